//! The Felix configuration keys a `ConfigUpdate` carries that matter to
//! the dataplane: each checked (a value that cannot be parsed is a
//! rejection naming the key), and how each takes effect.
//!
//! Precedence: a key in the last `ConfigUpdate` wins over its flag (the
//! calc graph holds the cluster's configuration; the flags are this
//! node's defaults); a key that a later `ConfigUpdate` leaves out falls
//! back to the flag.
//!
//! - **Live** keys change the running dataplane: `FelixHostname`, the
//!   WireGuard keys ([`crate::model::wireguard`]), `VXLANEnabled`,
//!   `VXLANVNI`, `VXLANPort`, `VXLANMTU` (`VXLANMTUV6`), `IpInIpEnabled`,
//!   `FailsafeInboundHostPorts`, `FailsafeOutboundHostPorts`,
//!   `DefaultEndpointToHostAction`, `IptablesRefreshInterval`,
//!   `IpsetsRefreshInterval`, `RouteRefreshInterval`, `LogSeverityScreen`.
//! - **Restart** keys name what every chain, rule and set is built on
//!   (`InterfacePrefix`, `IptablesMarkMask`) or a node-wide choice made at
//!   start (`IPForwarding`): a value other than the running one is
//!   reported (log and status, as `config.restart_needed.<key>`), kept in
//!   the state directory, and in force from the next start on. Felix
//!   restarts itself on such a change; the daemon leaves the restart to
//!   its operator (a DaemonSet rollout), since a restart in the middle of a
//!   calc graph's snapshot would cost more than it saves.
//!
//! Other keys are Felix's own business (BPF, BGP, reporting…): listed once
//! at debug level and otherwise ignored.

use std::collections::BTreeMap;
use std::time::Duration;

use super::wireguard::parse_bool;

/// How a key takes effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    Live,
    Restart,
}

/// Felix's `DefaultEndpointToHostAction`: what happens to traffic from a
/// workload to its host once the workload's egress policy allowed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EndpointToHost {
    /// Dropped (Felix's own default).
    Drop,
    /// Accepted (the egress policy allowed it): what Calico's manifests
    /// set, and this daemon's default.
    #[default]
    Accept,
    /// Left to the rest of INPUT (other rules, host endpoints).
    Return,
}

impl std::str::FromStr for EndpointToHost {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "drop" => Ok(Self::Drop),
            "accept" => Ok(Self::Accept),
            "return" => Ok(Self::Return),
            _ => Err(format!("{s:?}: expected Drop, Accept or Return")),
        }
    }
}

/// The keys this daemon reads, with how each takes effect. (WireGuard's
/// and `FelixHostname` are checked by their managers.)
pub const KEYS: &[(&str, Effect)] = &[
    ("InterfacePrefix", Effect::Restart),
    ("IptablesMarkMask", Effect::Restart),
    ("IPForwarding", Effect::Restart),
    ("IpInIpEnabled", Effect::Live),
    ("VXLANEnabled", Effect::Live),
    ("VXLANVNI", Effect::Live),
    ("VXLANPort", Effect::Live),
    ("VXLANMTU", Effect::Live),
    ("VXLANMTUV6", Effect::Live),
    ("IptablesRefreshInterval", Effect::Live),
    ("IpsetsRefreshInterval", Effect::Live),
    ("RouteRefreshInterval", Effect::Live),
    ("FailsafeInboundHostPorts", Effect::Live),
    ("FailsafeOutboundHostPorts", Effect::Live),
    ("DefaultEndpointToHostAction", Effect::Live),
    ("LogSeverityScreen", Effect::Live),
];

/// Keys other modules check and apply ([`crate::model::wireguard`], the
/// routes manager's `FelixHostname`): known, so not listed as unknown.
const OTHERS: &[&str] = &[
    "FelixHostname",
    "WireguardEnabled",
    "WireguardEnabledV6",
    "WireguardListeningPort",
    "WireguardListeningPortV6",
    "WireguardMTU",
    "WireguardMTUV6",
    "WireguardRoutingRulePriority",
    "WireguardInterfaceName",
    "WireguardInterfaceNameV6",
];

/// Every key of a `ConfigUpdate` this daemon reads: [`KEYS`] and the ones
/// other modules check and apply.
pub fn known_keys() -> impl Iterator<Item = &'static str> {
    KEYS.iter().map(|(k, _)| *k).chain(OTHERS.iter().copied())
}

