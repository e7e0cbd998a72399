//! Outgoing NAT for IPAM pools with `masquerade` (Felix's nat-outgoing):
//! traffic from a masquerading pool to anywhere outside all pools leaves
//! with the node's address. In the nat table of every IP version:
//! POSTROUTING → `<prefix>-POSTROUTING` → `<prefix>-nat-outgoing`:
//! `-m set --match-set <prefix>40masq-ipam-pools src -m set !
//! --match-set <prefix>40all-ipam-pools dst -j MASQUERADE`. The two sets
//! are kept by the IP-set manager. With no masquerading pool of a version
//! the hook and chains are removed. No I/O here.

use std::collections::BTreeMap;

use ipnet::IpNet;

use super::{Manager, ManagerError};
use crate::backends::DesiredKernel;
use crate::generictables::{Rule, RuleError};
use crate::managers::ipsets::{ALL_POOLS, MASQ_POOLS};
use crate::model::ipsets::SetNames;
use crate::model::{Id, IpVersion, Key, Update};

#[derive(Debug)]
pub struct NatManager {
    prefix: String,
    sets: SetNames,
    pools: BTreeMap<Id, (IpNet, bool)>,
    dirty: bool,
}

fn bad(e: RuleError) -> ManagerError {
    ManagerError::Inconsistent {
        manager: "nat",
        reason: e.to_string(),
    }
}

impl NatManager {
    pub fn new(prefix: &str, sets: SetNames) -> Self {
        Self {
            prefix: prefix.to_string(),
            sets,
            pools: BTreeMap::new(),
            dirty: true,
        }
    }
}

impl Manager for NatManager {
    fn name(&self) -> &'static str {
        "nat"
    }

    fn on_update(&mut self, update: &Update) {
        match update {
            Update::IpamPool(id, p) => {
                self.pools.insert(id.clone(), (p.cidr, p.masquerade));
            }
            Update::Remove(Key::IpamPool(id)) => {
                self.pools.remove(id);
            }
            _ => return,
        }
        self.dirty = true;
    }

    fn complete_deferred_work(&mut self, kernel: &mut DesiredKernel) -> Result<(), ManagerError> {
        if !self.dirty {
            return Ok(());
        }
        let post = format!("{}-POSTROUTING", self.prefix);
        let outgoing = format!("{}-nat-outgoing", self.prefix);
        for t in kernel.rule_tables_mut().filter(|t| t.table() == "nat") {
            let v = t.version();
            let masq = self
                .pools
                .values()
                .any(|(cidr, m)| *m && IpVersion::of(&cidr.addr()) == v);
            if !masq {
                t.set_hooks("POSTROUTING", Vec::new()).map_err(bad)?;
                t.remove_chain(&post);
                t.remove_chain(&outgoing);
                continue;
            }
            let all = self.sets.name(v, &Id::new(ALL_POOLS).expect("valid"));
            let masq_set = self.sets.name(v, &Id::new(MASQ_POOLS).expect("valid"));
            let rule = Rule::new([
                "-m",
                "set",
                "--match-set",
                masq_set.as_str(),
                "src",
                "-m",
                "set",
                "!",
                "--match-set",
                all.as_str(),
                "dst",
                "-j",
                "MASQUERADE",
            ])
            .map_err(bad)?;
            t.set_chain(&outgoing, vec![rule]).map_err(bad)?;
            t.set_chain(
                &post,
                vec![Rule::new(["-j", outgoing.as_str()]).map_err(bad)?],
            )
            .map_err(bad)?;
            t.set_hooks(
                "POSTROUTING",
                vec![Rule::new(["-j", post.as_str()]).map_err(bad)?],
            )
            .map_err(bad)?;
        }
        self.dirty = false;
        Ok(())
    }
}
