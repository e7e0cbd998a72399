//! The interface monitor: links and addresses of the namespace the daemon
//! runs in. It owns no kernel objects; it only reads.
//!
//! Events come from an rtnetlink multicast subscription (links, IPv4 and
//! IPv6 addresses), preceded by a full dump that ends in
//! [`InterfaceEvent::InSync`]. The loop does not apply before that.

pub mod netlink;

use ipnet::IpNet;

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
    /// The initial dump is complete.
    InSync,
}
