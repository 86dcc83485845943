//! The load engine: bounded, scripted load against nodes' HTTP data plane, measured with an HDR
//! histogram. Every run stops by itself: a fixed request count, and optionally a deadline.

use crate::core::request::{Priority, Risk};
use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// What to send, how much, how fast.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct LoadPlan {
    pub urls: Vec<String>,
    pub requests: usize,
    pub concurrency: usize,
    /// Requests per second across all workers; `None` is as fast as they go.
    pub rate_per_s: Option<f64>,
    /// Stop starting new requests after this long.
    pub max_duration_ms: Option<u64>,
    pub agent: String,
    /// The model every request asks for when there is no mix.
    pub model: String,
    pub task: String,
    pub risk: Risk,
    pub priority: Priority,
    pub seed: u64,
    pub timeout_ms: u64,
    /// Request kinds chosen per request by weight; empty means the one kind above.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mix: Vec<super::scenario::Mix>,
    /// Streamed answers, as plain text (no contract holds them back).
    #[serde(default)]
    pub stream: bool,
}

impl LoadPlan {
    /// The kind of request `i` (deterministic for a seed).
    pub(crate) fn kind(&self, i: usize) -> super::scenario::Mix {
        let total: u64 = self.mix.iter().map(|m| u64::from(m.weight)).sum();
        if total == 0 {
            return super::scenario::Mix {
                weight: 1,
                risk: self.risk,
                priority: self.priority,
                agent: self.agent.clone(),
                task: self.task.clone(),
                max_tokens: None,
                api: Default::default(),
                model: self.model.clone(),
            };
        }
        let mut x =
            xxhash_rust::xxh3::xxh3_64_with_seed(&(i as u64).to_le_bytes(), self.seed) % total;
        for m in &self.mix {
            if x < u64::from(m.weight) {
                return m.clone();
            }
            x -= u64::from(m.weight);
        }
        self.mix[0].clone()
    }
}

/// Where the requests go.
#[derive(Clone)]
pub(crate) enum Through {
    /// The nodes' HTTP data plane (`plan.urls`), round-robin; a node that refuses the connection
    /// is skipped for the next one, as a load balancer would.
    Http(reqwest::Client),
    /// The nodes' NATS data plane (`oam.v1.request`, a queue group across nodes).
    Nats(Arc<crate::transport::ask::Asker>),
    /// Mesh calls to an agent, with fail-fast semantics.
    Agent {
        caller: Arc<crate::mesh::client::Caller>,
        agent: String,
    },
}

/// One finished request.
#[derive(Clone, Debug)]
pub(crate) struct Measurement {
    /// When it started, since the run began.
    pub started_us: u64,
    pub latency_us: u64,
    /// HTTP status, or 0 for a transport error.
    pub status: u16,
    pub phase: String,
    pub provider: String,
    pub reasons: Vec<String>,
    pub priority: Priority,
    /// A mesh call's error code (agent calls only).
    pub error: Option<String>,
    /// A streamed answer: when its first bytes arrived, since it was sent.
    pub first_byte_us: Option<u64>,
}

/// Everything measured, as written by `--json`.
#[derive(Serialize, Debug)]
pub(crate) struct Report {
    pub version: &'static str,
    pub plan: LoadPlan,
    pub sent: usize,
    pub succeeded: usize,
    pub success_rate: f64,
    pub elapsed_s: f64,
    pub throughput_per_s: f64,
    pub latency_ms: Percentiles,
    /// Streamed answers: time to the first bytes of the answer (the first token).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<Percentiles>,
    pub statuses: BTreeMap<String, usize>,
    pub phases: BTreeMap<String, usize>,
    pub providers: BTreeMap<String, usize>,
    pub reason_codes: BTreeMap<String, usize>,
    /// Mesh error codes of failed agent calls (e.g. agent_died, not_found).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub errors: BTreeMap<String, usize>,
    /// Requests that did not get a 200.
    pub failed: usize,
    /// Why they failed: `refused`, `timeout`, `transport`, `cut` (the answer broke off), a mesh
    /// error code, or `http STATUS REASON` (the last reason code the answer carried).
    pub failures: BTreeMap<String, usize>,
    /// The run was stopped early (Ctrl-C, SIGTERM): this covers the requests that finished.
    pub interrupted: bool,
}

