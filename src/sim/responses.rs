//! The simulator's OpenAI Responses API: a Responses request read into the chat request its
//! providers answer, and the answer and typed event stream written as a Responses upstream
//! writes them. Written apart from the node's translation, so each is checked against the
//! other. State the simulator does not keep (`previous_response_id`) and hosted tools are
//! refused by name.

use super::text_of;
use serde_json::{Value, json};

/// A Responses request as a chat request (the turns' text, function tools, `stream`,
/// reasoning effort), or why it is refused. A function call reads as an assistant turn, its
/// output as a `tool` turn.
pub(crate) fn to_chat(body: &[u8]) -> Result<Value, super::NotServed> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let Some(model) = v["model"].as_str() else {
        return Err(super::NotServed("model: is required".into()));
    };
    if !v["previous_response_id"].is_null() {
        return Err(super::NotServed(
            "previous_response_id: the simulator keeps no responses".into(),
        ));
    }
    let mut messages = Vec::new();
    if let Some(i) = v["instructions"].as_str() {
        messages.push(json!({"role": "system", "content": i}));
    }
    match &v["input"] {
        Value::String(s) => messages.push(json!({"role": "user", "content": s})),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let turn = match item["type"].as_str().unwrap_or("message") {
                    "message" => match item["role"].as_str() {
                        Some(r @ ("user" | "assistant" | "system" | "developer")) => {
                            let role = if r == "developer" { "system" } else { r };
                            json!({"role": role, "content": text_of(&item["content"])})
                        }
                        _ => {
                            return Err(super::NotServed(format!(
                                "input.{i}.role: must be user, assistant, system or developer"
                            )));
                        }
                    },
                    "function_call" => json!({"role": "assistant", "content": ""}),
                    "function_call_output" => json!({"role": "tool", "content": item["output"]}),
                    other => {
                        return Err(super::NotServed(format!(
                            "input.{i}.type: {other:?} is not served"
                        )));
                    }
                };
                messages.push(turn);
            }
        }
        _ => {
            return Err(super::NotServed(
                "input: a string or a list of items is required".into(),
            ));
        }
    }
    if messages.iter().all(|m| m["role"] == "system") {
        return Err(super::NotServed(
            "input: at least one item is required".into(),
        ));
    }
    let mut tools = Vec::new();
    for (i, t) in v["tools"].as_array().into_iter().flatten().enumerate() {
        if t["type"] != "function" {
            return Err(super::NotServed(format!(
                "tools.{i}.type: {} is a hosted tool; the simulator serves function tools",
                t["type"]
            )));
        }
        tools.push(json!({"type": "function",
            "function": {"name": t["name"], "parameters": t["parameters"]}}));
    }
    Ok(json!({"model": model, "messages": messages, "tools": tools,
        "stream": v["stream"] == true, "stream_options": {"include_usage": true},
        "reasoning_effort": v["reasoning"]["effort"]}))
}

/// Chat usage as Responses counts it.
fn usage(chat: &Value) -> Value {
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    let (input, output) = (n(&chat["prompt_tokens"]), n(&chat["completion_tokens"]));
    json!({"input_tokens": input,
        "input_tokens_details": {"cached_tokens": n(&chat["prompt_tokens_details"]["cached_tokens"])},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": n(&chat["completion_tokens_details"]["reasoning_tokens"])},
        "total_tokens": input + output})
}

/// The output item of a chat answer's message, as it stands when done: its text as a
/// message, or its tool call as a function call.
fn item(id: &str, message: &Value) -> Value {
    match message["tool_calls"].get(0) {
        Some(c) => json!({"type": "function_call", "id": format!("fc_{id}"),
            "call_id": c["id"], "name": c["function"]["name"],
            "arguments": c["function"]["arguments"], "status": "completed"}),
        None => json!({"type": "message", "id": format!("msg_{id}"), "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": message["content"], "annotations": []}]}),
    }
}

/// A response object: `output` and `usage` as given, complete unless the answer was cut at
/// its length.
fn object(id: &str, model: &str, created: u64, finish: &str, output: Value, usage: Value) -> Value {
    let cut = finish == "length";
    json!({"id": format!("resp_{id}"), "object": "response", "created_at": created,
        "status": if cut { "incomplete" } else { "completed" },
        "incomplete_details": cut.then(|| json!({"reason": "max_output_tokens"})),
        "error": null, "model": model, "output": output, "parallel_tool_calls": true,
        "tool_choice": "auto", "tools": [], "usage": usage})
}

/// A whole answer (`id`, the chat `message`, its finish reason and chat usage) as a response.
pub(crate) fn response(
    id: &str,
    model: &str,
    created: u64,
    message: &Value,
    finish: &str,
    chat_usage: &Value,
) -> Value {
    let output = json!([item(id, message)]);
    object(id, model, created, finish, output, usage(chat_usage))
}

/// The same answer as typed events, numbered in order: `response.created`, the item added,
/// its text (or arguments) in `pieces`, the item done, `response.completed` (or
/// `response.incomplete`).
pub(crate) fn events(
    id: &str,
    model: &str,
    created: u64,
    message: &Value,
    finish: &str,
    chat_usage: &Value,
    pieces: &[String],
) -> Vec<String> {
    let done = item(id, message);
    let tool = done["type"] == "function_call";
    let item_id = done["id"].clone();
    let mut out = Vec::new();
    let mut push = |name: &str, mut data: Value| {
        data["type"] = json!(name);
        data["sequence_number"] = json!(out.len());
        out.push(format!("event: {name}\ndata: {data}\n\n"));
    };
    let mut started = object(id, model, created, "stop", json!([]), Value::Null);
    started["status"] = json!("in_progress");
    push("response.created", json!({"response": started}));
    let mut added = done.clone();
    added["status"] = json!("in_progress");
    if tool {
        added["arguments"] = json!("");
    } else {
        added["content"] = json!([]);
    }
    push(
        "response.output_item.added",
        json!({"output_index": 0, "item": added}),
    );
    let part = json!({"type": "output_text", "text": "", "annotations": []});
    if !tool {
        push(
            "response.content_part.added",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part}),
        );
    }
    for p in pieces {
        let (name, mut data) = if tool {
            ("response.function_call_arguments.delta", json!({}))
        } else {
            ("response.output_text.delta", json!({"content_index": 0}))
        };
        data["item_id"] = item_id.clone();
        data["output_index"] = json!(0);
        data["delta"] = json!(p);
        push(name, data);
    }
    if tool {
        push(
            "response.function_call_arguments.done",
            json!({"item_id": item_id, "output_index": 0, "arguments": done["arguments"]}),
        );
    } else {
        let text = &done["content"][0]["text"];
        push(
            "response.output_text.done",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text}),
        );
        push(
            "response.content_part.done",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                "part": done["content"][0]}),
        );
    }
    push(
        "response.output_item.done",
        json!({"output_index": 0, "item": done}),
    );
    let whole = object(id, model, created, finish, json!([done]), usage(chat_usage));
    let name = if finish == "length" {
        "response.incomplete"
    } else {
        "response.completed"
    };
    push(name, json!({"response": whole}));
    out
}
