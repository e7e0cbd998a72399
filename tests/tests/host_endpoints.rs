//! Host endpoint policy with real packets: the daemon's "host" namespace
//! has an uplink to an "outside" namespace; a host endpoint on the uplink
//! polices what reaches the host and what leaves it, and the failsafe ports
//! stay open whatever the policy says. Traffic stays inside the test's
//! namespaces. Needs root.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Result;
use dphandler_proto::felix;
use dphandler_tests::{Daemon, Netns, privileged, push, tempdir};

fn msgs(first: u64, yaml: &str) -> Vec<felix::ToDataplane> {
    let mut v = dphandler_proto::text::parse_to_dataplane(yaml).expect("test YAML");
    for (i, m) in v.iter_mut().enumerate() {
        m.sequence_number = first + i as u64;
    }
    v
}

fn listen(ns: &str, ports: &[u16], stop: &Arc<AtomicBool>) {
    for &port in ports {
        let stop = stop.clone();
        let file = std::fs::File::open(format!("/run/netns/{ns}")).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let l = TcpListener::bind(("0.0.0.0", port)).unwrap();
            l.set_nonblocking(true).unwrap();
            tx.send(()).unwrap();
            while !stop.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((s, _)) => drop(s),
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        rx.recv().unwrap();
    }
}

fn tcp(ns: &Netns, to: &str) -> bool {
    let addr: SocketAddr = to.parse().unwrap();
    let file = std::fs::File::open(format!("/run/netns/{}", ns.0)).unwrap();
    std::thread::spawn(move || {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
    })
    .join()
    .unwrap()
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
    let stop = Arc::new(AtomicBool::new(false));
    listen(&host.0, &[22, 80, 8080], &stop);
    listen(&out.0, &[9000], &stop);

    let d = Daemon::start(&host, &dir.path().join("dp.sock"), &["--ipv6", "false"])?;
    let mut c = d.connect().await?;
    let (rej, _) = push(&mut c, msgs(1, "inSync: {}\n")).await?;
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
    push(&mut c, msgs(10, &hep(""))).await?;
    assert!(!tcp(&out, "10.99.0.1:80"), "policed, nothing allowed");
    assert!(tcp(&out, "10.99.0.1:22"), "ssh is a failsafe port");
    assert!(!tcp(&host, "10.99.0.2:9000"), "egress policed too");

    // An ingress policy for tcp/80.
    let yaml = format!(
        "activePolicyUpdate:\n  id: {{name: default.web}}\n  policy:\n    tier: default\n    inboundRules: [{{action: allow, protocol: {{name: tcp}}, dstPorts: [{{first: 80}}]}}]\n---\n{}",
        hep(
            "    tiers:\n      - name: default\n        ingressPolicies: [{name: default.web}]\n        defaultAction: deny\n"
        )
    );
    push(&mut c, msgs(20, &yaml)).await?;
    assert!(tcp(&out, "10.99.0.1:80"), "allowed by the policy");
    assert!(!tcp(&out, "10.99.0.1:8080"), "not allowed");
    assert!(tcp(&out, "10.99.0.1:22"), "failsafe still open");

    // The host endpoint removed: the host is not policed again.
    push(
        &mut c,
        msgs(30, "hostEndpointRemove: {id: {endpointId: up0}}\n"),
    )
    .await?;
    assert!(tcp(&out, "10.99.0.1:8080"));
    assert!(tcp(&host, "10.99.0.2:9000"));
    stop.store(true, Ordering::Relaxed);
    Ok(())
}
