//! `dphandler demo`: the real server in a sandbox network namespace, fed a
//! bundled scenario through the real gRPC path.
//!
//! Creates `dph-demo-<pid>` (removed at the end, also on failure or Ctrl-C),
//! starts `dphandler serve` inside it on a temporary socket, pushes the
//! scenario over `ToDataplane` exactly as a calc graph would, waits for
//! `DataplaneInSync` on `StatusUpdates`, prints what was programmed, and ends
//! the server by PID. The host's own namespace is never touched.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use dphandler_proto::felix::{self, from_dataplane, to_dataplane::Payload};
use dphandler_proto::v1::{self, status_update, to_dataplane_reply::Kind};

/// The bundled scenario: a small node's snapshot, one message invalid on
/// purpose.
pub const SCENARIO: &str = include_str!("../scenarios/demo.yaml");

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Push this file (YAML, JSON or NDJSON of felix.ToDataplane) instead of
    /// the bundled scenario.
    #[arg(long, env = "DPH_DEMO_SCENARIO")]
    scenario: Option<PathBuf>,
    /// Seconds to wait for DataplaneInSync.
    #[arg(long, env = "DPH_DEMO_TIMEOUT", default_value_t = 30.0)]
    timeout: f64,
    /// Be Felix instead of a gRPC client: run `dphctl felix-driver` with
    /// pipes on its fds 3 and 4 and send the scenario as framed
    /// felix.ToDataplane messages, as Felix's external-driver mode does.
    #[arg(long, env = "DPH_DEMO_VIA_FELIX_DRIVER")]
    via_felix_driver: bool,
}

/// The node-wide sysctls the daemon sets (see `backends::sysctl`).
const NODE_SETTINGS: [&str; 3] = [
    "net.ipv4.ip_forward",
    "net.ipv6.conf.all.forwarding",
    "net.netfilter.nf_conntrack_acct",
];

/// A sysctl's value inside namespace `ns` ("?" when it cannot be read).
fn sysctl(ns: &str, key: &str) -> String {
    Command::new("ip")
        .args(["netns", "exec", ns, "sysctl", "-n", key])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "?".into())
}

struct Sandbox(String);

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// The server we started, ended by PID.
struct Server(Child);

impl Server {
    fn stop(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.0.id())?);
        // It may already have exited; then wait() reports how.
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        Ok(self.0.wait()?)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.stop();
        }
    }
}

