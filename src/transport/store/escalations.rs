//! Open escalations: every escalation a node raises is recorded in the JetStream KV bucket
//! `oam-escalations` as open, and stays open until someone resolves it (`oam escalation
//! resolve`). `oam watch` and `oam escalation list` read the bucket, so a view started later
//! still sees what waits for a human. Records expire after [`MAX_AGE`].

use super::{StoreError, StoreResult};
use crate::core::escalation::Escalation;
use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};
use std::time::Duration;

pub(crate) const BUCKET: &str = "oam-escalations";
/// Open or resolved, a record is gone after this long.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(24 * 3600);

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Open,
    Resolved,
}

/// One escalation and what became of it.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct EscalationRecord {
    pub escalation: Escalation,
    /// The node that raised it.
    pub node: String,
    pub status: Status,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Who said they are on it (still open until resolved), and when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acknowledged_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acknowledged_at_ms: Option<u64>,
    /// How telling a human went (a configured webhook), once it is over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<Delivery>,
    /// How the configured command sink took it, once it is over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_delivery: Option<Delivery>,
}

/// What became of sending an escalation to a sink.
#[derive(Serialize, Deserialize, Clone, PartialEq, Eq, Debug)]
pub struct Delivery {
    /// Where it went (the webhook's URL).
    pub sink: String,
    /// Attempts made.
    pub attempts: u32,
    /// When it was taken (a 2xx), if it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivered_at_ms: Option<u64>,
    /// Why the last attempt failed, if the last one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The bucket key for an escalation id (ids carry request ids, which callers choose).
pub fn key(id: &str) -> String {
    super::token(id)
}

/// Open (or create) the bucket.
pub async fn store(nats: &async_nats::Client) -> StoreResult<kv::Store> {
    crate::transport::store::bucket(nats, BUCKET, MAX_AGE).await
}

/// Record `escalation`, raised by `node`, as open: true; false when a record of its id is there
/// already (another node raised the same episode's escalation first).
pub async fn open(store: &kv::Store, node: &str, escalation: &Escalation) -> StoreResult<bool> {
    let record = EscalationRecord {
        escalation: escalation.clone(),
        node: node.to_string(),
        status: Status::Open,
        resolved_by: None,
        resolved_at_ms: None,
        note: None,
        acknowledged_by: None,
        acknowledged_at_ms: None,
        delivery: None,
        command_delivery: None,
    };
    // Created, never put: a record already there (resolved, say) is never overwritten.
    match store
        .create(key(&escalation.id), serde_json::to_vec(&record)?.into())
        .await
    {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(StoreError::Failed(format!(
            "escalation {} not recorded: {e}",
            escalation.id
        ))),
    }
}

/// Every record in the bucket, oldest first; entries that are not records are skipped (see
/// `all_checked` to hear about them).
pub async fn all(store: &kv::Store) -> StoreResult<Vec<EscalationRecord>> {
    Ok(all_checked(store).await?.0)
}

/// Every record in the bucket, oldest first, and the keys of entries that are not records
/// (corrupt, or written by something else), so a reader can say so instead of hiding them.
pub(crate) async fn all_checked(
    store: &kv::Store,
) -> StoreResult<(Vec<EscalationRecord>, Vec<String>)> {
    let keys = super::keys(store).await?;
    let mut out = Vec::with_capacity(keys.len());
    let mut unreadable = Vec::new();
    for k in keys {
        if let Some(bytes) = store.get(&k).await? {
            match serde_json::from_slice::<EscalationRecord>(&bytes) {
                Ok(r) => out.push(r),
                Err(_) => unreadable.push(k),
            }
        }
    }
    out.sort_by(|a, b| {
        (a.escalation.created_at_ms, &a.escalation.id)
            .cmp(&(b.escalation.created_at_ms, &b.escalation.id))
    });
    Ok((out, unreadable))
}

/// What resolving one escalation did.
#[derive(Debug, PartialEq)]
pub enum Resolved {
    Now(Box<EscalationRecord>),
    Already(Box<EscalationRecord>),
    Unknown,
}

/// What a person says of an escalation.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mark {
    /// Seen, and someone is on it (it stays open).
    Acknowledged,
    /// Seen to.
    Resolved,
}

/// Mark escalation `id` resolved by `by` (compare-and-swap, so two resolvers cannot both win).
pub async fn resolve(
    store: &kv::Store,
    id: &str,
    by: &str,
    note: Option<&str>,
    now_ms: u64,
) -> StoreResult<Resolved> {
    mark(store, id, Mark::Resolved, by, note, now_ms).await
}

