//! Anthropic's Messages API through a node: the official Anthropic SDK, Messages targets
//! (`api = "anthropic"`) serving both APIs and falling back to chat targets, cut streams
//! continued across the two, and what Messages alone carries (thinking, cache pricing).

use crate::gateway::*;
use serde_json::{Value, json};

/// The official Anthropic SDK against `/v1/messages`: plain, streamed, a tool-use round trip,
/// an image, the model list and an error, all through the chat pipeline (the `oam` object
/// rides along on every answer).
#[tokio::test]
async fn the_anthropic_client_speaks_messages_through_the_same_pipeline() {
    let g = gateway("anthropic").await;
    let script = r#"
import json, sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="not-needed", max_retries=0)
out = {}
hello = [{"role": "user", "content": "Hello"}]
m = c.messages.create(model="small", max_tokens=64, system="be brief", messages=hello)
out["plain"] = json.loads(m.to_json())
with c.messages.stream(model="small", max_tokens=64, system="be brief", messages=hello) as s:
    out["streamed_text"] = "".join(s.text_stream)
    out["streamed"] = json.loads(s.get_final_message().to_json())
tools = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
ask = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]
first = c.messages.create(model="small", max_tokens=64, tools=tools, messages=ask)
out["first"] = json.loads(first.to_json())
use = [b for b in first.content if b.type == "tool_use"][0]
with c.messages.stream(model="small", max_tokens=64, tools=tools, messages=ask) as s:
    out["streamed_tool"] = json.loads(s.get_final_message().to_json())
