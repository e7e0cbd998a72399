//! Two nodes for the multi-node tests (routes, VXLAN, WireGuard): each
//! node is a namespace of its own with its own daemon and its own
//! calc-graph feed (what Calico sends that node: its workloads, every
//! node's VTEP and host metadata, the route to the other node's block and
//! its own block); the nodes are joined by an underlay veth pair (`eth0`
//! in each, 172.31.77.1/24 and .2/24, fd00:77::1/64 and ::2/64). Pods A
//! (node 1, 10.65.1.2) and B (node 2, 10.65.2.2) are wired as Calico's
//! CNI wires them. Nothing global is set here: forwarding, devices,
//! routes and neighbours are the daemons' to make.

use anyhow::{Result, bail};

use crate::lab::{Probe, WorkloadSpec, probe, serve, workload, yaml_msgs};
use crate::{Daemon, Netns, push};

pub const PODS: [&str; 2] = ["10.65.1.2", "10.65.2.2"];
pub const BLOCKS: [&str; 2] = ["10.65.1.0/26", "10.65.2.0/26"];
pub const UNDERLAY: [&str; 2] = ["172.31.77.1", "172.31.77.2"];
pub const VTEP_IPS: [&str; 2] = ["10.65.1.0", "10.65.2.0"];
pub const VTEP_MACS: [&str; 2] = ["66:6a:00:00:00:01", "66:6a:00:00:00:02"];
// IPv6: the VXLAN feed is dual-stack (vxlan-v6.calico over an IPv6
// underlay).
pub const PODS6: [&str; 2] = ["fd00:65:1::2", "fd00:65:2::2"];
pub const BLOCKS6: [&str; 2] = ["fd00:65:1::/122", "fd00:65:2::/122"];
pub const UNDERLAY6: [&str; 2] = ["fd00:77::1", "fd00:77::2"];
pub const VTEP_IPS6: [&str; 2] = ["fd00:65:1::", "fd00:65:2::"];
pub const VTEP_MACS6: [&str; 2] = ["66:6b:00:00:00:01", "66:6b:00:00:00:02"];
pub const PROBES: [Probe; 3] = [Probe::Tcp(80), Probe::Udp(53), Probe::Icmp];

/// Pool types and route types of `RouteUpdate` (felixbackend.proto).
pub const NO_ENCAP: &str = "NO_ENCAP";
pub const VXLAN: &str = "VXLAN";
pub const REMOTE_WORKLOAD: u32 = 1;
pub const LOCAL_WORKLOAD: u32 = 4;

/// One node: its namespace and its pod's (with servers on TCP 80, UDP 53).
#[allow(
    missing_debug_implementations,
    reason = "holds running server threads; nothing to show"
)]
pub struct Node {
    pub ns: Netns,
    pub pod: Netns,
    _servers: crate::lab::Servers,
}

/// Two nodes joined by an underlay, one pod on each, and a foreign route
/// in each node's main table that must survive everything.
pub fn cluster(tag: &str) -> Result<[Node; 2]> {
    let n1 = Netns::new(&format!("{tag}1"))?;
    let n2 = Netns::new(&format!("{tag}2"))?;
    n1.run(
        "ip",
        &[
            "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &n2.0,
        ],
    )?;
    let mut nodes = Vec::new();
    for (i, ns) in [n1, n2].into_iter().enumerate() {
        ns.run("ip", &["link", "set", "lo", "up"])?;
        ns.run(
            "ip",
            &["addr", "add", &format!("{}/24", UNDERLAY[i]), "dev", "eth0"],
        )?;
        // The underlay's IPv6 address is there at once (no DAD: the test's
        // underlay, not the daemon's business).
        ns.run(
            "ip",
            &[
                "-6",
                "addr",
                "add",
                &format!("{}/64", UNDERLAY6[i]),
                "dev",
                "eth0",
                "nodad",
            ],
        )?;
        ns.run("ip", &["link", "set", "eth0", "up"])?;
        // Someone else's route (an admin's, another agent's): not ours by
        // protocol nor by device.
        ns.run(
            "ip",
            &[
                "route",
                "add",
                "198.18.0.0/24",
                "via",
                UNDERLAY[1 - i],
                "proto",
                "static",
            ],
        )?;
        let iface = if i == 0 { "caliA" } else { "caliB" };
        let pod = workload(
            &ns,
            WorkloadSpec {
                iface,
                n: i as u8 + 1,
                v4: PODS[i],
                v6: Some(PODS6[i]),
                host_route: false,
                host_neigh: false,
            },
        )?;
        let servers = serve(&pod.0, &[80], &[53]);
        nodes.push(Node {
            ns,
            pod,
            _servers: servers,
        });
    }
    nodes.try_into().map_err(|_| anyhow::anyhow!("two nodes"))
}

pub fn route(types: u32, pool: &str, dst: &str, node: usize, extra: &str) -> String {
    let ip = if dst.contains(':') {
        UNDERLAY6[node]
    } else {
        UNDERLAY[node]
    };
    format!(
        "routeUpdate: {{types: {types}, ipPoolType: {pool}, dst: '{dst}', dstNodeName: node{n}, dstNodeIp: '{ip}'{extra}}}\n---\n",
        n = node + 1,
    )
}

