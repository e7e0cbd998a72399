//! The `dphandler.v1.Dataplane` service. Handlers validate and convert each
//! message (`dphandler_proto::convert`) and enqueue it for the sync loop;
//! they never touch the kernel.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use dphandler_dataplane::model::{IpVersion, Update};
use dphandler_dataplane::sync_loop::{Feed, Rejection, StatusEvent};
use dphandler_proto::felix::{self, from_dataplane};
use dphandler_proto::v1;
use dphandler_proto::wire::raw::dataplane_server::Dataplane;
use dphandler_proto::wire::{self, RawToDataplane, WireLimits};
use futures::{FutureExt, Stream};
use prost::Message;
use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, warn};

use crate::connector::Connector;
use crate::limits::{self, MessageLimiter};

/// Most messages one feed item carries.
const BATCH: usize = 64;

/// What the messages read from every stream and not yet taken in by the
/// loop may weigh decoded, together (as [`wire::check`] estimates it): a
/// feeder that sends faster than the loop takes its messages in is held
/// back here (and so by HTTP/2 flow control) once it is spent.
pub const DECODED_IN_FLIGHT: usize = 512 << 20;

/// `reason`, cut as [`ValidationError`](dphandler_dataplane::model::ValidationError)
/// cuts its own (a 60 MiB string echoed whole became a 300 MiB reason,
/// logged whole; strings are also limited on the wire, see
/// [`WireLimits::string_bytes`]).
pub fn cut(reason: String) -> String {
    dphandler_dataplane::model::ValidationError::new("", reason).reason
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

pub struct DataplaneService {
    conn: Connector,
    next_session: AtomicU64,
    started: Instant,
    /// Messages per peer on `ToDataplane` streams (see [`crate::limits`]).
    messages: Option<Arc<MessageLimiter>>,
    /// What one message may hold (checked before it is decoded).
    wire_limits: WireLimits,
    /// The decoded bytes in flight, of every stream ([`DECODED_IN_FLIGHT`]).
    in_flight: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for DataplaneService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataplaneService")
            .field("conn", &self.conn)
            .field("message_limit", &self.messages.is_some())
            .finish_non_exhaustive()
    }
}

impl DataplaneService {
    pub fn new(conn: Connector) -> Self {
        Self {
            conn,
            next_session: AtomicU64::new(1),
            started: Instant::now(),
            messages: None,
            wire_limits: WireLimits::default(),
            in_flight: Arc::new(tokio::sync::Semaphore::new(DECODED_IN_FLIGHT)),
        }
    }

    /// The budget of decoded bytes in flight (tests: one small enough to
    /// spend in two messages).
    #[cfg(test)]
    fn with_decoded_in_flight(mut self, bytes: usize) -> Self {
        self.in_flight = Arc::new(tokio::sync::Semaphore::new(bytes));
        self
    }

    /// What one message may hold.
    pub fn with_wire_limits(mut self, limits: WireLimits) -> Self {
        self.wire_limits = limits;
        self
    }

    /// Limits the messages each peer sends over its `ToDataplane` streams.
    pub fn with_message_limit(mut self, limiter: MessageLimiter) -> Self {
        self.messages = Some(Arc::new(limiter));
        self
    }
}

/// One message checked against the limits: decoded and converted.
/// `Ok(None)` for a message with no payload; `Err((sequence number, field,
/// reason))` for one that cannot be decoded or is invalid.
fn decode(
    raw: RawToDataplane,
    seq: u64,
    converter: &mut dphandler_proto::convert::Converter,
) -> Result<Option<(u64, Update)>, (u64, String, String)> {
    let msg = felix::ToDataplane::decode(raw.0).map_err(|e| {
        (
            seq,
            String::new(),
            format!("not a valid felix.ToDataplane message: {e}"),
        )
    })?;
    let seq = msg.sequence_number;
    match converter.convert(msg) {
        Ok(u) => Ok(u.map(|u| (seq, u))),
        Err(r) => Err((seq, r.error.field, r.error.reason)),
    }
}

