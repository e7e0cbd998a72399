//! The backend against a fake kernel and fake `wireguard-go`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::fake::{self, Fake, Seam, fake, peer};
use super::*;

fn backend(f: &Arc<Mutex<Fake>>, keys: KeyStore, choice: WgImpl) -> Wireguard {
    Wireguard::new(Box::new(Seam(f.clone())), keys, choice)
}

fn device(peers: u8) -> WgDevice {
    let mut d = fake::device(Some("10.65.0.1"));
    d.peers.extend((1..=peers).map(|i| {
        let mut p = peer(
            100 + i,
            &format!("192.168.0.{i}:51820"),
            &[&format!("10.65.{i}.0/26")],
        );
        p.1.node = format!("node-{i}");
        p
    }));
    d
}

fn apply(b: &mut Wireguard) {
    b.apply(Phase::Links).unwrap();
}

fn status(b: &Wireguard) -> BTreeMap<String, String> {
    b.status().into_iter().collect()
}

#[test]
fn kernel_device_with_key_peers_address_and_mtu() {
    let f = fake(true, true);
    let mut b = backend(&f, KeyStore::new(None), WgImpl::Auto);
    b.set(IpVersion::V4, "wireguard.cali", Some(device(2)));
    b.set(IpVersion::V6, "wg-v6.cali", None);
    assert!(b.is_dirty(Phase::Links));
    apply(&mut b);
    {
        let f = f.lock().unwrap();
        assert_eq!(f.log[0], "create kernel wireguard.cali");
        let l = &f.links["wireguard.cali"];
        assert_eq!(l.mtu, Some(1440));
        assert!(l.up);
        assert_eq!(l.addrs, vec!["10.65.0.1/32".parse::<IpNet>().unwrap()]);
        let d = &f.devices["wireguard.cali"];
        assert_eq!(d.private_key, Some([1; 32]));
        assert_eq!(d.listen_port, Some(51820));
        assert_eq!(d.fwmark, Some(0x20_0000));
        assert_eq!(d.peers.len(), 2);
        // A new device shakes hands with its peers at once.
        assert_eq!(f.log.last().unwrap(), "nudge wireguard.cali 2");
    }
    let public = public_key(&[1; 32]).to_base64();
    assert_eq!(
        b.take_events(),
        vec![
            (IpVersion::V4, public.clone()),
            (IpVersion::V6, String::new())
        ]
    );
    let s = status(&b);
    assert_eq!(s["wireguard.v4.device"], "wireguard.cali (kernel)");
    assert_eq!(s["wireguard.v4.public_key"], public);
    assert_eq!(s["wireguard.v6.device"], "off");
    assert!(s["wireguard.v4.peer.node-1"].contains("handshake never"));
    // Peers without a handshake: the device is read again shortly.
    assert!(b.apply(Phase::Links).is_ok());
    let writes_before = f.lock().unwrap().log.len();
    // Once in step, an apply writes nothing and announces nothing.
    b.families[0].dirty = true;
    apply(&mut b);
    assert_eq!(f.lock().unwrap().log.len(), writes_before);
    assert!(b.take_events().is_empty());
}

#[test]
fn no_kernel_module_falls_back_to_wireguard_go() {
    let f = fake(false, true);
    let mut b = backend(&f, KeyStore::new(None), WgImpl::Auto);
    b.set(IpVersion::V4, "wireguard.cali", Some(device(1)));
    apply(&mut b);
    assert_eq!(
        f.lock().unwrap().log[0],
        "start wireguard-go wireguard.cali"
    );
    assert_eq!(
        status(&b)["wireguard.v4.device"],
        "wireguard.cali (userspace)"
    );
    assert_eq!(b.take_events().len(), 1);
}

