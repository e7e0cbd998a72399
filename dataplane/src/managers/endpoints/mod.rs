//! Policy enforcement for workload and host endpoints, as Felix's
//! `endpoint_mgr.go`, `policy_mgr.go` and `rules/` lay it out. No I/O here:
//! it sets chains in the filter, raw and mangle table objects of every IP
//! version, and the workload routes, neighbours and sysctls.
//!
//! filter:
//! - `<prefix>-FORWARD`, hooked from FORWARD: marks cleared; traffic from a
//!   host endpoint through `<prefix>-from-hep-forward` (unless raw or
//!   mangle accepted it), from a workload interface through
//!   `<prefix>-from-wl-dispatch`, to one through `<prefix>-to-wl-dispatch`,
//!   to a host endpoint through `<prefix>-to-hep-forward`; what they
//!   accepted (accept mark) is accepted.
//! - `<prefix>-INPUT`, hooked from INPUT: traffic from a workload to the
//!   host goes through the workload's egress policy, then is accepted if
//!   allowed and dropped otherwise (Felix's DefaultEndpointToHostAction
//!   DROP); then what raw/mangle accepted is accepted; then host endpoint
//!   policy through `<prefix>-from-host-endpoint`. `<prefix>-OUTPUT`: the
//!   host may reach its workloads (kubelet probes), as in Felix; the rest
//!   goes through `<prefix>-to-host-endpoint`.
//! - Workload dispatch sends each known workload interface to its own
//!   chain and drops every other workload interface (fail closed).
//!   `<prefix>-tw-<iface>` (to the workload: ingress) and `<prefix>-fw-
//!   <iface>` (from it: egress): conntrack established/related accept,
//!   invalid drop, the marks cleared, then per tier each policy's chain
//!   (while no policy of the tier passed), return when accepted, the tier's
//!   default drop unless it passes; then the profiles; then drop. An
//!   endpoint that is administratively down gets a single drop rule.
//! - Host endpoints: `<prefix>-fh-<iface>` / `-th-` (to and from the host,
//!   failsafe ports first) and `-fhfw-` / `-thfw-` (forwarded through the
//!   interface: forward tiers; allowed when none applies); the
//!   all-interfaces endpoint's chains end in `any` (`<prefix>-fhany`).
//! - Policy and profile chains (`<prefix>-pi-…`, `-po-…`, `-pri-…`,
//!   `-pro-…`) hold the rendered rules.
//!
//! raw and mangle, only while some host endpoint has untracked or pre-DNAT
//! policy: `<prefix>-PREROUTING` (both) and `<prefix>-OUTPUT` (raw),
//! hooked from the built-ins, dispatch to `<prefix>-fh-`/`-th-` chains of
//! untracked policy (what it allows is NOTRACKed and accepted) or pre-DNAT
//! policy (accepted); the policy chains of untracked policies live in raw,
//! of pre-DNAT policies in mangle.
//!
//! Work is incremental: a change re-renders only the chains of the
//! policies, profiles and endpoints it touched (plus the dispatch and host
//! chains when endpoints come or go); the table backend then writes only
//! what differs.

mod chains;
mod hosts;
mod links;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::{Manager, ManagerError};
use crate::backends::DesiredKernel;
use crate::generictables::{Rule, RuleError};
use crate::model::Marks;
use crate::model::ipsets::SetNames;
use crate::model::{
    EndpointState, HostEndpoint, HostEndpointId, Id, IpVersion, Key, Policy, PolicyId, Profile,
    Update, WorkloadEndpoint, WorkloadEndpointId,
};
use crate::rules::ChainNames;
use chains::{FILTER, MANGLE, RAW};

/// Built-in chains we hook, per table, and our chain for each.
pub const FILTER_HOOKS: [&str; 3] = ["INPUT", "FORWARD", "OUTPUT"];
const RAW_HOOKS: [&str; 2] = ["PREROUTING", "OUTPUT"];
const MANGLE_HOOKS: [&str; 1] = ["PREROUTING"];

