//! The nftables dataplane of one IP version as a backend: the managers'
//! chains ([`ChainTable`], one per iptables table) and IP sets
//! ([`DesiredSets`]), programmed by one commit per apply over our own
//! netlink socket ([`super::plan`] decides what it holds). The kernel is
//! read back at start (adopting what a previous run left: nothing is
//! written where it already matches, so a restart has no gap), after a
//! failed commit, and on every refresh tick (what was changed by hand is
//! put back). The refresh reads run on a thread of their own, over a
//! second socket ([`NetlinkKernel`]): at 30,000 chains and 1M elements a
//! read takes seconds, which the applies go on spending on the calc
//! graph's messages. A read that a commit overtook is not trusted (it may
//! have seen half of it): it is read again, and after three overtaken
//! reads in a row the next apply reads in place (so constant churn cannot
//! put a repair off for ever).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::{debug, info, instrument, warn};

use super::chains::ChainTable;
use super::netlink::{NftError, NftNetlink};
use super::ops::{Family, Op};
use super::plan::{
    Content, Contents, Input, Observed, ObservedChain, ObservedTable, Patch, PlanError, TableAfter,
    plan,
};
use super::sets::DesiredSets;
use super::shards::{Filter, ShardLayout};
use crate::backends::desired::{RuleTable, SetStore};
use crate::backends::iptables::Ownership;
use crate::backends::{ApplyOutcome, Backend, BackendError, BackgroundRead, Phase, Refresh};
use crate::model::IpVersion;
use crate::model::ipsets::SetNames;

/// The iptables tables whose chains we program, in hook order (filter,
/// with its shards, is [`Filter`]).
pub const TABLES: [&str; 3] = ["raw", "mangle", "nat"];

const NAME_V4: &str = "nftables-v4";
const NAME_V6: &str = "nftables-v6";

/// How often a read running on its own thread is looked for.
const READ_POLL: Duration = Duration::from_millis(50);
/// Refresh reads a commit may overtake in a row before one is made in
/// place.
const MAX_OVERTAKEN: u32 = 3;

/// A read of our tables that can run on another thread.
pub type DetachedRead = Box<dyn FnOnce() -> Result<(Observed, Contents), NftError> + Send>;

/// The kernel side: commits and reads. [`NftNetlink`] in the daemon.
pub trait NftKernel: Send + std::fmt::Debug {
    fn commit(&mut self, ops: &[Op]) -> Result<(), NftError>;
    /// Our tables (named `<chain_prefix>…`) of `family`, and what their
    /// sets hold.
    fn read(
        &mut self,
        family: Family,
        chain_prefix: &str,
    ) -> Result<(Observed, Contents), NftError>;
    /// The same read, to run on another thread while commits go on (None:
    /// reads block the apply).
    fn detached_read(&self, _family: Family, _chain_prefix: &str) -> Option<DetachedRead> {
        None
    }
}

/// The daemon's kernel: one socket for commits, and a second one, opened
/// with it (so in the same network namespace), for the refresh reads that
/// run beside them.
#[derive(Debug)]
pub struct NetlinkKernel {
    writer: NftNetlink,
    reader: Arc<Mutex<NftNetlink>>,
}

impl NetlinkKernel {
    pub fn open() -> Result<Self, NftError> {
        Ok(Self {
            writer: NftNetlink::open()?,
            reader: Arc::new(Mutex::new(NftNetlink::open()?)),
        })
    }
}

impl NftKernel for NetlinkKernel {
    fn commit(&mut self, ops: &[Op]) -> Result<(), NftError> {
        self.writer.commit(ops)
    }

    fn read(
        &mut self,
        family: Family,
        chain_prefix: &str,
    ) -> Result<(Observed, Contents), NftError> {
        NftKernel::read(&mut self.writer, family, chain_prefix)
    }

    fn detached_read(&self, family: Family, chain_prefix: &str) -> Option<DetachedRead> {
        let reader = Arc::clone(&self.reader);
        let prefix = chain_prefix.to_owned();
        Some(Box::new(move || {
            // A read that panicked poisons the lock; the socket is still
            // good (each dump skips replies to an earlier sequence).
            let mut r = reader.lock().unwrap_or_else(PoisonError::into_inner);
            NftKernel::read(&mut *r, family, &prefix)
        }))
    }
}

impl NftKernel for NftNetlink {
    fn commit(&mut self, ops: &[Op]) -> Result<(), NftError> {
        NftNetlink::commit(self, ops)
    }

