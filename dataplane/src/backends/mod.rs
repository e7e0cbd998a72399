//! The seam between desired state and the kernel.
//!
//! Each backend object (an IP-set family, an iptables table, a route table)
//! holds what the managers queued and what it last read from the kernel,
//! computes the minimal diff and applies it in one batch. `apply` is the only
//! place that does I/O. Backends are synchronous (they spawn the kernel tools
//! or speak netlink on their own socket); the loop runs them off the async
//! runtime, concurrently within a phase.

pub mod cleanup;
pub mod desired;
pub mod iprules;
pub mod ipsets;
pub mod iptables;
pub mod netlink;
pub mod nftables;
pub mod recording;
pub mod routes;
pub mod sysctl;
pub mod vxlan;
pub mod wireguard;
pub mod xdp;

use std::time::Duration;

/// Order of the apply phases (Felix's `apply()`): devices that routes go
/// through (VXLAN) first; IP sets are created and
/// updated before the tables that reference them; routes and rules run
/// beside them; tables next; then the workload interfaces' settings, whose
/// `forwarding=1` lets the kernel forward IPv4 from the interface (it asks
/// the input device's knob, not `ip_forward`): only once the rules that
/// police it are in (seen with a real Felix: a new node's workloads talked
/// unpoliced for the ~15 ms between the two); IP-set deletions once nothing
/// references the sets; node-wide settings (global forwarding) last. A
/// failed phase stops the apply before the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    Links,
    IpSetUpdates,
    RoutesAndRules,
    Tables,
    InterfaceSettings,
    IpSetDeletions,
    NodeSettings,
}

impl Phase {
    pub const ALL: [Phase; 7] = [
        Phase::Links,
        Phase::IpSetUpdates,
        Phase::RoutesAndRules,
        Phase::Tables,
        Phase::InterfaceSettings,
        Phase::IpSetDeletions,
        Phase::NodeSettings,
    ];
}

/// Which refresh timer fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refresh {
    IpSets,
    Routes,
    Xdp,
    Iptables,
}

/// What a successful apply asks of the loop.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Apply again after this long (e.g. to re-read a table after a write).
    pub reschedule_after: Option<Duration>,
}

/// Errors from talking to the kernel.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A kernel tool exited non-zero. Usually transient (lock contention,
    /// a concurrent writer): retried with backoff, then a resync.
    #[error("{backend}: `{command}` failed ({status}): {stderr}")]
    Command {
        backend: &'static str,
        command: String,
        status: String,
        stderr: String,
    },
    /// An I/O error spawning or talking to the kernel.
    #[error("{backend}: {context}")]
    Io {
        backend: &'static str,
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// A kernel tool printed something we cannot read. Retried (with a
    /// fresh read).
    #[error("{backend}: cannot read the kernel's state: {reason}")]
    Parse {
        backend: &'static str,
        reason: String,
    },
    /// A netlink request failed (the kernel's errno is in `source`).
    /// Usually transient (a device that just went away): retried after a
    /// fresh read.
    #[error("{backend}: {context}")]
    Netlink {
        backend: &'static str,
        context: String,
        #[source]
        source: rtnetlink::Error,
    },
    /// nf_tables refused a commit or a read (nothing of a refused commit
    /// applied). Retried after a fresh read.
    #[error("{backend}: {source}")]
    Nftables {
        backend: &'static str,
        #[source]
        source: nftables::netlink::NftError,
    },
    /// The desired state cannot be programmed as it stands (a rule looks
    /// up a set no manager defined yet). Retried: the next message may
    /// complete it.
    #[error("{backend}: {reason}")]
    Inconsistent {
        backend: &'static str,
        reason: String,
    },
    /// A failure scripted by a recording backend (tests only).
    #[error("{backend}: scripted failure on call {call}")]
    Scripted {
        backend: &'static str,
        call: usize,
        /// Whether it stands for a failure a retry cannot mend.
        permanent: bool,
    },
}

