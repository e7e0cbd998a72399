//! The rtnetlink seams (routes, neighbours, FDB, VXLAN devices, ip rules)
//! against the real kernel, in a network namespace this test creates (and
//! removes, also on failure): what they write reads back as the same
//! value, so a restarted daemon finds nothing to change. Needs root.

mod common;

use std::process::Command;

use anyhow::{Context, Result};
use common::{Netns, privileged};
use dphandler_dataplane::backends::iprules::IpRuleSeam;
use dphandler_dataplane::backends::iprules::netlink::IpRuleNetlink;
use dphandler_dataplane::backends::routes::netlink::RouteNetlink;
use dphandler_dataplane::backends::routes::{
    KernelFdb, RT_SCOPE_LINK, RT_SCOPE_UNIVERSE, RTN_BLACKHOLE, RTN_UNICAST, RouteOp, RouteSeam,
    kernel_route,
};
use dphandler_dataplane::backends::vxlan::netlink::VxlanNetlink;
use dphandler_dataplane::backends::vxlan::{VxlanOp, VxlanSeam, fix_in_place, incompatible};
use dphandler_dataplane::model::MacAddr;
use dphandler_dataplane::model::routes::{
    IpRule, RouteClass, RouteKey, RouteKind, RouteTarget, VxlanDevice,
};

/// A namespace with an underlay: `eth0` (172.31.9.1/24) and its veth peer
/// `eth1`, both up.
fn with_underlay(tag: &str) -> Result<Netns> {
    let ns = Netns::new(tag)?;
    ns.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
    ])?;
    ns.ip(&["addr", "add", "172.31.9.1/24", "dev", "eth0"])?;
    ns.ip(&["link", "set", "eth0", "up"])?;
    ns.ip(&["link", "set", "eth1", "up"])?;
    Ok(ns)
}

/// `vxlan.calico` as the routes manager would ask for it on that underlay.
fn vxlan_device() -> VxlanDevice {
    VxlanDevice {
        name: "vxlan.calico".into(),
        vni: 4096,
        port: 4789,
        mac: MacAddr::parse("66:6a:00:00:00:01").unwrap(),
        parent: "eth0".into(),
        local: "172.31.9.1".parse().unwrap(),
        mtu: 1450,
        addr: "10.65.1.0".parse().unwrap(),
    }
}

fn target(kind: RouteKind, dev: Option<&str>, gw: Option<&str>, protocol: u8) -> RouteTarget {
    RouteTarget {
        class: RouteClass::VxlanTunnel,
        kind,
        dev: dev.map(Into::into),
        gateway: gw.map(|g| g.parse().unwrap()),
        onlink: gw.is_some(),
        protocol,
        mtu: gw.map(|_| 1450),
    }
}

