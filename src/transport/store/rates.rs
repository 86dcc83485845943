//! Rate-limit windows (`core::rates`) as they are kept: the JetStream KV bucket `oam-rates`,
//! one record per caller and minute (`{caller}.{window}`: what the cluster has granted of
//! it), kept two windows. A node leases from a record by compare-and-swap (`node::rates`).

use super::StoreResult;
use crate::core::rates::{Granted, Limit, WINDOW_MS};
use crate::transport::subjects::RATES_BUCKET;
use async_nats::jetstream::kv;
use std::time::Duration;

/// Open the bucket, creating it on first use (a window's record outlives it by one window).
pub async fn open(nats: &async_nats::Client) -> StoreResult<kv::Store> {
    super::bucket(nats, RATES_BUCKET, Duration::from_millis(2 * WINDOW_MS)).await
}

/// The key of `caller`'s record of `window`.
pub fn key(caller: &str, window: u64) -> String {
    format!("{}.{window}", super::token(caller))
}

/// Compare-and-swap attempts before a lease counts as failed.
const CAS_TRIES: usize = 32;

/// Lease up to `wants` (requests, tokens) of `caller`'s `window` under `limit`, by
/// compare-and-swap retried on conflict: what was granted (never beyond the limit), or why
/// the store did not answer.
pub async fn lease(
    store: &kv::Store,
    caller: &str,
    window: u64,
    limit: &Limit,
    wants: (u64, u64),
) -> std::result::Result<(u64, u64), LeaseError> {
    let k = key(caller, window);
    for _ in 0..CAS_TRIES {
        let entry = store
            .entry(&k)
            .await
            .map_err(|e| LeaseError::Unread(e.to_string()))?;
        let (mut granted, revision) = match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                // A record that does not read is taken as fully granted: never more than the limit.
                let g = serde_json::from_slice::<Granted>(&e.value).unwrap_or(Granted {
                    requests: u64::MAX,
                    tokens: u64::MAX,
                });
                (g, Some(e.revision))
            }
            Some(e) => (Granted::default(), Some(e.revision)),
            None => (Granted::default(), None),
        };
        let got = granted.lease(limit, wants.0, wants.1);
        if got == (0, 0) {
            return Ok(got);
        }
        let bytes = serde_json::to_vec(&granted).map_err(|e| LeaseError::Unread(e.to_string()))?;
        let written = match revision {
            Some(r) => store
                .update(&k, bytes.into(), r)
                .await
                .map_err(|e| e.kind() == kv::UpdateErrorKind::WrongLastRevision),
            None => store
                .create(&k, bytes.into())
                .await
                .map_err(|e| e.kind() == kv::CreateErrorKind::AlreadyExists),
        };
        match written {
            Ok(_) => return Ok(got),
            // Another node wrote first: read again.
            Err(true) => continue,
            Err(false) => return Err(LeaseError::Unwritten(k)),
        }
    }
    Err(LeaseError::Contended(k))
}

/// Why a lease was not granted by the store.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("the store did not answer: {0}")]
    Unread(String),
    #[error("the store did not take the write of {0}")]
    Unwritten(String),
    #[error("{CAS_TRIES} writes of {0} in a row lost to other nodes")]
    Contended(String),
}
