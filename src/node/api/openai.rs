//! The OpenAI chat-completions surface, in one place: the request as clients send it (with
//! oam's own fields in an `oam` object or `X-OAM-*` headers) decoded into typed turns and the
//! core's request, the error envelope, the `oam` object every answer carries, the HTTP status a
//! decision answers with, and the chunks of a stream (read from upstreams, written to callers).
//! Another API is a sibling of this file.

pub(crate) use super::{BadRequest, Decoded, OamFields, bad, header, param_of};
use crate::clock::now_ms;
use crate::core::pipeline::{Decision, DecisionOutcome};
use crate::core::reason::{Phase, ReasonCode};
use crate::core::request::{GenerationStatus, Request};
use crate::node::config::NodeConfig;
use crate::node::exchange::{
    Attempt, ChatUsage, ChunkOut, Completion, OwnedHead, Passthrough, Reply, UsageOut,
};
use crate::node::model::{Sampling, Turn};
use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

/// The OpenAI error envelope: `{"error": {message, type, param, code}}`, with the `oam` object
/// of the decision that made it (if one did).
#[derive(serde::Serialize)]
pub(crate) struct ErrorBody<'a> {
    error: ErrorFields<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    oam: Option<OamObject<'a>>,
}

#[derive(serde::Serialize)]
struct ErrorFields<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: &'a str,
}

/// The OpenAI error envelope of `message`.
pub(crate) fn error_body<'a>(
    message: &'a str,
    kind: &'a str,
    param: Option<&'a str>,
    code: &'a str,
) -> ErrorBody<'a> {
    ErrorBody {
        error: ErrorFields {
            message,
            kind,
            param,
            code,
        },
        oam: None,
    }
}

/// The most tools one request may declare (OpenAI's own limit).
pub(crate) const MAX_TOOLS: usize = 128;

/// The most answers one request may ask for (OpenAI's own limit on `n`).
pub(crate) const MAX_N: u64 = 128;

/// The OpenAI request shape: what oam reads; everything else (sampling parameters, unknown
/// future fields) is kept in `rest`, the tools and messages as sent, for the upstream.
pub(crate) struct ChatIn {
    model: Option<String>,
    /// Each message as it came (read into a `Turn` by `decode_request`).
    messages: Vec<Box<RawValue>>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    response_format: Option<Value>,
    stream: Option<bool>,
    sampling: Sampling,
    include_usage: bool,
    oam: Option<OamFields>,
    /// `tools` as it came: read once per distinct list (`tools::declared`), sent on as it is.
    tools: Option<Box<RawValue>>,
    rest: serde_json::Map<String, Value>,
}

