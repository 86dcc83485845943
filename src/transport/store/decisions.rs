//! The durable decision log as it is kept: a JetStream stream per node (`OAM_DECISIONS_{node}`,
//! subject `oam.v1.decisionlog.{node}`), one message per batch of records decided under one
//! pipeline configuration. A stream per node gives each node a byte budget of its own: what one
//! node writes (junk, on a stolen credential) pushes out only its own records. Nodes write it
//! (`node::decisionlog`); `oam explain` and `oam audit` read every node's stream and merge them.

use super::{StoreError, StoreResult};
use crate::core::pipeline::Config as PipelineConfig;
use crate::core::record::Record;
use crate::core::timeline::StateVersion;
use crate::transport::subjects;
use async_nats::jetstream;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How long the server may take to open the log for reading.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// A batch message's size at most (the server's max_payload is 1 MB by default).
const BATCH_BYTES: usize = 512 * 1024;
/// About what one record takes (one provider, a short exchange): to size a message up front.
const RECORD_BYTES: usize = 4 * 1024;

/// One message of the log: records decided under one configuration, or entries of the node's
/// state timeline (`core::timeline`), which come before the records that name them.
#[derive(Serialize, Deserialize, Debug)]
pub(crate) struct Batch {
    pub node: String,
    /// The node's run (one engine's life): state versions count within it.
    #[serde(default)]
    pub run: String,
    pub config: PipelineConfig,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub timeline: Vec<StateVersion>,
    #[serde(default)]
    pub records: Vec<Record>,
}

/// The decision log's size when the nodes' config says none (`[decision_log] max_bytes`).
pub const DEFAULT_MAX_BYTES: u64 = 256 << 20;

/// The configuration of `node`'s stream: records older than `max_age` go, and the oldest go
/// first beyond `max_bytes`.
pub fn stream(
    node: &str,
    max_age: Duration,
    max_bytes: u64,
    replicas: usize,
) -> jetstream::stream::Config {
    jetstream::stream::Config {
        num_replicas: replicas,
        name: subjects::decision_log_stream(node),
        subjects: vec![subjects::decision_log(node)],
        max_age,
        max_bytes: i64::try_from(max_bytes).unwrap_or(i64::MAX),
        discard: jetstream::stream::DiscardPolicy::Old,
        allow_direct: true,
        ..Default::default()
    }
}

/// Where the stream `have` keeps other limits than `want` says: what each says, for a message
/// (`max_bytes 268435456 -> 2147483648`), or None when they agree.
pub(crate) fn retention_differs(
    have: &jetstream::stream::Config,
    want: &jetstream::stream::Config,
) -> Option<String> {
    let mut said = Vec::new();
    if have.max_bytes != want.max_bytes {
        said.push(format!(
            "max_bytes {} -> {}",
            have.max_bytes, want.max_bytes
        ));
    }
    if have.max_age != want.max_age {
        said.push(format!(
            "max_age {} h -> {} h",
            have.max_age.as_secs() / 3600,
            want.max_age.as_secs() / 3600
        ));
    }
    (!said.is_empty()).then(|| said.join(", "))
}

/// Open the log's stream as `want` says, creating it; an existing one with other limits is
/// given `want`'s size and age (the rest of its configuration as it is). Whether it changed one,
/// as `retention_differs` says it.
pub(crate) async fn open_as(
    js: &jetstream::Context,
    want: jetstream::stream::Config,
) -> StoreResult<(jetstream::stream::Stream, Option<String>)> {
    let mut stream = js
        .get_or_create_stream(want.clone())
        .await
        .map_err(|e| StoreError::Failed(format!("cannot open the stream {}: {e}", want.name)))?;
    let have = stream.cached_info().config.clone();
    let Some(change) = retention_differs(&have, &want) else {
        return Ok((stream, None));
    };
    let updated = jetstream::stream::Config {
        max_bytes: want.max_bytes,
        max_age: want.max_age,
        ..have
    };
    js.update_stream(updated).await.map_err(|e| {
        StoreError::Failed(format!(
            "cannot change the stream {} ({change}): {e}",
            want.name
        ))
    })?;
    stream
        .info()
        .await
        .map_err(|e| StoreError::Failed(format!("{e}")))?;
    Ok((stream, Some(change)))
}

