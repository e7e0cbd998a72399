//! The managers' rules (iptables' match and target syntax, built only from
//! the tokens [`crate::generictables::Rule`] allows) as nf_tables
//! expressions, so that one renderer feeds both dataplanes. Pure: text
//! in, expressions out.
//!
//! Every token the managers write has a translation here, and anything
//! else is refused (a rule that cannot be translated must not be
//! programmed half): `-p`, `-s`, `-d`, `-i`, `-o` (each with `!`),
//! `-m set --match-set NAME src|dst|src,src|dst,dst`, `-m multiport`
//! and `--dport`/`--sport`, `-m icmp`/`icmp6` types and codes, `-m mark`,
//! `-m conntrack --ctstate`, `-m addrtype --src-type|--dst-type`, and the
//! targets ACCEPT, DROP, RETURN, MARK `--set-xmark`, LOG `--log-prefix`,
//! MASQUERADE, NOTRACK and a jump or goto to a chain. A port list becomes
//! a lookup in a constant interval set named after its contents
//! ([`PortSet`]), which the table holds while a rule uses it.

use std::net::IpAddr;

use ipnet::IpNet;

use super::expr::{Base, Expr, Meta, RTN_LOCAL, RTN_UNICAST, Verdict, addr, iface};

/// Why a rule cannot be translated. Not retryable: the rule is wrong for
/// this dataplane whatever the kernel holds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rule {rule:?}: {reason}")]
pub struct TranslateError {
    pub rule: String,
    pub reason: String,
}

/// A port list a rule looks up: its set's name and its inclusive ranges.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortSet {
    pub name: String,
    pub ranges: Vec<(u16, u16)>,
}

impl PortSet {
    /// The interval set's elements: each range's start, and the port after
    /// its end (flagged as an end) unless it runs to 65535.
    pub fn elements(&self) -> Vec<(super::ops::Key, bool)> {
        use super::ops::Key;
        self.ranges
            .iter()
            .flat_map(|&(lo, hi)| {
                std::iter::once((Key::Port(lo), false))
                    .chain(hi.checked_add(1).map(|e| (Key::Port(e), true)))
            })
            .collect()
    }
}

/// One rule as nf_tables sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Translated {
    pub exprs: Vec<Expr>,
    /// The IP sets it looks up (they must be in its table).
    pub sets: Vec<String>,
    /// The port lists it looks up.
    pub port_sets: Vec<PortSet>,
    /// The chain it jumps or goes to.
    pub target: Option<String>,
    /// The interface dispatch it looks its verdict up in.
    pub dispatch: Option<std::sync::Arc<Dispatch>>,
}

/// How a dispatch map's name starts.
pub const DISPATCH_MAP: &str = "dispatch-";

/// A dispatch chain (`-i <interface> -g <chain>` per interface, then
/// `-j DROP` or `-j RETURN`) as one verdict-map lookup, `meta iifname
/// vmap @<name>`, and that last rule: one hash lookup per packet where the
/// rules were a walk of the interfaces. Named after the chain (and its
/// direction and end), not its entries: an interface that comes, goes or
/// moves is an element added or removed, and the rule that looks the map
/// up stays (a removed element is not validated; a whole new map was
/// every interface's element written again and the table walked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatch {
    pub name: String,
    /// `-i` (the packet's input interface) or `-o`.
    pub input: bool,
    /// Interface → the chain it goes to, in the rules' order.
    pub entries: Vec<(String, String)>,
    /// An interface not in the map is dropped (else returned).
    pub drop: bool,
}

