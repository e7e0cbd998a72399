//! Policy enforcement with real packets: a "host" namespace running the
//! real daemon and two workload namespaces joined to it by veth pairs, set
//! up the way Calico's CNI does (a /32 on the workload's eth0, a default
//! route via 169.254.1.1, a host-side `caliX` interface with a /32 route).
//! Endpoints, policies, profiles and IP sets go in over gRPC; TCP and ICMP
//! between the workloads show what is allowed. All traffic stays inside the
//! test's namespaces. Needs root.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result};
use dphandler_tests::lab::{self, tcp_ok, yaml_msgs};
use dphandler_tests::{Daemon, Netns, privileged, push, tempdir};

/// A workload namespace `iface` ↔ `eth0`, address `ip`, with the host's
/// route to it added by hand (the daemon takes it over).
fn workload(host: &Netns, iface: &str, ip: &str) -> Result<Netns> {
    let n = iface.trim_start_matches("cali").parse().unwrap_or(9);
    lab::workload_v4(host, iface, n, ip)
}

fn listen(ns: &str, ports: &[u16]) -> lab::Servers {
    lab::serve(ns, ports, &[])
}

fn tcp(from: &Netns, to: &str, port: u16) -> bool {
    let addr: SocketAddr = format!("{to}:{port}").parse().unwrap();
    tcp_ok(from, addr, Duration::from_millis(700))
}

/// Whether a byte sent on `flow` (to an echo server) comes back within
/// a second.
fn echoes(flow: &mut std::net::TcpStream) -> bool {
    use std::io::{Read, Write};
    let mut b = [0u8; 1];
    flow.set_read_timeout(Some(Duration::from_secs(1))).is_ok()
        && flow.write_all(b"x").is_ok()
        && flow.read_exact(&mut b).is_ok()
        && &b == b"x"
}

