//! From what the managers want and what the kernel holds to one commit:
//! pure (desired and observed in, [`Op`]s and the state they leave out),
//! so every case is tested without a kernel.
//!
//! One nf_tables table per iptables table (`<prefix>-raw`, `-mangle`,
//! `-nat`, `-filter`), each holding the chains its hooks reach, a base
//! chain per built-in chain with our hooks, the IP sets its rules look up
//! and the port lists they use. Per table: a chain whose rules' comments
//! differ from ours is flushed and written whole; a chain nothing reaches
//! any more is flushed and removed; a set changes by its members' delta
//! (or, after a read, by the difference from what the kernel holds); a
//! table with nothing wanted in it is removed. The ops are ordered so
//! that the batch is valid at every step: flushes, sets and their
//! elements, chains, rules, then removals.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::chains::{ChainTable, DesiredChain, base_chain};
use super::intervals::{self, Range};
use super::ops::{Family, Key, KeyType, Op, SetInfo};
use super::sets::{Change, DesiredSets, key, key as key_of, kind, ranges};
use super::translate::{Dispatch, PortSet};
use crate::backends::desired::RuleTable;

const NFT_SET_INTERVAL: u32 = 0x4;
const NFT_SET_MAP: u32 = 0x8;

/// A chain as read back or as last written.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObservedChain {
    /// Hook number and priority of a base chain.
    pub hook: Option<(u32, i32)>,
    /// Each rule's comment, in order.
    pub comments: std::sync::Arc<[String]>,
}

/// One of our tables as read back or as last written.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObservedTable {
    pub chains: BTreeMap<String, ObservedChain>,
    /// By name, in no order: a member's plan looks its set up in every
    /// table (33 at the default shards; a `BTreeMap`'s string compares,
    /// cold in cache, were ~0.05 ms of a member's apply).
    pub sets: HashMap<String, SetInfo>,
    /// Each dispatch map's entries: interface → the chain its element
    /// goes to (`""`: a verdict none of ours).
    pub maps: BTreeMap<String, BTreeMap<String, String>>,
}

/// Our tables of one family, by name.
pub type Observed = BTreeMap<String, ObservedTable>;

/// What a set holds in the kernel, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    Keys(HashSet<Key>),
    Ranges(Vec<Range>),
    /// A port list's interval elements.
    Intervals(Vec<(Key, bool)>),
}

/// What a read found: the tables it read, each planned whole against
/// what it found, and what their sets hold. A table of ours the read did
/// not take (one a commit touched while it was read) is planned from
/// what was last written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Contents {
    /// The tables read (also one found gone).
    pub tables: HashSet<String>,
    /// What each set of theirs holds, by (table, set).
    pub sets: HashMap<(String, String), Content>,
}

impl Contents {
    pub fn new() -> Self {
        Self::default()
    }

    /// What set `key` (table, set) holds, if its table was read.
    pub fn get(&self, key: &(String, String)) -> Option<&Content> {
        self.sets.get(key)
    }

    /// Whether table `name` was read.
    pub fn read(&self, name: &str) -> bool {
        self.tables.contains(name)
    }

    /// Takes in the read of another table.
    pub fn extend(&mut self, other: Contents) {
        self.tables.extend(other.tables);
        self.sets.extend(other.sets);
    }
}

/// The sets' contents; the tables read are those they are in.
impl FromIterator<((String, String), Content)> for Contents {
    fn from_iter<I: IntoIterator<Item = ((String, String), Content)>>(iter: I) -> Self {
        let sets: HashMap<(String, String), Content> = iter.into_iter().collect();
        let tables = sets.keys().map(|(t, _)| t.clone()).collect();
        Self { tables, sets }
    }
}

impl<const N: usize> From<[((String, String), Content); N]> for Contents {
    fn from(sets: [((String, String), Content); N]) -> Self {
        sets.into_iter().collect()
    }
}

/// A port list's element: a key, and whether it ends an interval.
type IntervalKey = (Key, bool);

