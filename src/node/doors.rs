//! HTTP of the doors for tools and agents: the Model Context Protocol at `POST /mcp`
//! (`api::mcp`) and Agent2Agent at `/a2a/{agent}` with its cards (`api::a2a`). Both list what
//! the tool catalog (`node::catalog`) holds, as far as the caller's key allows
//! (`[[client]] tools`), and run each call through the request path as `Asks::Tool`.

use super::Node;
use super::api::a2a;
use super::api::mcp::{self as door, Era, RpcAnswer, RpcRequest};
use super::api::rpc;
use super::catalog::Tool;
use super::config::Allowlist;
use super::http::{read_body, run, to_http, with_oam_headers};
use super::request::{Answer, Asks, authenticate};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

fn rpc(a: RpcAnswer) -> Response {
    match a.body {
        Some(body) => json_response(a.status, body),
        None => StatusCode::ACCEPTED.into_response(),
    }
}

/// A JSON body already written.
fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    let json = [(axum::http::header::CONTENT_TYPE, "application/json")];
    (status, json, body).into_response()
}

/// Who calls, by key: its tool list (none: every tool); or the 401 that refuses it.
fn caller<'a>(node: &'a Node, headers: &HeaderMap) -> Result<Option<Allowlist<'a>>, Box<Answer>> {
    let client = authenticate(node, headers)?;
    Ok(client.and_then(|id| node.cfg.tool_allowlist(id)))
}

/// The request's body and its caller's tool list; or the answer that refuses it.
async fn read_as_caller<'a>(
    node: &'a Arc<Node>,
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Result<(axum::body::Bytes, Option<Allowlist<'a>>), Box<Answer>> {
    let bytes = read_body(node, headers, body).await?;
    Ok((bytes, caller(node, headers)?))
}

fn allows(list: &Option<Allowlist<'_>>, name: &str) -> bool {
    list.as_ref().is_none_or(|a| a.allows(name))
}

/// Run `call` of `tool` through the request path: its `tools/call` result, and the headers
/// that say what was decided.
async fn call_tool(
    node: &Arc<Node>,
    headers: HeaderMap,
    call: &RpcRequest,
    tool: &Tool,
    list: &Option<Allowlist<'_>>,
) -> Result<(axum::body::Bytes, [String; 4]), Response> {
    let revision = list.as_ref().map(|a| a.revision.as_str());
    let body = door::call_body(call, tool, revision);
    let answer = run(node, body.into(), headers, Asks::Tool).await?;
    Ok((
        answer.body,
        [
            answer.phase,
            answer.reasons,
            answer.target,
            answer.request_id,
        ],
    ))
}

/// `POST /mcp`: one JSON-RPC request of the Model Context Protocol. A notification is
/// acknowledged (202).
pub(super) async fn mcp(
    State(node): State<Arc<Node>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    // A client held to a list of tools sees and calls only those; to it the others do not
    // exist.
    let (bytes, list) = match read_as_caller(&node, &headers, body).await {
        Ok(read) => read,
        Err(refused) => return to_http(*refused),
    };
    let call = match door::read(&bytes, &headers) {
        Err(refused) => return rpc(refused),
        Ok(None) => return StatusCode::ACCEPTED.into_response(),
        Ok(Some(call)) => call,
    };
    match call.method.as_str() {
        "tools/list" => {
            let (tools, _) = node.catalog.tools(&node).await;
            rpc(door::list_result(&call, &tools, |n| allows(&list, n)))
        }
        "tools/call" => {
            let name = call.params.name();
            let tool = match allows(&list, name) {
                true => node.catalog.find(&node, name).await,
                false => None,
            };
            // Unknown (or not allowed), changed, or arguments that do not fit: refused here.
            let refused = door::refuse_call(&call, tool.as_ref());
            let Some(tool) = tool.filter(|_| refused.is_none()) else {
                return rpc(refused.unwrap_or_else(|| door::result(&call, door::Empty {})));
            };
            match call_tool(&node, headers, &call, &tool, &list).await {
                Ok((result, said)) => with_oam_headers(rpc(door::passed_on(&call, &result)), said),
                Err(failed) => failed,
            }
        }
        _ => rpc(door::answer_plain(&call)),
    }
}

/// `/mcp` answers only POST: no stream of the server's own is offered.
pub(super) async fn not_mcp() -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        [(axum::http::header::ALLOW, "POST")],
        "the MCP door answers POST only (no server-initiated stream)\n",
    )
        .into_response()
}