#[derive(Serialize, Debug, Default)]
pub(crate) struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

/// The body of request `i` of kind `k`: distinct content per request so loop detection sees
/// new calls.
fn body_of(plan: &LoadPlan, i: usize, k: &super::scenario::Mix) -> Value {
    use super::scenario::Surface;
    let text = format!("oam bench request {i} (seed {})", plan.seed);
    let oam = json!({
        "agent": k.agent,
        "task": k.task,
        "risk": k.risk,
        "priority": k.priority,
        "request_id": format!("bench-{}-{}-{i}", plan.seed, crate::ids::run_token()),
    });
    let mut body = match k.api {
        Surface::Chat | Surface::Messages => json!({"model": k.model,
            "messages": [{"role": "user", "content": text}], "oam": oam}),
        Surface::Responses | Surface::Embeddings => {
            json!({"model": k.model, "input": text, "oam": oam})
        }
        // A distinct order each time, as for the texts above.
        Surface::Mcp => {
            let order = format!("o-{}-{i}", plan.seed);
            return json!({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                "params": {"name": k.model, "arguments": {"order": order}}});
        }
    };
    match (k.api, k.max_tokens) {
        (Surface::Embeddings, _) => {}
        (Surface::Responses, Some(n)) => body["max_output_tokens"] = json!(n),
        // Messages asks for max_tokens always.
        (Surface::Messages, n) => body["max_tokens"] = json!(n.unwrap_or(256)),
        (_, Some(n)) => body["max_tokens"] = json!(n),
        (_, None) => {}
    }
    if plan.stream {
        body["stream"] = json!(true);
        body["response_format"] = json!({"type": "text"});
    }
    body
}

fn empty_sample() -> Measurement {
    Measurement {
        started_us: 0,
        latency_us: 0,
        status: 0,
        phase: "transport_error".into(),
        provider: String::new(),
        reasons: Vec::new(),
        priority: Priority::Normal,
        error: None,
        first_byte_us: None,
    }
}

/// Why a request that did not get a 200 failed, in a word or two.
fn failure_of(s: &Measurement) -> String {
    match (&s.error, s.status) {
        (Some(e), _) => e.clone(),
        (None, 0) => "transport".into(),
        (None, status) => match s.reasons.last() {
            Some(code) => format!("http {status} {code}"),
            None => format!("http {status}"),
        },
    }
}

/// What kind of transport failure a request error is.
fn transport_failure(e: &reqwest::Error) -> &'static str {
    if e.is_connect() {
        "refused"
    } else if e.is_timeout() {
        "timeout"
    } else {
        "transport"
    }
}

/// Request `i` over HTTP to `urls[i % n]`, moving on to the next node when one refuses the
/// connection.
async fn one_http(
    http: &reqwest::Client,
    urls: &[String],
    i: usize,
    (path, body): (&str, &Value),
    timeout: Duration,
) -> Measurement {
    let started = Instant::now();
    let mut result = None;
    for k in 0..urls.len() {
        let url = &urls[(i + k) % urls.len()];
        let r = http
            .post(format!("{}{path}", url.trim_end_matches('/')))
            .timeout(timeout.saturating_sub(started.elapsed()))
            .json(body)
            .send()
            .await;
        let refused = matches!(&r, Err(e) if e.is_connect());
        result = Some(r);
        if !refused {
            break;
        }
    }
    let mut s = empty_sample();
    let Some(result) = result else {
        return s;
    };
    match result {
        Err(e) => s.error = Some(transport_failure(&e).into()),
        Ok(resp) => {
            let h = resp.headers();
            let get = |n: &str| {
                h.get(n)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string()
            };
            s.status = resp.status().as_u16();
            s.phase = get("x-oam-phase");
            s.provider = get("x-oam-target");
            s.reasons = get("x-oam-reasons")
                .split(',')
                .filter(|r| !r.is_empty())
                .map(String::from)
                .collect();
            let streamed = get("content-type").starts_with("text/event-stream");
            // Read the body: the request is done when the answer has arrived, not the headers.
            let body = if streamed {
                read_chunks(resp, started, &mut s).await
            } else {
                resp.bytes().await.map(|b| b.to_vec())
            };
            match body {
                Err(e) => {
                    s.status = 0;
                    s.phase = "transport_error".into();
                    s.error = Some(if e.is_timeout() { "timeout" } else { "cut" }.into());
                }
                Ok(body) if streamed => read_stream(&mut s, &body),
                Ok(body) if path == "/mcp" => read_tool_result(&mut s, &body),
                Ok(_) => {}
            }
        }
    }
    s.latency_us = started.elapsed().as_micros() as u64;
    s
}

