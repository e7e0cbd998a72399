//! WireGuard devices (`wireguard.cali`, `wg-v6.cali`; Felix's
//! `felix/wireguard`).
//!
//! Owns the links with the names it is given (one per IP version, and the
//! names they had before a rename) when they are WireGuard devices (kind
//! `wireguard`, or a `tun` that a `wireguard-go` serves), their peers, and
//! the key files in the state directory. A link of such a name and another
//! kind is not ours: it is reported, never replaced.
//!
//! Each device is carried by the kernel's module where the kernel has one
//! and by a `wireguard-go` process (userspace, the same UAPI) where it has
//! not: the first enable tries the kernel and falls back (`--wireguard-impl`
//! forces one). Configured through the `wireguard-control` crate either
//! way. The device gets this node's key (the device's own, else the kept
//! one, else a new one; see [`keys`]), the listen port, the fwmark, the MTU,
//! this node's WireGuard address and up; then its peers are made to match
//! (strays removed, changed ones replaced). The public key is announced
//! ([`Wireguard::take_events`]) whenever it changes; an empty one when the
//! version is off or WireGuard cannot run here. Off deletes the device.
//!
//! The routing table and rule that send pod traffic into the device belong
//! to the routes and rules backends (the WireGuard manager fills them).
//! Runs in [`Phase::Links`], before the routes that go through the device.

pub mod device;
#[cfg(test)]
pub(crate) mod fake;
pub mod keys;
pub mod plan;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

use ipnet::IpNet;
use tracing::{info, instrument, warn};

use super::vxlan::{ObservedLink, VxlanOp, link_fixes};
use super::{ApplyOutcome, Backend, BackendError, Phase, Refresh};
use crate::model::IpVersion;
use crate::model::wireguard::{PublicKey, WgDevice, WgImpl, WgPeer};
use keys::KeyStore;
use plan::{DeviceChange, ObservedDevice, plan};

/// How often an apply re-reads a device while one of its peers has not
/// shaken hands yet (for the handshake times in status), and for how long
/// after its peers were written (an idle peer never shakes hands; the
/// route refresh tick reads the device after that).
const HANDSHAKE_POLL: Duration = Duration::from_secs(2);
const HANDSHAKE_POLL_FOR: Duration = Duration::from_secs(30);

/// What carries a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carrier {
    Kernel,
    Userspace,
}

impl Carrier {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kernel => "kernel",
            Self::Userspace => "userspace",
        }
    }
}

/// The outcome of asking for a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Created {
    Yes,
    /// This carrier cannot make devices here (why).
    NotSupported(String),
}

/// The seam to the kernel and to `wireguard-go`.
pub trait WgSeam: Send + std::fmt::Debug {
    /// The link of that name, with its kind and addresses.
    fn link(&mut self, name: &str) -> Result<Option<ObservedLink>, BackendError>;
    /// A kernel WireGuard link.
    fn create_kernel(&mut self, name: &str) -> Result<Created, BackendError>;
    /// A `wireguard-go` serving `name`, ready for configuration.
    fn start_userspace(&mut self, name: &str) -> Result<Created, BackendError>;
    /// Whether a `wireguard-go` answers on `name`'s UAPI socket.
    fn userspace_running(&mut self, name: &str) -> bool;
    /// Deletes the link (a `wireguard-go` serving it exits).
    fn delete(&mut self, name: &str, index: u32) -> Result<(), BackendError>;
    fn read(&mut self, name: &str, carrier: Carrier) -> Result<ObservedDevice, BackendError>;
    fn configure(
        &mut self,
        name: &str,
        carrier: Carrier,
        change: &DeviceChange,
    ) -> Result<(), BackendError>;
    /// MTU, up, addresses.
    fn link_op(&mut self, op: &VxlanOp) -> Result<(), BackendError>;
    /// Makes the device shake hands with these peers now rather than when
    /// it next has a packet for them.
    fn nudge(
        &mut self,
        name: &str,
        carrier: Carrier,
        peers: &[PublicKey],
    ) -> Result<(), BackendError>;
    /// More about what carries `name` (the `wireguard-go` pid), for status.
    fn describe(&self, name: &str) -> Option<String>;
    /// A new private key.
    fn generate_key(&mut self) -> [u8; 32];
    /// What this host offers (kernel module, `wireguard-go`), as found at
    /// start.
    fn support(&self) -> String;
}

/// The public key of a private one.
pub fn public_key(private: &[u8; 32]) -> PublicKey {
    PublicKey(wireguard_control::Key(*private).get_public().0)
}

/// Where one version's device stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Off,
    Up,
    Unsupported(String),
}

