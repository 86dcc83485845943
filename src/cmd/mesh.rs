//! `oam mesh up | down | status`: a whole local cluster in one command (nats-server, the
//! simulator, N nodes), recorded in one state folder, stopped by exactly the recorded PIDs.

use crate::error::{Error, Kind, Result};
use crate::localmesh::{self, Record, Started, Stopped};
use crate::natsd;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Start nats-server, the provider simulator and N nodes on 127.0.0.1.
    Up(UpArgs),
    /// Stop exactly what `oam mesh up` started (newest first, SIGTERM then SIGKILL).
    Down(DownArgs),
    /// Show what is running and healthy.
    Status(StatusArgs),
    /// The liveness monitor: connection drops and missed heartbeats become death notices.
    Monitor(MonitorArgs),
}

#[derive(clap::Args, Debug)]
pub struct MonitorArgs {
    /// Application-account NATS URL. Default: $OAM_NATS_URL, then the mesh in --dir.
    #[arg(long)]
    pub nats_url: Option<String>,
    /// System-account NATS URL (reads `$SYS` advisories). Default: $OAM_NATS_SYS_URL, then the
    /// mesh in --dir.
    #[arg(long)]
    pub sys_url: Option<String>,
    #[arg(long, default_value = ".oam")]
    pub dir: PathBuf,
    /// Print the ready line as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// Number of nodes.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=9))]
    pub nodes: u16,
    /// The state folder: PIDs, ports, config, logs, credentials.
    #[arg(long, default_value = ".oam")]
    pub dir: PathBuf,
    /// NATS client port (0: any free port).
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
    /// Print the endpoints as one JSON document.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct DownArgs {
    #[arg(long, default_value = ".oam")]
    pub dir: PathBuf,
    /// How long each process gets to exit after SIGTERM before SIGKILL.
    #[arg(long, default_value_t = 5_000)]
    pub grace_ms: u64,
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    #[arg(long, default_value = ".oam")]
    pub dir: PathBuf,
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: Args) -> Result<()> {
    match args.command {
        Command::Up(a) => up(a).await,
        Command::Down(a) => down(a),
        Command::Status(a) => status(a).await,
        Command::Monitor(a) => monitor(a).await,
    }
}

/// Check that a port asked for is free; 0 stays 0: the process binds any free port itself and
/// says which (asking for a free port first would race with everything else on the machine).
fn pick_port(wanted: u16, what: &str, flag: &str) -> Result<u16> {
    if wanted != 0 && natsd::port_in_use(wanted) {
        return Err(Error::usage(format!(
            "port {wanted} for {what} is in use on 127.0.0.1; stop what holds it, or pass \
             {flag} 0 for any free port (or another number)"
        )));
    }
    Ok(wanted)
}

