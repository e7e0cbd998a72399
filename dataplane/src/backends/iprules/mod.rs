//! Policy-routing rules (`ip rule`), over rtnetlink (Felix's
//! `felix/routerule`).
//!
//! Owns the rules that look up one of its tables (given at construction;
//! 0 and 253–255, the kernel's, are refused) and nothing else: the kernel's
//! own rules (`lookup local/main/default`) and other agents' rules stay.
//! Each apply reads the rules of both families (at start, after a failure
//! and on the route refresh tick; otherwise it trusts what it wrote),
//! deletes ours that are no longer wanted and adds the missing ones. IpRules
//! are compared as Felix's `RulesMatchSrcFWMarkTable` does: priority,
//! family, fwmark and mask, invert, source, table.
//!
//! Not to be confused with [`crate::rules`], which renders policy into
//! iptables rules.

pub mod netlink;

use std::collections::BTreeSet;

use tracing::{debug, info, instrument};

use super::{ApplyOutcome, Backend, BackendError, Phase, Refresh};
use crate::model::routes::IpRule;

/// The seam to the kernel.
pub trait IpRuleSeam: Send + std::fmt::Debug {
    /// Every rule of both families.
    fn rules(&mut self) -> Result<Vec<IpRule>, BackendError>;
    fn add(&mut self, rule: &IpRule) -> Result<(), BackendError>;
    fn delete(&mut self, rule: &IpRule) -> Result<(), BackendError>;
}

/// Why a set of tables cannot be ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("routing table {0} belongs to the kernel (0 and 253-255 cannot be owned)")]
pub struct KernelTable(pub u32);

#[derive(Debug)]
pub struct IpRules {
    tables: BTreeSet<u32>,
    seam: Box<dyn IpRuleSeam>,
    desired: BTreeSet<IpRule>,
    observed: Option<BTreeSet<IpRule>>,
}

impl IpRules {
    /// A backend owning the rules that look up `tables`.
    pub fn new(
        tables: impl IntoIterator<Item = u32>,
        seam: Box<dyn IpRuleSeam>,
    ) -> Result<Self, KernelTable> {
        let tables: BTreeSet<u32> = tables.into_iter().collect();
        if let Some(t) = tables.iter().find(|t| matches!(t, 0 | 253..=255)) {
            return Err(KernelTable(*t));
        }
        Ok(Self {
            tables,
            seam,
            desired: BTreeSet::new(),
            observed: None,
        })
    }

    /// The whole desired set. A rule for a table we do not own is a bug
    /// of the caller: it is left out (and logged), never written.
    pub fn set(&mut self, rules: BTreeSet<IpRule>) {
        let (ours, foreign): (BTreeSet<IpRule>, BTreeSet<IpRule>) = rules
            .into_iter()
            .partition(|r| self.tables.contains(&r.table));
        if !foreign.is_empty() {
            tracing::error!(?foreign, "rules for tables we do not own: left out");
        }
        self.desired = ours;
    }

    pub fn desired(&self) -> &BTreeSet<IpRule> {
        &self.desired
    }

    fn read(&mut self) -> Result<BTreeSet<IpRule>, BackendError> {
        Ok(self
            .seam
            .rules()?
            .into_iter()
            .filter(|r| self.tables.contains(&r.table))
            .collect())
    }
}

impl Backend for IpRules {
    fn name(&self) -> &'static str {
        "rules"
    }

    fn phases(&self) -> &'static [Phase] {
        &[Phase::RoutesAndRules]
    }

    fn is_dirty(&self, phase: Phase) -> bool {
        phase == Phase::RoutesAndRules && self.observed.as_ref() != Some(&self.desired)
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if refresh == Refresh::Routes {
            self.observed = None;
        }
    }

    #[instrument(level = "debug", skip(self), fields(backend = "rules"))]
    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        let mut observed = match self.observed.take() {
            Some(o) => o,
            None => self.read()?,
        };
        let stale: Vec<IpRule> = observed.difference(&self.desired).copied().collect();
        let missing: Vec<IpRule> = self.desired.difference(&observed).copied().collect();
        debug!(stale = stale.len(), missing = missing.len(), "ip rules");
        // Additions first: a rule that replaces another (a new priority)
        // is in force before the old one goes.
        for r in missing {
            info!(rule = ?r, "adding ip rule");
            // On failure `observed` stays unknown: read again at the retry.
            self.seam.add(&r)?;
            observed.insert(r);
        }
        for r in stale {
            info!(rule = ?r, "deleting ip rule");
            self.seam.delete(&r)?;
            observed.remove(&r);
        }
        self.observed = Some(observed);
        Ok(ApplyOutcome::default())
    }
}

#[cfg(test)]
mod tests;
