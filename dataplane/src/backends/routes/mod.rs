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
//!
//! Applies are incremental: a change of the desired state marks only the
//! keys it touches, and the next apply looks at those alone (one route in
//! 100,000 costs one netlink request, not a walk of every route); after a
//! read (start, refresh, failure) every key is looked at once.

pub mod kernel;
pub mod netlink;
mod plan;
#[cfg(test)]
mod tests;

/// Routes over an [`EmptyKernel`], owning workload routes (`cali`,
/// protocol 3) and routing tables `tables`: for tests of what others hand
/// this backend.
#[cfg(test)]
pub(crate) fn empty(tables: Vec<u32>) -> Routes {
    Routes::new(
        RouteOwnership {
            exclusive_protocol: 80,
            device_protocol: 3,
            workload_prefix: "cali".into(),
            remove_external_routes: true,
            tunnel_devices: vec![],
            tables,
        },
        Box::new(EmptyKernel),
    )
}

/// A kernel with no links, routes or neighbours that takes every write:
/// for tests of what others hand this backend.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct EmptyKernel;

#[cfg(test)]
impl RouteSeam for EmptyKernel {
    fn links(&mut self) -> Result<Vec<Link>, BackendError> {
        Ok(vec![])
    }
    fn routes(&mut self) -> Result<Vec<KernelRoute>, BackendError> {
        Ok(vec![])
    }
    fn neighbours(&mut self) -> Result<(Vec<KernelNeighbour>, Vec<KernelFdb>), BackendError> {
        Ok((vec![], vec![]))
    }
    fn write(&mut self, _ops: &[RouteOp]) -> Vec<(usize, BackendError)> {
        vec![]
    }
}

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use tracing::{debug, info, instrument, warn};

use super::{ApplyOutcome, Backend, BackendError, Phase, Refresh};
use crate::model::MacAddr;
use crate::model::routes::{FdbEntry, Neighbour, RouteKey, RouteTarget};
pub use kernel::{
    KernelFdb, KernelNeighbour, KernelRoute, Link, RT_SCOPE_LINK, RT_SCOPE_UNIVERSE, RTN_BLACKHOLE,
    RTN_UNICAST, RouteOp, RouteOwnership, RouteSeam, kernel_route,
};

/// How long an unexpected route on a newly seen workload interface is
/// spared (Felix's 10 s).
pub const GRACE: Duration = Duration::from_secs(10);