/// The mesh agents offered over A2A to this caller: the tools of the `mesh = true` tool
/// servers that its list allows.
async fn offered(node: &Arc<Node>, list: &Option<Allowlist<'_>>) -> Vec<Tool> {
    let mesh: Vec<&str> = node
        .cfg
        .mcp_servers
        .iter()
        .filter(|s| s.mesh)
        .map(|s| s.id.as_str())
        .collect();
    if mesh.is_empty() {
        return Vec::new();
    }
    let (tools, _) = node.catalog.tools(node).await;
    tools
        .into_iter()
        .filter(|t| mesh.contains(&t.server.as_str()) && !t.changed)
        .filter(|t| allows(list, &t.public_name()))
        .collect()
}

fn as_offered(t: &Tool) -> a2a::Offered<'_> {
    a2a::Offered {
        agent: &t.name,
        description: t.definition.description(),
    }
}

/// `http://{host}`: where this node is reached, as the caller reached it.
fn base(headers: &HeaderMap) -> String {
    let host = super::api::header(headers, "host").unwrap_or("127.0.0.1");
    format!("http://{host}")
}

/// `GET /.well-known/agent-card.json`: the node's card, the offered agents as its skills.
pub(super) async fn node_card(State(node): State<Arc<Node>>, headers: HeaderMap) -> Response {
    let list = match caller(&node, &headers) {
        Ok(list) => list,
        Err(refused) => return to_http(*refused),
    };
    let tools = offered(&node, &list).await;
    let offered: Vec<a2a::Offered<'_>> = tools.iter().map(as_offered).collect();
    axum::Json(a2a::node_card(&base(&headers), &offered)).into_response()
}

/// `GET /a2a/{agent}/.well-known/agent-card.json`.
pub(super) async fn agent_card(
    State(node): State<Arc<Node>>,
    Path(agent): Path<String>,
    headers: HeaderMap,
) -> Response {
    let list = match caller(&node, &headers) {
        Ok(list) => list,
        Err(refused) => return to_http(*refused),
    };
    let tools = offered(&node, &list).await;
    match tools.iter().find(|t| t.name == agent) {
        Some(t) => axum::Json(a2a::agent_card(&base(&headers), &as_offered(t))).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            format!("no agent {agent:?} is offered here (see /.well-known/agent-card.json)\n"),
        )
            .into_response(),
    }
}

/// `POST /a2a`: the node's own interface names no agent; it says where they are.
pub(super) async fn a2a_unnamed(body: axum::body::Bytes) -> Response {
    let id = rpc::read(&body)
        .ok()
        .and_then(|m| m.id)
        .unwrap_or_else(rpc::no_id);
    let why = "send to an agent's own interface, POST /a2a/{agent} (the skills of \
               /.well-known/agent-card.json name them)";
    json_response(StatusCode::OK, a2a::error(&id, rpc::INVALID_PARAMS, why))
}

/// `POST /a2a/{agent}`: `SendMessage`, as one call of the agent through the request path.
pub(super) async fn a2a_send(
    State(node): State<Arc<Node>>,
    Path(agent): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let (bytes, list) = match read_as_caller(&node, &headers, body).await {
        Ok(read) => read,
        Err(refused) => return to_http(*refused),
    };
    let send = match a2a::read(&bytes, super::api::header(&headers, "a2a-version")) {
        Ok(send) => send,
        Err(refused) => return json_response(StatusCode::OK, refused),
    };
    let tools = offered(&node, &list).await;
    let Some(tool) = tools.into_iter().find(|t| t.name == agent) else {
        let why = format!("no agent {agent:?} is offered here");
        let answer = a2a::error(&send.id, rpc::INVALID_PARAMS, &why);
        return json_response(StatusCode::OK, answer);
    };
    let call = RpcRequest {
        id: send.id.clone(),
        method: "tools/call".into(),
        params: door::RpcParams {
            name: Some(tool.public_name()),
            arguments: Some(send.payload.clone()),
            protocol_version: None,
        },
        era: Era::Legacy,
    };
    if let Some(refused) = door::refuse_call(&call, Some(&tool)) {
        /// The result of a refusal's answer.
        #[derive(serde::Deserialize)]
        struct Refusal<'a> {
            #[serde(borrow)]
            result: Option<&'a serde_json::value::RawValue>,
        }
        let body = refused.body.unwrap_or_default();
        let result = serde_json::from_slice::<Refusal<'_>>(&body)
            .ok()
            .and_then(|r| r.result)
            .map_or(&b"{}"[..], |r| r.get().as_bytes());
        let answer = a2a::answer(&send, "refused", result);
        return json_response(StatusCode::OK, answer);
    }
    match call_tool(&node, headers, &call, &tool, &list).await {
        Ok((result, said)) => {
            let task_id = said[3].clone();
            let resp = json_response(StatusCode::OK, a2a::answer(&send, &task_id, &result));
            with_oam_headers(resp, said)
        }
        Err(failed) => failed,
    }
}
