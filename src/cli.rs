//! The command line: the top-level parser and the dispatch to `cmd::*`.

use crate::cmd;
use crate::error::{Findings, Result};
use clap::{Parser, Subcommand};

/// oam: reliability, liveness and attention control for AI agents.
///
/// Every decision oam makes carries machine-readable reason codes; `oam reasons` lists them.
#[derive(Parser, Debug)]
#[command(name = "oam", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// In the order a user meets them: the demo and a local mesh first, then watching, breaking and
/// explaining it, then the tools of a running deployment, then the parts and the plumbing.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// The whole story in one command: a local mesh, the headline failure scenarios with
    /// verdicts, a summary, and everything stopped again.
    Demo(cmd::demo::Args),
    /// A local cluster in one command: `oam mesh up`, `oam mesh status`, `oam mesh down`.
    Mesh(cmd::mesh::Args),
    /// A live terminal view of the whole mesh: quorum, breakers, bulkheads, agents and the
    /// reason-code stream, with chaos at a key.
    Watch(cmd::watch::Args),
    /// Inject a failure that restores itself: `oam chaos kill-provider primary --for 30s`.
    Chaos(cmd::chaos::Args),
    /// Why was request X decided so? Its record from the decision log, replayed through the
    /// core and told step by step (exit 1 if the replay differs).
    Explain(cmd::explain::Args),
    /// The decision log: list and filter decisions (agent, reason code, outcome, time range);
    /// `--verify` replays each.
    Audit(cmd::audit::Args),
    /// What a candidate configuration would have changed: the decision log's window decided
    /// again under it (`oam rehearse candidate.toml --since 24h`).
    Rehearse(cmd::rehearse::Args),
    /// Bounded load against the nodes (HTTP or NATS), or a scenario: load, chaos and expectations.
    Bench(cmd::bench::Args),
    /// Agents on the mesh: `oam agent serve NAME --demo echo`, `oam agent call NAME`, `oam agent list`.
    Agent(cmd::agent::Args),
    /// The cluster's shared budgets: `oam budget list`, `oam budget set AGENT --limit 5`.
    Budget(cmd::budget::Args),
    /// The cluster's books: the ledger beside the decision log's charges, per budget and node
    /// run; `--verify` exits 1 naming any request answered and not charged, or charged twice;
    /// `--settle` charges what the runs of nodes that are gone answered and did not settle.
    Spend(cmd::spend::Args),
    /// What waits for a human: `oam escalation list`, `oam escalation resolve ID --note ...`.
    Escalation(cmd::escalation::Args),
    /// The mesh's NATS users, one per role: `oam creds issue --role agent --name X`.
    Creds(cmd::creds::Args),
    /// The nodes' configuration: `oam config check oam.toml` validates it without starting
    /// anything.
    Config(cmd::config::Args),
    /// Control-plane nodes: `oam node run --id n1`.
    Node(cmd::node::Args),
    /// Serve simulated model providers over an OpenAI-compatible HTTP API, with fault modes.
    Sim(cmd::sim::Args),
    /// Print what arrives on a NATS subject, e.g. `oam listen 'mesh.death.>'`.
    Listen(cmd::listen::Args),
    /// Run the decision pipeline on a recorded input and print the decision as JSON.
    Decide(cmd::decide::Args),
    /// List every reason code with its phase and meaning.
    Reasons(cmd::reasons::Args),
    /// A shell completion script on stdout: `oam completions bash|zsh|fish|elvish|powershell`.
    Completions(cmd::completions::Args),
    /// The manual page on stdout (`oam man | man -l -`), or every page into a folder.
    Man(cmd::man::Args),
}

impl Cli {
    /// The runtime's worker threads the command asks for (`oam node run --worker-threads`);
    /// `None`: tokio's default.
    pub fn worker_threads(&self) -> Option<usize> {
        match &self.command {
            Command::Node(args) => args.worker_threads(),
            _ => None,
        }
    }

