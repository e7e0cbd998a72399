//! `dphandler`: the dataplane daemon.

use std::path::PathBuf;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, bail};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, parser::ValueSource};
use dphandler_dataplane::backends::cleanup::Cleanup;
use dphandler_dataplane::backends::iprules::{IpRules, netlink::IpRuleNetlink};
use dphandler_dataplane::backends::ipsets::{IpSets, restore::IpsetTool};
use dphandler_dataplane::backends::iptables::restore::{
    self as iptables_restore, FlavorChoice, IptablesTool,
};
use dphandler_dataplane::backends::iptables::{InsertMode, Table};
use dphandler_dataplane::backends::nftables::Dataplane;
use dphandler_dataplane::backends::nftables::shards::ShardLayout;
use dphandler_dataplane::backends::routes::{RouteOwnership, Routes, netlink::RouteNetlink};
use dphandler_dataplane::backends::sysctl::{Forwarding, NodeSettings, Sysctls};
use dphandler_dataplane::backends::vxlan::{Vxlan, netlink::VxlanNetlink};
use dphandler_dataplane::backends::wireguard::{Wireguard, device::WgNetlink, keys::KeyStore};
use dphandler_dataplane::backends::xdp::{BpfSeam, Xdp};
use dphandler_dataplane::backends::{Backend, DesiredKernel};
use dphandler_dataplane::generictables::Ownership;
use dphandler_dataplane::managers::nat::NatManager;
use dphandler_dataplane::managers::{
    Manager,
    endpoints::{EndpointsConfig, EndpointsManager},
    ipsets::IpSetsManager,
    routes::{RoutesConfig, RoutesManager, VXLAN_V4, VXLAN_V6, VxlanMode},
    wireguard::{WireguardConfig, WireguardManager},
    xdp::{XdpManager, proto_number},
};
use dphandler_dataplane::model::Marks;
use dphandler_dataplane::model::{
    IfaceName, IpVersion,
    ipsets::SetNames,
    wireguard::{WgImpl, WgSettings},
};
use dphandler_dataplane::sync_loop::LoopConfig;
use dphandler_proto::wire::raw::dataplane_server::DataplaneServer;
use dphandler_server::access::limit_connections;
use dphandler_server::limits;
use dphandler_server::{connector, grpc::DataplaneService, listen};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use tower_governor::GovernorLayer;
use tracing::{error, info, warn};

mod demo;

