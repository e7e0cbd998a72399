//! Pod traffic between nodes (Felix's `route_mgr.go`, `vxlan_mgr.go` and
//! `noencap_mgr.go` in one): `RouteUpdate`s become routes to other nodes'
//! IPAM blocks and blackholes for this node's; `VXLANTunnelEndpointUpdate`s
//! become the VXLAN devices and, per remote VTEP, a permanent neighbour
//! and an FDB entry. No I/O: everything is queued into the routes and VXLAN
//! backends.
//!
//! Per IP version, a `RouteUpdate` of a VXLAN pool (while VXLAN is on for
//! that version) to another node's block becomes
//! - `<block> via <node IP> dev <parent> onlink proto 80` when the calc
//!   graph says the node is in our subnet (`same_subnet`) and we know our
//!   parent interface;
//! - otherwise `<block> via <its VTEP IP> dev vxlan.calico onlink mtu M`
//!   (proto 3), or a device route on `vxlan.calico` for a remote tunnel
//!   address or a borrowed one;
//!
//! a `RouteUpdate` of a no-encap pool (while the calc graph says no-encap
//! is in use) becomes `<block> via <node IP> dev <parent> onlink proto 80`;
//! one of an IPIP pool `<block> via <node IP> dev tunl0 onlink proto 80`
//! where the kernel has `tunl0` (reported otherwise); and a local block
//! (`LOCAL_WORKLOAD`, not a single address, not a workload's own) of a pool
//! whose routing is on becomes `blackhole <block> proto 80`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use tracing::{debug, info};

use super::{Manager, ManagerError};
use crate::backends::DesiredKernel;
use crate::backends::routes::RouteSource;
use crate::interfaces::InterfaceEvent;
use crate::model::routes::{
    FdbEntry, Neighbour, RouteClass, RouteKey, RouteKind, RouteTarget, VxlanDevice,
};
use crate::model::{
    Encapsulation, HostMetadata, Id, IpVersion, Key, MacAddr, Route, Update, ValidationError, Vtep,
};

/// `RouteType` bits of `RouteUpdate.types`.
pub const REMOTE_WORKLOAD: u32 = 1;
pub const LOCAL_WORKLOAD: u32 = 4;
pub const REMOTE_TUNNEL: u32 = 16;

/// `IPPoolType` of `RouteUpdate.ip_pool_type`.
pub const POOL_NO_ENCAP: i32 = 1;
pub const POOL_VXLAN: i32 = 2;
pub const POOL_IPIP: i32 = 3;

pub const VXLAN_V4: &str = "vxlan.calico";
pub const VXLAN_V6: &str = "vxlan-v6.calico";
pub const IPIP_DEVICE: &str = "tunl0";

pub use crate::model::routes::VxlanMode;

#[derive(Debug, Clone, PartialEq)]
pub struct RoutesConfig {
    /// This node's name (`--hostname`; `FelixHostname` in a ConfigUpdate
    /// overrides it).
    pub hostname: String,
    pub vxlan: VxlanMode,
    pub vni: u32,
    pub port: u16,
    /// VXLAN device MTU; `None`: the parent's MTU − 50 (− 70 for IPv6).
    pub mtu: Option<u32>,
    pub mtu_v6: Option<u32>,
    /// Protocol of routes through our devices (Felix's DeviceRouteProtocol).
    pub device_protocol: u8,
    /// Protocol of blackhole, same-subnet, no-encap and IPIP routes (ours
    /// by protocol alone).
    pub route_protocol: u8,
    pub ipv6: bool,
}

impl Default for RoutesConfig {
    fn default() -> Self {
        Self {
            hostname: String::new(),
            vxlan: VxlanMode::Auto,
            vni: 4096,
            port: 4789,
            mtu: None,
            mtu_v6: None,
            device_protocol: 3,
            route_protocol: 80,
            ipv6: true,
        }
    }
}

#[derive(Debug, Clone)]
struct LinkInfo {
    name: String,
    mtu: u32,
    addrs: BTreeSet<IpNet>,
}

