//! nf_tables rule expressions as netlink attributes: the few the policy
//! layout needs (loads of packet fields and metadata, comparisons, set
//! lookups, conntrack state, counters, verdicts). Pure: expressions in,
//! bytes out.

use super::wire::{NLA_F_NESTED, attr, attr_str, attr_u32};

const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
/// The verdict register, and the first data register (16 bytes).
const NFT_REG_VERDICT: u32 = 0;
const NFT_REG_1: u32 = 1;
/// The first 32-bit register (`NFT_REG32_00`), the same bytes as
/// `NFT_REG_1`.
const NFT_REG32_00: u32 = 8;

/// Metadata a rule can load (`enum nft_meta_keys`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Meta {
    Mark = 3,
    IifName = 6,
    OifName = 7,
    L4Proto = 16,
}

/// Where a packet field is (`enum nft_payload_bases`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Base {
    Network = 1,
    Transport = 2,
}

/// What a rule does with a packet it matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    Drop,
    Return,
    Jump(String),
    Goto(String),
}

/// One expression of a rule; they run in order, each on the registers the
/// ones before filled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expr {
    /// Loads metadata into the register.
    Meta(Meta),
    /// Loads `len` bytes at `offset` of the header at `base`.
    Payload {
        base: Base,
        offset: u32,
        len: u32,
    },
    /// Continues only if the register's first `data.len()` bytes equal
    /// `data` (or differ, with `eq: false`).
    Cmp {
        eq: bool,
        data: Vec<u8>,
    },
    /// Continues only if the register's value is in (or, `invert`, not in)
    /// the set.
    Lookup {
        set: String,
        invert: bool,
    },
    /// The verdict the map holds for the register's value (`vmap`); no
    /// entry: on to the next rule.
    VerdictMap {
        map: String,
    },
    /// Loads each field (`Meta`/`Payload`) into consecutive 32-bit
    /// registers and looks the concatenation up in a set (`ip saddr .
    /// meta l4proto . th dport @set`).
    LookupConcat {
        fields: Vec<Expr>,
        set: String,
        invert: bool,
    },
    /// Continues only for conntrack states in `mask` (`ct state`: 1
    /// invalid, 2 established, 4 related, 8 new).
    CtState {
        mask: u32,
    },
    /// `mark & mask == value`.
    MarkIs {
        mask: u32,
        value: u32,
    },
    /// `mark = (mark & !mask) | value`.
    SetMark {
        mask: u32,
        value: u32,
    },
    /// `mark & mask != value`.
    MarkIsNot {
        mask: u32,
        value: u32,
    },
    /// `reg &= mask` over the register's first `mask.len()` bytes (a
    /// network's prefix before its compare).
    And(Vec<u8>),
    /// Continues only if the register's first `lo.len()` bytes are within
    /// `[lo, hi]` (big-endian; outside it with `eq: false`).
    Range {
        eq: bool,
        lo: Vec<u8>,
        hi: Vec<u8>,
    },
    /// Continues only if the register (a big-endian number of
    /// `data.len()` bytes) is `>=` (`ge`) or `<=` `data`.
    CmpOrder {
        ge: bool,
        data: Vec<u8>,
    },
    /// Loads the route type of the packet's source or destination address
    /// (`fib saddr|daddr type`; compare with [`RTN_LOCAL`] or
    /// [`RTN_UNICAST`]).
    FibAddrType {
        daddr: bool,
    },
    /// Logs the packet to the kernel log with a prefix.
    Log {
        prefix: String,
    },
    /// Source NAT to the outgoing interface's address (nat chains only).
    Masquerade,
    /// No connection tracking for this packet (before conntrack's hook).
    Notrack,
    Counter,
    Verdict(Verdict),
}

/// The route type of a local address (`RTN_LOCAL`), as `fib` loads it.
pub const RTN_LOCAL: u32 = 2;
/// The route type of an address routed elsewhere (`RTN_UNICAST`): a
/// packet to it is forwarded.
pub const RTN_UNICAST: u32 = 1;

fn nested(buf: &mut Vec<u8>, ty: u16, inner: impl FnOnce(&mut Vec<u8>)) {
    let mut i = Vec::new();
    inner(&mut i);
    attr(buf, ty | NLA_F_NESTED, &i);
}

/// One `NFTA_LIST_ELEM` of a rule's expression list.
fn expr(buf: &mut Vec<u8>, name: &str, data: impl FnOnce(&mut Vec<u8>)) {
    nested(buf, NFTA_LIST_ELEM, |b| {
        attr_str(b, NFTA_EXPR_NAME, name);
        nested(b, NFTA_EXPR_DATA, data);
    });
}

fn value(buf: &mut Vec<u8>, ty: u16, v: &[u8]) {
    nested(buf, ty, |b| attr(b, NFTA_DATA_VALUE, v));
}

