//! The nftables dataplane of one IP version as a backend: the managers'
//! chains ([`ChainTable`], one per iptables table) and IP sets
//! ([`DesiredSets`]), programmed by one commit per apply over our own
//! netlink socket ([`super::plan`] decides what it holds). The kernel is
//! read back at start (adopting what a previous run left: nothing is
//! written where it already matches, so a restart has no gap), after a
//! failed commit, and on every refresh tick (what was changed by hand is
//! put back).
//!
//! The refresh reads run on a thread of their own, over a second socket
//! ([`NetlinkKernel`]), table by table ([`super::read`]): at 30,000
//! chains and 1M elements a read of all takes seconds, which the applies
//! go on spending on the calc graph's messages. Each table read is taken
//! as it comes in, with the chains and sets a commit of ours touched
//! since its read began taken as written rather than as read (it may
//! have seen half of the commit; [`super::read::patch_read`]). A table
//! made or removed meanwhile, or whose read failed, is read again, alone,
//! up to four rounds a refresh (`MAX_ROUNDS`); one still unread is left to the
//! next refresh, and after three refreshes in a row (`MAX_MISSED`) it is read
//! in the apply (a stall of one table's read, not of all). A table taken
//! is planned whole against what was read; the others go on from their
//! changes.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::{debug, info, instrument, warn};

use super::chains::ChainTable;
use super::netlink::{NftError, NftNetlink};
use super::ops::{Family, Op};
use super::plan::{Contents, Input, Observed, ObservedTable, Patch, PlanError, TableAfter, plan};
use super::read::{
    Gate, Listing, Object, SharedReader, TableRead, TableReader, patch_read, read_all,
};
use super::sets::DesiredSets;
use super::shards::{Filter, ShardLayout};
use crate::backends::desired::{RuleTable, SetStore};
use crate::backends::{ApplyOutcome, Backend, BackendError, BackgroundRead, Phase, Refresh};
use crate::generictables::Ownership;
use crate::model::IpVersion;
use crate::model::ipsets::SetNames;

/// The iptables tables whose chains we program, in hook order (filter,
/// with its shards, is [`Filter`]).
pub const TABLES: [&str; 3] = ["raw", "mangle", "nat"];

const NAME_V4: &str = "nftables-v4";
const NAME_V6: &str = "nftables-v6";

/// How often a read running on its own thread is looked for.
const READ_POLL: Duration = Duration::from_millis(50);
/// Rounds of a refresh read: the first reads every table, each other the
/// tables the round before could not take (made or removed while read,
/// or a read that failed).
const MAX_ROUNDS: u32 = 4;
/// Refreshes in a row that may leave a table unread before one reads it
/// in the apply.
const MAX_MISSED: u32 = 3;

/// The kernel side: commits and reads. [`NetlinkKernel`] in the daemon.
pub trait NftKernel: Send + std::fmt::Debug {
    fn commit(&mut self, ops: &[Op]) -> Result<(), NftError>;
    /// Our tables (named `<chain_prefix>…`) of `family`, and what their
    /// sets hold.
    fn read(
        &mut self,
        family: Family,
        chain_prefix: &str,
    ) -> Result<(Observed, Contents), NftError>;
    /// A reader of single tables, to run on another thread while commits
    /// go on (None: reads block the apply).
    fn reader(&self) -> Option<Box<dyn TableReader>> {
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
        read_all(&mut self.writer, family, chain_prefix)
    }

    fn reader(&self) -> Option<Box<dyn TableReader>> {
        Some(Box::new(SharedReader(Arc::clone(&self.reader))))
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
        read_all(self, family, chain_prefix)
    }
}

/// Table `name` as `listing` found it: read (its chains taken from the
/// listing; not the elements of the sets in `unread`), or `None` if the
/// listing did not find it; with the number of the last commit before
/// the listing.
fn read_listed(
    reader: &mut dyn TableReader,
    family: Family,
    name: &str,
    listing: &mut Listing,
    unread: &HashSet<String>,
) -> Result<(u64, TableRead), NftError> {
    if !listing.tables.iter().any(|t| t == name) {
        return Ok((listing.began, None));
    }
    let chains = listing.chains.remove(name).unwrap_or_default();
    let read = reader.read_table(family, name, chains, unread)?;
    Ok((listing.began, Some(read)))
}

/// The IP sets of `sets` a read of them (`contents`) found holding
/// another number of elements than they have members (those with members
/// not written yet aside): changed by hand, or missing a member (a count
/// that matches may still hide a swap, which the plan puts right in the
/// copy read; the other copies in turn).
fn changed_sets<'a>(
    contents: &'a Contents,
    sets: &'a DesiredSets,
) -> impl Iterator<Item = String> + 'a {
    contents.sets.iter().filter_map(|((_, s), c)| {
        if sets.changes.contains_key(s) {
            return None; // members not written yet: no count to compare
        }
        let d = sets.sets.get(s)?;
        match c {
            super::plan::Content::Keys(have) if have.len() != d.members.len() => Some(s.clone()),
            _ => None,
        }
    })
}

/// A table's read as it came back from the refresh's thread.
struct Found {
    name: String,
    read: Result<(u64, TableRead), NftError>,
}