#[derive(Debug)]
pub struct RoutesManager {
    /// The flags' settings.
    base: RoutesConfig,
    /// In force: `base` with the VXLAN keys of the last ConfigUpdate.
    cfg: RoutesConfig,
    /// `IpInIpEnabled` of the last ConfigUpdate, over the calc graph's
    /// Encapsulation.
    ipip_override: Option<bool>,
    /// From a ConfigUpdate's `FelixHostname`.
    hostname_override: Option<String>,
    routes: BTreeMap<IpNet, Route>,
    vteps: BTreeMap<Id, Vtep>,
    hosts: BTreeMap<Id, HostMetadata>,
    encap: Encapsulation,
    links: BTreeMap<u32, LinkInfo>,
    link_events: Vec<InterfaceEvent>,
    /// Everything must be worked out again (a VTEP, the encapsulation, the
    /// node's name or its underlay changed).
    all_dirty: bool,
    /// Only these RouteUpdate destinations changed.
    dirty_dsts: BTreeSet<IpNet>,
    /// Another node's VTEP changed: its neighbour and FDB entry, and the
    /// routes to that node (in `dirty_dsts`).
    vteps_dirty: bool,
    /// The destinations routed to each node, for a VTEP change.
    by_node: BTreeMap<Id, BTreeSet<IpNet>>,
    /// What the interfaces mean to us (parents, tunl0): a link or address
    /// event that leaves it as it is needs no full pass.
    underlay: Underlay,
    /// The VXLAN devices of the last full pass, by version.
    devices: BTreeMap<IpVersion, VxlanDevice>,
    /// The kind of route programmed for each destination (for counts).
    classes: BTreeMap<IpNet, &'static str>,
    counts: BTreeMap<&'static str, usize>,
    /// Routes that cannot be programmed yet, and why.
    waiting_routes: BTreeMap<IpNet, String>,
    /// Devices that cannot be made yet, and why.
    waiting_devices: BTreeMap<&'static str, String>,
    vxlan_state: BTreeMap<&'static str, String>,
}

/// The parts of the interfaces that decide routes: each version's parent
/// (name, address, MTU) and whether `tunl0` exists.
type Underlay = (
    Option<(String, IpAddr, u32)>,
    Option<(String, IpAddr, u32)>,
    bool,
);

fn class_name(c: RouteClass) -> &'static str {
    match c {
        RouteClass::Blackhole => "blackhole",
        RouteClass::VxlanTunnel => "vxlan",
        RouteClass::VxlanSameSubnet => "vxlan_same_subnet",
        RouteClass::NoEncap => "no_encap",
        RouteClass::IpipTunnel => "ipip",
        RouteClass::IpipSameSubnet => "ipip_same_subnet",
        RouteClass::LocalWorkload => "workload",
        RouteClass::Wireguard => "wireguard",
    }
}

fn is_type(r: &Route, t: u32) -> bool {
    r.types & t == t
}

fn is_host_prefix(n: &IpNet) -> bool {
    n.prefix_len() == n.max_prefix_len()
}

fn version_of(n: &IpNet) -> IpVersion {
    match n {
        IpNet::V4(_) => IpVersion::V4,
        IpNet::V6(_) => IpVersion::V6,
    }
}

impl RoutesManager {
    pub fn new(cfg: RoutesConfig) -> Self {
        Self {
            base: cfg.clone(),
            cfg,
            ipip_override: None,
            hostname_override: None,
            routes: BTreeMap::new(),
            vteps: BTreeMap::new(),
            hosts: BTreeMap::new(),
            encap: Encapsulation::default(),
            links: BTreeMap::new(),
            link_events: Vec::new(),
            all_dirty: true,
            dirty_dsts: BTreeSet::new(),
            vteps_dirty: false,
            by_node: BTreeMap::new(),
            underlay: (None, None, false),
            devices: BTreeMap::new(),
            classes: BTreeMap::new(),
            counts: BTreeMap::new(),
            waiting_routes: BTreeMap::new(),
            waiting_devices: BTreeMap::new(),
            vxlan_state: BTreeMap::new(),
        }
    }

    pub fn hostname(&self) -> &str {
        self.hostname_override
            .as_deref()
            .unwrap_or(&self.cfg.hostname)
    }
}

impl RoutesManager {
    fn versions(&self) -> Vec<IpVersion> {
        if self.cfg.ipv6 {
            vec![IpVersion::V4, IpVersion::V6]
        } else {
            vec![IpVersion::V4]
        }
    }

    fn underlay_now(&self) -> Underlay {
        let p = |v| self.parent(v).map(|(l, ip)| (l.name.clone(), ip, l.mtu));
        (
            p(IpVersion::V4),
            p(IpVersion::V6),
            self.link_named(IPIP_DEVICE).is_some(),
        )
    }