#[test]
fn vxlan_device_routes_neighbours_and_fdb_round_trip() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let ns = with_underlay("nlseam")?;
    ns.ip(&[
        "route",
        "add",
        "198.18.0.0/24",
        "dev",
        "eth0",
        "proto",
        "static",
    ])?;

    let dev = vxlan_device();
    let d = dev.clone();
    let (created, fixes) = ns.within(move || -> Result<_> {
        let mut v = VxlanNetlink::open()?;
        let parent = v.link_index("eth0")?.context("eth0")?;
        assert_eq!(v.get("vxlan.calico")?, None);
        v.write(&VxlanOp::Create {
            dev: d.clone(),
            parent_index: parent,
        })?;
        let have = v.get("vxlan.calico")?.context("created")?;
        let why = incompatible(&d, parent, &have);
        for op in fix_in_place(&d, &have) {
            v.write(&op)?;
        }
        let again = v.get("vxlan.calico")?.context("still there")?;
        Ok((why, fix_in_place(&d, &again)))
    })?;
    assert_eq!(created, None, "a new device reads back as what we asked");
    assert!(fixes.is_empty(), "nothing left to fix: {fixes:?}");
    let link = ns.ip(&["-d", "link", "show", "vxlan.calico"])?;
    for want in [
        "vxlan id 4096",
        "local 172.31.9.1",
        "dev eth0",
        "dstport 4789",
        "66:6a:00:00:00:01",
        "mtu 1450",
        "state UNKNOWN",
    ] {
        assert!(link.contains(want), "{want:?} in {link}");
    }

    // Routes of every shape we write, neighbours and FDB: written, then read
    // back equal (so a restart writes nothing).
    let (read_back, written, second) = ns.within(|| -> Result<_> {
        let mut r = RouteNetlink::open()?;
        let links = r.links()?;
        let idx = |n: &str| links.iter().find(|l| l.name == n).map(|l| l.index);
        let vx = idx("vxlan.calico").context("vxlan")?;
        let eth0 = idx("eth0").context("eth0")?;
        let key = |d: &str| RouteKey::main(d.parse().unwrap());
        let mut other_table = RouteKey::new(1000, "10.70.0.0/24".parse().unwrap(), 0);
        other_table.metric = 7;
        let routes = vec![
            kernel_route(
                key("10.65.2.0/26"),
                &target(
                    RouteKind::Unicast,
                    Some("vxlan.calico"),
                    Some("10.65.2.0"),
                    3,
                ),
                Some(vx),
            ),
            kernel_route(
                key("10.65.3.0/26"),
                &target(RouteKind::Unicast, Some("eth0"), Some("172.31.9.3"), 80),
                Some(eth0),
            ),
            kernel_route(
                key("10.65.1.0/26"),
                &target(RouteKind::Blackhole, None, None, 80),
                None,
            ),
            kernel_route(
                key("10.65.2.9/32"),
                &target(RouteKind::Unicast, Some("vxlan.calico"), None, 3),
                Some(vx),
            ),
            kernel_route(
                key("fd00:65:2::/122"),
                &target(RouteKind::Unicast, Some("eth0"), None, 3),
                Some(eth0),
            ),
            kernel_route(
                key("fd00:65:1::/122"),
                &target(RouteKind::Blackhole, None, None, 80),
                None,
            ),
            kernel_route(
                other_table,
                &target(RouteKind::Unicast, Some("eth0"), None, 80),
                Some(eth0),
            ),
            // WireGuard's table: a throw, v4 and v6.
            kernel_route(
                RouteKey::new(1, "10.65.1.0/26".parse().unwrap(), 0),
                &target(RouteKind::Throw, None, None, 3),
                None,
            ),
            kernel_route(
                RouteKey::new(2, "fd00:65:1::/122".parse().unwrap(), 0),
                &target(RouteKind::Throw, None, None, 3),
                None,
            ),
        ];
        let mac2 = MacAddr::parse("66:6a:00:00:00:02").unwrap();
        let mut ops: Vec<RouteOp> = routes.iter().cloned().map(RouteOp::ReplaceRoute).collect();
        ops.push(RouteOp::ReplaceNeighbour {
            ifindex: vx,
            addr: "10.65.2.0".parse().unwrap(),
            mac: mac2,
        });
        ops.push(RouteOp::AddFdb(KernelFdb {
            ifindex: vx,
            mac: mac2,
            dst: Some("172.31.9.2".parse().unwrap()),
        }));
        let failures = r.write(&ops);
        assert!(failures.is_empty(), "{failures:?}");
        let all = r.routes()?;
        let read: Vec<_> = routes
            .iter()
            .map(|w| all.iter().find(|k| k.key == w.key).cloned())
            .collect();
        let (neigh, fdb) = r.neighbours()?;
        let n = neigh
            .into_iter()
            .find(|n| n.ifindex == vx && n.addr.to_string() == "10.65.2.0");
        let f = fdb.into_iter().find(|f| f.ifindex == vx && f.mac == mac2);
        // Replacing what is there, and deleting one route twice, is fine.
        let again = r.write(&[
            ops[0].clone(),
            RouteOp::DeleteRoute(routes[3].key),
            RouteOp::DeleteRoute(routes[3].key),
        ]);
        Ok(((read, n, f), routes, again.len()))
    })?;
    let (read, n, f) = read_back;
    for (w, r) in written.iter().zip(&read) {
        assert_eq!(Some(w), r.as_ref(), "read back differs");
    }
    assert!(
        written
            .iter()
            .any(|r| r.kind == RTN_BLACKHOLE && r.scope == RT_SCOPE_UNIVERSE)
    );
    assert!(
        written
            .iter()
            .any(|r| r.kind == RTN_UNICAST && r.scope == RT_SCOPE_LINK)
    );
    let n = n.context("neighbour read back")?;
    assert!(n.permanent && n.mac == Some(MacAddr::parse("66:6a:00:00:00:02").unwrap()));
    assert_eq!(
        f.context("fdb read back")?.dst,
        Some("172.31.9.2".parse().unwrap())
    );
    assert_eq!(second, 0, "replace and delete of a missing route succeed");
    let shown = ns.ip(&["route", "show", "10.65.2.0/26"])?;
    assert!(
        shown.contains("via 10.65.2.0 dev vxlan.calico onlink mtu 1450"),
        "{shown}"
    );
    let fdb = Command::new("bridge")
        .args(["-n", &ns.0, "fdb", "show", "dev", "vxlan.calico"])
        .output()?;
    assert!(
        String::from_utf8_lossy(&fdb.stdout)
            .contains("66:6a:00:00:00:02 dst 172.31.9.2 self permanent"),
        "{}",
        String::from_utf8_lossy(&fdb.stdout)
    );
    let t1000 = ns.ip(&["route", "show", "table", "1000"])?;
    assert!(
        t1000.contains("10.70.0.0/24 dev eth0 proto 80 scope link metric 7"),
        "{t1000}"
    );
    assert!(
        ns.ip(&["route"])?
            .contains("198.18.0.0/24 dev eth0 proto static")
    );
    let t1 = ns.ip(&["-d", "route", "show", "table", "1"])?;
    assert!(t1.contains("throw 10.65.1.0/26 proto boot"), "{t1}");
    Ok(())
}