/// Why no commit can be planned. Retrying helps once the managers' state
/// or the kernel's changes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A rule looks up a set the managers have not defined (yet).
    #[error("table {table}: a rule looks up set {set}, which is not defined")]
    MissingSet { table: String, set: String },
    /// A set was re-added before the kernel's copy was read: read first.
    #[error("table {table}: set {set} must be read back before it is rewritten")]
    NeedRead { table: String, set: String },
}

/// One change a cheap plan makes to what a table holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Patch {
    /// A chain rewritten: its name and what it holds now.
    Chain(String, ObservedChain),
    /// A port list added.
    Set(SetInfo),
    /// A dispatch map's entries changed: what it holds now.
    Map(String, BTreeMap<String, String>),
    /// A chain removed.
    ChainGone(String),
}

/// What one table holds after a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableAfter {
    /// Planned whole: all it holds.
    Whole(ObservedTable),
    /// Planned from its changes: what changed (nothing, for a table whose
    /// sets' members alone changed).
    Patched(Vec<Patch>),
    Removed,
}

/// A planned commit and what the kernel holds after it.
#[derive(Debug, Default)]
pub struct Plan {
    pub ops: Vec<Op>,
    /// Each of our tables the commit touches (not one it leaves as is).
    pub tables: BTreeMap<String, TableAfter>,
    /// Interval sets' ranges after it, by (table, set), where they were
    /// written or (a table planned whole) all of its.
    pub ranges: HashMap<(String, String), Vec<Range>>,
}

impl Plan {
    /// Whether any table was planned whole (every chain looked at).
    pub fn any_whole(&self) -> bool {
        self.whole_tables().next().is_some()
    }

    /// The tables planned whole.
    pub fn whole_tables(&self) -> impl Iterator<Item = &str> {
        self.tables
            .iter()
            .filter(|(_, t)| matches!(t, TableAfter::Whole(_)))
            .map(|(n, _)| n.as_str())
    }

    /// `observed` and `written` (interval sets' ranges) as the commit
    /// leaves them; the names of the tables whose contents changed.
    pub fn apply_to(
        self,
        observed: &mut Observed,
        written: &mut HashMap<(String, String), Vec<Range>>,
    ) -> Vec<String> {
        let mut changed = Vec::new();
        for (name, after) in self.tables {
            match after {
                TableAfter::Whole(t) => {
                    written.retain(|(table, _), _| *table != name);
                    observed.insert(name.clone(), t);
                }
                TableAfter::Patched(patches) if patches.is_empty() => continue,
                TableAfter::Patched(patches) => {
                    let t = observed.entry(name.clone()).or_default();
                    for p in patches {
                        match p {
                            Patch::Chain(chain, c) => {
                                t.chains.insert(chain, c);
                            }
                            Patch::Set(info) => {
                                t.sets.insert(info.name.clone(), info);
                            }
                            Patch::Map(map, entries) => {
                                t.maps.insert(map, entries);
                            }
                            Patch::ChainGone(chain) => {
                                t.chains.remove(&chain);
                            }
                        }
                    }
                }
                TableAfter::Removed => {
                    written.retain(|(table, _), _| *table != name);
                    observed.remove(&name);
                }
            }
            changed.push(name);
        }
        written.extend(self.ranges);
        changed
    }
}

/// The table name of iptables table `table`.
pub fn table_name(chain_prefix: &str, table: &str) -> String {
    format!("{chain_prefix}{table}")
}

fn set_info(name: &str, key: KeyType, interval: bool) -> SetInfo {
    let (key_type, key_len) = key.code();
    SetInfo {
        name: name.to_string(),
        key_type,
        key_len,
        flags: if interval { NFT_SET_INTERVAL } else { 0 },
    }
}

fn same_kind(a: &SetInfo, b: &SetInfo) -> bool {
    let f = NFT_SET_INTERVAL | NFT_SET_MAP;
    a.key_type == b.key_type && a.key_len == b.key_len && a.flags & f == b.flags & f
}

