//! IP sets, one backend object per IP family.
//!
//! Owns the kernel IP sets named `<prefix>40…`/`<prefix>4t…` (IPv4) or
//! `<prefix>60…`/`<prefix>6t…` (IPv6) in the daemon's network namespace, and
//! nothing else: other sets are never read into our state, written or
//! destroyed.
//!
//! The object holds what the kernel has (read with `ipset save`, then kept
//! up to date after each write) and the changes the manager queued. An apply
//! writes one `ipset restore -exist` script with the minimal lines: `create`
//! for new sets (with `hashsize` sized from the member count), `add`/`del`
//! for the members that differ, and for a set whose type or `maxelem`
//! changed a temporary set filled and `swap`ped in, so members never vanish
//! mid-update. Set deletions run in their own, last phase, after the
//! iptables tables stopped referencing the sets. A failed write drops what
//! we believed about the kernel: the next apply re-reads it and the manager
//! re-sends the whole desired state.

pub mod restore;
pub mod save;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;

use tracing::{debug, instrument};

pub use super::DetachedSave;
use super::{ApplyOutcome, Backend, BackendError, BackgroundRead, Phase, Refresh};
use crate::model::IpVersion;
use crate::model::ipsets::{IpSetType, Member, SetNames};

/// What a set is, apart from its members. `hashsize` is not part of it: the
/// kernel grows a hash as needed, so a different one needs no rewrite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    pub set_type: IpSetType,
    pub maxelem: u32,
}

/// The seam to the kernel: plain text in, plain text out.
pub trait IpSetExec: Send + std::fmt::Debug {
    /// `ipset save` (all sets; we keep only ours).
    fn save(&mut self) -> Result<String, BackendError>;
    /// `ipset restore -exist` with `script` on stdin.
    fn restore(&mut self, script: &str) -> Result<(), BackendError>;
    /// A `save` that can run on another thread (None: reads happen in
    /// the apply).
    fn detached_save(&self) -> Option<DetachedSave> {
        None
    }
}

/// One of our sets as the kernel has it. `meta` is `None` for a set of a
/// type we do not program (someone else made it under our name): it is
/// replaced.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelSet {
    pub meta: Option<Meta>,
    pub members: HashSet<Member>,
}

#[derive(Debug)]
enum Pending {
    /// The whole set, as it must be.
    Replace(Meta, HashSet<Member>),
    /// Changes to a set the kernel already has.
    Delta {
        add: HashSet<Member>,
        del: HashSet<Member>,
    },
}

/// The IP sets of one family.
#[derive(Debug)]
pub struct IpSets {
    version: IpVersion,
    names: SetNames,
    exec: Box<dyn IpSetExec>,
    /// Our sets as the kernel has them; `None` until read (or after a
    /// failure or a refresh tick).
    observed: Option<HashMap<String, KernelSet>>,
    /// Names that must exist, with their metadata.
    desired: HashMap<String, Meta>,
    pending: BTreeMap<String, Pending>,
    /// The manager must send every desired set again (at start, and after
    /// a failure or a resync).
    needs_full: bool,
    temp_seq: u64,
    /// The first read, started with the daemon ([`IpSets::prefetch`]).
    first_read: Option<BackgroundRead<String>>,
    /// A refresh read running beside the applies.
    check: Option<BackgroundRead<Differences>>,
    /// Restores attempted so far, and per set the count at its last write:
    /// what a refresh read says of a set written since it began is not
    /// trusted.
    writes: u64,
    written_at: HashMap<String, u64>,
}

/// Our sets whose kernel state differs from what we believed when a
/// refresh read began: as read, or None where the set is gone.
type Differences = Vec<(String, Option<KernelSet>)>;

/// `hashsize` for `n` members: the next power of two above `n`, at least
/// 1024 (the kernel's default), so a big set is created at its size instead
/// of being rehashed again and again while it fills.
pub fn hashsize(n: usize) -> usize {
    (n + 1).next_power_of_two().max(1024)
}

/// A member as `ipset save` prints it (a `hash:net` host entry has no
/// `/32` or `/128`), written without an allocation.
#[derive(Debug, Clone, Copy)]
pub struct MemberText<'a>(pub &'a Member);

impl std::fmt::Display for MemberText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Member::Net(n) if n.prefix_len() == n.max_prefix_len() => write!(f, "{}", n.addr()),
            m => write!(f, "{m}"),
        }
    }
}

/// Whether the kernel can swap a set of type `a` with one of type `b`: only
/// sets of the same type ("The sets cannot be swapped: their type does not
/// match", even for `hash:ip` and `hash:net`; measured on 6.18).
fn swappable(a: IpSetType, b: IpSetType) -> bool {
    a == b
}

