//! The nftables dataplane backend against the kernel, in a network
//! namespace of the test's own: the managers' chains and sets programmed
//! in one commit; a second daemon adopting them without a write; a set
//! member as a data-only change; tampering put back on refresh; our
//! tables gone when nothing is wanted; another agent's nftables table and
//! iptables-nft rules untouched throughout. Needs root.

use std::collections::HashSet;

mod common;

use anyhow::{Context, Result, ensure};
use common::{Netns, privileged};
use dphandler_dataplane::backends::ipsets::Meta;
use dphandler_dataplane::backends::nftables::Dataplane;
use dphandler_dataplane::backends::{Backend, Phase, Refresh};
use dphandler_dataplane::generictables::Rule;
use dphandler_dataplane::model::IpVersion;
use dphandler_dataplane::model::ipsets::{IpSetType, Member, SetNames};

fn r(s: &str) -> Rule {
    Rule::parse(s).unwrap()
}

fn ip(s: &str) -> Member {
    Member::Ip(s.parse().unwrap())
}

/// The managers' side: a filter chain that looks up a set and a port
/// list, and a nat chain that masquerades.
fn want(d: &mut Dataplane) {
    d.set_store_mut().replace(
        "dph40blocked".into(),
        Meta {
            set_type: IpSetType::Ip,
            maxelem: 1000,
        },
        HashSet::from([ip("10.0.0.1")]),
    );
    d.set_store_mut().replace(
        "dph40pools".into(),
        Meta {
            set_type: IpSetType::Net,
            maxelem: 1000,
        },
        HashSet::from([
            Member::Net("10.65.0.0/16".parse().unwrap()),
            Member::Net("10.65.1.0/24".parse().unwrap()),
        ]),
    );
    for t in d.rule_tables_mut() {
        match t.table() {
            "filter" => {
                t.set_chain(
                    "dph-fw",
                    vec![
                        r("-m set --match-set dph40blocked src -j DROP"),
                        r("-p tcp -m multiport --destination-ports 80,443,8000:8080 -j ACCEPT"),
                        r("-m conntrack --ctstate INVALID -j DROP"),
                        r("-p udp -m addrtype ! --dst-type UNICAST -j RETURN"),
                    ],
                )
                .unwrap();
                t.set_hooks("FORWARD", vec![r("-i cali+ -j dph-fw")])
                    .unwrap();
            }
            "nat" => {
                t.set_chain(
                    "dph-nat-outgoing",
                    vec![r(
                        "-m set --match-set dph40pools src -m set ! --match-set dph40pools dst -j MASQUERADE",
                    )],
                )
                .unwrap();
                t.set_hooks("POSTROUTING", vec![r("-j dph-nat-outgoing")])
                    .unwrap();
            }
            _ => {}
        }
    }
}

fn open(ns: &Netns) -> Result<Dataplane> {
    Ok(ns.within(|| {
        Dataplane::open(
            IpVersion::V4,
            "dph",
            SetNames::new("dph").unwrap(),
            Default::default(),
        )
    })?)
}

fn apply(d: &mut Dataplane) -> Result<()> {
    ensure!(d.is_dirty(Phase::Tables), "nothing to apply");
    d.apply(Phase::Tables)?;
    Ok(())
}

