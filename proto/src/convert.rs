//! `felix::ToDataplane` → `model::Update`, validating every field that can
//! reach a kernel command. An error names the offending field as a dotted
//! path (`ipset_update.members[3]`) and nothing of the message is used.

use dphandler_dataplane::model::network::{
    EncapMode, Encapsulation, GlobalBgpConfig, IpamPool, Route, Service, Vtep, WireguardEndpoint,
};
use dphandler_dataplane::model::{
    Action, EndpointState, HostEndpoint, HostEndpointId, HostInterface, IcmpMatch, Id, IfaceName,
    IpSet, IpSetDelta, IpSetType, IpVersion, Key, MacAddr, Member, Policy, PolicyId, PortRange,
    Profile, Protocol, Rule, TierDefault, TierInfo, Update, Valid, ValidationError,
    WorkloadEndpoint, WorkloadEndpointId, check_text, parse_ip, parse_ip_opt, parse_net,
};

use crate::felix::{self, to_dataplane::Payload};

/// Largest number of members one IPSetUpdate may carry (Felix's
/// MaxIpsetSize default).
pub const MAX_IPSET_MEMBERS: usize = 1_048_576;
const MAX_LABEL: usize = 63 * 1024;

/// A message that could not be converted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("message {sequence_number}: {error}")]
pub struct Rejected {
    pub sequence_number: u64,
    #[source]
    pub error: ValidationError,
}

/// Convert one message on its own. `Ok(None)` for a message with no
/// payload (ignored, as Felix ignores unknown payloads). A stream's
/// messages go through a [`Converter`], which also puts together what a
/// released Felix sends of a host in pieces.
pub fn to_update(msg: felix::ToDataplane) -> Result<Option<Update>, Rejected> {
    let seq = msg.sequence_number;
    let Some(payload) = msg.payload else {
        return Ok(None);
    };
    convert_payload(payload)
        .map(Some)
        .map_err(|error| Rejected {
            sequence_number: seq,
            error,
        })
}

/// Converts one stream's messages, in order.
///
/// Master's Felix sends a host whole (`HostMetadataUpdate`, both families
/// in CIDR form, AS number, labels). A released Felix (v3.31, v3.32) sends
/// it in three messages: `HostMetadataUpdate` with the IPv4 address alone,
/// `HostMetadataV6Update` with the IPv6 address, and
/// `HostMetadataV4V6Update` with the addresses of the Node's BGP spec, AS
/// number and labels; each has its own remove. The managers want the host
/// whole, so this keeps each host's pieces and turns every piece's update
/// or remove into the whole host as it now stands (or its removal once no
/// piece is left): a released Felix's IPv6 host addresses are not lost, and
/// one piece's update never erases another's.
#[derive(Debug, Default)]
pub struct Converter {
    hosts: hosts::Pieces,
}

impl Converter {
    pub fn convert(&mut self, msg: felix::ToDataplane) -> Result<Option<Update>, Rejected> {
        let seq = msg.sequence_number;
        let Some(payload) = msg.payload else {
            return Ok(None);
        };
        let piece = hosts::Piece::of(&payload);
        let update = convert_payload(payload).map_err(|error| Rejected {
            sequence_number: seq,
            error,
        })?;
        Ok(Some(match piece {
            Some(piece) => self.hosts.merge(piece, update),
            None => update,
        }))
    }
}

fn at<T>(r: Valid<T>, field: &str) -> Valid<T> {
    r.map_err(|e| e.within(field))
}

/// [`at`] for the `i`-th element of a list; the path is only formatted when
/// there is an error (this is the hot path of every message).
fn at_index<T>(r: Valid<T>, field: &str, i: usize) -> Valid<T> {
    r.map_err(|e| e.within(&format!("{field}[{i}]")))
}

fn id(s: &str, field: &str) -> Valid<Id> {
    at(Id::new(s), field)
}

fn opt_id(s: &str, field: &str) -> Valid<Option<Id>> {
    at(Id::optional(s), field)
}

