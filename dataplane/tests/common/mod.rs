//! What the dataplane's kernel tests share: a network namespace of the
//! test's own (unique name, removed on drop, also when the test fails),
//! commands and closures run inside it, and the root check.

#![allow(
    dead_code,
    reason = "each test file is its own crate and uses some of these helpers"
)]

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result, bail};

/// A network namespace of the test's own.
pub struct Netns(pub String);

impl Netns {
    /// Creates `dph-<tag>-<pid>-<n>`.
    pub fn new(tag: &str) -> Result<Self> {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "dph-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let st = Command::new("ip").args(["netns", "add", &name]).status()?;
        if !st.success() {
            bail!("ip netns add {name}");
        }
        Ok(Self(name))
    }

    /// `ip -n <ns> <args>`: its output, or its error.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let mut full = vec!["-n", self.0.as_str()];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    /// `args[0] args[1..]` inside the namespace: its output, or its error.
    pub fn exec(&self, args: &[&str]) -> Result<String> {
        let mut full = vec!["netns", "exec", self.0.as_str()];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    /// Runs `f` on a thread inside the namespace (sockets opened there stay
    /// bound to it).
    pub fn within<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let file = std::fs::File::open(format!("/run/netns/{}", self.0)).expect("netns file");
        std::thread::spawn(move || {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("thread")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Runs `cmd args`: its output, or an error with what it printed.
pub fn run(cmd: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("spawning {cmd}"))?;
    if !out.status.success() {
        bail!("{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// True when the test may go on: we are root. Without root the test is
/// skipped, except under CI (`CI` set), where that is a failure.
pub fn privileged() -> bool {
    if nix::unistd::Uid::effective().is_root() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must run the privileged tests as root"
    );
    eprintln!("skipped: needs root");
    false
}
