//! The interface monitor against the real kernel, in a network namespace
//! this test creates (and removes, also on failure). Needs root.

use std::time::Duration;

mod common;

use anyhow::{Context, Result, bail};
use common::{Netns, privileged, run};
use dphandler_dataplane::interfaces::{InterfaceEvent, netlink};
use tokio::sync::mpsc;

/// Run the monitor on a thread that entered `ns`; the netlink socket is
/// bound to the namespace it was opened in.
fn spawn_monitor(ns: &str) -> Result<(mpsc::Receiver<InterfaceEvent>, mpsc::Sender<()>)> {
    let file = std::fs::File::open(format!("/run/netns/{ns}"))?;
    let (tx, rx) = mpsc::channel(100);
    let (resync_tx, resync_rx) = mpsc::channel(1);
    std::thread::spawn(move || {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(netlink::run(tx, resync_rx));
    });
    Ok((rx, resync_tx))
}

async fn next_matching(
    rx: &mut mpsc::Receiver<InterfaceEvent>,
    want: impl Fn(&InterfaceEvent) -> bool,
) -> Result<InterfaceEvent> {
    tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(ev) = rx.recv().await {
            if want(&ev) {
                return Ok(ev);
            }
        }
        bail!("monitor stopped")
    })
    .await
    .context("timed out waiting for an interface event")?
}

#[tokio::test]
async fn dump_ends_in_sync_then_changes_stream() -> Result<()> {
    if !privileged() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the privileged tests as root"
        );
        eprintln!("skipped: needs root for network namespaces");
        return Ok(());
    }
    let ns = Netns::new("ifmon")?;
    let (mut rx, resync) = spawn_monitor(&ns.0)?;

    // The initial dump: lo (down in a new namespace), then InSync.
    let mut saw_lo = false;
    loop {
        let ev = next_matching(&mut rx, |_| true).await?;
        match ev {
            InterfaceEvent::Link { ref name, up, .. } if name == "lo" => {
                assert!(!up, "lo starts down in a new namespace");
                saw_lo = true;
            }
            InterfaceEvent::InSync => break,
            _ => {}
        }
    }
    assert!(saw_lo, "lo missing from the dump");

    // A new veth pair, brought up, with addresses of both families.
    let n = ns.0.as_str();
    run(
        "ip",
        &[
            "-n", n, "link", "add", "dphtesta", "type", "veth", "peer", "name", "dphtestb",
        ],
    )?;
    next_matching(
        &mut rx,
        |e| matches!(e, InterfaceEvent::Link { name, .. } if name == "dphtesta"),
    )
    .await?;
    run(
        "ip",
        &["-n", n, "addr", "add", "10.99.0.1/24", "dev", "dphtesta"],
    )?;
    run(
        "ip",
        &[
            "-n",
            n,
            "addr",
            "add",
            "fd99::1/64",
            "dev",
            "dphtesta",
            "nodad",
        ],
    )?;
    let v4 = next_matching(&mut rx, |e| {
        matches!(e, InterfaceEvent::AddrAdded { addr, .. } if addr.to_string() == "10.99.0.1/24")
    })
    .await?;
    next_matching(
        &mut rx,
        |e| matches!(e, InterfaceEvent::AddrAdded { addr, .. } if addr.to_string() == "fd99::1/64"),
    )
    .await?;
    run("ip", &["-n", n, "link", "set", "dphtesta", "up"])?;
    run("ip", &["-n", n, "link", "set", "dphtestb", "up"])?;
    next_matching(
        &mut rx,
        |e| matches!(e, InterfaceEvent::Link { name, up: true, .. } if name == "dphtesta"),
    )
    .await?;

    // A refresh re-dumps: the address is reported again.
    resync.send(()).await?;
    let again = next_matching(
        &mut rx,
        |e| matches!(e, InterfaceEvent::AddrAdded { .. } if *e == v4),
    )
    .await?;
    assert_eq!(again, v4);

    run(
        "ip",
        &["-n", n, "addr", "del", "10.99.0.1/24", "dev", "dphtesta"],
    )?;
    next_matching(&mut rx, |e| {
        matches!(e, InterfaceEvent::AddrRemoved { addr, .. } if addr.to_string() == "10.99.0.1/24")
    })
    .await?;
    run("ip", &["-n", n, "link", "del", "dphtesta"])?;
    next_matching(
        &mut rx,
        |e| matches!(e, InterfaceEvent::LinkRemoved { name, .. } if name == "dphtesta"),
    )
    .await?;
    Ok(())
}
