//! Rendering the endpoint chains: pure functions of the manager's state.

use crate::model::config::EndpointToHost;
use std::collections::BTreeMap;

use super::{EndpointsManager, bad, clear, mark, on_mark, rule};
use crate::generictables::{MAX_CHAIN_NAME, Rule};
use crate::managers::ManagerError;
use crate::managers::hosts::Resolved;
use crate::managers::ipsets::VXLAN_SOURCES;
use crate::model::{EndpointState, Id, IpVersion, TierDefault, TierInfo, WorkloadEndpoint};
use crate::rules::{Direction, Renderer};

/// Interfaces per dispatch chain before it is split.
const DISPATCH_LEAF: usize = 32;

/// ICMPv6 types a workload may always send to the host: multicast
/// listener query, report and done (130-132), router solicitation (133),
/// neighbour solicitation and advertisement (135, 136).
const ICMPV6_TO_ROUTER: [u8; 6] = [130, 131, 132, 133, 135, 136];

/// The tables endpoint policy lives in.
pub const FILTER: &str = "filter";
pub const RAW: &str = "raw";
pub const MANGLE: &str = "mangle";

/// Chains of one table: name → rules.
pub(super) type Chains = BTreeMap<String, Vec<Rule>>;

/// Dispatch leaves by their chain's name: the flag, depth and entries
/// they were rendered for, and their rules.
/// A dispatch leaf as last rendered into one IP version's filter, by
/// chain name: its flag, depth, interfaces and rules (a leaf's rules
/// follow from those alone).
pub(super) type DispatchMemo =
    std::collections::HashMap<String, (String, usize, Vec<String>, Vec<Rule>)>;

/// What an endpoint chain is for (Felix's chain types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// filter INPUT/OUTPUT and workloads: conntrack, tiers with their
    /// default drop, profiles, a final drop.
    Normal,
    /// filter FORWARD through a host endpoint: conntrack, tiers with their
    /// default drop; allowed when no policy applies in this direction.
    Forward,
    /// raw: tiers of untracked policies; what they allow is not tracked;
    /// no drop at the end (normal policy still follows).
    Untracked,
    /// mangle PREROUTING: tiers of pre-DNAT policies, no drop at the end.
    PreDnat,
}

impl Kind {
    fn table(self) -> &'static str {
        match self {
            Self::Normal | Self::Forward => FILTER,
            Self::Untracked => RAW,
            Self::PreDnat => MANGLE,
        }
    }
}

/// The table a policy's chains live in.
pub(super) fn policy_table(p: &crate::model::Policy) -> &'static str {
    if p.untracked {
        RAW
    } else if p.pre_dnat {
        MANGLE
    } else {
        FILTER
    }
}

/// `-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT`.
fn established() -> Result<Rule, ManagerError> {
    rule(&[
        "-m",
        "conntrack",
        "--ctstate",
        "RELATED,ESTABLISHED",
        "-j",
        "ACCEPT",
    ])
}

/// `-p P -m multiport --<flag> a,b,… -j ACCEPT` per protocol (15 per rule).
fn port_accepts(ports: &[(String, u16)], flag: &str) -> Result<Vec<Rule>, ManagerError> {
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
                flag,
                &joined,
                "-j",
                "ACCEPT",
            ])?);
        }
    }
    Ok(out)
}

impl EndpointsManager {
    pub(super) fn p(&self, suffix: &str) -> String {
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

    /// A host endpoint chain: `<prefix>-<kind>-<iface>`, or
    /// `<prefix>-<kind>any` for the all-interfaces endpoint (no interface
    /// name can make that one: the `-` is missing).
    fn host_chain(&self, kind: &str, iface: Option<&str>) -> String {
        match iface {
            Some(i) => format!("{}-{kind}-{i}", self.cfg.prefix),
            None => format!("{}-{kind}any", self.cfg.prefix),
        }
    }

    pub(super) fn renderer(&self, v: IpVersion) -> Renderer<'_> {
        Renderer {
            sets: self.sets.clone(),
            marks: self.cfg.marks,
            version: v,
            log_prefix: self.p("policy"),
            known_sets: Some(&self.sets_known),
        }
    }

    fn all_marks(&self) -> u32 {
        let m = self.cfg.marks;
        m.accept | m.pass | m.scratch0 | m.scratch1
    }

