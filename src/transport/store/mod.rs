//! Every JetStream store oam keeps: the helpers every KV bucket shares (open one, creating it
//! on first use; list its keys), and one file per store with its records and how each is
//! read, changed and watched: escalations, the budget ledger, rate-limit windows,
//! loop-episode claims and the decision log. The mesh's own buckets are read through `mesh::store`.

pub mod copies;
pub mod decisions;
pub mod escalations;
pub mod ledger;
pub mod loops;
pub mod rates;

use async_nats::jetstream::{self, kv};
use std::time::Duration;

/// Why a store did not do what was asked; each says what it was doing.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No answer in time: a server gone, a stream electing its leader.
    #[error("{0}")]
    Silent(String),
    /// NATS or the server refused or failed it (as it said).
    #[error("{0}")]
    Failed(String),
    /// A record or an answer that is not what it should be.
    #[error("{0}")]
    Unreadable(String),
    /// Writes kept meeting other writers' (try again).
    #[error("{0}")]
    Contended(String),
    /// A store kept in a way oam refuses, or missing; what to do is said.
    #[error("{0}")]
    Unfit(String),
}

/// A store's answer.
pub type StoreResult<T> = std::result::Result<T, StoreError>;

said_as!(
    StoreError::Failed:
    async_nats::SubscribeError,
    async_nats::PublishError,
    kv::EntryError,
    kv::PutError,
    kv::CreateError,
    kv::UpdateError,
    kv::WatchError,
    jetstream::stream::ConsumerError,
    jetstream::consumer::StreamError,
    jetstream::context::RequestError,
    serde_json::Error,
);

/// How long an agent instance's record lives without renewal.
pub const INSTANCE_LEASE: Duration = Duration::from_secs(15);
/// How long an announced death is remembered (so it is announced once).
pub(crate) const TOMBSTONE_AGE: Duration = Duration::from_secs(120);

/// How long a loop episode's claim (`oam-loop-episodes`) outlives its episode at most; the
/// episode's own end frees it sooner.
pub(crate) const LOOP_EPISODES_AGE: Duration = Duration::from_secs(3_600);

/// The agent mesh's buckets and how long an entry lives in each (zero: for good).
pub(crate) const MESH_BUCKETS: [(&str, Duration); 4] = [
    (crate::transport::subjects::CATALOG_BUCKET, Duration::ZERO),
    (crate::transport::subjects::REGISTRY_BUCKET, Duration::ZERO),
    (crate::transport::subjects::INSTANCES_BUCKET, INSTANCE_LEASE),
    (crate::transport::subjects::TOMBSTONES_BUCKET, TOMBSTONE_AGE),
];

/// The keys of `store` that have a message (deleted ones too, until their marker ages out: a
/// `get` then finds nothing), from the stream's subject counts rather than a consumer, so a
/// role that may not create consumers (agents, callers) can list them.
pub async fn keys(store: &kv::Store) -> StoreResult<Vec<String>> {
    keys_matching(store, ">").await
}

/// Messages one direct get asks for at most (the server answers them one after another, then
/// says it is done).
const GET_BATCH: usize = 256;
/// ... and bytes at most: a batch of large messages (decision batches of many records) comes in
/// pieces a loaded reader takes in time, not 64 MB at once (the server's own cap).
const GET_BYTES: usize = 4 << 20;