    /// Works out the route for one destination (`None`: no route of
    /// ours), keeping the counts and the waiting list.
    /// `own`: the node's own addresses ([`Self::own_nets`], taken once
    /// per pass).
    fn target_for(&mut self, dst: IpNet, own: &[IpNet]) -> Option<RouteTarget> {
        let result = match self.routes.get(&dst) {
            Some(r) if version_of(&dst) == IpVersion::V4 || self.cfg.ipv6 => {
                self.route_for(r, &self.devices, own)
            }
            _ => Ok(None),
        };
        let (target, waiting) = match result {
            Ok(t) => (t, None),
            Err(why) => (None, Some(why)),
        };
        match waiting {
            Some(w) => {
                self.waiting_routes.insert(dst, w);
            }
            None => {
                self.waiting_routes.remove(&dst);
            }
        }
        let class = target.as_ref().map(|t| class_name(t.class));
        let old = match class {
            Some(c) => self.classes.insert(dst, c),
            None => self.classes.remove(&dst),
        };
        if old != class {
            if let Some(o) = old {
                *self.counts.entry(o).or_default() -= 1;
            }
            if let Some(c) = class {
                *self.counts.entry(c).or_default() += 1;
            }
        }
        target
    }

    fn log_waiting(&self) {
        let n = self.waiting_routes.len() + self.waiting_devices.len();
        if n > 0 {
            debug!(
                waiting = n,
                "routes and devices that cannot be programmed yet"
            );
        }
    }

    /// Everything again: devices, VTEP neighbours and FDB, every route.
    fn full_pass(&mut self, kernel: &mut DesiredKernel) {
        self.underlay = self.underlay_now();
        self.waiting_devices.clear();
        let versions = self.versions();
        let mut devices = BTreeMap::new();
        for &ver in &versions {
            let name = Self::device_name(ver);
            match self.vxlan_device(ver) {
                Ok(dev) => {
                    self.vxlan_state.insert(
                        name,
                        match &dev {
                            Some(d) => format!(
                                "vni {} port {} parent {} local {} mtu {} addr {} mac {}",
                                d.vni, d.port, d.parent, d.local, d.mtu, d.addr, d.mac
                            ),
                            None => "off".into(),
                        },
                    );
                    if let Some(d) = &dev {
                        devices.insert(ver, d.clone());
                    }
                    if let Some(v) = &mut kernel.vxlan {
                        v.set(name, dev);
                    }
                }
                Err(why) => {
                    // The device is left as it is (an underlay address
                    // that flaps must not take 100,000 routes with it):
                    // routes keep going through it.
                    if let Some(d) = self.devices.get(&ver) {
                        devices.insert(ver, d.clone());
                    }
                    self.vxlan_state.insert(name, why.clone());
                    self.waiting_devices.insert(name, format!("{name}: {why}"));
                }
            }
        }
        self.devices = devices;
        let (neighbours, fdb) = self.vtep_entries();
        // Routes.
        self.classes.clear();
        self.counts.clear();
        self.waiting_routes.clear();
        let dsts: Vec<IpNet> = self.routes.keys().copied().collect();
        let own = self.own_nets();
        let mut routes = BTreeMap::new();
        for dst in dsts {
            if let Some(t) = self.target_for(dst, &own) {
                routes.insert(RouteKey::main(dst), t);
            }
        }
        self.counts.insert("vteps", neighbours.len());
        self.vteps_dirty = false;
        debug!(
            routes = routes.len(),
            neighbours = neighbours.len(),
            "cluster routes"
        );
        if let Some(k) = &mut kernel.routes {
            k.set(RouteSource::Cluster, routes, neighbours);
            k.set_fdb(fdb);
        }
        if !self.waiting_devices.is_empty() || !self.waiting_routes.is_empty() {
            info!(
                devices = ?self.waiting_devices.values().collect::<Vec<_>>(),
                routes = self.waiting_routes.len(),
                "routes and devices that cannot be programmed yet"
            );
        }
    }
}

impl RoutesManager {
    /// Keeps `by_node` current as a route is replaced or removed.
    fn index_by_node(&mut self, old: Option<&Route>, new: Option<&Route>) {
        if let Some(o) = old
            && let Some(n) = &o.dst_node_name
            && let Some(set) = self.by_node.get_mut(n)
        {
            set.remove(&o.dst);
            if set.is_empty() {
                self.by_node.remove(n);
            }
        }
        if let Some(r) = new
            && let Some(n) = &r.dst_node_name
        {
            self.by_node.entry(n.clone()).or_default().insert(r.dst);
        }
    }

