//! Policy enforcement for workload endpoints in the filter table, as
//! Felix's `endpoint_mgr.go` and `rules/` lay it out. No I/O here: it sets
//! chains in the filter table objects of every IP version.
//!
//! - `<prefix>-FORWARD`, hooked from FORWARD: traffic from a workload
//!   interface goes through `<prefix>-from-wl-dispatch`, traffic to one
//!   through `<prefix>-to-wl-dispatch`; what they accepted (accept mark) is
//!   accepted.
//! - `<prefix>-INPUT`, hooked from INPUT: traffic from a workload to the
//!   host goes through the workload's egress policy, then is accepted if
//!   allowed and dropped otherwise (Felix's DefaultEndpointToHostAction
//!   DROP). `<prefix>-OUTPUT` is hooked and empty: the host may reach its
//!   workloads (kubelet probes), as in Felix.
//! - The dispatch chains send each known workload interface to its own
//!   chain and drop every other workload interface (fail closed).
//! - `<prefix>-tw-<iface>` (to the workload: ingress) and `<prefix>-fw-
//!   <iface>` (from it: egress): conntrack established/related accept,
//!   invalid drop, the marks cleared, then per tier each policy's chain
//!   (while no policy of the tier passed), return when accepted, the tier's
//!   default drop unless it passes; then the profiles; then drop. An
//!   endpoint that is administratively down gets a single drop rule.
//! - Policy and profile chains (`<prefix>-pi-…`, `-po-…`, `-pri-…`,
//!   `-pro-…`) hold the rendered rules; only those an endpoint uses are
//!   programmed.

use std::collections::{BTreeMap, BTreeSet};

use super::{Manager, ManagerError};
use crate::backends::DesiredKernel;
use crate::backends::iptables::{Rule, RuleError};
use crate::model::ipsets::SetNames;
use crate::model::{
    EndpointState, Id, IpVersion, Key, Policy, PolicyId, Profile, TierDefault, Update,
    WorkloadEndpoint, WorkloadEndpointId,
};
use crate::rules::{ChainNames, Direction, Marks, Renderer};

/// Built-in filter chains we hook, and our chain for each.
pub const FILTER_HOOKS: [&str; 3] = ["INPUT", "FORWARD", "OUTPUT"];

#[derive(Debug, Clone)]
pub struct EndpointsConfig {
    /// Prefix of our objects (`dph`).
    pub prefix: String,
    /// Interface name prefix of workload interfaces (`cali`).
    pub workload_prefix: String,
    pub marks: Marks,
    /// Host ports that no host-endpoint policy can close: (protocol, port)
    /// reaching the host, and leaving it.
    pub failsafe_in: Ports,
    pub failsafe_out: Ports,
}

/// (protocol, port) pairs.
pub type Ports = Vec<(String, u16)>;

/// Felix's default failsafe ports (ssh, dhcp, bgp, etcd, typha, k8s api).
pub fn default_failsafe() -> (Ports, Ports) {
    let p = |l: &[(&str, u16)]| l.iter().map(|(a, b)| (a.to_string(), *b)).collect();
    let common = [
        ("tcp", 179),
        ("tcp", 2379),
        ("tcp", 2380),
        ("tcp", 5473),
        ("tcp", 6443),
        ("tcp", 6666),
        ("tcp", 6667),
    ];
    let mut inbound = vec![("tcp", 22), ("udp", 68)];
    inbound.extend(common);
    let mut outbound = vec![("udp", 53), ("udp", 67)];
    outbound.extend(common);
    (p(&inbound), p(&outbound))
}

#[derive(Debug)]
pub struct EndpointsManager {
    cfg: EndpointsConfig,
    sets: SetNames,
    chains: ChainNames,
    policies: BTreeMap<PolicyId, Policy>,
    profiles: BTreeMap<Id, Profile>,
    endpoints: BTreeMap<WorkloadEndpointId, WorkloadEndpoint>,
    hosts: BTreeMap<crate::model::HostEndpointId, crate::model::HostEndpoint>,
    dirty: bool,
    /// The IP sets that exist (rules naming others match as if empty).
    sets_known: BTreeSet<Id>,
    /// Links by name, and whether they are up (from the interface monitor).
    links: BTreeMap<String, bool>,
    /// The status last reported per endpoint.
    reported: BTreeMap<WorkloadEndpointId, &'static str>,
    reported_hosts: BTreeMap<crate::model::HostEndpointId, &'static str>,
    /// The chains we set last time, per (table index): removed when no
    /// longer wanted.
    last: BTreeMap<usize, BTreeSet<String>>,
}

