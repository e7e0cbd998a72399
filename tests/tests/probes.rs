//! The four probes of a hostile or careless feeder (issue 38), replayed
//! against the real daemon, each in a namespace of its own: after each,
//! the loop is alive, a later valid workload is programmed, and the
//! node's own networking is as it was. Needs root.
//!
//! 1. A ConfigUpdate value that overflowed the loop's timer (and a panic
//!    anywhere in the loop ends the daemon, for its supervisor).
//! 2. An id or a name that every backend must take (`~` in an IP set id,
//!    the longest `--prefix` with the longest interface name).
//! 3. A workload endpoint on the uplink, a route to everything.
//! 4. A small message that decodes into gigabytes.

use std::io::Read;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use dphandler_proto::felix::{self, to_dataplane::Payload};
use dphandler_proto::v1;
use dphandler_tests::{Daemon, Netns, bin, in_sync, ipset, msg, privileged, push, tempdir};

fn policy_using(set: &str) -> Payload {
    Payload::ActivePolicyUpdate(felix::ActivePolicyUpdate {
        id: Some(felix::PolicyId {
            name: "default.p".into(),
            ..Default::default()
        }),
        policy: Some(felix::Policy {
            tier: "default".into(),
            inbound_rules: vec![felix::Rule {
                action: "allow".into(),
                src_ip_set_ids: vec![set.into()],
                ..Default::default()
            }],
            ..Default::default()
        }),
    })
}

fn workload(iface: &str, nets: &[&str], policy: bool) -> Payload {
    Payload::WorkloadEndpointUpdate(felix::WorkloadEndpointUpdate {
        id: Some(felix::WorkloadEndpointId {
            orchestrator_id: "k8s".into(),
            workload_id: format!("ns/{iface}"),
            endpoint_id: "eth0".into(),
        }),
        endpoint: Some(felix::WorkloadEndpoint {
            state: "active".into(),
            name: iface.into(),
            ipv4_nets: nets.iter().map(|n| n.to_string()).collect(),
            tiers: if policy {
                vec![felix::TierInfo {
                    name: "default".into(),
                    ingress_policies: vec![felix::PolicyId {
                        name: "default.p".into(),
                        ..Default::default()
                    }],
                    ..Default::default()
                }]
            } else {
                Vec::new()
            },
            ..Default::default()
        }),
    })
}

