//! The unix-socket listener: mode 0660, a stale socket file replaced, a live
//! one refused.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use tokio::net::{UnixListener, UnixStream};

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// Another process answers on the socket: refusing to steal it. Not
    /// retryable until that process stops.
    #[error("{0} is in use by a running server; refusing to replace it")]
    InUse(String),
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

/// Bind `path`. A leftover socket nobody listens on is removed first; a
/// path that is not a socket is never removed.
pub async fn bind_unix(path: &Path) -> Result<UnixListener, ListenError> {
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
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(io(format!("setting mode 0660 on {shown}")))?;
    Ok(listener)
}
