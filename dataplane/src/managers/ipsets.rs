//! The IP-set manager: the calc graph's IP sets (IPSetUpdate, IPSetDelta,
//! IPSetRemove), split by family into the v4 and v6 backend objects
//! ([`crate::backends::ipsets::IpSets`]). Every set id gets a set in each
//! family the dataplane programs (rules of either family may reference it),
//! holding that family's members. No I/O here.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::{Manager, ManagerError};
use crate::backends::DesiredKernel;
use crate::backends::ipsets::Meta;
use crate::model::ipsets::{IpSetType, Member};
use crate::model::{Id, IpVersion, Key, Update, ValidationError};

/// Felix's default `MaxIpsetSize`.
pub const DEFAULT_MAX_SIZE: u32 = 1_048_576;

/// Most members over all of the calc graph's sets together, unless set
/// (ten times the policy benchmark's 1,000,000).
pub const DEFAULT_MAX_MEMBERS: usize = 10_000_000;

#[derive(Debug)]
struct DesiredSet {
    set_type: IpSetType,
    members: HashSet<Member>,
}

impl DesiredSet {
    fn count(&self, v: IpVersion) -> usize {
        self.members.iter().filter(|m| m.version() == v).count()
    }
}

#[derive(Debug)]
enum Change {
    Full,
    Delta {
        add: HashSet<Member>,
        del: HashSet<Member>,
    },
    Removed,
}

#[derive(Debug)]
pub struct IpSetsManager {
    max_size: u32,
    /// Most members over all of the calc graph's sets (a feeder cannot
    /// grow the daemon's memory without bound by sending many big sets).
    max_members: usize,
    /// Members the calc graph's sets hold now.
    members_total: usize,
    sets: HashMap<Id, DesiredSet>,
    /// What changed since the last `complete_deferred_work`.
    changes: HashMap<Id, Change>,
    /// IPAM pools: CIDR and whether traffic leaving it is masqueraded.
    pools: std::collections::BTreeMap<Id, (ipnet::IpNet, bool)>,
    /// The host's addresses, when the host-IPs set is kept.
    host_ips: Option<HostIps>,
    /// Each node's VTEP parent addresses (IPv4, IPv6), for
    /// [`VXLAN_SOURCES`].
    vtep_parents: BTreeMap<Id, Vec<std::net::IpAddr>>,
    /// `--vxlan`, when the VXLAN-sources set is kept, and the calc graph's
    /// encapsulation: the set exists while VXLAN is on (or VTEPs are
    /// known).
    vxlan: Option<crate::model::routes::VxlanMode>,
    /// `--vxlan`, before a ConfigUpdate's `VXLANEnabled`.
    vxlan_flag: Option<crate::model::routes::VxlanMode>,
    encap: crate::model::Encapsulation,
}

/// What the host-IPs set is built from: every address of every interface
/// but the workload ones (as Felix's `hostip_mgr.go`).
#[derive(Debug)]
struct HostIps {
    workload_prefix: String,
    ifaces: BTreeMap<u32, String>,
    addrs: BTreeMap<u32, BTreeSet<std::net::IpAddr>>,
    members: HashSet<Member>,
}

impl HostIps {
    fn members(&self) -> HashSet<Member> {
        self.addrs
            .iter()
            .filter(|(i, _)| {
                self.ifaces
                    .get(i)
                    .is_some_and(|n| !n.starts_with(self.workload_prefix.as_str()))
            })
            .flat_map(|(_, a)| a.iter().map(|ip| Member::Ip(*ip)))
            .collect()
    }
}

/// The set of every IPAM pool's CIDR (Felix's `all-ipam-pools`).
pub const ALL_POOLS: &str = "all-ipam-pools";
/// The set of the CIDRs of pools with `masquerade` (`masq-ipam-pools`).
pub const MASQ_POOLS: &str = "masq-ipam-pools";
/// The set of this host's addresses (Felix's `this-host`).
pub const HOST_IPS: &str = "this-host";
/// The nodes VXLAN packets may come from: every VTEP's parent address
/// (Felix's `all-vxlan-net`).
pub const VXLAN_SOURCES: &str = "all-vxlan-net";

