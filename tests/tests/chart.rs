//! The Helm chart, `charts/dphandler`:
//! - `helm lint --strict` and `helm template` over every value set in
//!   `charts/dphandler/ci/`; the manifests validated offline against the
//!   Kubernetes schemas of the oldest version the chart supports and the
//!   newest (`kubernetes-validate --strict`), and the ServiceMonitor /
//!   PodMonitor against prometheus-operator's (`tests/tools/
//!   validate-monitors.mjs`);
//! - values the daemon would refuse, or that cannot work together, fail
//!   the render naming the value;
//! - every `DPH_*` variable of `dphandler serve` (as its `--help` lists
//!   them) reaches the pod, and none that it does not know; the chart's
//!   defaults are the daemon's;
//! - the environment a rendered pod gets runs the real daemon (in a
//!   namespace of the test's own, with the host's `/proc/sys/net` bound
//!   where the pod mounts it), and the chart's probes reach its health
//!   endpoint: readiness 503 before the calc graph's InSync, 200 after.
//!
//! helm, kubernetes-validate and the monitor schemas come from
//! `scripts/install-packages.sh` (`.tools/`). The last two tests need root.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result, bail};
use dphandler_tests::lab::{http_get, yaml_msgs};
use dphandler_tests::tls::{ca_and_cert, cert};
use dphandler_tests::{Daemon, Netns, bin, privileged, push, tempdir};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn chart() -> PathBuf {
    root().join("charts/dphandler")
}

/// `.tools/`, when install-packages.sh has put the chart tools there.
fn tools() -> Option<PathBuf> {
    let t = root().join(".tools");
    if t.join("bin/helm").exists()
        && t.join("kubernetes-validate/bin/kubernetes-validate")
            .exists()
    {
        return Some(t);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must have helm and kubernetes-validate: scripts/install-packages.sh installs them"
    );
    eprintln!("skipped: helm is not installed (bash scripts/install-packages.sh)");
    None
}

fn run(cmd: &mut Command) -> Result<Output> {
    cmd.output()
        .with_context(|| format!("running {:?}", cmd.get_program()))
}

