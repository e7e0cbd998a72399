//! Felix's own dataplane as the oracle: the same seeded scenarios
//! (`dphandler_tests::differential`), written with calicoctl into etcd,
//! programmed in turn by
//!
//! - (a) Felix with its internal dataplane in iptables mode,
//! - (b) Felix's internal dataplane in nftables mode,
//! - (c) Felix → dphandler, our iptables dataplane,
//! - (d) Felix → dphandler, our nftables dataplane,
//!
//! each on a node of its own (a fresh namespace, its workloads and etcd),
//! and probed alike (TCP, UDP and ping between every pair of workloads,
//! from the node, and through the node's host endpoint from an outside
//! network). Felix's iptables verdicts are the expected ones: a probe
//! where (c) or (d) differs is our bug until shown otherwise; one where (b)
//! differs is Felix disagreeing with itself, reported apart.
//!
//! `DPH_DIFF_SEEDS`: a count (seeds 1..=N) or a comma-separated list; by
//! default [`CI_SEEDS`] and [`REGRESSIONS`]. `DPH_DIFF_MODES`: which modes
//! (`abcd`, the default; the first is the oracle). Skipped, saying so, where
//! there is no Go toolchain. Needs root.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dphandler_tests::calico::{self, Calico, Mode, Proc};
use dphandler_tests::differential::{
    self, MARKER, MARKER_PORTS, NODE_TCP, NODE_UDP, NODE_UPLINK, NODE_V4, NODE_V6, OUTSIDE,
    OUTSIDE_TCP, Place, ProbeCase, TCP_PORTS, UDP_PORTS, UPLINK, WORKLOADS,
};
use dphandler_tests::lab;
use dphandler_tests::{Daemon, Netns, tempdir};

/// The seeds CI runs.
const CI_SEEDS: [u64; 6] = [1, 2, 3, 4, 5, 6];

/// Seeds that once found a difference (kept as regression cases; each
/// names what it found). Among [`CI_SEEDS`], seeds 1, 5 and 6 are ones
/// Felix's own nftables mode cannot program (`icmp type 8 code 0`: `nft`
/// refuses its syntax, felix/nftables/match_builder.go), and seed 3 one
/// where its nftables mode lets through what its iptables mode drops (a
/// pre-DNAT Allow on the host endpoint): both reported, not compared.
const REGRESSIONS: [(u64, &str); 6] = [
    (
        8,
        "negated nets of the other family: the rule is not in this family",
    ),
    (11, "the same"),
    (50, "the same"),
    (51, "the same: an IPv4 UDP probe Felix allowed, we denied"),
    (66, "the same"),
    (177, "the same"),
];

fn seeds() -> Result<Vec<u64>> {
    let Ok(v) = std::env::var("DPH_DIFF_SEEDS") else {
        let mut s: Vec<u64> = CI_SEEDS.to_vec();
        s.extend(REGRESSIONS.iter().map(|(seed, _)| *seed));
        return Ok(s);
    };
    if let Ok(n) = v.parse::<u64>() {
        return Ok((1..=n).collect());
    }
    v.split(',')
        .map(|s| {
            s.trim()
                .parse()
                .context("DPH_DIFF_SEEDS: a count or a list of seeds")
        })
        .collect()
}

fn modes() -> Result<Vec<Mode>> {
    let v = std::env::var("DPH_DIFF_MODES").unwrap_or_else(|_| "abcd".into());
    Mode::parse_list(&v).context("DPH_DIFF_MODES")
}

/// One mode's verdicts: per scenario, per probe of [`differential::probes`];
/// or why there are none (Felix could not program the scenario).
struct Run {
    mode: Mode,
    verdicts: Vec<Result<Vec<bool>, String>>,
    took: Duration,
}

/// The node: its namespace, the workloads' namespaces and their servers.
struct Node {
    host: Netns,
    outside: Netns,
    workloads: Vec<Netns>,
    marker: [Netns; 2],
    _servers: Vec<lab::Servers>,
}