    fn read(
        &mut self,
        family: Family,
        chain_prefix: &str,
    ) -> Result<(Observed, Contents), NftError> {
        let mut observed = Observed::new();
        let mut contents = Contents::new();
        for table in self.tables(family)? {
            if !table.starts_with(chain_prefix) {
                continue;
            }
            let mut t = ObservedTable::default();
            // Chain by chain: a whole-table rule dump is quadratic in the
            // kernel (see `NftNetlink::rules`).
            for c in self.chains(family, &table)? {
                let rules: Vec<String> = self
                    .chain_rules(family, &table, &c.name)?
                    .into_iter()
                    .filter(|r| r.chain == c.name)
                    .map(|r| r.comment)
                    .collect();
                t.chains.insert(
                    c.name,
                    ObservedChain {
                        hook: c.hook,
                        comments: rules.into(),
                    },
                );
            }
            for s in self.sets(family, &table)? {
                let content = if s.key_len == 2 {
                    Content::Intervals(self.raw_elements(family, &table, &s.name)?)
                } else if s.flags & 0x4 != 0 {
                    Content::Ranges(self.ranges(family, &table, &s.name)?)
                } else {
                    // A 16-byte key parses as an IPv6 address; a map's
                    // interface names are taken back as such (same bytes).
                    let ifname = |k: super::ops::Key| match k {
                        super::ops::Key::Addr(std::net::IpAddr::V6(a)) => {
                            super::ops::Key::IfName(a.octets())
                        }
                        k => k,
                    };
                    if s.key_type == super::ops::TYPE_IFNAME {
                        // A dispatch map: each interface and the chain it
                        // goes to.
                        let entries = self.verdicts(family, &table, &s.name)?;
                        let keys = entries.iter().map(|(k, _)| ifname(*k)).collect();
                        let by_name = entries
                            .into_iter()
                            .filter_map(|(k, c)| Some((ifname(k).as_ifname()?, c)))
                            .collect();
                        t.maps.insert(s.name.clone(), by_name);
                        Content::Keys(keys)
                    } else {
                        let keys = self.elements(family, &table, &s.name)?.into_iter();
                        Content::Keys(keys.collect())
                    }
                };
                contents.insert((table.clone(), s.name.clone()), content);
                t.sets.insert(s.name.clone(), s);
            }
            observed.insert(table, t);
        }
        Ok((observed, contents))
    }
}

/// The nftables dataplane of one IP version.
#[derive(Debug)]
pub struct Dataplane {
    version: IpVersion,
    own: Ownership,
    pub tables: Vec<ChainTable>,
    pub filter: Filter,
    pub sets: DesiredSets,
    kernel: Box<dyn NftKernel>,
    /// Our tables as last read or written; `None`: read at the next apply.
    observed: Option<Observed>,
    /// Set contents from the read not yet used by a plan.
    contents: Option<Contents>,
    /// A refresh tick asked for a read.
    refresh_due: bool,
    /// The refresh read running on its own thread, and how many commits
    /// had been tried when it began.
    background: Option<BackgroundRead<(Observed, Contents)>>,
    /// Commits tried (a read begun before the last one may be stale).
    attempts: u64,
    /// The first read's shard placement taken over.
    adopted: bool,
    /// Refresh reads overtaken by a commit in a row.
    overtaken: u32,
    commits: u64,
    /// Those that added rules: the kernel validated them by walking the
    /// table (set elements alone are not walked).
    validating: u64,
    /// Commits already counted in the metrics (all, validating).
    exported: std::sync::atomic::AtomicU64,
    exported_validating: std::sync::atomic::AtomicU64,
    /// Commit times not yet put into the metrics, in seconds.
    commit_times: std::sync::Mutex<Vec<f64>>,
    /// Per table of ours: (chains, rules, sets) as last read or written,
    /// kept up to date by each commit (status and metrics run after every
    /// apply; counting 320,000 rules each time cost milliseconds).
    counts: Counts,
    /// The [`Counts::generation`] the table gauges were last set from.
    exported_counts: std::sync::atomic::AtomicU64,
    /// How many of our IP sets some table holds (the metric), counted when
    /// a table is written whole or read.
    held_sets: usize,
}

/// (chains, rules, sets) per table, with the status lines made of them:
/// made again when they change, not after every apply (the status and the
/// gauges of 33 tables were ~0.1 ms of a member's ~2 ms).
#[derive(Debug, Default)]
struct Counts {
    by_table: std::collections::BTreeMap<String, (usize, usize, usize)>,
    lines: Vec<(String, String)>,
    /// Bumped on every change.
    generation: u64,
    /// The generation `lines` were made at.
    lines_made: Option<u64>,
}

impl Counts {
    fn replace(&mut self, by_table: std::collections::BTreeMap<String, (usize, usize, usize)>) {
        self.by_table = by_table;
        self.generation += 1;
    }

    fn set(&mut self, table: String, counts: Option<(usize, usize, usize)>) {
        let was = match counts {
            Some(c) => self.by_table.insert(table, c),
            None => self.by_table.remove(&table),
        };
        if was != counts {
            self.generation += 1;
        }
    }

