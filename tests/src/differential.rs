//! Seeded policy scenarios for the differential test
//! (`tests/calico_differential.rs`): the same Calico resources, written with
//! calicoctl, programmed by Felix's own dataplane and by dphandler behind
//! Felix; Felix's verdicts are the expected ones.
//!
//! A node holds four dual-stack workloads in two namespaces (`na`: w1, w2;
//! `nb`: w3, w4) and a marker pair in a third (`nm`). A scenario chooses each
//! workload's labels, service account and named ports, each namespace's
//! labels and profile rules, the tier `sec`'s default action, and one to
//! four policies (global or namespaced, in `sec` or `default`, ingress,
//! egress or both) whose rules draw on selectors (`==`, `!=`, `has()`,
//! `in`, `not in`, `&&`, `||`, `all()`), namespace and service-account
//! selectors, numbered, ranged and named ports, `nets`/`notNets` of both
//! families, protocols, ICMP and ICMPv6 types and codes, `ipVersion`. The marker policy (tier `marker`, first) opens
//! one port to the marker workload, a different one in each scenario: once
//! it is enforced, everything written before it is too.
//!
//! The node also has an uplink to an outside network (`hep0`), a host
//! endpoint on it (its `zone` label chosen by the scenario) and zero to two
//! policies for it: normal (applied to forwarded traffic or not), pre-DNAT
//! or untracked.

/// The workloads the scenarios police: (name, namespace, host interface,
/// MAC suffix, IPv4 address, IPv6 address).
pub const WORKLOADS: [(&str, &str, &str, u8, &str, &str); 4] = [
    ("w1", "na", "cali11", 0x11, "10.65.0.11", "fd00:65::11"),
    ("w2", "na", "cali12", 0x12, "10.65.0.12", "fd00:65::12"),
    ("w3", "nb", "cali13", 0x13, "10.65.0.13", "fd00:65::13"),
    ("w4", "nb", "cali14", 0x14, "10.65.0.14", "fd00:65::14"),
];

/// The node's own addresses (on its loopback).
pub const NODE_V4: &str = "172.31.50.1";
pub const NODE_V6: &str = "fd00:50::1";

/// The marker pair: the source (`msrc`) and the destination (`mdst`),
/// dual-stack (each family's tables are programmed apart: Felix can fail
/// one and program the other).
pub const MARKER: [(&str, &str, u8, &str, &str); 2] = [
    ("msrc", "cali9", 0x09, "10.65.0.9", "fd00:65::9"),
    ("mdst", "cali10", 0x0a, "10.65.0.10", "fd00:65::a"),
];

/// The marker's two ports; scenario `k` opens `MARKER_PORTS[k % 2]`.
pub const MARKER_PORTS: [u16; 2] = [20001, 20002];

/// What every workload serves.
pub const TCP_PORTS: [u16; 3] = [8080, 9090, 7000];
pub const UDP_PORTS: [u16; 2] = [5353, 6000];

/// The node's interface toward the outside network: a host endpoint.
pub const UPLINK: &str = "hep0";
/// The node's address on it, and the outside namespace's.
pub const NODE_UPLINK: &str = "192.168.77.1";
pub const OUTSIDE: &str = "192.168.77.2";
/// What the node serves (on every address), and the outside namespace.
pub const NODE_TCP: [u16; 3] = [8081, 8082, 22];
pub const NODE_UDP: [u16; 1] = [5353];
pub const OUTSIDE_TCP: [u16; 1] = [9000];

/// Where a probe starts or ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// A workload (an index into [`WORKLOADS`]).
    Workload(usize),
    /// The node itself.
    Node,
    /// A machine on the node's outside network (through [`UPLINK`]).
    Outside,
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Workload(i) => f.write_str(WORKLOADS[*i].0),
            Self::Node => f.write_str("node"),
            Self::Outside => f.write_str("outside"),
        }
    }
}

/// One probe, over IPv4 or IPv6.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeCase {
    pub from: Place,
    pub to: Place,
    pub v6: bool,
    pub probe: crate::lab::Probe,
}

impl ProbeCase {
    /// The address probed (the node is probed from outside, on its
    /// uplink).
    pub fn target(&self) -> &'static str {
        match self.to {
            Place::Workload(i) if self.v6 => WORKLOADS[i].5,
            Place::Workload(i) => WORKLOADS[i].4,
            Place::Node => NODE_UPLINK,
            Place::Outside => OUTSIDE,
        }
    }
}

