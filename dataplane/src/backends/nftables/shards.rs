//! The filter table, sharded: workload policy spread over several small
//! tables so that a commit which changes a rule walks one small table,
//! not all of filter (the kernel validates the whole table a changed rule
//! is in; see the module header of [`super`]).
//!
//! What the managers set in filter is routed here:
//! - a workload's endpoint chains (`<prefix>-fw-<iface>`, `-tw-`) go to
//!   one shard table (`<prefix>-filter-<n>`), with copies of the policy
//!   and profile chains they jump to (and so of the IP sets those look
//!   up). In the shard an endpoint chain is named by its rules
//!   (`<prefix>-tw-list-<hash>`: a policy list chain), and the endpoints
//!   there with the same rules (the same policies and profiles) share it:
//!   the kernel's commit passes over every chain in the namespace, so
//!   10,000 replicas of a few deployments cost a few chains per shard, not
//!   20,000. The chain goes with the last endpoint that uses it; one whose
//!   policies change moves to the chain of its new rules. A restart finds
//!   the interfaces where the shards' dispatch maps name them.
//!   An interface stays in the shard it was first put in; a new one
//!   goes to the shard its IP sets point at (endpoints whose policies look
//!   up the same sets share a shard, so the sets are copied few times and
//!   a policy change walks the few shards its endpoints are in), unless
//!   that shard is a quarter fuller than the average, then to the
//!   emptiest;
//! - everything else stays in filter, where the workload dispatch now
//!   goes to one of two small chains instead of the endpoint's: they set
//!   the endpoint's "allowed" mark (so filter goes on as if its policy had
//!   allowed the packet) and a pending bit (`Marks::pending_from` /
//!   `pending_to`), which filter's forward and input hooks clear first
//!   (only its dispatch sets them);
//! - each shard hooks `forward` and `input` after filter
//!   ([`super::chains::SHARD_PRIORITY`]) and, for a packet with a pending bit, looks its
//!   interface up in a verdict map of the shard's endpoints and goes to
//!   the endpoint chain, which clears the bit first and then drops or
//!   allows as it did in filter. A drop in any table is final; so is
//!   filter's own: the packet passes only if filter and the shard both
//!   let it;
//! - filter's end check ([`super::chains::END_PRIORITY`]) drops a packet still marked
//!   pending that is not part of an established flow: its shard was
//!   missing (fail closed). An established packet may keep its ingress
//!   bit: its egress chain accepted it first, as filter would have.
//!
//! With fewer than 2 shards, or a mark mask without the two bits, nothing
//! is routed: filter holds every chain as before.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::chains::{ChainTable, END};
use crate::backends::desired::RuleTable;
use crate::backends::iptables::{Ownership, Rule, RuleError};
use crate::model::IpVersion;
use crate::rules::Marks;

/// Most shard tables (their names are static).
pub const MAX_SHARDS: usize = 32;

const SHARD_NAMES: [&str; MAX_SHARDS] = [
    "filter-0",
    "filter-1",
    "filter-2",
    "filter-3",
    "filter-4",
    "filter-5",
    "filter-6",
    "filter-7",
    "filter-8",
    "filter-9",
    "filter-10",
    "filter-11",
    "filter-12",
    "filter-13",
    "filter-14",
    "filter-15",
    "filter-16",
    "filter-17",
    "filter-18",
    "filter-19",
    "filter-20",
    "filter-21",
    "filter-22",
    "filter-23",
    "filter-24",
    "filter-25",
    "filter-26",
    "filter-27",
    "filter-28",
    "filter-29",
    "filter-30",
    "filter-31",
];

/// Egress (from the workload) or ingress (to it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Dir {
    From,
    To,
}

/// How the chains are spread, when they are.
#[derive(Debug, Clone)]
struct Placement {
    chain_prefix: String,
    from_bit: u32,
    to_bit: u32,
    accept: u32,
    /// Each workload interface's shard.
    placed: HashMap<String, usize>,
    /// Endpoint chains per shard.
    load: Vec<usize>,
    /// Per shard: the chains copied from filter, and how many chains
    /// there jump to each.
    refs: Vec<HashMap<String, usize>>,
    /// Per shard and direction: its interfaces, each with the chain its
    /// dispatch goes to.
    members: Vec<[BTreeMap<String, String>; 2]>,
    /// Each endpoint chain's policy list chain (named by its rules).
    lists: HashMap<String, String>,
    /// Per shard: its policy list chains, and how many endpoint chains
    /// each stands for.
    users: Vec<HashMap<String, usize>>,
    /// Endpoint chains set or removed since the last [`Filter::settle`].
    dirty: BTreeSet<String>,
    /// Filter's chains set since then that a shard holds a copy of.
    recopy: BTreeSet<String>,
    /// The endpoint chains as the managers set them.
    endpoints: HashMap<String, Vec<Rule>>,
    /// The workload dispatch chains as the managers set them (filter
    /// holds them redirected).
    dispatch: HashMap<String, Vec<Rule>>,
}

