//! `oam mesh up`: start a local cluster (`crate::local::cluster::up`) and say where it is.

use crate::error::{Error, Kind, Result};
use crate::local::{self, cluster};
use crate::node::config;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Number of nodes.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=9))]
    pub nodes: u16,
    /// The state folder: PIDs, ports, config, logs, credentials.
    #[arg(long, env = "OAM_DIR", default_value = ".oam")]
    pub dir: PathBuf,
    /// nats-servers to run as one cluster (routes between them, JetStream on each, every
    /// stream and bucket on min(3, N) of them). 3 survive the loss of any one; 2 do not (no
    /// majority is left), and are warned about.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=5))]
    pub servers: u16,
    /// NATS client port of the first server, the others' follow it (0: any free ports).
    #[arg(long, default_value_t = 4222)]
    pub port: u16,
    /// The simulator's HTTP port (0: any free port).
    #[arg(long, default_value_t = 8081)]
    pub sim_port: u16,
    /// The first node's HTTP port; the others follow it (0: any free ports).
    #[arg(long, default_value_t = 8091)]
    pub http_port: u16,
    /// The nats-server binary (default: $OAM_NATS_SERVER, the project's .tools, then PATH).
    #[arg(long)]
    pub nats_server: Option<PathBuf>,
    /// How often JetStream writes to disk: `always` (fsync every write before it is
    /// acknowledged) or a duration (default 2m; a majority of servers holds every acknowledged
    /// write in memory meanwhile). See docs/cluster.md.
    #[arg(long, value_name = "INTERVAL", value_parser = crate::local::natsd::parse_sync_interval)]
    pub sync_interval: Option<String>,
    /// Open each nats-server's HTTP monitoring port on 127.0.0.1 (any free port; `oam mesh
    /// status` shows it). It answers anyone on this machine, without a password, with every
    /// user, inbox and consumer: for debugging and the fault scripts, not for a shared host.
    #[arg(long)]
    pub nats_monitor: bool,
    /// Generate new NATS passwords. By default the folder keeps its credentials across `oam
    /// mesh down` and `oam mesh up`, so running agents and watches reconnect by themselves.
    #[arg(long)]
    pub new_credentials: bool,
    /// The nodes' configuration (providers, timings, pipeline, budgets; docs/configuration.md,
    /// starters in examples/; `oam config check FILE` validates one). Without it: $OAM_CONFIG,
    /// else ./oam.toml, else the nodes route across a simulator this mesh starts.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Start this host's part of a mesh across hosts, from the file that lists them (after
    /// `oam mesh init --hosts FILE` once, its folder copied to every host): its nats-server
    /// (a member of the hosts' cluster, TLS for clients and routes), its nodes, a monitor.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["nodes", "servers", "port", "sim_port", "http_port", "config", "new_credentials", "sync_interval"])]
    pub hosts: Option<PathBuf>,
    /// Which host of --hosts this is (default: the one whose address this machine has).
    #[arg(long, value_name = "NAME", requires = "hosts")]
    pub host: Option<String>,
    /// With --hosts: how long to wait for the other hosts' servers.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 120,
        requires = "hosts"
    )]
    pub wait_s: u64,
    /// Print the endpoints as one JSON document.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(a: Args) -> Result<()> {
    let exe = local::oam_exe().map_err(Error::failed)?;
    if let Some(file) = &a.hosts {
        let deployment =
            local::hosts::Deployment::load(file).map_err(|e| Error::usage(format!("{e:#}")))?;
        let log_retention = match deployment.config_path() {
            Some(path) => Some(log_retention(&path)?),
            None => None,
        };
        log_fits_disk(log_retention, &a.dir, 1)?;
        let plan = local::hosts::HostPlan {
            log_retention,
            deployment,
            host: a.host.clone(),
            dir: a.dir.clone(),
            exe,
            nats_server: a.nats_server.clone(),
            wait: std::time::Duration::from_secs(a.wait_s),
            nats_monitor: a.nats_monitor,
        };
        let up = local::hosts::up(&plan).await;
        return report(&a, up);
    }
    // The configuration: --config, else $OAM_CONFIG, else ./oam.toml (said, since a mesh on
    // real providers costs money), else the simulator.
    let config = match config::discover(a.config.clone()) {
        Some((path, "--config")) => Some(path),
        Some((path, how)) => {
            let path = std::fs::canonicalize(&path).unwrap_or(path);
            eprintln!(
                "oam mesh up: using the configuration {} (from {how}; --config names another)",
                path.display()
            );
            Some(path)
        }
        None => None,
    };
    // A configuration is checked before anything starts (errors name the file, line and field).
    let log_retention = match &config {
        Some(path) => Some(log_retention(path)?),
        None => None,
    };
    log_fits_disk(log_retention, &a.dir, a.servers.into())?;
    let plan = cluster::Plan {
        dir: a.dir.clone(),
        nodes: a.nodes,
        servers: a.servers,
        port: a.port,
        sim_port: a.sim_port,
        http_port: a.http_port,
        nats_server: a.nats_server.clone(),
        exe,
        new_credentials: a.new_credentials,
        config,
        log_retention,
        sync_interval: a.sync_interval.clone(),
        nats_monitor: a.nats_monitor,
    };
    report(&a, cluster::up(&plan).await)
}

