//! oam: a reliability, liveness and attention control plane for AI agents.
//!
//! `core` holds the pure decision logic; `sim` the provider simulator; `cmd` holds one module per subcommand (argument parsing
//! and glue, no decisions); `cli` is the top-level parser; `error` decides exit codes.

pub mod bench;
pub mod chaos;
pub mod cli;
pub mod cmd;
pub mod core;
pub mod error;
pub mod escalations;
pub mod localmesh;
pub mod mesh;
pub mod natsd;
pub mod node;
pub mod scenario;
pub mod signal;
pub mod sim;
pub mod transport;
pub mod watch;
