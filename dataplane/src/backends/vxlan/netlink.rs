//! The real [`VxlanSeam`]: rtnetlink in the daemon's namespace, one socket
//! owned by the VXLAN backend (see [`crate::backends::netlink`]).

use std::net::IpAddr;

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{InfoData, InfoVxlan, LinkAttribute, LinkFlags, LinkInfo};
use rtnetlink::{LinkUnspec, LinkVxlan};

use super::{ObservedLink, VxlanOp, VxlanSeam};
use crate::backends::BackendError;
use crate::backends::netlink::{Netlink, errno};
use crate::model::MacAddr;

const ENODEV: i32 = 19;

#[derive(Debug)]
pub struct VxlanNetlink {
    nl: Netlink,
}

impl VxlanNetlink {
    pub fn open() -> Result<Self, BackendError> {
        Ok(Self {
            nl: Netlink::open("vxlan")?,
        })
    }

    fn link_message(
        &self,
        name: &str,
    ) -> Result<Option<netlink_packet_route::link::LinkMessage>, BackendError> {
        let h = self.nl.handle();
        let r: Result<Vec<_>, _> = self
            .nl
            .block_on(h.link().get().match_name(name).execute().try_collect());
        match r {
            Ok(mut v) => Ok(v.pop()),
            Err(e) if errno(&e) == Some(ENODEV) => Ok(None),
            Err(e) => Err(self.nl.error(format!("looking up link {name}"), e)),
        }
    }
}

impl VxlanSeam for VxlanNetlink {
    fn link_index(&mut self, name: &str) -> Result<Option<u32>, BackendError> {
        Ok(self.link_message(name)?.map(|m| m.header.index))
    }

    fn get(&mut self, name: &str) -> Result<Option<ObservedLink>, BackendError> {
        let Some(m) = self.link_message(name)? else {
            return Ok(None);
        };
        let mut o = ObservedLink {
            index: m.header.index,
            up: m.header.flags.contains(LinkFlags::Up),
            ..ObservedLink::default()
        };
        for a in &m.attributes {
            match a {
                LinkAttribute::Mtu(v) => o.mtu = Some(*v),
                LinkAttribute::Address(mac) => {
                    o.mac = <[u8; 6]>::try_from(mac.as_slice()).ok().map(MacAddr)
                }
                LinkAttribute::LinkInfo(infos) => {
                    for i in infos {
                        match i {
                            LinkInfo::Kind(k) => o.kind = k.to_string(),
                            LinkInfo::Data(InfoData::Vxlan(vs)) => {
                                for v in vs {
                                    match v {
                                        InfoVxlan::Id(x) => o.vni = Some(*x),
                                        InfoVxlan::Port(x) => o.port = Some(*x),
                                        InfoVxlan::Link(x) => o.parent = Some(*x),
                                        InfoVxlan::Local(x) => o.local = Some(IpAddr::V4(*x)),
                                        InfoVxlan::Local6(x) => o.local = Some(IpAddr::V6(*x)),
                                        _ => {}
                                    }
                                }
                            }
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        let h = self.nl.handle();
        let addrs: Vec<_> = self
            .nl
            .block_on(
                h.address()
                    .get()
                    .set_link_index_filter(o.index)
                    .execute()
                    .try_collect(),
            )
            .map_err(|e| self.nl.error(format!("listing the addresses of {name}"), e))?;
        for a in addrs {
            // The dump is filtered by index on our side too: older kernels
            // ignore the filter.
            if a.header.index != o.index {
                continue;
            }
            for attr in &a.attributes {
                if let AddressAttribute::Address(ip) = attr
                    && let Ok(n) = IpNet::new(*ip, a.header.prefix_len)
                {
                    o.addrs.push(n);
                }
            }
        }
        Ok(Some(o))
    }

    fn write(&mut self, op: &VxlanOp) -> Result<(), BackendError> {
        let h = self.nl.handle();
        let r = match op {
            VxlanOp::Create { dev, parent_index } => {
                let mut b = LinkVxlan::new(&dev.name, dev.vni)
                    .dev(*parent_index)
                    .port(dev.port)
                    .learning(false);
                b = match dev.local {
                    IpAddr::V4(v4) => b.local(v4),
                    IpAddr::V6(v6) => b.local6(v6),
                };
                let msg = b.mtu(dev.mtu).address(dev.mac.0.to_vec()).build();
                self.nl.block_on(h.link().add(msg).execute())
            }
            VxlanOp::Delete { index, .. } => self.nl.block_on(h.link().del(*index).execute()),
            VxlanOp::SetMtu { index, mtu } => {
                let msg = LinkUnspec::new_with_index(*index).mtu(*mtu).build();
                self.nl.block_on(h.link().set(msg).execute())
            }
            VxlanOp::SetUp { index } => {
                let msg = LinkUnspec::new_with_index(*index).up().build();
                self.nl.block_on(h.link().set(msg).execute())
            }
            VxlanOp::AddAddr { index, addr } => self.nl.block_on(
                h.address()
                    .add(*index, addr.addr(), addr.prefix_len())
                    .replace()
                    .execute(),
            ),
            VxlanOp::DelAddr { index, addr } => {
                let found: Vec<_> = self
                    .nl
                    .block_on(
                        h.address()
                            .get()
                            .set_link_index_filter(*index)
                            .set_address_filter(addr.addr())
                            .execute()
                            .try_collect(),
                    )
                    .map_err(|e| self.nl.error(format!("{op:?}"), e))?;
                let mut r = Ok(());
                for m in found {
                    if m.header.index == *index && m.header.prefix_len == addr.prefix_len() {
                        r = self.nl.block_on(h.address().del(m).execute());
                    }
                }
                r
            }
        };
        r.map_err(|e| self.nl.error(format!("{op:?}"), e))
    }
}
