//! The Model Context Protocol door (`POST /mcp`, streamable HTTP, JSON answers): the tools of
//! the configured tool servers (`node::catalog`) listed as one server's, and each `tools/call`
//! run through the pipeline as a model call is (admission, loop check, budget at the server's
//! price per call, the server's breaker and cluster health, the tool's output schema as the
//! contract, retries only for tools that say they are idempotent, a decision record).
//!
//! Both revisions are served: 2026-07-28 (each POST self-contained: `server/discover`, the
//! `Mcp-Method` and `Mcp-Name` headers, `resultType` on results) and 2025-11-25 (`initialize`,
//! no session: any node serves any call). A refusal of the gateway (a loop, a budget, a server
//! down) is a result with `isError` that says why, so the agent's model reads it; the decision
//! is in the result's `_meta` under `oam`.

use super::rpc::{self, Failure, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR};
use crate::core::decision::{Decision, DecisionOutcome};
use crate::core::reason::{Phase, ReasonCode};
use crate::core::request::{ANONYMOUS, Api, Message, Policy, Request};
use crate::node::api::{BadRequest, bad, header};
use crate::node::catalog::Tool;
use crate::node::exchange::ToolDefinition;
use crate::node::exchange::{Attempt, Passthrough, Reply};
use axum::http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Value, json};

/// The revisions served, newest first.
pub(crate) const MODERN: &str = "2026-07-28";
const LEGACY: [&str; 3] = ["2025-11-25", "2025-06-18", "2025-03-26"];

const HEADER_MISMATCH: i64 = -32020;
const UNSUPPORTED_VERSION: i64 = -32022;

/// A JSON-RPC exchange's answer: its HTTP status and body (none: 202 for a notification).
pub(crate) struct RpcAnswer {
    pub status: StatusCode,
    pub body: Option<Vec<u8>>,
}

/// How the request is spoken.
#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) enum Era {
    Modern,
    Legacy,
}

/// One JSON-RPC request read from the body.
pub(crate) struct RpcRequest {
    pub id: rpc::Id,
    pub method: String,
    pub params: RpcParams,
    pub era: Era,
}

/// What oam reads of a request's params (each method names some of them).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RpcParams {
    /// `tools/call`: the tool's public name.
    #[serde(default)]
    pub name: Option<String>,
    /// `tools/call`: its arguments, passed on as given.
    #[serde(default)]
    pub arguments: Option<Value>,
    /// `initialize`: the revision the client speaks.
    #[serde(default)]
    pub protocol_version: Option<String>,
}

impl RpcParams {
    /// The tool a `tools/call` names ("" when none).
    pub(crate) fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("")
    }
}

/// Why a revision was refused: what is served.
#[derive(Serialize)]
struct Unsupported<'a> {
    supported: Vec<&'a str>,
    requested: &'a str,
}

fn error(era: Era, id: &RawValue, code: i64, message: &str) -> RpcAnswer {
    failure(era, id, code, message, None::<()>)
}

fn failure<D: Serialize>(
    era: Era,
    id: &RawValue,
    code: i64,
    message: &str,
    data: Option<D>,
) -> RpcAnswer {
    let status = match (era, code) {
        (Era::Modern, METHOD_NOT_FOUND) => StatusCode::NOT_FOUND,
        (
            Era::Modern,
            PARSE_ERROR | INVALID_REQUEST | INVALID_PARAMS | HEADER_MISMATCH | UNSUPPORTED_VERSION,
        ) => StatusCode::BAD_REQUEST,
        (_, PARSE_ERROR) => StatusCode::BAD_REQUEST,
        _ => StatusCode::OK,
    };
    let error = Failure {
        code,
        message,
        data,
    };
    RpcAnswer {
        status,
        body: Some(rpc::failure(id, error)),
    }
}

/// A result, with `resultType` in 2026-07-28.
pub(crate) fn result(call: &RpcRequest, r: impl Serialize) -> RpcAnswer {
    passed_on(call, &serde_json::to_vec(&r).unwrap_or_default())
}

