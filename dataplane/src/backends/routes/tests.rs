//! The routes backend against a fake kernel: what it reads as ours, the
//! writes it makes, the grace period, failures.

use std::sync::{Arc, Mutex};

use super::*;
use crate::model::routes::{RouteClass, RouteKind};

/// A kernel in memory: links, routes, neighbours and FDB entries, and every
/// write made to it. Writes change it as the kernel would.
#[derive(Debug, Default)]
struct State {
    links: Vec<Link>,
    routes: BTreeMap<RouteKey, KernelRoute>,
    neighbours: Vec<KernelNeighbour>,
    fdb: Vec<KernelFdb>,
    writes: Vec<RouteOp>,
    /// Writes that fail (by position among all writes so far).
    fail_at: Option<usize>,
    /// A route the kernel refuses as invalid (EINVAL), by destination.
    refuse: Option<String>,
    dumps: usize,
}

#[derive(Debug, Clone, Default)]
struct Fake(Arc<Mutex<State>>);

impl RouteSeam for Fake {
    fn links(&mut self) -> Result<Vec<Link>, BackendError> {
        Ok(self.0.lock().unwrap().links.clone())
    }
    fn routes(&mut self) -> Result<Vec<KernelRoute>, BackendError> {
        let mut s = self.0.lock().unwrap();
        s.dumps += 1;
        Ok(s.routes.values().cloned().collect())
    }
    fn neighbours(&mut self) -> Result<(Vec<KernelNeighbour>, Vec<KernelFdb>), BackendError> {
        let s = self.0.lock().unwrap();
        Ok((s.neighbours.clone(), s.fdb.clone()))
    }
    fn write(&mut self, ops: &[RouteOp]) -> Vec<(usize, BackendError)> {
        let mut s = self.0.lock().unwrap();
        let mut failed = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            if s.fail_at == Some(s.writes.len()) {
                s.writes.push(op.clone());
                failed.push((
                    i,
                    BackendError::Scripted {
                        backend: "routes",
                        call: i,
                        permanent: false,
                    },
                ));
                continue;
            }
            if let RouteOp::ReplaceRoute(r) = op
                && s.refuse.as_deref() == Some(r.key.dst.to_string().as_str())
            {
                s.writes.push(op.clone());
                failed.push((
                    i,
                    BackendError::Scripted {
                        backend: "routes",
                        call: i,
                        permanent: true,
                    },
                ));
                continue;
            }
            s.writes.push(op.clone());
            match op {
                RouteOp::ReplaceRoute(r) => {
                    s.routes.insert(r.key, r.clone());
                }
                RouteOp::DeleteRoute(k) => {
                    s.routes.remove(k);
                }
                RouteOp::ReplaceNeighbour { ifindex, addr, mac } => {
                    s.neighbours
                        .retain(|n| !(n.ifindex == *ifindex && n.addr == *addr));
                    s.neighbours.push(KernelNeighbour {
                        ifindex: *ifindex,
                        addr: *addr,
                        mac: Some(*mac),
                        permanent: true,
                    });
                }
                RouteOp::DeleteNeighbour { ifindex, addr } => {
                    s.neighbours
                        .retain(|n| !(n.ifindex == *ifindex && n.addr == *addr));
                }
                RouteOp::AddFdb(f) => s.fdb.push(f.clone()),
                RouteOp::DeleteFdb(f) => s.fdb.retain(|x| x != f),
            }
        }
        failed
    }
}

impl Fake {
    fn with_links(links: &[(u32, &str)]) -> Self {
        let f = Fake::default();
        f.0.lock().unwrap().links = links
            .iter()
            .map(|(i, n)| Link {
                index: *i,
                name: n.to_string(),
            })
            .collect();
        f
    }
    /// A link appears in the kernel.
    fn add_link(&self, index: u32, name: &str) {
        self.0.lock().unwrap().links.push(Link {
            index,
            name: name.into(),
        });
    }
    fn add_route(&self, r: KernelRoute) {
        self.0.lock().unwrap().routes.insert(r.key, r);
    }
    fn take_writes(&self) -> Vec<RouteOp> {
        std::mem::take(&mut self.0.lock().unwrap().writes)
    }
    fn has(&self, dst: &str) -> bool {
        let k = RouteKey::main(dst.parse().unwrap());
        self.0.lock().unwrap().routes.contains_key(&k)
    }
}

