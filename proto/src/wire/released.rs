//! The one form of a released Felix (v3.31, v3.32) that our descriptors
//! cannot declare beside master's: a `TierInfo`'s `ingress_policies` and
//! `egress_policies` are policy names (`repeated string`) in releases and
//! `PolicyID` messages at master, under the same field numbers. [`normalize`]
//! rewrites each name into `PolicyID{name}` before anything is decoded, so
//! one decoder takes both. (The policy's own id, `ActivePolicyUpdate.id`,
//! is `PolicyID{tier, name}` in releases: our `PolicyID` declares the
//! released `tier` field, and the name alone identifies the policy, as the
//! released names carry their tier: `default.allow-web`.)
//!
//! The two forms cannot be confused: an encoded `PolicyID` starts with a
//! field tag (0x0a, 0x12, 0x1a or 0x22: a control character or `"`), and a
//! Calico policy name with a letter or a digit (names are DNS-1123 labels
//! and subdomains, namespaced ones `namespace/name`).

use std::collections::HashSet;
use std::sync::OnceLock;

use prost_reflect::{Kind, MessageDescriptor};

use super::{Value, next_field, to_dataplane, varint};

/// `PolicyID.name`'s tag: field 2, length-delimited.
const POLICY_ID_NAME_TAG: u8 = (2 << 3) | 2;

/// The ToDataplane message with a released Felix's `TierInfo` names
/// rewritten as master's `PolicyID`s, or `None` when it holds none (every
/// message of master's Felix, and all but a released Felix's endpoint
/// updates). A broken encoding is left to the decoder to report.
pub fn normalize(bytes: &[u8]) -> Option<Vec<u8>> {
    let desc = to_dataplane();
    rewrite(&desc, bytes, holders())
}

/// The full names of the messages that can hold a `TierInfo` (itself
/// included): only their fields are walked.
fn holders() -> &'static HashSet<String> {
    static HOLDERS: OnceLock<HashSet<String>> = OnceLock::new();
    HOLDERS.get_or_init(|| {
        fn holds(m: &MessageDescriptor, seen: &mut Vec<String>) -> bool {
            if m.full_name() == "felix.TierInfo" {
                return true;
            }
            if seen.iter().any(|s| s == m.full_name()) {
                return false;
            }
            seen.push(m.full_name().to_string());
            let found = m.fields().any(|f| match f.kind() {
                Kind::Message(inner) => holds(&inner, seen),
                _ => false,
            });
            seen.pop();
            found
        }
        let mut out = HashSet::new();
        let mut stack = vec![to_dataplane()];
        while let Some(m) = stack.pop() {
            if !out.contains(m.full_name()) && holds(&m, &mut Vec::new()) {
                out.insert(m.full_name().to_string());
                for f in m.fields() {
                    if let Kind::Message(inner) = f.kind() {
                        stack.push(inner);
                    }
                }
            }
        }
        out
    })
}

