//! The static part of the iptables state: our top-level chains in the
//! filter table and the hooks that jump to them from the built-in chains
//! (`INPUT` → `<prefix>-INPUT`, `FORWARD` → `<prefix>-FORWARD`, `OUTPUT` →
//! `<prefix>-OUTPUT`), in every IP version the dataplane programs. The
//! chains are empty until policy rendering fills them (a later issue): an
//! empty chain returns, so hooking it changes no verdict. No I/O here.

use super::{Manager, ManagerError};
use crate::backends::DesiredKernel;
use crate::backends::iptables::Rule;
use crate::model::Update;

#[derive(Debug)]
pub struct StaticChainsManager {
    prefix: String,
    done: bool,
}

impl StaticChainsManager {
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_string(),
            done: false,
        }
    }
}

/// The built-in filter chains we hook.
pub const FILTER_HOOKS: [&str; 3] = ["INPUT", "FORWARD", "OUTPUT"];

impl Manager for StaticChainsManager {
    fn name(&self) -> &'static str {
        "static-chains"
    }

    fn on_update(&mut self, _update: &Update) {}

    fn complete_deferred_work(&mut self, kernel: &mut DesiredKernel) -> Result<(), ManagerError> {
        if self.done {
            return Ok(());
        }
        let bad = |e: crate::backends::iptables::RuleError| ManagerError::Inconsistent {
            manager: "static-chains",
            reason: e.to_string(),
        };
        for t in kernel.tables.iter_mut().filter(|t| t.table() == "filter") {
            for hook in FILTER_HOOKS {
                let chain = format!("{}-{hook}", self.prefix);
                t.set_chain(&chain, Vec::new()).map_err(bad)?;
                let jump = Rule::new(["-j", chain.as_str()]).map_err(bad)?;
                t.set_hooks(hook, vec![jump]).map_err(bad)?;
            }
        }
        self.done = true;
        Ok(())
    }
}