/// A result that came as JSON bytes (a tool's own), with `resultType` in 2026-07-28.
pub(crate) fn passed_on(call: &RpcRequest, r: &[u8]) -> RpcAnswer {
    let r = match call.era {
        Era::Modern => crate::node::exchange::set_member(r, "resultType", b"\"complete\""),
        Era::Legacy => r.to_vec(),
    };
    let body = match serde_json::from_slice::<&RawValue>(&r) {
        Ok(r) => rpc::success(&call.id, r),
        Err(e) => {
            let why = format!("the tool's result is not JSON: {e}");
            return error(call.era, &call.id, rpc::INTERNAL_ERROR, &why);
        }
    };
    RpcAnswer {
        status: StatusCode::OK,
        body: Some(body),
    }
}

/// Read the body's JSON-RPC message: a request to answer (`Ok(Some)`), a notification or a
/// response (`Ok(None)`: 202), or the error answer.
pub(crate) fn read(body: &[u8], h: &HeaderMap) -> Result<Option<RpcRequest>, RpcAnswer> {
    let version = header(h, "mcp-protocol-version");
    let no_id = rpc::no_id();
    let era = match version {
        Some(MODERN) => Era::Modern,
        None => Era::Legacy,
        Some(v) if LEGACY.contains(&v) => Era::Legacy,
        Some(v) => {
            let supported: Vec<&str> = std::iter::once(MODERN).chain(LEGACY).collect();
            let message = format!(
                "protocol revision {v} is not served; this gateway speaks {}",
                supported.join(", ")
            );
            let data = Unsupported {
                supported,
                requested: v,
            };
            return Err(failure(
                Era::Modern,
                &no_id,
                UNSUPPORTED_VERSION,
                &message,
                Some(data),
            ));
        }
    };
    let m = rpc::read(body).map_err(|(code, why)| error(era, &no_id, code, &why))?;
    // No method: a response to nothing this door asked; no id: a notification. Both are
    // acknowledged and dropped.
    let (Some(method), Some(id)) = (m.method, m.id.filter(|id| rpc::is_request_id(id))) else {
        return Ok(None);
    };
    let params: RpcParams =
        rpc::params(m.params.as_deref()).map_err(|why| error(era, &id, INVALID_PARAMS, &why))?;
    if era == Era::Modern {
        if header(h, "mcp-method") != Some(method.as_str()) {
            let why = "the Mcp-Method header does not match the request's method";
            return Err(error(era, &id, HEADER_MISMATCH, why));
        }
        if method == "tools/call" && header(h, "mcp-name") != params.name.as_deref() {
            let why = "the Mcp-Name header does not match the tool the request calls";
            return Err(error(era, &id, HEADER_MISMATCH, why));
        }
    }
    Ok(Some(RpcRequest {
        id,
        method,
        params,
        era,
    }))
}

/// What this door says of itself (`initialize`, `server/discover`).
#[derive(Serialize, Clone, Copy)]
struct ServerInfo {
    name: &'static str,
    version: &'static str,
}

const SERVER_INFO: ServerInfo = ServerInfo {
    name: "oam",
    version: env!("CARGO_PKG_VERSION"),
};

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ServerCapabilities {
    tools: ToolsCapability,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ToolsCapability {
    list_changed: bool,
}

const CAPABILITIES: ServerCapabilities = ServerCapabilities {
    tools: ToolsCapability {
        list_changed: false,
    },
};

/// The `initialize` result (2025-11-25 and before).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InitializeResult {
    protocol_version: &'static str,
    capabilities: ServerCapabilities,
    server_info: ServerInfo,
    instructions: &'static str,
}

/// The `server/discover` result (2026-07-28).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Discovered {
    supported_versions: [&'static str; 1],
    capabilities: ServerCapabilities,
    ttl_ms: u64,
    cache_scope: &'static str,
    #[serde(rename = "_meta")]
    meta: DiscoveredMeta,
}

#[derive(Serialize)]
struct DiscoveredMeta {
    #[serde(rename = "io.modelcontextprotocol/serverInfo")]
    server_info: ServerInfo,
}

