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
//!   policies change moves to the chain of its new rules. A policy or
//!   profile chain that one list chain alone jumps to in the shard (or
//!   a few, if it is small: a namespace's profile) is written into them
//!   where that does the same (`inline`: a chain fewer); otherwise it is
//!   a copy they all jump to. A restart finds
//!   the interfaces where the shards' dispatch maps name them.
//!   An interface stays in the shard it was first put in; a new one
//!   goes to a shard that has its policy list chain already (no chain
//!   more), else to the shard its IP sets point at (endpoints whose
//!   policies look up the same sets share a shard, so the sets are copied
//!   few times and a policy change walks the few shards its endpoints are
//!   in), unless that shard is a quarter fuller than the average, then to
//!   the emptiest;
//! - everything else stays in filter, where the workload dispatch is one
//!   goto per direction (the managers' tree of interfaces is not
//!   programmed: only the shards' maps know the interfaces, so an
//!   endpoint coming or going does not touch filter) to one of two small
//!   chains, which stand for the endpoint's policy there: filter goes on
//!   as if it had allowed the packet (the "allowed" mark) when the shards
//!   do (below), and drops it otherwise;
//! - egress (from a workload) is checked once per packet, in prerouting,
//!   before the routing decision and after DNAT (so on the address the
//!   packet goes to, as in forward): filter's prerouting
//!   ([`super::chains::FIRST_PRIORITY`]) clears both bits
//!   (`Marks::pending_from` / `pending_to`), leaves alone what the
//!   managers' INPUT accepts from a workload before its egress policy
//!   (ICMPv6 router and neighbour messages, WireGuard and VXLAN to this
//!   host) when it is not forwarded, and marks every other packet from a
//!   workload interface "egress unchecked" (the ingress bit, which means
//!   nothing else in prerouting). Each shard's prerouting
//!   ([`super::chains::SHARD_PRE_PRIORITY`]) looks such a packet's
//!   interface up in a verdict map of its endpoints and goes to the
//!   endpoint's egress chain, which first marks the packet "checked"
//!   (and no longer unchecked), then drops it or lets it on. Filter's
//!   egress stub, in forward and input alike, lets on a checked packet
//!   and drops the rest: an interface no shard knows (dropped as Felix's
//!   dispatch drops it) or a missing shard (fail closed). Felix checks
//!   egress in forward and again in input; one hook means each egress
//!   chain is walked once when the kernel validates its shard, not twice;
//! - ingress (to a workload) stays in forward: filter's forward hook
//!   clears the ingress bit first, its dispatch stub sets it (pending)
//!   with the allowed mark, and each shard's forward hook
//!   ([`super::chains::SHARD_PRIORITY`]) looks the interface up and goes
//!   to the endpoint's ingress chain, which clears the bit first and then
//!   drops or allows as it did in filter. An endpoint chain's accept of an
//!   established flow is a return there, so that the rest runs too. A
//!   drop in any table is final; so is filter's own: the packet passes
//!   only if filter and the shard both let it;
//! - filter's end check ([`super::chains::END_PRIORITY`]) drops a packet
//!   still pending ingress, established or not: no shard knows its
//!   interface or its shard was missing (fail closed).
//!
//! Marks set in prerouting are there at the routing decision: an `ip
//! rule` that matches the firewall mark with a mask of ours would see
//! them (Felix's marks are set in filter, after it). The default mark
//! bits (and Calico's) do not overlap WireGuard's or kube-proxy's.
//!
//! With fewer than 2 shards, or a mark mask without the two bits, nothing
//! is routed: filter holds every chain as before.

mod copies;
mod inline;
mod placement;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use copies::{copy, put_list, release, render_list};

use super::chains::{ChainTable, END, FIRST};
use crate::backends::desired::RuleTable;
use crate::generictables::{Ownership, Rule, RuleError};
use crate::model::IpVersion;
use crate::model::Marks;

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
    pass: u32,
    /// Each workload interface's shard.
    placed: HashMap<String, usize>,
    /// Endpoint chains per shard.
    load: Vec<usize>,
    /// Endpoint chains a shard holds before the next is opened (0: all
    /// are open from the start).
    fill: usize,
    /// The shards open to new interfaces in the current settle
    /// ([`Placement::open`]).
    open: Vec<usize>,
    /// Per shard: the chains copied from filter, and how many chains
    /// there jump to each.
    refs: Vec<HashMap<String, usize>>,
    /// Per shard and direction: its interfaces, each with its entry in
    /// the shard's dispatch (`-o <iface> -g <list chain>`: the policy list
    /// chain, named by its rules, is the entry's target).
    members: Vec<[BTreeMap<String, Rule>; 2]>,
    /// Per shard: its policy list chains, and how many endpoint chains
    /// each stands for.
    users: Vec<HashMap<String, usize>>,
    /// Per shard: each policy list chain's rules (as the endpoint chains
    /// it stands for have them; programmed with what it alone jumps to
    /// written in).
    lists: Vec<HashMap<String, Vec<Rule>>>,
    /// Per shard: each chain the policy list chains jump to, and which.
    holders: Vec<HashMap<String, BTreeSet<String>>>,
    /// Endpoint chains set or removed since the last [`Filter::settle`].
    dirty: BTreeSet<String>,
    /// Filter's chains set since then that a shard holds a copy of.
    recopy: BTreeSet<String>,
    /// The endpoint chains as the managers set them.
    endpoints: HashMap<String, Vec<Rule>>,
    /// The workload dispatch chains as the managers set them (filter
    /// holds one goto to the pending chain per root in their place).
    dispatch: HashMap<String, Vec<Rule>>,
}

