//! Reading our tables back (those named `<chain_prefix>…`, never another
//! agent's): all at once, in the apply (at start, after a refused
//! commit), or table by table on a thread of its own beside the commits
//! (the refresh).
//!
//! A table read beside the commits is a snapshot of each object in it
//! (chain, set, map) that no commit changed while it was read. The
//! kernel cannot say which objects a commit changed (it flags a dump any
//! commit interrupted), but the dataplane knows its own commits' ops:
//! commits are numbered by the [`Gate`], each round of reads begins with
//! a [`Listing`] of our tables and their chains made between two commits
//! (the gate held: ~6 ms at 10,000 chains; the chain dump walks every
//! table of the family, so our own commits must not interrupt it, and
//! another agent's make it run again), which records the number of the
//! last commit before it, and [`patch_read`] takes each object a later
//! commit of ours touched as that commit wrote it (the dataplane's model)
//! instead of as read. So a read under constant churn is still taken
//! whole (what was changed by hand in the objects the churn touched is
//! put back by the next refresh). Only a table made or removed meanwhile
//! is read again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use super::netlink::{NftError, NftNetlink};
use super::ops::{ChainInfo, Family, Key, Op, TYPE_IFNAME};
use super::plan::{Content, Contents, Observed, ObservedChain, ObservedTable};

/// Tables of at most this many chains have their rules read in one dump;
/// larger ones chain by chain.
const ONE_RULE_DUMP_CHAINS: usize = 1_000;

/// Numbers the commits, and lets a read run between two of them.
#[derive(Debug, Default)]
pub struct Gate(Mutex<u64>);

impl Gate {
    /// Runs commit `f` as the next one; its number, and what it returned.
    pub fn commit<T>(&self, f: impl FnOnce() -> T) -> (u64, T) {
        let mut n = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        *n += 1;
        (*n, f())
    }

    /// Runs `f` between two commits, with the number of the last one.
    pub fn between<T>(&self, f: impl FnOnce(u64) -> T) -> T {
        let n = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        f(*n)
    }

    /// The number of the last commit.
    pub fn last(&self) -> u64 {
        self.between(|n| n)
    }
}

/// What of one table an op changes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Object {
    /// The table itself (made or removed).
    Table,
    /// A chain: itself, or its rules.
    Chain(String),
    /// A set or map: itself, or its elements.
    Set(String),
}

impl Object {
    /// What op `op` changes in its table ([`Op::table`]).
    pub fn of(op: &Op) -> Object {
        match op {
            Op::AddTable { .. } | Op::DestroyTable { .. } => Object::Table,
            Op::AddSet { set, .. }
            | Op::DestroySet { set, .. }
            | Op::AddElements { set, .. }
            | Op::DestroyElements { set, .. }
            | Op::AddRanges { set, .. }
            | Op::AddIntervals { set, .. }
            | Op::DestroyIntervals { set, .. }
            | Op::DestroyRanges { set, .. } => Object::Set(set.clone()),
            Op::AddVerdictMap { map, .. } | Op::AddVerdicts { map, .. } => Object::Set(map.clone()),
            Op::AddChain { chain, .. }
            | Op::DestroyChain { chain, .. }
            | Op::DeleteRule { chain, .. }
            | Op::FlushChain { chain, .. }
            | Op::AddRule { chain, .. } => Object::Chain(chain.clone()),
        }
    }
}

