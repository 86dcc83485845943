//! The data plane: an OpenAI-compatible `POST /v1/chat/completions` over HTTP, and the same
//! request over NATS (`oam.v1.request`, one queue group across nodes).
//!
//! oam's own fields come in an `oam` object in the body or in `X-OAM-*` headers. A success is an
//! OpenAI chat completion plus an `oam` object; a failure is the OpenAI error envelope plus the
//! same `oam` object, with an HTTP status that follows the phase. Every response carries
//! `X-OAM-Phase`, `X-OAM-Reasons`, `X-OAM-Provider` and `X-Request-Id`.

use super::Node;
use super::connector::Passthrough;
use super::detach::Detachable;
use crate::clock::now_ms;
use crate::core::contract::ContractSpec;
use crate::core::pipeline::{Decision, DecisionOutcome, Effect, Session, Step};
use crate::core::reason::{Phase, ReasonCode};
use crate::core::record::{Call, Recorder};
use crate::core::request::{GenerationStatus, Message, Policy, Priority, Request, Risk};
use crate::transport::subjects;
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub fn router(node: Arc<Node>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/v1/oam/state", get(state))
        .route("/v1/oam/chaos", post(chaos))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        // The chat handler enforces node.max_body_bytes itself, with an OpenAI-style error.
        .layer(DefaultBodyLimit::disable())
        .with_state(node)
}

/// `POST /v1/oam/chaos`: how an isolated node hears that its fault ended early. Only a
/// restore is accepted here; faults themselves come from the warden over NATS.
async fn chaos(State(node): State<Arc<Node>>, body: axum::body::Bytes) -> Response {
    match serde_json::from_slice::<crate::core::chaos::NodeCommand>(&body) {
        Ok(crate::core::chaos::NodeCommand::Restore { id, key })
            if node.bus.isolation_key_is(&id, &key) =>
        {
            node.chaos.apply(crate::core::chaos::NodeCommand::Restore { id, key });
            axum::Json(json!({"applied": true})).into_response()
        }
        Ok(crate::core::chaos::NodeCommand::Restore { .. }) => (
            StatusCode::FORBIDDEN,
            axum::Json(json!({"error": "a restore over HTTP ends only the isolation under way, and carries its key (from the warden); end faults with `oam chaos restore`"})),
        )
            .into_response(),
        Ok(_) => (
            StatusCode::FORBIDDEN,
            axum::Json(json!({"error": "only a restore is accepted over HTTP; inject faults with `oam chaos`"})),
        )
            .into_response(),
        Err(e) => (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"error": format!("not a chaos command: {e}")})),
        )
            .into_response(),
    }
}

async fn state(State(node): State<Arc<Node>>) -> Response {
    axum::Json(super::status::snapshot(&node)).into_response()
}

async fn metrics(State(node): State<Arc<Node>>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        node.metrics.registry.render(),
    )
        .into_response()
}

/// `GET /v1/models`: the model routes with their targets, or (with no routes) every target's
/// model; and `auto`, scored routing across every target.
async fn models(State(node): State<Arc<Node>>, headers: HeaderMap) -> Response {
    if let Err(a) = authenticate(&node, &headers) {
        return to_http(*a);
    }
    let entry = |id: &str, owned_by: &str, targets: Vec<&str>| json!({"id": id, "object": "model", "created": 0, "owned_by": owned_by, "oam": {"targets": targets}});
    let all: Vec<&str> = node.cfg.targets.iter().map(|t| t.id.as_str()).collect();
    let mut data: Vec<Value> = if node.cfg.routes.is_empty() {
        node.cfg
            .targets
            .iter()
            .map(|t| entry(&t.model, &format!("oam/{}", t.provider), vec![&t.id]))
            .collect()
    } else {
        node.cfg
            .routes
            .iter()
            .map(|r| {
                let targets = r.targets.iter().filter_map(|t| node.cfg.target(t));
                entry(&r.model, "oam", targets.map(|t| t.id.as_str()).collect())
            })
            .collect()
    };
    data.push(entry("auto", "oam", all));
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// oam's extra fields, from the body's `oam` object (headers fill what it leaves out).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct OamFields {
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    agent: Option<String>,
    #[serde(default)]
    task: Option<String>,
    #[serde(default)]
    risk: Option<Risk>,
    #[serde(default)]
    priority: Option<Priority>,
    #[serde(default)]
    idempotent: Option<bool>,
    #[serde(default)]
    latency_budget_ms: Option<u64>,
    #[serde(default)]
    max_cost_usd: Option<f64>,
    #[serde(default)]
    policy: Option<Policy>,
    #[serde(default)]
    contract: Option<ContractSpec>,
}

/// The most tools one request may declare (OpenAI's own limit).
const MAX_TOOLS: usize = 128;

/// The most answers one request may ask for (OpenAI's own limit on `n`).
const MAX_N: u64 = 128;

