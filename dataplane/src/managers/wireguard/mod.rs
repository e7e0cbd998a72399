//! WireGuard between nodes (Felix's `wireguard_mgr.go` and the routing
//! half of `felix/wireguard/wireguard.go`): per IP version, the device
//! (name, port, fwmark, MTU, this node's WireGuard address), one peer per
//! other node that has an endpoint (`HostMetadataUpdate`) and a key
//! (`WireguardEndpointUpdate` / `…V6Update`) no other node claims, with
//! that node's workload blocks and tunnel addresses (`RouteUpdate`s) as
//! allowed IPs; the routing table (1, v6: 2) with `<cidr> dev <device>` for
//! each programmed peer's CIDRs (and, once this node's key is out, a
//! blackhole of each at metric 4096 behind it: fail closed while the
//! device is gone; not Felix's) and `throw <cidr>` for the others' and for
//! this node's own; and the rule `not fwmark M/M lookup <table>` (priority
//! 99), which sends everything but WireGuard's own packets (which carry
//! the mark) through that table. Off: no device, no routes, no rule.
//!
//! Enabled by `--wireguard` / `--wireguard-v6` or a `ConfigUpdate`
//! (`WireguardEnabled`, `WireguardEnabledV6`, `WireguardListeningPort[V6]`,
//! `WireguardMTU[V6]`, `WireguardRoutingRulePriority`,
//! `WireguardInterfaceName[V6]`); a key present in the last
//! `ConfigUpdate` wins over the flag. No I/O: everything is queued into
//! the WireGuard, routes and rules backends.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use tracing::info;

use super::{Manager, ManagerError};
use crate::backends::DesiredKernel;
use crate::backends::routes::RouteSource;
use crate::interfaces::InterfaceEvent;
use crate::model::routes::{IpRule, RouteClass, RouteKey, RouteKind, RouteTarget};
use crate::model::wireguard::{
    FAIL_CLOSED_METRIC, OVERHEAD_V4, OVERHEAD_V6, PublicKey, RULE_PRIORITY, TABLE_V4, TABLE_V6,
    WgDevice, WgPeer, WgSettings, check_config, config_keys,
};
use crate::model::{HostMetadata, Id, IpVersion, Key, Update, ValidationError, WireguardEndpoint};

/// `RouteType` bits that make a CIDR part of a node's WireGuard share
/// (workloads and tunnel addresses, local and remote; `REMOTE_HOST` only
/// with host encryption, which we do not do).
const WORKLOAD_OR_TUNNEL: u32 = 1 | 4 | 16 | 32;
/// The MTU assumed for the host when its interface is not known yet
/// (Felix's default).
const DEFAULT_HOST_MTU: u32 = 1500;

/// What the flags say (a `ConfigUpdate` may override each).
#[derive(Debug, Clone)]
pub struct WireguardConfig {
    pub hostname: String,
    pub v4: WgSettings,
    pub v6: WgSettings,
    pub rule_priority: u32,
    pub table: u32,
    pub table_v6: u32,
    pub fwmark: u32,
    /// Protocol of the routes into the device.
    pub device_protocol: u8,
    pub ipv6: bool,
}

impl Default for WireguardConfig {
    fn default() -> Self {
        Self {
            hostname: String::new(),
            v4: WgSettings::default_for(IpVersion::V4),
            v6: WgSettings::default_for(IpVersion::V6),
            rule_priority: RULE_PRIORITY,
            table: TABLE_V4,
            table_v6: TABLE_V6,
            fwmark: 0x20_0000,
            device_protocol: 3,
            ipv6: true,
        }
    }
}

#[derive(Debug, Clone, Default)]
struct LinkInfo {
    name: String,
    mtu: u32,
    addrs: BTreeSet<IpNet>,
}

