//! Open Agent Mesh wire types: catalog and registry entries, error replies, heartbeats and death
//! notices, and the header names. Field names and shapes match the `openagentmesh` Python SDK
//! (0.2.0) so agents and callers of either side interoperate. Plain data, no I/O.

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub const H_REQUEST_ID: &str = "X-Mesh-Request-Id";
pub const H_STATUS: &str = "X-Mesh-Status";
pub(crate) const H_SOURCE: &str = "X-Mesh-Source";
pub const H_INSTANCE_ID: &str = "X-Mesh-Instance-Id";
pub(crate) const H_STREAM: &str = "X-Mesh-Stream";
pub const H_STREAM_SEQ: &str = "X-Mesh-Stream-Seq";
pub const H_STREAM_END: &str = "X-Mesh-Stream-End";
/// oam's extension: where the serving instance acknowledges receipt with its instance id, so the
/// caller can race the request against that instance's death. Other clients simply omit it.
pub(crate) const H_ACK_TO: &str = "X-Mesh-Ack-To";
/// oam's extension: where the stream's chunks go, an answer inbox of the caller's under the
/// agent's answerer token (instead of `mesh.stream.{request_id}`, which every client of the
/// SDK's kind may read and write), so only the serving instance and the caller see them, and
/// no other role writes there. Other clients omit it.
pub(crate) const H_STREAM_TO: &str = "X-Mesh-Stream-To";
/// The model use an agent reports for its answer (the SDK's usage attribution), a JSON object
/// on the reply (a stream's end frame): see `Usage`.
pub(crate) const H_USAGE: &str = "X-Mesh-Usage";

/// What `X-Mesh-Usage` carries, every field optional. Read leniently: what does not parse, or
/// a count or cost that is negative or not finite, is not reported.
#[derive(Deserialize, Serialize, Clone, PartialEq, Debug, Default)]
pub struct Usage {
    #[serde(default)]
    pub input_tokens: Option<u64>,
    #[serde(default)]
    pub output_tokens: Option<u64>,
    #[serde(default)]
    pub total_tokens: Option<u64>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub estimated_cost_usd: Option<f64>,
}

impl Usage {
    /// The header's value, if it says anything usable.
    pub fn parse(value: &str) -> Option<Usage> {
        let mut u: Usage = serde_json::from_str(value).ok()?;
        u.estimated_cost_usd = u.estimated_cost_usd.filter(|c| c.is_finite() && *c >= 0.0);
        u.model = u.model.filter(|m| !m.is_empty() && m.len() <= 200);
        (u != Usage::default()).then_some(u)
    }
}

/// Agent names: dot-separated segments of letters, digits, '-' and '_'.
pub(crate) fn valid_agent_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && name.split('.').all(|seg| {
            !seg.is_empty()
                && seg
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        })
}

/// One entry of the `catalog` key's JSON array in the `mesh-catalog` bucket.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct CatalogEntry {
    pub name: String,
    pub description: String,
    #[serde(default = "default_version")]
    pub version: String,
    #[serde(default)]
    pub tags: Vec<String>,
    #[serde(default = "yes")]
    pub invocable: bool,
    #[serde(default)]
    pub streaming: bool,
    /// oam's extension: the longest a handler may take; past it the caller hears `stuck`.
    /// (Other clients ignore the field.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_handling_ms: Option<u64>,
}

fn default_version() -> String {
    "0.1.0".into()
}
fn yes() -> bool {
    true
}

/// The contract stored under the agent's name in `mesh-registry`.
pub(crate) fn registry_entry(entry: &CatalogEntry, registered_at: &str) -> Value {
    serde_json::json!({
        "name": entry.name,
        "description": entry.description,
        "version": entry.version,
        "capabilities": {"streaming": entry.streaming, "invocable": entry.invocable},
        "skills": [{
            "id": entry.name,
            "name": entry.name,
            "description": entry.description,
            "tags": entry.tags,
        }],
        "x-agentmesh": {
            "subject": crate::transport::subjects::agent(&entry.name),
            "tags": entry.tags,
            "registered_at": registered_at,
            "max_handling_ms": entry.max_handling_ms,
        },
    })
}

/// Error codes in error replies.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The instance holding the request died.
    AgentDied,
    Timeout,
    /// Nobody serves this name and the catalog does not list it.
    NotFound,
    /// The catalog lists it but no instance answers.
    NotAvailable,
    InvalidInput,
    HandlerError,
    InvocationMismatch,
    /// The handler ran past the maximum handling time its agent declared.
    Stuck,
    /// Stream chunks arrived out of order (or one was lost).
    ChunkSequenceError,
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    /// Every code a peer can send (not `Unknown`, which stands for what this version does not
    /// know).
    pub const ALL: [ErrorCode; 9] = [
        ErrorCode::AgentDied,
        ErrorCode::Timeout,
        ErrorCode::NotFound,
        ErrorCode::NotAvailable,
        ErrorCode::InvalidInput,
        ErrorCode::HandlerError,
        ErrorCode::InvocationMismatch,
        ErrorCode::Stuck,
        ErrorCode::ChunkSequenceError,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::AgentDied => "agent_died",
            ErrorCode::Timeout => "timeout",
            ErrorCode::NotFound => "not_found",
            ErrorCode::NotAvailable => "not_available",
            ErrorCode::InvalidInput => "invalid_input",
            ErrorCode::HandlerError => "handler_error",
            ErrorCode::InvocationMismatch => "invocation_mismatch",
            ErrorCode::Stuck => "stuck",
            ErrorCode::ChunkSequenceError => "chunk_sequence_error",
            ErrorCode::Unknown => "unknown",
        }
    }
}

