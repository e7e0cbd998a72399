//! Text forms of the wire messages, in the canonical protobuf JSON mapping.
//!
//! [`parse_to_dataplane`] reads what `dphctl push` accepts: one YAML stream
//! (documents separated by `---`), or JSON: one value, several concatenated,
//! or one per line (NDJSON). A value that is an array holds several messages.
//! Field names may be lowerCamelCase (`ipsetUpdate`) or as in the `.proto`
//! (`ipset_update`); unknown fields are errors, as the mapping requires.
//!
//! [`to_json`] renders any of our messages the same way, for `dphctl watch`.

use prost_reflect::{DynamicMessage, MessageDescriptor, SerializeOptions};

use crate::felix;

/// Why a text input could not be read. None of these is helped by a retry:
/// the input must be fixed.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("not valid JSON: {source}")]
    Json {
        #[source]
        source: serde_json::Error,
    },
    #[error("not valid YAML: {source}")]
    Yaml {
        #[source]
        source: serde_yaml::Error,
    },
    #[error("message {index} (counting from 1) is not a felix.ToDataplane: {source}")]
    Message {
        index: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("message {index} (counting from 1) is a {found}, not an object")]
    NotAnObject { index: usize, found: &'static str },
    #[error("the message cannot be rendered: {0}")]
    Render(String),
}

fn descriptor(full_name: &str) -> MessageDescriptor {
    crate::descriptor_pool()
        .get_message_by_name(full_name)
        .unwrap_or_else(|| panic!("{full_name} is in our descriptor set"))
}

/// The values of a text input, arrays flattened, empty YAML documents skipped.
fn values(input: &str) -> Result<Vec<serde_json::Value>, TextError> {
    use serde::Deserialize;
    let mut out = Vec::new();
    let mut push = |v: serde_json::Value| match v {
        serde_json::Value::Array(items) => out.extend(items),
        serde_json::Value::Null => {}
        v => out.push(v),
    };
    let trimmed = input.trim_start();
    if trimmed.starts_with('{') || trimmed.starts_with('[') {
        for v in serde_json::Deserializer::from_str(input).into_iter::<serde_json::Value>() {
            push(v.map_err(|source| TextError::Json { source })?);
        }
    } else {
        for doc in serde_yaml::Deserializer::from_str(input) {
            push(serde_json::Value::deserialize(doc).map_err(|source| TextError::Yaml { source })?);
        }
    }
    Ok(out)
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}

/// Parses YAML, JSON, concatenated JSON or NDJSON into `felix.ToDataplane`
/// messages, in input order.
pub fn parse_to_dataplane(input: &str) -> Result<Vec<felix::ToDataplane>, TextError> {
    let desc = descriptor("felix.ToDataplane");
    values(input)?
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let index = i + 1;
            if !v.is_object() {
                return Err(TextError::NotAnObject {
                    index,
                    found: kind(&v),
                });
            }
            let dynamic = DynamicMessage::deserialize(desc.clone(), v)
                .map_err(|source| TextError::Message { index, source })?;
            dynamic
                .transcode_to::<felix::ToDataplane>()
                .map_err(|e| TextError::Render(e.to_string()))
        })
        .collect()
}

/// Gives each message without a sequence number (0) the one after the
/// previous message's, so a hand-written file needs none.
pub fn number(msgs: &mut [felix::ToDataplane]) {
    let mut next = 1;
    for m in msgs {
        if m.sequence_number == 0 {
            m.sequence_number = next;
        }
        next = m.sequence_number + 1;
    }
}

