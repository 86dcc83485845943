//! `oam agent serve`: a demo agent on the mesh until SIGINT/SIGTERM.

use crate::error::{Error, Kind, Result};
use crate::mesh::host::{self, Demo, Instance};
use crate::mesh::protocol::{self, CatalogEntry};
use crate::transport::connect;
use std::io::Write;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
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
    /// What the agent does, as the catalog lists it.
    #[arg(long, default_value = "oam demo agent")]
    pub description: String,
    /// Declare the longest a request may take; past it the caller gets `stuck` instead of
    /// waiting out its own timeout.
    #[arg(long)]
    pub max_handling_ms: Option<u64>,
    /// A tag for the catalog, besides `demo` (repeatable); `mcp` exposes the agent as a tool of
    /// nodes that serve the mesh's agents at `/mcp`.
    #[arg(long = "tag")]
    pub tags: Vec<String>,
    /// Print the ready line as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(cluster: &super::super::ClusterArgs, s: Args) -> Result<()> {
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
    let url = &cluster.url(&crate::cmd::Role::Agent(s.name.clone()))?;
    let entry = CatalogEntry {
        name: s.name.clone(),
        description: s.description.clone(),
        version: "0.1.0".into(),
        tags: std::iter::once("demo".to_string())
            .chain(s.tags.iter().cloned())
            .collect(),
        invocable: true,
        streaming: s.demo.streams(),
        max_handling_ms: s.max_handling_ms,
    };
    let mut instances = Vec::new();
    for _ in 0..s.replicas {
        let (inst, sub) = Instance::start(url, entry.clone(), crate::cmd::refused())
            .await
            .map_err(|e| {
                Error::new(
                    Kind::Unreachable,
                    anyhow::Error::from(e).context(format!(
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
    // Every replica stops at once and they leave together, so an exit takes one goodbye's
    // time however many replicas there are, and the last of the agent's instances says so.
    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut running = Vec::new();
    let mut members = Vec::new();
    for (inst, sub) in instances {
        let mut stop_rx = stop_tx.subscribe();
        let (demo, concurrency) = (s.demo, s.concurrency);
        members.push(inst.clone());
        running.push(tokio::spawn(async move {
            let stop = async move {
                let _ = stop_rx.recv().await;
            };
            host::run(
                inst,
                sub,
                demo.into(),
                concurrency,
                Duration::from_secs(1),
                stop,
            )
            .await
        }));
    }
    crate::cmd::terminated().await;
    let _ = stop_tx.send(());
    let mut connected = false;
    for task in running {
        connected |= task.await.unwrap_or(false);
    }
    if connected {
        host::leave(&members).await;
    }
    Ok(())
}
