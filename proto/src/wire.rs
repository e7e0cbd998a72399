//! A `ToDataplane` message as it came off the wire, checked against
//! [`WireLimits`] before anything of it is decoded.
//!
//! Decoding is where a small message becomes a big one: a policy of a
//! million empty rules is 2 MB on the wire and, decoded, a million
//! `felix::Rule` structs of several hundred bytes each (the daemon grew
//! from 33 MB to 2.8 GB taking it). So the server takes each message as
//! bytes ([`RawToDataplane`], through the server stubs generated for it,
//! [`raw`]) and [`check`] walks the protobuf encoding first, guided
//! by the message descriptors: it counts each repeated field's elements
//! against its limit and estimates the decoded size from the structs'
//! sizes; only a message within both is decoded. A refused message is a
//! rejection naming its sequence number and field, like any invalid one:
//! the stream and the rest of the state go on.

mod released;

pub use released::normalize;

use std::collections::HashMap;
use std::sync::OnceLock;

use prost::bytes::{Buf, BufMut, Bytes};
use prost::encoding::{DecodeContext, WireType};
use prost_reflect::{Cardinality, FieldDescriptor, Kind, MessageDescriptor};

/// The stubs of `dphandler.v1.Dataplane` that take each `ToDataplane`
/// message as a [`RawToDataplane`] (every other type is the one in
/// [`crate::v1`]): the server's, and the client's of `dphctl felix-driver`,
/// which passes Felix's messages on as they came.
#[allow(clippy::all, missing_debug_implementations, reason = "generated code")]
pub mod raw {
    include!(concat!(env!("OUT_DIR"), "/raw/dphandler.v1.rs"));
}

/// One `felix.ToDataplane` message, undecoded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawToDataplane(pub Bytes);

impl prost::Message for RawToDataplane {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.0);
    }

    fn merge_field(
        &mut self,
        _tag: u32,
        _wire_type: WireType,
        _buf: &mut impl Buf,
        _ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        unreachable!("merge takes the whole message")
    }

    /// The whole message, as bytes (the codec hands over exactly one).
    fn merge(&mut self, mut buf: impl Buf) -> Result<(), prost::DecodeError> {
        self.0 = buf.copy_to_bytes(buf.remaining());
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0 = Bytes::new();
    }
}

/// What one message may hold. Felix sets no such limits; these are far
/// above what a calc graph sends (Kubernetes policies have tens of rules,
/// Felix's largest IP set is `MaxIpsetSize`), and far below what would
/// take a node's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireLimits {
    /// Rules in one of a policy's or profile's rule lists.
    pub rules: usize,
    /// Members of one IP set update or delta list.
    pub members: usize,
    /// Entries of a map (labels, a ConfigUpdate's keys).
    pub map_entries: usize,
    /// Elements of any other repeated field (a rule's nets, ports and IP
    /// sets, an endpoint's tiers and their policies, …).
    pub entries: usize,
    /// Bytes of one string (an id is at most 253, a label 63 KiB): a
    /// reason that quotes a value stays small.
    pub string_bytes: usize,
    /// The decoded message may be at most this many times its wire size…
    pub decoded_factor: usize,
    /// …or this many bytes, whichever is more.
    pub decoded_floor: usize,
}

impl Default for WireLimits {
    fn default() -> Self {
        Self {
            rules: 10_000,
            members: crate::convert::MAX_IPSET_MEMBERS,
            map_entries: 4_096,
            entries: 100_000,
            string_bytes: 64 << 10,
            decoded_factor: 8,
            decoded_floor: 16 << 20,
        }
    }
}

/// A message within the limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    pub sequence_number: u64,
    /// About how many bytes the decoded `felix::ToDataplane` takes.
    pub decoded: usize,
}

/// A message refused before it was decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("message {sequence_number}: {field}: {reason}")]
pub struct Refused {
    pub sequence_number: u64,
    pub field: String,
    pub reason: String,
}

/// How deep messages may nest (ours nest five deep; prost allows 100).
const MAX_DEPTH: usize = 16;

