//! A small Calico-like lab for the traffic tests: workload namespaces joined
//! to a "host" namespace by veth pairs, servers inside namespaces, probes
//! run from inside namespaces. Everything stays inside the test's own
//! namespaces.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
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

/// `GET path` over HTTP/1.1 on `host:port` inside namespace `ns` (the
/// health and metrics endpoints): (status code, body).
pub fn http_get(ns: &Netns, host: &str, port: u16, path: &str) -> Result<(u16, String)> {
    use std::io::{Read, Write};
    let (host, path) = (host.to_string(), path.to_string());
    in_ns(&ns.0, move || -> Result<(u16, String)> {
        let mut s = TcpStream::connect((host.as_str(), port))
            .with_context(|| format!("connecting to {host}:{port}"))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        let code = out
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
        Ok((code, body))
    })
}

/// The scrape at `port` in `ns`, parsed as OpenMetrics text (what
/// prometheus-client writes; the parser checks the format too): series
/// (`name{a="1",b="2"}`, labels sorted; counters with `_total`, histograms
/// as `_count` and `_sum`) → value.
pub fn scrape(ns: &Netns, port: u16) -> Result<std::collections::BTreeMap<String, f64>> {
    use openmetrics_parser::{MetricNumber, OpenMetricsValue};
    let (code, body) = http_get(ns, "127.0.0.1", port, "/metrics")?;
    if code != 200 {
        anyhow::bail!("/metrics answered {code}: {body}");
    }
    let parsed = openmetrics_parser::openmetrics::parse_openmetrics(&body)
        .map_err(|e| anyhow::anyhow!("/metrics is not OpenMetrics: {e:?}\n{body}"))?;
    let mut out = std::collections::BTreeMap::new();
    for (name, family) in &parsed.families {
        for s in family.iter_samples() {
            let labels = s
                .get_labelset()
                .map_err(|e| anyhow::anyhow!("{name}: {e:?}"))?;
            let mut labels: Vec<String> =
                labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
            labels.sort();
            let series = |suffix: &str| {
                if labels.is_empty() {
                    format!("{name}{suffix}")
                } else {
                    format!("{name}{suffix}{{{}}}", labels.join(","))
                }
            };
            match &s.value {
                OpenMetricsValue::Counter(c) => {
                    out.insert(series("_total"), c.value.as_f64());
                }
                OpenMetricsValue::Gauge(n) | OpenMetricsValue::Unknown(n) => {
                    out.insert(series(""), n.as_f64());
                }
                OpenMetricsValue::Histogram(h) => {
                    for b in &h.buckets {
                        let mut with_le = labels.clone();
                        with_le.push(format!("le=\"{}\"", b.upper_bound));
                        with_le.sort();
                        out.insert(
                            format!("{name}_bucket{{{}}}", with_le.join(",")),
                            b.count.as_f64(),
                        );
                    }
                    out.insert(series("_count"), h.count.unwrap_or(0) as f64);
                    out.insert(
                        series("_sum"),
                        h.sum.as_ref().map_or(0.0, MetricNumber::as_f64),
                    );
                }
                _ => {}
            }
        }
    }
    Ok(out)
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
    /// Add the host's /32 (/128) route to the workload by hand, as the CNI
    /// does (the daemon adds its own as well).
    pub host_route: bool,
    /// Add a permanent IPv4 neighbour entry for the workload on the host
    /// (IPv6 neighbours are always left to NDP, as on a Calico node).
    pub host_neigh: bool,
}

impl WorkloadSpec<'_> {
    pub fn mac(&self) -> String {
        format!("02:00:00:00:00:{:02x}", self.n)
    }
}

/// The host side's IPv6 link-local address: the workloads' IPv6 gateway.
/// The CNI gives every host-side veth MAC ee:ee:ee:ee:ee:ee, and the kernel
/// derives this address from it.
pub const HOST_SIDE_LL: &str = "fe80::ecee:eeff:feee:eeee";