/// Give each of `nodes` its stream, sharing `max_bytes` equally among them (each keeps
/// `max_bytes / nodes`), as the admin: a node may write only its own and change none. The
/// shared stream of earlier oam, if there is one, is first retired (`retire_shared`).
/// What changed in streams that were there, as `retention_differs` says it.
pub(crate) async fn open_for(
    js: &jetstream::Context,
    nodes: &[String],
    max_age: Duration,
    max_bytes: u64,
    replicas: usize,
) -> StoreResult<Vec<String>> {
    retire_shared(js).await?;
    let each = max_bytes / u64::try_from(nodes.len().max(1)).unwrap_or(u64::MAX);
    let mut changed = Vec::new();
    for node in nodes {
        let (_, change) = open_as(js, stream(node, max_age, each, replicas)).await?;
        changed.extend(change.map(|c| format!("{}: {c}", subjects::decision_log_stream(node))));
    }
    Ok(changed)
}

/// `open_for` with the size and age the nodes' streams keep now (their sizes summed): a node
/// given credentials after `oam mesh up` gets its share of the same log.
pub(crate) async fn reshare(
    js: &jetstream::Context,
    nodes: &[String],
    replicas: usize,
) -> StoreResult<Vec<String>> {
    let (mut max_bytes, mut max_age) = (0_u64, Duration::ZERO);
    for node in nodes {
        if let Ok(mut s) = js.get_stream(subjects::decision_log_stream(node)).await {
            let config = &s.info().await?.config;
            max_bytes += u64::try_from(config.max_bytes).unwrap_or(0);
            max_age = max_age.max(config.max_age);
        }
    }
    if max_bytes == 0 {
        (max_bytes, max_age) = (DEFAULT_MAX_BYTES, Duration::from_secs(7 * 24 * 3600));
    }
    open_for(js, nodes, max_age, max_bytes, replicas).await
}

/// The stream earlier oam kept for all nodes together (`OAM_DECISIONS` on every node's
/// subject) takes no more writes: its subjects would overlap each node's own stream. What it
/// holds stays readable until it ages out.
pub(crate) async fn retire_shared(js: &jetstream::Context) -> StoreResult<()> {
    let name = subjects::DECISION_LOG_STREAM;
    let Ok(mut shared) = js.get_stream(name).await else {
        return Ok(()); // none (the usual case), or said where it is read
    };
    let have = shared.info().await?.config.clone();
    if have.subjects == [subjects::RETIRED_DECISION_LOG] {
        return Ok(());
    }
    js.update_stream(jetstream::stream::Config {
        subjects: vec![subjects::RETIRED_DECISION_LOG.to_string()],
        ..have
    })
    .await
    .map_err(|e| {
        StoreError::Failed(format!("cannot retire the shared decision log {name}: {e}"))
    })?;
    tracing::info!(
        "the decision log is kept per node now ({name}_{{node}}); {name} keeps what it holds \
         until it ages out"
    );
    Ok(())
}

/// The members every batch message opens with.
#[derive(Serialize)]
struct BatchHead<'a> {
    node: &'a str,
    run: &'a str,
    config: &'a PipelineConfig,
}

/// A batch message's opening: `{"node":...,"run":...,"config":...` (its records follow).
pub(crate) fn batch_head(node: &str, run: &str, config: &PipelineConfig) -> Vec<u8> {
    let mut head = serde_json::to_vec(&BatchHead { node, run, config }).unwrap_or_default();
    head.pop(); // the closing brace: `,"records":[...]}` follows
    head
}

/// Encode state timeline entries into batch messages (`head` is `batch_head`) of at most
/// `BATCH_BYTES` (an entry larger than that goes alone), in order: (entries in it, bytes).
pub(crate) fn timeline_batches(head: &[u8], entries: &[StateVersion]) -> Vec<(usize, Vec<u8>)> {
    let mut out = Vec::new();
    let mut msg = Vec::new();
    let mut n = 0;
    for e in entries {
        let Ok(one) = serde_json::to_vec(e) else {
            continue; // plain data: cannot fail
        };
        if n > 0 && msg.len() + one.len() + 2 > BATCH_BYTES {
            msg.extend_from_slice(b"]}");
            out.push((n, std::mem::take(&mut msg)));
            n = 0;
        }
        if n == 0 {
            msg.extend_from_slice(head);
            msg.extend_from_slice(b",\"timeline\":[");
        } else {
            msg.push(b',');
        }
        msg.extend_from_slice(&one);
        n += 1;
    }
    if n > 0 {
        msg.extend_from_slice(b"]}");
        out.push((n, msg));
    }
    out
}

