//! Policy scenarios checked with real packets, IPv4 and IPv6: for each, a
//! policy goes in over gRPC and a matrix of TCP, UDP and ICMP probes from
//! workload w1 to workload w2 (both in namespaces of their own, joined to
//! the daemon's "host" namespace by veth pairs) must connect exactly where
//! the policy allows. All traffic stays inside the test's namespaces.
//! Needs root.

use anyhow::{Result, bail};
use dphandler_tests::lab::{
    Probe, WorkloadSpec, forget_ipv6_neighbours, probe, serve, workload, yaml_msgs,
};
use dphandler_tests::{Daemon, Netns, privileged, push, tempdir};

const W1: (&str, &str) = ("10.65.0.2", "fd00:65::2");
const W2: (&str, &str) = ("10.65.0.3", "fd00:65::3");

const PROBES: [Probe; 6] = [
    Probe::Tcp(80),
    Probe::Tcp(81),
    Probe::Tcp(8080),
    Probe::Udp(53),
    Probe::Udp(54),
    Probe::Icmp,
];

struct Case {
    name: &'static str,
    /// YAML messages for the scenario (policies, sets, endpoints).
    yaml: String,
    /// Probes expected to connect, for IPv4 and for IPv6.
    v4: &'static [Probe],
    v6: &'static [Probe],
}

fn wep(iface: &str, (v4, v6): (&str, &str), extra: &str) -> String {
    format!(
        "workloadEndpointUpdate:\n  id: {{orchestratorId: k8s, workloadId: ns/{iface}, endpointId: eth0}}\n  endpoint:\n    name: {iface}\n    ipv4Nets: [{v4}/32]\n    ipv6Nets: ['{v6}/128']\n    profileIds: [kns.ns]\n{extra}"
    )
}

/// w2 with one tier (default deny unless `default` says pass) on ingress.
fn w2_ingress(policies: &[&str], default: &str) -> String {
    let list = policies
        .iter()
        .map(|p| format!("{{name: {p}}}"))
        .collect::<Vec<_>>()
        .join(", ");
    wep(
        "cali2",
        W2,
        &format!(
            "    tiers:\n      - name: t\n        ingressPolicies: [{list}]\n        defaultAction: {default}\n"
        ),
    )
}

fn policy(name: &str, dir: &str, rules: &str) -> String {
    format!(
        "activePolicyUpdate:\n  id: {{name: {name}}}\n  policy:\n    tier: t\n    {dir}:\n{rules}"
    )
}

fn ingress_case(
    name: &'static str,
    rules: &str,
    v4: &'static [Probe],
    v6: &'static [Probe],
) -> Case {
    Case {
        name,
        yaml: format!(
            "{}---\n{}",
            policy("t.p", "inboundRules", rules),
            w2_ingress(&["t.p"], "deny")
        ),
        v4,
        v6,
    }
}

use Probe::{Icmp, Tcp, Udp};

