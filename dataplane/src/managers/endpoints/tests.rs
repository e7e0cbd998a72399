//! Golden chains for representative endpoints.

use super::*;
use crate::model::{Action, IfaceName, TierInfo};

fn mgr() -> EndpointsManager {
    EndpointsManager::new(
        EndpointsConfig {
            prefix: "dph".into(),
            workload_prefix: "cali".into(),
            marks: Marks::default(),
            failsafe_in: default_failsafe().0,
            failsafe_out: default_failsafe().1,
        },
        SetNames::new("dph").unwrap(),
    )
}

fn id(s: &str) -> Id {
    Id::new(s).unwrap()
}

fn pid(s: &str) -> PolicyId {
    PolicyId {
        name: id(s),
        namespace: None,
        kind: None,
    }
}

fn wep(iface: &str, tiers: Vec<TierInfo>, profiles: &[&str], state: EndpointState) -> Update {
    Update::WorkloadEndpoint(
        WorkloadEndpointId {
            orchestrator: id("k8s"),
            workload: id(&format!("ns/{iface}")),
            endpoint: id("eth0"),
        },
        WorkloadEndpoint {
            state,
            name: IfaceName::new(iface).unwrap(),
            mac: None,
            profile_ids: profiles.iter().map(|p| id(p)).collect(),
            ipv4_nets: vec![],
            ipv6_nets: vec![],
            tiers,
            ipv4_nat: vec![],
            ipv6_nat: vec![],
            allow_spoofed_source_prefixes: vec![],
        },
    )
}

fn text(rules: &[Rule]) -> Vec<&str> {
    rules.iter().map(Rule::text).collect()
}

#[test]
fn workload_chains_tiers_profiles_and_dispatch() {
    let mut m = mgr();
    m.on_update(&Update::Policy(
        pid("default.allow-web"),
        Policy {
            inbound_rules: vec![crate::model::Rule {
                protocol: Some(crate::model::Protocol::TCP),
                dst_ports: vec![crate::model::PortRange {
                    first: 80,
                    last: 80,
                }],
                ..Default::default()
            }],
            ..Default::default()
        },
    ));
    m.on_update(&Update::Profile(
        id("kns.web"),
        Profile {
            inbound_rules: vec![crate::model::Rule {
                action: Some(Action::Deny),
                ..Default::default()
            }],
            outbound_rules: vec![crate::model::Rule::default()],
        },
    ));
    m.on_update(&wep(
        "cali1",
        vec![TierInfo {
            name: id("default"),
            ingress_policies: vec![pid("default.allow-web"), pid("default.unknown")],
            egress_policies: vec![],
            default_action: TierDefault::Deny,
        }],
        &["kns.web"],
        EndpointState::Active,
    ));
    m.on_update(&wep("cali2", vec![], &[], EndpointState::Down));
    let c = m.desired(IpVersion::V4).unwrap();
    assert_eq!(
        text(&c["dph-tw-cali1"]),
        [
            "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
            "-m conntrack --ctstate INVALID -j DROP",
            "-j MARK --set-xmark 0/0x30000",
            "-j MARK --set-xmark 0/0x20000",
            "-m mark --mark 0/0x20000 -j dph-pi-default.allow-web",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
            "-m mark --mark 0/0x20000 -j DROP",
            "-j dph-pri-kns.web",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
            "-j DROP",
        ],
        "an unknown policy is left out; the tier's default drop still applies"
    );
    assert_eq!(
        text(&c["dph-fw-cali1"]),
        [
            "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
            "-m conntrack --ctstate INVALID -j DROP",
            "-j MARK --set-xmark 0/0x30000",
            "-j dph-pro-kns.web",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
            "-j DROP",
        ],
        "no egress policies in the tier: straight to the profiles"
    );
    assert_eq!(text(&c["dph-tw-cali2"]), ["-j DROP"], "admin down");
    assert_eq!(
        text(&c["dph-from-wl-dispatch"]),
        [
            "-i cali1 -g dph-fw-cali1",
            "-i cali2 -g dph-fw-cali2",
            "-j DROP"
        ]
    );
    assert_eq!(
        text(&c["dph-to-wl-dispatch"]),
        [
            "-o cali1 -g dph-tw-cali1",
            "-o cali2 -g dph-tw-cali2",
            "-j DROP"
        ]
    );
    assert_eq!(
        text(&c["dph-pi-default.allow-web"]),
        [
            "-p tcp -m multiport --destination-ports 80 -j MARK --set-xmark 0x10000/0x10000",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
        ]
    );
    assert_eq!(
        text(&c["dph-FORWARD"]),
        [
            "-i cali+ -j dph-from-wl-dispatch",
            "-o cali+ -j dph-to-wl-dispatch",
            "-i cali+ -m mark --mark 0x10000/0x10000 -j ACCEPT",
            "-o cali+ -m mark --mark 0x10000/0x10000 -j ACCEPT",
        ]
    );
    assert_eq!(
        text(&c["dph-INPUT"]),
        [
            "-i cali+ -j dph-from-wl-dispatch",
            "-i cali+ -m mark --mark 0x10000/0x10000 -j ACCEPT",
            "-i cali+ -j DROP",
            "-j dph-from-host-endpoint",
            "-m mark --mark 0x10000/0x10000 -j ACCEPT",
        ]
    );
    assert_eq!(
        text(&c["dph-failsafe-in"]),
        [
            "-p tcp -m multiport --dports 22,179,2379,2380,5473,6443,6666,6667 -j ACCEPT",
            "-p udp -m multiport --dports 68 -j ACCEPT",
        ]
    );
    assert!(
        c["dph-from-host-endpoint"].is_empty(),
        "no host endpoints: nothing policed"
    );
}

#[test]
fn pass_tiers_and_removed_objects() {
    let mut m = mgr();
    m.on_update(&Update::Policy(pid("t1.p"), Policy::default()));
    m.on_update(&wep(
        "cali1",
        vec![TierInfo {
            name: id("t1"),
            ingress_policies: vec![pid("t1.p")],
            egress_policies: vec![],
            default_action: TierDefault::Pass,
        }],
        &[],
        EndpointState::Active,
    ));
    let c = m.desired(IpVersion::V6).unwrap();
    assert!(
        !text(&c["dph-tw-cali1"]).contains(&"-m mark --mark 0/0x20000 -j DROP"),
        "a pass tier has no default drop"
    );
    m.on_update(&Update::Remove(Key::Policy(pid("t1.p"))));
    let c = m.desired(IpVersion::V6).unwrap();
    assert!(!c.contains_key("dph-pi-t1.p"));
    assert!(
        !text(&c["dph-tw-cali1"])
            .iter()
            .any(|r| r.contains("dph-pi-t1.p"))
    );
}