/// An error reply body: `{code, message, agent, request_id, details}`.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct MeshError {
    pub code: ErrorCode,
    pub message: String,
    #[serde(default)]
    pub agent: String,
    #[serde(default)]
    pub request_id: String,
    #[serde(default)]
    pub details: Value,
}

impl std::fmt::Display for MeshError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} from {}: {}",
            self.code.as_str(),
            self.agent,
            self.message
        )
    }
}

impl std::error::Error for MeshError {}

/// A serving instance's heartbeat on `mesh.health.{name}`.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub(crate) struct AgentHeartbeat {
    pub agent: String,
    pub instance_id: String,
    pub in_flight: u64,
    pub processed: u64,
    pub at_ms: u64,
    /// The connection it was sent on, `{server_id}/{client_id}` (oam hosts): a closed
    /// connection that is not this one is an old one, not the instance's death.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conn: Option<String>,
}

/// A connection's name in heartbeats: `{server_id}/{client_id}`.
pub(crate) fn conn_name(server_id: &str, client_id: u64) -> String {
    format!("{server_id}/{client_id}")
}

/// Why an agent is gone.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "snake_case")]
pub(crate) enum DeathReason {
    /// Its connection closed (crash, kill).
    Disconnect,
    /// It left on purpose.
    GracefulShutdown,
    /// It stopped heartbeating (frozen, partitioned).
    MissedHeartbeats,
    #[serde(other)]
    Other,
}

impl DeathReason {
    /// The reason as it travels.
    pub fn as_str(self) -> &'static str {
        match self {
            DeathReason::Disconnect => "disconnect",
            DeathReason::GracefulShutdown => "graceful_shutdown",
            DeathReason::MissedHeartbeats => "missed_heartbeats",
            DeathReason::Other => "other",
        }
    }
}

/// `mesh.death.{name}`: `{agent, reason, detected_at, instance_id}`.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub(crate) struct DeathNotice {
    pub agent: String,
    pub reason: DeathReason,
    /// RFC 3339, UTC.
    pub detected_at: String,
    pub instance_id: String,
    /// What the server said (e.g. "Client Closed", "Stale Connection", "Slow Consumer").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// oam's extension: `detected_at` in milliseconds since the epoch, so a caller fails only
    /// the calls it made before the death (a call made after it finds nobody, or a new
    /// instance). Other clients omit it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detected_at_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_sdk_rule() {
        assert!(valid_agent_name("demo.echo") && valid_agent_name("a-b_c.d9"));
        for bad in ["", ".a", "a.", "a..b", "a b", "a/b", "a.*"] {
            assert!(!valid_agent_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn wire_shapes_match_the_python_sdk() {
        let e: MeshError = serde_json::from_str(
            r#"{"code": "handler_error", "message": "kaboom", "agent": "demo.echo", "request_id": "ab", "details": {}}"#,
        )
        .unwrap();
        assert_eq!(e.code, ErrorCode::HandlerError);
        let odd: MeshError =
            serde_json::from_str(r#"{"code": "rate_limited", "message": "x"}"#).unwrap();
        assert_eq!(
            odd.code,
            ErrorCode::Unknown,
            "codes we do not know still parse"
        );
        let c: CatalogEntry = serde_json::from_str(
            r#"{"name": "echo", "description": "Echoes", "version": "0.1.0", "tags": [], "invocable": true, "streaming": false}"#,
        )
        .unwrap();
        let reg = registry_entry(&c, "2026-11-30T00:00:00+00:00");
        assert_eq!(
            reg["x-agentmesh"]["subject"],
            crate::transport::subjects::agent("echo")
        );
        assert_eq!(reg["capabilities"]["invocable"], true);
        let d = DeathNotice {
            agent: "echo".into(),
            reason: DeathReason::GracefulShutdown,
            detected_at: "t".into(),
            instance_id: "i".into(),
            detail: None,
            detected_at_ms: None,
        };
        assert_eq!(
            serde_json::to_value(&d).unwrap(),
            serde_json::json!({"agent": "echo", "reason": "graceful_shutdown", "detected_at": "t", "instance_id": "i"})
        );
    }

    proptest::proptest! {
        /// Every record read from the bus or a bucket (death notices, heartbeats, catalog
        /// entries, instance and escalation records) is decoded or refused from any bytes,
        /// without a panic; a name that decodes is checked before use.
        #[test]
        fn any_bytes_decode_or_are_refused(
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
            name in ".{0,40}",
        ) {
            let json = serde_json::json!({
                "agent": name, "name": name, "reason": name, "detected_at": name,
                "instance_id": name, "agents": [name], "ts": name,
            })
            .to_string();
            for bytes in [raw.as_slice(), json.as_bytes()] {
                let _ = serde_json::from_slice::<DeathNotice>(bytes);
                let _ = serde_json::from_slice::<AgentHeartbeat>(bytes);
                let _ = serde_json::from_slice::<Vec<CatalogEntry>>(bytes);
                let _ = serde_json::from_slice::<crate::mesh::store::InstanceRecord>(bytes);
                let _ = serde_json::from_slice::<crate::transport::store::escalations::EscalationRecord>(bytes);
                if let Ok(n) = serde_json::from_slice::<DeathNotice>(bytes) {
                    let _ = valid_agent_name(&n.agent);
                }
            }
        }
    }
}
