/// A plan and what it leaves.
struct Planned {
    ops: Vec<Op>,
    /// How each table it touches was planned.
    tables: BTreeMap<String, TableAfter>,
    /// What the kernel holds after it.
    after: Observed,
}

/// [`plan`] of IPv4 tables `tables` with our prefix.
fn plan_v4(
    tables: &[ChainTable],
    sets: &DesiredSets,
    observed: &Observed,
    contents: Option<&Contents>,
) -> Result<Planned, PlanError> {
    let p = plan(input(&refs(tables), sets, observed, contents))?;
    let Plan {
        ops,
        tables,
        ranges,
    } = p;
    let mut after = observed.clone();
    let mut written = sets.written_ranges.clone();
    Plan {
        ops: Vec::new(),
        tables: tables.clone(),
        ranges,
    }
    .apply_to(&mut after, &mut written);
    Ok(Planned { ops, tables, after })
}

/// The plan's input for IPv4 tables with our prefix.
fn input<'a>(
    tables: &'a [&'a ChainTable],
    sets: &'a DesiredSets,
    observed: &'a Observed,
    contents: Option<&'a Contents>,
) -> Input<'a> {
    Input {
        family: Family::Ip,
        chain_prefix: "dph-",
        tables,
        sets,
        observed,
        contents,
    }
}

/// Whether table `t` was planned from its changes alone.
fn cheap(p: &Planned, t: &str) -> bool {
    matches!(p.tables.get(t), Some(TableAfter::Patched(_)) | None)
}

/// The tables as the plans take them.
fn refs(tables: &[ChainTable]) -> Vec<&ChainTable> {
    tables.iter().collect()
}

use super::*;
use crate::backends::desired::SetStore;
use crate::backends::ipsets::Meta;
use crate::generictables::{Ownership, Rule};
use crate::model::IpVersion;
use crate::model::ipsets::{IpSetType, Member, SetNames};
use std::collections::{BTreeMap, HashSet};

fn r(s: &str) -> Rule {
    Rule::parse(s).unwrap()
}

fn ip(s: &str) -> Member {
    Member::Ip(s.parse().unwrap())
}

fn state() -> (Vec<ChainTable>, DesiredSets) {
    let mut t = ChainTable::new("filter", IpVersion::V4, Ownership::new("dph"));
    t.set_chain("dph-a", vec![r("-m set --match-set dph40s src -j DROP")])
        .unwrap();
    t.set_hooks("FORWARD", vec![r("-j dph-a")]).unwrap();
    let mut s = DesiredSets::new(IpVersion::V4, SetNames::new("dph").unwrap());
    s.replace(
        "dph40s".into(),
        Meta {
            set_type: IpSetType::Ip,
            maxelem: 10,
        },
        [ip("10.0.0.1")].into(),
    );
    (vec![t], s)
}

/// A dispatch chain's rules: each `(interface, c)` to `dph-fw-<c>`, then
/// a drop.
fn dispatch(entries: &[(&str, &str)]) -> Vec<Rule> {
    let mut rules: Vec<Rule> = entries
        .iter()
        .map(|(i, c)| r(&format!("-i {i} -g dph-fw-{c}")))
        .collect();
    rules.push(r("-j DROP"));
    rules
}

fn names(ops: &[Op]) -> Vec<String> {
    ops.iter().map(super::super::ops::describe).collect()
}

/// What the dataplane does after a commit.
fn committed(tables: &mut [ChainTable], sets: &mut DesiredSets) {
    sets.changes.clear();
    sets.removed_any = false;
    for t in tables {
        t.changed = false;
        t.reshaped = false;
        t.regraphed = false;
        t.touched.clear();
    }
}

/// [`state`] and a raw table whose chain looks up the same set, written;
/// then a member added to the set.
fn with_raw_written() -> (Vec<ChainTable>, DesiredSets, Planned) {
    let (mut tables, mut sets) = state();
    let mut raw = ChainTable::new("raw", IpVersion::V4, Ownership::new("dph"));
    raw.set_chain("dph-b", vec![r("-m set --match-set dph40s src -j DROP")])
        .unwrap();
    raw.set_hooks("PREROUTING", vec![r("-j dph-b")]).unwrap();
    tables.push(raw);
    let p = plan_v4(&tables, &sets, &Observed::new(), None).unwrap();
    committed(&mut tables, &mut sets);
    sets.delta(
        "dph40s",
        &mut [ip("10.0.0.2")].into_iter(),
        &mut std::iter::empty(),
    );
    (tables, sets, p)
}