pub async fn run(args: DemoArgs, log: &str) -> anyhow::Result<()> {
    let timeout = Duration::try_from_secs_f64(args.timeout)
        .context("--timeout must be a non-negative number of seconds")?;
    let (name, text) = match &args.scenario {
        Some(p) => (
            p.display().to_string(),
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        ),
        None => (
            "bundled scenario (server/scenarios/demo.yaml)".into(),
            SCENARIO.into(),
        ),
    };
    let mut msgs =
        dphandler_proto::text::parse_to_dataplane(&text).with_context(|| format!("in {name}"))?;
    dphandler_proto::text::number(&mut msgs);
    let total = msgs.len();
    if !msgs
        .iter()
        .any(|m| matches!(m.payload, Some(Payload::InSync(_))))
    {
        bail!("{name} has no InSync message: the dataplane would never go in sync");
    }
    if !nix::unistd::Uid::effective().is_root() {
        bail!("the demo creates a network namespace: run it as root");
    }

    let ns = Sandbox(format!("dph-demo-{}", std::process::id()));
    let st = Command::new("ip")
        .args(["netns", "add", &ns.0])
        .status()
        .context("running `ip` (install iproute2)")?;
    if !st.success() {
        bail!("ip netns add {} failed", ns.0);
    }
    // The namespace starts with loopback down; bring it up as a node would
    // have it, with an underlay interface holding this node's address (the
    // VXLAN device's parent). Both ends of its veth stay in the sandbox.
    for args in [
        &["link", "set", "lo", "up"][..],
        &[
            "link", "add", "eth0", "type", "veth", "peer", "name", "uplink",
        ],
        &["addr", "add", "192.0.2.11/24", "dev", "eth0"],
        &["link", "set", "eth0", "up"],
        &["link", "set", "uplink", "up"],
    ] {
        let st = Command::new("ip")
            .args(["-n", &ns.0])
            .args(args)
            .status()
            .context("running `ip`")?;
        if !st.success() {
            bail!("ip {args:?} in the sandbox failed");
        }
    }
    // The node-wide settings the daemon makes (as Felix): read before it
    // starts, shown again once it is in sync.
    let before: Vec<String> = NODE_SETTINGS.iter().map(|k| sysctl(&ns.0, k)).collect();
    let dir = tempfile::Builder::new().prefix("dph-demo-").tempdir()?;
    let socket = dir.path().join("dataplane.sock");
    let exe = std::env::current_exe().context("finding our own binary")?;
    let mut server = Server(
        Command::new("ip")
            .args(["netns", "exec", &ns.0])
            .arg(&exe)
            .args(["serve", "--hostname", "node-1", "--socket"])
            .arg(&socket)
            // The sandbox's state stays in the sandbox's directory.
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .env("DPH_LOG", log)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting dphandler serve")?,
    );
    println!(
        "sandbox: network namespace {}; server pid {} on {}",
        ns.0,
        server.0.id(),
        socket.display()
    );

    let mut client = None;
    for _ in 0..200 {
        if let Some(status) = server.0.try_wait()? {
            bail!("the server exited at start ({status})");
        }
        if socket.exists()
            && let Ok(c) = dphandler_proto::client::connect_unix(&socket).await
        {
            client = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut client = client.context("the server did not come up within 10 s")?;
    let mut updates = client
        .status_updates(v1::StatusUpdatesRequest {})
        .await?
        .into_inner();

    if args.via_felix_driver {
        let started = Instant::now();
        let driver = exe.with_file_name("dphctl");
        let replies = as_felix(&driver, &socket, msgs, total, &name, timeout)?;
        println!(
            "DataplaneInSync on fd 4 after {:.1} ms; what else the driver wrote to Felix:",
            started.elapsed().as_secs_f64() * 1e3
        );
        for r in replies {
            println!(
                "  {}",
                dphandler_proto::text::to_json("felix.FromDataplane", &r)?
            );
        }
        show(&mut client, &ns.0, &before).await?;
        drop(updates);
        return stop(server, client, &ns.0);
    }
    println!("pushing {total} messages from the {name} over ToDataplane");
    let started = Instant::now();
    let mut replies = client
        .to_dataplane(futures::stream::iter(msgs))
        .await?
        .into_inner();
    let mut rejections = Vec::new();
    let mut programmed = 0;
    while let Some(r) = tokio::time::timeout(timeout, replies.message())
        .await
        .context("timed out waiting for the server's replies")??
    {
        match r.kind {
            Some(Kind::Rejected(r)) => rejections.push(r),
            Some(Kind::Programmed(p)) => programmed = p.sequence_number,
            Some(Kind::Received(_)) | None => {}
        }
    }
    let in_sync_after = loop {
        let u = tokio::time::timeout(timeout, updates.message())
            .await
            .context("timed out waiting for DataplaneInSync")??
            .context("StatusUpdates ended before DataplaneInSync")?;
        if let Some(status_update::Kind::Update(felix::FromDataplane {
            payload: Some(from_dataplane::Payload::DataplaneInSync(_)),
            ..
        })) = u.kind
        {
            break started.elapsed();
        }
    };
    println!(
        "DataplaneInSync after {:.1} ms; programmed up to sequence {programmed}",
        in_sync_after.as_secs_f64() * 1e3
    );
    for r in &rejections {
        println!(
            "rejected (nothing of it applied): sequence {}: {}: {}",
            r.sequence_number, r.field, r.reason
        );
    }
    show(&mut client, &ns.0, &before).await?;
    drop(replies);
    drop(updates);
    stop(server, client, &ns.0)
}

/// Ends the server by PID (SIGTERM), once the client is gone.
fn stop(
    mut server: Server,
    client: dphandler_proto::v1::dataplane_client::DataplaneClient<tonic::transport::Channel>,
    ns: &str,
) -> anyhow::Result<()> {
    drop(client);
    let status = server.stop()?;
    if !status.success() {
        bail!("the server exited with {status}");
    }
    println!("server stopped by SIGTERM ({status}); removing namespace {ns}");
    Ok(())
}

/// Felix's external-driver mode (`felix/dataplane/external`): the driver
/// exec'd with Felix's two pipes on fds 3 and 4, the messages framed (an
/// 8-byte little-endian length, then the protobuf) and numbered from 0;
/// what the driver writes back is read until DataplaneInSync. The driver's
/// stderr (its rejections) goes to ours, as Felix copies it.
fn as_felix(
    driver: &std::path::Path,
    socket: &std::path::Path,
    mut msgs: Vec<felix::ToDataplane>,
    total: usize,
    name: &str,
    timeout: Duration,
) -> anyhow::Result<Vec<felix::FromDataplane>> {
    use command_fds::{CommandFdExt, FdMapping};
    use prost::Message;
    use std::io::{Read, Write};
    let (to_r, mut to_w) = std::io::pipe()?;
    let (mut from_r, from_w) = std::io::pipe()?;
    let mut cmd = Command::new(driver);
    cmd.arg("felix-driver")
        .env("DPH_SOCKET", socket)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    cmd.fd_mappings(vec![
        FdMapping {
            parent_fd: to_r.into(),
            child_fd: 3,
        },
        FdMapping {
            parent_fd: from_w.into(),
            child_fd: 4,
        },
    ])?;
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {}", driver.display()))?;
    drop(cmd);
    let mut child = Server(child);
    println!(
        "as Felix: {} felix-driver (pid {}) on fds 3 and 4; {total} framed messages from the {name}",
        driver.display(),
        child.0.id()
    );
    for (i, m) in msgs.iter_mut().enumerate() {
        m.sequence_number = i as u64;
        let data = m.encode_to_vec();
        to_w.write_all(&(data.len() as u64).to_le_bytes())?;
        to_w.write_all(&data)?;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        loop {
            let mut len = [0u8; 8];
            if from_r.read_exact(&mut len).is_err() {
                return;
            }
            let mut buf = vec![0u8; u64::from_le_bytes(len) as usize];
            if from_r.read_exact(&mut buf).is_err() {
                return;
            }
            let Ok(m) = felix::FromDataplane::decode(buf.as_slice()) else {
                return;
            };
            if tx.send(m).is_err() {
                return;
            }
        }
    });
    let until = Instant::now() + timeout;
    let mut seen = Vec::new();
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let m = rx
            .recv_timeout(left)
            .context("no DataplaneInSync from the driver on fd 4 in time")?;
        if matches!(m.payload, Some(from_dataplane::Payload::DataplaneInSync(_))) {
            break;
        }
        seen.push(m);
    }
    // Felix stopping: fd 3 closed, then SIGTERM (the driver ends at once).
    drop(to_w);
    let st = child.stop()?;
    if !st.success() {
        bail!("the driver ended with {st}");
    }
    Ok(seen)
}

