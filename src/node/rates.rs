//! Rate limits per client and agent across the cluster (`core::rates`): before a request's
//! first attempt, the caller's lease on this node admits it, or is topped up from the shared
//! window in `oam-rates` and then admits it, or it is refused (RATE_LIMIT_EXCEEDED: 429 with
//! `Retry-After`). Tokens are taken by estimate and set right by the usage the attempts
//! report. While the store cannot be reached, the node admits from its own share of the window
//! (the limit divided by the cluster size).

use super::Node;
use super::metrics::{Kind, Registry};
use crate::clock::now_ms;
use crate::core::rates::{self, Lease, Limit};
use async_nats::jetstream::kv;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// This node's leases, one per limited caller, and the shared store.
#[derive(Default)]
pub(crate) struct Rates {
    leases: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<Lease>>>>,
    store: tokio::sync::OnceCell<kv::Store>,
    pub counters: Arc<RateCounters>,
}

/// Leases taken from the shared window, and from this node's share of it (the store
/// unreachable), for `/metrics`.
#[derive(Default)]
pub(crate) struct RateCounters {
    store: AtomicU64,
    local_share: AtomicU64,
}

impl RateCounters {
    /// Register the counters, read when scraped.
    pub(crate) fn register(self: &Arc<Self>, registry: &Registry) {
        let c = self.clone();
        registry.register(
            "oam_rate_limit_leases_total",
            "Batches of a caller's rate-limit window this node leased, by where from (store: \
             the cluster's shared count; local_share: its own share while that is unreachable).",
            Kind::Counter,
            move |s| {
                for (from, n) in [("store", &c.store), ("local_share", &c.local_share)] {
                    s.put(&[("from", from)], n.load(Ordering::Relaxed));
                }
            },
        );
    }
}

/// A request admitted under a limit: its window and the tokens taken for it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Admitted {
    window: u64,
    tokens: u64,
}

impl Rates {
    fn lease_of(&self, caller: &str) -> Arc<tokio::sync::Mutex<Lease>> {
        let mut leases = self
            .leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        leases.entry(caller.to_string()).or_default().clone()
    }

    async fn store(&self, node: &Node) -> Option<&kv::Store> {
        self.store
            .get_or_try_init(|| crate::transport::store::rates::open(node.bus.nats()))
            .await
            .ok()
    }

    /// Admit one request of `caller` estimated at `tokens` under `limit`, or how long until
    /// the window that would admit it opens (ms).
    pub(crate) async fn admit(
        &self,
        node: &Node,
        caller: &str,
        limit: &Limit,
        tokens: u64,
    ) -> Result<Admitted, u64> {
        let now = now_ms();
        let window = rates::window(now);
        let admitted = Admitted { window, tokens };
        let lease = self.lease_of(caller);
        // One refill at a time per caller; the others wait for it and take from it.
        let mut l = lease.lock().await;
        if l.take(limit, window, tokens) {
            return Ok(admitted);
        }
        let nodes = node.cfg.node.cluster_size;
        let wants = l.wants(limit, nodes, tokens);
        let asked = async {
            let store = self.store(node).await.ok_or("the store cannot be opened")?;
            crate::transport::store::rates::lease(store, caller, window, limit, wants)
                .await
                .map_err(|_| "the store did not answer")
        };
        let timeout = crate::transport::store::ledger::STORE_TIMEOUT;
        match tokio::time::timeout(timeout, asked).await {
            Ok(Ok((r, t))) => {
                self.counters.store.fetch_add(1, Ordering::Relaxed);
                l.add(window, r, t);
            }
            _ => {
                self.counters.local_share.fetch_add(1, Ordering::Relaxed);
                l.local_share(limit, nodes, window, wants);
            }
        }
        if l.take(limit, window, tokens) {
            return Ok(admitted);
        }
        Err(rates::retry_after_ms(now))
    }

    /// What a request admitted as `a` used in all (`actual` tokens, from its attempts' usage).
    pub(crate) async fn settle(&self, caller: &str, a: Admitted, actual: u64) {
        let lease = self.lease_of(caller);
        lease.lock().await.settle(a.window, a.tokens, actual);
    }
}