#[derive(Debug)]
struct Family {
    version: IpVersion,
    /// The device's name, on or off.
    name: String,
    want: Option<WgDevice>,
    /// Names of devices of ours that must go (a renamed device).
    stale: BTreeSet<String>,
    carrier: Option<Carrier>,
    state: State,
    /// The public key last announced (`""`: none).
    announced: Option<String>,
    dirty: bool,
    reread_at: Option<Instant>,
    /// The device as last read, and written since (status: peers and
    /// handshakes).
    observed: Option<ObservedDevice>,
    /// `observed` is what the device holds: no read before the next write
    /// (cleared by a resync, a link event, a handshake poll, a failure).
    trusted: bool,
    poll_until: Option<Instant>,
    key_warning: Option<String>,
    /// The key the state directory holds (written or read by us).
    kept: Option<[u8; 32]>,
}

impl Family {
    fn new(version: IpVersion) -> Self {
        Self {
            version,
            name: String::new(),
            want: None,
            stale: BTreeSet::new(),
            carrier: None,
            state: State::Off,
            announced: None,
            // Nothing until the manager says (a version the daemon does
            // not program is never announced).
            dirty: false,
            reread_at: None,
            observed: None,
            trusted: false,
            poll_until: None,
            key_warning: None,
            kept: None,
        }
    }

    fn label(&self) -> &'static str {
        match self.version {
            IpVersion::V4 => "v4",
            IpVersion::V6 => "v6",
        }
    }
}

#[derive(Debug)]
pub struct Wireguard {
    seam: Box<dyn WgSeam>,
    keys: KeyStore,
    choice: WgImpl,
    families: [Family; 2],
    events: Vec<(IpVersion, String)>,
    /// The names that are ours whoever made the link there: the
    /// operator's (the flags'; Felix's by default).
    own_names: BTreeSet<String>,
    /// The links this daemon made (kept in the state directory): ours too
    /// when a ConfigUpdate's name chose them. Any other link, whatever its
    /// kind, is never reconfigured or deleted (a ConfigUpdate naming an
    /// operator's own `wg0`, or a VPN's `tun0`, must not take it over).
    made: BTreeSet<String>,
}

fn idx(v: IpVersion) -> usize {
    match v {
        IpVersion::V4 => 0,
        IpVersion::V6 => 1,
    }
}

impl Wireguard {
    pub fn new(seam: Box<dyn WgSeam>, keys: KeyStore, choice: WgImpl) -> Self {
        let made = keys.made_links();
        Self {
            seam,
            keys,
            choice,
            families: [Family::new(IpVersion::V4), Family::new(IpVersion::V6)],
            events: Vec::new(),
            own_names: [
                crate::model::wireguard::IFACE_V4,
                crate::model::wireguard::IFACE_V6,
            ]
            .into_iter()
            .map(String::from)
            .collect(),
            made,
        }
    }

