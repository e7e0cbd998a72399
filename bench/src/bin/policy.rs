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
//! 4. one IP-set member added, until programmed: after each policy change
//!    and then `--member-adds` more, 20 ms apart (the median of all). Raw:
//!    one `ipset add` / `nft add element` after each policy change.
//! 5. the packet path: TCP request/response over one connection between
//!    two real workloads among the synthetic ones, for a few seconds.
//! 6. the server's peak RSS.
//!
//! Each dataplane (`--dataplanes iptables,nftables`) runs the same
//! sequence in namespaces of its own, one after the other, in the same
//! run. The nftables raw baseline is `nft -f` of what `nft list ruleset`
//! reads back (and a one-chain `flush chain` + rules for a change). For
//! nftables the kernel's side is also counted with the function tracer
//! (tracefs; no kprobes on this kernel): commits (`nf_tables_commit`),
//! those that walked a table to validate it (`nft_table_validate`) and
//! the chains walked (`nft_chain_validate`), over a traced churn second
//! pass; the commit time is the daemon's own (batch sent to reply).
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
    /// IP-set members added one at a time, 20 ms apart, after the timed
    /// policy changes (the member's figure is their median: one commit's
    /// time moves with what the caches hold, and five samples after five
    /// runs of the raw tool were too few).
    #[arg(long, env = "DPH_BENCH_MEMBER_ADDS", default_value_t = 50)]
    member_adds: usize,
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
    /// Which dataplanes to run, in order.
    #[arg(
        long,
        env = "DPH_BENCH_DATAPLANES",
        value_delimiter = ',',
        default_value = "iptables,nftables"
    )]
    dataplanes: Vec<String>,
    /// Seconds of request/response traffic between the two real workloads.
    #[arg(long, env = "DPH_BENCH_RR_SECONDS", default_value_t = 5)]
    rr_seconds: u64,
    /// Seconds of the traced churn pass (nftables: validation census).
    #[arg(long, env = "DPH_BENCH_TRACE_SECONDS", default_value_t = 10)]
    trace_seconds: u32,
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

/// Endpoint `w`'s interface.
fn endpoint_name(w: usize) -> String {
    format!("cali{w:011x}")
}