fn list<T>(items: &[String], field: &str, f: impl Fn(&str) -> Valid<T>) -> Valid<Vec<T>> {
    items
        .iter()
        .enumerate()
        .map(|(i, s)| f(s).map_err(|e| e.within(&format!("[{i}]")).within(field)))
        .collect()
}

fn labels<'a>(
    map: impl IntoIterator<Item = (&'a String, &'a String)>,
    field: &str,
) -> Valid<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = map
        .into_iter()
        .map(|(k, v)| {
            at(check_text(k, 317), field)?;
            at(check_text(v, MAX_LABEL), field)?;
            Ok((k.clone(), v.clone()))
        })
        .collect::<Valid<_>>()?;
    out.sort();
    Ok(out)
}

fn policy_id(p: &felix::PolicyId) -> Valid<PolicyId> {
    Ok(PolicyId {
        name: id(&p.name, "name")?,
        namespace: opt_id(&p.namespace, "namespace")?,
        kind: opt_id(&p.kind, "kind")?,
    })
}

fn wep_id(w: &felix::WorkloadEndpointId) -> Valid<WorkloadEndpointId> {
    Ok(WorkloadEndpointId {
        orchestrator: id(&w.orchestrator_id, "orchestrator_id")?,
        workload: id(&w.workload_id, "workload_id")?,
        endpoint: id(&w.endpoint_id, "endpoint_id")?,
    })
}

fn required<'a, T>(v: &'a Option<T>, field: &str) -> Valid<&'a T> {
    v.as_ref()
        .ok_or_else(|| ValidationError::new(field, "is required"))
}

