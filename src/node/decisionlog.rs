//! The durable decision log: every decision's record (`core::record`: the request as the core
//! saw it, the state each step saw, the results, the decision) goes to the node's JetStream
//! stream `OAM_DECISIONS_{node}` (subject `oam.v1.decisionlog.{node}`), kept by age and size as
//! `[decision_log]` says. Off the request's path: records wait in a buffer bounded in bytes
//! and are written in batches (many records per message, each batch with the pipeline
//! configuration they were decided under, and a message id the stream deduplicates on); a batch
//! not acknowledged is written again for a while (past a stream leader's election). While the
//! stream takes writes, a full buffer holds the answers that would overfill it until the writer
//! has made room (backpressure, not loss); what cannot be written in the end (no stream, or none
//! for that long) is counted in `/metrics` and the node's snapshot. `oam explain` and `oam
//! audit` read it.

use super::Node;
use super::pipeline::lock;
use crate::core::record::Record;
use crate::core::timeline::StateVersion;
use crate::transport::store::decisions::{self, batch_head, batches};
use crate::transport::subjects;
use serde::Deserialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;

/// Bytes of records waiting to be written at most (a record's content and declared tools, and
/// ~4 KB for the rest of it). Past it, an answer waits for the writer to make room while the stream takes writes
/// (at most `ROOM_WAIT`); else the oldest are dropped and counted.
const WAITING_MAX_BYTES: usize = 64 << 20;
/// What a record holds besides its content, as the buffer counts it.
const RECORD_OVERHEAD: usize = 4 << 10;
/// The longest an answer waits for room in the buffer.
const ROOM_WAIT: Duration = Duration::from_secs(5);
/// How often waiting records are written (or sooner, once this many wait).
const EVERY: Duration = Duration::from_millis(100);
const BATCH_RECORDS: usize = 256;
/// How long a write's acknowledgement may take before it is tried again.
const ACK_TIMEOUT: Duration = Duration::from_secs(2);

/// `[decision_log]` in `oam.toml`.
#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct LogSettings {
    pub enabled: bool,
    /// Records older than this go (hours).
    pub max_age_hours: u64,
    /// The stream's size at most (bytes; JetStream sets this much file storage aside); the
    /// oldest records go first.
    pub max_bytes: u64,
    /// `full`, or `hash`: each message's content is kept as its hash only (the record then
    /// cannot be replayed).
    pub content: LogContent,
    /// A record whose messages and answers hold more than this is kept as under `hash`: one
    /// caller's large requests cannot flush everyone's records out of `max_bytes`.
    pub max_content_bytes: usize,
    /// Release an answer only once its record is in the stream (acknowledged): a node killed
    /// at any moment has logged every answer it gave, for about one stream round trip per
    /// request (requests waiting together share one write). Off by default.
    pub durable: bool,
}

#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub(crate) enum LogContent {
    #[default]
    Full,
    Hash,
}

impl Default for LogSettings {
    fn default() -> Self {
        LogSettings {
            enabled: true,
            max_age_hours: 24 * 7,
            max_bytes: crate::transport::store::decisions::DEFAULT_MAX_BYTES,
            content: LogContent::Full,
            max_content_bytes: 16 << 10,
            durable: false,
        }
    }
}

/// What became of records, for `/metrics` and the snapshot.
#[derive(Default)]
pub(crate) struct LogCounters {
    pub written: AtomicU64,
    /// Dropped (buffer full) or not acknowledged by the stream.
    pub lost: AtomicU64,
    /// State timeline entries written, and lost (as records are).
    pub timeline_written: AtomicU64,
    pub timeline_lost: AtomicU64,
}

