//! Policies, profiles and their rules.

use ipnet::IpNet;

use super::{Id, IpVersion, Valid, ValidationError};

/// `PolicyID`: name, plus namespace and kind for namespaced/staged kinds.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyId {
    pub name: Id,
    pub namespace: Option<Id>,
    pub kind: Option<Id>,
}

impl std::fmt::Display for PolicyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(k) = &self.kind {
            write!(f, "{k}:")?;
        }
        if let Some(ns) = &self.namespace {
            write!(f, "{ns}/")?;
        }
        write!(f, "{}", self.name)
    }
}

/// What a rule does when it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    Allow,
    Deny,
    /// `pass` / `next-tier`: skip the rest of this tier.
    Pass,
    Log,
}

impl Action {
    /// Felix's action strings; empty means allow.
    pub fn parse(s: &str) -> Valid<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "" | "allow" => Self::Allow,
            "deny" => Self::Deny,
            "pass" | "next-tier" => Self::Pass,
            "log" => Self::Log,
            _ => {
                return Err(ValidationError::new(
                    "",
                    format!("unknown action {s:?}; expected allow, deny, pass, next-tier or log"),
                ));
            }
        })
    }
}

/// An IP protocol, by number (0..=255); names are resolved when parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Protocol(pub u8);

impl Protocol {
    pub const ICMP: Self = Self(1);
    pub const TCP: Self = Self(6);
    pub const UDP: Self = Self(17);
    pub const ICMPV6: Self = Self(58);
    pub const SCTP: Self = Self(132);
    pub const UDPLITE: Self = Self(136);

    pub fn from_number(n: i32) -> Valid<Self> {
        u8::try_from(n).map(Self).map_err(|_| {
            ValidationError::new("number", format!("protocol number {n} is not 0-255"))
        })
    }

    pub fn from_name(s: &str) -> Valid<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "tcp" => Self::TCP,
            "udp" => Self::UDP,
            "icmp" => Self::ICMP,
            "icmpv6" => Self::ICMPV6,
            "sctp" => Self::SCTP,
            "udplite" => Self::UDPLITE,
            other => {
                if let Ok(n) = other.parse::<i32>() {
                    return Self::from_number(n)
                        .map_err(|e| ValidationError::new("name", e.reason));
                }
                return Err(ValidationError::new(
                    "name",
                    format!(
                        "unknown protocol {s:?}; expected tcp, udp, icmp, icmpv6, sctp, udplite or a number"
                    ),
                ));
            }
        })
    }

    /// Ports only mean something for these.
    pub fn has_ports(self) -> bool {
        matches!(self, Self::TCP | Self::UDP | Self::SCTP | Self::UDPLITE)
    }

    pub fn is_icmp(self) -> bool {
        matches!(self, Self::ICMP | Self::ICMPV6)
    }
}

/// An inclusive port range; `first == last` for a single port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    /// From the wire's `PortRange{first,last}`; `last == 0` means a single port.
    pub fn new(first: i32, last: i32) -> Valid<Self> {
        let last = if last == 0 { first } else { last };
        let port = |p: i32, f: &str| {
            u16::try_from(p)
                .map_err(|_| ValidationError::new(f, format!("port {p} is not 0-65535")))
        };
        let (a, b) = (port(first, "first")?, port(last, "last")?);
        if a > b {
            return Err(ValidationError::new(
                "",
                format!("port range {a}:{b} is reversed"),
            ));
        }
        Ok(Self { first: a, last: b })
    }
}

/// ICMP type with an optional code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IcmpMatch {
    pub icmp_type: u8,
    pub code: Option<u8>,
}

impl IcmpMatch {
    pub fn new(icmp_type: i32, code: Option<i32>) -> Valid<Self> {
        let t = u8::try_from(icmp_type).map_err(|_| {
            ValidationError::new("type", format!("ICMP type {icmp_type} is not 0-255"))
        })?;
        let c = code
            .map(|c| {
                u8::try_from(c).map_err(|_| {
                    ValidationError::new("code", format!("ICMP code {c} is not 0-255"))
                })
            })
            .transpose()?;
        Ok(Self {
            icmp_type: t,
            code: c,
        })
    }
}

/// One rule, every field validated.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Rule {
    pub action: Option<Action>,
    /// Only rules of this IP version (None: both).
    pub ip_version: Option<IpVersion>,
    pub protocol: Option<Protocol>,
    pub src_net: Vec<IpNet>,
    pub src_ports: Vec<PortRange>,
    pub src_named_port_ip_set_ids: Vec<Id>,
    pub dst_net: Vec<IpNet>,
    pub dst_ports: Vec<PortRange>,
    pub dst_named_port_ip_set_ids: Vec<Id>,
    pub icmp: Option<IcmpMatch>,
    pub src_ip_set_ids: Vec<Id>,
    pub dst_ip_set_ids: Vec<Id>,
    pub dst_ip_port_set_ids: Vec<Id>,
    pub not_protocol: Option<Protocol>,
    pub not_src_net: Vec<IpNet>,
    pub not_src_ports: Vec<PortRange>,
    pub not_dst_net: Vec<IpNet>,
    pub not_dst_ports: Vec<PortRange>,
    pub not_icmp: Option<IcmpMatch>,
    pub not_src_ip_set_ids: Vec<Id>,
    pub not_dst_ip_set_ids: Vec<Id>,
    pub not_src_named_port_ip_set_ids: Vec<Id>,
    pub not_dst_named_port_ip_set_ids: Vec<Id>,
    /// Matches this dataplane cannot enforce (HTTP: the application
    /// layer's). A rule with any of these fails closed: it never allows.
    pub unsupported: Vec<&'static str>,
    pub rule_id: Option<Id>,
}

