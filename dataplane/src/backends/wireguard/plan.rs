//! What a device lacks: the device's configuration as the kernel (or
//! `wireguard-go`) reports it, compared with the desired device, gives one
//! change (key, port, fwmark, peers to remove, peers to add or replace).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::SystemTime;

use ipnet::IpNet;

use crate::model::wireguard::{PublicKey, WgDevice};

/// A peer as the device holds it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObservedPeer {
    pub endpoint: Option<SocketAddr>,
    pub allowed_ips: BTreeSet<IpNet>,
    pub last_handshake: Option<SystemTime>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

/// A device's configuration as read back.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObservedDevice {
    pub private_key: Option<[u8; 32]>,
    pub listen_port: Option<u16>,
    pub fwmark: Option<u32>,
    pub peers: BTreeMap<PublicKey, ObservedPeer>,
}

/// One write to a device. Peers in `upsert` replace their endpoint and
/// allowed IPs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceChange {
    pub private_key: Option<[u8; 32]>,
    pub listen_port: Option<u16>,
    pub fwmark: Option<u32>,
    pub remove: Vec<PublicKey>,
    pub upsert: Vec<(PublicKey, SocketAddr, BTreeSet<IpNet>)>,
}

impl DeviceChange {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// What the device holds once this change is written (so an apply
    /// need not read it back).
    pub fn apply_to(&self, d: &mut ObservedDevice) {
        if let Some(k) = self.private_key {
            d.private_key = Some(k);
        }
        if let Some(p) = self.listen_port {
            d.listen_port = Some(p);
        }
        if let Some(m) = self.fwmark {
            d.fwmark = Some(m);
        }
        for k in &self.remove {
            d.peers.remove(k);
        }
        for (k, endpoint, ips) in &self.upsert {
            let p = d.peers.entry(*k).or_default();
            p.endpoint = Some(*endpoint);
            p.allowed_ips = ips.clone();
        }
    }
}

/// The change that makes `have` into `want` with private key `key`.
pub fn plan(want: &WgDevice, have: &ObservedDevice, key: &[u8; 32]) -> DeviceChange {
    let mut c = DeviceChange {
        private_key: (have.private_key.as_ref() != Some(key)).then_some(*key),
        listen_port: (have.listen_port != Some(want.port)).then_some(want.port),
        fwmark: (have.fwmark.unwrap_or(0) != want.fwmark).then_some(want.fwmark),
        ..DeviceChange::default()
    };
    c.remove = have
        .peers
        .keys()
        .filter(|k| !want.peers.contains_key(k))
        .copied()
        .collect();
    for (k, p) in &want.peers {
        let same = have
            .peers
            .get(k)
            .is_some_and(|h| h.endpoint == Some(p.endpoint) && h.allowed_ips == p.allowed_ips);
        if !same {
            c.upsert.push((*k, p.endpoint, p.allowed_ips.clone()));
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::wireguard::fake::{device, peer};

    fn dev(peers: &[(u8, &str, &[&str])]) -> WgDevice {
        let mut d = device(None);
        d.peers
            .extend(peers.iter().map(|(k, ep, ips)| peer(*k, ep, ips)));
        d
    }

    fn observed(want: &WgDevice, key: [u8; 32]) -> ObservedDevice {
        ObservedDevice {
            private_key: Some(key),
            listen_port: Some(want.port),
            fwmark: Some(want.fwmark),
            peers: want
                .peers
                .iter()
                .map(|(k, p)| {
                    (
                        *k,
                        ObservedPeer {
                            endpoint: Some(p.endpoint),
                            allowed_ips: p.allowed_ips.clone(),
                            ..ObservedPeer::default()
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn a_new_device_gets_everything() {
        let want = dev(&[(1, "10.0.0.2:51820", &["10.65.1.0/26"])]);
        let c = plan(&want, &ObservedDevice::default(), &[5; 32]);
        assert_eq!(c.private_key, Some([5; 32]));
        assert_eq!(c.listen_port, Some(51820));
        assert_eq!(c.fwmark, Some(0x20_0000));
        assert!(c.remove.is_empty());
        assert_eq!(c.upsert.len(), 1);
        assert_eq!(c.upsert[0].1.to_string(), "10.0.0.2:51820");
    }

    #[test]
    fn a_device_in_step_needs_nothing() {
        let want = dev(&[(1, "10.0.0.2:51820", &["10.65.1.0/26", "10.65.1.64/32"])]);
        assert!(plan(&want, &observed(&want, [5; 32]), &[5; 32]).is_empty());
    }

    #[test]
    fn only_changed_peers_are_written_and_strays_removed() {
        let want = dev(&[
            (1, "10.0.0.2:51820", &["10.65.1.0/26"]),
            (2, "10.0.0.3:51820", &["10.65.2.0/26"]),
            (3, "10.0.0.4:51820", &["10.65.3.0/26"]),
        ]);
        let mut have = observed(&want, [5; 32]);
        // Peer 2 moved, peer 3 lost a block, peer 9 is a stray.
        have.peers.get_mut(&PublicKey([2; 32])).unwrap().endpoint =
            Some("10.0.0.30:51820".parse().unwrap());
        have.peers
            .get_mut(&PublicKey([3; 32]))
            .unwrap()
            .allowed_ips
            .clear();
        have.peers
            .insert(PublicKey([9; 32]), ObservedPeer::default());
        have.fwmark = None;
        let c = plan(&want, &have, &[5; 32]);
        assert_eq!(c.private_key, None);
        assert_eq!(c.fwmark, Some(0x20_0000));
        assert_eq!(c.remove, vec![PublicKey([9; 32])]);
        let keys: Vec<u8> = c.upsert.iter().map(|(k, ..)| k.0[0]).collect();
        assert_eq!(keys, vec![2, 3]);
        // Written, the device is in step.
        c.apply_to(&mut have);
        assert!(plan(&want, &have, &[5; 32]).is_empty());
    }
}
