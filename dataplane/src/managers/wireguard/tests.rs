use super::*;
use crate::backends::Backend;
use crate::backends::wireguard::fake::{Seam, fake};
use crate::backends::wireguard::keys::KeyStore;
use crate::backends::wireguard::{Wireguard, public_key};
use crate::model::Route;
use crate::model::wireguard::WgImpl;

fn kernel() -> DesiredKernel {
    DesiredKernel {
        wireguard: Some(Wireguard::new(
            Box::new(Seam(fake(true, true))),
            KeyStore::new(None),
            WgImpl::Auto,
        )),
        routes: Some(crate::backends::routes::empty(vec![1, 2])),
        ..DesiredKernel::default()
    }
}

/// The cluster on node-a, its device made once (the fake's first key is
/// `[1; 32]`).
fn applied_cluster() -> (WireguardManager, DesiredKernel) {
    let mut m = manager(true);
    cluster(&mut m);
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    k.wireguard
        .as_mut()
        .unwrap()
        .apply(crate::backends::Phase::Links)
        .unwrap();
    (m, k)
}

/// The IPv4 device the manager asked for.
fn v4(k: &DesiredKernel) -> &WgDevice {
    k.wireguard
        .as_ref()
        .unwrap()
        .desired(IpVersion::V4)
        .expect("an IPv4 device")
}

fn id(s: &str) -> Id {
    Id::new(s).unwrap()
}

fn host(name: &str, v4: &str) -> Update {
    Update::HostMetadata(HostMetadata {
        hostname: id(name),
        ipv4_addr: Some(v4.parse().unwrap()),
        ipv6_addr: None,
        asnumber: None,
        labels: vec![],
    })
}

fn wg(name: &str, key: u8, addr: &str) -> Update {
    Update::WireguardEndpoint(WireguardEndpoint {
        hostname: id(name),
        public_key: (key != 0).then_some([key; 32]),
        interface_addr: Some(addr.parse().unwrap()),
    })
}

fn route(dst: &str, node: &str, types: u32) -> Update {
    Update::Route(Route {
        types,
        ip_pool_type: 2,
        dst: dst.parse().unwrap(),
        dst_node_name: Some(id(node)),
        dst_node_ip: None,
        same_subnet: false,
        nat_outgoing: false,
        local_workload: false,
        ipip: false,
        vxlan: true,
        wireguard: false,
        borrowed: false,
    })
}

fn manager(enabled: bool) -> WireguardManager {
    let mut cfg = WireguardConfig {
        hostname: "node-a".into(),
        ..WireguardConfig::default()
    };
    cfg.v4.enabled = enabled;
    WireguardManager::new(cfg)
}

fn cluster(m: &mut WireguardManager) {
    for u in [
        host("node-a", "192.168.0.1"),
        host("node-b", "192.168.0.2"),
        host("node-c", "192.168.0.3"),
        wg("node-a", 1, "10.65.0.1"),
        wg("node-b", 2, "10.65.1.1"),
        wg("node-c", 3, "10.65.2.1"),
        route("10.65.0.0/26", "node-a", 4),
        route("10.65.0.5/32", "node-a", 4),
        route("10.65.1.0/26", "node-b", 1),
        route("10.65.1.1/32", "node-b", 16),
        route("10.65.2.0/26", "node-c", 1),
        // A remote host's address is no part of its share (no host
        // encryption).
        route("192.168.0.2/32", "node-b", 2),
    ] {
        m.check(&u).unwrap();
        m.on_update(&u);
    }
}

fn table(k: &DesiredKernel) -> Vec<String> {
    k.routes
        .as_ref()
        .unwrap()
        .desired()
        .iter()
        .map(|(key, t)| {
            format!(
                "{} {} {:?} {}",
                key.table,
                key.dst,
                t.kind,
                t.dev.as_deref().unwrap_or("-")
            )
        })
        .collect()
}