impl Rule {
    pub fn action(&self) -> Action {
        self.action.unwrap_or(Action::Allow)
    }

    /// Cross-field checks, run after the fields are parsed.
    pub fn check(&self) -> Valid<()> {
        let inline = [
            &self.src_ip_set_ids,
            &self.dst_ip_set_ids,
            &self.dst_ip_port_set_ids,
            &self.src_named_port_ip_set_ids,
            &self.dst_named_port_ip_set_ids,
            &self.not_src_ip_set_ids,
            &self.not_dst_ip_set_ids,
            &self.not_src_named_port_ip_set_ids,
            &self.not_dst_named_port_ip_set_ids,
        ]
        .iter()
        .map(|l| l.len())
        .sum::<usize>()
            + self.not_src_net.len()
            + self.not_dst_net.len()
            + self.not_src_ports.len()
            + self.not_dst_ports.len();
        if inline > MAX_INLINE_MATCHES {
            return Err(ValidationError::new(
                "",
                format!(
                    "{inline} IP sets, negated nets and negated ports, which must all hold in one \
                     rule; at most {MAX_INLINE_MATCHES} (nf_tables and iptables take a rule of at \
                     most 64 KiB)"
                ),
            ));
        }
        let has_ports = !(self.src_ports.is_empty()
            && self.dst_ports.is_empty()
            && self.not_src_ports.is_empty()
            && self.not_dst_ports.is_empty()
            && self.src_named_port_ip_set_ids.is_empty()
            && self.dst_named_port_ip_set_ids.is_empty());
        if has_ports && !self.protocol.is_some_and(Protocol::has_ports) {
            return Err(ValidationError::new(
                "protocol",
                "ports need protocol tcp, udp, sctp or udplite",
            ));
        }
        if (self.icmp.is_some() || self.not_icmp.is_some())
            && !self.protocol.is_some_and(Protocol::is_icmp)
        {
            return Err(ValidationError::new(
                "protocol",
                "an ICMP type needs protocol icmp or icmpv6",
            ));
        }
        if let Some(v) = self.ip_version {
            for (name, nets) in [
                ("src_net", &self.src_net),
                ("dst_net", &self.dst_net),
                ("not_src_net", &self.not_src_net),
                ("not_dst_net", &self.not_dst_net),
            ] {
                if let Some(n) = nets.iter().find(|n| super::IpVersion::of(&n.addr()) != v) {
                    return Err(ValidationError::new(
                        name,
                        format!("{n} is not of the rule's ip_version {v:?}"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The most matches that must all hold in one rendered rule (its IP
/// sets, negated nets and negated ports): each is a match of the same
/// rule (a list of positive nets or ports becomes one rule per
/// alternative instead), and a rule must fit the kernel's 64 KiB. Calico's
/// rules name a few.
pub const MAX_INLINE_MATCHES: usize = 64;

/// `Policy`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Policy {
    pub namespace: Option<Id>,
    pub tier: Option<Id>,
    pub inbound_rules: Vec<Rule>,
    pub outbound_rules: Vec<Rule>,
    pub untracked: bool,
    pub pre_dnat: bool,
}

/// `Profile`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Profile {
    pub inbound_rules: Vec<Rule>,
    pub outbound_rules: Vec<Rule>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_and_protocols() {
        assert_eq!(Action::parse("next-tier").unwrap(), Action::Pass);
        assert_eq!(Action::parse("").unwrap(), Action::Allow);
        assert!(Action::parse("accept; -j ACCEPT").is_err());
        assert_eq!(Protocol::from_name("TCP").unwrap(), Protocol::TCP);
        assert_eq!(Protocol::from_name("47").unwrap(), Protocol(47));
        assert!(Protocol::from_name("tcp ").is_err());
        assert!(Protocol::from_number(256).is_err());
    }

    #[test]
    fn port_ranges() {
        assert_eq!(
            PortRange::new(80, 0).unwrap(),
            PortRange {
                first: 80,
                last: 80
            }
        );
        assert!(PortRange::new(90, 80).is_err());
        assert!(PortRange::new(-1, 0).is_err());
        assert!(PortRange::new(1, 65536).is_err());
    }

    #[test]
    fn cross_field_checks() {
        let r = Rule {
            dst_ports: vec![PortRange::new(80, 0).unwrap()],
            ..Rule::default()
        };
        assert_eq!(r.check().unwrap_err().field, "protocol");
        let r = Rule {
            protocol: Some(Protocol::TCP),
            dst_ports: vec![PortRange::new(80, 0).unwrap()],
            ..Rule::default()
        };
        assert!(r.check().is_ok());
        let r = Rule {
            ip_version: Some(IpVersion::V6),
            src_net: vec!["10.0.0.0/8".parse().unwrap()],
            ..Rule::default()
        };
        assert_eq!(r.check().unwrap_err().field, "src_net");
    }
}