    /// The chains of one workload endpoint (filter table).
    pub(super) fn workload_chains(&self, ep: &WorkloadEndpoint) -> Result<Chains, ManagerError> {
        let mut out = Chains::new();
        for dir in [Direction::Inbound, Direction::Outbound] {
            let rules = if ep.state == EndpointState::Down {
                vec![rule(&["-j", "DROP"])?]
            } else {
                self.policy_body(&ep.tiers, &ep.profile_ids, dir, Kind::Normal, None)?
            };
            out.insert(self.endpoint_chain(dir, ep.name.as_str()), rules);
        }
        Ok(out)
    }

    /// A policy's chains, in `table` (none if it lives elsewhere).
    pub(super) fn policy_chains(
        &self,
        id: &crate::model::PolicyId,
        table: &str,
        v: IpVersion,
    ) -> Result<Chains, ManagerError> {
        let mut out = Chains::new();
        let Some(pol) = self.policies.get(id) else {
            return Ok(out);
        };
        if policy_table(pol) != table {
            return Ok(out);
        }
        let r = self.renderer(v);
        out.insert(
            self.chains.policy(Direction::Inbound, id),
            r.rules(&pol.inbound_rules).map_err(bad)?,
        );
        // Pre-DNAT policy is ingress only.
        if table != MANGLE {
            out.insert(
                self.chains.policy(Direction::Outbound, id),
                r.rules(&pol.outbound_rules).map_err(bad)?,
            );
        }
        Ok(out)
    }

    /// A profile's chains (filter table).
    pub(super) fn profile_chains(&self, id: &Id, v: IpVersion) -> Result<Chains, ManagerError> {
        let mut out = Chains::new();
        let Some(prof) = self.profiles.get(id) else {
            return Ok(out);
        };
        let r = self.renderer(v);
        out.insert(
            self.chains.profile(Direction::Inbound, id),
            r.rules(&prof.inbound_rules).map_err(bad)?,
        );
        out.insert(
            self.chains.profile(Direction::Outbound, id),
            r.rules(&prof.outbound_rules).map_err(bad)?,
        );
        Ok(out)
    }

    /// Whether a jump to policy `id` belongs in a chain of `table`.
    fn policy_in(&self, id: &crate::model::PolicyId, table: &str) -> bool {
        self.policies
            .get(id)
            .is_some_and(|p| policy_table(p) == table)
    }

    /// conntrack, failsafe, marks cleared, tiers, then by kind: profiles
    /// and drop, or an allow when no forward policy applies, or nothing.
    pub(super) fn policy_body(
        &self,
        tiers: &[TierInfo],
        profile_ids: &[Id],
        dir: Direction,
        kind: Kind,
        failsafe: Option<&str>,
    ) -> Result<Vec<Rule>, ManagerError> {
        let m = self.cfg.marks;
        let mut out = Vec::new();
        if kind != Kind::Untracked {
            out.push(established()?);
            out.push(rule(&[
                "-m",
                "conntrack",
                "--ctstate",
                "INVALID",
                "-j",
                "DROP",
            ])?);
        }
        if let Some(f) = failsafe {
            out.push(rule(&["-j", f])?);
        }
        out.push(rule(&[
            "-j",
            "MARK",
            "--set-xmark",
            &clear(m.accept | m.pass),
        ])?);
        let table = kind.table();
        let mut any = false;
        for tier in tiers {
            let policies = match dir {
                Direction::Inbound => &tier.ingress_policies,
                Direction::Outbound => &tier.egress_policies,
            };
            if policies.is_empty() {
                continue;
            }
            any = true;
            out.push(rule(&["-j", "MARK", "--set-xmark", &clear(m.pass)])?);
            for pid in policies {
                if !self.policy_in(pid, table) {
                    // Not (yet) known: it cannot allow anything.
                    continue;
                }
                out.push(on_mark(&[], &clear(m.pass), &self.chains.policy(dir, pid))?);
                if kind == Kind::Untracked {
                    out.push(on_mark(&[], &mark(m.accept), "NOTRACK")?);
                }
                out.push(on_mark(&[], &mark(m.accept), "RETURN")?);
            }
            let drops = matches!(kind, Kind::Normal | Kind::Forward);
            if drops && tier.default_action == TierDefault::Deny {
                out.push(on_mark(&[], &clear(m.pass), "DROP")?);
            }
        }
        match kind {
            Kind::Normal => {
                for prof in profile_ids {
                    if !self.profiles.contains_key(prof) {
                        continue;
                    }
                    out.push(rule(&["-j", &self.chains.profile(dir, prof)])?);
                    out.push(on_mark(&[], &mark(m.accept), "RETURN")?);
                }
                out.push(rule(&["-j", "DROP"])?);
            }
            Kind::Forward if !any => {
                // Forwarded traffic is allowed when no apply-on-forward
                // policy applies in this direction (as in Felix).
                out.push(rule(&["-j", "MARK", "--set-xmark", &mark(m.accept)])?);
                out.push(rule(&["-j", "RETURN"])?);
            }
            _ => {}
        }
        Ok(out)
    }