impl Dispatch {
    /// `rules` of chain `chain` as a dispatch map, if that is what they
    /// are: at least one `-i|-o <interface> -g <chain>` (one direction,
    /// exact names, each once) and a last `-j DROP` or `-j RETURN`.
    pub fn of(chain: &str, rules: &[&str]) -> Option<Self> {
        let (last, gotos) = rules.split_last()?;
        let drop = match *last {
            "-j DROP" => true,
            "-j RETURN" => false,
            _ => return None,
        };
        if gotos.is_empty() {
            return None;
        }
        let mut input = None;
        let mut entries = Vec::with_capacity(gotos.len());
        let mut seen = std::collections::HashSet::with_capacity(gotos.len());
        for r in gotos {
            let t: Vec<&str> = r.split(' ').collect();
            let [flag, iface, "-g", chain] = t[..] else {
                return None;
            };
            let i = match flag {
                "-i" => true,
                "-o" => false,
                _ => return None,
            };
            if *input.get_or_insert(i) != i
                || iface.ends_with('+')
                || iface.len() > 15
                || !seen.insert(iface)
            {
                return None;
            }
            entries.push((iface.to_string(), chain.to_string()));
        }
        let input = input?;
        use sha2::Digest as _;
        let mut h = sha2::Sha224::new();
        h.update(chain.as_bytes());
        h.update(b"\n");
        h.update(if drop { &b"drop"[..] } else { b"return" });
        let sum = h.finalize();
        let hex = hex::encode(&sum[..8]);
        Some(Self {
            name: format!("{DISPATCH_MAP}{}-{hex}", if input { "in" } else { "out" }),
            input,
            entries,
            drop,
        })
    }

    /// The rule after the lookup.
    pub fn last(&self) -> &'static str {
        if self.drop { "-j DROP" } else { "-j RETURN" }
    }

    /// The map's entries: each interface's name, NUL-padded, and a goto.
    pub fn elements(&self) -> Vec<(super::ops::Key, Verdict)> {
        self.entries
            .iter()
            .map(|(i, c)| (super::ops::Key::ifname(i), Verdict::Goto(c.clone())))
            .collect()
    }

    /// The lookup rule and the drop.
    pub fn rules(self: &std::sync::Arc<Self>) -> [Translated; 2] {
        let meta = if self.input {
            Meta::IifName
        } else {
            Meta::OifName
        };
        let lookup = Translated {
            exprs: vec![
                Expr::Meta(meta),
                Expr::VerdictMap {
                    map: self.name.clone(),
                },
            ],
            sets: Vec::new(),
            port_sets: Vec::new(),
            target: None,
            dispatch: Some(std::sync::Arc::clone(self)),
        };
        let last = translate(self.last(), false).expect("a drop or return translates");
        [lookup, last]
    }
}

/// The IPv4 and IPv6 protocol numbers of a `-p` value.
fn protocol(s: &str) -> Option<u8> {
    Some(match s {
        "tcp" => 6,
        "udp" => 17,
        "sctp" => 132,
        "udplite" => 136,
        "icmp" => 1,
        "ipv6-icmp" | "icmpv6" => 58,
        n => n.parse().ok()?,
    })
}

/// A `--mark`/`--set-xmark` value: `value/mask` (a lone value: all bits).
fn mark(s: &str) -> Option<(u32, u32)> {
    let num = |t: &str| match t.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16).ok(),
        None => t.parse().ok(),
    };
    match s.split_once('/') {
        Some((v, m)) => Some((num(v)?, num(m)?)),
        None => Some((num(s)?, u32::MAX)),
    }
}

/// `80`, `1000:2000` or a comma-separated list of them.
fn ports(s: &str) -> Option<Vec<(u16, u16)>> {
    s.split(',')
        .map(|p| match p.split_once(':') {
            Some((a, b)) => {
                let (a, b) = (a.parse().ok()?, b.parse().ok()?);
                (a <= b).then_some((a, b))
            }
            None => p.parse().ok().map(|n| (n, n)),
        })
        .collect()
}

/// The name of the set holding `ranges`: the same list, the same set.
fn port_set_name(ranges: &[(u16, u16)]) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for (a, b) in ranges {
        h.update(a.to_be_bytes());
        h.update(b.to_be_bytes());
    }
    let d = h.finalize();
    let hex = hex::encode(&d[..8]);
    format!("ports-{hex}")
}

struct Builder<'a> {
    text: &'a str,
    v6: bool,
    out: Translated,
    /// Set by `-p`: port and ICMP matches need it.
    proto: Option<u8>,
}

