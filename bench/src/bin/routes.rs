//! The routes backend (rtnetlink) against the raw tool, in the same run:
//! the time our backend takes to bring the kernel to a state (read back,
//! diff, netlink writes) next to the time `ip -batch` takes to load the
//! same state from a prepared file (`bench/kernel_limits.sh` section 5,
//! measured here the same way: /32 routes `dev pv0`, one `ip -batch`; one
//! route on top with one `ip route add` process).
//!
//! Also: 1,000 VTEPs (a permanent neighbour and an FDB entry each on a
//! VXLAN device) against `ip -batch` + `bridge -batch`.
//!
//! Runs in a network namespace of its own (the process unshares one, so
//! the host's routes are never seen or touched). Needs root.
//!
//! ```sh
//! cargo build --release -p dphandler-bench && ./target/release/routes --routes 100000 --reps 3
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use dphandler_dataplane::backends::routes::netlink::RouteNetlink;
use dphandler_dataplane::backends::routes::{
    KernelFdb, KernelNeighbour, KernelRoute, Link, RouteOp, RouteOwnership, RouteSeam, RouteSource,
    Routes,
};
use dphandler_dataplane::backends::{Backend, BackendError, Phase};
use dphandler_dataplane::model::MacAddr;
use dphandler_dataplane::model::routes::{
    FdbEntry, Neighbour, RouteClass, RouteKey, RouteKind, RouteTarget,
};

#[derive(Parser, Debug)]
#[command(about = "routes backend (rtnetlink) vs raw ip -batch, same run")]
struct Args {
    /// Routes in the fresh load (and under the one-route changes).
    #[arg(long, env = "DPH_BENCH_ROUTES", default_value_t = 100_000)]
    routes: usize,
    /// VTEPs (neighbour + FDB entry each).
    #[arg(long, env = "DPH_BENCH_VTEPS", default_value_t = 1_000)]
    vteps: usize,
    /// Repetitions; the median is reported.
    #[arg(long, env = "DPH_BENCH_REPS", default_value_t = 3)]
    reps: usize,
}

/// The kernel_limits.sh destinations: 198.18.0.0 upwards, /32.
fn dst(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(
        198,
        18 + (i / 65536) as u8,
        (i / 256 % 256) as u8,
        (i % 256) as u8,
    )
}

const EXTRA: Ipv4Addr = Ipv4Addr::new(198, 19, 250, 1);

fn sh(prog: &str, args: &[&str]) -> Result<()> {
    let st = Command::new(prog)
        .args(args)
        .stdout(Stdio::null())
        .status()
        .with_context(|| prog.to_string())?;
    if !st.success() {
        bail!("{prog} {args:?} failed");
    }
    Ok(())
}

/// Runs `prog args` with `file` on its standard input; the wall time.
fn timed_batch(prog: &str, args: &[&str], file: &std::path::Path) -> Result<Duration> {
    let f = std::fs::File::open(file)?;
    let t = Instant::now();
    let st = Command::new(prog)
        .args(args)
        .stdin(f)
        .stdout(Stdio::null())
        .status()?;
    let d = t.elapsed();
    if !st.success() {
        bail!("{prog} {args:?} failed");
    }
    Ok(d)
}

fn timed(prog: &str, args: &[&str]) -> Result<Duration> {
    let t = Instant::now();
    sh(prog, args)?;
    Ok(t.elapsed())
}

fn count_routes() -> Result<usize> {
    let out = Command::new("ip")
        .args(["-4", "route", "show", "dev", "pv0"])
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).lines().count())
}

fn reset_routes() -> Result<()> {
    sh("ip", &["-4", "route", "flush", "dev", "pv0"])
}

fn route_target(protocol: u8) -> RouteTarget {
    RouteTarget {
        class: RouteClass::NoEncap,
        kind: RouteKind::Unicast,
        dev: Some("pv0".into()),
        gateway: None,
        onlink: false,
        protocol,
        mtu: None,
    }
}

fn desired(n: usize) -> BTreeMap<RouteKey, RouteTarget> {
    (0..n)
        .map(|i| (RouteKey::main(IpAddr::V4(dst(i)).into()), route_target(80)))
        .collect()
}

fn ownership() -> RouteOwnership {
    RouteOwnership {
        exclusive_protocol: 80,
        device_protocol: 3,
        workload_prefix: "cali".into(),
        remove_external_routes: true,
        tunnel_devices: vec!["vxlan.calico".into()],
        tables: vec![],
    }
}

fn vtep_mac(i: usize) -> MacAddr {
    MacAddr([0x66, 0x6a, 0, 0, (i / 256) as u8, (i % 256) as u8])
}

fn vtep_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 96, (i / 256) as u8, (i % 256) as u8)
}

fn host_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(172, 20, (i / 256) as u8, (i % 256) as u8)
}