#[derive(Debug)]
pub struct WireguardManager {
    cfg: WireguardConfig,
    config: BTreeMap<String, String>,
    hosts: BTreeMap<Id, HostMetadata>,
    endpoints: [BTreeMap<Id, WireguardEndpoint>; 2],
    /// CIDRs that are part of a node's share, by destination.
    routes: BTreeMap<IpNet, Id>,
    links: BTreeMap<u32, LinkInfo>,
    /// The destinations of each node's share (allowed IPs).
    by_node: BTreeMap<Id, BTreeSet<IpNet>>,
    /// Link events on our devices, for the backend.
    device_events: BTreeSet<String>,
    /// Everything must be worked out again (a key, an endpoint, config,
    /// the host's MTU, this node's blocks).
    all_dirty: bool,
    /// Only these destinations changed, and the shares of these nodes.
    dirty_dsts: BTreeSet<IpNet>,
    dirty_nodes: BTreeSet<Id>,
    /// The peers of the last full pass, per version: node → (key,
    /// endpoint).
    peers: [BTreeMap<Id, (PublicKey, SocketAddr)>; 2],
    /// This node's blocks (not single addresses), as of the last full pass.
    local_blocks: BTreeSet<IpNet>,
    /// Versions for which the calc graph just told us this node's key.
    own_key_told: BTreeSet<IpVersion>,
    /// Our own public keys as the backend last announced them.
    own_keys: [Option<String>; 2],
    /// Why a node is not a peer, per version.
    not_programmed: [BTreeMap<String, String>; 2],
    summary: [BTreeMap<&'static str, String>; 2],
}

fn idx(v: IpVersion) -> usize {
    match v {
        IpVersion::V4 => 0,
        IpVersion::V6 => 1,
    }
}

fn version_of(n: &IpNet) -> IpVersion {
    match n {
        IpNet::V4(_) => IpVersion::V4,
        IpNet::V6(_) => IpVersion::V6,
    }
}

fn label(v: IpVersion) -> &'static str {
    match v {
        IpVersion::V4 => "v4",
        IpVersion::V6 => "v6",
    }
}

impl WireguardManager {
    pub fn new(cfg: WireguardConfig) -> Self {
        Self {
            cfg,
            config: BTreeMap::new(),
            hosts: BTreeMap::new(),
            endpoints: [BTreeMap::new(), BTreeMap::new()],
            routes: BTreeMap::new(),
            links: BTreeMap::new(),
            by_node: BTreeMap::new(),
            device_events: BTreeSet::new(),
            all_dirty: true,
            dirty_dsts: BTreeSet::new(),
            dirty_nodes: BTreeSet::new(),
            peers: [BTreeMap::new(), BTreeMap::new()],
            local_blocks: BTreeSet::new(),
            own_key_told: BTreeSet::new(),
            own_keys: [None, None],
            not_programmed: [BTreeMap::new(), BTreeMap::new()],
            summary: [BTreeMap::new(), BTreeMap::new()],
        }
    }

    fn hostname(&self) -> &str {
        self.config
            .get("FelixHostname")
            .filter(|h| !h.is_empty())
            .unwrap_or(&self.cfg.hostname)
    }

    fn settings(&self, v: IpVersion) -> WgSettings {
        let mut s = match v {
            IpVersion::V4 => &self.cfg.v4,
            IpVersion::V6 => &self.cfg.v6,
        }
        .effective(v, &self.config);
        s.enabled &= v == IpVersion::V4 || self.cfg.ipv6;
        s
    }

    fn table(&self, v: IpVersion) -> u32 {
        match v {
            IpVersion::V4 => self.cfg.table,
            IpVersion::V6 => self.cfg.table_v6,
        }
    }

    fn rule_priority(&self) -> u32 {
        self.config
            .get("WireguardRoutingRulePriority")
            .and_then(|p| p.parse().ok())
            .unwrap_or(self.cfg.rule_priority)
    }

