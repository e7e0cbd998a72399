//! Per-peer rate limits, keyed by who is calling: the peer's IP address on
//! TCP, its uid on the unix socket (from `SO_PEERCRED`).
//!
//! - **Calls** (tower_governor): one call (a whole `ToDataplane` stream
//!   counts once) takes one token; a peer over its quota gets
//!   `RESOURCE_EXHAUSTED` with a `retry-after` header.
//! - **Messages** on `ToDataplane` streams (governor, keyed): each message
//!   takes one token from its peer's quota, over all of that peer's
//!   streams. A peer over its quota is slowed down, not cut off: its
//!   stream's reader waits for the next token before reading on, so
//!   HTTP/2 flow control holds the feeder back and nothing it sent is lost.
//!
//! Other peers are not affected by either.

use std::net::IpAddr;
use std::time::Duration;

use governor::middleware::NoOpMiddleware;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo, UdsConnectInfo};
use tower_governor::GovernorError;
use tower_governor::governor::{GovernorConfig, GovernorConfigBuilder};
use tower_governor::key_extractor::KeyExtractor;

/// Who is calling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerKey {
    Ip(IpAddr),
    Uid(u32),
}

/// Finds the [`PeerKey`] in the connection info tonic attaches to each
/// request. A request without one (which tonic does not produce) is refused
/// rather than let through unlimited.
#[derive(Debug, Clone, Copy, Default)]
pub struct PeerKeyExtractor;

impl KeyExtractor for PeerKeyExtractor {
    type Key = PeerKey;

    fn extract<T>(&self, req: &http::Request<T>) -> Result<PeerKey, GovernorError> {
        peer_of(req.extensions()).ok_or(GovernorError::UnableToExtractKey)
    }
}

/// The peer of a request, from the connection info tonic attaches.
pub fn peer_of(ext: &http::Extensions) -> Option<PeerKey> {
    let tcp = ext.get::<TcpConnectInfo>().or_else(|| {
        ext.get::<TlsConnectInfo<TcpConnectInfo>>()
            .map(|t| t.get_ref())
    });
    if let Some(addr) = tcp.and_then(|t| t.remote_addr()) {
        return Some(PeerKey::Ip(addr.ip()));
    }
    ext.get::<UdsConnectInfo>()
        .and_then(|u| u.peer_cred)
        .map(|c| PeerKey::Uid(c.uid()))
}

/// Messages per peer over its `ToDataplane` streams.
pub type MessageLimiter = governor::DefaultKeyedRateLimiter<PeerKey>;

/// Peers remembered before those back at a full quota are forgotten.
const MESSAGE_PEERS_KEPT: usize = 1024;

/// A quota of `per_second` messages per peer, with bursts of up to
/// `burst` (a snapshot is one burst).
pub fn message_limiter(per_second: f64, burst: u32) -> Result<MessageLimiter, LimitError> {
    let quota = governor::Quota::with_period(period(per_second)?)
        .ok_or(LimitError::Rate(per_second))?
        .allow_burst(std::num::NonZeroU32::new(burst).ok_or(LimitError::Burst)?);
    Ok(governor::RateLimiter::keyed(quota))
}

/// Takes one message's token from `peer`'s quota, waiting for it when the
/// quota is spent; returns whether it had to wait.
pub async fn take_message(limiter: &MessageLimiter, peer: &PeerKey) -> bool {
    if limiter.check_key(peer).is_ok() {
        return false;
    }
    if limiter.len() > MESSAGE_PEERS_KEPT {
        limiter.retain_recent();
    }
    limiter.until_key_ready(peer).await;
    true
}

fn period(per_second: f64) -> Result<Duration, LimitError> {
    if !(per_second.is_finite() && per_second > 0.0) {
        return Err(LimitError::Rate(per_second));
    }
    Ok(Duration::try_from_secs_f64(1.0 / per_second)
        .map_err(|_| LimitError::Rate(per_second))?
        .max(Duration::from_nanos(1)))
}

/// Why a rate-limit setting was refused (fix the flags; no retry helps).
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    #[error("the rate limit must be a positive number of calls per second, not {0}")]
    Rate(f64),
    #[error("the burst must be at least 1")]
    Burst,
}

/// A quota of `per_second` calls per peer, with bursts of up to `burst`.
pub fn governor_config(
    per_second: f64,
    burst: u32,
) -> Result<GovernorConfig<PeerKeyExtractor, NoOpMiddleware>, LimitError> {
    let period = period(per_second)?;
    if burst == 0 {
        return Err(LimitError::Burst);
    }
    GovernorConfigBuilder::default()
        .key_extractor(PeerKeyExtractor)
        .period(period)
        .burst_size(burst)
        .finish()
        .ok_or(LimitError::Rate(per_second))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_peers_are_keyed_by_ip() {
        let mut req = http::Request::new(());
        assert!(matches!(
            PeerKeyExtractor.extract(&req),
            Err(GovernorError::UnableToExtractKey)
        ));
        req.extensions_mut().insert(TcpConnectInfo {
            local_addr: Some("127.0.0.1:50051".parse().unwrap()),
            remote_addr: Some("10.1.2.3:40000".parse().unwrap()),
        });
        assert_eq!(
            PeerKeyExtractor.extract(&req).unwrap(),
            PeerKey::Ip("10.1.2.3".parse().unwrap())
        );
    }

    #[test]
    fn quota_is_per_peer() {
        let cfg = governor_config(1.0, 2).unwrap();
        let a = PeerKey::Ip("10.0.0.1".parse().unwrap());
        let b = PeerKey::Uid(0);
        let l = cfg.limiter();
        assert!(l.check_key(&a).is_ok());
        assert!(l.check_key(&a).is_ok());
        assert!(l.check_key(&a).is_err(), "burst of 2 used up");
        assert!(l.check_key(&b).is_ok(), "another peer is not affected");
    }

    #[tokio::test]
    async fn messages_over_the_quota_wait_and_other_peers_do_not() {
        let l = message_limiter(20.0, 3).unwrap();
        let a = PeerKey::Uid(1000);
        let b = PeerKey::Uid(1001);
        for _ in 0..3 {
            assert!(!take_message(&l, &a).await, "within the burst");
        }
        let t = std::time::Instant::now();
        assert!(take_message(&l, &a).await, "over the burst: waited");
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(30) && waited < Duration::from_secs(1),
            "one token at 20/s: {waited:?}"
        );
        assert!(!take_message(&l, &b).await, "another peer is not affected");
        assert!(message_limiter(0.0, 1).is_err());
        assert!(message_limiter(1.0, 0).is_err());
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(governor_config(0.0, 1).is_err());
        assert!(governor_config(f64::NAN, 1).is_err());
        assert!(governor_config(10.0, 0).is_err());
        assert!(governor_config(1e12, 1).is_ok());
    }
}
