//! Host endpoint policy with real packets: the daemon's "host" namespace
//! has an uplink to an "outside" namespace; a host endpoint on the uplink
//! polices what reaches the host and what leaves it, and the failsafe ports
//! stay open whatever the policy says. Traffic stays inside the test's
//! namespaces. Needs root.

use std::time::Duration;

use anyhow::Result;
use dphandler_tests::kernel;
use dphandler_tests::lab::{self, serve, tcp_ok, yaml_msgs};
use dphandler_tests::{Daemon, Netns, privileged, push, tempdir};

fn tcp(ns: &Netns, to: &str) -> bool {
    tcp_ok(ns, to.parse().unwrap(), Duration::from_millis(500))
}

#[tokio::test]
async fn host_endpoint_policy_and_failsafe_ports() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let host = Netns::new("hephost")?;
    let out = Netns::new("hepout")?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    lab::uplink(&host, &out, "up0", "10.99.0.1/24", "10.99.0.2/24")?;
    let _host_servers = serve(&host.0, &[22, 80, 8080], &[]);
    let _out_servers = serve(&out.0, &[9000], &[]);

    let d = Daemon::start(&host, &dir.path().join("dp.sock"), &["--ipv6", "false"])?;
    let mut c = d.connect().await?;
    let mut watch = c
        .status_updates(dphandler_proto::v1::StatusUpdatesRequest {})
        .await?
        .into_inner();
    let next_hep_status =
        async |w: &mut tonic::Streaming<dphandler_proto::v1::StatusUpdate>| -> Result<String> {
            loop {
                let u = tokio::time::timeout(Duration::from_secs(5), w.message())
                    .await??
                    .ok_or_else(|| anyhow::anyhow!("StatusUpdates ended"))?;
                let text = format!("{u:?}");
                if text.contains("HostEndpointStatus") {
                    return Ok(text);
                }
            }
        };
    let (rej, _) = push(&mut c, yaml_msgs(1, "inSync: {}\n")).await?;
    assert!(rej.is_empty());
    assert!(
        tcp(&out, "10.99.0.1:80"),
        "no host endpoint: the host is not policed"
    );
    assert!(tcp(&host, "10.99.0.2:9000"));

    // A host endpoint on the uplink, no policy: only the failsafe ports.
    let hep = |tiers: &str| {
        format!(
            "hostEndpointUpdate:\n  id: {{endpointId: up0}}\n  endpoint:\n    name: up0\n{tiers}"
        )
    };
    push(&mut c, yaml_msgs(10, &hep(""))).await?;
    assert!(!tcp(&out, "10.99.0.1:80"), "policed, nothing allowed");
    assert!(tcp(&out, "10.99.0.1:22"), "ssh is a failsafe port");
    assert!(!tcp(&host, "10.99.0.2:9000"), "egress policed too");
    let st = next_hep_status(&mut watch).await?;
    assert!(
        st.contains("HostEndpointStatusUpdate") && st.contains("up0") && st.contains("\"up\""),
        "{st}"
    );

    // An ingress policy for tcp/80.
    let yaml = format!(
        "activePolicyUpdate:\n  id: {{name: default.web}}\n  policy:\n    tier: default\n    inboundRules: [{{action: allow, protocol: {{name: tcp}}, dstPorts: [{{first: 80}}]}}]\n---\n{}",
        hep(
            "    tiers:\n      - name: default\n        ingressPolicies: [{name: default.web}]\n        defaultAction: deny\n"
        )
    );
    push(&mut c, yaml_msgs(20, &yaml)).await?;
    assert!(tcp(&out, "10.99.0.1:80"), "allowed by the policy");
    assert!(!tcp(&out, "10.99.0.1:8080"), "not allowed");
    assert!(tcp(&out, "10.99.0.1:22"), "failsafe still open");

    // The host endpoint removed: the host is not policed again.
    push(
        &mut c,
        yaml_msgs(30, "hostEndpointRemove: {id: {endpointId: up0}}\n"),
    )
    .await?;
    assert!(tcp(&out, "10.99.0.1:8080"));
    assert!(tcp(&host, "10.99.0.2:9000"));
    let st = next_hep_status(&mut watch).await?;
    assert!(
        st.contains("HostEndpointStatusRemove") && st.contains("up0"),
        "{st}"
    );
    Ok(())
}

