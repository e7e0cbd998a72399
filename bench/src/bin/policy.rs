//! Policy enforcement at scale, through the real server and the real
//! kernel, next to the raw tools loading the same state in the same run:
//!
//! 1. cold start: W workload endpoints, P policies (R rules each), profiles
//!    and S IP sets holding M members in all, then InSync, on one
//!    ToDataplane stream; timed from the first message to the reply that
//!    the InSync is programmed. Raw: `ipset restore` and `iptables-restore`
//!    of what `ipset save` / `iptables-save` read back afterwards, into a
//!    fresh namespace.
//! 2. one policy changed at that scale, until programmed. Raw: one chain
//!    rewritten by `iptables-restore --noflush` on top of the same state.
//! 3. churn: a mix of IP-set deltas, endpoint changes, new and removed
//!    endpoints and policy changes at a steady rate; the latency of each
//!    message (sent → programmed), and the server's CPU.
//! 4. the server's peak RSS.
//!
//! IPv4 only (`--ipv6 false`): the raw baseline loads one family. The
//! workload interfaces do not exist (creating 10,000 veth pairs would
//! dominate the run), so no routes are programmed; routes have their own
//! baseline (`ip -batch`) in `kernel_limits.sh`.
//!
//! Runs the server in network namespaces it creates. Needs root.
//!
//! ```sh
//! cargo build --release --workspace --bins
//! ./target/release/policy --endpoints 10000 --policies 5000 --members 1000000
//! ```

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Parser;
use dphandler_proto::felix::{self, to_dataplane::Payload};
use dphandler_tests::{Daemon, Feed, Netns, usage};

#[derive(Parser, Debug)]
#[command(about = "Policy enforcement at scale vs the raw tools, same run")]
struct Args {
    #[arg(long, env = "DPH_BENCH_ENDPOINTS", default_value_t = 10_000)]
    endpoints: usize,
    #[arg(long, env = "DPH_BENCH_POLICIES", default_value_t = 5_000)]
    policies: usize,
    /// Rules per policy (half inbound, half outbound).
    #[arg(long, env = "DPH_BENCH_RULES_PER_POLICY", default_value_t = 10)]
    rules_per_policy: usize,
    #[arg(long, env = "DPH_BENCH_SETS", default_value_t = 1_000)]
    sets: usize,
    /// IP-set members in all (spread evenly over the sets).
    #[arg(long, env = "DPH_BENCH_MEMBERS", default_value_t = 1_000_000)]
    members: usize,
    /// Policy changes timed one by one.
    #[arg(long, env = "DPH_BENCH_CHANGES", default_value_t = 5)]
    changes: usize,
    /// Churn: messages per second, and for how long.
    #[arg(long, env = "DPH_BENCH_CHURN_RATE", default_value_t = 100)]
    churn_rate: u32,
    #[arg(long, env = "DPH_BENCH_CHURN_SECONDS", default_value_t = 20)]
    churn_seconds: u32,
    /// Quiet time before each timed policy change: the server's post-write
    /// re-read (5 s after the write, then 5-10 s of `iptables-save` at this
    /// size) must be over.
    #[arg(long, env = "DPH_BENCH_SETTLE_SECONDS", default_value_t = 20)]
    settle_seconds: u64,
    /// Also write what was programmed (`ipset save`, `iptables-save -t
    /// filter`) into this directory, to study the raw tools by hand.
    #[arg(long, env = "DPH_BENCH_DUMP_DIR")]
    dump_dir: Option<std::path::PathBuf>,
    /// The server's log filter (its log goes to this program's stderr).
    #[arg(long, env = "DPH_BENCH_SERVER_LOG", default_value = "warn")]
    server_log: String,
}

const NAMESPACES: usize = 50;

fn ip(i: usize) -> String {
    format!("10.{}.{}.{}", (i >> 16) & 0xff, (i >> 8) & 0xff, i & 0xff)
}

fn set_id(k: usize) -> String {
    format!("s:set-{k}")
}

fn tcp() -> Option<felix::Protocol> {
    Some(felix::Protocol {
        number_or_name: Some(felix::protocol::NumberOrName::Name("tcp".into())),
    })
}

fn port(p: usize) -> Vec<felix::PortRange> {
    vec![felix::PortRange {
        first: p as i32,
        last: p as i32,
    }]
}

fn policy_id(p: usize) -> felix::PolicyId {
    felix::PolicyId {
        name: format!("default.pol-{p}"),
        ..Default::default()
    }
}

