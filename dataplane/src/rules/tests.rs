//! Golden text of rendered rules.

use super::*;

fn r4() -> Renderer<'static> {
    Renderer {
        sets: SetNames::new("dph").unwrap(),
        marks: Marks::default(),
        version: IpVersion::V4,
        log_prefix: "dph-policy".into(),
        known_sets: None,
    }
}

fn r6() -> Renderer<'static> {
    Renderer {
        version: IpVersion::V6,
        ..r4()
    }
}

fn id(s: &str) -> Id {
    Id::new(s).unwrap()
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn ports(list: &[(u16, u16)]) -> Vec<PortRange> {
    list.iter()
        .map(|&(a, b)| PortRange { first: a, last: b })
        .collect()
}

fn text(rules: &[IptRule]) -> Vec<&str> {
    rules.iter().map(IptRule::text).collect()
}

#[test]
fn allow_from_a_set_to_a_port() {
    let rule = Rule {
        protocol: Some(Protocol::TCP),
        src_ip_set_ids: vec![id("s:frontend")],
        dst_ports: ports(&[(8080, 8080)]),
        ..Rule::default()
    };
    assert_eq!(
        text(&r4().rule(&rule).unwrap()),
        [
            "-p tcp -m set --match-set dph40s:frontend src -m multiport --destination-ports 8080 -j MARK --set-xmark 0x10000/0x10000",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
        ]
    );
    assert_eq!(
        text(&r6().rule(&rule).unwrap())[0],
        "-p tcp -m set --match-set dph60s:frontend src -m multiport --destination-ports 8080 -j MARK --set-xmark 0x10000/0x10000"
    );
}

#[test]
fn several_cidrs_become_a_match_block() {
    let rule = Rule {
        action: Some(Action::Deny),
        src_net: vec![net("10.0.0.0/8"), net("192.168.0.0/16"), net("fd00::/8")],
        ..Rule::default()
    };
    assert_eq!(
        text(&r4().rule(&rule).unwrap()),
        [
            "-j MARK --set-xmark 0/0x80000",
            "-s 10.0.0.0/8 -j MARK --set-xmark 0x80000/0x80000",
            "-s 192.168.0.0/16 -j MARK --set-xmark 0x80000/0x80000",
            "-m mark --mark 0x80000/0x80000 -j DROP",
        ]
    );
    // In v6 only the v6 net is left: a plain match.
    assert_eq!(text(&r6().rule(&rule).unwrap()), ["-s fd00::/8 -j DROP"]);
    // Only v4 nets: the rule does not exist in v6.
    let v4only = Rule {
        src_net: vec![net("10.0.0.0/8")],
        ..Rule::default()
    };
    assert!(r6().rule(&v4only).unwrap().is_empty());
}

/// Felix drops a rule from a family whose negated nets are all of the
/// other family, as it does for positive ones, and a rule with a negated
/// catch-all (felix/rules/policy.go, FilterRuleToIPVersion). Rendered as
/// "not in no net" the rule denied IPv4 UDP that Felix's own dataplane
/// allowed (the differential run, seed 51).
#[test]
fn negated_nets_of_the_other_family_drop_the_rule_as_felix_does() {
    let v6_only = Rule {
        action: Some(Action::Deny),
        protocol: Some(Protocol::UDP),
        not_src_net: vec![net("fd00:65::12/127")],
        ..Rule::default()
    };
    assert!(r4().rule(&v6_only).unwrap().is_empty());
    assert_eq!(
        text(&r6().rule(&v6_only).unwrap()),
        ["-p udp ! -s fd00:65::12/127 -j DROP"]
    );
    let catch_all = Rule {
        not_dst_net: vec![net("0.0.0.0/0"), net("fd00::/8")],
        ..Rule::default()
    };
    assert!(r4().rule(&catch_all).unwrap().is_empty());
    assert_eq!(
        text(&r6().rule(&catch_all).unwrap()),
        [
            "! -d fd00::/8 -j MARK --set-xmark 0x10000/0x10000",
            "-m mark --mark 0x10000/0x10000 -j RETURN"
        ]
    );
}

#[test]
fn more_than_fifteen_port_slots_and_named_ports() {
    let many: Vec<(u16, u16)> = (0..10)
        .map(|i| (1000 + i * 10, 1000 + i * 10 + 5))
        .collect();
    let rule = Rule {
        protocol: Some(Protocol::UDP),
        dst_ports: ports(&many),
        dst_named_port_ip_set_ids: vec![id("n:dns")],
        ..Rule::default()
    };
    let out = r4().rule(&rule).unwrap();
    assert_eq!(
        text(&out),
        [
            "-j MARK --set-xmark 0/0x80000",
            "-p udp -m multiport --destination-ports 1000:1005,1010:1015,1020:1025,1030:1035,1040:1045,1050:1055,1060:1065 -j MARK --set-xmark 0x80000/0x80000",
            "-p udp -m multiport --destination-ports 1070:1075,1080:1085,1090:1095 -j MARK --set-xmark 0x80000/0x80000",
            "-p udp -m set --match-set dph40n:dns dst,dst -j MARK --set-xmark 0x80000/0x80000",
            "-p udp -m mark --mark 0x80000/0x80000 -j MARK --set-xmark 0x10000/0x10000",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
        ]
    );
    // A single named port alone is a plain match.
    let named = Rule {
        protocol: Some(Protocol::TCP),
        src_named_port_ip_set_ids: vec![id("n:web")],
        action: Some(Action::Deny),
        ..Rule::default()
    };
    assert_eq!(
        text(&r4().rule(&named).unwrap()),
        ["-p tcp -m set --match-set dph40n:web src,src -j DROP"]
    );
}

#[test]
fn negations_icmp_pass_and_log() {
    let rule = Rule {
        action: Some(Action::Pass),
        protocol: Some(Protocol::ICMP),
        icmp: Some(IcmpMatch {
            icmp_type: 8,
            code: Some(0),
        }),
        not_src_net: vec![net("10.1.0.0/16"), net("10.2.0.0/16")],
        not_dst_ip_set_ids: vec![id("s:blocked")],
        ..Rule::default()
    };
    assert_eq!(
        text(&r4().rule(&rule).unwrap()),
        [
            "-p icmp -m icmp --icmp-type 8/0 ! -s 10.1.0.0/16 ! -s 10.2.0.0/16 -m set ! --match-set dph40s:blocked dst -j MARK --set-xmark 0x20000/0x20000",
            "-m mark --mark 0x20000/0x20000 -j RETURN",
        ]
    );
    assert!(
        r6().rule(&rule).unwrap().is_empty(),
        "icmp (v4) has no v6 form"
    );
    let v6 = Rule {
        action: Some(Action::Log),
        protocol: Some(Protocol::ICMPV6),
        not_icmp: Some(IcmpMatch {
            icmp_type: 128,
            code: None,
        }),
        not_protocol: None,
        not_dst_ports: vec![],
        ..Rule::default()
    };
    assert_eq!(
        text(&r6().rule(&v6).unwrap()),
        ["-p ipv6-icmp -m icmp6 ! --icmpv6-type 128 -j LOG --log-prefix dph-policy"]
    );
    let not_ports = Rule {
        action: Some(Action::Deny),
        protocol: Some(Protocol::TCP),
        not_protocol: Some(Protocol::UDP),
        not_dst_ports: ports(&[(22, 22), (80, 90)]),
        ip_version: Some(IpVersion::V4),
        ..Rule::default()
    };
    assert_eq!(
        text(&r4().rule(&not_ports).unwrap()),
        ["-p tcp -m multiport ! --destination-ports 22,80:90 -j DROP"],
        "not udp is implied by tcp (and iptables takes one -p)"
    );
    let never = Rule {
        protocol: Some(Protocol::TCP),
        not_protocol: Some(Protocol::TCP),
        action: Some(Action::Deny),
        ..Rule::default()
    };
    assert!(
        r4().rule(&never).unwrap().is_empty(),
        "tcp and not tcp never matches"
    );
    let only_not = Rule {
        not_protocol: Some(Protocol::UDP),
        ..Rule::default()
    };
    assert_eq!(
        text(&r4().rule(&only_not).unwrap())[0],
        "! -p udp -j MARK --set-xmark 0x10000/0x10000"
    );
    assert!(r6().rule(&not_ports).unwrap().is_empty(), "ip_version 4");
}

#[test]
fn unenforceable_matches_fail_closed() {
    let allow = Rule {
        unsupported: vec!["http_match"],
        ..Rule::default()
    };
    assert!(
        r4().rule(&allow).unwrap().is_empty(),
        "an allow that cannot be enforced allows nothing"
    );
    let deny = Rule {
        action: Some(Action::Deny),
        protocol: Some(Protocol::TCP),
        unsupported: vec!["http_match"],
        ..Rule::default()
    };
    assert_eq!(
        text(&r4().rule(&deny).unwrap()),
        ["-p tcp -j DROP"],
        "a deny matches more"
    );
}

#[test]
fn chain_names() {
    let n = ChainNames::new("dph");
    let plain = PolicyId {
        name: id("default.allow-web"),
        namespace: None,
        kind: None,
    };
    assert_eq!(
        n.policy(Direction::Inbound, &plain),
        "dph-pi-default.allow-web"
    );
    assert_eq!(
        n.policy(Direction::Outbound, &plain),
        "dph-po-default.allow-web"
    );
    let ns = PolicyId {
        name: id("allow-web"),
        namespace: Some(id("shop")),
        kind: Some(id("NetworkPolicy")),
    };
    let a = n.policy(Direction::Inbound, &ns);
    assert_eq!(a.len(), MAX_CHAIN_NAME);
    assert!(a.starts_with("dph-pi-_"), "{a}");
    let other_ns = PolicyId {
        namespace: Some(id("shop2")),
        ..ns.clone()
    };
    assert_ne!(a, n.policy(Direction::Inbound, &other_ns));
    assert_eq!(
        n.profile(Direction::Inbound, &id("kns.shop")),
        "dph-pri-kns.shop"
    );
    let odd = n.profile(Direction::Outbound, &id("ksa.shop/default"));
    assert!(
        odd.starts_with("dph-pro-_") && odd.len() == MAX_CHAIN_NAME,
        "{odd}"
    );
    for name in [a, odd] {
        assert!(
            IptRule::new(["-j", name.as_str()]).is_ok(),
            "{name} is a valid token"
        );
    }
}

#[test]
fn rules_naming_missing_sets_match_as_if_the_set_were_empty() {
    let known: std::collections::BTreeSet<Id> = [id("s:here"), id("n:here")].into();
    let r = Renderer {
        known_sets: Some(&known),
        ..r4()
    };
    let positive = Rule {
        src_ip_set_ids: vec![id("s:gone")],
        ..Rule::default()
    };
    assert!(
        r.rule(&positive).unwrap().is_empty(),
        "in an empty set: never"
    );
    let negated = Rule {
        action: Some(Action::Deny),
        not_src_ip_set_ids: vec![id("s:gone"), id("s:here")],
        ..Rule::default()
    };
    assert_eq!(
        text(&r.rule(&negated).unwrap()),
        ["-m set ! --match-set dph40s:here src -j DROP"],
        "not in an empty set: always"
    );
    let named = Rule {
        protocol: Some(Protocol::TCP),
        dst_named_port_ip_set_ids: vec![id("n:gone")],
        ..Rule::default()
    };
    assert!(r.rule(&named).unwrap().is_empty());
    let mixed = Rule {
        protocol: Some(Protocol::TCP),
        dst_ports: ports(&[(80, 80)]),
        dst_named_port_ip_set_ids: vec![id("n:gone"), id("n:here")],
        action: Some(Action::Deny),
        ..Rule::default()
    };
    let out = text(&r.rule(&mixed).unwrap()).join("\n");
    assert!(out.contains("n:here") && !out.contains("n:gone"), "{out}");
}

#[test]
fn the_wireguard_mark_is_felixs() {
    assert_eq!(Marks::default().wireguard(), 0x20_0000);
}
