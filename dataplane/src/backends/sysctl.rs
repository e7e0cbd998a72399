//! Kernel settings under `/proc/sys`, in two objects.
//!
//! [`Sysctls`]: per-interface settings of workload interfaces, as Felix
//! sets them (`endpoint_mgr.go`, `configureInterface`): `accept_ra=0`
//! (always, as Felix: a workload must not be able to reconfigure the host
//! with router advertisements); for IPv4 `rp_filter=1` (strict: a workload
//! cannot spoof another's address), `route_localnet=1`, `proxy_arp=1` and
//! `neigh/<if>/proxy_delay=0` (the workload's gateway 169.254.1.1 is
//! answered at once), `forwarding=1`; for IPv6 `proxy_ndp=1` and
//! `forwarding=1`. Owns only those knobs of the interfaces the managers
//! name; a knob of an interface that vanished meanwhile is skipped (the
//! interface is gone with it).
//!
//! [`NodeSettings`]: the node-wide settings Felix makes at start
//! (`int_dataplane.go`, `configureKernel`): with IP forwarding enabled (the
//! default, Felix's `IPForwarding=Enabled`) `net.ipv4.ip_forward=1` and,
//! with IPv6, `net.ipv6.conf.all.forwarding=1` — the per-interface IPv6
//! `forwarding` knob does not make the kernel forward IPv6, only `all`
//! does; always `net.netfilter.nf_conntrack_acct=1`, and one try of
//! `modprobe nf_conntrack_proto_sctp` (without it some kernels mark every
//! SCTP packet INVALID; in most it is built in, and the try fails
//! harmlessly). Owns nothing else global; with forwarding disabled the two
//! forwarding knobs are never written.
//!
//! Both write only where the value differs, in the daemon's network
//! namespace.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use tracing::{debug, error, info, instrument, warn};

use super::{ApplyOutcome, Backend, BackendError, Phase, Refresh};

/// The settings of one workload interface: (path under /proc/sys, value).
pub fn workload_knobs(iface: &str, ipv6: bool) -> Vec<(String, &'static str)> {
    let mut v = vec![
        (format!("net/ipv6/conf/{iface}/accept_ra"), "0"),
        (format!("net/ipv4/conf/{iface}/rp_filter"), "1"),
        (format!("net/ipv4/conf/{iface}/route_localnet"), "1"),
        (format!("net/ipv4/conf/{iface}/proxy_arp"), "1"),
        (format!("net/ipv4/neigh/{iface}/proxy_delay"), "0"),
        (format!("net/ipv4/conf/{iface}/forwarding"), "1"),
    ];
    if ipv6 {
        v.push((format!("net/ipv6/conf/{iface}/proxy_ndp"), "1"));
        v.push((format!("net/ipv6/conf/{iface}/forwarding"), "1"));
    }
    v
}

#[derive(Debug)]
pub struct Sysctls {
    root: PathBuf,
    desired: BTreeMap<String, &'static str>,
    /// What we last found or wrote.
    seen: BTreeMap<String, String>,
    /// Every knob is to be looked at by the next apply.
    all: bool,
    /// Else only these (set or gone since the last apply).
    pending: BTreeSet<String>,
}

impl Sysctls {
    /// `root` is `/proc/sys` (a directory of files in tests).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            desired: BTreeMap::new(),
            seen: BTreeMap::new(),
            all: false,
            pending: BTreeSet::new(),
        }
    }

    pub fn set(&mut self, desired: BTreeMap<String, &'static str>) {
        if desired != self.desired {
            self.desired = desired;
            self.all = true;
        }
    }

    /// The knobs as set.
    pub fn desired(&self) -> &BTreeMap<String, &'static str> {
        &self.desired
    }

    /// Some knobs set (`Some`) or no longer ours (`None`), the others as
    /// they were: the next apply looks at these alone.
    pub fn patch(&mut self, knobs: impl IntoIterator<Item = (String, Option<&'static str>)>) {
        for (key, want) in knobs {
            let changed = match want {
                Some(v) => self.desired.insert(key.clone(), v) != Some(v),
                None => self.desired.remove(&key).is_some(),
            };
            if changed {
                self.pending.insert(key);
            }
        }
    }
}