/// Everything the namespace's firewall holds, whoever wrote it.
fn firewall(ns: &Netns) -> Result<String> {
    let out = if dphandler_tests::kernel::nftables() {
        ns.run("nft", &["list", "ruleset"])?
    } else {
        ns.run("iptables-save", &[])?
    };
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn status(client: &mut dphandler_tests::Client) -> Result<v1::DataplaneStatus> {
    Ok(client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner())
}

/// Probe 1: `IptablesRefreshInterval: "9300000000000000000"` was taken,
/// then panicked the loop at its next timer (the process stayed up and
/// answered every later stream "shutting down"). Now refused by field;
/// the loop lives on and programs what comes next. And a panic in the
/// loop (injected: debug builds) ends the daemon with status 70 and one
/// log line saying where.
#[tokio::test]
async fn a_config_value_past_the_clock_is_refused_and_a_panic_ends_the_daemon() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("probe1")?;
    let d = Daemon::start(&ns, &socket, &[])?;
    let mut client = d.connect().await?;
    let config = Payload::ConfigUpdate(felix::ConfigUpdate {
        config: [(
            "IptablesRefreshInterval".to_string(),
            "9300000000000000000".to_string(),
        )]
        .into(),
        ..Default::default()
    });
    let (rejected, programmed) = push(&mut client, vec![msg(1, config), msg(2, in_sync())]).await?;
    assert_eq!(programmed, 2);
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(
        rejected[0].field,
        "config_update.config[IptablesRefreshInterval]"
    );
    assert!(
        rejected[0].reason.contains("must be 0 to 86400 seconds"),
        "{rejected:?}"
    );
    // The loop is alive: a workload after it is programmed.
    let (rejected, programmed) = push(
        &mut client,
        vec![
            msg(1, ipset("s:x", &["10.9.0.1"])),
            msg(2, workload("cali1", &["10.65.0.1/32"], false)),
        ],
    )
    .await?;
    assert!(rejected.is_empty() && programmed == 2, "{rejected:?}");
    assert!(firewall(&ns)?.contains("cali1"), "the workload's chains");
    let st = status(&mut client).await?;
    assert!(st.in_sync && st.failed_applies == 0, "{st:?}");
    drop(d);

    // A panic in the loop: the daemon exits 70, saying so.
    let socket2 = dir.path().join("dp2.sock");
    let log = dir.path().join("panic.log");
    let mut child = ns
        .command(bin("dphandler"))
        .args(["serve", "--socket"])
        .arg(&socket2)
        .arg("--state-dir")
        .arg(dir.path().join("state2"))
        .env("DPH_TEST_PANIC_IN_APPLY", "1")
        .env("DPH_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let mut client = dphandler_tests::connect(&socket2).await?;
    let sent = tokio::time::timeout(
        Duration::from_secs(10),
        push(&mut client, vec![msg(1, in_sync())]),
    )
    .await;
    let t0 = std::time::Instant::now();
    let code = loop {
        if let Some(st) = child.try_wait()? {
            break st.code();
        }
        if t0.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            bail!("the daemon did not exit after a panic in its loop ({sent:?})");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut text = String::new();
    std::fs::File::open(&log)?.read_to_string(&mut text)?;
    assert_eq!(code, Some(70), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("panicked: the daemon exits"))
        .with_context(|| format!("no panic line in:\n{text}"))?;
    assert!(
        line.contains("DPH_TEST_PANIC_IN_APPLY") && line.contains("sync_loop.rs"),
        "{line}"
    );
    eprintln!("probe 1: exit status {code:?}: {line}");
    Ok(())
}

/// Probe 2: an IP set id with `~`, used by a policy, passed the edge and
/// then failed every apply (`~` was no rule token); the longest prefix
/// with the longest interface name made chain names past iptables' 28
/// characters. Now every id character is a token, every chain fits, and
/// a prefix that could not is refused at start.
#[tokio::test]
async fn every_id_and_name_the_edge_takes_is_programmed() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let ns = Netns::new("probe2")?;

    // Eight characters: refused at start, naming the limit.
    let out = ns
        .command(bin("dphandler"))
        .args(["serve", "--prefix", "abcdefgh", "--socket"])
        .arg(dir.path().join("no.sock"))
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("1-7 ASCII letters or digits"), "{err}");

    let socket = dir.path().join("dp.sock");
    let d = Daemon::start(&ns, &socket, &["--prefix", "abcdefg"])?;
    let mut client = d.connect().await?;
    let iface = "cali0123456789a";
    let (rejected, programmed) = push(
        &mut client,
        vec![
            msg(1, ipset("s:a~b", &["10.9.0.1"])),
            msg(2, policy_using("s:a~b")),
            msg(3, workload(iface, &["10.65.0.1/32"], true)),
            msg(4, in_sync()),
        ],
    )
    .await?;
    assert!(rejected.is_empty(), "{rejected:?}");
    assert_eq!(programmed, 4);
    let st = status(&mut client).await?;
    assert!(st.in_sync && st.failed_applies == 0, "{st:?}");
    assert!(
        !st.details.keys().any(|k| k.starts_with("isolated.")),
        "{:?}",
        st.details
    );
    let fw = firewall(&ns)?;
    if dphandler_tests::kernel::nftables() {
        // Sharded: the interface is a key of its shard's dispatch map,
        // the policy written into its list chain, the set (named by its
        // hash) filled.
        assert!(fw.contains(&format!("\"{iface}\"")), "{fw}");
        assert!(fw.contains("10.9.0.1"), "{fw}");
    } else {
        assert!(fw.contains("abcdefg-pi-default.p"), "{fw}");
        assert!(fw.contains(&format!("abcdefg-tw-{iface}")), "{fw}");
        assert!(fw.contains("--match-set abcdefg40s:a~b src"), "{fw}");
    }
    // A later workload goes in too.
    let (rejected, _) = push(
        &mut client,
        vec![msg(1, workload("cali2", &["10.65.0.2/32"], true))],
    )
    .await?;
    assert!(rejected.is_empty(), "{rejected:?}");
    assert!(firewall(&ns)?.contains("cali2"));
    Ok(())
}

