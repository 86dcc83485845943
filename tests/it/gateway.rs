//! oam as a gateway in front of a real upstream (the simulator over HTTP): model routes with
//! fallback chains, per-model health, contracts by choice, and errors handled by their class,
//! through OpenAI's chat completions and what every API shares. The other client APIs have a
//! file each (`messages`, `responses`, `embeddings`) on the `Gateway` fixture kept here.

use crate::support::{NatsServer, Proc};
use oam::core::breaker::Breaker;
use oam::core::health::Verdict;
use oam::core::wire::ProviderSnapshot;
use serde_json::{Value, json};
use std::time::Duration;

pub(crate) struct Gateway {
    pub(crate) url: String,
    pub(crate) sim_url: String,
    pub(crate) _node: GatewayNode,
    pub(crate) _sim: Proc,
    pub(crate) _nats: NatsServer,
    pub(crate) dir: std::path::PathBuf,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The node under test: in this process (the default), or `oam node run` where a test kills
/// it, measures its memory, or gives it an environment of its own.
pub(crate) enum GatewayNode {
    /// Kept for its drop, which stops it.
    InProcess {
        _node: crate::support::InProcessNode,
    },
    Process(Proc),
}

impl GatewayNode {
    pub(crate) fn in_process(&self) -> &oam::node::Node {
        match self {
            GatewayNode::InProcess { _node } => &_node.node,
            GatewayNode::Process(_) => panic!("this test reads the node in this process"),
        }
    }

    pub(crate) fn process(&mut self) -> &mut Proc {
        match self {
            GatewayNode::Process(p) => p,
            GatewayNode::InProcess { .. } => panic!("this test needs gateway_process"),
        }
    }
}

/// One node on a configuration with two models on the simulator's `primary` (routes `big`, with
/// `secondary` as its fallback, and `small`), and no contract; `extra` adds to it.
pub(crate) async fn gateway(tag: &str) -> Gateway {
    gateway_with(tag, "").await
}

pub(crate) async fn gateway_with(tag: &str, extra: &str) -> Gateway {
    gateway_with_env(tag, extra, &[]).await
}

pub(crate) async fn gateway_with_env(tag: &str, extra: &str, env: &[(&str, &str)]) -> Gateway {
    gateway_on(tag, "", extra, env, NatsServer::start().await).await
}

/// `gateway_with_env` with `node` added to the `[node]` section, on the server `nats`; the
/// node runs in this process unless it needs an environment of its own.
pub(crate) async fn gateway_on(
    tag: &str,
    node: &str,
    extra: &str,
    env: &[(&str, &str)],
    nats: NatsServer,
) -> Gateway {
    gateway_built(tag, node, extra, env, nats, !env.is_empty(), None).await
}

/// `gateway_on` with the node as a process of its own (`oam node run`).
pub(crate) async fn gateway_process(
    tag: &str,
    node: &str,
    extra: &str,
    nats: NatsServer,
) -> Gateway {
    gateway_built(tag, node, extra, &[], nats, true, None).await
}

pub(crate) async fn gateway_built(
    tag: &str,
    node: &str,
    extra: &str,
    env: &[(&str, &str)],
    nats: NatsServer,
    process: bool,
    open_files: Option<u32>,
) -> Gateway {
    let sim = Proc::spawn(&["sim", "--listen", "127.0.0.1:0", "--json"]);
    let sim_url = sim.ready["url"].as_str().unwrap().to_string();
    let dir = std::env::temp_dir().join(format!("oam-gw-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("oam.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"[node]
cluster_size = 1
{node}

[[provider]]
id = "primary"
base_url = "{sim_url}/primary/v1"
models = ["big", "small"]
cost_per_1k_tokens_usd = 0.01
probe = "off"

[[provider]]
id = "secondary"
base_url = "{sim_url}/secondary/v1"
model = "medium"
probe = "off"

[[route]]
model = "big"
targets = ["primary/big", "secondary/medium"]

[[route]]
model = "small"
targets = ["primary/small"]
{}"#,
            extra.replace("SIM", &sim_url)
        ),
    )
    .unwrap();
    let nats_url = nats.url();
    let (node, url) = if process {
        let args = crate::support::node_args("n1", &nats_url, &["--config", cfg.to_str().unwrap()]);
        let node = match open_files {
            Some(files) => Proc::spawn_with_hard_file_limit(files, &args),
            None => Proc::spawn_with_env(&args, env),
        };
        let url = node.ready["http"].as_str().unwrap().to_string();
        (GatewayNode::Process(node), url)
    } else {
        let node = crate::support::InProcessNode::start("n1", &cfg, &nats_url);
        let url = node.url.clone();
        (GatewayNode::InProcess { _node: node }, url)
    };
    Gateway {
        url,
        sim_url,
        _node: node,
        _sim: sim,
        _nats: nats,
        dir,
    }
}

pub(crate) fn client() -> reqwest::Client {
    crate::support::http(Duration::from_secs(20))
}

impl Gateway {
    pub(crate) async fn ask(&self, model: &str, q: &str) -> (u16, Value) {
        self.post(json!({"model": model, "messages": [{"role": "user", "content": q}]}))
            .await
    }

    /// A chat completion request of `body`: its status and JSON answer.
    pub(crate) async fn post(&self, body: Value) -> (u16, Value) {
        let r = client()
            .post(format!("{}/v1/chat/completions", self.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    /// `GET path` on the node, as JSON.
    pub(crate) async fn get(&self, path: &str) -> Value {
        let r = client().get(format!("{}{path}", self.url)).send().await;
        r.unwrap().json().await.unwrap()
    }

    pub(crate) async fn fault(&self, on: &str, mode: Value) {
        let mut body = mode;
        body["provider"] = json!(on);
        body["duration_ms"] = json!(60_000);
        let r = client()
            .post(format!("{}/sim/faults", self.sim_url))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201, "{:?}", r.text().await);
    }

    pub(crate) async fn clear(&self) {
        client()
            .delete(format!("{}/sim/faults", self.sim_url))
            .send()
            .await
            .unwrap();
    }

    pub(crate) async fn received(&self, provider: &str) -> Vec<Value> {
        let r = client()
            .get(format!("{}/sim/requests/{provider}", self.sim_url))
            .send()
            .await
            .unwrap();
        r.json::<Vec<Value>>().await.unwrap_or_default()
    }

    /// `oam explain --json` of the request `answer` answered, once it is in the log (written
    /// off the request's path).
    pub(crate) async fn explain(&self, answer: &Value) -> Value {
        let id = answer["oam"]["request_id"].as_str().unwrap().to_string();
        let nats_url = self._nats.url();
        crate::support::eventually(Duration::from_secs(10), || async {
            let out = assert_cmd::Command::cargo_bin("oam")
                .unwrap()
                .args(["explain", &id, "--json", "--nats-url", &nats_url])
                .output()
                .ok()?;
            serde_json::from_slice::<Value>(&out.stdout).ok()
        })
        .await
        .expect("the decision is in the log")
    }

    pub(crate) async fn target(&self, id: &str) -> ProviderSnapshot {
        let s = oam::local::cluster::snapshot(&client(), &self.url)
            .await
            .unwrap();
        s.provider(id).unwrap().clone()
    }
}

pub(crate) fn codes(v: &Value) -> Vec<String> {
    v["oam"]["reason_codes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_string())
        .collect()
}

pub(crate) fn tried(v: &Value) -> Vec<String> {
    v["oam"]["tried"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["target"].as_str().unwrap().to_string())
        .collect()
}

/// Routes serve their targets in order; one model's failures leave its sibling on the same host
/// alone; a prose answer is a good answer without a contract.
#[tokio::test]
async fn routes_fall_back_along_their_chain_and_keep_health_per_model() {
    let g = gateway("routes").await;
    let models = g.get("/v1/models").await;
    let listed: Vec<(&str, Vec<&str>)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let targets = m["oam"]["targets"].as_array().unwrap();
            (
                m["id"].as_str().unwrap(),
                targets.iter().map(|t| t.as_str().unwrap()).collect(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [
            ("big", vec!["primary/big", "secondary"]),
            ("small", vec!["primary/small"]),
            ("auto", vec!["primary/big", "primary/small", "secondary"]),
        ]
    );

    // The route's first target, with the upstream's model name.
    let (status, v) = g.ask("big", "first").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["oam"]["route"], "big");
    assert_eq!(v["oam"]["target"], "primary/big");
    assert_eq!(v["model"], "big", "the upstream's own answer, its model");
    let sent = g.received("primary").await;
    assert_eq!(sent.last().unwrap()["model"], "big");

    // An unknown model is not found (404, as the vendors answer, which their SDKs do not
    // retry), naming what is served.
    let (status, v) = g.ask("gpt-5", "who?").await;
    assert_eq!(status, 404);
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("big, small"), "{msg}");

    // Prose is a good answer when no contract is asked for.
    g.fault(
        "primary/small",
        json!({"mode": "contract", "kind": "not-json"}),
    )
    .await;
    let (status, v) = g.ask("small", "say it in words").await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.starts_with("Sure!"), "{content}");
    g.clear().await;

    // primary/big fails hard: `big` moves to secondary, and primary/small stays in use, its
    // breaker closed.
    g.fault("primary/big", json!({"mode": "error"})).await;
    for i in 0..6 {
        let (status, v) = g.ask("big", &format!("outage {i}")).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["oam"]["target"], "secondary", "{v}");
    }
    // Its own window and breaker took it out of use; its sibling's are untouched.
    let (big, small) = (
        g.target("primary/big").await,
        g.target("primary/small").await,
    );
    assert!(
        big.consensus.verdict == Verdict::Unhealthy || matches!(big.breaker, Breaker::Open { .. }),
        "{big:?}"
    );
    assert_eq!(small.breaker, Breaker::default());
    assert_ne!(small.consensus.verdict, Verdict::Unhealthy, "{small:?}");
    let (status, v) = g.ask("small", "still fine").await;
    assert_eq!(
        (status, v["oam"]["target"].as_str()),
        (200, Some("primary/small"))
    );
    // Out of use: straight to the fallback, no call to the failing model.
    let before = g.received("primary").await.len();
    let (_, v) = g.ask("big", "excluded").await;
    assert_eq!(tried(&v), ["secondary"], "{v}");
    assert_eq!(g.received("primary").await.len(), before);
}

/// Each error class handled as its own: a 5xx and a short 429 retried on the same target, a
/// context-length refusal moved on, a content-policy refusal returned as it came, refused
/// credentials moved on with an operator told.
#[tokio::test]
async fn upstream_errors_are_handled_by_their_class() {
    let g = gateway("errors").await;

    // One 500: the same target again, and it answers.
    g.fault("primary/small", json!({"mode": "error", "times": 1}))
        .await;
    let (status, v) = g.ask("small", "one 500").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(tried(&v), ["primary/small", "primary/small"]);
    assert!(codes(&v).contains(&"RETRY_SAME_TARGET".to_string()));

    // A 429 whose Retry-After is short: waited for, on the same target.
    g.fault(
        "primary/small",
        json!({"mode": "rate-limit", "retry_after_ms": 300, "times": 1}),
    )
    .await;
    let started = std::time::Instant::now();
    let (status, v) = g.ask("small", "one 429").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(tried(&v), ["primary/small", "primary/small"]);
    assert!(started.elapsed() >= Duration::from_millis(300));

    // Too long for primary/big: the next target, never the same one again.
    g.fault(
        "primary/big",
        json!({"mode": "refuse", "reason": "context-length"}),
    )
    .await;
    let (status, v) = g.ask("big", "a long story").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(tried(&v), ["primary/big", "secondary"]);
    assert!(codes(&v).contains(&"CONTEXT_LENGTH_EXCEEDED".to_string()));
    g.clear().await;

    // A content-policy refusal: the upstream's own error, no retry, no fallback.
    g.fault(
        "primary/big",
        json!({"mode": "refuse", "reason": "content-policy", "times": 1}),
    )
    .await;
    let before = g.received("secondary").await.len();
    let (status, v) = g.ask("big", "something forbidden").await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "content_policy_violation", "{v}");
    assert!(codes(&v).contains(&"CONTENT_POLICY_REFUSAL".to_string()));
    assert_eq!(tried(&v), ["primary/big"]);
    assert_eq!(g.received("secondary").await.len(), before);

    // Refused credentials: the next target serves, and an operator hears of it.
    g.fault("primary/big", json!({"mode": "refuse", "reason": "auth"}))
        .await;
    let (status, v) = g.ask("big", "key rotated").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(tried(&v), ["primary/big", "secondary"]);
    let esc = &v["oam"]["escalation"];
    let last = esc["reason_codes"].as_array().unwrap().last().unwrap();
    assert_eq!(last, "ESCALATED_UPSTREAM_MISCONFIGURED", "{v}");
    // One escalation per target, not one per request.
    let (_, v) = g.ask("big", "key still rotated").await;
    assert!(v["oam"]["escalation"].is_null(), "{v}");
}

/// A streamed answer as the caller saw it: each event's data, and when it arrived (ms after
/// the request was sent); and the time the body ended.
pub(crate) struct Seen {
    pub(crate) events: Vec<(u64, String)>,
    pub(crate) ended_ms: u64,
}

impl Seen {
    pub(crate) fn data(&self) -> Vec<&str> {
        self.events.iter().map(|(_, d)| d.as_str()).collect()
    }

    pub(crate) fn text(&self) -> String {
        self.events
            .iter()
            .filter_map(|(_, d)| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| {
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(String::from)
            })
            .collect()
    }

    /// The `oam` object of the last chunk or of the error event.
    pub(crate) fn oam(&self) -> Value {
        self.events
            .iter()
            .filter_map(|(_, d)| serde_json::from_str::<Value>(d).ok())
            .find_map(|v| v.get("oam").cloned())
            .unwrap_or(Value::Null)
    }

    pub(crate) fn ended_cleanly(&self) -> bool {
        self.data().last() == Some(&"[DONE]")
    }

    pub(crate) fn error(&self) -> Option<Value> {
        self.events
            .iter()
            .filter_map(|(_, d)| serde_json::from_str::<Value>(d).ok())
            .find_map(|v| v.get("error").cloned())
    }
}