/// Encode records into batch messages of at most `BATCH_BYTES` (a record larger than that
/// goes alone), each record encoded once: (records in it, bytes, who waits for it).
/// `head` is `batch_head`; a record that cannot be encoded is counted in `lost`.
pub fn batches<W>(
    head: &[u8],
    records: Vec<(Record, Option<W>)>,
    lost: &AtomicU64,
) -> Vec<(usize, Vec<u8>, Vec<W>)> {
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
                 waiters: &mut Vec<W>,
                 out: &mut Vec<(usize, Vec<u8>, Vec<W>)>,
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
            let run = crate::core::record::run_mark();
            if n == 0 {
                msg.extend_from_slice(head);
                msg.extend_from_slice(b",\"records\":[");
            } else {
                msg.push(b',');
            }
            if serde_json::to_writer(&mut msg, &r).is_err() {
                msg.truncate(mark);
                crate::core::record::rewind_run(run);
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
                    crate::core::record::run_afresh();
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
pub struct Stored {
    /// When its batch was written (ms since the epoch, the stream's time).
    pub written_ms: u64,
    pub config: Arc<PipelineConfig>,
    /// The node's run it was decided in (its state versions count within it).
    pub run: Arc<str>,
    pub record: Record,
}

/// How far back the log goes and what bounds it: what `oam explain` says of a record it does
/// not find.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogSpan {
    /// When its oldest batch was written (ms since the epoch); None when it is empty.
    pub first_ms: Option<u64>,
    pub bytes: u64,
    pub max_bytes: i64,
    pub max_age: Duration,
}

impl LogSpan {
    /// Why a record decided at most `searched_ms` ago (and not found) is not there, at `now_ms`,
    /// and what to do about it.
    pub fn why_missing(&self, searched_ms: u64, now_ms: u64) -> String {
        let Some(first) = self.first_ms else {
            return "the decision log holds no records yet".into();
        };
        let back = now_ms.saturating_sub(first);
        if back > searched_ms {
            return format!(
                "it goes back {}: try --since {}",
                human(back),
                human(back + 60_000)
            );
        }
        let full = self.max_bytes > 0 && self.bytes as f64 >= 0.9 * self.max_bytes as f64;
        let aged = back + 60_000 >= self.max_age.as_millis() as u64;
        if !full && !aged {
            return format!(
                "it holds every record since it began {} ago, and none has this id",
                human(back)
            );
        }
        if full && !aged {
            format!(
                "it goes back only {}: older records went by its size limit ({} MiB full; \
                 [decision_log] max_bytes keeps more)",
                human(back),
                self.max_bytes >> 20
            )
        } else {
            format!(
                "it goes back {}: older records went by its age limit ({} h; [decision_log] \
                 max_age_hours keeps them longer)",
                human(back),
                self.max_age.as_secs() / 3600
            )
        }
    }
}

/// `ms` as a `--since` reads it (`90s`, `12m`, `5h`, `3d`), rounded down.
pub fn human(ms: u64) -> String {
    let s = ms / 1_000;
    match s {
        0..60 => format!("{s}s"),
        60..3_600 => format!("{}m", s / 60),
        3_600..86_400 => format!("{}h", s / 3_600),
        _ => format!("{}d", s / 86_400),
    }
}

/// The log's streams, to read: every node's (only `node`'s, if given), and the shared stream
/// of earlier oam while it is there; an error that says why when the server does not answer
/// or there is no log yet.
async fn log_streams(
    nats: &async_nats::Client,
    node: Option<&str>,
) -> StoreResult<Vec<jetstream::stream::Stream>> {
    use futures_util::TryStreamExt;
    let js = super::context(nats);
    let deadline = tokio::time::Instant::now() + OPEN_TIMEOUT;
    let mut names = vec![subjects::DECISION_LOG_STREAM.to_string()];
    match node {
        Some(n) => names.push(subjects::decision_log_stream(n)),
        None => {
            let all: Vec<String> =
                retrying(deadline, || js.stream_names().try_collect::<Vec<String>>())
                    .await
                    .map_err(|_| no_answer())?
                    .map_err(|e| {
                        StoreError::Failed(format!("cannot list the decision log's streams: {e}"))
                    })?;
            let prefix = format!("{}_", subjects::DECISION_LOG_STREAM);
            names.extend(all.into_iter().filter(|n| n.starts_with(&prefix)));
        }
    }
    let mut out = Vec::new();
    for name in names {
        match retrying(deadline, || js.get_stream(&name)).await {
            Err(_) => return Err(no_answer()),
            Ok(Ok(s)) => out.push(s),
            Ok(Err(e)) if not_found(&e) => {}
            Ok(Err(e)) => {
                return Err(StoreError::Failed(format!(
                    "cannot read the decision log ({name}): {e}"
                )));
            }
        }
    }
    if out.is_empty() {
        return Err(StoreError::Failed(format!(
            "no decision log ({}_{}): nodes write it as they decide",
            subjects::DECISION_LOG_STREAM,
            node.unwrap_or("{node}")
        )));
    }
    Ok(out)
}

/// `ask` until it answers with anything but a passing unavailability (JetStream's 503 while a
/// leader is elected, no responders while a server restarts), tried again every 200 ms until
/// `deadline` (Err: no answer by then). A mesh just restarted answers so for a few seconds.
async fn retrying<
    T,
    E: std::fmt::Display,
    F: std::future::Future<Output = std::result::Result<T, E>>,
>(
    deadline: tokio::time::Instant,
    mut ask: impl FnMut() -> F,
) -> std::result::Result<std::result::Result<T, E>, tokio::time::error::Elapsed> {
    loop {
        let answer = tokio::time::timeout_at(deadline, ask()).await?;
        match answer {
            Err(e) if passing(&e.to_string()) && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            answer => return Ok(answer),
        }
    }
}

/// Does this error say the server is unavailable for a moment (not that anything is wrong)?
fn passing(error: &str) -> bool {
    let e = error.to_ascii_lowercase();
    e.contains("temporarily unavailable") || e.contains("no responders") || e.contains("503")
}

/// Whether a stream could not be made because another holds its subjects.
pub(crate) fn overlaps(e: &jetstream::context::CreateStreamError) -> bool {
    matches!(e.kind(), jetstream::context::CreateStreamErrorKind::JetStream(j)
        if j.error_code() == jetstream::ErrorCode::STREAM_SUBJECT_OVERLAP)
}

fn not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(j)
        if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
}

