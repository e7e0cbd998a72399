//! The shard layout, on its own (no kernel).

use super::*;

fn r(s: &str) -> Rule {
    Rule::parse(s).unwrap()
}

fn filter(n: usize) -> Filter {
    layered(n, 0)
}

/// Up to `n` shards, one more opened each `per_shard` interfaces.
fn layered(n: usize, per_shard: usize) -> Filter {
    Filter::new(
        IpVersion::V4,
        Ownership::new("dph"),
        ShardLayout {
            marks: Marks::default(),
            shards: n,
            per_shard,
        },
    )
}

/// The policy list chain `iface`'s ingress dispatch goes to, as
/// filter's shard holds it.
fn ingress<'a>(f: &'a Filter, iface: &str) -> (&'a str, &'a super::super::chains::DesiredChain) {
    let s = f.placement()[iface];
    let list = f.layout.as_ref().unwrap().members[s][Dir::To as usize][iface]
        .target()
        .expect("a goto");
    (list, f.shards[s].desired(list).expect("in its shard"))
}

/// Sets what the endpoints manager would for workloads `ifaces`, each
/// with ingress policy `pol-<i>` looking up set `s<i % sets>`.
fn workloads(f: &mut Filter, ifaces: &[&str], sets: usize) {
    let mut from = Vec::new();
    let mut to = Vec::new();
    for (i, iface) in ifaces.iter().enumerate() {
        let pol = format!("dph-pi-pol-{i}");
        f.set_chain(
            &pol,
            vec![r(&format!(
                "-m set --match-set dph-s{} src -j MARK --set-xmark 0x10000/0x10000",
                i % sets
            ))],
        )
        .unwrap();
        f.set_chain(
            &format!("dph-tw-{iface}"),
            vec![
                r("-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"),
                r(&format!("-j {pol}")),
                r("-j DROP"),
            ],
        )
        .unwrap();
        f.set_chain(&format!("dph-fw-{iface}"), vec![r("-j DROP")])
            .unwrap();
        from.push(r(&format!("-i {iface} -g dph-fw-{iface}")));
        to.push(r(&format!("-o {iface} -g dph-tw-{iface}")));
    }
    from.push(r("-j DROP"));
    to.push(r("-j DROP"));
    f.set_chain("dph-from-wl-dispatch", from).unwrap();
    f.set_chain("dph-to-wl-dispatch", to).unwrap();
    f.set_hooks(
        "FORWARD",
        vec![
            r("-i cali+ -j dph-from-wl-dispatch"),
            r("-o cali+ -j dph-to-wl-dispatch"),
        ],
    )
    .unwrap();
}

/// Four shards after a settle of workloads `cali0`… `cali<n-1>` (see
/// [`workloads`]); their names.
fn settled(n: usize, sets: usize) -> (Filter, Vec<String>) {
    let mut f = filter(4);
    let ifaces: Vec<String> = (0..n).map(|i| format!("cali{i}")).collect();
    let names: Vec<&str> = ifaces.iter().map(String::as_str).collect();
    workloads(&mut f, &names, sets);
    f.settle().unwrap();
    (f, ifaces)
}