/// Removes the VTEP neighbours and FDB entries of the VTEP rows.
fn clear_vteps(n: usize) -> Result<()> {
    sh(
        "ip",
        &["neigh", "flush", "dev", "vxlan.calico", "nud", "permanent"],
    )?;
    for i in 0..n {
        // Absent entries (the first round) fail: fine.
        let _ = Command::new("bridge")
            .args([
                "fdb",
                "del",
                &vtep_mac(i).to_string(),
                "dev",
                "vxlan.calico",
                "self",
            ])
            .stderr(Stdio::null())
            .status();
    }
    Ok(())
}

/// Counts what the backend would write, without a kernel: our own CPU.
#[derive(Debug, Default)]
struct Null {
    ops: usize,
}

impl RouteSeam for Null {
    fn links(&mut self) -> Result<Vec<Link>, BackendError> {
        Ok(vec![Link {
            index: 2,
            name: "pv0".into(),
        }])
    }
    fn routes(&mut self) -> Result<Vec<KernelRoute>, BackendError> {
        Ok(Vec::new())
    }
    fn neighbours(&mut self) -> Result<(Vec<KernelNeighbour>, Vec<KernelFdb>), BackendError> {
        Ok((Vec::new(), Vec::new()))
    }
    fn write(&mut self, ops: &[RouteOp]) -> Vec<(usize, BackendError)> {
        self.ops += ops.len();
        Vec::new()
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !nix::unistd::Uid::effective().is_root() {
        bail!("run as root: the benchmark makes a network namespace of its own");
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).context("unshare(CLONE_NEWNET)")?;
    sh("ip", &["link", "set", "lo", "up"])?;
    sh(
        "ip",
        &["link", "add", "pv0", "type", "veth", "peer", "name", "pv1"],
    )?;
    sh("ip", &["link", "set", "pv0", "up"])?;
    sh("ip", &["link", "set", "pv1", "up"])?;
    sh("ip", &["addr", "add", "172.20.255.254/16", "dev", "pv0"])?;
    sh(
        "ip",
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
            "pv0",
            "local",
            "172.20.255.254",
        ],
    )?;
    sh("ip", &["link", "set", "vxlan.calico", "up"])?;

    let dir = tempfile::tempdir()?;
    let raw_file = dir.path().join("routes.batch");
    let mut text = String::with_capacity(args.routes * 48);
    for i in 0..args.routes {
        text += &format!("route add {}/32 dev pv0 proto static\n", dst(i));
    }
    std::fs::write(&raw_file, text)?;
    let neigh_file = dir.path().join("neigh.batch");
    let fdb_file = dir.path().join("fdb.batch");
    let (mut nt, mut ft) = (String::new(), String::new());
    for i in 0..args.vteps {
        nt += &format!(
            "neigh replace {} lladdr {} dev vxlan.calico nud permanent\n",
            vtep_ip(i),
            vtep_mac(i)
        );
        ft += &format!(
            "fdb append {} dev vxlan.calico dst {} self permanent\n",
            vtep_mac(i),
            host_ip(i)
        );
    }
    std::fs::write(&neigh_file, nt)?;
    std::fs::write(&fdb_file, ft)?;
    let want = desired(args.routes);
    let neighbours: BTreeSet<Neighbour> = (0..args.vteps)
        .map(|i| Neighbour {
            dev: "vxlan.calico".into(),
            addr: vtep_ip(i).into(),
            mac: vtep_mac(i),
        })
        .collect();
    let fdb: BTreeSet<FdbEntry> = (0..args.vteps)
        .map(|i| FdbEntry {
            dev: "vxlan.calico".into(),
            mac: vtep_mac(i),
            dst: host_ip(i).into(),
        })
        .collect();

