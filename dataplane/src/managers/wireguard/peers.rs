//! The full pass: which nodes are peers (an endpoint and a key no other
//! node claims, not ours), each version's device, table and rule; and the
//! one-destination route and one-node peer that the incremental path
//! shares with it.

use super::*;

impl WireguardManager {
    /// Works out one version's device, table and rule.
    pub(super) fn desired(
        &mut self,
        v: IpVersion,
        s: &WgSettings,
    ) -> (WgDevice, BTreeMap<RouteKey, RouteTarget>, IpRule) {
        let i = idx(v);
        let own = self.hostname().to_string();
        let endpoints = &self.endpoints[i];
        let own_key = self.own_keys[i].clone();
        // Who claims which key.
        let mut claims: BTreeMap<[u8; 32], Vec<&str>> = BTreeMap::new();
        for (node, e) in endpoints {
            if let Some(k) = e.public_key.filter(|k| *k != [0; 32])
                && node.as_str() != own
            {
                claims.entry(k).or_default().push(node.as_str());
            }
        }
        let mut not_programmed = BTreeMap::new();
        let mut peers: BTreeMap<Id, (PublicKey, SocketAddr)> = BTreeMap::new();
        let mut nodes: BTreeSet<&Id> = endpoints.keys().collect();
        nodes.extend(self.routes.values());
        for node in nodes {
            if node.as_str() == own {
                continue;
            }
            let key = endpoints
                .get(node)
                .and_then(|e| e.public_key)
                .filter(|k| *k != [0; 32]);
            let addr = self.hosts.get(node).and_then(|h| match v {
                IpVersion::V4 => h.ipv4_addr,
                IpVersion::V6 => h.ipv6_addr,
            });
            let why = match (key, addr) {
                (None, _) => Some("no WireGuard key".to_string()),
                (_, None) => Some(format!("no {} endpoint address", label(v))),
                (Some(k), Some(_)) => {
                    let others: Vec<&str> = claims[&k]
                        .iter()
                        .copied()
                        .filter(|n| *n != node.as_str())
                        .collect();
                    let b64 = PublicKey(k).to_base64();
                    if !others.is_empty() {
                        Some(format!("key {b64} also claimed by {}", others.join(", ")))
                    } else if own_key.as_deref() == Some(b64.as_str()) {
                        Some(format!("key {b64} is this node's own"))
                    } else {
                        None
                    }
                }
            };
            match why {
                Some(w) => {
                    not_programmed.insert(node.to_string(), w);
                }
                None => {
                    let (Some(k), Some(a)) = (key, addr) else {
                        continue;
                    };
                    peers.insert(node.clone(), (PublicKey(k), SocketAddr::new(a, s.port)));
                }
            }
        }
        self.peers[i] = peers;
        self.local_blocks = self
            .routes
            .iter()
            .filter(|(d, n)| n.as_str() == own && d.prefix_len() < d.max_prefix_len())
            .map(|(d, _)| *d)
            .collect();
        let table: BTreeMap<RouteKey, RouteTarget> = self
            .routes
            .keys()
            .filter(|d| version_of(d) == v)
            .flat_map(|d| self.routes_of(v, d, &s.iface))
            .filter_map(|(k, t)| Some((k, t?)))
            .collect();
        let peers: BTreeMap<PublicKey, WgPeer> = self.peers[i]
            .iter()
            .map(|(node, (k, ep))| (*k, self.peer(v, node, *ep)))
            .collect();
        // The least MTU the device's family can carry (IPv6 needs 1280).
        let (overhead, host, least) = match v {
            IpVersion::V4 => (OVERHEAD_V4, self.host_mtu(), 68),
            IpVersion::V6 => (OVERHEAD_V6, self.host_mtu(), 1280),
        };
        // A host interface under the overhead (an MTU of 68 is valid)
        // gives the least, never a wrapped number.
        let mtu = s.mtu.unwrap_or_else(|| {
            host.unwrap_or(DEFAULT_HOST_MTU)
                .saturating_sub(overhead)
                .max(least)
        });
        let addr = self.endpoints[i]
            .get(own.as_str())
            .and_then(|e| e.interface_addr)
            .filter(|a| IpVersion::of(a) == v);
        let table_index = self.table(v);
        let summary = &mut self.summary[i];
        summary.clear();
        summary.insert(
            "mtu",
            match (s.mtu, host) {
                (Some(m), _) => format!("{m} (configured)"),
                (None, Some(h)) => format!("{mtu} (host interface {h} - {overhead})"),
                (None, None) => {
                    format!("{mtu} (host interface not known yet: {DEFAULT_HOST_MTU} - {overhead})")
                }
            },
        );
        summary.insert(
            "address",
            addr.map_or_else(
                || "none yet (no WireguardEndpointUpdate for this node)".into(),
                |a| a.to_string(),
            ),
        );
        summary.insert("table", table_index.to_string());
        self.not_programmed[i] = not_programmed;
        let rule = IpRule {
            v6: v == IpVersion::V6,
            priority: self.rule_priority(),
            fwmark: Some((self.cfg.fwmark, self.cfg.fwmark)),
            invert: true,
            src: None,
            table: self.table(v),
        };
        (
            WgDevice {
                version: v,
                name: s.iface.clone(),
                port: s.port,
                fwmark: self.cfg.fwmark,
                mtu,
                addr,
                peers,
            },
            table,
            rule,
        )
    }