fn bad(e: RuleError) -> ManagerError {
    ManagerError::Inconsistent {
        manager: "endpoints",
        reason: e.to_string(),
    }
}

fn rule(tokens: &[&str]) -> Result<Rule, ManagerError> {
    Rule::new(tokens.iter().copied()).map_err(bad)
}

/// `-p P -m multiport --dports a,b,… -j ACCEPT` per protocol (15 per rule).
fn failsafe_rules(ports: &[(String, u16)]) -> Result<Vec<Rule>, ManagerError> {
    let mut by_proto: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (p, port) in ports {
        by_proto
            .entry(p.as_str())
            .or_default()
            .push(port.to_string());
    }
    let mut out = Vec::new();
    for (p, list) in by_proto {
        for chunk in list.chunks(15) {
            let joined = chunk.join(",");
            out.push(rule(&[
                "-p",
                p,
                "-m",
                "multiport",
                "--dports",
                &joined,
                "-j",
                "ACCEPT",
            ])?);
        }
    }
    Ok(out)
}

/// `<head> -m mark --mark <mark> -j <target>`.
fn on_mark(head: &[&str], mark: &str, target: &str) -> Result<Rule, ManagerError> {
    let mut t = head.to_vec();
    t.extend(["-m", "mark", "--mark", mark, "-j", target]);
    rule(&t)
}

fn mark(m: u32) -> String {
    format!("{m:#x}/{m:#x}")
}

fn clear(m: u32) -> String {
    format!("0/{m:#x}")
}

impl EndpointsManager {
    pub fn new(cfg: EndpointsConfig, sets: SetNames) -> Self {
        let chains = ChainNames::new(&cfg.prefix);
        Self {
            cfg,
            sets,
            chains,
            policies: BTreeMap::new(),
            profiles: BTreeMap::new(),
            endpoints: BTreeMap::new(),
            hosts: BTreeMap::new(),
            dirty: true,
            sets_known: BTreeSet::new(),
            links: BTreeMap::new(),
            reported: BTreeMap::new(),
            reported_hosts: BTreeMap::new(),
            last: BTreeMap::new(),
        }
    }

