//! IPv6 on a node with the kernel's defaults: fresh namespaces in which
//! nothing but the daemon sets a sysctl, workloads wired as Calico's CNI
//! wires them (IPv6 default route via the host side's link-local address,
//! next hops found by NDP, no static IPv6 neighbours anywhere). The daemon
//! must turn forwarding on and let the workloads' NDP through whatever
//! their egress policy says; policy still decides everything else. TCP,
//! UDP and ICMPv6 between three workloads, both directions. All traffic
//! stays inside the test's namespaces. Needs root.

use anyhow::{Result, bail};
use dphandler_tests::kernel;
use dphandler_tests::lab::{
    HOST_SIDE_LL, Probe, forget_ipv6_neighbours, probe, serve, workload_dual, yaml_msgs,
};
use dphandler_tests::{Daemon, Netns, privileged, push, tempdir};

/// (interface, MAC suffix, IPv4, IPv6): w3 is in another IPv6 prefix.
const WL: [(&str, u8, &str, &str); 3] = [
    ("cali1", 1, "10.65.0.2", "fd00:65::2"),
    ("cali2", 2, "10.65.0.3", "fd00:65::3"),
    ("cali3", 3, "10.65.1.4", "fd00:66::4"),
];

const PROBES: [Probe; 3] = [Probe::Tcp(80), Probe::Udp(53), Probe::Icmp];

/// How nft prints ICMPv6 types 130, 131, 132, 133, 135 and 136.
const ICMPV6_NAMES: [&str; 6] = [
    "mld-listener-query",
    "mld-listener-report",
    "mld-listener-done",
    "nd-router-solicit",
    "nd-neighbor-solicit",
    "nd-neighbor-advert",
];
const V4_FORWARD: &str = "net.ipv4.ip_forward";
const V6_FORWARD: &str = "net.ipv6.conf.all.forwarding";
const CT_ACCT: &str = "net.netfilter.nf_conntrack_acct";

fn sysctl(ns: &Netns, key: &str) -> Result<String> {
    let out = ns.run("sysctl", &["-n", key])?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A workload endpoint message for workload `i` (0-based) of [`WL`].
fn wep(i: usize, extra: &str) -> String {
    let (iface, n, v4, v6) = WL[i];
    format!(
        "workloadEndpointUpdate:\n  id: {{orchestratorId: k8s, workloadId: ns/{iface}, endpointId: eth0}}\n  endpoint:\n    name: {iface}\n    mac: '02:00:00:00:00:{n:02x}'\n    ipv4Nets: [{v4}/32]\n    ipv6Nets: ['{v6}/128']\n    profileIds: [kns.ns]\n{extra}"
    )
}

/// Every workload with the allow-all profile, no policy.
fn baseline() -> String {
    format!(
        "activeProfileUpdate:\n  id: {{name: kns.ns}}\n  profile:\n    inboundRules: [{{action: allow}}]\n    outboundRules: [{{action: allow}}]\n---\n{}---\n{}---\n{}",
        wep(0, ""),
        wep(1, ""),
        wep(2, "")
    )
}

/// A policy `name` with `rules` in direction `dir` (`inboundRules` /
/// `outboundRules`), applied to w1 in that direction in tier `t` (default
/// deny).
fn on_w1(name: &str, dir: &str, rules: &str) -> String {
    let which = if dir == "inboundRules" {
        "ingressPolicies"
    } else {
        "egressPolicies"
    };
    format!(
        "activePolicyUpdate:\n  id: {{name: t.{name}}}\n  policy:\n    tier: t\n    {dir}:\n{rules}---\n{}",
        wep(
            0,
            &format!(
                "    tiers:\n      - name: t\n        {which}: [{{name: t.{name}}}]\n        defaultAction: deny\n"
            )
        )
    )
}

struct Scenario {
    name: &'static str,
    yaml: String,
    /// Directed pairs (from, to) of workloads that connect over IPv6, by
    /// every probe; every other pair must be blocked by every probe.
    open: &'static [(usize, usize)],
}

const ALL_PAIRS: [(usize, usize); 6] = [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)];

