//! What the workload interfaces give the routes and sysctls backends: a
//! /32 or /128 route to each workload whose interface exists, a static
//! neighbour for its IPv4 addresses when the MAC is known, and the
//! interface's sysctl knobs.
//!
//! Kept per interface ([`LinkShare`]), so that an endpoint or link that
//! changes costs its own interface's share (a patch of the backends'
//! desired state), not a pass over the node's 10,000 endpoints and their
//! 60,000 knobs. Everything is computed again only the first time and
//! after a failure.

use std::collections::{BTreeMap, BTreeSet};

use super::EndpointsManager;
use crate::backends::DesiredKernel;
use crate::backends::routes::RouteSource;
use crate::model::IpVersion;
use crate::model::routes::{Neighbour, RouteClass, RouteKey, RouteKind, RouteTarget};

/// One workload interface's routes, neighbours and knobs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct LinkShare {
    pub(super) routes: Vec<(RouteKey, RouteTarget)>,
    pub(super) neighbours: Vec<Neighbour>,
    pub(super) knobs: Vec<(String, &'static str)>,
}

impl LinkShare {
    fn is_empty(&self) -> bool {
        self.routes.is_empty() && self.neighbours.is_empty() && self.knobs.is_empty()
    }
}

/// The shares last handed to the backends.
#[derive(Debug, Default)]
pub(super) struct LinkShares {
    /// By interface name; an interface with nothing has none.
    by_link: BTreeMap<String, LinkShare>,
    /// The interfaces whose share has each route (two interfaces may
    /// claim one address): the first by name has it.
    claims: BTreeMap<RouteKey, BTreeSet<String>>,
    /// Whether the knobs were IPv6's too.
    ipv6: Option<bool>,
}

impl LinkShares {
    fn take(&mut self, name: &str) -> LinkShare {
        let old = self.by_link.remove(name).unwrap_or_default();
        for (k, _) in &old.routes {
            if let Some(c) = self.claims.get_mut(k) {
                c.remove(name);
                if c.is_empty() {
                    self.claims.remove(k);
                }
            }
        }
        old
    }

    fn put(&mut self, name: &str, share: LinkShare) {
        if share.is_empty() {
            return;
        }
        for (k, _) in &share.routes {
            self.claims.entry(*k).or_default().insert(name.to_string());
        }
        self.by_link.insert(name.to_string(), share);
    }

    /// Route `key` as the shares have it: its first claimer's.
    fn route(&self, key: &RouteKey) -> Option<RouteTarget> {
        let name = self.claims.get(key)?.first()?;
        let share = self.by_link.get(name)?;
        share
            .routes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, t)| t.clone())
    }

    /// Every route and neighbour of the shares.
    pub(super) fn routes(&self) -> (BTreeMap<RouteKey, RouteTarget>, BTreeSet<Neighbour>) {
        let routes = self
            .claims
            .keys()
            .filter_map(|k| Some((*k, self.route(k)?)))
            .collect();
        let neighbours = self
            .by_link
            .values()
            .flat_map(|s| s.neighbours.iter().cloned())
            .collect();
        (routes, neighbours)
    }

    fn knobs(&self) -> BTreeMap<String, &'static str> {
        self.by_link
            .values()
            .flat_map(|s| s.knobs.iter().cloned())
            .collect()
    }
}

