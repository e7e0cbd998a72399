//! Prometheus metrics of the dataplane, with Felix's names under our
//! prefix (`dphandler_int_dataplane_…`, `dphandler_iptables_…`): the loop
//! and the edge update them, the tools count their calls, the backends
//! export their state after each apply ([`crate::backends::Backend::export`]),
//! and the server registers and serves them (`--metrics-addr`).
//!
//! What the kernel counts (XDP verdicts, WireGuard bytes and handshakes)
//! is kept as the backends last read it and encoded at scrape time as
//! constant metrics ([`KernelReadings`]): a peer or interface that is gone
//! is gone from `/metrics`, and a counter the kernel reset (a program
//! attached again) is not mistaken for a decrease of ours.

use std::collections::BTreeMap;
use std::sync::Mutex;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
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

/// An IP version (`4`, `6`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VersionLabel {
    pub ip_version: String,
}

/// An iptables table of one IP version.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TableLabel {
    pub ip_version: String,
    pub table: String,
}

/// What a routes backend holds (`route`, `neighbour`, `fdb`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

/// `"4"` or `"6"`.
pub fn version_label(v: crate::model::IpVersion) -> VersionLabel {
    VersionLabel {
        ip_version: match v {
            crate::model::IpVersion::V4 => "4",
            crate::model::IpVersion::V6 => "6",
        }
        .into(),
    }
}

/// The counters of one kind of tool call (`iptables-restore`, `ipset`):
/// calls, failed calls, and lines fed in.
#[derive(Debug, Clone, Default)]
pub struct ToolCounters {
    pub calls: Counter,
    pub errors: Counter,
    pub lines: Counter,
}

impl ToolCounters {
    /// Counts one call that fed `input` (its lines), failed or not.
    pub fn count<T, E>(&self, input: &str, result: &Result<T, E>) {
        self.calls.inc();
        self.lines.inc_by(input.lines().count() as u64);
        if result.is_err() {
            self.errors.inc();
        }
    }
}

/// The iptables tools' counters of one IP version.
#[derive(Debug, Clone)]
pub struct IptablesToolMetrics {
    pub restore: ToolCounters,
    pub save: ToolCounters,
    /// Lines fed to iptables-restore, by table.
    pub lines: Family<TableLabel, Counter>,
    pub ip_version: VersionLabel,
}

impl IptablesToolMetrics {
    /// Counts an `iptables-restore` of `input` (lines by their `*table`).
    pub fn count_restore<T, E>(&self, input: &str, result: &Result<T, E>) {
        self.restore.calls.inc();
        if result.is_err() {
            self.restore.errors.inc();
        }
        let mut table = "";
        for line in input.lines() {
            if let Some(t) = line.strip_prefix('*') {
                table = t;
            }
            self.lines
                .get_or_create(&TableLabel {
                    ip_version: self.ip_version.ip_version.clone(),
                    table: table.to_string(),
                })
                .inc();
        }
    }
}

/// A WireGuard peer as the device last reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerReading {
    pub public_key: String,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    /// Unix seconds of the last handshake; `None`: never.
    pub latest_handshake: Option<u64>,
}

