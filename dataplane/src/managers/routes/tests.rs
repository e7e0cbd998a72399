//! The routes manager: what a node's calc-graph feed becomes (desired
//! routes, VXLAN devices, VTEP neighbours and FDB entries), read from the
//! backends' desired state; no kernel.

use super::*;
use crate::backends::BackendError;
use crate::backends::routes::{
    KernelFdb, KernelNeighbour, KernelRoute, Link, RouteOp, RouteOwnership, RouteSeam, Routes,
};
use crate::backends::vxlan::{ObservedLink, Vxlan, VxlanOp, VxlanSeam};
use crate::model::routes::MAIN_TABLE;

/// Seams that are never called: these tests only read desired state.
#[derive(Debug)]
struct NoKernel;

impl RouteSeam for NoKernel {
    fn links(&mut self) -> Result<Vec<Link>, BackendError> {
        unreachable!()
    }
    fn routes(&mut self) -> Result<Vec<KernelRoute>, BackendError> {
        unreachable!()
    }
    fn neighbours(&mut self) -> Result<(Vec<KernelNeighbour>, Vec<KernelFdb>), BackendError> {
        unreachable!()
    }
    fn write(&mut self, _: &[RouteOp]) -> Vec<(usize, BackendError)> {
        unreachable!()
    }
}

impl VxlanSeam for NoKernel {
    fn link_index(&mut self, _: &str) -> Result<Option<u32>, BackendError> {
        unreachable!()
    }
    fn get(&mut self, _: &str) -> Result<Option<ObservedLink>, BackendError> {
        unreachable!()
    }
    fn write(&mut self, _: &VxlanOp) -> Result<(), BackendError> {
        unreachable!()
    }
}

fn kernel() -> DesiredKernel {
    DesiredKernel {
        routes: Some(Routes::new(
            RouteOwnership {
                exclusive_protocol: 80,
                device_protocol: 3,
                workload_prefix: "cali".into(),
                remove_external_routes: true,
                tunnel_devices: vec![VXLAN_V4.into(), VXLAN_V6.into()],
                tables: vec![],
            },
            Box::new(NoKernel),
        )),
        vxlan: Some(Vxlan::new(&[VXLAN_V4, VXLAN_V6], Box::new(NoKernel))),
        ..DesiredKernel::default()
    }
}

fn mgr(hostname: &str) -> RoutesManager {
    let mut m = RoutesManager::new(RoutesConfig {
        hostname: hostname.into(),
        ..RoutesConfig::default()
    });
    // The underlay: eth0 with this node's address, MTU 1500.
    m.on_interface(&InterfaceEvent::Link {
        index: 2,
        name: "eth0".into(),
        up: true,
        mtu: 1500,
    });
    m.on_interface(&InterfaceEvent::AddrAdded {
        index: 2,
        addr: "172.31.77.1/24".parse().unwrap(),
    });
    m
}

fn id(s: &str) -> Id {
    Id::new(s).unwrap()
}

fn vtep(node: &str, n: u8, ip: &str, parent: &str) -> Update {
    Update::Vtep(Vtep {
        node: id(node),
        mac: Some(MacAddr([0x66, 0x6a, 0, 0, 0, n])),
        ipv4_addr: Some(ip.parse().unwrap()),
        parent_device_ip: Some(parent.parse().unwrap()),
        mac_v6: None,
        ipv6_addr: None,
        parent_device_ipv6: None,
    })
}

fn route(types: u32, pool: i32, dst: &str, node: &str, node_ip: &str) -> Route {
    Route {
        types,
        ip_pool_type: pool,
        dst: dst.parse().unwrap(),
        dst_node_name: Some(id(node)),
        dst_node_ip: Some(node_ip.parse().unwrap()),
        same_subnet: false,
        nat_outgoing: false,
        local_workload: false,
        ipip: false,
        vxlan: false,
        wireguard: false,
        borrowed: false,
    }
}