fn own() -> RouteOwnership {
    RouteOwnership {
        exclusive_protocol: 80,
        device_protocol: 3,
        workload_prefix: "cali".into(),
        remove_external_routes: true,
        tunnel_devices: vec!["vxlan.calico".into()],
        tables: vec![],
    }
}

fn key(dst: &str) -> RouteKey {
    RouteKey::main(dst.parse().unwrap())
}

fn dev_route(dev: &str) -> RouteTarget {
    RouteTarget {
        class: RouteClass::LocalWorkload,
        kind: RouteKind::Unicast,
        dev: Some(dev.into()),
        gateway: None,
        onlink: false,
        protocol: 3,
        mtu: None,
    }
}

fn blackhole() -> RouteTarget {
    RouteTarget {
        class: RouteClass::Blackhole,
        kind: RouteKind::Blackhole,
        dev: None,
        gateway: None,
        onlink: false,
        protocol: 80,
        mtu: None,
    }
}

/// A route in the kernel as someone (we or another) left it.
fn kroute(dst: &str, oif: Option<u32>, protocol: u8, kind: u8) -> KernelRoute {
    KernelRoute {
        key: key(dst),
        kind,
        oif,
        gateway: None,
        onlink: false,
        scope: if oif.is_some() {
            RT_SCOPE_LINK
        } else {
            RT_SCOPE_UNIVERSE
        },
        protocol,
        mtu: None,
    }
}

/// The write that puts `t` at `dst`.
fn replace(dst: &str, t: &RouteTarget, oif: Option<u32>) -> RouteOp {
    RouteOp::ReplaceRoute(kernel_route(key(dst), t, oif))
}

fn mac(s: &str) -> MacAddr {
    MacAddr::parse(s).unwrap()
}