/// `helm template` with these arguments: the rendered documents, or the
/// error helm printed.
fn render(tools: &Path, args: &[&str]) -> Result<std::result::Result<Vec<Value>, String>> {
    let out = run(Command::new(tools.join("bin/helm"))
        .args(["template", "t"])
        .arg(chart())
        .args(args))?;
    if !out.status.success() {
        return Ok(Err(String::from_utf8_lossy(&out.stderr).into_owned()));
    }
    let text = String::from_utf8(out.stdout)?;
    let mut docs = Vec::new();
    for d in serde_yaml::Deserializer::from_str(&text) {
        let v: Value = serde::Deserialize::deserialize(d)?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(Ok(docs))
}

fn rendered(tools: &Path, args: &[&str]) -> Result<Vec<Value>> {
    render(tools, args)?.map_err(|e| anyhow::anyhow!("helm template {args:?}: {e}"))
}

fn value_sets() -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(chart().join("ci"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    v.sort();
    if v.len() < 4 {
        bail!("charts/dphandler/ci has {} value sets", v.len());
    }
    Ok(v)
}

/// The DaemonSet's one container.
fn container(docs: &[Value]) -> Result<&Value> {
    let ds: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "DaemonSet").collect();
    if ds.len() != 1 {
        bail!("{} DaemonSets rendered", ds.len());
    }
    Ok(&ds[0]["spec"]["template"]["spec"]["containers"][0])
}

/// The container's environment: name → value (`None` for `valueFrom`).
fn env(docs: &[Value]) -> Result<BTreeMap<String, Option<String>>> {
    let mut m = BTreeMap::new();
    for e in container(docs)?["env"].as_array().context("no env")? {
        let name = e["name"]
            .as_str()
            .context("env without a name")?
            .to_string();
        let value = e["value"].as_str().map(str::to_string);
        if value.is_none() && e.get("valueFrom").is_none() {
            bail!("{name} has neither value nor valueFrom");
        }
        if m.insert(name.clone(), value).is_some() {
            bail!("{name} is set twice");
        }
    }
    Ok(m)
}

/// `dphandler serve --help`: each DPH_* variable with the flag's default
/// (`None`: no default; `Some("")` for a switch, which is off).
fn daemon_vars() -> Result<BTreeMap<String, Option<String>>> {
    let out = run(Command::new(bin("dphandler")).args(["serve", "--help"]))?;
    let help = String::from_utf8(out.stdout)?;
    let mut vars = BTreeMap::new();
    // One entry per flag: "      --flag <VALUE>\n          text [env: X=] [default: y]".
    for entry in help.split("\n      --").skip(1) {
        let entry = entry.split_whitespace().collect::<Vec<_>>().join(" ");
        let Some(env) = entry.split("[env: ").nth(1) else {
            continue;
        };
        let name = env.split('=').next().unwrap_or_default().to_string();
        let takes_value = entry.split(' ').nth(1).is_some_and(|w| w.starts_with('<'));
        let default = entry
            .split("[default: ")
            .nth(1)
            .and_then(|d| d.split(']').next())
            .map(str::to_string)
            .or_else(|| (!takes_value).then(String::new));
        vars.insert(name, default);
    }
    if vars.len() < 50 {
        bail!(
            "found only {} DPH_* variables in --help: {help}",
            vars.len()
        );
    }
    Ok(vars)
}

#[test]
fn the_chart_lints_and_its_manifests_validate() -> Result<()> {
    let Some(tools) = tools() else {
        return Ok(());
    };
    let dir = tempdir()?;
    let mut monitors = Vec::new();
    for set in value_sets()? {
        let name = set.file_name().unwrap().to_string_lossy().into_owned();
        let out = run(Command::new(tools.join("bin/helm"))
            .args(["lint", "--strict"])
            .arg(chart())
            .arg("-f")
            .arg(&set))?;
        assert!(
            out.status.success(),
            "helm lint --strict -f {name}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let docs = rendered(&tools, &["-f", set.to_str().unwrap()])?;
        container(&docs)?;
        let file = dir.path().join(&name);
        let mut text = String::new();
        for d in &docs {
            let kind = d["kind"].as_str().unwrap_or_default();
            if kind.ends_with("Monitor") {
                monitors.push(d.clone());
            } else {
                text.push_str("---\n");
                text.push_str(&serde_yaml::to_string(d)?);
            }
        }
        std::fs::write(&file, text)?;
        // The chart's floor (Chart.yaml's kubeVersion) and the newest.
        for version in ["1.27.0", "1.37.0"] {
            let out = run(
                Command::new(tools.join("kubernetes-validate/bin/kubernetes-validate"))
                    .args(["--strict", "-k", version])
                    .arg(&file),
            )?;
            let said = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                out.status.success(),
                "{name} against Kubernetes {version}: {said}"
            );
            assert!(
                !said.contains("Couldn't find schema"),
                "{name} against Kubernetes {version}: {said}"
            );
            let passed = said.matches(" passed for resource ").count();
            assert_eq!(
                passed,
                docs.len()
                    - docs
                        .iter()
                        .filter(|d| d["kind"].as_str().unwrap_or_default().ends_with("Monitor"))
                        .count(),
                "{name} against Kubernetes {version}: {said}"
            );
        }
    }
    let kinds: BTreeSet<&str> = monitors.iter().filter_map(|m| m["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        BTreeSet::from(["PodMonitor", "ServiceMonitor"]),
        "the value sets render both monitors"
    );
    let mut node = Command::new("node")
        .arg(root().join("tests/tools/validate-monitors.mjs"))
        .arg(&tools)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running node")?;
    std::io::Write::write_all(
        &mut node.stdin.take().unwrap(),
        serde_json::to_string(&monitors)?.as_bytes(),
    )?;
    let out = node.wait_with_output()?;
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "monitors: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(said.matches("valid ").count(), monitors.len(), "{said}");
    Ok(())
}

#[test]
fn values_that_cannot_work_are_refused_naming_them() -> Result<()> {
    let Some(tools) = tools() else {
        return Ok(());
    };
    for (args, says) in [
        // The schema: what the daemon would refuse at start.
        (vec!["config.prefix=toolongprefix"], "/config/prefix"),
        (
            vec!["config.iptablesRefreshSecond=3"],
            "iptablesRefreshSecond",
        ),
        (vec!["config.vxlan=on"], "/config/vxlan"),
        (vec!["config.routeProtocol=3"], "/config/routeProtocol"),
        (
            vec!["config.failsafeInbound=tcp22"],
            "/config/failsafeInbound",
        ),
        (
            vec!["config.wireguardInterface=a-name-far-too-long"],
            "/config/wireguardInterface",
        ),
        (vec!["config.vxlanMtuV6=1200"], "/config/vxlanMtuV6"),
        (vec!["stateDir=relative/dir"], "/stateDir"),
        (vec!["tcp.address=50051"], "/tcp/address"),
        (vec!["image.pullPolicy=Sometimes"], "/image/pullPolicy"),
        // The templates: settings that do not work together.
        (vec!["tcp.enabled=true"], "tcp.tlsSecret"),
        (
            vec!["tcp.enabled=true", "tcp.insecure=true", "tcp.tlsSecret=s"],
            "exclude each other",
        ),
        (vec!["metrics.podMonitor.enabled=true"], "metrics.address"),
        (
            vec![
                "metrics.serviceMonitor.enabled=true",
                "metrics.enabled=false",
                "metrics.address=0.0.0.0",
            ],
            "metrics.enabled",
        ),
        (vec!["config.wireguardImpl=userspace"], "privileged=true"),
    ] {
        let mut a = Vec::new();
        for s in &args {
            a.extend(["--set", s]);
        }
        match render(&tools, &a)? {
            Ok(_) => panic!("helm template --set {args:?} rendered"),
            Err(e) => assert!(e.contains(says), "--set {args:?}: {e}"),
        }
    }
    Ok(())
}

/// Flags the chart sets from its own sections (mounts, probes, the TLS
/// Secret) rather than from `config`: the value in values.yaml that
/// decides each.
const STRUCTURAL: &[(&str, &str)] = &[
    ("DPH_SOCKET", "socket:"),
    ("DPH_TCP", "tcp:"),
    ("DPH_TLS_CERT", "tlsSecret:"),
    ("DPH_TLS_KEY", "tlsSecret:"),
    ("DPH_TLS_CA", "tlsSecret:"),
    ("DPH_INSECURE_TCP", "insecure:"),
    ("DPH_STATE_DIR", "stateDir:"),
    ("DPH_BPFFS", "bpffs:"),
    ("DPH_HEALTH_ADDR", "health:"),
    ("DPH_METRICS_ADDR", "metrics:"),
    ("DPH_PROC_SYS", "privileged:"),
];

/// `DPH_FOO_BAR` → `fooBar`, the key in values.yaml's `config`.
fn config_key(var: &str) -> String {
    let mut key = String::new();
    for (i, part) in var.trim_start_matches("DPH_").split('_').enumerate() {
        let part = part.to_ascii_lowercase();
        if i == 0 {
            key.push_str(&part);
        } else {
            let mut c = part.chars();
            key.extend(c.next().map(|c| c.to_ascii_uppercase()));
            key.push_str(c.as_str());
        }
    }
    key
}

#[test]
fn every_daemon_variable_is_in_values_yaml_and_reaches_the_pod() -> Result<()> {
    let Some(tools) = tools() else {
        return Ok(());
    };
    let vars = daemon_vars()?;
    let values = std::fs::read_to_string(chart().join("values.yaml"))?;
    for var in vars.keys() {
        let key = match STRUCTURAL.iter().find(|(v, _)| v == var) {
            Some((_, key)) => key.to_string(),
            None => format!("  {}:", config_key(var)),
        };
        assert!(values.contains(&key), "{var}: values.yaml has no {key:?}");
    }
    // The everything set gives every setting; TLS needs a Secret (the
    // everything set serves insecure TCP instead).
    let mut seen = BTreeSet::new();
    for set in ["everything-values.yaml", "tcp-mtls-values.yaml"] {
        let path = chart().join("ci").join(set);
        let env = env(&rendered(&tools, &["-f", path.to_str().unwrap()])?)?;
        for name in env.keys() {
            if name.starts_with("DPH_") {
                assert!(vars.contains_key(name), "{set}: the daemon has no {name}");
                seen.insert(name.clone());
            }
        }
    }
    let missing: Vec<_> = vars.keys().filter(|v| !seen.contains(*v)).collect();
    assert!(missing.is_empty(), "never reach the pod: {missing:?}");
    Ok(())
}

#[test]
fn the_charts_defaults_are_the_daemons() -> Result<()> {
    let Some(tools) = tools() else {
        return Ok(());
    };
    let vars = daemon_vars()?;
    let env = env(&rendered(&tools, &[])?)?;
    for (var, default) in &vars {
        let got = env.get(var);
        match (var.as_str(), default, got) {
            // The pod's own: the node's name from the downward API, and the
            // host's /proc/sys/net where an unprivileged pod can write it.
            ("DPH_HOSTNAME", _, Some(None)) => {}
            ("DPH_PROC_SYS", _, Some(Some(v))) => assert_eq!(v, "/host/proc/sys"),
            (_, None, None) => {}
            (_, Some(d), None) if d.is_empty() => {}
            (_, Some(d), Some(Some(v))) if d.is_empty() => {
                assert_eq!(v, "false", "{var}: a switch the daemon has off")
            }
            (_, Some(d), Some(Some(v))) => assert_eq!(v, d, "{var}"),
            _ => panic!("{var}: the daemon's default is {default:?}, the chart's {got:?}"),
        }
    }
    Ok(())
}

/// The env of a rendered pod, as the kubelet would give it to a pod on
/// node `node`, with the paths the pod mounts under `mounts` (its `/host`).
fn pod_env(
    env: &BTreeMap<String, Option<String>>,
    node: &str,
    mounts: &Path,
) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| {
            let v = match (k.as_str(), v) {
                ("DPH_HOSTNAME", None) => node.to_string(),
                ("DPH_PROC_SYS", Some(p)) => match p.strip_prefix("/host/") {
                    Some(rest) => mounts.join(rest).display().to_string(),
                    None => p.clone(),
                },
                // The TLS Secret's mount.
                (_, Some(p)) if p.starts_with("/etc/dphandler/tls/") => {
                    mounts.join(&p[1..]).display().to_string()
                }
                (_, v) => v.clone().unwrap_or_default(),
            };
            (k.clone(), v)
        })
        .collect();
    out.push(("PATH".into(), std::env::var("PATH").unwrap_or_default()));
    out
}