fn convert_payload(p: Payload) -> Valid<Update> {
    Ok(match p {
        Payload::InSync(_) => Update::InSync,
        Payload::IpsetUpdate(u) => at(ipset_update(&u), "ipset_update")?,
        Payload::IpsetDeltaUpdate(u) => at(
            (|| {
                Ok(Update::IpSetDeltaUpdate(IpSetDelta {
                    id: id(&u.id, "id")?,
                    added: list(&u.added_members, "added_members", Member::parse_any)?,
                    removed: list(&u.removed_members, "removed_members", Member::parse_any)?,
                }))
            })(),
            "ipset_delta_update",
        )?,
        Payload::IpsetRemove(u) => Update::Remove(Key::IpSet(id(&u.id, "ipset_remove.id")?)),
        Payload::ActiveProfileUpdate(u) => at(
            (|| {
                let pid = id(&required(&u.id, "id")?.name, "id.name")?;
                let p = u.profile.clone().unwrap_or_default();
                Ok(Update::Profile(
                    pid,
                    Profile {
                        inbound_rules: rules(&p.inbound_rules, "profile.inbound_rules")?,
                        outbound_rules: rules(&p.outbound_rules, "profile.outbound_rules")?,
                    },
                ))
            })(),
            "active_profile_update",
        )?,
        Payload::ActiveProfileRemove(u) => Update::Remove(Key::Profile(id(
            &required(&u.id, "active_profile_remove.id")?.name,
            "active_profile_remove.id.name",
        )?)),
        Payload::ActivePolicyUpdate(u) => at(
            (|| {
                let raw_id = required(&u.id, "id")?;
                let pid = at(policy_id(raw_id), "id")?;
                let p = u.policy.clone().unwrap_or_default();
                // A released Felix names the tier in the id, master in the policy.
                let tier = if p.tier.is_empty() {
                    at(Id::optional(&raw_id.tier), "id.tier")?
                } else {
                    opt_id(&p.tier, "policy.tier")?
                };
                if p.untracked && p.pre_dnat {
                    return Err(ValidationError::new(
                        "policy",
                        "a policy cannot be both untracked and pre_dnat",
                    ));
                }
                Ok(Update::Policy(
                    pid,
                    Policy {
                        namespace: opt_id(&p.namespace, "policy.namespace")?,
                        tier,
                        inbound_rules: rules(&p.inbound_rules, "policy.inbound_rules")?,
                        outbound_rules: rules(&p.outbound_rules, "policy.outbound_rules")?,
                        untracked: p.untracked,
                        pre_dnat: p.pre_dnat,
                    },
                ))
            })(),
            "active_policy_update",
        )?,
        Payload::ActivePolicyRemove(u) => Update::Remove(Key::Policy(at(
            policy_id(required(&u.id, "active_policy_remove.id")?),
            "active_policy_remove.id",
        )?)),
        Payload::HostEndpointUpdate(u) => at(host_endpoint(&u), "host_endpoint_update")?,
        Payload::HostEndpointRemove(u) => Update::Remove(Key::HostEndpoint(HostEndpointId(id(
            &required(&u.id, "host_endpoint_remove.id")?.endpoint_id,
            "host_endpoint_remove.id.endpoint_id",
        )?))),
        Payload::WorkloadEndpointUpdate(u) => {
            at(workload_endpoint(&u), "workload_endpoint_update")?
        }
        Payload::WorkloadEndpointRemove(u) => Update::Remove(Key::WorkloadEndpoint(at(
            wep_id(required(&u.id, "workload_endpoint_remove.id")?),
            "workload_endpoint_remove.id",
        )?)),
        Payload::ConfigUpdate(u) => Update::Config(labels(&u.config, "config_update.config")?),
        Payload::HostMetadataUpdate(u) => hosts::update(
            &u.hostname,
            &u.ipv4_addr,
            &u.ipv6_addr,
            &u.asnumber,
            &u.labels,
            "host_metadata_update",
        )?,
        Payload::HostMetadataRemove(u) => hosts::remove(&u.hostname, "host_metadata_remove")?,
        // A released Felix's pieces of a host, each on its own (a stream's
        // `Converter` puts them together).
        Payload::HostMetadataV6Update(u) => hosts::update(
            &u.hostname,
            "",
            &u.ipv6_addr,
            "",
            &Default::default(),
            "host_metadata_v6_update",
        )?,
        Payload::HostMetadataV4v6Update(u) => hosts::update(
            &u.hostname,
            &u.ipv4_addr,
            &u.ipv6_addr,
            &u.asnumber,
            &u.labels,
            "host_metadata_v4v6_update",
        )?,
        Payload::HostMetadataV6Remove(u) => hosts::remove(&u.hostname, "host_metadata_v6_remove")?,
        Payload::HostMetadataV4v6Remove(u) => {
            hosts::remove(&u.hostname, "host_metadata_v4v6_remove")?
        }
        Payload::IpamPoolUpdate(u) => at(
            (|| {
                let pool = required(&u.pool, "pool")?;
                Ok(Update::IpamPool(
                    id(&u.id, "id")?,
                    IpamPool {
                        cidr: at(parse_net(&pool.cidr), "pool.cidr")?,
                        masquerade: pool.masquerade,
                        ipip_mode: at(EncapMode::parse(&pool.ipip_mode), "pool.ipip_mode")?,
                        vxlan_mode: at(EncapMode::parse(&pool.vxlan_mode), "pool.vxlan_mode")?,
                        allowed_uses: list(&pool.allowed_uses, "pool.allowed_uses", Id::new)?,
                    },
                ))
            })(),
            "ipam_pool_update",
        )?,
        Payload::IpamPoolRemove(u) => {
            Update::Remove(Key::IpamPool(id(&u.id, "ipam_pool_remove.id")?))
        }
        Payload::ServiceAccountUpdate(u) => {
            let sid = required(&u.id, "service_account_update.id")?;
            Update::ServiceAccount {
                namespace: id(&sid.namespace, "service_account_update.id.namespace")?,
                name: id(&sid.name, "service_account_update.id.name")?,
                labels: labels(&u.labels, "service_account_update.labels")?,
            }
        }
        Payload::ServiceAccountRemove(u) => {
            let sid = required(&u.id, "service_account_remove.id")?;
            Update::Remove(Key::ServiceAccount {
                namespace: id(&sid.namespace, "service_account_remove.id.namespace")?,
                name: id(&sid.name, "service_account_remove.id.name")?,
            })
        }
        Payload::NamespaceUpdate(u) => Update::Namespace {
            name: id(
                &required(&u.id, "namespace_update.id")?.name,
                "namespace_update.id.name",
            )?,
            labels: labels(&u.labels, "namespace_update.labels")?,
        },
        Payload::NamespaceRemove(u) => Update::Remove(Key::Namespace(id(
            &required(&u.id, "namespace_remove.id")?.name,
            "namespace_remove.id.name",
        )?)),
        Payload::RouteUpdate(u) => at(
            (|| {
                let t = u.tunnel_type.unwrap_or_default();
                Ok(Update::Route(Route {
                    types: u32::try_from(u.types).map_err(|_| {
                        ValidationError::new(
                            "types",
                            format!("{} is not a route type mask", u.types),
                        )
                    })?,
                    ip_pool_type: u.ip_pool_type,
                    dst: at(parse_net(&u.dst), "dst")?,
                    dst_node_name: opt_id(&u.dst_node_name, "dst_node_name")?,
                    dst_node_ip: at(parse_ip_opt(&u.dst_node_ip), "dst_node_ip")?,
                    same_subnet: u.same_subnet,
                    nat_outgoing: u.nat_outgoing,
                    local_workload: u.local_workload,
                    ipip: t.ipip,
                    vxlan: t.vxlan,
                    wireguard: t.wireguard,
                    borrowed: u.borrowed,
                }))
            })(),
            "route_update",
        )?,
        Payload::RouteRemove(u) => {
            Update::Remove(Key::Route(at(parse_net(&u.dst), "route_remove.dst")?))
        }
        Payload::VtepUpdate(u) => at(
            (|| {
                Ok(Update::Vtep(Vtep {
                    node: id(&u.node, "node")?,
                    mac: opt_mac(&u.mac, "mac")?,
                    ipv4_addr: at(parse_ip_opt(&u.ipv4_addr).and_then(v4), "ipv4_addr")?,
                    parent_device_ip: at(
                        parse_ip_opt(&u.parent_device_ip).and_then(v4),
                        "parent_device_ip",
                    )?,
                    mac_v6: opt_mac(&u.mac_v6, "mac_v6")?,
                    ipv6_addr: at(parse_ip_opt(&u.ipv6_addr).and_then(v6), "ipv6_addr")?,
                    parent_device_ipv6: at(
                        parse_ip_opt(&u.parent_device_ipv6).and_then(v6),
                        "parent_device_ipv6",
                    )?,
                }))
            })(),
            "vtep_update",
        )?,
        Payload::VtepRemove(u) => Update::Remove(Key::Vtep(id(&u.node, "vtep_remove.node")?)),
        Payload::WireguardEndpointUpdate(u) => Update::WireguardEndpoint(at(
            wg_endpoint(&u.hostname, &u.public_key, &u.interface_ipv4_addr, v4),
            "wireguard_endpoint_update",
        )?),
        Payload::WireguardEndpointRemove(u) => Update::Remove(Key::WireguardEndpoint(id(
            &u.hostname,
            "wireguard_endpoint_remove.hostname",
        )?)),
        Payload::WireguardEndpointV6Update(u) => Update::WireguardEndpointV6(at(
            wg_endpoint(&u.hostname, &u.public_key_v6, &u.interface_ipv6_addr, v6),
            "wireguard_endpoint_v6_update",
        )?),
        Payload::WireguardEndpointV6Remove(u) => Update::Remove(Key::WireguardEndpointV6(id(
            &u.hostname,
            "wireguard_endpoint_v6_remove.hostname",
        )?)),
        Payload::GlobalBgpConfigUpdate(u) => Update::GlobalBgpConfig(at(
            (|| {
                Ok(GlobalBgpConfig {
                    service_cluster_cidrs: list(
                        &u.service_cluster_cidrs,
                        "service_cluster_cidrs",
                        parse_net,
                    )?,
                    service_external_cidrs: list(
                        &u.service_external_cidrs,
                        "service_external_cidrs",
                        parse_net,
                    )?,
                    service_loadbalancer_cidrs: list(
                        &u.service_loadbalancer_cidrs,
                        "service_loadbalancer_cidrs",
                        parse_net,
                    )?,
                    local_workload_peering_ip_v4: at(
                        parse_ip_opt(&u.local_workload_peering_ip_v4),
                        "local_workload_peering_ip_v4",
                    )?,
                    local_workload_peering_ip_v6: at(
                        parse_ip_opt(&u.local_workload_peering_ip_v6),
                        "local_workload_peering_ip_v6",
                    )?,
                })
            })(),
            "global_bgp_config_update",
        )?),
        Payload::Encapsulation(u) => Update::Encapsulation(Encapsulation {
            ipip_enabled: u.ipip_enabled,
            vxlan_enabled: u.vxlan_enabled,
            vxlan_enabled_v6: u.vxlan_enabled_v6,
            no_encap_enabled: u.no_encap_enabled,
        }),
        Payload::ServiceUpdate(u) => at(
            (|| {
                Ok(Update::Service(Service {
                    name: id(&u.name, "name")?,
                    namespace: id(&u.namespace, "namespace")?,
                    service_type: opt_id(&u.r#type, "type")?,
                    cluster_ips: list(&u.cluster_ips, "cluster_ips", parse_ip)?,
                    loadbalancer_ip: at(parse_ip_opt(&u.loadbalancer_ip), "loadbalancer_ip")?,
                    external_ips: list(&u.external_ips, "external_ips", parse_ip)?,
                    loadbalancer_ingress_ips: list(
                        &u.loadbalancer_ingress_ips,
                        "loadbalancer_ingress_ips",
                        parse_ip,
                    )?,
                    ports: u
                        .ports
                        .iter()
                        .enumerate()
                        .map(|(i, p)| {
                            at_index(
                                (|| {
                                    let proto = Protocol::from_name(&p.protocol)?;
                                    let port = at(PortRange::new(p.port, 0), "Port")?.first;
                                    let node =
                                        at(PortRange::new(p.node_port, 0), "NodePort")?.first;
                                    Ok((proto, port, node))
                                })(),
                                "ports",
                                i,
                            )
                        })
                        .collect::<Valid<_>>()?,
                }))
            })(),
            "service_update",
        )?,
        Payload::ServiceRemove(u) => Update::Remove(Key::Service {
            namespace: id(&u.namespace, "service_remove.namespace")?,
            name: id(&u.name, "service_remove.name")?,
        }),
    })
}

fn ipset_update(u: &felix::IpSetUpdate) -> Valid<Update> {
    let set_type = match felix::ip_set_update::IpSetType::try_from(u.r#type) {
        Ok(felix::ip_set_update::IpSetType::Ip) => IpSetType::Ip,
        Ok(felix::ip_set_update::IpSetType::Net) => IpSetType::Net,
        Ok(felix::ip_set_update::IpSetType::IpAndPort) => IpSetType::IpAndPort,
        Err(_) => {
            return Err(ValidationError::new(
                "type",
                format!("unknown IP set type {}", u.r#type),
            ));
        }
    };
    if u.members.len() > MAX_IPSET_MEMBERS {
        return Err(ValidationError::new(
            "members",
            format!(
                "{} members; at most {MAX_IPSET_MEMBERS} allowed",
                u.members.len()
            ),
        ));
    }
    Ok(Update::IpSetUpdate(IpSet {
        id: id(&u.id, "id")?,
        set_type,
        members: list(&u.members, "members", |m| Member::parse(set_type, m))?,
    }))
}

fn host_addr(s: &str) -> Valid<Option<std::net::IpAddr>> {
    // Felix sends the host's address bare or with its prefix length.
    // The host bits are the point here, so this is not a parse_net.
    if s.contains('/') {
        s.parse::<ipnet::IpNet>()
            .map(|n| Some(n.addr()))
            .map_err(|_| ValidationError::new("", format!("{s:?} is not an address/prefix")))
    } else {
        parse_ip_opt(s)
    }
}

fn opt_mac(s: &str, field: &str) -> Valid<Option<MacAddr>> {
    if s.is_empty() {
        Ok(None)
    } else {
        at(MacAddr::parse(s), field).map(Some)
    }
}

/// An address given for IPv4 must be one (and [`v6`] for IPv6): a VTEP or
/// a WireGuard peer of the wrong family would be programmed into the other
/// family's routes.
fn v4(a: Option<std::net::IpAddr>) -> Valid<Option<std::net::IpAddr>> {
    match a {
        Some(ip @ std::net::IpAddr::V6(_)) => Err(ValidationError::new(
            "",
            format!("{ip} is not an IPv4 address"),
        )),
        a => Ok(a),
    }
}

fn v6(a: Option<std::net::IpAddr>) -> Valid<Option<std::net::IpAddr>> {
    match a {
        Some(ip @ std::net::IpAddr::V4(_)) => Err(ValidationError::new(
            "",
            format!("{ip} is not an IPv6 address"),
        )),
        a => Ok(a),
    }
}

fn wg_endpoint(
    host: &str,
    key: &str,
    addr: &str,
    family: fn(Option<std::net::IpAddr>) -> Valid<Option<std::net::IpAddr>>,
) -> Valid<WireguardEndpoint> {
    Ok(WireguardEndpoint {
        hostname: id(host, "hostname")?,
        public_key: if key.is_empty() {
            None
        } else {
            Some(at(wg_key(key), "public_key")?)
        },
        interface_addr: at(parse_ip_opt(addr).and_then(family), "interface_addr")?,
    })
}

/// A WireGuard key: standard base64 of 32 bytes (44 characters).
fn wg_key(s: &str) -> Valid<[u8; 32]> {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bad = || {
        ValidationError::new(
            "",
            format!("{s:?} is not a base64 WireGuard key (44 characters)"),
        )
    };
    let b = s.as_bytes();
    if b.len() != 44 || b[43] != b'=' {
        return Err(bad());
    }
    let mut bits: u32 = 0;
    let mut nbits = 0;
    let mut out = Vec::with_capacity(32);
    for &c in &b[..43] {
        let v = ALPHABET.iter().position(|&a| a == c).ok_or_else(bad)? as u32;
        bits = (bits << 6) | v;
        nbits += 6;
        if nbits >= 8 {
            nbits -= 8;
            out.push((bits >> nbits) as u8);
            bits &= (1 << nbits) - 1;
        }
    }
    out.try_into().map_err(|_| bad())
}

fn tiers(ts: &[felix::TierInfo], field: &str) -> Valid<Vec<TierInfo>> {
    let mut seen = std::collections::HashSet::new();
    ts.iter()
        .enumerate()
        .map(|(i, t)| {
            at_index(
                (|| {
                    // A tier twice would be evaluated twice, its chains
                    // named twice: Felix's calc graph never sends it.
                    if !seen.insert(t.name.as_str()) {
                        return Err(ValidationError::new(
                            "name",
                            format!("tier {:?} is listed twice", t.name),
                        ));
                    }
                    Ok(TierInfo {
                        name: id(&t.name, "name")?,
                        ingress_policies: policy_ids(&t.ingress_policies, "ingress_policies")?,
                        egress_policies: policy_ids(&t.egress_policies, "egress_policies")?,
                        default_action: at(
                            TierDefault::parse(&t.default_action),
                            "default_action",
                        )?,
                    })
                })(),
                field,
                i,
            )
        })
        .collect()
}

fn policy_ids(ps: &[felix::PolicyId], field: &str) -> Valid<Vec<PolicyId>> {
    ps.iter()
        .enumerate()
        .map(|(i, p)| at_index(policy_id(p), field, i))
        .collect()
}

fn workload_endpoint(u: &felix::WorkloadEndpointUpdate) -> Valid<Update> {
    let wid = at(wep_id(required(&u.id, "id")?), "id")?;
    let e = required(&u.endpoint, "endpoint")?;
    let nat = |ns: &[felix::NatInfo], field: &str| -> Valid<Vec<_>> {
        ns.iter()
            .enumerate()
            .map(|(i, n)| {
                at_index(
                    (|| {
                        Ok((
                            at(parse_ip(&n.ext_ip), "ext_ip")?,
                            at(parse_ip(&n.int_ip), "int_ip")?,
                        ))
                    })(),
                    field,
                    i,
                )
            })
            .collect()
    };
    let ep = at(
        (|| {
            Ok(WorkloadEndpoint {
                state: at(EndpointState::parse(&e.state), "state")?,
                name: at(IfaceName::new(&e.name), "name")?,
                mac: opt_mac(&e.mac, "mac")?,
                profile_ids: list(&e.profile_ids, "profile_ids", Id::new)?,
                ipv4_nets: list(&e.ipv4_nets, "ipv4_nets", |s| match parse_net(s)? {
                    ipnet::IpNet::V4(n) => Ok(n),
                    ipnet::IpNet::V6(_) => {
                        Err(ValidationError::new("", format!("{s} is not IPv4")))
                    }
                })?,
                ipv6_nets: list(&e.ipv6_nets, "ipv6_nets", |s| match parse_net(s)? {
                    ipnet::IpNet::V6(n) => Ok(n),
                    ipnet::IpNet::V4(_) => {
                        Err(ValidationError::new("", format!("{s} is not IPv6")))
                    }
                })?,
                tiers: tiers(&e.tiers, "tiers")?,
                ipv4_nat: nat(&e.ipv4_nat, "ipv4_nat")?,
                ipv6_nat: nat(&e.ipv6_nat, "ipv6_nat")?,
                allow_spoofed_source_prefixes: list(
                    &e.allow_spoofed_source_prefixes,
                    "allow_spoofed_source_prefixes",
                    parse_net,
                )?,
            })
        })(),
        "endpoint",
    )?;
    Ok(Update::WorkloadEndpoint(wid, ep))
}

fn host_endpoint(u: &felix::HostEndpointUpdate) -> Valid<Update> {
    let hid = HostEndpointId(id(&required(&u.id, "id")?.endpoint_id, "id.endpoint_id")?);
    let e = required(&u.endpoint, "endpoint")?;
    let ep = at(
        (|| {
            Ok(HostEndpoint {
                interface: match e.name.as_str() {
                    "" => HostInterface::ByAddress,
                    "*" => HostInterface::All,
                    name => HostInterface::Named(at(IfaceName::new(name), "name")?),
                },
                profile_ids: list(&e.profile_ids, "profile_ids", Id::new)?,
                tiers: tiers(&e.tiers, "tiers")?,
                untracked_tiers: tiers(&e.untracked_tiers, "untracked_tiers")?,
                pre_dnat_tiers: tiers(&e.pre_dnat_tiers, "pre_dnat_tiers")?,
                forward_tiers: tiers(&e.forward_tiers, "forward_tiers")?,
                expected_ipv4_addrs: list(&e.expected_ipv4_addrs, "expected_ipv4_addrs", |s| {
                    v4(Some(parse_ip(s)?)).map(|a| a.expect("given"))
                })?,
                expected_ipv6_addrs: list(&e.expected_ipv6_addrs, "expected_ipv6_addrs", |s| {
                    v6(Some(parse_ip(s)?)).map(|a| a.expect("given"))
                })?,
            })
        })(),
        "endpoint",
    )?;
    Ok(Update::HostEndpoint(hid, ep))
}

fn rules(rs: &[felix::Rule], field: &str) -> Valid<Vec<Rule>> {
    rs.iter()
        .enumerate()
        .map(|(i, r)| at_index(rule(r), field, i))
        .collect()
}

fn protocol(p: &Option<felix::Protocol>, field: &str) -> Valid<Option<Protocol>> {
    use felix::protocol::NumberOrName;
    let Some(p) = p else { return Ok(None) };
    at(
        match &p.number_or_name {
            None => return Ok(None),
            Some(NumberOrName::Number(n)) => Protocol::from_number(*n),
            Some(NumberOrName::Name(s)) => Protocol::from_name(s),
        }
        .map(Some),
        field,
    )
}

fn ports(ps: &[felix::PortRange], field: &str) -> Valid<Vec<PortRange>> {
    ps.iter()
        .enumerate()
        .map(|(i, p)| at_index(PortRange::new(p.first, p.last), field, i))
        .collect()
}

fn rule(r: &felix::Rule) -> Valid<Rule> {
    use felix::rule::{Icmp, NotIcmp};
    let icmp = |i: Option<(i32, Option<i32>)>, field: &str| {
        i.map(|(t, c)| at(IcmpMatch::new(t, c), field)).transpose()
    };
    let mut unsupported = Vec::new();
    if r.http_match.is_some() {
        unsupported.push("http_match");
    }
    // A service-account match is not one: Felix's calc graph has already
    // folded it into the rule's IP sets (libcalico-go's
    // `GetEntityRuleSelector`: namespace, label and service-account
    // selectors in one), and sends it besides only for the application
    // layer (Dikastes); Felix's own iptables and nftables ignore it, and so
    // do we. (Refusing it dropped a real Felix's allow by service account.)
    let ids = |v: &[String], f: &str| list(v, f, Id::new);
    let out = Rule {
        action: Some(at(Action::parse(&r.action), "action")?),
        ip_version: match model_ip_version(r.ip_version) {
            Ok(v) => v,
            Err(e) => return Err(e.within("ip_version")),
        },
        protocol: protocol(&r.protocol, "protocol")?,
        src_net: list(&r.src_net, "src_net", parse_net)?,
        src_ports: ports(&r.src_ports, "src_ports")?,
        src_named_port_ip_set_ids: ids(&r.src_named_port_ip_set_ids, "src_named_port_ip_set_ids")?,
        dst_net: list(&r.dst_net, "dst_net", parse_net)?,
        dst_ports: ports(&r.dst_ports, "dst_ports")?,
        dst_named_port_ip_set_ids: ids(&r.dst_named_port_ip_set_ids, "dst_named_port_ip_set_ids")?,
        icmp: icmp(
            r.icmp.as_ref().map(|i| match i {
                Icmp::IcmpType(t) => (*t, None),
                Icmp::IcmpTypeCode(tc) => (tc.r#type, Some(tc.code)),
            }),
            "icmp_type",
        )?,
        src_ip_set_ids: ids(&r.src_ip_set_ids, "src_ip_set_ids")?,
        dst_ip_set_ids: ids(&r.dst_ip_set_ids, "dst_ip_set_ids")?,
        dst_ip_port_set_ids: ids(&r.dst_ip_port_set_ids, "dst_ip_port_set_ids")?,
        not_protocol: protocol(&r.not_protocol, "not_protocol")?,
        not_src_net: list(&r.not_src_net, "not_src_net", parse_net)?,
        not_src_ports: ports(&r.not_src_ports, "not_src_ports")?,
        not_dst_net: list(&r.not_dst_net, "not_dst_net", parse_net)?,
        not_dst_ports: ports(&r.not_dst_ports, "not_dst_ports")?,
        not_icmp: icmp(
            r.not_icmp.as_ref().map(|i| match i {
                NotIcmp::NotIcmpType(t) => (*t, None),
                NotIcmp::NotIcmpTypeCode(tc) => (tc.r#type, Some(tc.code)),
            }),
            "not_icmp_type",
        )?,
        not_src_ip_set_ids: ids(&r.not_src_ip_set_ids, "not_src_ip_set_ids")?,
        not_dst_ip_set_ids: ids(&r.not_dst_ip_set_ids, "not_dst_ip_set_ids")?,
        not_src_named_port_ip_set_ids: ids(
            &r.not_src_named_port_ip_set_ids,
            "not_src_named_port_ip_set_ids",
        )?,
        not_dst_named_port_ip_set_ids: ids(
            &r.not_dst_named_port_ip_set_ids,
            "not_dst_named_port_ip_set_ids",
        )?,
        unsupported,
        rule_id: opt_id(&r.rule_id, "rule_id")?,
    };
    out.check()?;
    Ok(out)
}

fn model_ip_version(v: i32) -> Valid<Option<IpVersion>> {
    match felix::IpVersion::try_from(v) {
        Ok(felix::IpVersion::Any) => Ok(None),
        Ok(felix::IpVersion::Ipv4) => Ok(Some(IpVersion::V4)),
        Ok(felix::IpVersion::Ipv6) => Ok(Some(IpVersion::V6)),
        Err(_) => Err(ValidationError::new(
            "",
            format!("unknown IP version {v}; expected 0, 4 or 6"),
        )),
    }
}

mod hosts;
#[cfg(test)]
mod tests;
