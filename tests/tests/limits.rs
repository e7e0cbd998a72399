//! The server's guards, against the real binary in a namespace of its own:
//! per-peer rate limit, message-size limit, socket permissions, TCP refused
//! without mTLS, and mTLS itself (client certificate required, other CAs
//! refused). TCP traffic stays on the namespace's own loopback. Needs root.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{Result, bail};
use dphandler_proto::v1;
use dphandler_tests::tls::{ca_and_cert, cert};
use dphandler_tests::{Daemon, Netns, bin, in_sync, ipset, msg, privileged, push, tempdir};

#[tokio::test]
async fn rate_limit_is_per_peer_and_says_so() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("rate")?;
    let d = Daemon::start(
        &ns,
        &socket,
        &["--rate-limit-per-second", "0.5", "--rate-limit-burst", "5"],
    )?;
    let mut client = d.connect().await?;
    let mut ok = 0;
    let mut limited = None;
    for _ in 0..20 {
        match client.get_status(v1::GetStatusRequest {}).await {
            Ok(_) => ok += 1,
            Err(s) => {
                limited = Some(s);
                break;
            }
        }
    }
    let s = limited.expect("calls beyond the burst are refused");
    assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
    // connect() may have spent a token or two probing; never more than the burst.
    assert!((1..=5).contains(&ok), "{ok} calls went through");
    assert!(s.metadata().get("retry-after").is_some(), "{s:?}");

    // Another peer (uid 65534 on the unix socket) has its own quota.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666))?;
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(bin("dphctl"))
        .arg("--socket")
        .arg(&socket)
        .arg("status")
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[tokio::test]
async fn oversized_message_is_refused_and_the_server_goes_on() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("size")?;
    let d = Daemon::start(&ns, &socket, &["--max-message-bytes", "4096"])?;
    let mut client = d.connect().await?;
    let members: Vec<String> = (0..1000)
        .map(|i| format!("10.0.{}.{}", i / 250, i % 250))
        .collect();
    let refs: Vec<&str> = members.iter().map(String::as_str).collect();
    let big = msg(1, ipset("s:big", &refs));
    let mut replies = client
        .to_dataplane(tokio_stream::iter(vec![big]))
        .await?
        .into_inner();
    let err = loop {
        match tokio::time::timeout(Duration::from_secs(10), replies.message()).await? {
            Err(e) => break e,
            Ok(Some(_)) => continue,
            Ok(None) => bail!("an oversized message was accepted"),
        }
    };
    assert_eq!(err.code(), tonic::Code::OutOfRange, "{err:?}");
    assert!(err.message().contains("4096"), "{err:?}");

    // Small messages on a new stream still work, and nothing of the big one
    // is held.
    let small = vec![msg(1, ipset("s:small", &["10.9.9.9"])), msg(2, in_sync())];
    push(&mut client, small).await?;
    let st = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    assert!(st.in_sync);
    assert_eq!(st.objects.get("ipset"), Some(&1), "{:?}", st.objects);
    Ok(())
}

#[tokio::test]
async fn socket_is_0660_and_others_are_refused() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    // The directory is reachable by anyone, so only the socket's own mode
    // keeps uid 65534 out.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("perm")?;
    let d = Daemon::start(&ns, &socket, &[])?;
    d.connect().await?;
    let mode = std::fs::metadata(&socket)?.permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "socket mode {mode:o}");
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(bin("dphctl"))
        .arg("--socket")
        .arg(&socket)
        .arg("status")
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.to_lowercase().contains("permission denied"), "{err}");
    Ok(())
}

#[test]
fn tcp_without_mtls_is_refused_at_start() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let ns = Netns::new("notls")?;
    let out = ns
        .command(bin("dphandler"))
        .args(["serve", "--tcp", "127.0.0.1:0", "--socket"])
        .arg(dir.path().join("dp.sock"))
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("refusing to listen on TCP without TLS"),
        "{err}"
    );
    assert!(
        !dir.path().join("dp.sock").exists(),
        "nothing was bound before the settings were checked"
    );
    // Half the TLS files is an error too.
    let out = ns
        .command(bin("dphandler"))
        .args([
            "serve",
            "--tcp",
            "127.0.0.1:0",
            "--tls-cert",
            "/nonexistent",
        ])
        .arg("--socket")
        .arg(dir.path().join("dp.sock"))
        .output()?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("go together"));
    Ok(())
}

fn dphctl_tcp(ns: &Netns, dir: &Path, port: u16, tls: Option<(&str, &str)>) -> Result<Output> {
    let mut c = ns.command(bin("dphctl"));
    c.args(["--tcp", &format!("127.0.0.1:{port}")]);
    match tls {
        Some((ca, client)) => {
            c.arg("--tls-ca")
                .arg(dir.join(format!("{ca}-ca.pem")))
                .arg("--tls-cert")
                .arg(dir.join(format!("{client}.pem")))
                .arg("--tls-key")
                .arg(dir.join(format!("{client}.key")))
                .args(["--tls-server-name", "localhost"]);
        }
        None => {
            c.arg("--insecure-tcp");
        }
    }
    Ok(c.args(["status", "--json"]).output()?)
}

#[tokio::test]
async fn mtls_requires_a_client_certificate_from_the_ca() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let d = dir.path();
    ca_and_cert(d, "good", "server")?;
    cert(d, "good", "client")?;
    ca_and_cert(d, "other", "stranger")?;
    let ns = Netns::new("mtls")?;
    ns.run("ip", &["link", "set", "lo", "up"])?;
    let port = 50051;
    let p = |f: &str| d.join(f).display().to_string();
    let (cert, key, ca) = (p("server.pem"), p("server.key"), p("good-ca.pem"));
    let daemon = Daemon::start(
        &ns,
        &d.join("dp.sock"),
        &[
            "--tcp",
            &format!("127.0.0.1:{port}"),
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-ca",
            &ca,
        ],
    )?;
    daemon.connect().await?;

    // A client with a certificate from the right CA gets through.
    let mut ok = None;
    for _ in 0..50 {
        let out = dphctl_tcp(&ns, d, port, Some(("good", "client")))?;
        if out.status.success() {
            ok = Some(out);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = ok.expect("the TCP listener answers a client with a good certificate");
    let st: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    // The status came back over mTLS (its fields depend on timing).
    assert!(st["uptimeSeconds"].as_f64().is_some(), "{st}");

    // Without TLS, or with a certificate from another CA: refused.
    let out = dphctl_tcp(&ns, d, port, None)?;
    assert!(!out.status.success(), "plain TCP got through");
    let out = dphctl_tcp(&ns, d, port, Some(("good", "stranger")))?;
    assert!(
        !out.status.success(),
        "a certificate from another CA got through"
    );
    // And the server is still fine.
    assert!(
        dphctl_tcp(&ns, d, port, Some(("good", "client")))?
            .status
            .success()
    );
    Ok(())
}
