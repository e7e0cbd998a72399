//! Soak: the real server in a namespace of its own under a steady stream of
//! changes for a long time (default 10 minutes at 100 updates/s), with
//! status watchers connecting and disconnecting all along. Prints, per
//! interval and at the end, the server's RSS, open fds and threads and our rules
//! in the kernel's filter table (they
//! should be flat), the changes' latency (sent → programmed), the server's
//! own apply times, and every error (failed applies, rejections, watcher
//! failures). Needs root. The dataplane is the daemon's default, or
//! `DPH_DATAPLANE`.
//!
//! ```sh
//! cargo build --release --workspace --bins
//! ./target/release/soak --minutes 10
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use dphandler_proto::felix::{self, to_dataplane::Payload};
use dphandler_proto::v1;
use dphandler_tests::kernel::our_rule_count;
use dphandler_tests::{Daemon, Feed, Netns, tempdir};

#[derive(Parser, Debug)]
#[command(
    about = "Hours-long behaviour in minutes: RSS, fds, threads and latency under steady churn"
)]
struct Args {
    /// How long the churn runs.
    #[arg(long, env = "DPH_BENCH_MINUTES", default_value_t = 10.0)]
    minutes: f64,
    /// Changes per second.
    #[arg(long, env = "DPH_BENCH_RATE", default_value_t = 100)]
    rate: u32,
    /// Workload endpoints in the snapshot.
    #[arg(long, env = "DPH_BENCH_ENDPOINTS", default_value_t = 500)]
    endpoints: usize,
    /// Policies in the snapshot.
    #[arg(long, env = "DPH_BENCH_POLICIES", default_value_t = 200)]
    policies: usize,
    /// IP sets in the snapshot, 100 members each.
    #[arg(long, env = "DPH_BENCH_SETS", default_value_t = 100)]
    sets: usize,
    /// A status watcher connects this often and stays 0.5-3 s.
    #[arg(long, env = "DPH_BENCH_WATCHER_PERIOD_SECONDS", default_value_t = 1.0)]
    watcher_period_seconds: f64,
    /// Seconds per row of the table.
    #[arg(long, env = "DPH_BENCH_REPORT_SECONDS", default_value_t = 60.0)]
    report_seconds: f64,
}

fn ip(i: usize) -> String {
    format!("10.{}.{}.{}", (i >> 16) & 0xff, (i >> 8) & 0xff, i & 0xff)
}

fn set_id(k: usize) -> String {
    format!("s:soak-{k}")
}

fn policy_id(p: usize) -> felix::PolicyId {
    felix::PolicyId {
        name: format!("default.soak-{p}"),
        ..Default::default()
    }
}

fn policy(a: &Args, p: usize, salt: usize) -> Payload {
    let rule = |k: usize| felix::Rule {
        action: "allow".into(),
        protocol: Some(felix::Protocol {
            number_or_name: Some(felix::protocol::NumberOrName::Name("tcp".into())),
        }),
        src_ip_set_ids: vec![set_id((p + k) % a.sets)],
        dst_ports: vec![felix::PortRange {
            first: (1000 + (salt + k) % 5000) as i32,
            last: (1000 + (salt + k) % 5000) as i32,
        }],
        ..Default::default()
    };
    Payload::ActivePolicyUpdate(felix::ActivePolicyUpdate {
        id: Some(policy_id(p)),
        policy: Some(felix::Policy {
            tier: "default".into(),
            inbound_rules: (0..4).map(rule).collect(),
            outbound_rules: vec![rule(4)],
            ..Default::default()
        }),
    })
}

fn workload_id(w: usize) -> felix::WorkloadEndpointId {
    felix::WorkloadEndpointId {
        orchestrator_id: "k8s".into(),
        workload_id: format!("soak/pod-{w}"),
        endpoint_id: "eth0".into(),
    }
}

fn endpoint(a: &Args, w: usize, salt: usize) -> Payload {
    Payload::WorkloadEndpointUpdate(felix::WorkloadEndpointUpdate {
        id: Some(workload_id(w)),
        endpoint: Some(felix::WorkloadEndpoint {
            state: "active".into(),
            name: format!("cali{w:011x}"),
            ipv4_nets: vec![format!("{}/32", ip(0x41_0000 + w))],
            tiers: vec![felix::TierInfo {
                name: "default".into(),
                ingress_policies: vec![policy_id((w + salt) % a.policies)],
                egress_policies: vec![policy_id((w + salt + 1) % a.policies)],
                default_action: "Deny".into(),
            }],
            ..Default::default()
        }),
    })
}

