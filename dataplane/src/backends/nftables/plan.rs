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
    pub sets: BTreeMap<String, SetInfo>,
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

/// The sets' contents as read, by (table, set).
pub type Contents = HashMap<(String, String), Content>;

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

/// A planned commit and what the kernel holds after it.
#[derive(Debug, Default)]
pub struct Plan {
    pub ops: Vec<Op>,
    pub after: Observed,
    /// Interval sets' ranges after it, by (table, set).
    pub ranges: HashMap<(String, String), Vec<Range>>,
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

/// Plans one commit for all of `tables` (one IP version, `family`).
/// `contents` is what a read found in the sets (then sets are diffed
/// against it); without it, the sets' uncommitted changes are written.
pub fn plan(
    family: Family,
    chain_prefix: &str,
    tables: &[&ChainTable],
    sets: &DesiredSets,
    observed: &Observed,
    contents: Option<&Contents>,
) -> Result<Plan, PlanError> {
    let mut st = Stages::default();
    let mut out = Plan::default();
    let names: Vec<String> = tables
        .iter()
        .map(|t| table_name(chain_prefix, t.table()))
        .collect();
    let wanted_tables: BTreeSet<String> = names.iter().cloned().collect();
    // A table none of whose chains changed (most shards, most of the
    // time) is planned for its sets' members alone, as written last (not
    // one that holds every set: a new set goes there with no chain
    // changed).
    let quiet = |t: &ChainTable, obs: Option<&ObservedTable>| {
        obs.is_some() && contents.is_none() && !t.changed && !t.all_sets && !sets.removed_any
    };
    let mut reaches: Vec<Option<HashSet<&str>>> = tables
        .iter()
        .zip(&names)
        .map(|(t, n)| (!quiet(t, observed.get(n))).then(|| t.reachable()))
        .collect();
    // The sets some table's rules look up (a quiet table's: those it
    // holds), for a table that holds the others.
    let mut used: HashSet<&str> = HashSet::new();
    if tables.iter().any(|t| t.spare_sets_only) {
        for ((t, reach), n) in tables.iter().zip(&reaches).zip(&names) {
            let Some(reach) = reach else {
                let held = observed.get(n).into_iter().flat_map(|o| o.sets.keys());
                used.extend(
                    held.filter_map(|s| sets.sets.get_key_value(s).map(|(k, _)| k.as_str())),
                );
                continue;
            };
            let chains = reach
                .iter()
                .filter_map(|c| t.chains.get(*c))
                .chain(t.hooks.values());
            for c in chains {
                for tr in &c.translated {
                    used.extend(tr.sets.iter().map(String::as_str));
                }
            }
        }
    }
    for (i, (t, name)) in tables.iter().zip(names).enumerate() {
        let obs = observed.get(&name);
        if let Some(o) = obs
            && quiet(t, obs)
            && let Some(after) = members_only(family, &name, o, sets, &mut st.sets, &mut out.ranges)
        {
            out.after.insert(name, after);
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
                    table: name,
                });
            }
            continue;
        }
        let ctx = TableCtx {
            family,
            name: &name,
            table: t,
            sets,
            obs,
            contents,
            used: &used,
        };
        let after = ctx.plan(&reach, &mut st, &mut out.ranges)?;
        out.after.insert(name, after);
    }
    // Tables of ours that no table object names (an older layout's).
    for name in observed.keys() {
        if !wanted_tables.contains(name) {
            st.table_removals.push(Op::DestroyTable {
                family,
                table: name.clone(),
            });
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

/// Table `table` as `obs` (the last write) with its sets' members
/// changed: the element ops into `ops`, the interval sets' ranges into
/// `ranges`. `None` when a set of it is to be written whole (a full plan
/// of the table then).
fn members_only(
    family: Family,
    table: &str,
    obs: &ObservedTable,
    sets: &DesiredSets,
    ops: &mut Vec<Op>,
    ranges_out: &mut HashMap<(String, String), Vec<Range>>,
) -> Option<ObservedTable> {
    let mut mine = Vec::new();
    for s in obs.sets.keys() {
        let Some(d) = sets.sets.get(s) else {
            continue; // a port list, or a set going with a full plan
        };
        let (_, interval) = kind(d.meta.set_type, sets.version_of());
        let key = (table.to_string(), s.clone());
        match sets.changes.get(s) {
            Some(Change::Whole) => return None,
            Some(Change::Delta { add, del }) => {
                if interval {
                    let have = sets.written_ranges.get(&key)?;
                    let want = ranges(&d.members);
                    let (gone, came) = intervals::diff(have, &want);
                    push_ranges(&mut mine, family, table, s, gone, came);
                    ranges_out.insert(key, want);
                } else {
                    let del: Vec<Key> = del.iter().filter_map(key_of).collect();
                    let add: Vec<Key> = add.iter().filter_map(key_of).collect();
                    push_elements(&mut mine, family, table, s, del, add);
                }
            }
            None if interval => {
                ranges_out.insert(key.clone(), sets.written_ranges.get(&key)?.clone());
            }
            None => {}
        }
    }
    ops.extend(mine);
    Some(obs.clone())
}

struct TableCtx<'a> {
    family: Family,
    name: &'a str,
    table: &'a ChainTable,
    sets: &'a DesiredSets,
    obs: Option<&'a ObservedTable>,
    contents: Option<&'a Contents>,
    /// With `spare_sets_only`: the sets other tables hold.
    used: &'a HashSet<&'a str>,
}

impl TableCtx<'_> {
    fn plan(
        &self,
        reach: &HashSet<&str>,
        st: &mut Stages,
        ranges_out: &mut HashMap<(String, String), Vec<Range>>,
    ) -> Result<ObservedTable, PlanError> {
        let (family, table) = (self.family, self.name.to_string());
        let empty = ObservedTable::default();
        let obs = self.obs.unwrap_or(&empty);
        if self.obs.is_none() {
            st.tables.push(Op::AddTable {
                family,
                table: table.clone(),
            });
        }
        // Every chain to program: (name, chain, base).
        // By name; from the reachable ones when they are few (the sharded
        // filter holds every policy chain and programs few of them).
        let mut wanted: Vec<(&str, &DesiredChain, bool)> =
            if reach.len() * 4 < self.table.chains.len() {
                let mut w: Vec<(&str, &DesiredChain, bool)> = reach
                    .iter()
                    .filter_map(|n| self.table.chains.get_key_value(*n))
                    .map(|(n, c)| (n.as_str(), c, false))
                    .collect();
                w.sort_unstable_by_key(|(n, _, _)| *n);
                w
            } else {
                self.table
                    .chains
                    .iter()
                    .filter(|(n, _)| reach.contains(n.as_str()))
                    .map(|(n, c)| (n.as_str(), c, false))
                    .collect()
            };
        wanted.extend(self.table.hooks.iter().map(|(n, c)| (n.as_str(), c, true)));

        // The sets and port lists they look up; every set in the filter
        // table (where `nft list` finds them, and so a policy that starts
        // using a big set does not have to write it first).
        let mut needed: BTreeMap<&str, SetInfo> = BTreeMap::new();
        if self.table.all_sets {
            let spare = self.table.spare_sets_only;
            for (s, d) in &self.sets.sets {
                if spare && self.used.contains(s.as_str()) {
                    continue;
                }
                let (k, interval) = kind(d.meta.set_type, self.sets_version());
                needed.insert(s, set_info(s, k, interval));
            }
        }
        let mut ports: BTreeMap<&str, &PortSet> = BTreeMap::new();
        for (_, c, _) in &wanted {
            for t in &c.translated {
                for s in &t.sets {
                    let Some(d) = self.sets.sets.get(s) else {
                        return Err(PlanError::MissingSet {
                            table: table.clone(),
                            set: s.clone(),
                        });
                    };
                    let (k, interval) = kind(d.meta.set_type, self.sets_version());
                    needed.insert(s, set_info(s, k, interval));
                }
                for p in &t.port_sets {
                    ports.insert(&p.name, p);
                }
            }
        }
        let mut retyped: BTreeSet<&str> = needed
            .iter()
            .filter(|(s, info)| obs.sets.get(**s).is_some_and(|o| !same_kind(o, info)))
            .map(|(s, _)| *s)
            .collect();
        // Dispatch maps. One changed by hand (another kind, or other
        // interfaces than its name says) is made again, with the chain
        // that looks it up (a map in use cannot be removed).
        let mut maps: BTreeMap<&str, &Dispatch> = BTreeMap::new();
        for (_, c, _) in &wanted {
            for t in &c.translated {
                if let Some(d) = &t.dispatch {
                    maps.insert(&d.name, d);
                }
            }
        }
        let map_info = |name: &str| {
            let (key_type, key_len) = KeyType::IfName.code();
            SetInfo {
                name: name.to_string(),
                key_type,
                key_len,
                flags: NFT_SET_MAP,
            }
        };
        for (name, d) in &maps {
            let Some(o) = obs.sets.get(*name) else {
                continue;
            };
            let read = self
                .contents
                .and_then(|c| c.get(&(table.clone(), name.to_string())));
            let damaged = !same_kind(o, &map_info(name))
                || read.is_some_and(|r| match r {
                    Content::Keys(have) => {
                        let have: HashSet<Vec<u8>> = have.iter().map(Key::bytes).collect();
                        have.len() != d.entries.len()
                            || d.entries
                                .iter()
                                .any(|(i, _)| !have.contains(&Key::ifname(i).bytes()))
                    }
                    _ => true,
                });
            if damaged {
                retyped.insert(name);
            }
        }

        let mut after = ObservedTable::default();
        // Chains: new ones made, changed ones flushed and rewritten.
        for (name, c, base) in &wanted {
            let o = obs.chains.get(*name);
            let uses_retyped = c.translated.iter().any(|t| {
                t.sets.iter().any(|s| retyped.contains(s.as_str()))
                    || t.dispatch
                        .as_ref()
                        .is_some_and(|d| retyped.contains(d.name.as_str()))
            });
            let hook = if *base {
                base_chain(self.table.table(), name).map(|b| (b.hook as u32, b.priority))
            } else {
                None
            };
            let add_chain = || Op::AddChain {
                family,
                table: table.clone(),
                chain: name.to_string(),
                base: base.then(|| base_chain(self.table.table(), name)).flatten(),
            };
            let rewrite = match o {
                None => {
                    st.chains.push(add_chain());
                    true
                }
                Some(o) if o.hook != hook => {
                    // A base chain made again by hand at another hook or
                    // priority (or a chain of ours made a base chain):
                    // emptied, removed and made anew (nothing can jump to
                    // a base chain, so nothing holds it).
                    for op in [
                        Op::FlushChain {
                            family,
                            table: table.clone(),
                            chain: name.to_string(),
                        },
                        Op::DestroyChain {
                            family,
                            table: table.clone(),
                            chain: name.to_string(),
                        },
                    ] {
                        st.flushes.push(op);
                    }
                    st.chains.push(add_chain());
                    true
                }
                Some(o) if o.comments != c.comments || uses_retyped => {
                    st.flushes.push(Op::FlushChain {
                        family,
                        table: table.clone(),
                        chain: name.to_string(),
                    });
                    true
                }
                Some(_) => false,
            };
            if rewrite {
                for (t, comment) in c.translated.iter().zip(c.comments.iter()) {
                    st.rules.push(Op::AddRule {
                        family,
                        table: table.clone(),
                        chain: name.to_string(),
                        exprs: t.exprs.clone(),
                        comment: comment.clone(),
                    });
                }
            }
            after.chains.insert(
                name.to_string(),
                ObservedChain {
                    hook,
                    comments: c.comments.clone(),
                },
            );
        }
        // Chains no longer wanted: emptied first (a rule in one may jump
        // to another), removed after the rules are written.
        for name in obs.chains.keys() {
            if !after.chains.contains_key(name) {
                st.flushes.push(Op::FlushChain {
                    family,
                    table: table.clone(),
                    chain: name.clone(),
                });
                st.chain_removals.push(Op::DestroyChain {
                    family,
                    table: table.clone(),
                    chain: name.clone(),
                });
            }
        }

        // IP sets.
        for (s, info) in &needed {
            let d = &self.sets.sets[*s];
            let (k, interval) = kind(d.meta.set_type, self.sets_version());
            let here = obs.sets.contains_key(*s) && !retyped.contains(s);
            if retyped.contains(s) {
                st.set_removals.push(Op::DestroySet {
                    family,
                    table: table.clone(),
                    set: s.to_string(),
                });
            }
            let rkey = (table.clone(), s.to_string());
            if !here {
                st.sets.push(Op::AddSet {
                    family,
                    table: table.clone(),
                    set: s.to_string(),
                    key: k,
                    interval,
                });
                if interval {
                    let r = ranges(&d.members);
                    if !r.is_empty() {
                        st.sets.push(Op::AddRanges {
                            family,
                            table: table.clone(),
                            set: s.to_string(),
                            ranges: r.clone(),
                        });
                    }
                    ranges_out.insert(rkey, r);
                } else {
                    let keys: Vec<Key> = d.members.iter().filter_map(key).collect();
                    if !keys.is_empty() {
                        st.sets.push(Op::AddElements {
                            family,
                            table: table.clone(),
                            set: s.to_string(),
                            elements: keys,
                        });
                    }
                }
            } else {
                self.set_update(s, interval, st, ranges_out)?;
            }
            after.sets.insert(s.to_string(), info.clone());
        }
        // Port lists: constant, named by their contents.
        for (p, set) in &ports {
            let elements = set.elements();
            let read = self
                .contents
                .and_then(|c| c.get(&(table.clone(), p.to_string())));
            // Changed by hand (its name says what it must hold): what was
            // put there is taken out, what is missing added back (it
            // cannot be removed and made anew while rules use it).
            let (extra, missing): (Vec<IntervalKey>, Vec<IntervalKey>) =
                match (obs.sets.contains_key(*p), read) {
                    (false, _) => (Vec::new(), elements),
                    (true, Some(Content::Intervals(have))) => (
                        have.iter()
                            .filter(|e| !elements.contains(e))
                            .copied()
                            .collect(),
                        elements.into_iter().filter(|e| !have.contains(e)).collect(),
                    ),
                    // Read as another kind: ours cannot be; rewrite it all.
                    (true, Some(_)) => (Vec::new(), elements),
                    (true, None) => (Vec::new(), Vec::new()),
                };
            if !obs.sets.contains_key(*p) {
                st.sets.push(Op::AddSet {
                    family,
                    table: table.clone(),
                    set: p.to_string(),
                    key: KeyType::Port,
                    interval: true,
                });
            }
            if !extra.is_empty() {
                st.sets.push(Op::DestroyIntervals {
                    family,
                    table: table.clone(),
                    set: p.to_string(),
                    elements: extra,
                });
            }
            if !missing.is_empty() {
                st.sets.push(Op::AddIntervals {
                    family,
                    table: table.clone(),
                    set: p.to_string(),
                    elements: missing,
                });
            }
            after
                .sets
                .insert(p.to_string(), set_info(p, KeyType::Port, true));
        }
        for (name, d) in &maps {
            if !obs.sets.contains_key(*name) || retyped.contains(name) {
                if retyped.contains(name) {
                    st.set_removals.push(Op::DestroySet {
                        family,
                        table: table.clone(),
                        set: name.to_string(),
                    });
                }
                st.sets.push(Op::AddVerdictMap {
                    family,
                    table: table.clone(),
                    map: name.to_string(),
                    key: KeyType::IfName,
                });
                st.map_elements.push(Op::AddVerdicts {
                    family,
                    table: table.clone(),
                    map: name.to_string(),
                    entries: d.elements(),
                });
            }
            after.sets.insert(name.to_string(), map_info(name));
        }
        for (s, o) in &obs.sets {
            if !after.sets.contains_key(s) {
                // A map's entries hold the chains they go to: it goes
                // before any chain is removed (the rule that looked it up
                // was flushed first).
                let stage = if o.flags & NFT_SET_MAP != 0 {
                    &mut st.set_removals
                } else {
                    &mut st.stale_sets
                };
                stage.push(Op::DestroySet {
                    family,
                    table: table.clone(),
                    set: s.clone(),
                });
            }
        }
        Ok(after)
    }

    fn sets_version(&self) -> crate::model::IpVersion {
        self.table.version()
    }

    /// An existing set brought to its members: by difference from what a
    /// read found, or by the uncommitted delta.
    fn set_update(
        &self,
        s: &str,
        interval: bool,
        st: &mut Stages,
        ranges_out: &mut HashMap<(String, String), Vec<Range>>,
    ) -> Result<(), PlanError> {
        let (family, table) = (self.family, self.name.to_string());
        let d = &self.sets.sets[s];
        let rkey = (table.clone(), s.to_string());
        let read = self.contents.and_then(|c| c.get(&rkey));
        let change = self.sets.changes.get(s);
        if interval {
            let have = match (read, self.sets.written_ranges.get(&rkey)) {
                (Some(Content::Ranges(r)), _) => r.clone(),
                (_, Some(r)) if read.is_none() => r.clone(),
                _ => {
                    return Err(PlanError::NeedRead {
                        table,
                        set: s.to_string(),
                    });
                }
            };
            let want = if read.is_none() && change.is_none() {
                have.clone()
            } else {
                ranges(&d.members)
            };
            let (gone, came) = intervals::diff(&have, &want);
            push_ranges(&mut st.sets, family, &table, s, gone, came);
            ranges_out.insert(rkey, want);
            return Ok(());
        }
        let (add, del): (Vec<Key>, Vec<Key>) = match (read, change) {
            (Some(Content::Keys(have)), _) => {
                let want: HashSet<Key> = d.members.iter().filter_map(key).collect();
                (
                    want.difference(have).copied().collect(),
                    have.difference(&want).copied().collect(),
                )
            }
            (Some(_), _) | (None, Some(Change::Whole)) => {
                return Err(PlanError::NeedRead {
                    table,
                    set: s.to_string(),
                });
            }
            (None, Some(Change::Delta { add, del })) => (
                add.iter().filter_map(key).collect(),
                del.iter().filter_map(key).collect(),
            ),
            (None, None) => return Ok(()),
        };
        push_elements(&mut st.sets, family, &table, s, del, add);
        Ok(())
    }
}

