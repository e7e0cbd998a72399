//! The chains the managers want in one table (`raw`, `mangle`, `nat`,
//! `filter`) of one IP version, translated to expressions as they are
//! set ([`super::translate`]): plain data, read by the plan.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

use super::ops::{BaseChain, Hook};
use super::translate::{Dispatch, Translated, translate};
use crate::backends::desired::RuleTable;
use crate::generictables::{Ownership, Rule, RuleError, chained_hashes, rule_hashes};
use crate::model::IpVersion;

/// One chain: the managers' rules, what they translate to, and the
/// comment each rule carries (our prefix and the rule's hash, chained over
/// the chain's name as the iptables dataplane does: equal comments, equal
/// rules).
#[derive(Debug, Clone, PartialEq)]
pub struct DesiredChain {
    pub rules: Vec<Rule>,
    /// Shared between rules of the same text ([`Interned`]).
    pub translated: Vec<Arc<Translated>>,
    /// Shared with what the plan records as written (no copy per apply).
    pub comments: Arc<[String]>,
}

impl DesiredChain {
    fn new(
        name: &str,
        rules: Vec<Rule>,
        v6: bool,
        own: &Ownership,
        interned: &mut Interned,
        maps: bool,
    ) -> Result<Self, RuleError> {
        // An interface dispatch (in a table that makes them maps): one
        // map lookup and its last rule, whose comments name the map (so a
        // new map is a rewritten chain).
        if maps {
            let texts: Vec<&str> = rules.iter().map(Rule::text).collect();
            if let Some(d) = Dispatch::of(name, &texts) {
                let d = Arc::new(d);
                let lookup = format!("vmap @{}", d.name);
                let comments = chained_hashes(name, [lookup.as_str(), d.last()])
                    .iter()
                    .map(|h| format!("{}{h}", own.comment_prefix))
                    .collect::<Vec<_>>()
                    .into();
                return Ok(Self {
                    translated: d.rules().into_iter().map(Arc::new).collect(),
                    rules,
                    comments,
                });
            }
        }
        let translated = rules
            .iter()
            .map(|r| interned.translate(r.text(), v6))
            .collect::<Result<Vec<_>, _>>()?;
        let comments = rule_hashes(name, &rules)
            .iter()
            .map(|h| format!("{}{h}", own.comment_prefix))
            .collect::<Vec<_>>()
            .into();
        Ok(Self {
            rules,
            translated,
            comments,
        })
    }

    /// The chains its rules jump or go to.
    pub fn targets(&self) -> impl Iterator<Item = &str> {
        self.translated.iter().flat_map(|t| {
            t.target.as_deref().into_iter().chain(
                t.dispatch
                    .iter()
                    .flat_map(|d| d.entries.iter().map(|(_, c)| c.as_str())),
            )
        })
    }
}

/// Translations by rule text, shared: most of a node's rules are the same
/// few lines in every endpoint's chain (conntrack, marks, returns, the
/// drop), and at 320,000 rules a translation each was a third of the
/// daemon's memory. Entries no chain holds any more are let go once the
/// map has doubled, or as many rules as it kept were let go, since the
/// last look.
#[derive(Debug, Clone, Default)]
pub struct Interned {
    by_text: std::collections::HashMap<String, Arc<Translated>>,
    kept_at_last_prune: usize,
    /// Rules of chains replaced or removed since then.
    dropped: usize,
}

impl Interned {
    fn translate(&mut self, text: &str, v6: bool) -> Result<Arc<Translated>, RuleError> {
        if let Some(t) = self.by_text.get(text) {
            return Ok(Arc::clone(t));
        }
        let t = Arc::new(translate(text, v6).map_err(|e| RuleError::Nftables(e.to_string()))?);
        self.by_text.insert(text.to_string(), Arc::clone(&t));
        Ok(t)
    }