/// The parsed values of the keys in [`KEYS`] that a `ConfigUpdate` set.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FelixConfig {
    pub interface_prefix: Option<String>,
    pub mark_mask: Option<u32>,
    pub ip_forwarding: Option<bool>,
    pub ipip_enabled: Option<bool>,
    pub vxlan_enabled: Option<bool>,
    pub vxlan_vni: Option<u32>,
    pub vxlan_port: Option<u16>,
    /// 0: the default (the parent's MTU less the overhead).
    pub vxlan_mtu: Option<u32>,
    pub vxlan_mtu_v6: Option<u32>,
    pub iptables_refresh: Option<Duration>,
    pub ipsets_refresh: Option<Duration>,
    pub route_refresh: Option<Duration>,
    pub failsafe_in: Option<Vec<(String, u16)>>,
    pub failsafe_out: Option<Vec<(String, u16)>>,
    pub endpoint_to_host: Option<EndpointToHost>,
    /// A tracing filter (`debug`, `info`, `warn`, `error`, `off`).
    pub log_level: Option<String>,
}

/// `tcp:22,udp:68` (Felix's `none` or nothing: no ports).
pub fn parse_ports(s: &str) -> Result<Vec<(String, u16)>, String> {
    if s.trim().eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| {
            let (p, port) = x
                .split_once(':')
                .ok_or_else(|| format!("{x:?}: expected proto:port, e.g. tcp:22"))?;
            let p = p.to_ascii_lowercase();
            if !matches!(p.as_str(), "tcp" | "udp" | "sctp") {
                return Err(format!("{x:?}: protocol must be tcp, udp or sctp"));
            }
            if port.contains(':') {
                return Err(format!(
                    "{x:?}: failsafe entries limited to a network (proto:net:port) are not supported"
                ));
            }
            let port: u16 = port
                .parse()
                .map_err(|_| format!("{x:?}: port must be 0-65535"))?;
            Ok((p, port))
        })
        .collect()
}

/// The longest interval any setting may have (a refresh, a retry, a
/// timeout): a day. Longer ones are refused, not clamped: a timer armed
/// past what the clock can hold would end the loop (a refresh interval of
/// 9.3e18 seconds did).
pub const MAX_INTERVAL: Duration = Duration::from_secs(86_400);

/// An interval of `secs` seconds (0 allowed: "never" for a refresh), at
/// most [`MAX_INTERVAL`].
pub fn interval(secs: f64) -> Result<Duration, String> {
    if !(0.0..=MAX_INTERVAL.as_secs_f64()).contains(&secs) {
        return Err(format!(
            "{secs} s: must be 0 to {} seconds",
            MAX_INTERVAL.as_secs()
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Felix's seconds (`90`, `2.5`), or a duration with a unit (`90s`,
/// `5m`, `1h`, `500ms`); 0 to [`MAX_INTERVAL`].
pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{s:?}: unit must be ms, s, m or h")),
    };
    interval(secs).map_err(|why| format!("{s:?}: {why}"))
}

/// Felix's log severities as a tracing filter.
fn parse_severity(s: &str) -> Result<String, String> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "warning" | "warn" => "warn",
        "error" | "fatal" | "panic" => "error",
        "none" | "" => "off",
        _ => {
            return Err(format!(
                "{s:?}: expected Debug, Info, Warning, Error, Fatal or None"
            ));
        }
    }
    .to_string())
}

fn parse_mask(s: &str) -> Result<u32, String> {
    let v = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => s.parse(),
    }
    .map_err(|_| format!("{s:?} is not a 32-bit mask (e.g. 0xffff0000)"))?;
    crate::model::Marks::from_mask(v)?;
    Ok(v)
}

fn parse_prefix(s: &str) -> Result<String, String> {
    // Felix allows several (`cali,tap`); one is what this daemon renders.
    if s.is_empty()
        || s.len() > 14
        || !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        return Err(format!(
            "{s:?}: one interface prefix of 1-14 characters of [A-Za-z0-9._-] (several, as Felix allows, are not supported)"
        ));
    }
    Ok(s.to_string())
}

fn bool_of(s: &str) -> Result<bool, String> {
    parse_bool(s).ok_or_else(|| format!("{s:?} is not true or false"))
}

