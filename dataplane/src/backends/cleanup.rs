//! What the other policy dataplane left behind: when the daemon runs with
//! `--dataplane nftables`, the chains, hook rules and IP sets an earlier
//! run with `--dataplane iptables` wrote (and the other way round). Left
//! in place they would go on enforcing a stale policy beside the new one.
//!
//! Owns nothing of its own: it drives the other dataplane's backends with
//! nothing desired, so they remove only what they own (our prefix, our
//! hash comments, our tables), once, after the new dataplane's tables are
//! written (the last phase but one: policy is never absent in between).
//! A failure (no `iptables` on an nftables-only host, no nf_tables in the
//! kernel) does not hold the dataplane back: it is reported in status and
//! tried again on the next refresh.

use tracing::{info, warn};

use super::{ApplyOutcome, Backend, BackendError, Phase, Refresh};

/// When the leftovers are removed: after the tables that replace them.
const PHASE: Phase = Phase::IpSetDeletions;

/// The other dataplane's backends, each with nothing desired, run in
/// order (tables before the sets their rules used).
pub struct Cleanup {
    name: &'static str,
    inner: Vec<Box<dyn Backend>>,
    /// Nothing left to remove, or a failure waiting for the next refresh.
    idle: bool,
    last_error: Option<String>,
}

impl std::fmt::Debug for Cleanup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cleanup")
            .field("name", &self.name)
            .field(
                "inner",
                &self.inner.iter().map(|b| b.name()).collect::<Vec<_>>(),
            )
            .field("idle", &self.idle)
            .finish()
    }
}

impl Cleanup {
    pub fn new(name: &'static str, inner: Vec<Box<dyn Backend>>) -> Self {
        Self {
            name,
            inner,
            idle: false,
            last_error: None,
        }
    }

    fn inner_dirty(&self) -> bool {
        self.inner
            .iter()
            .any(|b| b.phases().iter().any(|p| b.is_dirty(*p)))
    }

    fn run(&mut self) -> Result<ApplyOutcome, BackendError> {
        let mut outcome = ApplyOutcome::default();
        for b in &mut self.inner {
            for phase in Phase::ALL {
                if b.phases().contains(&phase) && b.is_dirty(phase) {
                    let o = b.apply(phase)?;
                    outcome.reschedule_after = match (outcome.reschedule_after, o.reschedule_after)
                    {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                }
            }
        }
        Ok(outcome)
    }
}

impl Backend for Cleanup {
    fn name(&self) -> &'static str {
        self.name
    }

    fn phases(&self) -> &'static [Phase] {
        &[PHASE]
    }

    fn is_dirty(&self, phase: Phase) -> bool {
        phase == PHASE && !self.idle && self.inner_dirty()
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if self.last_error.is_some() {
            self.idle = false;
        }
        for b in &mut self.inner {
            b.request_resync(refresh);
        }
    }

    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        match self.run() {
            Ok(o) => {
                if self.last_error.take().is_some() || !self.inner_dirty() {
                    info!(
                        cleanup = self.name,
                        "the other dataplane's leftovers are gone"
                    );
                }
                self.idle = !self.inner_dirty();
                Ok(o)
            }
            Err(e) => {
                warn!(cleanup = self.name, error = %e, "cannot remove the other dataplane's leftovers; trying again on the next refresh");
                self.last_error = Some(e.to_string());
                self.idle = true;
                Ok(ApplyOutcome::default())
            }
        }
    }

    fn status(&self) -> Vec<(String, String)> {
        let state = match &self.last_error {
            Some(e) => format!("failed: {e}"),
            None if self.idle => "done".to_string(),
            None => "pending".to_string(),
        };
        vec![(format!("cleanup.{}", self.name), state)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::recording::RecordingBackend;

    #[test]
    fn leftovers_are_removed_once_and_a_failure_waits_for_the_refresh() {
        let (rec, h) = RecordingBackend::new("old-tables", Phase::Tables);
        h.queue("remove our chains".into());
        let mut c = Cleanup::new("iptables", vec![Box::new(rec)]);
        assert!(c.is_dirty(PHASE));
        assert!(!c.is_dirty(Phase::Tables), "only after the new tables");
        c.apply(PHASE).unwrap();
        assert_eq!(
            h.lock().applied,
            vec![vec!["remove our chains".to_string()]]
        );
        assert!(!c.is_dirty(PHASE));
        assert_eq!(c.status()[0].1, "done");

        // A failure is reported, does not fail the apply, and waits.
        h.queue("again".into());
        h.lock().fail_on = vec![2];
        c.request_resync(Refresh::Iptables);
        assert!(c.apply(PHASE).is_ok());
        assert!(c.status()[0].1.starts_with("failed: "), "{:?}", c.status());
        assert!(!c.is_dirty(PHASE), "not retried before the next refresh");
        c.request_resync(Refresh::Iptables);
        assert!(c.is_dirty(PHASE));
        c.apply(PHASE).unwrap();
        assert_eq!(c.status()[0].1, "done");
        assert_eq!(h.lock().calls, 3);
    }
}
