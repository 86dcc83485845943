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

use crate::core::decision::{Decision, DecisionOutcome};
use crate::core::reason::ReasonCode;
use crate::core::request::{ANONYMOUS, Api, Message, Policy, Request};
use crate::node::api::{BadRequest, bad, header};
use crate::node::catalog::Tool;
use crate::node::exchange::{Attempt, Passthrough, Reply};
use axum::http::{HeaderMap, StatusCode};
use serde_json::{Value, json};

/// The revisions served, newest first.
pub(crate) const MODERN: &str = "2026-07-28";
const LEGACY: [&str; 3] = ["2025-11-25", "2025-06-18", "2025-03-26"];

const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;
const HEADER_MISMATCH: i64 = -32020;
const UNSUPPORTED_VERSION: i64 = -32022;

/// A JSON-RPC exchange's answer: its HTTP status and body (none: 202 for a notification).
pub(crate) struct RpcAnswer {
    pub status: StatusCode,
    pub body: Option<Value>,
}

/// How the request is spoken.
#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) enum Era {
    Modern,
    Legacy,
}

/// One JSON-RPC request read from the body, or the error answer that refuses it.
pub(crate) struct RpcRequest {
    pub id: Value,
    pub method: String,
    pub params: Value,
    pub era: Era,
}

fn error(era: Era, id: &Value, code: i64, message: &str, data: Option<Value>) -> RpcAnswer {
    let status = match (era, code) {
        (Era::Modern, METHOD_NOT_FOUND) => StatusCode::NOT_FOUND,
        (
            Era::Modern,
            PARSE_ERROR | INVALID_REQUEST | INVALID_PARAMS | HEADER_MISMATCH | UNSUPPORTED_VERSION,
        ) => StatusCode::BAD_REQUEST,
        (_, PARSE_ERROR) => StatusCode::BAD_REQUEST,
        _ => StatusCode::OK,
    };
    let mut e = json!({"code": code, "message": message});
    if let Some(d) = data {
        e["data"] = d;
    }
    RpcAnswer {
        status,
        body: Some(json!({"jsonrpc": "2.0", "id": id, "error": e})),
    }
}

/// A result, with `resultType` in 2026-07-28.
pub(crate) fn result(call: &RpcRequest, mut r: Value) -> RpcAnswer {
    if call.era == Era::Modern {
        r["resultType"] = "complete".into();
    }
    RpcAnswer {
        status: StatusCode::OK,
        body: Some(json!({"jsonrpc": "2.0", "id": call.id, "result": r})),
    }
}

/// Read the body's JSON-RPC message: a request to answer (`Ok(Some)`), a notification or a
/// response (`Ok(None)`: 202), or the error answer.
pub(crate) fn read(body: &[u8], h: &HeaderMap) -> Result<Option<RpcRequest>, RpcAnswer> {
    let version = header(h, "mcp-protocol-version");
    let era = match version {
        Some(MODERN) => Era::Modern,
        None => Era::Legacy,
        Some(v) if LEGACY.contains(&v) => Era::Legacy,
        Some(v) => {
            let supported: Vec<&str> = std::iter::once(MODERN).chain(LEGACY).collect();
            let data = json!({"supported": supported, "requested": v});
            let message = format!(
                "protocol revision {v} is not served; this gateway speaks {}",
                supported.join(", ")
            );
            return Err(error(
                Era::Modern,
                &Value::Null,
                UNSUPPORTED_VERSION,
                &message,
                Some(data),
            ));
        }
    };
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        error(
            era,
            &Value::Null,
            PARSE_ERROR,
            &format!("the body is not JSON: {e}"),
            None,
        )
    })?;
    let Some(m) = v.as_object() else {
        let why = "the body must be one JSON-RPC message (an object; batches are not served)";
        return Err(error(era, &Value::Null, INVALID_REQUEST, why, None));
    };
    let Some(method) = m.get("method").and_then(Value::as_str) else {
        // A response to nothing this door asked: acknowledged and dropped.
        return Ok(None);
    };
    let Some(id) = m.get("id").filter(|id| id.is_string() || id.is_number()) else {
        return Ok(None);
    };
    let params = m.get("params").cloned().unwrap_or_else(|| json!({}));
    if !params.is_object() {
        return Err(error(
            era,
            id,
            INVALID_PARAMS,
            "params must be an object",
            None,
        ));
    }
    if era == Era::Modern {
        if header(h, "mcp-method") != Some(method) {
            let why = "the Mcp-Method header does not match the request's method";
            return Err(error(era, id, HEADER_MISMATCH, why, None));
        }
        if method == "tools/call" && header(h, "mcp-name") != params["name"].as_str() {
            let why = "the Mcp-Name header does not match the tool the request calls";
            return Err(error(era, id, HEADER_MISMATCH, why, None));
        }
    }
    Ok(Some(RpcRequest {
        id: id.clone(),
        method: method.to_string(),
        params,
        era,
    }))
}

