//! `oam agent serve | call | stream | list | bench`: demo agents, calls and streams by name,
//! the catalog, and the liveness benchmark.

mod bench;
mod call;
mod list;
mod serve;

use crate::error::{Outcome, Result};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
    /// NATS URL (credentials may be in it). Default: $OAM_NATS_URL, then the local mesh in
    /// .oam/, then nats://127.0.0.1:4222.
    #[arg(long, global = true)]
    pub nats_url: Option<String>,
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

pub async fn run(a: Args) -> Result<Outcome> {
    let url = crate::local::resolve_url(a.nats_url.clone());
    match a.command {
        Command::Serve(s) => serve::run(&url, s).await.map(|()| Outcome::Ok),
        Command::Call(c) => call::call(&url, c).await,
        Command::Stream(c) => call::stream(&url, c).await,
        Command::List(l) => list::run(&url, l).await.map(|()| Outcome::Ok),
        Command::Bench(b) => bench::run(&url, b).await,
    }
}
