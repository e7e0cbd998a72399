//! The prefilter against the kernel: two namespaces of the test's own
//! ("host" with the filter on its `eth0`, "client" on the other end of the
//! veth), a bpffs mounted on a temporary directory of the test's own.
//! Needs root; skipped otherwise.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use dphandler_bpf::{Filter, Mode};
use ipnet::IpNet;

fn privileged() -> bool {
    nix::unistd::Uid::effective().is_root()
}

struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Result<Self> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("dphx-{tag}{n}-{}", std::process::id());
        let st = Command::new("ip").args(["netns", "add", &name]).status()?;
        if !st.success() {
            bail!("ip netns add {name}");
        }
        Ok(Self(name))
    }

    fn run(&self, args: &[&str]) -> Result<Output> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.0])
            .args(args)
            .output()?;
        Ok(out)
    }

    fn ok(&self, args: &[&str]) -> Result<String> {
        let out = self.run(args)?;
        if !out.status.success() {
            bail!(
                "{args:?} in {}: {}",
                self.0,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn run_spawn(&self, args: &[&str]) -> Result<std::process::Child> {
        Ok(Command::new("ip")
            .args(["netns", "exec", &self.0])
            .args(args)
            .stdout(std::process::Stdio::piped())
            .spawn()?)
    }

    /// Runs `f` on a thread that has entered this namespace.
    fn inside<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).expect("the namespace exists");
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("the thread ran")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// A bpffs of the test's own, unmounted on drop.
struct Bpffs(tempfile::TempDir);

impl Bpffs {
    fn new() -> Result<Self> {
        let d = tempfile::tempdir()?;
        nix::mount::mount(
            Some("bpf"),
            d.path(),
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .context("mounting a bpffs")?;
        Ok(Self(d))
    }

    fn path(&self) -> PathBuf {
        self.0.path().to_path_buf()
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.0.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Host (10.88.0.1, fd00:88::1) and client (10.88.0.2 and .3, fd00:88::2)
/// joined by a veth pair, `eth0` on both sides.
fn pair() -> Result<(Netns, Netns)> {
    let host = Netns::new("h")?;
    let client = Netns::new("c")?;
    host.ok(&[
        "ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &client.0,
    ])?;
    for (ns, addrs) in [
        (&host, &["10.88.0.1/24", "fd00:88::1/64"][..]),
        (
            &client,
            &["10.88.0.2/24", "10.88.0.3/24", "fd00:88::2/64"][..],
        ),
    ] {
        ns.ok(&["ip", "link", "set", "lo", "up"])?;
        for a in addrs {
            ns.ok(&["ip", "addr", "add", a, "dev", "eth0", "nodad"])?;
        }
        ns.ok(&["ip", "link", "set", "eth0", "up"])?;
    }
    Ok((host, client))
}

fn ping(from: &Netns, src: &str, to: &str) -> bool {
    from.run(&["ping", "-c", "1", "-W", "0.5", "-I", src, to])
        .is_ok_and(|o| o.status.success())
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

#[test]
fn the_prefilter_drops_listed_sources_passes_failsafe_ports_and_survives_a_restart() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let fs = Bpffs::new()?;
    let (host, client) = pair()?;
    let bpffs = fs.path();

    // Attach in the driver (veth has native XDP).
    let b = bpffs.clone();
    let mut f = host.inside(move || Filter::attach(&b, "eth0", &[Mode::Driver, Mode::Generic]))?;
    assert_eq!(f.mode(), Mode::Driver);
    let link = host.ok(&["ip", "-d", "link", "show", "eth0"])?;
    assert!(link.contains("xdp"), "{link}");
    assert!(
        ping(&client, "10.88.0.2", "10.88.0.1"),
        "nothing listed yet"
    );

    // A listed source is dropped, by XDP, in both families; another
    // address of the same client passes; a failsafe port passes.
    f.set_failsafe(&[(6, 22)])?;
    f.update_blocklist(&[net("10.88.0.2/32"), net("fd00:88::2/128")], &[])?;
    let before = f.verdicts()?;
    assert!(!ping(&client, "10.88.0.2", "10.88.0.1"));
    assert!(!ping(&client, "fd00:88::2", "fd00:88::1"));
    assert!(ping(&client, "10.88.0.3", "10.88.0.1"));
    let after = f.verdicts()?;
    assert!(after.dropped.0 >= before.dropped.0 + 2, "{after:?}");
    assert!(after.passed.0 > before.passed.0, "{after:?}");
    let listener = host.inside(|| TcpListener::bind("10.88.0.1:22"))?;
    // From the listed address (the client's first): only the failsafe
    // entry lets it in.
    let ok = client.inside(|| {
        let to: SocketAddr = "10.88.0.1:22".parse().unwrap();
        TcpStream::connect_timeout(&to, Duration::from_secs(2)).is_ok()
    });
    drop(listener);
    assert!(ok, "a failsafe port reaches the host");
    assert!(f.verdicts()?.failsafe.0 > 0);
    assert_eq!(
        f.blocklist()?,
        [net("10.88.0.2/32"), net("fd00:88::2/128")].into()
    );

    // A restart: the daemon's objects go, the pinned link and maps stay;
    // the next run swaps its program in. A flood from the listed source
    // across it is dropped throughout.
    let flood = client.run_spawn(&[
        "ping",
        "-q",
        "-i",
        "0.01",
        "-c",
        "150",
        "-I",
        "10.88.0.2",
        "10.88.0.1",
    ])?;
    std::thread::sleep(Duration::from_millis(300));
    drop(f);
    let link = host.ok(&["ip", "-d", "link", "show", "eth0"])?;
    assert!(link.contains("xdp"), "detached with the daemon: {link}");
    let b = bpffs.clone();
    let mut f = host.inside(move || Filter::attach(&b, "eth0", &[Mode::Driver, Mode::Generic]))?;
    assert_eq!(f.mode(), Mode::Adopted);
    assert_eq!(f.blocklist()?.len(), 2, "the pinned maps were kept");
    let out = flood.wait_with_output()?;
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(summary.contains("100% packet loss"), "{summary}");

    // Unlisted: through at once. Detached: no XDP, no pins.
    f.update_blocklist(&[], &[net("10.88.0.2/32")])?;
    assert!(ping(&client, "10.88.0.2", "10.88.0.1"));
    let pins = f.pins().to_path_buf();
    f.detach()?;
    let link = host.ok(&["ip", "-d", "link", "show", "eth0"])?;
    assert!(!link.contains("prog/xdp"), "{link}");
    assert!(!pins.exists());
    assert!(ping(&client, "fd00:88::2", "fd00:88::1"));
    Ok(())
}

#[test]
fn an_interface_without_xdp_in_the_asked_modes_is_refused_with_the_reason() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let fs = Bpffs::new()?;
    let (host, _client) = pair()?;
    let b = fs.path();
    // The loopback device has no native XDP: driver mode alone fails.
    let e = host
        .inside(move || Filter::attach(&b, "lo", &[Mode::Driver]))
        .expect_err("lo takes no native XDP");
    assert!(!e.retryable(), "{e}");
    assert!(e.to_string().contains("driver"), "{e}");
    let link = host.ok(&["ip", "-d", "link", "show", "lo"])?;
    assert!(!link.contains("prog/xdp"), "{link}");
    Ok(())
}

#[test]
fn the_committed_object_is_the_sources_build() -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let clang = Command::new("clang").arg("--version").output();
    let Ok(clang) = clang else {
        eprintln!("no clang: the committed object is not compared");
        return Ok(());
    };
    let version = String::from_utf8_lossy(&clang.stdout);
    let version = version.lines().next().unwrap_or_default();
    let built_with = std::fs::read_to_string(root.join("filter.o.clang"))?;
    if version != built_with.trim() || !Path::new("/usr/include/bpf/bpf_helpers.h").exists() {
        eprintln!(
            "{version:?} (built with {built_with:?}) or no libbpf-dev: the committed object is not compared"
        );
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("filter.o");
    let st = Command::new("bash")
        .arg(root.join("build.sh"))
        .arg(&out)
        .status()?;
    assert!(st.success(), "build.sh failed");
    let built = std::fs::read(&out)?;
    let committed = std::fs::read(root.join("filter.o"))?;
    assert!(
        built == committed,
        "bpf/filter.o is not what src/filter.c builds to: run bpf/build.sh and commit filter.o"
    );
    Ok(())
}
