//! Workload and host endpoints.

use ipnet::{Ipv4Net, Ipv6Net};
use std::net::IpAddr;

use super::{Id, IfaceName, MacAddr, PolicyId, Valid, ValidationError};

/// `WorkloadEndpointID`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkloadEndpointId {
    pub orchestrator: Id,
    pub workload: Id,
    pub endpoint: Id,
}

impl std::fmt::Display for WorkloadEndpointId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}",
            self.orchestrator, self.workload, self.endpoint
        )
    }
}

/// `HostEndpointID`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostEndpointId(pub Id);

/// Administrative state of a workload endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointState {
    Active,
    /// Anything else Felix may send ("down", "inactive"): traffic is dropped.
    Down,
}

impl EndpointState {
    pub fn parse(s: &str) -> Valid<Self> {
        match s {
            "active" | "" => Ok(Self::Active),
            "down" | "inactive" => Ok(Self::Down),
            other => Err(ValidationError::new(
                "",
                format!("unknown endpoint state {other:?}; expected active, down or inactive"),
            )),
        }
    }
}

/// What happens at the end of a tier when no policy decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TierDefault {
    #[default]
    Deny,
    Pass,
}

impl TierDefault {
    pub fn parse(s: &str) -> Valid<Self> {
        match s.to_ascii_lowercase().as_str() {
            "" | "deny" => Ok(Self::Deny),
            "pass" => Ok(Self::Pass),
            _ => Err(ValidationError::new(
                "",
                format!("unknown tier default action {s:?}; expected Deny or Pass"),
            )),
        }
    }
}

/// `TierInfo`.
#[derive(Debug, Clone, PartialEq)]
pub struct TierInfo {
    pub name: Id,
    pub ingress_policies: Vec<PolicyId>,
    pub egress_policies: Vec<PolicyId>,
    pub default_action: TierDefault,
}

/// `WorkloadEndpoint` (the fields a Linux dataplane acts on).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadEndpoint {
    pub state: EndpointState,
    /// Host-side interface.
    pub name: IfaceName,
    pub mac: Option<MacAddr>,
    pub profile_ids: Vec<Id>,
    pub ipv4_nets: Vec<Ipv4Net>,
    pub ipv6_nets: Vec<Ipv6Net>,
    pub tiers: Vec<TierInfo>,
    /// (external, internal) 1:1 NAT pairs.
    pub ipv4_nat: Vec<(IpAddr, IpAddr)>,
    pub ipv6_nat: Vec<(IpAddr, IpAddr)>,
    pub allow_spoofed_source_prefixes: Vec<ipnet::IpNet>,
}

/// The interface(s) a host endpoint applies to, from its `name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostInterface {
    /// `name` given: that interface.
    Named(IfaceName),
    /// `name` empty: the interface holding one of the expected addresses.
    ByAddress,
    /// `name` is `*`: every host interface that no other host endpoint
    /// claims (workload interfaces and `lo` excepted).
    All,
}

/// `HostEndpoint`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostEndpoint {
    /// Which host interface(s) the endpoint stands for.
    pub interface: HostInterface,
    pub profile_ids: Vec<Id>,
    pub tiers: Vec<TierInfo>,
    pub untracked_tiers: Vec<TierInfo>,
    pub pre_dnat_tiers: Vec<TierInfo>,
    pub forward_tiers: Vec<TierInfo>,
    pub expected_ipv4_addrs: Vec<IpAddr>,
    pub expected_ipv6_addrs: Vec<IpAddr>,
}