impl std::fmt::Display for ProbeCase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let family = if self.v6 { "IPv6" } else { "IPv4" };
        write!(f, "{} → {} {family} {:?}", self.from, self.to, self.probe)
    }
}

/// Every probe a scenario is held to:
/// - each ordered pair of workloads: TCP 8080, 9090 and 7000, UDP 5353
///   and 6000 and a ping over IPv4; TCP 8080, UDP 5353 and a ping over
///   IPv6;
/// - the node to each workload (TCP 8080, both families);
/// - through the host endpoint: the outside to the node (TCP 8081, 8082
///   and 22, Felix's failsafe; UDP 5353; a ping), the outside to two
///   workloads (TCP 8080, forwarded), and the node to the outside (TCP
///   9000).
pub fn probes() -> Vec<ProbeCase> {
    use crate::lab::Probe;
    let mut out = Vec::new();
    let mut add = |from, to, v6, probe| {
        out.push(ProbeCase {
            from,
            to,
            v6,
            probe,
        })
    };
    let v4: Vec<Probe> = TCP_PORTS
        .iter()
        .map(|p| Probe::Tcp(*p))
        .chain(UDP_PORTS.iter().map(|p| Probe::Udp(*p)))
        .chain([Probe::Icmp])
        .collect();
    let v6 = [Probe::Tcp(8080), Probe::Udp(5353), Probe::Icmp];
    for from in 0..WORKLOADS.len() {
        for to in 0..WORKLOADS.len() {
            if from == to {
                continue;
            }
            for (is_v6, probes) in [(false, &v4[..]), (true, &v6[..])] {
                for probe in probes {
                    add(Place::Workload(from), Place::Workload(to), is_v6, *probe);
                }
            }
        }
    }
    for to in 0..WORKLOADS.len() {
        for v6 in [false, true] {
            add(Place::Node, Place::Workload(to), v6, Probe::Tcp(8080));
        }
    }
    for probe in NODE_TCP
        .iter()
        .map(|p| Probe::Tcp(*p))
        .chain(NODE_UDP.iter().map(|p| Probe::Udp(*p)))
        .chain([Probe::Icmp])
    {
        add(Place::Outside, Place::Node, false, probe);
    }
    for to in [0, 2] {
        add(Place::Outside, Place::Workload(to), false, Probe::Tcp(8080));
    }
    add(
        Place::Node,
        Place::Outside,
        false,
        Probe::Tcp(OUTSIDE_TCP[0]),
    );
    out
}

/// splitmix64: a small, seedable generator (the scenarios must be the same
/// on every machine and in every version of this crate's dependencies).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// In `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// A scenario: the resources to write (YAML for `calicoctl apply`) and the
/// policies to delete before the next one (YAML for `calicoctl delete`).
#[derive(Debug, Clone)]
pub struct Scenario {
    pub seed: u64,
    pub apply: String,
    pub policies: String,
}

const APPS: [&str; 3] = ["a", "b", "c"];
const ROLES: [Option<&str>; 3] = [Some("x"), Some("y"), None];

/// A label selector over the workloads' labels.
fn selector(r: &mut Rng) -> String {
    let app = *r.pick(&APPS);
    let other = *r.pick(&APPS);
    match r.below(9) {
        0 => format!("app == '{app}'"),
        1 => format!("app != '{app}'"),
        2 => "has(role)".into(),
        3 => "!has(role)".into(),
        4 => format!("app in {{'{app}', '{other}'}}"),
        5 => format!("app not in {{'{app}'}}"),
        6 => format!("role == 'x' && app == '{app}'"),
        7 => format!("app == '{app}' || role == 'y'"),
        _ => "all()".into(),
    }
}

/// A selector over the namespaces' labels (`env`, and the name Calico
/// gives every namespace).
fn ns_selector(r: &mut Rng) -> String {
    match r.below(4) {
        0 => "env == 'prod'".into(),
        1 => "env != 'prod'".into(),
        2 => format!("projectcalico.org/name == '{}'", r.pick(&["na", "nb"])),
        _ => "all()".into(),
    }
}

const CIDRS_V4: [&str; 6] = [
    "10.65.0.11/32",
    "10.65.0.13/32",
    "10.65.0.8/29",
    "10.65.0.12/30",
    "10.66.0.0/16",
    "10.65.0.14/31",
];
const CIDRS_V6: [&str; 4] = [
    "fd00:65::11/128",
    "fd00:65::8/125",
    "fd00:65::12/127",
    "fd00:66::/64",
];

