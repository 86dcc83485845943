//! The chaos warden: the one process of a local mesh that applies faults and undoes them on
//! time. It answers `oam.v1.chaos.{inject,list,restore}`, keeps what it must undo in
//! `DIR/chaos.json` (so a restarted warden still restores), and checks expiries every 100 ms.

use crate::bench::load as bench;
use crate::clock::now_ms;
use crate::core::chaos::{
    Active, Aim, ContractBreak, Event, Fault, Inject, MAX_FOR, NodeCommand, Params, Restore,
    TargetFault, WardenReply,
};
use crate::local::{self, MeshRecord, Started};
use crate::mesh::{monitor, store};
use crate::sim::model::{FaultMode, SetFault};
use crate::transport::connect::flush_within;
use crate::transport::published::subscribe;
use crate::transport::subjects;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Bounds on the load faults.
pub(crate) const MAX_REQUESTS: u32 = 100_000;
pub(crate) const MAX_CONCURRENCY: u32 = 1_000;
const STATE: &str = "chaos.json";

/// How to undo a fault.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(tag = "undo", rename_all = "kebab-case")]
enum Undo {
    /// The simulator ends the fault by itself; an early restore clears it.
    SimFault { sim_url: String, provider: String },
    /// SIGCONT a stopped process (if it is still the one we stopped).
    Resume { pid: u32, marker: String },
    /// Start the recorded node again.
    RestartNode { name: String },
    /// Start a killed agent process again with its command line.
    RestartAgent { agent: String, args: Vec<String> },
    /// Nodes end it by themselves; an early restore tells them (over NATS, and over HTTP to a
    /// node that cannot hear NATS because it is isolated).
    Nodes {
        http: Option<String>,
        /// The isolation's key, which a restore over HTTP carries.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        key: String,
    },
    /// A bounded load task; ends by itself, or is stopped.
    Load,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
struct Injected {
    active: Active,
    undo: Undo,
}

pub(crate) struct Warden {
    dir: PathBuf,
    nats: async_nats::Client,
    /// The application URL with credentials, for processes it starts again.
    app_url: String,
    http: reqwest::Client,
    entries: Vec<Injected>,
    loads: BTreeMap<String, tokio::task::JoinHandle<()>>,
    /// Processes this warden started again, reaped as they exit.
    children: Vec<std::process::Child>,
    /// Agent processes it started again (not in the mesh record): stopped with the warden.
    agents: Vec<std::process::Child>,
    /// The system account's observer: which process holds an instance's connection.
    sys: Option<async_nats::Client>,
}

fn err(message: impl Into<String>) -> WardenReply {
    WardenReply::Error(message.into())
}

/// What an injection does, decided before anything is touched.
#[derive(Clone, PartialEq, Debug)]
enum InjectAction {
    /// Set this fault on the simulator (which ends it on time by itself).
    Sim { fault: SetFault, detail: String },
    /// SIGKILL (restarted at expiry) or SIGSTOP (resumed) the target node.
    SignalNode { kill: bool },
    /// Cut the target node off from NATS.
    Isolate,
    /// SIGKILL (restarted at expiry) or SIGSTOP (resumed) a process serving the target agent.
    SignalAgent { kill: bool },
    /// Treat the target agent's budget as spent on every node.
    DrainBudget,
    /// Load from the warden itself (`traffic-spike`, `agent-loop`).
    Load(Fault),
}

/// An injection, planned: the resolved target and the action.
#[derive(Clone, PartialEq, Debug)]
struct Planned {
    target: String,
    action: InjectAction,
}

/// Whether the command line `argv` is `oam agent [FLAGS] serve [FLAGS] AGENT ...` (whatever
/// the executable is called; `runs_this_executable` checks which it is): the only kind of
/// process the warden signals for an agent fault. AGENT is the one argument after `serve` that
/// is neither a flag nor a flag's value.
fn serves_agent(argv: &[String], agent: &str) -> bool {
    if argv.get(1).is_none_or(|a| a != "agent") {
        return false;
    }
    let Some(serve) = argv.iter().skip(2).position(|a| a == "serve") else {
        return false;
    };
    let rest = &argv[serve + 3..];
    // `agent serve` flags that take no value; every other `--flag` takes the next argument.
    let switch = |a: &str| a == "--json" || a.starts_with("--") && a.contains('=');
    let mut positional = Vec::new();
    let mut i = 0;
    while i < rest.len() {
        let a = rest[i].as_str();
        if a.starts_with('-') {
            i += if switch(a) { 1 } else { 2 };
        } else {
            positional.push(a);
            i += 1;
        }
    }
    positional.first() == Some(&agent)
}

/// Whether process `pid` runs the executable this warden runs: the same file (device and
/// inode of `/proc/PID/exe`), even when the binary was replaced on disk since.
fn runs_this_executable(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let theirs = std::fs::metadata(format!("/proc/{pid}/exe"));
    let ours = std::fs::metadata("/proc/self/exe");
    matches!((theirs, ours), (Ok(a), Ok(b)) if (a.dev(), a.ino()) == (b.dev(), b.ino()))
}

/// Does process `pid` hold the TCP socket whose local end is 127.0.0.1:`port` (its inode in
/// `/proc/net/tcp`, among the process's open files)?
fn holds_local_port(pid: u32, port: u16) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return false;
    };
    // `sl local_address rem_address st ... inode`: local 127.0.0.1:port is `0100007F:PPPP`.
    let local = format!("0100007F:{port:04X}");
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(1) == Some(&local.as_str())).then(|| f.get(9).map(|s| (*s).to_string()))?
        })
        .collect();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .any(|target| {
            let t = target.to_string_lossy();
            inodes.iter().any(|i| t == format!("socket:[{i}]"))
        })
}

