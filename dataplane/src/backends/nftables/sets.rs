//! The IP sets the managers want, as nf_tables sets: `hash:ip` and
//! `hash:ip,port` as hash sets of addresses or `addr . proto . port`
//! keys, `hash:net` as interval sets (merged ranges, [`super::intervals`]).
//! What changed since the last commit is kept as deltas, so a member
//! added is one element written (data only: no validation walk).

use std::collections::{BTreeSet, HashMap, HashSet};

use ipnet::IpNet;
use tracing::debug;

use super::intervals::{self, Range};
use super::ops::{Key, KeyType};
use crate::backends::desired::SetStore;
use crate::backends::ipsets::Meta;
use crate::model::IpVersion;
use crate::model::ipsets::{IpSetType, Member, PortProto, SetNames};

/// What an nf_tables set of this type and version holds, and whether it
/// is an interval set.
pub fn kind(set_type: IpSetType, v: IpVersion) -> (KeyType, bool) {
    let v6 = v == IpVersion::V6;
    match (set_type, v6) {
        (IpSetType::Ip, false) => (KeyType::Ipv4Addr, false),
        (IpSetType::Ip, true) => (KeyType::Ipv6Addr, false),
        (IpSetType::Net, false) => (KeyType::Ipv4Addr, true),
        (IpSetType::Net, true) => (KeyType::Ipv6Addr, true),
        (IpSetType::IpAndPort, false) => (KeyType::Ipv4AddrProtoPort, false),
        (IpSetType::IpAndPort, true) => (KeyType::Ipv6AddrProtoPort, false),
    }
}

/// A hash set's key for `m` (`None` for a network: interval sets hold
/// ranges).
pub fn key(m: &Member) -> Option<Key> {
    match m {
        Member::Ip(a) => Some(Key::Addr(*a)),
        Member::Net(n) if n.prefix_len() == n.max_prefix_len() => Some(Key::Addr(n.addr())),
        Member::Net(_) => None,
        Member::IpPort(a, p, port) => Some(Key::AddrProtoPort(
            *a,
            match p {
                PortProto::Tcp => 6,
                PortProto::Udp => 17,
                PortProto::Sctp => 132,
            },
            *port,
        )),
    }
}

/// An interval set's ranges for `members`.
pub fn ranges(members: &HashSet<Member>) -> Vec<Range> {
    let nets: BTreeSet<IpNet> = members
        .iter()
        .filter_map(|m| match m {
            Member::Net(n) => Some(*n),
            Member::Ip(a) => Some(IpNet::from(*a)),
            Member::IpPort(..) => None,
        })
        .collect();
    intervals::ranges(&nets)
}

/// One set the managers want.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredSet {
    pub meta: Meta,
    pub members: HashSet<Member>,
}

/// What happened to a set since the last commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// New, or of a new type: written whole.
    Whole,
    /// Members added and removed.
    Delta {
        add: HashSet<Member>,
        del: HashSet<Member>,
    },
}

/// The IP sets of one IP version.
#[derive(Debug)]
pub struct DesiredSets {
    version: IpVersion,
    names: SetNames,
    pub(super) sets: HashMap<String, DesiredSet>,
    /// Changes not yet committed, per set (gone sets are simply no longer
    /// in `sets`).
    pub(super) changes: HashMap<String, Change>,
    /// Interval sets' ranges as last written (a change is written as the
    /// ranges that went and came), by (table, set).
    pub(super) written_ranges: HashMap<(String, String), Vec<Range>>,
    pub(super) changed: bool,
    /// A set was removed since the last commit (a full plan removes it
    /// once no rule uses it).
    pub(super) removed_any: bool,
}

impl DesiredSets {
    pub fn new(version: IpVersion, names: SetNames) -> Self {
        Self {
            version,
            names,
            sets: HashMap::new(),
            changes: HashMap::new(),
            written_ranges: HashMap::new(),
            changed: false,
            removed_any: false,
        }
    }
}

impl SetStore for DesiredSets {
    fn version(&self) -> IpVersion {
        self.version
    }

    fn names(&self) -> &SetNames {
        &self.names
    }

    /// The members are kept here: nothing is asked again.
    fn needs_full(&self) -> bool {
        false
    }

    fn start_full(&mut self) {}