    /// Whether `node`'s VTEP is another node's; if so, what depends on it
    /// is marked (its neighbour and FDB entry, the routes to it) instead
    /// of everything.
    fn vtep_is_remote(&mut self, node: &Id) -> bool {
        if node.as_str() == self.hostname() {
            return false;
        }
        self.vteps_dirty = true;
        if let Some(dsts) = self.by_node.get(node) {
            self.dirty_dsts.extend(dsts.iter().copied());
        }
        true
    }

    /// The neighbour and FDB entry of every other node's VTEP on our
    /// devices.
    fn vtep_entries(&self) -> (BTreeSet<Neighbour>, BTreeSet<FdbEntry>) {
        let (mut neighbours, mut fdb) = (BTreeSet::new(), BTreeSet::new());
        for (node, v) in &self.vteps {
            if node.as_str() == self.hostname() {
                continue;
            }
            for (ver, dev) in &self.devices {
                if let Some((ip, mac, parent_ip)) = Self::vtep_addrs(v, *ver) {
                    neighbours.insert(Neighbour {
                        dev: dev.name.clone(),
                        addr: ip,
                        mac,
                    });
                    fdb.insert(FdbEntry {
                        dev: dev.name.clone(),
                        mac,
                        dst: parent_ip,
                    });
                }
            }
        }
        (neighbours, fdb)
    }
}

