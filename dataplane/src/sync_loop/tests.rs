//! Loop tests with a recording manager and backend (no root needed).

use std::sync::{Arc, Mutex};

use super::*;
use crate::backends::Phase;
use crate::backends::recording::{RecordingBackend, RecordingHandle};
use crate::managers::recording::{RecordingManager, Seen};
use crate::model::{Id, IpSet, IpSetDelta, IpSetType};

struct Harness {
    feed: mpsc::Sender<Feed>,
    ifaces: mpsc::Sender<InterfaceEvent>,
    events: broadcast::Receiver<StatusEvent>,
    status: watch::Receiver<Status>,
    backend: RecordingHandle,
    seen: Arc<Mutex<Seen>>,
    programmed: watch::Receiver<u64>,
    rejections: mpsc::Receiver<Rejection>,
    /// What the signal handler sets (`Channels::stopping`).
    stopping: Arc<std::sync::atomic::AtomicBool>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn fast_config() -> LoopConfig {
    LoopConfig {
        retry_interval: Duration::from_millis(300),
        retry_first: Duration::from_millis(300),
        ipset_refresh: Duration::ZERO,
        route_refresh: Duration::ZERO,
        xdp_refresh: Duration::ZERO,
        iptables_refresh: Duration::ZERO,
        interface_refresh: Duration::ZERO,
        ..LoopConfig::default()
    }
}

async fn start(cfg: LoopConfig) -> Harness {
    let (backend, handle) = RecordingBackend::new("rec", Phase::Tables);
    let (manager, seen) = RecordingManager::new(handle.clone());
    let kernel = DesiredKernel {
        others: vec![Box::new(backend)],
        ..Default::default()
    };
    let lp = SyncLoop::new(cfg, vec![Box::new(manager)], kernel);
    let (feed_tx, feed_rx) = mpsc::channel(1000);
    let (if_tx, if_rx) = mpsc::channel(100);
    let (ev_tx, ev_rx) = broadcast::channel(100);
    let (st_tx, st_rx) = watch::channel(Status::default());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ch = Channels {
        feed: feed_rx,
        interfaces: if_rx,
        interface_resync: None,
        events: ev_tx,
        status: st_tx,
        alive: None,
        stopping: Some(stopping.clone()),
    };
    tokio::spawn(lp.run(ch, async move {
        let _ = stop_rx.await;
    }));
    let (prog_tx, prog_rx) = watch::channel(0);
    let (rej_tx, rej_rx) = mpsc::channel(REJECTIONS_QUEUED);
    feed_tx
        .send(Feed::Open {
            session: 1,
            programmed: prog_tx,
            rejections: rej_tx,
        })
        .await
        .unwrap();
    Harness {
        feed: feed_tx,
        ifaces: if_tx,
        events: ev_rx,
        status: st_rx,
        backend: handle,
        seen,
        programmed: prog_rx,
        rejections: rej_rx,
        stopping,
        _stop: stop_tx,
    }
}

fn set(id: &str) -> Update {
    Update::IpSetUpdate(IpSet {
        id: Id::new(id).unwrap(),
        set_type: IpSetType::Ip,
        members: vec![],
    })
}

async fn send(h: &Harness, session: SessionId, seq: u64, update: Update) {
    h.feed
        .send(Feed::Message {
            session,
            seq,
            update,
        })
        .await
        .unwrap();
}

async fn wait_for(h: &mut Harness, what: impl Fn(&Status) -> bool) -> Status {
    tokio::time::timeout(Duration::from_secs(5), h.status.wait_for(|s| what(s)))
        .await
        .expect("timed out waiting for status")
        .unwrap()
        .clone()
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(150)).await;
}

#[tokio::test]
async fn nothing_applied_before_both_in_syncs() {
    let mut h = start(fast_config()).await;
    send(&h, 1, 1, set("a")).await;
    send(&h, 1, 2, Update::InSync).await;
    settle().await;
    assert_eq!(
        h.backend.lock().calls,
        0,
        "applied before the interface monitor was in sync"
    );
    // The set reaches the managers at once; InSync is the loop's own business.
    assert_eq!(h.seen.lock().unwrap().updates, vec![set("a")]);

    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    let st = wait_for(&mut h, |s| s.in_sync).await;
    assert_eq!(st.last_programmed, 2);
    assert_eq!(*h.programmed.borrow(), 2);
    assert_eq!(h.events.recv().await.unwrap(), StatusEvent::DataplaneInSync);
    let r = h.backend.lock();
    assert_eq!(r.calls, 1);
    assert!(r.applied[0][0].contains("IpSetUpdate"));
}