#[test]
fn peers_table_and_rule() {
    let mut m = manager(true);
    cluster(&mut m);
    m.on_interface(&InterfaceEvent::Link {
        index: 2,
        name: "eth0".into(),
        up: true,
        mtu: 9000,
    });
    m.on_interface(&InterfaceEvent::AddrAdded {
        index: 2,
        addr: "192.168.0.1/24".parse().unwrap(),
    });
    let mut k = kernel();
    k.ip_rules = None;
    m.complete_deferred_work(&mut k).unwrap();
    let dev = v4(&k).clone();
    assert_eq!(dev.name, "wireguard.cali");
    assert_eq!(dev.port, 51820);
    assert_eq!(dev.fwmark, 0x20_0000);
    assert_eq!(dev.mtu, 9000 - 60);
    assert_eq!(dev.addr, Some("10.65.0.1".parse().unwrap()));
    let peers: Vec<(String, String, Vec<String>)> = dev
        .peers
        .values()
        .map(|p| {
            (
                p.node.clone(),
                p.endpoint.to_string(),
                p.allowed_ips.iter().map(ToString::to_string).collect(),
            )
        })
        .collect();
    assert_eq!(
        peers,
        vec![
            (
                "node-b".to_string(),
                "192.168.0.2:51820".to_string(),
                vec!["10.65.1.0/26".to_string(), "10.65.1.1/32".to_string()]
            ),
            (
                "node-c".to_string(),
                "192.168.0.3:51820".to_string(),
                vec!["10.65.2.0/26".to_string()]
            ),
        ]
    );
    assert_eq!(
        table(&k),
        vec![
            "1 10.65.0.0/26 Throw -",
            "1 10.65.1.0/26 Unicast wireguard.cali",
            "1 10.65.1.1/32 Unicast wireguard.cali",
            "1 10.65.2.0/26 Unicast wireguard.cali",
        ]
    );
    // v6 is off: no device for it.
    assert!(
        k.wireguard
            .as_ref()
            .unwrap()
            .desired(IpVersion::V6)
            .is_none()
    );
}

#[test]
fn a_duplicate_key_makes_neither_node_a_peer() {
    let mut m = manager(true);
    cluster(&mut m);
    m.on_update(&wg("node-c", 2, "10.65.2.1"));
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    let dev = v4(&k);
    assert!(dev.peers.is_empty());
    assert!(
        table(&k).iter().all(|r| r.contains("Throw")),
        "{:?}",
        table(&k)
    );
    let s: BTreeMap<String, String> = m.status().into_iter().collect();
    assert!(
        s["wireguard.v4.not_a_peer.node-b"].contains("also claimed by node-c"),
        "{s:?}"
    );
    // node-c takes a key of its own: both are peers again.
    m.on_update(&wg("node-c", 3, "10.65.2.1"));
    m.complete_deferred_work(&mut k).unwrap();
    let dev = v4(&k);
    assert_eq!(dev.peers.len(), 2);
    // A node without an endpoint address is no peer either.
    m.on_update(&Update::Remove(Key::HostMetadata(id("node-b"))));
    m.complete_deferred_work(&mut k).unwrap();
    let s: BTreeMap<String, String> = m.status().into_iter().collect();
    assert_eq!(
        s["wireguard.v4.not_a_peer.node-b"],
        "no v4 endpoint address"
    );
}

#[test]
fn a_node_claiming_our_own_key_is_no_peer() {
    let (mut m, mut k) = applied_cluster();
    // The fake's first key is [1; 32]: node-b now claims it.
    let ours = public_key(&[1; 32]);
    m.on_update(&Update::WireguardEndpoint(WireguardEndpoint {
        hostname: id("node-b"),
        public_key: Some(ours.0),
        interface_addr: None,
    }));
    m.complete_deferred_work(&mut k).unwrap();
    let s: BTreeMap<String, String> = m.status().into_iter().collect();
    assert!(s["wireguard.v4.not_a_peer.node-b"].contains("this node's own"));
}

