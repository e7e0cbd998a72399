//! A real Calico beside the daemon: etcd, calicoctl and Felix, built from
//! the Go module proxy by `scripts/calico.sh` (cached under
//! `.tools/calico/<version>/bin`), each run inside the test's own
//! namespace and ended by its PID.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::Netns;

fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the project")
        .to_path_buf()
}

/// One Calico version the script built.
#[derive(Debug, Clone)]
pub struct Calico {
    pub label: String,
    pub bin: PathBuf,
}

/// What `scripts/calico.sh` built: `Ok(None)` only where there is no Go
/// toolchain (the tests then say they were skipped); a version the proxy
/// refused is named on stderr with the proxy's answer.
pub fn versions() -> Result<Option<Vec<Calico>>> {
    static BUILT: OnceLock<std::result::Result<Option<Vec<Calico>>, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| build().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow::anyhow!(e))
}

fn build() -> Result<Option<Vec<Calico>>> {
    if Command::new("go").arg("version").output().is_err() {
        return Ok(None);
    }
    let root = project_root();
    let st = Command::new("bash")
        .arg(root.join("scripts/calico.sh"))
        .current_dir(&root)
        .status()
        .context("running scripts/calico.sh")?;
    let tools = root.join(".tools/calico");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&tools).with_context(|| format!("reading {}", tools.display()))? {
        let dir = e?.path();
        let label = dir.file_name().unwrap().to_string_lossy().into_owned();
        if dir.join("stamp").exists() {
            out.push(Calico {
                label,
                bin: dir.join("bin"),
            });
        } else if let Ok(why) = std::fs::read_to_string(dir.join("refused")) {
            eprintln!("Calico {label}: not tested: the module proxy refused it: {why}");
        }
    }
    if !st.success() || out.is_empty() {
        bail!("scripts/calico.sh built no Calico ({st})");
    }
    out.sort_by(|a, b| a.label.cmp(&b.label));
    Ok(Some(out))
}

/// A process of ours in a namespace, ended (SIGTERM, then SIGKILL after
/// 5 s) by its PID when dropped; its output in a log file.
#[derive(Debug)]
pub struct Proc {
    child: Option<Child>,
    pub log: PathBuf,
    name: &'static str,
}

