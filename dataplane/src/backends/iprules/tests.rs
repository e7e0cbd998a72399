//! The rules backend against a fake kernel.

use std::sync::{Arc, Mutex};

use super::*;

#[derive(Debug, Default)]
struct State {
    rules: BTreeSet<IpRule>,
    writes: Vec<String>,
    reads: usize,
}

#[derive(Debug, Clone, Default)]
struct Fake(Arc<Mutex<State>>);

impl IpRuleSeam for Fake {
    fn rules(&mut self) -> Result<Vec<IpRule>, BackendError> {
        let mut s = self.0.lock().unwrap();
        s.reads += 1;
        Ok(s.rules.iter().copied().collect())
    }
    fn add(&mut self, rule: &IpRule) -> Result<(), BackendError> {
        let mut s = self.0.lock().unwrap();
        s.writes
            .push(format!("add {} -> {}", rule.priority, rule.table));
        s.rules.insert(*rule);
        Ok(())
    }
    fn delete(&mut self, rule: &IpRule) -> Result<(), BackendError> {
        let mut s = self.0.lock().unwrap();
        s.writes
            .push(format!("del {} -> {}", rule.priority, rule.table));
        s.rules.remove(rule);
        Ok(())
    }
}

fn rule(priority: u32, table: u32) -> IpRule {
    IpRule {
        v6: false,
        priority,
        fwmark: Some((0x20_0000, 0x20_0000)),
        invert: true,
        src: None,
        table,
    }
}

#[test]
fn kernel_tables_cannot_be_owned() {
    for t in [0, 253, 254, 255] {
        assert_eq!(
            IpRules::new([1, t], Box::new(Fake::default())).unwrap_err(),
            KernelTable(t)
        );
    }
}

#[test]
fn only_rules_of_our_tables_are_touched_and_only_the_differences() {
    let k = Fake::default();
    {
        let mut s = k.0.lock().unwrap();
        // The kernel's own, another agent's (table 100), a stale one of
        // ours (table 1, priority 98) and one that is right (table 2).
        for r in [
            rule(0, 255),
            rule(32766, 254),
            rule(50, 100),
            rule(98, 1),
            rule(99, 2),
        ] {
            s.rules.insert(r);
        }
    }
    let mut b = IpRules::new([1, 2], Box::new(k.clone())).unwrap();
    b.set([rule(99, 1), rule(99, 2), rule(10, 100)].into());
    assert_eq!(b.desired(), &BTreeSet::from([rule(99, 1), rule(99, 2)]));
    assert!(b.is_dirty(Phase::RoutesAndRules));
    b.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(
        std::mem::take(&mut k.0.lock().unwrap().writes),
        ["add 99 -> 1", "del 98 -> 1"],
        "added before the old one goes"
    );
    assert!(!b.is_dirty(Phase::RoutesAndRules));
    let s = k.0.lock().unwrap();
    for foreign in [rule(0, 255), rule(32766, 254), rule(50, 100)] {
        assert!(s.rules.contains(&foreign), "{foreign:?} touched");
    }
    drop(s);
    // Someone deletes ours: the refresh puts it back.
    k.0.lock().unwrap().rules.remove(&rule(99, 2));
    b.request_resync(Refresh::Routes);
    b.apply(Phase::RoutesAndRules).unwrap();
    assert_eq!(k.0.lock().unwrap().writes, ["add 99 -> 2"]);
    assert_eq!(k.0.lock().unwrap().reads, 2);
}