    let mut t: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
    let extra_key = RouteKey::main(IpAddr::V4(EXTRA).into());
    for _ in 0..args.reps {
        // Raw: fresh load, then one route on top with one process.
        reset_routes()?;
        t.entry("raw_fresh")
            .or_default()
            .push(timed_batch("ip", &["-batch", "-"], &raw_file)?);
        if count_routes()? != args.routes {
            bail!("raw load incomplete");
        }
        let extra = format!("{EXTRA}/32");
        t.entry("raw_add").or_default().push(timed(
            "ip",
            &["route", "add", &extra, "dev", "pv0", "proto", "static"],
        )?);
        t.entry("raw_del")
            .or_default()
            .push(timed("ip", &["route", "del", &extra, "dev", "pv0"])?);

        // Ours, fresh: the backend's first apply (link dump, route and
        // neighbour dumps, diff, writes); the desired state is built before
        // the clock starts (the managers hold it as the messages arrive).
        reset_routes()?;
        let mut b = Routes::new(ownership(), Box::new(RouteNetlink::open()?));
        b.set(RouteSource::Cluster, want.clone(), BTreeSet::new());
        let s = Instant::now();
        b.apply(Phase::RoutesAndRules)?;
        t.entry("ours_fresh").or_default().push(s.elapsed());
        if count_routes()? != args.routes {
            bail!("our load incomplete: {}", count_routes()?);
        }
        // One route added, then removed, at that size: as the routes
        // manager hands over a RouteUpdate / RouteRemove (one key), and as
        // a manager that re-sets its whole share would (a merge walk of
        // both maps finds the one difference).
        let s = Instant::now();
        b.update(RouteSource::Cluster, extra_key, Some(route_target(80)));
        b.apply(Phase::RoutesAndRules)?;
        t.entry("ours_add").or_default().push(s.elapsed());
        if count_routes()? != args.routes + 1 {
            bail!("the added route is missing");
        }
        let s = Instant::now();
        b.update(RouteSource::Cluster, extra_key, None);
        b.apply(Phase::RoutesAndRules)?;
        t.entry("ours_del").or_default().push(s.elapsed());
        if count_routes()? != args.routes {
            bail!("the removed route is still there");
        }
        let mut plus = want.clone();
        plus.insert(extra_key, route_target(80));
        let s = Instant::now();
        b.set(RouteSource::Cluster, plus, BTreeSet::new());
        b.apply(Phase::RoutesAndRules)?;
        t.entry("ours_set_add").or_default().push(s.elapsed());
        let same = want.clone();
        let s = Instant::now();
        b.set(RouteSource::Cluster, same, BTreeSet::new());
        b.apply(Phase::RoutesAndRules)?;
        t.entry("ours_set_del").or_default().push(s.elapsed());
        if count_routes()? != args.routes {
            bail!("one-route changes left {}", count_routes()?);
        }
        // Our CPU alone for the fresh load (no kernel).
        let mut n = Routes::new(ownership(), Box::new(Null::default()));
        n.set(RouteSource::Cluster, want.clone(), BTreeSet::new());
        let s = Instant::now();
        n.apply(Phase::RoutesAndRules)?;
        t.entry("ours_cpu").or_default().push(s.elapsed());
        drop(b);
        reset_routes()?;

        // VTEPs: raw neighbours + FDB, then ours.
        clear_vteps(args.vteps)?;
        let a = timed_batch("ip", &["-batch", "-"], &neigh_file)?;
        let f = timed_batch("bridge", &["-batch", "-"], &fdb_file)?;
        t.entry("raw_vteps").or_default().push(a + f);
        clear_vteps(args.vteps)?;
        let mut b = Routes::new(ownership(), Box::new(RouteNetlink::open()?));
        b.set(RouteSource::Cluster, BTreeMap::new(), neighbours.clone());
        b.set_fdb(fdb.clone());
        let s = Instant::now();
        b.apply(Phase::RoutesAndRules)?;
        t.entry("ours_vteps").or_default().push(s.elapsed());
        let shown = Command::new("bridge")
            .args(["fdb", "show", "dev", "vxlan.calico"])
            .output()?;
        let fdb_n = String::from_utf8_lossy(&shown.stdout)
            .lines()
            .filter(|l| l.contains(" dst "))
            .count();
        if fdb_n != args.vteps {
            bail!("our VTEP load has {fdb_n} FDB entries");
        }
        clear_vteps(args.vteps)?;
    }
    let m = |k: &str| median(t[k].clone());
    println!(
        "routes: {} /32 routes on a veth, {} VTEPs, median of {} runs, own network namespace",
        args.routes, args.vteps, args.reps
    );
    println!();
    println!("| case | raw tool | dphandler | ratio / difference | target |");
    println!("|---|---|---|---|---|");
    println!(
        "| {} routes, fresh, until programmed | {:.1} ms (`ip -batch`) | {:.1} ms | {:.2}× | ≤ 1.0× |",
        args.routes,
        ms(m("raw_fresh")),
        ms(m("ours_fresh")),
        m("ours_fresh").as_secs_f64() / m("raw_fresh").as_secs_f64()
    );
    println!(
        "| one route added at {} | {:.2} ms (`ip route add`) | {:.3} ms | {:+.2} ms | ≤ 1 ms |",
        args.routes,
        ms(m("raw_add")),
        ms(m("ours_add")),
        ms(m("ours_add")) - ms(m("raw_add"))
    );
    println!(
        "| one route removed at {} | {:.2} ms (`ip route del`) | {:.3} ms | {:+.2} ms | ≤ 1 ms |",
        args.routes,
        ms(m("raw_del")),
        ms(m("ours_del")),
        ms(m("ours_del")) - ms(m("raw_del"))
    );
    println!(
        "| the same two through a whole-share `set` (add / remove) | — | {:.2} / {:.2} ms | — | — |",
        ms(m("ours_set_add")),
        ms(m("ours_set_del"))
    );
    println!(
        "| {} VTEPs (neighbour + FDB each), fresh | {:.1} ms (`ip -batch` + `bridge -batch`) | {:.1} ms | {:.2}× | reported |",
        args.vteps,
        ms(m("raw_vteps")),
        ms(m("ours_vteps")),
        m("ours_vteps").as_secs_f64() / m("raw_vteps").as_secs_f64()
    );
    println!(
        "| our diff of the fresh load (no kernel) | — | {:.1} ms | — | — |",
        ms(m("ours_cpu"))
    );
    Ok(())
}