    fn replace(&mut self, name: String, meta: Meta, members: HashSet<Member>) {
        self.changed = true;
        let change = match self.sets.get(&name) {
            Some(old) if old.meta.set_type == meta.set_type => {
                let add: HashSet<Member> = members.difference(&old.members).copied().collect();
                let del: HashSet<Member> = old.members.difference(&members).copied().collect();
                if add.is_empty() && del.is_empty() && old.meta == meta {
                    return;
                }
                Change::Delta { add, del }
            }
            _ => Change::Whole,
        };
        self.merge(&name, change);
        self.sets.insert(name, DesiredSet { meta, members });
    }

    fn delta(
        &mut self,
        name: &str,
        add: &mut dyn Iterator<Item = Member>,
        del: &mut dyn Iterator<Item = Member>,
    ) {
        let Some(set) = self.sets.get_mut(name) else {
            debug!(name, "delta for a set that is not desired; ignored");
            return;
        };
        let (mut a, mut d) = (HashSet::new(), HashSet::new());
        for m in del {
            if set.members.remove(&m) {
                d.insert(m);
            }
        }
        for m in add {
            if set.members.insert(m) {
                d.remove(&m);
                a.insert(m);
            }
        }
        if !a.is_empty() || !d.is_empty() {
            self.changed = true;
            self.merge(name, Change::Delta { add: a, del: d });
        }
    }

    fn remove(&mut self, name: &str) {
        if self.sets.remove(name).is_some() {
            self.changes.remove(name);
            self.changed = true;
            self.removed_any = true;
        }
    }
}

impl DesiredSets {
    /// The IP version its sets are of.
    pub fn version_of(&self) -> IpVersion {
        self.version
    }

    /// Folds `c` into the set's uncommitted change.
    fn merge(&mut self, name: &str, c: Change) {
        match (self.changes.get_mut(name), c) {
            (Some(Change::Whole), _) => {}
            (Some(Change::Delta { add, del }), Change::Delta { add: a, del: d }) => {
                for m in d {
                    if !add.remove(&m) {
                        del.insert(m);
                    }
                }
                for m in a {
                    if !del.remove(&m) {
                        add.insert(m);
                    }
                }
            }
            (_, c) => {
                self.changes.insert(name.to_string(), c);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Member {
        Member::Ip(s.parse().unwrap())
    }

    fn meta(t: IpSetType) -> Meta {
        Meta {
            set_type: t,
            maxelem: 1000,
        }
    }

    #[test]
    fn changes_since_the_last_commit_are_one_delta() {
        let mut s = DesiredSets::new(IpVersion::V4, SetNames::new("dph").unwrap());
        s.replace("a".into(), meta(IpSetType::Ip), [ip("10.0.0.1")].into());
        assert_eq!(s.changes["a"], Change::Whole);
        s.changes.clear();
        s.delta(
            "a",
            &mut [ip("10.0.0.2"), ip("10.0.0.3")].into_iter(),
            &mut std::iter::empty(),
        );
        s.delta(
            "a",
            &mut std::iter::empty(),
            &mut [ip("10.0.0.3"), ip("10.0.0.1")].into_iter(),
        );
        assert_eq!(
            s.changes["a"],
            Change::Delta {
                add: [ip("10.0.0.2")].into(),
                del: [ip("10.0.0.1")].into()
            },
            "an add then a delete of the same member cancel out"
        );
        assert_eq!(s.sets["a"].members, [ip("10.0.0.2")].into());
        s.changes.clear();
        s.replace("a".into(), meta(IpSetType::Ip), [ip("10.0.0.2")].into());
        assert!(s.changes.is_empty(), "the same members: nothing to write");
        s.replace("a".into(), meta(IpSetType::Net), [ip("10.0.0.2")].into());
        assert_eq!(s.changes["a"], Change::Whole, "a new type is a new set");
    }

    #[test]
    fn members_become_keys_and_ranges() {
        let p = Member::IpPort("10.0.0.1".parse().unwrap(), PortProto::Udp, 53);
        assert_eq!(
            key(&p),
            Some(Key::AddrProtoPort("10.0.0.1".parse().unwrap(), 17, 53))
        );
        assert_eq!(key(&Member::Net("10.0.0.0/8".parse().unwrap())), None);
        let r = ranges(
            &[
                Member::Net("10.0.0.0/8".parse().unwrap()),
                Member::Net("10.1.0.0/16".parse().unwrap()),
            ]
            .into(),
        );
        assert_eq!(r.len(), 1, "{r:?}");
    }
}
