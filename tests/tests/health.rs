//! The health endpoint of a real daemon in a namespace of the test's own:
//! readiness before and after the calc graph's InSync, liveness while the
//! sync loop turns and while it is held (an `ipset` wrapper, first on the
//! daemon's PATH, sleeps on a set named to stall it). Needs root.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use dphandler_tests::kernel;
use dphandler_tests::lab::{http_get, scrape, yaml_msgs};
use dphandler_tests::{Daemon, Netns, privileged, push, tempdir};

/// `GET path` on the namespace's 127.0.0.1:19099 (health) or :19091
/// (`/metrics`): (status code, body).
fn get(ns: &Netns, path: &'static str) -> Result<(u16, String)> {
    let port = if path == "/metrics" { 19091 } else { 19099 };
    http_get(ns, "127.0.0.1", port, path)
}

#[tokio::test]
async fn readiness_follows_in_sync_and_liveness_the_loop() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let real = String::from_utf8(
        std::process::Command::new("sh")
            .args(["-c", "command -v ipset"])
            .output()?
            .stdout,
    )?;
    let real = real.trim();
    if real.is_empty() {
        bail!("no ipset");
    }
    let wrapper = dir.path().join("ipset");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nif [ \"$1\" = restore ]; then\n  t=$(mktemp); cat > \"$t\"\n  if grep -q stall \"$t\"; then sleep 6; fi\n  {real} \"$@\" < \"$t\"; rc=$?; rm -f \"$t\"; exit $rc\nfi\nexec {real} \"$@\"\n"
        ),
    )?;
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;
    let path = format!("{}:{}", dir.path().display(), std::env::var("PATH")?);
    let ns = Netns::new("hl")?;
    ns.run("ip", &["link", "set", "lo", "up"])?;
    let d = Daemon::start_env(
        &ns,
        &dir.path().join("d.sock"),
        &[
            "--hostname",
            "n1",
            "--health-addr",
            "127.0.0.1:19099",
            "--metrics-addr",
            "127.0.0.1:19091",
            "--liveness-timeout-seconds",
            "2",
        ],
        &[("PATH", path.as_str())],
    )?;
    let mut c = d.connect().await?;
    let (code, body) = get(&ns, "/readiness")?;
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("\"readiness\":false") && body.contains("InSync"),
        "{body}"
    );
    assert_eq!(get(&ns, "/liveness")?.0, 200);

    let (rej, _) = push(
        &mut c,
        yaml_msgs(
            1,
            "ipsetUpdate: {id: 's:a', members: ['10.0.0.1']}\n---\ninSync: {}\n",
        ),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    let (code, body) = get(&ns, "/readiness")?;
    assert_eq!(code, 200, "{body}");
    // Idle for longer than the liveness timeout: the loop still turns.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (code, body) = get(&ns, "/liveness")?;
    assert_eq!(code, 200, "{body}");

    // Hold the loop in an apply for 6 s: liveness fails, then recovers.
    let mut c2 = d.connect().await?;
    let stall = tokio::spawn(async move {
        push(
            &mut c2,
            yaml_msgs(10, "ipsetUpdate: {id: 's:stall', members: ['10.0.0.2']}\n"),
        )
        .await
    });
    let t = Instant::now();
    let mut failed = None;
    while t.elapsed() < Duration::from_secs(6) {
        let (code, body) = get(&ns, "/liveness")?;
        if code == 503 {
            failed = Some(body);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let body = failed.expect("liveness failed while the loop was held");
    assert!(body.contains("has not turned"), "{body}");
    let (rej, _) = stall.await??;
    assert!(rej.is_empty(), "{rej:?}");
    assert_eq!(get(&ns, "/liveness")?.0, 200);
    assert_eq!(get(&ns, "/nope")?.0, 404);
    Ok(())
}

#[tokio::test]
async fn metrics_count_what_the_daemon_did() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let ns = Netns::new("mt")?;
    ns.run("ip", &["link", "set", "lo", "up"])?;
    let d = Daemon::start(
        &ns,
        &dir.path().join("d.sock"),
        &[
            "--hostname",
            "n1",
            "--health-addr",
            "none",
            "--metrics-addr",
            "127.0.0.1:19191",
        ],
    )?;
    let mut c = d.connect().await?;
    let before = scrape(&ns, 19191)?;
    assert_eq!(
        before.get("dphandler_int_dataplane_in_sync"),
        Some(&0.0),
        "{before:?}"
    );

    // Two sets, a message the loop refuses (a member that is no address),
    // a workload endpoint, InSync.
    let (rej, _) = push(
        &mut c,
        yaml_msgs(
            1,
            "ipsetUpdate: {id: 's:a', members: ['10.0.0.1', '10.0.0.2']}\n---\n\
             ipsetUpdate: {id: 's:b', type: NET, members: ['10.0.1.0/24']}\n---\n\
             ipsetDeltaUpdate: {id: 's:a', addedMembers: ['10.0.0.999']}\n---\n\
             workloadEndpointUpdate: {id: {orchestratorId: k8s, workloadId: ns/p, endpointId: eth0}, \
             endpoint: {state: active, name: cali1234, ipv4Nets: ['10.0.0.1/32']}}\n---\n\
             inSync: {}\n",
        ),
    )
    .await?;
    assert_eq!(rej.len(), 1, "{rej:?}");

    // A scrape with no apply in between, as GetStatus counts them.
    let (m, st) = {
        let mut found = None;
        for _ in 0..20 {
            let a = c
                .get_status(dphandler_proto::v1::GetStatusRequest {})
                .await?
                .into_inner();
            let m = scrape(&ns, 19191)?;
            let b = c
                .get_status(dphandler_proto::v1::GetStatusRequest {})
                .await?
                .into_inner();
            if a.applies == b.applies && b.in_sync {
                found = Some((m, b));
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        found.expect("a quiet moment")
    };
    let get = |k: &str| {
        m.get(k)
            .copied()
            .unwrap_or_else(|| panic!("no {k} in {m:#?}"))
    };
    assert_eq!(get("dphandler_int_dataplane_in_sync"), 1.0);
    assert_eq!(
        get("dphandler_int_dataplane_apply_time_seconds_count"),
        (st.applies - st.failed_applies) as f64,
        "one observation per successful apply"
    );
    assert_eq!(
        get("dphandler_int_dataplane_failures_total"),
        st.failed_applies as f64
    );
    assert_eq!(get("dphandler_grpc_rejections_total"), 1.0);
    assert_eq!(
        get("dphandler_int_dataplane_messages_total{type=\"ipset\"}"),
        2.0
    );
    assert_eq!(
        get("dphandler_int_dataplane_messages_total{type=\"in_sync\"}"),
        1.0
    );

    if kernel::nftables() {
        // Commits, not tools; what our filter table holds, as nft lists it.
        assert!(get("dphandler_nftables_commits_total{ip_version=\"4\"}") >= 1.0);
        // Filter and its shards.
        let listed = kernel::our_rules(&ns, false, "filter")?;
        let chains = listed.matches("\tchain ").count();
        let rules = listed.matches("comment \"dph:").count();
        assert!(chains > 0, "{listed}");
        let of_filter = |metric: &str| -> f64 {
            let prefix = format!("{metric}{{ip_version=\"4\",table=\"dph-filter");
            m.iter()
                .filter(|(k, _)| k.starts_with(&prefix))
                .map(|(_, v)| v)
                .sum()
        };
        assert_eq!(
            of_filter("dphandler_nftables_chains"),
            chains as f64,
            "{listed}"
        );
        assert_eq!(
            of_filter("dphandler_nftables_rules"),
            rules as f64,
            "{listed}"
        );
        // Each set once, wherever it is (a shard's copy is the same set).
        let sets = listed
            .lines()
            .filter_map(|l| l.trim().strip_prefix("set dph40"))
            .collect::<std::collections::BTreeSet<_>>()
            .len();
        assert_eq!(
            get("dphandler_ipsets{ip_version=\"4\"}"),
            sets as f64,
            "{listed}"
        );
        assert!(sets >= 1, "{listed}");
    } else {
        // The tools: every run counted, none failed.
        assert!(get("dphandler_ipset_calls_total") >= 1.0);
        assert!(
            get("dphandler_ipset_lines_executed_total") >= 5.0,
            "2 creates, 3 members"
        );
        assert_eq!(get("dphandler_ipset_errors_total"), 0.0);
        assert!(get("dphandler_iptables_restore_calls_total{ip_version=\"4\"}") >= 1.0);
        assert_eq!(
            get("dphandler_iptables_restore_errors_total{ip_version=\"4\"}"),
            0.0
        );
        assert!(get("dphandler_iptables_save_calls_total{ip_version=\"4\"}") >= 1.0);
        assert!(
            get("dphandler_iptables_lines_executed_total{ip_version=\"4\",table=\"filter\"}")
                > 10.0
        );

        // What the kernel holds, as the kernel says.
        let saved = String::from_utf8(ns.run("iptables-save", &["-t", "filter"])?.stdout)?;
        let chains = saved.lines().filter(|l| l.starts_with(":dph-")).count();
        let rules = saved
            .lines()
            .filter(|l| l.starts_with("-A ") && l.contains("--comment \"dph:"))
            .count();
        assert!(chains > 0, "{saved}");
        assert_eq!(
            get("dphandler_iptables_chains{ip_version=\"4\",table=\"filter\"}"),
            chains as f64,
            "{saved}"
        );
        assert_eq!(
            get("dphandler_iptables_rules{ip_version=\"4\",table=\"filter\"}"),
            rules as f64,
            "{saved}"
        );
        let sets = String::from_utf8(ns.run("ipset", &["list", "-n"])?.stdout)?;
        let v4 = sets.lines().filter(|l| l.starts_with("dph40")).count();
        assert_eq!(
            get("dphandler_ipsets{ip_version=\"4\"}"),
            v4 as f64,
            "{sets}"
        );
        assert!(v4 >= 2, "{sets}");
    }
    assert!(m.contains_key("dphandler_routes{kind=\"route\"}"), "{m:#?}");
    assert_eq!(
        get("dphandler_grpc_feeders"),
        0.0,
        "the push's stream ended"
    );

    // A watcher is counted while its stream is open.
    assert_eq!(get("dphandler_grpc_watchers"), 0.0);
    let watch = c
        .status_updates(dphandler_proto::v1::StatusUpdatesRequest {})
        .await?
        .into_inner();
    let watchers = |want: f64| {
        let ns = &ns;
        async move {
            for _ in 0..50 {
                if scrape(ns, 19191)?.get("dphandler_grpc_watchers") == Some(&want) {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            bail!("grpc_watchers never {want}")
        }
    };
    watchers(1.0).await?;
    drop(watch);
    watchers(0.0).await?;
    Ok(())
}