    /// The failsafe chains of `table`: (in, out). In raw, before conntrack,
    /// each also lets the replies of the other direction's ports through,
    /// so that no untracked policy can catch half a failsafe connection.
    fn failsafe_chains(&self, table: &str) -> Result<(Vec<Rule>, Vec<Rule>), ManagerError> {
        let (fin, fout) = (&self.cfg.failsafe_in, &self.cfg.failsafe_out);
        let mut inbound = port_accepts(fin, "--dports")?;
        let mut outbound = port_accepts(fout, "--dports")?;
        if table == RAW {
            inbound.extend(port_accepts(fout, "--sports")?);
            outbound.extend(port_accepts(fin, "--sports")?);
        }
        Ok((inbound, outbound))
    }

    /// Dispatch rules `-i|-o <iface> -g <chain>` for `ifaces`, and the
    /// all-interfaces default (workload interfaces and `lo` excepted).
    fn dispatch(
        &self,
        flag: &str,
        kind: &str,
        ifaces: &[&str],
        all: bool,
    ) -> Result<Vec<Rule>, ManagerError> {
        let mut out = Vec::new();
        if all {
            let wl = format!("{}+", self.cfg.workload_prefix);
            out.push(rule(&[flag, &wl, "-j", "RETURN"])?);
            out.push(rule(&[flag, "lo", "-j", "RETURN"])?);
        }
        for i in ifaces {
            out.push(rule(&[flag, i, "-g", &self.host_chain(kind, Some(i))])?);
        }
        if all {
            out.push(rule(&["-g", &self.host_chain(kind, None)])?);
        }
        Ok(out)
    }

    /// Whether raw and mangle carry host endpoint chains (some resolved
    /// host endpoint has untracked or pre-DNAT policy).
    pub(super) fn host_tables_active(&self, res: &Resolved) -> bool {
        let named = res.named.values().any(|id| {
            self.hosts
                .get(id)
                .is_some_and(|h| !h.untracked_tiers.is_empty() || !h.pre_dnat_tiers.is_empty())
        });
        let all = res
            .all
            .as_ref()
            .and_then(|id| self.hosts.get(id))
            .is_some_and(|h| !h.pre_dnat_tiers.is_empty());
        named || all
    }

    /// Every chain of `table` not owned by a policy, profile or workload:
    /// the top-level chains, dispatch, failsafe and host endpoint chains.
    pub(super) fn static_chains(
        &self,
        table: &str,
        v: IpVersion,
        res: &Resolved,
    ) -> Result<Chains, ManagerError> {
        let active = self.host_tables_active(res);
        match table {
            FILTER => self.filter_chains(res, active, v),
            RAW if active => self.raw_chains(res),
            MANGLE if active => self.mangle_chains(res),
            _ => Ok(Chains::new()),
        }
    }

