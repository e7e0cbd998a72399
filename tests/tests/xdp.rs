//! XDP through the real daemon: a "host" namespace whose `eth0` (a veth)
//! faces a "client" namespace (10.89.0.2 and .3); a host endpoint on
//! `eth0` with an untracked policy that denies sources in an IP set. The
//! daemon pins under a bpffs the test mounts on a temporary directory of
//! its own (`ip netns exec` mounts a fresh `/sys`, so `/sys/fs/bpf` would
//! not outlive one daemon). Needs root.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Result;
use dphandler_bpf::Filter;
use dphandler_tests::kernel;
use dphandler_tests::lab::{Bpffs, in_ns, scrape, yaml_msgs};
use dphandler_tests::{Daemon, Netns, privileged, push, tempdir};

fn lab() -> Result<(Netns, Netns)> {
    let host = Netns::new("xh")?;
    let client = Netns::new("xc")?;
    host.run(
        "ip",
        &[
            "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &client.0,
        ],
    )?;
    for (ns, addrs) in [
        (&host, &["10.89.0.1/24"][..]),
        (&client, &["10.89.0.2/24", "10.89.0.3/24"][..]),
    ] {
        ns.run("ip", &["link", "set", "lo", "up"])?;
        for a in addrs {
            ns.run("ip", &["addr", "add", a, "dev", "eth0"])?;
        }
        ns.run("ip", &["link", "set", "eth0", "up"])?;
    }
    Ok((host, client))
}