/// A fault the warden will not inject, and what to do instead.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
struct NotInjected(String);

impl From<String> for NotInjected {
    fn from(why: String) -> NotInjected {
        NotInjected(why)
    }
}

/// Check `req` against the bounds and what is `active`, resolve its target and settings: pure,
/// so every refusal and default is tested without a mesh. An error says what to do instead.
fn plan(req: &Inject, active: &[&Active]) -> Result<Planned, NotInjected> {
    let for_ms = req.for_ms;
    if for_ms == 0 || u128::from(for_ms) > MAX_FOR.as_millis() {
        return Err(NotInjected(format!(
            "--for must be between 1 ms and {} s",
            MAX_FOR.as_secs()
        )));
    }
    let (fault, p) = (req.fault, &req.params);
    if p.requests.is_some_and(|n| n == 0 || n > MAX_REQUESTS)
        || p.concurrency.is_some_and(|n| n == 0 || n > MAX_CONCURRENCY)
    {
        return Err(NotInjected(format!(
            "--requests must be 1 to {MAX_REQUESTS} and --concurrency 1 to {MAX_CONCURRENCY}"
        )));
    }
    let given = req.target.clone().filter(|t| !t.is_empty());
    let target = match (
        fault.aim(),
        given.or(fault.default_target().map(String::from)),
    ) {
        (Aim::Mesh, _) => "mesh".to_string(),
        (_, Some(t)) => t,
        (aim, None) => {
            return Err(NotInjected(format!(
                "{} needs a target: {}",
                fault.name(),
                match aim {
                    Aim::Provider => "a provider (e.g. primary)",
                    Aim::Node => "a node (e.g. n2)",
                    Aim::Agent => "an agent name (e.g. demo.echo)",
                    _ => "an agent name as callers send it (e.g. support-bot)",
                }
            )));
        }
    };
    if fault == Fault::IsolateNode
        && let Some(a) = active
            .iter()
            .find(|a| a.fault == fault && a.target == target)
    {
        return Err(NotInjected(format!(
            "{} is already isolated ({}); `oam chaos restore {}` first",
            a.target, a.id, a.id
        )));
    }
    let sim = |mode: FaultMode, detail: String| InjectAction::Sim {
        fault: SetFault {
            provider: target.clone(),
            duration_ms: for_ms,
            times: None,
            mode,
        },
        detail,
    };
    let action = match fault {
        Fault::KillProvider => sim(FaultMode::Error { status: 500 }, "hard 500s".into()),
        Fault::BreakContract => {
            let kind = p.mode.unwrap_or(ContractBreak::MissingField);
            let detail = format!("200 with a broken contract ({})", kind.as_str());
            sim(FaultMode::Contract { kind }, detail)
        }
        Fault::SlowProvider => {
            let ms = p.ms.unwrap_or(2_000);
            sim(
                FaultMode::Slow { extra_ms: ms },
                format!("+{ms} ms latency"),
            )
        }
        Fault::HangProvider => sim(FaultMode::Hang, "accepts and never answers".into()),
        Fault::FlakyProvider => {
            let rate = p.error_rate.unwrap_or(0.3);
            if !(0.0..=1.0).contains(&rate) {
                return Err(NotInjected(format!(
                    "--error-rate {rate}: use a share between 0 and 1"
                )));
            }
            let detail = format!("{:.0}% of requests fail", rate * 100.0);
            sim(FaultMode::Flaky { error_rate: rate }, detail)
        }
        Fault::RateLimitProvider => {
            let ms = p.retry_after_ms.unwrap_or(1_000);
            let detail = format!("429 with Retry-After {ms} ms");
            sim(FaultMode::RateLimit { retry_after_ms: ms }, detail)
        }
        Fault::BreakStream => {
            let kind = p.stream.unwrap_or_default();
            let after = p.after_chunks.unwrap_or(4);
            let detail = format!("streams {} after {after} events", kind.as_str());
            sim(
                FaultMode::Stream {
                    kind,
                    after_chunks: after,
                },
                detail,
            )
        }
        Fault::KillNode => InjectAction::SignalNode { kill: true },
        Fault::StopNode => InjectAction::SignalNode { kill: false },
        Fault::IsolateNode => InjectAction::Isolate,
        Fault::KillAgent => InjectAction::SignalAgent { kill: true },
        Fault::StopAgent => InjectAction::SignalAgent { kill: false },
        Fault::DrainBudget => InjectAction::DrainBudget,
        Fault::AgentLoop | Fault::TrafficSpike => InjectAction::Load(fault),
    };
    Ok(Planned { target, action })
}

/// What a simulator's fault mode is as a fault of a node's own calls; `None` for those only
/// an upstream can do (a broken contract or stream, a refusal, a reset).
fn target_fault(mode: &FaultMode) -> Option<TargetFault> {
    Some(match *mode {
        FaultMode::Error { status } => TargetFault::Error { status },
        FaultMode::Slow { extra_ms } => TargetFault::Slow { extra_ms },
        FaultMode::Hang => TargetFault::Hang,
        FaultMode::RateLimit { retry_after_ms } => TargetFault::RateLimit { retry_after_ms },
        FaultMode::Flaky { error_rate } => TargetFault::Flaky { error_rate },
        FaultMode::Contract { .. }
        | FaultMode::Stream { .. }
        | FaultMode::Reset
        | FaultMode::Refuse { .. } => return None,
    })
}

