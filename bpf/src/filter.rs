//! The prefilter on one interface: load, attach (or take over the pinned
//! link), maps by delta, counters, removal.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{HashMap as BpfHashMap, MapData, PerCpuArray};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::xdp::XdpLink;
use aya::programs::{Xdp, XdpMode};
use aya::{Ebpf, EbpfLoader};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use tracing::{info, warn};

/// Why XDP could not be programmed on an interface. The raw table's rules
/// still apply either way.
#[derive(Debug, thiserror::Error)]
pub enum XdpError {
    #[error("{iface}: loading the XDP program: {source}")]
    Load {
        iface: String,
        #[source]
        source: Box<aya::EbpfError>,
    },
    #[error("{iface}: {context}: {source}")]
    Program {
        iface: String,
        context: &'static str,
        #[source]
        source: Box<aya::programs::ProgramError>,
    },
    #[error("{iface}: {context}: {source}")]
    Map {
        iface: String,
        context: &'static str,
        #[source]
        source: Box<aya::maps::MapError>,
    },
    #[error("{iface}: {context}: {source}")]
    Link {
        iface: String,
        context: &'static str,
        #[source]
        source: Box<aya::programs::links::LinkError>,
    },
    #[error("{iface}: pinning {what}: {source}")]
    Pin {
        iface: String,
        what: &'static str,
        #[source]
        source: Box<aya::pin::PinError>,
    },
    #[error("{iface}: {context}: {source}")]
    Io {
        iface: String,
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// No mode would attach (the reasons, per mode).
    #[error("{iface}: XDP cannot attach here: {reasons}")]
    Unsupported { iface: String, reasons: String },
}

impl XdpError {
    /// Whether trying again can help (an interface that takes no XDP will
    /// not start to by itself; everything else may be transient).
    pub fn retryable(&self) -> bool {
        !matches!(self, Self::Unsupported { .. })
    }
}

/// How the program sits on the interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// In the driver (native XDP).
    Driver,
    /// In the kernel's generic path (skb).
    Generic,
    /// Taken over from the pinned link of an earlier run (the mode it
    /// was attached in).
    Adopted,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Driver => "driver",
            Self::Generic => "generic",
            Self::Adopted => "adopted",
        }
    }
}

/// (packets, bytes) of each verdict, summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Verdicts {
    pub passed: (u64, u64),
    pub failsafe: (u64, u64),
    pub dropped: (u64, u64),
}

/// The prefilter on one interface.
#[derive(Debug)]
pub struct Filter {
    iface: String,
    dir: PathBuf,
    ebpf: Ebpf,
    mode: Mode,
}

type V4 = [u8; 4];
type V6 = [u8; 16];

impl Filter {
    /// Where an interface's pins live.
    pub fn dir(bpffs: &Path, iface: &str) -> PathBuf {
        bpffs.join("dphandler").join("xdp").join(iface)
    }

    /// Loads the program for `iface` with its maps pinned in
    /// [`Filter::dir`] (reusing pinned ones), and attaches it: into the
    /// pinned link of an earlier run when there is one (an atomic swap),
    /// else in the first of `modes` that takes, pinning the new link.
    pub fn attach(bpffs: &Path, iface: &str, modes: &[Mode]) -> Result<Self, XdpError> {
        let dir = Self::dir(bpffs, iface);
        fs::create_dir_all(&dir).map_err(|source| XdpError::Io {
            iface: iface.into(),
            context: format!("creating {}", dir.display()),
            source,
        })?;
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(&dir)
            .load(crate::OBJECT)
            .map_err(|source| XdpError::Load {
                iface: iface.into(),
                source: Box::new(source),
            })?;
        let prog_err = |context| {
            let iface = iface.to_string();
            move |source| XdpError::Program {
                iface,
                context,
                source: Box::new(source),
            }
        };
        let prog: &mut Xdp = ebpf
            .program_mut("prefilter")
            .expect("the object has the prefilter program")
            .try_into()
            .map_err(prog_err("the prefilter is not an XDP program"))?;
        prog.load().map_err(prog_err("loading into the kernel"))?;
        let link_path = dir.join("link");
        let mut mode = None;
        if link_path.exists() {
            match Self::take_over(prog, &link_path) {
                Ok(()) => mode = Some(Mode::Adopted),
                Err(e) => {
                    // A link whose interface went away (or a stray file):
                    // start afresh.
                    warn!(iface, error = %e, "cannot take over the pinned XDP link; attaching anew");
                    let _ = fs::remove_file(&link_path);
                }
            }
        }
        let mode = match mode {
            Some(m) => m,
            None => {
                let mut reasons = Vec::new();
                let mut attached = None;
                for m in modes {
                    let xm = match m {
                        Mode::Driver => XdpMode::Driver,
                        Mode::Generic => XdpMode::Skb,
                        Mode::Adopted => continue,
                    };
                    match prog.attach(iface, xm) {
                        Ok(id) => {
                            attached = Some((id, *m));
                            break;
                        }
                        Err(e) => reasons.push(format!("{}: {e}", m.as_str())),
                    }
                }
                let (id, m) = attached.ok_or_else(|| XdpError::Unsupported {
                    iface: iface.into(),
                    reasons: reasons.join("; "),
                })?;
                let link = prog.take_link(id).map_err(prog_err("taking the link"))?;
                // A bpf_link pinned outlives the daemon (a netlink-attached
                // program cannot be pinned; kernels since 5.9 give links).
                let fd: FdLink = link.try_into().map_err(|source| XdpError::Link {
                    iface: iface.into(),
                    context: "this kernel attached XDP without a bpf_link",
                    source: Box::new(source),
                })?;
                fd.pin(&link_path).map_err(|source| XdpError::Pin {
                    iface: iface.into(),
                    what: "the XDP link",
                    source: Box::new(source),
                })?;
                m
            }
        };
        info!(iface, mode = mode.as_str(), "XDP prefilter attached");
        Ok(Self {
            iface: iface.into(),
            dir,
            ebpf,
            mode,
        })
    }

