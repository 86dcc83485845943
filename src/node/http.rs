//! HTTP in front of the request path: `POST /v1/chat/completions` (OpenAI-compatible),
//! `GET /v1/models`, the node's state and metrics, and the chaos restore an isolated node can
//! still hear. Every response carries `X-OAM-Phase`, `X-OAM-Reasons`, `X-OAM-Target` and
//! `X-Request-Id`.

use super::Node;
use super::detach::Detachable;
use super::openai::BadRequest;
use super::request::{Answer, authenticate, bad_request, execute};
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub fn router(node: Arc<Node>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/v1/oam/state", get(state))
        .route("/v1/oam/chaos", post(chaos))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        // The chat handler enforces node.max_body_bytes itself, with an OpenAI-style error.
        .layer(DefaultBodyLimit::disable())
        .with_state(node)
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

async fn state(State(node): State<Arc<Node>>) -> Response {
    axum::Json(super::status::snapshot(&node)).into_response()
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
/// model; and `auto`, scored routing across every target.
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
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

pub(crate) fn to_http(a: Answer) -> Response {
    let Answer {
        stream: _,
        live: _,
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
    resp
}

/// An accepted answer as OpenAI server-sent events. oam checks the whole answer (contract,
/// quality, cost) before releasing any of it, so the stream is the checked answer in one content
/// chunk, then the finish reason with usage and the `oam` object, then `[DONE]`.
pub(crate) fn to_sse(a: Answer) -> Response {
    let b: Value = serde_json::from_slice(&a.body).unwrap_or_default();
    let b = &b;
    let [first, mut last] = super::connector::chunks_of(b);
    last["usage"] = b["usage"].clone();
    last["oam"] = b["oam"].clone();
    let text = format!("data: {first}\n\ndata: {last}\n\ndata: [DONE]\n\n");
    let resp = (
        StatusCode::OK,
        [
            (axum::http::header::CONTENT_TYPE, "text/event-stream"),
            (axum::http::header::CACHE_CONTROL, "no-cache"),
        ],
        text,
    )
        .into_response();
    with_oam_headers(resp, [a.phase, a.reasons, a.target, a.request_id])
}

async fn chat(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let limit = node.cfg.node.max_body_bytes;
    let read = tokio::time::timeout(
        super::server::BODY_TIMEOUT,
        axum::body::to_bytes(body, limit),
    );
    match read.await {
        Ok(Ok(bytes)) => {
            // A caller that hangs up cancels nothing half-way: the pipeline moves to a task of
            // its own, is told the caller is gone, and ends cleanly (slot released, health
            // sample and decision kept).
            let caller = CancellationToken::new();
            let hung_up = caller.clone();
            let n = node.clone();
            let run = async move { execute(&n, &bytes, &headers, caller, true).await };
            let run = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(run));
            let Ok(answer) = Detachable::new(run, hung_up, node.serving.tasks.clone()).await else {
                tracing::error!("a request's pipeline panicked");
                return (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    axum::Json(super::openai::error_body(
                        "oam failed internally while serving this request; see the node's log",
                        "server_error",
                        None,
                        "internal_error",
                    )),
                )
                    .into_response();
            };
            if let Some(live) = answer.live {
                live
            } else if answer.status == StatusCode::OK && answer.stream {
                to_sse(answer)
            } else {
                to_http(answer)
            }
        }
        Ok(Err(_)) => to_http(too_large(&node, &headers)),
        Err(_) => {
            let mut a = bad_request(
                &node,
                &headers,
                BadRequest {
                    param: None,
                    message: format!(
                        "the request body did not arrive within {} s",
                        super::server::BODY_TIMEOUT.as_secs()
                    ),
                },
            );
            a.status = StatusCode::REQUEST_TIMEOUT;
            to_http(a)
        }
    }
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
            message: format!(
                "the request body is larger than this node accepts ({limit} bytes; \
                 node.max_body_bytes in oam.toml)"
            ),
        },
    );
    a.status = StatusCode::PAYLOAD_TOO_LARGE;
    a
}
