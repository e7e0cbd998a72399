//! The endpoints manager's side of host-endpoint resolution (see
//! [`crate::managers::hosts`]).

use super::EndpointsManager;
use crate::managers::hosts::{Resolved, resolve};

impl EndpointsManager {
    pub(super) fn resolve_hosts(&self) -> Resolved {
        resolve(
            &self.hosts,
            self.host_links.interfaces(),
            &self.cfg.workload_prefix,
        )
    }
}