/// Once the daemon is told to stop (the flag its signal handler sets,
/// before the loop's `shutdown` future is polled), a change that comes
/// after is not applied: a device lost in the same drain is not made again.
#[tokio::test]
async fn nothing_is_applied_once_stopping() {
    let mut h = start(fast_config()).await;
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 1, Update::InSync).await;
    wait_for(&mut h, |s| s.in_sync).await;
    let before = h.backend.lock().calls;
    h.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
    send(&h, 1, 2, set("a")).await;
    // The interface monitor's news (the lost device) is not applied either.
    h.ifaces
        .send(InterfaceEvent::LinkRemoved {
            index: 7,
            name: "wg0".into(),
        })
        .await
        .unwrap();
    settle().await;
    assert_eq!(h.backend.lock().calls, before, "applied while stopping");
    assert_eq!(h.status.borrow().last_programmed, 1);
    // The control: the same change is applied when the flag is down.
    h.stopping.store(false, std::sync::atomic::Ordering::SeqCst);
    send(&h, 1, 3, set("b")).await;
    wait_for(&mut h, |s| s.last_programmed == 3).await;
    assert!(h.backend.lock().calls > before);
}

#[tokio::test]
async fn nothing_applied_before_datastore_in_sync() {
    let mut h = start(fast_config()).await;
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 1, set("a")).await;
    settle().await;
    assert_eq!(h.backend.lock().calls, 0);
    assert!(!h.status.borrow().in_sync);
    send(&h, 1, 2, Update::InSync).await;
    wait_for(&mut h, |s| s.in_sync).await;
}

/// Sends `n` IP-set messages from seq `from + 1` on, as fast as the
/// channel takes them.
fn flood(h: &Harness, from: u64, n: u64) -> tokio::task::JoinHandle<()> {
    let feed = h.feed.clone();
    tokio::spawn(async move {
        for i in from..from + n {
            feed.send(Feed::Message {
                session: 1,
                seq: i + 1,
                update: set(&format!("s{i}")),
            })
            .await
            .unwrap();
            if i % 50 == 0 {
                tokio::task::yield_now().await;
            }
        }
    })
}

#[tokio::test]
async fn a_burst_is_throttled_to_the_burst_and_one_apply_per_period() {
    let cfg = fast_config();
    let (burst, period) = (cfg.throttle_burst as usize, cfg.throttle_period);
    let mut h = start(cfg).await;
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 0, Update::InSync).await;
    wait_for(&mut h, |s| s.in_sync).await;
    // Let the bucket fill up again.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let before = h.backend.lock().calls;
    let t0 = std::time::Instant::now();
    let sender = flood(&h, 0, 10_000);
    let window = Duration::from_millis(100);
    tokio::time::sleep(window.saturating_sub(t0.elapsed())).await;
    let in_window = h.backend.lock().calls - before;
    let elapsed = t0.elapsed();
    sender.await.unwrap();
    let most = burst + (elapsed.as_secs_f64() / period.as_secs_f64()) as usize + 1;
    assert!(
        in_window <= most,
        "{in_window} applies in {elapsed:?} (at most {most})"
    );
    assert!(
        in_window >= 2,
        "the burst should have applied a few times, got {in_window}"
    );
    // Everything is programmed eventually.
    wait_for(&mut h, |s| s.last_programmed == 10_000 && !s.dirty).await;
    assert_eq!(h.status.borrow().objects.get("ipset"), Some(&10_000));
}