fn vxlan_on() -> Update {
    Update::Encapsulation(Encapsulation {
        vxlan_enabled: true,
        ..Encapsulation::default()
    })
}

/// The desired routes as `ip route`-like lines.
fn routes(k: &DesiredKernel) -> Vec<String> {
    k.routes
        .as_ref()
        .unwrap()
        .desired()
        .iter()
        .map(|(key, t)| {
            assert_eq!(key.table, MAIN_TABLE);
            let mut s = match t.kind {
                RouteKind::Blackhole => format!("blackhole {}", key.dst),
                RouteKind::Throw => format!("throw {}", key.dst),
                RouteKind::Unicast => key.dst.to_string(),
            };
            if let Some(g) = t.gateway {
                s += &format!(" via {g}");
            }
            if let Some(d) = &t.dev {
                s += &format!(" dev {d}");
            }
            if t.onlink {
                s += " onlink";
            }
            s += &format!(" proto {}", t.protocol);
            if let Some(m) = t.mtu {
                s += &format!(" mtu {m}");
            }
            s
        })
        .collect()
}

/// Node 1 of a two-node VXLAN cluster, as Calico's calc graph feeds it.
fn vxlan_node() -> RoutesManager {
    let mut m = mgr("node1");
    for u in [
        vxlan_on(),
        vtep("node1", 1, "10.65.1.0", "172.31.77.1"),
        vtep("node2", 2, "10.65.2.0", "172.31.77.2"),
        Update::Route(route(
            LOCAL_WORKLOAD,
            POOL_VXLAN,
            "10.65.1.0/26",
            "node1",
            "172.31.77.1",
        )),
        Update::Route(Route {
            local_workload: true,
            ..route(
                LOCAL_WORKLOAD,
                POOL_VXLAN,
                "10.65.1.2/32",
                "node1",
                "172.31.77.1",
            )
        }),
        Update::Route(route(
            REMOTE_WORKLOAD,
            POOL_VXLAN,
            "10.65.2.0/26",
            "node2",
            "172.31.77.2",
        )),
        Update::Route(route(
            REMOTE_WORKLOAD | REMOTE_TUNNEL,
            POOL_VXLAN,
            "10.65.2.0/32",
            "node2",
            "172.31.77.2",
        )),
        Update::Route(Route {
            borrowed: true,
            ..route(
                REMOTE_TUNNEL,
                POOL_VXLAN,
                "10.65.1.60/32",
                "node2",
                "172.31.77.2",
            )
        }),
    ] {
        m.check(&u).unwrap();
        m.on_update(&u);
    }
    m
}

#[test]
fn a_vxlan_node_gets_felix_s_routes_device_and_vteps() {
    let mut m = vxlan_node();
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    assert_eq!(
        routes(&k),
        [
            "blackhole 10.65.1.0/26 proto 80",
            "10.65.1.60/32 dev vxlan.calico proto 3 mtu 1450",
            "10.65.2.0/26 via 10.65.2.0 dev vxlan.calico onlink proto 3 mtu 1450",
            "10.65.2.0/32 dev vxlan.calico proto 3 mtu 1450",
        ]
    );
    assert_eq!(
        k.vxlan.as_ref().unwrap().desired(VXLAN_V4),
        Some(&VxlanDevice {
            name: VXLAN_V4.into(),
            vni: 4096,
            port: 4789,
            mac: MacAddr([0x66, 0x6a, 0, 0, 0, 1]),
            parent: "eth0".into(),
            local: "172.31.77.1".parse().unwrap(),
            mtu: 1450,
            addr: "10.65.1.0".parse().unwrap(),
        })
    );
    assert_eq!(k.vxlan.as_ref().unwrap().desired(VXLAN_V6), None);
    let r = k.routes.as_ref().unwrap();
    assert_eq!(
        r.desired_neighbours().into_iter().collect::<Vec<_>>(),
        [Neighbour {
            dev: VXLAN_V4.into(),
            addr: "10.65.2.0".parse().unwrap(),
            mac: MacAddr([0x66, 0x6a, 0, 0, 0, 2]),
        }],
        "the remote VTEP only, not our own"
    );
    assert_eq!(
        r.desired_fdb().iter().cloned().collect::<Vec<_>>(),
        [FdbEntry {
            dev: VXLAN_V4.into(),
            mac: MacAddr([0x66, 0x6a, 0, 0, 0, 2]),
            dst: "172.31.77.2".parse().unwrap(),
        }]
    );
    let status: BTreeMap<_, _> = m.status().into_iter().collect();
    assert_eq!(status["node"], "node1");
    assert_eq!(status["routes.vxlan"], "3");
    assert_eq!(status["routes.blackhole"], "1");
    assert!(
        status["vxlan.vxlan.calico"].contains("vni 4096"),
        "{status:?}"
    );
}

