//! `oam mesh up | init | down | status | monitor`: a whole local cluster in one command (nats-server,
//! the simulator, N nodes, the monitor, the chaos warden), recorded in one state folder, stopped
//! by exactly the recorded PIDs. The work is `crate::local::cluster`'s; these are its commands.

use crate::error::Findings;

mod down;
mod init;
mod monitor;
mod status;
mod up;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Start nats-server, the provider simulator and N nodes on 127.0.0.1 (or, with --hosts,
    /// this host's part of a mesh across hosts).
    Up(up::Args),
    /// Make the passwords and TLS certificates every host of a mesh across hosts shares.
    Init(init::Args),
    /// Stop exactly what `oam mesh up` started (newest first, SIGTERM then SIGKILL).
    Down(down::Args),
    /// Show what is running and healthy.
    Status(status::Args),
    /// The liveness monitor: connection drops and missed heartbeats become death notices.
    Monitor(monitor::Args),
}

pub async fn run(args: Args) -> crate::error::Result<Findings> {
    let done = |()| Findings::Ok;
    match args.command {
        Command::Up(a) => up::run(a).await.map(done),
        Command::Down(a) => down::run(a).await.map(done),
        Command::Init(a) => init::run(a).await.map(done),
        Command::Status(a) => status::run(a).await,
        Command::Monitor(a) => monitor::run(a).await.map(done),
    }
}
