//! WireGuard through the real daemon.
//!
//! 1. Peers programmed per second: a node whose WireGuard device is up is
//!    sent, in one batch over gRPC, what the calc graph sends for
//!    `--peers` other nodes (host metadata, WireGuard endpoint with key,
//!    one IPAM block each), timed until the server reports it programmed
//!    (device peers, table routes). Then one node's key changes, timed the
//!    same way. Beside it, in the same run, the raw tools on a device of
//!    their own: `wg setconf` with the same peers plus `ip -batch` with the
//!    same table routes, and one `wg set … peer`.
//! 2. Time to first handshake: two nodes (namespaces joined by a veth
//!    underlay), each with its daemon; from sending each node the other's
//!    key until `wg` reports a handshake, with a ping every 10 ms from one
//!    node's WireGuard address to the other's. Beside it, two devices set
//!    up by `wg` and `ip` directly, timed from the first `wg set`.
//!
//! This kernel has no WireGuard module: both sides use `wireguard-go`.
//! Needs root, `wireguard-go` and `wg`.
//!
//! ```sh
//! cargo build --release --workspace --bins && ./target/release/wireguard --peers 1000
//! ```

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use dphandler_proto::felix::{self, to_dataplane::Payload};
use dphandler_tests::{Daemon, Feed, Netns, usage};

#[derive(Parser, Debug)]
#[command(about = "WireGuard peers and handshakes through the real daemon vs raw wg/ip, same run")]
struct Args {
    /// Other nodes (one peer and one block each).
    #[arg(long, env = "DPH_BENCH_PEERS", default_value_t = 1_000)]
    peers: usize,
    /// One-peer changes timed.
    #[arg(long, env = "DPH_BENCH_CHANGES", default_value_t = 10)]
    changes: usize,
    /// Handshakes timed (each on fresh nodes).
    #[arg(long, env = "DPH_BENCH_HANDSHAKES", default_value_t = 3)]
    handshakes: usize,
    /// The server's log filter.
    #[arg(long, env = "DPH_BENCH_SERVER_LOG", default_value = "warn")]
    server_log: String,
}

/// A peer key: 32 bytes from node `n` and `salt` (any 32 bytes are a
/// public key to WireGuard), base64.
fn key(n: usize, salt: u8) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b = [0u8; 33];
    let mut x = (n as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(salt);
    for v in b.iter_mut().take(32) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *v = x as u8;
    }
    let mut s = String::new();
    for c in b.chunks(3) {
        let w = (u32::from(c[0]) << 16) | (u32::from(c[1]) << 8) | u32::from(c[2]);
        for i in 0..4 {
            s.push(A[(w >> (18 - 6 * i)) as usize & 63] as char);
        }
    }
    s.truncate(43);
    s.push('=');
    s
}

/// Node `n`'s underlay address (this node is 0) and block.
fn node_ip(n: usize) -> String {
    format!("172.20.{}.{}", (n + 1) / 256, (n + 1) % 256)
}

fn block(n: usize) -> String {
    let base = (n as u32) << 6;
    let a = 0x0a00_0000 | base;
    format!("{}/26", std::net::Ipv4Addr::from(a))
}

fn peer_msgs(n: usize, salt: u8) -> Vec<Payload> {
    vec![
        Payload::HostMetadataUpdate(felix::HostMetadataUpdate {
            hostname: format!("node-{n}"),
            ipv4_addr: node_ip(n),
            ..Default::default()
        }),
        Payload::WireguardEndpointUpdate(felix::WireguardEndpointUpdate {
            hostname: format!("node-{n}"),
            public_key: key(n, salt),
            ..Default::default()
        }),
        Payload::RouteUpdate(felix::RouteUpdate {
            types: 1,        // REMOTE_WORKLOAD
            ip_pool_type: 2, // VXLAN
            dst: block(n),
            dst_node_name: format!("node-{n}"),
            dst_node_ip: node_ip(n),
            ..Default::default()
        }),
    ]
}

fn run(ns: &Netns, prog: &str, args: &[&str], stdin: Option<&Path>) -> Result<Duration> {
    let mut c = ns.command(prog);
    c.args(args).stdout(Stdio::null());
    if let Some(f) = stdin {
        c.stdin(std::fs::File::open(f)?);
    }
    let t = Instant::now();
    let st = c.status().with_context(|| format!("running {prog}"))?;
    let d = t.elapsed();
    if !st.success() {
        bail!("{prog} {args:?} failed");
    }
    Ok(d)
}

