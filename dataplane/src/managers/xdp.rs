//! XDP acceleration of untracked ingress deny on host endpoints (Felix's
//! `xdp_state.go`): for a host endpoint's interfaces (resolved as for
//! iptables: by name, by address, or `*` for every other interface but
//! `lo`, see [`super::hosts`]) whose first
//! untracked ingress policy begins with a deny rule matching nothing but
//! source IP sets and/or source CIDRs (Felix: exactly one IPv4 set; here
//! sets and CIDRs, both families), the interface's XDP blocklist holds
//! those sets' members and CIDRs. Everything else stays with iptables; the
//! raw-table rules of the same policy are programmed either way, so
//! correctness never depends on XDP. No I/O: the blocklists are queued into
//! the XDP backend.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;

use super::hosts::{HostLinks, resolve};
use super::{Manager, ManagerError};
use crate::backends::DesiredKernel;
use crate::interfaces::InterfaceEvent;
use crate::model::{
    Action, HostEndpoint, HostEndpointId, Id, Key, Member, Policy, PolicyId, Rule, Update,
};

/// The protocol numbers of failsafe port names.
pub fn proto_number(name: &str) -> Option<u8> {
    match name {
        "tcp" => Some(6),
        "udp" => Some(17),
        "sctp" => Some(132),
        _ => None,
    }
}

#[derive(Debug, Default)]
pub struct XdpManager {
    workload_prefix: String,
    heps: BTreeMap<HostEndpointId, HostEndpoint>,
    policies: BTreeMap<PolicyId, Policy>,
    /// IP and CIDR members of every IP set (a policy may name a set that
    /// came first).
    sets: BTreeMap<Id, BTreeSet<IpNet>>,
    /// The host's links and addresses (host endpoints by address and `*`
    /// resolve against them).
    host_links: HostLinks,
    link_events: BTreeSet<String>,
    dirty: bool,
}

/// A deny rule matching only source sets and/or source CIDRs.
fn accelerable(r: &Rule) -> bool {
    if r.action() != Action::Deny || (r.src_ip_set_ids.is_empty() && r.src_net.is_empty()) {
        return false;
    }
    let bare = Rule {
        action: r.action,
        ip_version: r.ip_version,
        src_net: r.src_net.clone(),
        src_ip_set_ids: r.src_ip_set_ids.clone(),
        rule_id: r.rule_id.clone(),
        ..Rule::default()
    };
    bare == *r
}

fn nets(members: &[Member]) -> impl Iterator<Item = IpNet> + '_ {
    members.iter().filter_map(|m| match m {
        Member::Ip(ip) => Some(IpNet::from(*ip)),
        Member::Net(n) => Some(*n),
        Member::IpPort(..) => None,
    })
}

impl XdpManager {
    /// `workload_prefix`: workload interfaces are never host endpoints.
    pub fn new(workload_prefix: &str) -> Self {
        Self {
            workload_prefix: workload_prefix.to_string(),
            dirty: true,
            ..Self::default()
        }
    }

    /// The blocklist XDP takes over for `hep`, if any.
    fn accelerated(&self, hep: &HostEndpoint) -> Option<BTreeSet<IpNet>> {
        let first = hep
            .untracked_tiers
            .iter()
            .flat_map(|t| t.ingress_policies.iter())
            .next()?;
        let policy = self.policies.get(first).filter(|p| p.untracked)?;
        let rule = policy.inbound_rules.first().filter(|r| accelerable(r))?;
        let mut out: BTreeSet<IpNet> = rule.src_net.iter().copied().collect();
        for id in &rule.src_ip_set_ids {
            // A set not known yet: nothing of it to drop (iptables holds
            // the rule back the same way).
            if let Some(s) = self.sets.get(id) {
                out.extend(s.iter().copied());
            }
        }
        Some(out)
    }

