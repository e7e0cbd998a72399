//! A stopping daemon changes nothing more: killed beside its
//! `wireguard-go` (a node being drained, a pod deleted), it does not start
//! a new one during its grace period, which would outlive it. Nor does the
//! apply under way when the `wireguard-go` dies: its configuration used to
//! find no socket, and `wireguard-control` then started a `wireguard-go`
//! of its own, daemonised (CI, about 1 run in 20). Needs root and
//! `wireguard-go`.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use dphandler_tests::{Daemon, Netns, in_sync, msg, privileged, tempdir};

/// The pids of the `wireguard-go` processes serving `iface`.
fn wireguard_go(iface: &str) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        let is = args.first()?.ends_with(b"wireguard-go") && args.contains(&iface.as_bytes());
        is.then_some(pid)
    })
    .collect()
}

fn kill(pid: i32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
}

/// Ends the `wireguard-go`s of `iface` on drop (what the test started),
/// and their UAPI socket.
struct Reaper(String);

impl Drop for Reaper {
    fn drop(&mut self) {
        for pid in wireguard_go(&self.0) {
            kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
        let _ = std::fs::remove_file(format!("/var/run/wireguard/{}.sock", self.0));
    }
}

async fn wait_for(what: &str, mut until: impl FnMut() -> bool) -> Result<()> {
    let t0 = Instant::now();
    while !until() {
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(15),
            "{what}: not in 15 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

#[tokio::test]
async fn a_stopping_daemon_starts_no_wireguard_go() -> Result<()> {
    if !privileged() || !Path::new("/usr/bin/wireguard-go").exists() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let iface = format!("wgs{}.cali", std::process::id() % 100_000);
    let _reaper = Reaper(iface.clone());
    let ns = Netns::new("stop")?;
    let d = Daemon::start(
        &ns,
        &socket,
        &[
            "--wireguard",
            "true",
            "--wireguard-interface",
            &iface,
            "--wireguard-impl",
            "userspace",
            "--shutdown-grace-seconds",
            "3",
        ],
    )?;
    let mut client = d.connect().await?;
    // A feeder that stays: the stop waits out its grace period, when the
    // device's loss used to be repaired.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(msg(1, in_sync())).await?;
    let _replies = client
        .to_dataplane(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    wait_for("a wireguard-go", || !wireguard_go(&iface).is_empty()).await?;
    let first = wireguard_go(&iface);

    // Both at once, as a node's drain does.
    let daemon_pid = i32::try_from(d.pid()).context("pid")?;
    kill(daemon_pid, nix::sys::signal::Signal::SIGTERM);
    for pid in &first {
        kill(*pid, nix::sys::signal::Signal::SIGKILL);
    }
    let stopped = Instant::now();
    let status = d.stop()?;
    eprintln!(
        "stopping: the daemon exited after {:?} ({status})",
        stopped.elapsed()
    );
    assert!(status.success(), "{status}");
    // A wireguard-go started during the grace period would be running
    // (or starting) now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after: Vec<i32> = wireguard_go(&iface)
        .into_iter()
        .filter(|p| !first.contains(p))
        .collect();
    assert!(
        after.is_empty(),
        "a new wireguard-go outlived the daemon: {after:?}"
    );
    drop(tx);
    Ok(())
}
