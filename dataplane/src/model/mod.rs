//! Desired state as plain data.
//!
//! Every value in here has been validated: a string that may reach a kernel
//! command (an id, an interface name, a CIDR, a set member) can only be built
//! through a constructor that checks it. The gRPC edge (`dphandler-proto`)
//! converts the wire messages into these types; the sync loop and the
//! managers only ever see these.

pub mod config;
pub mod endpoints;
pub mod ipsets;
pub mod marks;
pub mod network;
pub mod policy;
pub mod routes;
pub mod wireguard;

use std::fmt;
use std::net::IpAddr;

pub use endpoints::{
    EndpointState, HostEndpoint, HostEndpointId, HostInterface, TierDefault, TierInfo,
    WorkloadEndpoint, WorkloadEndpointId,
};
pub use ipsets::{IpSet, IpSetDelta, IpSetType, Member};
pub use marks::Marks;
pub use network::{
    Encapsulation, GlobalBgpConfig, HostMetadata, IpamPool, Route, Service, Vtep, WireguardEndpoint,
};
pub use policy::{Action, IcmpMatch, Policy, PolicyId, PortRange, Profile, Protocol, Rule};

/// Why a value was refused. `field` is a dotted path into the message
/// (`ipset_update.members[3]`); the edge prefixes it as it descends.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct ValidationError {
    pub field: String,
    pub reason: String,
}

/// The longest reason a rejection gives (one that quotes a long value is
/// cut, saying how long it was).
pub const MAX_REASON: usize = 1024;

impl ValidationError {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        let mut reason = reason.into();
        if reason.len() > MAX_REASON {
            let mut at = MAX_REASON;
            while !reason.is_char_boundary(at) {
                at -= 1;
            }
            let total = reason.len();
            reason.truncate(at);
            reason.push_str(&format!("… ({total} bytes in all)"));
        }
        Self {
            field: field.into(),
            reason,
        }
    }

    /// Prefix the field path with `outer` (`outer.field`, or `outer[i]` style
    /// when `field` starts with `[`).
    #[must_use]
    pub fn within(mut self, outer: &str) -> Self {
        self.field = if self.field.is_empty() {
            outer.to_string()
        } else if self.field.starts_with('[') {
            format!("{outer}{}", self.field)
        } else {
            format!("{outer}.{}", self.field)
        };
        self
    }
}

/// Shorthand for results of validation.
pub type Valid<T> = Result<T, ValidationError>;

/// Longest id we accept (Kubernetes names are at most 253 characters).
pub const MAX_ID_LEN: usize = 253;

/// An identifier from the calc graph (IP set id, policy/profile/tier name,
/// namespace, endpoint id parts, host name).
///
/// Charset `[A-Za-z0-9._:/@+=~-]` (plus `_`), 1..=253 bytes: nothing that
/// could break out of an `ipset restore` or `iptables-restore` line (no
/// whitespace, quotes, `#`, `,` or control characters).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Id(Box<str>);

impl Id {
    pub fn new(s: &str) -> Valid<Self> {
        if s.is_empty() {
            return Err(ValidationError::new("", "must not be empty"));
        }
        if s.len() > MAX_ID_LEN {
            return Err(ValidationError::new(
                "",
                format!("is {} bytes long; at most {MAX_ID_LEN} allowed", s.len()),
            ));
        }
        if let Some(c) = s.chars().find(|c| !is_id_char(*c)) {
            return Err(ValidationError::new(
                "",
                format!("contains {c:?}; allowed are letters, digits and . _ - : / @ + = ~"),
            ));
        }
        Ok(Self(s.into()))
    }

    /// Like [`Id::new`] but an empty string gives `None`.
    pub fn optional(s: &str) -> Valid<Option<Self>> {
        if s.is_empty() {
            Ok(None)
        } else {
            Self::new(s).map(Some)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn is_id_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':' | '/' | '@' | '+' | '=' | '~')
}

/// What a token of a rule may hold on its way to `iptables-restore`
/// (`[A-Za-z0-9._:/,!=+@%~-]`): no whitespace, quotes, `#` or control
/// characters, so no name can end a token or a line. Every id character
/// is one (checked by a test over every byte): an IP set named by an id
/// is always a valid token, so what the edge accepts the renderer can
/// write.
pub fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"._:/,!=+@%~-".contains(&b)
}

/// Ids order, compare and hash as their text: a map keyed by `Id` can be
/// looked up with a `&str`.
impl std::borrow::Borrow<str> for Id {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A Linux interface name: 1..=15 bytes (IFNAMSIZ - 1) of `[A-Za-z0-9._-]`,
/// not `.` or `..`. No `+` (an iptables wildcard), `/`, `:` or whitespace.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IfaceName(Box<str>);

impl IfaceName {
    pub const MAX_LEN: usize = 15;