/// What the sandbox holds now.
async fn show(
    client: &mut dphandler_proto::v1::dataplane_client::DataplaneClient<tonic::transport::Channel>,
    ns: &str,
    before: &[String],
) -> anyhow::Result<()> {
    let st = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    println!(
        "status: in sync {}, {} applies ({} failed), last programmed sequence {}",
        st.in_sync, st.applies, st.failed_applies, st.last_programmed_sequence
    );
    println!(
        "node-wide settings in the sandbox (the daemon turns forwarding on once policy is \
         programmed, as Felix does; --ip-forwarding disabled leaves the two forwarding knobs alone):"
    );
    for (key, was) in NODE_SETTINGS.iter().zip(before) {
        println!("  {key:<34}{was} -> {}", sysctl(ns, key));
    }
    println!("objects held, by kind:");
    let mut kinds: Vec<_> = st.objects.iter().collect();
    kinds.sort();
    for (kind, n) in kinds {
        println!("  {kind:<22}{n}");
    }
    // What is in the sandbox's kernel now, read with the kernel's own tool
    // (the server inherited the demo's DPH_DATAPLANE).
    if std::env::var("DPH_DATAPLANE").is_ok_and(|d| d == "nftables") {
        show_nftables(ns)?;
    } else {
        show_iptables(ns)?;
    }
    show_routes(ns)?;
    println!("status details (dphctl status shows the same):");
    let mut details: Vec<_> = st.details.iter().collect();
    details.sort();
    for (k, v) in details {
        println!("  {k:<32}{v}");
    }
    println!(
        "(the workload's interface does not exist in the sandbox, so no route to it is \
         programmed)"
    );
    Ok(())
}

