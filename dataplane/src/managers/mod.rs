//! Managers turn updates into desired kernel state. They do no I/O: they
//! record what they were told in `on_update` / `on_interface` and, when the
//! loop applies, queue desired state into the backend objects of
//! [`DesiredKernel`] in `complete_deferred_work`.

pub mod endpoints;
pub mod hosts;
pub mod ipsets;
pub mod nat;
pub mod routes;
pub mod wireguard;
pub mod xdp;

use crate::backends::DesiredKernel;
use crate::interfaces::InterfaceEvent;
use crate::model::{Update, ValidationError};

/// Errors a manager can report while queuing desired state.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// The desired state is inconsistent (e.g. a reference to an unknown
    /// object); a retry helps once the missing update arrives.
    #[error("{manager}: {reason}")]
    Inconsistent {
        manager: &'static str,
        reason: String,
    },
}

impl ManagerError {
    /// Whether retrying the apply can help.
    pub fn retryable(&self) -> bool {
        true
    }
}

/// One subsystem's view of the desired state.
pub trait Manager: Send {
    fn name(&self) -> &'static str;
    /// Checks a validated message against this manager's state before it
    /// is accepted (e.g. an IP set over the maximum size). An error rejects
    /// the message: nothing of it reaches any manager.
    fn check(&self, _update: &Update) -> Result<(), ValidationError> {
        Ok(())
    }
    /// A validated message from the calc graph. Record only.
    fn on_update(&mut self, update: &Update);
    /// A link or address change seen by the interface monitor. Record only.
    fn on_interface(&mut self, _event: &InterfaceEvent) {}
    /// Settle state that depends on other managers, once per apply.
    fn resolve_update_batch(&mut self) {}
    /// Queue desired state into the backends.
    fn complete_deferred_work(&mut self, kernel: &mut DesiredKernel) -> Result<(), ManagerError>;
    /// After an apply that left nothing dirty: status changes to report
    /// (e.g. an endpoint that went up or down), each once.
    fn status_changes(&mut self) -> Vec<crate::status::StatusEvent> {
        Vec::new()
    }
    /// What this manager reports in status (`GetStatus` details): (key,
    /// value) pairs, e.g. what it is waiting for.
    fn status(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

#[cfg(test)]
pub mod recording {
    //! A manager that records what it saw and queues one op per update into
    //! a recording backend, for the loop's tests.

    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::backends::recording::RecordingHandle;

    #[derive(Debug, Default)]
    pub struct Seen {
        pub updates: Vec<Update>,
        pub interfaces: Vec<InterfaceEvent>,
        pub batches: usize,
    }

    #[derive(Debug)]
    pub struct RecordingManager {
        pub seen: Arc<Mutex<Seen>>,
        pending: Vec<String>,
        backend: RecordingHandle,
    }

    impl RecordingManager {
        pub fn new(backend: RecordingHandle) -> (Self, Arc<Mutex<Seen>>) {
            let seen = Arc::new(Mutex::new(Seen::default()));
            (
                Self {
                    seen: seen.clone(),
                    pending: Vec::new(),
                    backend,
                },
                seen,
            )
        }
    }

    impl Manager for RecordingManager {
        fn name(&self) -> &'static str {
            "recording"
        }
        fn on_update(&mut self, update: &Update) {
            self.pending.push(format!("{update:?}"));
            self.seen.lock().unwrap().updates.push(update.clone());
        }
        fn on_interface(&mut self, event: &InterfaceEvent) {
            self.seen.lock().unwrap().interfaces.push(event.clone());
        }
        fn complete_deferred_work(
            &mut self,
            _kernel: &mut DesiredKernel,
        ) -> Result<(), ManagerError> {
            self.seen.lock().unwrap().batches += 1;
            for op in self.pending.drain(..) {
                self.backend.queue(op);
            }
            Ok(())
        }
    }
}