/// What Calico's calc graph sends node `me` (0 or 1): with a VXLAN pool
/// dual-stack, with a no-encap pool IPv4 only.
pub fn feed(me: usize, pool: &str, encap: &str) -> String {
    let other = 1 - me;
    let v6 = pool == VXLAN;
    let iface = if me == 0 { "caliA" } else { "caliB" };
    let v6_nets = if v6 {
        format!("    ipv6Nets: ['{}/128']\n", PODS6[me])
    } else {
        String::new()
    };
    let mut y = format!(
        "encapsulation: {{{encap}}}\n---\n\
         activeProfileUpdate:\n  id: {{name: kns.ns}}\n  profile:\n    inboundRules: [{{action: allow}}]\n    outboundRules: [{{action: allow}}]\n---\n\
         workloadEndpointUpdate:\n  id: {{orchestratorId: k8s, workloadId: ns/pod{me}, endpointId: eth0}}\n  endpoint:\n    name: {iface}\n    mac: '02:00:00:00:00:0{}'\n    ipv4Nets: [{}/32]\n{v6_nets}    profileIds: [kns.ns]\n---\n",
        me + 1,
        PODS[me]
    );
    for n in 0..2 {
        y += &format!(
            "hostMetadataUpdate: {{hostname: node{}, ipv4Addr: '{}', ipv6Addr: '{}'}}\n---\n",
            n + 1,
            UNDERLAY[n],
            UNDERLAY6[n]
        );
        if pool == VXLAN {
            y += &format!(
                "vtepUpdate: {{node: node{}, mac: '{}', ipv4Addr: '{}', parentDeviceIp: '{}', macV6: '{}', ipv6Addr: '{}', parentDeviceIpv6: '{}'}}\n---\n",
                n + 1,
                VTEP_MACS[n],
                VTEP_IPS[n],
                UNDERLAY[n],
                VTEP_MACS6[n],
                VTEP_IPS6[n],
                UNDERLAY6[n]
            );
        }
    }
    let mut blocks = vec![(BLOCKS, PODS, "/32")];
    if v6 {
        blocks.push((BLOCKS6, PODS6, "/128"));
    }
    for (b, p, host) in blocks {
        y += &route(LOCAL_WORKLOAD, pool, b[me], me, "");
        y += &route(
            LOCAL_WORKLOAD,
            pool,
            &format!("{}{host}", p[me]),
            me,
            ", localWorkload: true",
        );
        y += &route(REMOTE_WORKLOAD, pool, b[other], other, "");
    }
    y += "inSync: {}\n";
    y
}

/// Starts node `i`'s daemon and pushes its feed; returns the daemon.
pub async fn start(node: &Node, i: usize, dir: &std::path::Path, yaml: &str) -> Result<Daemon> {
    start_with(node, i, dir, yaml, &[]).await
}

/// [`start`] with more flags for the daemon.
pub async fn start_with(
    node: &Node,
    i: usize,
    dir: &std::path::Path,
    yaml: &str,
    extra: &[&str],
) -> Result<Daemon> {
    let hostname = format!("node{}", i + 1);
    let mut args = vec!["--hostname", hostname.as_str()];
    args.extend_from_slice(extra);
    let d = Daemon::start(
        &node.ns,
        &dir.join(format!("node{}-{}.sock", i + 1, rand_suffix())),
        &args,
    )?;
    let mut c = d.connect().await?;
    let (rej, _) = push(&mut c, yaml_msgs(1, yaml)).await?;
    if !rej.is_empty() {
        bail!("node{} rejected {rej:?}", i + 1);
    }
    Ok(d)
}

pub fn rand_suffix() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

pub fn stdout(ns: &Netns, prog: &str, args: &[&str]) -> Result<String> {
    Ok(String::from_utf8_lossy(&ns.run(prog, args)?.stdout).into_owned())
}

pub fn all_probes(from: &Netns, to: &str) -> Vec<(Probe, bool)> {
    PROBES.iter().map(|p| (*p, probe(from, to, *p))).collect()
}

pub fn assert_all(from: &Netns, to: &str, want: bool, what: &str) {
    for (p, got) in all_probes(from, to) {
        assert_eq!(got, want, "{what}: {p:?} to {to}");
    }
}

/// The `wireguard-go`s our daemons started, ended on drop: their pid
/// files (in the daemons' state directories) name them; the UAPI socket a
/// killed one leaves behind goes too.
#[derive(Debug)]
pub struct WgGoReaper(pub Vec<(std::path::PathBuf, String)>);

impl WgGoReaper {
    pub fn kill(pid_file: &std::path::Path) {
        if let Ok(pid) = std::fs::read_to_string(pid_file)
            && let Ok(pid) = pid.trim().parse::<i32>()
        {
            let pid = nix::unistd::Pid::from_raw(pid);
            // SIGKILL: a wireguard-go whose namespace is already gone can
            // hang in its orderly shutdown.
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

impl Drop for WgGoReaper {
    fn drop(&mut self) {
        for (pid_file, iface) in &self.0 {
            Self::kill(pid_file);
            let _ = std::fs::remove_file(format!("/var/run/wireguard/{iface}.sock"));
        }
    }
}
