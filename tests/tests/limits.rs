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
use dphandler_tests::{Daemon, Netns, bin, in_sync, ipset, ipsets, msg, privileged, push, tempdir};

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

    // A peer that connects and never says a word is let go when the TLS
    // handshake times out (10 s); meanwhile it holds only its slot.
    let mut idle = ns_tcp_connect(&ns, port)?;
    let t0 = std::time::Instant::now();
    let mut buf = [0u8; 64];
    let n = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        idle.read(&mut buf)
    })
    .await??;
    let waited = t0.elapsed();
    eprintln!("mtls: a silent peer was closed after {waited:?} ({n} bytes)");
    assert_eq!(n, 0, "closed without a word");
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(20),
        "{waited:?}"
    );
    drop(daemon);

    // With --tls-client-name, only a certificate that names one of them.
    dphandler_tests::tls::cert(d, "good", "intruder")?;
    let port = 50052;
    let _named = Daemon::start(
        &ns,
        &d.join("dp2.sock"),
        &[
            "--tcp",
            &format!("127.0.0.1:{port}"),
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-ca",
            &ca,
            "--tls-client-name",
            "feeder.example,client",
        ],
    )?;
    let mut ok = false;
    for _ in 0..50 {
        if dphctl_tcp(&ns, d, port, Some(("good", "client")))?
            .status
            .success()
        {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the named client gets through");
    let out = dphctl_tcp(&ns, d, port, Some(("good", "intruder")))?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "an unnamed certificate got through");
    assert!(err.contains("names none of"), "{err}");
    Ok(())
}

/// A TCP connection to `port` on the namespace's loopback, from inside
/// it (a socket made in the namespace: `ip netns exec` runs a helper
/// that holds the connection open, its stdout the connection's data).
fn ns_tcp_connect(ns: &Netns, port: u16) -> Result<std::process::ChildStdout> {
    let mut child = ns
        .command("python3")
        .args([
            "-c",
            &format!(
                "import socket,sys\ns=socket.create_connection(('127.0.0.1',{port}))\n\
                 d=s.recv(64)\nsys.stdout.buffer.write(d)"
            ),
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    Ok(child.stdout.take().expect("piped"))
}

/// Runs `dphctl --socket <socket> <args>` as uid 65534, with `groups` as
/// its only groups (none: `--clear-groups`), `stdin` fed in.
fn dphctl_as_nobody(
    socket: &Path,
    groups: Option<&str>,
    args: &[&str],
    stdin: &str,
) -> Result<Output> {
    use std::io::Write;
    let mut c = Command::new("setpriv");
    c.args(["--reuid=65534", "--regid=65534"]);
    match groups {
        Some(g) => c.arg(format!("--groups={g}")),
        None => c.arg("--clear-groups"),
    };
    let mut child = c
        .arg(bin("dphctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(stdin.as_bytes())?;
    Ok(child.wait_with_output()?)
}

#[tokio::test]
async fn socket_group_lets_its_members_in() -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("sgrp")?;
    // A group number no account needs to exist for (the host's group file
    // is left alone).
    let d = Daemon::start(&ns, &socket, &["--socket-group", "4242"])?;
    d.connect().await?;
    let meta = std::fs::metadata(&socket)?;
    assert_eq!(
        (meta.gid(), meta.permissions().mode() & 0o777),
        (4242, 0o660)
    );
    let ok = dphctl_as_nobody(&socket, Some("4242"), &["status"], "")?;
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let refused = dphctl_as_nobody(&socket, None, &["status"], "")?;
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert!(err.to_lowercase().contains("permission denied"), "{err}");
    drop(d);

    // A group name that does not exist stops the daemon before it binds.
    let out = ns
        .command(bin("dphandler"))
        .args(["serve", "--socket-group", "dph-no-such-group-x", "--socket"])
        .arg(dir.path().join("other.sock"))
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--socket-group") && err.contains("dph-no-such-group-x"),
        "{err}"
    );
    assert!(!dir.path().join("other.sock").exists());
    Ok(())
}

/// Those who only watch get a read-only socket of their own: `dphctl
/// status` and `watch` fall back to it; a feed through it is refused.
#[tokio::test]
async fn the_status_socket_lets_watchers_read_and_nothing_else() -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let socket = dir.path().join("dp.sock");
    let status = dir.path().join("dp-status.sock");
    let ns = Netns::new("ssock")?;
    let d = Daemon::start(
        &ns,
        &socket,
        &["--socket-group", "4242", "--status-socket-group", "4343"],
    )?;
    d.connect().await?;
    let meta = std::fs::metadata(&status)?;
    assert_eq!(
        (meta.gid(), meta.permissions().mode() & 0o777),
        (4343, 0o660)
    );
    // A watcher (group 4343 only): status works, through the status socket.
    let ok = dphctl_as_nobody(&socket, Some("4343"), &["status"], "")?;
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    // It cannot feed: not through the socket (not its group), not through
    // the status socket (read-only).
    let push = dphctl_as_nobody(&status, Some("4343"), &["push", "-"], "[{\"inSync\":{}}]")?;
    let err = String::from_utf8_lossy(&push.stderr);
    assert!(!push.status.success(), "{err}");
    assert!(err.contains("read-only"), "{err}");
    // A feeder (group 4242) feeds as before.
    let fed = dphctl_as_nobody(
        &socket,
        Some("4242"),
        &["push", "--no-wait", "-"],
        "[{\"inSync\":{}}]",
    )?;
    assert!(
        fed.status.success(),
        "{}",
        String::from_utf8_lossy(&fed.stderr)
    );
    // Off with `none`; gone with the daemon otherwise.
    drop(d);
    assert!(!status.exists(), "removed at exit");
    let socket2 = dir.path().join("other.sock");
    let _d = Daemon::start(&ns, &socket2, &["--status-socket", "none"])?;
    _d.connect().await?;
    assert!(!dir.path().join("other-status.sock").exists());
    Ok(())
}

/// A peer over its message rate is slowed down, loses nothing, and another
/// peer's stream is not held back meanwhile.
#[tokio::test]
async fn message_rate_is_per_peer_and_slows_without_loss() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("mrate")?;
    let d = Daemon::start(
        &ns,
        &socket,
        &[
            "--message-rate-per-second",
            "200",
            "--message-burst",
            "100",
            "--socket-group",
            "4242",
        ],
    )?;
    let mut client = d.connect().await?;
    // 500 messages: 100 at once, then 400 at 200/s — 2 s at least.
    let mut msgs: Vec<_> = (1..500)
        .map(|i| msg(i, ipset(&format!("s:{i}"), &["10.0.0.1"])))
        .collect();
    msgs.push(msg(500, in_sync()));
    let started = std::time::Instant::now();
    let mut root = client.clone();
    let flood = tokio::spawn(async move { push(&mut root, msgs).await });
    // Meanwhile another peer (uid 65534) pushes a delta of its own.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = std::time::Instant::now();
    let other = dphctl_as_nobody(
        &socket,
        Some("4242"),
        &["push", "--no-wait", "-"],
        "{\"ipsetUpdate\":{\"id\":\"s:other\",\"members\":[\"10.0.0.2\"]}}\n",
    )?;
    let other_took = t.elapsed();
    assert!(
        other.status.success(),
        "{}",
        String::from_utf8_lossy(&other.stderr)
    );
    let (rejected, programmed) = flood.await??;
    let took = started.elapsed();
    assert!(rejected.is_empty(), "{rejected:?}");
    assert_eq!(programmed, 500);
    assert!(
        took >= Duration::from_millis(1900),
        "400 messages over the burst at 200/s took {took:?}"
    );
    assert!(
        other_took < Duration::from_millis(1500) && other_took + Duration::from_millis(500) < took,
        "the other peer waited {other_took:?} (the flood took {took:?})"
    );
    let st = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    assert_eq!(
        st.objects.get("ipset"),
        Some(&500),
        "499 + the other peer's: {:?}",
        st.objects
    );
    Ok(())
}

