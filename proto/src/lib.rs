//! dphandler's wire API.
//!
//! - [`felix`]: Calico's dataplane messages (`felix/felixbackend.proto`), wire-compatible.
//! - [`v1`]: the `dphandler.v1.Dataplane` service and its envelopes.
//! - [`convert`]: validation and conversion of `felix::ToDataplane` into the
//!   dataplane's model (`dphandler_dataplane::model`). Nothing that fails here
//!   reaches the kernel.
//! - [`text`]: the canonical JSON mapping (YAML, JSON, NDJSON) of the messages.
//! - [`client`]: connecting to the server over its unix socket or TCP.

#[allow(clippy::all, missing_debug_implementations, reason = "generated code")]
pub mod felix {
    tonic::include_proto!("felix");
}

/// Package `dphandler` (nested as the generated code's `super::` paths expect).
pub mod dphandler {
    #[allow(clippy::all, missing_debug_implementations, reason = "generated code")]
    pub mod v1 {
        tonic::include_proto!("dphandler.v1");
    }
}
pub use dphandler::v1;

pub mod client;
pub mod convert;
pub mod text;
pub mod wire;

/// The encoded `FileDescriptorSet` of all our `.proto` files (for gRPC
/// reflection and the canonical JSON mapping).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptor.bin"));

/// The descriptor pool built from [`FILE_DESCRIPTOR_SET`].
pub fn descriptor_pool() -> &'static prost_reflect::DescriptorPool {
    static POOL: std::sync::OnceLock<prost_reflect::DescriptorPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        prost_reflect::DescriptorPool::decode(FILE_DESCRIPTOR_SET)
            .expect("the descriptor set compiled by build.rs decodes")
    })
}

/// The largest message the server takes by default
/// (`--max-message-bytes`). Felix's largest message is an IP set of its
/// `MaxIpsetSize` (1,048,576) members: 14.2 MB of IPv4 addresses, 43.0 MB
/// of IPv6 addresses written out in full (measured by
/// `wire::tests::the_largest_ip_sets_fit_the_default_message_size`);
/// every other message of a real snapshot is far smaller.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 48 << 20;