/// An empty result (`ping`'s).
#[derive(Serialize)]
pub(crate) struct Empty {}

/// Answers to everything but `tools/list` and `tools/call`.
pub(crate) fn answer_plain(call: &RpcRequest) -> RpcAnswer {
    match (call.method.as_str(), call.era) {
        ("initialize", Era::Legacy) => {
            let asked = call.params.protocol_version.as_deref().unwrap_or("");
            let agreed = LEGACY.iter().find(|v| **v == asked).unwrap_or(&LEGACY[0]);
            let r = InitializeResult {
                protocol_version: agreed,
                capabilities: CAPABILITIES,
                server_info: SERVER_INFO,
                instructions: "Tools of this team's tool servers, each call judged by oam.",
            };
            result(call, r)
        }
        ("server/discover", _) => {
            let r = Discovered {
                supported_versions: [MODERN],
                capabilities: CAPABILITIES,
                ttl_ms: 0,
                cache_scope: "private",
                meta: DiscoveredMeta {
                    server_info: SERVER_INFO,
                },
            };
            result(call, r)
        }
        ("ping", _) => result(call, Empty {}),
        (m, era) => error(
            era,
            &call.id,
            METHOD_NOT_FOUND,
            &format!("method {m:?} is not served here (tools/list, tools/call, ping)"),
        ),
    }
}

/// The `tools/list` result.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ToolsListed {
    /// Each tool's definition as its server gave it, renamed.
    tools: Vec<ToolDefinition>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ttl_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_scope: Option<&'static str>,
}

/// The `tools/list` result: every tool served (those `allowed`), under its public name.
pub(crate) fn list_result(
    call: &RpcRequest,
    tools: &[Tool],
    allowed: impl Fn(&str) -> bool,
) -> RpcAnswer {
    let tools = tools
        .iter()
        .filter(|t| !t.changed && allowed(&t.public_name()))
        .map(|t| t.definition.listed_as(&t.public_name(), t.hash))
        .collect();
    let modern = call.era == Era::Modern;
    let r = ToolsListed {
        tools,
        ttl_ms: modern.then_some(0),
        cache_scope: modern.then_some("private"),
    };
    result(call, r)
}

/// A tool call refused before the pipeline (unknown tool: a JSON-RPC error; arguments that do
/// not fit, a changed definition: a result with `isError`, which the model reads).
pub(crate) fn refuse_call(call: &RpcRequest, tool: Option<&Tool>) -> Option<RpcAnswer> {
    let name = call.params.name();
    let Some(tool) = tool else {
        let why = format!("no tool {name:?} is served here (see tools/list)");
        return Some(error(call.era, &call.id, INVALID_PARAMS, &why));
    };
    let refused = |code: ReasonCode, why: String| {
        let oam = RefusedOam {
            outcome: "rejected",
            phase: code.phase(),
            reason_codes: [code],
            attempts: 0,
        };
        Some(result(call, ToolError::new(&why, Some(oam))))
    };
    if tool.changed {
        let why = format!(
            "{}: {name}'s definition changed since this gateway first saw it; it is not called \
             until the gateway pins the new one",
            ReasonCode::ToolDefinitionChanged.as_str()
        );
        return refused(ReasonCode::ToolDefinitionChanged, why);
    }
    let args = call.params.arguments.clone().unwrap_or_else(|| json!({}));
    if let Some(schema) = tool.definition.input_schema()
        && let Err(why) = crate::core::contract::fits_schema(&args, schema)
    {
        let why = format!(
            "{}: the arguments do not fit {name}'s input schema: {why}",
            ReasonCode::ToolArgumentsInvalid.as_str()
        );
        return refused(ReasonCode::ToolArgumentsInvalid, why);
    }
    None
}

/// The `oam` object of a call refused before the pipeline.
#[derive(Serialize)]
struct RefusedOam {
    outcome: &'static str,
    phase: Phase,
    reason_codes: [ReasonCode; 1],
    attempts: u32,
}

