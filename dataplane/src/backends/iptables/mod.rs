//! iptables tables, one backend object per (table, IP version).
//!
//! Owns, in the daemon's network namespace: the chains whose names start
//! with the chain prefix (`dph-` by default), and in the built-in chains
//! only the rules that carry our hash comment (`dph:<16 chars>`). Foreign
//! chains and rules are never removed, reordered or rewritten.
//!
//! Every rule we write starts with `-m comment --comment "<prefix>:<hash>"`;
//! the hash is chained over the chain's name and the text of each rule up to
//! it (sha224, base64url, 16 characters, as Felix does), so read-back
//! (`iptables-save -t T`) tells which rules are ours and whether each is the
//! one we want at its position. An apply writes one
//! `iptables-restore --noflush --wait` per table with the minimal lines: new
//! chains, `-R`/`-A`/`-D` by position in our chains, our hook rules in the
//! built-in chains (deleted by their full spec, so a rule someone else
//! inserted meanwhile is never hit, and inserted at the top or appended),
//! and chain deletions last. Only chains that a hook reaches (or that are
//! forced) are programmed. After a write the table is re-read once
//! ([`POST_WRITE_CHECK`]) and on every refresh tick, and whatever was
//! changed by hand is put back. Those check-reads run on a thread of their
//! own while applies go on (at 300,000 rules `iptables-save` takes
//! seconds); a read that a write overtook is dropped and taken again
//! later. A check-read, the refresh tick's too, starts only once the table
//! has had no write for [`POST_WRITE_CHECK`]: under a steady stream of
//! writes it could never be used, and it slowed every restore beside it
//! (measured at 320,000 rules: applies 300 ms apart became 400-900 ms, and
//! the read did not finish in 30 s — iptables-save starts its dump over
//! when a commit lands in the middle). The first read can start when the
//! daemon does ([`Table::prefetch`]), while the calc graph is still
//! sending its snapshot (nothing is applied before it is in sync); the
//! read after a failed write is done in the apply itself.

pub mod restore;
pub mod save;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use tracing::{debug, info, instrument, warn};

pub use super::DetachedSave;
use super::{ApplyOutcome, Backend, BackendError, BackgroundRead, Phase, Refresh};
use crate::generictables::check_chain;
use crate::generictables::{Ownership, Rule, RuleError, RuleHash, rule_hashes};
use crate::model::IpVersion;

/// When a table is read again after we wrote it.
pub const POST_WRITE_CHECK: Duration = Duration::from_secs(5);
/// How often an apply looks whether a background read has finished.
const CHECK_POLL: Duration = Duration::from_millis(100);

/// Where our rules go in a built-in chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InsertMode {
    /// At the top, before every other rule (Felix's default).
    #[default]
    Insert,
    /// At the bottom.
    Append,
}

impl std::str::FromStr for InsertMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "insert" => Ok(Self::Insert),
            "append" => Ok(Self::Append),
            _ => Err(format!("{s:?}: expected insert or append")),
        }
    }
}

/// The seam to the kernel.
pub trait IptablesExec: Send + std::fmt::Debug {
    /// `iptables-save -t <table>` (or the ip6tables one).
    fn save(&mut self, table: &str) -> Result<String, BackendError>;
    /// `iptables-restore --noflush --wait` with `input` on stdin.
    fn restore(&mut self, input: &str) -> Result<(), BackendError>;
    /// Split a write that sets more chains than this into several
    /// transactions (None: never split).
    fn chains_per_restore(&self) -> Option<usize> {
        None
    }
    /// A `save` of `table` that can run on another thread while the table
    /// goes on being applied (None: re-reads block the apply).
    fn detached_save(&self, _table: &str) -> Option<DetachedSave> {
        None
    }
}

/// What a background read found: parsed, and for a check-read compared,
/// on its own thread (at 300,000 rules the parse alone took 90-170 ms and
/// the full diff after it 40-60 ms of an apply).
#[derive(Debug)]
enum ReadResult {
    /// The whole table (the first read: nothing to compare with).
    Whole(BTreeMap<String, ObservedChain>),
    /// The chains that differ from what we believed when the read began:
    /// as read, or None where the chain is gone.
    Differences(Vec<(String, Option<ObservedChain>)>),
}

impl ReadResult {
    fn read(save: DetachedSave, prefix: String) -> Result<Self, BackendError> {
        Ok(Self::Whole(save::parse(&save()?, &prefix)))
    }

