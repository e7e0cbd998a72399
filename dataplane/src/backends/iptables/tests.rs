//! The table backend against a recording seam: golden restore input.

use std::sync::{Arc, Mutex};

use super::*;

#[derive(Debug, Default)]
struct Rec {
    save: String,
    inputs: Vec<String>,
    saves: usize,
    /// Chains per transaction (None: never split).
    per: Option<usize>,
    /// Offer reads that run on another thread.
    detached: bool,
    /// A restore whose input has a line holding this fails there, as
    /// iptables-restore does on a match it cannot load.
    refuse: Option<String>,
}

#[derive(Debug, Clone, Default)]
struct Recording(Arc<Mutex<Rec>>);

impl IptablesExec for Recording {
    fn save(&mut self, table: &str) -> Result<String, BackendError> {
        let mut r = self.0.lock().unwrap();
        r.saves += 1;
        assert_eq!(table, "filter");
        Ok(r.save.clone())
    }
    fn restore(&mut self, input: &str) -> Result<(), BackendError> {
        let mut r = self.0.lock().unwrap();
        if let Some(bad) = &r.refuse
            && let Some(n) = input.lines().position(|l| l.contains(bad.as_str()))
        {
            return Err(BackendError::Command {
                backend: "iptables",
                command: "iptables-restore --noflush --wait 5".into(),
                status: "exit status: 2".into(),
                stderr: format!(
                    "iptables-restore v1.8.9 (nf_tables): Set {bad} doesn't exist.\n\nError occurred at line: {}\nTry `iptables-restore -h' for more information.",
                    n + 1
                ),
            });
        }
        r.inputs.push(input.to_string());
        Ok(())
    }
    fn chains_per_restore(&self) -> Option<usize> {
        self.0.lock().unwrap().per
    }
    fn detached_save(&self, table: &str) -> Option<DetachedSave> {
        let me = self.clone();
        let table = table.to_string();
        self.0
            .lock()
            .unwrap()
            .detached
            .then(|| Box::new(move || me.clone().save(&table)) as DetachedSave)
    }
}

fn table(save: &str, mode: InsertMode) -> (Table, Recording) {
    let rec = Recording::default();
    rec.0.lock().unwrap().save = save.to_string();
    let t = Table::new(
        "filter",
        IpVersion::V4,
        Ownership::new("dph"),
        mode,
        Box::new(rec.clone()),
    );
    (t, rec)
}

fn r(s: &str) -> Rule {
    Rule::parse(s).unwrap()
}

fn last(rec: &Recording) -> String {
    rec.0
        .lock()
        .unwrap()
        .inputs
        .last()
        .cloned()
        .unwrap_or_default()
}

fn inputs(rec: &Recording) -> usize {
    rec.0.lock().unwrap().inputs.len()
}

const EMPTY: &str =
    "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";

fn h(chain: &str, rules: &[&str]) -> Vec<RuleHash> {
    rule_hashes(chain, &rules.iter().map(|s| r(s)).collect::<Vec<_>>())
}

#[test]
fn hashes_are_chained_over_the_chain_and_earlier_rules() {
    let a = h("dph-x", &["-j ACCEPT", "-j DROP"]);
    assert_eq!(a.len(), 2);
    assert!(a.iter().all(|x| x.as_str().len() == 16));
    // The first 16 characters of base64url(sha224(chain, rule, ...)), as
    // computed independently (Python's hashlib and base64).
    assert_eq!(a[0].as_str(), "JQ4PRWrgqaodmCl7");
    assert_eq!(a[1].as_str(), "EiYc9bw98__CPnrm");
    assert_eq!(a, h("dph-x", &["-j ACCEPT", "-j DROP"]), "deterministic");
    assert_ne!(a[0], h("dph-y", &["-j ACCEPT"])[0], "depends on the chain");
    assert_ne!(
        a[1],
        h("dph-x", &["-j RETURN", "-j DROP"])[1],
        "depends on earlier rules"
    );
}

