//! The durable decision log: every decision's record (`core::record`: the request as the core
//! saw it, the state each step saw, the results, the decision) goes to the JetStream stream
//! `OAM_DECISIONS` (subjects `oam.v1.decisionlog.{node}`), kept by age and size as
//! `[decision_log]` says. Off the request's path: records wait in a bounded buffer and are
//! written in batches (many records per message, each batch with the pipeline configuration
//! they were decided under); what cannot be written (buffer full, no stream, no ack) is counted
//! in `/metrics` and the node's snapshot, never waited for. `oam explain` and `oam audit` read it.

use super::Node;
use crate::core::pipeline::Config as PipelineConfig;
use crate::core::record::Record;
use crate::transport::subjects;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Records waiting to be written at most; beyond, the oldest are dropped and counted.
const WAITING_MAX: usize = 8_192;
/// A batch message's size at most (the server's max_payload is 1 MB by default).
const BATCH_BYTES: usize = 512 * 1024;
/// About what one record takes (one provider, a short exchange): to size a message up front.
const RECORD_BYTES: usize = 4 * 1024;
/// How often waiting records are written (or sooner, once this many wait).
const EVERY: Duration = Duration::from_millis(100);
const BATCH_RECORDS: usize = 256;
/// How long a write's acknowledgement may take before its records count as lost.
const ACK_TIMEOUT: Duration = Duration::from_secs(2);

/// One message of the log: records decided under one configuration.
#[derive(Serialize, Deserialize, Debug)]
pub struct Batch {
    pub node: String,
    pub config: PipelineConfig,
    pub records: Vec<Record>,
}

/// `[decision_log]` in `oam.toml`.
#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogSettings {
    pub enabled: bool,
    /// Records older than this go (hours).
    pub max_age_hours: u64,
    /// The stream's size at most (bytes; JetStream sets this much file storage aside); the
    /// oldest records go first.
    pub max_bytes: u64,
    /// `full`, or `hash`: each message's content is kept as its hash only (the record then
    /// cannot be replayed).
    pub content: Content,
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
pub enum Content {
    #[default]
    Full,
    Hash,
}

impl Default for LogSettings {
    fn default() -> Self {
        LogSettings {
            enabled: true,
            max_age_hours: 24 * 7,
            max_bytes: 256 << 20,
            content: Content::Full,
            max_content_bytes: 16 << 10,
            durable: false,
        }
    }
}

/// What became of records, for `/metrics` and the snapshot.
#[derive(Default)]
pub struct LogCounters {
    pub written: AtomicU64,
    /// Dropped (buffer full) or not acknowledged by the stream.
    pub lost: AtomicU64,
}

/// The stream's configuration as `settings` asks.
pub fn stream_config(settings: &LogSettings) -> async_nats::jetstream::stream::Config {
    crate::transport::kv::decision_log_stream(
        Duration::from_secs(settings.max_age_hours * 3600),
        settings.max_bytes,
    )
}

impl Node {
    pub(crate) fn logs_decisions(&self) -> bool {
        self.cfg.decision_log.enabled
    }

