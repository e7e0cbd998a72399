//! What a commit is made of ([`Op`]) and what the kernel reports back
//! (tables, chains, rules, sets): plain data for the netlink layer.

use std::net::IpAddr;

use super::intervals::Range;

// nft's data types (`nft describe ipv4_addr`).
const TYPE_IPADDR: u32 = 7;
const TYPE_IP6ADDR: u32 = 8;
const TYPE_INET_PROTO: u32 = 12;
const TYPE_INET_SERVICE: u32 = 13;
const TYPE_BITS: u32 = 6;
pub(super) const TYPE_IFNAME: u32 = 41;

/// An address family of nf_tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    Inet,
    Ip,
    Ip6,
}

impl Family {
    pub(super) fn number(self) -> u8 {
        match self {
            Self::Inet => 1,
            Self::Ip => 2,
            Self::Ip6 => 10,
        }
    }
}

/// What a set holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyType {
    Ipv4Addr,
    Ipv6Addr,
    /// `ipv4_addr . inet_proto . inet_service`: Calico's named-port sets
    /// (`hash:ip,port`).
    Ipv4AddrProtoPort,
    Ipv6AddrProtoPort,
    /// An interface name (the dispatch maps' key).
    IfName,
    /// A transport port (`inet_service`): the port lists of rules.
    Port,
}

impl KeyType {
    /// nft's type number (a concatenation's types, 6 bits each) and the
    /// key's length (each field padded to 4 bytes).
    pub(super) fn code(self) -> (u32, u32) {
        let concat =
            |addr: u32| ((addr << TYPE_BITS) | TYPE_INET_PROTO) << TYPE_BITS | TYPE_INET_SERVICE;
        match self {
            Self::Ipv4Addr => (TYPE_IPADDR, 4),
            Self::Ipv6Addr => (TYPE_IP6ADDR, 16),
            Self::Ipv4AddrProtoPort => (concat(TYPE_IPADDR), 12),
            Self::Ipv6AddrProtoPort => (concat(TYPE_IP6ADDR), 24),
            Self::IfName => (TYPE_IFNAME, 16),
            Self::Port => (TYPE_INET_SERVICE, 2),
        }
    }
}

/// One element's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Key {
    Addr(IpAddr),
    /// An address, an IP protocol number and a port.
    AddrProtoPort(IpAddr, u8, u16),
    /// An interface name, NUL-padded ([`Key::ifname`]).
    IfName([u8; 16]),
    /// A transport port.
    Port(u16),
}

impl Key {
    /// An interface name as a key (at most 15 bytes, as the kernel's).
    pub fn ifname(name: &str) -> Self {
        let mut b = [0u8; 16];
        let n = name.len().min(15);
        b[..n].copy_from_slice(&name.as_bytes()[..n]);
        Self::IfName(b)
    }

    /// The interface name of an [`Key::IfName`].
    pub fn as_ifname(&self) -> Option<String> {
        let Self::IfName(b) = self else {
            return None;
        };
        let n = b.iter().position(|c| *c == 0).unwrap_or(b.len());
        std::str::from_utf8(&b[..n]).ok().map(str::to_string)
    }
}

impl From<IpAddr> for Key {
    fn from(a: IpAddr) -> Self {
        Self::Addr(a)
    }
}

impl Key {
    /// As the kernel holds it: fields in network order, each padded to 4
    /// bytes.
    pub(super) fn bytes(&self) -> Vec<u8> {
        let addr = |a: &IpAddr| match a {
            IpAddr::V4(a) => a.octets().to_vec(),
            IpAddr::V6(a) => a.octets().to_vec(),
        };
        match self {
            Self::Addr(a) => addr(a),
            Self::IfName(b) => b.to_vec(),
            Self::Port(p) => p.to_be_bytes().to_vec(),
            Self::AddrProtoPort(a, proto, port) => {
                let mut b = addr(a);
                b.extend([*proto, 0, 0, 0]);
                b.extend(port.to_be_bytes());
                b.extend([0, 0]);
                b
            }
        }
    }

    pub(super) fn parse(v: &[u8]) -> Option<Self> {
        let addr = |v: &[u8]| -> Option<IpAddr> {
            match v.len() {
                4 => Some(IpAddr::from(<[u8; 4]>::try_from(v).ok()?)),
                16 => Some(IpAddr::from(<[u8; 16]>::try_from(v).ok()?)),
                _ => None,
            }
        };
        match v.len() {
            2 => Some(Self::Port(u16::from_be_bytes([v[0], v[1]]))),
            4 | 16 => addr(v).map(Self::Addr),
            12 | 24 => {
                let n = v.len() - 8;
                Some(Self::AddrProtoPort(
                    addr(&v[..n])?,
                    v[n],
                    u16::from_be_bytes([v[n + 4], v[n + 5]]),
                ))
            }
            _ => None,
        }
    }
}