/// One interface's XDP verdicts as the program's map last held them:
/// (verdict, packets, bytes).
pub type XdpReading = Vec<(&'static str, u64, u64)>;

/// What the kernel counts, as the backends last read it.
#[derive(Debug, Default)]
pub struct KernelReadings {
    inner: Mutex<Readings>,
}

#[derive(Debug, Default)]
struct Readings {
    /// Per IP version ("4", "6"): the peers.
    wireguard: BTreeMap<String, Vec<PeerReading>>,
    /// Per interface.
    xdp: BTreeMap<String, XdpReading>,
}

impl KernelReadings {
    /// The peers of the `ip_version` device, replacing the last reading.
    pub fn set_wireguard(&self, ip_version: &VersionLabel, peers: Vec<PeerReading>) {
        let mut r = self.inner.lock().expect("readings lock");
        if peers.is_empty() {
            r.wireguard.remove(&ip_version.ip_version);
        } else {
            r.wireguard.insert(ip_version.ip_version.clone(), peers);
        }
    }

    /// Every interface's XDP verdicts, replacing the last reading.
    pub fn set_xdp(&self, ifaces: BTreeMap<String, XdpReading>) {
        self.inner.lock().expect("readings lock").xdp = ifaces;
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabel {
    ip_version: String,
    public_key: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct XdpLabel {
    iface: String,
    verdict: String,
}

impl Collector for KernelReadings {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let r = self.inner.lock().expect("readings lock");
        let peers: Vec<(PeerLabel, &PeerReading)> = r
            .wireguard
            .iter()
            .flat_map(|(v, peers)| {
                peers.iter().map(move |p| {
                    (
                        PeerLabel {
                            ip_version: v.clone(),
                            public_key: p.public_key.clone(),
                        },
                        p,
                    )
                })
            })
            .collect();
        type PeerValue = fn(&PeerReading) -> u64;
        let counters: [(&str, &str, PeerValue); 2] = [
            (
                "wireguard_bytes_rcvd",
                "Bytes received from the peer",
                |p| p.rx_bytes,
            ),
            ("wireguard_bytes_sent", "Bytes sent to the peer", |p| {
                p.tx_bytes
            }),
        ];
        for (name, help, value) in counters {
            if peers.is_empty() {
                continue;
            }
            let mut family = encoder.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (label, p) in &peers {
                ConstCounter::new(value(p)).encode(family.encode_family(label)?)?;
            }
        }
        let handshakes: Vec<_> = peers
            .iter()
            .filter_map(|(l, p)| p.latest_handshake.map(|t| (l, t)))
            .collect();
        if !handshakes.is_empty() {
            let mut family = encoder.encode_descriptor(
                "wireguard_latest_handshake_seconds",
                "Unix time of the last handshake with the peer",
                None,
                prometheus_client::metrics::MetricType::Gauge,
            )?;
            for (label, t) in handshakes {
                ConstGauge::new(t as i64).encode(family.encode_family(label)?)?;
            }
        }
        if !r.xdp.is_empty() {
            for (name, help, bytes) in [
                (
                    "xdp_packets",
                    "Packets the XDP prefilter saw, by verdict",
                    false,
                ),
                ("xdp_bytes", "Bytes the XDP prefilter saw, by verdict", true),
            ] {
                let mut family = encoder.encode_descriptor(
                    name,
                    help,
                    None,
                    prometheus_client::metrics::MetricType::Counter,
                )?;
                for (iface, verdicts) in &r.xdp {
                    for (verdict, pkts, b) in verdicts {
                        let label = XdpLabel {
                            iface: iface.clone(),
                            verdict: (*verdict).to_string(),
                        };
                        ConstCounter::new(if bytes { *b } else { *pkts })
                            .encode(family.encode_family(&label)?)?;
                    }
                }
            }
        }
        Ok(())
    }
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
    /// Messages a feeder's stream waited for (its peer over the message
    /// rate limit).
    pub message_waits: Counter,
    /// Refresh ticks (each re-reads part of the kernel), by refresh.
    pub resyncs: Family<RefreshLabel, Counter>,
    /// 1 once the dataplane is in sync.
    pub in_sync: Gauge,
    /// Objects the dataplane could not program and isolated (each named
    /// in the status details under `isolated.`).
    pub isolated: Gauge,
    /// Feeder streams open.
    pub feeders: Gauge,
    /// StatusUpdates streams open.
    pub watchers: Gauge,
    /// iptables-restore / iptables-save calls and failures, by IP version.
    pub iptables_restore_calls: Family<VersionLabel, Counter>,
    pub iptables_restore_errors: Family<VersionLabel, Counter>,
    pub iptables_save_calls: Family<VersionLabel, Counter>,
    pub iptables_save_errors: Family<VersionLabel, Counter>,
    /// Lines fed to iptables-restore, by table.
    pub iptables_lines: Family<TableLabel, Counter>,
    /// Our chains and rules, by table, as last read or written.
    pub iptables_chains: Family<TableLabel, Gauge>,
    pub iptables_rules: Family<TableLabel, Gauge>,
    /// nftables commits that changed something, by IP version
    /// (`--dataplane nftables`).
    pub nftables_commits: Family<VersionLabel, Counter>,
    /// Those of them the kernel validates by walking the table: they add
    /// or replace a rule (every rule here carries a verdict or sets the
    /// mark, which the kernel validates) rather than only set elements.
    pub nftables_validating_commits: Family<VersionLabel, Counter>,
    /// Seconds per nftables commit that changed something: the batch sent
    /// until the kernel's reply, i.e. the kernel's commit (validation
    /// included).
    pub nftables_commit_time: Family<VersionLabel, Histogram, fn() -> Histogram>,
    /// Chains (base chains too) and rules in our nftables tables, by
    /// table (`dph-filter`, …), as last read or written.
    pub nftables_chains: Family<TableLabel, Gauge>,
    pub nftables_rules: Family<TableLabel, Gauge>,
    /// `ipset` calls (save and restore), failures and lines fed in.
    pub ipset: ToolCounters,
    /// Our IP sets, by IP version.
    pub ipsets: Family<VersionLabel, Gauge>,
    /// Routes, neighbours and FDB entries we hold in the kernel.
    pub routes: Family<KindLabel, Gauge>,
    /// WireGuard peers configured, by IP version.
    pub wireguard_peers: Family<VersionLabel, Gauge>,
    /// Interfaces with the XDP prefilter attached.
    pub xdp_interfaces: Gauge,
    /// What the kernel counts, encoded at scrape time.
    pub kernel: std::sync::Arc<KernelReadings>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            apply_time: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            failures: Counter::default(),
            messages: Family::default(),
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            rejections: Counter::default(),
            message_waits: Counter::default(),
            resyncs: Family::default(),
            in_sync: Gauge::default(),
            isolated: Gauge::default(),
            feeders: Gauge::default(),
            watchers: Gauge::default(),
            iptables_restore_calls: Family::default(),
            iptables_restore_errors: Family::default(),
            iptables_save_calls: Family::default(),
            iptables_save_errors: Family::default(),
            iptables_lines: Family::default(),
            iptables_chains: Family::default(),
            iptables_rules: Family::default(),
            nftables_commits: Family::default(),
            nftables_validating_commits: Family::default(),
            nftables_commit_time: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_125, 2.0, 14))
            }),
            nftables_chains: Family::default(),
            nftables_rules: Family::default(),
            ipset: ToolCounters::default(),
            ipsets: Family::default(),
            routes: Family::default(),
            wireguard_peers: Family::default(),
            xdp_interfaces: Gauge::default(),
            kernel: Default::default(),
        }
    }
}

