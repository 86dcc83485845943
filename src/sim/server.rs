//! The simulator's HTTP server: an OpenAI-compatible API per provider plus a small fault API.
//!
//! - `POST /{provider}/v1/chat/completions`, `GET /{provider}/v1/models` (which fails only
//!   under a hard `error` outage: the host is down; a flaky or broken model still lists): one base URL per
//!   provider (`http://HOST:PORT/{provider}/v1`), what an OpenAI client is pointed at.
//! - `POST /v1/chat/completions`, `GET /v1/models`: all providers, chosen by `model` (the
//!   provider id or its model name).
//! - `POST /{provider}/v1/messages`, `POST /v1/messages`: the same providers speaking
//!   Anthropic's Messages API (`anthropic-version` required; answers, event streams and errors
//!   in its shapes, with the same faults), for `api = "anthropic"` targets.
//! - `POST /{provider}/v1/responses`, `POST /v1/responses`: the same providers speaking
//!   OpenAI's Responses API (typed event streams; `previous_response_id` and hosted tools
//!   refused by name), with the same faults.
//! - `POST /{provider}/v1/embeddings`, `POST /v1/embeddings`: a deterministic unit vector per
//!   input (`dimensions`, default 8; `float` or `base64`), with the same faults; under a
//!   contract fault the list is one short, a quiet failure a gateway must catch.
//! - `POST /mcp`: a tool server (Model Context Protocol) with an order desk's tools (`tools`).
//! - `GET /sim/faults`, `POST /sim/faults`, `DELETE /sim/faults[/{provider}]`: the fault API.
//! - `GET /healthz`.
//!
//! Usage is reported as providers report it: a system prompt a provider has seen before is
//! read from its cache (`prompt_tokens_details.cached_tokens`), and a request with
//! `reasoning_effort` spends reasoning tokens (`completion_tokens_details.reasoning_tokens`).
//! Over Messages, the first sight of a system prompt is reported as written to the cache
//! (`cache_creation_input_tokens`), later ones as read from it (`cache_read_input_tokens`).

use super::model::{self, Faults, Handling, SimProvider};
use super::{messages, responses, text_of};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The running simulator's shared state.
pub(crate) struct Sim {
    seed: u64,
    providers: BTreeMap<String, (SimProvider, AtomicU64)>,
    faults: Mutex<Faults>,
    started: Instant,
    /// The last chat requests each provider received (at most `REQUESTS_KEPT`), as sent
    /// (`GET /sim/requests/{provider}`), so a test can check what a gateway passed through.
    last: Mutex<BTreeMap<String, std::collections::VecDeque<Value>>>,
    /// The system prompts each provider has seen (their hashes): a prompt that begins with one
    /// again is read from the cache, as a provider's prompt cache would (at most
    /// `CACHED_KEPT` kept).
    cached: Mutex<std::collections::HashSet<(String, u64)>>,
}

/// System prompts the simulator remembers for its prompt cache.
const CACHED_KEPT: usize = 10_000;

impl Sim {
    pub(crate) fn new(seed: u64, providers: Vec<SimProvider>) -> Self {
        Sim {
            seed,
            providers: providers
                .into_iter()
                .map(|p| (p.id.clone(), (p, AtomicU64::new(0))))
                .collect(),
            faults: Mutex::new(Faults::default()),
            started: Instant::now(),
            last: Mutex::default(),
            cached: Mutex::default(),
        }
    }

    /// Milliseconds since the sim started: the clock faults are timed on.
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn faults(&self) -> std::sync::MutexGuard<'_, Faults> {
        // A poisoned lock only means a handler panicked mid-update; the map is still usable.
        self.faults
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Remember `body` among the last requests `provider` received.
    /// The tokens of `req`'s system prompt that `provider` reads from its cache, and those it
    /// writes to it: read when it has seen the same system prompt before, else written (and
    /// remembered now).
    fn cached_tokens(&self, provider: &str, req: &ChatRequest) -> (u64, u64) {
        let Some(system) = req.messages.first().filter(|m| m.role == "system") else {
            return (0, 0);
        };
        let text = text_of(&system.content);
        let key = (
            provider.to_string(),
            xxhash_rust::xxh3::xxh3_64(text.as_bytes()),
        );
        let mut seen = self
            .cached
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let tokens = (text.len() as u64).div_ceil(4);
        if seen.contains(&key) {
            return (tokens, 0);
        }
        if seen.len() < CACHED_KEPT {
            seen.insert(key);
        }
        (0, tokens)
    }

