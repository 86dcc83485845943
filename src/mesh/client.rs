//! Calling agents on the mesh: request/reply on `mesh.agent.{name}` with a request id, and every
//! failure turned into a `MeshError` with its code (no responders -> `not_found`, or
//! `not_available` when the catalog lists the agent; no answer in time -> `timeout`).

use super::protocol::{self, ErrorCode, MeshError};
use super::store;
use crate::transport::subjects;
use async_nats::HeaderMap;
use async_nats::client::RequestErrorKind;
use bytes::Bytes;
use std::time::Duration;

fn error(code: ErrorCode, agent: &str, request_id: &str, message: String) -> MeshError {
    MeshError {
        code,
        message,
        agent: agent.to_string(),
        request_id: request_id.to_string(),
        details: serde_json::Value::Object(Default::default()),
    }
}

/// Call `agent` with `payload`; the reply body on success.
pub async fn call(
    nats: &async_nats::Client,
    agent: &str,
    payload: Bytes,
    timeout: Duration,
) -> Result<Bytes, MeshError> {
    let request_id = crate::natsd::random_hex(16).unwrap_or_else(|_| "0".repeat(32));
    if !protocol::valid_agent_name(agent) {
        return Err(error(
            ErrorCode::InvalidInput,
            agent,
            &request_id,
            "agent names are dot-separated segments of letters, digits, '-' and '_'".into(),
        ));
    }
    let mut h = HeaderMap::new();
    h.insert(protocol::H_REQUEST_ID, request_id.as_str());
    let request = nats.request_with_headers(subjects::agent(agent), h, payload);
    let reply = match tokio::time::timeout(timeout, request).await {
        Err(_) => {
            return Err(error(
                ErrorCode::Timeout,
                agent,
                &request_id,
                format!("no answer within {} ms", timeout.as_millis()),
            ));
        }
        Ok(Err(e)) if e.kind() == RequestErrorKind::NoResponders => {
            let listed = store::catalog(nats)
                .await
                .unwrap_or_default()
                .iter()
                .any(|c| c.name == agent);
            let (code, message) = if listed {
                (
                    ErrorCode::NotAvailable,
                    format!("{agent} is in the catalog but no instance answers"),
                )
            } else {
                (
                    ErrorCode::NotFound,
                    format!("no agent named {agent} on the mesh"),
                )
            };
            return Err(error(code, agent, &request_id, message));
        }
        Ok(Err(e)) if e.kind() == RequestErrorKind::TimedOut => {
            return Err(error(
                ErrorCode::Timeout,
                agent,
                &request_id,
                format!("no answer: {e}"),
            ));
        }
        Ok(Err(e)) => {
            return Err(error(
                ErrorCode::Unknown,
                agent,
                &request_id,
                format!("the request failed: {e}"),
            ));
        }
        Ok(Ok(m)) => m,
    };
    let status = reply
        .headers
        .as_ref()
        .and_then(|h| h.get(protocol::H_STATUS))
        .map(|v| v.as_str().to_string());
    if status.as_deref() == Some("error") {
        return Err(serde_json::from_slice(&reply.payload).unwrap_or_else(|_| {
            error(
                ErrorCode::Unknown,
                agent,
                &request_id,
                String::from_utf8_lossy(&reply.payload).into_owned(),
            )
        }));
    }
    Ok(if reply.payload.is_empty() {
        Bytes::from_static(b"{}")
    } else {
        reply.payload
    })
}
