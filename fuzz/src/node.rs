//! A node as the daemon builds it, for the `sequence` target: every
//! manager over every backend, each backend over a seam that records and
//! accepts (an empty kernel), with either policy dataplane. What the
//! seams are given is checked as the kernel would check it: every
//! nftables commit is encoded as it would be sent (an attribute past 64
//! KiB is refused), every `iptables-restore` and `ipset restore` line is
//! made of tokens the tools take.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use dphandler_dataplane::backends::iprules::{IpRuleSeam, IpRules};
use dphandler_dataplane::backends::ipsets::{IpSetExec, IpSets};
use dphandler_dataplane::backends::iptables::{InsertMode, IptablesExec, Table};
use dphandler_dataplane::backends::nftables::dataplane::{Dataplane, NftKernel};
use dphandler_dataplane::backends::nftables::netlink::NftError;
use dphandler_dataplane::backends::nftables::ops::{Family, Op};
use dphandler_dataplane::backends::nftables::plan::{Contents, Observed};
use dphandler_dataplane::backends::nftables::shards::ShardLayout;
use dphandler_dataplane::backends::routes::kernel::{
    KernelFdb, KernelNeighbour, KernelRoute, Link, RouteOwnership, RouteSeam,
};
use dphandler_dataplane::backends::routes::{RouteOp, Routes};
use dphandler_dataplane::backends::vxlan::{ObservedLink, Vxlan, VxlanOp, VxlanSeam};
use dphandler_dataplane::backends::wireguard::keys::KeyStore;
use dphandler_dataplane::backends::wireguard::plan::{DeviceChange, ObservedDevice};
use dphandler_dataplane::backends::wireguard::{Carrier, Created, WgSeam, Wireguard};
use dphandler_dataplane::backends::xdp::{Verdicts, Xdp, XdpSeam};
use dphandler_dataplane::backends::{BackendError, DesiredKernel};
use dphandler_dataplane::generictables::Ownership;
use dphandler_dataplane::interfaces::InterfaceEvent;
use dphandler_dataplane::managers::Manager;
use dphandler_dataplane::managers::endpoints::{
    EndpointsConfig, EndpointsManager, default_failsafe,
};
use dphandler_dataplane::managers::ipsets::IpSetsManager;
use dphandler_dataplane::managers::nat::NatManager;
use dphandler_dataplane::managers::routes::{RoutesConfig, RoutesManager, VXLAN_V4, VXLAN_V6};
use dphandler_dataplane::managers::wireguard::{WireguardConfig, WireguardManager};
use dphandler_dataplane::managers::xdp::XdpManager;
use dphandler_dataplane::model::ipsets::SetNames;
use dphandler_dataplane::model::routes::IpRule;
use dphandler_dataplane::model::wireguard::{PublicKey, WgSettings};
use dphandler_dataplane::model::{IpVersion, Update};
use ipnet::IpNet;

/// What the seams were given that the kernel would not take.
pub type Faults = Arc<Mutex<Vec<String>>>;

fn token_line(line: &str) -> bool {
    line.split(' ').all(|t| {
        let t = t
            .strip_prefix('"')
            .and_then(|t| t.strip_suffix('"'))
            .unwrap_or(t);
        !t.is_empty() && t.bytes().all(dphandler_dataplane::model::is_token_byte)
    })
}

/// `iptables-restore` and `ipset restore` over an empty kernel: every
/// line checked.
#[derive(Debug, Clone)]
struct Tool(Faults);

impl IptablesExec for Tool {
    fn save(&mut self, _: &str) -> Result<String, BackendError> {
        Ok(String::new())
    }
    fn restore(&mut self, input: &str) -> Result<(), BackendError> {
        for line in input.lines() {
            let header = line.starts_with('*') || line.starts_with(':') || line == "COMMIT";
            if !(header || token_line(line)) {
                self.0
                    .lock()
                    .unwrap()
                    .push(format!("iptables-restore line: {line}"));
            }
        }
        Ok(())
    }
}

impl IpSetExec for Tool {
    fn save(&mut self) -> Result<String, BackendError> {
        Ok(String::new())
    }
    fn restore(&mut self, script: &str) -> Result<(), BackendError> {
        for line in script.lines() {
            if !token_line(line) {
                self.0
                    .lock()
                    .unwrap()
                    .push(format!("ipset restore line: {line}"));
            }
        }
        Ok(())
    }
}

/// The changes of every nftables commit, in order.
pub type Commits = Arc<Mutex<Vec<Op>>>;

/// nf_tables over an empty kernel: each commit encoded as it would be
/// sent (and kept).
#[derive(Debug, Clone)]
struct Nft(Faults, Commits);