/// A full plan takes a table none of whose chains changed as it was
/// written, with its sets' new members only.
#[test]
fn a_quiet_table_gets_its_members_alone() {
    let (mut tables, sets, p) = with_raw_written();
    // filter changes (a new chain: a whole plan); raw does not.
    tables[0].set_chain("dph-c", vec![r("-j DROP")]).unwrap();
    tables[0]
        .set_hooks("FORWARD", vec![r("-j dph-a"), r("-j dph-c")])
        .unwrap();
    assert!(tables[0].reshaped && !tables[1].changed);
    let again = plan_v4(&tables, &sets, &p.after, None).unwrap();
    let raw_ops: Vec<String> = names(&again.ops)
        .into_iter()
        .filter(|o| o.contains("dph-raw"))
        .collect();
    assert_eq!(raw_ops, ["adding 1 elements to dph-raw/dph40s"]);
    assert_eq!(again.after["dph-raw"], p.after["dph-raw"]);
    assert!(cheap(&again, "dph-raw") && !cheap(&again, "dph-filter"));
    assert!(
        names(&again.ops).contains(&"adding 1 elements to dph-filter/dph40s".to_string()),
        "{:?}",
        names(&again.ops)
    );
}

/// A read that took one table (a commit touched the other while it was
/// read): that table is planned whole against what was read, and what
/// was changed by hand in it put back; the other goes on from its
/// changes (a member, by its delta), as last written.
#[test]
fn a_table_read_alone_is_planned_whole_and_the_rest_from_changes() {
    let (tables, sets, p) = with_raw_written();
    // raw as read: its chain emptied by hand, its set missing the first
    // member and holding one put there by hand.
    let mut read = p.after.clone();
    read.get_mut("dph-raw")
        .unwrap()
        .chains
        .get_mut("dph-b")
        .unwrap()
        .comments = Vec::new().into();
    let contents: Contents = [(
        ("dph-raw".to_string(), "dph40s".to_string()),
        Content::Keys([Key::Addr("10.9.9.9".parse().unwrap())].into()),
    )]
    .into();
    assert!(contents.read("dph-raw") && !contents.read("dph-filter"));
    let again = plan_v4(&tables, &sets, &read, Some(&contents)).unwrap();
    assert!(!cheap(&again, "dph-raw") && cheap(&again, "dph-filter"));
    let mut ops = names(&again.ops);
    ops.sort();
    assert_eq!(
        ops,
        [
            "adding 1 elements to dph-filter/dph40s",
            "adding 2 elements to dph-raw/dph40s",
            "adding rule \"dph:rSvw1bmzaIIW8UNS\" to dph-raw/dph-b",
            "flushing chain dph-raw/dph-b",
            "removing 1 elements from dph-raw/dph40s",
        ]
        .map(String::from)
    );
    assert_eq!(again.after, p.after, "as written");
}

#[test]
fn a_first_plan_makes_everything_in_an_order_the_kernel_takes() {
    let (mut tables, mut sets) = state();
    let p = plan_v4(&tables, &sets, &Observed::new(), None).unwrap();
    committed(&mut tables, &mut sets);
    assert_eq!(
        names(&p.ops),
        [
            "adding table dph-filter",
            "adding set dph-filter/dph40s",
            "adding 1 elements to dph-filter/dph40s",
            "adding chain dph-filter/dph-a",
            "adding chain dph-filter/FORWARD",
            "adding rule \"dph:DIw5m7AUdhJbj4tR\" to dph-filter/dph-a",
            "adding rule \"dph:zF1jByNAP998x14n\" to dph-filter/FORWARD",
        ]
        .map(String::from)
        .to_vec(),
        "{:#?}",
        names(&p.ops)
    );
    // Planned again against what it leaves: nothing to do.
    let again = plan_v4(&tables, &sets, &p.after, None).unwrap();
    assert!(again.ops.is_empty(), "{:?}", names(&again.ops));
}

