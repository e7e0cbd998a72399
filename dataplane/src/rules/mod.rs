//! Rendering the calc graph's policy and profile rules into iptables rules
//! (Felix's `felix/rules/`). Pure: model in, [`Rule`](crate::generictables::Rule)s out; the
//! managers place them in chains and the table backend writes them.
//!
//! A rule becomes, in Felix's match order: protocol, source nets, source IP
//! sets, source ports, source named ports, destination nets, sets, ip-port
//! sets, ports, named ports, ICMP, then every `not_` form. Lists that must
//! match any one of their items (several CIDRs, more than 15 port slots, or
//! ports together with named ports) become a match block: a scratch mark is
//! cleared, set by one rule per alternative, and required by the rule
//! itself. Actions follow Felix: allow and pass set their mark and return,
//! deny drops, log logs. A rule for the other IP version is skipped.
//!
//! Fields that cannot be enforced here (HTTP matches, service-account
//! matches) fail closed: an allow, pass or log rule carrying one is left out
//! (it never matches); a deny rule is kept without it (it matches more).

use ipnet::IpNet;

use crate::generictables::{MAX_CHAIN_NAME, Rule as IptRule, RuleError};
use crate::model::ipsets::SetNames;
use crate::model::{Action, IcmpMatch, Id, IpVersion, Marks, PolicyId, PortRange, Protocol, Rule};

fn mark(m: u32) -> String {
    format!("{m:#x}/{m:#x}")
}

/// Ingress (to the endpoint) or egress (from it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Inbound,
    Outbound,
}

/// The kinds of chain that hold one object's rules alone: a policy's
/// (`pi-`, `po-`), a profile's (`pri-`, `pro-`) and a workload endpoint's
/// (`tw-`, `fw-`, and the nftables shards' policy lists `tw-list-…`).
const ISOLATABLE: [&str; 6] = ["pi-", "po-", "pri-", "pro-", "tw-", "fw-"];

/// Whether chain `name` (of chain prefix `chain_prefix`, e.g. `dph-`) is
/// one that a backend may hold fail-closed alone (a single drop) when the
/// kernel refuses its rules: a policy's, profile's or workload's. The
/// top-level, dispatch and host endpoint chains are not: dropping in them
/// would cut off more than the one object (the host's own traffic, its
/// failsafe ports).
pub fn isolatable(chain_prefix: &str, name: &str) -> bool {
    name.strip_prefix(chain_prefix)
        .is_some_and(|r| ISOLATABLE.iter().any(|k| r.starts_with(k)))
}

/// Names of the chains rules live in.
#[derive(Debug, Clone)]
pub struct ChainNames {
    prefix: String,
}

fn chain_safe(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b))
}

impl ChainNames {
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_string(),
        }
    }

    /// `head` + `suffix`, or `head` + `_` + base64url(sha256(suffix)) cut to
    /// the 28-character limit when the suffix is too long or has characters
    /// a chain name cannot hold. Deterministic.
    fn limited(head: &str, suffix: &str) -> String {
        use base64::Engine;
        use sha2::Digest;
        if head.len() + suffix.len() <= MAX_CHAIN_NAME
            && chain_safe(suffix)
            && !suffix.starts_with('_')
        {
            return format!("{head}{suffix}");
        }
        let hash = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(sha2::Sha256::digest(suffix.as_bytes()));
        format!("{head}_{}", &hash[..MAX_CHAIN_NAME - head.len() - 1])
    }

    /// `<prefix>-pi-<policy>` / `<prefix>-po-<policy>`. A policy with a
    /// namespace or kind is named by a hash of all three, so two policies
    /// never share a chain.
    pub fn policy(&self, dir: Direction, id: &PolicyId) -> String {
        let d = match dir {
            Direction::Inbound => "pi",
            Direction::Outbound => "po",
        };
        let suffix = match (&id.namespace, &id.kind) {
            (None, None) => id.name.as_str().to_string(),
            (ns, kind) => format!(
                "_{}|{}|{}",
                kind.as_ref().map_or("", Id::as_str),
                ns.as_ref().map_or("", Id::as_str),
                id.name.as_str()
            ),
        };
        Self::limited(&format!("{}-{d}-", self.prefix), &suffix)
    }

    /// `<prefix>-pri-<profile>` / `<prefix>-pro-<profile>`.
    pub fn profile(&self, dir: Direction, id: &Id) -> String {
        let d = match dir {
            Direction::Inbound => "pri",
            Direction::Outbound => "pro",
        };
        Self::limited(&format!("{}-{d}-", self.prefix), id.as_str())
    }
}

