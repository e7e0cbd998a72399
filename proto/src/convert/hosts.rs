//! A host's metadata as master's Felix sends it (whole) and as a released
//! Felix sends it (in three pieces), put together per stream by
//! [`super::Converter`].

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use dphandler_dataplane::model::network::HostMetadata;
use dphandler_dataplane::model::{Id, Key, Update, Valid, ValidationError};

use super::{at, host_addr, id, labels, v4, v6};
use crate::felix::to_dataplane::Payload;

/// The update of one host (or of one released piece of it) from its
/// fields, an empty string for an absent one; errors within `field`.
pub(super) fn update(
    hostname: &str,
    ipv4_addr: &str,
    ipv6_addr: &str,
    asnumber: &str,
    host_labels: &HashMap<String, String>,
    field: &str,
) -> Valid<Update> {
    at(
        host(hostname, ipv4_addr, ipv6_addr, asnumber, host_labels).map(Update::HostMetadata),
        field,
    )
}

/// The removal of a host (or of one released piece of it).
pub(super) fn remove(hostname: &str, field: &str) -> Valid<Update> {
    Ok(Update::Remove(Key::HostMetadata(at(
        id(hostname, "hostname"),
        field,
    )?)))
}

/// One host from its fields (an empty string is an absent field).
fn host(
    hostname: &str,
    ipv4_addr: &str,
    ipv6_addr: &str,
    asnumber: &str,
    host_labels: &HashMap<String, String>,
) -> Valid<HostMetadata> {
    Ok(HostMetadata {
        hostname: id(hostname, "hostname")?,
        ipv4_addr: at(host_addr(ipv4_addr).and_then(v4), "ipv4_addr")?,
        ipv6_addr: at(host_addr(ipv6_addr).and_then(v6), "ipv6_addr")?,
        asnumber: if asnumber.is_empty() {
            None
        } else {
            Some(asnumber.parse().map_err(|_| {
                ValidationError::new("asnumber", format!("{asnumber:?} is not an AS number"))
            })?)
        },
        labels: labels(host_labels, "labels")?,
    })
}

/// Which piece of a host a message sets or removes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Piece {
    /// `HostMetadataUpdate`/`Remove`: master's whole host, or a released
    /// Felix's IPv4 address (the Node's BGP address, else its first
    /// internal or external one).
    Base,
    /// `HostMetadataV6Update`/`Remove` (released): the IPv6 address, found
    /// as for IPv4.
    V6,
    /// `HostMetadataV4V6Update`/`Remove` (released): the Node's BGP
    /// addresses (empty without BGP), AS number and labels.
    Whole,
}

impl Piece {
    pub(super) fn of(p: &Payload) -> Option<Self> {
        match p {
            Payload::HostMetadataUpdate(_) | Payload::HostMetadataRemove(_) => Some(Self::Base),
            Payload::HostMetadataV6Update(_) | Payload::HostMetadataV6Remove(_) => Some(Self::V6),
            Payload::HostMetadataV4v6Update(_) | Payload::HostMetadataV4v6Remove(_) => {
                Some(Self::Whole)
            }
            _ => None,
        }
    }
}

#[derive(Debug, Default)]
struct Held {
    base: Option<HostMetadata>,
    v6: Option<Option<IpAddr>>,
    whole: Option<HostMetadata>,
}

impl Held {
    fn is_empty(&self) -> bool {
        self.base.is_none() && self.v6.is_none() && self.whole.is_none()
    }

    /// The host as its pieces make it: an address of the BGP spec over the
    /// one found otherwise, the v6 piece over the base's (master's) IPv6.
    fn host(&self, hostname: &Id) -> HostMetadata {
        let base = self.base.as_ref();
        let whole = self.whole.as_ref();
        HostMetadata {
            hostname: hostname.clone(),
            ipv4_addr: whole
                .and_then(|w| w.ipv4_addr)
                .or_else(|| base.and_then(|b| b.ipv4_addr)),
            ipv6_addr: whole
                .and_then(|w| w.ipv6_addr)
                .or(self.v6.flatten())
                .or_else(|| base.and_then(|b| b.ipv6_addr)),
            asnumber: whole
                .and_then(|w| w.asnumber)
                .or_else(|| base.and_then(|b| b.asnumber)),
            labels: whole.or(base).map(|h| h.labels.clone()).unwrap_or_default(),
        }
    }
}

/// Every host's pieces, as received so far on one stream.
#[derive(Debug, Default)]
pub(super) struct Pieces {
    hosts: BTreeMap<Id, Held>,
}