#[test]
fn a_rules_target_is_the_token_after_its_jump() {
    assert_eq!(
        r("-m set --match-set s src -j dph-x").target(),
        Some("dph-x")
    );
    assert_eq!(r("-i cali1 -g dph-tw-cali1").target(), Some("dph-tw-cali1"));
    assert_eq!(r("--jump ACCEPT").target(), Some("ACCEPT"));
    assert_eq!(r("-j MARK --set-xmark 0x1/0x1").target(), Some("MARK"));
    assert_eq!(r("-s 10.0.0.1/32").target(), None);
    assert_eq!(r("-p tcp -j").target(), None);
}

#[test]
fn tokens_that_could_inject_are_refused() {
    for bad in [
        "x\n-A INPUT -j ACCEPT",
        "a b",
        "\"quoted\"",
        "it's",
        "#comment",
        "back\\slash",
        "",
        "tab\there",
    ] {
        assert!(Rule::new([bad]).is_err(), "{bad:?}");
    }
    assert!(Rule::parse("-m set --match-set dph40s:a src -j ACCEPT").is_ok());
    assert!(Rule::parse("-j ACCEPT\n-A INPUT -j ACCEPT").is_err());
    let (mut t, _) = table(EMPTY, InsertMode::Insert);
    assert!(t.set_chain("dph-x\n-A INPUT", vec![]).is_err());
    assert!(t.set_chain("KUBE-X", vec![]).is_err(), "not our prefix");
    assert!(
        t.set_chain("dph-this-name-is-much-too-long-for-it", vec![])
            .is_err()
    );
    assert!(
        t.set_hooks("dph-x", vec![]).is_err(),
        "hooks go in built-in chains"
    );
}

#[test]
fn fresh_table_gets_referenced_chains_hooks_on_top_and_nothing_else() {
    let (mut t, rec) = table(
        "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -s 10.9.9.9/32 -j ACCEPT\nCOMMIT\n",
        InsertMode::Insert,
    );
    t.set_chain("dph-INPUT", vec![r("-j dph-wl"), r("-j ACCEPT")])
        .unwrap();
    t.set_chain("dph-wl", vec![r("-p tcp --dport 80 -j DROP")])
        .unwrap();
    t.set_chain("dph-orphan", vec![r("-j DROP")]).unwrap();
    t.set_hooks("INPUT", vec![r("-j dph-INPUT")]).unwrap();
    assert!(t.is_dirty(Phase::Tables));
    t.apply(Phase::Tables).unwrap();
    let hi = h("dph-INPUT", &["-j dph-wl", "-j ACCEPT"]);
    let hw = h("dph-wl", &["-p tcp --dport 80 -j DROP"]);
    let hh = h("INPUT", &["-j dph-INPUT"]);
    assert_eq!(
        last(&rec),
        format!(
            "*filter\n\
             :dph-INPUT - [0:0]\n\
             :dph-wl - [0:0]\n\
             -A dph-INPUT -m comment --comment \"dph:{}\" -j dph-wl\n\
             -A dph-INPUT -m comment --comment \"dph:{}\" -j ACCEPT\n\
             -A dph-wl -m comment --comment \"dph:{}\" -p tcp --dport 80 -j DROP\n\
             -I INPUT 1 -m comment --comment \"dph:{}\" -j dph-INPUT\n\
             COMMIT\n",
            hi[0], hi[1], hw[0], hh[0]
        )
    );
    // Nothing changed: nothing written, and no re-read until the check.
    assert!(!t.is_dirty(Phase::Tables));
    let o = t.observed().unwrap();
    assert_eq!(o["INPUT"].rules.len(), 2, "ours on top of the foreign rule");
    assert_eq!(o["INPUT"].rules[1].1, "-s 10.9.9.9/32 -j ACCEPT");
}