fn node() -> Result<Node> {
    let host = Netns::new("dif")?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    host.run(
        "ip",
        &["addr", "add", &format!("{NODE_V4}/24"), "dev", "lo"],
    )?;
    host.run(
        "ip",
        &["-6", "addr", "add", &format!("{NODE_V6}/128"), "dev", "lo"],
    )?;
    let outside = Netns::new("difo")?;
    lab::uplink(
        &host,
        &outside,
        UPLINK,
        &format!("{NODE_UPLINK}/24"),
        &format!("{OUTSIDE}/24"),
    )?;
    // The outside reaches the pods through the node, as a router would.
    outside.run("ip", &["route", "add", "10.65.0.0/16", "via", NODE_UPLINK])?;
    let mut servers = vec![
        lab::serve(&host.0, &NODE_TCP, &NODE_UDP),
        lab::serve(&outside.0, &OUTSIDE_TCP, &[]),
    ];
    let mut workloads = Vec::new();
    for (_, _, iface, n, v4, v6) in WORKLOADS {
        let w = lab::workload_dual(&host, iface, n, v4, v6)?;
        servers.push(lab::serve(&w.0, &TCP_PORTS, &UDP_PORTS));
        workloads.push(w);
    }
    let marker = |(_, iface, n, v4, v6): (&str, &str, u8, &str, &str)| {
        lab::workload_dual(&host, iface, n, v4, v6)
    };
    let m_src = marker(MARKER[0])?;
    let m_dst = marker(MARKER[1])?;
    servers.push(lab::serve(&m_dst.0, &MARKER_PORTS, &[]));
    Ok(Node {
        host,
        outside,
        workloads,
        marker: [m_src, m_dst],
        _servers: servers,
    })
}

/// Whether the marker of scenario `k` holds over both families: its port
/// open, the other closed.
fn marker_holds(n: &Node, k: usize) -> bool {
    [MARKER[1].3, MARKER[1].4].iter().all(|ip| {
        let port = |p: u16| {
            let ip: std::net::IpAddr = ip.parse().expect("the marker's address");
            lab::tcp_ok(
                &n.marker[0],
                std::net::SocketAddr::new(ip, p),
                Duration::from_millis(60),
            )
        };
        port(MARKER_PORTS[k % 2]) && !port(MARKER_PORTS[(k + 1) % 2])
    })
}