/// Why the warden could not start or go on (what a client of it is told is
/// `transport::chaos::WardenError`).
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartError {
    #[error("cannot make the HTTP client: {0}")]
    Http(#[from] reqwest::Error),
    /// NATS refused or failed it (a subscription, a flush), as it said.
    #[error("{0}")]
    Bus(String),
}

said_as!(StartError::Bus: async_nats::SubscribeError, async_nats::client::FlushError);

impl Warden {
    pub(crate) fn new(
        dir: PathBuf,
        nats: async_nats::Client,
        app_url: String,
    ) -> Result<Warden, StartError> {
        let entries = match std::fs::read_to_string(dir.join(STATE)) {
            Ok(text) => serde_json::from_str(&text).unwrap_or_else(|e| {
                tracing::warn!("ignoring an unreadable {STATE}: {e}");
                Vec::new()
            }),
            Err(_) => Vec::new(),
        };
        Ok(Warden {
            dir,
            nats,
            app_url,
            http: crate::http::http_client(Some(Duration::from_secs(5)))?,
            entries,
            loads: BTreeMap::new(),
            children: Vec::new(),
            agents: Vec::new(),
            sys: None,
        })
    }

    fn save(&self) {
        let path = self.dir.join(STATE);
        let tmp = self.dir.join(format!("{STATE}.tmp"));
        let text = serde_json::to_string_pretty(&self.entries).unwrap_or_else(|_| "[]".into());
        if std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .is_err()
        {
            tracing::warn!("cannot write {}", path.display());
        }
    }

    async fn announce(&self, kind: &str, fault: &Active) {
        let ev = Event {
            kind: kind.into(),
            fault: fault.clone(),
            at_ms: now_ms(),
        };
        if let Ok(b) = serde_json::to_vec(&ev) {
            let _ = self.nats.publish(subjects::CHAOS_EVENT, b.into()).await;
        }
    }

    fn record(&self) -> Result<MeshRecord, WardenReply> {
        match MeshRecord::load(&self.dir) {
            Ok(Some(r)) => Ok(r),
            Ok(None) => Err(err(format!("no mesh recorded in {}", self.dir.display()))),
            Err(e) => Err(err(format!("{e:#}"))),
        }
    }

    fn node(&self, name: &str) -> Result<Started, WardenReply> {
        let rec = self.record()?;
        let names: Vec<String> = rec.nodes().map(|n| n.name.clone()).collect();
        rec.nodes()
            .find(|n| n.name == name)
            .cloned()
            .ok_or_else(|| {
                err(format!(
                    "no node {name:?} in this mesh; the nodes are {}",
                    names.join(", ")
                ))
            })
    }

    /// Does process `pid` hold the NATS connection the server knows as instance `id`
    /// (`oam-host-{id}`)? Asked of the server through the system account; without it, nothing
    /// can be verified and the answer is no.
    async fn holds_instance(&self, pid: u32, id: &str) -> bool {
        let Some(sys) = &self.sys else {
            tracing::warn!("no system-account access: an instance's process cannot be verified");
            return false;
        };
        match monitor::connection_port(sys, &subjects::host_connection(id)).await {
            Some(port) => holds_local_port(pid, port),
            None => false,
        }
    }

    /// One running instance of `agent` served by oam on this machine: (pid, its command line).
    async fn agent_process(&self, agent: &str) -> Result<(u32, Vec<String>), WardenReply> {
        let host = store::hostname();
        let records = store::all_instances(&store::Mesh::new(self.nats.clone()))
            .await
            .unwrap_or_default();
        let local: Vec<_> = records
            .iter()
            .filter(|r| r.host.as_deref() == Some(host) && r.pid.is_some())
            .collect();
        for r in local.iter().filter(|r| r.agents.iter().any(|a| a == agent)) {
            let pid = r.pid.unwrap_or_default();
            if let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) {
                let argv: Vec<String> = raw
                    .split(|b| *b == 0)
                    .filter(|a| !a.is_empty())
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                // A record is a claim anyone on the bus can write: the process must be this
                // very oam serving that agent, and hold the connection the server knows as
                // that instance, or it is not touched.
                if serves_agent(&argv, agent)
                    && runs_this_executable(pid)
                    && self.holds_instance(pid, &r.instance_id).await
                {
                    return Ok((pid, argv));
                }
                tracing::warn!(
                    agent,
                    pid,
                    instance = %r.instance_id,
                    "an instance record names a process that is not this oam serving the agent; \
                     it is left alone"
                );
            }
        }
        let mut names: Vec<&str> = local
            .iter()
            .flat_map(|r| r.agents.iter().map(String::as_str))
            .collect();
        names.sort();
        names.dedup();
        Err(err(if names.is_empty() {
            format!(
                "no agent {agent:?} served by oam on this machine (none is: start one with \
                 `oam agent serve NAME --demo echo`)"
            )
        } else {
            format!(
                "no agent {agent:?} served by oam on this machine; these are: {}",
                names.join(", ")
            )
        }))
    }

    /// Does this mesh's simulator serve `provider` (a provider's id, or `provider/model`)?
    async fn sim_serves(&self, provider: &str) -> Result<bool, WardenReply> {
        let sim_url = self.record()?.sim_url;
        if sim_url.is_empty() {
            return Ok(false);
        }
        let host = provider.split_once('/').map_or(provider, |(p, _)| p);
        let resp = self
            .http
            .get(format!("{sim_url}/sim/faults"))
            .send()
            .await
            .map_err(|e| err(format!("the simulator at {sim_url} did not answer: {e}")))?;
        let v: serde_json::Value = resp.json().await.unwrap_or_default();
        Ok(v["providers"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p == host)))
    }

    /// Ok when a node of this mesh routes to `provider` (a provider's id, or one target's),
    /// asked of the first node that answers; else the refusal that lists what they route to.
    async fn nodes_serve(&self, provider: &str) -> Result<(), WardenReply> {
        let rec = self.record()?;
        for n in rec.nodes() {
            let state = self
                .http
                .get(format!("{}/v1/oam/state", n.endpoint))
                .send()
                .await;
            let Ok(state) = state else { continue };
            let v: serde_json::Value = state.json().await.unwrap_or_default();
            let ids: Vec<&str> = v["providers"]
                .as_array()
                .map(|p| p.iter().filter_map(|p| p["id"].as_str()).collect())
                .unwrap_or_default();
            // A provider (every target of it), or one target (`provider/model`).
            let of =
                |id: &str| id == provider || id.split_once('/').map_or(id, |(p, _)| p) == provider;
            if ids.iter().any(|id| of(id)) {
                return Ok(());
            }
            return Err(err(format!(
                "no provider {provider:?} on this mesh's nodes; their targets are {}",
                ids.join(", ")
            )));
        }
        Err(err(
            "no node of this mesh answered to say what it routes to",
        ))
    }

    async fn sim_fault(&self, body: SetFault) -> Result<Undo, WardenReply> {
        let sim_url = self.record()?.sim_url;
        if sim_url.is_empty() {
            return Err(err(
                "this mesh's nodes run on your configuration (`oam mesh up --config`), with no \
                 simulator: provider faults need a mesh started without --config",
            ));
        }
        let resp = self
            .http
            .post(format!("{sim_url}/sim/faults"))
            .json(&body)
            .send()
            .await
            .map_err(|e| err(format!("the simulator at {sim_url} did not answer: {e}")))?;
        if !resp.status().is_success() {
            let v: serde_json::Value = resp.json().await.unwrap_or_default();
            return Err(err(v["error"]["message"]
                .as_str()
                .unwrap_or("the simulator refused the fault")
                .to_string()));
        }
        Ok(Undo::SimFault {
            sim_url,
            provider: body.provider,
        })
    }

    async fn node_command(&self, to: &str, cmd: &NodeCommand) {
        if let Ok(b) = serde_json::to_vec(cmd) {
            let _ = self.nats.publish(subjects::chaos_node(to), b.into()).await;
            flush_within(&self.nats, Duration::from_secs(1)).await;
        }
    }

    /// Apply `req`: plan it (pure), then do it; the active fault, or why not.
    async fn inject(&mut self, req: Inject) -> WardenReply {
        let active: Vec<&Active> = self.entries.iter().map(|e| &e.active).collect();
        let Planned { target, action } = match plan(&req, &active) {
            Ok(p) => p,
            Err(why) => return err(why.0),
        };
        let (fault, for_ms) = (req.fault, req.for_ms);
        let now = now_ms();
        let id = format!("c{}", crate::ids::random_hex(3).unwrap_or_default());
        let (undo, detail) = match self
            .apply(action, &target, &id, &req.params, now, for_ms)
            .await
        {
            Ok(x) => x,
            Err(e) => return e,
        };
        let active = Active {
            id,
            fault,
            target,
            params: req.params,
            injected_at_ms: now,
            expires_at_ms: now + for_ms,
            detail,
        };
        tracing::info!(id = %active.id, fault = fault.name(), target = %active.target, for_ms, detail = %active.detail, "injected");
        self.entries.push(Injected {
            active: active.clone(),
            undo,
        });
        self.save();
        self.announce("injected", &active).await;
        WardenReply::Ok(vec![active])
    }

    /// Do what `plan` decided: the undo to record and what was done, in words.
    async fn apply(
        &mut self,
        action: InjectAction,
        target: &str,
        id: &str,
        params: &Params,
        now: u64,
        for_ms: u64,
    ) -> Result<(Undo, String), WardenReply> {
        match action {
            InjectAction::Sim { mut fault, detail } => {
                // The simulator's providers meet it there; any other target (the team's own
                // providers, a tool server) in every node's calls of it.
                if self.sim_serves(&fault.provider).await? {
                    // It ends when the warden says it expires (at `now + for_ms`), not later
                    // by the time the question took: the simulator's clock starts at its POST.
                    let asked_ms = now_ms().saturating_sub(now);
                    fault.duration_ms = fault.duration_ms.saturating_sub(asked_ms).max(1);
                    return self.sim_fault(fault).await.map(|u| (u, detail));
                }
                self.nodes_serve(target).await?;
                let injected = target_fault(&fault.mode).ok_or_else(|| {
                    err(format!(
                        "{target} is not one of this mesh's simulator's providers, and only an \
                         upstream can answer with {detail}: nodes fail, slow, hang, rate-limit \
                         or flake their own calls of a target (kill-, slow-, hang-, \
                         rate-limit- or flaky-provider)"
                    ))
                })?;
                let cmd = NodeCommand::FailTarget {
                    id: id.to_string(),
                    target: target.to_string(),
                    fault: injected,
                    until_ms: now + for_ms,
                };
                self.node_command("all", &cmd).await;
                let undo = Undo::Nodes {
                    http: None,
                    key: String::new(),
                };
                Ok((undo, format!("{detail}, in every node's calls of {target}")))
            }
            InjectAction::SignalNode { kill } => {
                let n = self.node(target)?;
                if !local::is_ours(&n) {
                    return Err(err(format!(
                        "node {target} (pid {}) is down already; `oam mesh status` shows the mesh",
                        n.pid
                    )));
                }
                if kill {
                    local::signal(n.pid, libc::SIGKILL);
                    let undo = Undo::RestartNode {
                        name: n.name.clone(),
                    };
                    Ok((undo, format!("SIGKILL pid {}", n.pid)))
                } else {
                    local::signal(n.pid, libc::SIGSTOP);
                    let undo = Undo::Resume {
                        pid: n.pid,
                        marker: n.cmdline_marker.clone(),
                    };
                    Ok((undo, format!("SIGSTOP pid {}", n.pid)))
                }
            }
            InjectAction::Isolate => {
                let n = self.node(target)?;
                let key = crate::ids::unguessable();
                let cmd = NodeCommand::Isolate {
                    id: id.to_string(),
                    until_ms: now + for_ms,
                    key: key.clone(),
                };
                self.node_command(target, &cmd).await;
                let undo = Undo::Nodes {
                    http: Some(n.endpoint.clone()),
                    key,
                };
                Ok((undo, "cut off from NATS".into()))
            }
            InjectAction::SignalAgent { kill } => {
                let (pid, argv) = self.agent_process(target).await?;
                if kill {
                    local::signal(pid, libc::SIGKILL);
                    let undo = Undo::RestartAgent {
                        agent: target.to_string(),
                        args: argv.into_iter().skip(1).collect(),
                    };
                    Ok((undo, format!("SIGKILL pid {pid}")))
                } else {
                    local::signal(pid, libc::SIGSTOP);
                    let undo = Undo::Resume {
                        pid,
                        marker: argv.get(1..).map(|a| a.join(" ")).unwrap_or_default(),
                    };
                    Ok((undo, format!("SIGSTOP pid {pid}")))
                }
            }
            InjectAction::DrainBudget => {
                let cmd = NodeCommand::DrainBudget {
                    id: id.to_string(),
                    agent: target.to_string(),
                    until_ms: now + for_ms,
                };
                self.node_command("all", &cmd).await;
                Ok((
                    Undo::Nodes {
                        http: None,
                        key: String::new(),
                    },
                    "budget spent on every node".into(),
                ))
            }
            InjectAction::Load(fault) => self
                .start_load(fault, target, id, params.clone(), for_ms)
                .map(|detail| (Undo::Load, detail)),
        }
    }

    /// Bounded load from the warden itself, so it goes on without the `oam chaos` process.
    fn start_load(
        &mut self,
        fault: Fault,
        target: &str,
        id: &str,
        p: Params,
        for_ms: u64,
    ) -> Result<String, WardenReply> {
        let rec = self.record()?;
        let urls: Vec<String> = rec.nodes().map(|n| n.endpoint.clone()).collect();
        if urls.is_empty() {
            return Err(err("this mesh has no nodes to send load to"));
        }
        let http = self.http.clone();
        let (task, detail) = if fault == Fault::TrafficSpike {
            let (requests, concurrency) = (p.requests, p.concurrency);
            let detail = format!(
                "{} background requests, {} at once",
                requests.map_or("10 x concurrency".into(), |n| n.to_string()),
                concurrency.map_or("twice the nodes' background slots".into(), |c| c
                    .to_string()),
            );
            let task = tokio::spawn(async move {
                let concurrency = match concurrency {
                    Some(c) => c.max(1) as usize,
                    None => spike_concurrency(&http, &urls).await,
                };
                let requests = requests.map_or(concurrency * 10, |n| n as usize);
                let plan = bench::LoadPlan {
                    urls,
                    requests,
                    concurrency,
                    rate_per_s: None,
                    max_duration_ms: Some(for_ms),
                    agent: "spike".into(),
                    model: "auto".into(),
                    task: "spike".into(),
                    risk: crate::core::request::Risk::Low,
                    priority: crate::core::request::Priority::Background,
                    seed: now_ms(),
                    timeout_ms: 10_000,
                    mix: Vec::new(),
                    stream: false,
                };
                // Ended early by aborting this task (restore), or at its deadline.
                let never = tokio_util::sync::CancellationToken::new();
                let r = bench::run(plan, bench::Through::Http(http), &never, || {}).await;
                tracing::info!(
                    sent = r.sent,
                    succeeded = r.succeeded,
                    concurrency,
                    "traffic spike done"
                );
            });
            (task, detail)
        } else {
            // The same failing high-risk call, again and again, spread over every node in
            // turn (loop counts are the cluster's): under its own JSON contract it asks for a
            // confidence no answer reaches.
            let requests = p.requests.unwrap_or(8);
            let names: Vec<&str> = rec.nodes().map(|n| n.name.as_str()).collect();
            let detail = format!(
                "{requests} identical failing high-risk calls, in turn to {}",
                names.join(", ")
            );
            let urls: Vec<String> = urls
                .iter()
                .map(|u| format!("{u}/v1/chat/completions"))
                .collect();
            let body = json!({
                "model": "auto",
                "messages": [{"role": "user", "content": format!("chaos {id}: approve refund 5531 with certainty")}],
                "oam": {"agent": target, "task": "refund", "risk": "high",
                        "contract": {"min_confidence": 0.999},
                        "policy": {"min_confidence": 0.999, "max_attempts": 1}},
            });
            // One call at a time (each sees the ones before it), paced to end well within
            // the fault's time however long each takes: the (k+1)th is sent k intervals after
            // the first, or as soon as the kth has its answer.
            let every =
                Duration::from_millis((for_ms / (u64::from(requests) + 1)).clamp(50, 1_000));
            let task = tokio::spawn(async move {
                let start = tokio::time::Instant::now();
                for (k, url) in urls.iter().cycle().take(requests as usize).enumerate() {
                    tokio::time::sleep_until(start + every * k as u32).await;
                    let _ = http.post(url).json(&body).send().await;
                }
            });
            (task, detail)
        };
        self.loads.insert(id.to_string(), task);
        Ok(detail)
    }

    /// Undo one fault; `early` when asked before its expiry.
    async fn undo(&mut self, e: &Injected, early: bool) {
        match &e.undo {
            Undo::SimFault { sim_url, provider } => {
                if early {
                    let _ = self
                        .http
                        .delete(format!("{sim_url}/sim/faults/{provider}"))
                        .send()
                        .await;
                }
            }
            Undo::Resume { pid, marker } => {
                if local::is_running(*pid, marker) {
                    local::signal(*pid, libc::SIGCONT);
                }
            }
            Undo::RestartNode { name } => self.restart_node(name).await,
            Undo::RestartAgent { agent, args } => {
                let url = self.url_for(&local::roles::Role::Agent(agent.clone()));
                let env = [(crate::transport::connect::ENV_URL, url)];
                let log_name = format!("agent-{agent}");
                let exe = local::oam_exe();
                match exe.and_then(|exe| local::spawn_oam(&exe, &self.dir, &log_name, args, &env)) {
                    Ok((child, _, _)) => self.agents.push(child),
                    Err(e) => tracing::warn!("cannot start agent {agent} again: {e:#}"),
                }
            }
            Undo::Nodes { http, key } => {
                let cmd = NodeCommand::Restore {
                    id: e.active.id.clone(),
                    key: key.clone(),
                };
                self.node_command("all", &cmd).await;
                if let Some(http) = http {
                    let _ = self
                        .http
                        .post(format!("{http}/v1/oam/chaos"))
                        .json(&cmd)
                        .send()
                        .await;
                }
            }
            Undo::Load => {
                if let Some(task) = self.loads.remove(&e.active.id) {
                    task.abort();
                }
            }
        }
    }

    /// The NATS URL a process of `role` is started with again: its credentials file in the
    /// mesh folder, else the URL the warden itself was given.
    fn url_for(&self, role: &local::roles::Role) -> String {
        local::read_role_file(&local::role_path(&self.dir, &role.user()))
            .map_or_else(|_| self.app_url.clone(), |f| f.url)
    }

    async fn restart_node(&mut self, name: &str) {
        let Ok(mut rec) = self.record() else {
            return;
        };
        let Some(n) = rec.processes.iter_mut().find(|p| p.name == name) else {
            return;
        };
        if local::is_ours(n) {
            return; // someone started it already
        }
        let url = self.url_for(&local::roles::Role::Node(name.to_string()));
        let env = [(crate::transport::connect::ENV_URL, url)];
        // Its old port came from the kernel's pool; if something took it meanwhile, the node
        // comes back on any free port (and the record says which).
        for attempt in 0..2 {
            if attempt == 1 {
                tracing::warn!(
                    node = name,
                    "its old address is taken; starting it on a free port"
                );
                n.set_listen("127.0.0.1:0");
            }
            let spawned = local::oam_exe()
                .and_then(|exe| local::spawn_oam(&exe, &self.dir, name, &n.args, &env));
            let (mut child, out, log) = match spawned {
                Ok(started) => started,
                Err(e) => {
                    tracing::warn!("cannot start {name} again: {e:#}");
                    return;
                }
            };
            let ready = local::ready_line(&mut child, &out, &log, name, Duration::from_secs(10))
                .await
                .ok();
            let exited = !matches!(child.try_wait(), Ok(None));
            n.pid = child.id();
            self.children.push(child);
            if let Some(url) = ready.as_ref().and_then(|r| r["http"].as_str()) {
                n.settle_address(url);
                break;
            }
            if !exited {
                break; // slow, not failed: leave it be
            }
        }
        if let Err(e) = rec.save(&self.dir) {
            tracing::warn!("cannot record the new pid of {name}: {e:#}");
        }
        tracing::info!(node = name, "started again");
    }

    /// End what is due; reap what exited.
    async fn expire(&mut self) {
        let now = now_ms();
        let (due, keep): (Vec<Injected>, Vec<Injected>) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|e| e.active.expires_at_ms <= now);
        self.entries = keep;
        for e in &due {
            self.undo(e, false).await;
            tracing::info!(id = %e.active.id, fault = e.active.fault.name(), "expired and restored");
            self.announce("expired", &e.active).await;
        }
        if !due.is_empty() {
            self.save();
        }
        self.children
            .retain_mut(|c| matches!(c.try_wait(), Ok(None)));
    }

    async fn restore(&mut self, what: Option<String>) -> WardenReply {
        let matches = |e: &Injected| match &what {
            None => true,
            Some(w) => e.active.id == *w || e.active.fault.name() == w,
        };
        let (hit, keep): (Vec<Injected>, Vec<Injected>) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(matches);
        self.entries = keep;
        if hit.is_empty() && what.is_some() {
            let active: Vec<String> = self
                .entries
                .iter()
                .map(|e| {
                    format!(
                        "{} ({} {})",
                        e.active.id,
                        e.active.fault.name(),
                        e.active.target
                    )
                })
                .collect();
            return err(format!(
                "no active fault {:?}; active: {}",
                what.unwrap_or_default(),
                if active.is_empty() {
                    "none".into()
                } else {
                    active.join(", ")
                }
            ));
        }
        for e in &hit {
            self.undo(e, true).await;
            self.announce("restored", &e.active).await;
        }
        self.save();
        WardenReply::Ok(hit.into_iter().map(|e| e.active).collect())
    }

    fn list(&self) -> WardenReply {
        WardenReply::Ok(self.entries.iter().map(|e| e.active.clone()).collect())
    }
}

