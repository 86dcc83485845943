//! The one integration-test binary: the real `oam` binary, driven as a user would.
#![expect(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test that cannot go on should fail loudly, where it stands"
)]

mod agents;
mod architecture;
mod chaos;
mod cli;
mod cluster;
mod config;
mod embeddings;
mod gateway;
mod hosts;
mod mesh;
mod messages;
mod rehearse;
mod responses;
mod roles;
mod scenarios;
mod servers;
mod sim;
mod spend;
mod support;
mod tools;
mod watch;