/// A streamed body as it arrives, noting when its first bytes came.
async fn read_chunks(
    mut resp: reqwest::Response,
    started: Instant,
    s: &mut Measurement,
) -> Result<Vec<u8>, reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        if s.first_byte_us.is_none() && !chunk.is_empty() {
            s.first_byte_us = Some(started.elapsed().as_micros() as u64);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// A streamed answer's verdict: answered only if it ended with `[DONE]`; its `oam` object (on
/// the last chunk, or on an in-band error event) says how it was decided.
fn read_stream(s: &mut Measurement, body: &[u8]) {
    let mut parser = crate::http::sse::Parser::default();
    let events = parser.feed(body).unwrap_or_default();
    let oam = events
        .iter()
        .rev()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find_map(|v| {
            let error = v["error"]["code"].as_str().map(String::from);
            v.get("oam").cloned().map(|o| (o, error))
        });
    if let Some((oam, error)) = oam {
        s.phase = oam["phase"].as_str().unwrap_or("").to_string();
        s.provider = oam["target"].as_str().unwrap_or("").to_string();
        s.reasons = oam["reason_codes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r.as_str().map(String::from))
            .collect();
        if let Some(code) = error {
            s.status = 0;
            s.error = Some(format!("stream error {code}"));
            return;
        }
    }
    if events.last().map(String::as_str) != Some("[DONE]") {
        s.status = 0;
        s.error = Some("cut".into());
    }
}

/// A tool call's verdict: answered only if its result is not an error (a refusal of oam is a
/// result with `isError`, under HTTP 200, as MCP has it).
fn read_tool_result(s: &mut Measurement, body: &[u8]) {
    let v: Value = serde_json::from_slice(body).unwrap_or_default();
    if v["result"]["isError"] == true || v.get("result").is_none() {
        s.status = 0;
        let last = s
            .reasons
            .last()
            .cloned()
            .unwrap_or_else(|| "isError".into());
        s.error = Some(format!("tool error {last}"));
    }
}

/// Request `i` on the NATS data plane; the reply carries the status and the `oam` object.
async fn one_nats(
    asker: &crate::transport::ask::Asker,
    body: &Value,
    timeout: Duration,
) -> Measurement {
    use crate::transport::{ask::AskError, subjects};
    let started = Instant::now();
    let mut s = empty_sample();
    let payload = serde_json::to_vec(body).unwrap_or_default();
    let (tag, subject) = (subjects::ANSWERER_NODES, subjects::REQUEST.to_string());
    let asked = asker.ask(tag, subject, Default::default(), payload.into(), timeout);
    let reply = match asked.await {
        Err(AskError::TimedOut) => Err("timeout"),
        Err(AskError::NoResponders) => Err("no_responders"),
        Err(AskError::Failed(_)) => Err("transport"),
        Ok(reply) => Ok(reply),
    };
    let reply = match reply {
        Ok(r) => r,
        Err(kind) => {
            s.error = Some(kind.into());
            s.latency_us = started.elapsed().as_micros() as u64;
            return s;
        }
    };
    if let Ok(v) = serde_json::from_slice::<Value>(&reply.payload) {
        let oam = &v["oam"];
        s.status = v["status"].as_u64().unwrap_or(0) as u16;
        s.phase = oam["phase"].as_str().unwrap_or("").to_string();
        s.provider = oam["target"].as_str().unwrap_or("").to_string();
        s.reasons = oam["reason_codes"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|r| r.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
    }
    s.latency_us = started.elapsed().as_micros() as u64;
    s
}

/// Call `i` to an agent on the mesh: success, or the mesh error's code.
async fn one_agent(
    caller: &crate::mesh::client::Caller,
    agent: &str,
    i: usize,
    timeout: Duration,
) -> Measurement {
    let started = Instant::now();
    let payload = format!("{{\"bench\": {i}}}");
    let mut s = empty_sample();
    match caller.call(agent, payload.into(), timeout).await {
        Ok(_) => {
            s.status = 200;
            s.phase = "accepted".into();
            s.provider = agent.to_string();
        }
        Err(e) => {
            s.status = 503;
            s.phase = "agent".into();
            s.error = Some(e.code.as_str().to_string());
        }
    }
    s.latency_us = started.elapsed().as_micros() as u64;
    s
}

/// Run `plan`; `progress` is called once per finished request. Cancelling `stop` ends the run
/// early: nothing new starts, requests under way are abandoned, and the report (marked
/// `interrupted`) holds what finished.
pub(crate) async fn run(
    plan: LoadPlan,
    target: Through,
    stop: &CancellationToken,
    progress: impl Fn() + Send + Sync + 'static,
) -> Report {
    let (samples, elapsed, plan) = run_samples(plan, target, Instant::now(), stop, progress).await;
    let mut report = summarize(plan, &samples, elapsed);
    report.interrupted = stop.is_cancelled();
    report
}

/// Run `plan` from `started` (now, or a moment just past on the caller's clock: sample times
/// and the rate schedule count from it) and return every sample (for scenarios, which look at
/// them over time).
pub(crate) async fn run_samples(
    plan: LoadPlan,
    target: Through,
    started: Instant,
    stop: &CancellationToken,
    progress: impl Fn() + Send + Sync + 'static,
) -> (Vec<Measurement>, Duration, LoadPlan) {
    let next = Arc::new(AtomicUsize::new(0));
    let samples = Arc::new(Mutex::new(Vec::with_capacity(plan.requests.min(100_000))));
    let progress = Arc::new(progress);
    let deadline = plan
        .max_duration_ms
        .map(|ms| started + Duration::from_millis(ms));
    let timeout = Duration::from_millis(plan.timeout_ms);
    let plan_arc = Arc::new(plan);
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..plan_arc.concurrency.max(1) {
        let (next, samples, progress, target, plan, stop) = (
            next.clone(),
            samples.clone(),
            progress.clone(),
            target.clone(),
            plan_arc.clone(),
            stop.clone(),
        );
        workers.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= plan.requests
                    || deadline.is_some_and(|d| Instant::now() >= d)
                    || stop.is_cancelled()
                {
                    return;
                }
                if let Some(rate) = plan.rate_per_s {
                    // A schedule beyond any clock (a rate of 1e-300) sends nothing more; the
                    // command checks rates first, so this is a last guard, not a path.
                    let Some(at) = Duration::try_from_secs_f64(i as f64 / rate)
                        .ok()
                        .and_then(|d| started.checked_add(d))
                    else {
                        return;
                    };
                    if deadline.is_some_and(|d| at >= d) {
                        return; // due after the run's deadline: never sent
                    }
                    tokio::select! {
                        () = tokio::time::sleep_until(at.into()) => {}
                        () = stop.cancelled() => return,
                    }
                }
                let began = started.elapsed();
                let kind = plan.kind(i);
                let one = async {
                    match &target {
                        Through::Http(http) => {
                            let body = body_of(&plan, i, &kind);
                            let sent = (kind.api.path(), &body);
                            one_http(http, &plan.urls, i, sent, timeout).await
                        }
                        Through::Nats(nats) => {
                            one_nats(nats, &body_of(&plan, i, &kind), timeout).await
                        }
                        Through::Agent { caller, agent } => {
                            one_agent(caller, agent, i, timeout).await
                        }
                    }
                };
                let mut s = tokio::select! {
                    s = one => s,
                    () = stop.cancelled() => return,
                };
                s.started_us = began.as_micros() as u64;
                s.priority = kind.priority;
                samples
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(s);
                progress();
            }
        });
    }
    while workers.join_next().await.is_some() {}
    let elapsed = started.elapsed();
    let plan = Arc::try_unwrap(plan_arc).unwrap_or_else(|a| (*a).clone());
    let samples = std::mem::take(
        &mut *samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    (samples, elapsed, plan)
}

fn percentiles(h: &Histogram<u64>) -> Percentiles {
    let ms = |us: u64| us as f64 / 1_000.0;
    Percentiles {
        p50: ms(h.value_at_quantile(0.50)),
        p95: ms(h.value_at_quantile(0.95)),
        p99: ms(h.value_at_quantile(0.99)),
        max: ms(h.max()),
        mean: h.mean() / 1_000.0,
    }
}

pub(crate) fn summarize(plan: LoadPlan, samples: &[Measurement], elapsed: Duration) -> Report {
    #[expect(
        clippy::expect_used,
        reason = "constant bounds, exercised by every test that summarizes"
    )]
    let mut hist = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3)
        .expect("static histogram bounds are valid");
    let mut statuses = BTreeMap::new();
    let mut phases = BTreeMap::new();
    let mut providers = BTreeMap::new();
    let mut reasons = BTreeMap::new();
    let mut errors = BTreeMap::new();
    let mut failures = BTreeMap::new();
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
        if let Some(e) = &s.error {
            *errors.entry(e.clone()).or_insert(0) += 1;
        }
        if s.status == 200 {
            succeeded += 1;
        } else {
            *failures.entry(failure_of(s)).or_insert(0) += 1;
        }
    }
    let latency_ms = if samples.is_empty() {
        Percentiles::default()
    } else {
        percentiles(&hist)
    };
    let firsts = samples.iter().filter_map(|s| s.first_byte_us);
    let ttft_ms = (firsts.clone().count() > 0).then(|| {
        let mut h = hist.clone();
        h.reset();
        for us in firsts {
            let _ = h.record(us.max(1));
        }
        percentiles(&h)
    });
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
        ttft_ms,
        statuses,
        phases,
        providers,
        reason_codes: reasons,
        errors,
        failed: samples.len() - succeeded,
        failures,
        interrupted: false,
        plan,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> LoadPlan {
        LoadPlan {
            urls: vec!["http://x".into()],
            requests: 4,
            concurrency: 2,
            rate_per_s: None,
            max_duration_ms: None,
            agent: "a".into(),
            model: "auto".into(),
            task: "t".into(),
            risk: Risk::Low,
            priority: Priority::Normal,
            seed: 1,
            timeout_ms: 1_000,
            mix: Vec::new(),
            stream: false,
        }
    }

    fn sample(ms: u64, status: u16, provider: &str) -> Measurement {
        Measurement {
            started_us: 0,
            priority: Priority::Normal,
            error: None,
            latency_us: ms * 1_000,
            first_byte_us: None,
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
        let samples: Vec<Measurement> = (1..=100)
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
    fn streams_report_their_first_token_and_only_a_done_stream_is_answered() {
        let mut samples: Vec<Measurement> = (1..=10)
            .map(|i| Measurement {
                first_byte_us: Some(i * 1_000),
                ..sample(100, 200, "local")
            })
            .collect();
        let r = summarize(plan(), &samples, Duration::from_secs(1));
        let f = r.ttft_ms.expect("streams give a first-token figure");
        assert!(
            (f.p50 - 5.0).abs() < 0.1 && (f.max - 10.0).abs() < 0.1,
            "{f:?}"
        );
        samples.iter_mut().for_each(|s| s.first_byte_us = None);
        assert!(
            summarize(plan(), &samples, Duration::from_secs(1))
                .ttft_ms
                .is_none()
        );

        let oam = r#"{"choices":[],"oam":{"phase":"accepted","target":"local","reason_codes":["ACCEPTED"]}}"#;
        let done = format!("data: {{\"choices\":[]}}\n\ndata: {oam}\n\ndata: [DONE]\n\n");
        let mut s = sample(1, 200, "");
        read_stream(&mut s, done.as_bytes());
        assert_eq!((s.status, s.provider.as_str()), (200, "local"));
        let mut s = sample(1, 200, "");
        read_stream(&mut s, b"data: {\"choices\":[]}\n\n");
        assert_eq!((s.status, s.error.as_deref()), (0, Some("cut")));
        let error =
            r#"data: {"error":{"code":"STREAM_ENDED_WITH_ERROR"},"oam":{"phase":"generation"}}"#;
        let mut s = sample(1, 200, "");
        read_stream(&mut s, format!("{error}\n\n").as_bytes());
        assert_eq!(s.status, 0);
        assert_eq!(
            s.error.as_deref(),
            Some("stream error STREAM_ENDED_WITH_ERROR")
        );
        assert_eq!(s.phase, "generation");
    }

    #[test]
    fn bodies_are_distinct_per_request() {
        let body = |i| body_of(&plan(), i, &plan().kind(i));
        assert_ne!(body(1), body(2));
        assert_eq!(body(1)["oam"]["agent"], "a");
    }
}