// The API path allocates a little for every message (decoded strings, model
// values); glibc's malloc showed up as a quarter of the server's CPU in the
// throughput benchmark. mimalloc is well kept and a drop-in.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(
    name = "dphandler",
    version,
    about = "Linux dataplane daemon driven over gRPC by a Calico-style calc graph"
)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax). Given, it holds over a
    /// ConfigUpdate's LogSeverityScreen; unset, that sets the level.
    #[arg(long, env = "DPH_LOG", default_value = "info", global = true)]
    log: String,
    /// Log as JSON lines.
    #[arg(long, env = "DPH_LOG_JSON", global = true)]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the Dataplane API.
    Serve(Box<ServeArgs>),
    /// Run the real server in a sandbox network namespace, push the bundled
    /// scenario through gRPC, wait for DataplaneInSync and print what was
    /// programmed. Needs root; the host's namespace is left alone.
    Demo(demo::DemoArgs),
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Unix socket to listen on (mode 0660).
    #[arg(
        long,
        env = "DPH_SOCKET",
        default_value = "/run/dphandler/dataplane.sock"
    )]
    socket: PathBuf,
    /// Group that owns the unix socket (a name or a number): its members
    /// may use the API without root. Default: the daemon's own group.
    #[arg(long, env = "DPH_SOCKET_GROUP")]
    socket_group: Option<String>,
    /// A second unix socket that only reads (GetStatus, StatusUpdates,
    /// health, reflection; not ToDataplane), for those who only watch
    /// (`dphctl status` falls back to it); `none` for none. Default:
    /// beside --socket, `<name>-status.sock`.
    #[arg(long, env = "DPH_STATUS_SOCKET")]
    status_socket: Option<String>,
    /// Group that owns the status socket (mode 0660). Default:
    /// --socket-group's.
    #[arg(long, env = "DPH_STATUS_SOCKET_GROUP")]
    status_socket_group: Option<String>,
    /// Connections each listener (unix socket, status socket, TCP) holds
    /// open at once; more wait in the backlog.
    #[arg(long, env = "DPH_MAX_CONNECTIONS", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    max_connections: u32,
    /// DNS names (subject alternative names) of which a TCP client's
    /// certificate must carry one; repeat or separate with commas.
    /// Default: any certificate the --tls-ca signed.
    #[arg(
        long = "tls-client-name",
        env = "DPH_TLS_CLIENT_NAMES",
        value_delimiter = ','
    )]
    tls_client_names: Vec<String>,
    /// Also listen on TCP at this address (e.g. `0.0.0.0:50051`). Requires
    /// --tls-cert, --tls-key and --tls-ca (clients must present a certificate
    /// signed by that CA) unless --insecure-tcp.
    #[arg(long, env = "DPH_TCP")]
    tcp: Option<std::net::SocketAddr>,
    /// Server certificate (PEM) for the TCP listener.
    #[arg(long, env = "DPH_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// Key (PEM) of the server certificate.
    #[arg(long, env = "DPH_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// CA bundle (PEM) that client certificates must chain to.
    #[arg(long, env = "DPH_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Serve TCP without TLS or client authentication. Anyone who can reach
    /// the port can then rewrite this node's dataplane: only for tests.
    #[arg(long, env = "DPH_INSECURE_TCP")]
    insecure_tcp: bool,
    /// Largest message accepted, in bytes (1 KiB to 256 MiB). The default
    /// takes Felix's largest, an IP set of a million IPv6 addresses.
    #[arg(long, env = "DPH_MAX_MESSAGE_BYTES", default_value_t = dphandler_proto::DEFAULT_MAX_MESSAGE_BYTES, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1024..=256 << 20))]
    max_message_bytes: usize,
    /// Concurrent HTTP/2 streams per connection.
    #[arg(long, env = "DPH_MAX_CONCURRENT_STREAMS", default_value_t = 64)]
    max_concurrent_streams: u32,
    /// gRPC calls per second allowed to each peer (IP on TCP, uid on the
    /// unix socket); a stream counts once however many messages it carries.
    #[arg(long, env = "DPH_RATE_LIMIT_PER_SECOND", default_value_t = 20.0)]
    rate_limit_per_second: f64,
    /// Calls a peer may make in a burst before the rate applies.
    #[arg(long, env = "DPH_RATE_LIMIT_BURST", default_value_t = 100)]
    rate_limit_burst: u32,
    /// Messages per second each peer may send over its ToDataplane
    /// streams together; a peer over it is slowed down (its stream waits),
    /// nothing is dropped.
    #[arg(long, env = "DPH_MESSAGE_RATE_PER_SECOND", default_value_t = 100_000.0)]
    message_rate_per_second: f64,
    /// Messages a peer may send in a burst (a snapshot) before the message
    /// rate applies.
    #[arg(long, env = "DPH_MESSAGE_BURST", default_value_t = 2_000_000)]
    message_burst: u32,
    /// Most objects of one kind held at once (workload endpoints, policies,
    /// IP sets, routes, …): a message that would add one more is rejected.
    #[arg(long, env = "DPH_MAX_OBJECTS_PER_KIND", default_value_t = dphandler_dataplane::sync_loop::DEFAULT_MAX_OBJECTS_PER_KIND, value_parser = clap::value_parser!(u64).range(1..))]
    max_objects_per_kind: u64,
    /// Seconds open streams get to finish after SIGTERM/SIGINT.
    #[arg(long, env = "DPH_SHUTDOWN_GRACE_SECONDS", default_value_t = 2.0)]
    shutdown_grace_seconds: f64,
    /// Prefix of every kernel object the daemon owns (IP sets are
    /// `<prefix>40<id>` / `<prefix>60<id>`); 1-7 letters or digits (the longest
    /// chain name, `<prefix>-thfw-<15-character interface>`, fits iptables'
    /// 28 characters).
    #[arg(long, env = "DPH_PREFIX", default_value = "dph")]
    prefix: String,
    /// Largest IP set (its `maxelem`); a set that would grow beyond it is
    /// rejected.
    #[arg(long, env = "DPH_MAX_IPSET_SIZE", default_value_t = dphandler_dataplane::managers::ipsets::DEFAULT_MAX_SIZE)]
    max_ipset_size: u32,
    /// Most members over all IP sets together; a message that would go
    /// beyond is rejected.
    #[arg(long, env = "DPH_MAX_IPSET_MEMBERS", default_value_t = dphandler_dataplane::managers::ipsets::DEFAULT_MAX_MEMBERS)]
    max_ipset_members: usize,
    /// Seconds between re-reads of the kernel's IP sets (0: never); what was
    /// changed by hand is repaired then.
    #[arg(long, env = "DPH_IPSET_REFRESH_SECONDS", default_value_t = 90.0)]
    ipset_refresh_seconds: f64,
    /// Seconds before a failed apply is retried.
    #[arg(long, env = "DPH_RETRY_SECONDS", default_value_t = 10.0)]
    retry_seconds: f64,
    /// Under sustained changes, applies start at most once per this many
    /// seconds (after a burst of 10).
    #[arg(long, env = "DPH_APPLY_INTERVAL_SECONDS", default_value_t = 0.02)]
    apply_interval_seconds: f64,
    /// Under sustained changes, the share of the time spent applying at
    /// most (0 < duty <= 1; 1: applies run back to back): a dear apply is
    /// followed by a wait that batches what comes in meanwhile.
    #[arg(long, env = "DPH_APPLY_DUTY", default_value_t = 0.5)]
    apply_duty: f64,
    /// Seconds between re-reads of our iptables tables (0: never).
    #[arg(long, env = "DPH_IPTABLES_REFRESH_SECONDS", default_value_t = 180.0)]
    iptables_refresh_seconds: f64,
    /// What programs policy: `iptables` (iptables-restore and ipset; the
    /// flavour below), `nftables` (our own nf_tables tables and sets over
    /// netlink), or `auto` (iptables, until the nftables dataplane has
    /// passed everything the iptables one does).
    #[arg(long, env = "DPH_DATAPLANE", value_enum, default_value = "auto")]
    dataplane: DataplaneChoice,
    /// nftables: how many tables workload policy is spread over (each
    /// workload's chains, with copies of the policy chains and IP sets
    /// they use, in one), so that a rule change makes the kernel check one
    /// small table rather than all of filter. 0 or 1: all in filter.
    #[arg(long, env = "DPH_NFTABLES_SHARDS", default_value_t = 32, value_parser = clap::value_parser!(u32).range(0..=32))]
    nftables_shards: u32,
    /// nftables: workload interfaces a shard holds before the next shard
    /// table is opened (an empty shard has no hooks; each open one costs
    /// every forwarded packet two hook calls). 0: all shards open from
    /// the start.
    #[arg(long, env = "DPH_NFTABLES_WORKLOADS_PER_SHARD", default_value_t = 256)]
    nftables_workloads_per_shard: u32,
    /// iptables flavour: auto (detect which one the host uses), nft or legacy.
    #[arg(long, env = "DPH_IPTABLES_BACKEND", default_value = "auto")]
    iptables_backend: FlavorChoice,
    /// Where our rules go in the built-in chains: insert (top) or append.
    #[arg(long, env = "DPH_CHAIN_INSERT_MODE", default_value = "insert")]
    chain_insert_mode: InsertMode,
    /// Validate and hold the desired state, report in sync, but program
    /// nothing in the kernel (for trying a feeder, and for benchmarks of
    /// the API path).
    #[arg(long, env = "DPH_DRY_RUN")]
    dry_run: bool,
    /// Protocol number of the routes that are ours by protocol alone:
    /// blackholes for local blocks, same-subnet, no-encap and IPIP routes
    /// (Felix's 80).
    #[arg(long, env = "DPH_ROUTE_PROTOCOL", default_value_t = 80)]
    route_protocol: u8,
    /// Protocol number of the routes through our own devices (workload
    /// interfaces, vxlan.calico), which are ours by their device (Felix's
    /// DeviceRouteProtocol, 3 = boot).
    #[arg(long, env = "DPH_DEVICE_ROUTE_PROTOCOL", default_value_t = 3)]
    device_route_protocol: u8,
    /// Remove every route on a workload interface that the calc graph did
    /// not ask for, whoever made it (Felix's RemoveExternalRoutes); `false`
    /// removes only routes with our protocols there.
    #[arg(long, env = "DPH_REMOVE_EXTERNAL_ROUTES", default_value_t = true, action = clap::ArgAction::Set)]
    remove_external_routes: bool,
    /// This node's name, as the calc graph calls it: tells this node's
    /// VTEP and host metadata from the other nodes'. Default: the
    /// kernel's hostname. A ConfigUpdate's `FelixHostname` overrides it.
    #[arg(long, env = "DPH_HOSTNAME")]
    hostname: Option<String>,
    /// VXLAN between nodes: auto (as the calc graph's Encapsulation
    /// message says), enabled or disabled.
    #[arg(long, env = "DPH_VXLAN", default_value = "auto")]
    vxlan: VxlanMode,
    /// VXLAN network identifier (Felix's VXLANVNI).
    #[arg(long, env = "DPH_VXLAN_VNI", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..16_777_216))]
    vxlan_vni: u32,
    /// VXLAN UDP port (Felix's VXLANPort).
    #[arg(long, env = "DPH_VXLAN_PORT", default_value_t = 4789, value_parser = clap::value_parser!(u16).range(1..))]
    vxlan_port: u16,
    /// MTU of vxlan.calico; default: the parent interface's MTU − 50.
    #[arg(long, env = "DPH_VXLAN_MTU", value_parser = clap::value_parser!(u32).range(68..65536))]
    vxlan_mtu: Option<u32>,
    /// MTU of vxlan-v6.calico; default: the parent interface's MTU − 70.
    #[arg(long, env = "DPH_VXLAN_MTU_V6", value_parser = clap::value_parser!(u32).range(1280..65536))]
    vxlan_mtu_v6: Option<u32>,
    /// WireGuard for IPv4 pod traffic between nodes (Felix's
    /// WireguardEnabled; a ConfigUpdate's `WireguardEnabled` overrides it).
    #[arg(long, env = "DPH_WIREGUARD", default_value_t = false, action = clap::ArgAction::Set)]
    wireguard: bool,
    /// WireGuard for IPv6 (Felix's WireguardEnabledV6).
    #[arg(long, env = "DPH_WIREGUARD_V6", default_value_t = false, action = clap::ArgAction::Set)]
    wireguard_v6: bool,
    /// The IPv4 WireGuard device (Felix's WireguardInterfaceName).
    #[arg(long, env = "DPH_WIREGUARD_INTERFACE", default_value = "wireguard.cali", value_parser = parse_iface)]
    wireguard_interface: String,
    /// The IPv6 WireGuard device (Felix's WireguardInterfaceNameV6).
    #[arg(long, env = "DPH_WIREGUARD_INTERFACE_V6", default_value = "wg-v6.cali", value_parser = parse_iface)]
    wireguard_interface_v6: String,
    /// WireGuard UDP port (Felix's WireguardListeningPort).
    #[arg(long, env = "DPH_WIREGUARD_PORT", default_value_t = 51820, value_parser = clap::value_parser!(u16).range(1..))]
    wireguard_port: u16,
    /// IPv6 WireGuard UDP port (Felix's WireguardListeningPortV6).
    #[arg(long, env = "DPH_WIREGUARD_PORT_V6", default_value_t = 51821, value_parser = clap::value_parser!(u16).range(1..))]
    wireguard_port_v6: u16,
    /// MTU of the IPv4 device; default: the host interface's MTU − 60.
    #[arg(long, env = "DPH_WIREGUARD_MTU", value_parser = clap::value_parser!(u32).range(68..65536))]
    wireguard_mtu: Option<u32>,
    /// MTU of the IPv6 device; default: the host interface's MTU − 80.
    #[arg(long, env = "DPH_WIREGUARD_MTU_V6", value_parser = clap::value_parser!(u32).range(1280..65536))]
    wireguard_mtu_v6: Option<u32>,
    /// Priority of the rule into WireGuard's table (Felix's
    /// WireguardRoutingRulePriority).
    #[arg(long, env = "DPH_WIREGUARD_RULE_PRIORITY", default_value_t = 99, value_parser = clap::value_parser!(u32).range(1..32766))]
    wireguard_rule_priority: u32,
    /// WireGuard's routing table for IPv4 (Felix takes the first index of
    /// its RouteTableRanges, 1); every route in it is ours.
    #[arg(long, env = "DPH_WIREGUARD_TABLE", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..253))]
    wireguard_table: u32,
    /// WireGuard's routing table for IPv6 (Felix: the next index, 2).
    #[arg(long, env = "DPH_WIREGUARD_TABLE_V6", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..253))]
    wireguard_table_v6: u32,
    /// What carries the devices: the kernel's module, wireguard-go
    /// (userspace), or auto (the kernel where it has the module).
    #[arg(long, env = "DPH_WIREGUARD_IMPL", default_value = "auto")]
    wireguard_impl: WgImpl,
    /// The wireguard-go to run where the kernel has no WireGuard.
    #[arg(long, env = "DPH_WIREGUARD_GO", default_value = "wireguard-go")]
    wireguard_go: PathBuf,
    /// Where the daemon keeps state across restarts (the WireGuard keys,
    /// wireguard-go's pid and log); empty: nowhere.
    #[arg(long, env = "DPH_STATE_DIR", default_value = "/var/lib/dphandler")]
    state_dir: PathBuf,
    /// Prometheus metrics over HTTP (`/metrics`); `none` turns them off.
    /// Not Felix's 9091: on a Calico node both share the node's network.
    #[arg(long, env = "DPH_METRICS_ADDR", default_value = "127.0.0.1:9191")]
    metrics_addr: String,
    /// Felix-style health probes over HTTP (`/liveness`, `/readiness`);
    /// `none` turns them off. Not Felix's 9099.
    #[arg(long, env = "DPH_HEALTH_ADDR", default_value = "127.0.0.1:9199")]
    health_addr: String,
    /// How long the sync loop may go without turning before `/liveness`
    /// fails (it turns every few seconds when idle; a long apply holds it).
    #[arg(long, env = "DPH_LIVENESS_TIMEOUT_SECONDS", default_value_t = 90.0)]
    liveness_timeout_seconds: f64,
    /// XDP acceleration of untracked ingress deny on host endpoints
    /// (Felix's XDPEnabled): `enabled` or `disabled` (then an earlier run's
    /// XDP programs are removed).
    #[arg(long, env = "DPH_XDP", value_enum, default_value = "enabled")]
    xdp: Switch,
    /// Where the XDP programs' links and maps are pinned (a bpffs; mounted
    /// there if it is not one).
    #[arg(long, env = "DPH_BPFFS", default_value = "/sys/fs/bpf")]
    bpffs: PathBuf,
    /// Seconds between checks of the XDP programs and maps (0: never).
    #[arg(long, env = "DPH_XDP_REFRESH_SECONDS", default_value_t = 90.0)]
    xdp_refresh_seconds: f64,
    /// Seconds between re-reads of our routes (0: never).
    #[arg(long, env = "DPH_ROUTE_REFRESH_SECONDS", default_value_t = 90.0)]
    route_refresh_seconds: f64,
    /// Ports reaching the host that no host-endpoint policy can close
    /// (`proto:port,…`; Felix's FailsafeInboundHostPorts).
    #[arg(long, env = "DPH_FAILSAFE_INBOUND", default_value = "tcp:22,udp:68,tcp:179,tcp:2379,tcp:2380,tcp:5473,tcp:6443,tcp:6666,tcp:6667", value_parser = parse_ports)]
    failsafe_inbound: PortList,
    /// Ports the host may always reach (Felix's FailsafeOutboundHostPorts).
    #[arg(long, env = "DPH_FAILSAFE_OUTBOUND", default_value = "udp:53,udp:67,tcp:179,tcp:2379,tcp:2380,tcp:5473,tcp:6443,tcp:6666,tcp:6667", value_parser = parse_ports)]
    failsafe_outbound: PortList,
    /// Name prefix of workload interfaces (Felix's InterfacePrefix).
    #[arg(long, env = "DPH_WORKLOAD_IFACE_PREFIX", default_value = "cali")]
    workload_iface_prefix: String,
    /// Program IPv6 as well as IPv4.
    #[arg(long, env = "DPH_IPV6", default_value_t = true, action = clap::ArgAction::Set)]
    ipv6: bool,
    /// Turn on the node's global forwarding (`net.ipv4.ip_forward=1` and,
    /// with --ipv6, `net.ipv6.conf.all.forwarding=1`) once policy is
    /// programmed, and keep it on (Felix's IPForwarding). `disabled`
    /// leaves both as they are: then whoever manages the node must turn
    /// them on, or workloads reach nothing beyond the node.
    #[arg(long, env = "DPH_IP_FORWARDING", default_value = "enabled")]
    ip_forwarding: Forwarding,
    /// Where the kernel's `/proc/sys` is: the daemon writes only under its
    /// `net/`. An unprivileged container's `/proc/sys` is read-only; the
    /// Helm chart mounts the host's `/proc/sys/net` at
    /// `/host/proc/sys/net` and points this at `/host/proc/sys`.
    #[arg(long, env = "DPH_PROC_SYS", default_value = "/proc/sys")]
    proc_sys: PathBuf,
    /// The mark bits the daemon may use (Felix's IptablesMarkMask): accept,
    /// pass, Felix's drop, two scratch bits and WireGuard's, from the
    /// lowest; at least six bits.
    #[arg(long, env = "DPH_IPTABLES_MARK_MASK", default_value = "0xffff0000")]
    iptables_mark_mask: String,
    /// What becomes of traffic from a workload to this host once its
    /// egress policy allowed it (Felix's DefaultEndpointToHostAction):
    /// `accept`, `drop` or `return` (to the rest of INPUT). Felix's default
    /// is drop; Calico's manifests set accept, as here.
    #[arg(
        long,
        env = "DPH_DEFAULT_ENDPOINT_TO_HOST_ACTION",
        default_value = "accept"
    )]
    default_endpoint_to_host_action: dphandler_dataplane::model::config::EndpointToHost,
}

