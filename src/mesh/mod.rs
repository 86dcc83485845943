//! The agent mesh (Open Agent Mesh protocol on NATS): wire types, serving agents, calling them,
//! and the KV state they share.

pub mod census;
pub mod client;
pub mod host;
pub mod monitor;
pub mod protocol;
pub mod store;