/// A dispatch chain is a verdict map made with its entries after the
/// chains they go to. Its lookup is named by the chain, so an interface
/// that goes, comes or moves is an element removed or added (removed
/// before any chain it went to is), planned from the changes alone when
/// nothing else was reshaped; one changed by hand is put right element by
/// element; one whose entries are unknown is made again.
#[test]
fn dispatch_maps_are_made_patched_and_repaired_in_order() {
    let mut t = ChainTable::new("filter-0", IpVersion::V4, Ownership::new("dph")).with_maps();
    for c in ["dph-fw-cali1", "dph-fw-cali2"] {
        t.set_chain(c, vec![r("-j ACCEPT")]).unwrap();
    }
    t.set_chain(
        "dph-from-wl-dispatch",
        dispatch(&[("cali1", "cali1"), ("cali2", "cali2")]),
    )
    .unwrap();
    t.set_hooks("FORWARD", vec![r("-j dph-from-wl-dispatch")])
        .unwrap();
    let mut tables = vec![t];
    let mut sets = DesiredSets::new(IpVersion::V4, SetNames::new("dph").unwrap());
    let p = plan_v4(&tables, &sets, &Observed::new(), None).unwrap();
    let ops = names(&p.ops);
    let pos = |ops: &[String], what: &str| {
        ops.iter()
            .position(|o| o.starts_with(what))
            .unwrap_or_else(|| panic!("no {what}: {ops:#?}"))
    };
    let map = pos(&ops, "adding map dph-filter-0/dispatch-in-");
    let entries = pos(&ops, "adding 2 entries to dph-filter-0/dispatch-in-");
    assert!(map < pos(&ops, "adding chain dph-filter-0/dph-fw-cali2"));
    assert!(pos(&ops, "adding chain dph-filter-0/dph-fw-cali2") < entries);
    assert!(entries < pos(&ops, "adding rule"));
    committed(&mut tables, &mut sets);
    let first = p.after.clone();
    let name = first["dph-filter-0"]
        .sets
        .keys()
        .find(|s| s.starts_with("dispatch-"))
        .unwrap()
        .clone();

    // cali2 goes: its element, then its chain; the map and its lookup stay.
    tables[0]
        .set_chain("dph-from-wl-dispatch", dispatch(&[("cali1", "cali1")]))
        .unwrap();
    tables[0].remove_chain("dph-fw-cali2");
    let p = plan_v4(&tables, &sets, &first, None).unwrap();
    assert_eq!(
        names(&p.ops),
        [
            "flushing chain dph-filter-0/dph-fw-cali2".to_string(),
            format!("removing 1 elements from dph-filter-0/{name}"),
            "removing chain dph-filter-0/dph-fw-cali2".to_string(),
        ]
    );
    committed(&mut tables, &mut sets);
    let second = p.after.clone();
    let again = plan_v4(&tables, &sets, &second, None).unwrap();
    assert!(again.ops.is_empty(), "{:?}", names(&again.ops));

    // A replica of cali1 comes: nothing reshaped, its element alone, from
    // the changes.
    tables[0]
        .set_chain(
            "dph-from-wl-dispatch",
            dispatch(&[("cali1", "cali1"), ("cali3", "cali1")]),
        )
        .unwrap();
    assert!(!tables[0].reshaped);
    let p = plan_v4(&tables, &sets, &second, None).unwrap();
    assert!(cheap(&p, "dph-filter-0"), "planned from the changes");
    assert_eq!(
        names(&p.ops),
        [format!("adding 1 entries to dph-filter-0/{name}")]
    );
    committed(&mut tables, &mut sets);
    let third = p.after.clone();
    assert_eq!(
        third["dph-filter-0"].maps[&name],
        [("cali1", "dph-fw-cali1"), ("cali3", "dph-fw-cali1")]
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .into()
    );
    assert!(
        plan_v4(&tables, &sets, &third, None)
            .unwrap()
            .ops
            .is_empty()
    );

    // Changed by hand, as a read finds it: cali1's element gone, cali3's
    // going elsewhere, one more: put right element by element.
    let mut read = third.clone();
    read.get_mut("dph-filter-0").unwrap().maps.insert(
        name.clone(),
        [("cali3", ""), ("cali9", "dph-fw-cali1")]
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .into(),
    );
    let contents: Contents = [(
        ("dph-filter-0".to_string(), name.clone()),
        Content::Keys([Key::ifname("cali3"), Key::ifname("cali9")].into()),
    )]
    .into();
    let p = plan_v4(&tables, &sets, &read, Some(&contents)).unwrap();
    assert_eq!(
        names(&p.ops),
        [
            format!("removing 2 elements from dph-filter-0/{name}"),
            format!("adding 2 entries to dph-filter-0/{name}"),
        ]
    );
    assert_eq!(p.after, third, "as written");
    // As read with its entries: nothing to do.
    let p = plan_v4(&tables, &sets, &third, Some(&contents)).unwrap();
    assert!(p.ops.is_empty(), "{:?}", names(&p.ops));

    // Entries unknown (a map this process did not write or read): made
    // again, with the chain that looks it up.
    let mut unknown = third.clone();
    unknown.get_mut("dph-filter-0").unwrap().maps.clear();
    let p = plan_v4(&tables, &sets, &unknown, Some(&contents)).unwrap();
    let short: Vec<String> = names(&p.ops)
        .into_iter()
        .map(|o| {
            if o.starts_with("adding rule") {
                "adding rule".into()
            } else {
                o
            }
        })
        .collect();
    assert_eq!(
        short,
        [
            "flushing chain dph-filter-0/dph-from-wl-dispatch".to_string(),
            format!("removing set dph-filter-0/{name}"),
            format!("adding map dph-filter-0/{name}"),
            format!("adding 2 entries to dph-filter-0/{name}"),
            "adding rule".to_string(),
            "adding rule".to_string(),
        ]
    );
}

