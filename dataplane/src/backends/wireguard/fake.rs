//! A fake kernel and fake `wireguard-go` for the backend's and the
//! manager's tests.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use super::*;
use crate::model::wireguard::WgPeer;
use plan::ObservedPeer;

#[derive(Debug, Default)]
pub struct Fake {
    pub kernel_module: bool,
    pub wireguard_go: bool,
    pub links: BTreeMap<String, ObservedLink>,
    pub running: BTreeSet<String>,
    pub devices: BTreeMap<String, ObservedDevice>,
    pub next_index: u32,
    pub next_key: u8,
    pub log: Vec<String>,
    pub reads: usize,
}

impl Fake {
    pub fn add_link(&mut self, name: &str, kind: &str) {
        self.next_index += 1;
        self.links.insert(
            name.into(),
            ObservedLink {
                index: self.next_index,
                kind: kind.into(),
                mtu: Some(1420),
                ..ObservedLink::default()
            },
        );
    }
}

#[derive(Debug, Clone)]
pub struct Seam(pub Arc<Mutex<Fake>>);

impl WgSeam for Seam {
    fn link(&mut self, name: &str) -> Result<Option<ObservedLink>, BackendError> {
        Ok(self.0.lock().unwrap().links.get(name).cloned())
    }
    fn create_kernel(&mut self, name: &str) -> Result<Created, BackendError> {
        let mut f = self.0.lock().unwrap();
        if !f.kernel_module {
            return Ok(Created::NotSupported("no module".into()));
        }
        f.add_link(name, "wireguard");
        f.log.push(format!("create kernel {name}"));
        Ok(Created::Yes)
    }
    fn start_userspace(&mut self, name: &str) -> Result<Created, BackendError> {
        let mut f = self.0.lock().unwrap();
        if !f.wireguard_go {
            return Ok(Created::NotSupported("no wireguard-go".into()));
        }
        f.add_link(name, "tun");
        f.running.insert(name.into());
        f.log.push(format!("start wireguard-go {name}"));
        Ok(Created::Yes)
    }
    fn userspace_running(&mut self, name: &str) -> bool {
        self.0.lock().unwrap().running.contains(name)
    }
    fn delete(&mut self, name: &str, _index: u32) -> Result<(), BackendError> {
        let mut f = self.0.lock().unwrap();
        f.links.remove(name);
        f.running.remove(name);
        f.devices.remove(name);
        f.log.push(format!("delete {name}"));
        Ok(())
    }
    fn read(&mut self, name: &str, _c: Carrier) -> Result<ObservedDevice, BackendError> {
        let mut f = self.0.lock().unwrap();
        f.reads += 1;
        Ok(f.devices.get(name).cloned().unwrap_or_default())
    }
    fn configure(
        &mut self,
        name: &str,
        _c: Carrier,
        change: &DeviceChange,
    ) -> Result<(), BackendError> {
        let mut f = self.0.lock().unwrap();
        f.log.push(format!(
            "configure {name} key={} peers-={} peers+={}",
            change.private_key.is_some(),
            change.remove.len(),
            change.upsert.len()
        ));
        let d = f.devices.entry(name.into()).or_default();
        if let Some(k) = change.private_key {
            d.private_key = Some(k);
        }
        if let Some(p) = change.listen_port {
            d.listen_port = Some(p);
        }
        if let Some(m) = change.fwmark {
            d.fwmark = Some(m);
        }
        for k in &change.remove {
            d.peers.remove(k);
        }
        for (k, ep, ips) in &change.upsert {
            d.peers.insert(
                *k,
                ObservedPeer {
                    endpoint: Some(*ep),
                    allowed_ips: ips.clone(),
                    ..ObservedPeer::default()
                },
            );
        }
        Ok(())
    }
    fn link_op(&mut self, op: &VxlanOp) -> Result<(), BackendError> {
        let mut f = self.0.lock().unwrap();
        f.log.push(format!("{op:?}"));
        for l in f.links.values_mut() {
            match op {
                VxlanOp::SetMtu { index, mtu } if l.index == *index => l.mtu = Some(*mtu),
                VxlanOp::SetUp { index } if l.index == *index => l.up = true,
                VxlanOp::AddAddr { index, addr } if l.index == *index => l.addrs.push(*addr),
                VxlanOp::DelAddr { index, addr } if l.index == *index => {
                    l.addrs.retain(|a| a != addr)
                }
                _ => {}
            }
        }
        Ok(())
    }
    fn nudge(&mut self, name: &str, _c: Carrier, peers: &[PublicKey]) -> Result<(), BackendError> {
        let mut f = self.0.lock().unwrap();
        f.log.push(format!("nudge {name} {}", peers.len()));
        Ok(())
    }
    fn describe(&self, _name: &str) -> Option<String> {
        None
    }
    fn support(&self) -> String {
        "fake".into()
    }
    fn generate_key(&mut self) -> [u8; 32] {
        let mut f = self.0.lock().unwrap();
        f.next_key += 1;
        [f.next_key; 32]
    }
}

pub fn fake(kernel_module: bool, wireguard_go: bool) -> Arc<Mutex<Fake>> {
    Arc::new(Mutex::new(Fake {
        kernel_module,
        wireguard_go,
        ..Fake::default()
    }))
}

impl Fake {
    pub fn start_userspace_with_key(&mut self, name: &str, key: [u8; 32]) {
        self.add_link(name, "tun");
        self.running.insert(name.into());
        self.devices.insert(
            name.into(),
            ObservedDevice {
                private_key: Some(key),
                ..ObservedDevice::default()
            },
        );
    }
}

/// An IPv4 device as Felix makes it, with no peers.
pub fn device(addr: Option<&str>) -> WgDevice {
    WgDevice {
        version: IpVersion::V4,
        name: "wireguard.cali".into(),
        port: 51820,
        fwmark: 0x20_0000,
        mtu: 1440,
        addr: addr.map(|a| a.parse().unwrap()),
        peers: BTreeMap::new(),
    }
}

/// Peer `k` (key `[k; 32]`, node `node-k`).
pub fn peer(k: u8, endpoint: &str, ips: &[&str]) -> (PublicKey, WgPeer) {
    (
        PublicKey([k; 32]),
        WgPeer {
            node: format!("node-{k}"),
            endpoint: endpoint.parse().unwrap(),
            allowed_ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
        },
    )
}