#[test]
fn chains_and_sets_are_programmed_adopted_repaired_and_removed() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let ns = Netns::new("nftdp")?;
    let nft = |args: &[&str]| ns.exec(&[&["nft"][..], args].concat());
    // Another agent's table and iptables-nft rules, which must stay.
    nft(&["add", "table", "ip", "kube-proxy"])?;
    nft(&["add", "chain", "ip", "kube-proxy", "services"])?;
    ns.exec(&[
        "iptables-nft",
        "-A",
        "FORWARD",
        "-s",
        "192.0.2.9",
        "-j",
        "DROP",
    ])?;
    let foreign = || -> Result<(String, String)> {
        Ok((
            nft(&["list", "table", "ip", "kube-proxy"])?,
            ns.exec(&["iptables-nft-save", "-t", "filter"])?
                .lines()
                .filter(|l| !l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n"),
        ))
    };
    let before = foreign()?;

    let mut d = open(&ns)?;
    want(&mut d);
    apply(&mut d)?;
    ensure!(d.commits() == 1, "one commit for everything");
    let filter = nft(&["list", "table", "ip", "dph-filter"])?;
    for want in [
        "type filter hook forward priority filter; policy accept;",
        "iifname \"cali*\" counter packets 0 bytes 0 jump dph-fw",
        "ip saddr @dph40blocked counter packets 0 bytes 0 drop",
        "tcp dport @ports-",
        "ct state invalid counter packets 0 bytes 0 drop",
        "fib daddr type != unicast counter packets 0 bytes 0 return",
        "comment \"dph:",
    ] {
        ensure!(filter.contains(want), "{want:?} not in\n{filter}");
    }
    let nat = nft(&["list", "table", "ip", "dph-nat"])?;
    ensure!(
        nat.contains("type nat hook postrouting priority srcnat")
            && nat.contains(
                "ip saddr @dph40pools ip daddr != @dph40pools counter packets 0 bytes 0 masquerade"
            )
            && nat.contains("10.65.0.0/16"),
        "{nat}"
    );
    let ports = nft(&["-j", "list", "sets", "ip"])?;
    ensure!(ports.contains("ports-"), "the port list is a set: {ports}");

    // A second daemon with the same wishes adopts all of it: no write.
    let mut again = open(&ns)?;
    want(&mut again);
    again.apply(Phase::Tables)?;
    ensure!(
        again.commits() == 0,
        "a restart writes nothing that is right"
    );
    drop(again);

    // A member is one element.
    d.set_store_mut().delta(
        "dph40blocked",
        &mut [ip("10.0.0.2")].into_iter(),
        &mut [ip("10.0.0.1")].into_iter(),
    );
    apply(&mut d)?;
    let set = nft(&["list", "set", "ip", "dph-filter", "dph40blocked"])?;
    ensure!(
        set.contains("10.0.0.2") && !set.contains("10.0.0.1"),
        "{set}"
    );

    // Tampering: our chain flushed and a rule put in our table by hand.
    nft(&["flush", "chain", "ip", "dph-filter", "dph-fw"])?;
    nft(&["add", "rule", "ip", "dph-filter", "FORWARD", "accept"])?;
    nft(&[
        "delete",
        "element",
        "ip",
        "dph-filter",
        "dph40blocked",
        "{ 10.0.0.2 }",
    ])?;
    // A port put into our port list, and our POSTROUTING hook made again
    // at another priority.
    let ports = nft(&["list", "table", "ip", "dph-filter"])?
        .lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("set ")
                .and_then(|r| r.strip_suffix(" {"))
        })
        .find(|n| n.starts_with("ports-"))
        .map(str::to_owned)
        .context("our port list")?;
    nft(&["add", "element", "ip", "dph-filter", &ports, "{ 22 }"])?;
    nft(&["flush", "chain", "ip", "dph-nat", "POSTROUTING"])?;
    nft(&["delete", "chain", "ip", "dph-nat", "POSTROUTING"])?;
    nft(&[
        "add",
        "chain",
        "ip",
        "dph-nat",
        "POSTROUTING",
        "{ type nat hook postrouting priority 50 ; }",
    ])?;
    ensure!(!d.is_dirty(Phase::Tables), "nothing changed on our side");
    d.request_resync(Refresh::Iptables);
    apply(&mut d)?;
    // The read runs on its own thread (its own socket, opened in the
    // namespace with the first); the repair comes with the apply after it.
    // Each table is taken in as it is read.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while d.reading() {
        ensure!(
            std::time::Instant::now() < until,
            "the refresh read never finished"
        );
        if d.is_dirty(Phase::Tables) {
            apply(&mut d)?;
        } else {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    let repaired = nft(&["list", "table", "ip", "dph-filter"])?;
    ensure!(
        repaired.contains("ip saddr @dph40blocked counter packets 0 bytes 0 drop")
            && !repaired.contains("\n\t\taccept\n")
            && repaired.contains("10.0.0.2"),
        "{repaired}"
    );
    let port_list = nft(&["list", "set", "ip", "dph-filter", &ports])?;
    ensure!(
        port_list.contains("80, 443, 8000-8080") && !port_list.contains(" 22"),
        "the port put there by hand is gone: {port_list}"
    );
    let hook = nft(&["list", "chain", "ip", "dph-nat", "POSTROUTING"])?;
    ensure!(
        hook.contains("priority srcnat;") && hook.contains("jump dph-nat-outgoing"),
        "the hook is back at its priority with its rule: {hook}"
    );

    // Every set is in the filter table, used or not.
    d.set_store_mut().replace(
        "dph40unused".into(),
        Meta {
            set_type: IpSetType::Ip,
            maxelem: 1000,
        },
        HashSet::from([ip("10.9.9.9")]),
    );
    apply(&mut d)?;
    let unused = nft(&["list", "set", "ip", "dph-filter", "dph40unused"])?;
    ensure!(unused.contains("10.9.9.9"), "{unused}");
    ensure!(
        !nft(&["list", "table", "ip", "dph-nat"])?.contains("dph40blocked"),
        "the nat table holds only the sets its rules use"
    );

    // Nothing wanted: our tables go, nothing else does.
    for s in ["dph40blocked", "dph40pools", "dph40unused"] {
        d.set_store_mut().remove(s);
    }
    for t in d.rule_tables_mut() {
        for h in ["FORWARD", "POSTROUTING"] {
            let _ = t.set_hooks(h, Vec::new());
        }
        t.remove_chain("dph-fw");
        t.remove_chain("dph-nat-outgoing");
    }
    apply(&mut d)?;
    let tables = nft(&["list", "tables"])?;
    ensure!(!tables.contains("dph-"), "{tables}");
    ensure!(
        foreign()? == before,
        "the foreign table and iptables rules changed"
    );
    Ok(())
}

