//! One full decision: admission, fingerprint of a 1 KB message, consensus and scoring over three
//! providers, breaker, contract check of the answer, budget settlement, decision assembly.
//! And what each client API's own code costs one small request (`api/...`): the body decoded,
//! the chat completion the pipeline accepted written as that API's answer.

#![expect(
    clippy::expect_used,
    reason = "a benchmark's fixed inputs are valid, or it should stop"
)]

use criterion::{Criterion, criterion_group, criterion_main};
use oam::core::health::Verdict;
use oam::core::pipeline::{Config, Engine, State, Step};
use oam::core::quorum::{Cluster, Observation};
use oam::core::request::{Generation, Message, Policy, Priority, Request, Risk};
use std::hint::black_box;

const NOW: u64 = 1_764_460_800_000;

fn engine() -> Engine {
    let mut cluster = Cluster::new("n1", 3);
    for node in ["n1", "n2", "n3"] {
        cluster.heartbeat(node, NOW);
        for provider in ["primary", "local", "secondary"] {
            cluster.observe(Observation {
                node: node.into(),
                provider: provider.into(),
                at_ms: NOW,
                verdict: Verdict::Healthy,
                availability: 1.0,
                contract_failure_pct: 0.0,
                p95_ms: 190,
                samples: 15,
                evidence: oam::core::health::Evidence::Traffic,
                own: Default::default(),
            });
        }
    }
    Engine::new(
        Config::default(),
        State {
            cluster: cluster.into(),
            ..State::default()
        },
    )
}

fn request() -> Request {
    Request {
        id: "bench".into(),
        agent: "agent".into(),
        task: "summarise".into(),
        team: None,
        model: Some("gpt".into()),
        messages: vec![Message {
            role: "user".into(),
            content: "x".repeat(1024),
        }],
        risk: Risk::Low,
        priority: Priority::Normal,
        idempotent: true,
        latency_budget_ms: None,
        max_cost_usd: None,
        max_tokens: None,
        n: 1,
        policy: Policy::default(),
        contract: None,
        response_format: None,
        tools: Default::default(),
        bound_to: None,
        tool_allowlist: None,
        embeddings: false,
        stream: false,
    }
}

/// The small request of `scripts/bench-gateway` in each API, and a completion as the
/// simulator's zero-latency provider answers it, the `oam` object in.
fn apis(c: &mut Criterion) {
    let chat = br#"{"model": "auto", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}"#;
    let responses = br#"{"model": "auto", "input": "hello", "max_output_tokens": 16}"#;
    let completion = bytes::Bytes::from_static(
        br#"{"id":"chatcmpl-7","object":"chat.completion","created":1764460800,"model":"sim-zero","choices":[{"index":0,"message":{"role":"assistant","content":"hello from the simulator"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":5,"total_tokens":14},"oam":{"agent":"anonymous","attempts":1,"cost_usd":0.0,"fallback":false,"outcome":"accepted","phase":"accepted","provider":"sim-zero","reason_codes":[],"request_id":"bench","served_by":["sim-zero"]}}"#,
    );
    for (api, body) in [
        ("chat", &chat[..]),
        ("messages", &chat[..]),
        ("responses", &responses[..]),
    ] {
        assert!(
            oam::node::translated(api, body, &completion) > 0,
            "{api} takes the bench's request"
        );
        c.bench_function(&format!("api/{api}"), |b| {
            b.iter(|| oam::node::translated(api, black_box(body), &completion));
        });
    }
}

fn bench(c: &mut Criterion) {
    let mut e = engine();
    let answer = Generation::ok(r#"{"answer":"42","confidence":0.9}"#, 180);
    // The request goes round: each decision hands it back through its session, so the loop
    // measures deciding, not allocating and freeing a 1 KB message.
    let mut spare = Some(request());
    c.bench_function("decide/3-providers-1KB", |b| {
        b.iter(|| {
            let r = spare
                .take()
                .expect("request returned by the last iteration");
            let (mut s, step) = e.begin(r, NOW).expect("valid");
            let Step::Dispatch(_) = step else {
                panic!("expected a dispatch")
            };
            let Step::Done(d) = e.complete(&mut s, answer.clone(), NOW + 180) else {
                panic!("expected a decision")
            };
            spare = Some(s.into_request());
            black_box(d)
        });
    });
}

/// The same decision for a request that declares `n` tools (each a small object schema, as
/// agents send them): what declared tools add to a decision, with their schemas compiled once.
fn with_tools(c: &mut Criterion) {
    for n in [20, 128] {
        let mut e = engine();
        let answer = Generation::ok(r#"{"answer":"42","confidence":0.9}"#, 180);
        let mut r = request();
        r.tools = std::sync::Arc::new(
            (0..n)
                .map(|i| {
                    let schema = serde_json::json!({"type": "object", "required": ["q"],
                    "properties": {"q": {"type": "string"}, "limit": {"type": "integer"},
                                   "tags": {"type": "array", "items": {"type": "string"}}}});
                    (format!("tool_{i}"), schema)
                })
                .collect(),
        );
        let mut spare = Some(r);
        c.bench_function(&format!("decide/{n}-tools"), |b| {
            b.iter(|| {
                let r = spare
                    .take()
                    .expect("request returned by the last iteration");
                let (mut s, _) = e.begin(r, NOW).expect("valid");
                let Step::Done(d) = e.complete(&mut s, answer.clone(), NOW + 180) else {
                    panic!("expected a decision")
                };
                spare = Some(s.into_request());
                black_box(d)
            });
        });
    }
}

/// One decision as a node records it for the decision log (`Recorder`: the state `begin` saw,
/// each call's state as it differs).
fn record(e: &mut Engine, r: &Request, answer: &Generation) -> oam::core::record::Record {
    use oam::core::record::{Call, Recorder};
    let mut rec = Recorder::begin(e, r, NOW);
    let (mut s, _) = e.begin(r.clone(), NOW).expect("valid");
    let call = Call::Complete {
        generation: answer.clone(),
    };
    rec.call(e, &call, NOW + 180);
    let Some(Step::Done(d)) = e.apply(&mut s, call, NOW + 180) else {
        panic!("expected a decision")
    };
    rec.finish(std::sync::Arc::new(oam::core::record::Decided::new(*d)))
}

/// The decision above, recorded; then the record encoded as the log writes it.
fn recorded(c: &mut Criterion) {
    let mut e = engine();
    let answer = Generation::ok(r#"{"answer":"42","confidence":0.9}"#, 180);
    let r = request();
    c.bench_function("decide/recorded", |b| {
        b.iter(|| black_box(record(&mut e, &r, &answer)));
    });
    let record = record(&mut e, &r, &answer);
    // Each time with its decision not yet written (a record's decision is written once, and
    // the live stream usually writes it first).
    c.bench_function("record/encode", |b| {
        b.iter_batched(
            || {
                let mut r = record.clone();
                r.decision = std::sync::Arc::new(oam::core::record::Decided::new(
                    (**record.decision).clone(),
                ));
                r
            },
            |r| black_box(serde_json::to_vec(&r).expect("encodes")),
            criterion::BatchSize::SmallInput,
        );
    });
}

criterion_group!(benches, bench, with_tools, recorded, apis);
criterion_main!(benches);
