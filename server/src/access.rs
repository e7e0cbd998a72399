//! Who may do what on a listener, before a handler runs: the read-only
//! status socket (no `ToDataplane`), the client names a TCP listener's
//! certificates must carry, and how many connections a listener holds.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::{Connected, TcpConnectInfo, TlsConnectInfo};

/// The method that changes the dataplane.
const FEED: &str = "/dphandler.v1.Dataplane/ToDataplane";

/// What a listener allows.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Everything but `ToDataplane` (GetStatus, StatusUpdates, health,
    /// reflection): for those who only watch.
    pub read_only: bool,
    /// Names (DNS SANs) of which a client certificate must carry one;
    /// empty: any certificate the CA signed.
    pub client_names: Arc<[String]>,
}

impl Access {
    /// Why `req` is refused, if it is.
    fn refuse<B>(&self, req: &http::Request<B>) -> Option<tonic::Status> {
        if self.read_only && req.uri().path() == FEED {
            return Some(tonic::Status::permission_denied(
                "this socket is read-only (GetStatus, StatusUpdates, health, reflection): \
                 feed the dataplane through its --socket",
            ));
        }
        if self.client_names.is_empty() {
            return None;
        }
        let certs = req
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(TlsConnectInfo::peer_certs);
        let Some(leaf) = certs.as_ref().and_then(|c| c.first()) else {
            return Some(tonic::Status::unauthenticated("no client certificate"));
        };
        let Ok(cert) = webpki::EndEntityCert::try_from(leaf) else {
            return Some(tonic::Status::unauthenticated(
                "the client certificate cannot be read",
            ));
        };
        let named = self.client_names.iter().any(|n| {
            rustls_pki_types::ServerName::try_from(n.as_str())
                .is_ok_and(|name| cert.verify_is_valid_for_subject_name(&name).is_ok())
        });
        (!named).then(|| {
            tonic::Status::permission_denied(format!(
                "the client certificate names none of {:?} (--tls-client-name)",
                self.client_names
            ))
        })
    }
}

impl<S> tower::Layer<S> for Access {
    type Service = AccessService<S>;
    fn layer(&self, inner: S) -> AccessService<S> {
        AccessService {
            inner,
            access: self.clone(),
        }
    }
}

/// [`Access`] in front of a service.
#[derive(Debug, Clone)]
pub struct AccessService<S> {
    inner: S,
    access: Access,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for AccessService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        match self.access.refuse(&req) {
            Some(status) => Box::pin(std::future::ready(Ok(status.into_http()))),
            None => Box::pin(self.inner.call(req)),
        }
    }
}

/// A connection that holds one of its listener's slots while it is open.
#[derive(Debug)]
pub struct Limited<IO> {
    io: IO,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

/// `incoming` with at most `max` connections open at once: the next one
/// is accepted only when one closes (the rest wait in the backlog).
pub fn limit_connections<S, IO, E>(
    incoming: S,
    max: usize,
) -> impl Stream<Item = Result<Limited<IO>, E>>
where
    S: Stream<Item = Result<IO, E>>,
{
    let slots = Arc::new(tokio::sync::Semaphore::new(max.max(1)));
    // A slot first, then the next accept: so at most `max` are open.
    futures::stream::unfold((Box::pin(incoming), slots), |(mut s, slots)| async move {
        let slot = slots.clone().acquire_owned().await.ok()?;
        let next = s.next().await?;
        Some((next.map(|io| Limited { io, _slot: slot }), (s, slots)))
    })
}

impl<IO: Connected> Connected for Limited<IO> {
    type ConnectInfo = IO::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Limited<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Limited<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}
