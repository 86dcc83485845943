//! The Agent2Agent door (A2A v1.0, JSON-RPC binding): mesh agents that are tools (those the
//! `mesh = true` tool server serves) as A2A agents. Each has a card at
//! `/a2a/{agent}/.well-known/agent-card.json` whose interface is `POST /a2a/{agent}`; the node's
//! own card (`/.well-known/agent-card.json`) lists them as skills. `SendMessage` becomes one tool
//! call of the agent through the pipeline (the same gate, budget, breaker and record as
//! `/mcp`): its payload is the message's first data part that is an object, else
//! `{"text": ...}` of its text parts; the agent's answer is a completed task with the answer
//! as an artifact, and a refusal or a failure (an agent that died holding the call among them)
//! a failed task that says why. Pure: the HTTP handlers live in `node::http`.

use super::rpc::{self, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND};
use crate::node::exchange::{lenient, str_of};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Value, json};

/// The protocol version served.
pub(crate) const VERSION: &str = "1.0";

const VERSION_NOT_SUPPORTED: i64 = -32009;

/// One agent offered over A2A: its name and what the catalog says it does.
pub(crate) struct Offered<'a> {
    pub agent: &'a str,
    pub description: &'a str,
}

/// An agent card (`AgentCard`).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Card<'a> {
    name: &'a str,
    description: &'a str,
    version: &'static str,
    supported_interfaces: [Interface; 1],
    provider: Provider<'a>,
    capabilities: AgentCapabilities,
    default_input_modes: [&'static str; 2],
    default_output_modes: [&'static str; 2],
    skills: Vec<Skill<'a>>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Interface {
    url: String,
    protocol_binding: &'static str,
    protocol_version: &'static str,
}

#[derive(Serialize)]
struct Provider<'a> {
    organization: &'static str,
    url: &'a str,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct AgentCapabilities {
    streaming: bool,
    push_notifications: bool,
}

#[derive(Serialize)]
struct Skill<'a> {
    id: &'a str,
    name: &'a str,
    description: &'a str,
    tags: [&'static str; 1],
}

fn skill<'a>(a: &Offered<'a>) -> Skill<'a> {
    Skill {
        id: a.agent,
        name: a.agent,
        description: a.description,
        tags: ["mesh"],
    }
}

const MODES: [&str; 2] = ["application/json", "text/plain"];

/// A card named `name` whose interface is `url` and whose skills are `skills`.
fn card<'a>(
    base: &'a str,
    name: &'a str,
    description: &'a str,
    url: String,
    skills: Vec<Skill<'a>>,
) -> Card<'a> {
    Card {
        name,
        description,
        version: env!("CARGO_PKG_VERSION"),
        supported_interfaces: [Interface {
            url,
            protocol_binding: "JSONRPC",
            protocol_version: VERSION,
        }],
        provider: Provider {
            organization: "oam",
            url: base,
        },
        capabilities: AgentCapabilities {
            streaming: false,
            push_notifications: false,
        },
        default_input_modes: MODES,
        default_output_modes: MODES,
        skills,
    }
}

/// The card of `agent`, served by the node at `base` (`http://host:port`).
pub(crate) fn agent_card<'a>(base: &'a str, a: &Offered<'a>) -> Card<'a> {
    let url = format!("{base}/a2a/{}", a.agent);
    card(base, a.agent, a.description, url, vec![skill(a)])
}

/// The node's own card: every offered agent as a skill, each reached at its own card's
/// interface (`/a2a/{agent}`); the node's interface answers with where they are.
pub(crate) fn node_card<'a>(base: &'a str, offered: &[Offered<'a>]) -> Card<'a> {
    let description = "The agents of this oam mesh, each at /a2a/{agent} (its card at \
                       /a2a/{agent}/.well-known/agent-card.json), every call judged by oam.";
    let skills = offered.iter().map(skill).collect();
    card(base, "oam mesh", description, format!("{base}/a2a"), skills)
}

/// A JSON-RPC error answer to request `id`.
pub(crate) fn error(id: &RawValue, code: i64, message: &str) -> Vec<u8> {
    rpc::error(id, code, message)
}

/// What a `SendMessage` asks: the request's id, the payload for the agent, and the message's
/// context (kept on the task).
pub(crate) struct Send {
    pub id: rpc::Id,
    pub payload: Value,
    pub context_id: Option<String>,
}

/// `SendMessage`'s params, as far as oam reads them.
#[derive(Deserialize, Default)]
struct SendParams<'a> {
    #[serde(default, borrow)]
    message: Option<SentMessage<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SentMessage<'a> {
    #[serde(default, borrow)]
    parts: Vec<PartIn<'a>>,
    #[serde(default)]
    context_id: Option<String>,
}

