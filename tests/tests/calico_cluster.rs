//! A real Calico on two nodes: each node a namespace with its own Felix
//! (built from the Go module proxy by `scripts/calico.sh`) and its own
//! daemon behind it, joined by an underlay (`eth0`, 172.31.77.0/24); one
//! etcd in a control namespace that reaches both nodes over a management
//! network of its own (172.31.78.0/24), so the underlay carries only what
//! the nodes send each other. An IPPool with `vxlanMode: Always`; the
//! pods' blocks and the VXLAN tunnel addresses assigned by Calico's own
//! IPAM client (as the CNI plugin and calico-node assign them), so Felix
//! routes each block to its node. Pods talk across the nodes over VXLAN.
//! Then `wireguardEnabled: true`: each daemon's key travels through its
//! Felix into its Node resource, reaches the other node as a
//! `WireguardEndpointUpdate`, and the underlay carries only UDP 51820.
//! No message of either Felix is rejected. Needs root; skipped, saying
//! so, only without Go.

use std::time::Instant;

use anyhow::Result;
use dphandler_tests::calico::{self, Calico, Proc};
use dphandler_tests::cluster::{
    BLOCKS, PODS, UNDERLAY, VTEP_IPS, VTEP_MACS, WgGoReaper, assert_all, cluster, stdout,
};
use dphandler_tests::lab::{Capture, Probe, probe};
use dphandler_tests::{Daemon, Netns, tempdir};

/// The control namespace's address on the management network (etcd).
const CONTROL: &str = "172.31.78.254";

/// The control namespace: a bridge on the management network, one veth
/// to each node (`mgmt0`, 172.31.78.1 and .2 there).
fn control(nodes: &[&Netns; 2]) -> Result<Netns> {
    let ctl = Netns::new("calctl")?;
    ctl.run("ip", &["link", "set", "lo", "up"])?;
    ctl.run("ip", &["link", "add", "br0", "type", "bridge"])?;
    ctl.run(
        "ip",
        &["addr", "add", &format!("{CONTROL}/24"), "dev", "br0"],
    )?;
    ctl.run("ip", &["link", "set", "br0", "up"])?;
    for (i, n) in nodes.iter().enumerate() {
        let port = format!("n{}", i + 1);
        ctl.run(
            "ip",
            &[
                "link", "add", &port, "type", "veth", "peer", "name", "mgmt0", "netns", &n.0,
            ],
        )?;
        ctl.run("ip", &["link", "set", &port, "master", "br0", "up"])?;
        n.run(
            "ip",
            &[
                "addr",
                "add",
                &format!("172.31.78.{}/24", i + 1),
                "dev",
                "mgmt0",
            ],
        )?;
        n.run("ip", &["link", "set", "mgmt0", "up"])?;
    }
    Ok(ctl)
}

fn resources() -> String {
    let mut y = String::from(
        "apiVersion: projectcalico.org/v3\nkind: IPPool\nmetadata: {name: pool1}\n\
         spec: {cidr: 10.65.0.0/16, blockSize: 26, ipipMode: Never, vxlanMode: Always, natOutgoing: false}\n\
         ---\napiVersion: projectcalico.org/v3\nkind: Profile\nmetadata: {name: allow-all}\n\
         spec: {ingress: [{action: Allow}], egress: [{action: Allow}]}\n",
    );
    for i in 0..2 {
        let (n, iface) = (i + 1, if i == 0 { "caliA" } else { "caliB" });
        y.push_str(&format!(
            "---\napiVersion: projectcalico.org/v3\nkind: Node\nmetadata: {{name: node{n}}}\n\
             spec: {{bgp: {{ipv4Address: {u}/24}}, ipv4VXLANTunnelAddr: {t}, vxlanTunnelMACAddr: '{m}'}}\n\
             ---\napiVersion: projectcalico.org/v3\nkind: WorkloadEndpoint\n\
             metadata: {{namespace: ns1, labels: {{app: pod{n}}}}}\n\
             spec: {{node: node{n}, orchestrator: k8s, pod: pod{n}, endpoint: eth0, interfaceName: {iface},\n\
             \x20      mac: '02:00:00:00:00:0{n}', ipNetworks: ['{p}/32'], profiles: [allow-all]}}\n",
            u = UNDERLAY[i],
            t = VTEP_IPS[i],
            m = VTEP_MACS[i],
            p = PODS[i],
        ));
    }
    y
}