/// A `tools/call` result with `isError` saying why, with oam's decision (if any) in `_meta`.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ToolError<'a, O: Serialize> {
    content: [TextContent<'a>; 1],
    is_error: bool,
    #[serde(rename = "_meta", skip_serializing_if = "Option::is_none")]
    meta: Option<OamMeta<O>>,
}

impl<'a, O: Serialize> ToolError<'a, O> {
    fn new(why: &'a str, oam: Option<O>) -> Self {
        ToolError {
            content: [TextContent {
                kind: "text",
                text: why,
            }],
            is_error: true,
            meta: oam.map(|oam| OamMeta { oam }),
        }
    }
}

#[derive(Serialize)]
struct TextContent<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

#[derive(Serialize)]
struct OamMeta<O: Serialize> {
    oam: O,
}

/// The body `execute` decodes for a tool call (`decode`): the server, the call, and what the
/// tool's definition says of it.
#[derive(Serialize)]
struct CallBodyOut<'a> {
    allowlist: Option<&'a str>,
    server: &'a str,
    call: ToolCallOut<'a>,
    idempotent: bool,
    output_schema: Option<&'a Value>,
}

/// One call of a tool, as the tool server's upstream reads it from the request's message.
#[derive(Serialize)]
struct ToolCallOut<'a> {
    arguments: &'a Value,
    name: &'a str,
}

/// `CallBodyOut` as `decode` reads it.
#[derive(Deserialize)]
struct CallBodyIn<'a> {
    allowlist: Option<String>,
    server: String,
    #[serde(borrow)]
    call: &'a RawValue,
    idempotent: bool,
    output_schema: Option<Value>,
}

/// The body `execute` decodes for a tool call (`decode`).
pub(crate) fn call_body(call: &RpcRequest, tool: &Tool, allowlist: Option<&str>) -> Vec<u8> {
    let none = json!({});
    let body = CallBodyOut {
        allowlist,
        server: &tool.server,
        call: ToolCallOut {
            arguments: call.params.arguments.as_ref().unwrap_or(&none),
            name: &tool.name,
        },
        idempotent: tool.definition.idempotent(),
        output_schema: tool.definition.output_schema(),
    };
    serde_json::to_vec(&body).unwrap_or_default()
}

/// The core request of a tool call (`call_body`'s): bound to the tool server, its one message
/// the call, held to the tool's output schema, tried once unless it may run twice.
pub(crate) fn decode(
    body: &[u8],
    h: &HeaderMap,
    new_id: &dyn Fn() -> String,
) -> Result<(Request, bool, Passthrough), BadRequest> {
    let v: CallBodyIn<'_> =
        serde_json::from_slice(body).map_err(|e| bad("params", e.to_string()))?;
    let idempotent = v.idempotent;
    let response_format = v.output_schema.filter(Value::is_object).map(|schema| {
        json!({"type": "json_schema", "json_schema": {"name": "result", "schema": schema}})
    });
    let request = Request {
        id: header(h, "x-request-id").map_or_else(new_id, String::from),
        agent: header(h, "x-oam-agent").unwrap_or(ANONYMOUS).to_string(),
        task: header(h, "x-oam-task").unwrap_or("").to_string(),
        team: None,
        model: Some(v.server),
        messages: vec![Message {
            role: "tool".into(),
            content: v.call.get().to_string(),
        }],
        risk: Default::default(),
        priority: Default::default(),
        idempotent,
        latency_budget_ms: None,
        max_cost_usd: None,
        max_tokens: None,
        n: 1,
        policy: Policy {
            allow_fallback: false,
            max_attempts: (!idempotent).then_some(1),
            min_confidence: None,
        },
        contract: None,
        response_format,
        tools: Default::default(),
        bound_to: Some(Api::Mcp),
        tool_allowlist: v.allowlist,
        embeddings: false,
        stream: false,
    };
    Ok((request, false, Passthrough::default()))
}

