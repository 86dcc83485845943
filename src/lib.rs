//! oam: a reliability, liveness and attention control plane for AI agents.
//!
//! The layering, checked by `tests/it/architecture.rs` against its table of allowed edges (a
//! DAG; the runtimes use each other only where listed, and only the commands that run a node
//! use `node`):
//!
//! ```text
//! core <- {clock, ids, http, error, signal} <- transport <- mesh <- {local, node}
//!                                                          sim  <- chaos (with bench, mesh)
//!                              transport, local, mesh <- bench; core, mesh, transport <- tui
//!                                                  everything <- cmd <- cli
//! ```
//!
//! - `core`: the pure decision logic and the wire types (no runtime, bus, file or clock).
//! - `clock`, `ids`, `http`, `error`, `signal`: small shared helpers (wall clock, random ids,
//!   the HTTP client and SSE codec, exit kinds, the stop signals).
//! - `transport`: NATS (connecting, subject names, every JetStream store, the chaos warden's
//!   client).
//! - `local`: a cluster on this machine (state folder, nats-server, starting and stopping; a
//!   private mesh in one call).
//! - `mesh`: the agent mesh (Open Agent Mesh hosts, callers, the liveness monitor).
//! - `sim`: the provider simulator. `node`: the gateway runtime around `core`.
//! - `bench`: load, scenarios and their runner. `chaos`: the chaos warden.
//! - `tui`: the live view's model and rendering (`oam watch`). `cmd`: one module per
//!   subcommand (arguments and glue, no decisions); `cli`: the top-level parser.

/// `From` each listed error for a variant of an error enum that holds what the error says (its
/// text, its sources' included): `said_as!(StoreError::Failed: kv::EntryError, kv::PutError)`.
macro_rules! said_as {
    ($target:ident :: $variant:ident : $($t:ty),* $(,)?) => {
        $(impl From<$t> for $target {
            fn from(e: $t) -> Self {
                $target::$variant(e.to_string())
            }
        })*
    };
}

pub mod bench;
pub mod chaos;
pub mod cli;
pub mod clock;
pub mod cmd;
pub mod core;
pub mod error;
pub mod http;
pub mod ids;
pub mod local;
pub mod mesh;
pub mod node;
pub mod signal;
pub mod sim;
pub mod transport;
pub mod tui;
