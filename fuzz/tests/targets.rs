//! The fuzz targets, each for `DPH_FUZZ_SECONDS` (CI: 60): what reads
//! untrusted input must not panic, and what it accepts must render into
//! rules the kernel tools take.
//!
//! - `proto`: bytes → `felix.ToDataplane` → the model (the gRPC path).
//! - `text`: what `dphctl push` reads (JSON, NDJSON, YAML) → messages.
//! - `render`: messages changed field by field; those the edge and the
//!   managers accept are rendered by the managers into iptables tables:
//!   that must succeed, every rule must be made of the tokens
//!   iptables-restore is given (`[A-Za-z0-9._:/,!=+@%-]`), and every rule
//!   must translate to nftables.
//! - `save`: `iptables-save` and `ipset save` output → our parsers.

use dphandler_dataplane::backends::DesiredKernel;
use dphandler_dataplane::backends::iptables::{InsertMode, IptablesExec, Ownership, Table};
use dphandler_dataplane::managers::Manager;
use dphandler_dataplane::managers::endpoints::{
    EndpointsConfig, EndpointsManager, default_failsafe,
};
use dphandler_dataplane::managers::nat::NatManager;
use dphandler_dataplane::model::ipsets::SetNames;
use dphandler_dataplane::model::{IpVersion, Update};
use dphandler_fuzz::{apply, corpus, mutated, run_for};
use dphandler_proto::felix;
use dphandler_proto::text::parse_to_dataplane;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use prost::Message;
use std::sync::atomic::{AtomicU64, Ordering};

