//! The endpoints manager's side of host-endpoint resolution (see
//! [`crate::managers::hosts`]).

use super::EndpointsManager;
use crate::managers::hosts::{Interfaces, Resolved, resolve};

impl EndpointsManager {
    pub(super) fn resolve_hosts(&self) -> Resolved {
        resolve(
            &self.hosts,
            Interfaces {
                links: &self.links,
                ifaces: &self.ifaces,
                addrs: &self.addrs,
            },
            &self.cfg.workload_prefix,
        )
    }
}
