//! The IP-set backend against a recording seam: the exact restore scripts.

use std::sync::{Arc, Mutex};

use super::*;
use crate::model::Id;

#[derive(Debug, Default)]
struct Rec {
    save: String,
    scripts: Vec<String>,
    saves: usize,
    fail_next: bool,
    /// Offer reads that run on another thread (taking this long).
    detached: bool,
    detached_delay: std::time::Duration,
}

#[derive(Debug, Clone, Default)]
struct Recording(Arc<Mutex<Rec>>);

impl IpSetExec for Recording {
    fn save(&mut self) -> Result<String, BackendError> {
        let mut r = self.0.lock().unwrap();
        r.saves += 1;
        Ok(r.save.clone())
    }
    fn restore(&mut self, script: &str) -> Result<(), BackendError> {
        let mut r = self.0.lock().unwrap();
        r.scripts.push(script.to_string());
        if std::mem::take(&mut r.fail_next) {
            return Err(BackendError::Command {
                backend: "ipsets",
                command: "ipset restore -exist".into(),
                status: "exit status: 1".into(),
                stderr: "scripted".into(),
            });
        }
        Ok(())
    }
    fn detached_save(&self) -> Option<DetachedSave> {
        let mut me = self.clone();
        let r = self.0.lock().unwrap();
        let delay = r.detached_delay;
        r.detached.then(|| {
            Box::new(move || {
                std::thread::sleep(delay);
                me.save()
            }) as DetachedSave
        })
    }
}

fn sets(save: &str) -> (IpSets, Recording) {
    let rec = Recording::default();
    rec.0.lock().unwrap().save = save.to_string();
    let b = IpSets::new(
        IpVersion::V4,
        SetNames::new("dph").unwrap(),
        Box::new(rec.clone()),
    );
    (b, rec)
}

fn m(ty: IpSetType, s: &str) -> Member {
    Member::parse(ty, s).unwrap()
}

fn members(ty: IpSetType, list: &[&str]) -> HashSet<Member> {
    list.iter().map(|s| m(ty, s)).collect()
}

/// The set most tests want: dph40a holding 10.0.0.1 and 10.0.0.2.
fn want_a(b: &mut IpSets) {
    b.replace(
        "dph40a".into(),
        IP,
        members(IpSetType::Ip, &["10.0.0.1", "10.0.0.2"]),
    );
}

const IP: Meta = Meta {
    set_type: IpSetType::Ip,
    maxelem: 1000,
};

fn sorted(script: &str) -> Vec<&str> {
    let mut v: Vec<&str> = script.lines().collect();
    v.sort();
    v
}

fn last_script(rec: &Recording) -> String {
    rec.0
        .lock()
        .unwrap()
        .scripts
        .last()
        .cloned()
        .unwrap_or_default()
}

fn apply_all(b: &mut IpSets) {
    for p in [Phase::IpSetUpdates, Phase::IpSetDeletions] {
        if b.is_dirty(p) {
            b.apply(p).unwrap();
        }
    }
}

#[test]
fn fresh_sets_are_created_sized_and_filled_in_one_restore() {
    let (mut b, rec) = sets("");
    assert!(b.needs_full());
    b.start_full();
    want_a(&mut b);
    let big: HashSet<Member> = (0..3000u32)
        .map(|i| Member::Ip(std::net::Ipv4Addr::from(0x0a01_0000 + i).into()))
        .collect();
    b.replace("dph40b".into(), IP, big);
    apply_all(&mut b);
    let r = rec.0.lock().unwrap();
    assert_eq!(r.scripts.len(), 1, "one restore for everything");
    let s = &r.scripts[0];
    assert!(
        s.starts_with("create dph40a hash:ip family inet hashsize 1024 maxelem 1000\n"),
        "{s}"
    );
    assert!(s.contains("create dph40b hash:ip family inet hashsize 4096 maxelem 1000\n"));
    assert_eq!(
        s.lines().filter(|l| l.starts_with("add dph40b ")).count(),
        3000
    );
    assert!(s.contains("add dph40a 10.0.0.1\n") && s.contains("add dph40a 10.0.0.2\n"));
    drop(r);
    assert!(!b.is_dirty(Phase::IpSetUpdates) && !b.is_dirty(Phase::IpSetDeletions));
}