/// A part: its text, or its data (an object is passed to the agent as it came).
#[derive(Deserialize)]
struct PartIn<'a> {
    #[serde(default)]
    text: Option<String>,
    #[serde(default, borrow)]
    data: Option<&'a RawValue>,
}

/// Read a JSON-RPC request to `/a2a/{agent}`: a `SendMessage`, or the error answer.
pub(crate) fn read(body: &[u8], version: Option<&str>) -> Result<Send, Vec<u8>> {
    let m = rpc::read(body).map_err(|(code, why)| error(&rpc::no_id(), code, &why))?;
    let id = m.id.unwrap_or_else(rpc::no_id);
    if let Some(asked) = version.filter(|v| *v != VERSION) {
        let why = format!("A2A version {asked} is not served; this agent speaks {VERSION}");
        return Err(error(&id, VERSION_NOT_SUPPORTED, &why));
    }
    let Some(method) = m.method else {
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
    let params: SendParams<'_> =
        rpc::params(m.params.as_deref()).map_err(|why| error(&id, INVALID_PARAMS, &why))?;
    let Some(message) = params.message.filter(|m| !m.parts.is_empty()) else {
        return Err(error(
            &id,
            INVALID_PARAMS,
            "params.message.parts must be a non-empty list",
        ));
    };
    let data = message
        .parts
        .iter()
        .filter_map(|p| p.data)
        .find(|d| d.get().starts_with('{'));
    let payload = match data.map(|d| serde_json::from_str(d.get())) {
        Some(Ok(d)) => d,
        _ => {
            let text: Vec<&str> = message
                .parts
                .iter()
                .filter_map(|p| p.text.as_deref())
                .collect();
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
        context_id: message.context_id,
    })
}

/// A `tools/call` result, as far as A2A reads it: each member read leniently (a tool server's
/// result is passed on as it came, so a member of another shape is ignored, not the whole).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ToolResult<'a> {
    #[serde(default, borrow)]
    content: Option<&'a RawValue>,
    #[serde(default, borrow)]
    is_error: Option<&'a RawValue>,
    #[serde(default, borrow)]
    structured_content: Option<&'a RawValue>,
    #[serde(default, rename = "_meta", borrow)]
    meta: Option<&'a RawValue>,
}

#[derive(Deserialize, Default)]
struct TextIn<'a> {
    #[serde(default, borrow)]
    text: Option<&'a RawValue>,
}

#[derive(Deserialize, Default)]
struct MetaIn<'a> {
    #[serde(default, borrow)]
    oam: Option<&'a RawValue>,
}

/// The task a `SendMessage` answer carries.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Task<'a> {
    id: &'a str,
    context_id: &'a str,
    status: TaskStatus<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    artifacts: Option<[Artifact<'a>; 1]>,
    metadata: Metadata<'a>,
}

