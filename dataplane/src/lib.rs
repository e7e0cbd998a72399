//! dphandler's dataplane: the model (validated desired state), the sync
//! loop, the managers that turn updates into desired kernel state, and the
//! backends that program the kernel. No gRPC in here.
//!
//! The layers, each importing only those before it (no import circle):
//! `model` (plain data) → `generictables` (the rule types both dataplanes
//! share) → `rules` (the policy renderer) → `status` and `metrics` (what
//! goes upwards) → `backends` (the only I/O) → `interfaces` (the link monitor) →
//! `managers` (memory only) → `session` → `sync_loop` (the one owner).
//! `tests/layers.rs` holds the code to this order.

pub mod backends;
pub mod generictables;
pub mod interfaces;
pub mod managers;
pub mod metrics;
pub mod model;
pub mod rules;
pub mod session;
pub mod status;
pub mod sync_loop;
