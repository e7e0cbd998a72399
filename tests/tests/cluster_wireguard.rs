//! Pod traffic between two nodes encrypted with WireGuard (the two-node
//! lab is `dphandler_tests::cluster`; the calc graph's VXLAN feed stays on,
//! WireGuard's table takes pod traffic first). This kernel has no
//! WireGuard module: the daemons fall back to `wireguard-go`, which they
//! start and configure themselves. Nothing global is set by the test: the
//! devices, keys, rules and routes are the daemons' to make. The test ends
//! the `wireguard-go` processes the daemons started (by the pids in their
//! state directories), also on failure. Needs root, `wireguard-go` and
//! `wg` (wireguard-tools).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dphandler_proto::felix::from_dataplane::Payload as FromPayload;
use dphandler_proto::v1::{self, status_update::Kind};
use dphandler_tests::cluster::*;
use dphandler_tests::kernel;
use dphandler_tests::lab::{Capture, Probe, probe, scrape, yaml_msgs};
use dphandler_tests::traffic::Pinger;
use dphandler_tests::{Daemon, Netns, privileged, push, tempdir};
use tonic::Streaming;

/// The next WireGuard key of IP version `v` (4 or 6) a StatusUpdates
/// stream carries.
async fn next_key(s: &mut Streaming<v1::StatusUpdate>, v: i32, within: Duration) -> Result<String> {
    let until = Instant::now() + within;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let m = tokio::time::timeout(left, s.message())
            .await
            .context("no WireguardStatusUpdate in time")??
            .context("StatusUpdates ended")?;
        if let Some(Kind::Update(f)) = m.kind
            && let Some(FromPayload::WireguardStatusUpdate(w)) = f.payload
            && w.ip_version == v
        {
            return Ok(w.public_key);
        }
    }
}

async fn watch(d: &Daemon) -> Result<Streaming<v1::StatusUpdate>> {
    Ok(d.connect()
        .await?
        .status_updates(v1::StatusUpdatesRequest {})
        .await?
        .into_inner())
}

async fn details(d: &Daemon) -> Result<std::collections::HashMap<String, String>> {
    Ok(d.connect()
        .await?
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner()
        .details)
}

/// `wireguardEndpointUpdate`s and `…V6Update`s for both nodes (what the
/// calc graph sends once each node has published its keys).
fn endpoints(keys: &[[String; 2]; 2]) -> String {
    (0..2)
        .map(|n| {
            format!(
                "wireguardEndpointUpdate: {{hostname: node{}, publicKey: '{}', interfaceIpv4Addr: '{}'}}\n---\n\
                 wireguardEndpointV6Update: {{hostname: node{}, publicKeyV6: '{}', interfaceIpv6Addr: '{}'}}\n---\n",
                n + 1,
                keys[n][0],
                WG_ADDRS[n],
                n + 1,
                keys[n][1],
                WG_ADDRS6[n]
            )
        })
        .collect()
}

/// Each node's WireGuard addresses (Calico takes them from the node's
/// blocks).
const WG_ADDRS: [&str; 2] = ["10.65.1.1", "10.65.2.1"];
const WG_ADDRS6: [&str; 2] = ["fd00:65:1::1", "fd00:65:2::1"];

fn handshake_seen(ns: &Netns, iface: &str) -> bool {
    stdout(ns, "wg", &["show", iface, "latest-handshakes"])
        .map(|o| {
            o.split_whitespace()
                .nth(1)
                .is_some_and(|t| t.parse::<u64>().is_ok_and(|t| t > 0))
        })
        .unwrap_or(false)
}