#[derive(Debug, Clone, PartialEq)]
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
    /// Protocol of the routes to workloads (Felix's DeviceRouteProtocol,
    /// 3 = `boot`): they are ours by their interface, not their protocol.
    pub device_route_protocol: u8,
    /// VXLAN (`--vxlan`) and its UDP port: while it is on, VXLAN packets
    /// to this host are accepted only from the nodes of the VXLAN-sources
    /// set (Felix's `all-vxlan-net` rules in `cali-INPUT`).
    pub vxlan: crate::model::routes::VxlanMode,
    pub vxlan_port: u16,
    /// WireGuard as the flags say (v4, v6): while it is on, its UDP port
    /// to and from this host is accepted ahead of host-endpoint policy
    /// (Felix's "Allow incoming/outgoing Wireguard packets").
    pub wireguard: [crate::model::wireguard::WgSettings; 2],
    /// What becomes of traffic from a workload to this host once the
    /// workload's egress policy allowed it (Felix's
    /// DefaultEndpointToHostAction).
    pub endpoint_to_host: crate::model::config::EndpointToHost,
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

/// Who set a chain: so that its chains can be re-rendered, and the stale
/// ones removed, on its own.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Owner {
    Policy(PolicyId),
    Profile(Id),
    Workload(WorkloadEndpointId),
    /// The workload dispatch chains.
    Dispatch,
    /// Top-level, failsafe and host endpoint chains.
    Static,
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Owner::Policy(id) => write!(f, "policy {id}"),
            Owner::Profile(id) => write!(f, "profile {id}"),
            Owner::Workload(id) => write!(f, "workload endpoint {id}"),
            Owner::Dispatch => f.write_str("the workload dispatch"),
            Owner::Static => f.write_str("the top-level and host endpoint chains"),
        }
    }
}

/// What changed since the last `complete_deferred_work`.
#[derive(Debug, Default)]
struct Dirty {
    /// Everything (the first time).
    all: bool,
    policies: BTreeSet<PolicyId>,
    profiles: BTreeSet<Id>,
    workloads: BTreeSet<WorkloadEndpointId>,
    /// IP sets that came or went: rules naming them change.
    sets: BTreeSet<Id>,
    /// Workload dispatch chains.
    dispatch: bool,
    /// Host endpoints, top-level chains.
    statics: bool,
    /// The routes, neighbours and sysctls of these interfaces.
    links: BTreeSet<String>,
}

impl Dirty {
    fn any(&self) -> bool {
        self.all
            || self.dispatch
            || self.statics
            || !(self.policies.is_empty()
                && self.links.is_empty()
                && self.profiles.is_empty()
                && self.workloads.is_empty()
                && self.sets.is_empty())
    }
}