#[test]
fn same_subnet_goes_direct_and_the_mtu_follows_the_parent() {
    let mut m = vxlan_node();
    m.on_interface(&InterfaceEvent::Link {
        index: 2,
        name: "eth0".into(),
        up: true,
        mtu: 9000,
    });
    m.on_update(&Update::Route(Route {
        same_subnet: true,
        ..route(
            REMOTE_WORKLOAD,
            POOL_VXLAN,
            "10.65.2.0/26",
            "node2",
            "172.31.77.2",
        )
    }));
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    assert!(
        routes(&k).contains(&"10.65.2.0/26 via 172.31.77.2 dev eth0 onlink proto 80".to_string()),
        "{:?}",
        routes(&k)
    );
    assert_eq!(
        k.vxlan.as_ref().unwrap().desired(VXLAN_V4).unwrap().mtu,
        8950
    );
}

#[test]
fn vxlan_off_removes_the_device_and_everything_through_it() {
    let mut m = vxlan_node();
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    m.on_update(&Update::Encapsulation(Encapsulation::default()));
    m.complete_deferred_work(&mut k).unwrap();
    assert!(routes(&k).is_empty(), "{:?}", routes(&k));
    assert_eq!(k.vxlan.as_ref().unwrap().desired(VXLAN_V4), None);
    assert!(k.routes.as_ref().unwrap().desired_neighbours().is_empty());
    assert!(k.routes.as_ref().unwrap().desired_fdb().is_empty());
    // --vxlan enabled holds whatever the calc graph says.
    let mut m = RoutesManager::new(RoutesConfig {
        hostname: "node1".into(),
        vxlan: VxlanMode::Enabled,
        mtu: Some(1400),
        ..RoutesConfig::default()
    });
    m.links = vxlan_node().links;
    for u in [
        vtep("node1", 1, "10.65.1.0", "172.31.77.1"),
        Update::Encapsulation(Encapsulation::default()),
    ] {
        m.on_update(&u);
    }
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    assert_eq!(
        k.vxlan.as_ref().unwrap().desired(VXLAN_V4).unwrap().mtu,
        1400
    );
}

#[test]
fn config_update_vxlan_keys_change_the_device_and_routes_live() {
    let config = |pairs: &[(&str, &str)]| Update::Config(crate::model::config::kv(pairs));
    let mut m = vxlan_node();
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    let dev = k.vxlan.as_ref().unwrap().desired(VXLAN_V4).unwrap().clone();
    assert_eq!((dev.vni, dev.port), (4096, 4789));
    let before = routes(&k);
    // Another VNI, port and MTU: the device as the ConfigUpdate says.
    m.on_update(&config(&[
        ("VXLANVNI", "4097"),
        ("VXLANPort", "4790"),
        ("VXLANMTU", "1300"),
    ]));
    m.complete_deferred_work(&mut k).unwrap();
    let dev = k.vxlan.as_ref().unwrap().desired(VXLAN_V4).unwrap();
    assert_eq!((dev.vni, dev.port, dev.mtu), (4097, 4790, 1300));
    // VXLANEnabled false wins over the calc graph's Encapsulation.
    m.on_update(&config(&[("VXLANEnabled", "false")]));
    m.complete_deferred_work(&mut k).unwrap();
    assert_eq!(k.vxlan.as_ref().unwrap().desired(VXLAN_V4), None);
    assert!(routes(&k).is_empty(), "{:?}", routes(&k));
    // No keys: the flags and the Encapsulation again.
    m.on_update(&config(&[]));
    m.complete_deferred_work(&mut k).unwrap();
    let dev = k.vxlan.as_ref().unwrap().desired(VXLAN_V4).unwrap();
    assert_eq!((dev.vni, dev.port), (4096, 4789));
    assert_eq!(routes(&k), before);
}

