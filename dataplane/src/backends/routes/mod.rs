//! Routes, permanent neighbours and VXLAN FDB entries, over rtnetlink.
//!
//! Owns, in the main table (Felix's `MainTableOwnershipPolicy`):
//! - every route with our exclusive protocol (`--route-protocol`, 80):
//!   blackholes for local IPAM blocks, same-subnet and no-encap routes;
//! - every route whose device is one of our tunnel devices
//!   (`vxlan.calico`, `vxlan-v6.calico`), and every route whose device is a
//!   workload interface (the `--workload-iface-prefix`), whatever its
//!   protocol (Felix's RemoveExternalRoutes; with
//!   `--remove-external-routes=false` only those with our two protocols) —
//!   except the kernel's own IPv6 `fe80::/64`;
//! - permanent neighbour entries on those same devices, and the FDB
//!   entries of our VXLAN devices.
//!
//! Nothing else is read into our state, changed or deleted. Routes are keyed
//! as the kernel keys them (table, destination, TOS, metric): a change is
//! one `RTM_NEWROUTE` with `NLM_F_REPLACE` (no gap), a removal one
//! `RTM_DELROUTE` with wildcard protocol, scope and type. Read back by dump
//! (filtered on the table attribute: dumps are not filtered by table) at
//! start, after a failure and on the route refresh tick.
//!
//! An unexpected route on a workload interface that appeared in the last
//! 10 s (`GRACE`) is left alone until we have routes for that interface
//! (Felix's `routeCleanupGracePeriod`: CNI may be adding it right now).

pub mod netlink;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use tracing::{debug, info, instrument, warn};

use super::{ApplyOutcome, Backend, BackendError, Phase, Refresh};
use crate::model::MacAddr;
use crate::model::routes::{
    FdbEntry, MAIN_TABLE, Neighbour, RouteKey, RouteKind, RouteScope, RouteTarget,
};

/// How long an unexpected route on a newly seen workload interface is
/// spared (Felix's 10 s).
pub const GRACE: Duration = Duration::from_secs(10);

/// Kernel route types (`RTN_*`) and scopes (`RT_SCOPE_*`) we read and
/// write.
pub const RTN_UNICAST: u8 = 1;
pub const RTN_BLACKHOLE: u8 = 6;
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
/// [`netlink::RouteNetlink`]; tests use a fake kernel.
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

/// Which routes are ours (see the module header).
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
}

impl RouteOwnership {
    fn owns_device(&self, name: &str) -> bool {
        name.starts_with(&self.workload_prefix) || self.tunnel_devices.iter().any(|d| d == name)
    }

    fn owns_route(&self, r: &KernelRoute, dev: Option<&str>) -> bool {
        if r.key.table != MAIN_TABLE {
            return false;
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
            Some(d) if self.tunnel_devices.iter().any(|t| t == d) => true,
            Some(d) if d.starts_with(&self.workload_prefix) => {
                self.remove_external_routes || r.protocol == self.device_protocol
            }
            _ => false,
        }
    }
}

/// Who asked for a route or neighbour: each manager sets its own share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RouteSource {
    /// Routes and ARP entries to this node's workloads (endpoints manager).
    Workloads,
    /// Routes to other nodes' blocks, blackholes, VTEP neighbours (routes
    /// manager).
    Cluster,
}

#[derive(Debug, Default)]
struct Observed {
    routes: BTreeMap<RouteKey, KernelRoute>,
    neighbours: BTreeMap<(u32, IpAddr), KernelNeighbour>,
    fdb: BTreeSet<KernelFdb>,
}

/// What the backend reports in status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutesSummary {
    pub routes: usize,
    pub neighbours: usize,
    pub fdb: usize,
    /// Devices named by desired routes that do not exist (yet).
    pub missing_devices: Vec<String>,
}

#[derive(Debug)]
pub struct Routes {
    own: RouteOwnership,
    seam: Box<dyn RouteSeam>,
    routes: BTreeMap<RouteSource, BTreeMap<RouteKey, RouteTarget>>,
    neighbours: BTreeMap<RouteSource, BTreeSet<Neighbour>>,
    fdb: BTreeSet<FdbEntry>,
    changed: bool,
    /// name → index, from the last link dump (and link events since).
    links: Option<HashMap<String, u32>>,
    /// Workload interfaces that appeared after our first read, and when.
    new_links: HashMap<u32, Instant>,
    observed: Option<Observed>,
    grace: Duration,
    /// A grace period held back a deletion: look again then.
    grace_until: Option<Instant>,
    summary: RoutesSummary,
}