/// The log's span: all its streams together.
pub async fn span(nats: &async_nats::Client) -> StoreResult<LogSpan> {
    let mut span = LogSpan {
        first_ms: None,
        bytes: 0,
        max_bytes: 0,
        max_age: Duration::ZERO,
    };
    for mut stream in log_streams(nats, None).await? {
        let info = stream.info().await?;
        let first = (info.state.messages > 0).then(|| {
            u64::try_from(info.state.first_timestamp.unix_timestamp_nanos() / 1_000_000)
                .unwrap_or(0)
        });
        span.first_ms = match (span.first_ms, first) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        span.bytes += info.state.bytes;
        span.max_bytes = span.max_bytes.saturating_add(info.config.max_bytes.max(0));
        span.max_age = span.max_age.max(info.config.max_age);
    }
    Ok(span)
}

/// A server that never answers (its roles refuse this client's replies, say) is an error that
/// says what to do, not a wait without end.
fn no_answer() -> StoreError {
    StoreError::Silent(format!(
        "the server did not answer for the decision log ({}_*) within {} s; if the mesh was \
         started by another version of oam, start it again with `oam mesh up`",
        subjects::DECISION_LOG_STREAM,
        OPEN_TIMEOUT.as_secs()
    ))
}

/// Read the decision log from `since_ms` (ms since the epoch, by when batches were written),
/// oldest first by when each was written; `node` narrows it to one node's records. Only the
/// records `keep` wants are held in memory, the `last` of them at most (a full log read for
/// the newest few is not held whole): those, and how many records were read in all. A batch
/// is believed only from the node whose subject it came on (only that node may publish there).
pub async fn read(
    nats: &async_nats::Client,
    since_ms: u64,
    node: Option<&str>,
    keep: impl Fn(&Record) -> bool,
    last: usize,
) -> StoreResult<(Vec<Stored>, usize)> {
    let start = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(since_ms) * 1_000_000)
        .map_err(|e| StoreError::Unreadable(format!("start time: {e}")))?;
    let mut all = Vec::new();
    let mut read = 0;
    for stream in log_streams(nats, node).await? {
        let (out, n) = read_stream(nats, &stream, start, node, &keep, last).await?;
        all.extend(out);
        read += n;
    }
    // One stream after another: merged by when each was written (a stable sort keeps each
    // stream's order, which is the order written).
    all.sort_by_key(|s: &Stored| s.written_ms);
    all.drain(..all.len().saturating_sub(last));
    Ok((all, read))
}

