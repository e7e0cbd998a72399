//! The sync loop, as Felix's `loopUpdatingDataplane`: one task owns the
//! managers and backends and selects over feeder messages, interface events,
//! refresh ticks, the reschedule timer, throttle refill and the retry timer.
//! It applies only when the datastore and the interface monitor are in sync,
//! something is dirty and the throttle admits.

use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{Quota, RateLimiter};
use rand::Rng;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::backends::{BackendError, DesiredKernel, Refresh};
use crate::interfaces::InterfaceEvent;
use crate::managers::Manager;
use crate::model::{Key, Member, Update};
use crate::session::Store;
pub use crate::status::{ISOLATED, StatusEvent};

/// Identifies one feeder stream.
pub type SessionId = u64;

/// A message refused by the loop (it needs state the edge does not have,
/// e.g. a delta for an unknown IP set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub sequence_number: u64,
    pub field: String,
    pub reason: String,
}

/// What the feeder side sends into the loop.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "Message is the hot variant: moved once into a channel slot; boxing it would add an allocation per message"
)]
pub enum Feed {
    Open {
        session: SessionId,
        /// Highest sequence number of this session now programmed.
        programmed: watch::Sender<u64>,
        /// Bounded ([`REJECTIONS_QUEUED`]): a stream whose client does not
        /// read its replies cannot pile them up; the loop never waits on
        /// it (a rejection that finds it full is counted, not queued).
        rejections: mpsc::Sender<Rejection>,
    },
    Message {
        session: SessionId,
        seq: u64,
        update: Update,
    },
    /// Several messages of one session, in order: what the stream had
    /// already decoded, sent as one item so that a fast feeder costs one
    /// wake-up per batch rather than per message.
    Messages {
        session: SessionId,
        messages: Vec<(u64, Update)>,
        /// What the messages weigh in the edge's budget of decoded bytes
        /// in flight: given back when the loop has taken them in.
        held: Option<tokio::sync::OwnedSemaphorePermit>,
    },
    Close {
        session: SessionId,
    },
}

/// Rejections queued for one stream's replies at most.
pub const REJECTIONS_QUEUED: usize = 1024;

/// A snapshot of the loop's state, published after every change.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Status {
    pub in_sync: bool,
    pub datastore_in_sync: bool,
    pub interfaces_in_sync: bool,
    pub dirty: bool,
    pub last_programmed: u64,
    pub applies: u64,
    pub failed_applies: u64,
    pub objects: BTreeMap<&'static str, u64>,
    pub feeders: u32,
    pub last_error: Option<String>,
    /// How long the last successful applies took (managers and kernel).
    pub apply: ApplySummary,
    /// What managers and backends report after each apply (routes, VXLAN
    /// devices, what waits for what). Shared: the status is copied to its
    /// watchers after every apply, and these change far less often.
    pub details: Arc<BTreeMap<String, String>>,
    /// The WireGuard public keys last announced, per IP version.
    pub wireguard_keys: BTreeMap<crate::model::IpVersion, String>,
}

/// Median, 99th percentile and maximum of the last applies, and every
/// apply since start counted by duration.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ApplySummary {
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
    pub samples: usize,
    /// Cumulative: `histogram[i]` applies took at most
    /// [`APPLY_BUCKETS_MS`]`[i]` (the last bucket counts them all).
    pub histogram: [u64; APPLY_BUCKETS_MS.len()],
}

/// Upper bounds (ms) of the apply-time histogram; the last is unbounded.
pub const APPLY_BUCKETS_MS: [f64; 19] = [
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    50.0,
    100.0,
    150.0,
    200.0,
    250.0,
    300.0,
    400.0,
    500.0,
    750.0,
    1000.0,
    2000.0,
    5000.0,
    10000.0,
    f64::INFINITY,
];

/// The durations of the last [`ApplyTimes::KEEP`] successful applies.
#[derive(Debug, Clone, Default, PartialEq)]
struct ApplyTimes {
    recent: std::collections::VecDeque<Duration>,
    histogram: [u64; APPLY_BUCKETS_MS.len()],
}

impl ApplyTimes {
    pub const KEEP: usize = 1000;

    fn record(&mut self, d: Duration) {
        let ms = d.as_secs_f64() * 1000.0;
        for (count, le) in self.histogram.iter_mut().zip(APPLY_BUCKETS_MS) {
            if ms <= le {
                *count += 1;
            }
        }
        if self.recent.len() == Self::KEEP {
            self.recent.pop_front();
        }
        self.recent.push_back(d);
    }