/// Who asked for a route or neighbour: each manager sets its own share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RouteSource {
    /// Routes and ARP entries to this node's workloads (endpoints manager).
    Workloads,
    /// Routes to other nodes' blocks, blackholes, VTEP neighbours (routes
    /// manager).
    Cluster,
    /// WireGuard's tables (WireGuard manager).
    Wireguard,
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
    /// Route keys whose desired state changed since the last apply.
    pending: BTreeSet<RouteKey>,
    /// Neighbours or FDB entries changed since the last apply.
    neighbours_changed: bool,
    /// Routes to devices that did not exist when last looked at, by key.
    unresolved: BTreeMap<RouteKey, String>,
    /// Devices of wanted neighbours and FDB entries that did not exist.
    missing_for_neighbours: BTreeSet<String>,
    /// Unexpected routes spared by a grace period, to look at again.
    graced: BTreeSet<RouteKey>,
    /// Routes the kernel refused as invalid (a write that cannot
    /// succeed), with the target refused and why: left as they are in
    /// the kernel (their last good state) until their target changes;
    /// every other route is written.
    refused: BTreeMap<RouteKey, (RouteTarget, String)>,
    grace_until: Option<Instant>,
    /// name → index, from the last link dump (and link events since).
    links: Option<HashMap<String, u32>>,
    /// Workload interfaces that appeared after our first read, and when.
    new_links: HashMap<u32, Instant>,
    /// What the kernel holds of ours; `None` = read before the next apply
    /// (which then looks at every key).
    observed: Option<Observed>,
    grace: Duration,
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
            pending: BTreeSet::new(),
            neighbours_changed: false,
            unresolved: BTreeMap::new(),
            missing_for_neighbours: BTreeSet::new(),
            graced: BTreeSet::new(),
            refused: BTreeMap::new(),
            grace_until: None,
            links: None,
            new_links: HashMap::new(),
            observed: None,
            grace: GRACE,
            summary: RoutesSummary::default(),
        }
    }

    /// A shorter grace period (tests).
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// One source's whole share of routes and neighbours; only the keys
    /// that differ from its last share are looked at by the next apply.
    /// Routes that wait for a missing device are looked at again too (the
    /// device may exist now).
    pub fn set(
        &mut self,
        source: RouteSource,
        routes: BTreeMap<RouteKey, RouteTarget>,
        neighbours: BTreeSet<Neighbour>,
    ) {
        let old = self.routes.entry(source).or_default();
        if *old != routes {
            // A merge walk of the two sorted maps: only what differs.
            let mut a = old.iter().peekable();
            let mut b = routes.iter().peekable();
            loop {
                match (a.peek(), b.peek()) {
                    (None, None) => break,
                    (Some((ka, _)), None) => {
                        self.pending.insert(**ka);
                        a.next();
                    }
                    (None, Some((kb, _))) => {
                        self.pending.insert(**kb);
                        b.next();
                    }
                    (Some((ka, ta)), Some((kb, tb))) => match ka.cmp(kb) {
                        std::cmp::Ordering::Less => {
                            self.pending.insert(**ka);
                            a.next();
                        }
                        std::cmp::Ordering::Greater => {
                            self.pending.insert(**kb);
                            b.next();
                        }
                        std::cmp::Ordering::Equal => {
                            if ta != tb {
                                self.pending.insert(**ka);
                            }
                            a.next();
                            b.next();
                        }
                    },
                }
            }
            *old = routes;
        }
        self.set_neighbours(source, neighbours);
        self.retry_unresolved();
    }

    /// One source's whole share of neighbours.
    pub fn set_neighbours(&mut self, source: RouteSource, neighbours: BTreeSet<Neighbour>) {
        if self.neighbours.get(&source) != Some(&neighbours) {
            self.neighbours.insert(source, neighbours);
            self.neighbours_changed = true;
        }
    }

    /// Part of one source's share: routes set (`Some`) or gone (`None`)
    /// and neighbours in (`true`) or out, the rest of the share as it
    /// was; what waits for a missing device is looked at again, as after
    /// [`Self::set`]. For a source whose share is made of many small,
    /// independent parts (a workload interface's routes), so that a
    /// change costs its part, not the whole share.
    pub fn patch(
        &mut self,
        source: RouteSource,
        routes: impl IntoIterator<Item = (RouteKey, Option<RouteTarget>)>,
        neighbours: impl IntoIterator<Item = (Neighbour, bool)>,
    ) {
        for (key, target) in routes {
            self.update(source, key, target);
        }
        let share = self.neighbours.entry(source).or_default();
        for (n, present) in neighbours {
            self.neighbours_changed |= if present {
                share.insert(n)
            } else {
                share.remove(&n)
            };
        }
        self.retry_unresolved();
    }

    /// One route of one source: `None` removes it.
    pub fn update(&mut self, source: RouteSource, key: RouteKey, target: Option<RouteTarget>) {
        let share = self.routes.entry(source).or_default();
        let changed = match target {
            Some(t) => share.insert(key, t.clone()).as_ref() != Some(&t),
            None => share.remove(&key).is_some(),
        };
        if changed {
            self.pending.insert(key);
        }
    }

    /// The FDB entries of our VXLAN devices.
    pub fn set_fdb(&mut self, fdb: BTreeSet<FdbEntry>) {
        if fdb != self.fdb {
            self.fdb = fdb;
            self.neighbours_changed = true;
        }
    }

    /// What waits for a missing device is looked at again.
    fn retry_unresolved(&mut self) {
        self.pending.extend(self.unresolved.keys().copied());
        self.neighbours_changed |= !self.missing_for_neighbours.is_empty();
    }

    /// A link appeared (interface monitor). Its index may be new for an
    /// old name (a workload recreated).
    pub fn link_added(&mut self, index: u32, name: &str) {
        let Some(links) = &mut self.links else {
            return;
        };
        let old = links.insert(name.to_string(), index);
        if old != Some(index) {
            if name.starts_with(&self.own.workload_prefix) {
                self.new_links.insert(index, Instant::now());
            }
            // A new index for an old name whose removal we did not hear
            // of: what we wrote through the old index is gone.
            if let (Some(old), Some(o)) = (old, &self.observed) {
                self.pending.extend(
                    o.routes
                        .iter()
                        .filter(|(_, r)| r.oif == Some(old))
                        .map(|(k, _)| *k),
                );
            }
            self.retry_unresolved();
        }
    }

    /// Whether the kernel held route `key` of ours at the last look.
    pub fn holds(&self, key: &RouteKey) -> bool {
        self.observed
            .as_ref()
            .is_some_and(|o| o.routes.contains_key(key))
    }

    /// A route was deleted (the route watcher): if it is one we hold,
    /// forget it, so that the next apply writes it again (deleted by hand:
    /// back in milliseconds rather than at the refresh tick). Our own
    /// deletions are already forgotten; others' routes were never held.
    pub fn route_removed(&mut self, key: RouteKey) {
        if let Some(o) = &mut self.observed
            && o.routes.remove(&key).is_some()
        {
            self.pending.insert(key);
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
            let gone: Vec<RouteKey> = o
                .routes
                .iter()
                .filter(|(_, r)| r.oif == Some(index))
                .map(|(k, _)| *k)
                .collect();
            for k in gone {
                o.routes.remove(&k);
                self.pending.insert(k);
            }
            let before = (o.neighbours.len(), o.fdb.len());
            o.neighbours.retain(|(i, _), _| *i != index);
            o.fdb.retain(|f| f.ifindex != index);
            self.neighbours_changed |= before != (o.neighbours.len(), o.fdb.len());
        }
    }

    /// The routes every source wants, the lowest class winning a key.
    pub fn desired(&self) -> BTreeMap<RouteKey, RouteTarget> {
        let keys: BTreeSet<RouteKey> = self
            .routes
            .values()
            .flat_map(|m| m.keys().copied())
            .collect();
        keys.into_iter()
            .filter_map(|k| self.winner(&k).map(|t| (k, t.clone())))
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

    /// The route wanted for `key`: the lowest class among the sources.
    fn winner(&self, key: &RouteKey) -> Option<&RouteTarget> {
        self.routes
            .values()
            .filter_map(|m| m.get(key))
            .min_by_key(|t| t.class)
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

    fn read(&mut self) -> Result<Observed, BackendError> {
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
            if names.get(&f.ifindex).is_some_and(|d| self.own.is_tunnel(d)) {
                o.fdb.insert(f);
            }
        }
        debug!(
            routes = o.routes.len(),
            neighbours = o.neighbours.len(),
            fdb = o.fdb.len(),
            "read our routes"
        );
        Ok(o)
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
}

impl Backend for Routes {
    fn name(&self) -> &'static str {
        "routes"
    }

    fn export(&self, m: &crate::metrics::Metrics) {
        let s = &self.summary;
        for (kind, n) in [
            ("route", s.routes),
            ("neighbour", s.neighbours),
            ("fdb", s.fdb),
        ] {
            m.routes
                .get_or_create(&crate::metrics::KindLabel { kind: kind.into() })
                .set(n as i64);
        }
    }

    fn phases(&self) -> &'static [Phase] {
        &[Phase::RoutesAndRules]
    }

    fn is_dirty(&self, phase: Phase) -> bool {
        phase == Phase::RoutesAndRules
            && (!self.pending.is_empty()
                || self.neighbours_changed
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
        let (mut observed, full) = match self.observed.take() {
            Some(o) => (o, false),
            None => (self.read()?, true),
        };
        // After a read every key is looked at: ours in the kernel and
        // wanted; otherwise only what changed, and what a grace period held
        // back once it is over.
        let mut keys = std::mem::take(&mut self.pending);
        if full {
            keys.extend(observed.routes.keys().copied());
            keys.extend(self.routes.values().flat_map(|m| m.keys().copied()));
        }
        if self.grace_until.is_some_and(|t| Instant::now() >= t) || full {
            keys.extend(std::mem::take(&mut self.graced));
            self.grace_until = None;
        }
        // A route the kernel refused is tried again only when what is
        // wanted of it changes.
        let refused = std::mem::take(&mut self.refused);
        self.refused = refused
            .into_iter()
            .filter(|(k, (t, _))| self.winner(k) == Some(t))
            .collect();
        keys.retain(|k| !self.refused.contains_key(k));
        let neighbours = full || self.neighbours_changed;
        let plan = match self.plan(&observed, &keys, neighbours) {
            Ok(p) => p,
            Err(e) => {
                self.pending.extend(keys);
                return Err(e);
            }
        };
        for k in &keys {
            self.unresolved.remove(k);
        }
        self.unresolved.extend(plan.unresolved);
        if let Some(m) = plan.missing_for_neighbours {
            self.missing_for_neighbours = m;
        }
        let missing: Vec<String> = self
            .unresolved
            .values()
            .chain(&self.missing_for_neighbours)
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        if missing != self.summary.missing_devices {
            if missing.is_empty() {
                info!("every device our routes name exists now");
            } else {
                warn!(devices = ?missing, "routes to devices that do not exist are left out until they appear");
            }
        }
        let ops = plan.ops;
        let failures = if ops.is_empty() {
            Vec::new()
        } else {
            debug!(ops = ops.len(), looked_at = keys.len(), "netlink writes");
            for op in &ops {
                tracing::trace!(?op, "netlink write");
            }
            self.seam.write(&ops)
        };
        // A route the kernel refused as invalid belongs to that route
        // alone: it is isolated (reported, left as it is), and the rest is
        // not failed for it.
        let (permanent, failures): (Vec<_>, Vec<_>) = failures
            .into_iter()
            .partition(|(i, e)| !e.retryable() && matches!(ops[*i], RouteOp::ReplaceRoute(_)));
        for (i, e) in &permanent {
            if let RouteOp::ReplaceRoute(r) = &ops[*i]
                && let Some(t) = self.winner(&r.key).cloned()
            {
                warn!(dst = %r.key.dst, table = r.key.table, error = %e, "the kernel refused this route: it is left as it is until it changes (the rest is written)");
                self.refused.insert(r.key, (t, e.to_string()));
            }
        }
        let permanent: BTreeSet<usize> = permanent.iter().map(|(i, _)| *i).collect();
        let failed: BTreeSet<usize> = failures
            .iter()
            .map(|(i, _)| *i)
            .chain(permanent.iter().copied())
            .collect();
        for (i, op) in ops.iter().enumerate() {
            if !failed.contains(&i) {
                plan::record(&mut observed, op);
            }
        }
        self.summary = RoutesSummary {
            routes: observed.routes.len(),
            neighbours: observed.neighbours.len(),
            fdb: observed.fdb.len(),
            missing_devices: missing,
        };
        self.graced.extend(plan.graced);
        if let Some(d) = plan.grace_left {
            // The earliest end of a grace period still running.
            let t = Instant::now() + d;
            self.grace_until = Some(self.grace_until.map_or(t, |g| g.min(t)));
        }
        self.neighbours_changed = false;
        if let Some((i, first)) = failures.into_iter().next() {
            warn!(op = ?ops[i], error = %first, failed = failed.len(), "route writes failed; re-reading before the retry");
            // What failed may have been half done or overtaken (a device
            // that went away): read everything again before the retry.
            self.observed = None;
            self.links = None;
            return Err(first);
        }
        self.observed = Some(observed);
        Ok(ApplyOutcome {
            reschedule_after: self
                .grace_until
                .map(|t| t.saturating_duration_since(Instant::now())),
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
        for (k, (_, why)) in &self.refused {
            out.push((
                format!(
                    "{}routes.table{}.{}",
                    crate::status::ISOLATED,
                    k.table,
                    k.dst
                ),
                format!("{why} (left as it is until it changes)"),
            ));
        }
        out
    }
}