impl LogCounters {
    /// Register the counters, read when scraped.
    pub(crate) fn register(self: &Arc<Self>, registry: &super::metrics::Registry) {
        let c = self.clone();
        registry.register(
            "oam_decision_log_records_total",
            "Decision records, by what became of them (lost: the buffer was full, or the \
             stream did not take them).",
            super::metrics::Kind::Counter,
            move |s| {
                s.put(&[("result", "written")], c.written.load(Ordering::Relaxed));
                s.put(&[("result", "lost")], c.lost.load(Ordering::Relaxed));
            },
        );
        let c = self.clone();
        registry.register(
            "oam_decision_log_state_versions_total",
            "State timeline versions (the engine's per-target state, once per change), by what \
             became of them (lost: not taken by the stream; a whole state follows).",
            super::metrics::Kind::Counter,
            move |s| {
                let written = c.timeline_written.load(Ordering::Relaxed);
                s.put(&[("result", "written")], written);
                s.put(
                    &[("result", "lost")],
                    c.timeline_lost.load(Ordering::Relaxed),
                );
            },
        );
    }
}

pub(crate) struct DecisionLog {
    id: String,
    settings: LogSettings,
    /// Decision records waiting for the log, and who waits for each (under `durable`).
    waiting: Mutex<Waiting>,
    full: Notify,
    /// The writer took what waited: room was made.
    room: Notify,
    /// The stream took the writer's last write (so a full buffer is worth waiting for).
    accepting: std::sync::atomic::AtomicBool,
    /// `WAITING_MAX_BYTES` (smaller in tests).
    waiting_max: usize,
    pub counters: Arc<LogCounters>,
    /// The stream's size and age were compared with `settings` (once a run).
    retention_checked: std::sync::atomic::AtomicBool,
}

/// The service that writes waiting records in batches.
pub(crate) struct Writer(pub Arc<Node>);