/// How workload policy is spread: over `shards` tables, with the pending
/// bits of `marks`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ShardLayout {
    pub marks: Marks,
    pub shards: usize,
}

/// The filter table of one IP version: filter itself and its shards.
#[derive(Debug, Clone)]
pub struct Filter {
    pub main: ChainTable,
    pub shards: Vec<ChainTable>,
    layout: Option<Placement>,
}

fn rule(text: &str) -> Rule {
    Rule::parse(text).expect("a rule of our own tokens")
}

/// `-m mark --mark <bit>/<bit> <tail>`.
fn on_bit(bit: u32, tail: &str) -> Rule {
    rule(&format!("-m mark --mark {bit:#x}/{bit:#x} {tail}"))
}

impl Filter {
    /// `shards` tables (at most [`MAX_SHARDS`]) when `marks` has the
    /// pending bits; else filter alone.
    pub fn new(version: IpVersion, own: Ownership, marks: Marks, shards: usize) -> Self {
        let n = shards.min(MAX_SHARDS);
        let sharded = n >= 2 && marks.pending_from != 0 && marks.pending_to != 0;
        let mut f = Self {
            main: ChainTable::new("filter", version, own.clone()),
            shards: Vec::new(),
            layout: None,
        };
        if !sharded {
            return f;
        }
        // Each set where its users are; filter holds only those no shard
        // uses (a copy of the others would be one more of a million
        // members).
        f.main.spare_sets_only = true;
        f.shards = SHARD_NAMES[..n]
            .iter()
            .map(|t| ChainTable::new(t, version, own.clone()).with_maps())
            .collect();
        let layout = Placement {
            chain_prefix: own.chain_prefix.clone(),
            from_bit: marks.pending_from,
            to_bit: marks.pending_to,
            accept: marks.accept,
            placed: HashMap::new(),
            load: vec![0; n],
            refs: vec![HashMap::new(); n],
            members: vec![Default::default(); n],
            lists: HashMap::new(),
            users: vec![HashMap::new(); n],
            dirty: BTreeSet::new(),
            recopy: BTreeSet::new(),
            endpoints: HashMap::new(),
            dispatch: HashMap::new(),
        };
        // The two chains filter's dispatch goes to, and its end check.
        for dir in [Dir::From, Dir::To] {
            let bits = layout.bit(dir) | layout.accept;
            let stub = layout.stub(dir);
            f.main
                .set_chain(
                    &stub,
                    vec![rule(&format!("-j MARK --set-xmark {bits:#x}/{bits:#x}"))],
                )
                .expect("the pending chain is valid");
            f.main.force(&stub);
        }
        let established = rule("-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT");
        let forward = vec![
            established.clone(),
            on_bit(layout.from_bit, "-j DROP"),
            on_bit(layout.to_bit, "-j DROP"),
        ];
        let input = vec![established, on_bit(layout.from_bit, "-j DROP")];
        f.main
            .set_hooks(&format!("FORWARD{END}"), forward)
            .expect("the end check is valid");
        f.main
            .set_hooks(&format!("INPUT{END}"), input)
            .expect("the end check is valid");
        f.layout = Some(layout);
        f
    }

    /// Every table: filter, then the shards.
    pub fn tables(&self) -> impl Iterator<Item = &ChainTable> {
        std::iter::once(&self.main).chain(&self.shards)
    }

    pub fn tables_mut(&mut self) -> impl Iterator<Item = &mut ChainTable> {
        std::iter::once(&mut self.main).chain(&mut self.shards)
    }

    /// Something is still to be written.
    pub fn changed(&self) -> bool {
        self.tables().any(|t| t.changed)
            || self
                .layout
                .as_ref()
                .is_some_and(|l| !l.dirty.is_empty() || !l.recopy.is_empty())
    }

    /// The shard of each workload interface placed so far.
    pub fn placement(&self) -> HashMap<String, usize> {
        self.layout
            .as_ref()
            .map(|l| l.placed.clone())
            .unwrap_or_default()
    }

    /// Takes the shards a previous run put interfaces in from `observed`
    /// (our tables as read) and `contents` (their sets' and maps'
    /// elements), for those not placed yet: a restart that finds them
    /// right writes nothing. An interface is where a shard's dispatch map
    /// names it (or, as an older layout had it, a chain is named after
    /// it). Shards beyond the number now configured are left to be
    /// emptied.
    pub fn adopt(
        &mut self,
        observed: &super::plan::Observed,
        contents: Option<&super::plan::Contents>,
        chain_prefix: &str,
    ) {
        let Some(l) = self.layout.as_mut() else {
            return;
        };
        for (s, t) in self.shards.iter().enumerate() {
            let table = super::plan::table_name(chain_prefix, t.table());
            let Some(obs) = observed.get(&table) else {
                continue;
            };
            for name in obs.chains.keys() {
                if let Some((_, iface)) = l.endpoint(name) {
                    l.placed.entry(iface.to_string()).or_insert(s);
                }
            }
            let maps = obs
                .sets
                .keys()
                .filter(|m| m.starts_with(super::translate::DISPATCH_MAP));
            for map in maps {
                let Some(super::plan::Content::Keys(keys)) =
                    contents.and_then(|c| c.get(&(table.clone(), map.clone())))
                else {
                    continue;
                };
                for iface in keys.iter().filter_map(super::ops::Key::as_ifname) {
                    l.placed.entry(iface).or_insert(s);
                }
            }
        }
    }

