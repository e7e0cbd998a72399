//! The real [`RouteSeam`]: rtnetlink in the daemon's namespace, one socket
//! owned by the routes backend (see [`crate::backends::netlink`]).
//!
//! Writes are pipelined: up to [`IN_FLIGHT`] requests wait for their
//! acknowledgement at once, so a batch costs the kernel's work rather than
//! one round trip per route (`ip -batch` waits for each).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::{StreamExt, TryStreamExt};
use ipnet::IpNet;
use netlink_packet_route::AddressFamily;
use netlink_packet_route::link::LinkAttribute;
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteMetric,
    RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::RouteMessageBuilder;

use super::kernel::{KernelFdb, KernelNeighbour, KernelRoute, Link, RouteOp, RouteSeam};
use crate::backends::BackendError;
use crate::backends::netlink::{Netlink, errno};
use crate::model::MacAddr;
use crate::model::routes::RouteKey;

/// Requests awaiting their acknowledgement at once.
pub const IN_FLIGHT: usize = 64;

const ESRCH: i32 = 3;
const ENOENT: i32 = 2;

#[derive(Debug)]
pub struct RouteNetlink {
    nl: Netlink,
}

impl RouteNetlink {
    pub fn open() -> Result<Self, BackendError> {
        Ok(Self {
            nl: Netlink::open("routes")?,
        })
    }
}

fn ip_of(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

/// A dumped route in our terms; `None` for what we never own (multicast
/// families, malformed prefixes).
pub fn from_message(m: &RouteMessage) -> Option<KernelRoute> {
    let h = &m.header;
    let mut dst = None;
    let mut table = u32::from(h.table);
    let (mut oif, mut gateway, mut metric, mut mtu) = (None, None, 0, None);
    for a in &m.attributes {
        match a {
            RouteAttribute::Destination(d) => dst = ip_of(d),
            RouteAttribute::Gateway(g) => gateway = ip_of(g),
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::Priority(p) => metric = *p,
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Metrics(ms) => {
                for x in ms {
                    if let RouteMetric::Mtu(v) = x {
                        mtu = Some(*v);
                    }
                }
            }
            _ => {}
        }
    }
    let dst = match (h.address_family, dst) {
        (_, Some(ip)) => IpNet::new(ip, h.destination_prefix_length).ok()?,
        (AddressFamily::Inet, None) => IpNet::new(Ipv4Addr::UNSPECIFIED.into(), 0).ok()?,
        (AddressFamily::Inet6, None) => IpNet::new(Ipv6Addr::UNSPECIFIED.into(), 0).ok()?,
        _ => return None,
    };
    let kind = u8::from(h.kind);
    // IPv6 special routes (blackhole, unreachable, prohibit, throw) come
    // back on `lo`; they have no device.
    if matches!(kind, 6..=9) {
        oif = None;
    }
    let mut key = RouteKey::new(table, dst, metric);
    key.tos = h.tos;
    Some(KernelRoute {
        key,
        kind,
        oif,
        gateway,
        onlink: h.flags.contains(RouteFlags::Onlink),
        scope: u8::from(h.scope),
        protocol: u8::from(h.protocol),
        mtu,
    })
}

fn base_message(key: &RouteKey) -> RouteMessage {
    let mut m = match key.dst {
        IpNet::V4(n) => RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(n.addr(), n.prefix_len())
            .build(),
        IpNet::V6(n) => RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(n.addr(), n.prefix_len())
            .build(),
    };
    m.header.tos = key.tos;
    // Tables above 255 only fit the attribute; the header says "see it".
    m.header.table = u8::try_from(key.table).unwrap_or(RouteHeader::RT_TABLE_UNSPEC);
    m.attributes.push(RouteAttribute::Table(key.table));
    m.attributes.push(RouteAttribute::Priority(key.metric));
    m
}

fn to_message(r: &KernelRoute) -> RouteMessage {
    let mut m = base_message(&r.key);
    m.header.kind = RouteType::from(r.kind);
    m.header.scope = RouteScope::from(r.scope);
    m.header.protocol = RouteProtocol::from(r.protocol);
    if r.onlink {
        m.header.flags |= RouteFlags::Onlink;
    }
    if let Some(i) = r.oif {
        m.attributes.push(RouteAttribute::Oif(i));
    }
    if let Some(g) = r.gateway {
        m.attributes.push(RouteAttribute::Gateway(g.into()));
    }
    if let Some(mtu) = r.mtu {
        m.attributes
            .push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(mtu)]));
    }
    m
}

