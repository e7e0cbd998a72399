//! Per-interface kernel settings for workload interfaces, as Felix sets
//! them (`endpoint_mgr.go`, `configureInterface`): for IPv4 `rp_filter=1`
//! (strict: a workload cannot spoof another's address), `route_localnet=1`,
//! `proxy_arp=1` and `neigh/<if>/proxy_delay=0` (the workload's gateway
//! 169.254.1.1 is answered at once), `forwarding=1`; for IPv6 `proxy_ndp=1`
//! and `forwarding=1`.
//!
//! Owns only those knobs of interfaces the managers name (workload
//! interfaces); nothing global. Written under `/proc/sys` of the daemon's
//! network namespace, only where the value differs; a knob of an interface
//! that vanished meanwhile is skipped (the interface is gone with it).

use std::collections::BTreeMap;
use std::path::PathBuf;

use tracing::{debug, instrument};

use super::{ApplyOutcome, Backend, BackendError, Phase, Refresh};

/// The settings of one workload interface: (path under /proc/sys, value).
pub fn workload_knobs(iface: &str, ipv6: bool) -> Vec<(String, &'static str)> {
    let mut v = vec![
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
    changed: bool,
}

impl Sysctls {
    /// `root` is `/proc/sys` (a directory of files in tests).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            desired: BTreeMap::new(),
            seen: BTreeMap::new(),
            changed: false,
        }
    }

    pub fn set(&mut self, desired: BTreeMap<String, &'static str>) {
        if desired != self.desired {
            self.desired = desired;
            self.changed = true;
        }
    }
}

impl Backend for Sysctls {
    fn name(&self) -> &'static str {
        "sysctls"
    }

    fn phases(&self) -> &'static [Phase] {
        &[Phase::RoutesAndRules]
    }

    fn is_dirty(&self, phase: Phase) -> bool {
        phase == Phase::RoutesAndRules && self.changed
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if refresh == Refresh::Routes {
            self.seen.clear();
            self.changed = !self.desired.is_empty();
        }
    }

    #[instrument(level = "debug", skip(self), fields(backend = "sysctls"))]
    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        self.seen.retain(|k, _| self.desired.contains_key(k));
        for (key, want) in &self.desired {
            if self.seen.get(key).map(String::as_str) == Some(*want) {
                continue;
            }
            let path = self.root.join(key);
            let now = match std::fs::read_to_string(&path) {
                Ok(s) => s.trim().to_string(),
                // The interface is gone (or the knob does not exist in this
                // kernel): nothing to set.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(BackendError::Io {
                        backend: "sysctls",
                        context: format!("reading {}", path.display()),
                        source,
                    });
                }
            };
            if now != *want {
                debug!(%key, from = %now, to = want, "sysctl");
                match std::fs::write(&path, want) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(source) => {
                        return Err(BackendError::Io {
                            backend: "sysctls",
                            context: format!("writing {want} to {}", path.display()),
                            source,
                        });
                    }
                }
            }
            self.seen.insert(key.clone(), (*want).to_string());
        }
        self.changed = false;
        Ok(ApplyOutcome::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(s.is_dirty(Phase::RoutesAndRules));
        s.apply(Phase::RoutesAndRules).unwrap();
        assert_eq!(
            std::fs::read_to_string(knob.join("proxy_arp")).unwrap(),
            "1"
        );
        assert_eq!(
            std::fs::read_to_string(knob.join("rp_filter")).unwrap(),
            "1\n",
            "left as it was"
        );
        assert!(!s.is_dirty(Phase::RoutesAndRules));
    }
}
