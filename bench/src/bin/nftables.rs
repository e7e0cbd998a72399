//! What one nf_tables commit costs, written by our netlink layer
//! (`backends::nftables::netlink`) and, in the same run, by the kernel's
//! own tool (`nft`, one process per change) — at the scale where issue 4
//! measured iptables-nft's wall: a table of `--chains` chains of
//! `--rules-per-chain` rules each, every chain reached from the `input`
//! hook through an interface dispatch.
//!
//! The cases are the design's levers: a set element (data only: never
//! validated), a rule in the big table (the kernel walks every chain
//! reachable from the table's base chains), the same rule in a small
//! table of its own (the walk is per table), and a rule that only counts
//! (no verdict: not validated).
//!
//! Runs in a network namespace of its own (the process unshares one).
//! Needs root.
//!
//! ```sh
//! cargo build --release -p dphandler-bench && ./target/release/nftables --chains 3000 --rules-per-chain 10
//! ```

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use dphandler_dataplane::backends::nftables::expr::{self, Expr, Meta, Verdict};
use dphandler_dataplane::backends::nftables::netlink::NftNetlink;
use dphandler_dataplane::backends::nftables::ops::{BaseChain, Family, Hook, Key, KeyType, Op};

#[derive(Parser, Debug)]
#[command(about = "nf_tables commit cost: our netlink vs nft, same run")]
struct Args {
    #[arg(long, env = "DPH_BENCH_CHAINS", default_value_t = 3000)]
    chains: usize,
    #[arg(long, env = "DPH_BENCH_RULES_PER_CHAIN", default_value_t = 10)]
    rules_per_chain: usize,
    /// Repetitions of each change; the median is reported.
    #[arg(long, env = "DPH_BENCH_REPS", default_value_t = 15)]
    reps: usize,
}

const BIG: &str = "dph-big";
const SMALL: &str = "dph-small";

fn a(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i as u32))
}

/// `ip saddr <a> accept`.
fn accept_from(i: usize) -> Vec<Expr> {
    let IpAddr::V4(v4) = a(i) else { unreachable!() };
    vec![
        expr::addr(false, true),
        Expr::Cmp {
            eq: true,
            data: v4.octets().to_vec(),
        },
        Expr::Verdict(Verdict::Accept),
    ]
}

fn rule(table: &str, chain: &str, exprs: Vec<Expr>) -> Op {
    Op::AddRule {
        family: Family::Ip,
        table: table.into(),
        chain: chain.into(),
        exprs,
        comment: String::new(),
    }
}

fn build(nl: &mut NftNetlink, chains: usize, per: usize) -> Result<()> {
    let t = |s: &str| s.to_string();
    let base = |table: &str| Op::AddChain {
        family: Family::Ip,
        table: table.into(),
        chain: t("input"),
        base: Some(BaseChain {
            hook: Hook::Input,
            priority: 0,
            accept_by_default: true,
            nat: false,
        }),
    };
    nl.commit(&[
        Op::AddTable {
            family: Family::Ip,
            table: t(BIG),
        },
        base(BIG),
        Op::AddSet {
            family: Family::Ip,
            table: t(BIG),
            set: t("s"),
            key: KeyType::Ipv4Addr,
            interval: false,
        },
        Op::AddVerdictMap {
            family: Family::Ip,
            table: t(BIG),
            map: t("dispatch"),
            key: KeyType::IfName,
        },
        rule(
            BIG,
            "input",
            vec![
                Expr::Meta(Meta::IifName),
                Expr::VerdictMap { map: t("dispatch") },
            ],
        ),
        Op::AddTable {
            family: Family::Ip,
            table: t(SMALL),
        },
        base(SMALL),
        Op::AddChain {
            family: Family::Ip,
            table: t(SMALL),
            chain: t("c"),
            base: None,
        },
        rule(SMALL, "input", vec![Expr::Verdict(Verdict::Jump(t("c")))]),
    ])?;
    // In commits of 500 chains (as the iptables backend writes them).
    for start in (0..chains).step_by(500) {
        let mut ops = Vec::new();
        for c in start..(start + 500).min(chains) {
            let name = format!("c{c}");
            ops.push(Op::AddChain {
                family: Family::Ip,
                table: t(BIG),
                chain: name.clone(),
                base: None,
            });
            for r in 0..per {
                ops.push(rule(BIG, &name, accept_from(c * per + r)));
            }
            ops.push(rule(
                BIG,
                "input",
                [
                    &expr::iface(Meta::IifName, &format!("cali{c}"))[..],
                    &[Expr::Verdict(Verdict::Jump(name))],
                ]
                .concat(),
            ));
        }
        nl.commit(&ops)?;
    }
    Ok(())
}

