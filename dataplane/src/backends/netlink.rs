//! One rtnetlink socket owned by one backend, used from its synchronous
//! `apply`.
//!
//! Backends apply on plain threads (the loop runs each phase's backends on
//! scoped threads inside `spawn_blocking`), while the `rtnetlink` crate is
//! async. Each backend therefore owns a current-thread tokio runtime with
//! its connection task spawned on it, and blocks on it for each request:
//! the socket is opened once, in the namespace the daemon runs in, and is
//! driven only while the backend waits on it (a current-thread runtime runs
//! its tasks inside `block_on`). `block_on` is never called from async
//! code: applies run inside `block_in_place` (the daemon), on the blocking
//! pool (`spawn_blocking`, current-thread runtimes) or on the scoped
//! threads of a phase, where blocking is allowed.

use std::future::Future;

use rtnetlink::Handle;

use super::BackendError;

/// A netlink connection of one backend.
#[derive(Debug)]
pub struct Netlink {
    backend: &'static str,
    /// Always `Some` until dropped.
    runtime: Option<tokio::runtime::Runtime>,
    handle: Handle,
}

impl Netlink {
    /// Opens the socket (in the caller's network namespace). May be called
    /// from async code (the daemon opens its sockets at start): the socket
    /// is registered with our runtime by entering it, not by blocking on
    /// it.
    pub fn open(backend: &'static str) -> Result<Self, BackendError> {
        let io = |context: &str, source| BackendError::Io {
            backend,
            context: context.into(),
            source,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| io("building the netlink runtime", e))?;
        let (conn, handle, _) = {
            let _in = runtime.enter();
            rtnetlink::new_connection().map_err(|e| io("opening an rtnetlink socket", e))?
        };
        runtime.spawn(conn);
        Ok(Self {
            backend,
            runtime: Some(runtime),
            handle,
        })
    }

    pub fn handle(&self) -> Handle {
        self.handle.clone()
    }

    /// Runs `f` to completion on our runtime. Only from a blocking thread
    /// (a backend's apply), never from async code.
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.runtime
            .as_ref()
            .expect("the runtime lives until drop")
            .block_on(f)
    }

    /// A netlink error as a backend error.
    pub fn error(&self, context: impl Into<String>, source: rtnetlink::Error) -> BackendError {
        BackendError::Netlink {
            backend: self.backend,
            context: context.into(),
            source,
        }
    }
}

impl Drop for Netlink {
    /// Without waiting: the backends are dropped by the loop's task, in
    /// async code, where a blocking runtime shutdown would panic.
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// The errno of a netlink error reply (positive), if it is one.
pub fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| -c.get()),
        _ => None,
    }
}