    fn filter_chains(
        &self,
        res: &Resolved,
        active: bool,
        v: IpVersion,
    ) -> Result<Chains, ManagerError> {
        let m = self.cfg.marks;
        let wl = format!("{}+", self.cfg.workload_prefix);
        let (from, to) = (self.p("from-wl-dispatch"), self.p("to-wl-dispatch"));
        let (fhe, the) = (self.p("from-host-endpoint"), self.p("to-host-endpoint"));
        let (fhf, thf) = (self.p("from-hep-forward"), self.p("to-hep-forward"));
        let all = self.all_marks();
        // A packet raw or mangle accepted (untracked or pre-DNAT policy)
        // carries the accept mark; only then is that mark ours to trust.
        let already = || on_mark(&[], &mark(m.accept), "ACCEPT");
        let mut chains = Chains::new();

        let mut fwd = vec![rule(&[
            "-j",
            "MARK",
            "--set-xmark",
            &clear(if active { all & !m.accept } else { all }),
        ])?];
        fwd.push(on_mark(&[], &clear(m.accept), &fhf)?);
        // A workload's chains end in its accept mark or a drop; one that
        // returns without the mark (emptied by hand or by another agent)
        // is a drop here, not the accept of the other direction's mark:
        // fail closed until the refresh puts it back.
        fwd.push(rule(&["-i", &wl, "-j", &from])?);
        fwd.push(on_mark(&["-i", &wl], &clear(m.accept), "DROP")?);
        fwd.push(rule(&[
            "-o",
            &wl,
            "-j",
            "MARK",
            "--set-xmark",
            &clear(m.accept),
        ])?);
        fwd.push(rule(&["-o", &wl, "-j", &to])?);
        fwd.push(on_mark(&["-o", &wl], &clear(m.accept), "DROP")?);
        fwd.push(rule(&["-j", &thf])?);
        fwd.push(on_mark(&[], &mark(m.accept), "ACCEPT")?);
        chains.insert(self.p("FORWARD"), fwd);

        // IPv6: what a workload needs of its router (the host) is accepted
        // before its egress policy, so that no policy can cut it off from
        // its gateway (Felix's ICMPv6Filter in cali-wl-to-host).
        let mut input = match v {
            IpVersion::V4 => Vec::new(),
            IpVersion::V6 => ICMPV6_TO_ROUTER
                .iter()
                .map(|t| {
                    let t = t.to_string();
                    rule(&[
                        "-i",
                        &wl,
                        "-p",
                        "ipv6-icmp",
                        "-m",
                        "icmp6",
                        "--icmpv6-type",
                        &t,
                        "-j",
                        "ACCEPT",
                    ])
                })
                .collect::<Result<_, _>>()?,
        };
        // VXLAN to this host only from the nodes we know (Felix's
        // all-vxlan-net rules): a forged VXLAN packet from elsewhere on the
        // underlay cannot inject traffic into the pod network.
        let mut vxlan_out = None;
        if self.cfg.vxlan.on(&self.encap, v, true) {
            let port = self.cfg.vxlan_port.to_string();
            let sources = self
                .sets
                .name(v, &Id::new(VXLAN_SOURCES).expect("a valid id"));
            let vxlan = ["-p", "udp", "-m", "udp", "--dport", port.as_str()];
            let local = ["-m", "addrtype", "--dst-type", "LOCAL"];
            let from_known = ["-m", "set", "--match-set", sources.as_str(), "src"];
            input.push(rule(
                &[&vxlan[..], &from_known, &local, &["-j", "ACCEPT"]].concat(),
            )?);
            input.push(rule(&[&vxlan[..], &local, &["-j", "DROP"]].concat())?);
            // And from this host to those nodes, whatever host-endpoint
            // policy says (Felix: "Allow VXLAN packets to other allowed
            // hosts").
            let to_known = ["-m", "set", "--match-set", sources.as_str(), "dst"];
            let from_here = ["-m", "addrtype", "--src-type", "LOCAL"];
            vxlan_out = Some(rule(
                &[&vxlan[..], &to_known, &from_here, &["-j", "ACCEPT"]].concat(),
            )?);
        }
        // WireGuard to and from this host, whatever host-endpoint policy
        // says (Felix's FilterInputChainAllowWG and its output twin): the
        // peers and allowed IPs are the filter.
        let wg = self.wireguard_port(v).map(|p| p.to_string());
        let wg_udp = wg
            .as_ref()
            .map(|p| ["-p", "udp", "-m", "udp", "--dport", p.as_str()]);
        if let Some(udp) = &wg_udp {
            input.push(rule(
                &[
                    &udp[..],
                    &["-m", "addrtype", "--dst-type", "LOCAL", "-j", "ACCEPT"],
                ]
                .concat(),
            )?);
        }
        // From a workload: its egress policy, then what
        // DefaultEndpointToHostAction says of what that allowed.
        input.push(rule(&["-i", &wl, "-j", &from])?);
        match self.cfg.endpoint_to_host {
            EndpointToHost::Accept => input.push(on_mark(&["-i", &wl], &mark(m.accept), "ACCEPT")?),
            EndpointToHost::Return => input.push(on_mark(&["-i", &wl], &mark(m.accept), "RETURN")?),
            EndpointToHost::Drop => {}
        }
        input.push(rule(&["-i", &wl, "-j", "DROP"])?);
        if active {
            input.push(already()?);
        }
        // Host endpoints (opt-in: interfaces without one are not policed).
        input.push(rule(&["-j", "MARK", "--set-xmark", &clear(all)])?);
        input.push(rule(&["-j", &fhe])?);
        input.push(on_mark(&[], &mark(m.accept), "ACCEPT")?);
        chains.insert(self.p("INPUT"), input);

        // The host may reach its workloads (kubelet probes), as in Felix;
        // traffic leaving through a host endpoint is policed.
        let mut output = Vec::new();
        if active {
            output.push(already()?);
        }
        output.extend(vxlan_out);
        if let Some(udp) = &wg_udp {
            output.push(rule(
                &[
                    &udp[..],
                    &["-m", "addrtype", "--src-type", "LOCAL", "-j", "ACCEPT"],
                ]
                .concat(),
            )?);
        }
        output.push(rule(&["-o", &wl, "-j", "RETURN"])?);
        output.push(rule(&["-j", "MARK", "--set-xmark", &clear(all)])?);
        output.push(rule(&["-j", &the])?);
        output.push(on_mark(&[], &mark(m.accept), "ACCEPT")?);
        chains.insert(self.p("OUTPUT"), output);

        let (fs_in, fs_out) = (self.p("failsafe-in"), self.p("failsafe-out"));
        let (fin, fout) = self.failsafe_chains(FILTER)?;
        chains.insert(fs_in.clone(), fin);
        chains.insert(fs_out.clone(), fout);

        let ifaces: Vec<&str> = res.named.keys().map(String::as_str).collect();
        let has_all = res.all.is_some();
        chains.insert(fhe, self.dispatch("-i", "fh", &ifaces, has_all)?);
        chains.insert(the, self.dispatch("-o", "th", &ifaces, has_all)?);
        chains.insert(fhf, self.dispatch("-i", "fhfw", &ifaces, has_all)?);
        chains.insert(thf, self.dispatch("-o", "thfw", &ifaces, has_all)?);
        let targets = res
            .named
            .iter()
            .map(|(i, id)| (Some(i.as_str()), id))
            .chain(res.all.iter().map(|id| (None, id)));
        for (iface, id) in targets {
            let Some(h) = self.hosts.get(id) else {
                continue;
            };
            let body = |tiers: &[TierInfo], dir, kind, fs: Option<&str>| {
                self.policy_body(tiers, &h.profile_ids, dir, kind, fs)
            };
            chains.insert(
                self.host_chain("fh", iface),
                body(&h.tiers, Direction::Inbound, Kind::Normal, Some(&fs_in))?,
            );
            chains.insert(
                self.host_chain("th", iface),
                body(&h.tiers, Direction::Outbound, Kind::Normal, Some(&fs_out))?,
            );
            chains.insert(
                self.host_chain("fhfw", iface),
                body(&h.forward_tiers, Direction::Inbound, Kind::Forward, None)?,
            );
            chains.insert(
                self.host_chain("thfw", iface),
                body(&h.forward_tiers, Direction::Outbound, Kind::Forward, None)?,
            );
        }

        Ok(chains)
    }

