//! The budget ledger (`core::ledger`) as it is kept: the JetStream KV bucket `oam-budgets`, one
//! record per budget under `global` and `agent.{name}`. Nodes reserve and settle against it in
//! batches (`node::ledger`); operators and bench scenarios read and change one record at a time.

use crate::core::ledger::Ledger;
use crate::transport::subjects::BUDGETS_BUCKET;
use async_nats::jetstream::kv;
use std::time::Duration;

/// Open the ledger's bucket, creating it on first use (records never expire).
pub async fn open(nats: &async_nats::Client) -> anyhow::Result<kv::Store> {
    super::bucket(nats, BUDGETS_BUCKET, Duration::ZERO).await
}

/// How long one ledger round trip may take before the ledger counts as unreachable.
pub const STORE_TIMEOUT: Duration = Duration::from_millis(750);
/// Compare-and-swap attempts per key and batch before the batch counts as failed.
pub const CAS_TRIES: usize = 32;

/// The key of the global budget (`None`) or of `agent`'s.
pub fn key(agent: Option<&str>) -> String {
    match agent {
        None => "global".into(),
        Some(a) => format!("agent.{}", super::token(a)),
    }
}

/// Why an operator's change to a budget record was not made.
#[derive(Debug)]
pub enum ChangeError {
    /// There is no such budget, and the change makes none.
    Missing,
    /// The record is not a budget (its parse error).
    Unreadable(String),
    /// The store failed or did not take the write.
    Store(String),
}

/// Change the budget of `agent` (`None`: the global one) with `f`, by compare-and-swap retried
/// on conflict; `create` makes it when there is none. The record as written.
pub async fn change(
    store: &kv::Store,
    agent: Option<&str>,
    create: bool,
    f: impl Fn(&mut Ledger),
) -> Result<Ledger, ChangeError> {
    let k = key(agent);
    for _ in 0..CAS_TRIES {
        let entry = store
            .entry(&k)
            .await
            .map_err(|e| ChangeError::Store(e.to_string()))?;
        let (mut ledger, revision) = match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                let l: Ledger = serde_json::from_slice(&e.value)
                    .map_err(|err| ChangeError::Unreadable(err.to_string()))?;
                (l, Some(e.revision))
            }
            Some(e) => (Ledger::default(), Some(e.revision)),
            None => (Ledger::default(), None),
        };
        if revision.is_none() || ledger == Ledger::default() {
            if !create {
                return Err(ChangeError::Missing);
            }
            ledger.agent = agent.map(String::from);
        }
        f(&mut ledger);
        // A human changed the budget: the exhaustion episode (and its one escalation) ends.
        ledger.refused = None;
        let bytes = serde_json::to_vec(&ledger).map_err(|e| ChangeError::Store(e.to_string()))?;
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
            Ok(_) => return Ok(ledger),
            Err(true) => {}
            Err(false) => return Err(ChangeError::Store("the write was not taken".into())),
        }
    }
    Err(ChangeError::Store(format!(
        "{CAS_TRIES} conflicting writes in a row; try again"
    )))
}

/// The budget record of `agent` (`None`: the global one), if there is one.
pub async fn read(store: &kv::Store, agent: Option<&str>) -> anyhow::Result<Option<Ledger>> {
    let k = key(agent);
    match store.get(&k).await? {
        Some(bytes) => {
            Ok(Some(serde_json::from_slice(&bytes).map_err(|e| {
                anyhow::anyhow!("{k} is not a budget record: {e}")
            })?))
        }
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::key;

    #[test]
    fn keys_name_the_budget_and_stay_one_subject_token() {
        assert_eq!(key(None), "global");
        assert_eq!(key(Some("planner")), "agent.planner");
        let odd = key(Some("a.b c"));
        assert!(odd.starts_with("agent.h-"), "{odd}");
        assert_eq!(odd.matches('.').count(), 1, "{odd}");
        assert_ne!(key(Some("a.b")), key(Some("a_b")));
    }
}
