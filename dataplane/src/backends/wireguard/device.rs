//! The real [`WgSeam`]: links over rtnetlink, device configuration through
//! the `wireguard-control` crate (the kernel's generic netlink API, or a
//! `wireguard-go`'s UAPI socket), and the `wireguard-go` processes we start.
//!
//! A `wireguard-go` is started in the foreground (`-f`) as our child, in a
//! process group of its own (a Ctrl-C or a signal to the daemon's group
//! does not reach it), its output in `<state-dir>/wireguard-go.<dev>.log`
//! and its pid in `<state-dir>/wireguard-go.<dev>.pid`. It outlives the
//! daemon on purpose: pod traffic keeps flowing through a daemon restart,
//! as it does through a kernel device, and the restarted daemon finds the
//! device answering on its UAPI socket and keeps it. Deleting the device
//! (WireGuard off) makes it exit; children that exit are reaped at the
//! next apply.
//!
//! `wireguard-control` would start a `wireguard-go` itself (daemonised,
//! unsupervised, outliving a stopping daemon) when a configuration finds no
//! socket: ours died between its start and its configuration (killed beside
//! the daemon in a drain: CI). So every userspace configuration first looks
//! for the socket and fails, retryably, when it is gone
//! ([`update`]); the next apply starts ours again.

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use rtnetlink::LinkWireguard;
use tracing::{info, warn};
use wireguard_control::{
    Backend as WgBackend, Device, DeviceUpdate, InterfaceName, Key, PeerConfigBuilder,
};

use super::plan::{DeviceChange, ObservedDevice, ObservedPeer};
use super::{Carrier, Created, WgSeam};
use crate::backends::BackendError;
use crate::backends::netlink::{Netlink, errno};
use crate::backends::vxlan::netlink::VxlanNetlink;
use crate::backends::vxlan::{ObservedLink, VxlanOp, VxlanSeam};
use crate::model::wireguard::PublicKey;

const EOPNOTSUPP: i32 = 95;
/// Where `wireguard-go` puts its UAPI sockets (`wireguard-control` looks
/// in both).
const SOCKET_DIRS: [&str; 2] = ["/var/run/wireguard", "/run/wireguard"];
/// How long a new `wireguard-go` may take to open its socket.
const START_TIMEOUT: Duration = Duration::from_secs(5);

fn io(context: String, source: std::io::Error) -> BackendError {
    BackendError::Io {
        backend: "wireguard",
        context,
        source,
    }
}

fn iface(name: &str) -> Result<InterfaceName, BackendError> {
    name.parse().map_err(|e| BackendError::Parse {
        backend: "wireguard",
        reason: format!("{name:?} is not an interface name: {e}"),
    })
}

/// Whether a `wireguard-go` answers on `name`'s UAPI socket.
fn socket_answers(name: &str) -> bool {
    SOCKET_DIRS
        .iter()
        .any(|d| UnixStream::connect(format!("{d}/{name}.sock")).is_ok())
}

/// Writes `u` to device `name`. A userspace device whose `wireguard-go` is
/// gone is an error (retryable: the next apply finds the device gone and
/// starts ours again), not handed to `wireguard-control`, which would start
/// a daemonised `wireguard-go` of its own (its userspace `apply` does when
/// it cannot open the socket). What is left is the time between this look
/// and the crate's own, microseconds against the ~5 ms between our start
/// and our configuration.
fn update(name: &str, carrier: Carrier, u: DeviceUpdate, what: &str) -> Result<(), BackendError> {
    let context = format!("{what} WireGuard device {name}");
    if carrier == Carrier::Userspace && !socket_answers(name) {
        return Err(io(
            context,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "its wireguard-go is gone (no UAPI socket answers); it is started again",
            ),
        ));
    }
    u.apply(&iface(name)?, carrier_backend(carrier))
        .map_err(|e| io(context, e))
}

fn carrier_backend(c: Carrier) -> WgBackend {
    match c {
        Carrier::Kernel => WgBackend::Kernel,
        Carrier::Userspace => WgBackend::Userspace,
    }
}

/// The real seam.
#[derive(Debug)]
pub struct WgNetlink {
    /// Link reads and MTU/address/up writes (the VXLAN backend's seam does
    /// the same for any link).
    links: VxlanNetlink,
    nl: Netlink,
    binary: PathBuf,
    state_dir: Option<PathBuf>,
    children: HashMap<String, Child>,
    /// Pids of the `wireguard-go`s of an earlier run that we kept (from
    /// their pid files, read once).
    adopted: HashMap<String, String>,
    support: String,
}

/// `binary` as found on `PATH` (or as given, with a `/`).
fn find(binary: &Path) -> Option<PathBuf> {
    if binary.components().count() > 1 {
        return binary.is_file().then(|| binary.to_path_buf());
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(binary))
        .find(|p| p.is_file())
}

