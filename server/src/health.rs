//! Felix-style health over HTTP (`--health-addr`): `/liveness` answers 200
//! while the sync loop turns (it turns at least every few seconds when
//! idle; a loop blocked longer than `--liveness-timeout-seconds` is not
//! live), `/readiness` 200 once the dataplane is in sync and the last apply
//! succeeded; 503 otherwise, each with a short JSON reason. Served with
//! hyper (already the gRPC server's HTTP stack), one task per connection.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dphandler_dataplane::sync_loop::{Status, alive_now};
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::sync::watch;
use tracing::{debug, info, warn};

/// What the probes look at.
#[derive(Debug, Clone)]
pub struct Health {
    pub status: watch::Receiver<Status>,
    pub alive: Arc<AtomicU64>,
    pub liveness_timeout: Duration,
}

fn json_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| match c {
            '"' => vec!['\\', '"'],
            '\\' => vec!['\\', '\\'],
            c if c.is_control() => vec![' '],
            c => vec![c],
        })
        .collect()
}

impl Health {
    /// (ok, reason) of a probe.
    pub fn liveness(&self) -> (bool, String) {
        let since = alive_now().saturating_sub(self.alive.load(Ordering::Relaxed));
        let limit = self.liveness_timeout.as_millis() as u64;
        if since <= limit {
            (true, format!("the sync loop turned {since} ms ago"))
        } else {
            (
                false,
                format!("the sync loop has not turned for {since} ms (limit {limit} ms)"),
            )
        }
    }

    pub fn readiness(&self) -> (bool, String) {
        let s = self.status.borrow();
        if !s.in_sync {
            let waiting = if !s.datastore_in_sync {
                "the calc graph's InSync"
            } else if !s.interfaces_in_sync {
                "the interface monitor's first dump"
            } else {
                "the first complete apply"
            };
            return (false, format!("not in sync yet: waiting for {waiting}"));
        }
        match &s.last_error {
            Some(e) => (false, format!("the last apply failed: {e}")),
            None => (true, "in sync".into()),
        }
    }

    fn answer(&self, path: &str) -> Response<Full<Bytes>> {
        let (code, body) = match path {
            "/liveness" | "/readiness" => {
                let (ok, reason) = if path == "/liveness" {
                    self.liveness()
                } else {
                    self.readiness()
                };
                let code = if ok {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                let key = &path[1..];
                (
                    code,
                    format!(
                        "{{\"{key}\":{ok},\"reason\":\"{}\"}}\n",
                        json_escape(&reason)
                    ),
                )
            }
            _ => (
                StatusCode::NOT_FOUND,
                "{\"error\":\"not found: /liveness or /readiness\"}\n".to_string(),
            ),
        };
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = code;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        r
    }
}

/// Serves the probes on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, health: Health) {
    serve_with(listener, "health", move |path| health.answer(path)).await;
}

/// Serves `/metrics` (Prometheus text format) from `registry`.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    registry: std::sync::Arc<prometheus_client::registry::Registry>,
) {
    serve_with(listener, "metrics", move |path| {
        let (code, ctype, body) = if path == "/metrics" {
            let mut out = String::new();
            match prometheus_client::encoding::text::encode(&mut out, &registry) {
                Ok(()) => (
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    out,
                ),
                Err(e) => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    format!("encoding the metrics: {e}\n"),
                ),
            }
        } else {
            (
                StatusCode::NOT_FOUND,
                "text/plain",
                "not found: /metrics\n".into(),
            )
        };
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = code;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static(ctype),
        );
        r
    })
    .await;
}

/// A plain HTTP/1 server: `answer` maps a path to a response.
async fn serve_with(
    listener: tokio::net::TcpListener,
    what: &'static str,
    answer: impl Fn(&str) -> Response<Full<Bytes>> + Clone + Send + Sync + 'static,
) {
    if let Ok(a) = listener.local_addr() {
        info!(addr = %a, "{what} endpoint listening");
    }
    // Probes and scrapes are a few at a time: more connections than this
    // wait in the backlog (each holds a file descriptor and a task).
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_HTTP_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors (EMFILE, ENFILE) or memory: the
                // connection waits in the backlog; retrying at once only
                // spun a core.
                warn!(error = %e, "{what} endpoint: accept failed; trying again in 100 ms");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let answer = answer.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                let r = answer(req.uri().path());
                async move { Ok::<_, Infallible>(r) }
            });
            // A client that sends nothing, or too slowly, is let go.
            let conn = http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HTTP_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc);
            match tokio::time::timeout(HTTP_TIMEOUT * 2, conn).await {
                Ok(Err(e)) => debug!(%peer, error = %e, "{what} connection"),
                Ok(Ok(())) => {}
                Err(_) => debug!(%peer, "{what} connection: too slow, closed"),
            }
        });
    }
}

/// Connections the health and metrics endpoints serve at once (each).
const MAX_HTTP_CONNECTIONS: usize = 32;
/// How long a health or metrics request may take to arrive.
const HTTP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// `none` turns an address flag off.
pub fn parse_addr(s: &str) -> Result<Option<SocketAddr>, String> {
    if s == "none" {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .map_err(|_| format!("{s:?}: expected ADDRESS:PORT or none"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(status: Status, turned_ms_ago: u64) -> Health {
        let (_tx, rx) = watch::channel(status);
        Health {
            status: rx,
            alive: Arc::new(AtomicU64::new(alive_now() - turned_ms_ago)),
            liveness_timeout: Duration::from_secs(2),
        }
    }

    #[test]
    fn readiness_and_liveness_say_why() {
        let h = health(Status::default(), 0);
        let (ok, why) = h.readiness();
        assert!(!ok && why.contains("InSync"), "{why}");
        assert!(h.liveness().0);
        let h = health(
            Status {
                in_sync: true,
                datastore_in_sync: true,
                interfaces_in_sync: true,
                last_error: Some("ipsets: \"x\" failed".into()),
                ..Status::default()
            },
            5_000,
        );
        let (ok, why) = h.readiness();
        assert!(!ok && why.contains("last apply failed"), "{why}");
        let (ok, why) = h.liveness();
        assert!(!ok && why.contains("not turned"), "{why}");
        let r = h.answer("/readiness");
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(h.answer("/nope").status(), StatusCode::NOT_FOUND);
        assert_eq!(
            json_escape("a \"b\" \\ c\n"),
            "a \\\"b\\\" \\\\ c ".to_string()
        );
    }
}