#[derive(Debug)]
pub struct EndpointsManager {
    /// The flags' settings.
    base: EndpointsConfig,
    /// In force: `base` with the keys of the last ConfigUpdate.
    cfg: EndpointsConfig,
    sets: SetNames,
    chains: ChainNames,
    policies: BTreeMap<PolicyId, Policy>,
    profiles: BTreeMap<Id, Profile>,
    endpoints: BTreeMap<WorkloadEndpointId, WorkloadEndpoint>,
    hosts: BTreeMap<HostEndpointId, HostEndpoint>,
    /// Which workloads name each policy / profile: their chains change when
    /// it comes or goes.
    policy_users: HashMap<PolicyId, BTreeSet<WorkloadEndpointId>>,
    profile_users: HashMap<Id, BTreeSet<WorkloadEndpointId>>,
    dirty: Dirty,
    /// The IP sets that exist (rules naming others match as if empty).
    sets_known: BTreeSet<Id>,
    /// The host's links (up or not) and their addresses, from the
    /// interface monitor.
    host_links: crate::managers::hosts::HostLinks,
    /// The host endpoints as last resolved against the interfaces.
    resolved: crate::managers::hosts::Resolved,
    /// The status last reported per endpoint.
    reported: BTreeMap<WorkloadEndpointId, &'static str>,
    /// Endpoints whose status may have changed since the last report (an
    /// update, a removal, their interface): only these are looked at, so a
    /// report costs what changed, not the node's 10,000 endpoints.
    status_due: BTreeSet<WorkloadEndpointId>,
    /// Workload endpoints by interface name (for link events).
    by_name: HashMap<String, BTreeSet<WorkloadEndpointId>>,
    reported_hosts: BTreeMap<HostEndpointId, &'static str>,
    /// The chains each owner set, per table index.
    owned: HashMap<Owner, Vec<(usize, String)>>,
    /// How many owners set each chain (per table index): a chain goes
    /// only when the last of them lets it go. Two workloads on one
    /// interface name the same chains; while one shadows the other, the
    /// one let go must not take the other's chains with it.
    claims: HashMap<(usize, String), u32>,
    /// All-interfaces endpoints with untracked policy already warned about.
    warned: BTreeSet<HostEndpointId>,
    /// The calc graph's encapsulation (whether VXLAN is on).
    encap: crate::model::Encapsulation,
    /// The WireGuard keys of the last ConfigUpdate.
    wg_config: std::collections::BTreeMap<String, String>,
    /// The dispatch leaves last rendered, by their chain's name: one whose
    /// interfaces did not change is taken as it was (an endpoint coming
    /// or going changes a few of the 10,000 rules).
    /// Per IP version (v4, v6): each filter table keeps its own leaves.
    dispatch_memo: std::cell::RefCell<[chains::DispatchMemo; 2]>,
    /// The dispatch leaves the last render found as they were (not
    /// rendered again; still owned).
    dispatch_kept: std::cell::RefCell<Vec<String>>,
    /// Each interface's routes, neighbours and knobs as last handed to
    /// the backends.
    links: links::LinkShares,
    /// Owners whose chains could not be programmed, and why: kept at
    /// their last good state, or fail-closed (see `apply_owners`).
    broken: BTreeMap<Owner, String>,
    /// Tests: the owners whose render fails (no validated input makes
    /// one fail; this stands in for a renderer bug).
    #[cfg(test)]
    fail_render: BTreeSet<Owner>,
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

/// The IP set ids the rules name.
fn set_refs(rules: &[crate::model::Rule]) -> impl Iterator<Item = &Id> {
    rules.iter().flat_map(|r| {
        r.src_ip_set_ids
            .iter()
            .chain(&r.dst_ip_set_ids)
            .chain(&r.dst_ip_port_set_ids)
            .chain(&r.src_named_port_ip_set_ids)
            .chain(&r.dst_named_port_ip_set_ids)
            .chain(&r.not_src_ip_set_ids)
            .chain(&r.not_dst_ip_set_ids)
            .chain(&r.not_src_named_port_ip_set_ids)
            .chain(&r.not_dst_named_port_ip_set_ids)
    })
}

fn names_any(rules: [&[crate::model::Rule]; 2], sets: &BTreeSet<Id>) -> bool {
    rules
        .into_iter()
        .any(|r| set_refs(r).any(|id| sets.contains(id)))
}

impl EndpointsManager {
    /// The devices of ours whose addresses lie in the workload blocks by
    /// design (VXLAN, IPIP and WireGuard tunnels): not the node's own.
    pub(super) fn tunnel_devices(&self) -> Vec<String> {
        use crate::managers::routes::{IPIP_DEVICE, VXLAN_V4, VXLAN_V6};
        let mut out: Vec<String> = [VXLAN_V4, VXLAN_V6, IPIP_DEVICE]
            .into_iter()
            .map(str::to_string)
            .collect();
        for (i, v) in [IpVersion::V4, IpVersion::V6].into_iter().enumerate() {
            out.push(self.cfg.wireguard[i].effective(v, &self.wg_config).iface);
        }
        out
    }

    /// WireGuard's UDP port for version `v` while WireGuard is on.
    fn wireguard_port(&self, v: IpVersion) -> Option<u16> {
        let i = usize::from(v == IpVersion::V6);
        let s = self.cfg.wireguard[i].effective(v, &self.wg_config);
        s.enabled.then_some(s.port)
    }

    pub fn new(cfg: EndpointsConfig, sets: SetNames) -> Self {
        let chains = ChainNames::new(&cfg.prefix);
        Self {
            base: cfg.clone(),
            cfg,
            sets,
            chains,
            policies: BTreeMap::new(),
            profiles: BTreeMap::new(),
            endpoints: BTreeMap::new(),
            hosts: BTreeMap::new(),
            policy_users: HashMap::new(),
            profile_users: HashMap::new(),
            dirty: Dirty {
                all: true,
                ..Dirty::default()
            },
            sets_known: BTreeSet::new(),
            host_links: Default::default(),
            resolved: crate::managers::hosts::Resolved::default(),
            reported: BTreeMap::new(),
            status_due: BTreeSet::new(),
            by_name: HashMap::new(),
            reported_hosts: BTreeMap::new(),
            encap: crate::model::Encapsulation::default(),
            wg_config: std::collections::BTreeMap::new(),
            dispatch_memo: Default::default(),
            dispatch_kept: Default::default(),
            owned: HashMap::new(),
            claims: HashMap::new(),
            warned: BTreeSet::new(),
            links: Default::default(),
            broken: BTreeMap::new(),
            #[cfg(test)]
            fail_render: BTreeSet::new(),
        }
    }

