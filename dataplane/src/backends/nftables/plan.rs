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
use super::sets::{Change, DesiredSets, key, kind, ranges};
use super::translate::PortSet;
use crate::backends::desired::RuleTable;
use crate::model::ipsets::IpSetType;

const NFT_SET_INTERVAL: u32 = 0x4;
/// The table that holds every IP set (the others hold those their rules
/// use).
const SETS_HOME: &str = "filter";
const NFT_SET_MAP: u32 = 0x8;

/// A chain as read back or as last written.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObservedChain {
    /// Hook number and priority of a base chain.
    pub hook: Option<(u32, i32)>,
    /// Each rule's comment, in order.
    pub comments: Vec<String>,
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

/// The ops of one table, grouped by when they run in the batch.
#[derive(Default)]
struct Stages {
    tables: Vec<Op>,
    flushes: Vec<Op>,
    set_removals: Vec<Op>,
    sets: Vec<Op>,
    chains: Vec<Op>,
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
    tables: &[ChainTable],
    sets: &DesiredSets,
    observed: &Observed,
    contents: Option<&Contents>,
) -> Result<Plan, PlanError> {
    let mut st = Stages::default();
    let mut out = Plan::default();
    let wanted_tables: BTreeSet<String> = tables
        .iter()
        .map(|t| table_name(chain_prefix, t.table()))
        .collect();
    for t in tables {
        let name = table_name(chain_prefix, t.table());
        let obs = observed.get(&name);
        let reach = t.reachable();
        let all_sets = t.table() == SETS_HOME && !sets.sets.is_empty();
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
        st.rules,
        st.chain_removals,
        st.stale_sets,
        st.table_removals,
    ]
    .concat();
    Ok(out)
}

struct TableCtx<'a> {
    family: Family,
    name: &'a str,
    table: &'a ChainTable,
    sets: &'a DesiredSets,
    obs: Option<&'a ObservedTable>,
    contents: Option<&'a Contents>,
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
        let mut wanted: Vec<(&str, &DesiredChain, bool)> = self
            .table
            .chains
            .iter()
            .filter(|(n, _)| reach.contains(n.as_str()))
            .map(|(n, c)| (n.as_str(), c, false))
            .collect();
        wanted.extend(self.table.hooks.iter().map(|(n, c)| (n.as_str(), c, true)));

        // The sets and port lists they look up; every set in the filter
        // table (where `nft list` finds them, and so a policy that starts
        // using a big set does not have to write it first).
        let mut needed: BTreeMap<&str, SetInfo> = BTreeMap::new();
        if self.table.table() == SETS_HOME {
            for (s, d) in &self.sets.sets {
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
        let retyped: BTreeSet<&str> = needed
            .iter()
            .filter(|(s, info)| obs.sets.get(**s).is_some_and(|o| !same_kind(o, info)))
            .map(|(s, _)| *s)
            .collect();

        let mut after = ObservedTable::default();
        // Chains: new ones made, changed ones flushed and rewritten.
        for (name, c, base) in &wanted {
            let o = obs.chains.get(*name);
            let uses_retyped = c
                .translated
                .iter()
                .any(|t| t.sets.iter().any(|s| retyped.contains(s.as_str())));
            let hook = if *base {
                base_chain(self.table.table(), name).map(|b| (b.hook as u32, b.priority))
            } else {
                None
            };
            let rewrite = match o {
                None => {
                    st.chains.push(Op::AddChain {
                        family,
                        table: table.clone(),
                        chain: name.to_string(),
                        base: if *base {
                            base_chain(self.table.table(), name)
                        } else {
                            None
                        },
                    });
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
                for (t, comment) in c.translated.iter().zip(&c.comments) {
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
                    hook: o.map_or(hook, |o| o.hook),
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
                self.set_update(s, d.meta.set_type, interval, st, ranges_out)?;
            }
            after.sets.insert(s.to_string(), info.clone());
        }
        // Port lists: constant, named by their contents.
        for (p, set) in &ports {
            let elements = set.elements();
            let read = self
                .contents
                .and_then(|c| c.get(&(table.clone(), p.to_string())));
            // Changed by hand (its name says what it must hold): what is
            // missing is added back; it cannot be removed and made anew
            // while rules use it.
            let sorted = |mut v: Vec<(Key, bool)>| {
                v.sort();
                v
            };
            let damaged = read.is_some_and(|r| match r {
                Content::Intervals(have) => sorted(have.clone()) != sorted(elements.clone()),
                _ => true,
            });
            if !obs.sets.contains_key(*p) {
                st.sets.push(Op::AddSet {
                    family,
                    table: table.clone(),
                    set: p.to_string(),
                    key: KeyType::Port,
                    interval: true,
                });
            }
            if !obs.sets.contains_key(*p) || damaged {
                st.sets.push(Op::AddIntervals {
                    family,
                    table: table.clone(),
                    set: p.to_string(),
                    elements,
                });
            }
            after
                .sets
                .insert(p.to_string(), set_info(p, KeyType::Port, true));
        }
        for s in obs.sets.keys() {
            if !after.sets.contains_key(s) {
                st.stale_sets.push(Op::DestroySet {
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
        set_type: IpSetType,
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
            if !gone.is_empty() {
                st.sets.push(Op::DestroyRanges {
                    family,
                    table: table.clone(),
                    set: s.to_string(),
                    ranges: gone,
                });
            }
            if !came.is_empty() {
                st.sets.push(Op::AddRanges {
                    family,
                    table: table.clone(),
                    set: s.to_string(),
                    ranges: came,
                });
            }
            ranges_out.insert(rkey, want);
            return Ok(());
        }
        let _ = set_type;
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
        if !del.is_empty() {
            st.sets.push(Op::DestroyElements {
                family,
                table: table.clone(),
                set: s.to_string(),
                elements: del,
            });
        }
        if !add.is_empty() {
            st.sets.push(Op::AddElements {
                family,
                table,
                set: s.to_string(),
                elements: add,
            });
        }
        Ok(())
    }
}