    fn received(&self, provider: &str, body: &Bytes) {
        if let Ok(v) = serde_json::from_slice::<Value>(body) {
            let mut last = self
                .last
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let kept = last.entry(provider.to_string()).or_default();
            if kept.len() == REQUESTS_KEPT {
                kept.pop_front();
            }
            kept.push_back(v);
        }
    }

    /// What `provider` replies to its `k`th request, for `model` (else its own), asking
    /// `question`: under the fault on that model of it, else on it (a hang waited out); the
    /// fault, and when.
    async fn reply(
        &self,
        provider: &SimProvider,
        k: u64,
        model: Option<&str>,
        question: &str,
    ) -> (Handling, Option<model::ActiveFault>, u64) {
        let now = self.now_ms();
        let fault = {
            let mut faults = self.faults();
            let model = model.unwrap_or(&provider.model);
            faults
                .get(&format!("{}/{model}", provider.id), now)
                .or_else(|| faults.get(&provider.id, now))
        };
        let mut reply = model::reply(self.seed, provider, k, question, fault, now);
        if let Handling::Hang { until_ms } = reply {
            tokio::time::sleep(Duration::from_millis(until_ms.saturating_sub(now))).await;
            reply = model::reply(self.seed, provider, k, question, None, self.now_ms());
        }
        (reply, fault, now)
    }

    fn find(&self, name: &str) -> Option<&(SimProvider, AtomicU64)> {
        self.providers
            .get(name)
            .or_else(|| self.providers.values().find(|(p, _)| p.model == name))
    }
}

pub(crate) fn router(sim: Arc<Sim>) -> Router {
    let apis = [Speaks::Chat, Speaks::Messages, Speaks::Responses];
    apis.into_iter()
        .fold(Router::new(), api_routes)
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/mcp", post(super::tools::mcp))
        .route("/v1/models", get(all_models))
        .route("/{provider}/v1/models", get(provider_models))
        .route("/v1/embeddings", post(embeddings_any))
        .route("/{provider}/v1/embeddings", post(embeddings_provider))
        .route(
            "/sim/faults",
            get(list_faults).post(set_fault).delete(clear_all),
        )
        .route("/sim/faults/{provider}", axum::routing::delete(clear_one))
        .route("/sim/requests/{provider}", get(last_request))
        .fallback(|| async {
            openai_error(
                StatusCode::NOT_FOUND,
                "not_found",
                "no such endpoint; try POST /{provider}/v1/chat/completions or GET /sim/faults",
            )
        })
        .with_state(sim)
}

/// An error in `api`'s envelope.
fn api_error(api: Speaks, status: StatusCode, code: &str, message: &str) -> Response {
    match api {
        Speaks::Chat | Speaks::Responses => openai_error(status, code, message),
        Speaks::Messages => (status, axum::Json(messages::error(status, message))).into_response(),
    }
}

/// An OpenAI-style error envelope.
fn openai_error(status: StatusCode, code: &str, message: &str) -> Response {
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
    (status, axum::Json(body)).into_response()
}

fn model_entry(p: &SimProvider) -> Value {
    json!({"id": p.model, "object": "model", "created": 0, "owned_by": format!("oam-sim/{}", p.id)})
}

