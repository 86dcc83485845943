//! What a node says of itself: its snapshot (`GET /v1/oam/state`, `oam.v1.state.{node}`, read
//! by `oam watch` and `oam mesh status`) and its Prometheus exposition (`GET /metrics`).

use super::Node;
use super::metrics::{Kind, Registry};
use super::pipeline::{Pipeline, lock};
use crate::clock::now_ms;
use crate::core::breaker::Breaker;
use crate::core::bulkhead::Kind as Pool;
use crate::core::health::Verdict;
use crate::core::request::Priority;
use crate::core::wire::{BusCounts, MemberSnapshot, NodeSnapshot, ProviderSnapshot};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The JetStream stores that do not take this node's writes now (a full store, JetStream gone
/// on the server, no answer), each with its last error; a store's next write that succeeds
/// clears it. Shown in the snapshot, so `oam mesh status` and `oam watch` say so.
#[derive(Default)]
pub(crate) struct StoreFaults(Mutex<BTreeMap<&'static str, String>>);

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
pub(crate) fn breaker_now(b: Option<Breaker>, now_ms: u64) -> Breaker {
    let mut b = b.unwrap_or_default();
    b.tick(now_ms);
    b
}

/// What `node` sees, now.
pub(crate) fn snapshot(node: &Node) -> NodeSnapshot {
    let now = now_ms();
    // Judged before the engine is locked: a judgement reads the peers' evidence from it.
    let local: BTreeMap<String, _> = node
        .cfg
        .targets
        .iter()
        .filter_map(|t| Some((t.id.clone(), node.health.stats(&t.id, now)?)))
        .collect();
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
            tools: p.serves_tools(),
            consensus: c.view(&p.id, now),
            local: local.get(&*p.id).copied(),
            breaker: breaker_now(e.state.breakers.get(&*p.id).copied(), now),
            last_failure: node.health.last_failure(&p.id),
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
        stream_bulkheads: e.state.stream_bulkheads,
        stream_bulkhead_limits: e.config.stream_bulkheads,
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
        short_copies: node.copies.short(),
        probes: node.health.probes.snapshot(now),
        routes: e
            .state
            .routes
            .iter()
            .map(|(model, r)| {
                (
                    model.clone(),
                    r.targets.iter().map(ToString::to_string).collect(),
                )
            })
            .collect(),
    }
}

/// Register what the engine holds (breakers, bulkheads, the cluster's view), this node's
/// identity and its HTTP saturation, all read when scraped.
pub(crate) fn register(
    registry: &Registry,
    node: &str,
    pipeline: &Pipeline,
    serving: &super::Serving,
) {
    let p = pipeline.clone();
    registry.register(
        "oam_breaker_state",
        "Circuit breaker per target: 0 closed, 1 half-open, 2 open.",
        Kind::Gauge,
        move |s| {
            let e = p.read();
            let now = now_ms();
            for t in &e.state.providers {
                let v = match breaker_now(e.state.breakers.get(&*t.id).copied(), now) {
                    Breaker::Closed { .. } => 0,
                    Breaker::HalfOpen { .. } => 1,
                    Breaker::Open { .. } => 2,
                };
                s.put(&[("target", &t.id)], v);
            }
        },
    );
    for (name, help, kind, which) in [
        (
            "oam_bulkhead_active",
            "Requests holding a slot, per class and kind (short or stream).",
            Kind::Gauge,
            0,
        ),
        (
            "oam_bulkhead_queued",
            "Requests waiting in the class queue, per kind.",
            Kind::Gauge,
            1,
        ),
        (
            "oam_bulkhead_shed_total",
            "Requests shed at admission, per class and kind.",
            Kind::Counter,
            2,
        ),
        (
            "oam_bulkhead_limit",
            "Slots a class may hold at once, per kind (node default: sized from cores and \
             open files).",
            Kind::Gauge,
            3,
        ),
    ] {
        let p = pipeline.clone();
        registry.register(name, help, kind, move |s| {
            let e = p.read();
            let pools = [
                (Pool::Short, &e.state.bulkheads, &e.config.bulkheads),
                (
                    Pool::Stream,
                    &e.state.stream_bulkheads,
                    &e.config.stream_bulkheads,
                ),
            ];
            for (pool, b, limits) in pools {
                for class in Priority::ALL {
                    let u = b.usage(class);
                    let limit = u64::from(limits.limits(class).concurrency);
                    let v = [u64::from(u.active), u64::from(u.queued), u.shed, limit][which];
                    s.put(&[("class", class.as_str()), ("kind", pool.as_str())], v);
                }
            }
        });
    }
    let p = pipeline.clone();
    registry.register(
        "oam_live_nodes",
        "Nodes alive in this node's view, itself included.",
        Kind::Gauge,
        move |s| s.put(&[], p.read().state.cluster.live_nodes(now_ms()).len()),
    );
    let p = pipeline.clone();
    registry.register(
        "oam_quorum",
        "Agreeing observations a target verdict needs.",
        Kind::Gauge,
        move |s| s.put(&[], p.read().state.cluster.quorum(now_ms())),
    );
    let p = pipeline.clone();
    registry.register(
        "oam_target_verdict",
        "Consensus verdict per target (1 for the current one).",
        Kind::Gauge,
        move |s| {
            for (id, v) in views(&p) {
                for verdict in Verdict::ALL {
                    let quorum = v.quorum.to_string();
                    let labels = [
                        ("target", id.as_str()),
                        ("verdict", verdict.as_str()),
                        ("quorum", &quorum),
                    ];
                    s.put(&labels, u8::from(v.verdict == verdict));
                }
            }
        },
    );
    let p = pipeline.clone();
    registry.register(
        "oam_target_votes",
        "Observations agreeing with the verdict.",
        Kind::Gauge,
        move |s| {
            for (id, v) in views(&p) {
                s.put(&[("target", id.as_str())], v.votes);
            }
        },
    );
    let node = node.to_string();
    registry.register("oam_node_info", "This node.", Kind::Gauge, move |s| {
        s.put(
            &[("node", &node), ("version", env!("CARGO_PKG_VERSION"))],
            1,
        );
    });
    let saturated = serving.saturated.clone();
    registry.register(
        "oam_http_connection_limit_reached_total",
        "Times every HTTP connection slot (node.max_connections) was taken: the one waiting \
         longest for a request was closed to make room, or a spare slot took the new one.",
        Kind::Counter,
        move |s| s.put(&[], saturated.load(Ordering::Relaxed)),
    );
    let refused = serving.refused_at_connection_limit.clone();
    registry.register(
        "oam_http_connection_refused_total",
        "Requests refused with CONNECTION_LIMIT (503, Retry-After) on a spare connection: \
         every connection slot had a request in hand.",
        Kind::Counter,
        move |s| s.put(&[], refused.load(Ordering::Relaxed)),
    );
}

