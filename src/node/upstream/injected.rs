//! Faults a node injects into its own calls of a provider (`NodeCommand::FailTarget`): how
//! `oam chaos` fails a target no simulator stands in for (the team's real providers, a tool
//! server), so failover can be rehearsed on the real configuration. Each fault ends by itself
//! at its expiry or by its restore; the connector meets every call of its provider (requests,
//! streams, probes, tool lists) with it before the upstream is asked.

use super::super::exchange::Attempt;
use super::failed;
use crate::core::chaos::TargetFault;
use crate::core::request::{Generation, GenerationStatus};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

struct Active {
    id: String,
    provider: String,
    fault: TargetFault,
    until_ms: u64,
}

/// The faults in force on this node, shared by its connectors and its chaos service.
#[derive(Default)]
pub(crate) struct Injected(Mutex<Vec<Active>>);

impl Injected {
    /// Fault `id` meets every call of `provider` until `until_ms`.
    pub(crate) fn set(&self, id: &str, provider: &str, fault: TargetFault, until_ms: u64) {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        all.retain(|a| a.id != id);
        all.push(Active {
            id: id.to_string(),
            provider: provider.to_string(),
            fault,
            until_ms,
        });
    }

    /// Fault `id` ends; whether it was in force.
    pub(crate) fn end(&self, id: &str) -> bool {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let before = all.len();
        all.retain(|a| a.id != id);
        all.len() != before
    }

    /// The fault at `now_ms` on any of `names` (a provider, and the target a call is for), if
    /// one is in force (the newest), and its id.
    fn on(&self, names: &[impl AsRef<str>], now_ms: u64) -> Option<(String, TargetFault)> {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        all.retain(|a| a.until_ms > now_ms);
        all.iter()
            .rev()
            .find(|a| names.iter().any(|n| n.as_ref() == a.provider))
            .map(|a| (a.id.clone(), a.fault))
    }

    /// What the fault on `provider` makes of a call bounded by `timeout`: the failed attempt
    /// it ends as, or `None` (no fault, a slow one waited out, a flaky one that let it by): the
    /// call goes on.
    pub(crate) async fn meet(
        &self,
        names: &[impl AsRef<str>],
        timeout: Duration,
    ) -> Option<Attempt> {
        let (id, fault) = self.on(names, crate::clock::now_ms())?;
        let why = |what: String| format!("chaos fault {id}: {what}");
        let timeout_ms = timeout.as_millis() as u64;
        match fault {
            TargetFault::Error { status } => {
                let kind = match status {
                    401 | 403 => GenerationStatus::Unauthorized,
                    429 => GenerationStatus::RateLimited,
                    _ => GenerationStatus::Error,
                };
                let mut a = failed(kind, why(format!("HTTP {status}")), 0);
                a.http_status = status;
                Some(a)
            }
            TargetFault::Slow { extra_ms } if extra_ms < timeout_ms => {
                tokio::time::sleep(Duration::from_millis(extra_ms)).await;
                None
            }
            TargetFault::Slow { .. } | TargetFault::Hang => {
                tokio::time::sleep(timeout).await;
                let what = format!("no answer within {timeout_ms} ms");
                Some(failed(GenerationStatus::Timeout, why(what), timeout_ms))
            }
            TargetFault::RateLimit { retry_after_ms } => {
                let mut a = failed(GenerationStatus::RateLimited, why("HTTP 429".into()), 0);
                a.generation.retry_after_ms = Some(retry_after_ms);
                a.http_status = 429;
                Some(a)
            }
            TargetFault::Flaky { error_rate } => {
                // Which calls fail is the clock's to say: no state, and about the share asked.
                let draw = (crate::clock::now_ms() ^ (std::process::id() as u64)) % 1_000;
                (draw < (error_rate * 1_000.0) as u64)
                    .then(|| failed(GenerationStatus::Error, why("HTTP 500".into()), 0))
            }
        }
    }

    /// `meet`, for a free check: the generation it ends as.
    pub(crate) async fn meet_check(
        &self,
        names: &[impl AsRef<str>],
        timeout: Duration,
    ) -> Option<Generation> {
        self.meet(names, timeout).await.map(|a| a.generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_fault_meets_its_provider_s_calls_until_it_ends() {
        let faults = Injected::default();
        let far = crate::clock::now_ms() + 60_000;
        faults.set("f1", "calc", TargetFault::Error { status: 503 }, far);
        let t = Duration::from_millis(50);
        let a = faults
            .meet(&["calc"], t)
            .await
            .expect("failed by the fault");
        assert_eq!(a.generation.status, GenerationStatus::Error);
        assert!(a.generation.error.unwrap().contains("f1"));
        assert!(faults.meet(&["other"], t).await.is_none());
        // A fault on one target of a provider meets that target's calls, not the provider's
        // others.
        faults.set("t1", "calc/big", TargetFault::Error { status: 503 }, far);
        assert!(faults.meet(&["calc2", "calc2/big"], t).await.is_none());
        assert!(faults.meet(&["x", "calc/big"], t).await.is_some());
        assert!(faults.end("t1"));
        let a = {
            faults.set("f2", "calc", TargetFault::Hang, far);
            faults.meet(&["calc"], t).await.unwrap()
        };
        assert_eq!(a.generation.status, GenerationStatus::Timeout);
        assert!(faults.end("f2") && faults.end("f1"));
        assert!(faults.meet(&["calc"], t).await.is_none());
        // Past its expiry it is gone by itself.
        faults.set("f3", "calc", TargetFault::Error { status: 500 }, 1);
        assert!(faults.meet(&["calc"], t).await.is_none());
    }
}