#[test]
fn the_node_name_from_config_decides_which_vtep_is_ours() {
    let mut m = vxlan_node();
    m.on_update(&Update::Config(vec![(
        "FelixHostname".into(),
        "node2".into(),
    )]));
    assert_eq!(m.hostname(), "node2");
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    // Node 2's VTEP parent address is not on this host: no device yet, and
    // why is in the status.
    let status: BTreeMap<_, _> = m.status().into_iter().collect();
    assert!(
        status["vxlan.vxlan.calico"].contains("172.31.77.2"),
        "{status:?}"
    );
    assert!(k.routes.as_ref().unwrap().desired_neighbours().is_empty());
    // Once this host has that address, the device is node 2's and node 1
    // is the remote VTEP.
    m.on_interface(&InterfaceEvent::AddrAdded {
        index: 2,
        addr: "172.31.77.2/24".parse().unwrap(),
    });
    m.complete_deferred_work(&mut k).unwrap();
    let dev = k.vxlan.as_ref().unwrap().desired(VXLAN_V4).unwrap();
    assert_eq!(dev.mac, MacAddr([0x66, 0x6a, 0, 0, 0, 2]));
    assert_eq!(
        k.routes
            .as_ref()
            .unwrap()
            .desired_neighbours()
            .iter()
            .map(|n| n.addr.to_string())
            .collect::<Vec<_>>(),
        ["10.65.1.0"]
    );
}

#[test]
fn a_route_waits_for_its_vtep() {
    let mut m = mgr("node1");
    for u in [
        vxlan_on(),
        vtep("node1", 1, "10.65.1.0", "172.31.77.1"),
        Update::Route(route(
            REMOTE_WORKLOAD,
            POOL_VXLAN,
            "10.65.3.0/26",
            "node3",
            "172.31.77.3",
        )),
    ] {
        m.on_update(&u);
    }
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    assert!(routes(&k).is_empty());
    let status: BTreeMap<_, _> = m.status().into_iter().collect();
    assert_eq!(
        status["routes.waiting.0"],
        "10.65.3.0/26: waiting for the VTEP of node \"node3\""
    );
    m.on_update(&vtep("node3", 3, "10.65.3.0", "172.31.77.3"));
    m.complete_deferred_work(&mut k).unwrap();
    assert_eq!(
        routes(&k),
        ["10.65.3.0/26 via 10.65.3.0 dev vxlan.calico onlink proto 3 mtu 1450"]
    );
    assert!(
        !m.status()
            .iter()
            .any(|(k, _)| k.starts_with("routes.waiting"))
    );
    // RouteRemove takes it away.
    m.on_update(&Update::Remove(Key::Route("10.65.3.0/26".parse().unwrap())));
    m.complete_deferred_work(&mut k).unwrap();
    assert!(routes(&k).is_empty());
}

