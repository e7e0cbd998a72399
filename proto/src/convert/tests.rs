use super::*;
use crate::felix::{self, to_dataplane::Payload};

fn msg(seq: u64, p: Payload) -> felix::ToDataplane {
    felix::ToDataplane {
        sequence_number: seq,
        payload: Some(p),
    }
}

fn reject(p: Payload) -> Rejected {
    to_update(msg(7, p)).expect_err("should be rejected")
}

fn ipset(id: &str, ty: felix::ip_set_update::IpSetType, members: &[&str]) -> Payload {
    Payload::IpsetUpdate(felix::IpSetUpdate {
        id: id.into(),
        members: members.iter().map(|m| m.to_string()).collect(),
        r#type: ty as i32,
    })
}

#[test]
fn ipset_members_are_checked_by_type() {
    use felix::ip_set_update::IpSetType as T;
    let ok = to_update(msg(1, ipset("s:a", T::Net, &["10.0.0.0/8", "fd00::/64"])))
        .unwrap()
        .unwrap();
    let Update::IpSetUpdate(s) = ok else { panic!() };
    assert_eq!(s.members.len(), 2);
    let r = reject(ipset("s:a", T::Ip, &["10.0.0.1", "10.0.0.0/8"]));
    assert_eq!(r.sequence_number, 7);
    assert_eq!(r.error.field, "ipset_update.members[1]");
    let r = reject(ipset(
        "s:a",
        T::IpAndPort,
        &["10.0.0.1,tcp:80\nadd x 1.2.3.4"],
    ));
    assert_eq!(r.error.field, "ipset_update.members[0]");
    let r = reject(Payload::IpsetUpdate(felix::IpSetUpdate {
        id: "a".into(),
        members: vec![],
        r#type: 9,
    }));
    assert_eq!(r.error.field, "ipset_update.type");
}

#[test]
fn names_cannot_inject_rules() {
    use felix::ip_set_update::IpSetType as T;
    for bad in [
        "x\n-A INPUT -j ACCEPT",
        "a b",
        "a\"b",
        "-A INPUT -j ACCEPT",
        "",
    ] {
        let r = reject(ipset(bad, T::Ip, &[]));
        assert_eq!(r.error.field, "ipset_update.id", "{bad:?}");
        let r = reject(Payload::ActivePolicyUpdate(felix::ActivePolicyUpdate {
            id: Some(felix::PolicyId {
                name: bad.into(),
                ..Default::default()
            }),
            policy: Some(felix::Policy::default()),
        }));
        assert_eq!(r.error.field, "active_policy_update.id.name", "{bad:?}");
    }
}

#[test]
fn rules_are_validated_field_by_field() {
    let rule = |r: felix::Rule| {
        Payload::ActivePolicyUpdate(felix::ActivePolicyUpdate {
            id: Some(felix::PolicyId {
                name: "default.p".into(),
                ..Default::default()
            }),
            policy: Some(felix::Policy {
                inbound_rules: vec![felix::Rule::default(), r],
                ..Default::default()
            }),
        })
    };
    let tcp = || {
        Some(felix::Protocol {
            number_or_name: Some(felix::protocol::NumberOrName::Name("tcp".into())),
        })
    };
    let good = felix::Rule {
        action: "allow".into(),
        protocol: tcp(),
        dst_ports: vec![felix::PortRange {
            first: 80,
            last: 90,
        }],
        src_net: vec!["10.0.0.0/8".into()],
        icmp: None,
        ..Default::default()
    };
    let Update::Policy(_, p) = to_update(msg(1, rule(good.clone()))).unwrap().unwrap() else {
        panic!()
    };
    assert_eq!(
        p.inbound_rules[1].dst_ports[0],
        PortRange {
            first: 80,
            last: 90
        }
    );

    let cases: Vec<(felix::Rule, &str)> = vec![
        (
            felix::Rule {
                action: "accept".into(),
                ..good.clone()
            },
            "action",
        ),
        (
            felix::Rule {
                dst_ports: vec![felix::PortRange {
                    first: 90,
                    last: 80,
                }],
                ..good.clone()
            },
            "dst_ports[0]",
        ),
        (
            felix::Rule {
                src_ports: vec![felix::PortRange {
                    first: 70000,
                    last: 0,
                }],
                ..good.clone()
            },
            "src_ports[0].first",
        ),
        (
            felix::Rule {
                src_net: vec!["10.0.0.0/8".into(), "10.0.0.300/32".into()],
                ..good.clone()
            },
            "src_net[1]",
        ),
        (
            felix::Rule {
                protocol: Some(felix::Protocol {
                    number_or_name: Some(felix::protocol::NumberOrName::Number(300)),
                }),
                ..good.clone()
            },
            "protocol.number",
        ),
        (
            felix::Rule {
                protocol: None,
                ..good.clone()
            },
            "protocol",
        ),
        (
            felix::Rule {
                ip_version: 5,
                ..good.clone()
            },
            "ip_version",
        ),
        (
            felix::Rule {
                dst_ip_set_ids: vec!["ok".into(), "bad id".into()],
                ..good.clone()
            },
            "dst_ip_set_ids[1]",
        ),
    ];
    for (r, field) in cases {
        let e = reject(rule(r));
        assert_eq!(
            e.error.field,
            format!("active_policy_update.policy.inbound_rules[1].{field}"),
            "{e}"
        );
    }
}