/// The decided tool call as its `tools/call` result (JSON bytes): the tool's own result when
/// accepted, else a result with `isError` saying why; oam's decision in `_meta`.
pub(crate) fn answer(d: &Decision, last: Option<Attempt>) -> (StatusCode, bytes::Bytes) {
    let oam = crate::node::api::openai::OamObject::of(d);
    let (body, error) = match last {
        Some(a) => (a.body, a.generation.error),
        None => (None, None),
    };
    let result = match body {
        Some(Reply::Json(Value::Object(mut r))) if d.outcome == DecisionOutcome::Accepted => {
            let meta = r.entry("_meta").or_insert_with(|| json!({}));
            if let Some(meta) = meta.as_object_mut() {
                meta.insert("oam".into(), json!(oam));
            }
            serde_json::to_vec(&r)
        }
        _ => {
            let reasons: Vec<&str> = d.reason_codes.iter().map(|c| c.as_str()).collect();
            let verb = match d.outcome {
                DecisionOutcome::Escalated => "escalated",
                _ => "refused",
            };
            let mut why = format!(
                "oam {verb} the tool call in phase {}: {}",
                d.phase,
                reasons.join(", ")
            );
            if let Some(e) = error.filter(|_| !d.attempts.is_empty()) {
                why = format!("{why}; the last attempt: {e}");
            }
            serde_json::to_vec(&ToolError::new(&why, Some(&oam)))
        }
    };
    (StatusCode::OK, result.unwrap_or_default().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(a: RpcAnswer) -> Value {
        serde_json::from_slice(&a.body.expect("a body")).expect("JSON")
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn modern_requests_must_say_their_method_and_tool_in_headers() {
        let body =
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"calc__add"}}"#;
        let h = headers(&[
            ("mcp-protocol-version", MODERN),
            ("mcp-method", "tools/call"),
            ("mcp-name", "calc__add"),
        ]);
        assert!(read(body, &h).is_ok_and(|c| c.is_some_and(|c| c.era == Era::Modern)));
        let h = headers(&[
            ("mcp-protocol-version", MODERN),
            ("mcp-method", "tools/call"),
            ("mcp-name", "calc__sub"),
        ]);
        let Err(e) = read(body, &h) else {
            panic!("a mismatch is refused")
        };
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(tree(e)["error"]["code"], HEADER_MISMATCH);
        let h = headers(&[("mcp-protocol-version", "2099-01-01")]);
        let Err(e) = read(body, &h) else {
            panic!("an unknown revision is refused")
        };
        assert_eq!(tree(e)["error"]["data"]["requested"], "2099-01-01");
    }

    #[test]
    fn notifications_and_junk_are_told_apart() {
        let h = HeaderMap::new();
        assert!(
            read(
                br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
                &h
            )
            .is_ok_and(|c| c.is_none())
        );
        let Err(e) = read(b"{not json", &h) else {
            panic!()
        };
        assert_eq!(tree(e)["error"]["code"], PARSE_ERROR);
        let Err(e) = read(b"[1]", &h) else { panic!() };
        assert_eq!(tree(e)["error"]["code"], INVALID_REQUEST);
        let Err(e) = read(br#"{"id":1,"method":"tools/call","params":[]}"#, &h) else {
            panic!()
        };
        assert_eq!(tree(e)["error"]["code"], INVALID_PARAMS);
    }

    #[test]
    fn a_legacy_client_is_given_the_revision_it_asked_for_if_served() {
        let call = |v: &str| RpcRequest {
            id: RawValue::from_string("1".into()).unwrap(),
            method: "initialize".into(),
            params: RpcParams {
                protocol_version: Some(v.into()),
                ..RpcParams::default()
            },
            era: Era::Legacy,
        };
        let r = tree(answer_plain(&call("2025-06-18")));
        assert_eq!(r["result"]["protocolVersion"], "2025-06-18");
        assert_eq!(r["result"]["capabilities"]["tools"]["listChanged"], false);
        let r = tree(answer_plain(&call("2024-01-01")));
        assert_eq!(r["result"]["protocolVersion"], LEGACY[0]);
        assert_eq!(r["id"], 1);
    }
}
