//! `GET /metrics`: Prometheus text exposition (format 0.0.4) of what a node does and sees.
//!
//! Counters and the request-duration histogram are kept here as requests finish; gauges
//! (breakers, bulkheads, nodes, quorum, consensus) are read from the engine when scraped.

use crate::core::breaker::Breaker;
use crate::core::health::{Outcome, Verdict};
use crate::core::pipeline::{Decision, Engine};
use crate::core::request::Priority;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

/// Upper bounds of the request-duration buckets, in seconds.
const BUCKETS_S: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0,
];

#[derive(Default)]
struct Histogram {
    buckets: [u64; BUCKETS_S.len()],
    count: u64,
    sum_s: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (i, le) in BUCKETS_S.iter().enumerate() {
            if seconds <= *le {
                self.buckets[i] += 1;
            }
        }
        self.count += 1;
        self.sum_s += seconds;
    }
}

#[derive(Default)]
struct Inner {
    requests: BTreeMap<(&'static str, &'static str), u64>,
    reasons: BTreeMap<&'static str, u64>,
    duration: BTreeMap<&'static str, Histogram>,
    provider_outcomes: BTreeMap<(String, &'static str, &'static str), u64>,
    escalation_deliveries: BTreeMap<&'static str, u64>,
    unauthorized: u64,
}

#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

fn outcome_name(o: Outcome) -> &'static str {
    match o {
        Outcome::Success => "success",
        Outcome::ContractFailure => "contract_failure",
        Outcome::Error => "error",
        Outcome::Timeout => "timeout",
    }
}

