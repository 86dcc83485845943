//! A whole local cluster with one call: nats-server (generated config and credentials), the
//! provider simulator, N nodes, the liveness monitor and the chaos warden, all on 127.0.0.1,
//! recorded in one state folder; and what `oam mesh status` reports of it. `oam mesh up`,
//! `oam demo` and the tests start a cluster through `up`.

use super::natsd;
use super::roles::Role;
use super::{MeshRecord, Started, Stopped};
use crate::core::wire::NodeSnapshot;
use crate::transport::connect::{ENV_CA, ENV_URL};
pub use crate::transport::store::copies::{StreamStatus, stream_copies};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The environment variable holding the system-account URL for the monitor.
pub(crate) const ENV_SYS_URL: &str = "OAM_NATS_SYS_URL";

/// How long each process may take to say it is ready, and the nodes to see each other.
pub(super) const READY_WITHIN: Duration = Duration::from_secs(20);

/// What to start.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The state folder (created if missing).
    pub dir: PathBuf,
    pub nodes: u16,
    /// nats-servers: one, or the members of a cluster (routes between them, JetStream on each,
    /// every stream and bucket on min(3, servers) of them).
    pub servers: u16,
    /// The first server's NATS client port, the others' follow it; 0 lets each server take any
    /// free port (and say which).
    pub port: u16,
    /// The simulator's HTTP port (0: any).
    pub sim_port: u16,
    /// The first node's HTTP port; the others follow it (0: any free ports).
    pub http_port: u16,
    /// The nats-server binary; `None` looks in $OAM_NATS_SERVER, the project's .tools, PATH.
    pub nats_server: Option<PathBuf>,
    /// The `oam` binary the processes run (`super::oam_exe()` for this one).
    pub exe: PathBuf,
    /// Generate new NATS passwords even if the folder holds some. By default a folder keeps its
    /// credentials across `down` and `up`, so agents and views connected to it reconnect.
    pub new_credentials: bool,
    /// The nodes' configuration (`oam.toml`); without one they route across a simulator this
    /// mesh starts.
    pub config: Option<PathBuf>,
    /// The decision log's age and size from that configuration: the stream is made (or
    /// changed) to keep them. Without, one is made with the nodes' defaults and an existing one
    /// is left as it is.
    pub log_retention: Option<(Duration, u64)>,
    /// JetStream's fsync interval (`always` or a duration; `None`: `natsd::DEFAULT_SYNC`).
    pub sync_interval: Option<String>,
    /// Open each nats-server's HTTP monitoring port on 127.0.0.1 (any free port). Off by
    /// default: it shows anyone who reaches it every user, inbox and consumer, without a
    /// password; oam itself asks the system account.
    pub nats_monitor: bool,
}

impl Plan {
    /// Every port chosen by the kernel, `nodes` nodes, in `dir`, running this `oam`.
    pub fn any_ports(dir: PathBuf, nodes: u16, exe: PathBuf) -> Plan {
        Plan {
            dir,
            nodes,
            servers: 1,
            port: 0,
            sim_port: 0,
            http_port: 0,
            nats_server: None,
            exe,
            new_credentials: false,
            config: None,
            log_retention: None,
            sync_interval: None,
            nats_monitor: false,
        }
    }
}

/// Why a cluster did not start.
#[derive(Debug)]
pub enum UpError {
    /// The plan cannot work as asked (a port in use, a bad folder, no nats-server).
    Plan(anyhow::Error),
    /// A process failed to start or the nodes did not find each other; what was started has
    /// been stopped again.
    Start(anyhow::Error),
}

impl std::fmt::Display for UpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpError::Plan(e) | UpError::Start(e) => write!(f, "{e:#}"),
        }
    }
}

impl std::error::Error for UpError {}

/// What `up` found or did.
#[derive(Debug)]
pub enum Up {
    Started {
        record: MeshRecord,
        dir: PathBuf,
        nats_server_version: String,
    },
    /// The folder's cluster is running already (`alive` of `total` processes); nothing started.
    AlreadyRunning {
        dir: PathBuf,
        alive: usize,
        total: usize,
    },
    /// The folder's cluster was partly down: what had stopped was started again, servers
    /// first, each as it was recorded (its ports, its role's credentials).
    Repaired {
        dir: PathBuf,
        restarted: Vec<String>,
        total: usize,
    },
}

/// Start the cluster `plan` describes and wait until every node sees every node. On failure,
/// everything started is stopped again, and a folder this call made is removed if nothing was
/// written to it (what was, the servers' logs say why).
pub async fn up(plan: &Plan) -> Result<Up, UpError> {
    let fresh = !plan.dir.exists();
    let result = up_in(plan).await;
    if result.is_err() && fresh {
        // Only an empty folder goes (`remove_dir` refuses any other).
        let _ = std::fs::remove_dir(&plan.dir);
    }
    result
}