impl WgNetlink {
    /// `binary`: the `wireguard-go` to run; `state_dir`: where its logs and
    /// pid files go (none: output discarded, no pid file).
    pub fn open(binary: PathBuf, state_dir: Option<PathBuf>) -> Result<Self, BackendError> {
        // A module that is not loaded yet may still be loadable: creating
        // a device asks the kernel first whatever this says.
        let module = Path::new("/sys/module/wireguard").exists();
        let go = find(&binary);
        let support = format!(
            "kernel module {}; wireguard-go {}",
            if module {
                "loaded"
            } else {
                "not loaded (the kernel is asked first all the same)"
            },
            go.as_ref().map_or_else(
                || format!("{} not found", binary.display()),
                |p| p.display().to_string()
            )
        );
        info!(kernel_module = module, wireguard_go = ?go, "WireGuard support on this host");
        Ok(Self {
            links: VxlanNetlink::open()?,
            nl: Netlink::open("wireguard")?,
            binary,
            state_dir,
            children: HashMap::new(),
            adopted: HashMap::new(),
            support,
        })
    }

    fn file(&self, name: &str, ext: &str) -> Option<PathBuf> {
        self.state_dir
            .as_ref()
            .map(|d| d.join(format!("wireguard-go.{name}.{ext}")))
    }

    /// Reaps our `wireguard-go`s that exited.
    fn reap(&mut self) {
        self.children.retain(|name, c| match c.try_wait() {
            Ok(Some(status)) => {
                warn!(device = %name, %status, "wireguard-go exited");
                false
            }
            _ => true,
        });
    }

    /// The last lines of a `wireguard-go`'s log (why it did not start).
    fn log_tail(&self, name: &str) -> String {
        let Some(p) = self.file(name, "log") else {
            return String::new();
        };
        let mut s = String::new();
        if let Ok(mut f) = fs::File::open(p) {
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            let _ = f.seek(SeekFrom::Start(len.saturating_sub(600)));
            let _ = f.read_to_string(&mut s);
        }
        s.trim().to_string()
    }
}

impl WgSeam for WgNetlink {
    fn link(&mut self, name: &str) -> Result<Option<ObservedLink>, BackendError> {
        self.reap();
        self.links.get(name)
    }

    fn create_kernel(&mut self, name: &str) -> Result<Created, BackendError> {
        let h = self.nl.handle();
        match self
            .nl
            .block_on(h.link().add(LinkWireguard::new(name).build()).execute())
        {
            Ok(()) => Ok(Created::Yes),
            Err(e) if errno(&e) == Some(EOPNOTSUPP) => Ok(Created::NotSupported(
                "the kernel has no WireGuard module (link kind wireguard unknown)".into(),
            )),
            Err(e) => Err(self.nl.error(format!("creating WireGuard link {name}"), e)),
        }
    }