    /// Index (or unindex) a workload: its policy and profile references
    /// and its interface name; its status is due for a look.
    /// Whether workload `id` (`ep`) is the one its interface serves: of
    /// several endpoints on one interface name, the lowest id, as in Felix
    /// (the others are shadowed until it goes: a make-before-break that
    /// must behave predictably meanwhile).
    fn active(&self, id: &WorkloadEndpointId, ep: &WorkloadEndpoint) -> bool {
        self.by_name
            .get(ep.name.as_str())
            .and_then(|ids| ids.first())
            .is_none_or(|first| first == id)
    }

    /// Every workload on interface `name` is rendered again (which of
    /// them is active may have changed).
    fn interface_changed(&mut self, name: &str) {
        if let Some(ids) = self.by_name.get(name) {
            self.dirty.workloads.extend(ids.iter().cloned());
        }
    }

    fn index(&mut self, id: &WorkloadEndpointId, ep: &WorkloadEndpoint, add: bool) {
        self.status_due.insert(id.clone());
        let named = self.by_name.entry(ep.name.as_str().to_owned()).or_default();
        if add {
            named.insert(id.clone());
        } else {
            named.remove(id);
            if named.is_empty() {
                self.by_name.remove(ep.name.as_str());
            }
        }
        let pols = ep
            .tiers
            .iter()
            .flat_map(|t| t.ingress_policies.iter().chain(&t.egress_policies));
        for p in pols {
            let users = self.policy_users.entry(p.clone()).or_default();
            if add {
                users.insert(id.clone());
            } else {
                users.remove(id);
                if users.is_empty() {
                    self.policy_users.remove(p);
                }
            }
        }
        for p in &ep.profile_ids {
            let users = self.profile_users.entry(p.clone()).or_default();
            if add {
                users.insert(id.clone());
            } else {
                users.remove(id);
                if users.is_empty() {
                    self.profile_users.remove(p);
                }
            }
        }
    }

    /// A policy came, went or moved table: the chains that jump to it.
    fn policy_presence_changed(&mut self, id: &PolicyId) {
        if let Some(users) = self.policy_users.get(id) {
            self.dirty.workloads.extend(users.iter().cloned());
        }
        self.dirty.statics |= !self.hosts.is_empty();
    }

    fn profile_presence_changed(&mut self, id: &Id) {
        if let Some(users) = self.profile_users.get(id) {
            self.dirty.workloads.extend(users.iter().cloned());
        }
        self.dirty.statics |= !self.hosts.is_empty();
    }

    /// The chains `owner` wants in table `table` (of version `v`).
    fn render(
        &self,
        owner: &Owner,
        table: &str,
        v: IpVersion,
    ) -> Result<chains::Chains, ManagerError> {
        #[cfg(test)]
        if self.fail_render.contains(owner) {
            return Err(bad(RuleError::Token("injected".into())));
        }
        match owner {
            Owner::Policy(id) => self.policy_chains(id, table, v),
            Owner::Profile(id) if table == FILTER => self.profile_chains(id, v),
            Owner::Workload(id) if table == FILTER => match self.endpoints.get(id) {
                Some(ep) if self.active(id, ep) => self.workload_chains(ep),
                _ => Ok(chains::Chains::new()),
            },
            Owner::Dispatch if table == FILTER => self.dispatch_chains(v),
            Owner::Static => self.static_chains(table, v, &self.resolved),
            _ => Ok(chains::Chains::new()),
        }
    }

    /// Sets the chains `owner` wants in every endpoint table (with
    /// `fail_closed`, each of them as a single drop) and returns them;
    /// on an error nothing of it is left set (each chain it had set is
    /// put back as it was).
    fn program(
        &self,
        owner: &Owner,
        kernel: &mut DesiredKernel,
        fail_closed: bool,
    ) -> Result<Vec<(usize, String)>, ManagerError> {
        let mut tables: Vec<&mut dyn crate::backends::desired::RuleTable> =
            kernel.rule_tables_mut().collect();
        let mut planned = Vec::new();
        for (i, t) in tables.iter().enumerate() {
            let table = t.table();
            if ![FILTER, RAW, MANGLE].contains(&table) {
                continue;
            }
            let chains =
                if *owner == Owner::Dispatch && table == FILTER && !t.dispatch_by_interface() {
                    // No tree to render: the table sends every workload
                    // interface on as one.
                    self.dispatch_roots()
                } else if fail_closed {
                    let drop = vec![rule(&["-j", "DROP"])?];
                    self.chain_names(owner, table)
                        .into_iter()
                        .map(|n| (n, drop.clone()))
                        .collect()
                } else {
                    self.render(owner, table, t.version())?
                };
            planned.push((i, chains));
        }
        let mut now: Vec<(usize, String)> = Vec::new();
        let mut undo: Vec<(usize, String, Option<Vec<Rule>>)> = Vec::new();
        for (i, chains) in planned {
            let t = &mut *tables[i];
            for (name, rules) in chains {
                let before = t.chain(&name).map(<[Rule]>::to_vec);
                if let Err(e) = t.set_chain(&name, rules) {
                    // Back as it was, newest first (a chain set twice
                    // gets its first state back).
                    for (j, n, r) in undo.into_iter().rev() {
                        match r {
                            Some(r) => {
                                let _ = tables[j].set_chain(&n, r);
                            }
                            None => tables[j].remove_chain(&n),
                        }
                    }
                    return Err(bad(e));
                }
                undo.push((i, name.clone(), before));
                now.push((i, name));
            }
            if *owner == Owner::Dispatch && tables[i].table() == FILTER {
                now.extend(self.dispatch_kept.take().into_iter().map(|n| (i, n)));
            }
        }
        Ok(now)
    }