/// Table `name` as read (`read`), with each object in `touched` (those a
/// commit of ours changed since the read began) as last written
/// (`written`, the dataplane's model of the table) instead: a touched
/// chain or set's kind as written, a touched map's entries as written,
/// and no contents for a touched set (the next plan takes its members
/// from the changes, as if it had not been read). `None`: the table was
/// made or removed meanwhile, to read again.
pub fn patch_read(
    name: &str,
    read: TableRead,
    touched: &[&Object],
    written: Option<&ObservedTable>,
) -> Option<TableRead> {
    if touched.is_empty() {
        return Some(read);
    }
    let Some((mut table, mut contents)) = read else {
        // Not there when read: anything done to it since made it.
        return None;
    };
    let empty = ObservedTable::default();
    let written = written.unwrap_or(&empty);
    for object in touched {
        match object {
            Object::Table => return None,
            Object::Chain(c) => match written.chains.get(c) {
                Some(w) => {
                    table.chains.insert(c.clone(), w.clone());
                }
                None => {
                    table.chains.remove(c);
                }
            },
            Object::Set(s) => {
                contents.sets.remove(&(name.to_string(), s.clone()));
                match written.sets.get(s) {
                    Some(w) => {
                        table.sets.insert(s.clone(), w.clone());
                    }
                    None => {
                        table.sets.remove(s);
                    }
                }
                match written.maps.get(s) {
                    Some(w) => {
                        table.maps.insert(s.clone(), w.clone());
                    }
                    None => {
                        table.maps.remove(s);
                    }
                }
            }
        }
    }
    Some(Some((table, contents)))
}

/// One table as read: what it holds and what its sets hold (the
/// contents name the table as read); `None`: not there.
pub type TableRead = Option<(ObservedTable, Contents)>;

/// Our tables and their chains, listed between two commits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    /// The number of the last commit before the listing.
    pub began: u64,
    pub tables: Vec<String>,
    pub chains: BTreeMap<String, Vec<ChainInfo>>,
}

/// Reads our tables one by one, on a thread of its own.
pub trait TableReader: Send {
    /// Our tables (named `<chain_prefix>…`) of `family` and their chains,
    /// listed between two commits of `gate`.
    fn list(
        &mut self,
        family: Family,
        chain_prefix: &str,
        gate: &Gate,
    ) -> Result<Listing, NftError>;
    /// Table `name`, whose chains are `chains`: their rules, its sets and
    /// what they hold (but the hash sets named in `unread`: their
    /// elements are not read, and the contents do not name them).
    fn read_table(
        &mut self,
        family: Family,
        name: &str,
        chains: Vec<ChainInfo>,
        unread: &HashSet<String>,
    ) -> Result<(ObservedTable, Contents), NftError>;
}

impl TableReader for NftNetlink {
    fn list(
        &mut self,
        family: Family,
        chain_prefix: &str,
        gate: &Gate,
    ) -> Result<Listing, NftError> {
        gate.between(|began| {
            let mut tables = self.tables(family)?;
            tables.retain(|t| t.starts_with(chain_prefix));
            let mut chains = self.chains_by_table(family)?;
            chains.retain(|t, _| t.starts_with(chain_prefix));
            Ok(Listing {
                began,
                tables,
                chains,
            })
        })
    }

    fn read_table(
        &mut self,
        family: Family,
        name: &str,
        chains: Vec<ChainInfo>,
        unread: &HashSet<String>,
    ) -> Result<(ObservedTable, Contents), NftError> {
        let mut contents = Contents::new();
        let table = read_rest(self, family, name, chains, unread, &mut contents)?;
        Ok((table, contents))
    }
}

/// The refresh reader over a socket of its own (shared with nothing
/// else; the lock only keeps it whole if a read's thread panicked).
#[derive(Debug)]
pub struct SharedReader(pub Arc<Mutex<NftNetlink>>);

impl TableReader for SharedReader {
    fn list(
        &mut self,
        family: Family,
        chain_prefix: &str,
        gate: &Gate,
    ) -> Result<Listing, NftError> {
        let mut r = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        r.list(family, chain_prefix, gate)
    }

    fn read_table(
        &mut self,
        family: Family,
        name: &str,
        chains: Vec<ChainInfo>,
        unread: &HashSet<String>,
    ) -> Result<(ObservedTable, Contents), NftError> {
        let mut r = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        r.read_table(family, name, chains, unread)
    }
}