    /// The MTU of the interface that holds this node's address.
    fn host_mtu(&self) -> Option<u32> {
        let h = self.hosts.get(self.hostname())?;
        let ips: Vec<IpAddr> = h
            .ipv4_addr
            .iter()
            .chain(h.ipv6_addr.iter())
            .copied()
            .collect();
        self.links
            .values()
            .find(|l| l.addrs.iter().any(|a| ips.contains(&a.addr())))
            .map(|l| l.mtu)
            .filter(|m| *m > 0)
    }

    fn is_device(&self, name: &str) -> bool {
        [IpVersion::V4, IpVersion::V6]
            .iter()
            .any(|v| self.settings(*v).iface == name)
            || name == self.cfg.v4.iface
            || name == self.cfg.v6.iface
    }
}

impl Manager for WireguardManager {
    fn name(&self) -> &'static str {
        "wireguard"
    }

    fn check(&self, update: &Update) -> Result<(), ValidationError> {
        match update {
            Update::Config(kv) => check_config(kv).map_err(|(k, reason)| {
                ValidationError::new(format!("config_update.config[{k}]"), reason)
            }),
            Update::WireguardEndpoint(e) | Update::WireguardEndpointV6(e) => {
                let (v, field, msg) = match update {
                    Update::WireguardEndpoint(_) => (
                        IpVersion::V4,
                        "interface_ipv4_addr",
                        "wireguard_endpoint_update",
                    ),
                    _ => (
                        IpVersion::V6,
                        "interface_ipv6_addr",
                        "wireguard_endpoint_v6_update",
                    ),
                };
                match e.interface_addr {
                    Some(a) if IpVersion::of(&a) != v => Err(ValidationError::new(
                        format!("{msg}.{field}"),
                        format!("{a} is not an IP{} address", label(v)),
                    )),
                    _ => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    fn on_update(&mut self, update: &Update) {
        match update {
            Update::Config(kv) => {
                let mut ours = config_keys(kv);
                if let Some((_, h)) = kv.iter().find(|(k, _)| k == "FelixHostname") {
                    ours.insert("FelixHostname".into(), h.clone());
                }
                if ours != self.config {
                    info!(config = ?ours, "WireGuard config from ConfigUpdate");
                    self.config = ours;
                }
            }
            Update::HostMetadata(h) => {
                self.hosts.insert(h.hostname.clone(), h.clone());
            }
            Update::Remove(Key::HostMetadata(h)) => {
                self.hosts.remove(h);
            }
            Update::WireguardEndpoint(e) => {
                if e.hostname.as_str() == self.hostname() {
                    self.own_key_told.insert(IpVersion::V4);
                }
                self.endpoints[0].insert(e.hostname.clone(), e.clone());
            }
            Update::WireguardEndpointV6(e) => {
                if e.hostname.as_str() == self.hostname() {
                    self.own_key_told.insert(IpVersion::V6);
                }
                self.endpoints[1].insert(e.hostname.clone(), e.clone());
            }
            Update::Remove(Key::WireguardEndpoint(h)) => {
                self.endpoints[0].remove(h);
            }
            Update::Remove(Key::WireguardEndpointV6(h)) => {
                self.endpoints[1].remove(h);
            }
            Update::Route(r) => {
                let node = r
                    .dst_node_name
                    .clone()
                    .filter(|_| r.types & WORKLOAD_OR_TUNNEL != 0);
                let old = match &node {
                    Some(n) => self.routes.insert(r.dst, n.clone()),
                    None => self.routes.remove(&r.dst),
                };
                if old != node {
                    self.route_changed(r.dst, old, node.as_ref());
                }
                return;
            }
            Update::Remove(Key::Route(dst)) => {
                if let Some(old) = self.routes.remove(dst) {
                    self.route_changed(*dst, Some(old), None);
                }
                return;
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
                let l = self.links.entry(*index).or_default();
                let changed = l.mtu != *mtu;
                l.name = name.clone();
                l.mtu = *mtu;
                if self.is_device(name) {
                    self.device_events.insert(name.clone());
                } else if changed {
                    self.all_dirty = true;
                }
            }
            InterfaceEvent::LinkRemoved { index, name } => {
                self.links.remove(index);
                if self.is_device(name) {
                    self.device_events.insert(name.clone());
                }
            }
            InterfaceEvent::AddrAdded { index, addr } => {
                if let Some(l) = self.links.get_mut(index)
                    && l.addrs.insert(*addr)
                {
                    self.all_dirty = true;
                }
            }
            InterfaceEvent::AddrRemoved { index, addr } => {
                if let Some(l) = self.links.get_mut(index)
                    && l.addrs.remove(addr)
                {
                    self.all_dirty = true;
                }
            }
            InterfaceEvent::InSync | InterfaceEvent::RouteRemoved(_) => {}
        }
    }

    fn complete_deferred_work(&mut self, kernel: &mut DesiredKernel) -> Result<(), ManagerError> {
        let Some(wg) = &mut kernel.wireguard else {
            return Ok(());
        };
        for name in std::mem::take(&mut self.device_events) {
            wg.link_changed(&name);
        }
        // Our own key decides whether another node's is a duplicate.
        for v in [IpVersion::V4, IpVersion::V6] {
            let k = wg.public_key(v).map(str::to_string);
            if k != self.own_keys[idx(v)] {
                self.own_keys[idx(v)] = k;
                self.all_dirty = true;
            }
        }
        // The calc graph says this node has another key than ours (a key
        // it has not heard of yet, or a stale one): say ours again, as
        // Felix does.
        for v in std::mem::take(&mut self.own_key_told) {
            let told = self.endpoints[idx(v)]
                .get(self.hostname())
                .and_then(|e| e.public_key)
                .map(|k| PublicKey(k).to_base64());
            let ours = self.own_keys[idx(v)].as_deref().filter(|k| !k.is_empty());
            if let (Some(told), Some(ours)) = (told, ours)
                && told != ours
            {
                wg.reannounce(v);
            }
        }
        if !self.all_dirty {
            if !self.dirty_dsts.is_empty() || !self.dirty_nodes.is_empty() {
                self.incremental(kernel);
            }
            return Ok(());
        }
        self.all_dirty = false;
        self.dirty_dsts.clear();
        self.dirty_nodes.clear();
        let mut table = BTreeMap::new();
        let mut rules = BTreeSet::new();
        for v in [IpVersion::V4, IpVersion::V6] {
            if v == IpVersion::V6 && !self.cfg.ipv6 {
                continue;
            }
            let s = self.settings(v);
            if s.enabled {
                let (dev, routes, rule) = self.desired(v, &s);
                table.extend(routes);
                rules.insert(rule);
                kernel
                    .wireguard
                    .as_mut()
                    .expect("checked above")
                    .set(v, &s.iface, Some(dev));
            } else {
                self.summary[idx(v)].clear();
                self.not_programmed[idx(v)].clear();
                kernel
                    .wireguard
                    .as_mut()
                    .expect("checked above")
                    .set(v, &s.iface, None);
            }
        }
        if let Some(r) = &mut kernel.routes {
            r.set(RouteSource::Wireguard, table, BTreeSet::new());
        }
        if let Some(r) = &mut kernel.ip_rules {
            r.set(rules);
        }
        Ok(())
    }

    fn status(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for v in [IpVersion::V4, IpVersion::V6] {
            let i = idx(v);
            let p = format!("wireguard.{}", label(v));
            let s = self.settings(v);
            if !s.enabled {
                continue;
            }
            for (k, val) in &self.summary[i] {
                out.push((format!("{p}.{k}"), val.clone()));
            }
            for (node, why) in self.not_programmed[i].iter().take(20) {
                out.push((format!("{p}.not_a_peer.{node}"), why.clone()));
            }
            if self.not_programmed[i].len() > 20 {
                out.push((
                    format!("{p}.not_a_peer.more"),
                    (self.not_programmed[i].len() - 20).to_string(),
                ));
            }
        }
        out
    }
}

mod incremental;
mod peers;
#[cfg(test)]
mod tests;