/// A `proto:port,…` list (one value, so clap does not take it for a
/// repeated flag).
#[derive(Debug, Clone)]
struct PortList(Vec<(String, u16)>);

/// `tcp:22,udp:68` → [("tcp", 22), ("udp", 68)].
fn parse_iface(s: &str) -> Result<String, String> {
    IfaceName::new(s)
        .map(|n| n.as_str().to_string())
        .map_err(|e| e.reason)
}

fn parse_ports(s: &str) -> Result<PortList, String> {
    s.split(',')
        .filter(|x| !x.is_empty())
        .map(|x| {
            let (p, port) = x
                .split_once(':')
                .ok_or_else(|| format!("{x:?}: expected proto:port, e.g. tcp:22"))?;
            if !matches!(p, "tcp" | "udp" | "sctp") {
                return Err(format!("{x:?}: protocol must be tcp, udp or sctp"));
            }
            let port: u16 = port
                .parse()
                .map_err(|_| format!("{x:?}: port must be 0-65535"))?;
            Ok((p.to_string(), port))
        })
        .collect::<Result<_, _>>()
        .map(PortList)
}

impl ServeArgs {
    /// The TCP listener's TLS settings: `Ok(None)` for --insecure-tcp.
    fn tcp_tls(&self) -> anyhow::Result<Option<ServerTlsConfig>> {
        let read =
            |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        match (
            &self.tls_cert,
            &self.tls_key,
            &self.tls_ca,
            self.insecure_tcp,
        ) {
            (Some(cert), Some(key), Some(ca), false) => Ok(Some(
                ServerTlsConfig::new()
                    .identity(Identity::from_pem(read(cert)?, read(key)?))
                    .client_ca_root(Certificate::from_pem(read(ca)?))
                    .client_auth_optional(false)
                    // A peer that opens a connection and never finishes
                    // its handshake lets its slot go.
                    .timeout(TLS_HANDSHAKE_TIMEOUT),
            )),
            (None, None, None, true) if !self.tls_client_names.is_empty() => {
                bail!("--tls-client-name needs TLS (client certificates): not with --insecure-tcp")
            }
            (None, None, None, true) => Ok(None),
            (_, _, _, true) => bail!("--insecure-tcp and --tls-* exclude each other"),
            (None, None, None, false) => bail!(
                "refusing to listen on TCP without TLS: give --tls-cert, --tls-key and \
                 --tls-ca (client certificates are required), or --insecure-tcp for a test setup"
            ),
            _ => bail!("--tls-cert, --tls-key and --tls-ca go together"),
        }
    }
}

