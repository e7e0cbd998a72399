//! Where a workload's chains go: its shard, its policy list chain's name,
//! and each shard's dispatch.

use std::collections::BTreeSet;

use super::{Dir, Placement, on_bit, rule};
use crate::backends::desired::RuleTable;
use crate::backends::nftables::chains::ChainTable;
use crate::generictables::{Rule, RuleError};

impl Placement {
    /// A policy list chain's first rule. Egress (checked in prerouting):
    /// "checked" set and "unchecked" cleared, so that filter's dispatch
    /// lets the packet on if the rest of the chain does not drop it (a
    /// return is an allow). Ingress: its pending bit cleared.
    pub(super) fn entered(&self, dir: Dir) -> Rule {
        match dir {
            Dir::From => rule(&format!(
                "-j MARK --set-xmark {:#x}/{:#x}",
                self.from_bit,
                self.from_bit | self.to_bit
            )),
            Dir::To => rule(&format!("-j MARK --set-xmark 0x0/{:#x}", self.to_bit)),
        }
    }

    /// Whether `name` is the managers' filter INPUT chain
    /// (`<prefix>INPUT`); asked of every chain set, so without building a
    /// name.
    pub(super) fn is_input_chain(&self, name: &str) -> bool {
        name.strip_prefix(&self.chain_prefix) == Some("INPUT")
    }

    /// Filter's prerouting, before the shards': both bits cleared
    /// (whatever set them: only a shard's policy list chain may say that
    /// a packet's egress policy allowed it); then what INPUT (`input`,
    /// the managers' chain) accepts from a workload before its egress
    /// policy — ICMPv6 router and neighbour messages, WireGuard or VXLAN
    /// to this host — is left unchecked when it is not forwarded (its
    /// destination is not a unicast route), so INPUT takes it as before;
    /// then each packet from a workload interface (those INPUT sends to
    /// the egress dispatch) is marked "egress unchecked" with the ingress
    /// bit, for the shard that knows its interface. Only rules that
    /// accept are followed (what the managers put there).
    pub(super) fn prerouting(&self, input: &[Rule]) -> Vec<Rule> {
        let bits = self.from_bit | self.to_bit;
        let mut out = vec![rule(&format!("-j MARK --set-xmark 0x0/{bits:#x}"))];
        let dispatch = format!("{}from-wl-dispatch", self.chain_prefix);
        let Some(at) = input.iter().position(|r| r.target() == Some(&dispatch)) else {
            return out;
        };
        let not_forwarded = "-m addrtype ! --dst-type UNICAST -j RETURN";
        for r in &input[..at] {
            match r.text().strip_suffix("-j ACCEPT") {
                Some("") => out.push(rule(not_forwarded)),
                Some(head) => out.push(rule(&format!("{head}{not_forwarded}"))),
                None => {}
            }
        }
        let to = self.to_bit;
        let tail = format!(" -j {dispatch}");
        for r in &input[at..] {
            if let Some(head) = r.text().strip_suffix(&tail) {
                out.push(rule(&format!("{head} -j MARK --set-xmark {to:#x}/{to:#x}")));
            }
        }
        out
    }

