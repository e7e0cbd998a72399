//! `dphandler demo` end to end: sandbox namespace, real server, the bundled
//! scenario over gRPC, and the namespace gone afterwards. Needs root.

use std::process::Command;

use anyhow::Result;
use dphandler_tests::{bin, privileged};

#[test]
fn demo_runs_in_a_sandbox_and_cleans_up() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let out = Command::new(bin("dphandler"))
        .arg("demo")
        .env("DPH_LOG", "warn")
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("DataplaneInSync after"), "{stdout}");
    assert!(stdout.contains("programmed up to sequence 11"), "{stdout}");
    assert!(
        stdout.contains("sequence 9: ipset_update.members[1]"),
        "{stdout}"
    );
    assert!(stdout.contains("workload_endpoint     1"), "{stdout}");
    assert!(
        stdout.contains("dph40s:frontend-pods        hash:ip       2 members"),
        "{stdout}"
    );
    // The namespace it named is gone.
    let ns = stdout
        .split_whitespace()
        .find(|w| w.starts_with("dph-demo-"))
        .expect("the demo names its namespace")
        .trim_end_matches(';');
    let list = Command::new("ip").args(["netns", "list"]).output()?;
    assert!(
        !String::from_utf8_lossy(&list.stdout).contains(ns),
        "{ns} was not removed"
    );
    Ok(())
}