    /// The status lines made again, if the counts changed since.
    fn make_lines(&mut self, backend: &str) {
        if self.lines_made == Some(self.generation) {
            return;
        }
        self.lines_made = Some(self.generation);
        self.lines = self
            .by_table
            .iter()
            .map(|(name, (chains, rules, sets))| {
                (
                    format!("{backend}.{name}"),
                    format!("{chains} chains, {rules} rules, {sets} sets"),
                )
            })
            .collect();
    }
}

/// (chains, rules, sets) of each table.
fn count(observed: &Observed) -> std::collections::BTreeMap<String, (usize, usize, usize)> {
    observed
        .iter()
        .map(|(name, t)| {
            let rules = t.chains.values().map(|c| c.comments.len()).sum();
            (name.clone(), (t.chains.len(), rules, t.sets.len()))
        })
        .collect()
}

/// How many of our IP sets some table of `observed` holds (port lists
/// and the shards' copies aside).
fn held(observed: &Observed, sets: &DesiredSets) -> usize {
    observed
        .values()
        .flat_map(|t| t.sets.keys())
        .filter(|s| sets.sets.contains_key(*s))
        .collect::<std::collections::HashSet<_>>()
        .len()
}

impl Dataplane {
    /// `shards`: how many tables workload policy is spread over (see
    /// [`Filter`]; 0 or 1: filter holds it all).
    pub fn new(
        version: IpVersion,
        prefix: &str,
        names: SetNames,
        layout: ShardLayout,
        kernel: Box<dyn NftKernel>,
    ) -> Self {
        let own = Ownership::new(prefix);
        Self {
            version,
            tables: TABLES
                .iter()
                .map(|t| ChainTable::new(t, version, own.clone()))
                .collect(),
            filter: Filter::new(version, own.clone(), layout.marks, layout.shards),
            sets: DesiredSets::new(version, names),
            own,
            kernel,
            observed: None,
            contents: None,
            refresh_due: false,
            background: None,
            attempts: 0,
            adopted: false,
            overtaken: 0,
            commits: 0,
            validating: 0,
            exported: std::sync::atomic::AtomicU64::new(0),
            exported_validating: std::sync::atomic::AtomicU64::new(0),
            commit_times: std::sync::Mutex::new(Vec::new()),
            counts: Counts::default(),
            exported_counts: std::sync::atomic::AtomicU64::new(u64::MAX),
            held_sets: 0,
        }
    }

    /// Opens the daemon's netlink sockets.
    pub fn open(
        version: IpVersion,
        prefix: &str,
        names: SetNames,
        layout: ShardLayout,
    ) -> Result<Self, NftError> {
        Ok(Self::new(
            version,
            prefix,
            names,
            layout,
            Box::new(NetlinkKernel::open()?),
        ))
    }

    /// Every table of chains: raw, mangle, nat, filter and its shards.
    fn chain_tables(&self) -> Vec<&ChainTable> {
        self.tables.iter().chain(self.filter.tables()).collect()
    }

    fn tables_changed(&self) -> bool {
        self.tables.iter().any(|t| t.changed) || self.filter.changed()
    }

    /// A refresh read is running on its own thread.
    pub fn reading(&self) -> bool {
        self.background.is_some()
    }

    /// Starts the refresh read: on its own thread where the kernel allows
    /// and there is something to compare it with; else in this apply.
    fn start_read(&mut self) {
        if self.background.is_some() {
            return; // one at a time; a finished one is collected first
        }
        let job = self.observed.as_ref().and_then(|_| {
            self.kernel
                .detached_read(self.family(), &self.own.chain_prefix)
        });
        let Some(job) = job else {
            self.observed = None;
            return;
        };
        let backend = self.name();
        debug!(backend, "refresh read started");
        self.background = Some(BackgroundRead::spawn(self.attempts, move || {
            job().map_err(|source| BackendError::Nftables { backend, source })
        }));
    }

    /// Takes in a finished refresh read: adopted when no commit was tried
    /// since it began (the next plan is a full one against it: what was
    /// changed by hand is put back); read again otherwise.
    fn collect_read(&mut self) {
        if !self
            .background
            .as_ref()
            .is_some_and(BackgroundRead::is_finished)
        {
            return;
        }
        let b = self.background.take().expect("checked above");
        let began = b.writes;
        match b.join(self.name()) {
            Ok(_) if self.observed.is_none() => {} // read in place anyway
            Ok((observed, contents)) if began == self.attempts => {
                debug!(tables = observed.len(), "refresh read adopted");
                self.overtaken = 0;
                self.counts.replace(count(&observed));
                self.held_sets = held(&observed, &self.sets);
                self.observed = Some(observed);
                self.contents = Some(contents);
            }
            Ok(_) if self.overtaken < MAX_OVERTAKEN => {
                self.overtaken += 1;
                debug!(
                    overtaken = self.overtaken,
                    "refresh read overtaken by a commit: read again"
                );
                self.start_read();
            }
            Ok(_) => {
                debug!("refresh reads keep being overtaken: reading in the apply");
                self.overtaken = 0;
                self.observed = None;
            }
            Err(e) => {
                warn!(error = %e, "refresh read failed: reading in the apply");
                self.observed = None;
            }
        }
    }