impl NftKernel for Nft {
    fn commit(&mut self, ops: &[Op]) -> Result<(), NftError> {
        if let Err(e) = dphandler_dataplane::backends::nftables::netlink::encode(ops) {
            self.0.lock().unwrap().push(format!("nftables commit: {e}"));
            return Err(e);
        }
        self.1.lock().unwrap().extend_from_slice(ops);
        Ok(())
    }
    fn read(&mut self, _: Family, _: &str) -> Result<(Observed, Contents), NftError> {
        Ok(Default::default())
    }
}

/// Routes, neighbours and FDB entries over an empty kernel.
#[derive(Debug)]
struct NoRoutes;

impl RouteSeam for NoRoutes {
    fn links(&mut self) -> Result<Vec<Link>, BackendError> {
        Ok(vec![
            Link {
                index: 2,
                name: "eth0".into(),
            },
            Link {
                index: 3,
                name: "cali1".into(),
            },
        ])
    }
    fn routes(&mut self) -> Result<Vec<KernelRoute>, BackendError> {
        Ok(Vec::new())
    }
    fn neighbours(&mut self) -> Result<(Vec<KernelNeighbour>, Vec<KernelFdb>), BackendError> {
        Ok((Vec::new(), Vec::new()))
    }
    fn write(&mut self, _: &[RouteOp]) -> Vec<(usize, BackendError)> {
        Vec::new()
    }
}

#[derive(Debug)]
struct NoRules;

impl IpRuleSeam for NoRules {
    fn rules(&mut self) -> Result<Vec<IpRule>, BackendError> {
        Ok(Vec::new())
    }
    fn add(&mut self, _: &IpRule) -> Result<(), BackendError> {
        Ok(())
    }
    fn delete(&mut self, _: &IpRule) -> Result<(), BackendError> {
        Ok(())
    }
}

#[derive(Debug)]
struct NoLinks;

impl VxlanSeam for NoLinks {
    fn link_index(&mut self, name: &str) -> Result<Option<u32>, BackendError> {
        Ok((name == "eth0").then_some(2))
    }
    fn get(&mut self, _: &str) -> Result<Option<ObservedLink>, BackendError> {
        Ok(None)
    }
    fn write(&mut self, _: &VxlanOp) -> Result<(), BackendError> {
        Ok(())
    }
}

/// A host where WireGuard cannot run: the manager's routes and the
/// backend's bookkeeping go on, no device is made.
#[derive(Debug)]
struct NoWireguard;

impl WgSeam for NoWireguard {
    fn link(&mut self, _: &str) -> Result<Option<ObservedLink>, BackendError> {
        Ok(None)
    }
    fn create_kernel(&mut self, _: &str) -> Result<Created, BackendError> {
        Ok(Created::NotSupported(
            "the fuzz node has no WireGuard".into(),
        ))
    }
    fn start_userspace(&mut self, _: &str) -> Result<Created, BackendError> {
        Ok(Created::NotSupported(
            "the fuzz node has no wireguard-go".into(),
        ))
    }
    fn userspace_running(&mut self, _: &str) -> bool {
        false
    }
    fn delete(&mut self, _: &str, _: u32) -> Result<(), BackendError> {
        Ok(())
    }
    fn read(&mut self, _: &str, _: Carrier) -> Result<ObservedDevice, BackendError> {
        Ok(ObservedDevice::default())
    }
    fn configure(&mut self, _: &str, _: Carrier, _: &DeviceChange) -> Result<(), BackendError> {
        Ok(())
    }
    fn link_op(&mut self, _: &VxlanOp) -> Result<(), BackendError> {
        Ok(())
    }
    fn nudge(&mut self, _: &str, _: Carrier, _: &[PublicKey]) -> Result<(), BackendError> {
        Ok(())
    }
    fn describe(&self, _: &str) -> Option<String> {
        None
    }
    fn generate_key(&mut self) -> [u8; 32] {
        [7; 32]
    }
    fn support(&self) -> String {
        "none (fuzz)".into()
    }
}

#[derive(Debug)]
struct NoXdp;

impl XdpSeam for NoXdp {
    fn pinned(&mut self) -> Vec<String> {
        Vec::new()
    }
    fn attach(&mut self, _: &str) -> Result<String, String> {
        Ok("generic".into())
    }
    fn detach(&mut self, _: &str) -> Result<(), String> {
        Ok(())
    }
    fn set_failsafe(&mut self, _: &str, _: &[(u8, u16)]) -> Result<(), String> {
        Ok(())
    }
    fn update(&mut self, _: &str, _: &[IpNet], _: &[IpNet]) -> Result<(), String> {
        Ok(())
    }
    fn read(&mut self, _: &str) -> Result<BTreeSet<IpNet>, String> {
        Ok(BTreeSet::new())
    }
    fn verdicts(&mut self, _: &str) -> Result<Verdicts, String> {
        Ok(Verdicts::default())
    }
}

/// The prefix the node is built with: the longest `--prefix` takes, so
/// that every name is as long as it gets.
pub const PREFIX: &str = "dphfuzz";