impl Backend for Sysctls {
    fn name(&self) -> &'static str {
        "sysctls"
    }

    /// After the tables: `forwarding=1` on a workload interface is what
    /// lets the kernel forward IPv4 from it.
    fn phases(&self) -> &'static [Phase] {
        &[Phase::InterfaceSettings]
    }

    fn is_dirty(&self, phase: Phase) -> bool {
        phase == Phase::InterfaceSettings && (self.all || !self.pending.is_empty())
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if refresh == Refresh::Routes {
            self.seen.clear();
            self.all = !self.desired.is_empty();
        }
    }

    #[instrument(level = "debug", skip(self), fields(backend = "sysctls"))]
    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        let pending = std::mem::take(&mut self.pending);
        let keys: Box<dyn Iterator<Item = (&String, &&'static str)>> = if self.all {
            self.seen.retain(|k, _| self.desired.contains_key(k));
            Box::new(self.desired.iter())
        } else {
            for k in pending.iter().filter(|k| !self.desired.contains_key(*k)) {
                self.seen.remove(k);
            }
            Box::new(pending.iter().filter_map(|k| self.desired.get_key_value(k)))
        };
        for (key, want) in keys {
            if self.seen.get(key).map(String::as_str) == Some(*want) {
                continue;
            }
            // A failure leaves every knob to be looked at again.
            let found = ensure(&self.root, key, want).inspect_err(|_| self.all = true);
            match found? {
                // The interface is gone (or the knob does not exist in this
                // kernel): nothing to set.
                Ensured::Absent => continue,
                Ensured::Already => {}
                Ensured::Changed { from } => debug!(%key, %from, to = want, "sysctl"),
            }
            self.seen.insert(key.clone(), (*want).to_string());
        }
        self.all = false;
        Ok(ApplyOutcome::default())
    }
}

/// What [`ensure`] found.
#[derive(Debug, PartialEq, Eq)]
enum Ensured {
    /// No such knob (the interface is gone, or not in this kernel).
    Absent,
    /// It had the value already.
    Already,
    /// We wrote it; it was `from`.
    Changed { from: String },
}

/// Sets `root/key` to `want` unless it has that value already.
fn ensure(root: &Path, key: &str, want: &str) -> Result<Ensured, BackendError> {
    let path = root.join(key);
    let now = match std::fs::read_to_string(&path) {
        Ok(s) => s.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Ensured::Absent),
        Err(source) => {
            return Err(BackendError::Io {
                backend: "sysctls",
                context: format!("reading {}", path.display()),
                source,
            });
        }
    };
    if now == want {
        return Ok(Ensured::Already);
    }
    match std::fs::write(&path, want) {
        Ok(()) => Ok(Ensured::Changed { from: now }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Ensured::Absent),
        Err(source) => Err(BackendError::Io {
            backend: "sysctls",
            context: format!("writing {want} to {}", path.display()),
            source,
        }),
    }
}

/// Felix's `IPForwarding`: whether the daemon turns on the node's global
/// forwarding sysctls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Forwarding {
    #[default]
    Enabled,
    Disabled,
}

impl std::str::FromStr for Forwarding {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "enabled" => Ok(Self::Enabled),
            "disabled" => Ok(Self::Disabled),
            _ => Err(format!("{s:?}: expected enabled or disabled")),
        }
    }
}

/// The conntrack module some kernels need for SCTP (Felix tries it too).
pub const SCTP_CONNTRACK_MODULE: &str = "nf_conntrack_proto_sctp";

/// The node-wide settings (see the module header). Applied in the last
/// phase of the first apply — so forwarding is turned on only once the
/// rules that police it are in the kernel, and `nf_conntrack_acct` exists
/// (the tables' conntrack matches load `nf_conntrack`) — and checked again
/// on every route refresh: a setting changed behind our back is put back
/// with a warning.
#[derive(Debug)]
pub struct NodeSettings {
    root: PathBuf,
    knobs: Vec<(&'static str, &'static str)>,
    /// Modules still to try (once each), and the program that loads them.
    modules: Vec<&'static str>,
    modprobe: PathBuf,
    /// Whether the knobs are to be checked at the next apply.
    pending: bool,
    /// Whether they were checked before (a change found later is a
    /// change made by someone else).
    checked_once: bool,
}