impl DecisionLog {
    pub(crate) fn new(id: &str, settings: LogSettings) -> DecisionLog {
        DecisionLog {
            id: id.to_string(),
            settings,
            waiting: Mutex::default(),
            full: Notify::new(),
            room: Notify::new(),
            accepting: std::sync::atomic::AtomicBool::new(false),
            waiting_max: WAITING_MAX_BYTES,
            counters: Arc::default(),
            retention_checked: Default::default(),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.settings.enabled
    }

    /// Whether an answer waits for its record (`[decision_log] durable`).
    pub(crate) fn durable(&self) -> bool {
        self.settings.enabled && self.settings.durable
    }

    /// Keep a decided request's record for the next write (never waits: `logged` does). Under
    /// `durable`, the receiver says when it was written (true) or could not be (false), and the
    /// write starts at once.
    pub(crate) fn keep(&self, mut r: Record) -> Kept {
        let settings = &self.settings;
        if settings.content == LogContent::Hash || r.content_bytes() > settings.max_content_bytes {
            r.hash_content(|c| format!("xxh3:{:016x}", xxhash_rust::xxh3::xxh3_64(c.as_bytes())));
        }
        let (tx, rx) = if settings.durable {
            let (tx, rx) = tokio::sync::oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        // Its tools count in full though requests declaring the same share one set: a bound
        // that holds when they do not.
        let size = r.content_bytes() + r.request.tools.json_len() + RECORD_OVERHEAD;
        let mut waiting = lock(&self.waiting);
        let urgent = tx.is_some();
        waiting.records.push_back((r, tx, size));
        waiting.bytes += size;
        let over = waiting.bytes > self.waiting_max;
        if urgent || over || waiting.records.len() >= BATCH_RECORDS {
            self.full.notify_one();
        }
        Kept { ack: rx, over }
    }

    /// Keep the entries `e` wrote to its state timeline for the next write, before the records
    /// that name them (called under the engine's lock, so entries are kept in order). Beyond
    /// `TIMELINE_MAX` waiting entries (the stream long unwritable), they go, and the engine
    /// writes a whole state next.
    pub(crate) fn timeline(&self, e: &mut crate::core::pipeline::Engine) {
        let entries = e.take_timeline();
        if entries.is_empty() {
            return;
        }
        let mut waiting = lock(&self.waiting);
        waiting.timeline.extend(entries);
        if waiting.timeline.len() > TIMELINE_MAX {
            let lost = waiting.timeline.len();
            waiting.timeline.clear();
            drop(waiting);
            e.timeline_lost();
            self.counters
                .timeline_lost
                .fetch_add(lost as u64, Ordering::Relaxed);
        }
    }

    /// Wait until there is room for what was kept (while the stream takes writes, at most
    /// `ROOM_WAIT`; else the oldest records are dropped, counted, to make it), and under
    /// `durable` until the record is written (at most the write's own deadlines).
    pub(crate) async fn logged(&self, kept: Option<Kept>) {
        let Some(kept) = kept else { return };
        if kept.over {
            self.make_room().await;
        }
        if let Some(rx) = kept.ack
            && !matches!(
                tokio::time::timeout(RETRY_FOR + ACK_TIMEOUT * 2, rx).await,
                Ok(Ok(true))
            )
        {
            tracing::warn!(node = %self.id, "an answer released without its record in the decision log");
        }
    }
}

impl DecisionLog {
    async fn make_room(&self) {
        let deadline = tokio::time::Instant::now() + ROOM_WAIT;
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if lock(&self.waiting).bytes <= self.waiting_max {
                return;
            }
            let accepting = self.accepting.load(Ordering::Relaxed);
            if !accepting || tokio::time::timeout_at(deadline, room).await.is_err() {
                break;
            }
        }
        // No stream to drain to: the oldest go (their waiters hear `false` as senders drop).
        let mut waiting = lock(&self.waiting);
        while waiting.bytes > self.waiting_max {
            let Some((_, _, size)) = waiting.records.pop_front() else {
                break;
            };
            waiting.bytes -= size;
            self.counters.lost.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Records waiting for the writer, each with its waiter (under `durable`) and counted size.
#[derive(Default)]
struct Waiting {
    records: std::collections::VecDeque<(Record, Option<oneshot::Sender<bool>>, usize)>,
    bytes: usize,
    /// State timeline entries, in order (written before the records).
    timeline: Vec<StateVersion>,
}

/// State timeline entries waiting at most (see `DecisionLog::timeline`).
const TIMELINE_MAX: usize = 10_000;

/// What `keep` did with a record: `logged` waits on it.
#[must_use]
pub(crate) struct Kept {
    ack: Option<oneshot::Receiver<bool>>,
    /// The buffer is over its bound with it.
    over: bool,
}

/// A batch not yet acknowledged: written again (under the same message id, so a batch the
/// stream took but whose acknowledgement was lost is not stored twice) until `RETRY_FOR` has
/// passed since its first try.
struct Unwritten {
    id: String,
    records: usize,
    /// State timeline entries in it.
    entries: usize,
    bytes: bytes::Bytes,
    waiters: Vec<oneshot::Sender<bool>>,
    since: std::time::Instant,
}

/// How long a batch is tried again: past a stream leader's election (measured 4-8 s after the
/// leader's server dies), well within the stream's 2-minute duplicate window.
const RETRY_FOR: Duration = Duration::from_secs(20);
/// Bytes of unacknowledged batches kept at most; beyond, the oldest are counted lost.
const UNWRITTEN_MAX_BYTES: usize = 64 << 20;

impl Writer {
    /// Write waiting records in batches until `stop` (and once more then). A batch the stream
    /// does not acknowledge is tried again, oldest first, for `RETRY_FOR`.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let node = &self.0;
        let log = &node.log;
        if !log.enabled() {
            return;
        }
        let js = crate::transport::store::context(node.bus.nats());
        let idle = IdleEncoder::start(log.counters.clone());
        let mut ready = false;
        let subject = subjects::decision_log(&node.id);
        // Message ids unique across this node's restarts: its boot, then a count.
        let boot = crate::ids::random_hex(6).unwrap_or_else(|_| crate::clock::now_ms().to_string());
        let mut sent = 0_u64;
        // A stream that cannot be opened is said once until a write succeeds again.
        let mut said = false;
        let mut unwritten: std::collections::VecDeque<Unwritten> = Default::default();
        // Opened at start, not at the first record: a stream kept with other limits than
        // `[decision_log]` is changed (or said) before anything is written.
        if !node.bus.isolated() {
            ready = open(node, &js, said).await;
            said = !ready;
        }
        log.accepting.store(ready, Ordering::Relaxed);
        loop {
            let stopping = tokio::select! {
                () = tokio::time::sleep(EVERY) => false,
                () = log.full.notified() => false,
                () = stop.cancelled() => true,
            };
            let (timeline, waiting, behind) = {
                let taken = std::mem::take(&mut *lock(&log.waiting));
                // More than one batch's worth (taken at `BATCH_RECORDS`): the log is behind.
                let behind = taken.records.len() > BATCH_RECORDS;
                let records: Vec<(Record, Option<oneshot::Sender<bool>>)> =
                    taken.records.into_iter().map(|(r, w, _)| (r, w)).collect();
                (taken.timeline, records, behind)
            };
            log.room.notify_waiters();
            let head = batch_head(&node.id, &boot, &node.cfg.pipeline);
            // The state timeline first: the records name its versions.
            for (entries, bytes) in decisions::timeline_batches(&head, &timeline) {
                sent += 1;
                unwritten.push_back(Unwritten {
                    id: format!("{}.{boot}.{sent}", node.id),
                    records: 0,
                    entries,
                    bytes: bytes.into(),
                    waiters: Vec::new(),
                    since: std::time::Instant::now(),
                });
            }
            // Encoded at idle priority while the log keeps up and nobody waits for it.
            let urgent = behind || stopping || waiting.iter().any(|(_, w)| w.is_some());
            let encoded = match &idle {
                Some(idle) if !urgent && !waiting.is_empty() => idle.encode(head, waiting).await,
                _ => batches(&head, waiting, &log.counters.lost),
            };
            for (records, bytes, waiters) in encoded {
                sent += 1;
                unwritten.push_back(Unwritten {
                    id: format!("{}.{boot}.{sent}", node.id),
                    records,
                    entries: 0,
                    bytes: bytes.into(),
                    waiters,
                    since: std::time::Instant::now(),
                });
            }
            while let Some(batch) = unwritten.front() {
                if !ready {
                    ready = open(node, &js, said).await;
                    said = !ready;
                }
                if !(ready && !node.bus.isolated() && write(node, &js, &subject, batch).await) {
                    ready = false; // look at the stream again next time
                    log.accepting.store(false, Ordering::Relaxed);
                    break;
                }
                log.accepting.store(true, Ordering::Relaxed);
                said = false;
                if let Some(done) = unwritten.pop_front() {
                    log.counters
                        .written
                        .fetch_add(done.records as u64, Ordering::Relaxed);
                    log.counters
                        .timeline_written
                        .fetch_add(done.entries as u64, Ordering::Relaxed);
                    for w in done.waiters {
                        let _ = w.send(true);
                    }
                }
            }
            let mut held: usize = unwritten.iter().map(|b| b.bytes.len()).sum();
            while let Some(oldest) = unwritten.front() {
                let expired = stopping || oldest.since.elapsed() >= RETRY_FOR;
                if !expired && held <= UNWRITTEN_MAX_BYTES {
                    break;
                }
                if let Some(lost) = unwritten.pop_front() {
                    held -= lost.bytes.len();
                    log.counters
                        .lost
                        .fetch_add(lost.records as u64, Ordering::Relaxed);
                    if lost.entries > 0 {
                        log.counters
                            .timeline_lost
                            .fetch_add(lost.entries as u64, Ordering::Relaxed);
                        // Readers lose the versions until the next whole state.
                        node.pipeline
                            .with(crate::core::pipeline::Engine::timeline_lost);
                    }
                    for w in lost.waiters {
                        let _ = w.send(false);
                    }
                }
            }
            if stopping {
                return;
            }
        }
    }
}

type Batch = (usize, Vec<u8>, Vec<oneshot::Sender<bool>>);
type Waiter = Option<oneshot::Sender<bool>>;

/// A thread that encodes records at idle priority (`SCHED_IDLE`), counting what it cannot encode
/// as lost in the log's counters. Serialising a few hundred
/// records takes milliseconds; at the node's own priority a request woken on that core waited
/// behind it (most of the p99 at concurrency 1: 1.6 ms, 0.7-0.8 with this). An idle thread
/// gives way at once and its core counts as free to the scheduler (nice 19 did not help). On a
/// node with every core busy it still runs, slowly (its share is 3/1024 of a normal thread's):
/// the writer sends it at most one batch's worth of records at a time and encodes on the
/// runtime once more than that wait, or where an answer waits for its record (`durable`), or
/// at stop. A thread cannot leave idle priority without privileges, hence one of its own.
struct IdleEncoder {
    jobs: std::sync::mpsc::Sender<Encode>,
    counters: Arc<LogCounters>,
}

/// Records for the idle thread to encode, and where their batches go.
struct Encode {
    head: Vec<u8>,
    records: Vec<(Record, Waiter)>,
    done: oneshot::Sender<Vec<Batch>>,
}

impl IdleEncoder {
    /// The thread, named `oam-log-idle`; it ends with the encoder. None if it cannot start.
    fn start(counters: Arc<LogCounters>) -> Option<IdleEncoder> {
        let (jobs, rx) = std::sync::mpsc::channel::<Encode>();
        let lost = counters.clone();
        let run = move || {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: pid 0 is the calling thread; `param` outlives the call.
            if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &raw const param) } != 0 {
                tracing::debug!("decision log: the encoder runs at the node's priority");
            }
            while let Ok(e) = rx.recv() {
                let _ = e.done.send(batches(&e.head, e.records, &lost.lost));
            }
        };
        let spawned = std::thread::Builder::new()
            .name("oam-log-idle".into())
            .spawn(run);
        spawned.ok().map(|_| IdleEncoder { jobs, counters })
    }

    /// `batches` of `records`, encoded on the idle thread (on the caller's if it is gone).
    async fn encode(&self, head: Vec<u8>, records: Vec<(Record, Waiter)>) -> Vec<Batch> {
        let n = records.len() as u64;
        let (done, encoded) = oneshot::channel();
        let job = Encode {
            head,
            records,
            done,
        };
        if let Err(std::sync::mpsc::SendError(e)) = self.jobs.send(job) {
            return batches(&e.head, e.records, &self.counters.lost);
        }
        encoded.await.unwrap_or_else(|_| {
            // The thread ended with them (a panic): their waiters hear `false` as senders drop.
            self.counters.lost.fetch_add(n, Ordering::Relaxed);
            Vec::new()
        })
    }
}

/// Open (or create) the stream; whether it is there to write to. A failure is logged unless
/// it has been `said` already.
async fn open(node: &Node, js: &async_nats::jetstream::Context, said: bool) -> bool {
    let s = &node.log.settings;
    let cfg = decisions::stream(
        &node.id,
        Duration::from_secs(s.max_age_hours * 3600),
        s.max_bytes,
        crate::transport::store::replicas(node.bus.nats()),
    );
    let mut made = tokio::time::timeout(ACK_TIMEOUT, js.get_or_create_stream(cfg.clone())).await;
    if let Ok(Err(e)) = &made
        && decisions::overlaps(e)
    {
        // The shared log of earlier oam holds this node's subject: where this node may (no
        // mesh), it retires that one and makes its own.
        match decisions::retire_shared(js).await {
            Ok(()) => {
                made =
                    tokio::time::timeout(ACK_TIMEOUT, js.get_or_create_stream(cfg.clone())).await;
            }
            Err(e) => tracing::warn!(node = %node.id, "decision log: {e:#}"),
        }
    }
    match made {
        Ok(Ok(stream)) => {
            // Written still (a record is better kept once than lost), but said.
            let config = &stream.cached_info().config;
            if let Err(e) = crate::transport::store::check_replicas(node.bus.nats(), config) {
                tracing::warn!(node = %node.id, "decision log: {e:#}");
            }
            if !node.log.retention_checked.swap(true, Ordering::Relaxed) {
                apply_retention(node, js, config, &cfg).await;
            }
            true
        }
        Ok(Err(e)) => {
            if !said {
                tracing::warn!(node = %node.id, "decision log: cannot open the stream {} (tried again): {e}", cfg.name);
            }
            node.store_faults
                .failed("decision log", format!("cannot open the stream: {e}"));
            false
        }
        Err(_) => {
            if !said {
                tracing::warn!(node = %node.id, "decision log: no answer opening {} (tried again)", cfg.name);
            }
            false
        }
    }
}

/// The stream was made with other limits than this node's `[decision_log]` (by an earlier run,
/// by another version): give it this node's size and age, or, where this node may not change
/// streams (a mesh's node role), say so and how to apply them. Records are written either way.
/// A stream smaller than `max_bytes` is this node's share of a mesh's log (`oam mesh up`
/// shares it out among the nodes) and is left so.
async fn apply_retention(
    node: &Node,
    js: &async_nats::jetstream::Context,
    have: &async_nats::jetstream::stream::Config,
    want: &async_nats::jetstream::stream::Config,
) {
    let share = (1..want.max_bytes).contains(&have.max_bytes);
    let want = &async_nats::jetstream::stream::Config {
        max_bytes: if share {
            have.max_bytes
        } else {
            want.max_bytes
        },
        ..want.clone()
    };
    let Some(change) = decisions::retention_differs(have, want) else {
        return;
    };
    let updated = async_nats::jetstream::stream::Config {
        max_bytes: want.max_bytes,
        max_age: want.max_age,
        ..have.clone()
    };
    let stream = &want.name;
    match tokio::time::timeout(ACK_TIMEOUT, js.update_stream(updated)).await {
        Ok(Ok(_)) => {
            tracing::info!(node = %node.id, "decision log: the stream {stream} now keeps what [decision_log] says ({change})");
        }
        _ => tracing::warn!(
            node = %node.id,
            "decision log: the stream {stream} keeps other limits than this node's [decision_log] \
             ({change}) and this node may not change it, so records go by the stream's; apply \
             the configuration with `oam mesh up --config FILE` (it changes the stream as the \
             admin), or `nats stream edit {stream} --max-bytes {} --max-age {}h`",
            want.max_bytes,
            want.max_age.as_secs() / 3600
        ),
    }
}

/// Write one batch under its message id; whether the stream acknowledged it.
async fn write(
    node: &Node,
    js: &async_nats::jetstream::Context,
    subject: &str,
    batch: &Unwritten,
) -> bool {
    let publish = async_nats::jetstream::message::PublishMessage::build()
        .payload(batch.bytes.clone())
        .message_id(&batch.id);
    let sent = tokio::time::timeout(ACK_TIMEOUT, js.send_publish(subject.to_string(), publish));
    let Ok(Ok(ack)) = sent.await else {
        return false;
    };
    match tokio::time::timeout(ACK_TIMEOUT, ack).await {
        Ok(Ok(_)) => {
            node.store_faults.ok("decision log");
            true
        }
        Ok(Err(e)) => {
            node.store_faults.failed("decision log", e);
            false
        }
        Err(_) => {
            node.store_faults
                .failed("decision log", "no acknowledgement");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::pipeline::tests::{engine, recorded};

    fn log(settings: LogSettings) -> DecisionLog {
        DecisionLog::new("n1", settings)
    }

    /// Records encoded on the idle thread come out as encoded on the runtime, and the thread
    /// runs at idle priority.
    #[tokio::test]
    async fn the_idle_encoder_encodes_as_the_runtime_does_at_the_lowest_priority() {
        let mut e = engine();
        let a: Vec<(Record, Option<oneshot::Sender<bool>>)> = (0..300)
            .map(|i| (recorded(&mut e, &format!("r{i}"), 100), None))
            .collect();
        let copy = || a.iter().map(|(r, _)| (r.clone(), None)).collect();
        let (b, c) = (copy(), copy());
        let counters = Arc::new(LogCounters::default());
        let head = b"{\"node\":\"n1\"".to_vec();
        let idle = IdleEncoder::start(counters.clone()).expect("a thread");
        let there = idle.encode(head.clone(), a).await;
        let here = batches(&head, b, &counters.lost);
        let bytes = |v: &[Batch]| {
            v.iter()
                .map(|(n, b, _)| (*n, b.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(bytes(&there), bytes(&here));
        assert_eq!(there.iter().map(|b| b.0).sum::<usize>(), 300);
        // Its thread (and any other test's) at idle priority; the caller's left alone.
        // SAFETY: a plain system call on an integer (0: the calling thread).
        let policy = |tid: libc::pid_t| unsafe { libc::sched_getscheduler(tid) };
        let idle_threads: Vec<libc::pid_t> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| {
                let t = t.ok()?.path();
                let comm = std::fs::read_to_string(t.join("comm")).ok()?;
                (comm.trim() == "oam-log-idle").then(|| t.file_name()?.to_str()?.parse().ok())?
            })
            .collect();
        assert!(!idle_threads.is_empty(), "the thread is there, so named");
        for tid in idle_threads {
            assert_eq!(policy(tid), libc::SCHED_IDLE, "thread {tid}");
        }
        assert_eq!(policy(0), libc::SCHED_OTHER, "the caller's thread");
        // With no thread to take them, records are encoded where they are.
        let gone = IdleEncoder {
            jobs: std::sync::mpsc::channel().0,
            counters: counters.clone(),
        };
        let here_again = gone.encode(head.clone(), c).await;
        assert_eq!(bytes(&here_again), bytes(&here));
        assert_eq!(counters.lost.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_record_over_max_content_bytes_keeps_only_hashes_of_its_content() {
        let mut e = engine();
        let settings = LogSettings {
            max_content_bytes: 100,
            ..LogSettings::default()
        };
        let l = log(settings);
        assert!(
            l.keep(recorded(&mut e, "small", 10)).ack.is_none(),
            "not durable: no waiter"
        );
        let _ = l.keep(recorded(&mut e, "big", 1_000));
        let waiting = lock(&l.waiting);
        let text = |i: usize| serde_json::to_string(&waiting.records[i].0).unwrap();
        assert!(text(0).contains(&"x".repeat(10)), "small content is kept");
        assert!(!text(1).contains(&"x".repeat(100)), "large content is not");
        assert!(text(1).contains("xxh3:"), "only its hash");
    }

    /// Past its bound in bytes, a record's answer waits while the stream takes writes, and is
    /// released as the writer makes room, nothing dropped; with no stream taking writes the
    /// oldest go, counted, and a durable waiter hears it.
    #[tokio::test]
    async fn a_full_buffer_holds_answers_back_while_the_stream_takes_writes() {
        let mut e = engine();
        let mut l = log(LogSettings {
            durable: true,
            ..LogSettings::default()
        });
        // Records of ~14 KB (10,000 content bytes and the overhead): 67 overfill ~940 KB.
        l.waiting_max = 66 * (10_000 + RECORD_OVERHEAD + 100);
        let l = Arc::new(l);
        let big = 10_000;
        let mut first = l.keep(recorded(&mut e, "r0", big));
        let first_ack = first.ack.take().expect("a waiter");
        for i in 1..66 {
            assert!(!l.keep(recorded(&mut e, &format!("r{i}"), big)).over, "{i}");
        }
        // The stream takes writes: the answer over the bound waits for room ...
        l.accepting.store(true, Ordering::Relaxed);
        let over = l.keep(recorded(&mut e, "over", big));
        assert!(over.over);
        let waiting = tokio::spawn({
            let l = l.clone();
            async move { l.make_room().await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "it waits for the writer");
        // ... which takes what waits, and it goes on; nothing was dropped.
        let taken = std::mem::take(&mut *lock(&l.waiting));
        l.room.notify_waiters();
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("released once room was made")
            .unwrap();
        assert_eq!(taken.records.len(), 67);
        assert_eq!(l.counters.lost.load(Ordering::Relaxed), 0);
        drop(taken);
        assert!(
            first_ack.await.is_err(),
            "dropped with the taken batch here"
        );
        // No stream: the oldest go at once, counted, down to the bound.
        l.accepting.store(false, Ordering::Relaxed);
        let mut oldest = l.keep(recorded(&mut e, "s0", big));
        let mut oldest_ack = oldest.ack.take().expect("a waiter");
        let mut last = None;
        for i in 1..70 {
            last = Some(l.keep(recorded(&mut e, &format!("s{i}"), big)));
        }
        assert!(last.is_some_and(|k| k.over));
        l.make_room().await; // what `logged` does for it, before waiting on its write

        let w = lock(&l.waiting);
        assert!(w.bytes <= l.waiting_max, "{}", w.bytes);
        assert_eq!(
            l.counters.lost.load(Ordering::Relaxed),
            4,
            "70 kept, 66 fit"
        );
        assert_eq!(
            oldest_ack.try_recv(),
            Err(tokio::sync::oneshot::error::TryRecvError::Closed),
            "its waiter hears it will not be written"
        );
    }
}
