//! `--dataplane nftables` against the real daemon, beside other agents:
//! a workload's policy enforced with real TCP; another agent's nftables
//! table and iptables-nft rules in the same namespace untouched; a switch
//! from the iptables dataplane that leaves none of its chains or sets
//! (and the switch back, none of our tables); a restart that adopts what
//! is there without writing, while a flow keeps being checked; tampering
//! put back on the refresh tick; `dphctl status` per table. Needs root.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use dphandler_tests::lab::{self, scrape, tcp_ok, yaml_msgs};
use dphandler_tests::{Daemon, Netns, privileged, push, tempdir};

fn tcp(from: &Netns, to: &str, port: u16) -> bool {
    let addr: SocketAddr = format!("{to}:{port}").parse().unwrap();
    tcp_ok(from, addr, Duration::from_millis(700))
}

/// Two workloads; w2 takes tcp/80 from the set holding w1, nothing else.
fn snapshot() -> String {
    let wep = |iface: &str, ip: &str, extra: &str| {
        format!(
            "workloadEndpointUpdate:\n  id: {{orchestratorId: k8s, workloadId: ns/{iface}, endpointId: eth0}}\n  endpoint:\n    name: {iface}\n    ipv4Nets: [{ip}/32]\n    profileIds: [kns.ns]\n{extra}---\n"
        )
    };
    let tier = "    tiers:\n      - name: default\n        ingressPolicies: [{name: default.web}]\n        defaultAction: deny\n";
    format!(
        "activeProfileUpdate:\n  id: {{name: kns.ns}}\n  profile:\n    inboundRules: [{{action: allow}}]\n    outboundRules: [{{action: allow}}]\n---\n\
         ipsetUpdate: {{id: 's:clients', type: IP, members: [10.65.0.2]}}\n---\n\
         activePolicyUpdate:\n  id: {{name: default.web}}\n  policy:\n    tier: default\n    inboundRules:\n      - action: allow\n        protocol: {{name: tcp}}\n        srcIpSetIds: ['s:clients']\n        dstPorts: [{{first: 80}}]\n---\n\
         {}{}inSync: {{}}\n",
        wep("cali1", "10.65.0.2", ""),
        wep("cali2", "10.65.0.3", tier)
    )
}

/// What another agent keeps in the namespace, as listed.
fn foreign(host: &Netns) -> Result<(String, String)> {
    let kp = host.run("nft", &["list", "table", "ip", "kube-proxy"])?;
    let ipt = host.run("iptables-nft", &["-S", "FORWARD"])?;
    // Our own hook (the iptables dataplane's) aside.
    Ok((
        String::from_utf8_lossy(&kp.stdout).into_owned(),
        String::from_utf8_lossy(&ipt.stdout)
            .lines()
            .filter(|l| !l.contains("dph"))
            .collect::<Vec<_>>()
            .join("\n"),
    ))
}

fn ours_in_iptables(host: &Netns) -> Result<(usize, usize)> {
    let save = host.run("iptables-save", &[])?;
    let sets = host.run("ipset", &["list", "-n"])?;
    Ok((
        String::from_utf8_lossy(&save.stdout)
            .lines()
            .filter(|l| l.contains("dph"))
            .count(),
        String::from_utf8_lossy(&sets.stdout)
            .lines()
            .filter(|l| l.starts_with("dph"))
            .count(),
    ))
}

/// The chains of every shard table, as `<table> <chain>`.
fn shard_chains(host: &Netns) -> Result<std::collections::BTreeSet<String>> {
    let mut out = std::collections::BTreeSet::new();
    for t in our_tables(host)? {
        let Some(t) = t.strip_prefix("table ip ") else {
            continue;
        };
        if !t.starts_with("dph-filter-") {
            continue;
        }
        let l = host.run("nft", &["list", "table", "ip", t])?.stdout;
        for line in String::from_utf8_lossy(&l).lines() {
            if let Some(c) = line.trim().strip_prefix("chain ") {
                out.insert(format!("{t} {}", c.trim_end_matches(" {")));
            }
        }
    }
    Ok(out)
}

fn our_tables(host: &Netns) -> Result<Vec<String>> {
    let out = host.run("nft", &["list", "tables"])?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(" dph-"))
        .map(str::to_string)
        .collect())
}

