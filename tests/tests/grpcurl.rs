//! grpcurl 1.8.6 as a new user would run it: the README's grpcurl lines,
//! run as they stand (the socket path replaced by the test's), against a
//! real daemon in a namespace of the test's own. grpcurl comes from
//! `scripts/install-packages.sh` (`.tools/grpcurl`; `DPH_GRPCURL` to use
//! another). Needs root.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use dphandler_tests::{Daemon, Netns, privileged, tempdir};

fn grpcurl() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("DPH_GRPCURL") {
        return Some(p.into());
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/grpcurl/bin/grpcurl");
    if p.exists() {
        return Some(p);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must have grpcurl: scripts/install-packages.sh installs it"
    );
    eprintln!("skipped: grpcurl is not installed (bash scripts/install-packages.sh)");
    None
}

/// The README's grpcurl lines.
fn readme_lines() -> Result<Vec<String>> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))?;
    let lines: Vec<String> = readme
        .lines()
        .filter(|l| l.starts_with("grpcurl -"))
        .map(str::to_string)
        .collect();
    if lines.len() < 4 {
        bail!("the README shows {} grpcurl lines", lines.len());
    }
    Ok(lines)
}

#[test]
fn the_readmes_grpcurl_lines_work() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let Some(grpcurl) = grpcurl() else {
        return Ok(());
    };
    let dir = tempdir()?;
    let ns = Netns::new("gc")?;
    let socket = dir.path().join("dataplane.sock");
    let _d = Daemon::start(&ns, &socket, &["--hostname", "n1"])?;
    std::fs::write(
        dir.path().join("snapshot.ndjson"),
        "{\"sequenceNumber\":\"1\",\"ipsetUpdate\":{\"id\":\"s:web\",\"type\":\"NET\",\"members\":[\"10.0.0.0/24\"]}}\n\
         {\"sequenceNumber\":\"2\",\"inSync\":{}}\n",
    )?;
    // The socket appears once the daemon listens.
    for _ in 0..100 {
        if socket.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let mut outs = Vec::new();
    for line in readme_lines()? {
        let cmd = line
            .replacen("grpcurl", &grpcurl.display().to_string(), 1)
            .replace(
                "/run/dphandler/dataplane.sock",
                &socket.display().to_string(),
            );
        let out = Command::new("sh")
            .args(["-c", &cmd])
            .current_dir(dir.path())
            .output()
            .with_context(|| format!("running {cmd}"))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{line}\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        outs.push(text);
    }
    assert!(outs[0].contains("dphandler.v1.Dataplane"), "{}", outs[0]);
    assert!(outs[1].contains("rpc ToDataplane"), "{}", outs[1]);
    assert!(outs[2].contains("\"programmed\""), "{}", outs[2]);
    assert!(outs[3].contains("\"inSync\": true"), "{}", outs[3]);
    Ok(())
}
