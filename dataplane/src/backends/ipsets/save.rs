//! Reading `ipset save` output: `create NAME TYPE family F hashsize N
//! maxelem N …` and `add NAME MEMBER` lines. Only the sets `ours` accepts
//! are kept; every other line is skipped unread.

use std::collections::HashMap;

use super::{KernelSet, Meta};
use crate::model::ipsets::{IpSetType, Member};

fn set_type(t: &str) -> Option<IpSetType> {
    match t {
        "hash:ip" => Some(IpSetType::Ip),
        "hash:net" => Some(IpSetType::Net),
        "hash:ip,port" => Some(IpSetType::IpAndPort),
        _ => None,
    }
}

/// Our sets in `text`. A set of a type we do not program, or a member we
/// cannot read, makes the set's `meta` `None` (so it is rebuilt).
pub fn parse(
    text: &str,
    ours: impl Fn(&str) -> bool,
) -> Result<HashMap<String, KernelSet>, String> {
    let mut sets: HashMap<String, KernelSet> = HashMap::new();
    let mut types: HashMap<String, Option<IpSetType>> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let mut words = line.split_whitespace();
        let (Some(verb), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        if !ours(name) {
            continue;
        }
        match verb {
            "create" => {
                let ty = words.next().and_then(set_type);
                let mut maxelem = None;
                while let Some(k) = words.next() {
                    if k == "maxelem" {
                        maxelem = words.next().and_then(|v| v.parse().ok());
                    }
                }
                let meta = match (ty, maxelem) {
                    (Some(set_type), Some(maxelem)) => Some(Meta { set_type, maxelem }),
                    _ => None,
                };
                types.insert(name.to_string(), meta.map(|m| m.set_type));
                sets.insert(
                    name.to_string(),
                    KernelSet {
                        meta,
                        members: Default::default(),
                    },
                );
            }
            "add" => {
                let Some(set) = sets.get_mut(name) else {
                    return Err(format!("line {}: add to {name} before its create", i + 1));
                };
                let Some(Some(ty)) = types.get(name) else {
                    continue;
                };
                let text = words.next().unwrap_or_default();
                match Member::parse(*ty, text) {
                    Ok(m) => {
                        set.members.insert(m);
                    }
                    // Something we would not write: rebuild the set.
                    Err(_) => set.meta = None,
                }
            }
            _ => {}
        }
    }
    Ok(sets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ours_only() {
        let text = "\
create dph40a hash:ip family inet hashsize 1024 maxelem 1048576 bucketsize 12 initval 0x1
add dph40a 10.0.0.1
add dph40a 10.0.0.2
create foreign hash:ip family inet hashsize 1024 maxelem 65536
add foreign 1.1.1.1
create dph40n hash:net family inet hashsize 1024 maxelem 10
add dph40n 10.0.0.7
add dph40n 10.1.0.0/16
create dph40p hash:ip,port family inet hashsize 1024 maxelem 10
add dph40p 10.0.0.1,tcp:80
create dph40m hash:mac hashsize 1024 maxelem 10
add dph40m 00:11:22:33:44:55
";
        let sets = parse(text, |n| n.starts_with("dph40")).unwrap();
        assert_eq!(sets.len(), 4);
        assert!(!sets.contains_key("foreign"));
        let a = &sets["dph40a"];
        assert_eq!(
            a.meta,
            Some(Meta {
                set_type: IpSetType::Ip,
                maxelem: 1_048_576
            })
        );
        assert_eq!(a.members.len(), 2);
        let n = &sets["dph40n"];
        assert!(
            n.members
                .contains(&Member::parse(IpSetType::Net, "10.0.0.7/32").unwrap())
        );
        assert!(
            n.members
                .contains(&Member::parse(IpSetType::Net, "10.1.0.0/16").unwrap())
        );
        assert_eq!(sets["dph40p"].members.len(), 1);
        assert_eq!(sets["dph40m"].meta, None, "a type we do not program");
    }
}