/// The OpenAI request shape: what oam reads; everything else (tools, sampling parameters,
/// unknown future fields) is kept in `rest` and the messages as sent, for the upstream.
#[derive(Deserialize)]
struct ChatIn {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<Value>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    response_format: Option<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    oam: Option<OamFields>,
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

#[derive(Deserialize)]
struct MessageIn {
    role: String,
    #[serde(default)]
    content: Value,
}

fn text_of(content: &Value) -> Option<String> {
    match content {
        Value::String(s) => Some(s.clone()),
        Value::Null => Some(String::new()),
        Value::Array(parts) => Some(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        _ => None,
    }
}

/// The tools a request declares (`[{type, function: {name, parameters}}]`): name -> parameter
/// schema (`null` when a tool gives none). The list itself goes to the upstream as sent.
fn declared_tools(
    tools: Option<&Value>,
) -> Result<std::collections::BTreeMap<String, Value>, BadRequest> {
    let Some(tools) = tools else {
        return Ok(Default::default());
    };
    let list = tools.as_array().ok_or_else(|| {
        bad(
            "tools",
            "tools must be an array of {\"type\": \"function\", \"function\": {...}}",
        )
    })?;
    // Every tool's schema is compiled to check the answer's calls against it: without a bound,
    // one request of 6,000 tools cost 0.1 s of CPU and 43 MB.
    if list.len() > MAX_TOOLS {
        return Err(bad(
            "tools",
            format!(
                "at most {MAX_TOOLS} tools per request (OpenAI's own limit); this one declares {}",
                list.len()
            ),
        ));
    }
    let mut out = std::collections::BTreeMap::new();
    for (i, t) in list.iter().enumerate() {
        let f = &t["function"];
        let Some(name) = f["name"].as_str().filter(|n| !n.is_empty()) else {
            return Err(bad(
                format!("tools[{i}].function.name"),
                format!("tools[{i}].function.name must be a non-empty string"),
            ));
        };
        out.insert(
            name.to_string(),
            f.get("parameters").cloned().unwrap_or(Value::Null),
        );
    }
    Ok(out)
}

/// May a client ask for `model`? A route's name when routes are configured; without routes (every
/// target scored), any target's model or id; `auto` (or `oam`, or nothing) always.
fn known_model(cfg: &super::config::NodeConfig, model: &str) -> bool {
    if model.is_empty() || model == "auto" || model == "oam" {
        return true;
    }
    if cfg.routes.is_empty() {
        cfg.targets
            .iter()
            .any(|t| t.model == model || t.id == model)
    } else {
        cfg.route(model).is_some()
    }
}

/// A request the node refuses before the pipeline runs (400): the parameter at fault (for the
/// OpenAI error envelope's `param`), and why.
struct BadRequest {
    param: Option<String>,
    message: String,
}

fn bad(param: impl Into<String>, message: impl Into<String>) -> BadRequest {
    BadRequest {
        param: Some(param.into()),
        message: message.into(),
    }
}

/// The body parameter of a core request field: OpenAI's own names stay, oam's live in `oam`.
fn param_of(field: &str) -> String {
    match field {
        "messages" | "response_format" | "model" | "tools" => field.to_string(),
        "id" => "oam.request_id".to_string(),
        other => format!("oam.{other}"),
    }
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

fn parse_header<T: std::str::FromStr>(h: &HeaderMap, name: &str) -> Result<Option<T>, BadRequest> {
    match header(h, name) {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| bad(name, format!("header {name}: cannot read {v:?}"))),
    }
}

fn parse_enum_header<T: serde::de::DeserializeOwned>(
    h: &HeaderMap,
    name: &str,
) -> Result<Option<T>, BadRequest> {
    match header(h, name) {
        None => Ok(None),
        Some(v) => serde_json::from_value(Value::String(v.to_ascii_lowercase()))
            .map(Some)
            .map_err(|e| bad(name, format!("header {name}: {e}"))),
    }
}

/// Build the core request from the body and headers: the request, and whether it asked for
/// server-sent events (`"stream": true`). Bytes from outside: property-tested below.
fn to_request(
    node: &Node,
    body: &[u8],
    h: &HeaderMap,
    client: Option<&str>,
) -> Result<(Request, bool, Passthrough), BadRequest> {
    let mut r = decode_request(&node.cfg, body, h, || {
        node.serving.next_request_id(&node.id)
    })?;
    if let Some(id) = client {
        // Who holds the key is who calls, whatever the request says.
        r.0.agent = id.to_string();
    }
    Ok(r)
}

/// With `[[client]]`s configured, the client whose key the request bears
/// (`Authorization: Bearer <key>`), or the 401 that refuses it; without, `Ok(None)`: anyone.
fn authenticate<'a>(node: &'a Node, h: &HeaderMap) -> Result<Option<&'a str>, Box<Answer>> {
    if node.cfg.client_keys.is_empty() {
        return Ok(None);
    }
    let presented = header(h, "authorization")
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    let why = match presented {
        Some(key) => match node.cfg.client_with_key(key) {
            Some(id) => return Ok(Some(id)),
            None => "the key in the Authorization header is not one this gateway knows",
        },
        None => "this gateway needs an API key: send Authorization: Bearer <key>",
    };
    node.metrics.unauthorized();
    let mut a = bad_request(
        node,
        h,
        BadRequest {
            param: None,
            message: why.into(),
        },
    );
    a.status = StatusCode::UNAUTHORIZED;
    a.body = json_bytes(
        &json!({"error": {"message": why, "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}),
    );
    a.phase = "unauthorized".into();
    Err(Box::new(a))
}

/// `to_request` against the providers a node routes to; `new_id` names a request that names
/// itself nowhere.
fn decode_request(
    cfg: &super::config::NodeConfig,
    body: &[u8],
    h: &HeaderMap,
    new_id: impl FnOnce() -> String,
) -> Result<(Request, bool, Passthrough), BadRequest> {
    // Read plainly first; only a body that fails is read again, tracking where it failed.
    let plain = ChatIn::deserialize(&mut serde_json::Deserializer::from_slice(body));
    let chat = plain.or_else(|_| {
        serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(body))
    });
    let chat: ChatIn = chat.map_err(|e| {
        let path = e.path().to_string();
        let (param, at) = if path == "." {
            (None, String::new())
        } else {
            (Some(path.clone()), format!("{path}: "))
        };
        BadRequest {
            param,
            message: format!("invalid chat completion request: {at}{}", e.into_inner()),
        }
    })?;
    if chat.messages.is_empty() {
        return Err(bad("messages", "messages must hold at least one message"));
    }
    let mut messages = Vec::with_capacity(chat.messages.len());
    for (i, raw) in chat.messages.iter().enumerate() {
        let plain = MessageIn::deserialize(raw);
        let m = plain.or_else(|_| serde_path_to_error::deserialize(raw));
        let m: MessageIn = m.map_err(|e| {
            let at = match e.path().to_string() {
                p if p == "." => format!("messages[{i}]"),
                p => format!("messages[{i}].{p}"),
            };
            let message = format!("invalid chat completion request: {at}: {}", e.inner());
            bad(at, message)
        })?;
        let content = text_of(&m.content).ok_or_else(|| {
            bad(
                format!("messages[{i}].content"),
                format!("messages[{i}].content must be a string or an array of parts"),
            )
        })?;
        messages.push(Message {
            role: m.role,
            content,
        });
    }
    if let Some(model) = &chat.model
        && !known_model(cfg, model)
    {
        let known: Vec<&str> = if cfg.routes.is_empty() {
            cfg.targets.iter().map(|t| t.model.as_str()).collect()
        } else {
            cfg.routes.iter().map(|r| r.model.as_str()).collect()
        };
        return Err(bad(
            "model",
            format!(
                "unknown model {model:?}; this node serves {} (or send \"auto\")",
                known.join(", ")
            ),
        ));
    }
    let stream = chat.stream == Some(true);
    let tools = declared_tools(chat.rest.get("tools"))?;
    // `n` stays in the body for the upstream; oam prices every answer it asks for.
    let n = match chat.rest.get("n") {
        None | Some(Value::Null) => 1,
        Some(v) => v
            .as_u64()
            .filter(|n| (1..=MAX_N).contains(n))
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad("n", format!("n must be a whole number from 1 to {MAX_N}")))?,
    };
    let o = chat.oam.unwrap_or_default();
    let id = o
        .request_id
        .or_else(|| header(h, "x-request-id").map(String::from))
        .unwrap_or_else(new_id);
    let request = Request {
        id,
        agent: o
            .agent
            .or_else(|| header(h, "x-oam-agent").map(String::from))
            .unwrap_or_else(|| crate::core::request::ANONYMOUS.into()),
        task: o
            .task
            .or_else(|| header(h, "x-oam-task").map(String::from))
            .unwrap_or_default(),
        model: chat.model,
        messages,
        risk: match o.risk {
            Some(r) => r,
            None => parse_enum_header(h, "x-oam-risk")?.unwrap_or_default(),
        },
        priority: match o.priority {
            Some(p) => p,
            None => parse_enum_header(h, "x-oam-priority")?.unwrap_or_default(),
        },
        idempotent: match o.idempotent {
            Some(b) => b,
            None => parse_header(h, "x-oam-idempotent")?.unwrap_or(true),
        },
        latency_budget_ms: match o.latency_budget_ms {
            Some(v) => Some(v),
            None => parse_header(h, "x-oam-latency-budget-ms")?,
        },
        max_cost_usd: match o.max_cost_usd {
            Some(v) => Some(v),
            None => parse_header(h, "x-oam-max-cost-usd")?,
        },
        max_tokens: chat.max_completion_tokens.or(chat.max_tokens),
        n,
        policy: o.policy.unwrap_or_default(),
        contract: o.contract,
        response_format: chat.response_format,
        tools,
    };
    let mut extra = chat.rest;
    // oam sets the upstream's stream options itself (it always asks a stream for its usage);
    // whether the client wants the usage chunk is kept.
    let include_usage = extra
        .remove("stream_options")
        .is_some_and(|o| o["include_usage"] == Value::Bool(true));
    let pass = Passthrough {
        messages: chat.messages,
        extra,
        include_usage,
    };
    Ok((request, stream, pass))
}

/// What the data plane answers, before it is turned into HTTP or a NATS reply.
pub struct Answer {
    /// The request asked for server-sent events (HTTP only; the NATS reply is always JSON).
    pub stream: bool,
    pub status: StatusCode,
    /// JSON, written out.
    pub body: bytes::Bytes,
    pub request_id: String,
    pub phase: String,
    pub reasons: String,
    pub provider: String,
    /// A stream relayed live: the response is already under way (HTTP only).
    pub live: Option<Response>,
}

impl Answer {
    /// A stream relayed live: its response is already under way.
    fn live(resp: Response) -> Answer {
        Answer {
            stream: true,
            status: StatusCode::OK,
            body: bytes::Bytes::new(),
            request_id: String::new(),
            phase: String::new(),
            reasons: String::new(),
            provider: String::new(),
            live: Some(resp),
        }
    }
}

/// The HTTP status for a refused request, by the phase that refused it.
pub fn status_for(d: &Decision) -> StatusCode {
    let timed_out = d.reason_codes.contains(&ReasonCode::GenerationTimeout);
    // The last call made refused the request itself (invalid, too long for any target's
    // context window, or against content policy): the caller should change it.
    let rejected = d
        .attempts
        .iter()
        .rev()
        .find_map(|a| a.status)
        .is_some_and(GenerationStatus::is_refusal);
    match d.phase {
        Phase::Accepted => StatusCode::OK,
        Phase::Admission => StatusCode::SERVICE_UNAVAILABLE,
        Phase::Loop => StatusCode::TOO_MANY_REQUESTS,
        Phase::Budget | Phase::Cost => StatusCode::PAYMENT_REQUIRED,
        Phase::Semantic | Phase::Quality => StatusCode::UNPROCESSABLE_ENTITY,
        // The provider refused the request itself (its last attempt): the caller should fix it.
        Phase::Generation if rejected => StatusCode::BAD_REQUEST,
        Phase::Generation if timed_out => StatusCode::GATEWAY_TIMEOUT,
        Phase::Generation => StatusCode::BAD_GATEWAY,
        Phase::Routing | Phase::Breaker => StatusCode::SERVICE_UNAVAILABLE,
        Phase::Retry | Phase::Escalation => StatusCode::SERVICE_UNAVAILABLE,
    }
}

pub(crate) fn oam_object(d: &Decision) -> Value {
    serde_json::to_value(OamObject::of(d)).unwrap_or(Value::Null)
}

/// The `oam` object of an answer, written straight from the decision (members in name order).
#[derive(serde::Serialize)]
struct OamObject<'a> {
    agent: &'a str,
    attempts: usize,
    confidence: Option<f64>,
    cost_usd: f64,
    escalation: &'a Option<crate::core::escalation::Escalation>,
    fallback: bool,
    incident: &'a Option<crate::core::loops::Incident>,
    outcome: DecisionOutcome,
    phase: crate::core::reason::Phase,
    provider: Option<&'a str>,
    reason_codes: &'a [ReasonCode],
    request_id: &'a str,
    route: Option<&'a str>,
    target: Option<&'a str>,
    tried: Vec<Tried<'a>>,
}