    /// Keep a decided request's record for the next write (never waits). Under `durable`, the
    /// receiver says when it was written (true) or could not be (false), and the write starts
    /// at once.
    pub(crate) fn log_record(&self, mut r: Record) -> Option<tokio::sync::oneshot::Receiver<bool>> {
        let settings = &self.cfg.decision_log;
        if settings.content == Content::Hash || r.content_bytes() > settings.max_content_bytes {
            r.hash_content(|c| format!("xxh3:{:016x}", xxhash_rust::xxh3::xxh3_64(c.as_bytes())));
        }
        let (tx, rx) = if self.cfg.decision_log.durable {
            let (tx, rx) = tokio::sync::oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let mut waiting = super::lock(&self.records);
        if waiting.len() >= WAITING_MAX {
            // Its waiter (if any) hears `false` as its sender goes.
            waiting.remove(0);
            self.log_counters.lost.fetch_add(1, Ordering::Relaxed);
        }
        let urgent = tx.is_some();
        waiting.push((r, tx));
        if urgent || waiting.len() >= BATCH_RECORDS {
            self.records_full.notify_one();
        }
        rx
    }

    /// Wait (at most the write's own deadlines) until a durable record is written.
    pub(crate) async fn logged(&self, ack: Option<tokio::sync::oneshot::Receiver<bool>>) {
        if let Some(rx) = ack
            && !matches!(
                tokio::time::timeout(ACK_TIMEOUT * 3, rx).await,
                Ok(Ok(true))
            )
        {
            tracing::warn!(node = %self.id, "an answer released without its record in the decision log");
        }
    }

    /// Write waiting records in batches until the node stops (and once more then).
    pub(crate) async fn decision_log_loop(self: Arc<Self>) {
        if !self.logs_decisions() {
            return;
        }
        let js = async_nats::jetstream::new(self.nats.clone());
        let mut ready = false;
        let subject = subjects::decision_log(&self.id);
        loop {
            let stopping = tokio::select! {
                () = tokio::time::sleep(EVERY) => false,
                () = self.records_full.notified() => false,
                () = self.stop.cancelled() => true,
            };
            let waiting: Vec<(Record, Option<tokio::sync::oneshot::Sender<bool>>)> =
                std::mem::take(&mut *super::lock(&self.records));
            if !waiting.is_empty() {
                if !ready {
                    let cfg = stream_config(&self.cfg.decision_log);
                    match tokio::time::timeout(ACK_TIMEOUT, js.get_or_create_stream(cfg)).await {
                        Ok(Ok(_)) => ready = true,
                        Ok(Err(e)) => {
                            tracing::warn!(node = %self.id, "decision log: cannot open the stream {}: {e}", subjects::DECISION_LOG_STREAM);
                            self.store_faults
                                .failed("decision log", format!("cannot open the stream: {e}"));
                        }
                        Err(_) => {
                            tracing::warn!(node = %self.id, "decision log: no answer opening {}", subjects::DECISION_LOG_STREAM);
                        }
                    }
                }
                let head = batch_head(&self.id, &self.cfg.pipeline);
                for (n, bytes, waiters) in batches(&head, waiting, &self.log_counters.lost) {
                    let written = ready
                        && !self.isolated()
                        && match tokio::time::timeout(
                            ACK_TIMEOUT,
                            js.publish(subject.clone(), bytes.into()),
                        )
                        .await
                        {
                            Ok(Ok(ack)) => match tokio::time::timeout(ACK_TIMEOUT, ack).await {
                                Ok(Ok(_)) => {
                                    self.store_faults.ok("decision log");
                                    true
                                }
                                Ok(Err(e)) => {
                                    self.store_faults.failed("decision log", e);
                                    false
                                }
                                Err(_) => {
                                    self.store_faults
                                        .failed("decision log", "no acknowledgement");
                                    false
                                }
                            },
                            _ => false,
                        };
                    let counter = if written {
                        &self.log_counters.written
                    } else {
                        ready = false; // look at the stream again next time
                        &self.log_counters.lost
                    };
                    counter.fetch_add(n as u64, Ordering::Relaxed);
                    for w in waiters {
                        let _ = w.send(written);
                    }
                }
            }
            if stopping {
                return;
            }
        }
    }
}

/// A batch message's opening: `{"config":...,"node":...` (its records follow).
fn batch_head(node: &str, config: &PipelineConfig) -> Vec<u8> {
    let mut head = serde_json::to_vec(&serde_json::json!({"node": node, "config": config}))
        .unwrap_or_default();
    head.pop(); // the closing brace: `,"records":[...]}` follows
    head
}

/// Encode records into batch messages of at most `BATCH_BYTES` (a record larger than that
/// goes alone), each record encoded once: (records in it, bytes, who waits for it).
/// `head` is `batch_head`; a record that cannot be encoded is counted in `lost`.
#[allow(clippy::type_complexity)]
fn batches(
    head: &[u8],
    records: Vec<(Record, Option<tokio::sync::oneshot::Sender<bool>>)>,
    lost: &AtomicU64,
) -> Vec<(usize, Vec<u8>, Vec<tokio::sync::oneshot::Sender<bool>>)> {
    let mut out = Vec::new();
    // Records are written straight into the message, which is sized for them up front
    // (growing a half-megabyte buffer by doubling copies it over and over).
    let mut left = records.len();
    let fresh =
        |left: usize| Vec::with_capacity((left * RECORD_BYTES).min(BATCH_BYTES + RECORD_BYTES));
    let mut msg: Vec<u8> = fresh(left);
    let mut n = 0;
    let mut waiters = Vec::new();
    let close = |msg: &mut Vec<u8>,
                 n: &mut usize,
                 waiters: &mut Vec<tokio::sync::oneshot::Sender<bool>>,
                 out: &mut Vec<(usize, Vec<u8>, Vec<tokio::sync::oneshot::Sender<bool>>)>,
                 next: Vec<u8>| {
        if *n > 0 {
            msg.extend_from_slice(b"]}");
            out.push((*n, std::mem::replace(msg, next), std::mem::take(waiters)));
            *n = 0;
        }
    };
    // A message's records are written as a run (a cluster view the record before had is
    // written once); each message starts its own, so it reads alone.
    crate::core::record::in_a_run(|| {
        for (r, waiter) in records {
            left -= 1;
            let mark = msg.len();
            if n == 0 {
                msg.extend_from_slice(head);
                msg.extend_from_slice(b",\"records\":[");
            } else {
                msg.push(b',');
            }
            if serde_json::to_writer(&mut msg, &r).is_err() {
                msg.truncate(mark);
                lost.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if n > 0 && msg.len() + 2 > BATCH_BYTES {
                // Too big for this message: it starts the next one, written afresh.
                msg.truncate(mark);
                close(&mut msg, &mut n, &mut waiters, &mut out, fresh(left + 1));
                crate::core::record::run_afresh();
                msg.extend_from_slice(head);
                msg.extend_from_slice(b",\"records\":[");
                if serde_json::to_writer(&mut msg, &r).is_err() {
                    msg.clear();
                    lost.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
            waiters.extend(waiter);
            n += 1;
        }
    });
    close(&mut msg, &mut n, &mut waiters, &mut out, Vec::new());
    out
}

/// One record read back, with the configuration it was decided under and when it was written.
pub struct Entry {
    pub config: Arc<PipelineConfig>,
    pub record: Record,
}

/// Read the decision log from `since_ms` (ms since the epoch, by when batches were written),
/// oldest first; `node` narrows it to one node's records. Only the records `keep` wants are
/// held in memory: those, and how many records were read in all. A batch is believed only
/// from the node whose subject it came on (only that node may publish there).
pub async fn read(
    nats: &async_nats::Client,
    since_ms: u64,
    node: Option<&str>,
    keep: impl Fn(&Record) -> bool,
) -> anyhow::Result<(Vec<Entry>, usize)> {
    use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
    use futures_util::StreamExt;
    let js = async_nats::jetstream::new(nats.clone());
    let stream = js
        .get_stream(subjects::DECISION_LOG_STREAM)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "no decision log ({}): {e}; nodes write it as they decide",
                subjects::DECISION_LOG_STREAM
            )
        })?;
    let start = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(since_ms) * 1_000_000)
        .map_err(|e| anyhow::anyhow!("start time: {e}"))?;
    // An ephemeral pull consumer read a few batches per pull: each pull is bounded in
    // messages, so at most `PULL * BATCH_BYTES` is ever on its way to this reader (unbounded
    // pulls of a full log outran the server's pending limit for one client, which then dropped
    // the reader as a slow consumer).
    const PULL: usize = 16;
    let consumer = stream
        .create_consumer(pull::Config {
            deliver_policy: DeliverPolicy::ByStartTime { start_time: start },
            filter_subject: node.map(subjects::decision_log).unwrap_or_default(),
            ack_policy: AckPolicy::None,
            inactive_threshold: Duration::from_secs(30),
            memory_storage: true,
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", subjects::DECISION_LOG_STREAM))?;
    let mut pending = consumer.cached_info().num_pending;
    let mut out = Vec::new();
    let mut read = 0;
    while pending > 0 {
        let mut messages = consumer
            .batch()
            // No more than are there: a pull for more waits for them until it expires.
            .max_messages(PULL.min(usize::try_from(pending).unwrap_or(PULL)))
            .expires(Duration::from_secs(5))
            .messages()
            .await
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", subjects::DECISION_LOG_STREAM))?;
        let mut got = 0;
        while let Some(m) = messages.next().await {
            let m = m.map_err(|e| {
                anyhow::anyhow!("the decision log stopped answering after {read} records: {e}")
            })?;
            got += 1;
            pending = m.info().map_or(0, |i| i.pending);
            match crate::core::record::in_a_run(|| serde_json::from_slice::<Batch>(&m.payload)) {
                Ok(b)
                    if *m.subject != *subjects::decision_log(&b.node)
                        || b.records.iter().any(|r| r.node != b.node) =>
                {
                    tracing::warn!(
                        "records on {} that claim another node ({}) are not believed",
                        m.subject,
                        b.node
                    );
                }
                Ok(b) => {
                    read += b.records.len();
                    let config = Arc::new(b.config);
                    out.extend(
                        b.records
                            .into_iter()
                            .filter(|r| keep(r))
                            .map(|record| Entry {
                                config: config.clone(),
                                record,
                            }),
                    );
                }
                Err(e) => {
                    tracing::warn!("a decision log message is not a batch of records: {e}");
                }
            }
        }
        if got == 0 {
            anyhow::bail!("the decision log stopped answering after {read} records");
        }
    }
    Ok((out, read))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::pipeline::tests::{T0, engine, req};
    use crate::core::pipeline::{Engine, Step};
    use crate::core::record::{Call, Recorder};
    use crate::core::request::Generation;

    /// A decided request's record, its message `content_bytes` long.
    fn record(e: &mut Engine, id: &str, content_bytes: usize) -> Record {
        let mut r = req(id);
        r.messages[0].content = "x".repeat(content_bytes);
        let rec = Recorder::begin(e, &r, T0);
        let (mut s, _) = e.begin(r, T0).expect("valid");
        let mut rec = rec;
        let call = Call::Complete {
            generation: Generation::ok(r#"{"answer":"42","confidence":0.9}"#, 5),
        };
        rec.call(e, &call, T0 + 5);
        let Some(Step::Done(d)) = e.apply(&mut s, call, T0 + 5) else {
            panic!("decided")
        };
        rec.finish(Arc::new(crate::core::record::Decided::new(*d)))
    }

    #[test]
    fn records_are_split_into_messages_that_fit_and_read_back_in_order() {
        let mut e = engine();
        let config = e.config.clone();
        // Some records larger than the per-record estimate, one larger than a whole message.
        let sizes: Vec<usize> = (0..300)
            .map(|i| match i {
                150 => BATCH_BYTES + 1000,
                i if i % 7 == 0 => 20_000,
                _ => 500,
            })
            .collect();
        let mut waiting = Vec::new();
        let mut receivers = Vec::new();
        for (i, size) in sizes.iter().enumerate() {
            let (tx, rx) = tokio::sync::oneshot::channel();
            receivers.push(rx);
            waiting.push((record(&mut e, &format!("r{i}"), *size), Some(tx)));
        }
        let lost = AtomicU64::new(0);
        let out = batches(&batch_head("n1", &config), waiting, &lost);
        assert_eq!(lost.load(Ordering::Relaxed), 0);
        assert!(out.len() >= 3, "{} messages", out.len());
        let mut ids = Vec::new();
        for (n, bytes, waiters) in &out {
            // Each message names the cluster view its records share once, and reads alone.
            let text = std::str::from_utf8(bytes).unwrap();
            assert_eq!(text.matches("\"self_id\"").count(), 1, "{n} records");
            let b: Batch =
                crate::core::record::in_a_run(|| serde_json::from_slice(bytes)).expect("a batch");
            assert!(
                b.records
                    .iter()
                    .all(|r| r.begin.state.cluster == e.state.cluster)
            );
            assert_eq!(b.node, "n1");
            assert_eq!(b.records.len(), *n);
            assert_eq!(waiters.len(), *n);
            // Only a record that is alone may pass the limit.
            assert!(
                bytes.len() <= BATCH_BYTES || *n == 1,
                "{} bytes",
                bytes.len()
            );
            ids.extend(b.records.iter().map(|r| r.decision.request_id.clone()));
        }
        let expected: Vec<String> = (0..sizes.len()).map(|i| format!("r{i}")).collect();
        assert_eq!(ids, expected);
    }
}