#[test]
fn unsupported_matches_are_recorded() {
    let p = Payload::ActiveProfileUpdate(felix::ActiveProfileUpdate {
        id: Some(felix::ProfileId {
            name: "kns.default".into(),
        }),
        profile: Some(felix::Profile {
            inbound_rules: vec![felix::Rule {
                http_match: Some(felix::HttpMatch::default()),
                ..Default::default()
            }],
            outbound_rules: vec![],
        }),
    });
    let Update::Profile(_, p) = to_update(msg(1, p)).unwrap().unwrap() else {
        panic!()
    };
    assert_eq!(p.inbound_rules[0].unsupported, vec!["http_match"]);
}

#[test]
fn a_service_account_match_is_in_the_ip_sets_already() {
    // As Felix sends `serviceAccounts: {names: [sa1]}`: the IP set of the
    // endpoints it selects, and the match itself for the application layer.
    let p = Payload::ActiveProfileUpdate(felix::ActiveProfileUpdate {
        id: Some(felix::ProfileId {
            name: "kns.default".into(),
        }),
        profile: Some(felix::Profile {
            inbound_rules: vec![felix::Rule {
                action: "allow".into(),
                src_ip_set_ids: vec!["s:sa1".into()],
                src_service_account_match: Some(felix::ServiceAccountMatch {
                    names: vec!["sa1".into()],
                    ..Default::default()
                }),
                ..Default::default()
            }],
            outbound_rules: vec![],
        }),
    });
    let Update::Profile(_, p) = to_update(msg(1, p)).unwrap().unwrap() else {
        panic!()
    };
    assert!(p.inbound_rules[0].unsupported.is_empty());
    assert_eq!(p.inbound_rules[0].src_ip_set_ids[0].as_str(), "s:sa1");
}

#[test]
fn workload_endpoints() {
    let wep = |name: &str, nets: Vec<String>| {
        Payload::WorkloadEndpointUpdate(felix::WorkloadEndpointUpdate {
            id: Some(felix::WorkloadEndpointId {
                orchestrator_id: "k8s".into(),
                workload_id: "default/nginx".into(),
                endpoint_id: "eth0".into(),
            }),
            endpoint: Some(felix::WorkloadEndpoint {
                state: "active".into(),
                name: name.into(),
                mac: "ee:ee:ee:ee:ee:ee".into(),
                ipv4_nets: nets,
                ..Default::default()
            }),
        })
    };
    assert!(to_update(msg(1, wep("cali12345", vec!["10.65.0.2/32".into()]))).is_ok());
    assert_eq!(
        reject(wep("cali12345+", vec![])).error.field,
        "workload_endpoint_update.endpoint.name"
    );
    assert_eq!(
        reject(wep("cali123456789012", vec![])).error.field,
        "workload_endpoint_update.endpoint.name"
    );
    assert_eq!(
        reject(wep("cali1", vec!["fd00::1/128".into()])).error.field,
        "workload_endpoint_update.endpoint.ipv4_nets[0]"
    );
}

