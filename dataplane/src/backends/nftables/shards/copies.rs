//! What the shards hold besides their dispatch: copies of filter's chains
//! (counted by the chains there that jump to them) and the policy list
//! chains (counted by the endpoint chains they stand for; a chain only
//! one of them jumps to is written into it, [`super::inline`]).

use std::collections::{BTreeSet, HashMap, HashSet};

use super::Placement;
use super::inline::Marks;
use crate::backends::desired::RuleTable;
use crate::backends::nftables::chains::ChainTable;
use crate::generictables::{Rule, RuleError};

/// Shard `s` holds a copy of filter's chain `name` (one more chain there
/// jumps to it).
pub(super) fn add_ref(
    l: &mut Placement,
    main: &ChainTable,
    shard: &mut ChainTable,
    s: usize,
    name: &str,
) {
    let n = l.refs[s].entry(name.to_string()).or_insert(0);
    *n += 1;
    if *n == 1 {
        copy(l, main, shard, s, name);
    }
}

/// One chain fewer in shard `s` jumps to `name`; the last takes the copy.
pub(super) fn drop_ref(l: &mut Placement, shard: &mut ChainTable, s: usize, name: &str) {
    if last_gone(&mut l.refs[s], name) {
        take_out(l, shard, s, name);
    }
}

/// One fewer of `key` counted in `counts`: whether that was the last
/// (then it is no longer counted).
pub(super) fn last_gone(counts: &mut HashMap<String, usize>, key: &str) -> bool {
    let Some(n) = counts.get_mut(key) else {
        return false;
    };
    *n -= 1;
    if *n > 0 {
        return false;
    }
    counts.remove(key);
    true
}

/// Chain `name` out of shard `s`, and one reference fewer to each chain
/// it jumped to.
pub(super) fn take_out(l: &mut Placement, shard: &mut ChainTable, s: usize, name: &str) {
    let targets = targets(shard, name);
    shard.remove_chain(name);
    for t in &targets {
        drop_ref(l, shard, s, t);
    }
}

/// The chains `name` of `table` jumps or goes to.
pub(super) fn targets(table: &ChainTable, name: &str) -> Vec<String> {
    table
        .desired(name)
        .map(|c| c.targets().map(str::to_string).collect())
        .unwrap_or_default()
}

/// One endpoint chain fewer in shard `s` stands on policy list chain
/// `list`; the last takes it (and what it alone jumped to) out.
pub(super) fn release(
    l: &mut Placement,
    main: &ChainTable,
    shard: &mut ChainTable,
    s: usize,
    list: &str,
) -> Result<(), RuleError> {
    if last_gone(&mut l.users[s], list) {
        remove_list(l, main, shard, s, list)?;
    }
    Ok(())
}

/// The chains of ours that rules `body` jump or go to.
fn chain_targets(l: &Placement, body: &[Rule]) -> BTreeSet<String> {
    body.iter()
        .filter_map(Rule::target)
        .filter(|t| t.starts_with(&l.chain_prefix))
        .map(str::to_string)
        .collect()
}

/// Most rules a chain shared by several list chains of a shard may have
/// there, counted once per list chain, to be written into each of them:
/// a change to it rewrites them all. (A namespace's profile, one or two
/// rules that hardly ever change, is shared by every workload list of
/// the namespace: a copy per shard is one chain more for each commit to
/// pass over, 3,200 chains at 10,000 endpoints in 50 namespaces.)
const SHARED_INLINE_RULES: usize = 64;

/// Whether a chain of `rules` rules that `holders` list chains of a
/// shard jump to is written into each of them (where it does the same,
/// [`super::inline`]): one holder, whatever its size; more, while they
/// hold at most [`SHARED_INLINE_RULES`] of its rules together.
fn fits(holders: usize, rules: usize) -> bool {
    holders <= 1 || holders * rules <= SHARED_INLINE_RULES
}

