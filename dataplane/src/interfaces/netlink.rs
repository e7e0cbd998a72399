//! rtnetlink implementation of the interface monitor.

use std::net::IpAddr;
use std::time::Duration;

use futures::StreamExt;
use ipnet::IpNet;
use netlink_packet_route::RouteNetlinkMessage;
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkMessage};
use rtnetlink::packet_core::NetlinkPayload;
use rtnetlink::{Handle, MulticastGroup, new_multicast_connection};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::InterfaceEvent;

/// Errors of the interface monitor. All are retryable: the monitor
/// reconnects after a pause.
#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    #[error("opening the rtnetlink socket")]
    Socket(#[source] std::io::Error),
    #[error("dumping {what}")]
    Dump {
        what: &'static str,
        #[source]
        source: rtnetlink::Error,
    },
}

/// Run the monitor until `events` closes. Each `resync` request re-dumps
/// links and addresses (the interface refresh tick). On a netlink error the
/// monitor reconnects and dumps again.
pub async fn run(events: mpsc::Sender<InterfaceEvent>, mut resync: mpsc::Receiver<()>) {
    loop {
        match run_once(&events, &mut resync).await {
            Ok(()) => return, // the loop went away
            Err(e) => {
                warn!(error = %e, "interface monitor failed; reconnecting in 1s");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

async fn run_once(
    events: &mpsc::Sender<InterfaceEvent>,
    resync: &mut mpsc::Receiver<()>,
) -> Result<(), MonitorError> {
    // Subscribe before dumping so no change between the two is missed; a
    // change seen twice is harmless (events are states, not deltas).
    let (conn, handle, mut messages) = new_multicast_connection(&[
        MulticastGroup::Link,
        MulticastGroup::Ipv4Ifaddr,
        MulticastGroup::Ipv6Ifaddr,
    ])
    .map_err(MonitorError::Socket)?;
    let conn_task = tokio::spawn(conn);
    let result = async {
        let n = dump(&handle, events).await?;
        info!(links = n, "interface monitor in sync");
        if events.send(InterfaceEvent::InSync).await.is_err() {
            return Ok(());
        }
        loop {
            tokio::select! {
                msg = messages.next() => {
                    let Some((msg, _)) = msg else {
                        return Err(MonitorError::Socket(std::io::Error::other("multicast socket closed")));
                    };
                    if let NetlinkPayload::InnerMessage(inner) = msg.payload {
                        for ev in translate(inner) {
                            if events.send(ev).await.is_err() {
                                return Ok(());
                            }
                        }
                    }
                }
                r = resync.recv() => {
                    if r.is_none() {
                        return Ok(());
                    }
                    debug!("interface refresh: re-dumping links and addresses");
                    dump(&handle, events).await?;
                }
            }
        }
    }
    .await;
    conn_task.abort();
    result
}

/// Watch route deletions until `events` closes (a socket of its own; a
/// route added is ignored, ours included). An event lost to a full socket
/// buffer costs nothing worse than the route refresh tick: the watcher
/// reconnects.
pub async fn run_route_deletions(events: mpsc::Sender<InterfaceEvent>) {
    loop {
        match watch_routes(&events).await {
            Ok(()) => return,
            Err(e) => {
                warn!(error = %e, "route watcher failed; reconnecting in 1s (the route refresh covers what it missed)");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

async fn watch_routes(events: &mpsc::Sender<InterfaceEvent>) -> Result<(), MonitorError> {
    let (conn, _handle, mut messages) =
        new_multicast_connection(&[MulticastGroup::Ipv4Route, MulticastGroup::Ipv6Route])
            .map_err(MonitorError::Socket)?;
    let conn_task = tokio::spawn(conn);
    let result = async {
        while let Some((msg, _)) = messages.next().await {
            if let NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelRoute(r)) = msg.payload
                && let Some(k) = crate::backends::routes::netlink::from_message(&r)
                && events
                    .send(InterfaceEvent::RouteRemoved(k.key))
                    .await
                    .is_err()
            {
                return Ok(());
            }
        }
        Err(MonitorError::Socket(std::io::Error::other(
            "multicast socket closed",
        )))
    }
    .await;
    conn_task.abort();
    result
}

/// Dump all links, then all addresses; returns the number of links.
async fn dump(
    handle: &Handle,
    events: &mpsc::Sender<InterfaceEvent>,
) -> Result<usize, MonitorError> {
    let mut links = handle.link().get().execute();
    let mut n = 0;
    while let Some(link) = links.next().await {
        let link = link.map_err(|source| MonitorError::Dump {
            what: "links",
            source,
        })?;
        n += 1;
        for ev in translate(RouteNetlinkMessage::NewLink(link)) {
            if events.send(ev).await.is_err() {
                return Ok(n);
            }
        }
    }
    let mut addrs = handle.address().get().execute();
    while let Some(addr) = addrs.next().await {
        let addr = addr.map_err(|source| MonitorError::Dump {
            what: "addresses",
            source,
        })?;
        for ev in translate(RouteNetlinkMessage::NewAddress(addr)) {
            if events.send(ev).await.is_err() {
                return Ok(n);
            }
        }
    }
    Ok(n)
}

fn translate(msg: RouteNetlinkMessage) -> Vec<InterfaceEvent> {
    match msg {
        RouteNetlinkMessage::NewLink(l) => link_name(&l)
            .map(|name| InterfaceEvent::Link {
                index: l.header.index,
                name,
                up: l.header.flags.contains(LinkFlags::Up)
                    && l.header.flags.contains(LinkFlags::Running),
                mtu: l
                    .attributes
                    .iter()
                    .find_map(|a| match a {
                        LinkAttribute::Mtu(m) => Some(*m),
                        _ => None,
                    })
                    .unwrap_or(0),
            })
            .into_iter()
            .collect(),
        RouteNetlinkMessage::DelLink(l) => link_name(&l)
            .map(|name| InterfaceEvent::LinkRemoved {
                index: l.header.index,
                name,
            })
            .into_iter()
            .collect(),
        RouteNetlinkMessage::NewAddress(a) => addr_net(&a)
            .map(|addr| InterfaceEvent::AddrAdded {
                index: a.header.index,
                addr,
            })
            .into_iter()
            .collect(),
        RouteNetlinkMessage::DelAddress(a) => addr_net(&a)
            .map(|addr| InterfaceEvent::AddrRemoved {
                index: a.header.index,
                addr,
            })
            .into_iter()
            .collect(),
        _ => Vec::new(),
    }
}

fn link_name(l: &LinkMessage) -> Option<String> {
    l.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.clone()),
        _ => None,
    })
}

fn addr_net(a: &AddressMessage) -> Option<IpNet> {
    // IFA_LOCAL is the interface's own address on point-to-point links;
    // IFA_ADDRESS is the peer there. Prefer LOCAL, as `ip addr` does.
    let pick = |want_local: bool| {
        a.attributes.iter().find_map(|attr| match attr {
            AddressAttribute::Local(ip) if want_local => Some(*ip),
            AddressAttribute::Address(ip) if !want_local => Some(*ip),
            _ => None,
        })
    };
    let ip: IpAddr = pick(true).or_else(|| pick(false))?;
    IpNet::new(ip, a.header.prefix_len).ok()
}