fn cases() -> Vec<Case> {
    let all: &[Probe] = &PROBES;
    let w1_nets = format!("['{}/32', '{}/128']", W1.0, W1.1);
    vec![
        ingress_case("allow tcp/80", "      - {action: allow, protocol: {name: tcp}, dstPorts: [{first: 80}]}\n", &[Tcp(80)], &[Tcp(80)]),
        ingress_case("port range 80-81", "      - {action: allow, protocol: {name: tcp}, dstPorts: [{first: 80, last: 81}]}\n", &[Tcp(80), Tcp(81)], &[Tcp(80), Tcp(81)]),
        ingress_case("protocol by number (tcp = 6)", "      - {action: allow, protocol: {number: 6}}\n", &[Tcp(80), Tcp(81), Tcp(8080)], &[Tcp(80), Tcp(81), Tcp(8080)]),
        ingress_case("allow udp/53", "      - {action: allow, protocol: {name: udp}, dstPorts: [{first: 53}]}\n", &[Udp(53)], &[Udp(53)]),
        ingress_case("icmp is v4 only, icmpv6 v6 only", "      - {action: allow, protocol: {name: icmp}}\n      - {action: allow, protocol: {name: icmpv6}}\n", &[Icmp], &[Icmp]),
        ingress_case("icmp echo type only", "      - {action: allow, protocol: {name: icmp}, icmpType: 8}\n      - {action: allow, protocol: {name: icmpv6}, icmpType: 128}\n", &[Icmp], &[Icmp]),
        ingress_case("icmp timestamp type does not allow echo", "      - {action: allow, protocol: {name: icmp}, icmpType: 13}\n", &[], &[]),
        ingress_case("source nets of w1", &format!("      - {{action: allow, srcNet: {w1_nets}}}\n"), all, all),
        ingress_case("source net elsewhere", "      - {action: allow, srcNet: ['10.99.0.0/16', 'fd99::/64']}\n", &[], &[]),
        ingress_case("several source nets, one is w1's", &format!("      - {{action: allow, srcNet: ['10.99.0.0/16', '{}/32', 'fd99::/64', '{}/128']}}\n", W1.0, W1.1), all, all),
        ingress_case("not source net w1", &format!("      - {{action: allow, notSrcNet: {w1_nets}}}\n"), &[], &[]),
        ingress_case("destination net of w2", &format!("      - {{action: allow, protocol: {{name: tcp}}, dstNet: ['{}/32', '{}/128']}}\n", W2.0, W2.1), &[Tcp(80), Tcp(81), Tcp(8080)], &[Tcp(80), Tcp(81), Tcp(8080)]),
        ingress_case("not destination ports", "      - {action: allow, protocol: {name: tcp}, notDstPorts: [{first: 80}]}\n", &[Tcp(81), Tcp(8080)], &[Tcp(81), Tcp(8080)]),
        ingress_case("not protocol udp", "      - {action: allow, notProtocol: {name: udp}}\n", &[Tcp(80), Tcp(81), Tcp(8080), Icmp], &[Tcp(80), Tcp(81), Tcp(8080), Icmp]),
        ingress_case("deny tcp/80 before allow all", "      - {action: deny, protocol: {name: tcp}, dstPorts: [{first: 80}]}\n      - {action: allow}\n", &[Tcp(81), Tcp(8080), Udp(53), Udp(54), Icmp], &[Tcp(81), Tcp(8080), Udp(53), Udp(54), Icmp]),
        ingress_case("log does not end evaluation", "      - {action: log, protocol: {name: tcp}}\n      - {action: allow, protocol: {name: tcp}, dstPorts: [{first: 81}]}\n", &[Tcp(81)], &[Tcp(81)]),
        ingress_case("ip version 4 only", "      - {action: allow, ipVersion: IPV4}\n", all, &[]),
        ingress_case("more than 15 ports", &format!("      - {{action: allow, protocol: {{name: tcp}}, dstPorts: [{}]}}\n", (0..20).map(|i| format!("{{first: {}}}", if i == 19 { 8080 } else { 1000 + i })).collect::<Vec<_>>().join(", ")), &[Tcp(8080)], &[Tcp(8080)]),
        ingress_case("http match cannot be enforced: fails closed", "      - {action: allow, httpMatch: {methods: [GET]}}\n", &[], &[]),
        Case {
            name: "source IP set with w1",
            yaml: format!(
                "ipsetUpdate: {{id: 's:c', type: IP, members: ['{}', '{}']}}\n---\n{}---\n{}",
                W1.0, W1.1,
                policy("t.p", "inboundRules", "      - {action: allow, srcIpSetIds: ['s:c']}\n"),
                w2_ingress(&["t.p"], "deny")
            ),
            v4: all,
            v6: all,
        },
        Case {
            name: "source IP set without w1 (v6 only)",
            yaml: format!(
                "ipsetUpdate: {{id: 's:c', type: IP, members: ['{}']}}\n---\n{}---\n{}",
                W1.1,
                policy("t.p", "inboundRules", "      - {action: allow, srcIpSetIds: ['s:c']}\n"),
                w2_ingress(&["t.p"], "deny")
            ),
            v4: &[],
            v6: all,
        },
        Case {
            name: "not in source IP set",
            yaml: format!(
                "ipsetUpdate: {{id: 's:c', type: IP, members: ['{}', '{}']}}\n---\n{}---\n{}",
                W1.0, W1.1,
                policy("t.p", "inboundRules", "      - {action: allow, notSrcIpSetIds: ['s:c']}\n"),
                w2_ingress(&["t.p"], "deny")
            ),
            v4: &[],
            v6: &[],
        },
        Case {
            name: "named port through an ip,port set",
            yaml: format!(
                "ipsetUpdate: {{id: 'n:web', type: IP_AND_PORT, members: ['{},tcp:8080', '{},tcp:8080']}}\n---\n{}---\n{}",
                W2.0, W2.1,
                policy("t.p", "inboundRules", "      - {action: allow, protocol: {name: tcp}, dstNamedPortIpSetIds: ['n:web']}\n"),
                w2_ingress(&["t.p"], "deny")
            ),
            v4: &[Tcp(8080)],
            v6: &[Tcp(8080)],
        },
        Case {
            name: "pass to the next tier",
            yaml: format!(
                "{}---\n{}---\n{}",
                policy("t.pass", "inboundRules", "      - {action: pass, protocol: {name: tcp}}\n"),
                "activePolicyUpdate:\n  id: {name: u.p}\n  policy:\n    tier: u\n    inboundRules:\n      - {action: allow, protocol: {name: tcp}, dstPorts: [{first: 81}]}\n",
                wep("cali2", W2, "    tiers:\n      - name: t\n        ingressPolicies: [{name: t.pass}]\n        defaultAction: deny\n      - name: u\n        ingressPolicies: [{name: u.p}]\n        defaultAction: deny\n")
            ),
            v4: &[Tcp(81)],
            v6: &[Tcp(81)],
        },
        Case {
            name: "pass default hands over to the profile",
            yaml: format!(
                "{}---\n{}",
                policy("t.p", "inboundRules", "      - {action: deny, protocol: {name: udp}}\n"),
                w2_ingress(&["t.p"], "pass")
            ),
            v4: &[Tcp(80), Tcp(81), Tcp(8080), Icmp],
            v6: &[Tcp(80), Tcp(81), Tcp(8080), Icmp],
        },
        Case {
            name: "egress policy on w1 denies udp",
            yaml: format!(
                "{}---\n{}",
                policy("t.e", "outboundRules", "      - {action: deny, protocol: {name: udp}}\n      - {action: allow}\n"),
                wep("cali1", W1, "    tiers:\n      - name: t\n        egressPolicies: [{name: t.e}]\n        defaultAction: deny\n")
            ),
            v4: &[Tcp(80), Tcp(81), Tcp(8080), Icmp],
            v6: &[Tcp(80), Tcp(81), Tcp(8080), Icmp],
        },
        Case {
            name: "profile that denies",
            yaml: "activeProfileUpdate:\n  id: {name: kns.ns}\n  profile:\n    inboundRules: [{action: deny}]\n    outboundRules: [{action: allow}]\n".into(),
            v4: &[],
            v6: &[],
        },
        Case {
            name: "admin down",
            yaml: wep("cali2", W2, "    state: down\n"),
            v4: &[],
            v6: &[],
        },
    ]
}