#[test]
fn reads_only_ours_and_writes_only_differences() {
    let k = Fake::with_links(&[(1, "lo"), (2, "eth0"), (3, "cali1"), (4, "vxlan.calico")]);
    // Ours: right already; by protocol (stale); by workload device
    // (foreign protocol, stale); by tunnel device (stale).
    k.add_route(kroute("10.65.0.2/32", Some(3), 3, RTN_UNICAST));
    k.add_route(kroute("10.65.9.0/26", None, 80, RTN_BLACKHOLE));
    k.add_route(kroute("10.77.0.0/24", Some(3), 4, RTN_UNICAST));
    k.add_route(kroute("10.65.5.0/26", Some(4), 3, RTN_UNICAST));
    // Not ours: other protocols elsewhere, another's blackhole, the
    // kernel's link-local route on a workload interface, another table.
    k.add_route(kroute("192.168.0.0/24", Some(2), 2, RTN_UNICAST));
    k.add_route(kroute("10.99.0.0/24", Some(2), 4, RTN_UNICAST));
    k.add_route(kroute("10.98.0.0/24", None, 4, RTN_BLACKHOLE));
    k.add_route(kroute("fe80::/64", Some(3), 2, RTN_UNICAST));
    let mut other_table = kroute("10.65.7.0/26", None, 80, RTN_BLACKHOLE);
    other_table.key.table = 100;
    k.add_route(other_table);

    let mut r = Routes::new(own(), Box::new(k.clone()));
    r.set(
        RouteSource::Workloads,
        [
            (key("10.65.0.2/32"), dev_route("cali1")),
            (key("fd00::2/128"), dev_route("cali1")),
        ]
        .into(),
        [Neighbour {
            dev: "cali1".into(),
            addr: "10.65.0.2".parse().unwrap(),
            mac: mac("02:00:00:00:00:01"),
        }]
        .into(),
    );
    r.set(
        RouteSource::Cluster,
        [(key("10.65.1.0/26"), blackhole())].into(),
        BTreeSet::new(),
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    let w = k.take_writes();
    let v6 = kernel_route(key("fd00::2/128"), &dev_route("cali1"), Some(3));
    assert_eq!(v6.key.metric, 1024, "IPv6 metric 0 is the kernel's 1024");
    assert_eq!(
        w,
        vec![
            RouteOp::ReplaceNeighbour {
                ifindex: 3,
                addr: "10.65.0.2".parse().unwrap(),
                mac: mac("02:00:00:00:00:01"),
            },
            replace("10.65.1.0/26", &blackhole(), None),
            RouteOp::ReplaceRoute(v6),
            RouteOp::DeleteRoute(key("10.65.5.0/26")),
            RouteOp::DeleteRoute(key("10.65.9.0/26")),
            RouteOp::DeleteRoute(key("10.77.0.0/24")),
        ]
    );
    for foreign in [
        "192.168.0.0/24",
        "10.99.0.0/24",
        "10.98.0.0/24",
        "fe80::/64",
    ] {
        assert!(k.has(foreign), "{foreign} was touched");
    }
    assert!(!r.is_dirty(Phase::RoutesAndRules));
    // Nothing changed: nothing written, even after a re-read.
    r.request_resync(Refresh::Routes);
    r.apply(Phase::RoutesAndRules).unwrap();
    assert!(k.take_writes().is_empty());
    assert_eq!(
        r.status(),
        vec![
            ("kernel.routes".to_string(), "3".to_string()),
            ("kernel.neighbours".to_string(), "1".to_string()),
            ("kernel.fdb".to_string(), "0".to_string()),
        ]
    );
}

#[test]
fn every_route_of_a_table_we_own_is_ours() {
    let k = Fake::default();
    let mut theirs = kroute("10.70.0.0/24", None, 4, RTN_BLACKHOLE);
    theirs.key.table = 100;
    let mut ours = theirs.clone();
    ours.key.table = 1;
    k.add_route(theirs.clone());
    k.add_route(ours.clone());
    let mut o = own();
    o.tables = vec![1];
    let mut r = Routes::new(o, Box::new(k.clone()));
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(k.take_writes(), vec![RouteOp::DeleteRoute(ours.key)]);
}

#[test]
fn without_remove_external_routes_only_our_protocols_on_workloads() {
    let k = Fake::with_links(&[(3, "cali1")]);
    k.add_route(kroute("10.77.0.0/24", Some(3), 4, RTN_UNICAST));
    k.add_route(kroute("10.78.0.0/24", Some(3), 3, RTN_UNICAST));
    let mut o = own();
    o.remove_external_routes = false;
    let mut r = Routes::new(o, Box::new(k.clone()));
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![RouteOp::DeleteRoute(key("10.78.0.0/24"))]
    );
    assert!(k.has("10.77.0.0/24"));
}

#[test]
fn lowest_class_wins_a_key() {
    let k = Fake::with_links(&[(3, "cali1")]);
    let mut r = Routes::new(own(), Box::new(k.clone()));
    r.set(
        RouteSource::Cluster,
        [(key("10.65.0.2/32"), blackhole())].into(),
        BTreeSet::new(),
    );
    r.set(
        RouteSource::Workloads,
        [(key("10.65.0.2/32"), dev_route("cali1"))].into(),
        BTreeSet::new(),
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![replace("10.65.0.2/32", &dev_route("cali1"), Some(3))]
    );
}