impl NodeSettings {
    /// `root` is `/proc/sys` (a directory of files in tests).
    pub fn new(root: impl Into<PathBuf>, forwarding: Forwarding, ipv6: bool) -> Self {
        let mut knobs = Vec::new();
        if forwarding == Forwarding::Enabled {
            knobs.push(("net/ipv4/ip_forward", "1"));
            if ipv6 {
                knobs.push(("net/ipv6/conf/all/forwarding", "1"));
            }
        }
        knobs.push(("net/netfilter/nf_conntrack_acct", "1"));
        Self {
            root: root.into(),
            knobs,
            modules: vec![SCTP_CONNTRACK_MODULE],
            modprobe: "modprobe".into(),
            pending: true,
            checked_once: false,
        }
    }

    /// Load modules with this program instead of `modprobe` (tests).
    pub fn with_modprobe(mut self, program: impl Into<PathBuf>) -> Self {
        self.modprobe = program.into();
        self
    }

    /// The knobs this object keeps: (path under /proc/sys, value).
    pub fn knobs(&self) -> &[(&'static str, &'static str)] {
        &self.knobs
    }

    /// One try per module; the outcome is logged, never an error (as in
    /// Felix: the module may be built in or absent, and nothing we do
    /// depends on it).
    fn try_modules(&mut self) {
        for module in std::mem::take(&mut self.modules) {
            match std::process::Command::new(&self.modprobe)
                .arg(module)
                .stdin(std::process::Stdio::null())
                .output()
            {
                Ok(out) if out.status.success() => info!(module, "loaded kernel module"),
                Ok(out) => info!(
                    module,
                    status = %out.status,
                    stderr = %String::from_utf8_lossy(&out.stderr).trim(),
                    "kernel module not loaded (built in or not in this kernel): going on"
                ),
                Err(e) => info!(
                    module,
                    program = %self.modprobe.display(),
                    error = %e,
                    "could not run modprobe: going on"
                ),
            }
        }
    }
}

