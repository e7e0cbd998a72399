//! The nftables dataplane of one IP version as a backend: the managers'
//! chains ([`ChainTable`], one per iptables table) and IP sets
//! ([`DesiredSets`]), programmed by one commit per apply over our own
//! netlink socket ([`super::plan`] decides what it holds). The kernel is
//! read back at start (adopting what a previous run left: nothing is
//! written where it already matches, so a restart has no gap), after a
//! failed commit, and on every refresh tick (what was changed by hand is
//! put back).

use std::time::Instant;

use tracing::{debug, info, instrument, warn};

use super::chains::ChainTable;
use super::netlink::{NftError, NftNetlink};
use super::ops::{Family, Op};
use super::plan::{Content, Contents, Observed, ObservedChain, ObservedTable, PlanError, plan};
use super::sets::DesiredSets;
use crate::backends::desired::{RuleTable, SetStore};
use crate::backends::iptables::Ownership;
use crate::backends::{ApplyOutcome, Backend, BackendError, Phase, Refresh};
use crate::model::IpVersion;
use crate::model::ipsets::SetNames;

/// The iptables tables whose chains we program, in hook order.
pub const TABLES: [&str; 4] = ["raw", "mangle", "nat", "filter"];

const NAME_V4: &str = "nftables-v4";
const NAME_V6: &str = "nftables-v6";

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
            for c in self.chains(family, &table)? {
                t.chains.insert(
                    c.name,
                    ObservedChain {
                        hook: c.hook,
                        comments: Vec::new(),
                    },
                );
            }
            for r in self.rules(family, &table)? {
                t.chains
                    .entry(r.chain)
                    .or_default()
                    .comments
                    .push(r.comment);
            }
            for s in self.sets(family, &table)? {
                let content = if s.key_len == 2 {
                    Content::Intervals(self.raw_elements(family, &table, &s.name)?)
                } else if s.flags & 0x4 != 0 {
                    Content::Ranges(self.ranges(family, &table, &s.name)?)
                } else {
                    Content::Keys(
                        self.elements(family, &table, &s.name)?
                            .into_iter()
                            .collect(),
                    )
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
    pub sets: DesiredSets,
    kernel: Box<dyn NftKernel>,
    /// Our tables as last read or written; `None`: read at the next apply.
    observed: Option<Observed>,
    /// Set contents from the read not yet used by a plan.
    contents: Option<Contents>,
    commits: u64,
    /// Commits already counted in the metrics.
    exported: std::sync::atomic::AtomicU64,
}

impl Dataplane {
    pub fn new(
        version: IpVersion,
        prefix: &str,
        names: SetNames,
        kernel: Box<dyn NftKernel>,
    ) -> Self {
        let own = Ownership::new(prefix);
        Self {
            version,
            tables: TABLES
                .iter()
                .map(|t| ChainTable::new(t, version, own.clone()))
                .collect(),
            sets: DesiredSets::new(version, names),
            own,
            kernel,
            observed: None,
            contents: None,
            commits: 0,
            exported: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Opens the daemon's netlink socket.
    pub fn open(version: IpVersion, prefix: &str, names: SetNames) -> Result<Self, NftError> {
        Ok(Self::new(
            version,
            prefix,
            names,
            Box::new(NftNetlink::open()?),
        ))
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
        self.tables.iter_mut().map(|t| t as &mut dyn RuleTable)
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
        self.observed.is_none() || self.sets.changed || self.tables.iter().any(|t| t.changed)
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if matches!(refresh, Refresh::Iptables | Refresh::IpSets) {
            self.observed = None;
        }
    }

    #[instrument(skip_all, fields(backend = self.name()))]
    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        if self.observed.is_none() {
            self.read()?;
        }
        let family = self.family();
        let mut p = loop {
            let observed = self.observed.as_ref().expect("read above");
            match plan(
                family,
                &self.own.chain_prefix,
                &self.tables,
                &self.sets,
                observed,
                self.contents.as_ref(),
            ) {
                Ok(p) => break p,
                Err(PlanError::NeedRead { .. }) if self.contents.is_none() => self.read()?,
                Err(e) => {
                    return Err(BackendError::Parse {
                        backend: self.name(),
                        reason: e.to_string(),
                    });
                }
            }
        };
        let started = Instant::now();
        let n = p.ops.len();
        if let Err(e) = self.kernel.commit(&p.ops) {
            warn!(error = %e, ops = n, "nftables commit refused; reading back");
            self.observed = None;
            self.contents = None;
            return Err(self.err(e));
        }
        if n > 0 {
            self.commits += 1;
            let (adopted, repaired) = (self.contents.is_some(), self.commits);
            info!(ops = n, elapsed = ?started.elapsed(), after_read = adopted, commits = repaired, "nftables committed");
        }
        self.observed = Some(std::mem::take(&mut p.after));
        self.contents = None;
        self.sets.written_ranges = std::mem::take(&mut p.ranges);
        self.sets.changes.clear();
        self.sets.changed = false;
        for t in &mut self.tables {
            t.changed = false;
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
        let Some(obs) = &self.observed else {
            return;
        };
        for t in TABLES {
            let name = super::plan::table_name(&self.own.chain_prefix, t);
            let label = crate::metrics::TableLabel {
                ip_version: v.ip_version.clone(),
                table: name.clone(),
            };
            let (chains, rules) = obs.get(&name).map_or((0, 0), |t| {
                (
                    t.chains.len(),
                    t.chains.values().map(|c| c.comments.len()).sum(),
                )
            });
            m.nftables_chains.get_or_create(&label).set(chains as i64);
            m.nftables_rules.get_or_create(&label).set(rules as i64);
        }
        let sets: std::collections::BTreeSet<&String> = obs
            .values()
            .flat_map(|t| t.sets.keys())
            .filter(|s| !s.starts_with("ports-"))
            .collect();
        m.ipsets.get_or_create(&v).set(sets.len() as i64);
    }

    fn status(&self) -> Vec<(String, String)> {
        let Some(obs) = &self.observed else {
            return Vec::new();
        };
        obs.iter()
            .map(|(name, t)| {
                let rules: usize = t.chains.values().map(|c| c.comments.len()).sum();
                (
                    format!("{}.{name}", self.name()),
                    format!(
                        "{} chains, {rules} rules, {} sets",
                        t.chains.len(),
                        t.sets.len()
                    ),
                )
            })
            .collect()
    }
}