/// The sets of an `nft list table` listing: (name, type, members).
fn nft_sets(listing: &str) -> Vec<(String, String, usize)> {
    let mut sets: Vec<(String, String, usize)> = Vec::new();
    let mut elements: Option<String> = None;
    let mut in_set = false;
    for line in listing.lines().map(str::trim) {
        if let Some(e) = &mut elements {
            e.push_str(line);
        } else if let Some(name) = line.strip_prefix("set ").and_then(|l| l.strip_suffix(" {")) {
            sets.push((name.to_string(), String::new(), 0));
            in_set = true;
        } else if line == "}" {
            in_set = false;
        } else if !in_set {
            continue;
        } else if let Some(ty) = line.strip_prefix("type ") {
            if let Some(s) = sets.last_mut() {
                s.1 = ty.to_string();
            }
        } else if line == "flags interval" {
            if let Some(s) = sets.last_mut() {
                s.1.push_str(" (interval)");
            }
        } else if let Some(rest) = line.strip_prefix("elements = {") {
            elements = Some(rest.to_string());
        }
        if let Some(e) = elements.take_if(|e| e.ends_with('}'))
            && let Some(s) = sets.last_mut()
        {
            s.2 = e
                .trim_end_matches('}')
                .split(',')
                .filter(|m| !m.trim().is_empty())
                .count();
        }
    }
    sets
}

fn show_nftables(ns: &str) -> anyhow::Result<()> {
    for family in ["ip", "ip6"] {
        let nft = |args: &[&str]| -> anyhow::Result<String> {
            let out = Command::new("ip")
                .args(["netns", "exec", ns, "nft"])
                .args(args)
                .output()
                .context("running nft in the sandbox")?;
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        };
        // filter, and the shards that hold the workloads' policy.
        let tables = nft(&["list", "tables", family])?;
        let filters: Vec<&str> = tables
            .lines()
            .filter_map(|l| l.split_whitespace().nth(2))
            .filter(|t| *t == "dph-filter" || t.starts_with("dph-filter-"))
            .collect();
        for table in filters {
            let listing = nft(&["list", "table", family, table])?;
            println!("IP sets in the sandbox's kernel (nft list table {family} {table}):");
            for (name, ty, n) in nft_sets(&listing) {
                if !name.starts_with("ports-") {
                    println!("  {name:<28}{n:>3} members  {ty}");
                }
            }
            println!("nft list table {family} {table}, our chains and rules:");
            for l in listing.lines().filter(|l| {
                let l = l.trim_start();
                l.starts_with("chain ") || l.contains("comment \"dph:") || l.contains(" vmap ")
            }) {
                println!("  {}", l.trim());
            }
        }
    }
    Ok(())
}