#[derive(Serialize)]
struct TaskStatus<'a> {
    state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<StatusMessage<'a>>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct StatusMessage<'a> {
    message_id: String,
    role: &'static str,
    parts: [PartOut<'a>; 1],
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Artifact<'a> {
    artifact_id: String,
    name: &'static str,
    parts: [PartOut<'a>; 1],
}

/// A part written: text, or an object as data.
#[derive(Serialize)]
#[serde(rename_all = "lowercase")]
enum PartOut<'a> {
    Text(&'a str),
    Data(&'a RawValue),
}

#[derive(Serialize)]
struct Metadata<'a> {
    oam: Option<&'a RawValue>,
}

#[derive(Serialize)]
struct Sent<'a> {
    task: Task<'a>,
}

/// The `SendMessage` answer of a decided call: `result` is its `tools/call` result (the
/// agent's answer, or `isError` with why; JSON bytes), `task_id` the request's id.
pub(crate) fn answer(send: &Send, task_id: &str, result: &[u8]) -> Vec<u8> {
    let result: ToolResult<'_> = serde_json::from_slice(result).unwrap_or_default();
    let context = send.context_id.as_deref().unwrap_or(task_id);
    let parts: Vec<&RawValue> = lenient(result.content);
    let text: Vec<_> = parts
        .into_iter()
        .filter_map(|p| str_of(lenient::<TextIn<'_>>(Some(p)).text))
        .collect();
    let text = text.join("\n");
    let metadata = Metadata {
        oam: lenient::<MetaIn<'_>>(result.meta).oam,
    };
    let task = if result.is_error.is_some_and(|e| e.get() == "true") {
        Task {
            id: task_id,
            context_id: context,
            status: TaskStatus {
                state: "TASK_STATE_FAILED",
                message: Some(StatusMessage {
                    message_id: format!("{task_id}-status"),
                    role: "ROLE_AGENT",
                    parts: [PartOut::Text(&text)],
                }),
            },
            artifacts: None,
            metadata,
        }
    } else {
        let part = match result
            .structured_content
            .filter(|s| s.get().starts_with('{'))
        {
            Some(s) => PartOut::Data(s),
            None => PartOut::Text(&text),
        };
        Task {
            id: task_id,
            context_id: context,
            status: TaskStatus {
                state: "TASK_STATE_COMPLETED",
                message: None,
            },
            artifacts: Some([Artifact {
                artifact_id: format!("{task_id}-answer"),
                name: "answer",
                parts: [part],
            }]),
            metadata,
        }
    };
    rpc::success(&send.id, Sent { task })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(e: Vec<u8>) -> Value {
        serde_json::from_slice::<Value>(&e).unwrap()["error"]["code"].clone()
    }

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
        assert_eq!(code(e), INVALID_PARAMS);
        let Err(e) = read(body(json!([{"text": "a"}])).as_bytes(), Some("0.3")) else {
            panic!()
        };
        assert_eq!(code(e), VERSION_NOT_SUPPORTED);
        let old = json!({"jsonrpc": "2.0", "id": 1, "method": "message/send"}).to_string();
        let Err(e) = read(old.as_bytes(), None) else {
            panic!()
        };
        assert_eq!(code(e), METHOD_NOT_FOUND);
        let Err(e) = read(
            b"{\"id\": 1, \"method\": \"SendMessage\", \"params\": 2}",
            None,
        ) else {
            panic!()
        };
        assert_eq!(code(e), INVALID_PARAMS);
    }

    #[test]
    fn an_answer_is_a_completed_task_and_an_error_a_failed_one() {
        let send = Send {
            id: RawValue::from_string("\"7\"".into()).unwrap(),
            payload: json!({}),
            context_id: None,
        };
        let answer = |task: &str, result: Value| -> Value {
            let bytes = answer(&send, task, &serde_json::to_vec(&result).unwrap());
            serde_json::from_slice(&bytes).unwrap()
        };
        let ok = answer(
            "r1",
            json!({"content": [{"type": "text", "text": "{}"}], "structuredContent": {"a": 1}}),
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
            "r2",
            json!({"content": [{"type": "text", "text": "agent_died"}], "isError": true,
                   "_meta": {"oam": {"outcome": "rejected"}}}),
        );
        let status = &failed["result"]["task"]["status"];
        assert_eq!(status["state"], "TASK_STATE_FAILED");
        assert_eq!(status["message"]["parts"][0]["text"], "agent_died");
        assert_eq!(failed["id"], "7");
        assert_eq!(
            failed["result"]["task"]["metadata"]["oam"]["outcome"],
            "rejected"
        );
        assert_eq!(failed["result"]["task"]["contextId"], "r2");
        // A member of another shape is ignored, not the whole result.
        let odd = answer(
            "r3",
            json!({"content": [{"type": "text", "text": "kept"}, {"text": 7}], "isError": "yes",
                   "_meta": []}),
        );
        let task = &odd["result"]["task"];
        assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED");
        assert_eq!(task["artifacts"][0]["parts"][0]["text"], "kept");
    }
}
