//! `oam bench`: bounded, scripted load against nodes' HTTP data plane, measured with an HDR
//! histogram. Every run stops by itself: a fixed request count, and optionally a deadline.

use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What to send, how much, how fast.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub urls: Vec<String>,
    pub requests: usize,
    pub concurrency: usize,
    /// Requests per second across all workers; `None` is as fast as they go.
    pub rate_per_s: Option<f64>,
    /// Stop starting new requests after this long.
    pub max_duration_ms: Option<u64>,
    pub agent: String,
    pub task: String,
    pub risk: String,
    pub priority: String,
    pub seed: u64,
    pub timeout_ms: u64,
}

/// One finished request.
#[derive(Clone, Debug)]
pub struct Sample {
    pub latency_us: u64,
    /// HTTP status, or 0 for a transport error.
    pub status: u16,
    pub phase: String,
    pub provider: String,
    pub reasons: Vec<String>,
}

/// Everything measured, as written by `--json`.
#[derive(Serialize, Debug)]
pub struct Report {
    pub version: &'static str,
    pub plan: Plan,
    pub sent: usize,
    pub succeeded: usize,
    pub success_rate: f64,
    pub elapsed_s: f64,
    pub throughput_per_s: f64,
    pub latency_ms: Percentiles,
    pub statuses: BTreeMap<String, usize>,
    pub phases: BTreeMap<String, usize>,
    pub providers: BTreeMap<String, usize>,
    pub reason_codes: BTreeMap<String, usize>,
}

#[derive(Serialize, Debug, Default)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

/// The body of request `i`: distinct content per request so loop detection sees new calls.
pub fn body(plan: &Plan, i: usize) -> Value {
    json!({
        "model": "auto",
        "messages": [{"role": "user", "content": format!("oam bench request {i} (seed {})", plan.seed)}],
        "oam": {
            "agent": plan.agent,
            "task": plan.task,
            "risk": plan.risk,
            "priority": plan.priority,
            "request_id": format!("bench-{}-{i}", plan.seed),
        },
    })
}

async fn one(http: &reqwest::Client, url: &str, body: &Value, timeout: Duration) -> Sample {
    let started = Instant::now();
    let result = http
        .post(format!("{}/v1/chat/completions", url.trim_end_matches('/')))
        .timeout(timeout)
        .json(body)
        .send()
        .await;
    let mut s = Sample {
        latency_us: 0,
        status: 0,
        phase: "transport_error".into(),
        provider: String::new(),
        reasons: Vec::new(),
    };
    if let Ok(resp) = result {
        let h = resp.headers();
        let get = |n: &str| {
            h.get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        s.status = resp.status().as_u16();
        s.phase = get("x-oam-phase");
        s.provider = get("x-oam-provider");
        s.reasons = get("x-oam-reasons")
            .split(',')
            .filter(|r| !r.is_empty())
            .map(String::from)
            .collect();
        // Read the body: the request is done when the answer has arrived, not the headers.
        if resp.bytes().await.is_err() {
            s.status = 0;
            s.phase = "transport_error".into();
        }
    }
    s.latency_us = started.elapsed().as_micros() as u64;
    s
}

/// Run `plan`; `progress` is called once per finished request.
pub async fn run(
    plan: Plan,
    http: reqwest::Client,
    progress: impl Fn() + Send + Sync + 'static,
) -> Report {
    let next = Arc::new(AtomicUsize::new(0));
    let samples = Arc::new(Mutex::new(Vec::with_capacity(plan.requests)));
    let progress = Arc::new(progress);
    let started = Instant::now();
    let deadline = plan
        .max_duration_ms
        .map(|ms| started + Duration::from_millis(ms));
    let timeout = Duration::from_millis(plan.timeout_ms);
    let plan_arc = Arc::new(plan);
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..plan_arc.concurrency.max(1) {
        let (next, samples, progress, http, plan) = (
            next.clone(),
            samples.clone(),
            progress.clone(),
            http.clone(),
            plan_arc.clone(),
        );
        workers.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= plan.requests || deadline.is_some_and(|d| Instant::now() >= d) {
                    return;
                }
                if let Some(rate) = plan.rate_per_s {
                    let at = started + Duration::from_secs_f64(i as f64 / rate);
                    tokio::time::sleep_until(at.into()).await;
                }
                let url = &plan.urls[i % plan.urls.len()];
                let s = one(&http, url, &body(&plan, i), timeout).await;
                samples.lock().unwrap_or_else(|e| e.into_inner()).push(s);
                progress();
            }
        });
    }
    while workers.join_next().await.is_some() {}
    let elapsed = started.elapsed();
    let plan = Arc::try_unwrap(plan_arc).unwrap_or_else(|a| (*a).clone());
    let samples = std::mem::take(&mut *samples.lock().unwrap_or_else(|e| e.into_inner()));
    summarize(plan, &samples, elapsed)
}