/// Sends what a stream batched to the loop, with its weight in the budget
/// of decoded bytes; with nothing batched, drops the weight (rejected
/// messages weigh nothing once they are answered). False once the loop has
/// stopped.
async fn flush(
    feed: &mpsc::Sender<Feed>,
    session: u64,
    batch: &mut Vec<(u64, Update)>,
    held: &mut Option<tokio::sync::OwnedSemaphorePermit>,
) -> bool {
    if batch.is_empty() {
        *held = None;
        return true;
    }
    let messages = std::mem::replace(batch, Vec::with_capacity(BATCH));
    feed.send(Feed::Messages {
        session,
        messages,
        held: held.take(),
    })
    .await
    .is_ok()
}

fn rejected(r: Rejection) -> v1::ToDataplaneReply {
    v1::ToDataplaneReply {
        kind: Some(v1::to_dataplane_reply::Kind::Rejected(v1::Rejection {
            sequence_number: r.sequence_number,
            field: r.field,
            reason: r.reason,
        })),
    }
}

fn programmed(seq: u64) -> v1::ToDataplaneReply {
    v1::ToDataplaneReply {
        kind: Some(v1::to_dataplane_reply::Kind::Programmed(v1::Programmed {
            sequence_number: seq,
        })),
    }
}

/// What the reader saw when the client's side of the stream ended.
#[derive(Debug, Clone)]
struct ReadSummary {
    /// The stream failed (e.g. a message over the size limit): the client
    /// is told with this status.
    error: Option<Status>,
    last_accepted: Option<u64>,
    messages: u64,
    rejected: u64,
    /// The client half-closed (rather than the stream failing).
    half_closed: bool,
}

fn received(s: &ReadSummary, datastore_in_sync: bool) -> v1::ToDataplaneReply {
    v1::ToDataplaneReply {
        kind: Some(v1::to_dataplane_reply::Kind::Received(v1::Received {
            messages: s.messages,
            rejected: s.rejected,
            last_accepted_sequence: s.last_accepted.unwrap_or(0),
            datastore_in_sync,
        })),
    }
}

fn wep_id(id: &dphandler_dataplane::model::WorkloadEndpointId) -> felix::WorkloadEndpointId {
    felix::WorkloadEndpointId {
        orchestrator_id: id.orchestrator.as_str().to_string(),
        workload_id: id.workload.as_str().to_string(),
        endpoint_id: id.endpoint.as_str().to_string(),
    }
}

/// The loop's event as the wire's `FromDataplane`.
pub fn from_event(ev: StatusEvent) -> felix::FromDataplane {
    let payload = match ev {
        StatusEvent::DataplaneInSync => {
            from_dataplane::Payload::DataplaneInSync(felix::DataplaneInSync {})
        }
        StatusEvent::ProcessStatus {
            iso_timestamp,
            uptime,
        } => from_dataplane::Payload::ProcessStatusUpdate(felix::ProcessStatusUpdate {
            iso_timestamp,
            uptime,
        }),
        StatusEvent::WorkloadEndpointStatus {
            id,
            status,
            endpoint,
        } => from_dataplane::Payload::WorkloadEndpointStatusUpdate(
            felix::WorkloadEndpointStatusUpdate {
                id: Some(wep_id(&id)),
                status: Some(felix::EndpointStatus {
                    status: status.to_string(),
                }),
                // What Felix's endpoint-status file reporter writes (it
                // logs an error and writes no file without it).
                endpoint: Some(felix::WorkloadEndpoint {
                    name: endpoint.name.to_string(),
                    mac: endpoint.mac.map(|m| m.to_string()).unwrap_or_default(),
                    ipv4_nets: endpoint.ipv4_nets.iter().map(ToString::to_string).collect(),
                    ipv6_nets: endpoint.ipv6_nets.iter().map(ToString::to_string).collect(),
                    profile_ids: endpoint
                        .profile_ids
                        .iter()
                        .map(|p| p.as_str().to_string())
                        .collect(),
                    ..Default::default()
                }),
            },
        ),
        StatusEvent::HostEndpointStatus { id, status } => {
            from_dataplane::Payload::HostEndpointStatusUpdate(felix::HostEndpointStatusUpdate {
                id: Some(felix::HostEndpointId {
                    endpoint_id: id.0.as_str().to_string(),
                }),
                status: Some(felix::EndpointStatus {
                    status: status.to_string(),
                }),
            })
        }
        StatusEvent::HostEndpointStatusRemove { id } => {
            from_dataplane::Payload::HostEndpointStatusRemove(felix::HostEndpointStatusRemove {
                id: Some(felix::HostEndpointId {
                    endpoint_id: id.0.as_str().to_string(),
                }),
            })
        }
        StatusEvent::WireguardStatus {
            ip_version,
            public_key,
        } => from_dataplane::Payload::WireguardStatusUpdate(felix::WireguardStatusUpdate {
            public_key,
            ip_version: match ip_version {
                IpVersion::V4 => felix::IpVersion::Ipv4,
                IpVersion::V6 => felix::IpVersion::Ipv6,
            } as i32,
        }),
        StatusEvent::WorkloadEndpointStatusRemove { id } => {
            from_dataplane::Payload::WorkloadEndpointStatusRemove(
                felix::WorkloadEndpointStatusRemove {
                    id: Some(wep_id(&id)),
                },
            )
        }
    };
    felix::FromDataplane {
        sequence_number: 0,
        payload: Some(payload),
    }
}