/// One change to what the kernel holds, recorded by [`plan_changes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Patch {
    Chain {
        table: String,
        name: String,
        chain: ObservedChain,
    },
    Set {
        table: String,
        info: SetInfo,
    },
}

/// A commit planned from the changes alone.
#[derive(Debug, Default)]
pub struct Changes {
    pub ops: Vec<Op>,
    pub patches: Vec<Patch>,
    /// Interval sets' ranges after it, by (table, set).
    pub ranges: HashMap<(String, String), Vec<Range>>,
}

/// Plans one commit from what changed since the last one alone, without
/// looking at the rest (at 50,000 rules a [`plan`] walks every chain):
/// chains whose rules changed where nothing was reshaped, and set members
/// added or removed. `None` when it takes a full [`plan`]: after a read, a
/// chain added, removed or re-pointed, a hook changed, a set new, gone or
/// of a new type, an interval set not written by this process.
pub fn plan_changes(
    family: Family,
    chain_prefix: &str,
    tables: &[&ChainTable],
    sets: &DesiredSets,
    observed: &Observed,
) -> Option<Changes> {
    if sets.removed_any
        || tables.iter().any(|t| t.reshaped)
        || sets.changes.values().any(|c| *c == Change::Whole)
    {
        return None;
    }
    let mut out = Changes::default();
    let (mut flushes, mut set_ops, mut rules) = (Vec::new(), Vec::new(), Vec::new());
    for t in tables {
        let table = table_name(chain_prefix, t.table());
        for name in &t.touched {
            let Some(c) = t.chains.get(name) else {
                continue;
            };
            let Some(obs) = observed.get(&table) else {
                continue; // nothing of this table is programmed
            };
            let Some(o) = obs.chains.get(name) else {
                continue; // not reached from a hook: not programmed
            };
            if o.comments == c.comments {
                continue;
            }
            // What its rules look up must be in the table; a dispatch
            // map is made with the full plan.
            if c.translated.iter().any(|t| t.dispatch.is_some()) {
                return None;
            }
            for tr in &c.translated {
                for s in &tr.sets {
                    if !obs.sets.contains_key(s) {
                        return None;
                    }
                }
                for p in &tr.port_sets {
                    let added = out.patches.iter().any(
                        |x| matches!(x, Patch::Set { table: tb, info } if *tb == table && info.name == p.name),
                    );
                    if !obs.sets.contains_key(&p.name) && !added {
                        set_ops.push(Op::AddSet {
                            family,
                            table: table.clone(),
                            set: p.name.clone(),
                            key: KeyType::Port,
                            interval: true,
                        });
                        set_ops.push(Op::AddIntervals {
                            family,
                            table: table.clone(),
                            set: p.name.clone(),
                            elements: p.elements(),
                        });
                        out.patches.push(Patch::Set {
                            table: table.clone(),
                            info: set_info(&p.name, KeyType::Port, true),
                        });
                    }
                }
            }
            flushes.push(Op::FlushChain {
                family,
                table: table.clone(),
                chain: name.clone(),
            });
            for (tr, comment) in c.translated.iter().zip(c.comments.iter()) {
                rules.push(Op::AddRule {
                    family,
                    table: table.clone(),
                    chain: name.clone(),
                    exprs: tr.exprs.clone(),
                    comment: comment.clone(),
                });
            }
            out.patches.push(Patch::Chain {
                table: table.clone(),
                name: name.clone(),
                chain: ObservedChain {
                    hook: o.hook,
                    comments: c.comments.clone(),
                },
            });
        }
    }
    // Members: in every table that holds the set.
    for (s, change) in &sets.changes {
        let Change::Delta { add, del } = change else {
            return None;
        };
        let Some(d) = sets.sets.get(s) else {
            continue;
        };
        let (_, interval) = kind(d.meta.set_type, sets.version_of());
        for (table, obs) in observed {
            if !obs.sets.contains_key(s) {
                continue;
            }
            if interval {
                let key = (table.clone(), s.clone());
                let have = sets.written_ranges.get(&key)?;
                let want = ranges(&d.members);
                let (gone, came) = intervals::diff(have, &want);
                push_ranges(&mut set_ops, family, table, s, gone, came);
                out.ranges.insert(key, want);
                continue;
            }
            let del: Vec<Key> = del.iter().filter_map(key).collect();
            let add: Vec<Key> = add.iter().filter_map(key).collect();
            push_elements(&mut set_ops, family, table, s, del, add);
        }
    }
    out.ops = [flushes, set_ops, rules].concat();
    Some(out)
}