impl Gateway {
    pub(crate) async fn stream(&self, model: &str, q: &str) -> (u16, Seen) {
        self.stream_body(json!({"model": model, "stream": true,
            "messages": [{"role": "user", "content": q}]}))
            .await
    }

    pub(crate) async fn stream_body(&self, body: Value) -> (u16, Seen) {
        let sent = std::time::Instant::now();
        let mut r = client()
            .post(format!("{}/v1/chat/completions", self.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let mut parser = oam::http::sse::Parser::default();
        let mut events = Vec::new();
        while let Ok(Some(bytes)) = r.chunk().await {
            let at = sent.elapsed().as_millis() as u64;
            for e in parser.feed(&bytes).unwrap() {
                events.push((at, e));
            }
        }
        let ended_ms = sent.elapsed().as_millis() as u64;
        (status, Seen { events, ended_ms })
    }
}

pub(crate) const STREAMING: &str = r#"
[[provider]]
id = "local"
base_url = "SIM/local/v1"
model = "small-local"
prefill = true
probe = "off"

[[route]]
model = "prefill"
targets = ["primary/small", "local"]
first_token_ms = 1000
idle_ms = 400

[[route]]
model = "chain"
targets = ["primary/big", "secondary"]
first_token_ms = 1000
idle_ms = 400
"#;

pub(crate) async fn streaming(tag: &str) -> Gateway {
    gateway_with(tag, STREAMING).await
}

/// A streamed answer is relayed as it arrives: the first chunk reaches the caller well before the
/// upstream has finished, and the stream ends with oam's object and `[DONE]`.
#[tokio::test]
async fn a_stream_is_relayed_live_and_ends_cleanly() {
    let g = streaming("live").await;
    let (status, seen) = g.stream("prefill", "tell me slowly").await;
    assert_eq!(status, 200);
    assert!(seen.ended_cleanly(), "{:?}", seen.data());
    let first_ms = seen.events[0].0;
    // The simulator spreads its answer over ~10 events 15 ms apart (150 ms latency / 10).
    assert!(
        first_ms + 60 < seen.ended_ms,
        "first event at {first_ms} ms, end at {} ms: not live",
        seen.ended_ms
    );
    assert!(seen.events.len() >= 10, "{:?}", seen.data());
    let oam = seen.oam();
    assert_eq!(oam["outcome"], "accepted", "{oam}");
    assert_eq!(oam["target"], "primary/small");
    // Asked upstream as a stream, with usage (which this caller did not ask for: not relayed).
    let sent = g.received("primary").await;
    let last = sent.last().unwrap();
    assert_eq!(last["stream"], true);
    assert_eq!(last["stream_options"]["include_usage"], true);
    assert!(!seen.data().iter().any(|d| d.contains("\"usage\":{")));
}

/// Before the first byte, a failure is invisible: a slow first token, a silent start or an
/// unreadable first event move to the next target.
#[tokio::test]
async fn a_stream_that_fails_before_its_first_byte_moves_on_invisibly() {
    let g = streaming("before").await;
    for (i, mode) in [
        json!({"mode": "slow", "extra_ms": 3_000}),
        json!({"mode": "stream", "kind": "malformed", "after_chunks": 0}),
        json!({"mode": "error", "status": 503}),
    ]
    .into_iter()
    .enumerate()
    {
        g.clear().await;
        g.fault("primary/small", mode.clone()).await;
        let (status, seen) = g.stream("prefill", &format!("before {i}")).await;
        assert_eq!(status, 200, "{mode}");
        assert!(seen.ended_cleanly(), "{mode}: {:?}", seen.data());
        assert_eq!(seen.oam()["target"], "local", "{mode}: {}", seen.oam());
        assert!(seen.text().contains("local answer"), "{mode}");
        assert!(
            !seen.text().contains("primary"),
            "{mode}: nothing of the failed target"
        );
    }
}

/// After the first byte: a cut stream is continued once on a target that takes a prefill, given
/// what was delivered; with no such target it ends with an in-band error and never `[DONE]`.
/// The answer names both targets, its usage is both parts' and each part is charged, at its own
/// target's price, and settled in the shared ledger.
#[tokio::test]
async fn a_stream_cut_mid_answer_is_continued_or_ends_with_an_error() {
    let config = STREAMING.replace(
        "prefill = true\n",
        "prefill = true\ncost_per_1k_tokens_usd = 0.002\n",
    ) + "[budgets.agents.cutter]\nlimit_usd = 1.0\n";
    let g = gateway_with("cut", &config).await;
    g.fault(
        "primary/small",
        json!({"mode": "stream", "kind": "cut", "after_chunks": 4}),
    )
    .await;
    let q = "cut and continue";
    let (status, seen) = g
        .stream_body(json!({"model": "prefill", "stream": true,
            "stream_options": {"include_usage": true}, "oam": {"agent": "cutter"},
            "messages": [{"role": "user", "content": q}]}))
        .await;
    assert_eq!(status, 200);
    assert!(seen.ended_cleanly(), "{:?}", seen.data());
    let oam = seen.oam();
    let codes: Vec<&str> = oam["reason_codes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert!(codes.contains(&"STREAM_INTERRUPTED"), "{codes:?}");
    assert!(
        codes.contains(&"STREAM_CONTINUED_WITH_PREFILL"),
        "{codes:?}"
    );
    assert_eq!(oam["target"], "local");
    // The continuation was asked with what the caller already had, as an assistant prefill.
    let sent = g.received("local").await;
    let messages = sent.last().unwrap()["messages"].as_array().unwrap().clone();
    let prefill = messages.last().unwrap();
    assert_eq!(prefill["role"], "assistant");
    let delivered = prefill["content"].as_str().unwrap();
    assert!(!delivered.is_empty() && seen.text().starts_with(delivered));
    // ... and went on from it: one answer, not a second one spliced after the first's start.
    let whole: Value =
        serde_json::from_str(&seen.text()).unwrap_or_else(|e| panic!("{e}: {}", seen.text()));
    assert!(
        whole["answer"]
            .as_str()
            .is_some_and(|a| a.contains("continued by local")),
        "{whole}"
    );
    // Both targets, and both parts' usage and cost: the cut part (no usage of its own) at the
    // prompt's estimate (4 characters a token, 4 per message, 3 to start the reply) and the
    // text it delivered, at the primary's price; the rest as the continuation reported it.
    assert_eq!(oam["served_by"], json!(["primary/small", "local"]), "{oam}");
    // The last chunk names the model that wrote the answer's end, as clients read `model`.
    let chunks: Vec<Value> = seen
        .data()
        .iter()
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    assert_eq!(chunks[0]["model"], "small", "{:?}", seen.data());
    assert_eq!(
        chunks.last().unwrap()["model"],
        "small-local",
        "{:?}",
        seen.data()
    );
    let usage = seen
        .data()
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v.get("usage").filter(|u| u.is_object()).cloned())
        .expect("the usage the caller asked for");
    let first = (
        ("user".len() + q.len()).div_ceil(4) + 4 + 3,
        delivered.len().div_ceil(4),
    );
    let n = |k: &str| usage[k].as_u64().unwrap() as usize;
    let rest = (
        n("prompt_tokens") - first.0,
        n("completion_tokens") - first.1,
    );
    assert!(rest.0 > 0 && rest.1 > 0, "{usage}");
    assert_eq!(
        n("total_tokens"),
        n("prompt_tokens") + n("completion_tokens")
    );
    let tried = oam["tried"].as_array().unwrap();
    let cost = |i: usize| tried[i]["cost_usd"].as_f64().unwrap();
    let part1 = (first.0 + first.1) as f64 * 0.01 / 1000.0;
    let part2 = (rest.0 + rest.1) as f64 * 0.002 / 1000.0;
    assert!(
        (cost(0) - part1).abs() < 1e-9,
        "{} vs {part1}: {oam}",
        cost(0)
    );
    assert!(
        (cost(1) - part2).abs() < 1e-9,
        "{} vs {part2}: {oam}",
        cost(1)
    );
    let total = oam["cost_usd"].as_f64().unwrap();
    assert!((total - cost(0) - cost(1)).abs() < 1e-9, "{oam}");
    // Both settled in the ledger: the budget spent what the answer cost, and holds nothing.
    assert!(
        holds_drain(&g._nats.url(), "cutter", Duration::from_secs(10))
            .await
            .is_empty()
    );
    let spent = crate::support::eventually(Duration::from_secs(10), || async {
        let l = ledger_of(&g._nats.url(), "cutter").await?;
        ((l.spent_usd - total).abs() < 1e-9).then_some(l.spent_usd)
    })
    .await;
    assert!(spent.is_some(), "the ledger did not settle {total}");

    // `chain` has no target that takes a prefill: an error event, no [DONE].
    g.fault(
        "primary/big",
        json!({"mode": "stream", "kind": "cut", "after_chunks": 4}),
    )
    .await;
    let (status, seen) = g.stream("chain", "cut for good").await;
    assert_eq!(status, 200);
    assert!(
        !seen.ended_cleanly(),
        "a truncated stream never ends cleanly"
    );
    let err = seen.error().expect("an in-band error event");
    assert_eq!(err["code"], "STREAM_ENDED_WITH_ERROR", "{err}");
    assert!(!seen.text().is_empty(), "part of the answer had arrived");
}

/// A stall past the idle deadline is a failure of the target; a malformed event after the first
/// byte is skipped and said; a finish chunk whose `[DONE]` never comes is closed by oam.
#[tokio::test]
async fn stalls_malformed_events_and_a_missing_done_are_bounded() {
    let g = streaming("stall").await;
    g.fault(
        "primary/big",
        json!({"mode": "stream", "kind": "stall", "after_chunks": 3}),
    )
    .await;
    let (_, seen) = g.stream("chain", "stall").await;
    assert!(!seen.ended_cleanly());
    assert!(
        seen.ended_ms < 3_000,
        "ended after the 400 ms idle deadline, at {}",
        seen.ended_ms
    );
    let codes = seen.oam()["reason_codes"].to_string();
    assert!(
        codes.contains("GENERATION_TIMEOUT") && codes.contains("STREAM_INTERRUPTED"),
        "{codes}"
    );
    g.clear().await;

    g.fault(
        "primary/small",
        json!({"mode": "stream", "kind": "malformed", "after_chunks": 3}),
    )
    .await;
    let (_, seen) = g.stream("prefill", "malformed").await;
    assert!(seen.ended_cleanly(), "{:?}", seen.data());
    assert!(
        seen.oam()["reason_codes"]
            .to_string()
            .contains("STREAM_CHUNK_SKIPPED")
    );
    assert_eq!(seen.oam()["target"], "primary/small");
    g.clear().await;

    g.fault(
        "primary/small",
        json!({"mode": "stream", "kind": "no-done"}),
    )
    .await;
    let (_, seen) = g.stream("prefill", "no done").await;
    assert!(seen.ended_cleanly(), "complete, so closed cleanly by oam");
    assert!(
        seen.ended_ms < 5_000,
        "within the grace time, at {} ms",
        seen.ended_ms
    );
    assert_eq!(seen.oam()["outcome"], "accepted");
}

/// Under a contract the answer is checked whole before any of it is released, and the stream
/// says so (header and `oam` object) so nobody takes it for broken streaming.
#[tokio::test]
async fn a_stream_under_a_contract_is_checked_then_released() {
    let g = streaming("contract").await;
    let body = json!({"model": "prefill", "stream": true,
        "messages": [{"role": "user", "content": "json please"}],
        "response_format": {"type": "json_object"}});
    let resp = client()
        .post(format!("{}/v1/chat/completions", g.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-oam-buffered"], "contract");
    let text = resp.text().await.unwrap();
    let mut p = oam::http::sse::Parser::default();
    let events = p.feed(text.as_bytes()).unwrap();
    let content: Vec<String> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(content.len(), 1, "one checked chunk: {events:?}");
    assert!(serde_json::from_str::<Value>(&content[0]).is_ok());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["oam"]["buffered"], "contract", "{last}");
    // A live stream on the same node carries no such mark.
    let (_, seen) = g.stream("prefill", "tell me").await;
    assert!(seen.events.len() > 2 && seen.oam().get("buffered").is_none());
}

/// Tool calls are held to the tools the request declared: arguments that are not JSON or break
/// the tool's schema are a contract failure, moved to the next target; a tool whose parameters
/// are no JSON Schema is refused up front.
#[tokio::test]
async fn tool_arguments_must_fit_the_declared_schema() {
    let g = streaming("tools").await;
    let tools = json!([{"type": "function", "function": {"name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "minLength": 1}},
                       "required": ["q"], "additionalProperties": false}}}]);
    let ask = |q: &str| {
        json!({"model": "prefill", "tools": tools.clone(),
               "messages": [{"role": "user", "content": q}]})
    };
    let post = |body: Value| {
        let url = format!("{}/v1/chat/completions", g.url);
        async move {
            let r = client().post(url).json(&body).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (status, v) = post(ask("find oam")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    // Broken as a model breaks them: fields left out, cut short, of the wrong type.
    for kind in ["missing-field", "not-json", "low-confidence"] {
        g.fault(
            "primary/small",
            json!({"mode": "contract", "kind": kind, "times": 1}),
        )
        .await;
        let (status, v) = post(ask(&format!("broken {kind}"))).await;
        assert_eq!(status, 200, "{kind}: {v}");
        assert_eq!(tried(&v), ["primary/small", "local"], "{kind}: {v}");
        assert!(
            codes(&v).contains(&"TOOL_ARGUMENTS_INVALID".to_string()),
            "{v}"
        );
        let args = v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap();
        assert!(serde_json::from_str::<Value>(args).unwrap()["q"].is_string());
    }
    // Streamed live, a broken tool call is known only at its end, after its bytes reached the
    // caller: the stream ends with an error event naming it, and no second answer follows.
    // (On `big`: `primary/small` is out of use by now, after three broken answers.)
    g.fault(
        "primary/big",
        json!({"mode": "contract", "kind": "missing-field", "times": 1}),
    )
    .await;
    let mut live = ask("broken live");
    live["model"] = json!("big");
    live["stream"] = json!(true);
    let text = client()
        .post(format!("{}/v1/chat/completions", g.url))
        .json(&live)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events = oam::http::sse::Parser::default()
        .feed(text.as_bytes())
        .unwrap();
    assert_ne!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "TOOL_ARGUMENTS_INVALID", "{last}");
    let sources: std::collections::BTreeSet<String> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v["system_fingerprint"].as_str().map(String::from))
        .collect();
    assert_eq!(sources.len(), 1, "one upstream's answer only: {sources:?}");
    let mut bad = ask("bad schema");
    bad["tools"][0]["function"]["parameters"] = json!({"type": "no-such-type"});
    let (status, v) = post(bad).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "tools", "{v}");
}

/// The official SDKs retry a 5xx by themselves, twice by default: a route whose every target
/// was down drew 3 calls in 1.3 s. oam has retried and fallen back already, so it says when a
/// retry can help (`x-should-retry: true`, with `Retry-After`) and when it cannot.
#[tokio::test]
async fn the_openai_client_does_not_retry_what_oam_already_retried() {
    let g = gateway("should-retry").await;
    g.fault("primary/small", json!({"mode": "error", "status": 503}))
        .await;
    let script = r#"
import json, sys, openai
try:
    import httpx2 as httpx  # what this openai release is built on
except ImportError:
    import httpx
sent = []
http = httpx.Client(event_hooks={"request": [lambda r: sent.append(str(r.url))]})
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="not-needed", http_client=http)
out = {"retries": c.max_retries}
try:
    c.chat.completions.create(model="small", messages=[{"role": "user", "content": "down"}])
    out["status"] = 200
except openai.APIStatusError as e:
    out["status"] = e.status_code
    out["should_retry"] = e.response.headers.get("x-should-retry")
out["sent"] = len(sent)
print(json.dumps(out))
"#;
    let v = crate::support::python_json(script, &[&g.url]);
    assert_eq!(v["retries"], 2, "the client's default: {v}");
    let status = v["status"].as_u64().unwrap();
    assert!((500..600).contains(&status), "{v}");
    assert_eq!(v["should_retry"], "false", "{v}");
    assert_eq!(v["sent"], 1, "one call, not three: {v}");
}

/// The official OpenAI Python client through a route relayed live: a streamed tool call arrives
/// as deltas it reassembles, the round trip completes, and a stream that cannot be finished
/// raises in the client instead of ending as if complete.
#[tokio::test]
async fn the_openai_client_streams_tools_live_and_sees_a_broken_stream_fail() {
    let g = streaming("py").await;
    let script = r#"
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="not-needed", max_retries=0)
tools = [{"type": "function", "function": {"name": "get_weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}}]
turn = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
out = {}
chunks = list(c.chat.completions.create(model="prefill", messages=turn, tools=tools,
                                        stream=True, stream_options={"include_usage": True}))
calls = {}
for ch in chunks:
    for tc in ((ch.choices[0].delta.tool_calls or []) if ch.choices else []):
        e = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
        e["id"] = tc.id or e["id"]
        e["name"] += tc.function.name or "" if tc.function else ""
        e["arguments"] += (tc.function.arguments or "") if tc.function else ""
out["deltas"] = sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls)
out["call"] = calls[0]
out["finish"] = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
out["usage"] = [ch.usage.total_tokens for ch in chunks if ch.usage]
# SDK helpers read the usage from the last chunk before [DONE]; oam's object rides in it.
out["last_usage"] = chunks[-1].usage.total_tokens if chunks[-1].usage else None
out["last_oam"] = (chunks[-1].model_extra or {}).get("oam", {}).get("outcome")
turn.append({"role": "assistant", "content": None, "tool_calls": [{"id": calls[0]["id"],
             "type": "function", "function": {"name": calls[0]["name"],
             "arguments": calls[0]["arguments"]}}]})
turn.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "{\"celsius\": 21}"})
final = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
    model="prefill", messages=turn, tools=tools, stream=True) if ch.choices)
