//! The kernel's side of the routes backend: routes, neighbours and FDB
//! entries as the kernel holds them (devices by index), the writes, the
//! seam, and which of them are ours.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::backends::BackendError;
use crate::model::MacAddr;
use crate::model::routes::{MAIN_TABLE, RouteKey, RouteKind, RouteScope, RouteTarget};

/// Kernel route types (`RTN_*`) and scopes (`RT_SCOPE_*`) we read and
/// write.
pub const RTN_UNICAST: u8 = 1;
pub const RTN_BLACKHOLE: u8 = 6;
pub const RTN_THROW: u8 = 9;
pub const RT_SCOPE_UNIVERSE: u8 = 0;
pub const RT_SCOPE_LINK: u8 = 253;

/// A link as the backend sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
}

/// A route as the kernel holds it (devices by index).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelRoute {
    pub key: RouteKey,
    /// `RTN_*`.
    pub kind: u8,
    pub oif: Option<u32>,
    pub gateway: Option<IpAddr>,
    pub onlink: bool,
    /// `RT_SCOPE_*`.
    pub scope: u8,
    pub protocol: u8,
    pub mtu: Option<u32>,
}

/// The kernel form of a desired route.
pub fn kernel_route(key: RouteKey, t: &RouteTarget, oif: Option<u32>) -> KernelRoute {
    KernelRoute {
        key,
        kind: match t.kind {
            RouteKind::Unicast => RTN_UNICAST,
            RouteKind::Blackhole => RTN_BLACKHOLE,
            RouteKind::Throw => RTN_THROW,
        },
        oif,
        gateway: t.gateway,
        onlink: t.onlink,
        // IPv6 routes have no scope: the kernel reports universe for all.
        scope: match (t.scope(), key.dst) {
            (RouteScope::Link, IpNet::V4(_)) => RT_SCOPE_LINK,
            _ => RT_SCOPE_UNIVERSE,
        },
        protocol: t.protocol,
        mtu: t.mtu,
    }
}

/// A neighbour entry as the kernel holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelNeighbour {
    pub ifindex: u32,
    pub addr: IpAddr,
    pub mac: Option<MacAddr>,
    pub permanent: bool,
}

/// A bridge FDB entry (`AF_BRIDGE` neighbour) as the kernel holds it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct KernelFdb {
    pub ifindex: u32,
    pub mac: MacAddr,
    pub dst: Option<IpAddr>,
}

/// One write. Devices by index: the backend resolves names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteOp {
    ReplaceRoute(KernelRoute),
    DeleteRoute(RouteKey),
    ReplaceNeighbour {
        ifindex: u32,
        addr: IpAddr,
        mac: MacAddr,
    },
    DeleteNeighbour {
        ifindex: u32,
        addr: IpAddr,
    },
    AddFdb(KernelFdb),
    DeleteFdb(KernelFdb),
}

/// The seam to the kernel: dumps and a batch of writes. The real one is
/// [`super::netlink::RouteNetlink`]; tests use a fake kernel.
pub trait RouteSeam: Send + std::fmt::Debug {
    fn links(&mut self) -> Result<Vec<Link>, BackendError>;
    /// Every route of both families, every table.
    fn routes(&mut self) -> Result<Vec<KernelRoute>, BackendError>;
    /// IPv4 and IPv6 neighbours, and the bridge FDB.
    fn neighbours(&mut self) -> Result<(Vec<KernelNeighbour>, Vec<KernelFdb>), BackendError>;
    /// Carries out every op (one failing does not stop the others); returns
    /// the failures by position in `ops`.
    fn write(&mut self, ops: &[RouteOp]) -> Vec<(usize, BackendError)>;
}

/// Which routes are ours (see the module header of [`super`]).
#[derive(Debug, Clone)]
pub struct RouteOwnership {
    /// Routes with this protocol are ours wherever they point.
    pub exclusive_protocol: u8,
    /// Protocol of our routes through devices (workloads, VXLAN).
    pub device_protocol: u8,
    pub workload_prefix: String,
    /// Every route on a workload interface is ours (Felix's
    /// RemoveExternalRoutes, default on); otherwise only those with our
    /// protocols.
    pub remove_external_routes: bool,
    /// Our tunnel devices: every route and permanent neighbour on them is
    /// ours.
    pub tunnel_devices: Vec<String>,
    /// Routing tables besides main that are ours, every route in them
    /// (WireGuard's).
    pub tables: Vec<u32>,
}

impl RouteOwnership {
    pub fn owns_device(&self, name: &str) -> bool {
        name.starts_with(&self.workload_prefix) || self.is_tunnel(name)
    }

    pub fn is_tunnel(&self, name: &str) -> bool {
        self.tunnel_devices.iter().any(|d| d == name)
    }

    /// Whether a route read from the kernel is ours; `dev` is the name of
    /// its device, if it has one we know.
    pub fn owns_route(&self, r: &KernelRoute, dev: Option<&str>) -> bool {
        if r.key.table != MAIN_TABLE {
            return self.tables.contains(&r.key.table);
        }
        if r.protocol == self.exclusive_protocol {
            return true;
        }
        if r.kind != RTN_UNICAST {
            return false; // special routes are ours only by protocol
        }
        if let IpNet::V6(n) = r.key.dst
            && n.prefix_len() == 64
            && n.addr().segments()[..4] == [0xfe80, 0, 0, 0]
        {
            return false; // the kernel's link-local route
        }
        match dev {
            Some(d) if self.is_tunnel(d) => true,
            Some(d) if d.starts_with(&self.workload_prefix) => {
                self.remove_external_routes || r.protocol == self.device_protocol
            }
            _ => false,
        }
    }
}