/// The kernel: iptables (`nftables` false) or nftables, with every other
/// backend.
pub fn kernel(nftables: bool, faults: &Faults) -> DesiredKernel {
    kernel_recording(nftables, faults, &Commits::default())
}

/// [`kernel`], keeping the nftables commits' changes in `commits`.
pub fn kernel_recording(nftables: bool, faults: &Faults, commits: &Commits) -> DesiredKernel {
    let names = SetNames::new(PREFIX).expect("a prefix");
    let mut k = DesiredKernel::default();
    for v in [IpVersion::V4, IpVersion::V6] {
        if nftables {
            k.nftables.push(Dataplane::new(
                v,
                PREFIX,
                names.clone().for_nftables(),
                ShardLayout::default(),
                Box::new(Nft(faults.clone(), commits.clone())),
            ));
        } else {
            k.ipsets.push(IpSets::new(
                v,
                names.clone(),
                Box::new(Tool(faults.clone())),
            ));
            for t in ["raw", "mangle", "nat", "filter"] {
                k.tables.push(Table::new(
                    t,
                    v,
                    Ownership::new(PREFIX),
                    InsertMode::Insert,
                    Box::new(Tool(faults.clone())),
                ));
            }
        }
    }
    k.routes = Some(Routes::new(
        RouteOwnership {
            exclusive_protocol: 80,
            device_protocol: 3,
            workload_prefix: "cali".into(),
            remove_external_routes: true,
            tunnel_devices: vec![VXLAN_V4.into(), VXLAN_V6.into()],
            tables: vec![1, 2],
        },
        Box::new(NoRoutes),
    ));
    k.vxlan = Some(Vxlan::new(&[VXLAN_V4, VXLAN_V6], Box::new(NoLinks)));
    k.wireguard = Some(Wireguard::new(
        Box::new(NoWireguard),
        KeyStore::new(None),
        Default::default(),
    ));
    k.ip_rules = Some(IpRules::new([1, 2], Box::new(NoRules)).expect("tables 1 and 2"));
    k.xdp = Some(Xdp::new(Box::new(NoXdp), vec![(6, 22)]));
    k
}

/// Every manager, as the daemon builds them (its defaults) for the
/// iptables or (`nftables`) the nftables dataplane.
pub fn managers(nftables: bool) -> Vec<Box<dyn Manager>> {
    let names = SetNames::new(PREFIX).expect("a prefix");
    let names = if nftables {
        names.for_nftables()
    } else {
        names
    };
    let (failsafe_in, failsafe_out) = default_failsafe();
    let wg = [
        WgSettings::default_for(IpVersion::V4),
        WgSettings::default_for(IpVersion::V6),
    ];
    vec![
        Box::new(
            IpSetsManager::new(dphandler_dataplane::managers::ipsets::DEFAULT_MAX_SIZE)
                .with_host_ips("cali")
                .with_vxlan_sources(Default::default()),
        ),
        Box::new(NatManager::new(PREFIX, names.clone())),
        Box::new(EndpointsManager::new(
            EndpointsConfig {
                prefix: PREFIX.into(),
                workload_prefix: "cali".into(),
                marks: Default::default(),
                failsafe_in,
                failsafe_out,
                device_route_protocol: 3,
                vxlan: Default::default(),
                vxlan_port: 4789,
                wireguard: wg.clone(),
                endpoint_to_host: Default::default(),
            },
            names,
        )),
        Box::new(WireguardManager::new(WireguardConfig {
            hostname: "node-1".into(),
            v4: wg[0].clone(),
            v6: wg[1].clone(),
            ..Default::default()
        })),
        Box::new(RoutesManager::new(RoutesConfig {
            hostname: "node-1".into(),
            ..Default::default()
        })),
        Box::new(XdpManager::new("cali")),
    ]
}

/// What the interface monitor says of the node: its uplink (with an
/// address and a default route behind it), loopback, a workload's veth.
pub fn interfaces() -> Vec<InterfaceEvent> {
    let link = |index, name: &str| InterfaceEvent::Link {
        index,
        name: name.into(),
        up: true,
        mtu: 1500,
    };
    vec![
        link(1, "lo"),
        InterfaceEvent::AddrAdded {
            index: 1,
            addr: "127.0.0.1/8".parse().expect("a net"),
        },
        link(2, "eth0"),
        InterfaceEvent::AddrAdded {
            index: 2,
            addr: "192.0.2.10/24".parse().expect("a net"),
        },
        link(3, "cali1"),
        InterfaceEvent::InSync,
    ]
}

/// Whether the managers take `u`, as the loop asks them (after the
/// ConfigUpdate's own check).
pub fn accepted(ms: &[Box<dyn Manager>], u: &Update) -> bool {
    if let Update::Config(kv) = u
        && dphandler_dataplane::sync_loop::check_config(kv).is_err()
    {
        return false;
    }
    ms.iter().all(|m| m.check(u).is_ok())
}