/// What this door says of itself (`initialize`, `server/discover`).
fn server_info() -> Value {
    json!({"name": "oam", "version": env!("CARGO_PKG_VERSION")})
}

/// Answers to everything but `tools/list` and `tools/call`.
pub(crate) fn answer_plain(call: &RpcRequest) -> RpcAnswer {
    let capabilities = json!({"tools": {"listChanged": false}});
    match (call.method.as_str(), call.era) {
        ("initialize", Era::Legacy) => {
            let asked = call.params["protocolVersion"].as_str().unwrap_or("");
            let agreed = LEGACY.iter().find(|v| **v == asked).unwrap_or(&LEGACY[0]);
            result(
                call,
                json!({
                    "protocolVersion": agreed,
                    "capabilities": capabilities,
                    "serverInfo": server_info(),
                    "instructions": "Tools of this team's tool servers, each call judged by oam.",
                }),
            )
        }
        ("server/discover", _) => result(
            call,
            json!({
                "supportedVersions": [MODERN],
                "capabilities": capabilities,
                "ttlMs": 0,
                "cacheScope": "private",
                "_meta": {"io.modelcontextprotocol/serverInfo": server_info()},
            }),
        ),
        ("ping", _) => result(call, json!({})),
        (m, era) => error(
            era,
            &call.id,
            METHOD_NOT_FOUND,
            &format!("method {m:?} is not served here (tools/list, tools/call, ping)"),
            None,
        ),
    }
}

/// The `tools/list` result: every tool served (those `allowed`), under its public name.
pub(crate) fn list_result(
    call: &RpcRequest,
    tools: &[Tool],
    allowed: impl Fn(&str) -> bool,
) -> RpcAnswer {
    let listed: Vec<Value> = tools
        .iter()
        .filter(|t| !t.changed && allowed(&t.public_name()))
        .map(|t| {
            let mut d = t.definition.clone();
            d["name"] = t.public_name().into();
            // What `[[mcp_server]] pins` takes to pin this definition.
            if !d["_meta"].is_object() {
                d["_meta"] = json!({});
            }
            d["_meta"]["oam"] = json!({"definition_hash": format!("{:016x}", t.hash)});
            d
        })
        .collect();
    let mut r = json!({"tools": listed});
    if call.era == Era::Modern {
        r["ttlMs"] = 0.into();
        r["cacheScope"] = "private".into();
    }
    result(call, r)
}

/// A tool call refused before the pipeline (unknown tool: a JSON-RPC error; arguments that do
/// not fit, a changed definition: a result with `isError`, which the model reads).
pub(crate) fn refuse_call(call: &RpcRequest, tool: Option<&Tool>) -> Option<RpcAnswer> {
    let name = call.params["name"].as_str().unwrap_or("");
    let Some(tool) = tool else {
        let why = format!("no tool {name:?} is served here (see tools/list)");
        return Some(error(call.era, &call.id, INVALID_PARAMS, &why, None));
    };
    if tool.changed {
        let why = format!(
            "{}: {name}'s definition changed since this gateway first saw it; it is not called \
             until the gateway pins the new one",
            ReasonCode::ToolDefinitionChanged.as_str()
        );
        return Some(tool_error(
            call,
            &why,
            refused(ReasonCode::ToolDefinitionChanged),
        ));
    }
    let args = call
        .params
        .get("arguments")
        .cloned()
        .unwrap_or_else(|| json!({}));
    if let Some(schema) = tool.input_schema()
        && let Err(why) = crate::core::contract::fits_schema(&args, schema)
    {
        let why = format!(
            "{}: the arguments do not fit {name}'s input schema: {why}",
            ReasonCode::ToolArgumentsInvalid.as_str()
        );
        return Some(tool_error(
            call,
            &why,
            refused(ReasonCode::ToolArgumentsInvalid),
        ));
    }
    None
}

/// The `oam` object of a call refused before the pipeline, for `code`.
fn refused(code: ReasonCode) -> Value {
    json!({"outcome": "rejected", "phase": code.phase(), "reason_codes": [code], "attempts": 0})
}