fn ping(from: &Netns, src: &str) -> bool {
    from.command("ping")
        .args(["-c", "1", "-W", "0.5", "-I", src, "10.89.0.1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The listed source (10.89.0.2) pings the host 100 times a second for
/// `secs` (a deadline: with no reply, a count would have ping linger 10 s
/// more); its summary on stdout.
fn flood(client: &Netns, secs: u32) -> Result<std::process::Child> {
    Ok(client
        .command("ping")
        .args(["-q", "-i", "0.01", "-w", &secs.to_string()])
        .args(["-I", "10.89.0.2", "10.89.0.1"])
        .stdout(Stdio::piped())
        .spawn()?)
}

fn stdout(ns: &Netns, prog: &str, args: &[&str]) -> Result<String> {
    Ok(String::from_utf8_lossy(&ns.run(prog, args)?.stdout).into_owned())
}

/// The set, the untracked deny of it, a profile that lets everything else
/// in, and the host endpoint on `eth0` with both.
const SNAPSHOT: &str = "ipsetUpdate: {id: 's:bad', type: NET, members: ['10.89.0.2/32']}\n---\n\
activeProfileUpdate:\n  id: {name: allow}\n  profile:\n    inboundRules: [{action: allow}]\n    outboundRules: [{action: allow}]\n---\n\
activePolicyUpdate:\n  id: {name: default.xdp}\n  policy:\n    tier: default\n    untracked: true\n    inboundRules: [{action: deny, srcIpSetIds: ['s:bad']}]\n---\n\
hostEndpointUpdate:\n  id: {endpointId: up}\n  endpoint:\n    name: eth0\n    profileIds: [allow]\n    untrackedTiers:\n      - name: default\n        ingressPolicies: [{name: default.xdp}]\n        defaultAction: pass\n---\n\
inSync: {}\n";

/// A daemon on `host` pinning under `bpffs`, fed `snapshot`.
async fn daemon(
    host: &Netns,
    sock: &std::path::Path,
    bpffs: &Bpffs,
    snapshot: &str,
) -> Result<Daemon> {
    let b = bpffs.path().display().to_string();
    let d = Daemon::start(host, sock, &["--hostname", "n1", "--bpffs", b.as_str()])?;
    let (rej, _) = push(&mut d.connect().await?, yaml_msgs(1, snapshot)).await?;
    assert!(rej.is_empty(), "{rej:?}");
    Ok(d)
}

async fn details(d: &Daemon) -> Result<std::collections::HashMap<String, String>> {
    Ok(d.connect()
        .await?
        .get_status(dphandler_proto::v1::GetStatusRequest {})
        .await?
        .into_inner()
        .details)
}

/// Packets counted by our raw-table rules that drop the set's members.
fn raw_drops(host: &Netns) -> Result<u64> {
    if kernel::nftables() {
        // `ip saddr @dph40s:bad counter packets N bytes M drop`.
        return Ok(kernel::our_rules(host, false, "raw")?
            .lines()
            .filter(|l| l.contains("@dph40") && l.contains(" drop"))
            .filter_map(|l| {
                l.split("counter packets ")
                    .nth(1)?
                    .split(' ')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum());
    }
    let out = stdout(host, "iptables-save", &["-c", "-t", "raw"])?;
    Ok(out
        .lines()
        .filter(|l| l.contains("s:bad") || l.contains("dph40"))
        .filter(|l| l.contains("DROP"))
        .filter_map(|l| l.strip_prefix('[')?.split(':').next()?.parse::<u64>().ok())
        .sum())
}

#[tokio::test]
async fn untracked_deny_of_a_set_is_dropped_by_xdp_before_the_stack() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let fs = Bpffs::new()?;
    let dir = tempdir()?;
    let (host, client) = lab()?;
    let d = daemon(&host, &dir.path().join("d.sock"), &fs, SNAPSHOT).await?;

    let link = stdout(&host, "ip", &["-d", "link", "show", "eth0"])?;
    assert!(link.contains("prog/xdp"), "{link}");
    assert!(!ping(&client, "10.89.0.2"), "a member is dropped");
    assert!(ping(&client, "10.89.0.3"), "a non-member passes");
    // Dropped by XDP, before the raw table sees it (status reads the
    // counters every 5 s).
    let mut x = String::new();
    for _ in 0..80 {
        x = details(&d).await?["xdp.eth0"].clone();
        if !x.contains("dropped 0 pkts") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(x.starts_with("driver, 1 prefixes"), "{x}");
    assert!(!x.contains("dropped 0 pkts"), "{x}");
    assert_eq!(raw_drops(&host)?, 0, "the raw table saw the packet");
    // The same counters in the metrics.
    let m = scrape(&host, 9191)?;
    assert_eq!(m.get("dphandler_xdp_interfaces"), Some(&1.0), "{m:#?}");
    for (name, verdict) in [
        ("xdp_packets_total", "dropped"),
        ("xdp_bytes_total", "dropped"),
        ("xdp_packets_total", "passed"),
    ] {
        let v = m.get(&format!(
            "dphandler_{name}{{iface=\"eth0\",verdict=\"{verdict}\"}}"
        ));
        assert!(
            v.is_some_and(|v| *v >= 1.0),
            "{name} {verdict}: {v:?} in {m:#?}"
        );
    }
    // A failsafe port still reaches the host from the member.
    let listener = in_ns(&host.0, || TcpListener::bind("10.89.0.1:22"))?;
    let ok = in_ns(&client.0, || {
        let to: SocketAddr = "10.89.0.1:22".parse().unwrap();
        TcpStream::connect_timeout(&to, Duration::from_secs(2)).is_ok()
    });
    drop(listener);
    assert!(ok, "failsafe port from a listed source");

    // A restart: a flood from the member across it is dropped throughout.
    let flood = flood(&client, 2)?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.stop()?;
    let d = daemon(&host, &dir.path().join("d2.sock"), &fs, SNAPSHOT).await?;
    let summary = String::from_utf8_lossy(&flood.wait_with_output()?.stdout).into_owned();
    assert!(summary.contains("100% packet loss"), "{summary}");
    assert!(details(&d).await?["xdp.eth0"].starts_with("adopted"));

    // The member leaves the set: through within one apply.
    let (rej, _) = push(
        &mut d.connect().await?,
        yaml_msgs(
            100,
            "ipsetDeltaUpdate: {id: 's:bad', removedMembers: ['10.89.0.2/32']}\n",
        ),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    assert!(ping(&client, "10.89.0.2"), "no longer listed");

    // The policy goes: XDP is detached, its pins removed.
    let (rej, _) = push(
        &mut d.connect().await?,
        yaml_msgs(
            200,
            "hostEndpointUpdate:\n  id: {endpointId: up}\n  endpoint:\n    name: eth0\n    profileIds: [allow]\n",
        ),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    let link = stdout(&host, "ip", &["-d", "link", "show", "eth0"])?;
    assert!(!link.contains("prog/xdp"), "{link}");
    assert!(!fs.path().join("dphandler/xdp/eth0").exists());
    Ok(())
}

/// An interface where our program cannot attach (another agent's XDP is
/// there): the reason is in status and the raw table drops the same
/// packets.
#[tokio::test]
async fn where_xdp_cannot_attach_the_raw_table_drops() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let fs = Bpffs::new()?;
    let other = Bpffs::new()?;
    let dir = tempdir()?;
    let (host, client) = lab()?;
    // Someone else's XDP program (ours, pinned elsewhere) holds eth0.
    let o = other.path();
    let theirs = in_ns(&host.0, move || {
        dphandler_bpf::Filter::attach(&o, "eth0", &[dphandler_bpf::Mode::Driver])
    })?;
    let d = daemon(&host, &dir.path().join("d.sock"), &fs, SNAPSHOT).await?;
    let x = details(&d).await?["xdp.eth0"].clone();
    assert!(
        x.starts_with("not programmed (the raw table drops instead)"),
        "{x}"
    );
    let before = raw_drops(&host)?;
    assert!(!ping(&client, "10.89.0.2"), "dropped by the raw table");
    assert!(raw_drops(&host)? > before, "the raw table counted it");
    assert!(ping(&client, "10.89.0.3"));
    theirs.detach()?;
    Ok(())
}

/// An all-interfaces (`*`) host endpoint, Calico's automatic one: XDP on
/// every host interface but `lo`.
#[tokio::test]
async fn an_all_interfaces_host_endpoint_gets_xdp_on_every_interface_but_lo() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let fs = Bpffs::new()?;
    let dir = tempdir()?;
    let (host, client) = lab()?;
    let all = SNAPSHOT.replace("    name: eth0\n", "    name: \"*\"\n");
    let d = daemon(&host, &dir.path().join("d.sock"), &fs, &all).await?;
    let eth0 = stdout(&host, "ip", &["-d", "link", "show", "eth0"])?;
    assert!(eth0.contains("prog/xdp"), "{eth0}");
    let lo = stdout(&host, "ip", &["-d", "link", "show", "lo"])?;
    assert!(!lo.contains("prog/xdp"), "{lo}");
    assert!(!ping(&client, "10.89.0.2"));
    assert!(ping(&client, "10.89.0.3"));
    d.stop()?;
    // The pins outlive the daemon; a test leaves nothing behind.
    Filter::remove(&fs.path(), "eth0")?;
    Ok(())
}

/// Our XDP link detached by hand (`bpftool link detach`, as an operator
/// or another agent could) while the listed source floods and an allowed
/// UDP flow runs: the raw table drops the listed source meanwhile (never
/// let through), and the XDP refresh attaches anew; how long that took is
/// measured (`faults:`).
#[tokio::test]
async fn a_detached_xdp_program_is_attached_again_and_the_raw_table_drops_meanwhile() -> Result<()>
{
    if !privileged() {
        return Ok(());
    }
    use dphandler_tests::traffic::{Target, Traffic};
    let fs = Bpffs::new()?;
    let dir = tempdir()?;
    let (host, client) = lab()?;
    let b = fs.path().display().to_string();
    let d = Daemon::start(
        &host,
        &dir.path().join("d.sock"),
        &[
            "--hostname",
            "n1",
            "--bpffs",
            b.as_str(),
            "--xdp-refresh-seconds",
            "1",
        ],
    )?;
    let (rej, _) = push(&mut d.connect().await?, yaml_msgs(1, SNAPSHOT)).await?;
    assert!(rej.is_empty(), "{rej:?}");
    let _servers = dphandler_tests::lab::serve(&host.0, &[], &[53]);
    let traffic = Traffic::start(
        &client,
        Target {
            src: Some("10.89.0.3".parse()?),
            ip: "10.89.0.1".parse()?,
            udp: 53,
            denied_tcp: None,
        },
    )?;
    // The listed source, 100 pings a second for 3 s.
    let flood = flood(&client, 3)?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let attached = || -> Result<bool> {
        Ok(stdout(&host, "ip", &["-d", "link", "show", "eth0"])?.contains("prog/xdp"))
    };
    assert!(attached()?);
    let raw_before = raw_drops(&host)?;
    let link = fs.path().join("dphandler/xdp/eth0/link");
    let t = std::time::Instant::now();
    host.run(
        "bpftool",
        &["link", "detach", "pinned", &link.display().to_string()],
    )?;
    assert!(!attached()?, "detached");
    let repaired = loop {
        if attached()? {
            break t.elapsed();
        }
        if t.elapsed() > Duration::from_secs(30) {
            anyhow::bail!("not attached again in 30 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let raw_meanwhile = raw_drops(&host)? - raw_before;
    let summary = String::from_utf8_lossy(&flood.wait_with_output()?.stdout).into_owned();
    let seen = traffic.stop();
    let x = details(&d).await?["xdp.eth0"].clone();
    eprintln!(
        "faults: our XDP link detached by hand (bpftool): attached again after {repaired:?} (--xdp-refresh-seconds 1), the raw table dropped {raw_meanwhile} of the listed source's packets meanwhile; the listed source's flood: {}; allowed {}; status: {x}",
        summary
            .lines()
            .find(|l| l.contains("packet loss"))
            .unwrap_or(&summary),
        seen.summary()
    );
    assert!(summary.contains("100% packet loss"), "{summary}");
    assert!(raw_meanwhile > 0, "the raw table carried on");
    assert_eq!(seen.udp_lost, 0, "{seen:?}");
    assert!(repaired < Duration::from_secs(5), "{repaired:?}");
    assert!(x.starts_with("driver"), "{x}");
    Ok(())
}
