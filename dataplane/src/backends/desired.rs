//! What the managers write into, whichever dataplane programs it: chains
//! of rules per table ([`RuleTable`]) and IP sets ([`SetStore`]). The
//! iptables dataplane implements them with `iptables-restore` and `ipset`
//! ([`super::iptables::Table`], [`super::ipsets::IpSets`]); the nftables
//! one with its own tables and sets ([`super::nftables::Dataplane`]).
//! Plain desired state: no I/O happens through these.

use std::collections::{BTreeSet, HashSet};

use super::ipsets::Meta;
use crate::generictables::{Rule, RuleError};
use crate::model::IpVersion;
use crate::model::ipsets::{Member, SetNames};

/// The chains of one table (`raw`, `mangle`, `nat`, `filter`) of one IP
/// version, in iptables' rule syntax.
pub trait RuleTable: Send {
    fn table(&self) -> &'static str;
    fn version(&self) -> IpVersion;
    /// Chain `name` (which must carry our prefix) must hold `rules`.
    fn set_chain(&mut self, name: &str, rules: Vec<Rule>) -> Result<(), RuleError>;
    /// Chain `name` is no longer wanted.
    fn remove_chain(&mut self, name: &str);
    /// Program `name` even if nothing references it.
    fn force(&mut self, name: &str);
    /// Our rules in built-in chain `builtin`; an empty list removes them.
    fn set_hooks(&mut self, builtin: &str, rules: Vec<Rule>) -> Result<(), RuleError>;
    /// The desired rules of chain `name`, if it is set.
    fn chain(&self, name: &str) -> Option<&[Rule]>;
    /// The desired rules of built-in chain `builtin`'s hooks.
    fn hooks(&self, builtin: &str) -> &[Rule];
    /// The chains that will be programmed: those the hooks reach, and the
    /// forced ones.
    fn programmed(&self) -> BTreeSet<String>;
    /// Whether the workload dispatch here goes interface by interface (the
    /// managers' tree of chains); else the table sends every workload
    /// interface on as one (the sharded nftables filter: its shards' maps
    /// know the interfaces) and takes only the dispatch roots, whatever
    /// they hold.
    fn dispatch_by_interface(&self) -> bool {
        true
    }
}

/// The IP sets of one IP version.
pub trait SetStore: Send {
    fn version(&self) -> IpVersion;
    fn names(&self) -> &SetNames;
    /// The manager must call [`start_full`](Self::start_full) and then
    /// [`replace`](Self::replace) every desired set.
    fn needs_full(&self) -> bool;
    /// Forget the desired state; the manager sends all of it again.
    fn start_full(&mut self);
    /// Set `name` must hold exactly `members`.
    fn replace(&mut self, name: String, meta: Meta, members: HashSet<Member>);
    /// Members added to and removed from set `name` (which must have been
    /// [`replace`](Self::replace)d before).
    fn delta(
        &mut self,
        name: &str,
        add: &mut dyn Iterator<Item = Member>,
        del: &mut dyn Iterator<Item = Member>,
    );
    /// Set `name` must go.
    fn remove(&mut self, name: &str);
}

impl RuleTable for super::iptables::Table {
    fn table(&self) -> &'static str {
        self.table()
    }
    fn version(&self) -> IpVersion {
        self.version()
    }
    fn set_chain(&mut self, name: &str, rules: Vec<Rule>) -> Result<(), RuleError> {
        self.set_chain(name, rules)
    }
    fn remove_chain(&mut self, name: &str) {
        self.remove_chain(name)
    }
    fn force(&mut self, name: &str) {
        self.force(name)
    }
    fn set_hooks(&mut self, builtin: &str, rules: Vec<Rule>) -> Result<(), RuleError> {
        self.set_hooks(builtin, rules)
    }
    fn chain(&self, name: &str) -> Option<&[Rule]> {
        self.chain(name)
    }
    fn hooks(&self, builtin: &str) -> &[Rule] {
        self.hooks(builtin)
    }
    fn programmed(&self) -> BTreeSet<String> {
        self.programmed()
    }
}

impl SetStore for super::ipsets::IpSets {
    fn version(&self) -> IpVersion {
        self.version()
    }
    fn names(&self) -> &SetNames {
        self.names()
    }
    fn needs_full(&self) -> bool {
        self.needs_full()
    }
    fn start_full(&mut self) {
        self.start_full()
    }
    fn replace(&mut self, name: String, meta: Meta, members: HashSet<Member>) {
        self.replace(name, meta, members)
    }
    fn delta(
        &mut self,
        name: &str,
        add: &mut dyn Iterator<Item = Member>,
        del: &mut dyn Iterator<Item = Member>,
    ) {
        self.delta(name, add, del)
    }
    fn remove(&mut self, name: &str) {
        self.remove(name)
    }
}