/// The messages of `stream` on `filter` from sequence `from` on, to the last there is now, each
/// given to `each` (which says whether to go on), read by direct get in batches of `GET_BATCH`
/// (no consumer, so a role that may only read, a viewer, needs none and can leave none behind).
/// The sequence to read from next time.
pub async fn read_on(
    nats: &async_nats::Client,
    stream: &str,
    filter: &str,
    from: u64,
    mut each: impl FnMut(jetstream::message::StreamMessage) -> bool,
) -> StoreResult<u64> {
    use futures_util::StreamExt;
    let inbox = nats.new_inbox();
    let mut answers = nats.subscribe(inbox.clone()).await?;
    let ask = format!("$JS.API.DIRECT.GET.{stream}");
    let stopped = || StoreError::Silent(format!("the stream {stream} stopped answering"));
    let mut next = from.max(1);
    // A stream just restarted, or electing a leader, answers "no responders" for a while:
    // asked again until `API_TIMEOUT` has passed without an answer.
    let mut unanswered_since: Option<tokio::time::Instant> = None;
    loop {
        let question = serde_json::json!({
            "seq": next, "batch": GET_BATCH, "max_bytes": GET_BYTES, "next_by_subj": filter,
        });
        nats.publish_with_reply(ask.clone(), inbox.clone(), question.to_string().into())
            .await?;
        let mut got = 0;
        let mut again = false;
        // What the server says is left on the filter after this batch (its end-of-batch
        // message carries it): a batch may end short of `GET_BATCH` when its bytes reach the
        // server's cap, which is no end of the stream.
        let mut pending: Option<u64> = None;
        loop {
            let m = tokio::time::timeout(API_TIMEOUT, answers.next())
                .await
                .map_err(|_| stopped())?
                .ok_or_else(stopped)?;
            match m.status.map(|s| s.as_u16()) {
                // The end of this batch; none at all past the last.
                Some(204) => {
                    pending = m
                        .headers
                        .as_ref()
                        .and_then(|h| h.get("Nats-Num-Pending"))
                        .and_then(|v| v.as_str().parse().ok());
                    break;
                }
                Some(404) => return Ok(next),
                Some(503) if got == 0 => {
                    let since = *unanswered_since.get_or_insert_with(tokio::time::Instant::now);
                    if since.elapsed() >= API_TIMEOUT {
                        return Err(StoreError::Silent(format!(
                            "cannot read {stream}: no replica answered for {} s (503)",
                            API_TIMEOUT.as_secs()
                        )));
                    }
                    again = true;
                    break;
                }
                Some(code) => {
                    return Err(StoreError::Failed(format!(
                        "cannot read {stream}: {code} {}",
                        m.description.as_deref().unwrap_or("")
                    )));
                }
                None => {}
            }
            let header = |name: &str| {
                let h = m.headers.as_ref()?.get(name)?;
                Some(h.as_str().to_string())
            };
            let (Some(seq), Some(at), Some(subject)) = (
                header("Nats-Sequence").and_then(|s| s.parse::<u64>().ok()),
                header("Nats-Time-Stamp")
                    .and_then(|t| async_nats::datetime::parse_rfc3339(&t).ok()),
                header("Nats-Subject"),
            ) else {
                return Err(StoreError::Unreadable(format!(
                    "cannot read {stream}: a direct get answer without its headers"
                )));
            };
            next = seq + 1;
            got += 1;
            let message = jetstream::message::StreamMessage {
                subject: subject.into(),
                sequence: seq,
                headers: m.headers.unwrap_or_default(),
                payload: m.payload,
                time: at,
            };
            if !each(message) {
                return Ok(next);
            }
        }
        if again {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        unanswered_since = None;
        let more = match pending {
            Some(left) => left > 0 && got > 0,
            None => got >= GET_BATCH,
        };
        if !more {
            return Ok(next);
        }
    }
}

/// The first sequence of `stream` on `filter` stored at `at` or later (binary search by direct
/// get, as `read_on`), or one past the last when none is.
pub(crate) async fn first_at(
    nats: &async_nats::Client,
    stream: &jetstream::stream::Stream,
    filter: &str,
    at: time::OffsetDateTime,
) -> StoreResult<u64> {
    let info = tokio::time::timeout(API_TIMEOUT, stream.get_info())
        .await
        .map_err(|_| {
            StoreError::Silent(format!(
                "the stream {} stopped answering",
                stream_name(stream)
            ))
        })?
        .map_err(|e| StoreError::Failed(format!("cannot read {}: {e}", stream_name(stream))))?;
    let (mut lo, mut hi) = (
        info.state.first_sequence.max(1),
        info.state.last_sequence + 1,
    );
    // Invariant: every message before `lo` is older than `at`; `hi` is at or after it (or the end).
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let mut found = None;
        read_on(nats, stream_name(stream), filter, mid, |m| {
            found = Some((m.sequence, m.time));
            false
        })
        .await?;
        match found {
            Some((seq, time)) if time < at => lo = seq + 1,
            Some(_) | None => hi = mid,
        }
    }
    Ok(lo)
}

fn stream_name(stream: &jetstream::stream::Stream) -> &str {
    &stream.cached_info().config.name
}

/// One change of a bucket's key, as `watch` reads it.
pub struct Change {
    pub key: String,
    pub revision: u64,
    pub operation: kv::Operation,
    pub value: bytes::Bytes,
}

/// How long one pull of a watch lasts (see `watch`).
const WATCH_PULL: Duration = Duration::from_secs(2);