impl Pieces {
    /// Takes one piece's converted update (the piece alone) and gives the
    /// host as it now stands, or its removal once it has no piece left.
    pub(super) fn merge(&mut self, piece: Piece, update: Update) -> Update {
        let (hostname, set) = match update {
            Update::HostMetadata(h) => (h.hostname.clone(), Some(h)),
            Update::Remove(Key::HostMetadata(hostname)) => (hostname, None),
            other => return other,
        };
        let held = self.hosts.entry(hostname.clone()).or_default();
        match piece {
            Piece::Base => held.base = set,
            Piece::V6 => held.v6 = set.map(|h| h.ipv6_addr),
            Piece::Whole => held.whole = set,
        }
        if held.is_empty() {
            self.hosts.remove(&hostname);
            Update::Remove(Key::HostMetadata(hostname))
        } else {
            Update::HostMetadata(held.host(&hostname))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Converter;
    use crate::felix::{self, to_dataplane::Payload};
    use dphandler_dataplane::model::{Id, Key, Update};

    fn send(c: &mut Converter, p: Payload) -> Update {
        c.convert(felix::ToDataplane {
            sequence_number: 1,
            payload: Some(p),
        })
        .expect("accepted")
        .expect("an update")
    }

    fn v4(host: &str, addr: &str) -> Payload {
        Payload::HostMetadataUpdate(felix::HostMetadataUpdate {
            hostname: host.into(),
            ipv4_addr: addr.into(),
            ..Default::default()
        })
    }

    fn v6(host: &str, addr: &str) -> Payload {
        Payload::HostMetadataV6Update(felix::HostMetadataV6Update {
            hostname: host.into(),
            ipv6_addr: addr.into(),
        })
    }

    fn whole(host: &str, a4: &str, a6: &str) -> Payload {
        Payload::HostMetadataV4v6Update(felix::HostMetadataV4v6Update {
            hostname: host.into(),
            ipv4_addr: a4.into(),
            ipv6_addr: a6.into(),
            asnumber: "64512".into(),
            labels: [("rack".to_string(), "r1".to_string())].into(),
        })
    }

    fn addrs(u: &Update) -> (Option<String>, Option<String>) {
        let Update::HostMetadata(h) = u else {
            panic!("not a host: {u:?}")
        };
        (
            h.ipv4_addr.map(|a| a.to_string()),
            h.ipv6_addr.map(|a| a.to_string()),
        )
    }

    fn some(a: &str, b: &str) -> (Option<String>, Option<String>) {
        (
            (!a.is_empty()).then(|| a.to_string()),
            (!b.is_empty()).then(|| b.to_string()),
        )
    }

    #[test]
    fn a_released_felixs_pieces_make_one_host() {
        // The order a released Felix flushes them in: v4, v6, whole.
        let mut c = Converter::default();
        assert_eq!(
            addrs(&send(&mut c, v4("n1", "10.0.0.1"))),
            some("10.0.0.1", "")
        );
        assert_eq!(
            addrs(&send(&mut c, v6("n1", "fd00::1"))),
            some("10.0.0.1", "fd00::1"),
            "the IPv6 piece keeps the IPv4 address"
        );
        let u = send(&mut c, whole("n1", "", ""));
        assert_eq!(
            addrs(&u),
            some("10.0.0.1", "fd00::1"),
            "no BGP spec: found addresses stand"
        );
        let Update::HostMetadata(h) = u else {
            unreachable!()
        };
        assert_eq!(h.asnumber, Some(64512));
        assert_eq!(h.labels, vec![("rack".into(), "r1".into())]);
        // The BGP spec's addresses come first.
        assert_eq!(
            addrs(&send(&mut c, whole("n1", "10.0.9.1/24", "fd00::9/64"))),
            some("10.0.9.1", "fd00::9")
        );
        // A piece removed leaves the others.
        let rm6 = Payload::HostMetadataV6Remove(felix::HostMetadataV6Remove {
            hostname: "n1".into(),
            ..Default::default()
        });
        let rm_whole = Payload::HostMetadataV4v6Remove(felix::HostMetadataV4v6Remove {
            hostname: "n1".into(),
            ..Default::default()
        });
        assert_eq!(
            addrs(&send(&mut c, rm_whole)),
            some("10.0.0.1", "fd00::1"),
            "the found addresses stand without the BGP spec"
        );
        assert_eq!(addrs(&send(&mut c, rm6)), some("10.0.0.1", ""));
        let rm4 = Payload::HostMetadataRemove(felix::HostMetadataRemove {
            hostname: "n1".into(),
            ..Default::default()
        });
        assert_eq!(
            send(&mut c, rm4),
            Update::Remove(Key::HostMetadata(Id::new("n1").unwrap())),
            "the last piece gone removes the host"
        );
    }

    #[test]
    fn masters_whole_host_is_passed_as_it_is() {
        let mut c = Converter::default();
        let u = send(
            &mut c,
            Payload::HostMetadataUpdate(felix::HostMetadataUpdate {
                hostname: "n2".into(),
                ipv4_addr: "10.0.0.2/24".into(),
                ipv6_addr: "fd00::2/64".into(),
                asnumber: "65000".into(),
                labels: [("a".to_string(), "b".to_string())].into(),
            }),
        );
        let Update::HostMetadata(h) = &u else {
            panic!()
        };
        assert_eq!(addrs(&u), some("10.0.0.2", "fd00::2"));
        assert_eq!(h.asnumber, Some(65000));
        assert_eq!(h.labels, vec![("a".into(), "b".into())]);
        let rm = Payload::HostMetadataRemove(felix::HostMetadataRemove {
            hostname: "n2".into(),
            ..Default::default()
        });
        assert!(matches!(
            send(&mut c, rm),
            Update::Remove(Key::HostMetadata(_))
        ));
    }

    #[test]
    fn each_released_form_is_validated() {
        let mut c = Converter::default();
        for (p, field) in [
            (v6("n1", "10.0.0.1"), "host_metadata_v6_update.ipv6_addr"),
            (
                whole("n1", "fd00::1/64", ""),
                "host_metadata_v4v6_update.ipv4_addr",
            ),
            (whole("", "", ""), "host_metadata_v4v6_update.hostname"),
        ] {
            let e = c
                .convert(felix::ToDataplane {
                    sequence_number: 9,
                    payload: Some(p),
                })
                .expect_err("rejected");
            assert_eq!(e.error.field, field);
        }
    }
}
