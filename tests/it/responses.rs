//! OpenAI's Responses API through a node, with the official OpenAI SDK.

use crate::gateway::*;
use serde_json::{Value, json};

/// The official OpenAI SDK's `responses.create` against `/v1/responses`: plain, streamed, a
/// function-tool round trip, and the stateful fields this gateway does not keep refused by name.
#[tokio::test]
async fn the_openai_client_speaks_responses_through_the_same_pipeline() {
    let g = gateway("responses").await;
    let script = r#"
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="not-needed", max_retries=0)
out = {}
r = c.responses.create(model="small", instructions="be brief", input="Hello")
out["plain"] = {"text": r.output_text, "status": r.status, "usage": r.usage.total_tokens,
                "raw": json.loads(r.to_json())}
events = list(c.responses.create(model="small", instructions="be brief", input="Hello",
                                 stream=True))
out["types"] = [e.type for e in events]
out["deltas"] = "".join(e.delta for e in events if e.type == "response.output_text.delta")
out["delta_count"] = sum(1 for e in events if e.type == "response.output_text.delta")
out["completed"] = json.loads(events[-1].response.to_json())
with c.responses.stream(model="small", input="Hello") as s:
    out["stream_final"] = s.get_final_response().output_text
tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]
ask = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]
first = c.responses.create(model="small", input=ask, tools=tools)
call = [o for o in first.output if o.type == "function_call"][0]
out["call"] = {"name": call.name, "arguments": call.arguments, "call_id": call.call_id}
turns = ask + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}]
out["second"] = c.responses.create(model="small", input=turns, tools=tools).output_text
try:
    c.responses.create(model="small", input="again", previous_response_id=first.id)
    out["error"] = "answered"
except openai.BadRequestError as e:
    out["error"] = {"status": e.status_code, "body": e.body}
print(json.dumps(out))
"#;
    let v = crate::support::python_json(script, &[&g.url]);
    let plain = &v["plain"];
    let text = plain["text"].as_str().unwrap();
    assert!(
        text.contains("primary answer") && text.contains("to: Hello"),
        "{v}"
    );
    assert_eq!(plain["status"], "completed");
    assert!(plain["usage"].as_u64() > Some(0), "{plain}");
    assert_eq!(plain["raw"]["oam"]["outcome"], "accepted");
    assert_eq!(plain["raw"]["oam"]["target"], "primary/small");
    let types: Vec<&str> = v["types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(types.first(), Some(&"response.created"), "{types:?}");
    assert_eq!(types.last(), Some(&"response.completed"), "{types:?}");
    assert!(
        v["delta_count"].as_u64() > Some(1),
        "relayed live, in pieces: {v}"
    );
    let delta = v["deltas"].as_str().unwrap();
    assert!(delta.contains("to: Hello"), "{v}");
    assert_eq!(v["completed"]["output"][0]["content"][0]["text"], delta);
    assert!(
        v["stream_final"].as_str().unwrap().contains("to: Hello"),
        "{v}"
    );
    assert_eq!(v["call"]["name"], "get_weather", "{v}");
    let args: Value = serde_json::from_str(v["call"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string(), "{v}");
    assert!(v["second"].as_str().unwrap().contains("answer"), "{v}");
    assert_eq!(v["error"]["status"], 400, "{v}");
    assert_eq!(v["error"]["body"]["param"], "previous_response_id", "{v}");

    // What reached the upstream: chat completions, the tool output as a `tool` message.
    let sent = g.received("primary").await;
    assert_eq!(
        sent[0]["messages"][0],
        json!({"role": "system", "content": "be brief"})
    );
    let last = sent.last().unwrap()["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(
        (&last["role"], &last["content"]),
        (&json!("tool"), &json!("21 C")),
        "{last}"
    );
    assert_eq!(last["tool_call_id"], v["call"]["call_id"]);
    assert_eq!(sent.len(), 5, "the refused request reached no provider");
}
