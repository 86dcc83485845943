//! The client APIs a node serves, as siblings, one file each: OpenAI chat completions
//! (`openai`), Anthropic Messages (`anthropic`), OpenAI Responses (`responses`), embeddings
//! (`embeddings`). Each decodes its request once, into the typed turns (`node::model`) and the
//! core request (`Decoded::into_request` reads oam's fields and headers alike for all), and
//! writes the decided answer (whole, or as its stream's events) and its errors in its own
//! envelope; `ClientApi` names them for the router. Nothing here uses an upstream API's module:
//! both sides meet in `node::exchange`.

use crate::core::contract::ContractSpec;
use crate::core::pipeline::Decision;
use crate::core::request::{Message, Policy, Priority, Request, Risk};
use crate::node::config::NodeConfig;
use crate::node::exchange::{Delta, Passthrough};
pub(crate) use crate::node::exchange::{Members, members_of};
use crate::node::model::{Sampling, Turn};
use crate::node::request::Answer;
use axum::http::HeaderMap;
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

pub(crate) mod a2a;
pub(crate) mod anthropic;
pub(crate) mod embeddings;
pub(crate) mod mcp;
pub(crate) mod openai;
pub(crate) mod responses;
pub(crate) mod rpc;

/// oam's extra fields, from the body's `oam` object (headers fill what it leaves out).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct OamFields {
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

/// The turns as the pipeline reads them: each one's role and text.
pub(crate) fn messages_of(turns: &[Turn]) -> Vec<Message> {
    turns
        .iter()
        .map(|t| Message {
            role: t.role.as_str().to_string(),
            content: t.plain_text(),
        })
        .collect()
}

/// May a client ask for `model`? A route's name when routes are configured; without routes (every
/// target scored), any target's model or id; `auto` (or `oam`, or nothing) always.
pub(crate) fn known_model(cfg: &NodeConfig, model: &str) -> bool {
    if model.is_empty() || model == "auto" || model == "oam" {
        return true;
    }
    if cfg.routes.is_empty() {
        cfg.targets
            .iter()
            .any(|t| (t.model == model || t.id == model) && t.api != crate::core::request::Api::Mcp)
    } else {
        cfg.route(model).is_some()
    }
}

/// A request the node refuses before the pipeline runs (400, or 404 for what it does not
/// have): the parameter at fault (for the OpenAI error envelope's `param`), and why.
#[derive(Debug)]
pub(crate) struct BadRequest {
    pub param: Option<String>,
    pub message: String,
    /// It names a model this node does not serve: 404, as both vendors answer
    /// (`model_not_found`, `not_found_error`), which their SDKs do not retry.
    pub not_found: bool,
}

pub(crate) fn bad(param: impl Into<String>, message: impl Into<String>) -> BadRequest {
    BadRequest {
        param: Some(param.into()),
        message: message.into(),
        not_found: false,
    }
}

/// The body parameter of a core request field: OpenAI's own names stay, oam's live in `oam`.
pub(crate) fn param_of(field: &str) -> String {
    match field {
        "messages" | "response_format" | "model" | "tools" => field.to_string(),
        "id" => "oam.request_id".to_string(),
        other => format!("oam.{other}"),
    }
}

pub(crate) fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

pub(crate) fn parse_header<T: std::str::FromStr>(
    h: &HeaderMap,
    name: &str,
) -> Result<Option<T>, BadRequest> {
    match header(h, name) {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| bad(name, format!("header {name}: cannot read {v:?}"))),
    }
}

pub(crate) fn parse_enum_header<T: serde::de::DeserializeOwned>(
    h: &HeaderMap,
    name: &str,
) -> Result<Option<T>, BadRequest> {
    match header(h, name) {
        None => Ok(None),
        Some(v) => {
            let v = v.to_ascii_lowercase();
            let read = serde::de::value::StrDeserializer::<serde::de::value::Error>::new(&v);
            T::deserialize(read)
                .map(Some)
                .map_err(|e| bad(name, format!("header {name}: {e}")))
        }
    }
}

/// One client API's anatomy, as the router and the live relay use it: its requests decoded
/// into the core request and what goes upstream, its answers (whole, or as its stream's events)
/// and errors written in its own shapes, and a stream relayed live as its events. Each sibling
/// module implements it for a unit struct; adding an API is a module and a line in the router
/// (`node::http::answers`).
pub(crate) trait ClientApi: Sync {
    /// The request's headers as the node reads them (a key sent in the API's own header).
    fn headers(&self, h: HeaderMap) -> HeaderMap {
        h
    }