    fn check(
        save: DetachedSave,
        prefix: String,
        belief: BTreeMap<String, ObservedChain>,
    ) -> Result<Self, BackendError> {
        let read = save::parse(&save()?, &prefix);
        let mut out: Vec<(String, Option<ObservedChain>)> = belief
            .keys()
            .filter(|n| !read.contains_key(*n))
            .map(|n| (n.clone(), None))
            .collect();
        for (name, chain) in read {
            if !belief.get(&name).is_some_and(|b| same_rules(b, &chain)) {
                out.push((name, Some(chain)));
            }
        }
        Ok(Self::Differences(out))
    }
}

/// Whether a chain read back is the one we believe is there: the same
/// rules of ours (by hash) and foreign rules (by spec) in the same order.
/// Our rules' specs are not compared: `iptables-save` prints them in its
/// own way (`-m tcp` added, and so on).
fn same_rules(belief: &ObservedChain, read: &ObservedChain) -> bool {
    belief.rules.len() == read.rules.len()
        && belief
            .rules
            .iter()
            .zip(&read.rules)
            .all(|(b, r)| b.0 == r.0 && (b.0.is_some() || b.1 == r.1))
}

/// A chain as read back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ObservedChain {
    /// Per rule, in order: our hash (if the rule carries our comment) and,
    /// in the built-in chains, the rule's spec as `iptables-save` printed
    /// it (after `-A <chain>`; we delete our hooks there by spec). Empty
    /// elsewhere: rules in our chains are addressed by position, foreign
    /// chains are never touched, and at 300,000 rules the specs would be
    /// tens of megabytes.
    pub rules: Vec<(Option<RuleHash>, String)>,
}

const BUILTINS: &[&str] = &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

fn is_builtin(chain: &str) -> bool {
    BUILTINS.contains(&chain)
}

/// What a rule line adds to the rule's text and chain name:
/// `-A <chain> -m comment --comment "<prefix>:<16>" <text>\n`.
const LINE_OVERHEAD: usize = 48;

/// One chain's share of a restore: its declaration and its lines.
#[derive(Debug)]
struct Part {
    name: String,
    /// Ranges of the shared declaration and body buffers (one allocation
    /// each for the whole render, not two per chain).
    decl: std::ops::Range<usize>,
    body: std::ops::Range<usize>,
}

/// Everything one render writes.
#[derive(Debug, Default)]
struct Script {
    decl: String,
    body: String,
    parts: Vec<Part>,
}

/// A chain we want, with what is derived from its rules once.
#[derive(Debug, Clone, PartialEq)]
struct DesiredChain {
    rules: Vec<Rule>,
    hashes: Vec<RuleHash>,
    /// The chains of ours its rules jump or go to.
    targets: Vec<String>,
    /// About what writing the chain whole takes in a restore.
    bytes: usize,
}

/// One table of one IP version.
#[derive(Debug)]
pub struct Table {
    table: &'static str,
    version: IpVersion,
    own: Ownership,
    mode: InsertMode,
    exec: Box<dyn IptablesExec>,
    chains: BTreeMap<String, DesiredChain>,
    /// Chains changed since the last successful write (only these are
    /// diffed, unless the table was just read).
    touched: BTreeSet<String>,
    /// The table was (re-)read: diff every chain.
    full_diff: bool,
    forced: BTreeSet<String>,
    hooks: BTreeMap<String, Vec<Rule>>,
    observed: Option<BTreeMap<String, ObservedChain>>,
    /// Desired state changed since the last successful write.
    changed: bool,
    /// What is programmed may have changed (hooks, forced chains, jumps,
    /// removals): the next render looks at every chain, hook and stale
    /// chain, not only at the chains touched.
    reshaped: bool,
    recheck_at: Option<Instant>,
    /// A check-read running beside the applies (at 300,000 rules
    /// iptables-save takes seconds; the loop does not wait for it).
    background: Option<BackgroundRead<ReadResult>>,
    /// Writes attempted so far (failed ones too: what they left is
    /// unknown): a background read that began before the last one is stale.
    writes: u64,
    /// When the last write was attempted, and how long the table must stay
    /// unwritten before a check-read starts.
    last_write: Option<Instant>,
    check_delay: Duration,
    /// Bumped whenever `observed` is read or written: the metrics count
    /// our chains and rules again only then (a walk of every rule, which
    /// at 300,000 rules is not for every apply).
    observed_gen: u64,
    /// (generation, chains, rules) last counted for the metrics.
    counted: std::cell::Cell<Option<(u64, usize, usize)>>,
    /// Chains whose rules the tool refused (a line it named): written as
    /// a single drop until their rules change. By name: the rules that
    /// were refused, and why.
    quarantined: BTreeMap<String, Quarantined>,
}

/// A chain the kernel would not take, held fail-closed.
#[derive(Debug, Clone)]
struct Quarantined {
    wanted: Vec<Rule>,
    why: String,
}

/// Most chains one apply isolates before it gives up and fails (each
/// costs a read and a write of the table).
const MAX_ISOLATED_PER_APPLY: usize = 16;

