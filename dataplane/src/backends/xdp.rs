//! The XDP prefilter on host interfaces (Felix's `xdp_state.go`), through
//! the `dphandler-bpf` loader.
//!
//! Owns, per interface it is given, the XDP program attached there and its
//! pins under `<bpffs>/dphandler/xdp/<iface>/` (link and maps); at the first
//! apply, pins of interfaces no longer wanted (an earlier run's) are
//! removed. Never fails the apply: a program that cannot be loaded or
//! attached, or a map that cannot be written, wipes XDP on that interface
//! (the raw table's untracked rules, always programmed, still drop the
//! same packets), says why in status and the log, and is tried again on the
//! XDP refresh tick or when the interface changes.
//!
//! Runs in [`Phase::Links`], before IP sets, routes and tables.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use tracing::{info, instrument, warn};

use super::{ApplyOutcome, Backend, BackendError, Phase, Refresh};

/// How often the verdict counters are read for status while a prefilter
/// is attached.
const COUNTERS_EVERY: Duration = Duration::from_secs(5);

/// (packets, bytes) per verdict.
pub use dphandler_bpf::Verdicts;

/// The seam to the kernel (the real one: [`BpfSeam`]).
pub trait XdpSeam: Send + std::fmt::Debug {
    /// Interfaces with pins from any run.
    fn pinned(&mut self) -> Vec<String>;
    /// Loads and attaches (or takes over the pinned link); the mode.
    fn attach(&mut self, iface: &str) -> Result<String, String>;
    /// Detaches and removes the pins.
    fn detach(&mut self, iface: &str) -> Result<(), String>;
    fn set_failsafe(&mut self, iface: &str, ports: &[(u8, u16)]) -> Result<(), String>;
    fn update(&mut self, iface: &str, add: &[IpNet], remove: &[IpNet]) -> Result<(), String>;
    /// What the blocklist maps hold.
    fn read(&mut self, iface: &str) -> Result<BTreeSet<IpNet>, String>;
    fn verdicts(&mut self, iface: &str) -> Result<Verdicts, String>;
}

#[derive(Debug)]
struct Applied {
    mode: String,
    blocklist: BTreeSet<IpNet>,
    verdicts: Verdicts,
}

#[derive(Debug)]
pub struct Xdp {
    seam: Box<dyn XdpSeam>,
    failsafe: Vec<(u8, u16)>,
    desired: BTreeMap<String, BTreeSet<IpNet>>,
    applied: BTreeMap<String, Applied>,
    /// Interfaces where XDP could not be programmed, and why.
    failed: BTreeMap<String, String>,
    dirty: bool,
    /// Re-read the maps (refresh tick) before comparing.
    reread: bool,
    swept: bool,
    counters_at: Option<Instant>,
}

impl Xdp {
    /// `failsafe`: (protocol number, port) always let through.
    pub fn new(seam: Box<dyn XdpSeam>, failsafe: Vec<(u8, u16)>) -> Self {
        Self {
            seam,
            failsafe,
            desired: BTreeMap::new(),
            applied: BTreeMap::new(),
            failed: BTreeMap::new(),
            dirty: true,
            reread: false,
            swept: false,
            counters_at: None,
        }
    }

    /// Interface `iface`'s blocklist; `None`: no XDP there.
    pub fn set(&mut self, iface: &str, blocklist: Option<BTreeSet<IpNet>>) {
        let changed = match blocklist {
            Some(b) => self.desired.insert(iface.to_string(), b.clone()) != Some(b),
            None => self.desired.remove(iface).is_some(),
        };
        self.dirty |= changed;
    }

    pub fn desired(&self) -> &BTreeMap<String, BTreeSet<IpNet>> {
        &self.desired
    }

    /// A link came or changed: try an interface that failed again.
    pub fn link_changed(&mut self, iface: &str) {
        if self.desired.contains_key(iface) && self.failed.remove(iface).is_some() {
            self.dirty = true;
        }
    }

    /// When to read the counters next (while anything is attached).
    fn next_counters(&mut self) -> ApplyOutcome {
        self.counters_at = (!self.applied.is_empty()).then(|| Instant::now() + COUNTERS_EVERY);
        ApplyOutcome {
            reschedule_after: self.counters_at.map(|_| COUNTERS_EVERY),
        }
    }

