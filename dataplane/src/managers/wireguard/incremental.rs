//! A `RouteUpdate` or `RouteRemove` worked out alone: the route of that
//! destination in the WireGuard table and the allowed IPs of the peers it
//! moved between; what a full pass must decide (a node seen for the first
//! time, this node's own blocks) falls back to one.

use super::*;

impl WireguardManager {
    /// Only some destinations changed: their routes, and the allowed IPs
    /// of their nodes' peers.
    pub(super) fn incremental(&mut self, kernel: &mut DesiredKernel) {
        let dsts = std::mem::take(&mut self.dirty_dsts);
        let nodes = std::mem::take(&mut self.dirty_nodes);
        for v in [IpVersion::V4, IpVersion::V6] {
            let s = self.settings(v);
            if !s.enabled {
                continue;
            }
            if let Some(r) = &mut kernel.routes {
                for dst in dsts.iter().filter(|d| version_of(d) == v) {
                    for (key, target) in self.routes_of(v, dst, &s.iface) {
                        r.update(RouteSource::Wireguard, key, target);
                    }
                }
            }
            if let Some(wg) = &mut kernel.wireguard {
                for node in &nodes {
                    if let Some((k, ep)) = self.peers[idx(v)].get(node) {
                        wg.update_peer(v, *k, self.peer(v, node, *ep));
                    }
                }
            }
        }
    }

    /// A destination of `node`'s share came or went.
    pub(super) fn route_changed(&mut self, dst: IpNet, old: Option<Id>, new: Option<&Id>) {
        if let Some(o) = &old
            && let Some(set) = self.by_node.get_mut(o)
        {
            set.remove(&dst);
            if set.is_empty() {
                self.by_node.remove(o);
            }
        }
        if let Some(n) = new {
            self.by_node.entry(n.clone()).or_default().insert(dst);
        }
        let own = self.hostname();
        let is_own = |n: Option<&Id>| n.is_some_and(|n| n.as_str() == own);
        // This node's block decides which of its addresses need a route; a
        // node seen for the first time may be a peer: everything again.
        let new_node = new.is_some_and(|n| !self.peers_or_known(n));
        if (dst.prefix_len() < dst.max_prefix_len() && (is_own(old.as_ref()) || is_own(new)))
            || new_node
        {
            self.all_dirty = true;
            return;
        }
        self.dirty_dsts.insert(dst);
        self.dirty_nodes.extend(old);
        self.dirty_nodes.extend(new.cloned());
    }

    /// Whether the last full pass knew `node` (as a peer or not).
    pub(super) fn peers_or_known(&self, node: &Id) -> bool {
        node.as_str() == self.hostname()
            || self.peers.iter().any(|p| p.contains_key(node))
            || self
                .not_programmed
                .iter()
                .any(|n| n.contains_key(node.as_str()))
    }
}
