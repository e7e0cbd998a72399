//! A traffic loop for the fault tests: an established UDP flow (one
//! datagram and its echo every 10 ms; each one that does not come back is
//! counted lost) and a denied TCP port probed every 50 ms (each
//! connection that gets through is counted, with when). Runs in threads
//! entered into the client's namespace; traffic goes only to the target
//! the test names, an address inside its own namespaces. And a `ping`
//! across a change ([`Pinger`]) for the multi-node tests, an
//! established TCP flow across restarts ([`EchoFlow`]), and the
//! benchmarks' packet path ([`request_response`]).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::Netns;

/// Where the loop sends: the server's address, its echoing UDP port (the
/// established flow) and a TCP port policy denies (a listener behind it,
/// so that a connection that gets through is seen).
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// The flow's source address (else the kernel's choice).
    pub src: Option<IpAddr>,
    pub ip: IpAddr,
    pub udp: u16,
    pub denied_tcp: Option<u16>,
}

/// What the traffic saw.
#[derive(Debug, Default)]
pub struct Seen {
    pub udp_sent: u64,
    pub udp_lost: u64,
    pub denied_tries: u64,
    /// When denied connections got through (since the traffic started).
    pub denied_through: Vec<Duration>,
}

impl Seen {
    pub fn summary(&self) -> String {
        format!(
            "UDP flow {} sent, {} lost; denied port {} tries, {} through",
            self.udp_sent,
            self.udp_lost,
            self.denied_tries,
            self.denied_through.len()
        )
    }
}

/// The traffic loop, running until [`Traffic::stop`].
#[allow(
    missing_debug_implementations,
    reason = "holds running threads; nothing to show"
)]
pub struct Traffic {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    udp: std::thread::JoinHandle<(u64, u64)>,
    denied: Option<std::thread::JoinHandle<(u64, Vec<Duration>)>>,
}

impl Traffic {
    /// Starts the flow from `from` to `to` and waits until its first echo
    /// came back; then the denied port's probes.
    pub fn start(from: &Netns, to: Target) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let udp = {
            let (stop, sent_n) = (stop.clone(), sent.clone());
            let file = std::fs::File::open(format!("/run/netns/{}", from.0))?;
            std::thread::spawn(move || {
                nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
                let any = match (to.src, to.ip) {
                    (Some(src), _) => SocketAddr::new(src, 0),
                    (None, IpAddr::V4(_)) => SocketAddr::from(([0u8; 4], 0)),
                    (None, IpAddr::V6(_)) => SocketAddr::from(([0u16; 8], 0)),
                };
                let s = UdpSocket::bind(any).expect("bind");
                s.connect(SocketAddr::new(to.ip, to.udp)).expect("connect");
                s.set_read_timeout(Some(Duration::from_millis(2)))
                    .expect("timeout");
                let mut got = BTreeSet::new();
                let mut buf = [0u8; 16];
                // The flow is established once an echo came back.
                loop {
                    let _ = s.send(&u64::MAX.to_be_bytes());
                    if s.recv(&mut buf).is_ok() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = ready_tx.send(());
                let mut seq = 0u64;
                let mut next = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    if Instant::now() >= next {
                        let _ = s.send(&seq.to_be_bytes());
                        seq += 1;
                        sent_n.store(seq, Ordering::Relaxed);
                        next += Duration::from_millis(10);
                    }
                    while let Ok(n) = s.recv(&mut buf) {
                        if n == 8 {
                            got.insert(u64::from_be_bytes(buf[..8].try_into().expect("8")));
                        }
                    }
                }
                // Stragglers.
                let end = Instant::now() + Duration::from_millis(300);
                while Instant::now() < end {
                    if let Ok(8) = s.recv(&mut buf) {
                        got.insert(u64::from_be_bytes(buf[..8].try_into().expect("8")));
                    }
                }
                let back = got.iter().filter(|g| **g < seq).count() as u64;
                (seq, seq - back)
            })
        };
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .context("the UDP flow never got an echo")?;
        let denied = to
            .denied_tcp
            .map(|port| -> Result<_> {
                let stop = stop.clone();
                let file = std::fs::File::open(format!("/run/netns/{}", from.0))?;
                Ok(std::thread::spawn(move || {
                    nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
                    let to = SocketAddr::new(to.ip, port);
                    let (mut tries, mut through) = (0u64, Vec::new());
                    while !stop.load(Ordering::Relaxed) {
                        tries += 1;
                        if TcpStream::connect_timeout(&to, Duration::from_millis(50)).is_ok() {
                            through.push(started.elapsed());
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    (tries, through)
                }))
            })
            .transpose()?;
        Ok(Self {
            stop,
            sent,
            udp,
            denied,
        })
    }

    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    pub fn stop(self) -> Seen {
        self.stop.store(true, Ordering::Relaxed);
        let (udp_sent, udp_lost) = self.udp.join().expect("udp thread");
        let (denied_tries, denied_through) = self
            .denied
            .map(|d| d.join().expect("denied thread"))
            .unwrap_or_default();
        Seen {
            udp_sent,
            udp_lost,
            denied_tries,
            denied_through,
        }
    }
}

/// `ping` every 20 ms from a namespace, running across a change (a
/// daemon's restart) until [`Pinger::stop`].
///
/// Not `ping -w`: at its deadline ping counts the requests still in
/// flight as lost, so a loaded machine (replies slower than 20 ms) showed
/// one packet lost of 165 where none was. Here a request counts as lost
/// only when a later one was answered.
#[derive(Debug)]
pub struct Pinger(Option<std::process::Child>);

impl Pinger {
    pub fn start(from: &Netns, to: &str) -> Result<Self> {
        let child = from
            .command("ping")
            .args(["-n", "-i", "0.02", to])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting ping")?;
        Ok(Self(Some(child)))
    }