/// A base chain found at another priority (made again by hand) is
/// removed and made anew with its rules; the rest stays.
#[test]
fn a_hook_at_the_wrong_priority_is_made_again() {
    let (mut tables, mut sets) = state();
    let p = plan_v4(&tables, &sets, &Observed::new(), None).unwrap();
    committed(&mut tables, &mut sets);
    let mut read = p.after.clone();
    let forward = read
        .get_mut("dph-filter")
        .and_then(|t| t.chains.get_mut("FORWARD"))
        .unwrap();
    let (hook, priority) = forward.hook.unwrap();
    forward.hook = Some((hook, priority + 10));
    forward.comments = Vec::new().into();
    let contents: Contents = [(
        ("dph-filter".to_string(), "dph40s".to_string()),
        Content::Keys([Key::Addr("10.0.0.1".parse().unwrap())].into()),
    )]
    .into();
    let again = plan_v4(&tables, &sets, &read, Some(&contents)).unwrap();
    assert_eq!(
        names(&again.ops),
        [
            "flushing chain dph-filter/FORWARD",
            "removing chain dph-filter/FORWARD",
            "adding chain dph-filter/FORWARD",
            "adding rule \"dph:zF1jByNAP998x14n\" to dph-filter/FORWARD",
        ]
        .map(String::from)
        .to_vec()
    );
    assert_eq!(again.after, p.after, "as first written");
}

#[test]
fn changes_alone_are_planned_without_the_rest() {
    let (mut tables, mut sets) = state();
    let p = plan_v4(&tables, &sets, &Observed::new(), None).unwrap();
    assert!(
        !cheap(&p, "dph-filter"),
        "new sets and chains: a whole plan"
    );
    committed(&mut tables, &mut sets);
    let observed = p.after;

    // A member: one element, nothing else.
    sets.delta(
        "dph40s",
        &mut [ip("10.0.0.2")].into_iter(),
        &mut std::iter::empty(),
    );
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert_eq!(names(&c.ops), ["adding 1 elements to dph-filter/dph40s"]);
    assert!(cheap(&c, "dph-filter"));
    committed(&mut tables, &mut sets);

    // A chain's rules: that chain flushed and written, with the port
    // list its new rule needs.
    tables[0]
        .set_chain(
            "dph-a",
            vec![r("-p tcp -m multiport --destination-ports 1,2 -j DROP")],
        )
        .unwrap();
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    let n = names(&c.ops);
    assert_eq!(n[0], "flushing chain dph-filter/dph-a");
    assert!(n[1].starts_with("adding set dph-filter/ports-"), "{n:?}");
    assert!(n[3].starts_with("adding rule"), "{n:?}");
    assert!(
        matches!(&c.tables["dph-filter"], TableAfter::Patched(p) if p.len() == 2),
        "{:?}",
        c.tables
    );
    committed(&mut tables, &mut sets);
    let observed = c.after;

    // A dispatch chain given one more interface that goes where the
    // others go reshapes nothing.
    tables[0].set_chain("dph-p", vec![r("-j ACCEPT")]).unwrap();
    tables[0]
        .set_chain("dph-a", vec![r("-i a -g dph-p"), r("-j dph-p")])
        .unwrap();
    assert!(
        tables[0].regraphed && !tables[0].reshaped,
        "a new jump: which chains are reached may change"
    );
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert!(
        !cheap(&c, "dph-filter"),
        "the table that holds every set is planned whole"
    );
    committed(&mut tables, &mut sets);
    let observed = c.after;
    tables[0]
        .set_chain(
            "dph-a",
            vec![r("-i a -g dph-p"), r("-i b -g dph-p"), r("-j dph-p")],
        )
        .unwrap();
    assert!(!tables[0].reshaped && !tables[0].regraphed);
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert!(cheap(&c, "dph-filter"));
    assert_eq!(
        names(&c.ops)
            .iter()
            .filter(|o| o.starts_with("adding rule"))
            .count(),
        3
    );
    committed(&mut tables, &mut sets);
    let observed = c.after;

    // A new set the table must hold: a whole plan.
    sets.replace(
        "dph40t".into(),
        Meta {
            set_type: IpSetType::Ip,
            maxelem: 10,
        },
        [ip("10.0.0.9")].into(),
    );
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert!(!cheap(&c, "dph-filter"));
    assert!(
        names(&c.ops).contains(&"adding set dph-filter/dph40t".to_string()),
        "{:?}",
        names(&c.ops)
    );
}

