//! A stock Felix's view of dphandler: an emulated Felix that does what
//! `felix/dataplane/external/ext_dataplane.go` does — two pipes, the driver
//! exec'd with no arguments (as `dphandler-felix-driver`, a symlink to
//! dphctl) with them on fds 3 and 4, framed `felix.ToDataplane` messages
//! numbered from 0 — and reads framed `felix.FromDataplane` replies. Behind
//! the driver, the real daemon in a namespace with two workloads; packets
//! show the policy is enforced. Then what makes the driver exit (an
//! oversized frame, the server killed, no fds 3 and 4, SIGTERM) and what
//! does not (a malformed frame: rejected by the server). Needs root.

use std::io::{BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use command_fds::{CommandFdExt, FdMapping};
use dphandler_proto::felix::{self, from_dataplane::Payload as From};
use dphandler_tests::kernel;
use dphandler_tests::lab::{self, tcp_ok, yaml_msgs};
use dphandler_tests::{Daemon, Netns, bin, privileged, tempdir};
use prost::Message;

/// Felix's side of the driver: its pipes, the frames read back, the
/// driver's stderr.
struct Felix {
    child: Child,
    to_driver: Option<std::io::PipeWriter>,
    replies: mpsc::Receiver<felix::FromDataplane>,
    stderr: Arc<Mutex<String>>,
    seq: u64,
}

impl Felix {
    /// Starts the driver as Felix does: `driver` with no arguments, fd 3
    /// the read end of Felix's ToDataplane pipe, fd 4 the write end of its
    /// FromDataplane pipe.
    fn start(driver: &Path, socket: &Path) -> Result<Self> {
        Self::start_env(driver, socket, &[])
    }

    /// [`Felix::start`] with more environment variables for the driver.
    fn start_env(driver: &Path, socket: &Path, env: &[(&str, &str)]) -> Result<Self> {
        let (to_r, to_w) = std::io::pipe()?;
        let (from_r, from_w) = std::io::pipe()?;
        let mut cmd = Command::new(driver);
        cmd.env("DPH_SOCKET", socket)
            .env("DPH_FELIX_CONNECT_TIMEOUT_SECONDS", "5")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .envs(env.iter().copied());
        cmd.fd_mappings(vec![
            FdMapping {
                parent_fd: OwnedFd::from(to_r),
                child_fd: 3,
            },
            FdMapping {
                parent_fd: OwnedFd::from(from_w),
                child_fd: 4,
            },
        ])?;
        let mut child = cmd.spawn().context("starting the driver")?;
        // Felix closes its copies of the driver's ends.
        drop(cmd);
        let stderr = Arc::new(Mutex::new(String::new()));
        {
            let mut pipe = child.stderr.take().context("stderr")?;
            let stderr = stderr.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                    eprint!("[driver] {text}");
                    stderr.lock().unwrap().push_str(&text);
                }
            });
        }
        let (tx, replies) = mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(from_r);
            loop {
                let mut len = [0u8; 8];
                if r.read_exact(&mut len).is_err() {
                    return;
                }
                let mut buf = vec![0u8; u64::from_le_bytes(len) as usize];
                if r.read_exact(&mut buf).is_err() {
                    return;
                }
                let msg = felix::FromDataplane::decode(buf.as_slice()).expect("a FromDataplane");
                if tx.send(msg).is_err() {
                    return;
                }
            }
        });
        Ok(Self {
            child,
            to_driver: Some(to_w),
            replies,
            stderr,
            seq: 0,
        })
    }

    fn write_raw(&mut self, bytes: &[u8]) -> Result<()> {
        let w = self.to_driver.as_mut().context("fd 3 closed")?;
        w.write_all(bytes)?;
        Ok(())
    }

    /// Frames and sends messages (YAML, as the other tests write them),
    /// numbered on from Felix's counter.
    fn send(&mut self, yaml: &str) -> Result<()> {
        for m in yaml_msgs(self.seq, yaml) {
            self.seq = m.sequence_number + 1;
            let data = m.encode_to_vec();
            let mut frame = (data.len() as u64).to_le_bytes().to_vec();
            frame.extend(data);
            self.write_raw(&frame)?;
        }
        Ok(())
    }

    /// Reads replies until one `matches`, within `secs`; the others seen
    /// on the way are returned too.
    fn until(
        &self,
        secs: u64,
        what: &str,
        mut matches: impl FnMut(&felix::FromDataplane) -> bool,
    ) -> Result<Vec<felix::FromDataplane>> {
        let until = Instant::now() + Duration::from_secs(secs);
        let mut seen = Vec::new();
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.replies.recv_timeout(left) {
                Ok(m) => {
                    let hit = matches(&m);
                    seen.push(m);
                    if hit {
                        return Ok(seen);
                    }
                }
                Err(_) => bail!("no {what} on fd 4 within {secs} s; saw {seen:?}"),
            }
        }
    }

    /// Waits for the driver to exit: its status and what it said.
    fn exit(&mut self, secs: u64) -> Result<(std::process::ExitStatus, String)> {
        let until = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(st) = self.child.try_wait()? {
                std::thread::sleep(Duration::from_millis(100)); // the last stderr
                return Ok((st, self.stderr.lock().unwrap().clone()));
            }
            if Instant::now() >= until {
                bail!("the driver did not exit within {secs} s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn said(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }
}

impl Drop for Felix {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `dphandler-felix-driver` in `dir`: a symlink to dphctl, the name under
/// which it is Felix's driver.
fn driver(dir: &Path) -> Result<std::path::PathBuf> {
    std::fs::create_dir_all(dir)?;
    let p = dir.join("dphandler-felix-driver");
    std::os::unix::fs::symlink(bin("dphctl"), &p)?;
    Ok(p)
}

fn wep(iface: &str, ip: &str, extra: &str) -> String {
    format!(
        "workloadEndpointUpdate:\n  id: {{orchestratorId: k8s, workloadId: ns/{iface}, endpointId: eth0}}\n  endpoint:\n    name: {iface}\n    ipv4Nets: [{ip}/32]\n    profileIds: [kns.ns]\n{extra}"
    )
}

fn tcp(from: &Netns, to: &str, port: u16) -> bool {
    let addr: SocketAddr = format!("{to}:{port}").parse().unwrap();
    tcp_ok(from, addr, Duration::from_millis(700))
}

/// A ConfigUpdate as Felix sends it: the keys that matter to a dataplane
/// (here the daemon's running values, or live ones), and some of Felix's
/// own.
const FELIX_CONFIG: &str = "FelixHostname: node1, InterfacePrefix: cali, \
IptablesMarkMask: '0xffff0000', IPForwarding: Enabled, IpInIpEnabled: 'false', \
VXLANEnabled: 'false', VXLANVNI: '4096', VXLANPort: '4789', VXLANMTU: '0', \
WireguardEnabled: 'false', WireguardListeningPort: '51820', WireguardMTU: '0', \
IptablesRefreshInterval: '90', IpsetsRefreshInterval: '90', RouteRefreshInterval: '90', \
FailsafeInboundHostPorts: 'tcp:22,udp:68', FailsafeOutboundHostPorts: 'udp:53', \
DefaultEndpointToHostAction: Accept, LogSeverityScreen: Info, \
BPFEnabled: 'false', ReportingIntervalSecs: '30'";

async fn details(socket: &Path) -> Result<std::collections::HashMap<String, String>> {
    Ok(dphandler_tests::connect(socket)
        .await?
        .get_status(dphandler_proto::v1::GetStatusRequest {})
        .await?
        .into_inner()
        .details)
}

#[tokio::test]
async fn a_felix_drives_the_daemon_through_the_driver() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let host = Netns::new("fx")?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    let w1 = lab::workload_v4(&host, "cali1", 1, "10.66.0.2")?;
    let w2 = lab::workload_v4(&host, "cali2", 2, "10.66.0.3")?;
    let _l = lab::serve(&w2.0, &[80, 81], &[]);
    // A service on the host itself, for workload-to-host traffic.
    host.run("ip", &["addr", "add", "10.66.255.1/32", "dev", "lo"])?;
    let _h = lab::serve(&host.0, &[8080], &[]);
    let socket = dir.path().join("dp.sock");
    let d = Daemon::start(&host, &socket, &["--ipv6", "false", "--hostname", "node1"])?;
    d.connect().await?;

    let mut felix = Felix::start(&driver(dir.path())?, &socket)?;
    // What Felix sends first: its config, then the snapshot, then InSync.
    felix.send(&format!("configUpdate:\n  config: {{{FELIX_CONFIG}}}\n"))?;
    let snapshot = format!(
        "ipsetUpdate: {{id: 's:w1', members: ['10.66.0.2']}}\n---\n\
         activeProfileUpdate:\n  id: {{name: kns.ns}}\n  profile:\n    inboundRules: [{{action: allow}}]\n    outboundRules: [{{action: allow}}]\n---\n\
         activePolicyUpdate:\n  id: {{name: default.web}}\n  policy:\n    tier: default\n    inboundRules: [{{action: allow, protocol: {{name: tcp}}, dstPorts: [{{first: 80, last: 80}}], srcIpSetIds: ['s:w1']}}]\n---\n\
         {}---\n{}---\ninSync: {{}}\n",
        wep("cali1", "10.66.0.2", ""),
        wep(
            "cali2",
            "10.66.0.3",
            "    tiers: [{name: default, ingressPolicies: [{name: default.web}], defaultAction: deny}]\n"
        ),
    );
    felix.send(&snapshot)?;
    let seen = felix.until(20, "DataplaneInSync", |m| {
        matches!(m.payload, Some(From::DataplaneInSync(_)))
    })?;
    // Endpoint status, as Felix writes it to the datastore.
    let mut up = std::collections::BTreeSet::new();
    let mut note_up = |m: &felix::FromDataplane| {
        if let Some(From::WorkloadEndpointStatusUpdate(u)) = &m.payload
            && u.status.as_ref().is_some_and(|s| s.status == "up")
        {
            up.insert(
                u.id.as_ref()
                    .map(|i| i.workload_id.clone())
                    .unwrap_or_default(),
            );
        }
        up.len() == 2
    };
    if !seen.iter().any(&mut note_up) {
        felix.until(10, "both endpoints up", &mut note_up)?;
    }
    // The policy, enforced: tcp/80 from w1's set only.
    assert!(tcp(&w1, "10.66.0.3", 80), "allowed by the policy");
    assert!(!tcp(&w1, "10.66.0.3", 81), "denied by the tier's default");

    // A delta: the policy opens 81 too.
    felix.send(
        "activePolicyUpdate:\n  id: {name: default.web}\n  policy:\n    tier: default\n    inboundRules: [{action: allow, protocol: {name: tcp}, dstPorts: [{first: 80, last: 81}], srcIpSetIds: ['s:w1']}]\n",
    )?;
    let mut ok = false;
    for _ in 0..30 {
        if tcp(&w1, "10.66.0.3", 81) {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the delta reached the kernel");

    // A message the daemon refuses: logged with its sequence number.
    let bad_seq = felix.seq;
    felix.send("ipsetDeltaUpdate: {id: 's:w1', addedMembers: ['10.66.0.999']}\n")?;
    let until = Instant::now() + Duration::from_secs(5);
    while !felix
        .said()
        .contains(&format!("rejected: sequence {bad_seq}:"))
    {
        assert!(
            Instant::now() < until,
            "no rejection logged: {}",
            felix.said()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(felix.said().contains("10.66.0.999"), "{}", felix.said());

    // ConfigUpdate: a bad value is a rejection naming the key.
    let bad_seq = felix.seq;
    felix.send(&format!(
        "configUpdate:\n  config: {{{FELIX_CONFIG}, VXLANPort: '0'}}\n"
    ))?;
    let until = Instant::now() + Duration::from_secs(5);
    let want = format!("rejected: sequence {bad_seq}: config_update.config[VXLANPort]");
    while !felix.said().contains(&want) {
        assert!(
            Instant::now() < until,
            "no rejection logged: {}",
            felix.said()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A live key: workloads may reach the host (Accept), then not (Drop).
    assert!(
        tcp(&w1, "10.66.255.1", 8080),
        "DefaultEndpointToHostAction Accept"
    );
    felix.send(&format!(
        "configUpdate:\n  config: {{{}}}\n",
        FELIX_CONFIG.replace(
            "DefaultEndpointToHostAction: Accept",
            "DefaultEndpointToHostAction: Drop"
        )
    ))?;
    let mut blocked = false;
    for _ in 0..30 {
        if !tcp(&w1, "10.66.255.1", 8080) {
            blocked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        blocked,
        "DefaultEndpointToHostAction Drop reached the kernel: {}",
        kernel::our_chain(&host, false, "filter", "dph-INPUT")?
    );
    assert!(tcp(&w1, "10.66.0.3", 80), "workload to workload unchanged");
    // A key that needs a restart: reported, and kept for the next start.
    felix.send(&format!(
        "configUpdate:\n  config: {{{}}}\n",
        FELIX_CONFIG.replace("InterfacePrefix: cali", "InterfacePrefix: tap")
    ))?;
    let mut d_ = std::collections::HashMap::new();
    for _ in 0..50 {
        d_ = details(&socket).await?;
        if d_.contains_key("config.restart_needed.InterfacePrefix") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let said = d_
        .get("config.restart_needed.InterfacePrefix")
        .with_context(|| format!("{d_:?}"))?;
    assert!(
        said.contains("running cali, ConfigUpdate says tap"),
        "{said}"
    );
    let kept = std::fs::read_to_string(dir.path().join("dp.sock.state/felix-config"))?;
    assert!(kept.contains("InterfacePrefix=tap"), "{kept}");
    // Everything else still as it was: workloads still talk.
    assert!(tcp(&w1, "10.66.0.3", 80));
    // A loop-level live key: the iptables refresh every second, as the
    // resync counter shows.
    let resyncs = || -> Result<f64> {
        Ok(lab::scrape(&host, 9191)?
            .get("dphandler_int_dataplane_resyncs_total{refresh=\"iptables\"}")
            .copied()
            .unwrap_or(0.0))
    };
    let before = resyncs()?;
    felix.send(&format!(
        "configUpdate:\n  config: {{{}}}\n",
        FELIX_CONFIG
            .replace(
                "IptablesRefreshInterval: '90'",
                "IptablesRefreshInterval: '1'"
            )
            .replace("InterfacePrefix: cali", "InterfacePrefix: tap")
    ))?;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let after = resyncs()?;
    assert!(after - before >= 2.0, "iptables resyncs {before} → {after}");

    // The heartbeat Felix's status reporter expects (first after 10 s).
    felix.until(15, "ProcessStatusUpdate", |m| {
        matches!(m.payload, Some(From::ProcessStatusUpdate(_)))
    })?;

    // Felix stopping: SIGTERM, and the driver is gone well within 4 s.
    let t = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(felix.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    let (st, _) = felix.exit(4)?;
    assert!(st.success(), "{st:?}");
    eprintln!("driver ended {:?} after SIGTERM", t.elapsed());

    // The restart: the kept InterfacePrefix is in force; the calc graph,
    // which asks for it, finds nothing waiting any more.
    d.stop()?;
    let d = Daemon::start(&host, &socket, &["--ipv6", "false", "--hostname", "node1"])?;
    d.connect().await?;
    let mut felix = Felix::start(&driver(&dir.path().join("again"))?, &socket)?;
    felix.send(&format!(
        "configUpdate:\n  config: {{{}}}\n---\ninSync: {{}}\n",
        FELIX_CONFIG.replace("InterfacePrefix: cali", "InterfacePrefix: tap")
    ))?;
    felix.until(20, "DataplaneInSync", |m| {
        matches!(m.payload, Some(From::DataplaneInSync(_)))
    })?;
    let input = kernel::our_chain(&host, false, "filter", "dph-INPUT")?;
    assert!(
        input.contains(kernel::spelled("-i tap+", "iifname \"tap*\"")),
        "{input}"
    );
    assert!(
        !input.contains(kernel::spelled("-i cali+", "iifname \"cali*\"")),
        "{input}"
    );
    let d_ = details(&socket).await?;
    assert!(
        !d_.keys().any(|k| k.starts_with("config.restart_needed")),
        "{d_:?}"
    );
    drop(felix);
    drop(d);
    Ok(())
}

#[tokio::test]
async fn what_makes_the_driver_exit() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let ns = Netns::new("fxe")?;
    let socket = dir.path().join("dp.sock");
    let mut d = Some(Daemon::start(&ns, &socket, &["--hostname", "n1"])?);
    d.as_ref().unwrap().connect().await?;
    let drv = driver(dir.path())?;

    // A frame that is not a ToDataplane does not end it: the driver passes
    // Felix's bytes on undecoded, the server rejects that one message (a
    // Felix newer than this dphandler must not be restarted in a loop for
    // it) and the driver logs the rejection; the next message is taken.
    let mut f = Felix::start(&drv, &socket)?;
    f.write_raw(&[3, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff])?;
    f.send("inSync: {}\n")?;
    f.until(10, "DataplaneInSync after a bad frame", |m| {
        matches!(m.payload, Some(From::DataplaneInSync(_)))
    })?;
    f.to_driver = None;
    let (st, said) = f.exit(10)?;
    assert!(st.success(), "{said}");
    assert!(
        said.contains("rejected: sequence 0: : not a valid felix.ToDataplane message"),
        "{said}"
    );

    // A length no sane frame has.
    let mut f = Felix::start(&drv, &socket)?;
    f.write_raw(&u64::MAX.to_le_bytes())?;
    let (st, said) = f.exit(10)?;
    assert!(!st.success(), "{said}");
    assert!(said.contains("over the limit"), "{said}");

    // Felix closing fd 3 (it is going away): a clean end.
    let mut f = Felix::start(&drv, &socket)?;
    f.send("inSync: {}\n")?;
    f.until(10, "DataplaneInSync", |m| {
        matches!(m.payload, Some(From::DataplaneInSync(_)))
    })?;
    f.to_driver = None;
    let (st, said) = f.exit(10)?;
    assert!(st.success(), "{said}");
    assert!(said.contains("Felix closed fd 3"), "{said}");

    // Not run by Felix: no fds 3 and 4.
    let out = Command::new(bin("dphctl"))
        .args(["--socket"])
        .arg(&socket)
        .arg("felix-driver")
        .output()?;
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("is not open") && said.contains("fds 3 and 4"),
        "{said}"
    );

    // The server killed under a running driver: it exits non-zero (Felix
    // then restarts, and its new driver sends the snapshot again).
    let mut f = Felix::start(&drv, &socket)?;
    f.send("inSync: {}\n")?;
    f.until(10, "DataplaneInSync", |m| {
        matches!(m.payload, Some(From::DataplaneInSync(_)))
    })?;
    d.take().unwrap().stop()?;
    let (st, said) = f.exit(10)?;
    assert!(!st.success(), "{said}");
    assert!(
        said.contains("lost the server") || said.contains("ended the"),
        "{said}"
    );

    // And no server at all: it gives up after its connect timeout.
    let mut f = Felix::start(&drv, &dir.path().join("nobody.sock"))?;
    let (st, said) = f.exit(15)?;
    assert!(!st.success(), "{said}");
    assert!(said.contains("no dphandler within"), "{said}");

    // A TLS file that is not there stays missing: it says so at once
    // rather than after its connect timeout (here 5 s).
    let started = Instant::now();
    let missing = dir.path().join("no-ca.pem");
    let missing = missing.to_str().unwrap();
    let mut f = Felix::start_env(
        &drv,
        &socket,
        &[
            ("DPH_TCP", "127.0.0.1:9"),
            ("DPH_TLS_CA", missing),
            ("DPH_TLS_CERT", missing),
            ("DPH_TLS_KEY", missing),
        ],
    )?;
    let (st, said) = f.exit(15)?;
    assert!(!st.success(), "{said}");
    assert!(
        said.contains("trying again will not help") && said.contains("no-ca.pem"),
        "{said}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    Ok(())
}

/// A daemon whose stderr goes to `log`, with `DPH_LOG` set to `level` or
/// unset.
fn logging_daemon(ns: &Netns, socket: &Path, log: &Path, level: Option<&str>) -> Result<Daemon> {
    // `sh` execs it, so the pid is its own.
    let mut cmd = ns.command("sh");
    cmd.args([
        "-c",
        "exec \"$0\" serve --hostname n1 --socket \"$1\" --state-dir \"$1.state\" 2>\"$2\"",
    ])
    .arg(bin("dphandler"))
    .arg(socket)
    .arg(log);
    match level {
        Some(l) => cmd.env("DPH_LOG", l),
        None => cmd.env_remove("DPH_LOG"),
    };
    Daemon::spawn(cmd, socket)
}

fn debug_lines(log: &Path) -> Result<usize> {
    Ok(std::fs::read_to_string(log)?
        .lines()
        .filter(|l| l.contains("DEBUG"))
        .count())
}

#[tokio::test]
async fn log_severity_screen_changes_the_log_level_and_back() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let ns = Netns::new("fxl")?;
    let socket = dir.path().join("dp.sock");
    let log = dir.path().join("daemon.log");
    // No --log: the default (info), and the calc graph's level.
    let d = logging_daemon(&ns, &socket, &log, None)?;
    let mut c = d.connect().await?;
    let (rej, _) = dphandler_tests::push(
        &mut c,
        yaml_msgs(
            1,
            "ipsetUpdate: {id: 's:a', members: ['10.0.0.1']}\n---\ninSync: {}\n",
        ),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    assert_eq!(debug_lines(&log)?, 0, "the default, info");
    let (rej, _) = dphandler_tests::push(
        &mut c,
        yaml_msgs(10, "configUpdate: {config: {LogSeverityScreen: Debug}}\n---\nipsetUpdate: {id: 's:b', members: ['10.0.0.2']}\n"),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let n = debug_lines(&log)?;
    assert!(
        n > 0,
        "LogSeverityScreen Debug: {}",
        std::fs::read_to_string(&log)?
    );
    // Without the key: the default again.
    let (rej, _) = dphandler_tests::push(
        &mut c,
        yaml_msgs(
            20,
            "configUpdate: {config: {}}\n---\nipsetUpdate: {id: 's:c', members: ['10.0.0.3']}\n",
        ),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after_off = debug_lines(&log)?;
    let (rej, _) = dphandler_tests::push(
        &mut c,
        yaml_msgs(30, "ipsetUpdate: {id: 's:d', members: ['10.0.0.4']}\n"),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(debug_lines(&log)?, after_off, "back to info");
    drop(c);
    assert!(d.stop()?.success());

    // An operator's --log (here DPH_LOG) holds, as Felix's environment
    // beats its datastore: a ConfigUpdate's Debug changes nothing.
    let log = dir.path().join("daemon-warn.log");
    let d = logging_daemon(&ns, &socket, &log, Some("warn"))?;
    let mut c = d.connect().await?;
    let (rej, _) = dphandler_tests::push(
        &mut c,
        yaml_msgs(1, "configUpdate: {config: {LogSeverityScreen: Debug}}\n---\nipsetUpdate: {id: 's:a', members: ['10.0.0.1']}\n---\ninSync: {}\n---\nipsetUpdate: {id: 's:b', members: ['10.0.0.2']}\n"),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let text = std::fs::read_to_string(&log)?;
    assert_eq!(debug_lines(&log)?, 0, "--log warn holds: {text}");
    assert!(!text.contains(" INFO "), "--log warn holds: {text}");
    drop(c);
    assert!(d.stop()?.success());
    Ok(())
}
