//! `dphctl push`, `watch` and `status` against the real server in a namespace
//! of its own, over the unix socket. Needs root.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use anyhow::Result;
use dphandler_tests::{Daemon, Netns, bin, privileged, tempdir};

fn dphctl(socket: &std::path::Path, args: &[&str], stdin: Option<&str>) -> Result<Output> {
    let mut child = Command::new(bin("dphctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut input = child.stdin.take().expect("piped");
    input.write_all(stdin.unwrap_or("").as_bytes())?;
    drop(input);
    Ok(child.wait_with_output()?)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test]
async fn push_watch_status() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("ctl")?;
    let d = Daemon::start(&ns, &socket, &[])?;
    d.connect().await?;

    // Before any InSync nothing is programmed: push says so (exit 4) rather
    // than waiting forever.
    let out = dphctl(
        &socket,
        &["push", "-"],
        Some(r#"{"ipsetUpdate":{"id":"s:early","members":["10.1.0.1"]}}"#),
    )?;
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("InSync"),
        "{}",
        text(&out.stderr)
    );

    // A watcher started now sees DataplaneInSync once the snapshot is in.
    let watcher = Command::new(bin("dphctl"))
        .arg("--socket")
        .arg(&socket)
        .args(["watch", "--json", "--until-in-sync"])
        .stdout(Stdio::piped())
        .spawn()?;

    // The bundled demo scenario (YAML) with one bad message: exit 3, the
    // reason names the field, the rest is programmed.
    let scenario = concat!(env!("CARGO_MANIFEST_DIR"), "/../server/scenarios/demo.yaml");
    let out = dphctl(&socket, &["push", scenario], None)?;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("ipset_update.members[1]") && stderr.contains("not-an-ip"),
        "{stderr}"
    );
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("1 rejected") && stdout.contains("programmed up to sequence 17"),
        "{stdout}"
    );

    let w = watcher.wait_with_output()?;
    assert!(w.status.success());
    // Endpoint status may come first; DataplaneInSync ends the watch.
    let lines: Vec<serde_json::Value> = text(&w.stdout)
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(
        lines.last(),
        Some(&serde_json::json!({"update": {"dataplaneInSync": {}}})),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l["update"]["workloadEndpointStatusUpdate"]["status"]["status"] == "down"),
        "the demo's workload has no interface here, so it is down: {lines:?}"
    );

    // status --json: in sync, sequence 17, objects by kind.
    let out = dphctl(&socket, &["status", "--json"], None)?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let st: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(st["inSync"], true, "{st}");
    assert_eq!(st["lastProgrammedSequence"], "17", "{st}");
    assert_eq!(st["objects"]["ipset"], "3", "{st}");
    assert_eq!(st["objects"]["policy"], "1", "{st}");
    assert_eq!(st["objects"]["workload_endpoint"], "1", "{st}");

    // NDJSON delta after sync: exit 0 and programmed. The human status says so.
    let out = dphctl(
        &socket,
        &["push", "-"],
        Some(
            "{\"sequenceNumber\":\"20\",\"ipsetRemove\":{\"id\":\"s:allowed-nets\"}}\n\
             {\"ipsetRemove\":{\"id\":\"s:frontend-pods\"}}\n",
        ),
    )?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("programmed up to sequence 21"),
        "{}",
        text(&out.stdout)
    );
    let out = dphctl(&socket, &["status"], None)?;
    let table = text(&out.stdout);
    assert!(table.contains("in sync:                  yes"), "{table}");
    assert!(table.contains("last programmed sequence: 21"), "{table}");
    assert!(table.contains("  ipset                   1"), "{table}");

    // Bad input: a clear error naming the message, and nothing is sent.
    let out = dphctl(
        &socket,
        &["push", "-"],
        Some("{\"inSync\":{}}\n{\"nope\":1}\n"),
    )?;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("message 2"),
        "{}",
        text(&out.stderr)
    );
    let out = dphctl(&socket, &["status", "--json"], None)?;
    let st: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(st["lastProgrammedSequence"], "21", "{st}");

    // --in-sync replaces the state with the file's (a new snapshot).
    let out = dphctl(
        &socket,
        &["push", "--in-sync", "-"],
        Some("ipsetUpdate: {id: s:only, type: NET, members: [10.9.0.0/16]}\n"),
    )?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = dphctl(&socket, &["status", "--json"], None)?;
    let st: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(st["objects"]["ipset"], "1", "{st}");
    assert!(st["objects"].get("policy").is_none(), "{st}");

    // No server: a clear connection error.
    let out = dphctl(&dir.path().join("absent.sock"), &["status"], None)?;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("absent.sock"),
        "{}",
        text(&out.stderr)
    );
    d.stop()?;
    Ok(())
}

#[tokio::test]
async fn large_push_is_paced_not_dropped() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("ctlbig")?;
    let d = Daemon::start(&ns, &socket, &[])?;
    d.connect().await?;
    // 20,000 messages (far more than the feed channel holds) as NDJSON.
    let mut input = String::new();
    for i in 0..20_000 {
        input.push_str(&format!(
            "{{\"ipsetUpdate\":{{\"id\":\"s:n{}\",\"members\":[\"10.{}.{}.1\"]}}}}\n",
            i % 500,
            i % 200,
            i % 250
        ));
    }
    input.push_str("{\"inSync\":{}}\n");
    let out = dphctl(&socket, &["push", "-"], Some(&input))?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("20001 messages sent, 20001 accepted"),
        "{}",
        text(&out.stdout)
    );
    let out = dphctl(&socket, &["status", "--json"], None)?;
    let st: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(st["lastProgrammedSequence"], "20001", "{st}");
    assert_eq!(st["objects"]["ipset"], "500", "{st}");
    Ok(())
}
