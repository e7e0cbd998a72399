//! IP sets as the calc graph describes them: an id, a type and members of
//! both IP families (the dataplane splits them into a v4 and a v6 set).

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

use super::{Id, IpVersion, Valid, ValidationError, parse_ip, parse_net};

/// `IPSetUpdate.IPSetType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpSetType {
    /// `hash:ip`
    Ip,
    /// `hash:net`
    Net,
    /// `hash:ip,port`
    IpAndPort,
}

impl IpSetType {
    /// The ipset type name.
    pub fn ipset_type(self) -> &'static str {
        match self {
            Self::Ip => "hash:ip",
            Self::Net => "hash:net",
            Self::IpAndPort => "hash:ip,port",
        }
    }
}

/// Protocols an `hash:ip,port` member may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PortProto {
    Tcp,
    Udp,
    Sctp,
}

impl PortProto {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::Sctp => "sctp",
        }
    }
}

/// One member, typed by the set's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Member {
    Ip(IpAddr),
    Net(IpNet),
    IpPort(IpAddr, PortProto, u16),
}

impl Member {
    /// Parse a member string for a set of type `ty`:
    /// - `Ip`: `10.0.0.1`, `fd00::1`
    /// - `Net`: `10.0.0.0/24` (a bare address is a /32 or /128)
    /// - `IpAndPort`: `10.0.0.1,tcp:8080` (ipset's own syntax)
    pub fn parse(ty: IpSetType, s: &str) -> Valid<Self> {
        match ty {
            IpSetType::Ip => parse_ip(s).map(Self::Ip),
            IpSetType::Net => {
                let net = parse_net(s)?;
                if net.prefix_len() == 0 {
                    // hash:net cannot hold a /0; Felix splits it, we refuse it
                    // rather than silently program something else.
                    return Err(ValidationError::new(
                        "",
                        format!(
                            "{s:?}: a /0 cannot be a hash:net member; use 0.0.0.0/1 and 128.0.0.0/1"
                        ),
                    ));
                }
                Ok(Self::Net(net))
            }
            IpSetType::IpAndPort => {
                let bad = || {
                    ValidationError::new(
                        "",
                        format!("{s:?} is not an ip,proto:port member (e.g. 10.0.0.1,tcp:8080)"),
                    )
                };
                let (ip, rest) = s.split_once(',').ok_or_else(bad)?;
                let (proto, port) = rest.split_once(':').ok_or_else(bad)?;
                let ip = parse_ip(ip)?;
                let proto = match proto {
                    "tcp" => PortProto::Tcp,
                    "udp" => PortProto::Udp,
                    "sctp" => PortProto::Sctp,
                    other => {
                        return Err(ValidationError::new(
                            "",
                            format!("{s:?}: protocol {other:?} must be tcp, udp or sctp"),
                        ));
                    }
                };
                let port: u16 = port.parse().map_err(|_| {
                    ValidationError::new("", format!("{s:?}: port {port:?} is not 0-65535"))
                })?;
                Ok(Self::IpPort(ip, proto, port))
            }
        }
    }

    pub fn version(&self) -> IpVersion {
        match self {
            Self::Ip(a) | Self::IpPort(a, _, _) => IpVersion::of(a),
            Self::Net(n) => IpVersion::of(&n.addr()),
        }
    }
}

impl fmt::Display for Member {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip(a) => write!(f, "{a}"),
            Self::Net(n) => write!(f, "{n}"),
            Self::IpPort(a, p, port) => write!(f, "{a},{}:{port}", p.as_str()),
        }
    }
}

/// `IPSetUpdate`: the whole membership of a set.
#[derive(Debug, Clone, PartialEq)]
pub struct IpSet {
    pub id: Id,
    pub set_type: IpSetType,
    pub members: Vec<Member>,
}

/// `IPSetDeltaUpdate`: members added to and removed from an existing set.
/// The edge parses each member by its shape ([`Member::parse_any`]); the
/// loop brings them to the type the set was created with, or rejects them.
#[derive(Debug, Clone, PartialEq)]
pub struct IpSetDelta {
    pub id: Id,
    pub added: Vec<Member>,
    pub removed: Vec<Member>,
}

impl Member {
    /// Parse a member whose set type is not known yet, by its shape:
    /// `ip,proto:port`, a CIDR, or an IP.
    pub fn parse_any(s: &str) -> Valid<Self> {
        let ty = if s.contains(',') {
            IpSetType::IpAndPort
        } else if s.contains('/') {
            IpSetType::Net
        } else {
            IpSetType::Ip
        };
        Self::parse(ty, s)
    }
}

