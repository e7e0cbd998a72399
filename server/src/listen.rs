//! The unix-socket listener: mode 0660 (group: `--socket-group`, else the
//! daemon's), a stale socket file replaced, a live one refused.

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
    let listener = UnixListener::bind(path).map_err(io(format!("binding {shown}")))?;
    if let Some(gid) = group {
        chown(path, None, Some(gid))
            .map_err(|e| io(format!("giving {shown} to group {gid}"))(e.into()))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(io(format!("setting mode 0660 on {shown}")))?;
    Ok(listener)
}