/// `stream_options`: what of it oam reads.
#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// A request body's members, `tools` kept as its text (a tree of 128 schemas cost more to
/// build and drop than the rest of the request).
struct Members {
    tools: Option<Box<RawValue>>,
    messages: Option<Box<RawValue>>,
    rest: serde_json::Map<String, Value>,
}

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Members, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<Members, A::Error> {
                let mut out = Members {
                    tools: None,
                    messages: None,
                    rest: serde_json::Map::new(),
                };
                while let Some(k) = m.next_key::<String>()? {
                    if k == "tools" {
                        out.tools = Some(m.next_value()?);
                    } else if k == "messages" {
                        out.messages = Some(m.next_value()?);
                    } else {
                        out.rest.insert(k, m.next_value()?);
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_map(Visit)
    }
}

impl ChatIn {
    /// The body read once, as one JSON object, and the fields oam reads taken out of it (serde's
    /// `flatten` read every byte twice, the second time from a copy of its own: with 128 tools
    /// that was most of a request's CPU). A bad field is named by its path.
    fn parse(body: &[u8]) -> Result<ChatIn, BadRequest> {
        let invalid = |path: Option<String>, e: &dyn std::fmt::Display| {
            let at = path.as_ref().map(|p| format!("{p}: ")).unwrap_or_default();
            BadRequest {
                param: path,
                message: format!("invalid chat completion request: {at}{e}"),
                not_found: false,
            }
        };
        let Members {
            tools,
            messages,
            mut rest,
        } = serde_json::from_slice(body).map_err(|e| invalid(None, &e))?;
        fn take<T: serde::de::DeserializeOwned>(
            rest: &mut serde_json::Map<String, Value>,
            name: &str,
        ) -> Result<Option<T>, (String, String)> {
            let Some(v) = rest.remove(name) else {
                return Ok(None);
            };
            serde_path_to_error::deserialize(v).map_err(|e| {
                let path = match e.path().to_string() {
                    p if p == "." => name.to_string(),
                    p => format!("{name}.{p}"),
                };
                (path, e.into_inner().to_string())
            })
        }
        let read = || -> Result<ChatIn, (String, String)> {
            Ok(ChatIn {
                model: take(&mut rest, "model")?.flatten(),
                messages: messages
                    .map(|m| serde_json::from_str::<Option<Vec<Box<RawValue>>>>(m.get()))
                    .transpose()
                    .map_err(|e| ("messages".to_string(), e.to_string()))?
                    .flatten()
                    .ok_or_else(|| (String::new(), "missing field `messages`".to_string()))?,
                max_tokens: take(&mut rest, "max_tokens")?.flatten(),
                max_completion_tokens: take(&mut rest, "max_completion_tokens")?.flatten(),
                response_format: take(&mut rest, "response_format")?.flatten(),
                stream: take(&mut rest, "stream")?.flatten(),
                sampling: Sampling {
                    temperature: take(&mut rest, "temperature")?.flatten(),
                    top_p: take(&mut rest, "top_p")?.flatten(),
                    stop: take(&mut rest, "stop")?.flatten(),
                    user: take(&mut rest, "user")?.flatten(),
                    tool_choice: take(&mut rest, "tool_choice")?.flatten(),
                    parallel_tool_calls: take(&mut rest, "parallel_tool_calls")?.flatten(),
                    n: take(&mut rest, "n")?.flatten(),
                    logprobs: take(&mut rest, "logprobs")?.flatten(),
                },
                include_usage: take::<Option<StreamOptions>>(&mut rest, "stream_options")?
                    .flatten()
                    .and_then(|o| o.include_usage)
                    .unwrap_or(false),
                oam: take(&mut rest, "oam")?.flatten(),
                tools: None,
                rest: serde_json::Map::new(),
            })
        };
        let mut chat = read().map_err(|(path, e)| {
            let path = (!path.is_empty()).then_some(path);
            invalid(path, &e)
        })?;
        chat.rest = rest;
        chat.tools = tools;
        Ok(chat)
    }
}

/// `to_request` against the providers a node routes to; `new_id` names a request that names
/// itself nowhere.
pub(crate) fn decode_request(
    cfg: &NodeConfig,
    body: &[u8],
    h: &HeaderMap,
    new_id: impl FnOnce() -> String,
) -> Result<(Request, bool, Passthrough), BadRequest> {
    let chat = ChatIn::parse(body)?;
    let mut turns = Vec::with_capacity(chat.messages.len());
    for (i, raw) in chat.messages.iter().enumerate() {
        let turn = Turn::from_chat(raw).map_err(|e| {
            let at = match e.path().to_string() {
                p if p == "." => format!("messages[{i}]"),
                p => format!("messages[{i}].{p}"),
            };
            let message = format!("invalid chat completion request: {at}: {}", e.inner());
            bad(at, message)
        })?;
        turns.push(turn);
    }
    let decoded = Decoded {
        model: chat.model,
        turns,
        sampling: chat.sampling,
        max_tokens: chat.max_completion_tokens.or(chat.max_tokens),
        response_format: chat.response_format,
        stream: chat.stream == Some(true),
        include_usage: chat.include_usage,
        oam: chat.oam,
        tools: chat.tools,
        extra: chat.rest,
    };
    decoded.into_request(cfg, h, new_id)
}

/// The HTTP status for a refused request, by the phase that refused it.
pub(crate) fn status_for(d: &Decision) -> StatusCode {
    let timed_out = d.reason_codes.contains(&ReasonCode::GenerationTimeout);
    // The last call made refused the request itself (invalid, too long for any target's
    // context window, or against content policy): the caller should change it.
    let rejected = d
        .attempts
        .iter()
        .rev()
        .find_map(|a| a.status)
        .is_some_and(GenerationStatus::is_refusal);
    if d.reason_codes.contains(&ReasonCode::RateLimitExceeded) {
        return StatusCode::TOO_MANY_REQUESTS;
    }
    if d.reason_codes.contains(&ReasonCode::LocalResourceExhausted) {
        return StatusCode::SERVICE_UNAVAILABLE; // the node's shortage: retry after a moment
    }
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

/// The `oam` object of an answer, written straight from the decision (members in name order).
#[derive(serde::Serialize)]
pub(crate) struct OamObject<'a> {
    agent: &'a str,
    attempts: usize,
    confidence: Option<f64>,
    cost_usd: f64,
    escalation: &'a Option<crate::core::escalation::Escalation>,
    fallback: bool,
    incident: &'a Option<crate::core::loops::Incident>,
    outcome: DecisionOutcome,
    phase: crate::core::reason::Phase,
    reason_codes: &'a [ReasonCode],
    request_id: &'a str,
    route: Option<&'a str>,
    /// A live stream cut and continued: every target whose text the answer holds, in order.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    served_by: Vec<&'a str>,
    /// A budget refused it: the estimate beside what the budget had left.
    #[serde(skip_serializing_if = "Option::is_none")]
    shortfall: Option<&'a crate::core::budget::Shortfall>,
    target: Option<&'a str>,
    tried: Vec<Tried<'a>>,
}

#[derive(serde::Serialize)]
struct Tried<'a> {
    /// What it cost: the answer's `cost_usd` is their sum.
    cost_usd: f64,
    latency_ms: u64,
    reason_codes: &'a [ReasonCode],
    status: Option<GenerationStatus>,
    target: &'a str,
}