/// Dear applies under sustained changes: the loop waits after each (its
/// duty bound), so what comes in meanwhile is batched and the applies
/// take about `apply_duty` of the time, not all of it.
#[tokio::test]
async fn dear_applies_take_at_most_their_duty_of_the_time() {
    let cfg = LoopConfig {
        apply_duty: 0.5,
        duty_burst: Duration::from_millis(40),
        throttle_period: Duration::from_millis(1),
        ..fast_config()
    };
    let mut h = start(cfg).await;
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 0, Update::InSync).await;
    wait_for(&mut h, |s| s.in_sync).await;
    let takes = Duration::from_millis(20);
    h.backend.lock().apply_takes = takes;
    let before = h.backend.lock().calls;
    let t0 = std::time::Instant::now();
    let mut seq = 0;
    // A message every 2 ms for 600 ms: always something to apply.
    while t0.elapsed() < Duration::from_millis(600) {
        send(&h, 1, seq + 1, set(&format!("s{seq}"))).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let calls = h.backend.lock().calls - before;
    let busy = takes * calls as u32;
    let share = busy.as_secs_f64() / t0.elapsed().as_secs_f64();
    // Back to back they would be ~30 (100%); the duty bound allows ~15,
    // plus the first of the burst.
    assert!(
        share <= 0.5 + 0.1,
        "{calls} applies of {takes:?} in {:?}: {share:.2} of the time",
        t0.elapsed()
    );
    assert!(calls >= 8, "applies still run: {calls}");
    wait_for(&mut h, |s| s.last_programmed == seq && !s.dirty).await;
}

/// A change after a quiet spell is applied at once, however dear the
/// apply before it was (the budget had filled up meanwhile).
#[tokio::test]
async fn a_change_after_a_dear_apply_is_not_held_back() {
    let cfg = LoopConfig {
        apply_duty: 0.1,
        duty_gap_max: Duration::from_millis(400),
        ..fast_config()
    };
    let mut h = start(cfg).await;
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 0, Update::InSync).await;
    wait_for(&mut h, |s| s.in_sync).await;
    let takes = Duration::from_millis(30);
    h.backend.lock().apply_takes = takes;
    send(&h, 1, 1, set("a")).await;
    wait_for(&mut h, |s| s.last_programmed == 1).await;
    let sent = std::time::Instant::now();
    send(&h, 1, 2, set("b")).await;
    wait_for(&mut h, |s| s.last_programmed == 2).await;
    // Waiting out a tenth-duty gap after the first would be 270 ms.
    assert!(
        sent.elapsed() < Duration::from_millis(200),
        "the second change took {:?}",
        sent.elapsed()
    );
}

/// Cheap applies are not held back: a change under sustained churn is
/// programmed within a few periods, not Felix's 100 ms.
#[tokio::test]
async fn cheap_applies_follow_the_changes() {
    let mut h = start(fast_config()).await;
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 0, Update::InSync).await;
    wait_for(&mut h, |s| s.in_sync).await;
    let mut took = Vec::new();
    for seq in 1..=60u64 {
        let sent = std::time::Instant::now();
        send(&h, 1, seq, set(&format!("s{seq}"))).await;
        wait_for(&mut h, |s| s.last_programmed == seq).await;
        took.push(sent.elapsed());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    took.sort();
    // Felix's count throttle (10, then one per 100 ms) makes it ~95 ms
    // once the burst is spent.
    assert!(
        took[30] < Duration::from_millis(40),
        "the median of 60 changes took {:?}",
        took[30]
    );
}

#[tokio::test]
async fn drain_handles_queued_messages_in_one_wake() {
    let mut h = start(fast_config()).await;
    // Queue 50 messages before the loop gets to run; they are taken in one
    // wake-up, so the first apply sees all of them.
    for i in 0..50 {
        send(&h, 1, i + 1, set(&format!("s{i}"))).await;
    }
    send(&h, 1, 51, Update::InSync).await;
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    wait_for(&mut h, |s| s.in_sync).await;
    let r = h.backend.lock();
    assert_eq!(
        r.applied[0].len(),
        50,
        "first apply had {} ops",
        r.applied[0].len()
    );
}

