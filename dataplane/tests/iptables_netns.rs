//! The iptables table backend against the real tools, nft and legacy, each
//! in a network namespace this test creates (and removes, also on failure;
//! the tools run under `ip netns exec`). Needs root.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

mod common;

use anyhow::Result;
use common::{Netns, privileged};
use dphandler_dataplane::backends::iptables::restore::{Flavor, IptablesTool};
use dphandler_dataplane::backends::iptables::{InsertMode, IptablesExec, Table};
use dphandler_dataplane::backends::{Backend, BackendError, Phase, Refresh};
use dphandler_dataplane::generictables::{Ownership, Rule};
use dphandler_dataplane::model::IpVersion;

/// Counts restores, so a test can tell that nothing was written.
#[derive(Debug)]
struct Counting(IptablesTool, Arc<AtomicUsize>);

impl IptablesExec for Counting {
    fn save(&mut self, table: &str) -> Result<String, BackendError> {
        self.0.save(table)
    }
    fn restore(&mut self, input: &str) -> Result<(), BackendError> {
        self.1.fetch_add(1, Ordering::Relaxed);
        self.0.restore(input)
    }
}

fn table(ns: &Netns, flavor: Flavor) -> (Table, Arc<AtomicUsize>) {
    let n = Arc::new(AtomicUsize::new(0));
    let tool = IptablesTool::new(
        flavor,
        IpVersion::V4,
        vec!["ip".into(), "netns".into(), "exec".into(), ns.0.clone()],
    );
    let t = Table::new(
        "filter",
        IpVersion::V4,
        Ownership::new("dph"),
        InsertMode::Insert,
        Box::new(Counting(tool, n.clone())),
    );
    (t, n)
}

fn r(s: &str) -> Rule {
    Rule::parse(s).unwrap()
}

/// `iptables-save` without the comment lines and counters.
fn save(ns: &Netns, flavor: Flavor) -> Result<Vec<String>> {
    let tool = match flavor {
        Flavor::Nft => "iptables-nft-save",
        Flavor::Legacy => "iptables-legacy-save",
    };
    Ok(ns
        .exec(&[tool, "-t", "filter"])?
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match l.strip_prefix(':') {
            // ":CHAIN POLICY [p:b]": drop the counters.
            Some(rest) => format!(":{}", rest.rsplit_once(' ').map_or(rest, |x| x.0)),
            None => l.to_string(),
        })
        .collect())
}

fn foreign(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter(|l| !l.contains("dph"))
        .cloned()
        .collect()
}

fn apply(t: &mut Table) -> Result<()> {
    t.apply(Phase::Tables)?;
    Ok(())
}