impl Routes {
    pub fn new(own: RouteOwnership, seam: Box<dyn RouteSeam>) -> Self {
        Self {
            own,
            seam,
            routes: BTreeMap::new(),
            neighbours: BTreeMap::new(),
            fdb: BTreeSet::new(),
            changed: true,
            links: None,
            new_links: HashMap::new(),
            observed: None,
            grace: GRACE,
            grace_until: None,
            summary: RoutesSummary::default(),
        }
    }

    /// A shorter grace period (tests).
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// One source's whole share of routes and neighbours. A source whose
    /// routes name a device that was missing at the last apply marks the
    /// backend changed even when its share is the same (the device may
    /// exist now).
    pub fn set(
        &mut self,
        source: RouteSource,
        routes: BTreeMap<RouteKey, RouteTarget>,
        neighbours: BTreeSet<Neighbour>,
    ) {
        if self.routes.get(&source) != Some(&routes)
            || self.neighbours.get(&source) != Some(&neighbours)
            || !self.summary.missing_devices.is_empty()
        {
            self.routes.insert(source, routes);
            self.neighbours.insert(source, neighbours);
            self.changed = true;
        }
    }

    /// The FDB entries of our VXLAN devices.
    pub fn set_fdb(&mut self, fdb: BTreeSet<FdbEntry>) {
        if fdb != self.fdb {
            self.fdb = fdb;
            self.changed = true;
        }
    }

    /// A link appeared (interface monitor). Its index may be new for an
    /// old name (a workload recreated).
    pub fn link_added(&mut self, index: u32, name: &str) {
        let Some(links) = &mut self.links else {
            return;
        };
        if links.get(name) != Some(&index) {
            links.insert(name.to_string(), index);
            if name.starts_with(&self.own.workload_prefix) {
                self.new_links.insert(index, Instant::now());
            }
            self.changed = true;
        }
    }

    /// A link went away, and the kernel took its routes and neighbours
    /// with it: forget them, so that they are written again if the link
    /// comes back.
    pub fn link_removed(&mut self, index: u32, name: &str) {
        if let Some(links) = &mut self.links
            && links.get(name) == Some(&index)
        {
            links.remove(name);
        }
        self.new_links.remove(&index);
        if let Some(o) = &mut self.observed {
            o.routes.retain(|_, r| r.oif != Some(index));
            o.neighbours.retain(|(i, _), _| *i != index);
            o.fdb.retain(|f| f.ifindex != index);
        }
        self.changed = true;
    }

    /// The routes every source wants, the lowest class winning a key.
    pub fn desired(&self) -> BTreeMap<RouteKey, RouteTarget> {
        self.merged()
            .into_iter()
            .map(|(k, t)| (k, t.clone()))
            .collect()
    }

    /// The neighbours every source wants.
    pub fn desired_neighbours(&self) -> BTreeSet<Neighbour> {
        self.neighbours.values().flatten().cloned().collect()
    }

    /// The FDB entries wanted.
    pub fn desired_fdb(&self) -> &BTreeSet<FdbEntry> {
        &self.fdb
    }

    pub fn summary(&self) -> &RoutesSummary {
        &self.summary
    }

    /// The desired routes of every source, the lowest class winning a key.
    fn merged(&self) -> BTreeMap<RouteKey, &RouteTarget> {
        let mut out: BTreeMap<RouteKey, &RouteTarget> = BTreeMap::new();
        for share in self.routes.values() {
            for (k, t) in share {
                match out.get(k) {
                    Some(old) if old.class <= t.class => {}
                    _ => {
                        out.insert(*k, t);
                    }
                }
            }
        }
        out
    }

    fn read_links(&mut self) -> Result<(), BackendError> {
        let first = self.links.is_none();
        let mut map = HashMap::new();
        for l in self.seam.links()? {
            if !first
                && l.name.starts_with(&self.own.workload_prefix)
                && self.links.as_ref().and_then(|m| m.get(&l.name)) != Some(&l.index)
            {
                self.new_links.entry(l.index).or_insert_with(Instant::now);
            }
            map.insert(l.name, l.index);
        }
        self.links = Some(map);
        Ok(())
    }

    fn read(&mut self) -> Result<(), BackendError> {
        self.read_links()?;
        let names: HashMap<u32, &str> = self
            .links
            .iter()
            .flatten()
            .map(|(n, i)| (*i, n.as_str()))
            .collect();
        let mut o = Observed::default();
        for r in self.seam.routes()? {
            let dev = r.oif.and_then(|i| names.get(&i).copied());
            if self.own.owns_route(&r, dev) {
                o.routes.insert(r.key, r);
            }
        }
        let (neighbours, fdb) = self.seam.neighbours()?;
        for n in neighbours {
            let ours = n.permanent
                && names
                    .get(&n.ifindex)
                    .is_some_and(|d| self.own.owns_device(d));
            if ours {
                o.neighbours.insert((n.ifindex, n.addr), n);
            }
        }
        for f in fdb {
            let ours = names
                .get(&f.ifindex)
                .is_some_and(|d| self.own.tunnel_devices.iter().any(|t| t == d));
            if ours {
                o.fdb.insert(f);
            }
        }
        debug!(
            routes = o.routes.len(),
            neighbours = o.neighbours.len(),
            fdb = o.fdb.len(),
            "read our routes"
        );
        self.observed = Some(o);
        Ok(())
    }