#[test]
fn config_update_turns_it_on_and_off_and_bad_values_are_refused() {
    let mut m = manager(false);
    cluster(&mut m);
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    assert!(
        k.wireguard
            .as_ref()
            .unwrap()
            .desired(IpVersion::V4)
            .is_none()
    );
    assert!(table(&k).is_empty());
    let on = Update::Config(vec![
        ("WireguardEnabled".into(), "true".into()),
        ("WireguardListeningPort".into(), "51999".into()),
        ("WireguardMTU".into(), "1380".into()),
        ("WireguardRoutingRulePriority".into(), "98".into()),
        ("WireguardInterfaceName".into(), "wg0.cali".into()),
    ]);
    m.check(&on).unwrap();
    m.on_update(&on);
    let mut k = kernel();
    k.ip_rules = Some(crate::backends::iprules::IpRules::new([1, 2], Box::new(NoRules)).unwrap());
    m.complete_deferred_work(&mut k).unwrap();
    let dev = v4(&k);
    assert_eq!(
        (dev.name.as_str(), dev.port, dev.mtu),
        ("wg0.cali", 51999, 1380)
    );
    assert_eq!(dev.peers.values().next().unwrap().endpoint.port(), 51999);
    let rules: Vec<IpRule> = k
        .ip_rules
        .as_ref()
        .unwrap()
        .desired()
        .iter()
        .copied()
        .collect();
    assert_eq!(
        rules,
        vec![IpRule {
            v6: false,
            priority: 98,
            fwmark: Some((0x20_0000, 0x20_0000)),
            invert: true,
            src: None,
            table: 1,
        }]
    );
    // A later ConfigUpdate without the keys: the flags again (off).
    m.on_update(&Update::Config(vec![]));
    m.complete_deferred_work(&mut k).unwrap();
    assert!(
        k.wireguard
            .as_ref()
            .unwrap()
            .desired(IpVersion::V4)
            .is_none()
    );
    assert!(k.ip_rules.as_ref().unwrap().desired().is_empty());
    assert!(table(&k).is_empty());
    for (key, value, says) in [
        ("WireguardEnabled", "maybe", "not true or false"),
        ("WireguardListeningPort", "70000", "not a UDP port"),
        ("WireguardMTU", "20", "not an MTU"),
        (
            "WireguardRoutingRulePriority",
            "32766",
            "not a rule priority",
        ),
        (
            "WireguardInterfaceName",
            "wg0 cali",
            "not an interface name",
        ),
    ] {
        let e = m
            .check(&Update::Config(vec![(key.into(), value.into())]))
            .unwrap_err();
        assert_eq!(e.field, format!("config_update.config[{key}]"));
        assert!(e.reason.contains(says), "{e}");
    }
    let e = m
        .check(&Update::WireguardEndpoint(WireguardEndpoint {
            hostname: id("node-b"),
            public_key: None,
            interface_addr: Some("fd00::1".parse().unwrap()),
        }))
        .unwrap_err();
    assert_eq!(e.field, "wireguard_endpoint_update.interface_ipv4_addr");
}

#[derive(Debug)]
struct NoRules;
impl crate::backends::iprules::IpRuleSeam for NoRules {
    fn rules(&mut self) -> Result<Vec<IpRule>, crate::backends::BackendError> {
        Ok(vec![])
    }
    fn add(&mut self, _rule: &IpRule) -> Result<(), crate::backends::BackendError> {
        Ok(())
    }
    fn delete(&mut self, _rule: &IpRule) -> Result<(), crate::backends::BackendError> {
        Ok(())
    }
}

/// The IPv4 table and device as a full pass over `updates` makes them.
fn full_pass(updates: &[Update]) -> (Vec<String>, WgDevice) {
    let mut m = manager(true);
    cluster(&mut m);
    for u in updates {
        m.on_update(u);
    }
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    (table(&k), v4(&k).clone())
}

#[test]
fn route_changes_are_worked_out_alone_and_agree_with_a_full_pass() {
    let mut m = manager(true);
    cluster(&mut m);
    let mut k = kernel();
    m.complete_deferred_work(&mut k).unwrap();
    let mut seen = Vec::new();
    for u in [
        // Another block of a peer, a block moving between peers, a
        // peer's block gone, a block of a node that is no peer (no key),
        // a workload address inside this node's block.
        route("10.65.1.64/26", "node-b", 1),
        route("10.65.2.0/26", "node-b", 1),
        Update::Remove(Key::Route("10.65.1.1/32".parse().unwrap())),
        route("10.65.9.0/26", "node-z", 1),
        route("10.65.0.9/32", "node-a", 4),
        route("10.65.9.64/26", "node-z", 1),
    ] {
        m.on_update(&u);
        let incremental = !m.all_dirty;
        m.complete_deferred_work(&mut k).unwrap();
        seen.push(u);
        let (t, dev) = full_pass(&seen);
        assert_eq!(table(&k), t, "after {:?}", seen.last());
        assert_eq!(v4(&k), &dev, "after {:?}", seen.last());
        // Only a node never seen before needs a full pass.
        let first_of_node = matches!(seen.last(), Some(Update::Route(r))
            if r.dst.to_string() == "10.65.9.0/26");
        assert_eq!(incremental, !first_of_node, "after {:?}", seen.last());
    }
}

