//! `oam sim` over real HTTP: the OpenAI shape, every fault mode, expiry, bad input.

use crate::support::{Proc, eventually};
use oam::core::contract::Contract;
use oam::core::reason::ReasonCode;
use serde_json::{Value, json};
use std::time::Duration;

fn sim(seed: &str) -> (Proc, String) {
    let p = Proc::spawn(&["sim", "--listen", "127.0.0.1:0", "--json", "--seed", seed]);
    let url = p.ready["url"].as_str().expect("url").to_string();
    (p, url)
}

fn client() -> reqwest::Client {
    crate::support::http(Duration::from_secs(10))
}

async fn get_json(c: &reqwest::Client, url: String) -> Value {
    c.get(url).send().await.unwrap().json().await.unwrap()
}

fn chat(question: &str) -> Value {
    json!({"model": "ignored-by-provider-path", "messages": [{"role": "user", "content": question}]})
}

async fn ask(c: &reqwest::Client, url: &str, provider: &str) -> reqwest::Response {
    c.post(format!("{url}/{provider}/v1/chat/completions"))
        .json(&chat("What is the capital of Norway?"))
        .send()
        .await
        .expect("send")
}

async fn set_fault(c: &reqwest::Client, url: &str, fault: Value) {
    let r = c
        .post(format!("{url}/sim/faults"))
        .json(&fault)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
}

fn content(v: &Value) -> (&str, Option<&str>) {
    let choice = &v["choices"][0];
    (
        choice["message"]["content"].as_str().expect("content"),
        choice["finish_reason"].as_str(),
    )
}

#[tokio::test]
async fn answers_in_the_openai_shape_and_meet_the_contract() {
    let (_p, url) = sim("1");
    let c = client();
    let r = ask(&c, &url, "primary").await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["usage"]["total_tokens"].as_u64().unwrap() > 0);
    let (text, finish) = content(&v);
    let confidence = Contract::default()
        .check(text, finish)
        .expect("healthy answers pass");
    assert!(confidence.unwrap() >= 0.86);

    let models: Value = get_json(&c, format!("{url}/v1/models")).await;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["sim-small", "sim-large", "sim-medium"]);

    // The shared endpoint routes by model name.
    let v: Value = c
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-sim-local-"));
}

#[tokio::test]
async fn the_same_seed_gives_the_same_answers() {
    let (_a, url_a) = sim("7");
    let (_b, url_b) = sim("7");
    let c = client();
    for _ in 0..3 {
        let a: Value = ask(&c, &url_a, "secondary").await.json().await.unwrap();
        let b: Value = ask(&c, &url_b, "secondary").await.json().await.unwrap();
        assert_eq!(content(&a), content(&b));
    }
}

#[tokio::test]
async fn contract_faults_are_caught_with_their_codes() {
    let (_p, url) = sim("2");
    let c = client();
    for (kind, code) in [
        ("not-json", ReasonCode::ContractNotJson),
        ("missing-field", ReasonCode::ContractMissingField),
        ("low-confidence", ReasonCode::ContractConfidenceTooLow),
        ("truncated", ReasonCode::ContractTruncated),
    ] {
        set_fault(
            &c,
            &url,
            json!({"provider": "primary", "mode": "contract", "kind": kind, "duration_ms": 60_000}),
        )
        .await;
        let r = ask(&c, &url, "primary").await;
        assert_eq!(r.status(), 200, "a broken contract still answers 200");
        let v: Value = r.json().await.unwrap();
        let (text, finish) = content(&v);
        let defects = Contract::default().check(text, finish).unwrap_err();
        assert_eq!(defects[0].code, code, "{kind}: {text}");
    }
}