fn scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "allow-all profile, no policy",
            yaml: String::new(),
            open: &ALL_PAIRS,
        },
        Scenario {
            // The policy a user writes to keep a pod inside its network:
            // NDP to the gateway is not in that prefix, and must still work.
            name: "w1 egress allows only the global prefix fd00:65::/64",
            yaml: on_w1(
                "prefix",
                "outboundRules",
                "      - {action: allow, dstNet: ['fd00:65::/64']}\n",
            ),
            open: &[(0, 1), (1, 0), (1, 2), (2, 0), (2, 1)],
        },
        Scenario {
            name: "w1 egress allows only one peer (w3)",
            yaml: on_w1(
                "peer",
                "outboundRules",
                "      - {action: allow, dstNet: ['fd00:66::4/128']}\n",
            ),
            open: &[(0, 2), (1, 0), (1, 2), (2, 0), (2, 1)],
        },
        Scenario {
            name: "w1 ingress allows only from one peer (w2)",
            yaml: on_w1(
                "from",
                "inboundRules",
                "      - {action: allow, srcNet: ['fd00:65::3/128']}\n",
            ),
            open: &[(0, 1), (0, 2), (1, 0), (1, 2), (2, 1)],
        },
    ]
}

/// The lab: a host namespace with the kernel's defaults, three workloads
/// with servers (TCP 80, UDP echo 53).
struct Lab {
    host: Netns,
    wls: Vec<Netns>,
    _servers: Vec<dphandler_tests::lab::Servers>,
}

fn lab(tag: &str) -> Result<Lab> {
    let host = Netns::new(tag)?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    // The starting point this test is about: nothing forwards.
    for key in [V4_FORWARD, V6_FORWARD] {
        if sysctl(&host, key)? != "0" {
            bail!("{key} is not 0 in a fresh namespace: this kernel's defaults differ");
        }
    }
    let mut wls = Vec::new();
    let mut servers = Vec::new();
    for (iface, n, v4, v6) in WL {
        let wl = workload_dual(&host, iface, n, v4, v6)?;
        servers.push(serve(&wl.0, &[80], &[53]));
        wls.push(wl);
    }
    Ok(Lab {
        host,
        wls,
        _servers: servers,
    })
}