    /// Parse the command line, or the exit code after clap printed why not (help and version
    /// exit 0). An unknown subcommand (e.g. a fault `oam chaos` does not know) is answered with
    /// the valid ones.
    pub fn parse_args() -> Result<Cli, std::process::ExitCode> {
        Cli::try_parse().map_err(|e| {
            let _ = e.print();
            if e.kind() == clap::error::ErrorKind::InvalidSubcommand {
                let valid = valid_subcommands(std::env::args().skip(1));
                eprintln!("\nvalid here: {}", valid.join(", "));
            }
            std::process::ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2))
        })
    }
}

/// The subcommands of the deepest command named in `args`.
fn valid_subcommands(args: impl Iterator<Item = String>) -> Vec<String> {
    use clap::CommandFactory;
    let root = Cli::command();
    let mut cur = &root;
    for a in args {
        match cur.find_subcommand(&a) {
            Some(sub) => cur = sub,
            None if a.starts_with('-') => continue,
            None => break,
        }
    }
    cur.get_subcommands()
        .filter(|s| !s.is_hide_set())
        .map(|s| s.get_name().to_string())
        .collect()
}

/// Run the command; commands that check something say what failed in their `Findings`. A
/// command stopped because the bus refused this process (`cmd::refused`) exits as
/// unreachable, saying why.
pub async fn run(cli: Cli) -> Result<Findings> {
    let result = dispatch(cli).await;
    match cmd::refused().reason() {
        Some(why) => Err(crate::error::Error::new(
            crate::error::Kind::Unreachable,
            anyhow::anyhow!("{why}"),
        )),
        None => result,
    }
}

async fn dispatch(cli: Cli) -> Result<Findings> {
    let done = |()| Findings::Ok;
    match cli.command {
        Command::Reasons(args) => cmd::reasons::run(args).map(done),
        Command::Decide(args) => cmd::decide::run(args).map(done),
        Command::Sim(args) => cmd::sim::run(args).await.map(done),
        Command::Node(args) => cmd::node::run(args).await.map(done),
        Command::Mesh(args) => cmd::mesh::run(args).await,
        Command::Bench(args) => cmd::bench::run(args).await,
        Command::Agent(args) => cmd::agent::run(args).await,
        Command::Listen(args) => cmd::listen::run(args).await.map(done),
        Command::Chaos(args) => cmd::chaos::run(args).await.map(done),
        Command::Creds(args) => cmd::creds::run(args).await.map(done),
        Command::Config(args) => cmd::config::run(args).map(done),
        Command::Escalation(args) => cmd::escalation::run(args).await.map(done),
        Command::Budget(args) => cmd::budget::run(args).await.map(done),
        Command::Explain(args) => cmd::explain::run(args).await,
        Command::Audit(args) => cmd::audit::run(args).await,
        Command::Rehearse(args) => cmd::rehearse::run(args).await,
        Command::Spend(args) => cmd::spend::run(args).await,
        Command::Demo(args) => cmd::demo::run(args).await,
        Command::Watch(args) => cmd::watch::run(args).await.map(done),
        Command::Completions(args) => {
            use clap::CommandFactory;
            cmd::completions::run(args, Cli::command()).map(done)
        }
        Command::Man(args) => {
            use clap::CommandFactory;
            cmd::man::run(args, Cli::command()).map(done)
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_command_line_definition_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }

    /// Every flag and argument of every command says what it is for in `--help`.
    #[test]
    fn every_argument_has_help() {
        use clap::CommandFactory;
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if ["help", "version"].contains(&id) || arg.is_hide_set() {
                    continue;
                }
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{path} --{id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&super::Cli::command(), "oam", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:#?}");
    }

    #[test]
    fn the_command_list_opens_with_what_a_user_does_first() {
        use clap::CommandFactory;
        let cli = super::Cli::command();
        let first: Vec<&str> = cli
            .get_subcommands()
            .take(3)
            .map(clap::Command::get_name)
            .collect();
        assert_eq!(first, ["demo", "mesh", "watch"]);
    }
}