fn update(f: felix::FromDataplane) -> v1::StatusUpdate {
    v1::StatusUpdate {
        kind: Some(v1::status_update::Kind::Update(f)),
    }
}

#[tonic::async_trait]
impl Dataplane for DataplaneService {
    type ToDataplaneStream = BoxStream<v1::ToDataplaneReply>;
    type StatusUpdatesStream = BoxStream<v1::StatusUpdate>;

    async fn to_dataplane(
        &self,
        request: Request<Streaming<RawToDataplane>>,
    ) -> Result<Response<Self::ToDataplaneStream>, Status> {
        // A stream whose peer is unknown (tonic always attaches one) is
        // not limited by message: the call limit still applies.
        let limit = self
            .messages
            .clone()
            .zip(limits::peer_of(request.extensions()));
        let mut inbound = request.into_inner();
        let session = self.next_session.fetch_add(1, Ordering::Relaxed);
        let (prog_tx, mut prog_rx) = watch::channel(0u64);
        let (rej_tx, mut rej_rx) =
            mpsc::channel::<Rejection>(dphandler_dataplane::sync_loop::REJECTIONS_QUEUED);
        let wire_limits = self.wire_limits;
        let in_flight = self.in_flight.clone();
        let feed = self.conn.feed.clone();
        let metrics = self.conn.metrics.clone();
        feed.send(Feed::Open {
            session,
            programmed: prog_tx,
            rejections: rej_tx.clone(),
        })
        .await
        .map_err(|_| Status::unavailable("the dataplane is shutting down"))?;
        info!(session, "feeder connected");

        // Reader: validate, convert, enqueue.
        let (done_tx, mut done_rx) = watch::channel::<Option<ReadSummary>>(None);
        let reader_feed = feed.clone();
        tokio::spawn(async move {
            let mut last_accepted = None;
            let (mut messages, mut rejected_count) = (0u64, 0u64);
            let mut half_closed = false;
            let mut error = None;
            let mut batch: Vec<(u64, Update)> = Vec::with_capacity(BATCH);
            // What this stream has sent of each host (a released Felix
            // sends a host in pieces).
            let mut converter = dphandler_proto::convert::Converter::default();
            // The batch's weight in the budget of decoded bytes in flight.
            let mut held: Option<tokio::sync::OwnedSemaphorePermit> = None;
            let mut ended = false;
            while !ended {
                // Wait for one message, then take those already decoded
                // (up to BATCH) without waiting: one feed item per batch.
                let mut next = Some(inbound.message().await);
                while let Some(item) = next.take() {
                    match item {
                        Ok(Some(msg)) => {
                            messages += 1;
                            if let Some((limiter, peer)) = &limit
                                && limiter.check_key(peer).is_err()
                            {
                                // Over the peer's message rate: what is
                                // batched goes first, then the reader waits
                                // (the feeder is held back by flow control).
                                if !flush(&reader_feed, session, &mut batch, &mut held).await {
                                    ended = true; // the loop has stopped
                                    break;
                                }
                                metrics.message_waits.inc();
                                limits::take_message(limiter, peer).await;
                            }
                            // A released Felix's policy names in a
                            // TierInfo, as master's PolicyIDs.
                            let msg = match wire::normalize(&msg.0) {
                                Some(b) => RawToDataplane(b.into()),
                                None => msg,
                            };
                            let mut msg_seq = 0;
                            let converted = match wire::check(&msg.0, &wire_limits) {
                                Err(r) => Err((r.sequence_number, r.field, r.reason)),
                                Ok(c) => {
                                    msg_seq = c.sequence_number;
                                    // Weighed before it is decoded: a full
                                    // budget holds this stream back here.
                                    let weight = u32::try_from(c.decoded.min(DECODED_IN_FLIGHT))
                                        .unwrap_or(u32::MAX)
                                        .max(1);
                                    let permit = match in_flight
                                        .clone()
                                        .try_acquire_many_owned(weight)
                                    {
                                        Ok(p) => Some(p),
                                        Err(tokio::sync::TryAcquireError::Closed) => None,
                                        Err(tokio::sync::TryAcquireError::NoPermits) => {
                                            // What this stream batched goes
                                            // first, its weight with it:
                                            // waiting while holding it could
                                            // wait for ever.
                                            if !flush(&reader_feed, session, &mut batch, &mut held)
                                                .await
                                            {
                                                ended = true; // the loop has stopped
                                                break;
                                            }
                                            in_flight.clone().acquire_many_owned(weight).await.ok()
                                        }
                                    };
                                    let Some(p) = permit else {
                                        ended = true;
                                        break;
                                    };
                                    match &mut held {
                                        Some(h) => h.merge(p),
                                        None => held = Some(p),
                                    }
                                    decode(msg, c.sequence_number, &mut converter)
                                }
                            };
                            match converted {
                                Ok(Some((seq, update))) => {
                                    batch.push((seq, update));
                                    last_accepted = Some(seq);
                                }
                                Ok(None) => {
                                    // No payload this build knows: a newer
                                    // Felix's message (Felix itself ignores
                                    // what it does not know).
                                    warn!(
                                        session,
                                        seq = msg_seq,
                                        "a message of a type this dphandler does not know: ignored"
                                    );
                                }
                                Err((seq, field, reason)) => {
                                    rejected_count += 1;
                                    metrics.rejections.inc();
                                    let reason = cut(reason);
                                    warn!(session, seq, %field, %reason, "message rejected");
                                    let r = Rejection {
                                        sequence_number: seq,
                                        field,
                                        reason,
                                    };
                                    // A client that reads no replies holds
                                    // its own stream back here.
                                    if rej_tx.send(r).await.is_err() {
                                        ended = true;
                                        break;
                                    }
                                }
                            }
                        }
                        Ok(None) => {
                            half_closed = true;
                            ended = true;
                        }
                        Err(e) => {
                            info!(session, error = %e, "feeder stream ended with an error");
                            error = Some(e);
                            ended = true;
                        }
                    }
                    if !ended && batch.len() < BATCH {
                        next = inbound.message().now_or_never();
                    }
                }
                // Waiting here on a full feed channel is the back-pressure.
                if !flush(&reader_feed, session, &mut batch, &mut held).await {
                    break;
                }
            }
            // Every rejection is queued before this, so the writer sends them
            // all before Received.
            let _ = done_tx.send(Some(ReadSummary {
                error,
                last_accepted,
                messages,
                rejected: rejected_count,
                half_closed,
            }));
        });

        // Writer: rejections as they come, Programmed after each apply. Ends
        // when the feeder has finished sending and everything it sent is
        // programmed, or when the client goes away. The kernel is left as it is.
        let (out_tx, out_rx) = mpsc::channel(128);
        let status = self.conn.status.clone();
        tokio::spawn(async move {
            let mut finished: Option<Option<u64>> = None;
            // Judge completion by what was sent, not by the watch's newest
            // value: otherwise the stream could end before telling the client.
            let mut sent = 0u64;
            loop {
                if let Some(last) = finished {
                    let all_programmed = last.is_none_or(|l| sent >= l);
                    if all_programmed && rej_rx.is_empty() {
                        break;
                    }
                }
                tokio::select! {
                    Some(r) = rej_rx.recv() => {
                        if out_tx.send(Ok(rejected(r))).await.is_err() { break; }
                    }
                    changed = prog_rx.changed() => {
                        if changed.is_err() { break; }
                        let seq = *prog_rx.borrow_and_update();
                        if out_tx.send(Ok(programmed(seq))).await.is_err() { break; }
                        sent = seq;
                    }
                    changed = done_rx.changed(), if finished.is_none() => {
                        let summary = if changed.is_err() { None } else { done_rx.borrow().clone() };
                        let Some(summary) = summary else {
                            finished = Some(None);
                            continue;
                        };
                        finished = Some(summary.last_accepted);
                        if let Some(status) = summary.error {
                            // What was accepted before stays; the client
                            // learns why its stream ended.
                            while let Ok(r) = rej_rx.try_recv() {
                                if out_tx.send(Ok(rejected(r))).await.is_err() { break; }
                            }
                            let _ = out_tx.send(Err(status)).await;
                            break;
                        }
                        if summary.half_closed {
                            let mut broken = false;
                            while let Ok(r) = rej_rx.try_recv() {
                                if out_tx.send(Ok(rejected(r))).await.is_err() { broken = true; break; }
                            }
                            let received = received(&summary, status.borrow().datastore_in_sync);
                            if broken || out_tx.send(Ok(received)).await.is_err() { break; }
                        }
                    }
                    () = out_tx.closed() => break,
                }
            }
            let _ = feed.send(Feed::Close { session }).await;
            info!(session, "feeder stream closed");
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out_rx))))
    }

    async fn status_updates(
        &self,
        _request: Request<v1::StatusUpdatesRequest>,
    ) -> Result<Response<Self::StatusUpdatesStream>, Status> {
        // Subscribe first, then look at the status: an InSync that happens in
        // between is seen on the channel and the synthesised one suppressed.
        let mut events = self.conn.events.subscribe();
        let (already_in_sync, keys) = {
            let s = self.conn.status.borrow();
            (s.in_sync, s.wireguard_keys.clone())
        };
        let (out_tx, out_rx) = mpsc::channel(64);
        let watchers = self.conn.metrics.watchers.clone();
        tokio::spawn(async move {
            // Counted while this task runs.
            watchers.inc();
            let _counted = dec_on_drop(watchers);
            // A new watcher hears where things stand: in sync first (as
            // before there were keys), then this node's WireGuard keys.
            let mut now = Vec::new();
            if already_in_sync {
                now.push(StatusEvent::DataplaneInSync);
            }
            now.extend(keys.into_iter().map(|(ip_version, public_key)| {
                StatusEvent::WireguardStatus {
                    ip_version,
                    public_key,
                }
            }));
            for ev in now {
                if out_tx.send(Ok(update(from_event(ev)))).await.is_err() {
                    return;
                }
            }
            loop {
                // A watcher that goes away ends its task at once, not at the
                // next event.
                let received = tokio::select! {
                    r = events.recv() => r,
                    () = out_tx.closed() => break,
                };
                let item = match received {
                    Ok(StatusEvent::DataplaneInSync) if already_in_sync => continue,
                    Ok(ev) => update(from_event(ev)),
                    Err(broadcast::error::RecvError::Lagged(missed)) => v1::StatusUpdate {
                        kind: Some(v1::status_update::Kind::Lagged(v1::Lagged { missed })),
                    },
                    Err(broadcast::error::RecvError::Closed) => break,
                };
                if out_tx.send(Ok(item)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out_rx))))
    }

    async fn get_status(
        &self,
        _request: Request<v1::GetStatusRequest>,
    ) -> Result<Response<v1::DataplaneStatus>, Status> {
        let s = self.conn.status.borrow().clone();
        Ok(Response::new(v1::DataplaneStatus {
            in_sync: s.in_sync,
            datastore_in_sync: s.datastore_in_sync,
            interfaces_in_sync: s.interfaces_in_sync,
            dirty: s.dirty,
            last_programmed_sequence: s.last_programmed,
            applies: s.applies,
            failed_applies: s.failed_applies,
            apply_p50_ms: s.apply.p50.as_secs_f64() * 1000.0,
            apply_p99_ms: s.apply.p99.as_secs_f64() * 1000.0,
            apply_max_ms: s.apply.max.as_secs_f64() * 1000.0,
            apply_samples: u32::try_from(s.apply.samples).unwrap_or(u32::MAX),
            apply_histogram: dphandler_dataplane::sync_loop::APPLY_BUCKETS_MS
                .iter()
                .zip(s.apply.histogram)
                .map(|(le, count)| v1::ApplyBucket { le_ms: *le, count })
                .collect(),
            objects: s
                .objects
                .iter()
                .map(|(k, v)| ((*k).to_string(), *v))
                .collect(),
            feeders: s.feeders,
            watchers: u32::try_from(self.conn.events.receiver_count()).unwrap_or(u32::MAX),
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            last_error: s.last_error.unwrap_or_default(),
            details: s
                .details
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }))
    }
}

