//! What this node's earlier runs answered and did not settle, charged from their records when
//! it starts again.
//!
//! A node settles an attempt's cost off the request's path, in batches written every half
//! second or so: a run killed in between took settlements with it that its answers' records
//! (in the decision log, each naming its settlements, `record::Charge`) still carry. A budget
//! record counts each holder's settlements by number, so the ones it lacks are known
//! (`core::books`) and applied now under the dead run's name, each once (`Ledger::settle_once`:
//! a number applied already is skipped, so doing this twice, or beside a late write of the dead
//! run, charges nothing twice). What the dead run held lapses with its lease as before.
//!
//! Only this node's earlier runs: another node's may still be alive. A run whose answer was
//! released but whose record did not reach the log either cannot be found here (that is the
//! `[decision_log] durable` setting's to prevent).

use super::Node;
use crate::clock::now_ms;
use crate::core::books::{Books, Hole};
use crate::core::ledger::Ledger;
use crate::transport::store::StoreError;
use crate::transport::store::ledger::STORE_TIMEOUT;
use async_nats::jetstream::kv;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

/// The log is read from this long before an earlier run's last settlement in the ledger: its
/// unsettled answers were decided after that, or at most a settling delay before.
const BEFORE_LAST_SETTLED_MS: u64 = 60_000;

/// Tries at charging them: a node started beside a busy or recovering cluster may find the
/// ledger or its log not answering for a while.
const TRIES: u32 = 30;
const BETWEEN_TRIES: Duration = Duration::from_secs(2);

/// Charge what this node's earlier runs answered and the ledger lacks, trying again while the
/// ledger or the log does not answer (at most `TRIES` times, until `stop`); how many
/// settlements were applied (none when there were no earlier runs, or nothing was missing).
pub(crate) async fn earlier_runs(
    node: Arc<Node>,
    stop: tokio_util::sync::CancellationToken,
) -> usize {
    let mut last_error = None;
    for _ in 0..TRIES {
        let opened = tokio::time::timeout(
            STORE_TIMEOUT * 4,
            crate::transport::store::ledger::open(node.bus.nats()),
        )
        .await;
        let tried = match opened {
            Ok(Ok(store)) => settle_earlier(&node, &store).await,
            Ok(Err(e)) => Err(e),
            Err(_) => Err(StoreError::Silent("the budget ledger did not open".into())),
        };
        match tried {
            Ok(applied) => return applied,
            Err(e) => last_error = Some(e),
        }
        tokio::select! {
            () = tokio::time::sleep(BETWEEN_TRIES) => {}
            () = stop.cancelled() => break,
        }
    }
    if let Some(e) = last_error {
        tracing::warn!(node = %node.id, "earlier runs' settlements not checked: {e:#}");
    }
    0
}

async fn settle_earlier(node: &Node, store: &kv::Store) -> Result<usize, StoreError> {
    if !node.log.enabled() {
        return Ok(0);
    }
    let ledgers = crate::transport::store::ledger::read_all(store, STORE_TIMEOUT * 4)
        .await?
        .budgets;
    let own = node.ledger.holder();
    let lease_ms = node.cfg.node.budget_lease_ms;
    let Some((earlier, last_ms)) = earlier_holders(&ledgers, &node.id, &own, lease_ms) else {
        return Ok(0);
    };
    let from = last_ms.saturating_sub(BEFORE_LAST_SETTLED_MS);
    let mut books = Books::default();
    crate::transport::store::decisions::each_own(node.bus.nats(), &node.id, from, |r| {
        if r.charges.iter().any(|c| earlier.contains(&c.holder)) {
            books.add(r);
        }
    })
    .await?;
    let report = books.check(&ledgers, from, now_ms(), 0);
    let mut by_key: BTreeMap<String, Vec<Hole>> = BTreeMap::new();
    for h in report
        .not_charged
        .into_iter()
        .filter(|h| earlier.contains(&h.holder))
    {
        by_key.entry(h.budget.clone()).or_default().push(h);
    }
    let mut applied = 0;
    for (k, mut holes) in by_key {
        holes.sort_by(|a, b| (&a.holder, a.seq).cmp(&(&b.holder, b.seq)));
        let n = apply(node, store, &k, &holes).await?;
        let usd: f64 = holes.iter().map(|h| h.usd).sum();
        tracing::info!(
            node = %node.id,
            budget = %k,
            settlements = n,
            usd,
            requests = ?holes.iter().map(|h| h.request_id.as_str()).collect::<Vec<_>>(),
            "charged what an earlier run of this node answered and did not settle"
        );
        applied += n;
    }
    node.ledger
        .counters
        .from_records
        .fetch_add(applied as u64, std::sync::atomic::Ordering::Relaxed);
    Ok(applied)
}

/// The holders of `node`'s runs other than `own` the ledger knows (by a settlement or a hold),
/// and the earliest moment the log must be read from for them.
fn earlier_holders(
    ledgers: &BTreeMap<String, Ledger>,
    node: &str,
    own: &str,
    lease_ms: u64,
) -> Option<(BTreeSet<String>, u64)> {
    let prefix = format!("{node}#");
    let mut earlier = BTreeSet::new();
    let mut last: Option<u64> = None;
    let mut seen = |h: &String, at: u64| {
        if h.starts_with(&prefix) && h != own {
            earlier.insert(h.clone());
            last = Some(last.map_or(at, |l| l.min(at)));
        }
    };
    for l in ledgers.values() {
        for (h, s) in &l.settled {
            seen(h, s.at_ms);
        }
        for (h, hold) in &l.holds {
            seen(h, hold.until_ms.saturating_sub(lease_ms));
        }
    }
    Some((earlier, last?))
}

/// Apply `holes` (one budget's, in order) to its record, mirrored here as written: how many
/// were applied (a number the record has already is not).
async fn apply(
    node: &Node,
    store: &kv::Store,
    k: &str,
    holes: &[Hole],
) -> Result<usize, StoreError> {
    let (applied, written) =
        crate::transport::store::ledger::settle_holes(store, k, holes, now_ms()).await?;
    if let Some((revision, ledger)) = written {
        node.ledger.mirror(k, revision, &ledger);
    }
    Ok(applied.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn earlier_runs_are_this_nodes_other_holders_from_their_first_trace() {
        let mut a = Ledger::new(10.0);
        assert!(a.settle_once("n1#old", 3, 0.0, 0.1, 5_000));
        assert!(a.settle_once("n1#now", 1, 0.0, 0.1, 9_000));
        assert!(a.settle_once("n10#x", 1, 0.0, 0.1, 1_000));
        let mut b = Ledger::new(10.0);
        assert!(b.reserve("n1#older", 0.5, 2_000, 60_000));
        let ledgers = BTreeMap::from([("a".to_string(), a), ("b".to_string(), b)]);
        let (earlier, from) =
            earlier_holders(&ledgers, "n1", "n1#now", 30_000).expect("earlier runs");
        assert_eq!(
            earlier.into_iter().collect::<Vec<_>>(),
            vec!["n1#old", "n1#older"],
            "not this run, not n10"
        );
        assert_eq!(
            from, 5_000,
            "n1#old's last settlement; n1#older held from 32 s"
        );
        assert!(earlier_holders(&ledgers, "n2", "n2#now", 30_000).is_none());
    }
}