impl Metrics {
    /// The counters an iptables tool of `version` updates.
    pub fn iptables_tool(&self, version: crate::model::IpVersion) -> IptablesToolMetrics {
        let v = version_label(version);
        IptablesToolMetrics {
            restore: ToolCounters {
                calls: self.iptables_restore_calls.get_or_create(&v).clone(),
                errors: self.iptables_restore_errors.get_or_create(&v).clone(),
                lines: Counter::default(),
            },
            save: ToolCounters {
                calls: self.iptables_save_calls.get_or_create(&v).clone(),
                errors: self.iptables_save_errors.get_or_create(&v).clone(),
                lines: Counter::default(),
            },
            lines: self.iptables_lines.clone(),
            ip_version: v,
        }
    }

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
            "grpc_message_waits",
            "Messages read only after waiting for the peer's message rate limit",
            self.message_waits.clone(),
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
            "int_dataplane_isolated_objects",
            "Objects that could not be programmed and were isolated (kept at their last good state or fail-closed); GetStatus names each",
            self.isolated.clone(),
        );
        registry.register(
            "grpc_feeders",
            "Feeder streams (ToDataplane) open",
            self.feeders.clone(),
        );
        registry.register(
            "grpc_watchers",
            "StatusUpdates streams open",
            self.watchers.clone(),
        );
        registry.register(
            "iptables_restore_calls",
            "iptables-restore runs",
            self.iptables_restore_calls.clone(),
        );
        registry.register(
            "iptables_restore_errors",
            "iptables-restore runs that failed",
            self.iptables_restore_errors.clone(),
        );
        registry.register(
            "iptables_save_calls",
            "iptables-save runs",
            self.iptables_save_calls.clone(),
        );
        registry.register(
            "iptables_save_errors",
            "iptables-save runs that failed",
            self.iptables_save_errors.clone(),
        );
        registry.register(
            "iptables_lines_executed",
            "Lines fed to iptables-restore",
            self.iptables_lines.clone(),
        );
        registry.register(
            "iptables_chains",
            "Our chains in the table, as last read or written",
            self.iptables_chains.clone(),
        );
        registry.register(
            "iptables_rules",
            "Our rules in the table, as last read or written",
            self.iptables_rules.clone(),
        );
        registry.register(
            "nftables_commits",
            "nftables commits that changed something",
            self.nftables_commits.clone(),
        );
        registry.register(
            "nftables_validating_commits",
            "nftables commits that add rules (the kernel walks the table to validate them)",
            self.nftables_validating_commits.clone(),
        );
        registry.register(
            "nftables_commit_seconds",
            "Time of an nftables commit, batch sent to the kernel's reply",
            self.nftables_commit_time.clone(),
        );
        registry.register(
            "nftables_chains",
            "Chains in our nftables table, as last read or written",
            self.nftables_chains.clone(),
        );
        registry.register(
            "nftables_rules",
            "Rules in our nftables table, as last read or written",
            self.nftables_rules.clone(),
        );
        registry.register("ipset_calls", "ipset runs", self.ipset.calls.clone());
        registry.register(
            "ipset_errors",
            "ipset runs that failed",
            self.ipset.errors.clone(),
        );
        registry.register(
            "ipset_lines_executed",
            "Lines fed to ipset restore",
            self.ipset.lines.clone(),
        );
        registry.register("ipsets", "Our IP sets", self.ipsets.clone());
        registry.register(
            "routes",
            "Routes, neighbours and FDB entries we hold, by kind",
            self.routes.clone(),
        );
        registry.register(
            "wireguard_peers",
            "WireGuard peers configured on the device",
            self.wireguard_peers.clone(),
        );
        registry.register(
            "xdp_interfaces",
            "Interfaces with the XDP prefilter attached",
            self.xdp_interfaces.clone(),
        );
        registry.register_collector(Box::new(self.kernel.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(m: &Metrics) -> String {
        let mut r = Registry::with_prefix("dphandler");
        m.register(&mut r);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        out
    }

    #[test]
    fn iptables_restores_count_lines_by_table_and_failures() {
        let m = Metrics::default();
        let tool = m.iptables_tool(crate::model::IpVersion::V6);
        let input = "*filter\n:dph-x - [0:0]\n-A dph-x -j ACCEPT\nCOMMIT\n*raw\nCOMMIT\n";
        tool.count_restore(input, &Ok::<(), ()>(()));
        tool.count_restore("*raw\nCOMMIT\n", &Err::<(), ()>(()));
        let t = text(&m);
        for line in [
            "dphandler_iptables_restore_calls_total{ip_version=\"6\"} 2",
            "dphandler_iptables_restore_errors_total{ip_version=\"6\"} 1",
            "dphandler_iptables_lines_executed_total{ip_version=\"6\",table=\"filter\"} 4",
            "dphandler_iptables_lines_executed_total{ip_version=\"6\",table=\"raw\"} 4",
        ] {
            assert!(t.contains(line), "{line} in\n{t}");
        }
    }

    #[test]
    fn ipset_runs_count_calls_errors_and_lines() {
        let m = Metrics::default();
        m.ipset
            .count("create a hash:ip\nadd a 10.0.0.1\n", &Ok::<(), ()>(()));
        m.ipset.count("", &Err::<(), ()>(()));
        let t = text(&m);
        assert!(t.contains("dphandler_ipset_calls_total 2"), "{t}");
        assert!(t.contains("dphandler_ipset_errors_total 1"), "{t}");
        assert!(t.contains("dphandler_ipset_lines_executed_total 2"), "{t}");
    }

    #[test]
    fn kernel_readings_are_encoded_as_read_and_gone_when_gone() {
        let m = Metrics::default();
        let v4 = version_label(crate::model::IpVersion::V4);
        m.kernel.set_wireguard(
            &v4,
            vec![PeerReading {
                public_key: "k+/=".into(),
                rx_bytes: 10,
                tx_bytes: 20,
                latest_handshake: Some(1_700_000_000),
            }],
        );
        m.kernel.set_xdp(BTreeMap::from([(
            "eth0".to_string(),
            vec![("dropped", 3, 300), ("passed", 5, 500)],
        )]));
        let t = text(&m);
        for line in [
            "dphandler_wireguard_bytes_rcvd_total{ip_version=\"4\",public_key=\"k+/=\"} 10",
            "dphandler_wireguard_bytes_sent_total{ip_version=\"4\",public_key=\"k+/=\"} 20",
            "dphandler_wireguard_latest_handshake_seconds{ip_version=\"4\",public_key=\"k+/=\"} 1700000000",
            "dphandler_xdp_packets_total{iface=\"eth0\",verdict=\"dropped\"} 3",
            "dphandler_xdp_bytes_total{iface=\"eth0\",verdict=\"passed\"} 500",
        ] {
            assert!(t.contains(line), "{line} in\n{t}");
        }
        // A counter the kernel reset is shown as the kernel has it.
        m.kernel.set_xdp(BTreeMap::from([(
            "eth0".to_string(),
            vec![("dropped", 1, 100)],
        )]));
        m.kernel.set_wireguard(&v4, Vec::new());
        let t = text(&m);
        assert!(
            t.contains("dphandler_xdp_packets_total{iface=\"eth0\",verdict=\"dropped\"} 1"),
            "{t}"
        );
        assert!(!t.contains("wireguard_bytes"), "{t}");
        assert!(!t.contains("verdict=\"passed\""), "{t}");
    }
}
