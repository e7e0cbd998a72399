//! Outgoing NAT with real packets: a workload in a masquerading IPAM pool
//! reaches an "outside" namespace with the node's address; with masquerade
//! off, with its own. All traffic stays inside the test's namespaces.
//! Needs root.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use dphandler_tests::kernel;
use dphandler_tests::lab::{self, WorkloadSpec, yaml_msgs};
use dphandler_tests::{Daemon, Netns, privileged, push, tempdir};

#[tokio::test]
async fn masquerade_follows_the_pool() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let host = Netns::new("nathost")?;
    let out = Netns::new("natout")?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    // The workload, as CNI would set it up; the daemon adds the route.
    let wl = lab::workload(
        &host,
        WorkloadSpec {
            iface: "cali1",
            n: 1,
            v4: "10.65.0.2",
            v6: None,
            host_route: false,
            host_neigh: false,
        },
    )?;
    // The uplink to "outside", which has no route back to the pool.
    lab::uplink(&host, &out, "up0", "10.99.0.1/24", "10.99.0.2/24")?;

    // A listener outside that records who connected.
    let seen: Arc<Mutex<Vec<SocketAddr>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    {
        let (seen, stop) = (seen.clone(), stop.clone());
        let file = std::fs::File::open(format!("/run/netns/{}", out.0))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let l = TcpListener::bind("0.0.0.0:80").unwrap();
            l.set_nonblocking(true).unwrap();
            tx.send(()).unwrap();
            while !stop.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((_, peer)) => seen.lock().unwrap().push(peer),
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        rx.recv()?;
    }
    let connect = || {
        let file = std::fs::File::open(format!("/run/netns/{}", wl.0)).unwrap();
        std::thread::spawn(move || {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            TcpStream::connect_timeout(&"10.99.0.2:80".parse().unwrap(), Duration::from_millis(700))
                .is_ok()
        })
        .join()
        .unwrap()
    };
    let last_peer = || {
        std::thread::sleep(Duration::from_millis(100));
        seen.lock().unwrap().last().map(|a| a.ip().to_string())
    };

    let d = Daemon::start(&host, &dir.path().join("dp.sock"), &["--ipv6", "false"])?;
    let mut c = d.connect().await?;
    let base = "activeProfileUpdate:\n  id: {name: kns.ns}\n  profile:\n    inboundRules: [{action: allow}]\n    outboundRules: [{action: allow}]\n---\n\
workloadEndpointUpdate:\n  id: {orchestratorId: k8s, workloadId: ns/w, endpointId: eth0}\n  endpoint:\n    name: cali1\n    mac: '02:00:00:00:00:01'\n    ipv4Nets: [10.65.0.2/32]\n    profileIds: [kns.ns]\n";
    let pool = |masq: bool| {
        format!(
            "ipamPoolUpdate:\n  id: pool1\n  pool: {{cidr: 10.65.0.0/16, masquerade: {masq}}}\n"
        )
    };

    // No pool yet: outside has no route back, so the connection fails.
    let (rej, _) = push(&mut c, yaml_msgs(1, &format!("{base}---\ninSync: {{}}\n"))).await?;
    assert!(rej.is_empty(), "{rej:?}");
    assert!(!connect(), "without NAT the reply cannot come back");

    // A masquerading pool: the workload goes out as the node.
    push(&mut c, yaml_msgs(10, &pool(true))).await?;
    let nat = kernel::our_rules(&host, false, "nat")?;
    assert!(
        nat.contains(kernel::spelled("-j MASQUERADE", "masquerade")),
        "{nat}"
    );
    assert!(connect(), "masqueraded flow connects");
    assert_eq!(
        last_peer().as_deref(),
        Some("10.99.0.1"),
        "seen as the node"
    );

    // Masquerade off (and a route back): the workload's own address.
    push(&mut c, yaml_msgs(20, &pool(false))).await?;
    let nat = kernel::our_rules(&host, false, "nat")?;
    assert!(nat.is_empty(), "nothing of ours left in nat: {nat}");
    out.run("ip", &["route", "add", "10.65.0.0/16", "via", "10.99.0.1"])?;
    assert!(connect());
    assert_eq!(last_peer().as_deref(), Some("10.65.0.2"), "not masqueraded");
    stop.store(true, Ordering::Relaxed);
    Ok(())
}