/// Policy `p`, version `v` (a change moves its ports).
fn policy(a: &Args, p: usize, v: usize) -> Payload {
    let half = a.rules_per_policy / 2;
    let rule = |r: usize, inbound: bool| {
        let set = vec![set_id((p * a.rules_per_policy + r) % a.sets)];
        let mut rule = felix::Rule {
            action: "allow".into(),
            protocol: tcp(),
            dst_ports: port(8000 + r + v),
            ..Default::default()
        };
        if inbound {
            rule.src_ip_set_ids = set;
        } else {
            rule.dst_ip_set_ids = set;
        }
        rule
    };
    Payload::ActivePolicyUpdate(felix::ActivePolicyUpdate {
        id: Some(policy_id(p)),
        policy: Some(felix::Policy {
            tier: "default".into(),
            inbound_rules: (0..half).map(|r| rule(r, true)).collect(),
            outbound_rules: (half..a.rules_per_policy).map(|r| rule(r, false)).collect(),
            ..Default::default()
        }),
    })
}

fn workload_id(w: usize) -> felix::WorkloadEndpointId {
    felix::WorkloadEndpointId {
        orchestrator_id: "k8s".into(),
        workload_id: format!("ns{}/pod-{w}", w % NAMESPACES),
        endpoint_id: "eth0".into(),
    }
}

/// Endpoint `w`, naming ingress policy `pin` and egress policy `pout`.
fn endpoint(w: usize, pin: usize, pout: usize) -> Payload {
    Payload::WorkloadEndpointUpdate(felix::WorkloadEndpointUpdate {
        id: Some(workload_id(w)),
        endpoint: Some(felix::WorkloadEndpoint {
            state: "active".into(),
            name: format!("cali{w:011x}"),
            mac: format!(
                "ee:ee:ee:{:02x}:{:02x}:{:02x}",
                w >> 16 & 0xff,
                w >> 8 & 0xff,
                w & 0xff
            ),
            profile_ids: vec![format!("kns.ns{}", w % NAMESPACES)],
            ipv4_nets: vec![format!("{}/32", ip(0x80_0000 + w))],
            tiers: vec![felix::TierInfo {
                name: "default".into(),
                ingress_policies: vec![policy_id(pin)],
                egress_policies: vec![policy_id(pout)],
                default_action: "deny".into(),
            }],
            ..Default::default()
        }),
    })
}

fn cold_start(a: &Args) -> Vec<Payload> {
    let mut out = Vec::new();
    let per_set = a.members / a.sets;
    for k in 0..a.sets {
        out.push(Payload::IpsetUpdate(felix::IpSetUpdate {
            id: set_id(k),
            members: (0..per_set).map(|j| ip(k * per_set + j)).collect(),
            r#type: felix::ip_set_update::IpSetType::Ip as i32,
        }));
    }
    for p in 0..a.policies {
        out.push(policy(a, p, 0));
    }
    for n in 0..NAMESPACES {
        out.push(Payload::ActiveProfileUpdate(felix::ActiveProfileUpdate {
            id: Some(felix::ProfileId {
                name: format!("kns.ns{n}"),
            }),
            profile: Some(felix::Profile {
                inbound_rules: vec![felix::Rule {
                    action: "allow".into(),
                    src_ip_set_ids: vec![set_id(n % a.sets)],
                    ..Default::default()
                }],
                outbound_rules: vec![felix::Rule {
                    action: "allow".into(),
                    ..Default::default()
                }],
            }),
        }));
    }
    for w in 0..a.endpoints {
        out.push(endpoint(w, w % a.policies, (w + 1) % a.policies));
    }
    out.push(Payload::InSync(felix::InSync {}));
    out
}