impl BackendError {
    /// Whether a retry of the same write can help. No: a missing tool
    /// (ENOENT) or one we may not run, and a request the kernel refused
    /// as invalid for what it is (`EINVAL`, `ERANGE`, `EOPNOTSUPP`,
    /// `EAFNOSUPPORT`, `EPERM`, `E2BIG`, `EMSGSIZE`): the same request
    /// fails the same way until the desired state changes. Everything
    /// else (a lock, a busy kernel, a device that went away, a torn read)
    /// is worth retrying with backoff. The loop retries what cannot be
    /// mended only at the next change or its slow retry tick.
    pub fn retryable(&self) -> bool {
        use std::io::ErrorKind;
        match self {
            Self::Io { source, .. } => !matches!(
                source.kind(),
                ErrorKind::NotFound | ErrorKind::PermissionDenied
            ),
            Self::Netlink { source, .. } => !netlink::errno(source).is_some_and(permanent_errno),
            Self::Nftables {
                source: nftables::netlink::NftError::Refused { source, .. },
                ..
            } => !source.raw_os_error().is_some_and(permanent_errno),
            Self::Nftables {
                source: nftables::netlink::NftError::TooLarge { .. },
                ..
            } => false,
            Self::Scripted { permanent, .. } => !permanent,
            _ => true,
        }
    }
}

/// An errno that says the request itself is wrong, not the moment.
fn permanent_errno(e: i32) -> bool {
    use nix::errno::Errno;
    matches!(
        Errno::from_raw(e),
        Errno::EINVAL
            | Errno::ERANGE
            | Errno::EOPNOTSUPP
            | Errno::EAFNOSUPPORT
            | Errno::EPERM
            | Errno::E2BIG
            | Errno::EMSGSIZE
    )
}

/// The standard input for a kernel tool that reads a script: an unlinked
/// temporary file holding `input`, or `None` to fall back to a pipe (no
/// writable temporary directory). A file is read in big blocks; a pipe
/// makes the writer and the tool take turns every 64 KiB, which cost
/// ~100 ms more for a 6 MB iptables-restore input (measured).
pub(crate) fn script_file(input: &str) -> Option<std::fs::File> {
    use std::io::{Seek, Write};
    let mut f = tempfile::tempfile().ok()?;
    f.write_all(input.as_bytes()).ok()?;
    f.rewind().ok()?;
    Some(f)
}

/// How a script reaches a tool's standard input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScriptInput {
    /// Through a pipe, written while the tool reads (best for `ipset
    /// restore`: it works as the lines arrive; a 20 MB file first written
    /// to disk made a 1M-member load 10–30% slower, measured).
    Pipe,
    /// From a temporary file (best for `iptables-restore`; see
    /// [`script_file`]).
    File,
}

/// A read of the kernel (`iptables-save`, `ipset save`) that can run on
/// another thread.
pub type DetachedSave = Box<dyn FnOnce() -> Result<String, BackendError> + Send>;

/// A kernel read running on a thread of its own beside the applies, and
/// how many writes the backend had attempted when it began (a read that a
/// later write overtook may be stale).
#[derive(Debug)]
pub(crate) struct BackgroundRead<T> {
    handle: std::thread::JoinHandle<Result<T, BackendError>>,
    pub(crate) writes: u64,
}