/// Renders a message of ours (`full_name` is its protobuf name, e.g.
/// `felix.FromDataplane`) as one line of canonical JSON. Fields at their
/// default value are left out, as the mapping does.
pub fn to_json<M: prost::Message>(full_name: &str, msg: &M) -> Result<String, TextError> {
    let mut dynamic = DynamicMessage::new(descriptor(full_name));
    dynamic
        .transcode_from(msg)
        .map_err(|e| TextError::Render(e.to_string()))?;
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::new(&mut out);
    dynamic
        .serialize_with_options(&mut ser, &SerializeOptions::new())
        .map_err(|e| TextError::Render(e.to_string()))?;
    String::from_utf8(out).map_err(|e| TextError::Render(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix::to_dataplane::Payload;

    fn payload_names(msgs: &[felix::ToDataplane]) -> Vec<&'static str> {
        msgs.iter()
            .map(|m| match m.payload {
                Some(Payload::InSync(_)) => "in_sync",
                Some(Payload::IpsetUpdate(_)) => "ipset_update",
                Some(Payload::IpsetRemove(_)) => "ipset_remove",
                Some(Payload::ActivePolicyUpdate(_)) => "active_policy_update",
                Some(_) => "other",
                None => "none",
            })
            .collect()
    }

    #[test]
    fn yaml_documents_and_arrays() {
        let msgs = parse_to_dataplane(
            "sequenceNumber: 1\nipsetUpdate: {id: s1, members: [10.0.0.1], type: NET}\n---\n\
             - sequence_number: 2\n  ipset_remove: {id: s1}\n- inSync: {}\n---\n",
        )
        .unwrap();
        assert_eq!(
            payload_names(&msgs),
            ["ipset_update", "ipset_remove", "in_sync"]
        );
        assert_eq!(msgs[0].sequence_number, 1);
        assert_eq!(msgs[1].sequence_number, 2);
        match &msgs[0].payload {
            Some(Payload::IpsetUpdate(u)) => {
                assert_eq!(u.id, "s1");
                assert_eq!(u.members, ["10.0.0.1"]);
                assert_eq!(u.r#type, felix::ip_set_update::IpSetType::Net as i32);
            }
            p => panic!("{p:?}"),
        }
    }

    #[test]
    fn json_ndjson_and_concatenated() {
        let one = r#"[{"sequenceNumber":"5","inSync":{}}]"#;
        let nd = "{\"ipsetRemove\":{\"id\":\"a\"}}\n{\"inSync\":{}}\n";
        let cat = r#"{"ipsetRemove":{"id":"a"}}{"inSync":{}}"#;
        assert_eq!(parse_to_dataplane(one).unwrap()[0].sequence_number, 5);
        assert_eq!(
            payload_names(&parse_to_dataplane(nd).unwrap()),
            ["ipset_remove", "in_sync"]
        );
        assert_eq!(
            payload_names(&parse_to_dataplane(cat).unwrap()),
            ["ipset_remove", "in_sync"]
        );
    }

    #[test]
    fn errors_name_the_message_and_field() {
        let e = parse_to_dataplane("{\"inSync\":{}}\n{\"ipsetUpdat\":{}}\n").unwrap_err();
        let s = e.to_string();
        assert!(s.contains("message 2"), "{s}");
        assert!(s.contains("ipsetUpdat"), "{s}");
        let e = parse_to_dataplane("- 3\n").unwrap_err();
        assert!(e.to_string().contains("message 1"), "{e}");
        assert!(e.to_string().contains("number"), "{e}");
        let e = parse_to_dataplane("{\"inSync\":").unwrap_err();
        assert!(matches!(e, TextError::Json { .. }), "{e}");
        let e = parse_to_dataplane("a: [\n").unwrap_err();
        assert!(matches!(e, TextError::Yaml { .. }), "{e}");
    }

    #[test]
    fn numbers_follow_the_previous_message() {
        let m = |seq| felix::ToDataplane {
            sequence_number: seq,
            payload: Some(Payload::InSync(felix::InSync {})),
        };
        let mut v = vec![m(0), m(0), m(10), m(0), m(3), m(0)];
        number(&mut v);
        let seqs: Vec<u64> = v.iter().map(|m| m.sequence_number).collect();
        assert_eq!(seqs, [1, 2, 10, 11, 3, 4]);
    }

    #[test]
    fn renders_canonical_json() {
        let msg = felix::FromDataplane {
            sequence_number: 0,
            payload: Some(felix::from_dataplane::Payload::DataplaneInSync(
                felix::DataplaneInSync {},
            )),
        };
        assert_eq!(
            to_json("felix.FromDataplane", &msg).unwrap(),
            r#"{"dataplaneInSync":{}}"#
        );
        // And back: what we render, push parses.
        let to = felix::ToDataplane {
            sequence_number: 9,
            payload: Some(Payload::IpsetRemove(felix::IpSetRemove { id: "x".into() })),
        };
        let text = to_json("felix.ToDataplane", &to).unwrap();
        assert_eq!(parse_to_dataplane(&text).unwrap(), vec![to]);
    }
}