/// The probe's (host, port, path) from the rendered container.
fn probe(c: &Value, which: &str) -> Result<(String, u16, String)> {
    let g = &c[which]["httpGet"];
    Ok((
        g["host"].as_str().context("probe host")?.to_string(),
        u16::try_from(g["port"].as_u64().context("probe port")?)?,
        g["path"].as_str().context("probe path")?.to_string(),
    ))
}

/// The host's `/proc/sys/net`, bound at `<dir>/proc/sys/net` as the chart
/// mounts it at `/host/proc/sys/net`; unbound on drop. What the daemon
/// writes through it lands in its own network namespace's settings (the
/// kernel picks the namespace of whoever opens the file).
struct ProcSysNet(PathBuf);

impl ProcSysNet {
    fn bind(dir: &Path) -> Result<Self> {
        let target = dir.join("proc/sys/net");
        std::fs::create_dir_all(&target)?;
        nix::mount::mount(
            Some("/proc/sys/net"),
            &target,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .context("binding /proc/sys/net")?;
        Ok(Self(target))
    }
}

impl Drop for ProcSysNet {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

#[tokio::test]
async fn a_rendered_pods_environment_runs_the_daemon_and_its_probes_answer() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let Some(tools) = tools() else {
        return Ok(());
    };
    let dir = tempdir()?;
    let bpffs = dphandler_tests::lab::Bpffs::new()?;
    let run_dir = dir.path().join("run");
    let state = dir.path().join("state");
    let docs = rendered(
        &tools,
        &[
            "--set",
            &format!("socket.hostDir={}", run_dir.display()),
            "--set",
            &format!("stateDir={}", state.display()),
            "--set",
            &format!("bpffs={}", bpffs.path().display()),
        ],
    )?;
    let c = container(&docs)?;
    let env = env(&docs)?;
    let host = dir.path().join("host");
    let _net = ProcSysNet::bind(&host)?;
    let ns = Netns::new("chart")?;
    ns.run("ip", &["link", "set", "lo", "up"])?;
    let forwarding = || -> Result<String> {
        let out = ns.run("cat", &["/proc/sys/net/ipv4/ip_forward"])?;
        Ok(String::from_utf8(out.stdout)?.trim().to_string())
    };
    assert_eq!(
        forwarding()?,
        "0",
        "a new namespace starts without forwarding"
    );
    // The hostPath directories the kubelet makes (DirectoryOrCreate).
    std::fs::create_dir_all(&run_dir)?;
    std::fs::create_dir_all(&state)?;
    let mut cmd = ns.command(bin("dphandler"));
    cmd.args(
        c["args"]
            .as_array()
            .context("args")?
            .iter()
            .filter_map(Value::as_str),
    )
    .env_clear()
    .envs(pod_env(&env, "node-1", &host));
    let socket = PathBuf::from(env["DPH_SOCKET"].clone().context("DPH_SOCKET")?);
    let d = Daemon::spawn(cmd, &socket)?;
    let mut client = d.connect().await?;