impl<T: Send + 'static> BackgroundRead<T> {
    pub(crate) fn spawn(
        writes: u64,
        job: impl FnOnce() -> Result<T, BackendError> + Send + 'static,
    ) -> Self {
        Self {
            handle: std::thread::spawn(job),
            writes,
        }
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the result (a panic on the thread is an error here, not
    /// a crash of the loop).
    pub(crate) fn join(self, backend: &'static str) -> Result<T, BackendError> {
        self.handle.join().map_err(|_| BackendError::Parse {
            backend,
            reason: "the read's thread panicked".into(),
        })?
    }
}

/// Runs `cmd` with `input` on its standard input; returns its output.
/// `Err` only when it could not be run at all.
pub(crate) fn run_with_input(
    cmd: &mut std::process::Command,
    input: &str,
    how: ScriptInput,
) -> std::io::Result<std::process::Output> {
    use std::io::Write;
    use std::process::Stdio;
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    if how == ScriptInput::File
        && let Some(f) = script_file(input)
    {
        return cmd.stdin(f).output();
    }
    let mut child = cmd.stdin(Stdio::piped()).spawn()?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    // A write error means the tool stopped reading (it failed on a line);
    // its exit status and stderr say why.
    let _ = stdin.write_all(input.as_bytes());
    drop(stdin);
    child.wait_with_output()
}

/// One kernel object the loop drives.
pub trait Backend: Send {
    fn name(&self) -> &'static str;
    /// The phases this backend works in (IP sets: updates early, deletions
    /// last); `apply` is called once per dirty phase.
    fn phases(&self) -> &'static [Phase];
    /// Desired and observed state differ in `phase` (or a resync is pending).
    fn is_dirty(&self, phase: Phase) -> bool;
    /// A refresh timer fired: re-read the kernel at the next apply if this
    /// backend cares about `refresh`.
    fn request_resync(&mut self, refresh: Refresh);
    /// Bring the kernel to the desired state for `phase`. Blocking I/O is
    /// allowed.
    fn apply(&mut self, phase: Phase) -> Result<ApplyOutcome, BackendError>;
    /// What this backend reports in status (`GetStatus` details), as
    /// (key, value) pairs.
    fn status(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Puts this backend's state into the metrics: gauges of what it holds,
    /// and what the kernel counts into [`crate::metrics::KernelReadings`].
    /// Called after every apply; no I/O.
    fn export(&self, _m: &crate::metrics::Metrics) {}
    /// When to look at this backend again though nothing is dirty yet (a
    /// read running on another thread, to be taken in when it is done).
    fn wake_after(&self) -> Option<Duration> {
        None
    }
}

/// All backend objects, filled by the managers during
/// `complete_deferred_work`. Subsystems have typed slots, so their managers
/// reach them directly; the loop drives every one through
/// [`DesiredKernel::backends_mut`].
#[derive(Default)]
pub struct DesiredKernel {
    /// The IP sets of each family the dataplane programs (v4, then v6).
    pub ipsets: Vec<ipsets::IpSets>,
    /// The iptables tables, per IP version (`--dataplane iptables`).
    pub tables: Vec<iptables::Table>,
    /// The nftables dataplane, per IP version (`--dataplane nftables`):
    /// its own tables and sets.
    pub nftables: Vec<nftables::Dataplane>,
    /// VXLAN devices (before the routes through them).
    pub vxlan: Option<vxlan::Vxlan>,
    /// WireGuard devices and their peers.
    pub wireguard: Option<wireguard::Wireguard>,
    /// The XDP prefilter on host interfaces.
    pub xdp: Option<xdp::Xdp>,
    /// Routes, neighbours and FDB entries.
    pub routes: Option<routes::Routes>,
    /// ip rules into the routing tables we own (WireGuard's).
    pub ip_rules: Option<iprules::IpRules>,
    /// Per-interface settings of workload interfaces.
    pub sysctls: Option<sysctl::Sysctls>,
    /// Backends without a typed slot (and the recording ones in tests).
    pub others: Vec<Box<dyn Backend>>,
}

/// Every backend slot of a [`DesiredKernel`], in apply order: the one list
/// of them. `$iter` is `iter` or `iter_mut`, `$as` the trait-object
/// reference, `$inner` how a boxed one is borrowed (`as_ref`/`as_mut`).
/// A new slot goes here and in the struct, nowhere else.
macro_rules! each_backend {
    ($k:expr, $iter:ident, $as:ty, $inner:ident) => {
        std::iter::empty::<$as>()
            .chain($k.ipsets.$iter().map(|b| b as $as))
            .chain($k.tables.$iter().map(|b| b as $as))
            .chain($k.nftables.$iter().map(|b| b as $as))
            .chain($k.vxlan.$iter().map(|b| b as $as))
            .chain($k.wireguard.$iter().map(|b| b as $as))
            .chain($k.xdp.$iter().map(|b| b as $as))
            .chain($k.routes.$iter().map(|b| b as $as))
            .chain($k.ip_rules.$iter().map(|b| b as $as))
            .chain($k.sysctls.$iter().map(|b| b as $as))
            .chain($k.others.$iter().map(|b| b.$inner() as $as))
    };
}

impl std::fmt::Debug for DesiredKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DesiredKernel")
            .field(
                "backends",
                &self.backends().map(|b| b.name()).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl DesiredKernel {
    pub fn backends(&self) -> impl Iterator<Item = &dyn Backend> {
        each_backend!(self, iter, &dyn Backend, as_ref)
    }

    pub fn backends_mut(&mut self) -> impl Iterator<Item = &mut dyn Backend> {
        each_backend!(self, iter_mut, &mut dyn Backend, as_mut)
    }

    pub fn is_empty(&self) -> bool {
        self.backends().next().is_none()
    }

    /// The tables of chains the managers write into, whichever dataplane
    /// programs them.
    pub fn rule_tables_mut(&mut self) -> impl Iterator<Item = &mut dyn desired::RuleTable> {
        self.tables
            .iter_mut()
            .map(|t| t as &mut dyn desired::RuleTable)
            .chain(self.nftables.iter_mut().flat_map(|d| d.rule_tables_mut()))
    }

    /// The IP sets of each IP version, whichever dataplane programs them.
    pub fn set_stores_mut(&mut self) -> impl Iterator<Item = &mut dyn desired::SetStore> {
        self.ipsets
            .iter_mut()
            .map(|s| s as &mut dyn desired::SetStore)
            .chain(self.nftables.iter_mut().map(|d| d.set_store_mut()))
    }

    pub fn any_dirty(&mut self) -> bool {
        self.backends_mut()
            .any(|b| b.phases().iter().any(|p| b.is_dirty(*p)))
    }

    /// What backends announce (WireGuard keys), once each.
    pub fn take_events(&mut self) -> Vec<crate::status::StatusEvent> {
        self.wireguard
            .as_mut()
            .map(|w| w.take_events())
            .unwrap_or_default()
            .into_iter()
            .map(
                |(ip_version, public_key)| crate::status::StatusEvent::WireguardStatus {
                    ip_version,
                    public_key,
                },
            )
            .collect()
    }

    /// Every backend's status pairs.
    pub fn status(&mut self) -> Vec<(String, String)> {
        self.backends_mut().flat_map(|b| b.status()).collect()
    }

    /// Every backend's state into the metrics.
    pub fn export(&mut self, m: &crate::metrics::Metrics) {
        for b in self.backends_mut() {
            b.export(m);
        }
    }

    /// The soonest any backend wants to be looked at again unasked.
    pub fn wake_after(&mut self) -> Option<Duration> {
        self.backends_mut().filter_map(|b| b.wake_after()).min()
    }

    pub fn request_resync(&mut self, refresh: Refresh) {
        for b in self.backends_mut() {
            b.request_resync(refresh);
        }
    }

    /// Run every dirty backend, phase by phase; backends of one phase run
    /// concurrently on scoped threads. A failing phase stops the apply:
    /// later phases may depend on it (a rule needs its IP set).
    pub fn apply_all(&mut self) -> Result<ApplyOutcome, Vec<BackendError>> {
        let mut outcome = ApplyOutcome::default();
        for phase in Phase::ALL {
            let mut group: Vec<&mut dyn Backend> = self
                .backends_mut()
                .filter(|b| b.phases().contains(&phase) && b.is_dirty(phase))
                .collect();
            let timed = |b: &mut dyn Backend| {
                let started = std::time::Instant::now();
                let r = b.apply(phase);
                tracing::debug!(backend = b.name(), ?phase, elapsed = ?started.elapsed(), ok = r.is_ok(), "applied");
                r
            };
            let results: Vec<Result<ApplyOutcome, BackendError>> = match group.len() {
                0 => continue,
                1 => vec![timed(&mut *group[0])],
                _ => std::thread::scope(|s| {
                    let handles: Vec<_> = group
                        .iter_mut()
                        .map(|b| s.spawn(move || timed(&mut **b)))
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().expect("backend apply panicked"))
                        .collect()
                }),
            };
            let mut errors = Vec::new();
            for r in results {
                match r {
                    Ok(o) => {
                        outcome.reschedule_after =
                            match (outcome.reschedule_after, o.reschedule_after) {
                                (Some(a), Some(b)) => Some(a.min(b)),
                                (a, b) => a.or(b),
                            }
                    }
                    Err(e) => errors.push(e),
                }
            }
            if !errors.is_empty() {
                return Err(errors);
            }
        }
        Ok(outcome)
    }
}
