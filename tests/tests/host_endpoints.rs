//! Host endpoint policy with real packets: the daemon's "host" namespace
//! has an uplink to an "outside" namespace; a host endpoint on the uplink
//! polices what reaches the host and what leaves it, and the failsafe ports
//! stay open whatever the policy says. Traffic stays inside the test's
//! namespaces. Needs root.

use std::time::Duration;

use anyhow::Result;
use dphandler_tests::lab::{serve, tcp_ok, yaml_msgs};
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
    host.run(
        "ip",
        &[
            "link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", &out.0,
        ],
    )?;
    host.run("ip", &["addr", "add", "10.99.0.1/24", "dev", "up0"])?;
    host.run("ip", &["link", "set", "up0", "up"])?;
    out.run("ip", &["addr", "add", "10.99.0.2/24", "dev", "eth0"])?;
    out.run("ip", &["link", "set", "eth0", "up"])?;
    out.run("ip", &["link", "set", "lo", "up"])?;
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