/// The ops that take interval set `set` of `table` from ranges `gone` to
/// ranges `came` (removals first).
fn push_ranges(
    out: &mut Vec<Op>,
    family: Family,
    table: &str,
    set: &str,
    gone: Vec<Range>,
    came: Vec<Range>,
) {
    if !gone.is_empty() {
        out.push(Op::DestroyRanges {
            family,
            table: table.to_string(),
            set: set.to_string(),
            ranges: gone,
        });
    }
    if !came.is_empty() {
        out.push(Op::AddRanges {
            family,
            table: table.to_string(),
            set: set.to_string(),
            ranges: came,
        });
    }
}

/// The ops that make IP set `set` of `table` (key type `k`, an interval
/// set or not) with every member of `d`; an interval set's ranges.
fn push_new_set(
    out: &mut Vec<Op>,
    family: Family,
    table: &str,
    set: &str,
    d: &super::sets::DesiredSet,
    (k, interval): (KeyType, bool),
) -> Option<Vec<Range>> {
    out.push(Op::AddSet {
        family,
        table: table.to_string(),
        set: set.to_string(),
        key: k,
        interval,
    });
    if interval {
        let r = ranges(&d.members);
        if !r.is_empty() {
            out.push(Op::AddRanges {
                family,
                table: table.to_string(),
                set: set.to_string(),
                ranges: r.clone(),
            });
        }
        return Some(r);
    }
    let keys: Vec<Key> = d.members.iter().filter_map(key).collect();
    if !keys.is_empty() {
        out.push(Op::AddElements {
            family,
            table: table.to_string(),
            set: set.to_string(),
            elements: keys,
        });
    }
    None
}

/// Chain `chain` of `table` no longer wanted: emptied with the flushes
/// (a rule in it may jump to another chain removed), removed after the
/// rules are written and the map elements that went to it are gone.
fn push_chain_removal(
    flushes: &mut Vec<Op>,
    removals: &mut Vec<Op>,
    family: Family,
    table: &str,
    chain: &str,
) {
    flushes.push(Op::FlushChain {
        family,
        table: table.to_string(),
        chain: chain.to_string(),
    });
    removals.push(Op::DestroyChain {
        family,
        table: table.to_string(),
        chain: chain.to_string(),
    });
}

/// The ops that remove `del` from and add `add` to hash set `set` of
/// `table`.
fn push_elements(
    out: &mut Vec<Op>,
    family: Family,
    table: &str,
    set: &str,
    del: Vec<Key>,
    add: Vec<Key>,
) {
    if !del.is_empty() {
        out.push(Op::DestroyElements {
            family,
            table: table.to_string(),
            set: set.to_string(),
            elements: del,
        });
    }
    if !add.is_empty() {
        out.push(Op::AddElements {
            family,
            table: table.to_string(),
            set: set.to_string(),
            elements: add,
        });
    }
}

/// The element ops that bring dispatch map `d` of `table` from `have`
/// (what the kernel holds) to its entries: the elements of interfaces
/// gone or moved removed, those new or moved added (in the stage after
/// the chains they go to, before any chain is removed); its entries
/// after them.
fn map_delta(
    out: &mut Vec<Op>,
    family: Family,
    table: &str,
    d: &Dispatch,
    have: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let want: BTreeMap<String, String> = d.entries.iter().cloned().collect();
    let gone: Vec<Key> = have
        .iter()
        .filter(|(i, c)| want.get(*i) != Some(*c))
        .map(|(i, _)| Key::ifname(i))
        .collect();
    let came: Vec<(Key, super::expr::Verdict)> = want
        .iter()
        .filter(|(i, c)| have.get(*i) != Some(*c))
        .map(|(i, c)| (Key::ifname(i), super::expr::Verdict::Goto(c.clone())))
        .collect();
    if !gone.is_empty() {
        out.push(Op::DestroyElements {
            family,
            table: table.to_string(),
            set: d.name.clone(),
            elements: gone,
        });
    }
    if !came.is_empty() {
        out.push(Op::AddVerdicts {
            family,
            table: table.to_string(),
            map: d.name.clone(),
            entries: came,
        });
    }
    want
}

