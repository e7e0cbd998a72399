//! The dphandler daemon: the gRPC service (`grpc`), the connector between
//! the streams and the sync loop (`connector`), the unix-socket listeners
//! (`listen`) and who may do what on them (`access`). Handlers validate,
//! convert and enqueue; they never touch the kernel.

pub mod access;
pub mod connector;
pub mod grpc;
pub mod health;
pub mod limits;
pub mod listen;