    /// The names of the chains [`Self::render`] gives `owner` in
    /// `table`, without rendering them (for its fail-closed form).
    fn chain_names(&self, owner: &Owner, table: &str) -> Vec<String> {
        use crate::rules::Direction::{Inbound, Outbound};
        match owner {
            Owner::Policy(id) => match self.policies.get(id) {
                Some(p) if chains::policy_table(p) == table => {
                    let mut n = vec![self.chains.policy(Inbound, id)];
                    if table != MANGLE {
                        n.push(self.chains.policy(Outbound, id));
                    }
                    n
                }
                _ => Vec::new(),
            },
            Owner::Profile(id) if table == FILTER && self.profiles.contains_key(id) => vec![
                self.chains.profile(Inbound, id),
                self.chains.profile(Outbound, id),
            ],
            Owner::Workload(id) if table == FILTER => match self.endpoints.get(id) {
                Some(ep) if self.active(id, ep) => vec![
                    self.endpoint_chain(Inbound, ep.name.as_str()),
                    self.endpoint_chain(Outbound, ep.name.as_str()),
                ],
                _ => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    /// Re-render `owners` into every endpoint table and drop the chains
    /// they no longer want.
    ///
    /// A policy, profile or workload whose chains cannot be rendered or
    /// set (a rule no table takes) is isolated: its chains stay as they
    /// were when it had some (its last good state), else it gets the
    /// fail-closed form of them (each chain a single drop); it is reported
    /// ([`Self::broken`]) and the other owners go on. Only the dispatch
    /// and static chains, which everything hangs from, fail the apply.
    fn apply_owners(
        &mut self,
        owners: Vec<Owner>,
        kernel: &mut DesiredKernel,
    ) -> Result<(), ManagerError> {
        for owner in owners {
            let now = match self.program(&owner, kernel, false) {
                Ok(now) => {
                    if let Some(why) = self.broken.remove(&owner) {
                        tracing::info!(owner = %owner, was = %why, "programmed again: no longer isolated");
                    }
                    now
                }
                Err(e) if matches!(owner, Owner::Dispatch | Owner::Static) => return Err(e),
                Err(e) => {
                    let why = e.to_string();
                    let kept = self.owned.contains_key(&owner);
                    if !self.broken.get(&owner).is_some_and(|w| w.starts_with(&why)) {
                        tracing::warn!(
                            owner = %owner,
                            error = %why,
                            kept_last_good = kept,
                            "cannot be programmed: isolated (the rest goes on)"
                        );
                    }
                    let state = if kept {
                        "kept at its last good state"
                    } else {
                        "fail-closed: each of its chains drops everything"
                    };
                    self.broken
                        .insert(owner.clone(), format!("{why} ({state})"));
                    if kept {
                        continue;
                    }
                    self.program(&owner, kernel, true)?
                }
            };
            let before = self.owned.remove(&owner).unwrap_or_default();
            // (Sets for the lookups: the dispatch owner has thousands.)
            let before_set: HashSet<&(usize, String)> = before.iter().collect();
            let now_set: HashSet<&(usize, String)> = now.iter().collect();
            for key in now.iter().filter(|k| !before_set.contains(k)) {
                *self.claims.entry(key.clone()).or_default() += 1;
            }
            for (i, t) in kernel.rule_tables_mut().enumerate() {
                for key in before.iter().filter(|k| k.0 == i && !now_set.contains(k)) {
                    let left = match self.claims.get_mut(key) {
                        Some(n) if *n > 1 => {
                            *n -= 1;
                            continue;
                        }
                        _ => self.claims.remove(key),
                    };
                    debug_assert!(left.is_some(), "a chain owned is claimed");
                    t.remove_chain(&key.1);
                }
            }
            if !now.is_empty() {
                self.owned.insert(owner, now);
            }
        }
        Ok(())
    }

    /// The hooks from the built-in chains: filter always; raw and mangle
    /// only while they hold host endpoint policy.
    fn set_hooks(&self, kernel: &mut DesiredKernel) -> Result<(), ManagerError> {
        let active = self.host_tables_active(&self.resolved);
        for t in kernel.rule_tables_mut() {
            let (hooks, on): (&[&str], bool) = match t.table() {
                FILTER => (&FILTER_HOOKS, true),
                RAW => (&RAW_HOOKS, active),
                MANGLE => (&MANGLE_HOOKS, active),
                _ => continue,
            };
            for hook in hooks {
                let rules = if on {
                    vec![rule(&["-j", &self.p(hook)])?]
                } else {
                    Vec::new()
                };
                t.set_hooks(hook, rules).map_err(bad)?;
            }
        }
        Ok(())
    }

    fn warn_unsupported(&mut self) {
        let Some(id) = self.resolved.all.clone() else {
            return;
        };
        let untracked = self
            .hosts
            .get(&id)
            .is_some_and(|h| !h.untracked_tiers.is_empty());
        if untracked && self.warned.insert(id.clone()) {
            tracing::warn!(
                host_endpoint = %id.0,
                "untracked policy on an all-interfaces host endpoint is not supported \
                 (as in Felix): ignored"
            );
        }
    }

    fn on_link_change(&mut self, name: &str) {
        if self.by_name.contains_key(name) {
            self.dirty.links.insert(name.to_string());
        }
        self.dirty.statics |= !self.hosts.is_empty();
    }
}

impl Manager for EndpointsManager {
    fn name(&self) -> &'static str {
        "endpoints"
    }

    /// A workload endpoint is confined to a workload interface (one named
    /// with the workload prefix, as Felix's InterfacePrefix confines it)
    /// and to addresses that are not the node's own: a feeder must not
    /// make the uplink a workload's (its routes, proxy ARP, sysctls) nor
    /// route the node's addresses or subnets, or everything, to one.
    fn check(&self, update: &Update) -> Result<(), crate::model::ValidationError> {
        use crate::model::ValidationError;
        let Update::WorkloadEndpoint(_, ep) = update else {
            return Ok(());
        };
        let prefix = self.cfg.workload_prefix.as_str();
        if !ep.name.as_str().starts_with(prefix) {
            return Err(ValidationError::new(
                "workload_endpoint_update.endpoint.name",
                format!(
                    "interface {:?} is not a workload interface: workload endpoints are confined \
                     to interfaces named {prefix}… (--workload-iface-prefix, Felix's InterfacePrefix)",
                    ep.name.as_str()
                ),
            ));
        }
        let tunnels = self.tunnel_devices();
        let tunnels: Vec<&str> = tunnels.iter().map(String::as_str).collect();
        let own: Vec<&ipnet::IpNet> = self.host_links.own_nets(prefix, &tunnels).collect();
        let nets = ep
            .ipv4_nets
            .iter()
            .map(|n| ("ipv4_nets", ipnet::IpNet::V4(*n)))
            .chain(
                ep.ipv6_nets
                    .iter()
                    .map(|n| ("ipv6_nets", ipnet::IpNet::V6(*n))),
            );
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        for (field, net) in nets {
            let i = seen.entry(field).or_default();
            if let Some(why) = crate::managers::hosts::covers_host(&net, own.iter().copied()) {
                return Err(ValidationError::new(
                    format!("workload_endpoint_update.endpoint.{field}[{i}]"),
                    format!("{why}: a workload's address must not be"),
                ));
            }
            *i += 1;
        }
        Ok(())
    }

    #[allow(
        clippy::collapsible_match,
        reason = "the inner ifs change state; as match guards they would hide that"
    )]
    fn on_update(&mut self, update: &Update) {
        match update {
            Update::Encapsulation(e) => {
                // VXLAN on or off: the INPUT rules that guard it.
                if *e != self.encap {
                    self.encap = *e;
                    self.dirty.statics = true;
                }
            }
            Update::Config(kv) => {
                // WireGuard on or off, or its port: the rules that let it
                // through.
                let wg = crate::model::wireguard::config_keys(kv);
                if wg != self.wg_config {
                    self.wg_config = wg;
                    self.dirty.statics = true;
                }
                // Failsafes, what workloads may send the host, VXLAN.
                // Checked at the edge ([`crate::model::config`]).
                let felix = crate::model::config::FelixConfig::parse(kv).unwrap_or_default();
                let cfg = EndpointsConfig {
                    failsafe_in: felix
                        .failsafe_in
                        .clone()
                        .unwrap_or_else(|| self.base.failsafe_in.clone()),
                    failsafe_out: felix
                        .failsafe_out
                        .clone()
                        .unwrap_or_else(|| self.base.failsafe_out.clone()),
                    endpoint_to_host: felix.endpoint_to_host.unwrap_or(self.base.endpoint_to_host),
                    vxlan: felix.vxlan_mode(self.base.vxlan),
                    vxlan_port: felix.vxlan_port.unwrap_or(self.base.vxlan_port),
                    ..self.base.clone()
                };
                if cfg != self.cfg {
                    self.cfg = cfg;
                    self.dirty.statics = true;
                }
            }
            Update::Policy(id, p) => {
                let old = self.policies.insert(id.clone(), p.clone());
                let moved = old
                    .as_ref()
                    .is_none_or(|o| chains::policy_table(o) != chains::policy_table(p));
                if old.as_ref() != Some(p) {
                    self.dirty.policies.insert(id.clone());
                }
                if moved {
                    self.policy_presence_changed(id);
                }
            }
            Update::Remove(Key::Policy(id)) => {
                if self.policies.remove(id).is_some() {
                    self.dirty.policies.insert(id.clone());
                    self.policy_presence_changed(id);
                }
            }
            Update::Profile(id, p) => {
                let old = self.profiles.insert(id.clone(), p.clone());
                if old.as_ref() != Some(p) {
                    self.dirty.profiles.insert(id.clone());
                }
                if old.is_none() {
                    self.profile_presence_changed(id);
                }
            }
            Update::Remove(Key::Profile(id)) => {
                if self.profiles.remove(id).is_some() {
                    self.dirty.profiles.insert(id.clone());
                    self.profile_presence_changed(id);
                }
            }
            Update::WorkloadEndpoint(id, ep) => {
                let old = self.endpoints.insert(id.clone(), ep.clone());
                if let Some(o) = &old {
                    if o == ep {
                        return;
                    }
                    self.index(id, o, false);
                    self.interface_changed(o.name.as_str());
                }
                self.index(id, ep, true);
                self.interface_changed(ep.name.as_str());
                self.dirty.workloads.insert(id.clone());
                let names = old
                    .iter()
                    .map(|o| o.name.as_str())
                    .chain([ep.name.as_str()]);
                self.dirty.links.extend(names.map(str::to_string));
                // A new or renamed interface changes the dispatch chains.
                self.dirty.dispatch |= old.is_none_or(|o| o.name != ep.name);
            }
            Update::Remove(Key::WorkloadEndpoint(id)) => {
                if let Some(o) = self.endpoints.remove(id) {
                    self.index(id, &o, false);
                    self.interface_changed(o.name.as_str());
                    self.dirty.workloads.insert(id.clone());
                    self.dirty.links.insert(o.name.as_str().to_string());
                    self.dirty.dispatch = true;
                }
            }
            Update::HostEndpoint(id, hep) => {
                if self.hosts.insert(id.clone(), hep.clone()).as_ref() != Some(hep) {
                    self.dirty.statics = true;
                }
            }
            Update::Remove(Key::HostEndpoint(id)) => {
                if self.hosts.remove(id).is_some() {
                    self.dirty.statics = true;
                }
            }
            Update::IpSetUpdate(s) => {
                if self.sets_known.insert(s.id.clone()) {
                    self.dirty.sets.insert(s.id.clone());
                }
            }
            Update::Remove(Key::IpSet(id)) => {
                if self.sets_known.remove(id) {
                    self.dirty.sets.insert(id.clone());
                }
            }
            _ => {}
        }
    }