    /// XDP off on `iface` after a failure (the raw table carries on).
    fn wipe(&mut self, iface: &str, why: String) {
        warn!(iface, reason = %why, "XDP wiped on this interface; the raw table still drops");
        self.applied.remove(iface);
        let _ = self.seam.detach(iface);
        self.failed.insert(iface.to_string(), why);
    }

    fn apply_iface(&mut self, iface: &str, want: &BTreeSet<IpNet>) {
        // The refresh attaches again: the program is swapped into our
        // pinned link, or, if the link was detached meanwhile, attached
        // anew; the maps are read back.
        let again = if self.reread {
            self.applied.remove(iface).map(|a| a.mode)
        } else {
            None
        };
        if !self.applied.contains_key(iface) {
            let mode = match self.seam.attach(iface) {
                Ok(m) if m == "adopted" => again.unwrap_or(m),
                Ok(m) => m,
                Err(why) => return self.wipe(iface, why),
            };
            if let Err(why) = self.seam.set_failsafe(iface, &self.failsafe) {
                return self.wipe(iface, why);
            }
            // Maps pinned by an earlier run are reused: start from theirs.
            let have = match self.seam.read(iface) {
                Ok(h) => h,
                Err(why) => return self.wipe(iface, why),
            };
            self.applied.insert(
                iface.to_string(),
                Applied {
                    mode,
                    blocklist: have,
                    verdicts: Verdicts::default(),
                },
            );
        }
        let have = &self.applied[iface].blocklist;
        let add: Vec<IpNet> = want.difference(have).copied().collect();
        let del: Vec<IpNet> = have.difference(want).copied().collect();
        if !(add.is_empty() && del.is_empty()) {
            if let Err(why) = self.seam.update(iface, &add, &del) {
                return self.wipe(iface, why);
            }
            if let Some(a) = self.applied.get_mut(iface) {
                a.blocklist = want.clone();
            }
        }
        if let Ok(v) = self.seam.verdicts(iface)
            && let Some(a) = self.applied.get_mut(iface)
        {
            a.verdicts = v;
        }
        self.failed.remove(iface);
    }
}

impl Backend for Xdp {
    fn name(&self) -> &'static str {
        "xdp"
    }

    fn export(&self, m: &crate::metrics::Metrics) {
        m.xdp_interfaces.set(self.applied.len() as i64);
        m.kernel.set_xdp(
            self.applied
                .iter()
                .map(|(iface, a)| {
                    let v = a.verdicts;
                    (
                        iface.clone(),
                        vec![
                            ("dropped", v.dropped.0, v.dropped.1),
                            ("failsafe", v.failsafe.0, v.failsafe.1),
                            ("passed", v.passed.0, v.passed.1),
                        ],
                    )
                })
                .collect(),
        );
    }

    fn phases(&self) -> &'static [Phase] {
        &[Phase::Links]
    }

    fn is_dirty(&self, _phase: Phase) -> bool {
        self.dirty || self.counters_at.is_some_and(|t| Instant::now() >= t)
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if refresh == Refresh::Xdp {
            self.dirty = true;
            self.reread = true;
            // Failed interfaces are tried again.
            self.failed.clear();
        }
    }

    #[instrument(level = "debug", skip_all, name = "xdp_apply")]
    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        if !self.dirty {
            // Only the counters are due.
            let ifaces: Vec<String> = self.applied.keys().cloned().collect();
            for iface in ifaces {
                if let Ok(v) = self.seam.verdicts(&iface)
                    && let Some(a) = self.applied.get_mut(&iface)
                {
                    a.verdicts = v;
                }
            }
            return Ok(self.next_counters());
        }
        if !self.swept {
            // An earlier run's pins for interfaces not wanted now.
            for iface in self.seam.pinned() {
                if !self.desired.contains_key(&iface) {
                    info!(iface, "removing an earlier run's XDP prefilter");
                    let _ = self.seam.detach(&iface);
                }
            }
            self.swept = true;
        }
        let gone: Vec<String> = self
            .applied
            .keys()
            .filter(|i| !self.desired.contains_key(*i))
            .cloned()
            .collect();
        for iface in gone {
            self.applied.remove(&iface);
            if let Err(why) = self.seam.detach(&iface) {
                warn!(iface, reason = %why, "cannot remove the XDP prefilter");
            }
        }
        self.failed.retain(|i, _| self.desired.contains_key(i));
        let desired = self.desired.clone();
        for (iface, want) in &desired {
            if self.failed.contains_key(iface) {
                continue;
            }
            self.apply_iface(iface, want);
        }
        self.dirty = false;
        self.reread = false;
        Ok(self.next_counters())
    }

    fn status(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (iface, a) in &self.applied {
            let v = a.verdicts;
            out.push((
                format!("xdp.{iface}"),
                format!(
                    "{}, {} prefixes, dropped {} pkts / {} B, failsafe {} pkts, passed {} pkts",
                    a.mode,
                    a.blocklist.len(),
                    v.dropped.0,
                    v.dropped.1,
                    v.failsafe.0,
                    v.passed.0
                ),
            ));
        }
        for (iface, why) in &self.failed {
            out.push((
                format!("xdp.{iface}"),
                format!("not programmed (the raw table drops instead): {why}"),
            ));
        }
        out
    }
}