/// Creates the workload's namespace and veth pair as Calico's CNI does:
/// host side with MAC ee:ee:ee:ee:ee:ee; a /32 (and /128) on the workload's
/// eth0; IPv4 default route via 169.254.1.1 (a permanent neighbour for it
/// in the workload: the lab's host has no uplink for proxy ARP to answer
/// from); IPv6 default route via the host side's link-local address,
/// resolved by NDP. DAD is off on both ends, as the CNI sets it (a
/// point-to-point link). Nothing global is set: forwarding and the
/// per-interface knobs the daemon owns are the daemon's to set.
pub fn workload(host: &Netns, s: WorkloadSpec<'_>) -> Result<Netns> {
    let wl = Netns::new("wl")?;
    let (iface, mac) = (s.iface, s.mac());
    host.run(
        "ip",
        &[
            "link", "add", iface, "type", "veth", "peer", "name", "eth0", "netns", &wl.0,
        ],
    )?;
    if s.v6.is_some() {
        // Calico's CNI turns DAD off on both ends (cni-plugin/pkg/dataplane/
        // linux/dataplane_linux.go: the container's eth0 and the host veth),
        // per interface: the plugin's job, not the daemon's.
        let dad = |dev: &str| format!("net.ipv6.conf.{dev}.accept_dad=0");
        host.run("sysctl", &["-qw", &dad(iface)])?;
        wl.run("sysctl", &["-qw", &dad("eth0")])?;
    }
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
    wl.run(
        "ip",
        &[
            "neigh",
            "add",
            "169.254.1.1",
            "lladdr",
            "ee:ee:ee:ee:ee:ee",
            "dev",
            "eth0",
            "nud",
            "permanent",
        ],
    )?;
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
            &["-6", "addr", "add", &format!("{v6}/128"), "dev", "eth0"],
        )?;
        wl.run(
            "ip",
            &[
                "-6",
                "route",
                "add",
                "default",
                "via",
                HOST_SIDE_LL,
                "dev",
                "eth0",
            ],
        )?;
        if s.host_route {
            host.run(
                "ip",
                &["-6", "route", "add", &format!("{v6}/128"), "dev", iface],
            )?;
        }
    }
    Ok(wl)
}

/// An IPv4-only workload `n` on `iface` with address `ip`, the host's
/// route to it added by hand (the daemon takes it over).
pub fn workload_v4(host: &Netns, iface: &str, n: u8, ip: &str) -> Result<Netns> {
    workload(
        host,
        WorkloadSpec {
            iface,
            n,
            v4: ip,
            v6: None,
            host_route: true,
            host_neigh: false,
        },
    )
}

/// A dual-stack workload `n` on `iface` with addresses `v4` and `v6`, the
/// host's routes to it added by hand (the daemon takes them over).
pub fn workload_dual(host: &Netns, iface: &str, n: u8, v4: &str, v6: &str) -> Result<Netns> {
    workload(
        host,
        WorkloadSpec {
            iface,
            n,
            v4,
            v6: Some(v6),
            host_route: true,
            host_neigh: false,
        },
    )
}