/// The source or destination of a rule: `None` for none at all. Its CIDRs
/// are of the rule's family (Calico refuses a rule whose `ipVersion` and
/// CIDRs differ).
fn entity(r: &mut Rng, dest: bool, proto: Option<&str>, v6: bool) -> Option<String> {
    let cidrs: &[&str] = if v6 { &CIDRS_V6 } else { &CIDRS_V4 };
    let mut parts = Vec::new();
    match r.below(10) {
        0 | 1 => parts.push(format!("selector: \"{}\"", selector(r))),
        2 => parts.push(format!("namespaceSelector: \"{}\"", ns_selector(r))),
        3 => parts.push(format!(
            "serviceAccounts: {{names: [{}]}}",
            r.pick(&["sa1", "sa2"])
        )),
        4 => parts.push(format!("nets: ['{}']", r.pick(cidrs))),
        5 => parts.push(format!("notNets: ['{}']", r.pick(cidrs))),
        6 => parts.push(format!("notSelector: \"{}\"", selector(r))),
        7 => {
            parts.push(format!("selector: \"{}\"", selector(r)));
            parts.push(format!("namespaceSelector: \"{}\"", ns_selector(r)));
        }
        _ => {}
    }
    // Ports only with TCP or UDP, as Calico requires.
    if dest && matches!(proto, Some("TCP" | "UDP")) && r.chance(70) {
        let named = if proto == Some("TCP") { "http" } else { "dns" };
        let ports = match r.below(6) {
            0 => "[8080]".to_string(),
            1 => "[9090, 7000]".to_string(),
            2 => "['7000:8080']".to_string(),
            3 => format!("[{named}]"),
            4 => "[5353]".to_string(),
            _ => "[6000, 8080]".to_string(),
        };
        if r.chance(20) {
            parts.push(format!("notPorts: {ports}"));
        } else {
            parts.push(format!("ports: {ports}"));
        }
    }
    (!parts.is_empty()).then(|| format!("{{{}}}", parts.join(", ")))
}

fn rule(r: &mut Rng) -> String {
    let action = *r.pick(&["Allow", "Allow", "Allow", "Deny", "Deny", "Pass", "Log"]);
    let proto = match r.below(9) {
        0..=2 => Some("TCP"),
        3 | 4 => Some("UDP"),
        5 => Some("ICMP"),
        6 => Some("ICMPv6"),
        _ => None,
    };
    let mut parts = vec![format!("action: {action}")];
    if let Some(p) = proto {
        parts.push(format!("protocol: {p}"));
        if p.starts_with("ICMP") && r.chance(60) {
            // Echo request (what the probe sends), with and without its
            // code, or a type never sent (timestamp; echo reply).
            let icmp = if p == "ICMP" {
                *r.pick(&["{type: 8}", "{type: 8, code: 0}", "{type: 13}"])
            } else {
                *r.pick(&["{type: 128}", "{type: 128, code: 0}", "{type: 129}"])
            };
            if r.chance(25) {
                parts.push(format!("notICMP: {icmp}"));
            } else {
                parts.push(format!("icmp: {icmp}"));
            }
        }
    } else if r.chance(20) {
        parts.push(format!("notProtocol: {}", r.pick(&["TCP", "UDP"])));
    }
    // The family of the rule's CIDRs: ICMP is IPv4's, ICMPv6 IPv6's; and
    // sometimes the rule says it (`ipVersion`).
    let v6 = match proto {
        Some("ICMP") => false,
        Some("ICMPv6") => true,
        _ => r.chance(40),
    };
    if r.chance(15) {
        parts.push(format!("ipVersion: {}", if v6 { 6 } else { 4 }));
    }
    if let Some(s) = entity(r, false, proto, v6) {
        parts.push(format!("source: {s}"));
    }
    if let Some(d) = entity(r, true, proto, v6) {
        parts.push(format!("destination: {d}"));
    }
    format!("{{{}}}", parts.join(", "))
}

fn rules(r: &mut Rng) -> String {
    let n = 1 + r.below(3);
    let v: Vec<String> = (0..n).map(|_| rule(r)).collect();
    format!("[{}]", v.join(", "))
}

/// The node's host endpoint on [`UPLINK`], in zone `zone`.
pub fn host_endpoint(zone: &str) -> String {
    format!(
        "---\napiVersion: projectcalico.org/v3\nkind: HostEndpoint\n\
         metadata: {{name: node1-{UPLINK}, labels: {{role: edge, zone: {zone}}}}}\n\
         spec: {{node: node1, interfaceName: {UPLINK}, expectedIPs: ['{NODE_UPLINK}']}}\n"
    )
}