    /// The workload dispatch chains (filter): from and to each workload
    /// interface, as a tree split by the characters of the names. Leaves
    /// that are as they were last time are not in the result but in
    /// `dispatch_kept` (their chains are still set in the tables).
    pub(super) fn dispatch_chains(&self, v: IpVersion) -> Result<Chains, ManagerError> {
        let vi = usize::from(v == IpVersion::V6);
        let wl = self.cfg.workload_prefix.as_str();
        // Only names with the workload prefix can reach dispatch at all.
        let mut ifaces: Vec<&str> = self
            .endpoints
            .values()
            .map(|ep| ep.name.as_str())
            .filter(|n| n.starts_with(wl))
            .collect();
        ifaces.sort_unstable();
        ifaces.dedup();
        let mut chains = Chains::new();
        let mut memo = DispatchMemo::new();
        self.dispatch_kept.borrow_mut().clear();
        for (flag, dir, root) in [
            ("-i", Direction::Outbound, self.p("from-wl-dispatch")),
            ("-o", Direction::Inbound, self.p("to-wl-dispatch")),
        ] {
            self.dispatch_tree(
                (flag, dir, vi),
                (&root, root.clone()),
                wl.len(),
                &ifaces,
                (&mut chains, &mut memo),
            )?;
        }
        // What was not rendered this time is let go.
        self.dispatch_memo.borrow_mut()[vi] = memo;
        Ok(chains)
    }