/// Every key's last record of `store`, then every change, as they come; the stream ends when
/// the consumer behind it breaks (the bus gone), and the caller watches again.
///
/// Read by an ordered pull consumer, never the bucket's push watch (nor `kv::Store::keys`,
/// which is one too): a push consumer's client answers a flow-control status message by
/// publishing an empty body to whatever reply subject it names, with the reader's rights. When
/// agents could publish into a node's inbox, one emptied budget records, rate-limit windows and
/// escalations that way; nobody but the server may publish there now, and a pull consumer's
/// client answers nothing it is sent in any case.
pub async fn watch(
    store: &kv::Store,
) -> StoreResult<impl futures_util::Stream<Item = Change> + use<>> {
    use futures_util::StreamExt;
    let config = jetstream::consumer::pull::OrderedConfig {
        filter_subject: format!("{}>", store.prefix),
        deliver_policy: jetstream::consumer::DeliverPolicy::LastPerSubject,
        // Each pull lasts `WATCH_PULL` with an idle heartbeat every half of it, and two missed
        // heartbeats make the client make the consumer again: a consumer lost with a server
        // that restarted (or a stream leader that moved) is replaced within about `WATCH_PULL`.
        // With the client's defaults (30 s pulls, 15 s heartbeats) a restart left the watch,
        // and the budgets it mirrors, stale for up to 30 s.
        max_expires: WATCH_PULL,
        ..Default::default()
    };
    let messages = store
        .stream
        .create_consumer(config)
        .await?
        .messages()
        .await?;
    let prefix = store.prefix.clone();
    Ok(messages
        .take_while(|m| std::future::ready(m.is_ok()))
        .filter_map(move |m| std::future::ready(m.ok().and_then(|m| change_of(&prefix, &m)))))
}

/// A message of a bucket's stream as the change of its key (`None`: not one of the bucket's).
fn change_of(prefix: &str, m: &jetstream::Message) -> Option<Change> {
    let key = m.subject.strip_prefix(prefix)?.to_string();
    let revision = m.info().ok()?.stream_sequence;
    let operation = operation_of(m.headers.as_ref());
    Some(Change {
        key,
        revision,
        operation,
        value: m.payload.clone(),
    })
}

/// The operation a delete or purge marker says in its header; a record has none.
fn operation_of(headers: Option<&async_nats::HeaderMap>) -> kv::Operation {
    match headers.and_then(|h| h.get("KV-Operation")) {
        Some(op) if op.as_str() == "DEL" => kv::Operation::Delete,
        Some(op) if op.as_str() == "PURGE" => kv::Operation::Purge,
        _ => kv::Operation::Put,
    }
}

/// The changes of `store` from revision `from` on, as they are now (each key's last, for a
/// bucket that keeps one per key), read by direct get (`read_on`: no consumer), and the
/// revision to read from next time.
pub(crate) async fn changes_since(
    nats: &async_nats::Client,
    store: &kv::Store,
    from: u64,
) -> StoreResult<(Vec<Change>, u64)> {
    let mut out = Vec::new();
    let prefix = &store.prefix;
    let stream = &store.stream_name;
    let next = read_on(nats, stream, &format!("{prefix}>"), from, |m| {
        if let Some(key) = m.subject.strip_prefix(prefix.as_str()) {
            out.push(Change {
                key: key.to_string(),
                revision: m.sequence,
                operation: operation_of(Some(&m.headers)),
                value: m.payload,
            });
        }
        true
    })
    .await?;
    Ok((out, next))
}

/// The keys of `store` that match `pattern` (a subject pattern: `*` one token, `>` the rest),
/// as `keys` lists them: the server filters, so a few keys of a large bucket cost a few.
pub(crate) async fn keys_matching(store: &kv::Store, pattern: &str) -> StoreResult<Vec<String>> {
    use futures_util::TryStreamExt;
    let prefix = format!("$KV.{}.", store.name);
    let subjects: Vec<(String, usize)> = store
        .stream
        .info_with_subjects(format!("{prefix}{pattern}"))
        .await?
        .try_collect()
        .await?;
    let mut keys: Vec<String> = subjects
        .into_iter()
        .filter_map(|(s, _)| s.strip_prefix(&prefix).map(String::from))
        .collect();
    keys.sort();
    Ok(keys)
}

/// A KV key token for a name anyone may choose (an agent, an escalation id carrying a request
/// id): a short plain name as it is; anything else (and a name that itself starts `h-`)
/// hex-encoded behind `h-`, long ones shortened to their first 100 bytes and a hash of the
/// whole, so two names never share a token.
pub fn token(id: &str) -> String {
    let plain = !id.is_empty()
        && id.len() <= 200
        && !id.starts_with("h-")
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if plain {
        return id.to_string();
    }
    let hex = |bytes: &[u8]| -> String { bytes.iter().map(|b| format!("{b:02x}")).collect() };
    if id.len() <= 100 {
        return format!("h-{}", hex(id.as_bytes()));
    }
    // FNV-1a, 64 bits.
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("h-{}-{hash:016x}", hex(&id.as_bytes()[..100]))
}