#[test]
fn what_nothing_reaches_goes_after_the_rules_that_used_it() {
    let (mut tables, mut sets) = state();
    let p = plan_v4(&tables, &sets, &Observed::new(), None).unwrap();
    committed(&mut tables, &mut sets);
    tables[0]
        .set_hooks("FORWARD", vec![r("-j ACCEPT")])
        .unwrap();
    let q = plan_v4(&tables, &sets, &p.after, None).unwrap();
    let n = names(&q.ops);
    let flush = n
        .iter()
        .position(|o| o == "flushing chain dph-filter/dph-a");
    let gone = n
        .iter()
        .position(|o| o == "removing chain dph-filter/dph-a");
    assert!(flush.is_some() && gone.is_some() && flush < gone, "{n:?}");
    assert!(
        !n.iter().any(|o| o.contains("removing set")),
        "every set stays in the filter table: {n:?}"
    );
    // A set no longer desired and used by nothing goes.
    sets.remove("dph40s");
    let after = q.after;
    let z = plan_v4(&tables, &sets, &after, None).unwrap();
    assert_eq!(names(&z.ops), ["removing set dph-filter/dph40s"]);
}

/// The table that holds the sets no other table looks up (sharded
/// filter) is planned from its changes while the others are: a member is
/// an element; a new set no rule uses goes to it; a new set a changed
/// chain elsewhere starts using goes there, not to it.
#[test]
fn the_spare_sets_table_takes_new_unused_sets_and_only_those() {
    let meta = Meta {
        set_type: IpSetType::Ip,
        maxelem: 10,
    };
    let mut filter = ChainTable::new("filter", IpVersion::V4, Ownership::new("dph"));
    filter.spare_sets_only = true;
    filter.set_hooks("FORWARD", vec![r("-j ACCEPT")]).unwrap();
    let mut shard = ChainTable::new("filter-0", IpVersion::V4, Ownership::new("dph"));
    shard
        .set_chain("dph-a", vec![r("-m set --match-set dph40a src -j DROP")])
        .unwrap();
    shard.set_hooks("FORWARD", vec![r("-j dph-a")]).unwrap();
    let mut tables = vec![filter, shard];
    let mut sets = DesiredSets::new(IpVersion::V4, SetNames::new("dph").unwrap());
    for s in ["dph40a", "dph40b"] {
        sets.replace(s.into(), meta, [ip("10.0.0.1")].into());
    }
    let p = plan_v4(&tables, &sets, &Observed::new(), None).unwrap();
    committed(&mut tables, &mut sets);
    let observed = p.after;
    let held = |o: &Observed, t: &str| {
        let mut v: Vec<String> = o[t].sets.keys().cloned().collect();
        v.sort();
        v
    };
    assert_eq!(held(&observed, "dph-filter"), ["dph40b"]);
    assert_eq!(held(&observed, "dph-filter-0"), ["dph40a"]);

    // Members of both: elements alone, every table from its changes.
    for s in ["dph40a", "dph40b"] {
        sets.delta(
            s,
            &mut [ip("10.0.0.2")].into_iter(),
            &mut std::iter::empty(),
        );
    }
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert_eq!(
        names(&c.ops),
        [
            "adding 1 elements to dph-filter/dph40b",
            "adding 1 elements to dph-filter-0/dph40a"
        ]
    );
    assert!(cheap(&c, "dph-filter") && cheap(&c, "dph-filter-0"));
    // Planned as members alone: no table named, the same ops as every
    // table planned from its changes.
    assert!(c.tables.is_empty());
    let by_tables = plan_tables(input(&refs(&tables), &sets, &observed, None));
    assert_eq!(by_tables.unwrap().ops, c.ops);
    committed(&mut tables, &mut sets);

    // A new set no rule uses: filter takes it.
    sets.replace("dph40c".into(), meta, [ip("10.0.0.3")].into());
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert!(!cheap(&c, "dph-filter") && cheap(&c, "dph-filter-0"));
    assert_eq!(held(&c.after, "dph-filter"), ["dph40b", "dph40c"]);
    committed(&mut tables, &mut sets);
    let observed = c.after;

    // A new set the shard's changed chain looks up: the shard takes it,
    // filter stays as it is.
    sets.replace("dph40d".into(), meta, [ip("10.0.0.4")].into());
    tables[1]
        .set_chain(
            "dph-a",
            vec![
                r("-m set --match-set dph40a src -j DROP"),
                r("-m set --match-set dph40d src -j DROP"),
            ],
        )
        .unwrap();
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert!(cheap(&c, "dph-filter"), "{:?}", names(&c.ops));
    assert_eq!(held(&c.after, "dph-filter"), ["dph40b", "dph40c"]);
    assert_eq!(held(&c.after, "dph-filter-0"), ["dph40a", "dph40d"]);
    committed(&mut tables, &mut sets);
    let observed = c.after;

    // The shard given a chain more and no longer looking up dph40d:
    // planned from its changes (the chain made, the rule rewritten); it
    // keeps the set until its next whole plan, and filter stays as it is.
    tables[1].set_chain("dph-b", vec![r("-j DROP")]).unwrap();
    tables[1]
        .set_chain("dph-a", vec![r("-m set --match-set dph40a src -j dph-b")])
        .unwrap();
    assert!(tables[1].regraphed && !tables[1].reshaped);
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert!(cheap(&c, "dph-filter") && cheap(&c, "dph-filter-0"));
    assert_eq!(
        names(&c.ops),
        [
            "flushing chain dph-filter-0/dph-a",
            "adding chain dph-filter-0/dph-b",
            "adding rule \"dph:3zY8FU_6ax9t8-4I\" to dph-filter-0/dph-b",
            "adding rule \"dph:TQr2SvOpPeqTF7iT\" to dph-filter-0/dph-a",
        ]
    );
    assert_eq!(held(&c.after, "dph-filter"), ["dph40b", "dph40c"]);
    assert_eq!(held(&c.after, "dph-filter-0"), ["dph40a", "dph40d"]);
    committed(&mut tables, &mut sets);
    let observed = c.after;

    // Its hooks changed (a whole plan): it drops the set, and filter
    // takes it (every set is somewhere).
    tables[1]
        .set_hooks("FORWARD", vec![r("-j dph-a"), r("-j ACCEPT")])
        .unwrap();
    assert!(tables[1].reshaped);
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert!(!cheap(&c, "dph-filter") && !cheap(&c, "dph-filter-0"));
    assert_eq!(held(&c.after, "dph-filter"), ["dph40b", "dph40c", "dph40d"]);
    assert_eq!(held(&c.after, "dph-filter-0"), ["dph40a"]);
    committed(&mut tables, &mut sets);
    let observed = c.after;

    // Reshaped again, keeping its sets: filter stays as it is.
    tables[1].set_chain("dph-b", vec![r("-j ACCEPT")]).unwrap();
    tables[1].set_chain("dph-c", vec![r("-j DROP")]).unwrap();
    tables[1]
        .set_hooks("FORWARD", vec![r("-j dph-a"), r("-j dph-c")])
        .unwrap();
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert!(cheap(&c, "dph-filter") && !cheap(&c, "dph-filter-0"));
    assert_eq!(held(&c.after, "dph-filter"), ["dph40b", "dph40c", "dph40d"]);
}

