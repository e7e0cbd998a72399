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

/// The chain workload `iface`'s traffic goes to in filter, `kind` `tw`
/// (to it) or `fw` (from it): `dph-<kind>-<iface>` with iptables (and
/// nftables unsharded); sharded, the policy list chain its shard's
/// dispatch map names for it.
pub fn endpoint_chain(ns: &Netns, v6: bool, kind: &str, iface: &str) -> Result<String> {
    let own = format!("dph-{kind}-{iface}");
    if !nftables() {
        return Ok(own);
    }
    let text = our_rules(ns, v6, "filter")?;
    let quoted = format!("\"{iface}\"");
    let goto = format!("goto dph-{kind}-");
    text.split(['\n', ',', '{', '}'])
        .filter(|e| e.contains(&quoted))
        .filter_map(|e| {
            let at = e.find(&goto)? + "goto ".len();
            e[at..].split_whitespace().next()
        })
        // Filter's own dispatch marks the packet for the shards.
        .find(|c| !c.contains("pending"))
        .map_or(Ok(own), |c| Ok(c.to_string()))
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
/// the set's block of `nft list table` in whichever of our tables holds
/// it: `nft list set` cannot name a set with a colon, as ours have); ""
/// when it is nowhere.
pub fn our_set(ns: &Netns, v6: bool, name: &str) -> Result<String> {
    if !nftables() {
        let out = ns.run("ipset", &["list", name])?;
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    Ok(nft_sets(ns, v6, name)?
        .into_iter()
        .next()
        .map(|(_, block)| block)
        .unwrap_or_default())
}

/// Every copy of our IP set `name`: the ipset (iptables), or the set in
/// each of our nftables tables that holds one (the shards keep copies).
pub fn our_set_copies(ns: &Netns, v6: bool, name: &str) -> Result<Vec<String>> {
    if !nftables() {
        return Ok(vec![our_set(ns, v6, name)?]);
    }
    Ok(nft_sets(ns, v6, name)?
        .into_iter()
        .map(|(_, block)| block)
        .collect())
}

/// The nftables daemon's name of the set that the iptables one names
/// `name` (`dph40<id>`): an id nft's identifiers do not take (`s:…`) is
/// named by its hash there.
fn nft_set_name(name: &str) -> Result<String> {
    use dphandler_dataplane::model::ipsets::SetNames;
    use dphandler_dataplane::model::{Id, IpVersion};
    let (v, id) = match (name.strip_prefix("dph40"), name.strip_prefix("dph60")) {
        (Some(id), _) => (IpVersion::V4, id),
        (_, Some(id)) => (IpVersion::V6, id),
        _ => return Ok(name.to_string()),
    };
    let names = SetNames::new("dph").map_err(|e| anyhow::anyhow!("{e}"))?;
    let id = Id::new(id).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(names.for_nftables().name(v, &id))
}

/// Each of our nftables tables that holds set `name` (its iptables
/// name), with the set's block of its listing.
fn nft_sets(ns: &Netns, v6: bool, name: &str) -> Result<Vec<(String, String)>> {
    let head = format!("\tset {} {{", nft_set_name(name)?);
    let mut found = Vec::new();
    for table in TABLES {
        for t in nft_tables(ns, v6, table)? {
            let out = ns
                .command("nft")
                .args(["list", "table", family(v6), &t])
                .output()?;
            let text = String::from_utf8_lossy(&out.stdout);
            if let Some(at) = text.find(&head) {
                let block = &text[at..];
                let end = block.find("\n\t}").map_or(block.len(), |e| e + 3);
                found.push((t, block[..end].to_string()));
            }
        }
    }
    Ok(found)
}

/// Flushes our chain `chain` of `table` by hand, as an operator could:
/// `iptables -F`, or `nft flush chain` in the table that holds it.
pub fn flush_our_chain(ns: &Netns, v6: bool, table: &str, chain: &str) -> Result<()> {
    if !nftables() {
        let tool = if v6 { "ip6tables" } else { "iptables" };
        ns.run(tool, &["-t", table, "-F", chain])?;
        return Ok(());
    }
    for t in nft_tables(ns, v6, table)? {
        let held = ns
            .command("nft")
            .args(["list", "chain", family(v6), &t, chain])
            .output()?
            .status
            .success();
        if held {
            ns.run("nft", &["flush", "chain", family(v6), &t, chain])?;
            return Ok(());
        }
    }
    anyhow::bail!("no chain {chain} in our {table} tables")
}

/// Empties our set `name` (its iptables name) by hand: `ipset flush`, or
/// `nft flush set` of every copy in our nftables tables.
pub fn flush_our_set(ns: &Netns, v6: bool, name: &str) -> Result<()> {
    if !nftables() {
        ns.run("ipset", &["flush", name])?;
        return Ok(());
    }
    let held = nft_sets(ns, v6, name)?;
    anyhow::ensure!(
        !held.is_empty(),
        "no set {name} in our tables: {}",
        String::from_utf8_lossy(&ns.run("nft", &["list", "ruleset"])?.stdout)
    );
    let name = nft_set_name(name)?;
    for (t, _) in held {
        ns.run("nft", &["flush", "set", family(v6), &t, &name])?;
    }
    Ok(())
}

/// `text` with nft's counter values taken out (`counter packets 3 bytes
/// 180` → `counter`), to compare a listing while traffic flows.
pub fn without_counters(text: &str) -> String {
    text.lines()
        .map(|line| {
            let mut out = Vec::new();
            let mut words = line.split(' ').peekable();
            while let Some(w) = words.next() {
                out.push(w);
                if w.trim_start() == "counter" && words.peek() == Some(&"packets") {
                    // packets N bytes M
                    for _ in 0..4 {
                        words.next();
                    }
                }
            }
            out.join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every rule of ours in the IPv4 tables (iptables or nftables, as the
/// daemons under test program).
pub fn all_our_rules(host: &Netns) -> Result<String> {
    let mut text = String::new();
    for table in ["raw", "mangle", "nat", "filter"] {
        text.push_str(&our_rules(host, false, table)?);
        text.push('\n');
    }
    Ok(text)
}

/// Reads our IPv4 filter rules every 20 ms in a thread: how many reads
/// found fewer than `baseline` rules (the count with everything in
/// place) or lacked one of `ifaces`.
#[derive(Debug)]
pub struct RuleWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<(u64, u64, String)>>,
}

impl RuleWatch {
    pub fn start(host: &Netns, baseline: usize, ifaces: &[&str]) -> Self {
        use std::sync::atomic::Ordering;
        let host = Netns(host.0.clone());
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let ifaces: Vec<String> = ifaces.iter().map(|s| s.to_string()).collect();
        let thread = std::thread::spawn(move || {
            let (mut missing, mut samples, mut first_bad) = (0u64, 0u64, String::new());
            while !flag.load(Ordering::Relaxed) {
                let read = our_rules(&host, false, "filter")
                    .and_then(|r| Ok((our_rule_count(&host, false, "filter")?, r)));
                if let Ok((count, r)) = read {
                    samples += 1;
                    let whole = count >= baseline && ifaces.iter().all(|i| r.contains(i.as_str()));
                    if !whole {
                        missing += 1;
                        if first_bad.is_empty() {
                            first_bad = format!("{count} rules of {baseline}:\n{r}");
                        }
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            // The Netns is the test's: not removed here.
            std::mem::forget(host);
            (missing, samples, first_bad)
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    /// (incomplete reads, reads, the first incomplete one).
    pub fn finish(mut self) -> (u64, u64, String) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}