/// Mark escalation `id` as `how` by `by` (compare-and-swap); a resolved one, or one already
/// acknowledged when acknowledging, is `Already`.
pub async fn mark(
    store: &kv::Store,
    id: &str,
    how: Mark,
    by: &str,
    note: Option<&str>,
    now_ms: u64,
) -> StoreResult<Resolved> {
    let k = key(id);
    for _ in 0..5 {
        let Some(entry) = store.entry(k.clone()).await? else {
            return Ok(Resolved::Unknown);
        };
        if entry.operation != kv::Operation::Put {
            return Ok(Resolved::Unknown);
        }
        let mut record: EscalationRecord = serde_json::from_slice(&entry.value).map_err(|e| {
            StoreError::Unreadable(format!("the record of {id} is not an escalation: {e}"))
        })?;
        let done = record.status == Status::Resolved
            || (how == Mark::Acknowledged && record.acknowledged_by.is_some());
        if done {
            return Ok(Resolved::Already(Box::new(record)));
        }
        match how {
            Mark::Resolved => {
                record.status = Status::Resolved;
                record.resolved_by = Some(by.to_string());
                record.resolved_at_ms = Some(now_ms);
            }
            Mark::Acknowledged => {
                record.acknowledged_by = Some(by.to_string());
                record.acknowledged_at_ms = Some(now_ms);
            }
        }
        if note.is_some() {
            record.note = note.map(String::from);
        }
        let bytes = serde_json::to_vec(&record)?;
        match store.update(&k, bytes.into(), entry.revision).await {
            Ok(_) => return Ok(Resolved::Now(Box::new(record))),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(StoreError::Contended(format!(
        "{id} kept changing while it was being resolved; try again"
    )))
}

/// EscalationRecord on escalation `id` how its delivery went (whatever else changed in the record
/// meanwhile stays).
/// A sink an escalation is sent to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sink {
    Webhook(String),
    /// A program and its arguments.
    Command(Vec<String>),
}

impl Sink {
    /// How it is named in a delivery record.
    pub fn name(&self) -> String {
        match self {
            Sink::Webhook(url) => url.clone(),
            Sink::Command(argv) => format!("command: {}", argv.join(" ")),
        }
    }
}

/// EscalationRecord how `sink` took escalation `id`.
pub async fn delivered(
    store: &kv::Store,
    id: &str,
    sink: &Sink,
    delivery: Delivery,
) -> StoreResult<()> {
    let k = key(id);
    for _ in 0..5 {
        let Some(entry) = store.entry(k.clone()).await? else {
            return Err(StoreError::Failed(format!("no record of {id}")));
        };
        let mut record: EscalationRecord = serde_json::from_slice(&entry.value).map_err(|e| {
            StoreError::Unreadable(format!("the record of {id} is not an escalation: {e}"))
        })?;
        match sink {
            Sink::Webhook(_) => record.delivery = Some(delivery.clone()),
            Sink::Command(_) => record.command_delivery = Some(delivery.clone()),
        }
        let bytes = serde_json::to_vec(&record)?;
        match store.update(&k, bytes.into(), entry.revision).await {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(StoreError::Contended(format!(
        "{id} kept changing while its delivery was recorded"
    )))
}

/// A loop escalation for tests of the views.
#[cfg(test)]
pub(crate) fn example(
    id: &str,
    agent: &str,
    created_at_ms: u64,
    status: Status,
) -> EscalationRecord {
    use crate::core::reason::{Action, Phase, ReasonCode};
    EscalationRecord {
        escalation: Escalation {
            id: id.to_string(),
            request_id: format!("r-{id}"),
            agent: agent.to_string(),
            task: "refund".into(),
            phase: Phase::Loop,
            reason_codes: vec![
                ReasonCode::AgentLoopDetected,
                ReasonCode::HumanAttentionRequired,
                ReasonCode::EscalatedAgentLoop,
            ],
            recommended_action: Action::HumanReviewBlockAutomaticAction,
            created_at_ms,
            incident_id: None,
            target: None,
            detail: None,
        },
        node: "n1".into(),
        status,
        resolved_by: None,
        resolved_at_ms: None,
        note: None,
        acknowledged_by: None,
        acknowledged_at_ms: None,
        delivery: None,
        command_delivery: None,
    }
}