/// The longest IP set name the kernel accepts.
pub const MAX_SET_NAME: usize = 31;

/// The longest `--prefix`: every name built on it fits its kernel's
/// limit (checked over every name the managers make by
/// `every_chain_name_fits_with_the_longest_prefix`).
pub const MAX_PREFIX: usize = 7;

/// How the dataplane names its IP sets: `<prefix>40<id>` (IPv4) and
/// `<prefix>60<id>` (IPv6), as Felix does with `cali`; temporary sets for
/// swaps are `<prefix>4t<n>` / `<prefix>6t<n>`. A name over 31 characters
/// becomes `<prefix>40_` + base64url(sha256(id)) cut to fit; so does an id
/// that starts with `_`, so that no id can take the name another id's hash
/// gave (a feeder could otherwise make two sets share one kernel set).
/// Deterministic: the same id always gets the same name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetNames {
    prefix: String,
    /// Names `nft` can parse back (`--dataplane nftables`): an id with a
    /// character nft's identifiers do not take (`:@+=~`, as in Calico's
    /// `s:…` ids) is named by its hash, so `nft list ruleset` output loads
    /// again with `nft -f`.
    nft: bool,
}

/// What an nft identifier may hold after its first letter.
fn nft_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "/-_.".contains(c)
}

impl SetNames {
    /// `prefix` must be 1 to [`MAX_PREFIX`] ASCII letters or digits.
    pub fn new(prefix: &str) -> Valid<Self> {
        if prefix.is_empty()
            || prefix.len() > MAX_PREFIX
            || !prefix.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            return Err(ValidationError::new(
                "prefix",
                format!(
                    "{prefix:?}: the prefix must be 1-{MAX_PREFIX} ASCII letters or digits \
                     (the longest chain name, <prefix>-thfw-<15-character interface>, \
                     must fit iptables' 28 characters)"
                ),
            ));
        }
        Ok(Self {
            prefix: prefix.to_string(),
            nft: false,
        })
    }

    /// The same names, made for nftables (see the field).
    pub fn for_nftables(mut self) -> Self {
        self.nft = true;
        self
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn tag(v: IpVersion) -> &'static str {
        match v {
            IpVersion::V4 => "40",
            IpVersion::V6 => "60",
        }
    }

    /// The kernel name of set `id` in family `v`.
    pub fn name(&self, v: IpVersion, id: &Id) -> String {
        use base64::Engine;
        use sha2::Digest;
        let head = format!("{}{}", self.prefix, Self::tag(v));
        if head.len() + id.as_str().len() <= MAX_SET_NAME
            && !id.as_str().starts_with('_')
            && (!self.nft || id.as_str().chars().all(nft_char))
        {
            return head + id.as_str();
        }
        let digest = sha2::Sha256::digest(id.as_str().as_bytes());
        let hash = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(digest);
        let room = MAX_SET_NAME - head.len() - 1;
        format!("{head}_{}", &hash[..room])
    }

    /// A temporary set of family `v`.
    pub fn temp(&self, v: IpVersion, n: u64) -> String {
        let t = match v {
            IpVersion::V4 => "4t",
            IpVersion::V6 => "6t",
        };
        format!("{}{t}{n}", self.prefix)
    }

    /// Whether `name` is one of ours in family `v` (a set or a temporary).
    pub fn owns(&self, v: IpVersion, name: &str) -> bool {
        let Some(rest) = name.strip_prefix(&self.prefix) else {
            return false;
        };
        match v {
            IpVersion::V4 => rest.starts_with("40") || rest.starts_with("4t"),
            IpVersion::V6 => rest.starts_with("60") || rest.starts_with("6t"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nftables_names_are_ones_nft_parses() {
        let n = SetNames::new("dph").unwrap();
        let id = Id::new("s:abc").unwrap();
        assert_eq!(n.name(IpVersion::V4, &id), "dph40s:abc");
        let nft = n.clone().for_nftables();
        let name = nft.name(IpVersion::V4, &id);
        assert!(
            name.starts_with("dph40_") && name.chars().all(nft_char),
            "{name}"
        );
        let plain = Id::new("all-ipam-pools").unwrap();
        assert_eq!(nft.name(IpVersion::V4, &plain), "dph40all-ipam-pools");
    }

    #[test]
    fn set_names() {
        let n = SetNames::new("dph").unwrap();
        let id = Id::new("s:abc").unwrap();
        assert_eq!(n.name(IpVersion::V4, &id), "dph40s:abc");
        assert_eq!(n.name(IpVersion::V6, &id), "dph60s:abc");
        let long = Id::new("s:this-id-is-far-too-long-for-the-kernel").unwrap();
        let name = n.name(IpVersion::V4, &long);
        assert_eq!(name.len(), MAX_SET_NAME);
        assert!(name.starts_with("dph40_"), "{name}");
        assert_eq!(name, n.name(IpVersion::V4, &long), "deterministic");
        assert_ne!(
            name,
            n.name(
                IpVersion::V4,
                &Id::new("s:this-id-is-far-too-long-for-the-kernel2").unwrap()
            )
        );
        assert!(n.owns(IpVersion::V4, "dph40s:abc"));
        assert!(n.owns(IpVersion::V4, &n.temp(IpVersion::V4, 3)));
        assert!(!n.owns(IpVersion::V6, "dph40s:abc"));
        assert!(!n.owns(IpVersion::V4, "dph-other"));
        assert!(!n.owns(IpVersion::V4, "cali40s:abc"));
        for bad in ["", "dph-x", "a b", "toolongprefix1", "eightchr"] {
            assert!(SetNames::new(bad).is_err(), "{bad:?}");
        }
        assert!(SetNames::new("sevench").is_ok());
    }

    /// Every id, whatever characters of the id charset it holds, names a
    /// set by a valid rule token, within the kernel's length, in both
    /// dataplanes; and no id takes the name another's hash gave.
    #[test]
    fn every_id_names_a_set_that_every_backend_takes() {
        for prefix in ["d", "sevench"] {
            for names in [
                SetNames::new(prefix).unwrap(),
                SetNames::new(prefix).unwrap().for_nftables(),
            ] {
                for b in 0u8..=127 {
                    let c = b as char;
                    let Ok(id) = Id::new(&format!("s{c}x")) else {
                        continue;
                    };
                    for v in [IpVersion::V4, IpVersion::V6] {
                        let name = names.name(v, &id);
                        assert!(name.len() <= MAX_SET_NAME, "{name}");
                        assert!(
                            name.bytes().all(crate::model::is_token_byte),
                            "{c:?}: {name}"
                        );
                        if names.nft {
                            assert!(name.chars().all(nft_char), "{c:?}: {name}");
                        }
                        assert!(names.owns(v, &name));
                    }
                }
                let long = Id::new(&"x".repeat(40)).unwrap();
                let hashed = names.name(IpVersion::V4, &long);
                let tail = hashed.strip_prefix(&format!("{prefix}40")).unwrap();
                let forged = Id::new(tail).unwrap();
                assert_ne!(names.name(IpVersion::V4, &forged), hashed);
            }
        }
    }

    #[test]
    fn members_by_type() {
        assert_eq!(
            Member::parse(IpSetType::Ip, "10.0.0.1")
                .unwrap()
                .to_string(),
            "10.0.0.1"
        );
        assert!(Member::parse(IpSetType::Ip, "10.0.0.0/24").is_err());
        assert_eq!(
            Member::parse(IpSetType::Net, "10.0.0.0/24")
                .unwrap()
                .to_string(),
            "10.0.0.0/24"
        );
        assert_eq!(
            Member::parse(IpSetType::Net, "10.0.0.7")
                .unwrap()
                .to_string(),
            "10.0.0.7/32"
        );
        assert!(Member::parse(IpSetType::Net, "0.0.0.0/0").is_err());
        assert_eq!(
            Member::parse(IpSetType::IpAndPort, "fd00::1,udp:53")
                .unwrap()
                .to_string(),
            "fd00::1,udp:53"
        );
        for bad in [
            "10.0.0.1",
            "10.0.0.1,tcp",
            "10.0.0.1,icmp:1",
            "10.0.0.1,tcp:65536",
            "x,tcp:1",
        ] {
            assert!(Member::parse(IpSetType::IpAndPort, bad).is_err(), "{bad}");
        }
        assert!(Member::parse(IpSetType::Ip, "10.0.0.1\nadd x 1.1.1.1").is_err());
    }

    #[test]
    fn members_by_shape() {
        assert_eq!(
            Member::parse_any("10.1.2.3,tcp:80").unwrap().to_string(),
            "10.1.2.3,tcp:80"
        );
        assert_eq!(
            Member::parse_any("10.1.0.0/16").unwrap().to_string(),
            "10.1.0.0/16"
        );
        assert!(Member::parse_any("10.1.2.3 -exist").is_err());
    }
}
