//! Sets of networks as nf_tables interval sets. The kernel holds an
//! interval set as disjoint ranges and refuses overlapping ones, so the
//! calc graph's CIDRs (which may nest or touch: 10.0.0.0/8 and
//! 10.1.0.0/16) are merged here into ranges, and a change is written as
//! the ranges that went and the ranges that came — never by reading the
//! whole set back, which is what makes `nft` 1.0.6 take seconds at a
//! million elements.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;

/// `[start, end)`; `end` `None`: up to the top of the address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Range {
    pub start: IpAddr,
    pub end: Option<IpAddr>,
}

fn to_u128(a: IpAddr) -> u128 {
    match a {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

fn from_u128(v: u128, like: IpAddr) -> IpAddr {
    match like {
        IpAddr::V4(_) => IpAddr::from(std::net::Ipv4Addr::from(v as u32)),
        IpAddr::V6(_) => IpAddr::from(std::net::Ipv6Addr::from(v)),
    }
}

/// The nets of one IP version as disjoint, non-touching ranges, in order.
pub fn ranges(nets: &BTreeSet<IpNet>) -> Vec<Range> {
    // [start, last] inclusive, as integers.
    let mut spans: Vec<(u128, u128, IpAddr)> = nets
        .iter()
        .map(|n| {
            let n = n.trunc();
            (to_u128(n.network()), to_u128(n.broadcast()), n.network())
        })
        .collect();
    spans.sort();
    let mut merged: Vec<(u128, u128, IpAddr)> = Vec::new();
    for (s, e, like) in spans {
        match merged.last_mut() {
            // Overlapping or touching: one range.
            Some(last) if s <= last.1.saturating_add(1) => last.1 = last.1.max(e),
            _ => merged.push((s, e, like)),
        }
    }
    merged
        .into_iter()
        .map(|(s, e, like)| {
            let top = match like {
                IpAddr::V4(_) => u128::from(u32::MAX),
                IpAddr::V6(_) => u128::MAX,
            };
            Range {
                start: from_u128(s, like),
                end: (e < top).then(|| from_u128(e + 1, like)),
            }
        })
        .collect()
}

/// What to write to go from ranges `have` to `want`: (removed, added).
pub fn diff(have: &[Range], want: &[Range]) -> (Vec<Range>, Vec<Range>) {
    let have: BTreeSet<&Range> = have.iter().collect();
    let want: BTreeSet<&Range> = want.iter().collect();
    (
        have.difference(&want).map(|r| **r).collect(),
        want.difference(&have).map(|r| **r).collect(),
    )
}

/// Ranges back from an interval set's elements as the kernel lists them:
/// (key, is an interval end), in any order.
pub fn from_elements(mut elements: Vec<(IpAddr, bool)>) -> Vec<Range> {
    elements.sort_by_key(|(a, end)| (to_u128(*a), !*end));
    let mut out = Vec::new();
    let mut open: Option<IpAddr> = None;
    for (a, end) in elements {
        match (end, open) {
            (false, None) => open = Some(a),
            (false, Some(s)) => {
                // A start right after an open one: the earlier ran to here.
                out.push(Range {
                    start: s,
                    end: Some(a),
                });
                open = Some(a);
            }
            (true, Some(s)) => {
                out.push(Range {
                    start: s,
                    end: Some(a),
                });
                open = None;
            }
            // The kernel's own leading end marker: nothing to close.
            (true, None) => {}
        }
    }
    if let Some(s) = open {
        out.push(Range {
            start: s,
            end: None,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(v: &[&str]) -> BTreeSet<IpNet> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn r(s: &str, e: Option<&str>) -> Range {
        Range {
            start: s.parse().unwrap(),
            end: e.map(|e| e.parse().unwrap()),
        }
    }

    #[test]
    fn nested_and_touching_nets_merge() {
        assert_eq!(
            ranges(&nets(&[
                "10.1.2.0/24",
                "10.0.0.0/24",
                "10.0.1.0/24",
                "10.1.0.0/16",
                "192.168.0.7/32",
                "255.255.255.0/24",
            ])),
            [
                r("10.0.0.0", Some("10.0.2.0")),
                r("10.1.0.0", Some("10.2.0.0")),
                r("192.168.0.7", Some("192.168.0.8")),
                r("255.255.255.0", None),
            ]
        );
        assert_eq!(
            ranges(&nets(&["fd00::/64", "fd00::1/128", "::/0"])),
            [r("::", None)]
        );
    }

    #[test]
    fn a_change_is_the_ranges_that_went_and_came() {
        let before = ranges(&nets(&["10.0.0.0/24", "10.5.0.0/16"]));
        let after = ranges(&nets(&["10.0.0.0/24", "10.0.1.0/24", "10.5.0.0/16"]));
        let (gone, came) = diff(&before, &after);
        assert_eq!(gone, [r("10.0.0.0", Some("10.0.1.0"))]);
        assert_eq!(came, [r("10.0.0.0", Some("10.0.2.0"))]);
    }

    #[test]
    fn elements_read_back_as_ranges() {
        let a = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            from_elements(vec![
                (a("10.1.0.0"), false),
                (a("0.0.0.0"), true),
                (a("10.0.2.0"), true),
                (a("10.0.0.0"), false),
                (a("10.2.0.0"), true),
                (a("255.255.255.0"), false),
            ]),
            [
                r("10.0.0.0", Some("10.0.2.0")),
                r("10.1.0.0", Some("10.2.0.0")),
                r("255.255.255.0", None),
            ]
        );
    }
}