    /// Made after every apply: the quantiles by selection, not by sorting
    /// the last 1,000 (~10 µs of a member's apply).
    fn summary(&self) -> ApplySummary {
        let mut v: Vec<Duration> = self.recent.iter().copied().collect();
        let mut q = |q: f64| {
            let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len().max(1)) - 1;
            if v.is_empty() {
                Duration::default()
            } else {
                *v.select_nth_unstable(i).1
            }
        };
        let (p50, p99) = (q(0.5), q(0.99));
        ApplySummary {
            p50,
            p99,
            max: v.iter().max().copied().unwrap_or_default(),
            samples: v.len(),
            histogram: self.histogram,
        }
    }
}

/// Whether the loop accepts a ConfigUpdate's keys: else the field and why
/// (what the loop's rejection says).
pub fn check_config(kv: &[(String, String)]) -> Result<(), (String, String)> {
    config::ConfigState::check(kv)
}

/// [`LoopConfig::max_objects_per_kind`] unless set: 25 times the policy
/// benchmark's 10,000 endpoints.
pub const DEFAULT_MAX_OBJECTS_PER_KIND: u64 = 250_000;

/// Timings (Felix's defaults, but for the apply throttle's) and limits.
#[derive(Debug, Clone)]
pub struct LoopConfig {
    /// Applies that may run back to back after a quiet spell.
    pub throttle_burst: u32,
    /// Under sustained changes, applies start at most once per period.
    pub throttle_period: Duration,
    /// Under sustained changes, the share of the time spent applying at
    /// most (1.0: no bound). The loop keeps a budget of apply time that
    /// fills at `apply_duty` seconds a second up to `duty_burst`; an apply
    /// spends what it took, and none starts while the budget is spent. So
    /// a change after a quiet spell is applied at once, however dear the
    /// last apply was, and under sustained changes the applies batch
    /// what comes in meanwhile. The budget never runs further behind than
    /// `duty_gap_max` of waiting (one long apply, a cold start, does not
    /// hold the next change back for long).
    pub apply_duty: f64,
    pub duty_burst: Duration,
    pub duty_gap_max: Duration,
    pub drain_max: usize,
    /// The longest wait before a failed apply is retried (Felix's retry
    /// tick).
    pub retry_interval: Duration,
    /// The first retry's wait; each further consecutive failure doubles it,
    /// up to `retry_interval`.
    pub retry_first: Duration,
    pub ipset_refresh: Duration,
    pub route_refresh: Duration,
    pub xdp_refresh: Duration,
    pub iptables_refresh: Duration,
    pub interface_refresh: Duration,
    /// Fraction of each refresh period added at random (0.1 = 10%).
    pub jitter: f64,
    pub heartbeat_first: Duration,
    pub heartbeat_every: Duration,
    /// How often an idle loop still turns (and says so in
    /// [`Channels::alive`]), for liveness.
    pub liveness_tick: Duration,
    /// Most objects of one kind (endpoints, policies, IP sets, routes, …)
    /// held at once: a message that would add one more is rejected (those
    /// that replace or remove one always pass), so a feeder cannot grow
    /// the daemon's memory without bound.
    pub max_objects_per_kind: u64,
}

impl Default for LoopConfig {
    fn default() -> Self {
        Self {
            // Felix counts applies (10, then one per 100 ms), which puts
            // a floor of ~100 ms on a change's latency under sustained
            // churn however cheap the apply is; what the throttle is for
            // (bounded CPU, batching when applies are dear) the duty
            // bound below gives without that floor.
            throttle_burst: 10,
            throttle_period: Duration::from_millis(20),
            apply_duty: 0.5,
            duty_burst: Duration::from_secs(1),
            duty_gap_max: Duration::from_millis(50),
            drain_max: 100,
            retry_interval: Duration::from_secs(10),
            retry_first: Duration::from_millis(100),
            ipset_refresh: Duration::from_secs(90),
            route_refresh: Duration::from_secs(90),
            xdp_refresh: Duration::from_secs(90),
            iptables_refresh: Duration::from_secs(180),
            interface_refresh: Duration::from_secs(90),
            jitter: 0.1,
            heartbeat_first: Duration::from_secs(10),
            heartbeat_every: Duration::from_secs(30),
            liveness_tick: Duration::from_secs(5),
            max_objects_per_kind: DEFAULT_MAX_OBJECTS_PER_KIND,
        }
    }
}