/// `read` of one stream.
async fn read_stream(
    nats: &async_nats::Client,
    stream: &jetstream::stream::Stream,
    start: time::OffsetDateTime,
    node: Option<&str>,
    keep: &impl Fn(&Record) -> bool,
    last: usize,
) -> StoreResult<(std::collections::VecDeque<Stored>, usize)> {
    let name = &stream.cached_info().config.name;
    if last == usize::MAX {
        let filter = node.map_or_else(
            || subjects::DECISION_LOG_ALL.to_string(),
            subjects::decision_log,
        );
        let from = super::first_at(nats, stream, &filter, start).await?;
        let (out, read, _) =
            records_from(nats, stream, from, None, start, node, keep, last).await?;
        return Ok((out, read));
    }
    // Only the newest `last` are wanted: read back from the end in windows of messages, each
    // twice the one before, until enough are kept, the log's start, or `since_ms` is reached.
    let info = tokio::time::timeout(OPEN_TIMEOUT, stream.get_info())
        .await
        .map_err(|_| no_answer())?
        .map_err(|e| StoreError::Failed(format!("cannot read {name}: {e}")))?;
    let (first, mut end) = (info.state.first_sequence, info.state.last_sequence);
    let mut out = std::collections::VecDeque::new();
    let mut read = 0;
    let mut window: u64 = 16;
    while end >= first.max(1) && info.state.messages > 0 && out.len() < last {
        let begin = end.saturating_sub(window - 1).max(first).max(1);
        let (older, n, reached_since) =
            records_from(nats, stream, begin, Some(end), start, node, keep, last).await?;
        read += n;
        for e in older.into_iter().rev() {
            out.push_front(e);
        }
        if reached_since || begin == first {
            break;
        }
        end = begin - 1;
        window = window.saturating_mul(2);
    }
    out.drain(..out.len().saturating_sub(last));
    Ok((out, read))
}

/// Read records from `from` (up to sequence `until`, if given), as `read_from` does: the
/// records `keep` wants (the `last` of them at most), how many were read, and whether one
/// written before `since` was met.
#[allow(clippy::too_many_arguments)]
async fn records_from(
    nats: &async_nats::Client,
    stream: &async_nats::jetstream::stream::Stream,
    from: u64,
    until: Option<u64>,
    since: time::OffsetDateTime,
    node: Option<&str>,
    keep: &impl Fn(&Record) -> bool,
    last: usize,
) -> StoreResult<(std::collections::VecDeque<Stored>, usize, bool)> {
    let mut out = std::collections::VecDeque::new();
    let mut read = 0;
    let before_since = read_from(nats, stream, from, until, since, node, |b, written_ms| {
        read += b.records.len();
        let config = Arc::new(b.config);
        let run: Arc<str> = b.run.into();
        out.extend(
            b.records
                .into_iter()
                .filter(|r| keep(r))
                .map(|record| Stored {
                    written_ms,
                    config: config.clone(),
                    run: run.clone(),
                    record,
                }),
        );
        out.drain(..out.len().saturating_sub(last));
    })
    .await?;
    Ok((out, read, before_since))
}