fn ping(from: &Netns, to: &str) -> bool {
    from.command("ping")
        .args(["-c", "1", "-W", "1", to])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn wep(iface: &str, ip: &str, extra: &str) -> String {
    format!(
        "workloadEndpointUpdate:\n  id: {{orchestratorId: k8s, workloadId: ns/{iface}, endpointId: eth0}}\n  endpoint:\n    name: {iface}\n    ipv4Nets: [{ip}/32]\n{extra}"
    )
}

#[tokio::test]
async fn connectivity_follows_policy() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let host = Netns::new("host")?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    let w1 = workload(&host, "cali1", "10.65.0.2")?;
    let w2 = workload(&host, "cali2", "10.65.0.3")?;
    let _l = listen(&w2.0, &[80, 81]);
    let _echo = lab::echo(&w2.0, 82);

    // Before the daemon: a namespace with the kernel's defaults does not
    // forward; the daemon has to turn that on (as Felix does).
    assert!(
        !tcp(&w1, "10.65.0.3", 80),
        "the fresh namespace forwards already: this test would not show the daemon doing it"
    );

    let d = Daemon::start(&host, &dir.path().join("dp.sock"), &["--ipv6", "false"])?;
    let mut c = d.connect().await.context("daemon")?;
    let mut watch = c
        .status_updates(dphandler_proto::v1::StatusUpdatesRequest {})
        .await?
        .into_inner();

    // 1. Known endpoints without profiles or policies: nothing is allowed.
    let yaml = format!(
        "{}\n---\n{}\n---\ninSync: {{}}\n",
        wep("cali1", "10.65.0.2", ""),
        wep("cali2", "10.65.0.3", "")
    );
    let (rej, _) = push(&mut c, yaml_msgs(1, &yaml)).await?;
    assert!(rej.is_empty(), "{rej:?}");
    assert!(!tcp(&w1, "10.65.0.3", 80), "no policy: denied");
    assert!(!ping(&w1, "10.65.0.3"));
    // Both endpoints are reported up on StatusUpdates.
    let mut up = std::collections::BTreeSet::new();
    while up.len() < 2 {
        let u = tokio::time::timeout(Duration::from_secs(5), watch.message())
            .await??
            .context("StatusUpdates ended")?;
        let text = format!("{u:?}");
        if text.contains("WorkloadEndpointStatusUpdate") && text.contains("\"up\"") {
            up.insert(if text.contains("ns/cali1") { 1 } else { 2 });
        }
    }

    // 2. A profile allowing everything, on both: all flows.
    let allow_all = "activeProfileUpdate:\n  id: {name: kns.ns}\n  profile:\n    inboundRules: [{action: allow}]\n    outboundRules: [{action: allow}]\n";
    let yaml = format!(
        "{allow_all}---\n{}---\n{}",
        wep("cali1", "10.65.0.2", "    profileIds: [kns.ns]\n"),
        wep("cali2", "10.65.0.3", "    profileIds: [kns.ns]\n")
    );
    push(&mut c, yaml_msgs(10, &yaml)).await?;
    assert!(tcp(&w1, "10.65.0.3", 80), "profile allows");
    assert!(tcp(&w1, "10.65.0.3", 81));
    assert!(ping(&w1, "10.65.0.3"));
    assert!(
        !tcp(&w2, "10.65.0.2", 22),
        "nothing listens on w1:22 (sanity)"
    );

    // 3. A tier on w2's ingress: tcp/80 from the IP set of w1 only; the
    //    tier's default drop stops the rest before the profile.
    let tier = "    tiers:\n      - name: default\n        ingressPolicies: [{name: default.web}]\n        defaultAction: deny\n";
    let yaml = format!(
        "ipsetUpdate: {{id: 's:clients', type: IP, members: [10.65.0.2]}}\n---\n\
         activePolicyUpdate:\n  id: {{name: default.web}}\n  policy:\n    tier: default\n    inboundRules:\n      - action: allow\n        protocol: {{name: tcp}}\n        srcIpSetIds: ['s:clients']\n        dstPorts: [{{first: 80}}]\n---\n{}",
        wep(
            "cali2",
            "10.65.0.3",
            &format!("    profileIds: [kns.ns]\n{tier}")
        )
    );
    let (rej, _) = push(&mut c, yaml_msgs(20, &yaml)).await?;
    assert!(rej.is_empty(), "{rej:?}");
    assert!(
        tcp(&w1, "10.65.0.3", 80),
        "policy allows tcp/80 from the set"
    );
    assert!(!tcp(&w1, "10.65.0.3", 81), "tier default drop");
    assert!(!ping(&w1, "10.65.0.3"), "icmp is not allowed by the policy");

    // 4. The set loses w1: tcp/80 is denied too.
    push(
        &mut c,
        yaml_msgs(
            30,
            "ipsetDeltaUpdate: {id: 's:clients', removedMembers: [10.65.0.2]}\n",
        ),
    )
    .await?;
    assert!(!tcp(&w1, "10.65.0.3", 80), "no longer in the set");
    push(
        &mut c,
        yaml_msgs(
            31,
            "ipsetDeltaUpdate: {id: 's:clients', addedMembers: [10.65.0.2]}\n",
        ),
    )
    .await?;
    assert!(tcp(&w1, "10.65.0.3", 80), "back in the set");

    // 5. The policy removed while the endpoint still lists it: nothing in
    //    the tier can allow, so the tier's default drop applies.
    push(
        &mut c,
        yaml_msgs(40, "activePolicyRemove: {id: {name: default.web}}\n"),
    )
    .await?;
    assert!(!tcp(&w1, "10.65.0.3", 80));

    // 6. A pass tier hands over to the profile again.
    let pass = "    tiers:\n      - name: default\n        ingressPolicies: [{name: default.web}]\n        defaultAction: pass\n";
    push(
        &mut c,
        yaml_msgs(
            50,
            &wep(
                "cali2",
                "10.65.0.3",
                &format!("    profileIds: [kns.ns]\n{pass}"),
            ),
        ),
    )
    .await?;
    assert!(tcp(&w1, "10.65.0.3", 81), "pass tier: the profile allows");

    // 7. Administratively down: dropped whatever the profile says.
    push(
        &mut c,
        yaml_msgs(
            60,
            &wep(
                "cali2",
                "10.65.0.3",
                "    state: down\n    profileIds: [kns.ns]\n",
            ),
        ),
    )
    .await?;
    assert!(!tcp(&w1, "10.65.0.3", 80), "admin down");

    // 8. Up again, an established flow to it; then the endpoint removed:
    //    its interface is unknown, dispatch drops it, the established
    //    flow too (as Felix's dispatch does).
    push(
        &mut c,
        yaml_msgs(65, &wep("cali2", "10.65.0.3", "    profileIds: [kns.ns]\n")),
    )
    .await?;
    let mut flow = lab::connect(&w1, "10.65.0.3:82".parse()?)?;
    assert!(echoes(&mut flow), "the flow before the removal");
    push(
        &mut c,
        yaml_msgs(70, "workloadEndpointRemove: {id: {orchestratorId: k8s, workloadId: ns/cali2, endpointId: eth0}}\n"),
    )
    .await?;
    assert!(
        !tcp(&w1, "10.65.0.3", 80),
        "unknown workload interface: fail closed"
    );
    // The route went with the endpoint; one put back by hand (as a stale
    // route of someone else's would be) leaves the drop to dispatch.
    host.run("ip", &["route", "replace", "10.65.0.3/32", "dev", "cali2"])?;
    assert!(
        !echoes(&mut flow),
        "an established flow to and from an unknown workload interface: dropped"
    );

    // And the daemon stopping leaves enforcement as it is.
    assert!(d.stop()?.success());
    assert!(!tcp(&w1, "10.65.0.3", 80), "kernel state left as it was");
    Ok(())
}