#[test]
fn deltas_and_replacements_write_only_the_difference() {
    let (mut b, rec) = sets(
        "create dph40a hash:ip family inet hashsize 1024 maxelem 1000 bucketsize 12 initval 0x1\n\
         add dph40a 10.0.0.1\nadd dph40a 10.0.0.2\n",
    );
    b.start_full();
    // Adopting what the kernel has: nothing to write at all.
    want_a(&mut b);
    apply_all(&mut b);
    assert!(rec.0.lock().unwrap().scripts.is_empty(), "adopted as it is");

    b.delta(
        "dph40a",
        [m(IpSetType::Ip, "10.0.0.3"), m(IpSetType::Ip, "10.0.0.1")],
        [m(IpSetType::Ip, "10.0.0.2"), m(IpSetType::Ip, "10.9.9.9")],
    );
    apply_all(&mut b);
    assert_eq!(
        sorted(&last_script(&rec)),
        ["add dph40a 10.0.0.3", "del dph40a 10.0.0.2"],
        "only real changes: 10.0.0.1 is there already, 10.9.9.9 never was"
    );

    b.replace(
        "dph40a".into(),
        IP,
        members(IpSetType::Ip, &["10.0.0.3", "10.0.0.4"]),
    );
    apply_all(&mut b);
    assert_eq!(
        sorted(&last_script(&rec)),
        ["add dph40a 10.0.0.4", "del dph40a 10.0.0.1"]
    );
    assert_eq!(
        rec.0.lock().unwrap().saves,
        1,
        "no re-read after our own writes"
    );
}

#[test]
fn a_size_change_goes_through_a_temporary_set_and_swap() {
    let (mut b, rec) =
        sets("create dph40a hash:ip family inet hashsize 1024 maxelem 1000\nadd dph40a 10.0.0.1\n");
    b.start_full();
    let bigger = Meta {
        maxelem: 5000,
        ..IP
    };
    b.replace(
        "dph40a".into(),
        bigger,
        members(IpSetType::Ip, &["10.0.0.1", "10.0.0.5"]),
    );
    apply_all(&mut b);
    let s = last_script(&rec);
    let lines: Vec<&str> = s.lines().collect();
    assert_eq!(lines[0], "destroy dph4t1");
    assert_eq!(
        lines[1],
        "create dph4t1 hash:ip family inet hashsize 1024 maxelem 5000"
    );
    assert_eq!(
        sorted(&lines[2..4].join("\n")),
        ["add dph4t1 10.0.0.1", "add dph4t1 10.0.0.5"]
    );
    assert_eq!(&lines[4..], ["swap dph4t1 dph40a", "destroy dph4t1"]);
}

#[test]
fn a_type_change_recreates_the_set() {
    let (mut b, rec) =
        sets("create dph40a hash:ip family inet hashsize 1024 maxelem 1000\nadd dph40a 10.0.0.1\n");
    b.start_full();
    let net = Meta {
        set_type: IpSetType::Net,
        maxelem: 1000,
    };
    b.replace(
        "dph40a".into(),
        net,
        members(IpSetType::Net, &["10.0.0.0/8", "10.0.0.1"]),
    );
    apply_all(&mut b);
    let s = last_script(&rec);
    let lines: Vec<&str> = s.lines().collect();
    assert_eq!(lines[0], "destroy dph40a");
    assert_eq!(
        lines[1],
        "create dph40a hash:net family inet hashsize 1024 maxelem 1000"
    );
    assert_eq!(
        sorted(&lines[2..].join("\n")),
        ["add dph40a 10.0.0.0/8", "add dph40a 10.0.0.1"],
        "a hash:net host entry is written as ipset save prints it"
    );
}

#[test]
fn deletions_wait_for_their_phase_and_spare_foreign_sets() {
    let (mut b, rec) = sets(
        "create dph40old hash:ip family inet hashsize 1024 maxelem 1000\n\
         create dph4t7 hash:ip family inet hashsize 1024 maxelem 1000\n\
         create dph60v6 hash:ip family inet6 hashsize 1024 maxelem 1000\n\
         create mine hash:ip family inet hashsize 1024 maxelem 1000\n\
         create dph-other hash:ip family inet hashsize 1024 maxelem 1000\n",
    );
    b.start_full();
    b.replace("dph40new".into(), IP, HashSet::new());
    b.apply(Phase::IpSetUpdates).unwrap();
    assert_eq!(
        last_script(&rec),
        "create dph40new hash:ip family inet hashsize 1024 maxelem 1000\n",
        "the updates phase destroys nothing"
    );
    assert!(b.is_dirty(Phase::IpSetDeletions));
    b.apply(Phase::IpSetDeletions).unwrap();
    assert_eq!(
        sorted(&last_script(&rec)),
        ["destroy dph40old", "destroy dph4t7"],
        "only our v4 sets: not the v6 one (the other object's), nor foreign ones"
    );
    assert!(!b.is_dirty(Phase::IpSetDeletions));

    b.remove("dph40new");
    assert!(!b.is_dirty(Phase::IpSetUpdates));
    b.apply(Phase::IpSetDeletions).unwrap();
    assert_eq!(last_script(&rec), "destroy dph40new\n");
}

#[test]
fn a_failed_write_rereads_and_asks_for_everything_again() {
    let (mut b, rec) = sets("");
    b.start_full();
    b.replace("dph40a".into(), IP, members(IpSetType::Ip, &["10.0.0.1"]));
    rec.0.lock().unwrap().fail_next = true;
    assert!(b.apply(Phase::IpSetUpdates).is_err());
    assert!(b.needs_full() && b.observed().is_none());
    // The manager sends the desired state again; the kernel is re-read.
    rec.0.lock().unwrap().save =
        "create dph40a hash:ip family inet hashsize 1024 maxelem 1000\n".into();
    b.start_full();
    b.replace("dph40a".into(), IP, members(IpSetType::Ip, &["10.0.0.1"]));
    b.apply(Phase::IpSetUpdates).unwrap();
    assert_eq!(last_script(&rec), "add dph40a 10.0.0.1\n");
    assert_eq!(rec.0.lock().unwrap().saves, 2);
}

