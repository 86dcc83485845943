//! `oam agent serve | call | stream | list`: demo agents, calls and streams by name, and the
//! catalog.

use crate::error::{Error, Kind, Result};
use crate::mesh::host::{self, Demo, Instance};
use crate::mesh::protocol::{self, CatalogEntry};
use crate::mesh::{client, store};
use crate::transport::connect;
use std::io::{IsTerminal, Read, Write};
use std::time::Duration;

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
    Serve(ServeArgs),
    /// Call an agent by name and print its reply.
    Call(CallArgs),
    /// Stream from an agent by name: one line per chunk as it arrives.
    Stream(CallArgs),
    /// List the agents in the mesh catalog.
    List(ListArgs),
    /// Measure liveness (SIGKILL/SIGSTOP to failure) and echo speed on a running mesh.
    Bench(super::agent_bench::Args),
}

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The agent's name (dot-separated, e.g. demo.echo).
    pub name: String,
    /// What it does: echo, sleep:MS, hang, fail, chat (answers chat requests like a model), or
    /// stream:N:MS (a streaming agent: N chunks, one every MS ms).
    #[arg(long, default_value = "echo")]
    pub demo: Demo,
    /// Instances to run in this process (each its own connection and instance id).
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Requests each instance handles at once; more wait (backpressure).
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    #[arg(long, default_value = "oam demo agent")]
    pub description: String,
    /// Declare the longest a request may take; past it the caller gets `stuck` instead of
    /// waiting out its own timeout.
    #[arg(long)]
    pub max_handling_ms: Option<u64>,
    /// Print the ready line as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct CallArgs {
    pub name: String,
    /// The JSON payload, or `-` to read it from standard input (default: {}).
    pub payload: Option<String>,
    /// Seconds to wait for the answer (for a stream: for all of it).
    #[arg(long, default_value_t = 30.0)]
    pub timeout: f64,
}

impl CallArgs {
    /// The payload (validated as JSON) and the timeout, or a usage error.
    fn checked(&self) -> Result<(bytes::Bytes, Duration)> {
        let payload = match self.payload.as_deref() {
            None => "{}".to_string(),
            Some("-") => {
                if std::io::stdin().is_terminal() {
                    return Err(Error::usage(
                        "`-` reads the payload from standard input; pipe JSON into it",
                    ));
                }
                let mut s = String::new();
                std::io::stdin()
                    .read_to_string(&mut s)
                    .map_err(|e| Error::usage(format!("cannot read standard input: {e}")))?;
                s
            }
            Some(p) => p.to_string(),
        };
        if let Err(e) = serde_json::from_str::<serde_json::Value>(&payload) {
            return Err(Error::usage(format!("the payload is not JSON: {e}")));
        }
        let timeout = Duration::try_from_secs_f64(self.timeout)
            .ok()
            .filter(|t| !t.is_zero() && *t <= MAX_TIMEOUT)
            .ok_or_else(|| {
                Error::usage(format!(
                    "--timeout {}: use a number of seconds above 0 and at most {}",
                    self.timeout,
                    MAX_TIMEOUT.as_secs()
                ))
            })?;
        Ok((payload.into_bytes().into(), timeout))
    }
}

/// The longest a caller may wait for an agent: a day.
const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);

fn mesh_failure(e: protocol::MeshError) -> Error {
    Error::new(
        Kind::Check,
        anyhow::anyhow!("{}: {}", e.code.as_str(), e.message),
    )
}

#[derive(clap::Args, Debug)]
pub struct ListArgs {
    #[arg(long)]
    pub json: bool,
}

fn url(flag: &Option<String>) -> String {
    crate::local::resolve_url(flag.clone())
}

pub async fn run(a: Args) -> Result<()> {
    let url = url(&a.nats_url);
    match a.command {
        Command::Serve(s) => serve(&url, s).await,
        Command::Call(c) => call(&url, c).await,
        Command::Stream(c) => stream(&url, c).await,
        Command::List(l) => list(&url, l).await,
        Command::Bench(b) => super::agent_bench::run(&url, b).await,
    }
}