/// The refresh read under way: one round of it.
struct Refreshing {
    job: BackgroundRead<()>,
    /// The tables read so far and not yet taken in.
    found: Arc<Mutex<Vec<Found>>>,
    round: u32,
    /// Tables to read again in the next round.
    again: Vec<String>,
    /// Per table, the IP sets whose elements this refresh does not read.
    unread: Arc<HashMap<String, HashSet<String>>>,
    /// IP sets a copy of which was read holding another number of
    /// elements than the set has members.
    changed_sets: HashSet<String>,
}

impl std::fmt::Debug for Refreshing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Refreshing")
            .field("round", &self.round)
            .field("again", &self.again)
            .finish_non_exhaustive()
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
    /// The refresh read running on its own thread.
    refresh: Option<Refreshing>,
    /// Numbers the commits; the refresh reads run between two.
    gate: Arc<Gate>,
    /// While a refresh reads: per table, each object a commit touched,
    /// and the number of the last that did.
    touched: HashMap<String, HashMap<Object, u64>>,
    /// Tables the refreshes left unread, and how many in a row.
    missed: HashMap<String, u32>,
    /// Refreshes begun: which copy of each IP set the next one reads.
    refreshes: u64,
    /// The first read's shard placement taken over.
    adopted: bool,
    /// Reads of all our tables made in the apply.
    reads_in_apply: u64,
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
        .map(|(name, t)| (name.clone(), count_table(t)))
        .collect()
}