/// `reg &= mask ^ xor` (nft's bitwise expression).
fn bitwise(buf: &mut Vec<u8>, mask: u32, xor: u32) {
    expr(buf, "bitwise", |b| {
        attr_u32(b, 1, NFT_REG_1); // SREG
        attr_u32(b, 2, NFT_REG_1); // DREG
        attr_u32(b, 3, 4); // LEN
        value(b, 4, &mask.to_ne_bytes()); // MASK
        value(b, 5, &xor.to_ne_bytes()); // XOR
    });
}

fn cmp(buf: &mut Vec<u8>, eq: bool, data: &[u8]) {
    expr(buf, "cmp", |b| {
        attr_u32(b, 1, NFT_REG_1); // SREG
        attr_u32(b, 2, if eq { 0 } else { 1 }); // OP: EQ, NEQ
        value(b, 3, data); // DATA
    });
}

fn meta_load(buf: &mut Vec<u8>, key: Meta) {
    meta_into(buf, key, NFT_REG_1);
}

fn meta_into(buf: &mut Vec<u8>, key: Meta, dreg: u32) {
    expr(buf, "meta", |b| {
        attr_u32(b, 1, dreg); // DREG
        attr_u32(b, 2, key as u32); // KEY
    });
}

fn payload_into(buf: &mut Vec<u8>, base: Base, offset: u32, len: u32, dreg: u32) {
    expr(buf, "payload", |b| {
        attr_u32(b, 1, dreg); // DREG
        attr_u32(b, 2, base as u32); // BASE
        attr_u32(b, 3, offset); // OFFSET
        attr_u32(b, 4, len); // LEN
    });
}

fn lookup(buf: &mut Vec<u8>, set: &str, sreg: u32, invert: bool) {
    expr(buf, "lookup", |b| {
        attr_str(b, 1, set); // SET
        attr_u32(b, 2, sreg); // SREG
        if invert {
            attr_u32(b, 5, 1); // FLAGS: NFT_LOOKUP_F_INV
        }
    });
}

/// A verdict as nf_tables data (`NFTA_DATA_VERDICT`): an immediate's, or a
/// verdict map element's.
pub(super) fn verdict_data(b: &mut Vec<u8>, v: &Verdict) {
    nested(b, NFTA_DATA_VERDICT, |b| {
        let (code, chain): (i32, Option<&str>) = match v {
            Verdict::Drop => (0, None),
            Verdict::Accept => (1, None),
            Verdict::Jump(c) => (-3, Some(c)),
            Verdict::Goto(c) => (-4, Some(c)),
            Verdict::Return => (-5, None),
        };
        attr(b, NFTA_VERDICT_CODE, &code.to_be_bytes());
        if let Some(c) = chain {
            attr_str(b, NFTA_VERDICT_CHAIN, c);
        }
    });
}