    let (rh, rp, rpath) = probe(c, "readinessProbe")?;
    let (lh, lp, lpath) = probe(c, "livenessProbe")?;
    let (code, body) = http_get(&ns, &rh, rp, &rpath)?;
    assert_eq!(
        code, 503,
        "readiness before the calc graph's InSync: {body}"
    );
    assert_eq!(http_get(&ns, &lh, lp, &lpath)?.0, 200);

    let (rejected, programmed) = push(
        &mut client,
        yaml_msgs(
            1,
            "- ipsetUpdate: {id: 's:web', type: NET, members: ['10.0.0.0/24']}\n- inSync: {}\n",
        ),
    )
    .await?;
    assert!(rejected.is_empty(), "{rejected:?}");
    assert_eq!(programmed, 2);
    let (code, body) = http_get(&ns, &rh, rp, &rpath)?;
    assert_eq!(code, 200, "readiness after InSync: {body}");
    // Programmed with the chart's prefix, forwarding on through the pod's
    // /host/proc/sys (in this namespace only), metrics where the chart
    // says.
    let sets = ns.run("ipset", &["list", "-n"])?;
    assert!(
        String::from_utf8(sets.stdout)?.contains("dph40s:web"),
        "the set is programmed"
    );
    assert_eq!(forwarding()?, "1");
    let metrics = env["DPH_METRICS_ADDR"].clone().context("metrics")?;
    let (mhost, mport) = metrics.rsplit_once(':').context("host:port")?;
    let (code, body) = http_get(&ns, mhost, mport.parse()?, "/metrics")?;
    assert_eq!(code, 200);
    assert!(
        body.contains("dphandler_int_dataplane_apply_time_seconds_count"),
        "{body}"
    );
    assert!(d.stop()?.success());
    Ok(())
}

#[tokio::test]
async fn every_value_set_starts_the_daemon() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let Some(tools) = tools() else {
        return Ok(());
    };
    let dir = tempdir()?;
    // What the TLS Secret would hold, where the pod mounts it.
    let tls = dir.path().join("etc/dphandler/tls");
    std::fs::create_dir_all(&tls)?;
    ca_and_cert(&tls, "cluster", "server")?;
    cert(&tls, "cluster", "calc-graph")?;
    for (from, to) in [
        ("server.pem", "tls.crt"),
        ("server.key", "tls.key"),
        ("cluster-ca.pem", "ca.crt"),
    ] {
        std::fs::copy(tls.join(from), tls.join(to))?;
    }
    for set in value_sets()? {
        let name = set.file_stem().unwrap().to_string_lossy().into_owned();
        let docs = rendered(&tools, &["-f", set.to_str().unwrap()])?;
        let c = container(&docs)?;
        let mut env = env(&docs)?;
        let socket = dir.path().join(format!("{name}.sock"));
        // Where this test can have them; and a dry run, so that each
        // set's settings (kernel WireGuard, tables 3 and 4, …) are parsed
        // and checked but nothing is programmed.
        for (k, v) in [
            ("DPH_SOCKET", socket.display().to_string()),
            (
                "DPH_STATE_DIR",
                dir.path().join(&name).display().to_string(),
            ),
            ("DPH_DRY_RUN", "true".into()),
        ] {
            assert!(
                env.insert(k.into(), Some(v)).is_some(),
                "{name}: {k} is rendered"
            );
        }
        if let Some(p) = env.get_mut("DPH_PROC_SYS") {
            *p = Some("/proc/sys".into());
        }
        if let Some(p @ Some(_)) = env.get_mut("DPH_STATUS_SOCKET") {
            *p = Some(
                dir.path()
                    .join(format!("{name}-watch.sock"))
                    .display()
                    .to_string(),
            );
        }
        let ns = Netns::new("chartv")?;
        ns.run("ip", &["link", "set", "lo", "up"])?;
        let mut cmd = ns.command(bin("dphandler"));
        cmd.args(
            c["args"]
                .as_array()
                .context("args")?
                .iter()
                .filter_map(Value::as_str),
        )
        .env_clear()
        .envs(pod_env(&env, "node-1", dir.path()));
        let d = Daemon::spawn(cmd, &socket)?;
        d.connect().await.with_context(|| name.clone())?;
        let (h, p, path) = probe(c, "livenessProbe")?;
        assert_eq!(http_get(&ns, &h, p, &path)?.0, 200, "{name}");
        // A remote calc graph over the set's TCP listener, as the chart
        // configured it.
        if let Some(Some(addr)) = env.get("DPH_TCP") {
            let port = addr.rsplit_once(':').context("host:port")?.1;
            let ctl = || {
                let mut ctl = ns.command(bin("dphctl"));
                ctl.args(["--tcp", &format!("127.0.0.1:{port}")]);
                if env.contains_key("DPH_TLS_CA") {
                    ctl.arg("--tls-ca")
                        .arg(tls.join("cluster-ca.pem"))
                        .arg("--tls-cert")
                        .arg(tls.join("calc-graph.pem"))
                        .arg("--tls-key")
                        .arg(tls.join("calc-graph.key"))
                        .args(["--tls-server-name", "localhost"]);
                } else {
                    ctl.arg("--insecure-tcp");
                }
                ctl.args(["status", "--json"]);
                ctl
            };
            let mut ok = false;
            for _ in 0..50 {
                if run(&mut ctl())?.status.success() {
                    ok = true;
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            assert!(ok, "{name}: dphctl over {addr}");
        }
        let st = d.stop()?;
        assert!(st.success(), "{name}: {st:?}");
    }
    Ok(())
}

/// The pod is held to what it needs: no privilege escalation, the
/// runtime's seccomp profile, a read-only root filesystem (what it writes
/// goes to its mounts), a memory limit (a system-node-critical pod without
/// one would have the kernel kill workloads first). A privileged pod
/// (wireguard-go's /dev/net/tun) keeps the read-only root and the limit.
#[test]
fn the_pod_is_held_to_what_it_needs() -> Result<()> {
    let Some(tools) = tools() else {
        return Ok(());
    };
    let docs = rendered(&tools, &[])?;
    let c = container(&docs)?;
    let sc = &c["securityContext"];
    assert_eq!(sc["allowPrivilegeEscalation"], Value::Bool(false), "{sc}");
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault", "{sc}");
    assert_eq!(sc["readOnlyRootFilesystem"], Value::Bool(true), "{sc}");
    assert_eq!(sc["capabilities"]["drop"][0], "ALL", "{sc}");
    assert!(
        c["resources"]["limits"]["memory"].is_string(),
        "{}",
        c["resources"]
    );
    let mounts: Vec<&str> = c["volumeMounts"]
        .as_array()
        .context("mounts")?
        .iter()
        .filter_map(|m| m["mountPath"].as_str())
        .collect();
    for writable in [
        "/tmp",
        "/run/wireguard",
        "/run/dphandler",
        "/var/lib/dphandler",
    ] {
        assert!(mounts.contains(&writable), "{writable} in {mounts:?}");
    }
    let path = chart().join("ci").join("privileged-values.yaml");
    let docs = rendered(&tools, &["-f", path.to_str().context("utf-8")?])?;
    let c = container(&docs)?;
    assert_eq!(c["securityContext"]["privileged"], Value::Bool(true));
    assert_eq!(
        c["securityContext"]["readOnlyRootFilesystem"],
        Value::Bool(true)
    );
    assert!(c["resources"]["limits"]["memory"].is_string());
    Ok(())
}