async fn all_models(State(sim): State<Arc<Sim>>) -> Response {
    let data: Vec<Value> = sim
        .providers
        .values()
        .map(|(p, _)| model_entry(p))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn provider_models(State(sim): State<Arc<Sim>>, Path(name): Path<String>) -> Response {
    // A hard outage takes the whole host down, its model list too; every other fault (a
    // flaky, slow or broken model) leaves the list answering, as a real host's does.
    let now = sim.now_ms();
    let down = sim.faults().active(now).get(&name).map(|f| f.mode);
    if let Some(model::FaultMode::Error { status }) = down {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return openai_error(status, "server_error", "simulated outage");
    }
    match sim.providers.get(&name) {
        Some((p, _)) => {
            axum::Json(json!({"object": "list", "data": [model_entry(p)]})).into_response()
        }
        None => unknown_provider(&sim, &name),
    }
}

fn unknown_provider(sim: &Sim, name: &str) -> Response {
    let known: Vec<&str> = sim.providers.keys().map(String::as_str).collect();
    openai_error(
        StatusCode::NOT_FOUND,
        "model_not_found",
        &format!(
            "no provider or model {name:?}; this sim has {}",
            known.join(", ")
        ),
    )
}

/// Sleep `ms`, or not at all for 0 (tokio rounds even a zero sleep up to a timer tick, ~1 ms,
/// which would put a floor under a zero-latency provider).
async fn pause(ms: u64) {
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

#[derive(Deserialize)]
struct ChatRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    stream: bool,
    /// Tools the caller declared: a user turn is answered with a call to the first.
    #[serde(default)]
    tools: Vec<Value>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// `low`, `medium` or `high`: the answer spends 8, 16 or 32 tokens reasoning first.
    #[serde(default)]
    reasoning_effort: Option<String>,
    /// Over Messages, extended thinking was asked for: the answer starts with a thinking block.
    #[serde(default)]
    sim_thinking: bool,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct ChatMessage {
    #[serde(default)]
    role: String,
    #[serde(default)]
    content: Value,
}

/// Why a chat request was refused: (code, message), always a 400.
type BadRequest = (&'static str, String);

fn parse_chat(body: &Bytes) -> Result<ChatRequest, BadRequest> {
    let req: ChatRequest = serde_json::from_slice(body).map_err(|e| {
        (
            "invalid_json",
            format!("the body is not a valid chat completion request: {e}"),
        )
    })?;
    if req.messages.is_empty() {
        return Err((
            "invalid_request",
            "messages must hold at least one message".into(),
        ));
    }
    Ok(req)
}

/// How many of the last chat requests the simulator keeps per provider.
const REQUESTS_KEPT: usize = 64;

/// The last chat requests `provider` received, oldest first, as they were sent (404 before the
/// first).
async fn last_request(State(sim): State<Arc<Sim>>, Path(name): Path<String>) -> Response {
    let last = sim
        .last
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&name)
        .cloned();
    match last {
        Some(v) => axum::Json(Value::Array(v.into())).into_response(),
        None => openai_error(
            StatusCode::NOT_FOUND,
            "not_found",
            &format!("{name} has received no chat request yet"),
        ),
    }
}

/// The API a request came in, and its answer goes out, in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Speaks {
    Chat,
    Messages,
    Responses,
}

impl Speaks {
    /// The path after `/v1/`.
    fn path(self) -> &'static str {
        match self {
            Speaks::Chat => "chat/completions",
            Speaks::Messages => "messages",
            Speaks::Responses => "responses",
        }
    }

    /// The request as the chat request the providers answer, or why it gets a 400.
    fn parse(self, headers: &HeaderMap, body: &Bytes) -> Result<ChatRequest, BadRequest> {
        let refused = |why: String| ("invalid_request", why);
        let chat = match self {
            Speaks::Chat => return parse_chat(body),
            Speaks::Messages if !headers.contains_key("anthropic-version") => {
                return Err(refused("anthropic-version: header is required".into()));
            }
            Speaks::Messages => messages::to_chat(body),
            Speaks::Responses => responses::to_chat(body),
        }
        .map_err(|why| refused(why.0))?;
        serde_json::from_value(chat).map_err(|e| refused(format!("{}: {e}", self.path())))
    }

    /// A 400 in this API's envelope.
    fn refuse(self, (code, why): BadRequest) -> Response {
        api_error(self, StatusCode::BAD_REQUEST, code, &why)
    }
}

/// A request to all providers, answered by the one its `model` names.
async fn serve_any(sim: Arc<Sim>, headers: HeaderMap, body: Bytes, speaks: Speaks) -> Response {
    let req = match speaks.parse(&headers, &body) {
        Ok(r) => r,
        Err(why) => return speaks.refuse(why),
    };
    let Some(name) = req.model.clone() else {
        let why = format!(
            "model is required here; or post to /{{provider}}/v1/{}",
            speaks.path()
        );
        return speaks.refuse(("invalid_request", why));
    };
    match sim.find(&name) {
        Some((p, _)) => {
            let id = p.id.clone();
            sim.received(&id, &body);
            answer(&sim, &id, req, speaks).await
        }
        None => unknown_provider(&sim, &name),
    }
}

