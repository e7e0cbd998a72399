//! The real [`IpSetExec`]: the `ipset` tool, in the daemon's network
//! namespace. The `ipset` crate (libipset FFI) is not used: its `list()`
//! fails beyond ~1 KiB of output, it has no swap and is `!Send`; spawning
//! `ipset restore` with the script on stdin is as fast and atomic per line.

use std::process::{Command, Stdio};

use super::IpSetExec;
use crate::backends::BackendError;

const BACKEND: &str = "ipsets";

/// Runs `ipset` (from `PATH`, or the given path).
#[derive(Debug, Clone)]
pub struct IpsetTool {
    program: String,
    metrics: Option<crate::metrics::ToolCounters>,
}

impl Default for IpsetTool {
    fn default() -> Self {
        Self::new("ipset")
    }
}

impl IpsetTool {
    pub fn new(program: impl Into<String>) -> Self {
        Self {
            program: program.into(),
            metrics: None,
        }
    }

    /// Count every run (calls, failures, lines fed to `ipset restore`).
    pub fn with_metrics(mut self, m: crate::metrics::ToolCounters) -> Self {
        self.metrics = Some(m);
        self
    }

    fn counted<T>(&self, input: &str, r: Result<T, BackendError>) -> Result<T, BackendError> {
        if let Some(m) = &self.metrics {
            m.count(input, &r);
        }
        r
    }
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> BackendError {
    move |source| BackendError::Io {
        backend: BACKEND,
        context,
        source,
    }
}

impl IpSetExec for IpsetTool {
    fn save(&mut self) -> Result<String, BackendError> {
        let r = self.run_save();
        self.counted("", r)
    }

    fn restore(&mut self, script: &str) -> Result<(), BackendError> {
        let r = self.run_restore(script);
        self.counted(script, r)
    }

    fn detached_save(&self) -> Option<super::DetachedSave> {
        let mut me = self.clone();
        Some(Box::new(move || me.save()))
    }
}

impl IpsetTool {
    fn run_save(&self) -> Result<String, BackendError> {
        let out = Command::new(&self.program)
            .arg("save")
            .stdin(Stdio::null())
            .output()
            .map_err(io(format!("running {} save", self.program)))?;
        if !out.status.success() {
            return Err(BackendError::Command {
                backend: BACKEND,
                command: format!("{} save", self.program),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        String::from_utf8(out.stdout).map_err(|e| BackendError::Parse {
            backend: BACKEND,
            reason: format!("ipset save printed non-UTF-8: {e}"),
        })
    }

    fn run_restore(&self, script: &str) -> Result<(), BackendError> {
        let mut cmd = Command::new(&self.program);
        cmd.args(["restore", "-exist"]);
        let out =
            crate::backends::run_with_input(&mut cmd, script, crate::backends::ScriptInput::Pipe)
                .map_err(io(format!("running {} restore", self.program)))?;
        if !out.status.success() {
            return Err(BackendError::Command {
                backend: BACKEND,
                command: format!("{} restore -exist", self.program),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(())
    }
}