/// A result with `isError` saying `why`, with oam's decision (if any) in `_meta`.
fn tool_error(call: &RpcRequest, why: &str, oam: Value) -> RpcAnswer {
    let mut r = json!({"content": [{"type": "text", "text": why}], "isError": true});
    if !oam.is_null() {
        r["_meta"] = json!({"oam": oam});
    }
    result(call, r)
}

/// The body `execute` decodes for a tool call (`decode`): the server, the call, and what the
/// tool's definition says of it.
pub(crate) fn call_body(call: &RpcRequest, tool: &Tool, allowlist: Option<&str>) -> Vec<u8> {
    let body = json!({
        "allowlist": allowlist,
        "server": tool.server,
        "call": {
            "name": tool.name,
            "arguments": call.params.get("arguments").cloned().unwrap_or_else(|| json!({})),
        },
        "idempotent": tool.idempotent(),
        "output_schema": tool.output_schema(),
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// The core request of a tool call (`call_body`'s): bound to the tool server, its one message
/// the call, held to the tool's output schema, tried once unless it may run twice.
pub(crate) fn decode(
    body: &[u8],
    h: &HeaderMap,
    new_id: &dyn Fn() -> String,
) -> Result<(Request, bool, Passthrough), BadRequest> {
    let v: Value = serde_json::from_slice(body).map_err(|e| bad("params", e.to_string()))?;
    let server = v["server"].as_str().unwrap_or_default().to_string();
    let idempotent = v["idempotent"] == true;
    let response_format = v["output_schema"].is_object().then(|| {
        json!({"type": "json_schema", "json_schema": {"name": "result", "schema": v["output_schema"]}})
    });
    let request = Request {
        id: header(h, "x-request-id").map_or_else(new_id, String::from),
        agent: header(h, "x-oam-agent").unwrap_or(ANONYMOUS).to_string(),
        task: header(h, "x-oam-task").unwrap_or("").to_string(),
        team: None,
        model: Some(server),
        messages: vec![Message {
            role: "tool".into(),
            content: v["call"].to_string(),
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
        tool_allowlist: v["allowlist"].as_str().map(String::from),
        embeddings: false,
        stream: false,
    };
    Ok((request, false, Passthrough::default()))
}

/// The decided tool call as its `tools/call` result (JSON bytes): the tool's own result when
/// accepted, else a result with `isError` saying why; oam's decision in `_meta`.
pub(crate) fn answer(d: &Decision, last: Option<Attempt>) -> (StatusCode, bytes::Bytes) {
    let oam = serde_json::to_value(crate::node::api::openai::OamObject::of(d)).unwrap_or_default();
    let (body, error) = match last {
        Some(a) => (a.body, a.generation.error),
        None => (None, None),
    };
    let result = match body {
        Some(Reply::Json(Value::Object(mut r))) if d.outcome == DecisionOutcome::Accepted => {
            let meta = r.entry("_meta").or_insert_with(|| json!({}));
            if meta.is_object() {
                meta["oam"] = oam;
            }
            Value::Object(r)
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
            json!({"content": [{"type": "text", "text": why}], "isError": true, "_meta": {"oam": oam}})
        }
    };
    (
        StatusCode::OK,
        serde_json::to_vec(&result).unwrap_or_default().into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(e.body.unwrap()["error"]["code"], HEADER_MISMATCH);
        let h = headers(&[("mcp-protocol-version", "2099-01-01")]);
        let Err(e) = read(body, &h) else {
            panic!("an unknown revision is refused")
        };
        assert_eq!(e.body.unwrap()["error"]["data"]["requested"], "2099-01-01");
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
        assert_eq!(e.body.unwrap()["error"]["code"], PARSE_ERROR);
        let Err(e) = read(b"[1]", &h) else { panic!() };
        assert_eq!(e.body.unwrap()["error"]["code"], INVALID_REQUEST);
    }

    #[test]
    fn a_legacy_client_is_given_the_revision_it_asked_for_if_served() {
        let call = |v: &str| RpcRequest {
            id: 1.into(),
            method: "initialize".into(),
            params: json!({"protocolVersion": v}),
            era: Era::Legacy,
        };
        let r = answer_plain(&call("2025-06-18")).body.unwrap();
        assert_eq!(r["result"]["protocolVersion"], "2025-06-18");
        let r = answer_plain(&call("2024-01-01")).body.unwrap();
        assert_eq!(r["result"]["protocolVersion"], LEGACY[0]);
    }
}
