//! `GET /metrics`: one registry for everything a node exposes, written as Prometheus text
//! (format 0.0.4). Each service registers its metrics once, by name, help and type: counters
//! kept as requests finish ([`Family`], [`Histograms`]), or values read when scraped (a
//! closure over the service's own state). The registry alone writes the text.

use crate::core::health::Outcome;
use crate::core::pipeline::Decision;
use std::collections::BTreeMap;
use std::fmt::{Display, Write};
use std::sync::{Arc, Mutex, MutexGuard};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Where a family writes its samples when scraped.
pub(crate) struct Scrape<'a> {
    name: &'static str,
    out: &'a mut String,
}

impl Scrape<'_> {
    /// One sample of the family: `name{labels} value`.
    pub(crate) fn put(&mut self, labels: &[(&str, &str)], value: impl Display) {
        self.put_named("", labels, value);
    }

    /// One sample named `{family}{suffix}` (a histogram's `_bucket`, `_sum`, `_count`).
    pub(crate) fn put_named(&mut self, suffix: &str, labels: &[(&str, &str)], value: impl Display) {
        let _ = write!(self.out, "{}{suffix}", self.name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }
}

/// Escape a label value per the exposition format.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

type Collect = Box<dyn Fn(&mut Scrape<'_>) + Send + Sync>;

struct Registered {
    name: &'static str,
    help: &'static str,
    kind: Kind,
    collect: Collect,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Every metric of a node, in the order registered.
#[derive(Default)]
pub(crate) struct Registry(Mutex<Vec<Registered>>);

impl Registry {
    /// Register a family whose samples `collect` writes when scraped.
    pub(crate) fn register(
        &self,
        name: &'static str,
        help: &'static str,
        kind: Kind,
        collect: impl Fn(&mut Scrape<'_>) + Send + Sync + 'static,
    ) {
        let mut all = lock(&self.0);
        debug_assert!(
            all.iter().all(|r| r.name != name),
            "{name} registered twice"
        );
        all.push(Registered {
            name,
            help,
            kind,
            collect: Box::new(collect),
        });
    }

    /// Register a counter family kept by key; `labels` names a key's label values.
    pub(crate) fn family<K: Ord + Clone + Send + 'static>(
        &self,
        name: &'static str,
        help: &'static str,
        labels: fn(&K) -> Vec<(&'static str, String)>,
    ) -> Family<K> {
        let family = Family(Arc::default());
        let kept = family.clone();
        self.register(name, help, Kind::Counter, move |s| {
            for (k, n) in lock(&kept.0).iter() {
                let pairs = labels(k);
                let pairs: Vec<(&str, &str)> =
                    pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
                s.put(&pairs, n);
            }
        });
        family
    }

    /// The exposition: every family, with its help and type, in the order registered.
    pub(crate) fn render(&self) -> String {
        let mut out = String::with_capacity(8 << 10);
        for r in lock(&self.0).iter() {
            let _ = writeln!(out, "# HELP {} {}", r.name, r.help);
            let _ = writeln!(out, "# TYPE {} {}", r.name, r.kind.as_str());
            (r.collect)(&mut Scrape {
                name: r.name,
                out: &mut out,
            });
        }
        out
    }
}

/// A counter per key (a set of label values), kept as things happen.
pub(crate) struct Family<K>(Arc<Mutex<BTreeMap<K, u64>>>);

impl<K> Clone for Family<K> {
    fn clone(&self) -> Self {
        Family(self.0.clone())
    }
}

impl<K: Ord> Family<K> {
    pub(crate) fn inc(&self, key: K) {
        *lock(&self.0).entry(key).or_default() += 1;
    }
}

/// Upper bounds of the request-duration buckets, in seconds.
const BUCKETS_S: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Upper bounds of the overhead buckets, in seconds: oam's own time is tens of microseconds to
/// a few milliseconds.
const OVERHEAD_BUCKETS_S: [f64; 12] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
];

struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<u64>,
    count: u64,
    sum_s: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            buckets: vec![0; bounds.len()],
            count: 0,
            sum_s: 0.0,
        }
    }

    fn observe(&mut self, seconds: f64) {
        for (i, le) in self.bounds.iter().enumerate() {
            if seconds <= *le {
                self.buckets[i] += 1;
            }
        }
        self.count += 1;
        self.sum_s += seconds;
    }
}

/// A histogram of seconds per value of one label.
#[derive(Clone)]
pub(crate) struct Histograms {
    bounds: &'static [f64],
    kept: Arc<Mutex<BTreeMap<&'static str, Histogram>>>,
}

impl Histograms {
    fn register(
        registry: &Registry,
        name: &'static str,
        help: &'static str,
        label: &'static str,
        bounds: &'static [f64],
    ) -> Histograms {
        let h = Histograms {
            bounds,
            kept: Arc::default(),
        };
        let kept = h.kept.clone();
        registry.register(name, help, Kind::Histogram, move |s| {
            for (v, h) in lock(&kept).iter() {
                for (le, n) in h.bounds.iter().zip(&h.buckets) {
                    s.put_named("_bucket", &[(label, v), ("le", &le.to_string())], n);
                }
                s.put_named("_bucket", &[(label, v), ("le", "+Inf")], h.count);
                s.put_named("_sum", &[(label, v)], h.sum_s);
                s.put_named("_count", &[(label, v)], h.count);
            }
        });
        h
    }

