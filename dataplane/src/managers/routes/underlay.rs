//! This node's side of the underlay: the interfaces and their addresses as
//! the interface monitor reports them, this node's VTEP, the parent
//! interface (Felix's `detectParentIface`) and the VXLAN device to make.

use std::net::IpAddr;

use super::*;

impl RoutesManager {
    pub(super) fn link_holding(&self, ip: IpAddr) -> Option<&LinkInfo> {
        self.links
            .values()
            .find(|l| l.addrs.iter().any(|a| a.addr() == ip))
    }

    pub(super) fn link_named(&self, name: &str) -> Option<&LinkInfo> {
        self.links.values().find(|l| l.name == name)
    }

    pub(super) fn local_vtep(&self) -> Option<&Vtep> {
        self.vteps.get(self.hostname())
    }

    /// (VTEP IP, MAC, parent IP) of a VTEP for one IP version.
    pub(super) fn vtep_addrs(v: &Vtep, ver: IpVersion) -> Option<(IpAddr, MacAddr, IpAddr)> {
        match ver {
            IpVersion::V4 => Some((v.ipv4_addr?, v.mac?, v.parent_device_ip?)),
            IpVersion::V6 => Some((v.ipv6_addr?, v.mac_v6?, v.parent_device_ipv6?)),
        }
    }

    /// The underlay interface for one IP version: the one holding our
    /// VTEP's parent address, else the one holding this node's address
    /// (HostMetadata).
    pub(super) fn parent(&self, ver: IpVersion) -> Option<(&LinkInfo, IpAddr)> {
        if let Some((_, _, ip)) = self.local_vtep().and_then(|v| Self::vtep_addrs(v, ver))
            && let Some(l) = self.link_holding(ip)
        {
            return Some((l, ip));
        }
        let host = self.hosts.get(self.hostname())?;
        let ip = match ver {
            IpVersion::V4 => host.ipv4_addr?,
            IpVersion::V6 => host.ipv6_addr?,
        };
        self.link_holding(ip).map(|l| (l, ip))
    }

    pub(super) fn device_name(ver: IpVersion) -> &'static str {
        match ver {
            IpVersion::V4 => VXLAN_V4,
            IpVersion::V6 => VXLAN_V6,
        }
    }

    /// The VXLAN device for one version: `Ok(None)` = must not exist,
    /// `Err(reason)` = cannot say yet (leave it as it is).
    pub(super) fn vxlan_device(&self, ver: IpVersion) -> Result<Option<VxlanDevice>, String> {
        if !self.vxlan_on(ver) {
            return Ok(None);
        }
        let Some((addr, mac, parent_ip)) = self.local_vtep().and_then(|v| Self::vtep_addrs(v, ver))
        else {
            return Err(format!(
                "waiting for this node's VTEP ({}) with an {} address",
                self.hostname(),
                match ver {
                    IpVersion::V4 => "IPv4",
                    IpVersion::V6 => "IPv6",
                }
            ));
        };
        let Some(parent) = self.link_holding(parent_ip) else {
            return Err(format!(
                "waiting for an interface holding the VTEP parent address {parent_ip}"
            ));
        };
        let (cfg_mtu, overhead) = match ver {
            IpVersion::V4 => (self.cfg.mtu, 50),
            IpVersion::V6 => (self.cfg.mtu_v6, 70),
        };
        let mtu = cfg_mtu.unwrap_or_else(|| parent.mtu.saturating_sub(overhead).max(68));
        Ok(Some(VxlanDevice {
            name: Self::device_name(ver).into(),
            vni: self.cfg.vni,
            port: self.cfg.port,
            mac,
            parent: parent.name.clone(),
            local: parent_ip,
            mtu,
            addr,
        }))
    }
}