    fn p(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.cfg.prefix)
    }

    /// `<prefix>-tw-<iface>` / `<prefix>-fw-<iface>`.
    pub fn endpoint_chain(&self, dir: Direction, iface: &str) -> String {
        let d = match dir {
            Direction::Inbound => "tw",
            Direction::Outbound => "fw",
        };
        format!("{}-{d}-{iface}", self.cfg.prefix)
    }

    /// The chain for one endpoint and direction.
    fn endpoint_rules(
        &self,
        ep: &WorkloadEndpoint,
        dir: Direction,
    ) -> Result<Vec<Rule>, ManagerError> {
        if ep.state == EndpointState::Down {
            return Ok(vec![rule(&["-j", "DROP"])?]);
        }
        self.policy_body(&ep.tiers, &ep.profile_ids, dir, None)
    }

    /// conntrack, marks cleared, (failsafe), tiers, profiles, drop.
    fn policy_body(
        &self,
        tiers: &[crate::model::TierInfo],
        profile_ids: &[Id],
        dir: Direction,
        failsafe: Option<&str>,
    ) -> Result<Vec<Rule>, ManagerError> {
        let m = self.cfg.marks;
        let mut out = vec![
            rule(&[
                "-m",
                "conntrack",
                "--ctstate",
                "RELATED,ESTABLISHED",
                "-j",
                "ACCEPT",
            ])?,
            rule(&["-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"])?,
            rule(&["-j", "MARK", "--set-xmark", &clear(m.accept | m.pass)])?,
        ];
        if let Some(f) = failsafe {
            out.push(rule(&["-j", f])?);
        }
        for tier in tiers {
            let policies = match dir {
                Direction::Inbound => &tier.ingress_policies,
                Direction::Outbound => &tier.egress_policies,
            };
            if policies.is_empty() {
                continue;
            }
            out.push(rule(&["-j", "MARK", "--set-xmark", &clear(m.pass)])?);
            for pid in policies {
                let chain = self.chains.policy(dir, pid);
                if !self.policies.contains_key(pid) {
                    // Not (yet) known: it cannot allow anything.
                    continue;
                }
                out.push(on_mark(&[], &clear(m.pass), &chain)?);
                out.push(on_mark(&[], &mark(m.accept), "RETURN")?);
            }
            if tier.default_action == TierDefault::Deny {
                out.push(on_mark(&[], &clear(m.pass), "DROP")?);
            }
        }
        for prof in profile_ids {
            if !self.profiles.contains_key(prof) {
                continue;
            }
            let chain = self.chains.profile(dir, prof);
            out.push(rule(&["-j", &chain])?);
            out.push(on_mark(&[], &mark(m.accept), "RETURN")?);
        }
        out.push(rule(&["-j", "DROP"])?);
        Ok(out)
    }

    /// /32 and /128 routes to each workload whose interface exists, and a
    /// permanent neighbour entry for each address when the MAC is known.
    fn routes(
        &self,
    ) -> (
        BTreeMap<ipnet::IpNet, String>,
        BTreeSet<crate::backends::routes::Neighbour>,
    ) {
        let (mut routes, mut neighbours) = (BTreeMap::new(), BTreeSet::new());
        for ep in self.endpoints.values() {
            let dev = ep.name.as_str();
            if !self.links.contains_key(dev) {
                continue; // CNI has not made it yet; retried when it appears
            }
            let nets = ep
                .ipv4_nets
                .iter()
                .map(|n| ipnet::IpNet::V4(*n))
                .chain(ep.ipv6_nets.iter().map(|n| ipnet::IpNet::V6(*n)));
            for net in nets {
                routes.insert(net, dev.to_string());
                if let Some(mac) = &ep.mac
                    && net.prefix_len() == net.max_prefix_len()
                {
                    neighbours.insert(crate::backends::routes::Neighbour {
                        addr: net.addr(),
                        dev: dev.to_string(),
                        mac: mac.to_string(),
                    });
                }
            }
        }
        (routes, neighbours)
    }

    /// Every chain of one IP version: name → rules.
    fn desired(&self, v: IpVersion) -> Result<BTreeMap<String, Vec<Rule>>, ManagerError> {
        let r = Renderer {
            sets: self.sets.clone(),
            marks: self.cfg.marks,
            version: v,
            log_prefix: self.p("policy"),
            known_sets: Some(&self.sets_known),
        };
        let m = self.cfg.marks;
        let wl = format!("{}+", self.cfg.workload_prefix);
        let (from, to) = (self.p("from-wl-dispatch"), self.p("to-wl-dispatch"));
        let mut chains = BTreeMap::new();
        chains.insert(
            self.p("FORWARD"),
            vec![
                rule(&["-i", &wl, "-j", &from])?,
                rule(&["-o", &wl, "-j", &to])?,
                on_mark(&["-i", &wl], &mark(m.accept), "ACCEPT")?,
                on_mark(&["-o", &wl], &mark(m.accept), "ACCEPT")?,
            ],
        );
        chains.insert(
            self.p("INPUT"),
            vec![
                rule(&["-i", &wl, "-j", &from])?,
                on_mark(&["-i", &wl], &mark(m.accept), "ACCEPT")?,
                rule(&["-i", &wl, "-j", "DROP"])?,
                // Host endpoints (opt-in: interfaces without one are not
                // policed), after the workload rules above.
                rule(&["-j", &self.p("from-host-endpoint")])?,
                on_mark(&[], &mark(m.accept), "ACCEPT")?,
            ],
        );
        // The host may reach its workloads (kubelet probes), as in Felix;
        // traffic leaving through a host endpoint is policed.
        chains.insert(
            self.p("OUTPUT"),
            vec![
                rule(&["-o", &wl, "-j", "RETURN"])?,
                rule(&["-j", &self.p("to-host-endpoint")])?,
                on_mark(&[], &mark(m.accept), "ACCEPT")?,
            ],
        );
        let (fs_in, fs_out) = (self.p("failsafe-in"), self.p("failsafe-out"));
        chains.insert(fs_in.clone(), failsafe_rules(&self.cfg.failsafe_in)?);
        chains.insert(fs_out.clone(), failsafe_rules(&self.cfg.failsafe_out)?);
        let (mut from_host, mut to_host) = (Vec::new(), Vec::new());
        for hep in self.hosts.values() {
            let Some(iface) = &hep.name else {
                continue; // "all interfaces" host endpoints: not yet
            };
            let iface = iface.as_str();
            let fh = format!("{}-fh-{iface}", self.cfg.prefix);
            let th = format!("{}-th-{iface}", self.cfg.prefix);
            from_host.push(rule(&["-i", iface, "-g", &fh])?);
            to_host.push(rule(&["-o", iface, "-g", &th])?);
            chains.insert(
                fh,
                self.policy_body(
                    &hep.tiers,
                    &hep.profile_ids,
                    Direction::Inbound,
                    Some(&fs_in),
                )?,
            );
            chains.insert(
                th,
                self.policy_body(
                    &hep.tiers,
                    &hep.profile_ids,
                    Direction::Outbound,
                    Some(&fs_out),
                )?,
            );
        }
        chains.insert(self.p("from-host-endpoint"), from_host);
        chains.insert(self.p("to-host-endpoint"), to_host);
        let (mut from_rules, mut to_rules) = (Vec::new(), Vec::new());
        for ep in self.endpoints.values() {
            let iface = ep.name.as_str();
            let fw = self.endpoint_chain(Direction::Outbound, iface);
            let tw = self.endpoint_chain(Direction::Inbound, iface);
            from_rules.push(rule(&["-i", iface, "-g", &fw])?);
            to_rules.push(rule(&["-o", iface, "-g", &tw])?);
            chains.insert(fw, self.endpoint_rules(ep, Direction::Outbound)?);
            chains.insert(tw, self.endpoint_rules(ep, Direction::Inbound)?);
        }
        // Unknown workload interfaces: fail closed.
        from_rules.push(rule(&["-j", "DROP"])?);
        to_rules.push(rule(&["-j", "DROP"])?);
        chains.insert(from, from_rules);
        chains.insert(to, to_rules);
        for (id, pol) in &self.policies {
            chains.insert(
                self.chains.policy(Direction::Inbound, id),
                r.rules(&pol.inbound_rules).map_err(bad)?,
            );
            chains.insert(
                self.chains.policy(Direction::Outbound, id),
                r.rules(&pol.outbound_rules).map_err(bad)?,
            );
        }
        for (id, prof) in &self.profiles {
            chains.insert(
                self.chains.profile(Direction::Inbound, id),
                r.rules(&prof.inbound_rules).map_err(bad)?,
            );
            chains.insert(
                self.chains.profile(Direction::Outbound, id),
                r.rules(&prof.outbound_rules).map_err(bad)?,
            );
        }
        Ok(chains)
    }
}