#[test]
fn a_refresh_rereads_and_repairs() {
    let (mut b, rec) = sets("");
    b.start_full();
    want_a(&mut b);
    apply_all(&mut b);
    // Someone deleted a member by hand.
    rec.0.lock().unwrap().save =
        "create dph40a hash:ip family inet hashsize 1024 maxelem 1000\nadd dph40a 10.0.0.1\n"
            .into();
    b.request_resync(Refresh::Routes);
    assert!(!b.needs_full(), "other refresh timers are not ours");
    b.request_resync(Refresh::IpSets);
    assert!(b.needs_full() && b.is_dirty(Phase::IpSetUpdates));
    b.start_full();
    want_a(&mut b);
    apply_all(&mut b);
    assert_eq!(last_script(&rec), "add dph40a 10.0.0.2\n");
    let _ = Id::new("unused").unwrap();
}

#[test]
fn the_first_read_can_start_before_the_first_apply() {
    let (mut b, rec) =
        sets("create dph40a hash:ip family inet hashsize 1024 maxelem 1000\nadd dph40a 10.0.0.1\n");
    rec.0.lock().unwrap().detached = true;
    b.prefetch();
    b.prefetch(); // once only
    b.start_full();
    want_a(&mut b);
    apply_all(&mut b);
    assert_eq!(
        rec.0.lock().unwrap().saves,
        1,
        "read once, before the apply"
    );
    assert_eq!(
        last_script(&rec),
        "add dph40a 10.0.0.2\n",
        "diffed against what the early read saw"
    );
}

/// Waits for the backend's refresh read to finish.
fn wait_check(b: &IpSets) {
    for _ in 0..500 {
        if b.is_dirty(Phase::IpSetUpdates) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    panic!("the refresh read never finished");
}

#[test]
fn a_refresh_read_runs_beside_the_applies_and_repairs_without_the_manager() {
    let (mut b, rec) = sets("");
    rec.0.lock().unwrap().detached = true;
    b.start_full();
    want_a(&mut b);
    b.replace("dph40b".into(), IP, members(IpSetType::Ip, &["10.0.1.1"]));
    apply_all(&mut b);
    assert_eq!(rec.0.lock().unwrap().scripts.len(), 1);
    // By hand: a member of a deleted, b destroyed, a foreign-looking set of
    // our prefix created.
    rec.0.lock().unwrap().save = "create dph40a hash:ip family inet hashsize 1024 maxelem 1000\n\
         add dph40a 10.0.0.1\n\
         create dph40z hash:ip family inet hashsize 1024 maxelem 1000\n"
        .into();
    b.request_resync(Refresh::IpSets);
    assert!(!b.needs_full(), "the manager is not asked for everything");
    wait_check(&b);
    apply_all(&mut b);
    let r = rec.0.lock().unwrap();
    assert_eq!(r.saves, 2);
    assert_eq!(
        sorted(&r.scripts[1]),
        vec![
            "add dph40a 10.0.0.2",
            "add dph40b 10.0.1.1",
            "create dph40b hash:ip family inet hashsize 1024 maxelem 1000",
        ]
    );
    assert_eq!(r.scripts[2], "destroy dph40z\n", "not desired: destroyed");
}

#[test]
fn a_refresh_read_overtaken_by_a_write_repairs_nothing_that_is_right() {
    let (mut b, rec) = sets("");
    rec.0.lock().unwrap().detached = true;
    b.start_full();
    b.replace("dph40a".into(), IP, members(IpSetType::Ip, &["10.0.0.1"]));
    apply_all(&mut b);
    // The read sees the set as it was before the delta below is written
    // (the read takes 100 ms; the write comes at once).
    rec.0.lock().unwrap().save =
        "create dph40a hash:ip family inet hashsize 1024 maxelem 1000\nadd dph40a 10.0.0.1\n"
            .into();
    rec.0.lock().unwrap().detached_delay = std::time::Duration::from_millis(100);
    b.request_resync(Refresh::IpSets);
    b.delta("dph40a", [m(IpSetType::Ip, "10.0.0.2")], []);
    b.apply(Phase::IpSetUpdates).unwrap();
    assert_eq!(
        rec.0.lock().unwrap().scripts.len(),
        2,
        "the delta is written"
    );
    wait_check(&b);
    apply_all(&mut b);
    let r = rec.0.lock().unwrap();
    assert_eq!(r.saves, 2);
    assert_eq!(
        r.scripts.len(),
        2,
        "nothing written but the delta: {:?}",
        r.scripts
    );
    assert_eq!(r.scripts[1], "add dph40a 10.0.0.2\n");
}
