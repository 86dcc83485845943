//! A chat model served by an agent on the mesh (`agent = "name"`): the chat request is its
//! payload, a chat completion its answer, called with the fail-fast caller, so an agent that
//! dies holding a request ends that attempt with `agent_died` as soon as the monitor says so
//! (not at its timeout) and the request goes on to its fallback. An agent cannot stream: its
//! whole answer is replayed as a stream's events.

use super::super::exchange::{Attempt, Passthrough};
use super::{Opened, Upstream, UpstreamCall, chat, failed};
use crate::core::request::GenerationStatus;
use crate::mesh::client::Caller;
use crate::mesh::protocol::ErrorCode;
use futures_util::future::BoxFuture;
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

    async fn caller(&self) -> anyhow::Result<&Caller> {
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
            match caller.call(&self.name, payload.into(), timeout).await {
                Ok(bytes) => chat::completion(&bytes, started.elapsed().as_millis() as u64),
                Err(e) if e.code == ErrorCode::Timeout => {
                    failed(GenerationStatus::Timeout, e.to_string())
                }
                Err(e) => failed(GenerationStatus::Error, e.to_string()),
            }
        })
    }

    fn open_stream<'a>(
        &'a self,
        model: &'a str,
        pass: &'a Passthrough,
        _prefill: Option<&'a str>,
        max_tokens: u32,
        first_event: Duration,
    ) -> BoxFuture<'a, Opened> {
        Box::pin(async move {
            let started = Instant::now();
            let ask = UpstreamCall {
                model,
                pass: Some(pass),
                messages: &[],
                max_tokens,
                response_format: None,
            };
            let a = self.generate(ask, first_event).await;
            Opened::whole(a, pass.include_usage, started)
        })
    }

    fn agent(&self) -> Option<&str> {
        Some(&self.name)
    }
}