    /// Lets go of the translations only this map holds, when it has grown
    /// enough since the last time for the look to be worth it.
    fn prune(&mut self, dropped: usize) {
        self.dropped += dropped;
        let floor = self.kept_at_last_prune + 1024;
        if self.by_text.len() < self.kept_at_last_prune + floor && self.dropped < floor {
            return;
        }
        self.by_text.retain(|_, t| Arc::strong_count(t) > 1);
        self.kept_at_last_prune = self.by_text.len();
        self.dropped = 0;
    }

    /// Distinct translations held.
    pub fn len(&self) -> usize {
        self.by_text.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_text.is_empty()
    }
}

const BUILTINS: &[&str] = &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// The suffix of a filter hook that runs after the shards
/// (`FORWARD-END`).
pub const END: &str = "-END";
/// The suffix of a filter hook that runs before the shards
/// (`PREROUTING-FIRST`).
pub const FIRST: &str = "-FIRST";
/// Where the shards hook `forward`: after filter (0).
pub const SHARD_PRIORITY: i32 = 10;
/// Where filter's end check hooks: after the shards.
pub const END_PRIORITY: i32 = 20;
/// Where filter hooks `prerouting` in the sharded layout: after DNAT
/// (nat's −100), so that policy sees the address the packet goes to, as
/// it does in forward.
pub const FIRST_PRIORITY: i32 = -90;
/// Where the shards hook `prerouting`: after filter's.
pub const SHARD_PRE_PRIORITY: i32 = -80;

/// Where iptables' built-in chain `builtin` of `table` hooks, at the
/// priority iptables-nft gives it (so the two order alike beside each
/// other); `None` where iptables has no such chain.
pub fn base_chain(table: &str, builtin: &str) -> Option<BaseChain> {
    let base = builtin.strip_suffix(END).unwrap_or(builtin);
    let hook = match base.strip_suffix(FIRST).unwrap_or(base) {
        "PREROUTING" => Hook::Prerouting,
        "INPUT" => Hook::Input,
        "FORWARD" => Hook::Forward,
        "OUTPUT" => Hook::Output,
        "POSTROUTING" => Hook::Postrouting,
        _ => return None,
    };
    let end = builtin.ends_with(END);
    let first = base.ends_with(FIRST);
    let priority = match (table, hook, end) {
        // The sharded layout (see `super::shards`): filter's prerouting
        // first, then the shards'; the shards' forward after filter's,
        // filter's end check after them.
        ("filter", Hook::Prerouting, false) if first => FIRST_PRIORITY,
        _ if first => return None,
        (t, Hook::Prerouting, false) if t.starts_with("filter-") => SHARD_PRE_PRIORITY,
        (t, Hook::Input | Hook::Forward, false) if t.starts_with("filter-") => SHARD_PRIORITY,
        ("filter", Hook::Input | Hook::Forward, true) => END_PRIORITY,
        (_, _, true) => return None,
        (t, _, _) if t.starts_with("filter-") => return None,
        ("raw", Hook::Prerouting | Hook::Output, _) => -300,
        ("mangle", _, _) => -150,
        ("nat", Hook::Prerouting | Hook::Output, _) => -100,
        ("nat", Hook::Input | Hook::Postrouting, _) => 100,
        ("filter", Hook::Input | Hook::Forward | Hook::Output, _) => 0,
        _ => return None,
    };
    Some(BaseChain {
        hook,
        priority,
        accept_by_default: true,
        nat: table == "nat",
    })
}