    /// Puts the endpoint chains set since the last call into their shards
    /// (now that the policies they jump to are set too: a new interface
    /// is placed by the IP sets those look up), and refreshes the copies
    /// of filter's chains the shards hold. Called before each plan.
    pub fn settle(&mut self) -> Result<(), RuleError> {
        let Some(l) = self.layout.as_mut() else {
            return Ok(());
        };
        let dirty = std::mem::take(&mut l.dirty);
        let recopy = std::mem::take(&mut l.recopy);
        // Copies first: an endpoint placed below copies what filter holds.
        for name in recopy {
            for s in 0..self.shards.len() {
                if l.refs[s].contains_key(&name) {
                    copy(l, &self.main, &mut self.shards[s], s, &name);
                }
            }
        }
        let mut touched: BTreeSet<usize> = BTreeSet::new();
        // A chain a shard refuses stays dirty (tried again at the next
        // settle) and the others still go in; the first refusal is returned.
        let mut refused: Option<RuleError> = None;
        for name in dirty {
            let (dir, iface) = l.endpoint(&name).expect("only endpoint chains are dirty");
            let iface = iface.to_string();
            match l.endpoints.get(&name).cloned() {
                Some(rules) => {
                    let mut body =
                        vec![rule(&format!("-j MARK --set-xmark 0x0/{:#x}", l.bit(dir)))];
                    body.extend(rules);
                    let list = l.list_chain(dir, &body);
                    let s = match l.placed.get(&iface) {
                        Some(s) => *s,
                        None => {
                            let s = l.choose(&self.main, &body);
                            l.placed.insert(iface.clone(), s);
                            s
                        }
                    };
                    let shard = &mut self.shards[s];
                    if !l.users[s].contains_key(&list) {
                        if let Err(e) = shard.set_chain(&list, body) {
                            l.dirty.insert(name);
                            refused.get_or_insert(e);
                            continue;
                        }
                        let targets: Vec<String> = shard
                            .desired(&list)
                            .map(|c| c.targets().map(str::to_string).collect())
                            .unwrap_or_default();
                        for t in &targets {
                            add_ref(l, &self.main, shard, s, t);
                        }
                    }
                    *l.users[s].entry(list.clone()).or_insert(0) += 1;
                    if let Some(old) = l.lists.insert(name.clone(), list.clone()) {
                        release(l, shard, s, &old);
                    }
                    let went = l.members[s][dir as usize].insert(iface.clone(), list.clone());
                    if went.is_none() {
                        l.load[s] += 1;
                    }
                    if went.as_ref() != Some(&list) {
                        touched.insert(s);
                    }
                }
                None => {
                    let Some(&s) = l.placed.get(&iface) else {
                        continue;
                    };
                    if let Some(old) = l.lists.remove(&name) {
                        release(l, &mut self.shards[s], s, &old);
                    }
                    if l.members[s][dir as usize].remove(&iface).is_some() {
                        l.load[s] -= 1;
                        touched.insert(s);
                    }
                    if l.members[s].iter().all(|m| !m.contains_key(&iface)) {
                        l.placed.remove(&iface);
                    }
                }
            }
        }
        for s in touched {
            l.dispatch(&mut self.shards[s], s)?;
        }
        refused.map_or(Ok(()), Err)
    }
}

impl Placement {
    fn bit(&self, dir: Dir) -> u32 {
        match dir {
            Dir::From => self.from_bit,
            Dir::To => self.to_bit,
        }
    }

    /// The chain filter's dispatch goes to for a workload in `dir` (no
    /// interface name, at most 15 bytes, can make it).
    fn stub(&self, dir: Dir) -> String {
        match dir {
            Dir::From => format!("{}fw-pending-in-shards", self.chain_prefix),
            Dir::To => format!("{}tw-pending-in-shards", self.chain_prefix),
        }
    }

    /// The policy list chain for an endpoint chain of `body` in `dir`:
    /// named by its rules, so endpoints with the same policies (a
    /// deployment's replicas) share one chain in a shard, and a restart
    /// finds the chain it would write. (The part after `fw-`/`tw-` is
    /// longer than an interface name can be.)
    fn list_chain(&self, dir: Dir, body: &[Rule]) -> String {
        use sha2::Digest as _;
        let mut h = sha2::Sha224::new();
        for r in body {
            h.update(r.text().as_bytes());
            h.update(b"\n");
        }
        let kind = match dir {
            Dir::From => "fw",
            Dir::To => "tw",
        };
        let sum = h.finalize();
        format!(
            "{}{kind}-list-{}",
            self.chain_prefix,
            hex::encode(&sum[..8])
        )
    }