    pub fn new(s: &str) -> Valid<Self> {
        if s.is_empty() {
            return Err(ValidationError::new("", "interface name must not be empty"));
        }
        if s.len() > Self::MAX_LEN {
            return Err(ValidationError::new(
                "",
                format!(
                    "interface name {s:?} is {} bytes; Linux allows at most {}",
                    s.len(),
                    Self::MAX_LEN
                ),
            ));
        }
        if s == "." || s == ".." {
            return Err(ValidationError::new(
                "",
                format!("{s:?} is not an interface name"),
            ));
        }
        if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(ValidationError::new(
                "",
                format!(
                    "interface name {s:?} contains {c:?}; allowed are letters, digits and . _ -"
                ),
            ));
        }
        Ok(Self(s.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IfaceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for IfaceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An Ethernet address.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    pub fn parse(s: &str) -> Valid<Self> {
        let mut out = [0u8; 6];
        let parts: Vec<&str> = s.split([':', '-']).collect();
        if parts.len() != 6 {
            return Err(ValidationError::new(
                "",
                format!("{s:?} is not a MAC address (aa:bb:cc:dd:ee:ff)"),
            ));
        }
        for (i, p) in parts.iter().enumerate() {
            if p.len() != 2 {
                return Err(ValidationError::new(
                    "",
                    format!("{s:?} is not a MAC address (aa:bb:cc:dd:ee:ff)"),
                ));
            }
            out[i] = u8::from_str_radix(p, 16).map_err(|_| {
                ValidationError::new(
                    "",
                    format!("{s:?} is not a MAC address (aa:bb:cc:dd:ee:ff)"),
                )
            })?;
        }
        Ok(Self(out))
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

/// IP version of a rule or set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpVersion {
    V4,
    V6,
}

impl IpVersion {
    pub fn of(addr: &IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }
}

/// Parse an IP address. Zone indices (`fe80::1%eth0`) are refused.
pub fn parse_ip(s: &str) -> Valid<IpAddr> {
    s.parse::<IpAddr>()
        .map_err(|_| ValidationError::new("", format!("{s:?} is not an IP address")))
}

/// Parse an optional IP address: empty gives `None`.
pub fn parse_ip_opt(s: &str) -> Valid<Option<IpAddr>> {
    if s.is_empty() {
        Ok(None)
    } else {
        parse_ip(s).map(Some)
    }
}

/// Parse a CIDR. A bare address is taken as a host route (/32 or /128), as
/// Felix does. Host bits must be zero (`10.0.0.1/24` is refused: it is
/// almost always a typo and iptables would silently mask it).
pub fn parse_net(s: &str) -> Valid<ipnet::IpNet> {
    if !s.contains('/') {
        return parse_ip(s).map(ipnet::IpNet::from);
    }
    let net: ipnet::IpNet = s
        .parse()
        .map_err(|_| ValidationError::new("", format!("{s:?} is not a CIDR")))?;
    if net.trunc() != net {
        return Err(ValidationError::new(
            "",
            format!("{s:?} has host bits set; did you mean {}?", net.trunc()),
        ));
    }
    Ok(net)
}

/// Check a free-form string that never reaches a kernel command (labels,
/// annotations, messages): length only, and no NUL.
pub fn check_text(s: &str, max: usize) -> Valid<()> {
    if s.len() > max {
        return Err(ValidationError::new(
            "",
            format!("is {} bytes; at most {max} allowed", s.len()),
        ));
    }
    if s.contains('\0') {
        return Err(ValidationError::new("", "contains a NUL byte"));
    }
    Ok(())
}

/// The kinds of object the calc graph sends, for keys, counts and sweeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    IpSet,
    Policy,
    Profile,
    HostEndpoint,
    WorkloadEndpoint,
    HostMetadata,
    IpamPool,
    ServiceAccount,
    Namespace,
    Route,
    Vtep,
    WireguardEndpoint,
    WireguardEndpointV6,
    Service,
    Config,
    Encapsulation,
    GlobalBgpConfig,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::IpSet => "ipset",
            Self::Policy => "policy",
            Self::Profile => "profile",
            Self::HostEndpoint => "host_endpoint",
            Self::WorkloadEndpoint => "workload_endpoint",
            Self::HostMetadata => "host_metadata",
            Self::IpamPool => "ipam_pool",
            Self::ServiceAccount => "service_account",
            Self::Namespace => "namespace",
            Self::Route => "route",
            Self::Vtep => "vtep",
            Self::WireguardEndpoint => "wireguard_endpoint",
            Self::WireguardEndpointV6 => "wireguard_endpoint_v6",
            Self::Service => "service",
            Self::Config => "config",
            Self::Encapsulation => "encapsulation",
            Self::GlobalBgpConfig => "global_bgp_config",
        }
    }

