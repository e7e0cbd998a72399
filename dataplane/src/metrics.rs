//! Prometheus metrics of the dataplane, with Felix's names under our
//! prefix (`dphandler_int_dataplane_…`): the loop and the edge update them,
//! the server registers and serves them (`--metrics-addr`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// A message kind (`ipset`, `policy`, `in_sync`, …).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TypeLabel {
    pub r#type: String,
}

/// A refresh (`ipsets`, `routes`, `xdp`, `iptables`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefreshLabel {
    pub refresh: String,
}

#[derive(Debug, Clone)]
pub struct Metrics {
    /// Seconds per successful apply (managers and kernel).
    pub apply_time: Histogram,
    /// Applies that failed (retried).
    pub failures: Counter,
    /// Messages from the calc graph, by kind.
    pub messages: Family<TypeLabel, Counter>,
    /// Messages handled per wake-up of the loop.
    pub batch_size: Histogram,
    /// Messages refused (at the edge or by the loop).
    pub rejections: Counter,
    /// Refresh ticks (each re-reads part of the kernel), by refresh.
    pub resyncs: Family<RefreshLabel, Counter>,
    /// 1 once the dataplane is in sync.
    pub in_sync: Gauge,
    /// Feeder streams open.
    pub feeders: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            apply_time: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            failures: Counter::default(),
            messages: Family::default(),
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            rejections: Counter::default(),
            resyncs: Family::default(),
            in_sync: Gauge::default(),
            feeders: Gauge::default(),
        }
    }
}

impl Metrics {
    /// Registers every metric under `registry` (which carries the
    /// `dphandler` prefix).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "int_dataplane_apply_time_seconds",
            "Time taken by successful applies of the dataplane",
            self.apply_time.clone(),
        );
        registry.register(
            "int_dataplane_failures",
            "Applies of the dataplane that failed",
            self.failures.clone(),
        );
        registry.register(
            "int_dataplane_messages",
            "Messages from the calc graph, by type",
            self.messages.clone(),
        );
        registry.register(
            "int_dataplane_msg_batch_size",
            "Messages handled per wake-up of the sync loop",
            self.batch_size.clone(),
        );
        registry.register(
            "grpc_rejections",
            "Messages refused, with a reason sent back on their stream",
            self.rejections.clone(),
        );
        registry.register(
            "int_dataplane_resyncs",
            "Refresh ticks that re-read part of the kernel",
            self.resyncs.clone(),
        );
        registry.register(
            "int_dataplane_in_sync",
            "1 once the dataplane is in sync with the calc graph",
            self.in_sync.clone(),
        );
        registry.register(
            "grpc_feeders",
            "Feeder streams (ToDataplane) open",
            self.feeders.clone(),
        );
    }
}