#[derive(serde::Serialize)]
struct Tried<'a> {
    latency_ms: u64,
    reason_codes: &'a [ReasonCode],
    status: Option<GenerationStatus>,
    target: &'a str,
}

impl<'a> OamObject<'a> {
    fn of(d: &'a Decision) -> Self {
        OamObject {
            agent: &d.agent,
            attempts: d.attempts.len(),
            confidence: d.confidence,
            cost_usd: d.cost_usd,
            escalation: &d.escalation,
            fallback: d.fallback,
            incident: &d.incident,
            outcome: d.outcome,
            phase: d.phase,
            provider: d.provider.as_deref(),
            reason_codes: &d.reason_codes,
            request_id: &d.request_id,
            route: d.route.as_deref(),
            target: d.provider.as_deref(),
            tried: d
                .attempts
                .iter()
                .filter_map(|a| {
                    Some(Tried {
                        latency_ms: a.latency_ms,
                        reason_codes: &a.codes,
                        status: a.status,
                        target: a.provider.as_deref()?,
                    })
                })
                .collect(),
        }
    }
}

/// A JSON body, written out.
fn json_bytes(v: &impl serde::Serialize) -> bytes::Bytes {
    serde_json::to_vec(v).unwrap_or_default().into()
}

/// A request on its way through the engine. Whatever way its driver ends (finished, or the
/// task dropped), the guard gives back what the session still holds: its queue place or slot,
/// and budget reserved for an attempt under way.
pub(crate) struct Flight {
    pub node: Arc<Node>,
    pub session: Session,
    /// What the shared budget ledger holds for the attempt under way.
    pub hold: Option<super::ledger::Hold>,
    /// The request's record for the decision log, as it goes (none when the log is off).
    pub recorder: Option<Recorder>,
}

