//! The VXLAN backend against a fake kernel.

use std::sync::{Arc, Mutex};

use super::*;

#[derive(Debug, Default)]
struct State {
    links: BTreeMap<String, ObservedLink>,
    next_index: u32,
    writes: Vec<VxlanOp>,
}

#[derive(Debug, Clone, Default)]
struct Fake(Arc<Mutex<State>>);

impl VxlanSeam for Fake {
    fn link_index(&mut self, name: &str) -> Result<Option<u32>, BackendError> {
        Ok(self.0.lock().unwrap().links.get(name).map(|l| l.index))
    }
    fn get(&mut self, name: &str) -> Result<Option<ObservedLink>, BackendError> {
        Ok(self.0.lock().unwrap().links.get(name).cloned())
    }
    fn write(&mut self, op: &VxlanOp) -> Result<(), BackendError> {
        let mut s = self.0.lock().unwrap();
        s.writes.push(op.clone());
        let by_index = |s: &mut State, i: u32| {
            s.links
                .values_mut()
                .find(|l| l.index == i)
                .expect("a link we have")
                .clone()
        };
        match op {
            VxlanOp::Create { dev, parent_index } => {
                s.next_index += 1;
                let index = 100 + s.next_index;
                s.links.insert(
                    dev.name.clone(),
                    ObservedLink {
                        index,
                        kind: "vxlan".into(),
                        vni: Some(dev.vni),
                        port: Some(dev.port),
                        parent: Some(*parent_index),
                        local: Some(dev.local),
                        mac: Some(dev.mac),
                        mtu: Some(dev.mtu),
                        up: false,
                        addrs: Vec::new(),
                    },
                );
            }
            VxlanOp::Delete { name, .. } => {
                s.links.remove(name);
            }
            VxlanOp::SetMtu { index, mtu } => {
                let _ = by_index(&mut s, *index);
                s.links
                    .values_mut()
                    .find(|l| l.index == *index)
                    .unwrap()
                    .mtu = Some(*mtu);
            }
            VxlanOp::SetUp { index } => {
                s.links.values_mut().find(|l| l.index == *index).unwrap().up = true;
            }
            VxlanOp::AddAddr { index, addr } => {
                s.links
                    .values_mut()
                    .find(|l| l.index == *index)
                    .unwrap()
                    .addrs
                    .push(*addr);
            }
            VxlanOp::DelAddr { index, addr } => {
                s.links
                    .values_mut()
                    .find(|l| l.index == *index)
                    .unwrap()
                    .addrs
                    .retain(|a| a != addr);
            }
        }
        Ok(())
    }
}

impl Fake {
    fn with_parent() -> Self {
        let f = Fake::default();
        f.0.lock().unwrap().links.insert(
            "eth0".into(),
            ObservedLink {
                index: 2,
                kind: "veth".into(),
                up: true,
                ..ObservedLink::default()
            },
        );
        f
    }
    fn take_writes(&self) -> Vec<VxlanOp> {
        std::mem::take(&mut self.0.lock().unwrap().writes)
    }
}

fn dev() -> VxlanDevice {
    VxlanDevice {
        name: "vxlan.calico".into(),
        vni: 4096,
        port: 4789,
        mac: MacAddr::parse("66:6a:00:00:00:01").unwrap(),
        parent: "eth0".into(),
        local: "172.31.77.1".parse().unwrap(),
        mtu: 1450,
        addr: "10.65.1.0".parse().unwrap(),
    }
}

#[test]
fn creates_then_leaves_a_matching_device_alone() {
    let k = Fake::with_parent();
    let mut v = Vxlan::new(&["vxlan.calico", "vxlan-v6.calico"], Box::new(k.clone()));
    v.set("vxlan.calico", Some(dev()));
    assert!(v.is_dirty(Phase::Links));
    v.apply(Phase::Links).unwrap();
    let w = k.take_writes();
    assert_eq!(
        w,
        vec![
            VxlanOp::Create {
                dev: dev(),
                parent_index: 2
            },
            VxlanOp::AddAddr {
                index: 101,
                addr: "10.65.1.0/32".parse().unwrap()
            },
            VxlanOp::SetUp { index: 101 },
        ]
    );
    assert!(!v.is_dirty(Phase::Links));
    // The refresh tick checks it again: nothing to do.
    v.request_resync(Refresh::Routes);
    v.apply(Phase::Links).unwrap();
    assert!(k.take_writes().is_empty());
}