    /// The core request a body of this API asks, whether it asked for a stream, and what goes
    /// upstream; or the 400 that says why it cannot be served. `new_id` names a request that
    /// names itself nowhere.
    fn decode_request(
        &self,
        cfg: &NodeConfig,
        body: &[u8],
        h: &HeaderMap,
        new_id: &dyn Fn() -> String,
    ) -> Result<(Request, bool, Passthrough), BadRequest>;

    /// A decided answer as this API writes it: its body (`a.body` holds a chat completion, or
    /// an error in OpenAI's envelope) and whether that is the events of a stream (`stream`: the
    /// caller asked for one).
    fn answer_of(&self, a: &Answer, stream: bool) -> (bytes::Bytes, bool);

    /// How a stream is relayed live in this API's events.
    fn relay(&self, pass: &Passthrough) -> Box<dyn Relayed>;
}

/// A stream relayed live in one client API: each chunk of the upstream's stream (as it came:
/// `data`; read: `delta`) becomes the events it means, and the decision ends it.
pub(crate) trait Relayed: Send + Sync {
    /// The events one chunk means (none: empty).
    fn chunk(&mut self, data: &str, delta: &Delta) -> String;

    /// The stream goes on on another target (a continuation), whose chunks name `model`.
    fn continued_by(&mut self, _model: &RawValue) {}

    /// The events that end the stream once `d` is decided.
    fn end(&mut self, d: &Decision) -> String;
}

/// What a client API read from its request, as the node serves it: the turns typed, the
/// sampling parameters and every other member under chat's names (`extra`, passed on), the
/// tools as a chat tool list.
pub(crate) struct Decoded {
    pub model: Option<String>,
    pub turns: Vec<Turn>,
    pub sampling: Sampling,
    pub max_tokens: Option<u32>,
    pub response_format: Option<Value>,
    pub stream: bool,
    /// The caller asked for the usage chunk of a stream (`stream_options.include_usage`; oam
    /// sets the upstream's stream options itself: it always asks a stream for its usage).
    pub include_usage: bool,
    pub oam: Option<OamFields>,
    pub tools: Option<Box<RawValue>>,
    pub extra: serde_json::Map<String, Value>,
}

impl Decoded {
    /// The core request it is, against the targets a node routes to (oam's fields from the
    /// `oam` object first, then the `X-OAM-*` headers), whether it asked for a stream, and
    /// what goes upstream as it came. `new_id` names a request that names itself nowhere.
    pub(crate) fn into_request(
        self,
        cfg: &NodeConfig,
        h: &HeaderMap,
        new_id: impl FnOnce() -> String,
    ) -> Result<(Request, bool, Passthrough), BadRequest> {
        if self.turns.is_empty() {
            return Err(bad("messages", "messages must hold at least one message"));
        }
        if let Some(model) = &self.model
            && !known_model(cfg, model)
        {
            let known: Vec<&str> = if cfg.routes.is_empty() {
                cfg.targets.iter().map(|t| t.model.as_str()).collect()
            } else {
                cfg.routes.iter().map(|r| r.model.as_str()).collect()
            };
            return Err(BadRequest {
                not_found: true,
                ..bad(
                    "model",
                    format!(
                        "unknown model {model:?}; this node serves {} (or send \"auto\")",
                        known.join(", ")
                    ),
                )
            });
        }
        let stream = self.stream;
        let tools = crate::node::tools::declared(self.tools.as_deref())?;
        // `n` goes on to the upstream; oam prices every answer it asks for.
        let n = match self.sampling.n {
            None => 1,
            Some(n) if (1..=openai::MAX_N).contains(&u64::from(n)) => n,
            Some(_) => {
                let most = openai::MAX_N;
                return Err(bad(
                    "n",
                    format!("n must be a whole number from 1 to {most}"),
                ));
            }
        };
        let o = self.oam.unwrap_or_default();
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
            team: None,
            model: self.model,
            messages: messages_of(&self.turns),
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
            max_tokens: self.max_tokens,
            n,
            policy: o.policy.unwrap_or_default(),
            contract: o.contract,
            response_format: self.response_format,
            tools,
            bound_to: None,
            tool_allowlist: None,
            embeddings: false,
            stream,
        };
        let pass = Passthrough {
            turns: self.turns,
            sampling: self.sampling,
            extra: self.extra,
            tools: self.tools,
            include_usage: self.include_usage,
            native: None,
        };
        Ok((request, stream, pass))
    }
}