/// A netfilter hook of the ip/ip6/inet families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Prerouting = 0,
    Input = 1,
    Forward = 2,
    Output = 3,
    Postrouting = 4,
}

/// A base chain's hook, priority (`filter` is 0; lower runs first) and
/// what it does with a packet no rule decided on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseChain {
    pub hook: Hook,
    pub priority: i32,
    pub accept_by_default: bool,
    /// A `nat` chain (the first packet of a connection only; where
    /// masquerade runs) rather than a `filter` one.
    pub nat: bool,
}

/// One change in a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Made if missing (an existing table is kept, with what it holds).
    AddTable { family: Family, table: String },
    /// Removed with everything in it, if there.
    DestroyTable { family: Family, table: String },
    /// Made if missing; an existing set of the same kind is kept. An
    /// interval set holds ranges ([`Op::AddRanges`]), the other kind
    /// addresses.
    AddSet {
        family: Family,
        table: String,
        set: String,
        key: KeyType,
        interval: bool,
    },
    DestroySet {
        family: Family,
        table: String,
        set: String,
    },
    /// Elements added (those already there stay).
    AddElements {
        family: Family,
        table: String,
        set: String,
        elements: Vec<Key>,
    },
    /// Elements removed (those not there are no error).
    DestroyElements {
        family: Family,
        table: String,
        set: String,
        elements: Vec<Key>,
    },
    /// A verdict map (`iifname vmap @map`): keys of `key`, each to a
    /// verdict; a `goto` element is validated like a rule, an `accept` or
    /// `drop` one is data.
    AddVerdictMap {
        family: Family,
        table: String,
        map: String,
        key: KeyType,
    },
    /// Entries added to a verdict map (a key there already must be
    /// removed first, in the same commit, to change its verdict).
    AddVerdicts {
        family: Family,
        table: String,
        map: String,
        entries: Vec<(Key, super::expr::Verdict)>,
    },
    /// Ranges added to an interval set (disjoint from those there:
    /// [`super::intervals::diff`]).
    AddRanges {
        family: Family,
        table: String,
        set: String,
        ranges: Vec<Range>,
    },
    /// Elements of an interval set of another key than addresses (port
    /// lists): (key, ends an interval).
    AddIntervals {
        family: Family,
        table: String,
        set: String,
        elements: Vec<(Key, bool)>,
    },
    /// Elements removed from such a set (one put there by hand).
    DestroyIntervals {
        family: Family,
        table: String,
        set: String,
        elements: Vec<(Key, bool)>,
    },
    /// Ranges removed from an interval set.
    DestroyRanges {
        family: Family,
        table: String,
        set: String,
        ranges: Vec<Range>,
    },
    /// A chain, made if missing; a base chain when `base` is given.
    AddChain {
        family: Family,
        table: String,
        chain: String,
        base: Option<BaseChain>,
    },
    /// Removed if there (it must hold no rules and be referenced by none).
    DestroyChain {
        family: Family,
        table: String,
        chain: String,
    },
    /// One rule removed, by its handle.
    DeleteRule {
        family: Family,
        table: String,
        chain: String,
        handle: u64,
    },
    /// Every rule of the chain removed.
    FlushChain {
        family: Family,
        table: String,
        chain: String,
    },
    /// A rule appended to the chain, with a comment (`nft` shows it).
    AddRule {
        family: Family,
        table: String,
        chain: String,
        exprs: Vec<super::expr::Expr>,
        comment: String,
    },
}

impl Op {
    /// The table the op changes.
    pub fn table(&self) -> &str {
        match self {
            Op::AddTable { table, .. }
            | Op::DestroyTable { table, .. }
            | Op::AddSet { table, .. }
            | Op::DestroySet { table, .. }
            | Op::AddElements { table, .. }
            | Op::DestroyElements { table, .. }
            | Op::AddVerdictMap { table, .. }
            | Op::AddVerdicts { table, .. }
            | Op::AddRanges { table, .. }
            | Op::AddIntervals { table, .. }
            | Op::DestroyIntervals { table, .. }
            | Op::DestroyRanges { table, .. }
            | Op::AddChain { table, .. }
            | Op::DestroyChain { table, .. }
            | Op::DeleteRule { table, .. }
            | Op::FlushChain { table, .. }
            | Op::AddRule { table, .. } => table,
        }
    }
}

/// A chain as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainInfo {
    pub name: String,
    /// Hook number and priority of a base chain.
    pub hook: Option<(u32, i32)>,
}

/// A rule as the kernel reports it: where, its handle (to delete it by),
/// and its comment (what the backend recognises its own rules by).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleInfo {
    pub chain: String,
    pub handle: u64,
    pub comment: String,
}

/// A set as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetInfo {
    pub name: String,
    pub key_type: u32,
    pub key_len: u32,
    pub flags: u32,
}