/// How long any JetStream request may wait for its answer. async-nats gives them no bound of
/// their own, and oam's connections set none (callers bound their own requests): a request
/// lost with a server that died would be waited for without end.
pub(crate) const API_TIMEOUT: Duration = Duration::from_secs(5);

/// The JetStream context every store of oam's is opened with: each request bounded by
/// `API_TIMEOUT` (the buckets and streams opened from it inherit it).
pub fn context(nats: &async_nats::Client) -> jetstream::Context {
    jetstream::ContextBuilder::new()
        .timeout(API_TIMEOUT)
        .build(nats.clone())
}

/// How long opening or creating a bucket may take: a server that does not answer (or a role
/// the server does not let create one, which hears nothing back) is an error, not a hang.
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);

/// How many servers the cluster `nats` is connected to has (1: a server on its own), as the
/// server tells its clients.
pub fn cluster_size(nats: &async_nats::Client) -> usize {
    nats.server_info().connect_urls.len().max(1)
}

/// How many copies every stream and bucket keeps: one per server, at most three. Three keep a
/// majority (every acknowledged write) through the loss of any one server.
pub fn replicas(nats: &async_nats::Client) -> usize {
    cluster_size(nats).min(3)
}

/// Refuse a stream that keeps one copy on a cluster: the loss of the server holding it loses
/// it, and with it what oam promises (a ledger, a log).
pub(crate) fn check_replicas(
    nats: &async_nats::Client,
    config: &jetstream::stream::Config,
) -> StoreResult<()> {
    let servers = cluster_size(nats);
    let stream = &config.name;
    if servers > 1 && config.num_replicas <= 1 {
        return Err(StoreError::Unfit(format!(
            "the stream {stream} keeps 1 copy on a cluster of {servers} servers, so losing one \
             server loses it; give it {} (`nats stream edit {stream} --replicas {}`), or let \
             `oam mesh up` create it",
            replicas(nats),
            replicas(nats)
        )));
    }
    Ok(())
}

/// Open the KV bucket `name`, creating it (history 1, `max_age`, `replicas` copies) if it does
/// not exist; one kept as a single copy on a cluster is refused.
pub async fn bucket(
    nats: &async_nats::Client,
    name: &str,
    max_age: Duration,
) -> StoreResult<kv::Store> {
    let js = context(nats);
    if let Ok(Ok(store)) = tokio::time::timeout(OPEN_TIMEOUT, js.get_key_value(name)).await {
        check_replicas(nats, &store.stream.cached_info().config)?;
        return Ok(store);
    }
    let config = kv::Config {
        bucket: name.to_string(),
        history: 1,
        max_age,
        num_replicas: replicas(nats),
        ..Default::default()
    };
    let created = match tokio::time::timeout(OPEN_TIMEOUT, js.create_key_value(config)).await {
        Ok(Ok(store)) => return Ok(store),
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no answer within {} s", OPEN_TIMEOUT.as_secs()),
    };
    // Another process may have created it meanwhile.
    match tokio::time::timeout(OPEN_TIMEOUT, js.get_key_value(name)).await {
        Ok(Ok(store)) => Ok(store),
        _ => Err(StoreError::Unfit(format!(
            "the KV bucket {name} is missing and could not be created ({created}); only the \
             admin may create one: `oam mesh up --dir DIR` puts back every bucket of a mesh, \
             running or not"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::token;

    #[test]
    fn tokens_are_kv_tokens_and_distinct() {
        assert_eq!(token("esc-r1"), "esc-r1");
        assert_eq!(token("esc-a.b"), "h-6573632d612e62");
        assert_eq!(token("esc-a b"), "h-6573632d612062");
        assert_ne!(token("esc-a.b"), token("esc-a b"));
        assert_ne!(
            token("h-6573632d612e62"),
            token("esc-a.b"),
            "a name like a token is encoded"
        );
        let long = format!("esc-{}", "x".repeat(300));
        let other = format!("esc-{}y", "x".repeat(299));
        assert!(token(&long).starts_with("h-") && token(&long).len() < 240);
        assert_ne!(token(&long), token(&other));
    }
}