/// Endpoint `w`, naming ingress policy `pin` and egress policy `pout`.
fn endpoint(w: usize, pin: usize, pout: usize) -> Payload {
    Payload::WorkloadEndpointUpdate(felix::WorkloadEndpointUpdate {
        id: Some(workload_id(w)),
        endpoint: Some(felix::WorkloadEndpoint {
            state: "active".into(),
            name: endpoint_name(w),
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

/// Adds `member` to the first set; milliseconds until it is programmed.
async fn add_member(feed: &mut Feed, member: String) -> Result<f64> {
    let t0 = Instant::now();
    let seq = feed.send(Payload::IpsetDeltaUpdate(felix::IpSetDeltaUpdate {
        id: set_id(0),
        added_members: vec![member],
        removed_members: vec![],
    }))?;
    let at = feed.until(seq, Duration::from_secs(60)).await?;
    Ok((at - t0).as_secs_f64() * 1000.0)
}

/// The names our nftables tables can have (the shards up to the most
/// there can be), listed one by one: a family-wide `nft list` is slow
/// at this size.
fn our_nft_tables() -> Vec<String> {
    ["raw", "mangle", "nat", "filter"]
        .iter()
        .map(|t| format!("dph-{t}"))
        .chain(
            (0..dphandler_dataplane::backends::nftables::shards::MAX_SHARDS)
                .map(|n| format!("dph-filter-{n}")),
        )
        .collect()
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

/// The two real workloads among the synthetic ones (request/response).
const RR: [(&str, &str); 2] = [("calirr1", "10.200.0.1"), ("calirr2", "10.200.0.2")];
const RR_PORT: u16 = 7000;

/// The real workloads' policy: tcp/7000 in, everything out.
fn rr_messages() -> Vec<Payload> {
    let id = felix::PolicyId {
        name: "default.rr".into(),
        ..Default::default()
    };
    let mut out = vec![Payload::ActivePolicyUpdate(felix::ActivePolicyUpdate {
        id: Some(id.clone()),
        policy: Some(felix::Policy {
            tier: "default".into(),
            inbound_rules: vec![felix::Rule {
                action: "allow".into(),
                protocol: tcp(),
                dst_ports: port(RR_PORT as usize),
                ..Default::default()
            }],
            outbound_rules: vec![felix::Rule {
                action: "allow".into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
    })];
    for (i, (name, addr)) in RR.iter().enumerate() {
        out.push(Payload::WorkloadEndpointUpdate(
            felix::WorkloadEndpointUpdate {
                id: Some(felix::WorkloadEndpointId {
                    orchestrator_id: "k8s".into(),
                    workload_id: format!("rr/pod-{i}"),
                    endpoint_id: "eth0".into(),
                }),
                endpoint: Some(felix::WorkloadEndpoint {
                    state: "active".into(),
                    name: name.to_string(),
                    profile_ids: vec!["kns.ns0".into()],
                    ipv4_nets: vec![format!("{addr}/32")],
                    tiers: vec![felix::TierInfo {
                        name: "default".into(),
                        ingress_policies: vec![id.clone()],
                        egress_policies: vec![id.clone()],
                        default_action: "deny".into(),
                    }],
                    ..Default::default()
                }),
            },
        ));
    }
    out
}

/// `perf record` of every CPU while a phase runs: the share of the
/// samples in the kernel's commit and in its validation walk.
struct Perf {
    child: std::process::Child,
    file: std::path::PathBuf,
}

impl Perf {
    fn start(dir: &std::path::Path, tag: &str) -> Option<Self> {
        let file = dir.join(format!("perf-{tag}.data"));
        let child = std::process::Command::new("perf")
            .args(["record", "-q", "-a", "-g", "-e", "cpu-clock", "-o"])
            .arg(&file)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        Some(Self { child, file })
    }

    /// (share of samples under nf_tables_commit, share in the walk:
    /// nft_chain_validate and below), in percent of all non-idle samples.
    fn finish(mut self) -> Option<(f64, f64)> {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).ok()?;
        self.child.wait().ok()?;
        let out = std::process::Command::new("perf")
            .args([
                "report",
                "--children",
                "--stdio",
                "--sort",
                "symbol",
                "-g",
                "none",
                "-i",
            ])
            .arg(&self.file)
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        // Lines: "  children%  self%  [k] symbol  IPC columns".
        let share = |sym: &str| -> f64 {
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter(|l| l.split_whitespace().nth(3) == Some(sym))
                .filter_map(|l| {
                    l.split_whitespace()
                        .next()?
                        .trim_end_matches('%')
                        .parse()
                        .ok()
                })
                .fold(0.0, f64::max)
        };
        // The idle loop's own samples (its children hold interrupts).
        let idle = text
            .lines()
            .filter(|l| l.split_whitespace().nth(3) == Some("pv_native_safe_halt"))
            .filter_map(|l| {
                l.split_whitespace()
                    .nth(1)?
                    .trim_end_matches('%')
                    .parse::<f64>()
                    .ok()
            })
            .fold(0.0, f64::max);
        let busy = (100.0 - idle).max(f64::MIN_POSITIVE);
        let _ = std::fs::remove_file(&self.file);
        Some((
            100.0 * share("nf_tables_commit") / busy,
            100.0 * share("nft_chain_validate") / busy,
        ))
    }
}

#[derive(Default)]
struct Churn {
    lat: Vec<f64>,
    wall: f64,
    kinds: BTreeMap<&'static str, usize>,
    next_new: usize,
    oldest_new: usize,
}

/// Endpoints added by the churn that are alive at once.
const LIVE_ENDPOINTS: usize = 20;

/// `rate` messages a second for `seconds`, the mix of the module's doc;
/// each message's latency (sent → programmed). Message `i` is the mix's
/// `i + salt`th: a second pass with a salt past the first's messages
/// sends changes of its own (the same one again changes nothing).
async fn churn(
    a: &Args,
    feed: &mut Feed,
    state: &mut Churn,
    seconds: u32,
    salt: usize,
) -> Result<()> {
    let total = (a.churn_rate * seconds) as usize;
    let interval = Duration::from_secs_f64(1.0 / f64::from(a.churn_rate));
    let mut sent: BTreeMap<u64, Instant> = BTreeMap::new();
    let started = Instant::now();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut i = 0usize;
    while i < total || !sent.is_empty() {
        tokio::select! {
            _ = tick.tick(), if i < total => {
                let j = i + salt;
                let (kind, msg) = match j % 10 {
                    0..5 => {
                        let k = (j * 31) % a.sets;
                        let base = 0x40_0000 + j * 2;
                        ("ip-set delta", Payload::IpsetDeltaUpdate(felix::IpSetDeltaUpdate {
                            id: set_id(k),
                            added_members: vec![ip(base), ip(base + 1)],
                            removed_members: vec![ip(k * (a.members / a.sets) + j % 10)],
                        }))
                    }
                    5 | 6 => {
                        let w = (j * 13) % a.endpoints;
                        ("endpoint changed", endpoint(w, (w + j) % a.policies, (w + 1) % a.policies))
                    }
                    7 => {
                        state.next_new += 1;
                        ("endpoint added", endpoint(state.next_new, j % a.policies, (j + 1) % a.policies))
                    }
                    // An added endpoint lives for LIVE_ENDPOINTS more
                    // adds (one removed right after its add would cancel
                    // out in the same batch and reach no kernel).
                    8 if state.next_new - state.oldest_new > LIVE_ENDPOINTS => {
                        state.oldest_new += 1;
                        ("endpoint removed", Payload::WorkloadEndpointRemove(felix::WorkloadEndpointRemove {
                            id: Some(workload_id(state.oldest_new)),
                        }))
                    }
                    _ => ("policy changed", policy(a, (j * 17) % a.policies, j)),
                };
                *state.kinds.entry(kind).or_default() += 1;
                let seq = feed.send(msg)?;
                sent.insert(seq, Instant::now());
                i += 1;
            }
            r = feed.next_programmed(Duration::from_secs(60)) => {
                let (s, at) = r?;
                let done: Vec<u64> = sent.range(..=s).map(|(k, _)| *k).collect();
                for k in done {
                    let t = sent.remove(&k).expect("present");
                    state.lat.push((at - t).as_secs_f64() * 1000.0);
                }
            }
        }
    }
    state.wall += started.elapsed().as_secs_f64();
    Ok(())
}

/// What one dataplane's run measured.
#[derive(Default)]
struct Report {
    programmed: String,
    cold: f64,
    raw_cold: f64,
    raw_cold_how: String,
    change: f64,
    raw_change: f64,
    member: f64,
    raw_member: f64,
    churn: Churn,
    apply_p50: f64,
    apply_p99: f64,
    n_applies: u64,
    cpu: f64,
    rss_cold: u64,
    rss_peak: u64,
    rr: f64,
    /// nftables: commits, validating commits, commit time p50/p99 (ms)
    /// in the traced pass, and perf's shares.
    commits: Option<(f64, f64, f64, f64)>,
    perf: Option<(f64, f64)>,
}

/// The apply-time histogram's bounds (ms) at quantile `q`, from the
/// server's cumulative buckets after minus before.
fn hist_bound(after: &[(f64, u64)], q: f64) -> f64 {
    let n = after.last().map_or(0, |b| b.1);
    let want = ((n as f64 * q).ceil() as u64).max(1);
    after
        .iter()
        .find(|(_, c)| *c >= want)
        .map_or(f64::INFINITY, |b| b.0)
}

/// A Prometheus histogram's bound (ms) at quantile `q`, over what it
/// counted between scrapes `m0` and `m1`.
fn scraped_bound(
    m0: &BTreeMap<String, f64>,
    m1: &BTreeMap<String, f64>,
    name: &str,
    q: f64,
) -> f64 {
    let mut buckets: Vec<(f64, f64)> = m1
        .iter()
        .filter_map(|(k, v)| {
            let le = k.strip_prefix(&format!("{name}_bucket{{"))?;
            let le = le.split("le=\"").nth(1)?.split('"').next()?;
            let before = m0.get(k).copied().unwrap_or(0.0);
            Some((le.parse::<f64>().unwrap_or(f64::INFINITY), *v - before))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let n = buckets.last().map_or(0.0, |b| b.1);
    let want = (n * q).ceil().max(1.0);
    buckets
        .iter()
        .find(|(_, c)| *c >= want)
        .map_or(f64::INFINITY, |b| b.0 * 1000.0)
}

async fn run_one(a: &Args, dataplane: &str) -> Result<Report> {
    let nft = dataplane == "nftables";
    let mut r = Report::default();
    let dir = dphandler_tests::tempdir()?;
    let ns = Netns::new("benchpol")?;
    ns.run("ip", &["link", "set", "lo", "up"])?;
    let w1 = dphandler_tests::lab::workload_v4(&ns, RR[0].0, 1, RR[0].1)?;
    let w2 = dphandler_tests::lab::workload_v4(&ns, RR[1].0, 2, RR[1].1)?;
    let _echo = dphandler_tests::lab::echo(&w2.0, RR_PORT);
    let daemon = Daemon::start(
        &ns,
        &dir.path().join("dp.sock"),
        &[
            "--log",
            &a.server_log,
            "--ipv6",
            "false",
            "--dataplane",
            dataplane,
        ],
    )?;
    let mut client = daemon.connect().await?;
    let mut feed = Feed::open(&mut client).await?;

    // 1. Cold start.
    let mut msgs = cold_start(a);
    let in_sync = msgs.pop().expect("InSync last");
    msgs.extend(rr_messages());
    msgs.push(in_sync);
    let started = Instant::now();
    let mut last = 0;
    for m in msgs {
        last = feed.send(m)?;
    }
    let done = feed.until(last, Duration::from_secs(1800)).await?;
    r.cold = (done - started).as_secs_f64() * 1000.0;
    r.rss_cold = usage(daemon.pid())?.0;

    // What we programmed, read back, loaded by the raw tools elsewhere.
    let raw_ns = Netns::new("benchraw")?;
    let chain = "dph-pi-default.pol-1";
    let rewrite: Vec<u8>;
    if nft {
        // Table by table: a family-wide dump (`nft list ruleset`, even
        // `nft list tables`) re-walks every rule before where it stopped
        // at each message, and with the sharded layout's 17 tables took
        // over 3 minutes at 10,000 endpoints (a table's own, 0.3 s).
        let mut rules = Vec::new();
        for t in our_nft_tables() {
            if let Ok(out) = ns.run("nft", &["list", "table", "ip", &t]) {
                rules.extend_from_slice(&out.stdout);
            }
        }
        let text = String::from_utf8_lossy(&rules);
        let n_rules = text.matches("comment \"dph:").count();
        let n_chains = text.matches("\tchain ").count();
        let n_sets = text.matches("\tset ").count();
        r.programmed = format!("{n_chains} chains, {n_rules} rules, {n_sets} sets in our tables");
        if let Some(d) = &a.dump_dir {
            std::fs::create_dir_all(d)?;
            std::fs::write(d.join("ruleset.nft"), &rules)?;
        }
        let took = timed(&raw_ns, "nft", &["-f", "-"], &rules)?;
        r.raw_cold = took.as_secs_f64() * 1000.0;
        r.raw_cold_how = "nft -f of nft list ruleset".into();
        // One chain flushed and written again by nft (in the first table
        // that holds it: a shard's copy with the sharded layout; or, where
        // the policy is written into the one policy list chain that uses
        // it, that chain: endpoint 1's ingress, the chain a change to the
        // policy rewrites).
        let list_chain = || {
            let entry = format!("\"{}\" : goto ", endpoint_name(1));
            let rest = text.split(&entry).find(|r| r.starts_with("dph-tw-list-"))?;
            rest.split([',', ' ', '\n']).next()
        };
        let chain = if text.contains(&format!("chain {chain} {{")) {
            chain
        } else {
            list_chain().unwrap_or(chain)
        };
        let head = format!("chain {chain} {{");
        let (table, body) = text
            .split("table ip ")
            .find_map(|t| {
                let name = t.split_whitespace().next()?;
                let body = t.split(&head).nth(1)?.split('}').next()?;
                Some((name, body))
            })
            .unwrap_or(("dph-filter", ""));
        let body: Vec<&str> = body
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        rewrite = format!(
            "flush chain ip {table} {chain}\ntable ip {table} {{\nchain {chain} {{\n{}\n}}\n}}\n",
            body.join("\n")
        )
        .into_bytes();
    } else {
        let sets = ns.run("ipset", &["save"])?.stdout;
        let filter = ns.run("iptables-save", &["-t", "filter"])?.stdout;
        let text = String::from_utf8_lossy(&filter);
        let n_rules = text.lines().filter(|l| l.starts_with("-A ")).count();
        let n_chains = text.lines().filter(|l| l.starts_with(":dph-")).count();
        let n_members = String::from_utf8_lossy(&sets)
            .lines()
            .filter(|l| l.starts_with("add "))
            .count();
        r.programmed = format!(
            "{n_chains} chains of ours, {n_rules} rules in filter, {n_members} IP-set members"
        );
        if let Some(d) = &a.dump_dir {
            std::fs::create_dir_all(d)?;
            std::fs::write(d.join("ipset.save"), &sets)?;
            std::fs::write(d.join("filter.save"), &filter)?;
        }
        let raw_sets = timed(&raw_ns, "ipset", &["restore"], &sets)?;
        let raw_filter = timed(&raw_ns, "iptables-restore", &["--wait"], &filter)?;
        r.raw_cold = (raw_sets + raw_filter).as_secs_f64() * 1000.0;
        r.raw_cold_how = format!(
            "ipset restore {:.0} + iptables-restore {:.0}",
            raw_sets.as_secs_f64() * 1000.0,
            raw_filter.as_secs_f64() * 1000.0
        );
        let chain_rules: Vec<String> = text
            .lines()
            .filter(|l| l.starts_with(&format!("-A {chain} ")))
            .map(str::to_string)
            .collect();
        rewrite = format!(
            "*filter\n:{chain} - [0:0]\n{}\nCOMMIT\n",
            chain_rules.join("\n")
        )
        .into_bytes();
    }

    // 2. One policy changed, and 4. one IP-set member added: ours and
    // the raw tool's, each after the server's post-write re-read is over.
    let (mut ours_change, mut raw_change) = (Vec::new(), Vec::new());
    let (mut ours_member, mut raw_member) = (Vec::new(), Vec::new());
    for i in 0..a.changes {
        tokio::time::sleep(Duration::from_secs(a.settle_seconds)).await;
        let took = if nft {
            timed(&raw_ns, "nft", &["-f", "-"], &rewrite)?
        } else {
            timed(
                &raw_ns,
                "iptables-restore",
                &["--noflush", "--wait"],
                &rewrite,
            )?
        };
        raw_change.push(took.as_secs_f64() * 1000.0);
        let p = 1 + i * 7 % a.policies;
        let t0 = Instant::now();
        let seq = feed.send(policy(a, p, 1 + i))?;
        let at = feed.until(seq, Duration::from_secs(60)).await?;
        ours_change.push((at - t0).as_secs_f64() * 1000.0);

        let member = ip(0x60_0000 + i);
        let took = if nft {
            let set = dphandler_dataplane::model::ipsets::SetNames::new("dph")
                .expect("valid")
                .for_nftables()
                .name(
                    dphandler_dataplane::model::IpVersion::V4,
                    &dphandler_dataplane::model::Id::new(&set_id(0)).expect("valid"),
                );
            // The first table that holds it (with the sharded layout, the
            // shards whose rules use it).
            let table = our_nft_tables()
                .into_iter()
                .find(|t| raw_ns.run("nft", &["list", "set", "ip", t, &set]).is_ok())
                .unwrap_or_else(|| "dph-filter".into());
            let started = Instant::now();
            raw_ns.run(
                "nft",
                &[
                    "add",
                    "element",
                    "ip",
                    &table,
                    &set,
                    &format!("{{ {member} }}"),
                ],
            )?;
            started.elapsed()
        } else {
            let started = Instant::now();
            raw_ns.run("ipset", &["add", "dph40s:set-0", &member])?;
            started.elapsed()
        };
        raw_member.push(took.as_secs_f64() * 1000.0);
        ours_member.push(add_member(&mut feed, member).await?);
        eprintln!(
            "{dataplane}: policy change {}: ours {:.1} ms, raw {:.1} ms; member: ours {:.2} ms, raw {:.2} ms",
            i + 1,
            ours_change[i],
            raw_change[i],
            ours_member[i],
            raw_member[i]
        );
    }
    drop(raw_ns);
    for i in 0..a.member_adds {
        tokio::time::sleep(Duration::from_millis(20)).await;
        ours_member.push(add_member(&mut feed, ip(0x70_0000 + i)).await?);
    }
    r.change = median(ours_change);
    r.raw_change = median(raw_change);
    r.member = median(ours_member);
    r.raw_member = median(raw_member);

    // 5. The packet path, on a quiet server.
    r.rr = dphandler_tests::traffic::request_response(
        &w1,
        format!("{}:{RR_PORT}", RR[1].1).parse()?,
        a.rr_seconds,
    )?;

    // 3. Churn at a steady rate, once the last change's re-read is over.
    tokio::time::sleep(Duration::from_secs(a.settle_seconds)).await;
    let h0 = client
        .get_status(dphandler_proto::v1::GetStatusRequest {})
        .await?
        .into_inner()
        .apply_histogram;
    let (_, cpu0) = usage(daemon.pid())?;
    r.churn.next_new = a.endpoints;
    r.churn.oldest_new = a.endpoints;
    churn(a, &mut feed, &mut r.churn, a.churn_seconds, 0).await?;
    let (_, cpu1) = usage(daemon.pid())?;
    r.cpu = (cpu1 - cpu0) / r.churn.wall;
    let st = client
        .get_status(dphandler_proto::v1::GetStatusRequest {})
        .await?
        .into_inner();
    let hist: Vec<(f64, u64)> = st
        .apply_histogram
        .iter()
        .zip(&h0)
        .map(|(b, b0)| (b.le_ms, b.count - b0.count))
        .collect();
    r.n_applies = hist.last().map_or(0, |b| b.1);
    r.apply_p50 = hist_bound(&hist, 0.5);
    r.apply_p99 = hist_bound(&hist, 0.99);

    // The kernel's side: a second churn pass under perf, and (nftables)
    // the daemon's commit counts and times over it.
    let m0 = dphandler_tests::lab::scrape(&ns, 9191).unwrap_or_default();
    let perf = Perf::start(dir.path(), dataplane);
    let mut traced = Churn {
        next_new: r.churn.next_new,
        oldest_new: r.churn.oldest_new,
        ..Default::default()
    };
    let salt = (a.churn_rate * a.churn_seconds) as usize;
    churn(a, &mut feed, &mut traced, a.trace_seconds, salt).await?;
    r.perf = perf.and_then(Perf::finish);
    if nft {
        let m1 = dphandler_tests::lab::scrape(&ns, 9191)?;
        let d = |k: &str| m1.get(k).copied().unwrap_or(0.0) - m0.get(k).copied().unwrap_or(0.0);
        let v = "{ip_version=\"4\"}";
        r.commits = Some((
            d(&format!("dphandler_nftables_commits_total{v}")),
            d(&format!("dphandler_nftables_validating_commits_total{v}")),
            scraped_bound(&m0, &m1, "dphandler_nftables_commit_seconds", 0.5),
            scraped_bound(&m0, &m1, "dphandler_nftables_commit_seconds", 0.99),
        ));
    }
    r.rss_peak = usage(daemon.pid())?.0;
    drop(feed);
    daemon.stop()?;
    r.churn.lat.sort_by(f64::total_cmp);
    Ok(r)
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    if !nix::unistd::Uid::effective().is_root() {
        bail!("the benchmark runs the server in network namespaces: run it as root");
    }
    if a.sets == 0 || a.policies == 0 || a.endpoints == 0 || a.changes == 0 {
        bail!("--sets, --policies, --endpoints and --changes must be at least 1");
    }
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut reports = Vec::new();
    for d in &a.dataplanes {
        if !["iptables", "nftables"].contains(&d.as_str()) {
            bail!("--dataplanes: {d:?} is neither iptables nor nftables");
        }
        reports.push((d.clone(), run_one(&a, d).await?));
    }

    println!(
        "policy: {} endpoints (+2 real ones), {} policies x {} rules, {} profiles, {} IP sets with {} members; IPv4; {cores} cores",
        a.endpoints, a.policies, a.rules_per_policy, NAMESPACES, a.sets, a.members
    );
    for (d, r) in &reports {
        println!("{d}: programmed {}", r.programmed);
    }
    println!();
    let names: Vec<&str> = reports.iter().map(|(d, _)| d.as_str()).collect();
    println!("| case | {} | target (nftables) |", names.join(" | "));
    println!("|---|{}---|", "---|".repeat(names.len()));
    let row = |case: &str, cell: &dyn Fn(&Report) -> String, target: &str| {
        let cells: Vec<String> = reports.iter().map(|(_, r)| cell(r)).collect();
        println!("| {case} | {} | {target} |", cells.join(" | "));
    };
    let iptables_cold = reports
        .iter()
        .find(|(d, _)| d == "iptables")
        .map(|(_, r)| r.cold);
    row(
        "cold start, first message to InSync programmed",
        &|r| {
            let vs =
                iptables_cold.map_or(String::new(), |c| format!("; {:.2}x iptables", r.cold / c));
            format!(
                "{:.0} ms ({:.2}x raw: {:.0} ms, {}){vs}",
                r.cold,
                r.cold / r.raw_cold,
                r.raw_cold,
                r.raw_cold_how
            )
        },
        "<= 1.0x iptables",
    );
    row(
        &format!(
            "one policy changed, until programmed (median of {})",
            a.changes
        ),
        &|r| {
            format!(
                "{:.1} ms (raw one-chain rewrite {:.1} ms)",
                r.change, r.raw_change
            )
        },
        "<= 20 ms",
    );
    row(
        &format!(
            "one IP-set member added, until programmed (median of {}; raw: of {})",
            a.changes + a.member_adds,
            a.changes
        ),
        &|r| {
            format!(
                "{:.2} ms (raw one-element add {:.2} ms)",
                r.member, r.raw_member
            )
        },
        "<= 2 ms",
    );
    row(
        &format!(
            "churn {}/s for {} s: sent → programmed, p50 / p99 / max",
            a.churn_rate, a.churn_seconds
        ),
        &|r| {
            let l = &r.churn.lat;
            format!(
                "{:.1} / {:.1} / {:.1} ms",
                percentile(l, 0.5),
                percentile(l, 0.99),
                l.last().copied().unwrap_or(0.0)
            )
        },
        "p99 <= 100 ms",
    );
    row(
        "churn: the server's apply time, p50 / p99 (histogram bounds)",
        &|r| {
            format!(
                "<= {} / <= {} ms ({} applies)",
                r.apply_p50, r.apply_p99, r.n_applies
            )
        },
        "p99 <= 50 ms",
    );
    row(
        "churn: server CPU",
        &|r| format!("{:.2} cores", r.cpu),
        "<= 0.3 core",
    );
    row(
        &format!(
            "kernel, traced churn ({} s): commits, validating, commit time p50 / p99",
            a.trace_seconds
        ),
        &|r| match r.commits {
            Some((n, v, p50, p99)) => format!(
                "{n:.0} commits, {v:.0} validating ({:.0}%), <= {p50:.2} / <= {p99:.2} ms",
                100.0 * v / n.max(1.0)
            ),
            None => "(iptables-restore: every write replaces rules)".into(),
        },
        "reported",
    );
    row(
        "kernel, traced churn: share of busy CPU in nf_tables_commit / in the validation walk (perf)",
        &|r| match r.perf {
            Some((c, v)) => format!("{c:.1}% / {v:.1}%"),
            None => "perf unavailable".into(),
        },
        "reported",
    );
    row(
        &format!(
            "packet path: TCP request/response between two workloads ({} s)",
            a.rr_seconds
        ),
        &|r| format!("{:.0} transactions/s", r.rr),
        "reported",
    );
    row(
        "peak RSS (after cold start / at the end)",
        &|r| {
            format!(
                "{:.0} / {:.0} MiB",
                r.rss_cold as f64 / 1024.0,
                r.rss_peak as f64 / 1024.0
            )
        },
        "reported",
    );
    println!();
    for (d, r) in &reports {
        let mix: Vec<String> = r
            .churn
            .kinds
            .iter()
            .map(|(k, n)| format!("{n} {k}"))
            .collect();
        println!("{d} churn mix: {}", mix.join(", "));
    }
    Ok(())
}