fn saved_with(chains: &[(&str, &[&str])], input_hooks: &[&str], foreign_top: bool) -> String {
    let mut s = String::from("*filter\n:INPUT ACCEPT [0:0]\n");
    for (c, _) in chains {
        s.push_str(&format!(":{c} - [0:0]\n"));
    }
    if foreign_top {
        s.push_str("-A INPUT -s 10.9.9.9/32 -j ACCEPT\n");
    }
    let hh = h("INPUT", input_hooks);
    for (rule, hash) in input_hooks.iter().zip(&hh) {
        s.push_str(&format!(
            "-A INPUT -m comment --comment \"dph:{hash}\" {rule}\n"
        ));
    }
    for (c, rules) in chains {
        for (rule, hash) in rules.iter().zip(h(c, rules)) {
            s.push_str(&format!(
                "-A {c} -m comment --comment \"dph:{hash}\" {rule}\n"
            ));
        }
    }
    s.push_str("COMMIT\n");
    s
}

#[test]
fn existing_state_is_adopted_and_changes_are_minimal() {
    let rules: &[&str] = &[
        "-s 10.0.0.1/32 -j ACCEPT",
        "-s 10.0.0.2/32 -j ACCEPT",
        "-j DROP",
    ];
    let (mut t, rec) = table(
        &saved_with(&[("dph-x", rules)], &["-j dph-x"], false),
        InsertMode::Insert,
    );
    t.set_chain("dph-x", rules.iter().map(|s| r(s)).collect())
        .unwrap();
    t.set_hooks("INPUT", vec![r("-j dph-x")]).unwrap();
    t.apply(Phase::Tables).unwrap();
    assert_eq!(inputs(&rec), 0, "adopted: nothing to write");

    // Change the last rule only: one -R.
    let new: Vec<Rule> = vec![r(rules[0]), r(rules[1]), r("-j REJECT")];
    let hx = rule_hashes("dph-x", &new);
    t.set_chain("dph-x", new).unwrap();
    t.apply(Phase::Tables).unwrap();
    assert_eq!(
        last(&rec),
        format!(
            "*filter\n-R dph-x 3 -m comment --comment \"dph:{}\" -j REJECT\nCOMMIT\n",
            hx[2]
        )
    );

    // Shorter chain: deletions from the end.
    let two: Vec<Rule> = vec![r(rules[0]), r(rules[1])];
    t.set_chain("dph-x", two).unwrap();
    t.apply(Phase::Tables).unwrap();
    assert_eq!(last(&rec), "*filter\n-D dph-x 3\nCOMMIT\n");

    // Most of a chain changes: it is declared (which flushes it under
    // --noflush) and written whole, in the same transaction.
    let other: Vec<Rule> = vec![r("-j REJECT"), r("-j DROP")];
    let ho = rule_hashes("dph-x", &other);
    t.set_chain("dph-x", other).unwrap();
    t.apply(Phase::Tables).unwrap();
    assert_eq!(
        last(&rec),
        format!(
            "*filter\n:dph-x - [0:0]\n\
             -A dph-x -m comment --comment \"dph:{}\" -j REJECT\n\
             -A dph-x -m comment --comment \"dph:{}\" -j DROP\nCOMMIT\n",
            ho[0], ho[1]
        )
    );
}

#[test]
fn unhooked_chains_are_deleted_last_and_hooks_by_spec() {
    let (mut t, rec) = table(
        &saved_with(&[("dph-x", &["-j ACCEPT"])], &["-j dph-x"], true),
        InsertMode::Insert,
    );
    t.apply(Phase::Tables).unwrap();
    let hh = h("INPUT", &["-j dph-x"]);
    assert_eq!(
        last(&rec),
        format!(
            "*filter\n-D INPUT -m comment --comment \"dph:{}\" -j dph-x\n-F dph-x\n-X dph-x\nCOMMIT\n",
            hh[0]
        ),
        "the foreign rule is not touched"
    );
    assert_eq!(t.observed().unwrap()["INPUT"].rules.len(), 1);
}

