//! Faults while traffic flows: the real daemon in a "host" namespace with
//! two workloads, a UDP flow between them established under policy (one
//! datagram and its echo every 10 ms: each lost one counted) and a denied
//! TCP port probed every 50 ms (each connection that gets through
//! counted), while the daemon is killed mid-apply and restarted, its kernel
//! tool fails, its feeder drops mid-snapshot, or its chains and sets are
//! changed by hand. Each test prints what it measured (`faults:` lines;
//! docs/reliability.md's table is one run of them). All traffic stays
//! inside the test's namespaces. Needs root.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dphandler_proto::felix::to_dataplane::Payload;
use dphandler_proto::{felix, v1};
use dphandler_tests::kernel::{
    flush_our_chain, flush_our_set, nftables, our_chain, our_set_copies, spelled, without_counters,
};
use dphandler_tests::lab::{self, yaml_msgs};
use dphandler_tests::traffic::{Target, Traffic};
use dphandler_tests::{Daemon, Feed, Netns, privileged, push, tempdir};

const W1: &str = "10.65.0.2";
const W2: &str = "10.65.0.3";
/// The established flow's port (allowed), and the denied port.
const UDP_OK: u16 = 5353;
const TCP_DENIED: u16 = 81;
/// The traffic loop's target: w2.
const TARGET: Target = Target {
    src: None,
    ip: IpAddr::V4(Ipv4Addr::new(10, 65, 0, 3)),
    udp: UDP_OK,
    denied_tcp: Some(TCP_DENIED),
};

fn wep(iface: &str, ip: &str) -> String {
    format!(
        "workloadEndpointUpdate:\n  id: {{orchestratorId: k8s, workloadId: ns/{iface}, endpointId: eth0}}\n  endpoint:\n    name: {iface}\n    ipv4Nets: [{ip}/32]\n    profileIds: [kns.ns]\n"
    )
}

/// The profile: inbound UDP 5353 and TCP 80 only (and `extra`).
fn profile(extra: &str) -> String {
    format!(
        "activeProfileUpdate:\n  id: {{name: kns.ns}}\n  profile:\n    inboundRules:\n      - {{action: allow, protocol: {{name: udp}}, dstPorts: [{{first: {UDP_OK}, last: {UDP_OK}}}]}}\n      - {{action: allow, protocol: {{name: tcp}}, dstPorts: [{{first: 80, last: 80}}]}}\n{extra}    outboundRules: [{{action: allow}}]\n"
    )
}

fn snapshot() -> String {
    format!(
        "{}---\n{}---\n{}---\ninSync: {{}}\n",
        profile(""),
        wep("cali1", W1),
        wep("cali2", W2)
    )
}

/// The host and its two workloads, servers on w2.
struct Lab {
    host: Netns,
    w1: Netns,
    _w2: Netns,
    _servers: lab::Servers,
}

fn lab(tag: &str) -> Result<Lab> {
    let host = Netns::new(tag)?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    let w1 = lab::workload_v4(&host, "cali1", 1, W1)?;
    let w2 = lab::workload_v4(&host, "cali2", 2, W2)?;
    let servers = lab::serve(&w2.0, &[80, TCP_DENIED], &[UDP_OK]);
    Ok(Lab {
        host,
        w1,
        _w2: w2,
        _servers: servers,
    })
}

async fn status(
    c: &mut v1::dataplane_client::DataplaneClient<tonic::transport::Channel>,
) -> Result<v1::DataplaneStatus> {
    Ok(c.get_status(v1::GetStatusRequest {}).await?.into_inner())
}

/// Endpoints in [`large`].
const BIG_ENDPOINTS: usize = 3000;

/// The chains of [`large`]'s endpoints in the kernel (nftables: the
/// dispatch rules and map entries that name their interfaces; the chains
/// they go to are shared by endpoints with the same policies).
fn big_chains(host: &Netns) -> Result<usize> {
    let text = dphandler_tests::kernel::our_rules(host, false, "filter")?;
    Ok(if nftables() {
        text.matches("\"calib").count()
    } else {
        text.matches(":dph-tw-calib").count() + text.matches(":dph-fw-calib").count()
    })
}

