//! dphandler's dataplane: the model (validated desired state), the sync
//! loop, the managers that turn updates into desired kernel state, and the
//! backends that program the kernel. No gRPC in here.

pub mod backends;
pub mod interfaces;
pub mod managers;
pub mod metrics;
pub mod model;
pub mod rules;
pub mod session;
pub mod sync_loop;