#[tokio::test]
async fn pods_on_two_nodes_talk_over_wireguard() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    // wireguard-go's UAPI sockets share one directory across namespaces:
    // device names unique to this run.
    let tag = std::process::id() % 100_000;
    let ifaces = [format!("wga{tag}.cali"), format!("wgb{tag}.cali")];
    let ifaces6 = [format!("w6a{tag}.cali"), format!("w6b{tag}.cali")];
    let states = [dir.path().join("state1"), dir.path().join("state2")];
    let nodes = cluster("wg")?;
    // Dropped before the nodes: their wireguard-go go first.
    let pid_file = |i: usize, iface: &str| states[i].join(format!("wireguard-go.{iface}.pid"));
    let _reaper = WgGoReaper(
        (0..2)
            .flat_map(|i| {
                [
                    (pid_file(i, &ifaces[i]), ifaces[i].clone()),
                    (pid_file(i, &ifaces6[i]), ifaces6[i].clone()),
                ]
            })
            .collect(),
    );
    let encap = "vxlanEnabled: true, vxlanEnabledV6: true";
    let feeds = [feed(0, VXLAN, encap), feed(1, VXLAN, encap)];
    let args = |i: usize| -> Vec<String> {
        vec![
            "--wireguard".into(),
            "true".into(),
            "--wireguard-interface".into(),
            ifaces[i].clone(),
            "--wireguard-v6".into(),
            "true".into(),
            "--wireguard-interface-v6".into(),
            ifaces6[i].clone(),
            "--state-dir".into(),
            states[i].display().to_string(),
        ]
    };
    let mut daemons: Vec<Option<Daemon>> = Vec::new();
    // keys[node][0 for IPv4, 1 for IPv6]
    let mut keys: [[String; 2]; 2] = Default::default();
    for (i, n) in nodes.iter().enumerate() {
        let a = args(i);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let d = start_with(n, i, dir.path(), &feeds[i], &a).await?;
        // The node's keys, as a watcher that connects after they were
        // made hears them.
        let mut w = watch(&d).await?;
        keys[i][0] = next_key(&mut w, 4, Duration::from_secs(15)).await?;
        keys[i][1] = next_key(&mut w, 6, Duration::from_secs(15)).await?;
        for k in &keys[i] {
            assert_eq!(k.len(), 44, "node{}: {k:?}", i + 1);
        }
        daemons.push(Some(d));
    }
    assert_ne!(keys[0][0], keys[1][0]);
    assert_ne!(keys[0][0], keys[0][1], "one key per IP version");
    // Kept with mode 0600.
    let key_file = states[0].join("wireguard-v4.key");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&key_file)?.permissions());
    assert_eq!(mode & 0o777, 0o600, "{}", key_file.display());

    // The calc graph carries each node's key to the other.
    let pushed = Instant::now();
    for d in daemons.iter().flatten() {
        let (rej, _) = push(&mut d.connect().await?, yaml_msgs(1000, &endpoints(&keys))).await?;
        assert!(rej.is_empty(), "{rej:?}");
    }
    // The first packets start the handshakes.
    for (iface, to) in [(&ifaces[0], PODS[1]), (&ifaces6[0], PODS6[1])] {
        let mut first_handshake = None;
        for _ in 0..50 {
            let _ = probe(&nodes[0].pod, to, Probe::Icmp);
            if handshake_seen(&nodes[0].ns, iface) {
                first_handshake = Some(pushed.elapsed());
                break;
            }
        }
        let first_handshake = first_handshake.context("no handshake within 50 pings")?;
        eprintln!("{iface}: first handshake {first_handshake:?} after the keys were sent");
    }

    // What each node programmed.
    for (i, n) in nodes.iter().enumerate() {
        let other = 1 - i;
        let link = stdout(&n.ns, "ip", &["-d", "link", "show", &ifaces[i]])?;
        // This kernel has no WireGuard: a tun served by wireguard-go.
        assert!(link.contains("mtu 1440") && link.contains("tun"), "{link}");
        let addr = stdout(&n.ns, "ip", &["-4", "addr", "show", "dev", &ifaces[i]])?;
        assert!(addr.contains(&format!("{}/32", WG_ADDRS[i])), "{addr}");
        let wg = stdout(&n.ns, "wg", &["show", &ifaces[i]])?;
        for want in [
            format!("public key: {}", keys[i][0]),
            "listening port: 51820".to_string(),
            "fwmark: 0x200000".to_string(),
            format!("peer: {}", keys[other][0]),
            format!("endpoint: {}:51820", UNDERLAY[other]),
            format!("allowed ips: {}", BLOCKS[other]),
            "latest handshake".to_string(),
        ] {
            assert!(wg.contains(&want), "node{}: {want:?} in {wg}", i + 1);
        }
        let rules = stdout(&n.ns, "ip", &["rule"])?;
        assert!(
            rules.contains("99:\tnot from all fwmark 0x200000/0x200000 lookup 1"),
            "{rules}"
        );
        let t = stdout(&n.ns, "ip", &["-d", "route", "show", "table", "1"])?;
        assert!(
            t.contains(&format!(
                "unicast {} dev {} proto boot scope link",
                BLOCKS[other], ifaces[i]
            )),
            "{t}"
        );
        assert!(t.contains(&format!("throw {}", BLOCKS[i])), "{t}");
        // The same over IPv6: its own device, key, port and table.
        let link = stdout(&n.ns, "ip", &["-d", "link", "show", &ifaces6[i]])?;
        assert!(link.contains("mtu 1420"), "{link}");
        let addr = stdout(&n.ns, "ip", &["-6", "addr", "show", "dev", &ifaces6[i]])?;
        assert!(addr.contains(&format!("{}/128", WG_ADDRS6[i])), "{addr}");
        let wg = stdout(&n.ns, "wg", &["show", &ifaces6[i]])?;
        for want in [
            format!("public key: {}", keys[i][1]),
            "listening port: 51821".to_string(),
            format!("peer: {}", keys[other][1]),
            format!("endpoint: [{}]:51821", UNDERLAY6[other]),
            format!("allowed ips: {}", BLOCKS6[other]),
            "latest handshake".to_string(),
        ] {
            assert!(wg.contains(&want), "node{}: {want:?} in {wg}", i + 1);
        }
        let rules = stdout(&n.ns, "ip", &["-6", "rule"])?;
        assert!(
            rules.contains("99:\tnot from all fwmark 0x200000/0x200000 lookup 2"),
            "{rules}"
        );
        let t = stdout(&n.ns, "ip", &["-6", "route", "show", "table", "2"])?;
        assert!(
            t.contains(&format!("{} dev {}", BLOCKS6[other], ifaces6[i])),
            "{t}"
        );
        assert!(t.contains(&format!("throw {}", BLOCKS6[i])), "{t}");
    }
    let d = details(daemons[0].as_ref().expect("running")).await?;
    assert!(
        d["wireguard.v4.device"].contains(&format!("{} (userspace, wireguard-go pid", ifaces[0])),
        "{d:?}"
    );
    assert!(
        d["wireguard.support"].starts_with("kernel module not loaded")
            && d["wireguard.support"].contains("wireguard-go /"),
        "{d:?}"
    );
    assert_eq!(d["wireguard.v4.public_key"], keys[0][0]);
    assert_eq!(d["wireguard.v6.public_key"], keys[0][1]);
    assert!(
        d["wireguard.v4.peer.node2"].contains(&format!("key {}", keys[1][0])),
        "{d:?}"
    );

    // A to B and back, IPv4 and IPv6: between the nodes the underlay
    // carries WireGuard and nothing else (no pod address, no VXLAN; the
    // IPv6 underlay's neighbour discovery and multicast listener
    // reports aside).
    let wg_seen = Capture::start(&nodes[1].ns, "udp port 51820 or udp port 51821")?;
    let other = Capture::start(
        &nodes[1].ns,
        "(ip and not udp port 51820) or (ip6 and not ip6 multicast and not icmp6 and not udp port 51821)",
    )?;
    for (from, to) in [(0, 1), (1, 0)] {
        for dst in [PODS[to], PODS6[to]] {
            for p in [Probe::Tcp(80), Probe::Udp(53), Probe::Icmp] {
                assert!(
                    probe(&nodes[from].pod, dst, p),
                    "{p:?} node{} -> {dst}",
                    from + 1
                );
            }
        }
    }
    let (wg_seen, other) = (wg_seen.finish(), other.finish());
    for port in [
        format!("{}.51820", UNDERLAY[0]),
        format!("{}.51821", UNDERLAY6[0]),
    ] {
        assert!(
            wg_seen.iter().any(|l| l.contains(&port)),
            "no WireGuard from {port} on the underlay: {wg_seen:?}"
        );
    }
    assert!(
        other.is_empty(),
        "besides WireGuard on the underlay: {other:?}"
    );
    // Host-endpoint policy on both underlays that allows nothing: the
    // WireGuard port still passes (Felix's allow rules ahead of it).
    let hep = "hostEndpointUpdate:\n  id: {endpointId: underlay}\n  endpoint:\n    name: eth0\n";
    for d in daemons.iter().flatten() {
        let (rej, _) = push(&mut d.connect().await?, yaml_msgs(1100, hep)).await?;
        assert!(rej.is_empty(), "{rej:?}");
    }
    for (from, to) in [(0, 1), (1, 0)] {
        assert!(
            probe(&nodes[from].pod, PODS[to], Probe::Tcp(80)),
            "node{} -> node{} under host-endpoint policy",
            from + 1,
            to + 1
        );
    }
    let input = kernel::our_chain(&nodes[1].ns, false, "filter", "dph-INPUT")?;
    assert!(
        input.lines().any(|l| l.contains(kernel::spelled(
            "--dport 51820 -m addrtype --dst-type LOCAL -j ACCEPT",
            "udp dport 51820 fib daddr type local counter"
        )) && l.contains(kernel::spelled("ACCEPT", "accept"))),
        "{input}"
    );
    // The handshake is in status too.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let d = details(daemons[0].as_ref().expect("running")).await?;
    assert!(
        !d["wireguard.v4.peer.node2"].contains("handshake never"),
        "{d:?}"
    );
    // And in the metrics (Felix's wireguard_* names): one peer per IP
    // version, the bytes the traffic above moved, the handshake's time.
    let m = scrape(&nodes[0].ns, 9191)?;
    for v in ["4", "6"] {
        assert_eq!(
            m.get(&format!("dphandler_wireguard_peers{{ip_version=\"{v}\"}}")),
            Some(&1.0),
            "{m:#?}"
        );
    }
    let peer = format!("ip_version=\"4\",public_key=\"{}\"", keys[1][0]);
    for name in ["wireguard_bytes_sent_total", "wireguard_bytes_rcvd_total"] {
        let bytes = m.get(&format!("dphandler_{name}{{{peer}}}")).copied();
        assert!(
            bytes.is_some_and(|b| b > 1000.0),
            "{name}: {bytes:?} in {m:#?}"
        );
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs_f64();
    let hs = m
        .get(&format!(
            "dphandler_wireguard_latest_handshake_seconds{{{peer}}}"
        ))
        .copied()
        .unwrap_or(0.0);
    assert!(
        now - hs < 600.0 && hs <= now + 1.0,
        "handshake at {hs}, now {now}"
    );

    // Restart node 1's daemon, and lose its wireguard-go too: the new one
    // brings back the same key, node 2 needs no update, traffic flows.
    daemons[0].take().expect("running").stop()?;
    WgGoReaper::kill(&pid_file(0, &ifaces[0]));
    WgGoReaper::kill(&pid_file(0, &ifaces6[0]));
    let gone = Instant::now();
    while stdout(&nodes[0].ns, "ip", &["link", "show", &ifaces[0]]).is_ok_and(|l| !l.is_empty()) {
        if gone.elapsed() > Duration::from_secs(5) {
            bail!("wireguard-go did not exit");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let a = args(0);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let d1 = start_with(
        &nodes[0],
        0,
        dir.path(),
        &(feeds[0].clone() + "---\n" + &endpoints(&keys)),
        &a,
    )
    .await?;
    let mut w = watch(&d1).await?;
    for v in [4, 6] {
        assert_eq!(
            next_key(&mut w, v, Duration::from_secs(15)).await?,
            keys[0][usize::from(v == 6)],
            "a new IPv{v} key after a restart"
        );
    }
    daemons[0] = Some(d1);
    for dst in [PODS[1], PODS6[1]] {
        let mut back = false;
        for _ in 0..20 {
            if probe(&nodes[0].pod, dst, Probe::Icmp) {
                back = true;
                break;
            }
        }
        assert!(back, "A -> {dst} after node 1's restart");
    }

    // Restart node 2's daemon alone: its wireguard-go outlives it and the
    // new daemon keeps it (same process, same key); a ping running across
    // the restart loses nothing.
    let pid_before = std::fs::read_to_string(pid_file(1, &ifaces[1]))?;
    let pinger = Pinger::start(&nodes[0].pod, PODS[1])?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    daemons[1].take().expect("running").stop()?;
    let a = args(1);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let d2 = start_with(
        &nodes[1],
        1,
        dir.path(),
        &(feeds[1].clone() + "---\n" + &endpoints(&keys)),
        &a,
    )
    .await?;
    assert_eq!(
        next_key(&mut watch(&d2).await?, 4, Duration::from_secs(15)).await?,
        keys[1][0]
    );
    let d = details(&d2).await?;
    assert!(
        d["wireguard.v4.device"]
            .contains(&format!("pid {} from an earlier run", pid_before.trim())),
        "{d:?}"
    );
    daemons[1] = Some(d2);
    // A second of pings after the restart: none lost before the last reply.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let seen = pinger
        .stop()
        .context("packets lost across node 2's restart")?;
    eprintln!("ping across node 2's restart: {seen}");

    // Node 2's wireguard-go dies under its running daemon: the daemon
    // starts another (the device goes with the process) with the same key.
    WgGoReaper::kill(&pid_file(1, &ifaces[1]));
    let died = Instant::now();
    let mut back = false;
    while died.elapsed() < Duration::from_secs(15) {
        let pid = std::fs::read_to_string(pid_file(1, &ifaces[1])).unwrap_or_default();
        if pid != pid_before && probe(&nodes[0].pod, PODS[1], Probe::Icmp) {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        back,
        "no new wireguard-go on node 2, or A -> B did not come back"
    );
    let wg = stdout(&nodes[1].ns, "wg", &["show", &ifaces[1], "public-key"])?;
    assert_eq!(wg.trim(), keys[1][0]);
    eprintln!("node 2's wireguard-go replaced in {:?}", died.elapsed());

    // Node 1's WireGuard device deleted by hand while a UDP flow from A
    // to B crosses it: the daemon makes it again (a new wireguard-go, the
    // same key); the datagrams lost, the time, and any pod packet on the
    // underlay in clear meanwhile (it must never fall back to VXLAN or
    // plain routing) are measured.
    let flow = dphandler_tests::traffic::Traffic::start(
        &nodes[0].pod,
        dphandler_tests::traffic::Target {
            src: None,
            ip: PODS[1].parse()?,
            udp: 53,
            denied_tcp: None,
        },
    )?;
    let clear = Capture::start(&nodes[1].ns, "ip and not udp port 51820 and not icmp")?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid_was = std::fs::read_to_string(pid_file(0, &ifaces[0]))?;
    let t1 = stdout(
        &nodes[0].ns,
        "ip",
        &["route", "show", "table", "1", BLOCKS[1]],
    )?;
    assert!(
        t1.contains(&format!("blackhole {} metric 4096", BLOCKS[1])),
        "the fail-closed route behind the device's: {t1}"
    );
    let t = Instant::now();
    nodes[0].ns.run("ip", &["link", "del", &ifaces[0]])?;
    let remade = loop {
        let pid = std::fs::read_to_string(pid_file(0, &ifaces[0])).unwrap_or_default();
        let peers = stdout(&nodes[0].ns, "wg", &["show", &ifaces[0], "peers"]).unwrap_or_default();
        let route = stdout(
            &nodes[0].ns,
            "ip",
            &["route", "show", "table", "all", BLOCKS[1]],
        )?;
        if pid != pid_was
            && peers.contains(&keys[1][0])
            && route.contains(&format!("dev {}", ifaces[0]))
        {
            break t.elapsed();
        }
        if t.elapsed() > Duration::from_secs(20) {
            bail!("node 1's WireGuard device not made again: {route}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let seen = flow.stop();
    let clear = clear.finish();
    eprintln!(
        "faults: node 1's WireGuard device deleted by hand: made again with its peer and routes after {remade:?}; {}; pod packets in clear on the underlay meanwhile: {}",
        seen.summary(),
        clear.len()
    );
    assert!(clear.is_empty(), "in clear on the underlay: {clear:?}");
    assert!(
        seen.udp_lost < seen.udp_sent / 2,
        "the flow came back: {seen:?}"
    );

    // A third node claiming node 2's key: neither is programmed (status
    // says why).
    let c1 = || async { daemons[0].as_ref().expect("running").connect().await };
    let dup = format!(
        "hostMetadataUpdate: {{hostname: node3, ipv4Addr: '172.31.77.3'}}\n---\n\
         wireguardEndpointUpdate: {{hostname: node3, publicKey: '{}'}}\n",
        keys[1][0]
    );
    let (rej, _) = push(&mut c1().await?, yaml_msgs(2000, &dup)).await?;
    assert!(rej.is_empty(), "{rej:?}");
    let wg = stdout(&nodes[0].ns, "wg", &["show", &ifaces[0], "peers"])?;
    assert!(wg.trim().is_empty(), "peers with a duplicate key: {wg}");
    let d = details(daemons[0].as_ref().expect("running")).await?;
    assert!(
        d["wireguard.v4.not_a_peer.node2"].contains("also claimed by node3"),
        "{d:?}"
    );
    // Node 2's CIDRs go back to the main table on node 1 (node 2, which
    // still has node 1 as a peer, would answer through WireGuard: the calc
    // graph sends the same to every node, so both drop each other).
    let t = stdout(&nodes[0].ns, "ip", &["route", "show", "table", "1"])?;
    assert!(t.contains(&format!("throw {}", BLOCKS[1])), "{t}");
    let (rej, _) = push(
        &mut c1().await?,
        yaml_msgs(2100, "wireguardEndpointRemove: {hostname: node3}\n---\nhostMetadataRemove: {hostname: node3}\n"),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    let wg = stdout(&nodes[0].ns, "wg", &["show", &ifaces[0], "peers"])?;
    assert_eq!(wg.trim(), keys[1][0]);

    // Bad input: refused with a reason, nothing changes.
    let before = stdout(&nodes[0].ns, "wg", &["show", &ifaces[0], "dump"])?;
    let bad = "wireguardEndpointUpdate: {hostname: node2, publicKey: 'not-a-key', interfaceIpv4Addr: '10.65.2.1'}\n---\n\
        wireguardEndpointUpdate: {hostname: node2, publicKey: 'AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=', interfaceIpv4Addr: 'fd00::1'}\n---\n\
        hostMetadataUpdate: {hostname: node2, ipv4Addr: 'node2.example'}\n---\n\
        configUpdate: {config: {WireguardListeningPort: '70000'}}\n";
    let (mut rej, _) = push(&mut c1().await?, yaml_msgs(2200, bad)).await?;
    // The edge refuses some, the loop others: in sequence order.
    rej.sort_by_key(|r| r.sequence_number);
    assert_eq!(rej.len(), 4, "{rej:?}");
    assert!(
        rej[0].reason.contains("not a base64 WireGuard key"),
        "{rej:?}"
    );
    assert!(rej[1].reason.contains("not an IPv4 address"), "{rej:?}");
    assert!(rej[2].reason.contains("not an IP address"), "{rej:?}");
    assert!(rej[3].reason.contains("not a UDP port"), "{rej:?}");
    let after = stdout(&nodes[0].ns, "wg", &["show", &ifaces[0], "dump"])?;
    let strip = |s: &str| -> Vec<String> {
        // Handshake times and counters move; the configuration must not.
        s.lines()
            .map(|l| l.split('\t').take(4).collect::<Vec<_>>().join("\t"))
            .collect()
    };
    assert_eq!(strip(&before), strip(&after));

    // Off through ConfigUpdate: device, rule and table go; the key
    // announced is empty; the pods still reach each other (VXLAN).
    let mut w = watch(daemons[0].as_ref().expect("running")).await?;
    assert_eq!(
        next_key(&mut w, 4, Duration::from_secs(5)).await?,
        keys[0][0]
    );
    let (rej, _) = push(
        &mut c1().await?,
        yaml_msgs(
            2300,
            "configUpdate: {config: {WireguardEnabled: 'false'}}\n",
        ),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    assert_eq!(next_key(&mut w, 4, Duration::from_secs(10)).await?, "");
    let links = stdout(&nodes[0].ns, "ip", &["link", "show"])?;
    assert!(!links.contains(&ifaces[0]), "{links}");
    let rules = stdout(&nodes[0].ns, "ip", &["rule"])?;
    assert!(!rules.contains("lookup 1"), "{rules}");
    // IPv6 stays on.
    assert!(stdout(&nodes[0].ns, "ip", &["-6", "rule"])?.contains("lookup 2"));
    let t = stdout(&nodes[0].ns, "ip", &["route", "show", "table", "1"])?;
    assert!(t.trim().is_empty(), "{t}");
    // Node 2 still sends to node 1 over WireGuard until the calc graph
    // removes node 1's key there.
    let (rej, _) = push(
        &mut daemons[1].as_ref().expect("running").connect().await?,
        yaml_msgs(2400, "wireguardEndpointRemove: {hostname: node1}\n"),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    for (from, to) in [(0, 1), (1, 0)] {
        assert!(
            probe(&nodes[from].pod, PODS[to], Probe::Icmp),
            "node{} -> node{} after WireGuard off",
            from + 1,
            to + 1
        );
    }
    let d = details(daemons[0].as_ref().expect("running")).await?;
    assert_eq!(d["wireguard.v4.device"], "off");
    Ok(())
}
