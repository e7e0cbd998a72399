//! The real [`IpRuleSeam`]: rtnetlink in the daemon's namespace, one socket
//! owned by the rules backend (see [`crate::backends::netlink`]).

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::AddressFamily;
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleFlags, RuleMessage};
use rtnetlink::IpVersion;

use super::IpRuleSeam;
use crate::backends::BackendError;
use crate::backends::netlink::{Netlink, errno};
use crate::model::routes::IpRule;

const ENOENT: i32 = 2;

#[derive(Debug)]
pub struct IpRuleNetlink {
    nl: Netlink,
}

impl IpRuleNetlink {
    pub fn open() -> Result<Self, BackendError> {
        Ok(Self {
            nl: Netlink::open("rules")?,
        })
    }
}

/// Ours in our terms; `None` for what we never write (other actions,
/// interface or port matches, ...): such a rule is never taken for ours.
fn from_message(m: &RuleMessage) -> Option<IpRule> {
    if m.header.action != RuleAction::ToTable {
        return None;
    }
    let mut r = IpRule {
        v6: m.header.family == AddressFamily::Inet6,
        priority: 0,
        fwmark: None,
        invert: m.header.flags.contains(RuleFlags::Invert),
        src: None,
        table: u32::from(m.header.table),
    };
    let (mut mark, mut mask) = (None, None);
    for a in &m.attributes {
        match a {
            RuleAttribute::Priority(p) => r.priority = *p,
            RuleAttribute::Table(t) => r.table = *t,
            RuleAttribute::FwMark(v) => mark = Some(*v),
            RuleAttribute::FwMask(v) => mask = Some(*v),
            RuleAttribute::Source(ip) => r.src = IpNet::new(*ip, m.header.src_len).ok(),
            RuleAttribute::Destination(_)
            | RuleAttribute::Iifname(_)
            | RuleAttribute::Oifname(_)
            | RuleAttribute::IpProtocol(_)
            | RuleAttribute::SourcePortRange(_)
            | RuleAttribute::DestinationPortRange(_)
            | RuleAttribute::UidRange(_) => return None,
            _ => {}
        }
    }
    if let Some(mark) = mark {
        r.fwmark = Some((mark, mask.unwrap_or(u32::MAX)));
    }
    Some(r)
}

fn to_message(r: &IpRule) -> RuleMessage {
    let mut m = RuleMessage::default();
    m.header.family = if r.v6 {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    // Not the crate's default (Unspec): that makes `lookup N none`, a rule
    // that routes nothing (toolchain.md).
    m.header.action = RuleAction::ToTable;
    m.header.table = u8::try_from(r.table).unwrap_or(0);
    if r.invert {
        m.header.flags |= RuleFlags::Invert;
    }
    m.attributes.push(RuleAttribute::Table(r.table));
    m.attributes.push(RuleAttribute::Priority(r.priority));
    if let Some((mark, mask)) = r.fwmark {
        m.attributes.push(RuleAttribute::FwMark(mark));
        m.attributes.push(RuleAttribute::FwMask(mask));
    }
    if let Some(src) = r.src {
        m.header.src_len = src.prefix_len();
        m.attributes.push(RuleAttribute::Source(src.addr()));
    }
    m
}

impl IpRuleSeam for IpRuleNetlink {
    fn rules(&mut self) -> Result<Vec<IpRule>, BackendError> {
        let mut out = Vec::new();
        for v in [IpVersion::V4, IpVersion::V6] {
            let h = self.nl.handle();
            let msgs: Vec<RuleMessage> = self
                .nl
                .block_on(h.rule().get(v).execute().try_collect())
                .map_err(|e| self.nl.error("dumping ip rules", e))?;
            out.extend(msgs.iter().filter_map(from_message));
        }
        Ok(out)
    }

    fn add(&mut self, rule: &IpRule) -> Result<(), BackendError> {
        let h = self.nl.handle();
        let mut req = h.rule().add();
        *req.message_mut() = to_message(rule);
        self.nl
            .block_on(req.execute())
            .map_err(|e| self.nl.error(format!("adding {rule:?}"), e))
    }

    fn delete(&mut self, rule: &IpRule) -> Result<(), BackendError> {
        let h = self.nl.handle();
        match self.nl.block_on(h.rule().del(to_message(rule)).execute()) {
            Err(e) if errno(&e) == Some(ENOENT) => Ok(()), // already gone
            r => r.map_err(|e| self.nl.error(format!("deleting {rule:?}"), e)),
        }
    }
}
