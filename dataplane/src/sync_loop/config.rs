//! The loop's share of a `ConfigUpdate` ([`crate::model::config`]): the
//! check that names a bad key, the refresh intervals and the log level
//! (live), the keys that need a restart (reported, kept in the state
//! directory for the next start), and the keys nobody reads (listed once
//! at debug level). The managers take the keys that shape what they
//! render.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use tracing::{debug, info, warn};

use crate::model::config::FelixConfig;

/// Changes the daemon's log filter: `Some(level)` from `LogSeverityScreen`,
/// `None` back to the flag's.
pub type LogLevelHook = Box<dyn Fn(Option<&str>) -> Result<(), String> + Send>;

/// What the daemon runs with, for the keys that need a restart, and where
/// to keep what the calc graph wants of them.
#[derive(Default)]
pub struct ConfigSettings {
    /// `InterfacePrefix`, `IptablesMarkMask`, `IPForwarding` as running.
    pub running: FelixConfig,
    /// The file the restart keys of the last ConfigUpdate are kept in
    /// (read at the next start); `None`: nowhere.
    pub keep: Option<PathBuf>,
    /// Sets the log level a ConfigUpdate names (`None` in it: back to
    /// the default); `None`: an operator's `--log` holds.
    pub log_level: Option<LogLevelHook>,
}

impl std::fmt::Debug for ConfigSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigSettings")
            .field("running", &self.running)
            .field("keep", &self.keep)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
pub(super) struct ConfigState {
    settings: ConfigSettings,
    /// The last ConfigUpdate's keys, parsed.
    pub(super) current: FelixConfig,
    unknown_seen: BTreeSet<String>,
    /// key → (running, wanted).
    restart_needed: BTreeMap<&'static str, (String, String)>,
    /// The refresh intervals changed: the loop re-arms its tickers.
    pub(super) refresh_changed: bool,
    log_level: Option<String>,
}

/// The kept restart keys, as `key=value` lines.
pub fn read_kept(path: &std::path::Path) -> std::io::Result<Vec<(String, String)>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

