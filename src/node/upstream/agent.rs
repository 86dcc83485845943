//! A chat model served by an agent on the mesh (`agent = "name"`): the chat request is its
//! payload, a chat completion its answer, called with the fail-fast caller, so an agent that
//! dies holding a request ends that attempt with `agent_died` as soon as the monitor says so
//! (not at its timeout) and the request goes on to its fallback. An agent cannot stream: its
//! whole answer is replayed as a stream's events.
//!
//! `MeshTools` serves the mesh's agents as a tool server's tools (`[[mcp_server]] mesh = true`):
//! those whose catalog entry carries the tag `mcp`, each called with the tool's arguments as its
//! payload by the same fail-fast caller, so a tool call held by an agent that dies ends at once.

use super::super::exchange::Attempt;
use super::{ToolAsk, ToolListError, Upstream, UpstreamCall, chat, failed, listed};
use crate::core::request::GenerationStatus;
use crate::core::request::{AgentUsage, Generation};
use crate::mesh::client::Caller;
use crate::mesh::protocol::ErrorCode;
use crate::node::exchange::ToolDefinition;
use futures_util::future::BoxFuture;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The node's calls to mesh agents: one fail-fast caller (one subscription each for
/// acknowledgements and deaths) for every agent provider, made on the first call.
pub(crate) struct AgentCalls {
    nats: async_nats::Client,
    caller: tokio::sync::OnceCell<Caller>,
}

impl AgentCalls {
    pub(crate) fn new(nats: async_nats::Client) -> AgentCalls {
        AgentCalls {
            nats,
            caller: tokio::sync::OnceCell::new(),
        }
    }

    async fn caller(&self) -> Result<&Caller, crate::mesh::RunError> {
        self.caller
            .get_or_try_init(|| Caller::new(self.nats.clone()))
            .await
    }
}

pub(super) struct MeshAgent {
    name: String,
    calls: Arc<AgentCalls>,
}

impl MeshAgent {
    pub(super) fn new(name: &str, calls: Arc<AgentCalls>) -> MeshAgent {
        MeshAgent {
            name: name.to_string(),
            calls,
        }
    }
}

impl Upstream for MeshAgent {
    fn generate<'a>(&'a self, ask: UpstreamCall<'a>, timeout: Duration) -> BoxFuture<'a, Attempt> {
        Box::pin(async move {
            let started = Instant::now();
            let failed = |status, why| failed(status, why, started.elapsed().as_millis() as u64);
            let payload = match serde_json::to_vec(&chat::Body::whole(&ask)) {
                Ok(p) => p,
                Err(e) => {
                    let why = format!("cannot write the request: {e}");
                    return failed(GenerationStatus::Error, why);
                }
            };
            let caller = match self.calls.caller().await {
                Ok(caller) => caller,
                Err(e) => {
                    let why = format!("cannot watch the mesh for deaths: {e:#}");
                    return failed(GenerationStatus::Error, why);
                }
            };
            match caller
                .call_reporting(&self.name, payload.into(), timeout)
                .await
            {
                Ok((bytes, usage)) => {
                    let mut attempt =
                        chat::completion(&bytes, started.elapsed().as_millis() as u64);
                    attempt.generation.agent_usage = usage.map(|u| Box::new(charged(&u)));
                    attempt
                }
                Err(e) if e.code == ErrorCode::Timeout => {
                    failed(GenerationStatus::Timeout, e.to_string())
                }
                Err(e) => failed(GenerationStatus::Error, e.to_string()),
            }
        })
    }

    fn agent(&self) -> Option<&str> {
        Some(&self.name)
    }
}

/// What an agent reported (`X-Mesh-Usage`), priced: its own estimate, else its tokens at its
/// model's listed price (`data/prices.toml`), else nothing charged.
fn charged(u: &crate::mesh::protocol::Usage) -> AgentUsage {
    let listed = || {
        let price = super::super::prices::table().lookup(u.model.as_deref()?)?;
        let (input, output) = (u.input_tokens?, u.output_tokens.unwrap_or(0));
        Some(crate::core::request::round_usd(
            (input as f64 * price.input + output as f64 * price.output) / 1e6,
        ))
    };
    AgentUsage {
        input_tokens: u.input_tokens,
        output_tokens: u.output_tokens,
        model: u.model.clone(),
        usd: u.estimated_cost_usd.or_else(listed),
    }
}

/// The catalog tag that exposes an agent as a tool.
pub(crate) const TOOL_TAG: &str = "mcp";

pub(super) struct MeshTools {
    calls: Arc<AgentCalls>,
    mesh: tokio::sync::OnceCell<crate::mesh::store::Mesh>,
}

impl MeshTools {
    pub(super) fn new(calls: Arc<AgentCalls>) -> MeshTools {
        MeshTools {
            calls,
            mesh: tokio::sync::OnceCell::new(),
        }
    }

