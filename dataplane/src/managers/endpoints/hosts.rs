//! Which host endpoint polices which host interface, as Felix's
//! `endpoint_mgr.go` resolves it: an endpoint naming an interface takes
//! that interface; one without a name takes every interface holding one of
//! its expected addresses; where several match, the lowest id wins. An
//! all-interfaces (`*`) endpoint (again the lowest id) covers every other
//! interface. Workload interfaces are never host endpoints.

use std::collections::BTreeMap;

use super::EndpointsManager;
use crate::model::{HostEndpoint, HostEndpointId, HostInterface};

/// The outcome of resolving host endpoints against the interfaces present.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Resolved {
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

impl EndpointsManager {
    pub(super) fn is_workload_iface(&self, name: &str) -> bool {
        name.starts_with(self.cfg.workload_prefix.as_str())
    }

    fn matches(&self, hep: &HostEndpoint, iface: &str, index: Option<u32>) -> bool {
        match &hep.interface {
            HostInterface::Named(n) => n.as_str() == iface,
            HostInterface::All => false,
            HostInterface::ByAddress => {
                index.and_then(|i| self.addrs.get(&i)).is_some_and(|have| {
                    hep.expected_ipv4_addrs
                        .iter()
                        .chain(&hep.expected_ipv6_addrs)
                        .any(|a| have.contains(a))
                })
            }
        }
    }

    pub(super) fn resolve_hosts(&self) -> Resolved {
        let mut out = Resolved::default();
        let index_of: BTreeMap<&str, u32> =
            self.ifaces.iter().map(|(i, n)| (n.as_str(), *i)).collect();
        for iface in self.links.keys() {
            if self.is_workload_iface(iface) {
                continue;
            }
            let index = index_of.get(iface.as_str()).copied();
            // BTreeMap order: the first match is the lowest id.
            if let Some((id, _)) = self
                .hosts
                .iter()
                .find(|(_, h)| self.matches(h, iface, index))
            {
                out.named.insert(iface.clone(), id.clone());
            }
        }
        out.all = self
            .hosts
            .iter()
            .find(|(_, h)| h.interface == HostInterface::All)
            .map(|(id, _)| id.clone());
        out
    }
}