impl Flight {
    pub(crate) fn new(node: Arc<Node>, session: Session, recorder: Option<Recorder>) -> Flight {
        Flight {
            node,
            session,
            hold: None,
            recorder,
        }
    }

    /// Tell the engine `call` about this request (recorded with the state it saw); if it ended
    /// the attempt under way, the attempt's ledger hold settles with what it cost.
    pub(crate) fn call(&mut self, call: Call) -> Option<Step> {
        let before = self.session.cost_usd();
        let ended = matches!(call, Call::Complete { .. } | Call::Withdraw);
        let now = now_ms();
        let Flight {
            node,
            session,
            recorder,
            ..
        } = self;
        let out = node.pipeline.with(|e| {
            if let Some(r) = recorder.as_mut() {
                r.call(e, &call, now);
            }
            e.apply(session, call, now)
        });
        super::ledger::settle_after(
            &self.node.ledger,
            &mut self.hold,
            &self.session,
            before,
            ended,
        );
        out
    }

    /// A call that always gives the next step (`Dequeue`, `Complete`).
    pub(crate) fn next(&mut self, call: Call) -> Step {
        // `apply` gives a step for these; were it not to, the request would wait in vain:
        // end it closed instead.
        match self.call(call) {
            Some(step) => step,
            None => self
                .call(Call::Complete {
                    generation: crate::core::request::Generation::failed(
                        GenerationStatus::Error,
                        0,
                    ),
                })
                .unwrap_or(Step::Queued),
        }
    }

    /// The request's record as far as it goes (finished with its decision by `conclude`).
    pub(crate) fn recorder(&mut self) -> Option<Recorder> {
        self.recorder.take()
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        if let Some(ticket) = self.session.ticket() {
            self.node.pipeline.forget_waiter(ticket);
        }
        // A decided request holds nothing: no lock taken for it.
        if self.session.holds_anything() {
            self.node
                .pipeline
                .with(|e| e.drop_session(&mut self.session));
        }
        if let Some(h) = self.hold.take() {
            self.node.ledger.settle(h, 0.0);
        }
    }
}

/// A request admitted to the pipeline.
struct Begun {
    flight: Flight,
    /// The engine's first step.
    step: Step,
    /// The slot it waits for, when queued.
    granted: Option<tokio::sync::oneshot::Receiver<()>>,
    /// It asked for server-sent events.
    stream: bool,
    /// What goes to the upstream unchanged.
    pass: Passthrough,
}

