//! Our compiled `felix` descriptors against Calico's field table
//! (`tests/fixtures/felix-wire.json`, read from felixbackend.proto at
//! commit 87c15906): every message reachable from ToDataplane and
//! FromDataplane has the same fields, numbers, types, labels and oneofs,
//! and every enum the same values.

use std::collections::{BTreeMap, BTreeSet};

use prost_reflect::{Cardinality, FieldDescriptor, Kind, MessageDescriptor};

fn type_name(f: &FieldDescriptor) -> String {
    fn scalar(k: &Kind) -> String {
        match k {
            Kind::Double => "double".into(),
            Kind::Float => "float".into(),
            Kind::Int32 => "int32".into(),
            Kind::Int64 => "int64".into(),
            Kind::Uint32 => "uint32".into(),
            Kind::Uint64 => "uint64".into(),
            Kind::Sint32 => "sint32".into(),
            Kind::Sint64 => "sint64".into(),
            Kind::Fixed32 => "fixed32".into(),
            Kind::Fixed64 => "fixed64".into(),
            Kind::Sfixed32 => "sfixed32".into(),
            Kind::Sfixed64 => "sfixed64".into(),
            Kind::Bool => "bool".into(),
            Kind::String => "string".into(),
            Kind::Bytes => "bytes".into(),
            Kind::Message(m) => m.name().into(),
            Kind::Enum(e) => e.name().into(),
        }
    }
    if f.is_map() {
        let Kind::Message(entry) = f.kind() else {
            unreachable!()
        };
        let k = entry.map_entry_key_field();
        let v = entry.map_entry_value_field();
        return format!("map<{},{}>", scalar(&k.kind()), scalar(&v.kind()));
    }
    scalar(&f.kind())
}

fn reachable(root: MessageDescriptor, out: &mut BTreeMap<String, MessageDescriptor>) {
    let name = root.full_name().trim_start_matches("felix.").to_string();
    if out.contains_key(&name) {
        return;
    }
    out.insert(name, root.clone());
    for f in root.fields() {
        if let Kind::Message(m) = f.kind() {
            if m.is_map_entry() {
                if let Kind::Message(v) = m.map_entry_value_field().kind() {
                    reachable(v, out);
                }
            } else {
                reachable(m, out);
            }
        }
    }
}

#[test]
fn felix_messages_match_calicos_field_table() {
    let want: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/felix-wire.json")).expect("fixture parses");
    let pool = dphandler_proto::descriptor_pool();
    let mut ours = BTreeMap::new();
    for root in ["felix.ToDataplane", "felix.FromDataplane"] {
        reachable(pool.get_message_by_name(root).expect(root), &mut ours);
    }
    let want_msgs = want["messages"].as_object().unwrap();
    let want_names: BTreeSet<&String> = want_msgs.keys().collect();
    let our_names: BTreeSet<&String> = ours.keys().collect();
    assert_eq!(our_names, want_names, "set of reachable messages differs");

    let mut checked = 0;
    for (name, fields) in want_msgs {
        let msg = &ours[name];
        let want_fields = fields.as_array().unwrap();
        assert_eq!(msg.fields().len(), want_fields.len(), "{name}: field count");
        for wf in want_fields {
            let fname = wf["name"].as_str().unwrap();
            let f = msg
                .get_field_by_name(fname)
                .unwrap_or_else(|| panic!("{name}.{fname} missing"));
            assert_eq!(
                u64::from(f.number()),
                wf["number"].as_u64().unwrap(),
                "{name}.{fname}: number"
            );
            assert_eq!(
                type_name(&f),
                wf["type"].as_str().unwrap(),
                "{name}.{fname}: type"
            );
            let label = match (f.is_map(), f.cardinality()) {
                (true, _) => None, // maps are listed by their map<> type
                (false, Cardinality::Repeated) => Some("repeated"),
                (false, Cardinality::Optional)
                    if f.supports_presence()
                        && f.containing_oneof().is_none()
                        && !matches!(f.kind(), Kind::Message(_)) =>
                {
                    Some("optional")
                }
                _ => None,
            };
            assert_eq!(
                label,
                wf.get("label").and_then(|l| l.as_str()),
                "{name}.{fname}: label"
            );
            let oneof = f.containing_oneof().map(|o| o.name().to_string());
            assert_eq!(
                oneof.as_deref(),
                wf.get("oneof").and_then(|o| o.as_str()),
                "{name}.{fname}: oneof"
            );
            checked += 1;
        }
    }
    assert!(checked > 200, "only {checked} fields checked");

    for (ename, values) in want["enums"].as_object().unwrap() {
        let e = pool
            .get_enum_by_name(&format!("felix.{ename}"))
            .unwrap_or_else(|| panic!("enum {ename} missing"));
        let ours: BTreeMap<String, i64> = e
            .values()
            .map(|v| (v.name().to_string(), i64::from(v.number())))
            .collect();
        let want: BTreeMap<String, i64> = values
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_i64().unwrap()))
            .collect();
        assert_eq!(ours, want, "enum {ename}");
    }
}

#[test]
fn a_tampered_table_is_caught() {
    // The check above must be able to fail: change one field number in the
    // fixture and the comparison sees it.
    let mut want: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/felix-wire.json")).unwrap();
    want["messages"]["IPSetUpdate"][0]["number"] = 99.into();
    let pool = dphandler_proto::descriptor_pool();
    let f = pool
        .get_message_by_name("felix.IPSetUpdate")
        .unwrap()
        .get_field_by_name("id")
        .unwrap();
    assert_ne!(
        u64::from(f.number()),
        want["messages"]["IPSetUpdate"][0]["number"]
            .as_u64()
            .unwrap()
    );
}