    /// The `ToDataplane` field whose message creates or replaces an object
    /// of this kind (what a rejection of such a message names).
    pub fn wire_field(self) -> &'static str {
        match self {
            Self::IpSet => "ipset_update",
            Self::Policy => "active_policy_update",
            Self::Profile => "active_profile_update",
            Self::HostEndpoint => "host_endpoint_update",
            Self::WorkloadEndpoint => "workload_endpoint_update",
            Self::HostMetadata => "host_metadata_update",
            Self::IpamPool => "ipam_pool_update",
            Self::ServiceAccount => "service_account_update",
            Self::Namespace => "namespace_update",
            Self::Route => "route_update",
            Self::Vtep => "vtep_update",
            Self::WireguardEndpoint => "wireguard_endpoint_update",
            Self::WireguardEndpointV6 => "wireguard_endpoint_v6_update",
            Self::Service => "service_update",
            Self::Config => "config_update",
            Self::Encapsulation => "encapsulation",
            Self::GlobalBgpConfig => "global_bgp_config_update",
        }
    }
}

/// Identity of a keyed object: what a later Remove names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    IpSet(Id),
    Policy(PolicyId),
    Profile(Id),
    HostEndpoint(HostEndpointId),
    WorkloadEndpoint(WorkloadEndpointId),
    HostMetadata(Id),
    IpamPool(Id),
    ServiceAccount {
        namespace: Id,
        name: Id,
    },
    Namespace(Id),
    Route(ipnet::IpNet),
    Vtep(Id),
    WireguardEndpoint(Id),
    WireguardEndpointV6(Id),
    Service {
        namespace: Id,
        name: Id,
    },
    /// Singletons (config, encapsulation, BGP config): replaced, never removed.
    Singleton(Kind),
}

impl Key {
    pub fn kind(&self) -> Kind {
        match self {
            Self::IpSet(_) => Kind::IpSet,
            Self::Policy(_) => Kind::Policy,
            Self::Profile(_) => Kind::Profile,
            Self::HostEndpoint(_) => Kind::HostEndpoint,
            Self::WorkloadEndpoint(_) => Kind::WorkloadEndpoint,
            Self::HostMetadata(_) => Kind::HostMetadata,
            Self::IpamPool(_) => Kind::IpamPool,
            Self::ServiceAccount { .. } => Kind::ServiceAccount,
            Self::Namespace(_) => Kind::Namespace,
            Self::Route(_) => Kind::Route,
            Self::Vtep(_) => Kind::Vtep,
            Self::WireguardEndpoint(_) => Kind::WireguardEndpoint,
            Self::WireguardEndpointV6(_) => Kind::WireguardEndpointV6,
            Self::Service { .. } => Kind::Service,
            Self::Singleton(k) => *k,
        }
    }

    /// Singletons are never swept: a snapshot that lacks them leaves the
    /// last value in force (Felix treats config the same way).
    pub fn sweepable(&self) -> bool {
        !matches!(self, Self::Singleton(_))
    }
}

/// One validated message from the calc graph.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    /// The snapshot is complete.
    InSync,
    IpSetUpdate(IpSet),
    IpSetDeltaUpdate(IpSetDelta),
    Policy(PolicyId, Policy),
    Profile(Id, Profile),
    HostEndpoint(HostEndpointId, HostEndpoint),
    WorkloadEndpoint(WorkloadEndpointId, WorkloadEndpoint),
    HostMetadata(HostMetadata),
    IpamPool(Id, IpamPool),
    ServiceAccount {
        namespace: Id,
        name: Id,
        labels: Vec<(String, String)>,
    },
    Namespace {
        name: Id,
        labels: Vec<(String, String)>,
    },
    Route(Route),
    Vtep(Vtep),
    WireguardEndpoint(WireguardEndpoint),
    WireguardEndpointV6(WireguardEndpoint),
    Service(Service),
    Config(Vec<(String, String)>),
    Encapsulation(Encapsulation),
    GlobalBgpConfig(GlobalBgpConfig),
    /// The object with this key is gone.
    Remove(Key),
}