    /// `(direction, interface)` of an endpoint chain's name.
    fn endpoint<'a>(&self, name: &'a str) -> Option<(Dir, &'a str)> {
        let rest = name.strip_prefix(&self.chain_prefix)?;
        let (dir, iface) = if let Some(i) = rest.strip_prefix("fw-") {
            (Dir::From, i)
        } else if let Some(i) = rest.strip_prefix("tw-") {
            (Dir::To, i)
        } else {
            return None;
        };
        // The pending chains are filter's own.
        (iface.len() <= 15 && !iface.is_empty()).then_some((dir, iface))
    }

    /// Whether `name` is a workload dispatch chain of filter's.
    fn is_dispatch(&self, name: &str) -> bool {
        name.strip_prefix(&self.chain_prefix)
            .is_some_and(|r| r.starts_with("from-wl-dispatch") || r.starts_with("to-wl-dispatch"))
    }

    /// A dispatch rule going to an endpoint chain goes to the pending
    /// chain instead.
    fn redirect(&self, r: Rule) -> Rule {
        let Some((dir, _)) = r.target().and_then(|t| self.endpoint(t)) else {
            return r;
        };
        let text = r.text();
        let at = text.rfind(' ').map_or(0, |i| i + 1);
        rule(&format!("{}{}", &text[..at], self.stub(dir)))
    }

    /// The shard for a new interface whose endpoint chain is `rules`: the
    /// one the IP sets of the chains it jumps to point at, unless that
    /// one is a quarter fuller than the average (then the emptiest).
    /// Endpoints with the same policies look up the same sets, so they
    /// share a shard, and a policy list chain there, unless the load
    /// spreads them (a list has at most one chain per shard).
    fn choose(&self, main: &ChainTable, rules: &[Rule]) -> usize {
        let n = self.load.len();
        let total: usize = self.load.iter().sum();
        let cap = total / n + total / (4 * n) + 8;
        let mut sets: BTreeSet<&str> = BTreeSet::new();
        for t in rules.iter().filter_map(Rule::target) {
            if let Some(c) = main.desired(t) {
                for tr in &c.translated {
                    sets.extend(tr.sets.iter().map(String::as_str));
                }
            }
        }
        let preferred = if sets.is_empty() {
            None
        } else {
            use sha2::Digest as _;
            let mut h = sha2::Sha224::new();
            for s in &sets {
                h.update(s.as_bytes());
                h.update(b"\n");
            }
            let d = h.finalize();
            Some(u64::from_le_bytes(d[..8].try_into().expect("8 bytes")) as usize % n)
        };
        let emptiest = (0..n).min_by_key(|s| self.load[*s]).expect("shards");
        match preferred {
            Some(s) if self.load[s] < cap => s,
            _ => emptiest,
        }
    }

    /// Shard `s`'s dispatch chains and hooks, from its interfaces.
    fn dispatch(&self, shard: &mut ChainTable, s: usize) -> Result<(), RuleError> {
        let mut forward = Vec::new();
        let mut input = Vec::new();
        for dir in [Dir::From, Dir::To] {
            let (flag, chain) = match dir {
                Dir::From => ("-i", format!("{}from-wl-shard", self.chain_prefix)),
                Dir::To => ("-o", format!("{}to-wl-shard", self.chain_prefix)),
            };
            let members = &self.members[s][dir as usize];
            if members.is_empty() {
                shard.remove_chain(&chain);
                continue;
            }
            let mut rules: Vec<Rule> = members
                .iter()
                .map(|(i, list)| rule(&format!("{flag} {i} -g {list}")))
                .collect();
            rules.push(rule("-j RETURN"));
            shard.set_chain(&chain, rules)?;
            let hook = on_bit(self.bit(dir), &format!("-j {chain}"));
            if dir == Dir::From {
                input.push(hook.clone());
            }
            forward.push(hook);
        }
        shard.set_hooks("FORWARD", forward)?;
        shard.set_hooks("INPUT", input)
    }
}

/// Shard `s` holds a copy of filter's chain `name` (one more chain there
/// jumps to it).
fn add_ref(l: &mut Placement, main: &ChainTable, shard: &mut ChainTable, s: usize, name: &str) {
    let n = l.refs[s].entry(name.to_string()).or_insert(0);
    *n += 1;
    if *n == 1 {
        copy(l, main, shard, s, name);
    }
}

/// One chain fewer in shard `s` jumps to `name`; the last takes the copy.
fn drop_ref(l: &mut Placement, shard: &mut ChainTable, s: usize, name: &str) {
    let Some(n) = l.refs[s].get_mut(name) else {
        return;
    };
    *n -= 1;
    if *n > 0 {
        return;
    }
    l.refs[s].remove(name);
    let targets: Vec<String> = shard
        .desired(name)
        .map(|c| c.targets().map(str::to_string).collect())
        .unwrap_or_default();
    shard.remove_chain(name);
    for t in &targets {
        drop_ref(l, shard, s, t);
    }
}

