//! An independent client: `buf curl`, which knows nothing of our .proto
//! files and learns the API through server reflection. Push a snapshot with
//! a bad message, see the rejection with its reason and the rest programmed,
//! see DataplaneInSync on StatusUpdates, and the health service. Needs root
//! and buf (`scripts/install-packages.sh` puts it in `.tools/`; `DPH_BUF`
//! overrides the path).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use dphandler_tests::{Daemon, Netns, privileged, tempdir};

fn buf() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("DPH_BUF") {
        return Some(p.into());
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/node_modules/.bin/buf");
    if p.exists() {
        return Some(p);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must have buf: scripts/install-packages.sh installs it"
    );
    eprintln!("skipped: buf is not installed (bash scripts/install-packages.sh)");
    None
}

fn curl(buf: &Path, socket: &Path, method: &str) -> Command {
    let mut c = Command::new(buf);
    c.args(["curl", "--protocol", "grpc", "--http2-prior-knowledge"])
        .arg("--unix-socket")
        .arg(socket)
        .arg(format!("http://localhost/{method}"));
    c
}

/// The JSON values buf prints, one after another.
fn values(out: &[u8]) -> Result<Vec<serde_json::Value>> {
    serde_json::Deserializer::from_slice(out)
        .into_iter()
        .map(|v| v.context("buf printed something that is not JSON"))
        .collect()
}

#[tokio::test]
async fn buf_curl_through_reflection() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let Some(buf) = buf() else { return Ok(()) };
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("buf")?;
    let d = Daemon::start(&ns, &socket, &[])?;
    d.connect().await?;

    // Reflection lists our service.
    let out = Command::new(&buf)
        .args([
            "curl",
            "--protocol",
            "grpc",
            "--http2-prior-knowledge",
            "--list-methods",
        ])
        .arg("--unix-socket")
        .arg(&socket)
        .arg("http://localhost")
        .output()?;
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for m in ["ToDataplane", "StatusUpdates", "GetStatus"] {
        assert!(
            list.contains(&format!("dphandler.v1.Dataplane/{m}")),
            "{list}"
        );
    }

    // A watcher first, so it sees the transition.
    let mut watch = curl(&buf, &socket, "dphandler.v1.Dataplane/StatusUpdates")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;

    // The bidirectional stream: three messages, the second invalid.
    let mut push = curl(&buf, &socket, "dphandler.v1.Dataplane/ToDataplane")
        .args(["-d", "@-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    push.stdin.take().unwrap().write_all(
        br#"{"sequenceNumber":"1","ipsetUpdate":{"id":"s:web","type":"NET","members":["10.0.0.0/24"]}}
{"sequenceNumber":"2","ipsetUpdate":{"id":"s:bad","members":["10.0.0.1/24"]}}
{"sequenceNumber":"3","inSync":{}}
"#,
    )?;
    let out = push.wait_with_output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let replies = values(&out.stdout)?;
    let rejected: Vec<_> = replies.iter().filter_map(|r| r.get("rejected")).collect();
    assert_eq!(rejected.len(), 1, "{replies:?}");
    assert_eq!(rejected[0]["sequenceNumber"], "2");
    assert_eq!(rejected[0]["field"], "ipset_update.members[0]");
    assert!(
        rejected[0]["reason"]
            .as_str()
            .unwrap()
            .contains("10.0.0.1/24"),
        "{replies:?}"
    );
    let programmed = replies
        .iter()
        .rev()
        .find_map(|r| r["programmed"]["sequenceNumber"].as_str());
    assert_eq!(programmed, Some("3"), "{replies:?}");

    // The watcher sees DataplaneInSync; then we end it (we started it).
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    let mut seen = String::new();
    let found = loop {
        let Some(line) = lines.next() else {
            break false;
        };
        seen.push_str(&line?);
        if seen.contains("dataplaneInSync") {
            break true;
        }
    };
    watch.kill()?;
    watch.wait()?;
    if !found {
        bail!("no DataplaneInSync on StatusUpdates: {seen}");
    }

    // GetStatus and health, also through buf.
    let out = curl(&buf, &socket, "dphandler.v1.Dataplane/GetStatus").output()?;
    let st = &values(&out.stdout)?[0];
    assert_eq!(st["inSync"], true, "{st}");
    assert_eq!(st["objects"]["ipset"], "1", "{st}");
    let out = curl(&buf, &socket, "grpc.health.v1.Health/Check").output()?;
    assert_eq!(values(&out.stdout)?[0]["status"], "SERVING");
    Ok(())
}
