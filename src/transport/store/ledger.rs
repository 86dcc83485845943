//! The budget ledger (`core::ledger`) as it is kept: the JetStream KV bucket `oam-budgets`, one
//! record per budget under `global`, `agent.{name}`, `team.{name}` and `task.{name}`, and one per
//! UTC day of what health probes
//! cost under `probes.{YYYY-MM-DD}`. Nodes reserve and settle against it in
//! batches (`node::ledger`); operators and bench scenarios read and change one record at a time.

use super::{StoreError, StoreResult};
use crate::core::budget::{Kind, Owner};
use crate::core::ledger::Ledger;
use crate::transport::subjects::BUDGETS_BUCKET;
use async_nats::jetstream::kv;
use std::time::Duration;

/// Open the ledger's bucket, creating it on first use (records never expire).
pub async fn open(nats: &async_nats::Client) -> StoreResult<kv::Store> {
    super::bucket(nats, BUDGETS_BUCKET, Duration::ZERO).await
}

/// How long one ledger round trip may take before the ledger counts as unreachable.
pub(crate) const STORE_TIMEOUT: Duration = Duration::from_millis(750);
/// Compare-and-swap attempts per key and batch before the batch counts as failed.
pub(crate) const CAS_TRIES: usize = 32;

/// The key of `owner`'s budget.
pub fn key(owner: &Owner) -> String {
    match owner.kind {
        Kind::Global => "global".into(),
        k => format!("{}.{}", k.as_str(), super::token(&owner.name)),
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

/// Change `owner`'s budget with `f`, by compare-and-swap retried on conflict; `create` makes it
/// when there is none. The record as written.
pub async fn change(
    store: &kv::Store,
    owner: &Owner,
    create: bool,
    f: impl Fn(&mut Ledger),
) -> std::result::Result<Ledger, ChangeError> {
    let k = key(owner);
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
            ledger.set_owner(owner);
        }
        f(&mut ledger);
        // A human changed the budget: the exhaustion episode (and its one escalation) ends, and
        // the next one is named from now.
        ledger.refused = None;
        ledger.since_ms = Some(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        );
        let bytes = serde_json::to_vec(&ledger).map_err(|e| ChangeError::Store(e.to_string()))?;
        // Err(None): another write came first; Err(Some((why, refused))): the store did not
        // take it, `refused` when it could never (a bad key); otherwise no leader answered
        // (a timeout, no stream found, no responders: what a minority of servers says).
        let written = match revision {
            Some(r) => store.update(&k, bytes.into(), r).await.map_err(|e| {
                (e.kind() != kv::UpdateErrorKind::WrongLastRevision)
                    .then(|| (e.to_string(), e.kind() == kv::UpdateErrorKind::InvalidKey))
            }),
            None => store.create(&k, bytes.into()).await.map_err(|e| {
                (e.kind() != kv::CreateErrorKind::AlreadyExists)
                    .then(|| (e.to_string(), e.kind() == kv::CreateErrorKind::InvalidKey))
            }),
        };
        match written {
            Ok(_) => return Ok(ledger),
            Err(None) => {}
            Err(Some((why, true))) => {
                return Err(ChangeError::Store(format!("the write was refused ({why})")));
            }
            Err(Some((why, false))) => {
                return Err(ChangeError::Store(format!(
                    "the write was not acknowledged ({why}); the budget store takes writes only \
                     while a majority of its NATS servers is up and reachable"
                )));
            }
        }
    }
    Err(ChangeError::Store(format!(
        "{CAS_TRIES} conflicting writes in a row; try again"
    )))
}

/// The record of `owner`'s budget, if there is one.
pub async fn read(store: &kv::Store, owner: &Owner) -> StoreResult<Option<Ledger>> {
    let k = key(owner);
    match store.get(&k).await? {
        Some(bytes) => Ok(Some(serde_json::from_slice(&bytes).map_err(|e| {
            StoreError::Unreadable(format!("{k} is not a budget record: {e}"))
        })?)),
        None => Ok(None),
    }
}

/// The key prefix of the probe budget's days.
pub(crate) const PROBES_PREFIX: &str = "probes.";

/// Every record of the ledger, read one key at a time.
#[derive(Default)]
pub(crate) struct Records {
    /// Budget records by key (`global`, `agent.{name}`, ...).
    pub budgets: std::collections::BTreeMap<String, Ledger>,
    /// What health probes cost, by UTC day (`node::health`): no one's budget.
    pub probe_days: Vec<(String, Ledger)>,
    /// Keys whose record does not parse, and why.
    pub unreadable: Vec<(String, String)>,
}

/// Read every record of the ledger, each within `each_within` (and its key list too).
pub(crate) async fn read_all(store: &kv::Store, each_within: Duration) -> StoreResult<Records> {
    let keys = tokio::time::timeout(each_within, super::keys(store))
        .await
        .map_err(|_| StoreError::Silent("no answer listing the ledger's keys".into()))??;
    let mut out = Records::default();
    for k in keys {
        let Some(bytes) = tokio::time::timeout(each_within, store.get(&k))
            .await
            .map_err(|_| StoreError::Silent(format!("no answer reading {k}")))??
        else {
            continue;
        };
        match (
            serde_json::from_slice::<Ledger>(&bytes),
            k.strip_prefix(PROBES_PREFIX),
        ) {
            (Ok(l), Some(day)) => out.probe_days.push((day.to_string(), l)),
            (Ok(l), None) => {
                out.budgets.insert(k, l);
            }
            (Err(e), _) => out.unreadable.push((k, e.to_string())),
        }
    }
    Ok(out)
}