fn is_released_name(element: &[u8]) -> bool {
    element.first().is_some_and(u8::is_ascii_alphanumeric)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// One message of `desc`, rewritten, or `None` if nothing in it changes.
fn rewrite(desc: &MessageDescriptor, bytes: &[u8], holders: &HashSet<String>) -> Option<Vec<u8>> {
    let tier_info = desc.full_name() == "felix.TierInfo";
    // (where the field's length starts, where its value ends, in `bytes`;
    // its new value)
    let mut changes: Vec<(usize, usize, Vec<u8>)> = Vec::new();
    let mut b = bytes;
    while !b.is_empty() {
        let mut after_tag = b;
        varint(&mut after_tag)?;
        let len_start = bytes.len() - after_tag.len();
        let (number, value) = next_field(&mut b)?;
        let Value::Len(inner) = value else { continue };
        let Some(f) = desc.get_field(number) else {
            continue;
        };
        let Kind::Message(m) = f.kind() else { continue };
        let end = bytes.len() - b.len();
        let new = if tier_info && m.full_name() == "felix.PolicyID" {
            is_released_name(inner).then(|| {
                let mut id = Vec::with_capacity(inner.len() + 6);
                id.push(POLICY_ID_NAME_TAG);
                put_varint(&mut id, inner.len() as u64);
                id.extend_from_slice(inner);
                id
            })
        } else if holders.contains(m.full_name()) {
            rewrite(&m, inner, holders)
        } else {
            None
        };
        if let Some(new) = new {
            changes.push((len_start, end, new));
        }
    }
    if changes.is_empty() {
        return None;
    }
    // Each changed value with its new length; everything else as it was.
    let mut out = Vec::with_capacity(bytes.len() + changes.len() * 8);
    let mut at = 0;
    for (len_start, end, new) in changes {
        out.extend_from_slice(&bytes[at..len_start]);
        put_varint(&mut out, new.len() as u64);
        out.extend_from_slice(&new);
        at = end;
    }
    out.extend_from_slice(&bytes[at..]);
    Some(out)
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::normalize;
    use crate::felix::{self, to_dataplane::Payload};

    /// A released Felix's TierInfo, encoded by hand: names as strings.
    fn released_tier(name: &str, ingress: &[&str], egress: &[&str]) -> Vec<u8> {
        let mut t = Vec::new();
        prost::encoding::string::encode(1, &name.to_string(), &mut t);
        for p in ingress {
            prost::encoding::string::encode(2, &p.to_string(), &mut t);
        }
        for p in egress {
            prost::encoding::string::encode(3, &p.to_string(), &mut t);
        }
        prost::encoding::string::encode(4, &"Deny".to_string(), &mut t);
        t
    }

    fn workload_update(tiers: &[Vec<u8>]) -> Vec<u8> {
        // WorkloadEndpointUpdate{id, endpoint{name, tiers}} with the tiers
        // spliced in as raw bytes.
        let id = felix::WorkloadEndpointId {
            orchestrator_id: "k8s".into(),
            workload_id: "ns1/pod1".into(),
            endpoint_id: "eth0".into(),
        };
        let mut ep = felix::WorkloadEndpoint {
            name: "cali1234".into(),
            ..Default::default()
        }
        .encode_to_vec();
        for t in tiers {
            prost::encoding::bytes::encode(7, &t.clone(), &mut ep);
        }
        let mut u = Vec::new();
        prost::encoding::message::encode(1, &id, &mut u);
        prost::encoding::bytes::encode(5, &ep, &mut u);
        let mut m = Vec::new();
        prost::encoding::uint64::encode(15, &42, &mut m);
        prost::encoding::bytes::encode(11, &u, &mut m);
        m
    }

    #[test]
    fn a_released_felixs_policy_names_become_policy_ids() {
        let raw = workload_update(&[
            released_tier(
                "default",
                &["default.allow-web", "ns1/default.np1"],
                &["default.egress"],
            ),
            released_tier("security", &[], &["security.deny-all"]),
        ]);
        let rewritten = normalize(&raw).expect("rewritten");
        let msg = felix::ToDataplane::decode(rewritten.as_slice()).expect("decodes");
        assert_eq!(msg.sequence_number, 42);
        let Some(Payload::WorkloadEndpointUpdate(u)) = msg.payload else {
            panic!("{msg:?}")
        };
        let ep = u.endpoint.unwrap();
        assert_eq!(ep.name, "cali1234");
        let names =
            |ids: &[felix::PolicyId]| ids.iter().map(|i| i.name.clone()).collect::<Vec<_>>();
        assert_eq!(ep.tiers.len(), 2);
        assert_eq!(ep.tiers[0].name, "default");
        assert_eq!(
            names(&ep.tiers[0].ingress_policies),
            ["default.allow-web", "ns1/default.np1"]
        );
        assert_eq!(names(&ep.tiers[0].egress_policies), ["default.egress"]);
        assert_eq!(ep.tiers[0].default_action, "Deny");
        assert_eq!(names(&ep.tiers[1].egress_policies), ["security.deny-all"]);
        assert_eq!(u.id.unwrap().workload_id, "ns1/pod1");
    }

    #[test]
    fn masters_form_and_other_messages_are_left_alone() {
        let master = felix::ToDataplane {
            sequence_number: 7,
            payload: Some(Payload::WorkloadEndpointUpdate(
                felix::WorkloadEndpointUpdate {
                    id: None,
                    endpoint: Some(felix::WorkloadEndpoint {
                        tiers: vec![felix::TierInfo {
                            name: "default".into(),
                            ingress_policies: vec![felix::PolicyId {
                                name: "allow-web".into(),
                                namespace: "ns1".into(),
                                kind: "NetworkPolicy".into(),
                                ..Default::default()
                            }],
                            ..Default::default()
                        }],
                        ..Default::default()
                    }),
                },
            )),
        };
        assert_eq!(normalize(&master.encode_to_vec()), None);
        let ipset = felix::ToDataplane {
            sequence_number: 8,
            payload: Some(Payload::IpsetUpdate(felix::IpSetUpdate {
                id: "s:abc".into(),
                members: vec!["10.0.0.1".into()],
                ..Default::default()
            })),
        };
        assert_eq!(normalize(&ipset.encode_to_vec()), None);
        // A broken encoding is left for the decoder to report.
        let mut broken = workload_update(&[released_tier("default", &["default.a"], &[])]);
        broken.truncate(broken.len() - 3);
        assert_eq!(normalize(&broken), None);
    }

    #[test]
    fn a_long_name_gets_a_longer_length() {
        // Lengths grow by the wrapper's two or three bytes, through every
        // enclosing message: a name of 126 bytes crosses a varint boundary.
        let long = format!("default.{}", "a".repeat(118));
        let raw = workload_update(&[released_tier("default", &[&long], &[])]);
        let msg = felix::ToDataplane::decode(normalize(&raw).unwrap().as_slice()).unwrap();
        let Some(Payload::WorkloadEndpointUpdate(u)) = msg.payload else {
            panic!()
        };
        assert_eq!(u.endpoint.unwrap().tiers[0].ingress_policies[0].name, long);
    }
}