impl Update {
    /// The key this message creates or replaces (None for InSync, deltas and
    /// removes).
    pub fn upsert_key(&self) -> Option<Key> {
        Some(match self {
            Self::InSync | Self::IpSetDeltaUpdate(_) | Self::Remove(_) => return None,
            Self::IpSetUpdate(s) => Key::IpSet(s.id.clone()),
            Self::Policy(id, _) => Key::Policy(id.clone()),
            Self::Profile(id, _) => Key::Profile(id.clone()),
            Self::HostEndpoint(id, _) => Key::HostEndpoint(id.clone()),
            Self::WorkloadEndpoint(id, _) => Key::WorkloadEndpoint(id.clone()),
            Self::HostMetadata(m) => Key::HostMetadata(m.hostname.clone()),
            Self::IpamPool(id, _) => Key::IpamPool(id.clone()),
            Self::ServiceAccount {
                namespace, name, ..
            } => Key::ServiceAccount {
                namespace: namespace.clone(),
                name: name.clone(),
            },
            Self::Namespace { name, .. } => Key::Namespace(name.clone()),
            Self::Route(r) => Key::Route(r.dst),
            Self::Vtep(v) => Key::Vtep(v.node.clone()),
            Self::WireguardEndpoint(w) => Key::WireguardEndpoint(w.hostname.clone()),
            Self::WireguardEndpointV6(w) => Key::WireguardEndpointV6(w.hostname.clone()),
            Self::Service(s) => Key::Service {
                namespace: s.namespace.clone(),
                name: s.name.clone(),
            },
            Self::Config(_) => Key::Singleton(Kind::Config),
            Self::Encapsulation(_) => Key::Singleton(Kind::Encapsulation),
            Self::GlobalBgpConfig(_) => Key::Singleton(Kind::GlobalBgpConfig),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reason that quotes a long value is cut, saying how long it was.
    #[test]
    fn a_long_reason_is_cut() {
        let e = ValidationError::new("f", format!("{:?} is not an IP", "é".repeat(100_000)));
        assert!(e.reason.len() < MAX_REASON + 64, "{}", e.reason.len());
        assert!(
            e.reason.ends_with("bytes in all)"),
            "{}",
            &e.reason[e.reason.len() - 40..]
        );
        assert_eq!(ValidationError::new("f", "short").reason, "short");
    }

    /// What the edge accepts in an id, a rule token can hold.
    #[test]
    fn every_id_character_is_a_token_character() {
        for b in 0u8..=255 {
            if let Ok(id) = Id::new(&String::from_utf8_lossy(&[b])) {
                assert!(
                    id.as_str().bytes().all(is_token_byte),
                    "{:?} is an id but not a token",
                    b as char
                );
            }
        }
    }

    #[test]
    fn ids_refuse_injection() {
        for bad in [
            "",
            "x\n-A INPUT -j ACCEPT",
            "a b",
            "a\"b",
            "a'b",
            "a#b",
            "a,b",
            "a\tb",
            "a\0b",
            "é",
        ] {
            assert!(Id::new(bad).is_err(), "{bad:?} accepted");
        }
        for good in [
            "s:abc-_XYZ09",
            "default.allow-all",
            "kns.default",
            "k8s/default/pod",
        ] {
            assert_eq!(Id::new(good).unwrap().as_str(), good);
        }
        assert!(Id::new(&"a".repeat(MAX_ID_LEN)).is_ok());
        let err = Id::new(&"a".repeat(MAX_ID_LEN + 1)).unwrap_err();
        assert!(err.reason.contains("at most 253"), "{err}");
    }

    #[test]
    fn iface_names() {
        assert!(IfaceName::new("cali1234567890a").is_ok());
        assert!(IfaceName::new("cali1234567890ab").is_err());
        for bad in ["", ".", "..", "eth0+", "a/b", "a:b", "a b", "eth0\n"] {
            assert!(IfaceName::new(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn nets() {
        assert_eq!(parse_net("10.0.0.1").unwrap().to_string(), "10.0.0.1/32");
        assert_eq!(parse_net("fd00::1").unwrap().to_string(), "fd00::1/128");
        assert_eq!(parse_net("10.0.0.0/8").unwrap().to_string(), "10.0.0.0/8");
        let e = parse_net("10.0.0.1/8").unwrap_err();
        assert!(e.reason.contains("did you mean 10.0.0.0/8"), "{e}");
        assert!(parse_net("10.0.0.0/33").is_err());
        assert!(parse_net("banana").is_err());
    }

    #[test]
    fn macs() {
        assert_eq!(
            MacAddr::parse("EE:ee:ee:ee:ee:01").unwrap().to_string(),
            "ee:ee:ee:ee:ee:01"
        );
        assert!(MacAddr::parse("ee:ee:ee:ee:ee").is_err());
        assert!(MacAddr::parse("ee:ee:ee:ee:ee:zz").is_err());
    }

    #[test]
    fn field_paths_compose() {
        let e = ValidationError::new("", "bad")
            .within("[3]")
            .within("members")
            .within("ipset_update");
        assert_eq!(e.field, "ipset_update.members[3]");
    }
}