    /// The operator's device names (the flags'), ours whoever made the
    /// link there.
    #[must_use]
    pub fn with_own_names<'a>(mut self, names: impl IntoIterator<Item = &'a str>) -> Self {
        self.own_names = names.into_iter().map(String::from).collect();
        self
    }

    /// Whether link `name` is ours to configure and delete.
    fn is_ours(&self, name: &str) -> bool {
        self.own_names.contains(name) || self.made.contains(name)
    }

    /// Family `i` cannot have its device `name`, for `why` (said once):
    /// no key is announced.
    fn unsupported(&mut self, i: usize, name: &str, why: String) {
        if self.families[i].state != State::Unsupported(why.clone()) {
            warn!(device = %name, reason = %why, "WireGuard is not supported here");
        }
        let f = &mut self.families[i];
        f.state = State::Unsupported(why);
        f.carrier = None;
        f.observed = None;
        self.announce(i, String::new());
    }

    /// Records (or forgets) a link this daemon made.
    fn note_made(&mut self, name: &str, made: bool) {
        let changed = if made {
            self.made.insert(name.to_string())
        } else {
            self.made.remove(name)
        };
        if changed && let Err(e) = self.keys.store_made_links(&self.made) {
            warn!(error = %e, "cannot keep which WireGuard links this daemon made");
        }
    }

    /// Version `v`'s device: `name`, and what it should be (`None`: off,
    /// the device of that name is removed).
    pub fn set(&mut self, v: IpVersion, name: &str, want: Option<WgDevice>) {
        let f = &mut self.families[idx(v)];
        if f.name != name {
            if !f.name.is_empty() {
                f.stale.insert(std::mem::take(&mut f.name));
            }
            f.stale.remove(name);
            f.name = name.to_string();
            f.dirty = true;
        }
        if f.want != want {
            f.want = want;
            f.dirty = true;
        }
    }

    /// One peer of version `v`'s device as it should now be (its allowed
    /// IPs changed); nothing while the version is off.
    pub fn update_peer(&mut self, v: IpVersion, key: PublicKey, peer: WgPeer) {
        let f = &mut self.families[idx(v)];
        if let Some(want) = &mut f.want
            && want.peers.get(&key) != Some(&peer)
        {
            want.peers.insert(key, peer);
            f.dirty = true;
        }
    }

    /// A link event for one of our devices: look at it again.
    pub fn link_changed(&mut self, name: &str) {
        for f in &mut self.families {
            if f.name == name || f.stale.contains(name) {
                f.dirty = true;
                f.trusted = false;
            }
        }
    }

    pub fn desired(&self, v: IpVersion) -> Option<&WgDevice> {
        self.families[idx(v)].want.as_ref()
    }

    /// The public key of version `v` as last announced.
    pub fn public_key(&self, v: IpVersion) -> Option<&str> {
        self.families[idx(v)].announced.as_deref()
    }

    /// Key announcements since the last call: (version, base64 public key
    /// or `""`).
    pub fn take_events(&mut self) -> Vec<(IpVersion, String)> {
        std::mem::take(&mut self.events)
    }

    /// Announces version `v`'s key again (the calc graph holds another one
    /// for this node: Felix sends its own again then).
    pub fn reannounce(&mut self, v: IpVersion) {
        let f = &self.families[idx(v)];
        if let Some(k) = &f.announced {
            info!(version = f.label(), public_key = %k, "WireGuard public key again: the calc graph has another");
            self.events.push((f.version, k.clone()));
        }
    }

    fn announce(&mut self, i: usize, key: String) {
        let f = &mut self.families[i];
        if f.announced.as_deref() != Some(key.as_str()) {
            info!(version = f.label(), public_key = %key, "WireGuard public key");
            f.announced = Some(key.clone());
            self.events.push((f.version, key));
        }
    }

    /// Deletes a link of ours by name, if it is there. A link of another
    /// kind under that name is left (and reported).
    fn remove_link(&mut self, name: &str) -> Result<(), BackendError> {
        let Some(l) = self.seam.link(name)? else {
            self.note_made(name, false);
            return Ok(());
        };
        if !self.is_ours(name) {
            warn!(device = name, kind = %l.kind, "not a link this daemon made: left alone");
            return Ok(());
        }
        if l.kind == "wireguard" || l.kind == "tun" {
            info!(device = name, kind = %l.kind, "deleting WireGuard device");
            self.seam.delete(name, l.index)?;
            self.note_made(name, false);
            Ok(())
        } else {
            warn!(device = name, kind = %l.kind, "not a WireGuard device: left alone");
            Ok(())
        }
    }

    /// A new device under `name`: the kernel's where it can, else
    /// `wireguard-go` (as `--wireguard-impl` allows).
    fn create(&mut self, name: &str) -> Result<Result<Carrier, String>, BackendError> {
        let kernel_why = if self.choice == WgImpl::Userspace {
            None
        } else {
            match self.seam.create_kernel(name)? {
                Created::Yes => return Ok(Ok(Carrier::Kernel)),
                Created::NotSupported(why) => Some(why),
            }
        };
        if self.choice == WgImpl::Kernel {
            return Ok(Err(kernel_why.unwrap_or_default()));
        }
        match self.seam.start_userspace(name)? {
            Created::Yes => {
                if let Some(why) = kernel_why {
                    info!(device = name, kernel = %why, "no kernel WireGuard: using wireguard-go");
                }
                Ok(Ok(Carrier::Userspace))
            }
            Created::NotSupported(why) => Ok(Err(match kernel_why {
                Some(k) => format!("{k}; {why}"),
                None => why,
            })),
        }
    }

    /// The private key: the device's, else the kept one, else a new one;
    /// kept in the state directory in every case.
    fn private_key(&mut self, i: usize, have: &ObservedDevice) -> Result<[u8; 32], BackendError> {
        let v = self.families[i].version;
        let key = match have.private_key {
            Some(k) => k,
            None => match self.keys.load(v)? {
                Some(k) => {
                    self.families[i].kept = Some(k);
                    k
                }
                None => {
                    info!(version = self.families[i].label(), "new WireGuard key");
                    self.seam.generate_key()
                }
            },
        };
        if self.families[i].kept == Some(key) {
            return Ok(key);
        }
        // Not keeping it costs a new key after a restart of a userspace
        // device, not the traffic now: reported, not fatal.
        self.families[i].key_warning = match self.keys.store(v, &key) {
            Ok(()) => {
                self.families[i].kept = Some(key);
                None
            }
            Err(e) => {
                warn!(error = %e, "cannot keep the WireGuard key");
                Some(e.to_string())
            }
        };
        Ok(key)
    }

    fn apply_family(&mut self, i: usize) -> Result<(), BackendError> {
        for name in std::mem::take(&mut self.families[i].stale) {
            if let Err(e) = self.remove_link(&name) {
                self.families[i].stale.insert(name);
                return Err(e);
            }
        }
        let name = self.families[i].name.clone();
        let Some(want) = self.families[i].want.clone() else {
            if !name.is_empty() {
                self.remove_link(&name)?;
            }
            let f = &mut self.families[i];
            f.carrier = None;
            f.state = State::Off;
            f.observed = None;
            self.announce(i, String::new());
            return Ok(());
        };
        let mut link = self.seam.link(&name)?;
        if link.is_some() && !self.is_ours(&name) {
            // Someone else's link under the name a ConfigUpdate chose.
            let why = format!(
                "a link named {name} exists that this daemon did not make: it is left alone \
                 (WireguardInterfaceName must name a link of ours, or none)"
            );
            self.unsupported(i, &name, why);
            return Ok(());
        }
        // Whether a wireguard-go serves a tun is asked when we last lost
        // track (start, resync, link event, failure), not at every apply.
        if let Some(l) = &link
            && l.kind == "tun"
            && !self.families[i].trusted
            && !self.seam.userspace_running(&name)
        {
            // Left by a wireguard-go that died: nothing serves it.
            warn!(device = %name, "a tun device with no wireguard-go behind it: made again");
            self.seam.delete(&name, l.index)?;
            link = None;
        }
        let made = link.is_none();
        let link = match link {
            Some(l) => l,
            None => {
                self.families[i].trusted = false;
                match self.create(&name)? {
                    Ok(c) => {
                        info!(device = %name, carrier = c.as_str(), "WireGuard device made");
                        self.note_made(&name, true);
                    }
                    Err(why) => {
                        self.unsupported(i, &name, why);
                        return Ok(());
                    }
                }
                self.seam.link(&name)?.ok_or_else(|| BackendError::Parse {
                    backend: "wireguard",
                    reason: format!("{name} was made but is not there"),
                })?
            }
        };
        let carrier = match link.kind.as_str() {
            "wireguard" => Carrier::Kernel,
            "tun" => Carrier::Userspace,
            other => {
                return Err(BackendError::Parse {
                    backend: "wireguard",
                    reason: format!(
                        "{name} exists and is a {other:?} link, not a WireGuard device: not ours to replace"
                    ),
                });
            }
        };
        self.families[i].carrier = Some(carrier);
        let addr = want.addr.map(IpNet::from);
        for op in link_fixes(&link, want.mtu, addr, want.version == IpVersion::V4) {
            self.seam.link_op(&op)?;
        }
        let have = match self.families[i].observed.take() {
            Some(o) if self.families[i].trusted => o,
            _ => self.seam.read(&name, carrier)?,
        };
        self.families[i].trusted = false;
        let key = self.private_key(i, &have)?;
        let change = plan(&want, &have, &key);
        let mut observed = have;
        let now = Instant::now();
        if !change.is_empty() {
            info!(
                device = %name,
                peers_removed = change.remove.len(),
                peers_written = change.upsert.len(),
                "configuring WireGuard device"
            );
            self.seam.configure(&name, carrier, &change)?;
            change.apply_to(&mut observed);
            // A device made again (its wireguard-go died, the daemon
            // restarted without it) starts with no sessions while the
            // peers still hold theirs: they would only notice after
            // WireGuard's 15 s rekey timeout. A handshake now ends that.
            if made && !want.peers.is_empty() {
                let peers: Vec<PublicKey> = want.peers.keys().copied().collect();
                self.seam.nudge(&name, carrier, &peers)?;
            }
            if !change.upsert.is_empty() {
                self.families[i].poll_until = Some(now + HANDSHAKE_POLL_FOR);
            }
        }
        let waiting = want.peers.keys().any(|k| {
            observed
                .peers
                .get(k)
                .is_none_or(|p| p.last_handshake.is_none())
        });
        let f = &mut self.families[i];
        let polling = f.poll_until.is_some_and(|t| now < t);
        f.reread_at = (waiting && polling).then(|| now + HANDSHAKE_POLL);
        f.trusted = true;
        f.observed = Some(observed);
        f.state = State::Up;
        self.announce(i, public_key(&key).to_base64());
        Ok(())
    }
}