#[test]
fn fixes_in_place_what_it_can_and_recreates_what_it_cannot() {
    let k = Fake::with_parent();
    let mut v = Vxlan::new(&["vxlan.calico"], Box::new(k.clone()));
    v.set("vxlan.calico", Some(dev()));
    v.apply(Phase::Links).unwrap();
    k.take_writes();
    // Someone changes the MTU, adds an address and takes it down.
    {
        let mut s = k.0.lock().unwrap();
        let l = s.links.get_mut("vxlan.calico").unwrap();
        l.mtu = Some(1400);
        l.up = false;
        l.addrs.push("10.9.9.9/24".parse().unwrap());
        l.addrs.push("fe80::1/64".parse().unwrap());
    }
    v.request_resync(Refresh::Routes);
    v.apply(Phase::Links).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![
            VxlanOp::SetMtu {
                index: 101,
                mtu: 1450
            },
            VxlanOp::DelAddr {
                index: 101,
                addr: "10.9.9.9/24".parse().unwrap()
            },
            VxlanOp::SetUp { index: 101 },
        ],
        "the link-local address stays"
    );
    // A new VNI cannot be set in place.
    let mut d = dev();
    d.vni = 4097;
    v.set("vxlan.calico", Some(d.clone()));
    v.apply(Phase::Links).unwrap();
    let w = k.take_writes();
    assert_eq!(
        w[..2],
        [
            VxlanOp::Delete {
                index: 101,
                name: "vxlan.calico".into()
            },
            VxlanOp::Create {
                dev: d,
                parent_index: 2
            },
        ]
    );
    assert_eq!(
        incompatible(&dev(), 2, &k.0.lock().unwrap().links["vxlan.calico"]),
        Some("vni: 4097 (want 4096)".into())
    );
}

#[test]
fn deletes_an_unwanted_device_and_waits_for_a_missing_parent() {
    let k = Fake::with_parent();
    let mut v = Vxlan::new(&["vxlan.calico"], Box::new(k.clone()));
    let mut d = dev();
    d.parent = "eth9".into();
    v.set("vxlan.calico", Some(d));
    v.apply(Phase::Links).unwrap();
    assert!(k.take_writes().is_empty());
    assert_eq!(
        v.status(),
        vec![(
            "kernel.vxlan.calico".to_string(),
            "waiting for parent interface eth9".to_string()
        )]
    );
    v.set("vxlan.calico", Some(dev()));
    v.apply(Phase::Links).unwrap();
    assert_eq!(k.take_writes().len(), 3);
    assert!(v.status().is_empty());
    // VXLAN off: the device goes; a link of another name is never touched.
    v.set("vxlan.calico", None);
    v.apply(Phase::Links).unwrap();
    assert_eq!(
        k.take_writes(),
        vec![VxlanOp::Delete {
            index: 101,
            name: "vxlan.calico".into()
        }]
    );
    assert!(k.0.lock().unwrap().links.contains_key("eth0"));
}

#[test]
fn a_device_deleted_by_hand_is_made_again_at_its_link_event() {
    let k = Fake::with_parent();
    let mut v = Vxlan::new(&["vxlan.calico", "vxlan-v6.calico"], Box::new(k.clone()));
    v.set("vxlan.calico", Some(dev()));
    v.apply(Phase::Links).unwrap();
    k.take_writes();
    // Someone deletes it; the monitor tells us.
    k.0.lock().unwrap().links.remove("vxlan.calico");
    v.link_changed("vxlan.calico");
    assert!(v.is_dirty(Phase::Links));
    v.apply(Phase::Links).unwrap();
    let w = k.take_writes();
    assert!(
        matches!(w.first(), Some(VxlanOp::Create { .. })),
        "made again: {w:?}"
    );
    // A link event for a name that is not wanted (v6 off), or not ours,
    // asks for nothing.
    v.link_changed("vxlan-v6.calico");
    v.link_changed("eth0");
    assert!(!v.is_dirty(Phase::Links));
}