#[test]
fn neighbours_and_fdb_on_our_devices_only() {
    let k = Fake::with_links(&[(2, "eth0"), (3, "cali1"), (4, "vxlan.calico")]);
    {
        let mut s = k.0.lock().unwrap();
        for (ifindex, addr, permanent) in [
            (2, "192.168.0.9", true), // not our device
            (3, "10.65.0.7", true),   // ours, stale
            (3, "10.65.0.8", false),  // learnt, not ours
            (4, "10.65.3.0", true),   // ours, stale VTEP
        ] {
            s.neighbours.push(KernelNeighbour {
                ifindex,
                addr: addr.parse().unwrap(),
                mac: Some(mac("02:00:00:00:00:09")),
                permanent,
            });
        }
        s.fdb.push(KernelFdb {
            ifindex: 4,
            mac: mac("66:00:00:00:00:03"),
            dst: Some("172.31.0.3".parse().unwrap()),
        });
        s.fdb.push(KernelFdb {
            ifindex: 2,
            mac: mac("66:00:00:00:00:04"),
            dst: None,
        });
    }
    let mut r = Routes::new(own(), Box::new(k.clone()));
    r.set(
        RouteSource::Cluster,
        BTreeMap::new(),
        [Neighbour {
            dev: "vxlan.calico".into(),
            addr: "10.65.2.0".parse().unwrap(),
            mac: mac("66:00:00:00:00:02"),
        }]
        .into(),
    );
    r.set_fdb(
        [FdbEntry {
            dev: "vxlan.calico".into(),
            mac: mac("66:00:00:00:00:02"),
            dst: "172.31.0.2".parse().unwrap(),
        }]
        .into(),
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    let w = k.take_writes();
    assert_eq!(
        w,
        vec![
            RouteOp::ReplaceNeighbour {
                ifindex: 4,
                addr: "10.65.2.0".parse().unwrap(),
                mac: mac("66:00:00:00:00:02"),
            },
            RouteOp::AddFdb(KernelFdb {
                ifindex: 4,
                mac: mac("66:00:00:00:00:02"),
                dst: Some("172.31.0.2".parse().unwrap()),
            }),
            RouteOp::DeleteNeighbour {
                ifindex: 3,
                addr: "10.65.0.7".parse().unwrap(),
            },
            RouteOp::DeleteNeighbour {
                ifindex: 4,
                addr: "10.65.3.0".parse().unwrap(),
            },
            RouteOp::DeleteFdb(KernelFdb {
                ifindex: 4,
                mac: mac("66:00:00:00:00:03"),
                dst: Some("172.31.0.3".parse().unwrap()),
            }),
        ]
    );
}

#[test]
fn a_route_to_a_missing_device_waits_for_it() {
    let k = Fake::with_links(&[(3, "cali1")]);
    let mut r = Routes::new(own(), Box::new(k.clone()));
    r.set(
        RouteSource::Workloads,
        [
            (key("10.65.0.2/32"), dev_route("cali1")),
            (key("10.65.0.3/32"), dev_route("cali2")),
        ]
        .into(),
        BTreeSet::new(),
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(k.take_writes().len(), 1);
    assert_eq!(r.summary().missing_devices, vec!["cali2".to_string()]);
    assert!(
        r.status()
            .contains(&("kernel.routes.missing_devices".into(), "cali2".into()))
    );
    // The device appears (made after our last link dump): the same desired
    // state, set again when the manager hears of it, is written now.
    k.add_link(5, "cali2");
    r.set(
        RouteSource::Workloads,
        [
            (key("10.65.0.2/32"), dev_route("cali1")),
            (key("10.65.0.3/32"), dev_route("cali2")),
        ]
        .into(),
        BTreeSet::new(),
    );
    assert!(r.is_dirty(Phase::RoutesAndRules));
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![replace("10.65.0.3/32", &dev_route("cali2"), Some(5))]
    );
    assert!(r.summary().missing_devices.is_empty());
}

#[test]
fn a_new_workload_interface_keeps_unexpected_routes_for_the_grace_period() {
    let k = Fake::with_links(&[(3, "cali1")]);
    let mut r = Routes::new(own(), Box::new(k.clone())).with_grace(Duration::from_millis(300));
    r.apply(Phase::RoutesAndRules).unwrap();
    // CNI makes cali2 and its route; the calc graph has not told us yet.
    k.add_link(7, "cali2");
    r.link_added(7, "cali2");
    k.add_route(kroute("10.65.0.9/32", Some(7), 3, RTN_UNICAST));
    r.request_resync(Refresh::Routes);
    let out = r.apply(Phase::RoutesAndRules).unwrap();
    assert!(k.take_writes().is_empty(), "spared in its grace period");
    let again = out
        .reschedule_after
        .expect("comes back when the grace ends");
    assert!(again <= Duration::from_millis(300));
    assert!(!r.is_dirty(Phase::RoutesAndRules));
    // Something else changes meanwhile: the grace period still ends when
    // it was going to.
    r.update(RouteSource::Cluster, key("10.65.9.0/26"), Some(blackhole()));
    let out = r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(k.take_writes().len(), 1);
    assert!(out.reschedule_after.is_some_and(|d| d <= again));
    std::thread::sleep(again);
    assert!(r.is_dirty(Phase::RoutesAndRules));
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![RouteOp::DeleteRoute(key("10.65.0.9/32"))]
    );
    // Interfaces present at start get no grace: stale routes go at once.
    let k = Fake::with_links(&[(3, "cali1")]);
    k.add_route(kroute("10.65.0.8/32", Some(3), 3, RTN_UNICAST));
    let mut r = Routes::new(own(), Box::new(k.clone()));
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![RouteOp::DeleteRoute(key("10.65.0.8/32"))]
    );
}

