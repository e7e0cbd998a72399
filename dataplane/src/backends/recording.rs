//! A backend that records what it was asked to apply and can be scripted to
//! fail, so managers and the loop are tested without root.

use std::sync::{Arc, Mutex};

use super::{ApplyOutcome, Backend, BackendError, Phase, Refresh};

#[derive(Debug, Default)]
pub struct Recorded {
    /// Ops queued and not yet applied.
    pub queued: Vec<String>,
    /// One entry per successful apply: the ops it applied.
    pub applied: Vec<Vec<String>>,
    /// Number of apply calls, failed ones included.
    pub calls: usize,
    /// Calls (1-based) that fail.
    pub fail_on: Vec<usize>,
    /// Fail every call from this one on (1-based), until cleared.
    pub fail_from: Option<usize>,
    pub resyncs: Vec<Refresh>,
    pub resync_pending: bool,
    /// How long each apply takes (a dear kernel write).
    pub apply_takes: std::time::Duration,
    /// The scripted failures are ones a retry cannot mend.
    pub permanent: bool,
}

/// Shared view of a [`RecordingBackend`], kept by the test and the manager.
#[derive(Debug, Clone, Default)]
pub struct RecordingHandle(pub Arc<Mutex<Recorded>>);

impl RecordingHandle {
    pub fn queue(&self, op: String) {
        self.0.lock().unwrap().queued.push(op);
    }
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Recorded> {
        self.0.lock().unwrap()
    }
}

#[derive(Debug)]
pub struct RecordingBackend {
    name: &'static str,
    phase: &'static [Phase],
    pub handle: RecordingHandle,
}

impl RecordingBackend {
    pub fn new(name: &'static str, phase: Phase) -> (Self, RecordingHandle) {
        let handle = RecordingHandle::default();
        (
            Self {
                name,
                phase: match phase {
                    Phase::Links => &[Phase::Links],
                    Phase::IpSetUpdates => &[Phase::IpSetUpdates],
                    Phase::RoutesAndRules => &[Phase::RoutesAndRules],
                    Phase::Tables => &[Phase::Tables],
                    Phase::InterfaceSettings => &[Phase::InterfaceSettings],
                    Phase::IpSetDeletions => &[Phase::IpSetDeletions],
                    Phase::NodeSettings => &[Phase::NodeSettings],
                },
                handle: handle.clone(),
            },
            handle,
        )
    }
}

impl Backend for RecordingBackend {
    fn name(&self) -> &'static str {
        self.name
    }
    fn phases(&self) -> &'static [Phase] {
        self.phase
    }
    fn is_dirty(&self, _phase: Phase) -> bool {
        let r = self.handle.lock();
        !r.queued.is_empty() || r.resync_pending
    }
    fn request_resync(&mut self, refresh: Refresh) {
        let mut r = self.handle.lock();
        r.resyncs.push(refresh);
        r.resync_pending = true;
    }
    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        let takes = self.handle.lock().apply_takes;
        std::thread::sleep(takes);
        let mut r = self.handle.lock();
        r.calls += 1;
        let call = r.calls;
        if r.fail_on.contains(&call) || r.fail_from.is_some_and(|f| call >= f) {
            return Err(BackendError::Scripted {
                backend: self.name,
                call,
                permanent: r.permanent,
            });
        }
        let ops = std::mem::take(&mut r.queued);
        r.applied.push(ops);
        r.resync_pending = false;
        Ok(ApplyOutcome::default())
    }
}
