//! Host metadata, IPAM pools, routes, VXLAN, WireGuard, services.

use std::net::IpAddr;

use ipnet::IpNet;

use super::{Id, MacAddr};

/// `HostMetadataUpdate`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostMetadata {
    pub hostname: Id,
    pub ipv4_addr: Option<IpAddr>,
    pub ipv6_addr: Option<IpAddr>,
    pub asnumber: Option<u32>,
    pub labels: Vec<(String, String)>,
}

/// `IPAMPool`.
#[derive(Debug, Clone, PartialEq)]
pub struct IpamPool {
    pub cidr: IpNet,
    pub masquerade: bool,
    pub ipip_mode: EncapMode,
    pub vxlan_mode: EncapMode,
    pub allowed_uses: Vec<Id>,
}

/// IPIP/VXLAN mode of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EncapMode {
    #[default]
    Never,
    Always,
    CrossSubnet,
}

impl EncapMode {
    pub fn parse(s: &str) -> super::Valid<Self> {
        match s.to_ascii_lowercase().as_str() {
            "" | "never" => Ok(Self::Never),
            "always" => Ok(Self::Always),
            "crosssubnet" => Ok(Self::CrossSubnet),
            _ => Err(super::ValidationError::new(
                "",
                format!("unknown encapsulation mode {s:?}; expected Never, Always or CrossSubnet"),
            )),
        }
    }
}

/// `RouteUpdate`.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Bitmask of `RouteType` values.
    pub types: u32,
    pub ip_pool_type: i32,
    pub dst: IpNet,
    pub dst_node_name: Option<Id>,
    pub dst_node_ip: Option<IpAddr>,
    pub same_subnet: bool,
    pub nat_outgoing: bool,
    pub local_workload: bool,
    pub ipip: bool,
    pub vxlan: bool,
    pub wireguard: bool,
    pub borrowed: bool,
}

/// `VXLANTunnelEndpointUpdate`.
#[derive(Debug, Clone, PartialEq)]
pub struct Vtep {
    pub node: Id,
    pub mac: Option<MacAddr>,
    pub ipv4_addr: Option<IpAddr>,
    pub parent_device_ip: Option<IpAddr>,
    pub mac_v6: Option<MacAddr>,
    pub ipv6_addr: Option<IpAddr>,
    pub parent_device_ipv6: Option<IpAddr>,
}

/// `WireguardEndpointUpdate` / `WireguardEndpointV6Update`.
#[derive(Debug, Clone, PartialEq)]
pub struct WireguardEndpoint {
    pub hostname: Id,
    /// 32-byte Curve25519 public key; `None` when the peer has none yet.
    pub public_key: Option<[u8; 32]>,
    pub interface_addr: Option<IpAddr>,
}

/// `Encapsulation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Encapsulation {
    pub ipip_enabled: bool,
    pub vxlan_enabled: bool,
    pub vxlan_enabled_v6: bool,
    pub no_encap_enabled: bool,
}

/// `GlobalBGPConfigUpdate`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GlobalBgpConfig {
    pub service_cluster_cidrs: Vec<IpNet>,
    pub service_external_cidrs: Vec<IpNet>,
    pub service_loadbalancer_cidrs: Vec<IpNet>,
    pub local_workload_peering_ip_v4: Option<IpAddr>,
    pub local_workload_peering_ip_v6: Option<IpAddr>,
}

/// `ServiceUpdate`.
#[derive(Debug, Clone, PartialEq)]
pub struct Service {
    pub name: Id,
    pub namespace: Id,
    pub service_type: Option<Id>,
    pub cluster_ips: Vec<IpAddr>,
    pub loadbalancer_ip: Option<IpAddr>,
    pub external_ips: Vec<IpAddr>,
    pub loadbalancer_ingress_ips: Vec<IpAddr>,
    /// (protocol, port, node port)
    pub ports: Vec<(super::Protocol, u16, u16)>,
}
