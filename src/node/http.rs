//! HTTP in front of the request path: `POST /v1/chat/completions` (OpenAI-compatible),
//! `POST /v1/messages` (Anthropic's Messages API), `POST /v1/responses` (OpenAI's Responses API),
//! `POST /v1/embeddings`,
//! `GET /v1/models`, the doors for tools and agents (`/mcp`, `/a2a`: `node::doors`), the node's
//! state and metrics, and the chaos restore an isolated node can
//! still hear. Every response carries `X-OAM-Phase`, `X-OAM-Reasons`, `X-OAM-Target` and
//! `X-Request-Id`.

use super::Node;
use super::api::openai::BadRequest;
use super::api::{self, ClientApi};
use super::detach::Detachable;
use super::request::{Answer, Asks, authenticate, bad_request, execute};
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use serde_json::{Value, json};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub(crate) fn router(node: Arc<Node>) -> Router {
    Router::new()
        .route("/v1/chat/completions", answers(&api::openai::Chat))
        .route("/v1/messages", answers(&api::anthropic::Messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/responses", answers(&api::responses::Responses))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route(
            "/mcp",
            post(super::doors::mcp).fallback(super::doors::not_mcp),
        )
        .route("/.well-known/agent-card.json", get(super::doors::node_card))
        .route("/a2a", post(super::doors::a2a_unnamed))
        .route("/a2a/{agent}", post(super::doors::a2a_send))
        .route(
            "/a2a/{agent}/.well-known/agent-card.json",
            get(super::doors::agent_card),
        )
        .route("/v1/oam/state", get(state))
        .route("/v1/oam/chaos", post(chaos))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        // The chat handler enforces node.max_body_bytes itself, with an OpenAI-style error.
        .layer(DefaultBodyLimit::disable())
        .with_state(node)
}

/// What a connection past `node.max_connections` is served (`server::OVERFLOW` of them at
/// once): the node's state, metrics and liveness as ever, and for anything else the refusal
/// `CONNECTION_LIMIT`, 503 with `Retry-After`, in the caller's API's error shape. The request's
/// body is read first and dropped (up to `node.max_body_bytes`, within 1 s): a socket closed on
/// unread bytes resets, and the caller would see the reset instead of the refusal.
pub(crate) fn overflow_router(node: Arc<Node>) -> Router {
    Router::new()
        .route("/v1/oam/state", get(state))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .fallback(at_connection_limit)
        .layer(DefaultBodyLimit::disable())
        .with_state(node)
}

async fn at_connection_limit(
    State(node): State<Arc<Node>>,
    uri: axum::http::Uri,
    body: axum::body::Body,
) -> Response {
    // Read and let go frame by frame: 64 spare callers sending a full body each hold no more
    // than a frame apiece.
    let limit = node.cfg.node.max_body_bytes;
    let drain = async {
        use http_body_util::BodyExt as _;
        let (mut body, mut read) = (body, 0);
        while read <= limit {
            match body.frame().await {
                Some(Ok(f)) => read += f.data_ref().map_or(0, bytes::Bytes::len),
                _ => break,
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), drain).await;
    node.serving
        .refused_at_connection_limit
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let code = crate::core::reason::ReasonCode::ConnectionLimit;
    let message = format!(
        "this node holds {} connections, each with a request in hand; retry after 1 s or on another node",
        node.cfg.node.max_connections
    );
    let body = if uri.path() == "/v1/messages" {
        json!({"type": "error", "error": {"type": "overloaded_error", "message": message}})
    } else {
        json!(super::api::openai::error_body(
            &message,
            "server_error",
            None,
            code.as_str()
        ))
    };
    // `with_oam_headers` adds the Retry-After of an admission refusal.
    let resp = (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    with_oam_headers(
        resp,
        [
            "admission".into(),
            code.as_str().into(),
            String::new(),
            node.serving.next_request_id(&node.id),
        ],
    )
}

/// `POST /v1/oam/chaos`: how an isolated node hears that its fault ended early. Only a
/// restore is accepted here; faults themselves come from the warden over NATS.
async fn chaos(State(node): State<Arc<Node>>, body: axum::body::Bytes) -> Response {
    match serde_json::from_slice::<crate::core::chaos::NodeCommand>(&body) {
        Ok(crate::core::chaos::NodeCommand::Restore { id, key })
            if node.bus.isolation_key_is(&id, &key) =>
        {
            node.chaos.apply(crate::core::chaos::NodeCommand::Restore { id, key });
            axum::Json(json!({"applied": true})).into_response()
        }
        Ok(crate::core::chaos::NodeCommand::Restore { .. }) => (
            StatusCode::FORBIDDEN,
            axum::Json(json!({"error": "a restore over HTTP ends only the isolation under way, and carries its key (from the warden); end faults with `oam chaos restore`"})),
        )
            .into_response(),
        Ok(_) => (
            StatusCode::FORBIDDEN,
            axum::Json(json!({"error": "only a restore is accepted over HTTP; inject faults with `oam chaos`"})),
        )
            .into_response(),
        Err(e) => (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"error": format!("not a chaos command: {e}")})),
        )
            .into_response(),
    }
}