/// The ops of one table, grouped by when they run in the batch.
#[derive(Default)]
struct Stages {
    tables: Vec<Op>,
    flushes: Vec<Op>,
    set_removals: Vec<Op>,
    sets: Vec<Op>,
    chains: Vec<Op>,
    /// Dispatch maps' entries: after the chains they go to.
    map_elements: Vec<Op>,
    rules: Vec<Op>,
    chain_removals: Vec<Op>,
    stale_sets: Vec<Op>,
    table_removals: Vec<Op>,
}

/// How one table is planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// From its changes alone ([`changes::cheap`]).
    Cheap,
    /// Every chain its hooks reach ([`table::TableCtx`]).
    Whole,
}

/// Plans one commit for all of `tables` (one IP version, `family`).
/// A table a read took (`contents`) is planned whole. Otherwise a table is
/// planned from its changes alone when its hooks did not change
/// ([`changes::cheap`], also where chains came, went or were pointed
/// elsewhere; the table that holds every set is planned whole then, and
/// when it must take a set): at 50,000 rules a whole plan
/// walks every chain, and most tables, most of the time, change by a few
/// rules or members or not at all. Where IP-set members alone changed,
/// the commit is their elements alone ([`members_only`]).
pub fn plan(input: Input<'_>) -> Result<Plan, PlanError> {
    match members_only(input) {
        Some(p) => Ok(p),
        None => plan_tables(input),
    }
}

/// What one commit is planned from.
#[derive(Debug, Clone, Copy)]
pub struct Input<'a> {
    /// The IP version's family.
    pub family: Family,
    pub chain_prefix: &'a str,
    /// Every table of ours that the dataplane has.
    pub tables: &'a [&'a ChainTable],
    pub sets: &'a DesiredSets,
    /// What the kernel holds, as last read or written.
    pub observed: &'a Observed,
    /// What a read found: each table it took is planned whole and its
    /// sets diffed against it.
    pub contents: Option<&'a Contents>,
}