/// What one client API's own code costs a request, for the benches: `body` decoded as `api`
/// asks (`chat`, `messages` or `responses`), then `completion` (the chat completion, its `oam`
/// object in, that the pipeline hands every API) written as that API's answer. The answer's
/// length; 0 when the body is refused.
#[doc(hidden)]
pub fn translated(api: &str, body: &[u8], completion: &bytes::Bytes) -> usize {
    static CFG: std::sync::OnceLock<Option<NodeConfig>> = std::sync::OnceLock::new();
    let Some(cfg) = CFG
        .get_or_init(|| NodeConfig::parse("bench", "", "http://127.0.0.1:1").ok())
        .as_ref()
    else {
        return 0;
    };
    let api: &dyn ClientApi = match api {
        "messages" => &anthropic::Messages,
        "responses" => &responses::Responses,
        _ => &openai::Chat,
    };
    let Ok((request, stream, _)) =
        api.decode_request(cfg, body, &HeaderMap::new(), &|| "bench".into())
    else {
        return 0;
    };
    let answer = Answer {
        stream,
        status: axum::http::StatusCode::OK,
        body: completion.clone(),
        request_id: request.id,
        phase: "accepted".into(),
        reasons: String::new(),
        target: String::new(),
        live: None,
        buffered: None,
        native: false,
    };
    api.answer_of(&answer, stream).0.len()
}

/// A request body read as the JSON object it must be.
pub(crate) fn object_of(body: &[u8]) -> Result<serde_json::Map<String, Value>, BadRequest> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(bad("body", "the body must be a JSON object")),
        Err(e) => Err(bad("body", format!("the body is not JSON: {e}"))),
    }
}

/// The request member `name` (its value `v`) read as a `T`, or the 400 that names where in it
/// it is not one.
pub(crate) fn member<T: serde::de::DeserializeOwned>(
    v: Value,
    name: &str,
) -> Result<T, BadRequest> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = match e.path().to_string() {
            p if p == "." => name.to_string(),
            p => format!("{name}.{p}"),
        };
        let message = format!("invalid request: {path}: {}", e.inner());
        BadRequest {
            param: Some(path),
            message,
            not_found: false,
        }
    })
}

/// The chat request a decoded request and its passthrough mean (what a chat upstream is sent
/// of them, and the pipeline reads), for tests of each API's translation.
#[cfg(test)]
pub(crate) fn as_chat(request: &Request, pass: &Passthrough) -> Value {
    let mut c = Value::Object(pass.extra.clone());
    if let Ok(Value::Object(sampling)) = serde_json::to_value(&pass.sampling) {
        c.as_object_mut().expect("an object").extend(sampling);
    }
    c["messages"] = serde_json::to_value(&pass.turns).expect("turns write");
    c["max_tokens"] = serde_json::json!(request.max_tokens);
    if let Some(tools) = &pass.tools {
        c["tools"] = serde_json::from_str(tools.get()).expect("a tool list");
    }
    if let Some(f) = &request.response_format {
        c["response_format"] = f.clone();
    }
    c
}

/// A request body's members (`members_of`), or the 400 that says it is no JSON object.
pub(crate) fn body_members(body: &[u8]) -> Result<Members<'_>, BadRequest> {
    let text =
        std::str::from_utf8(body).map_err(|e| bad("body", format!("the body is not JSON: {e}")))?;
    members_of(text).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => bad("body", "the body must be a JSON object"),
        _ => bad("body", format!("the body is not JSON: {e}")),
    })
}

/// JSON text read as a `T`, if it is one.
pub(crate) fn read<'a, T: Deserialize<'a>>(raw: &'a RawValue) -> Option<T> {
    serde_json::from_str(raw.get()).ok()
}

/// A member oam passes on (or reads through serde) as the JSON it is.
pub(crate) fn passed_on(raw: &RawValue, at: &str) -> Result<Value, BadRequest> {
    serde_json::from_str(raw.get()).map_err(|e| bad(at, format!("{at}: {e}")))
}

/// JSON text that is `null`.
pub(crate) fn is_null(raw: &RawValue) -> bool {
    raw.get() == "null"
}
