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

#[cfg(test)]
mod tests {
    use super::*;

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