/// A request to the provider named in the path.
async fn serve_provider(
    sim: Arc<Sim>,
    name: String,
    headers: HeaderMap,
    body: Bytes,
    speaks: Speaks,
) -> Response {
    if !sim.providers.contains_key(&name) {
        return unknown_provider(&sim, &name);
    }
    sim.received(&name, &body);
    match speaks.parse(&headers, &body) {
        Ok(req) => answer(&sim, &name, req, speaks).await,
        Err(why) => speaks.refuse(why),
    }
}

/// The routes of one API: `/v1/{path}` and `/{provider}/v1/{path}`.
fn api_routes(router: Router<Arc<Sim>>, speaks: Speaks) -> Router<Arc<Sim>> {
    let any = move |State(sim): State<Arc<Sim>>, headers: HeaderMap, body: Bytes| {
        serve_any(sim, headers, body, speaks)
    };
    let one = move |State(sim): State<Arc<Sim>>,
                    Path(name): Path<String>,
                    headers: HeaderMap,
                    body: Bytes| serve_provider(sim, name, headers, body, speaks);
    router
        .route(&format!("/v1/{}", speaks.path()), post(any))
        .route(&format!("/{{provider}}/v1/{}", speaks.path()), post(one))
}

/// The texts of an embeddings `input` (a string, strings, or token arrays read as their ids),
/// or why it is refused.
fn embedding_inputs(input: &Value) -> Result<Vec<String>, super::NotServed> {
    let items = match input {
        Value::String(_) => vec![input.clone()],
        Value::Array(a) if a.first().is_some_and(Value::is_number) => vec![input.clone()],
        Value::Array(a) => a.clone(),
        _ => {
            return Err(super::NotServed(
                "input must be a string, strings or token arrays".into(),
            ));
        }
    };
    if items.is_empty() {
        return Err(super::NotServed("input must hold at least one item".into()));
    }
    items
        .iter()
        .map(|i| match i {
            Value::String(s) if !s.is_empty() => Ok(s.clone()),
            Value::Array(t) if !t.is_empty() => Ok(i.to_string()),
            _ => Err("each input must be a non-empty string or token array".into()),
        })
        .collect()
}

/// A unit vector of `dims` for `text`, the same every time.
fn embedding_of(seed: u64, text: &str, dims: usize) -> Vec<f32> {
    let v: Vec<f32> = (0..dims as u64)
        .map(|i| {
            let h = xxhash_rust::xxh3::xxh3_64_with_seed(text.as_bytes(), seed ^ i);
            (h as f64 / u64::MAX as f64 * 2.0 - 1.0) as f32
        })
        .collect();
    let norm = v
        .iter()
        .map(|x| x * x)
        .sum::<f32>()
        .sqrt()
        .max(f32::EPSILON);
    v.into_iter().map(|x| x / norm).collect()
}

async fn embeddings_any(State(sim): State<Arc<Sim>>, body: Bytes) -> Response {
    let model = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["model"].as_str().map(String::from));
    let Some(name) = model else {
        return openai_error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "model is required here; or post to /{provider}/v1/embeddings",
        );
    };
    match sim.find(&name) {
        Some((p, _)) => {
            let id = p.id.clone();
            embed(&sim, &id, &body).await
        }
        None => unknown_provider(&sim, &name),
    }
}

async fn embeddings_provider(
    State(sim): State<Arc<Sim>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    if !sim.providers.contains_key(&name) {
        return unknown_provider(&sim, &name);
    }
    embed(&sim, &name, &body).await
}

/// `provider`'s embeddings for the request `body`, under its faults.
async fn embed(sim: &Sim, provider_id: &str, body: &Bytes) -> Response {
    use base64::Engine as _;
    let Some((provider, counter)) = sim.providers.get(provider_id) else {
        return unknown_provider(sim, provider_id);
    };
    sim.received(provider_id, body);
    let req: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            let why = format!("the body is not JSON: {e}");
            return openai_error(StatusCode::BAD_REQUEST, "invalid_json", &why);
        }
    };
    let inputs = match embedding_inputs(&req["input"]) {
        Ok(i) => i,
        Err(why) => return openai_error(StatusCode::BAD_REQUEST, "invalid_request", &why.0),
    };
    let dims = req["dimensions"].as_u64().unwrap_or(8).clamp(1, 4_096) as usize;
    let base64 = req["encoding_format"] == "base64";
    let k = counter.fetch_add(1, Ordering::Relaxed);
    let model = req["model"].as_str().unwrap_or(&provider.model).to_string();
    let (reply, fault, _) = sim.reply(provider, k, Some(&model), &inputs[0]).await;
    let Handling::Answer { delay_ms, .. } = reply else {
        return failure(Speaks::Chat, reply).await;
    };
    pause(delay_ms).await;
    let broken = fault.is_some_and(|f| matches!(f.mode, model::FaultMode::Contract { .. }));
    let kept = if broken {
        inputs.len() - 1
    } else {
        inputs.len()
    };
    let data: Vec<Value> = inputs[..kept]
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let v = embedding_of(sim.seed, text, dims);
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let tokens: u64 = inputs.iter().map(|t| (t.len() as u64).div_ceil(4)).sum();
    axum::Json(json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response()
}