/// Decrements `g` when dropped (a watcher's task ends, however it ends).
fn dec_on_drop(g: prometheus_client::metrics::gauge::Gauge) -> impl Drop {
    struct Dec(prometheus_client::metrics::gauge::Gauge);
    impl Drop for Dec {
        fn drop(&mut self) {
            self.0.dec();
        }
    }
    Dec(g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dphandler_dataplane::sync_loop::Status as LoopStatus;
    use futures::StreamExt;

    fn service(events: usize) -> (DataplaneService, broadcast::Sender<StatusEvent>) {
        let (feed, _feed_rx) = mpsc::channel(16);
        let (ev_tx, _) = broadcast::channel(events);
        let (_st_tx, st_rx) = watch::channel(LoopStatus::default());
        // The feed receiver and status sender may drop: these tests only use
        // the status fan-out.
        let conn = Connector {
            feed,
            events: ev_tx.clone(),
            status: st_rx,
            alive: Default::default(),
            metrics: Default::default(),
        };
        (DataplaneService::new(conn), ev_tx)
    }

    fn heartbeat(i: u64) -> StatusEvent {
        StatusEvent::ProcessStatus {
            iso_timestamp: format!("t{i}"),
            uptime: i as f64,
        }
    }

    #[tokio::test]
    async fn a_slow_watcher_lags_and_is_told_how_much_it_missed() {
        let (svc, events) = service(16);
        let mut slow = svc
            .status_updates(Request::new(v1::StatusUpdatesRequest {}))
            .await
            .unwrap()
            .into_inner();
        // The loop's side: 10,000 events while the watcher reads nothing.
        // broadcast::send never waits, so this finishes at once.
        let sent = tokio::time::timeout(std::time::Duration::from_secs(2), async {
            for i in 0..10_000 {
                events.send(heartbeat(i)).unwrap();
                if i % 100 == 0 {
                    tokio::task::yield_now().await;
                }
            }
        })
        .await;
        assert!(sent.is_ok(), "the sender was blocked by a slow watcher");
        let mut delivered = 0u64;
        let mut missed = 0u64;
        let mut last = None;
        while delivered + missed < 10_000 {
            let item = tokio::time::timeout(std::time::Duration::from_secs(2), slow.next())
                .await
                .expect("the watcher's stream goes on")
                .unwrap()
                .unwrap();
            match item.kind {
                Some(v1::status_update::Kind::Lagged(l)) => missed += l.missed,
                Some(v1::status_update::Kind::Update(u)) => {
                    delivered += 1;
                    last = Some(u);
                }
                None => panic!("empty update"),
            }
        }
        assert!(missed > 0, "no Lagged although the watcher fell behind");
        assert_eq!(
            delivered + missed,
            10_000,
            "every event is delivered or counted"
        );
        // The newest event is never lost.
        assert_eq!(
            last.unwrap().payload,
            Some(from_dataplane::Payload::ProcessStatusUpdate(
                felix::ProcessStatusUpdate {
                    iso_timestamp: "t9999".into(),
                    uptime: 9999.0
                }
            ))
        );
    }

    /// A stream whose batch holds most of the budget, and whose next
    /// message needs more than is left, hands the loop its batch before it
    /// waits: waiting while holding it waited for ever (no other stream
    /// held anything).
    #[tokio::test]
    async fn a_stream_never_waits_on_the_budget_it_holds_itself() {
        use dphandler_proto::felix::to_dataplane::Payload;
        let msg = |seq: u64| felix::ToDataplane {
            sequence_number: seq,
            payload: Some(Payload::IpsetUpdate(felix::IpSetUpdate {
                id: format!("s:{seq}"),
                members: (0..500)
                    .map(|i| format!("10.0.{}.{}", i / 250, i % 250))
                    .collect(),
                r#type: felix::ip_set_update::IpSetType::Ip as i32,
            })),
        };
        const SENT: u64 = 200;
        let weight = wire::check(&msg(1).encode_to_vec(), &WireLimits::default())
            .unwrap()
            .decoded;
        assert!(weight > 1000, "a message weighs {weight}");

        let (feed, mut feed_rx) = mpsc::channel(16);
        let (ev_tx, _) = broadcast::channel(16);
        let (_st_tx, st_rx) = watch::channel(LoopStatus::default());
        let conn = Connector {
            feed,
            events: ev_tx,
            status: st_rx,
            alive: Default::default(),
            metrics: Default::default(),
        };
        // Room for one message and a half: two batched together spend it.
        let svc = DataplaneService::new(conn).with_decoded_in_flight(weight * 3 / 2);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(
                    dphandler_proto::wire::raw::dataplane_server::DataplaneServer::new(svc),
                )
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        // The loop's side: takes every batch in at once (its weight given
        // back as it drops).
        let taken = tokio::spawn(async move {
            let mut programmed = None;
            let mut last = 0;
            while last < SENT {
                match feed_rx.recv().await {
                    Some(Feed::Open { programmed: p, .. }) => programmed = Some(p),
                    Some(Feed::Messages { messages, .. }) => {
                        last = messages.last().map_or(last, |m| m.0);
                    }
                    Some(Feed::Message { seq, .. }) => last = seq,
                    Some(Feed::Close { .. }) | None => break,
                }
            }
            drop(programmed);
            last
        });
        let mut client = v1::dataplane_client::DataplaneClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let _replies = client
            .to_dataplane(futures::stream::iter((1..=SENT).map(msg)))
            .await
            .unwrap();
        let last = tokio::time::timeout(std::time::Duration::from_secs(20), taken)
            .await
            .expect("the stream stalled on its own budget")
            .unwrap();
        assert_eq!(last, SENT);
        server.abort();
    }

    #[tokio::test]
    async fn watchers_fan_out_independently() {
        let (svc, events) = service(1024);
        let mut a = svc
            .status_updates(Request::new(v1::StatusUpdatesRequest {}))
            .await
            .unwrap()
            .into_inner();
        let mut b = svc
            .status_updates(Request::new(v1::StatusUpdatesRequest {}))
            .await
            .unwrap()
            .into_inner();
        events.send(StatusEvent::DataplaneInSync).unwrap();
        for s in [&mut a, &mut b] {
            let item = s.next().await.unwrap().unwrap();
            assert!(matches!(
                item.kind,
                Some(v1::status_update::Kind::Update(felix::FromDataplane {
                    payload: Some(from_dataplane::Payload::DataplaneInSync(_)),
                    ..
                }))
            ));
        }
    }
}