/// A policy for the host endpoint: normal (applied to forwarded traffic
/// or not), pre-DNAT (ingress) or untracked.
fn host_policy(r: &mut Rng, i: usize) -> String {
    // Only the host endpoint has a zone or the role edge: these select
    // no workload.
    let selector = *r.pick(&["has(zone)", "zone == 'a'", "zone == 'b'", "role == 'edge'"]);
    let kind = r.below(3);
    let (flags, types): (&str, &[&str]) = match kind {
        0 => (
            if r.chance(50) {
                "  applyOnForward: true\n"
            } else {
                ""
            },
            *r.pick(&[&["Ingress"][..], &["Egress"], &["Ingress", "Egress"]]),
        ),
        1 => ("  preDNAT: true\n  applyOnForward: true\n", &["Ingress"]),
        _ => (
            "  doNotTrack: true\n  applyOnForward: true\n",
            *r.pick(&[&["Ingress"][..], &["Egress"], &["Ingress", "Egress"]]),
        ),
    };
    let mut spec = format!(
        "  order: {}\n  selector: \"{selector}\"\n{flags}  types: [{}]\n",
        5 * (1 + r.below(4)),
        types.join(", ")
    );
    for t in types {
        let n = 1 + r.below(2);
        let rules: Vec<String> = (0..n).map(|_| host_rule(r, kind)).collect();
        spec += &format!("  {}: [{}]\n", t.to_lowercase(), rules.join(", "));
    }
    format!(
        "---\napiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\n\
         metadata: {{name: hep{i}}}\nspec:\n{spec}"
    )
}

fn host_rule(r: &mut Rng, kind: usize) -> String {
    // Pre-DNAT policy takes Allow and Deny only.
    let action = if kind == 1 {
        *r.pick(&["Allow", "Allow", "Deny"])
    } else {
        *r.pick(&["Allow", "Allow", "Deny", "Log"])
    };
    let mut parts = vec![format!("action: {action}")];
    let proto = *r.pick(&[Some("TCP"), Some("TCP"), Some("UDP"), Some("ICMP"), None]);
    if let Some(p) = proto {
        parts.push(format!("protocol: {p}"));
    }
    match r.below(4) {
        0 => parts.push(format!("source: {{nets: ['{OUTSIDE}/32']}}")),
        1 => parts.push("source: {notNets: ['192.168.77.0/30']}".into()),
        _ => {}
    }
    let mut dest = Vec::new();
    if r.chance(30) {
        dest.push(
            r.pick(&[
                "nets: ['10.65.0.8/29']",
                "nets: ['192.168.77.1/32']",
                "notNets: ['10.65.0.12/30']",
            ])
            .to_string(),
        );
    }
    if matches!(proto, Some("TCP" | "UDP")) && r.chance(70) {
        dest.push(
            r.pick(&[
                "ports: [8081]",
                "ports: [8082, 9000]",
                "ports: [8080]",
                "ports: [5353]",
                "ports: ['8000:8081']",
            ])
            .to_string(),
        );
    }
    if !dest.is_empty() {
        parts.push(format!("destination: {{{}}}", dest.join(", ")));
    }
    format!("{{{}}}", parts.join(", "))
}

/// A namespace's profile: its labels (`env`) and rules (Calico's
/// Kubernetes mode writes allow-all; scenarios vary them).
fn namespace(r: &mut Rng, ns: &str) -> String {
    let env = *r.pick(&["prod", "dev"]);
    let (ingress, egress) = match r.below(5) {
        0 => ("[{action: Deny}]", "[{action: Allow}]"),
        1 => ("[{action: Allow, protocol: TCP}]", "[{action: Allow}]"),
        2 => ("[]", "[{action: Allow}]"),
        _ => ("[{action: Allow}]", "[{action: Allow}]"),
    };
    format!(
        "---\napiVersion: projectcalico.org/v3\nkind: Profile\nmetadata: {{name: {ns}}}\n\
         spec:\n  labelsToApply: {{pcns.projectcalico.org/name: {ns}, env: {env}}}\n\
         \x20 ingress: {ingress}\n  egress: {egress}\n"
    )
}