async fn up_in(plan: &Plan) -> Result<Up, UpError> {
    let plan_err = |e: anyhow::Error| UpError::Plan(e);
    std::fs::create_dir_all(&plan.dir)
        .map_err(|e| plan_err(anyhow::anyhow!("cannot create {}: {e}", plan.dir.display())))?;
    let dir = plan
        .dir
        .canonicalize()
        .map_err(|e| plan_err(anyhow::anyhow!("cannot open {}: {e}", plan.dir.display())))?;
    if let Some(rec) = MeshRecord::load(&dir).map_err(plan_err)? {
        let alive = rec.processes.iter().filter(|p| super::is_ours(p)).count();
        if alive > 0 && alive < rec.processes.len() {
            let total = rec.processes.len();
            let restarted = repair(plan, &dir, rec).await.map_err(UpError::Start)?;
            return Ok(Up::Repaired {
                dir,
                restarted,
                total,
            });
        }
        if alive > 0 {
            // Up already: a server whose JetStream went off (a full disk turns it off, and only
            // a restart turns it on) is started again, once its disk has room.
            let clustered = rec.servers.len() >= 2;
            if let Some(up) = jetstream_repaired(plan, &dir, rec.clone(), clustered).await? {
                return Ok(up);
            }
            // Put back any bucket that has gone (only the admin may create one).
            if let Some((creds, servers)) = super::creds::load(&dir)
                && let Err(e) = create_buckets(
                    &natsd::app_url(&servers, &creds),
                    plan.log_retention,
                    1,
                    &creds.nodes(),
                )
                .await
            {
                tracing::warn!("the mesh is up but its buckets could not be checked: {e:#}");
            }
            return Ok(Up::AlreadyRunning {
                dir,
                alive,
                total: rec.processes.len(),
            });
        }
        tracing::info!(
            "{} records a mesh that is no longer running; starting afresh",
            dir.display()
        );
    }
    // The nodes are started elsewhere than here: the configuration by its whole path.
    let config = match &plan.config {
        Some(path) => Some(
            path.canonicalize()
                .map_err(|e| plan_err(anyhow::anyhow!("--config {}: {e}", path.display())))?,
        ),
        None => None,
    };
    let plan = &Plan {
        config,
        ..plan.clone()
    };
    let (bin, version) = natsd::find(plan.nats_server.as_deref()).map_err(plan_err)?;
    let mut nats_ports = Vec::new();
    for i in 0..plan.servers {
        let wanted = match plan.port {
            // Any free port, but the one the folder's server had last if it is free: agents
            // and watches still pointed at it reconnect by themselves.
            0 => last_port(&dir, i, plan.servers)
                .filter(|p| !natsd::port_in_use(*p))
                .unwrap_or(0),
            first => first.checked_add(i).ok_or_else(|| {
                plan_err(anyhow::anyhow!(
                    "--port {first} leaves no room for {} servers below 65536; pick a lower \
                     port, or 0 for any free ports",
                    plan.servers
                ))
            })?,
        };
        nats_ports.push(free_or_any(wanted, "nats-server", "--port").map_err(plan_err)?);
    }
    let sim_port = free_or_any(plan.sim_port, "the simulator", "--sim-port").map_err(plan_err)?;
    let mut node_ports = Vec::new();
    for i in 0..plan.nodes {
        let wanted = match plan.http_port {
            0 => 0,
            first => first.checked_add(i).ok_or_else(|| {
                plan_err(anyhow::anyhow!(
                    "--http-port {first} leaves no room for {} nodes below 65536; pick a lower \
                     first port, or 0 for any free ports",
                    plan.nodes
                ))
            })?,
        };
        node_ports.push(free_or_any(wanted, "a node", "--http-port").map_err(plan_err)?);
    }
    let mut started = Vec::new();
    let ports = Ports {
        nats: &nats_ports,
        sim: sim_port,
        nodes: &node_ports,
    };
    let done = start_all(plan, &dir, &bin, &ports, &mut started).await;
    settle(done, dir, version, &started).await
}

/// What starting gave: the record saved and the mesh `Started`, or on failure everything in
/// `started` stopped again, newest first.
pub(super) async fn settle(
    done: anyhow::Result<MeshRecord>,
    dir: PathBuf,
    version: natsd::Version,
    started: &[Started],
) -> Result<Up, UpError> {
    match done {
        Ok(record) => {
            record.save(&dir).map_err(UpError::Start)?;
            Ok(Up::Started {
                record,
                dir,
                nats_server_version: version.to_string(),
            })
        }
        Err(e) => {
            for p in started.iter().rev() {
                super::stop(p, Duration::from_secs(2)).await;
            }
            Err(UpError::Start(e))
        }
    }
}

/// Start again what a partly running mesh in `dir` lost, as `rec` records it: its
/// nats-servers from their configs (the same ports), then each `oam` process with its
/// arguments and its role's credentials; the names started again. The record is saved with
/// the new PIDs.
pub(super) async fn repair(
    plan: &Plan,
    dir: &Path,
    mut rec: MeshRecord,
) -> anyhow::Result<Vec<String>> {
    let (bin, _) = natsd::find(plan.nats_server.as_deref())?;
    let creds = kept_credentials(dir)
        .ok_or_else(|| anyhow::anyhow!("{}", super::creds::no_cluster(dir)))?;
    let mut restarted = Vec::new();
    for s in rec.servers.clone() {
        let Some(p) = rec.processes.iter_mut().find(|p| p.name == s.name) else {
            continue;
        };
        if super::is_ours(p) {
            continue;
        }
        let log = s.dir.join("nats.log");
        let server =
            natsd::start_from(&bin, &s.dir.join("nats.conf"), &s.dir, &log, READY_WITHIN).await?;
        p.pid = server.child.id();
        restarted.push(s.name.clone());
    }
    if !restarted.is_empty() && rec.servers.len() > 1 {
        jetstream_ready(&rec.servers, &creds).await?;
    }
    let servers = rec.client_urls();
    let url_of = |role: &Role| creds.url(&servers, &role.user()).unwrap_or_default();
    for p in &mut rec.processes {
        if super::is_nats_server(&p.name) || super::is_ours(p) {
            continue;
        }
        let mut env: Vec<(&str, String)> = match p.name.as_str() {
            "sim" => Vec::new(),
            "monitor" => vec![
                (ENV_URL, url_of(&Role::Monitor)),
                (ENV_SYS_URL, creds.observer_url(&servers)),
            ],
            "chaos" => vec![(ENV_URL, url_of(&Role::Warden))],
            node => vec![(ENV_URL, url_of(&Role::Node(node.to_string())))],
        };
        if let Some(ca) = &rec.ca {
            env.push((ENV_CA, ca.display().to_string()));
        }
        let (mut child, out, log) = super::spawn_oam(&plan.exe, dir, &p.name, &p.args, &env)?;
        p.pid = child.id();
        let ready = super::ready_line(&mut child, &out, &log, &p.name, READY_WITHIN).await?;
        if let Some(url) = ready["http"].as_str().or_else(|| ready["url"].as_str()) {
            p.settle_address(url);
        }
        restarted.push(p.name.clone());
    }
    rec.save(dir)?;
    Ok(restarted)
}

