//! The simulator's Anthropic Messages API: a Messages request read into the chat request its
//! providers answer, and the answer, event stream and errors written as a Messages upstream
//! writes them. Written apart from the node's translation, so each is checked against the other.

use super::text_of;
use axum::http::StatusCode;
use serde_json::{Value, json};

/// A Messages request as a chat request (what the providers read: the turns' text, the tools,
/// `stream`), or why it is refused. A user turn of tool results reads as a `tool` turn.
pub(crate) fn to_chat(body: &[u8]) -> Result<Value, super::NotServed> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let Some(model) = v["model"].as_str() else {
        return Err(super::NotServed("model: Field required".into()));
    };
    if v["max_tokens"].as_u64().is_none_or(|n| n < 1) {
        return Err(super::NotServed(
            "max_tokens: Field required (a whole number of at least 1)".into(),
        ));
    }
    let Some(turns) = v["messages"].as_array().filter(|t| !t.is_empty()) else {
        return Err(super::NotServed(
            "messages: at least one message is required".into(),
        ));
    };
    let mut messages = Vec::new();
    if !v["system"].is_null() {
        messages.push(json!({"role": "system", "content": text_of(&v["system"])}));
    }
    for (i, t) in turns.iter().enumerate() {
        let Some(role @ ("user" | "assistant")) = t["role"].as_str() else {
            return Err(super::NotServed(format!(
                "messages.{i}.role: must be user or assistant"
            )));
        };
        let blocks = t["content"].as_array();
        let results = blocks.is_some_and(|b| b.iter().any(|b| b["type"] == "tool_result"));
        let content = match blocks {
            Some(b) if results => b
                .iter()
                .map(|b| text_of(&b["content"]))
                .collect::<Vec<_>>()
                .join(" "),
            _ => text_of(&t["content"]),
        };
        let role = if results { "tool" } else { role };
        messages.push(json!({"role": role, "content": content}));
    }
    let tools: Vec<Value> = v["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| json!({"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}))
        .collect();
    Ok(json!({"model": model, "messages": messages, "tools": tools,
        "stream": v["stream"] == true, "stream_options": {"include_usage": true},
        "sim_thinking": v["thinking"]["type"] == "enabled"}))
}

fn stop_reason(finish: &str) -> &'static str {
    match finish {
        "length" => "max_tokens",
        "tool_calls" => "tool_use",
        _ => "end_turn",
    }
}

/// Chat usage (with `cache_creation_input_tokens` where the prompt wrote the cache) as
/// Messages counts it: cache reads and writes apart from `input_tokens`.
pub(crate) fn usage(chat: &Value) -> Value {
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    let read = n(&chat["prompt_tokens_details"]["cached_tokens"]);
    let written = n(&chat["cache_creation_input_tokens"]);
    let mut u = json!({"input_tokens": n(&chat["prompt_tokens"]).saturating_sub(read + written),
        "output_tokens": n(&chat["completion_tokens"])});
    if read > 0 {
        u["cache_read_input_tokens"] = json!(read);
    }
    if written > 0 {
        u["cache_creation_input_tokens"] = json!(written);
    }
    u
}

/// The content blocks of a chat answer's message: its text, or its tool call (arguments that
/// are no JSON object, under a contract fault, read as an empty input).
fn blocks(message: &Value) -> Vec<Value> {
    match message["tool_calls"].get(0) {
        Some(c) => {
            let f = &c["function"];
            let input = f["arguments"]
                .as_str()
                .and_then(|a| serde_json::from_str::<Value>(a).ok())
                .filter(Value::is_object)
                .unwrap_or_else(|| json!({}));
            vec![json!({"type": "tool_use", "id": c["id"], "name": f["name"], "input": input})]
        }
        None => vec![json!({"type": "text", "text": message["content"]})],
    }
}

/// A whole answer (`id`, the chat `message`, its finish reason and chat usage) as a message;
/// with extended thinking asked for, a signed thinking block first.
pub(crate) fn message(
    id: &str,
    model: &str,
    message: &Value,
    finish: &str,
    chat_usage: &Value,
    thinking: bool,
) -> Value {
    let mut content = blocks(message);
    if thinking {
        content.insert(
            0,
            json!({"type": "thinking", "thinking": "The simulator considers the question.",
                "signature": format!("sim-signature-{id}")}),
        );
    }
    json!({"id": format!("msg_{id}"), "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": stop_reason(finish), "stop_sequence": null,
        "usage": usage(chat_usage)})
}

fn event(name: &str, data: Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// The same answer as Messages events: `message_start` (with `ping`), the block's start, its
/// text or arguments in `pieces`, its stop, `message_delta` (stop reason, usage),
/// `message_stop`.
pub(crate) fn events(
    id: &str,
    model: &str,
    message: &Value,
    finish: &str,
    chat_usage: &Value,
    pieces: &[String],
) -> Vec<String> {
    let block = blocks(message).remove(0);
    let tool = block["type"] == "tool_use";
    let mut start = block.clone();
    if tool {
        start["input"] = json!({});
    } else {
        start["text"] = json!("");
    }
    let mut usage = usage(chat_usage);
    let mut first = usage.clone();
    first["output_tokens"] = json!(1);
    let mut out = vec![
        event(
            "message_start",
            json!({"type": "message_start", "message": {"id": format!("msg_{id}"),
                "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": null, "stop_sequence": null, "usage": first}}),
        ) + &event("ping", json!({"type": "ping"})),
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": start}),
        ),
    ];
    for p in pieces {
        let delta = if tool {
            json!({"type": "input_json_delta", "partial_json": p})
        } else {
            json!({"type": "text_delta", "text": p})
        };
        out.push(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": delta}),
        ));
    }
    out.push(event(
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
    ));
    // message_delta's usage is cumulative; output tokens are only known at the end.
    if let Some(u) = usage.as_object_mut() {
        u.remove("input_tokens");
    }
    out.push(event(
        "message_delta",
        json!({"type": "message_delta",
            "delta": {"stop_reason": stop_reason(finish), "stop_sequence": null}, "usage": usage}),
    ));
    out.push(event("message_stop", json!({"type": "message_stop"})));
    out
}

/// An error in Anthropic's envelope, typed by its status.
pub(crate) fn error(status: StatusCode, message: &str) -> Value {
    let kind = match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}
