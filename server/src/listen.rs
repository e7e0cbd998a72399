//! The unix-socket listeners: mode 0660 (group: `--socket-group`, else the
//! daemon's), a stale socket file replaced, a live one refused; the socket
//! has its owner and mode before anyone can reach it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use nix::unistd::{Gid, Group, chown};
use tokio::net::{UnixListener, UnixStream};

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// Another process answers on the socket: refusing to steal it. Not
    /// retryable until that process stops.
    #[error("{0} is in use by a running server; refusing to replace it")]
    InUse(String),
    /// `--socket-group` names no group on this host (fix the flag).
    #[error("no group named {0:?} on this host")]
    NoGroup(String),
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> ListenError {
    move |source| ListenError::Io { context, source }
}

/// The group `--socket-group` names: a number is taken as it is, a name
/// is looked up.
pub fn group(name: &str) -> Result<Gid, ListenError> {
    if let Ok(n) = name.parse::<u32>() {
        return Ok(Gid::from_raw(n));
    }
    match Group::from_name(name) {
        Ok(Some(g)) => Ok(g.gid),
        Ok(None) => Err(ListenError::NoGroup(name.to_string())),
        Err(e) => Err(ListenError::Io {
            context: format!("looking up group {name:?}"),
            source: e.into(),
        }),
    }
}

/// Bind `path`, owned by `group` if given. A leftover socket nobody
/// listens on is removed first; a path that is not a socket is never
/// removed.
pub async fn bind_unix(path: &Path, group: Option<Gid>) -> Result<UnixListener, ListenError> {
    bind_unix_mode(path, group, 0o660).await
}

/// [`bind_unix`] with the socket's `mode`.
pub async fn bind_unix_mode(
    path: &Path,
    group: Option<Gid>,
    mode: u32,
) -> Result<UnixListener, ListenError> {
    let shown = path.display().to_string();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(ListenError::Io {
                    context: format!("{shown} exists and is not a socket"),
                    source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
                });
            }
            if UnixStream::connect(path).await.is_ok() {
                return Err(ListenError::InUse(shown));
            }
            std::fs::remove_file(path).map_err(io(format!("removing stale socket {shown}")))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(format!("inspecting {shown}"))(e)),
    }
    // Bound in a directory only we can enter, given its owner and mode
    // there, then moved into place: at no moment can anyone connect to it
    // with the mode the umask would have given it.
    let dir = path.parent().unwrap_or(Path::new("."));
    let private = tempfile::Builder::new()
        .prefix(".dphandler-bind-")
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(dir)
        .map_err(io(format!(
            "making a private directory in {}",
            dir.display()
        )))?;
    let staged = private.path().join("s");
    let listener = UnixListener::bind(&staged).map_err(io(format!("binding {shown}")))?;
    if let Some(gid) = group {
        chown(&staged, None, Some(gid))
            .map_err(|e| io(format!("giving {shown} to group {gid}"))(e.into()))?;
    }
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode))
        .map_err(io(format!("setting mode {mode:o} on {shown}")))?;
    std::fs::rename(&staged, path).map_err(io(format!("moving the socket to {shown}")))?;
    Ok(listener)
}
