//! The Agent2Agent door (A2A v1.0, JSON-RPC binding): mesh agents that are tools (those the
//! `mesh = true` tool server serves) as A2A agents. Each has a card at
//! `/a2a/{agent}/.well-known/agent-card.json` whose interface is `POST /a2a/{agent}`; the node's
//! own card (`/.well-known/agent-card.json`) lists them as skills. `SendMessage` becomes one tool
//! call of the agent through the pipeline (the same gate, budget, breaker and record as
//! `/mcp`): its payload is the message's first data part that is an object, else
//! `{"text": ...}` of its text parts; the agent's answer is a completed task with the answer
//! as an artifact, and a refusal or a failure (an agent that died holding the call among them)
//! a failed task that says why. Pure: the HTTP handlers live in `node::http`.

use serde_json::{Value, json};

/// The protocol version served.
pub(crate) const VERSION: &str = "1.0";

const INVALID_PARAMS: i64 = -32602;
const METHOD_NOT_FOUND: i64 = -32601;
const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const VERSION_NOT_SUPPORTED: i64 = -32009;

/// One agent offered over A2A: its name and what the catalog says it does.
pub(crate) struct Offered<'a> {
    pub agent: &'a str,
    pub description: &'a str,
}

fn skill(a: &Offered<'_>) -> Value {
    json!({"id": a.agent, "name": a.agent, "description": a.description, "tags": ["mesh"]})
}

/// A card named `name` whose interface is `url` and whose skills are `skills`.
fn card(base: &str, name: &str, description: &str, url: String, skills: Vec<Value>) -> Value {
    json!({
        "name": name,
        "description": description,
        "version": env!("CARGO_PKG_VERSION"),
        "supportedInterfaces": [{
            "url": url,
            "protocolBinding": "JSONRPC",
            "protocolVersion": VERSION,
        }],
        "provider": {"organization": "oam", "url": base},
        "capabilities": {"streaming": false, "pushNotifications": false},
        "defaultInputModes": ["application/json", "text/plain"],
        "defaultOutputModes": ["application/json", "text/plain"],
        "skills": skills,
    })
}

/// The card of `agent`, served by the node at `base` (`http://host:port`).
pub(crate) fn agent_card(base: &str, a: &Offered<'_>) -> Value {
    let url = format!("{base}/a2a/{}", a.agent);
    card(base, a.agent, a.description, url, vec![skill(a)])
}

/// The node's own card: every offered agent as a skill, each reached at its own card's
/// interface (`/a2a/{agent}`); the node's interface answers with where they are.
pub(crate) fn node_card(base: &str, offered: &[Offered<'_>]) -> Value {
    let description = "The agents of this oam mesh, each at /a2a/{agent} (its card at \
                       /a2a/{agent}/.well-known/agent-card.json), every call judged by oam.";
    let skills = offered.iter().map(skill).collect();
    card(base, "oam mesh", description, format!("{base}/a2a"), skills)
}

/// A JSON-RPC error answer to request `id`.
pub(crate) fn error(id: &Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

/// What a `SendMessage` asks: the request's id, the payload for the agent, and the message's
/// context (kept on the task).
pub(crate) struct Send {
    pub id: Value,
    pub payload: Value,
    pub context_id: Option<String>,
}

/// Read a JSON-RPC request to `/a2a/{agent}`: a `SendMessage`, or the error answer.
pub(crate) fn read(body: &[u8], version: Option<&str>) -> Result<Send, Value> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        error(
            &Value::Null,
            PARSE_ERROR,
            &format!("the body is not JSON: {e}"),
        )
    })?;
    let id = v.get("id").cloned().unwrap_or(Value::Null);
    if let Some(asked) = version.filter(|v| *v != VERSION) {
        let why = format!("A2A version {asked} is not served; this agent speaks {VERSION}");
        return Err(error(&id, VERSION_NOT_SUPPORTED, &why));
    }
    let Some(method) = v.get("method").and_then(Value::as_str) else {
        return Err(error(
            &id,
            INVALID_REQUEST,
            "a JSON-RPC request needs a method",
        ));
    };
    if method != "SendMessage" {
        let why = format!("method {method:?} is not served here (SendMessage)");
        return Err(error(&id, METHOD_NOT_FOUND, &why));
    }
    let message = &v["params"]["message"];
    let Some(parts) = message["parts"].as_array().filter(|p| !p.is_empty()) else {
        return Err(error(
            &id,
            INVALID_PARAMS,
            "params.message.parts must be a non-empty list",
        ));
    };
    let data = parts
        .iter()
        .find_map(|p| p.get("data").filter(|d| d.is_object()));
    let payload = match data {
        Some(d) => d.clone(),
        None => {
            let text: Vec<&str> = parts.iter().filter_map(|p| p["text"].as_str()).collect();
            if text.is_empty() {
                let why = "the message holds neither a data part with an object nor text";
                return Err(error(&id, INVALID_PARAMS, why));
            }
            json!({"text": text.join("\n")})
        }
    };
    Ok(Send {
        id,
        payload,
        context_id: message["contextId"].as_str().map(String::from),
    })
}