/// Checks `bytes`, one `felix.ToDataplane` message, against `limits`.
/// A message whose encoding is broken passes (its decoding then says
/// what is wrong); only what is within the limits is decoded.
pub fn check(bytes: &[u8], limits: &WireLimits) -> Result<Checked, Refused> {
    let desc = to_dataplane();
    let seq_field = desc
        .get_field_by_name("sequence_number")
        .expect("ToDataplane has a sequence number")
        .number();
    let sequence_number = top_level_varint(bytes, seq_field).unwrap_or(0);
    let refused = |field: String, reason: String| Refused {
        sequence_number,
        field,
        reason,
    };
    let mut path = Vec::new();
    let decoded = match walk(&desc, bytes, limits, &mut path, 0) {
        Ok(n) => n,
        Err(Walk::Broken) => 0,
        Err(Walk::Over(field, reason)) => return Err(refused(field, reason)),
    };
    let allowed = limits
        .decoded_floor
        .max(limits.decoded_factor.saturating_mul(bytes.len()));
    if decoded > allowed {
        return Err(refused(
            String::new(),
            format!(
                "would take about {} MiB decoded from {} KiB on the wire; at most {} MiB \
                 ({}x its size, or {} MiB) may be",
                decoded >> 20,
                bytes.len() >> 10,
                allowed >> 20,
                limits.decoded_factor,
                limits.decoded_floor >> 20
            ),
        ));
    }
    Ok(Checked {
        sequence_number,
        decoded,
    })
}

fn to_dataplane() -> MessageDescriptor {
    crate::descriptor_pool()
        .get_message_by_name("felix.ToDataplane")
        .expect("felix.ToDataplane is in the descriptor set")
}

enum Walk {
    /// Not a valid encoding: left to the decoder to say.
    Broken,
    /// Over a limit: (field path, why).
    Over(String, String),
}