/// Probe 3: a workload endpoint named `eth0` (the uplink) with
/// `0.0.0.0/0` replaced the node's default route and set proxy ARP and
/// route_localnet on the uplink; a RouteUpdate for a local block of
/// `0.0.0.0/0` made a default blackhole. Now each is refused by field,
/// and the uplink's routes and knobs are what they were.
#[tokio::test]
async fn workloads_and_routes_cannot_take_the_uplink() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("probe3")?;
    // The node's uplink, as the test's own namespace has it.
    ns.run("ip", &["link", "set", "lo", "up"])?;
    // (A veth pair, both ends here: this kernel has no dummy links.)
    ns.run(
        "ip",
        &["link", "add", "eth0", "type", "veth", "peer", "name", "gw0"],
    )?;
    ns.run("ip", &["addr", "add", "192.0.2.10/24", "dev", "eth0"])?;
    ns.run("ip", &["link", "set", "gw0", "up"])?;
    ns.run("ip", &["link", "set", "eth0", "up"])?;
    ns.run("ip", &["route", "add", "default", "via", "192.0.2.1"])?;
    let routes = |ns: &Netns| -> Result<String> {
        let mut out = String::new();
        for v in ["-4", "-6"] {
            let o = ns.run("ip", &[v, "route", "show", "table", "all"])?;
            out.push_str(&String::from_utf8_lossy(&o.stdout));
        }
        Ok(out)
    };
    let knobs = |ns: &Netns| -> Result<String> {
        let o = ns.run(
            "sysctl",
            &[
                "net.ipv4.conf.eth0.proxy_arp",
                "net.ipv4.conf.eth0.route_localnet",
                "net.ipv4.conf.eth0.rp_filter",
            ],
        )?;
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let (routes0, knobs0) = (routes(&ns)?, knobs(&ns)?);
    let d = Daemon::start(&ns, &socket, &[])?;
    let mut client = d.connect().await?;
    let default_block = Payload::RouteUpdate(felix::RouteUpdate {
        types: 4, // LOCAL_WORKLOAD
        ip_pool_type: 2,
        dst: "0.0.0.0/0".into(),
        dst_node_name: "vm".into(),
        ..Default::default()
    });
    let uplink_block = Payload::RouteUpdate(felix::RouteUpdate {
        types: 1, // REMOTE_WORKLOAD
        ip_pool_type: 1,
        dst: "192.0.2.0/24".into(),
        dst_node_name: "other".into(),
        dst_node_ip: "192.0.2.20".into(),
        ..Default::default()
    });
    let (rejected, programmed) = push(
        &mut client,
        vec![
            msg(1, workload("eth0", &["0.0.0.0/0"], false)),
            msg(2, workload("cali1", &["0.0.0.0/0"], false)),
            msg(3, workload("cali2", &["192.0.2.10/32"], false)),
            msg(4, default_block),
            msg(5, uplink_block),
            msg(6, in_sync()),
        ],
    )
    .await?;
    assert_eq!(programmed, 6);
    let fields: Vec<(u64, &str, &str)> = rejected
        .iter()
        .map(|r| (r.sequence_number, r.field.as_str(), r.reason.as_str()))
        .collect();
    eprintln!("probe 3: {fields:#?}");
    let expect = [
        (
            1,
            "workload_endpoint_update.endpoint.name",
            "not a workload interface",
        ),
        (
            2,
            "workload_endpoint_update.endpoint.ipv4_nets[0]",
            "default route",
        ),
        (
            3,
            "workload_endpoint_update.endpoint.ipv4_nets[0]",
            "an address of this node",
        ),
        (4, "route_update.dst", "default route"),
        (5, "route_update.dst", "an address of this node"),
    ];
    assert_eq!(fields.len(), expect.len(), "{fields:?}");
    for ((seq, field, why), (s, f, r)) in expect.iter().zip(&fields) {
        assert_eq!((seq, field), (s, f), "{fields:?}");
        assert!(r.contains(why), "{seq}: {r}");
    }
    // A valid workload is programmed; the uplink is as it was.
    let (rejected, _) = push(
        &mut client,
        vec![msg(1, workload("cali3", &["10.65.0.3/32"], false))],
    )
    .await?;
    assert!(rejected.is_empty(), "{rejected:?}");
    assert!(firewall(&ns)?.contains("cali3"));
    assert_eq!(routes(&ns)?, routes0, "the node's routes changed");
    assert_eq!(knobs(&ns)?, knobs0, "the uplink's knobs changed");
    Ok(())
}

/// Peak RSS of process `pid` (`VmHWM`), in KiB.
fn peak_kib(pid: u32) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no VmHWM")
}

/// Probe 4: a policy of a million empty rules, 2 MB on the wire, took the
/// daemon from 33 MB to 2.8 GB while it decoded it, and was accepted.
/// Now it is refused before it is decoded, by field, and the daemon's
/// peak memory hardly moves; what comes after is programmed.
#[tokio::test]
async fn a_small_message_that_decodes_into_gigabytes_is_refused_undecoded() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("probe4")?;
    let d = Daemon::start(&ns, &socket, &[])?;
    let mut client = d.connect().await?;
    let (rejected, _) = push(
        &mut client,
        vec![msg(1, ipset("s:x", &["10.9.0.1"])), msg(2, in_sync())],
    )
    .await?;
    assert!(rejected.is_empty(), "{rejected:?}");
    let before = peak_kib(d.pid())?;
    let huge = Payload::ActivePolicyUpdate(felix::ActivePolicyUpdate {
        id: Some(felix::PolicyId {
            name: "default.huge".into(),
            ..Default::default()
        }),
        policy: Some(felix::Policy {
            inbound_rules: vec![felix::Rule::default(); 1_000_000],
            ..Default::default()
        }),
    });
    let wire = prost::Message::encoded_len(&msg(1, huge.clone()));
    let (rejected, programmed) = push(
        &mut client,
        vec![
            msg(1, huge),
            msg(2, workload("cali1", &["10.65.0.1/32"], false)),
        ],
    )
    .await?;
    let after = peak_kib(d.pid())?;
    eprintln!(
        "probe 4: a {} KiB message; peak RSS {} MiB before, {} MiB after",
        wire >> 10,
        before >> 10,
        after >> 10
    );
    assert_eq!(programmed, 2);
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(
        rejected[0].field,
        "active_policy_update.policy.inbound_rules"
    );
    assert!(
        rejected[0].reason.contains("more than 10000 rules"),
        "{rejected:?}"
    );
    assert!(after < 512 * 1024, "peak RSS {after} KiB");
    assert!(
        after.saturating_sub(before) < 4 * (wire as u64 >> 10) + 16 * 1024,
        "grew {} KiB on a {} KiB message",
        after - before,
        wire >> 10
    );
    assert!(firewall(&ns)?.contains("cali1"), "the workload after it");
    Ok(())
}