/// [`plan`], table by table.
fn plan_tables(input: Input<'_>) -> Result<Plan, PlanError> {
    let Input {
        family,
        chain_prefix,
        tables,
        sets,
        observed,
        contents,
    } = input;
    let mut st = Stages::default();
    let mut out = Plan::default();
    let names: Vec<String> = tables
        .iter()
        .map(|t| table_name(chain_prefix, t.table()))
        .collect();
    let wanted_tables: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    // A table read back, and every table once a set is gone (its
    // elements must leave every table that held it), is planned whole.
    let whole_only = |name: &str| sets.removed_any || contents.is_some_and(|c| c.read(name));
    // The cheap plans of the tables that need no whole plan (those that
    // hold every set are decided below, once it is known which sets the
    // others use).
    let mut cheap: Vec<Option<changes::Cheap>> = tables
        .iter()
        .zip(&names)
        .map(|(t, n)| {
            let obs = observed.get(n)?;
            if whole_only(n) || t.reshaped || t.all_sets {
                return None;
            }
            changes::cheap(family, n, t, sets, obs)
        })
        .collect();
    let mut reaches: Vec<Option<HashSet<&str>>> = tables
        .iter()
        .zip(&cheap)
        .map(|(t, c)| (c.is_none() && !t.all_sets).then(|| t.reachable()))
        .collect();
    // A table that holds every set (the rest, sharded) is planned from its
    // changes when it holds each it must already; one it holds and need
    // not any more stays until its next whole plan. After the last commit
    // every set was held somewhere; since then a table planned from its
    // changes has dropped none and one planned whole will hold just the
    // sets its chains reach. So only the sets new since then and those a
    // whole-planned table holds but will not can be missing: checked alone,
    // without gathering every set of every shard (hashing them all took a
    // member's apply ~1 ms and ~6% of the daemon under churn at 10,000
    // endpoints).
    let spare = tables.iter().any(|t| t.spare_sets_only);
    let mut whole_reach: HashSet<&str> = HashSet::new();
    let mut dropped: Vec<&str> = Vec::new();
    if spare {
        let whole: Vec<usize> = (0..tables.len())
            .filter(|&i| !tables[i].all_sets && cheap[i].is_none())
            .collect();
        for &i in &whole {
            let reach = reaches[i].as_ref().expect("a whole plan's reach");
            whole_reach.extend(reached_sets(tables[i], reach));
        }
        for &i in &whole {
            let held = observed
                .get(&names[i])
                .into_iter()
                .flat_map(|o| o.sets.keys());
            dropped.extend(
                held.map(String::as_str)
                    .filter(|s| sets.sets.contains_key(*s) && !whole_reach.contains(s)),
            );
        }
    }
    // Sets the tables planned from their changes take in this commit (a
    // new list chain's).
    let taken: HashSet<String> = cheap
        .iter()
        .flatten()
        .flat_map(|c| &c.patches)
        .filter_map(|p| match p {
            Patch::Set(info) => Some(info.name.clone()),
            _ => None,
        })
        .collect();
    for (i, t) in tables.iter().enumerate() {
        if !t.all_sets || whole_only(&names[i]) || t.reshaped || t.regraphed {
            continue;
        }
        let Some(obs) = observed.get(&names[i]) else {
            continue;
        };
        let held = |s: &str| {
            obs.sets.contains_key(s)
                || (t.spare_sets_only
                    && (whole_reach.contains(s)
                        || taken.contains(s)
                        || tables.iter().zip(&names).zip(&cheap).any(|((o, n), c)| {
                            !o.all_sets
                                && c.is_some()
                                && observed.get(n).is_some_and(|x| x.sets.contains_key(s))
                        })))
        };
        let new = sets
            .changes
            .iter()
            .filter(|(_, c)| matches!(c, Change::Whole))
            .map(|(s, _)| s.as_str());
        if new.chain(dropped.iter().copied()).all(held) {
            cheap[i] = changes::cheap(family, &names[i], t, sets, obs);
        }
    }
    // A table that holds the sets no other table looks up, planned whole:
    // which those are.
    let spare_whole = tables
        .iter()
        .zip(&cheap)
        .any(|(t, c)| t.all_sets && t.spare_sets_only && c.is_none());
    let used = if spare_whole {
        let mut used = used_sets(tables, &names, &reaches, observed, sets);
        used.extend(
            taken
                .iter()
                .filter_map(|s| sets.sets.get_key_value(s).map(|(k, _)| k.as_str())),
        );
        used
    } else {
        HashSet::new()
    };
    for (i, (t, name)) in tables.iter().zip(&names).enumerate() {
        let obs = observed.get(name);
        let mode = if cheap[i].is_some() {
            Mode::Cheap
        } else {
            Mode::Whole
        };
        if mode == Mode::Cheap {
            let c = cheap[i].take().expect("cheap");
            st.flushes.extend(c.flushes);
            st.sets.extend(c.sets);
            st.chains.extend(c.chains);
            st.map_elements.extend(c.map_elements);
            st.rules.extend(c.rules);
            st.chain_removals.extend(c.chain_removals);
            out.ranges.extend(c.ranges);
            out.tables
                .insert(name.clone(), TableAfter::Patched(c.patches));
            continue;
        }
        let reach = reaches[i].take().unwrap_or_else(|| t.reachable());
        let all_sets = t.all_sets
            && if t.spare_sets_only {
                sets.sets.keys().any(|s| !used.contains(s.as_str()))
            } else {
                !sets.sets.is_empty()
            };
        if reach.is_empty() && t.hooks.is_empty() && !all_sets {
            if obs.is_some() {
                st.table_removals.push(Op::DestroyTable {
                    family,
                    table: name.clone(),
                });
                out.tables.insert(name.clone(), TableAfter::Removed);
            }
            continue;
        }
        let ctx = table::TableCtx {
            family,
            name,
            table: t,
            sets,
            obs,
            contents,
            used: &used,
        };
        let after = ctx.plan(&reach, &mut st, &mut out.ranges)?;
        out.tables.insert(name.clone(), TableAfter::Whole(after));
    }
    // Tables of ours that no table object names (an older layout's).
    for name in observed.keys() {
        if !wanted_tables.contains(name.as_str()) {
            st.table_removals.push(Op::DestroyTable {
                family,
                table: name.clone(),
            });
            out.tables.insert(name.clone(), TableAfter::Removed);
        }
    }
    out.ops = [
        st.tables,
        st.flushes,
        st.set_removals,
        st.sets,
        st.chains,
        st.map_elements,
        st.rules,
        st.chain_removals,
        st.stale_sets,
        st.table_removals,
    ]
    .concat();
    Ok(out)
}