fn varint(b: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for i in 0..10 {
        let (&byte, rest) = b.split_first()?;
        *b = rest;
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// One field of the encoding: (number, wire type, its bytes or value).
enum Value<'a> {
    Varint(u64),
    Fixed,
    Len(&'a [u8]),
}

fn next_field<'a>(b: &mut &'a [u8]) -> Option<(u32, Value<'a>)> {
    let key = varint(b)?;
    let number = u32::try_from(key >> 3).ok()?;
    let v = match key & 7 {
        0 => Value::Varint(varint(b)?),
        1 => {
            *b = b.get(8..)?;
            Value::Fixed
        }
        5 => {
            *b = b.get(4..)?;
            Value::Fixed
        }
        2 => {
            let len = usize::try_from(varint(b)?).ok()?;
            let (v, rest) = (b.get(..len)?, b.get(len..)?);
            *b = rest;
            Value::Len(v)
        }
        _ => return None, // groups: none in these messages
    };
    Some((number, v))
}

/// The varint `field` of the top level (the last one wins, as in the
/// decoder; up to where the encoding breaks).
fn top_level_varint(mut b: &[u8], field: u32) -> Option<u64> {
    let mut found = None;
    while let Some((n, v)) = next_field(&mut b) {
        if let Value::Varint(v) = v
            && n == field
        {
            found = Some(v);
        }
    }
    found
}

/// The limit on `field`'s elements in one message of its own.
fn limit(field: &FieldDescriptor, limits: &WireLimits) -> (usize, &'static str) {
    if field.is_map() {
        return (limits.map_entries, "entries");
    }
    let parent = field.parent_message();
    match (parent.full_name(), field.name()) {
        ("felix.Policy" | "felix.Profile", "inbound_rules" | "outbound_rules") => {
            (limits.rules, "rules")
        }
        ("felix.IPSetUpdate", "members")
        | ("felix.IPSetDeltaUpdate", "added_members" | "removed_members") => {
            (limits.members, "members")
        }
        _ => (limits.entries, "entries"),
    }
}

/// About what a decoded message of `desc` takes in its parent (its
/// struct, inline): 24 bytes for a string, bytes, list or map, 8 for a
/// scalar, a nested message's own size for a singular one, the largest
/// variant for a oneof. Computed once per type.
fn struct_size(desc: &MessageDescriptor) -> usize {
    static SIZES: OnceLock<std::sync::Mutex<HashMap<String, usize>>> = OnceLock::new();
    let sizes = SIZES.get_or_init(Default::default);
    if let Some(n) = sizes.lock().expect("not poisoned").get(desc.full_name()) {
        return *n;
    }
    let field_size = |f: &FieldDescriptor| -> usize {
        if f.is_list() || f.is_map() {
            return 24;
        }
        match f.kind() {
            Kind::String | Kind::Bytes => 24,
            Kind::Message(m) => 8 + struct_size(&m),
            _ => 8,
        }
    };
    let mut n = 0;
    let mut oneofs: HashMap<String, usize> = HashMap::new();
    for f in desc.fields() {
        match f.containing_oneof() {
            Some(o) if !f.field_descriptor_proto().proto3_optional() => {
                let e = oneofs.entry(o.name().to_string()).or_default();
                *e = (*e).max(field_size(&f));
            }
            _ => n += field_size(&f),
        }
    }
    n += oneofs.values().map(|s| s + 8).sum::<usize>();
    let n = n.max(8);
    sizes
        .lock()
        .expect("not poisoned")
        .insert(desc.full_name().to_string(), n);
    n
}

/// What one element of a repeated field (or a field's heap part) takes
/// decoded, beyond its slot in the parent's struct: a string's bytes,
/// a list element's own slot.
fn element_heap(f: &FieldDescriptor, len: usize) -> usize {
    // Allocations are rounded up and carry the allocator's overhead.
    let alloc = |n: usize| if n == 0 { 0 } else { n.div_ceil(16) * 16 + 16 };
    match f.kind() {
        Kind::String | Kind::Bytes => alloc(len) + if f.is_list() { 24 } else { 0 },
        Kind::Message(m) if f.is_list() || f.is_map() => struct_size(&m),
        _ if f.is_list() => 8,
        _ => 0,
    }
}

/// Counts `by` more elements of repeated field `f` in the message at
/// `path` and refuses past its [`limit`]; the count so far.
fn count(
    counts: &mut HashMap<u32, usize>,
    f: &FieldDescriptor,
    by: usize,
    limits: &WireLimits,
    path: &[String],
) -> Result<usize, Walk> {
    let n = counts.entry(f.number()).or_default();
    *n = n.saturating_add(by);
    let (max, what) = limit(f, limits);
    if *n > max {
        let mut at = path.to_vec();
        at.push(f.name().to_string());
        return Err(Walk::Over(
            at.join("."),
            format!("more than {max} {what}; at most {max} allowed"),
        ));
    }
    Ok(*n)
}

/// Walks one message of `desc`: the decoded bytes it takes beyond its
/// own struct, or why it must not be decoded.
fn walk(
    desc: &MessageDescriptor,
    mut b: &[u8],
    limits: &WireLimits,
    path: &mut Vec<String>,
    depth: usize,
) -> Result<usize, Walk> {
    if depth > MAX_DEPTH {
        return Err(Walk::Over(
            path.join("."),
            format!("nested more than {MAX_DEPTH} deep"),
        ));
    }
    let mut decoded = 0usize;
    let mut counts: HashMap<u32, usize> = HashMap::new();
    while !b.is_empty() {
        let (number, value) = next_field(&mut b).ok_or(Walk::Broken)?;
        let Some(f) = desc.get_field(number) else {
            continue; // unknown: skipped by the decoder too
        };
        let repeated = f.cardinality() == Cardinality::Repeated;
        match (value, f.kind()) {
            (Value::Len(inner), Kind::Message(m)) => {
                if repeated {
                    let n = count(&mut counts, &f, 1, limits, path)?;
                    path.push(format!("{}[{}]", f.name(), n - 1));
                } else {
                    path.push(f.name().to_string());
                }
                let nested = walk(&m, inner, limits, path, depth + 1)?;
                path.pop();
                decoded = decoded
                    .saturating_add(nested)
                    .saturating_add(element_heap(&f, inner.len()));
            }
            (Value::Len(inner), Kind::String | Kind::Bytes) => {
                if inner.len() > limits.string_bytes {
                    path.push(f.name().to_string());
                    return Err(Walk::Over(
                        path.join("."),
                        format!(
                            "a string of {} bytes; at most {} allowed",
                            inner.len(),
                            limits.string_bytes
                        ),
                    ));
                }
                if repeated {
                    count(&mut counts, &f, 1, limits, path)?;
                }
                decoded = decoded.saturating_add(element_heap(&f, inner.len()));
            }
            (Value::Len(inner), _) if repeated => {
                // Packed scalars: at least one byte each.
                count(&mut counts, &f, inner.len(), limits, path)?;
                decoded = decoded.saturating_add(inner.len().saturating_mul(8));
            }
            (_, _) if repeated => {
                count(&mut counts, &f, 1, limits, path)?;
                decoded = decoded.saturating_add(8);
            }
            _ => {}
        }
    }
    Ok(decoded)
}

/// The decoded size [`check`] estimates for a whole `ToDataplane`: its
/// own struct and what it holds.
pub fn decoded_estimate(bytes: &[u8]) -> Option<usize> {
    let desc = to_dataplane();
    let mut path = Vec::new();
    let inner = walk(&desc, bytes, &WireLimits::unlimited(), &mut path, 0).ok()?;
    Some(struct_size(&desc) + inner)
}

impl WireLimits {
    /// No limit at all (for measuring).
    pub fn unlimited() -> Self {
        Self {
            rules: usize::MAX,
            members: usize::MAX,
            map_entries: usize::MAX,
            entries: usize::MAX,
            string_bytes: usize::MAX,
            decoded_factor: usize::MAX,
            decoded_floor: usize::MAX,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::felix::{self, to_dataplane::Payload};
    use prost::Message;

    fn policy(rules: usize) -> felix::ToDataplane {
        felix::ToDataplane {
            sequence_number: 7,
            payload: Some(Payload::ActivePolicyUpdate(felix::ActivePolicyUpdate {
                id: Some(felix::PolicyId {
                    name: "p".into(),
                    ..Default::default()
                }),
                policy: Some(felix::Policy {
                    inbound_rules: vec![felix::Rule::default(); rules],
                    ..Default::default()
                }),
            })),
        }
    }

    /// What the largest IP set Felix sends (`MaxIpsetSize` members) is on
    /// the wire: the default message size limit must take it.
    #[test]
    fn the_largest_ip_sets_fit_the_default_message_size() {
        for v6 in [false, true] {
            let members: Vec<String> = (0..crate::convert::MAX_IPSET_MEMBERS as u32)
                .map(|i| {
                    if v6 {
                        // The longest form: eight groups of four digits.
                        format!(
                            "fd00:1234:5678:9abc:def0:1234:{:04x}:{:04x}",
                            i >> 16,
                            i & 0xffff
                        )
                    } else {
                        format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255)
                    }
                })
                .collect();
            let m = felix::ToDataplane {
                sequence_number: 1,
                payload: Some(Payload::IpsetUpdate(felix::IpSetUpdate {
                    id: "s:big".into(),
                    members,
                    r#type: 0,
                })),
            };
            let len = m.encoded_len();
            eprintln!(
                "{} members, v6 {v6}: {len} bytes",
                crate::convert::MAX_IPSET_MEMBERS
            );
            assert!(len + len / 8 < crate::DEFAULT_MAX_MESSAGE_BYTES, "{len}");
        }
    }

    #[test]
    fn the_raw_message_is_its_bytes() {
        let m = policy(3);
        let bytes = m.encode_to_vec();
        let raw = RawToDataplane::decode(bytes.as_slice()).unwrap();
        assert_eq!(raw.0, bytes);
        assert_eq!(raw.encode_to_vec(), bytes);
        assert_eq!(felix::ToDataplane::decode(raw.0).unwrap(), m);
    }

    #[test]
    fn a_policy_of_a_million_empty_rules_is_refused_undecoded() {
        let bytes = policy(1_000_000).encode_to_vec();
        assert!(bytes.len() < 3 << 20, "{} bytes", bytes.len());
        let r = check(&bytes, &WireLimits::default()).unwrap_err();
        assert_eq!(r.sequence_number, 7);
        assert_eq!(r.field, "active_policy_update.policy.inbound_rules");
        assert!(r.reason.contains("more than 10000 rules"), "{}", r.reason);
        // And at the limit it passes.
        let ok = check(&policy(10_000).encode_to_vec(), &WireLimits::default()).unwrap();
        assert_eq!(ok.sequence_number, 7);
    }

    /// The estimate is never below what decoding takes: the structs'
    /// sizes from the descriptors are at least the generated ones.
    #[test]
    fn the_estimate_covers_the_generated_structs() {
        let desc = |n: &str| {
            crate::descriptor_pool()
                .get_message_by_name(n)
                .expect("known")
        };
        for (name, real) in [
            ("felix.Rule", std::mem::size_of::<felix::Rule>()),
            (
                "felix.ToDataplane",
                std::mem::size_of::<felix::ToDataplane>(),
            ),
            (
                "felix.WorkloadEndpoint",
                std::mem::size_of::<felix::WorkloadEndpoint>(),
            ),
            ("felix.TierInfo", std::mem::size_of::<felix::TierInfo>()),
            ("felix.PolicyID", std::mem::size_of::<felix::PolicyId>()),
        ] {
            let est = struct_size(&desc(name));
            assert!(est >= real && est <= 2 * real, "{name}: {est} vs {real}");
        }
        let many = policy(100_000).encode_to_vec();
        let est = decoded_estimate(&many).unwrap();
        assert!(est >= 100_000 * std::mem::size_of::<felix::Rule>(), "{est}");
    }

    #[test]
    fn many_small_things_are_refused_by_their_decoded_size() {
        // 200,000 empty strings in one rule's nets (2 bytes each on the
        // wire, 24 decoded): under the entries limit? No: over it. With a
        // looser entries limit, the decoded size refuses it.
        let mut m = policy(1);
        if let Some(Payload::ActivePolicyUpdate(u)) = &mut m.payload {
            u.policy.as_mut().unwrap().inbound_rules[0].src_net = vec![String::new(); 200_000];
        }
        let bytes = m.encode_to_vec();
        let r = check(&bytes, &WireLimits::default()).unwrap_err();
        assert_eq!(
            r.field,
            "active_policy_update.policy.inbound_rules[0].src_net"
        );
        let loose = WireLimits {
            entries: usize::MAX,
            decoded_floor: 1 << 20,
            decoded_factor: 4,
            ..WireLimits::default()
        };
        let r = check(&bytes, &loose).unwrap_err();
        assert_eq!(r.field, "");
        assert!(r.reason.contains("decoded"), "{}", r.reason);
    }

    #[test]
    fn a_long_string_is_refused_undecoded() {
        let m = felix::ToDataplane {
            sequence_number: 3,
            payload: Some(Payload::IpsetUpdate(felix::IpSetUpdate {
                id: "x".repeat(70_000),
                ..Default::default()
            })),
        };
        let r = check(&m.encode_to_vec(), &WireLimits::default()).unwrap_err();
        assert_eq!(
            (r.sequence_number, r.field.as_str()),
            (3, "ipset_update.id")
        );
        assert!(r.reason.contains("a string of 70000 bytes"), "{}", r.reason);
    }

    #[test]
    fn a_broken_encoding_passes_to_the_decoder_and_the_sequence_number_is_found() {
        // The sequence number (field 15) first, then a payload cut short.
        let mut bytes = vec![0x78, 7];
        let body = policy(2).encode_to_vec();
        bytes.extend_from_slice(&body[..body.len() - 4]);
        let c = check(&bytes, &WireLimits::default()).unwrap();
        assert_eq!(c.sequence_number, 7);
        assert!(felix::ToDataplane::decode(bytes.as_slice()).is_err());
        assert!(check(&[0xff; 11], &WireLimits::default()).is_ok());
        assert!(check(&[], &WireLimits::default()).is_ok());
    }
}