    fn index_of(&mut self, dev: &str, redumped: &mut bool) -> Result<Option<u32>, BackendError> {
        if let Some(i) = self.links.as_ref().and_then(|m| m.get(dev)) {
            return Ok(Some(*i));
        }
        if !*redumped {
            // Made since our last dump (our own VXLAN device, a workload
            // whose event is still on its way): look once more.
            *redumped = true;
            self.read_links()?;
            return Ok(self.links.as_ref().and_then(|m| m.get(dev)).copied());
        }
        Ok(None)
    }

    /// The ops that bring `observed` to the desired state.
    fn plan(&mut self, observed: &Observed) -> Result<Plan, BackendError> {
        let merged: Vec<(RouteKey, RouteTarget)> = self
            .merged()
            .into_iter()
            .map(|(k, t)| (k, t.clone()))
            .collect();
        let mut redumped = false;
        let mut missing = BTreeSet::new();
        let (mut adds, mut dels) = (Vec::new(), Vec::new());
        let mut wanted_keys = BTreeSet::new();
        let mut devices_with_routes = BTreeSet::new();
        for (key, t) in &merged {
            let oif = match &t.dev {
                Some(d) => match self.index_of(d, &mut redumped)? {
                    Some(i) => Some(i),
                    None => {
                        missing.insert(d.clone());
                        continue;
                    }
                },
                None => None,
            };
            wanted_keys.insert(*key);
            if let Some(i) = oif {
                devices_with_routes.insert(i);
            }
            let want = kernel_route(*key, t, oif);
            if observed.routes.get(key) != Some(&want) {
                adds.push(RouteOp::ReplaceRoute(want));
            }
        }
        let now = Instant::now();
        let mut grace_left: Option<Duration> = None;
        for (key, r) in &observed.routes {
            if wanted_keys.contains(key) {
                continue;
            }
            if let Some(i) = r.oif
                && !devices_with_routes.contains(&i)
                && let Some(seen) = self.new_links.get(&i)
            {
                let age = now.duration_since(*seen);
                if age < self.grace {
                    let left = self.grace - age;
                    grace_left = Some(grace_left.map_or(left, |g| g.min(left)));
                    debug!(dst = %key.dst, ifindex = i, "unexpected route on a new workload interface: in its grace period");
                    continue;
                }
            }
            dels.push(RouteOp::DeleteRoute(*key));
        }
        // Neighbours.
        let mut want_n: BTreeMap<(u32, IpAddr), MacAddr> = BTreeMap::new();
        let all_n: Vec<Neighbour> = self.neighbours.values().flatten().cloned().collect();
        for n in all_n {
            match self.index_of(&n.dev, &mut redumped)? {
                Some(i) => {
                    want_n.insert((i, n.addr), n.mac);
                }
                None => {
                    missing.insert(n.dev.clone());
                }
            }
        }
        let mut n_adds = Vec::new();
        for ((i, addr), mac) in &want_n {
            let ok = observed
                .neighbours
                .get(&(*i, *addr))
                .is_some_and(|k| k.mac == Some(*mac));
            if !ok {
                n_adds.push(RouteOp::ReplaceNeighbour {
                    ifindex: *i,
                    addr: *addr,
                    mac: *mac,
                });
            }
        }
        for (i, addr) in observed.neighbours.keys() {
            if !want_n.contains_key(&(*i, *addr)) {
                dels.push(RouteOp::DeleteNeighbour {
                    ifindex: *i,
                    addr: *addr,
                });
            }
        }
        // FDB.
        let mut want_f = BTreeSet::new();
        for f in self.fdb.clone() {
            match self.index_of(&f.dev, &mut redumped)? {
                Some(i) => {
                    want_f.insert(KernelFdb {
                        ifindex: i,
                        mac: f.mac,
                        dst: Some(f.dst),
                    });
                }
                None => {
                    missing.insert(f.dev.clone());
                }
            }
        }
        for f in want_f.difference(&observed.fdb) {
            n_adds.push(RouteOp::AddFdb(f.clone()));
        }
        for f in observed.fdb.difference(&want_f) {
            dels.push(RouteOp::DeleteFdb(f.clone()));
        }
        // Neighbours and FDB first (what the routes lead to), then routes,
        // then removals.
        n_adds.extend(adds);
        n_adds.extend(dels);
        Ok(Plan {
            ops: n_adds,
            missing: missing.into_iter().collect(),
            grace_left,
        })
    }
}