    /// The dispatch roots alone, empty, for a table that sends every
    /// workload interface on as one
    /// ([`crate::backends::desired::RuleTable::dispatch_by_interface`]).
    pub(super) fn dispatch_roots(&self) -> Chains {
        let mut chains = Chains::new();
        for root in ["from-wl-dispatch", "to-wl-dispatch"] {
            chains.insert(self.p(root), Vec::new());
        }
        chains
    }

    /// One dispatch chain `name` for `entries` (sorted by interface, all
    /// sharing their first `depth` bytes): a rule per interface, or, when
    /// there are many, one `-i <name prefix>+ -g <child>` per next
    /// character (Felix splits its dispatch chains the same way), so that
    /// an endpoint coming or going rewrites one small chain rather than a
    /// chain with a rule per endpoint. Characters all of them share make
    /// no level of their own, and a child whose name would be too long is
    /// named by a hash of its prefix (`<root>.<hex>`, where a name from the prefix has a `-`), so that names with
    /// a long common prefix split too. Unknown interfaces are dropped at
    /// every level: fail closed.
    fn dispatch_tree(
        &self,
        (flag, dir, vi): (&str, Direction, usize),
        (root, name): (&str, String),
        depth: usize,
        entries: &[&str],
        (out, memo): (&mut Chains, &mut DispatchMemo),
    ) -> Result<(), ManagerError> {
        // A leaf (a rule per interface, no subtree) rendered for the same
        // interfaces last time is taken as it was (the flag gives the
        // direction, so the same targets).
        let hit = self.dispatch_memo.borrow_mut()[vi]
            .remove(&name)
            .filter(|(f, d, e, _)| {
                f == flag
                    && *d == depth
                    && e.len() == entries.len()
                    && e.iter().zip(entries).all(|(a, b)| a == b)
            });
        if let Some(m) = hit {
            // Set last time as it is now: named, not set again (cloning
            // and comparing thousands of rules per endpoint added).
            self.dispatch_kept.borrow_mut().push(name.clone());
            memo.insert(name, m);
            return Ok(());
        }
        let first_depth = depth;
        let mut rules = Vec::new();
        let mut leaf = true;
        // Room for a hashed child name of at least 4 characters.
        let split = entries.len() > DISPATCH_LEAF && root.len() + 5 <= MAX_CHAIN_NAME;
        let mut depth = depth;
        if split {
            let first = entries[0].as_bytes();
            while let Some(c) = first.get(depth)
                && entries.iter().all(|n| n.as_bytes().get(depth) == Some(c))
            {
                depth += 1;
            }
        }
        let wl = self.cfg.workload_prefix.len();
        let to_endpoint =
            |iface: &str| rule(&[flag, iface, "-g", &self.endpoint_chain(dir, iface)]);
        let mut i = 0;
        while i < entries.len() {
            let iface = entries[i];
            let Some(key) = iface.get(..=depth).filter(|_| split) else {
                rules.push(to_endpoint(iface)?);
                i += 1;
                continue;
            };
            let j = i + entries[i..]
                .iter()
                .take_while(|n| n.get(..=depth) == Some(key))
                .count();
            if j - i == 1 {
                rules.push(to_endpoint(iface)?);
            } else {
                let named = format!("{root}-{}", &key[wl..]);
                let child = if named.len() <= MAX_CHAIN_NAME {
                    named
                } else {
                    use sha2::Digest as _;
                    let sum = sha2::Sha224::digest(key.as_bytes());
                    let hex = hex::encode(sum);
                    format!("{root}.{}", &hex[..MAX_CHAIN_NAME - root.len() - 1])
                };
                rules.push(rule(&[flag, &format!("{key}+"), "-g", &child])?);
                self.dispatch_tree(
                    (flag, dir, vi),
                    (root, child),
                    depth + 1,
                    &entries[i..j],
                    (&mut *out, &mut *memo),
                )?;
                leaf = false;
            }
            i = j;
        }
        rules.push(rule(&["-j", "DROP"])?);
        if leaf {
            let kept = entries.iter().map(|i| i.to_string()).collect();
            memo.insert(
                name.clone(),
                (flag.to_string(), first_depth, kept, rules.clone()),
            );
        }
        out.insert(name, rules);
        Ok(())
    }

