//! Our compiled `felix` descriptors against Calico's field tables: master
//! (`tests/fixtures/felix-wire.json`, read from felixbackend.proto at
//! commit 87c15906) and the release the tests' Felix is built from
//! (`felix-wire-v3.31.0.json`, printed by `tests/calico/wiredump`). Every
//! message reachable from ToDataplane and FromDataplane in either has the
//! same fields, numbers, types, labels and oneofs in ours, every enum the
//! same values, and ours has nothing neither has.

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

/// One field as a table row: (name, number, type, label, oneof).
type Row = (String, u64, String, Option<String>, Option<String>);

fn our_row(f: &FieldDescriptor) -> Row {
    let label = match (f.is_map(), f.cardinality()) {
        (true, _) => None, // maps are listed by their map<> type
        (false, Cardinality::Repeated) => Some("repeated".to_string()),
        (false, Cardinality::Optional)
            if f.supports_presence()
                && f.containing_oneof().is_none()
                && !matches!(f.kind(), Kind::Message(_)) =>
        {
            Some("optional".to_string())
        }
        _ => None,
    };
    (
        f.name().to_string(),
        u64::from(f.number()),
        type_name(f),
        label,
        f.containing_oneof().map(|o| o.name().to_string()),
    )
}

fn table_row(f: &serde_json::Value) -> Row {
    let s = |k: &str| f.get(k).and_then(|v| v.as_str()).map(str::to_string);
    (
        s("name").unwrap(),
        f["number"].as_u64().unwrap(),
        s("type").unwrap(),
        s("label"),
        s("oneof"),
    )
}

/// The one released form our descriptors cannot declare beside master's: a
/// TierInfo's policies are names in releases, PolicyIDs at master (the
/// server rewrites the names before decoding: `wire::normalize`).
fn rewritten_before_decoding(message: &str, field: &str) -> bool {
    message == "TierInfo" && matches!(field, "ingress_policies" | "egress_policies")
}

/// Every message, field and enum value of each table is ours, the same in
/// every respect, and we have nothing that none of the tables has. Returns
/// the differences, and how many fields were compared.
fn compare(tables: &[&serde_json::Value]) -> (Vec<String>, usize) {
    let pool = dphandler_proto::descriptor_pool();
    let mut ours = BTreeMap::new();
    for root in ["felix.ToDataplane", "felix.FromDataplane"] {
        reachable(pool.get_message_by_name(root).expect(root), &mut ours);
    }
    let mut diffs = Vec::new();
    let mut checked = 0;
    let mut listed: BTreeMap<&str, BTreeSet<u64>> = BTreeMap::new();
    for table in tables {
        for (name, fields) in table["messages"].as_object().unwrap() {
            let Some(msg) = ours.get(name) else {
                diffs.push(format!("{name}: missing"));
                continue;
            };
            listed.entry(name).or_default();
            for wf in fields.as_array().unwrap() {
                let want = table_row(wf);
                listed.entry(name).or_default().insert(want.1);
                let Some(f) = msg.get_field(u32::try_from(want.1).unwrap()) else {
                    diffs.push(format!("{name}.{}: missing", want.0));
                    continue;
                };
                let got = our_row(&f);
                if got != want && !rewritten_before_decoding(name, &want.0) {
                    diffs.push(format!(
                        "{name}.{}: ours {got:?}, Calico's {want:?}",
                        want.0
                    ));
                }
                checked += 1;
            }
        }
        for (ename, values) in table["enums"].as_object().unwrap() {
            let Some(e) = pool.get_enum_by_name(&format!("felix.{ename}")) else {
                diffs.push(format!("enum {ename}: missing"));
                continue;
            };
            for (v, n) in values.as_object().unwrap() {
                match e.get_value_by_name(v) {
                    Some(ours) if Some(i64::from(ours.number())) == n.as_i64() => {}
                    other => diffs.push(format!(
                        "enum {ename}.{v}: ours {:?}, Calico's {n}",
                        other.map(|o| o.number())
                    )),
                }
            }
        }
    }
    for (name, msg) in &ours {
        match listed.get(name.as_str()) {
            None => diffs.push(format!("{name}: in no table")),
            Some(numbers) => {
                for f in msg.fields() {
                    if !numbers.contains(&u64::from(f.number())) {
                        diffs.push(format!("{name}.{}: in no table", f.name()));
                    }
                }
            }
        }
    }
    (diffs, checked)
}

fn table(json: &str) -> serde_json::Value {
    serde_json::from_str(json).expect("fixture parses")
}

const MASTER: &str = include_str!("fixtures/felix-wire.json");
const RELEASED: &str = include_str!("fixtures/felix-wire-v3.31.0.json");

#[test]
fn felix_messages_match_calicos_field_tables_of_master_and_the_release() {
    let (diffs, checked) = compare(&[&table(MASTER), &table(RELEASED)]);
    assert!(diffs.is_empty(), "differences:\n{}", diffs.join("\n"));
    assert!(checked > 400, "only {checked} fields checked");
}

#[test]
fn the_released_only_messages_are_ours() {
    let released = table(RELEASED);
    let master = table(MASTER);
    for m in [
        "HostMetadataV6Update",
        "HostMetadataV6Remove",
        "HostMetadataV4V6Update",
        "HostMetadataV4V6Remove",
    ] {
        assert!(released["messages"].get(m).is_some(), "{m} in v3.31.0");
        assert!(master["messages"].get(m).is_none(), "{m} not at master");
    }
    let (diffs, _) = compare(&[&released]);
    // Against the release alone, only master's additions are extra.
    assert!(
        diffs.iter().all(|d| d.ends_with("in no table")),
        "{diffs:?}"
    );
    assert!(
        diffs.iter().any(|d| d == "PolicyID.kind: in no table"),
        "{diffs:?}"
    );
}

#[test]
fn a_tampered_table_is_caught() {
    // The comparison must be able to fail: a field number changed, a field
    // that is not ours, and one of ours that no table lists.
    let mut t = table(MASTER);
    t["messages"]["IPSetUpdate"][0]["number"] = 99.into();
    let (diffs, _) = compare(&[&t, &table(RELEASED)]);
    assert!(
        diffs.iter().any(|d| d.starts_with("IPSetUpdate.id")),
        "{diffs:?}"
    );
    let mut t = table(MASTER);
    t["messages"]["PolicyID"][0]["type"] = "bytes".into();
    let (diffs, _) = compare(&[&t, &table(RELEASED)]);
    assert!(
        diffs.iter().any(|d| d.starts_with("PolicyID.name")),
        "{diffs:?}"
    );
    let (diffs, _) = compare(&[&table(MASTER)]);
    assert!(
        diffs
            .iter()
            .any(|d| d == "HostMetadataV6Update: in no table"),
        "{diffs:?}"
    );
}
