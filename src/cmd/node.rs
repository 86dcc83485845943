//! `oam node run`: one control-plane node.

use crate::error::{Error, Result};
use crate::node::{self, Node, config::NodeConfig};
use crate::transport::{connect, subjects};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Run a node: probes, gossip, consensus, and the data plane (HTTP and NATS).
    Run(RunArgs),
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// This node's id (letters, digits, '-', '_'), unique in the cluster.
    #[arg(long)]
    pub id: String,
    /// HTTP data-plane address; port 0 picks a free one (printed when ready).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
    /// Providers, timings, pipeline and budgets (docs/configuration.md; starters in examples/;
    /// `oam config check FILE` validates one). Without it the node routes across `oam sim`'s
    /// providers at --sim-url.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Where `oam sim` listens, for the default providers.
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    pub sim_url: String,
    /// Cluster size n for the quorum (overrides the config's node.cluster_size).
    #[arg(long)]
    pub cluster_size: Option<usize>,
    /// Exactly the nodes of the cluster, this one included (`n1,n2,n3`; overrides the config's
    /// node.members): no other id is heard. Without it, the first n ids heard.
    #[arg(long, value_delimiter = ',', conflicts_with = "cluster_size")]
    pub members: Vec<String>,
    /// Print the ready line as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// Threads of the node's shared runtime: its services, the NATS door, and HTTP when
    /// `[node] lanes = 0` (default: one per core, or $TOKIO_WORKER_THREADS). HTTP connections
    /// are otherwise served on lanes of their own (docs/configuration.md).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,
}

impl Args {
    /// The runtime's worker threads this command asks for, if it does.
    pub fn worker_threads(&self) -> Option<usize> {
        match &self.command {
            Command::Run(a) => a.worker_threads.map(usize::from),
        }
    }
}

pub async fn run(args: Args) -> Result<()> {
    match args.command {
        Command::Run(a) => run_node(a).await,
    }
}

async fn run_node(a: RunArgs) -> Result<()> {
    if !subjects::valid_token(&a.id) {
        return Err(Error::usage(format!(
            "--id {:?}: use letters, digits, '-' or '_' (it becomes a NATS subject token)",
            a.id
        )));
    }
    // Before the config is read: its default limits are sized from the descriptors there are.
    let open_files = crate::node::limits::raise_open_files();
    let mut cfg = NodeConfig::load(a.config.as_deref(), &a.sim_url).map_err(Error::usage)?;
    for w in cfg.warnings() {
        eprintln!("oam node run: warning: {w}");
    }
    if let Some(n) = a.cluster_size {
        if n == 0 {
            return Err(Error::usage("--cluster-size must be at least 1"));
        }
        cfg.node.cluster_size = n;
    }
    if !a.members.is_empty() {
        cfg.node.members = a.members.clone();
    }
    if !cfg.node.members.is_empty() {
        if let Some(bad) = cfg.node.members.iter().find(|m| !subjects::valid_token(m)) {
            return Err(Error::usage(format!(
                "--members: {bad:?} is not a node id (letters, digits, '-' or '_')"
            )));
        }
        if !cfg.node.members.contains(&a.id) {
            return Err(Error::usage(format!(
                "--members {} does not name this node ({}); list every node, this one included",
                cfg.node.members.join(","),
                a.id
            )));
        }
    }
    let url = a.cluster.url(&super::Role::Node(a.id.clone()))?;
    let listener = tokio::net::TcpListener::bind(a.listen).await.map_err(|e| {
        Error::usage(format!(
            "cannot listen on {}: {e}. Pick another address with --listen, or 127.0.0.1:0",
            a.listen
        ))
    })?;
    let http = listener.local_addr().map_err(Error::failed)?;
    // A node started before nats-server keeps retrying in the background and joins when it can.
    let nats = crate::cmd::reach(&url, &format!("oam-node-{}", a.id), true).await?;
    let limits = serde_json::json!({
        "open_files": open_files,
        "max_connections": cfg.node.max_connections,
        "short_requests": cfg.pipeline.bulkheads.global_limit,
        "streams": cfg.pipeline.stream_bulkheads.global_limit,
        "lanes": cfg.node.lanes,
    });
    let (node, services) = Node::new(a.id.clone(), cfg, nats).map_err(Error::failed)?;
    {
        let mut out = std::io::stdout().lock();
        let ready = serde_json::json!({
            "node": a.id,
            "http": format!("http://{http}"),
            "nats": connect::redact(&url),
            "limits": limits,
        });
        if a.json {
            writeln!(out, "{ready}")?;
        } else {
            writeln!(
                out,
                "oam node {} serving http://{http}/v1/chat/completions (NATS {})\n  \
                 at once: {} short requests, {} streams, {} connections ({} open files), \
                 served on {} lanes",
                a.id,
                connect::redact(&url),
                limits["short_requests"],
                limits["streams"],
                limits["max_connections"],
                limits["open_files"],
                limits["lanes"],
            )?;
        }
        out.flush()?;
    }
    node::run(node, services, listener, crate::cmd::terminated())
        .await
        .map_err(Error::failed)
}