/// An entry of the big table's dispatch map for interface `x<i>`.
fn verdicts(i: usize, v: Verdict) -> Op {
    Op::AddVerdicts {
        family: Family::Ip,
        table: BIG.into(),
        map: "dispatch".into(),
        entries: vec![(Key::ifname(&format!("x{i}")), v)],
    }
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e3
}

fn nft(script: &str) -> Result<()> {
    let out = Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn();
    let mut child = out.context("running nft")?;
    std::io::Write::write_all(&mut child.stdin.take().context("stdin")?, script.as_bytes())?;
    let st = child.wait()?;
    if !st.success() {
        bail!("nft -f: {script}");
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !nix::unistd::Uid::effective().is_root() {
        bail!("needs root (it unshares a network namespace)");
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).context("unshare(CLONE_NEWNET)")?;
    let mut nl = NftNetlink::open()?;
    let t0 = Instant::now();
    build(&mut nl, args.chains, args.rules_per_chain)?;
    let rules = args.chains * (args.rules_per_chain + 1);
    println!(
        "table {BIG}: {} chains, {rules} rules, built in {:.0} ms over netlink",
        args.chains,
        t0.elapsed().as_secs_f64() * 1e3
    );
    let n = args.reps;
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut v = Vec::new();
        for _ in 0..n {
            let t = Instant::now();
            f()?;
            v.push(t.elapsed());
        }
        Ok(median(v))
    };
    // A new address for each change (a rule or element not there yet).
    let seq = std::cell::Cell::new(1_000_000usize);
    let next = || {
        seq.set(seq.get() + 1);
        seq.get()
    };
    type Change<'a> = Box<dyn FnMut() -> Result<()> + 'a>;
    let nl = std::cell::RefCell::new(nl);
    let cases: Vec<(&str, Change, Change)> = vec![
        (
            "set element added (data only)",
            Box::new(|| {
                let i = next();
                Ok(nl.borrow_mut().commit(&[Op::AddElements {
                    family: Family::Ip,
                    table: BIG.into(),
                    set: "s".into(),
                    elements: vec![a(i).into()],
                }])?)
            }),
            Box::new(|| {
                let i = next();
                nft(&format!("add element ip {BIG} s {{ {} }}\n", a(i)))
            }),
        ),
        (
            "dispatch map entry `: accept` (data only)",
            Box::new(|| {
                let i = next();
                Ok(nl.borrow_mut().commit(&[verdicts(i, Verdict::Accept)])?)
            }),
            Box::new(|| {
                let i = next();
                nft(&format!(
                    "add element ip {BIG} dispatch {{ \"x{i}\" : accept }}\n"
                ))
            }),
        ),
        (
            "dispatch map entry `: goto` an endpoint chain",
            Box::new(|| {
                let i = next();
                Ok(nl
                    .borrow_mut()
                    .commit(&[verdicts(i, Verdict::Goto("c0".into()))])?)
            }),
            Box::new(|| {
                let i = next();
                nft(&format!(
                    "add element ip {BIG} dispatch {{ \"x{i}\" : goto c0 }}\n"
                ))
            }),
        ),
        (
            "accept rule in the big table",
            Box::new(|| {
                let i = next();
                Ok(nl.borrow_mut().commit(&[rule(BIG, "c0", accept_from(i))])?)
            }),
            Box::new(|| {
                let i = next();
                nft(&format!("add rule ip {BIG} c0 ip saddr {} accept\n", a(i)))
            }),
        ),
        (
            "accept rule in a small table",
            Box::new(|| {
                let i = next();
                Ok(nl
                    .borrow_mut()
                    .commit(&[rule(SMALL, "c", accept_from(i))])?)
            }),
            Box::new(|| {
                let i = next();
                nft(&format!("add rule ip {SMALL} c ip saddr {} accept\n", a(i)))
            }),
        ),
        (
            "counting rule (no verdict) in the big table",
            Box::new(|| {
                Ok(nl
                    .borrow_mut()
                    .commit(&[rule(BIG, "c0", vec![Expr::Counter])])?)
            }),
            Box::new(|| nft(&format!("add rule ip {BIG} c0 counter\n"))),
        ),
    ];
    println!();
    println!("| change (median of {n}) | our netlink, ms | nft tool (same run), ms | ratio |");
    println!("|---|---|---|---|");
    for (name, mut ours, mut tool) in cases {
        let o = time(&mut *ours)?;
        let b = time(&mut *tool)?;
        println!("| {name} | {o:.2} | {b:.2} | {:.3} |", o / b);
    }
    Ok(())
}