#[tokio::test]
async fn error_rate_limit_reset_and_hang_behave_like_real_failures() {
    let (_p, url) = sim("3");
    let c = client();

    set_fault(
        &c,
        &url,
        json!({"provider": "primary", "mode": "error", "status": 503, "duration_ms": 60_000}),
    )
    .await;
    let r = ask(&c, &url, "primary").await;
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "server_error");

    set_fault(&c, &url, json!({"provider": "secondary", "mode": "rate-limit", "retry_after_ms": 1_500, "duration_ms": 60_000})).await;
    let r = ask(&c, &url, "secondary").await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "2");
    assert_eq!(r.headers()["retry-after-ms"], "1500");

    set_fault(
        &c,
        &url,
        json!({"provider": "local", "mode": "reset", "duration_ms": 60_000}),
    )
    .await;
    let outcome = match ask_result(&c, &url, "local").await {
        Ok(r) => match r.bytes().await {
            Ok(body) => format!("got a body of {} bytes", body.len()),
            Err(e) => format!("error reading the body: {e}"),
        },
        Err(e) => format!("error: {e}"),
    };
    assert!(
        outcome.starts_with("error"),
        "a reset must not look like an answer: {outcome}"
    );

    // A hang holds the request: a client with a short timeout gives up.
    set_fault(
        &c,
        &url,
        json!({"provider": "local", "mode": "hang", "duration_ms": 60_000}),
    )
    .await;
    let short = crate::support::http(Duration::from_millis(300));
    let err = ask_result(&short, &url, "local").await.unwrap_err();
    assert!(err.is_timeout(), "{err}");

    // The fault list shows all three with time left; clearing one restores it at once.
    let faults: Value = get_json(&c, format!("{url}/sim/faults")).await;
    let listed: Vec<(&str, &str)> = faults["faults"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["provider"].as_str().unwrap(), f["mode"].as_str().unwrap()))
        .collect();
    assert_eq!(
        listed,
        [
            ("local", "hang"),
            ("primary", "error"),
            ("secondary", "rate-limit")
        ]
    );
    assert!(faults["faults"][0]["remaining_ms"].as_u64().unwrap() > 50_000);
    let r = c
        .delete(format!("{url}/sim/faults/primary"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(ask(&c, &url, "primary").await.status(), 200);
}

async fn ask_result(
    c: &reqwest::Client,
    url: &str,
    provider: &str,
) -> reqwest::Result<reqwest::Response> {
    c.post(format!("{url}/{provider}/v1/chat/completions"))
        .json(&chat("q"))
        .send()
        .await
}

#[tokio::test]
async fn faults_end_on_their_own() {
    let (_p, url) = sim("4");
    let c = client();
    set_fault(
        &c,
        &url,
        json!({"provider": "primary", "mode": "error", "duration_ms": 300}),
    )
    .await;
    assert_eq!(ask(&c, &url, "primary").await.status(), 500);
    let cleared = eventually(Duration::from_secs(5), || {
        let c = c.clone();
        let url = url.clone();
        async move {
            let v: Value = c
                .get(format!("{url}/sim/faults"))
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            v["faults"].as_array()?.is_empty().then_some(())
        }
    })
    .await;
    assert!(cleared.is_some(), "the fault did not expire");
    assert_eq!(ask(&c, &url, "primary").await.status(), 200);
}

#[tokio::test]
async fn bad_input_gets_a_clear_openai_error() {
    let (_p, url) = sim("5");
    let c = client();
    let r = c
        .post(format!("{url}/primary/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not a valid chat completion request")
    );

    let r = ask(&c, &url, "nosuch").await;
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    assert!(v["error"]["message"].as_str().unwrap().contains("primary"));

    for bad in [
        json!({"provider": "primary", "mode": "melt", "duration_ms": 10}),
        json!({"provider": "primary", "mode": "flaky", "error_rate": 3.0, "duration_ms": 10}),
        json!({"provider": "primary", "mode": "error"}),
        json!({"provider": "primary", "mode": "error", "duraton_ms": 10}),
    ] {
        let r = c
            .post(format!("{url}/sim/faults"))
            .json(&bad)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{bad}");
    }
    // Nothing bad was applied.
    let v: Value = get_json(&c, format!("{url}/sim/faults")).await;
    assert_eq!(v["faults"], json!([]));
}

#[test]
fn a_port_in_use_is_a_usage_error_that_says_what_to_do() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    assert_cmd::Command::new(assert_cmd::cargo::cargo_bin!("oam"))
        .args(["sim", "--listen", &addr])
        .timeout(Duration::from_secs(20))
        .assert()
        .code(2)
        .stderr(
            predicates::str::contains("cannot listen").and(predicates::str::contains("--listen")),
        );
}

use predicates::prelude::PredicateBooleanExt as _;

/// The official OpenAI SDK's `responses.create` against the simulator itself: plain (cached and
/// reasoning tokens reported), streamed as typed events, a function-tool round trip, the
/// simulator's faults in this API's shapes (a 503 in OpenAI's envelope, a cut stream, broken
/// tool arguments), and stateful fields and hosted tools refused by name.
#[tokio::test]
async fn the_openai_client_speaks_responses_to_the_simulator() {
    let (_p, url) = sim("7");
    let script = r#"
import json, sys, urllib.request, openai
url = sys.argv[1]
c = openai.OpenAI(base_url=url + "/primary/v1", api_key="sim", max_retries=0)
def fault(f):
    req = urllib.request.Request(url + "/sim/faults", data=json.dumps(f).encode(),
                                 headers={"content-type": "application/json"})
    urllib.request.urlopen(req).read()
def clear():
    urllib.request.urlopen(urllib.request.Request(url + "/sim/faults", method="DELETE")).read()
out = {}
first = c.responses.create(model="sim-small", instructions="be brief", input="Hello")
again = c.responses.create(model="sim-small", instructions="be brief", input="Hello",
                           reasoning={"effort": "low"})
out["plain"] = {"text": first.output_text, "status": first.status,
                "usage": json.loads(first.usage.to_json()),
                "again": json.loads(again.usage.to_json())}
events = list(c.responses.create(model="sim-small", input="Hello", stream=True))
out["types"] = [e.type for e in events]
out["seq"] = [e.sequence_number for e in events]
out["deltas"] = "".join(e.delta for e in events if e.type == "response.output_text.delta")
out["final"] = events[-1].response.output_text
tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object",
          "properties": {"q": {"type": "string"}}, "required": ["q"]}}]
