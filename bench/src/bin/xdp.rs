//! XDP against the raw table, same run.
//!
//! 1. Drop rate: a sender namespace blasts small UDP datagrams from one
//!    source at a sink namespace over a veth pair (one sender thread,
//!    bounded by `--seconds` and `--packets`); the sink drops that source
//!    either with our XDP prefilter (the source in its blocklist) or with
//!    a raw-table `DROP` of the same source (`iptables -t raw -A
//!    PREROUTING -s … -j DROP`). On a veth the sender and the drop share
//!    the CPU, so the rate the sender reaches is the cost of a drop. Both
//!    counters (XDP's verdicts, the rule's packet count) confirm every
//!    packet was dropped.
//! 2. Loading a blocklist: `--members` /32s into the XDP map (one
//!    update) against the same members into an IP set (`ipset restore`
//!    of `create` + adds).
//!
//! Needs root. Bounded: nothing leaves the two namespaces.
//!
//! ```sh
//! cargo build --release -p dphandler-bench && ./target/release/xdp --seconds 3 --members 100000
//! ```

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Parser;
use dphandler_bpf::{Filter, Mode};
use dphandler_tests::Netns;
use dphandler_tests::lab::{Bpffs, in_ns};
use ipnet::IpNet;

#[derive(Parser, Debug)]
#[command(about = "XDP drop rate and blocklist load vs the raw table and ipset, same run")]
struct Args {
    /// How long each blast lasts at most.
    #[arg(long, env = "DPH_BENCH_SECONDS", default_value_t = 3.0)]
    seconds: f64,
    /// How many datagrams each blast sends at most.
    #[arg(long, env = "DPH_BENCH_PACKETS", default_value_t = 5_000_000)]
    packets: u64,
    /// Blocklist members loaded.
    #[arg(long, env = "DPH_BENCH_MEMBERS", default_value_t = 100_000)]
    members: u32,
}

fn pair(tag: &str) -> Result<(Netns, Netns)> {
    let sink = Netns::new(&format!("{tag}s"))?;
    let gen_ns = Netns::new(&format!("{tag}g"))?;
    sink.run(
        "ip",
        &[
            "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &gen_ns.0,
        ],
    )?;
    for (ns, a) in [(&sink, "10.90.0.1/24"), (&gen_ns, "10.90.0.2/24")] {
        ns.run("ip", &["link", "set", "lo", "up"])?;
        ns.run("ip", &["addr", "add", a, "dev", "eth0"])?;
        ns.run("ip", &["link", "set", "eth0", "up"])?;
    }
    // A static neighbour: the blast needs no ARP (the sink answers none
    // once it drops everything from us).
    let mac = String::from_utf8(sink.run("cat", &["/sys/class/net/eth0/address"])?.stdout)?;
    gen_ns.run(
        "ip",
        &[
            "neigh",
            "replace",
            "10.90.0.1",
            "lladdr",
            mac.trim(),
            "dev",
            "eth0",
            "nud",
            "permanent",
        ],
    )?;
    Ok((sink, gen_ns))
}

/// Sends 18-byte UDP datagrams from 10.90.0.2 to the sink as fast as one
/// thread can, within the bounds; returns (sent, elapsed).
fn blast(gen_ns: &Netns, a: &Args) -> (u64, Duration) {
    let (limit, packets) = (Duration::from_secs_f64(a.seconds), a.packets);
    in_ns(&gen_ns.0, move || {
        let s = UdpSocket::bind("10.90.0.2:0").expect("bind");
        let to: SocketAddr = "10.90.0.1:9".parse().unwrap();
        let payload = [0u8; 18];
        let t = Instant::now();
        let mut sent = 0u64;
        while sent < packets {
            for _ in 0..256 {
                if s.send_to(&payload, to).is_ok() {
                    sent += 1;
                }
            }
            if t.elapsed() >= limit {
                break;
            }
        }
        (sent, t.elapsed())
    })
}