impl Builder<'_> {
    fn fail<T>(&self, reason: impl Into<String>) -> Result<T, TranslateError> {
        Err(TranslateError {
            rule: self.text.to_string(),
            reason: reason.into(),
        })
    }

    fn push(&mut self, e: impl IntoIterator<Item = Expr>) {
        self.out.exprs.extend(e);
    }

    fn net(&mut self, s: &str, source: bool, eq: bool) -> Result<(), TranslateError> {
        let net: IpNet = match s.parse::<IpNet>() {
            Ok(n) => n,
            Err(_) => match s.parse::<IpAddr>() {
                Ok(a) => IpNet::from(a),
                Err(_) => return self.fail(format!("{s:?} is not an address or network")),
            },
        };
        if net.addr().is_ipv6() != self.v6 {
            return self.fail(format!("{s} is of the other IP version"));
        }
        let net = net.trunc();
        let bytes = |a: IpAddr| match a {
            IpAddr::V4(a) => a.octets().to_vec(),
            IpAddr::V6(a) => a.octets().to_vec(),
        };
        self.push([addr(self.v6, source)]);
        if net.prefix_len() < net.max_prefix_len() {
            self.push([Expr::And(bytes(net.netmask()))]);
        }
        self.push([Expr::Cmp {
            eq,
            data: bytes(net.network()),
        }]);
        Ok(())
    }

    fn ports(&mut self, list: &str, source: bool, eq: bool) -> Result<(), TranslateError> {
        if self.proto.is_none() {
            return self.fail("a port match needs -p");
        }
        let Some(mut ranges) = ports(list) else {
            return self.fail(format!("{list:?} is not a port list"));
        };
        ranges.sort();
        self.push([Expr::Payload {
            base: Base::Transport,
            offset: if source { 0 } else { 2 },
            len: 2,
        }]);
        match ranges.as_slice() {
            [(a, b)] if a == b => self.push([Expr::Cmp {
                eq,
                data: a.to_be_bytes().to_vec(),
            }]),
            [(a, b)] => self.push([Expr::Range {
                eq,
                lo: a.to_be_bytes().to_vec(),
                hi: b.to_be_bytes().to_vec(),
            }]),
            _ => {
                // Overlapping ranges would be refused by the interval set.
                let mut merged: Vec<(u16, u16)> = Vec::new();
                for (a, b) in ranges {
                    match merged.last_mut() {
                        Some(last) if u32::from(a) <= u32::from(last.1) + 1 => {
                            last.1 = last.1.max(b)
                        }
                        _ => merged.push((a, b)),
                    }
                }
                let set = PortSet {
                    name: port_set_name(&merged),
                    ranges: merged,
                };
                self.push([Expr::Lookup {
                    set: set.name.clone(),
                    invert: !eq,
                }]);
                if !self.out.port_sets.contains(&set) {
                    self.out.port_sets.push(set);
                }
            }
        }
        Ok(())
    }

    fn icmp(&mut self, value: &str, eq: bool) -> Result<(), TranslateError> {
        let want = if self.v6 { 58 } else { 1 };
        if self.proto != Some(want) {
            return self.fail("an ICMP match needs -p of its IP version's ICMP");
        }
        let parsed: Option<Vec<u8>> = value.split('/').map(|p| p.parse().ok()).collect();
        let Some(data) = parsed.filter(|d| (1..=2).contains(&d.len())) else {
            return self.fail(format!("{value:?} is not an ICMP type[/code]"));
        };
        self.push([
            Expr::Payload {
                base: Base::Transport,
                offset: 0,
                len: data.len() as u32,
            },
            Expr::Cmp { eq, data },
        ]);
        Ok(())
    }

    fn set(&mut self, name: &str, dir: &str, eq: bool) -> Result<(), TranslateError> {
        let invert = !eq;
        let set = name.to_string();
        match dir {
            "src" | "dst" => self.push([addr(self.v6, dir == "src"), Expr::Lookup { set, invert }]),
            "src,src" | "dst,dst" => {
                let source = dir == "src,src";
                self.push([Expr::LookupConcat {
                    fields: vec![
                        addr(self.v6, source),
                        Expr::Meta(Meta::L4Proto),
                        Expr::Payload {
                            base: Base::Transport,
                            offset: if source { 0 } else { 2 },
                            len: 2,
                        },
                    ],
                    set,
                    invert,
                }])
            }
            other => return self.fail(format!("set direction {other:?}")),
        }
        if !self.out.sets.iter().any(|s| s == name) {
            self.out.sets.push(name.to_string());
        }
        Ok(())
    }

    fn ctstate(&mut self, states: &str) -> Result<(), TranslateError> {
        let mut mask = 0;
        for s in states.split(',') {
            mask |= match s {
                "INVALID" => 1,
                "ESTABLISHED" => 2,
                "RELATED" => 4,
                "NEW" => 8,
                "UNTRACKED" => 64,
                other => return self.fail(format!("conntrack state {other:?}")),
            };
        }
        self.push([Expr::CtState { mask }]);
        Ok(())
    }
}