#[tokio::test]
async fn routes_and_neighbours_to_workloads_are_programmed() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let host = Netns::new("rthost")?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    let w1 = workload(&host, "cali1", "10.65.0.2")?;
    let w2 = workload(&host, "cali2", "10.65.0.3")?;
    // Take the hand-made route to w2 away: the daemon must program it.
    host.run("ip", &["route", "del", "10.65.0.3/32", "dev", "cali2"])?;
    // A route of another owner on a workload interface and one of ours
    // that is stale: both go (every route on a workload interface is ours,
    // Felix's RemoveExternalRoutes). A route of another owner elsewhere
    // stays.
    host.run(
        "ip",
        &[
            "route",
            "add",
            "10.77.0.0/24",
            "dev",
            "cali2",
            "proto",
            "static",
        ],
    )?;
    host.run(
        "ip",
        &[
            "route",
            "add",
            "10.79.0.0/24",
            "dev",
            "lo",
            "proto",
            "static",
        ],
    )?;
    host.run(
        "ip",
        &[
            "route",
            "add",
            "10.78.0.0/24",
            "dev",
            "cali2",
            "proto",
            "80",
        ],
    )?;
    let _l = listen(&w2.0, &[80]);
    assert!(!tcp(&w1, "10.65.0.3", 80), "no route to w2 yet");
    let w2_mac = String::from_utf8_lossy(&w2.run("cat", &["/sys/class/net/eth0/address"])?.stdout)
        .trim()
        .to_string();

    let d = Daemon::start(&host, &dir.path().join("dp.sock"), &["--ipv6", "false"])?;
    let mut c = d.connect().await?;
    let allow_all = "activeProfileUpdate:\n  id: {name: kns.ns}\n  profile:\n    inboundRules: [{action: allow}]\n    outboundRules: [{action: allow}]\n";
    let yaml = format!(
        "{allow_all}---\n{}---\n{}---\ninSync: {{}}\n",
        wep("cali1", "10.65.0.2", "    profileIds: [kns.ns]\n"),
        wep(
            "cali2",
            "10.65.0.3",
            &format!("    profileIds: [kns.ns]\n    mac: '{w2_mac}'\n")
        )
    );
    let (rej, _) = push(&mut c, yaml_msgs(1, &yaml)).await?;
    assert!(rej.is_empty(), "{rej:?}");
    let routes =
        String::from_utf8_lossy(&host.run("ip", &["-d", "route", "show"])?.stdout).into_owned();
    assert!(
        routes.contains("unicast 10.65.0.3 dev cali2 proto boot scope link"),
        "{routes}"
    );
    assert!(
        routes.contains("unicast 10.65.0.2 dev cali1 proto boot scope link"),
        "{routes}"
    );
    assert!(
        !routes.contains("10.78.0.0/24"),
        "stale route of ours removed: {routes}"
    );
    assert!(
        !routes.contains("10.77.0.0/24"),
        "unexpected route on a workload interface removed: {routes}"
    );
    assert!(
        routes.contains("10.79.0.0/24 dev lo proto static"),
        "foreign route kept: {routes}"
    );
    let neigh =
        String::from_utf8_lossy(&host.run("ip", &["neigh", "show", "dev", "cali2"])?.stdout)
            .into_owned();
    assert!(
        neigh.contains(&format!("10.65.0.3 lladdr {w2_mac} PERMANENT")),
        "{neigh}"
    );
    assert!(
        tcp(&w1, "10.65.0.3", 80),
        "w2 reachable through the daemon's route"
    );
    // Felix's per-interface settings on the workload interfaces.
    for (knob, want) in [
        ("/proc/sys/net/ipv4/conf/cali2/proxy_arp", "1"),
        ("/proc/sys/net/ipv4/conf/cali2/rp_filter", "1"),
        ("/proc/sys/net/ipv4/conf/cali2/route_localnet", "1"),
        ("/proc/sys/net/ipv4/neigh/cali2/proxy_delay", "0"),
    ] {
        let v = String::from_utf8_lossy(&host.run("cat", &[knob])?.stdout)
            .trim()
            .to_string();
        assert_eq!(v, want, "{knob}");
    }

    // The endpoint goes: its route and neighbour go too.
    push(
        &mut c,
        yaml_msgs(10, "workloadEndpointRemove: {id: {orchestratorId: k8s, workloadId: ns/cali2, endpointId: eth0}}\n"),
    )
    .await?;
    let routes = String::from_utf8_lossy(&host.run("ip", &["route", "show"])?.stdout).into_owned();
    assert!(!routes.contains("10.65.0.3"), "{routes}");
    let neigh =
        String::from_utf8_lossy(&host.run("ip", &["neigh", "show", "dev", "cali2"])?.stdout)
            .into_owned();
    assert!(!neigh.contains("PERMANENT"), "{neigh}");
    Ok(())
}