/// Authenticate, parse and begin a request, or the answer that refuses it. A function of its
/// own so that none of its temporaries is kept in the request's future (moved whole into its
/// box) across an await.
fn begin(node: &Arc<Node>, body: &[u8], headers: &HeaderMap) -> Result<Begun, Box<Answer>> {
    let client = authenticate(node, headers)?;
    let (request, stream, pass) = to_request(node, body, headers, client)
        .map_err(|e| Box::new(bad_request(node, headers, e)))?;
    let logging = node.log.enabled();
    let begun = node.pipeline.with(|e| {
        let now = now_ms();
        let recorder = logging.then(|| Recorder::begin(e, &request, now));
        e.begin(request, now).map(|(session, step)| {
            let granted = session.ticket().map(|t| node.pipeline.wait_for_slot(t));
            (Flight::new(node.clone(), session, recorder), step, granted)
        })
    });
    match begun {
        Ok((flight, step, granted)) => Ok(Begun {
            flight,
            step,
            granted,
            stream,
            pass,
        }),
        Err(e) => {
            let param = param_of(e.field);
            Err(Box::new(bad_request(node, headers, bad(param, e.message))))
        }
    }
}

/// Run one request through the pipeline, calling providers as it directs. `caller` is
/// cancelled when whoever asked went away: a queued request then leaves the queue at once, and
/// one with an attempt under way lets it finish but makes no further attempt.
pub async fn execute(
    node: &Arc<Node>,
    body: &[u8],
    headers: &HeaderMap,
    caller: CancellationToken,
    live_ok: bool,
) -> Answer {
    let started = std::time::Instant::now();
    let Begun {
        mut flight,
        mut step,
        mut granted,
        stream,
        pass,
    } = match begin(node, body, headers) {
        Ok(begun) => begun,
        Err(refused) => return *refused,
    };
    // A streaming request held to no contract is relayed as it arrives; one under a contract is
    // checked whole first, then released.
    let live = live_ok && stream && !flight.session.contracted();
    let limits = node
        .cfg
        .deadlines(flight.session.request().model.as_deref());
    let mut last = None;
    let queue_deadline =
        tokio::time::Instant::now() + Duration::from_millis(node.cfg.node.queue_timeout_ms);
    let decision = loop {
        step = match step {
            Step::Done(d) => break *d,
            Step::Queued => {
                let ticket = flight.session.ticket();
                let Some(rx) = granted.take() else {
                    // Only `begin` queues, and it registered the waiter; fail closed.
                    match flight.call(Call::Abandon) {
                        Some(Step::Done(d)) => break *d,
                        _ => continue,
                    }
                };
                let gave_up = tokio::select! {
                    // A slot was handed to this request.
                    _ = rx => None,
                    () = tokio::time::sleep_until(queue_deadline) => Some(false),
                    () = caller.cancelled() => Some(true),
                };
                let Some(caller_left) = gave_up else {
                    step = flight.next(Call::Dequeue);
                    continue;
                };
                // Leaving the queue: its waker goes too (a grant that raced with this is handed
                // on by the engine).
                if let Some(t) = ticket {
                    node.pipeline.forget_waiter(t);
                }
                let left = flight.call(if caller_left {
                    Call::CallerGone
                } else {
                    Call::Abandon
                });
                match left {
                    Some(Step::Done(d)) => break *d,
                    Some(other) => other,
                    // Not queued any more (cannot happen after `begin` queued it): go on as the
                    // engine says.
                    None => flight.next(Call::Dequeue),
                }
            }
            Step::Dispatch(d) => {
                if d.delay_ms > 0 {
                    let waited = tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(d.delay_ms)) => true,
                        () = caller.cancelled() => false,
                    };
                    // The caller left during the wait: the attempt is not made (with nothing
                    // waiting to start there is nothing to withdraw, and the call goes ahead).
                    if !waited && let Some(Step::Done(d)) = flight.call(Call::Withdraw) {
                        break *d;
                    }
                }
                // A shared budget holds the attempt's cost first (or the ledger says what next).
                if d.hold_usd > 0.0
                    && let Some(next) = node.ledger.reserve(&mut flight, d.hold_usd).await
                {
                    step = next;
                    continue;
                }
                if live {
                    // Boxed, like every rarely taken large future here: the request's future
                    // is moved whole into its box, so it stays the size of the common path.
                    let opened = tokio::select! {
                        o = Box::pin(super::live::open(node, &d, &pass, None, limits)) => Some(o),
                        () = caller.cancelled() => None,
                    };
                    // The caller left before the first event: the upstream call is dropped (no
                    // more is generated, and paid for, for nobody) and the request ends.
                    let Some(opened) = opened else {
                        // Nothing waiting (cannot be, after a dispatch): `next` ends it closed.
                        let left = match flight.call(Call::Withdraw) {
                            Some(step) => step,
                            None => flight.next(Call::Abandon),
                        };
                        step = left;
                        continue;
                    };
                    match opened {
                        super::live::Open::Started(first) => {
                            let target = d.provider.to_string();
                            let resp =
                                super::live::respond(flight, first, pass, limits, target, started);
                            return Answer::live(resp);
                        }
                        super::live::Open::Failed(a) => {
                            let g = a.generation.clone();
                            last = Some(a);
                            if caller.is_cancelled() {
                                flight.call(Call::CallerGone);
                            }
                            step = flight.next(Call::Complete { generation: g });
                            continue;
                        }
                    }
                }
                let attempt = match node.upstreams.target(&d.provider) {
                    Some((c, model)) => {
                        c.generate(
                            model,
                            &flight.session.request().messages,
                            Some(&pass),
                            d.max_tokens,
                            flight.session.request().response_format.as_ref(),
                            Duration::from_millis(d.timeout_ms),
                        )
                        .await
                    }
                    None => crate::core::request::Generation {
                        error: Some(format!("no connector for {}", d.provider)),
                        ..crate::core::request::Generation::failed(GenerationStatus::Error, 0)
                    }
                    .into(),
                };
                let g = attempt.generation.clone();
                last = Some(attempt);
                if caller.is_cancelled() {
                    flight.call(Call::CallerGone);
                }
                flight.next(Call::Complete { generation: g })
            }
        };
    };
    let record = flight.recorder();
    drop(flight);
    let answer = respond(node, &decision, last);
    let logged = conclude(node, decision, record, started);
    // Under `[decision_log] durable`, not before its record is in the stream.
    node.log.logged(logged).await;
    Answer { stream, ..answer }
}