/// Runs `program args` in `ns` with `input` on stdin; the wall time.
fn timed(ns: &Netns, program: &str, args: &[&str], input: &[u8]) -> Result<Duration> {
    let mut file = tempfile::tempfile()?;
    std::io::Write::write_all(&mut file, input)?;
    std::io::Seek::rewind(&mut file)?;
    let started = Instant::now();
    let out = ns
        .command(program)
        .args(args)
        .stdin(file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()?;
    let took = started.elapsed();
    if !out.status.success() {
        bail!(
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(took)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    if !nix::unistd::Uid::effective().is_root() {
        bail!("the benchmark runs the server in network namespaces: run it as root");
    }
    if a.sets == 0 || a.policies == 0 || a.endpoints == 0 {
        bail!("--sets, --policies and --endpoints must be at least 1");
    }
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let dir = dphandler_tests::tempdir()?;
    let ns = Netns::new("benchpol")?;
    ns.run("ip", &["link", "set", "lo", "up"])?;
    let daemon = Daemon::start(
        &ns,
        &dir.path().join("dp.sock"),
        &["--log", &a.server_log, "--ipv6", "false"],
    )?;
    let mut client = daemon.connect().await?;
    let mut feed = Feed::open(&mut client).await?;

    // 1. Cold start.
    let msgs = cold_start(&a);
    let n_msgs = msgs.len();
    let started = Instant::now();
    let mut last = 0;
    for m in msgs {
        last = feed.send(m)?;
    }
    let done = feed.until(last, Duration::from_secs(1800)).await?;
    let ours = done - started;
    let (rss_cold, _) = usage(daemon.pid())?;

    // What we programmed, read back, loaded by the raw tools elsewhere.
    let sets = ns.run("ipset", &["save"])?.stdout;
    let filter = ns.run("iptables-save", &["-t", "filter"])?.stdout;
    let n_rules = String::from_utf8_lossy(&filter)
        .lines()
        .filter(|l| l.starts_with("-A "))
        .count();
    let n_chains = String::from_utf8_lossy(&filter)
        .lines()
        .filter(|l| l.starts_with(":dph-"))
        .count();
    let n_members = String::from_utf8_lossy(&sets)
        .lines()
        .filter(|l| l.starts_with("add "))
        .count();
    if let Some(d) = &a.dump_dir {
        std::fs::create_dir_all(d)?;
        std::fs::write(d.join("ipset.save"), &sets)?;
        std::fs::write(d.join("filter.save"), &filter)?;
    }
    let raw_ns = Netns::new("benchraw")?;
    let raw_sets = timed(&raw_ns, "ipset", &["restore"], &sets)?;
    let raw_filter = timed(&raw_ns, "iptables-restore", &["--wait"], &filter)?;
    let raw_cold = raw_sets + raw_filter;

    // 2. One policy changed: ours, and the raw one-chain rewrite.
    let chain = "dph-pi-default.pol-1";
    let chain_rules: Vec<String> = String::from_utf8_lossy(&filter)
        .lines()
        .filter(|l| l.starts_with(&format!("-A {chain} ")))
        .map(str::to_string)
        .collect();
    let rewrite = format!(
        "*filter\n:{chain} - [0:0]\n{}\nCOMMIT\n",
        chain_rules.join("\n")
    );
    // Both are timed on a quiet machine: the server re-reads a table once,
    // 5 s after its last write (at this scale iptables-save takes seconds),
    // so each change first waits for that to be over.
    let (mut ours_change, mut raw_change) = (Vec::new(), Vec::new());
    for i in 0..a.changes {
        tokio::time::sleep(Duration::from_secs(a.settle_seconds)).await;
        let took = timed(
            &raw_ns,
            "iptables-restore",
            &["--noflush", "--wait"],
            rewrite.as_bytes(),
        )?;
        raw_change.push(took.as_secs_f64() * 1000.0);
        let p = 1 + i * 7 % a.policies;
        let t0 = Instant::now();
        let seq = feed.send(policy(&a, p, 1 + i))?;
        let at = feed.until(seq, Duration::from_secs(60)).await?;
        ours_change.push((at - t0).as_secs_f64() * 1000.0);
        eprintln!(
            "policy change {}: ours {:.1} ms, raw {:.1} ms",
            i + 1,
            ours_change[i],
            raw_change[i]
        );
    }
    drop(raw_ns);

    // 3. Churn at a steady rate, once the last change's re-read is over.
    tokio::time::sleep(Duration::from_secs(a.settle_seconds)).await;
    let h0 = client
        .get_status(dphandler_proto::v1::GetStatusRequest {})
        .await?
        .into_inner()
        .apply_histogram;
    let (_, cpu0) = usage(daemon.pid())?;
    let total = (a.churn_rate * a.churn_seconds) as usize;
    let interval = Duration::from_secs_f64(1.0 / f64::from(a.churn_rate));
    let mut sent: BTreeMap<u64, Instant> = BTreeMap::new();
    let mut lat: Vec<f64> = Vec::with_capacity(total);
    let churn_started = Instant::now();
    let mut next_new = a.endpoints;
    let mut oldest_new = a.endpoints;
    let mut i = 0usize;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    while i < total || !sent.is_empty() {
        tokio::select! {
            _ = tick.tick(), if i < total => {
                let (kind, msg) = match i % 10 {
                    0..5 => {
                        let k = (i * 31) % a.sets;
                        let base = 0x40_0000 + i * 2;
                        ("ip-set delta", Payload::IpsetDeltaUpdate(felix::IpSetDeltaUpdate {
                            id: set_id(k),
                            added_members: vec![ip(base), ip(base + 1)],
                            removed_members: vec![ip(k * (a.members / a.sets) + i % 10)],
                        }))
                    }
                    5 | 6 => {
                        let w = (i * 13) % a.endpoints;
                        ("endpoint changed", endpoint(w, (w + i) % a.policies, (w + 1) % a.policies))
                    }
                    7 => {
                        next_new += 1;
                        ("endpoint added", endpoint(next_new, i % a.policies, (i + 1) % a.policies))
                    }
                    8 if oldest_new < next_new => {
                        oldest_new += 1;
                        ("endpoint removed", Payload::WorkloadEndpointRemove(felix::WorkloadEndpointRemove {
                            id: Some(workload_id(oldest_new)),
                        }))
                    }
                    _ => ("policy changed", policy(&a, (i * 17) % a.policies, i)),
                };
                *kinds.entry(kind).or_default() += 1;
                let seq = feed.send(msg)?;
                sent.insert(seq, Instant::now());
                i += 1;
            }
            r = feed.next_programmed(Duration::from_secs(60)) => {
                let (s, at) = r?;
                let done: Vec<u64> = sent.range(..=s).map(|(k, _)| *k).collect();
                for k in done {
                    let t = sent.remove(&k).expect("present");
                    lat.push((at - t).as_secs_f64() * 1000.0);
                }
            }
        }
    }
    let churn_wall = churn_started.elapsed().as_secs_f64();
    let (rss_peak, cpu1) = usage(daemon.pid())?;
    let st = client
        .get_status(dphandler_proto::v1::GetStatusRequest {})
        .await?
        .into_inner();
    lat.sort_by(f64::total_cmp);
    drop(feed);
    daemon.stop()?;

    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "policy: {} endpoints, {} policies x {} rules, {} profiles, {} IP sets with {} members; \
         {n_msgs} messages; IPv4; {cores} cores",
        a.endpoints, a.policies, a.rules_per_policy, NAMESPACES, a.sets, a.members
    );
    println!(
        "programmed: {n_chains} chains of ours, {n_rules} rules in filter, {n_members} IP-set members"
    );
    println!();
    println!("| case | dphandler | raw tools, same run | ratio / difference | target |");
    println!("|---|---|---|---|---|");
    println!(
        "| cold start, first message to InSync programmed | {:.0} ms | {:.0} ms (ipset restore {:.0} + iptables-restore {:.0}) | {:.2}x | <= 1.25x |",
        ms(ours),
        ms(raw_cold),
        ms(raw_sets),
        ms(raw_filter),
        ours.as_secs_f64() / raw_cold.as_secs_f64()
    );
    let (oc, rc) = (median(ours_change), median(raw_change));
    println!(
        "| one policy changed, until programmed (median of {}) | {oc:.1} ms | {rc:.1} ms (one-chain iptables-restore --noflush) | raw {:+.1} ms | <= raw + 5 ms |",
        a.changes,
        oc - rc
    );
    println!(
        "| churn {}/s for {} s: latency sent → programmed, p50 / p99 / max | {:.1} / {:.1} / {:.1} ms | | | p99 <= 100 ms |",
        a.churn_rate,
        a.churn_seconds,
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat.last().copied().unwrap_or(0.0)
    );
    // The churn's applies alone: the server's cumulative histogram, after
    // minus before.
    let churn_applies: Vec<(f64, u64)> = st
        .apply_histogram
        .iter()
        .zip(&h0)
        .map(|(b, b0)| (b.le_ms, b.count - b0.count))
        .collect();
    let n_applies = churn_applies.last().map_or(0, |b| b.1);
    let bound = |q: f64| {
        let want = (n_applies as f64 * q).ceil() as u64;
        churn_applies
            .iter()
            .find(|(_, c)| *c >= want.max(1))
            .map_or(f64::INFINITY, |b| b.0)
    };
    let within = |ms: f64| churn_applies.iter().find(|b| b.0 == ms).map_or(0, |b| b.1);
    println!(
        "| churn: the server's apply time ({n_applies} applies) | p50 <= {} ms, p99 <= {} ms; {:.0}% within 100 ms, {:.0}% within 500 ms | | | p99 <= 100 ms |",
        bound(0.5),
        bound(0.99),
        100.0 * within(100.0) as f64 / n_applies.max(1) as f64,
        100.0 * within(500.0) as f64 / n_applies.max(1) as f64,
    );
    println!(
        "| churn: server CPU | {:.2} cores | | | <= 0.5 core |",
        (cpu1 - cpu0) / churn_wall
    );
    println!(
        "| peak RSS (after cold start / at the end) | {:.0} / {:.0} MiB | | | reported |",
        rss_cold as f64 / 1024.0,
        rss_peak as f64 / 1024.0
    );
    println!();
    let mix: Vec<String> = kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
    println!("churn mix: {}", mix.join(", "));
    Ok(())
}