/// The loop's channels to the rest of the daemon.
#[derive(Debug)]
pub struct Channels {
    pub feed: mpsc::Receiver<Feed>,
    pub interfaces: mpsc::Receiver<InterfaceEvent>,
    /// Asks the interface monitor to re-dump (interface refresh tick).
    pub interface_resync: Option<mpsc::Sender<()>>,
    pub events: broadcast::Sender<StatusEvent>,
    pub status: watch::Sender<Status>,
    /// When the loop last turned (milliseconds on [`alive_now`]'s clock):
    /// a liveness probe compares it with the time now. The loop turns at
    /// least every [`LoopConfig::liveness_tick`] unless something blocks
    /// it.
    pub alive: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
    /// Set from the signal handler itself when the daemon is told to stop,
    /// before the `shutdown` future can be polled: from then on the loop
    /// applies nothing (a device lost beside the daemon, its
    /// `wireguard-go` killed by the same drain, is not made again to
    /// outlive it).
    pub stopping: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// Milliseconds since the Unix epoch: the clock of [`Channels::alive`].
pub fn alive_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A periodic timer with jitter; disabled when the period is zero.

#[derive(Debug)]
struct Ticker {
    period: Duration,
    jitter: f64,
    next: Option<Instant>,
}

impl Ticker {
    fn new(period: Duration, jitter: f64) -> Self {
        let mut t = Self {
            period,
            jitter,
            next: None,
        };
        t.rearm();
        t
    }
    /// The next tick: `period` plus up to `jitter` of it from now; none
    /// for a zero period, or one the clock cannot hold (the settings are
    /// bounded to a day; this is the last guard: an overflow here once
    /// panicked the loop).
    fn rearm(&mut self) {
        self.next = (!self.period.is_zero())
            .then(|| {
                let jitter = self.jitter.clamp(0.0, 1.0);
                let extra = self.period.mul_f64(rand::rng().random_range(0.0..=jitter));
                Instant::now().checked_add(self.period.checked_add(extra)?)
            })
            .flatten();
    }
}

async fn sleep_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

struct SessionState {
    start: u64,
    swept: bool,
    highest: Option<u64>,
    programmed: watch::Sender<u64>,
    rejections: mpsc::Sender<Rejection>,
}

/// The apply-time budget of [`LoopConfig::apply_duty`].
#[derive(Debug)]
struct DutyBudget {
    /// Seconds of apply time left (negative: owed).
    left: f64,
    at: Instant,
}

impl DutyBudget {
    fn new(cfg: &LoopConfig) -> Self {
        Self {
            left: cfg.duty_burst.as_secs_f64(),
            at: Instant::now(),
        }
    }

    fn bounded(cfg: &LoopConfig) -> bool {
        cfg.apply_duty > 0.0 && cfg.apply_duty < 1.0
    }

    /// How long until an apply may start (`None`: now).
    fn wait(&mut self, cfg: &LoopConfig, now: Instant) -> Option<Duration> {
        if !Self::bounded(cfg) {
            return None;
        }
        let filled = cfg.apply_duty * (now - self.at).as_secs_f64();
        self.left = (self.left + filled).min(cfg.duty_burst.as_secs_f64());
        self.at = now;
        (self.left < 0.0).then(|| Duration::from_secs_f64(-self.left / cfg.apply_duty))
    }

