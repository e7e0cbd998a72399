//! A small Calico-like lab for the traffic tests: workload namespaces joined
//! to a "host" namespace by veth pairs, servers inside namespaces, probes
//! run from inside namespaces. Everything stays inside the test's own
//! namespaces.

use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Result;
use dphandler_proto::felix;

use crate::Netns;

/// Runs `f` on a thread that entered namespace `ns`.
pub fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let file = std::fs::File::open(format!("/run/netns/{ns}")).expect("netns file");
    std::thread::spawn(move || {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        f()
    })
    .join()
    .expect("thread")
}

/// YAML (or JSON) `felix.ToDataplane` messages, numbered from `first`.
pub fn yaml_msgs(first: u64, yaml: &str) -> Vec<felix::ToDataplane> {
    let mut v = dphandler_proto::text::parse_to_dataplane(yaml).expect("test YAML");
    for (i, m) in v.iter_mut().enumerate() {
        m.sequence_number = first + i as u64;
    }
    v
}

/// A workload, as Calico's CNI sets one up.
#[derive(Debug, Clone, Copy)]
pub struct WorkloadSpec<'a> {
    /// Host-side interface (`cali1`).
    pub iface: &'a str,
    /// The workload's eth0 gets MAC 02:00:00:00:00:<n>.
    pub n: u8,
    pub v4: &'a str,
    pub v6: Option<&'a str>,
    /// Add the host's /32 (/128) route to the workload by hand.
    pub host_route: bool,
    /// Add a permanent neighbour entry for the workload on the host.
    pub host_neigh: bool,
}

impl WorkloadSpec<'_> {
    pub fn mac(&self) -> String {
        format!("02:00:00:00:00:{:02x}", self.n)
    }
}

/// Creates the workload's namespace and veth pair: `/32` (and `/128`,
/// without DAD) on eth0, default routes via 169.254.1.1 and fe80::1 with
/// permanent neighbours for them (the host side has MAC ee:ee:ee:ee:ee:ee).
pub fn workload(host: &Netns, s: WorkloadSpec<'_>) -> Result<Netns> {
    let wl = Netns::new("wl")?;
    let (iface, mac) = (s.iface, s.mac());
    host.run(
        "ip",
        &[
            "link", "add", iface, "type", "veth", "peer", "name", "eth0", "netns", &wl.0,
        ],
    )?;
    host.run(
        "ip",
        &["link", "set", iface, "address", "ee:ee:ee:ee:ee:ee", "up"],
    )?;
    wl.run("ip", &["link", "set", "lo", "up"])?;
    wl.run("ip", &["link", "set", "eth0", "address", &mac, "up"])?;
    wl.run(
        "ip",
        &["addr", "add", &format!("{}/32", s.v4), "dev", "eth0"],
    )?;
    wl.run(
        "ip",
        &[
            "route",
            "add",
            "169.254.1.1",
            "dev",
            "eth0",
            "scope",
            "link",
        ],
    )?;
    wl.run(
        "ip",
        &[
            "route",
            "add",
            "default",
            "via",
            "169.254.1.1",
            "dev",
            "eth0",
        ],
    )?;
    let gw = [
        "lladdr",
        "ee:ee:ee:ee:ee:ee",
        "dev",
        "eth0",
        "nud",
        "permanent",
    ];
    wl.run("ip", &[&["neigh", "add", "169.254.1.1"][..], &gw].concat())?;
    if s.host_route {
        host.run(
            "ip",
            &["route", "add", &format!("{}/32", s.v4), "dev", iface],
        )?;
    }
    if s.host_neigh {
        host.run(
            "ip",
            &[
                "neigh",
                "add",
                s.v4,
                "lladdr",
                &mac,
                "dev",
                iface,
                "nud",
                "permanent",
            ],
        )?;
    }
    if let Some(v6) = s.v6 {
        wl.run(
            "ip",
            &[
                "-6",
                "addr",
                "add",
                &format!("{v6}/128"),
                "dev",
                "eth0",
                "nodad",
            ],
        )?;
        wl.run(
            "ip",
            &[&["-6", "neigh", "add", "fe80::1"][..], &gw].concat(),
        )?;
        wl.run(
            "ip",
            &[
                "-6", "route", "add", "default", "via", "fe80::1", "dev", "eth0",
            ],
        )?;
        if s.host_route {
            host.run(
                "ip",
                &["-6", "route", "add", &format!("{v6}/128"), "dev", iface],
            )?;
        }
        if s.host_neigh {
            host.run(
                "ip",
                &[
                    "-6",
                    "neigh",
                    "add",
                    v6,
                    "lladdr",
                    &mac,
                    "dev",
                    iface,
                    "nud",
                    "permanent",
                ],
            )?;
        }
    }
    Ok(wl)
}

/// TCP listeners and UDP echo servers in a namespace, stopped on drop.
#[derive(Debug)]
pub struct Servers(Arc<AtomicBool>);

impl Drop for Servers {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Listens on `::` (IPv4 too) in `ns`: TCP on `tcp` (accept and close),
/// UDP echo on `udp`. Returns once every socket is bound.
pub fn serve(ns: &str, tcp: &[u16], udp: &[u16]) -> Servers {
    let stop = Arc::new(AtomicBool::new(false));
    let mut ready = Vec::new();
    for (port, is_tcp) in tcp
        .iter()
        .map(|p| (*p, true))
        .chain(udp.iter().map(|p| (*p, false)))
    {
        let stop = stop.clone();
        let file = std::fs::File::open(format!("/run/netns/{ns}")).expect("netns file");
        let (tx, rx) = std::sync::mpsc::channel();
        ready.push(rx);
        std::thread::spawn(move || {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            if is_tcp {
                let l = TcpListener::bind(("::", port)).expect("bind tcp");
                l.set_nonblocking(true).unwrap();
                tx.send(()).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    match l.accept() {
                        Ok((s, _)) => drop(s),
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            } else {
                let s = UdpSocket::bind(("::", port)).expect("bind udp");
                s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
                tx.send(()).unwrap();
                let mut buf = [0u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((n, from)) = s.recv_from(&mut buf) {
                        let _ = s.send_to(&buf[..n], from);
                    }
                }
            }
        });
    }
    for r in ready {
        r.recv().expect("server thread");
    }
    Servers(stop)
}

/// Whether a TCP connection from inside `from` to `to` succeeds in time.
pub fn tcp_ok(from: &Netns, to: SocketAddr, timeout: Duration) -> bool {
    in_ns(&from.0, move || {
        TcpStream::connect_timeout(&to, timeout).is_ok()
    })
}