/// The corpus's messages, one per file message.
fn messages() -> Vec<felix::ToDataplane> {
    corpus("messages")
        .iter()
        .flat_map(|(p, b)| {
            let text = std::str::from_utf8(b).expect("UTF-8 corpus");
            parse_to_dataplane(text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        })
        .collect()
}

#[test]
fn proto() {
    let inputs: Vec<Vec<u8>> = messages().iter().map(Message::encode_to_vec).collect();
    let others: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    let ran = run_for("proto", mutated(inputs.len()), |(i, muts)| {
        let bytes = apply(&inputs[i], &muts, &others);
        if let Ok(msg) = felix::ToDataplane::decode(bytes.as_slice()) {
            let _ = dphandler_proto::convert::to_update(msg);
        }
        Ok(())
    });
    assert!(ran.cases > 0);
}

#[test]
fn text() {
    let files = corpus("messages");
    let inputs: Vec<&[u8]> = files.iter().map(|(_, b)| b.as_slice()).collect();
    let ran = run_for("text", mutated(inputs.len()), |(i, muts)| {
        let bytes = apply(inputs[i], &muts, &inputs);
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(msgs) = parse_to_dataplane(&text) {
            for m in msgs {
                let _ = dphandler_proto::convert::to_update(m);
            }
        }
        Ok(())
    });
    assert!(ran.cases > 0);
}

#[test]
fn save() {
    let ipt = corpus("iptables-save");
    let ips = corpus("ipset-save");
    let ipt_in: Vec<&[u8]> = ipt.iter().map(|(_, b)| b.as_slice()).collect();
    let ips_in: Vec<&[u8]> = ips.iter().map(|(_, b)| b.as_slice()).collect();
    let ran = run_for(
        "save",
        (any::<bool>(), mutated(ipt_in.len().max(ips_in.len()))),
        |(iptables, (i, muts))| {
            if iptables {
                let bytes = apply(ipt_in[i % ipt_in.len()], &muts, &ipt_in);
                let text = String::from_utf8_lossy(&bytes);
                let _ = dphandler_dataplane::backends::iptables::save::parse(&text, "dph:");
            } else {
                let bytes = apply(ips_in[i % ips_in.len()], &muts, &ips_in);
                let text = String::from_utf8_lossy(&bytes);
                let _ = dphandler_dataplane::backends::ipsets::save::parse(&text, |n| {
                    n.starts_with("dph")
                });
            }
            Ok(())
        },
    );
    assert!(ran.cases > 0);
}

/// Changed messages that the edge and the managers accepted (so were
/// rendered): a target whose changes are all refused tests nothing.
static ACCEPTED: AtomicU64 = AtomicU64::new(0);

/// Reads an empty table, takes every write.
#[derive(Debug)]
struct NoKernel;

impl IptablesExec for NoKernel {
    fn save(&mut self, _: &str) -> Result<String, dphandler_dataplane::backends::BackendError> {
        Ok(String::new())
    }
    fn restore(&mut self, _: &str) -> Result<(), dphandler_dataplane::backends::BackendError> {
        Ok(())
    }
}

fn kernel() -> DesiredKernel {
    let mut tables = Vec::new();
    for v in [IpVersion::V4, IpVersion::V6] {
        for t in ["raw", "mangle", "nat", "filter"] {
            tables.push(Table::new(
                t,
                v,
                Ownership::new("dph"),
                InsertMode::Insert,
                Box::new(NoKernel),
            ));
        }
    }
    DesiredKernel {
        tables,
        ..Default::default()
    }
}

fn managers() -> Vec<Box<dyn Manager>> {
    let names = SetNames::new("dph").expect("a prefix");
    let (failsafe_in, failsafe_out) = default_failsafe();
    vec![
        Box::new(NatManager::new("dph", names.clone())),
        Box::new(EndpointsManager::new(
            EndpointsConfig {
                prefix: "dph".into(),
                workload_prefix: "cali".into(),
                marks: Default::default(),
                failsafe_in,
                failsafe_out,
                device_route_protocol: 3,
                vxlan: Default::default(),
                vxlan_port: 4789,
                wireguard: [
                    dphandler_dataplane::model::wireguard::WgSettings::default_for(IpVersion::V4),
                    dphandler_dataplane::model::wireguard::WgSettings::default_for(IpVersion::V6),
                ],
                endpoint_to_host: Default::default(),
            },
            names,
        )),
    ]
}

/// Whether the loop and the managers accept `u` (as the sync loop asks).
fn accepted(ms: &[Box<dyn Manager>], u: &Update) -> bool {
    if let Update::Config(kv) = u
        && dphandler_dataplane::sync_loop::check_config(kv).is_err()
    {
        return false;
    }
    ms.iter().all(|m| m.check(u).is_ok())
}

/// The JSON leaves of `v` (paths into it).
fn leaves(v: &serde_json::Value, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, c) in m {
                path.push(k.clone());
                leaves(c, path, out);
                path.pop();
            }
        }
        serde_json::Value::Array(a) => {
            out.push(path.clone()); // the array itself: emptied or doubled
            for (i, c) in a.iter().enumerate() {
                path.push(i.to_string());
                leaves(c, path, out);
                path.pop();
            }
        }
        _ => out.push(path.clone()),
    }
}

fn at<'a>(v: &'a mut serde_json::Value, path: &[String]) -> Option<&'a mut serde_json::Value> {
    path.iter().try_fold(v, |v, k| match v {
        serde_json::Value::Object(m) => m.get_mut(k),
        serde_json::Value::Array(a) => a.get_mut(k.parse::<usize>().ok()?),
        _ => None,
    })
}

/// What a leaf becomes.
fn replacement(choice: usize, old: &serde_json::Value) -> serde_json::Value {
    use serde_json::json;
    const NUMBERS: &[i64] = &[0, -1, 1, 255, 256, 65535, 65536, 2147483647, -2147483648];
    let dict = dphandler_fuzz::DICTIONARY;
    match (old, choice % 4) {
        (serde_json::Value::Array(_), 0) => json!([]),
        (serde_json::Value::Array(a), _) => {
            let mut d = a.clone();
            d.extend(a.iter().cloned());
            serde_json::Value::Array(d)
        }
        (serde_json::Value::Number(_), _) => json!(NUMBERS[choice / 4 % NUMBERS.len()]),
        (serde_json::Value::String(s), 0) => json!(format!("{s}{}", dict[choice / 4 % dict.len()])),
        (serde_json::Value::String(s), 1) => json!(format!("{}{s}", dict[choice / 4 % dict.len()])),
        (serde_json::Value::String(_), _) => json!(dict[choice / 4 % dict.len()]),
        (serde_json::Value::Bool(b), _) => json!(!b),
        (_, _) => json!(dict[choice % dict.len()]),
    }
}