/// The service accounts' profiles (`ksa.<ns>.<sa>`: only their label).
pub fn service_accounts() -> String {
    let mut y = String::new();
    for ns in ["na", "nb", "nm"] {
        for sa in ["sa1", "sa2"] {
            y += &format!(
                "---\napiVersion: projectcalico.org/v3\nkind: Profile\n\
                 metadata: {{name: ksa.{ns}.{sa}}}\n\
                 spec: {{labelsToApply: {{pcsa.projectcalico.org/name: {sa}}}}}\n"
            );
        }
    }
    y
}

/// A workload's endpoint (name, host interface, MAC suffix, addresses as
/// `'a/32', 'b/128'`) in namespace `ns`, with the given labels, service
/// account and named ports.
pub fn endpoint(
    ns: &str,
    (name, iface, mac, nets): (&str, &str, u8, &str),
    labels: &str,
    sa: &str,
    ports: &str,
) -> String {
    format!(
        "---\napiVersion: projectcalico.org/v3\nkind: WorkloadEndpoint\n\
         metadata: {{name: node1-k8s-{name}-eth0, namespace: {ns}, labels: {{{labels}\
         projectcalico.org/namespace: {ns}, projectcalico.org/serviceaccount: {sa}}}}}\n\
         spec: {{node: node1, orchestrator: k8s, pod: {name}, endpoint: eth0, \
         interfaceName: {iface}, mac: '02:00:00:00:00:{mac:02x}', ipNetworks: [{nets}], \
         profiles: [{ns}, ksa.{ns}.{sa}], serviceAccountName: {sa}, ports: [{ports}]}}\n"
    )
}

/// The marker policy of scenario `k` (see the module's header).
pub fn marker_policy(k: usize) -> String {
    format!(
        "---\napiVersion: projectcalico.org/v3\nkind: GlobalNetworkPolicy\n\
         metadata: {{name: marker.open}}\n\
         spec:\n  tier: marker\n  order: 1\n  selector: has(marker)\n  types: [Ingress, Egress]\n\
         \x20 ingress: [{{action: Allow, protocol: TCP, destination: {{ports: [{p}]}}}}]\n\
         \x20 egress: [{{action: Allow, protocol: TCP, destination: {{ports: [{p}]}}}}]\n",
        p = MARKER_PORTS[k % 2]
    )
}

/// What every scenario builds on, written once: the node, the pool, the
/// tiers (`marker` first, `sec` before `default`), the service accounts'
/// profiles and the marker pair's namespace and endpoints.
pub fn base() -> String {
    let mut y = String::from(
        "apiVersion: projectcalico.org/v3\nkind: Node\nmetadata: {name: node1}\n\
         spec: {bgp: {ipv4Address: 172.31.50.1/24, ipv6Address: 'fd00:50::1/64'}}\n\
         ---\napiVersion: projectcalico.org/v3\nkind: IPPool\nmetadata: {name: pool1}\n\
         spec: {cidr: 10.65.0.0/16, ipipMode: Never, vxlanMode: Never, natOutgoing: false}\n\
         ---\napiVersion: projectcalico.org/v3\nkind: IPPool\nmetadata: {name: pool6}\n\
         spec: {cidr: 'fd00:65::/64', ipipMode: Never, vxlanMode: Never, natOutgoing: false}\n\
         ---\napiVersion: projectcalico.org/v3\nkind: Tier\nmetadata: {name: marker}\n\
         spec: {order: 1}\n\
         ---\napiVersion: projectcalico.org/v3\nkind: Tier\nmetadata: {name: sec}\n\
         spec: {order: 50}\n\
         ---\napiVersion: projectcalico.org/v3\nkind: Profile\nmetadata: {name: nm}\n\
         spec:\n  labelsToApply: {pcns.projectcalico.org/name: nm}\n\
         \x20 ingress: [{action: Allow}]\n  egress: [{action: Allow}]\n",
    );
    y += &service_accounts();
    for (name, iface, mac, ip, ip6) in MARKER {
        let nets = format!("'{ip}/32', '{ip6}/128'");
        y += &endpoint(
            "nm",
            (name, iface, mac, &nets),
            "marker: 'yes', ",
            "sa1",
            "",
        );
    }
    y
}