fn two_nodes(c: &Calico) -> Result<()> {
    let dir = tempdir()?;
    // wireguard-go's UAPI sockets share one directory across namespaces:
    // device names unique to this run (set per node in FelixConfiguration).
    let tag = std::process::id() % 100_000;
    let wg = [format!("wga{tag}.cali"), format!("wgb{tag}.cali")];
    let nodes = cluster("calc")?;
    let ctl = control(&[&nodes[0].ns, &nodes[1].ns])?;
    let _etcd = calico::etcd_on(c, &ctl, dir.path(), Some(CONTROL))?;
    let mut initial = resources();
    // Each node's WireGuard device name, from the start (a per-node
    // FelixConfiguration, as an operator would set it).
    for (i, w) in wg.iter().enumerate() {
        initial.push_str(&format!(
            "---\napiVersion: projectcalico.org/v3\nkind: FelixConfiguration\n\
             metadata: {{name: node.node{}}}\nspec: {{wireguardInterfaceName: {w}}}\n",
            i + 1
        ));
    }
    calico::apply(c, &ctl, dir.path(), &initial)?;
    for i in 0..2 {
        let host = format!("node{}", i + 1);
        calico::ipam_assign(c, &ctl, VTEP_IPS[i], &host, "tunnel")?;
        calico::ipam_assign(c, &ctl, PODS[i], &host, "workload")?;
    }
    let blocks = calico::calicoctl(c, &ctl, &["ipam", "show", "--show-blocks"])?;
    for b in BLOCKS {
        assert!(blocks.contains(b), "block {b} allocated: {blocks}");
    }

    let driver = calico::driver(dir.path())?;
    let etcd_url = format!("http://{CONTROL}:2379");
    let mut daemons = Vec::new();
    let mut states = Vec::new();
    let mut sockets = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        let host = format!("node{}", i + 1);
        let sub = dir.path().join(&host);
        std::fs::create_dir_all(&sub)?;
        let socket = sub.join("dp.sock");
        states.push(sub.join("dp.sock.state"));
        daemons.push(Daemon::start(
            &n.ns,
            &socket,
            &["--hostname", &host, "--ipv6", "false"],
        )?);
        sockets.push(socket);
    }
    let start_felix = |i: usize| {
        calico::felix(
            c,
            &nodes[i].ns,
            sockets[i].parent().expect("in the node's directory"),
            &format!("node{}", i + 1),
            &driver,
            &sockets[i],
            &[
                ("FELIX_IPV6SUPPORT", "false"),
                ("FELIX_ETCDENDPOINTS", &etcd_url),
                ("ETCD_ENDPOINTS", &etcd_url),
            ],
        )
    };
    let mut felixes = vec![start_felix(0)?, start_felix(1)?];
    // calico-node's supervisor: Felix restarts itself (exits) on some
    // configuration changes, and is started again.
    let mut restarted = 0;
    let mut revive = |felixes: &mut Vec<Proc>| -> Result<()> {
        for (i, f) in felixes.iter_mut().enumerate() {
            if f.exited().is_some() {
                *f = start_felix(i)?;
                restarted += 1;
            }
        }
        Ok(())
    };
    let _reaper = WgGoReaper(
        (0..2)
            .map(|i| {
                (
                    states[i].join(format!("wireguard-go.{}.pid", wg[i])),
                    wg[i].clone(),
                )
            })
            .collect(),
    );
    let tails = |felixes: &[Proc]| {
        felixes
            .iter()
            .map(|f| f.tail(25))
            .collect::<Vec<_>>()
            .join("\n")
    };

    // VXLAN: each node's pod reaches the other's, over vxlan.calico.
    let took = calico::until(60, "pods talking across the nodes over VXLAN", || {
        probe(&nodes[0].pod, PODS[1], Probe::Tcp(80))
            && probe(&nodes[1].pod, PODS[0], Probe::Tcp(80))
    })
    .map_err(|e| e.context(tails(&felixes)))?;
    eprintln!(
        "Calico {}: two nodes, VXLAN: pods talk after {took:?}",
        c.label
    );
    for (from, to) in [(0, 1), (1, 0)] {
        assert_all(&nodes[from].pod, PODS[to], true, "over VXLAN");
        let routes = stdout(&nodes[from].ns, "ip", &["route", "show", BLOCKS[to]])?;
        assert!(
            routes.contains("vxlan.calico"),
            "node{}: the other block through vxlan.calico: {routes}",
            from + 1
        );
    }

    // WireGuard: on in the cluster's FelixConfiguration.
    let enabled = Instant::now();
    calico::apply(
        c,
        &ctl,
        dir.path(),
        "apiVersion: projectcalico.org/v3\nkind: FelixConfiguration\nmetadata: {name: default}\n\
         spec: {wireguardEnabled: true}\n",
    )?;
    // Each daemon's key, through its Felix, in its Node resource.
    let mut keys = Vec::new();
    for i in 0..2 {
        let node = format!("node{}", i + 1);
        let mut key = String::new();
        calico::until(
            60,
            &format!("{node}'s WireGuard key in its Node resource"),
            || {
                if let Err(e) = revive(&mut felixes) {
                    eprintln!("restarting Felix: {e:#}");
                    return false;
                }
                let y = calico::calicoctl(c, &ctl, &["get", "node", &node, "-o", "yaml"])
                    .unwrap_or_default();
                key = y
                    .lines()
                    .find_map(|l| l.trim().strip_prefix("wireguardPublicKey:"))
                    .map(|k| k.trim().to_string())
                    .unwrap_or_default();
                !key.is_empty()
            },
        )
        .map_err(|e| e.context(tails(&felixes)))?;
        let ours = stdout(&nodes[i].ns, "wg", &["show", &wg[i], "public-key"])?;
        assert_eq!(key, ours.trim(), "{node}: the Node resource holds our key");
        keys.push(key);
    }
    // ... and the other node's daemon has it as its peer (from Felix's
    // WireguardEndpointUpdate), with the other node's underlay address.
    for i in 0..2 {
        let other = 1 - i;
        calico::until(60, "the other node as a WireGuard peer", || {
            if let Err(e) = revive(&mut felixes) {
                eprintln!("restarting Felix: {e:#}");
                return false;
            }
            stdout(&nodes[i].ns, "wg", &["show", &wg[i], "endpoints"]).is_ok_and(|e| {
                e.contains(&keys[other]) && e.contains(&format!("{}:51820", UNDERLAY[other]))
            })
        })
        .map_err(|e| e.context(tails(&felixes)))?;
    }
    eprintln!(
        "Calico {}: wireguardEnabled → both peers configured: {:?} ({restarted} Felix restarts)",
        c.label,
        enabled.elapsed()
    );
    // Pods now talk over WireGuard: on the underlay only UDP 51820.
    calico::until(30, "pods talking over WireGuard", || {
        probe(&nodes[0].pod, PODS[1], Probe::Tcp(80))
            && probe(&nodes[1].pod, PODS[0], Probe::Tcp(80))
    })?;
    let wg_seen = Capture::start_on(&nodes[1].ns, "eth0", "udp port 51820")?;
    let other = Capture::start_on(&nodes[1].ns, "eth0", "ip and not udp port 51820")?;
    for (from, to) in [(0, 1), (1, 0)] {
        assert_all(&nodes[from].pod, PODS[to], true, "over WireGuard");
    }
    let (wg_seen, other) = (wg_seen.finish(), other.finish());
    assert!(
        wg_seen
            .iter()
            .any(|l| l.contains(&format!("{}.51820", UNDERLAY[0]))),
        "no WireGuard on the underlay: {wg_seen:?}"
    );
    assert!(
        other.is_empty(),
        "besides WireGuard on the underlay: {other:?}"
    );

    for (i, n) in nodes.iter().enumerate() {
        assert_eq!(
            calico::rejections(&n.ns)?,
            0.0,
            "node{}: {}",
            i + 1,
            felixes[i].tail(40)
        );
        let log = std::fs::read_to_string(&felixes[i].log)?;
        assert!(!log.contains("rejected:"), "{}", felixes[i].tail(40));
    }
    drop(felixes);
    drop(daemons);
    Ok(())
}

#[test]
fn a_real_calico_on_two_nodes_vxlan_then_wireguard() -> Result<()> {
    calico::each_version(two_nodes)
}