#[test]
fn hooks_below_a_foreign_rule_are_moved_to_the_top_or_kept_at_the_bottom() {
    // Our hook sits below a foreign rule (someone inserted above us).
    let saved = saved_with(&[("dph-x", &["-j ACCEPT"])], &["-j dph-x"], true);
    let (mut t, rec) = table(&saved, InsertMode::Insert);
    t.set_chain("dph-x", vec![r("-j ACCEPT")]).unwrap();
    t.set_hooks("INPUT", vec![r("-j dph-x")]).unwrap();
    t.apply(Phase::Tables).unwrap();
    let hh = h("INPUT", &["-j dph-x"]);
    assert_eq!(
        last(&rec),
        format!(
            "*filter\n-D INPUT -m comment --comment \"dph:{0}\" -j dph-x\n\
             -I INPUT 1 -m comment --comment \"dph:{0}\" -j dph-x\nCOMMIT\n",
            hh[0]
        )
    );
    // In append mode the same state is already right.
    let (mut t, rec) = table(&saved, InsertMode::Append);
    t.set_chain("dph-x", vec![r("-j ACCEPT")]).unwrap();
    t.set_hooks("INPUT", vec![r("-j dph-x")]).unwrap();
    t.apply(Phase::Tables).unwrap();
    assert_eq!(inputs(&rec), 0);
}

#[test]
fn a_refresh_rereads_and_restores_what_was_deleted_by_hand() {
    let (t, rec) = table(EMPTY, InsertMode::Insert);
    let mut t = t.with_check_delay(Duration::from_millis(50));
    t.set_chain("dph-x", vec![r("-j ACCEPT")]).unwrap();
    t.set_hooks("INPUT", vec![r("-j dph-x")]).unwrap();
    t.apply(Phase::Tables).unwrap();
    assert_eq!(rec.0.lock().unwrap().saves, 1);
    // The read after the write, once the table has been quiet for a while
    // (this recorder reads in the apply): all as written.
    rec.0.lock().unwrap().save = saved_with(&[("dph-x", &["-j ACCEPT"])], &["-j dph-x"], false);
    std::thread::sleep(Duration::from_millis(60));
    assert!(t.is_dirty(Phase::Tables));
    t.apply(Phase::Tables).unwrap();
    assert_eq!(rec.0.lock().unwrap().saves, 2);
    assert_eq!(inputs(&rec), 1);
    assert!(!t.is_dirty(Phase::Tables));
    // By hand: the hook rule deleted.
    rec.0.lock().unwrap().save = saved_with(&[("dph-x", &["-j ACCEPT"])], &[], false);
    t.request_resync(Refresh::IpSets);
    assert!(!t.is_dirty(Phase::Tables), "not our timer");
    t.request_resync(Refresh::Iptables);
    assert!(t.is_dirty(Phase::Tables));
    t.apply(Phase::Tables).unwrap();
    let hh = h("INPUT", &["-j dph-x"]);
    assert_eq!(
        last(&rec),
        format!(
            "*filter\n-I INPUT 1 -m comment --comment \"dph:{}\" -j dph-x\nCOMMIT\n",
            hh[0]
        )
    );
}

