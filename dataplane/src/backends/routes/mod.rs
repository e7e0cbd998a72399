//! Routes and static neighbours to workloads, in the main routing table.
//!
//! Owns the routes of the main table whose protocol is ours (`proto 80`,
//! Felix's, by default) — nothing else is read into our state, changed or
//! deleted — and the permanent neighbour entries it adds for workload
//! addresses. Each apply writes one `ip -force -batch` (every line is tried;
//! a route to an interface that vanished fails alone and is retried) with
//! `route replace` for what is missing or different and `route del` for
//! routes of ours that are no longer wanted. Read back with
//! `ip -j route show proto N` at start, after a failure and on the route
//! refresh tick.
//!
//! The `ip` tool rather than the rtnetlink crate: backends apply on plain
//! threads (the loop runs them off the async runtime, several at once), and
//! rtnetlink needs a runtime of its own per call there; one `ip -batch` per
//! apply is a single process like the other backends' restores, and its
//! input is plain text the recording seam can check.

pub mod iproute;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use ipnet::IpNet;
use tracing::{debug, instrument};

use super::{ApplyOutcome, Backend, BackendError, Phase, Refresh};

/// The seam: `ip -j route show proto N` (both families) and `ip -force
/// -batch -`.
pub trait RouteExec: Send + std::fmt::Debug {
    fn show(&mut self, protocol: u8) -> Result<String, BackendError>;
    fn batch(&mut self, script: &str) -> Result<(), BackendError>;
}

/// A neighbour entry we keep for a workload address.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Neighbour {
    pub addr: IpAddr,
    pub dev: String,
    pub mac: String,
}

#[derive(Debug)]
pub struct Routes {
    protocol: u8,
    exec: Box<dyn RouteExec>,
    /// destination → device.
    desired: BTreeMap<IpNet, String>,
    observed: Option<BTreeMap<IpNet, String>>,
    neighbours: BTreeSet<Neighbour>,
    /// Neighbours written, to remove when no longer wanted.
    written: BTreeSet<Neighbour>,
    changed: bool,
}

impl Routes {
    pub fn new(protocol: u8, exec: Box<dyn RouteExec>) -> Self {
        Self {
            protocol,
            exec,
            desired: BTreeMap::new(),
            observed: None,
            neighbours: BTreeSet::new(),
            written: BTreeSet::new(),
            changed: true,
        }
    }

    /// The whole desired set of routes and neighbours.
    pub fn set(&mut self, routes: BTreeMap<IpNet, String>, neighbours: BTreeSet<Neighbour>) {
        if routes != self.desired || neighbours != self.neighbours {
            self.desired = routes;
            self.neighbours = neighbours;
            self.changed = true;
        }
    }

    fn read(&mut self) -> Result<(), BackendError> {
        let text = self.exec.show(self.protocol)?;
        let routes = iproute::parse_routes(&text).map_err(|reason| BackendError::Parse {
            backend: "routes",
            reason,
        })?;
        self.observed = Some(routes);
        Ok(())
    }

    fn render(&self, observed: &BTreeMap<IpNet, String>) -> String {
        let p = self.protocol;
        let mut s = String::new();
        for (dst, dev) in &self.desired {
            if observed.get(dst) != Some(dev) {
                let _ = writeln!(s, "route replace {dst} dev {dev} proto {p} scope link");
            }
        }
        for (dst, dev) in observed {
            if !self.desired.contains_key(dst) {
                let _ = writeln!(s, "route del {dst} dev {dev} proto {p}");
            }
        }
        for n in self.neighbours.difference(&self.written) {
            let _ = writeln!(
                s,
                "neigh replace {} lladdr {} dev {} nud permanent",
                n.addr, n.mac, n.dev
            );
        }
        for n in self.written.difference(&self.neighbours) {
            let _ = writeln!(s, "neigh del {} dev {}", n.addr, n.dev);
        }
        s
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
        phase == Phase::RoutesAndRules && (self.changed || self.observed.is_none())
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
        let observed = self.observed.take().expect("read above");
        let script = self.render(&observed);
        if !script.is_empty() {
            debug!(lines = script.lines().count(), "ip -batch");
            // On failure (some line failed, e.g. a device that just went
            // away) we re-read and try again at the retry.
            self.exec.batch(&script)?;
            self.written = self.neighbours.clone();
        }
        self.observed = Some(self.desired.clone());
        self.changed = false;
        Ok(ApplyOutcome::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Debug, Clone, Default)]
    struct Rec(Arc<Mutex<(String, Vec<String>)>>);

    impl RouteExec for Rec {
        fn show(&mut self, _p: u8) -> Result<String, BackendError> {
            Ok(self.0.lock().unwrap().0.clone())
        }
        fn batch(&mut self, script: &str) -> Result<(), BackendError> {
            self.0.lock().unwrap().1.push(script.to_string());
            Ok(())
        }
    }

    #[test]
    fn only_differences_and_only_ours() {
        let rec = Rec::default();
        rec.0.lock().unwrap().0 = r#"[{"dst":"10.65.0.2","dev":"cali1","scope":"link"},{"dst":"10.65.0.9","dev":"cali9","scope":"link"}]
[{"dst":"fd00::2","dev":"cali1","metric":1024}]"#
            .into();
        let mut r = Routes::new(80, Box::new(rec.clone()));
        let routes: BTreeMap<IpNet, String> = [
            ("10.65.0.2/32", "cali1"),
            ("10.65.0.3/32", "cali2"),
            ("fd00::2/128", "cali1"),
        ]
        .iter()
        .map(|(d, dev)| (d.parse().unwrap(), dev.to_string()))
        .collect();
        let n = Neighbour {
            addr: "10.65.0.3".parse().unwrap(),
            dev: "cali2".into(),
            mac: "02:00:00:00:00:03".into(),
        };
        r.set(routes, [n].into());
        r.apply(Phase::RoutesAndRules).unwrap();
        assert_eq!(
            rec.0.lock().unwrap().1[0],
            "route replace 10.65.0.3/32 dev cali2 proto 80 scope link\n\
             route del 10.65.0.9/32 dev cali9 proto 80\n\
             neigh replace 10.65.0.3 lladdr 02:00:00:00:00:03 dev cali2 nud permanent\n"
        );
        assert!(!r.is_dirty(Phase::RoutesAndRules));
        r.set(BTreeMap::new(), BTreeSet::new());
        r.apply(Phase::RoutesAndRules).unwrap();
        let last = rec.0.lock().unwrap().1.last().unwrap().clone();
        assert!(
            last.contains("route del 10.65.0.2/32 dev cali1 proto 80\n"),
            "{last}"
        );
        assert!(last.contains("neigh del 10.65.0.3 dev cali2\n"), "{last}");
    }
}