/// Renders rules for one IP version.
#[derive(Debug, Clone)]
pub struct Renderer<'a> {
    pub sets: SetNames,
    pub marks: Marks,
    pub version: IpVersion,
    /// `--log-prefix` of log rules.
    pub log_prefix: String,
    /// The IP sets that exist, if known. A rule that needs a set that does
    /// not exist is rendered as if the set were empty: a positive match
    /// never matches (the rule is left out), a negated one always does
    /// (the match is left out). So a set removed while a policy still names
    /// it neither breaks the rule nor stays pinned in the kernel by it.
    pub known_sets: Option<&'a std::collections::BTreeSet<Id>>,
}

fn of_version(nets: &[IpNet], v: IpVersion) -> Vec<IpNet> {
    nets.iter()
        .filter(|n| IpVersion::of(&n.addr()) == v)
        .copied()
        .collect()
}

fn proto_token(p: Protocol, v: IpVersion) -> String {
    match (p, v) {
        (Protocol::TCP, _) => "tcp".into(),
        (Protocol::UDP, _) => "udp".into(),
        (Protocol::SCTP, _) => "sctp".into(),
        (Protocol::UDPLITE, _) => "udplite".into(),
        (Protocol::ICMP, IpVersion::V4) => "icmp".into(),
        (Protocol::ICMPV6, IpVersion::V6) => "ipv6-icmp".into(),
        (Protocol(n), _) => n.to_string(),
    }
}

/// Port ranges in multiport syntax, chunked to its 15 slots (a range takes
/// two).
fn port_chunks(ports: &[PortRange]) -> Vec<String> {
    let mut chunks = Vec::new();
    let (mut cur, mut slots) = (Vec::new(), 0);
    for p in ports {
        let (text, n) = if p.first == p.last {
            (p.first.to_string(), 1)
        } else {
            (format!("{}:{}", p.first, p.last), 2)
        };
        if slots + n > 15 {
            chunks.push(cur.join(","));
            cur.clear();
            slots = 0;
        }
        cur.push(text);
        slots += n;
    }
    if !cur.is_empty() {
        chunks.push(cur.join(","));
    }
    chunks
}

fn icmp_tokens(m: &IcmpMatch, v: IpVersion, negate: bool) -> Vec<String> {
    let value = match m.code {
        Some(c) => format!("{}/{c}", m.icmp_type),
        None => m.icmp_type.to_string(),
    };
    let (module, flag) = match v {
        IpVersion::V4 => ("icmp", "--icmp-type"),
        IpVersion::V6 => ("icmp6", "--icmpv6-type"),
    };
    let mut t = vec!["-m".to_string(), module.into()];
    if negate {
        t.push("!".into());
    }
    t.extend([flag.to_string(), value]);
    t
}

/// One "any of these" group: the alternatives' match tokens.
type Block = Vec<Vec<String>>;