#[test]
fn a_large_write_is_split_with_every_chain_complete_before_it_is_reached() {
    let (mut t, rec) = table(EMPTY, InsertMode::Insert);
    rec.0.lock().unwrap().per = Some(2);
    // dph-top -> dph-d -> dph-a, dph-b, dph-c (each with two rules).
    for c in ["a", "b", "c"] {
        t.set_chain(
            &format!("dph-{c}"),
            vec![r("-p tcp -j ACCEPT"), r("-j DROP")],
        )
        .unwrap();
    }
    t.set_chain(
        "dph-d",
        vec![r("-i x -g dph-a"), r("-i y -g dph-b"), r("-i z -g dph-c")],
    )
    .unwrap();
    t.set_chain("dph-top", vec![r("-j dph-d")]).unwrap();
    t.set_hooks("FORWARD", vec![r("-j dph-top")]).unwrap();
    t.apply(Phase::Tables).unwrap();
    let inputs = rec.0.lock().unwrap().inputs.clone();
    assert_eq!(inputs.len(), 3, "5 chains, 2 per transaction: {inputs:#?}");
    let mut exist: Vec<String> = Vec::new();
    for (i, input) in inputs.iter().enumerate() {
        assert!(input.starts_with("*filter\n") && input.ends_with("COMMIT\n"));
        let declared: Vec<String> = input
            .lines()
            .filter_map(|l| l.strip_prefix(':'))
            .map(|l| l.split(' ').next().unwrap().to_string())
            .collect();
        exist.extend(declared.iter().cloned());
        for l in input
            .lines()
            .filter(|l| l.starts_with("-A ") || l.starts_with("-I "))
        {
            let chain = l.split(' ').nth(1).unwrap();
            if chain != "FORWARD" {
                assert!(
                    declared.iter().any(|d| d == chain),
                    "rules go with their chain: {l}"
                );
            }
            for target in ["dph-a", "dph-b", "dph-c", "dph-d", "dph-top"] {
                if l.ends_with(&format!(" {target}")) {
                    assert!(
                        exist.iter().any(|e| e == target),
                        "{target} exists before {l}"
                    );
                }
            }
        }
        assert_eq!(
            input.contains("-I FORWARD 1"),
            i == inputs.len() - 1,
            "the hook comes last, once everything is in place"
        );
    }
    assert_eq!(exist.len(), 5);
    // Small changes stay one atomic transaction.
    t.set_chain("dph-a", vec![r("-j DROP")]).unwrap();
    t.set_chain("dph-b", vec![r("-j DROP")]).unwrap();
    t.apply(Phase::Tables).unwrap();
    assert_eq!(inputs_after(&rec, 3), 1);
}

fn inputs_after(rec: &Recording, n: usize) -> usize {
    rec.0.lock().unwrap().inputs.len() - n
}

