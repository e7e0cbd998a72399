//! Helpers for the privileged end-to-end tests in `tests/tests/`.
//!
//! Every test that needs root creates its own network namespaces (unique
//! names, removed when the guard drops, also when the test fails), runs the
//! real `dphandler` inside one of them and ends it by PID. Nothing here
//! changes the host's own namespace, and traffic only ever goes to loopback or
//! to addresses inside the test's namespaces.
//!
//! The binaries are looked up next to the test executable
//! (`target/<profile>/`): `cargo build --workspace --bins` (which `.ci/run`
//! does) builds them. `DPH_TEST_BIN_DIR` overrides the directory.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

pub mod calico;
pub mod cluster;
pub mod differential;
pub mod kernel;
pub mod lab;
pub mod tls;
pub mod traffic;

use anyhow::{Context, Result, bail};
use dphandler_proto::felix::{self, to_dataplane::Payload};
use dphandler_proto::v1::dataplane_client::DataplaneClient;
use tonic::transport::Channel;

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

/// Path of one of the workspace's binaries (`dphandler`, `dphctl`), built in
/// the same profile as the caller.
pub fn bin(name: &str) -> PathBuf {
    let dirs: Vec<PathBuf> = match std::env::var_os("DPH_TEST_BIN_DIR") {
        Some(d) => vec![PathBuf::from(d)],
        None => {
            // A test runs from target/<profile>/deps/, a benchmark program
            // from target/<profile>/.
            let exe = std::env::current_exe().expect("we know our own path");
            let dir = exe.parent().expect("an executable is in a directory");
            [Some(dir), dir.parent()]
                .into_iter()
                .flatten()
                .map(Path::to_path_buf)
                .collect()
        }
    };
    dirs.iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("{name} is not in {dirs:?}: run `cargo build --workspace --bins` first")
        })
}