/// The desired chains of one table.
#[derive(Debug, Clone)]
pub struct ChainTable {
    table: &'static str,
    version: IpVersion,
    own: Ownership,
    pub(super) chains: BTreeMap<String, DesiredChain>,
    /// Our rules in each built-in chain (their own base chain here).
    pub(super) hooks: BTreeMap<String, DesiredChain>,
    forced: BTreeSet<String>,
    /// Changed since the last successful write.
    pub(super) changed: bool,
    /// Chains set (added or whose rules changed) since then.
    pub(super) touched: BTreeSet<String>,
    /// Which chains the hooks reach may have changed (a chain added or
    /// removed, a jump changed; the hooks and forced chains as they were):
    /// the next plan looks at which chains are reached and writes the
    /// touched and new ones, removes those no longer reached
    /// (`plan::changes::cheap`).
    pub(super) regraphed: bool,
    /// The hooks or the forced chains changed: the next plan looks at
    /// every chain.
    pub(super) reshaped: bool,
    interned: Interned,
    /// Interface dispatch chains become verdict maps (the shards).
    maps: bool,
    /// Holds every IP set, used or not (filter, unless sharded: where
    /// `nft list` finds them, and so a policy that starts using a big set
    /// does not have to write it first); the others hold those their
    /// rules look up.
    pub(super) all_sets: bool,
    /// With `all_sets`: only those no other table's rules look up (the
    /// sharded filter: every set is somewhere, a big one once).
    pub(super) spare_sets_only: bool,
    /// Chains the kernel refused (a commit it refused named one of their
    /// rules): held as a single drop until their rules change. By name:
    /// the rules refused, and why.
    pub(super) quarantined: BTreeMap<String, (Vec<Rule>, String)>,
}

impl ChainTable {
    pub fn new(table: &'static str, version: IpVersion, own: Ownership) -> Self {
        Self {
            table,
            version,
            own,
            chains: BTreeMap::new(),
            hooks: BTreeMap::new(),
            forced: BTreeSet::new(),
            changed: true,
            touched: BTreeSet::new(),
            regraphed: true,
            reshaped: true,
            interned: Interned::default(),
            maps: false,
            all_sets: table == "filter",
            spare_sets_only: false,
            quarantined: BTreeMap::new(),
        }
    }

    /// Holds chain `name` fail-closed (a single drop) because the kernel
    /// refused its rules (`why`); false if there is no such chain or it
    /// is held already.
    pub(super) fn quarantine(&mut self, name: &str, why: String) -> bool {
        if self.quarantined.contains_key(name) {
            return false;
        }
        let Some(wanted) = self.chains.get(name).map(|c| c.rules.clone()) else {
            return false;
        };
        let drop = vec![Rule::parse("-j DROP").expect("a valid rule")];
        let Ok(chain) = self.build(name, drop) else {
            return false;
        };
        tracing::warn!(
            table = self.table,
            chain = name,
            error = %why,
            "the kernel refused this chain's rules: it drops everything until they change (the rest is written)"
        );
        self.put(name, chain);
        self.quarantined.insert(name.to_string(), (wanted, why));
        true
    }

    /// Whether `rules` are what chain `name` is held fail-closed for
    /// (setting them again changes nothing); other rules lift the hold.
    fn still_refused(&mut self, name: &str, rules: &[Rule]) -> bool {
        match self.quarantined.get(name) {
            Some((wanted, _)) if wanted.as_slice() == rules => true,
            Some(_) => {
                tracing::info!(
                    table = self.table,
                    chain = name,
                    "its rules changed: no longer held fail-closed"
                );
                self.quarantined.remove(name);
                false
            }
            None => false,
        }
    }

    /// A table whose interface dispatch chains are verdict maps.
    pub fn with_maps(mut self) -> Self {
        self.maps = true;
        self
    }

    /// Builds chain `name` of `rules` as [`RuleTable::set_chain`] would
    /// set it (to be [`put`](Self::put) here or in another table).
    pub(super) fn build(
        &mut self,
        name: &str,
        rules: Vec<Rule>,
    ) -> Result<DesiredChain, RuleError> {
        let v6 = self.v6();
        DesiredChain::new(name, rules, v6, &self.own, &mut self.interned, self.maps)
    }