impl IpSetsManager {
    /// `max_size` is every set's `maxelem`; a set that would grow beyond it
    /// is rejected whole.
    pub fn new(max_size: u32) -> Self {
        Self {
            max_size,
            max_members: DEFAULT_MAX_MEMBERS,
            members_total: 0,
            sets: HashMap::new(),
            changes: HashMap::new(),
            pools: Default::default(),
            host_ips: None,
            vtep_parents: BTreeMap::new(),
            vxlan: None,
            vxlan_flag: None,
            encap: crate::model::Encapsulation::default(),
        }
    }

    /// At most `n` members over all of the calc graph's sets together; a
    /// message that would go beyond is rejected whole.
    pub fn with_max_members(mut self, n: usize) -> Self {
        self.max_members = n;
        self
    }

    /// Also keep the host-IPs set ([`HOST_IPS`]): the addresses of every
    /// interface whose name does not start with `workload_prefix`, from
    /// the interface monitor.
    pub fn with_host_ips(mut self, workload_prefix: &str) -> Self {
        self.host_ips = Some(HostIps {
            workload_prefix: workload_prefix.to_string(),
            ifaces: BTreeMap::new(),
            addrs: BTreeMap::new(),
            members: HashSet::new(),
        });
        let id = Id::new(HOST_IPS).expect("a valid id");
        self.sets.insert(
            id.clone(),
            DesiredSet {
                set_type: IpSetType::Ip,
                members: HashSet::new(),
            },
        );
        self.changes.insert(id, Change::Full);
        self
    }

    /// Keep the VXLAN-sources set ([`VXLAN_SOURCES`]) while VXLAN is on
    /// (`mode` and the calc graph's `Encapsulation`), even before any VTEP
    /// is known: the VXLAN rules in INPUT name it as soon as VXLAN is on,
    /// and a rule cannot name a set that does not exist.
    pub fn with_vxlan_sources(mut self, mode: crate::model::routes::VxlanMode) -> Self {
        self.vxlan = Some(mode);
        self.vxlan_flag = Some(mode);
        self.update_vxlan_sources();
        self
    }

    /// Rebuilds the two sets derived from the IPAM pools (type NET; ids
    /// the calc graph does not use: its own carry a `s:`/`n:`-style prefix).
    fn update_pool_sets(&mut self) {
        for (name, masq_only) in [(ALL_POOLS, false), (MASQ_POOLS, true)] {
            let id = Id::new(name).expect("a valid id");
            let members: HashSet<Member> = self
                .pools
                .values()
                .filter(|(_, masq)| !masq_only || *masq)
                .map(|(cidr, _)| Member::Net(*cidr))
                .collect();
            self.set_derived(id, members);
        }
    }

    /// Replaces a set the daemon derives itself (type NET).
    fn set_derived(&mut self, id: Id, members: HashSet<Member>) {
        self.sets.insert(
            id.clone(),
            DesiredSet {
                set_type: IpSetType::Net,
                members,
            },
        );
        self.changes.insert(id, Change::Full);
    }

    /// Rebuilds the set of VXLAN sources from the VTEPs; removes it when
    /// VXLAN is off and no VTEP is known.
    fn update_vxlan_sources(&mut self) {
        let Some(mode) = self.vxlan else {
            return;
        };
        let id = Id::new(VXLAN_SOURCES).expect("a valid id");
        let on = [IpVersion::V4, IpVersion::V6]
            .into_iter()
            .any(|v| mode.on(&self.encap, v, true));
        if !on && self.vtep_parents.is_empty() {
            if self.sets.remove(&id).is_some() {
                self.changes.insert(id, Change::Removed);
            }
            return;
        }
        let members = self
            .vtep_parents
            .values()
            .flatten()
            .map(|ip| Member::Net(ipnet::IpNet::from(*ip)))
            .collect();
        self.set_derived(id, members);
    }