async fn answer(nats: &async_nats::Client, msg: &async_nats::Message, reply: &WardenReply) {
    // Answers go to the warden's answer inboxes only, whatever subject the asker named.
    let to = (msg.reply.as_ref()).filter(|r| subjects::may_answer_on(subjects::ANSWERER_WARDEN, r));
    if let (Some(to), Ok(body)) = (to, serde_json::to_vec(reply)) {
        let _ = nats.publish(to.clone(), body.into()).await;
    }
}

fn parse<T: serde::de::DeserializeOwned>(payload: &[u8]) -> Result<T, WardenReply> {
    serde_json::from_slice(payload).map_err(|e| err(format!("malformed chaos request: {e}")))
}

/// Run the warden for the mesh in `dir` until `stop`; `ready` is called once it answers.
/// `sys` (the system account's observer) lets it verify which process holds an instance's
/// connection; without it, no agent process is signalled.
pub(crate) async fn run(
    dir: &Path,
    nats: async_nats::Client,
    sys: Option<async_nats::Client>,
    app_url: String,
    ready: impl FnOnce(),
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), StartError> {
    let mut w = Warden::new(dir.to_path_buf(), nats.clone(), app_url)?;
    w.sys = sys;
    let mut inject = subscribe(&nats, subjects::CHAOS_INJECT).await?;
    let mut list = subscribe(&nats, subjects::CHAOS_LIST).await?;
    let mut restore = subscribe(&nats, subjects::CHAOS_RESTORE).await?;
    nats.flush().await?;
    ready();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => break,
            Some(m) = inject.next() => {
                let reply = match parse::<Inject>(&m.payload) {
                    Ok(req) => w.inject(req).await,
                    Err(e) => e,
                };
                answer(&nats, &m, &reply).await;
            }
            Some(m) = list.next() => answer(&nats, &m, &w.list()).await,
            Some(m) = restore.next() => {
                let reply = match parse::<Restore>(&m.payload) {
                    Ok(r) => w.restore(r.what).await,
                    Err(e) => e,
                };
                answer(&nats, &m, &reply).await;
            }
            _ = tick.tick() => w.expire().await,
        }
    }
    // Leaving (usually `oam mesh down`): resume what is stopped and end the other faults, but
    // start nothing again: the mesh is going away.
    for e in std::mem::take(&mut w.entries) {
        if !matches!(e.undo, Undo::RestartNode { .. } | Undo::RestartAgent { .. }) {
            w.undo(&e, true).await;
        }
        w.announce("restored", &e.active).await;
    }
    w.save();
    flush_within(&nats, Duration::from_secs(1)).await;
    // Agents it started again are not in the mesh record: they go with the warden.
    for mut child in std::mem::take(&mut w.agents) {
        local::signal(child.id(), libc::SIGTERM);
        let _ = tokio::task::spawn_blocking(move || child.wait()).await;
    }
    Ok(())
}