fn mtu_of(s: &str) -> Result<u32, String> {
    s.parse::<u32>()
        .ok()
        .filter(|m| *m == 0 || (68..=65535).contains(m))
        .ok_or_else(|| format!("{s:?} is not an MTU (0 for the default, or 68-65535)"))
}

impl FelixConfig {
    /// The keys of a `ConfigUpdate` this module reads, parsed: `Err((key,
    /// why))` for the first that cannot be.
    pub fn parse(kv: &[(String, String)]) -> Result<Self, (String, String)> {
        let mut c = Self::default();
        for (k, v) in kv {
            let r: Result<(), String> = (|| {
                match k.as_str() {
                    "InterfacePrefix" => c.interface_prefix = Some(parse_prefix(v)?),
                    "IptablesMarkMask" => c.mark_mask = Some(parse_mask(v)?),
                    "IPForwarding" => {
                        c.ip_forwarding = Some(match v.to_ascii_lowercase().as_str() {
                            "enabled" => true,
                            "disabled" => false,
                            _ => return Err(format!("{v:?}: expected Enabled or Disabled")),
                        })
                    }
                    "IpInIpEnabled" => c.ipip_enabled = Some(bool_of(v)?),
                    "VXLANEnabled" => c.vxlan_enabled = Some(bool_of(v)?),
                    "VXLANVNI" => {
                        c.vxlan_vni = Some(
                            v.parse::<u32>()
                                .ok()
                                .filter(|n| (1..16_777_216).contains(n))
                                .ok_or_else(|| format!("{v:?} is not a VNI (1-16777215)"))?,
                        )
                    }
                    "VXLANPort" => {
                        c.vxlan_port = Some(
                            v.parse::<u16>()
                                .ok()
                                .filter(|p| *p > 0)
                                .ok_or_else(|| format!("{v:?} is not a UDP port (1-65535)"))?,
                        )
                    }
                    "VXLANMTU" => c.vxlan_mtu = Some(mtu_of(v)?),
                    "VXLANMTUV6" => c.vxlan_mtu_v6 = Some(mtu_of(v)?),
                    "IptablesRefreshInterval" => c.iptables_refresh = Some(parse_seconds(v)?),
                    "IpsetsRefreshInterval" => c.ipsets_refresh = Some(parse_seconds(v)?),
                    "RouteRefreshInterval" => c.route_refresh = Some(parse_seconds(v)?),
                    "FailsafeInboundHostPorts" => c.failsafe_in = Some(parse_ports(v)?),
                    "FailsafeOutboundHostPorts" => c.failsafe_out = Some(parse_ports(v)?),
                    "DefaultEndpointToHostAction" => c.endpoint_to_host = Some(v.parse()?),
                    "LogSeverityScreen" => c.log_level = Some(parse_severity(v)?),
                    _ => {}
                }
                Ok(())
            })();
            r.map_err(|why| (k.clone(), why))?;
        }
        Ok(c)
    }

    /// VXLAN as `VXLANEnabled` says, else as the flag.
    pub fn vxlan_mode(&self, flag: super::routes::VxlanMode) -> super::routes::VxlanMode {
        use super::routes::VxlanMode;
        match self.vxlan_enabled {
            Some(true) => VxlanMode::Enabled,
            Some(false) => VxlanMode::Disabled,
            None => flag,
        }
    }

    /// An MTU key over its flag: 0 is the default (`None`).
    pub fn mtu(key: Option<u32>, flag: Option<u32>) -> Option<u32> {
        match key {
            Some(0) => None,
            Some(m) => Some(m),
            None => flag,
        }
    }

    /// The keys of `kv` nobody here reads.
    pub fn unknown(kv: &[(String, String)]) -> Vec<&str> {
        kv.iter()
            .map(|(k, _)| k.as_str())
            .filter(|k| !KEYS.iter().any(|(n, _)| n == k) && !OTHERS.contains(k))
            .collect()
    }

    /// The restart keys set here, as (key, value) text.
    pub fn restart_keys(kv: &[(String, String)]) -> BTreeMap<String, String> {
        kv.iter()
            .filter(|(k, _)| KEYS.iter().any(|(n, e)| n == k && *e == Effect::Restart))
            .cloned()
            .collect()
    }
}