/// What an apply will do.
#[derive(Debug)]
struct Plan {
    ops: Vec<RouteOp>,
    /// Devices named by desired routes that could not be resolved.
    missing: Vec<String>,
    /// How long until a grace period ends, if one held back a deletion.
    grace_left: Option<Duration>,
}

/// The kernel form of a desired route.
pub fn kernel_route(key: RouteKey, t: &RouteTarget, oif: Option<u32>) -> KernelRoute {
    KernelRoute {
        key,
        kind: match t.kind {
            RouteKind::Unicast => RTN_UNICAST,
            RouteKind::Blackhole => RTN_BLACKHOLE,
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

/// Applies one op to what we believe the kernel holds.
fn record(o: &mut Observed, op: &RouteOp) {
    match op {
        RouteOp::ReplaceRoute(r) => {
            o.routes.insert(r.key, r.clone());
        }
        RouteOp::DeleteRoute(k) => {
            o.routes.remove(k);
        }
        RouteOp::ReplaceNeighbour { ifindex, addr, mac } => {
            o.neighbours.insert(
                (*ifindex, *addr),
                KernelNeighbour {
                    ifindex: *ifindex,
                    addr: *addr,
                    mac: Some(*mac),
                    permanent: true,
                },
            );
        }
        RouteOp::DeleteNeighbour { ifindex, addr } => {
            o.neighbours.remove(&(*ifindex, *addr));
        }
        RouteOp::AddFdb(f) => {
            o.fdb.insert(f.clone());
        }
        RouteOp::DeleteFdb(f) => {
            o.fdb.remove(f);
        }
    }
}

impl Backend for Routes {
    fn name(&self) -> &'static str {
        "routes"
    }

    fn phases(&self) -> &'static [Phase] {
        &[Phase::RoutesAndRules]
    }

    fn is_dirty(&self, phase: Phase) -> bool {
        phase == Phase::RoutesAndRules
            && (self.changed
                || self.observed.is_none()
                || self.grace_until.is_some_and(|t| Instant::now() >= t))
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if refresh == Refresh::Routes {
            self.observed = None;
        }
    }

    #[instrument(level = "debug", skip(self), fields(backend = "routes"))]
    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        if self.observed.is_none() {
            self.read()?;
        }
        let mut observed = self.observed.take().expect("read above");
        let Plan {
            ops,
            missing,
            grace_left,
        } = match self.plan(&observed) {
            Ok(p) => p,
            Err(e) => {
                self.observed = Some(observed);
                return Err(e);
            }
        };
        if missing != self.summary.missing_devices {
            if missing.is_empty() {
                info!("every device our routes name exists now");
            } else {
                warn!(devices = ?missing, "routes to devices that do not exist are left out until they appear");
            }
        }
        let failures = if ops.is_empty() {
            Vec::new()
        } else {
            debug!(ops = ops.len(), "netlink writes");
            for op in &ops {
                tracing::trace!(?op, "netlink write");
            }
            self.seam.write(&ops)
        };
        let failed: BTreeSet<usize> = failures.iter().map(|(i, _)| *i).collect();
        for (i, op) in ops.iter().enumerate() {
            if !failed.contains(&i) {
                record(&mut observed, op);
            }
        }
        self.summary = RoutesSummary {
            routes: observed.routes.len(),
            neighbours: observed.neighbours.len(),
            fdb: observed.fdb.len(),
            missing_devices: missing,
        };
        if let Some((i, first)) = failures.into_iter().next() {
            warn!(op = ?ops[i], error = %first, failed = failed.len(), "route writes failed; re-reading before the retry");
            // What failed may have been half done or overtaken (a device
            // that went away): read everything again before the retry.
            self.observed = None;
            self.links = None;
            return Err(first);
        }
        self.observed = Some(observed);
        self.changed = false;
        self.grace_until = grace_left.map(|d| Instant::now() + d);
        Ok(ApplyOutcome {
            reschedule_after: grace_left,
        })
    }

    fn status(&self) -> Vec<(String, String)> {
        let s = &self.summary;
        let mut out = vec![
            ("kernel.routes".into(), s.routes.to_string()),
            ("kernel.neighbours".into(), s.neighbours.to_string()),
            ("kernel.fdb".into(), s.fdb.to_string()),
        ];
        if !s.missing_devices.is_empty() {
            out.push((
                "kernel.routes.missing_devices".into(),
                s.missing_devices.join(","),
            ));
        }
        out
    }
}