async fn serve(url: &str, s: ServeArgs) -> Result<()> {
    if !protocol::valid_agent_name(&s.name) {
        return Err(Error::usage(format!(
            "agent name {:?}: use dot-separated segments of letters, digits, '-' and '_'",
            s.name
        )));
    }
    if s.replicas == 0 || s.concurrency == 0 {
        return Err(Error::usage(
            "--replicas and --concurrency must be at least 1",
        ));
    }
    let entry = CatalogEntry {
        name: s.name.clone(),
        description: s.description.clone(),
        version: "0.1.0".into(),
        tags: vec!["demo".into()],
        invocable: true,
        streaming: s.demo.streams(),
        max_handling_ms: s.max_handling_ms,
    };
    let mut instances = Vec::new();
    for _ in 0..s.replicas {
        let (inst, sub) = Instance::start(url, entry.clone()).await.map_err(|e| {
            Error::new(
                Kind::Unreachable,
                e.context(format!(
                    "cannot serve {} via {}",
                    s.name,
                    connect::redact(url)
                )),
            )
        })?;
        instances.push((inst, sub));
    }
    {
        let ids: Vec<&str> = instances.iter().map(|(i, _)| i.id.as_str()).collect();
        let mut out = std::io::stdout().lock();
        if s.json {
            writeln!(
                out,
                "{}",
                serde_json::json!({"agent": s.name, "instances": ids, "pid": std::process::id()})
            )?;
        } else {
            writeln!(
                out,
                "serving {} ({:?}) as {}",
                s.name,
                s.demo,
                ids.join(", ")
            )?;
        }
        out.flush()?;
    }
    let mut running = Vec::new();
    for (inst, sub) in instances {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (demo, concurrency) = (s.demo, s.concurrency);
        let task = tokio::spawn(async move {
            let stop = async move {
                let _ = stop_rx.await;
            };
            host::serve(
                inst,
                sub,
                demo.into(),
                concurrency,
                Duration::from_secs(1),
                stop,
            )
            .await
        });
        running.push((stop_tx, task));
    }
    crate::signal::terminated().await;
    // Leave one at a time, so the last replica out knows it is the last and says so.
    for (stop_tx, task) in running {
        let _ = stop_tx.send(());
        if let Ok(Err(e)) = task.await {
            tracing::warn!("an instance did not leave cleanly: {e:#}");
        }
    }
    Ok(())
}

async fn call(url: &str, c: CallArgs) -> Result<()> {
    let (payload, timeout) = c.checked()?;
    let nc = crate::transport::connect::reach(url, "oam-agent-call", false).await?;
    let caller = client::Caller::new(nc)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))?;
    let body = caller
        .call(&c.name, payload, timeout)
        .await
        .map_err(mesh_failure)?;
    let mut out = std::io::stdout().lock();
    out.write_all(&body)?;
    writeln!(out)?;
    Ok(())
}

async fn stream(url: &str, c: CallArgs) -> Result<()> {
    let (payload, timeout) = c.checked()?;
    let nc = crate::transport::connect::reach(url, "oam-agent-stream", false).await?;
    let caller = client::Caller::new(nc)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))?;
    let mut chunks = caller
        .stream(&c.name, payload, timeout)
        .await
        .map_err(mesh_failure)?;
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(mesh_failure)?;
        let mut out = std::io::stdout().lock();
        out.write_all(&chunk)?;
        writeln!(out)?;
        out.flush()?;
    }
    Ok(())
}

async fn list(url: &str, l: ListArgs) -> Result<()> {
    let nc = crate::transport::connect::reach(url, "oam-agent-list", false).await?;
    let entries = store::catalog(&nc)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))?;
    let mut out = std::io::stdout().lock();
    if l.json {
        serde_json::to_writer_pretty(&mut out, &entries).map_err(|e| Error::new(Kind::Check, e))?;
        writeln!(out)?;
    } else if entries.is_empty() {
        writeln!(out, "no agents in the catalog")?;
    } else {
        writeln!(
            out,
            "{:30} {:8} {:10} DESCRIPTION",
            "NAME", "VERSION", "KIND"
        )?;
        for e in &entries {
            let kind = match (e.invocable, e.streaming) {
                (true, false) => "call",
                (true, true) => "stream",
                (false, true) => "publisher",
                (false, false) => "watcher",
            };
            writeln!(
                out,
                "{:30} {:8} {:10} {}",
                e.name, e.version, kind, e.description
            )?;
        }
    }
    Ok(())
}