#[test]
fn no_encap_and_ipip_pools() {
    let mut m = mgr("node1");
    for u in [
        Update::Encapsulation(Encapsulation {
            no_encap_enabled: true,
            ipip_enabled: true,
            ..Encapsulation::default()
        }),
        Update::HostMetadata(HostMetadata {
            hostname: id("node1"),
            ipv4_addr: Some("172.31.77.1".parse().unwrap()),
            ipv6_addr: None,
            asnumber: None,
            labels: vec![],
        }),
        Update::Route(route(
            REMOTE_WORKLOAD,
            POOL_NO_ENCAP,
            "10.66.2.0/26",
            "node2",
            "172.31.77.2",
        )),
        Update::Route(route(
            LOCAL_WORKLOAD,
            POOL_NO_ENCAP,
            "10.66.1.0/26",
            "node1",
            "172.31.77.1",
        )),
        Update::Route(route(
            REMOTE_WORKLOAD,
            POOL_IPIP,
            "10.67.2.0/26",
            "node2",
            "192.168.50.2",
        )),
    ] {
        m.on_update(&u);
    }
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    assert_eq!(
        routes(&k),
        [
            "blackhole 10.66.1.0/26 proto 80",
            "10.66.2.0/26 via 172.31.77.2 dev eth0 onlink proto 80",
        ]
    );
    let status: BTreeMap<_, _> = m.status().into_iter().collect();
    assert!(
        status["routes.waiting.0"].contains("no ipip module"),
        "{status:?}"
    );
    assert!(status["ipip"].starts_with("unavailable"), "{status:?}");
    // A kernel with the ipip module has tunl0.
    m.on_interface(&InterfaceEvent::Link {
        index: 9,
        name: IPIP_DEVICE.into(),
        up: true,
        mtu: 1480,
    });
    m.complete_deferred_work(&mut k).unwrap();
    assert!(
        m.status()
            .contains(&("ipip".into(), "available (tunl0 exists)".into()))
    );
    assert!(
        routes(&k).contains(&"10.67.2.0/26 via 192.168.50.2 dev tunl0 onlink proto 80".to_string()),
        "{:?}",
        routes(&k)
    );
    // IpInIpEnabled false in a ConfigUpdate: IPIP pools are not ours.
    m.on_update(&Update::Config(vec![(
        "IpInIpEnabled".into(),
        "false".into(),
    )]));
    m.complete_deferred_work(&mut k).unwrap();
    assert!(
        !routes(&k).iter().any(|r| r.contains("tunl0")),
        "{:?}",
        routes(&k)
    );
}

#[test]
fn a_pools_cidr_over_the_blocks_carved_from_it_is_no_overlap() {
    // Felix sends every pool's CIDR as a route of no node (CIDR_INFO):
    // it covers the nodes' blocks, before or after them (a real Felix's
    // first snapshot was refused for it).
    let m = vxlan_node();
    let pool = Route {
        dst_node_name: None,
        dst_node_ip: None,
        ..route(0, POOL_VXLAN, "10.65.0.0/16", "-", "0.0.0.0")
    };
    m.check(&Update::Route(pool.clone())).unwrap();
    let mut m = vxlan_node();
    m.on_update(&Update::Route(pool));
    m.check(&Update::Route(route(
        REMOTE_WORKLOAD,
        POOL_VXLAN,
        "10.65.3.0/26",
        "node3",
        "172.31.77.3",
    )))
    .unwrap();
}