out["final"] = final
try:
    got = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="chain", messages=[{"role": "user", "content": "break"}], stream=True) if ch.choices)
    out["broken"] = "ended as if complete: " + got
except openai.APIError as e:
    out["broken"] = str(e)
print(json.dumps(out))
"#;
    // The second stream on `chain` is cut after its fourth event, with no prefill target.
    g.fault(
        "primary/big",
        json!({"mode": "stream", "kind": "cut", "after_chunks": 4}),
    )
    .await;
    let v = crate::support::python_json(script, &[&g.url]);
    assert!(
        v["deltas"].as_u64().unwrap() >= 2,
        "arguments in pieces: {v}"
    );
    assert_eq!(v["call"]["name"], "get_weather", "{v}");
    let args: Value = serde_json::from_str(v["call"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string(), "{v}");
    assert_eq!(v["finish"], "tool_calls");
    assert_eq!(
        v["usage"].as_array().unwrap().len(),
        1,
        "usage relayed once, as asked: {v}"
    );
    assert_eq!(
        v["last_usage"], v["usage"][0],
        "the last chunk carries the usage: {v}"
    );
    assert_eq!(v["last_oam"], "accepted", "and the oam object: {v}");
    assert!(v["final"].as_str().unwrap().contains("answer"), "{v}");
    let broken = v["broken"].as_str().unwrap();
    assert!(broken.contains("STREAM_ENDED_WITH_ERROR"), "{broken}");
    // The image part reached the upstream as sent.
    let sent = g.received("primary").await;
    let first = sent
        .iter()
        .find(|r| r["messages"][0]["content"].is_array())
        .expect("the request with the image");
    assert_eq!(
        first["messages"][0]["content"][1]["image_url"]["url"],
        "data:image/png;base64,iVBORw0KGgo="
    );
}

