//! `dphandler demo` end to end: sandbox namespace, real server, the bundled
//! scenario over gRPC, and the namespace gone afterwards. Needs root.

use std::process::Command;

use anyhow::Result;
use dphandler_tests::kernel;
use dphandler_tests::{bin, privileged};

/// The scenario's frontend set, with its two members, as the demo lists
/// the kernel's sets (nftables names an id nft cannot parse, `s:…`, by
/// its hash).
fn assert_frontend_set(stdout: &str) {
    assert!(
        if kernel::nftables() {
            stdout
                .lines()
                .any(|l| l.contains("dph40_") && l.contains("  2 members  ipv4_addr"))
        } else {
            stdout.contains("dph40s:frontend-pods        hash:ip       2 members")
        },
        "{stdout}"
    );
}

/// The namespace the demo named in its output is gone.
fn namespace_is_gone(stdout: &str) -> Result<()> {
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
    assert!(stdout.contains("programmed up to sequence 17"), "{stdout}");
    assert!(
        stdout.contains("sequence 9: ipset_update.members[1]"),
        "{stdout}"
    );
    assert!(stdout.contains("workload_endpoint     1"), "{stdout}");
    assert_frontend_set(&stdout);
    // Pod traffic between nodes: the VXLAN device, the other node's block
    // through its VTEP, this node's block as a blackhole.
    for want in [
        "vxlan id 4096 local 192.0.2.11 dev eth0",
        "unicast 10.65.1.0/26 via 10.65.1.0 dev vxlan.calico proto boot scope global onlink mtu 1450",
        "blackhole 10.65.0.0/26 proto 80",
        "10.65.1.0 lladdr 66:6a:00:00:00:02 PERMANENT",
        "66:6a:00:00:00:02 dst 192.0.2.12 self permanent",
    ] {
        assert!(stdout.contains(want), "{want:?} in {stdout}");
    }
    // The namespace it named is gone.
    namespace_is_gone(&stdout)
}

#[test]
fn demo_as_felix_goes_through_the_felix_driver() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let out = Command::new(bin("dphandler"))
        .args(["demo", "--via-felix-driver"])
        .env("DPH_LOG", "warn")
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("felix-driver (pid") && stdout.contains("on fds 3 and 4"),
        "{stdout}"
    );
    assert!(stdout.contains("DataplaneInSync on fd 4 after"), "{stdout}");
    // Felix numbers from 0: the invalid message is 8 here; the driver says
    // so on the stderr Felix copies into its log.
    assert!(
        stderr.contains("dphctl felix-driver: rejected: sequence 8: ipset_update.members[1]"),
        "{stderr}"
    );
    assert!(
        stdout.contains("\"workloadEndpointStatusUpdate\":{\"id\":{\"orchestratorId\":\"k8s\",\"workloadId\":\"shop/backend-0\""),
        "{stdout}"
    );
    assert_frontend_set(&stdout);
    assert!(stdout.contains("last programmed sequence 16"), "{stdout}");
    namespace_is_gone(&stdout)
}
