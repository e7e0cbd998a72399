//! The iptables table backend against the raw tool, in the same run: the
//! time our backend takes to bring a table to a state (read it, render,
//! diff, one `iptables-restore --noflush`) next to the time
//! `iptables-restore` alone takes with a prepared file. The workload is
//! `bench/kernel_limits.sh`'s: N rules in N/10 chains of 10
//! (`-s A/32 -p tcp -m tcp --dport P -m comment … -j ACCEPT`), a dispatch
//! chain with one `-i IF -g CHAIN` per chain, hooked from FORWARD.
//!
//! Runs in a network namespace of its own (the process unshares one).
//! Needs root.
//!
//! ```sh
//! cargo build --release -p dphandler-bench && ./target/release/iptables --rules 50000 --reps 3
//! ```

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use dphandler_dataplane::backends::iptables::restore::{Flavor, IptablesTool};
use dphandler_dataplane::backends::iptables::{InsertMode, IptablesExec, Table};
use dphandler_dataplane::backends::{Backend, BackendError, Phase};
use dphandler_dataplane::generictables::{Ownership, Rule};
use dphandler_dataplane::model::IpVersion;

#[derive(Parser, Debug)]
#[command(about = "iptables backend vs raw iptables-restore, same run")]
struct Args {
    #[arg(long, env = "DPH_BENCH_RULES", default_value_t = 50_000)]
    rules: usize,
    #[arg(long, env = "DPH_BENCH_REPS", default_value_t = 3)]
    reps: usize,
    /// nft, legacy, or both.
    #[arg(long, env = "DPH_BENCH_FLAVOR", default_value = "both")]
    flavor: String,
    /// Only time our own CPU (hash, render, diff; no kernel), this many
    /// times: for profiling and A/B runs.
    #[arg(long, env = "DPH_BENCH_CPU_ONLY")]
    cpu_only: Option<usize>,
    /// With --cpu-only: how many reshaping changes to time.
    #[arg(long, env = "DPH_BENCH_RESHAPES", default_value_t = 20)]
    reshapes: usize,
}

/// One timing of our CPU alone: hand the state to a table over an empty
/// kernel and apply it.
fn cpu_once(built: &[(String, Vec<Rule>)]) -> Result<Duration> {
    let mut null = new_table(Box::new(Null));
    let copy = built.to_vec();
    let start = Instant::now();
    install(&mut null, copy)?;
    null.apply(Phase::Tables)?;
    Ok(start.elapsed())
}

/// Our CPU for a change that reshapes the table on top of `built`: one
/// chain more and a jump to it in the dispatch chain (a workload endpoint
/// added), so the render looks at every chain, not only the touched ones.
/// The jump goes into a small leaf chain, as in the daemon's dispatch tree.
fn cpu_reshape(
    built: &[(String, Vec<Rule>)],
    reps: usize,
) -> Result<(Vec<Duration>, Vec<Duration>)> {
    let mut null = new_table(Box::new(Null));
    install(&mut null, built.to_vec())?;
    null.apply(Phase::Tables)?;
    let mut dispatch = built.last().expect("dispatch chain").1.clone();
    dispatch.push(Rule::parse("-i newif+ -g dph-leaf")?);
    let mut leaf = vec![Rule::parse("-j DROP")?];
    null.set_chain("dph-leaf", leaf.clone())?;
    null.set_chain("dph-dispatch", dispatch)?;
    null.apply(Phase::Tables)?;
    let (mut out, mut applies) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    for i in 0..reps {
        let name = format!("dph-new{i}");
        let start = Instant::now();
        null.set_chain(&name, vec![Rule::parse("-j ACCEPT")?])?;
        leaf.insert(0, Rule::parse(&format!("-i newif{i} -g {name}"))?);
        null.set_chain("dph-leaf", leaf.clone())?;
        let applied = Instant::now();
        null.apply(Phase::Tables)?;
        out.push(start.elapsed());
        applies.push(applied.elapsed());
    }
    Ok((out, applies))
}

fn rule_text(i: usize) -> String {
    format!(
        "-s 10.{}.{}.{}/32 -p tcp -m tcp --dport {} -j ACCEPT",
        i / 65536 % 256,
        i / 256 % 256,
        i % 256,
        1024 + i % 60000
    )
}

fn raw_file(n: usize) -> String {
    let nc = (n / 10).max(1);
    let mut s = String::from(
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:perfp-dispatch - [0:0]\n",
    );
    for c in 0..nc {
        s.push_str(&format!(":perfp-c{c} - [0:0]\n"));
    }
    s.push_str("-A FORWARD -j perfp-dispatch\n");
    for c in 0..nc {
        s.push_str(&format!("-A perfp-dispatch -i perfp{c} -g perfp-c{c}\n"));
    }
    for i in 0..n {
        let c = (i / 10).min(nc - 1);
        let r = rule_text(i).replace(" -j ACCEPT", "");
        s.push_str(&format!(
            "-A perfp-c{c} {r} -m comment --comment \"perfp:{i}\" -j ACCEPT\n"
        ));
    }
    s.push_str("COMMIT\n");
    s
}

