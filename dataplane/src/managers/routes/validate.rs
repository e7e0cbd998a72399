//! What the routes manager refuses (the manager's `check`): a block that
//! overlaps another node's, a VTEP without a usable MAC or parent address.

use std::net::IpAddr;

use super::*;

/// A MAC that can be a VTEP's: unicast and not all zeros.
fn check_mac(mac: &MacAddr, field: &str) -> Result<(), ValidationError> {
    if mac.0 == [0; 6] || mac.0[0] & 1 == 1 {
        return Err(ValidationError::new(
            field,
            format!("{mac} is not a unicast MAC address; a VTEP needs one"),
        ));
    }
    Ok(())
}

/// A VTEP's address of one family needs its MAC (unicast) and its parent
/// device's address; `fields` names them in the message.
fn check_vtep_family(
    addr: Option<IpAddr>,
    mac: Option<MacAddr>,
    parent: Option<IpAddr>,
    (mac_field, parent_field): (&str, &str),
    family: &str,
) -> Result<(), ValidationError> {
    if addr.is_none() {
        return Ok(());
    }
    let mac = mac.ok_or_else(|| {
        ValidationError::new(
            mac_field,
            format!("a VTEP with an {family} address needs a MAC"),
        )
    })?;
    check_mac(&mac, mac_field)?;
    if parent.is_none() {
        return Err(ValidationError::new(
            parent_field,
            format!("a VTEP with an {family} address needs its parent device's address"),
        ));
    }
    Ok(())
}

impl RoutesManager {
    /// What a message must satisfy beyond its own validation: the
    /// manager's `check`.
    pub(super) fn validate(&self, update: &Update) -> Result<(), ValidationError> {
        match update {
            Update::Route(r) => {
                if let Some(why) = self.covers_host(r) {
                    return Err(ValidationError::new("route_update.dst", why));
                }
                if let Some(o) = self.overlapping(r) {
                    return Err(ValidationError::new(
                        "route_update.dst",
                        format!(
                            "block {} overlaps block {} of node {:?}; IPAM blocks of different nodes cannot overlap",
                            r.dst,
                            o.dst,
                            o.dst_node_name.as_ref().map(Id::as_str).unwrap_or("")
                        ),
                    ));
                }
                Ok(())
            }
            Update::Vtep(v) => {
                check_vtep_family(
                    v.ipv4_addr,
                    v.mac,
                    v.parent_device_ip,
                    ("vtep_update.mac", "vtep_update.parent_device_ip"),
                    "IPv4",
                )?;
                check_vtep_family(
                    v.ipv6_addr,
                    v.mac_v6,
                    v.parent_device_ipv6,
                    ("vtep_update.mac_v6", "vtep_update.parent_device_ipv6"),
                    "IPv6",
                )?;
                if v.ipv4_addr.is_none() && v.ipv6_addr.is_none() {
                    return Err(ValidationError::new(
                        "vtep_update",
                        "a VTEP needs an IPv4 or an IPv6 address",
                    ));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Why route `r` must never be programmed: a default route, a range
    /// that is not unicast (whatever its type), or, for a route this
    /// manager programs (a local block's blackhole, a remote block), one
    /// that covers this node's own addresses or subnets (those of its
    /// uplinks and loopback as known now; looked at again when the route
    /// is worked out).
    pub(super) fn covers_host(&self, r: &Route) -> Option<String> {
        let programmed = if is_type(r, LOCAL_WORKLOAD) {
            !r.local_workload && !is_host_prefix(&r.dst)
        } else {
            is_type(r, REMOTE_WORKLOAD) || is_type(r, REMOTE_TUNNEL)
        };
        let own = if programmed {
            self.own_nets()
        } else {
            Vec::new()
        };
        crate::managers::hosts::covers_host(&r.dst, &own)
            .map(|why| format!("{why}: no route a feeder asks for may"))
    }

    /// This node's own addresses with their prefixes: every address of
    /// the interfaces that carry its underlay (each version's parent,
    /// even a /32 as some clouds give) and of the loopback, and every
    /// address elsewhere that stands for a subnet (a second NIC, a
    /// bridge). A host address (/32, /128) on another device is left out:
    /// the tunnels' (VXLAN, WireGuard, IPIP) lie in the workload blocks
    /// by design. IPv6 link-local addresses are every link's own.
    pub(super) fn own_nets(&self) -> Vec<IpNet> {
        let parents: Vec<&str> = [IpVersion::V4, IpVersion::V6]
            .into_iter()
            .filter_map(|v| self.parent(v).map(|(l, _)| l.name.as_str()))
            .chain(["lo"])
            .collect();
        self.links
            .values()
            .flat_map(|l| {
                let whole = parents.contains(&l.name.as_str());
                l.addrs.iter().filter(move |a| {
                    let link_local =
                        matches!(a, IpNet::V6(v6) if v6.addr().segments()[0] & 0xffc0 == 0xfe80);
                    !link_local && (whole || !is_host_prefix(a))
                })
            })
            .copied()
            .collect()
    }

    /// Blocks (not single addresses) of `dst`'s version that overlap `dst`
    /// without being it, and whose owner differs. Only a node's routes are
    /// blocks: a route of no node (an IP pool's CIDR, `CIDR_INFO`, which
    /// Felix sends for every pool) covers the blocks carved from it.
    pub(super) fn overlapping(&self, r: &Route) -> Option<&Route> {
        if is_host_prefix(&r.dst) || r.dst_node_name.is_none() {
            return None;
        }
        let another_nodes = |o: &&Route| {
            o.dst != r.dst
                && !is_host_prefix(&o.dst)
                && o.dst_node_name.is_some()
                && o.dst_node_name != r.dst_node_name
        };
        // Blocks that contain it: one candidate per shorter prefix.
        for len in 0..r.dst.prefix_len() {
            let sup = IpNet::new(r.dst.addr(), len)
                .expect("shorter than a valid prefix")
                .trunc();
            if let Some(o) = self.routes.get(&sup).filter(another_nodes) {
                return Some(o);
            }
        }
        // Blocks inside it: their addresses lie within it (nets order by
        // address, then prefix length).
        let (lo, hi) = (r.dst.network(), r.dst.broadcast());
        let from = IpNet::new(lo, 0).expect("prefix 0 is valid");
        let to = IpNet::new(hi, r.dst.max_prefix_len()).expect("the full prefix is valid");
        self.routes
            .range(from..=to)
            .map(|(_, o)| o)
            .filter(another_nodes)
            .find(|o| r.dst.contains(&o.dst))
    }
}