#[test]
fn a_removed_link_takes_its_routes_and_they_come_back_with_it() {
    let k = Fake::with_links(&[(3, "cali1")]);
    let mut r = Routes::new(own(), Box::new(k.clone()));
    let want: BTreeMap<_, _> = [(key("10.65.0.2/32"), dev_route("cali1"))].into();
    r.set(RouteSource::Workloads, want.clone(), BTreeSet::new());
    r.apply(Phase::RoutesAndRules).unwrap();
    k.take_writes();
    // The kernel drops the routes of a deleted link; the pod comes back
    // under the same name with a new index.
    {
        let mut s = k.0.lock().unwrap();
        s.routes.clear();
        s.links = vec![Link {
            index: 9,
            name: "cali1".into(),
        }];
    }
    r.link_removed(3, "cali1");
    r.link_added(9, "cali1");
    r.set(RouteSource::Workloads, want, BTreeSet::new());
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![replace("10.65.0.2/32", &dev_route("cali1"), Some(9))]
    );
}

#[test]
fn a_route_deleted_by_hand_is_written_again_at_its_event() {
    let k = Fake::with_links(&[(3, "cali1")]);
    let mut r = Routes::new(own(), Box::new(k.clone()));
    r.set(
        RouteSource::Workloads,
        [(key("10.65.0.2/32"), dev_route("cali1"))].into(),
        BTreeSet::new(),
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    k.take_writes();
    // Someone else's route goes: nothing to do (the loop does not even
    // wake for it).
    assert!(r.holds(&key("10.65.0.2/32")));
    assert!(!r.holds(&key("198.18.0.0/24")));
    r.route_removed(key("198.18.0.0/24"));
    assert!(!r.is_dirty(Phase::RoutesAndRules));
    // Ours goes (`ip route del`): written again at the next apply.
    k.0.lock().unwrap().routes.remove(&key("10.65.0.2/32"));
    r.route_removed(key("10.65.0.2/32"));
    assert!(r.is_dirty(Phase::RoutesAndRules));
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![replace("10.65.0.2/32", &dev_route("cali1"), Some(3))]
    );
    // The event of our own deletion finds nothing to do.
    r.set(RouteSource::Workloads, BTreeMap::new(), BTreeSet::new());
    r.apply(Phase::RoutesAndRules).unwrap();
    k.take_writes();
    r.route_removed(key("10.65.0.2/32"));
    assert!(!r.is_dirty(Phase::RoutesAndRules));
}