fn raw_drops(sink: &Netns) -> Result<u64> {
    let out = sink.run(
        "iptables",
        &["-t", "raw", "-L", "PREROUTING", "-v", "-x", "-n"],
    )?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter(|l| l.contains("DROP") && l.contains("10.90.0.2"))
        .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
        .sum())
}

fn member(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0b00_0000 | i)
}

fn main() -> Result<()> {
    let a = Args::parse();
    if !nix::unistd::Uid::effective().is_root() {
        bail!("the benchmark uses network namespaces and a bpffs: run it as root");
    }
    let fs = Bpffs::new()?;
    let bpffs = fs.path();

    // 1a. XDP.
    let (sink, gen_ns) = pair("bxdp")?;
    let b = bpffs.clone();
    let mut f = in_ns(&sink.0, move || Filter::attach(&b, "eth0", &[Mode::Driver]))?;
    f.update_blocklist(&["10.90.0.2/32".parse::<IpNet>()?], &[])?;
    let before = f.verdicts()?;
    let (xdp_sent, xdp_t) = blast(&gen_ns, &a);
    let xdp_dropped = f.verdicts()?.dropped.0 - before.dropped.0;
    f.detach()?;
    drop((sink, gen_ns));

    // 1b. The raw table.
    let (sink, gen_ns) = pair("braw")?;
    sink.run(
        "iptables",
        &[
            "-t",
            "raw",
            "-A",
            "PREROUTING",
            "-s",
            "10.90.0.2",
            "-j",
            "DROP",
        ],
    )?;
    let (raw_sent, raw_t) = blast(&gen_ns, &a);
    let raw_dropped = raw_drops(&sink)?;
    drop((sink, gen_ns));

    // 2. Loading a blocklist: the XDP map against an IP set.
    let (sink, _g) = pair("bload")?;
    let b = bpffs.clone();
    let mut f = in_ns(&sink.0, move || Filter::attach(&b, "eth0", &[Mode::Driver]))?;
    let nets: Vec<IpNet> = (0..a.members)
        .map(|i| IpNet::from(std::net::IpAddr::V4(member(i))))
        .collect();
    let t = Instant::now();
    f.update_blocklist(&nets, &[])?;
    let map_t = t.elapsed();
    let held = f.blocklist()?.len();
    f.detach()?;
    if held != a.members as usize {
        bail!("{held} prefixes in the map, {} expected", a.members);
    }
    let mut script = String::from("create bench hash:net family inet maxelem 1048576\n");
    for i in 0..a.members {
        script += &format!("add bench {}\n", member(i));
    }
    let mut c = sink
        .command("ipset")
        .args(["restore"])
        .stdin(Stdio::piped())
        .spawn()?;
    let t = Instant::now();
    c.stdin
        .take()
        .expect("piped")
        .write_all(script.as_bytes())?;
    let st = c.wait()?;
    let ipset_t = t.elapsed();
    if !st.success() {
        bail!("ipset restore failed");
    }

    let pps = |n: u64, t: Duration| n as f64 / t.as_secs_f64();
    println!(
        "xdp: one sender thread over a veth, {:.1} s or {} datagrams per blast; {} blocklist members",
        a.seconds, a.packets, a.members
    );
    println!();
    println!("| case | raw table / ipset | XDP prefilter | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| datagrams dropped per second (one source listed) | {:.0} pps (`-t raw … -j DROP`; {} of {} counted) | {:.0} pps ({} of {} counted) | {:.2}× |",
        pps(raw_sent, raw_t),
        raw_dropped,
        raw_sent,
        pps(xdp_sent, xdp_t),
        xdp_dropped,
        xdp_sent,
        pps(xdp_sent, xdp_t) / pps(raw_sent, raw_t)
    );
    println!(
        "| {} members loaded | {:.0} ms (`ipset restore`, hash:net) | {:.0} ms (one map update) | {:.2}× |",
        a.members,
        ipset_t.as_secs_f64() * 1e3,
        map_t.as_secs_f64() * 1e3,
        map_t.as_secs_f64() / ipset_t.as_secs_f64()
    );
    Ok(())
}