/// What programs policy (`--dataplane`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DataplaneChoice {
    /// iptables, until the nftables dataplane has passed everything the
    /// iptables one does.
    Auto,
    /// iptables-restore and ipset.
    Iptables,
    /// The daemon's own nf_tables tables and sets over netlink.
    Nftables,
}

/// On or off (`--xdp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Switch {
    Enabled,
    Disabled,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let matches = Cli::command().get_matches();
    // `--log` (or `DPH_LOG`) given by the operator wins over the calc
    // graph's LogSeverityScreen, as Felix's environment wins over its
    // datastore config.
    let log_given = matches!(
        matches.value_source("log"),
        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
    );
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    use tracing_subscriber::{EnvFilter, layer::SubscriberExt, reload, util::SubscriberInitExt};
    let filter = EnvFilter::try_new(&cli.log).context("bad --log filter")?;
    // The filter can change at run time (a ConfigUpdate's LogSeverityScreen).
    let (filter, reload) = reload::Layer::new(filter);
    let registry = tracing_subscriber::registry().with(filter);
    if cli.log_json {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_writer(std::io::stderr),
            )
            .init()
    } else {
        registry
            .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
            .init()
    }
    exit_on_panic();
    let flag = cli.log.clone();
    let log_hook: Option<dphandler_dataplane::sync_loop::LogLevelHook> = (!log_given).then(|| {
        Box::new(move |level: Option<&str>| {
            let f = EnvFilter::try_new(level.unwrap_or(&flag)).map_err(|e| e.to_string())?;
            reload.reload(f).map_err(|e| e.to_string())
        }) as dphandler_dataplane::sync_loop::LogLevelHook
    });
    match cli.command {
        Command::Serve(args) => serve(*args, log_hook).await,
        // On Ctrl-C the demo's future is dropped, and with it the guards that
        // stop the server and remove the namespace.
        Command::Demo(args) => tokio::select! {
            r = demo::run(args, &cli.log) => r,
            _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; sandbox removed"),
        },
    }
}