/// (chains, rules, sets) of one table.
fn count_table(t: &ObservedTable) -> (usize, usize, usize) {
    let rules = t.chains.values().map(|c| c.comments.len()).sum();
    (t.chains.len(), rules, t.sets.len())
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
            filter: Filter::new(version, own.clone(), layout),
            sets: DesiredSets::new(version, names),
            own,
            kernel,
            observed: None,
            contents: None,
            refresh_due: false,
            refresh: None,
            gate: Arc::default(),
            touched: HashMap::new(),
            missed: HashMap::new(),
            refreshes: 0,
            adopted: false,
            reads_in_apply: 0,
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
        self.refresh.is_some()
    }

    /// Starts the refresh read: on its own thread where the kernel allows
    /// and there is something to compare it with; else in this apply.
    /// Tables the refreshes before left unread [`MAX_MISSED`] times are
    /// read here, in the apply.
    fn start_read(&mut self) {
        if self.refresh.is_some() {
            return; // one at a time
        }
        let reader = self.observed.as_ref().and_then(|_| self.kernel.reader());
        let Some(mut reader) = reader else {
            self.observed = None;
            return;
        };
        let mut due: Vec<String> = self
            .missed
            .iter()
            .filter(|(_, n)| **n >= MAX_MISSED)
            .map(|(t, _)| t.clone())
            .collect();
        let mut listing = Listing::default();
        if !due.is_empty() {
            match reader.list(self.family(), &self.own.chain_prefix, &self.gate) {
                Ok(l) => listing = l,
                Err(e) => {
                    warn!(error = %e, "listing our tables failed");
                    due.clear();
                }
            }
        }
        for name in &due {
            // No commit runs meanwhile: the read is taken as it is.
            match read_listed(
                &mut *reader,
                self.family(),
                name,
                &mut listing,
                &HashSet::new(),
            ) {
                Ok((_, read)) => {
                    info!(table = %name, "table refreshes left unread read in the apply");
                    self.missed.remove(name);
                    self.take_table(name.clone(), read);
                }
                Err(e) => warn!(table = %name, error = %e, "table read failed"),
            }
        }
        if !due.is_empty() {
            self.held_sets = held(self.observed.as_ref().expect("checked"), &self.sets);
        }
        let known: Vec<String> = self
            .observed
            .iter()
            .flat_map(|o| o.keys())
            .filter(|t| !due.contains(t))
            .cloned()
            .collect();
        let unread = Arc::new(self.unread_copies());
        self.refreshes += 1;
        debug!(backend = self.name(), "refresh read started");
        self.spawn_round(1, reader, known, Some(due), unread);
    }

    /// Round `round` of the refresh read: tables `names` (and, with
    /// `all_but`, every other table of ours but those) read on a thread
    /// of its own, each handed over as it is done.
    fn spawn_round(
        &mut self,
        round: u32,
        mut reader: Box<dyn TableReader>,
        mut names: Vec<String>,
        all_but: Option<Vec<String>>,
        unread: Arc<HashMap<String, HashSet<String>>>,
    ) {
        let found: Arc<Mutex<Vec<Found>>> = Arc::default();
        let (family, prefix, gate) = (
            self.family(),
            self.own.chain_prefix.clone(),
            Arc::clone(&self.gate),
        );
        let backend = self.name();
        let out = Arc::clone(&found);
        let skip = Arc::clone(&unread);
        self.touched.clear();
        let job = BackgroundRead::spawn(0, move || {
            let mut listing = reader
                .list(family, &prefix, &gate)
                .map_err(|source| BackendError::Nftables { backend, source })?;
            if let Some(skip) = all_but {
                for t in &listing.tables {
                    if !names.contains(t) && !skip.contains(t) {
                        names.push(t.clone());
                    }
                }
            }
            let none = HashSet::new();
            for name in names {
                let unread = skip.get(&name).unwrap_or(&none);
                let read = read_listed(&mut *reader, family, &name, &mut listing, unread);
                out.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(Found { name, read });
            }
            Ok(())
        });
        self.refresh = Some(Refreshing {
            job,
            found,
            round,
            again: Vec::new(),
            unread,
            changed_sets: HashSet::new(),
        });
    }

    /// Takes in the tables the refresh read has read so far: each that no
    /// commit touched since its read began (the next plan writes it whole
    /// against it: what was changed by hand is put back); the others are
    /// read again once the round is done.
    fn collect_reads(&mut self) {
        let Some(r) = self.refresh.as_mut() else {
            return;
        };
        // Finished first: what it found before it finished is all there.
        let finished = r.job.is_finished();
        let found = std::mem::take(&mut *r.found.lock().unwrap_or_else(PoisonError::into_inner));
        let mut took = Vec::new();
        for Found { name, read } in found {
            match read {
                Ok((began, read)) => {
                    let touched: Vec<&Object> = self
                        .touched
                        .get(&name)
                        .into_iter()
                        .flatten()
                        .filter(|(_, n)| **n > began)
                        .map(|(o, _)| o)
                        .collect();
                    let written = self.observed.as_ref().and_then(|o| o.get(&name));
                    match patch_read(&name, read, &touched, written) {
                        Some(read) => {
                            if !touched.is_empty() {
                                debug!(table = %name, objects = touched.len(), "taken with what commits touched meanwhile as written");
                            }
                            if let Some((_, contents)) = &read {
                                r.changed_sets.extend(changed_sets(contents, &self.sets));
                            }
                            took.push((name, read));
                        }
                        None => {
                            debug!(table = %name, round = r.round, "table made or removed while read: read again");
                            r.again.push(name);
                        }
                    }
                }
                Err(e) => {
                    debug!(table = %name, error = %e, "table read failed: read again");
                    r.again.push(name);
                }
            }
        }
        if self.observed.is_none() {
            took.clear(); // read in place anyway
        }
        if !took.is_empty() {
            debug!(tables = ?took.iter().map(|(n, _)| n).collect::<Vec<_>>(), "refresh read taken");
            for (name, read) in took {
                self.missed.remove(&name);
                self.take_table(name, read);
            }
            self.held_sets = held(self.observed.as_ref().expect("checked"), &self.sets);
        }
        if !finished {
            return;
        }
        let r = self.refresh.take().expect("checked above");
        let (round, mut again, mut unread) = (r.round, r.again, r.unread);
        if !r.changed_sets.is_empty() {
            // A copy read found changed (by hand, most likely all of them):
            // the others are read in the next round, not in turn.
            let mut rest = (*unread).clone();
            for (table, sets) in rest.iter_mut() {
                let before = sets.len();
                sets.retain(|s| !r.changed_sets.contains(s));
                if sets.len() != before && !again.contains(table) {
                    again.push(table.clone());
                }
            }
            debug!(sets = ?r.changed_sets, "set copies found changed: the others read now");
            unread = Arc::new(rest);
        }
        if let Err(e) = r.job.join(self.name()) {
            // Our tables could not be listed: the round is made again.
            warn!(error = %e, "refresh read failed");
            again = self
                .observed
                .iter()
                .flat_map(|o| o.keys())
                .cloned()
                .collect();
        }
        if again.is_empty() {
            debug!(rounds = round, "refresh read done");
            return;
        }
        match self.kernel.reader() {
            Some(reader) if round < MAX_ROUNDS && self.observed.is_some() => {
                self.spawn_round(round + 1, reader, again, None, unread);
            }
            _ => {
                for t in &again {
                    *self.missed.entry(t.clone()).or_default() += 1;
                }
                info!(tables = ?again, rounds = round, "tables left unread to the next refresh");
            }
        }
    }

    /// Per table, the IP sets whose elements the next refresh does not
    /// read: a set several tables hold (the shards' copies) has the
    /// elements of one copy read each refresh, each copy in turn. Reading
    /// the elements is most of a refresh (at a million members, 3.5
    /// million elements in 3,535 sets for 1,000; ~2.5 s of a core, nearly
    /// all of it the kernel's); this way every set is looked at on every
    /// refresh and every copy within as many refreshes as it has copies.
    fn unread_copies(&self) -> HashMap<String, HashSet<String>> {
        let mut unread: HashMap<String, HashSet<String>> = HashMap::new();
        let Some(observed) = self.observed.as_ref() else {
            return unread;
        };
        for set in self.sets.sets.keys() {
            let holders: Vec<&String> = observed
                .iter()
                .filter(|(_, t)| t.sets.contains_key(set))
                .map(|(name, _)| name)
                .collect();
            if holders.len() < 2 {
                continue;
            }
            let read = (self.refreshes % holders.len() as u64) as usize;
            for (i, t) in holders.into_iter().enumerate() {
                if i != read {
                    unread.entry(t.clone()).or_default().insert(set.clone());
                }
            }
        }
        unread
    }

    /// Takes table `name` as read: what it holds, and its sets' contents
    /// for the next plan (which writes it whole against them).
    fn take_table(&mut self, name: String, read: TableRead) {
        let Some(observed) = self.observed.as_mut() else {
            return;
        };
        let contents = self.contents.get_or_insert_with(Contents::new);
        contents.tables.insert(name.clone());
        match read {
            Some((table, sets)) => {
                contents.extend(sets);
                self.counts.set(name.clone(), Some(count_table(&table)));
                observed.insert(name, table);
            }
            None => {
                self.counts.set(name.clone(), None);
                observed.remove(&name);
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

    /// Reads of all our tables made in the apply (at start, after a
    /// refused commit, or when a set to write whole was not read), since
    /// start. The refresh reads beside the applies.
    pub fn reads_in_apply(&self) -> u64 {
        self.reads_in_apply
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

    /// Notes the tables commit `number` (`ops`) touched, for the refresh
    /// read under way.
    fn log_touched(&mut self, number: u64, ops: &[Op]) {
        let mut last: Option<(&str, Object)> = None;
        for op in ops {
            let (table, object) = (op.table(), Object::of(op));
            if last
                .as_ref()
                .is_some_and(|(t, o)| *t == table && *o == object)
            {
                continue; // a chain's rules, one after another
            }
            self.touched
                .entry(table.to_string())
                .or_default()
                .insert(object.clone(), number);
            last = Some((table, object));
        }
    }

    fn read(&mut self) -> Result<(), BackendError> {
        let started = Instant::now();
        self.reads_in_apply += 1;
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
            || self.refresh.as_ref().is_some_and(|r| {
                r.job.is_finished()
                    || !r
                        .found
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .is_empty()
            })
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if matches!(refresh, Refresh::Iptables | Refresh::IpSets) {
            self.refresh_due = true;
        }
    }

    fn wake_after(&self) -> Option<Duration> {
        self.refresh.as_ref().map(|_| READ_POLL)
    }

    #[instrument(skip_all, fields(backend = self.name()))]
    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        self.collect_reads();
        if std::mem::take(&mut self.refresh_due) {
            self.start_read();
        }
        let mut read_whole = false;
        if self.observed.is_none() {
            self.read()?;
            read_whole = true;
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
        // A refused commit whose change belongs to one object's chain
        // holds that chain fail-closed and plans again (nothing of a
        // refused commit applied): at most this many a time.
        let mut isolated = 0;
        let (p, committed, started) = 'isolate: loop {
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
                    // A set to write whole whose table was not read: read
                    // them all.
                    Err(PlanError::NeedRead { .. }) if !read_whole => {
                        self.read()?;
                        read_whole = true;
                    }
                    Err(e) => {
                        return Err(BackendError::Inconsistent {
                            backend: self.name(),
                            reason: e.to_string(),
                        });
                    }
                }
            };
            debug!(
                elapsed = ?planning.elapsed(),
                whole = ?p.whole_tables().collect::<Vec<_>>(),
                tables = p.tables.len(),
                set_changes = self.sets.changes.len(),
                "planned"
            );
            let started = Instant::now();
            let n = p.ops.len();
            let committed = if n > 0 {
                let (number, committed) = self.gate.commit(|| self.kernel.commit(&p.ops));
                if self.refresh.is_some() {
                    self.log_touched(number, &p.ops);
                }
                committed
            } else {
                Ok(())
            };
            if let Err(NftError::Refused {
                index: Some(i),
                op,
                source,
            }) = &committed
                && isolated < MAX_ISOLATED_PER_APPLY
                && p.ops
                    .get(*i)
                    .is_some_and(|o| self.isolate(o, format!("nf_tables refused {op}: {source}")))
            {
                isolated += 1;
                continue 'isolate;
            }
            break (p, committed, started);
        };
        let n = p.ops.len();
        let whole = p.any_whole();
        if let Err(e) = committed {
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
        let mut out = Vec::new();
        for t in self.chain_tables() {
            for (chain, (_, why)) in &t.quarantined {
                out.push((
                    format!(
                        "{}{}.{}.{chain}",
                        crate::status::ISOLATED,
                        self.name(),
                        super::plan::table_name(&self.own.chain_prefix, t.table())
                    ),
                    format!(
                        "{why} (fail-closed: the chain drops everything until its rules change)"
                    ),
                ));
            }
        }
        if self.observed.is_some() {
            out.extend(self.counts.lines.iter().cloned());
        }
        out
    }
}

/// Most chains one apply holds fail-closed before it gives up and fails.
const MAX_ISOLATED_PER_APPLY: usize = 16;

impl Dataplane {
    /// Holds the chain change `op` wrote fail-closed, if it is one that
    /// holds one object's rules alone ([`crate::rules::isolatable`]): a
    /// policy's, profile's or workload's. False otherwise (a top-level
    /// chain, a set, a table: the commit fails as before).
    fn isolate(&mut self, op: &Op, why: String) -> bool {
        let (table, chain) = match op {
            Op::AddRule { table, chain, .. }
            | Op::AddChain { table, chain, .. }
            | Op::FlushChain { table, chain, .. }
            | Op::DeleteRule { table, chain, .. } => (table, chain),
            _ => return false,
        };
        if !crate::rules::isolatable(&self.own.chain_prefix, chain) {
            return false;
        }
        let prefix = self.own.chain_prefix.clone();
        self.tables
            .iter_mut()
            .chain(self.filter.tables_mut())
            .find(|t| super::plan::table_name(&prefix, t.table()) == *table)
            .is_some_and(|t| t.quarantine(chain, why))
    }

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

    use super::super::ops::Key;
    use super::super::plan::Content;
    use super::*;
    use crate::backends::ipsets::Meta;
    use crate::generictables::Rule;
    use crate::model::ipsets::{IpSetType, Member};

    /// Commits are recorded (what the kernel holds is set by the test);
    /// each table the refresh reads on another thread is read when the
    /// test lets it go, as the kernel holds it then.
    #[derive(Debug)]
    struct Fake {
        commits: Arc<Mutex<Vec<Vec<Op>>>>,
        /// Commits still to refuse.
        refuse: Arc<Mutex<u32>>,
        held: Arc<Mutex<(Observed, Contents)>>,
        go: Arc<Mutex<mpsc::Receiver<()>>>,
        /// How many table reads have begun.
        begun: Arc<Mutex<usize>>,
        /// Reads of filter still to fail.
        fail: Arc<Mutex<u32>>,
    }

    impl NftKernel for Fake {
        fn commit(&mut self, ops: &[Op]) -> Result<(), NftError> {
            let mut refuse = self.refuse.lock().unwrap();
            if *refuse > 0 {
                *refuse -= 1;
                return Err(NftError::Refused {
                    op: "a rule".into(),
                    index: None,
                    source: std::io::Error::from_raw_os_error(12),
                });
            }
            self.commits.lock().unwrap().push(ops.to_vec());
            Ok(())
        }
        fn read(&mut self, _: Family, _: &str) -> Result<(Observed, Contents), NftError> {
            Ok(self.held.lock().unwrap().clone())
        }
        fn reader(&self) -> Option<Box<dyn TableReader>> {
            Some(Box::new(FakeReader {
                held: Arc::clone(&self.held),
                go: Arc::clone(&self.go),
                begun: Arc::clone(&self.begun),
                fail: Arc::clone(&self.fail),
            }))
        }
    }

    struct FakeReader {
        held: Arc<Mutex<(Observed, Contents)>>,
        go: Arc<Mutex<mpsc::Receiver<()>>>,
        begun: Arc<Mutex<usize>>,
        fail: Arc<Mutex<u32>>,
    }

    impl TableReader for FakeReader {
        fn list(&mut self, _: Family, _: &str, gate: &Gate) -> Result<Listing, NftError> {
            let tables = self.held.lock().unwrap().0.keys().cloned().collect();
            Ok(Listing {
                began: gate.last(),
                tables,
                chains: Default::default(),
            })
        }
        fn read_table(
            &mut self,
            _: Family,
            name: &str,
            _: Vec<super::super::ops::ChainInfo>,
            unread: &HashSet<String>,
        ) -> Result<(ObservedTable, Contents), NftError> {
            let mut fail = self.fail.lock().unwrap();
            if name == "dph-filter" && *fail > 0 {
                *fail -= 1;
                return Err(NftError::Interrupted { tries: 5 });
            }
            drop(fail);
            *self.begun.lock().unwrap() += 1;
            self.go.lock().unwrap().recv().expect("a go");
            let (observed, contents) = &*self.held.lock().unwrap();
            let sets = contents
                .sets
                .iter()
                .filter(|((table, set), _)| table == name && !unread.contains(set))
                .map(|(k, c)| (k.clone(), c.clone()));
            let mut c: Contents = sets.collect();
            c.tables.insert(name.to_string());
            Ok((observed.get(name).cloned().unwrap_or_default(), c))
        }
    }

    /// Waits for the round of the refresh read to finish.
    fn finish(d: &Dataplane) {
        let until = Instant::now() + Duration::from_secs(5);
        while !d.refresh.as_ref().is_some_and(|r| r.job.is_finished()) {
            assert!(Instant::now() < until, "the read never finished");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits until `n` table reads have begun (their commit number taken).
    fn begun(fake: &Arc<Mutex<usize>>, n: usize) {
        let until = Instant::now() + Duration::from_secs(5);
        while *fake.lock().unwrap() < n {
            assert!(Instant::now() < until, "no table read began");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits until the refresh read has handed over a table.
    fn handed_over(d: &Dataplane) {
        let until = Instant::now() + Duration::from_secs(5);
        while !d.is_dirty(Phase::Tables) {
            assert!(Instant::now() < until, "no table read came back");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The tables each commit since the `from`th touched.
    fn tables_of(commits: &Mutex<Vec<Vec<Op>>>, from: usize) -> Vec<Vec<String>> {
        commits.lock().unwrap()[from..]
            .iter()
            .map(|ops| {
                let mut t: Vec<String> = ops.iter().map(|o| o.table().to_string()).collect();
                t.dedup();
                t
            })
            .collect()
    }

    /// filter (a chain looking up dph40s) and nat (masquerade), written
    /// once; the kernel then holds what was written.
    fn two_tables(fake: Fake) -> Dataplane {
        two_tables_with(fake, "-j MASQUERADE")
    }

    /// [`two_tables`] with nat's chain holding `nat_rule`.
    fn two_tables_with(fake: Fake, nat_rule: &str) -> Dataplane {
        let held = Arc::clone(&fake.held);
        let mut d = Dataplane::new(
            IpVersion::V4,
            "dph",
            SetNames::new("dph").unwrap(),
            ShardLayout::default(),
            Box::new(fake),
        );
        let r = |s: &str| Rule::parse(s).unwrap();
        d.filter
            .set_chain("dph-a", vec![r("-m set --match-set dph40s src -j DROP")])
            .unwrap();
        d.filter.set_hooks("FORWARD", vec![r("-j dph-a")]).unwrap();
        let nat = d.tables.iter_mut().find(|t| t.table() == "nat").unwrap();
        nat.set_chain("dph-nat", vec![r(nat_rule)]).unwrap();
        nat.set_hooks("POSTROUTING", vec![r("-j dph-nat")]).unwrap();
        let meta = Meta {
            set_type: IpSetType::Ip,
            maxelem: 10,
        };
        d.sets
            .replace("dph40s".into(), meta, [ip("10.0.0.1")].into());
        d.apply(Phase::Tables).unwrap();
        let written = d.observed.clone().unwrap();
        assert_eq!(
            written.keys().collect::<Vec<_>>(),
            ["dph-filter", "dph-nat"]
        );
        let one = || Content::Keys([Key::Addr("10.0.0.1".parse().unwrap())].into());
        let contents: Contents = written
            .iter()
            .filter(|(_, t)| t.sets.contains_key("dph40s"))
            .map(|(name, _)| ((name.clone(), "dph40s".to_string()), one()))
            .collect();
        *held.lock().unwrap() = (written, contents);
        d
    }

    fn ip(s: &str) -> Member {
        Member::Ip(s.parse().unwrap())
    }

    /// A member of dph40s added and written.
    fn member(d: &mut Dataplane, a: &str) {
        d.sets
            .delta("dph40s", &mut [ip(a)].into_iter(), &mut std::iter::empty());
        d.apply(Phase::Tables).unwrap();
    }

    fn fake(commits: &Arc<Mutex<Vec<Vec<Op>>>>) -> (Fake, mpsc::Sender<()>) {
        let (tx, rx) = mpsc::channel();
        let fake = Fake {
            commits: Arc::clone(commits),
            refuse: Arc::default(),
            held: Arc::default(),
            go: Arc::new(Mutex::new(rx)),
            begun: Arc::default(),
            fail: Arc::default(),
        };
        (fake, tx)
    }

    /// A refresh read does not hold up the applies, and reads table by
    /// table; each table is taken as it comes in and what was changed by
    /// hand in it put back, by a commit of that table alone, except in
    /// what a commit touched while it was read (a set a member went
    /// into), which is taken as written and looked at again by the next
    /// refresh.
    #[test]
    fn refresh_reads_run_beside_the_applies_table_by_table() {
        let commits = Arc::default();
        let (fake, go) = fake(&commits);
        let (held, reads) = (Arc::clone(&fake.held), Arc::clone(&fake.begun));
        let mut d = two_tables(fake);
        assert_eq!(
            commits.lock().unwrap().len(),
            1,
            "the first apply writes it all"
        );
        let written = d.observed.clone().unwrap();
        let ops_of = |i: usize| -> Vec<String> {
            commits.lock().unwrap()[i]
                .iter()
                .map(super::super::ops::describe)
                .collect()
        };

        // The refresh: the read starts and the apply returns at once.
        d.request_resync(Refresh::Iptables);
        assert!(d.is_dirty(Phase::Tables));
        d.apply(Phase::Tables).unwrap();
        assert!(d.reading() && d.wake_after() == Some(READ_POLL));
        assert!(
            !d.is_dirty(Phase::Tables),
            "nothing to do until a table is read"
        );

        // Both tables' chains emptied by hand.
        {
            let (observed, _) = &mut *held.lock().unwrap();
            for (t, c) in [("dph-filter", "dph-a"), ("dph-nat", "dph-nat")] {
                let chain = observed.get_mut(t).unwrap().chains.get_mut(c).unwrap();
                chain.comments = Vec::new().into();
            }
        }
        // filter is being read (the reader waits for a go): a member
        // meanwhile is written at once (the read, which will not hold it,
        // may have seen half of that commit).
        begun(&reads, 1);
        member(&mut d, "10.0.0.2");
        assert_eq!(tables_of(&commits, 1), [["dph-filter"]]);
        go.send(()).unwrap();
        handed_over(&d);
        d.apply(Phase::Tables).unwrap();
        // filter is taken: its chain put back; its set, which the member
        // touched, taken as written (not emptied of the member).
        assert_eq!(tables_of(&commits, 2), [["dph-filter"]]);
        let ops = ops_of(2);
        assert!(
            ops.contains(&"flushing chain dph-filter/dph-a".to_string()),
            "{ops:?}"
        );
        assert!(!ops.iter().any(|o| o.contains("dph40s")), "{ops:?}");

        // nat, read with no commit beside it, is taken and put back too;
        // the refresh is done in one round.
        begun(&reads, 2);
        go.send(()).unwrap();
        finish(&d);
        d.apply(Phase::Tables).unwrap();
        assert_eq!(tables_of(&commits, 3), [["dph-nat"]]);
        assert!(!d.reading(), "done");
        assert_eq!(d.observed.as_ref().unwrap(), &written);
        assert!(d.missed.is_empty());

        // The next refresh, with no commit beside it, looks at the set
        // again: the kernel lacks the member, which is put back.
        {
            let (observed, _) = &mut *held.lock().unwrap();
            *observed = written.clone();
        }
        d.request_resync(Refresh::IpSets);
        d.apply(Phase::Tables).unwrap();
        go.send(()).unwrap();
        go.send(()).unwrap();
        finish(&d);
        d.apply(Phase::Tables).unwrap();
        assert!(!d.reading());
        assert_eq!(ops_of(4), ["adding 1 elements to dph-filter/dph40s"]);
        assert_eq!(commits.lock().unwrap().len(), 5);
    }

    /// A set two tables hold has the elements of one copy read each
    /// refresh, each copy in turn: a member swapped for another in both
    /// copies is put right in one, then in the other. A copy read holding
    /// another number of elements (the set flushed by hand) has the other
    /// read in the same refresh: both are refilled at once.
    #[test]
    fn each_refresh_reads_one_copy_of_a_set_in_turn() {
        let commits = Arc::default();
        let (fake, go) = fake(&commits);
        let held = Arc::clone(&fake.held);
        let mut d = two_tables_with(fake, "-m set --match-set dph40s src -j MASQUERADE");
        let both = |c: &Content| {
            let (_, contents) = &mut *held.lock().unwrap();
            assert_eq!(contents.sets.len(), 2, "both tables hold the set");
            for v in contents.sets.values_mut() {
                *v = c.clone();
            }
        };
        // A refresh: the ops of the commits it made.
        let refresh = |d: &mut Dataplane, reads: usize| {
            let before = commits.lock().unwrap().len();
            d.request_resync(Refresh::IpSets);
            d.apply(Phase::Tables).unwrap();
            for _ in 0..reads {
                go.send(()).unwrap();
            }
            while d.reading() {
                finish(d);
                d.apply(Phase::Tables).unwrap();
            }
            let mut ops: Vec<String> = commits.lock().unwrap()[before..]
                .iter()
                .flatten()
                .map(super::super::ops::describe)
                .collect();
            ops.sort();
            ops
        };
        both(&Content::Keys(
            [Key::Addr("10.9.9.9".parse().unwrap())].into(),
        ));
        let first = refresh(&mut d, 2);
        let second = refresh(&mut d, 2);
        let mut swapped = [first.clone(), second.clone()].concat();
        swapped.sort();
        assert_eq!(first.len(), 2, "one copy put right: {first:?}");
        assert_eq!(
            swapped,
            [
                "adding 1 elements to dph-filter/dph40s",
                "adding 1 elements to dph-nat/dph40s",
                "removing 1 elements from dph-filter/dph40s",
                "removing 1 elements from dph-nat/dph40s",
            ]
        );

        // Flushed: the copy read is empty, and the other is read at once
        // (a second round: one table read more).
        both(&Content::Keys(HashSet::new()));
        assert_eq!(
            refresh(&mut d, 3),
            [
                "adding 1 elements to dph-filter/dph40s",
                "adding 1 elements to dph-nat/dph40s",
            ]
        );
    }

    /// A table whose read fails in every round of a refresh is left to
    /// the next refresh; after [`MAX_MISSED`] refreshes in a row it is
    /// read in the apply (and what was changed in it put back).
    #[test]
    fn a_table_refreshes_leave_unread_is_read_in_the_apply_at_last() {
        let commits = Arc::default();
        let (fake, go) = fake(&commits);
        let held = Arc::clone(&fake.held);
        *fake.fail.lock().unwrap() = MAX_MISSED * MAX_ROUNDS;
        let mut d = two_tables(fake);
        {
            let (observed, _) = &mut *held.lock().unwrap();
            let chain = observed
                .get_mut("dph-filter")
                .unwrap()
                .chains
                .get_mut("dph-a")
                .unwrap();
            chain.comments = Vec::new().into();
        }
        for refresh in 1..=MAX_MISSED {
            d.request_resync(Refresh::IpSets);
            d.apply(Phase::Tables).unwrap();
            for round in 1..=MAX_ROUNDS {
                // filter's read fails at once; in the first round nat is
                // read after it.
                if round == 1 {
                    go.send(()).unwrap();
                }
                finish(&d);
                d.apply(Phase::Tables).unwrap();
            }
            assert!(!d.reading());
            assert_eq!(d.missed.get("dph-filter"), Some(&refresh), "left");
            assert!(!d.missed.contains_key("dph-nat"));
        }
        assert_eq!(commits.lock().unwrap().len(), 1, "nothing written");
        // The next refresh reads filter in the apply (the reader goes at
        // once) and puts its chain back; the round on the thread reads nat.
        go.send(()).unwrap();
        d.request_resync(Refresh::IpSets);
        d.apply(Phase::Tables).unwrap();
        assert_eq!(tables_of(&commits, 1), [["dph-filter"]]);
        assert!(d.missed.is_empty());
        go.send(()).unwrap();
        finish(&d);
        d.apply(Phase::Tables).unwrap();
        assert!(!d.reading());
        assert_eq!(commits.lock().unwrap().len(), 2, "nat was as written");
    }

    /// An IPv4 dataplane over a [`Fake`] that records its commits in
    /// `commits` and refuses the first `refuse`; the sender lets its
    /// detached reads go.
    fn unsharded(commits: Arc<Mutex<Vec<Vec<Op>>>>, refuse: u32) -> (Dataplane, mpsc::Sender<()>) {
        let (mut fake, tx) = fake(&commits);
        fake.refuse = Arc::new(Mutex::new(refuse));
        let d = Dataplane::new(
            IpVersion::V4,
            "dph",
            SetNames::new("dph").unwrap(),
            ShardLayout::default(),
            Box::new(fake),
        );
        (d, tx)
    }

    /// A kernel that refuses every commit that writes a rule other than
    /// a plain drop into one chain (as one would a rule with an
    /// expression it lacks).
    #[derive(Debug)]
    struct RefusesChain {
        chain: String,
        commits: Arc<Mutex<Vec<Vec<Op>>>>,
    }

    impl NftKernel for RefusesChain {
        fn commit(&mut self, ops: &[Op]) -> Result<(), NftError> {
            let drop =
                crate::generictables::rule_hashes(&self.chain, &[Rule::parse("-j DROP").unwrap()]);
            let drop = format!("dph:{}", drop[0].as_str());
            if let Some(i) = ops.iter().position(|o| {
                matches!(o, Op::AddRule { chain, comment, .. }
                    if *chain == self.chain && *comment != drop)
            }) {
                return Err(NftError::Refused {
                    op: super::super::ops::describe(&ops[i]),
                    index: Some(i),
                    source: std::io::Error::from_raw_os_error(22),
                });
            }
            self.commits.lock().unwrap().push(ops.to_vec());
            Ok(())
        }
        fn read(&mut self, _: Family, _: &str) -> Result<(Observed, Contents), NftError> {
            Ok(Default::default())
        }
    }

    /// A commit refused for a rule of one policy's chain holds that chain
    /// fail-closed (a single drop) and commits the rest in the same
    /// apply; reported until its rules change. A refused rule of a
    /// top-level chain fails the apply as before.
    #[test]
    fn a_chain_the_kernel_refuses_is_held_fail_closed_and_the_rest_committed() {
        let commits = Arc::new(Mutex::new(Vec::new()));
        let mut d = Dataplane::new(
            IpVersion::V4,
            "dph",
            SetNames::new("dph").unwrap(),
            ShardLayout::default(),
            Box::new(RefusesChain {
                chain: "dph-pi-bad".into(),
                commits: Arc::clone(&commits),
            }),
        );
        let r = |s: &str| Rule::parse(s).unwrap();
        d.filter
            .set_chain("dph-pi-bad", vec![r("-p tcp -j ACCEPT")])
            .unwrap();
        d.filter
            .set_chain("dph-pi-good", vec![r("-p udp -j ACCEPT")])
            .unwrap();
        d.filter
            .set_hooks("FORWARD", vec![r("-j dph-pi-good"), r("-j dph-pi-bad")])
            .unwrap();
        d.apply(Phase::Tables).unwrap();
        assert_eq!(d.commits(), 1);
        let committed = commits.lock().unwrap().concat();
        let rules_of = |chain: &str| {
            committed
                .iter()
                .filter(|o| matches!(o, Op::AddRule { chain: c, .. } if c == chain))
                .count()
        };
        assert_eq!(rules_of("dph-pi-good"), 1);
        // Held: a single rule (the drop; the kernel took it).
        assert_eq!(rules_of("dph-pi-bad"), 1);
        let st: std::collections::BTreeMap<String, String> = d.status().into_iter().collect();
        let key = "isolated.nftables-v4.dph-filter.dph-pi-bad";
        assert!(
            st.get(key).is_some_and(|w| w.contains("fail-closed")),
            "{st:?}"
        );
        // What the managers set is what they see; setting it again
        // changes nothing.
        assert_eq!(
            d.filter.chain("dph-pi-bad").unwrap()[0].text(),
            "-p tcp -j ACCEPT"
        );
        d.filter
            .set_chain("dph-pi-bad", vec![r("-p tcp -j ACCEPT")])
            .unwrap();
        assert!(!d.is_dirty(Phase::Tables));
        // Rules that change lift it.
        d.filter
            .set_chain("dph-pi-bad", vec![r("-p sctp -j ACCEPT")])
            .unwrap();
        let e = d.apply(Phase::Tables);
        // (Still refused: this kernel refuses any rule there; held again.)
        assert!(e.is_ok(), "{e:?}");
        assert!(d.status().iter().any(|(k, _)| k == key));
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
        let (fake, _go) = fake(&Arc::default());
        let mut d = Dataplane::new(
            IpVersion::V4,
            "dph",
            SetNames::new("dph").unwrap(),
            ShardLayout {
                marks: crate::model::Marks::default(),
                shards: 2,
                per_shard: 0,
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