/// A user's turn with tools declared is answered with a call to the first tool, each required
/// argument set to the question; after the tool's result, with an answer. Under a contract
/// fault the arguments break: cut short (not JSON), missing every field, or of the wrong type.
fn tool_call(
    messages: &[ChatMessage],
    tools: &[Value],
    question: &str,
    brk: Option<crate::core::chaos::ContractBreak>,
) -> Option<Value> {
    use crate::core::chaos::ContractBreak;
    let function = &tools.first()?["function"];
    if messages.last()?.role != "user" {
        return None;
    }
    let args: serde_json::Map<String, Value> = function["parameters"]["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|name| {
            let value = match brk {
                Some(ContractBreak::LowConfidence) => json!(42),
                _ => json!(question),
            };
            Some((name.as_str()?.to_string(), value))
        })
        .collect();
    let mut arguments = Value::Object(args).to_string();
    match brk {
        Some(ContractBreak::NotJson | ContractBreak::Truncated) => {
            let mut cut = arguments.len() / 2;
            while !arguments.is_char_boundary(cut) {
                cut -= 1;
            }
            arguments.truncate(cut);
        }
        Some(ContractBreak::MissingField) => arguments = "{}".into(),
        _ => {}
    }
    Some(json!({
        "id": format!("call_{:08x}", question.len()),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }))
}

