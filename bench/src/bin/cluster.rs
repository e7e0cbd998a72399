//! Routes between nodes through the real daemon: a node of a large VXLAN
//! cluster (by default 1,000 other nodes and 100,000 of their IPAM blocks)
//! fed over gRPC as Calico's calc graph would, then one `RouteUpdate` and
//! one `RouteRemove` timed from the send until the server reports them
//! programmed. Beside it, in the same run, the raw tool: `ip -batch`
//! loading the same routes, and one `ip route add` / `del` process.
//!
//! The server runs in a network namespace of the benchmark's own, with a
//! veth underlay for the VXLAN device's parent. Needs root.
//!
//! ```sh
//! cargo build --release --workspace --bins && ./target/release/cluster --blocks 100000 --nodes 1000
//! ```

use std::net::Ipv4Addr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Parser;
use dphandler_proto::felix::{self, to_dataplane::Payload};
use dphandler_tests::{Daemon, Feed, Netns, usage};

#[derive(Parser, Debug)]
#[command(about = "Routes between nodes through the real daemon vs raw ip -batch, same run")]
struct Args {
    /// Other nodes' IPAM blocks (/26), spread over --nodes.
    #[arg(long, env = "DPH_BENCH_BLOCKS", default_value_t = 100_000)]
    blocks: usize,
    /// Other nodes (one VTEP each).
    #[arg(long, env = "DPH_BENCH_NODES", default_value_t = 1_000)]
    nodes: usize,
    /// One-route changes timed (each an add and a remove).
    #[arg(long, env = "DPH_BENCH_CHANGES", default_value_t = 20)]
    changes: usize,
    /// The server's log filter.
    #[arg(long, env = "DPH_BENCH_SERVER_LOG", default_value = "warn")]
    server_log: String,
    /// WireGuard on too (its table gets a route per block: the nodes send
    /// no keys here, so every block is a `throw`).
    #[arg(long, env = "DPH_BENCH_WIREGUARD")]
    wireguard: bool,
}

/// Block `i`: 10.0.0.0/26 upwards (262,144 fit in 10.0.0.0/8).
fn block(i: usize) -> String {
    let base = (i as u32) << 6;
    format!("{}/26", Ipv4Addr::from(0x0a00_0000 | base))
}

/// Node `n`'s underlay address (this node is 0) and VTEP.
fn node_ip(n: usize) -> Ipv4Addr {
    Ipv4Addr::from(0xac14_0000 | (n as u32 + 1))
}

fn vtep_ip(n: usize) -> Ipv4Addr {
    Ipv4Addr::from(0x6440_0000 | (n as u32 + 1))
}

fn route(i: usize, nodes: usize) -> Payload {
    let n = 1 + i % nodes;
    Payload::RouteUpdate(felix::RouteUpdate {
        types: 1,        // REMOTE_WORKLOAD
        ip_pool_type: 2, // VXLAN
        dst: block(i),
        dst_node_name: format!("node-{n}"),
        dst_node_ip: node_ip(n).to_string(),
        ..Default::default()
    })
}

fn snapshot(a: &Args) -> Vec<Payload> {
    let mut out = vec![Payload::Encapsulation(felix::Encapsulation {
        vxlan_enabled: true,
        ..Default::default()
    })];
    for n in 0..=a.nodes {
        out.push(Payload::VtepUpdate(felix::VxlanTunnelEndpointUpdate {
            node: format!("node-{n}"),
            mac: format!("66:6a:00:00:{:02x}:{:02x}", n / 256, n % 256),
            ipv4_addr: vtep_ip(n).to_string(),
            parent_device_ip: node_ip(n).to_string(),
            ..Default::default()
        }));
    }
    for i in 0..a.blocks {
        out.push(route(i, a.nodes));
    }
    out.push(Payload::InSync(felix::InSync {}));
    out
}