impl IpSets {
    pub fn new(version: IpVersion, names: SetNames, exec: Box<dyn IpSetExec>) -> Self {
        Self {
            version,
            names,
            exec,
            observed: None,
            desired: HashMap::new(),
            pending: BTreeMap::new(),
            needs_full: true,
            temp_seq: 0,
            first_read: None,
            check: None,
            writes: 0,
            written_at: HashMap::new(),
        }
    }

    /// The refresh: reads the kernel beside the applies where the tool
    /// allows (at 1,000,000 members `ipset save` and its parse took seconds,
    /// and re-sending the whole desired state more: an apply of 5 s every
    /// 90 s), and compares it with what we believe on that thread. Without
    /// a detached read, or without a belief, as before: read in the apply,
    /// and the manager sends everything again.
    fn start_check(&mut self) {
        if self.check.is_some() {
            return;
        }
        match (self.exec.detached_save(), &self.observed) {
            (Some(save), Some(observed)) => {
                debug!("IP-set refresh read started");
                let belief = observed.clone();
                let (names, version) = (self.names.clone(), self.version);
                let check = BackgroundRead::spawn(self.writes, move || {
                    let text = save()?;
                    let read = save::parse(&text, |n| names.owns(version, n)).map_err(|e| {
                        BackendError::Parse {
                            backend: "ipsets",
                            reason: e,
                        }
                    })?;
                    let mut out: Differences = belief
                        .keys()
                        .filter(|n| !read.contains_key(*n))
                        .map(|n| (n.clone(), None))
                        .collect();
                    for (name, set) in read {
                        if belief.get(&name) != Some(&set) {
                            out.push((name, Some(set)));
                        }
                    }
                    Ok(out)
                });
                self.check = Some(check);
            }
            _ => {
                self.observed = None;
                self.needs_full = true;
            }
        }
    }

    /// Takes a finished refresh read: each set that differs and that we
    /// have not written since the read began is put right from what we
    /// believe it holds (that is what we wrote, so the desired state),
    /// without the manager.
    fn collect_check(&mut self) -> Result<(), BackendError> {
        if !self.check.as_ref().is_some_and(BackgroundRead::is_finished) {
            return Ok(());
        }
        let check = self.check.take().expect("checked above");
        let began = check.writes;
        let diffs = check.join(self.name())?;
        let Some(observed) = self.observed.as_mut() else {
            // A failed write since: everything is read and re-sent anyway.
            return Ok(());
        };
        let mut repaired = 0;
        for (name, read) in diffs {
            // A set we wrote while the read ran may have been read before
            // or after our write: leave it to the next refresh. (A repair
            // would be harmless, since what we write comes from what we
            // believe and -exist makes it idempotent; this keeps `observed`
            // from taking a read that is older than our write.)
            if self.written_at.get(&name).is_some_and(|w| *w > began) {
                continue;
            }
            let believed = observed.remove(&name);
            if let Some(meta) = self.desired.get(&name).copied() {
                let mut want = believed.map(|b| b.members).unwrap_or_default();
                match self.pending.remove(&name) {
                    Some(Pending::Replace(m, members)) => {
                        self.pending
                            .insert(name.clone(), Pending::Replace(m, members));
                    }
                    Some(Pending::Delta { add, del }) => {
                        want.retain(|m| !del.contains(m));
                        want.extend(add);
                        self.pending
                            .insert(name.clone(), Pending::Replace(meta, want));
                    }
                    None => {
                        self.pending
                            .insert(name.clone(), Pending::Replace(meta, want));
                    }
                }
                repaired += 1;
            }
            if let Some(k) = read {
                observed.insert(name, k);
            }
        }
        debug!(repaired, "IP-set refresh read taken");
        Ok(())
    }

    /// Starts the first `ipset save` in the background, where the tool
    /// allows: at 1,000,000 members it takes seconds, which the daemon can
    /// spend receiving the calc graph's snapshot (nothing is applied before
    /// it is in sync) instead of in its first apply. Nothing is written
    /// before that read is taken, so it cannot go stale by our doing.
    pub fn prefetch(&mut self) {
        if self.observed.is_none()
            && self.first_read.is_none()
            && let Some(save) = self.exec.detached_save()
        {
            self.first_read = Some(BackgroundRead::spawn(0, save));
        }
    }

    pub fn version(&self) -> IpVersion {
        self.version
    }

    pub fn names(&self) -> &SetNames {
        &self.names
    }

    /// The manager must call [`start_full`](Self::start_full) and then
    /// [`replace`](Self::replace) every desired set.
    pub fn needs_full(&self) -> bool {
        self.needs_full
    }

    /// Forget the desired state; the manager sends all of it again.
    pub fn start_full(&mut self) {
        self.desired.clear();
        self.pending.clear();
        self.needs_full = false;
    }