/// Whether server `s`'s JetStream is on, as it says itself when asked as the system account;
/// `None` when it cannot be asked (no credentials in the folder, no answer).
async fn jetstream_on(rec: &MeshRecord, s: &super::NatsServer) -> Option<bool> {
    let creds = kept_credentials(s.dir.parent()?)?;
    let nats = tokio::time::timeout(Duration::from_secs(2), s.system_connection(&creds))
        .await
        .ok()?
        .ok()?;
    let v = natsd::server_info(&nats, &s.config_name(&rec.servers), "JSZ").await?;
    Some(v["data"]["disabled"] != true)
}

/// `restart_jetstream_off` as `up` answers it: `Repaired` if it restarted a server.
pub(super) async fn jetstream_repaired(
    plan: &Plan,
    dir: &Path,
    rec: MeshRecord,
    clustered: bool,
) -> Result<Option<Up>, UpError> {
    let total = rec.processes.len();
    let restarted = restart_jetstream_off(plan, dir, rec, clustered)
        .await
        .map_err(UpError::Start)?;
    Ok((!restarted.is_empty()).then(|| Up::Repaired {
        dir: dir.to_path_buf(),
        restarted,
        total,
    }))
}

/// Restart (SIGTERM, then start from its config) each running server of `rec` whose JetStream
/// is off, if they are `clustered` (a lone server's JetStream is every stream's only copy); one
/// whose disk is still full is left as it is, with an error that says so. The servers
/// restarted, each with why.
async fn restart_jetstream_off(
    plan: &Plan,
    dir: &Path,
    mut rec: MeshRecord,
    clustered: bool,
) -> anyhow::Result<Vec<String>> {
    if !clustered {
        return Ok(Vec::new());
    }
    let mut off = Vec::new();
    for s in &rec.servers {
        let running = rec
            .processes
            .iter()
            .any(|p| p.name == s.name && super::is_ours(p));
        if running && jetstream_on(&rec, s).await == Some(false) {
            off.push(s.clone());
        }
    }
    if off.is_empty() {
        return Ok(Vec::new());
    }
    let (bin, _) = natsd::find(plan.nats_server.as_deref())?;
    let creds = kept_credentials(dir)
        .ok_or_else(|| anyhow::anyhow!("{}", super::creds::no_cluster(dir)))?;
    let mut restarted = Vec::new();
    for s in off {
        if let Some(free) = super::free_bytes(&s.dir.join("jetstream"))
            && free < DISK_LOW
        {
            anyhow::bail!(
                "{}'s JetStream is off and its disk has {} KiB free: free space on it, then run                  `oam mesh up --dir {}` again to restart it",
                s.name,
                free >> 10,
                dir.display()
            );
        }
        let Some(p) = rec.processes.iter_mut().find(|p| p.name == s.name) else {
            continue;
        };
        super::signal(p.pid, libc::SIGTERM);
        let gone = Instant::now() + Duration::from_secs(10);
        while super::is_ours(p) && Instant::now() < gone {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if super::is_ours(p) {
            super::signal(p.pid, libc::SIGKILL);
        }
        let log = s.dir.join("nats.log");
        let server =
            natsd::start_from(&bin, &s.dir.join("nats.conf"), &s.dir, &log, READY_WITHIN).await?;
        p.pid = server.child.id();
        restarted.push(format!("{} (its JetStream was off)", s.name));
    }
    rec.save(dir)?;
    jetstream_ready(&rec.servers, &creds).await?;
    Ok(restarted)
}

/// The client port server `i` (of `servers`) of the folder's last mesh listened on, from the
/// config it left behind.
fn last_port(dir: &Path, i: u16, servers: u16) -> Option<u16> {
    let folder = if servers == 1 {
        dir.to_path_buf()
    } else {
        dir.join(format!("nats-{}", i + 1))
    };
    let conf = std::fs::read_to_string(folder.join("nats.conf")).ok()?;
    let listen = conf
        .lines()
        .find_map(|l| l.strip_prefix("listen: 127.0.0.1:"))?;
    listen.trim().parse().ok().filter(|p| *p != 0)
}

/// Check that a port asked for is free; 0 stays 0: the process binds any free port itself and
/// says which (asking for a free port first would race with everything else on the machine).
pub(super) fn free_or_any(wanted: u16, what: &str, flag: &str) -> anyhow::Result<u16> {
    if wanted != 0 && natsd::port_in_use(wanted) {
        anyhow::bail!(
            "port {wanted} for {what} is in use on 127.0.0.1; stop what holds it, or pass {flag} \
             0 for any free port (or another number)"
        );
    }
    Ok(wanted)
}

struct Ports<'a> {
    nats: &'a [u16],
    sim: u16,
    nodes: &'a [u16],
}