    /// An apply took `took`.
    fn spend(&mut self, cfg: &LoopConfig, took: Duration) {
        if !Self::bounded(cfg) {
            return;
        }
        let floor = -cfg.duty_gap_max.as_secs_f64() * cfg.apply_duty;
        self.left = (self.left - took.as_secs_f64()).max(floor);
    }
}

/// The loop itself.
pub struct SyncLoop {
    cfg: LoopConfig,
    managers: Vec<Box<dyn Manager>>,
    kernel: Option<DesiredKernel>,
    store: Store,
    sessions: HashMap<SessionId, SessionState>,
    throttle: RateLimiter<governor::state::NotKeyed, governor::state::InMemoryState, DefaultClock>,
    clock: DefaultClock,
    status: Status,
    dirty: bool,
    in_sync_sent: bool,
    pending_refresh: Vec<Refresh>,
    retry_at: Option<Instant>,
    /// The last apply failed only in ways a retry cannot mend (see
    /// [`crate::backends::BackendError::retryable`]): the next message or
    /// interface event applies at once (it may mend it), else the slow
    /// retry tick does.
    stuck: bool,
    /// Consecutive failed applies.
    failures: u32,
    reschedule_at: Option<Instant>,
    refill_at: Option<Instant>,
    /// The apply time left to spend (the duty bound).
    budget: DutyBudget,
    apply_times: ApplyTimes,
    metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
    /// The message counters by kind, looked up once each.
    msg_counters: HashMap<&'static str, prometheus_client::metrics::counter::Counter>,
    /// The loop's share of the ConfigUpdate.
    config: config::ConfigState,
}

impl std::fmt::Debug for SyncLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncLoop")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl SyncLoop {
    pub fn new(cfg: LoopConfig, managers: Vec<Box<dyn Manager>>, kernel: DesiredKernel) -> Self {
        let burst = NonZeroU32::new(cfg.throttle_burst.max(1)).expect("max(1)");
        let quota = Quota::with_period(cfg.throttle_period.max(Duration::from_micros(1)))
            .expect("non-zero period")
            .allow_burst(burst);
        let budget = DutyBudget::new(&cfg);
        Self {
            cfg,
            managers,
            kernel: Some(kernel),
            store: Store::default(),
            sessions: HashMap::new(),
            throttle: RateLimiter::direct(quota),
            clock: DefaultClock::default(),
            status: Status::default(),
            dirty: false,
            in_sync_sent: false,
            pending_refresh: Vec::new(),
            retry_at: None,
            stuck: false,
            failures: 0,
            reschedule_at: None,
            refill_at: None,
            budget,
            apply_times: ApplyTimes::default(),
            metrics: None,
            msg_counters: HashMap::new(),
            config: config::ConfigState::default(),
        }
    }

    /// What a ConfigUpdate's restart keys are compared with, where they
    /// are kept, and how the log level changes.
    pub fn with_config(mut self, settings: ConfigSettings) -> Self {
        self.config = config::ConfigState::new(settings);
        self
    }