fn write_kept(path: &std::path::Path, kv: &BTreeMap<String, String>) -> std::io::Result<()> {
    if kv.is_empty() {
        return match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
    }
    let text: String = kv.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    if std::fs::read_to_string(path).is_ok_and(|t| t == text) {
        return Ok(());
    }
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(dir)?;
    // Written whole, synced, renamed into place, the rename synced: after
    // a crash or a power cut the next start reads the old keys or the new
    // ones, never a torn or empty file.
    let tmp = path.with_extension("tmp");
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

impl ConfigState {
    pub(super) fn new(settings: ConfigSettings) -> Self {
        Self {
            settings,
            ..Self::default()
        }
    }

    /// `Err((field, why))` for a value that cannot be parsed.
    pub(super) fn check(kv: &[(String, String)]) -> Result<(), (String, String)> {
        FelixConfig::parse(kv)
            .map(|_| ())
            .map_err(|(k, why)| (format!("config_update.config[{k}]"), why))
    }

    /// A checked ConfigUpdate.
    pub(super) fn on_config(&mut self, kv: &[(String, String)]) {
        let c = FelixConfig::parse(kv).unwrap_or_default();
        for k in FelixConfig::unknown(kv) {
            if self.unknown_seen.insert(k.to_string()) {
                debug!(key = k, "ConfigUpdate key not used by this dataplane");
            }
        }
        let refresh = |c: &FelixConfig| (c.iptables_refresh, c.ipsets_refresh, c.route_refresh);
        if refresh(&c) != refresh(&self.current) {
            info!(
                iptables = ?c.iptables_refresh,
                ipsets = ?c.ipsets_refresh,
                routes = ?c.route_refresh,
                "refresh intervals from ConfigUpdate (unset: the flags')"
            );
            self.refresh_changed = true;
        }
        if c.log_level != self.log_level {
            match &self.settings.log_level {
                Some(hook) => match hook(c.log_level.as_deref()) {
                    Ok(()) => {
                        info!(level = ?c.log_level, "log level from ConfigUpdate (unset: --log)")
                    }
                    Err(e) => warn!(error = %e, "could not change the log level"),
                },
                None => info!(
                    level = ?c.log_level,
                    "LogSeverityScreen from ConfigUpdate not applied: --log is given"
                ),
            }
            self.log_level = c.log_level.clone();
        }
        // The keys that need a restart: what differs from the running
        // value is reported and kept for the next start.
        let r = &self.settings.running;
        let mut needed = BTreeMap::new();
        if let (Some(w), Some(h)) = (&c.interface_prefix, &r.interface_prefix)
            && w != h
        {
            needed.insert("InterfacePrefix", (h.clone(), w.clone()));
        }
        if let (Some(w), Some(h)) = (c.mark_mask, r.mark_mask)
            && w != h
        {
            needed.insert("IptablesMarkMask", (format!("{h:#x}"), format!("{w:#x}")));
        }
        if let (Some(w), Some(h)) = (c.ip_forwarding, r.ip_forwarding)
            && w != h
        {
            let s = |b: bool| if b { "Enabled" } else { "Disabled" }.to_string();
            needed.insert("IPForwarding", (s(h), s(w)));
        }
        for (k, (have, want)) in &needed {
            if self.restart_needed.get(k) != Some(&(have.clone(), want.clone())) {
                warn!(
                    key = k,
                    running = %have,
                    wanted = %want,
                    "ConfigUpdate changes a setting that needs a restart: kept, in force after the daemon restarts"
                );
            }
        }
        self.restart_needed = needed;
        if let Some(path) = &self.settings.keep
            && let Err(e) = write_kept(path, &FelixConfig::restart_keys(kv))
        {
            warn!(path = %path.display(), error = %e, "could not keep the ConfigUpdate's restart keys");
        }
        self.current = c;
    }

    /// A refresh interval: the ConfigUpdate's, else the flag's.
    pub(super) fn refresh(flag: Duration, key: Option<Duration>) -> Duration {
        key.unwrap_or(flag)
    }

    /// For status: what waits for a restart.
    pub(super) fn details(&self) -> Vec<(String, String)> {
        self.restart_needed
            .iter()
            .map(|(k, (have, want))| {
                (
                    format!("config.restart_needed.{k}"),
                    format!("running {have}, ConfigUpdate says {want}: in force after a restart"),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::kv;

    #[test]
    fn restart_keys_are_reported_and_kept_live_ones_applied() {
        let dir = tempfile::tempdir().unwrap();
        let keep = dir.path().join("felix-config");
        let levels = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = levels.clone();
        let mut s = ConfigState::new(ConfigSettings {
            running: FelixConfig::parse(&kv(&[
                ("InterfacePrefix", "cali"),
                ("IptablesMarkMask", "0xffff0000"),
                ("IPForwarding", "Enabled"),
            ]))
            .unwrap(),
            keep: Some(keep.clone()),
            log_level: Some(Box::new(move |l| {
                seen.lock().unwrap().push(l.map(str::to_string));
                Ok(())
            })),
        });
        let c = kv(&[
            ("InterfacePrefix", "cali"),
            ("IptablesMarkMask", "0xff000000"),
            ("IPForwarding", "Disabled"),
            ("IptablesRefreshInterval", "30"),
            ("LogSeverityScreen", "Debug"),
        ]);
        ConfigState::check(&c).unwrap();
        s.on_config(&c);
        let d: BTreeMap<_, _> = s.details().into_iter().collect();
        assert_eq!(d.len(), 2, "{d:?}");
        assert!(d["config.restart_needed.IptablesMarkMask"].contains("running 0xffff0000"));
        assert!(d["config.restart_needed.IPForwarding"].contains("says Disabled"));
        assert!(s.refresh_changed);
        assert_eq!(
            ConfigState::refresh(Duration::from_secs(180), s.current.iptables_refresh),
            Duration::from_secs(30)
        );
        assert_eq!(*levels.lock().unwrap(), vec![Some("debug".to_string())]);
        assert_eq!(
            read_kept(&keep).unwrap(),
            kv(&[
                ("IPForwarding", "Disabled"),
                ("InterfacePrefix", "cali"),
                ("IptablesMarkMask", "0xff000000"),
            ])
        );

        // The keys gone again: the flags', nothing waits, the log level back.
        s.refresh_changed = false;
        s.on_config(&[]);
        assert!(s.details().is_empty());
        assert!(s.refresh_changed);
        assert_eq!(levels.lock().unwrap().last(), Some(&None));
        assert!(read_kept(&keep).unwrap().is_empty());

        let (field, why) = ConfigState::check(&kv(&[("VXLANPort", "0")])).unwrap_err();
        assert_eq!(field, "config_update.config[VXLANPort]");
        assert!(why.contains("UDP port"), "{why}");
    }
}