/// Each target's consensus view, now.
fn views(p: &Pipeline) -> Vec<(String, crate::core::quorum::ProviderView)> {
    let e = p.read();
    let now = now_ms();
    e.state
        .providers
        .iter()
        .map(|t| (t.id.to_string(), e.state.cluster.view(&t.id, now)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::config::NodeConfig;

    #[tokio::test]
    async fn a_node_says_what_it_sees_and_exposes_every_metric_once() {
        let cfg = NodeConfig::load(None, "http://127.0.0.1:1").expect("the default configuration");
        let targets = cfg.targets.len();
        let nats = super::super::bus::offline::client().await;
        let (node, _services) = Node::new("n1".into(), cfg, nats).expect("a node");
        let snap = snapshot(&node);
        assert_eq!((snap.node.as_str(), snap.providers.len()), ("n1", targets));
        assert!(snap.store_faults.is_empty());
        node.store_faults.failed("ledger", "the store is full");
        assert_eq!(snapshot(&node).store_faults["ledger"], "the store is full");
        node.store_faults.ok("ledger");
        assert!(
            snapshot(&node).store_faults.is_empty(),
            "a write that succeeds clears it"
        );

        let text = node.metrics.registry.render();
        let mut families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        families.sort_unstable();
        let mut expected = vec![
            "oam_breaker_state",
            "oam_budget_escrow_draws_total",
            "oam_budget_ledger_writes_total",
            "oam_budget_reservations_total",
            "oam_budget_settled_from_records_total",
            "oam_budget_unsettled",
            "oam_budget_would_refuse_total",
            "oam_bulkhead_active",
            "oam_bulkhead_limit",
            "oam_bulkhead_queued",
            "oam_bulkhead_shed_total",
            "oam_bus_messages_ignored_total",
            "oam_decision_log_records_total",
            "oam_decision_log_state_versions_total",
            "oam_escalation_deliveries_total",
            "oam_http_connection_limit_reached_total",
            "oam_http_connection_refused_total",
            "oam_live_nodes",
            "oam_node_info",
            "oam_otlp_spans_total",
            "oam_overhead_seconds",
            "oam_probe_calls_total",
            "oam_probe_spend_usd_per_hour",
            "oam_probe_spend_usd_total",
            "oam_probe_target_spend_usd_per_hour",
            "oam_target_failing_calls",
            "oam_target_last_failure_age_seconds",
            "oam_target_outcomes_total",
            "oam_target_verdict",
            "oam_target_votes",
            "oam_quorum",
            "oam_rate_limit_leases_total",
            "oam_reason_codes_total",
            "oam_request_duration_seconds",
            "oam_requests_total",
            "oam_stream_replicas",
            "oam_stream_replicas_current",
            "oam_unauthorized_requests_total",
        ];
        expected.sort_unstable();
        assert_eq!(families, expected, "each family once");
        assert_eq!(text.matches("# HELP ").count(), expected.len());
        assert!(text.contains("oam_breaker_state{target=\""), "{text}");
        assert!(
            !text.contains("provider=\""),
            "a target is labelled target: {text}"
        );
    }
}
