//! The real [`RouteExec`]: iproute2's `ip`, in the daemon's namespace.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use ipnet::IpNet;

use super::RouteExec;
use crate::backends::BackendError;

#[derive(Debug, Clone, Default)]
pub struct IpTool;

fn run(args: &[&str]) -> Result<String, BackendError> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| BackendError::Io {
            backend: "routes",
            context: "running ip".into(),
            source,
        })?;
    if !out.status.success() {
        return Err(BackendError::Command {
            backend: "routes",
            command: format!("ip {}", args.join(" ")),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl RouteExec for IpTool {
    fn show(&mut self, protocol: u8) -> Result<String, BackendError> {
        let p = protocol.to_string();
        let v4 = run(&["-j", "-4", "route", "show", "table", "main", "proto", &p])?;
        let v6 = run(&["-j", "-6", "route", "show", "table", "main", "proto", &p])?;
        Ok(format!("{}\n{}", v4.trim(), v6.trim()))
    }

    fn batch(&mut self, script: &str) -> Result<(), BackendError> {
        let mut cmd = Command::new("ip");
        cmd.args(["-force", "-batch", "-"]);
        let out =
            crate::backends::run_with_input(&mut cmd, script, crate::backends::ScriptInput::Pipe)
                .map_err(|source| BackendError::Io {
                backend: "routes",
                context: "running ip -batch".into(),
                source,
            })?;
        if !out.status.success() {
            return Err(BackendError::Command {
                backend: "routes",
                command: "ip -force -batch -".into(),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(())
    }
}

/// Routes from one or more JSON arrays of `ip -j route show` (a host route's
/// `dst` has no prefix length).
pub fn parse_routes(text: &str) -> Result<BTreeMap<IpNet, String>, String> {
    let mut out = BTreeMap::new();
    for v in serde_json::Deserializer::from_str(text).into_iter::<serde_json::Value>() {
        let v = v.map_err(|e| format!("ip -j route printed something that is not JSON: {e}"))?;
        for r in v.as_array().into_iter().flatten() {
            let (Some(dst), Some(dev)) = (r["dst"].as_str(), r["dev"].as_str()) else {
                continue;
            };
            let net: IpNet = match dst.parse::<IpNet>() {
                Ok(n) => n,
                Err(_) => match dst.parse::<std::net::IpAddr>() {
                    Ok(a) => IpNet::from(a),
                    Err(_) => continue, // "default" and the like: not ours
                },
            };
            out.insert(net, dev.to_string());
        }
    }
    Ok(out)
}