/// How long a TCP client has to finish its TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// HTTP/2 pings on an idle connection, and how long the answer may take:
/// a peer that went away without closing frees its slot.
const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Exit status of a daemon that panicked (BSD's `EX_SOFTWARE`).
const PANIC_EXIT: i32 = 70;

/// A panic on any thread or task ends the process with [`PANIC_EXIT`] and
/// one log line saying where: a daemon whose loop died but whose sockets
/// still answered "the dataplane is shutting down" was stuck for good (its
/// supervisor saw it running). Exiting lets the supervisor restart it, and
/// the restart adopts what the kernel holds (nothing is flushed).
fn exit_on_panic() {
    std::panic::set_hook(Box::new(|info| {
        let what = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into());
        let at = info.location().map(ToString::to_string).unwrap_or_default();
        let thread = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_string();
        tracing::error!(
            panic = %what,
            location = %at,
            thread = %thread,
            status = PANIC_EXIT,
            "panicked: the daemon exits so that its supervisor restarts it (the kernel is left as it is)"
        );
        eprintln!("{}", std::backtrace::Backtrace::force_capture());
        std::process::exit(PANIC_EXIT);
    }));
}

/// SIGTERM and SIGINT, caught from the moment this is called: made before
/// anything is bound, so that a signal that comes while the daemon starts
/// (a pod deleted at once) still stops it the orderly way.
///
/// Besides the future, a flag the signal handler sets itself: the sync loop
/// reads it before each apply, so nothing is applied after the signal even
/// when the loop turns before the future is polled (the device lost with a
/// `wireguard-go` killed in the same drain was made again, and outlived the
/// daemon: CI). signal-hook's flag beside tokio's stream: both register
/// through signal-hook-registry, which calls every action of a signal.
fn shutdown_signal() -> anyhow::Result<(impl std::future::Future<Output = ()>, Arc<AtomicBool>)> {
    use tokio::signal::unix::{SignalKind, signal};
    let stopping = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stopping.clone()).context("catching SIGTERM/SIGINT")?;
    }
    let mut term = signal(SignalKind::terminate()).context("catching SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("catching SIGINT")?;
    let stopped = async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM: stopping; kernel state is left as it is"),
            _ = int.recv() => info!("SIGINT: stopping; kernel state is left as it is"),
        }
    };
    Ok((stopped, stopping))
}

/// Where the restart keys of the last ConfigUpdate are kept.
fn kept_config_path(args: &ServeArgs) -> Option<PathBuf> {
    (!args.state_dir.as_os_str().is_empty()).then(|| args.state_dir.join("felix-config"))
}

/// The restart keys (`InterfacePrefix`, `IptablesMarkMask`, `IPForwarding`)
/// the calc graph's last ConfigUpdate asked for, kept in the state
/// directory: in force from this start on, over their flags (as a
/// ConfigUpdate's keys are over the flags). Returns the mark mask.
fn apply_kept_config(args: &mut ServeArgs, mask: u32) -> anyhow::Result<u32> {
    use dphandler_dataplane::model::config::FelixConfig;
    let Some(path) = kept_config_path(args) else {
        return Ok(mask);
    };
    let kv = dphandler_dataplane::sync_loop::read_kept(&path)
        .with_context(|| format!("reading {}", path.display()))?;
    let kept = match FelixConfig::parse(&kv) {
        Ok(k) => k,
        Err((key, why)) => {
            warn!(path = %path.display(), key, %why, "ignoring the kept ConfigUpdate keys");
            return Ok(mask);
        }
    };
    if let Some(p) = kept.interface_prefix
        && p != args.workload_iface_prefix
    {
        info!(from = %args.workload_iface_prefix, to = %p, "InterfacePrefix from the last ConfigUpdate (kept), over --workload-iface-prefix");
        args.workload_iface_prefix = p;
    }
    if let Some(f) = kept.ip_forwarding {
        let f = if f {
            Forwarding::Enabled
        } else {
            Forwarding::Disabled
        };
        if f != args.ip_forwarding {
            info!(to = ?f, "IPForwarding from the last ConfigUpdate (kept), over --ip-forwarding");
            args.ip_forwarding = f;
        }
    }
    Ok(match kept.mark_mask {
        Some(m) if m != mask => {
            info!(from = %format!("{mask:#x}"), to = %format!("{m:#x}"), "IptablesMarkMask from the last ConfigUpdate (kept), over --iptables-mark-mask");
            m
        }
        _ => mask,
    })
}

