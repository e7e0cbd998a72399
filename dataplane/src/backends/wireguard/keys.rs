//! The node's WireGuard private keys, one per IP version, kept in the state
//! directory (`--state-dir`) as well as on the device.
//!
//! Felix keeps its key only on the device. A userspace device
//! (`wireguard-go`) dies with its process, and a new key would make every
//! other node wait for the calc graph to carry it to them before traffic
//! flows again; the file lets a restarted daemon bring back the same key.
//! Each file holds the base64 key and a newline, mode 0600, in a 0700
//! directory, written to a temporary file in the same directory, synced
//! and renamed over the old one (a crash leaves the old key or the new
//! one, never half of one).

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use base64::Engine;

use crate::backends::BackendError;
use crate::model::IpVersion;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// The file that names the links this daemon made.
const LINKS: &str = "wireguard-links";

/// Where the keys live. `None` directory: keys are not kept (tests, or a
/// daemon told `--state-dir ""`).
#[derive(Debug, Clone)]
pub struct KeyStore {
    dir: Option<PathBuf>,
}

fn io(context: String, source: std::io::Error) -> BackendError {
    BackendError::Io {
        backend: "wireguard",
        context,
        source,
    }
}

impl KeyStore {
    pub fn new(dir: Option<PathBuf>) -> Self {
        Self { dir }
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    fn path(&self, v: IpVersion) -> Option<PathBuf> {
        let file = match v {
            IpVersion::V4 => "wireguard-v4.key",
            IpVersion::V6 => "wireguard-v6.key",
        };
        self.dir.as_ref().map(|d| d.join(file))
    }

    /// The kept key, if there is a readable one. A file that does not hold
    /// a key is an error (it is not overwritten silently: it may be an
    /// operator's).
    pub fn load(&self, v: IpVersion) -> Result<Option<[u8; 32]>, BackendError> {
        let Some(p) = self.path(v) else {
            return Ok(None);
        };
        let text = match fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(format!("reading {}", p.display()), e)),
        };
        let bytes = B64.decode(text.trim()).ok();
        match bytes.and_then(|b| <[u8; 32]>::try_from(b).ok()) {
            Some(k) => Ok(Some(k)),
            None => Err(BackendError::Parse {
                backend: "wireguard",
                reason: format!(
                    "{} does not hold a base64 WireGuard key; move it away to let a new key be made",
                    p.display()
                ),
            }),
        }
    }

    /// The WireGuard links this daemon made (`wireguard-links` in the
    /// state directory, a name a line): ours to reconfigure and delete
    /// though a ConfigUpdate named them.
    pub fn made_links(&self) -> std::collections::BTreeSet<String> {
        let Some(dir) = &self.dir else {
            return Default::default();
        };
        fs::read_to_string(dir.join(LINKS))
            .map(|t| {
                t.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Keeps `links` as the ones this daemon made (synced, renamed into
    /// place; no-op without a directory).
    pub fn store_made_links(
        &self,
        links: &std::collections::BTreeSet<String>,
    ) -> Result<(), BackendError> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        let p = dir.join(LINKS);
        let tmp = dir.join(format!("{LINKS}.tmp"));
        let text: String = links.iter().map(|l| format!("{l}\n")).collect();
        let write = || -> std::io::Result<()> {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
            let mut f = fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            fs::rename(&tmp, &p)?;
            fs::File::open(dir)?.sync_all()
        };
        write().map_err(|e| io(format!("writing {}", p.display()), e))
    }

    /// Keeps `key` (no-op without a directory or when the file holds it).
    pub fn store(&self, v: IpVersion, key: &[u8; 32]) -> Result<(), BackendError> {
        let (Some(dir), Some(p)) = (&self.dir, self.path(v)) else {
            return Ok(());
        };
        // An unreadable file stops us here too: it is not ours to replace.
        if self.load(v)? == Some(*key) {
            return Ok(());
        }
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| io(format!("creating {}", dir.display()), e))?;
        let tmp = p.with_extension("key.tmp");
        let write = || -> std::io::Result<()> {
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            // An existing temporary file keeps its mode: make sure.
            f.set_permissions(fs::Permissions::from_mode(0o600))?;
            f.write_all(format!("{}\n", B64.encode(key)).as_bytes())?;
            f.sync_all()?;
            fs::rename(&tmp, &p)?;
            // The rename is durable once the directory is synced.
            fs::File::open(dir)?.sync_all()
        };
        write().map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io(format!("writing {}", p.display()), e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_with_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        let store = KeyStore::new(Some(dir.path().join("state")));
        assert_eq!(store.load(IpVersion::V4).unwrap(), None);
        store.store(IpVersion::V4, &[7; 32]).unwrap();
        store.store(IpVersion::V6, &[9; 32]).unwrap();
        assert_eq!(store.load(IpVersion::V4).unwrap(), Some([7; 32]));
        assert_eq!(store.load(IpVersion::V6).unwrap(), Some([9; 32]));
        let p = dir.path().join("state/wireguard-v4.key");
        let mode = fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dmode = fs::metadata(dir.path().join("state"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dmode, 0o700);
        store.store(IpVersion::V4, &[8; 32]).unwrap();
        assert_eq!(store.load(IpVersion::V4).unwrap(), Some([8; 32]));
        assert!(!dir.path().join("state/wireguard-v4.key.tmp").exists());
    }

    #[test]
    fn a_file_without_a_key_is_an_error_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("wireguard-v4.key");
        fs::write(&p, "not a key\n").unwrap();
        let store = KeyStore::new(Some(dir.path().into()));
        let e = store.load(IpVersion::V4).unwrap_err().to_string();
        assert!(e.contains("does not hold a base64 WireGuard key"), "{e}");
        assert_eq!(fs::read_to_string(&p).unwrap(), "not a key\n");
    }

    #[test]
    fn no_directory_keeps_nothing() {
        let store = KeyStore::new(None);
        store.store(IpVersion::V4, &[1; 32]).unwrap();
        assert_eq!(store.load(IpVersion::V4).unwrap(), None);
    }
}
