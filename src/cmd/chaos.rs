//! `oam chaos FAULT [TARGET] [--for 30s]`, `oam chaos list`, `oam chaos restore`: ask the mesh's
//! chaos warden (over NATS) to inject, list or end faults; `oam chaos warden` is that warden.

use crate::core::chaos::{
    self, Active, ContractBreak, Fault, Inject, Params, Restore, StreamBreak,
};
use crate::error::{Error, Kind, Result};
use crate::transport::chaos::{self as warden, WardenError};
use crate::transport::{connect, subjects};
use std::io::Write;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
    /// Print the result as JSON.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct For {
    /// How long the fault lasts, at most 1h; the target restores itself after it (e.g. 30s,
    /// 500ms, 2m, 1h).
    #[arg(long = "for", default_value = "30s", value_parser = parse_for)]
    pub duration: Duration,
}

/// A fault's `--for`: a duration of at most `MAX_FOR`, the longest the warden keeps a fault.
fn parse_for(s: &str) -> std::result::Result<Duration, super::BadValue> {
    let d = chaos::parse_duration(s).map_err(|e| e.to_string())?;
    if d > chaos::MAX_FOR {
        return Err(super::BadValue(format!(
            "{s:?}: a fault lasts at most {}m (the chaos warden restores every fault within \
             that); give a shorter --for, and inject it again to go on",
            chaos::MAX_FOR.as_secs() / 60
        )));
    }
    Ok(d)
}

#[derive(clap::Args, Debug)]
pub struct On {
    /// The provider, node or agent to break.
    pub target: String,
    #[command(flatten)]
    pub for_: For,
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// PROVIDER answers hard 5xx (a total outage).
    KillProvider(On),
    /// PROVIDER answers 200 with content that breaks the contract.
    BreakContract {
        #[command(flatten)]
        on: On,
        /// How the answer is broken.
        #[arg(long, default_value = "missing-field", value_parser = contract_modes())]
        mode: ContractBreak,
    },
    /// PROVIDER answers late.
    SlowProvider {
        #[command(flatten)]
        on: On,
        /// Milliseconds added to every answer.
        #[arg(long, default_value_t = 2_000)]
        ms: u64,
    },
    /// PROVIDER accepts requests and never answers.
    HangProvider(On),
    /// A share of PROVIDER's requests fail.
    FlakyProvider {
        #[command(flatten)]
        on: On,
        /// The share of requests that fail, from 0 to 1.
        #[arg(long, default_value_t = 0.3)]
        error_rate: f64,
    },
    /// PROVIDER answers 429 with Retry-After.
    RateLimitProvider {
        #[command(flatten)]
        on: On,
        /// What the provider's 429 asks callers to wait (its Retry-After), in milliseconds.
        #[arg(long, default_value_t = 1_000)]
        retry_after_ms: u64,
    },
    /// PROVIDER's streamed answers break after a few events: cut, stall, a malformed event, or
    /// no [DONE] (answers that do not stream are unaffected).
    BreakStream {
        #[command(flatten)]
        on: On,
        /// How the streams break.
        #[arg(long, default_value = "cut", value_parser = stream_breaks())]
        kind: StreamBreak,
        /// Events sent before the break.
        #[arg(long, default_value_t = 4)]
        after: u32,
    },
    /// SIGKILL a node of the local mesh; it is started again at the end.
    KillNode(On),
    /// SIGSTOP a node (a hung process); SIGCONT at the end.
    StopNode(On),
    /// Cut a node off from NATS (a partition); it reconnects at the end.
    IsolateNode(On),
    /// SIGKILL a process serving AGENT on this machine; it is started again at the end.
    KillAgent(On),
    /// SIGSTOP a process serving AGENT; SIGCONT at the end.
    StopAgent(On),
    /// An agent retries an identical failing high-risk call, to each node in turn (default
    /// agent: loop-bot).
    AgentLoop {
        /// The calling agent's name.
        target: Option<String>,
        #[command(flatten)]
        for_: For,
        /// How many identical calls.
        #[arg(long, default_value_t = 8)]
        requests: u32,
    },
    /// A bounded burst of background-class requests across the nodes.
    TrafficSpike {
        #[command(flatten)]
        for_: For,
        /// Requests in the burst [default: 10 x the concurrency].
        #[arg(long)]
        requests: Option<u32>,
        /// Requests under way at once [default: twice the background slots of every node
        /// together, read from their state, so each sheds some].
        #[arg(long)]
        concurrency: Option<u32>,
    },
    /// AGENT's budget is spent on every node (high-risk work is refused and escalated).
    DrainBudget(On),
    /// The active faults and the time they have left.
    List {
        /// Whole lines, however wide (by default the table wraps to the terminal).
        #[arg(long)]
        wide: bool,
    },
    /// End faults early: one by id, all of one kind by name, or --all.
    Restore {
        /// A fault id (from `oam chaos list`) or a fault name (e.g. kill-provider).
        what: Option<String>,
        /// End every active fault.
        #[arg(long, conflicts_with = "what")]
        all: bool,
    },
    /// Run the chaos warden for the local mesh in --dir (`oam mesh up` starts it).
    Warden,
}

