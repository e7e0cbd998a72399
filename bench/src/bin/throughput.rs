//! Throughput of the API path with no kernel work: messages per second that
//! the real `dphandler serve` decodes, validates and dispatches into the sync
//! loop, fed over its unix socket by a tonic client, for a realistic mix of
//! calc-graph messages; and the server's peak RSS and CPU time.
//!
//! Each run starts a fresh server in a network namespace of its own, sends
//! the mix followed by InSync on one ToDataplane stream, and stops the clock
//! when the server reports the last sequence number programmed (so the time
//! includes the apply and the snapshot's sweep). Needs root (for the
//! namespace). Prints a markdown table.
//!
//! ```sh
//! cargo build --release --workspace --bins
//! ./target/release/throughput --messages 1000000 --runs 3
//! ```

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Parser;
use dphandler_proto::felix::{self, to_dataplane::Payload};
use dphandler_proto::v1::{self, to_dataplane_reply::Kind};
use dphandler_tests::{Daemon, Netns, usage};

#[derive(Parser, Debug)]
#[command(about = "Messages/s through gRPC into the sync loop, with no kernel work")]
struct Args {
    /// Messages per run (plus the initial IP sets and the final InSync).
    #[arg(long, env = "DPH_BENCH_MESSAGES", default_value_t = 1_000_000)]
    messages: usize,
    /// Runs, each against a fresh server.
    #[arg(long, env = "DPH_BENCH_RUNS", default_value_t = 3)]
    runs: usize,
}

/// IP sets created up front, so that deltas have a target.
const SETS: usize = 1000;

fn ip(i: usize) -> String {
    format!("10.{}.{}.{}", (i >> 16) & 0xff, (i >> 8) & 0xff, i & 0xff)
}

fn rule(i: usize) -> felix::Rule {
    felix::Rule {
        action: "allow".into(),
        protocol: Some(felix::Protocol {
            number_or_name: Some(felix::protocol::NumberOrName::Name("tcp".into())),
        }),
        src_ip_set_ids: vec![format!("s:set-{}", i % SETS)],
        dst_ports: vec![felix::PortRange {
            first: 8000 + (i % 100) as i32,
            last: 8000 + (i % 100) as i32,
        }],
        dst_net: vec![format!("10.{}.0.0/16", i % 200)],
        rule_id: format!("r{i:x}"),
        ..Default::default()
    }
}

fn policy_id(i: usize) -> felix::PolicyId {
    felix::PolicyId {
        name: format!("ns{}.policy-{}", i % 50, i % 5000),
        namespace: format!("ns{}", i % 50),
        kind: "NetworkPolicy".into(),
        ..Default::default()
    }
}

/// The i-th message of the mix. Per 100: 35 IP-set deltas, 10 full IP-set
/// updates, 20 workload endpoints, 10 policies (4 rules), 5 profiles, 15
/// routes, 5 removes: roughly what a calc graph sends while pods churn.
fn mixed(i: usize) -> Payload {
    match i % 100 {
        0..35 => Payload::IpsetDeltaUpdate(felix::IpSetDeltaUpdate {
            id: format!("s:set-{}", i % SETS),
            added_members: vec![ip(i), ip(i + 1)],
            removed_members: vec![ip(i.wrapping_sub(7))],
        }),
        35..45 => Payload::IpsetUpdate(felix::IpSetUpdate {
            id: format!("s:set-{}", i % SETS),
            members: (0..20).map(|k| ip(i * 20 + k)).collect(),
            r#type: felix::ip_set_update::IpSetType::Ip as i32,
        }),
        45..65 => {
            let w = i % 10_000;
            Payload::WorkloadEndpointUpdate(felix::WorkloadEndpointUpdate {
                id: Some(felix::WorkloadEndpointId {
                    orchestrator_id: "k8s".into(),
                    workload_id: format!("ns{}/pod-{w}", w % 50),
                    endpoint_id: "eth0".into(),
                }),
                endpoint: Some(felix::WorkloadEndpoint {
                    state: "active".into(),
                    name: format!("cali{w:011x}"),
                    mac: format!(
                        "ee:ee:ee:{:02x}:{:02x}:{:02x}",
                        w >> 16 & 0xff,
                        w >> 8 & 0xff,
                        w & 0xff
                    ),
                    profile_ids: vec![format!("kns.ns{}", w % 50)],
                    ipv4_nets: vec![format!("{}/32", ip(w))],
                    tiers: vec![felix::TierInfo {
                        name: "default".into(),
                        ingress_policies: vec![policy_id(i)],
                        egress_policies: vec![policy_id(i + 1)],
                        default_action: "deny".into(),
                    }],
                    ..Default::default()
                }),
            })
        }
        65..75 => Payload::ActivePolicyUpdate(felix::ActivePolicyUpdate {
            id: Some(policy_id(i)),
            policy: Some(felix::Policy {
                namespace: format!("ns{}", i % 50),
                tier: "default".into(),
                inbound_rules: (0..3).map(|k| rule(i + k)).collect(),
                outbound_rules: vec![rule(i + 3)],
                ..Default::default()
            }),
        }),
        75..80 => Payload::ActiveProfileUpdate(felix::ActiveProfileUpdate {
            id: Some(felix::ProfileId {
                name: format!("kns.ns{}", i % 50),
            }),
            profile: Some(felix::Profile {
                inbound_rules: vec![rule(i)],
                outbound_rules: vec![felix::Rule {
                    action: "allow".into(),
                    ..Default::default()
                }],
            }),
        }),
        80..95 => Payload::RouteUpdate(felix::RouteUpdate {
            types: felix::RouteType::RemoteWorkload as i32,
            dst: format!("10.{}.{}.0/26", 100 + (i >> 8) % 100, i & 0xff),
            dst_node_name: format!("node-{}", i % 500),
            dst_node_ip: format!("192.0.2.{}", 1 + i % 250),
            ..Default::default()
        }),
        _ => Payload::RouteRemove(felix::RouteRemove {
            dst: format!("10.{}.{}.0/26", 100 + (i >> 8) % 100, (i + 1) & 0xff),
        }),
    }
}