/// A shard whose chains come and go (an endpoint with a new policy list
/// chain, one whose list chain and policy copy go with it) is planned from
/// its changes, and leaves the chains and maps a whole plan would (a new
/// chain's set not held yet comes with its members); a dispatch whose map
/// would still hold chains that go takes the whole plan.
#[test]
fn chains_that_come_and_go_are_planned_from_the_changes() {
    let mut t = ChainTable::new("filter-0", IpVersion::V4, Ownership::new("dph")).with_maps();
    t.set_chain("dph-pi-x", vec![r("-m set --match-set dph40a src -j DROP")])
        .unwrap();
    t.set_chain("dph-pi-y", vec![r("-p tcp -j DROP")]).unwrap();
    t.set_chain("dph-fw-1", vec![r("-j dph-pi-x"), r("-j dph-pi-y")])
        .unwrap();
    t.set_chain("dph-fw-2", vec![r("-j dph-pi-x"), r("-j ACCEPT")])
        .unwrap();
    t.set_chain("dph-d", dispatch(&[("cali1", "1"), ("cali2", "2")]))
        .unwrap();
    t.set_hooks("FORWARD", vec![r("-j dph-d")]).unwrap();
    let mut tables = vec![t];
    let mut sets = DesiredSets::new(IpVersion::V4, SetNames::new("dph").unwrap());
    let meta = Meta {
        set_type: IpSetType::Ip,
        maxelem: 10,
    };
    sets.replace("dph40a".into(), meta, [ip("10.0.0.1")].into());
    sets.replace("dph40b".into(), meta, [ip("10.0.0.2")].into());
    let p = plan_v4(&tables, &sets, &Observed::new(), None).unwrap();
    committed(&mut tables, &mut sets);
    let observed = p.after;
    let map = observed["dph-filter-0"]
        .maps
        .keys()
        .next()
        .expect("a dispatch map")
        .clone();
    // What a whole plan from nothing leaves: the chains and maps.
    let as_whole = |tables: &[ChainTable], sets: &DesiredSets, after: &Observed| {
        let fresh = plan_v4(tables, sets, &Observed::new(), None).unwrap();
        let (w, s) = (&fresh.after["dph-filter-0"], &after["dph-filter-0"]);
        assert_eq!(s.chains, w.chains);
        assert_eq!(s.maps, w.maps);
    };

    // An endpoint with a list chain of its own comes (and a member with
    // it): the chain made, its element added after it, its rules.
    tables[0]
        .set_chain("dph-fw-3", vec![r("-j dph-pi-x"), r("-j DROP")])
        .unwrap();
    tables[0]
        .set_chain(
            "dph-d",
            dispatch(&[("cali1", "1"), ("cali2", "2"), ("cali3", "3")]),
        )
        .unwrap();
    sets.delta(
        "dph40a",
        &mut [ip("10.0.0.9")].into_iter(),
        &mut std::iter::empty(),
    );
    assert!(tables[0].regraphed && !tables[0].reshaped);
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert!(cheap(&c, "dph-filter-0"), "{:?}", c.tables);
    let ops = names(&c.ops);
    assert_eq!(ops[0], "adding 1 elements to dph-filter-0/dph40a");
    assert_eq!(ops[1], "adding chain dph-filter-0/dph-fw-3");
    assert_eq!(ops[2], format!("adding 1 entries to dph-filter-0/{map}"));
    assert!(
        ops[3..]
            .iter()
            .all(|o| o.ends_with("to dph-filter-0/dph-fw-3"))
    );
    assert_eq!(ops.len(), 5, "{ops:#?}");
    as_whole(&tables, &sets, &c.after);
    committed(&mut tables, &mut sets);
    let observed = c.after;

    // Endpoint 1 goes, and with it the only list chain that used policy
    // y: both emptied first, the element removed, then both chains.
    tables[0]
        .set_chain("dph-d", dispatch(&[("cali2", "2"), ("cali3", "3")]))
        .unwrap();
    tables[0].remove_chain("dph-fw-1");
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert!(cheap(&c, "dph-filter-0"), "{:?}", c.tables);
    assert_eq!(
        names(&c.ops),
        [
            "flushing chain dph-filter-0/dph-fw-1".to_string(),
            "flushing chain dph-filter-0/dph-pi-y".to_string(),
            format!("removing 1 elements from dph-filter-0/{map}"),
            "removing chain dph-filter-0/dph-fw-1".to_string(),
            "removing chain dph-filter-0/dph-pi-y".to_string(),
        ]
    );
    as_whole(&tables, &sets, &c.after);
    committed(&mut tables, &mut sets);
    let observed = c.after;
    assert!(
        plan_v4(&tables, &sets, &observed, None)
            .unwrap()
            .ops
            .is_empty(),
        "nothing left to do"
    );

    // A new list chain that looks up a set the shard does not hold: the
    // set comes with its members, before the chain's rules; still from
    // the changes, and filter does not take the set.
    tables[0]
        .set_chain("dph-fw-4", vec![r("-m set --match-set dph40b src -j DROP")])
        .unwrap();
    tables[0]
        .set_chain(
            "dph-d",
            dispatch(&[("cali2", "2"), ("cali3", "3"), ("cali4", "4")]),
        )
        .unwrap();
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert!(cheap(&c, "dph-filter-0"), "{:?}", c.tables);
    let ops = names(&c.ops);
    assert_eq!(
        ops[..3],
        [
            "adding set dph-filter-0/dph40b",
            "adding 1 elements to dph-filter-0/dph40b",
            "adding chain dph-filter-0/dph-fw-4",
        ]
    );
    as_whole(&tables, &sets, &c.after);
    let fresh = plan_v4(&tables, &sets, &Observed::new(), None).unwrap();
    assert_eq!(
        c.after["dph-filter-0"].sets,
        fresh.after["dph-filter-0"].sets
    );
    committed(&mut tables, &mut sets);
    let observed = c.after;

    // The last interfaces go: the dispatch is a drop alone, no map. The
    // map would hold the list chains that go, so the whole plan removes
    // it first.
    tables[0].set_chain("dph-d", dispatch(&[])).unwrap();
    for c in ["dph-fw-2", "dph-fw-3", "dph-fw-4", "dph-pi-x"] {
        tables[0].remove_chain(c);
    }
    assert!(!tables[0].reshaped);
    let c = plan_v4(&tables, &sets, &observed, None).unwrap();
    assert!(!cheap(&c, "dph-filter-0"), "{:?}", names(&c.ops));
    let ops = names(&c.ops);
    let at = |what: &str| {
        ops.iter()
            .position(|o| o.starts_with(what))
            .unwrap_or_else(|| panic!("no {what}: {ops:#?}"))
    };
    assert!(
        at(&format!("removing set dph-filter-0/{map}"))
            < at("removing chain dph-filter-0/dph-fw-2")
    );
    as_whole(&tables, &sets, &c.after);
}