    /// The agents of the catalog that are tools, as tool definitions: any JSON object as their
    /// arguments, idempotent when tagged `idempotent`.
    async fn tools(&self, timeout: Duration) -> Result<Vec<ToolDefinition>, ToolListError> {
        let mesh = self
            .mesh
            .get_or_init(|| async { crate::mesh::store::Mesh::new(self.calls.nats.clone()) })
            .await;
        let read = crate::mesh::store::catalog(mesh);
        let catalog = match tokio::time::timeout(timeout, read).await {
            Err(_) => return Err(ToolListError::CatalogSilent(timeout)),
            Ok(Err(e)) => return Err(ToolListError::CatalogUnread(format!("{e:#}"))),
            Ok(Ok(c)) => c,
        };
        Ok(catalog
            .into_iter()
            .filter(|e| e.invocable && !e.streaming && e.tags.iter().any(|t| t == TOOL_TAG))
            .map(|e| {
                let idempotent = e.tags.iter().any(|t| t == "idempotent");
                ToolDefinition::of_agent(&e.name, &e.description, idempotent)
            })
            .collect())
    }
}

/// An agent's answer as a tool's result: its JSON as text, and as structured content when it is
/// an object.
fn tool_result(bytes: &[u8], latency_ms: u64) -> Attempt {
    let value: Value = serde_json::from_slice(bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into_owned()));
    let text = match &value {
        Value::String(s) => s.clone(),
        v => v.to_string(),
    };
    let mut result = json!({"content": [{"type": "text", "text": text}], "isError": false});
    if value.is_object() {
        result["structuredContent"] = value;
    }
    Attempt {
        generation: Generation::ok(&text, latency_ms),
        body: Some(super::super::exchange::Reply::Json(result)),
        http_status: 200,
    }
}

impl Upstream for MeshTools {
    fn generate<'a>(&'a self, ask: UpstreamCall<'a>, timeout: Duration) -> BoxFuture<'a, Attempt> {
        Box::pin(async move {
            let started = Instant::now();
            let ms = || started.elapsed().as_millis() as u64;
            let (agent, args) = match ToolAsk::of(&ask, ms()) {
                Ok(ToolAsk::Call(call)) => (call.name, call.arguments),
                Ok(ToolAsk::Probe) => return listed(self.tools(timeout).await, ms()),
                Err(refused) => return *refused,
            };
            let caller = match self.calls.caller().await {
                Ok(caller) => caller,
                Err(e) => {
                    let why = format!("cannot watch the mesh for deaths: {e:#}");
                    return failed(GenerationStatus::Error, why, ms());
                }
            };
            let payload = args.to_string().into_bytes();
            match caller.call_reporting(&agent, payload.into(), timeout).await {
                Ok((bytes, usage)) => {
                    let mut attempt = tool_result(&bytes, ms());
                    attempt.generation.agent_usage = usage.map(|u| Box::new(charged(&u)));
                    attempt
                }
                Err(e) if e.code == ErrorCode::Timeout => {
                    failed(GenerationStatus::Timeout, e.to_string(), ms())
                }
                Err(e) if e.code == ErrorCode::InvalidInput => {
                    failed(GenerationStatus::Rejected, e.to_string(), ms())
                }
                Err(e) => failed(GenerationStatus::Error, e.to_string(), ms()),
            }
        })
    }

    fn tool_list(
        &self,
        timeout: Duration,
    ) -> Option<BoxFuture<'_, Result<Vec<ToolDefinition>, ToolListError>>> {
        Some(Box::pin(self.tools(timeout)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::protocol::Usage;

    #[test]
    fn reported_use_is_charged_at_its_estimate_else_at_its_models_price() {
        let u = Usage::parse(
            r#"{"input_tokens": 1000000, "output_tokens": 100000, "model": "gpt-4o-mini"}"#,
        )
        .expect("usage");
        let c = charged(&u);
        // $0.15 per 1M in, $0.60 per 1M out (data/prices.toml).
        assert_eq!(c.usd, Some(0.21));
        let own = Usage {
            estimated_cost_usd: Some(0.5),
            ..u.clone()
        };
        assert_eq!(
            charged(&own).usd,
            Some(0.5),
            "the agent's own estimate wins"
        );
        let unlisted = Usage {
            model: Some("house-model".into()),
            ..u
        };
        assert_eq!(charged(&unlisted).usd, None);
        assert_eq!(charged(&unlisted).charged_usd(), 0.0);
    }

    #[test]
    fn a_usage_header_is_read_leniently() {
        assert_eq!(Usage::parse("not json"), None);
        assert_eq!(Usage::parse("{}"), None, "says nothing");
        let u = Usage::parse(r#"{"estimated_cost_usd": -1, "output_tokens": 5, "extra": 1}"#)
            .expect("the tokens stand");
        assert_eq!((u.estimated_cost_usd, u.output_tokens), (None, Some(5)));
        assert_eq!(Usage::parse(r#"{"input_tokens": -3}"#), None, "not a count");
    }
}