/// Every record written since `since_ms` (`node`: one node's only), in the order each node
/// wrote them, given to `each` with the states its run's timeline had reached (the log read
/// from its start for them, `timeline::Versions`), so that it can be decided again on the state
/// it saw (`oam rehearse`). Nothing is held but the latest states of each run. How many
/// records were given.
pub(crate) async fn each_with_states(
    nats: &async_nats::Client,
    since_ms: u64,
    node: Option<&str>,
    mut each: impl FnMut(&Record, &crate::core::timeline::Versions),
) -> StoreResult<u64> {
    let mut given = 0;
    let since = time::OffsetDateTime::UNIX_EPOCH;
    for stream in log_streams(nats, node).await? {
        let mut runs: std::collections::HashMap<String, crate::core::timeline::Versions> =
            std::collections::HashMap::new();
        read_from(nats, &stream, 1, None, since, node, |b, written_ms| {
            let run = runs.entry(b.run).or_default();
            for e in &b.timeline {
                run.follow(e);
            }
            if written_ms >= since_ms {
                for r in &b.records {
                    given += 1;
                    each(r, run);
                }
            }
        })
        .await?;
    }
    Ok(given)
}

/// Every record written since `since_ms` (`node`: one node's only), given to `each` in the
/// order each node wrote them; nothing is held. How many records were given.
pub async fn each(
    nats: &async_nats::Client,
    since_ms: u64,
    node: Option<&str>,
    each: impl FnMut(&Record),
) -> StoreResult<u64> {
    each_in(nats, log_streams(nats, node).await?, since_ms, node, each).await
}

/// `each` on `node`'s own stream only (what a node may read of the log: the shared stream of
/// earlier oam is not its to open).
pub(crate) async fn each_own(
    nats: &async_nats::Client,
    node: &str,
    since_ms: u64,
    each: impl FnMut(&Record),
) -> StoreResult<u64> {
    let name = subjects::decision_log_stream(node);
    let stream = tokio::time::timeout(OPEN_TIMEOUT, super::context(nats).get_stream(&name))
        .await
        .map_err(|_| no_answer())?
        .map_err(|e| StoreError::Failed(format!("cannot read the decision log ({name}): {e}")))?;
    each_in(nats, vec![stream], since_ms, Some(node), each).await
}

/// `each` over `streams`.
async fn each_in(
    nats: &async_nats::Client,
    streams: Vec<jetstream::stream::Stream>,
    since_ms: u64,
    node: Option<&str>,
    mut each: impl FnMut(&Record),
) -> StoreResult<u64> {
    let start = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(since_ms) * 1_000_000)
        .map_err(|e| StoreError::Unreadable(format!("start time: {e}")))?;
    let filter = node.map_or_else(
        || subjects::DECISION_LOG_ALL.to_string(),
        subjects::decision_log,
    );
    let mut given = 0;
    for stream in streams {
        let from = super::first_at(nats, &stream, &filter, start).await?;
        read_from(nats, &stream, from, None, start, node, |b, _| {
            for r in &b.records {
                given += 1;
                each(r);
            }
        })
        .await?;
    }
    Ok(given)
}

/// The state timeline of `node`'s run `run`, every entry the log holds, in order (versions
/// missing from it are the log's gaps: `timeline::StateAt::then` says so).
pub async fn timeline(
    nats: &async_nats::Client,
    node: &str,
    run: &str,
) -> StoreResult<Vec<StateVersion>> {
    let mut out = Vec::new();
    let since = time::OffsetDateTime::UNIX_EPOCH;
    for stream in log_streams(nats, Some(node)).await? {
        read_from(nats, &stream, 1, None, since, Some(node), |b, _| {
            if b.run == run {
                out.extend(b.timeline);
            }
        })
        .await?;
    }
    Ok(out)
}