    fn on_interface(&mut self, event: &crate::interfaces::InterfaceEvent) {
        use crate::interfaces::InterfaceEvent as E;
        let c = self.host_links.apply(event);
        // Up, down, gone or renamed: the status of the endpoints on it.
        let named = match event {
            E::Link { name, .. } | E::LinkRemoved { name, .. } => Some(name.as_str()),
            _ => None,
        };
        for name in named.into_iter().chain(c.links.iter().map(String::as_str)) {
            if let Some(ids) = self.by_name.get(name) {
                self.status_due.extend(ids.iter().cloned());
            }
        }
        // A link came or went: its routes can go in, a host endpoint may
        // now police it (up/down alone only changes the status).
        for name in &c.links {
            self.on_link_change(name);
        }
        if c.addrs {
            self.dirty.statics |= !self.hosts.is_empty();
        }
    }

    fn status(&self) -> Vec<(String, String)> {
        self.broken
            .iter()
            .map(|(owner, why)| {
                let (kind, id) = match owner {
                    Owner::Policy(id) => ("policy", id.to_string()),
                    Owner::Profile(id) => ("profile", id.to_string()),
                    Owner::Workload(id) => ("workload", id.to_string()),
                    Owner::Dispatch => ("chains", "dispatch".into()),
                    Owner::Static => ("chains", "static".into()),
                };
                (
                    format!("{}{kind}.{id}", crate::status::ISOLATED),
                    why.clone(),
                )
            })
            .collect()
    }

