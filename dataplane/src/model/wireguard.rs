//! WireGuard desired state as plain data: keys, the device of one IP
//! version and its peers (Felix's `felix/wireguard`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};

use base64::Engine;
use ipnet::IpNet;

use super::{IfaceName, IpVersion};

/// Felix's device names, ports and routing-rule priority.
pub const IFACE_V4: &str = "wireguard.cali";
pub const IFACE_V6: &str = "wg-v6.cali";
pub const PORT_V4: u16 = 51820;
pub const PORT_V6: u16 = 51821;
pub const RULE_PRIORITY: u32 = 99;
/// Felix's first two indices of `RouteTableRanges` (1-250): v4 gets 1, v6 2.
pub const TABLE_V4: u32 = 1;
pub const TABLE_V6: u32 = 2;
/// The metric of the blackhole behind each peer's route in the WireGuard
/// table (the device's routes have 0, IPv6 1024): it takes over when the
/// device's route is gone.
pub const FAIL_CLOSED_METRIC: u32 = 4096;
/// What the device's MTU leaves of the host's: the WireGuard header over
/// IPv4 (60) or IPv6 (80) underlay.
pub const OVERHEAD_V4: u32 = 60;
pub const OVERHEAD_V6: u32 = 80;

/// A Curve25519 public key. Shown as WireGuard shows it: standard base64.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PublicKey(pub [u8; 32]);

impl PublicKey {
    pub fn to_base64(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(self.0)
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_base64())
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({self})")
    }
}

/// One programmed peer: another node with an endpoint and a key no other
/// node claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgPeer {
    /// The node's name (for status; WireGuard knows peers by key).
    pub node: String,
    pub endpoint: SocketAddr,
    /// The node's workload blocks and tunnel addresses.
    pub allowed_ips: BTreeSet<IpNet>,
}

/// The device of one IP version as it should be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgDevice {
    pub version: IpVersion,
    pub name: String,
    pub port: u16,
    pub fwmark: u32,
    pub mtu: u32,
    /// This node's `interface_ipv4_addr` (`interface_ipv6_addr`), as /32
    /// (/128) on the device.
    pub addr: Option<IpAddr>,
    pub peers: BTreeMap<PublicKey, WgPeer>,
}

/// Which implementation carries a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WgImpl {
    /// The kernel's module where there is one, else `wireguard-go`.
    #[default]
    Auto,
    Kernel,
    Userspace,
}

impl std::str::FromStr for WgImpl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "kernel" => Ok(Self::Kernel),
            "userspace" => Ok(Self::Userspace),
            _ => Err(format!("{s:?}: expected auto, kernel or userspace")),
        }
    }
}

/// One IP version's WireGuard settings: what the flags say, or (from
/// [`WgSettings::effective`]) what is in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgSettings {
    pub enabled: bool,
    pub port: u16,
    /// `None`: the host interface's MTU minus the overhead.
    pub mtu: Option<u32>,
    pub iface: String,
}

impl WgSettings {
    /// Felix's defaults for version `v` (off).
    pub fn default_for(v: IpVersion) -> Self {
        match v {
            IpVersion::V4 => Self {
                enabled: false,
                port: PORT_V4,
                mtu: None,
                iface: IFACE_V4.into(),
            },
            IpVersion::V6 => Self {
                enabled: false,
                port: PORT_V6,
                mtu: None,
                iface: IFACE_V6.into(),
            },
        }
    }

    /// The settings in force: a key of the last `ConfigUpdate` (only ours,
    /// see [`config_keys`]) wins over the flag.
    pub fn effective(&self, v: IpVersion, config: &BTreeMap<String, String>) -> Self {
        let get = |k: &str| config.get(k).map(String::as_str);
        let [en, port, mtu, iface] = match v {
            IpVersion::V4 => [
                "WireguardEnabled",
                "WireguardListeningPort",
                "WireguardMTU",
                "WireguardInterfaceName",
            ],
            IpVersion::V6 => [
                "WireguardEnabledV6",
                "WireguardListeningPortV6",
                "WireguardMTUV6",
                "WireguardInterfaceNameV6",
            ],
        };
        Self {
            enabled: get(en).and_then(parse_bool).unwrap_or(self.enabled),
            port: get(port).and_then(|p| p.parse().ok()).unwrap_or(self.port),
            mtu: match get(mtu).and_then(|m| m.parse::<u32>().ok()) {
                Some(0) => None,
                Some(m) => Some(m),
                None => self.mtu,
            },
            iface: get(iface).unwrap_or(&self.iface).to_string(),
        }
    }
}

/// The `ConfigUpdate` keys WireGuard reads (Felix's names), and what each
/// must be.
const CONFIG_KEYS: [(&str, &str); 9] = [
    ("WireguardEnabled", "bool"),
    ("WireguardEnabledV6", "bool"),
    ("WireguardListeningPort", "port"),
    ("WireguardListeningPortV6", "port"),
    ("WireguardMTU", "mtu"),
    ("WireguardMTUV6", "mtu"),
    ("WireguardRoutingRulePriority", "priority"),
    ("WireguardInterfaceName", "iface"),
    ("WireguardInterfaceNameV6", "iface"),
];

/// Our keys of a `ConfigUpdate`.
pub fn config_keys(kv: &[(String, String)]) -> BTreeMap<String, String> {
    kv.iter()
        .filter(|(k, _)| CONFIG_KEYS.iter().any(|(n, _)| n == k))
        .cloned()
        .collect()
}

/// Felix's booleans.
pub fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Checks the WireGuard keys of a `ConfigUpdate`: `Err((key, why))` for
/// the first bad one.
pub fn check_config(kv: &[(String, String)]) -> Result<(), (String, String)> {
    for (k, v) in kv {
        let Some((_, kind)) = CONFIG_KEYS.iter().find(|(name, _)| name == k) else {
            continue;
        };
        let (ok, what) = match *kind {
            "bool" => (parse_bool(v).is_some(), "is not true or false".to_string()),
            "port" => (
                v.parse::<u16>().is_ok_and(|p| p > 0),
                "is not a UDP port (1-65535)".into(),
            ),
            // 0: the default (host MTU minus the overhead).
            "mtu" => (
                v.parse::<u32>()
                    .is_ok_and(|m| m == 0 || (68..=65535).contains(&m)),
                "is not an MTU (0 for the default, or 68-65535)".into(),
            ),
            "priority" => (
                v.parse::<u32>().is_ok_and(|p| p > 0 && p < 32766),
                "is not a rule priority (1-32765: 0 and 32766 are the kernel's local and main rules)"
                    .into(),
            ),
            _ => (IfaceName::new(v).is_ok(), "is not an interface name".into()),
        };
        if !ok {
            return Err((k.clone(), format!("{v:?} {what}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_print_as_wireguard_does() {
        assert_eq!(
            PublicKey([0; 32]).to_string(),
            "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
        );
        let mut k = [0u8; 32];
        k[31] = 1;
        assert_eq!(
            format!("{:?}", PublicKey(k)),
            "PublicKey(AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAE=)"
        );
    }
}
