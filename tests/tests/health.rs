//! The health endpoint of a real daemon in a namespace of the test's own:
//! readiness before and after the calc graph's InSync, liveness while the
//! sync loop turns and while it is held (an `ipset` wrapper, first on the
//! daemon's PATH, sleeps on a set named to stall it). Needs root.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use dphandler_tests::lab::{http_get, yaml_msgs};
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