/// A deletion template: the key, with protocol, scope and type wildcards
/// (Felix's `deleteRoute`, from reading the kernel and `ip route del`).
fn delete_message(key: &RouteKey) -> RouteMessage {
    let mut m = base_message(key);
    m.header.protocol = RouteProtocol::Unspec;
    m.header.scope = RouteScope::NoWhere;
    m.header.kind = RouteType::Unspec;
    m
}

fn neighbour_message(
    family: AddressFamily,
    ifindex: u32,
    addr: Option<IpAddr>,
    mac: Option<MacAddr>,
) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = family;
    m.header.ifindex = ifindex;
    m.header.state = NeighbourState::Permanent;
    if family == AddressFamily::Bridge {
        m.header.flags = NeighbourFlags::Own; // NTF_SELF: the device's own FDB
    }
    if let Some(a) = addr {
        m.attributes.push(NeighbourAttribute::Destination(match a {
            IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
            IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
        }));
    }
    if let Some(mac) = mac {
        m.attributes
            .push(NeighbourAttribute::LinkLayerAddress(mac.0.to_vec()));
    }
    m
}

fn family_of(a: IpAddr) -> AddressFamily {
    match a {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

fn neighbour_fields(m: &NeighbourMessage) -> (Option<IpAddr>, Option<MacAddr>) {
    let (mut addr, mut mac) = (None, None);
    for a in &m.attributes {
        match a {
            NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => {
                addr = Some(IpAddr::V4(*v4))
            }
            NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => {
                addr = Some(IpAddr::V6(*v6))
            }
            // An FDB entry's (AF_BRIDGE) destination is not parsed by
            // family: raw bytes.
            NeighbourAttribute::Destination(NeighbourAddress::Other(b)) => {
                addr = match b.len() {
                    4 => <[u8; 4]>::try_from(b.as_slice()).ok().map(IpAddr::from),
                    16 => <[u8; 16]>::try_from(b.as_slice()).ok().map(IpAddr::from),
                    _ => None,
                }
            }
            NeighbourAttribute::LinkLayerAddress(l) => {
                mac = <[u8; 6]>::try_from(l.as_slice()).ok().map(MacAddr)
            }
            _ => {}
        }
    }
    (addr, mac)
}

impl RouteSeam for RouteNetlink {
    fn links(&mut self) -> Result<Vec<Link>, BackendError> {
        let h = self.nl.handle();
        let msgs: Vec<_> = self
            .nl
            .block_on(h.link().get().execute().try_collect())
            .map_err(|e| self.nl.error("dumping links", e))?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| {
                let name = m.attributes.iter().find_map(|a| match a {
                    LinkAttribute::IfName(n) => Some(n.clone()),
                    _ => None,
                })?;
                Some(Link {
                    index: m.header.index,
                    name,
                })
            })
            .collect())
    }

    fn routes(&mut self) -> Result<Vec<KernelRoute>, BackendError> {
        let mut out = Vec::new();
        for req in [
            RouteMessageBuilder::<Ipv4Addr>::new().build(),
            RouteMessageBuilder::<Ipv6Addr>::new().build(),
        ] {
            let h = self.nl.handle();
            let msgs: Vec<RouteMessage> = self
                .nl
                .block_on(h.route().get(req).execute().try_collect())
                .map_err(|e| self.nl.error("dumping routes", e))?;
            out.extend(msgs.iter().filter_map(from_message));
        }
        Ok(out)
    }

    fn neighbours(&mut self) -> Result<(Vec<KernelNeighbour>, Vec<KernelFdb>), BackendError> {
        let (mut neighbours, mut fdb) = (Vec::new(), Vec::new());
        for family in [
            AddressFamily::Inet,
            AddressFamily::Inet6,
            AddressFamily::Bridge,
        ] {
            let h = self.nl.handle();
            let msgs: Vec<NeighbourMessage> = self
                .nl
                .block_on(
                    h.neighbours()
                        .get()
                        .set_address_family(family)
                        .execute()
                        .try_collect(),
                )
                .map_err(|e| self.nl.error("dumping neighbours", e))?;
            for m in msgs {
                let (addr, mac) = neighbour_fields(&m);
                if family == AddressFamily::Bridge {
                    if let Some(mac) = mac
                        && m.header.state == NeighbourState::Permanent
                    {
                        fdb.push(KernelFdb {
                            ifindex: m.header.ifindex,
                            mac,
                            dst: addr,
                        });
                    }
                } else if let Some(addr) = addr {
                    neighbours.push(KernelNeighbour {
                        ifindex: m.header.ifindex,
                        addr,
                        mac,
                        permanent: m.header.state == NeighbourState::Permanent,
                    });
                }
            }
        }
        Ok((neighbours, fdb))
    }

    fn write(&mut self, ops: &[RouteOp]) -> Vec<(usize, BackendError)> {
        let h = self.nl.handle();
        let one = |i: usize, op: &RouteOp| {
            let h = h.clone();
            let op = op.clone();
            async move {
                let r = match &op {
                    RouteOp::ReplaceRoute(r) => {
                        h.route().add(to_message(r)).replace().execute().await
                    }
                    RouteOp::DeleteRoute(k) => {
                        match h.route().del(delete_message(k)).execute().await {
                            // Already gone (with its device, or by hand).
                            Err(e) if errno(&e) == Some(ESRCH) => Ok(()),
                            r => r,
                        }
                    }
                    RouteOp::ReplaceNeighbour { ifindex, addr, mac } => {
                        let mut req = h.neighbours().add(*ifindex, *addr).replace();
                        *req.message_mut() =
                            neighbour_message(family_of(*addr), *ifindex, Some(*addr), Some(*mac));
                        req.execute().await
                    }
                    RouteOp::DeleteNeighbour { ifindex, addr } => {
                        let m = neighbour_message(family_of(*addr), *ifindex, Some(*addr), None);
                        match h.neighbours().del(m).execute().await {
                            Err(e) if errno(&e) == Some(ENOENT) => Ok(()),
                            r => r,
                        }
                    }
                    RouteOp::AddFdb(f) => {
                        let mut req = h.neighbours().add_bridge(f.ifindex, &f.mac.0).replace();
                        *req.message_mut() =
                            neighbour_message(AddressFamily::Bridge, f.ifindex, f.dst, Some(f.mac));
                        req.execute().await
                    }
                    RouteOp::DeleteFdb(f) => {
                        let m =
                            neighbour_message(AddressFamily::Bridge, f.ifindex, f.dst, Some(f.mac));
                        match h.neighbours().del(m).execute().await {
                            Err(e) if errno(&e) == Some(ENOENT) => Ok(()),
                            r => r,
                        }
                    }
                };
                (i, op, r)
            }
        };
        let results: Vec<_> = self.nl.block_on(
            futures::stream::iter(ops.iter().enumerate().map(|(i, op)| one(i, op)))
                .buffer_unordered(IN_FLIGHT)
                .collect(),
        );
        results
            .into_iter()
            .filter_map(|(i, op, r)| r.err().map(|e| (i, self.nl.error(format!("{op:?}"), e))))
            .collect()
    }
}