/// `[("k", "v")]` as a ConfigUpdate's pairs (tests).
#[cfg(test)]
pub(crate) fn kv(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn felix_values_parse() {
        let c = FelixConfig::parse(&kv(&[
            ("InterfacePrefix", "tap"),
            ("IptablesMarkMask", "0xff000000"),
            ("IPForwarding", "Disabled"),
            ("IpInIpEnabled", "true"),
            ("VXLANEnabled", "false"),
            ("VXLANVNI", "4097"),
            ("VXLANPort", "4790"),
            ("VXLANMTU", "0"),
            ("IptablesRefreshInterval", "90"),
            ("IpsetsRefreshInterval", "1m"),
            ("RouteRefreshInterval", "2.5"),
            ("FailsafeInboundHostPorts", "tcp:22, UDP:68"),
            ("FailsafeOutboundHostPorts", "none"),
            ("DefaultEndpointToHostAction", "ACCEPT"),
            ("LogSeverityScreen", "Warning"),
            ("SomethingElse", "whatever"),
        ]))
        .unwrap();
        assert_eq!(c.interface_prefix.as_deref(), Some("tap"));
        assert_eq!(c.mark_mask, Some(0xff00_0000));
        assert_eq!(c.ip_forwarding, Some(false));
        assert_eq!(c.ipip_enabled, Some(true));
        assert_eq!(c.vxlan_enabled, Some(false));
        assert_eq!(
            (c.vxlan_vni, c.vxlan_port, c.vxlan_mtu),
            (Some(4097), Some(4790), Some(0))
        );
        assert_eq!(c.iptables_refresh, Some(Duration::from_secs(90)));
        assert_eq!(c.ipsets_refresh, Some(Duration::from_secs(60)));
        assert_eq!(c.route_refresh, Some(Duration::from_millis(2500)));
        assert_eq!(
            c.failsafe_in,
            Some(vec![("tcp".into(), 22), ("udp".into(), 68)])
        );
        assert_eq!(c.failsafe_out, Some(vec![]));
        assert_eq!(c.endpoint_to_host, Some(EndpointToHost::Accept));
        assert_eq!(c.log_level.as_deref(), Some("warn"));
        assert_eq!(parse_seconds("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_seconds("5m"), Ok(Duration::from_secs(300)));
    }

    #[test]
    fn a_bad_value_names_its_key() {
        for (k, v, says) in [
            ("InterfacePrefix", "cali,tap", "several"),
            ("IptablesMarkMask", "0xf", "need 6"),
            ("IptablesMarkMask", "lots", "not a 32-bit mask"),
            ("IPForwarding", "yes", "Enabled or Disabled"),
            ("VXLANVNI", "0", "not a VNI"),
            ("VXLANPort", "70000", "not a UDP port"),
            ("VXLANMTU", "20", "not an MTU"),
            ("IpInIpEnabled", "maybe", "not true or false"),
            ("IptablesRefreshInterval", "soon", "not a number"),
            ("RouteRefreshInterval", "5d", "unit"),
            (
                "IptablesRefreshInterval",
                "9300000000000000000",
                "must be 0 to 86400 seconds",
            ),
            ("IpsetsRefreshInterval", "-1", "must be 0 to 86400"),
            ("RouteRefreshInterval", "25h", "must be 0 to 86400"),
            ("IptablesRefreshInterval", "NaN", "not a number"),
            ("IptablesRefreshInterval", "100000", "must be 0 to 86400"),
            (
                "FailsafeInboundHostPorts",
                "tcp:10.0.0.0/8:22",
                "not supported",
            ),
            ("FailsafeOutboundHostPorts", "icmp:1", "tcp, udp or sctp"),
            (
                "DefaultEndpointToHostAction",
                "Reject",
                "Drop, Accept or Return",
            ),
            ("LogSeverityScreen", "Loud", "expected Debug"),
        ] {
            let (key, why) = FelixConfig::parse(&kv(&[(k, v)])).unwrap_err();
            assert_eq!(key, k);
            assert!(why.contains(says), "{k}={v}: {why}");
        }
    }

    #[test]
    fn unknown_and_restart_keys() {
        let c = kv(&[
            ("InterfacePrefix", "cali"),
            ("WireguardEnabled", "true"),
            ("BPFEnabled", "false"),
            ("FelixHostname", "n1"),
        ]);
        assert_eq!(FelixConfig::unknown(&c), vec!["BPFEnabled"]);
        assert_eq!(
            FelixConfig::restart_keys(&c),
            BTreeMap::from([("InterfacePrefix".into(), "cali".into())])
        );
    }
}
