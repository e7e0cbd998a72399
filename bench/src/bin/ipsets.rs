//! The IP-set backend against the raw tool, in the same run: the time our
//! backend takes to bring the kernel to a state (render, diff, one
//! `ipset restore`) next to the time `ipset restore` alone takes to load
//! the same state from a prepared file (the baseline of
//! `bench/kernel_limits.sh`, measured here the same way: 100 `hash:net`
//! sets, members as /32 host entries, `maxelem 1048576`, pre-sized
//! `hashsize`).
//!
//! Runs in a network namespace of its own (the process unshares one, so
//! the host's IP sets are never seen or touched). Needs root.
//!
//! ```sh
//! cargo build --release -p dphandler-bench && ./target/release/ipsets --members 1000000 --reps 3
//! ```

use std::collections::HashSet;
use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use dphandler_dataplane::backends::ipsets::{
    IpSetExec, IpSets, Meta, hashsize, restore::IpsetTool,
};
use dphandler_dataplane::backends::{Backend, BackendError, Phase};
use dphandler_dataplane::model::IpVersion;
use dphandler_dataplane::model::ipsets::{IpSetType, Member, SetNames};

#[derive(Parser, Debug)]
#[command(about = "IP-set backend vs raw ipset restore, same run")]
struct Args {
    /// Members in total, spread over --sets sets.
    #[arg(long, env = "DPH_BENCH_MEMBERS", default_value_t = 1_000_000)]
    members: usize,
    #[arg(long, env = "DPH_BENCH_SETS", default_value_t = 100)]
    sets: usize,
    /// Repetitions; the median is reported.
    #[arg(long, env = "DPH_BENCH_REPS", default_value_t = 3)]
    reps: usize,
}

const MAXELEM: u32 = 1_048_576;

fn member(j: usize) -> Ipv4Addr {
    Ipv4Addr::new(
        10,
        (j / 65536 % 256) as u8,
        (j / 256 % 256) as u8,
        (j % 256) as u8,
    )
}

fn ipset(args: &[&str], stdin: Option<&[u8]>) -> Result<()> {
    let mut c = Command::new("ipset")
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .spawn()?;
    if let Some(input) = stdin {
        c.stdin.take().unwrap().write_all(input)?;
    }
    if !c.wait()?.success() {
        bail!("ipset {args:?} failed");
    }
    Ok(())
}

fn reset() -> Result<()> {
    ipset(&["flush"], None)?;
    ipset(&["destroy"], None)
}

/// Runs `ipset restore` with `file` as its standard input, as the shell
/// baseline does (`ipset restore <file`); returns the wall time.
fn raw_restore(file: &std::path::Path) -> Result<Duration> {
    let f = std::fs::File::open(file)?;
    let t = Instant::now();
    let st = Command::new("ipset")
        .arg("restore")
        .stdin(f)
        .stdout(Stdio::null())
        .status()?;
    let d = t.elapsed();
    if !st.success() {
        bail!("ipset restore failed");
    }
    Ok(d)
}

/// The baseline's input, pre-sized, for `m` members in `s` sets.
fn raw_script(m: usize, s: usize, names: &[String]) -> String {
    let per = m / s;
    let extra = m - per * s;
    let mut out = String::with_capacity(m * 24);
    for (k, name) in names.iter().enumerate() {
        let cnt = per + usize::from(k < extra);
        out.push_str(&format!(
            "create {name} hash:net family inet hashsize {} maxelem {MAXELEM}\n",
            hashsize(cnt)
        ));
    }
    for (k, name) in names.iter().enumerate() {
        let cnt = per + usize::from(k < extra);
        for j in 0..cnt {
            out.push_str(&format!("add {name} {}\n", member(j)));
        }
    }
    out
}

fn desired(m: usize, s: usize) -> Vec<HashSet<Member>> {
    let per = m / s;
    let extra = m - per * s;
    (0..s)
        .map(|k| {
            let cnt = per + usize::from(k < extra);
            (0..cnt)
                .map(|j| Member::Net(ipnet::IpNet::from(std::net::IpAddr::from(member(j)))))
                .collect()
        })
        .collect()
}

/// Counts what the backend would write, without a kernel: our own CPU.
#[derive(Debug, Default)]
struct Null {
    bytes: usize,
}