/// Wait for the first line of `path` (a child's stdout), parsed as JSON.
fn ready_line(
    path: &Path,
    child: &mut std::process::Child,
    what: &str,
    log: &Path,
) -> Result<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && let Some(line) = text.lines().next()
            && text.contains('\n')
        {
            return serde_json::from_str(line).map_err(|e| {
                Error::new(Kind::Check, anyhow::anyhow!("{what} printed {line:?}: {e}"))
            });
        }
        if let Ok(Some(status)) = child.try_wait() {
            let tail = std::fs::read_to_string(log).unwrap_or_default();
            let last = tail.lines().last().unwrap_or("").to_string();
            return Err(Error::new(
                Kind::Check,
                anyhow::anyhow!(
                    "{what} exited ({status}) before it was ready: {last} (see {})",
                    log.display()
                ),
            ));
        }
        if Instant::now() > deadline {
            return Err(Error::new(
                Kind::Check,
                anyhow::anyhow!("{what} was not ready within 20 s; see {}", log.display()),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn spawn_oam(
    dir: &Path,
    name: &str,
    args: &[String],
    env: &[(&str, String)],
) -> Result<(std::process::Child, PathBuf, PathBuf)> {
    localmesh::spawn_oam(dir, name, args, env).map_err(|e| Error::new(Kind::Check, e))
}

async fn up(a: UpArgs) -> Result<()> {
    let dir = a.dir.clone();
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::usage(format!("cannot create {}: {e}", dir.display())))?;
    let dir = dir.canonicalize().map_err(|e| Error::new(Kind::Check, e))?;
    if let Some(rec) = Record::load(&dir).map_err(|e| Error::new(Kind::Usage, e))? {
        let alive = rec
            .processes
            .iter()
            .filter(|p| localmesh::is_ours(p))
            .count();
        if alive > 0 {
            let mut out = std::io::stdout().lock();
            writeln!(
                out,
                "the mesh in {} is already up ({alive} of {} processes running); \
                 `oam mesh status --dir {}` shows it, `oam mesh down --dir {}` stops it",
                dir.display(),
                rec.processes.len(),
                a.dir.display(),
                a.dir.display()
            )?;
            return Ok(());
        }
        tracing::info!(
            "{} records a mesh that is no longer running; starting afresh",
            dir.display()
        );
    }
    let (bin, version) =
        natsd::find(a.nats_server.as_deref()).map_err(|e| Error::new(Kind::Usage, e))?;
    let port = pick_port(a.port, "nats-server", "--port")?;
    let sim_port = pick_port(a.sim_port, "the simulator", "--sim-port")?;
    let mut node_ports = Vec::new();
    for i in 0..a.nodes {
        let wanted = match a.http_port {
            0 => 0,
            first => first.checked_add(i).ok_or_else(|| {
                Error::usage(format!(
                    "--http-port {first} leaves no room for {} nodes below 65536; pick a lower \
                     first port, or 0 for any free ports",
                    a.nodes
                ))
            })?,
        };
        node_ports.push(pick_port(wanted, "a node", "--http-port")?);
    }

    let mut started: Vec<Started> = Vec::new();
    let result = start_all(&a, &dir, &bin, port, sim_port, &node_ports, &mut started).await;
    let rec = match result {
        Ok(rec) => rec,
        Err(e) => {
            for p in started.iter().rev() {
                localmesh::stop(p, Duration::from_secs(2));
            }
            return Err(e);
        }
    };
    rec.save(&dir).map_err(|e| Error::new(Kind::Check, e))?;
    let mut out = std::io::stdout().lock();
    if a.json {
        let doc = serde_json::json!({
            "dir": dir,
            "nats": format!("nats://127.0.0.1:{}", rec.nats_port),
            "nats_server_version": version.to_string(),
            "credentials": dir.join(localmesh::CREDENTIALS),
            "sim": rec.sim_url,
            "nodes": rec.nodes().map(|n| serde_json::json!({"id": n.name, "http": n.endpoint, "pid": n.pid})).collect::<Vec<_>>(),
            "processes": rec.processes,
        });
        writeln!(out, "{doc}")?;
    } else {
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
        writeln!(
            out,
            "  curl -s -X POST {}/sim/faults -d '{{\"provider\": \"primary\", \"mode\": \"error\", \"duration_ms\": 30000}}'",
            rec.sim_url
        )?;
        writeln!(
            out,
            "  oam mesh status --dir {}    oam mesh down --dir {}",
            a.dir.display(),
            a.dir.display()
        )?;
    }
    Ok(())
}

async fn start_all(
    a: &UpArgs,
    dir: &Path,
    bin: &Path,
    port: u16,
    sim_port: u16,
    node_ports: &[u16],
    started: &mut Vec<Started>,
) -> Result<Record> {
    let check = |e: anyhow::Error| Error::new(Kind::Check, e);
    // nats-server from a generated config, credentials beside it (0600).
    let creds = natsd::Credentials::generate().map_err(check)?;
    let layout = natsd::Layout {
        port,
        monitor_port: 0,
        dir: dir.to_path_buf(),
    };
    let nats_log = dir.join("nats.log");
    let server =
        natsd::start(bin, &layout, &creds, &nats_log, Duration::from_secs(15)).map_err(check)?;
    let (port, monitor_port) = (server.port, server.monitor_port);
    started.push(Started {
        name: "nats-server".into(),
        pid: server.child.id(),
        endpoint: format!("nats://127.0.0.1:{port} (monitor http://127.0.0.1:{monitor_port})"),
        log: nats_log,
        cmdline_marker: layout.config_path().display().to_string(),
        args: Vec::new(),
    });
    let creds_doc = serde_json::json!({
        "app_url": natsd::app_url(port, &creds),
        "sys_url": natsd::sys_url(port, &creds),
        "credentials": creds,
    });
    localmesh::write_private(
        &dir.join(localmesh::CREDENTIALS),
        &format!("{creds_doc:#}\n"),
    )
    .map_err(check)?;

    // The simulator.
    let sim_args: Vec<String> = [
        "sim",
        "--listen",
        &format!("127.0.0.1:{sim_port}"),
        "--json",
    ]
    .map(String::from)
    .to_vec();
    let (mut child, out, log) = spawn_oam(dir, "sim", &sim_args, &[])?;
    started.push(Started {
        name: "sim".into(),
        pid: child.id(),
        endpoint: String::new(),
        log: log.clone(),
        cmdline_marker: "sim --listen 127.0.0.1:".into(),
        args: sim_args,
    });
    let ready = ready_line(&out, &mut child, "the simulator", &log)?;
    let sim_url = ready["url"].as_str().unwrap_or_default().to_string();
    if let Some(p) = started.last_mut() {
        p.settle_address(&sim_url);
    }

    // The nodes; the NATS URL with credentials travels in the environment, not argv. A node's
    // marker (`--id n1 --sim-url URL`) names this mesh and survives a restart on its new port.
    let app_url = natsd::app_url(port, &creds);
    let mut pending = Vec::new();
    for (i, &p) in node_ports.iter().enumerate() {
        let id = format!("n{}", i + 1);
        let args: Vec<String> = [
            "node",
            "run",
            "--id",
            &id,
            "--sim-url",
            &sim_url,
            "--listen",
            &format!("127.0.0.1:{p}"),
            "--json",
            "--cluster-size",
            &a.nodes.to_string(),
        ]
        .map(String::from)
        .to_vec();
        let (child, out, log) = spawn_oam(
            dir,
            &id,
            &args,
            &[(crate::transport::connect::ENV_URL, app_url.clone())],
        )?;
        started.push(Started {
            name: id.clone(),
            pid: child.id(),
            endpoint: String::new(),
            log: log.clone(),
            cmdline_marker: format!("--id {id} --sim-url {sim_url}"),
            args,
        });
        pending.push((started.len() - 1, id, child, out, log));
    }
    let mut node_urls = Vec::new();
    for (at, id, mut child, out, log) in pending {
        let ready = ready_line(&out, &mut child, &format!("node {id}"), &log)?;
        let url = ready["http"].as_str().unwrap_or_default().to_string();
        if let Some(p) = started.get_mut(at) {
            p.settle_address(&url);
        }
        node_urls.push((id, url, log));
    }
    // The liveness monitor, with both accounts' credentials in its environment.
    let monitor_args: Vec<String> = ["mesh", "monitor", "--json", "--dir"]
        .map(String::from)
        .into_iter()
        .chain([dir.display().to_string()])
        .collect();
    let env = [
        (crate::transport::connect::ENV_URL, app_url.clone()),
        (ENV_SYS_URL, natsd::sys_url(port, &creds)),
    ];
    let (mut child, out, log) = spawn_oam(dir, "monitor", &monitor_args, &env)?;
    started.push(Started {
        name: "monitor".into(),
        pid: child.id(),
        endpoint: "death notices on mesh.death.>".into(),
        log: log.clone(),
        cmdline_marker: format!("mesh monitor --json --dir {}", dir.display()),
        args: monitor_args.clone(),
    });
    ready_line(&out, &mut child, "the monitor", &log)?;
    // The chaos warden: applies `oam chaos` faults and undoes them on time.
    let warden_args: Vec<String> = ["chaos", "warden", "--json", "--dir"]
        .map(String::from)
        .into_iter()
        .chain([dir.display().to_string()])
        .collect();
    let env = [(crate::transport::connect::ENV_URL, app_url.clone())];
    let (mut child, out, log) = spawn_oam(dir, "chaos", &warden_args, &env)?;
    started.push(Started {
        name: "chaos".into(),
        pid: child.id(),
        endpoint: "oam chaos (oam.v1.chaos.*)".into(),
        log: log.clone(),
        cmdline_marker: format!("chaos warden --json --dir {}", dir.display()),
        args: warden_args.clone(),
    });
    ready_line(&out, &mut child, "the chaos warden", &log)?;
    // Ready means: every node sees every node.
    let http = crate::node::connector::http_client(Some(Duration::from_secs(2)))
        .map_err(|e| check(e.into()))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    for (id, url, log) in &node_urls {
        loop {
            let live = async {
                let v: serde_json::Value = http
                    .get(format!("{url}/v1/oam/state"))
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()?;
                Some(v["live_nodes"].as_array()?.len())
            }
            .await;
            if live == Some(node_ports.len()) {
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::new(
                    Kind::Check,
                    anyhow::anyhow!(
                        "node {id} did not see all {} nodes within 20 s; see {}",
                        node_ports.len(),
                        log.display()
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(Record {
        started_at_ms: crate::node::now_ms(),
        nats_port: port,
        nats_monitor_port: monitor_port,
        sim_url,
        processes: std::mem::take(started),
    })
}

fn down(a: DownArgs) -> Result<()> {
    let Some(rec) = Record::load(&a.dir).map_err(|e| Error::new(Kind::Usage, e))? else {
        let mut out = std::io::stdout().lock();
        if a.json {
            writeln!(out, "{}", serde_json::json!({"stopped": []}))?;
        } else {
            writeln!(
                out,
                "no mesh recorded in {}; nothing to stop",
                a.dir.display()
            )?;
        }
        return Ok(());
    };
    let grace = Duration::from_millis(a.grace_ms);
    let mut report = Vec::new();
    for p in rec.processes.iter().rev() {
        let how = localmesh::stop(p, grace);
        report.push((p, how));
    }
    std::fs::remove_file(Record::path(&a.dir)).map_err(|e| Error::new(Kind::Check, e))?;
    let mut out = std::io::stdout().lock();
    if a.json {
        let stopped: Vec<serde_json::Value> = report
            .iter()
            .map(|(p, how)| serde_json::json!({"name": p.name, "pid": p.pid, "how": how}))
            .collect();
        writeln!(out, "{}", serde_json::json!({ "stopped": stopped }))?;
    } else {
        for (p, how) in &report {
            let how = match how {
                Stopped::Terminated => "stopped",
                Stopped::Killed => "killed after the grace period",
                Stopped::NotRunning => "was not running",
            };
            writeln!(out, "  {:12} {:>7}  {how}", p.name, p.pid)?;
        }
        writeln!(out, "oam mesh down: logs kept in {}", a.dir.display())?;
    }
    Ok(())
}

async fn status(a: StatusArgs) -> Result<()> {
    let Some(rec) = Record::load(&a.dir).map_err(|e| Error::new(Kind::Usage, e))? else {
        return Err(Error::new(
            Kind::Unreachable,
            anyhow::anyhow!(
                "no mesh recorded in {}; start one with `oam mesh up`",
                a.dir.display()
            ),
        ));
    };
    let http = crate::node::connector::http_client(Some(Duration::from_secs(2)))
        .map_err(|e| Error::new(Kind::Check, e))?;
    let mut rows = Vec::new();
    for p in &rec.processes {
        let running = localmesh::is_ours(p);
        let detail = if !running {
            "not running".to_string()
        } else if p.name == "nats-server" {
            let ok = std::net::TcpStream::connect_timeout(
                &std::net::SocketAddr::from(([127, 0, 0, 1], rec.nats_port)),
                Duration::from_millis(500),
            )
            .is_ok();
            if ok {
                "accepting connections".into()
            } else {
                "not accepting connections".into()
            }
        } else if p.name == "monitor" {
            "watching for deaths".into()
        } else if p.name == "chaos" {
            "restores faults on time".into()
        } else if p.name == "sim" {
            match http.get(format!("{}/healthz", p.endpoint)).send().await {
                Ok(r) if r.status().is_success() => "healthy".into(),
                _ => "not answering".into(),
            }
        } else {
            match http
                .get(format!("{}/v1/oam/state", p.endpoint))
                .send()
                .await
            {
                Ok(r) => match r.json::<serde_json::Value>().await {
                    Ok(v) => {
                        let live = v["live_nodes"].as_array().map_or(0, Vec::len);
                        let verdicts: Vec<String> = v["providers"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .map(|p| {
                                format!(
                                    "{}={}",
                                    p["id"].as_str().unwrap_or("?"),
                                    p["consensus"]["verdict"].as_str().unwrap_or("?")
                                )
                            })
                            .collect();
                        format!("{live} live nodes; {}", verdicts.join(" "))
                    }
                    Err(_) => "unreadable state".into(),
                },
                Err(_) => "not answering".into(),
            }
        };
        let healthy = running && !detail.starts_with("not") && !detail.starts_with("unreadable");
        rows.push((p, running, healthy, detail));
    }
    let all_healthy = rows.iter().all(|r| r.2);
    let mut out = std::io::stdout().lock();
    if a.json {
        let procs: Vec<serde_json::Value> = rows
            .iter()
            .map(|(p, running, healthy, detail)| serde_json::json!({"name": p.name, "pid": p.pid, "endpoint": p.endpoint, "running": running, "healthy": healthy, "detail": detail}))
            .collect();
        writeln!(
            out,
            "{}",
            serde_json::json!({"healthy": all_healthy, "processes": procs})
        )?;
    } else {
        writeln!(
            out,
            "  {:12} {:>7}  {:32} STATUS",
            "PROCESS", "PID", "ENDPOINT"
        )?;
        for (p, _, _, detail) in &rows {
            writeln!(
                out,
                "  {:12} {:>7}  {:32} {detail}",
                p.name, p.pid, p.endpoint
            )?;
        }
    }
    if all_healthy {
        Ok(())
    } else {
        Err(Error::new(
            Kind::Check,
            anyhow::anyhow!("part of the mesh is down"),
        ))
    }
}

/// The environment variable holding the system-account URL for the monitor.
pub const ENV_SYS_URL: &str = "OAM_NATS_SYS_URL";

async fn monitor(a: MonitorArgs) -> Result<()> {
    use crate::transport::connect;
    let from_dir = |key: &str| localmesh::recorded_url(&a.dir, key);
    let app_url = a
        .nats_url
        .or_else(|| std::env::var(connect::ENV_URL).ok())
        .or_else(|| from_dir("app_url"))
        .unwrap_or_else(|| connect::DEFAULT_URL.to_string());
    let sys_url = a
        .sys_url
        .or_else(|| std::env::var(ENV_SYS_URL).ok())
        .or_else(|| from_dir("sys_url"))
        .ok_or_else(|| {
            Error::usage(
                "the monitor needs the system account to read $SYS advisories: pass --sys-url \
                 (or set OAM_NATS_SYS_URL), or run it beside a mesh started by `oam mesh up`",
            )
        })?;
    let app = super::nats(&app_url, "oam-monitor", false).await?;
    let sys = super::nats(&sys_url, "oam-monitor-sys", false).await?;
    let json = a.json;
    let shown = connect::redact(&app_url);
    let ready = move || {
        let mut out = std::io::stdout().lock();
        let line = serde_json::json!({"monitor": shown, "pid": std::process::id()});
        let _ = if json {
            writeln!(out, "{line}")
        } else {
            writeln!(out, "oam mesh monitor watching {shown}")
        };
        let _ = out.flush();
    };
    crate::mesh::monitor::run(app, sys, ready, crate::signal::terminated())
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))
}