/// `provider`'s answer to `req`, in `api`'s shapes.
async fn answer(sim: &Sim, provider_id: &str, req: ChatRequest, api: Speaks) -> Response {
    let Some((provider, counter)) = sim.providers.get(provider_id) else {
        return unknown_provider(sim, provider_id);
    };
    let k = counter.fetch_add(1, Ordering::Relaxed);
    let question = req
        .messages
        .iter()
        .rev()
        .find(|m| m.role == "user")
        .map(|m| text_of(&m.content))
        .unwrap_or_default();
    let prompt_chars: usize = req.messages.iter().map(|m| text_of(&m.content).len()).sum();
    let (reply, fault, now) = sim
        .reply(provider, k, req.model.as_deref(), &question)
        .await;
    match reply {
        Handling::Answer {
            delay_ms,
            content,
            finish_reason,
        } => {
            pause(delay_ms).await;
            // The assistant's last turn is a prefill (the start of an answer that was cut):
            // continued, not answered afresh after it.
            let content = match req.messages.last() {
                Some(m) if m.role == "assistant" && !text_of(&m.content).is_empty() => {
                    model::continue_after(&text_of(&m.content), provider_id)
                }
                _ => content,
            };
            let created = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let prompt_tokens = (prompt_chars as u64).div_ceil(4);
            let completion_tokens = (content.len() as u64).div_ceil(4);
            let (cached_tokens, written_tokens) = sim.cached_tokens(provider_id, &req);
            let cached_tokens = cached_tokens.min(prompt_tokens);
            let model = req.model.unwrap_or_else(|| provider.model.clone());
            let brk = fault.and_then(|f| match f.mode {
                model::FaultMode::Contract { kind } => Some(kind),
                _ => None,
            });
            let call = tool_call(&req.messages, &req.tools, &question, brk);
            let (message, finish_reason) = match call {
                Some(call) if finish_reason == "stop" || brk.is_some() => (
                    json!({"role": "assistant", "content": null, "tool_calls": [call]}),
                    "tool_calls".to_string(),
                ),
                _ => (
                    json!({"role": "assistant", "content": content}),
                    finish_reason.to_string(),
                ),
            };
            let reasoning_tokens = match req.reasoning_effort.as_deref() {
                Some("low") => 8,
                Some("medium") => 16,
                Some("high") => 32,
                _ => 0,
            };
            let completion_tokens = completion_tokens + reasoning_tokens;
            let mut usage = json!({
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            });
            if cached_tokens > 0 {
                usage["prompt_tokens_details"] = json!({"cached_tokens": cached_tokens});
            }
            if reasoning_tokens > 0 {
                usage["completion_tokens_details"] = json!({"reasoning_tokens": reasoning_tokens});
            }
            // Only Messages reports what a prompt wrote to the cache.
            if api == Speaks::Messages && written_tokens > 0 {
                usage["cache_creation_input_tokens"] = json!(written_tokens.min(prompt_tokens));
            }
            if req.stream {
                let head = json!({
                    "id": format!("chatcmpl-sim-{}-{k}", provider.id),
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "system_fingerprint": format!("oam-sim-{}", provider.id),
                });
                let usage = req
                    .stream_options
                    .is_some_and(|o| o.include_usage)
                    .then_some(usage);
                let brk = fault.and_then(|f| match f.mode {
                    model::FaultMode::Stream { kind, after_chunks } => {
                        Some((kind, after_chunks as usize, f.until_ms.saturating_sub(now)))
                    }
                    _ => None,
                });
                let plan = Streamed {
                    api,
                    head,
                    message,
                    finish_reason,
                    usage,
                    chunk_ms: provider.latency_ms / 10,
                    brk,
                };
                return plan.into_response();
            }
            let chat = json!({
                "id": format!("chatcmpl-sim-{}-{k}", provider.id),
                "object": "chat.completion",
                "created": created,
                "model": model,
                "system_fingerprint": format!("oam-sim-{}", provider.id),
                "choices": [{
                    "index": 0,
                    "message": message,
                    "finish_reason": finish_reason,
                }],
                "usage": usage,
            });
            match api {
                Speaks::Chat => axum::Json(chat).into_response(),
                Speaks::Messages => axum::Json(messages::message(
                    &format!("sim-{}-{k}", provider.id),
                    &model,
                    &chat["choices"][0]["message"],
                    chat["choices"][0]["finish_reason"]
                        .as_str()
                        .unwrap_or("stop"),
                    &chat["usage"],
                    req.sim_thinking,
                ))
                .into_response(),
                Speaks::Responses => axum::Json(responses::response(
                    &format!("sim-{}-{k}", provider.id),
                    &model,
                    created,
                    &chat["choices"][0]["message"],
                    chat["choices"][0]["finish_reason"]
                        .as_str()
                        .unwrap_or("stop"),
                    &chat["usage"],
                ))
                .into_response(),
            }
        }
        other => failure(api, other).await,
    }
}

/// What a provider answers instead of an answer: an error status, a rate limit, a refusal, a
/// reset connection (in `api`'s envelope).
async fn failure(api: Speaks, reply: Handling) -> Response {
    match reply {
        Handling::Answer { .. } => openai_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "an answer is no failure",
        ),
        Handling::Fail { delay_ms, status } => {
            pause(delay_ms).await;
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            api_error(api, status, "upstream_error", "simulated provider outage")
        }
        Handling::RateLimited { retry_after_ms } => {
            let mut resp = api_error(
                api,
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_exceeded",
                "simulated rate limit",
            );
            let secs = retry_after_ms.div_ceil(1_000).to_string();
            let headers = resp.headers_mut();
            if let Ok(v) = HeaderValue::from_str(&secs) {
                headers.insert(header::RETRY_AFTER, v);
            }
            if let Ok(v) = HeaderValue::from_str(&retry_after_ms.to_string()) {
                headers.insert("retry-after-ms", v);
            }
            resp
        }
        Handling::Refuse(reason) => {
            use model::Refusal;
            let (status, code, message) = match reason {
                Refusal::ContextLength => (
                    StatusCode::BAD_REQUEST,
                    "context_length_exceeded",
                    "This model's maximum context length is 4096 tokens; your messages are longer.",
                ),
                Refusal::ContentPolicy => (
                    StatusCode::BAD_REQUEST,
                    "content_policy_violation",
                    "Your request was rejected as a result of our safety system.",
                ),
                Refusal::Auth => (
                    StatusCode::UNAUTHORIZED,
                    "invalid_api_key",
                    "Incorrect API key provided.",
                ),
            };
            api_error(api, status, code, message)
        }
        Handling::Reset => {
            // A body that fails after the headers: the server drops the connection mid-response,
            // which the client sees as a reset / incomplete message.
            let stream = futures_util::stream::once(async {
                Err::<Bytes, std::io::Error>(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "simulated connection reset",
                ))
            });
            Response::builder()
                .status(StatusCode::OK)
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::CONTENT_LENGTH, "1024")
                .body(Body::from_stream(stream))
                .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
        }
        Handling::Hang { .. } => openai_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "hang did not end",
        ),
    }
}

