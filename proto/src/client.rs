//! Connecting a client to `dphandler serve`: over its unix socket, or over TCP
//! (TLS with a client certificate, or plain when the server was started with
//! `--insecure-tcp`). Used by `dphctl`, the demo and the tests.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::v1::dataplane_client::DataplaneClient;

/// Why a connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The server is not (yet) listening, or went away: a retry can help.
    #[error("cannot connect to {target}: {source}")]
    Connect {
        target: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// A TLS file could not be read: fix the path; a retry does not help.
    #[error("cannot read {path}: {source}")]
    ReadFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The address or TLS settings are wrong; a retry does not help.
    #[error("bad client settings for {target}: {source}")]
    Settings {
        target: String,
        #[source]
        source: tonic::transport::Error,
    },
}

impl ConnectError {
    /// Whether trying again later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Connect { .. })
    }
}

/// Client-side TLS files for a TCP connection.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// PEM bundle of the CA(s) that signed the server's certificate.
    pub ca: PathBuf,
    /// PEM certificate and key this client presents.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Name to check the server's certificate against (default: the host of
    /// the address).
    pub server_name: Option<String>,
}

fn read(path: &Path) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|source| ConnectError::ReadFile {
        path: path.to_path_buf(),
        source,
    })
}

/// The daemon's read-only status socket beside its socket `socket`:
/// `<name>-status.sock` (`/run/dphandler/dataplane-status.sock`).
pub fn status_socket(socket: &Path) -> std::path::PathBuf {
    let stem = socket
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    socket.with_file_name(format!("{stem}-status.sock"))
}

/// Connects over the unix socket at `path`.
pub async fn connect_unix(path: &Path) -> Result<DataplaneClient<Channel>, ConnectError> {
    channel_unix(path).await.map(DataplaneClient::new)
}

/// The channel of [`connect_unix`] (for a client of other stubs: the raw
/// ToDataplane client of [`crate::wire::raw`]).
pub async fn channel_unix(path: &Path) -> Result<Channel, ConnectError> {
    let target = path.display().to_string();
    let p = path.to_path_buf();
    // The URI is required by the HTTP/2 layer but not used: the connector
    // below ignores it and dials the socket.
    let ch = Endpoint::from_static("http://localhost")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_| {
            let p = p.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }))
        .await
        .map_err(|source| ConnectError::Connect { target, source })?;
    Ok(ch)
}

/// Connects over TCP to `addr` (`host:port`), with TLS when `tls` is given.
pub async fn connect_tcp(
    addr: &str,
    tls: Option<&TlsFiles>,
) -> Result<DataplaneClient<Channel>, ConnectError> {
    channel_tcp(addr, tls).await.map(DataplaneClient::new)
}

/// The channel of [`connect_tcp`].
pub async fn channel_tcp(addr: &str, tls: Option<&TlsFiles>) -> Result<Channel, ConnectError> {
    let target = addr.to_string();
    let settings = |source| ConnectError::Settings {
        target: target.clone(),
        source,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .map_err(settings)?
        .connect_timeout(Duration::from_secs(5));
    if let Some(t) = tls {
        let mut cfg = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(&t.ca)?))
            .identity(Identity::from_pem(read(&t.cert)?, read(&t.key)?));
        if let Some(name) = &t.server_name {
            cfg = cfg.domain_name(name.clone());
        }
        ep = ep.tls_config(cfg).map_err(settings)?;
    }
    ep.connect().await.map_err(|source| ConnectError::Connect {
        target: target.clone(),
        source,
    })
}