/// A rule's tokens are those iptables-restore is given.
fn allowed_token(t: &str) -> bool {
    let t = t
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(t);
    !t.is_empty()
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:/,!=+@%-".contains(&b))
}

#[test]
fn render() {
    let msgs = messages();
    let values: Vec<serde_json::Value> = msgs
        .iter()
        .map(|m| {
            let json = dphandler_proto::text::to_json("felix.ToDataplane", m).expect("renders");
            serde_json::from_str(&json).expect("JSON")
        })
        .collect();
    // The corpus's valid messages, applied before each case.
    let baseline: Vec<Update> = msgs
        .iter()
        .filter_map(|m| {
            dphandler_proto::convert::to_update(m.clone())
                .ok()
                .flatten()
        })
        .collect();
    assert!(
        baseline.len() > 30,
        "{} valid corpus messages",
        baseline.len()
    );
    let strategy = (
        0..values.len(),
        prop::collection::vec((any::<usize>(), any::<usize>()), 1..4),
    );
    let ran = run_for("render", strategy, |(i, edits)| {
        let mut v = values[i].clone();
        for (leaf, choice) in &edits {
            let mut all = Vec::new();
            leaves(&v, &mut Vec::new(), &mut all);
            if all.is_empty() {
                break;
            }
            let path = &all[leaf % all.len()];
            if let Some(slot) = at(&mut v, path) {
                *slot = replacement(*choice, slot);
            }
        }
        let Ok(parsed) = parse_to_dataplane(&v.to_string()) else {
            return Ok(()); // the text target's business
        };
        let mut ms = managers();
        let mut updates: Vec<&Update> = baseline.iter().collect();
        let converted: Vec<Update> = parsed
            .into_iter()
            .filter_map(|m| dphandler_proto::convert::to_update(m).ok().flatten())
            .collect();
        updates.extend(converted.iter());
        let changed = converted.len();
        for (n, u) in updates.into_iter().enumerate() {
            if accepted(&ms, u) {
                if n >= baseline.len() && changed > 0 {
                    ACCEPTED.fetch_add(1, Ordering::Relaxed);
                }
                for m in &mut ms {
                    m.on_update(u);
                }
            }
        }
        let mut k = kernel();
        for m in &mut ms {
            m.resolve_update_batch();
        }
        for m in &mut ms {
            m.complete_deferred_work(&mut k).map_err(|e| {
                TestCaseError::fail(format!("accepted, but not rendered: {e}\n{v}"))
            })?;
        }
        k.apply_all()
            .map_err(|e| TestCaseError::fail(format!("accepted, but not applied: {e:?}\n{v}")))?;
        for t in &k.tables {
            let v6 = t.version() == IpVersion::V6;
            for name in t.programmed() {
                for r in t.chain(&name).into_iter().flatten() {
                    let text = r.text();
                    if let Some(bad) = text.split_whitespace().find(|w| !allowed_token(w)) {
                        return Err(TestCaseError::fail(format!(
                            "token {bad:?} in {name}: {text}\n{v}"
                        )));
                    }
                    dphandler_dataplane::backends::nftables::translate::translate(text, v6)
                        .map_err(|e| {
                            TestCaseError::fail(format!(
                                "no nftables translation of {text} in {name}: {e}\n{v}"
                            ))
                        })?;
                }
            }
        }
        Ok(())
    });
    let accepted = ACCEPTED.load(Ordering::Relaxed);
    eprintln!("render: {accepted} changed messages accepted and rendered");
    assert!(
        accepted * 10 > ran.cases,
        "only {accepted} of {} changed messages were accepted",
        ran.cases
    );
}