    /// Ends the ping (SIGINT: it prints its summary) and fails naming the
    /// requests that went unanswered while later ones were answered, or
    /// when too few were answered at the end (more than 10 in flight, 200
    /// ms: the path did not come back).
    pub fn stop(mut self) -> Result<String> {
        let child = self.0.take().context("stopped once")?;
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id())?);
        // `ip netns exec` execs ping: the pid is ping's, and ours.
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT)?;
        let out = child.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let answered: BTreeSet<u64> = text
            .split_whitespace()
            .filter_map(|w| w.strip_prefix("icmp_seq=")?.parse().ok())
            .collect();
        let sent: u64 = text
            .lines()
            .find_map(|l| l.split_once(" packets transmitted")?.0.trim().parse().ok())
            .context("no summary from ping")?;
        let lines: Vec<&str> = text.lines().filter(|l| !l.is_empty()).collect();
        let summary = lines[lines.len().saturating_sub(2)..].join(" / ");
        let Some(&last) = answered.last() else {
            anyhow::bail!("no reply at all: {summary}");
        };
        let lost: Vec<u64> = (1..last).filter(|s| !answered.contains(s)).collect();
        if !lost.is_empty() {
            anyhow::bail!("requests {lost:?} unanswered, later ones answered: {summary}");
        }
        if sent.saturating_sub(last) > 10 {
            anyhow::bail!("the last {} requests unanswered: {summary}", sent - last);
        }
        Ok(format!(
            "{last} of {sent} answered, none lost before the last answer"
        ))
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// An established TCP flow (to an echo server, `lab::echo`): a byte every
/// 10 ms and its echo back; [`EchoFlow::finish`] says how many exchanges
/// failed of how many made.
#[derive(Debug)]
pub struct EchoFlow {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<(u64, u64)>>,
}

impl EchoFlow {
    pub fn start(from: &Netns, to: SocketAddr) -> Result<Self> {
        use std::io::{Read, Write};
        let mut s = crate::lab::connect(from, to).context("the flow's connection")?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let (mut failed, mut made) = (0u64, 0u64);
            let mut b = [0u8; 1];
            while !flag.load(Ordering::Relaxed) {
                made += 1;
                if s.write_all(b"x").is_err() || s.read_exact(&mut b).is_err() {
                    failed += 1;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            (failed, made)
        });
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// (failed, made).
    pub fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

/// Request/response transactions per second over one TCP connection from
/// inside `from` to `to` (an echo, `lab::echo`): one byte each way, for
/// `seconds` after 1,000 to warm up. The benchmarks' packet path.
pub fn request_response(from: &Netns, to: SocketAddr, seconds: u64) -> Result<f64> {
    use std::io::{Read, Write};
    crate::lab::in_ns(&from.0.clone(), move || -> Result<f64> {
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(2))
            .with_context(|| format!("connecting to {to}"))?;
        s.set_nodelay(true)?;
        let mut b = [0u8; 1];
        for _ in 0..1000 {
            s.write_all(b"x")?;
            s.read_exact(&mut b)?;
        }
        let (started, mut n) = (Instant::now(), 0u64);
        while started.elapsed() < Duration::from_secs(seconds) {
            for _ in 0..100 {
                s.write_all(b"x")?;
                s.read_exact(&mut b)?;
            }
            n += 100;
        }
        Ok(n as f64 / started.elapsed().as_secs_f64())
    })
}
