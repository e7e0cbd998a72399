//! VXLAN devices (`vxlan.calico`, `vxlan-v6.calico`), over rtnetlink.
//!
//! Owns the links with the names it is given and nothing else: each is
//! created as Felix makes it (VNI, UDP port, MAC = this node's VTEP MAC,
//! parent link and local address = the underlay interface and this node's
//! address on it, MTU, the VTEP address as /32 or /128, up), checked on
//! every apply, on the route refresh tick and at a link event of its name
//! (deleted by hand: made again at once), and recreated when a
//! parameter the kernel cannot change in place differs (VNI, port, parent,
//! local address, MAC: Felix's `vxlanLinksIncompat`); MTU, state and
//! addresses are set in place. Other addresses of the device's family are
//! removed (not the IPv6 link-local one). A device that is no longer
//! wanted (VXLAN off) is deleted.
//!
//! Runs in [`Phase::Links`], before the routes that go through it.

pub mod netlink;

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use tracing::{info, instrument, warn};

use super::{ApplyOutcome, Backend, BackendError, Phase, Refresh};
use crate::model::MacAddr;
use crate::model::routes::VxlanDevice;

/// A VXLAN link as the kernel holds it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObservedLink {
    pub index: u32,
    /// `vxlan`, or whatever other kind a link of that name has.
    pub kind: String,
    pub vni: Option<u32>,
    pub port: Option<u16>,
    pub parent: Option<u32>,
    pub local: Option<IpAddr>,
    pub mac: Option<MacAddr>,
    pub mtu: Option<u32>,
    pub up: bool,
    pub addrs: Vec<IpNet>,
}

/// One write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VxlanOp {
    Create { dev: VxlanDevice, parent_index: u32 },
    Delete { index: u32, name: String },
    SetMtu { index: u32, mtu: u32 },
    SetUp { index: u32 },
    AddAddr { index: u32, addr: IpNet },
    DelAddr { index: u32, addr: IpNet },
}

/// The seam to the kernel.
pub trait VxlanSeam: Send + std::fmt::Debug {
    /// The index of a link by name, if it exists.
    fn link_index(&mut self, name: &str) -> Result<Option<u32>, BackendError>;
    /// The link of that name with its VXLAN parameters and addresses.
    fn get(&mut self, name: &str) -> Result<Option<ObservedLink>, BackendError>;
    fn write(&mut self, op: &VxlanOp) -> Result<(), BackendError>;
}

/// Why an existing link cannot be kept, if it cannot.
pub fn incompatible(want: &VxlanDevice, parent_index: u32, have: &ObservedLink) -> Option<String> {
    if have.kind != "vxlan" {
        return Some(format!("link kind {:?}", have.kind));
    }
    let differs = |what: &str, want: String, have: String| {
        (want != have).then(|| format!("{what}: {have} (want {want})"))
    };
    let opt = |v: Option<String>| v.unwrap_or_else(|| "none".into());
    differs(
        "vni",
        want.vni.to_string(),
        opt(have.vni.map(|v| v.to_string())),
    )
    .or_else(|| {
        differs(
            "port",
            want.port.to_string(),
            opt(have.port.map(|v| v.to_string())),
        )
    })
    .or_else(|| {
        differs(
            "parent",
            parent_index.to_string(),
            opt(have.parent.map(|v| v.to_string())),
        )
    })
    .or_else(|| {
        differs(
            "local",
            want.local.to_string(),
            opt(have.local.map(|v| v.to_string())),
        )
    })
    .or_else(|| {
        differs(
            "mac",
            want.mac.to_string(),
            opt(have.mac.map(|v| v.to_string())),
        )
    })
}

fn is_link_local(n: &IpNet) -> bool {
    matches!(n, IpNet::V6(v6) if v6.addr().segments()[0] & 0xffc0 == 0xfe80)
}

/// What a device lacks: ops to run on the existing link `have`.
pub fn fix_in_place(want: &VxlanDevice, have: &ObservedLink) -> Vec<VxlanOp> {
    link_fixes(
        have,
        want.mtu,
        Some(IpNet::from(want.addr)),
        want.addr.is_ipv4(),
    )
}

/// What a device link of ours needs, whatever its kind (VXLAN,
/// WireGuard): its MTU, its one address of a family (the family's others
/// removed, not IPv6 link-local ones), up.
pub fn link_fixes(have: &ObservedLink, mtu: u32, addr: Option<IpNet>, ipv4: bool) -> Vec<VxlanOp> {
    let index = have.index;
    let mut ops = Vec::new();
    if have.mtu != Some(mtu) {
        ops.push(VxlanOp::SetMtu { index, mtu });
    }
    if let Some(addr) = addr
        && !have.addrs.contains(&addr)
    {
        ops.push(VxlanOp::AddAddr { index, addr });
    }
    for a in &have.addrs {
        let same_family = a.addr().is_ipv4() == ipv4;
        if Some(*a) != addr && same_family && !is_link_local(a) {
            ops.push(VxlanOp::DelAddr { index, addr: *a });
        }
    }
    if !have.up {
        ops.push(VxlanOp::SetUp { index });
    }
    ops
}