impl Table {
    pub fn new(
        table: &'static str,
        version: IpVersion,
        own: Ownership,
        mode: InsertMode,
        exec: Box<dyn IptablesExec>,
    ) -> Self {
        Self {
            table,
            version,
            own,
            mode,
            exec,
            chains: BTreeMap::new(),
            touched: BTreeSet::new(),
            full_diff: true,
            forced: BTreeSet::new(),
            hooks: BTreeMap::new(),
            observed: None,
            changed: true,
            reshaped: true,
            recheck_at: None,
            background: None,
            writes: 0,
            last_write: None,
            check_delay: POST_WRITE_CHECK,
            observed_gen: 0,
            counted: std::cell::Cell::new(None),
            quarantined: BTreeMap::new(),
        }
    }

    /// How long the table must go unwritten before a check-read starts
    /// ([`POST_WRITE_CHECK`] unless set; tests shorten it).
    pub fn with_check_delay(mut self, d: Duration) -> Self {
        self.check_delay = d;
        self
    }

    pub fn table(&self) -> &'static str {
        self.table
    }

    pub fn version(&self) -> IpVersion {
        self.version
    }

    /// Chain `name` (which must carry our prefix) must hold `rules`.
    pub fn set_chain(&mut self, name: &str, rules: Vec<Rule>) -> Result<(), RuleError> {
        check_chain(name)?;
        if !name.starts_with(&self.own.chain_prefix) {
            return Err(RuleError::ChainName(name.to_string()));
        }
        if let Some(q) = self.quarantined.get(name) {
            if q.wanted == rules {
                return Ok(()); // still the rules the kernel refused
            }
            info!(
                table = self.table,
                chain = name,
                "its rules changed: no longer held fail-closed"
            );
            self.quarantined.remove(name);
        }
        self.put_chain(name, rules);
        Ok(())
    }

    fn put_chain(&mut self, name: &str, rules: Vec<Rule>) {
        if self.chains.get(name).map(|c| &c.rules) != Some(&rules) {
            let chain = DesiredChain {
                bytes: rules
                    .iter()
                    .map(|r| r.text().len() + LINE_OVERHEAD + name.len())
                    .sum(),
                hashes: rule_hashes(name, &rules),
                targets: rules
                    .iter()
                    .filter_map(Rule::target)
                    .filter(|t| t.starts_with(&self.own.chain_prefix))
                    .map(str::to_string)
                    .collect(),
                rules,
            };
            if self.chains.get(name).map(|c| &c.targets) != Some(&chain.targets) {
                self.reshaped = true;
            }
            self.chains.insert(name.to_string(), chain);
            self.touched.insert(name.to_string());
            self.changed = true;
        }
    }

    /// Chain `name` is no longer wanted.
    pub fn remove_chain(&mut self, name: &str) {
        self.quarantined.remove(name);
        if self.chains.remove(name).is_some() {
            self.touched.remove(name);
            self.reshaped = true;
            self.forced.remove(name);
            self.changed = true;
        }
    }

    /// Program `name` even if nothing references it.
    pub fn force(&mut self, name: &str) {
        if self.forced.insert(name.to_string()) {
            self.reshaped = true;
            self.changed = true;
        }
    }

    /// Our rules in built-in chain `builtin` (at the top or the bottom, by
    /// the insert mode). An empty list removes them.
    pub fn set_hooks(&mut self, builtin: &str, rules: Vec<Rule>) -> Result<(), RuleError> {
        if !is_builtin(builtin) {
            return Err(RuleError::ChainName(builtin.to_string()));
        }
        let old = self.hooks.get(builtin).cloned().unwrap_or_default();
        if old != rules {
            if rules.is_empty() {
                self.hooks.remove(builtin);
            } else {
                self.hooks.insert(builtin.to_string(), rules);
            }
            self.reshaped = true;
            self.changed = true;
        }
        Ok(())
    }

    /// The chains that will be programmed: those the hooks reach, directly
    /// or through other chains of ours, and the forced ones.
    pub fn programmed(&self) -> BTreeSet<String> {
        self.reachable().into_iter().map(str::to_string).collect()
    }

    /// [`Self::programmed`] without copying names (it runs on every apply
    /// that reshapes the table: 30,000 chains at the benchmark's scale).
    fn reachable(&self) -> std::collections::HashSet<&str> {
        let mut out = std::collections::HashSet::with_capacity(self.chains.len());
        let mut todo: Vec<&str> = self.forced.iter().map(String::as_str).collect();
        for rules in self.hooks.values() {
            todo.extend(rules.iter().filter_map(Rule::target));
        }
        while let Some(c) = todo.pop() {
            let Some((name, chain)) = self.chains.get_key_value(c) else {
                continue;
            };
            if out.insert(name.as_str()) {
                todo.extend(chain.targets.iter().map(String::as_str));
            }
        }
        out
    }

    /// The desired rules of chain `name`, if it is set (for a chain held
    /// fail-closed, the rules that were refused: what the managers set).
    pub fn chain(&self, name: &str) -> Option<&[Rule]> {
        if let Some(q) = self.quarantined.get(name) {
            return Some(&q.wanted);
        }
        self.chains.get(name).map(|c| c.rules.as_slice())
    }

    /// The chain a failed restore's error names, when it is one that can
    /// be held fail-closed alone (a policy's, a profile's or a workload
    /// endpoint's: [`crate::rules::isolatable`]) and is not held already.
    /// The tools say `Error occurred at line: N` (a line they could not
    /// parse or whose match or target they could not load) or `line N
    /// failed`; the line is `input`'s. A failure at `COMMIT` names no
    /// chain: the kernel refused the transaction as a whole.
    fn culprit(&self, e: &BackendError, input: &str) -> Option<String> {
        let BackendError::Command { stderr, .. } = e else {
            return None;
        };
        let n: usize = stderr
            .split("Error occurred at line: ")
            .nth(1)
            .or_else(|| {
                stderr
                    .split("line ")
                    .nth(1)
                    .filter(|r| r.contains(" failed"))
            })?
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()?;
        let line = input.lines().nth(n.checked_sub(1)?)?;
        let mut words = line.split(' ');
        let chain = match words.next()? {
            "-A" | "-I" | "-R" => words.next()?,
            decl => decl.strip_prefix(':')?,
        };
        (self.chains.contains_key(chain)
            && !self.quarantined.contains_key(chain)
            && crate::rules::isolatable(&self.own.chain_prefix, chain))
        .then(|| chain.to_string())
    }

    /// Holds chain `name` fail-closed (a single drop) because the tool
    /// refused its rules (`e`).
    fn quarantine(&mut self, name: &str, e: &BackendError) {
        let wanted = self
            .chains
            .get(name)
            .map(|c| c.rules.clone())
            .unwrap_or_default();
        warn!(
            table = self.table,
            chain = name,
            error = %e,
            "the kernel refused this chain's rules: it drops everything until they change (the rest of the table is written)"
        );
        self.put_chain(name, vec![Rule::parse("-j DROP").expect("a valid rule")]);
        self.reshaped = true;
        self.quarantined.insert(
            name.to_string(),
            Quarantined {
                wanted,
                why: e.to_string(),
            },
        );
    }

    /// The desired rules of built-in chain `builtin`'s hooks.
    pub fn hooks(&self, builtin: &str) -> &[Rule] {
        self.hooks.get(builtin).map_or(&[], Vec::as_slice)
    }

    /// The table as last read or written.
    pub fn observed(&self) -> Option<&BTreeMap<String, ObservedChain>> {
        self.observed.as_ref()
    }

    fn read(&mut self) -> Result<(), BackendError> {
        let text = self.exec.save(self.table)?;
        self.observed = Some(save::parse(&text, &self.own.comment_prefix));
        self.observed_gen += 1;
        self.full_diff = true;
        Ok(())
    }

    /// `<verb> <chain> [<pos>] -m comment --comment "<prefix><hash>" <rule>`,
    /// e.g. `-A dph-x …`, `-R dph-x 3 …` or `-I INPUT 1 …`.
    fn line(
        &self,
        out: &mut String,
        verb: &str,
        chain: &str,
        pos: Option<usize>,
        hash: &RuleHash,
        rule: &Rule,
    ) {
        out.push_str(verb);
        out.push(' ');
        out.push_str(chain);
        if let Some(p) = pos {
            let _ = write!(out, " {p}");
        }
        out.push_str(" -m comment --comment \"");
        out.push_str(&self.own.comment_prefix);
        out.push_str(hash.as_str());
        out.push_str("\" ");
        out.push_str(rule.text());
        out.push('\n');
    }

    /// The lines that bring our chain `name` from what `observed` has to
    /// what we want; `observed` is updated to match.
    fn render_chain(
        &self,
        name: &str,
        observed: &mut BTreeMap<String, ObservedChain>,
        decl: &mut String,
        body: &mut String,
    ) {
        let fresh = !observed.contains_key(name);
        let chain = &self.chains[name];
        if fresh {
            observed.insert(name.to_string(), ObservedChain::default());
            let _ = writeln!(*decl, ":{name} - [0:0]");
        }
        let old = observed.get_mut(name).expect("inserted above");
        let edits = chain
            .hashes
            .iter()
            .enumerate()
            .filter(|(i, h)| {
                old.rules
                    .get(*i)
                    .is_some_and(|(o, _)| o.as_ref() != Some(h))
            })
            .count()
            + old.rules.len().saturating_sub(chain.rules.len());
        if !fresh && edits > 0 && chain.rules.len() + 1 < 2 * edits {
            // Most of the chain changes: flush and write it whole, in
            // the same transaction. Under --noflush, declaring an
            // existing chain flushes it; that is much cheaper for
            // iptables-nft than `-F` or replacing rule by rule, which
            // look up each rule.
            let _ = writeln!(*decl, ":{name} - [0:0]");
            for (rule, hash) in chain.rules.iter().zip(&chain.hashes) {
                self.line(body, "-A", name, None, hash, rule);
            }
        } else {
            for (i, (rule, hash)) in chain.rules.iter().zip(&chain.hashes).enumerate() {
                match old.rules.get(i) {
                    Some((Some(h), _)) if h == hash => {}
                    Some(_) => self.line(body, "-R", name, Some(i + 1), hash, rule),
                    None => self.line(body, "-A", name, None, hash, rule),
                }
            }
            for j in (chain.rules.len()..old.rules.len()).rev() {
                let _ = writeln!(*body, "-D {name} {}", j + 1);
            }
        }
        // The spec of a rule in our own chains is never needed (we
        // address them by position): keep only the hash.
        old.rules.clear();
        old.rules
            .extend(chain.hashes.iter().map(|h| (Some(*h), String::new())));
    }

    /// The restore input that brings `observed` to the desired state;
    /// `observed` is updated to what the kernel holds once it is applied.
    ///
    /// Usually one transaction; a write that sets more chains than the
    /// tool handles well in one ([`IptablesExec::chains_per_restore`])
    /// becomes several, each holding whole chains, ordered so that a chain
    /// is complete before anything jumps to it, with the hooks and the
    /// deletions in the last one.
    fn render(&self, observed: &mut BTreeMap<String, ObservedChain>) -> Vec<String> {
        let mut script = Script::default();
        if observed.len() < self.chains.len() / 2 {
            // Mostly a fresh load (megabytes at 50,000 rules): one
            // allocation instead of a string doubling its way up, and room
            // for the body behind the declarations (see `transactions`).
            let body: usize = self.chains.values().map(|c| c.bytes).sum();
            let decl = self.chains.keys().map(|n| n.len() + 10).sum::<usize>() + 64;
            script.decl.reserve(decl + body);
            script.body.reserve(body);
        }
        let mut part = |name: &str, observed: &mut BTreeMap<String, ObservedChain>| {
            let (d0, b0) = (script.decl.len(), script.body.len());
            self.render_chain(name, observed, &mut script.decl, &mut script.body);
            let (d1, b1) = (script.decl.len(), script.body.len());
            if d1 > d0 || b1 > b0 {
                script.parts.push(Part {
                    name: name.to_string(),
                    decl: d0..d1,
                    body: b0..b1,
                });
            }
        };
        let whole = self.full_diff || self.reshaped;
        if !whole {
            // Nothing but rule changes in chains that stay programmed:
            // after our last write (or adoption) the chains of ours in
            // `observed` are exactly the programmed ones, so only the
            // touched ones need a look. Hooks and stale chains are as
            // they were.
            for name in &self.touched {
                if observed.contains_key(name) {
                    part(name, observed);
                }
            }
            return self.transactions(script, String::new());
        }
        let programmed = self.reachable();
        // Our chains: every one after a read, otherwise those changed since
        // the last write and those newly reached (in name order).
        for name in self
            .chains
            .keys()
            .filter(|n| programmed.contains(n.as_str()))
        {
            let fresh = !observed.contains_key(name);
            if fresh || self.full_diff || self.touched.contains(name) {
                part(name, observed);
            }
        }
        let mut body = String::new();
        // Our rules in the built-in chains.
        let builtins: BTreeSet<String> = self
            .hooks
            .keys()
            .cloned()
            .chain(
                observed
                    .iter()
                    .filter(|(n, c)| is_builtin(n) && c.rules.iter().any(|r| r.0.is_some()))
                    .map(|(n, _)| n.clone()),
            )
            .collect();
        for b in &builtins {
            let want = self.hooks.get(b).cloned().unwrap_or_default();
            let hashes = rule_hashes(b, &want);
            let old = observed.get(b).cloned().unwrap_or_default();
            let ours: Vec<&(Option<RuleHash>, String)> =
                old.rules.iter().filter(|r| r.0.is_some()).collect();
            let positions_ok = match self.mode {
                InsertMode::Insert => old.rules.iter().take(want.len()).all(|r| r.0.is_some()),
                InsertMode::Append => old
                    .rules
                    .iter()
                    .rev()
                    .take(want.len())
                    .all(|r| r.0.is_some()),
            };
            let in_order = ours.len() == hashes.len()
                && ours
                    .iter()
                    .zip(&hashes)
                    .all(|(o, h)| o.0.as_ref() == Some(h));
            if in_order && positions_ok {
                continue;
            }
            // Remove ours by their full spec (immune to positions shifting
            // under us), then put the wanted ones in place.
            for (_, spec) in &ours {
                let _ = writeln!(body, "-D {b} {spec}");
            }
            let foreign = old.rules.iter().filter(|r| r.0.is_none()).cloned();
            let mine: Vec<(Option<RuleHash>, String)> = hashes
                .iter()
                .zip(&want)
                .map(|(h, r)| {
                    (
                        Some(*h),
                        format!(
                            "-m comment --comment \"{}{h}\" {}",
                            self.own.comment_prefix,
                            r.text()
                        ),
                    )
                })
                .collect();
            let rules = match self.mode {
                InsertMode::Insert => {
                    for (i, (rule, hash)) in want.iter().zip(&hashes).enumerate() {
                        self.line(&mut body, "-I", b, Some(i + 1), hash, rule);
                    }
                    mine.into_iter().chain(foreign).collect()
                }
                InsertMode::Append => {
                    for (rule, hash) in want.iter().zip(&hashes) {
                        self.line(&mut body, "-A", b, None, hash, rule);
                    }
                    foreign.chain(mine).collect()
                }
            };
            observed.insert(b.clone(), ObservedChain { rules });
        }
        // Chains of ours that are no longer programmed: flushed first (their
        // rules may reference each other), deleted last.
        let stale: Vec<String> = observed
            .keys()
            .filter(|n| n.starts_with(&self.own.chain_prefix) && !programmed.contains(n.as_str()))
            .cloned()
            .collect();
        for n in &stale {
            let _ = writeln!(body, "-F {n}");
        }
        for n in &stale {
            let _ = writeln!(body, "-X {n}");
            observed.remove(n);
        }
        self.transactions(script, body)
    }

    /// Packs chain parts and the closing lines (hooks, deletions) into
    /// restore inputs.
    fn transactions(&self, script: Script, tail: String) -> Vec<String> {
        let Script { decl, body, parts } = script;
        if parts.is_empty() && tail.is_empty() {
            return Vec::new();
        }
        let per = self.exec.chains_per_restore().unwrap_or(usize::MAX).max(1);
        if parts.len() <= per {
            // One transaction: the buffers are already in order. The
            // header goes in front of the (small) declarations, the body
            // behind them, into the room reserved for it.
            let mut out = decl;
            out.insert_str(0, &format!("*{}\n", self.table));
            out.push_str(&body);
            out.push_str(&tail);
            out.push_str("COMMIT\n");
            return vec![out];
        }
        let parts = self.dependency_order(parts);
        let mut out: Vec<String> = Vec::new();
        let mut chunks = parts.chunks(per).peekable();
        while let Some(chunk) = chunks.next() {
            let size: usize = chunk.iter().map(|p| p.decl.len() + p.body.len()).sum();
            let mut t = String::with_capacity(size + tail.len() + 32);
            let _ = writeln!(t, "*{}", self.table);
            for p in chunk {
                t.push_str(&decl[p.decl.clone()]);
            }
            for p in chunk {
                t.push_str(&body[p.body.clone()]);
            }
            if chunks.peek().is_none() {
                t.push_str(&tail);
            }
            t.push_str("COMMIT\n");
            out.push(t);
        }
        out
    }

    /// `parts` with every chain after the chains it jumps to.
    fn dependency_order(&self, parts: Vec<Part>) -> Vec<Part> {
        let mut by_name: BTreeMap<String, Part> =
            parts.into_iter().map(|p| (p.name.clone(), p)).collect();
        let names: Vec<String> = by_name.keys().cloned().collect();
        let mut seen = BTreeSet::new();
        let mut out = Vec::with_capacity(names.len());
        // Iterative post-order walk over the jump targets.
        for root in names {
            let mut stack = vec![(root, false)];
            while let Some((name, expanded)) = stack.pop() {
                if expanded {
                    if let Some(p) = by_name.remove(&name) {
                        out.push(p);
                    }
                    continue;
                }
                if !seen.insert(name.clone()) {
                    continue;
                }
                stack.push((name.clone(), true));
                if let Some(c) = self.chains.get(&name) {
                    for t in c.targets.iter().rev() {
                        if by_name.contains_key(t) && !seen.contains(t) {
                            stack.push((t.clone(), false));
                        }
                    }
                }
            }
        }
        out
    }

    /// Starts the first read of the table in the background, where the
    /// tool allows: at 300,000 rules `iptables-save` takes seconds, which
    /// the daemon can spend receiving the calc graph's snapshot instead of
    /// in its first apply. Only before anything was read or written.
    pub fn prefetch(&mut self) {
        if self.observed.is_none()
            && self.background.is_none()
            && self.writes == 0
            && let Some(save) = self.exec.detached_save(self.table)
        {
            let prefix = self.own.comment_prefix.clone();
            self.background = Some(BackgroundRead::spawn(self.writes, move || {
                ReadResult::read(save, prefix)
            }));
        }
    }

    /// Starts the check-read, in the background where the tool allows it
    /// (else it happens now, in this apply).
    fn start_check(&mut self) {
        self.recheck_at = None;
        if self.background.is_some() {
            return;
        }
        match (self.exec.detached_save(self.table), &self.observed) {
            (Some(save), Some(observed)) => {
                debug!(table = self.table, "check-read started");
                // What we believe is there, for the thread to compare the
                // read with (a copy: the applies go on meanwhile).
                let belief = observed.clone();
                let prefix = self.own.comment_prefix.clone();
                self.background = Some(BackgroundRead::spawn(self.writes, move || {
                    ReadResult::check(save, prefix, belief)
                }));
            }
            _ => self.observed = None,
        }
    }

    /// Takes in what a read no write has overtaken found: the whole table
    /// (then every chain is diffed against it), or the chains that differ
    /// from what we believed (only those are looked at again).
    fn adopt(&mut self, result: ReadResult) {
        self.observed_gen += 1;
        match result {
            ReadResult::Whole(read) => {
                self.observed = Some(read);
                self.full_diff = true;
            }
            ReadResult::Differences(diffs) => {
                let Some(observed) = self.observed.as_mut() else {
                    // Nothing to correct (cannot happen without a write,
                    // which would have made the read stale): read again.
                    return;
                };
                debug!(
                    table = self.table,
                    differences = diffs.len(),
                    "check-read adopted"
                );
                for (name, chain) in diffs {
                    // A rule edited in a chain of ours that stays: rewrite
                    // that chain. Anything else (a chain gone or new, a
                    // built-in chain changed): look at the whole table.
                    if chain.is_some()
                        && self.chains.contains_key(&name)
                        && observed.contains_key(&name)
                    {
                        self.touched.insert(name.clone());
                    } else {
                        self.reshaped = true;
                    }
                    match chain {
                        Some(c) => observed.insert(name, c),
                        None => observed.remove(&name),
                    };
                    self.changed = true;
                }
            }
        }
    }

    /// Takes a finished background read: adopted if no write happened
    /// since it began (then everything is diffed against it), dropped
    /// otherwise (the next check reads again).
    fn collect_check(&mut self) -> Result<(), BackendError> {
        if !self
            .background
            .as_ref()
            .is_some_and(BackgroundRead::is_finished)
        {
            return Ok(());
        }
        let b = self.background.take().expect("checked above");
        let began = b.writes;
        let result = b.join(self.name())?;
        if began == self.writes {
            self.adopt(result);
        } else {
            debug!(
                table = self.table,
                "check-read overtaken by a write: dropped"
            );
            self.recheck_at = Some(Instant::now() + self.check_delay);
        }
        Ok(())
    }

    fn apply_table(&mut self) -> Result<ApplyOutcome, BackendError> {
        self.apply_table_isolating(0)
    }

    /// [`Self::apply_table`], `isolated` chains into this apply.
    fn apply_table_isolating(&mut self, isolated: usize) -> Result<ApplyOutcome, BackendError> {
        // A read started earlier first; one started now is taken by a
        // later apply.
        self.collect_check()?;
        if self.recheck_at.is_some_and(|t| Instant::now() >= t) {
            self.start_check();
        }
        if self.observed.is_none()
            && let Some(b) = self.background.take()
            && b.writes == self.writes
        {
            // A read no write has overtaken (the first one, started with
            // the daemon): wait for it rather than read again. A stale one
            // is let go (its thread ends on its own).
            let result = b.join(self.name())?;
            self.adopt(result);
        }
        if self.observed.is_none() {
            self.read()?;
        }
        let mut observed = self.observed.take().expect("read above");
        let t0 = Instant::now();
        let inputs = self.render(&mut observed);
        let render_ms = t0.elapsed().as_secs_f64() * 1e3;
        if inputs.is_empty() {
            self.observed = Some(observed);
            self.done();
            return Ok(ApplyOutcome {
                reschedule_after: self.next_check(),
            });
        }
        debug!(
            table = self.table,
            transactions = inputs.len(),
            bytes = inputs.iter().map(String::len).sum::<usize>(),
            render_ms,
            "iptables-restore"
        );
        // On failure `observed` is dropped: we no longer know what the
        // table holds (earlier transactions may have landed), and read it
        // again next time.
        self.writes += 1;
        self.last_write = Some(Instant::now());
        for input in &inputs {
            if let Err(e) = self.exec.restore(input) {
                // A chain the tool named is held fail-closed and the
                // table written again without it: one policy the kernel
                // cannot take (a match its kernel lacks) must not keep
                // every other change out.
                return match self.culprit(&e, input) {
                    Some(chain) if isolated < MAX_ISOLATED_PER_APPLY => {
                        self.quarantine(&chain, &e);
                        self.read()?;
                        self.apply_table_isolating(isolated + 1)
                    }
                    _ => Err(e),
                };
            }
        }
        self.observed = Some(observed);
        self.observed_gen += 1;
        self.done();
        self.recheck_at = Some(Instant::now() + self.check_delay);
        Ok(ApplyOutcome {
            reschedule_after: self.next_check(),
        })
    }

    /// When the loop should come back: for a read in flight, or for the
    /// next check.
    fn next_check(&self) -> Option<Duration> {
        if self.background.is_some() {
            return Some(CHECK_POLL);
        }
        self.recheck_at
            .map(|t| t.saturating_duration_since(Instant::now()))
    }

    fn done(&mut self) {
        self.changed = false;
        self.reshaped = false;
        self.full_diff = false;
        self.touched.clear();
    }
}

