//! The simulator's tool server: `POST /mcp`, a Model Context Protocol server (streamable HTTP,
//! JSON answers, no session) with two tools of an order desk: `lookup` (reads an order;
//! read-only, idempotent, structured output) and `refund` (changes one; neither). It speaks
//! 2026-07-28 (`server/discover`, results with `resultType`) and 2025-11-25 (`initialize`),
//! enough for oam's `[[mcp_server]]` and the official SDK's client. Deterministic: an order's
//! status is a function of its id.

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

const MODERN: &str = "2026-07-28";
const LEGACY: &str = "2025-11-25";

fn tools() -> Value {
    json!([
        {
            "name": "lookup",
            "description": "The status of an order",
            "inputSchema": {
                "type": "object",
                "properties": {"order": {"type": "string"}},
                "required": ["order"],
            },
            "outputSchema": {
                "type": "object",
                "properties": {"order": {"type": "string"}, "status": {"type": "string"}},
                "required": ["order", "status"],
            },
            "annotations": {"readOnlyHint": true, "idempotentHint": true},
        },
        {
            "name": "refund",
            "description": "Refund an order",
            "inputSchema": {
                "type": "object",
                "properties": {"order": {"type": "string"}},
                "required": ["order"],
            },
            "annotations": {"destructiveHint": true, "idempotentHint": false},
        },
    ])
}

/// What a tool answers for `args`: its result, or why it cannot (`isError`).
fn call(name: &str, args: &Value) -> Value {
    let Some(order) = args["order"].as_str() else {
        return json!({"content": [{"type": "text", "text": "arguments need an order"}], "isError": true});
    };
    let statuses = ["open", "shipped", "delivered"];
    let status = statuses[order.bytes().map(usize::from).sum::<usize>() % statuses.len()];
    match name {
        "lookup" => {
            let s = json!({"order": order, "status": status});
            json!({"content": [{"type": "text", "text": s.to_string()}], "structuredContent": s})
        }
        "refund" => {
            json!({"content": [{"type": "text", "text": format!("refunded {order}")}]})
        }
        other => {
            json!({"content": [{"type": "text", "text": format!("no tool {other:?}")}], "isError": true})
        }
    }
}

/// `POST /mcp`.
pub(crate) async fn mcp(headers: HeaderMap, body: Bytes) -> Response {
    let modern = headers
        .get("mcp-protocol-version")
        .and_then(|v| v.to_str().ok())
        == Some(MODERN);
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        let e =
            json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": "not JSON"}});
        return (StatusCode::BAD_REQUEST, axum::Json(e)).into_response();
    };
    let (Some(method), Some(id)) = (v["method"].as_str(), v.get("id")) else {
        return StatusCode::ACCEPTED.into_response();
    };
    let info = json!({"name": "oam-sim-tools", "version": env!("CARGO_PKG_VERSION")});
    let mut result = match method {
        "initialize" => json!({
            "protocolVersion": LEGACY,
            "capabilities": {"tools": {"listChanged": false}},
            "serverInfo": info,
        }),
        "server/discover" => json!({
            "supportedVersions": [MODERN],
            "capabilities": {"tools": {"listChanged": false}},
            "ttlMs": 0,
            "cacheScope": "public",
            "_meta": {"io.modelcontextprotocol/serverInfo": info},
        }),
        "ping" => json!({}),
        "tools/list" => {
            let mut r = json!({"tools": tools()});
            if modern {
                r["ttlMs"] = 0.into();
                r["cacheScope"] = "public".into();
            }
            r
        }
        "tools/call" => call(
            v["params"]["name"].as_str().unwrap_or(""),
            &v["params"]["arguments"],
        ),
        other => {
            let e = json!({"code": -32601, "message": format!("method {other:?} not found")});
            let status = if modern {
                StatusCode::NOT_FOUND
            } else {
                StatusCode::OK
            };
            let body = json!({"jsonrpc": "2.0", "id": id, "error": e});
            return (status, axum::Json(body)).into_response();
        }
    };
    if modern {
        result["resultType"] = "complete".into();
    }
    axum::Json(json!({"jsonrpc": "2.0", "id": id, "result": result})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_answers_in_its_schema_and_the_same_order_the_same_way() {
        let a = call("lookup", &json!({"order": "o-1"}));
        assert_eq!(a, call("lookup", &json!({"order": "o-1"})));
        assert_eq!(a["structuredContent"]["order"], "o-1");
        assert!(call("lookup", &json!({})).get("isError").is_some());
        assert_eq!(call("nope", &json!({"order": "o"}))["isError"], true);
    }
}