/// The plan of members alone is taken only when members alone changed:
/// not after a read, with a chain changed, a set to be written whole or
/// removed, or a table of ours the dataplane no longer has.
#[test]
fn members_alone_are_planned_only_when_nothing_else_changed() {
    let (mut tables, mut sets) = state();
    let p = plan_v4(&tables, &sets, &Observed::new(), None).unwrap();
    committed(&mut tables, &mut sets);
    let observed = p.after;
    let alone = |tables: &[ChainTable], sets: &DesiredSets, observed: &Observed, c| {
        members_only(input(&refs(tables), sets, observed, c)).is_some()
    };
    sets.delta(
        "dph40s",
        &mut [ip("10.0.0.2")].into_iter(),
        &mut std::iter::empty(),
    );
    assert!(alone(&tables, &sets, &observed, None));
    let read = Contents::new();
    assert!(!alone(&tables, &sets, &observed, Some(&read)));

    let mut more = observed.clone();
    more.insert("dph-old".into(), ObservedTable::default());
    assert!(!alone(&tables, &sets, &more, None));

    // A table with nothing in it is not programmed, and needs nothing.
    let mut with_raw = tables.clone();
    with_raw.push(ChainTable::new("raw", IpVersion::V4, Ownership::new("dph")));
    with_raw[1].changed = false;
    assert!(alone(&with_raw, &sets, &observed, None));
    // One with chains that is not programmed (removed by hand and not
    // read back yet) takes the table's plan.
    with_raw[1]
        .set_hooks("PREROUTING", vec![r("-j DROP")])
        .unwrap();
    with_raw[1].changed = false;
    assert!(!alone(&with_raw, &sets, &observed, None));

    let mut changed = tables.clone();
    changed[0].set_chain("dph-b", vec![r("-j DROP")]).unwrap();
    assert!(!alone(&changed, &sets, &observed, None));

    sets.removed_any = true;
    assert!(!alone(&tables, &sets, &observed, None));
    sets.removed_any = false;
    assert!(alone(&tables, &sets, &observed, None));

    // A set of another type is written whole.
    sets.replace(
        "dph40s".into(),
        Meta {
            set_type: IpSetType::Net,
            maxelem: 10,
        },
        [ip("10.0.0.9")].into(),
    );
    assert!(!alone(&tables, &sets, &observed, None));
}