fn out(ns: &Netns, prog: &str, args: &[&str]) -> Result<String> {
    Ok(String::from_utf8_lossy(&ns.run(prog, args)?.stdout).into_owned())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `wireguard-go` processes we started (by pid file or child), ended on
/// drop with their sockets.
struct WgGo {
    pids: Vec<std::path::PathBuf>,
    children: Vec<std::process::Child>,
    sockets: Vec<String>,
}

fn kill_pid_file(p: &Path) {
    if let Ok(pid) = std::fs::read_to_string(p)
        && let Ok(pid) = pid.trim().parse::<i32>()
    {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

impl Drop for WgGo {
    fn drop(&mut self) {
        for p in &self.pids {
            kill_pid_file(p);
        }
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for s in &self.sockets {
            let _ = std::fs::remove_file(format!("/var/run/wireguard/{s}.sock"));
        }
    }
}

fn underlay(ns: &Netns, addr: &str) -> Result<()> {
    for args in [
        &["link", "set", "lo", "up"][..],
        &[
            "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
        ],
        &["addr", "add", addr, "dev", "eth0"],
        &["link", "set", "eth0", "up"],
        &["link", "set", "eth1", "up"],
    ] {
        ns.run("ip", args)?;
    }
    Ok(())
}

/// Two nodes `<tag>1` and `<tag>2` joined by a veth underlay (`eth0`,
/// `addr[i]`/24 each), up.
fn two_nodes(tag: &str, addr: [&str; 2]) -> Result<[Netns; 2]> {
    let n1 = Netns::new(&format!("{tag}1"))?;
    let n2 = Netns::new(&format!("{tag}2"))?;
    n1.run(
        "ip",
        &[
            "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &n2.0,
        ],
    )?;
    for (i, ns) in [&n1, &n2].into_iter().enumerate() {
        ns.run("ip", &["link", "set", "lo", "up"])?;
        ns.run(
            "ip",
            &["addr", "add", &format!("{}/24", addr[i]), "dev", "eth0"],
        )?;
        ns.run("ip", &["link", "set", "eth0", "up"])?;
    }
    Ok([n1, n2])
}

/// Starts `wireguard-go` on `iface` in `ns` and waits for its socket.
fn start_wireguard_go(ns: &Netns, iface: &str, reap: &mut WgGo) -> Result<()> {
    let c = ns
        .command("wireguard-go")
        .args(["-f", iface])
        .env("WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("wireguard-go (apt-get install wireguard-go)")?;
    reap.children.push(c);
    reap.sockets.push(iface.to_string());
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(format!("/var/run/wireguard/{iface}.sock"))
        .is_err()
    {
        if t.elapsed() > Duration::from_secs(5) {
            bail!("wireguard-go {iface} did not start");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

fn handshake(ns: &Netns, iface: &str) -> bool {
    out(ns, "wg", &["show", iface, "latest-handshakes"]).is_ok_and(|o| {
        o.split_whitespace()
            .nth(1)
            .is_some_and(|t| t.parse::<u64>().is_ok_and(|t| t > 0))
    })
}

/// Pings `to` from `ns` every 10 ms until `iface` has shaken hands.
fn until_handshake(ns: &Netns, iface: &str, to: &str, since: Instant) -> Result<Duration> {
    loop {
        let _ = ns
            .command("ping")
            .args(["-c", "1", "-W", "0.01", to])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if handshake(ns, iface) {
            return Ok(since.elapsed());
        }
        if since.elapsed() > Duration::from_secs(20) {
            bail!("no handshake on {iface} in 20 s");
        }
    }
}

async fn peers_bench(a: &Args, tag: u32) -> Result<(Duration, Duration, Vec<f64>, Vec<f64>, u64)> {
    let dir = dphandler_tests::tempdir()?;
    let iface = format!("wgp{tag}.cali");
    let state = dir.path().join("state");
    let mut reap = WgGo {
        pids: vec![state.join(format!("wireguard-go.{iface}.pid"))],
        children: vec![],
        sockets: vec![iface.clone()],
    };
    let ns = Netns::new("benchwg")?;
    underlay(&ns, "172.20.0.1/16")?;
    let daemon = Daemon::start(
        &ns,
        &dir.path().join("dp.sock"),
        &[
            "--log",
            &a.server_log,
            "--ipv6",
            "false",
            "--hostname",
            "node-0",
            "--wireguard",
            "true",
            "--wireguard-interface",
            &iface,
            "--state-dir",
            &state.display().to_string(),
        ],
    )?;
    let mut client = daemon.connect().await?;
    let mut feed = Feed::open(&mut client).await?;
    // The device first (this node only), so that what is timed is peers.
    feed.send(Payload::HostMetadataUpdate(felix::HostMetadataUpdate {
        hostname: "node-0".into(),
        ipv4_addr: node_ip(0),
        ..Default::default()
    }))?;
    let seq = feed.send(Payload::InSync(felix::InSync {}))?;
    feed.until(seq, Duration::from_secs(60)).await?;
    let t = Instant::now();
    while !out(&ns, "wg", &["show", &iface]).is_ok_and(|o| o.contains("public key")) {
        if t.elapsed() > Duration::from_secs(10) {
            bail!("no WireGuard device {iface}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let msgs: Vec<Payload> = (1..=a.peers).flat_map(|n| peer_msgs(n, 0)).collect();
    let t0 = Instant::now();
    let mut last = 0;
    for m in msgs {
        last = feed.send(m)?;
    }
    let done = feed.until(last, Duration::from_secs(600)).await?;
    let cold = done - t0;
    let n = out(&ns, "wg", &["show", &iface, "peers"])?.lines().count();
    if n != a.peers {
        bail!("{n} peers on {iface}, {} expected", a.peers);
    }
    let routes = out(&ns, "ip", &["route", "show", "table", "1"])?
        .lines()
        .count();
    if routes != a.peers {
        bail!("{routes} routes in table 1, {} expected", a.peers);
    }
    // One node's key changes.
    let mut change = Vec::new();
    for c in 0..a.changes {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let n = 1 + c % a.peers;
        let t = Instant::now();
        let seq = feed.send(Payload::WireguardEndpointUpdate(
            felix::WireguardEndpointUpdate {
                hostname: format!("node-{n}"),
                public_key: key(n, 1 + c as u8),
                ..Default::default()
            },
        ))?;
        let at = feed.until(seq, Duration::from_secs(60)).await?;
        change.push((at - t).as_secs_f64() * 1e3);
    }
    let (rss, _) = usage(daemon.pid())?;
    drop(feed);
    daemon.stop()?;
    // The daemon's wireguard-go outlives it by design: end it now.
    for p in reap.pids.drain(..) {
        kill_pid_file(&p);
    }

    // The raw tools on a device of their own.
    let raw = Netns::new("benchwgraw")?;
    underlay(&raw, "172.20.0.1/16")?;
    let raw_iface = format!("wgr{tag}.cali");
    start_wireguard_go(&raw, &raw_iface, &mut reap)?;
    run(&raw, "ip", &["link", "set", &raw_iface, "up"], None)?;
    let private = dir.path().join("private.key");
    std::fs::write(&private, format!("{}\n", key(0, 9)))?;
    let conf = dir.path().join("wg.conf");
    let mut text = format!(
        "[Interface]\nPrivateKey = {}\nListenPort = 51820\nFwMark = 0x200000\n",
        key(0, 9)
    );
    let mut batch = String::new();
    for n in 1..=a.peers {
        text += &format!(
            "[Peer]\nPublicKey = {}\nEndpoint = {}:51820\nAllowedIPs = {}\n",
            key(n, 0),
            node_ip(n),
            block(n)
        );
        batch += &format!(
            "route add {} dev {raw_iface} table 1 proto boot scope link\n",
            block(n)
        );
    }
    std::fs::write(&conf, text)?;
    let routes_file = dir.path().join("routes.batch");
    std::fs::write(&routes_file, batch)?;
    let t = Instant::now();
    run(
        &raw,
        "wg",
        &["setconf", &raw_iface, &conf.display().to_string()],
        None,
    )?;
    run(&raw, "ip", &["-batch", "-"], Some(&routes_file))?;
    run(
        &raw,
        "ip",
        &[
            "rule",
            "add",
            "not",
            "fwmark",
            "0x200000/0x200000",
            "lookup",
            "1",
            "priority",
            "99",
        ],
        None,
    )?;
    let raw_cold = t.elapsed();
    let mut raw_change = Vec::new();
    for c in 0..a.changes {
        let n = 1 + c % a.peers;
        let ep = format!("{}:51820", node_ip(n));
        let (old, new) = (key(n, c as u8), key(n, 1 + c as u8));
        let t = Instant::now();
        run(
            &raw,
            "wg",
            &[
                "set",
                &raw_iface,
                "peer",
                &old,
                "remove",
                "peer",
                &new,
                "endpoint",
                &ep,
                "allowed-ips",
                &block(n),
            ],
            None,
        )?;
        raw_change.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok((raw_cold, cold, raw_change, change, rss))
}

/// One two-node handshake through the daemons.
async fn handshake_daemons(a: &Args, tag: u32, round: usize) -> Result<Duration> {
    let dir = dphandler_tests::tempdir()?;
    let ifaces = [
        format!("wh{tag}a{round}.cali"),
        format!("wh{tag}b{round}.cali"),
    ];
    let states = [dir.path().join("s1"), dir.path().join("s2")];
    let _reap = WgGo {
        pids: (0..2)
            .map(|i| states[i].join(format!("wireguard-go.{}.pid", ifaces[i])))
            .collect(),
        children: vec![],
        sockets: ifaces.to_vec(),
    };
    let addr = ["172.31.78.1", "172.31.78.2"];
    let [n1, n2] = two_nodes("benchwh", addr)?;
    let wg_addr = ["10.66.1.1", "10.66.2.1"];
    let blocks = ["10.66.1.0/26", "10.66.2.0/26"];
    let mut daemons = Vec::new();
    let mut keys = Vec::new();
    for (i, ns) in [&n1, &n2].into_iter().enumerate() {
        let d = Daemon::start(
            ns,
            &dir.path().join(format!("n{i}.sock")),
            &[
                "--log",
                &a.server_log,
                "--ipv6",
                "false",
                "--hostname",
                &format!("node{i}"),
                "--wireguard",
                "true",
                "--wireguard-interface",
                &ifaces[i],
                "--state-dir",
                &states[i].display().to_string(),
            ],
        )?;
        let mut c = d.connect().await?;
        let mut f = Feed::open(&mut c).await?;
        for n in 0..2 {
            f.send(Payload::HostMetadataUpdate(felix::HostMetadataUpdate {
                hostname: format!("node{n}"),
                ipv4_addr: addr[n].into(),
                ..Default::default()
            }))?;
            f.send(Payload::RouteUpdate(felix::RouteUpdate {
                types: if n == i { 4 } else { 1 },
                ip_pool_type: 2,
                dst: blocks[n].into(),
                dst_node_name: format!("node{n}"),
                dst_node_ip: addr[n].into(),
                ..Default::default()
            }))?;
        }
        let seq = f.send(Payload::InSync(felix::InSync {}))?;
        f.until(seq, Duration::from_secs(30)).await?;
        let t = Instant::now();
        let k = loop {
            let s = out(ns, "wg", &["show", &ifaces[i], "public-key"])?;
            if !s.trim().is_empty() {
                break s.trim().to_string();
            }
            if t.elapsed() > Duration::from_secs(10) {
                bail!("no key on {}", ifaces[i]);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        keys.push(k);
        daemons.push((d, f));
    }
    let t0 = Instant::now();
    for (_, f) in &mut daemons {
        let mut last = 0;
        for n in 0..2 {
            last = f.send(Payload::WireguardEndpointUpdate(
                felix::WireguardEndpointUpdate {
                    hostname: format!("node{n}"),
                    public_key: keys[n].clone(),
                    interface_ipv4_addr: wg_addr[n].into(),
                },
            ))?;
        }
        f.until(last, Duration::from_secs(30)).await?;
    }
    let d = until_handshake(&n1, &ifaces[0], wg_addr[1], t0)?;
    for (d, _) in daemons {
        d.stop()?;
    }
    Ok(d)
}

/// The same with `wg` and `ip` by hand.
fn handshake_raw(tag: u32, round: usize) -> Result<Duration> {
    let dir = dphandler_tests::tempdir()?;
    let ifaces = [
        format!("wr{tag}a{round}.cali"),
        format!("wr{tag}b{round}.cali"),
    ];
    let mut reap = WgGo {
        pids: vec![],
        children: vec![],
        sockets: vec![],
    };
    let addr = ["172.31.79.1", "172.31.79.2"];
    let [n1, n2] = two_nodes("benchwr", addr)?;
    let wg_addr = ["10.67.1.1", "10.67.2.1"];
    let privs = [key(1, 77), key(2, 77)];
    let mut pubs = Vec::new();
    for (i, ns) in [&n1, &n2].into_iter().enumerate() {
        start_wireguard_go(ns, &ifaces[i], &mut reap)?;
        ns.run(
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/32", wg_addr[i]),
                "dev",
                &ifaces[i],
            ],
        )?;
        ns.run("ip", &["link", "set", &ifaces[i], "up"])?;
        ns.run(
            "ip",
            &[
                "route",
                "add",
                &format!("{}/32", wg_addr[1 - i]),
                "dev",
                &ifaces[i],
            ],
        )?;
        let p = dir.path().join(format!("k{i}"));
        std::fs::write(&p, format!("{}\n", privs[i]))?;
        let mut c = ns
            .command("wg")
            .arg("pubkey")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        use std::io::Write;
        c.stdin
            .take()
            .expect("piped")
            .write_all(format!("{}\n", privs[i]).as_bytes())?;
        pubs.push(
            String::from_utf8(c.wait_with_output()?.stdout)?
                .trim()
                .to_string(),
        );
    }
    let t0 = Instant::now();
    for (i, ns) in [&n1, &n2].into_iter().enumerate() {
        let p = dir.path().join(format!("k{i}"));
        run(
            ns,
            "wg",
            &[
                "set",
                &ifaces[i],
                "listen-port",
                "51820",
                "private-key",
                &p.display().to_string(),
                "peer",
                &pubs[1 - i],
                "endpoint",
                &format!("{}:51820", addr[1 - i]),
                "allowed-ips",
                &format!("{}/32", wg_addr[1 - i]),
            ],
            None,
        )?;
    }
    until_handshake(&n1, &ifaces[0], wg_addr[1], t0)
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    if !nix::unistd::Uid::effective().is_root() {
        bail!("the benchmark runs the server in network namespaces: run it as root");
    }
    if a.peers == 0 || a.peers > 60_000 {
        bail!("--peers 1..60000");
    }
    let tag = std::process::id() % 10_000;
    let (raw_cold, cold, raw_change, change, rss) = peers_bench(&a, tag).await?;
    let (mut hs, mut raw_hs) = (Vec::new(), Vec::new());
    for r in 0..a.handshakes {
        hs.push(handshake_daemons(&a, tag, r).await?.as_secs_f64() * 1e3);
        raw_hs.push(handshake_raw(tag, r)?.as_secs_f64() * 1e3);
    }
    println!(
        "wireguard: {} peers (one block each) over gRPC to a node with its device up; {} one-key changes; {} two-node handshakes (median); devices by wireguard-go",
        a.peers, a.changes, a.handshakes
    );
    println!();
    println!("| case | raw tools | dphandler (send → Programmed) | ratio / difference |");
    println!("|---|---|---|---|");
    println!(
        "| {} peers + {} table routes + rule | {:.0} ms (`wg setconf` + `ip -batch` + `ip rule`) | {:.0} ms ({:.0} peers/s) | {:.2}× |",
        a.peers,
        a.peers,
        raw_cold.as_secs_f64() * 1e3,
        cold.as_secs_f64() * 1e3,
        a.peers as f64 / cold.as_secs_f64(),
        cold.as_secs_f64() / raw_cold.as_secs_f64()
    );
    let (r, o) = (median(raw_change), median(change));
    println!(
        "| one node's key changes, at {} peers | {r:.2} ms (`wg set … remove … peer`) | {o:.2} ms | {:+.2} ms |",
        a.peers,
        o - r
    );
    let (r, o) = (median(raw_hs), median(hs));
    println!(
        "| two nodes: keys sent → first handshake (ping every 10 ms) | {r:.0} ms (`wg set` on both) | {o:.0} ms | {:+.0} ms |",
        o - r
    );
    println!("server: peak RSS {:.0} MiB", rss as f64 / 1024.0);
    Ok(())
}