impl Manager for EndpointsManager {
    fn name(&self) -> &'static str {
        "endpoints"
    }

    fn on_update(&mut self, update: &Update) {
        match update {
            Update::Policy(id, p) if !p.untracked && !p.pre_dnat => {
                self.policies.insert(id.clone(), p.clone());
            }
            Update::Profile(id, p) => {
                self.profiles.insert(id.clone(), p.clone());
            }
            Update::WorkloadEndpoint(id, ep) => {
                self.endpoints.insert(id.clone(), ep.clone());
            }
            Update::Remove(Key::Policy(id)) => {
                self.policies.remove(id);
            }
            Update::Remove(Key::Profile(id)) => {
                self.profiles.remove(id);
            }
            Update::Remove(Key::WorkloadEndpoint(id)) => {
                self.endpoints.remove(id);
            }
            Update::HostEndpoint(id, hep) => {
                self.hosts.insert(id.clone(), hep.clone());
            }
            Update::Remove(Key::HostEndpoint(id)) => {
                self.hosts.remove(id);
            }
            Update::IpSetUpdate(s) => {
                if !self.sets_known.insert(s.id.clone()) {
                    return; // existed already: rules are unchanged
                }
            }
            Update::Remove(Key::IpSet(id)) => {
                if !self.sets_known.remove(id) {
                    return;
                }
            }
            _ => return,
        }
        self.dirty = true;
    }

    fn on_interface(&mut self, event: &crate::interfaces::InterfaceEvent) {
        use crate::interfaces::InterfaceEvent as E;
        match event {
            // A workload's interface appeared: its routes can go in.
            E::Link { name, up, .. } if self.links.insert(name.clone(), *up).is_none() => {
                self.dirty |= self.endpoints.values().any(|e| e.name.as_str() == name);
            }
            E::LinkRemoved { name, .. } => {
                self.links.remove(name);
                self.dirty |= self.endpoints.values().any(|e| e.name.as_str() == name);
            }
            _ => {}
        }
    }

    fn status_changes(&mut self) -> Vec<crate::sync_loop::StatusEvent> {
        use crate::sync_loop::StatusEvent;
        let mut out = Vec::new();
        for (id, ep) in &self.endpoints {
            let link_up = self.links.get(ep.name.as_str()).copied().unwrap_or(false);
            let status = if ep.state == EndpointState::Active && link_up {
                "up"
            } else {
                "down"
            };
            if self.reported.get(id) != Some(&status) {
                self.reported.insert(id.clone(), status);
                out.push(StatusEvent::WorkloadEndpointStatus {
                    id: id.clone(),
                    status,
                });
            }
        }
        let gone: Vec<WorkloadEndpointId> = self
            .reported
            .keys()
            .filter(|id| !self.endpoints.contains_key(*id))
            .cloned()
            .collect();
        for id in gone {
            self.reported.remove(&id);
            out.push(StatusEvent::WorkloadEndpointStatusRemove { id });
        }
        // Host endpoints: up when their interface exists and is up ("all
        // interfaces" ones: up).
        for (id, hep) in &self.hosts {
            let up = hep
                .name
                .as_ref()
                .is_none_or(|n| self.links.get(n.as_str()).copied().unwrap_or(false));
            let status = if up { "up" } else { "down" };
            if self.reported_hosts.get(id) != Some(&status) {
                self.reported_hosts.insert(id.clone(), status);
                out.push(StatusEvent::HostEndpointStatus {
                    id: id.clone(),
                    status,
                });
            }
        }
        let gone: Vec<crate::model::HostEndpointId> = self
            .reported_hosts
            .keys()
            .filter(|id| !self.hosts.contains_key(*id))
            .cloned()
            .collect();
        for id in gone {
            self.reported_hosts.remove(&id);
            out.push(StatusEvent::HostEndpointStatusRemove { id });
        }
        out
    }

    fn complete_deferred_work(&mut self, kernel: &mut DesiredKernel) -> Result<(), ManagerError> {
        if !self.dirty {
            return Ok(());
        }
        for (i, t) in kernel.tables.iter_mut().enumerate() {
            if t.table() != "filter" {
                continue;
            }
            let chains = self.desired(t.version())?;
            let names: BTreeSet<String> = chains.keys().cloned().collect();
            for old in self.last.get(&i).into_iter().flatten() {
                if !names.contains(old) {
                    t.remove_chain(old);
                }
            }
            for (name, rules) in chains {
                t.set_chain(&name, rules).map_err(bad)?;
            }
            for hook in FILTER_HOOKS {
                let jump = rule(&["-j", &self.p(hook)])?;
                t.set_hooks(hook, vec![jump]).map_err(bad)?;
            }
            self.last.insert(i, names);
        }
        if let Some(r) = &mut kernel.routes {
            let (routes, neighbours) = self.routes();
            r.set(routes, neighbours);
        }
        if let Some(sc) = &mut kernel.sysctls {
            let ipv6 = kernel.tables.iter().any(|t| t.version() == IpVersion::V6);
            let knobs = self
                .endpoints
                .values()
                .filter(|ep| self.links.contains_key(ep.name.as_str()))
                .flat_map(|ep| crate::backends::sysctl::workload_knobs(ep.name.as_str(), ipv6))
                .collect();
            sc.set(knobs);
        }
        self.dirty = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