#[test]
fn ip_rules_round_trip_and_look_up_their_table() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let ns = Netns::new("nlrules")?;
    let rules = [
        // WireGuard's: `not fwmark 0x200000/0x200000 lookup 1`, priority 99.
        IpRule {
            v6: false,
            priority: 99,
            fwmark: Some((0x20_0000, 0x20_0000)),
            invert: true,
            src: None,
            table: 1,
        },
        IpRule {
            v6: true,
            priority: 99,
            fwmark: Some((0x20_0000, 0x20_0000)),
            invert: true,
            src: None,
            table: 2,
        },
        IpRule {
            v6: false,
            priority: 200,
            fwmark: None,
            invert: false,
            src: Some("10.65.0.0/16".parse().unwrap()),
            table: 1000,
        },
    ];
    let (read, after_delete) = ns.within(move || -> Result<_> {
        let mut s = IpRuleNetlink::open()?;
        for r in &rules {
            s.add(r)?;
        }
        let read = s.rules()?;
        s.delete(&rules[2])?;
        s.delete(&rules[2])?; // already gone: fine
        Ok((read, s.rules()?))
    })?;
    for r in &rules {
        assert!(read.contains(r), "{r:?} not read back from {read:?}");
    }
    assert!(!after_delete.contains(&rules[2]));
    // The kernel's own rules read back too (and are never ours: the
    // backend owns rules by table).
    assert!(read.iter().any(|r| r.table == 254 && r.priority == 32766));
    let shown = ns.ip(&["rule", "show"])?;
    assert!(
        shown.contains("99:\tnot from all fwmark 0x200000/0x200000 lookup 1"),
        "{shown}"
    );
    assert!(!shown.contains("none"), "a rule without action: {shown}");
    Ok(())
}

#[test]
fn the_vxlan_backend_recreates_fixes_in_place_and_deletes() -> Result<()> {
    use dphandler_dataplane::backends::vxlan::Vxlan;
    use dphandler_dataplane::backends::{Backend, Phase};
    if !privileged() {
        return Ok(());
    }
    let ns = with_underlay("nlvxlan")?;
    let dev = vxlan_device();
    let index = |ns: &Netns| -> Result<String> {
        let l = ns.ip(&["-o", "link", "show", "vxlan.calico"])?;
        Ok(l.split(':').next().unwrap_or_default().to_string())
    };
    // One backend, its socket opened inside the namespace; each step is
    // one apply there.
    let (tx, rx) = std::sync::mpsc::channel::<Option<VxlanDevice>>();
    let (done_tx, done) = std::sync::mpsc::channel::<Result<(), String>>();
    let file = std::fs::File::open(format!("/run/netns/{}", ns.0))?;
    let worker = std::thread::spawn(move || {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        let seam = VxlanNetlink::open().expect("netlink");
        let mut b = Vxlan::new(&["vxlan.calico"], Box::new(seam));
        for want in rx {
            b.set("vxlan.calico", want);
            let r = b.apply(Phase::Links).map(|_| ()).map_err(|e| e.to_string());
            done_tx.send(r).expect("the test waits");
        }
    });
    let step = |want: Option<VxlanDevice>| -> Result<()> {
        tx.send(want)?;
        done.recv()?.map_err(anyhow::Error::msg)
    };
    step(Some(dev.clone()))?;
    let first = index(&ns)?;
    // Someone lowers the MTU and adds an address: put right in place.
    ns.ip(&["link", "set", "vxlan.calico", "mtu", "1400"])?;
    ns.ip(&["addr", "add", "10.9.9.9/24", "dev", "vxlan.calico"])?;
    step(Some(dev.clone()))?;
    let link = ns.ip(&["-d", "link", "show", "vxlan.calico"])?;
    assert!(
        link.contains("mtu 1450") && link.contains("vxlan id 4096"),
        "{link}"
    );
    let addrs = ns.ip(&["-4", "addr", "show", "dev", "vxlan.calico"])?;
    assert!(
        addrs.contains("10.65.1.0/32") && !addrs.contains("10.9.9.9"),
        "{addrs}"
    );
    assert_eq!(index(&ns)?, first, "fixed in place, not recreated");
    // A new VNI cannot be set in place: recreated.
    step(Some(VxlanDevice { vni: 4097, ..dev }))?;
    let link = ns.ip(&["-d", "link", "show", "vxlan.calico"])?;
    assert!(
        link.contains("vxlan id 4097") && link.contains("UP"),
        "{link}"
    );
    assert_ne!(index(&ns)?, first, "recreated");
    // VXLAN off: gone; the parent stays.
    step(None)?;
    assert!(!ns.ip(&["link", "show"])?.contains("vxlan.calico"));
    assert!(ns.ip(&["link", "show", "eth0"])?.contains("eth0"));
    drop(tx);
    worker.join().expect("the backend's thread");
    Ok(())
}