fn raw_rewrite() -> String {
    let mut s = String::from("*filter\n:perfp-c7 - [0:0]\n");
    for j in 0..10 {
        s.push_str(&format!(
            "-A perfp-c7 -s 192.0.2.{}/32 -p tcp -m tcp --dport {} -m comment --comment \"perfp:rw{j}\" -j ACCEPT\n",
            j + 1,
            2000 + j
        ));
    }
    s.push_str("COMMIT\n");
    s
}

fn tools(f: Flavor) -> (&'static str, &'static str) {
    match f {
        Flavor::Nft => ("iptables-nft-restore", "iptables-nft-save"),
        Flavor::Legacy => ("iptables-legacy-restore", "iptables-legacy-save"),
    }
}

fn raw_restore(f: Flavor, file: &std::path::Path, noflush: bool) -> Result<Duration> {
    let (restore, _) = tools(f);
    let input = std::fs::File::open(file)?;
    let mut c = Command::new(restore);
    c.args(["-w", "5"]);
    if noflush {
        c.arg("--noflush");
    }
    let t = Instant::now();
    let st = c.stdin(input).stdout(Stdio::null()).status()?;
    let d = t.elapsed();
    if !st.success() {
        bail!("{restore} failed");
    }
    Ok(d)
}

fn reset(f: Flavor) -> Result<()> {
    let (restore, _) = tools(f);
    let mut c = Command::new(restore)
        .args(["-w", "5"])
        .stdin(Stdio::piped())
        .spawn()?;
    use std::io::Write;
    c.stdin.take().unwrap().write_all(
        b"*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n",
    )?;
    if !c.wait()?.success() {
        bail!("reset failed");
    }
    if f == Flavor::Nft {
        let _ = Command::new("nft").args(["flush", "ruleset"]).status();
    }
    Ok(())
}

fn count_rules(f: Flavor) -> Result<usize> {
    let (_, save) = tools(f);
    let out = Command::new(save).args(["-t", "filter"]).output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("-A "))
        .count())
}

/// Our desired state for the same workload: (chain, rules), dispatch last.
fn build(n: usize) -> Result<Vec<(String, Vec<Rule>)>> {
    let nc = (n / 10).max(1);
    let mut chains: Vec<Vec<Rule>> = vec![Vec::with_capacity(10); nc];
    for i in 0..n {
        chains[(i / 10).min(nc - 1)].push(Rule::parse(&rule_text(i))?);
    }
    let mut out: Vec<(String, Vec<Rule>)> = chains
        .into_iter()
        .enumerate()
        .map(|(c, rules)| (format!("dph-c{c}"), rules))
        .collect();
    let dispatch = (0..nc)
        .map(|c| Rule::parse(&format!("-i perfp{c} -g dph-c{c}")))
        .collect::<Result<_, _>>()?;
    out.push(("dph-dispatch".into(), dispatch));
    Ok(out)
}

/// Hands the desired state to the table (this hashes every rule).
fn install(t: &mut Table, built: Vec<(String, Vec<Rule>)>) -> Result<()> {
    for (name, rules) in built {
        t.set_chain(&name, rules)?;
    }
    t.set_hooks("FORWARD", vec![Rule::parse("-j dph-dispatch")?])?;
    Ok(())
}

/// An empty kernel, for timing our own CPU (render and diff) alone.
#[derive(Debug, Default)]
struct Null;