    /// The chain filter's dispatch goes to for a workload in `dir` (no
    /// interface name, at most 15 bytes, can make it).
    pub(super) fn stub(&self, dir: Dir) -> String {
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
    pub(super) fn list_chain(&self, dir: Dir, body: &[Rule]) -> String {
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
    pub(super) fn endpoint<'a>(&self, name: &'a str) -> Option<(Dir, &'a str)> {
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
    pub(super) fn is_dispatch(&self, name: &str) -> bool {
        name.strip_prefix(&self.chain_prefix)
            .is_some_and(|r| r.starts_with("from-wl-dispatch") || r.starts_with("to-wl-dispatch"))
    }

    /// The direction of filter's workload dispatch root `name`, if it is
    /// one (the managers' tree below it is not).
    pub(super) fn dispatch_root(&self, name: &str) -> Option<Dir> {
        match name.strip_prefix(&self.chain_prefix)? {
            "from-wl-dispatch" => Some(Dir::From),
            "to-wl-dispatch" => Some(Dir::To),
            _ => None,
        }
    }

    /// The shards open to new interfaces in this settle, for `incoming`
    /// endpoint chains more than are placed: those in use, and as many
    /// empty ones more (the first first) as it takes to hold the load at
    /// [`Placement::fill`] chains a shard. Every shard with `fill` 0.
    /// An empty shard has no hooks, so a packet pays two hook calls per
    /// open shard (prerouting and forward): a node of a few hundred
    /// workloads uses one or two shards, not all of them.
    pub(super) fn open(&mut self, incoming: usize) {
        let n = self.load.len();
        let total: usize = self.load.iter().sum::<usize>() + incoming;
        let wanted = match self.fill {
            0 => n,
            fill => total.div_ceil(fill).clamp(1, n),
        };
        let mut open: Vec<usize> = (0..n).filter(|&s| self.load[s] > 0).collect();
        let mut empty = (0..n).filter(|&s| self.load[s] == 0);
        while open.len() < wanted {
            match empty.next() {
                Some(s) => open.push(s),
                None => break,
            }
        }
        open.sort_unstable();
        self.open = open;
    }

    /// Most endpoint chains an open shard takes a new interface at: a
    /// quarter more than the average over the open shards, and no more
    /// than the fill while there are shards left to open.
    fn cap(&self) -> usize {
        let n = self.open.len().max(1);
        let total: usize = self.open.iter().map(|&s| self.load[s]).sum();
        let even = total / n + total / (4 * n) + 8;
        if self.fill > 0 && self.open.len() < self.load.len() {
            even.min(self.fill)
        } else {
            even
        }
    }

    /// The shard for a new interface whose endpoint chain would be policy
    /// list chain `list`: of those that have that list chain already (no
    /// chain more: a replica whose twin went elsewhere when its own shard
    /// was full), the emptiest, unless it is full.
    pub(super) fn with_list(&self, list: &str) -> Option<usize> {
        let cap = self.cap();
        (0..self.load.len())
            .filter(|&s| self.users[s].contains_key(list))
            .min_by_key(|&s| self.load[s])
            .filter(|&s| self.load[s] < cap)
    }

    /// The shard for a new interface whose endpoint chain is `rules`: of
    /// the open shards, the one the IP sets of the chains it jumps to
    /// point at, unless that one is a quarter fuller than the average
    /// (then the emptiest). Endpoints with the same policies look up the
    /// same sets, so they share a shard, and a policy list chain there,
    /// unless the load spreads them (a list has at most one chain per
    /// shard).
    pub(super) fn choose(&self, main: &ChainTable, rules: &[Rule]) -> usize {
        let open = &self.open;
        let cap = self.cap();
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
            let at = u64::from_le_bytes(d[..8].try_into().expect("8 bytes")) as usize % open.len();
            Some(open[at])
        };
        let emptiest = *open
            .iter()
            .min_by_key(|s| self.load[**s])
            .expect("one shard open at least");
        match preferred {
            Some(s) if self.load[s] < cap => s,
            _ => emptiest,
        }
    }

    /// Interface `iface`'s entry in its shard's dispatch in `dir`: to
    /// policy list chain `list`.
    pub(super) fn entry(&self, dir: Dir, iface: &str, list: &str) -> Rule {
        let flag = match dir {
            Dir::From => "-i",
            Dir::To => "-o",
        };
        rule(&format!("{flag} {iface} -g {list}"))
    }

    /// Shard `s`'s dispatch chains and hooks, from its interfaces: egress
    /// in prerouting (for a packet marked "egress unchecked"), ingress in
    /// forward (for one its dispatch marked pending). Each list chain is
    /// reached from one hook, so a change walks it once.
    pub(super) fn dispatch(&self, shard: &mut ChainTable, s: usize) -> Result<(), RuleError> {
        let mut prerouting = Vec::new();
        let mut forward = Vec::new();
        for dir in [Dir::From, Dir::To] {
            let chain = match dir {
                Dir::From => format!("{}from-wl-shard", self.chain_prefix),
                Dir::To => format!("{}to-wl-shard", self.chain_prefix),
            };
            let members = &self.members[s][dir as usize];
            if members.is_empty() {
                shard.remove_chain(&chain);
                continue;
            }
            let mut rules: Vec<Rule> = members.values().cloned().collect();
            rules.push(rule("-j RETURN"));
            shard.set_chain(&chain, rules)?;
            let hook = on_bit(self.to_bit, &format!("-j {chain}"));
            match dir {
                Dir::From => prerouting.push(hook),
                Dir::To => forward.push(hook),
            }
        }
        shard.set_hooks("PREROUTING", prerouting)?;
        shard.set_hooks("FORWARD", forward)
    }
}