/// What every decided request leaves behind: health samples from its traffic, metrics, and the
/// decision (with any incident and escalation) on the bus.
pub(crate) fn conclude(
    node: &Node,
    decision: Decision,
    record: Option<Recorder>,
    started: std::time::Instant,
) -> Option<tokio::sync::oneshot::Receiver<bool>> {
    for effect in &decision.effects {
        if let Effect::HealthSample {
            provider,
            outcome,
            latency_ms,
        } = effect
        {
            node.health.record_traffic(provider, *outcome, *latency_ms);
            node.metrics.provider_outcome(provider, "traffic", *outcome);
        }
    }
    node.metrics
        .decision(&decision, started.elapsed().as_secs_f64());
    let decision = std::sync::Arc::new(crate::core::record::Decided::new(decision));
    let logged = record.and_then(|r| node.log.keep(r.finish(decision.clone())));
    publish_decision(node, decision);
    logged
}

fn bad_request(node: &Node, headers: &HeaderMap, e: BadRequest) -> Answer {
    let request_id = header(headers, "x-request-id")
        .map_or_else(|| node.serving.next_request_id(&node.id), String::from);
    Answer {
        stream: false,
        status: StatusCode::BAD_REQUEST,
        body: json_bytes(
            &json!({"error": {"message": e.message, "type": "invalid_request_error", "param": e.param, "code": "invalid_request"}}),
        ),
        request_id,
        phase: "invalid".into(),
        reasons: String::new(),
        provider: String::new(),
        live: None,
    }
}

fn publish_decision(node: &Node, d: std::sync::Arc<crate::core::record::Decided>) {
    node.loops.share(&d);
    if let Some(i) = &d.incident
        && d.reason_codes.contains(&ReasonCode::AgentLoopDetected)
    {
        // A new loop episode: raised once for the cluster (see `node::loops`).
        node.loops.raise(i.clone(), d.escalation.clone());
    } else if let Some(e) = &d.escalation {
        node.escalations.raise(e);
    }
    node.bus.decided(d);
}

fn respond(node: &Node, d: &Decision, last: Option<super::connector::Attempt>) -> Answer {
    use super::connector::Reply;
    let status = status_for(d);
    let reasons: Vec<&str> = d.reason_codes.iter().map(|c| c.as_str()).collect();
    let provider = d.provider.as_deref().unwrap_or("").to_string();
    let accepted = d.outcome == DecisionOutcome::Accepted;
    let (g, upstream, upstream_status) = match last {
        Some(a) => (a.generation, a.body, a.http_status),
        None => (crate::core::request::Generation::ok("", 0), None, 0),
    };
    let policy = g.status == GenerationStatus::ContentPolicy
        && d.reason_codes.contains(&ReasonCode::ContentPolicyRefusal);
    let refusal = if policy {
        upstream.as_ref().and_then(Reply::value)
    } else {
        None
    };
    let (status, body) = if let Some(Value::Object(mut refusal)) = refusal {
        // The upstream's content-policy refusal as it came (an error, or a filtered answer),
        // with its status, and oam's object.
        refusal.insert("oam".into(), oam_object(d));
        let status = StatusCode::from_u16(upstream_status).unwrap_or(status);
        (status, json_bytes(&refusal))
    } else if let (true, Some(Reply::Completion(answer))) = (accepted, &upstream) {
        // The upstream's chat completion as it came, byte for byte (choices, tool calls,
        // finish reason, logprobs, usage, system fingerprint, its model), with oam's object
        // written in.
        let oam = serde_json::to_vec(&OamObject::of(d)).unwrap_or_default();
        (
            status,
            super::connector::with_member(answer, "oam", &oam).into(),
        )
    } else if let (true, Some(Reply::Json(Value::Object(mut answer)))) = (accepted, upstream)
        && answer.get("choices").is_some_and(Value::is_array)
    {
        answer.insert("oam".into(), oam_object(d));
        (status, json_bytes(&answer))
    } else if accepted {
        let model = node
            .cfg
            .targets
            .iter()
            .find(|t| t.id == provider)
            .map_or("", |t| t.model.as_str());
        let usage = g.usage.unwrap_or_default();
        let body = json!({
            "id": format!("chatcmpl-{}", d.request_id),
            "object": "chat.completion",
            "created": now_ms() / 1000,
            "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": g.content},
                "finish_reason": g.finish_reason.unwrap_or_else(|| "stop".into()),
            }],
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            },
            "oam": OamObject::of(d),
        });
        (status, json_bytes(&body))
    } else {
        let last_code = d.reason_codes.last().map_or("", |c| c.as_str());
        let message = format!(
            "oam {} the request in phase {}: {}",
            match d.outcome {
                DecisionOutcome::Escalated => "escalated",
                _ => "refused",
            },
            d.phase,
            reasons.join(", ")
        );
        let body = json!({
            "error": {
                "message": message,
                "type": if status.is_server_error() { "server_error" } else { "invalid_request_error" },
                "param": null,
                "code": last_code,
            },
            "oam": OamObject::of(d),
        });
        (status, json_bytes(&body))
    };
    Answer {
        stream: false,
        status,
        body,
        request_id: d.request_id.clone(),
        phase: d.phase.to_string(),
        reasons: reasons.join(","),
        provider,
        live: None,
    }
}

