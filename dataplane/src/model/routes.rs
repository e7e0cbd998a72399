//! Desired kernel routes, neighbours, FDB entries and VXLAN devices: what
//! the managers ask the route and VXLAN backends for. Plain data; the
//! backends resolve interface names to indices when they write.

use std::net::IpAddr;

use ipnet::IpNet;

use super::{Encapsulation, IpVersion, MacAddr};

/// The main routing table.
pub const MAIN_TABLE: u32 = 254;

/// What identifies a route to the kernel within a table (Felix's
/// `RouteKey`): destination, TOS and metric. Two routes with the same key
/// cannot coexist; a replace swaps one for the other without a gap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RouteKey {
    pub table: u32,
    pub dst: IpNet,
    pub tos: u8,
    /// IPv6 routes written with metric 0 read back as 1024 (the kernel's
    /// default): [`RouteKey::main`] normalises, so keys round-trip.
    pub metric: u32,
}

impl RouteKey {
    /// A route in the main table with the kernel's default metric.
    pub fn main(dst: IpNet) -> Self {
        Self::new(MAIN_TABLE, dst, 0)
    }

    pub fn new(table: u32, dst: IpNet, metric: u32) -> Self {
        let metric = match dst {
            IpNet::V6(_) if metric == 0 => 1024,
            _ => metric,
        };
        Self {
            table,
            dst,
            tos: 0,
            metric,
        }
    }
}

/// Which kind of route wins when two sources want the same key (Felix's
/// `RouteClass`: the lowest wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RouteClass {
    LocalWorkload,
    /// WireGuard's own table (routes into the device, throws).
    Wireguard,
    VxlanSameSubnet,
    VxlanTunnel,
    IpipSameSubnet,
    IpipTunnel,
    NoEncap,
    Blackhole,
}

/// What a route does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RouteKind {
    Unicast,
    /// Dropped silently (`blackhole`); no device.
    Blackhole,
    /// Ends the lookup in this table: the next rule's table decides
    /// (`throw`); no device.
    Throw,
}

/// Where a route sends its packets.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RouteTarget {
    pub class: RouteClass,
    pub kind: RouteKind,
    /// Output device (by name; `None` for a blackhole).
    pub dev: Option<String>,
    pub gateway: Option<IpAddr>,
    /// `onlink`: the gateway is taken to be on the device's link even
    /// though no address of ours covers it (VXLAN and no-encap routes).
    pub onlink: bool,
    pub protocol: u8,
    pub mtu: Option<u32>,
}

impl RouteTarget {
    /// The scope the kernel gives such a route: link for a plain device
    /// route, universe for gatewayed and special routes.
    pub fn scope(&self) -> RouteScope {
        if self.kind == RouteKind::Unicast && self.gateway.is_none() && self.dev.is_some() {
            RouteScope::Link
        } else {
            RouteScope::Universe
        }
    }
}

/// The route scopes we write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RouteScope {
    Universe,
    Link,
}

/// A permanent neighbour (ARP/NDP) entry.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Neighbour {
    pub dev: String,
    pub addr: IpAddr,
    pub mac: MacAddr,
}

/// A permanent forwarding-database entry of a VXLAN device: frames for
/// `mac` are sent to the VTEP at `dst`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FdbEntry {
    pub dev: String,
    pub mac: MacAddr,
    pub dst: IpAddr,
}

/// A VXLAN device as Felix makes it (`vxlan.calico`, `vxlan-v6.calico`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanDevice {
    pub name: String,
    pub vni: u32,
    pub port: u16,
    pub mac: MacAddr,
    /// The underlay interface and this node's address on it (the source of
    /// the encapsulated packets).
    pub parent: String,
    pub local: IpAddr,
    pub mtu: u32,
    /// This node's VTEP address (/32 or /128 on the device).
    pub addr: IpAddr,
}

/// A policy-routing rule (`ip rule`), as Felix's `routerule.Rule`:
/// priority, optional fwmark/mask (optionally inverted: `not fwmark`),
/// optional source prefix, and the table it looks up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IpRule {
    pub v6: bool,
    pub priority: u32,
    /// (mark, mask).
    pub fwmark: Option<(u32, u32)>,
    pub invert: bool,
    pub src: Option<IpNet>,
    pub table: u32,
}

/// `--vxlan`: on, off, or as the calc graph's `Encapsulation` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VxlanMode {
    #[default]
    Auto,
    Enabled,
    Disabled,
}

impl std::str::FromStr for VxlanMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "enabled" | "true" | "on" => Ok(Self::Enabled),
            "disabled" | "false" | "off" => Ok(Self::Disabled),
            _ => Err(format!("{s:?}: expected auto, enabled or disabled")),
        }
    }
}

impl VxlanMode {
    /// Whether VXLAN is on for IP version `v` (IPv6 only where the daemon
    /// programs IPv6 at all).
    pub fn on(self, encap: &Encapsulation, v: IpVersion, ipv6: bool) -> bool {
        match (self, v) {
            (_, IpVersion::V6) if !ipv6 => false,
            (Self::Enabled, _) => true,
            (Self::Disabled, _) => false,
            (Self::Auto, IpVersion::V4) => encap.vxlan_enabled,
            (Self::Auto, IpVersion::V6) => encap.vxlan_enabled_v6,
        }
    }
}