/// One endpoint chain fewer in shard `s` stands on policy list chain
/// `list`; the last takes it (and what it alone jumped to) out.
fn release(l: &mut Placement, shard: &mut ChainTable, s: usize, list: &str) {
    let Some(n) = l.users[s].get_mut(list) else {
        return;
    };
    *n -= 1;
    if *n > 0 {
        return;
    }
    l.users[s].remove(list);
    let targets: Vec<String> = shard
        .desired(list)
        .map(|c| c.targets().map(str::to_string).collect())
        .unwrap_or_default();
    shard.remove_chain(list);
    for t in &targets {
        drop_ref(l, shard, s, t);
    }
}

/// Shard `s`'s copy of filter's chain `name` made what filter holds (and
/// the chains it jumps to copied too).
fn copy(l: &mut Placement, main: &ChainTable, shard: &mut ChainTable, s: usize, name: &str) {
    let Some(chain) = main.desired(name) else {
        // Not (yet) set in filter: the managers jump only to chains they
        // set, so the endpoint chain that jumps here is being re-rendered.
        return;
    };
    let old: Vec<String> = shard
        .desired(name)
        .map(|c| c.targets().map(str::to_string).collect())
        .unwrap_or_default();
    let new: Vec<String> = chain.targets().map(str::to_string).collect();
    shard.put(name, chain.clone());
    let (old_set, new_set): (HashSet<&String>, HashSet<&String>) =
        (old.iter().collect(), new.iter().collect());
    for t in new_set.difference(&old_set) {
        add_ref(l, main, shard, s, t);
    }
    for t in old_set.difference(&new_set) {
        drop_ref(l, shard, s, t);
    }
}