/// `GET /v1/oam/state`: the node's snapshot. With `[[client]]` keys configured, a caller
/// without one of them gets it without what names a client (each agent's, team's and task's
/// budget, its limit and spend, and loop episodes): the cluster, targets, bulkheads and counters only.
async fn state(State(node): State<Arc<Node>>, headers: HeaderMap) -> Response {
    let mut s = super::status::snapshot(&node);
    let keyed = super::request::presented_key(&headers)
        .is_some_and(|key| node.cfg.client_with_key(key).is_some());
    if !node.cfg.client_keys.is_empty() && !keyed {
        s.budgets.agents.clear();
        s.budgets.teams.clear();
        s.budgets.tasks.clear();
        s.loops.clear();
    }
    axum::Json(s).into_response()
}

async fn metrics(State(node): State<Arc<Node>>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        node.metrics.registry.render(),
    )
        .into_response()
}

/// `GET /v1/models`: the model routes with their targets, or (with no routes) every target's
/// model; and `auto`, scored routing across every target. In Anthropic's shape when the
/// request carries `anthropic-version`.
async fn models(State(node): State<Arc<Node>>, headers: HeaderMap) -> Response {
    if let Err(a) = authenticate(&node, &headers) {
        return to_http(*a);
    }
    let entry = |id: &str, owned_by: &str, targets: Vec<&str>| json!({"id": id, "object": "model", "created": 0, "owned_by": owned_by, "oam": {"targets": targets}});
    let all: Vec<&str> = node.cfg.targets.iter().map(|t| t.id.as_str()).collect();
    let mut data: Vec<Value> = if node.cfg.routes.is_empty() {
        node.cfg
            .targets
            .iter()
            .map(|t| entry(&t.model, &format!("oam/{}", t.provider), vec![&t.id]))
            .collect()
    } else {
        node.cfg
            .routes
            .iter()
            .map(|r| {
                let targets = r.targets.iter().filter_map(|t| node.cfg.target(t));
                entry(&r.model, "oam", targets.map(|t| t.id.as_str()).collect())
            })
            .collect()
    };
    data.push(entry("auto", "oam", all));
    if headers.contains_key("anthropic-version") {
        // An Anthropic client lists models in its own shape (one page).
        return axum::Json(super::api::anthropic::models_of(&data)).into_response();
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

pub(crate) fn to_http(a: Answer) -> Response {
    let Answer {
        stream: _,
        live: _,
        buffered: _,
        native: _,
        status,
        body,
        request_id,
        phase,
        reasons,
        target,
    } = a;
    let json = [(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    )];
    let resp = (status, json, body).into_response();
    with_oam_headers(resp, [phase, reasons, target, request_id])
}

/// `X-OAM-Phase`, `X-OAM-Reasons`, `X-OAM-Target` and `X-Request-Id` on a response.
pub(crate) fn with_oam_headers(
    mut resp: Response,
    [phase, reasons, target, request_id]: [String; 4],
) -> Response {
    let status = resp.status();
    let phase_is_admission = phase == "admission";
    let h = resp.headers_mut();
    for (name, value) in [
        ("x-oam-phase", phase),
        ("x-oam-reasons", reasons),
        ("x-oam-target", target),
        ("x-request-id", request_id),
    ] {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(HeaderName::from_static(name), v);
        }
    }
    let reasons = h.get("x-oam-reasons").map(HeaderValue::as_bytes);
    let has = |code: &[u8]| reasons.is_some_and(|r| r.windows(code.len()).any(|w| w == code));
    // The official SDKs retry 408, 409, 429 and 5xx answers by themselves (twice by default)
    // unless `x-should-retry` says otherwise. oam has already retried and fallen back as its
    // policy says, so it tells them when a retry can help (and when: `Retry-After`) and when
    // it cannot (every target of the route down or failing: the same answer again, and billed
    // attempts).
    let retry = if has(b"RATE_LIMIT_EXCEEDED") {
        // Over a rate limit: when the window that admits it again opens.
        let ms = crate::core::rates::retry_after_ms(crate::clock::now_ms());
        Some(HeaderValue::from(ms.div_ceil(1_000)))
    } else if status == StatusCode::SERVICE_UNAVAILABLE
        && (phase_is_admission || has(b"LOCAL_RESOURCE_EXHAUSTED"))
    {
        // Full (a bulkhead, its queue) or short of descriptors: a moment later, or elsewhere.
        Some(HeaderValue::from_static("1"))
    } else {
        None
    };
    let should_retry = match retry {
        Some(after) => {
            h.insert(axum::http::header::RETRY_AFTER, after);
            Some("true")
        }
        None if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS => {
            Some("false")
        }
        None => None,
    };
    if let Some(v) = should_retry {
        h.insert(
            HeaderName::from_static("x-should-retry"),
            HeaderValue::from_static(v),
        );
    }
    resp
}

/// A stream that was checked whole before release says why (`X-OAM-Buffered: contract`), so
/// nobody takes one content chunk for broken streaming.
fn says_buffered(mut resp: Response, why: Option<&'static str>) -> Response {
    if let Some(why) = why {
        resp.headers_mut().insert(
            HeaderName::from_static("x-oam-buffered"),
            HeaderValue::from_static(why),
        );
    }
    resp
}

/// `POST /v1/messages/count_tokens`: the prompt tokens of a Messages request, estimated as the
/// engine prices them (`anthropic::count_tokens`); no target is called.
async fn count_tokens(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let headers = super::api::anthropic::chat_headers(&headers);
    let answer = match authenticate(&node, &headers) {
        Err(refused) => *refused,
        Ok(_) => match read_body(&node, &headers, body).await {
            Err(refused) => *refused,
            Ok(bytes) => match super::api::anthropic::count_tokens(&node.cfg, &bytes, &headers) {
                Ok(n) => return axum::Json(json!({"input_tokens": n})).into_response(),
                Err(e) => bad_request(&node, &headers, e),
            },
        },
    };
    let (text, events) = super::api::anthropic::answer_of(&answer, false);
    let text = bytes::Bytes::from(text);
    in_its_api(answer, text, events)
}

/// `POST /v1/embeddings`: routed to embedding targets with health, breakers, budgets and the
/// log (`embeddings`); the upstream's list with the `oam` object.
async fn embeddings(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let bytes = match read_body(&node, &headers, body).await {
        Ok(bytes) => bytes,
        Err(refused) => return to_http(*refused),
    };
    match run(&node, bytes, headers, Asks::Embeddings).await {
        Ok(answer) => to_http(answer),
        Err(failed) => failed,
    }
}

/// `POST` of one client API's requests (`api::ClientApi`): the same pipeline, headers and
/// limits for every API, each answer and error written in the API's own shapes.
fn answers(api: &'static dyn ClientApi) -> MethodRouter<Arc<Node>> {
    post(
        move |State(node): State<Arc<Node>>, headers: HeaderMap, body: axum::body::Body| {
            answer_in(api, node, headers, body)
        },
    )
}

async fn answer_in(
    api: &'static dyn ClientApi,
    node: Arc<Node>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let headers = api.headers(headers);
    let answer = match read_body(&node, &headers, body).await {
        Err(refused) => *refused,
        Ok(bytes) => {
            let asks = Asks::Answer { api, live: true };
            match run(&node, bytes, headers, asks).await {
                Ok(Answer {
                    live: Some(live), ..
                }) => return live,
                Ok(answer) => answer,
                Err(failed) => return failed,
            }
        }
    };
    let (body, events) = api.answer_of(&answer, answer.stream);
    in_its_api(answer, body, events)
}

/// `answer` written in its API's shape (`body`: events, or JSON), with its status and the
/// `X-OAM-*` headers; events say they are not to be cached, and why a stream was checked whole.
fn in_its_api(answer: Answer, body: bytes::Bytes, events: bool) -> Response {
    let kind = if events {
        "text/event-stream"
    } else {
        "application/json"
    };
    let mut resp = (
        answer.status,
        [(axum::http::header::CONTENT_TYPE, kind)],
        body,
    )
        .into_response();
    if events {
        resp.headers_mut().insert(
            axum::http::header::CACHE_CONTROL,
            HeaderValue::from_static("no-cache"),
        );
    }
    let resp = says_buffered(resp, answer.buffered.filter(|_| events));
    with_oam_headers(
        resp,
        [
            answer.phase,
            answer.reasons,
            answer.target,
            answer.request_id,
        ],
    )
}

/// The request body, read within `BODY_TIMEOUT` and `node.max_body_bytes`; else the 413 or 408
/// that says which.
pub(super) async fn read_body(
    node: &Arc<Node>,
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Result<axum::body::Bytes, Box<Answer>> {
    let limit = node.cfg.node.max_body_bytes;
    let read = tokio::time::timeout(
        super::server::BODY_TIMEOUT,
        axum::body::to_bytes(body, limit),
    );
    match read.await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(_)) => Err(Box::new(too_large(node, headers))),
        Err(_) => {
            let mut a = bad_request(
                node,
                headers,
                BadRequest {
                    param: None,
                    not_found: false,
                    message: format!(
                        "the request body did not arrive within {} s",
                        super::server::BODY_TIMEOUT.as_secs()
                    ),
                },
            );
            a.status = StatusCode::REQUEST_TIMEOUT;
            Err(Box::new(a))
        }
    }
}