impl Backend for Table {
    fn name(&self) -> &'static str {
        match (self.version, self.table) {
            (IpVersion::V4, "raw") => "iptables-raw",
            (IpVersion::V4, "mangle") => "iptables-mangle",
            (IpVersion::V4, "nat") => "iptables-nat",
            (IpVersion::V4, _) => "iptables-filter",
            (IpVersion::V6, "raw") => "ip6tables-raw",
            (IpVersion::V6, "mangle") => "ip6tables-mangle",
            (IpVersion::V6, "nat") => "ip6tables-nat",
            (IpVersion::V6, _) => "ip6tables-filter",
        }
    }

    fn phases(&self) -> &'static [Phase] {
        &[Phase::Tables]
    }

    fn is_dirty(&self, phase: Phase) -> bool {
        phase == Phase::Tables
            && (self.changed
                || self.observed.is_none()
                || self.recheck_at.is_some_and(|t| Instant::now() >= t)
                || self
                    .background
                    .as_ref()
                    .is_some_and(BackgroundRead::is_finished))
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if refresh == Refresh::Iptables {
            // The refresh tick: a check-read (in the background when the
            // tool allows), like the one after writes, and like it only once
            // the table has gone unwritten for a while.
            let now = Instant::now();
            let quiet = self
                .last_write
                .map_or(now, |w| (w + self.check_delay).max(now));
            self.recheck_at = Some(self.recheck_at.map_or(quiet, |t| t.min(quiet)));
        }
    }

    #[instrument(level = "debug", skip(self), fields(backend = self.name()))]
    fn apply(&mut self, phase: Phase) -> Result<ApplyOutcome, BackendError> {
        if phase != Phase::Tables {
            return Ok(ApplyOutcome::default());
        }
        self.apply_table()
    }

    fn status(&self) -> Vec<(String, String)> {
        self.quarantined
            .iter()
            .map(|(chain, q)| {
                (
                    format!("{}{}.{}", crate::status::ISOLATED, self.name(), chain),
                    format!(
                        "{} (fail-closed: the chain drops everything until its rules change)",
                        q.why
                    ),
                )
            })
            .collect()
    }

    fn export(&self, m: &crate::metrics::Metrics) {
        // Unknown (not read yet, or a write failed): the last figures stay.
        let Some(observed) = &self.observed else {
            return;
        };
        let (chains, rules) = match self.counted.get() {
            Some((generation, c, r)) if generation == self.observed_gen => (c, r),
            _ => {
                let (c, r) = owned_counts(observed, &self.own);
                self.counted.set(Some((self.observed_gen, c, r)));
                (c, r)
            }
        };
        let label = crate::metrics::TableLabel {
            ip_version: crate::metrics::version_label(self.version).ip_version,
            table: self.table.to_string(),
        };
        m.iptables_chains.get_or_create(&label).set(chains as i64);
        m.iptables_rules.get_or_create(&label).set(rules as i64);
    }
}

/// Counts, for status and tests: our chains and rules as last observed.
pub fn owned_counts(observed: &BTreeMap<String, ObservedChain>, own: &Ownership) -> (usize, usize) {
    let chains = observed
        .keys()
        .filter(|n| n.starts_with(&own.chain_prefix))
        .count();
    let rules = observed
        .values()
        .map(|c| c.rules.iter().filter(|r| r.0.is_some()).count())
        .sum();
    (chains, rules)
}

#[cfg(test)]
mod tests;
