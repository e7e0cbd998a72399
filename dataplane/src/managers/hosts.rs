//! Which host endpoint polices which host interface, as Felix's
//! `endpoint_mgr.go` resolves it: an endpoint naming an interface takes
//! that interface; one without a name takes every interface holding one of
//! its expected addresses; where several match, the lowest id wins. An
//! all-interfaces (`*`) endpoint (again the lowest id) covers every other
//! interface. Workload interfaces are never host endpoints. Shared by the
//! endpoints manager (iptables) and the XDP manager.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::model::{HostEndpoint, HostEndpointId, HostInterface};

/// The outcome of resolving host endpoints against the interfaces present.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Resolved {
    /// Interface name → the host endpoint policing it.
    pub named: BTreeMap<String, HostEndpointId>,
    /// The all-interfaces endpoint, if any.
    pub all: Option<HostEndpointId>,
}

impl Resolved {
    /// The interfaces `id` polices (`None` for the all-interfaces one).
    pub fn interfaces_of<'a>(&'a self, id: &'a HostEndpointId) -> impl Iterator<Item = &'a str> {
        self.named
            .iter()
            .filter(move |(_, h)| *h == id)
            .map(|(n, _)| n.as_str())
    }
}

/// The host's links and addresses, kept from the interface monitor's
/// events.
#[derive(Debug, Default, Clone)]
pub struct HostLinks {
    /// Name → up.
    pub links: BTreeMap<String, bool>,
    /// Index → name.
    pub ifaces: BTreeMap<u32, String>,
    /// Index → addresses.
    pub addrs: BTreeMap<u32, BTreeSet<IpAddr>>,
    /// Index → addresses with their prefix (the subnets they stand in).
    pub nets: BTreeMap<u32, BTreeSet<ipnet::IpNet>>,
}

/// What an event changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LinkChange {
    /// Links that appeared, went or were renamed away from.
    pub links: Vec<String>,
    /// Addresses changed.
    pub addrs: bool,
}

impl HostLinks {
    pub fn apply(&mut self, event: &crate::interfaces::InterfaceEvent) -> LinkChange {
        use crate::interfaces::InterfaceEvent as E;
        let mut c = LinkChange::default();
        match event {
            E::Link {
                index, name, up, ..
            } => {
                if let Some(old) = self.ifaces.insert(*index, name.clone())
                    && old != *name
                {
                    self.links.remove(&old);
                    c.links.push(old);
                }
                // A link appeared; up/down alone is no change of presence.
                if self.links.insert(name.clone(), *up).is_none() {
                    c.links.push(name.clone());
                }
            }
            E::LinkRemoved { index, name } => {
                self.ifaces.remove(index);
                self.addrs.remove(index);
                self.nets.remove(index);
                self.links.remove(name);
                c.links.push(name.clone());
            }
            E::AddrAdded { index, addr } => {
                c.addrs = self.addrs.entry(*index).or_default().insert(addr.addr());
                self.nets.entry(*index).or_default().insert(*addr);
            }
            E::AddrRemoved { index, addr } => {
                if let Some(n) = self.nets.get_mut(index) {
                    n.remove(addr);
                }
                c.addrs = self
                    .addrs
                    .get_mut(index)
                    .is_some_and(|a| a.remove(&addr.addr()));
            }
            E::InSync | E::RouteRemoved(_) => {}
        }
        c
    }

    /// The node's own addresses, with their prefixes: those of every link
    /// but the workload interfaces and the tunnel devices in `tunnels`
    /// (whose addresses lie in the workload blocks by design).
    pub fn own_nets<'a>(
        &'a self,
        workload_prefix: &'a str,
        tunnels: &'a [&'a str],
    ) -> impl Iterator<Item = &'a ipnet::IpNet> {
        self.nets
            .iter()
            .filter(move |(i, _)| {
                self.ifaces.get(i).is_some_and(|n| {
                    !n.starts_with(workload_prefix) && !tunnels.contains(&n.as_str())
                })
            })
            .flat_map(|(_, n)| n)
    }

    pub fn interfaces(&self) -> Interfaces<'_> {
        Interfaces {
            links: &self.links,
            ifaces: &self.ifaces,
            addrs: &self.addrs,
        }
    }
}

/// Why `net` may not be routed to a workload, nor by a route a feeder
/// asks for: a default route (it would replace the node's own), a range
/// that is not unicast, or one that covers an address of the node (so any
/// that covers one of its subnets; `own`: the node's addresses with their
/// prefixes); `None` when it may. A narrower range inside a node's subnet
/// that misses its addresses is allowed (a pod address from the node's
/// subnet, as some IPAMs hand out).
pub fn covers_host<'a>(
    net: &ipnet::IpNet,
    own: impl IntoIterator<Item = &'a ipnet::IpNet>,
) -> Option<String> {
    if net.prefix_len() == 0 {
        return Some(format!(
            "{net} is a default route: it would replace this node's own"
        ));
    }
    let a = net.network();
    let special = match a {
        IpAddr::V4(v4) => {
            v4.is_loopback() || v4.is_multicast() || v4.is_broadcast() || v4.octets()[0] == 0
        }
        IpAddr::V6(v6) => v6.is_loopback() || v6.is_multicast() || v6.is_unspecified(),
    };
    if special {
        return Some(format!("{net} is not a unicast range"));
    }
    // A range that covers one of the node's subnets covers its address
    // there too.
    own.into_iter().find(|o| net.contains(&o.addr())).map(|o| {
        format!(
            "{net} covers {}, an address of this node (on {})",
            o.addr(),
            o.trunc()
        )
    })
}

/// The host's interfaces as the interface monitor reports them.
#[derive(Debug, Clone, Copy)]
pub struct Interfaces<'a> {
    /// Name → up.
    pub links: &'a BTreeMap<String, bool>,
    /// Index → name.
    pub ifaces: &'a BTreeMap<u32, String>,
    /// Index → addresses.
    pub addrs: &'a BTreeMap<u32, BTreeSet<IpAddr>>,
}

fn matches(hep: &HostEndpoint, iface: &str, addrs: Option<&BTreeSet<IpAddr>>) -> bool {
    match &hep.interface {
        HostInterface::Named(n) => n.as_str() == iface,
        HostInterface::All => false,
        HostInterface::ByAddress => addrs.is_some_and(|have| {
            hep.expected_ipv4_addrs
                .iter()
                .chain(&hep.expected_ipv6_addrs)
                .any(|a| have.contains(a))
        }),
    }
}

/// Resolves `hosts` against the interfaces present (workload interfaces,
/// named with `workload_prefix`, excepted).
pub fn resolve(
    hosts: &BTreeMap<HostEndpointId, HostEndpoint>,
    i: Interfaces<'_>,
    workload_prefix: &str,
) -> Resolved {
    let mut out = Resolved::default();
    let index_of: BTreeMap<&str, u32> = i.ifaces.iter().map(|(k, n)| (n.as_str(), *k)).collect();
    for iface in i.links.keys() {
        if iface.starts_with(workload_prefix) {
            continue;
        }
        let addrs = index_of.get(iface.as_str()).and_then(|k| i.addrs.get(k));
        // BTreeMap order: the first match is the lowest id.
        if let Some((id, _)) = hosts.iter().find(|(_, h)| matches(h, iface, addrs)) {
            out.named.insert(iface.clone(), id.clone());
        }
    }
    out.all = hosts
        .iter()
        .find(|(_, h)| h.interface == HostInterface::All)
        .map(|(id, _)| id.clone());
    out
}