impl RuleTable for Filter {
    fn table(&self) -> &'static str {
        "filter"
    }

    fn version(&self) -> IpVersion {
        self.main.version()
    }

    fn set_chain(&mut self, name: &str, rules: Vec<Rule>) -> Result<(), RuleError> {
        let Some(l) = self.layout.as_mut() else {
            return self.main.set_chain(name, rules);
        };
        if l.endpoint(name).is_some() {
            if l.endpoints.get(name) != Some(&rules) {
                // Checked now (a rule that cannot be translated is refused
                // here, as filter would refuse it), placed at the next plan.
                self.main.build(name, rules.clone())?;
                l.endpoints.insert(name.to_string(), rules);
                l.dirty.insert(name.to_string());
            }
            return Ok(());
        }
        if l.is_dispatch(name) {
            // The managers set every dispatch chain on each endpoint
            // change; one as they last set it is left alone (not
            // rewritten rule by rule first to be found equal). Kept only
            // once filter took it.
            if l.dispatch.get(name) == Some(&rules) {
                return Ok(());
            }
            let redirected = rules.iter().map(|r| l.redirect(r.clone())).collect();
            self.main.set_chain(name, redirected)?;
            l.dispatch.insert(name.to_string(), rules);
        } else {
            self.main.set_chain(name, rules)?;
        }
        if l.refs.iter().any(|r| r.contains_key(name)) {
            l.recopy.insert(name.to_string());
        }
        Ok(())
    }

    fn remove_chain(&mut self, name: &str) {
        let Some(l) = self.layout.as_mut() else {
            return self.main.remove_chain(name);
        };
        if l.endpoint(name).is_some() {
            if l.endpoints.remove(name).is_some() {
                l.dirty.insert(name.to_string());
            }
            return;
        }
        l.dispatch.remove(name);
        self.main.remove_chain(name);
    }

    fn force(&mut self, name: &str) {
        self.main.force(name)
    }

    fn set_hooks(&mut self, builtin: &str, rules: Vec<Rule>) -> Result<(), RuleError> {
        // Sharded, a packet enters forward and input with no pending bit
        // (whatever set one before): only filter's dispatch sets them.
        let rules = match &self.layout {
            Some(l) if !rules.is_empty() && matches!(builtin, "FORWARD" | "INPUT") => {
                let bits = l.from_bit | l.to_bit;
                let mut all = vec![rule(&format!("-j MARK --set-xmark 0x0/{bits:#x}"))];
                all.extend(rules);
                all
            }
            _ => rules,
        };
        self.main.set_hooks(builtin, rules)
    }

    fn chain(&self, name: &str) -> Option<&[Rule]> {
        match &self.layout {
            Some(l) if l.endpoint(name).is_some() => l.endpoints.get(name).map(Vec::as_slice),
            _ => self.main.chain(name),
        }
    }

    fn hooks(&self, builtin: &str) -> &[Rule] {
        let hooks = self.main.hooks(builtin);
        match &self.layout {
            // The managers' rules, without the clearing of the pending
            // bits put before them.
            Some(_) if matches!(builtin, "FORWARD" | "INPUT") && !hooks.is_empty() => &hooks[1..],
            _ => hooks,
        }
    }

    fn programmed(&self) -> BTreeSet<String> {
        let mut out = self.main.programmed();
        if let Some(l) = &self.layout {
            out.extend(l.endpoints.keys().cloned());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> Rule {
        Rule::parse(s).unwrap()
    }

    fn filter(n: usize) -> Filter {
        Filter::new(IpVersion::V4, Ownership::new("dph"), Marks::default(), n)
    }

    /// The policy list chain `iface`'s ingress dispatch goes to, as
    /// filter's shard holds it.
    fn ingress<'a>(
        f: &'a Filter,
        iface: &str,
    ) -> (&'a str, &'a super::super::chains::DesiredChain) {
        let s = f.placement()[iface];
        let list = f.layout.as_ref().unwrap().members[s][Dir::To as usize][iface].as_str();
        (list, f.shards[s].desired(list).expect("in its shard"))
    }

    /// Sets what the endpoints manager would for workloads `ifaces`, each
    /// with ingress policy `pol-<i>` looking up set `s<i % sets>`.
    fn workloads(f: &mut Filter, ifaces: &[&str], sets: usize) {
        let mut from = Vec::new();
        let mut to = Vec::new();
        for (i, iface) in ifaces.iter().enumerate() {
            let pol = format!("dph-pi-pol-{i}");
            f.set_chain(
                &pol,
                vec![r(&format!(
                    "-m set --match-set dph-s{} src -j MARK --set-xmark 0x10000/0x10000",
                    i % sets
                ))],
            )
            .unwrap();
            f.set_chain(
                &format!("dph-tw-{iface}"),
                vec![
                    r("-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"),
                    r(&format!("-j {pol}")),
                    r("-j DROP"),
                ],
            )
            .unwrap();
            f.set_chain(&format!("dph-fw-{iface}"), vec![r("-j DROP")])
                .unwrap();
            from.push(r(&format!("-i {iface} -g dph-fw-{iface}")));
            to.push(r(&format!("-o {iface} -g dph-tw-{iface}")));
        }
        from.push(r("-j DROP"));
        to.push(r("-j DROP"));
        f.set_chain("dph-from-wl-dispatch", from).unwrap();
        f.set_chain("dph-to-wl-dispatch", to).unwrap();
        f.set_hooks(
            "FORWARD",
            vec![
                r("-i cali+ -j dph-from-wl-dispatch"),
                r("-o cali+ -j dph-to-wl-dispatch"),
            ],
        )
        .unwrap();
    }

    /// Endpoint chains go to shards with copies of what they jump to;
    /// filter's dispatch goes to the pending chains; each shard hooks
    /// forward and input behind a pending bit and dispatches by map.
    #[test]
    fn endpoint_chains_go_to_shards_with_copies_of_their_policies() {
        let mut f = filter(4);
        let ifaces: Vec<String> = (0..40).map(|i| format!("cali{i}")).collect();
        let names: Vec<&str> = ifaces.iter().map(String::as_str).collect();
        workloads(&mut f, &names, 4);
        f.settle().unwrap();
        assert!(
            f.main.desired("dph-tw-cali1").is_none(),
            "endpoint chains leave filter"
        );
        let dispatch = &f.main.desired("dph-to-wl-dispatch").unwrap().rules;
        assert_eq!(dispatch[0].text(), "-o cali0 -g dph-tw-pending-in-shards");
        assert_eq!(dispatch.last().unwrap().text(), "-j DROP");
        let placed = f.placement();
        assert_eq!(placed.len(), 40);
        for (i, iface) in names.iter().enumerate() {
            let s = &f.shards[placed[*iface]];
            let (list, tw) = ingress(&f, iface);
            assert!(list.starts_with("dph-tw-list-"), "{list}");
            assert!(
                s.desired(&format!("dph-tw-{iface}")).is_none(),
                "one chain per policy list, not per interface"
            );
            assert_eq!(
                tw.rules[0].text(),
                "-j MARK --set-xmark 0x0/0x800000",
                "the ingress pending bit cleared first"
            );
            assert!(
                s.desired(&format!("dph-pi-pol-{i}")).is_some(),
                "its policy copied"
            );
            assert!(s.reachable().contains(format!("dph-pi-pol-{i}").as_str()));
        }
        // Same sets, same shard (the load allowing): 4 set groups over 4
        // shards put the 40 endpoints in at most 4 shards, each holding
        // the sets of one or two groups.
        let used: BTreeSet<usize> = placed.values().copied().collect();
        assert!(used.len() <= 4, "{placed:?}");
        for s in &used {
            let sh = &f.shards[*s];
            let hooks = &sh.hooks["FORWARD"].rules;
            assert_eq!(
                hooks.iter().map(Rule::text).collect::<Vec<_>>(),
                [
                    "-m mark --mark 0x400000/0x400000 -j dph-from-wl-shard",
                    "-m mark --mark 0x800000/0x800000 -j dph-to-wl-shard"
                ]
            );
            assert_eq!(sh.hooks["INPUT"].rules.len(), 1);
            let d = sh.desired("dph-to-wl-shard").unwrap();
            assert!(d.translated[0].dispatch.is_some(), "a verdict map");
            assert_eq!(d.rules.last().unwrap().text(), "-j RETURN");
        }
        // Filter's forward hook clears the pending bits before anything.
        let fwd = &f.main.hooks["FORWARD"].rules;
        assert_eq!(fwd[0].text(), "-j MARK --set-xmark 0x0/0xc00000");
        assert_eq!(fwd[1].text(), "-i cali+ -j dph-from-wl-dispatch");
        assert_eq!(RuleTable::hooks(&f, "FORWARD").len(), 2);
        // A policy changed in filter is copied again where it is used.
        f.set_chain(
            "dph-pi-pol-3",
            vec![r("-m set --match-set dph-s3 src -j DROP")],
        )
        .unwrap();
        f.settle().unwrap();
        let s = &f.shards[placed["cali3"]];
        assert_eq!(
            s.desired("dph-pi-pol-3").unwrap().rules[0].text(),
            "-m set --match-set dph-s3 src -j DROP"
        );
        // Endpoints removed take their copies, dispatch entries and, last,
        // the shard's hooks with them.
        let shard3 = placed["cali3"];
        let here: Vec<&str> = names
            .iter()
            .copied()
            .filter(|i| placed[*i] == shard3)
            .collect();
        for i in &here {
            f.remove_chain(&format!("dph-tw-{i}"));
            f.remove_chain(&format!("dph-fw-{i}"));
        }
        f.settle().unwrap();
        let s = &f.shards[shard3];
        assert!(
            s.chains.is_empty(),
            "{:?}",
            s.chains.keys().collect::<Vec<_>>()
        );
        assert!(s.hooks.is_empty());
        assert!(!f.placement().contains_key(here[0]));
    }

    /// A dispatch chain filter refused is refused again when set again
    /// (not skipped as "as last set"), and one it took is then left alone.
    #[test]
    fn a_refused_dispatch_chain_is_not_remembered() {
        let mut f = filter(4);
        workloads(&mut f, &["cali0"], 1);
        let bad = vec![r("-o cali0 -j REJECT")];
        assert!(f.set_chain("dph-to-wl-dispatch", bad.clone()).is_err());
        assert!(
            f.set_chain("dph-to-wl-dispatch", bad).is_err(),
            "refused again, not taken as already set"
        );
        let good = vec![r("-o cali0 -g dph-tw-cali0"), r("-j DROP")];
        f.set_chain("dph-to-wl-dispatch", good.clone()).unwrap();
        f.settle().unwrap();
        let d = &f.main.desired("dph-to-wl-dispatch").unwrap().rules;
        assert_eq!(d[0].text(), "-o cali0 -g dph-tw-pending-in-shards");
        f.set_chain("dph-to-wl-dispatch", good).unwrap();
    }

    /// A new interface does not go to a shard a quarter fuller than the
    /// average; an interface stays where it was put.
    #[test]
    fn placement_is_balanced_and_sticky() {
        let mut f = filter(4);
        let ifaces: Vec<String> = (0..200).map(|i| format!("cali{i}")).collect();
        let names: Vec<&str> = ifaces.iter().map(String::as_str).collect();
        // One set for all: affinity alone would put all in one shard.
        workloads(&mut f, &names, 1);
        f.settle().unwrap();
        let l = f.layout.as_ref().unwrap();
        let max = *l.load.iter().max().unwrap();
        assert!(max <= 400 / 4 + 400 / 16 + 8 + 1, "{:?}", l.load);
        let before = f.placement();
        f.set_chain("dph-tw-cali7", vec![r("-j dph-pi-pol-9"), r("-j DROP")])
            .unwrap();
        f.settle().unwrap();
        assert_eq!(f.placement()["cali7"], before["cali7"]);
        let s = &f.shards[before["cali7"]];
        assert!(s.desired("dph-pi-pol-9").is_some());
        assert!(
            s.desired("dph-pi-pol-7").is_none()
                || placed_elsewhere_uses(&f, "dph-pi-pol-7", before["cali7"]),
            "the copy nothing in the shard jumps to any more is gone"
        );
    }

    fn placed_elsewhere_uses(f: &Filter, chain: &str, s: usize) -> bool {
        f.shards[s]
            .chains
            .values()
            .any(|c| c.targets().any(|t| t == chain))
    }

    /// A restart takes the shards the kernel's tables show (where it put
    /// the interfaces before), whatever it would choose now.
    #[test]
    fn placement_is_adopted_from_the_tables_read() {
        let mut observed = crate::backends::nftables::plan::Observed::new();
        let mut t = crate::backends::nftables::plan::ObservedTable::default();
        for c in ["dph-tw-cali1", "dph-fw-cali1", "dph-fw-pending-in-shards"] {
            t.chains.insert(c.to_string(), Default::default());
        }
        observed.insert("dph-filter-3".to_string(), t);
        let mut other = crate::backends::nftables::plan::ObservedTable::default();
        other
            .chains
            .insert("dph-tw-cali2".to_string(), Default::default());
        // A shard beyond those configured now: left to be emptied.
        observed.insert("dph-filter-9".to_string(), other);
        let mut f = filter(4);
        // A shard's dispatch map names cali5 (and cali1, placed already).
        let mut t5 = crate::backends::nftables::plan::ObservedTable::default();
        t5.sets.insert(
            "dispatch-in-0123".to_string(),
            crate::backends::nftables::ops::SetInfo {
                name: "dispatch-in-0123".to_string(),
                key_type: 41,
                key_len: 16,
                flags: 8,
            },
        );
        observed.insert("dph-filter-1".to_string(), t5);
        let contents: crate::backends::nftables::plan::Contents = [(
            ("dph-filter-1".to_string(), "dispatch-in-0123".to_string()),
            crate::backends::nftables::plan::Content::Keys(
                ["cali5"]
                    .map(crate::backends::nftables::ops::Key::ifname)
                    .into(),
            ),
        )]
        .into();
        f.adopt(&observed, Some(&contents), "dph-");
        workloads(&mut f, &["cali1", "cali2", "cali5"], 1);
        f.settle().unwrap();
        let placed = f.placement();
        assert_eq!(placed["cali1"], 3);
        assert_eq!(placed["cali5"], 1);
        assert!(placed["cali2"] < 4);
        let (list, _) = ingress(&f, "cali1");
        assert!(f.shards[3].desired(list).is_some());
    }

    /// Endpoints with the same policies share one policy list chain in a
    /// shard; one whose policies change gets its own and leaves the
    /// shared one to the others; the last to go takes the chain and the
    /// copies only it jumped to.
    #[test]
    fn endpoints_with_the_same_policies_share_a_chain() {
        let mut f = filter(4);
        let same = |f: &mut Filter, iface: &str| {
            f.set_chain(
                &format!("dph-tw-{iface}"),
                vec![r("-j dph-pi-pol-0"), r("-j DROP")],
            )
            .unwrap();
        };
        workloads(&mut f, &["cali0"], 1);
        for i in ["cali0", "cali1", "cali2"] {
            same(&mut f, i);
        }
        f.settle().unwrap();
        let (shared, _) = ingress(&f, "cali0");
        let shared = shared.to_string();
        for i in ["cali1", "cali2"] {
            assert_eq!(ingress(&f, i).0, shared, "{i} shares cali0's chain");
        }
        let s = f.placement()["cali0"];
        let lists = |f: &Filter| {
            f.shards[s]
                .chains
                .keys()
                .filter(|c| c.starts_with("dph-tw-list-"))
                .count()
        };
        assert_eq!(lists(&f), 1);
        let d = &f.shards[s].desired("dph-to-wl-shard").unwrap();
        let entries = &d.translated[0].dispatch.as_ref().unwrap().entries;
        assert!(entries.iter().all(|(_, c)| *c == shared), "{entries:?}");
        // cali1 changes: a chain of its own; the others keep theirs.
        f.set_chain("dph-tw-cali1", vec![r("-j dph-pi-pol-0"), r("-j ACCEPT")])
            .unwrap();
        f.settle().unwrap();
        assert_ne!(ingress(&f, "cali1").0, shared);
        assert_eq!(ingress(&f, "cali2").0, shared);
        assert_eq!(lists(&f), 2);
        // cali0 and cali2 go: their chain goes with the last of them.
        for i in ["cali0", "cali2"] {
            f.remove_chain(&format!("dph-tw-{i}"));
            f.settle().unwrap();
            assert_eq!(f.shards[s].desired(&shared).is_some(), i == "cali0");
        }
        assert_eq!(lists(&f), 1);
        assert!(
            f.shards[s].desired("dph-pi-pol-0").is_some(),
            "cali1 uses it"
        );
        f.remove_chain("dph-tw-cali1");
        f.settle().unwrap();
        assert_eq!(lists(&f), 0);
        assert!(f.shards[s].desired("dph-pi-pol-0").is_none());
    }

    /// With one shard, or a mark mask without the pending bits, filter
    /// holds everything as before.
    #[test]
    fn unsharded_without_shards_or_bits() {
        for f in [
            filter(1),
            Filter::new(
                IpVersion::V4,
                Ownership::new("dph"),
                Marks::from_mask(0x3f0000).unwrap(),
                8,
            ),
        ] {
            let mut f = f;
            workloads(&mut f, &["cali1"], 1);
            f.settle().unwrap();
            assert!(f.shards.is_empty());
            assert!(f.main.desired("dph-tw-cali1").is_some());
            assert_eq!(
                f.main.desired("dph-to-wl-dispatch").unwrap().rules[0].text(),
                "-o cali1 -g dph-tw-cali1"
            );
        }
    }
}