/// The expressions of a rule, as the `NFTA_RULE_EXPRESSIONS` list's body.
pub fn encode(exprs: &[Expr]) -> Vec<u8> {
    let mut buf = Vec::new();
    for e in exprs {
        match e {
            Expr::Meta(key) => meta_load(&mut buf, *key),
            Expr::Payload { base, offset, len } => {
                payload_into(&mut buf, *base, *offset, *len, NFT_REG_1)
            }
            Expr::Cmp { eq, data } => cmp(&mut buf, *eq, data),
            Expr::Lookup { set, invert } => lookup(&mut buf, set, NFT_REG_1, *invert),
            Expr::VerdictMap { map } => expr(&mut buf, "lookup", |b| {
                attr_str(b, 1, map); // SET
                attr_u32(b, 2, NFT_REG_1); // SREG
                attr_u32(b, 3, NFT_REG_VERDICT); // DREG
            }),
            Expr::LookupConcat {
                fields,
                set,
                invert,
            } => {
                let mut reg = NFT_REG32_00;
                for f in fields {
                    match f {
                        Expr::Meta(key) => {
                            meta_into(&mut buf, *key, reg);
                            reg += 1;
                        }
                        Expr::Payload { base, offset, len } => {
                            payload_into(&mut buf, *base, *offset, *len, reg);
                            reg += len.div_ceil(4);
                        }
                        // Only loads make a key.
                        _ => {}
                    }
                }
                lookup(&mut buf, set, NFT_REG32_00, *invert);
            }
            Expr::CtState { mask } => {
                expr(&mut buf, "ct", |b| {
                    attr_u32(b, 1, NFT_REG_1); // DREG
                    attr_u32(b, 2, 0); // KEY: NFT_CT_STATE
                });
                bitwise(&mut buf, *mask, 0);
                cmp(&mut buf, false, &0u32.to_ne_bytes());
            }
            Expr::MarkIs { mask, value: v } => {
                meta_load(&mut buf, Meta::Mark);
                bitwise(&mut buf, *mask, 0);
                cmp(&mut buf, true, &v.to_ne_bytes());
            }
            Expr::SetMark { mask, value: v } => {
                meta_load(&mut buf, Meta::Mark);
                bitwise(&mut buf, !*mask, *v);
                expr(&mut buf, "meta", |b| {
                    attr_u32(b, 2, Meta::Mark as u32); // KEY
                    attr_u32(b, 3, NFT_REG_1); // SREG: set
                });
            }
            Expr::MarkIsNot { mask, value: v } => {
                meta_load(&mut buf, Meta::Mark);
                bitwise(&mut buf, *mask, 0);
                cmp(&mut buf, false, &v.to_ne_bytes());
            }
            Expr::And(mask) => expr(&mut buf, "bitwise", |b| {
                attr_u32(b, 1, NFT_REG_1); // SREG
                attr_u32(b, 2, NFT_REG_1); // DREG
                attr_u32(b, 3, mask.len() as u32); // LEN
                value(b, 4, mask); // MASK
                value(b, 5, &vec![0; mask.len()]); // XOR
            }),
            Expr::Range { eq, lo, hi } => expr(&mut buf, "range", |b| {
                attr_u32(b, 1, NFT_REG_1); // SREG
                attr_u32(b, 2, if *eq { 0 } else { 1 }); // OP: EQ, NEQ
                value(b, 3, lo); // FROM
                value(b, 4, hi); // TO
            }),
            Expr::CmpOrder { ge, data } => expr(&mut buf, "cmp", |b| {
                attr_u32(b, 1, NFT_REG_1); // SREG
                attr_u32(b, 2, if *ge { 5 } else { 3 }); // OP: GTE, LTE
                value(b, 3, data);
            }),
            Expr::FibAddrType { daddr } => expr(&mut buf, "fib", |b| {
                attr_u32(b, 1, NFT_REG_1); // DREG
                attr_u32(b, 2, 3); // RESULT: NFT_FIB_RESULT_ADDRTYPE
                attr_u32(b, 3, if *daddr { 2 } else { 1 }); // FLAGS: DADDR, SADDR
            }),
            Expr::Log { prefix } => expr(&mut buf, "log", |b| {
                attr_str(b, 2, prefix); // PREFIX
            }),
            Expr::Masquerade => expr(&mut buf, "masq", |_| {}),
            Expr::Notrack => expr(&mut buf, "notrack", |_| {}),
            Expr::Counter => expr(&mut buf, "counter", |_| {}),
            Expr::Verdict(v) => expr(&mut buf, "immediate", |b| {
                attr_u32(b, 1, NFT_REG_VERDICT); // DREG
                nested(b, 2, |b| verdict_data(b, v)); // DATA
            }),
        }
    }
    buf
}

/// `iifname`/`oifname` equal to `name`, or starting with it when it ends
/// in `+` (iptables' wildcard, nft's `*`).
pub fn iface(meta: Meta, name: &str) -> [Expr; 2] {
    let data = match name.strip_suffix('+') {
        Some(prefix) => prefix.as_bytes().to_vec(),
        None => {
            let mut d = name.as_bytes().to_vec();
            d.resize(16, 0);
            d
        }
    };
    [Expr::Meta(meta), Expr::Cmp { eq: true, data }]
}

/// The IPv4 (`v6` false) or IPv6 source or destination address.
pub fn addr(v6: bool, source: bool) -> Expr {
    let (offset, len) = match (v6, source) {
        (false, true) => (12, 4),
        (false, false) => (16, 4),
        (true, true) => (8, 16),
        (true, false) => (24, 16),
    };
    Expr::Payload {
        base: Base::Network,
        offset,
        len,
    }
}

/// The transport's destination port (after an `l4proto` match).
pub fn dport() -> Expr {
    Expr::Payload {
        base: Base::Transport,
        offset: 2,
        len: 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interface_prefix_compares_only_its_bytes() {
        assert_eq!(
            iface(Meta::IifName, "cali+")[1],
            Expr::Cmp {
                eq: true,
                data: b"cali".to_vec()
            }
        );
        let [_, Expr::Cmp { data, .. }] = iface(Meta::OifName, "eth0") else {
            panic!()
        };
        assert_eq!(data.len(), 16, "a whole name, NUL-padded");
    }

    #[test]
    fn expressions_are_a_list_of_named_elements() {
        let b = encode(&[Expr::Counter, Expr::Verdict(Verdict::Drop)]);
        assert_eq!(b.len() % 4, 0);
        let text = String::from_utf8_lossy(&b);
        assert!(
            text.contains("counter") && text.contains("immediate"),
            "{text:?}"
        );
    }
}