fn timed(ns: &Netns, args: &[&str], stdin: Option<&std::path::Path>) -> Result<Duration> {
    let mut c = ns.command("ip");
    c.args(args).stdout(Stdio::null());
    if let Some(f) = stdin {
        c.stdin(std::fs::File::open(f)?);
    }
    let t = Instant::now();
    let st = c.status()?;
    let d = t.elapsed();
    if !st.success() {
        bail!("ip {args:?} failed");
    }
    Ok(d)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    if !nix::unistd::Uid::effective().is_root() {
        bail!("the benchmark runs the server in network namespaces: run it as root");
    }
    if a.nodes == 0 || a.blocks == 0 || a.blocks > 262_000 || a.nodes > 60_000 {
        bail!("--nodes 1..60000 and --blocks 1..262000");
    }
    let dir = dphandler_tests::tempdir()?;
    let ns = Netns::new("benchclu")?;
    for args in [
        &["link", "set", "lo", "up"][..],
        &[
            "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
        ],
        &["addr", "add", &format!("{}/16", node_ip(0)), "dev", "eth0"],
        &["link", "set", "eth0", "up"],
        &["link", "set", "eth1", "up"],
    ] {
        ns.run("ip", args)?;
    }
    let iface = format!("wgc{}.cali", std::process::id() % 100_000);
    let state = dir.path().join("state");
    let state_arg = state.display().to_string();
    let mut args = vec![
        "--log",
        &a.server_log,
        "--ipv6",
        "false",
        "--hostname",
        "node-0",
    ];
    if a.wireguard {
        args.extend([
            "--wireguard",
            "true",
            "--wireguard-interface",
            &iface,
            "--state-dir",
            &state_arg,
        ]);
    }
    let daemon = Daemon::start(&ns, &dir.path().join("dp.sock"), &args)?;
    let mut client = daemon.connect().await?;
    let mut feed = Feed::open(&mut client).await?;

    // The snapshot, until programmed.
    let msgs = snapshot(&a);
    let n_msgs = msgs.len();
    let t0 = Instant::now();
    let mut last = 0;
    for m in msgs {
        last = feed.send(m)?;
    }
    let done = feed.until(last, Duration::from_secs(600)).await?;
    let cold = done - t0;
    let (rss, _) = usage(daemon.pid())?;
    let shown = ns.run("ip", &["-4", "route", "show", "dev", "vxlan.calico"])?;
    let n_routes = String::from_utf8_lossy(&shown.stdout).lines().count();
    if n_routes != a.blocks {
        bail!("{n_routes} routes on vxlan.calico, {} expected", a.blocks);
    }

    // One route added and removed, each until Programmed. Each change
    // waits 300 ms first: the apply throttle (Felix's: a bucket of 10, one
    // token per 100 ms) paces back-to-back changes, and a lone change is
    // what is measured here.
    let (mut add, mut del, mut same) = (Vec::new(), Vec::new(), Vec::new());
    for c in 0..a.changes {
        let i = a.blocks + c;
        // The API path alone: a RouteUpdate the node already has (nothing
        // to write).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t = Instant::now();
        let seq = feed.send(route(c, a.nodes))?;
        let at = feed.until(seq, Duration::from_secs(60)).await?;
        same.push((at - t).as_secs_f64() * 1e3);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t = Instant::now();
        let seq = feed.send(route(i, a.nodes))?;
        let at = feed.until(seq, Duration::from_secs(60)).await?;
        add.push((at - t).as_secs_f64() * 1e3);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t = Instant::now();
        let seq = feed.send(Payload::RouteRemove(felix::RouteRemove { dst: block(i) }))?;
        let at = feed.until(seq, Duration::from_secs(60)).await?;
        del.push((at - t).as_secs_f64() * 1e3);
    }
    // A VTEP update (a node's MAC changes): everything is worked out again.
    let mut vtep = Vec::new();
    for c in 0..a.changes.min(5) {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let n = 1 + c;
        let t = Instant::now();
        let seq = feed.send(Payload::VtepUpdate(felix::VxlanTunnelEndpointUpdate {
            node: format!("node-{n}"),
            mac: format!("66:6b:00:00:{:02x}:{:02x}", n / 256, n % 256),
            ipv4_addr: vtep_ip(n).to_string(),
            parent_device_ip: node_ip(n).to_string(),
            ..Default::default()
        }))?;
        let at = feed.until(seq, Duration::from_secs(60)).await?;
        vtep.push((at - t).as_secs_f64() * 1e3);
    }
    let st = client
        .get_status(dphandler_proto::v1::GetStatusRequest {})
        .await?
        .into_inner();
    drop(feed);
    daemon.stop()?;
    if a.wireguard {
        // The daemon's wireguard-go outlives it by design: end it here.
        let pid = std::fs::read_to_string(state.join(format!("wireguard-go.{iface}.pid")))?;
        let pid = nix::unistd::Pid::from_raw(pid.trim().parse()?);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = std::fs::remove_file(format!("/var/run/wireguard/{iface}.sock"));
    }

    // The raw tool in a namespace of its own: the same routes by one
    // `ip -batch`, then one route by one process each way.
    let raw = Netns::new("benchcluraw")?;
    for args in [
        &["link", "set", "lo", "up"][..],
        &[
            "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
        ],
        &["addr", "add", &format!("{}/16", node_ip(0)), "dev", "eth0"],
        &["link", "set", "eth0", "up"],
        &[
            "link",
            "add",
            "vxlan.calico",
            "type",
            "vxlan",
            "id",
            "4096",
            "dstport",
            "4789",
            "dev",
            "eth0",
            "local",
            "172.20.0.1",
        ],
        &["link", "set", "vxlan.calico", "up"],
    ] {
        raw.run("ip", args)?;
    }
    let batch = dir.path().join("routes.batch");
    let mut text = String::with_capacity(a.blocks * 80);
    for i in 0..a.blocks {
        let n = 1 + i % a.nodes;
        text += &format!(
            "route add {} via {} dev vxlan.calico onlink proto boot mtu 1450\n",
            block(i),
            vtep_ip(n)
        );
    }
    std::fs::write(&batch, text)?;
    let raw_cold = timed(&raw, &["-batch", "-"], Some(&batch))?;
    let (mut raw_add, mut raw_del) = (Vec::new(), Vec::new());
    for c in 0..a.changes {
        let dst = block(a.blocks + c);
        let via = vtep_ip(1).to_string();
        let route = [
            "route",
            "add",
            &dst,
            "via",
            &via,
            "dev",
            "vxlan.calico",
            "onlink",
        ];
        raw_add.push(timed(&raw, &route, None)?.as_secs_f64() * 1e3);
        raw_del.push(timed(&raw, &["route", "del", &dst], None)?.as_secs_f64() * 1e3);
    }

    println!(
        "cluster: {} blocks of {} other nodes over VXLAN{}, one daemon fed over gRPC ({} messages), {} one-route changes (median)",
        a.blocks,
        a.nodes,
        if a.wireguard { ", WireGuard on" } else { "" },
        n_msgs,
        a.changes
    );
    println!();
    println!("| case | raw tool | dphandler (send → Programmed) | ratio / difference | target |");
    println!("|---|---|---|---|---|");
    println!(
        "| {} routes + {} VTEPs, fresh snapshot | {:.0} ms (`ip -batch`, routes only) | {:.0} ms | {:.2}× | — |",
        a.blocks,
        a.nodes,
        raw_cold.as_secs_f64() * 1e3,
        cold.as_secs_f64() * 1e3,
        cold.as_secs_f64() / raw_cold.as_secs_f64()
    );
    let (ra, oa) = (median(raw_add), median(add));
    let (rd, od) = (median(raw_del), median(del));
    println!(
        "| one `RouteUpdate` at {} | {:.2} ms (`ip route add`) | {:.2} ms | {:+.2} ms | ≤ 1 ms |",
        a.blocks,
        ra,
        oa,
        oa - ra
    );
    println!(
        "| one `RouteRemove` at {} | {:.2} ms (`ip route del`) | {:.2} ms | {:+.2} ms | ≤ 1 ms |",
        a.blocks,
        rd,
        od,
        od - rd
    );
    println!(
        "| a `RouteUpdate` the node already has (the API path alone) | — | {:.2} ms | — | — |",
        median(same)
    );
    println!(
        "| one `VXLANTunnelEndpointUpdate` (a node's MAC) at {} | — | {:.1} ms | — | — |",
        a.blocks,
        median(vtep)
    );
    println!(
        "server: peak RSS {:.0} MiB; apply p50 {:.2} ms, p99 {:.2} ms over its last {} applies",
        rss as f64 / 1024.0,
        st.apply_p50_ms,
        st.apply_p99_ms,
        st.apply_samples
    );
    Ok(())
}