/// The `SendMessage` result of a decided call: `result` is its `tools/call` result (the
/// agent's answer, or `isError` with why), `task_id` the request's id.
pub(crate) fn answer(send: &Send, task_id: &str, result: &Value) -> Value {
    let context = send
        .context_id
        .clone()
        .unwrap_or_else(|| task_id.to_string());
    let text = crate::node::exchange::text_of_content(result);
    let oam = result["_meta"]["oam"].clone();
    let task = if result["isError"] == true {
        json!({
            "id": task_id,
            "contextId": context,
            "status": {
                "state": "TASK_STATE_FAILED",
                "message": {
                    "messageId": format!("{task_id}-status"),
                    "role": "ROLE_AGENT",
                    "parts": [{"text": text}],
                },
            },
            "metadata": {"oam": oam},
        })
    } else {
        let part = match result.get("structuredContent").filter(|s| s.is_object()) {
            Some(s) => json!({"data": s}),
            None => json!({"text": text}),
        };
        json!({
            "id": task_id,
            "contextId": context,
            "status": {"state": "TASK_STATE_COMPLETED"},
            "artifacts": [{"artifactId": format!("{task_id}-answer"), "name": "answer", "parts": [part]}],
            "metadata": {"oam": oam},
        })
    };
    json!({"jsonrpc": "2.0", "id": send.id, "result": {"task": task}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_s_data_part_is_the_payload_else_its_text() {
        let body = |parts: Value| {
            json!({"jsonrpc": "2.0", "id": "1", "method": "SendMessage",
                   "params": {"message": {"messageId": "m", "role": "ROLE_USER", "parts": parts}}})
            .to_string()
        };
        let s = read(
            body(json!([{"text": "hi"}, {"data": {"n": 3.0}}])).as_bytes(),
            Some("1.0"),
        );
        assert_eq!(s.ok().unwrap().payload, json!({"n": 3.0}));
        let s = read(body(json!([{"text": "a"}, {"text": "b"}])).as_bytes(), None);
        assert_eq!(s.ok().unwrap().payload, json!({"text": "a\nb"}));
        let Err(e) = read(body(json!([])).as_bytes(), None) else {
            panic!()
        };
        assert_eq!(e["error"]["code"], INVALID_PARAMS);
        let Err(e) = read(body(json!([{"text": "a"}])).as_bytes(), Some("0.3")) else {
            panic!()
        };
        assert_eq!(e["error"]["code"], VERSION_NOT_SUPPORTED);
        let old = json!({"jsonrpc": "2.0", "id": 1, "method": "message/send"}).to_string();
        let Err(e) = read(old.as_bytes(), None) else {
            panic!()
        };
        assert_eq!(e["error"]["code"], METHOD_NOT_FOUND);
    }

    #[test]
    fn an_answer_is_a_completed_task_and_an_error_a_failed_one() {
        let send = Send {
            id: json!("7"),
            payload: json!({}),
            context_id: None,
        };
        let ok = answer(
            &send,
            "r1",
            &json!({"content": [{"type": "text", "text": "{}"}], "structuredContent": {"a": 1}}),
        );
        assert_eq!(
            ok["result"]["task"]["status"]["state"],
            "TASK_STATE_COMPLETED"
        );
        assert_eq!(
            ok["result"]["task"]["artifacts"][0]["parts"][0]["data"],
            json!({"a": 1})
        );
        let failed = answer(
            &send,
            "r2",
            &json!({"content": [{"type": "text", "text": "agent_died"}], "isError": true}),
        );
        let status = &failed["result"]["task"]["status"];
        assert_eq!(status["state"], "TASK_STATE_FAILED");
        assert_eq!(status["message"]["parts"][0]["text"], "agent_died");
        assert_eq!(failed["id"], "7");
    }
}