/// A streamed answer: OpenAI's chunks (the role, the content or tool-call arguments in eight
/// pieces `chunk_ms` apart, the finish reason, the usage when asked for, `[DONE]`), broken as
/// the fault says.
struct Streamed {
    api: Speaks,
    head: Value,
    message: Value,
    finish_reason: String,
    usage: Option<Value>,
    chunk_ms: u64,
    /// How it breaks, after how many events, and how long the fault has left.
    brk: Option<(model::StreamBreak, usize, u64)>,
}

/// One thing the body does: wait, then send bytes or fail.
type Piece = (u64, Result<Bytes, std::io::Error>);

impl Streamed {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> String {
        let mut c = self.head.clone();
        c["choices"] = json!([{"index": 0, "delta": delta, "finish_reason": finish}]);
        format!("data: {c}\n\n")
    }

    fn events(&self) -> Vec<String> {
        match self.api {
            Speaks::Messages => return self.messages_events(),
            Speaks::Responses => return self.responses_events(),
            Speaks::Chat => {}
        }
        let mut out = vec![self.chunk(json!({"role": "assistant", "content": ""}), None)];
        let call = self.message["tool_calls"].get(0);
        let text = match call {
            Some(c) => c["function"]["arguments"].as_str().unwrap_or_default(),
            None => self.message["content"].as_str().unwrap_or_default(),
        };
        if let Some(c) = call {
            let mut first = c.clone();
            first["index"] = json!(0);
            first["function"]["arguments"] = json!("");
            out.push(self.chunk(json!({"tool_calls": [first]}), None));
        }
        for piece in pieces(text, 8) {
            let delta = match call {
                Some(_) => json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}),
                None => json!({"content": piece}),
            };
            out.push(self.chunk(delta, None));
        }
        out.push(self.chunk(json!({}), Some(&self.finish_reason)));
        if let Some(u) = &self.usage {
            let mut c = self.head.clone();
            c["choices"] = json!([]);
            c["usage"] = u.clone();
            out.push(format!("data: {c}\n\n"));
        }
        out.push("data: [DONE]\n\n".into());
        out
    }

    /// The answer's text (or tool-call arguments) in the pieces it is streamed in.
    fn text_pieces(&self) -> Vec<String> {
        let text = match self.message["tool_calls"].get(0) {
            Some(c) => c["function"]["arguments"].as_str().unwrap_or_default(),
            None => self.message["content"].as_str().unwrap_or_default(),
        };
        pieces(text, 8)
    }

    /// The answer's id without the chat prefix.
    fn id(&self) -> &str {
        let id = self.head["id"].as_str().unwrap_or_default();
        id.strip_prefix("chatcmpl-").unwrap_or(id)
    }

    /// The same answer as Messages events.
    fn messages_events(&self) -> Vec<String> {
        messages::events(
            self.id(),
            self.head["model"].as_str().unwrap_or_default(),
            &self.message,
            &self.finish_reason,
            self.usage.as_ref().unwrap_or(&Value::Null),
            &self.text_pieces(),
        )
    }

    /// The same answer as Responses events.
    fn responses_events(&self) -> Vec<String> {
        responses::events(
            self.id(),
            self.head["model"].as_str().unwrap_or_default(),
            self.head["created"].as_u64().unwrap_or(0),
            &self.message,
            &self.finish_reason,
            self.usage.as_ref().unwrap_or(&Value::Null),
            &self.text_pieces(),
        )
    }

    fn pieces(&self) -> Vec<Piece> {
        use model::StreamBreak;
        let mut plan: Vec<Piece> = Vec::new();
        let events = self.events();
        let last = events.len() - 1;
        for (i, e) in events.into_iter().enumerate() {
            let wait = if i == 0 { 0 } else { self.chunk_ms };
            if let Some((kind, at, hold)) = self.brk
                && at == i
            {
                match kind {
                    StreamBreak::Stall => {
                        plan.push((hold, Ok(Bytes::new())));
                    }
                    StreamBreak::Cut => {
                        let cut = std::io::Error::new(
                            std::io::ErrorKind::ConnectionReset,
                            "simulated stream cut",
                        );
                        plan.push((wait, Err(cut)));
                        return plan;
                    }
                    StreamBreak::Malformed => {
                        let broken: &[u8] = match self.api {
                            Speaks::Chat => b"data: {\"choices\": [\n\n",
                            Speaks::Messages => {
                                b"event: content_block_delta\ndata: {\"type\": \n\n"
                            }
                            Speaks::Responses => {
                                b"event: response.output_text.delta\ndata: {\"type\": \n\n"
                            }
                        };
                        plan.push((wait, Ok(Bytes::from_static(broken))));
                    }
                    StreamBreak::NoDone => {}
                }
            }
            if i == last
                && let Some((model::StreamBreak::NoDone, _, hold)) = self.brk
            {
                plan.push((hold, Ok(Bytes::new())));
                return plan;
            }
            plan.push((wait, Ok(Bytes::from(e))));
        }
        plan
    }
}