    /// Keep `metrics` up to date.
    pub fn with_metrics(mut self, metrics: std::sync::Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Counts one message of the calc graph by its kind.
    fn count_message(&mut self, update: &Update) {
        let Some(m) = &self.metrics else {
            return;
        };
        let kind = match update {
            Update::InSync => "in_sync",
            Update::IpSetDeltaUpdate(_) => "ipset_delta",
            Update::Remove(k) => match k.kind().as_str() {
                "ipset" => "ipset_remove",
                "policy" => "policy_remove",
                "profile" => "profile_remove",
                "host_endpoint" => "host_endpoint_remove",
                "workload_endpoint" => "workload_endpoint_remove",
                "route" => "route_remove",
                _ => "other_remove",
            },
            u => u.upsert_key().map_or("other", |k| k.kind().as_str()),
        };
        self.msg_counters
            .entry(kind)
            .or_insert_with(|| {
                m.messages
                    .get_or_create(&crate::metrics::TypeLabel {
                        r#type: kind.to_string(),
                    })
                    .clone()
            })
            .inc();
    }

    /// Run until the feed channel closes (all senders dropped) or `shutdown`
    /// resolves. Kernel state is left as it is.
    pub async fn run(mut self, mut ch: Channels, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        let cfg = self.cfg.clone();
        let refresh = |flag: Duration, key: Option<Duration>| {
            Ticker::new(config::ConfigState::refresh(flag, key), cfg.jitter)
        };
        let mut ipsets = Ticker::new(cfg.ipset_refresh, cfg.jitter);
        let mut routes = Ticker::new(cfg.route_refresh, cfg.jitter);
        let mut xdp = Ticker::new(cfg.xdp_refresh, cfg.jitter);
        let mut iptables = Ticker::new(cfg.iptables_refresh, cfg.jitter);
        let mut ifaces = Ticker::new(cfg.interface_refresh, cfg.jitter);
        let started = Instant::now();
        let mut heartbeat_at = Some(started + cfg.heartbeat_first);
        let mut live = Ticker::new(cfg.liveness_tick, 0.0);
        let mut interfaces_open = true;
        loop {
            if std::mem::take(&mut self.config.refresh_changed) {
                let c = &self.config.current;
                ipsets = refresh(cfg.ipset_refresh, c.ipsets_refresh);
                routes = refresh(cfg.route_refresh, c.route_refresh);
                iptables = refresh(cfg.iptables_refresh, c.iptables_refresh);
            }
            if let Some(a) = &ch.alive {
                a.store(alive_now(), std::sync::atomic::Ordering::Relaxed);
            }
            tokio::select! {
                () = &mut shutdown => break,
                msg = ch.feed.recv() => {
                    let Some(msg) = msg else { break };
                    self.on_feed(msg);
                    // Drain up to drain_max more messages (a batch counts
                    // as its length) before looking at applying.
                    let mut drained = 0;
                    while drained < cfg.drain_max {
                        match ch.feed.try_recv() {
                            Ok(m) => drained += self.on_feed(m),
                            Err(_) => break,
                        }
                    }
                }
                ev = ch.interfaces.recv(), if interfaces_open => {
                    match ev {
                        Some(ev) => {
                            self.on_interface(ev);
                            for _ in 0..cfg.drain_max {
                                match ch.interfaces.try_recv() {
                                    Ok(e) => self.on_interface(e),
                                    Err(_) => break,
                                }
                            }
                        }
                        None => interfaces_open = false,
                    }
                }
                () = sleep_opt(ipsets.next) => { ipsets.rearm(); self.refresh(Refresh::IpSets); }
                () = sleep_opt(routes.next) => { routes.rearm(); self.refresh(Refresh::Routes); }
                () = sleep_opt(xdp.next) => { xdp.rearm(); self.refresh(Refresh::Xdp); }
                () = sleep_opt(iptables.next) => { iptables.rearm(); self.refresh(Refresh::Iptables); }
                () = sleep_opt(ifaces.next) => {
                    ifaces.rearm();
                    if let Some(tx) = &ch.interface_resync {
                        let _ = tx.try_send(());
                    }
                }
                () = sleep_opt(self.reschedule_at) => { self.reschedule_at = None; self.dirty = true; }
                () = sleep_opt(self.refill_at) => { self.refill_at = None; }
                () = sleep_opt(self.retry_at) => { self.retry_at = None; debug!("retry tick"); }
                () = sleep_opt(live.next) => { live.rearm(); }
                () = sleep_opt(heartbeat_at) => {
                    heartbeat_at = Some(Instant::now() + cfg.heartbeat_every);
                    let _ = ch.events.send(StatusEvent::ProcessStatus {
                        iso_timestamp: iso_now(),
                        uptime: started.elapsed().as_secs_f64(),
                    });
                }
            }
            self.maybe_apply(&ch).await;
            self.publish(&ch);
        }
        info!("sync loop stopped; kernel state left as it is");
    }

    /// Whether every manager accepts `update`; if not, it is rejected.
    fn accepted(&mut self, session: SessionId, seq: u64, update: &Update) -> bool {
        // No kind can be at its limit while all of them together are below
        // it: the key (a copy of the message's id) is only built then.
        if self.store.len() as u64 >= self.cfg.max_objects_per_kind
            && let Some(key) = update.upsert_key()
            && key.sweepable()
            && !self.store.contains(&key)
        {
            let kind = key.kind();
            let held = self.store.count(kind);
            if held >= self.cfg.max_objects_per_kind {
                self.reject(
                    session,
                    seq,
                    kind.wire_field(),
                    format!(
                        "{held} {} objects are held, the most allowed \
                         (--max-objects-per-kind); this new one was not added \
                         (replacing or removing one still works)",
                        kind.as_str()
                    ),
                );
                return false;
            }
        }
        if let Update::Config(kv) = update
            && let Err((field, why)) = config::ConfigState::check(kv)
        {
            self.reject(session, seq, &field, why);
            return false;
        }
        let verdict = self.managers.iter().find_map(|m| m.check(update).err());
        match verdict {
            None => true,
            Some(e) => {
                self.reject(session, seq, &e.field, e.reason);
                false
            }
        }
    }

    fn dispatch(&mut self, update: &Update) {
        if let Update::Config(kv) = update {
            self.config.on_config(kv);
        }
        self.store.record(update);
        for m in &mut self.managers {
            m.on_update(update);
        }
        self.dirty = true;
    }

    /// Handles one feed item; returns how many messages it carried.
    fn on_feed(&mut self, feed: Feed) -> usize {
        let mut n = 1;
        match feed {
            Feed::Open {
                session,
                programmed,
                rejections,
            } => {
                self.sessions.insert(
                    session,
                    SessionState {
                        start: self.store.now(),
                        swept: false,
                        highest: None,
                        programmed,
                        rejections,
                    },
                );
            }
            Feed::Close { session } => {
                self.sessions.remove(&session);
            }
            Feed::Message {
                session,
                seq,
                update,
            } => self.on_message(session, seq, update),
            Feed::Messages {
                session,
                messages,
                held: _held,
            } => {
                n = messages.len();
                for (seq, update) in messages {
                    self.on_message(session, seq, update);
                }
            }
        }
        self.status.feeders = u32::try_from(self.sessions.len()).unwrap_or(u32::MAX);
        if let Some(m) = &self.metrics {
            m.feeders.set(i64::from(self.status.feeders));
            m.batch_size.observe(n as f64);
        }
        n
    }

    fn on_message(&mut self, session: SessionId, seq: u64, update: Update) {
        self.unstick();
        self.count_message(&update);
        self.handle_message(session, seq, update);
        // Rejected or not, the message is dealt with: the stream learns it
        // through `Programmed` after the next apply (for a rejected one,
        // an apply that may have nothing to do), so a stream whose last
        // messages were refused still ends.
        if let Some(s) = self.sessions.get_mut(&session) {
            s.highest = Some(s.highest.map_or(seq, |h| h.max(seq)));
        }
        self.dirty = true;
    }

    fn handle_message(&mut self, session: SessionId, seq: u64, mut update: Update) {
        match &mut update {
            Update::InSync => {
                let sweep_since = self.sessions.get_mut(&session).and_then(|s| {
                    (!s.swept).then(|| {
                        s.swept = true;
                        s.start
                    })
                });
                if let Some(since) = sweep_since {
                    let stale = self.store.sweep(since);
                    if !stale.is_empty() {
                        info!(
                            session,
                            removed = stale.len(),
                            "snapshot complete: removing objects it did not contain"
                        );
                    }
                    for key in stale {
                        let remove = Update::Remove(key);
                        for m in &mut self.managers {
                            m.on_update(&remove);
                        }
                    }
                }
                self.status.datastore_in_sync = true;
                self.dirty = true;
            }
            Update::IpSetDeltaUpdate(delta) => {
                let key = Key::IpSet(delta.id.clone());
                let Some(ty) = self.store.ipset_type(&key) else {
                    self.reject(
                        session,
                        seq,
                        "ipset_delta_update.id",
                        format!("no IP set {} exists", delta.id),
                    );
                    return;
                };
                // Members were parsed by shape at the edge; bring them to the
                // set's own type (a bare IP in a hash:net set is a /32).
                for (name, list) in [
                    ("added_members", &mut delta.added),
                    ("removed_members", &mut delta.removed),
                ] {
                    for (i, m) in list.iter_mut().enumerate() {
                        match Member::parse(ty, &m.to_string()) {
                            Ok(norm) => *m = norm,
                            Err(e) => {
                                let field = format!("ipset_delta_update.{name}[{i}]");
                                self.reject(
                                    session,
                                    seq,
                                    &field,
                                    format!("{}; set is {}", e.reason, ty.ipset_type()),
                                );
                                return;
                            }
                        }
                    }
                }
                if !self.accepted(session, seq, &update) {
                    return;
                }
                self.dispatch(&update);
            }
            _ => {
                if !self.accepted(session, seq, &update) {
                    return;
                }
                self.dispatch(&update)
            }
        }
    }

    fn reject(&mut self, session: SessionId, seq: u64, field: &str, reason: String) {
        warn!(session, seq, field, %reason, "message rejected");
        if let Some(m) = &self.metrics {
            m.rejections.inc();
        }
        if let Some(s) = self.sessions.get(&session) {
            let r = Rejection {
                sequence_number: seq,
                field: field.into(),
                reason,
            };
            if let Err(mpsc::error::TrySendError::Full(r)) = s.rejections.try_send(r) {
                warn!(
                    session,
                    seq = r.sequence_number,
                    "the stream's client is not reading its replies: this rejection is only logged"
                );
            }
        }
    }

    /// New input after an apply that failed in a way a retry cannot
    /// mend: it may mend it, so the slow retry tick is not waited for.
    fn unstick(&mut self) {
        if self.stuck {
            self.stuck = false;
            self.retry_at = None;
        }
    }

    fn on_interface(&mut self, ev: InterfaceEvent) {
        // Anyone's route deleted (a routing daemon's churn) comes here:
        // only one of ours is worth an apply.
        if let InterfaceEvent::RouteRemoved(key) = &ev
            && !self
                .kernel
                .as_ref()
                .and_then(|k| k.routes.as_ref())
                .is_some_and(|r| r.holds(key))
        {
            return;
        }
        self.unstick();
        if ev == InterfaceEvent::InSync {
            self.status.interfaces_in_sync = true;
        } else {
            for m in &mut self.managers {
                m.on_interface(&ev);
            }
        }
        self.dirty = true;
    }

    fn refresh(&mut self, r: Refresh) {
        debug!(?r, "refresh tick");
        if let Some(m) = &self.metrics {
            m.resyncs
                .get_or_create(&crate::metrics::RefreshLabel {
                    refresh: format!("{r:?}").to_ascii_lowercase(),
                })
                .inc();
        }
        self.pending_refresh.push(r);
        self.dirty = true;
    }

    async fn maybe_apply(&mut self, ch: &Channels) {
        if !(self.status.datastore_in_sync && self.status.interfaces_in_sync && self.dirty) {
            return;
        }
        if ch
            .stopping
            .as_ref()
            .is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst))
        {
            debug!("stopping: nothing more is applied");
            return;
        }
        if self.retry_at.is_some() {
            return; // a failed apply waits for the retry tick
        }
        let now = Instant::now();
        if let Some(wait) = self.budget.wait(&self.cfg, now) {
            self.refill_at = Some(now + wait);
            return;
        }
        if let Err(not_until) = self.throttle.check() {
            self.refill_at = Some(Instant::now() + not_until.wait_time_from(self.clock.now()));
            return;
        }
        self.apply(ch).await;
    }

    async fn apply(&mut self, ch: &Channels) {
        // Tests (debug builds only): a panic where the loop does its work,
        // to see that it ends the daemon (tests/probes.rs).
        #[cfg(debug_assertions)]
        if std::env::var_os("DPH_TEST_PANIC_IN_APPLY").is_some() {
            panic!("DPH_TEST_PANIC_IN_APPLY: a panic injected into the apply");
        }
        let started = Instant::now();
        self.dirty = false;
        self.status.applies += 1;
        for m in &mut self.managers {
            m.resolve_update_batch();
        }
        let mut kernel = self
            .kernel
            .take()
            .expect("kernel is put back after every apply");
        // Resyncs first, so the managers see what the backends now need
        // (e.g. the whole desired state again) in this same apply.
        for r in self.pending_refresh.drain(..) {
            kernel.request_resync(r);
        }
        let mut error = None;
        // Whether some error of this apply can be mended by a retry.
        let mut retryable = false;
        for m in &mut self.managers {
            if let Err(e) = m.complete_deferred_work(&mut kernel) {
                retryable |= e.retryable();
                error.get_or_insert(e.to_string());
            }
        }
        let managers_done = started.elapsed();
        // Nothing for the kernel (a message that changed nothing, a
        // refused one): no hop to a blocking thread.
        let (kernel, result) = if kernel.is_empty() || !kernel.any_dirty() {
            (kernel, Ok(Default::default()))
        } else if tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread
        {
            // The kernel writes block: this worker hands its other tasks to
            // the rest of the runtime while they run (cheaper than a hop to
            // the blocking pool and back, which cost ~0.2 ms per apply).
            let r = tokio::task::block_in_place(|| kernel.apply_all());
            (kernel, r)
        } else {
            tokio::task::spawn_blocking(move || {
                let r = kernel.apply_all();
                (kernel, r)
            })
            .await
            .expect("apply task panicked")
        };
        let mut kernel = kernel;
        match result {
            Ok(outcome) => {
                // A backend that was not due in this apply keeps the time it
                // asked for earlier (a device read again for handshakes);
                // one with a read under way is looked at again, dirty or not.
                let wake = match (outcome.reschedule_after, kernel.wake_after()) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let new = wake.map(|d| Instant::now() + d);
                self.reschedule_at = match (self.reschedule_at, new) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            Err(errors) => {
                retryable |= errors.iter().any(BackendError::retryable);
                let msg = errors
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ");
                error.get_or_insert(msg);
            }
        }
        let kernel_done = started.elapsed();
        // Keys are announced as soon as the device has them, whether or not
        // a later phase failed.
        // The status first: a watcher that subscribes after the send finds
        // the key there (one that subscribed in between hears it twice).
        let events = kernel.take_events();
        if !events.is_empty() {
            for ev in &events {
                if let StatusEvent::WireguardStatus {
                    ip_version,
                    public_key,
                } = ev
                {
                    self.status
                        .wireguard_keys
                        .insert(*ip_version, public_key.clone());
                }
            }
            self.publish(ch);
            for ev in events {
                let _ = ch.events.send(ev);
            }
        }
        let still_dirty = kernel.any_dirty();
        let details: BTreeMap<String, String> = self
            .managers
            .iter()
            .flat_map(|m| m.status())
            .chain(kernel.status())
            .chain(self.config.details())
            .collect();
        if *self.status.details != details {
            if let Some(m) = &self.metrics {
                let isolated = details.keys().filter(|k| k.starts_with(ISOLATED)).count();
                m.isolated.set(i64::try_from(isolated).unwrap_or(i64::MAX));
            }
            self.status.details = Arc::new(details);
        }
        if let Some(m) = &self.metrics {
            kernel.export(m);
        }
        self.kernel = Some(kernel);
        debug!(
            managers_ms = managers_done.as_secs_f64() * 1e3,
            kernel_ms = (kernel_done - managers_done).as_secs_f64() * 1e3,
            status_ms = (started.elapsed() - kernel_done).as_secs_f64() * 1e3,
            "apply"
        );
        if let Some(e) = error {
            // What a retry can mend is retried with backoff; what it
            // cannot, at the next change or the slow retry tick only (a
            // write the kernel refuses as invalid, retried at once for
            // ever, held every other change back).
            let wait = if retryable {
                self.cfg
                    .retry_first
                    .saturating_mul(1u32 << self.failures.min(20))
                    .min(self.cfg.retry_interval)
            } else {
                self.cfg.retry_interval
            };
            self.stuck = !retryable;
            self.failures += 1;
            warn!(error = %e, retryable, retry_in = ?wait, "apply failed");
            self.status.failed_applies += 1;
            if let Some(m) = &self.metrics {
                m.failures.inc();
            }
            self.status.last_error = Some(e);
            self.dirty = true;
            self.retry_at = Some(Instant::now() + wait);
            return;
        }
        self.status.last_error = None;
        self.failures = 0;
        self.stuck = false;
        let took = started.elapsed();
        self.budget.spend(&self.cfg, took);
        self.apply_times.record(took);
        if let Some(m) = &self.metrics {
            m.apply_time.observe(started.elapsed().as_secs_f64());
        }
        self.status.apply = self.apply_times.summary();
        if still_dirty {
            // Something is left for another pass (the throttle paces it):
            // wake up for it even if nothing else happens.
            self.dirty = true;
            let now = Instant::now();
            self.reschedule_at = Some(self.reschedule_at.map_or(now, |t| t.min(now)));
            return;
        }
        let in_sync_now = !self.in_sync_sent && !self.dirty;
        if in_sync_now {
            self.in_sync_sent = true;
            self.status.in_sync = true;
            if let Some(m) = &self.metrics {
                m.in_sync.set(1);
            }
        }
        for s in self.sessions.values() {
            if let Some(h) = s.highest {
                self.status.last_programmed = self.status.last_programmed.max(h);
            }
        }
        // A feeder that hears `Programmed` and then asks GetStatus must find
        // it said there already: publish first.
        self.publish(ch);
        for s in self.sessions.values() {
            if let Some(h) = s.highest {
                s.programmed.send_replace(h);
            }
        }
        // Endpoint status after each successful apply, changes only.
        for m in &mut self.managers {
            for ev in m.status_changes() {
                let _ = ch.events.send(ev);
            }
        }
        if in_sync_now {
            info!("dataplane in sync");
            let _ = ch.events.send(StatusEvent::DataplaneInSync);
        }
    }

    fn publish(&mut self, ch: &Channels) {
        self.status.dirty = self.dirty;
        self.status.objects = self.store.counts().map(|(k, n)| (k.as_str(), n)).collect();
        ch.status.send_if_modified(|s| {
            if *s == self.status {
                false
            } else {
                *s = self.status.clone();
                true
            }
        });
    }
}

/// Current time as RFC 3339 UTC, without a date crate.
fn iso_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

mod config;
pub use config::{ConfigSettings, LogLevelHook, read_kept};

#[cfg(test)]
mod tests;