#[tokio::test]
async fn a_batch_is_handled_in_order() {
    let mut h = start(fast_config()).await;
    // A later set of the same id replaces the earlier one: order matters.
    let mut messages: Vec<(u64, Update)> = (0..300)
        .map(|i| (i + 1, set(&format!("s{}", i % 100))))
        .collect();
    messages.push((301, Update::Remove(Key::IpSet(Id::new("s0").unwrap()))));
    messages.push((302, Update::InSync));
    h.feed
        .send(Feed::Messages {
            session: 1,
            messages,
            held: None,
        })
        .await
        .unwrap();
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    let st = wait_for(&mut h, |s| s.in_sync).await;
    assert_eq!(st.objects.get("ipset"), Some(&99));
    assert_eq!(*h.programmed.borrow(), 302);
    assert_eq!(st.last_programmed, 302);
}

#[tokio::test]
async fn failing_backend_is_retried_and_in_sync_waits_for_success() {
    let mut h = start(fast_config()).await;
    h.backend.lock().fail_on = vec![1, 2];
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 1, set("a")).await;
    send(&h, 1, 2, Update::InSync).await;
    let st = wait_for(&mut h, |s| s.failed_applies >= 1).await;
    assert!(!st.in_sync);
    assert!(
        st.last_error
            .as_deref()
            .unwrap()
            .contains("scripted failure")
    );
    // Not retried before the retry tick (300 ms here).
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(h.backend.lock().calls, 1);
    let t0 = std::time::Instant::now();
    let st = wait_for(&mut h, |s| s.in_sync).await;
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "retried too early"
    );
    assert_eq!(st.failed_applies, 2);
    assert_eq!(st.last_error, None);
    assert_eq!(h.backend.lock().calls, 3);
    assert_eq!(*h.programmed.borrow(), 2, "programmed only after success");
}

#[tokio::test]
async fn retries_back_off_from_the_first_wait_up_to_the_retry_interval() {
    let cfg = LoopConfig {
        retry_first: Duration::from_millis(20),
        retry_interval: Duration::from_secs(5),
        ..fast_config()
    };
    let mut h = start(cfg).await;
    h.backend.lock().fail_on = vec![1, 2, 3];
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 1, set("a")).await;
    let t0 = std::time::Instant::now();
    send(&h, 1, 2, Update::InSync).await;
    let st = wait_for(&mut h, |s| s.in_sync).await;
    let took = t0.elapsed();
    // 20 + 40 + 80 ms of waits, well under the 5 s cap.
    assert!(
        took >= Duration::from_millis(140),
        "retried too early: {took:?}"
    );
    assert!(
        took < Duration::from_secs(2),
        "no backoff from the first wait: {took:?}"
    );
    assert_eq!(st.failed_applies, 3);
    assert_eq!(h.backend.lock().calls, 4);
}

/// A failure a retry cannot mend is not retried with backoff: only at
/// the slow retry tick, or at once when a new message comes (it may mend
/// it).
#[tokio::test]
async fn a_failure_a_retry_cannot_mend_waits_for_the_next_change() {
    let cfg = LoopConfig {
        retry_first: Duration::from_millis(20),
        retry_interval: Duration::from_secs(30),
        ..fast_config()
    };
    let mut h = start(cfg).await;
    {
        let mut b = h.backend.lock();
        b.fail_on = vec![1];
        b.permanent = true;
    }
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 1, set("a")).await;
    send(&h, 1, 2, Update::InSync).await;
    let st = wait_for(&mut h, |s| s.failed_applies >= 1).await;
    assert!(!st.in_sync);
    // Backoff would have retried after 20 ms.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.backend.lock().calls, 1, "retried though nothing changed");
    // A new message: applied at once.
    let t0 = std::time::Instant::now();
    send(&h, 1, 3, set("b")).await;
    let st = wait_for(&mut h, |s| s.in_sync).await;
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(st.failed_applies, 1);
    assert_eq!(h.backend.lock().calls, 2);
}

#[tokio::test]
async fn refresh_tick_forces_a_resync() {
    let cfg = LoopConfig {
        ipset_refresh: Duration::from_millis(200),
        jitter: 0.0,
        ..fast_config()
    };
    let mut h = start(cfg).await;
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 1, Update::InSync).await;
    wait_for(&mut h, |s| s.in_sync).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = h.backend.lock();
    assert!(r.resyncs.contains(&Refresh::IpSets), "{:?}", r.resyncs);
    assert!(r.calls >= 2, "resync was not applied ({} calls)", r.calls);
}

