//! A traffic loop for the fault tests: an established UDP flow (one
//! datagram and its echo every 10 ms; each one that does not come back is
//! counted lost) and a denied TCP port probed every 50 ms (each
//! connection that gets through is counted, with when). Runs in threads
//! entered into the client's namespace; traffic goes only to the target
//! the test names, an address inside its own namespaces.

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