pub fn summarize(plan: Plan, samples: &[Sample], elapsed: Duration) -> Report {
    let mut hist = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3)
        .expect("static histogram bounds are valid");
    let mut statuses = BTreeMap::new();
    let mut phases = BTreeMap::new();
    let mut providers = BTreeMap::new();
    let mut reasons = BTreeMap::new();
    let mut succeeded = 0;
    for s in samples {
        let _ = hist.record(s.latency_us.max(1));
        *statuses.entry(s.status.to_string()).or_insert(0) += 1;
        *phases.entry(s.phase.clone()).or_insert(0) += 1;
        if !s.provider.is_empty() {
            *providers.entry(s.provider.clone()).or_insert(0) += 1;
        }
        for r in &s.reasons {
            *reasons.entry(r.clone()).or_insert(0) += 1;
        }
        if s.status == 200 {
            succeeded += 1;
        }
    }
    let ms = |us: u64| us as f64 / 1_000.0;
    let latency_ms = if samples.is_empty() {
        Percentiles::default()
    } else {
        Percentiles {
            p50: ms(hist.value_at_quantile(0.50)),
            p95: ms(hist.value_at_quantile(0.95)),
            p99: ms(hist.value_at_quantile(0.99)),
            max: ms(hist.max()),
            mean: hist.mean() / 1_000.0,
        }
    };
    let secs = elapsed.as_secs_f64();
    Report {
        version: env!("CARGO_PKG_VERSION"),
        sent: samples.len(),
        succeeded,
        success_rate: if samples.is_empty() {
            0.0
        } else {
            succeeded as f64 / samples.len() as f64
        },
        elapsed_s: secs,
        throughput_per_s: if secs > 0.0 {
            samples.len() as f64 / secs
        } else {
            0.0
        },
        latency_ms,
        statuses,
        phases,
        providers,
        reason_codes: reasons,
        plan,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Plan {
        Plan {
            urls: vec!["http://x".into()],
            requests: 4,
            concurrency: 2,
            rate_per_s: None,
            max_duration_ms: None,
            agent: "a".into(),
            task: "t".into(),
            risk: "low".into(),
            priority: "normal".into(),
            seed: 1,
            timeout_ms: 1_000,
        }
    }

    fn sample(ms: u64, status: u16, provider: &str) -> Sample {
        Sample {
            latency_us: ms * 1_000,
            status,
            phase: if status == 200 {
                "accepted"
            } else {
                "admission"
            }
            .into(),
            provider: provider.into(),
            reasons: vec!["ROUTING_SELECTED".into()],
        }
    }

    #[test]
    fn summary_counts_and_percentiles() {
        let samples: Vec<Sample> = (1..=100)
            .map(|i| {
                sample(
                    i,
                    if i <= 90 { 200 } else { 503 },
                    if i % 2 == 0 { "local" } else { "primary" },
                )
            })
            .collect();
        let r = summarize(plan(), &samples, Duration::from_secs(2));
        assert_eq!((r.sent, r.succeeded), (100, 90));
        assert!((r.success_rate - 0.9).abs() < 1e-12);
        assert!((r.throughput_per_s - 50.0).abs() < 1e-9);
        assert!((r.latency_ms.p50 - 50.0).abs() < 0.1, "{:?}", r.latency_ms);
        assert!((r.latency_ms.p95 - 95.0).abs() < 0.1);
        assert_eq!(r.statuses["503"], 10);
        assert_eq!(r.providers["local"], 50);
        assert_eq!(r.reason_codes["ROUTING_SELECTED"], 100);
    }

    #[test]
    fn bodies_are_distinct_per_request() {
        assert_ne!(body(&plan(), 1), body(&plan(), 2));
        assert_eq!(body(&plan(), 1)["oam"]["agent"], "a");
    }
}