impl IptablesExec for Null {
    fn save(&mut self, _table: &str) -> Result<String, BackendError> {
        Ok(
            "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n"
                .into(),
        )
    }
    fn restore(&mut self, _input: &str) -> Result<(), BackendError> {
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

fn new_table(exec: Box<dyn IptablesExec>) -> Table {
    Table::new(
        "filter",
        IpVersion::V4,
        Ownership::new("dph"),
        InsertMode::Insert,
        exec,
    )
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(n) = args.cpu_only {
        let built = build(args.rules)?;
        let mut v = (0..n.max(1))
            .map(|_| cpu_once(&built))
            .collect::<Result<Vec<_>>>()?;
        v.sort();
        println!(
            "our CPU: hash + render + diff {} rules, {} runs: min {:.1} / median {:.1} / max {:.1} ms",
            args.rules,
            v.len(),
            ms(v[0]),
            ms(v[v.len() / 2]),
            ms(v[v.len() - 1])
        );
        let (mut r, mut a) = cpu_reshape(&built, args.reshapes.max(1))?;
        r.sort();
        a.sort();
        println!(
            "our CPU: one chain and a jump to it added on top, {} runs: min {:.2} / median {:.2} / max {:.2} ms (the apply alone: median {:.2} ms)",
            r.len(),
            ms(r[0]),
            ms(r[r.len() / 2]),
            ms(r[r.len() - 1]),
            ms(a[a.len() / 2])
        );
        return Ok(());
    }
    if !nix::unistd::Uid::effective().is_root() {
        bail!("run as root: the benchmark makes a network namespace of its own");
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).context("unshare(CLONE_NEWNET)")?;
    let flavors: Vec<Flavor> = match args.flavor.as_str() {
        "nft" => vec![Flavor::Nft],
        "legacy" => vec![Flavor::Legacy],
        _ => vec![Flavor::Nft, Flavor::Legacy],
    };
    let dir = tempfile::tempdir()?;
    let full = dir.path().join("full.ipt");
    let rw = dir.path().join("rw.ipt");
    std::fs::write(&full, raw_file(args.rules))?;
    std::fs::write(&rw, raw_rewrite())?;
    let total = args.rules + (args.rules / 10).max(1) + 1;
    println!(
        "iptables: {} rules in {} chains (+{} dispatch rules, +1 hook), median of {} runs, own network namespace",
        args.rules,
        (args.rules / 10).max(1),
        (args.rules / 10).max(1),
        args.reps
    );
    println!();
    println!(
        "| flavour | case | raw `iptables-restore` | dphandler | ratio / difference | target |"
    );
    println!("|---|---|---|---|---|---|");
    for f in flavors {
        let (mut raw_fresh, mut ours_fresh, mut raw_rw, mut ours_rw, mut cpu) =
            (vec![], vec![], vec![], vec![], vec![]);
        let mut raw_noflush = vec![];
        let mut cpu_rw = vec![];
        let built = build(args.rules)?;
        for rep in 0..args.reps {
            reset(f)?;
            raw_fresh.push(raw_restore(f, &full, false)?);
            if count_rules(f)? != total {
                bail!("raw load has {} rules", count_rules(f)?);
            }
            raw_rw.push(raw_restore(f, &rw, true)?);
            // The same file in the mode we must use (we never flush a table
            // that may hold other agents' rules).
            reset(f)?;
            raw_noflush.push(raw_restore(f, &full, true)?);

            reset(f)?;
            let mut t = new_table(Box::new(IptablesTool::new(f, IpVersion::V4, Vec::new())));
            let copy = built.clone();
            let start = Instant::now();
            install(&mut t, copy)?;
            t.apply(Phase::Tables)?;
            ours_fresh.push(start.elapsed());
            let n = count_rules(f)?;
            if n != total {
                bail!("our load has {n} rules, expected {total}");
            }
            // Rewrite one chain (10 rules) on top, as the raw case does.
            let new: Vec<Rule> = (0..10)
                .map(|j| {
                    Rule::parse(&format!(
                        "-s 192.0.2.{}/32 -p tcp -m tcp --dport {} -j ACCEPT",
                        j + 1,
                        2000 + j + rep
                    ))
                })
                .collect::<Result<_, _>>()?;
            t.set_chain("dph-c7", new)?;
            let start = Instant::now();
            t.apply(Phase::Tables)?;
            ours_rw.push(start.elapsed());

            cpu.push(cpu_once(&built)?);
            let mut null = new_table(Box::new(Null));
            install(&mut null, built.clone())?;
            null.apply(Phase::Tables)?;
            let new: Vec<Rule> = (0..10)
                .map(|j| Rule::parse(&format!("-s 192.0.2.{}/32 -j ACCEPT", j + 1 + rep)))
                .collect::<Result<_, _>>()?;
            null.set_chain("dph-c7", new)?;
            let start = Instant::now();
            null.apply(Phase::Tables)?;
            cpu_rw.push(start.elapsed());
        }
        reset(f)?;
        let name = match f {
            Flavor::Nft => "nft",
            Flavor::Legacy => "legacy",
        };
        let rn = median(raw_noflush);
        let (rf, of, rr, or, c) = (
            median(raw_fresh),
            median(ours_fresh),
            median(raw_rw),
            median(ours_rw),
            median(cpu),
        );
        println!(
            "| {name} | {} rules in {} chains, fresh | {:.1} ms | {:.1} ms | {:.2}× | ≤ 1.25× |",
            args.rules,
            args.rules / 10,
            ms(rf),
            ms(of),
            of.as_secs_f64() / rf.as_secs_f64()
        );
        println!(
            "| {name} | same, raw with `--noflush` (the mode we must use) | {:.1} ms | {:.1} ms | {:.2}× | — |",
            ms(rn),
            ms(of),
            of.as_secs_f64() / rn.as_secs_f64()
        );
        println!(
            "| {name} | rewrite one chain (10 rules) on top | {:.1} ms | {:.1} ms | {:+.1} ms | ≤ raw + 5 ms |",
            ms(rr),
            ms(or),
            ms(or) - ms(rr)
        );
        println!(
            "| {name} | our CPU: hash + render + diff {} rules (no kernel) | — | {:.1} ms | — | ≤ 50 ms |",
            args.rules,
            ms(c)
        );
        println!(
            "| {name} | our CPU: the chain rewrite on top (no kernel) | — | {:.2} ms | — | — |",
            ms(median(cpu_rw))
        );
    }
    Ok(())
}