/// A network namespace of the test's own, deleted on drop.
#[derive(Debug)]
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
            bail!("ip netns add {name} failed");
        }
        Ok(Self(name))
    }

    /// A command that runs `program` inside the namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0]).arg(program);
        c
    }

    /// Runs a command in the namespace and returns its output, failing with
    /// its stderr if it fails.
    pub fn run(&self, program: &str, args: &[&str]) -> Result<Output> {
        let out = self.command(program).args(args).output()?;
        if !out.status.success() {
            bail!(
                "{program} {args:?} in {}: {}",
                self.0,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(out)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// A client of the daemon's gRPC service.
pub type Client = DataplaneClient<Channel>;

/// A `dphandler serve` we started, ended by PID (SIGTERM) on drop.
#[derive(Debug)]
pub struct Daemon {
    child: Child,
    pub socket: PathBuf,
}

impl Daemon {
    /// Starts `dphandler serve --socket <socket> <extra>` inside `ns`.
    pub fn start(ns: &Netns, socket: &Path, extra: &[&str]) -> Result<Self> {
        Self::start_env(ns, socket, extra, &[])
    }

    /// [`Daemon::start`] with more environment variables.
    pub fn start_env(
        ns: &Netns,
        socket: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let mut cmd = ns.command(bin("dphandler"));
        cmd.args(["serve", "--socket"]).arg(socket);
        // State (WireGuard keys, a ConfigUpdate's restart keys) beside the
        // socket, never in the host's /var/lib/dphandler.
        if !extra.contains(&"--state-dir") {
            let name = socket.file_name().unwrap_or_default().to_string_lossy();
            cmd.arg("--state-dir")
                .arg(socket.with_file_name(format!("{name}.state")));
        }
        cmd.args(extra)
            .envs(env.iter().copied())
            .env("DPH_LOG", std::env::var("DPH_LOG").unwrap_or("info".into()));
        Self::spawn(cmd, socket)
    }

    /// Starts a `dphandler` command built by the caller (e.g. with only
    /// the environment a Helm-rendered pod would have) that serves on
    /// `socket`.
    pub fn spawn(mut cmd: Command, socket: &Path) -> Result<Self> {
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawning dphandler")?;
        Ok(Self {
            child,
            socket: socket.to_path_buf(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn stop(mut self) -> Result<std::process::ExitStatus> {
        self.terminate();
        Ok(self.child.wait()?)
    }

    fn terminate(&mut self) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pid fits"));
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    }

    /// Waits until the daemon answers on its socket.
    pub async fn connect(&self) -> Result<DataplaneClient<Channel>> {
        connect(&self.socket).await
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.terminate();
            let _ = self.child.wait();
        }
    }
}

/// Connects to the socket, retrying while the server comes up (10 s).
pub async fn connect(socket: &Path) -> Result<DataplaneClient<Channel>> {
    let mut last = None;
    for _ in 0..200 {
        if socket.exists() {
            match dphandler_proto::client::connect_unix(socket).await {
                Ok(c) => return Ok(c),
                Err(e) => last = Some(e),
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("server did not come up on {}: {last:?}", socket.display())
}

/// A numbered message.
pub fn msg(seq: u64, p: Payload) -> felix::ToDataplane {
    felix::ToDataplane {
        sequence_number: seq,
        payload: Some(p),
    }
}

/// An IP set of type IP.
pub fn ipset(id: &str, members: &[&str]) -> Payload {
    Payload::IpsetUpdate(felix::IpSetUpdate {
        id: id.into(),
        members: members.iter().map(|s| s.to_string()).collect(),
        r#type: felix::ip_set_update::IpSetType::Ip as i32,
    })
}

/// InSync.
pub fn in_sync() -> Payload {
    Payload::InSync(felix::InSync {})
}

/// A temporary directory for sockets and files.
pub fn tempdir() -> Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new().prefix("dph-test-").tempdir()?)
}

/// Sends `msgs` on one ToDataplane stream and reads the replies until the
/// server ends the stream (everything accepted is programmed). Returns the
/// rejections and the highest sequence number programmed.
pub async fn push(
    client: &mut DataplaneClient<Channel>,
    msgs: Vec<felix::ToDataplane>,
) -> Result<(Vec<dphandler_proto::v1::Rejection>, u64)> {
    use dphandler_proto::v1::to_dataplane_reply::Kind;
    let mut replies = client
        .to_dataplane(tokio_stream::iter(msgs))
        .await?
        .into_inner();
    let (mut rejected, mut programmed) = (Vec::new(), 0);
    while let Some(r) = tokio::time::timeout(Duration::from_secs(30), replies.message()).await?? {
        match r.kind {
            Some(Kind::Rejected(r)) => rejected.push(r),
            Some(Kind::Programmed(p)) => programmed = p.sequence_number,
            _ => {}
        }
    }
    Ok((rejected, programmed))
}

/// An IP set of the given type.
pub fn ipset_of(id: &str, ty: felix::ip_set_update::IpSetType, members: &[&str]) -> Payload {
    Payload::IpsetUpdate(felix::IpSetUpdate {
        id: id.into(),
        members: members.iter().map(|s| s.to_string()).collect(),
        r#type: ty as i32,
    })
}

/// A set as `ipset save` shows it: its `create` line and its members.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedSet {
    pub create: String,
    pub members: std::collections::BTreeSet<String>,
}

impl SavedSet {
    /// The `maxelem` of the create line.
    pub fn maxelem(&self) -> Option<u64> {
        let mut w = self.create.split_whitespace();
        while let Some(x) = w.next() {
            if x == "maxelem" {
                return w.next()?.parse().ok();
            }
        }
        None
    }

    /// The `initval` of the create line: it changes only when the set is
    /// created anew.
    pub fn initval(&self) -> Option<String> {
        let mut w = self.create.split_whitespace();
        while let Some(x) = w.next() {
            if x == "initval" {
                return w.next().map(str::to_string);
            }
        }
        None
    }

    /// The set's type (`hash:ip`, …).
    pub fn set_type(&self) -> &str {
        self.create.split_whitespace().nth(2).unwrap_or_default()
    }
}

/// `ipset save` in the namespace, by set name.
pub fn ipsets(ns: &Netns) -> Result<std::collections::BTreeMap<String, SavedSet>> {
    let out = ns.run("ipset", &["save"])?;
    let mut sets = std::collections::BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let mut w = line.split_whitespace();
        match (w.next(), w.next()) {
            (Some("create"), Some(name)) => {
                sets.insert(
                    name.to_string(),
                    SavedSet {
                        create: line.to_string(),
                        members: Default::default(),
                    },
                );
            }
            (Some("add"), Some(name)) => {
                if let Some(s) = sets.get_mut(name) {
                    s.members.insert(w.collect::<Vec<_>>().join(" "));
                }
            }
            _ => {}
        }
    }
    Ok(sets)
}

/// Polls `until` every 50 ms for up to `secs` seconds.
pub async fn eventually(secs: u64, mut until: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if until()? {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            bail!("condition not met within {secs} s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends `msgs` on one ToDataplane stream and returns once the server has
/// validated them all (its `Received`), without waiting for them to be
/// programmed. Returns the rejections.
pub async fn send_only(
    client: &mut DataplaneClient<Channel>,
    msgs: Vec<felix::ToDataplane>,
) -> Result<Vec<dphandler_proto::v1::Rejection>> {
    use dphandler_proto::v1::to_dataplane_reply::Kind;
    let mut replies = client
        .to_dataplane(tokio_stream::iter(msgs))
        .await?
        .into_inner();
    let mut rejected = Vec::new();
    while let Some(r) = tokio::time::timeout(Duration::from_secs(30), replies.message()).await?? {
        match r.kind {
            Some(Kind::Rejected(r)) => rejected.push(r),
            Some(Kind::Received(_)) => return Ok(rejected),
            _ => {}
        }
    }
    bail!("the stream ended before Received")
}

/// Peak RSS (VmHWM, KiB) and CPU seconds (user + system) of a process.
pub fn usage(pid: u32) -> Result<(u64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let hwm = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("VmHWM in /proc/<pid>/status")?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may contain spaces) start at 3.
    let rest = stat.rsplit_once(')').context("/proc/<pid>/stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    // USER_HZ is 100 on every Linux architecture we run on.
    Ok((hwm, ticks as f64 / 100.0))
}

/// One long-lived ToDataplane stream, as a calc graph keeps open: messages
/// numbered in order, and each `Programmed` reply waited for (benchmarks
/// time changes with it).
#[derive(Debug)]
pub struct Feed {
    tx: tokio::sync::mpsc::UnboundedSender<felix::ToDataplane>,
    replies: tonic::Streaming<dphandler_proto::v1::ToDataplaneReply>,
    seq: u64,
    /// The highest sequence number reported programmed so far.
    pub programmed: u64,
}

impl Feed {
    /// Opens the stream.
    pub async fn open(client: &mut DataplaneClient<Channel>) -> Result<Self> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let replies = client
            .to_dataplane(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(Self {
            tx,
            replies,
            seq: 0,
            programmed: 0,
        })
    }

    /// Sends one message; returns its sequence number.
    pub fn send(&mut self, p: Payload) -> Result<u64> {
        self.seq += 1;
        self.tx
            .send(felix::ToDataplane {
                sequence_number: self.seq,
                payload: Some(p),
            })
            .map_err(|_| anyhow::anyhow!("the stream is closed"))?;
        Ok(self.seq)
    }

    /// The next Programmed reply (sequence number, when it arrived); a
    /// rejection is an error.
    pub async fn next_programmed(
        &mut self,
        timeout: Duration,
    ) -> Result<(u64, std::time::Instant)> {
        use dphandler_proto::v1::to_dataplane_reply::Kind;
        loop {
            let r = tokio::time::timeout(timeout, self.replies.message())
                .await
                .context("waiting for the server")??
                .context("the reply stream ended")?;
            match r.kind {
                Some(Kind::Programmed(p)) => {
                    self.programmed = p.sequence_number;
                    return Ok((p.sequence_number, std::time::Instant::now()));
                }
                Some(Kind::Rejected(r)) => {
                    bail!("rejected: {} {}: {}", r.sequence_number, r.field, r.reason)
                }
                _ => {}
            }
        }
    }

    /// Waits until `seq` is programmed; returns when that was seen.
    pub async fn until(&mut self, seq: u64, timeout: Duration) -> Result<std::time::Instant> {
        loop {
            let (s, at) = self.next_programmed(timeout).await?;
            if s >= seq {
                return Ok(at);
            }
        }
    }
}