/// Escape a label value per the exposition format.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A request finished after `seconds`.
    pub fn decision(&self, d: &Decision, seconds: f64) {
        let outcome = d.outcome.as_str();
        let mut m = self.inner();
        *m.requests.entry((outcome, d.phase.as_str())).or_default() += 1;
        for c in &d.reason_codes {
            *m.reasons.entry(c.as_str()).or_default() += 1;
        }
        m.duration.entry(outcome).or_default().observe(seconds);
    }

    /// A call to a provider ended (`source` is `probe` or `traffic`).
    pub fn provider_outcome(&self, provider: &str, source: &'static str, o: Outcome) {
        *self
            .inner()
            .provider_outcomes
            .entry((provider.to_string(), source, outcome_name(o)))
            .or_default() += 1;
    }

    /// A request refused for want of a client's key.
    pub fn unauthorized(&self) {
        self.inner().unauthorized += 1;
    }

    /// An escalation sent to a sink (`delivered`) or given up on (`failed`).
    pub fn escalation_delivery(&self, outcome: &'static str) {
        *self
            .inner()
            .escalation_deliveries
            .entry(outcome)
            .or_default() += 1;
    }

    /// The whole exposition, gauges read from `engine` at `now_ms`.
    pub fn render(&self, node: &str, engine: &Engine, now_ms: u64, bus: &[(&str, u64)]) -> String {
        let mut out = String::new();
        let m = self.inner();
        let w = &mut out;
        let _ = writeln!(
            w,
            "# HELP oam_requests_total Requests decided, by outcome and the phase they ended in."
        );
        let _ = writeln!(w, "# TYPE oam_requests_total counter");
        for ((outcome, phase), n) in &m.requests {
            let _ = writeln!(
                w,
                "oam_requests_total{{outcome=\"{outcome}\",phase=\"{phase}\"}} {n}"
            );
        }
        let _ = writeln!(
            w,
            "# HELP oam_reason_codes_total Reason codes carried by decisions."
        );
        let _ = writeln!(w, "# TYPE oam_reason_codes_total counter");
        for (code, n) in &m.reasons {
            let _ = writeln!(w, "oam_reason_codes_total{{code=\"{code}\"}} {n}");
        }
        let _ = writeln!(
            w,
            "# HELP oam_request_duration_seconds Time from arrival to decision, by outcome."
        );
        let _ = writeln!(w, "# TYPE oam_request_duration_seconds histogram");
        for (outcome, h) in &m.duration {
            for (le, n) in BUCKETS_S.iter().zip(h.buckets) {
                let _ = writeln!(
                    w,
                    "oam_request_duration_seconds_bucket{{outcome=\"{outcome}\",le=\"{le}\"}} {n}"
                );
            }
            let _ = writeln!(
                w,
                "oam_request_duration_seconds_bucket{{outcome=\"{outcome}\",le=\"+Inf\"}} {}",
                h.count
            );
            let _ = writeln!(
                w,
                "oam_request_duration_seconds_sum{{outcome=\"{outcome}\"}} {}",
                h.sum_s
            );
            let _ = writeln!(
                w,
                "oam_request_duration_seconds_count{{outcome=\"{outcome}\"}} {}",
                h.count
            );
        }
        let _ = writeln!(
            w,
            "# HELP oam_unauthorized_requests_total Requests refused for want of a client's key (401)."
        );
        let _ = writeln!(w, "# TYPE oam_unauthorized_requests_total counter");
        let _ = writeln!(w, "oam_unauthorized_requests_total {}", m.unauthorized);
        let _ = writeln!(
            w,
            "# HELP oam_escalation_deliveries_total Escalations sent to the webhook, by outcome."
        );
        let _ = writeln!(w, "# TYPE oam_escalation_deliveries_total counter");
        for (outcome, n) in &m.escalation_deliveries {
            let _ = writeln!(
                w,
                "oam_escalation_deliveries_total{{outcome=\"{outcome}\"}} {n}"
            );
        }
        let _ = writeln!(
            w,
            "# HELP oam_provider_outcomes_total Calls to providers, by source (probe or traffic) and outcome."
        );
        let _ = writeln!(w, "# TYPE oam_provider_outcomes_total counter");
        for ((p, source, outcome), n) in &m.provider_outcomes {
            let _ = writeln!(
                w,
                "oam_provider_outcomes_total{{provider=\"{}\",source=\"{source}\",outcome=\"{outcome}\"}} {n}",
                label(p)
            );
        }
        drop(m);

        let s = &engine.state;
        let _ = writeln!(
            w,
            "# HELP oam_breaker_state Circuit breaker per provider: 0 closed, 1 half-open, 2 open."
        );
        let _ = writeln!(w, "# TYPE oam_breaker_state gauge");
        for p in &s.providers {
            let mut b = s.breakers.get(&*p.id).copied().unwrap_or_default();
            b.tick(now_ms);
            let v = match b {
                Breaker::Closed { .. } => 0,
                Breaker::HalfOpen { .. } => 1,
                Breaker::Open { .. } => 2,
            };
            let _ = writeln!(w, "oam_breaker_state{{provider=\"{}\"}} {v}", label(&p.id));
        }
        for (name, help, kind, get) in [
            (
                "oam_bulkhead_active",
                "Requests holding a slot, per class.",
                "gauge",
                0,
            ),
            (
                "oam_bulkhead_queued",
                "Requests waiting in the class queue.",
                "gauge",
                1,
            ),
            (
                "oam_bulkhead_shed_total",
                "Requests shed at admission, per class.",
                "counter",
                2,
            ),
        ] {
            let _ = writeln!(w, "# HELP {name} {help}");
            let _ = writeln!(w, "# TYPE {name} {kind}");
            for class in Priority::ALL {
                let u = s.bulkheads.usage(class);
                let v = [u.active as u64, u.queued as u64, u.shed][get];
                let _ = writeln!(w, "{name}{{class=\"{}\"}} {v}", class.as_str());
            }
        }
        let c = &s.cluster;
        let _ = writeln!(
            w,
            "# HELP oam_live_nodes Nodes alive in this node's view, itself included."
        );
        let _ = writeln!(w, "# TYPE oam_live_nodes gauge");
        let _ = writeln!(w, "oam_live_nodes {}", c.live_nodes(now_ms).len());
        let _ = writeln!(
            w,
            "# HELP oam_quorum Agreeing observations a provider verdict needs."
        );
        let _ = writeln!(w, "# TYPE oam_quorum gauge");
        let _ = writeln!(w, "oam_quorum {}", c.quorum(now_ms));
        let _ = writeln!(
            w,
            "# HELP oam_provider_verdict Consensus verdict per provider (1 for the current one)."
        );
        let _ = writeln!(w, "# TYPE oam_provider_verdict gauge");
        let views: Vec<_> = s
            .providers
            .iter()
            .map(|p| (p.id.clone(), c.view(&p.id, now_ms)))
            .collect();
        for (id, v) in &views {
            for verdict in Verdict::ALL {
                let _ = writeln!(
                    w,
                    "oam_provider_verdict{{provider=\"{}\",verdict=\"{}\",quorum=\"{}\"}} {}",
                    label(id),
                    verdict.as_str(),
                    v.quorum,
                    u8::from(v.verdict == verdict)
                );
            }
        }
        let _ = writeln!(
            w,
            "# HELP oam_provider_votes Observations agreeing with the verdict."
        );
        let _ = writeln!(w, "# TYPE oam_provider_votes gauge");
        for (id, v) in &views {
            let _ = writeln!(
                w,
                "oam_provider_votes{{provider=\"{}\"}} {}",
                label(id),
                v.votes
            );
        }
        let _ = writeln!(
            w,
            "# HELP oam_bus_messages_ignored_total Control-plane messages not applied, by reason."
        );
        let _ = writeln!(w, "# TYPE oam_bus_messages_ignored_total counter");
        for (reason, n) in bus {
            let _ = writeln!(
                w,
                "oam_bus_messages_ignored_total{{reason=\"{reason}\"}} {n}"
            );
        }
        let _ = writeln!(w, "# HELP oam_node_info This node.");
        let _ = writeln!(w, "# TYPE oam_node_info gauge");
        let _ = writeln!(
            w,
            "oam_node_info{{node=\"{}\",version=\"{}\"}} 1",
            label(node),
            env!("CARGO_PKG_VERSION")
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::default();
        for s in [0.001, 0.15, 0.15, 20.0] {
            h.observe(s);
        }
        assert_eq!(h.buckets[0], 1);
        assert_eq!(h.buckets[5], 3, "le=0.2 holds everything up to 0.2");
        assert_eq!(h.buckets[BUCKETS_S.len() - 1], 3, "20 s is only in +Inf");
        assert_eq!(h.count, 4);
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