fn ago(t: SystemTime) -> String {
    match SystemTime::now().duration_since(t) {
        Ok(d) => format!("{}s ago", d.as_secs()),
        Err(_) => "just now".into(),
    }
}

impl Backend for Wireguard {
    fn name(&self) -> &'static str {
        "wireguard"
    }

    fn export(&self, m: &crate::metrics::Metrics) {
        for f in &self.families {
            let v = crate::metrics::version_label(f.version);
            let up = matches!(f.state, State::Up);
            let want = f.want.as_ref().filter(|_| up);
            m.wireguard_peers
                .get_or_create(&v)
                .set(want.map_or(0, |w| w.peers.len()) as i64);
            // The peers we configured, as the device last reported them.
            let peers = match (want, &f.observed) {
                (Some(want), Some(have)) => want
                    .peers
                    .keys()
                    .filter_map(|k| {
                        have.peers.get(k).map(|p| crate::metrics::PeerReading {
                            public_key: k.to_base64(),
                            rx_bytes: p.rx_bytes,
                            tx_bytes: p.tx_bytes,
                            latest_handshake: p
                                .last_handshake
                                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                                .map(|d| d.as_secs()),
                        })
                    })
                    .collect(),
                _ => Vec::new(),
            };
            m.kernel.set_wireguard(&v, peers);
        }
    }

    fn phases(&self) -> &'static [Phase] {
        &[Phase::Links]
    }

    fn is_dirty(&self, _phase: Phase) -> bool {
        let now = Instant::now();
        self.families
            .iter()
            .any(|f| f.dirty || f.reread_at.is_some_and(|t| now >= t))
    }

    fn request_resync(&mut self, refresh: Refresh) {
        // The route refresh also retries a version WireGuard could not run
        // for (Felix retries at every resync).
        if refresh == Refresh::Routes {
            for f in &mut self.families {
                f.dirty = true;
                f.trusted = false;
            }
        }
    }

    #[instrument(level = "debug", skip_all, name = "wireguard_apply")]
    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        let now = Instant::now();
        let mut outcome = ApplyOutcome::default();
        for i in 0..self.families.len() {
            let f = &self.families[i];
            if !(f.dirty || f.reread_at.is_some_and(|t| now >= t)) {
                continue;
            }
            if f.reread_at.is_some_and(|t| now >= t) {
                self.families[i].trusted = false;
            }
            self.families[i].reread_at = None;
            self.apply_family(i)?;
            self.families[i].dirty = false;
        }
        for f in &self.families {
            if let Some(t) = f.reread_at {
                let d = t.saturating_duration_since(Instant::now());
                outcome.reschedule_after = Some(outcome.reschedule_after.map_or(d, |o| o.min(d)));
            }
        }
        Ok(outcome)
    }

    fn status(&self) -> Vec<(String, String)> {
        let mut out = vec![("wireguard.support".to_string(), self.seam.support())];
        for f in &self.families {
            let p = format!("wireguard.{}", f.label());
            let device = match (&f.state, f.carrier) {
                (State::Off, _) => "off".to_string(),
                (State::Unsupported(why), _) => format!("unsupported: {why}"),
                (State::Up, Some(c)) => {
                    let more = self.seam.describe(&f.name).map(|d| format!(", {d}"));
                    format!("{} ({}{})", f.name, c.as_str(), more.unwrap_or_default())
                }
                (State::Up, None) => f.name.clone(),
            };
            out.push((format!("{p}.device"), device));
            if let Some(k) = f.announced.as_ref().filter(|k| !k.is_empty()) {
                out.push((format!("{p}.public_key"), k.clone()));
            }
            if let Some(w) = &f.key_warning {
                out.push((format!("{p}.key_not_kept"), w.clone()));
            }
            let (Some(want), Some(have)) = (&f.want, &f.observed) else {
                continue;
            };
            out.push((format!("{p}.peers"), want.peers.len().to_string()));
            for (k, peer) in want.peers.iter().take(20) {
                let seen = have.peers.get(k);
                let hs = seen
                    .and_then(|s| s.last_handshake)
                    .map_or_else(|| "never".to_string(), ago);
                let (rx, tx) = seen.map_or((0, 0), |s| (s.rx_bytes, s.tx_bytes));
                out.push((
                    format!("{p}.peer.{}", peer.node),
                    format!(
                        "key {k} endpoint {} handshake {hs} rx {rx} B tx {tx} B",
                        peer.endpoint
                    ),
                ));
            }
            if want.peers.len() > 20 {
                out.push((
                    format!("{p}.peer.more"),
                    (want.peers.len() - 20).to_string(),
                ));
            }
        }
        out
    }
}