    pub fn family(&self) -> Family {
        match self.version {
            IpVersion::V4 => Family::Ip,
            IpVersion::V6 => Family::Ip6,
        }
    }

    pub fn version(&self) -> IpVersion {
        self.version
    }

    /// Commits that changed something, since start.
    pub fn commits(&self) -> u64 {
        self.commits
    }

    /// Our tables as last read or written.
    pub fn observed(&self) -> Option<&Observed> {
        self.observed.as_ref()
    }

    pub fn rule_tables_mut(&mut self) -> impl Iterator<Item = &mut dyn RuleTable> {
        self.tables
            .iter_mut()
            .map(|t| t as &mut dyn RuleTable)
            .chain(std::iter::once(&mut self.filter as &mut dyn RuleTable))
    }

    pub fn set_store_mut(&mut self) -> &mut dyn SetStore {
        &mut self.sets
    }

    fn err(&self, source: NftError) -> BackendError {
        BackendError::Nftables {
            backend: self.name(),
            source,
        }
    }

    fn read(&mut self) -> Result<(), BackendError> {
        let started = Instant::now();
        let (observed, contents) = self
            .kernel
            .read(self.family(), &self.own.chain_prefix)
            .map_err(|e| self.err(e))?;
        debug!(tables = observed.len(), elapsed = ?started.elapsed(), "read our nftables tables");
        self.counts.replace(count(&observed));
        self.held_sets = held(&observed, &self.sets);
        self.observed = Some(observed);
        self.contents = Some(contents);
        Ok(())
    }
}

impl Backend for Dataplane {
    fn name(&self) -> &'static str {
        match self.version {
            IpVersion::V4 => NAME_V4,
            IpVersion::V6 => NAME_V6,
        }
    }

    fn phases(&self) -> &'static [Phase] {
        &[Phase::Tables]
    }

    fn is_dirty(&self, _phase: Phase) -> bool {
        self.observed.is_none()
            || self.refresh_due
            || self.sets.changed
            || self.tables_changed()
            || self
                .background
                .as_ref()
                .is_some_and(BackgroundRead::is_finished)
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if matches!(refresh, Refresh::Iptables | Refresh::IpSets) {
            self.refresh_due = true;
        }
    }

    fn wake_after(&self) -> Option<Duration> {
        self.background.as_ref().map(|_| READ_POLL)
    }

    #[instrument(skip_all, fields(backend = self.name()))]
    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        self.collect_read();
        if std::mem::take(&mut self.refresh_due) {
            self.start_read();
        }
        if self.observed.is_none() {
            self.read()?;
        }
        if self.contents.is_none() && !self.sets.changed && !self.tables_changed() {
            return Ok(ApplyOutcome::default()); // a read under way, nothing else
        }
        let family = self.family();
        let planning = Instant::now();
        if !std::mem::replace(&mut self.adopted, true) {
            let observed = self.observed.as_ref().expect("read above");
            let contents = self.contents.as_ref();
            self.filter
                .adopt(observed, contents, &self.own.chain_prefix);
        }
        self.filter
            .settle()
            .map_err(|e| BackendError::Inconsistent {
                backend: self.name(),
                reason: e.to_string(),
            })?;
        let p = loop {
            let observed = self.observed.as_ref().expect("read above");
            let planned = plan(Input {
                family,
                chain_prefix: &self.own.chain_prefix,
                tables: &self.chain_tables(),
                sets: &self.sets,
                observed,
                contents: self.contents.as_ref(),
            });
            match planned {
                Ok(p) => break p,
                Err(PlanError::NeedRead { .. }) if self.contents.is_none() => self.read()?,
                Err(e) => {
                    return Err(BackendError::Inconsistent {
                        backend: self.name(),
                        reason: e.to_string(),
                    });
                }
            }
        };
        let whole = p.any_whole();
        debug!(
            elapsed = ?planning.elapsed(),
            whole = ?p.whole_tables().collect::<Vec<_>>(),
            tables = p.tables.len(),
            set_changes = self.sets.changes.len(),
            "planned"
        );
        let started = Instant::now();
        let n = p.ops.len();
        if n > 0 {
            self.attempts += 1;
        }
        if let Err(e) = self.kernel.commit(&p.ops) {
            warn!(error = %e, ops = n, "nftables commit refused; reading back");
            self.observed = None;
            self.contents = None;
            return Err(self.err(e));
        }
        if n > 0 {
            self.commits += 1;
            if p.ops.iter().any(|o| matches!(o, Op::AddRule { .. })) {
                self.validating += 1;
            }
            if let Ok(mut t) = self.commit_times.lock() {
                t.push(started.elapsed().as_secs_f64());
            }
            let adopted = self.contents.is_some();
            info!(ops = n, elapsed = ?started.elapsed(), after_read = adopted, whole, commits = self.commits, "nftables committed");
        }
        let observed = self.observed.as_mut().expect("planned from it");
        // The sets held change only with a table written whole or removed,
        // or a set a patch adds (a new chain's in a shard), and then only
        // when a set came or went or a read came back (else every set was
        // held before and is after: a set one table stops using, the spare
        // table takes).
        // Counting them all took ~3% of the daemon under endpoint churn.
        let sets_moved = self.contents.is_some()
            || self.sets.removed_any
            || self
                .sets
                .changes
                .values()
                .any(|c| matches!(c, super::sets::Change::Whole));
        let recount = sets_moved
            && p.tables.values().any(|t| match t {
                TableAfter::Patched(patches) => patches.iter().any(|x| matches!(x, Patch::Set(_))),
                _ => true,
            });
        for name in p.apply_to(observed, &mut self.sets.written_ranges) {
            let counts = observed.get(&name).map(|t| {
                let rules = t.chains.values().map(|c| c.comments.len()).sum();
                (t.chains.len(), rules, t.sets.len())
            });
            self.counts.set(name, counts);
        }
        if recount {
            self.held_sets = held(observed, &self.sets);
        }
        let backend = self.name();
        self.counts.make_lines(backend);
        self.contents = None;
        self.sets.changes.clear();
        self.sets.changed = false;
        self.sets.removed_any = false;
        for t in self.tables.iter_mut().chain(self.filter.tables_mut()) {
            t.changed = false;
            t.reshaped = false;
            t.regraphed = false;
            t.touched.clear();
        }
        Ok(ApplyOutcome::default())
    }

    fn export(&self, m: &crate::metrics::Metrics) {
        use std::sync::atomic::Ordering;
        let v = crate::metrics::version_label(self.version);
        let before = self.exported.swap(self.commits, Ordering::Relaxed);
        m.nftables_commits
            .get_or_create(&v)
            .inc_by(self.commits.saturating_sub(before));
        let before = self
            .exported_validating
            .swap(self.validating, Ordering::Relaxed);
        m.nftables_validating_commits
            .get_or_create(&v)
            .inc_by(self.validating.saturating_sub(before));
        if let Ok(mut t) = self.commit_times.lock() {
            let h = m.nftables_commit_time.get_or_create(&v);
            for s in t.drain(..) {
                h.observe(s);
            }
        }
        if self.observed.is_none() {
            return;
        }
        let generation = self.counts.generation;
        if self.exported_counts.swap(generation, Ordering::Relaxed) != generation {
            self.export_tables(m, &v);
        }
        m.ipsets.get_or_create(&v).set(self.held_sets as i64);
    }

    fn status(&self) -> Vec<(String, String)> {
        if self.observed.is_none() {
            return Vec::new();
        }
        self.counts.lines.clone()
    }
}

