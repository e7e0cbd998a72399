//! Per-peer rate limiting of gRPC calls (tower_governor), keyed by who is
//! calling: the peer's IP address on TCP, its uid on the unix socket (from
//! `SO_PEERCRED`). One call (a whole `ToDataplane` stream counts once) takes
//! one token; a peer over its quota gets `RESOURCE_EXHAUSTED` with a
//! `retry-after` header, and other peers are not affected.

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
        let ext = req.extensions();
        let tcp = ext.get::<TcpConnectInfo>().or_else(|| {
            ext.get::<TlsConnectInfo<TcpConnectInfo>>()
                .map(|t| t.get_ref())
        });
        if let Some(addr) = tcp.and_then(|t| t.remote_addr()) {
            return Ok(PeerKey::Ip(addr.ip()));
        }
        if let Some(cred) = ext.get::<UdsConnectInfo>().and_then(|u| u.peer_cred) {
            return Ok(PeerKey::Uid(cred.uid()));
        }
        Err(GovernorError::UnableToExtractKey)
    }
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
    if !(per_second.is_finite() && per_second > 0.0) {
        return Err(LimitError::Rate(per_second));
    }
    if burst == 0 {
        return Err(LimitError::Burst);
    }
    let period = Duration::try_from_secs_f64(1.0 / per_second)
        .map_err(|_| LimitError::Rate(per_second))?
        .max(Duration::from_nanos(1));
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

    #[test]
    fn bad_settings_are_refused() {
        assert!(governor_config(0.0, 1).is_err());
        assert!(governor_config(f64::NAN, 1).is_err());
        assert!(governor_config(10.0, 0).is_err());
        assert!(governor_config(1e12, 1).is_ok());
    }
}