/// The VXLAN devices, by name: `None` = must not exist.
#[derive(Debug)]
pub struct Vxlan {
    seam: Box<dyn VxlanSeam>,
    desired: BTreeMap<String, Option<VxlanDevice>>,
    changed: bool,
    /// The parent a device waits for (missing underlay interface).
    waiting: BTreeMap<String, String>,
}

impl Vxlan {
    /// `names`: the devices this backend owns (all absent until set).
    pub fn new(names: &[&str], seam: Box<dyn VxlanSeam>) -> Self {
        Self {
            seam,
            desired: names.iter().map(|n| (n.to_string(), None)).collect(),
            changed: true,
            waiting: BTreeMap::new(),
        }
    }

    /// The desired state of one owned device.
    pub fn set(&mut self, name: &str, dev: Option<VxlanDevice>) {
        let slot = self.desired.entry(name.to_string()).or_default();
        if *slot != dev || !self.waiting.is_empty() {
            *slot = dev;
            self.changed = true;
        }
    }

    /// The desired state of one device (`None`: must not exist, or not
    /// ours).
    pub fn desired(&self, name: &str) -> Option<&VxlanDevice> {
        self.desired.get(name).and_then(Option::as_ref)
    }

    /// A link event (the monitor's) for a name we own: a device that is
    /// wanted is looked at again at once (deleted or changed by hand: made
    /// again without waiting for the refresh tick). Our own writes bring
    /// one more look that finds nothing to do.
    pub fn link_changed(&mut self, name: &str) {
        if self.desired.get(name).is_some_and(Option::is_some) {
            self.changed = true;
        }
    }

    /// Devices waiting for their parent interface, by name.
    pub fn waiting(&self) -> &BTreeMap<String, String> {
        &self.waiting
    }

    fn apply_one(&mut self, name: &str, want: Option<&VxlanDevice>) -> Result<(), BackendError> {
        let have = self.seam.get(name)?;
        let Some(want) = want else {
            if let Some(h) = have {
                info!(device = name, "VXLAN is off: deleting the device");
                self.seam.write(&VxlanOp::Delete {
                    index: h.index,
                    name: name.into(),
                })?;
            }
            return Ok(());
        };
        let Some(parent_index) = self.seam.link_index(&want.parent)? else {
            warn!(device = name, parent = %want.parent, "the VXLAN parent interface does not exist; waiting for it");
            self.waiting.insert(name.into(), want.parent.clone());
            return Ok(());
        };
        self.waiting.remove(name);
        let have = match have {
            Some(h) => match incompatible(want, parent_index, &h) {
                None => Some(h),
                Some(why) => {
                    warn!(device = name, %why, "VXLAN device differs; recreating it");
                    self.seam.write(&VxlanOp::Delete {
                        index: h.index,
                        name: name.into(),
                    })?;
                    None
                }
            },
            None => None,
        };
        let have = match have {
            Some(h) => h,
            None => {
                info!(device = name, vni = want.vni, port = want.port, parent = %want.parent, local = %want.local, mtu = want.mtu, "creating the VXLAN device");
                self.seam.write(&VxlanOp::Create {
                    dev: want.clone(),
                    parent_index,
                })?;
                self.seam.get(name)?.ok_or_else(|| BackendError::Parse {
                    backend: "vxlan",
                    reason: format!("{name} is missing right after it was created"),
                })?
            }
        };
        for op in fix_in_place(want, &have) {
            info!(device = name, ?op, "VXLAN device");
            self.seam.write(&op)?;
        }
        Ok(())
    }
}

impl Backend for Vxlan {
    fn name(&self) -> &'static str {
        "vxlan"
    }

    fn phases(&self) -> &'static [Phase] {
        &[Phase::Links]
    }

    fn is_dirty(&self, phase: Phase) -> bool {
        phase == Phase::Links && self.changed
    }

    fn request_resync(&mut self, refresh: Refresh) {
        if refresh == Refresh::Routes {
            self.changed = true;
        }
    }

    #[instrument(level = "debug", skip(self), fields(backend = "vxlan"))]
    fn apply(&mut self, _phase: Phase) -> Result<ApplyOutcome, BackendError> {
        let desired: Vec<(String, Option<VxlanDevice>)> = self
            .desired
            .iter()
            .map(|(n, d)| (n.clone(), d.clone()))
            .collect();
        for (name, want) in &desired {
            self.apply_one(name, want.as_ref())?;
        }
        self.changed = false;
        Ok(ApplyOutcome::default())
    }

    fn status(&self) -> Vec<(String, String)> {
        self.waiting
            .iter()
            .map(|(dev, parent)| {
                (
                    format!("kernel.{dev}"),
                    format!("waiting for parent interface {parent}"),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