fn messages(n: usize) -> Vec<felix::ToDataplane> {
    let mut out = Vec::with_capacity(SETS + n + 1);
    let mut seq = 0;
    let mut push = |p| {
        seq += 1;
        out.push(felix::ToDataplane {
            sequence_number: seq,
            payload: Some(p),
        });
    };
    for s in 0..SETS {
        push(Payload::IpsetUpdate(felix::IpSetUpdate {
            id: format!("s:set-{s}"),
            members: (0..10).map(|k| ip(s * 10 + k)).collect(),
            r#type: felix::ip_set_update::IpSetType::Ip as i32,
        }));
    }
    for i in 0..n {
        push(mixed(i));
    }
    push(Payload::InSync(felix::InSync {}));
    out
}

struct Run {
    messages: usize,
    seconds: f64,
    rejected: u64,
    rss_kib: u64,
    cpu: f64,
}

async fn run_once(n: usize) -> Result<Run> {
    let msgs = messages(n);
    let total = msgs.len();
    let last = msgs.last().map(|m| m.sequence_number).unwrap_or(0);
    let dir = dphandler_tests::tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("bench")?;
    // Default settings, logs off the hot path, and --dry-run: the API path
    // only, no kernel work (the IP-set and iptables benchmarks measure that).
    let daemon = Daemon::start(&ns, &socket, &["--log", "warn", "--dry-run"])?;
    let mut client = daemon.connect().await?;
    let started = Instant::now();
    let mut replies = client
        .to_dataplane(futures::stream::iter(msgs))
        .await?
        .into_inner();
    let mut rejected = 0;
    let mut programmed = 0;
    while let Some(r) = tokio::time::timeout(Duration::from_secs(600), replies.message()).await?? {
        match r.kind {
            Some(Kind::Programmed(p)) => programmed = p.sequence_number,
            Some(Kind::Received(r)) => rejected = r.rejected,
            Some(Kind::Rejected(r)) => {
                if rejected == 0 {
                    eprintln!("rejected: {} {}: {}", r.sequence_number, r.field, r.reason);
                }
                rejected += 1;
            }
            None => {}
        }
        if programmed >= last {
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    if programmed < last {
        bail!("the stream ended at sequence {programmed} of {last}");
    }
    let st = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    if !st.in_sync {
        bail!("not in sync after the run: {st:?}");
    }
    let (rss_kib, cpu) = usage(daemon.pid())?;
    daemon.stop()?;
    Ok(Run {
        messages: total,
        seconds,
        rejected,
        rss_kib,
        cpu,
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if !nix::unistd::Uid::effective().is_root() {
        bail!("the benchmark runs the server in a network namespace: run it as root");
    }
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "throughput: {} mixed messages (+{SETS} IP sets, +InSync) per run, {cores} cores, \
         server and client on the same machine",
        args.messages
    );
    println!();
    println!(
        "| run | messages | seconds | messages/s | rejected | server CPU s | server peak RSS |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut rates = Vec::new();
    for i in 1..=args.runs {
        let r = run_once(args.messages).await?;
        let rate = r.messages as f64 / r.seconds;
        rates.push(rate);
        println!(
            "| {i} | {} | {:.3} | {:.0} | {} | {:.2} | {:.1} MiB |",
            r.messages,
            r.seconds,
            rate,
            r.rejected,
            r.cpu,
            r.rss_kib as f64 / 1024.0
        );
    }
    rates.sort_by(f64::total_cmp);
    if let Some(median) = rates.get(rates.len() / 2) {
        println!();
        println!("median: {median:.0} messages/s (target: at least 200000)");
    }
    Ok(())
}