#[test]
fn bad_input_is_refused_with_a_reason() {
    let m = vxlan_node();
    let overlap = Update::Route(route(
        REMOTE_WORKLOAD,
        POOL_VXLAN,
        "10.65.2.0/24",
        "node3",
        "172.31.77.3",
    ));
    let e = m.check(&overlap).unwrap_err();
    assert_eq!(e.field, "route_update.dst");
    assert!(
        e.reason
            .contains("overlaps block 10.65.2.0/26 of node \"node2\""),
        "{e}"
    );
    // A smaller block inside another node's block, too.
    let inside = Update::Route(route(
        REMOTE_WORKLOAD,
        POOL_VXLAN,
        "10.65.2.16/28",
        "node3",
        "172.31.77.3",
    ));
    let e = m.check(&inside).unwrap_err();
    assert!(e.reason.contains("overlaps block 10.65.2.0/26"), "{e}");
    // A neighbouring block of another node is fine.
    m.check(&Update::Route(route(
        REMOTE_WORKLOAD,
        POOL_VXLAN,
        "10.65.2.64/26",
        "node3",
        "172.31.77.3",
    )))
    .unwrap();
    // The same block again (an update) and a borrowed /32 inside a block
    // are fine.
    m.check(&Update::Route(route(
        REMOTE_WORKLOAD,
        POOL_VXLAN,
        "10.65.2.0/26",
        "node2",
        "172.31.77.2",
    )))
    .unwrap();
    m.check(&Update::Route(Route {
        borrowed: true,
        ..route(
            REMOTE_TUNNEL,
            POOL_VXLAN,
            "10.65.2.7/32",
            "node3",
            "172.31.77.3",
        )
    }))
    .unwrap();
    for (mac, why) in [
        ([0xff; 6], "not a unicast MAC"),
        ([0x01, 0, 0x5e, 0, 0, 1], "not a unicast MAC"),
        ([0; 6], "not a unicast MAC"),
    ] {
        let Update::Vtep(mut v) = vtep("node3", 3, "10.65.3.0", "172.31.77.3") else {
            unreachable!()
        };
        v.mac = Some(MacAddr(mac));
        let e = m.check(&Update::Vtep(v)).unwrap_err();
        assert!(e.reason.contains(why), "{e}");
        assert_eq!(e.field, "vtep_update.mac");
    }
    let Update::Vtep(mut v) = vtep("node3", 3, "10.65.3.0", "172.31.77.3") else {
        unreachable!()
    };
    v.parent_device_ip = None;
    assert_eq!(
        m.check(&Update::Vtep(v)).unwrap_err().field,
        "vtep_update.parent_device_ip"
    );
}

#[test]
fn a_route_update_is_worked_out_alone_and_workload_links_change_nothing() {
    let mut m = vxlan_node();
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    // A pod's veth comes and goes: nothing of ours depends on it.
    m.on_interface(&InterfaceEvent::Link {
        index: 7,
        name: "cali9".into(),
        up: true,
        mtu: 1500,
    });
    m.on_interface(&InterfaceEvent::LinkRemoved {
        index: 7,
        name: "cali9".into(),
    });
    assert!(!m.all_dirty);
    // Another block of node 2: that destination alone.
    m.on_update(&Update::Route(route(
        REMOTE_WORKLOAD,
        POOL_VXLAN,
        "10.65.4.0/26",
        "node2",
        "172.31.77.2",
    )));
    assert!(!m.all_dirty);
    assert_eq!(m.dirty_dsts.len(), 1);
    m.complete_deferred_work(&mut k).unwrap();
    assert!(
        routes(&k).contains(
            &"10.65.4.0/26 via 10.65.2.0 dev vxlan.calico onlink proto 3 mtu 1450".to_string()
        ),
        "{:?}",
        routes(&k)
    );
    let status: BTreeMap<_, _> = m.status().into_iter().collect();
    assert_eq!(status["routes.vxlan"], "4");
    // An address elsewhere on the underlay changes nothing either; a new
    // MTU of the parent does.
    m.on_interface(&InterfaceEvent::AddrAdded {
        index: 2,
        addr: "172.31.78.1/24".parse().unwrap(),
    });
    assert!(!m.all_dirty);
    m.on_interface(&InterfaceEvent::Link {
        index: 2,
        name: "eth0".into(),
        up: true,
        mtu: 9000,
    });
    assert!(m.all_dirty);
    m.complete_deferred_work(&mut k).unwrap();
    // The parent's address goes for a moment: the device and the routes
    // through it stay as they are; what waits is reported.
    m.on_interface(&InterfaceEvent::AddrRemoved {
        index: 2,
        addr: "172.31.77.1/24".parse().unwrap(),
    });
    assert!(m.all_dirty);
    m.complete_deferred_work(&mut k).unwrap();
    assert_eq!(routes(&k).len(), 5, "{:?}", routes(&k));
    assert_eq!(
        k.vxlan.as_ref().unwrap().desired(VXLAN_V4).unwrap().mtu,
        8950
    );
    let status: BTreeMap<_, _> = m.status().into_iter().collect();
    assert!(
        status["vxlan.vxlan.calico"].contains("172.31.77.1"),
        "{status:?}"
    );
}