/// A read set's keys against the members: what is missing added, what
/// is extra removed, an address and its /32 net one key.
#[test]
fn a_read_set_is_diffed_by_key() {
    use crate::model::ipsets::Member;
    let k = |s: &str| Key::Addr(s.parse().unwrap());
    let net = |s: &str| Member::Net(s.parse().unwrap());
    let members: HashSet<Member> = [
        ip("10.0.0.1"),
        ip("10.0.0.2"),
        net("10.0.0.2/32"),
        net("10.1.0.0/16"),
    ]
    .into();
    let sorted = |(mut a, mut d): (Vec<Key>, Vec<Key>)| {
        a.sort();
        d.sort();
        (a, d)
    };
    let as_written: HashSet<Key> = [k("10.0.0.1"), k("10.0.0.2")].into();
    assert_eq!(table::diff_keys(&members, &as_written), (vec![], vec![]));
    let changed: HashSet<Key> = [k("10.0.0.2"), k("10.9.9.9")].into();
    assert_eq!(
        sorted(table::diff_keys(&members, &changed)),
        (vec![k("10.0.0.1")], vec![k("10.9.9.9")])
    );
    // As many keys as the members', but one of them not theirs.
    let swapped: HashSet<Key> = [k("10.0.0.1"), k("10.9.9.9")].into();
    assert_eq!(
        sorted(table::diff_keys(&members, &swapped)),
        (vec![k("10.0.0.2")], vec![k("10.9.9.9")])
    );
    assert_eq!(
        table::diff_keys(&HashSet::new(), &HashSet::new()),
        (vec![], vec![])
    );
}