/// Read batches from sequence `from` (up to sequence `until`, if given), by direct get in
/// batches (`store::read_on`: no consumer, a viewer may create none), believing each only from
/// its node's subject, skipping those written before `since`, each given to `each` with when it
/// was written (ms since the epoch); whether one written before `since` was met.
async fn read_from(
    nats: &async_nats::Client,
    stream: &async_nats::jetstream::stream::Stream,
    from: u64,
    until: Option<u64>,
    since: time::OffsetDateTime,
    node: Option<&str>,
    mut each: impl FnMut(Batch, u64),
) -> StoreResult<bool> {
    let filter = node.map_or_else(
        || subjects::DECISION_LOG_ALL.to_string(),
        subjects::decision_log,
    );
    let read = std::sync::atomic::AtomicUsize::new(0);
    let mut before_since = false;
    let name = &stream.cached_info().config.name;
    let mut on_message = |m: async_nats::jetstream::message::StreamMessage| {
        if until.is_some_and(|u| m.sequence > u) {
            return false;
        }
        if m.time < since {
            before_since = true;
            return true;
        }
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
                read.fetch_add(b.records.len(), std::sync::atomic::Ordering::Relaxed);
                let ms = u64::try_from(m.time.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
                each(b, ms);
            }
            Err(e) => {
                tracing::warn!("a decision log message is not a batch of records: {e}");
            }
        }
        until.is_none_or(|u| m.sequence < u)
    };
    // A stream electing a leader (a mesh just restarted) answers 503 for a moment: asked again
    // until it answers, while nothing was read yet.
    let deadline = tokio::time::Instant::now() + OPEN_TIMEOUT;
    loop {
        match super::read_on(nats, name, &filter, from, &mut on_message).await {
            Err(e)
                if read.load(std::sync::atomic::Ordering::Relaxed) == 0
                    && passing(&format!("{e:#}"))
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => {
                return Err(StoreError::Silent(format!(
                    "the decision log stopped answering after {} records: {e}",
                    read.load(std::sync::atomic::Ordering::Relaxed)
                )));
            }
            Ok(_) => break,
        }
    }
    Ok(before_since)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::pipeline::tests::{engine, recorded};

    #[test]
    fn only_a_passing_unavailability_is_asked_again() {
        assert!(passing(
            "request failed: JetStream system temporarily unavailable (code 503, error code 10008)"
        ));
        assert!(passing("no responders"));
        assert!(!passing("stream not found (code 404, error code 10059)"));
        assert!(!passing("permissions violation"));
    }

    #[test]
    fn a_missing_record_is_explained_by_what_bounds_the_log() {
        const H: u64 = 3_600_000;
        let now = 100 * 24 * H;
        let span = |back_ms: u64, bytes: u64| LogSpan {
            first_ms: Some(now - back_ms),
            bytes,
            max_bytes: 256 << 20,
            max_age: Duration::from_secs(7 * 24 * 3600),
        };
        let none = LogSpan {
            first_ms: None,
            ..span(0, 0)
        };
        assert!(none.why_missing(H, now).contains("no records"));
        // The log goes back further than was searched: search further.
        let why = span(5 * H, 1 << 20).why_missing(H, now);
        assert!(why.contains("try --since 5h"), "{why}");
        // Searched all of it, and it is full long before its age limit: sized out.
        let why = span(2 * H, 250 << 20).why_missing(7 * 24 * H, now);
        assert!(
            why.contains("size limit (256 MiB") && why.contains("2h"),
            "{why}"
        );
        // Searched all of it, young and not full: the id was never decided here.
        let why = span(2 * H, 10 << 20).why_missing(7 * 24 * H, now);
        assert!(why.contains("every record since it began 2h ago"), "{why}");
        // Searched all of it, and it goes back its whole age: aged out.
        let why = span(7 * 24 * H, 10 << 20).why_missing(8 * 24 * H, now);
        assert!(why.contains("age limit (168 h"), "{why}");
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
        let mut receivers: Vec<tokio::sync::oneshot::Receiver<bool>> = Vec::new();
        for (i, size) in sizes.iter().enumerate() {
            let (tx, rx) = tokio::sync::oneshot::channel();
            receivers.push(rx);
            waiting.push((recorded(&mut e, &format!("r{i}"), *size), Some(tx)));
        }
        let lost = AtomicU64::new(0);
        let out = batches(&batch_head("n1", "run1", &config), waiting, &lost);
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