/// The real seam: `dphandler_bpf::Filter`s, pinned under `bpffs`.
#[derive(Debug)]
pub struct BpfSeam {
    bpffs: std::path::PathBuf,
    filters: BTreeMap<String, dphandler_bpf::Filter>,
}

impl BpfSeam {
    pub fn new(bpffs: std::path::PathBuf) -> Self {
        Self {
            bpffs,
            filters: BTreeMap::new(),
        }
    }

    fn filter(&mut self, iface: &str) -> Result<&mut dphandler_bpf::Filter, String> {
        self.filters
            .get_mut(iface)
            .ok_or_else(|| format!("{iface}: not attached"))
    }
}

impl XdpSeam for BpfSeam {
    fn pinned(&mut self) -> Vec<String> {
        let dir = self.bpffs.join("dphandler").join("xdp");
        std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn attach(&mut self, iface: &str) -> Result<String, String> {
        use dphandler_bpf::Mode;
        let f = dphandler_bpf::Filter::attach(&self.bpffs, iface, &[Mode::Driver, Mode::Generic])
            .map_err(|e| e.to_string())?;
        let mode = f.mode().as_str().to_string();
        self.filters.insert(iface.to_string(), f);
        Ok(mode)
    }

    fn detach(&mut self, iface: &str) -> Result<(), String> {
        match self.filters.remove(iface) {
            Some(f) => f.detach(),
            None => dphandler_bpf::Filter::remove(&self.bpffs, iface),
        }
        .map_err(|e| e.to_string())
    }

    fn set_failsafe(&mut self, iface: &str, ports: &[(u8, u16)]) -> Result<(), String> {
        self.filter(iface)?
            .set_failsafe(ports)
            .map_err(|e| e.to_string())
    }

    fn update(&mut self, iface: &str, add: &[IpNet], remove: &[IpNet]) -> Result<(), String> {
        self.filter(iface)?
            .update_blocklist(add, remove)
            .map_err(|e| e.to_string())
    }

    fn read(&mut self, iface: &str) -> Result<BTreeSet<IpNet>, String> {
        self.filter(iface)?.blocklist().map_err(|e| e.to_string())
    }

    fn verdicts(&mut self, iface: &str) -> Result<Verdicts, String> {
        self.filter(iface)?.verdicts().map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Debug, Default)]
    struct Fake {
        pinned: Vec<String>,
        refuse: BTreeSet<String>,
        maps: BTreeMap<String, BTreeSet<IpNet>>,
        log: Vec<String>,
    }

    #[derive(Debug)]
    struct Seam(Arc<Mutex<Fake>>);

