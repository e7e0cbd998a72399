//! The cheap plan of one table, from what changed since the last write
//! alone: its sets' members, the chains whose rules changed and, where
//! chains were added, removed or pointed elsewhere (the hooks as they
//! were), the chains now reached or no longer. At 50,000 rules a full
//! plan walks every chain; most tables, most of the time, change like
//! this or not at all.

use super::*;

/// The cheap plan of one table.
#[derive(Debug, Default)]
pub(super) struct Cheap {
    pub flushes: Vec<Op>,
    pub sets: Vec<Op>,
    /// Chains made (regraphed).
    pub chains: Vec<Op>,
    pub rules: Vec<Op>,
    /// Chains removed (regraphed): after the rules and map elements that
    /// went to them.
    pub chain_removals: Vec<Op>,
    pub patches: Vec<Patch>,
    pub ranges: Vec<((String, String), Vec<Range>)>,
    /// Dispatch maps' element changes.
    pub map_elements: Vec<Op>,
}

/// Table `t` (named `table`, `obs` as last written) from its changes
/// alone: its sets by their deltas, the touched chains rewritten where
/// their rules changed. Where chains were added, removed or pointed
/// elsewhere (`regraphed`; its hooks and forced chains as they were), also
/// the chains its hooks reach now and were not programmed are made, and
/// those programmed and reached no more emptied and removed. A set the
/// removed chains alone looked up stays until the table's next whole plan
/// (a read, a hook changed): only its members cost, and a shard's
/// endpoint coming or going no longer plans the shard whole (~5 ms at
/// 10,000 endpoints). `None` when it takes a full plan: a set of it to be
/// written whole, an interval set not written by this process, a set not
/// defined, a dispatch map new or not known, or one no chain here brings
/// up to date that goes to a chain removed.
pub(super) fn cheap(
    family: Family,
    table: &str,
    t: &ChainTable,
    sets: &DesiredSets,
    obs: &ObservedTable,
) -> Option<Cheap> {
    let mut out = Cheap::default();
    members(family, table, obs, sets, &mut out)?;
    let reach = t.regraphed.then(|| t.reachable());
    // Programmed and no longer reached (a base chain is a hook's: the
    // hooks did not change).
    let gone: BTreeSet<&str> = match &reach {
        Some(reach) => obs
            .chains
            .iter()
            .filter(|(n, o)| o.hook.is_none() && !reach.contains(n.as_str()))
            .map(|(n, _)| n.as_str())
            .collect(),
        None => BTreeSet::new(),
    };
    if let Some(reach) = &reach {
        let mut came: Vec<&str> = reach
            .iter()
            .copied()
            .filter(|n| !obs.chains.contains_key(*n))
            .collect();
        came.sort_unstable();
        for name in came {
            let c = &t.chains[name];
            rewrite(family, table, name, c, None, obs, sets, &mut out)?;
        }
    }
    for name in &t.touched {
        let (Some(c), Some(o)) = (t.chains.get(name), obs.chains.get(name)) else {
            continue; // made above, or not reached from a hook: not programmed
        };
        if gone.contains(name.as_str()) {
            continue;
        }
        rewrite(family, table, name, c, Some(o), obs, sets, &mut out)?;
    }
    if gone.is_empty() {
        return Some(out);
    }
    // A map brought up to date above goes to reached chains alone, and so
    // does one whose chain is reached and untouched; one whose chain went
    // (or is no longer a dispatch) and goes to a chain removed would hold
    // it in use.
    let updated: BTreeSet<&str> = out
        .patches
        .iter()
        .filter_map(|p| match p {
            Patch::Map(m, _) => Some(m.as_str()),
            _ => None,
        })
        .collect();
    let stale = obs
        .maps
        .iter()
        .filter(|(m, _)| !updated.contains(m.as_str()))
        .any(|(_, entries)| entries.values().any(|c| gone.contains(c.as_str())));
    if stale {
        return None;
    }
    for name in gone {
        super::push_chain_removal(
            &mut out.flushes,
            &mut out.chain_removals,
            family,
            table,
            name,
        );
        out.patches.push(Patch::ChainGone(name.to_string()));
    }
    Some(out)
}