/// Run the request path on `bytes`. A caller that hangs up cancels nothing half-way: the
/// pipeline moves to a task of its own, is told the caller is gone, and ends cleanly (slot
/// released, health sample and decision kept). A pipeline that panicked is a 500.
pub(super) async fn run(
    node: &Arc<Node>,
    bytes: axum::body::Bytes,
    headers: HeaderMap,
    asks: Asks,
) -> Result<Answer, Response> {
    let caller = CancellationToken::new();
    let hung_up = caller.clone();
    let n = node.clone();
    let run = async move { execute(&n, &bytes, &headers, caller, asks).await };
    let run = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(run));
    Detachable::new(run, hung_up, node.serving.tasks.clone())
        .await
        .map_err(|_| {
            tracing::error!("a request's pipeline panicked");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                axum::Json(super::api::openai::error_body(
                    "oam failed internally while serving this request; see the node's log",
                    "server_error",
                    None,
                    "internal_error",
                )),
            )
                .into_response()
        })
}

/// The answer to a body over `node.max_body_bytes` (HTTP and NATS alike): 413, no provider
/// called.
pub(crate) fn too_large(node: &Arc<Node>, headers: &HeaderMap) -> Answer {
    let limit = node.cfg.node.max_body_bytes;
    let mut a = bad_request(
        node,
        headers,
        BadRequest {
            param: None,
            not_found: false,
            message: format!(
                "the request body is larger than this node accepts ({limit} bytes; \
                 node.max_body_bytes in oam.toml)"
            ),
        },
    );
    a.status = StatusCode::PAYLOAD_TOO_LARGE;
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::chaos::NodeCommand;
    use crate::node::offline;

    async fn read(resp: Response) -> (StatusCode, HeaderMap, Value) {
        let (parts, body) = resp.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20).await.expect("a body");
        let v = serde_json::from_slice(&bytes)
            .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        (parts.status, parts.headers, v)
    }

    fn chaos_body(cmd: &NodeCommand) -> axum::body::Bytes {
        serde_json::to_vec(cmd).expect("JSON").into()
    }

    #[tokio::test]
    async fn over_http_only_the_isolations_own_restore_is_heard() {
        let node = offline::node().await;
        let until_ms = crate::clock::now_ms() + 60_000;
        let (id, key) = ("f1".to_string(), "k-from-the-warden".to_string());
        node.chaos.apply(NodeCommand::Isolate {
            id: id.clone(),
            until_ms,
            key: key.clone(),
        });
        assert!(node.bus.isolated());
        let post = |cmd: NodeCommand| chaos(State(node.clone()), chaos_body(&cmd));

        let (status, _, v) = read(chaos(State(node.clone()), "{nope".into()).await).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(
            v["error"]
                .as_str()
                .is_some_and(|e| e.starts_with("not a chaos command")),
            "{v}"
        );
        let inject = NodeCommand::DrainBudget {
            id: "f2".into(),
            agent: "a".into(),
            until_ms,
        };
        assert_eq!(read(post(inject).await).await.0, StatusCode::FORBIDDEN);
        for wrong in ["", "k-guessed"] {
            let restore = NodeCommand::Restore {
                id: id.clone(),
                key: wrong.into(),
            };
            assert_eq!(
                read(post(restore).await).await.0,
                StatusCode::FORBIDDEN,
                "{wrong:?}"
            );
            assert!(node.bus.isolated(), "a wrong key ends nothing");
        }
        let (status, _, v) = read(post(NodeCommand::Restore { id, key }).await).await;
        assert_eq!((status, &v), (StatusCode::OK, &json!({"applied": true})));
        assert!(!node.bus.isolated());
    }

    /// With client keys, the state says nothing that names a client to a caller without one:
    /// no client's budget (its limit and spend) and no loop episode; with a key, everything.
    #[tokio::test]
    async fn the_state_names_no_client_to_a_caller_without_a_key() {
        // SAFETY: set before the node reads it, in a variable no other test uses.
        unsafe { std::env::set_var("OAM_TEST_STATE_KEY", "a-key-of-sixteen-chars") };
        let (node, _) = offline::node_with(
            "[[client]]\nid = \"bob\"\nkey_env = \"OAM_TEST_STATE_KEY\"\n\n[budgets.agents.bob]\nlimit_usd = 5.0\n",
        )
        .await;
        let (_, _, open) = read(state(State(node.clone()), HeaderMap::new()).await).await;
        assert_eq!(open["budgets"]["agents"], json!({}), "{open}");
        assert!(open["providers"].is_array(), "{open}");
        let mut wrong = HeaderMap::new();
        wrong.insert(
            "authorization",
            "Bearer guessed-key-guessed".parse().expect("a header"),
        );
        let (_, _, guessed) = read(state(State(node.clone()), wrong).await).await;
        assert_eq!(guessed["budgets"]["agents"], json!({}), "{guessed}");
        let mut keyed = HeaderMap::new();
        keyed.insert(
            "authorization",
            "Bearer a-key-of-sixteen-chars".parse().expect("a header"),
        );
        let (_, _, full) = read(state(State(node), keyed).await).await;
        assert!(full["budgets"]["agents"]["bob"].is_object(), "{full}");
    }

    #[tokio::test]
    async fn models_list_routes_with_their_targets_and_auto_across_all() {
        // Without routes: every target's model, then auto.
        let (plain, _) = offline::node_with(
            "[[provider]]\nid = \"a\"\nbase_url = \"http://127.0.0.1:9/v1\"\nmodels = [\"m1\", \"m2\"]\nprobe = \"off\"\n",
        )
        .await;
        let (status, _, v) = read(models(State(plain.clone()), HeaderMap::new()).await).await;
        assert_eq!(status, StatusCode::OK);
        let data = v["data"].as_array().expect("a list");
        assert_eq!(data.len(), plain.cfg.targets.len() + 1, "{v}");
        for (entry, t) in data.iter().zip(&plain.cfg.targets) {
            assert_eq!(entry["id"].as_str(), Some(t.model.as_str()));
            assert_eq!(entry["oam"]["targets"], json!([t.id]));
        }
        let auto = data.last().expect("auto");
        assert_eq!(auto["id"], "auto");
        assert_eq!(
            auto["oam"]["targets"].as_array().map(Vec::len),
            Some(plain.cfg.targets.len())
        );
        // The simulator's configuration: its route `json`, then auto.
        let node = offline::node().await;
        let (_, _, v) = read(models(State(node.clone()), HeaderMap::new()).await).await;
        assert_eq!(v["data"][0]["id"], "json", "{v}");
        assert_eq!(v["data"][1]["id"], "auto", "{v}");

        // With routes: each route's model with its targets, in the route's order.
        let ids: Vec<&str> = node.cfg.targets.iter().map(|t| t.id.as_str()).collect();
        let routed = format!(
            "[[route]]\nmodel = \"fast\"\ntargets = [\"{}\", \"{}\"]\n",
            ids[1], ids[0]
        );
        let (routed, _) = offline::node_with(&routed).await;
        let (_, _, v) = read(models(State(routed), HeaderMap::new()).await).await;
        assert_eq!(v["data"][0]["id"], "fast");
        assert_eq!(v["data"][0]["oam"]["targets"], json!([ids[1], ids[0]]));
        assert_eq!(
            v["data"][1]["id"], "json",
            "the simulator's own route follows"
        );
        assert_eq!(v["data"][2]["id"], "auto");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_413_before_any_target_is_called() {
        let (node, _) = offline::node_with("[node]\nmax_body_bytes = 64\n").await;
        let body = axum::body::Body::from(vec![b' '; 65]);
        let mut h = HeaderMap::new();
        h.insert("x-request-id", HeaderValue::from_static("big-1"));
        let served = answer_in(&api::openai::Chat, node.clone(), h, body).await;
        let (status, headers, v) = read(served).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("64 bytes") && message.contains("node.max_body_bytes"),
            "{v}"
        );
        assert_eq!(headers["x-request-id"], "big-1");
        assert_eq!(headers["x-oam-phase"], "invalid");
        assert_eq!(node.pipeline.read().state.bulkheads.normal.active, 0);
    }

    #[tokio::test]
    async fn an_accepted_answer_streams_as_events_and_headers_that_cannot_be_sent_are_left_out() {
        let answer = json!({
            "id": "c1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "oam": {"request_id": "r1"}
        });
        let a = Answer {
            stream: true,
            live: None,
            buffered: None,
            native: false,
            status: StatusCode::OK,
            body: serde_json::to_vec(&answer).expect("JSON").into(),
            request_id: "r1".into(),
            phase: "accepted".into(),
            reasons: String::new(),
            target: "bad\nname".into(),
        };
        let (body, events) = api::openai::Chat.answer_of(&a, true);
        let (status, headers, v) = read(in_its_api(a, body, events)).await;
        assert_eq!(headers["cache-control"], "no-cache");
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers["content-type"], "text/event-stream");
        assert_eq!(
            (&headers["x-request-id"], &headers["x-oam-phase"]),
            (
                &HeaderValue::from_static("r1"),
                &HeaderValue::from_static("accepted")
            )
        );
        assert!(
            !headers.contains_key("x-oam-target"),
            "a value with a newline is no header"
        );
        let text = v.as_str().expect("not JSON: events");
        let body = answer.to_string();
        let answer = crate::node::exchange::read_completion(&body).expect("a completion");
        assert_eq!(text, crate::node::api::openai::sse_of(&answer));
    }
}
