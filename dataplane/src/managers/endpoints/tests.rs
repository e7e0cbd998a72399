//! Golden chains for representative endpoints.

use super::*;
use crate::model::wireguard::WgSettings;
use crate::model::{Action, IfaceName, TierDefault, TierInfo};

fn mgr() -> EndpointsManager {
    EndpointsManager::new(
        EndpointsConfig {
            prefix: "dph".into(),
            workload_prefix: "cali".into(),
            marks: Marks::default(),
            failsafe_in: default_failsafe().0,
            failsafe_out: default_failsafe().1,
            device_route_protocol: 3,
            vxlan: crate::model::routes::VxlanMode::Auto,
            vxlan_port: 4789,
            wireguard: [
                WgSettings::default_for(IpVersion::V4),
                WgSettings::default_for(IpVersion::V6),
            ],
            endpoint_to_host: Default::default(),
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

/// A table seam that reads an empty table and accepts every write.
#[derive(Debug)]
struct NoKernel;

impl crate::backends::iptables::IptablesExec for NoKernel {
    fn save(&mut self, _: &str) -> Result<String, crate::backends::BackendError> {
        Ok(String::new())
    }
    fn restore(&mut self, _: &str) -> Result<(), crate::backends::BackendError> {
        Ok(())
    }
}

/// filter, raw and mangle of version `v`.
fn kernel(v: IpVersion) -> DesiredKernel {
    use crate::backends::iptables::{InsertMode, Table};
    use crate::generictables::Ownership;
    DesiredKernel {
        tables: ["filter", "raw", "mangle"]
            .into_iter()
            .map(|t| {
                Table::new(
                    t,
                    v,
                    Ownership::new("dph"),
                    InsertMode::Insert,
                    Box::new(NoKernel),
                )
            })
            .collect(),
        ..Default::default()
    }
}

/// Applies the manager's work and returns the programmed chains of
/// `table` (those the hooks reach), as text.
fn run(m: &mut EndpointsManager, k: &mut DesiredKernel, table: &str) -> Chains {
    m.complete_deferred_work(k).unwrap();
    programmed(k.tables.iter().find(|t| t.table() == table).unwrap())
}

/// The programmed chains of `t` (those the hooks reach), as text.
fn programmed(t: &crate::backends::iptables::Table) -> Chains {
    t.programmed()
        .into_iter()
        .map(|name| {
            let rules = t
                .chain(&name)
                .unwrap()
                .iter()
                .map(|r| r.text().to_string())
                .collect();
            (name, rules)
        })
        .collect()
}

type Chains = BTreeMap<String, Vec<String>>;

fn table<'a>(k: &'a DesiredKernel, name: &str) -> &'a crate::backends::iptables::Table {
    k.tables.iter().find(|t| t.table() == name).unwrap()
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
    let mut k = kernel(IpVersion::V4);
    let c = run(&mut m, &mut k, "filter");
    assert_eq!(
        c["dph-tw-cali1"],
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
        c["dph-fw-cali1"],
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
    assert_eq!(c["dph-tw-cali2"], ["-j DROP"], "admin down");
    assert_eq!(
        c["dph-from-wl-dispatch"],
        [
            "-i cali1 -g dph-fw-cali1",
            "-i cali2 -g dph-fw-cali2",
            "-j DROP"
        ]
    );
    assert_eq!(
        c["dph-to-wl-dispatch"],
        [
            "-o cali1 -g dph-tw-cali1",
            "-o cali2 -g dph-tw-cali2",
            "-j DROP"
        ]
    );
    assert_eq!(
        c["dph-pi-default.allow-web"],
        [
            "-p tcp -m multiport --destination-ports 80 -j MARK --set-xmark 0x10000/0x10000",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
        ]
    );
    assert_eq!(
        c["dph-FORWARD"],
        [
            "-j MARK --set-xmark 0/0x1b0000",
            "-m mark --mark 0/0x10000 -j dph-from-hep-forward",
            "-i cali+ -j dph-from-wl-dispatch",
            "-i cali+ -m mark --mark 0/0x10000 -j DROP",
            "-o cali+ -j MARK --set-xmark 0/0x10000",
            "-o cali+ -j dph-to-wl-dispatch",
            "-o cali+ -m mark --mark 0/0x10000 -j DROP",
            "-j dph-to-hep-forward",
            "-m mark --mark 0x10000/0x10000 -j ACCEPT",
        ]
    );
    assert_eq!(
        c["dph-INPUT"],
        [
            "-i cali+ -j dph-from-wl-dispatch",
            "-i cali+ -m mark --mark 0x10000/0x10000 -j ACCEPT",
            "-i cali+ -j DROP",
            "-j MARK --set-xmark 0/0x1b0000",
            "-j dph-from-host-endpoint",
            "-m mark --mark 0x10000/0x10000 -j ACCEPT",
        ]
    );
    assert!(
        c["dph-from-host-endpoint"].is_empty(),
        "no host endpoints: nothing policed"
    );
    assert!(!c.contains_key("dph-failsafe-in"), "unreferenced");
    let raw = run(&mut m, &mut k, "raw");
    assert!(raw.is_empty(), "raw untouched without host endpoint policy");
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
    let mut k = kernel(IpVersion::V6);
    let c = run(&mut m, &mut k, "filter");
    assert!(
        !c["dph-tw-cali1"]
            .iter()
            .any(|r| r == "-m mark --mark 0/0x20000 -j DROP"),
        "a pass tier has no default drop"
    );
    m.on_update(&Update::Remove(Key::Policy(pid("t1.p"))));
    let c = run(&mut m, &mut k, "filter");
    assert!(!c.contains_key("dph-pi-t1.p"));
    assert!(!c["dph-tw-cali1"].iter().any(|r| r.contains("dph-pi-t1.p")));
}

fn tier(name: &str, ingress: &[&str], egress: &[&str]) -> TierInfo {
    TierInfo {
        name: id(name),
        ingress_policies: ingress.iter().map(|p| pid(p)).collect(),
        egress_policies: egress.iter().map(|p| pid(p)).collect(),
        default_action: TierDefault::Deny,
    }
}

fn tcp_port(port: u16) -> crate::model::Rule {
    crate::model::Rule {
        protocol: Some(crate::model::Protocol::TCP),
        dst_ports: vec![crate::model::PortRange {
            first: port,
            last: port,
        }],
        ..Default::default()
    }
}

fn link(m: &mut EndpointsManager, index: u32, name: &str, addr: &str) {
    use crate::interfaces::InterfaceEvent as E;
    m.on_interface(&E::Link {
        index,
        name: name.into(),
        up: true,
        mtu: 1500,
    });
    m.on_interface(&E::AddrAdded {
        index,
        addr: addr.parse().unwrap(),
    });
}

fn hep(iface: crate::model::HostInterface, expect: &[&str]) -> HostEndpoint {
    HostEndpoint {
        interface: iface,
        profile_ids: vec![],
        tiers: vec![],
        untracked_tiers: vec![],
        pre_dnat_tiers: vec![],
        forward_tiers: vec![],
        expected_ipv4_addrs: expect.iter().map(|a| a.parse().unwrap()).collect(),
        expected_ipv6_addrs: vec![],
    }
}

#[test]
fn host_endpoints_in_filter_raw_and_mangle() {
    use crate::model::HostInterface;
    let mut m = mgr();
    link(&mut m, 1, "lo", "127.0.0.1/8");
    link(&mut m, 2, "eth0", "10.0.0.1/24");
    link(&mut m, 3, "eth1", "10.1.0.1/24");
    link(&mut m, 4, "cali1", "169.254.1.1/32");
    let pol = |untracked, pre_dnat| Policy {
        inbound_rules: vec![tcp_port(80)],
        outbound_rules: vec![tcp_port(443)],
        untracked,
        pre_dnat,
        ..Default::default()
    };
    m.on_update(&Update::Policy(pid("t.normal"), pol(false, false)));
    m.on_update(&Update::Policy(pid("t.untracked"), pol(true, false)));
    m.on_update(&Update::Policy(pid("t.prednat"), pol(false, true)));
    let mut named = hep(HostInterface::Named(IfaceName::new("eth0").unwrap()), &[]);
    named.tiers = vec![tier("t", &["t.normal"], &[])];
    named.untracked_tiers = vec![tier("t", &["t.untracked"], &["t.untracked"])];
    named.pre_dnat_tiers = vec![tier("t", &["t.prednat"], &[])];
    named.forward_tiers = vec![tier("t", &[], &["t.normal"])];
    let hid = |s: &str| HostEndpointId(id(s));
    m.on_update(&Update::HostEndpoint(hid("a-named"), named));
    // Matched by address: eth1 holds 10.1.0.1.
    m.on_update(&Update::HostEndpoint(
        hid("b-addr"),
        hep(HostInterface::ByAddress, &["10.1.0.1"]),
    ));
    let mut all = hep(HostInterface::All, &[]);
    all.untracked_tiers = vec![tier("t", &["t.untracked"], &[])];
    m.on_update(&Update::HostEndpoint(hid("c-all"), all));
    let mut k = kernel(IpVersion::V4);
    let f = run(&mut m, &mut k, "filter");
    assert_eq!(
        f["dph-from-host-endpoint"],
        [
            "-i cali+ -j RETURN",
            "-i lo -j RETURN",
            "-i eth0 -g dph-fh-eth0",
            "-i eth1 -g dph-fh-eth1",
            "-g dph-fhany",
        ],
        "named and by-address endpoints first, then the all-interfaces one"
    );
    assert_eq!(
        f["dph-fh-eth0"],
        [
            "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
            "-m conntrack --ctstate INVALID -j DROP",
            "-j dph-failsafe-in",
            "-j MARK --set-xmark 0/0x30000",
            "-j MARK --set-xmark 0/0x20000",
            "-m mark --mark 0/0x20000 -j dph-pi-t.normal",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
            "-m mark --mark 0/0x20000 -j DROP",
            "-j DROP",
        ]
    );
    assert_eq!(
        f["dph-fhfw-eth0"],
        [
            "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
            "-m conntrack --ctstate INVALID -j DROP",
            "-j MARK --set-xmark 0/0x30000",
            "-j MARK --set-xmark 0x10000/0x10000",
            "-j RETURN",
        ],
        "no forward policy inbound: forwarded traffic allowed"
    );
    assert_eq!(
        f["dph-thfw-eth0"][2..],
        [
            "-j MARK --set-xmark 0/0x30000",
            "-j MARK --set-xmark 0/0x20000",
            "-m mark --mark 0/0x20000 -j dph-po-t.normal",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
            "-m mark --mark 0/0x20000 -j DROP",
        ],
        "forward tiers outbound, no profiles, no final drop"
    );
    assert_eq!(
        f["dph-fh-eth1"][2..4],
        ["-j dph-failsafe-in", "-j MARK --set-xmark 0/0x30000"]
    );
    assert!(f.contains_key("dph-fhany") && f.contains_key("dph-thfwany"));
    assert_eq!(
        f["dph-INPUT"][3], "-m mark --mark 0x10000/0x10000 -j ACCEPT",
        "what raw or mangle accepted is accepted"
    );
    assert!(
        !f.contains_key("dph-pi-t.untracked"),
        "untracked policy lives in raw"
    );

    let raw = run(&mut m, &mut k, "raw");
    assert_eq!(
        table(&k, "raw").hooks("PREROUTING")[0].text(),
        "-j dph-PREROUTING"
    );
    assert_eq!(
        raw["dph-PREROUTING"],
        [
            "-j MARK --set-xmark 0/0x1b0000",
            "-i cali+ -j RETURN",
            "-j dph-from-host-endpoint",
            "-m mark --mark 0x10000/0x10000 -j ACCEPT",
        ]
    );
    assert_eq!(
        raw["dph-from-host-endpoint"],
        ["-i eth0 -g dph-fh-eth0"],
        "untracked policy on the all-interfaces endpoint is ignored, as in Felix"
    );
    assert_eq!(
        raw["dph-th-eth0"],
        [
            "-j dph-failsafe-out",
            "-j MARK --set-xmark 0/0x30000",
            "-j MARK --set-xmark 0/0x20000",
            "-m mark --mark 0/0x20000 -j dph-po-t.untracked",
            "-m mark --mark 0x10000/0x10000 -j NOTRACK",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
        ],
        "no conntrack, no drops"
    );
    assert_eq!(
        raw["dph-failsafe-in"],
        [
            "-p tcp -m multiport --dports 22,179,2379,2380,5473,6443,6666,6667 -j ACCEPT",
            "-p udp -m multiport --dports 68 -j ACCEPT",
            "-p tcp -m multiport --sports 179,2379,2380,5473,6443,6666,6667 -j ACCEPT",
            "-p udp -m multiport --sports 53,67 -j ACCEPT",
        ],
        "raw lets the replies of outbound failsafe ports in"
    );
    assert_eq!(raw["dph-pi-t.untracked"].len(), 2);

    let mangle = run(&mut m, &mut k, "mangle");
    assert_eq!(mangle["dph-from-host-endpoint"], ["-i eth0 -g dph-fh-eth0"]);
    assert_eq!(
        mangle["dph-fh-eth0"][3..],
        [
            "-j MARK --set-xmark 0/0x30000",
            "-j MARK --set-xmark 0/0x20000",
            "-m mark --mark 0/0x20000 -j dph-pi-t.prednat",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
        ]
    );
    assert!(
        !mangle.contains_key("dph-po-t.prednat"),
        "pre-DNAT policy is ingress only"
    );

    // Without untracked and pre-DNAT policy, raw and mangle are let go.
    let mut named = hep(HostInterface::Named(IfaceName::new("eth0").unwrap()), &[]);
    named.tiers = vec![tier("t", &["t.normal"], &[])];
    m.on_update(&Update::HostEndpoint(hid("a-named"), named));
    m.on_update(&Update::Remove(Key::HostEndpoint(hid("c-all"))));
    assert!(run(&mut m, &mut k, "raw").is_empty());
    assert!(table(&k, "raw").hooks("PREROUTING").is_empty());
    assert!(table(&k, "mangle").hooks("PREROUTING").is_empty());
    let f = run(&mut m, &mut k, "filter");
    assert_eq!(
        f["dph-from-host-endpoint"],
        ["-i eth0 -g dph-fh-eth0", "-i eth1 -g dph-fh-eth1"]
    );
    assert_eq!(
        f["dph-INPUT"][3], "-j MARK --set-xmark 0/0x1b0000",
        "no raw/mangle policy: the accept mark is not trusted"
    );

    // The address moves: the by-address endpoint follows it.
    use crate::interfaces::InterfaceEvent as E;
    m.on_interface(&E::AddrRemoved {
        index: 3,
        addr: "10.1.0.1/24".parse().unwrap(),
    });
    link(&mut m, 5, "eth2", "10.1.0.1/24");
    let f = run(&mut m, &mut k, "filter");
    assert_eq!(
        f["dph-from-host-endpoint"],
        ["-i eth0 -g dph-fh-eth0", "-i eth2 -g dph-fh-eth2"]
    );
    assert!(!f.contains_key("dph-fh-eth1"));
}

#[test]
fn incremental_changes_reach_the_chains_they_affect() {
    let mut m = mgr();
    let mut k = kernel(IpVersion::V4);
    m.on_update(&wep(
        "cali1",
        vec![tier("t", &["t.late"], &[])],
        &["prof"],
        EndpointState::Active,
    ));
    m.on_update(&wep("cali2", vec![], &[], EndpointState::Active));
    let c = run(&mut m, &mut k, "filter");
    assert!(
        !c["dph-tw-cali1"]
            .iter()
            .any(|r| r.contains("dph-pi-t.late"))
    );
    assert!(!c["dph-tw-cali1"].iter().any(|r| r.contains("dph-pri-prof")));

    // A policy and a profile arriving after the endpoint that names them.
    let set_rule = crate::model::Rule {
        src_ip_set_ids: vec![id("s:web")],
        ..Default::default()
    };
    m.on_update(&Update::Policy(
        pid("t.late"),
        Policy {
            inbound_rules: vec![set_rule],
            ..Default::default()
        },
    ));
    m.on_update(&Update::Profile(id("prof"), Profile::default()));
    let c = run(&mut m, &mut k, "filter");
    assert!(
        c["dph-tw-cali1"]
            .iter()
            .any(|r| r.ends_with("-j dph-pi-t.late"))
    );
    assert!(c["dph-tw-cali1"].iter().any(|r| r == "-j dph-pri-prof"));
    assert!(c["dph-pi-t.late"].is_empty(), "the set does not exist yet");

    // The set appears: the policy naming it is re-rendered.
    m.on_update(&Update::IpSetUpdate(crate::model::IpSet {
        id: id("s:web"),
        set_type: crate::model::IpSetType::Ip,
        members: vec![],
    }));
    let c = run(&mut m, &mut k, "filter");
    assert_eq!(c["dph-pi-t.late"].len(), 2, "{:?}", c["dph-pi-t.late"]);

    // An interface renamed: old chains go, dispatch follows.
    let mut renamed = wep("cali3", vec![], &[], EndpointState::Active);
    if let Update::WorkloadEndpoint(_, ep) = &mut renamed {
        // same id as cali2's
        let Update::WorkloadEndpoint(id2, _) = wep("cali2", vec![], &[], EndpointState::Active)
        else {
            unreachable!()
        };
        renamed = Update::WorkloadEndpoint(id2, ep.clone());
    }
    m.on_update(&renamed);
    let c = run(&mut m, &mut k, "filter");
    assert!(!c.contains_key("dph-tw-cali2") && c.contains_key("dph-tw-cali3"));
    let filter = &k.tables[0];
    assert!(
        filter.chain("dph-tw-cali2").is_none(),
        "removed, not only unreferenced"
    );
    assert_eq!(
        c["dph-to-wl-dispatch"],
        [
            "-o cali1 -g dph-tw-cali1",
            "-o cali3 -g dph-tw-cali3",
            "-j DROP"
        ]
    );

    // The policy removed: the endpoint chain loses its jump.
    m.on_update(&Update::Remove(Key::Policy(pid("t.late"))));
    let c = run(&mut m, &mut k, "filter");
    assert!(
        !c["dph-tw-cali1"]
            .iter()
            .any(|r| r.contains("dph-pi-t.late"))
    );
    assert!(k.tables[0].chain("dph-pi-t.late").is_none());
}

/// Where `-i`/`-o` dispatch sends `iface`, following the chains as the
/// kernel would (first match; `name+` matches names starting with name).
fn dispatch_to(c: &Chains, root: &str, iface: &str) -> String {
    let mut chain = root.to_string();
    'walk: loop {
        for r in &c[&chain] {
            let t: Vec<&str> = r.split(' ').collect();
            if t == ["-j", "DROP"] {
                return "DROP".into();
            }
            let pat = t[1];
            let hit = match pat.strip_suffix('+') {
                Some(p) => iface.starts_with(p),
                None => iface == pat,
            };
            if hit {
                chain = t[3].to_string();
                if !c.contains_key(&chain) || !chain.contains("dispatch") {
                    return chain;
                }
                continue 'walk;
            }
        }
        return "fell off".into();
    }
}

/// Both dispatch trees take `iface` to its endpoint's chains.
fn assert_dispatched(c: &Chains, iface: &str) {
    assert_eq!(
        dispatch_to(c, "dph-from-wl-dispatch", iface),
        format!("dph-fw-{iface}")
    );
    assert_eq!(
        dispatch_to(c, "dph-to-wl-dispatch", iface),
        format!("dph-tw-{iface}")
    );
}

#[test]
fn dispatch_is_a_tree_that_reaches_every_endpoint() {
    let mut m = mgr();
    let names: Vec<String> = (0..300u32)
        .map(|i| format!("cali{:011x}", i.wrapping_mul(2_654_435_761) >> 4))
        .chain(["cali1".to_string(), "cali12".to_string()])
        .collect();
    for n in &names {
        m.on_update(&wep(n, vec![], &[], EndpointState::Active));
    }
    let mut k = kernel(IpVersion::V4);
    let c = run(&mut m, &mut k, "filter");
    let root = &c["dph-from-wl-dispatch"];
    assert!(root.len() < 40, "split: {} rules in the root", root.len());
    assert!(
        root.iter()
            .any(|r| r.starts_with("-i cali1+ -g dph-from-wl-dispatch-1"))
    );
    assert!(
        c.keys()
            .filter(|n| n.starts_with("dph-from-wl-dispatch"))
            .all(|n| n.len() <= 28)
    );
    for n in &names {
        assert_dispatched(&c, n);
    }
    assert_eq!(dispatch_to(&c, "dph-from-wl-dispatch", "cali1ffff"), "DROP");
    assert_eq!(dispatch_to(&c, "dph-from-wl-dispatch", "calizzz"), "DROP");
    assert!(
        c.values().all(|rules| rules.len() <= 40),
        "no chain holds a rule per endpoint"
    );

    // One endpoint more rewrites one small leaf, not the root.
    let before = c;
    m.on_update(&wep("cali00000000abc", vec![], &[], EndpointState::Active));
    let after = run(&mut m, &mut k, "filter");
    let changed: Vec<&String> = after
        .iter()
        .filter(|(n, r)| n.contains("dispatch") && before.get(*n) != Some(r))
        .map(|(n, _)| n)
        .collect();
    assert!(changed.len() <= 4, "{changed:?}");
    assert_eq!(
        dispatch_to(&after, "dph-to-wl-dispatch", "cali00000000abc"),
        "dph-tw-cali00000000abc"
    );
}

/// Names sharing a long prefix (`cali` and seven zeros) split too: the
/// shared characters make no level of their own, and children whose
/// names would be too long are named by a hash.
#[test]
fn dispatch_splits_names_with_a_long_common_prefix() {
    let mut m = mgr();
    let names: Vec<String> = (0..3000u32).map(|i| format!("cali{i:011x}")).collect();
    for n in &names {
        m.on_update(&wep(n, vec![], &[], EndpointState::Active));
    }
    let c = run(&mut m, &mut kernel(IpVersion::V4), "filter");
    let dispatch: Vec<(&String, &Vec<String>)> =
        c.iter().filter(|(n, _)| n.contains("dispatch")).collect();
    assert!(
        dispatch.iter().all(|(n, r)| n.len() <= 28 && r.len() <= 40),
        "{:?}",
        dispatch
            .iter()
            .map(|(n, r)| (n.as_str(), r.len()))
            .filter(|(_, l)| *l > 40)
            .collect::<Vec<_>>()
    );
    assert!(
        dispatch.iter().any(|(n, _)| n.contains('.')),
        "hashed names"
    );
    for n in names.iter().step_by(7) {
        assert_dispatched(&c, n);
    }
    assert_eq!(
        dispatch_to(&c, "dph-from-wl-dispatch", "cali0000000ffff"),
        "DROP"
    );
}

#[test]
fn vxlan_to_this_host_only_from_known_nodes() {
    let filter = |v, encap: crate::model::Encapsulation| {
        let mut m = mgr();
        m.on_update(&wep("cali1", vec![], &[], EndpointState::Active));
        m.on_update(&Update::Encapsulation(encap));
        run(&mut m, &mut kernel(v), "filter")
    };
    let on = crate::model::Encapsulation {
        vxlan_enabled: true,
        ..Default::default()
    };
    let v4 = filter(IpVersion::V4, on);
    // Felix's all-vxlan-net rules, first in INPUT.
    assert_eq!(
        v4["dph-INPUT"][..3],
        [
            "-p udp -m udp --dport 4789 -m set --match-set dph40all-vxlan-net src -m addrtype --dst-type LOCAL -j ACCEPT",
            "-p udp -m udp --dport 4789 -m addrtype --dst-type LOCAL -j DROP",
            "-i cali+ -j dph-from-wl-dispatch",
        ]
    );
    // From this host to the known nodes, ahead of host-endpoint policy.
    assert!(
        v4["dph-OUTPUT"].contains(&"-p udp -m udp --dport 4789 -m set --match-set dph40all-vxlan-net dst -m addrtype --src-type LOCAL -j ACCEPT".to_string()),
        "{:?}",
        v4["dph-OUTPUT"]
    );
    // VXLAN on for IPv4 only: nothing of it in IPv6; off: nothing at all.
    let v6 = filter(IpVersion::V6, on);
    assert!(!v6.values().flatten().any(|r| r.contains("4789")));
    let off = filter(IpVersion::V4, crate::model::Encapsulation::default());
    assert!(!off.values().flatten().any(|r| r.contains("4789")));
    let v6_on = filter(
        IpVersion::V6,
        crate::model::Encapsulation {
            vxlan_enabled_v6: true,
            ..Default::default()
        },
    );
    assert!(
        v6_on["dph-INPUT"]
            .iter()
            .any(|r| r.contains("--match-set dph60all-vxlan-net src")),
        "{:?}",
        v6_on["dph-INPUT"]
    );
}

#[test]
fn wireguard_to_and_from_this_host_whatever_host_policy_says() {
    let filter = |v, config: &[(&str, &str)]| {
        let mut m = mgr();
        m.on_update(&wep("cali1", vec![], &[], EndpointState::Active));
        m.on_update(&Update::Config(
            config
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ));
        run(&mut m, &mut kernel(v), "filter")
    };
    let off = filter(IpVersion::V4, &[]);
    assert!(!off.values().flatten().any(|r| r.contains("51820")));
    let on = filter(
        IpVersion::V4,
        &[
            ("WireguardEnabled", "true"),
            ("WireguardListeningPort", "51999"),
        ],
    );
    // Felix's "Allow incoming/outgoing IPv4 Wireguard packets".
    assert_eq!(
        on["dph-INPUT"][0],
        "-p udp -m udp --dport 51999 -m addrtype --dst-type LOCAL -j ACCEPT"
    );
    assert!(
        on["dph-OUTPUT"].contains(
            &"-p udp -m udp --dport 51999 -m addrtype --src-type LOCAL -j ACCEPT".to_string()
        ),
        "{:?}",
        on["dph-OUTPUT"]
    );
    // On for IPv4 only: nothing of it in IPv6; IPv6 has its own port.
    let v6 = filter(IpVersion::V6, &[("WireguardEnabled", "true")]);
    assert!(!v6.values().flatten().any(|r| r.contains("5182")));
    let v6 = filter(IpVersion::V6, &[("WireguardEnabledV6", "true")]);
    assert!(
        v6["dph-INPUT"].contains(
            &"-p udp -m udp --dport 51821 -m addrtype --dst-type LOCAL -j ACCEPT".to_string()
        ),
        "{:?}",
        v6["dph-INPUT"]
    );
}

#[test]
fn a_config_update_changes_failsafes_endpoint_to_host_and_vxlan_live() {
    let config = |m: &mut EndpointsManager, pairs: &[(&str, &str)]| {
        m.on_update(&Update::Config(crate::model::config::kv(pairs)))
    };
    let mut m = mgr();
    m.on_update(&wep("cali1", vec![], &[], EndpointState::Active));
    // A host endpoint: the failsafe chains are rendered for it.
    link(&mut m, 2, "eth0", "10.0.0.1/24");
    m.on_update(&Update::HostEndpoint(
        HostEndpointId(id("h")),
        hep(
            crate::model::HostInterface::Named(IfaceName::new("eth0").unwrap()),
            &[],
        ),
    ));
    let mut k = kernel(IpVersion::V4);
    let before = run(&mut m, &mut k, "filter");
    assert!(
        before["dph-failsafe-in"][0].contains("--dports 22,179"),
        "{before:?}"
    );
    let from_wl = |f: &BTreeMap<String, Vec<String>>| -> Vec<String> {
        f["dph-INPUT"]
            .iter()
            .filter(|r| r.starts_with("-i cali+"))
            .cloned()
            .collect()
    };
    // The flag's (Accept): what egress allowed is accepted.
    assert_eq!(
        from_wl(&before),
        [
            "-i cali+ -j dph-from-wl-dispatch",
            "-i cali+ -m mark --mark 0x10000/0x10000 -j ACCEPT",
            "-i cali+ -j DROP"
        ]
    );
    assert!(!before.values().flatten().any(|r| r.contains("4790")));
    config(
        &mut m,
        &[
            ("FailsafeInboundHostPorts", "tcp:2222"),
            ("FailsafeOutboundHostPorts", "none"),
            ("DefaultEndpointToHostAction", "Return"),
            ("VXLANEnabled", "true"),
            ("VXLANPort", "4790"),
        ],
    );
    let after = run(&mut m, &mut k, "filter");
    assert_eq!(
        from_wl(&after),
        [
            "-i cali+ -j dph-from-wl-dispatch",
            "-i cali+ -m mark --mark 0x10000/0x10000 -j RETURN",
            "-i cali+ -j DROP"
        ]
    );
    assert_eq!(
        after["dph-failsafe-in"],
        ["-p tcp -m multiport --dports 2222 -j ACCEPT"]
    );
    assert!(
        after.get("dph-failsafe-out").is_none_or(Vec::is_empty),
        "{after:?}"
    );
    assert!(
        after["dph-INPUT"]
            .iter()
            .any(|r| r.contains("--dport 4790")),
        "VXLAN on its new port: {:?}",
        after["dph-INPUT"]
    );
    // The keys gone: the flags' again.
    config(&mut m, &[]);
    assert_eq!(run(&mut m, &mut k, "filter"), before);
}

#[test]
fn ipv6_workloads_reach_their_router_whatever_their_egress_policy() {
    let filter = |v| {
        let mut m = mgr();
        m.on_update(&wep("cali1", vec![], &[], EndpointState::Active));
        run(&mut m, &mut kernel(v), "filter")
    };
    let icmpv6: Vec<String> = [130, 131, 132, 133, 135, 136]
        .iter()
        .map(|t| format!("-i cali+ -p ipv6-icmp -m icmp6 --icmpv6-type {t} -j ACCEPT"))
        .collect();
    let v6 = filter(IpVersion::V6);
    // Felix's ICMPv6Filter: before the jump to the egress policy.
    assert_eq!(v6["dph-INPUT"][..6], icmpv6[..]);
    assert_eq!(v6["dph-INPUT"][6], "-i cali+ -j dph-from-wl-dispatch");
    let v4 = filter(IpVersion::V4);
    assert_eq!(v4["dph-INPUT"][0], "-i cali+ -j dph-from-wl-dispatch");
    assert!(
        !v4.values().flatten().any(|r| r.contains("icmp6")),
        "IPv4 has no such exception"
    );
}

#[test]
fn static_neighbours_for_ipv4_only_ipv6_is_left_to_ndp() {
    let mut m = mgr();
    let Update::WorkloadEndpoint(wid, mut ep) = wep("cali1", vec![], &[], EndpointState::Active)
    else {
        unreachable!()
    };
    ep.mac = Some(crate::model::MacAddr::parse("02:00:00:00:00:01").unwrap());
    ep.ipv4_nets = vec!["10.65.0.2/32".parse().unwrap()];
    ep.ipv6_nets = vec!["fd00:65::2/128".parse().unwrap()];
    m.on_update(&Update::WorkloadEndpoint(wid, ep));
    link(&mut m, 7, "cali1", "fe80::ecee:eeff:feee:eeee/64");
    let share = m.link_share("cali1", false, &[]);
    assert_eq!(
        share
            .routes
            .iter()
            .map(|(k, _)| k.dst.to_string())
            .collect::<Vec<_>>(),
        ["10.65.0.2/32", "fd00:65::2/128"]
    );
    let neighbours = share.neighbours;
    assert_eq!(
        neighbours
            .iter()
            .map(|n| n.addr.to_string())
            .collect::<Vec<_>>(),
        ["10.65.0.2"]
    );
}

/// Status is reported for what changed only: an update, its interface
/// going up or down, a removal; a report with nothing new says nothing.
#[test]
fn status_reports_follow_endpoints_and_their_links() {
    use crate::interfaces::InterfaceEvent as E;
    use crate::status::StatusEvent as S;
    let mut m = mgr();
    let wid = |iface: &str| WorkloadEndpointId {
        orchestrator: id("k8s"),
        workload: id(&format!("ns/{iface}")),
        endpoint: id("eth0"),
    };
    let status = |m: &mut EndpointsManager| -> Vec<String> {
        m.status_changes()
            .into_iter()
            .map(|e| match e {
                S::WorkloadEndpointStatus { id, status, .. } => format!("{} {status}", id.workload),
                S::WorkloadEndpointStatusRemove { id } => format!("{} gone", id.workload),
                other => format!("{other:?}"),
            })
            .collect()
    };
    m.on_update(&wep("cali1", vec![], &[], EndpointState::Active));
    m.on_update(&wep("cali2", vec![], &[], EndpointState::Active));
    assert_eq!(status(&mut m), ["ns/cali1 down", "ns/cali2 down"]);
    assert!(status(&mut m).is_empty(), "nothing changed, nothing said");
    let link = |name: &str, index: u32, up: bool| E::Link {
        index,
        name: name.into(),
        up,
        mtu: 1500,
    };
    m.on_interface(&link("cali2", 7, true));
    m.on_interface(&link("eth9", 8, true));
    assert_eq!(status(&mut m), ["ns/cali2 up"]);
    m.on_interface(&link("cali2", 7, false));
    assert_eq!(status(&mut m), ["ns/cali2 down"]);
    m.on_interface(&link("cali2", 7, true));
    m.on_update(&wep("cali2", vec![], &[], EndpointState::Down));
    assert!(
        status(&mut m).is_empty(),
        "up, then the endpoint down: as reported"
    );
    m.on_update(&wep("cali2", vec![], &[], EndpointState::Active));
    assert_eq!(status(&mut m), ["ns/cali2 up"]);
    m.on_update(&Update::Remove(Key::WorkloadEndpoint(wid("cali1"))));
    m.on_interface(&E::LinkRemoved {
        index: 7,
        name: "cali2".into(),
    });
    assert_eq!(status(&mut m), ["ns/cali1 gone", "ns/cali2 down"]);
}

/// The dispatch leaves kept from the last render give what a render from
/// scratch gives, as endpoints come and go.
#[test]
fn dispatch_kept_from_the_last_render_is_what_a_fresh_render_gives() {
    let mut m = mgr();
    let mut k = kernel(IpVersion::V4);
    let names: Vec<String> = (0..600u32).map(|i| format!("cali{i:011x}")).collect();
    for n in &names {
        m.on_update(&wep(n, vec![], &[], EndpointState::Active));
    }
    run(&mut m, &mut k, "filter");
    for (step, n) in ["cali0000000123x", "cali0000000007a", "cali9"]
        .iter()
        .enumerate()
    {
        m.on_update(&wep(n, vec![], &[], EndpointState::Active));
        let kept = run(&mut m, &mut k, "filter");
        let mut fresh_m = mgr();
        for n in names.iter().map(String::as_str).chain(
            ["cali0000000123x", "cali0000000007a", "cali9"]
                .into_iter()
                .take(step + 1),
        ) {
            fresh_m.on_update(&wep(n, vec![], &[], EndpointState::Active));
        }
        let fresh = run(&mut fresh_m, &mut kernel(IpVersion::V4), "filter");
        let dispatch = |c: &Chains| -> Chains {
            c.iter()
                .filter(|(n, _)| n.contains("dispatch"))
                .map(|(n, r)| (n.clone(), r.clone()))
                .collect()
        };
        assert_eq!(dispatch(&kept), dispatch(&fresh), "after adding {n}");
        assert_dispatched(&kept, n);
    }
}

/// Both IP versions' filter tables get each new dispatch leaf: a leaf one
/// version's render found changed is not taken as kept by the other's.
#[test]
fn each_ip_versions_dispatch_gets_the_new_leaf() {
    let mut m = mgr();
    let mut k = kernel(IpVersion::V4);
    k.tables.extend(kernel(IpVersion::V6).tables);
    // One missing from a leaf, then added: the leaf keeps its name.
    for i in (0..600u32).filter(|i| *i != 5) {
        m.on_update(&wep(
            &format!("cali{i:011x}"),
            vec![],
            &[],
            EndpointState::Active,
        ));
    }
    m.complete_deferred_work(&mut k).unwrap();
    m.on_update(&wep("cali00000000005", vec![], &[], EndpointState::Active));
    m.complete_deferred_work(&mut k).unwrap();
    for t in k.tables.iter().filter(|t| t.table() == "filter") {
        assert_dispatched(&programmed(t), "cali00000000005");
    }
}

/// Two workloads on one interface (a make-before-break, or a feeder's
/// mistake): the lower id is served, the other shadowed, as in Felix; either
/// going leaves the other's chains in place.
#[test]
fn two_workloads_on_one_interface_the_lower_id_is_served() {
    let on = |workload: &str, profile: &str| {
        let Update::WorkloadEndpoint(mut wid, ep) =
            wep("cali1", vec![], &[profile], EndpointState::Active)
        else {
            unreachable!()
        };
        wid.workload = id(workload);
        (wid.clone(), Update::WorkloadEndpoint(wid, ep))
    };
    let (a, add_a) = on("ns/a", "kns.a");
    let (b, add_b) = on("ns/b", "kns.b");
    let served = |c: &Chains| -> String {
        let tw = &c["dph-tw-cali1"];
        tw.iter()
            .find(|r| r.contains("dph-pri-"))
            .cloned()
            .unwrap_or_default()
    };
    let mut m = mgr();
    for p in ["kns.a", "kns.b", "kns.b2"] {
        m.on_update(&Update::Profile(id(p), Profile::default()));
    }
    let mut k = kernel(IpVersion::V4);
    // b first, then a (lower) takes over.
    m.on_update(&add_b);
    assert_eq!(served(&run(&mut m, &mut k, "filter")), "-j dph-pri-kns.b");
    m.on_update(&add_a);
    assert_eq!(served(&run(&mut m, &mut k, "filter")), "-j dph-pri-kns.a");
    // An update of the shadowed one changes nothing served.
    let (_, add_b2) = on("ns/b", "kns.b2");
    m.on_update(&add_b2);
    assert_eq!(served(&run(&mut m, &mut k, "filter")), "-j dph-pri-kns.a");
    // The shadowed one goes: a's chains stay.
    m.on_update(&Update::Remove(Key::WorkloadEndpoint(b.clone())));
    let c = run(&mut m, &mut k, "filter");
    assert_eq!(served(&c), "-j dph-pri-kns.a");
    assert!(c.contains_key("dph-fw-cali1"));
    // b again, then a goes: b is served (its chains, not none).
    m.on_update(&add_b);
    run(&mut m, &mut k, "filter");
    m.on_update(&Update::Remove(Key::WorkloadEndpoint(a)));
    let c = run(&mut m, &mut k, "filter");
    assert_eq!(served(&c), "-j dph-pri-kns.b");
    assert!(c.contains_key("dph-fw-cali1"));
    // Both gone: the chains go too.
    m.on_update(&Update::Remove(Key::WorkloadEndpoint(b)));
    let c = run(&mut m, &mut k, "filter");
    assert!(!c.contains_key("dph-tw-cali1") && !c.contains_key("dph-fw-cali1"));
    assert!(table(&k, "filter").chain("dph-tw-cali1").is_none());
}

/// An nftables kernel that takes every commit and holds nothing.
#[derive(Debug)]
struct NoNft;

impl crate::backends::nftables::dataplane::NftKernel for NoNft {
    fn commit(
        &mut self,
        _: &[crate::backends::nftables::ops::Op],
    ) -> Result<(), crate::backends::nftables::netlink::NftError> {
        Ok(())
    }
    fn read(
        &mut self,
        _: crate::backends::nftables::ops::Family,
        _: &str,
    ) -> Result<
        (
            crate::backends::nftables::plan::Observed,
            crate::backends::nftables::plan::Contents,
        ),
        crate::backends::nftables::netlink::NftError,
    > {
        Ok(Default::default())
    }
}

/// With the sharded nftables filter (its shards' maps know the
/// interfaces), the dispatch tree is not rendered: filter takes the two
/// roots alone and sends every workload interface on to the shards.
#[test]
fn a_sharded_nftables_filter_gets_no_dispatch_tree() {
    use crate::backends::nftables::{Dataplane, shards::ShardLayout};
    let mut m = mgr();
    let mut k = DesiredKernel {
        nftables: vec![Dataplane::new(
            IpVersion::V4,
            "dph",
            SetNames::new("dph").unwrap(),
            ShardLayout {
                marks: Marks::default(),
                shards: 4,
                per_shard: 0,
            },
            Box::new(NoNft),
        )],
        ..Default::default()
    };
    for i in 0..40 {
        m.on_update(&wep(
            &format!("cali{i}"),
            vec![],
            &[],
            EndpointState::Active,
        ));
    }
    m.complete_deferred_work(&mut k).unwrap();
    let filter = &k.nftables[0].filter;
    for (root, stub) in [
        ("dph-from-wl-dispatch", "dph-fw-pending-in-shards"),
        ("dph-to-wl-dispatch", "dph-tw-pending-in-shards"),
    ] {
        use crate::backends::desired::RuleTable;
        assert_eq!(RuleTable::chain(filter, root), Some(&[][..]), "{root}");
        let programmed = RuleTable::chain(&filter.main, root).expect("the root");
        assert_eq!(programmed[0].text(), format!("-g {stub}"));
    }
    assert_eq!(
        crate::backends::desired::RuleTable::programmed(&filter.main)
            .iter()
            .filter(|c| c.contains("wl-dispatch"))
            .count(),
        2,
        "only the roots"
    );
    // The endpoints go to the shards (at the next plan).
    k.nftables[0].filter.settle().unwrap();
    assert_eq!(k.nftables[0].filter.placement().len(), 40);
}

/// The workload routes, neighbours and knobs of `k`, as text.
fn link_state(k: &DesiredKernel) -> (Vec<String>, Vec<String>, Vec<String>) {
    let r = k.routes.as_ref().unwrap();
    let routes = r
        .desired()
        .iter()
        .map(|(k, t)| format!("{} dev {}", k.dst, t.dev.as_deref().unwrap_or("-")))
        .collect();
    let neighbours = r
        .desired_neighbours()
        .iter()
        .map(|n| format!("{} {}", n.addr, n.dev))
        .collect();
    let knobs = k
        .sysctls
        .as_ref()
        .unwrap()
        .desired()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    (routes, neighbours, knobs)
}

/// An endpoint or link that changes patches its own interface's routes,
/// neighbours and knobs; after every step they are what a daemon that
/// started with the same state computes whole.
#[test]
fn routes_and_knobs_follow_each_interface_as_a_restart_would_find_them() {
    use crate::interfaces::InterfaceEvent as E;
    let kernel = || {
        let mut k = kernel(IpVersion::V4);
        k.routes = Some(crate::backends::routes::empty(vec![]));
        k.sysctls = Some(crate::backends::sysctl::Sysctls::new("/nonexistent"));
        k
    };
    enum Step {
        Up(Update),
        If(E),
    }
    let ep = |workload: &str, iface: &str, v4: &str| {
        let Update::WorkloadEndpoint(mut wid, mut ep) =
            wep(iface, vec![], &[], EndpointState::Active)
        else {
            unreachable!()
        };
        wid.workload = id(workload);
        ep.ipv4_nets = vec![v4.parse().unwrap()];
        ep.mac = Some(crate::model::MacAddr::parse("02:00:00:00:00:01").unwrap());
        Step::Up(Update::WorkloadEndpoint(wid, ep))
    };
    let gone = |workload: &str| {
        let Step::Up(Update::WorkloadEndpoint(wid, _)) = ep(workload, "x", "10.0.0.1/32") else {
            unreachable!()
        };
        Step::Up(Update::Remove(Key::WorkloadEndpoint(wid)))
    };
    let up = |index: u32, name: &str| {
        Step::If(E::Link {
            index,
            name: name.into(),
            up: true,
            mtu: 1500,
        })
    };
    let down = |index: u32, name: &str| {
        Step::If(E::LinkRemoved {
            index,
            name: name.into(),
        })
    };
    let feed = |m: &mut EndpointsManager, s: &Step| match s {
        Step::Up(u) => m.on_update(u),
        Step::If(e) => m.on_interface(e),
    };
    // Each step, and the routes it leaves.
    let steps: Vec<(Vec<Step>, &[&str])> = vec![
        (
            vec![
                ep("ns/w1", "cali1", "10.65.0.1/32"),
                ep("ns/w2", "cali2", "10.65.0.2/32"),
                ep("ns/w3", "cali3", "10.65.0.3/32"),
                up(1, "cali1"),
                up(2, "cali2"),
            ],
            &["10.65.0.1/32 dev cali1", "10.65.0.2/32 dev cali2"],
        ),
        // Readdressed; a link appears.
        (
            vec![ep("ns/w1", "cali1", "10.65.0.9/32"), up(3, "cali3")],
            &[
                "10.65.0.2/32 dev cali2",
                "10.65.0.3/32 dev cali3",
                "10.65.0.9/32 dev cali1",
            ],
        ),
        // A second endpoint on cali2, with a lower id: it is served.
        (
            vec![ep("ns/a2", "cali2", "10.65.0.22/32")],
            &[
                "10.65.0.3/32 dev cali3",
                "10.65.0.9/32 dev cali1",
                "10.65.0.22/32 dev cali2",
            ],
        ),
        // cali2's link goes; w1 is gone; w3 renamed to an existing link.
        (
            vec![
                down(2, "cali2"),
                gone("ns/w1"),
                up(4, "cali4"),
                ep("ns/w3", "cali4", "10.65.0.3/32"),
            ],
            &["10.65.0.3/32 dev cali4"],
        ),
        // Two interfaces claim one address: the first by name has it,
        // until it goes.
        (
            vec![
                up(6, "cali6"),
                up(5, "cali5"),
                ep("ns/w6", "cali6", "10.65.0.50/32"),
                ep("ns/w5", "cali5", "10.65.0.50/32"),
            ],
            &["10.65.0.3/32 dev cali4", "10.65.0.50/32 dev cali5"],
        ),
        (
            vec![gone("ns/w5")],
            &["10.65.0.3/32 dev cali4", "10.65.0.50/32 dev cali6"],
        ),
    ];
    let mut m = mgr();
    let mut k = kernel();
    let mut history: Vec<&Step> = Vec::new();
    for (i, (step, want)) in steps.iter().enumerate() {
        for s in step {
            feed(&mut m, s);
            history.push(s);
        }
        m.complete_deferred_work(&mut k).unwrap();
        let got = link_state(&k);
        assert_eq!(got.0, *want, "step {i}");
        // One neighbour and six knobs per served interface with a link.
        assert_eq!(got.1.len() * 6, got.2.len(), "step {i}: {:?}", got.1);
        let mut fresh = mgr();
        let mut fk = kernel();
        for s in &history {
            feed(&mut fresh, s);
        }
        fresh.complete_deferred_work(&mut fk).unwrap();
        assert_eq!(got, link_state(&fk), "step {i}: patched against whole");
    }
}

/// A policy, profile or workload that cannot be rendered is isolated: a
/// new one fail-closed (its chains drop), a known one kept as it was;
/// reported until it renders again; the others are programmed meanwhile.
#[test]
fn an_object_that_cannot_be_rendered_is_isolated_and_the_rest_programmed() {
    let allow80 = |port| Policy {
        inbound_rules: vec![crate::model::Rule {
            action: Some(Action::Allow),
            ..tcp_port(port)
        }],
        ..Default::default()
    };
    let mut m = mgr();
    let mut k = kernel(IpVersion::V4);
    m.on_update(&Update::Policy(pid("t.good"), allow80(80)));
    m.on_update(&Update::Policy(pid("t.bad"), allow80(81)));
    m.fail_render.insert(Owner::Policy(pid("t.bad")));
    m.on_update(&wep(
        "cali1",
        vec![tier("t", &["t.good", "t.bad"], &[])],
        &[],
        EndpointState::Active,
    ));
    let c = run(&mut m, &mut k, "filter");
    assert_eq!(c["dph-pi-t.bad"], ["-j DROP"], "new: fail-closed");
    assert!(c["dph-pi-t.good"][0].contains("ports 80 "), "{c:?}");
    assert!(c["dph-tw-cali1"].iter().any(|r| r.contains("dph-pi-t.bad")));
    let st: BTreeMap<_, _> = m.status().into_iter().collect();
    assert!(
        st["isolated.policy.t.bad"].contains("injected")
            && st["isolated.policy.t.bad"].contains("fail-closed"),
        "{st:?}"
    );
    assert_eq!(st.len(), 1, "{st:?}");

    // A known one that breaks keeps its last good chains; a later
    // workload is programmed meanwhile.
    m.fail_render.insert(Owner::Policy(pid("t.good")));
    m.on_update(&Update::Policy(pid("t.good"), allow80(8080)));
    m.on_update(&wep(
        "cali2",
        vec![tier("t", &["t.good"], &[])],
        &[],
        EndpointState::Active,
    ));
    let c = run(&mut m, &mut k, "filter");
    assert!(c["dph-pi-t.good"][0].contains("ports 80 "), "{c:?}");
    assert!(c.contains_key("dph-tw-cali2"), "the new workload: {c:?}");
    let st: BTreeMap<_, _> = m.status().into_iter().collect();
    assert!(st["isolated.policy.t.good"].contains("last good"), "{st:?}");

    // Mended: rendered as sent, no longer reported.
    m.fail_render.clear();
    m.on_update(&Update::Policy(pid("t.good"), allow80(8081)));
    m.on_update(&Update::Policy(pid("t.bad"), allow80(82)));
    let c = run(&mut m, &mut k, "filter");
    assert!(c["dph-pi-t.good"][0].contains("ports 8081 "), "{c:?}");
    assert!(c["dph-pi-t.bad"][0].contains("ports 82 "), "{c:?}");
    assert!(m.status().is_empty(), "{:?}", m.status());

    // A workload fail-closed: both its chains drop.
    m.fail_render.insert(Owner::Workload(
        match wep("cali3", vec![], &[], EndpointState::Active) {
            Update::WorkloadEndpoint(id, _) => id,
            _ => unreachable!(),
        },
    ));
    m.on_update(&wep("cali3", vec![], &[], EndpointState::Active));
    let c = run(&mut m, &mut k, "filter");
    assert_eq!(c["dph-tw-cali3"], ["-j DROP"]);
    assert_eq!(c["dph-fw-cali3"], ["-j DROP"]);
}

/// With the longest prefix `--prefix` takes and the longest names the
/// edge takes (15-byte interfaces, 253-byte ids, every id character),
/// every chain the managers make fits iptables' limit: nothing is
/// isolated, every table takes its chains.
#[test]
fn every_chain_name_fits_with_the_longest_prefix() {
    use crate::backends::iptables::{InsertMode, Table};
    use crate::generictables::{MAX_CHAIN_NAME, Ownership};
    use crate::model::HostInterface;
    use crate::model::ipsets::MAX_PREFIX;
    let prefix = "p".repeat(MAX_PREFIX);
    let mut cfg = mgr().cfg;
    cfg.prefix = prefix.clone();
    cfg.workload_prefix = "c".into();
    let mut m = EndpointsManager::new(cfg, SetNames::new(&prefix).unwrap());
    let long_iface = "c".repeat(IfaceName::MAX_LEN);
    let host_iface = "e".repeat(IfaceName::MAX_LEN);
    link(&mut m, 2, &host_iface, "10.0.0.1/24");
    link(&mut m, 3, &long_iface, "169.254.1.1/32");
    let odd = "a._-:/@+=~".repeat(26);
    let odd = &odd[..253];
    let all_ids = PolicyId {
        name: id(odd),
        namespace: Some(id(odd)),
        kind: Some(id(odd)),
    };
    let pol = |untracked, pre_dnat| Policy {
        inbound_rules: vec![crate::model::Rule {
            src_ip_set_ids: vec![id(odd)],
            ..tcp_port(80)
        }],
        outbound_rules: vec![tcp_port(443)],
        untracked,
        pre_dnat,
        ..Default::default()
    };
    m.on_update(&Update::IpSetUpdate(crate::model::IpSet {
        id: id(odd),
        set_type: crate::model::IpSetType::Ip,
        members: vec![],
    }));
    m.on_update(&Update::Policy(all_ids.clone(), pol(false, false)));
    m.on_update(&Update::Policy(pid(odd), pol(true, false)));
    m.on_update(&Update::Policy(pid(&odd[1..]), pol(false, true)));
    m.on_update(&Update::Profile(id(odd), Default::default()));
    let mut t = tier("t", &[], &[]);
    t.ingress_policies = vec![all_ids.clone()];
    t.egress_policies = vec![all_ids];
    m.on_update(&wep(
        &long_iface,
        vec![t.clone()],
        &[odd],
        EndpointState::Active,
    ));
    let mut untracked = t.clone();
    untracked.ingress_policies = vec![pid(odd)];
    let mut prednat = t.clone();
    prednat.ingress_policies = vec![pid(&odd[1..])];
    for (n, iface) in [
        (
            odd,
            HostInterface::Named(IfaceName::new(&host_iface).unwrap()),
        ),
        ("all", HostInterface::All),
    ] {
        let mut h = hep(iface, &[]);
        h.tiers = vec![t.clone()];
        h.forward_tiers = vec![t.clone()];
        h.untracked_tiers = vec![untracked.clone()];
        h.pre_dnat_tiers = vec![prednat.clone()];
        h.profile_ids = vec![id(odd)];
        m.on_update(&Update::HostEndpoint(HostEndpointId(id(n)), h));
    }
    for v in [IpVersion::V4, IpVersion::V6] {
        let mut k = DesiredKernel {
            tables: ["filter", "raw", "mangle"]
                .into_iter()
                .map(|t| {
                    Table::new(
                        t,
                        v,
                        Ownership::new(&prefix),
                        InsertMode::Insert,
                        Box::new(NoKernel),
                    )
                })
                .collect(),
            ..Default::default()
        };
        m.dirty.all = true;
        m.complete_deferred_work(&mut k).unwrap();
        assert!(m.status().is_empty(), "{:?}", m.status());
        let mut names = 0;
        for t in &k.tables {
            for name in t.programmed() {
                assert!(name.len() <= MAX_CHAIN_NAME, "{name}");
                names += 1;
            }
        }
        assert!(names > 20, "{names} chains");
        k.apply_all().unwrap();
    }
}

/// A workload endpoint is confined to a workload interface and to
/// addresses that are not the node's own.
#[test]
fn workloads_are_confined_to_workload_interfaces_and_addresses() {
    let mut m = mgr();
    link(&mut m, 2, "eth0", "192.0.2.10/24");
    link(&mut m, 3, "vxlan.calico", "10.65.0.0/32");
    let with_nets = |iface: &str, v4: &[&str], v6: &[&str]| {
        let Update::WorkloadEndpoint(id, mut ep) = wep(iface, vec![], &[], EndpointState::Active)
        else {
            unreachable!()
        };
        ep.ipv4_nets = v4.iter().map(|n| n.parse().unwrap()).collect();
        ep.ipv6_nets = v6.iter().map(|n| n.parse().unwrap()).collect();
        Update::WorkloadEndpoint(id, ep)
    };
    let e = m
        .check(&with_nets("eth0", &["10.65.0.5/32"], &[]))
        .unwrap_err();
    assert_eq!(e.field, "workload_endpoint_update.endpoint.name");
    assert!(
        e.reason.contains("not a workload interface"),
        "{}",
        e.reason
    );
    for (v4, v6, field, says) in [
        (&["0.0.0.0/0"][..], &[][..], "ipv4_nets[0]", "default route"),
        (&[], &["::/0"][..], "ipv6_nets[0]", "default route"),
        (
            &["10.65.0.5/32", "192.0.2.10/32"],
            &[],
            "ipv4_nets[1]",
            "an address of this node",
        ),
        (
            &["192.0.2.0/24"],
            &[],
            "ipv4_nets[0]",
            "an address of this node",
        ),
        (&["127.0.0.1/32"], &[], "ipv4_nets[0]", "not a unicast"),
    ] {
        let e = m.check(&with_nets("cali1", v4, v6)).unwrap_err();
        assert_eq!(
            e.field,
            format!("workload_endpoint_update.endpoint.{field}")
        );
        assert!(e.reason.contains(says), "{v4:?} {v6:?}: {}", e.reason);
    }
    // A pod address in the node's subnet, and one in the block the VXLAN
    // device's address is in: fine.
    m.check(&with_nets(
        "cali1",
        &["192.0.2.77/32", "10.65.0.0/32"],
        &["fd00::1/128"],
    ))
    .unwrap();
}
