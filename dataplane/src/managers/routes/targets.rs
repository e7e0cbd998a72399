//! What a `RouteUpdate` becomes: which pools' routes are ours to program,
//! and the route for one update (VXLAN tunnel, same-subnet, no-encap, IPIP,
//! blackhole), or why there is none yet.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::*;

impl RoutesManager {
    pub(super) fn vxlan_on(&self, v: IpVersion) -> bool {
        self.cfg.vxlan.on(&self.encap, v, self.cfg.ipv6)
    }

    /// Whether routes of this pool type are ours to program.
    pub(super) fn pool_on(&self, pool: i32, v: IpVersion) -> bool {
        match pool {
            POOL_VXLAN => self.vxlan_on(v),
            POOL_NO_ENCAP => self.encap.no_encap_enabled,
            POOL_IPIP => {
                self.ipip_override.unwrap_or(self.encap.ipip_enabled) && v == IpVersion::V4
            }
            _ => false,
        }
    }

    pub(super) fn target(
        &self,
        class: RouteClass,
        dev: &str,
        gateway: Option<IpAddr>,
        protocol: u8,
        mtu: Option<u32>,
    ) -> RouteTarget {
        RouteTarget {
            class,
            kind: RouteKind::Unicast,
            dev: Some(dev.into()),
            gateway,
            onlink: gateway.is_some(),
            protocol,
            mtu,
        }
    }

    /// The route for one RouteUpdate, or why there is none.
    pub(super) fn route_for(
        &self,
        r: &Route,
        devices: &BTreeMap<IpVersion, VxlanDevice>,
        own: &[IpNet],
    ) -> Result<Option<RouteTarget>, String> {
        let ver = version_of(&r.dst);
        if !self.pool_on(r.ip_pool_type, ver) {
            return Ok(None);
        }
        // Refused when it came; the node's addresses may have changed
        // since.
        if let Some(why) = crate::managers::hosts::covers_host(&r.dst, own) {
            return Err(format!("{why}: no route a feeder asks for may"));
        }
        let rp = self.cfg.route_protocol;
        if is_type(r, LOCAL_WORKLOAD) {
            if r.local_workload || is_host_prefix(&r.dst) {
                return Ok(None); // a workload's own route: endpoints manager
            }
            return Ok(Some(RouteTarget {
                class: RouteClass::Blackhole,
                kind: RouteKind::Blackhole,
                dev: None,
                gateway: None,
                onlink: false,
                protocol: rp,
                mtu: None,
            }));
        }
        let remote_tunnel =
            is_type(r, REMOTE_TUNNEL) && (is_type(r, REMOTE_WORKLOAD) || r.borrowed);
        if !is_type(r, REMOTE_WORKLOAD) && !remote_tunnel {
            return Ok(None);
        }
        // The parent as of the last look at the interfaces (kept current by
        // `on_interface` and every full pass): not searched per route.
        let parent = match ver {
            IpVersion::V4 => self.underlay.0.as_ref(),
            IpVersion::V6 => self.underlay.1.as_ref(),
        }
        .map(|(name, _, _)| name.as_str());
        match r.ip_pool_type {
            POOL_VXLAN => {
                if r.same_subnet
                    && let (Some(gw), Some(p)) = (r.dst_node_ip, parent)
                {
                    return Ok(Some(self.target(
                        RouteClass::VxlanSameSubnet,
                        p,
                        Some(gw),
                        rp,
                        None,
                    )));
                }
                let Some(dev) = devices.get(&ver) else {
                    return Err(format!("{}: no VXLAN device yet", r.dst));
                };
                let dp = self.cfg.device_protocol;
                if remote_tunnel {
                    return Ok(Some(self.target(
                        RouteClass::VxlanTunnel,
                        &dev.name,
                        None,
                        dp,
                        Some(dev.mtu),
                    )));
                }
                let node = r.dst_node_name.as_ref().map(Id::as_str).unwrap_or("");
                let vtep = self.vteps.get(node).and_then(|v| Self::vtep_addrs(v, ver));
                let Some((gw, _, _)) = vtep else {
                    return Err(format!("{}: waiting for the VTEP of node {node:?}", r.dst));
                };
                Ok(Some(self.target(
                    RouteClass::VxlanTunnel,
                    &dev.name,
                    Some(gw),
                    dp,
                    Some(dev.mtu),
                )))
            }
            POOL_NO_ENCAP => {
                let (Some(gw), Some(p)) = (r.dst_node_ip, parent) else {
                    return Err(format!(
                        "{}: no-encap route needs dst_node_ip and this node's interface",
                        r.dst
                    ));
                };
                Ok(Some(self.target(
                    RouteClass::NoEncap,
                    p,
                    Some(gw),
                    rp,
                    None,
                )))
            }
            POOL_IPIP => {
                let Some(gw) = r.dst_node_ip else {
                    return Err(format!("{}: IPIP route without dst_node_ip", r.dst));
                };
                if r.same_subnet
                    && let Some(p) = parent
                {
                    return Ok(Some(self.target(
                        RouteClass::IpipSameSubnet,
                        p,
                        Some(gw),
                        rp,
                        None,
                    )));
                }
                if !self.underlay.2 {
                    return Err(format!(
                        "{}: IPIP needs {IPIP_DEVICE}, which this kernel does not have (no ipip module)",
                        r.dst
                    ));
                }
                Ok(Some(self.target(
                    RouteClass::IpipTunnel,
                    IPIP_DEVICE,
                    Some(gw),
                    rp,
                    None,
                )))
            }
            _ => Ok(None),
        }
    }
}