    /// Set `name` must hold exactly `members`.
    pub fn replace(&mut self, name: String, meta: Meta, members: HashSet<Member>) {
        self.desired.insert(name.clone(), meta);
        self.pending.insert(name, Pending::Replace(meta, members));
    }

    /// Members added to and removed from set `name` (which must have been
    /// [`replace`](Self::replace)d before).
    pub fn delta(
        &mut self,
        name: &str,
        add: impl IntoIterator<Item = Member>,
        del: impl IntoIterator<Item = Member>,
    ) {
        if !self.desired.contains_key(name) {
            debug!(name, "delta for a set that is not desired; ignored");
            return;
        }
        let p = self
            .pending
            .entry(name.to_string())
            .or_insert_with(|| Pending::Delta {
                add: HashSet::new(),
                del: HashSet::new(),
            });
        match p {
            Pending::Replace(_, members) => {
                for m in del {
                    members.remove(&m);
                }
                members.extend(add);
            }
            Pending::Delta { add: a, del: d } => {
                for m in del {
                    a.remove(&m);
                    d.insert(m);
                }
                for m in add {
                    d.remove(&m);
                    a.insert(m);
                }
            }
        }
    }

    /// Set `name` must go (in the deletions phase).
    pub fn remove(&mut self, name: &str) {
        self.desired.remove(name);
        self.pending.remove(name);
    }

    /// Our sets as last read or written (for tests and status).
    pub fn observed(&self) -> Option<&HashMap<String, KernelSet>> {
        self.observed.as_ref()
    }

    fn read(&mut self) -> Result<(), BackendError> {
        let text = match self.first_read.take() {
            Some(r) => r.join(self.name())?,
            None => self.exec.save()?,
        };
        let version = self.version;
        let names = &self.names;
        let sets = save::parse(&text, |name| names.owns(version, name)).map_err(|e| {
            BackendError::Parse {
                backend: self.name(),
                reason: e,
            }
        })?;
        debug!(sets = sets.len(), "read our IP sets");
        self.observed = Some(sets);
        Ok(())
    }