impl EndpointsManager {
    /// Interface `name`'s share: nothing until the interface exists;
    /// then the routes and neighbours of the workload it serves (of
    /// several endpoints on one name, the active one's) and its knobs.
    /// IPv6 neighbours are left to NDP, as in Felix (its static entries
    /// are ARP only): the host solicits, the workload answers, and the
    /// ICMPv6 exception in `dph-INPUT` lets the answer through whatever
    /// the workload's egress policy says.
    /// A workload address that covers one of the node's own (`own`; it
    /// was refused when the endpoint came, but the node's addresses can
    /// change after) gets no route.
    pub(super) fn link_share(&self, name: &str, ipv6: bool, own: &[ipnet::IpNet]) -> LinkShare {
        let mut share = LinkShare::default();
        if !self.host_links.links.contains_key(name) {
            return share; // CNI has not made it yet; done when it appears
        }
        let Some(ep) = self
            .by_name
            .get(name)
            .and_then(|ids| ids.first())
            .and_then(|id| self.endpoints.get(id))
        else {
            return share;
        };
        let nets = ep
            .ipv4_nets
            .iter()
            .map(|n| ipnet::IpNet::V4(*n))
            .chain(ep.ipv6_nets.iter().map(|n| ipnet::IpNet::V6(*n)));
        for net in nets {
            if let Some(why) = crate::managers::hosts::covers_host(&net, own) {
                tracing::warn!(interface = name, %why, "a workload address is left unrouted");
                continue;
            }
            share.routes.push((
                RouteKey::main(net),
                RouteTarget {
                    class: RouteClass::LocalWorkload,
                    kind: RouteKind::Unicast,
                    dev: Some(name.to_string()),
                    gateway: None,
                    onlink: false,
                    protocol: self.cfg.device_route_protocol,
                    mtu: None,
                },
            ));
            if let Some(mac) = &ep.mac
                && matches!(net, ipnet::IpNet::V4(_))
                && net.prefix_len() == net.max_prefix_len()
            {
                share.neighbours.push(Neighbour {
                    addr: net.addr(),
                    dev: name.to_string(),
                    mac: *mac,
                });
            }
        }
        share.knobs = crate::backends::sysctl::workload_knobs(name, ipv6);
        share
    }

    /// Hands the backends the shares of the interfaces in `changed`, or
    /// (`all`) every interface's.
    pub(super) fn update_links(
        &mut self,
        kernel: &mut DesiredKernel,
        all: bool,
        changed: BTreeSet<String>,
    ) {
        let ipv6 = kernel
            .rule_tables_mut()
            .any(|t| t.version() == IpVersion::V6);
        let tunnels = self.tunnel_devices();
        let tunnels: Vec<&str> = tunnels.iter().map(String::as_str).collect();
        let own: Vec<ipnet::IpNet> = self
            .host_links
            .own_nets(&self.cfg.workload_prefix, &tunnels)
            .copied()
            .collect();
        if all || self.links.ipv6 != Some(ipv6) {
            let mut shares = LinkShares {
                ipv6: Some(ipv6),
                ..LinkShares::default()
            };
            for name in self.by_name.keys() {
                shares.put(name, self.link_share(name, ipv6, &own));
            }
            self.links = shares;
            if let Some(r) = &mut kernel.routes {
                let (routes, neighbours) = self.links.routes();
                r.set(RouteSource::Workloads, routes, neighbours);
            }
            if let Some(sc) = &mut kernel.sysctls {
                sc.set(self.links.knobs());
            }
            return;
        }
        let mut keys: BTreeSet<RouteKey> = BTreeSet::new();
        let mut neighbours: Vec<(Neighbour, bool)> = Vec::new();
        let mut knobs: Vec<(String, Option<&'static str>)> = Vec::new();
        for name in changed {
            let new = self.link_share(&name, ipv6, &own);
            let old = self.links.take(&name);
            keys.extend(old.routes.iter().chain(&new.routes).map(|(k, _)| *k));
            let gone = old
                .neighbours
                .iter()
                .filter(|n| !new.neighbours.contains(n));
            neighbours.extend(gone.map(|n| (n.clone(), false)));
            let came = new
                .neighbours
                .iter()
                .filter(|n| !old.neighbours.contains(n));
            neighbours.extend(came.map(|n| (n.clone(), true)));
            let dropped = old
                .knobs
                .iter()
                .filter(|(k, _)| !new.knobs.iter().any(|(n, _)| n == k));
            knobs.extend(dropped.map(|(k, _)| (k.clone(), None)));
            knobs.extend(new.knobs.iter().map(|(k, v)| (k.clone(), Some(*v))));
            self.links.put(&name, new);
        }
        if let Some(r) = &mut kernel.routes {
            let routes = keys.into_iter().map(|k| (k, self.links.route(&k)));
            r.patch(RouteSource::Workloads, routes, neighbours);
        }
        if let Some(sc) = &mut kernel.sysctls {
            sc.patch(knobs);
        }
    }
}