#[cfg(test)]
mod tests {
    /// [`plan`] of IPv4 tables `tables` with our prefix.
    fn plan_v4(
        tables: &[ChainTable],
        sets: &DesiredSets,
        observed: &Observed,
        contents: Option<&Contents>,
    ) -> Result<Plan, PlanError> {
        plan(Family::Ip, "dph-", &refs(tables), sets, observed, contents)
    }

    /// The tables as the plans take them.
    fn refs(tables: &[ChainTable]) -> Vec<&ChainTable> {
        tables.iter().collect()
    }

    use super::*;
    use crate::backends::desired::SetStore;
    use crate::backends::ipsets::Meta;
    use crate::backends::iptables::{Ownership, Rule};
    use crate::model::IpVersion;
    use crate::model::ipsets::{IpSetType, Member, SetNames};

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
            t.touched.clear();
        }
    }

    /// A full plan takes a table none of whose chains changed as it was
    /// written, with its sets' new members only.
    #[test]
    fn a_quiet_table_gets_its_members_alone() {
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
        // filter changes (a new chain: a full plan); raw does not.
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
        assert!(
            names(&again.ops).contains(&"adding 1 elements to dph-filter/dph40s".to_string()),
            "{:?}",
            names(&again.ops)
        );
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
    /// chains they go to; a new one replaces it (the old map goes before
    /// any chain it held is removed); one changed by hand is made again.
    #[test]
    fn dispatch_maps_are_made_replaced_and_repaired_in_order() {
        let mut t = ChainTable::new("filter-0", IpVersion::V4, Ownership::new("dph")).with_maps();
        for c in ["dph-fw-cali1", "dph-fw-cali2"] {
            t.set_chain(c, vec![r("-j ACCEPT")]).unwrap();
        }
        let dispatch = |ifaces: &[&str]| {
            let mut rules: Vec<Rule> = ifaces
                .iter()
                .map(|i| r(&format!("-i {i} -g dph-fw-{i}")))
                .collect();
            rules.push(r("-j DROP"));
            rules
        };
        t.set_chain("dph-from-wl-dispatch", dispatch(&["cali1", "cali2"]))
            .unwrap();
        t.set_hooks("FORWARD", vec![r("-j dph-from-wl-dispatch")])
            .unwrap();
        let mut tables = vec![t];
        let mut sets = DesiredSets::new(IpVersion::V4, SetNames::new("dph").unwrap());
        let p = plan_v4(&tables, &sets, &Observed::new(), None).unwrap();
        let ops = names(&p.ops);
        let pos = |what: &str| {
            ops.iter()
                .position(|o| o.starts_with(what))
                .unwrap_or_else(|| panic!("no {what}: {ops:#?}"))
        };
        let map = pos("adding map dph-filter-0/dispatch-in-");
        let entries = pos("adding 2 entries to dph-filter-0/dispatch-in-");
        assert!(map < pos("adding chain dph-filter-0/dph-fw-cali2"));
        assert!(pos("adding chain dph-filter-0/dph-fw-cali2") < entries);
        assert!(entries < pos("adding rule"));
        committed(&mut tables, &mut sets);
        let first = p.after.clone();

        // cali2 goes: a new map, the old one removed before its chain.
        tables[0]
            .set_chain("dph-from-wl-dispatch", dispatch(&["cali1"]))
            .unwrap();
        tables[0].remove_chain("dph-fw-cali2");
        let p = plan_v4(&tables, &sets, &first, None).unwrap();
        let ops = names(&p.ops);
        let pos = |what: &str| {
            ops.iter()
                .position(|o| o.starts_with(what))
                .unwrap_or_else(|| panic!("no {what}: {ops:#?}"))
        };
        assert!(
            pos("flushing chain dph-filter-0/dph-from-wl-dispatch")
                < pos("removing set dph-filter-0/dispatch-in-")
        );
        assert!(
            pos("removing set dph-filter-0/dispatch-in-")
                < pos("removing chain dph-filter-0/dph-fw-cali2")
        );
        assert!(pos("adding 1 entries to dph-filter-0/dispatch-in-") < pos("adding rule"));
        committed(&mut tables, &mut sets);
        let second = p.after.clone();
        let again = plan_v4(&tables, &sets, &second, None).unwrap();
        assert!(again.ops.is_empty(), "{:?}", names(&again.ops));

        // An entry taken out by hand: the map and its chain made again.
        let map = second["dph-filter-0"]
            .sets
            .keys()
            .find(|s| s.starts_with("dispatch-"))
            .unwrap()
            .clone();
        let contents: Contents = [(
            ("dph-filter-0".to_string(), map.clone()),
            Content::Keys(HashSet::new()),
        )]
        .into();
        let p = plan_v4(&tables, &sets, &second, Some(&contents)).unwrap();
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
                format!("removing set dph-filter-0/{map}"),
                format!("adding map dph-filter-0/{map}"),
                format!("adding 1 entries to dph-filter-0/{map}"),
                "adding rule".to_string(),
                "adding rule".to_string(),
            ]
        );
        // As read with its entries: nothing to do.
        let whole: Contents = [(
            ("dph-filter-0".to_string(), map.clone()),
            Content::Keys([Key::ifname("cali1")].into()),
        )]
        .into();
        let p = plan_v4(&tables, &sets, &second, Some(&whole)).unwrap();
        assert!(p.ops.is_empty(), "{:?}", names(&p.ops));
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
            plan_changes(Family::Ip, "dph-", &refs(&tables), &sets, &p.after).is_none(),
            "new sets and chains take a full plan"
        );
        committed(&mut tables, &mut sets);
        let observed = p.after;

        // A member: one element, nothing else.
        sets.delta(
            "dph40s",
            &mut [ip("10.0.0.2")].into_iter(),
            &mut std::iter::empty(),
        );
        let c = plan_changes(Family::Ip, "dph-", &refs(&tables), &sets, &observed).unwrap();
        assert_eq!(names(&c.ops), ["adding 1 elements to dph-filter/dph40s"]);
        committed(&mut tables, &mut sets);

        // A chain's rules: that chain flushed and written, with the port
        // list its new rule needs.
        tables[0]
            .set_chain(
                "dph-a",
                vec![r("-p tcp -m multiport --destination-ports 1,2 -j DROP")],
            )
            .unwrap();
        let c = plan_changes(Family::Ip, "dph-", &refs(&tables), &sets, &observed).unwrap();
        let n = names(&c.ops);
        assert_eq!(n[0], "flushing chain dph-filter/dph-a");
        assert!(n[1].starts_with("adding set dph-filter/ports-"), "{n:?}");
        assert!(n[3].starts_with("adding rule"), "{n:?}");
        assert_eq!(c.patches.len(), 2);
        committed(&mut tables, &mut sets);

        // A new jump reshapes the table: a full plan.
        tables[0].set_chain("dph-b", vec![r("-j ACCEPT")]).unwrap();
        tables[0].set_chain("dph-a", vec![r("-j dph-b")]).unwrap();
        assert!(plan_changes(Family::Ip, "dph-", &refs(&tables), &sets, &observed).is_none());
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
}