fn show_iptables(ns: &str) -> anyhow::Result<()> {
    let save = Command::new("ip")
        .args(["netns", "exec", ns, "ipset", "save"])
        .output()
        .context("running ipset save in the sandbox")?;
    let mut sets: Vec<(String, String, usize)> = Vec::new();
    for line in String::from_utf8_lossy(&save.stdout).lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["create", name, ty, ..] => sets.push((name.to_string(), ty.to_string(), 0)),
            ["add", name, ..] => {
                if let Some(s) = sets.iter_mut().find(|s| s.0 == *name) {
                    s.2 += 1;
                }
            }
            _ => {}
        }
    }
    println!("IP sets in the sandbox's kernel (ipset save):");
    for (name, ty, n) in &sets {
        println!("  {name:<28}{ty:<14}{n} members");
    }
    for tool in ["iptables-save", "ip6tables-save"] {
        let out = Command::new("ip")
            .args(["netns", "exec", ns, tool, "-t", "filter"])
            .output()
            .with_context(|| format!("running {tool} in the sandbox"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let ours: Vec<&str> = text.lines().filter(|l| l.contains("dph")).collect();
        println!("{tool} -t filter, our chains and rules:");
        for l in ours {
            println!("  {l}");
        }
    }
    Ok(())
}

fn show_routes(ns: &str) -> anyhow::Result<()> {
    println!("routes between nodes in the sandbox's kernel:");
    for (what, args) in [
        ("VXLAN device", &["-d", "link", "show", "vxlan.calico"][..]),
        (
            "its address",
            &["-4", "addr", "show", "dev", "vxlan.calico"],
        ),
        ("routes (ip -d route)", &["-d", "route", "show"]),
        ("VTEP neighbours", &["neigh", "show", "dev", "vxlan.calico"]),
    ] {
        println!("  {what}:");
        let out = Command::new("ip").args(["-n", ns]).args(args).output()?;
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            println!("    {}", l.trim());
        }
    }
    let fdb = Command::new("bridge")
        .args(["-n", ns, "fdb", "show", "dev", "vxlan.calico"])
        .output()?;
    println!("  VTEP FDB entries (bridge fdb):");
    for l in String::from_utf8_lossy(&fdb.stdout)
        .lines()
        .filter(|l| l.contains(" dst "))
    {
        println!("    {l}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nft_listings_give_each_sets_type_and_size() {
        let listing = "table ip dph-filter {\n\tchain c {\n\t\ttype filter hook input priority filter;\n\t}\n\tset dph40a {\n\t\ttype ipv4_addr\n\t\telements = { 10.0.0.1, 10.0.0.2,\n\t\t\t     10.0.0.3 }\n\t}\n\n\tset dph40n {\n\t\ttype ipv4_addr\n\t\tflags interval\n\t}\n}\n";
        assert_eq!(
            nft_sets(listing),
            vec![
                ("dph40a".into(), "ipv4_addr".into(), 3),
                ("dph40n".into(), "ipv4_addr (interval)".into(), 0)
            ]
        );
    }

    #[test]
    fn bundled_scenario_parses_and_ends_in_sync() {
        let mut msgs = dphandler_proto::text::parse_to_dataplane(SCENARIO).unwrap();
        dphandler_proto::text::number(&mut msgs);
        assert_eq!(msgs.len(), 17);
        assert!(matches!(
            msgs.last().unwrap().payload,
            Some(Payload::InSync(_))
        ));
        // Exactly one message is invalid, on purpose.
        let bad: Vec<u64> = msgs
            .into_iter()
            .filter_map(|m| {
                let seq = m.sequence_number;
                dphandler_proto::convert::to_update(m).err().map(|_| seq)
            })
            .collect();
        assert_eq!(bad, [9]);
    }
}
