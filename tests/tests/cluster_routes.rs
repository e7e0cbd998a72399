//! Pod traffic between two nodes over VXLAN and without encapsulation
//! (the two-node lab is `dphandler_tests::cluster`). Nothing global is set
//! by the test: forwarding, the VXLAN device, routes and neighbours are
//! the daemons' to make. All traffic stays inside the test's namespaces.
//! Needs root.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use dphandler_tests::cluster::*;
use dphandler_tests::lab::{Capture, Probe, connect, echo, probe, yaml_msgs};
use dphandler_tests::traffic::Pinger;
use dphandler_tests::{Netns, privileged, push, tempdir};

/// A VXLAN packet's UDP payload: VNI 4096, an Ethernet frame to `dst_mac`
/// carrying an IPv4/UDP datagram `src` → `dst`:53 (what a node's VTEP
/// sends; here made by hand, as an intruder on the underlay could).
fn vxlan_payload(dst_mac: &str, src: [u8; 4], dst: [u8; 4]) -> Vec<u8> {
    let mac = |s: &str| -> Vec<u8> {
        s.split(':')
            .map(|b| u8::from_str_radix(b, 16).expect("a MAC"))
            .collect()
    };
    let mut p = vec![0x08, 0, 0, 0, 0x00, 0x10, 0x00, 0]; // flags I, VNI 4096
    p.extend(mac(dst_mac));
    p.extend(mac("02:de:ad:be:ef:01"));
    p.extend([0x08, 0x00]); // IPv4
    let udp_len = 8 + 2u16;
    let total = 20 + udp_len;
    let mut ip = vec![
        0x45,
        0,
        (total >> 8) as u8,
        total as u8,
        0,
        1,
        0,
        0,
        64,
        17,
        0,
        0,
    ];
    ip.extend(src);
    ip.extend(dst);
    let sum = ip
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum::<u32>();
    let sum = !(((sum & 0xffff) + (sum >> 16)) as u16);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    p.extend(ip);
    p.extend([0x9c, 0x40, 0, 53, (udp_len >> 8) as u8, udp_len as u8, 0, 0]); // 40000 -> 53, no checksum
    p.extend(b"hi");
    p
}

/// Sends one hand-made VXLAN packet from `src` (an address of `ns`) to
/// `dst`:4789.
fn send_vxlan(ns: &Netns, src: &str, dst: &str, payload: Vec<u8>) -> Result<()> {
    let (src, dst): (std::net::IpAddr, std::net::IpAddr) = (src.parse()?, dst.parse()?);
    dphandler_tests::lab::in_ns(&ns.0, move || -> Result<()> {
        let s = std::net::UdpSocket::bind((src, 0))?;
        s.send_to(&payload, (dst, 4789))?;
        Ok(())
    })
}