/// Starts a daemon with `dataplane` and feeds it the snapshot.
async fn run(
    host: &Netns,
    dir: &std::path::Path,
    dataplane: &str,
    metrics: &str,
) -> Result<(
    Daemon,
    dphandler_proto::v1::dataplane_client::DataplaneClient<tonic::transport::Channel>,
)> {
    let d = Daemon::start(
        host,
        &dir.join("dp.sock"),
        &[
            "--ipv6",
            "false",
            "--dataplane",
            dataplane,
            "--iptables-refresh-seconds",
            "1",
            "--metrics-addr",
            metrics,
        ],
    )?;
    let mut c = d.connect().await.context("daemon")?;
    let (rej, _) = push(&mut c, yaml_msgs(1, &snapshot())).await?;
    ensure!(rej.is_empty(), "{rej:?}");
    Ok((d, c))
}

#[tokio::test]
async fn nftables_enforces_adopts_repairs_and_replaces_iptables() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let host = Netns::new("nft")?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    let w1 = lab::workload_v4(&host, "cali1", 1, "10.65.0.2")?;
    let w2 = lab::workload_v4(&host, "cali2", 2, "10.65.0.3")?;
    let _l = lab::serve(&w2.0, &[80, 81], &[]);
    // Another agent: its own nftables table and an iptables-nft rule.
    host.run("nft", &["add", "table", "ip", "kube-proxy"])?;
    host.run(
        "nft",
        &[
            "add",
            "set",
            "ip",
            "kube-proxy",
            "svc",
            "{ type ipv4_addr; }",
        ],
    )?;
    host.run(
        "iptables-nft",
        &["-A", "FORWARD", "-s", "192.0.2.9", "-j", "DROP"],
    )?;
    let before = foreign(&host)?;
    let metrics = "127.0.0.1:19391";

    // 1. The iptables dataplane first: its chains and sets are there.
    let (d, c) = run(&host, dir.path(), "iptables", metrics).await?;
    assert!(tcp(&w1, "10.65.0.3", 80) && !tcp(&w1, "10.65.0.3", 81));
    let (rules, sets) = ours_in_iptables(&host)?;
    assert!(rules > 10 && sets >= 1, "{rules} rules, {sets} sets");
    drop(c);
    d.stop()?;

    // 2. nftables: the same policy, and nothing left of iptables'.
    let (d, mut c) = run(&host, dir.path(), "nftables", metrics).await?;
    assert!(tcp(&w1, "10.65.0.3", 80), "allowed by the policy");
    assert!(!tcp(&w1, "10.65.0.3", 81), "the tier's default drop");
    assert!(!tcp(&w2, "10.65.0.2", 80), "nothing listens (sanity)");
    let deadline = Instant::now() + Duration::from_secs(10);
    while ours_in_iptables(&host)? != (0, 0) {
        ensure!(
            Instant::now() < deadline,
            "the iptables dataplane's leftovers stay: {:?}",
            ours_in_iptables(&host)?
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let tables = our_tables(&host)?;
    assert!(
        tables.iter().any(|t| t.contains("ip dph-filter")),
        "{tables:?}"
    );
    // What nft lists of ours loads again with `nft -f` (set names nft
    // can parse), into a namespace of its own.
    let listed = host
        .run("nft", &["list", "table", "ip", "dph-filter"])?
        .stdout;
    // The workloads' policy is in a shard: a chain per policy list (named
    // by its rules, shared by endpoints with the same policies) with the
    // policies only it uses written in (the allow above is cali2's
    // alone), and a verdict-map dispatch; filter's own dispatch sets the
    // pending mark.
    let shards: Vec<(String, String)> = tables
        .iter()
        .filter_map(|t| t.strip_prefix("table ip "))
        .filter(|t| t.starts_with("dph-filter-"))
        .map(|t| {
            let l = host.run("nft", &["list", "table", "ip", t])?.stdout;
            Ok((t.to_string(), String::from_utf8_lossy(&l).into_owned()))
        })
        .collect::<Result<_>>()?;
    let (shard, shard_listing) = shards
        .iter()
        .find(|(_, l)| l.contains("\"cali2\" : goto dph-tw-list-"))
        .with_context(|| format!("a shard holding cali2's chains: {shards:?}"))?;
    let shard = shard.clone();
    for want in [
        "chain dph-fw-list-",
        "chain dph-tw-list-",
        "oifname vmap @dispatch-out-",
        "iifname vmap @dispatch-in-",
        "hook forward priority filter + 10",
        // Egress is checked once, before the routing decision.
        "hook prerouting priority ",
    ] {
        assert!(shard_listing.contains(want), "{want}: {shard_listing}");
    }
    assert!(
        !shard_listing.contains("hook input"),
        "egress is not walked from input too: {shard_listing}"
    );
    // A shard without workloads has no base chains: the one holding
    // these few alone hooks prerouting and forward, so a packet pays for
    // one shard, not 32 (how many are opened is the placement's unit
    // test, `shards_open_as_workloads_come`).
    let hooked: Vec<&str> = shards
        .iter()
        .filter(|(_, l)| l.contains(" hook "))
        .map(|(t, _)| t.as_str())
        .collect();
    assert_eq!(hooked, [shard.as_str()], "{shards:?}");
    assert!(
        !shard_listing.contains("chain dph-pi-default.web"),
        "cali2's policy is written into its list chain: {shard_listing}"
    );
    let name = shard_listing
        .split("\"cali2\" : goto dph-tw-list-")
        .nth(1)
        .and_then(|r| r.split([',', ' ', '\n']).next())
        .context("cali2's ingress list chain")?;
    let list = shard_listing
        .split(&format!("chain dph-tw-list-{name} {{"))
        .nth(1)
        .with_context(|| format!("{name} in {shard_listing}"))?;
    let list = &list[..list.find("\n\t}").unwrap_or(list.len())];
    assert!(list.contains("tcp dport 80"), "{list}");
    assert!(
        String::from_utf8_lossy(&listed).contains("goto dph-tw-pending-in-shards"),
        "{}",
        String::from_utf8_lossy(&listed)
    );
    // Egress, checked in prerouting, decides for forwarded traffic and
    // for traffic to the host alike: w1 may reach a host service, then
    // an egress policy denies it that port (and only that).
    host.run("ip", &["addr", "add", "10.65.255.1/32", "dev", "lo"])?;
    let _h = lab::serve(&host.0, &[8080], &[]);
    assert!(tcp(&w1, "10.65.255.1", 8080), "workload to host, allowed");
    let w1_with = |tiers: &str| {
        format!(
            "workloadEndpointUpdate:\n  id: {{orchestratorId: k8s, workloadId: ns/cali1, endpointId: eth0}}\n  endpoint:\n    name: cali1\n    ipv4Nets: [10.65.0.2/32]\n    profileIds: [kns.ns]\n{tiers}---\n"
        )
    };
    let egress = format!(
        "activePolicyUpdate:\n  id: {{name: default.out}}\n  policy:\n    tier: default\n    outboundRules:\n      - action: deny\n        protocol: {{name: tcp}}\n        dstPorts: [{{first: 8080}}]\n      - action: allow\n---\n{}",
        w1_with(
            "    tiers:\n      - name: default\n        egressPolicies: [{name: default.out}]\n        defaultAction: deny\n"
        )
    );
    let chains_before = shard_chains(&host)?;
    let (rej, _) = push(&mut c, yaml_msgs(100, &egress)).await?;
    ensure!(rej.is_empty(), "{rej:?}");
    let chains_with = shard_chains(&host)?;
    assert!(
        chains_with
            .difference(&chains_before)
            .any(|c| c.contains(" dph-fw-list-")),
        "w1's new egress list chain is made: {chains_before:?} → {chains_with:?}"
    );
    assert!(
        !tcp(&w1, "10.65.255.1", 8080),
        "egress denies w1 the host's port"
    );
    assert!(tcp(&w1, "10.65.0.3", 80), "and allows the rest, forwarded");
    assert!(!tcp(&w1, "10.65.0.3", 81), "w2's ingress still decides");
    let back = format!(
        "{}activePolicyRemove:\n  id: {{name: default.out}}\n---\n",
        w1_with("")
    );
    let (rej, _) = push(&mut c, yaml_msgs(200, &back)).await?;
    ensure!(rej.is_empty(), "{rej:?}");
    // Planned from the changes: the list chain of the policy gone is
    // removed, the one without it made again (nothing else left behind).
    assert_eq!(shard_chains(&host)?, chains_before);
    assert!(tcp(&w1, "10.65.255.1", 8080), "allowed again");
    let copy = Netns::new("nftcopy")?;
    let file = dir.path().join("dph-filter.nft");
    std::fs::write(&file, &listed)?;
    copy.run("nft", &["-f", &file.to_string_lossy()])?;
    drop(copy);
    let st = c
        .get_status(dphandler_proto::v1::GetStatusRequest {})
        .await?
        .into_inner();
    let filter = st
        .details
        .get("nftables-v4.dph-filter")
        .context("status per table")?;
    assert!(
        filter.contains(" chains, ") && filter.contains(" rules, "),
        "{filter}"
    );
    assert_eq!(
        st.details.get("cleanup.iptables-v4").map(String::as_str),
        Some("done"),
        "{:?}",
        st.details
    );
    drop(c);
    d.stop()?;

    // 3. A restart adopts: nothing is written, and an established flow
    //    and the policy hold throughout.
    let flow = lab::connect(&w1, "10.65.0.3:80".parse()?)?;
    let (d, _c) = run(&host, dir.path(), "nftables", metrics).await?;
    let m = scrape(&host, 19391)?;
    assert_eq!(
        m.get("dphandler_nftables_commits_total{ip_version=\"4\"}"),
        Some(&0.0),
        "a restart wrote to tables that were right"
    );
    assert!(tcp(&w1, "10.65.0.3", 80) && !tcp(&w1, "10.65.0.3", 81));
    let mut f = flow;
    std::io::Write::write_all(&mut f, b"x").context("the established flow broke")?;

    // 4. Tampering is put back on the refresh tick (every second here):
    //    the forward hook's jump flushed by hand opens tcp/81.
    host.run("nft", &["flush", "chain", "ip", "dph-filter", "FORWARD"])?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let chain = host.run("nft", &["list", "chain", "ip", "dph-filter", "FORWARD"])?;
        if String::from_utf8_lossy(&chain.stdout).contains("jump dph-FORWARD") {
            break;
        }
        ensure!(Instant::now() < deadline, "the hook was not put back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!tcp(&w1, "10.65.0.3", 81), "denied again after the repair");
    // cali2's entry taken out of its shard's dispatch map by hand: its
    // ingress policy would not run, so filter's end check drops what is
    // sent to it (fail closed) until the refresh makes the map again.
    let listed = host.run("nft", &["list", "chain", "ip", &shard, "dph-to-wl-shard"])?;
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    let map = listed
        .split_whitespace()
        .find_map(|w| w.strip_prefix("@dispatch-"))
        .map(|h| format!("dispatch-{h}"))
        .context("the dispatch map")?;
    host.run(
        "nft",
        &["delete", "element", "ip", &shard, &map, "{ \"cali2\" }"],
    )?;
    let blocked = !tcp(&w1, "10.65.0.3", 80);
    let entries = || -> Result<String> {
        let m = host.run("nft", &["list", "table", "ip", &shard])?;
        Ok(String::from_utf8_lossy(&m.stdout).into_owned())
    };
    // (A refresh tick may have repaired it while the probe ran.)
    let repaired_already = entries()?.contains("\"cali2\" : goto dph-tw-list-");
    assert!(
        blocked || repaired_already,
        "reached while its ingress policy could not run"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !entries()?.contains("\"cali2\" : goto dph-tw-list-") {
        ensure!(
            Instant::now() < deadline,
            "the dispatch map was not made again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(tcp(&w1, "10.65.0.3", 80), "w2 reached again");
    assert!(!tcp(&w1, "10.65.0.3", 81));
    // Refresh ticks that find everything right write nothing.
    let commits = || -> Result<f64> {
        Ok(scrape(&host, 19391)?
            .get("dphandler_nftables_commits_total{ip_version=\"4\"}")
            .copied()
            .unwrap_or(-1.0))
    };
    let repaired = commits()?;
    assert!(repaired >= 1.0);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(commits()?, repaired, "a refresh of right tables wrote");
    d.stop()?;

    // 5. Back to iptables: none of our tables stay.
    let (d, _c) = run(&host, dir.path(), "iptables", metrics).await?;
    assert!(tcp(&w1, "10.65.0.3", 80) && !tcp(&w1, "10.65.0.3", 81));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !our_tables(&host)?.is_empty() {
        ensure!(
            Instant::now() < deadline,
            "our nftables tables stay: {:?}",
            our_tables(&host)?
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    d.stop()?;
    assert_eq!(foreign(&host)?, before, "another agent's state changed");
    Ok(())
}