    /// raw: untracked policy of host endpoints on named interfaces (Felix
    /// does not support it on the all-interfaces endpoint either).
    fn raw_chains(&self, res: &Resolved) -> Result<Chains, ManagerError> {
        let m = self.cfg.marks;
        let wl = format!("{}+", self.cfg.workload_prefix);
        let (fhe, the) = (self.p("from-host-endpoint"), self.p("to-host-endpoint"));
        let (fs_in, fs_out) = (self.p("failsafe-in"), self.p("failsafe-out"));
        let clear_all = clear(self.all_marks());
        let mut chains = Chains::new();
        chains.insert(
            self.p("PREROUTING"),
            vec![
                // Ours from here on, whatever ran before us.
                rule(&["-j", "MARK", "--set-xmark", &clear_all])?,
                rule(&["-i", &wl, "-j", "RETURN"])?,
                rule(&["-j", &fhe])?,
                on_mark(&[], &mark(m.accept), "ACCEPT")?,
            ],
        );
        chains.insert(
            self.p("OUTPUT"),
            vec![
                rule(&["-j", "MARK", "--set-xmark", &clear_all])?,
                rule(&["-j", &the])?,
                on_mark(&[], &mark(m.accept), "ACCEPT")?,
            ],
        );
        let (fin, fout) = self.failsafe_chains(RAW)?;
        chains.insert(fs_in.clone(), fin);
        chains.insert(fs_out.clone(), fout);
        let untracked: Vec<(&str, &crate::model::HostEndpoint)> = res
            .named
            .iter()
            .filter_map(|(i, id)| Some((i.as_str(), self.hosts.get(id)?)))
            .filter(|(_, h)| !h.untracked_tiers.is_empty())
            .collect();
        let ifaces: Vec<&str> = untracked.iter().map(|(i, _)| *i).collect();
        chains.insert(fhe, self.dispatch("-i", "fh", &ifaces, false)?);
        chains.insert(the, self.dispatch("-o", "th", &ifaces, false)?);
        for (iface, h) in untracked {
            let t = &h.untracked_tiers;
            chains.insert(
                self.host_chain("fh", Some(iface)),
                self.policy_body(t, &[], Direction::Inbound, Kind::Untracked, Some(&fs_in))?,
            );
            chains.insert(
                self.host_chain("th", Some(iface)),
                self.policy_body(t, &[], Direction::Outbound, Kind::Untracked, Some(&fs_out))?,
            );
        }
        Ok(chains)
    }

    /// mangle PREROUTING: pre-DNAT (ingress) policy of host endpoints.
    fn mangle_chains(&self, res: &Resolved) -> Result<Chains, ManagerError> {
        let m = self.cfg.marks;
        let wl = format!("{}+", self.cfg.workload_prefix);
        let fhe = self.p("from-host-endpoint");
        let fs_in = self.p("failsafe-in");
        let mut chains = Chains::new();
        chains.insert(
            self.p("PREROUTING"),
            vec![
                established()?,
                // Accepted by untracked policy in raw.
                on_mark(&[], &mark(m.accept), "ACCEPT")?,
                rule(&["-i", &wl, "-j", "RETURN"])?,
                rule(&["-j", &fhe])?,
                on_mark(&[], &mark(m.accept), "ACCEPT")?,
            ],
        );
        chains.insert(fs_in.clone(), self.failsafe_chains(MANGLE)?.0);
        let pre = |id: &crate::model::HostEndpointId| {
            self.hosts.get(id).filter(|h| !h.pre_dnat_tiers.is_empty())
        };
        let named: Vec<(&str, &crate::model::HostEndpoint)> = res
            .named
            .iter()
            .filter_map(|(i, id)| Some((i.as_str(), pre(id)?)))
            .collect();
        let all = res.all.as_ref().and_then(pre);
        let ifaces: Vec<&str> = named.iter().map(|(i, _)| *i).collect();
        chains.insert(fhe, self.dispatch("-i", "fh", &ifaces, all.is_some())?);
        let targets = named
            .into_iter()
            .map(|(i, h)| (Some(i), h))
            .chain(all.map(|h| (None, h)));
        for (iface, h) in targets {
            chains.insert(
                self.host_chain("fh", iface),
                self.policy_body(
                    &h.pre_dnat_tiers,
                    &[],
                    Direction::Inbound,
                    Kind::PreDnat,
                    Some(&fs_in),
                )?,
            );
        }
        Ok(chains)
    }
}