    fn family(&self) -> &'static str {
        match self.version {
            IpVersion::V4 => "inet",
            IpVersion::V6 => "inet6",
        }
    }

    fn create_line(&self, out: &mut String, name: &str, meta: Meta, n: usize) {
        let _ = writeln!(
            out,
            "create {name} {} family {} hashsize {} maxelem {}",
            meta.set_type.ipset_type(),
            self.family(),
            hashsize(n),
            meta.maxelem
        );
    }

    fn fail(&mut self, e: BackendError) -> BackendError {
        // We no longer know what the kernel holds: read it again, and have
        // the manager send everything again.
        self.observed = None;
        self.needs_full = true;
        e
    }

    /// Creates, member changes and swaps; one `ipset restore`.
    fn apply_updates(&mut self) -> Result<ApplyOutcome, BackendError> {
        self.collect_check()?;
        if self.observed.is_none()
            && let Err(e) = self.read()
        {
            return Err(self.fail(e));
        }
        if self.needs_full {
            // The manager has not re-sent the desired state yet; nothing
            // to write until it has (the loop calls it before each apply).
            return Ok(ApplyOutcome::default());
        }
        let observed = self.observed.as_ref().expect("read above");
        let mut script = String::new();
        let mut lost = false;
        let mut after: Vec<(String, KernelSet)> = Vec::new();
        let pending = std::mem::take(&mut self.pending);
        for (name, p) in &pending {
            match (p, observed.get(name)) {
                (Pending::Replace(meta, members), None) => {
                    self.create_line(&mut script, name, *meta, members.len());
                    for m in members {
                        let _ = writeln!(script, "add {name} {}", MemberText(m));
                    }
                }
                (Pending::Replace(meta, members), Some(k)) if k.meta == Some(*meta) => {
                    for m in k.members.difference(members) {
                        let _ = writeln!(script, "del {name} {}", MemberText(m));
                    }
                    for m in members.difference(&k.members) {
                        let _ = writeln!(script, "add {name} {}", MemberText(m));
                    }
                }
                (Pending::Replace(meta, members), Some(k)) => {
                    let compatible = k
                        .meta
                        .is_some_and(|old| swappable(old.set_type, meta.set_type));
                    if compatible {
                        // Fill a temporary set and swap it in: the set's
                        // name (and the rules using it) never see it empty.
                        // A leftover temporary of an earlier run could have
                        // this name: destroy first (a no-op under -exist).
                        self.temp_seq += 1;
                        let temp = self.names.temp(self.version, self.temp_seq);
                        let _ = writeln!(script, "destroy {temp}");
                        self.create_line(&mut script, &temp, *meta, members.len());
                        for m in members {
                            let _ = writeln!(script, "add {temp} {}", MemberText(m));
                        }
                        let _ = writeln!(script, "swap {temp} {name}");
                        let _ = writeln!(script, "destroy {temp}");
                    } else {
                        // The kernel cannot swap sets of different types:
                        // replace it. This fails while a rule still uses the
                        // set (the error says so) and is retried; the calc
                        // graph changes a set's type only with a new id.
                        let _ = writeln!(script, "destroy {name}");
                        self.create_line(&mut script, name, *meta, members.len());
                        for m in members {
                            let _ = writeln!(script, "add {name} {}", MemberText(m));
                        }
                    }
                }
                (Pending::Delta { add, del }, Some(k)) => {
                    for m in del.intersection(&k.members) {
                        let _ = writeln!(script, "del {name} {}", MemberText(m));
                    }
                    for m in add.difference(&k.members) {
                        let _ = writeln!(script, "add {name} {}", MemberText(m));
                    }
                }
                (Pending::Delta { .. }, None) => lost = true,
            }
        }
        if !script.is_empty() {
            debug!(bytes = script.len(), sets = pending.len(), "ipset restore");
            self.writes += 1;
            for name in pending.keys() {
                self.written_at.insert(name.clone(), self.writes);
            }
            // -exist makes the script idempotent: a destroy of a temporary
            // that is not there, an add that is already there.
            if let Err(e) = self.exec.restore(&script) {
                return Err(self.fail(e));
            }
        }
        // The kernel now has what we wrote.
        let observed = self.observed.as_mut().expect("read above");
        for (name, p) in pending {
            match p {
                Pending::Replace(meta, members) => after.push((
                    name,
                    KernelSet {
                        meta: Some(meta),
                        members,
                    },
                )),
                Pending::Delta { add, del } => {
                    if let Some(k) = observed.get_mut(&name) {
                        for m in &del {
                            k.members.remove(m);
                        }
                        k.members.extend(add);
                    }
                }
            }
        }
        observed.extend(after);
        if lost {
            // A set we had written is gone from the kernel (removed by
            // hand?): rebuild from the desired state.
            self.observed = None;
            self.needs_full = true;
        }
        Ok(ApplyOutcome::default())
    }

    /// Destroys our sets that are not desired (and leftover temporaries).
    fn apply_deletions(&mut self) -> Result<ApplyOutcome, BackendError> {
        let Some(observed) = &self.observed else {
            return Ok(ApplyOutcome::default());
        };
        let stale: Vec<String> = observed
            .keys()
            .filter(|n| !self.desired.contains_key(*n))
            .cloned()
            .collect();
        if stale.is_empty() {
            return Ok(ApplyOutcome::default());
        }
        let mut script = String::new();
        for n in &stale {
            let _ = writeln!(script, "destroy {n}");
        }
        debug!(sets = stale.len(), "destroying IP sets");
        self.writes += 1;
        for n in &stale {
            self.written_at.insert(n.clone(), self.writes);
        }
        if let Err(e) = self.exec.restore(&script) {
            // Typically a set still in use by a rule ("in use by a kernel
            // component"). Lines before the failing one took effect: read
            // the kernel again. The desired state is intact, so the manager
            // need not send it again.
            self.observed = None;
            return Err(e);
        }
        let observed = self.observed.as_mut().expect("checked above");
        for n in stale {
            observed.remove(&n);
            self.written_at.remove(&n);
        }
        Ok(ApplyOutcome::default())
    }
}

impl Backend for IpSets {
    fn export(&self, m: &crate::metrics::Metrics) {
        if let Some(observed) = &self.observed {
            m.ipsets
                .get_or_create(&crate::metrics::version_label(self.version))
                .set(observed.len() as i64);
        }
    }

    fn name(&self) -> &'static str {
        match self.version {
            IpVersion::V4 => "ipsets-v4",
            IpVersion::V6 => "ipsets-v6",
        }
    }

    fn phases(&self) -> &'static [Phase] {
        &[Phase::IpSetUpdates, Phase::IpSetDeletions]
    }

    fn is_dirty(&self, phase: Phase) -> bool {
        match phase {
            Phase::IpSetUpdates => {
                self.observed.is_none()
                    || self.needs_full
                    || !self.pending.is_empty()
                    || self.check.as_ref().is_some_and(BackgroundRead::is_finished)
            }
            Phase::IpSetDeletions => self
                .observed
                .as_ref()
                .is_some_and(|o| o.keys().any(|n| !self.desired.contains_key(n))),
            _ => false,
        }
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if refresh == Refresh::IpSets {
            self.start_check();
        }
    }

    #[instrument(level = "debug", skip(self), fields(backend = self.name()))]
    fn apply(&mut self, phase: Phase) -> Result<ApplyOutcome, BackendError> {
        match phase {
            Phase::IpSetUpdates => self.apply_updates(),
            Phase::IpSetDeletions => self.apply_deletions(),
            _ => Ok(ApplyOutcome::default()),
        }
    }
}

#[cfg(test)]
mod tests;
