//! The keys of everything the calc graph has sent, for mark-and-sweep at a
//! snapshot's end and for the per-kind object counts.
//!
//! Each key remembers the tick at which a message last created or replaced
//! it. A session that starts at tick `t` and ends its snapshot with InSync
//! sweeps every key not touched since `t`: those objects were not in the
//! snapshot. Nothing is flushed; the managers receive an ordinary Remove.

use std::collections::HashMap;

use crate::model::{IpSetType, Key, Kind, Update};

#[derive(Debug, Default)]
pub struct Store {
    entries: HashMap<Key, Entry>,
    counts: HashMap<Kind, u64>,
    tick: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    touched: u64,
    /// The type an IP set was created with (to check deltas against).
    ipset_type: Option<IpSetType>,
}

impl Store {
    /// The current tick; a session started now sweeps what is older.
    pub fn now(&self) -> u64 {
        self.tick
    }

    /// Record the effect of `update` on the key space.
    pub fn record(&mut self, update: &Update) {
        self.tick += 1;
        if let Update::Remove(key) = update {
            if self.entries.remove(key).is_some() {
                self.dec(key.kind());
            }
            return;
        }
        let Some(key) = update.upsert_key() else {
            return;
        };
        let ipset_type = match update {
            Update::IpSetUpdate(s) => Some(s.set_type),
            _ => None,
        };
        let kind = key.kind();
        let entry = Entry {
            touched: self.tick,
            ipset_type,
        };
        if self.entries.insert(key, entry).is_none() {
            *self.counts.entry(kind).or_default() += 1;
        }
    }

    /// The type of IP set `id`, if it exists.
    pub fn ipset_type(&self, key: &Key) -> Option<IpSetType> {
        self.entries.get(key).and_then(|e| e.ipset_type)
    }

    /// Remove and return every sweepable key not touched since `since`.
    pub fn sweep(&mut self, since: u64) -> Vec<Key> {
        let stale: Vec<Key> = self
            .entries
            .iter()
            .filter(|(k, e)| e.touched <= since && k.sweepable())
            .map(|(k, _)| k.clone())
            .collect();
        for k in &stale {
            self.entries.remove(k);
            self.dec(k.kind());
        }
        stale
    }

    fn dec(&mut self, kind: Kind) {
        if let Some(c) = self.counts.get_mut(&kind) {
            *c -= 1;
            if *c == 0 {
                self.counts.remove(&kind);
            }
        }
    }

    /// Whether an object with `key` is held.
    pub fn contains(&self, key: &Key) -> bool {
        self.entries.contains_key(key)
    }

    /// Objects of `kind` held.
    pub fn count(&self, kind: Kind) -> u64 {
        self.counts.get(&kind).copied().unwrap_or(0)
    }

    /// Objects held, by kind.
    pub fn counts(&self) -> impl Iterator<Item = (Kind, u64)> + '_ {
        self.counts.iter().map(|(k, v)| (*k, *v))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Id, IpSet};

    fn set(id: &str) -> Update {
        Update::IpSetUpdate(IpSet {
            id: Id::new(id).unwrap(),
            set_type: IpSetType::Ip,
            members: vec![],
        })
    }

    #[test]
    fn sweep_removes_what_the_snapshot_lacked() {
        let mut s = Store::default();
        s.record(&set("a"));
        s.record(&set("b"));
        s.record(&Update::Config(vec![]));
        let start = s.now();
        s.record(&set("b"));
        s.record(&set("c"));
        let swept = s.sweep(start);
        assert_eq!(swept, vec![Key::IpSet(Id::new("a").unwrap())]);
        assert_eq!(
            s.counts().collect::<Vec<_>>().len(),
            2,
            "ipset and config remain"
        );
        assert_eq!(s.len(), 3);
        s.record(&Update::Remove(Key::IpSet(Id::new("b").unwrap())));
        assert_eq!(s.len(), 2);
        assert_eq!(
            s.ipset_type(&Key::IpSet(Id::new("c").unwrap())),
            Some(IpSetType::Ip)
        );
    }
}