/// A host endpoint YAML message.
fn hep_msg(id: &str, name: &str, body: &str) -> String {
    format!(
        "hostEndpointUpdate:\n  id: {{endpointId: {id}}}\n  endpoint:\n    name: \"{name}\"\n{body}"
    )
}

/// A one-rule-per-direction policy YAML message.
fn policy_msg(name: &str, flags: &str, inbound: &str, outbound: &str) -> String {
    format!(
        "activePolicyUpdate:\n  id: {{name: {name}}}\n  policy:\n    tier: default\n{flags}    inboundRules: [{inbound}]\n    outboundRules: [{outbound}]\n"
    )
}

fn tier(key: &str, ingress: &[&str], egress: &[&str]) -> String {
    let list = |l: &[&str]| {
        l.iter()
            .map(|p| format!("{{name: {p}}}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "    {key}:\n      - name: default\n        ingressPolicies: [{}]\n        egressPolicies: [{}]\n        defaultAction: deny\n",
        list(ingress),
        list(egress)
    )
}

fn own_rules(ns: &Netns, table: &str) -> Result<usize> {
    kernel::our_rule_count(ns, false, table)
}

/// Untracked (raw), pre-DNAT (mangle) and forward policy, and the
/// all-interfaces host endpoint, each shown with real connections. The
/// "host" namespace routes between two outside namespaces.
#[tokio::test]
async fn untracked_pre_dnat_forward_and_all_interfaces() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let host = Netns::new("hep2host")?;
    let out = Netns::new("hep2out")?;
    let far = Netns::new("hep2far")?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    for (ns, up, net, route) in [
        (&out, "up0", "10.99.0", "10.98.0.0/24"),
        (&far, "up1", "10.98.0", "10.99.0.0/24"),
    ] {
        host.run(
            "ip",
            &[
                "link", "add", up, "type", "veth", "peer", "name", "eth0", "netns", &ns.0,
            ],
        )?;
        host.run("ip", &["addr", "add", &format!("{net}.1/24"), "dev", up])?;
        host.run("ip", &["link", "set", up, "up"])?;
        ns.run(
            "ip",
            &["addr", "add", &format!("{net}.2/24"), "dev", "eth0"],
        )?;
        ns.run("ip", &["link", "set", "eth0", "up"])?;
        ns.run("ip", &["link", "set", "lo", "up"])?;
        ns.run("ip", &["route", "add", route, "via", &format!("{net}.1")])?;
    }
    let _host_servers = serve(&host.0, &[22, 80, 8080], &[]);
    let _far_servers = serve(&far.0, &[9000, 9001], &[]);
    let d = Daemon::start(&host, &dir.path().join("dp.sock"), &["--ipv6", "false"])?;
    let mut c = d.connect().await?;
    let mut seq = 1;
    let mut send = async |c: &mut _, yaml: String| -> Result<()> {
        let msgs = yaml_msgs(seq, &yaml);
        seq += msgs.len() as u64;
        let (rej, _) = push(c, msgs).await?;
        assert!(rej.is_empty(), "{rej:?}");
        Ok(())
    };
    let allow_tcp = |dir: &str, port: u16| {
        format!("{{action: allow, protocol: {{name: tcp}}, {dir}: [{{first: {port}}}]}}")
    };
    send(&mut c, "inSync: {}\n".into()).await?;
    assert!(tcp(&out, "10.98.0.2:9001"), "forwarding works unpoliced");
    assert_eq!(own_rules(&host, "raw")?, 0);
    let host_ips = kernel::our_set(&host, false, "dph40this-host")?;
    for a in ["10.99.0.1", "10.98.0.1", "127.0.0.1"] {
        assert!(
            host_ips.contains(a),
            "the host-IPs set holds {a}: {host_ips}"
        );
    }

    // Untracked: normal policy allows nothing, an untracked policy lets
    // tcp/80 in (and its replies out) without conntrack.
    let untracked = policy_msg(
        "default.u",
        "    untracked: true\n",
        &allow_tcp("dstPorts", 80),
        &allow_tcp("srcPorts", 80),
    );
    let hep = hep_msg(
        "up0",
        "up0",
        &tier("untrackedTiers", &["default.u"], &["default.u"]),
    );
    send(&mut c, format!("{untracked}---\n{hep}")).await?;
    assert!(
        own_rules(&host, "raw")? > 0,
        "raw holds the untracked policy"
    );
    assert!(
        tcp(&out, "10.99.0.1:80"),
        "allowed by untracked policy alone"
    );
    assert!(!tcp(&out, "10.99.0.1:8080"), "normal policy: nothing else");
    assert!(tcp(&out, "10.99.0.1:22"), "failsafe");

    // An untracked deny of everything inbound cannot cut the failsafe.
    let deny_all = policy_msg(
        "default.u",
        "    untracked: true\n",
        "{action: deny}",
        "{action: deny}",
    );
    send(&mut c, deny_all).await?;
    assert!(!tcp(&out, "10.99.0.1:80"));
    assert!(
        tcp(&out, "10.99.0.1:22"),
        "failsafe is checked first in raw too"
    );

    // Pre-DNAT: tcp/8080 allowed in mangle, which normal policy then
    // does not see again.
    let pre = policy_msg(
        "default.pd",
        "    preDnat: true\n",
        &allow_tcp("dstPorts", 8080),
        "",
    );
    let hep = hep_msg("up0", "up0", &tier("preDnatTiers", &["default.pd"], &[]));
    send(&mut c, format!("{pre}---\n{hep}")).await?;
    assert!(own_rules(&host, "mangle")? > 0);
    assert!(tcp(&out, "10.99.0.1:8080"), "allowed by pre-DNAT policy");
    assert!(!tcp(&out, "10.99.0.1:80"), "the untracked policy is gone");

    // Forward: a host endpoint on up1 allows only tcp/9000 to be
    // forwarded out of it; up0 has no forward policy (allowed).
    let fwd = policy_msg("default.fwd", "", "", &allow_tcp("dstPorts", 9000));
    let hep0 = hep_msg("up0", "up0", "");
    let hep1 = hep_msg("up1", "up1", &tier("forwardTiers", &[], &["default.fwd"]));
    send(&mut c, format!("{fwd}---\n{hep0}---\n{hep1}")).await?;
    assert_eq!(own_rules(&host, "raw")?, 0, "raw and mangle let go");
    assert_eq!(own_rules(&host, "mangle")?, 0);
    assert!(tcp(&out, "10.98.0.2:9000"), "forwarded: allowed");
    assert!(!tcp(&out, "10.98.0.2:9001"), "forwarded: not allowed");

    // All interfaces: one endpoint polices up0 and up1, not lo.
    let web = policy_msg("default.web", "", &allow_tcp("dstPorts", 80), "");
    let all = hep_msg("all", "*", &tier("tiers", &["default.web"], &[]));
    send(
        &mut c,
        format!(
            "hostEndpointRemove: {{id: {{endpointId: up0}}}}\n---\nhostEndpointRemove: {{id: {{endpointId: up1}}}}\n---\n{web}---\n{all}"
        ),
    )
    .await?;
    assert!(tcp(&out, "10.99.0.1:80"));
    assert!(!tcp(&out, "10.99.0.1:8080"));
    assert!(tcp(&far, "10.98.0.1:80"));
    assert!(!tcp(&far, "10.98.0.1:8080"), "the other interface too");
    assert!(tcp(&host, "127.0.0.1:8080"), "loopback is not policed");
    assert!(tcp(&out, "10.98.0.2:9001"), "no forward policy: forwarded");

    send(
        &mut c,
        "hostEndpointRemove: {id: {endpointId: all}}\n".into(),
    )
    .await?;
    assert!(tcp(&out, "10.99.0.1:8080"), "unpoliced again");
    Ok(())
}