#[tokio::test]
async fn second_session_in_sync_removes_what_it_lacks() {
    let mut h = start(fast_config()).await;
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 1, set("a")).await;
    send(&h, 1, 2, set("b")).await;
    send(&h, 1, 3, Update::InSync).await;
    wait_for(&mut h, |s| s.in_sync).await;
    h.feed.send(Feed::Close { session: 1 }).await.unwrap();

    let (prog_tx, mut prog_rx) = watch::channel(0);
    let (rej_tx, _rej_rx) = mpsc::channel(REJECTIONS_QUEUED);
    h.feed
        .send(Feed::Open {
            session: 2,
            programmed: prog_tx,
            rejections: rej_tx,
        })
        .await
        .unwrap();
    send(&h, 2, 1, set("b")).await;
    send(&h, 2, 2, set("c")).await;
    settle().await;
    assert_eq!(
        h.status.borrow().objects.get("ipset"),
        Some(&3),
        "nothing removed before InSync"
    );
    send(&h, 2, 3, Update::InSync).await;
    tokio::time::timeout(Duration::from_secs(5), prog_rx.wait_for(|p| *p == 3))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(h.status.borrow().objects.get("ipset"), Some(&2));
    let seen = h.seen.lock().unwrap();
    let removes: Vec<_> = seen
        .updates
        .iter()
        .filter(|u| matches!(u, Update::Remove(_)))
        .collect();
    assert_eq!(
        removes,
        vec![&Update::Remove(Key::IpSet(Id::new("a").unwrap()))]
    );
}

#[tokio::test]
async fn delta_for_unknown_set_is_rejected_and_rest_applies() {
    let mut h = start(fast_config()).await;
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    let net = Update::IpSetUpdate(IpSet {
        id: Id::new("n").unwrap(),
        set_type: IpSetType::Net,
        members: vec![],
    });
    send(&h, 1, 1, net).await;
    let delta = |id: &str, m: &str| {
        Update::IpSetDeltaUpdate(IpSetDelta {
            id: Id::new(id).unwrap(),
            added: vec![Member::parse_any(m).unwrap()],
            removed: vec![],
        })
    };
    send(&h, 1, 2, delta("nope", "10.0.0.1")).await;
    send(&h, 1, 3, delta("n", "10.0.0.1,tcp:80")).await;
    send(&h, 1, 4, delta("n", "10.0.0.1")).await;
    send(&h, 1, 5, Update::InSync).await;
    wait_for(&mut h, |s| s.in_sync).await;
    let r1 = h.rejections.recv().await.unwrap();
    assert_eq!(
        (r1.sequence_number, r1.field.as_str()),
        (2, "ipset_delta_update.id")
    );
    let r2 = h.rejections.recv().await.unwrap();
    assert_eq!(
        (r2.sequence_number, r2.field.as_str()),
        (3, "ipset_delta_update.added_members[0]")
    );
    let seen = h.seen.lock().unwrap();
    let accepted: Vec<_> = seen
        .updates
        .iter()
        .filter(|u| matches!(u, Update::IpSetDeltaUpdate(_)))
        .collect();
    assert_eq!(accepted.len(), 1);
    let Update::IpSetDeltaUpdate(d) = accepted[0] else {
        unreachable!()
    };
    assert_eq!(
        d.added[0].to_string(),
        "10.0.0.1/32",
        "normalised to the set's type"
    );
}