/// All our tables of `family` and what their sets hold, in one go (the
/// chains of the family in one dump).
pub fn read_all(
    nl: &mut NftNetlink,
    family: Family,
    chain_prefix: &str,
) -> Result<(Observed, Contents), NftError> {
    let mut observed = Observed::new();
    let mut contents = Contents::new();
    let Listing {
        tables, mut chains, ..
    } = nl.list(family, chain_prefix, &Gate::default())?;
    for table in tables {
        let chains = chains.remove(&table).unwrap_or_default();
        let t = read_rest(nl, family, &table, chains, &HashSet::new(), &mut contents)?;
        observed.insert(table, t);
    }
    Ok((observed, contents))
}

/// Table `table` with chains `chains`: their rules, its sets and what
/// they hold (into `contents`, which names the table as read), but the
/// elements of the hash sets in `unread`.
fn read_rest(
    nl: &mut NftNetlink,
    family: Family,
    table: &str,
    chains: Vec<ChainInfo>,
    unread: &HashSet<String>,
    contents: &mut Contents,
) -> Result<ObservedTable, NftError> {
    let mut t = ObservedTable::default();
    // A table of few chains (a shard's ~300) in one dump; a big one, or
    // one whose dump a commit interrupted, chain by chain (a whole-table
    // rule dump is quadratic in the kernel: `NftNetlink::table_rules`).
    let mut by_chain: Option<HashMap<String, Vec<String>>> = None;
    if chains.len() <= ONE_RULE_DUMP_CHAINS
        && let Some(rules) = nl.table_rules(family, table)?
    {
        let mut m: HashMap<String, Vec<String>> = HashMap::new();
        for r in rules {
            m.entry(r.chain).or_default().push(r.comment);
        }
        by_chain = Some(m);
    }
    let one_chain = |nl: &mut NftNetlink, name: &str| -> Result<Vec<String>, NftError> {
        Ok(nl
            .chain_rules(family, table, name)?
            .into_iter()
            .filter(|r| r.chain == name)
            .map(|r| r.comment)
            .collect())
    };
    for c in chains {
        let rules: Vec<String> = match by_chain.as_mut().map(|m| m.remove(&c.name)) {
            Some(Some(rules)) => rules,
            // A chain the table's dump showed without rules is read on
            // its own: once in ~40 runs of the test beside another
            // agent's commits, a dump counted whole (not flagged, the
            // generation unchanged) came back without a 300-rule chain's
            // rules (not understood yet). An empty chain costs a small
            // dump; the others are taken from the one dump.
            Some(None) | None => one_chain(nl, &c.name)?,
        };
        t.chains.insert(
            c.name,
            ObservedChain {
                hook: c.hook,
                comments: rules.into(),
            },
        );
    }
    for s in nl.sets(family, table)? {
        let hash = s.key_len != 2 && s.flags & 0x4 == 0 && s.key_type != TYPE_IFNAME;
        if hash && unread.contains(&s.name) {
            t.sets.insert(s.name.clone(), s);
            continue;
        }
        let content = if s.key_len == 2 {
            Content::Intervals(nl.raw_elements(family, table, &s.name)?)
        } else if s.flags & 0x4 != 0 {
            Content::Ranges(nl.ranges(family, table, &s.name)?)
        } else {
            // A 16-byte key parses as an IPv6 address; a map's interface
            // names are taken back as such (same bytes).
            let ifname = |k: Key| match k {
                Key::Addr(std::net::IpAddr::V6(a)) => Key::IfName(a.octets()),
                k => k,
            };
            if s.key_type == TYPE_IFNAME {
                // A dispatch map: each interface and the chain it goes to.
                let entries = nl.verdicts(family, table, &s.name)?;
                let keys = entries.iter().map(|(k, _)| ifname(*k)).collect();
                let by_name = entries
                    .into_iter()
                    .filter_map(|(k, c)| Some((ifname(k).as_ifname()?, c)))
                    .collect();
                t.maps.insert(s.name.clone(), by_name);
                Content::Keys(keys)
            } else {
                let keys = nl.elements(family, table, &s.name)?.into_iter();
                Content::Keys(keys.collect())
            }
        };
        contents
            .sets
            .insert((table.to_string(), s.name.clone()), content);
        t.sets.insert(s.name.clone(), s);
    }
    contents.tables.insert(table.to_string());
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::nftables::plan::Content;

    fn chain(comments: &[&str]) -> ObservedChain {
        ObservedChain {
            hook: None,
            comments: comments
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .into(),
        }
    }

    fn info(name: &str, flags: u32) -> super::super::ops::SetInfo {
        super::super::ops::SetInfo {
            name: name.into(),
            key_type: 7,
            key_len: 4,
            flags,
        }
    }

    /// What the model holds: chains a, b; set s; map m.
    fn written() -> ObservedTable {
        let mut t = ObservedTable::default();
        t.chains.insert("a".into(), chain(&["a1"]));
        t.chains.insert("b".into(), chain(&["b1", "b2"]));
        t.sets.insert("s".into(), info("s", 0));
        t.sets.insert("m".into(), info("m", 8));
        t.maps
            .insert("m".into(), [("cali1".to_string(), "b".to_string())].into());
        t
    }

    /// The read: chain a changed by hand, b torn by a rewrite, set s's
    /// and map m's contents, a chain c a commit removed meanwhile.
    fn read() -> TableRead {
        let mut t = written();
        t.chains.insert("a".into(), chain(&[]));
        t.chains.insert("b".into(), chain(&["b1"]));
        t.chains.insert("c".into(), chain(&["c1"]));
        t.maps.insert("m".into(), [].into());
        let contents: Contents = [
            (("t".to_string(), "s".to_string()), Content::Keys([].into())),
            (("t".to_string(), "m".to_string()), Content::Keys([].into())),
        ]
        .into();
        Some((t, contents))
    }

    /// Untouched objects stay as read (what was changed by hand is put
    /// back by the plan); touched ones are taken as written.
    #[test]
    fn what_a_commit_touched_meanwhile_is_taken_as_written() {
        let w = written();
        assert_eq!(
            patch_read("t", read(), &[], Some(&w)),
            Some(read()),
            "untouched: as read"
        );

        let (b, c, m) = (
            Object::Chain("b".into()),
            Object::Chain("c".into()),
            Object::Set("m".into()),
        );
        let (t, contents) = patch_read("t", read(), &[&b, &c, &m], Some(&w))
            .unwrap()
            .unwrap();
        assert_eq!(t.chains["a"], chain(&[]), "as read: to be put back");
        assert_eq!(t.chains["b"], w.chains["b"], "as written");
        assert!(!t.chains.contains_key("c"), "removed, as written");
        assert_eq!(t.maps["m"], w.maps["m"]);
        assert!(contents.read("t"));
        assert!(contents.get(&("t".into(), "s".into())).is_some());
        assert!(
            contents.get(&("t".into(), "m".into())).is_none(),
            "not as read"
        );

        // A set removed meanwhile is gone with its entries.
        let mut gone = w.clone();
        gone.sets.remove("m");
        gone.maps.remove("m");
        let (t, _) = patch_read("t", read(), &[&m], Some(&gone))
            .unwrap()
            .unwrap();
        assert!(!t.sets.contains_key("m") && !t.maps.contains_key("m"));
    }

    /// A table made or removed while it was read, or not there when read
    /// and written to since, is read again.
    #[test]
    fn a_table_that_came_or_went_meanwhile_is_read_again() {
        let w = written();
        assert_eq!(patch_read("t", read(), &[&Object::Table], Some(&w)), None);
        let a = Object::Chain("a".into());
        assert_eq!(patch_read("t", None, &[&a], Some(&w)), None);
        assert_eq!(
            patch_read("t", None, &[], None),
            Some(None),
            "gone, untouched"
        );
    }
}
