//! The diff: which writes bring the kernel's routes, neighbours and FDB
//! entries to the desired state, for the keys an apply looks at.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use tracing::debug;

use super::*;

impl Routes {
    /// The ops that bring the `keys` of `observed` (and, if they changed,
    /// the neighbours and FDB entries) to the desired state.
    pub(super) fn plan(
        &mut self,
        observed: &Observed,
        keys: &BTreeSet<RouteKey>,
        neighbours: bool,
    ) -> Result<Plan, BackendError> {
        let mut redumped = false;
        let (mut adds, mut dels) = (Vec::new(), Vec::new());
        let mut unresolved = BTreeMap::new();
        let mut graced = BTreeSet::new();
        let mut grace_left: Option<Duration> = None;
        let now = Instant::now();
        for key in keys {
            let want = match self.winner(key).cloned() {
                None => None,
                Some(t) => match &t.dev {
                    None => Some(kernel_route(*key, &t, None)),
                    Some(d) => match self.index_of(d, &mut redumped)? {
                        Some(i) => Some(kernel_route(*key, &t, Some(i))),
                        None => {
                            unresolved.insert(*key, d.clone());
                            continue;
                        }
                    },
                },
            };
            let have = observed.routes.get(key);
            match (want, have) {
                (Some(w), h) if h != Some(&w) => adds.push(RouteOp::ReplaceRoute(w)),
                (Some(_), _) => {}
                (None, None) => {}
                (None, Some(r)) => {
                    if let Some(i) = r.oif
                        && let Some(seen) = self.new_links.get(&i)
                        && now.duration_since(*seen) < self.grace
                        && !self.has_routes_on(i)
                    {
                        let left = self.grace - now.duration_since(*seen);
                        grace_left = Some(grace_left.map_or(left, |g| g.min(left)));
                        graced.insert(*key);
                        debug!(dst = %key.dst, ifindex = i, "unexpected route on a new workload interface: in its grace period");
                        continue;
                    }
                    dels.push(RouteOp::DeleteRoute(*key));
                }
            }
        }
        let mut n_ops = Vec::new();
        let mut n_dels = Vec::new();
        let missing_for_neighbours = if neighbours {
            let mut m = BTreeSet::new();
            self.plan_neighbours(observed, &mut redumped, &mut n_ops, &mut n_dels, &mut m)?;
            Some(m)
        } else {
            None
        };
        // Neighbours and FDB first (what the routes lead to), then routes,
        // then removals.
        n_ops.extend(adds);
        n_ops.extend(dels);
        n_ops.extend(n_dels);
        Ok(Plan {
            ops: n_ops,
            unresolved,
            missing_for_neighbours,
            graced,
            grace_left,
        })
    }

    /// Whether any desired route goes through link `index`.
    fn has_routes_on(&self, index: u32) -> bool {
        let Some(name) = self
            .links
            .iter()
            .flatten()
            .find(|(_, i)| **i == index)
            .map(|(n, _)| n)
        else {
            return false;
        };
        self.routes
            .values()
            .flat_map(|m| m.values())
            .any(|t| t.dev.as_ref() == Some(name))
    }

    fn plan_neighbours(
        &mut self,
        observed: &Observed,
        redumped: &mut bool,
        adds: &mut Vec<RouteOp>,
        dels: &mut Vec<RouteOp>,
        missing: &mut BTreeSet<String>,
    ) -> Result<(), BackendError> {
        let mut want_n: BTreeMap<(u32, IpAddr), MacAddr> = BTreeMap::new();
        for n in self.desired_neighbours() {
            match self.index_of(&n.dev, redumped)? {
                Some(i) => {
                    want_n.insert((i, n.addr), n.mac);
                }
                None => {
                    missing.insert(n.dev.clone());
                }
            }
        }
        for ((i, addr), mac) in &want_n {
            let ok = observed
                .neighbours
                .get(&(*i, *addr))
                .is_some_and(|k| k.mac == Some(*mac));
            if !ok {
                adds.push(RouteOp::ReplaceNeighbour {
                    ifindex: *i,
                    addr: *addr,
                    mac: *mac,
                });
            }
        }
        for (i, addr) in observed.neighbours.keys() {
            if !want_n.contains_key(&(*i, *addr)) {
                dels.push(RouteOp::DeleteNeighbour {
                    ifindex: *i,
                    addr: *addr,
                });
            }
        }
        let mut want_f = BTreeSet::new();
        for f in self.fdb.clone() {
            match self.index_of(&f.dev, redumped)? {
                Some(i) => {
                    want_f.insert(KernelFdb {
                        ifindex: i,
                        mac: f.mac,
                        dst: Some(f.dst),
                    });
                }
                None => {
                    missing.insert(f.dev.clone());
                }
            }
        }
        for f in want_f.difference(&observed.fdb) {
            adds.push(RouteOp::AddFdb(f.clone()));
        }
        for f in observed.fdb.difference(&want_f) {
            dels.push(RouteOp::DeleteFdb(f.clone()));
        }
        Ok(())
    }
}

/// What an apply will do.
#[derive(Debug)]
pub(super) struct Plan {
    pub(super) ops: Vec<RouteOp>,
    /// Routes looked at whose device could not be resolved, by key.
    pub(super) unresolved: BTreeMap<RouteKey, String>,
    /// Devices of wanted neighbours and FDB entries that are missing (when
    /// those were looked at).
    pub(super) missing_for_neighbours: Option<BTreeSet<String>>,
    /// Deletions held back by a grace period.
    pub(super) graced: BTreeSet<RouteKey>,
    /// How long until that grace period ends.
    pub(super) grace_left: Option<Duration>,
}

/// Applies one op to what we believe the kernel holds.
pub(super) fn record(o: &mut Observed, op: &RouteOp) {
    match op {
        RouteOp::ReplaceRoute(r) => {
            o.routes.insert(r.key, r.clone());
        }
        RouteOp::DeleteRoute(k) => {
            o.routes.remove(k);
        }
        RouteOp::ReplaceNeighbour { ifindex, addr, mac } => {
            o.neighbours.insert(
                (*ifindex, *addr),
                KernelNeighbour {
                    ifindex: *ifindex,
                    addr: *addr,
                    mac: Some(*mac),
                    permanent: true,
                },
            );
        }
        RouteOp::DeleteNeighbour { ifindex, addr } => {
            o.neighbours.remove(&(*ifindex, *addr));
        }
        RouteOp::AddFdb(f) => {
            o.fdb.insert(f.clone());
        }
        RouteOp::DeleteFdb(f) => {
            o.fdb.remove(f);
        }
    }
}