#[test]
fn another_node_s_vtep_touches_its_entries_and_its_routes_only() {
    let mut m = vxlan_node();
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    // Node 2 comes back with another MAC and VTEP address.
    m.on_update(&vtep("node2", 9, "10.65.2.1", "172.31.77.2"));
    assert!(!m.all_dirty);
    assert!(m.vteps_dirty);
    assert_eq!(
        m.dirty_dsts
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["10.65.1.60/32", "10.65.2.0/26", "10.65.2.0/32"],
        "the routes to node 2"
    );
    m.complete_deferred_work(&mut k).unwrap();
    assert!(
        routes(&k).contains(
            &"10.65.2.0/26 via 10.65.2.1 dev vxlan.calico onlink proto 3 mtu 1450".to_string()
        ),
        "{:?}",
        routes(&k)
    );
    let r = k.routes.as_ref().unwrap();
    assert_eq!(
        r.desired_neighbours()
            .iter()
            .map(|n| (n.addr.to_string(), n.mac.to_string()))
            .collect::<Vec<_>>(),
        [("10.65.2.1".to_string(), "66:6a:00:00:00:09".to_string())]
    );
    // Node 2 leaves: its entries go, its block waits for a VTEP again.
    m.on_update(&Update::Remove(Key::Vtep(id("node2"))));
    assert!(!m.all_dirty);
    m.complete_deferred_work(&mut k).unwrap();
    assert!(k.routes.as_ref().unwrap().desired_neighbours().is_empty());
    assert!(
        !routes(&k).iter().any(|r| r.starts_with("10.65.2.0/26")),
        "{:?}",
        routes(&k)
    );
    // Our own VTEP is everything's business.
    m.on_update(&vtep("node1", 7, "10.65.1.0", "172.31.77.1"));
    assert!(m.all_dirty);
}

/// No route a feeder asks for may replace the node's default route or
/// cover its own addresses and subnets; a route this manager does not
/// program (another host's address) may name them.
#[test]
fn no_route_covers_the_default_or_the_nodes_own_addresses() {
    let mut m = vxlan_node();
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    for (types, dst, says) in [
        (LOCAL_WORKLOAD, "0.0.0.0/0", "default route"),
        (REMOTE_WORKLOAD, "::/0", "default route"),
        (REMOTE_WORKLOAD, "127.0.0.0/8", "not a unicast range"),
        (LOCAL_WORKLOAD, "224.0.0.0/4", "not a unicast range"),
        // eth0 holds 172.31.77.1/24 (the node's uplink).
        (LOCAL_WORKLOAD, "172.31.0.0/16", "an address of this node"),
        (REMOTE_WORKLOAD, "172.31.77.0/24", "an address of this node"),
        (REMOTE_WORKLOAD, "172.31.77.1/32", "an address of this node"),
    ] {
        let r = Update::Route(route(types, POOL_VXLAN, dst, "node2", "172.31.77.2"));
        let e = m.check(&r).unwrap_err();
        assert_eq!(e.field, "route_update.dst");
        assert!(e.reason.contains(says), "{dst}: {}", e.reason);
    }
    // Another node's address: not a route of ours to program.
    let host = Update::Route(route(
        2,
        POOL_VXLAN,
        "172.31.77.2/32",
        "node2",
        "172.31.77.2",
    ));
    m.check(&host).unwrap();
    // A block beside the uplink's subnet: fine.
    let block = Update::Route(route(
        REMOTE_WORKLOAD,
        POOL_VXLAN,
        "10.65.9.0/26",
        "node3",
        "172.31.77.3",
    ));
    m.check(&block).unwrap();
}