    fn status_changes(&mut self) -> Vec<crate::status::StatusEvent> {
        use crate::status::StatusEvent;
        let mut out = Vec::new();
        for id in std::mem::take(&mut self.status_due) {
            let Some(ep) = self.endpoints.get(&id) else {
                if self.reported.remove(&id).is_some() {
                    out.push(StatusEvent::WorkloadEndpointStatusRemove { id });
                }
                continue;
            };
            let link_up = self
                .host_links
                .links
                .get(ep.name.as_str())
                .copied()
                .unwrap_or(false);
            let status = if ep.state == EndpointState::Active && link_up {
                "up"
            } else {
                "down"
            };
            if self.reported.get(&id) != Some(&status) {
                self.reported.insert(id.clone(), status);
                out.push(StatusEvent::WorkloadEndpointStatus {
                    id,
                    status,
                    endpoint: Box::new(ep.clone()),
                });
            }
        }
        // Host endpoints, as Felix: up when it polices at least one
        // interface and all of them are up (the all-interfaces one: up);
        // down otherwise.
        for id in self.hosts.keys() {
            let all = self.resolved.all.as_ref() == Some(id);
            let mut ifaces = self.resolved.interfaces_of(id).peekable();
            let resolved = all || ifaces.peek().is_some();
            let up =
                resolved && ifaces.all(|n| self.host_links.links.get(n).copied().unwrap_or(false));
            let status = if up { "up" } else { "down" };
            if self.reported_hosts.get(id) != Some(&status) {
                self.reported_hosts.insert(id.clone(), status);
                out.push(StatusEvent::HostEndpointStatus {
                    id: id.clone(),
                    status,
                });
            }
        }
        let gone: Vec<HostEndpointId> = self
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
        if !self.dirty.any() {
            return Ok(());
        }
        let d = std::mem::take(&mut self.dirty);
        let mut owners: Vec<Owner> = Vec::new();
        if d.all {
            // Everything set again (after a failure too): no leaf kept.
            *self.dispatch_memo.borrow_mut() = Default::default();
            owners.extend(self.policies.keys().cloned().map(Owner::Policy));
            owners.extend(self.profiles.keys().cloned().map(Owner::Profile));
            owners.extend(self.endpoints.keys().cloned().map(Owner::Workload));
        } else {
            let mut policies = d.policies;
            let mut profiles = d.profiles;
            if !d.sets.is_empty() {
                for (id, p) in &self.policies {
                    if names_any([&p.inbound_rules, &p.outbound_rules], &d.sets) {
                        policies.insert(id.clone());
                    }
                }
                for (id, p) in &self.profiles {
                    if names_any([&p.inbound_rules, &p.outbound_rules], &d.sets) {
                        profiles.insert(id.clone());
                    }
                }
            }
            owners.extend(policies.into_iter().map(Owner::Policy));
            owners.extend(profiles.into_iter().map(Owner::Profile));
            owners.extend(d.workloads.into_iter().map(Owner::Workload));
        }
        if d.all || d.dispatch {
            owners.push(Owner::Dispatch);
        }
        if d.all || d.statics {
            self.resolved = self.resolve_hosts();
            self.warn_unsupported();
            owners.push(Owner::Static);
        }
        let result = self
            .apply_owners(owners, kernel)
            .and_then(|()| self.set_hooks(kernel));
        if let Err(e) = result {
            // Inconsistent input: try everything again next time.
            self.dirty.all = true;
            return Err(e);
        }
        if d.all || !d.links.is_empty() {
            self.update_links(kernel, d.all, d.links);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