/// The plan when IP-set members alone changed since the last commit (no
/// chain, hook or set came, went or changed; no read came back): the
/// elements, in each table that holds a changed set. No table's chains
/// or sets change, so none is named in [`Plan::tables`]. It is what the
/// plan of every table from its changes comes to then, without the 33
/// tables' (at the default shards) bookkeeping: the common case, a
/// member added. `None` when anything else changed, a table of ours is
/// not one of `tables`, or a set is to be written whole.
fn members_only(input: Input<'_>) -> Option<Plan> {
    let (sets, observed) = (input.sets, input.observed);
    let members_alone = input.contents.is_none()
        && !sets.removed_any
        && input.tables.iter().all(|t| !t.changed)
        && sets
            .changes
            .values()
            .all(|c| matches!(c, Change::Delta { .. }));
    if !members_alone {
        return None;
    }
    let mut out = Plan::default();
    let mut elements = changes::Cheap::default();
    let mut ours = 0;
    for t in input.tables {
        let name = table_name(input.chain_prefix, t.table());
        match observed.get(&name) {
            Some(obs) => {
                ours += 1;
                changes::members(input.family, &name, obs, sets, &mut elements)?;
            }
            // Not programmed, and nothing to program (raw and mangle
            // without host endpoint policy).
            None if t.hooks.is_empty() && t.chains.is_empty() && !t.all_sets => {}
            None => return None,
        }
    }
    if ours != observed.len() {
        return None; // a table of ours no table object names: removed
    }
    out.ops = elements.sets;
    out.ranges.extend(elements.ranges);
    Some(out)
}

/// The sets the tables that do not hold every set look up: a table
/// planned whole, by the chains it reaches (`reaches`); one planned from
/// its changes, by the sets it holds (and those it takes in this commit,
/// added by the caller).
fn used_sets<'a>(
    tables: &[&'a ChainTable],
    names: &[String],
    reaches: &[Option<HashSet<&'a str>>],
    observed: &'a Observed,
    sets: &'a DesiredSets,
) -> HashSet<&'a str> {
    let mut used: HashSet<&str> = HashSet::new();
    for (i, t) in tables.iter().enumerate() {
        if t.all_sets {
            continue;
        }
        let Some(reach) = &reaches[i] else {
            let held = observed
                .get(&names[i])
                .into_iter()
                .flat_map(|o| o.sets.keys());
            used.extend(held.filter_map(|s| sets.sets.get_key_value(s).map(|(k, _)| k.as_str())));
            continue;
        };
        used.extend(reached_sets(t, reach));
    }
    used
}

/// The sets the chains `reach` of table `t` (and its hooks) look up.
fn reached_sets<'a>(t: &'a ChainTable, reach: &HashSet<&'a str>) -> impl Iterator<Item = &'a str> {
    reach
        .iter()
        .filter_map(|c| t.chains.get(*c))
        .chain(t.hooks.values())
        .flat_map(|c| &c.translated)
        .flat_map(|tr| tr.sets.iter().map(String::as_str))
}

mod changes;
mod table;

#[cfg(test)]
mod tests;