/// Forgets every learnt IPv6 neighbour in `ns` (permanent ones stay), so
/// that the next packet has to resolve its next hop by NDP again.
pub fn forget_ipv6_neighbours(ns: &Netns) -> Result<()> {
    ns.run("ip", &["-6", "neigh", "flush", "all"])?;
    Ok(())
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

/// A TCP echo server on `port` (`::`, IPv4 too) in `ns`: every connection
/// gets back what it sends, for as long as it stays open. Returns once
/// bound; stopped on drop.
pub fn echo(ns: &str, port: u16) -> Servers {
    use std::io::{Read, Write};
    let stop = Arc::new(AtomicBool::new(false));
    let file = std::fs::File::open(format!("/run/netns/{ns}")).expect("netns file");
    let (tx, rx) = std::sync::mpsc::channel();
    let flag = stop.clone();
    std::thread::spawn(move || {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        let l = TcpListener::bind(("::", port)).expect("bind tcp");
        l.set_nonblocking(true).unwrap();
        tx.send(()).unwrap();
        while !flag.load(Ordering::Relaxed) {
            match l.accept() {
                Ok((mut s, _)) => {
                    let flag = flag.clone();
                    std::thread::spawn(move || {
                        s.set_nonblocking(false).unwrap();
                        s.set_read_timeout(Some(Duration::from_millis(100)))
                            .unwrap();
                        let mut buf = [0u8; 256];
                        while !flag.load(Ordering::Relaxed) {
                            match s.read(&mut buf) {
                                Ok(0) => break,
                                Ok(n) => {
                                    if s.write_all(&buf[..n]).is_err() {
                                        break;
                                    }
                                }
                                Err(e)
                                    if e.kind() == std::io::ErrorKind::WouldBlock
                                        || e.kind() == std::io::ErrorKind::TimedOut => {}
                                Err(_) => break,
                            }
                        }
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    rx.recv().expect("echo server thread");
    Servers(stop)
}

/// A TCP connection made from inside `from` (the socket stays in that
/// namespace; it can be used from any thread).
pub fn connect(from: &Netns, to: SocketAddr) -> std::io::Result<TcpStream> {
    in_ns(&from.0, move || {
        TcpStream::connect_timeout(&to, Duration::from_secs(2))
    })
}

/// Whether a TCP connection from inside `from` to `to` succeeds in time.
pub fn tcp_ok(from: &Netns, to: SocketAddr, timeout: Duration) -> bool {
    in_ns(&from.0, move || {
        TcpStream::connect_timeout(&to, timeout).is_ok()
    })
}

/// A UDP socket on a source port no earlier probe of this process used.
///
/// A probe is a new flow: with a random port it can happen to reuse the
/// 5-tuple of an earlier probe's flow that conntrack still holds (UDP
/// entries live 30–120 s), and then a packet that policy now blocks is
/// accepted as part of an established flow — correct behaviour that the
/// probe must not mistake for a hole. Ports come from 20000–31999, below
/// the kernel's ephemeral range.
fn udp_probe_socket(v4: bool) -> UdpSocket {
    use std::sync::atomic::AtomicU32;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    for _ in 0..12_000 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed) % 12_000;
        let port = 20_000 + n as u16;
        let bind: SocketAddr = if v4 {
            SocketAddr::from(([0, 0, 0, 0], port))
        } else {
            SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port))
        };
        if let Ok(s) = UdpSocket::bind(bind) {
            return s;
        }
    }
    panic!("no free UDP source port for a probe in 20000-31999")
}

/// One probe of [`probe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// A TCP connection to this port.
    Tcp(u16),
    /// A datagram to this port and its echo back.
    Udp(u16),
    /// One ping (ICMP echo, or ICMPv6 echo to an IPv6 address).
    Icmp,
}

/// Whether `p` from inside `from` to `to` gets through (each waits up to
/// 0.4 s when dropped).
pub fn probe(from: &Netns, to: &str, p: Probe) -> bool {
    let ip: std::net::IpAddr = to.parse().expect("a probe's target is an address");
    match p {
        Probe::Tcp(port) => tcp_ok(from, SocketAddr::new(ip, port), Duration::from_millis(400)),
        Probe::Udp(port) => in_ns(&from.0, move || {
            let s = udp_probe_socket(ip.is_ipv4());
            s.set_read_timeout(Some(Duration::from_millis(400)))
                .expect("read timeout");
            let _ = s.send_to(b"ping", SocketAddr::new(ip, port));
            let mut buf = [0u8; 16];
            s.recv_from(&mut buf).is_ok()
        }),
        Probe::Icmp => from
            .command("ping")
            .args(["-c", "1", "-W", "0.4", to])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false),
    }
}

/// A packet capture (`tcpdump`) on `eth0` of a namespace, ended (by PID)
/// on drop: what crossed an underlay.
#[derive(Debug)]
pub struct Capture {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Capture {
    /// Starts capturing on `eth0` what matches `filter`; returns once
    /// tcpdump listens.
    pub fn start(ns: &Netns, filter: &str) -> Result<Self> {
        Self::start_on(ns, "eth0", filter)
    }

    /// The same on interface `iface`.
    pub fn start_on(ns: &Netns, iface: &str, filter: &str) -> Result<Self> {
        let mut child = ns
            .command("tcpdump")
            .args(["-i", iface, "-nn", "-l", "-p", filter])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("tcpdump (apt-get install tcpdump)")?;
        let (tx, lines) = std::sync::mpsc::channel();
        let err = child.stderr.take().expect("piped");
        let out = child.stdout.take().expect("piped");
        let (ready_tx, ready) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                if l.contains("listening on") {
                    let _ = ready_tx.send(());
                }
            }
        });
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if !l.trim().is_empty() {
                    let _ = tx.send(l);
                }
            }
        });
        ready
            .recv_timeout(Duration::from_secs(10))
            .context("tcpdump did not start listening")?;
        Ok(Self { child, lines })
    }

    /// Ends the capture and returns what it printed.
    pub fn finish(mut self) -> Vec<String> {
        std::thread::sleep(Duration::from_millis(300));
        self.stop();
        let mut out = Vec::new();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(500)) {
            out.push(l);
        }
        out
    }

    fn stop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let _ = self.child.wait();
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.stop();
        }
    }
}

/// A bpffs of the caller's own, on a temporary directory, unmounted on
/// drop (what is pinned there goes with it). `ip netns exec` mounts a
/// fresh `/sys`, so a daemon there needs a bpffs outside it to keep its
/// pins across restarts.
#[derive(Debug)]
pub struct Bpffs(tempfile::TempDir);

impl Bpffs {
    pub fn new() -> Result<Self> {
        let d = tempfile::tempdir()?;
        nix::mount::mount(
            Some("bpf"),
            d.path(),
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .context("mounting a bpffs")?;
        Ok(Self(d))
    }

    pub fn path(&self) -> std::path::PathBuf {
        self.0.path().to_path_buf()
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.0.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// A link from `host` to `out` (an "outside" namespace): veth `host_if`
/// with `host_addr` (prefix included) in `host`, `eth0` with `out_addr`
/// in `out`, both up, and `out`'s loopback up.
pub fn uplink(
    host: &Netns,
    out: &Netns,
    host_if: &str,
    host_addr: &str,
    out_addr: &str,
) -> Result<()> {
    host.run(
        "ip",
        &[
            "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", &out.0,
        ],
    )?;
    host.run("ip", &["addr", "add", host_addr, "dev", host_if])?;
    host.run("ip", &["link", "set", host_if, "up"])?;
    out.run("ip", &["addr", "add", out_addr, "dev", "eth0"])?;
    out.run("ip", &["link", "set", "eth0", "up"])?;
    out.run("ip", &["link", "set", "lo", "up"])?;
    Ok(())
}