#[test]
fn neither_kernel_nor_wireguard_go_announces_no_key() {
    let f = fake(false, false);
    let mut b = backend(&f, KeyStore::new(None), WgImpl::Auto);
    b.set(IpVersion::V4, "wireguard.cali", Some(device(1)));
    apply(&mut b);
    assert_eq!(b.take_events(), vec![(IpVersion::V4, String::new())]);
    assert_eq!(
        status(&b)["wireguard.v4.device"],
        "unsupported: no module; no wireguard-go"
    );
    // Forced kernel on a kernel without it: unsupported too, no fallback.
    let f = fake(false, true);
    let mut b = backend(&f, KeyStore::new(None), WgImpl::Kernel);
    b.set(IpVersion::V4, "wireguard.cali", Some(device(1)));
    apply(&mut b);
    assert!(f.lock().unwrap().log.is_empty());
    assert!(status(&b)["wireguard.v4.device"].starts_with("unsupported"));
}

#[test]
fn the_kept_key_survives_a_restart_and_the_devices_key_wins() {
    let dir = tempfile::tempdir().unwrap();
    let keys = KeyStore::new(Some(dir.path().into()));
    let f = fake(false, true);
    let mut b = backend(&f, keys.clone(), WgImpl::Auto);
    b.set(IpVersion::V4, "wireguard.cali", Some(device(0)));
    apply(&mut b);
    let first = b.take_events();
    // The daemon and its wireguard-go are gone; a new daemon, a new
    // device: the same key.
    drop(b);
    let f = fake(false, true);
    f.lock().unwrap().next_key = 50;
    let mut b = backend(&f, keys.clone(), WgImpl::Auto);
    b.set(IpVersion::V4, "wireguard.cali", Some(device(0)));
    apply(&mut b);
    assert_eq!(b.take_events(), first);
    // A device that kept running has its own key: it is used and kept.
    let f = fake(false, true);
    f.lock()
        .unwrap()
        .start_userspace_with_key("wireguard.cali", [77; 32]);
    let mut b = backend(&f, keys.clone(), WgImpl::Auto);
    b.set(IpVersion::V4, "wireguard.cali", Some(device(0)));
    apply(&mut b);
    assert_eq!(
        b.take_events(),
        vec![(IpVersion::V4, public_key(&[77; 32]).to_base64())]
    );
    assert_eq!(keys.load(IpVersion::V4).unwrap(), Some([77; 32]));
    assert!(
        !f.lock()
            .unwrap()
            .log
            .iter()
            .any(|l| l.starts_with("start") || l.starts_with("create"))
    );
}

#[test]
fn disabling_deletes_the_device_and_announces_no_key() {
    let f = fake(true, true);
    let mut b = backend(&f, KeyStore::new(None), WgImpl::Auto);
    b.set(IpVersion::V4, "wireguard.cali", Some(device(1)));
    apply(&mut b);
    b.take_events();
    b.set(IpVersion::V4, "wireguard.cali", None);
    apply(&mut b);
    assert!(f.lock().unwrap().links.is_empty());
    assert_eq!(b.take_events(), vec![(IpVersion::V4, String::new())]);
    assert_eq!(status(&b)["wireguard.v4.device"], "off");
}

#[test]
fn a_foreign_link_is_reported_not_replaced() {
    let f = fake(true, true);
    f.lock().unwrap().add_link("wireguard.cali", "bridge");
    let mut b = backend(&f, KeyStore::new(None), WgImpl::Auto);
    b.set(IpVersion::V4, "wireguard.cali", Some(device(1)));
    let e = b.apply(Phase::Links).unwrap_err().to_string();
    assert!(e.contains("is a \"bridge\" link"), "{e}");
    assert_eq!(f.lock().unwrap().links["wireguard.cali"].kind, "bridge");
    // Off leaves it too.
    b.set(IpVersion::V4, "wireguard.cali", None);
    apply(&mut b);
    assert!(f.lock().unwrap().links.contains_key("wireguard.cali"));
}