/// The injection a fault command asks for.
fn injection(c: Command) -> std::result::Result<Inject, Command> {
    let mut params = Params::default();
    let (fault, target, d) = match c {
        Command::KillProvider(on) => (Fault::KillProvider, Some(on.target), on.for_.duration),
        Command::BreakContract { on, mode } => {
            params.mode = Some(mode);
            (Fault::BreakContract, Some(on.target), on.for_.duration)
        }
        Command::SlowProvider { on, ms } => {
            params.ms = Some(ms);
            (Fault::SlowProvider, Some(on.target), on.for_.duration)
        }
        Command::HangProvider(on) => (Fault::HangProvider, Some(on.target), on.for_.duration),
        Command::FlakyProvider { on, error_rate } => {
            params.error_rate = Some(error_rate);
            (Fault::FlakyProvider, Some(on.target), on.for_.duration)
        }
        Command::RateLimitProvider { on, retry_after_ms } => {
            params.retry_after_ms = Some(retry_after_ms);
            (Fault::RateLimitProvider, Some(on.target), on.for_.duration)
        }
        Command::BreakStream { on, kind, after } => {
            params.stream = Some(kind);
            params.after_chunks = Some(after);
            (Fault::BreakStream, Some(on.target), on.for_.duration)
        }
        Command::KillNode(on) => (Fault::KillNode, Some(on.target), on.for_.duration),
        Command::StopNode(on) => (Fault::StopNode, Some(on.target), on.for_.duration),
        Command::IsolateNode(on) => (Fault::IsolateNode, Some(on.target), on.for_.duration),
        Command::KillAgent(on) => (Fault::KillAgent, Some(on.target), on.for_.duration),
        Command::StopAgent(on) => (Fault::StopAgent, Some(on.target), on.for_.duration),
        Command::AgentLoop {
            target,
            for_,
            requests,
        } => {
            params.requests = Some(requests);
            (Fault::AgentLoop, target, for_.duration)
        }
        Command::TrafficSpike {
            for_,
            requests,
            concurrency,
        } => {
            params.requests = requests;
            params.concurrency = concurrency;
            (Fault::TrafficSpike, None, for_.duration)
        }
        Command::DrainBudget(on) => (Fault::DrainBudget, Some(on.target), on.for_.duration),
        other => return Err(other),
    };
    Ok(Inject {
        fault,
        target,
        for_ms: d.as_millis() as u64,
        params,
    })
}

/// Ask the warden; its reply, or exit 3 when there is none.
async fn ask(url: &str, subject: &'static str, body: Vec<u8>) -> Result<Vec<Active>> {
    let nc = crate::cmd::reach(url, "oam-chaos", false).await?;
    warden::ask(&nc, subject, body).await.map_err(|e| match e {
        WardenError::NoWarden => Error::new(
            Kind::Unreachable,
            anyhow::anyhow!(
                "no chaos warden answers on {}; `oam mesh up` starts one (or run \
                 `oam chaos warden --dir DIR` beside your mesh)",
                connect::redact(url)
            ),
        ),
        WardenError::Refused(why) => Error::usage(why),
        WardenError::Failed(why) => Error::new(Kind::Unreachable, anyhow::anyhow!(why)),
    })
}

fn secs(ms: u64) -> String {
    format!("{:.1} s", ms as f64 / 1_000.0)
}

