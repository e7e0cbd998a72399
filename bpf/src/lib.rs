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