/// Many endpoints and policies at once: an apply of a second or more.
fn large(first_seq: u64) -> Vec<felix::ToDataplane> {
    let mut msgs = Vec::new();
    let mut seq = first_seq;
    let mut push = |p: Payload| {
        msgs.push(felix::ToDataplane {
            sequence_number: seq,
            payload: Some(p),
        });
        seq += 1;
    };
    for p in 0..500 {
        push(Payload::ActivePolicyUpdate(felix::ActivePolicyUpdate {
            id: Some(felix::PolicyId {
                name: format!("default.big-{p}"),
                ..Default::default()
            }),
            policy: Some(felix::Policy {
                tier: "default".into(),
                inbound_rules: (0..10)
                    .map(|k| felix::Rule {
                        action: "allow".into(),
                        protocol: Some(felix::Protocol {
                            number_or_name: Some(felix::protocol::NumberOrName::Name("tcp".into())),
                        }),
                        dst_ports: vec![felix::PortRange {
                            first: 1000 + k,
                            last: 1000 + k,
                        }],
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
        }));
    }
    for w in 0..BIG_ENDPOINTS {
        push(Payload::WorkloadEndpointUpdate(
            felix::WorkloadEndpointUpdate {
                id: Some(felix::WorkloadEndpointId {
                    orchestrator_id: "k8s".into(),
                    workload_id: format!("big/pod-{w}"),
                    endpoint_id: "eth0".into(),
                }),
                endpoint: Some(felix::WorkloadEndpoint {
                    state: "active".into(),
                    name: format!("calib{w:010x}"),
                    ipv4_nets: vec![format!("10.66.{}.{}/32", w / 250, w % 250)],
                    tiers: vec![felix::TierInfo {
                        name: "default".into(),
                        ingress_policies: vec![felix::PolicyId {
                            name: format!("default.big-{}", w % 500),
                            ..Default::default()
                        }],
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
            },
        ));
    }
    msgs
}

/// SIGKILL in the middle of a large apply, then a new daemon fed again:
/// the kernel keeps what it had meanwhile (no flush at exit or start), so
/// the established flow loses nothing and the denied port stays shut.
#[tokio::test]
async fn sigkill_mid_apply_and_restart_lose_nothing() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let l = lab("fkill")?;
    let args = ["--ipv6", "false"];
    let d = Daemon::start(&l.host, &socket, &args)?;
    let mut c = d.connect().await?;
    push(&mut c, yaml_msgs(1, &snapshot())).await?;
    let traffic = Traffic::start(&l.w1, TARGET)?;
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The large update, on a stream of its own.
    // With nftables, its first commit is what is looked for: listing the
    // tables while 30 of them grow to 3,000 rules each takes seconds a
    // look (the kernel's family-wide rule dump starts again for each
    // message), and the update would be all in before one ended.
    let commits = || -> Result<f64> {
        Ok(lab::scrape(&l.host, 9191)?
            .get("dphandler_nftables_commits_total{ip_version=\"4\"}")
            .copied()
            .unwrap_or(0.0))
    };
    let before = if nftables() { commits()? } else { 0.0 };
    let mut feed = Feed::open(&mut c).await?;
    let big = large(1);
    let last = big.len() as u64;
    for m in big {
        feed.send(m.payload.expect("a payload"))?;
    }
    // Killed as soon as the first of its chains is in the kernel.
    let t = Instant::now();
    let arrived = || -> Result<bool> {
        Ok(if nftables() {
            commits()? > before
        } else {
            big_chains(&l.host)? > 0
        })
    };
    while !arrived()? {
        if t.elapsed() > Duration::from_secs(30) {
            bail!("the large update never reached the kernel");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(d.pid())?),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let killed_after = t.elapsed();
    let at_kill = big_chains(&l.host)?;
    drop(feed);
    drop(c);
    drop(d); // reaps it
    let down_for = Duration::from_millis(500);
    tokio::time::sleep(down_for).await;

    // A new daemon; the calc graph sends its snapshot again (without the
    // large update: it was never acknowledged as programmed).
    let started = Instant::now();
    let d = Daemon::start(&l.host, &socket, &args)?;
    let mut c = d.connect().await?;
    push(&mut c, yaml_msgs(1, &snapshot())).await?;
    let repaired = started.elapsed();
    let st = status(&mut c).await?;
    assert!(st.in_sync, "{st:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seen = traffic.stop();

    // What the killed apply left is gone after the snapshot.
    let left = big_chains(&l.host)?;
    assert_eq!(left, 0, "chains of the killed apply left in the kernel");
    eprintln!(
        "faults: SIGKILL mid-apply ({last} messages sent; killed {killed_after:?} after, with {at_kill} of its {} endpoint chains in the kernel), down {down_for:?}, restart to in sync {repaired:?}; {}",
        2 * BIG_ENDPOINTS,
        seen.summary()
    );
    assert_eq!(seen.udp_lost, 0, "{seen:?}");
    assert!(seen.denied_through.is_empty(), "{seen:?}");
    assert!(seen.udp_sent > 100);
    Ok(())
}

/// What [`open_under`] saw: the denied port opened by a change sent
/// while an obstacle stood in the daemon's way.
#[derive(Debug)]
struct Opened {
    /// Failed applies the status counted meanwhile, and the first error.
    failed: u64,
    error: String,
    /// From sending the change until it was reported programmed.
    took: Duration,
    /// When the change was sent, since the traffic began.
    sent_after: Duration,
    /// Connections to the denied port before the change was programmed.
    early: usize,
    seen: dphandler_tests::traffic::Seen,
}

/// A daemon on a new lab (`args`, `env`) with traffic flowing; `arm`
/// puts the obstacle up, then a change opens the denied port: how long
/// until it is programmed, what the status said meanwhile, and whether a
/// connection got through before it was programmed (a hole).
async fn open_under(
    tag: &str,
    args: &[&str],
    env: &[(&str, &str)],
    arm: impl FnOnce() -> Result<()>,
) -> Result<Opened> {
    let dir = tempdir()?;
    let l = lab(tag)?;
    let socket = dir.path().join("dp.sock");
    let d = Daemon::start_env(&l.host, &socket, args, env)?;
    let mut c = d.connect().await?;
    push(&mut c, yaml_msgs(1, &snapshot())).await?;
    let traffic = Traffic::start(&l.w1, TARGET)?;
    let since = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = status(&mut c).await?;

    arm()?;
    let open = profile(&format!(
        "      - {{action: allow, protocol: {{name: tcp}}, dstPorts: [{{first: {TCP_DENIED}, last: {TCP_DENIED}}}]}}\n"
    ));
    let mut feed = Feed::open(&mut c).await?;
    let sent_at = Instant::now();
    let mut msgs = yaml_msgs(1, &open);
    let seq = feed.send(msgs.remove(0).payload.context("a payload")?)?;
    // Until it lands: not programmed, the error shown.
    let mut error = String::new();
    let programmed_at = loop {
        tokio::select! {
            r = feed.next_programmed(Duration::from_secs(60)) => {
                let (s, at) = r?;
                if s >= seq { break at; }
            }
            // (Within the per-peer call rate.)
            () = tokio::time::sleep(Duration::from_millis(200)) => {
                let st = status(&mut c).await?;
                if st.failed_applies > before.failed_applies && error.is_empty() {
                    error = st.last_error.clone();
                }
            }
        }
    };
    let st = status(&mut c).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seen = traffic.stop();
    let programmed_after = programmed_at.duration_since(since);
    let early = seen
        .denied_through
        .iter()
        .filter(|t| **t + Duration::from_millis(50) < programmed_after)
        .count();
    assert!(!seen.denied_through.is_empty(), "opened once programmed");
    Ok(Opened {
        failed: st.failed_applies - before.failed_applies,
        error,
        took: programmed_at - sent_at,
        sent_after: sent_at.duration_since(since),
        early,
        seen,
    })
}

/// `iptables-nft-restore` fails three times (a wrapper first on the
/// daemon's PATH): the change is not reported programmed and not in the
/// kernel until a retry lands it; the error is in the status meanwhile.
#[tokio::test]
async fn a_failing_tool_is_retried_and_nothing_is_reported_early() -> Result<()> {
    if !privileged() || nftables() {
        return Ok(()); // nftables: no tool, netlink
    }
    let dir = tempdir()?;
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin)?;
    let fail = dir.path().join("fail");
    let real = [
        "/usr/sbin/iptables-nft-restore",
        "/sbin/iptables-nft-restore",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .context("iptables-nft-restore")?;
    let wrapper = bin.join("iptables-nft-restore");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nf={}\nif [ -s \"$f\" ]; then n=$(cat \"$f\"); if [ \"$n\" -gt 0 ]; then echo $((n-1)) > \"$f\"; echo 'dph-test: injected failure' >&2; exit 1; fi; fi\nexec {real} \"$@\"\n",
            fail.display()
        ),
    )?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
    let path = format!("{}:{}", bin.display(), std::env::var("PATH")?);

    // Three failures armed, then the denied port opened.
    let o = open_under(
        "ftool",
        &["--ipv6", "false", "--iptables-backend", "nft"],
        &[("PATH", path.as_str())],
        || Ok(std::fs::write(&fail, "3")?),
    )
    .await?;
    eprintln!(
        "faults: iptables-nft-restore failing 3 times: {} failed applies reported ({:?}), the change programmed {:?} after it was sent; UDP flow {} sent, {} lost; denied port opened by the change at {:?}: {} connections before it was programmed",
        o.failed, o.error, o.took, o.seen.udp_sent, o.seen.udp_lost, o.sent_after, o.early
    );
    assert!(o.failed >= 3, "{o:?}");
    assert!(o.error.contains("injected failure"), "{o:?}");
    assert_eq!(o.early, 0, "{o:?}");
    assert_eq!(o.seen.udp_lost, 0, "{o:?}");
    assert_eq!(std::fs::read_to_string(&fail)?.trim(), "0");
    Ok(())
}

/// The xtables lock held by another process for 10 s (iptables-legacy;
/// the lock file is the test's own through `XTABLES_LOCKFILE`, never the
/// host's): the restore waits its 5 s and fails, the error says so, the
/// change is retried and programmed once the lock is free; the flow goes
/// on meanwhile (the lock holds writers back, not packets).
#[tokio::test]
async fn the_xtables_lock_held_for_10_s_delays_the_change_and_loses_nothing() -> Result<()> {
    if !privileged() || nftables() {
        return Ok(()); // nftables: no lock, netlink transactions
    }
    let dir = tempdir()?;
    let lock = dir.path().join("xtables.lock");
    let lock_s = lock.display().to_string();
    let holder = std::cell::RefCell::new(None);
    let o = open_under(
        "flock",
        &["--ipv6", "false", "--iptables-backend", "legacy"],
        &[("XTABLES_LOCKFILE", lock_s.as_str())],
        || {
            let child = std::process::Command::new("flock")
                .args([lock_s.as_str(), "sleep", "10"])
                .spawn()?;
            // Held once a non-blocking try fails.
            let t = Instant::now();
            while std::process::Command::new("flock")
                .args(["-n", lock_s.as_str(), "true"])
                .status()?
                .success()
            {
                if t.elapsed() > Duration::from_secs(5) {
                    bail!("the lock was never held");
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            *holder.borrow_mut() = Some(child);
            Ok(())
        },
    )
    .await?;
    let mut child = holder.into_inner().context("held")?;
    let _ = child.wait();
    eprintln!(
        "faults: the xtables lock held by another process for 10 s (iptables-legacy): {} failed applies reported ({:?}), the change (sent just after the lock was taken) programmed {:?} after it was sent; UDP flow {} sent, {} lost; denied port opened by the change: {} connections before it was programmed",
        o.failed, o.error, o.took, o.seen.udp_sent, o.seen.udp_lost, o.early
    );
    assert!(o.failed >= 1, "{o:?}");
    assert!(o.error.contains("xtables lock"), "{o:?}");
    assert!(
        o.took >= Duration::from_secs(8),
        "not before the lock was free: {o:?}"
    );
    assert_eq!(o.early, 0, "{o:?}");
    assert_eq!(o.seen.udp_lost, 0, "{o:?}");
    Ok(())
}

/// A feeder that goes away halfway through its snapshot: nothing is
/// programmed or reported in sync for it; the next feeder's full snapshot
/// is, and sweeps what the first sent that the second did not.
#[tokio::test]
async fn a_feeder_dropped_mid_snapshot_programs_nothing_until_the_next_one() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let l = lab("ffeed")?;
    let d = Daemon::start(&l.host, &socket, &["--ipv6", "false"])?;
    let mut c = d.connect().await?;
    let mut watch = c
        .status_updates(v1::StatusUpdatesRequest {})
        .await?
        .into_inner();

    // Half a snapshot (and an IP set the next one lacks), then gone.
    {
        let mut feed = Feed::open(&mut c).await?;
        feed.send(Payload::IpsetUpdate(felix::IpSetUpdate {
            id: "s:half".into(),
            members: vec!["10.9.9.9".into()],
            r#type: felix::ip_set_update::IpSetType::Ip as i32,
        }))?;
        for m in yaml_msgs(2, &format!("{}---\n{}", profile(""), wep("cali1", W1))) {
            feed.send(m.payload.context("a payload")?)?;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = status(&mut c).await?;
    assert!(!st.in_sync && !st.datastore_in_sync, "{st:?}");
    assert_eq!(st.applies, 0, "nothing applied before an InSync: {st:?}");
    assert!(
        !dphandler_tests::kernel::our_rules(&l.host, false, "filter")?.contains("cali1"),
        "nothing programmed"
    );
    // Nothing but heartbeats on the watch stream.
    while let Ok(Ok(Some(u))) =
        tokio::time::timeout(Duration::from_millis(100), watch.message()).await
    {
        if let Some(v1::status_update::Kind::Update(f)) = &u.kind
            && matches!(
                f.payload,
                Some(felix::from_dataplane::Payload::DataplaneInSync(_))
            )
        {
            bail!("DataplaneInSync before any InSync");
        }
    }

    // The next feeder sends everything.
    let t = Instant::now();
    push(&mut c, yaml_msgs(1, &snapshot())).await?;
    let took = t.elapsed();
    let st = status(&mut c).await?;
    assert!(st.in_sync, "{st:?}");
    assert_eq!(
        st.objects.get("ipset"),
        None,
        "the half's set was swept: {:?}",
        st.objects
    );
    let traffic = Traffic::start(&l.w1, TARGET)?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seen = traffic.stop();
    eprintln!(
        "faults: feeder dropped mid-snapshot: nothing applied or reported in sync meanwhile; the next feeder's snapshot programmed in {took:?}; then UDP {} sent, {} lost, denied {} through",
        seen.udp_sent,
        seen.udp_lost,
        seen.denied_through.len()
    );
    assert_eq!(seen.udp_lost, 0);
    assert!(seen.denied_through.is_empty());
    Ok(())
}

/// Our endpoint chain flushed by hand while traffic flows: the refresh
/// puts it right; how long that took and what got through meanwhile is
/// measured. A flushed chain returns without its accept mark, and the
/// forward chain drops what a workload's chains did not accept (it once
/// accepted it on the other direction's mark: every denied connection got
/// through until the repair).
#[tokio::test]
async fn a_flushed_chain_is_repaired_and_nothing_denied_gets_in() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let l = lab("fflush")?;
    let d = Daemon::start(
        &l.host,
        &socket,
        &["--ipv6", "false", "--iptables-refresh-seconds", "1"],
    )?;
    let mut c = d.connect().await?;
    push(&mut c, yaml_msgs(1, &snapshot())).await?;
    let traffic = Traffic::start(&l.w1, TARGET)?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let chain = dphandler_tests::kernel::endpoint_chain(&l.host, false, "tw", "cali2")?;
    let chain = chain.as_str();
    let listed = || -> Result<String> {
        Ok(without_counters(&our_chain(
            &l.host, false, "filter", chain,
        )?))
    };
    let before = listed()?;
    assert!(
        before.contains(spelled(&format!("-A {chain}"), "dph:")),
        "{before}"
    );
    let sent_before = traffic.sent();
    let t = Instant::now();
    flush_our_chain(&l.host, false, "filter", chain)?;
    let repaired = loop {
        if listed()? == before {
            break t.elapsed();
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!("not repaired in 30 s:\n{}\nwas\n{before}", listed()?);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let during = traffic.sent() - sent_before;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seen = traffic.stop();
    eprintln!(
        "faults: our endpoint chain flushed by hand ({}): repaired after {repaired:?} (--iptables-refresh-seconds 1); {during} datagrams sent while flushed; {}",
        spelled("iptables -F", "nft flush chain"),
        seen.summary()
    );
    assert!(seen.denied_through.is_empty(), "{seen:?}");
    Ok(())
}

/// The route to a workload deleted by hand while traffic flows: the flow
/// is cut until the daemon, told by the kernel's route-deleted event (not
/// the 90 s refresh tick), puts it back; how long that takes and how many
/// datagrams were lost meanwhile is measured (nothing denied gets through:
/// policy is untouched).
#[tokio::test]
async fn a_deleted_route_is_repaired() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let l = lab("froute")?;
    let d = Daemon::start(&l.host, &socket, &["--ipv6", "false"])?;
    let mut c = d.connect().await?;
    push(&mut c, yaml_msgs(1, &snapshot())).await?;
    let traffic = Traffic::start(&l.w1, TARGET)?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let route = |host: &Netns| -> Result<String> {
        let out = host.run("ip", &["-4", "route", "show", &format!("{W2}/32")])?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let before = route(&l.host)?;
    assert!(before.contains("cali2"), "{before:?}");
    let t = Instant::now();
    l.host.run("ip", &["route", "del", &format!("{W2}/32")])?;
    let repaired = loop {
        if route(&l.host)? == before {
            break t.elapsed();
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!("not repaired in 30 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seen = traffic.stop();
    eprintln!(
        "faults: the route to a workload deleted by hand: repaired after {repaired:?} (at the kernel's route-deleted event); {}",
        seen.summary()
    );
    assert!(repaired < Duration::from_secs(1), "{repaired:?}");
    assert!(seen.denied_through.is_empty(), "{seen:?}");
    Ok(())
}

/// An IP set of ours emptied by hand while traffic flows: what it allowed
/// is refused (fail closed) until the IP-set refresh fills it again; the
/// established flow goes on.
#[tokio::test]
async fn an_emptied_ip_set_is_refilled() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let l = lab("fset")?;
    let d = Daemon::start(
        &l.host,
        &socket,
        &[
            "--ipv6",
            "false",
            "--ipset-refresh-seconds",
            "1",
            // (nftables: the sets are refreshed with their tables.)
            "--iptables-refresh-seconds",
            "1",
        ],
    )?;
    let mut c = d.connect().await?;
    // TCP 80 only from the set holding w1.
    let yaml = snapshot().replace(
        "      - {action: allow, protocol: {name: tcp}, dstPorts: [{first: 80, last: 80}]}\n",
        "      - {action: allow, protocol: {name: tcp}, dstPorts: [{first: 80, last: 80}], srcIpSetIds: [s:clients]}\n",
    );
    let set = format!("ipsetUpdate: {{id: s:clients, type: IP, members: [{W1}]}}\n---\n{yaml}");
    push(&mut c, yaml_msgs(1, &set)).await?;
    let to80 = SocketAddr::from(([10, 65, 0, 3], 80));
    assert!(
        lab::tcp_ok(&l.w1, to80, Duration::from_millis(500)),
        "allowed by the set"
    );
    let traffic = Traffic::start(&l.w1, TARGET)?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    flush_our_set(&l.host, false, "dph40s:clients")?;
    let refused_meanwhile = !lab::tcp_ok(&l.w1, to80, Duration::from_millis(300));
    let repaired = loop {
        // Every copy (nftables: one in each table whose rules look it up).
        let copies = our_set_copies(&l.host, false, "dph40s:clients")?;
        if !copies.is_empty() && copies.iter().all(|c| c.contains(W1)) {
            break t.elapsed();
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!("not refilled in 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        lab::tcp_ok(&l.w1, to80, Duration::from_millis(500)),
        "allowed again"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seen = traffic.stop();
    eprintln!(
        "faults: our IP set emptied by hand ({}): refilled after {repaired:?} (--ipset-refresh-seconds 1); what it allowed was refused meanwhile: {refused_meanwhile}; {}",
        spelled("ipset flush", "nft flush set"),
        seen.summary()
    );
    assert_eq!(seen.udp_lost, 0, "{seen:?}");
    assert!(seen.denied_through.is_empty(), "{seen:?}");
    Ok(())
}

/// Two feeders at once: their messages go onto one shared state in the
/// order they arrive; what both sent is programmed, and the second's
/// `InSync` removes what the first created before the second began and
/// did not send again (see docs/api.md, "Sessions and several feeders").
#[tokio::test]
async fn two_feeders_at_once_share_one_state() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let l = lab("ftwo")?;
    let d = Daemon::start(&l.host, &socket, &["--ipv6", "false"])?;
    let mut c = d.connect().await?;
    // Feeder A: the snapshot, and a set only it sends.
    let set = |id: &str, ip: &str| {
        Payload::IpsetUpdate(felix::IpSetUpdate {
            id: id.into(),
            members: vec![ip.into()],
            r#type: felix::ip_set_update::IpSetType::Ip as i32,
        })
    };
    let mut a = Feed::open(&mut c).await?;
    a.send(set("s:only-a", "10.1.0.1"))?;
    for m in yaml_msgs(1, &snapshot()) {
        a.send(m.payload.context("a payload")?)?;
    }
    let a_last = a.send(set("s:a-late", "10.1.0.2"))?;
    a.until(a_last, Duration::from_secs(10)).await?;
    let traffic = Traffic::start(&l.w1, TARGET)?;
    // Feeder B, while A's stream stays open: deltas to A's set, its own
    // set, and then its own snapshot's end.
    let mut b = Feed::open(&mut c).await?;
    // (The loop counts a stream once it has taken its opening, just after
    // the stream is answered: a status read at once may not show it yet.)
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut st = status(&mut c).await?;
    while st.feeders != 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        st = status(&mut c).await?;
    }
    assert_eq!(st.feeders, 2, "{st:?}");
    b.send(set("s:only-b", "10.2.0.1"))?;
    b.send(Payload::IpsetDeltaUpdate(felix::IpSetDeltaUpdate {
        id: "s:a-late".into(),
        added_members: vec!["10.2.0.2".into()],
        removed_members: vec![],
    }))?;
    let mut b_in_sync = 0;
    for m in yaml_msgs(1, &snapshot()) {
        b_in_sync = b.send(m.payload.context("a payload")?)?;
    }
    // Two streams' messages interleave in the order the server reads
    // them, not the order they were sent: B's snapshot is waited for
    // before A writes again (last writer wins per object).
    b.until(b_in_sync, Duration::from_secs(10)).await?;
    let a2 = a.send(set("s:a-late", "10.1.0.3"))?;
    a.until(a2, Duration::from_secs(10)).await?;
    let b_last = b.send(Payload::IpsetDeltaUpdate(felix::IpSetDeltaUpdate {
        id: "s:only-b".into(),
        added_members: vec!["10.2.0.3".into()],
        removed_members: vec![],
    }))?;
    b.until(b_last, Duration::from_secs(10)).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let st = status(&mut c).await?;
    let seen = traffic.stop();
    // s:only-a and s:a-late were last written by A before B began, and
    // B's InSync swept them (B's delta to s:a-late is no write of the
    // whole set); A's write after it made s:a-late again, as A wrote it.
    assert_eq!(st.objects.get("ipset"), Some(&2), "{:?}", st.objects);
    if !nftables() {
        let sets = dphandler_tests::ipsets(&l.host)?;
        assert!(!sets.contains_key("dph40s:only-a"), "{:?}", sets.keys());
        let late: Vec<&String> = sets["dph40s:a-late"].members.iter().collect();
        assert_eq!(late, ["10.1.0.3"], "A wrote last");
        assert_eq!(sets["dph40s:only-b"].members.len(), 2);
    }
    eprintln!(
        "faults: two feeders at once: both programmed onto one state (last writer wins, the second's InSync swept the first's older set); {}",
        seen.summary()
    );
    assert_eq!(seen.udp_lost, 0, "{seen:?}");
    assert!(seen.denied_through.is_empty(), "{seen:?}");
    Ok(())
}