    /// Sets chain `name` to `chain`, built by [`build`](Self::build) (of
    /// this table or one of the same IP version and maps).
    pub(super) fn put(&mut self, name: &str, chain: DesiredChain) {
        if self.chains.get(name) == Some(&chain) || self.still_refused(name, &chain.rules) {
            return;
        }
        // What is programmed depends on the chains a chain jumps to, not
        // on how often or in which order (a dispatch chain given one more
        // interface that goes where the others go reshapes nothing).
        let same_jumps = self.chains.get(name).is_some_and(|old| {
            old.targets().eq(chain.targets()) || {
                let a: BTreeSet<&str> = old.targets().collect();
                let b: BTreeSet<&str> = chain.targets().collect();
                a == b
            }
        });
        self.touched.insert(name.to_string());
        if !same_jumps {
            tracing::debug!(
                table = self.table,
                chain = name,
                "regraphed: a chain's jumps changed"
            );
            self.regraphed = true;
        }
        let old = self.chains.insert(name.to_string(), chain);
        self.changed = true;
        self.interned.prune(old.map_or(0, |o| o.translated.len()));
    }

    /// The desired chain `name`.
    pub(super) fn desired(&self, name: &str) -> Option<&DesiredChain> {
        self.chains.get(name)
    }

    fn v6(&self) -> bool {
        self.version == IpVersion::V6
    }

    /// The chains to program: those the hooks reach and the forced ones.
    pub(super) fn reachable(&self) -> HashSet<&str> {
        let mut out = HashSet::with_capacity(self.chains.len());
        let mut todo: Vec<&str> = self.forced.iter().map(String::as_str).collect();
        for h in self.hooks.values() {
            todo.extend(h.targets());
        }
        while let Some(c) = todo.pop() {
            let Some((name, chain)) = self.chains.get_key_value(c) else {
                continue;
            };
            if out.insert(name.as_str()) {
                todo.extend(chain.targets());
            }
        }
        out
    }
}