impl<'a> OamObject<'a> {
    pub(crate) fn of(d: &'a Decision) -> Self {
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
            reason_codes: &d.reason_codes,
            request_id: &d.request_id,
            route: d.route.as_deref(),
            served_by: Some(d.served_by())
                .filter(|by| by.len() > 1)
                .unwrap_or_default(),
            shortfall: d.shortfall.as_ref(),
            target: d.provider.as_deref(),
            tried: d
                .attempts
                .iter()
                .filter_map(|a| {
                    Some(Tried {
                        cost_usd: a.cost_usd,
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
pub(crate) fn json_bytes(v: &impl serde::Serialize) -> bytes::Bytes {
    serde_json::to_vec(v).unwrap_or_default().into()
}

/// The answer to decision `d` as an OpenAI client reads it: its status and body. `last` is the
/// last call made (its upstream answer is passed on as it came when accepted, or when it is a
/// content-policy refusal); `model` is the decided target's model; `why` says why the targets
/// weighed are down, for a refusal.
pub(crate) fn answer(
    d: &Decision,
    last: Option<Attempt>,
    model: &str,
    why: &[String],
) -> (StatusCode, bytes::Bytes) {
    let status = status_for(d);
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
    if let Some(Value::Object(mut refusal)) = refusal {
        // The upstream's content-policy refusal as it came (an error, or a filtered answer),
        // with its status, and oam's object.
        refusal.insert("oam".into(), json!(OamObject::of(d)));
        let status = StatusCode::from_u16(upstream_status).unwrap_or(status);
        (status, json_bytes(&refusal))
    } else if let (true, Some(Reply::Completion(answer))) = (accepted, &upstream) {
        // The upstream's chat completion as it came, byte for byte (choices, tool calls,
        // finish reason, logprobs, usage, system fingerprint, its model), with oam's object
        // written in.
        let oam = serde_json::to_vec(&OamObject::of(d)).unwrap_or_default();
        (
            status,
            crate::node::exchange::with_member(answer, "oam", &oam).into(),
        )
    } else if let (true, Some(Reply::Json(Value::Object(mut answer)))) = (accepted, upstream)
        && (answer.get("choices").is_some_and(Value::is_array)
            || answer.get("data").is_some_and(Value::is_array)
            || answer.get("type").is_some_and(|t| t == "message"))
    {
        // A chat completion of another shape, a list of embeddings, or a Messages target's
        // answer to a request it was sent as it came.
        answer.insert("oam".into(), json!(OamObject::of(d)));
        (status, json_bytes(&answer))
    } else if accepted {
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
        let reasons: Vec<&str> = d.reason_codes.iter().map(|c| c.as_str()).collect();
        let mut message = format!(
            "oam {} the request in phase {}: {}",
            match d.outcome {
                DecisionOutcome::Escalated => "escalated",
                _ => "refused",
            },
            d.phase,
            reasons.join(", ")
        );
        if let Some(sf) = &d.shortfall {
            message = format!("{message} ({})", sf.describe());
        }
        if !why.is_empty() {
            message = format!("{message}; last failures: {}", why.join("; "));
        }
        let kind = if status.is_server_error() {
            "server_error"
        } else {
            "invalid_request_error"
        };
        let mut body = error_body(&message, kind, None, last_code);
        body.oam = Some(OamObject::of(d));
        (status, json_bytes(&body))
    }
}

/// An accepted, already checked answer as one server-sent-events body: its content chunk,
/// then its finish chunk with the usage and the `oam` object, then `[DONE]`.
pub(crate) fn sse_of(answer: &Completion) -> String {
    let content = [answer.content_choice()];
    let finish = [answer.finish_choice()];
    let first = ChunkOut::of(answer.head, &content).text();
    let mut last = ChunkOut::of(answer.head, &finish);
    last.usage = answer.usage_sent.map(UsageOut::Sent);
    last.oam = answer.oam;
    let last = last.text();
    format!("data: {first}\n\ndata: {last}\n\ndata: [DONE]\n\n")
}

/// The event that ends a relayed stream once `d` is decided: for an accepted answer oam's last
/// chunk (no choices, the `oam` object, and the upstream's `usage` when the caller asked for
/// it, so the last chunk before `[DONE]` carries the usage as SDK helpers read it) and
/// `[DONE]`; else the usage chunk as it came and an in-band error event, and never `[DONE]`,
/// so that no client takes a cut answer for a whole one. `head` is the stream's first chunk's
/// `id`, `created` and `model` (the last model, after a continuation).
pub(crate) fn stream_end(
    d: &Decision,
    head: Option<&OwnedHead>,
    usage: Option<&RawValue>,
) -> String {
    /// A chunk with no choices.
    #[derive(serde::Serialize)]
    struct ClosingChunk<'a> {
        id: Option<&'a RawValue>,
        object: &'static str,
        created: Option<&'a RawValue>,
        model: Option<&'a RawValue>,
        choices: [(); 0],
        #[serde(skip_serializing_if = "Option::is_none")]
        usage: Option<&'a RawValue>,
        #[serde(skip_serializing_if = "Option::is_none")]
        oam: Option<OamObject<'a>>,
    }
    let last = |usage, oam| {
        let last = ClosingChunk {
            id: head.and_then(|h| h.id.as_deref()),
            object: "chat.completion.chunk",
            created: head.and_then(|h| h.created.as_deref()),
            model: head.and_then(|h| h.model.as_deref()),
            choices: [],
            usage,
            oam,
        };
        serde_json::to_string(&last).unwrap_or_default()
    };
    if d.outcome == DecisionOutcome::Accepted {
        let last = last(usage, Some(OamObject::of(d)));
        format!("data: {last}\n\ndata: [DONE]\n\n")
    } else {
        let reasons: Vec<&str> = d.reason_codes.iter().map(|c| c.as_str()).collect();
        let code = d.reason_codes.last().map_or("", |c| c.as_str());
        let why = format!(
            "oam ended the stream in phase {}: {}",
            d.phase,
            reasons.join(", ")
        );
        let mut error = error_body(&why, "server_error", None, code);
        error.oam = Some(OamObject::of(d));
        let mut out = String::new();
        if usage.is_some() {
            out = format!("data: {}\n\n", last(usage, None));
        }
        let error = serde_json::to_string(&error).unwrap_or_default();
        out + &format!("data: {error}\n\n")
    }
}

/// OpenAI's chat completions (and the NATS data plane, which speaks it).
pub(crate) struct Chat;

impl super::ClientApi for Chat {
    fn decode_request(
        &self,
        cfg: &NodeConfig,
        body: &[u8],
        h: &HeaderMap,
        new_id: &dyn Fn() -> String,
    ) -> Result<(Request, bool, Passthrough), BadRequest> {
        decode_request(cfg, body, h, new_id)
    }

    /// The chat completion as it is; a stream checked whole as its events (`sse_of`).
    fn answer_of(&self, a: &crate::node::request::Answer, stream: bool) -> (bytes::Bytes, bool) {
        if stream && a.status == StatusCode::OK {
            let body = String::from_utf8_lossy(&a.body);
            let answer = crate::node::exchange::read_completion(&body).unwrap_or_default();
            (sse_of(&answer).into(), true)
        } else {
            (a.body.clone(), false)
        }
    }

    fn relay(&self, pass: &Passthrough) -> Box<dyn super::Relayed> {
        Box::new(ChatRelay {
            head: None,
            usage: None,
            include_usage: pass.include_usage,
        })
    }
}

/// A chat stream relayed live: its chunks as they came, its usage chunk held back for oam's
/// last chunk (when the caller asked for it), which repeats the first chunk's head.
struct ChatRelay {
    head: Option<OwnedHead>,
    usage: Option<Box<RawValue>>,
    include_usage: bool,
}

impl super::Relayed for ChatRelay {
    fn chunk(&mut self, data: &str, delta: &crate::node::exchange::Delta) -> String {
        if self.head.is_none() {
            self.head = Some(delta.head.to_owned());
        }
        if delta.usage_only {
            if self.include_usage {
                // As it came; counted by oam where it sums the parts of a continued stream.
                self.usage = match delta.usage_sent {
                    Some(sent) => Some(sent.to_owned()),
                    None => delta
                        .usage
                        .and_then(|u| serde_json::value::to_raw_value(&ChatUsage::from(u)).ok()),
                };
            }
            return String::new();
        }
        format!("data: {data}\n\n")
    }

    fn continued_by(&mut self, model: &RawValue) {
        if let Some(head) = &mut self.head {
            head.model = Some(model.to_owned());
        }
    }

    fn end(&mut self, d: &Decision) -> String {
        stream_end(d, self.head.as_ref(), self.usage.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::request::{Priority, Risk};
    use axum::http::HeaderValue;

    fn decision(outcome: &str, phase: &str) -> Decision {
        crate::node::offline::decision(outcome, phase, &[])
    }

    #[test]
    fn a_body_is_read_once_and_a_bad_field_is_named_by_its_path() {
        let chat = ChatIn::parse(
            br#"{"model": "m", "messages": [{"role": "user", "content": "x"}],
                 "tools": [{"type": "function"}], "temperature": 0.5, "stream": null,
                 "seed": 3}"#,
        )
        .expect("a good body");
        assert_eq!(chat.model.as_deref(), Some("m"));
        assert_eq!((chat.messages.len(), chat.stream), (1, None));
        let rest: Vec<&str> = chat.rest.keys().map(String::as_str).collect();
        assert_eq!(rest, ["seed"], "what oam does not read goes on");
        assert_eq!(chat.sampling.temperature, Some(0.5), "sampling is read");
        let tools = chat.tools.as_deref().map(RawValue::get);
        assert_eq!(
            tools,
            Some(r#"[{"type": "function"}]"#),
            "tools go on as sent"
        );
        for (body, param, says) in [
            (&br#"{"messages": 5}"#[..], Some("messages"), "invalid type"),
            (
                br#"{"messages": [], "oam": {"risk": 3}}"#,
                Some("oam.risk"),
                "invalid type",
            ),
            (
                br#"{"messages": [], "max_tokens": -1}"#,
                Some("max_tokens"),
                "invalid value",
            ),
            (br#"{"model": "m"}"#, None, "missing field `messages`"),
            (br#"[1]"#, None, "invalid type"),
            (br#"{"messages": "#, None, "EOF"),
        ] {
            let Err(e) = ChatIn::parse(body) else {
                panic!("{} is no chat request", String::from_utf8_lossy(body));
            };
            assert_eq!(e.param.as_deref(), param, "{}", e.message);
            assert!(
                e.message.starts_with("invalid chat completion request: ")
                    && e.message.contains(says),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn statuses_follow_the_phase() {
        let mut d = decision("rejected", "admission");
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

    fn cfg() -> NodeConfig {
        NodeConfig::load(None, "http://127.0.0.1:1").expect("the default configuration")
    }

    fn decode(body: Value, h: &HeaderMap) -> Result<(Request, bool, Passthrough), BadRequest> {
        decode_request(&cfg(), body.to_string().as_bytes(), h, || "new".into())
    }

    #[test]
    fn oam_fields_come_from_the_body_first_then_the_headers() {
        let mut h = HeaderMap::new();
        h.insert("x-oam-agent", HeaderValue::from_static("from-header"));
        h.insert("x-oam-risk", HeaderValue::from_static("HIGH"));
        h.insert("x-request-id", HeaderValue::from_static("hdr-id"));
        let body = json!({
            "model": "auto", "stream": true, "n": 2, "max_completion_tokens": 7,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "oam": {"agent": "from-body", "priority": "critical"},
            "temperature": 0.5, "stream_options": {"include_usage": true}
        });
        let Ok((r, stream, pass)) = decode(body, &h) else {
            panic!("does not decode")
        };
        assert_eq!(r.agent, "from-body", "the body wins over the header");
        assert_eq!(
            r.risk,
            Risk::High,
            "a header fills what the body leaves out"
        );
        assert_eq!(r.priority, Priority::Critical);
        assert_eq!((r.id.as_str(), r.n, r.max_tokens), ("hdr-id", 2, Some(7)));
        assert_eq!(r.messages[0].content, "a\nb", "text parts are joined");
        assert!(stream && pass.include_usage);
        assert_eq!(pass.sampling.temperature, Some(0.5), "sampling is read");
        assert!(
            !pass.extra.contains_key("stream_options"),
            "oam sets the upstream's own"
        );
    }

    #[test]
    fn what_cannot_be_served_is_refused_naming_the_parameter() {
        let h = HeaderMap::new();
        let m = json!([{"role": "user", "content": "q"}]);
        let refused = |body: Value| match decode(body, &h) {
            Ok(_) => panic!("decoded"),
            Err(e) => e,
        };
        let e = refused(json!({"model": "no-such-model", "messages": m}));
        assert_eq!(e.param.as_deref(), Some("model"));
        assert!(e.message.contains("no-such-model"), "{}", e.message);
        assert_eq!(
            refused(json!({"messages": []})).param.as_deref(),
            Some("messages")
        );
        assert_eq!(
            refused(json!({"messages": m, "n": 0})).param.as_deref(),
            Some("n")
        );
        let tools: Vec<Value> = (0..=MAX_TOOLS)
            .map(|i| json!({"type": "function", "function": {"name": format!("t{i}")}}))
            .collect();
        assert_eq!(
            refused(json!({"messages": m, "tools": tools}))
                .param
                .as_deref(),
            Some("tools")
        );
        let e = refused(json!({"messages": [{"role": "user", "content": 5}]}));
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        let e = refused(json!({"messages": m, "oam": {"risk": "extreme"}}));
        assert_eq!(e.param.as_deref(), Some("oam.risk"), "{}", e.message);
    }

    #[test]
    fn a_refusal_answers_with_the_error_envelope_and_the_oam_object() {
        let mut d = decision("rejected", "admission");
        d.phase = Phase::Budget;
        d.reason_codes = vec![ReasonCode::BudgetExhausted];
        let (status, body) = answer(&d, None, "m", &[]);
        assert_eq!(status.as_u16(), 402);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], json!("BUDGET_EXHAUSTED"));
        assert_eq!(v["error"]["type"], json!("invalid_request_error"));
        assert_eq!(v["oam"]["reason_codes"], json!(["BUDGET_EXHAUSTED"]));
        assert_eq!(v["oam"]["request_id"], json!("r"));
        assert!(v["oam"].get("shortfall").is_none(), "{v}");
        // A budget's refusal says what the attempt was estimated at beside what was left.
        d.shortfall = Some(crate::core::budget::Shortfall {
            agent: Some("bot".into()),
            team: None,
            task: None,
            estimate_usd: 0.0031,
            remaining_usd: 0.002,
            limit_usd: 0.002,
        });
        let v: Value = serde_json::from_slice(&answer(&d, None, "m", &[]).1).unwrap();
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.ends_with(
                "(an attempt estimated at $0.0031 is more than the $0.0020 left of agent \
                 bot's $0.0020 budget)"
            ),
            "{message}"
        );
        assert_eq!(v["oam"]["shortfall"]["estimate_usd"], 0.0031);
    }

    #[test]
    fn an_accepted_answer_without_an_upstream_body_is_a_chat_completion() {
        let mut d = decision("rejected", "admission");
        d.outcome = DecisionOutcome::Accepted;
        d.phase = Phase::Accepted;
        d.provider = Some("sim/m".into());
        let mut g = crate::core::request::Generation::ok("hello", 3);
        g.finish_reason = Some("length".into());
        let last = Attempt::from(g);
        let (status, body) = answer(&d, Some(last), "m", &[]);
        assert_eq!(status.as_u16(), 200);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["object"], json!("chat.completion"));
        assert_eq!(v["model"], json!("m"));
        assert_eq!(v["choices"][0]["message"]["content"], json!("hello"));
        assert_eq!(v["choices"][0]["finish_reason"], json!("length"));
        assert_eq!(v["oam"]["target"], json!("sim/m"));
        assert!(
            v["oam"].get("provider").is_none(),
            "the target is named once"
        );
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
                    Ok((r, _, pass)) => proptest::prop_assert_eq!(r.messages.len(), pass.turns.len()),
                    Err(e) => proptest::prop_assert!(!e.message.is_empty()),
                }
            }
        }
    }

    #[test]
    fn a_checked_answer_is_one_body_of_events_with_usage_and_oam_last() {
        let body = crate::node::exchange::tests::completion().to_string();
        let text = sse_of(&crate::node::exchange::read_completion(&body).expect("a completion"));
        let data: Vec<&str> = text
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").expect("a data line"))
            .collect();
        assert_eq!(data.len(), 3);
        assert_eq!(data[2], "[DONE]");
        let last: Value = serde_json::from_str(data[1]).expect("JSON");
        assert_eq!(last["usage"]["total_tokens"], 6);
        assert_eq!(last["oam"]["request_id"], "r");
        assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn a_relayed_stream_ends_with_done_only_when_accepted() {
        let data = json!({"id": "c9", "created": 3, "model": "m", "choices": []}).to_string();
        let head = crate::node::exchange::read_chunk(&data)
            .expect("no error")
            .expect("a chunk")
            .head
            .to_owned();
        let usage = json!({"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8});
        let usage_text = serde_json::value::to_raw_value(&usage).unwrap();
        let ok = stream_end(
            &decision("accepted", "accepted"),
            Some(&head),
            Some(&usage_text),
        );
        assert!(ok.ends_with("data: [DONE]\n\n"), "{ok}");
        assert_eq!(
            ok.matches("data: ").count(),
            2,
            "one last chunk, then [DONE]: {ok}"
        );
        let last: Value = serde_json::from_str(
            ok.strip_prefix("data: ")
                .and_then(|s| s.split("\n\n").next())
                .expect("an event"),
        )
        .expect("JSON");
        assert_eq!((&last["id"], &last["choices"]), (&json!("c9"), &json!([])));
        assert_eq!(last["oam"]["outcome"], "accepted");
        assert_eq!(
            last["usage"], usage,
            "the last chunk before [DONE] has the usage"
        );

        let mut d = decision("rejected", "semantic");
        d.reason_codes = vec![ReasonCode::ContractSchemaViolation];
        let refused = stream_end(&d, Some(&head), None);
        assert!(
            !refused.contains("[DONE]"),
            "a cut answer never ends cleanly: {refused}"
        );
        let error: Value =
            serde_json::from_str(refused.trim().strip_prefix("data: ").expect("an event"))
                .expect("JSON");
        assert_eq!(error["error"]["code"], "CONTRACT_SCHEMA_VIOLATION");
        assert_eq!(error["oam"]["phase"], "semantic");
    }
}