/// The i-th change: per 10, 5 IP-set deltas (a member in, one out), 2
/// endpoints changed, 1 endpoint added and (from the 21st add on) 1 of the
/// oldest added removed, 1 policy changed.
fn change(a: &Args, i: usize, added: &mut (usize, usize)) -> Payload {
    match i % 10 {
        0..5 => {
            let k = (i * 31) % a.sets;
            Payload::IpsetDeltaUpdate(felix::IpSetDeltaUpdate {
                id: set_id(k),
                added_members: vec![ip(0x20_0000 + i)],
                removed_members: vec![ip(0x20_0000 + i.saturating_sub(500))],
            })
        }
        5 | 6 => endpoint(a, (i * 13) % a.endpoints, i),
        7 => {
            added.0 += 1;
            endpoint(a, a.endpoints + added.0, i)
        }
        8 if added.0 - added.1 > 20 => {
            added.1 += 1;
            Payload::WorkloadEndpointRemove(felix::WorkloadEndpointRemove {
                id: Some(workload_id(a.endpoints + added.1)),
            })
        }
        _ => policy(a, (i * 17) % a.policies, i),
    }
}

/// (RSS MiB, open fds, threads) of a process.
fn sample(pid: u32) -> Result<(f64, usize, usize)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("{name} in /proc/{pid}/status"))
    };
    let rss = field("VmRSS:")? as f64 / 1024.0;
    let threads = field("Threads:")? as usize;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count();
    Ok((rss, fds, threads))
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Watchers: one connects every `period`, reads its stream for 0.5-3 s
/// and goes. Counts connections and failures.
fn watchers(
    mut client: dphandler_proto::v1::dataplane_client::DataplaneClient<tonic::transport::Channel>,
    period: Duration,
    stop: Arc<AtomicU64>,
    connects: Arc<AtomicU64>,
    failures: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut n = 0u64;
        while stop.load(Ordering::Relaxed) == 0 {
            n += 1;
            let stay = Duration::from_millis(500 + (n * 7919) % 2500);
            let mut c = client.clone();
            let (connected, failed) = (connects.clone(), failures.clone());
            tokio::spawn(async move {
                connected.fetch_add(1, Ordering::Relaxed);
                match c.status_updates(v1::StatusUpdatesRequest {}).await {
                    Ok(s) => {
                        let mut s = s.into_inner();
                        let until = tokio::time::sleep(stay);
                        tokio::pin!(until);
                        loop {
                            tokio::select! {
                                () = &mut until => break,
                                m = s.message() => match m {
                                    Ok(Some(_)) => {}
                                    Ok(None) => break,
                                    Err(_) => { failed.fetch_add(1, Ordering::Relaxed); break; }
                                }
                            }
                        }
                    }
                    Err(_) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
            if client.get_status(v1::GetStatusRequest {}).await.is_err() {
                failures.fetch_add(1, Ordering::Relaxed);
            }
            tokio::time::sleep(period).await;
        }
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    // (Shared with the rule counter's thread; removed when the last goes.)
    let ns = Arc::new(Netns::new("soak")?);
    // Watchers and status calls are many: the call limit is not under test.
    let d = Daemon::start(
        &ns,
        &socket,
        &[
            "--rate-limit-per-second",
            "1000",
            "--rate-limit-burst",
            "1000",
        ],
    )?;
    let mut client = d.connect().await?;
    let pid = d.pid();
    let dataplane = std::env::var("DPH_DATAPLANE").unwrap_or_else(|_| "auto".into());

    // The snapshot.
    let mut feed = Feed::open(&mut client).await?;
    for k in 0..a.sets {
        feed.send(Payload::IpsetUpdate(felix::IpSetUpdate {
            id: set_id(k),
            members: (0..100).map(|m| ip(k * 100 + m)).collect(),
            r#type: felix::ip_set_update::IpSetType::Ip as i32,
        }))?;
    }
    for p in 0..a.policies {
        feed.send(policy(&a, p, 0))?;
    }
    for w in 0..a.endpoints {
        feed.send(endpoint(&a, w, 0))?;
    }
    let last = feed.send(Payload::InSync(felix::InSync {}))?;
    feed.until(last, Duration::from_secs(120)).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let stop = Arc::new(AtomicU64::new(0));
    let (connects, failures) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let w = watchers(
        client.clone(),
        Duration::from_secs_f64(a.watcher_period_seconds),
        stop.clone(),
        connects.clone(),
        failures.clone(),
    );

    let start = sample(pid)?;
    let status0 = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    println!(
        "soak: {} minutes at {}/s, dataplane {dataplane}; {} endpoints, {} policies, {} IP sets; a watcher every {} s",
        a.minutes, a.rate, a.endpoints, a.policies, a.sets, a.watcher_period_seconds
    );
    println!();
    println!(
        "| minute | RSS MiB | fds | threads | our rules in filter | changes | latency p50 / p99 / max ms | applies | failed applies | watchers (failed) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    // Our rules in the kernel: a leak of chains or rules would grow here
    // (and slow every apply down). Counted on a thread of its own, so
    // that listing the tables (hundreds of ms with nft) never holds up
    // this loop's sends and receives; a row shows the latest count.
    let rules0 = our_rule_count(&ns, false, "filter")?;
    let latest_rules = Arc::new(AtomicU64::new(rules0 as u64));
    let counter = {
        let (latest, stop, ns) = (latest_rules.clone(), stop.clone(), ns.clone());
        let every = Duration::from_secs_f64(a.report_seconds / 2.0);
        std::thread::spawn(move || {
            while stop.load(Ordering::Relaxed) == 0 {
                // A listing that a commit interrupts fails (nft): tried
                // again a few times, else "unknown" (never a stale count).
                let n = (0..5)
                    .find_map(|_| our_rule_count(&ns, false, "filter").ok())
                    .map_or(u64::MAX, |n| n as u64);
                latest.store(n, Ordering::Relaxed);
                std::thread::sleep(every);
            }
        })
    };
    let rules = || match latest_rules.load(Ordering::Relaxed) {
        u64::MAX => "–".to_string(),
        n => n.to_string(),
    };
    println!(
        "| 0 | {:.1} | {} | {} | {rules0} | 0 | | {} | {} | 0 (0) |",
        start.0, start.1, start.2, status0.applies, status0.failed_applies
    );

    let total = (f64::from(a.rate) * a.minutes * 60.0) as usize;
    let interval = Duration::from_secs_f64(1.0 / f64::from(a.rate));
    let report = Duration::from_secs_f64(a.report_seconds);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut sent: BTreeMap<u64, Instant> = BTreeMap::new();
    let (mut lat_all, mut lat_row) = (Vec::new(), Vec::new());
    let mut added = (0usize, 0usize);
    let started = Instant::now();
    let mut next_report = started + report;
    let mut i = 0usize;
    let mut rows = 0u32;
    let mut row_changes = 0usize;
    while i < total || !sent.is_empty() {
        tokio::select! {
            _ = tick.tick(), if i < total => {
                let seq = feed.send(change(&a, i, &mut added))?;
                sent.insert(seq, Instant::now());
                i += 1;
                row_changes += 1;
            }
            r = feed.next_programmed(Duration::from_secs(60)) => {
                let (s, at) = r?;
                let done: Vec<u64> = sent.range(..=s).map(|(k, _)| *k).collect();
                for k in done {
                    let t = sent.remove(&k).expect("present");
                    let ms = (at - t).as_secs_f64() * 1000.0;
                    lat_row.push(ms);
                    lat_all.push(ms);
                }
            }
        }
        if Instant::now() >= next_report {
            rows += 1;
            next_report += report;
            let s = sample(pid)?;
            let st = client
                .get_status(v1::GetStatusRequest {})
                .await?
                .into_inner();
            lat_row.sort_by(f64::total_cmp);
            println!(
                "| {:.1} | {:.1} | {} | {} | {} | {} | {:.1} / {:.1} / {:.1} | {} | {} | {} ({}) |",
                f64::from(rows) * a.report_seconds / 60.0,
                s.0,
                s.1,
                s.2,
                rules(),
                row_changes,
                pct(&lat_row, 0.5),
                pct(&lat_row, 0.99),
                lat_row.last().copied().unwrap_or(f64::NAN),
                st.applies - status0.applies,
                st.failed_applies - status0.failed_applies,
                connects.load(Ordering::Relaxed),
                failures.load(Ordering::Relaxed),
            );
            lat_row.clear();
            row_changes = 0;
        }
    }
    stop.store(1, Ordering::Relaxed);
    w.await?;
    let _ = counter.join();
    // Watchers still open end within 3 s.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let end = sample(pid)?;
    let st = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    lat_all.sort_by(f64::total_cmp);
    println!();
    println!("| | start | end |");
    println!("|---|---|---|");
    println!("| RSS | {:.1} MiB | {:.1} MiB |", start.0, end.0);
    println!("| open fds | {} | {} |", start.1, end.1);
    println!("| threads | {} | {} |", start.2, end.2);
    println!(
        "| our rules in filter | {rules0} | {} |",
        our_rule_count(&ns, false, "filter")?
    );
    println!();
    println!(
        "changes: {} sent, all programmed; latency p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        total,
        pct(&lat_all, 0.5),
        pct(&lat_all, 0.99),
        lat_all.last().copied().unwrap_or(f64::NAN)
    );
    println!(
        "server: {} applies, apply p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (its own histogram, whole run); failed applies {}; last error {:?}",
        st.applies - status0.applies,
        st.apply_p50_ms,
        st.apply_p99_ms,
        st.apply_max_ms,
        st.failed_applies - status0.failed_applies,
        st.last_error
    );
    println!(
        "watchers: {} connected, {} failed; rejections: 0 (a rejection ends the run)",
        connects.load(Ordering::Relaxed),
        failures.load(Ordering::Relaxed)
    );
    drop(d);
    Ok(())
}
