//! Loop-episode claims as they are kept: the KV bucket `oam-loop-episodes`, one record per
//! episode (by fingerprint) naming the node that raised its incident, so two nodes that open
//! one at the same moment raise it once (`node::loops`).

use super::StoreResult;
use crate::transport::subjects::LOOP_EPISODES_BUCKET;
use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How long claiming may take before the incident is raised anyway (better twice than never).
pub(crate) const CLAIM_TIMEOUT: Duration = Duration::from_millis(750);

/// Open the claims' bucket, creating it on first use.
pub async fn open(nats: &async_nats::Client) -> StoreResult<kv::Store> {
    super::bucket(nats, LOOP_EPISODES_BUCKET, super::LOOP_EPISODES_AGE).await
}

/// Free episode `key`'s claim (the episode ended); a bucket that does not answer keeps it
/// until it expires.
pub async fn release(store: &kv::Store, key: &str) {
    let _ = tokio::time::timeout(CLAIM_TIMEOUT, store.delete(key)).await;
}

/// Who raised an episode's incident, and until when the episode stands.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct Claim {
    pub incident: String,
    pub node: String,
    pub until_ms: u64,
}

/// Claim episode `key` (its fingerprint) with `claim` at `now`: `Some(true)` won, `Some(false)`
/// another node holds a claim that stands, `None` the bucket did not answer.
pub async fn claim(store: &kv::Store, key: &str, claim: &Claim, now: u64) -> Option<bool> {
    let bytes: bytes::Bytes = serde_json::to_vec(claim).ok()?.into();
    for _ in 0..8 {
        let entry = tokio::time::timeout(CLAIM_TIMEOUT, store.entry(key))
            .await
            .ok()?
            .ok()?;
        let written = match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                let standing =
                    serde_json::from_slice::<Claim>(&e.value).is_ok_and(|c| c.until_ms > now);
                if standing {
                    return Some(false);
                }
                tokio::time::timeout(CLAIM_TIMEOUT, store.update(key, bytes.clone(), e.revision))
                    .await
                    .ok()?
                    .map(|_| ())
                    .map_err(|e| e.kind() == kv::UpdateErrorKind::WrongLastRevision)
            }
            _ => tokio::time::timeout(CLAIM_TIMEOUT, store.create(key, bytes.clone()))
                .await
                .ok()?
                .map(|_| ())
                .map_err(|e| e.kind() == kv::CreateErrorKind::AlreadyExists),
        };
        match written {
            Ok(()) => return Some(true),
            Err(true) => continue, // someone wrote meanwhile: look again
            Err(false) => return None,
        }
    }
    None
}