/// The decision log must fit the JetStream store of each of this host's `servers`, sized to the
/// disk it keeps its mesh folder on (`local::store_bytes`): checked before anything starts, not
/// found out when the disk is full (every host of a hosts mesh checks its own).
fn log_fits_disk(
    log_retention: Option<(std::time::Duration, u64)>,
    dir: &std::path::Path,
    servers: usize,
) -> Result<()> {
    let bytes = log_retention.map_or(crate::transport::store::decisions::DEFAULT_MAX_BYTES, |r| {
        r.1
    });
    if let Some(free) = local::free_bytes(dir) {
        local::log_fits(bytes, free, servers, dir).map_err(Error::usage)?;
    }
    Ok(())
}

/// The decision log's age and size from the nodes' configuration at `path`, checked before
/// anything starts (errors name the file, line and field).
fn log_retention(path: &std::path::Path) -> Result<(std::time::Duration, u64)> {
    let cfg = crate::node::config::NodeConfig::load(Some(path), "").map_err(Error::usage)?;
    let log = &cfg.decision_log;
    Ok((
        std::time::Duration::from_secs(log.max_age_hours.saturating_mul(3600)),
        log.max_bytes,
    ))
}

/// Say what `up` did.
fn report(a: &Args, up: std::result::Result<cluster::Up, cluster::UpError>) -> Result<()> {
    let up = up.map_err(|e| match e {
        cluster::UpError::Plan(e) => Error::new(Kind::Usage, e),
        cluster::UpError::Start(e) => Error::failed(e),
    })?;
    let (rec, dir, version) = match up {
        cluster::Up::Started {
            record,
            dir,
            nats_server_version,
        } => (record, dir, nats_server_version),
        cluster::Up::Repaired {
            dir,
            restarted,
            total,
        } => {
            let mut out = std::io::stdout().lock();
            if a.json {
                let doc = serde_json::json!({
                    "dir": dir, "repaired": restarted, "processes": total,
                });
                writeln!(out, "{doc}")?;
                return Ok(());
            }
            writeln!(
                out,
                "the mesh in {} was partly down; started again: {} (now all {total} \
                 processes run); `oam mesh status --dir {}` shows it",
                dir.display(),
                restarted.join(", "),
                a.dir.display()
            )?;
            return Ok(());
        }
        cluster::Up::AlreadyRunning { dir, alive, total } => {
            let mut out = std::io::stdout().lock();
            if a.json {
                let doc = serde_json::json!({
                    "dir": dir, "already_up": true, "running": alive, "processes": total,
                });
                writeln!(out, "{doc}")?;
                return Ok(());
            }
            writeln!(
                out,
                "the mesh in {} is already up ({alive} of {total} processes running); \
                 `oam mesh status --dir {}` shows it, `oam mesh down --dir {}` stops it",
                dir.display(),
                a.dir.display(),
                a.dir.display()
            )?;
            return Ok(());
        }
    };
    let mut out = std::io::stdout().lock();
    if a.json {
        let doc = serde_json::json!({
            "dir": dir,
            "nats": rec.client_urls().join(","),
            "servers": rec.servers,
            "nats_server_version": version,
            "credentials": dir.join(local::CREDS_DIR),
            "sim": (!rec.sim_url.is_empty()).then_some(&rec.sim_url),
            "nodes": rec.nodes().map(|n| serde_json::json!({"id": n.name, "http": n.endpoint, "pid": n.pid})).collect::<Vec<_>>(),
            "processes": rec.processes,
        });
        writeln!(out, "{doc}")?;
        return Ok(());
    }
    writeln!(
        out,
        "oam mesh up: {} processes, state in {}",
        rec.processes.len(),
        dir.display()
    )?;
    writeln!(out, "  {:12} {:>7}  ENDPOINT", "PROCESS", "PID")?;
    for p in &rec.processes {
        writeln!(out, "  {:12} {:>7}  {}", p.name, p.pid, p.endpoint)?;
    }
    let first = rec
        .nodes()
        .next()
        .map(|n| n.endpoint.clone())
        .unwrap_or_default();
    writeln!(
        out,
        "\nTry:\n  curl -s {first}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\": \"auto\", \"messages\": [{{\"role\": \"user\", \"content\": \"hello\"}}]}}'"
    )?;
    if !rec.sim_url.is_empty() {
        writeln!(
            out,
            "  curl -s -X POST {}/sim/faults -d '{{\"provider\": \"primary\", \"mode\": \"error\", \"duration_ms\": 30000}}'",
            rec.sim_url
        )?;
    }
    writeln!(
        out,
        "  oam mesh status --dir {}    oam mesh down --dir {}",
        a.dir.display(),
        a.dir.display()
    )?;
    writeln!(
        out,
        "  oam creds issue --role agent --name NAME --dir {}    (each role has its own \
         NATS user: {})",
        a.dir.display(),
        dir.join(local::CREDS_DIR).display()
    )?;
    Ok(())
}
