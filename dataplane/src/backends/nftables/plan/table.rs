//! The full plan of one table: every chain its hooks reach compared with
//! what the kernel holds, its sets and port lists, its dispatch maps.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::*;

pub(super) struct TableCtx<'a> {
    pub(super) family: Family,
    pub(super) name: &'a str,
    pub(super) table: &'a ChainTable,
    pub(super) sets: &'a DesiredSets,
    pub(super) obs: Option<&'a ObservedTable>,
    pub(super) contents: Option<&'a Contents>,
    /// With `spare_sets_only`: the sets other tables hold.
    pub(super) used: &'a HashSet<&'a str>,
}

impl TableCtx<'_> {
    pub(super) fn plan(
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
        // Dispatch maps. One of another kind (made again by hand), or
        // whose entries are not known (not written by this process, not
        // read), is made again, with the chain that looks it up (a map in
        // use cannot be removed); the others are brought to their entries
        // element by element (below).
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
        for name in maps.keys() {
            let Some(o) = obs.sets.get(*name) else {
                continue;
            };
            if !same_kind(o, &map_info(name)) || !obs.maps.contains_key(*name) {
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
                push_chain_removal(
                    &mut st.flushes,
                    &mut st.chain_removals,
                    family,
                    &table,
                    name,
                );
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
                if let Some(r) = push_new_set(&mut st.sets, family, &table, s, d, (k, interval)) {
                    ranges_out.insert(rkey, r);
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
            let have = obs.maps.get(*name);
            if let (Some(have), true, false) =
                (have, obs.sets.contains_key(*name), retyped.contains(name))
            {
                let want = map_delta(&mut st.map_elements, family, &table, d, have);
                after.maps.insert(name.to_string(), want);
            } else {
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
                after
                    .maps
                    .insert(name.to_string(), d.entries.iter().cloned().collect());
            }
            after.sets.insert(name.to_string(), map_info(name));
        }
        // In name order, so a plan is the same ops every time.
        let mut held: Vec<(&String, &SetInfo)> = obs.sets.iter().collect();
        held.sort_unstable_by_key(|(s, _)| *s);
        for (s, o) in held {
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
            (Some(Content::Keys(have)), _) => diff_keys(&d.members, have),
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

/// The keys to add to and remove from a hash set that holds `have` so
/// that it holds those of `members`. The members' keys are looked up in
/// `have`; a set of them is made only when `have` holds a key none of
/// them has. A refresh plans each table whole against what was read, and
/// making a set of every member's key, with the two differences, was 83%
/// of those plans (at 1M members, 7–55 ms a table): a set as written
/// makes none.
pub(super) fn diff_keys(
    members: &HashSet<crate::model::ipsets::Member>,
    have: &HashSet<Key>,
) -> (Vec<Key>, Vec<Key>) {
    use crate::model::ipsets::Member;
    let (mut add, mut held) = (Vec::new(), 0);
    for m in members {
        let Some(k) = key(m) else {
            continue;
        };
        // An address and its /32 net are one key: counted once.
        if let Member::Net(n) = m
            && members.contains(&Member::Ip(n.addr()))
        {
            continue;
        }
        if have.contains(&k) {
            held += 1;
        } else {
            add.push(k);
        }
    }
    let del = if held == have.len() {
        Vec::new()
    } else {
        let want: HashSet<Key> = members.iter().filter_map(key).collect();
        have.difference(&want).copied().collect()
    };
    (add, del)
}
