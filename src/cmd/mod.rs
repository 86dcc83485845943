//! One module per subcommand: its clap `Args` and its `run`. Glue only; decisions live in `core`.

pub mod agent;
pub mod agent_bench;
pub mod bench;
pub mod bench_scenario;
pub mod chaos;
pub mod decide;
pub mod demo;
pub mod escalation;
pub mod listen;
pub mod mesh;
pub mod node;
pub mod reasons;
pub mod sim;
pub mod watch;

use crate::error::{Error, Kind, Result};
use crate::transport::connect;

/// Connect to NATS for a command, or say what to do: the one place that message is written.
/// With `wait_for_server`, a server that is not up yet is retried in the background.
pub(crate) async fn nats(
    url: &str,
    name: &str,
    wait_for_server: bool,
) -> Result<async_nats::Client> {
    connect::connect(url, name, wait_for_server)
        .await
        .map_err(|e| {
            Error::new(
                Kind::Unreachable,
                anyhow::anyhow!(
                    "cannot reach NATS at {} ({e}). Start a local mesh with `oam mesh up`, \
                 or pass --nats-url",
                    connect::redact(url)
                ),
            )
        })
}