#[tokio::test]
async fn pods_on_two_nodes_talk_over_vxlan() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let nodes = cluster("vx")?;
    let encap = "vxlanEnabled: true, vxlanEnabledV6: true";
    let feeds = [feed(0, VXLAN, encap), feed(1, VXLAN, encap)];
    let mut daemons = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        daemons.push(Some(start(n, i, dir.path(), &feeds[i]).await?));
    }

    // What each node programmed.
    for (i, n) in nodes.iter().enumerate() {
        let other = 1 - i;
        let link = stdout(&n.ns, "ip", &["-d", "link", "show", "vxlan.calico"])?;
        for want in [
            "vxlan id 4096",
            &format!("local {}", UNDERLAY[i]),
            "dev eth0",
            "dstport 4789",
            VTEP_MACS[i],
            "mtu 1450",
        ] {
            assert!(link.contains(want), "node{}: {want:?} in {link}", i + 1);
        }
        let addr = stdout(&n.ns, "ip", &["-4", "addr", "show", "dev", "vxlan.calico"])?;
        assert!(addr.contains(&format!("{}/32", VTEP_IPS[i])), "{addr}");
        let r = stdout(&n.ns, "ip", &["-d", "route", "show", BLOCKS[other]])?;
        for want in [
            &format!("via {}", VTEP_IPS[other]),
            "dev vxlan.calico",
            "proto boot",
            "onlink",
            "mtu 1450",
        ] {
            assert!(r.contains(want), "node{} route: {want:?} in {r}", i + 1);
        }
        let bh = stdout(&n.ns, "ip", &["route", "show", "type", "blackhole"])?;
        assert!(
            bh.contains(&format!("blackhole {} proto 80", BLOCKS[i])),
            "node{}: {bh}",
            i + 1
        );
        let neigh = stdout(&n.ns, "ip", &["neigh", "show", "dev", "vxlan.calico"])?;
        assert!(
            neigh.contains(&format!(
                "{} lladdr {} PERMANENT",
                VTEP_IPS[other], VTEP_MACS[other]
            )),
            "{neigh}"
        );
        let fdb = stdout(&n.ns, "bridge", &["fdb", "show", "dev", "vxlan.calico"])?;
        assert!(
            fdb.contains(&format!(
                "{} dst {} self permanent",
                VTEP_MACS[other], UNDERLAY[other]
            )),
            "{fdb}"
        );
        // The same over IPv6: vxlan-v6.calico, MTU − 70.
        let link = stdout(&n.ns, "ip", &["-d", "link", "show", "vxlan-v6.calico"])?;
        for want in [
            "vxlan id 4096",
            &format!("local {}", UNDERLAY6[i]),
            "dev eth0",
            VTEP_MACS6[i],
            "mtu 1430",
        ] {
            assert!(link.contains(want), "node{}: {want:?} in {link}", i + 1);
        }
        let r = stdout(&n.ns, "ip", &["-6", "route", "show", BLOCKS6[other]])?;
        assert!(
            r.contains(&format!("via {} dev vxlan-v6.calico", VTEP_IPS6[other]))
                && r.contains("onlink")
                && r.contains("mtu 1430"),
            "node{}: {r}",
            i + 1
        );
        let bh = stdout(&n.ns, "ip", &["-6", "route", "show", "type", "blackhole"])?;
        assert!(bh.contains(BLOCKS6[i]), "node{}: {bh}", i + 1);
        let neigh = stdout(
            &n.ns,
            "ip",
            &["-6", "neigh", "show", "dev", "vxlan-v6.calico"],
        )?;
        assert!(
            neigh.contains(&format!(
                "{} lladdr {} PERMANENT",
                VTEP_IPS6[other], VTEP_MACS6[other]
            )),
            "{neigh}"
        );
        let fdb = stdout(&n.ns, "bridge", &["fdb", "show", "dev", "vxlan-v6.calico"])?;
        assert!(
            fdb.contains(&format!(
                "{} dst {} self permanent",
                VTEP_MACS6[other], UNDERLAY6[other]
            )),
            "{fdb}"
        );
    }

    // What node 1 reports (GetStatus; `dphctl status` prints the same).
    let mut c1 = daemons[0].as_ref().expect("running").connect().await?;
    let st = c1
        .get_status(dphandler_proto::v1::GetStatusRequest {})
        .await?
        .into_inner();
    let d = &st.details;
    assert_eq!(d.get("node").map(String::as_str), Some("node1"), "{d:?}");
    // Whether this kernel can do IPIP (tunl0) is reported either way.
    assert!(d.contains_key("ipip"), "{d:?}");
    // One route to the other node's block and one blackhole per family.
    assert_eq!(
        d.get("routes.vxlan").map(String::as_str),
        Some("2"),
        "{d:?}"
    );
    assert_eq!(
        d.get("routes.blackhole").map(String::as_str),
        Some("2"),
        "{d:?}"
    );
    assert!(
        d.get("vxlan.vxlan.calico")
            .is_some_and(|v| v.contains("vni 4096") && v.contains("parent eth0")),
        "{d:?}"
    );
    assert!(
        d.get("vxlan.vxlan-v6.calico")
            .is_some_and(|v| v.contains("local fd00:77::1") && v.contains("mtu 1430")),
        "{d:?}"
    );
    assert_eq!(d.get("kernel.fdb").map(String::as_str), Some("2"), "{d:?}");
    assert!(!d.keys().any(|k| k.starts_with("routes.waiting")), "{d:?}");

    // A to B and back, over VXLAN: the underlay carries UDP 4789 and no
    // pod address in the clear.
    let vxlan_seen = Capture::start(&nodes[1].ns, "udp dst port 4789")?;
    let clear = Capture::start(
        &nodes[1].ns,
        "(net 10.65.0.0/16 or net fd00:65::/48) and not udp port 4789",
    )?;
    assert_all(&nodes[0].pod, PODS[1], true, "A -> B");
    assert_all(&nodes[1].pod, PODS[0], true, "B -> A");
    assert_all(&nodes[0].pod, PODS6[1], true, "A -> B over IPv6");
    assert_all(&nodes[1].pod, PODS6[0], true, "B -> A over IPv6");
    let (vx, clear) = (vxlan_seen.finish(), clear.finish());
    for dst in [UNDERLAY[1], UNDERLAY6[1]] {
        assert!(
            vx.iter().any(|l| l.contains(&format!("{dst}.4789"))),
            "no VXLAN to {dst} on the underlay: {vx:?}"
        );
    }
    assert!(clear.is_empty(), "pod addresses in the clear: {clear:?}");

    // VXLAN to node 2 only from known nodes: a packet made as node 1's
    // VTEP would make it arrives at pod B when it comes from node 1's
    // address, and is dropped when it comes from another address on the
    // underlay (an intruder forging pod traffic).
    nodes[0]
        .ns
        .run("ip", &["addr", "add", "172.31.77.9/24", "dev", "eth0"])?;
    let forged = |from: &str| -> Result<Vec<String>> {
        let seen = Capture::start_on(&nodes[1].ns, "caliB", "udp and host 10.65.1.77")?;
        for _ in 0..3 {
            send_vxlan(
                &nodes[0].ns,
                from,
                UNDERLAY[1],
                vxlan_payload(VTEP_MACS[1], [10, 65, 1, 77], [10, 65, 2, 2]),
            )?;
        }
        Ok(seen.finish())
    };
    let known = forged(UNDERLAY[0])?;
    assert!(
        known.iter().any(|l| l.contains("10.65.1.77")),
        "the hand-made VXLAN packet from node 1 did not arrive: {known:?}"
    );
    let unknown = forged("172.31.77.9")?;
    assert!(
        unknown.is_empty(),
        "VXLAN from an unknown underlay address reached pod B: {unknown:?}"
    );

    // Blackhole: an address of node 1's block with no workload gets no
    // reply and does not leak to node 1's default route.
    nodes[0]
        .ns
        .run("ip", &["route", "add", "default", "via", UNDERLAY[1]])?;
    let matching = stdout(&nodes[0].ns, "ip", &["route", "show", "match", "10.65.1.9"])?;
    assert!(
        matching.contains(&format!("blackhole {} proto 80", BLOCKS[0])),
        "{matching}"
    );
    // The kernel refuses to route it (a blackhole's EINVAL), where without
    // the blackhole it would take the default route.
    assert!(
        nodes[0]
            .ns
            .run("ip", &["route", "get", "10.65.1.9"])
            .is_err()
    );
    let leak = Capture::start(&nodes[0].ns, "net 10.65.1.0/26")?;
    assert!(!probe(&nodes[1].pod, "10.65.1.9", Probe::Icmp));
    assert!(!probe(&nodes[0].pod, "10.65.1.9", Probe::Icmp));
    let leak = leak.finish();
    // VXLAN packets do not match the filter (their outer addresses are the
    // nodes'): anything caught crossed the underlay in the clear.
    assert!(
        !leak.iter().any(|l| l.contains("10.65.1.9")),
        "a packet to 10.65.1.9 left node 1: {leak:?}"
    );
    nodes[0]
        .ns
        .run("ip", &["route", "del", "default", "via", UNDERLAY[1]])?;

    // A restart of either daemon drops nothing: a ping every 20 ms runs
    // through both restarts, and a TCP connection made before them still
    // carries data after them.
    let _echo = echo(&nodes[1].pod.0, 7);
    let mut conn = connect(&nodes[0].pod, format!("{}:7", PODS[1]).parse()?)?;
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut roundtrip = |msg: &[u8]| -> Result<()> {
        use std::io::{Read, Write};
        conn.write_all(msg)?;
        let mut got = vec![0u8; msg.len()];
        conn.read_exact(&mut got)?;
        if got != msg {
            bail!("echo returned {got:?}");
        }
        Ok(())
    };
    roundtrip(b"before")?;
    let pinger = Pinger::start(&nodes[0].pod, PODS[1])?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in [0, 1] {
        daemons[i].take().expect("running").stop()?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        daemons[i] = Some(start(&nodes[i], i, dir.path(), &feeds[i]).await?);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    roundtrip(b"after both restarts")
        .context("the TCP connection made before the restarts broke")?;
    let seen = pinger.stop().context("packets lost across the restarts")?;
    eprintln!("ping across both restarts: {seen}");

    // Policy on node 2 still decides: a deny-all ingress policy on B.
    let deny = "activePolicyUpdate:\n  id: {name: t.deny}\n  policy:\n    tier: t\n    inboundRules: [{action: deny}]\n---\n\
        workloadEndpointUpdate:\n  id: {orchestratorId: k8s, workloadId: ns/pod1, endpointId: eth0}\n  endpoint:\n    name: caliB\n    mac: '02:00:00:00:00:02'\n    ipv4Nets: [10.65.2.2/32]\n    profileIds: [kns.ns]\n    tiers:\n      - name: t\n        ingressPolicies: [{name: t.deny}]\n        defaultAction: deny\n";
    let mut c2 = daemons[1].as_ref().expect("running").connect().await?;
    let (rej, _) = push(&mut c2, yaml_msgs(100, deny)).await?;
    assert!(rej.is_empty(), "{rej:?}");
    assert_all(&nodes[0].pod, PODS[1], false, "A -> B under B's deny");
    // Back to the snapshot: open again.
    let (rej, _) = push(&mut c2, yaml_msgs(200, &feeds[1])).await?;
    assert!(rej.is_empty(), "{rej:?}");
    assert_all(&nodes[0].pod, PODS[1], true, "A -> B after the deny");

    // Bad input is refused with a reason and changes nothing.
    let mut c1 = daemons[0].as_ref().expect("running").connect().await?;
    let before = stdout(&nodes[0].ns, "ip", &["route"])?;
    let bad = "vtepUpdate: {node: node3, mac: 'ff:ff:ff:ff:ff:ff', ipv4Addr: '10.65.3.0', parentDeviceIp: '172.31.77.3'}\n---\n\
        routeUpdate: {types: 1, ipPoolType: VXLAN, dst: '10.65.2.0/24', dstNodeName: node3, dstNodeIp: '172.31.77.3'}\n";
    let (rej, _) = push(&mut c1, yaml_msgs(300, bad)).await?;
    assert_eq!(rej.len(), 2, "{rej:?}");
    assert!(rej[0].reason.contains("not a unicast MAC"), "{rej:?}");
    assert!(
        rej[1].reason.contains("overlaps block 10.65.2.0/26"),
        "{rej:?}"
    );
    assert_eq!(
        stdout(&nodes[0].ns, "ip", &["route"])?,
        before,
        "routes unchanged"
    );
    assert_all(&nodes[0].pod, PODS[1], true, "A -> B after bad input");

    // RouteRemove of B's block on node 1 cuts A from B.
    let (rej, _) = push(
        &mut c1,
        yaml_msgs(400, &format!("routeRemove: {{dst: '{}'}}\n", BLOCKS[1])),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    let r = stdout(&nodes[0].ns, "ip", &["route", "show", BLOCKS[1]])?;
    assert!(r.trim().is_empty(), "route still there: {r}");
    assert!(
        !probe(&nodes[0].pod, PODS[1], Probe::Icmp),
        "A -> B after RouteRemove"
    );

    // VXLAN off: the device goes, with its routes and neighbours; foreign
    // routes stay.
    let (rej, _) = push(&mut c1, yaml_msgs(500, "encapsulation: {}\n")).await?;
    assert!(rej.is_empty(), "{rej:?}");
    let links = stdout(&nodes[0].ns, "ip", &["link", "show"])?;
    assert!(!links.contains("vxlan.calico"), "{links}");
    for n in &nodes {
        let r = stdout(&n.ns, "ip", &["route", "show", "198.18.0.0/24"])?;
        assert!(r.contains("proto static"), "foreign route gone: {r}");
    }
    Ok(())
}

#[tokio::test]
async fn same_subnet_nodes_route_pods_without_encapsulation() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let nodes = cluster("ne")?;
    let encap = "noEncapEnabled: true";
    let mut daemons = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        daemons.push(start(n, i, dir.path(), &feed(i, NO_ENCAP, encap)).await?);
    }
    for (i, n) in nodes.iter().enumerate() {
        let other = 1 - i;
        let r = stdout(&n.ns, "ip", &["route", "show", BLOCKS[other]])?;
        for want in [
            &format!("via {}", UNDERLAY[other]),
            "dev eth0",
            "proto 80",
            "onlink",
        ] {
            assert!(r.contains(want), "node{}: {want:?} in {r}", i + 1);
        }
        let links = stdout(&n.ns, "ip", &["link", "show"])?;
        assert!(!links.contains("vxlan"), "no VXLAN device: {links}");
    }
    // Plain routing: the pods' packets cross the underlay as they are.
    let clear = Capture::start(&nodes[1].ns, &format!("host {}", PODS[0]))?;
    assert_all(&nodes[0].pod, PODS[1], true, "A -> B");
    assert_all(&nodes[1].pod, PODS[0], true, "B -> A");
    let clear = clear.finish();
    assert!(
        clear.iter().any(|l| l.contains(PODS[0])),
        "the pods' packets did not cross eth0 as they are: {clear:?}"
    );
    drop(daemons);
    Ok(())
}

