//! The container image (`Dockerfile`), checked without an image builder
//! (none here): the build stage is unprivileged and builds the binaries the
//! final stage copies; the final stage installs the package of every
//! program the daemon runs (by the names the code runs them under) and
//! starts the daemon.

use std::collections::BTreeSet;
use std::path::Path;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The programs `dphandler serve` runs, and the Debian package of each.
const RUNTIME: [(&str, &str); 6] = [
    ("iptables-restore", "iptables"),
    ("iptables-nft-save", "iptables"),
    ("iptables-legacy-save", "iptables"),
    ("ipset", "ipset"),
    ("modprobe", "kmod"),
    ("wireguard-go", "wireguard-go"),
];

/// Each program is one the code names (so the list cannot drift from
/// what the daemon runs without this test noticing).
#[test]
fn the_runtime_list_is_what_the_code_runs() {
    let read = |p: &str| std::fs::read_to_string(root().join(p)).unwrap();
    let code = [
        read("dataplane/src/backends/iptables/restore.rs"),
        read("dataplane/src/backends/ipsets/restore.rs"),
        read("dataplane/src/backends/sysctl.rs"),
        read("server/src/main.rs"),
    ]
    .join("\n");
    for (prog, _) in RUNTIME {
        let stem = prog
            .trim_end_matches("-save")
            .trim_end_matches("-restore")
            .trim_end_matches("-nft")
            .trim_end_matches("-legacy");
        assert!(
            code.contains(&format!("\"{stem}")),
            "{prog}: the code no longer names {stem:?}"
        );
    }
}

#[test]
fn the_dockerfile_builds_unprivileged_and_ships_what_the_daemon_runs() {
    let df = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    // The comments before the first FROM, then the stages.
    let stages: Vec<&str> = df.split("\nFROM ").collect();
    assert_eq!(stages.len(), 3, "a build stage and a run stage");
    let (build, run) = (stages[1], stages[2]);
    // Build: not as root, the two binaries, the locked dependencies.
    let user = build.find("\nUSER ").expect("a USER in the build stage");
    let cargo = build.find("cargo build").expect("cargo build");
    assert!(user < cargo, "cargo runs as the unprivileged user");
    for b in ["--locked", "--bin dphandler", "--bin dphctl"] {
        assert!(build.contains(b), "{b}");
    }
    // Run: the packages, the binaries only, the entrypoint.
    assert!(run.starts_with("debian:") && run.contains("slim"), "{run}");
    let install = run
        .lines()
        .find(|l| l.contains("apt-get install"))
        .expect("apt-get install");
    let pkgs: BTreeSet<&str> = install
        .split_whitespace()
        .filter(|w| !w.starts_with('-') && !["&&", "apt-get", "install"].contains(w))
        .collect();
    for (prog, pkg) in RUNTIME {
        assert!(pkgs.contains(pkg), "{prog} needs {pkg}: {pkgs:?}");
    }
    let copies: Vec<&str> = run.lines().filter(|l| l.starts_with("COPY")).collect();
    assert_eq!(copies.len(), 2, "{copies:?}");
    for b in ["dphandler", "dphctl"] {
        assert!(
            copies.iter().any(|c| c.contains("--from=build")
                && c.contains(&format!("/target/release/{b} /usr/local/bin/{b}"))),
            "{b}: {copies:?}"
        );
    }
    assert!(run.contains("ENTRYPOINT [\"/usr/local/bin/dphandler\", \"serve\"]"));
    let ignore = std::fs::read_to_string(root().join(".dockerignore")).unwrap();
    for p in ["target", ".tools"] {
        assert!(ignore.lines().any(|l| l == p), ".dockerignore: {p}");
    }
}