/// `text` in `n` pieces of about equal length (on character boundaries).
fn pieces(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let size = chars.len().div_ceil(n).max(1);
    chars.chunks(size).map(|c| c.iter().collect()).collect()
}

impl IntoResponse for Streamed {
    fn into_response(self) -> Response {
        let plan = std::collections::VecDeque::from(self.pieces());
        let body = futures_util::stream::unfold(plan, |mut plan| async move {
            let (wait, piece) = plan.pop_front()?;
            pause(wait).await;
            Some((piece, plan))
        });
        Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(body))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
    }
}

fn faults_doc(sim: &Sim) -> Value {
    let now = sim.now_ms();
    let mut faults = sim.faults();
    let list: Vec<Value> = faults
        .active(now)
        .iter()
        .map(|(provider, f)| {
            let mut v = serde_json::to_value(f.mode).unwrap_or(Value::Null);
            v["provider"] = json!(provider);
            v["remaining_ms"] = json!(f.until_ms.saturating_sub(now));
            v
        })
        .collect();
    let providers: Vec<&str> = sim.providers.keys().map(String::as_str).collect();
    json!({ "faults": list, "providers": providers })
}

async fn list_faults(State(sim): State<Arc<Sim>>) -> Response {
    axum::Json(faults_doc(&sim)).into_response()
}

async fn set_fault(State(sim): State<Arc<Sim>>, body: Bytes) -> Response {
    let req: super::model::SetFault = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return openai_error(
                StatusCode::BAD_REQUEST,
                "invalid_fault",
                &format!(
                    "expected {{\"provider\", \"duration_ms\", \"mode\": error|contract|slow|hang|\
                     rate-limit|reset|flaky, ...}}: {e}"
                ),
            );
        }
    };
    let host = req
        .provider
        .split_once('/')
        .map_or(&*req.provider, |(p, _)| p);
    if !sim.providers.contains_key(host) {
        return unknown_provider(&sim, host);
    }
    if req.times == Some(0) {
        return openai_error(
            StatusCode::BAD_REQUEST,
            "invalid_fault",
            "times must be at least 1 (or left out: every request)",
        );
    }
    if let Err(e) = req.mode.validate() {
        return openai_error(StatusCode::BAD_REQUEST, "invalid_fault", &e.0);
    }
    let now = sim.now_ms();
    sim.faults()
        .set(&req.provider, req.mode, now, req.duration_ms, req.times);
    tracing::info!(provider = %req.provider, mode = req.mode.name(), duration_ms = req.duration_ms, "fault set");
    (StatusCode::CREATED, axum::Json(faults_doc(&sim))).into_response()
}

async fn clear_one(State(sim): State<Arc<Sim>>, Path(provider): Path<String>) -> Response {
    if !sim.providers.contains_key(&provider) {
        return unknown_provider(&sim, &provider);
    }
    let cleared = sim.faults().clear(&provider);
    axum::Json(json!({"cleared": u8::from(cleared)})).into_response()
}

async fn clear_all(State(sim): State<Arc<Sim>>) -> Response {
    let cleared = sim.faults().clear_all();
    axum::Json(json!({"cleared": cleared})).into_response()
}
