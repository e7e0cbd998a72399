//! What the daemon under test programmed, read with the kernel's own tools
//! of the dataplane it runs: `iptables-save` and `ipset` for
//! `--dataplane iptables`, `nft` for `--dataplane nftables`. The daemons
//! the tests start inherit `DPH_DATAPLANE`, so one suite runs against
//! either (CI runs the packet suites with both).

use anyhow::Result;

use crate::Netns;

/// The tables an nftables daemon keeps, one per iptables table (filter
/// with its shards, `dph-filter-<n>`).
const TABLES: [&str; 4] = ["raw", "mangle", "nat", "filter"];

/// Our nftables tables for iptables table `table`: `dph-<table>`, and for
/// filter its shards.
fn nft_tables(ns: &Netns, v6: bool, table: &str) -> Result<Vec<String>> {
    let out = ns.run("nft", &["list", "tables", family(v6)])?;
    let main = format!("dph-{table}");
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|t| {
            *t == main
                || t.strip_prefix(&main)
                    .and_then(|r| r.strip_prefix('-'))
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
        .collect())
}

/// Whether the daemons under test program nftables.
pub fn nftables() -> bool {
    std::env::var("DPH_DATAPLANE").is_ok_and(|d| d == "nftables")
}

fn family(v6: bool) -> &'static str {
    if v6 { "ip6" } else { "ip" }
}

/// Our rules in `table` ("" when we have none there): the lines of
/// `iptables-save -t <table>` that name us, or nft's listing of our table.
pub fn our_rules(ns: &Netns, v6: bool, table: &str) -> Result<String> {
    if nftables() {
        let mut text = String::new();
        for t in nft_tables(ns, v6, table)? {
            // Gone since it was listed (nft fails): nothing of ours.
            let out = ns
                .command("nft")
                .args(["list", "table", family(v6), &t])
                .output()?;
            text.push_str(&String::from_utf8_lossy(&out.stdout));
        }
        return Ok(text);
    }
    let tool = if v6 {
        "ip6tables-save"
    } else {
        "iptables-save"
    };
    let out = ns.run(tool, &["-t", table])?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("dph"))
        .collect::<Vec<_>>()
        .join("\n"))
}

/// How many rules of ours `table` holds.
pub fn our_rule_count(ns: &Netns, v6: bool, table: &str) -> Result<usize> {
    let text = our_rules(ns, v6, table)?;
    Ok(if nftables() {
        text.matches("comment \"dph:").count()
    } else {
        text.lines().filter(|l| l.starts_with("-A ")).count()
    })
}

/// The rules of our chain `chain` in `table`, one per line: `iptables -S`
/// lines, or nft's.
pub fn our_chain(ns: &Netns, v6: bool, table: &str, chain: &str) -> Result<String> {
    let out = if nftables() {
        // In filter, or a workload's in the shard that holds it.
        let mut found = None;
        for t in nft_tables(ns, v6, table)? {
            let out = ns
                .command("nft")
                .args(["list", "chain", family(v6), &t, chain])
                .output()?;
            if out.status.success() {
                found = Some(out);
                break;
            }
        }
        match found {
            Some(out) => out,
            None => ns.run(
                "nft",
                &["list", "chain", family(v6), &format!("dph-{table}"), chain],
            )?,
        }
    } else {
        let tool = if v6 { "ip6tables" } else { "iptables" };
        ns.run(tool, &["-t", table, "-S", chain])?
    };
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `iptables` or `nft` spelling of the same match, for the dataplane
/// under test.
pub fn spelled<'a>(iptables: &'a str, nft: &'a str) -> &'a str {
    if nftables() { nft } else { iptables }
}

/// What our set `name` holds, as the kernel lists it (`ipset list`, or
/// `nft list set` in whichever of our tables holds it); "" when it is
/// nowhere.
pub fn our_set(ns: &Netns, v6: bool, name: &str) -> Result<String> {
    if !nftables() {
        let out = ns.run("ipset", &["list", name])?;
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let mut tables = Vec::new();
    for t in TABLES {
        tables.extend(nft_tables(ns, v6, t)?);
    }
    for t in tables {
        let out = ns
            .command("nft")
            .args(["list", "set", family(v6), &t, name])
            .output()?;
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
    }
    Ok(String::new())
}