/// One `oam` process to start: its name in the record, arguments, environment, what the
/// operator connects to, and the marker its command line must contain.
pub(super) struct Spec<'a> {
    pub name: &'a str,
    pub args: Vec<String>,
    pub env: &'a [(&'a str, String)],
    pub endpoint: &'a str,
    pub marker: String,
}

/// A node's `oam` arguments: its id, how it routes (`--sim-url URL` or `--config FILE`), where
/// it listens, and exactly the nodes that make up the cluster (no other id is heard).
pub(super) fn node_args(id: &str, routing: &[String], listen: &str, members: &str) -> Vec<String> {
    let mut args: Vec<String> = ["node", "run", "--id", id].map(String::from).into();
    args.extend(routing.iter().cloned());
    args.extend(["--listen", listen, "--json", "--members", members].map(String::from));
    args
}

/// What a node's command line must contain to be this mesh's (`--id n1 --sim-url URL`): it
/// survives a restart on another port.
pub(super) fn node_marker(id: &str, routing: &[String]) -> String {
    format!("--id {id} {}", routing.join(" "))
}

/// The liveness monitor of the mesh in `shown_dir`, with its users of both accounts in `env`.
pub(super) fn monitor_spec<'a>(shown_dir: &str, env: &'a [(&'a str, String)]) -> Spec<'a> {
    Spec {
        name: "monitor",
        args: ["mesh", "monitor", "--json", "--dir", shown_dir]
            .map(String::from)
            .into(),
        env,
        endpoint: "death notices on mesh.death.>",
        marker: format!("mesh monitor --json --dir {shown_dir}"),
    }
}

/// Start one `oam` process, record it in `started`, and wait for its ready line.
pub(super) async fn start_oam(
    plan: &Plan,
    dir: &Path,
    started: &mut Vec<Started>,
    spec: Spec<'_>,
) -> anyhow::Result<serde_json::Value> {
    let (mut child, out, log) = super::spawn_oam(&plan.exe, dir, spec.name, &spec.args, spec.env)?;
    started.push(Started {
        name: spec.name.to_string(),
        pid: child.id(),
        endpoint: spec.endpoint.to_string(),
        log: log.clone(),
        cmdline_marker: spec.marker,
        args: spec.args,
    });
    super::ready_line(&mut child, &out, &log, spec.name, READY_WITHIN).await
}

/// Start the provider simulator on `listen` (`127.0.0.1:8081`); its URL.
pub(super) async fn start_sim(
    plan: &Plan,
    dir: &Path,
    listen: &str,
    started: &mut Vec<Started>,
) -> anyhow::Result<String> {
    let args = ["sim", "--listen", listen, "--json"];
    let host = listen.rsplit_once(':').map_or(listen, |(h, _)| h);
    let sim = Spec {
        name: "sim",
        args: args.iter().map(|s| (*s).to_string()).collect(),
        env: &[],
        endpoint: "",
        marker: format!("sim --listen {host}:"),
    };
    let ready = start_oam(plan, dir, started, sim).await?;
    let sim_url = ready["url"].as_str().unwrap_or_default().to_string();
    if let Some(p) = started.last_mut() {
        p.settle_address(&sim_url);
    }
    Ok(sim_url)
}

async fn start_all(
    plan: &Plan,
    dir: &Path,
    bin: &Path,
    ports: &Ports<'_>,
    started: &mut Vec<Started>,
) -> anyhow::Result<MeshRecord> {
    // nats-server from a generated config, credentials beside it (0600): the folder's own, kept
    // across down and up, unless new ones are asked for (or it has none). A folder from before
    // roles gave every process one password: that one is not kept.
    let legacy = dir.join(super::CREDENTIALS);
    let kept = (!plan.new_credentials && !legacy.exists())
        .then(|| kept_credentials(dir))
        .flatten();
    let _ = std::fs::remove_file(&legacy);
    let mut creds = match kept {
        Some(c) => c,
        None => natsd::Credentials::generate()?,
    };
    // The roles of what this mesh runs, and of the people who use it.
    let node_ids: Vec<String> = (1..=ports.nodes.len()).map(|i| format!("n{i}")).collect();
    let mut roles: Vec<Role> = node_ids.iter().map(|id| Role::Node(id.clone())).collect();
    roles.extend(super::roles::BESIDE_NODES);
    for role in &roles {
        creds.add(role)?;
    }
    let servers = start_servers(plan, dir, bin, ports.nats, &creds, started).await?;
    let port: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let urls = natsd::loopback(&port);
    // Every password in one file for `oam mesh up` and `oam creds`; each role's in its own
    // (agents issued earlier keep theirs, with the ports as they are now).
    save_system(dir, &urls, &creds)?;
    write_role_files(dir, &urls, None, &creds)?;
    let url_of = |role: &Role| creds.url(&urls, &role.user()).unwrap_or_default();
    create_buckets(
        &natsd::app_url(&urls, &creds),
        plan.log_retention,
        1,
        &creds.nodes(),
    )
    .await?;
    if servers.len() == 2 {
        tracing::warn!(
            "2 nats-servers make no majority once one is gone: streams keep 2 copies and stop \
             taking writes when either server dies; run 3 (`--servers 3`) to survive the loss \
             of one"
        );
    }

    let strings = |a: &[&str]| a.iter().map(|s| (*s).to_string()).collect::<Vec<_>>();
    // The nodes route by the user's configuration, or across a simulator started here.
    let (sim_url, routing) = match &plan.config {
        Some(path) => {
            let shown = path.display().to_string();
            (String::new(), vec!["--config".to_string(), shown])
        }
        None => {
            let listen = format!("127.0.0.1:{}", ports.sim);
            let url = start_sim(plan, dir, &listen, started).await?;
            (url.clone(), vec!["--sim-url".to_string(), url])
        }
    };

    // The nodes; the NATS URL with credentials travels in the environment, not argv. A node's
    // marker (`--id n1 --sim-url URL` or `--id n1 --config FILE`) names this mesh and survives
    // a restart on its new port. They start together, then each is waited for.
    // Exactly these nodes make up the cluster: no other id is heard.
    let members = node_ids.join(",");
    let mut pending = Vec::new();
    for (id, &p) in node_ids.iter().zip(ports.nodes) {
        let id = id.clone();
        let env = [(ENV_URL, url_of(&Role::Node(id.clone())))];
        let args = node_args(&id, &routing, &format!("127.0.0.1:{p}"), &members);
        let (child, out, log) = super::spawn_oam(&plan.exe, dir, &id, &args, &env)?;
        started.push(Started {
            name: id.clone(),
            pid: child.id(),
            endpoint: String::new(),
            log: log.clone(),
            cmdline_marker: node_marker(&id, &routing),
            args,
        });
        pending.push((started.len() - 1, id, child, out, log));
    }
    let mut node_urls = Vec::new();
    for (at, id, mut child, out, log) in pending {
        let what = format!("node {id}");
        let ready = super::ready_line(&mut child, &out, &log, &what, READY_WITHIN).await?;
        let url = ready["http"].as_str().unwrap_or_default().to_string();
        if let Some(p) = started.get_mut(at) {
            p.settle_address(&url);
        }
        node_urls.push((id, url, log));
    }
    // The liveness monitor, with its own users of both accounts in its environment.
    let shown_dir = dir.display().to_string();
    let env = [
        (ENV_URL, url_of(&Role::Monitor)),
        (ENV_SYS_URL, creds.observer_url(&urls)),
    ];
    start_oam(plan, dir, started, monitor_spec(&shown_dir, &env)).await?;
    // The chaos warden: applies `oam chaos` faults and undoes them on time.
    let env = [(ENV_URL, url_of(&Role::Warden))];
    let warden = Spec {
        name: "chaos",
        args: strings(&["chaos", "warden", "--json", "--dir", &shown_dir]),
        env: &env,
        endpoint: "oam chaos (oam.v1.chaos.*)",
        marker: format!("chaos warden --json --dir {shown_dir}"),
    };
    start_oam(plan, dir, started, warden).await?;
    // Ready means: every node sees every node.
    let http = crate::http::http_client(Some(Duration::from_secs(2)))?;
    let deadline = Instant::now() + READY_WITHIN;
    for (id, url, log) in &node_urls {
        loop {
            let live = live_nodes(&http, url).await;
            if live == Some(ports.nodes.len()) {
                break;
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "node {id} did not see all {} nodes within {} s; see {}",
                    ports.nodes.len(),
                    READY_WITHIN.as_secs(),
                    log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(MeshRecord {
        started_at_ms: crate::clock::now_ms(),
        servers,
        sim_url,
        processes: std::mem::take(started),
        nats_urls: Vec::new(),
        ca: None,
        hosts: None,
    })
}

/// Start the mesh's nats-servers, one after another, each recorded in `started`: one on its
/// own in `dir`, or the members of a cluster (`nats-1` ... in `dir/nats-N`), each with routes
/// to all the others (JetStream's cluster needs them named from the start, so their route
/// ports are chosen first), then wait until JetStream has a leader.
async fn start_servers(
    plan: &Plan,
    dir: &Path,
    bin: &Path,
    asked: &[u16],
    creds: &natsd::Credentials,
    started: &mut Vec<Started>,
) -> anyhow::Result<Vec<super::NatsServer>> {
    let alone = asked.len() == 1;
    let route_ports = if alone {
        vec![0]
    } else {
        natsd::free_ports(asked.len())?
    };
    // Every server here shares this disk (see `store_bytes`).
    let store_bytes = super::free_bytes(dir).map(|f| super::store_bytes(f, asked.len()));
    let servers: Vec<super::NatsServer> = asked
        .iter()
        .zip(&route_ports)
        .enumerate()
        .map(|(i, (&asked_port, &cluster_port))| {
            let (name, dir) = if alone {
                ("nats-server".to_string(), dir.to_path_buf())
            } else {
                let name = format!("nats-{}", i + 1);
                (name.clone(), dir.join(name))
            };
            super::NatsServer {
                name,
                dir,
                port: asked_port,
                monitor_port: 0,
                cluster_port,
                asked_port,
                address: None,
                peers: Vec::new(),
                tls: None,
                sync_interval: plan.sync_interval.clone(),
                store_bytes,
            }
        })
        .collect();
    let mut running = Vec::new();
    for s in &servers {
        std::fs::create_dir_all(&s.dir)?;
        let layout = natsd::Layout {
            monitor_port: plan.nats_monitor.then_some(0),
            ..s.layout(&servers, true)
        };
        let log = s.dir.join("nats.log");
        let server = natsd::start(bin, &layout, creds, &log, Duration::from_secs(15)).await?;
        started.push(Started {
            name: s.name.clone(),
            pid: server.child.id(),
            endpoint: format!(
                "nats://127.0.0.1:{}{}",
                server.port,
                monitor_shown(server.monitor_port)
            ),
            log,
            cmdline_marker: layout.config_path().display().to_string(),
            args: Vec::new(),
        });
        running.push(super::NatsServer {
            port: server.port,
            monitor_port: server.monitor_port,
            ..s.clone()
        });
    }
    if !alone {
        jetstream_ready(&running, creds).await?;
    }
    Ok(running)
}

/// What the node at `url` sees (`None`: it does not answer, or not with a snapshot).
pub async fn snapshot(http: &reqwest::Client, url: &str) -> Option<NodeSnapshot> {
    http.get(format!("{url}/v1/oam/state"))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()
}

/// The credentials a folder's earlier cluster used, if it recorded readable ones (all of them
/// are in `system.json`).
pub fn kept_credentials(dir: &Path) -> Option<natsd::Credentials> {
    let text = std::fs::read_to_string(dir.join(super::SYSTEM)).ok()?;
    let doc: serde_json::Value = serde_json::from_str(&text).ok()?;
    serde_json::from_value(doc.get("credentials")?.clone()).ok()
}

/// Write `system.json`: the admin's and the system account's URLs on `servers` and every
/// password (0600).
pub(crate) fn save_system(
    dir: &Path,
    servers: &[String],
    creds: &natsd::Credentials,
) -> anyhow::Result<()> {
    let doc = serde_json::json!({
        "app_url": natsd::app_url(servers, creds),
        "sys_url": natsd::sys_url(servers, creds),
        "credentials": creds,
    });
    super::write_private(&dir.join(super::SYSTEM), &format!("{doc:#}\n"))
}

/// Write every role user's credentials file for `servers` (`ca`: their TLS's).
pub(crate) fn write_role_files(
    dir: &Path,
    servers: &[String],
    ca: Option<&Path>,
    creds: &natsd::Credentials,
) -> anyhow::Result<()> {
    for user in creds.users.keys() {
        if let Some(role) = Role::of_user(user) {
            super::write_role_file(dir, servers, ca, creds, &role)?;
        }
    }
    Ok(())
}

/// Create every bucket the mesh and the Open Agent Mesh SDK use, and the decision log's stream
/// of each of `nodes`, as the admin, so that no other role needs to create (or may delete) a
/// stream.
pub(super) async fn create_buckets(
    admin_url: &str,
    log_retention: Option<(Duration, u64)>,
    copies: usize,
    nodes: &[String],
) -> anyhow::Result<()> {
    use crate::transport::store::{self, decisions, escalations, ledger, loops, rates};
    let refused = crate::transport::connect::Refusal::default();
    let nats =
        crate::transport::connect::connect(admin_url, "oam-mesh-up", false, &refused).await?;
    // Every store keeps as many copies as the server this connection reached knows of: one
    // that has not heard of every server yet would make them keep fewer for good.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while store::replicas(&nats) < copies && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let replicas = store::replicas(&nats);
    if replicas < copies {
        anyhow::bail!(
            "the server reached knows {replicas} of the {copies} servers the stores need"
        );
    }
    escalations::store(&nats).await?;
    ledger::open(&nats).await?;
    loops::open(&nats).await?;
    rates::open(&nats).await?;
    for (name, max_age) in store::MESH_BUCKETS {
        store::bucket(&nats, name, max_age).await?;
    }
    store::bucket(&nats, super::roles::SDK_CONTEXT_BUCKET, Duration::ZERO).await?;
    // The decision log, as the configuration says (nodes may not change a stream), else with
    // the nodes' default retention (a week, 256 MiB), shared out among the nodes.
    let (max_age, max_bytes) = log_retention.unwrap_or((
        Duration::from_secs(7 * 24 * 3600),
        decisions::DEFAULT_MAX_BYTES,
    ));
    let changed =
        decisions::open_for(&store::context(&nats), nodes, max_age, max_bytes, replicas).await?;
    if !changed.is_empty() {
        tracing::info!(
            "the decision log now keeps what [decision_log] says, shared by {} nodes ({})",
            nodes.len(),
            changed.join("; ")
        );
    }
    // The SDK's artifact store is an object store: a stream laid out as its clients expect.
    let b = super::roles::SDK_ARTIFACTS_BUCKET;
    store::context(&nats)
        .get_or_create_stream(async_nats::jetstream::stream::Config {
            name: format!("OBJ_{b}"),
            subjects: vec![format!("$O.{b}.C.>"), format!("$O.{b}.M.>")],
            allow_rollup: true,
            allow_direct: true,
            discard: async_nats::jetstream::stream::DiscardPolicy::New,
            num_replicas: replicas,
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow::anyhow!("cannot create the stream OBJ_{b}: {e}"))?;
    crate::transport::connect::flush_within(&nats, Duration::from_secs(2)).await;
    Ok(())
}

/// Wait until every server's JetStream has a meta leader and knows every member (a stream of
/// 3 replicas needs 3 known servers), at most `READY_WITHIN`.
async fn jetstream_ready(
    servers: &[super::NatsServer],
    creds: &natsd::Credentials,
) -> anyhow::Result<()> {
    jetstream_sees(servers, creds, servers.len(), READY_WITHIN).await
}

/// How a started server's endpoint shows its monitoring port, if it has one.
pub(super) fn monitor_shown(port: u16) -> String {
    if port == 0 {
        String::new()
    } else {
        format!(" (monitor http://127.0.0.1:{port})")
    }
}

/// Wait until the JetStream of each of `servers` (this host's) has a meta leader and knows
/// `members` servers, at most `within`.
pub(super) async fn jetstream_sees(
    servers: &[super::NatsServer],
    creds: &natsd::Credentials,
    members: usize,
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    for s in servers {
        // Asked of the server itself as the system account (no monitoring port needed).
        let nats = s.system_connection(creds).await?;
        loop {
            let meta = natsd::server_info(&nats, &s.config_name(servers), "JSZ")
                .await
                .map(|v| v["data"]["meta_cluster"].clone())
                .unwrap_or_default();
            let known = meta["cluster_size"].as_u64().unwrap_or(0);
            if meta["leader"].as_str().is_some_and(|l| !l.is_empty()) && known >= members as u64 {
                break;
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "{}'s JetStream had no leader among all {members} servers within {} s (it \
                     knows {known}); see {}",
                    s.name,
                    within.as_secs(),
                    s.dir.join("nats.log").display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// How many nodes the node at `url` sees alive (`None`: it does not answer).
async fn live_nodes(http: &reqwest::Client, url: &str) -> Option<usize> {
    snapshot(http, url).await.map(|s| s.live_nodes.len())
}

/// Stop every recorded process, newest first (SIGTERM, then SIGKILL after `grace`), and forget
/// the record; how each one stopped, or `None` when the folder records no cluster.
pub async fn down(dir: &Path, grace: Duration) -> anyhow::Result<Option<Vec<(Started, Stopped)>>> {
    let Some(rec) = MeshRecord::load(dir)? else {
        return Ok(None);
    };
    let mut report = Vec::new();
    for p in rec.processes.into_iter().rev() {
        let how = super::stop(&p, grace).await;
        report.push((p, how));
    }
    std::fs::remove_file(MeshRecord::path(dir))?;
    Ok(Some(report))
}

/// How every stream of the mesh keeps its copies (asked as the admin; `None` when the mesh
/// runs one server, whose streams keep one copy, or its credentials are not in `dir`).
pub(crate) async fn stream_status(
    dir: &std::path::Path,
    rec: &MeshRecord,
) -> Option<Vec<StreamStatus>> {
    use futures_util::TryStreamExt;
    if rec.servers.len() < 2 {
        return None;
    }
    let (creds, servers) = super::creds::load(dir)?;
    let refused = crate::transport::connect::Refusal::default();
    let admin = natsd::app_url(&servers, &creds);
    let connect = crate::transport::connect::connect(&admin, "oam-mesh-status", false, &refused);
    let nats = tokio::time::timeout(Duration::from_secs(2), connect)
        .await
        .ok()?
        .ok()?;
    let js = crate::transport::store::context(&nats);
    let mut names: Vec<String> =
        tokio::time::timeout(Duration::from_secs(2), js.stream_names().try_collect())
            .await
            .ok()?
            .ok()?;
    names.sort();
    let js = &js;
    let asked = names.iter().map(|name| {
        let info = async move { js.get_stream(name).await.map(|s| s.cached_info().clone()) };
        tokio::time::timeout(Duration::from_secs(2), info)
    });
    let infos = futures_util::future::join_all(asked).await;
    let mut out = Vec::new();
    for (name, info) in names.into_iter().zip(infos) {
        out.push(match info {
            Ok(Ok(info)) => stream_copies(&name, info.config.num_replicas, info.cluster),
            _ => StreamStatus {
                name: name.clone(),
                leader: None,
                replicas: 0,
                current: 0,
                behind: Vec::new(),
                healthy: false,
                detail: "does not answer: no leader, so fewer than a majority of its copies \
                         are up; it takes no writes"
                    .into(),
            },
        });
    }
    Some(out)
}

/// One process of a cluster, as `oam mesh status` reports it.
#[derive(serde::Serialize, Clone, PartialEq, Debug)]
pub struct ProcessStatus {
    pub name: String,
    pub pid: u32,
    pub endpoint: String,
    pub running: bool,
    pub healthy: bool,
    pub detail: String,
}

/// Probe every process the record lists: running (the same process we started), and healthy
/// (it answers as it should).
pub async fn status(rec: &MeshRecord) -> anyhow::Result<Vec<ProcessStatus>> {
    let http = crate::http::http_client(Some(Duration::from_secs(2)))?;
    let mut rows = Vec::new();
    for p in &rec.processes {
        let running = super::is_ours(p);
        let (healthy, detail) = if !running {
            (false, "down (the process is gone)".to_string())
        } else {
            probe(&http, rec, p).await
        };
        rows.push(ProcessStatus {
            name: p.name.clone(),
            pid: p.pid,
            endpoint: p.endpoint.clone(),
            running,
            healthy,
            detail,
        });
    }
    Ok(rows)
}

/// A server's disk with less free than this is said to be full: JetStream's writes there
/// fail, and its copies of the streams fall behind.
const DISK_LOW: u64 = 16 << 20;

/// Whether a running process answers as it should, and what it says.
async fn probe(http: &reqwest::Client, rec: &MeshRecord, p: &Started) -> (bool, String) {
    match p.name.as_str() {
        name if super::is_nats_server(name) => {
            let server = rec.servers.iter().find(|s| s.name == name);
            let addr = server.map_or_else(
                || std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                |s| std::net::SocketAddr::from((s.ip(), s.port)),
            );
            let ok = tokio::time::timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(addr),
            )
            .await
            .is_ok_and(|c| c.is_ok());
            if !ok {
                return (false, "not accepting connections".into());
            }
            match server.and_then(|s| super::free_bytes(&s.dir.join("jetstream"))) {
                Some(free) if free < DISK_LOW => (
                    false,
                    format!(
                        "accepting connections, but its disk has {} KiB free: JetStream cannot \
                         write its copies there; free space on it",
                        free >> 10
                    ),
                ),
                _ => match server {
                    Some(s) if rec.servers.len() > 1 && jetstream_on(rec, s).await == Some(false) => (
                        false,
                        "accepting connections, but its JetStream is off (nats-server turns it \
                         off when a write fails, as on a full disk, and only a restart turns it \
                         on): its streams keep one copy fewer; `oam mesh up` restarts it"
                            .into(),
                    ),
                    _ => (true, "accepting connections".into()),
                },
            }
        }
        "monitor" => (true, "watching for deaths".into()),
        "chaos" => (true, "restores faults on time".into()),
        "sim" => match http.get(format!("{}/healthz", p.endpoint)).send().await {
            Ok(r) if r.status().is_success() => (true, "healthy".into()),
            _ => (false, "not answering".into()),
        },
        _ => match snapshot(http, &p.endpoint).await {
            Some(s) => {
                let verdicts: Vec<String> = s
                    .providers
                    .iter()
                    .map(|p| format!("{}={}", p.id, p.consensus.verdict))
                    .collect();
                let live = s.live_nodes.len();
                if !s.store_faults.is_empty() {
                    // A store that takes no writes: budgets fail closed, records are lost.
                    let faults: Vec<String> = s
                        .store_faults
                        .iter()
                        .map(|(store, why)| format!("the {store} takes no writes ({why})"))
                        .collect();
                    return (false, format!("{live} live nodes; {}", faults.join("; ")));
                }
                // Why a target is down, as this node last saw it fail.
                let why: Vec<String> = s
                    .providers
                    .iter()
                    .filter(|p| p.consensus.verdict != crate::core::health::Verdict::Healthy)
                    .filter_map(|p| {
                        let f = p.last_failure.as_ref().filter(|f| f.failing > 0)?;
                        Some(format!("{}: {}", p.id, f.said(s.now_ms)))
                    })
                    .collect();
                let said = if why.is_empty() {
                    format!("{live} live nodes; {}", verdicts.join(" "))
                } else {
                    format!(
                        "{live} live nodes; {}; {}",
                        verdicts.join(" "),
                        why.join("; ")
                    )
                };
                // Every target down: nothing this node is asked can be answered.
                let down = |id: &str| {
                    s.providers.iter().any(|p| {
                        p.id == id && p.consensus.verdict == crate::core::health::Verdict::Unhealthy
                    })
                };
                let none_answers =
                    !s.providers.is_empty() && s.providers.iter().all(|p| down(&p.id));
                if none_answers {
                    return (false, format!("no target answers; {said}"));
                }
                // A route none of whose targets answers: what clients ask for by that name fails.
                let dead_routes: Vec<String> = s
                    .routes
                    .iter()
                    .filter(|(_, targets)| !targets.is_empty() && targets.iter().all(|t| down(t)))
                    .map(|(model, targets)| format!("route {model} ({})", targets.join(", ")))
                    .collect();
                if !dead_routes.is_empty() {
                    return (
                        false,
                        format!("no target answers {}; {said}", dead_routes.join(", ")),
                    );
                }
                (true, said)
            }
            None => (false, "not answering".into()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::stream_copies;

    fn cluster(leader: Option<&str>, replicas: serde_json::Value) -> serde_json::Value {
        serde_json::json!({"name": "oam", "leader": leader, "replicas": replicas})
    }

    fn copies(c: serde_json::Value) -> super::StreamStatus {
        stream_copies("S", 3, Some(serde_json::from_value(c).unwrap()))
    }

    #[test]
    fn a_stream_is_healthy_only_with_a_leader_and_every_copy_heard_from() {
        let ok = copies(cluster(
            Some("nats-1"),
            serde_json::json!([
                {"name": "nats-2", "current": true, "active": 200_000_000},
                {"name": "nats-3", "current": true, "active": 300_000_000}
            ]),
        ));
        assert!(ok.healthy, "{ok:?}");
        assert_eq!(ok.current, 3);
        // Heard from but not caught up (a full disk answers heartbeats and writes nothing):
        // not current.
        let lagging = copies(cluster(
            Some("nats-1"),
            serde_json::json!([
                {"name": "nats-2", "current": true, "active": 200_000_000},
                {"name": "nats-3", "current": false, "active": 300_000_000, "lag": 40}
            ]),
        ));
        assert_eq!(lagging.behind, ["nats-3 (not current, 40 entries behind)"]);
        assert_eq!(lagging.current, 2);
        // A full disk: the copy there stopped, silent since.
        let full = copies(cluster(
            Some("nats-1"),
            serde_json::json!([
                {"name": "nats-2", "current": true, "active": 200_000_000},
                {"name": "nats-3", "current": false, "active": 10_000_000_000u64, "lag": 14}
            ]),
        ));
        assert!(!full.healthy);
        assert_eq!(full.current, 2);
        assert!(
            full.detail
                .contains("loss of one more server stops its writes"),
            "{full:?}"
        );
        assert!(
            full.detail
                .contains("nats-3 (14 entries behind, silent 10 s)"),
            "{full:?}"
        );
        // A server that died: not heard from since a new leader, or held offline.
        let dead = copies(cluster(
            Some("nats-3"),
            serde_json::json!([
                {"name": "nats-1", "current": true, "active": 50_000_000},
                {"name": "nats-2", "current": false, "active": 0, "lag": 2}
            ]),
        ));
        assert_eq!(dead.behind, ["nats-2 (not heard from)"]);
        let offline = copies(cluster(
            Some("nats-3"),
            serde_json::json!([{"name": "nats-1", "current": false, "active": 0, "offline": true},
                {"name": "nats-2", "current": false, "active": 0, "offline": true}]),
        ));
        assert_eq!(offline.current, 1);
        assert!(
            offline.detail.contains("takes no writes until 2 are"),
            "{offline:?}"
        );
        // No leader: no writes.
        let none = copies(cluster(None, serde_json::json!([])));
        assert!(
            !none.healthy && none.detail.contains("takes no writes"),
            "{none:?}"
        );
    }
}
