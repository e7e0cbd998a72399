//! The dphandler daemon: the gRPC service (`grpc`), the connector between
//! the streams and the sync loop (`connector`), and the unix-socket
//! listener (`listen`). Handlers validate, convert and enqueue; they never
//! touch the kernel.

pub mod connector;
pub mod grpc;
pub mod health;
pub mod limits;
pub mod listen;