/// Every probe at once (each is a flow of its own; a dropped one waits
/// 0.4 s). IPv6 neighbours are resolved by NDP as on a Calico node.
fn probe_all(n: &Node, cases: &[ProbeCase]) -> Vec<bool> {
    std::thread::scope(|s| {
        let handles: Vec<_> = cases
            .iter()
            .map(|c| {
                let from = match c.from {
                    Place::Workload(i) => &n.workloads[i],
                    Place::Node => &n.host,
                    Place::Outside => &n.outside,
                };
                s.spawn(move || lab::probe(from, c.target(), c.probe))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a probe thread"))
            .collect()
    })
}

/// Why Felix's own dataplane gave up (it panics when the kernel refuses
/// what it wrote, and calico-node restarts it), from its log; `None` if it
/// did not.
fn gave_up(felix: &Proc) -> Option<String> {
    let log = std::fs::read_to_string(&felix.log).ok()?;
    // The panic's line, and the kernel tool's own words on the lines after.
    let why: Vec<&str> = log
        .lines()
        .skip_while(|l| !l.contains("[PANIC]"))
        .take(3)
        .collect();
    (!why.is_empty()).then(|| why.join(" | "))
}

fn run_mode(c: &Calico, mode: Mode, seeds: &[u64], cases: &[ProbeCase]) -> Result<Run> {
    let started = Instant::now();
    let dir = tempdir()?;
    let n = node()?;
    let _etcd = calico::etcd(c, &n.host, dir.path())?;
    let socket = dir.path().join("dp.sock");
    let daemon = match mode.dataplane() {
        Some(dp) => Some(Daemon::start(
            &n.host,
            &socket,
            &["--hostname", "node1", "--ipv6", "true", "--dataplane", dp],
        )?),
        None => None,
    };
    calico::apply(c, &n.host, dir.path(), &differential::base())?;
    let env = [("FELIX_IPV6SUPPORT", "true"), ("FELIX_XDPENABLED", "false")];
    let start_felix = || calico::felix_for(c, mode, &n.host, dir.path(), "node1", &socket, &env);
    // None after Felix gave up on a scenario, until the next is written.
    let mut felix = Some(start_felix()?);
    let fail = |felix: &Option<Proc>, e: anyhow::Error| -> anyhow::Error {
        let tail = felix.as_ref().map(|f| f.tail(40)).unwrap_or_default();
        e.context(format!("{} under Calico {}\n{tail}", mode.name(), c.label))
    };
    let mut verdicts = Vec::new();
    let mut previous: Option<String> = None;
    for (k, seed) in seeds.iter().enumerate() {
        let s = differential::scenario(*seed, k);
        if let Some(p) = previous.take() {
            calico::delete(c, &n.host, dir.path(), &p)
                .map_err(|e| fail(&felix, e.context(format!("seed {seed}: deleting"))))?;
        }
        calico::apply(c, &n.host, dir.path(), &s.apply)
            .map_err(|e| fail(&felix, e.context(format!("seed {seed}:\n{}", s.apply))))?;
        previous = Some(s.policies.clone());
        // After it gave up on the scenario before: a new one, as
        // calico-node's supervisor would start.
        let f = match &mut felix {
            Some(f) => f,
            None => felix.insert(start_felix()?),
        };
        let t0 = Instant::now();
        let held = loop {
            if marker_holds(&n, k) {
                break true;
            }
            if f.exited().is_some() || t0.elapsed() > Duration::from_secs(60) {
                break false;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if held {
            let v = probe_all(&n, cases);
            // Felix can give up on one family after the other's tables
            // (and the marker) are in: then these verdicts are not its.
            if f.exited().is_none() {
                verdicts.push(Ok(v));
                continue;
            }
        }
        let why = gave_up(f);
        if mode.ours() || why.is_none() {
            return Err(fail(
                &felix,
                anyhow::anyhow!("seed {seed}: the marker not within 60 s"),
            ));
        }
        let why = why.unwrap_or_default();
        eprintln!(
            "differential: {}: seed {seed}: Felix gave up: {why}",
            mode.name()
        );
        verdicts.push(Err(why));
        felix = None;
    }
    if daemon.is_some() {
        let rejected = calico::rejections(&n.host)?;
        if rejected != 0.0 {
            return Err(fail(
                &felix,
                anyhow::anyhow!("the daemon rejected {rejected} of Felix's messages"),
            ));
        }
    }
    drop(felix);
    drop(daemon);
    Ok(Run {
        mode,
        verdicts,
        took: started.elapsed(),
    })
}

fn differential(c: &Calico) -> Result<()> {
    let seeds = seeds()?;
    let modes = modes()?;
    let cases = differential::probes();
    let mut runs = Vec::new();
    for mode in &modes {
        let r = run_mode(c, *mode, &seeds, &cases)?;
        eprintln!(
            "differential: {} — {} scenarios × {} probes in {:.1} s",
            mode.name(),
            seeds.len(),
            cases.len(),
            r.took.as_secs_f64()
        );
        runs.push(r);
    }
    let (oracle, others) = runs.split_first().context("at least one mode")?;
    let mut ours_wrong = Vec::new();
    let mut felix_wrong = Vec::new();
    let mut unprogrammed = Vec::new();
    for run in &runs {
        for (k, seed) in seeds.iter().enumerate() {
            if let Err(why) = &run.verdicts[k] {
                unprogrammed.push(format!("seed {seed}, {}: {why}", run.mode.name()));
            }
        }
    }
    for run in others {
        for (k, seed) in seeds.iter().enumerate() {
            let (Ok(want), Ok(got)) = (&oracle.verdicts[k], &run.verdicts[k]) else {
                continue;
            };
            let diff: Vec<String> = cases
                .iter()
                .enumerate()
                .filter(|(i, _)| got[*i] != want[*i])
                .map(|(i, case)| {
                    format!(
                        "  {case}: {} says {}, {} says {}",
                        oracle.mode.name(),
                        want[i],
                        run.mode.name(),
                        got[i]
                    )
                })
                .collect();
            if diff.is_empty() {
                continue;
            }
            let report = format!(
                "seed {seed}, {}: {} of {} probes differ\n{}\n{}",
                run.mode.name(),
                diff.len(),
                cases.len(),
                diff.join("\n"),
                differential::scenario(*seed, k).apply
            );
            if run.mode.ours() {
                ours_wrong.push(report);
            } else {
                felix_wrong.push(report);
            }
        }
    }
    let compared = oracle.verdicts.iter().filter(|v| v.is_ok()).count();
    let allowed: usize = oracle
        .verdicts
        .iter()
        .flatten()
        .flatten()
        .filter(|v| **v)
        .count();
    eprintln!(
        "differential: Calico {}: {} scenarios, {} probes each; {} of {} allowed by {}; \
         ours differ in {}, Felix's modes in {}; {} not programmed",
        c.label,
        seeds.len(),
        cases.len(),
        allowed,
        compared * cases.len(),
        oracle.mode.name(),
        ours_wrong.len(),
        felix_wrong.len(),
        unprogrammed.len()
    );
    for f in &felix_wrong {
        eprintln!("Felix disagrees with itself: {f}");
    }
    for u in &unprogrammed {
        eprintln!("not programmed: {u}");
    }
    if !ours_wrong.is_empty() {
        bail!("{}", ours_wrong.join("\n\n"));
    }
    Ok(())
}

#[test]
fn felix_and_dphandler_agree_verdict_for_verdict() -> Result<()> {
    calico::each_version(differential)
}