/// Scenario `seed`; `k` is its place in the run (the marker's port).
pub fn scenario(seed: u64, k: usize) -> Scenario {
    let mut r = Rng::new(seed);
    let mut apply = String::new();
    apply += &namespace(&mut r, "na");
    apply += &namespace(&mut r, "nb");
    for (name, ns, iface, mac, ip, ip6) in WORKLOADS {
        let mut labels = format!("app: {}, ", r.pick(&APPS));
        if let Some(role) = r.pick(&ROLES) {
            labels += &format!("role: {role}, ");
        }
        let sa = *r.pick(&["sa1", "sa2"]);
        let ports = format!(
            "{{name: http, protocol: TCP, port: {}}}, {{name: dns, protocol: UDP, port: {}}}",
            r.pick(&[8080, 9090]),
            r.pick(&[5353, 6000])
        );
        let nets = format!("'{ip}/32', '{ip6}/128'");
        apply += &endpoint(ns, (name, iface, mac, &nets), &labels, sa, &ports);
    }
    let default_action = *r.pick(&["Deny", "Pass"]);
    apply += &format!(
        "---\napiVersion: projectcalico.org/v3\nkind: Tier\nmetadata: {{name: sec}}\n\
         spec: {{order: 50, defaultAction: {default_action}}}\n"
    );
    // The host endpoint's part draws from a stream of its own: a seed
    // keeps the workloads' scenario it had before host endpoints came in
    // (the regression seeds).
    let mut h = Rng::new(seed ^ 0x4845_5000_0000_0000);
    let zone = *h.pick(&["a", "b"]);
    apply += &host_endpoint(zone);
    let mut policies = String::new();
    for i in 0..h.below(3) {
        policies += &host_policy(&mut h, i);
    }
    for i in 0..1 + r.below(4) {
        let tier = if r.chance(40) { "sec" } else { "default" };
        let name = if tier == "default" {
            format!("p{i}")
        } else {
            format!("sec.p{i}")
        };
        let (kind, meta) = if r.chance(60) {
            ("GlobalNetworkPolicy", format!("{{name: {name}}}"))
        } else {
            let ns = *r.pick(&["na", "nb"]);
            (
                "NetworkPolicy",
                format!("{{name: {name}, namespace: {ns}}}"),
            )
        };
        let types: &[&str] = match r.below(3) {
            0 => &["Ingress"],
            1 => &["Egress"],
            _ => &["Ingress", "Egress"],
        };
        let mut spec = format!(
            "  tier: {tier}\n  order: {}\n  selector: \"{}\"\n  types: [{}]\n",
            10 * (1 + r.below(5)),
            selector(&mut r),
            types.join(", ")
        );
        for t in types {
            let key = t.to_lowercase();
            spec += &format!("  {key}: {}\n", rules(&mut r));
        }
        policies += &format!(
            "---\napiVersion: projectcalico.org/v3\nkind: {kind}\nmetadata: {meta}\nspec:\n{spec}"
        );
    }
    apply += &policies;
    apply += &marker_policy(k);
    Scenario {
        seed,
        apply,
        policies,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_makes_the_same_scenario_and_seeds_differ() {
        assert_eq!(scenario(7, 0).apply, scenario(7, 0).apply);
        assert_ne!(scenario(7, 0).apply, scenario(8, 0).apply);
        // Only the marker's port follows the place in the run.
        assert_eq!(
            scenario(7, 0).apply.replace("20001", "20002"),
            scenario(7, 1).apply
        );
    }

    #[test]
    fn the_scenarios_draw_on_every_kind_of_match() {
        let all: String = (0..200).map(|s| scenario(s, 0).apply).collect();
        for what in [
            "namespaceSelector",
            "serviceAccounts",
            "notNets",
            "nets:",
            "notPorts",
            "[http]",
            "[dns]",
            "'7000:8080'",
            "icmp: {type: 8, code: 0}",
            "protocol: ICMPv6",
            "icmp: {type: 128}",
            "ipVersion: 6",
            "preDNAT: true",
            "doNotTrack: true",
            "applyOnForward: true",
            "kind: HostEndpoint",
            "fd00:65::8/125",
            "notICMP",
            "notProtocol",
            "notSelector",
            "has(role)",
            "not in",
            "action: Pass",
            "action: Log",
            "defaultAction: Pass",
            "kind: NetworkPolicy",
            "tier: sec",
            "types: [Ingress, Egress]",
        ] {
            assert!(all.contains(what), "no scenario of 200 has {what}");
        }
    }

    #[test]
    fn every_pair_is_probed_in_every_way() {
        let p = probes();
        // 4 × 3 pairs × (6 IPv4 + 3 IPv6) probes, the node to each
        // workload over both, and 8 through the host endpoint.
        assert_eq!(p.len(), 12 * 9 + 8 + 8);
        assert!(p.iter().all(|c| c.from != c.to));
    }
}