turns = ask + [{"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "21 C"}]}]
out["second"] = json.loads(c.messages.create(model="small", max_tokens=64, tools=tools,
                                             messages=turns).to_json())
out["models"] = [m.id for m in c.models.list()]
out["counted"] = [c.messages.count_tokens(model="small", messages=[{"role": "user", "content": t}]).input_tokens
                  for t in ["hi", "word " * 400]]
try:
    c.messages.create(model="gpt-9", max_tokens=8, messages=hello)
    out["error"] = "answered"
except anthropic.NotFoundError as e:
    out["error"] = {"status": e.status_code, "body": e.body}
print(json.dumps(out))
"#;
    let v = crate::support::python_json(script, &[&g.url]);
    let plain = &v["plain"];
    assert_eq!(
        (&plain["type"], &plain["role"]),
        (&json!("message"), &json!("assistant")),
        "{v}"
    );
    assert_eq!(plain["content"][0]["type"], "text");
    assert_eq!(plain["stop_reason"], "end_turn");
    assert!(
        plain["usage"]["output_tokens"].as_u64() > Some(0),
        "{plain}"
    );
    assert_eq!(plain["oam"]["outcome"], "accepted");
    assert_eq!(plain["oam"]["target"], "primary/small");
    let streamed = &v["streamed"];
    assert_eq!(v["streamed_text"], streamed["content"][0]["text"], "{v}");
    for m in [plain, streamed] {
        let text = m["content"][0]["text"].as_str().unwrap();
        assert!(
            text.contains("primary answer") && text.contains("to: Hello"),
            "{text}"
        );
    }
    assert_eq!(streamed["stop_reason"], "end_turn");

    let first = &v["first"];
    assert_eq!(first["stop_reason"], "tool_use", "{first}");
    let call = first["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "tool_use")
        .unwrap();
    assert_eq!(call["name"], "get_weather");
    assert!(call["input"]["city"].is_string(), "{call}");
    let streamed_call = v["streamed_tool"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "tool_use")
        .unwrap();
    assert_eq!(
        streamed_call["input"], call["input"],
        "the stream's input JSON reads back whole"
    );
    let second = &v["second"];
    assert_eq!(second["stop_reason"], "end_turn", "{second}");
    assert!(
        second["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("answer"),
        "{second}"
    );

    assert_eq!(v["models"], json!(["big", "small", "auto"]));
    let counted: Vec<u64> = v["counted"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect();
    assert!(
        counted[0] > 0 && counted[1] >= counted[0] + 400,
        "{counted:?}"
    );
    assert_eq!(v["error"]["status"], 404, "{v}");
    assert_eq!(v["error"]["body"]["type"], "error");
    assert_eq!(v["error"]["body"]["error"]["type"], "not_found_error");
    assert!(
        v["error"]["body"]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown model"),
        "{v}"
    );

    // What reached the upstream: chat completions, the image and the tool result translated.
    let sent = g.received("primary").await;
    assert!(
        sent.iter().all(|r| r["messages"].is_array()),
        "chat requests only"
    );
    assert_eq!(
        sent[0]["messages"][0],
        json!({"role": "system", "content": "be brief"})
    );
    let with_image = sent
        .iter()
        .find(|r| r["messages"][0]["content"].is_array())
        .expect("the image");
    assert_eq!(
        with_image["messages"][0]["content"][1]["image_url"]["url"],
        "data:image/png;base64,iVBORw0KGgo="
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
    assert_eq!(last["tool_call_id"], call["id"]);
}

/// Messages streamed live through the official Anthropic SDK: a cut stream is continued on a
/// prefill target and reads as one whole message; with no such target the SDK raises the
/// in-band error, never taking a cut answer for a whole one.
#[tokio::test]
async fn the_anthropic_client_sees_a_cut_stream_continued_or_failed() {
    let g = streaming("anthropic-cut").await;
    for on in ["primary/small", "primary/big"] {
        g.fault(
            on,
            json!({"mode": "stream", "kind": "cut", "after_chunks": 4}),
        )
        .await;
    }
    let script = r#"
import json, sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="not-needed", max_retries=0)
out = {}
with c.messages.stream(model="prefill", max_tokens=64,
                       messages=[{"role": "user", "content": "cut and continue"}]) as s:
    out["deltas"] = sum(1 for _ in s.text_stream)
    m = json.loads(s.get_final_message().to_json())
out["continued"] = m
try:
    with c.messages.stream(model="chain", max_tokens=64,
                           messages=[{"role": "user", "content": "cut for good"}]) as s:
        got = "".join(s.text_stream)
    out["broken"] = "ended as if complete: " + got
except anthropic.APIError as e:
    out["broken"] = str(e)
print(json.dumps(out))
"#;
    let v = crate::support::python_json(script, &[&g.url]);
    assert!(v["deltas"].as_u64() > Some(1), "relayed in pieces: {v}");
    let m = &v["continued"];
    assert_eq!(m["stop_reason"], "end_turn", "{m}");
    assert_eq!(
        m["content"].as_array().map(Vec::len),
        Some(1),
        "one text block: {m}"
    );
    assert!(!m["content"][0]["text"].as_str().unwrap().is_empty());
    let broken = v["broken"].as_str().unwrap();
    assert!(broken.contains("STREAM_ENDED_WITH_ERROR"), "{broken}");
    let sent = g.received("local").await;
    let prefill = sent.last().unwrap()["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(
        prefill["role"], "assistant",
        "continued with what the caller had"
    );
}

/// A Messages upstream (`api = "anthropic"`, the simulator's `secondary` speaking Messages)
/// beside the chat targets of `STREAMING`: `claude-first` falls back from it to a chat target
/// that takes a prefill, `chat-first` from a chat target to it.
const TWO_APIS: &str = r#"
[[provider]]
id = "claude"
api = "anthropic"
base_url = "SIM/secondary/v1"
model = "medium"
probe = "off"
cost_per_1k_tokens_usd = 0.003
output_cost_per_1k_usd = 0.015
cached_input_cost_per_1k_usd = 0.0003
cache_write_cost_per_1k_usd = 0.00375

[[route]]
model = "claude-first"
targets = ["claude", "local"]
first_token_ms = 1000
idle_ms = 400

[[route]]
model = "chat-first"
targets = ["primary/small", "claude"]
first_token_ms = 1000
idle_ms = 400
"#;

async fn two_apis(tag: &str) -> Gateway {
    gateway_with(tag, &format!("{STREAMING}{TWO_APIS}")).await
}

/// The official Anthropic SDK through a Messages target (plain, a tool-use round trip,
/// streamed) and the official OpenAI SDK's chat on the same target by translation; when
/// either API's target fails, the other API's serves the same request.
#[tokio::test]
async fn an_anthropic_upstream_serves_both_apis_and_each_falls_back_to_the_other() {
    let g = two_apis("two-apis").await;
    let script = r#"
import json, sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="not-needed", max_retries=0)
out = {}
m = c.messages.create(model="claude-first", max_tokens=64, system="be brief",
                      messages=[{"role": "user", "content": "hello claude"}])
out["plain"] = json.loads(m.to_json())
tools = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
ask = [{"role": "user", "content": "Weather in Paris?"}]
first = c.messages.create(model="claude-first", max_tokens=64, tools=tools, messages=ask)
use = [b for b in first.content if b.type == "tool_use"][0]
turns = ask + [{"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "21 C"}]}]
second = c.messages.create(model="claude-first", max_tokens=64, tools=tools, messages=turns)
out["first"], out["second"] = json.loads(first.to_json()), json.loads(second.to_json())
with c.messages.stream(model="claude-first", max_tokens=64,
                       messages=[{"role": "user", "content": "stream from claude"}]) as s:
    out["deltas"] = sum(1 for _ in s.text_stream)
    out["streamed"] = json.loads(s.get_final_message().to_json())
print(json.dumps(out))
"#;
    let v = crate::support::python_json(script, &[&g.url]);
    let plain = &v["plain"];
    assert_eq!(plain["oam"]["target"], "claude", "{plain}");
    assert!(
        plain["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("secondary answer"),
        "{plain}"
    );
    // What reached the upstream is a Messages request, not a chat one.
    let sent = g.received("secondary").await;
    let asked = &sent[0];
    assert_eq!(asked["system"], "be brief", "{asked}");
    assert_eq!(asked["model"], "medium");
    assert_eq!(
        asked["messages"],
        json!([{"role": "user", "content": [{"type": "text", "text": "hello claude"}]}])
    );
    assert_eq!(v["first"]["stop_reason"], "tool_use", "{v}");
    let call = &v["first"]["content"].as_array().unwrap().last().unwrap();
    assert_eq!(call["input"]["city"], "Weather in Paris?", "{call}");
    assert_eq!(v["second"]["stop_reason"], "end_turn", "{v}");
    let result_turn = &g.received("secondary").await[2]["messages"][2];
    assert_eq!(
        result_turn["content"][0],
        json!({"type": "tool_result", "tool_use_id": call["id"], "content": "21 C"}),
        "the tool result reached the Messages upstream as one: {result_turn}"
    );
    assert!(v["deltas"].as_u64() > Some(1), "relayed in pieces: {v}");
    assert_eq!(v["streamed"]["stop_reason"], "end_turn", "{v}");
    let streamed = g.received("secondary").await[3].clone();
    assert_eq!(
        streamed["stream"], true,
        "streamed from the Messages target: {streamed}"
    );

    // The Messages target fails: the Anthropic client is served by the chat target.
    g.fault("secondary", json!({"mode": "error", "status": 529}))
        .await;
    let fell_back = r#"
import json, sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="not-needed", max_retries=0)
m = c.messages.create(model="claude-first", max_tokens=64,
                      messages=[{"role": "user", "content": "claude is down"}])
print(m.to_json())
"#;
    let m = crate::support::python_json(fell_back, &[&g.url]);
    assert_eq!(m["oam"]["target"], "local", "{m}");
    assert_eq!(
        tried(&m),
        ["claude", "claude", "local"],
        "retried once, then moved on: {m}"
    );
    g.clear().await;

    // The chat target fails: the OpenAI client is served by the Messages target, streamed.
    g.fault("primary/small", json!({"mode": "error", "status": 503}))
        .await;
    let chat = r#"
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="not-needed", max_retries=0)
r = c.chat.completions.create(model="chat-first",
                              messages=[{"role": "user", "content": "chat is down"}])
s = c.chat.completions.create(model="chat-first", stream=True,
                              messages=[{"role": "user", "content": "chat is down, streamed"}])
text = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
print(json.dumps({"whole": json.loads(r.to_json()), "streamed": text}))
"#;
    let v = crate::support::python_json(chat, &[&g.url]);
    let whole = &v["whole"];
    assert_eq!(whole["oam"]["target"], "claude", "{whole}");
    assert_eq!(
        tried(whole),
        ["primary/small", "primary/small", "claude"],
        "{whole}"
    );
    assert!(
        whole["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("secondary answer"),
        "{whole}"
    );
    assert_eq!(whole["choices"][0]["finish_reason"], "stop");
    assert!(
        v["streamed"].as_str().unwrap().contains("secondary answer"),
        "{v}"
    );
}

/// A stream cut mid-answer on one API's target is continued on the other's, given what the
/// caller already has: from Messages to a chat target's prefill, and from chat to Messages'
/// native trailing assistant turn; the caller reads one whole answer either way.
#[tokio::test]
async fn a_cut_stream_is_continued_across_the_two_apis() {
    let g = two_apis("two-apis-cut").await;
    g.fault(
        "primary/small",
        json!({"mode": "stream", "kind": "cut", "after_chunks": 4}),
    )
    .await;
    let (status, seen) = g.stream("chat-first", "cut chat").await;
    assert_eq!(status, 200);
    assert!(seen.ended_cleanly(), "{:?}", seen.data());
    assert_eq!(seen.oam()["target"], "claude", "{}", seen.oam());
    let turns = g.received("secondary").await.last().unwrap()["messages"].clone();
    let last = turns.as_array().unwrap().last().unwrap();
    assert_eq!(last["role"], "assistant", "a native prefill: {turns}");
    let delivered = last["content"][0]["text"].as_str().unwrap();
    assert!(
        !delivered.is_empty() && seen.text().starts_with(delivered),
        "{delivered:?} then {}",
        seen.text()
    );
    g.clear().await;

    g.fault(
        "secondary",
        json!({"mode": "stream", "kind": "cut", "after_chunks": 4}),
    )
    .await;
    let script = r#"
import json, sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="not-needed", max_retries=0)
with c.messages.stream(model="claude-first", max_tokens=64,
                       messages=[{"role": "user", "content": "cut claude"}]) as s:
    text = "".join(s.text_stream)
    m = json.loads(s.get_final_message().to_json())
print(json.dumps({"text": text, "message": m}))
"#;
    let v = crate::support::python_json(script, &[&g.url]);
    let m = &v["message"];
    assert_eq!(m["stop_reason"], "end_turn", "never truncated: {m}");
    let prefill = g.received("local").await.last().unwrap()["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(prefill["role"], "assistant", "{prefill}");
    let delivered = prefill["content"].as_str().unwrap();
    assert!(
        !delivered.is_empty() && v["text"].as_str().unwrap().starts_with(delivered),
        "{delivered:?} then {v}"
    );
}

/// A chat request using what Messages has no equivalent for (`logprobs`, a JSON
/// `response_format`) never reaches the Messages target: it is excluded with its reason code,
/// and with the chat target down the request is refused rather than sent altered.
#[tokio::test]
async fn what_messages_cannot_carry_never_reaches_an_anthropic_target() {
    let g = two_apis("two-apis-bound").await;
    g.fault("primary/small", json!({"mode": "error", "status": 503}))
        .await;
    for (field, value) in [
        ("logprobs", json!(true)),
        ("response_format", json!({"type": "json_object"})),
    ] {
        let mut body = json!({"model": "chat-first",
            "messages": [{"role": "user", "content": "give me logprobs"}]});
        body[field] = value;
        let (status, v) = g.post(body).await;
        assert_ne!(status, 200, "{field}: {v}");
        assert!(
            tried(&v).iter().all(|t| t == "primary/small"),
            "{field}: {v}"
        );
        let text = g.explain(&v).await.to_string();
        assert!(
            text.contains("API_NOT_CARRIED"),
            "{field}: claude excluded by its reason code: {text}"
        );
    }
    assert!(
        g.received("secondary").await.is_empty(),
        "nothing reached the Messages upstream"
    );
    // Without them, the same request is served there.
    let (status, v) = g.ask("chat-first", "no logprobs").await;
    assert_eq!(
        (status, &v["oam"]["target"]),
        (200, &json!("claude")),
        "{v}"
    );
}

/// Messages reports prompt tokens written to and read from its cache apart from the rest; each
/// is priced at its own rate, and the Anthropic client reads them back under their names.
#[tokio::test]
async fn cache_writes_and_reads_are_priced_from_what_messages_reports() {
    let g = two_apis("two-apis-cache").await;
    let script = r#"
import json, sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="not-needed", max_retries=0)
system = "You answer questions about tides. " * 40
out = [json.loads(c.messages.create(model="claude-first", max_tokens=64, system=system,
        messages=[{"role": "user", "content": q}]).to_json()) for q in ["Brest?", "Calais?"]]
print(json.dumps(out))
"#;
    let v = crate::support::python_json(script, &[&g.url]);
    let (first, second) = (&v[0], &v[1]);
    let n = |m: &Value, k: &str| m["usage"][k].as_f64().unwrap_or(0.0);
    assert!(n(first, "cache_creation_input_tokens") >= 300.0, "{first}");
    assert_eq!(n(first, "cache_read_input_tokens"), 0.0, "{first}");
    assert_eq!(
        n(second, "cache_read_input_tokens"),
        n(first, "cache_creation_input_tokens"),
        "{second}"
    );
    for m in [first, second] {
        let expected = (n(m, "input_tokens") * 0.003
            + n(m, "cache_read_input_tokens") * 0.0003
            + n(m, "cache_creation_input_tokens") * 0.00375
            + n(m, "output_tokens") * 0.015)
            / 1_000.0;
        let cost = m["oam"]["cost_usd"].as_f64().unwrap();
        assert!(
            (cost - expected).abs() < 1e-9,
            "charged {cost}, the usage says {expected}: {m}"
        );
    }
}

/// With a Messages target, a Messages request using what only Messages carries (extended
/// thinking, a thinking block in its history) is sent to it as it came and answered as it
/// answered (the thinking block signed, whole or streamed), never to a chat target: on a
/// route that starts with one, that target is excluded (API_NOT_CARRIED).
#[tokio::test]
async fn thinking_goes_to_a_messages_target_as_it_came() {
    let g = two_apis("two-apis-thinking").await;
    let script = r#"
import json, sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="not-needed", max_retries=0)
turns = [{"role": "user", "content": "think first"},
         {"role": "assistant", "content": [
             {"type": "thinking", "thinking": "earlier thoughts", "signature": "sig-1"},
             {"type": "text", "text": "earlier answer"}]},
         {"role": "user", "content": "and now?"}]
thinking = {"type": "enabled", "budget_tokens": 1024}
m = c.messages.create(model="chat-first", max_tokens=2048, thinking=thinking, messages=turns)
with c.messages.stream(model="chat-first", max_tokens=2048, thinking=thinking,
                       messages=turns) as s:
    streamed = json.loads(s.get_final_message().to_json())
print(json.dumps({"whole": json.loads(m.to_json()), "streamed": streamed}))
"#;
    let v = crate::support::python_json(script, &[&g.url]);
    for m in [&v["whole"], &v["streamed"]] {
        let first = &m["content"][0];
        assert_eq!(first["type"], "thinking", "{m}");
        assert!(
            first["signature"]
                .as_str()
                .unwrap()
                .starts_with("sim-signature"),
            "{m}"
        );
        assert_eq!(m["content"][1]["type"], "text", "{m}");
    }
    assert_eq!(v["whole"]["oam"]["target"], "claude", "{v}");
    assert_eq!(
        tried(&v["whole"]),
        ["claude"],
        "the chat target first in the route: {v}"
    );
    let explained = g.explain(&v["whole"]).await.to_string();
    assert!(explained.contains("API_NOT_CARRIED"), "{explained}");
    assert!(
        g.received("primary").await.is_empty(),
        "nothing reached the chat target"
    );
    let sent = &g.received("secondary").await[0];
    assert_eq!(sent["thinking"]["budget_tokens"], 1024, "{sent}");
    assert_eq!(sent["model"], "medium");
    assert_eq!(
        sent["messages"][1]["content"][0],
        json!({"type": "thinking", "thinking": "earlier thoughts", "signature": "sig-1"}),
        "the history's thinking block unchanged: {sent}"
    );
    assert!(
        sent.get("oam").is_none() && sent.get("stream").is_none(),
        "{sent}"
    );
}