#[tokio::test]
async fn established_flows_survive_a_policy_change_new_ones_follow_it() -> Result<()> {
    use std::io::{Read, Write};
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let host = Netns::new("flowh")?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    let w1 = workload(&host, "cali1", "10.65.0.2")?;
    let w2 = workload(&host, "cali2", "10.65.0.3")?;
    // An echo server on w2:80.
    {
        let file = std::fs::File::open(format!("/run/netns/{}", w2.0))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let l = TcpListener::bind("0.0.0.0:80").unwrap();
            tx.send(()).unwrap();
            for s in l.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut s = s;
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 || s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        rx.recv()?;
    }
    let d = Daemon::start(&host, &dir.path().join("dp.sock"), &["--ipv6", "false"])?;
    let mut c = d.connect().await?;
    let allow = "activeProfileUpdate:\n  id: {name: kns.ns}\n  profile:\n    inboundRules: [{action: allow}]\n    outboundRules: [{action: allow}]\n";
    let yaml = format!(
        "{allow}---\n{}---\n{}---\ninSync: {{}}\n",
        wep("cali1", "10.65.0.2", "    profileIds: [kns.ns]\n"),
        wep("cali2", "10.65.0.3", "    profileIds: [kns.ns]\n")
    );
    push(&mut c, yaml_msgs(1, &yaml)).await?;

    // A long-lived connection from w1, opened while allowed.
    let file = std::fs::File::open(format!("/run/netns/{}", w1.0))?;
    let (cmd_tx, cmd_rx) = std::sync::mpsc::channel::<()>();
    let (res_tx, res_rx) = std::sync::mpsc::channel::<bool>();
    std::thread::spawn(move || {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let mut s =
            TcpStream::connect_timeout(&"10.65.0.3:80".parse().unwrap(), Duration::from_secs(1))
                .expect("connect while allowed");
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        while cmd_rx.recv().is_ok() {
            let mut buf = [0u8; 5];
            let ok =
                s.write_all(b"hello").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"hello";
            res_tx.send(ok).unwrap();
        }
    });
    let exchange = || -> bool {
        cmd_tx.send(()).unwrap();
        res_rx.recv_timeout(Duration::from_secs(3)).unwrap_or(false)
    };
    assert!(exchange(), "the flow works while allowed");

    // The profile now denies new inbound connections to w2.
    push(
        &mut c,
        yaml_msgs(10, "activeProfileUpdate:\n  id: {name: kns.ns}\n  profile:\n    inboundRules: [{action: deny}]\n    outboundRules: [{action: allow}]\n"),
    )
    .await?;
    assert!(
        !tcp(&w1, "10.65.0.3", 80),
        "a new connection follows the new policy"
    );
    assert!(
        exchange(),
        "the established flow carries on (conntrack), as in Felix"
    );

    // The profile removed while the flow runs: still established.
    push(
        &mut c,
        yaml_msgs(20, "activeProfileRemove: {id: {name: kns.ns}}\n"),
    )
    .await?;
    assert!(exchange(), "still established after the profile went");
    assert!(!tcp(&w1, "10.65.0.3", 80));
    Ok(())
}