/// Endpoint chains go to shards with copies of what they jump to;
/// filter's dispatch goes to the pending chains; each shard hooks
/// prerouting (egress) and forward (ingress) behind a bit and dispatches
/// by map.
#[test]
fn endpoint_chains_go_to_shards_with_copies_of_their_policies() {
    let (mut f, ifaces) = settled(40, 4);
    let names: Vec<&str> = ifaces.iter().map(String::as_str).collect();
    assert!(
        f.main.desired("dph-tw-cali1").is_none(),
        "endpoint chains leave filter"
    );
    let dispatch = &f.main.desired("dph-to-wl-dispatch").unwrap().rules;
    assert_eq!(
        dispatch.iter().map(Rule::text).collect::<Vec<_>>(),
        ["-g dph-tw-pending-in-shards"],
        "filter's dispatch marks every workload packet for the shards"
    );
    // The end check: an ingress pending bit no shard cleared is dropped,
    // established or not.
    let texts = |rules: &[Rule]| {
        rules
            .iter()
            .map(|r| r.text().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        texts(&f.main.hooks["FORWARD-END"].rules),
        ["-m mark --mark 0x800000/0x800000 -j DROP"]
    );
    assert!(!f.main.hooks.contains_key("INPUT-END"));
    // Egress: checked by a shard in prerouting; filter's dispatch lets
    // on what one checked, and drops the rest (an interface no shard
    // knows, fail closed).
    assert_eq!(
        texts(&f.main.desired("dph-fw-pending-in-shards").unwrap().rules),
        [
            "-j MARK --set-xmark 0x0/0x10000",
            "-m mark --mark 0x400000/0x400000 -j MARK --set-xmark 0x10000/0x10000"
        ]
    );
    assert_eq!(
        texts(&f.main.hooks["PREROUTING-FIRST"].rules),
        ["-j MARK --set-xmark 0x0/0xc00000"],
        "no INPUT chain yet: nothing is marked unchecked, so nothing passes"
    );
    let placed = f.placement();
    assert_eq!(placed.len(), 40);
    for (i, iface) in names.iter().enumerate() {
        let s = &f.shards[placed[*iface]];
        let (list, tw) = ingress(&f, iface);
        assert!(list.starts_with("dph-tw-list-"), "{list}");
        assert!(
            s.desired(&format!("dph-tw-{iface}")).is_none(),
            "one chain per policy list, not per interface"
        );
        assert_eq!(
            tw.rules[0].text(),
            "-j MARK --set-xmark 0x0/0x800000",
            "the ingress pending bit cleared first"
        );
        assert!(
            s.desired(&format!("dph-pi-pol-{i}")).is_some(),
            "its policy copied"
        );
        assert!(s.reachable().contains(format!("dph-pi-pol-{i}").as_str()));
    }
    // Same sets, same shard (the load allowing): 4 set groups over 4
    // shards put the 40 endpoints in at most 4 shards, each holding
    // the sets of one or two groups.
    let used: BTreeSet<usize> = placed.values().copied().collect();
    assert!(used.len() <= 4, "{placed:?}");
    for s in &used {
        let sh = &f.shards[*s];
        let hooks = &sh.hooks["FORWARD"].rules;
        assert_eq!(
            hooks.iter().map(Rule::text).collect::<Vec<_>>(),
            ["-m mark --mark 0x800000/0x800000 -j dph-to-wl-shard"]
        );
        assert_eq!(
            texts(&sh.hooks["PREROUTING"].rules),
            ["-m mark --mark 0x800000/0x800000 -j dph-from-wl-shard"],
            "egress unchecked"
        );
        assert!(
            !sh.hooks.contains_key("INPUT"),
            "egress is not checked twice"
        );
        let fw = sh
            .desired(
                f.layout.as_ref().unwrap().members[*s][Dir::From as usize]
                    .values()
                    .next()
                    .unwrap()
                    .target()
                    .unwrap(),
            )
            .unwrap();
        assert_eq!(
            fw.rules[0].text(),
            "-j MARK --set-xmark 0x400000/0xc00000",
            "egress checked, unchecked no more"
        );
        let d = sh.desired("dph-to-wl-shard").unwrap();
        assert!(d.translated[0].dispatch.is_some(), "a verdict map");
        assert_eq!(d.rules.last().unwrap().text(), "-j RETURN");
    }
    // Filter's forward hook clears the ingress bit before anything (and
    // keeps the egress one).
    let fwd = &f.main.hooks["FORWARD"].rules;
    assert_eq!(fwd[0].text(), "-j MARK --set-xmark 0x0/0x800000");
    assert_eq!(fwd[1].text(), "-i cali+ -j dph-from-wl-dispatch");
    assert_eq!(RuleTable::hooks(&f, "FORWARD").len(), 2);
    // A policy changed in filter is copied again where it is used.
    f.set_chain(
        "dph-pi-pol-3",
        vec![r("-m set --match-set dph-s3 src -j DROP")],
    )
    .unwrap();
    f.settle().unwrap();
    let s = &f.shards[placed["cali3"]];
    assert_eq!(
        s.desired("dph-pi-pol-3").unwrap().rules[0].text(),
        "-m set --match-set dph-s3 src -j DROP"
    );
    // Endpoints removed take their copies, dispatch entries and, last,
    // the shard's hooks with them.
    let shard3 = placed["cali3"];
    let here: Vec<&str> = names
        .iter()
        .copied()
        .filter(|i| placed[*i] == shard3)
        .collect();
    for i in &here {
        f.remove_chain(&format!("dph-tw-{i}"));
        f.remove_chain(&format!("dph-fw-{i}"));
    }
    f.settle().unwrap();
    let s = &f.shards[shard3];
    assert!(
        s.chains.is_empty(),
        "{:?}",
        s.chains.keys().collect::<Vec<_>>()
    );
    assert!(s.hooks.is_empty());
    assert!(!f.placement().contains_key(here[0]));
}

/// Filter's dispatch is one goto to the pending chain whatever tree the
/// managers set (kept for `chain`, not programmed), and an endpoint
/// coming or going leaves it alone. In the shard, an endpoint chain's
/// accept of an established flow is a return (the other direction's
/// chain runs too and clears its bit).
#[test]
fn filters_dispatch_is_one_goto_whatever_the_tree() {
    let mut f = filter(4);
    workloads(&mut f, &["cali0"], 1);
    let tree = vec![
        r("-o cali1+ -g dph-to-wl-dispatch-1"),
        r("-o cali0 -g dph-tw-cali0"),
        r("-j DROP"),
    ];
    f.set_chain("dph-to-wl-dispatch", tree.clone()).unwrap();
    f.set_chain(
        "dph-to-wl-dispatch-1",
        vec![r("-o cali1 -g dph-tw-cali1"), r("-j DROP")],
    )
    .unwrap();
    f.settle().unwrap();
    let root = f.main.desired("dph-to-wl-dispatch").unwrap().clone();
    assert_eq!(root.rules[0].text(), "-g dph-tw-pending-in-shards");
    assert!(f.main.desired("dph-to-wl-dispatch-1").is_none());
    assert_eq!(RuleTable::chain(&f, "dph-to-wl-dispatch"), Some(&tree[..]));
    workloads(&mut f, &["cali0", "cali1"], 1);
    f.settle().unwrap();
    assert_eq!(f.main.desired("dph-to-wl-dispatch"), Some(&root));
    let (_, tw) = ingress(&f, "cali1");
    assert_eq!(
        tw.rules[1].text(),
        "-m conntrack --ctstate RELATED,ESTABLISHED -j RETURN"
    );
}

/// A new interface does not go to a shard a quarter fuller than the
/// average; an interface stays where it was put.
#[test]
fn placement_is_balanced_and_sticky() {
    // One set for all: affinity alone would put all in one shard.
    let (mut f, _) = settled(200, 1);
    let l = f.layout.as_ref().unwrap();
    let max = *l.load.iter().max().unwrap();
    assert!(max <= 400 / 4 + 400 / 16 + 8 + 1, "{:?}", l.load);
    let before = f.placement();
    f.set_chain("dph-tw-cali7", vec![r("-j dph-pi-pol-9"), r("-j DROP")])
        .unwrap();
    f.settle().unwrap();
    assert_eq!(f.placement()["cali7"], before["cali7"]);
    let s = &f.shards[before["cali7"]];
    assert!(s.desired("dph-pi-pol-9").is_some());
    assert!(
        s.desired("dph-pi-pol-7").is_none()
            || placed_elsewhere_uses(&f, "dph-pi-pol-7", before["cali7"]),
        "the copy nothing in the shard jumps to any more is gone"
    );
}

/// With a fill per shard, a node's first workloads share one shard and
/// the next is opened only when the open ones are full: an empty shard
/// has no hooks, so a packet pays for the shards in use, not for all of
/// them. A snapshot opens as many as it needs at once; a shard whose
/// workloads all went loses its hooks.
#[test]
fn shards_open_as_workloads_come() {
    let hooked = |f: &Filter| -> Vec<usize> {
        (0..f.shards.len())
            .filter(|&s| {
                !f.shards[s].hooks("PREROUTING").is_empty()
                    || !f.shards[s].hooks("FORWARD").is_empty()
            })
            .collect()
    };
    let mut f = layered(8, 4);
    let ifaces: Vec<String> = (0..10).map(|i| format!("cali{i}")).collect();
    let names: Vec<&str> = ifaces.iter().map(String::as_str).collect();
    for k in 1..=10 {
        workloads(&mut f, &names[..k], 3);
        f.settle().unwrap();
        let used: BTreeSet<usize> = f.placement().values().copied().collect();
        let want = k.div_ceil(4);
        assert_eq!(used.len(), want, "{k} workloads: {:?}", f.placement());
        assert_eq!(hooked(&f).len(), want, "{k} workloads");
    }
    // The ones placed stay; removing the last shard's workloads leaves
    // it without hooks.
    let before = f.placement();
    let last = before["cali9"];
    let gone: Vec<&str> = names
        .iter()
        .copied()
        .filter(|i| before[*i] != last)
        .collect();
    for i in names.iter().filter(|i| before[**i] == last) {
        f.remove_chain(&format!("dph-tw-{i}"));
        f.remove_chain(&format!("dph-fw-{i}"));
    }
    workloads(&mut f, &gone, 3);
    f.settle().unwrap();
    assert!(!hooked(&f).contains(&last), "{:?}", hooked(&f));
    for i in &gone {
        assert_eq!(f.placement()[*i], before[*i]);
    }

    // A snapshot of 400 (at 25 a shard, 16 shards' worth) opens all 8
    // at once: placed exactly as with all open from the start.
    let ifaces: Vec<String> = (0..400).map(|i| format!("cali{i}")).collect();
    let names: Vec<&str> = ifaces.iter().map(String::as_str).collect();
    let [a, b] = [25, 0].map(|per_shard| {
        let mut f = layered(8, per_shard);
        workloads(&mut f, &names, 40);
        f.settle().unwrap();
        f
    });
    assert_eq!(a.placement(), b.placement());
    assert_eq!(hooked(&a), hooked(&b));
    assert!(
        hooked(&a).len() > 4,
        "{:?}",
        a.layout.as_ref().unwrap().load
    );
    // 40 (80 endpoint chains) fill two shards of 25; without a fill,
    // every shard is open from the first and they spread further.
    let [a, b] = [25, 0].map(|per_shard| {
        let mut f = layered(8, per_shard);
        workloads(&mut f, &names[..40], 40);
        f.settle().unwrap();
        hooked(&f).len()
    });
    assert_eq!(a, 2);
    assert!(b > 2, "{b}");
}

fn placed_elsewhere_uses(f: &Filter, chain: &str, s: usize) -> bool {
    f.shards[s]
        .chains
        .values()
        .any(|c| c.targets().any(|t| t == chain))
}

/// A restart takes the shards the kernel's tables show (where it put
/// the interfaces before), whatever it would choose now.
#[test]
fn placement_is_adopted_from_the_tables_read() {
    let mut observed = crate::backends::nftables::plan::Observed::new();
    let mut t = crate::backends::nftables::plan::ObservedTable::default();
    for c in ["dph-tw-cali1", "dph-fw-cali1", "dph-fw-pending-in-shards"] {
        t.chains.insert(c.to_string(), Default::default());
    }
    observed.insert("dph-filter-3".to_string(), t);
    let mut other = crate::backends::nftables::plan::ObservedTable::default();
    other
        .chains
        .insert("dph-tw-cali2".to_string(), Default::default());
    // A shard beyond those configured now: left to be emptied.
    observed.insert("dph-filter-9".to_string(), other);
    let mut f = filter(4);
    // A shard's dispatch map names cali5 (and cali1, placed already).
    let mut t5 = crate::backends::nftables::plan::ObservedTable::default();
    t5.sets.insert(
        "dispatch-in-0123".to_string(),
        crate::backends::nftables::ops::SetInfo {
            name: "dispatch-in-0123".to_string(),
            key_type: 41,
            key_len: 16,
            flags: 8,
        },
    );
    observed.insert("dph-filter-1".to_string(), t5);
    let contents: crate::backends::nftables::plan::Contents = [(
        ("dph-filter-1".to_string(), "dispatch-in-0123".to_string()),
        crate::backends::nftables::plan::Content::Keys(
            ["cali5"]
                .map(crate::backends::nftables::ops::Key::ifname)
                .into(),
        ),
    )]
    .into();
    f.adopt(&observed, Some(&contents), "dph-");
    workloads(&mut f, &["cali1", "cali2", "cali5"], 1);
    f.settle().unwrap();
    let placed = f.placement();
    assert_eq!(placed["cali1"], 3);
    assert_eq!(placed["cali5"], 1);
    assert!(placed["cali2"] < 4);
    let (list, _) = ingress(&f, "cali1");
    assert!(f.shards[3].desired(list).is_some());
}

/// Endpoints with the same policies share one policy list chain in a
/// shard; one whose policies change gets its own and leaves the
/// shared one to the others; the last to go takes the chain and the
/// copies only it jumped to.
#[test]
fn endpoints_with_the_same_policies_share_a_chain() {
    let mut f = filter(4);
    let same = |f: &mut Filter, iface: &str| {
        f.set_chain(
            &format!("dph-tw-{iface}"),
            vec![r("-j dph-pi-pol-0"), r("-j DROP")],
        )
        .unwrap();
    };
    workloads(&mut f, &["cali0"], 1);
    for i in ["cali0", "cali1", "cali2"] {
        same(&mut f, i);
    }
    f.settle().unwrap();
    let (shared, _) = ingress(&f, "cali0");
    let shared = shared.to_string();
    for i in ["cali1", "cali2"] {
        assert_eq!(ingress(&f, i).0, shared, "{i} shares cali0's chain");
    }
    let s = f.placement()["cali0"];
    let lists = |f: &Filter| {
        f.shards[s]
            .chains
            .keys()
            .filter(|c| c.starts_with("dph-tw-list-"))
            .count()
    };
    assert_eq!(lists(&f), 1);
    let d = &f.shards[s].desired("dph-to-wl-shard").unwrap();
    let entries = &d.translated[0].dispatch.as_ref().unwrap().entries;
    assert!(entries.iter().all(|(_, c)| *c == shared), "{entries:?}");
    // cali1 changes: a chain of its own; the others keep theirs.
    f.set_chain("dph-tw-cali1", vec![r("-j dph-pi-pol-0"), r("-j ACCEPT")])
        .unwrap();
    f.settle().unwrap();
    assert_ne!(ingress(&f, "cali1").0, shared);
    assert_eq!(ingress(&f, "cali2").0, shared);
    assert_eq!(lists(&f), 2);
    // cali0 and cali2 go: their chain goes with the last of them.
    for i in ["cali0", "cali2"] {
        f.remove_chain(&format!("dph-tw-{i}"));
        f.settle().unwrap();
        assert_eq!(f.shards[s].desired(&shared).is_some(), i == "cali0");
    }
    assert_eq!(lists(&f), 1);
    assert!(
        f.shards[s].desired("dph-pi-pol-0").is_some(),
        "cali1 uses it"
    );
    f.remove_chain("dph-tw-cali1");
    f.settle().unwrap();
    assert_eq!(lists(&f), 0);
    assert!(f.shards[s].desired("dph-pi-pol-0").is_none());
}

/// A new interface whose policy list chain a shard has already joins
/// it there (no chain more), even where its sets would send it elsewhere:
/// a replica whose twin was put in another shard (its own was full, or a
/// restart found it there).
#[test]
fn a_twin_joins_its_list_chain() {
    let mut f = filter(4);
    workloads(&mut f, &["cali0"], 1);
    let rules = |f: &Filter, dir: &str| f.chain(&format!("dph-{dir}-cali0")).unwrap().to_vec();
    let preferred = {
        let l = f.layout.as_ref().unwrap();
        l.choose(&f.main, &rules(&f, "tw"))
    };
    let other = (preferred + 1) % 4;
    f.layout
        .as_mut()
        .unwrap()
        .placed
        .insert("cali0".into(), other);
    f.settle().unwrap();
    assert_eq!(f.placement()["cali0"], other);
    for dir in ["fw", "tw"] {
        let r = rules(&f, dir);
        f.set_chain(&format!("dph-{dir}-twin"), r).unwrap();
    }
    f.settle().unwrap();
    assert_eq!(
        f.placement()["twin"],
        other,
        "with its twin, not in {preferred}"
    );
    assert_eq!(ingress(&f, "twin").0, ingress(&f, "cali0").0);
}

/// A workload's ingress chain as the endpoints manager writes it: one
/// tier of `policies`, then a drop.
fn tiered(policies: &[&str]) -> Vec<Rule> {
    let mut out = vec![
        r("-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"),
        r("-j MARK --set-xmark 0/0x30000"),
        r("-j MARK --set-xmark 0/0x20000"),
    ];
    for p in policies {
        out.push(r(&format!("-m mark --mark 0/0x20000 -j {p}")));
        out.push(r("-m mark --mark 0x10000/0x10000 -j RETURN"));
    }
    out.push(r("-m mark --mark 0/0x20000 -j DROP"));
    out.push(r("-j DROP"));
    out
}

/// An allow of port `port` (all policies here look up set `dph-s0`, so
/// their endpoints share a shard).
fn allow(port: u16) -> Vec<Rule> {
    vec![
        r(&format!(
            "-m set --match-set dph-s0 src -p tcp --dport {port} -j MARK --set-xmark 0x10000/0x10000"
        )),
        r("-m mark --mark 0x10000/0x10000 -j RETURN"),
    ]
}

/// A policy of `n` allows from port `port` on.
fn allows(port: u16, n: u16) -> Vec<Rule> {
    (port..port + n).flat_map(allow).collect()
}

/// A policy that one policy list chain alone jumps to in its shard is
/// written into it (one chain fewer for every commit to pass over), and
/// so is a small one several share; a second list chain that comes to
/// use a big one makes both jump to a copy again, and the copy goes
/// when one is left; a change to it is written where it is; a pass is
/// never written in.
#[test]
fn a_policy_one_list_chain_uses_is_written_into_it() {
    let mut f = filter(4);
    // a: 66 rules, too many to write into two list chains (64).
    f.set_chain("dph-pi-a", allows(80, 33)).unwrap();
    for (p, port) in [("b", 181), ("c", 182)] {
        f.set_chain(&format!("dph-pi-{p}"), allow(port)).unwrap();
    }
    f.set_chain("dph-tw-cali0", tiered(&["dph-pi-a"])).unwrap();
    f.set_chain("dph-tw-cali1", tiered(&["dph-pi-b"])).unwrap();
    f.settle().unwrap();
    let s = f.placement()["cali0"];
    assert_eq!(f.placement()["cali1"], s, "the same sets, the same shard");
    let texts = |f: &Filter, iface: &str| -> Vec<String> {
        let (_, c) = ingress(f, iface);
        c.rules.iter().map(|r| r.text().to_string()).collect()
    };
    let copied = |f: &Filter, p: &str| f.shards[s].desired(p).is_some();
    let t0 = texts(&f, "cali0");
    assert_eq!(
        [&t0[4], &t0[5], &t0[4 + 65], &t0[4 + 66]],
        [
            "-m set --match-set dph-s0 src -p tcp --dport 80 -j MARK --set-xmark 0x10000/0x10000",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
        ],
        "a's 66 rules where the jump was: {t0:?}"
    );
    assert!(t0.iter().all(|t| !t.contains("-j dph-pi-a")), "{t0:?}");
    assert!(!copied(&f, "dph-pi-a") && !copied(&f, "dph-pi-b"));
    // cali2's list (a then c) shares a: a is a copy both jump to; c is
    // cali2's alone.
    f.set_chain("dph-tw-cali2", tiered(&["dph-pi-a", "dph-pi-c"]))
        .unwrap();
    f.settle().unwrap();
    assert_eq!(f.placement()["cali2"], s);
    assert!(copied(&f, "dph-pi-a") && !copied(&f, "dph-pi-c"));
    for iface in ["cali0", "cali2"] {
        assert!(
            texts(&f, iface).contains(&"-m mark --mark 0/0x20000 -j dph-pi-a".to_string()),
            "{iface} jumps to the shared copy"
        );
    }
    assert!(texts(&f, "cali2").iter().any(|t| t.contains("--dport 182")));
    // cali3 shares c (two rules) with cali2: written into both.
    f.set_chain("dph-tw-cali3", tiered(&["dph-pi-c"])).unwrap();
    f.settle().unwrap();
    assert_eq!(f.placement()["cali3"], s);
    assert!(!copied(&f, "dph-pi-c"));
    for iface in ["cali2", "cali3"] {
        assert!(texts(&f, iface).iter().any(|t| t.contains("--dport 182")));
    }
    f.remove_chain("dph-tw-cali3");
    // cali2 goes: a is cali0's alone again.
    f.remove_chain("dph-tw-cali2");
    f.settle().unwrap();
    assert!(!copied(&f, "dph-pi-a") && !copied(&f, "dph-pi-c"));
    assert!(texts(&f, "cali0").iter().any(|t| t.contains("--dport 80")));
    // A change to a is written into cali0's chain, under the same name.
    let (name, _) = ingress(&f, "cali0");
    let name = name.to_string();
    f.set_chain("dph-pi-a", allow(90)).unwrap();
    f.settle().unwrap();
    assert_eq!(ingress(&f, "cali0").0, name);
    assert!(texts(&f, "cali0").iter().any(|t| t.contains("--dport 90")));
    assert!(!texts(&f, "cali0").iter().any(|t| t.contains("--dport 80")));
    // Now small (two rules): cali2 coming back shares it written in.
    f.set_chain("dph-tw-cali2", tiered(&["dph-pi-a", "dph-pi-c"]))
        .unwrap();
    f.settle().unwrap();
    assert!(!copied(&f, "dph-pi-a"));
    assert!(texts(&f, "cali2").iter().any(|t| t.contains("--dport 90")));
    // Grown past what two list chains may hold: a copy both jump to.
    f.set_chain("dph-pi-a", allows(90, 33)).unwrap();
    f.settle().unwrap();
    assert!(copied(&f, "dph-pi-a"));
    assert!(texts(&f, "cali2").contains(&"-m mark --mark 0/0x20000 -j dph-pi-a".to_string()));
    f.remove_chain("dph-tw-cali2");
    f.settle().unwrap();
    assert!(!copied(&f, "dph-pi-a"));
    // A pass: jumped to (a copy) — written in, its return would end the
    // list chain with no accept mark, which a shard lets through.
    f.set_chain(
        "dph-pi-a",
        vec![
            r("-m set --match-set dph-s0 src -j MARK --set-xmark 0x20000/0x20000"),
            r("-m mark --mark 0x20000/0x20000 -j RETURN"),
        ],
    )
    .unwrap();
    f.settle().unwrap();
    assert!(copied(&f, "dph-pi-a"));
    assert!(texts(&f, "cali0").contains(&"-m mark --mark 0/0x20000 -j dph-pi-a".to_string()));
    // The last user gone: nothing left of either.
    f.remove_chain("dph-tw-cali0");
    f.remove_chain("dph-tw-cali1");
    f.settle().unwrap();
    assert!(
        f.shards[s]
            .chains
            .keys()
            .all(|c| !c.contains("-list-") && !c.starts_with("dph-pi-"))
    );
}

/// With one shard, or a mark mask without the pending bits, filter
/// holds everything as before.
#[test]
fn unsharded_without_shards_or_bits() {
    for f in [
        filter(1),
        Filter::new(
            IpVersion::V4,
            Ownership::new("dph"),
            ShardLayout {
                marks: Marks::from_mask(0x3f0000).unwrap(),
                shards: 8,
                per_shard: 0,
            },
        ),
    ] {
        let mut f = f;
        workloads(&mut f, &["cali1"], 1);
        f.settle().unwrap();
        assert!(f.shards.is_empty());
        assert!(f.main.desired("dph-tw-cali1").is_some());
        assert_eq!(
            f.main.desired("dph-to-wl-dispatch").unwrap().rules[0].text(),
            "-o cali1 -g dph-tw-cali1"
        );
    }
}

/// Filter's prerouting follows the managers' INPUT chain: what INPUT
/// accepts from a workload before its egress policy is left unchecked
/// when it is not forwarded, and every packet from a workload prefix is
/// marked "egress unchecked" for the shards.
#[test]
fn prerouting_marks_workload_packets_and_spares_what_input_takes_first() {
    let mut f = Filter::new(
        IpVersion::V6,
        Ownership::new("dph"),
        ShardLayout {
            marks: Marks::default(),
            shards: 4,
            per_shard: 0,
        },
    );
    f.set_chain(
        "dph-INPUT",
        vec![
            r("-p udp -m udp --dport 51820 -m addrtype --dst-type LOCAL -j ACCEPT"),
            r("-p udp -m udp --dport 4789 -m addrtype --dst-type LOCAL -j DROP"),
            r("-i cali+ -p ipv6-icmp -m icmp6 --icmpv6-type 135 -j ACCEPT"),
            r("-i cali+ -j dph-from-wl-dispatch"),
            r("-i tap+ -j dph-from-wl-dispatch"),
            r("-i cali+ -m mark --mark 0x10000/0x10000 -j ACCEPT"),
            r("-i cali+ -j DROP"),
            r("-j ACCEPT"),
        ],
    )
    .unwrap();
    assert_eq!(
        f.main.hooks["PREROUTING-FIRST"]
            .rules
            .iter()
            .map(Rule::text)
            .collect::<Vec<_>>(),
        [
            "-j MARK --set-xmark 0x0/0xc00000",
            "-p udp -m udp --dport 51820 -m addrtype --dst-type LOCAL -m addrtype ! --dst-type UNICAST -j RETURN",
            "-i cali+ -p ipv6-icmp -m icmp6 --icmpv6-type 135 -m addrtype ! --dst-type UNICAST -j RETURN",
            "-i cali+ -j MARK --set-xmark 0x800000/0x800000",
            "-i tap+ -j MARK --set-xmark 0x800000/0x800000",
        ]
    );
    assert_eq!(
        RuleTable::chain(&f, "dph-INPUT").unwrap().len(),
        8,
        "the chain itself as set"
    );
}