/// `oam bench --stream` counts streams that end with `[DONE]` and reports time to first token.
#[tokio::test]
async fn bench_streams_and_reports_the_first_token() {
    let g = streaming("bench").await;
    let out = std::process::Command::new(assert_cmd::cargo::cargo_bin!("oam"))
        .args([
            "bench", "--url", &g.url, "--stream", "-n", "40", "-c", "4", "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["succeeded"], 40, "{r}");
    let ttft = r["ttft_ms"]["p50"].as_f64().expect("a first-token figure");
    let whole = r["latency_ms"]["p50"].as_f64().unwrap();
    assert!(
        ttft > 0.0 && ttft < whole,
        "first token {ttft} ms, whole {whole} ms"
    );
}

/// A caller that gives up while a live stream waits for its first event costs nothing more:
/// the upstream call is dropped at once (not held until the first-event deadline), no other
/// target is tried, and the request ends as `CLIENT_DISCONNECTED`.
#[tokio::test]
async fn a_caller_gone_before_the_first_event_ends_the_upstream_call() {
    let g = streaming("gone").await;
    // Silent for 3 s: past the route's 1 s first-event deadline.
    g.fault("primary/small", json!({"mode": "slow", "extra_ms": 3_000}))
        .await;
    let before = g.received("local").await.len();
    let body = json!({"model": "prefill", "stream": true,
        "messages": [{"role": "user", "content": "too slow for me"}]});
    let sent = std::time::Instant::now();
    let gave_up = crate::support::http(Duration::from_millis(200))
        .post(format!("{}/v1/chat/completions", g.url))
        .json(&body)
        .send()
        .await;
    assert!(gave_up.is_err(), "the caller's own timeout");
    let ended = crate::support::eventually(Duration::from_secs(5), || async {
        let counts = crate::support::reason_counts(&g.url).await;
        (counts.get("CLIENT_DISCONNECTED").copied().unwrap_or(0.0) >= 1.0).then_some(())
    })
    .await;
    assert!(ended.is_some(), "decided as the caller leaving");
    // Decided when the caller left, not when the 1 s first-event deadline would have ended
    // the call.
    assert!(
        sent.elapsed() < Duration::from_millis(900),
        "{:?}",
        sent.elapsed()
    );
    assert_eq!(
        g.received("local").await.len(),
        before,
        "no other target tried"
    );
}

/// With `[[client]]`s configured, only a request bearing one's key is served (HTTP and
/// `/v1/models` alike), and it counts as that client whatever agent it names: loops are counted
/// per caller, so one client's identical failures never stop another's.
#[tokio::test]
async fn only_clients_with_a_key_are_served_and_each_is_its_own_agent() {
    const ALPHA: &str = "alpha-key-0123456789";
    const BETA: &str = "beta-key-0123456789";
    let g = gateway_with_env(
        "clients",
        "[[client]]\nid = \"alpha\"\nkey_env = \"OAM_TEST_KEY_ALPHA\"\n\
         [[client]]\nid = \"beta\"\nkey_env = \"OAM_TEST_KEY_BETA\"\n",
        &[("OAM_TEST_KEY_ALPHA", ALPHA), ("OAM_TEST_KEY_BETA", BETA)],
    )
    .await;
    let ask = |key: Option<&'static str>, agent: &'static str| {
        let url = format!("{}/v1/chat/completions", g.url);
        async move {
            let body = json!({"model": "big", "messages": [{"role": "user", "content": "same question"}],
                              "oam": {"agent": agent, "task": "t"}});
            let mut r = client().post(url).json(&body);
            if let Some(k) = key {
                r = r.bearer_auth(k);
            }
            let r = r.send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    // No key, a wrong key: refused before anything is decided or called.
    for key in [None, Some("not-a-key-0123456789")] {
        let (status, body) = ask(key, "alpha").await;
        assert_eq!(status, 401, "{body}");
        assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
    }
    let models = format!("{}/v1/models", g.url);
    assert_eq!(
        client()
            .get(&models)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        401
    );
    let listed = client()
        .get(&models)
        .bearer_auth(BETA)
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status().as_u16(), 200);
    assert!(
        g.received("primary").await.is_empty(),
        "nothing reached the upstream"
    );
    let m = crate::support::metrics(&g.url).await;
    assert!(m.contains("oam_unauthorized_requests_total 3"), "{m}");
    // The other APIs alike, a bad body too: no key, no word about the body.
    for (path, body) in [
        ("/v1/messages", json!({"model": "big", "messages": []})),
        (
            "/v1/responses",
            json!({"model": "big", "input": "q", "store": true}),
        ),
        (
            "/v1/messages/count_tokens",
            json!({"model": "big", "messages": []}),
        ),
    ] {
        let r = client()
            .post(format!("{}{path}", g.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 401, "{path}");
        // Anthropic's clients send x-api-key, OpenAI's a bearer token.
        let keyed = client().post(format!("{}{path}", g.url));
        let keyed = if path.starts_with("/v1/messages") {
            keyed.header("x-api-key", ALPHA)
        } else {
            keyed.bearer_auth(ALPHA)
        };
        let r = keyed.json(&body).send().await.unwrap();
        assert_eq!(
            r.status().as_u16(),
            400,
            "{path}: a keyed caller hears about its body"
        );
    }
    let m = crate::support::metrics(&g.url).await;
    assert!(m.contains("oam_unauthorized_requests_total 6"), "{m}");
    // A wrong key is blamed on the header it came in.
    let r = client()
        .post(format!("{}/v1/messages", g.url))
        .header("x-api-key", "sk-not-ours")
        .json(&json!({"model": "big", "max_tokens": 8, "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let said: Value = r.json().await.unwrap();
    let said = said["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(said.contains("x-api-key header"), "{said}");

    // The NATS data plane asks for the same key, as a message header.
    let nc = oam::transport::connect::connect(&g._nats.url(), "test", false, &Default::default())
        .await
        .unwrap();
    let plane = crate::support::NatsPlane::new(&nc).await;
    let body = json!({"model": "big", "messages": [{"role": "user", "content": "hi"}]});
    let bytes: bytes::Bytes = serde_json::to_vec(&body).unwrap().into();
    let refused = plane.request(bytes.clone()).await.unwrap();
    let refused: Value = serde_json::from_slice(&refused.payload).unwrap();
    assert_eq!(refused["status"], 401, "{refused}");
    let mut h = async_nats::HeaderMap::new();
    h.insert("Authorization", format!("Bearer {BETA}").as_str());
    let served = plane.request_with_headers(h, bytes).await.unwrap();
    let served: Value = serde_json::from_slice(&served.payload).unwrap();
    assert_eq!(served["status"], 200, "{served}");
    assert_eq!(served["oam"]["agent"], "beta", "{served}");

    // A client's key makes it that client, whatever agent the request names.
    let (status, body) = ask(Some(ALPHA), "beta").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["oam"]["agent"], "alpha", "{body}");

    // Every target fails: alpha's identical calls trip alpha's loop at the third failure;
    // beta's identical calls (naming alpha as their agent) are beta's own, not alpha's loop.
    g.fault("primary/big", json!({"mode": "error"})).await;
    g.fault("secondary", json!({"mode": "error"})).await;
    for _ in 0..3 {
        let (status, body) = ask(Some(ALPHA), "alpha").await;
        assert_ne!(status, 200, "{body}");
    }
    let (status, body) = ask(Some(ALPHA), "alpha").await;
    assert_eq!(status, 429, "{body}");
    assert!(
        codes(&body).contains(&"RUNAWAY_RETRY_STOPPED".to_string()),
        "{body}"
    );
    for _ in 0..2 {
        let (status, body) = ask(Some(BETA), "alpha").await;
        assert_ne!(status, 429, "beta is not alpha's loop: {body}");
        assert_eq!(body["oam"]["agent"], "beta", "{body}");
        assert_ne!(body["oam"]["phase"], "loop", "{body}");
        assert!(
            !codes(&body).contains(&"RUNAWAY_RETRY_STOPPED".to_string()),
            "{body}"
        );
    }
}

/// An upstream of its own (not the simulator): it answers one fixed chat completion, written
/// its own way (member order, spacing, fields oam never reads), and keeps the
/// `Authorization` header of every request.
pub(crate) async fn keyed_upstream() -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::http::HeaderMap;
    let seen: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let keep = seen.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(move |h: HeaderMap| {
            let keep = keep.clone();
            async move {
                let auth = h
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                keep.lock().unwrap().push(auth);
                (
                    [("content-type", "application/json")],
                    UPSTREAM_ANSWER.to_string(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

pub(crate) const UPSTREAM_ANSWER: &str = "{\n  \"model\": \"up-1\",\n  \"id\": \"cmpl-9\", \"object\": \"chat.completion\", \"created\": 7,\n  \"choices\": [{\"index\": 0, \"message\": {\"role\": \"assistant\", \"content\": \"plain prose \\u00e9\"}, \"logprobs\": null, \"finish_reason\": \"stop\"}],\n  \"usage\": {\"prompt_tokens\": 5, \"completion_tokens\": 3, \"total_tokens\": 8},\n  \"system_fingerprint\": \"fp_1\", \"service_tier\": \"default\"\n}\n";

#[tokio::test]
async fn the_upstream_gets_its_key_and_its_answer_comes_back_as_it_was_written() {
    let (up, seen) = keyed_upstream().await;
    let g = gateway_with_env(
        "keyed",
        &format!(
            "[[provider]]\nid = \"keyed\"\nbase_url = \"{up}\"\nmodel = \"up-1\"\napi_key_env = \"OAM_TEST_UPSTREAM_KEY\"\nprobe = \"off\"\n[[route]]\nmodel = \"up-1\"\ntargets = [\"keyed/up-1\"]\n"
        ),
        &[("OAM_TEST_UPSTREAM_KEY", "sk-test-0123456789abcdef")],
    )
    .await;
    let r = client()
        .post(format!("{}/v1/chat/completions", g.url))
        .json(&json!({"model": "up-1", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let text = r.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        *seen.lock().unwrap(),
        ["Bearer sk-test-0123456789abcdef"],
        "the key went with the request"
    );
    // The upstream's bytes, then oam's object as the last member.
    let (head, oam) = text.split_once(",\"oam\":").expect("an oam object");
    let up_body = UPSTREAM_ANSWER.trim_end().strip_suffix('}').unwrap();
    assert_eq!(head, up_body, "the upstream's answer as it was written");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "plain prose é");
    assert_eq!(v["service_tier"], "default");
    assert_eq!(v["oam"]["target"], "keyed", "{oam}");
    assert_eq!(v["oam"]["outcome"], "accepted");

    // A streamed request takes the other client; the key goes with it too.
    let r = client()
        .post(format!("{}/v1/chat/completions", g.url))
        .json(&json!({"model": "up-1", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let events = r.text().await.unwrap();
    assert!(events.contains("plain prose"), "{events}");
    assert_eq!(
        seen.lock().unwrap().last().map(String::as_str),
        Some("Bearer sk-test-0123456789abcdef")
    );
    assert_eq!(seen.lock().unwrap().len(), 2);
}

/// The attack: requests whose own `json_schema` no answer can fit opened the target's breaker,
/// and then ordinary requests got CIRCUIT_OPEN. A request's own contract judges the request.
#[tokio::test]
async fn a_caller_s_impossible_schema_opens_no_breaker() {
    let g = gateway("own-schema").await;
    let impossible = json!({"type": "json_schema", "json_schema": {"name": "never", "schema":
        {"type": "object", "required": ["never"], "properties": {"never": {"type": "integer"}}}}});
    for i in 0..12 {
        let body = json!({"model": "small", "response_format": impossible,
                          "messages": [{"role": "user", "content": format!("trip {i}")}]});
        let r = client()
            .post(format!("{}/v1/chat/completions", g.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        let v: Value = r.json().await.unwrap();
        assert!(
            codes(&v).contains(&"SEMANTIC_VALIDATION_FAILED".to_string()),
            "{v}"
        );
        assert!(!codes(&v).contains(&"CIRCUIT_OPENED".to_string()), "{v}");
    }
    for i in 0..10 {
        let (status, v) = g.ask("small", &format!("ordinary {i}")).await;
        assert_eq!(status, 200, "{v}");
        assert!(!codes(&v).contains(&"CIRCUIT_OPEN".to_string()), "{v}");
    }
    let t = g.target("primary/small").await;
    assert!(t.breaker.is_closed(), "{t:?}");
}

/// The attack: `n = 128` against a $0.01 limit was priced as one answer; eight requests were
/// admitted and spent 102 times the limit. Now a reservation prices all 128 answers (and `n`
/// reaches the upstream as sent), so the request is refused before anything is called.
#[tokio::test]
async fn asking_for_many_answers_at_once_escapes_no_budget() {
    let g = gateway_with("n128", "[budgets.agents.greedy]\nlimit_usd = 0.01\n").await;
    // Each its own question (identical failing calls would be stopped as a loop first).
    let asked = std::sync::atomic::AtomicU32::new(0);
    let ask = |n: Value| {
        let i = asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        json!({"model": "small", "n": n, "max_tokens": 100, "oam": {"agent": "greedy"},
               "messages": [{"role": "user", "content": format!("many {i}")}]})
    };
    let (status, v) = g.post(ask(json!(1))).await;
    assert_eq!(status, 200, "one answer fits the budget: {v}");
    for _ in 0..8 {
        let (status, v) = g.post(ask(json!(128))).await;
        assert_ne!(status, 200, "{v}");
        assert!(codes(&v).iter().any(|c| c.starts_with("BUDGET")), "{v}");
    }
    let sent = g.received("primary").await;
    assert_eq!(
        sent.len(),
        1,
        "only the one-answer request reached the upstream"
    );
    assert!(sent[0]["n"].is_null() || sent[0]["n"] == 1, "{:?}", sent[0]);
    // Not a number of answers: a clear 400.
    for bad in [json!(0), json!(129), json!(1.5), json!("2")] {
        let (status, v) = g.post(ask(bad.clone())).await;
        assert_eq!(status, 400, "{bad}: {v}");
        assert_eq!(v["error"]["param"], "n", "{v}");
    }
}

/// `agent`'s budget record in the shared ledger, if it has one (none while a node starting up
/// has not made the ledger's bucket yet).
pub(crate) async fn ledger_of(nats_url: &str, agent: &str) -> Option<oam::core::ledger::Ledger> {
    let nc = oam::transport::connect::connect(nats_url, "test-ledger", false, &Default::default())
        .await
        .unwrap();
    let kv = async_nats::jetstream::new(nc)
        .get_key_value("oam-budgets")
        .await
        .ok()?;
    let raw = kv.get(format!("agent.{agent}")).await.unwrap()?;
    Some(serde_json::from_slice(&raw).unwrap())
}

/// The holds of `agent`'s budget in the shared ledger that still count, by holder.
pub(crate) async fn live_holds(nats_url: &str, agent: &str) -> Vec<(String, f64)> {
    let Some(l) = ledger_of(nats_url, agent).await else {
        return Vec::new();
    };
    let now = oam::clock::now_ms();
    l.holds
        .into_iter()
        .filter(|(_, h)| h.until_ms > now)
        .map(|(n, h)| (n, h.usd))
        .collect()
}

/// Wait (at most `within`) until `agent`'s budget holds nothing; what it still holds if not.
pub(crate) async fn holds_drain(
    nats_url: &str,
    agent: &str,
    within: Duration,
) -> Vec<(String, f64)> {
    let deadline = std::time::Instant::now() + within;
    loop {
        let holds = live_holds(nats_url, agent).await;
        if holds.is_empty() || std::time::Instant::now() > deadline {
            return holds;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The attack: a hold taken for an attempt that failed (a generation error, an answer that broke
/// the request's schema) and was followed by another attempt was never given back: the node
/// renewed it as long as it lived, and the budget stayed locked.
#[tokio::test]
async fn a_failed_attempt_gives_its_hold_back() {
    let g = gateway_with("holds", "[budgets.agents.spender]\nlimit_usd = 1.0\n").await;
    let nats_url = g._nats.url();
    // A generation error, then another attempt.
    g.fault("primary/big", json!({"mode": "error", "times": 1}))
        .await;
    let (status, v) = g
        .post(json!({"model": "big", "oam": {"agent": "spender"},
        "messages": [{"role": "user", "content": "error first"}]}))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(tried(&v).len(), 2, "a second attempt after the error: {v}");
    let left = holds_drain(&nats_url, "spender", Duration::from_secs(5)).await;
    assert!(left.is_empty(), "after a generation error: {left:?}");
    // Answers that break the request's own schema on both targets.
    let impossible = json!({"type": "json_schema", "json_schema": {"name": "never", "schema":
        {"type": "object", "required": ["never"], "properties": {"never": {"type": "integer"}}}}});
    let (_, v) = g
        .post(json!({"model": "big", "oam": {"agent": "spender"},
        "response_format": impossible,
        "messages": [{"role": "user", "content": "schema"}]}))
        .await;
    assert!(
        codes(&v).contains(&"SEMANTIC_VALIDATION_FAILED".to_string()),
        "{v}"
    );
    let left = holds_drain(&nats_url, "spender", Duration::from_secs(5)).await;
    assert!(left.is_empty(), "after schema failures: {left:?}");
}

/// A node killed holding an attempt's cost and started again under the same id: what its last
/// run held lapses with that run's lease, although the new run reserves on the same budget.
#[tokio::test]
async fn a_killed_node_s_holds_lapse_although_it_restarts() {
    let mut g = gateway_process(
        "lapse",
        "budget_lease_ms = 5000",
        "[budgets.agents.spender]\nlimit_usd = 1.0\n",
        NatsServer::start().await,
    )
    .await;
    let nats_url = g._nats.url();
    g.fault("primary/small", json!({"mode": "hang"})).await;
    let url = format!("{}/v1/chat/completions", g.url);
    let hung = tokio::spawn(async move {
        let body = json!({"model": "small", "oam": {"agent": "spender"},
            "messages": [{"role": "user", "content": "hangs"}]});
        let _ = client().post(url).json(&body).send().await;
    });
    let held = crate::support::eventually(Duration::from_secs(10), || async {
        let h = live_holds(&nats_url, "spender").await;
        (!h.is_empty()).then_some(h)
    })
    .await
    .expect("the hung attempt's cost is held");
    g._node.process().kill();
    hung.abort();
    g.clear().await;
    let cfg = g.dir.join("oam.toml");
    g._node = GatewayNode::Process(Proc::spawn(&crate::support::node_args(
        "n1",
        &nats_url,
        &["--config", cfg.to_str().unwrap()],
    )));
    g.url = g._node.process().ready["http"]
        .as_str()
        .unwrap()
        .to_string();
    // The new run spends on the same budget while its last run's hold still counts.
    let body = json!({"model": "small", "oam": {"agent": "spender"},
        "messages": [{"role": "user", "content": "spend"}]});
    let r = client()
        .post(format!("{}/v1/chat/completions", g.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let left = holds_drain(&nats_url, "spender", Duration::from_secs(12)).await;
    assert!(
        left.is_empty(),
        "held before the kill {held:?}, still {left:?}"
    );
}

/// `POST /v1/oam/chaos` is how an isolated node hears of an early restore, and anyone on
/// 127.0.0.1 can reach it: it ends only the isolation under way, and only with that isolation's
/// key (which the warden sent the node over NATS).
#[tokio::test]
async fn only_the_warden_s_key_ends_an_isolation_over_http() {
    let g = gateway("restore-key").await;
    let nc = oam::transport::connect::connect(&g._nats.url(), "test", false, &Default::default())
        .await
        .unwrap();
    let plane = crate::support::NatsPlane::new(&nc).await;
    let body = json!({"messages": [{"role": "user", "content": "over nats"}]}).to_string();
    // Answered (Some(true)), nobody subscribed (Some(false): the node is cut off), or no
    // answer in time (None: a busy machine, say nothing).
    let answers = |plane: crate::support::NatsPlane| {
        let body = body.clone();
        async move {
            let r = tokio::time::timeout(Duration::from_secs(5), plane.request(body.into())).await;
            match r {
                Ok(Ok(_)) => Some(true),
                Ok(Err(oam::transport::ask::AskError::NoResponders)) => Some(false),
                _ => None,
            }
        }
    };
    // The node's subscriptions are in place once it answers over NATS; then it is cut off.
    let up = crate::support::eventually(Duration::from_secs(10), || {
        let plane = plane.clone();
        async move { (answers(plane).await == Some(true)).then_some(()) }
    })
    .await;
    assert!(up.is_some(), "the node serves the NATS data plane");
    let isolate = oam::core::chaos::NodeCommand::Isolate {
        id: "cut".into(),
        until_ms: oam::clock::now_ms() + 60_000,
        key: "k-of-the-warden-0123456789".into(),
    };
    nc.publish(
        oam::transport::subjects::chaos_node("n1"),
        serde_json::to_vec(&isolate).unwrap().into(),
    )
    .await
    .unwrap();
    let cut = crate::support::eventually(Duration::from_secs(10), || {
        let plane = plane.clone();
        async move { (answers(plane).await == Some(false)).then_some(()) }
    })
    .await;
    assert!(
        cut.is_some(),
        "the node left the NATS data plane when cut off"
    );
    let restore = |key: Option<&str>| {
        let mut cmd = json!({"action": "restore", "id": "cut"});
        if let Some(k) = key {
            cmd["key"] = json!(k);
        }
        let url = format!("{}/v1/oam/chaos", g.url);
        async move {
            client()
                .post(url)
                .json(&cmd)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(restore(None).await, 403);
    assert_eq!(restore(Some("guessed-key-0123456789")).await, 403);
    assert_eq!(answers(plane.clone()).await, Some(false), "still cut off");
    assert_eq!(restore(Some("k-of-the-warden-0123456789")).await, 200);
    let back = crate::support::eventually(Duration::from_secs(10), || {
        let plane = plane.clone();
        async move { (answers(plane).await == Some(true)).then_some(()) }
    })
    .await;
    assert!(back.is_some(), "the restore ended the isolation");
}

/// An upstream that answers without end: `/big/v1` a JSON body of 64 MiB, `/endless/v1` a body
/// that never ends, `/sse/v1` an event stream that never ends (each bounded here: at most
/// 256 MiB or 60 s per answer, and it stops once the node hangs up).
pub(crate) async fn endless_upstream() -> String {
    use axum::body::Body;
    use futures_util::{StreamExt as _, stream};
    const CHUNK: usize = 64 << 10;
    fn endless(prefix: &'static str, piece: &'static str, limit: usize) -> Body {
        let started = std::time::Instant::now();
        let pieces = stream::iter(0..)
            .map(move |i| {
                let mut chunk = if i == 0 {
                    prefix.to_string()
                } else {
                    String::new()
                };
                while chunk.len() < CHUNK {
                    chunk.push_str(piece);
                }
                Ok::<_, std::io::Error>(bytes::Bytes::from(chunk))
            })
            .take_while(move |_| std::future::ready(started.elapsed() < Duration::from_secs(60)))
            .take(limit / CHUNK);
        Body::from_stream(pieces)
    }
    let app = axum::Router::new()
        .route(
            "/big/v1/chat/completions",
            axum::routing::post(|| async {
                let mut body = String::from(r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":""#);
                body.push_str(&"a".repeat(64 << 20));
                body.push_str(r#""}}]}"#);
                ([("content-type", "application/json")], body)
            }),
        )
        .route(
            "/endless/v1/chat/completions",
            axum::routing::post(|| async {
                (
                    [("content-type", "application/json")],
                    endless(r#"{"choices":[{"message":{"content":""#, "aaaaaaaa", 256 << 20),
                )
            }),
        )
        .route(
            "/sse/v1/chat/completions",
            axum::routing::post(|| async {
                let piece = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n";
                (
                    [("content-type", "text/event-stream")],
                    endless("", piece, 256 << 20),
                )
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// A process's resident memory, in MiB (from /proc).
pub(crate) fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib / 1024
}

/// The attack: a 64 MB answer was relayed whole (367 MB resident), and an endless body grew
/// the node to 752 MB, never given back. An answer or stream past `node.max_answer_bytes` now
/// fails the attempt (the next target answers) and what was read is dropped.
#[tokio::test]
async fn an_endless_upstream_grows_no_node() {
    let up = endless_upstream().await;
    let mut extra = String::new();
    for kind in ["big", "endless", "sse"] {
        extra.push_str(&format!(
            "[[provider]]\nid = \"{kind}\"\nbase_url = \"{up}/{kind}/v1\"\nmodel = \"m\"\nprobe = \"off\"\n\
             [[route]]\nmodel = \"x-{kind}\"\ntargets = [\"{kind}/m\", \"secondary/medium\"]\n"
        ));
    }
    let mut g = gateway_process(
        "endless",
        "max_answer_bytes = 1048576",
        &extra,
        NatsServer::start().await,
    )
    .await;
    for round in 0..3 {
        for kind in ["big", "endless", "sse"] {
            for stream in [false, true] {
                let body = json!({"model": format!("x-{kind}"), "stream": stream,
                    "messages": [{"role": "user", "content": format!("{kind} {round} {stream}")}]});
                let r = client()
                    .post(format!("{}/v1/chat/completions", g.url))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status().as_u16(), 200, "{kind} stream={stream}");
                let text = r.text().await.unwrap();
                assert!(
                    text.len() < 2 << 20,
                    "{kind} stream={stream}: {} bytes",
                    text.len()
                );
                if kind == "sse" && stream {
                    // Relayed live as it came, then cut at the limit (the stream says so), or,
                    // once the target's breaker is open, answered by the next one.
                    let tail = &text[text.len().saturating_sub(600)..];
                    assert!(
                        tail.contains("error") || text.contains("oam-sim-secondary"),
                        "{kind} stream={stream}: {tail}"
                    );
                } else {
                    assert!(
                        text.contains("secondary"),
                        "{kind} stream={stream}: the next target answered: {text}"
                    );
                }
            }
        }
    }
    // An order of magnitude, not a tight number: the node never held much of any answer.
    let rss = rss_mib(g._node.process().pid());
    assert!(rss < 200, "the node is {rss} MiB resident after the abuse");
}

/// The attack: one request with 6,000 tools cost 92-165 ms of CPU and 43 MB (fifty at once,
/// 1.2-2.1 GB), as every tool's schema is compiled. More than 128 tools is a clear 400 now,
/// before anything is compiled or called.
#[tokio::test]
async fn thousands_of_tools_are_refused_at_once() {
    let g = gateway("tools-cap").await;
    let tools = |n: usize| -> Vec<Value> {
        (0..n)
            .map(|i| {
                json!({"type": "function", "function": {"name": format!("t{i}"),
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}})
            })
            .collect()
    };
    let post = |n: usize| {
        g.post(json!({"model": "small", "tools": tools(n),
                      "messages": [{"role": "user", "content": format!("{n} tools")}]}))
    };
    let (status, v) = post(6_000).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "tools", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("128"),
        "{v}"
    );
    assert!(g.received("primary").await.is_empty(), "nothing was called");
    let (status, v) = post(128).await;
    assert_eq!(status, 200, "{v}");
}

/// Open `n` connections to `addr` that send a request's headers a byte every 200 ms, each for
/// at most `for_`; they end by themselves.
pub(crate) fn slow_header_sockets(
    addr: &str,
    n: usize,
    for_: Duration,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..n)
        .map(|_| {
            let addr = addr.to_string();
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt as _;
                let Ok(mut s) = tokio::net::TcpStream::connect(&addr).await else {
                    return;
                };
                let started = std::time::Instant::now();
                let head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ";
                let _ = s.write_all(head).await;
                while started.elapsed() < for_ {
                    if s.write_all(b"a").await.is_err() {
                        return; // closed by the node
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        })
        .collect()
}

/// The attack: 600 sockets sending their headers slowly took ordinary requests from 1.9 ms to
/// 4.6 s at the median. Now the connection that has waited longest for a request is closed to
/// make room, so callers with a request to make get in.
#[tokio::test]
async fn slow_header_sockets_keep_no_caller_out() {
    let g = gateway_on(
        "slow-headers",
        "max_connections = 16",
        "",
        &[],
        NatsServer::start().await,
    )
    .await;
    let addr = g.url.trim_start_matches("http://").to_string();
    let slow = slow_header_sockets(&addr, 48, Duration::from_secs(8));
    let saturated = &g._node.in_process().serving.saturated;
    let full = crate::support::eventually(Duration::from_secs(5), || async {
        (saturated.load(std::sync::atomic::Ordering::Relaxed) > 0).then_some(())
    });
    assert!(full.await.is_some(), "the slow sockets took every slot");
    let mut slowest = Duration::ZERO;
    for i in 0..10 {
        let started = std::time::Instant::now();
        let (status, v) = g.ask("small", &format!("through the crowd {i}")).await;
        assert_eq!(status, 200, "{v}");
        slowest = slowest.max(started.elapsed());
    }
    // An order of magnitude: without room made, each waits for a header timeout (10 s).
    assert!(
        slowest < Duration::from_secs(3),
        "the slowest took {slowest:?}"
    );
    for s in slow {
        s.abort();
    }
}

/// The attack: 20 streams read at a byte a second held 661 MB and were never closed. A client
/// that takes no write for `node.write_timeout_ms` is hung up on, and its stream's upstream call
/// ends with it.
#[tokio::test]
async fn a_reader_that_stalls_is_hung_up_on() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let up = endless_upstream().await;
    let extra = format!(
        "[[provider]]\nid = \"sse\"\nbase_url = \"{up}/sse/v1\"\nmodel = \"m\"\nprobe = \"off\"\n\
         [[route]]\nmodel = \"x-sse\"\ntargets = [\"sse/m\"]\n"
    );
    let g = gateway_on(
        "stall",
        "write_timeout_ms = 1000\nmax_answer_bytes = 268435456",
        &extra,
        &[],
        NatsServer::start().await,
    )
    .await;
    let addr = g.url.trim_start_matches("http://").to_string();
    let body = json!({"model": "x-sse", "stream": true,
                      "messages": [{"role": "user", "content": "never read"}]})
    .to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    // Read nothing for a while: the socket's buffers fill, then a write waits past the limit.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut got = 0usize;
    let mut buf = vec![0u8; 1 << 16];
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got += n,
            }
        }
    })
    .await;
    assert!(
        ended.is_ok(),
        "still streaming after 20 s ({got} bytes read)"
    );
    assert!(
        got < 64 << 20,
        "{got} bytes were buffered for the stalled reader"
    );
}

/// The attack: 320 requests of 900 KB evicted every earlier record from the decision log in
/// 4.9 s. A record holding more than `[decision_log] max_content_bytes` keeps its content as
/// hashes, so large requests cannot flush everyone's records out of `max_bytes`.
#[tokio::test]
async fn large_requests_flush_no_one_s_records_from_the_log() {
    let g = gateway_with("log-flush", "[decision_log]\nmax_bytes = 8388608\n").await;
    let nats_url = g._nats.url();
    let (status, v) = g.ask("small", "the record to keep").await;
    assert_eq!(status, 200, "{v}");
    let kept = v["oam"]["request_id"].as_str().unwrap().to_string();
    let big = "x".repeat(900 << 10);
    for i in 0..24 {
        let (status, v) = g.ask("small", &format!("{i} {big}")).await;
        assert_eq!(status, 200, "{v}");
    }
    let explain = |id: String| {
        let nats_url = nats_url.clone();
        async move {
            let out = assert_cmd::Command::cargo_bin("oam")
                .unwrap()
                .args(["explain", &id, "--json", "--nats-url", &nats_url])
                .output()
                .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
            )
        }
    };
    // Written off the request's path: wait until the last large one is in the log.
    let last = crate::support::eventually(Duration::from_secs(10), || async {
        let out = assert_cmd::Command::cargo_bin("oam")
            .unwrap()
            .args(["audit", "--json", "--limit", "100", "--nats-url", &nats_url])
            .output()
            .ok()?;
        let list: Value = serde_json::from_slice(&out.stdout).ok()?;
        (list.as_array()?.len() >= 25).then_some(list)
    })
    .await
    .expect("every record is in the log");
    assert!(last.to_string().contains(&kept), "{last}");
    let (code, out) = explain(kept.clone()).await;
    assert_eq!(code, Some(0), "the small record still replays: {out}");
    // `--verify` tells a record kept as hashes from one whose replay differs: not a failure.
    let out = assert_cmd::Command::cargo_bin("oam")
        .unwrap()
        .args([
            "audit",
            "--verify",
            "--json",
            "--limit",
            "100",
            "--nats-url",
            &nats_url,
        ])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let replay = |id: &str| {
        rows.iter()
            .find(|r| r["record"]["decision"]["request_id"] == id)
            .map(|r| r["replay"].clone())
    };
    assert_eq!(replay(&kept), Some(json!({"identical": true})));
    let hashed = rows
        .iter()
        .filter(|r| r["replay"]["replayable"] == false)
        .count();
    assert_eq!(hashed, 24, "every large record is hashed, not replayable");
}

/// The attack: a full JetStream store froze the ledger and the decision log (answers unlogged,
/// spend unsettled) while every node looked healthy. A node now says which store takes no
/// writes (its snapshot, so `oam mesh status` and `oam watch` show it), high-risk work on a
/// budget fails closed, and once the store takes writes again the node carries on by itself.
#[tokio::test]
async fn a_full_store_is_seen_fails_closed_and_heals() {
    let g = gateway_on(
        "full-store",
        "",
        "[budgets.agents.spender]\nlimit_usd = 1.0\n[decision_log]\nmax_bytes = 4194304\n",
        &[],
        NatsServer::start_small(24 << 20).await,
    )
    .await;
    let high = |q: &str| {
        g.post(
            json!({"model": "small", "oam": {"agent": "spender", "risk": "high"},
                      "messages": [{"role": "user", "content": q}]}),
        )
    };
    let (status, v) = high("before").await;
    assert_eq!(status, 200, "{v}");
    // Fill the store (bounded: at most 40 MB).
    let nc = oam::transport::connect::connect(&g._nats.url(), "filler", false, &Default::default())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(nc);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "FILLER".into(),
        subjects: vec!["filler".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut full = false;
    for _ in 0..40 {
        let ack = js.publish("filler", vec![0u8; 1 << 20].into()).await;
        if ack.is_err() || ack.unwrap().await.is_err() {
            full = true;
            break;
        }
    }
    assert!(full, "the store took 40 MB");
    let mut i = 0;
    let refused = crate::support::eventually(Duration::from_secs(10), || {
        i += 1;
        let q = format!("while full {i}");
        let high = &high;
        async move {
            let (status, v) = high(&q).await;
            (status != 200).then_some(v)
        }
    })
    .await
    .expect("high-risk work on a budget fails closed");
    assert!(
        codes(&refused).contains(&"BUDGET_STORE_UNREACHABLE".to_string()),
        "{refused}"
    );
    let s = oam::local::cluster::snapshot(&client(), &g.url)
        .await
        .unwrap();
    assert!(
        s.store_faults.contains_key("ledger"),
        "{:?}",
        s.store_faults
    );
    // Room again: the node carries on by itself.
    js.delete_stream("FILLER").await.unwrap();
    let mut i = 0;
    let served = crate::support::eventually(Duration::from_secs(10), || {
        i += 1;
        let q = format!("after {i}");
        let high = &high;
        async move {
            let (status, v) = high(&q).await;
            (status == 200).then_some(v)
        }
    })
    .await;
    assert!(served.is_some(), "high-risk work is served again");
    let s = oam::local::cluster::snapshot(&client(), &g.url)
        .await
        .unwrap();
    assert!(
        !s.store_faults.contains_key("ledger"),
        "{:?}",
        s.store_faults
    );
}

/// High risk on an exhausted budget: no guess, a 402 and an escalation that blocks the
/// automatic action; the same from the `X-OAM-*` headers.
#[tokio::test]
async fn an_exhausted_budget_refuses_high_risk_with_an_escalation() {
    let g = gateway_with("broke", "[budgets.agents.broke]\nlimit_usd = 0.0\n").await;
    let mut body =
        json!({"model": "small", "messages": [{"role": "user", "content": "wire the refund"}]});
    body["oam"] = json!({"agent": "broke", "risk": "high"});
    let r = client()
        .post(format!("{}/v1/chat/completions", g.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 402);
    assert_eq!(r.headers()["x-oam-phase"], "budget");
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v["oam"]["escalation"]["recommended_action"],
        "HUMAN_REVIEW_BLOCK_AUTOMATIC_ACTION"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("BUDGET_EXHAUSTED"),
        "{v}"
    );
    let r = client()
        .post(format!("{}/v1/chat/completions", g.url))
        .header("x-oam-agent", "broke")
        .header("x-oam-risk", "HIGH")
        .json(&json!({"model": "small", "messages": [{"role": "user", "content": "via headers"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 402);
    assert!(
        g.received("primary").await.is_empty(),
        "no provider was called"
    );
}

/// Bad input over HTTP: a 400 in the OpenAI envelope that names the field, headers included;
/// a body over the limit is a 413.
#[tokio::test]
async fn bad_input_gets_an_error_that_names_its_field() {
    let g = gateway("bad-input").await;
    let r = client()
        .post(format!("{}/v1/chat/completions", g.url))
        .header("content-type", "application/json")
        .body("{\"messages\": [{\"role\": \"user\", \"content\": 5}]}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.headers().contains_key("x-request-id"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "messages[0].content", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("messages[0].content"),
        "{v}"
    );
    let m = json!([{"role": "user", "content": "x"}]);
    for (body, param, says) in [
        (
            json!({"model": "gpt-9", "messages": m}),
            "model",
            "unknown model",
        ),
        // Values only the pipeline can judge name their field too.
        (
            json!({"messages": m, "oam": {"max_cost_usd": -1}}),
            "oam.max_cost_usd",
            "max_cost_usd",
        ),
        (
            json!({"messages": m, "oam": {"risk": "extreme"}}),
            "oam.risk",
            "risk",
        ),
    ] {
        let (status, v) = g.post(body).await;
        let not_found = says == "unknown model";
        assert_eq!(status, if not_found { 404 } else { 400 }, "{v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(says),
            "{v}"
        );
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let huge = "x".repeat(2 << 20);
    let (status, v) = g
        .post(json!({"messages": [{"role": "user", "content": huge}]}))
        .await;
    assert_eq!(status, 413);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_body_bytes"),
        "{v}"
    );
    assert!(
        g.received("primary").await.is_empty(),
        "no provider was called"
    );
}

/// Garbage on the control-plane subjects is counted, never applied, never a crash.
#[tokio::test]
async fn garbage_on_the_control_plane_is_counted_never_applied() {
    let g = gateway("garbage").await;
    let nc = oam::transport::connect::connect(&g._nats.url(), "test", false, &Default::default())
        .await
        .unwrap();
    let envelope = |sender: &str, seq: u64, body: &str| {
        format!(
            "{{\"id\":\"x{seq}\",\"sender\":\"{sender}\",\"at_ms\":0,\"incarnation\":1,\"seq\":{seq},\"body\":{body}}}"
        )
    };
    let garbage = [
        ("oam.v1.heartbeat.n9", "not json".to_string()),
        ("oam.v1.observations.n9", "{\"id\": 1}".to_string()),
        // n9 speaking for n1.
        (
            "oam.v1.heartbeat.n9",
            envelope("n9", 1, "{\"node\":\"n1\"}"),
        ),
        // A goodbye from n8, which is no member (the cluster has one seat).
        ("oam.v1.goodbye.n8", envelope("n8", 5, "{\"node\":\"n8\"}")),
    ];
    let state = || async {
        let r = client()
            .get(format!("{}/v1/oam/state", g.url))
            .send()
            .await
            .ok()?;
        r.json::<Value>().await.ok()
    };
    // Sent again each round: the node's gossip may not have subscribed yet when its HTTP
    // answers, and what nobody subscribes to is gone.
    let counted = crate::support::eventually(Duration::from_secs(5), || async {
        for (subject, payload) in &garbage {
            nc.publish(*subject, payload.clone().into()).await.ok()?;
        }
        nc.flush().await.ok()?;
        let s = state().await?;
        let bus = &s["bus"];
        (bus["malformed"].as_u64()? >= 2 && bus["forged"].as_u64()? >= 2).then_some(s)
    })
    .await;
    let s = counted.expect("bad messages were not counted");
    assert_eq!(s["live_nodes"], json!(["n1"]), "{s}");
    let (status, v) = g.ask("small", "still serving").await;
    assert_eq!(status, 200, "{v}");
}

/// Cached and reasoning tokens cost what their own prices say, from the usage the simulator
/// reports (a system prompt it has seen is read from its cache; `reasoning_effort` spends
/// reasoning tokens), through chat and through the Responses API.
#[tokio::test]
async fn cached_and_reasoning_tokens_are_priced_from_what_the_upstream_reports() {
    let extra = "[[provider]]\nid = \"priced\"\nbase_url = \"SIM/primary/v1\"\nmodel = \"big\"\n\
        probe = \"off\"\ncost_per_1k_tokens_usd = 0.01\noutput_cost_per_1k_usd = 0.04\n\
        cached_input_cost_per_1k_usd = 0.001\nreasoning_cost_per_1k_usd = 0.08\n\
        [[route]]\nmodel = \"priced\"\ntargets = [\"priced\"]\n";
    let g = gateway_with("priced", extra).await;
    let system = "You answer questions about the weather. ".repeat(40);
    let ask = |effort: Option<&str>| {
        let mut body = json!({"model": "priced", "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "Paris?"}]});
        if let Some(e) = effort {
            body["reasoning_effort"] = json!(e);
        }
        g.post(body)
    };
    // What the usage says it costs, at the configured prices.
    let priced = |v: &Value| {
        let u = &v["usage"];
        let n = |x: &Value| x.as_f64().unwrap_or(0.0);
        let (prompt, completion) = (n(&u["prompt_tokens"]), n(&u["completion_tokens"]));
        let cached = n(&u["prompt_tokens_details"]["cached_tokens"]);
        let reasoning = n(&u["completion_tokens_details"]["reasoning_tokens"]);
        ((prompt - cached) * 0.01
            + cached * 0.001
            + (completion - reasoning) * 0.04
            + reasoning * 0.08)
            / 1_000.0
    };
    let (status, first) = ask(None).await;
    assert_eq!(status, 200, "{first}");
    assert!(
        first["usage"]["prompt_tokens_details"].is_null(),
        "a first prompt is not cached: {first}"
    );
    let (_, second) = ask(None).await;
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        cached >= 400,
        "the system prompt is read from the cache: {second}"
    );
    let (_, thinking) = ask(Some("high")).await;
    assert_eq!(
        thinking["usage"]["completion_tokens_details"]["reasoning_tokens"], 32,
        "{thinking}"
    );
    for v in [&first, &second, &thinking] {
        let cost = v["oam"]["cost_usd"].as_f64().unwrap();
        assert!(
            (cost - priced(v)).abs() < 1e-9,
            "charged {cost}, the usage says {}: {v}",
            priced(v)
        );
    }
    let c1 = first["oam"]["cost_usd"].as_f64().unwrap();
    let c2 = second["oam"]["cost_usd"].as_f64().unwrap();
    assert!(
        c2 < c1 * 0.5,
        "a cached prompt costs less: {c2} against {c1}"
    );

    // The Responses API reports the same counts in its own names, at the same cost.
    let r = client()
        .post(format!("{}/v1/responses", g.url))
        .json(
            &json!({"model": "priced", "instructions": system, "input": "Paris?",
                      "reasoning": {"effort": "low"}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["usage"]["input_tokens_details"]["cached_tokens"].as_u64() >= Some(400),
        "{v}"
    );
    assert_eq!(
        v["usage"]["output_tokens_details"]["reasoning_tokens"], 8,
        "{v}"
    );
    let n = |x: &Value| x.as_f64().unwrap_or(0.0);
    let u = &v["usage"];
    let cached = n(&u["input_tokens_details"]["cached_tokens"]);
    let reasoning = n(&u["output_tokens_details"]["reasoning_tokens"]);
    let expected = ((n(&u["input_tokens"]) - cached) * 0.01
        + cached * 0.001
        + (n(&u["output_tokens"]) - reasoning) * 0.04
        + reasoning * 0.08)
        / 1_000.0;
    let cost = v["oam"]["cost_usd"].as_f64().unwrap();
    assert!(
        (cost - expected).abs() < 1e-9,
        "charged {cost}, the usage says {expected}: {v}"
    );
}

/// Each API refuses bad input in its own envelope, naming the field, and no provider is called.
#[tokio::test]
async fn each_api_refuses_bad_input_in_its_own_envelope() {
    let g = gateway("api-bad-input").await;
    let post = |path: &'static str, body: Value| {
        let url = format!("{}{path}", g.url);
        async move {
            let r = client().post(url).json(&body).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let hi = json!([{"role": "user", "content": "hi"}]);
    for (body, field) in [
        (json!({"model": "small", "messages": hi}), "max_tokens"),
        (
            json!({"model": "small", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video"}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"model": "small", "max_tokens": 8, "messages": hi, "top_k": 3}),
            "top_k",
        ),
    ] {
        let (status, v) = post("/v1/messages", body).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(
            (&v["type"], &v["error"]["type"]),
            (&json!("error"), &json!("invalid_request_error")),
            "{v}"
        );
        assert!(
            v["error"]["message"].as_str().unwrap().contains(field),
            "{field}: {v}"
        );
    }
    for (body, field) in [
        (
            json!({"model": "small", "input": "hi", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (
            json!({"model": "small", "input": "hi", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"model": "small", "input": [{"type": "item_reference", "id": "x"}]}),
            "input[0].type",
        ),
    ] {
        let (status, v) = post("/v1/responses", body).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], field, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    assert!(
        g.received("primary").await.is_empty(),
        "no provider was called"
    );
    assert!(
        g.received("secondary").await.is_empty(),
        "no provider was called"
    );
}

/// Tokens per minute: each request is admitted on its estimate (prompt plus `max_tokens`) and
/// charged what its usage says, so what the window served adds up to the limit, not to the
/// estimates; past it, 429 with `Retry-After`.
#[tokio::test]
async fn tokens_per_minute_are_charged_by_usage_and_bound_the_window() {
    let g = gateway_with("tpm", "[rate_limits.reader]\ntpm = 500\n").await;
    // The window is the clock's minute: the run (some 30 requests, a few seconds) starts early
    // enough in one to end in it.
    let window = oam::core::rates::WINDOW_MS;
    let into = oam::clock::now_ms() % window;
    if into > window - 15_000 {
        tokio::time::sleep(Duration::from_millis(window - into + 100)).await;
    }
    let mut used = 0;
    let mut served = 0;
    let mut refused = None;
    for i in 0..60 {
        let (status, v) = g
            .post(
                json!({"model": "small", "max_tokens": 100, "oam": {"agent": "reader"},
                "messages": [{"role": "user", "content": format!("read {i}")}]}),
            )
            .await;
        if status == 429 {
            refused = Some(v);
            break;
        }
        assert_eq!(status, 200, "{v}");
        served += 1;
        used += v["usage"]["total_tokens"].as_u64().unwrap();
    }
    let refused = refused.expect("the window ran out");
    assert!(
        codes(&refused).contains(&"RATE_LIMIT_EXCEEDED".into()),
        "{refused}"
    );
    // Admitted on estimates of about 100 tokens, charged about 25 each: far more than ten.
    assert!(served > 10, "{served} served, {used} tokens");
    assert!(used <= 500, "{used} tokens served under a limit of 500");
}

/// Traces in the tools operators run: with `[telemetry]` pointed at a real OTLP receiver, every
/// request is one SERVER span and every attempt one CLIENT span under it, with the GenAI
/// conventions' attributes and oam's own; a caller's `traceparent` is followed; a rerouted
/// request shows both attempts, the failed one with its error; a stream its time to first
/// chunk; a refusal its error class. Content only when asked for.
/// Configured by the standard variables alone (an OpenTelemetry operator's habit): endpoint,
/// protobuf, service name, resource attributes and headers. The receiver decodes the
/// protobuf with OpenTelemetry's own definitions and refuses unknown fields.
#[tokio::test]
async fn the_standard_otel_variables_export_protobuf_spans() {
    let mut receiver = crate::support::OtlpReceiver::start();
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ("OTEL_SERVICE_NAME", "checkout"),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment=test,team=ai",
        ),
        ("OTEL_EXPORTER_OTLP_HEADERS", "x-test-key=k%20env"),
    ];
    let g = gateway_with_env("otlp-env", "", &env).await;
    let (status, plain) = g.ask("small", "trace me over protobuf").await;
    assert_eq!(status, 200, "{plain}");
    let id = plain["oam"]["request_id"].as_str().unwrap().to_string();
    let spans = receiver
        .until(Duration::from_secs(15), |s| {
            s.iter()
                .any(|x| x["attributes"]["oam.request_id"] == id.as_str())
                && s.iter().any(|x| x["kind"] == 3)
        })
        .await;
    assert!(
        !spans.iter().any(|s| s.get("refused").is_some()),
        "the receiver refused an export: {spans:?}"
    );
    let server = spans
        .iter()
        .find(|s| s["kind"] == 2 && s["attributes"]["oam.request_id"] == id.as_str())
        .unwrap_or_else(|| panic!("no span for {id}: {spans:?}"));
    assert_eq!(server["content_type"], "application/x-protobuf");
    assert_eq!(server["resource"]["service.name"], "checkout");
    assert_eq!(server["resource"]["deployment.environment"], "test");
    assert_eq!(server["resource"]["team"], "ai");
    assert_eq!(server["header"], "k env");
    assert_eq!(server["name"], "chat small");
    assert_eq!(server["status"], 1, "OK");
    let a = &server["attributes"];
    assert_eq!(
        a["gen_ai.usage.input_tokens"], plain["usage"]["prompt_tokens"],
        "{a}"
    );
    assert_eq!(a["gen_ai.response.finish_reasons"], json!(["stop"]));
    assert_eq!(a["oam.decision"], "accepted");
    assert_eq!(server["trace_id"].as_str().unwrap().len(), 32);
    let attempt = spans
        .iter()
        .find(|s| s["kind"] == 3 && s["parent"] == server["span_id"])
        .unwrap_or_else(|| panic!("no attempt span: {spans:?}"));
    assert_eq!(attempt["trace_id"], server["trace_id"]);
    assert!(
        attempt["end"].as_u64().unwrap() >= attempt["start"].as_u64().unwrap(),
        "{attempt}"
    );
}

#[tokio::test]
async fn requests_are_traced_to_a_real_otlp_receiver() {
    let mut receiver = crate::support::OtlpReceiver::start();
    let extra = format!(
        r#"
[[route]]
model = "checked"
targets = ["primary/big", "secondary/medium"]
contract = {{}}

[telemetry]
otlp_endpoint = "{}"
service_name = "oam-test"
content = true
headers = {{ "x-test-key" = "k-123" }}
"#,
        receiver.url
    );
    let g = gateway_with("otlp", &extra).await;
    let span_of = |spans: &[Value], id: &str| -> Option<Value> {
        spans
            .iter()
            .find(|s| s["kind"] == 2 && s["attributes"]["oam.request_id"] == id)
            .cloned()
    };

    // A plain answer, in the caller's trace.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let r = client()
        .post(format!("{}/v1/chat/completions", g.url))
        .header(
            "traceparent",
            format!("00-{caller_trace}-00f067aa0ba902b7-01"),
        )
        .json(&json!({"model": "small", "max_tokens": 64,
                      "messages": [{"role": "user", "content": "trace me"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let plain: Value = r.json().await.unwrap();
    let plain_id = plain["oam"]["request_id"].as_str().unwrap().to_string();

    // Rerouted: the first target breaks the contract.
    g.fault(
        "primary/big",
        json!({"mode": "contract", "kind": "not-json", "times": 1}),
    )
    .await;
    let (status, rerouted) = g.ask("checked", "reroute me").await;
    assert_eq!(status, 200, "{rerouted}");
    let rerouted_id = rerouted["oam"]["request_id"].as_str().unwrap().to_string();

    // Streamed live.
    let (status, seen) = g.stream("small", "stream me").await;
    assert_eq!(status, 200);
    let stream_id = seen.oam()["request_id"].as_str().unwrap().to_string();

    // Refused: no target serves the model any more.
    g.fault("secondary/medium", json!({"mode": "error", "status": 500}))
        .await;
    g.fault("primary/big", json!({"mode": "error", "status": 500}))
        .await;
    let (status, refused) = g.ask("big", "fail me").await;
    assert_ne!(status, 200, "{refused}");
    let refused_id = refused["oam"]["request_id"].as_str().unwrap().to_string();

    let ids = [&plain_id, &rerouted_id, &stream_id, &refused_id];
    let spans = receiver
        .until(Duration::from_secs(15), |s| {
            ids.iter().all(|id| span_of(s, id).is_some())
        })
        .await;
    assert!(
        !spans.iter().any(|s| s.get("refused").is_some()),
        "the receiver refused an export: {spans:?}"
    );
    let request =
        |id: &str| span_of(&spans, id).unwrap_or_else(|| panic!("no span for {id}: {spans:?}"));
    let children = |parent: &Value| -> Vec<Value> {
        spans
            .iter()
            .filter(|s| s["parent"] == parent["span_id"] && s["kind"] == 3)
            .cloned()
            .collect()
    };

    let p = request(&plain_id);
    assert_eq!(p["trace_id"], caller_trace, "the caller's trace: {p}");
    assert_eq!(p["parent"], "00f067aa0ba902b7");
    assert_eq!(p["name"], "chat small");
    assert_eq!(p["status"], 1, "OK");
    assert_eq!(p["resource"]["service.name"], "oam-test");
    assert_eq!(p["resource"]["service.instance.id"], "n1");
    assert_eq!(p["header"], "k-123", "the configured headers are sent");
    let a = &p["attributes"];
    assert_eq!(a["gen_ai.operation.name"], "chat");
    assert_eq!(a["gen_ai.request.model"], "small");
    assert_eq!(a["gen_ai.response.model"], "small");
    assert_eq!(a["gen_ai.provider.name"], "openai");
    assert_eq!(a["gen_ai.request.max_tokens"], 64);
    assert_eq!(a["oam.decision"], "accepted");
    assert_eq!(a["oam.route"], "small");
    assert_eq!(a["oam.target"], "primary/small");
    assert_eq!(
        a["gen_ai.usage.input_tokens"], plain["usage"]["prompt_tokens"],
        "{a}"
    );
    assert_eq!(
        a["gen_ai.usage.output_tokens"],
        plain["usage"]["completion_tokens"]
    );
    assert_eq!(a["gen_ai.response.finish_reasons"], json!(["stop"]));
    let input: Value = serde_json::from_str(a["gen_ai.input.messages"].as_str().unwrap()).unwrap();
    assert_eq!(input[0]["parts"][0]["content"], "trace me");
    let output: Value =
        serde_json::from_str(a["gen_ai.output.messages"].as_str().unwrap()).unwrap();
    assert_eq!(
        output[0]["parts"][0]["content"],
        plain["choices"][0]["message"]["content"]
    );
    let kids = children(&p);
    assert_eq!(kids.len(), 1, "{kids:?}");
    assert_eq!(kids[0]["trace_id"], caller_trace);
    assert_eq!(kids[0]["name"], "chat small");
    assert!(
        kids[0]["start"].as_u64() >= p["start"].as_u64()
            && kids[0]["end"].as_u64() <= p["end"].as_u64()
    );

    let r = request(&rerouted_id);
    assert_eq!(
        r["attributes"]["oam.fallback_chain"],
        json!(["primary/big", "secondary"])
    );
    assert!(
        r["attributes"]["oam.reason_codes"]
            .as_array()
            .unwrap()
            .contains(&json!("CONTRACT_NOT_JSON"))
    );
    let kids = children(&r);
    assert_eq!(kids.len(), 2, "{kids:?}");
    let failed = kids
        .iter()
        .find(|k| k["attributes"]["oam.attempt"] == 1)
        .unwrap();
    assert_eq!(
        (
            failed["status"].as_u64(),
            failed["attributes"]["error.type"].as_str()
        ),
        (Some(2), Some("CONTRACT_NOT_JSON")),
        "{failed}"
    );
    let served = kids
        .iter()
        .find(|k| k["attributes"]["oam.attempt"] == 2)
        .unwrap();
    assert_eq!(served["status"], 1);
    assert_eq!(served["attributes"]["oam.target"], "secondary");
    assert!(
        failed["end"].as_u64() <= served["start"].as_u64(),
        "attempts in order"
    );

    let s = request(&stream_id);
    assert_eq!(s["attributes"]["oam.stream"], true);
    let ttft = s["attributes"]["gen_ai.response.time_to_first_chunk"]
        .as_f64()
        .unwrap();
    let whole = (s["end"].as_u64().unwrap() - s["start"].as_u64().unwrap()) as f64 / 1e9;
    assert!(
        ttft > 0.0 && ttft < whole,
        "first chunk at {ttft} s of {whole} s"
    );

    let f = request(&refused_id);
    assert_eq!(f["status"], 2, "ERROR");
    assert_eq!(f["attributes"]["oam.decision"], refused["oam"]["outcome"]);
    assert_eq!(
        f["attributes"]["error.type"], refused["error"]["code"],
        "{f}"
    );
    let kids = children(&f);
    assert!(!kids.is_empty(), "{refused}");
    assert!(
        !kids.is_empty()
            && kids
                .iter()
                .all(|k| k["status"] == 2 && k["attributes"]["error.type"].is_string()),
        "{kids:?}"
    );

    // Counted on /metrics.
    let text = crate::support::metrics(&g.url).await;
    assert!(
        text.contains("oam_otlp_spans_total{result=\"exported\"}"),
        "{text}"
    );
}

/// One judgement for every answer: a probe the target refuses as the request's fault (against
/// its content policy) is no health sample, as such an answer to a request is none; the
/// target stays healthy through a run of them.
#[tokio::test]
async fn a_content_policy_refusal_to_a_probe_leaves_the_target_healthy() {
    let extra = r#"
[[provider]]
id = "probed"
base_url = "SIM/primary/v1"
model = "probe-me"
probe = "chat"
"#;
    let g = gateway_on(
        "probe-refusal",
        "probe_interval_ms = 200",
        extra,
        &[],
        NatsServer::start().await,
    )
    .await;
    let probes = || async {
        g.received("primary")
            .await
            .iter()
            .filter(|r| r["model"] == "probe-me")
            .count()
    };
    let healthy = crate::support::eventually(Duration::from_secs(10), || async {
        (g.target("probed").await.consensus.verdict == Verdict::Healthy).then_some(())
    })
    .await;
    assert!(healthy.is_some(), "{:?}", g.target("probed").await);
    g.fault(
        "primary/probe-me",
        json!({"mode": "refuse", "reason": "content-policy"}),
    )
    .await;
    let before = probes().await;
    let refused = crate::support::eventually(Duration::from_secs(10), || async {
        (probes().await >= before + 8).then_some(())
    })
    .await;
    assert!(refused.is_some(), "the target was probed while it refused");
    let t = g.target("probed").await;
    assert_eq!(t.consensus.verdict, Verdict::Healthy, "{t:?}");
}

/// examples/oam.toml, the documented configuration with every key, is valid: a node runs on it
/// (pointed at a simulator of this test's) and answers a client by its key, and no other.
#[tokio::test]
async fn the_example_configuration_runs_a_node() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/oam.toml");
    let text = std::fs::read_to_string(path).unwrap();
    assert!(
        text.contains("http://127.0.0.1:8081/"),
        "it points at `oam sim`"
    );
    let sim = Proc::spawn(&["sim", "--listen", "127.0.0.1:0", "--json"]);
    let sim_url = sim.ready["url"].as_str().unwrap();
    let dir = std::env::temp_dir().join(format!("oam-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("oam.toml");
    std::fs::write(&cfg, text.replace("http://127.0.0.1:8081", sim_url)).unwrap();
    let nats = NatsServer::start().await;
    let key = "support-0123456789abcdef";
    let env = [
        ("OAM_EXAMPLE_KEY_SUPPORT", key),
        ("OAM_EXAMPLE_KEY_BATCH", "batch-0123456789abcdef"),
        ("OAM_EXAMPLE_PRIMARY_KEY", "sk-example"),
        ("OAM_EXAMPLE_TICKETS_KEY", "tk-example"),
    ];
    let nats_url = nats.url();
    // Its shared runtime on one worker thread (`--worker-threads 1`; HTTP on its lanes): it
    // serves the same.
    let node = Proc::spawn_with_env(
        &crate::support::node_args(
            "n1",
            &nats_url,
            &["--config", cfg.to_str().unwrap(), "--worker-threads", "1"],
        ),
        &env,
    );
    let url = node.ready["http"].as_str().unwrap().to_string();
    let ask = |key: Option<&'static str>| {
        let url = url.clone();
        async move {
            let mut r = client()
                .post(format!("{url}/v1/chat/completions"))
                .json(&json!({"model": "auto", "max_tokens": 64,
                              "messages": [{"role": "user", "content": "hello"}]}));
            if let Some(k) = key {
                r = r.bearer_auth(k);
            }
            let r = r.send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (status, v) = ask(Some(key)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["oam"]["agent"], "support-bot", "{v}");
    let (status, _) = ask(None).await;
    assert_eq!(status, 401, "a [[client]] makes keys required");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Streams are judged by their pace: a long healthy stream (its first event at 1.2 s, then an
/// event every 120 ms, 2.4 s in all) is no slow target. Judged by whole durations, eight of them
/// put the primary's p95 over the 1.5-s limit and its route moved to the fallback with nothing
/// failing.
#[tokio::test]
async fn long_healthy_streams_keep_their_route_on_its_primary() {
    let sim = Proc::spawn(&[
        "sim",
        "--listen",
        "127.0.0.1:0",
        "--json",
        "--provider",
        "primary=1200+0",
        "--provider",
        "local=20+0",
    ]);
    let sim_url = sim.ready["url"].as_str().unwrap();
    let dir = std::env::temp_dir().join(format!("oam-gw-pace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("oam.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"[node]
cluster_size = 1

[[provider]]
id = "primary"
base_url = "{sim_url}/primary/v1"
model = "long"
probe = "off"

[[provider]]
id = "local"
base_url = "{sim_url}/local/v1"
model = "short"
probe = "off"

[[route]]
model = "talk"
targets = ["primary", "local"]

[streaming]
first_token_ms = 5000
idle_ms = 2000
total_ms = 20000
"#
        ),
    )
    .unwrap();
    let nats = NatsServer::start().await;
    let node = crate::support::InProcessNode::start("n1", &cfg, &nats.url());
    let g = |i: usize| {
        let url = node.url.clone();
        async move {
            let body = json!({"model": "talk", "stream": true,
                "messages": [{"role": "user", "content": format!("tell me a long story {i}")}]});
            let text = client()
                .post(format!("{url}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let events = oam::http::sse::Parser::default()
                .feed(text.as_bytes())
                .unwrap();
            let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
            last["oam"]["target"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        }
    };
    let served = futures_util::future::join_all((0..8).map(g)).await;
    assert!(served.iter().all(|t| t == "primary"), "{served:?}");
    let s = oam::local::cluster::snapshot(&client(), &node.url)
        .await
        .unwrap();
    let primary = s.provider("primary").unwrap();
    let local = primary.local.expect("its own window");
    assert_eq!(local.samples, 8, "{primary:?}");
    assert!(local.p95_ms < 1_500, "judged by pace: {local:?}");
    assert_eq!(local.verdict(), Verdict::Healthy, "{primary:?}");
    // Once the node's view holds it, the route still starts on its primary.
    let shared = crate::support::eventually(Duration::from_secs(5), || async {
        let s = oam::local::cluster::snapshot(&client(), &node.url).await?;
        (s.provider("primary")?.consensus.verdict != Verdict::Unknown).then_some(s)
    })
    .await
    .expect("the node's own view is shared");
    let view = &shared.provider("primary").unwrap().consensus;
    assert_eq!(view.verdict, Verdict::Healthy, "{view:?}");
    assert_eq!(g(8).await, "primary", "the route stays on its primary");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Probes run on their own: a target whose probe hangs holds up no other target's (a round
/// used to wait for its slowest probe); and a target that answered 429 is not probed again
/// before its Retry-After.
#[tokio::test]
async fn a_hanging_probe_holds_up_no_other_and_a_retry_after_is_kept() {
    let extra = r#"
[[provider]]
id = "probed"
base_url = "SIM/primary/v1"
models = ["stuck", "quick", "limited"]
probe = "chat"
"#;
    let g = gateway_on(
        "probe-apart",
        "probe_interval_ms = 200\nprobe_timeout_ms = 1500",
        extra,
        &[],
        NatsServer::start().await,
    )
    .await;
    g.fault("primary/stuck", json!({"mode": "hang"})).await;
    g.fault(
        "primary/limited",
        json!({"mode": "rate-limit", "retry_after_ms": 30_000}),
    )
    .await;
    let probes = |model: &'static str| {
        let g = &g;
        async move {
            g.received("primary")
                .await
                .iter()
                .filter(|r| r["model"] == model)
                .count()
        }
    };
    let before = probes("quick").await;
    let kept_up = crate::support::eventually(Duration::from_secs(3), || async {
        (probes("quick").await >= before + 8).then_some(())
    })
    .await;
    assert!(
        kept_up.is_some(),
        "quick was probed {} times beside a hanging probe",
        probes("quick").await - before
    );
    let limited = probes("limited").await;
    assert!(
        (1..=2).contains(&limited),
        "probed {limited} times within its Retry-After"
    );
}

/// An upstream whose streams are paced like a model's: `/paced/v1` answers a stream with one
/// word every 100 ms for 4 s (then its finish and `[DONE]`), and a whole answer at once.
pub(crate) async fn paced_upstream() -> String {
    use futures_util::{StreamExt as _, stream};
    let app = axum::Router::new().route(
        "/paced/v1/chat/completions",
        axum::routing::post(|body: axum::Json<Value>| async move {
            if body["stream"] != true {
                let answer = json!({"id": "p", "object": "chat.completion", "created": 0,
                    "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "whole"}}]});
                return axum::Json(answer).into_response();
            }
            let chunk = |delta: Value, finish: Value| {
                let c = json!({"id": "p", "object": "chat.completion.chunk", "created": 0,
                    "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
                format!("data: {c}\n\n")
            };
            let words = stream::iter(0..40).then(move |i| async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok::<_, std::io::Error>(chunk(json!({"content": format!("w{i} ")}), Value::Null))
            });
            let end = stream::iter([
                Ok(chunk(json!({}), json!("stop"))),
                Ok("data: [DONE]\n\n".to_string()),
            ]);
            (
                [("content-type", "text/event-stream")],
                axum::body::Body::from_stream(words.chain(end)),
            )
                .into_response()
        }),
    );
    use axum::response::IntoResponse as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// A stream to `url` that is read to its end in the background: its status once the head came.
pub(crate) async fn open_stream(
    url: &str,
    q: &str,
) -> (
    u16,
    reqwest::header::HeaderMap,
    tokio::task::JoinHandle<String>,
) {
    let c = crate::support::http_unpooled(Duration::from_secs(30));
    let body = json!({"model": "x-paced", "stream": true,
                      "messages": [{"role": "user", "content": q}]});
    let r = c
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    (
        status,
        headers,
        tokio::spawn(async move { r.text().await.unwrap_or_default() }),
    )
}

pub(crate) fn paced_provider(up: &str) -> String {
    format!(
        "[[provider]]\nid = \"paced\"\nbase_url = \"{up}/paced/v1\"\nmodel = \"m\"\nprobe = \"off\"\n\
         [[route]]\nmodel = \"x-paced\"\ntargets = [\"paced/m\"]\n"
    )
}

/// Streams have slots of their own: past them a stream is refused at once (503, a reason code,
/// Retry-After) while short requests are still served; past every connection slot a new caller
/// is refused at once too (`CONNECTION_LIMIT`), never left in the kernel's queue, and the node's
/// metrics and state still answer.
#[tokio::test]
async fn streams_and_connections_past_their_limits_are_refused_at_once() {
    let up = paced_upstream().await;
    let extra = format!(
        "{}\n[pipeline.stream_bulkheads]\nnormal = {{ concurrency = 3, queue = 0 }}\n",
        paced_provider(&up)
    );
    let g = gateway_on(
        "stream-slots",
        "max_connections = 5",
        &extra,
        &[],
        NatsServer::start().await,
    )
    .await;
    let mut held = Vec::new();
    for i in 0..3 {
        let (status, _, body) = open_stream(&g.url, &format!("held {i}")).await;
        assert_eq!(status, 200);
        held.push(body);
    }
    // The fourth stream: no slot, no queue.
    let started = std::time::Instant::now();
    let (status, h, body) = open_stream(&g.url, "one too many").await;
    let refused_in = started.elapsed();
    assert_eq!(status, 503);
    assert!(refused_in < Duration::from_secs(1), "{refused_in:?}");
    assert_eq!(h["retry-after"], "1");
    assert!(
        h["x-oam-reasons"]
            .to_str()
            .unwrap()
            .contains("BULKHEAD_SHED"),
        "{h:?}"
    );
    drop(body);
    // A short request has slots of its own.
    let (status, v) = g.ask("small", "short, meanwhile").await;
    assert_eq!(status, 200, "{v}");
    let state = g.get("/v1/oam/state").await;
    assert_eq!(state["stream_bulkheads"]["normal"]["active"], 3, "{state}");
    assert_eq!(state["stream_bulkhead_limits"]["normal"]["concurrency"], 3);
    assert_eq!(state["bulkheads"]["normal"]["active"], 0);

    // Two callers send their headers and hold their bodies back: with the three streams, every
    // connection slot has a request in hand.
    let addr = g.url.trim_start_matches("http://").to_string();
    let mut pending = Vec::new();
    for _ in 0..2 {
        use tokio::io::AsyncWriteExt as _;
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            .await
            .unwrap();
        pending.push(s);
    }
    let in_hand = crate::support::eventually(Duration::from_secs(5), || async {
        let r = crate::support::http_unpooled(Duration::from_secs(5))
            .post(format!("{}/v1/chat/completions", g.url))
            .json(&json!({"model": "small", "messages": [{"role": "user", "content": "full?"}]}))
            .send()
            .await
            .ok()?;
        (r.status() == 503).then(|| r.headers().clone())
    })
    .await
    .expect("refused once every connection has a request in hand");
    assert_eq!(in_hand["x-oam-reasons"], "CONNECTION_LIMIT");
    assert_eq!(in_hand["retry-after"], "1");
    assert_eq!(in_hand["x-should-retry"], "true", "a moment later can help");
    // Refused at once, not queued behind the five.
    let started = std::time::Instant::now();
    let (status, h, _) = open_stream(&g.url, "still full").await;
    assert_eq!(
        (status, &h["x-oam-reasons"]),
        (
            503,
            &"CONNECTION_LIMIT"
                .parse::<reqwest::header::HeaderValue>()
                .unwrap()
        )
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    // The node's own endpoints still answer.
    let metrics = crate::support::metrics(&g.url).await;
    let refused = metrics
        .lines()
        .find_map(|l| l.strip_prefix("oam_http_connection_refused_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .expect("the refusals are counted");
    assert!(refused >= 2.0, "{refused}");
    // The held streams were never disturbed: each ends with its finish.
    drop(pending);
    for body in held {
        let text = body.await.unwrap();
        assert!(text.contains("w39") && text.contains("[DONE]"), "{text}");
    }
}

/// The attack: under `ulimit -n 1024`, connects that failed for want of descriptors were scored
/// as provider failures, opened the breaker, and 453 requests got `NO_PROVIDER_AVAILABLE`. A
/// node with more connections allowed than descriptors now refuses what it cannot carry with
/// `LOCAL_RESOURCE_EXHAUSTED` (or holds callers in the backlog until it can), and the provider
/// stays healthy with its breaker closed.
#[tokio::test]
async fn running_out_of_descriptors_is_never_the_provider_s_fault() {
    let up = paced_upstream().await;
    let g = gateway_built(
        "fds",
        "max_connections = 400",
        &paced_provider(&up),
        &[],
        NatsServer::start().await,
        true,
        Some(96),
    )
    .await;
    let mut streams = Vec::new();
    for i in 0..80 {
        let url = g.url.clone();
        streams.push(tokio::spawn(async move {
            let c = crate::support::http_unpooled(Duration::from_secs(40));
            let body = json!({"model": "x-paced", "stream": true,
                              "messages": [{"role": "user", "content": format!("fd {i}")}]});
            let r = c
                .post(format!("{url}/v1/chat/completions"))
                .json(&body)
                .send()
                .await;
            match r {
                Ok(r) => {
                    let reasons = r
                        .headers()
                        .get("x-oam-reasons")
                        .map(|v| v.to_str().unwrap_or("").to_string());
                    (Some(r.status().as_u16()), reasons.unwrap_or_default())
                }
                Err(_) => (None, String::new()),
            }
        }));
    }
    let mut short = 0;
    let mut served = 0;
    for s in streams {
        let (status, reasons) = s.await.unwrap();
        if status == Some(200) {
            served += 1;
        }
        if reasons.contains("LOCAL_RESOURCE_EXHAUSTED") {
            short += 1;
            assert_eq!(status, Some(503));
        }
        assert!(
            !reasons.contains("NO_PROVIDER_AVAILABLE") && !reasons.contains("CIRCUIT_OPEN"),
            "{reasons}"
        );
    }
    assert!(
        short > 0,
        "the node ran short of descriptors ({served} served)"
    );
    assert!(served > 0);
    // The provider is healthy and its breaker closed: the shortage was the node's.
    let state = g.get("/v1/oam/state").await;
    let paced = state["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == "paced")
        .unwrap_or_else(|| panic!("{state}"));
    assert_eq!(paced["breaker"]["state"], "closed", "{paced}");
    assert_ne!(paced["consensus"]["verdict"], "UNHEALTHY", "{paced}");
    let (status, text, _) = open_stream(&g.url, "after").await;
    assert_eq!(status, 200, "{text:?}");
}

/// The decision log keeps the node's state timeline beside its records: every record names a
/// version, the versions rebuild the state each record's own cut was taken from, and a record
/// replays under another route on the state of a target it never used (primary/big cooling
/// down after a long 429 when a `small` request came).
#[tokio::test]
async fn records_name_versions_of_a_state_timeline_that_replays_them_under_other_routes() {
    use oam::core::timeline::StateAt;
    use oam::transport::store::decisions;
    let g = gateway("timeline").await;
    g.fault(
        "primary/big",
        json!({"mode": "rate-limit", "retry_after_ms": 60_000, "times": 1}),
    )
    .await;
    let (status, v) = g.ask("big", "cooled").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(tried(&v), ["primary/big", "secondary"]);
    let mut ids = Vec::new();
    for i in 0..3 {
        let (status, v) = g.ask("small", &format!("after {i}")).await;
        assert_eq!(status, 200, "{v}");
        ids.push(v["oam"]["request_id"].as_str().unwrap().to_string());
    }
    let nats = oam::transport::connect::connect(&g._nats.url(), "test", false, &Default::default())
        .await
        .unwrap();
    let records = crate::support::eventually(Duration::from_secs(10), || async {
        let (read, _) = decisions::read(&nats, 0, Some("n1"), |_| true, usize::MAX)
            .await
            .ok()?;
        (read.len() >= 4).then_some(read)
    })
    .await
    .expect("four records in the log");
    let run = records[0].run.clone();
    assert!(!run.is_empty() && records.iter().all(|r| r.run == run));
    let entries = decisions::timeline(&nats, "n1", &run).await.unwrap();
    assert!(entries[0].whole, "the timeline opens with a whole state");
    let mut versions = std::collections::BTreeMap::new();
    let mut at: Option<StateAt> = None;
    for e in &entries {
        match at.as_mut() {
            None => at = Some(StateAt::of(e).unwrap()),
            Some(s) => s.then(e).unwrap(),
        }
        let s = at.clone().unwrap();
        versions.insert(s.version, s);
    }
    for r in &records {
        let rec = &r.record;
        let seen = versions
            .get(&rec.begin.seen)
            .expect("its version is in the log");
        // The record's own cut is the timeline's state of its targets.
        for t in &rec.begin.state.providers {
            let id = &*t.id;
            assert_eq!(rec.begin.state.breakers.get(id), seen.breakers.get(id));
            assert_eq!(rec.begin.state.cooldowns.get(id), seen.cooldowns.get(id));
            assert_eq!(
                rec.begin.state.cluster.observations.get(id),
                seen.cluster.observations.get(id)
            );
        }
        // Under its own config it replays to its decision.
        let same = rec
            .replay_under(&r.config, &seen.providers, &seen.routes, |v| {
                versions.get(&v)
            })
            .unwrap();
        assert_eq!(
            serde_json::to_string(&same).unwrap(),
            serde_json::to_string(&rec.decision).unwrap()
        );
    }
    // A candidate putting primary/big first on `small`: it was cooling down, so primary/small
    // still serves each of them, as a fallback.
    let last = versions.values().last().unwrap();
    assert!(last.cooldowns.contains_key("primary/big"));
    let mut candidate = last.routes.clone();
    let small = candidate.get_mut("small").unwrap();
    small.targets.insert(0, "primary/big".into());
    for r in records
        .iter()
        .filter(|r| ids.contains(&r.record.decision.request_id))
    {
        assert!(
            r.record.begin.state.cooldowns.is_empty(),
            "its own cut never saw it"
        );
        let d = r
            .record
            .replay_under(&r.config, &last.providers, &candidate, |v| versions.get(&v))
            .unwrap();
        let served = d.attempts.last().unwrap();
        assert_eq!(served.provider.as_deref(), Some("primary/small"));
        assert!(served.fallback);
    }
}

/// Reading a stream by direct get in batches: a batch that ends short because of its bytes
/// (the reader asks for 4 MB at most; the server's own cap is about 64 MB) is not the stream's
/// end; the server's end-of-batch says how many are left. Before, it was taken for the end:
/// `oam rehearse` read 244 of a log's 547 messages (30,255 of 67,928 records) and said
/// nothing; here the old reader stopped after the first batch of 200 KB messages.
#[tokio::test]
async fn a_stream_of_large_messages_is_read_to_its_end() {
    let server = crate::support::NatsServer::start().await;
    let nc = oam::transport::connect::connect(&server.url(), "test", false, &Default::default())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(nc.clone());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "BIG".into(),
        subjects: vec!["big.>".into()],
        allow_direct: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let payload = vec![b'x'; 200 * 1024];
    for i in 0..100 {
        js.publish(format!("big.{}", i % 3), payload.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    let next = oam::transport::store::read_on(&nc, "BIG", "big.>", 1, |m| {
        seen.push(m.sequence);
        true
    })
    .await
    .unwrap();
    assert_eq!(seen, (1..=100).collect::<Vec<u64>>());
    assert_eq!(next, 101);
}