impl Proc {
    pub fn spawn(name: &'static str, mut cmd: Command, log: PathBuf) -> Result<Self> {
        let f = std::fs::File::create(&log)?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Self {
            child: Some(child),
            log,
            name,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Whether it has exited (and how).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// The last `lines` lines of its log.
    pub fn tail(&self, lines: usize) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let v: Vec<&str> = s.lines().collect();
        format!(
            "--- last lines of {} ({}) ---\n{}",
            self.name,
            self.log.display(),
            v[v.len().saturating_sub(lines)..].join("\n")
        )
    }

    /// SIGKILL (as a crash or the OOM killer ends it); its exit status.
    pub fn kill(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let _ = child.kill();
        child.wait().ok()
    }

    /// Waits up to `secs` for it to exit by itself.
    pub fn wait_exit(&mut self, secs: u64) -> Option<std::process::ExitStatus> {
        let until = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < until {
            if let Some(st) = self.exited() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Whether its log holds `text`.
    pub fn logged(&self, text: &str) -> bool {
        std::fs::read_to_string(&self.log).is_ok_and(|l| l.contains(text))
    }

    /// SIGTERM, then SIGKILL if it has not ended within 5 s.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).ok()?);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if let Ok(Some(st)) = child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        child.wait().ok()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs `test` against every Calico version built; skipped, saying so,
/// only without root or without Go.
pub fn each_version(test: fn(&Calico) -> Result<()>) -> Result<()> {
    if !crate::privileged() {
        return Ok(());
    }
    let Some(versions) = versions()? else {
        eprintln!("SKIPPED: no Go toolchain: Calico cannot be built (scripts/calico.sh)");
        return Ok(());
    };
    for c in &versions {
        test(c)?;
    }
    Ok(())
}

/// Waits until `cond` holds, up to `secs`, trying every 20 ms; the time
/// it took.
pub fn until(secs: u64, what: &str, cond: impl FnMut() -> bool) -> Result<Duration> {
    until_every(secs, Duration::from_millis(20), what, cond)
}

/// [`until`], trying every `every` (a benchmark's timing wants finer).
pub fn until_every(
    secs: u64,
    every: Duration,
    what: &str,
    mut cond: impl FnMut() -> bool,
) -> Result<Duration> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(secs) {
        if cond() {
            return Ok(start.elapsed());
        }
        std::thread::sleep(every);
    }
    bail!("{what}: not within {secs} s")
}

/// The daemon's rejection counter (its metrics, 127.0.0.1:9191 in `ns`).
pub fn rejections(ns: &Netns) -> Result<f64> {
    Ok(crate::lab::scrape(ns, 9191)?
        .get("dphandler_grpc_rejections_total")
        .copied()
        .unwrap_or(0.0))
}

/// etcd on the namespace's loopback (127.0.0.1:2379), its data in `dir`.
pub fn etcd(c: &Calico, ns: &Netns, dir: &Path) -> Result<Proc> {
    etcd_on(c, ns, dir, None)
}

/// [`etcd`], also listening on `addr` (port 2379) for other namespaces.
pub fn etcd_on(c: &Calico, ns: &Netns, dir: &Path, addr: Option<&str>) -> Result<Proc> {
    let mut cmd = ns.command(c.bin.join("etcd"));
    let (listen, advertise) = match addr {
        Some(a) => (
            format!("http://127.0.0.1:2379,http://{a}:2379"),
            format!("http://{a}:2379"),
        ),
        None => (
            "http://127.0.0.1:2379".into(),
            "http://127.0.0.1:2379".into(),
        ),
    };
    cmd.args([
        "--name",
        "dphandler-test",
        "--listen-client-urls",
        &listen,
        "--advertise-client-urls",
        &advertise,
        "--listen-peer-urls",
        "http://127.0.0.1:2380",
        "--initial-advertise-peer-urls",
        "http://127.0.0.1:2380",
        "--initial-cluster",
        "dphandler-test=http://127.0.0.1:2380",
        "--log-level",
        "warn",
        "--data-dir",
    ])
    .arg(dir.join("etcd"));
    let p = Proc::spawn("etcd", cmd, dir.join("etcd.log"))?;
    // Ready when calicoctl can read from it.
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        if calicoctl(c, ns, &["get", "nodes"]).is_ok() {
            return Ok(p);
        }
        if Instant::now() > until {
            bail!("etcd did not answer within 20 s\n{}", p.tail(20));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Runs calicoctl against the namespace's etcd; its stdout.
pub fn calicoctl(c: &Calico, ns: &Netns, args: &[&str]) -> Result<String> {
    let out = ns
        .command(c.bin.join("calicoctl"))
        .args(args)
        .env("DATASTORE_TYPE", "etcdv3")
        .env("ETCD_ENDPOINTS", "http://127.0.0.1:2379")
        .output()
        .context("running calicoctl")?;
    if !out.status.success() {
        bail!(
            "calicoctl {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Calico's IPAM client (our helper, `tests/calico/ipam`) assigns `ip`
/// to `host`, claiming its block for the host if it has none yet (as the
/// CNI plugin and calico-node do); `use_` is `workload` or `tunnel`.
pub fn ipam_assign(c: &Calico, ns: &Netns, ip: &str, host: &str, use_: &str) -> Result<()> {
    let handle = format!("dphandler-test-{host}-{ip}").replace([':', '/'], "-");
    let out = ns
        .command(c.bin.join("ipam"))
        .args(["assign", ip, host, &handle, use_])
        .env("DATASTORE_TYPE", "etcdv3")
        .env("ETCD_ENDPOINTS", "http://127.0.0.1:2379")
        .output()
        .context("running the ipam helper")?;
    if !out.status.success() {
        bail!(
            "ipam assign {ip} {host}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// `calicoctl delete` of the resources `yaml` names.
pub fn delete(c: &Calico, ns: &Netns, dir: &Path, yaml: &str) -> Result<()> {
    let f = dir.join("delete.yaml");
    std::fs::write(&f, yaml)?;
    calicoctl(c, ns, &["delete", "-f", &f.to_string_lossy()]).map(drop)
}

/// `calicoctl apply` of YAML resources (one or more documents).
pub fn apply(c: &Calico, ns: &Netns, dir: &Path, yaml: &str) -> Result<()> {
    let f = dir.join("apply.yaml");
    std::fs::write(&f, yaml)?;
    calicoctl(c, ns, &["apply", "-f", &f.to_string_lossy()]).map(drop)
}

/// Felix as calico-node runs it, with our driver as its external
/// dataplane (`driver`: the `dphandler-felix-driver` symlink), speaking to
/// the daemon at `socket`.
pub fn felix(
    c: &Calico,
    ns: &Netns,
    dir: &Path,
    hostname: &str,
    driver: &Path,
    socket: &Path,
    extra_env: &[(&str, &str)],
) -> Result<Proc> {
    let mut cmd = felix_command(c, ns, dir, hostname);
    cmd.env("FELIX_USEINTERNALDATAPLANEDRIVER", "false")
        .env("FELIX_DATAPLANEDRIVER", driver)
        .env("DPH_SOCKET", socket)
        .envs(extra_env.iter().copied());
    Proc::spawn("calico-felix", cmd, felix_log(dir, hostname))
}

/// Felix with its own dataplane (what a Calico node runs today), in `ns`:
/// the oracle of the differential test. Its start would call a libbpf stub
/// that panics in a build without cgo (`bpfnat.RemoveConnectTimeLoadBalancer`);
/// `FELIX_DebugSkipCTLBCleanup` skips it. Pin `FELIX_NFTABLESMODE` in
/// `extra_env`.
pub fn felix_internal(
    c: &Calico,
    ns: &Netns,
    dir: &Path,
    hostname: &str,
    extra_env: &[(&str, &str)],
) -> Result<Proc> {
    let mut cmd = felix_command(c, ns, dir, hostname);
    cmd.env("FELIX_USEINTERNALDATAPLANEDRIVER", "true")
        .env("FELIX_DebugSkipCTLBCleanup", "true")
        .envs(extra_env.iter().copied());
    Proc::spawn("calico-felix", cmd, felix_log(dir, hostname))
}

/// Who programs the kernel under a real Felix: Felix's own dataplane or
/// dphandler behind it, each with iptables or nftables (the differential
/// test and the side-by-side benchmark run the four in turn).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// (a) Felix's internal dataplane, iptables mode.
    FelixIptables,
    /// (b) Felix's internal dataplane, nftables mode.
    FelixNftables,
    /// (c) Felix → dphandler, `--dataplane iptables`.
    OursIptables,
    /// (d) Felix → dphandler, `--dataplane nftables`.
    OursNftables,
}

impl Mode {
    /// Modes by their letters (`abcd`), in the order given.
    pub fn parse_list(letters: &str) -> Result<Vec<Self>> {
        letters
            .chars()
            .map(|c| {
                Ok(match c {
                    'a' => Self::FelixIptables,
                    'b' => Self::FelixNftables,
                    'c' => Self::OursIptables,
                    'd' => Self::OursNftables,
                    _ => bail!("{c:?} is not a mode (a–d)"),
                })
            })
            .collect()
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::FelixIptables => "(a) Felix, iptables",
            Self::FelixNftables => "(b) Felix, nftables",
            Self::OursIptables => "(c) Felix → dphandler, iptables",
            Self::OursNftables => "(d) Felix → dphandler, nftables",
        }
    }

    /// Whether dphandler programs the kernel (Felix with our driver).
    pub fn ours(self) -> bool {
        matches!(self, Self::OursIptables | Self::OursNftables)
    }

    /// The daemon's `--dataplane`, for our modes.
    pub fn dataplane(self) -> Option<&'static str> {
        match self {
            Self::OursIptables => Some("iptables"),
            Self::OursNftables => Some("nftables"),
            _ => None,
        }
    }

    /// Felix's settings for the mode: its nftables mode pinned (any mode
    /// but Disabled changes the IP-set messages of the calc graph), and
    /// Felix's own iptables on the same backend as the daemon's (the
    /// system's `iptables`, nf_tables; auto picks legacy in a fresh
    /// namespace).
    pub fn felix_env(self) -> Vec<(&'static str, &'static str)> {
        let nft = if self == Self::FelixNftables {
            "Enabled"
        } else {
            "Disabled"
        };
        let mut env = vec![("FELIX_NFTABLESMODE", nft)];
        if !self.ours() {
            env.push(("FELIX_IPTABLESBACKEND", "nft"));
        }
        env
    }
}

/// Felix for `mode` on node `hostname`: with our driver speaking to the
/// daemon at `socket` for our modes, with its own dataplane otherwise;
/// the mode's settings and then `extra_env`.
pub fn felix_for(
    c: &Calico,
    mode: Mode,
    ns: &Netns,
    dir: &Path,
    hostname: &str,
    socket: &Path,
    extra_env: &[(&str, &str)],
) -> Result<Proc> {
    let mut env = mode.felix_env();
    env.extend_from_slice(extra_env);
    if mode.ours() {
        felix(c, ns, dir, hostname, &driver(dir)?, socket, &env)
    } else {
        felix_internal(c, ns, dir, hostname, &env)
    }
}

/// What every Felix of the tests has: the datastore, its name, its logs.
fn felix_command(c: &Calico, ns: &Netns, dir: &Path, hostname: &str) -> Command {
    let mut cmd = ns.command(c.bin.join("calico-felix"));
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("FELIX_DATASTORETYPE", "etcdv3")
        .env("FELIX_ETCDENDPOINTS", "http://127.0.0.1:2379")
        // Felix's datastore client reads these (the FELIX_ ones alone left
        // v3.31.0 connecting to Kubernetes), as calico-node sets them.
        .env("DATASTORE_TYPE", "etcdv3")
        .env("ETCD_ENDPOINTS", "http://127.0.0.1:2379")
        .env("FELIX_FELIXHOSTNAME", hostname)
        .env("FELIX_USAGEREPORTINGENABLED", "false")
        .env("FELIX_LOGFILEPATH", "none")
        .env("FELIX_LOGSEVERITYSYS", "none")
        // DPH_TEST_FELIX_LOG=debug: Felix logs every message it sends.
        .env(
            "FELIX_LOGSEVERITYSCREEN",
            std::env::var("DPH_TEST_FELIX_LOG").unwrap_or_else(|_| "info".into()),
        )
        .env("FELIX_HEALTHENABLED", "true")
        // Its endpoint-status files in the test's directory, not the
        // host's /var/run/calico.
        .env("FELIX_ENDPOINTSTATUSPATHPREFIX", dir);
    cmd
}

/// A restarted Felix logs to a file of its own.
fn felix_log(dir: &Path, hostname: &str) -> PathBuf {
    (0..)
        .map(|n| dir.join(format!("felix-{hostname}-{n}.log")))
        .find(|l| !l.exists())
        .expect("a free name")
}

/// A Kubernetes namespace and one of its service accounts as Calico's
/// Kubernetes mode models them: the namespace's profile `<ns>` (allow
/// all; its label `projectcalico.org/name` for namespace selectors) and
/// the service account's profile `ksa.<ns>.<sa>`.
pub fn namespace_yaml(ns: &str, sa: &str) -> String {
    format!(
        "---\napiVersion: projectcalico.org/v3\nkind: Profile\nmetadata: {{name: {ns}}}\n\
         spec:\n  labelsToApply: {{pcns.projectcalico.org/name: {ns}}}\n\
         \x20 ingress: [{{action: Allow}}]\n  egress: [{{action: Allow}}]\n\
         ---\napiVersion: projectcalico.org/v3\nkind: Profile\nmetadata: {{name: ksa.{ns}.{sa}}}\n\
         spec: {{labelsToApply: {{pcsa.projectcalico.org/name: {sa}}}}}\n"
    )
}

/// Pod `app` of namespace `ns` (service account `sa`) on node1: its
/// WorkloadEndpoint on `iface`, MAC 02:00:00:00:00:0`n`, address `ip`;
/// `extra` is more of its spec (`ports: [...]`).
pub fn pod_yaml(
    ns: &str,
    sa: &str,
    app: &str,
    iface: &str,
    n: u8,
    ip: &str,
    extra: &str,
) -> String {
    format!(
        "---\napiVersion: projectcalico.org/v3\nkind: WorkloadEndpoint\n\
         metadata: {{name: node1-k8s-{app}-eth0, namespace: {ns}, labels: {{app: {app}, \
         projectcalico.org/namespace: {ns}, projectcalico.org/serviceaccount: {sa}}}}}\n\
         spec: {{node: node1, orchestrator: k8s, pod: {app}, endpoint: eth0, interfaceName: {iface}, \
         mac: '02:00:00:00:00:0{n}', ipNetworks: ['{ip}/32'], profiles: [{ns}, ksa.{ns}.{sa}], \
         serviceAccountName: {sa}{extra}}}\n"
    )
}

/// One node of a cluster (the one-node tests): its Node, a pool without
/// encapsulation, namespace ns1 with a client and a web pod (cali1
/// 10.65.0.2, cali2 10.65.0.3 with a named port `metrics`, TCP 6100), a
/// tier `security` whose policy denies TCP 7070 to web and passes the
/// rest, and `allow-web` allowing the client TCP 8080 and 7070.
pub fn one_node() -> String {
    let mut y = String::from(
        "apiVersion: projectcalico.org/v3\nkind: Node\nmetadata: {name: node1}\n\
         spec: {bgp: {ipv4Address: 172.31.50.1/24}}\n\
         ---\napiVersion: projectcalico.org/v3\nkind: IPPool\nmetadata: {name: pool1}\n\
         spec: {cidr: 10.65.0.0/16, ipipMode: Never, vxlanMode: Never, natOutgoing: false}\n",
    );
    y += &namespace_yaml("ns1", "sa1");
    y += &pod_yaml("ns1", "sa1", "client", "cali1", 1, "10.65.0.2", "");
    y += &pod_yaml(
        "ns1",
        "sa1",
        "web",
        "cali2",
        2,
        "10.65.0.3",
        ", ports: [{name: metrics, protocol: TCP, port: 6100}]",
    );
    y += POLICIES;
    y + &allow_web_yaml("8080, 7070")
}

/// `allow-web`: web allows the client TCP `ports`.
pub fn allow_web_yaml(ports: &str) -> String {
    format!(
        "---\napiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\nmetadata: {{name: allow-web}}\n\
         spec:\n  order: 100\n  selector: app == 'web'\n  types: [Ingress]\n  ingress:\n\
         \x20 - {{action: Allow, protocol: TCP, source: {{selector: app == 'client'}}, \
         destination: {{ports: [{ports}]}}}}\n"
    )
}

const POLICIES: &str = r#"---
apiVersion: projectcalico.org/v3
kind: Tier
metadata: {name: security}
spec: {order: 100}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {name: security.block-7070}
spec:
  tier: security
  order: 10
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - {action: Deny, protocol: TCP, destination: {ports: [7070]}}
  - {action: Pass}
"#;

/// `dphandler-felix-driver` in `dir`: the symlink to dphctl that
/// `FELIX_DATAPLANEDRIVER` names (made once).
pub fn driver(dir: &Path) -> Result<PathBuf> {
    let p = dir.join("dphandler-felix-driver");
    if !p.exists() {
        std::os::unix::fs::symlink(crate::bin("dphctl"), &p)?;
    }
    Ok(p)
}