impl Renderer<'_> {
    fn set(&self, id: &Id) -> String {
        self.sets.name(self.version, id)
    }

    fn exists(&self, id: &Id) -> bool {
        self.known_sets.is_none_or(|k| k.contains(id))
    }

    /// The rules for `rule` (none if it does not apply to this version or
    /// fails closed).
    pub fn rule(&self, rule: &Rule) -> Result<Vec<IptRule>, RuleError> {
        let v = self.version;
        if rule.ip_version.is_some_and(|rv| rv != v) {
            return Ok(Vec::new());
        }
        if let Some(p) = rule.protocol
            && ((p == Protocol::ICMP && v == IpVersion::V6)
                || (p == Protocol::ICMPV6 && v == IpVersion::V4))
        {
            return Ok(Vec::new());
        }
        let action = rule.action();
        if !rule.unsupported.is_empty() && action != Action::Deny {
            return Ok(Vec::new());
        }
        // A positive match on a set that does not exist matches nothing.
        let needed = rule
            .src_ip_set_ids
            .iter()
            .chain(&rule.dst_ip_set_ids)
            .chain(&rule.dst_ip_port_set_ids);
        if needed.clone().any(|id| !self.exists(id)) {
            return Ok(Vec::new());
        }
        let named_src: Vec<Id> = rule
            .src_named_port_ip_set_ids
            .iter()
            .filter(|i| self.exists(i))
            .cloned()
            .collect();
        let named_dst: Vec<Id> = rule
            .dst_named_port_ip_set_ids
            .iter()
            .filter(|i| self.exists(i))
            .cloned()
            .collect();
        for (ports, all, kept) in [
            (&rule.src_ports, &rule.src_named_port_ip_set_ids, &named_src),
            (&rule.dst_ports, &rule.dst_named_port_ip_set_ids, &named_dst),
        ] {
            // Only named ports were given and none of their sets exists.
            if ports.is_empty() && !all.is_empty() && kept.is_empty() {
                return Ok(Vec::new());
            }
        }
        let mut m: Vec<String> = Vec::new();
        let mut blocks: Vec<Block> = Vec::new();
        let push = |m: &mut Vec<String>, t: &[&str]| m.extend(t.iter().map(|s| s.to_string()));

        // Block alternatives carry the protocol too: multiport needs it.
        let proto: Vec<String> = rule
            .protocol
            .map(|p| vec!["-p".to_string(), proto_token(p, v)])
            .unwrap_or_default();
        m.extend(proto.iter().cloned());
        for (nets, flag) in [(&rule.src_net, "-s"), (&rule.dst_net, "-d")] {
            let mine = of_version(nets, v);
            if !nets.is_empty() && mine.is_empty() {
                return Ok(Vec::new()); // only nets of the other version
            }
            match mine.len() {
                0 => {}
                1 => push(&mut m, &[flag, &mine[0].to_string()]),
                _ => blocks.push(
                    mine.iter()
                        .map(|n| vec![flag.to_string(), n.to_string()])
                        .collect(),
                ),
            }
        }
        for id in &rule.src_ip_set_ids {
            push(&mut m, &["-m", "set", "--match-set", &self.set(id), "src"]);
        }
        for id in &rule.dst_ip_set_ids {
            push(&mut m, &["-m", "set", "--match-set", &self.set(id), "dst"]);
        }
        for id in &rule.dst_ip_port_set_ids {
            push(
                &mut m,
                &["-m", "set", "--match-set", &self.set(id), "dst,dst"],
            );
        }
        for (ports, named, flag, dir) in [
            (&rule.src_ports, &named_src, "--source-ports", "src,src"),
            (
                &rule.dst_ports,
                &named_dst,
                "--destination-ports",
                "dst,dst",
            ),
        ] {
            let chunks = port_chunks(ports);
            if chunks.len() == 1 && named.is_empty() {
                push(&mut m, &["-m", "multiport", flag, &chunks[0]]);
            } else if chunks.is_empty() && named.len() == 1 {
                push(
                    &mut m,
                    &["-m", "set", "--match-set", &self.set(&named[0]), dir],
                );
            } else if !chunks.is_empty() || !named.is_empty() {
                let mut b: Block = chunks
                    .iter()
                    .map(|c| vec!["-m".into(), "multiport".into(), flag.into(), c.clone()])
                    .collect();
                for id in named {
                    b.push(vec![
                        "-m".into(),
                        "set".into(),
                        "--match-set".into(),
                        self.set(id),
                        dir.into(),
                    ]);
                }
                blocks.push(b);
            }
        }
        if let Some(i) = &rule.icmp {
            m.extend(icmp_tokens(i, v, false));
        }
        // Negations: each is ANDed, which is what "not any of" means.
        match (rule.protocol, rule.not_protocol) {
            // "tcp and not tcp" never matches.
            (Some(p), Some(n)) if p == n => return Ok(Vec::new()),
            // "tcp and not udp" is just tcp (and iptables allows one -p).
            (Some(_), Some(_)) | (_, None) => {}
            (None, Some(n)) => push(&mut m, &["!", "-p", &proto_token(n, v)]),
        }
        for (nets, flag) in [(&rule.not_src_net, "-s"), (&rule.not_dst_net, "-d")] {
            let mine = of_version(nets, v);
            // As Felix renders it (felix/rules/policy.go,
            // FilterRuleToIPVersion): negated nets all of the other family
            // drop the rule from this family, as positive ones do; so does
            // a negated catch-all (a contradiction). Found by the
            // differential run against Felix's own dataplane (seed 51).
            if (!nets.is_empty() && mine.is_empty()) || mine.iter().any(|n| n.prefix_len() == 0) {
                return Ok(Vec::new());
            }
            for n in mine {
                push(&mut m, &["!", flag, &n.to_string()]);
            }
        }
        for (ports, flag) in [
            (&rule.not_src_ports, "--source-ports"),
            (&rule.not_dst_ports, "--destination-ports"),
        ] {
            for c in port_chunks(ports) {
                push(&mut m, &["-m", "multiport", "!", flag, &c]);
            }
        }
        if let Some(i) = &rule.not_icmp {
            m.extend(icmp_tokens(i, v, true));
        }
        for (ids, dir) in [
            (&rule.not_src_ip_set_ids, "src"),
            (&rule.not_dst_ip_set_ids, "dst"),
            (&rule.not_src_named_port_ip_set_ids, "src,src"),
            (&rule.not_dst_named_port_ip_set_ids, "dst,dst"),
        ] {
            // Not in a set that does not exist: always true.
            for id in ids.iter().filter(|i| self.exists(i)) {
                push(
                    &mut m,
                    &["-m", "set", "!", "--match-set", &self.set(id), dir],
                );
            }
        }

        let scratch = [self.marks.scratch0, self.marks.scratch1];
        if blocks.len() > scratch.len() {
            // More "any of" groups than scratch marks: fail closed.
            return Ok(if action == Action::Deny {
                vec![self.make(&m, &["-j", "DROP"])?]
            } else {
                Vec::new()
            });
        }
        let mut out = Vec::new();
        for (block, bit) in blocks.iter().zip(scratch) {
            out.push(self.make(&[], &["-j", "MARK", "--set-xmark", &format!("0/{bit:#x}")])?);
            for alt in block {
                let alt: Vec<&str> = proto.iter().chain(alt).map(String::as_str).collect();
                out.push(self.make_strs(&alt, &["-j", "MARK", "--set-xmark", &mark(bit)])?);
            }
            push(&mut m, &["-m", "mark", "--mark", &mark(bit)]);
        }
        match action {
            Action::Allow | Action::Pass => {
                let bit = if action == Action::Allow {
                    self.marks.accept
                } else {
                    self.marks.pass
                };
                out.push(self.make(&m, &["-j", "MARK", "--set-xmark", &mark(bit)])?);
                out.push(self.make(&[], &["-m", "mark", "--mark", &mark(bit), "-j", "RETURN"])?);
            }
            Action::Deny => out.push(self.make(&m, &["-j", "DROP"])?),
            Action::Log => {
                out.push(self.make(&m, &["-j", "LOG", "--log-prefix", &self.log_prefix])?)
            }
        }
        Ok(out)
    }

    fn make(&self, m: &[String], tail: &[&str]) -> Result<IptRule, RuleError> {
        IptRule::new(m.iter().map(String::as_str).chain(tail.iter().copied()))
    }

    fn make_strs(&self, m: &[&str], tail: &[&str]) -> Result<IptRule, RuleError> {
        IptRule::new(m.iter().copied().chain(tail.iter().copied()))
    }

    /// All rules of a policy or profile direction, in order.
    pub fn rules(&self, rules: &[Rule]) -> Result<Vec<IptRule>, RuleError> {
        let mut out = Vec::new();
        for r in rules {
            out.extend(self.rule(r)?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
