//! The fuzz targets, each for `DPH_FUZZ_SECONDS` (CI: 60): what reads
//! untrusted input must not panic, and what it accepts must render into
//! rules the kernel tools take.
//!
//! - `proto`: bytes → the limits on them → `felix.ToDataplane` → the
//!   model (the gRPC path).
//! - `text`: what `dphctl push` reads (JSON, NDJSON, YAML) → messages.
//! - `render`: messages changed field by field; those the edge and the
//!   managers accept are rendered by the managers into iptables tables:
//!   that must succeed, every rule must be made of the tokens
//!   iptables-restore is given (`[A-Za-z0-9._:/,!=+@%~-]`), and every rule
//!   must translate to nftables.
//! - `save`: `iptables-save` and `ipset save` output → our parsers.
//! - `sequence`: sequences of messages (the corpus's, changed field by
//!   field, and ConfigUpdates of every key this daemon reads with values
//!   at and past their bounds) through the edge (the limits on the bytes,
//!   the decoding, the conversion), the managers' checks, every manager,
//!   and every backend of a node over recording seams, with the iptables
//!   or the nftables dataplane: each message is refused at the edge or
//!   programs — every apply succeeds, nothing is isolated, every restore
//!   line is made of tool tokens, every nftables commit encodes.
//! - `netlink`: the nftables encoder on changed commits (refused, never
//!   wrapped, past 64 KiB) and the netlink dump decoders on any bytes.

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
    let limits = dphandler_proto::wire::WireLimits::default();
    let ran = run_for("proto", mutated(inputs.len()), |(i, muts)| {
        let bytes = apply(&inputs[i], &muts, &others);
        // As the server takes it: the limits on the bytes, then decoded.
        let checked = dphandler_proto::wire::check(&bytes, &limits);
        if checked.is_ok()
            && let Ok(msg) = felix::ToDataplane::decode(bytes.as_slice())
        {
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

/// Each message in the canonical JSON mapping (what the changes edit).
fn json_values(msgs: &[felix::ToDataplane]) -> Vec<serde_json::Value> {
    msgs.iter()
        .map(|m| {
            let json = dphandler_proto::text::to_json("felix.ToDataplane", m).expect("renders");
            serde_json::from_str(&json).expect("JSON")
        })
        .collect()
}

/// `v` with `edits` made: each (leaf, choice) replaces one leaf (picked
/// among the leaves as they are then) by [`replacement`].
fn edited(v: &serde_json::Value, edits: &[(usize, usize)]) -> serde_json::Value {
    let mut v = v.clone();
    for (leaf, choice) in edits {
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
    v
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
    !t.is_empty() && t.bytes().all(dphandler_dataplane::model::is_token_byte)
}

#[test]
fn render() {
    use dphandler_fuzz::node;
    let msgs = messages();
    let values = json_values(&msgs);
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
        let v = edited(&values[i], &edits);
        let Ok(parsed) = parse_to_dataplane(&v.to_string()) else {
            return Ok(()); // the text target's business
        };
        let mut ms = node::managers(false);
        let mut updates: Vec<&Update> = baseline.iter().collect();
        let converted: Vec<Update> = parsed
            .into_iter()
            .filter_map(|m| dphandler_proto::convert::to_update(m).ok().flatten())
            .collect();
        updates.extend(converted.iter());
        let changed = converted.len();
        for (n, u) in updates.into_iter().enumerate() {
            if node::accepted(&ms, u) {
                if n >= baseline.len() && changed > 0 {
                    ACCEPTED.fetch_add(1, Ordering::Relaxed);
                }
                for m in &mut ms {
                    m.on_update(u);
                }
            }
        }
        let faults = node::Faults::default();
        let mut k = node::kernel(false, &faults);
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

/// Values for a ConfigUpdate's keys at and past their bounds.
const CONFIG_VALUES: &[&str] = &[
    "0",
    "1",
    "-1",
    "67",
    "68",
    "79",
    "80",
    "1279",
    "1280",
    "65535",
    "65536",
    "4294967295",
    "9300000000000000000",
    "86400",
    "86401",
    "1e400",
    "NaN",
    "0.0001",
    "500ms",
    "90s",
    "5m",
    "25h",
    "true",
    "false",
    "Enabled",
    "Disabled",
    "cali",
    "tap",
    "eth0",
    "lo",
    "wg0",
    "wireguard.cali",
    "",
    "0xffff0000",
    "0x1",
    "0xffffffff",
    "tcp:22",
    "udp:65536",
    "none",
    "Drop",
    "Accept",
    "Return",
    "Debug",
    "Loud",
    "node-1",
    "32765",
    "32766",
];

/// A sequence of changed messages through a whole node: each refused at
/// the edge, or programmed.
#[test]
fn sequence() {
    use dphandler_fuzz::node;
    let msgs = messages();
    let values = json_values(&msgs);
    let limits = dphandler_proto::wire::WireLimits::default();
    let config_keys: Vec<&str> = dphandler_dataplane::model::config::known_keys().collect();
    let accepted_count = AtomicU64::new(0);
    let strategy = (
        any::<bool>(),
        prop::collection::vec(
            (
                0..values.len(),
                prop::collection::vec((any::<usize>(), any::<usize>()), 0..3),
            ),
            1..6,
        ),
        prop::collection::vec((0..config_keys.len(), 0..CONFIG_VALUES.len()), 0..4),
    );
    let ran = run_for("sequence", strategy, |(nftables, picks, config)| {
        let faults = node::Faults::default();
        let mut k = node::kernel(nftables, &faults);
        let mut ms = node::managers(nftables);
        for ev in node::interfaces() {
            for m in &mut ms {
                m.on_interface(&ev);
            }
        }
        // The case's messages: the corpus's, changed; a ConfigUpdate.
        let mut wire: Vec<Vec<u8>> = Vec::new();
        for (i, edits) in &picks {
            let v = edited(&values[*i], edits);
            if let Ok(parsed) = parse_to_dataplane(&v.to_string()) {
                wire.extend(parsed.iter().map(Message::encode_to_vec));
            }
        }
        if !config.is_empty() {
            let kv = config
                .iter()
                .map(|(k, v)| (config_keys[*k].to_string(), CONFIG_VALUES[*v].to_string()))
                .collect();
            wire.push(
                felix::ToDataplane {
                    sequence_number: 0,
                    payload: Some(felix::to_dataplane::Payload::ConfigUpdate(
                        felix::ConfigUpdate {
                            config: kv,
                            ..Default::default()
                        },
                    )),
                }
                .encode_to_vec(),
            );
        }
        // The corpus's valid messages first (a node with state), then the
        // case's, each applied as the loop would.
        let baseline = msgs.iter().map(Message::encode_to_vec);
        let total = msgs.len();
        for (n, bytes) in baseline.chain(wire).enumerate() {
            // The edge: limits on the bytes, decoding, conversion.
            if dphandler_proto::wire::check(&bytes, &limits).is_err() {
                continue;
            }
            let Ok(m) = felix::ToDataplane::decode(bytes.as_slice()) else {
                continue;
            };
            let Ok(Some(u)) = dphandler_proto::convert::to_update(m) else {
                continue;
            };
            if !node::accepted(&ms, &u) {
                continue;
            }
            if n >= total {
                accepted_count.fetch_add(1, Ordering::Relaxed);
            }
            for m in &mut ms {
                m.on_update(&u);
            }
            if n + 1 < total {
                continue; // the baseline is applied once, whole
            }
            for m in &mut ms {
                m.resolve_update_batch();
            }
            for m in &mut ms {
                m.complete_deferred_work(&mut k).map_err(|e| {
                    TestCaseError::fail(format!("accepted, but not rendered: {e}\n{u:?}"))
                })?;
            }
            k.apply_all().map_err(|e| {
                TestCaseError::fail(format!("accepted, but not applied: {e:?}\n{u:?}"))
            })?;
            let isolated: Vec<(String, String)> = ms
                .iter()
                .flat_map(|m| m.status())
                .chain(k.status())
                .filter(|(key, _)| key.starts_with(dphandler_dataplane::sync_loop::ISOLATED))
                .collect();
            if !isolated.is_empty() {
                return Err(TestCaseError::fail(format!(
                    "accepted, but isolated: {isolated:?}\n{u:?}"
                )));
            }
            let f = std::mem::take(&mut *faults.lock().unwrap());
            if !f.is_empty() {
                return Err(TestCaseError::fail(format!(
                    "the kernel would refuse: {f:?}\n{u:?}"
                )));
            }
        }
        Ok(())
    });
    let accepted = accepted_count.load(Ordering::Relaxed);
    eprintln!("sequence: {accepted} changed messages accepted and programmed");
    assert!(ran.cases > 0 && accepted > 0);
}

/// The nftables encoder on the commits a node makes, changed (names and
/// comments made long, elements repeated): an encoding or a refusal,
/// never a panic, never a wrapped length; and the dump decoders on any
/// bytes.
#[test]
fn netlink() {
    use dphandler_dataplane::backends::nftables::netlink::{decode_any, encode};
    use dphandler_dataplane::backends::nftables::ops::Op;
    use dphandler_fuzz::node;
    // The commits a node makes for the corpus (recorded by encoding them).
    let faults = node::Faults::default();
    let commits = node::Commits::default();
    let mut k = node::kernel_recording(true, &faults, &commits);
    let mut ms = node::managers(true);
    for ev in node::interfaces() {
        for m in &mut ms {
            m.on_interface(&ev);
        }
    }
    for u in messages()
        .into_iter()
        .filter_map(|m| dphandler_proto::convert::to_update(m).ok().flatten())
    {
        if node::accepted(&ms, &u) {
            for m in &mut ms {
                m.on_update(&u);
            }
        }
    }
    for m in &mut ms {
        m.resolve_update_batch();
        m.complete_deferred_work(&mut k)
            .expect("the corpus renders");
    }
    k.apply_all().expect("the corpus is programmed");
    let ops: Vec<Op> = commits.lock().unwrap().clone();
    assert!(ops.len() > 10, "{} ops", ops.len());
    let encoded = encode(&ops).expect("the corpus encodes");
    let inputs: Vec<Vec<u8>> = vec![encoded];
    let others: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    let ran = run_for(
        "netlink",
        (
            0..ops.len(),
            0usize..4,
            0usize..20_000,
            mutated(inputs.len()),
        ),
        |(i, how, n, (j, muts))| {
            let mut op = ops[i].clone();
            let long = "x".repeat(n);
            match (&mut op, how) {
                (Op::AddRule { comment, .. }, 0) => *comment = long,
                (Op::AddRule { chain, .. } | Op::AddChain { chain, .. }, 1) => *chain = long,
                (Op::AddElements { elements, .. }, 2) if !elements.is_empty() => {
                    let e = elements[0];
                    elements.extend(std::iter::repeat_n(e, n));
                }
                (Op::AddRule { exprs, .. }, 3) if !exprs.is_empty() => {
                    let e = exprs[0].clone();
                    exprs.extend(std::iter::repeat_n(e, n / 8));
                }
                _ => {}
            }
            match encode(std::slice::from_ref(&op)) {
                Ok(bytes) => {
                    // Every attribute read back within its message.
                    let _ = decode_any(&bytes);
                }
                Err(e) => prop_assert!(e.to_string().contains("netlink takes at most"), "{e}"),
            }
            let bytes = apply(&inputs[j], &muts, &others);
            let _ = decode_any(&bytes);
            Ok(())
        },
    );
    assert!(ran.cases > 0);
}