    /// Swaps our freshly loaded program into the pinned link.
    fn take_over(prog: &mut Xdp, link_path: &Path) -> Result<(), String> {
        let pinned = PinnedLink::from_pin(link_path).map_err(|e| e.to_string())?;
        let link = XdpLink::try_from(FdLink::from(pinned)).map_err(|e| e.to_string())?;
        prog.attach_to_link(link).map_err(|e| e.to_string())?;
        Ok(())
    }

    pub fn iface(&self) -> &str {
        &self.iface
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    fn map(&mut self, name: &str) -> &mut aya::maps::Map {
        self.ebpf
            .map_mut(name)
            .expect("the object has the prefilter's maps")
    }

    /// Makes the failsafe map hold exactly `ports` ((protocol number,
    /// destination port)).
    pub fn set_failsafe(&mut self, ports: &[(u8, u16)]) -> Result<(), XdpError> {
        let iface = self.iface.clone();
        let err = map_err(&iface, "the failsafe map");
        let want: BTreeSet<[u8; 4]> = ports
            .iter()
            .map(|(proto, port)| {
                let p = port.to_ne_bytes();
                [*proto, 0, p[0], p[1]]
            })
            .collect();
        let mut m: BpfHashMap<&mut MapData, [u8; 4], u8> =
            BpfHashMap::try_from(self.map("failsafe")).map_err(err)?;
        let have: BTreeSet<[u8; 4]> = m.keys().filter_map(Result::ok).collect();
        let err = map_err(&iface, "the failsafe map");
        let mut r = Ok(());
        for k in have.difference(&want) {
            r = r.and(m.remove(k));
        }
        for k in want.difference(&have) {
            r = r.and(m.insert(k, 1, 0));
        }
        r.map_err(err)
    }

    /// Adds and removes blocklist prefixes (both families).
    pub fn update_blocklist(&mut self, add: &[IpNet], remove: &[IpNet]) -> Result<(), XdpError> {
        let iface = self.iface.clone();
        let (add4, add6) = split(add);
        let (del4, del6) = split(remove);
        {
            let err = map_err(&iface, "the IPv4 blocklist");
            let mut m: LpmTrie<&mut MapData, V4, u32> =
                LpmTrie::try_from(self.map("blocklist_v4")).map_err(err)?;
            let err = map_err(&iface, "the IPv4 blocklist");
            let mut r = Ok(());
            for n in &del4 {
                match m.remove(&v4_key(n)) {
                    Err(aya::maps::MapError::KeyNotFound) => {}
                    other => r = r.and(other),
                }
            }
            for n in &add4 {
                r = r.and(m.insert(&v4_key(n), 1, 0));
            }
            r.map_err(err)?;
        }
        let err = map_err(&iface, "the IPv6 blocklist");
        let mut m: LpmTrie<&mut MapData, V6, u32> =
            LpmTrie::try_from(self.map("blocklist_v6")).map_err(err)?;
        let err = map_err(&iface, "the IPv6 blocklist");
        let mut r = Ok(());
        for n in &del6 {
            match m.remove(&v6_key(n)) {
                Err(aya::maps::MapError::KeyNotFound) => {}
                other => r = r.and(other),
            }
        }
        for n in &add6 {
            r = r.and(m.insert(&v6_key(n), 1, 0));
        }
        r.map_err(err)
    }

    /// The prefixes the blocklists hold (what the kernel has: a refresh
    /// compares it with what should be there).
    pub fn blocklist(&mut self) -> Result<BTreeSet<IpNet>, XdpError> {
        let iface = self.iface.clone();
        let mut out = BTreeSet::new();
        let err = map_err(&iface, "reading the IPv4 blocklist");
        let m: LpmTrie<&mut MapData, V4, u32> =
            LpmTrie::try_from(self.map("blocklist_v4")).map_err(err)?;
        for k in m.keys() {
            let k = k.map_err(map_err(&iface, "reading the IPv4 blocklist"))?;
            if let Ok(n) = Ipv4Net::new(k.data().into(), k.prefix_len() as u8) {
                out.insert(IpNet::V4(n));
            }
        }
        let err = map_err(&iface, "reading the IPv6 blocklist");
        let m: LpmTrie<&mut MapData, V6, u32> =
            LpmTrie::try_from(self.map("blocklist_v6")).map_err(err)?;
        for k in m.keys() {
            let k = k.map_err(map_err(&iface, "reading the IPv6 blocklist"))?;
            if let Ok(n) = Ipv6Net::new(k.data().into(), k.prefix_len() as u8) {
                out.insert(IpNet::V6(n));
            }
        }
        Ok(out)
    }

    /// The verdict counters, summed over CPUs.
    pub fn verdicts(&mut self) -> Result<Verdicts, XdpError> {
        let iface = self.iface.clone();
        let err = map_err(&iface, "reading the counters");
        let m: PerCpuArray<&mut MapData, [u64; 2]> =
            PerCpuArray::try_from(self.map("verdicts")).map_err(err)?;
        let mut sums = [(0u64, 0u64); 3];
        for (i, sum) in sums.iter_mut().enumerate() {
            let per_cpu = m
                .get(&(i as u32), 0)
                .map_err(map_err(&iface, "reading the counters"))?;
            for v in per_cpu.iter() {
                sum.0 += v[0];
                sum.1 += v[1];
            }
        }
        Ok(Verdicts {
            passed: sums[0],
            failsafe: sums[1],
            dropped: sums[2],
        })
    }

    /// Detaches the program from the interface and removes its pins.
    pub fn detach(self) -> Result<(), XdpError> {
        let Self {
            iface, ebpf, dir, ..
        } = self;
        // Our descriptors first: the link goes once its pin does too.
        drop(ebpf);
        remove_pins(&iface, &dir)
    }

    /// Removes the pins of `iface` under `bpffs` (the link, hence the
    /// program, and the maps), whether or not this run attached them.
    pub fn remove(bpffs: &Path, iface: &str) -> Result<(), XdpError> {
        remove_pins(iface, &Self::dir(bpffs, iface))
    }

    /// This filter's pin directory.
    pub fn pins(&self) -> &Path {
        &self.dir
    }
}

fn map_err(
    iface: &str,
    context: &'static str,
) -> impl FnOnce(aya::maps::MapError) -> XdpError + use<> {
    let iface = iface.to_string();
    move |source| XdpError::Map {
        iface,
        context,
        source: Box::new(source),
    }
}

fn remove_pins(iface: &str, dir: &Path) -> Result<(), XdpError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(XdpError::Io {
                iface: iface.into(),
                context: format!("reading {}", dir.display()),
                source,
            });
        }
    };
    for e in entries.flatten() {
        let _ = fs::remove_file(e.path());
    }
    fs::remove_dir(dir).map_err(|source| XdpError::Io {
        iface: iface.into(),
        context: format!("removing {}", dir.display()),
        source,
    })?;
    info!(iface, "XDP prefilter removed");
    Ok(())
}

fn split(nets: &[IpNet]) -> (Vec<Ipv4Net>, Vec<Ipv6Net>) {
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for n in nets {
        match n {
            IpNet::V4(n) => v4.push(*n),
            IpNet::V6(n) => v6.push(*n),
        }
    }
    (v4, v6)
}

fn v4_key(n: &Ipv4Net) -> Key<V4> {
    Key::new(u32::from(n.prefix_len()), n.trunc().addr().octets())
}

fn v6_key(n: &Ipv6Net) -> Key<V6> {
    Key::new(u32::from(n.prefix_len()), n.trunc().addr().octets())
}