fn to_http(a: Answer) -> Response {
    let Answer {
        stream: _,
        live: _,
        status,
        body,
        request_id,
        phase,
        reasons,
        provider,
    } = a;
    let json = [(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    )];
    let resp = (status, json, body).into_response();
    with_oam_headers(resp, [phase, reasons, provider, request_id])
}

/// `X-OAM-Phase`, `X-OAM-Reasons`, `X-OAM-Provider` and `X-Request-Id` on a response.
pub(crate) fn with_oam_headers(
    mut resp: Response,
    [phase, reasons, provider, request_id]: [String; 4],
) -> Response {
    let h = resp.headers_mut();
    for (name, value) in [
        ("x-oam-phase", phase),
        ("x-oam-reasons", reasons),
        ("x-oam-provider", provider),
        ("x-request-id", request_id),
    ] {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(HeaderName::from_static(name), v);
        }
    }
    resp
}

/// An accepted answer as OpenAI server-sent events. oam checks the whole answer (contract,
/// quality, cost) before releasing any of it, so the stream is the checked answer in one content
/// chunk, then the finish reason with usage and the `oam` object, then `[DONE]`.
fn to_sse(a: Answer) -> Response {
    let b: Value = serde_json::from_slice(&a.body).unwrap_or_default();
    let b = &b;
    let [first, mut last] = super::connector::chunks_of(b);
    last["usage"] = b["usage"].clone();
    last["oam"] = b["oam"].clone();
    let text = format!("data: {first}\n\ndata: {last}\n\ndata: [DONE]\n\n");
    let resp = (
        StatusCode::OK,
        [
            (axum::http::header::CONTENT_TYPE, "text/event-stream"),
            (axum::http::header::CACHE_CONTROL, "no-cache"),
        ],
        text,
    )
        .into_response();
    with_oam_headers(resp, [a.phase, a.reasons, a.provider, a.request_id])
}

async fn chat(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let limit = node.cfg.node.max_body_bytes;
    let read = tokio::time::timeout(
        super::server::BODY_TIMEOUT,
        axum::body::to_bytes(body, limit),
    );
    match read.await {
        Ok(Ok(bytes)) => {
            // A caller that hangs up cancels nothing half-way: the pipeline moves to a task of
            // its own, is told the caller is gone, and ends cleanly (slot released, health
            // sample and decision kept).
            let caller = CancellationToken::new();
            let hung_up = caller.clone();
            let n = node.clone();
            let run = async move { execute(&n, &bytes, &headers, caller, true).await };
            let run = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(run));
            let Ok(answer) = Detachable::new(run, hung_up, node.serving.tasks.clone()).await else {
                tracing::error!("a request's pipeline panicked");
                return (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    axum::Json(json!({"error": {"message": "oam failed internally while serving this request; see the node's log", "type": "server_error", "param": null, "code": "internal_error"}})),
                )
                    .into_response();
            };
            if let Some(live) = answer.live {
                live
            } else if answer.status == StatusCode::OK && answer.stream {
                to_sse(answer)
            } else {
                to_http(answer)
            }
        }
        Ok(Err(_)) => to_http(too_large(&node, &headers)),
        Err(_) => {
            let mut a = bad_request(
                &node,
                &headers,
                BadRequest {
                    param: None,
                    message: format!(
                        "the request body did not arrive within {} s",
                        super::server::BODY_TIMEOUT.as_secs()
                    ),
                },
            );
            a.status = StatusCode::REQUEST_TIMEOUT;
            to_http(a)
        }
    }
}

/// The answer to a body over `node.max_body_bytes` (HTTP and NATS alike): 413, no provider
/// called.
fn too_large(node: &Arc<Node>, headers: &HeaderMap) -> Answer {
    let limit = node.cfg.node.max_body_bytes;
    let mut a = bad_request(
        node,
        headers,
        BadRequest {
            param: None,
            message: format!(
                "the request body is larger than this node accepts ({limit} bytes; \
                 node.max_body_bytes in oam.toml)"
            ),
        },
    );
    a.status = StatusCode::PAYLOAD_TOO_LARGE;
    a
}

/// The same data plane on NATS: requests on `oam.v1.request` (queue group `oam-nodes`), the
/// reply is the HTTP body with `status` and the `X-OAM-*` values added to its `oam` object.
/// When the node stops it leaves the queue group, answers what the server had already sent it,
/// and returns.
pub async fn serve_nats(node: Arc<Node>) -> anyhow::Result<()> {
    loop {
        // Isolated (chaos): not a member of the queue group until reconnected.
        while node.bus.isolated() {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
                () = node.serving.stop.cancelled() => return Ok(()),
            }
        }
        let mut sub = node
            .bus
            .nats()
            .queue_subscribe(subjects::REQUEST, subjects::REQUEST_QUEUE.into())
            .await?;
        loop {
            // Registered before the check, so an isolation between the two is not missed.
            let changed = node.bus.isolation_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if node.bus.isolated() {
                break;
            }
            let msg = tokio::select! {
                m = sub.next() => match m { Some(m) => m, None => return Ok(()) },
                _ = changed => break,
                () = node.serving.stop.cancelled() => {
                    // Without a bus there is nothing to leave and nothing more will arrive.
                    if node.bus.nats().connection_state() != async_nats::connection::State::Connected {
                        return Ok(());
                    }
                    // Leave the group; what was already delivered is still answered.
                    let _ = sub.drain().await;
                    while let Ok(Some(m)) =
                        tokio::time::timeout(Duration::from_secs(1), sub.next()).await
                    {
                        serve_one(&node, m);
                    }
                    return Ok(());
                }
            };
            serve_one(&node, msg);
        }
        let _ = sub.unsubscribe().await;
    }
}

