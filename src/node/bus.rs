//! The node's side of NATS: its connection, the outbox every event waits in (so a slow or
//! absent NATS never blocks a request), live decisions sent in batches, what it refused to
//! apply from the bus, and whether chaos has cut it off (`oam chaos isolate-node`).
//!
//! [`Bus`] is the handle every service shares; [`Publisher`] is the service that moves the
//! outbox to NATS, in order.

use super::pipeline::lock;
use crate::clock::now_ms;
use crate::core::record::Decided;
use crate::core::wire::Stamper;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

/// Events wait here for the bus.
const OUTBOX_CAPACITY: usize = 4_096;
/// Decisions go out in batches: every this many ms ...
pub(crate) const DECISION_BATCH_MS: u64 = 50;
/// ... or as soon as this many wait.
pub(crate) const DECISION_BATCH_MAX: usize = 256;
/// Decisions kept at most while the bus is slower than the node (the oldest go first, counted).
const DECISIONS_KEPT: usize = 8 * DECISION_BATCH_MAX;

/// Forged events logged (at warn) before only the counter says more.
const FORGED_LOGGED: u64 = 8;

/// Counters of what the node refused to apply from the bus, and events it could not send.
#[derive(Default)]
pub(crate) struct BusCounters {
    pub malformed: AtomicU64,
    pub duplicate_or_stale: AtomicU64,
    pub forged: AtomicU64,
    /// Events not published because the outbox was full (NATS down for long).
    pub dropped_events: AtomicU64,
}

/// The isolation under way, if `until_ms` is ahead (none by default).
#[derive(Default)]
struct Isolation {
    /// The fault's id.
    id: String,
    until_ms: u64,
    /// What an early restore over HTTP carries.
    key: String,
}

pub(crate) struct Bus {
    id: String,
    nats: async_nats::Client,
    outbox: mpsc::Sender<(String, bytes::Bytes)>,
    stamper: Mutex<Stamper>,
    pub counters: BusCounters,
    /// Decisions waiting for the next batch.
    decisions: Mutex<std::collections::VecDeque<Arc<Decided>>>,
    decisions_full: Notify,
    /// Chaos cutting the node off from NATS.
    isolation: Mutex<Isolation>,
    /// Woken when the node is cut off from NATS or reconnected.
    pub isolation_changed: Notify,
}

/// Moves the outbox to NATS, and live decisions to the outbox in batches.
pub(crate) struct Publisher {
    bus: Arc<Bus>,
    rx: mpsc::Receiver<(String, bytes::Bytes)>,
}

impl Bus {
    pub(crate) fn new(id: &str, nats: async_nats::Client) -> (Arc<Bus>, Publisher) {
        let (outbox, rx) = mpsc::channel(OUTBOX_CAPACITY);
        let bus = Arc::new(Bus {
            id: id.to_string(),
            nats,
            outbox,
            stamper: Mutex::new(Stamper::new(id.to_string(), now_ms())),
            counters: BusCounters::default(),
            decisions: Mutex::default(),
            decisions_full: Notify::new(),
            isolation: Mutex::default(),
            isolation_changed: Notify::new(),
        });
        let publisher = Publisher {
            bus: bus.clone(),
            rx,
        };
        (bus, publisher)
    }

    /// Register what the node refused from the bus, read when scraped.
    pub(crate) fn register(self: &Arc<Self>, registry: &super::metrics::Registry) {
        let bus = self.clone();
        registry.register(
            "oam_bus_messages_ignored_total",
            "Control-plane messages not applied, by reason.",
            super::metrics::Kind::Counter,
            move |s| {
                let c = &bus.counters;
                for (reason, n) in [
                    ("malformed", &c.malformed),
                    ("duplicate_or_stale", &c.duplicate_or_stale),
                    ("forged", &c.forged),
                    ("dropped_outgoing", &c.dropped_events),
                ] {
                    s.put(&[("reason", reason)], n.load(Ordering::Relaxed));
                }
            },
        );
    }

    /// The connection, for the services that subscribe and read stores.
    pub(crate) fn nats(&self) -> &async_nats::Client {
        &self.nats
    }