#[test]
fn a_dead_wireguard_gos_tun_is_made_again_and_a_renamed_device_removed() {
    let f = fake(false, true);
    f.lock().unwrap().add_link("wireguard.cali", "tun");
    let mut b = backend(&f, KeyStore::new(None), WgImpl::Auto);
    b.set(IpVersion::V4, "wireguard.cali", Some(device(0)));
    apply(&mut b);
    assert_eq!(
        f.lock().unwrap().log[..2],
        ["delete wireguard.cali", "start wireguard-go wireguard.cali"]
    );
    let mut d = device(0);
    d.name = "wg0.cali".into();
    b.set(IpVersion::V4, "wg0.cali", Some(d));
    apply(&mut b);
    let f = f.lock().unwrap();
    assert!(f.links.contains_key("wg0.cali"));
    assert!(!f.links.contains_key("wireguard.cali"));
}

#[test]
fn a_peer_change_is_written_without_reading_the_device_again() {
    let f = fake(true, true);
    let mut b = backend(&f, KeyStore::new(None), WgImpl::Auto);
    b.set(IpVersion::V4, "wireguard.cali", Some(device(3)));
    apply(&mut b);
    let reads = f.lock().unwrap().reads;
    let mut d = device(3);
    d.peers.remove(&PublicKey([102; 32]));
    b.set(IpVersion::V4, "wireguard.cali", Some(d));
    apply(&mut b);
    {
        let f = f.lock().unwrap();
        assert_eq!(f.reads, reads, "read again");
        assert_eq!(
            f.log.last().unwrap(),
            "configure wireguard.cali key=false peers-=1 peers+=0"
        );
        assert_eq!(f.devices["wireguard.cali"].peers.len(), 2);
    }
    // A resync reads it (and finds it in step).
    b.request_resync(Refresh::Routes);
    apply(&mut b);
    assert_eq!(f.lock().unwrap().reads, reads + 1);
}

/// A ConfigUpdate's device name that names a link this daemon did not
/// make (an operator's own WireGuard, a VPN's tun) leaves it alone: not
/// reconfigured, not deleted when the name changes again. One the daemon
/// made under such a name is its own: kept in the state directory across
/// restarts, and deleted when the name moves on.
#[test]
fn a_link_the_daemon_did_not_make_is_never_taken_or_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let keys = KeyStore::new(Some(dir.path().to_path_buf()));
    let f = fake(true, true);
    f.lock().unwrap().add_link("wg0", "wireguard");
    f.lock().unwrap().add_link("tun0", "tun");
    let mut b = backend(&f, keys.clone(), WgImpl::Auto);
    for foreign in ["wg0", "tun0"] {
        b.set(IpVersion::V4, foreign, Some(device(1)));
        apply(&mut b);
        let st = status(&b);
        assert!(st["wireguard.v4.device"].contains("did not make"), "{st:?}");
        assert!(
            !f.lock().unwrap().devices.contains_key(foreign),
            "configured"
        );
    }
    // A name of its own: made, then the name moves back and the foreign
    // links are still there.
    b.set(IpVersion::V4, "wg-made", Some(device(1)));
    apply(&mut b);
    assert!(f.lock().unwrap().links.contains_key("wg-made"));
    assert_eq!(keys.made_links(), ["wg-made".to_string()].into());
    // A restarted daemon knows it made it.
    let mut b = backend(&f, keys.clone(), WgImpl::Auto);
    b.set(IpVersion::V4, "wg-made", Some(device(1)));
    apply(&mut b);
    b.set(IpVersion::V4, "wireguard.cali", Some(device(1)));
    apply(&mut b);
    let fk = f.lock().unwrap();
    assert!(
        fk.links.contains_key("wg0") && fk.links.contains_key("tun0"),
        "{:?}",
        fk.log
    );
    assert!(!fk.links.contains_key("wg-made"), "{:?}", fk.log);
    assert!(keys.made_links().contains("wireguard.cali"));
}
