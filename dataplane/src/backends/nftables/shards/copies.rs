//! What the shards hold besides their dispatch: copies of filter's chains
//! (counted by the chains there that jump to them) and the policy list
//! chains (counted by the endpoint chains they stand for).

use std::collections::{HashMap, HashSet};

use super::Placement;
use crate::backends::desired::RuleTable;
use crate::backends::nftables::chains::ChainTable;

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
pub(super) fn release(l: &mut Placement, shard: &mut ChainTable, s: usize, list: &str) {
    if last_gone(&mut l.users[s], list) {
        take_out(l, shard, s, list);
    }
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