    /// Queue an event, in an envelope, for the bus. Never waits: when the outbox is full the
    /// event is dropped and counted.
    pub(crate) fn publish<T: Serialize>(&self, subject: String, body: T) {
        let env = lock(&self.stamper).stamp(now_ms(), body);
        match serde_json::to_vec(&env) {
            Ok(bytes) => {
                if self.outbox.try_send((subject, bytes.into())).is_err() {
                    self.counters.dropped_events.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) => tracing::warn!("cannot encode an event: {e}"),
        }
    }

    /// Keep a live decision for the next batch (never waits).
    pub(crate) fn decided(&self, d: Arc<Decided>) {
        let mut waiting = lock(&self.decisions);
        if waiting.len() >= DECISIONS_KEPT {
            waiting.pop_front();
            self.counters.dropped_events.fetch_add(1, Ordering::Relaxed);
        }
        waiting.push_back(d);
        if waiting.len() >= DECISION_BATCH_MAX {
            self.decisions_full.notify_one();
        }
    }

    /// Queue the waiting decisions, in batches of at most `DECISION_BATCH_MAX`.
    pub(crate) fn send_decisions(&self) {
        loop {
            let batch: Vec<Arc<Decided>> = {
                let mut waiting = lock(&self.decisions);
                let n = waiting.len().min(DECISION_BATCH_MAX);
                waiting.drain(..n).collect()
            };
            if batch.is_empty() {
                return;
            }
            self.publish(crate::transport::subjects::decision(&self.id), &batch);
        }
    }

    /// Count a forged event, and say so (the first few times).
    pub(crate) fn forged<T>(&self, stream: &str, sender: &str, why: &str) -> Option<T> {
        let n = self.counters.forged.fetch_add(1, Ordering::Relaxed);
        if n < FORGED_LOGGED {
            tracing::warn!(node = %self.id, stream, sender, "refused a forged event: {why}");
        }
        None
    }

    /// Cut the node off from NATS until `until_ms` (fault `id`; `key` restores it early).
    pub(crate) fn isolate(&self, id: String, until_ms: u64, key: String) {
        *lock(&self.isolation) = Isolation { id, until_ms, key };
        self.isolation_changed.notify_waiters();
    }

    /// End isolation `id`, if it is the one under way; whether it was.
    pub(crate) fn reconnect(&self, id: &str) -> bool {
        let mut iso = lock(&self.isolation);
        let ended = !iso.id.is_empty() && iso.id == id;
        if ended {
            *iso = Isolation::default();
            self.isolation_changed.notify_waiters();
        }
        ended
    }

    /// Cut off from NATS by chaos: nothing goes out, nothing coming in is applied, and the NATS
    /// data plane is unsubscribed.
    pub(crate) fn isolated(&self) -> bool {
        now_ms() < lock(&self.isolation).until_ms
    }

    /// Whether `key` is the key of isolation `id`, under way (constant time in the key).
    pub(crate) fn isolation_key_is(&self, id: &str, key: &str) -> bool {
        let iso = lock(&self.isolation);
        iso.id == id && !iso.key.is_empty() && super::config::Secret::of(&iso.key).matches(key)
    }

    /// Flush what waits in the outbox (the goodbye among it) within `limit`; never waits on a
    /// bus that is gone.
    pub(crate) async fn drain_within(&self, limit: Duration) {
        if self.nats.connection_state() != async_nats::connection::State::Connected {
            return;
        }
        let drained = async {
            while self.outbox.capacity() < OUTBOX_CAPACITY {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            crate::transport::connect::flush_within(&self.nats, limit).await;
        };
        let _ = tokio::time::timeout(limit, drained).await;
    }
}

impl Publisher {
    /// Until `stop`: decisions to the outbox every `DECISION_BATCH_MS` (or when a batch is
    /// full), the outbox to NATS in order. What waits when the node stops goes out then; the
    /// outbox keeps going out until the node's last handle is gone.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let Publisher { bus, mut rx } = self;
        let batcher = {
            let bus = bus.clone();
            async move {
                let mut tick = tokio::time::interval(Duration::from_millis(DECISION_BATCH_MS));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    let stopping = tokio::select! {
                        _ = tick.tick() => false,
                        () = bus.decisions_full.notified() => false,
                        () = stop.cancelled() => true,
                    };
                    bus.send_decisions();
                    if stopping {
                        return;
                    }
                }
            }
        };
        let forward = async {
            while let Some((subject, payload)) = rx.recv().await {
                if bus.isolated() {
                    continue; // a partition loses what it would have said
                }
                if let Err(e) = bus.nats.publish(subject, payload).await {
                    tracing::debug!("publish failed: {e}");
                }
            }
        };
        tokio::join!(batcher, forward);
    }
}