/// `vxlan.calico` deleted by hand on node 1 while a UDP flow from pod A to
/// pod B crosses it and a port B's policy denies is probed: its link
/// event (not the 90 s refresh tick) makes the device again with its
/// address, routes, neighbour and FDB entry; the datagrams lost until then, and the time, are
/// measured (`faults:`); nothing denied gets through.
#[tokio::test]
async fn a_deleted_vxlan_device_is_made_again_while_traffic_flows() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    use dphandler_tests::traffic::{Target, Traffic};
    let dir = tempdir()?;
    let nodes = cluster("fvx")?;
    // B's extra server on the denied port.
    let _denied = dphandler_tests::lab::serve(&nodes[1].pod.0, &[81], &[]);
    let encap = "vxlanEnabled: true";
    let policy = "inboundRules: [{action: allow, protocol: {name: udp}}, {action: allow, protocol: {name: icmp}}, {action: allow, protocol: {name: tcp}, dstPorts: [{first: 80, last: 80}]}]";
    let mut daemons = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        let yaml = feed(i, VXLAN, encap).replace("inboundRules: [{action: allow}]", policy);
        daemons.push(start(n, i, dir.path(), &yaml).await?);
    }
    let traffic = Traffic::start(
        &nodes[0].pod,
        Target {
            src: None,
            ip: PODS[1].parse()?,
            udp: 53,
            denied_tcp: Some(81),
        },
    )?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let n1 = &nodes[0].ns;
    let state = || -> Result<(String, String, String)> {
        Ok((
            // (Without the link's index: a new device has a new one.)
            stdout(n1, "ip", &["-4", "addr", "show", "dev", "vxlan.calico"])
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("inet "))
                .collect(),
            stdout(n1, "ip", &["route", "show", BLOCKS[1]])?,
            stdout(n1, "ip", &["neigh", "show", VTEP_IPS[1]])?,
        ))
    };
    let before = state()?;
    assert!(before.1.contains("dev vxlan.calico"), "{before:?}");
    let t = std::time::Instant::now();
    n1.run("ip", &["link", "del", "vxlan.calico"])?;
    let repaired = loop {
        if state()? == before {
            break t.elapsed();
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!("not made again in 30 s: {:?}", state()?);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seen = traffic.stop();
    let fdb = stdout(n1, "bridge", &["fdb", "show", "dev", "vxlan.calico"])?;
    eprintln!(
        "faults: vxlan.calico deleted by hand: made again with its address, route and neighbour after {repaired:?} (at its link event, not the refresh tick); {}",
        seen.summary()
    );
    assert!(
        fdb.contains(&format!("{} dst {}", VTEP_MACS[1], UNDERLAY[1])),
        "{fdb}"
    );
    assert!(repaired < Duration::from_secs(2), "{repaired:?}");
    assert!(seen.denied_through.is_empty(), "{seen:?}");
    assert!(
        seen.udp_lost < seen.udp_sent / 2,
        "the flow came back: {seen:?}"
    );
    drop(daemons);
    Ok(())
}