async fn serve(
    args: ServeArgs,
    log_hook: Option<dphandler_dataplane::sync_loop::LogLevelHook>,
) -> anyhow::Result<()> {
    let (signalled_by, stopping) = shutdown_signal()?;
    let secs = |v: f64, flag: &str| {
        dphandler_dataplane::model::config::interval(v)
            .map_err(|why| anyhow::anyhow!("{flag}: {why}"))
    };
    let grace = secs(args.shutdown_grace_seconds, "--shutdown-grace-seconds")?;
    // Check every setting before binding anything.
    let tcp_tls = match args.tcp {
        Some(_) => Some(args.tcp_tls()?),
        None => None,
    };
    let governor = Arc::new(
        limits::governor_config(args.rate_limit_per_second, args.rate_limit_burst)
            .context("--rate-limit-per-second / --rate-limit-burst")?,
    );
    let message_limiter = limits::message_limiter(args.message_rate_per_second, args.message_burst)
        .context("--message-rate-per-second / --message-burst")?;
    let socket_group = args
        .socket_group
        .as_deref()
        .map(listen::group)
        .transpose()
        .context("--socket-group")?;
    let liveness_timeout = secs(args.liveness_timeout_seconds, "--liveness-timeout-seconds")?;
    let loop_cfg = LoopConfig {
        // An idle loop turns well within the liveness timeout.
        liveness_tick: (liveness_timeout / 4).clamp(
            std::time::Duration::from_millis(100),
            std::time::Duration::from_secs(5),
        ),
        ipset_refresh: secs(args.ipset_refresh_seconds, "--ipset-refresh-seconds")?,
        iptables_refresh: secs(args.iptables_refresh_seconds, "--iptables-refresh-seconds")?,
        route_refresh: secs(args.route_refresh_seconds, "--route-refresh-seconds")?,
        xdp_refresh: secs(args.xdp_refresh_seconds, "--xdp-refresh-seconds")?,
        retry_interval: secs(args.retry_seconds, "--retry-seconds")?,
        throttle_period: secs(args.apply_interval_seconds, "--apply-interval-seconds")?,
        apply_duty: if args.apply_duty > 0.0 && args.apply_duty <= 1.0 {
            args.apply_duty
        } else {
            bail!("--apply-duty must be above 0 and at most 1")
        },
        max_objects_per_kind: args.max_objects_per_kind,
        ..LoopConfig::default()
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let loop_stop = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let names =
        SetNames::new(&args.prefix).map_err(|e| anyhow::anyhow!("--prefix: {}", e.reason))?;
    let nftables = args.dataplane == DataplaneChoice::Nftables;
    let names = if nftables {
        names.for_nftables()
    } else {
        names
    };
    let mut args = args;
    let mark_mask = dphandler_dataplane::model::config::FelixConfig::parse(&[(
        "IptablesMarkMask".to_string(),
        args.iptables_mark_mask.clone(),
    )])
    .map_err(|(_, why)| anyhow::anyhow!("--iptables-mark-mask: {why}"))?
    .mark_mask
    .expect("parsed");
    let mark_mask = apply_kept_config(&mut args, mark_mask)?;
    let marks = Marks::from_mask(mark_mask).map_err(|e| anyhow::anyhow!("mark mask: {e}"))?;
    if args.workload_iface_prefix.is_empty()
        || args.workload_iface_prefix.len() > 14
        || !args
            .workload_iface_prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        bail!("--workload-iface-prefix must be 1-14 characters of [A-Za-z0-9._-]");
    }
    if args.max_ipset_size == 0 {
        bail!("--max-ipset-size must be at least 1");
    }
    let flavor = match args.iptables_backend {
        FlavorChoice::Fixed(f) => f,
        FlavorChoice::Auto => iptables_restore::detect(&[]),
    };
    info!(?flavor, "iptables flavour");
    let metrics = Arc::new(dphandler_dataplane::metrics::Metrics::default());
    let mut kernel = DesiredKernel::default();
    let nftables = args.dataplane == DataplaneChoice::Nftables;
    info!(
        dataplane = if nftables { "nftables" } else { "iptables" },
        "policy dataplane"
    );
    for v in [IpVersion::V4, IpVersion::V6] {
        if v == IpVersion::V6 && !args.ipv6 {
            continue;
        }
        let mut sets = IpSets::new(
            v,
            names.clone(),
            Box::new(IpsetTool::default().with_metrics(metrics.ipset.clone())),
        );
        // One object per table: raw, mangle and nat hold nothing of ours
        // yet (policy rendering fills them); they are read, never written
        // while empty.
        let mut tables: Vec<Table> = ["raw", "mangle", "nat", "filter"]
            .into_iter()
            .map(|table| {
                Table::new(
                    table,
                    v,
                    Ownership::new(&args.prefix),
                    args.chain_insert_mode,
                    Box::new(
                        IptablesTool::new(flavor, v, Vec::new())
                            .with_metrics(metrics.iptables_tool(v)),
                    ),
                )
            })
            .collect();
        let (this, other) = match v {
            IpVersion::V4 => ("nftables-v4", "iptables-v4"),
            IpVersion::V6 => ("nftables-v6", "iptables-v6"),
        };
        if nftables {
            kernel.nftables.push(
                Dataplane::open(
                    v,
                    &args.prefix,
                    names.clone(),
                    ShardLayout {
                        marks,
                        shards: args.nftables_shards as usize,
                        per_shard: args.nftables_workloads_per_shard as usize,
                    },
                )
                .context("opening the nftables netlink socket")?,
            );
            // An earlier run's iptables chains, hooks and sets go once the
            // nftables tables are in (tables before the sets they use).
            if !args.dry_run {
                let mut old: Vec<Box<dyn Backend>> = Vec::new();
                for t in tables {
                    old.push(Box::new(t));
                }
                // Nothing is desired of it: no manager will send the sets.
                sets.start_full();
                old.push(Box::new(sets));
                kernel.others.push(Box::new(Cleanup::new(other, old)));
            }
            continue;
        }
        if !args.dry_run {
            sets.prefetch();
            // Read while the calc graph sends its snapshot (seconds at
            // 300,000 rules), not in the first apply.
            for t in &mut tables {
                t.prefetch();
            }
            // An earlier run's nftables tables go once the iptables ones
            // are in.
            match Dataplane::open(v, &args.prefix, names.clone(), ShardLayout::default()) {
                Ok(d) => kernel
                    .others
                    .push(Box::new(Cleanup::new(this, vec![Box::new(d)]))),
                Err(e) => {
                    warn!(error = %e, "no nf_tables netlink: no nftables leftovers to look for")
                }
            }
        }
        kernel.ipsets.push(sets);
        kernel.tables.extend(tables);
    }
    if matches!(args.route_protocol, 0..=4) {
        // 0-4 are the kernel's own (unspec, redirect, kernel, boot, static):
        // owning them would mean deleting routes that are not ours.
        bail!("--route-protocol must be 5-255 (0-4 belong to the kernel and admins)");
    }
    if matches!(args.device_route_protocol, 0..=2) {
        bail!("--device-route-protocol must be 3-255 (0-2 are the kernel's)");
    }
    let hostname = match &args.hostname {
        Some(h) if !h.is_empty() => h.clone(),
        Some(_) => bail!("--hostname must not be empty"),
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("reading the kernel's hostname (give --hostname)")?
            .trim()
            .to_string(),
    };
    info!(%hostname, vxlan = ?args.vxlan, "this node");
    if !args.dry_run {
        kernel.routes = Some(Routes::new(
            RouteOwnership {
                exclusive_protocol: args.route_protocol,
                device_protocol: args.device_route_protocol,
                workload_prefix: args.workload_iface_prefix.clone(),
                remove_external_routes: args.remove_external_routes,
                tunnel_devices: vec![VXLAN_V4.into(), VXLAN_V6.into()],
                tables: vec![args.wireguard_table, args.wireguard_table_v6],
            },
            Box::new(RouteNetlink::open().context("opening the routes' netlink socket")?),
        ));
        kernel.vxlan = Some(Vxlan::new(
            &[VXLAN_V4, VXLAN_V6],
            Box::new(VxlanNetlink::open().context("opening the VXLAN netlink socket")?),
        ));
        let state_dir = (!args.state_dir.as_os_str().is_empty()).then(|| args.state_dir.clone());
        kernel.wireguard = Some(
            Wireguard::new(
                Box::new(
                    WgNetlink::open(args.wireguard_go.clone(), state_dir.clone())
                        .context("opening the WireGuard netlink socket")?,
                ),
                KeyStore::new(state_dir),
                args.wireguard_impl,
            )
            .with_own_names([
                args.wireguard_interface.as_str(),
                args.wireguard_interface_v6.as_str(),
            ]),
        );
        kernel.ip_rules = Some(
            IpRules::new(
                [args.wireguard_table, args.wireguard_table_v6],
                Box::new(IpRuleNetlink::open().context("opening the rules' netlink socket")?),
            )
            .context("--wireguard-table")?,
        );
    }
    let xdp_enabled = args.xdp == Switch::Enabled;
    if !args.dry_run {
        // The backend runs even with XDP off: it removes an earlier run's
        // programs.
        match dphandler_bpf::ensure_bpffs(&args.bpffs) {
            Ok(true) => info!(bpffs = %args.bpffs.display(), "mounted a bpffs"),
            Ok(false) => {}
            Err(e) => {
                warn!(bpffs = %args.bpffs.display(), error = %e, "no bpffs: XDP programs cannot be pinned")
            }
        }
        let failsafe = args
            .failsafe_inbound
            .0
            .iter()
            .filter_map(|(p, port)| Some((proto_number(p)?, *port)))
            .collect();
        kernel.xdp = Some(Xdp::new(
            Box::new(BpfSeam::new(args.bpffs.clone())),
            failsafe,
        ));
    }
    if !args.proc_sys.join("net").is_dir() {
        bail!(
            "--proc-sys {}: no net/ under it (give the directory where the kernel's /proc/sys is)",
            args.proc_sys.display()
        );
    }
    kernel.sysctls = Some(Sysctls::new(&args.proc_sys));
    let node = NodeSettings::new(&args.proc_sys, args.ip_forwarding, args.ipv6);
    match args.ip_forwarding {
        Forwarding::Enabled => info!(
            knobs = ?node.knobs(),
            "IP forwarding enabled: these are set once policy is programmed, and kept"
        ),
        Forwarding::Disabled => info!(
            knobs = ?node.knobs(),
            "IP forwarding disabled by config: the forwarding sysctls are left as they are"
        ),
    }
    kernel.others.push(Box::new(node));
    let wireguard = [
        WgSettings {
            enabled: args.wireguard,
            port: args.wireguard_port,
            mtu: args.wireguard_mtu,
            iface: args.wireguard_interface.clone(),
        },
        WgSettings {
            enabled: args.wireguard_v6,
            port: args.wireguard_port_v6,
            mtu: args.wireguard_mtu_v6,
            iface: args.wireguard_interface_v6.clone(),
        },
    ];
    let mut managers: Vec<Box<dyn Manager>> = vec![
        Box::new(
            IpSetsManager::new(args.max_ipset_size)
                .with_max_members(args.max_ipset_members)
                .with_host_ips(&args.workload_iface_prefix)
                .with_vxlan_sources(args.vxlan),
        ),
        Box::new(NatManager::new(&args.prefix, names.clone())),
        Box::new(EndpointsManager::new(
            EndpointsConfig {
                prefix: args.prefix.clone(),
                workload_prefix: args.workload_iface_prefix.clone(),
                marks,
                failsafe_in: args.failsafe_inbound.0.clone(),
                failsafe_out: args.failsafe_outbound.0.clone(),
                device_route_protocol: args.device_route_protocol,
                vxlan: args.vxlan,
                vxlan_port: args.vxlan_port,
                wireguard: wireguard.clone(),
                endpoint_to_host: args.default_endpoint_to_host_action,
            },
            names.clone(),
        )),
        Box::new(WireguardManager::new(WireguardConfig {
            hostname: hostname.clone(),
            v4: wireguard[0].clone(),
            v6: wireguard[1].clone(),
            rule_priority: args.wireguard_rule_priority,
            table: args.wireguard_table,
            table_v6: args.wireguard_table_v6,
            fwmark: marks.wireguard(),
            device_protocol: args.device_route_protocol,
            ipv6: args.ipv6,
        })),
        Box::new(RoutesManager::new(RoutesConfig {
            hostname,
            vxlan: args.vxlan,
            vni: args.vxlan_vni,
            port: args.vxlan_port,
            mtu: args.vxlan_mtu,
            mtu_v6: args.vxlan_mtu_v6,
            device_protocol: args.device_route_protocol,
            route_protocol: args.route_protocol,
            ipv6: args.ipv6,
        })),
    ];
    if xdp_enabled {
        managers.push(Box::new(XdpManager::new(&args.workload_iface_prefix)));
    }
    let (kernel, managers) = if args.dry_run {
        warn!("--dry-run: nothing will be programmed in the kernel");
        (DesiredKernel::default(), Vec::new())
    } else {
        (kernel, managers)
    };
    let status_path = match args.status_socket.as_deref() {
        Some("none") => None,
        Some(p) => Some(PathBuf::from(p)),
        None => Some(dphandler_proto::client::status_socket(&args.socket)),
    };
    let status_group = match &args.status_socket_group {
        Some(g) => Some(listen::group(g).context("--status-socket-group")?),
        None => socket_group,
    };
    let status_listener = match &status_path {
        Some(p) => Some(listen::bind_unix(p, status_group).await?),
        None => None,
    };
    if args.tcp.is_some()
        && tcp_tls.as_ref().is_some_and(Option::is_some)
        && args.tls_client_names.is_empty()
    {
        warn!(
            "TCP: any client certificate the --tls-ca signed is accepted; --tls-client-name narrows it to named clients"
        );
    }
    let tcp_listener = match args.tcp {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding TCP {addr}"))?,
        ),
        None => None,
    };
    let health_addr = dphandler_server::health::parse_addr(&args.health_addr)
        .map_err(|e| anyhow::anyhow!("--health-addr {e}"))?;
    let health_listener = match health_addr {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the health endpoint {addr}"))?,
        ),
        None => None,
    };
    let metrics_addr = dphandler_server::health::parse_addr(&args.metrics_addr)
        .map_err(|e| anyhow::anyhow!("--metrics-addr {e}"))?;
    let metrics_listener = match metrics_addr {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the metrics endpoint {addr}"))?,
        ),
        None => None,
    };
    // The socket last: a client takes its appearing for "the daemon is
    // up", and the health and metrics endpoints, the status socket and TCP
    // are bound by then (a test that probed health as soon as it could
    // connect found it not yet bound).
    let listener = listen::bind_unix(&args.socket, socket_group).await?;
    let mut registry = prometheus_client::registry::Registry::with_prefix("dphandler");
    metrics.register(&mut registry);
    let config = dphandler_dataplane::sync_loop::ConfigSettings {
        running: dphandler_dataplane::model::config::FelixConfig {
            interface_prefix: Some(args.workload_iface_prefix.clone()),
            mark_mask: Some(mark_mask),
            ip_forwarding: Some(args.ip_forwarding == Forwarding::Enabled),
            ..Default::default()
        },
        keep: kept_config_path(&args),
        log_level: log_hook,
    };
    let (conn, loop_task) = connector::start(
        loop_cfg,
        managers,
        kernel,
        metrics.clone(),
        config,
        loop_stop,
        stopping,
    );
    if let Some(l) = metrics_listener {
        tokio::spawn(dphandler_server::health::serve_metrics(
            l,
            Arc::new(registry),
        ));
    }
    if let Some(l) = health_listener {
        tokio::spawn(dphandler_server::health::serve(
            l,
            dphandler_server::health::Health {
                status: conn.status.clone(),
                alive: conn.alive.clone(),
                liveness_timeout,
            },
        ));
    }
    info!(socket = %args.socket.display(), "listening");

    let (health, health_svc) = tonic_health::server::health_reporter();
    health
        .set_serving::<DataplaneServer<DataplaneService>>()
        .await;
    let reflection_builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(dphandler_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection = reflection_builder()
        .build_v1()
        .context("building the reflection service")?;
    // grpcurl 1.8 (and other older clients) speak only v1alpha.
    let reflection_v1alpha = reflection_builder()
        .build_v1alpha()
        .context("building the v1alpha reflection service")?;
    let svc = DataplaneServer::from_arc(Arc::new(
        DataplaneService::new(conn).with_message_limit(message_limiter),
    ))
    .max_decoding_message_size(args.max_message_bytes)
    .max_encoding_message_size(args.max_message_bytes);

    // Both listeners stop on the first SIGTERM/SIGINT, and the loop at
    // once: a stopping daemon changes nothing more (a WireGuard device
    // that went with it, its wireguard-go killed beside the daemon, was
    // made again by an apply during the grace period, and outlived it).
    let (signalled_tx, signalled) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        signalled_by.await;
        let _ = signalled_tx.send(true);
        let _ = stop_tx.send(true);
    });
    let stopping = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let max_connections = args.max_connections as usize;
    let builder = |access: dphandler_server::access::Access| {
        tonic::transport::Server::builder()
            .max_concurrent_streams(Some(args.max_concurrent_streams))
            .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
            .layer(GovernorLayer::new(governor.clone()))
            .layer(access)
    };
    let unix = builder(Default::default())
        .add_service(health_svc.clone())
        .add_service(reflection.clone())
        .add_service(reflection_v1alpha.clone())
        .add_service(svc.clone())
        .serve_with_incoming_shutdown(
            limit_connections(UnixListenerStream::new(listener), max_connections),
            stopping(signalled.clone()),
        );
    let status_server = async {
        let Some(l) = status_listener else {
            return Ok(());
        };
        info!(socket = %status_path.as_ref().expect("bound").display(), "listening (read-only)");
        builder(dphandler_server::access::Access {
            read_only: true,
            ..Default::default()
        })
        .add_service(health_svc.clone())
        .add_service(reflection.clone())
        .add_service(reflection_v1alpha.clone())
        .add_service(svc.clone())
        .serve_with_incoming_shutdown(
            limit_connections(UnixListenerStream::new(l), max_connections),
            stopping(signalled.clone()),
        )
        .await
        .context("gRPC server (status socket)")
    };
    let tcp = async {
        let (Some(l), Some(tls)) = (tcp_listener, tcp_tls) else {
            return Ok(());
        };
        let addr = l.local_addr()?;
        let mut b = tonic::transport::Server::builder();
        if let Some(tls) = tls {
            b = b.tls_config(tls).context("TLS settings")?;
            info!(%addr, "listening on TCP (TLS, client certificates required)");
        } else {
            warn!(%addr, "listening on TCP WITHOUT TLS (--insecure-tcp): anyone who reaches it controls this dataplane");
        }
        b.max_concurrent_streams(Some(args.max_concurrent_streams))
            .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
            .layer(GovernorLayer::new(governor.clone()))
            .layer(dphandler_server::access::Access {
                read_only: false,
                client_names: args.tls_client_names.clone().into(),
            })
            .add_service(health_svc.clone())
            .add_service(reflection.clone())
            .add_service(reflection_v1alpha.clone())
            .add_service(svc.clone())
            .serve_with_incoming_shutdown(
                limit_connections(
                    tonic::transport::server::TcpIncoming::from(l).with_nodelay(Some(true)),
                    max_connections,
                ),
                stopping(signalled.clone()),
            )
            .await
            .context("gRPC server (TCP)")
    };
    let servers = async {
        tokio::try_join!(
            async { unix.await.context("gRPC server (unix)") },
            status_server,
            tcp
        )
    };
    // Streams get a grace period to end cleanly; then we stop anyway.
    let mut grace_rx = signalled.clone();
    // The loop's end, as a watch: looked at while the servers run, and
    // waited for once they have stopped.
    let (loop_ended_tx, mut loop_ended) = tokio::sync::watch::channel(None);
    tokio::spawn(async move {
        let r = loop_task.await.map_err(|e| e.to_string());
        let _ = loop_ended_tx.send(Some(r));
    });
    let mut loop_early = loop_ended.clone();
    let loop_signalled = signalled.clone();
    let loop_watch = async move {
        let _ = loop_early.wait_for(Option::is_some).await;
        if *loop_signalled.borrow() {
            // Stopped as asked: the servers' end is what is waited for.
            std::future::pending::<()>().await;
        }
        loop_early.borrow().clone()
    };
    let loop_ended_early = tokio::select! {
        r = servers => { r?; false }
        r = loop_watch => {
            // Only a stop ends the loop; anything else is a bug (a panic
            // has ended the process already, see exit_on_panic).
            error!(result = ?r, "the sync loop ended without being asked to: exiting");
            true
        }
        () = async {
            let _ = grace_rx.wait_for(|s| *s).await;
            tokio::time::sleep(grace).await;
        } => { info!(?grace, "streams still open after the grace period; stopping"); false }
    };
    if loop_ended_early {
        let _ = std::fs::remove_file(&args.socket);
        if let Some(p) = &status_path {
            let _ = std::fs::remove_file(p);
        }
        std::process::exit(PANIC_EXIT);
    }
    // The loop was told to stop at the signal; an apply under way ends.
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        loop_ended.wait_for(Option::is_some),
    )
    .await;
    let _ = std::fs::remove_file(&args.socket);
    if let Some(p) = &status_path {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// docs/configuration.md's table has one row per `serve` flag
    /// (`` | `--flag` | `DPH_ENV` | default … | ``) with its variable, whose
    /// default column names clap's default where the flag has one, and no
    /// row for a flag the daemon does not have.
    #[test]
    fn configuration_doc_lists_every_flag() {
        let doc = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/configuration.md"
        ))
        .unwrap();
        let mut rows: BTreeMap<String, (String, String)> = BTreeMap::new();
        for line in doc.lines().filter(|l| l.starts_with("| `--")) {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let flag = cells[1].trim_matches('`').to_string();
            let env = cells[2].trim_matches('`').to_string();
            assert!(
                rows.insert(flag.clone(), (env, cells[3].to_string()))
                    .is_none(),
                "{flag}: two rows"
            );
        }
        let mut cli = Cli::command();
        cli.build();
        let serve = cli.find_subcommand("serve").expect("serve");
        let mut wrong = Vec::new();
        let mut seen = 0;
        for arg in serve.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if matches!(long, "help" | "version") {
                continue;
            }
            seen += 1;
            let flag = format!("--{long}");
            let env = arg
                .get_env()
                .map(|e| e.to_string_lossy().into_owned())
                .unwrap_or_default();
            match rows.remove(&flag) {
                None => wrong.push(format!("{flag}: no row")),
                Some((documented, _)) if documented != env => wrong.push(format!(
                    "{flag}: the row says {documented}, the flag reads {env}"
                )),
                Some((_, default)) => {
                    for d in arg.get_default_values() {
                        let d = d.to_string_lossy();
                        // A switch's `false` reads "off".
                        let off = d == "false" && default.starts_with("off");
                        if !off && !default.contains(d.as_ref()) {
                            wrong.push(format!("{flag}: default {d:?} not in {default:?}"));
                        }
                    }
                }
            }
        }
        for flag in rows.keys() {
            wrong.push(format!("{flag}: documented, but serve has no such flag"));
        }
        assert!(seen > 60, "{seen} flags read");
        assert!(
            wrong.is_empty(),
            "docs/configuration.md:\n{}",
            wrong.join("\n")
        );
    }
}