/// A bus on a client that never connects (port 1), for unit tests that need no server, and
/// what its services queued for NATS.
#[cfg(test)]
pub(crate) mod offline {
    use super::*;

    pub(crate) async fn client() -> async_nats::Client {
        async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect("nats://127.0.0.1:1")
            .await
            .expect("a client that retries in the background")
    }

    pub(crate) async fn bus(id: &str) -> (Arc<Bus>, Publisher) {
        Bus::new(id, client().await)
    }

    /// Every event queued so far: (subject, envelope as JSON).
    pub(crate) fn sent(p: &mut Publisher) -> Vec<(String, serde_json::Value)> {
        let mut out = Vec::new();
        while let Ok((subject, payload)) = p.rx.try_recv() {
            out.push((
                subject,
                serde_json::from_slice(&payload).expect("an envelope"),
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decision, as the engine makes one.
    fn decided() -> crate::core::pipeline::Decision {
        use crate::core::pipeline::{Step, tests};
        let mut e = tests::engine();
        let (mut s, _) = e.begin(tests::req("r"), tests::T0).expect("admitted");
        let g = crate::core::request::Generation::ok(r#"{"answer":"a","confidence":0.9}"#, 5);
        match e.complete(&mut s, g, tests::T0 + 5) {
            Step::Done(d) => *d,
            other => panic!("{other:?}"),
        }
    }

    async fn offline() -> (Arc<Bus>, Publisher) {
        super::offline::bus("n1").await
    }

    #[tokio::test]
    async fn a_full_outbox_drops_and_counts_instead_of_waiting() {
        let (bus, publisher) = offline().await;
        for i in 0..OUTBOX_CAPACITY + 3 {
            bus.publish(format!("s.{i}"), i);
        }
        assert_eq!(bus.counters.dropped_events.load(Ordering::Relaxed), 3);
        let mut rx = publisher.rx;
        let (subject, payload) = rx.recv().await.expect("the first event waits");
        assert_eq!(subject, "s.0");
        let env: crate::core::wire::Envelope<usize> = serde_json::from_slice(&payload).unwrap();
        assert_eq!((env.sender.as_str(), env.body), ("n1", 0));
    }

    #[tokio::test]
    async fn decisions_go_out_in_batches_and_the_oldest_go_when_too_many_wait() {
        let (bus, publisher) = offline().await;
        let d = Arc::new(Decided::new(decided()));
        for _ in 0..DECISIONS_KEPT + 2 {
            bus.decided(d.clone());
        }
        assert_eq!(bus.counters.dropped_events.load(Ordering::Relaxed), 2);
        bus.send_decisions();
        let mut rx = publisher.rx;
        let mut sizes = Vec::new();
        while let Ok((subject, payload)) = rx.try_recv() {
            assert_eq!(subject, crate::transport::subjects::decision("n1"));
            let env: crate::core::wire::Envelope<Vec<serde_json::Value>> =
                serde_json::from_slice(&payload).unwrap();
            sizes.push(env.body.len());
        }
        assert_eq!(
            sizes,
            vec![DECISION_BATCH_MAX; DECISIONS_KEPT / DECISION_BATCH_MAX]
        );
    }

    #[tokio::test]
    async fn isolation_ends_at_its_time_or_by_its_own_id_and_key_only() {
        let (bus, _p) = offline().await;
        bus.isolate("f1".into(), now_ms() + 60_000, "k1".into());
        assert!(bus.isolated());
        assert!(bus.isolation_key_is("f1", "k1"));
        assert!(!bus.isolation_key_is("f1", "k2"));
        assert!(!bus.isolation_key_is("f2", "k1"));
        assert!(
            !bus.reconnect("f2"),
            "another fault's restore does not end it"
        );
        assert!(bus.isolated());
        assert!(bus.reconnect("f1"));
        assert!(!bus.isolated());
        bus.isolate("f3".into(), now_ms().saturating_sub(1), String::new());
        assert!(!bus.isolated(), "past its time it is over");
        assert!(
            !bus.isolation_key_is("f3", ""),
            "an empty key restores nothing"
        );
    }
}