/// Chain `name` of table `table` (`c`; `o` as programmed, `None`: to be
/// made) written where its rules changed, with the IP sets and port lists
/// its rules look up that the table does not hold yet (a set with all its
/// members: a shard's endpoint whose new policy looks up a set the shard
/// had no copy of); `None` when that takes a full plan (a set not
/// defined, a dispatch map new or not known).
#[allow(
    clippy::too_many_arguments,
    reason = "one table's context, passed down as is"
)]
fn rewrite(
    family: Family,
    table: &str,
    name: &str,
    c: &DesiredChain,
    o: Option<&ObservedChain>,
    obs: &ObservedTable,
    sets: &DesiredSets,
    out: &mut Cheap,
) -> Option<()> {
    // A dispatch map whose entries alone changed (its lookup, named
    // by its chain, did not): elements removed and added. One not
    // written by this process, or a new one, takes the full plan.
    if let Some(d) = c.translated.iter().find_map(|t| t.dispatch.as_ref()) {
        let o = o?;
        if o.comments != c.comments {
            return None;
        }
        let have = obs.maps.get(&d.name)?;
        let want = super::map_delta(&mut out.map_elements, family, table, d, have);
        if &want != have {
            out.patches.push(Patch::Map(d.name.clone(), want));
        }
        return Some(());
    }
    match o {
        Some(o) if o.comments == c.comments => return Some(()),
        Some(_) => out.flushes.push(Op::FlushChain {
            family,
            table: table.to_string(),
            chain: name.to_string(),
        }),
        None => out.chains.push(Op::AddChain {
            family,
            table: table.to_string(),
            chain: name.to_string(),
            base: None,
        }),
    }
    for tr in &c.translated {
        for s in &tr.sets {
            if !obs.sets.contains_key(s) {
                add_set(family, table, s, sets, out)?;
            }
        }
        for p in &tr.port_sets {
            let added = out
                .patches
                .iter()
                .any(|x| matches!(x, Patch::Set(info) if info.name == p.name));
            if obs.sets.contains_key(&p.name) || added {
                continue;
            }
            out.sets.push(Op::AddSet {
                family,
                table: table.to_string(),
                set: p.name.clone(),
                key: KeyType::Port,
                interval: true,
            });
            out.sets.push(Op::AddIntervals {
                family,
                table: table.to_string(),
                set: p.name.clone(),
                elements: p.elements(),
            });
            out.patches
                .push(Patch::Set(set_info(&p.name, KeyType::Port, true)));
        }
    }
    for (tr, comment) in c.translated.iter().zip(c.comments.iter()) {
        out.rules.push(Op::AddRule {
            family,
            table: table.to_string(),
            chain: name.to_string(),
            exprs: tr.exprs.clone(),
            comment: comment.clone(),
        });
    }
    out.patches.push(Patch::Chain(
        name.to_string(),
        ObservedChain {
            hook: o.and_then(|o| o.hook),
            comments: c.comments.clone(),
        },
    ));
    Some(())
}

/// IP set `s` added to table `table` with its members, unless this plan
/// added it already; `None` if it is not defined.
fn add_set(
    family: Family,
    table: &str,
    s: &str,
    sets: &DesiredSets,
    out: &mut Cheap,
) -> Option<()> {
    let added = out
        .patches
        .iter()
        .any(|x| matches!(x, Patch::Set(info) if info.name == s));
    if added {
        return Some(());
    }
    let d = sets.sets.get(s)?;
    let (k, interval) = kind(d.meta.set_type, sets.version_of());
    if let Some(r) = super::push_new_set(&mut out.sets, family, table, s, d, (k, interval)) {
        out.ranges.push(((table.to_string(), s.to_string()), r));
    }
    out.patches.push(Patch::Set(set_info(s, k, interval)));
    Some(())
}

/// The element ops that bring the sets table `table` holds (`obs`) to
/// their members, by the uncommitted deltas; `None` when one is to be
/// written whole.
pub(super) fn members(
    family: Family,
    table: &str,
    obs: &ObservedTable,
    sets: &DesiredSets,
    out: &mut Cheap,
) -> Option<()> {
    // The changed sets (few), not the table's (hundreds), in order.
    let mut changed: Vec<(&String, &Change)> = sets
        .changes
        .iter()
        .filter(|(s, _)| obs.sets.contains_key(*s))
        .collect();
    changed.sort_unstable_by_key(|(s, _)| *s);
    for (s, change) in changed {
        let Some(d) = sets.sets.get(s) else {
            continue;
        };
        let (_, interval) = kind(d.meta.set_type, sets.version_of());
        match change {
            Change::Whole => return None,
            Change::Delta { add, del } => {
                if interval {
                    let key = (table.to_string(), s.clone());
                    let have = sets.written_ranges.get(&key)?;
                    let want = ranges(&d.members);
                    let (gone, came) = intervals::diff(have, &want);
                    push_ranges(&mut out.sets, family, table, s, gone, came);
                    out.ranges.push((key, want));
                } else {
                    let del: Vec<Key> = del.iter().filter_map(key_of).collect();
                    let add: Vec<Key> = add.iter().filter_map(key_of).collect();
                    push_elements(&mut out.sets, family, table, s, del, add);
                }
            }
        }
    }
    Some(())
}