    fn too_big(&self, field: &str, v: IpVersion, n: usize) -> Result<(), ValidationError> {
        if n > self.max_size as usize {
            let fam = match v {
                IpVersion::V4 => "IPv4",
                IpVersion::V6 => "IPv6",
            };
            return Err(ValidationError::new(
                field,
                format!(
                    "the set would hold {n} {fam} members, over the maximum of {} \
                     (--max-ipset-size); nothing of it was applied",
                    self.max_size
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a message after which the sets would hold `n` members in
    /// all.
    fn too_many(&self, field: &str, n: usize) -> Result<(), ValidationError> {
        if n > self.max_members {
            return Err(ValidationError::new(
                field,
                format!(
                    "the IP sets would hold {n} members in all, over the maximum of {} \
                     (--max-ipset-members); nothing of it was applied",
                    self.max_members
                ),
            ));
        }
        Ok(())
    }

    fn meta(&self, set_type: IpSetType) -> Meta {
        Meta {
            set_type,
            maxelem: self.max_size,
        }
    }
}

fn of(members: &HashSet<Member>, v: IpVersion) -> HashSet<Member> {
    members
        .iter()
        .filter(|m| m.version() == v)
        .copied()
        .collect()
}

impl Manager for IpSetsManager {
    fn name(&self) -> &'static str {
        "ipsets"
    }

    fn check(&self, update: &Update) -> Result<(), ValidationError> {
        match update {
            Update::IpSetUpdate(s) => {
                let unique: HashSet<&Member> = s.members.iter().collect();
                for v in [IpVersion::V4, IpVersion::V6] {
                    let n = unique.iter().filter(|m| m.version() == v).count();
                    self.too_big("ipset_update.members", v, n)?;
                }
                let held = self.sets.get(&s.id).map_or(0, |d| d.members.len());
                self.too_many(
                    "ipset_update.members",
                    self.members_total.saturating_sub(held) + unique.len(),
                )
            }
            Update::IpSetDeltaUpdate(d) => {
                let Some(set) = self.sets.get(&d.id) else {
                    return Ok(());
                };
                let removed: HashSet<&Member> = d.removed.iter().collect();
                for v in [IpVersion::V4, IpVersion::V6] {
                    let gone = removed
                        .iter()
                        .filter(|m| m.version() == v && set.members.contains(**m))
                        .count();
                    let new: HashSet<&Member> = d
                        .added
                        .iter()
                        .filter(|m| m.version() == v && !set.members.contains(*m))
                        .collect();
                    let n = set.count(v) - gone + new.len();
                    self.too_big("ipset_delta_update.added_members", v, n)?;
                }
                // What the set holds after: removed first, then added.
                let added: HashSet<&Member> = d.added.iter().collect();
                let new = added.iter().filter(|m| !set.members.contains(**m)).count();
                let gone = removed
                    .iter()
                    .filter(|m| set.members.contains(**m) && !added.contains(*m))
                    .count();
                if new > gone {
                    self.too_many(
                        "ipset_delta_update.added_members",
                        self.members_total + new - gone,
                    )?;
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn on_update(&mut self, update: &Update) {
        match update {
            Update::IpSetUpdate(s) => {
                let set = DesiredSet {
                    set_type: s.set_type,
                    members: s.members.iter().copied().collect(),
                };
                self.members_total += set.members.len();
                if let Some(old) = self.sets.insert(s.id.clone(), set) {
                    self.members_total = self.members_total.saturating_sub(old.members.len());
                }
                self.changes.insert(s.id.clone(), Change::Full);
            }
            Update::IpSetDeltaUpdate(d) => {
                let Some(set) = self.sets.get_mut(&d.id) else {
                    return;
                };
                let before = set.members.len();
                for m in &d.removed {
                    set.members.remove(m);
                }
                set.members.extend(d.added.iter().copied());
                self.members_total =
                    (self.members_total + set.members.len()).saturating_sub(before);
                match self
                    .changes
                    .entry(d.id.clone())
                    .or_insert_with(|| Change::Delta {
                        add: HashSet::new(),
                        del: HashSet::new(),
                    }) {
                    Change::Full | Change::Removed => {}
                    Change::Delta { add, del } => {
                        for m in &d.removed {
                            add.remove(m);
                            del.insert(*m);
                        }
                        for m in &d.added {
                            del.remove(m);
                            add.insert(*m);
                        }
                    }
                }
            }
            Update::Remove(Key::IpSet(id)) if self.sets.contains_key(id) => {
                if let Some(old) = self.sets.remove(id) {
                    self.members_total = self.members_total.saturating_sub(old.members.len());
                }
                self.changes.insert(id.clone(), Change::Removed);
            }
            Update::IpamPool(id, pool) => {
                self.pools.insert(id.clone(), (pool.cidr, pool.masquerade));
                self.update_pool_sets();
            }
            Update::Remove(Key::IpamPool(id)) if self.pools.remove(id).is_some() => {
                self.update_pool_sets();
            }
            Update::Vtep(v) => {
                let parents: Vec<std::net::IpAddr> = [v.parent_device_ip, v.parent_device_ipv6]
                    .into_iter()
                    .flatten()
                    .collect();
                if self.vtep_parents.get(&v.node) != Some(&parents) {
                    self.vtep_parents.insert(v.node.clone(), parents);
                    self.update_vxlan_sources();
                }
            }
            Update::Remove(Key::Vtep(node)) if self.vtep_parents.remove(node).is_some() => {
                self.update_vxlan_sources();
            }
            Update::Encapsulation(e) if *e != self.encap => {
                self.encap = *e;
                self.update_vxlan_sources();
            }
            Update::Config(kv) => {
                if let Some(flag) = self.vxlan_flag {
                    // Checked at the edge ([`crate::model::config`]).
                    let felix = crate::model::config::FelixConfig::parse(kv).unwrap_or_default();
                    let mode = Some(felix.vxlan_mode(flag));
                    if mode != self.vxlan {
                        self.vxlan = mode;
                        self.update_vxlan_sources();
                    }
                }
            }
            _ => {}
        }
    }

    fn on_interface(&mut self, event: &crate::interfaces::InterfaceEvent) {
        use crate::interfaces::InterfaceEvent as E;
        let Some(h) = &mut self.host_ips else {
            return;
        };
        match event {
            E::Link { index, name, .. } => {
                h.ifaces.insert(*index, name.clone());
            }
            E::LinkRemoved { index, .. } => {
                h.ifaces.remove(index);
                h.addrs.remove(index);
            }
            E::AddrAdded { index, addr } => {
                h.addrs.entry(*index).or_default().insert(addr.addr());
            }
            E::AddrRemoved { index, addr } => {
                if let Some(a) = h.addrs.get_mut(index) {
                    a.remove(&addr.addr());
                }
            }
            E::InSync | E::RouteRemoved(_) => return,
        }
        let members = h.members();
        if members != h.members {
            h.members = members.clone();
            let id = Id::new(HOST_IPS).expect("a valid id");
            self.sets.insert(
                id.clone(),
                DesiredSet {
                    set_type: IpSetType::Ip,
                    members,
                },
            );
            self.changes.insert(id, Change::Full);
        }
    }

    fn complete_deferred_work(&mut self, kernel: &mut DesiredKernel) -> Result<(), ManagerError> {
        for b in kernel.set_stores_mut() {
            let v = b.version();
            if b.needs_full() {
                b.start_full();
                for (id, set) in &self.sets {
                    let name = b.names().name(v, id);
                    b.replace(name, self.meta(set.set_type), of(&set.members, v));
                }
                continue;
            }
            for (id, change) in &self.changes {
                let name = b.names().name(v, id);
                match change {
                    Change::Full => {
                        let set = &self.sets[id];
                        b.replace(name, self.meta(set.set_type), of(&set.members, v));
                    }
                    Change::Delta { add, del } => {
                        b.delta(
                            &name,
                            &mut add.iter().filter(|m| m.version() == v).copied(),
                            &mut del.iter().filter(|m| m.version() == v).copied(),
                        );
                    }
                    Change::Removed => b.remove(&name),
                }
            }
        }
        self.changes.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::ipsets::{IpSetExec, IpSets};
    use crate::backends::{Backend, BackendError, Phase};
    use crate::model::ipsets::{IpSet, IpSetDelta, SetNames};
    use std::sync::{Arc, Mutex};

    #[derive(Debug, Clone, Default)]
    struct Scripts(Arc<Mutex<Vec<String>>>);

    impl IpSetExec for Scripts {
        fn save(&mut self) -> Result<String, BackendError> {
            Ok(String::new())
        }
        fn restore(&mut self, script: &str) -> Result<(), BackendError> {
            self.0.lock().unwrap().push(script.to_string());
            Ok(())
        }
    }

    fn kernel() -> (DesiredKernel, Scripts, Scripts) {
        let (v4, v6) = (Scripts::default(), Scripts::default());
        let names = SetNames::new("dph").unwrap();
        let k = DesiredKernel {
            ipsets: vec![
                IpSets::new(IpVersion::V4, names.clone(), Box::new(v4.clone())),
                IpSets::new(IpVersion::V6, names, Box::new(v6.clone())),
            ],
            ..Default::default()
        };
        (k, v4, v6)
    }

    fn set(id: &str, ty: IpSetType, members: &[&str]) -> Update {
        Update::IpSetUpdate(IpSet {
            id: Id::new(id).unwrap(),
            set_type: ty,
            members: members
                .iter()
                .map(|s| Member::parse(ty, s).unwrap())
                .collect(),
        })
    }

    fn delta(id: &str, add: &[&str], del: &[&str]) -> Update {
        let p = |l: &[&str]| l.iter().map(|s| Member::parse_any(s).unwrap()).collect();
        Update::IpSetDeltaUpdate(IpSetDelta {
            id: Id::new(id).unwrap(),
            added: p(add),
            removed: p(del),
        })
    }

    fn apply(mgr: &mut IpSetsManager, k: &mut DesiredKernel) {
        mgr.complete_deferred_work(k).unwrap();
        k.apply_all().unwrap();
    }

    #[test]
    fn members_over_all_sets_are_limited() {
        let mut mgr = IpSetsManager::new(DEFAULT_MAX_SIZE).with_max_members(4);
        let a = set("a", IpSetType::Ip, &["10.0.0.1", "10.0.0.2", "fd00::1"]);
        mgr.check(&a).unwrap();
        mgr.on_update(&a);
        let b = set("b", IpSetType::Ip, &["10.0.0.1", "10.0.0.9"]);
        let err = mgr.check(&b).unwrap_err();
        assert_eq!(err.field, "ipset_update.members");
        assert!(
            err.reason
                .contains("5 members in all, over the maximum of 4"),
            "{}",
            err.reason
        );
        // Replacing a set counts what it then holds, not both.
        let a2 = set(
            "a",
            IpSetType::Ip,
            &["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"],
        );
        mgr.check(&a2).unwrap();
        // A delta: removals make room in the same message.
        let d = delta("a", &["10.0.0.5", "10.0.0.6"], &[]);
        assert_eq!(
            mgr.check(&d).unwrap_err().field,
            "ipset_delta_update.added_members"
        );
        let d = delta("a", &["10.0.0.5"], &["10.0.0.1"]);
        mgr.check(&d).unwrap();
        mgr.on_update(&d);
        let d = delta("a", &["10.0.0.5", "10.0.0.2"], &[]);
        mgr.check(&d).unwrap(); // nothing new
        mgr.on_update(&Update::Remove(Key::IpSet(Id::new("a").unwrap())));
        mgr.check(&set(
            "b",
            IpSetType::Ip,
            &["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"],
        ))
        .unwrap();
    }

    #[test]
    fn members_are_split_by_family_and_every_id_exists_in_both() {
        let mut mgr = IpSetsManager::new(DEFAULT_MAX_SIZE);
        let (mut k, v4, v6) = kernel();
        mgr.on_update(&set("s:a", IpSetType::Ip, &["10.0.0.1", "fd00::1"]));
        apply(&mut mgr, &mut k);
        let s4 = v4.0.lock().unwrap().join("");
        let s6 = v6.0.lock().unwrap().join("");
        assert!(
            s4.contains("create dph40s:a hash:ip family inet ")
                && s4.contains("add dph40s:a 10.0.0.1\n")
        );
        assert!(!s4.contains("fd00"));
        assert!(
            s6.contains("create dph60s:a hash:ip family inet6 ")
                && s6.contains("add dph60s:a fd00::1\n")
        );

        mgr.on_update(&delta("s:a", &["10.0.0.2"], &["10.0.0.1"]));
        apply(&mut mgr, &mut k);
        let last4 = v4.0.lock().unwrap().last().unwrap().clone();
        let mut lines: Vec<&str> = last4.lines().collect();
        lines.sort();
        assert_eq!(lines, ["add dph40s:a 10.0.0.2", "del dph40s:a 10.0.0.1"]);
        assert_eq!(v6.0.lock().unwrap().len(), 1, "nothing changed in v6");

        mgr.on_update(&Update::Remove(Key::IpSet(Id::new("s:a").unwrap())));
        apply(&mut mgr, &mut k);
        assert_eq!(v4.0.lock().unwrap().last().unwrap(), "destroy dph40s:a\n");
        assert_eq!(v6.0.lock().unwrap().last().unwrap(), "destroy dph60s:a\n");
        assert!(!k.ipsets[0].is_dirty(Phase::IpSetDeletions));
    }

    #[test]
    fn sets_over_the_maximum_are_refused_whole() {
        let mut mgr = IpSetsManager::new(3);
        let ok = set(
            "s:a",
            IpSetType::Ip,
            &["10.0.0.1", "10.0.0.2", "10.0.0.3", "fd00::1"],
        );
        assert!(
            mgr.check(&ok).is_ok(),
            "3 v4 + 1 v6 fit a maximum of 3 per family"
        );
        mgr.on_update(&ok);
        let big = set(
            "s:b",
            IpSetType::Ip,
            &["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"],
        );
        let e = mgr.check(&big).unwrap_err();
        assert_eq!(e.field, "ipset_update.members");
        assert!(
            e.reason.contains("4 IPv4 members") && e.reason.contains("maximum of 3"),
            "{}",
            e.reason
        );
        // A delta that swaps one member for another keeps the size.
        assert!(
            mgr.check(&delta("s:a", &["10.0.0.9"], &["10.0.0.1"]))
                .is_ok()
        );
        // Re-adding a member it has is no growth.
        assert!(mgr.check(&delta("s:a", &["10.0.0.1"], &[])).is_ok());
        let e = mgr.check(&delta("s:a", &["10.0.0.9"], &[])).unwrap_err();
        assert_eq!(e.field, "ipset_delta_update.added_members");
    }

    #[test]
    fn a_resync_resends_the_whole_desired_state() {
        let mut mgr = IpSetsManager::new(DEFAULT_MAX_SIZE);
        let (mut k, v4, _v6) = kernel();
        mgr.on_update(&set("s:a", IpSetType::Net, &["10.0.0.0/8"]));
        apply(&mut mgr, &mut k);
        k.request_resync(crate::backends::Refresh::IpSets);
        apply(&mut mgr, &mut k);
        // The fake kernel is empty on every read, so the set is rebuilt.
        let all = v4.0.lock().unwrap().clone();
        assert_eq!(all.len(), 2);
        assert!(all[1].contains("create dph40s:a hash:net"), "{all:?}");
    }

    #[test]
    fn vxlan_sources_follow_the_vteps() {
        use crate::model::routes::VxlanMode;
        let mut mgr = IpSetsManager::new(DEFAULT_MAX_SIZE).with_vxlan_sources(VxlanMode::Auto);
        let (mut k, v4, v6) = kernel();
        // Not while VXLAN is off and no VTEP is known.
        apply(&mut mgr, &mut k);
        assert!(!v4.0.lock().unwrap().join("").contains("all-vxlan-net"));
        // VXLAN on: there at once, empty, before any VTEP.
        mgr.on_update(&Update::Encapsulation(crate::model::Encapsulation {
            vxlan_enabled: true,
            ..Default::default()
        }));
        apply(&mut mgr, &mut k);
        assert!(
            v4.0.lock()
                .unwrap()
                .join("")
                .contains("create dph40all-vxlan-net hash:net")
        );
        let vtep = |node: &str, ip: &str, ip6: Option<&str>| {
            Update::Vtep(crate::model::Vtep {
                node: Id::new(node).unwrap(),
                mac: Some(crate::model::MacAddr([0x66, 0, 0, 0, 0, 1])),
                ipv4_addr: Some("10.65.0.0".parse().unwrap()),
                parent_device_ip: Some(ip.parse().unwrap()),
                mac_v6: ip6.map(|_| crate::model::MacAddr([0x66, 0, 0, 0, 0, 2])),
                ipv6_addr: ip6.map(|_| "fd00:65::".parse().unwrap()),
                parent_device_ipv6: ip6.map(|a| a.parse().unwrap()),
            })
        };
        for u in [
            vtep("node1", "172.31.0.1", Some("fd00:77::1")),
            vtep("node2", "172.31.0.2", None),
        ] {
            mgr.on_update(&u);
        }
        apply(&mut mgr, &mut k);
        let s4 = v4.0.lock().unwrap().join("");
        assert!(s4.contains("create dph40all-vxlan-net hash:net"), "{s4}");
        assert!(s4.contains("add dph40all-vxlan-net 172.31.0.1"), "{s4}");
        assert!(s4.contains("add dph40all-vxlan-net 172.31.0.2"), "{s4}");
        let s6 = v6.0.lock().unwrap().join("");
        assert!(s6.contains("add dph60all-vxlan-net fd00:77::1"), "{s6}");
        // Node 2 leaves.
        mgr.on_update(&Update::Remove(Key::Vtep(Id::new("node2").unwrap())));
        apply(&mut mgr, &mut k);
        let last = v4.0.lock().unwrap().last().unwrap().clone();
        assert!(last.contains("del dph40all-vxlan-net 172.31.0.2"), "{last}");
    }

    #[test]
    fn host_ips_follow_the_interfaces_but_not_workloads() {
        use crate::interfaces::InterfaceEvent as E;
        let mut mgr = IpSetsManager::new(DEFAULT_MAX_SIZE).with_host_ips("cali");
        let (mut k, v4, v6) = kernel();
        let link = |index, name: &str| E::Link {
            index,
            name: name.into(),
            up: true,
            mtu: 1500,
        };
        let addr = |index, a: &str| E::AddrAdded {
            index,
            addr: a.parse().unwrap(),
        };
        for e in [
            link(1, "eth0"),
            addr(1, "10.0.0.5/24"),
            addr(1, "fd00::5/64"),
            link(2, "cali1"),
            addr(2, "169.254.1.1/32"),
        ] {
            mgr.on_interface(&e);
        }
        mgr.complete_deferred_work(&mut k).unwrap();
        for b in &mut k.ipsets {
            for ph in Phase::ALL {
                b.apply(ph).unwrap();
            }
        }
        let s4 = v4.0.lock().unwrap().join("\n");
        assert!(s4.contains("create dph40this-host hash:ip"), "{s4}");
        assert!(s4.contains("add dph40this-host 10.0.0.5"), "{s4}");
        assert!(
            !s4.contains("169.254.1.1"),
            "workload interfaces are not the host's"
        );
        assert!(
            v6.0.lock()
                .unwrap()
                .join("\n")
                .contains("add dph60this-host fd00::5")
        );

        // The address goes away: so does the member.
        mgr.on_interface(&E::AddrRemoved {
            index: 1,
            addr: "10.0.0.5/24".parse().unwrap(),
        });
        mgr.complete_deferred_work(&mut k).unwrap();
        for b in &mut k.ipsets {
            for ph in Phase::ALL {
                b.apply(ph).unwrap();
            }
        }
        let last = v4.0.lock().unwrap().last().cloned().unwrap();
        assert!(last.contains("del dph40this-host 10.0.0.5"), "{last}");
    }
}