/// The UTC day of `now_ms`, as the probe budget's key names it (`2026-12-02`).
pub fn probes_day(now_ms: u64) -> String {
    crate::core::date::utc_date(now_ms / 1_000)
}

/// Add `usd` to what health probes cost on `day` unless that passes `cap` (the record's limit
/// becomes the cap given; without one it stays as it was): whether it was added. By
/// compare-and-swap, retried on conflict.
pub(crate) async fn charge_probes(
    store: &kv::Store,
    day: &str,
    usd: f64,
    cap: Option<f64>,
) -> StoreResult<bool> {
    let k = format!("{PROBES_PREFIX}{day}");
    for _ in 0..CAS_TRIES {
        let entry = store.entry(&k).await?;
        let (mut ledger, revision) = match entry {
            Some(e) if e.operation == kv::Operation::Put => (
                serde_json::from_slice::<Ledger>(&e.value)?,
                Some(e.revision),
            ),
            Some(e) => (Ledger::default(), Some(e.revision)),
            None => (Ledger::default(), None),
        };
        if let Some(cap) = cap {
            ledger.limit_usd = cap;
            if usd > 0.0 && ledger.spent_usd + usd > cap + 1e-9 {
                return Ok(false);
            }
        }
        ledger.spent_usd = crate::core::request::round_usd((ledger.spent_usd + usd).max(0.0));
        let bytes = serde_json::to_vec(&ledger)?;
        let written = match revision {
            Some(r) => store
                .update(&k, bytes.into(), r)
                .await
                .map(|_| ())
                .map_err(|e| {
                    (e.kind() != kv::UpdateErrorKind::WrongLastRevision).then(|| e.to_string())
                }),
            None => store
                .create(&k, bytes.into())
                .await
                .map(|_| ())
                .map_err(|e| {
                    (e.kind() != kv::CreateErrorKind::AlreadyExists).then(|| e.to_string())
                }),
        };
        match written {
            Ok(()) => return Ok(true),
            Err(None) => {}
            Err(Some(e)) => {
                return Err(StoreError::Failed(format!(
                    "the probe budget's write was not taken: {e}"
                )));
            }
        }
    }
    Err(StoreError::Contended(format!(
        "{CAS_TRIES} conflicting writes in a row to {k}"
    )))
}

/// Apply `holes` (recorded charges the budget record `k` lacks, in order) to it by
/// compare-and-swap, each settlement number once (one the record has, or a later one of its
/// holder, is skipped) at `now_ms`: which of them were applied (their places in `holes`), and
/// the record as written when any was.
pub(crate) async fn settle_holes(
    store: &kv::Store,
    k: &str,
    holes: &[crate::core::books::Hole],
    now_ms: u64,
) -> StoreResult<(Vec<usize>, Option<(u64, Ledger)>)> {
    for _ in 0..CAS_TRIES {
        let entry = tokio::time::timeout(STORE_TIMEOUT, store.entry(k))
            .await
            .map_err(|_| StoreError::Silent(format!("no answer reading {k}")))??
            .ok_or_else(|| StoreError::Failed(format!("{k} is gone")))?;
        if entry.operation != kv::Operation::Put {
            return Err(StoreError::Failed(format!("{k} was removed")));
        }
        let mut ledger: Ledger = serde_json::from_slice(&entry.value)?;
        let applied: Vec<usize> = (0..holes.len())
            .filter(|&i| {
                let h = &holes[i];
                ledger.settle_once(&h.holder, h.seq, 0.0, h.usd, now_ms)
            })
            .collect();
        if applied.is_empty() {
            return Ok((applied, None));
        }
        let bytes: bytes::Bytes = serde_json::to_vec(&ledger)?.into();
        match tokio::time::timeout(STORE_TIMEOUT, store.update(k, bytes, entry.revision)).await {
            Ok(Ok(revision)) => return Ok((applied, Some((revision, ledger)))),
            Ok(Err(e)) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok(Err(e)) => return Err(StoreError::Failed(format!("{k} not written: {e}"))),
            Err(_) => return Err(StoreError::Silent(format!("no answer writing {k}"))),
        }
    }
    Err(StoreError::Contended(format!(
        "{CAS_TRIES} conflicting writes in a row on {k}"
    )))
}

#[cfg(test)]
mod tests {
    use super::key;
    use crate::core::budget::{Kind, Owner};

    #[test]
    fn keys_name_the_budget_and_stay_one_subject_token() {
        assert_eq!(key(&Owner::global()), "global");
        assert_eq!(key(&Owner::agent("planner")), "agent.planner");
        assert_eq!(key(&Owner::new(Kind::Team, "support")), "team.support");
        assert_eq!(key(&Owner::new(Kind::Task, "t1")), "task.t1");
        let odd = key(&Owner::agent("a.b c"));
        assert!(odd.starts_with("agent.h-"), "{odd}");
        assert_eq!(odd.matches('.').count(), 1, "{odd}");
        assert_ne!(key(&Owner::agent("a.b")), key(&Owner::agent("a_b")));
        assert_ne!(key(&Owner::agent("x")), key(&Owner::new(Kind::Team, "x")));
    }

    #[test]
    fn a_probe_day_is_the_utc_date() {
        assert_eq!(super::probes_day(0), "1970-01-01");
        // 2026-12-02T23:59:59.999Z and a millisecond later.
        assert_eq!(super::probes_day(1_796_255_999_999), "2026-12-02");
        assert_eq!(super::probes_day(1_796_256_000_000), "2026-12-03");
        assert_eq!(super::probes_day(951_782_400_000), "2000-02-29");
    }
}