    pub(crate) fn observe(&self, value: &'static str, seconds: f64) {
        lock(&self.kept)
            .entry(value)
            .or_insert_with(|| Histogram::new(self.bounds))
            .observe(seconds);
    }
}

fn outcome_name(o: Outcome) -> &'static str {
    match o {
        Outcome::Success => "success",
        Outcome::ContractFailure => "contract_failure",
        Outcome::Error => "error",
        Outcome::Timeout => "timeout",
    }
}

/// The registry, and the families the request path and its services count in.
pub(crate) struct Metrics {
    pub registry: Registry,
    requests: Family<(&'static str, &'static str)>,
    reasons: Family<&'static str>,
    duration: Histograms,
    overhead: Histograms,
    unauthorized: Family<()>,
    escalation_deliveries: Family<&'static str>,
    provider_outcomes: Family<(String, &'static str, &'static str)>,
}

impl Default for Metrics {
    fn default() -> Self {
        let registry = Registry::default();
        let requests = registry.family(
            "oam_requests_total",
            "Requests decided, by outcome and the phase they ended in.",
            |(o, p): &(&str, &str)| vec![("outcome", o.to_string()), ("phase", p.to_string())],
        );
        let reasons = registry.family(
            "oam_reason_codes_total",
            "Reason codes carried by decisions.",
            |c: &&str| vec![("code", c.to_string())],
        );
        let duration = Histograms::register(
            &registry,
            "oam_request_duration_seconds",
            "Time from arrival to decision, by outcome.",
            "outcome",
            &BUCKETS_S,
        );
        let overhead = Histograms::register(
            &registry,
            "oam_overhead_seconds",
            "Time a request spent in oam itself: from arrival to its answer (a live stream: to \
             its first event), less the time waiting on upstreams, in a bulkhead's queue and in \
             a retry's backoff. By how it was answered: whole, or stream (relayed live).",
            "answer",
            &OVERHEAD_BUCKETS_S,
        );
        let unauthorized = registry.family(
            "oam_unauthorized_requests_total",
            "Requests refused for want of a client's key (401).",
            |()| vec![],
        );
        // Shown at 0 before the first one.
        lock(&unauthorized.0).insert((), 0);
        let escalation_deliveries = registry.family(
            "oam_escalation_deliveries_total",
            "Escalations sent to the webhook, by outcome.",
            |o: &&str| vec![("outcome", o.to_string())],
        );
        let provider_outcomes = registry.family(
            "oam_target_outcomes_total",
            "Calls to targets, by source (probe or traffic) and outcome.",
            |(p, s, o): &(String, &str, &str)| {
                vec![
                    ("target", p.clone()),
                    ("source", s.to_string()),
                    ("outcome", o.to_string()),
                ]
            },
        );
        Metrics {
            registry,
            requests,
            reasons,
            duration,
            overhead,
            unauthorized,
            escalation_deliveries,
            provider_outcomes,
        }
    }
}

impl Metrics {
    /// A request finished after `seconds`.
    pub(crate) fn decision(&self, d: &Decision, seconds: f64) {
        let outcome = d.outcome.as_str();
        self.requests.inc((outcome, d.phase.as_str()));
        for c in &d.reason_codes {
            self.reasons.inc(c.as_str());
        }
        self.duration.observe(outcome, seconds);
    }

    /// A request spent `seconds` in oam itself (`answer`: `whole` or `stream`).
    pub(crate) fn overhead(&self, answer: &'static str, seconds: f64) {
        self.overhead.observe(answer, seconds);
    }

    /// A call to a target ended (`source` is `probe` or `traffic`).
    pub(crate) fn provider_outcome(&self, target: &str, source: &'static str, o: Outcome) {
        self.provider_outcomes
            .inc((target.to_string(), source, outcome_name(o)));
    }

    /// A request refused for want of a client's key.
    pub(crate) fn unauthorized(&self) {
        self.unauthorized.inc(());
    }

    /// An escalation sent to a sink (`delivered`) or given up on (`failed`).
    pub(crate) fn escalation_delivery(&self, outcome: &'static str) {
        self.escalation_deliveries.inc(outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(&BUCKETS_S);
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
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn families_come_out_in_the_order_registered_with_help_type_and_samples() {
        let r = Registry::default();
        let f = r.family("x_total", "Xs, by kind.", |k: &&str| {
            vec![("kind", k.to_string())]
        });
        r.register("y", "A gauge.", Kind::Gauge, |s| {
            s.put(&[("a", "q\"")], 2.5);
        });
        f.inc("b");
        f.inc("a");
        f.inc("b");
        assert_eq!(
            r.render(),
            "# HELP x_total Xs, by kind.\n# TYPE x_total counter\nx_total{kind=\"a\"} 1\n\
             x_total{kind=\"b\"} 2\n# HELP y A gauge.\n# TYPE y gauge\ny{a=\"q\\\"\"} 2.5\n"
        );
    }
}
