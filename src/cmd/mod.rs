//! One module per subcommand: its clap `Args` and its `run`. Glue only; decisions live in `core`.

pub mod agent;
pub mod bench;
pub mod chaos;
pub mod completions;
pub mod decide;
pub mod demo;
pub mod escalation;
pub mod listen;
pub mod man;
pub mod mesh;
pub mod node;
pub mod reasons;
pub mod sim;
pub mod watch;