    impl XdpSeam for Seam {
        fn pinned(&mut self) -> Vec<String> {
            self.0.lock().unwrap().pinned.clone()
        }
        fn attach(&mut self, iface: &str) -> Result<String, String> {
            let mut f = self.0.lock().unwrap();
            f.log.push(format!("attach {iface}"));
            if f.refuse.contains(iface) {
                return Err(format!("{iface}: XDP cannot attach here"));
            }
            f.maps.entry(iface.into()).or_default();
            Ok("driver".into())
        }
        fn detach(&mut self, iface: &str) -> Result<(), String> {
            let mut f = self.0.lock().unwrap();
            f.log.push(format!("detach {iface}"));
            f.maps.remove(iface);
            f.pinned.retain(|p| p != iface);
            Ok(())
        }
        fn set_failsafe(&mut self, _iface: &str, _ports: &[(u8, u16)]) -> Result<(), String> {
            Ok(())
        }
        fn update(&mut self, iface: &str, add: &[IpNet], remove: &[IpNet]) -> Result<(), String> {
            let mut f = self.0.lock().unwrap();
            f.log
                .push(format!("update {iface} +{} -{}", add.len(), remove.len()));
            let m = f.maps.get_mut(iface).ok_or("not attached")?;
            for n in remove {
                m.remove(n);
            }
            m.extend(add.iter().copied());
            Ok(())
        }
        fn read(&mut self, iface: &str) -> Result<BTreeSet<IpNet>, String> {
            Ok(self
                .0
                .lock()
                .unwrap()
                .maps
                .get(iface)
                .cloned()
                .unwrap_or_default())
        }
        fn verdicts(&mut self, _iface: &str) -> Result<Verdicts, String> {
            Ok(Verdicts::default())
        }
    }

    fn nets(v: &[&str]) -> BTreeSet<IpNet> {
        v.iter().map(|n| n.parse().unwrap()).collect()
    }

    fn backend(f: &Arc<Mutex<Fake>>) -> Xdp {
        Xdp::new(Box::new(Seam(f.clone())), vec![(6, 22)])
    }

    #[test]
    fn deltas_stale_pins_and_a_failed_attach() {
        let f = Arc::new(Mutex::new(Fake {
            pinned: vec!["old0".into()],
            refuse: ["bad0".to_string()].into(),
            ..Fake::default()
        }));
        let mut x = backend(&f);
        x.set("eth0", Some(nets(&["10.0.0.1/32", "10.0.0.2/32"])));
        x.set("bad0", Some(nets(&["10.0.0.1/32"])));
        x.apply(Phase::Links).unwrap();
        {
            let f = f.lock().unwrap();
            assert_eq!(
                f.log,
                [
                    "detach old0",
                    "attach bad0",
                    "detach bad0",
                    "attach eth0",
                    "update eth0 +2 -0"
                ]
            );
        }
        let st: BTreeMap<String, String> = x.status().into_iter().collect();
        assert!(st["xdp.bad0"].starts_with("not programmed"), "{st:?}");
        assert!(st["xdp.eth0"].starts_with("driver, 2 prefixes"), "{st:?}");
        // A member goes: one delta, no reattach.
        x.set("eth0", Some(nets(&["10.0.0.2/32"])));
        x.apply(Phase::Links).unwrap();
        assert_eq!(f.lock().unwrap().log.last().unwrap(), "update eth0 +0 -1");
        // Someone edits the map: the refresh reads it and puts it right.
        f.lock()
            .unwrap()
            .maps
            .get_mut("eth0")
            .unwrap()
            .insert("192.0.2.1/32".parse().unwrap());
        x.request_resync(Refresh::Xdp);
        x.apply(Phase::Links).unwrap();
        assert_eq!(f.lock().unwrap().maps["eth0"], nets(&["10.0.0.2/32"]));
        // ... attaching again (a detached program comes back), keeping the
        // mode it had.
        assert!(
            f.lock()
                .unwrap()
                .log
                .iter()
                .filter(|l| *l == "attach eth0")
                .count()
                == 2
        );
        let st: BTreeMap<String, String> = x.status().into_iter().collect();
        assert!(st["xdp.eth0"].starts_with("driver"), "{st:?}");
        // The refresh also tried bad0 again; unwanted: detached.
        x.set("eth0", None);
        x.apply(Phase::Links).unwrap();
        assert!(!f.lock().unwrap().maps.contains_key("eth0"));
        assert!(x.status().iter().all(|(k, _)| k != "xdp.eth0"));
    }
}