impl Dataplane {
    /// Each table's gauges.
    fn export_tables(&self, m: &crate::metrics::Metrics, v: &crate::metrics::VersionLabel) {
        for t in self.chain_tables() {
            let name = super::plan::table_name(&self.own.chain_prefix, t.table());
            let label = crate::metrics::TableLabel {
                ip_version: v.ip_version.clone(),
                table: name.clone(),
            };
            let (chains, rules, _) = self.counts.by_table.get(&name).copied().unwrap_or_default();
            m.nftables_chains.get_or_create(&label).set(chains as i64);
            m.nftables_rules.get_or_create(&label).set(rules as i64);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::backends::ipsets::Meta;
    use crate::backends::iptables::Rule;
    use crate::model::ipsets::{IpSetType, Member};

    /// Commits are recorded and make what the kernel holds; the refresh
    /// reads on other threads wait for a go each and return what the
    /// kernel held when they were let go.
    #[derive(Debug)]
    struct Fake {
        commits: Arc<Mutex<Vec<usize>>>,
        /// Commits still to refuse.
        refuse: Arc<Mutex<u32>>,
        held: Arc<Mutex<(Observed, Contents)>>,
        go: Arc<Mutex<mpsc::Receiver<()>>>,
        detached: Arc<Mutex<u32>>,
    }

    impl NftKernel for Fake {
        fn commit(&mut self, ops: &[Op]) -> Result<(), NftError> {
            let mut refuse = self.refuse.lock().unwrap();
            if *refuse > 0 {
                *refuse -= 1;
                return Err(NftError::Refused {
                    op: "a rule".into(),
                    source: std::io::Error::from_raw_os_error(12),
                });
            }
            self.commits.lock().unwrap().push(ops.len());
            Ok(())
        }
        fn read(&mut self, _: Family, _: &str) -> Result<(Observed, Contents), NftError> {
            Ok(self.held.lock().unwrap().clone())
        }
        fn detached_read(&self, _: Family, _: &str) -> Option<DetachedRead> {
            *self.detached.lock().unwrap() += 1;
            let (go, held) = (Arc::clone(&self.go), Arc::clone(&self.held));
            Some(Box::new(move || {
                go.lock().unwrap().recv().expect("a go");
                Ok(held.lock().unwrap().clone())
            }))
        }
    }

    fn finish(d: &Dataplane) {
        let until = Instant::now() + Duration::from_secs(5);
        while !d
            .background
            .as_ref()
            .is_some_and(BackgroundRead::is_finished)
        {
            assert!(Instant::now() < until, "the read never finished");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A refresh read does not hold up the applies; one a commit overtook
    /// is read again, and the one adopted repairs what it found.
    #[test]
    fn refresh_reads_run_beside_the_applies() {
        let (tx, rx) = mpsc::channel();
        let commits = Arc::new(Mutex::new(Vec::new()));
        let detached = Arc::new(Mutex::new(0));
        let held = Arc::new(Mutex::new((Observed::new(), Contents::new())));
        let fake = Fake {
            commits: Arc::clone(&commits),
            refuse: Arc::default(),
            held: Arc::clone(&held),
            go: Arc::new(Mutex::new(rx)),
            detached: Arc::clone(&detached),
        };
        let names = SetNames::new("dph").unwrap();
        let mut d = Dataplane::new(
            IpVersion::V4,
            "dph",
            names,
            ShardLayout::default(),
            Box::new(fake),
        );
        let filter = &mut d.filter;
        filter
            .set_chain(
                "dph-a",
                vec![Rule::parse("-m set --match-set dph40s src -j DROP").unwrap()],
            )
            .unwrap();
        filter
            .set_hooks("FORWARD", vec![Rule::parse("-j dph-a").unwrap()])
            .unwrap();
        let ip = |s: &str| Member::Ip(s.parse().unwrap());
        let meta = Meta {
            set_type: IpSetType::Ip,
            maxelem: 10,
        };
        d.sets
            .replace("dph40s".into(), meta, [ip("10.0.0.1")].into());
        d.apply(Phase::Tables).unwrap();
        assert_eq!(
            commits.lock().unwrap().len(),
            1,
            "the first apply writes it all"
        );
        let written = d.observed.clone().unwrap();

        // The refresh: the read starts and the apply returns at once.
        d.request_resync(Refresh::Iptables);
        assert!(d.is_dirty(Phase::Tables));
        d.apply(Phase::Tables).unwrap();
        assert!(d.reading() && d.wake_after() == Some(READ_POLL));
        assert!(
            !d.is_dirty(Phase::Tables),
            "nothing to do until the read is done"
        );
        // A member meanwhile is written at once (and overtakes the read).
        d.sets.delta(
            "dph40s",
            &mut [ip("10.0.0.2")].into_iter(),
            &mut std::iter::empty(),
        );
        d.apply(Phase::Tables).unwrap();
        assert_eq!(commits.lock().unwrap().len(), 2);

        // The overtaken read is dropped and a new one started.
        tx.send(()).unwrap();
        finish(&d);
        assert!(d.is_dirty(Phase::Tables));
        d.apply(Phase::Tables).unwrap();
        assert!(d.reading(), "read again");
        assert_eq!(*detached.lock().unwrap(), 2);
        assert_eq!(
            commits.lock().unwrap().len(),
            2,
            "nothing written on a stale read"
        );

        // The kernel lost our tables meanwhile (a hand flush): the read
        // that no commit overtook is adopted, and what it found missing
        // is put back.
        *held.lock().unwrap() = (Observed::new(), Contents::new());
        tx.send(()).unwrap();
        finish(&d);
        d.apply(Phase::Tables).unwrap();
        assert!(!d.reading());
        assert_eq!(commits.lock().unwrap().len(), 3, "repaired");
        assert_eq!(d.observed.as_ref().map(|o| o.len()), Some(written.len()));

        // Reads that commits keep overtaking give way to one in place.
        for n in 0..=MAX_OVERTAKEN {
            if n == 0 {
                d.request_resync(Refresh::IpSets);
                d.apply(Phase::Tables).unwrap();
            }
            d.sets.delta(
                "dph40s",
                &mut [ip(&format!("10.0.1.{n}"))].into_iter(),
                &mut std::iter::empty(),
            );
            d.apply(Phase::Tables).unwrap();
            tx.send(()).unwrap();
            finish(&d);
            d.apply(Phase::Tables).unwrap();
        }
        assert!(!d.reading(), "the last one was read in place");
    }

    /// An IPv4 dataplane over a [`Fake`] that records its commits in
    /// `commits` and refuses the first `refuse`; the sender lets its
    /// detached reads go.
    fn unsharded(commits: Arc<Mutex<Vec<usize>>>, refuse: u32) -> (Dataplane, mpsc::Sender<()>) {
        let (tx, rx) = mpsc::channel();
        let fake = Fake {
            commits,
            refuse: Arc::new(Mutex::new(refuse)),
            held: Arc::new(Mutex::new((Observed::new(), Contents::new()))),
            go: Arc::new(Mutex::new(rx)),
            detached: Arc::default(),
        };
        let d = Dataplane::new(
            IpVersion::V4,
            "dph",
            SetNames::new("dph").unwrap(),
            ShardLayout::default(),
            Box::new(fake),
        );
        (d, tx)
    }

    /// A commit the kernel refuses (nothing of it applied) is an error
    /// of the apply, which the loop retries; each retry reads the tables
    /// back and plans from what is there, so the change lands whole once
    /// the kernel takes it, and nothing is counted committed before.
    #[test]
    fn a_refused_commit_is_retried_from_a_fresh_read() {
        let commits = Arc::new(Mutex::new(Vec::new()));
        let (mut d, _go) = unsharded(Arc::clone(&commits), 2);
        d.filter
            .set_chain("dph-a", vec![Rule::parse("-j DROP").unwrap()])
            .unwrap();
        d.filter
            .set_hooks("FORWARD", vec![Rule::parse("-j dph-a").unwrap()])
            .unwrap();
        for _ in 0..2 {
            let e = d.apply(Phase::Tables).unwrap_err();
            assert!(e.to_string().contains("refused a rule"), "{e}");
            assert!(d.is_dirty(Phase::Tables), "still to do");
            assert_eq!(d.commits(), 0);
        }
        d.apply(Phase::Tables).unwrap();
        assert_eq!(d.commits(), 1);
        assert_eq!(commits.lock().unwrap().len(), 1);
        assert!(!d.is_dirty(Phase::Tables));
    }

    /// The IP sets counted as held follow sets that come and go, and stay
    /// right through commits that reshape a table without either (which
    /// skip the count).
    #[test]
    fn the_sets_held_follow_sets_added_and_removed() {
        let (mut d, _go) = unsharded(Arc::default(), 0);
        let meta = Meta {
            set_type: IpSetType::Ip,
            maxelem: 10,
        };
        let one = |a: &str| [Member::Ip(a.parse().unwrap())].into();
        let r = |s: &str| Rule::parse(s).unwrap();
        d.filter
            .set_chain("dph-a", vec![r("-m set --match-set dph40a src -j DROP")])
            .unwrap();
        d.filter.set_hooks("FORWARD", vec![r("-j dph-a")]).unwrap();
        d.set_store_mut()
            .replace("dph40a".into(), meta, one("10.0.0.1"));
        d.apply(Phase::Tables).unwrap();
        assert_eq!(d.held_sets, 1);
        d.set_store_mut()
            .replace("dph40b".into(), meta, one("10.0.0.2"));
        d.apply(Phase::Tables).unwrap();
        assert_eq!(d.held_sets, 2);
        // A new chain (filter planned whole), no set new or gone.
        d.filter.set_chain("dph-b", vec![r("-j DROP")]).unwrap();
        d.filter
            .set_hooks("FORWARD", vec![r("-j dph-a"), r("-j dph-b")])
            .unwrap();
        d.apply(Phase::Tables).unwrap();
        assert_eq!(d.held_sets, 2);
        d.set_store_mut().remove("dph40b");
        d.apply(Phase::Tables).unwrap();
        assert_eq!(d.held_sets, 1);
    }

    /// The status lines per table are made again when a commit changes
    /// what a table holds, and only then (they are not made after every
    /// apply); a member alone leaves them as they were.
    #[test]
    fn the_status_follows_what_each_table_holds() {
        let (mut d, _go) = unsharded(Arc::default(), 0);
        let r = |s: &str| Rule::parse(s).unwrap();
        let meta = Meta {
            set_type: IpSetType::Ip,
            maxelem: 10,
        };
        assert!(d.status().is_empty(), "nothing read yet");
        d.filter.set_chain("dph-a", vec![r("-j DROP")]).unwrap();
        d.filter.set_hooks("FORWARD", vec![r("-j dph-a")]).unwrap();
        d.set_store_mut().replace(
            "dph40a".into(),
            meta,
            [Member::Ip("10.0.0.1".parse().unwrap())].into(),
        );
        d.apply(Phase::Tables).unwrap();
        let line = |d: &Dataplane| {
            d.status()
                .into_iter()
                .find(|(k, _)| k == "nftables-v4.dph-filter")
                .map(|(_, v)| v)
        };
        assert_eq!(line(&d).as_deref(), Some("2 chains, 2 rules, 1 sets"));
        let made = d.counts.lines_made;
        d.set_store_mut().delta(
            "dph40a",
            &mut [Member::Ip("10.0.0.2".parse().unwrap())].into_iter(),
            &mut std::iter::empty(),
        );
        d.apply(Phase::Tables).unwrap();
        assert_eq!(d.counts.lines_made, made, "a member alone: not made again");
        d.filter
            .set_chain("dph-a", vec![r("-p tcp -j DROP"), r("-j DROP")])
            .unwrap();
        d.apply(Phase::Tables).unwrap();
        assert_eq!(line(&d).as_deref(), Some("2 chains, 3 rules, 1 sets"));
    }

    /// A new IP set that a new endpoint's policy looks up, in the same
    /// apply: its shard is planned from the changes and takes the set, not
    /// filter (whether filter is planned from its changes or, a policy
    /// chain more, whole), and the sets held count it.
    #[test]
    fn a_set_a_shard_takes_from_its_changes_is_counted_held() {
        let fake = Fake {
            commits: Arc::default(),
            refuse: Arc::default(),
            held: Arc::new(Mutex::new((Observed::new(), Contents::new()))),
            go: Arc::new(Mutex::new(mpsc::channel().1)),
            detached: Arc::default(),
        };
        let mut d = Dataplane::new(
            IpVersion::V4,
            "dph",
            SetNames::new("dph").unwrap(),
            ShardLayout {
                marks: crate::rules::Marks::default(),
                shards: 2,
            },
            Box::new(fake),
        );
        let r = |s: &str| Rule::parse(s).unwrap();
        let meta = Meta {
            set_type: IpSetType::Ip,
            maxelem: 10,
        };
        let one = |a: &str| [Member::Ip(a.parse().unwrap())].into();
        // Both policies first (filter holds them, unprogrammed): the
        // second apply leaves filter's chains as they are.
        for (i, set) in ["dph40a", "dph40b"].iter().enumerate() {
            d.filter
                .set_chain(
                    &format!("dph-pi-p{i}"),
                    vec![r(&format!("-m set --match-set {set} src -j DROP"))],
                )
                .unwrap();
        }
        let workloads = |d: &mut Dataplane, n: usize| {
            let (mut from, mut to) = (Vec::new(), Vec::new());
            for i in 0..n {
                d.filter
                    .set_chain(
                        &format!("dph-tw-cali{i}"),
                        vec![r(&format!("-j dph-pi-p{i}")), r("-j DROP")],
                    )
                    .unwrap();
                d.filter
                    .set_chain(&format!("dph-fw-cali{i}"), vec![r("-j DROP")])
                    .unwrap();
                from.push(r(&format!("-i cali{i} -g dph-fw-cali{i}")));
                to.push(r(&format!("-o cali{i} -g dph-tw-cali{i}")));
            }
            from.push(r("-j DROP"));
            to.push(r("-j DROP"));
            d.filter.set_chain("dph-from-wl-dispatch", from).unwrap();
            d.filter.set_chain("dph-to-wl-dispatch", to).unwrap();
        };
        d.set_store_mut()
            .replace("dph40a".into(), meta, one("10.0.0.1"));
        workloads(&mut d, 1);
        d.filter
            .set_hooks(
                "FORWARD",
                vec![
                    r("-i cali+ -j dph-from-wl-dispatch"),
                    r("-o cali+ -j dph-to-wl-dispatch"),
                ],
            )
            .unwrap();
        d.apply(Phase::Tables).unwrap();
        assert_eq!(d.held_sets, 1);
        let shard = d.filter.placement()["cali0"];

        d.set_store_mut()
            .replace("dph40b".into(), meta, one("10.0.0.2"));
        workloads(&mut d, 2);
        assert!(
            d.filter.main.touched.is_empty() && !d.filter.main.regraphed,
            "filter itself did not change"
        );
        d.apply(Phase::Tables).unwrap();
        let observed = d.observed.as_ref().unwrap();
        let s = d.filter.placement()["cali1"];
        let sets_of = |t: &str| observed[t].sets.keys().cloned().collect::<Vec<_>>();
        assert_eq!(s, shard, "cali1 goes where cali0 is: the emptier is full");
        assert!(
            sets_of(&format!("dph-filter-{s}")).contains(&"dph40b".to_string()),
            "{:?}",
            sets_of(&format!("dph-filter-{s}"))
        );
        assert!(!sets_of("dph-filter").contains(&"dph40b".to_string()));
        assert_eq!(d.held_sets, 2, "the new set, held by the shard alone");

        // Again with a new policy in the same apply: filter gets a chain
        // more (planned whole) and still leaves the set to the shard.
        d.set_store_mut()
            .replace("dph40c".into(), meta, one("10.0.0.3"));
        d.filter
            .set_chain(
                "dph-pi-p2",
                vec![r("-m set --match-set dph40c src -j DROP")],
            )
            .unwrap();
        workloads(&mut d, 3);
        assert!(d.filter.main.regraphed);
        d.apply(Phase::Tables).unwrap();
        let observed = d.observed.as_ref().unwrap();
        let s = d.filter.placement()["cali2"];
        let sets_of = |t: &str| observed[t].sets.keys().cloned().collect::<Vec<_>>();
        assert!(sets_of(&format!("dph-filter-{s}")).contains(&"dph40c".to_string()));
        assert!(!sets_of("dph-filter").contains(&"dph40c".to_string()));
        assert_eq!(d.held_sets, 3);
    }
}
