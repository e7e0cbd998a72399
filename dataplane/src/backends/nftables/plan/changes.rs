//! The cheap plan of one table, from what changed since the last write
//! alone: its sets' members, and the chains whose rules changed where
//! nothing was reshaped (no chain added, removed or re-pointed). At
//! 50,000 rules a full plan walks every chain; most tables, most of the
//! time, change like this or not at all.

use super::*;

/// The cheap plan of one table.
#[derive(Debug, Default)]
pub(super) struct Cheap {
    pub flushes: Vec<Op>,
    pub sets: Vec<Op>,
    pub rules: Vec<Op>,
    pub patches: Vec<Patch>,
    pub ranges: Vec<((String, String), Vec<Range>)>,
    /// Dispatch maps' element changes.
    pub map_elements: Vec<Op>,
}

/// Table `t` (named `table`, `obs` as last written) from its changes
/// alone; `None` when it takes a full plan: a set of it to be written
/// whole, an interval set not written by this process, a changed chain
/// that looks up a set the table does not hold or a dispatch map.
pub(super) fn cheap(
    family: Family,
    table: &str,
    t: &ChainTable,
    sets: &DesiredSets,
    obs: &ObservedTable,
) -> Option<Cheap> {
    let mut out = Cheap::default();
    members(family, table, obs, sets, &mut out)?;
    for name in &t.touched {
        let Some(c) = t.chains.get(name) else {
            continue;
        };
        let Some(o) = obs.chains.get(name) else {
            continue; // not reached from a hook: not programmed
        };
        // A dispatch map whose entries alone changed (its lookup, named
        // by its chain, did not): elements removed and added. One not
        // written by this process, or a new one, takes the full plan.
        if let Some(d) = c.translated.iter().find_map(|t| t.dispatch.as_ref()) {
            if o.comments != c.comments {
                return None;
            }
            let have = obs.maps.get(&d.name)?;
            let want = super::map_delta(&mut out.map_elements, family, table, d, have);
            if &want != have {
                out.patches.push(Patch::Map(d.name.clone(), want));
            }
            continue;
        }
        if o.comments == c.comments {
            continue;
        }
        for tr in &c.translated {
            if tr.sets.iter().any(|s| !obs.sets.contains_key(s)) {
                return None;
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
        out.flushes.push(Op::FlushChain {
            family,
            table: table.to_string(),
            chain: name.clone(),
        });
        for (tr, comment) in c.translated.iter().zip(c.comments.iter()) {
            out.rules.push(Op::AddRule {
                family,
                table: table.to_string(),
                chain: name.clone(),
                exprs: tr.exprs.clone(),
                comment: comment.clone(),
            });
        }
        out.patches.push(Patch::Chain(
            name.clone(),
            ObservedChain {
                hook: o.hook,
                comments: c.comments.clone(),
            },
        ));
    }
    Some(out)
}

/// The element ops that bring the sets table `table` holds (`obs`) to
/// their members, by the uncommitted deltas; `None` when one is to be
/// written whole.
fn members(
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