/// Waits for the table's background read to finish (is_dirty turns true).
fn wait_read(t: &Table) {
    for _ in 0..500 {
        if t.is_dirty(Phase::Tables) {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    panic!("the background read never finished");
}

#[test]
fn check_reads_run_in_the_background_and_stale_ones_are_dropped() {
    let (t, rec) = table(EMPTY, InsertMode::Insert);
    let mut t = t.with_check_delay(Duration::ZERO);
    rec.0.lock().unwrap().detached = true;
    t.set_chain("dph-a", vec![r("-j DROP")]).unwrap();
    t.set_hooks("INPUT", vec![r("-j dph-a")]).unwrap();
    t.apply(Phase::Tables).unwrap();
    assert_eq!(
        rec.0.lock().unwrap().saves,
        1,
        "the first read is in the apply"
    );
    let written = last(&rec);
    let hook = h("INPUT", &["-j dph-a"])[0];
    let hash = h("dph-a", &["-j DROP"])[0];
    // Someone deletes our rule in dph-a.
    let tampered = format!(
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:dph-a - [0:0]\n\
         -A INPUT -m comment --comment \"dph:{hook}\" -j dph-a\nCOMMIT\n"
    );
    rec.0.lock().unwrap().save = tampered;
    t.request_resync(Refresh::Iptables);
    let out = t.apply(Phase::Tables).unwrap();
    assert_eq!(
        out.reschedule_after,
        Some(CHECK_POLL),
        "the read is in flight"
    );
    assert_eq!(inputs(&rec), 1, "nothing written while it runs");
    wait_read(&t);
    t.apply(Phase::Tables).unwrap();
    assert_eq!(rec.0.lock().unwrap().saves, 2);
    assert_eq!(inputs(&rec), 2, "the deleted rule is put back");
    assert!(last(&rec).contains(&format!(
        "-A dph-a -m comment --comment \"dph:{hash}\" -j DROP"
    )));

    // A read that a write overtakes is dropped, not diffed against.
    rec.0.lock().unwrap().save = EMPTY.to_string();
    t.request_resync(Refresh::Iptables);
    t.apply(Phase::Tables).unwrap();
    t.set_chain("dph-a", vec![r("-j ACCEPT")]).unwrap();
    t.apply(Phase::Tables).unwrap(); // the write
    let writes = inputs(&rec);
    wait_read(&t);
    t.apply(Phase::Tables).unwrap();
    assert_eq!(
        inputs(&rec),
        writes,
        "the stale read (an empty table) was not acted on"
    );
    assert!(!written.is_empty());
}

#[test]
fn the_first_read_can_start_before_the_first_apply() {
    let (mut t, rec) = table(
        &saved_with(&[("dph-a", &["-j DROP"])], &["-j dph-a"], false),
        InsertMode::Insert,
    );
    rec.0.lock().unwrap().detached = true;
    t.prefetch();
    t.prefetch(); // once only
    t.set_chain("dph-a", vec![r("-j DROP")]).unwrap();
    t.set_hooks("INPUT", vec![r("-j dph-a")]).unwrap();
    // Whether or not the read has finished, the apply uses it.
    t.apply(Phase::Tables).unwrap();
    assert_eq!(
        rec.0.lock().unwrap().saves,
        1,
        "read once, before the apply"
    );
    assert_eq!(
        inputs(&rec),
        0,
        "what was there is adopted: nothing written"
    );
    // Once the table has been read or written, prefetch does nothing.
    t.prefetch();
    assert_eq!(rec.0.lock().unwrap().saves, 1);
}

#[test]
fn a_check_read_that_finds_what_we_wrote_changes_nothing_and_a_lost_hook_is_put_back() {
    let (t, rec) = table(EMPTY, InsertMode::Insert);
    let mut t = t.with_check_delay(Duration::ZERO);
    rec.0.lock().unwrap().detached = true;
    t.set_chain("dph-a", vec![r("-p tcp --dport 80 -j DROP")])
        .unwrap();
    t.set_hooks("INPUT", vec![r("-j dph-a")]).unwrap();
    t.apply(Phase::Tables).unwrap();
    assert_eq!(inputs(&rec), 1);
    let hook = h("INPUT", &["-j dph-a"])[0];
    let rule = h("dph-a", &["-p tcp --dport 80 -j DROP"])[0];
    // What iptables-save prints: our rules in its own spelling (`-m tcp`),
    // and a foreign rule someone added below ours.
    let as_saved = format!(
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:dph-a - [0:0]\n\
         -A INPUT -m comment --comment \"dph:{hook}\" -j dph-a\n\
         -A INPUT -s 10.9.9.9/32 -j ACCEPT\n\
         -A dph-a -p tcp -m tcp --dport 80 -m comment --comment \"dph:{rule}\" -j DROP\nCOMMIT\n"
    );
    rec.0.lock().unwrap().save = as_saved;
    t.request_resync(Refresh::Iptables);
    t.apply(Phase::Tables).unwrap(); // starts the read
    wait_read(&t);
    t.apply(Phase::Tables).unwrap(); // takes it
    assert_eq!(inputs(&rec), 1, "nothing of ours differs: nothing written");
    assert!(!t.is_dirty(Phase::Tables));
    assert_eq!(
        t.observed().unwrap()["INPUT"].rules[1].1,
        "-s 10.9.9.9/32 -j ACCEPT",
        "the foreign rule is known now"
    );

    // Someone deletes our hook: the next check puts it back on top, and
    // leaves the foreign rule alone.
    rec.0.lock().unwrap().save = format!(
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:dph-a - [0:0]\n\
         -A INPUT -s 10.9.9.9/32 -j ACCEPT\n\
         -A dph-a -p tcp -m tcp --dport 80 -m comment --comment \"dph:{rule}\" -j DROP\nCOMMIT\n"
    );
    t.request_resync(Refresh::Iptables);
    t.apply(Phase::Tables).unwrap();
    wait_read(&t);
    t.apply(Phase::Tables).unwrap();
    assert_eq!(inputs(&rec), 2);
    assert_eq!(
        last(&rec),
        format!("*filter\n-I INPUT 1 -m comment --comment \"dph:{hook}\" -j dph-a\nCOMMIT\n")
    );
}

#[test]
fn no_check_read_starts_while_the_table_keeps_being_written() {
    let (t, rec) = table(EMPTY, InsertMode::Insert);
    let mut t = t.with_check_delay(Duration::from_millis(300));
    rec.0.lock().unwrap().detached = true;
    t.set_hooks("INPUT", vec![r("-j dph-a")]).unwrap();
    for i in 0..3 {
        t.set_chain("dph-a", vec![r(&format!("-s 10.0.0.{i}/32 -j DROP"))])
            .unwrap();
        t.apply(Phase::Tables).unwrap();
        // The refresh tick comes in the middle of the writes.
        t.request_resync(Refresh::Iptables);
        t.apply(Phase::Tables).unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        rec.0.lock().unwrap().saves,
        1,
        "only the first read: no check-read beside the writes"
    );
    // Once the table has been quiet for the delay, the tick's read runs.
    std::thread::sleep(Duration::from_millis(320));
    assert!(t.is_dirty(Phase::Tables));
    t.apply(Phase::Tables).unwrap();
    wait_read(&t);
    assert_eq!(rec.0.lock().unwrap().saves, 2);
}

/// A chain whose rules the tool refuses (the line it names) is held
/// fail-closed and the rest of the table written in the same apply; it is
/// reported until its rules change. A refused line in a chain that cannot
/// be held alone (a top-level one) fails the apply as before.
#[test]
fn a_chain_the_kernel_refuses_is_held_fail_closed_and_the_rest_written() {
    let (mut t, rec) = table(EMPTY, InsertMode::Insert);
    rec.0.lock().unwrap().refuse = Some("nope".into());
    t.set_chain("dph-pi-bad", vec![r("-m set --match-set nope src -j DROP")])
        .unwrap();
    t.set_chain("dph-pi-good", vec![r("-p tcp -j ACCEPT")])
        .unwrap();
    t.set_hooks("INPUT", vec![r("-j dph-pi-good"), r("-j dph-pi-bad")])
        .unwrap();
    t.apply(Phase::Tables).unwrap();
    let input = last(&rec);
    assert!(!input.contains("nope"), "{input}");
    assert!(
        input
            .lines()
            .any(|l| l.starts_with("-A dph-pi-bad") && l.ends_with("-j DROP")),
        "{input}"
    );
    assert!(input.contains("-A dph-pi-good"), "{input}");
    let st = t.status();
    assert_eq!(st.len(), 1, "{st:?}");
    assert_eq!(st[0].0, "isolated.iptables-filter.dph-pi-bad");
    assert!(
        st[0].1.contains("doesn't exist") && st[0].1.contains("fail-closed"),
        "{st:?}"
    );
    // What the managers set is what they see.
    assert_eq!(
        t.chain("dph-pi-bad").unwrap()[0].text(),
        "-m set --match-set nope src -j DROP"
    );

    // The same rules again: nothing to write, still held.
    let n = inputs(&rec);
    rec.0.lock().unwrap().save = input.clone();
    t.set_chain("dph-pi-bad", vec![r("-m set --match-set nope src -j DROP")])
        .unwrap();
    assert!(!t.is_dirty(Phase::Tables) || t.apply(Phase::Tables).is_ok());
    assert_eq!(inputs(&rec), n, "nothing written");
    assert_eq!(t.status().len(), 1);

    // Rules that change lift it.
    t.set_chain("dph-pi-bad", vec![r("-p udp -j DROP")])
        .unwrap();
    t.apply(Phase::Tables).unwrap();
    assert!(last(&rec).contains("-p udp"), "{}", last(&rec));
    assert!(t.status().is_empty());

    // A top-level chain's line: not held, the apply fails.
    t.set_chain("dph-INPUT", vec![r("-m set --match-set nope src -j DROP")])
        .unwrap();
    t.set_hooks("INPUT", vec![r("-j dph-INPUT")]).unwrap();
    assert!(t.apply(Phase::Tables).is_err());
    assert!(t.status().is_empty());
}