    /// The route in version `v`'s table for `dst`: into the device when
    /// its node is a peer, `throw` otherwise and for this node's own (a
    /// workload's address inside one of this node's blocks needs none).
    pub(super) fn target(&self, v: IpVersion, dst: &IpNet, iface: &str) -> Option<RouteTarget> {
        let node = self.routes.get(dst)?;
        if version_of(dst) != v {
            return None;
        }
        let mut t = RouteTarget {
            class: RouteClass::Wireguard,
            kind: RouteKind::Throw,
            dev: None,
            gateway: None,
            onlink: false,
            protocol: self.cfg.device_protocol,
            mtu: None,
        };
        if node.as_str() == self.hostname() {
            let covered = dst.prefix_len() == dst.max_prefix_len()
                && self.local_blocks.iter().any(|b| b.contains(dst));
            return (!covered).then_some(t);
        }
        if self.peers[idx(v)].contains_key(node) {
            t.kind = RouteKind::Unicast;
            t.dev = Some(iface.to_string());
        }
        Some(t)
    }

    /// The routes of `dst` in version `v`'s table: [`Self::target`], and
    /// behind a route into the device a blackhole (a higher metric) that
    /// takes over when the device's route is gone (the device deleted,
    /// its wireguard-go dead, until it is made again): pod traffic to a
    /// peer is dropped then, never sent in clear through the next rule's
    /// tables (VXLAN, the underlay), which is what Felix's table does. Only
    /// once this node has a key out: where WireGuard cannot run at all,
    /// nothing is held back.
    pub(super) fn routes_of(
        &self,
        v: IpVersion,
        dst: &IpNet,
        iface: &str,
    ) -> [(RouteKey, Option<RouteTarget>); 2] {
        let table = self.table(v);
        let target = self.target(v, dst, iface);
        let running = self.own_keys[idx(v)]
            .as_deref()
            .is_some_and(|k| !k.is_empty());
        let fallback = target
            .as_ref()
            .filter(|t| running && t.kind == RouteKind::Unicast)
            .map(|t| RouteTarget {
                kind: RouteKind::Blackhole,
                dev: None,
                ..t.clone()
            });
        [
            (RouteKey::new(table, *dst, 0), target),
            (RouteKey::new(table, *dst, FAIL_CLOSED_METRIC), fallback),
        ]
    }

    /// A programmed node as a peer: its share of version `v` as allowed
    /// IPs.
    pub(super) fn peer(&self, v: IpVersion, node: &Id, endpoint: SocketAddr) -> WgPeer {
        WgPeer {
            node: node.to_string(),
            endpoint,
            allowed_ips: self
                .by_node
                .get(node)
                .map(|d| d.iter().filter(|d| version_of(d) == v).copied().collect())
                .unwrap_or_default(),
        }
    }
}