    fn start_userspace(&mut self, name: &str) -> Result<Created, BackendError> {
        let (stdout, stderr) = match self.file(name, "log") {
            Some(p) => {
                if let Some(d) = p.parent() {
                    fs::create_dir_all(d)
                        .map_err(|e| io(format!("creating {}", d.display()), e))?;
                }
                let f =
                    fs::File::create(&p).map_err(|e| io(format!("creating {}", p.display()), e))?;
                let g = f
                    .try_clone()
                    .map_err(|e| io(format!("opening {}", p.display()), e))?;
                (Stdio::from(f), Stdio::from(g))
            }
            None => (Stdio::null(), Stdio::null()),
        };
        let mut cmd = Command::new(&self.binary);
        cmd.arg("-f")
            .arg(name)
            .env("LOG_LEVEL", "error")
            // We chose userspace (or were told to): no refusal because
            // the kernel might have a module after all.
            .env("WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD", "1")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Created::NotSupported(format!(
                    "no {} to run (install wireguard-go or give --wireguard-go)",
                    self.binary.display()
                )));
            }
            Err(e) => return Err(io(format!("starting {}", self.binary.display()), e)),
        };
        let pid = child.id();
        let started = Instant::now();
        loop {
            if self.userspace_running(name) {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(BackendError::Command {
                    backend: "wireguard",
                    command: format!("{} -f {name}", self.binary.display()),
                    status: status.to_string(),
                    stderr: self.log_tail(name),
                });
            }
            if started.elapsed() > START_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                return Err(BackendError::Command {
                    backend: "wireguard",
                    command: format!("{} -f {name}", self.binary.display()),
                    status: format!("no UAPI socket after {START_TIMEOUT:?}"),
                    stderr: self.log_tail(name),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Some(p) = self.file(name, "pid")
            && let Err(e) = fs::write(&p, format!("{pid}\n"))
        {
            warn!(error = %e, path = %p.display(), "cannot write the wireguard-go pid file");
        }
        info!(device = name, pid, "wireguard-go started");
        self.children.insert(name.to_string(), child);
        Ok(Created::Yes)
    }

    fn userspace_running(&mut self, name: &str) -> bool {
        let running = socket_answers(name);
        if running && !self.children.contains_key(name) {
            let pid = self
                .file(name, "pid")
                .and_then(|p| fs::read_to_string(p).ok())
                .map_or_else(|| "unknown".into(), |p| p.trim().to_string());
            self.adopted.insert(name.to_string(), pid);
        }
        running
    }

    fn delete(&mut self, name: &str, index: u32) -> Result<(), BackendError> {
        let h = self.nl.handle();
        self.nl
            .block_on(h.link().del(index).execute())
            .map_err(|e| self.nl.error(format!("deleting {name}"), e))?;
        self.adopted.remove(name);
        if let Some(mut c) = self.children.remove(name) {
            // It exits when its device goes; do not leave a zombie.
            let until = Instant::now() + Duration::from_secs(2);
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if let Some(p) = self.file(name, "pid") {
            let _ = fs::remove_file(p);
        }
        Ok(())
    }

    fn read(&mut self, name: &str, carrier: Carrier) -> Result<ObservedDevice, BackendError> {
        let d = Device::get(&iface(name)?, carrier_backend(carrier))
            .map_err(|e| io(format!("reading WireGuard device {name}"), e))?;
        Ok(ObservedDevice {
            private_key: d.private_key.map(|k| k.0),
            listen_port: d.listen_port,
            fwmark: d.fwmark,
            peers: d
                .peers
                .into_iter()
                .map(|p| {
                    (
                        PublicKey(p.config.public_key.0),
                        ObservedPeer {
                            endpoint: p.config.endpoint,
                            allowed_ips: p
                                .config
                                .allowed_ips
                                .iter()
                                .filter_map(|a| IpNet::new(a.address, a.cidr).ok())
                                .collect(),
                            last_handshake: p.stats.last_handshake_time,
                            rx_bytes: p.stats.rx_bytes,
                            tx_bytes: p.stats.tx_bytes,
                        },
                    )
                })
                .collect(),
        })
    }

    fn configure(
        &mut self,
        name: &str,
        carrier: Carrier,
        change: &DeviceChange,
    ) -> Result<(), BackendError> {
        let mut u = DeviceUpdate::new();
        if let Some(k) = change.private_key {
            u = u.set_private_key(Key(k));
        }
        if let Some(p) = change.listen_port {
            u = u.set_listen_port(p);
        }
        if let Some(m) = change.fwmark {
            u = u.set_fwmark(m);
        }
        for k in &change.remove {
            u = u.remove_peer_by_key(&Key(k.0));
        }
        for (k, endpoint, ips) in &change.upsert {
            let mut p = PeerConfigBuilder::new(&Key(k.0))
                .set_endpoint(*endpoint)
                .replace_allowed_ips();
            for ip in ips {
                p = p.add_allowed_ip(ip.addr(), ip.prefix_len());
            }
            u = u.add_peer(p);
        }
        update(name, carrier, u, "configuring")
    }

    fn link_op(&mut self, op: &VxlanOp) -> Result<(), BackendError> {
        self.links.write(op)
    }

    /// A persistent keepalive switched on sends a keepalive at once (the
    /// kernel's `set_peer` and wireguard-go's UAPI both do), which needs a
    /// session, which starts a handshake; switched off again right after,
    /// the handshake goes on. (`wg set … persistent-keepalive 1` then `0`.)
    fn nudge(
        &mut self,
        name: &str,
        carrier: Carrier,
        peers: &[PublicKey],
    ) -> Result<(), BackendError> {
        for interval in [1, 0] {
            let mut u = DeviceUpdate::new();
            for k in peers {
                u = u.add_peer(
                    PeerConfigBuilder::new(&Key(k.0)).set_persistent_keepalive_interval(interval),
                );
            }
            update(name, carrier, u, "starting handshakes on")?;
        }
        Ok(())
    }

    fn describe(&self, name: &str) -> Option<String> {
        if let Some(c) = self.children.get(name) {
            return Some(format!("wireguard-go pid {}", c.id()));
        }
        let pid = self.adopted.get(name)?;
        Some(format!("wireguard-go pid {pid} from an earlier run"))
    }

    fn generate_key(&mut self) -> [u8; 32] {
        Key::generate_private().0
    }

    fn support(&self) -> String {
        self.support.clone()
    }
}