/// How many background requests at once a spike sends unless told: twice what the nodes'
/// background bulkheads hold together (their defaults are sized from each node's machine), so
/// some is shed on every node; 30 for a node whose state cannot be read. At most
/// `MAX_CONCURRENCY`.
async fn spike_concurrency(http: &reqwest::Client, nodes: &[String]) -> usize {
    let mut total = 0u64;
    for url in nodes {
        let state = http
            .get(format!("{url}/v1/oam/state"))
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        let snap = match state {
            Ok(r) => r.json::<crate::core::wire::NodeSnapshot>().await.ok(),
            Err(_) => None,
        };
        total += snap.map_or(30, |s| {
            2 * u64::from(s.bulkhead_limits.background.concurrency)
        });
    }
    usize::try_from(total.clamp(1, u64::from(MAX_CONCURRENCY))).unwrap_or(60)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inject(fault: Fault, target: Option<&str>, for_ms: u64) -> Inject {
        Inject {
            fault,
            target: target.map(String::from),
            for_ms,
            params: Params::default(),
        }
    }

    #[test]
    fn only_oam_agent_serve_of_that_agent_is_a_target() {
        let argv = |a: &[&str]| a.iter().map(|s| (*s).to_string()).collect::<Vec<_>>();
        for ok in [
            argv(&["/x/oam", "agent", "serve", "demo.echo", "--demo", "echo"]),
            argv(&["oam", "agent", "--dir", "/m", "serve", "demo.echo"]),
            argv(&[
                "oam",
                "agent",
                "serve",
                "--demo",
                "echo",
                "--json",
                "demo.echo",
            ]),
            argv(&["oam", "agent", "serve", "--replicas=2", "demo.echo"]),
        ] {
            assert!(serves_agent(&ok, "demo.echo"), "{ok:?}");
        }
        for other in [
            argv(&["/usr/sbin/sshd", "-D"]),
            argv(&["/x/oam", "agent", "serve", "demo.other"]),
            argv(&["/x/oam", "node", "run", "--id", "n1"]),
            argv(&["bash", "-c", "oam agent serve demo.echo"]),
            argv(&["oam", "agent", "serve", "--demo", "demo.echo", "other"]),
            argv(&[]),
        ] {
            assert!(!serves_agent(&other, "demo.echo"), "{other:?}");
        }
        // A process runs its own executable; pid 1 (init) does not run this one.
        assert!(runs_this_executable(std::process::id()));
        // The process that holds a connection's local end is found; another is not.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let conn = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let port = conn.local_addr().unwrap().port();
        assert!(holds_local_port(std::process::id(), port));
        assert!(!holds_local_port(1, port));
        assert!(!runs_this_executable(1), "pid 1 runs something else");
    }

    #[test]
    fn provider_faults_become_the_simulators_own_fault_for_as_long_as_asked() {
        let p = plan(&inject(Fault::BreakContract, Some("primary"), 5_000), &[]).unwrap();
        assert_eq!(p.target, "primary");
        let InjectAction::Sim { fault, detail } = p.action else {
            panic!("a provider fault goes to the simulator: {:?}", p.action);
        };
        assert_eq!(
            fault,
            SetFault {
                provider: "primary".into(),
                duration_ms: 5_000,
                times: None,
                mode: FaultMode::Contract {
                    kind: ContractBreak::MissingField
                },
            },
            "missing-field by default"
        );
        assert!(detail.contains("missing-field"), "{detail}");
        let mut slow = inject(Fault::SlowProvider, Some("local"), 1_000);
        slow.params.ms = Some(750);
        let InjectAction::Sim { fault, .. } = plan(&slow, &[]).unwrap().action else {
            panic!("sim");
        };
        assert_eq!(fault.mode, FaultMode::Slow { extra_ms: 750 });
    }

    #[test]
    fn targets_are_resolved_or_asked_for_by_kind() {
        let spike = plan(&inject(Fault::TrafficSpike, Some("ignored"), 1_000), &[]).unwrap();
        assert_eq!(spike.target, "mesh");
        assert_eq!(spike.action, InjectAction::Load(Fault::TrafficSpike));
        assert_eq!(
            plan(&inject(Fault::AgentLoop, None, 1_000), &[])
                .unwrap()
                .target,
            "loop-bot"
        );
        for (fault, says) in [
            (Fault::KillProvider, "a provider"),
            (Fault::StopNode, "a node"),
            (Fault::KillAgent, "an agent name (e.g. demo.echo)"),
            (Fault::DrainBudget, "as callers send it"),
        ] {
            let why = plan(&inject(fault, Some(""), 1_000), &[]).unwrap_err();
            assert!(
                why.0.contains("needs a target") && why.0.contains(says),
                "{why}"
            );
        }
        assert_eq!(
            plan(&inject(Fault::KillNode, Some("n2"), 1_000), &[])
                .unwrap()
                .action,
            InjectAction::SignalNode { kill: true }
        );
    }

    #[test]
    fn bounds_and_a_second_isolation_are_refused_with_what_to_do() {
        let too_long = u64::try_from(MAX_FOR.as_millis()).unwrap() + 1;
        assert!(
            plan(&inject(Fault::KillProvider, Some("p"), too_long), &[])
                .unwrap_err()
                .0
                .contains("--for")
        );
        assert!(plan(&inject(Fault::KillProvider, Some("p"), 0), &[]).is_err());
        let mut spike = inject(Fault::TrafficSpike, None, 1_000);
        spike.params.requests = Some(MAX_REQUESTS + 1);
        assert!(plan(&spike, &[]).unwrap_err().0.contains("--requests"));
        let mut flaky = inject(Fault::FlakyProvider, Some("p"), 1_000);
        flaky.params.error_rate = Some(1.5);
        assert!(plan(&flaky, &[]).unwrap_err().0.contains("--error-rate"));
        let isolated = Active {
            id: "c1".into(),
            fault: Fault::IsolateNode,
            target: "n2".into(),
            params: Params::default(),
            injected_at_ms: 0,
            expires_at_ms: 1,
            detail: String::new(),
        };
        let again = plan(&inject(Fault::IsolateNode, Some("n2"), 1_000), &[&isolated]);
        assert!(again.unwrap_err().0.contains("oam chaos restore c1"));
        let other = plan(&inject(Fault::IsolateNode, Some("n3"), 1_000), &[&isolated]);
        assert_eq!(other.unwrap().action, InjectAction::Isolate);
    }
}
