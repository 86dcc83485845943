//! What a node says of itself: its snapshot (`GET /v1/oam/state`, `oam.v1.state.{node}`, read
//! by `oam watch` and `oam mesh status`) and its Prometheus exposition (`GET /metrics`).

use super::Node;
use super::pipeline::lock;
use crate::clock::now_ms;
use crate::core::breaker::Breaker;
use crate::core::wire::{BusCounts, MemberSnapshot, NodeSnapshot, ProviderSnapshot};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The JetStream stores that do not take this node's writes now (a full store, JetStream gone
/// on the server, no answer), each with its last error; a store's next write that succeeds
/// clears it. Shown in the snapshot, so `oam mesh status` and `oam watch` say so.
#[derive(Default)]
pub struct StoreFaults(Mutex<BTreeMap<&'static str, String>>);

impl StoreFaults {
    pub(crate) fn failed(&self, store: &'static str, why: impl std::fmt::Display) {
        let why = why.to_string();
        if lock(&self.0).insert(store, why.clone()).is_none() {
            tracing::error!(store, "the {store} takes no writes: {why}");
        }
    }

    pub(crate) fn ok(&self, store: &'static str) {
        if lock(&self.0).remove(store).is_some() {
            tracing::info!(store, "the {store} takes writes again");
        }
    }

    fn snapshot(&self) -> BTreeMap<String, String> {
        lock(&self.0)
            .iter()
            .map(|(k, v)| ((*k).to_string(), v.clone()))
            .collect()
    }
}

/// A breaker as a request arriving at `now_ms` would find it: an open one past its time is
/// half-open, even if no request has touched it since.
pub fn breaker_now(b: Option<Breaker>, now_ms: u64) -> Breaker {
    let mut b = b.unwrap_or_default();
    b.tick(now_ms);
    b
}

/// What `node` sees, now.
pub fn snapshot(node: &Node) -> NodeSnapshot {
    let now = now_ms();
    let e = node.pipeline.read();
    let c = &e.state.cluster;
    let nodes = c
        .members
        .iter()
        .map(|(id, m)| MemberSnapshot {
            id: id.clone(),
            alive: c.is_alive(id, now),
            heartbeat_age_ms: now.saturating_sub(m.last_heartbeat_ms),
            connected: m.connected,
        })
        .collect();
    let providers = e
        .state
        .providers
        .iter()
        .map(|p| ProviderSnapshot {
            id: p.id.to_string(),
            fallback: p.fallback,
            consensus: c.view(&p.id, now),
            local: node.health.stats(&p.id, now),
            breaker: breaker_now(e.state.breakers.get(&*p.id).copied(), now),
        })
        .collect();
    let count = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let bus = &node.bus.counters;
    NodeSnapshot {
        node: node.id.clone(),
        now_ms: now,
        cluster_size: c.effective_size(now),
        quorum: c.quorum(now),
        live_nodes: c.live_nodes(now).into_iter().map(String::from).collect(),
        nodes,
        providers,
        bulkheads: e.state.bulkheads,
        bulkhead_limits: e.config.bulkheads,
        budgets: e.state.budgets.clone(),
        loops: e.state.loops.clone(),
        bus: BusCounts {
            malformed: count(&bus.malformed),
            duplicate_or_stale: count(&bus.duplicate_or_stale),
            forged: count(&bus.forged),
            dropped_events: count(&bus.dropped_events),
        },
        escalations_undelivered: count(&node.escalations.undelivered),
        decisions_unlogged: count(&node.log.counters.lost),
        store_faults: node.store_faults.snapshot(),
    }
}

/// The Prometheus exposition.
pub fn prometheus(node: &Node) -> String {
    let b = &node.bus.counters;
    let count = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let bus = [
        ("malformed", count(&b.malformed)),
        ("duplicate_or_stale", count(&b.duplicate_or_stale)),
        ("forged", count(&b.forged)),
        ("dropped_outgoing", count(&b.dropped_events)),
    ];
    let engine = node.pipeline.read();
    let mut text = node.metrics.render(&node.id, &engine, now_ms(), &bus);
    drop(engine);
    text.push_str(&format!(
        "# HELP oam_http_connection_limit_reached_total Times every HTTP connection slot \
         (node.max_connections) was taken; new connections waited.\n\
         # TYPE oam_http_connection_limit_reached_total counter\n\
         oam_http_connection_limit_reached_total {}\n",
        count(&node.serving.saturated)
    ));
    text.push_str(&node.ledger.counters.render());
    let log = &node.log.counters;
    text.push_str(&format!(
        "# HELP oam_decision_log_records_total Decision records, by what became of them (lost: \
         the buffer was full, or the stream did not take them).\n\
         # TYPE oam_decision_log_records_total counter\n\
         oam_decision_log_records_total{{result=\"written\"}} {}\n\
         oam_decision_log_records_total{{result=\"lost\"}} {}\n",
        count(&log.written),
        count(&log.lost)
    ));
    text
}