fn lifecycle(flavor: Flavor) -> Result<()> {
    let tag = match flavor {
        Flavor::Nft => "iptn",
        Flavor::Legacy => "iptl",
    };
    let ns = Netns::new(tag)?;
    let ipt = match flavor {
        Flavor::Nft => "iptables-nft",
        Flavor::Legacy => "iptables-legacy",
    };
    // Another agent's state, planted before we start.
    ns.exec(&[ipt, "-w", "-N", "KUBE-FOO"])?;
    ns.exec(&[
        ipt,
        "-w",
        "-A",
        "KUBE-FOO",
        "-s",
        "10.8.0.0/16",
        "-j",
        "RETURN",
    ])?;
    ns.exec(&[ipt, "-w", "-A", "INPUT", "-s", "10.9.9.9", "-j", "ACCEPT"])?;
    ns.exec(&[
        ipt,
        "-w",
        "-A",
        "FORWARD",
        "-m",
        "comment",
        "--comment",
        "kube thing",
        "-j",
        "KUBE-FOO",
    ])?;
    ns.exec(&[
        ipt, "-w", "-A", "OUTPUT", "-p", "udp", "--dport", "53", "-j", "ACCEPT",
    ])?;
    let planted = foreign(&save(&ns, flavor)?);

    let (mut t, writes) = table(&ns, flavor);
    t.set_chain(
        "dph-INPUT",
        vec![r("-j dph-wl"), r("-p tcp --dport 22 -j ACCEPT")],
    )?;
    t.set_chain("dph-wl", vec![r("-s 10.0.0.1/32 -j ACCEPT")])?;
    t.set_chain("dph-FORWARD", vec![r("-j RETURN")])?;
    t.set_chain("dph-unused", vec![r("-j DROP")])?;
    t.set_hooks("INPUT", vec![r("-j dph-INPUT")])?;
    t.set_hooks("FORWARD", vec![r("-j dph-FORWARD")])?;
    apply(&mut t)?;
    let s = save(&ns, flavor)?;
    let input: Vec<&String> = s.iter().filter(|l| l.starts_with("-A INPUT")).collect();
    assert_eq!(input.len(), 2, "{s:#?}");
    assert!(
        input[0].contains("dph:") && input[0].ends_with("-j dph-INPUT"),
        "ours on top: {s:#?}"
    );
    assert!(s.iter().any(|l| l == ":dph-wl -"), "{s:#?}");
    assert!(
        !s.iter().any(|l| l.contains("dph-unused")),
        "unreferenced chains are not programmed"
    );

    // Many applies: edits, growth, shrinking, a chain dropped.
    for i in 0..10 {
        let rules: Vec<Rule> = (0..=i)
            .map(|k| r(&format!("-s 10.0.{k}.{i}/32 -j ACCEPT")))
            .collect();
        t.set_chain("dph-wl", rules)?;
        apply(&mut t)?;
    }
    t.set_hooks("FORWARD", vec![])?;
    apply(&mut t)?;
    let s = save(&ns, flavor)?;
    assert_eq!(s.iter().filter(|l| l.starts_with("-A dph-wl")).count(), 10);
    assert!(
        !s.iter().any(|l| l.contains("dph-FORWARD")),
        "unhooked chain deleted: {s:#?}"
    );
    assert_eq!(foreign(&s), planted, "foreign chains and rules changed");

    // A restart: a new object with the same desired state writes nothing.
    let before = save(&ns, flavor)?;
    let (mut t2, writes2) = table(&ns, flavor);
    t2.set_chain(
        "dph-INPUT",
        vec![r("-j dph-wl"), r("-p tcp --dport 22 -j ACCEPT")],
    )?;
    let rules: Vec<Rule> = (0..10)
        .map(|k| r(&format!("-s 10.0.{k}.9/32 -j ACCEPT")))
        .collect();
    t2.set_chain("dph-wl", rules)?;
    t2.set_hooks("INPUT", vec![r("-j dph-INPUT")])?;
    apply(&mut t2)?;
    assert_eq!(
        writes2.load(Ordering::Relaxed),
        0,
        "adopted without a write"
    );
    assert_eq!(save(&ns, flavor)?, before);

    // Tampering: our hook and one of our rules deleted by hand; the refresh
    // puts them back, foreign state still untouched.
    let hook = before
        .iter()
        .find(|l| l.starts_with("-A INPUT") && l.contains("dph:"))
        .unwrap();
    let spec: Vec<&str> = hook["-A INPUT ".len()..]
        .split(' ')
        .map(|w| w.trim_matches('"'))
        .collect();
    let mut del = vec![ipt, "-w", "-D", "INPUT"];
    del.extend(spec.iter());
    ns.exec(&del)?;
    ns.exec(&[ipt, "-w", "-D", "dph-wl", "3"])?;
    assert_ne!(save(&ns, flavor)?, before);
    t2.request_resync(Refresh::Iptables);
    apply(&mut t2)?;
    assert_eq!(save(&ns, flavor)?, before, "repaired");
    assert_eq!(foreign(&save(&ns, flavor)?), planted);
    assert!(writes.load(Ordering::Relaxed) >= 12);
    Ok(())
}

#[test]
fn tables_on_iptables_nft() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    lifecycle(Flavor::Nft)
}

#[test]
fn tables_on_iptables_legacy() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    lifecycle(Flavor::Legacy)
}

#[test]
fn detection_follows_the_rules_already_there() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    use dphandler_dataplane::backends::iptables::restore::detect;
    let ns = Netns::new("iptdet")?;
    let w: Vec<String> = vec!["ip".into(), "netns".into(), "exec".into(), ns.0.clone()];
    assert_eq!(detect(&w), Flavor::Nft, "nothing anywhere: nft");
    for i in 0..3 {
        ns.exec(&[
            "iptables-legacy",
            "-w",
            "-A",
            "INPUT",
            "-s",
            &format!("10.0.0.{i}"),
            "-j",
            "ACCEPT",
        ])?;
    }
    assert_eq!(detect(&w), Flavor::Legacy, "legacy holds the rules");
    Ok(())
}