/// Elements per message: an attribute holds at most 64 KiB (an IPv6
/// element takes 28 bytes).
const ELEMENTS_PER_MESSAGE: usize = 1024;

/// `op` as messages: element lists in slices.
pub(super) fn chunks(op: &Op) -> Vec<std::borrow::Cow<'_, Op>> {
    use std::borrow::Cow;
    match op {
        Op::AddElements { elements, .. } | Op::DestroyElements { elements, .. }
            if elements.len() > ELEMENTS_PER_MESSAGE =>
        {
            elements
                .chunks(ELEMENTS_PER_MESSAGE)
                .map(|c| {
                    let mut part = op.clone();
                    if let Op::AddElements { elements, .. } | Op::DestroyElements { elements, .. } =
                        &mut part
                    {
                        *elements = c.to_vec();
                    }
                    Cow::Owned(part)
                })
                .collect()
        }
        // Two elements a range.
        Op::AddRanges { ranges, .. } | Op::DestroyRanges { ranges, .. }
            if ranges.len() > ELEMENTS_PER_MESSAGE / 2 =>
        {
            ranges
                .chunks(ELEMENTS_PER_MESSAGE / 2)
                .map(|c| {
                    let mut part = op.clone();
                    if let Op::AddRanges { ranges, .. } | Op::DestroyRanges { ranges, .. } =
                        &mut part
                    {
                        *ranges = c.to_vec();
                    }
                    Cow::Owned(part)
                })
                .collect()
        }
        // An entry carries a chain name: a quarter as many a message.
        Op::AddVerdicts { entries, .. } if entries.len() > ELEMENTS_PER_MESSAGE / 4 => entries
            .chunks(ELEMENTS_PER_MESSAGE / 4)
            .map(|c| {
                let mut part = op.clone();
                if let Op::AddVerdicts { entries, .. } = &mut part {
                    *entries = c.to_vec();
                }
                Cow::Owned(part)
            })
            .collect(),
        _ => vec![Cow::Borrowed(op)],
    }
}

pub(super) fn describe(op: &Op) -> String {
    match op {
        Op::AddTable { table, .. } => format!("adding table {table}"),
        Op::DestroyTable { table, .. } => format!("removing table {table}"),
        Op::AddSet { table, set, .. } => format!("adding set {table}/{set}"),
        Op::DestroySet { table, set, .. } => format!("removing set {table}/{set}"),
        Op::AddElements {
            table,
            set,
            elements,
            ..
        } => format!("adding {} elements to {table}/{set}", elements.len()),
        Op::DestroyElements {
            table,
            set,
            elements,
            ..
        } => format!("removing {} elements from {table}/{set}", elements.len()),
        Op::AddRanges {
            table, set, ranges, ..
        } => format!("adding {} ranges to {table}/{set}", ranges.len()),
        Op::AddIntervals {
            table,
            set,
            elements,
            ..
        } => format!("adding {} interval keys to {table}/{set}", elements.len()),
        Op::DestroyIntervals {
            table,
            set,
            elements,
            ..
        } => format!(
            "removing {} interval keys from {table}/{set}",
            elements.len()
        ),
        Op::AddVerdictMap { table, map, .. } => format!("adding map {table}/{map}"),
        Op::AddVerdicts {
            table,
            map,
            entries,
            ..
        } => format!("adding {} entries to {table}/{map}", entries.len()),
        Op::DestroyRanges {
            table, set, ranges, ..
        } => format!("removing {} ranges from {table}/{set}", ranges.len()),
        Op::AddChain { table, chain, .. } => format!("adding chain {table}/{chain}"),
        Op::DestroyChain { table, chain, .. } => format!("removing chain {table}/{chain}"),
        Op::FlushChain { table, chain, .. } => format!("flushing chain {table}/{chain}"),
        Op::DeleteRule {
            table,
            chain,
            handle,
            ..
        } => format!("removing rule {handle} from {table}/{chain}"),
        Op::AddRule {
            table,
            chain,
            comment,
            ..
        } => format!("adding rule {comment:?} to {table}/{chain}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_as_the_kernel_holds_them() {
        for k in [
            Key::Addr("10.0.0.1".parse().unwrap()),
            Key::Addr("fd00::1".parse().unwrap()),
            Key::AddrProtoPort("10.0.0.1".parse().unwrap(), 6, 8080),
            Key::AddrProtoPort("fd00::1".parse().unwrap(), 17, 53),
        ] {
            assert_eq!(Key::parse(&k.bytes()), Some(k));
        }
        let b = Key::AddrProtoPort("10.0.0.1".parse().unwrap(), 6, 8080).bytes();
        assert_eq!(b, [10, 0, 0, 1, 6, 0, 0, 0, 0x1f, 0x90, 0, 0]);
        assert_eq!(
            KeyType::Ipv4AddrProtoPort.code(),
            ((7 << 12) | (12 << 6) | 13, 12)
        );
    }
}