#[test]
fn a_stale_key_for_this_node_gets_ours_announced_again() {
    let (mut m, mut k) = applied_cluster();
    let ours = public_key(&[1; 32]).to_base64();
    let first = k.wireguard.as_mut().unwrap().take_events();
    assert_eq!(first[0], (IpVersion::V4, ours.clone()));
    m.complete_deferred_work(&mut k).unwrap();
    // The calc graph still has the key of node-a's earlier life ([1; 32]
    // as a public key is not ours).
    m.on_update(&wg("node-a", 1, "10.65.0.1"));
    m.complete_deferred_work(&mut k).unwrap();
    assert_eq!(
        k.wireguard.as_mut().unwrap().take_events(),
        vec![(IpVersion::V4, ours.clone())]
    );
    // Once it has ours, nothing more.
    m.on_update(&Update::WireguardEndpoint(WireguardEndpoint {
        hostname: id("node-a"),
        public_key: Some(public_key(&[1; 32]).0),
        interface_addr: Some("10.65.0.1".parse().unwrap()),
    }));
    m.complete_deferred_work(&mut k).unwrap();
    assert!(k.wireguard.as_mut().unwrap().take_events().is_empty());
}

/// Once this node's key is out, each peer's route has a blackhole behind
/// it (metric 4096) that takes over while the device's route is gone; a
/// node that is not a peer has none; a RouteUpdate alone keeps them in
/// step; where WireGuard cannot run (no key), there are none.
#[test]
fn a_peers_route_has_a_blackhole_behind_it_once_our_key_is_out() {
    let with_metric = |k: &DesiredKernel| -> Vec<String> {
        k.routes
            .as_ref()
            .unwrap()
            .desired()
            .iter()
            .map(|(key, t)| format!("{} {} {} {:?}", key.table, key.dst, key.metric, t.kind))
            .collect()
    };
    let (mut m, mut k) = applied_cluster();
    m.complete_deferred_work(&mut k).unwrap();
    assert_eq!(
        with_metric(&k),
        vec![
            "1 10.65.0.0/26 0 Throw",
            "1 10.65.1.0/26 0 Unicast",
            "1 10.65.1.0/26 4096 Blackhole",
            "1 10.65.1.1/32 0 Unicast",
            "1 10.65.1.1/32 4096 Blackhole",
            "1 10.65.2.0/26 0 Unicast",
            "1 10.65.2.0/26 4096 Blackhole",
        ]
    );
    // A new block of node-b, worked out alone.
    let u = route("10.65.3.0/26", "node-b", 1);
    m.check(&u).unwrap();
    m.on_update(&u);
    m.complete_deferred_work(&mut k).unwrap();
    let t = with_metric(&k);
    assert!(
        t.contains(&"1 10.65.3.0/26 4096 Blackhole".to_string()),
        "{t:?}"
    );
    // It goes: both go.
    m.on_update(&Update::Remove(Key::Route("10.65.3.0/26".parse().unwrap())));
    m.complete_deferred_work(&mut k).unwrap();
    let t = with_metric(&k);
    assert!(!t.iter().any(|r| r.contains("10.65.3.0")), "{t:?}");

    // No WireGuard here at all: no key, nothing held back.
    let mut m = manager(true);
    cluster(&mut m);
    let mut k = kernel();
    k.wireguard = Some(Wireguard::new(
        Box::new(Seam(fake(false, false))),
        KeyStore::new(None),
        WgImpl::Auto,
    ));
    m.complete_deferred_work(&mut k).unwrap();
    let _ = k
        .wireguard
        .as_mut()
        .unwrap()
        .apply(crate::backends::Phase::Links);
    m.complete_deferred_work(&mut k).unwrap();
    let t = with_metric(&k);
    assert!(t.iter().any(|r| r.contains("Unicast")), "{t:?}");
    assert!(!t.iter().any(|r| r.contains("Blackhole")), "{t:?}");
}

/// A host interface whose MTU is under WireGuard's overhead (68 is a
/// valid MTU) gives the device the least its family carries, never a
/// wrapped number.
#[test]
fn a_host_mtu_under_the_overhead_gives_the_least_mtu() {
    let mut m = manager(true);
    cluster(&mut m);
    m.on_interface(&InterfaceEvent::Link {
        index: 2,
        name: "eth0".into(),
        up: true,
        mtu: 68,
    });
    m.on_interface(&InterfaceEvent::AddrAdded {
        index: 2,
        addr: "192.168.0.1/24".parse().unwrap(),
    });
    let mut k = kernel();
    k.ip_rules = None;
    m.complete_deferred_work(&mut k).unwrap();
    assert_eq!(v4(&k).mtu, 68);
}
