//! The agent mesh (Open Agent Mesh protocol on NATS): wire types, serving agents, calling them,
//! and the KV state they share.

pub mod census;
pub mod client;
pub mod host;
pub mod monitor;
pub mod protocol;
pub mod store;

/// Why an agent, a caller or the monitor could not start or go on (a call's own failure is a
/// `protocol::MeshError`, with its code).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// NATS refused or failed it (a connection, a subscription, a flush), as it said.
    #[error("{0}")]
    Bus(String),
    #[error(transparent)]
    Store(#[from] crate::transport::store::StoreError),
    #[error(transparent)]
    Random(#[from] crate::ids::NoRandomness),
}

said_as!(
    RunError::Bus:
    async_nats::ConnectError,
    async_nats::SubscribeError,
    async_nats::client::FlushError,
    async_nats::PublishError,
);
