//! The interface monitor: links and addresses of the namespace the daemon
//! runs in. It owns no kernel objects; it only reads.
//!
//! Events come from an rtnetlink multicast subscription (links, IPv4 and
//! IPv6 addresses), preceded by a full dump that ends in
//! [`InterfaceEvent::InSync`]. The loop does not apply before that. Route
//! deletions come from a second subscription, so that the volume of route
//! notifications (our own writes among them) cannot crowd out link events.

pub mod netlink;

use ipnet::IpNet;

use crate::model::routes::RouteKey;

/// A change seen by the interface monitor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InterfaceEvent {
    /// A link exists with this state (sent for new links and for changes).
    Link {
        index: u32,
        name: String,
        up: bool,
        /// 0 when the kernel did not say.
        mtu: u32,
    },
    /// A link is gone.
    LinkRemoved { index: u32, name: String },
    /// An address was added to (or is present on) link `index`.
    AddrAdded { index: u32, addr: IpNet },
    /// An address was removed from link `index`.
    AddrRemoved { index: u32, addr: IpNet },
    /// A route was deleted (any table, anyone's): the routes backend
    /// forgets it if it was ours, and writes it again (someone's `ip route
    /// del`). From a socket of its own ([`netlink::run_route_deletions`]).
    RouteRemoved(RouteKey),
    /// The initial dump is complete.
    InSync,
}