impl IpSetExec for Null {
    fn save(&mut self) -> Result<String, BackendError> {
        Ok(String::new())
    }
    fn restore(&mut self, script: &str) -> Result<(), BackendError> {
        self.bytes += script.len();
        Ok(())
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn count_members() -> Result<usize> {
    let out = Command::new("ipset").arg("save").output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("add "))
        .count())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !nix::unistd::Uid::effective().is_root() {
        bail!("run as root: the benchmark makes a network namespace of its own");
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).context("unshare(CLONE_NEWNET)")?;
    let names_gen = SetNames::new("dph")?;
    let ids: Vec<dphandler_dataplane::model::Id> = (0..args.sets)
        .map(|k| dphandler_dataplane::model::Id::new(&format!("s{k}")).unwrap())
        .collect();
    let names: Vec<String> = ids
        .iter()
        .map(|i| names_gen.name(IpVersion::V4, i))
        .collect();
    let dir = tempfile::tempdir()?;
    let raw_file = dir.path().join("raw.ipset");
    std::fs::write(&raw_file, raw_script(args.members, args.sets, &names))?;
    let inc_file = dir.path().join("inc.ipset");
    let n0 = &names[0];
    std::fs::write(
        &inc_file,
        format!(
            "add {n0} 192.0.2.77\nadd {n0} 192.0.2.78\ndel {n0} {}\ndel {n0} {}\n",
            member(5),
            member(6)
        ),
    )?;
    let sets = desired(args.members, args.sets);
    let meta = Meta {
        set_type: IpSetType::Net,
        maxelem: MAXELEM,
    };

    let (mut raw_fresh, mut ours_fresh, mut raw_inc, mut ours_inc, mut cpu) =
        (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..args.reps {
        // Raw tool, fresh load.
        reset()?;
        raw_fresh.push(raw_restore(&raw_file)?);
        let loaded = count_members()?;
        if loaded != args.members {
            bail!("raw load has {loaded} members");
        }
        // Raw tool, 2 adds + 2 dels on top.
        raw_inc.push(raw_restore(&inc_file)?);

        // Ours, fresh: the backend reads the (empty) kernel, renders and
        // writes; the desired state is built before the clock starts (the
        // manager holds it as the messages arrive).
        reset()?;
        let mut b = IpSets::new(
            IpVersion::V4,
            names_gen.clone(),
            Box::new(IpsetTool::default()),
        );
        b.start_full();
        for (name, m) in names.iter().zip(&sets) {
            b.replace(name.clone(), meta, m.clone());
        }
        let t = Instant::now();
        b.apply(Phase::IpSetUpdates)?;
        ours_fresh.push(t.elapsed());
        let loaded = count_members()?;
        if loaded != args.members {
            bail!("our load has {loaded} members");
        }
        // Ours, 2 adds + 2 dels on top, in one apply.
        let net = |a: Ipv4Addr| Member::Net(ipnet::IpNet::from(std::net::IpAddr::from(a)));
        b.delta(
            n0,
            [
                net(Ipv4Addr::new(192, 0, 2, 77)),
                net(Ipv4Addr::new(192, 0, 2, 78)),
            ],
            [net(member(5)), net(member(6))],
        );
        let t = Instant::now();
        b.apply(Phase::IpSetUpdates)?;
        ours_inc.push(t.elapsed());

        // Our own CPU for the fresh case: render and diff, no kernel.
        let mut n = IpSets::new(IpVersion::V4, names_gen.clone(), Box::new(Null::default()));
        n.start_full();
        for (name, m) in names.iter().zip(&sets) {
            n.replace(name.clone(), meta, m.clone());
        }
        let t = Instant::now();
        n.apply(Phase::IpSetUpdates)?;
        cpu.push(t.elapsed());
    }
    reset()?;

    let (rf, of, ri, oi, c) = (
        median(raw_fresh),
        median(ours_fresh),
        median(raw_inc),
        median(ours_inc),
        median(cpu),
    );
    println!(
        "ipsets: {} members in {} hash:net sets, median of {} runs, own network namespace",
        args.members, args.sets, args.reps
    );
    println!();
    println!("| case | raw `ipset restore` | dphandler | ratio / difference | target |");
    println!("|---|---|---|---|---|");
    println!(
        "| {} members in {} sets, fresh | {:.1} ms (pre-sized) | {:.1} ms | {:.2}× | ≤ 1.25× |",
        args.members,
        args.sets,
        ms(rf),
        ms(of),
        of.as_secs_f64() / rf.as_secs_f64()
    );
    println!(
        "| 2 adds + 2 dels on top | {:.2} ms | {:.2} ms | {:+.2} ms | ≤ raw + 2 ms |",
        ms(ri),
        ms(oi),
        ms(oi) - ms(ri)
    );
    println!(
        "| our render + diff of the fresh load (no kernel) | — | {:.1} ms | — | — |",
        ms(c)
    );
    Ok(())
}
