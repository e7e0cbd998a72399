//! The same calc graph, two dataplanes, side by side: a real Calico (etcd,
//! calicoctl, Felix, built by `scripts/calico.sh`) drives, in turn,
//!
//! - (a) Felix's own dataplane, iptables mode;
//! - (b) Felix's own dataplane, nftables mode;
//! - (c) Felix → dphandler, our iptables dataplane;
//! - (d) Felix → dphandler, our nftables dataplane;
//!
//! each alone on the machine, on a node of its own (a fresh namespace),
//! with the same datastore content: `--endpoints` workload endpoints (veth
//! pairs whose far ends stay on the node: their chains and routes are
//! programmed, no traffic goes to them) in `--namespaces` namespaces,
//! `--policies` GlobalNetworkPolicies (each selects the endpoints of one
//! app and allows TCP from another app's), and two real workloads under
//! a policy (`probe-allow`) that the timed changes rewrite. Measured:
//!
//! 1. cold start: Felix started with the datastore full → the first
//!    allowed packet between the real workloads (the first apply of every
//!    mode programs the whole snapshot: the packet comes with the rest)
//!    and another port denied (programmed, not merely open), whichever
//!    comes last;
//! 2. one policy changed with calicoctl → enforced (a probe that flips;
//!    median and max of `--changes`);
//! 3. one endpoint added with calicoctl (its workload wired beforehand, as
//!    the CNI does) → its first allowed packet (median and max of
//!    `--adds`);
//! 4. churn: calicoctl label writes at `--churn-rate`/s for
//!    `--churn-seconds`, and meanwhile one policy change a second,
//!    write → enforced (p50 / p99);
//! 5. CPU (Felix, its driver and the daemon) in the cold start and in the
//!    churn, and peak RSS;
//! 6. the packet path: TCP request/response over one connection between
//!    the real workloads, for `--rr-seconds`.
//!
//! Felix's calc graph and its throttle (a token bucket of 10 applies,
//! refilled every ~100 ms) are the same in every mode; Felix's own
//! `felix_calc_graph_update_time_seconds` is printed beside each mode's
//! cold start: the calc graph's share.
//!
//! ```sh
//! cargo build --release --workspace --bins
//! ./target/release/sidebyside --endpoints 1000 --policies 500
//! ```

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use dphandler_tests::calico::{self, Calico, Mode, Proc};
use dphandler_tests::{Daemon, Netns, lab, traffic, usage};

#[derive(Parser, Debug)]
#[command(about = "Felix's own dataplane and dphandler behind Felix, same run")]
struct Args {
    #[arg(long, env = "DPH_BENCH_ENDPOINTS", default_value_t = 500)]
    endpoints: usize,
    #[arg(long, env = "DPH_BENCH_NAMESPACES", default_value_t = 10)]
    namespaces: usize,
    #[arg(long, env = "DPH_BENCH_POLICIES", default_value_t = 200)]
    policies: usize,
    /// Distinct `app` labels the endpoints and policies draw on.
    #[arg(long, env = "DPH_BENCH_APPS", default_value_t = 50)]
    apps: usize,
    #[arg(long, env = "DPH_BENCH_CHANGES", default_value_t = 5)]
    changes: usize,
    #[arg(long, env = "DPH_BENCH_ADDS", default_value_t = 5)]
    adds: usize,
    #[arg(long, env = "DPH_BENCH_CHURN_RATE", default_value_t = 10)]
    churn_rate: u32,
    #[arg(long, env = "DPH_BENCH_CHURN_SECONDS", default_value_t = 10)]
    churn_seconds: u64,
    #[arg(long, env = "DPH_BENCH_RR_SECONDS", default_value_t = 5)]
    rr_seconds: u64,
    /// Which modes, in order (letters a–d of the module's doc).
    #[arg(long, env = "DPH_BENCH_MODES", default_value = "abcd")]
    modes: String,
}

const CLIENT: (&str, u8, &str) = ("cali1", 1, "10.65.0.2");
const SERVER: (&str, u8, &str) = ("cali2", 2, "10.65.0.3");
/// The probe policy's port alternates between these.
const FLIP: [u16; 2] = [8081, 8082];
const RR_PORT: u16 = 7777;

/// The MAC `lab::workload` gives workload `n`'s eth0.
fn real_mac(n: u8) -> String {
    format!("02:00:00:00:00:{n:02x}")
}

