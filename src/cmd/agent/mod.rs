//! `oam agent serve | call | stream | list | bench`: demo agents, calls and streams by name,
//! the catalog, and the liveness benchmark.

mod bench;
mod call;
mod list;
mod serve;

use crate::error::{Findings, Result};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Serve a demo agent until SIGINT/SIGTERM.
    Serve(serve::Args),
    /// Call an agent by name and print its reply.
    Call(call::Args),
    /// Stream from an agent by name: one line per chunk as it arrives.
    Stream(call::Args),
    /// List the agents in the mesh catalog.
    List(list::Args),
    /// Measure liveness (SIGKILL/SIGSTOP to failure) and echo speed on a running mesh.
    Bench(bench::Args),
}

pub async fn run(a: Args) -> Result<Findings> {
    // Each checks its own arguments before it looks for the cluster.
    let cluster = &a.cluster;
    match a.command {
        Command::Serve(s) => serve::run(cluster, s).await.map(|()| Findings::Ok),
        Command::Call(c) => call::call(cluster, c).await,
        Command::Stream(c) => call::stream(cluster, c).await,
        Command::List(l) => list::run(cluster, l).await.map(|()| Findings::Ok),
        Command::Bench(b) => bench::run(cluster, b).await,
    }
}
