//! What the dataplane reports upwards: the events the loop sends to its
//! watchers (converted to `felix.FromDataplane` at the edge) and the
//! status-detail key of an isolated object. Below the managers and
//! backends, which make these, and the sync loop, which sends them. No
//! kernel objects.

/// What the loop reports (converted to `felix.FromDataplane` at the edge).
#[derive(Debug, Clone, PartialEq)]
pub enum StatusEvent {
    DataplaneInSync,
    ProcessStatus {
        iso_timestamp: String,
        uptime: f64,
    },
    /// A workload endpoint's status changed: `up`, `down` or `error`;
    /// with the endpoint as it stands (Felix's endpoint-status files name
    /// its interface, MAC and nets).
    WorkloadEndpointStatus {
        id: crate::model::WorkloadEndpointId,
        status: &'static str,
        endpoint: Box<crate::model::WorkloadEndpoint>,
    },
    /// A workload endpoint is gone.
    WorkloadEndpointStatusRemove {
        id: crate::model::WorkloadEndpointId,
    },
    /// A host endpoint's status changed: `up` or `down`.
    HostEndpointStatus {
        id: crate::model::HostEndpointId,
        status: &'static str,
    },
    /// A host endpoint is gone.
    HostEndpointStatusRemove {
        id: crate::model::HostEndpointId,
    },
    /// This node's WireGuard public key for one IP version (base64; empty
    /// when WireGuard is off or cannot run). Sent when it changes; a new
    /// watcher gets the current ones first ([`Status::wireguard_keys`]).
    WireguardStatus {
        ip_version: crate::model::IpVersion,
        public_key: String,
    },
}

/// The prefix of the status details that name an object the dataplane
/// could not program and isolated (`isolated.policy.<id>`: why, and
/// whether it is kept at its last good state or fail-closed); counted in
/// the `int_dataplane_isolated_objects` gauge.
pub const ISOLATED: &str = "isolated.";