/// How workload policy is spread: over at most `shards` tables, with the
/// pending bits of `marks`, opening one more each time the open ones
/// hold `per_shard` workload interfaces (0: all open from the start).
#[derive(Debug, Clone, Copy, Default)]
pub struct ShardLayout {
    pub marks: Marks,
    pub shards: usize,
    pub per_shard: usize,
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

/// The endpoint chain's accept of an established flow, in its shard: a
/// return, so that the shard's other direction runs too and clears its
/// pending bit (both directions' chains accept an established flow first
/// thing; an interface no shard knows keeps its bit, established or not,
/// and is dropped at the end, as filter's dispatch dropped it).
fn returned(r: Rule) -> Rule {
    if r.text() == ESTABLISHED_ACCEPT {
        rule(&ESTABLISHED_ACCEPT.replace("-j ACCEPT", "-j RETURN"))
    } else {
        r
    }
}

const ESTABLISHED_ACCEPT: &str = "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT";

/// `-m mark --mark <bit>/<bit> <tail>`.
fn on_bit(bit: u32, tail: &str) -> Rule {
    rule(&format!("-m mark --mark {bit:#x}/{bit:#x} {tail}"))
}

impl Filter {
    /// Up to `layout.shards` tables (at most [`MAX_SHARDS`]) when its
    /// marks have the pending bits; else filter alone.
    pub fn new(version: IpVersion, own: Ownership, layout: ShardLayout) -> Self {
        let ShardLayout {
            marks,
            shards,
            per_shard,
        } = layout;
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
            pass: marks.pass,
            placed: HashMap::new(),
            load: vec![0; n],
            // An interface has two endpoint chains (ingress and egress).
            fill: per_shard.saturating_mul(2),
            open: (0..n).collect(),
            refs: vec![HashMap::new(); n],
            members: vec![Default::default(); n],
            users: vec![HashMap::new(); n],
            lists: vec![HashMap::new(); n],
            holders: vec![HashMap::new(); n],
            dirty: BTreeSet::new(),
            recopy: BTreeSet::new(),
            endpoints: HashMap::new(),
            dispatch: HashMap::new(),
        };
        // The two chains filter's dispatch goes to: egress was checked
        // in prerouting (allowed if a shard set the bit), ingress is
        // pending for the shards.
        let (from, to, accept) = (layout.from_bit, layout.to_bit, layout.accept);
        let stubs = [
            (
                Dir::From,
                vec![
                    rule(&format!("-j MARK --set-xmark 0x0/{accept:#x}")),
                    on_bit(
                        from,
                        &format!("-j MARK --set-xmark {accept:#x}/{accept:#x}"),
                    ),
                ],
            ),
            (
                Dir::To,
                vec![rule(&format!(
                    "-j MARK --set-xmark {:#x}/{:#x}",
                    to | accept,
                    to | accept
                ))],
            ),
        ];
        for (dir, rules) in stubs {
            let stub = layout.stub(dir);
            f.main
                .set_chain(&stub, rules)
                .expect("the pending chain is valid");
            f.main.force(&stub);
        }
        f.main
            .set_hooks(&format!("FORWARD{END}"), vec![on_bit(to, "-j DROP")])
            .expect("the end check is valid");
        f.main
            .set_hooks(&format!("PREROUTING{FIRST}"), layout.prerouting(&[]))
            .expect("the egress mark is valid");
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
        // A chain written into the list chains that alone jump to it is
        // written there again (or, no longer fit for it, jumped to).
        let mut refused: Option<RuleError> = None;
        for name in recopy {
            for s in 0..self.shards.len() {
                if l.refs[s].contains_key(&name) {
                    copy(l, &self.main, &mut self.shards[s], s, &name);
                }
                let lists: Vec<String> = l.holders[s]
                    .get(&name)
                    .map(|h| h.iter().cloned().collect())
                    .unwrap_or_default();
                for list in lists {
                    if let Err(e) = render_list(l, &self.main, &mut self.shards[s], s, &list) {
                        refused.get_or_insert(e);
                    }
                }
            }
        }
        let mut touched: BTreeSet<usize> = BTreeSet::new();
        // The shards open to what comes now: a snapshot of 10,000
        // endpoints opens them all before the first is placed (so that
        // endpoints of the same sets share a shard from the start).
        let incoming = dirty
            .iter()
            .filter(|name| {
                l.endpoints.contains_key(*name)
                    && l.endpoint(name)
                        .is_some_and(|(_, iface)| !l.placed.contains_key(iface))
            })
            .count();
        l.open(incoming);
        // A chain a shard refuses stays dirty (tried again at the next
        // settle) and the others still go in; the first refusal is returned.
        for name in dirty {
            let (dir, iface) = l.endpoint(&name).expect("only endpoint chains are dirty");
            let iface = iface.to_string();
            match l.endpoints.get(&name).cloned() {
                Some(rules) => {
                    let mut body = vec![l.entered(dir)];
                    body.extend(rules.into_iter().map(returned));
                    let list = l.list_chain(dir, &body);
                    let s = match l.placed.get(&iface) {
                        Some(s) => *s,
                        None => {
                            let s = l
                                .with_list(&list)
                                .unwrap_or_else(|| l.choose(&self.main, &body));
                            l.placed.insert(iface.clone(), s);
                            s
                        }
                    };
                    let shard = &mut self.shards[s];
                    if !l.users[s].contains_key(&list)
                        && let Err(e) = put_list(l, &self.main, shard, s, &list, body)
                    {
                        l.dirty.insert(name);
                        refused.get_or_insert(e);
                        continue;
                    }
                    *l.users[s].entry(list.clone()).or_insert(0) += 1;
                    let entry = l.entry(dir, &iface, &list);
                    let went = l.members[s][dir as usize]
                        .insert(iface.clone(), entry)
                        .and_then(|e| e.target().map(str::to_string));
                    match &went {
                        Some(old) => {
                            if let Err(e) = release(l, &self.main, shard, s, old) {
                                refused.get_or_insert(e);
                            }
                        }
                        None => l.load[s] += 1,
                    }
                    if went.as_ref() != Some(&list) {
                        touched.insert(s);
                    }
                }
                None => {
                    let Some(&s) = l.placed.get(&iface) else {
                        continue;
                    };
                    let old = l.members[s][dir as usize]
                        .remove(&iface)
                        .and_then(|e| e.target().map(str::to_string));
                    if let Some(old) = old {
                        if let Err(e) = release(l, &self.main, &mut self.shards[s], s, &old) {
                            refused.get_or_insert(e);
                        }
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
        if l.is_input_chain(name) {
            // What a workload sends the host that INPUT takes before its
            // egress policy, and the workload interfaces: filter's
            // prerouting follows them.
            self.main.set_chain(name, rules.clone())?;
            let pre = l.prerouting(&rules);
            return self.main.set_hooks(&format!("PREROUTING{FIRST}"), pre);
        }
        if l.is_dispatch(name) {
            // Only the shards' maps know the workloads' interfaces: filter's
            // dispatch root sends every packet of the workload prefix to
            // the pending chain, and the managers' tree below it is kept
            // (for `chain`) but not programmed. An endpoint coming or
            // going leaves filter alone (no walk of it, no plan);
            // an interface no shard knows keeps its pending bit, and the
            // end check drops it.
            if let Some(dir) = l.dispatch_root(name)
                && !self.main.chains.contains_key(name)
            {
                self.main
                    .set_chain(name, vec![rule(&format!("-g {}", l.stub(dir)))])?;
            }
            l.dispatch.insert(name.to_string(), rules);
            return Ok(());
        } else {
            self.main.set_chain(name, rules)?;
        }
        if l.refs.iter().any(|r| r.contains_key(name))
            || l.holders.iter().any(|h| h.contains_key(name))
        {
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
        // Sharded, a packet enters forward with no ingress pending bit
        // (whatever set one before: prerouting's "egress unchecked"):
        // only filter's dispatch sets it. The egress bit is kept: the
        // shard that checked the packet's egress policy set it.
        let rules = match &self.layout {
            Some(l) if !rules.is_empty() && builtin == "FORWARD" => {
                let mut all = vec![rule(&format!("-j MARK --set-xmark 0x0/{:#x}", l.to_bit))];
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
            Some(l) if l.is_dispatch(name) => l.dispatch.get(name).map(Vec::as_slice),
            _ => self.main.chain(name),
        }
    }

    fn hooks(&self, builtin: &str) -> &[Rule] {
        let hooks = self.main.hooks(builtin);
        match &self.layout {
            // The managers' rules, without the clearing of the pending
            // bit put before them.
            Some(_) if builtin == "FORWARD" && !hooks.is_empty() => &hooks[1..],
            _ => hooks,
        }
    }

    fn dispatch_by_interface(&self) -> bool {
        self.layout.is_none()
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
mod tests;