/// List chain `list` joins (or leaves) the holders of each chain of
/// `targets` in shard `s`: the other holders for which that changes
/// whether the chain is written into them ([`fits`]).
fn hold(
    l: &mut Placement,
    main: &ChainTable,
    s: usize,
    list: &str,
    targets: BTreeSet<String>,
    joins: bool,
) -> BTreeSet<String> {
    let mut changed = BTreeSet::new();
    for t in targets {
        let size = main.chain(&t).map_or(0, <[Rule]>::len);
        let h = l.holders[s].entry(t.clone()).or_default();
        let before = h.len();
        if joins {
            h.insert(list.to_string());
        } else {
            h.remove(list);
        }
        if fits(before, size) != fits(h.len(), size) {
            changed.extend(h.iter().filter(|x| *x != list).cloned());
        }
        if h.is_empty() {
            l.holders[s].remove(&t);
        }
    }
    changed
}

/// Policy list chain `list` of rules `body` into shard `s`, where it is
/// new: programmed with the chains it alone jumps to there (and the
/// small ones it shares, [`fits`]) written in ([`super::inline`]); a
/// list chain that had one of those written in until now jumps to a
/// shared copy again.
pub(super) fn put_list(
    l: &mut Placement,
    main: &ChainTable,
    shard: &mut ChainTable,
    s: usize,
    list: &str,
    body: Vec<Rule>,
) -> Result<(), RuleError> {
    let targets = chain_targets(l, &body);
    l.lists[s].insert(list.to_string(), body);
    let shared = hold(l, main, s, list, targets, true);
    if let Err(e) = render_list(l, main, shard, s, list) {
        remove_list(l, main, shard, s, list)?;
        return Err(e);
    }
    for other in shared {
        render_list(l, main, shard, s, &other)?;
    }
    Ok(())
}

/// Policy list chain `list` out of shard `s` (and what it alone jumped
/// to); a list chain left alone with a chain it shared (or few enough
/// of them, [`fits`]) has it written in.
pub(super) fn remove_list(
    l: &mut Placement,
    main: &ChainTable,
    shard: &mut ChainTable,
    s: usize,
    list: &str,
) -> Result<(), RuleError> {
    let Some(body) = l.lists[s].remove(list) else {
        return Ok(());
    };
    take_out(l, shard, s, list);
    let targets = chain_targets(l, &body);
    for other in hold(l, main, s, list, targets, false) {
        render_list(l, main, shard, s, &other)?;
    }
    Ok(())
}

/// Shard `s`'s policy list chain `list` programmed from its rules and
/// what the chains it jumps to hold now, and the copies it jumps to
/// counted.
pub(super) fn render_list(
    l: &mut Placement,
    main: &ChainTable,
    shard: &mut ChainTable,
    s: usize,
    list: &str,
) -> Result<(), RuleError> {
    let Some(body) = l.lists[s].get(list) else {
        return Ok(());
    };
    let marks = Marks {
        accept: l.accept,
        pass: l.pass,
        chain_prefix: &l.chain_prefix,
    };
    let holders = &l.holders[s];
    let rendered = marks.render(
        body,
        |t| {
            let rules = main.chain(t)?;
            fits(holders.get(t)?.len(), rules.len()).then_some(rules)
        },
        |t| main.chain(t),
    );
    let old: BTreeSet<String> = targets(shard, list).into_iter().collect();
    shard.set_chain(list, rendered)?;
    let new: BTreeSet<String> = targets(shard, list).into_iter().collect();
    for t in new.difference(&old) {
        add_ref(l, main, shard, s, t);
    }
    for t in old.difference(&new) {
        drop_ref(l, shard, s, t);
    }
    Ok(())
}

/// Shard `s`'s copy of filter's chain `name` made what filter holds (and
/// the chains it jumps to copied too).
pub(super) fn copy(
    l: &mut Placement,
    main: &ChainTable,
    shard: &mut ChainTable,
    s: usize,
    name: &str,
) {
    let Some(chain) = main.desired(name) else {
        // Not (yet) set in filter: the managers jump only to chains they
        // set, so the endpoint chain that jumps here is being re-rendered.
        return;
    };
    let old = targets(shard, name);
    let new: Vec<String> = chain.targets().map(str::to_string).collect();
    shard.put(name, chain.clone());
    let (old_set, new_set): (HashSet<&String>, HashSet<&String>) =
        (old.iter().collect(), new.iter().collect());
    for t in new_set.difference(&old_set) {
        add_ref(l, main, shard, s, t);
    }
    for t in old_set.difference(&new_set) {
        drop_ref(l, shard, s, t);
    }
}