/// Answer one request from the NATS data plane, on its own task.
fn serve_one(node: &Arc<Node>, msg: async_nats::Message) {
    if subjects::from_jetstream(&msg) {
        return; // copied here by a JetStream consumer: nobody asked
    }
    let node = node.clone();
    node.clone().serving.tasks.spawn(async move {
        // Answers go to reply inboxes only, whatever subject the asker named.
        let Some(reply) = msg.reply.clone().filter(|r| subjects::is_inbox(r)) else {
            return; // no reply inbox: nobody to answer
        };
        let mut headers = HeaderMap::new();
        if let Some(h) = &msg.headers {
            for (name, values) in h.iter() {
                let Ok(name) = HeaderName::from_bytes(name.to_string().as_bytes()) else {
                    continue;
                };
                if let Some(v) = values.first()
                    && let Ok(v) = HeaderValue::from_str(v.as_str())
                {
                    headers.insert(name, v);
                }
            }
        }
        // The same body limit as HTTP. A NATS requester that gives up cannot be seen; its
        // request runs to the end.
        let a = if msg.payload.len() > node.cfg.node.max_body_bytes {
            too_large(&node, &headers)
        } else {
            execute(
                &node,
                &msg.payload,
                &headers,
                CancellationToken::new(),
                false,
            )
            .await
        };
        // The HTTP answer's body with its status as a member (the upstream's own `status`, if
        // its answer had one, gives way).
        let status = a.status.as_u16().to_string();
        let bytes = super::connector::set_member(&a.body, "status", status.as_bytes());
        if let Err(e) = node.bus.nats().publish(reply, bytes.into()).await {
            tracing::debug!("cannot reply on NATS: {e}");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_phase() {
        let mut d: Decision = serde_json::from_value(json!({
            "request_id": "r", "agent": "a", "task": "", "fingerprint": "0000000000000000",
            "outcome": "rejected", "phase": "admission", "reason_codes": [],
            "provider": null, "fallback": false, "confidence": null, "cost_usd": 0.0,
            "attempts": [], "escalation": null, "incident": null, "effects": [], "decided_at_ms": 0
        }))
        .unwrap();
        for (phase, status) in [
            (Phase::Admission, 503),
            (Phase::Loop, 429),
            (Phase::Budget, 402),
            (Phase::Semantic, 422),
            (Phase::Quality, 422),
            (Phase::Generation, 502),
            (Phase::Accepted, 200),
        ] {
            d.phase = phase;
            assert_eq!(status_for(&d).as_u16(), status, "{phase}");
        }
        d.phase = Phase::Generation;
        d.reason_codes = vec![ReasonCode::GenerationTimeout];
        assert_eq!(status_for(&d).as_u16(), 504);
    }

    /// JSON-ish text from the pieces a chat request is made of, so that the decoder gets far
    /// past the first byte.
    fn chat_like() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let piece = prop_oneof![
            Just("{".to_string()),
            Just("}".to_string()),
            Just("[".to_string()),
            Just("]".to_string()),
            Just(",".to_string()),
            Just(":".to_string()),
            Just("\"messages\"".to_string()),
            Just("\"role\"".to_string()),
            Just("\"content\"".to_string()),
            Just("\"model\"".to_string()),
            Just("\"oam\"".to_string()),
            Just("\"stream\"".to_string()),
            Just("\"type\"".to_string()),
            Just("\"text\"".to_string()),
            Just("\"risk\"".to_string()),
            Just("\"max_tokens\"".to_string()),
            Just("\"latency_budget_ms\"".to_string()),
            Just("\"contract\"".to_string()),
            Just("\"user\"".to_string()),
            Just("null".to_string()),
            Just("true".to_string()),
            Just("-1".to_string()),
            Just("1e999".to_string()),
            Just("18446744073709551616".to_string()),
            any::<String>().prop_map(|s| serde_json::to_string(&s).unwrap_or_default()),
        ];
        proptest::collection::vec(piece, 0..40).prop_map(|v| v.concat())
    }

    proptest::proptest! {
        /// Whatever a client sends, the decoder answers with a request or a 400 naming why;
        /// it never panics.
        #[test]
        fn any_body_decodes_or_is_refused(body in chat_like(), raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let cfg = crate::node::config::NodeConfig::load(None, "http://127.0.0.1:1").unwrap_or_default();
            let mut h = HeaderMap::new();
            h.insert("x-oam-risk", HeaderValue::from_static("high"));
            for bytes in [body.as_bytes(), raw.as_slice()] {
                match decode_request(&cfg, bytes, &h, || "r".into()) {
                    Ok((r, _, pass)) => proptest::prop_assert_eq!(r.messages.len(), pass.messages.len()),
                    Err(e) => proptest::prop_assert!(!e.message.is_empty()),
                }
            }
        }
    }
}