/// Translates one rule of IP version 6 (`v6`) or 4.
pub fn translate(text: &str, v6: bool) -> Result<Translated, TranslateError> {
    let mut b = Builder {
        text,
        v6,
        out: Translated {
            exprs: Vec::new(),
            sets: Vec::new(),
            port_sets: Vec::new(),
            target: None,
            dispatch: None,
        },
        proto: None,
    };
    let toks: Vec<&str> = text.split(' ').collect();
    let mut i = 0;
    let mut negate = false;
    // The value after token i (and step past it).
    macro_rules! value {
        () => {{
            i += 1;
            match toks.get(i) {
                Some(t) => *t,
                None => return b.fail(format!("{} needs a value", toks[i - 1])),
            }
        }};
    }
    while i < toks.len() {
        let t = toks[i];
        let eq = !negate;
        negate = false;
        match t {
            "!" => negate = true,
            "-p" | "--protocol" => {
                let v = value!();
                let Some(p) = protocol(v) else {
                    return b.fail(format!("protocol {v:?}"));
                };
                if eq {
                    b.proto = Some(p);
                }
                b.push([Expr::Meta(Meta::L4Proto), Expr::Cmp { eq, data: vec![p] }]);
            }
            "-s" | "--source" => {
                let v = value!();
                b.net(v, true, eq)?
            }
            "-d" | "--destination" => {
                let v = value!();
                b.net(v, false, eq)?
            }
            "-i" | "-o" => {
                let v = value!();
                let meta = if t == "-i" {
                    Meta::IifName
                } else {
                    Meta::OifName
                };
                let [load, cmp] = iface(meta, v);
                let cmp = match cmp {
                    Expr::Cmp { data, .. } => Expr::Cmp { eq, data },
                    other => other,
                };
                b.push([load, cmp]);
            }
            "-m" => {
                let module = value!();
                if !matches!(
                    module,
                    "set"
                        | "multiport"
                        | "tcp"
                        | "udp"
                        | "sctp"
                        | "icmp"
                        | "icmp6"
                        | "mark"
                        | "conntrack"
                        | "addrtype"
                ) {
                    return b.fail(format!("match module {module:?}"));
                }
            }
            "--match-set" => {
                let name = value!();
                let dir = value!();
                b.set(name, dir, eq)?
            }
            "--dport" | "--destination-port" | "--dports" | "--destination-ports" => {
                let v = value!();
                b.ports(v, false, eq)?
            }
            "--sport" | "--source-port" | "--sports" | "--source-ports" => {
                let v = value!();
                b.ports(v, true, eq)?
            }
            "--icmp-type" | "--icmpv6-type" => {
                if (t == "--icmpv6-type") != v6 {
                    return b.fail(format!("{t} in a rule of the other IP version"));
                }
                let v = value!();
                b.icmp(v, eq)?
            }
            "--mark" => {
                let v = value!();
                let Some((value, mask)) = mark(v) else {
                    return b.fail(format!("mark {v:?}"));
                };
                b.push([if eq {
                    Expr::MarkIs { mask, value }
                } else {
                    Expr::MarkIsNot { mask, value }
                }]);
            }
            "--ctstate" => {
                if !eq {
                    return b.fail("a negated --ctstate");
                }
                let v = value!();
                b.ctstate(v)?
            }
            "--src-type" | "--dst-type" => {
                let v = value!();
                let rtn = match v {
                    "LOCAL" => RTN_LOCAL,
                    "UNICAST" => RTN_UNICAST,
                    _ => return b.fail(format!("address type {v:?}")),
                };
                b.push([
                    Expr::FibAddrType {
                        daddr: t == "--dst-type",
                    },
                    Expr::Cmp {
                        eq,
                        data: rtn.to_ne_bytes().to_vec(),
                    },
                ]);
            }
            "-j" | "-g" => {
                let target = value!();
                // Every rule counts what reaches its target, as iptables'
                // rules do.
                b.push([Expr::Counter]);
                let goto = t == "-g";
                match (target, goto) {
                    ("ACCEPT", false) => b.push([Expr::Verdict(Verdict::Accept)]),
                    ("DROP", false) => b.push([Expr::Verdict(Verdict::Drop)]),
                    ("RETURN", false) => b.push([Expr::Verdict(Verdict::Return)]),
                    ("MASQUERADE", false) => b.push([Expr::Masquerade]),
                    ("NOTRACK", false) => b.push([Expr::Notrack]),
                    ("MARK", false) => {
                        if toks.get(i + 1) != Some(&"--set-xmark") {
                            return b.fail("MARK needs --set-xmark");
                        }
                        i += 1;
                        let v = value!();
                        let Some((value, mask)) = mark(v) else {
                            return b.fail(format!("mark {v:?}"));
                        };
                        b.push([Expr::SetMark { mask, value }]);
                    }
                    ("LOG", false) => {
                        let prefix = if toks.get(i + 1) == Some(&"--log-prefix") {
                            i += 1;
                            value!().to_string()
                        } else {
                            String::new()
                        };
                        b.push([Expr::Log { prefix }]);
                    }
                    (chain, _) if chain.chars().all(|c| c.is_ascii_uppercase()) => {
                        return b.fail(format!("target {chain:?}"));
                    }
                    (chain, _) => {
                        b.out.target = Some(chain.to_string());
                        b.push([Expr::Verdict(if goto {
                            Verdict::Goto(chain.to_string())
                        } else {
                            Verdict::Jump(chain.to_string())
                        })]);
                    }
                }
                if i + 1 < toks.len() {
                    return b.fail(format!("{:?} after the target", toks[i + 1]));
                }
            }
            other => return b.fail(format!("token {other:?}")),
        }
        i += 1;
    }
    if negate {
        return b.fail("a trailing '!'");
    }
    Ok(b.out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::nftables::ops::Key;

    fn exprs(text: &str) -> Vec<Expr> {
        translate(text, false).unwrap().exprs
    }

    #[test]
    fn matches_and_targets_become_expressions_in_order() {
        assert_eq!(
            exprs("-i cali+ -p tcp -m multiport --destination-ports 80 -j ACCEPT"),
            vec![
                Expr::Meta(Meta::IifName),
                Expr::Cmp {
                    eq: true,
                    data: b"cali".to_vec()
                },
                Expr::Meta(Meta::L4Proto),
                Expr::Cmp {
                    eq: true,
                    data: vec![6]
                },
                Expr::Payload {
                    base: Base::Transport,
                    offset: 2,
                    len: 2
                },
                Expr::Cmp {
                    eq: true,
                    data: vec![0, 80]
                },
                Expr::Counter,
                Expr::Verdict(Verdict::Accept),
            ]
        );
        assert_eq!(
            exprs("! -s 10.1.0.0/16 -j MARK --set-xmark 0x10000/0x10000"),
            vec![
                addr(false, true),
                Expr::And(vec![255, 255, 0, 0]),
                Expr::Cmp {
                    eq: false,
                    data: vec![10, 1, 0, 0]
                },
                Expr::Counter,
                Expr::SetMark {
                    mask: 0x10000,
                    value: 0x10000
                },
            ]
        );
        let t = translate("-m set --match-set dph40a src -g dph-x", false).unwrap();
        assert_eq!(t.sets, vec!["dph40a".to_string()]);
        assert_eq!(t.target.as_deref(), Some("dph-x"));
        assert_eq!(
            t.exprs.last(),
            Some(&Expr::Verdict(Verdict::Goto("dph-x".into())))
        );
    }

    #[test]
    fn interface_dispatch_is_one_map_lookup() {
        let rules = [
            "-i cali1 -g dph-fw-cali1",
            "-i cali2 -g dph-fw-cali2",
            "-j DROP",
        ];
        let d = std::sync::Arc::new(Dispatch::of("dph-a", &rules).expect("a dispatch"));
        assert!(d.input && d.name.starts_with("dispatch-in-"));
        assert_eq!(
            d.entries,
            [("cali1", "dph-fw-cali1"), ("cali2", "dph-fw-cali2")]
                .map(|(a, b)| (a.to_string(), b.to_string()))
        );
        let [lookup, drop] = d.rules();
        assert_eq!(
            lookup.exprs,
            [
                Expr::Meta(Meta::IifName),
                Expr::VerdictMap {
                    map: d.name.clone()
                }
            ]
        );
        assert_eq!(drop, translate("-j DROP", false).unwrap());
        // Named by its chain, not what it holds: other entries are the
        // same map's elements.
        let other = Dispatch::of("dph-a", &["-i cali1 -g dph-fw-cali1", "-j DROP"]).unwrap();
        assert_eq!(other.name, d.name);
        assert_ne!(other.entries, d.entries);
        assert_ne!(
            Dispatch::of("dph-b", &rules).unwrap().name,
            d.name,
            "another chain's"
        );
        // Ending in a return: unknown interfaces go on.
        let ret = Dispatch::of("dph-a", &["-i cali1 -g dph-fw-cali1", "-j RETURN"]).unwrap();
        assert!(!ret.drop && ret.last() == "-j RETURN");
        assert_ne!(ret.name, other.name, "named by the end too");
        // Anything else stays rules: a wildcard, both directions, another
        // end, a name twice, no interface at all.
        for not in [
            &["-i cali+ -g dph-x", "-j DROP"][..],
            &["-i cali1 -g dph-x", "-o cali2 -g dph-y", "-j DROP"],
            &["-i cali1 -g dph-x", "-j ACCEPT"],
            &["-i cali1 -g dph-x", "-i cali1 -g dph-y", "-j DROP"],
            &["-i cali1 -j dph-x", "-j DROP"],
            &["-j DROP"],
        ] {
            assert!(Dispatch::of("dph-a", not).is_none(), "{not:?}");
        }
    }

    #[test]
    fn port_lists_are_constant_sets_named_by_their_contents() {
        let a = translate(
            "-p udp -m multiport --destination-ports 53,1000:2000,1500:2500 -j DROP",
            false,
        )
        .unwrap();
        let b = translate(
            "-p tcp -m multiport ! --destination-ports 1000:2500,53 -j DROP",
            false,
        )
        .unwrap();
        assert_eq!(a.port_sets.len(), 1);
        assert_eq!(a.port_sets, b.port_sets, "same ports, same set");
        assert_eq!(a.port_sets[0].ranges, vec![(53, 53), (1000, 2500)]);
        assert_eq!(
            a.port_sets[0].elements(),
            vec![
                (Key::Port(53), false),
                (Key::Port(54), true),
                (Key::Port(1000), false),
                (Key::Port(2501), true)
            ]
        );
        assert!(b.exprs.contains(&Expr::Lookup {
            set: a.port_sets[0].name.clone(),
            invert: true
        }));
        let top = PortSet {
            name: String::new(),
            ranges: vec![(65000, 65535)],
        };
        assert_eq!(top.elements(), vec![(Key::Port(65000), false)]);
    }

    #[test]
    fn what_cannot_be_translated_is_refused_whole() {
        for bad in [
            "-m string --string x -j DROP",
            "--dport 80 -j ACCEPT",
            "-s 10.0.0.0/8 -j ACCEPT -j DROP",
            "-s fd00::/8 -j ACCEPT",
            "-j REJECT",
            "-p tcp -m icmp --icmp-type 8 -j ACCEPT",
            "-m conntrack ! --ctstate INVALID -j DROP",
            "-s 10.0.0.1 !",
            "-p bogus -j DROP",
        ] {
            assert!(translate(bad, false).is_err(), "{bad}");
        }
        assert!(translate("-p ipv6-icmp -m icmp6 --icmpv6-type 128 -j ACCEPT", true).is_ok());
        assert!(translate("-p ipv6-icmp -m icmp6 --icmpv6-type 128 -j ACCEPT", false).is_err());
    }
}