fn synthetic_mac(i: usize) -> String {
    format!("02:00:00:01:{:02x}:{:02x}", i / 256, i % 256)
}

fn endpoint_ip(i: usize) -> String {
    format!("10.66.{}.{}", i / 250, 1 + i % 250)
}

/// A WorkloadEndpoint; `mac` is its workload's (Felix writes a permanent
/// neighbour entry with it: a wrong one loses the workload's traffic).
fn wep(ns: &str, name: &str, iface: &str, mac: &str, ip: &str, app: &str) -> String {
    format!(
        "---\napiVersion: projectcalico.org/v3\nkind: WorkloadEndpoint\n\
         metadata: {{name: node1-k8s-{name}-eth0, namespace: {ns}, labels: {{app: {app}, \
         projectcalico.org/namespace: {ns}}}}}\n\
         spec: {{node: node1, orchestrator: k8s, pod: {name}, endpoint: eth0, interfaceName: {iface}, \
         mac: '{mac}', ipNetworks: ['{ip}/32'], profiles: [{ns}]}}\n"
    )
}

fn probe_policy(port: u16) -> String {
    format!(
        "---\napiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {{name: probe-allow}}\n\
         spec:\n  order: 1\n  selector: app == 'server'\n  types: [Ingress]\n  ingress:\n\
         \x20 - {{action: Allow, protocol: TCP, source: {{selector: app == 'client'}}, \
         destination: {{ports: [{port}, {RR_PORT}]}}}}\n"
    )
}

/// Everything the datastore holds before Felix starts.
fn datastore(a: &Args) -> String {
    let mut y = String::from(
        "apiVersion: projectcalico.org/v3\nkind: Node\nmetadata: {name: node1}\n\
         spec: {bgp: {ipv4Address: 172.31.50.1/24}}\n\
         ---\napiVersion: projectcalico.org/v3\nkind: IPPool\nmetadata: {name: pool1}\n\
         spec: {cidr: 10.64.0.0/14, ipipMode: Never, vxlanMode: Never, natOutgoing: false}\n",
    );
    for n in 0..a.namespaces {
        y += &format!(
            "---\napiVersion: projectcalico.org/v3\nkind: Profile\nmetadata: {{name: n{n}}}\n\
             spec:\n  labelsToApply: {{pcns.projectcalico.org/name: n{n}}}\n\
             \x20 ingress: [{{action: Allow}}]\n  egress: [{{action: Allow}}]\n"
        );
    }
    for i in 0..a.endpoints {
        y += &wep(
            &format!("n{}", i % a.namespaces),
            &format!("e{i}"),
            &format!("calie{i}"),
            &synthetic_mac(i),
            &endpoint_ip(i),
            &format!("a{}", i % a.apps),
        );
    }
    for p in 0..a.policies {
        y += &format!(
            "---\napiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {{name: scale-{p}}}\n\
             spec:\n  order: {}\n  selector: app == 'a{}'\n  types: [Ingress, Egress]\n  ingress:\n\
             \x20 - {{action: Allow, protocol: TCP, source: {{selector: app == 'a{}'}}, \
             destination: {{ports: [{}]}}}}\n  egress: [{{action: Allow}}]\n",
            100 + p,
            p % a.apps,
            (p + 1) % a.apps,
            1000 + p % 100
        );
    }
    y += &wep(
        "n0",
        "client",
        CLIENT.0,
        &real_mac(CLIENT.1),
        CLIENT.2,
        "client",
    );
    y += &wep(
        "n0",
        "server",
        SERVER.0,
        &real_mac(SERVER.1),
        SERVER.2,
        "server",
    );
    y + &probe_policy(FLIP[0])
}

/// The synthetic endpoints' interfaces: veth pairs whose far ends stay on
/// the node (one `ip -batch`).
fn synthetic_links(host: &Netns, n: usize) -> Result<()> {
    let mut batch = String::new();
    for i in 0..n {
        batch += &format!(
            "link add calie{i} type veth peer name pe{i}\nlink set calie{i} up\nlink set pe{i} up\n"
        );
    }
    let f = tempfile::NamedTempFile::new()?;
    std::fs::write(f.path(), batch)?;
    host.run("ip", &["-batch", &f.path().to_string_lossy()])?;
    Ok(())
}

fn quick(from: &Netns, to: &str, port: u16) -> bool {
    let to: SocketAddr = format!("{to}:{port}").parse().expect("an address");
    lab::tcp_ok(from, to, Duration::from_millis(50))
}

