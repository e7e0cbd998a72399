//! The real `dphandler serve` in a network namespace of its own, driven by a
//! tonic client over the unix socket. Needs root.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use dphandler_proto::felix::{self, to_dataplane::Payload};
use dphandler_proto::v1;
use dphandler_tests::{Daemon, Netns, bin, ipset, msg, privileged, push, tempdir};

#[tokio::test]
async fn snapshot_in_sync_rejection_and_status_over_the_unix_socket() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("e2e")?;
    let d = Daemon::start(&ns, &socket, &[])?;
    let mut client = d.connect().await?;
    let mode = std::fs::metadata(&socket)?.permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "socket mode {mode:o}");

    let mut watch = client
        .status_updates(v1::StatusUpdatesRequest {})
        .await?
        .into_inner();

    let msgs = vec![
        msg(1, ipset("s:a", &["10.0.0.1", "10.0.0.2"])),
        msg(2, ipset("bad id\n-A INPUT -j ACCEPT", &[])),
        msg(3, ipset("s:b", &["10.0.0.3", "not-an-ip"])),
        msg(4, ipset("s:c", &["fd00::1"])),
        msg(5, Payload::InSync(felix::InSync {})),
    ];
    let mut replies = client
        .to_dataplane(tokio_stream::iter(msgs))
        .await?
        .into_inner();
    let mut rejected = Vec::new();
    let mut programmed = 0;
    let mut received = None;
    while let Some(r) = tokio::time::timeout(Duration::from_secs(10), replies.message()).await?? {
        match r.kind.unwrap() {
            v1::to_dataplane_reply::Kind::Rejected(r) => {
                assert!(received.is_none(), "rejections come before Received");
                rejected.push(r)
            }
            v1::to_dataplane_reply::Kind::Programmed(p) => programmed = p.sequence_number,
            v1::to_dataplane_reply::Kind::Received(r) => received = Some(r),
        }
    }
    let received = received.expect("Received is sent after the client half-closes");
    assert_eq!(
        (
            received.messages,
            received.rejected,
            received.last_accepted_sequence
        ),
        (5, 2, 5)
    );
    assert_eq!(
        programmed, 5,
        "the stream ends once everything it sent is programmed"
    );
    assert_eq!(rejected.len(), 2, "{rejected:?}");
    assert_eq!(
        (rejected[0].sequence_number, rejected[0].field.as_str()),
        (2, "ipset_update.id")
    );
    assert_eq!(
        (rejected[1].sequence_number, rejected[1].field.as_str()),
        (3, "ipset_update.members[1]")
    );
    assert!(
        rejected[1].reason.contains("not-an-ip"),
        "{}",
        rejected[1].reason
    );

    // The first apply announces this node's WireGuard keys (empty: it is
    // off), as Felix's does, then the dataplane is in sync.
    let mut keys = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), watch.message())
            .await??
            .unwrap();
        match m.kind {
            Some(v1::status_update::Kind::Update(felix::FromDataplane {
                payload: Some(felix::from_dataplane::Payload::DataplaneInSync(_)),
                ..
            })) => break,
            Some(v1::status_update::Kind::Update(felix::FromDataplane {
                payload: Some(felix::from_dataplane::Payload::WireguardStatusUpdate(w)),
                ..
            })) => keys.push((w.ip_version, w.public_key)),
            other => panic!("before DataplaneInSync: {other:?}"),
        }
    }
    assert_eq!(keys, vec![(4, String::new()), (6, String::new())]);

    let st = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    assert!(st.in_sync && st.datastore_in_sync && st.interfaces_in_sync);
    assert_eq!(st.objects.get("ipset"), Some(&2), "{:?}", st.objects);
    assert_eq!(st.last_programmed_sequence, 5);

    // A watcher that connects after the fact still learns the dataplane is in sync.
    let mut late = client
        .status_updates(v1::StatusUpdatesRequest {})
        .await?
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(5), late.message())
        .await??
        .unwrap();
    assert!(format!("{first:?}").contains("DataplaneInSync"));

    // A second session's snapshot replaces the first: s:a and s:c go.
    let msgs = vec![
        msg(1, ipset("s:d", &["10.0.0.9"])),
        msg(2, Payload::InSync(felix::InSync {})),
    ];
    push(&mut client, msgs).await?;
    let st = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    assert_eq!(st.objects.get("ipset"), Some(&1), "{:?}", st.objects);
    Ok(())
}

#[tokio::test]
async fn live_socket_is_refused_and_stale_one_replaced() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    // A stale socket file: bound once, nobody listening.
    drop(std::os::unix::net::UnixListener::bind(&socket)?);
    assert!(socket.exists());
    let ns = Netns::new("sock")?;
    let d = Daemon::start(&ns, &socket, &[])?;
    let mut client = d.connect().await?;
    client.get_status(v1::GetStatusRequest {}).await?;

    // A second server on the same socket refuses to start.
    let out = Command::new(bin("dphandler"))
        .args(["serve", "--socket"])
        .arg(&socket)
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by a running server"), "{err}");
    // ... and the first still answers.
    client.get_status(v1::GetStatusRequest {}).await?;
    Ok(())
}

#[tokio::test]
async fn sigterm_ends_open_streams_and_leaves_the_kernel_alone() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("term")?;
    // Kernel state that must survive the daemon's stop.
    ns.run(
        "ip",
        &[
            "link", "add", "keep0", "type", "veth", "peer", "name", "keep1",
        ],
    )?;
    ns.run("iptables", &["-w", "-N", "KEEP-ME"])?;
    let d = Daemon::start(&ns, &socket, &["--shutdown-grace-seconds", "1"])?;
    let mut client = d.connect().await?;
    let mut watch = client
        .status_updates(v1::StatusUpdatesRequest {})
        .await?
        .into_inner();
    // A feeder that never half-closes: its snapshot is programmed, and the
    // stream stays open.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(msg(1, ipset("s:a", &["10.0.0.1"]))).await?;
    tx.send(msg(2, Payload::InSync(felix::InSync {}))).await?;
    let mut replies = client
        .to_dataplane(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    loop {
        let r = tokio::time::timeout(Duration::from_secs(10), replies.message())
            .await??
            .expect("the stream stays open");
        if matches!(r.kind, Some(v1::to_dataplane_reply::Kind::Programmed(p)) if p.sequence_number == 2)
        {
            break;
        }
    }

    let started = std::time::Instant::now();
    let status = d.stop()?;
    assert!(status.success(), "exit status {status}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stopping took {:?}",
        started.elapsed()
    );
    // Both streams are over (cleanly or with a transport error), not hanging.
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(_)) = watch.message().await {}
        while let Ok(Some(_)) = replies.message().await {}
    })
    .await;
    assert!(
        end.is_ok(),
        "a stream was still open after the server stopped"
    );
    drop(tx);
    assert!(!socket.exists(), "the socket file is removed on stop");
    // Nothing in the kernel was removed.
    ns.run("ip", &["link", "show", "keep0"])?;
    let save = ns.run("iptables-save", &[])?;
    assert!(String::from_utf8_lossy(&save.stdout).contains(":KEEP-ME"));
    Ok(())
}