impl Backend for NodeSettings {
    fn name(&self) -> &'static str {
        "node-settings"
    }

    fn phases(&self) -> &'static [Phase] {
        &[Phase::NodeSettings]
    }

    fn is_dirty(&self, phase: Phase) -> bool {
        phase == Phase::NodeSettings && (self.pending || !self.modules.is_empty())
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if refresh == Refresh::Routes {
            self.pending = true;
        }
    }

    /// Never fails: a setting that cannot be written is logged as an error
    /// and tried again at the next route refresh (as Felix, which logs and
    /// goes on). Failing the apply would hold back every other change
    /// until the retry, for a knob that a retry seldom fixes (a read-only
    /// `/proc/sys`).
    #[instrument(level = "debug", skip(self), fields(backend = "node-settings"))]
    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        self.try_modules();
        for (key, want) in &self.knobs {
            match ensure(&self.root, key, want) {
                Ok(Ensured::Already) => debug!(key, value = want, "node setting as wanted"),
                Ok(Ensured::Changed { from }) if self.checked_once => {
                    warn!(key, %from, to = want, "node setting was changed by someone else: put back")
                }
                Ok(Ensured::Changed { from }) => {
                    info!(key, %from, to = want, "node setting changed")
                }
                Ok(Ensured::Absent) => {
                    warn!(
                        key,
                        "node setting not in this kernel (module not loaded?): left alone"
                    )
                }
                Err(e) => {
                    error!(key, error = %e, "cannot make node setting; trying again at the next route refresh")
                }
            }
        }
        self.pending = false;
        self.checked_once = true;
        Ok(ApplyOutcome::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workload_interface_forwards_only_after_the_tables() {
        // IPv4 forwards from an interface whose own `forwarding` is 1,
        // whatever `ip_forward` says: set before the rules, a new node's
        // workloads talked unpoliced until the tables were written (a real
        // Felix's start showed it in 3 of 15 runs).
        let s = Sysctls::new(Path::new("/nonexistent"));
        assert_eq!(s.phases(), &[Phase::InterfaceSettings]);
        let at = |p: Phase| Phase::ALL.iter().position(|q| *q == p).unwrap();
        assert!(at(Phase::InterfaceSettings) > at(Phase::Tables));
        assert!(
            workload_knobs("cali1", false)
                .iter()
                .any(|(k, v)| k == "net/ipv4/conf/cali1/forwarding" && *v == "1")
        );
    }

    #[test]
    fn writes_only_what_differs_and_skips_vanished_interfaces() {
        let dir = tempfile::tempdir().unwrap();
        let knob = dir.path().join("net/ipv4/conf/cali1");
        std::fs::create_dir_all(&knob).unwrap();
        std::fs::write(knob.join("proxy_arp"), "0\n").unwrap();
        std::fs::write(knob.join("rp_filter"), "1\n").unwrap();
        let mut s = Sysctls::new(dir.path());
        let desired: BTreeMap<String, &'static str> = workload_knobs("cali1", false)
            .into_iter()
            .chain(workload_knobs("gone0", false))
            .collect();
        s.set(desired);
        assert!(s.is_dirty(Phase::InterfaceSettings));
        s.apply(Phase::InterfaceSettings).unwrap();
        assert_eq!(
            std::fs::read_to_string(knob.join("proxy_arp")).unwrap(),
            "1"
        );
        assert_eq!(
            std::fs::read_to_string(knob.join("rp_filter")).unwrap(),
            "1\n",
            "left as it was"
        );
        assert!(!s.is_dirty(Phase::InterfaceSettings));
    }

    /// A patch is applied alone: the knobs it names are looked at (and a
    /// knob of another interface changed by hand meanwhile is not, until
    /// a refresh); a knob no longer ours is forgotten, so that it is
    /// written again if it comes back.
    #[test]
    fn a_patch_looks_at_its_own_knobs() {
        let dir = tempfile::tempdir().unwrap();
        for i in ["cali1", "cali2"] {
            let knob = dir.path().join(format!("net/ipv4/conf/{i}"));
            std::fs::create_dir_all(&knob).unwrap();
            std::fs::write(knob.join("proxy_arp"), "0\n").unwrap();
        }
        let arp = |i: &str| format!("net/ipv4/conf/{i}/proxy_arp");
        let mut s = Sysctls::new(dir.path());
        s.set([(arp("cali1"), "1")].into_iter().collect());
        s.apply(Phase::InterfaceSettings).unwrap();
        assert_eq!(read(&dir, &arp("cali1")), "1");
        // By hand, behind our back.
        std::fs::write(dir.path().join(arp("cali1")), "0\n").unwrap();
        s.patch([(arp("cali2"), Some("1"))]);
        assert!(s.is_dirty(Phase::InterfaceSettings));
        s.apply(Phase::InterfaceSettings).unwrap();
        assert_eq!(read(&dir, &arp("cali2")), "1");
        assert_eq!(read(&dir, &arp("cali1")), "0", "not in the patch");
        // The same again is no change.
        s.patch([(arp("cali2"), Some("1"))]);
        assert!(!s.is_dirty(Phase::InterfaceSettings));
        // Gone, set by hand, back: written again.
        s.patch([(arp("cali2"), None)]);
        s.apply(Phase::InterfaceSettings).unwrap();
        std::fs::write(dir.path().join(arp("cali2")), "0\n").unwrap();
        s.patch([(arp("cali2"), Some("1"))]);
        s.apply(Phase::InterfaceSettings).unwrap();
        assert_eq!(read(&dir, &arp("cali2")), "1");
        // A refresh looks at every knob.
        s.request_resync(Refresh::Routes);
        s.apply(Phase::InterfaceSettings).unwrap();
        assert_eq!(read(&dir, &arp("cali1")), "1");
        assert_eq!(s.desired().len(), 2);
    }

    /// A /proc/sys of files, with the three global knobs at `v4`, `v6`
    /// and `acct`.
    fn proc_sys(v4: &str, v6: &str, acct: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (key, value) in [
            ("net/ipv4/ip_forward", v4),
            ("net/ipv6/conf/all/forwarding", v6),
            ("net/netfilter/nf_conntrack_acct", acct),
        ] {
            let path = dir.path().join(key);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, format!("{value}\n")).unwrap();
        }
        dir
    }

    fn read(dir: &tempfile::TempDir, key: &str) -> String {
        std::fs::read_to_string(dir.path().join(key))
            .unwrap()
            .trim()
            .to_string()
    }

    /// A stand-in for modprobe that appends its argument to `log`.
    fn fake_modprobe(dir: &tempfile::TempDir) -> (PathBuf, PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let (prog, log) = (dir.path().join("modprobe"), dir.path().join("modprobe.log"));
        std::fs::write(
            &prog,
            format!("#!/bin/sh\necho \"$1\" >> {}\nexit 1\n", log.display()),
        )
        .unwrap();
        std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
        (prog, log)
    }

    #[test]
    fn node_settings_turn_forwarding_on_after_the_tables_and_keep_it() {
        let dir = proc_sys("0", "0", "0");
        let (prog, log) = fake_modprobe(&dir);
        let mut n = NodeSettings::new(dir.path(), Forwarding::Enabled, true).with_modprobe(&prog);
        assert_eq!(n.phases(), &[Phase::NodeSettings]);
        assert!(
            Phase::ALL.last() == Some(&Phase::NodeSettings),
            "the last phase: after the tables"
        );
        assert!(n.is_dirty(Phase::NodeSettings));
        assert!(!n.is_dirty(Phase::Tables));
        n.apply(Phase::NodeSettings).unwrap();
        assert_eq!(read(&dir, "net/ipv4/ip_forward"), "1");
        assert_eq!(read(&dir, "net/ipv6/conf/all/forwarding"), "1");
        assert_eq!(read(&dir, "net/netfilter/nf_conntrack_acct"), "1");
        assert!(!n.is_dirty(Phase::NodeSettings));
        // Someone turns IPv6 forwarding off: put back at the route refresh
        // (and only then); the module is tried once, its failure ignored.
        std::fs::write(dir.path().join("net/ipv6/conf/all/forwarding"), "0").unwrap();
        n.request_resync(Refresh::IpSets);
        assert!(!n.is_dirty(Phase::NodeSettings));
        n.request_resync(Refresh::Routes);
        assert!(n.is_dirty(Phase::NodeSettings));
        n.apply(Phase::NodeSettings).unwrap();
        assert_eq!(read(&dir, "net/ipv6/conf/all/forwarding"), "1");
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            format!("{SCTP_CONNTRACK_MODULE}\n")
        );
    }

    #[test]
    fn node_settings_disabled_or_without_ipv6_leave_forwarding_alone() {
        let dir = proc_sys("0", "0", "0");
        let (prog, _) = fake_modprobe(&dir);
        let mut n = NodeSettings::new(dir.path(), Forwarding::Disabled, true).with_modprobe(&prog);
        n.apply(Phase::NodeSettings).unwrap();
        assert_eq!(read(&dir, "net/ipv4/ip_forward"), "0");
        assert_eq!(read(&dir, "net/ipv6/conf/all/forwarding"), "0");
        assert_eq!(
            read(&dir, "net/netfilter/nf_conntrack_acct"),
            "1",
            "as Felix"
        );

        let dir = proc_sys("0", "0", "1");
        let mut n = NodeSettings::new(dir.path(), Forwarding::Enabled, false)
            .with_modprobe(dir.path().join("no-such-program"));
        n.apply(Phase::NodeSettings).unwrap();
        assert_eq!(read(&dir, "net/ipv4/ip_forward"), "1");
        assert_eq!(read(&dir, "net/ipv6/conf/all/forwarding"), "0", "no --ipv6");
    }

    #[test]
    fn node_settings_go_on_when_a_knob_is_missing_or_unwritable() {
        let dir = tempfile::tempdir().unwrap();
        // No nf_conntrack (no acct knob); ip_forward a directory, so that
        // reading it fails.
        std::fs::create_dir_all(dir.path().join("net/ipv4/ip_forward")).unwrap();
        let mut n = NodeSettings::new(dir.path(), Forwarding::Enabled, true)
            .with_modprobe(dir.path().join("no-such-program"));
        assert!(n.apply(Phase::NodeSettings).is_ok(), "logged, not failed");
        assert!(!n.is_dirty(Phase::NodeSettings));
    }

    #[test]
    fn forwarding_parses_as_felix_spells_it() {
        assert_eq!("Enabled".parse::<Forwarding>(), Ok(Forwarding::Enabled));
        assert_eq!("disabled".parse::<Forwarding>(), Ok(Forwarding::Disabled));
        assert!(
            "on".parse::<Forwarding>()
                .unwrap_err()
                .contains("enabled or disabled")
        );
    }
}
