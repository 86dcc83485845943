//! Embeddings through a node: routed to embedding targets, priced, and held to one embedding per
//! input.

use crate::gateway::*;
use serde_json::{Value, json};

/// Two embedding targets (the simulator's `primary` and `local` answering embeddings), routed as
/// `embed`, beside the chat routes.
const EMBEDDINGS: &str = r#"
[[provider]]
id = "vectors"
base_url = "SIM/primary/v1"
model = "embed-large"
embeddings = true
probe = "off"
cost_per_1k_tokens_usd = 0.1

[[provider]]
id = "vectors-local"
base_url = "SIM/local/v1"
model = "embed-small"
embeddings = true
probe = "off"

[[route]]
model = "embed"
targets = ["vectors", "vectors-local"]
"#;

/// The official OpenAI SDK's `embeddings.create` through a node: routed, priced, falling back
/// when a target fails loudly (an error) or quietly (200 with one embedding short), and kept
/// apart from chat: `auto` embeds only on embedding targets and answers only on chat ones.
#[tokio::test]
async fn embeddings_are_routed_priced_and_checked_like_answers() {
    let g = gateway_with("embeddings", EMBEDDINGS).await;
    let script = r#"
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="not-needed", max_retries=0)
r = c.embeddings.create(model="embed", input=["tides in Brest", "tides in Calais"])
wide = c.embeddings.create(model="auto", input="one", dimensions=16)
print(json.dumps({"r": json.loads(r.to_json()), "dims": [len(d.embedding) for d in r.data],
                  "wide": len(wide.data[0].embedding), "wide_model": wide.model}))
"#;
    let v = crate::support::python_json(script, &[&g.url]);
    assert_eq!(v["dims"], json!([8, 8]), "{v}");
    assert_eq!(v["wide"], 16, "{v}");
    assert!(
        v["wide_model"].as_str().unwrap().starts_with("embed-"),
        "auto embeds on an embedding target: {v}"
    );
    let sent = g.received("primary").await;
    assert_eq!(sent[0]["model"], "embed-large");
    assert_eq!(
        sent[0]["input"],
        json!(["tides in Brest", "tides in Calais"])
    );

    let embed = |body: Value| {
        let url = format!("{}/v1/embeddings", g.url);
        async move {
            let r = client().post(url).json(&body).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (status, v) = embed(json!({"model": "embed", "input": "x".repeat(4_000)})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["oam"]["target"], "vectors", "{v}");
    let tokens = v["usage"]["prompt_tokens"].as_f64().unwrap();
    let cost = v["oam"]["cost_usd"].as_f64().unwrap();
    assert!(
        (cost - tokens * 0.1 / 1_000.0).abs() < 1e-9,
        "{cost} for {tokens} tokens: {v}"
    );

    for mode in [
        json!({"mode": "error", "status": 503}),
        json!({"mode": "contract", "kind": "missing-field"}),
    ] {
        g.clear().await;
        g.fault("primary", mode.clone()).await;
        let (status, v) = embed(json!({"model": "embed", "input": ["a", "b", "c"]})).await;
        assert_eq!(status, 200, "{mode}: {v}");
        assert_eq!(v["oam"]["target"], "vectors-local", "{mode}: {v}");
        assert_eq!(v["data"].as_array().unwrap().len(), 3, "{mode}: {v}");
        assert_eq!(tried(&v)[0], "vectors", "{mode}: {v}");
    }
    g.clear().await;

    // A chat request never lands on an embedding target, nor the reverse.
    let (status, v) = g.ask("embed", "answer me").await;
    assert_ne!(status, 200, "{v}");
    assert!(codes(&v).contains(&"MODEL_KIND_MISMATCH".into()), "{v}");
    let (status, v) = g.ask("auto", "answer me").await;
    assert_eq!(status, 200, "{v}");
    assert!(
        !v["oam"]["target"].as_str().unwrap().starts_with("vectors"),
        "{v}"
    );
    let (status, v) = embed(json!({"model": "small", "input": "x"})).await;
    assert_ne!(status, 200, "{v}");
    assert!(codes(&v).contains(&"MODEL_KIND_MISMATCH".into()), "{v}");

    // Bad input: a 400 naming the field, in OpenAI's envelope; nothing reaches a target.
    let before = g.received("primary").await.len();
    for (body, param) in [
        (json!({"model": "embed"}), "input"),
        (json!({"model": "embed", "input": []}), "input"),
        (json!({"model": "embed", "input": ["ok", 7]}), "input[1]"),
        (json!({"input": "x"}), "model"),
    ] {
        let (status, v) = embed(body.clone()).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    assert_eq!(g.received("primary").await.len(), before);
}