impl Lab {
    /// Every probe between every pair over IPv6, at once, after every
    /// namespace forgot its learnt neighbours (so each probe begins with
    /// NDP under the policy in force). Returns (from, to, probe, connected).
    fn probe_all(&self) -> Result<Vec<(usize, usize, Probe, bool)>> {
        for ns in std::iter::once(&self.host).chain(&self.wls) {
            forget_ipv6_neighbours(ns)?;
        }
        Ok(std::thread::scope(|sc| {
            let handles: Vec<_> = ALL_PAIRS
                .iter()
                .flat_map(|&(a, b)| PROBES.map(move |p| (a, b, p)))
                .map(|(a, b, p)| {
                    let from = &self.wls[a];
                    sc.spawn(move || (a, b, p, probe(from, WL[b].3, p)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        }))
    }
}

#[tokio::test]
async fn ipv6_policy_on_a_node_with_kernel_defaults() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let lab = lab("v6host")?;
    let host = &lab.host;
    let d = Daemon::start(host, &dir.path().join("dp.sock"), &[])?;
    let mut c = d.connect().await?;
    let mut seq = 1;
    let mut numbered = |yaml: &str| {
        let msgs = yaml_msgs(seq, yaml);
        seq += msgs.len() as u64;
        msgs
    };
    let snapshot = format!("{}---\ninSync: {{}}\n", baseline());
    let (rej, _) = push(&mut c, numbered(&snapshot)).await?;
    assert!(rej.is_empty(), "{rej:?}");

    // What the daemon set, globally and per workload interface.
    assert_eq!(sysctl(host, V4_FORWARD)?, "1");
    assert_eq!(sysctl(host, V6_FORWARD)?, "1");
    assert_eq!(sysctl(host, CT_ACCT)?, "1");
    for (iface, ..) in WL {
        assert_eq!(
            sysctl(host, &format!("net.ipv6.conf.{iface}.accept_ra"))?,
            "0"
        );
        assert_eq!(
            sysctl(host, &format!("net.ipv6.conf.{iface}.proxy_ndp"))?,
            "1"
        );
    }
    // The ICMPv6 exception, before the jump to the workloads' egress.
    let chain = kernel::our_chain(host, true, "filter", "dph-INPUT")?;
    let input: Vec<&str> = chain
        .lines()
        .filter(|l| l.starts_with("-A dph-INPUT ") || l.contains("comment \"dph:"))
        .collect();
    for (i, t) in [130, 131, 132, 133, 135, 136].iter().enumerate() {
        let (iface, want) = if kernel::nftables() {
            ("iifname \"cali*\"", ICMPV6_NAMES[i].to_string())
        } else {
            ("-i cali+ -p ipv6-icmp", format!("--icmpv6-type {t} "))
        };
        assert!(
            input[i].contains(iface) && input[i].contains(&want),
            "dph-INPUT rule {i} is not the ICMPv6 type {t} accept:\n{}",
            input.join("\n")
        );
    }
    assert!(
        input[6].contains(kernel::spelled(
            "-j dph-from-wl-dispatch",
            "jump dph-from-wl-dispatch"
        )),
        "{input:?}"
    );
    // IPv6 neighbours are NDP's: no static one (the IPv4 ones are ours).
    let neigh = host.run("ip", &["-6", "neigh", "show", "nud", "permanent"])?;
    assert!(
        String::from_utf8_lossy(&neigh.stdout).trim().is_empty(),
        "static IPv6 neighbours: {}",
        String::from_utf8_lossy(&neigh.stdout)
    );
    let neigh = host.run("ip", &["-4", "neigh", "show", "nud", "permanent"])?;
    assert_eq!(
        String::from_utf8_lossy(&neigh.stdout).lines().count(),
        3,
        "one static ARP entry per workload"
    );

    let mut failures = Vec::new();
    for s in scenarios() {
        let (rej, _) = push(&mut c, numbered(&snapshot)).await?;
        assert!(rej.is_empty(), "{rej:?}");
        if !s.yaml.is_empty() {
            let (rej, _) = push(&mut c, numbered(&s.yaml)).await?;
            assert!(rej.is_empty(), "{}: {rej:?}", s.name);
        }
        for (a, b, p, got) in lab.probe_all()? {
            let want = s.open.contains(&(a, b));
            if got != want {
                failures.push(format!(
                    "{}: w{} -> w{} {p:?} {}",
                    s.name,
                    a + 1,
                    b + 1,
                    if got { "connected" } else { "was blocked" }
                ));
            }
        }
        // The IPv6-only rule allows no IPv4 from w1.
        if s.name.contains("only the global prefix") && probe(&lab.wls[0], WL[1].2, Probe::Tcp(80))
        {
            failures.push(format!("{}: IPv4 w1 -> w2 connected", s.name));
        }
    }
    if !failures.is_empty() {
        bail!(
            "{} unexpected results:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    // The workloads' gateway is still the host side's link-local address,
    // learnt by NDP (not a static entry).
    let n = lab.wls[0].run("ip", &["-6", "neigh", "show", HOST_SIDE_LL])?;
    let n = String::from_utf8_lossy(&n.stdout);
    assert!(
        n.contains("ee:ee:ee:ee:ee:ee") && !n.contains("PERMANENT"),
        "{n}"
    );
    Ok(())
}

#[tokio::test]
async fn ip_forwarding_disabled_leaves_the_forwarding_sysctls_alone() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let lab = lab("fwdoff")?;
    let host = &lab.host;
    // Whoever manages this node turned IPv4 forwarding on themselves and
    // left IPv6 off: with `disabled` that is theirs to decide.
    host.run("sysctl", &["-qw", &format!("{V4_FORWARD}=1")])?;
    let snapshot = format!("{}---\ninSync: {{}}\n", baseline());
    {
        let d = Daemon::start(
            host,
            &dir.path().join("off.sock"),
            &["--ip-forwarding", "disabled"],
        )?;
        let mut c = d.connect().await?;
        let (rej, _) = push(&mut c, yaml_msgs(1, &snapshot)).await?;
        assert!(rej.is_empty(), "{rej:?}");
        assert_eq!(sysctl(host, V4_FORWARD)?, "1", "left as it was");
        assert_eq!(sysctl(host, V6_FORWARD)?, "0", "left as it was");
        assert_eq!(sysctl(host, CT_ACCT)?, "1", "set either way, as Felix");
        assert!(
            probe(&lab.wls[0], WL[1].2, Probe::Tcp(80)),
            "IPv4 forwards (the admin's setting)"
        );
        assert!(
            !probe(&lab.wls[0], WL[1].3, Probe::Tcp(80)),
            "IPv6 does not forward: nobody turned it on"
        );
        d.stop()?;
    }
    // The same node with the default: the daemon turns IPv6 on.
    let d = Daemon::start(host, &dir.path().join("on.sock"), &[])?;
    let mut c = d.connect().await?;
    let (rej, _) = push(&mut c, yaml_msgs(1, &snapshot)).await?;
    assert!(rej.is_empty(), "{rej:?}");
    assert_eq!(sysctl(host, V6_FORWARD)?, "1");
    for p in PROBES {
        assert!(probe(&lab.wls[0], WL[1].3, p), "IPv6 {p:?} w1 -> w2");
    }
    Ok(())
}