    /// The blocklist per interface.
    pub fn desired(&self) -> BTreeMap<String, BTreeSet<IpNet>> {
        let res = resolve(
            &self.heps,
            self.host_links.interfaces(),
            &self.workload_prefix,
        );
        let mut out = BTreeMap::new();
        let mut take = |iface: &str, id: &HostEndpointId| {
            if let Some(b) = self.heps.get(id).and_then(|h| self.accelerated(h)) {
                out.insert(iface.to_string(), b);
            }
        };
        for (iface, id) in &res.named {
            take(iface, id);
        }
        if let Some(all) = &res.all {
            for iface in self.host_links.links.keys() {
                if iface != "lo"
                    && !iface.starts_with(&self.workload_prefix)
                    && !res.named.contains_key(iface)
                {
                    take(iface, all);
                }
            }
        }
        out
    }
}

impl Manager for XdpManager {
    fn name(&self) -> &'static str {
        "xdp"
    }

    fn on_update(&mut self, update: &Update) {
        match update {
            Update::HostEndpoint(id, h) => {
                self.heps.insert(id.clone(), h.clone());
            }
            Update::Remove(Key::HostEndpoint(id)) => {
                self.heps.remove(id);
            }
            Update::Policy(id, p) => {
                self.policies.insert(id.clone(), p.clone());
            }
            Update::Remove(Key::Policy(id)) => {
                self.policies.remove(id);
            }
            Update::IpSetUpdate(s) => {
                self.sets.insert(s.id.clone(), nets(&s.members).collect());
            }
            Update::IpSetDeltaUpdate(d) => {
                let set = self.sets.entry(d.id.clone()).or_default();
                for n in nets(&d.removed) {
                    set.remove(&n);
                }
                set.extend(nets(&d.added));
            }
            Update::Remove(Key::IpSet(id)) => {
                self.sets.remove(id);
            }
            _ => return,
        }
        self.dirty = true;
    }

    fn on_interface(&mut self, event: &InterfaceEvent) {
        let c = self.host_links.apply(event);
        if let InterfaceEvent::Link { name, .. } = event
            && c.links.contains(name)
        {
            // Appeared: an interface XDP could not attach to may take it.
            self.link_events.insert(name.clone());
        }
        if !c.links.is_empty() || c.addrs {
            self.dirty |= !self.heps.is_empty();
        }
    }

    fn complete_deferred_work(&mut self, kernel: &mut DesiredKernel) -> Result<(), ManagerError> {
        let Some(x) = &mut kernel.xdp else {
            return Ok(());
        };
        for name in std::mem::take(&mut self.link_events) {
            x.link_changed(&name);
        }
        if !self.dirty {
            return Ok(());
        }
        self.dirty = false;
        let want = self.desired();
        let old: Vec<String> = x
            .desired()
            .keys()
            .filter(|i| !want.contains_key(*i))
            .cloned()
            .collect();
        for iface in old {
            x.set(&iface, None);
        }
        for (iface, b) in want {
            x.set(&iface, Some(b));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{HostInterface, IpSet, IpSetDelta, IpSetType, TierDefault, TierInfo};

    /// The host's links: lo, eth0, eth1 and a workload's.
    fn links(m: &mut XdpManager) {
        for (index, name) in [(1, "lo"), (2, "eth0"), (3, "eth1"), (4, "cali1")] {
            m.on_interface(&InterfaceEvent::Link {
                index,
                name: name.into(),
                up: true,
                mtu: 1500,
            });
        }
        m.on_interface(&InterfaceEvent::AddrAdded {
            index: 3,
            addr: "192.168.9.1/24".parse().unwrap(),
        });
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

    fn hep(iface: &str, policy: &str) -> Update {
        hep_on(
            "h",
            HostInterface::Named(crate::model::IfaceName::new(iface).unwrap()),
            policy,
        )
    }

    fn hep_on(name: &str, interface: HostInterface, policy: &str) -> Update {
        Update::HostEndpoint(
            HostEndpointId(id(name)),
            HostEndpoint {
                interface,
                profile_ids: vec![],
                tiers: vec![],
                untracked_tiers: vec![TierInfo {
                    name: id("t"),
                    ingress_policies: vec![pid(policy)],
                    egress_policies: vec![],
                    default_action: TierDefault::Deny,
                }],
                pre_dnat_tiers: vec![],
                forward_tiers: vec![],
                expected_ipv4_addrs: vec!["192.168.9.1".parse().unwrap()],
                expected_ipv6_addrs: vec![],
            },
        )
    }

    fn policy(name: &str, untracked: bool, rule: Rule) -> Update {
        Update::Policy(
            pid(name),
            Policy {
                inbound_rules: vec![rule],
                untracked,
                ..Policy::default()
            },
        )
    }

    fn deny_from(sets: &[&str], nets: &[&str]) -> Rule {
        Rule {
            action: Some(Action::Deny),
            src_ip_set_ids: sets.iter().map(|s| id(s)).collect(),
            src_net: nets.iter().map(|n| n.parse().unwrap()).collect(),
            ..Rule::default()
        }
    }

    fn set(name: &str, members: &[&str]) -> Update {
        Update::IpSetUpdate(IpSet {
            id: id(name),
            set_type: IpSetType::Net,
            members: members
                .iter()
                .map(|m| Member::Net(m.parse().unwrap()))
                .collect(),
        })
    }

    fn list(m: &XdpManager) -> Vec<(String, Vec<String>)> {
        m.desired()
            .into_iter()
            .map(|(i, b)| (i, b.iter().map(ToString::to_string).collect()))
            .collect()
    }

    #[test]
    fn untracked_deny_of_sources_is_accelerated() {
        let mut m = XdpManager::new("cali");
        links(&mut m);
        for u in [
            set("bad", &["10.1.0.0/16", "fd00:bad::/64"]),
            policy("p", true, deny_from(&["bad"], &["192.0.2.7/32"])),
            hep("eth0", "p"),
        ] {
            m.on_update(&u);
        }
        assert_eq!(
            list(&m),
            vec![(
                "eth0".to_string(),
                vec![
                    "10.1.0.0/16".to_string(),
                    "192.0.2.7/32".to_string(),
                    "fd00:bad::/64".to_string()
                ]
            )]
        );
        // Members come and go as deltas.
        m.on_update(&Update::IpSetDeltaUpdate(IpSetDelta {
            id: id("bad"),
            added: vec![Member::Ip("10.9.9.9".parse().unwrap())],
            removed: vec![Member::Net("10.1.0.0/16".parse().unwrap())],
        }));
        assert_eq!(
            list(&m)[0].1,
            vec!["10.9.9.9/32", "192.0.2.7/32", "fd00:bad::/64"]
        );
    }

    #[test]
    fn anything_else_stays_with_iptables() {
        let mut with_port = deny_from(&["bad"], &[]);
        with_port.protocol = Some(crate::model::Protocol(6));
        let allow = Rule {
            action: Some(Action::Allow),
            ..deny_from(&["bad"], &[])
        };
        for (untracked, rule) in [
            (false, deny_from(&["bad"], &[])),
            (true, with_port),
            (true, allow),
            (true, deny_from(&[], &[])),
        ] {
            let mut m = XdpManager::new("cali");
            links(&mut m);
            m.on_update(&set("bad", &["10.1.0.0/16"]));
            m.on_update(&policy("p", untracked, rule.clone()));
            m.on_update(&hep("eth0", "p"));
            assert!(m.desired().is_empty(), "{untracked} {rule:?}");
        }
    }

    #[test]
    fn by_address_and_all_interfaces() {
        let mut m = XdpManager::new("cali");
        links(&mut m);
        m.on_update(&set("bad", &["10.1.0.0/16"]));
        m.on_update(&policy("p", true, deny_from(&["bad"], &[])));
        // By address: the interface holding it (eth1).
        m.on_update(&hep_on("a", HostInterface::ByAddress, "p"));
        assert_eq!(m.desired().keys().collect::<Vec<_>>(), ["eth1"]);
        // `*`: every other interface but lo and workloads.
        m.on_update(&hep_on("b", HostInterface::All, "p"));
        assert_eq!(m.desired().keys().collect::<Vec<_>>(), ["eth0", "eth1"]);
    }
}
