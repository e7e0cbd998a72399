//! Bounded channels between the gRPC streams and the sync loop: a full feed
//! channel makes the handler wait, so back-pressure reaches the feeder
//! through HTTP/2 flow control and nothing is dropped. Status events fan out
//! through a broadcast channel: a slow watcher lags, it never blocks the
//! loop.

use std::future::Future;

use dphandler_dataplane::backends::DesiredKernel;
use dphandler_dataplane::interfaces::netlink;
use dphandler_dataplane::managers::Manager;
use dphandler_dataplane::sync_loop::{Channels, Feed, LoopConfig, Status, StatusEvent, SyncLoop};
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinHandle;

/// Messages queued between the streams and the loop (Felix buffers 100;
/// we allow more so a fast feeder is not paced by every apply).
pub const FEED_CAPACITY: usize = 1024;
/// Status events kept for slow watchers before they lag.
pub const EVENTS_CAPACITY: usize = 1024;

/// The handles the gRPC service holds.
#[derive(Debug, Clone)]
pub struct Connector {
    pub feed: mpsc::Sender<Feed>,
    pub events: broadcast::Sender<StatusEvent>,
    pub status: watch::Receiver<Status>,
    /// When the loop last turned (see `Channels::alive`).
    pub alive: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// The Prometheus metrics the loop and the edge keep.
    pub metrics: std::sync::Arc<dphandler_dataplane::metrics::Metrics>,
}

/// Start the interface monitor and the sync loop; returns the connector and
/// the loop's task (which ends after `shutdown`; it applies nothing more
/// once `stopping` is set).
pub fn start(
    cfg: LoopConfig,
    managers: Vec<Box<dyn Manager>>,
    kernel: DesiredKernel,
    metrics: std::sync::Arc<dphandler_dataplane::metrics::Metrics>,
    config: dphandler_dataplane::sync_loop::ConfigSettings,
    shutdown: impl Future<Output = ()> + Send + 'static,
    stopping: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> (Connector, JoinHandle<()>) {
    let (feed_tx, feed_rx) = mpsc::channel(FEED_CAPACITY);
    let (if_tx, if_rx) = mpsc::channel(100);
    let (resync_tx, resync_rx) = mpsc::channel(1);
    let (ev_tx, _) = broadcast::channel(EVENTS_CAPACITY);
    let (st_tx, st_rx) = watch::channel(Status::default());
    tokio::spawn(netlink::run_route_deletions(if_tx.clone()));
    tokio::spawn(netlink::run(if_tx, resync_rx));
    let alive = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(
        dphandler_dataplane::sync_loop::alive_now(),
    ));
    let ch = Channels {
        feed: feed_rx,
        interfaces: if_rx,
        interface_resync: Some(resync_tx),
        events: ev_tx.clone(),
        status: st_tx,
        alive: Some(alive.clone()),
        stopping: Some(stopping),
    };
    let task = tokio::spawn(
        SyncLoop::new(cfg, managers, kernel)
            .with_metrics(metrics.clone())
            .with_config(config)
            .run(ch, shutdown),
    );
    (
        Connector {
            feed: feed_tx,
            events: ev_tx,
            status: st_rx,
            alive,
            metrics,
        },
        task,
    )
}