#[tokio::test]
async fn objects_per_kind_are_limited_and_the_rest_goes_on() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("kinds")?;
    let d = Daemon::start(
        &ns,
        &socket,
        &["--max-objects-per-kind", "3", "--max-ipset-members", "5"],
    )?;
    let mut client = d.connect().await?;
    let (rejected, _) = push(
        &mut client,
        vec![
            msg(1, ipset("s:a", &["10.0.0.1"])),
            msg(2, ipset("s:b", &["10.0.0.2"])),
            msg(3, ipset("s:c", &["10.0.0.3"])),
            msg(4, ipset("s:d", &["10.0.0.4"])), // a fourth set
            msg(5, ipset("s:a", &["10.0.0.1", "10.0.0.5"])), // replacing is fine
            msg(6, ipset("s:b", &["10.0.0.2", "10.0.0.6", "10.0.0.7"])), // 6 members in all
            msg(7, in_sync()),
        ],
    )
    .await?;
    let got: Vec<(u64, &str)> = rejected
        .iter()
        .map(|r| (r.sequence_number, r.field.as_str()))
        .collect();
    assert_eq!(
        got,
        [(4, "ipset_update"), (6, "ipset_update.members")],
        "{rejected:?}"
    );
    assert!(
        rejected[0].reason.contains("--max-objects-per-kind"),
        "{rejected:?}"
    );
    assert!(
        rejected[1].reason.contains("--max-ipset-members"),
        "{rejected:?}"
    );
    let st = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    assert_eq!(st.objects.get("ipset"), Some(&3), "{:?}", st.objects);
    if dphandler_tests::kernel::nftables() {
        return Ok(()); // the sets are read with ipset below
    }
    let sets = ipsets(&ns)?;
    let mut ours: Vec<(&str, Vec<String>)> = sets
        .iter()
        .filter(|(n, _)| n.starts_with("dph40s:"))
        .map(|(n, s)| (n.as_str(), s.members.iter().cloned().collect()))
        .collect();
    ours.sort();
    assert_eq!(
        ours,
        [
            (
                "dph40s:a",
                vec!["10.0.0.1".to_string(), "10.0.0.5".to_string()]
            ),
            ("dph40s:b", vec!["10.0.0.2".to_string()]),
            ("dph40s:c", vec!["10.0.0.3".to_string()]),
        ]
    );
    Ok(())
}