/// Polls every 5 ms until `cond`, up to `secs`; the time it took.
fn until(secs: u64, what: &str, cond: impl FnMut() -> bool) -> Result<Duration> {
    calico::until_every(secs, Duration::from_millis(5), what, cond)
}

/// The processes a mode's CPU is counted over: Felix, its children (the
/// driver) and the daemon.
fn pids(felix: &Proc, daemon: Option<&Daemon>) -> Vec<u32> {
    let mut v = vec![felix.pid()];
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(felix.pid()) {
                v.push(pid);
            }
        }
    }
    if let Some(d) = daemon {
        v.push(d.pid());
    }
    v
}

/// (CPU seconds, peak RSS in MiB) summed over `pids`.
fn cpu_rss(pids: &[u32]) -> (f64, f64) {
    pids.iter()
        .filter_map(|p| usage(*p).ok())
        .fold((0.0, 0.0), |(c, r), (hwm, cpu)| {
            (c + cpu, r + hwm as f64 / 1024.0)
        })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[derive(Debug, Default)]
struct Report {
    cold_ms: f64,
    cold_cpu: f64,
    calc_graph_s: Option<f64>,
    change_ms: Vec<f64>,
    add_ms: Vec<f64>,
    churn_ms: Vec<f64>,
    churn_writes: usize,
    churn_cores: f64,
    rss_mib: f64,
    rr: f64,
}

/// Felix's own calc-graph time so far (its Prometheus summary's sum).
fn calc_graph_seconds(host: &Netns) -> Option<f64> {
    let (_, body) = lab::http_get(host, "127.0.0.1", 9091, "/metrics").ok()?;
    body.lines()
        .find_map(|l| l.strip_prefix("felix_calc_graph_update_time_seconds_sum "))
        .and_then(|v| v.trim().parse().ok())
}

fn run_mode(c: &Calico, a: &Args, mode: Mode) -> Result<Report> {
    let dir = tempfile::tempdir()?;
    let host = Netns::new("sbs")?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    host.run("ip", &["addr", "add", "172.31.50.1/24", "dev", "lo"])?;
    let client = lab::workload_v4(&host, CLIENT.0, CLIENT.1, CLIENT.2)?;
    let server = lab::workload_v4(&host, SERVER.0, SERVER.1, SERVER.2)?;
    let _servers = lab::serve(&server.0, &FLIP, &[]);
    let _echo = lab::echo(&server.0, RR_PORT);
    synthetic_links(&host, a.endpoints)?;
    // The endpoints added one by one, wired beforehand as the CNI does.
    let adds: Vec<Netns> = (0..a.adds)
        .map(|k| {
            lab::workload_v4(
                &host,
                &format!("calia{k}"),
                10 + k as u8,
                &format!("10.65.1.{}", 1 + k),
            )
        })
        .collect::<Result<_>>()?;

    let _etcd = calico::etcd(c, &host, dir.path())?;
    let written = Instant::now();
    calico::apply(c, &host, dir.path(), &datastore(a))?;
    eprintln!(
        "{}: datastore written in {:.1} s",
        mode.name(),
        written.elapsed().as_secs_f64()
    );
    let socket = dir.path().join("dp.sock");
    let daemon = match mode.dataplane() {
        Some(dp) => Some(Daemon::start(
            &host,
            &socket,
            &["--hostname", "node1", "--ipv6", "false", "--dataplane", dp],
        )?),
        None => None,
    };
    let env = [
        ("FELIX_IPV6SUPPORT", "false"),
        ("FELIX_XDPENABLED", "false"),
        ("FELIX_PROMETHEUSMETRICSENABLED", "true"),
        ("FELIX_PROMETHEUSMETRICSPORT", "9091"),
    ];
    if let Some(d) = &daemon {
        // The daemon up and idle before Felix starts (as on a node where
        // it runs already).
        let rt = tokio::runtime::Runtime::new()?;
        rt.block_on(d.connect())?;
    }
    let t0 = Instant::now();
    let felix = calico::felix_for(c, mode, &host, dir.path(), "node1", &socket, &env)?;
    let ctx = |e: anyhow::Error| e.context(format!("{}\n{}", mode.name(), felix.tail(30)));
    until(600, "the cold start's first allowed packet", || {
        quick(&client, SERVER.2, FLIP[0])
    })
    .map_err(ctx)?;
    let allowed = t0.elapsed();
    // Programmed, not merely open: the other port denied too (a dataplane
    // that has programmed nothing lets both through, as Felix's own did
    // for its first 30 s at 2,000 endpoints here). A denied probe waits
    // out its timeout, so the time taken is when the probe that found it
    // denied started.
    let denied = {
        let limit = t0 + Duration::from_secs(600);
        loop {
            let at = t0.elapsed();
            if !quick(&client, SERVER.2, FLIP[1]) {
                break at;
            }
            if Instant::now() > limit {
                return Err(ctx(anyhow::anyhow!(
                    "the cold start's policy: the other port still open after 600 s"
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let mut r = Report {
        cold_ms: allowed.max(denied).as_secs_f64() * 1e3,
        ..Report::default()
    };
    let procs = pids(&felix, daemon.as_ref());
    r.cold_cpu = cpu_rss(&procs).0;
    r.calc_graph_s = calc_graph_seconds(&host);
    // Quiet before the timed changes.
    std::thread::sleep(Duration::from_secs(3));

    for k in 0..a.changes {
        let port = FLIP[(k + 1) % 2];
        let t = Instant::now();
        calico::apply(c, &host, dir.path(), &probe_policy(port))?;
        until(60, "a changed policy enforced", || {
            quick(&client, SERVER.2, port)
        })
        .map_err(ctx)?;
        r.change_ms.push(t.elapsed().as_secs_f64() * 1e3);
        // And the port it closed is closed (one rule update opens the one
        // and closes the other; checked after the timing).
        let old = FLIP[k % 2];
        until(60, "a changed policy's closed port denied", || {
            !quick(&client, SERVER.2, old)
        })
        .map_err(ctx)?;
        std::thread::sleep(Duration::from_millis(500));
    }
    let open = FLIP[a.changes % 2];
    for (k, wl) in adds.iter().enumerate() {
        let t = Instant::now();
        calico::apply(
            c,
            &host,
            dir.path(),
            &wep(
                "n0",
                &format!("added{k}"),
                &format!("calia{k}"),
                &real_mac(10 + k as u8),
                &format!("10.65.1.{}", 1 + k),
                "client",
            ),
        )?;
        until(60, "an added endpoint's first allowed packet", || {
            quick(wl, SERVER.2, open)
        })
        .map_err(ctx)?;
        r.add_ms.push(t.elapsed().as_secs_f64() * 1e3);
        std::thread::sleep(Duration::from_millis(500));
    }

    // Churn: label writes at the rate, a timed policy change a second.
    let writer = |stop: &std::sync::atomic::AtomicBool| -> Result<usize> {
        let every = Duration::from_secs_f64(1.0 / f64::from(a.churn_rate.max(1)));
        let n = a.endpoints.max(1);
        let (mut i, mut next) = (0usize, Instant::now());
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let e = i % n;
            let yaml = wep(
                &format!("n{}", e % a.namespaces),
                &format!("e{e}"),
                &format!("calie{e}"),
                &synthetic_mac(e),
                &endpoint_ip(e),
                &format!("a{}", (e + 1 + i / n) % a.apps),
            );
            let f = dir.path().join(format!("churn-{}.yaml", i % 4));
            std::fs::write(&f, yaml)?;
            calico::calicoctl(c, &host, &["apply", "-f", &f.to_string_lossy()])?;
            i += 1;
            next += every;
            if let Some(d) = next.checked_duration_since(Instant::now()) {
                std::thread::sleep(d);
            }
        }
        Ok(i)
    };
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (cpu0, _) = cpu_rss(&procs);
    let churn_started = Instant::now();
    let (changes, writes) = std::thread::scope(|s| -> Result<(Vec<f64>, usize)> {
        let w = s.spawn(|| writer(&stop));
        let mut lat = Vec::new();
        let mut k = a.changes;
        let timed = (|| -> Result<()> {
            while churn_started.elapsed() < Duration::from_secs(a.churn_seconds) {
                k += 1;
                let port = FLIP[k % 2];
                let t = Instant::now();
                calico::apply(c, &host, dir.path(), &probe_policy(port))?;
                until(60, "a changed policy enforced under churn", || {
                    quick(&client, SERVER.2, port)
                })
                .map_err(ctx)?;
                lat.push(t.elapsed().as_secs_f64() * 1e3);
                std::thread::sleep(Duration::from_secs(1).saturating_sub(t.elapsed()));
            }
            Ok(())
        })();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let writes = w
            .join()
            .map_err(|_| anyhow::anyhow!("the churn writer panicked"))??;
        timed?;
        Ok((lat, writes))
    })?;
    r.churn_ms = changes;
    let churn_wall = churn_started.elapsed().as_secs_f64();
    let (cpu1, rss) = cpu_rss(&procs);
    r.churn_writes = writes;
    r.churn_cores = (cpu1 - cpu0) / churn_wall;
    r.rss_mib = rss;
    std::thread::sleep(Duration::from_secs(1));
    let to: SocketAddr = format!("{}:{RR_PORT}", SERVER.2).parse()?;
    r.rr = traffic::request_response(&client, to, a.rr_seconds).map_err(ctx)?;
    drop(felix);
    drop(daemon);
    Ok(r)
}

fn main() -> Result<()> {
    let a = Args::parse();
    if !nix::unistd::Uid::effective().is_root() {
        bail!("the benchmark runs Felix and the daemon in network namespaces: run it as root");
    }
    if a.namespaces == 0 || a.apps == 0 || a.changes == 0 {
        bail!("--namespaces, --apps and --changes must be at least 1");
    }
    let modes = Mode::parse_list(&a.modes).context("--modes")?;
    let Some(versions) = calico::versions()? else {
        bail!("no Go toolchain: Calico cannot be built (scripts/calico.sh)");
    };
    let c = versions.last().context("a Calico version")?;
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut reports = Vec::new();
    for m in &modes {
        let r = run_mode(c, &a, *m)?;
        eprintln!("{}: {r:?}", m.name());
        reports.push((*m, r));
    }
    println!(
        "sidebyside: Calico {}, {} endpoints in {} namespaces, {} policies ({} apps), 2 real workloads; IPv4; {cores} cores",
        c.label, a.endpoints, a.namespaces, a.policies, a.apps
    );
    println!();
    let names: Vec<&str> = reports.iter().map(|(m, _)| m.name()).collect();
    println!("| case | {} |", names.join(" | "));
    println!("|---|{}", "---|".repeat(names.len()));
    let row = |case: String, cell: &dyn Fn(&Report) -> String| {
        let cells: Vec<String> = reports.iter().map(|(_, r)| cell(r)).collect();
        println!("| {case} | {} |", cells.join(" | "));
    };
    row(
        "cold start → programmed (one port allowed, another denied)".into(),
        &|r| format!("{:.0} ms", r.cold_ms),
    );
    row(
        "  of which Felix's calc graph (its own metric)".into(),
        &|r| {
            r.calc_graph_s
                .map_or("n/a".into(), |s| format!("{:.0} ms", s * 1e3))
        },
    );
    row("  CPU to then (Felix + driver + daemon)".into(), &|r| {
        format!("{:.2} s", r.cold_cpu)
    });
    row(
        format!("policy changed → enforced, median / max of {}", a.changes),
        &|r| {
            format!(
                "{:.0} / {:.0} ms",
                median(r.change_ms.clone()),
                percentile(r.change_ms.clone(), 1.0)
            )
        },
    );
    row(
        format!("endpoint added → first packet, median / max of {}", a.adds),
        &|r| {
            format!(
                "{:.0} / {:.0} ms",
                median(r.add_ms.clone()),
                percentile(r.add_ms.clone(), 1.0)
            )
        },
    );
    row(
        format!(
            "churn ({}/s label writes, {} s): policy change → enforced, p50 / p99",
            a.churn_rate, a.churn_seconds
        ),
        &|r| {
            format!(
                "{:.0} / {:.0} ms ({} changes, {} writes)",
                percentile(r.churn_ms.clone(), 0.5),
                percentile(r.churn_ms.clone(), 0.99),
                r.churn_ms.len(),
                r.churn_writes
            )
        },
    );
    row("churn: CPU (Felix + driver + daemon)".into(), &|r| {
        format!("{:.2} cores", r.churn_cores)
    });
    row("peak RSS (Felix + driver + daemon)".into(), &|r| {
        format!("{:.0} MiB", r.rss_mib)
    });
    row(
        format!("packet path: TCP request/response, {} s", a.rr_seconds),
        &|r| format!("{:.0} /s", r.rr),
    );
    Ok(())
}
