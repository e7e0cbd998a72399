//! The real `dphandler serve` in a network namespace of its own, driven by a
//! tonic client over the unix socket. Needs root.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use dphandler_proto::felix::{self, to_dataplane::Payload};
use dphandler_proto::v1::{self, dataplane_client::DataplaneClient};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// The daemon, ended by PID when dropped.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.0.id()).unwrap()),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.0.wait();
    }
}

fn start(tag: &str, socket: &Path) -> Result<(Netns, Daemon)> {
    let ns = Netns(format!("dph-{tag}-{}", std::process::id()));
    let st = Command::new("ip").args(["netns", "add", &ns.0]).status()?;
    if !st.success() {
        bail!("ip netns add failed");
    }
    let child = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.0,
            env!("CARGO_BIN_EXE_dphandler"),
            "serve",
            "--socket",
        ])
        .arg(socket)
        .env("DPH_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("spawning dphandler")?;
    Ok((ns, Daemon(child)))
}

async fn connect(socket: &Path) -> Result<DataplaneClient<Channel>> {
    for _ in 0..100 {
        if socket.exists() {
            let p = socket.to_path_buf();
            let ch = Endpoint::try_from("http://[::]:50051")?
                .connect_with_connector(tower::service_fn(move |_| {
                    let p = p.clone();
                    async move {
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                            UnixStream::connect(p).await?,
                        ))
                    }
                }))
                .await;
            if let Ok(ch) = ch {
                return Ok(DataplaneClient::new(ch));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("server did not come up on {}", socket.display())
}

fn msg(seq: u64, p: Payload) -> felix::ToDataplane {
    felix::ToDataplane {
        sequence_number: seq,
        payload: Some(p),
    }
}

fn ipset(id: &str, members: &[&str]) -> Payload {
    Payload::IpsetUpdate(felix::IpSetUpdate {
        id: id.into(),
        members: members.iter().map(|s| s.to_string()).collect(),
        r#type: felix::ip_set_update::IpSetType::Ip as i32,
    })
}

fn root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

#[tokio::test]
async fn snapshot_in_sync_rejection_and_status_over_the_unix_socket() -> Result<()> {
    if !root() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the privileged tests as root"
        );
        eprintln!("skipped: needs root");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let socket: PathBuf = dir.path().join("dp.sock");
    let (_ns, _d) = start("e2e", &socket)?;
    let mut client = connect(&socket).await?;
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
        (received.messages, received.rejected, received.last_accepted_sequence),
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

    let first = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await??
        .unwrap();
    assert!(matches!(
        first.kind,
        Some(v1::status_update::Kind::Update(felix::FromDataplane {
            payload: Some(felix::from_dataplane::Payload::DataplaneInSync(_)),
            ..
        }))
    ));

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
    let mut replies = client
        .to_dataplane(tokio_stream::iter(msgs))
        .await?
        .into_inner();
    while tokio::time::timeout(Duration::from_secs(10), replies.message())
        .await??
        .is_some()
    {}
    let st = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    assert_eq!(st.objects.get("ipset"), Some(&1), "{:?}", st.objects);
    Ok(())
}

#[tokio::test]
async fn live_socket_is_refused_and_stale_one_replaced() -> Result<()> {
    if !root() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the privileged tests as root"
        );
        eprintln!("skipped: needs root");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("dp.sock");
    // A stale socket file: bound once, nobody listening.
    drop(std::os::unix::net::UnixListener::bind(&socket)?);
    assert!(socket.exists());
    let (_ns, _d) = start("sock", &socket)?;
    let mut client = connect(&socket).await?;
    client.get_status(v1::GetStatusRequest {}).await?;

    // A second server on the same socket refuses to start.
    let out = Command::new(env!("CARGO_BIN_EXE_dphandler"))
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