#[tokio::test]
async fn refused_last_messages_are_reported_as_dealt_with() {
    // After the snapshot, a delta that is refused: the stream's programmed
    // sequence still reaches it (nothing to apply), so a feeder waiting for
    // everything it sent to be dealt with is not left hanging.
    let mut h = start(fast_config()).await;
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 1, set("a")).await;
    send(&h, 1, 2, Update::InSync).await;
    wait_for(&mut h, |s| s.in_sync).await;
    let applies = h.status.borrow().applies;
    let refused = Update::IpSetDeltaUpdate(IpSetDelta {
        id: Id::new("nope").unwrap(),
        added: vec![Member::parse_any("10.0.0.1").unwrap()],
        removed: vec![],
    });
    send(&h, 1, 3, refused).await;
    tokio::time::timeout(Duration::from_secs(5), h.programmed.wait_for(|p| *p == 3))
        .await
        .expect("programmed reaches the refused message")
        .unwrap();
    assert_eq!(h.rejections.recv().await.unwrap().sequence_number, 3);
    let st = wait_for(&mut h, |s| s.applies > applies).await;
    assert_eq!(st.last_programmed, 3);
    assert_eq!(
        h.seen
            .lock()
            .unwrap()
            .updates
            .iter()
            .filter(|u| matches!(u, Update::IpSetDeltaUpdate(_)))
            .count(),
        0,
        "nothing of it reached the managers"
    );
}

#[test]
fn iso_timestamps_look_right() {
    let s = iso_now();
    assert_eq!(s.len(), 20, "{s}");
    assert!(
        s.starts_with("20") && s.ends_with('Z') && s.as_bytes()[10] == b'T',
        "{s}"
    );
}

#[tokio::test]
async fn a_new_object_over_the_kind_limit_is_rejected_and_the_rest_goes_on() {
    let mut h = start(LoopConfig {
        max_objects_per_kind: 2,
        ..fast_config()
    })
    .await;
    h.ifaces.send(InterfaceEvent::InSync).await.unwrap();
    send(&h, 1, 1, set("a")).await;
    send(&h, 1, 2, set("b")).await;
    send(&h, 1, 3, set("c")).await; // a third set: over the limit
    send(&h, 1, 4, set("a")).await; // replacing one held still works
    let ns = Update::Namespace {
        name: Id::new("default").unwrap(),
        labels: vec![],
    };
    send(&h, 1, 5, ns).await; // other kinds count on their own
    send(&h, 1, 6, Update::Remove(Key::IpSet(Id::new("b").unwrap()))).await;
    send(&h, 1, 7, set("c")).await; // room again
    send(&h, 1, 8, Update::InSync).await;
    let st = wait_for(&mut h, |s| s.in_sync).await;
    let r = h.rejections.recv().await.unwrap();
    assert_eq!((r.sequence_number, r.field.as_str()), (3, "ipset_update"));
    assert!(
        r.reason.contains("2 ipset objects are held")
            && r.reason.contains("--max-objects-per-kind"),
        "{}",
        r.reason
    );
    assert!(h.rejections.try_recv().is_err(), "only the one");
    assert_eq!(st.objects.get("ipset"), Some(&2));
    assert_eq!(st.objects.get("namespace"), Some(&1));
    let seen = h.seen.lock().unwrap();
    let sets: Vec<&str> = seen
        .updates
        .iter()
        .filter_map(|u| match u {
            Update::IpSetUpdate(s) => Some(s.id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        sets,
        ["a", "b", "a", "c"],
        "the refused one reached no manager"
    );
}

/// The apply summary's quantiles are the nearest-rank ones over the last
/// [`ApplyTimes::KEEP`] applies, whatever order they came in.
#[test]
fn the_apply_summary_takes_the_quantiles_of_the_last_applies() {
    let mut t = ApplyTimes::default();
    assert_eq!(t.summary().p50, Duration::ZERO);
    assert_eq!(t.summary().samples, 0);
    // 1..=100 ms, shuffled.
    for i in 0..100u64 {
        t.record(Duration::from_millis(1 + (i * 37) % 100));
    }
    let s = t.summary();
    assert_eq!(
        (s.p50, s.p99, s.max, s.samples),
        (
            Duration::from_millis(50),
            Duration::from_millis(99),
            Duration::from_millis(100),
            100
        )
    );
    assert_eq!(s.histogram[0], 1, "one apply took at most 1 ms");
    // Only the last KEEP count: 1,000 more of 1 s push the others out.
    for _ in 0..ApplyTimes::KEEP {
        t.record(Duration::from_secs(1));
    }
    let s = t.summary();
    assert_eq!(
        (s.p50, s.max, s.samples),
        (
            Duration::from_secs(1),
            Duration::from_secs(1),
            ApplyTimes::KEEP
        )
    );
}