#[test]
fn a_new_index_for_a_name_rewrites_its_routes_even_unannounced() {
    // The removal event was missed (a monitor reconnect): the new index
    // alone tells us that what went through the old one is gone.
    let k = Fake::with_links(&[(3, "cali1")]);
    let mut r = Routes::new(own(), Box::new(k.clone()));
    r.set(
        RouteSource::Workloads,
        [(key("10.65.0.2/32"), dev_route("cali1"))].into(),
        BTreeSet::new(),
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    k.take_writes();
    k.0.lock().unwrap().links = vec![Link {
        index: 11,
        name: "cali1".into(),
    }];
    r.link_added(11, "cali1");
    assert!(r.is_dirty(Phase::RoutesAndRules));
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![replace("10.65.0.2/32", &dev_route("cali1"), Some(11))]
    );
}

#[test]
fn a_failed_write_is_retried_after_a_fresh_read() {
    let k = Fake::with_links(&[(3, "cali1")]);
    k.0.lock().unwrap().fail_at = Some(0);
    let mut r = Routes::new(own(), Box::new(k.clone()));
    r.set(
        RouteSource::Workloads,
        [
            (key("10.65.0.2/32"), dev_route("cali1")),
            (key("10.65.0.3/32"), dev_route("cali1")),
        ]
        .into(),
        BTreeSet::new(),
    );
    let err = r.apply(Phase::RoutesAndRules).unwrap_err();
    assert!(err.retryable());
    assert_eq!(k.take_writes().len(), 2, "the other write went through");
    assert!(r.is_dirty(Phase::RoutesAndRules));
    k.0.lock().unwrap().fail_at = None;
    let dumps = k.0.lock().unwrap().dumps;
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(k.0.lock().unwrap().dumps, dumps + 1, "read again");
    assert_eq!(
        k.take_writes(),
        vec![replace("10.65.0.2/32", &dev_route("cali1"), Some(3))]
    );
}

#[test]
fn a_change_looks_only_at_the_keys_it_touches() {
    let k = Fake::with_links(&[(3, "cali1")]);
    let mut r = Routes::new(own(), Box::new(k.clone()));
    let many: BTreeMap<RouteKey, RouteTarget> = (0..1000u32)
        .map(|i| {
            let dst = format!("10.{}.{}.0/26", 100 + i / 256, i % 256);
            (key(&dst), blackhole())
        })
        .collect();
    r.set(RouteSource::Cluster, many.clone(), BTreeSet::new());
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(k.take_writes().len(), 1000);
    // A foreign change the refresh would see is not looked for between
    // refreshes: an apply only visits what changed.
    k.0.lock().unwrap().routes.remove(&key("10.100.5.0/26"));
    let mut one_more = many.clone();
    one_more.insert(key("10.200.0.0/26"), blackhole());
    r.set(RouteSource::Cluster, one_more, BTreeSet::new());
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![replace("10.200.0.0/26", &blackhole(), None)]
    );
    r.update(RouteSource::Cluster, key("10.200.0.0/26"), None);
    r.update(
        RouteSource::Cluster,
        key("10.100.7.0/26"),
        Some(blackhole()),
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![RouteOp::DeleteRoute(key("10.200.0.0/26"))],
        "an update to the same value is no change"
    );
    assert_eq!(k.0.lock().unwrap().dumps, 1, "no re-read");
    // The refresh tick reads and looks at everything: the route deleted by
    // hand comes back.
    r.request_resync(Refresh::Routes);
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![replace("10.100.5.0/26", &blackhole(), None)]
    );
}