/// Every form the rule renderer produces is accepted by the real
/// iptables-restore (v4 and v6, nft), with the IP sets it names in place.
#[test]
fn rendered_rules_load_into_the_kernel() -> Result<()> {
    use dphandler_dataplane::model::Marks;
    use dphandler_dataplane::model::ipsets::SetNames;
    use dphandler_dataplane::model::{Action, IcmpMatch, Id, PortRange, Protocol, Rule as M};
    use dphandler_dataplane::rules::Renderer;
    if !privileged() {
        return Ok(());
    }
    let ns = Netns::new("iptrules")?;
    for (name, ty, fam) in [
        ("dph40s:a", "hash:ip", "inet"),
        ("dph40n:p", "hash:ip,port", "inet"),
        ("dph60s:a", "hash:ip", "inet6"),
        ("dph60n:p", "hash:ip,port", "inet6"),
    ] {
        ns.exec(&["ipset", "create", name, ty, "family", fam])?;
    }
    let id = |s: &str| Id::new(s).unwrap();
    let pr = |a: u16, b: u16| PortRange { first: a, last: b };
    let many: Vec<PortRange> = (0..10).map(|i| pr(1000 + i * 10, 1005 + i * 10)).collect();
    let rules = vec![
        M {
            protocol: Some(Protocol::TCP),
            src_ip_set_ids: vec![id("s:a")],
            dst_ports: vec![pr(80, 80), pr(8000, 8100)],
            ..M::default()
        },
        M {
            action: Some(Action::Deny),
            src_net: vec![
                "10.0.0.0/8".parse()?,
                "192.168.0.0/16".parse()?,
                "fd00::/8".parse()?,
                "fd01::/16".parse()?,
            ],
            dst_net: vec!["10.9.0.0/16".parse()?, "fd09::/16".parse()?],
            ..M::default()
        },
        M {
            protocol: Some(Protocol::UDP),
            dst_ports: many,
            dst_named_port_ip_set_ids: vec![id("n:p")],
            src_named_port_ip_set_ids: vec![id("n:p")],
            ..M::default()
        },
        M {
            action: Some(Action::Pass),
            protocol: Some(Protocol::ICMP),
            icmp: Some(IcmpMatch {
                icmp_type: 8,
                code: Some(0),
            }),
            not_src_net: vec!["10.1.0.0/16".parse()?],
            not_dst_ip_set_ids: vec![id("s:a")],
            ..M::default()
        },
        M {
            action: Some(Action::Log),
            protocol: Some(Protocol::ICMPV6),
            not_icmp: Some(IcmpMatch {
                icmp_type: 128,
                code: None,
            }),
            ..M::default()
        },
        M {
            action: Some(Action::Deny),
            protocol: Some(Protocol::TCP),
            not_protocol: Some(Protocol::UDP),
            not_dst_ports: vec![pr(22, 22), pr(80, 90)],
            dst_ip_port_set_ids: vec![id("n:p")],
            not_src_named_port_ip_set_ids: vec![id("n:p")],
            ..M::default()
        },
        M {
            protocol: Some(Protocol(47)),
            ..M::default()
        },
    ];
    for v in [IpVersion::V4, IpVersion::V6] {
        let r = Renderer {
            sets: SetNames::new("dph")?,
            marks: Marks::default(),
            version: v,
            log_prefix: "dph-policy".into(),
            known_sets: None,
        };
        let rendered = r.rules(&rules)?;
        assert!(rendered.len() >= 10, "{v:?}: {}", rendered.len());
        let tool = IptablesTool::new(
            Flavor::Nft,
            v,
            vec!["ip".into(), "netns".into(), "exec".into(), ns.0.clone()],
        );
        let mut t = Table::new(
            "filter",
            v,
            Ownership::new("dph"),
            InsertMode::Insert,
            Box::new(tool),
        );
        t.set_chain("dph-pi-test", rendered.clone())?;
        t.set_hooks("INPUT", vec![Rule::parse("-j dph-pi-test")?])?;
        t.apply(Phase::Tables)
            .map_err(|e| anyhow::anyhow!("{v:?}: iptables refused a rendered rule: {e}"))?;
        let save = match v {
            IpVersion::V4 => "iptables-nft-save",
            IpVersion::V6 => "ip6tables-nft-save",
        };
        let n = ns
            .exec(&[save, "-t", "filter"])?
            .lines()
            .filter(|l| l.starts_with("-A dph-pi-test"))
            .count();
        assert_eq!(n, rendered.len(), "{v:?}");
    }
    Ok(())
}
