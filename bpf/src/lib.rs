//! dphandler's XDP prefilter: the program (C, `src/filter.c`, built by
//! `build.sh` into the committed `filter.o`) and its loader over aya.
//!
//! Per host interface the program passes packets to a failsafe port
//! (protocol + destination port), drops packets whose source is in the
//! interface's blocklist (an LPM trie per IP family) and passes the rest,
//! counting each verdict per CPU. Kernel objects owned, per interface
//! `<iface>`: the XDP link on it and, under `<bpffs>/dphandler/xdp/<iface>/`,
//! the pinned link (`link`) and maps (`failsafe`, `blocklist_v4`,
//! `blocklist_v6`, `verdicts`). The pins keep the program attached and the
//! maps filled while the daemon is down; a restarted daemon loads the
//! program again and swaps it into the pinned link atomically (no moment
//! without the filter), reusing the maps.

pub mod filter;

pub use filter::{Filter, Mode, Verdicts, XdpError};

/// The compiled program (see `build.sh`), aligned as aya's ELF parser
/// needs.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!("../filter.o");

/// `statfs` magic of a bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Makes sure a bpffs is mounted at `path` (created if missing); `true`
/// when this call mounted it. Pins live only as long as their bpffs: in a
/// namespace of `ip netns exec` (which mounts a fresh `/sys`), give a path
/// outside `/sys` that the host has mounted.
pub fn ensure_bpffs(path: &std::path::Path) -> std::io::Result<bool> {
    std::fs::create_dir_all(path)?;
    let st = nix::sys::statfs::statfs(path).map_err(std::io::Error::from)?;
    if st.filesystem_type().0 as i64 == BPF_FS_MAGIC {
        return Ok(false);
    }
    nix::mount::mount(
        Some("bpf"),
        path,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(std::io::Error::from)?;
    Ok(true)
}