#[test]
fn routes_waiting_for_a_device_keep_waiting_across_other_changes() {
    let k = Fake::with_links(&[(3, "cali1")]);
    let mut r = Routes::new(own(), Box::new(k.clone()));
    r.set(
        RouteSource::Workloads,
        [(key("10.65.0.3/32"), dev_route("cali2"))].into(),
        BTreeSet::new(),
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    // Something else changes meanwhile.
    r.update(RouteSource::Cluster, key("10.65.9.0/26"), Some(blackhole()));
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(r.summary().missing_devices, vec!["cali2".to_string()]);
    k.take_writes();
    // cali2 appears: the interface monitor tells us.
    k.add_link(5, "cali2");
    r.link_added(5, "cali2");
    assert!(r.is_dirty(Phase::RoutesAndRules));
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(k.take_writes().len(), 1);
    assert!(r.summary().missing_devices.is_empty());
}

/// A patch changes its routes and neighbours and leaves the rest of the
/// source's share as it was.
#[test]
fn a_patch_writes_its_own_routes_and_neighbours() {
    let k = Fake::with_links(&[(3, "cali1"), (4, "cali2")]);
    let mut r = Routes::new(own(), Box::new(k.clone()));
    r.set(
        RouteSource::Workloads,
        [(key("10.65.0.2/32"), dev_route("cali1"))].into(),
        BTreeSet::new(),
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    k.take_writes();
    let n = Neighbour {
        dev: "cali2".into(),
        addr: "10.65.0.3".parse().unwrap(),
        mac: mac("02:00:00:00:00:03"),
    };
    r.patch(
        RouteSource::Workloads,
        [(key("10.65.0.3/32"), Some(dev_route("cali2")))],
        [(n.clone(), true)],
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![
            RouteOp::ReplaceNeighbour {
                ifindex: 4,
                addr: "10.65.0.3".parse().unwrap(),
                mac: mac("02:00:00:00:00:03"),
            },
            replace("10.65.0.3/32", &dev_route("cali2"), Some(4)),
        ]
    );
    // The same again changes nothing.
    r.patch(
        RouteSource::Workloads,
        [(key("10.65.0.3/32"), Some(dev_route("cali2")))],
        [(n.clone(), true)],
    );
    assert!(!r.is_dirty(Phase::RoutesAndRules));
    r.patch(
        RouteSource::Workloads,
        [(key("10.65.0.2/32"), None)],
        [(n, false)],
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![
            RouteOp::DeleteRoute(key("10.65.0.2/32")),
            RouteOp::DeleteNeighbour {
                ifindex: 4,
                addr: "10.65.0.3".parse().unwrap(),
            },
        ]
    );
    assert_eq!(
        r.desired()
            .keys()
            .map(|k| k.dst.to_string())
            .collect::<Vec<_>>(),
        ["10.65.0.3/32"]
    );
}

/// A route the kernel refuses as invalid is isolated: the others are
/// written and the apply succeeds; it is reported and not written again
/// until what is wanted of it changes.
#[test]
fn a_route_the_kernel_refuses_is_isolated_and_the_rest_written() {
    let k = Fake::with_links(&[(3, "cali1")]);
    k.0.lock().unwrap().refuse = Some("10.65.0.3/32".into());
    let mut r = Routes::new(own(), Box::new(k.clone()));
    r.set(
        RouteSource::Workloads,
        [
            (key("10.65.0.2/32"), dev_route("cali1")),
            (key("10.65.0.3/32"), dev_route("cali1")),
        ]
        .into(),
        BTreeSet::new(),
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    assert!(k.has("10.65.0.2/32"));
    assert!(!k.has("10.65.0.3/32"));
    let st: BTreeMap<String, String> = r.status().into_iter().collect();
    assert!(
        st["isolated.routes.table254.10.65.0.3/32"].contains("scripted failure"),
        "{st:?}"
    );
    // Not written again while it stays as it is.
    k.take_writes();
    r.set(
        RouteSource::Workloads,
        [
            (key("10.65.0.2/32"), dev_route("cali1")),
            (key("10.65.0.3/32"), dev_route("cali1")),
            (key("10.65.0.4/32"), dev_route("cali1")),
        ]
        .into(),
        BTreeSet::new(),
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![replace("10.65.0.4/32", &dev_route("cali1"), Some(3))]
    );
    // Changed (and no longer refused): written, no longer reported.
    k.0.lock().unwrap().refuse = None;
    r.set(
        RouteSource::Workloads,
        [(key("10.65.0.3/32"), blackhole())].into(),
        BTreeSet::new(),
    );
    r.apply(Phase::RoutesAndRules).unwrap();
    assert!(k.has("10.65.0.3/32"));
    assert!(!r.status().iter().any(|(k, _)| k.starts_with("isolated.")));
}