impl RuleTable for ChainTable {
    fn table(&self) -> &'static str {
        self.table
    }

    fn version(&self) -> IpVersion {
        self.version
    }

    fn set_chain(&mut self, name: &str, rules: Vec<Rule>) -> Result<(), RuleError> {
        if !name.starts_with(&self.own.chain_prefix) || BUILTINS.contains(&name) {
            return Err(RuleError::ChainName(name.to_string()));
        }
        if self.chains.get(name).map(|c| &c.rules) != Some(&rules)
            && !self.still_refused(name, &rules)
        {
            let chain = self.build(name, rules)?;
            self.put(name, chain);
        }
        Ok(())
    }

    fn remove_chain(&mut self, name: &str) {
        self.quarantined.remove(name);
        if let Some(old) = self.chains.remove(name) {
            let n = old.translated.len();
            drop(old);
            self.interned.prune(n);
            self.forced.remove(name);
            self.touched.remove(name);
            self.changed = true;
            tracing::debug!(
                table = self.table,
                chain = name,
                "regraphed: a chain removed"
            );
            self.regraphed = true;
        }
    }

    fn force(&mut self, name: &str) {
        if self.forced.insert(name.to_string()) {
            self.changed = true;
            self.reshaped = true;
        }
    }

    fn set_hooks(&mut self, builtin: &str, rules: Vec<Rule>) -> Result<(), RuleError> {
        if base_chain(self.table, builtin).is_none() {
            return Err(RuleError::ChainName(builtin.to_string()));
        }
        if self.hooks.get(builtin).map_or(&[][..], |c| &c.rules[..]) == &rules[..] {
            return Ok(());
        }
        if rules.is_empty() {
            self.hooks.remove(builtin);
        } else {
            let chain = self.build(builtin, rules)?;
            self.hooks.insert(builtin.to_string(), chain);
        }
        self.changed = true;
        tracing::debug!(table = self.table, builtin, "reshaped: hooks changed");
        self.reshaped = true;
        Ok(())
    }

    fn chain(&self, name: &str) -> Option<&[Rule]> {
        if let Some((wanted, _)) = self.quarantined.get(name) {
            return Some(wanted);
        }
        self.chains.get(name).map(|c| c.rules.as_slice())
    }

    fn hooks(&self, builtin: &str) -> &[Rule] {
        self.hooks.get(builtin).map_or(&[], |c| c.rules.as_slice())
    }

    fn programmed(&self) -> BTreeSet<String> {
        self.reachable().into_iter().map(str::to_string).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> Rule {
        Rule::parse(s).unwrap()
    }

    /// The same rule text in many chains is translated once; what no
    /// chain holds any more is let go.
    #[test]
    fn translations_are_shared_and_let_go() {
        let mut t = ChainTable::new("filter", IpVersion::V4, Ownership::new("dph"));
        for i in 0..3000 {
            t.set_chain(
                &format!("dph-tw-{i}"),
                vec![
                    r("-m conntrack --ctstate INVALID -j DROP"),
                    r(&format!("-j dph-pi-{i}")),
                ],
            )
            .unwrap();
        }
        let a = &t.chains["dph-tw-1"].translated[0];
        let b = &t.chains["dph-tw-2"].translated[0];
        assert!(Arc::ptr_eq(a, b), "one translation for one text");
        assert_ne!(
            t.chains["dph-tw-1"].translated[1],
            t.chains["dph-tw-2"].translated[1]
        );
        assert!(t.interned.len() <= 3001, "{}", t.interned.len());
        for i in 0..3000 {
            t.remove_chain(&format!("dph-tw-{i}"));
        }
        assert!(
            t.interned.len() < 1024 + 2,
            "let go once unused: {}",
            t.interned.len()
        );
    }

    #[test]
    fn only_what_the_hooks_reach_is_programmed() {
        let mut t = ChainTable::new("filter", IpVersion::V4, Ownership::new("dph"));
        t.set_chain("dph-a", vec![r("-j dph-b")]).unwrap();
        t.set_chain("dph-b", vec![r("-j DROP")]).unwrap();
        t.set_chain("dph-c", vec![r("-j DROP")]).unwrap();
        assert!(t.programmed().is_empty());
        t.set_hooks("FORWARD", vec![r("-j dph-a")]).unwrap();
        assert_eq!(t.programmed(), ["dph-a", "dph-b"].map(String::from).into());
        t.force("dph-c");
        assert_eq!(t.programmed().len(), 3);
        assert!(
            t.set_hooks("PREROUTING", vec![r("-j dph-a")]).is_err(),
            "no such chain in filter"
        );
        assert!(t.set_chain("FORWARD", vec![]).is_err());
        assert!(t.set_chain("other", vec![]).is_err());
        let err = t.set_chain("dph-d", vec![r("-j REJECT")]).unwrap_err();
        assert!(matches!(err, RuleError::Nftables(_)), "{err}");
        assert!(
            t.chain("dph-d").is_none(),
            "a rule that cannot be translated sets nothing"
        );
    }

    #[test]
    fn comments_carry_the_prefix_and_the_chained_hash() {
        let mut t = ChainTable::new("filter", IpVersion::V4, Ownership::new("dph"));
        t.set_chain("dph-a", vec![r("-j ACCEPT"), r("-j DROP")])
            .unwrap();
        let c = &t.chains["dph-a"].comments;
        assert!(
            c.iter().all(|c| c.starts_with("dph:") && c.len() == 20),
            "{c:?}"
        );
        assert_ne!(c[0], c[1]);
    }

    #[test]
    fn base_chains_sit_where_iptables_nft_puts_them() {
        assert_eq!(base_chain("raw", "PREROUTING").unwrap().priority, -300);
        assert_eq!(base_chain("nat", "POSTROUTING").unwrap().priority, 100);
        assert!(base_chain("nat", "POSTROUTING").unwrap().nat);
        assert!(!base_chain("filter", "FORWARD").unwrap().nat);
        assert!(base_chain("raw", "FORWARD").is_none());
        assert!(base_chain("filter", "PREROUTING").is_none());
        let first = base_chain("filter", "PREROUTING-FIRST").unwrap();
        let shard = base_chain("filter-3", "PREROUTING").unwrap();
        let dnat = base_chain("nat", "PREROUTING").unwrap();
        assert!(dnat.priority < first.priority && first.priority < shard.priority);
        assert!(base_chain("filter", "FORWARD-FIRST").is_none());
        assert!(base_chain("filter-3", "INPUT").is_some());
    }
}