/// The baseline every case starts from: both endpoints with the allow-all
/// profile and no tiers; no policies.
fn baseline() -> String {
    format!(
        "activeProfileUpdate:\n  id: {{name: kns.ns}}\n  profile:\n    inboundRules: [{{action: allow}}]\n    outboundRules: [{{action: allow}}]\n---\n{}---\n{}",
        wep("cali1", W1, ""),
        wep("cali2", W2, "")
    )
}

#[tokio::test]
async fn policy_scenarios_v4_and_v6() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let host = Netns::new("mxhost")?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    let spec = |iface, n, (v4, v6): (&'static str, &'static str)| WorkloadSpec {
        iface,
        n,
        v4,
        v6: Some(v6),
        host_route: true,
        host_neigh: true,
    };
    let w1 = workload(&host, spec("cali1", 1, W1))?;
    let w2 = workload(&host, spec("cali2", 2, W2))?;
    let _s = serve(&w2.0, &[80, 81, 8080], &[53, 54]);
    let d = Daemon::start(&host, &dir.path().join("dp.sock"), &[])?;
    let mut c = d.connect().await?;
    let mut seq = 1;
    let mut send = |yaml: String| {
        let msgs = yaml_msgs(seq, &yaml);
        seq += msgs.len() as u64;
        msgs
    };
    let (rej, _) = push(
        &mut c,
        [send(baseline()), send("inSync: {}\n".into())].concat(),
    )
    .await?;
    assert!(rej.is_empty(), "{rej:?}");
    // With the baseline everything connects, both families.
    for (to, v) in [(W2.0, "v4"), (W2.1, "v6")] {
        for p in PROBES {
            assert!(
                probe(&w1, to, p),
                "baseline {v} {p:?} does not connect: the lab is broken"
            );
        }
    }
    let mut failures = Vec::new();
    let cases = cases();
    for case in &cases {
        // Back to the baseline (a new snapshot removes the case's leftovers).
        let (rej, _) = push(
            &mut c,
            [send(baseline()), send("inSync: {}\n".into())].concat(),
        )
        .await?;
        assert!(rej.is_empty(), "{rej:?}");
        let (rej, _) = push(&mut c, send(case.yaml.clone())).await?;
        if !rej.is_empty() {
            failures.push(format!("{}: rejected {rej:?}", case.name));
            continue;
        }
        // Every case resolves its IPv6 next hops by NDP anew, under its
        // own policy (no neighbour learnt in an earlier case helps).
        for ns in [&host, &w1, &w2] {
            forget_ipv6_neighbours(ns)?;
        }
        // All probes of a case at once (each waits up to 0.4 s when dropped).
        let results: Vec<(&str, Probe, bool, bool)> = std::thread::scope(|sc| {
            let handles: Vec<_> = [(W2.0, case.v4, "v4"), (W2.1, case.v6, "v6")]
                .into_iter()
                .flat_map(|(to, want, v)| PROBES.map(move |p| (to, want, v, p)))
                .map(|(to, want, v, p)| {
                    let w1 = &w1;
                    sc.spawn(move || (v, p, probe(w1, to, p), want.contains(&p)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (v, p, got, want) in results {
            if got != want {
                failures.push(format!(
                    "{}: {v} {p:?} {}",
                    case.name,
                    if got { "connected" } else { "was blocked" }
                ));
            }
        }
    }
    eprintln!(
        "{} scenarios, {} probes each",
        cases.len(),
        2 * PROBES.len()
    );
    if !failures.is_empty() {
        bail!(
            "{} unexpected results:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    Ok(())
}