ask = [{"role": "user", "content": [{"type": "input_text", "text": "Find Oslo"}]}]
r = c.responses.create(model="sim-small", input=ask, tools=tools)
call = [o for o in r.output if o.type == "function_call"][0]
out["call"] = {"name": call.name, "arguments": json.loads(call.arguments)}
turns = ask + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "59.9 N"}]
out["after_tool"] = c.responses.create(model="sim-small", input=turns, tools=tools).output_text
with c.responses.stream(model="sim-small", input=ask, tools=tools) as s:
    out["streamed_args"] = [o.arguments for o in s.get_final_response().output
                            if o.type == "function_call"]
fault({"provider": "primary", "mode": "error", "status": 503, "duration_ms": 60000})
try:
    c.responses.create(model="sim-small", input="Hello")
    out["error"] = "answered"
except openai.APIStatusError as e:
    out["error"] = {"status": e.status_code, "body": e.body}
clear()
fault({"provider": "primary", "mode": "stream", "kind": "cut", "after_chunks": 3,
       "duration_ms": 60000})
seen = []
try:
    for e in c.responses.create(model="sim-small", input="Hello", stream=True):
        seen.append(e.type)
    out["cut"] = {"finished": True, "seen": seen}
except Exception as e:
    out["cut"] = {"finished": False, "seen": seen, "error": type(e).__name__}
clear()
fault({"provider": "primary", "mode": "contract", "kind": "not-json", "duration_ms": 60000})
r = c.responses.create(model="sim-small", input=ask, tools=tools)
out["broken_args"] = [o.arguments for o in r.output if o.type == "function_call"][0]
clear()
refused = {}
for name, kw in [("previous_response_id", {"previous_response_id": first.id}),
                 ("tools.0.type", {"tools": [{"type": "web_search"}]})]:
    try:
        c.responses.create(model="sim-small", input="Hello", **kw)
        refused[name] = "answered"
    except openai.BadRequestError as e:
        refused[name] = e.body["message"]
out["refused"] = refused
print(json.dumps(out))
"#;
    let v = crate::support::python_json(script, &[&url]);
    let plain = &v["plain"];
    assert_eq!(plain["status"], "completed", "{v}");
    assert!(!plain["text"].as_str().unwrap().is_empty(), "{v}");
    let (usage, again) = (&plain["usage"], &plain["again"]);
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0, "{v}");
    assert!(
        again["input_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "the second sight of the instructions is read from the cache: {v}"
    );
    assert_eq!(again["output_tokens_details"]["reasoning_tokens"], 8, "{v}");
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap())
    );

    let types: Vec<&str> = v["types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(types.first(), Some(&"response.created"), "{types:?}");
    assert_eq!(types.last(), Some(&"response.completed"), "{types:?}");
    assert!(
        types
            .iter()
            .filter(|t| **t == "response.output_text.delta")
            .count()
            > 1,
        "{types:?}"
    );
    let seq: Vec<u64> = v["seq"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect();
    assert_eq!(seq, (0..seq.len() as u64).collect::<Vec<_>>());
    assert_eq!(
        v["deltas"], v["final"],
        "the deltas add up to the answer: {v}"
    );

    assert_eq!(v["call"]["name"], "lookup");
    assert_eq!(v["call"]["arguments"]["q"], "Find Oslo");
    assert!(!v["after_tool"].as_str().unwrap().is_empty(), "{v}");
    assert_eq!(v["streamed_args"][0], json!(r#"{"q":"Find Oslo"}"#), "{v}");

    assert_eq!(v["error"]["status"], 503, "{v}");
    assert_eq!(v["error"]["body"]["type"], "server_error", "{v}");
    let cut = &v["cut"];
    assert_eq!(
        cut["finished"], false,
        "a cut stream must not end cleanly: {v}"
    );
    assert!(
        !cut["seen"]
            .as_array()
            .unwrap()
            .contains(&json!("response.completed")),
        "{v}"
    );
    let broken = v["broken_args"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Value>(broken).is_err(),
        "a contract fault breaks the arguments: {broken}"
    );
    for field in ["previous_response_id", "tools.0.type"] {
        let why = v["refused"][field].as_str().unwrap();
        assert!(why.starts_with(field), "{field}: {why}");
    }
}