#[test]
fn wireguard_keys() {
    let key = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    assert_eq!(wg_key(key).unwrap(), [0u8; 32]);
    let k2 = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=";
    assert_eq!(wg_key(k2).unwrap()[0], 0xc8);
    assert!(wg_key("short=").is_err());
    assert!(wg_key("yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBm!=").is_err());
}

#[test]
fn empty_payload_is_ignored_and_removes_convert() {
    assert_eq!(
        to_update(felix::ToDataplane {
            sequence_number: 1,
            payload: None
        })
        .unwrap(),
        None
    );
    let u = to_update(msg(
        2,
        Payload::IpsetRemove(felix::IpSetRemove { id: "s:x".into() }),
    ))
    .unwrap()
    .unwrap();
    assert_eq!(u, Update::Remove(Key::IpSet(Id::new("s:x").unwrap())));
}

#[test]
fn addresses_are_of_the_family_their_field_names() {
    let vtep = |v4: &str, parent: &str| {
        Payload::VtepUpdate(felix::VxlanTunnelEndpointUpdate {
            node: "n".into(),
            mac: "66:00:00:00:00:01".into(),
            ipv4_addr: v4.into(),
            parent_device_ip: parent.into(),
            ..Default::default()
        })
    };
    assert!(to_update(msg(1, vtep("10.65.1.0", "192.168.0.2"))).is_ok());
    assert_eq!(
        reject(vtep("fd00::1", "192.168.0.2")).error.field,
        "vtep_update.ipv4_addr"
    );
    assert_eq!(
        reject(vtep("10.65.1.0", "fd00::2")).error.field,
        "vtep_update.parent_device_ip"
    );
    let wg = Payload::WireguardEndpointV6Update(felix::WireguardEndpointV6Update {
        hostname: "n".into(),
        interface_ipv6_addr: "10.0.0.1".into(),
        ..Default::default()
    });
    assert_eq!(
        reject(wg).error.field,
        "wireguard_endpoint_v6_update.interface_addr"
    );
    let hep = Payload::HostEndpointUpdate(felix::HostEndpointUpdate {
        id: Some(felix::HostEndpointId {
            endpoint_id: "h".into(),
        }),
        endpoint: Some(felix::HostEndpoint {
            name: "eth0".into(),
            expected_ipv6_addrs: vec!["10.0.0.1".into()],
            ..Default::default()
        }),
    });
    assert_eq!(
        reject(hep).error.field,
        "host_endpoint_update.endpoint.expected_ipv6_addrs[0]"
    );
}

#[test]
fn a_tier_listed_twice_is_refused() {
    let tier = |name: &str| felix::TierInfo {
        name: name.into(),
        ..Default::default()
    };
    let wep = |tiers: Vec<felix::TierInfo>| {
        Payload::WorkloadEndpointUpdate(felix::WorkloadEndpointUpdate {
            id: Some(felix::WorkloadEndpointId {
                orchestrator_id: "k8s".into(),
                workload_id: "w".into(),
                endpoint_id: "e".into(),
            }),
            endpoint: Some(felix::WorkloadEndpoint {
                state: "active".into(),
                name: "cali1".into(),
                tiers,
                ..Default::default()
            }),
        })
    };
    assert!(to_update(msg(1, wep(vec![tier("a"), tier("b")]))).is_ok());
    let r = reject(wep(vec![tier("a"), tier("b"), tier("a")]));
    assert_eq!(
        r.error.field,
        "workload_endpoint_update.endpoint.tiers[2].name"
    );
    assert!(
        r.error.reason.contains("listed twice"),
        "{}",
        r.error.reason
    );
}