/// A refresh while members are written without a pause (each commit
/// touches filter's set): both tables are read beside the commits and
/// what was changed in them by hand put back, filter's set taken as the
/// commits wrote it. Nothing is read in the apply but the first read.
#[test]
fn a_refresh_under_churn_repairs_without_reading_in_the_apply() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let ns = Netns::new("nftchurn")?;
    let nft = |args: &[&str]| ns.exec(&[&["nft"][..], args].concat());
    let mut d = open(&ns)?;
    want(&mut d);
    apply(&mut d)?;
    ensure!(d.reads_in_apply() == 1, "the first read");
    // Enough members that filter's read takes a while (~0.2 s).
    let many = (0..30_000u32).map(|i| Member::Ip(std::net::Ipv4Addr::from(0x0a64_0000 + i).into()));
    d.set_store_mut().delta(
        "dph40blocked",
        &mut many.into_iter(),
        &mut std::iter::empty(),
    );
    apply(&mut d)?;
    std::thread::sleep(std::time::Duration::from_secs(1)); // the set's table grown
    nft(&["flush", "chain", "ip", "dph-nat", "dph-nat-outgoing"])?;
    nft(&["flush", "chain", "ip", "dph-filter", "dph-fw"])?;
    d.request_resync(Refresh::Iptables);
    let (mut n, mut slowest) = (0u32, std::time::Duration::ZERO);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while d.reading() || n == 0 {
        ensure!(
            std::time::Instant::now() < until,
            "the refresh read never finished"
        );
        n += 1;
        let member = ip(&format!("10.1.{}.{}", n / 250, n % 250));
        d.set_store_mut().delta(
            "dph40blocked",
            &mut std::iter::once(member),
            &mut std::iter::empty(),
        );
        let started = std::time::Instant::now();
        apply(&mut d)?;
        slowest = slowest.max(started.elapsed());
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let nat = nft(&["list", "chain", "ip", "dph-nat", "dph-nat-outgoing"])?;
    ensure!(nat.contains("masquerade"), "nat put back: {nat}");
    let fw = nft(&["list", "chain", "ip", "dph-filter", "dph-fw"])?;
    ensure!(fw.contains("@dph40blocked"), "filter put back: {fw}");
    ensure!(
        d.reads_in_apply() == 1,
        "no read in the apply ({} reads)",
        d.reads_in_apply()
    );
    eprintln!("{n} members written during the refresh; slowest apply {slowest:?}");
    let set = nft(&["list", "set", "ip", "dph-filter", "dph40blocked"])?;
    ensure!(
        set.contains("10.1.0.1,") || set.contains("10.1.0.1 "),
        "{set}"
    );
    Ok(())
}