impl Manager for RoutesManager {
    fn name(&self) -> &'static str {
        "routes"
    }

    fn check(&self, update: &Update) -> Result<(), ValidationError> {
        self.validate(update)
    }

    fn on_update(&mut self, update: &Update) {
        match update {
            Update::Route(r) => {
                let old = self.routes.insert(r.dst, r.clone());
                self.index_by_node(old.as_ref(), Some(r));
                self.dirty_dsts.insert(r.dst);
                return;
            }
            Update::Remove(Key::Route(dst)) => {
                let old = self.routes.remove(dst);
                self.index_by_node(old.as_ref(), None);
                self.dirty_dsts.insert(*dst);
                return;
            }
            Update::Vtep(v) => {
                self.vteps.insert(v.node.clone(), v.clone());
                if self.vtep_is_remote(&v.node) {
                    return;
                }
            }
            Update::Remove(Key::Vtep(node)) => {
                self.vteps.remove(node);
                if self.vtep_is_remote(node) {
                    return;
                }
            }
            Update::HostMetadata(h) => {
                self.hosts.insert(h.hostname.clone(), h.clone());
            }
            Update::Encapsulation(e) => self.encap = *e,
            Update::Config(kv) => {
                // Checked at the edge ([`crate::model::config`]).
                let felix = crate::model::config::FelixConfig::parse(kv).unwrap_or_default();
                let cfg = RoutesConfig {
                    vxlan: felix.vxlan_mode(self.base.vxlan),
                    vni: felix.vxlan_vni.unwrap_or(self.base.vni),
                    port: felix.vxlan_port.unwrap_or(self.base.port),
                    mtu: crate::model::config::FelixConfig::mtu(felix.vxlan_mtu, self.base.mtu),
                    mtu_v6: crate::model::config::FelixConfig::mtu(
                        felix.vxlan_mtu_v6,
                        self.base.mtu_v6,
                    ),
                    ..self.base.clone()
                };
                if cfg != self.cfg || felix.ipip_enabled != self.ipip_override {
                    info!(vxlan = ?cfg.vxlan, vni = cfg.vni, port = cfg.port, mtu = ?cfg.mtu, ipip = ?felix.ipip_enabled, "VXLAN/IPIP settings from ConfigUpdate");
                    self.cfg = cfg;
                    self.ipip_override = felix.ipip_enabled;
                }
                let h = kv
                    .iter()
                    .find(|(k, _)| k == "FelixHostname")
                    .map(|(_, v)| v.clone())
                    .filter(|v| !v.is_empty());
                if h != self.hostname_override {
                    info!(hostname = ?h, "this node's name from ConfigUpdate");
                    self.hostname_override = h;
                }
            }
            Update::Remove(Key::HostMetadata(h)) => {
                self.hosts.remove(h);
            }
            _ => return,
        }
        self.all_dirty = true;
    }

    fn on_interface(&mut self, event: &InterfaceEvent) {
        match event {
            InterfaceEvent::Link {
                index, name, mtu, ..
            } => {
                let l = self.links.entry(*index).or_insert_with(|| LinkInfo {
                    name: name.clone(),
                    mtu: *mtu,
                    addrs: BTreeSet::new(),
                });
                l.name = name.clone();
                l.mtu = *mtu;
            }
            InterfaceEvent::LinkRemoved { index, .. } => {
                self.links.remove(index);
            }
            InterfaceEvent::AddrAdded { index, addr } => {
                if let Some(l) = self.links.get_mut(index) {
                    l.addrs.insert(*addr);
                }
            }
            InterfaceEvent::AddrRemoved { index, addr } => {
                if let Some(l) = self.links.get_mut(index) {
                    l.addrs.remove(addr);
                }
            }
            InterfaceEvent::InSync | InterfaceEvent::RouteRemoved(_) => {}
        }
        if matches!(
            event,
            InterfaceEvent::Link { .. }
                | InterfaceEvent::LinkRemoved { .. }
                | InterfaceEvent::RouteRemoved(_)
        ) {
            self.link_events.push(event.clone());
        }
        // A workload's veth coming or going changes nothing of ours; the
        // underlay's interfaces do.
        let now = self.underlay_now();
        if now != self.underlay {
            self.underlay = now;
            self.all_dirty = true;
        }
    }

    fn complete_deferred_work(&mut self, kernel: &mut DesiredKernel) -> Result<(), ManagerError> {
        if let Some(routes) = &mut kernel.routes {
            for e in self.link_events.drain(..) {
                if let (
                    Some(v),
                    InterfaceEvent::Link { name, .. } | InterfaceEvent::LinkRemoved { name, .. },
                ) = (&mut kernel.vxlan, &e)
                {
                    v.link_changed(name);
                }
                match e {
                    InterfaceEvent::Link { index, name, .. } => routes.link_added(index, &name),
                    InterfaceEvent::LinkRemoved { index, name } => {
                        routes.link_removed(index, &name)
                    }
                    InterfaceEvent::RouteRemoved(key) => routes.route_removed(key),
                    _ => {}
                }
            }
        }
        if self.all_dirty {
            self.all_dirty = false;
            self.dirty_dsts.clear();
            self.full_pass(kernel);
        } else if self.vteps_dirty || !self.dirty_dsts.is_empty() {
            if self.vteps_dirty {
                self.vteps_dirty = false;
                let (neighbours, fdb) = self.vtep_entries();
                self.counts.insert("vteps", neighbours.len());
                if let Some(k) = &mut kernel.routes {
                    k.set_neighbours(RouteSource::Cluster, neighbours);
                    k.set_fdb(fdb);
                }
            }
            let dsts = std::mem::take(&mut self.dirty_dsts);
            let own = if dsts.is_empty() {
                Vec::new()
            } else {
                self.own_nets()
            };
            for dst in dsts {
                let target = self.target_for(dst, &own);
                if let Some(k) = &mut kernel.routes {
                    k.update(RouteSource::Cluster, RouteKey::main(dst), target);
                }
            }
            self.log_waiting();
        }
        Ok(())
    }

    fn status(&self) -> Vec<(String, String)> {
        let mut out = vec![
            ("node".to_string(), self.hostname().to_string()),
            (
                "ipip".to_string(),
                if self.underlay.2 {
                    format!("available ({IPIP_DEVICE} exists)")
                } else {
                    format!(
                        "unavailable: no {IPIP_DEVICE} (this kernel has no ipip module); IPIP routes wait"
                    )
                },
            ),
        ];
        for (dev, s) in &self.vxlan_state {
            out.push((format!("vxlan.{dev}"), s.clone()));
        }
        for (k, n) in &self.counts {
            if *n > 0 {
                out.push((format!("routes.{k}"), n.to_string()));
            }
        }
        let waiting: Vec<&String> = self
            .waiting_devices
            .values()
            .chain(self.waiting_routes.values())
            .collect();
        for (i, w) in waiting.iter().enumerate().take(20) {
            out.push((format!("routes.waiting.{i}"), (*w).clone()));
        }
        if waiting.len() > 20 {
            out.push((
                "routes.waiting.more".into(),
                (waiting.len() - 20).to_string(),
            ));
        }
        out
    }
}

mod targets;
#[cfg(test)]
mod tests;
mod underlay;
mod validate;