pub async fn run(a: Args) -> Result<()> {
    let role = if matches!(a.command, Command::Warden) {
        super::Role::Warden
    } else {
        super::Role::Operator
    };
    let url = a.cluster.url(&role)?;
    let command = match injection(a.command) {
        Ok(inject) => {
            let body = serde_json::to_vec(&inject).map_err(Error::failed)?;
            let faults = ask(&url, subjects::CHAOS_INJECT, body).await?;
            let mut out = std::io::stdout().lock();
            for f in &faults {
                if a.json {
                    writeln!(out, "{}", serde_json::to_string(f).unwrap_or_default())?;
                } else {
                    writeln!(
                        out,
                        "{} {}: {} for {} (id {}); `oam chaos restore {}` ends it early",
                        f.fault.name(),
                        f.target,
                        f.detail,
                        secs(f.expires_at_ms - f.injected_at_ms),
                        f.id,
                        f.id
                    )?;
                }
            }
            return Ok(());
        }
        Err(other) => other,
    };
    match command {
        Command::List { wide } => {
            let faults = ask(&url, subjects::CHAOS_LIST, b"{}".to_vec()).await?;
            let now = crate::clock::now_ms();
            let mut out = std::io::stdout().lock();
            if a.json {
                let doc: Vec<serde_json::Value> = faults
                    .iter()
                    .map(|f| {
                        let mut v = serde_json::to_value(f).unwrap_or_default();
                        v["left_ms"] = f.left_ms(now).into();
                        v
                    })
                    .collect();
                writeln!(out, "{}", serde_json::Value::Array(doc))?;
            } else if faults.is_empty() {
                writeln!(out, "no active faults")?;
            } else {
                let lines = faults.iter().map(|f| {
                    vec![
                        f.id.clone(),
                        f.fault.name().to_string(),
                        f.target.clone(),
                        secs(f.left_ms(now)),
                        f.detail.clone(),
                    ]
                });
                let header = ["id", "fault", "target", "left", "what"];
                writeln!(out, "{}", super::table(&header, lines, wide))?;
            }
            Ok(())
        }
        Command::Restore { what, all } => {
            if what.is_none() && !all {
                return Err(Error::usage(
                    "name a fault id or fault kind to restore, or pass --all",
                ));
            }
            let body = serde_json::to_vec(&Restore { what }).map_err(Error::failed)?;
            let faults = ask(&url, subjects::CHAOS_RESTORE, body).await?;
            let mut out = std::io::stdout().lock();
            if a.json {
                writeln!(
                    out,
                    "{}",
                    serde_json::to_string(&faults).unwrap_or_default()
                )?;
            } else if faults.is_empty() {
                writeln!(out, "no active faults; nothing to restore")?;
            } else {
                for f in &faults {
                    writeln!(out, "restored {} ({} {})", f.id, f.fault.name(), f.target)?;
                }
            }
            Ok(())
        }
        Command::Warden => {
            let dir = a.cluster.dir();
            let nc = crate::cmd::reach(&url, "oam-chaos-warden", false).await?;
            // The system account's observer, from the warden's credentials file.
            let file = a
                .cluster
                .creds
                .clone()
                .filter(|p| crate::local::is_role_file(p))
                .unwrap_or_else(|| crate::local::role_path(&dir, &role.user()));
            let sys_url = std::env::var(crate::local::cluster::ENV_SYS_URL)
                .ok()
                .or_else(|| crate::local::read_role_file(&file).ok()?.sys_url);
            let sys = match sys_url {
                Some(u) => Some(crate::cmd::reach(&u, "oam-chaos-warden-sys", false).await?),
                None => {
                    tracing::warn!(
                        "no system-account access ({} names none): kill-agent and stop-agent \
                         will be refused, as no process can be verified",
                        file.display()
                    );
                    None
                }
            };
            let json = a.json;
            let ready_dir = dir.clone();
            let ready = move || {
                let mut out = std::io::stdout().lock();
                let line = serde_json::json!({"warden": ready_dir, "pid": std::process::id()});
                let _ = if json {
                    writeln!(out, "{line}")
                } else {
                    writeln!(
                        out,
                        "oam chaos warden for the mesh in {}",
                        ready_dir.display()
                    )
                };
                let _ = out.flush();
            };
            crate::chaos::warden::run(&dir, nc, sys, url, ready, crate::cmd::terminated())
                .await
                .map_err(|e| Error::new(Kind::Unreachable, e))
        }
        other => Err(Error::usage(format!("{other:?} is not a chaos command"))),
    }
}

/// `--mode`: the contract-breaking modes, by name.
fn stream_breaks() -> impl clap::builder::TypedValueParser<Value = StreamBreak> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(StreamBreak::ALL.map(StreamBreak::as_str))
        .map(|name: String| StreamBreak::from_name(&name).unwrap_or_default())
}

fn contract_modes() -> impl clap::builder::TypedValueParser<Value = ContractBreak> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(ContractBreak::ALL.map(ContractBreak::as_str))
        .map(|name: String| ContractBreak::from_name(&name).unwrap_or_default())
}
