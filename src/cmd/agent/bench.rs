//! `oam agent bench`: the agent mesh's liveness and speed, measured against real processes on a
//! running mesh (start one with `oam mesh up`; its monitor must be running). Every loop is
//! bounded in count and time, and every agent process it starts is stopped by PID.
//!
//! - kill: SIGKILL an agent while it holds a call; time until the caller gets `agent_died`.
//! - replica: the same while another replica of the agent lives.
//! - freeze: SIGSTOP an agent; time until its death notice.
//! - echo: sequential call latency, and throughput with C concurrent callers next to raw
//!   async-nats request/reply measured in the same run.

use crate::error::{Error, Findings, Kind, Result};
use crate::mesh::client::Caller;
use crate::mesh::protocol::ErrorCode;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use futures_util::StreamExt;
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Kills to measure (each for the plain and the replica case).
    #[arg(long, default_value_t = 20)]
    pub kills: usize,
    /// Freezes (SIGSTOP) to measure.
    #[arg(long, default_value_t = 3)]
    pub freezes: usize,
    /// Sequential echo calls.
    #[arg(long, default_value_t = 2_000)]
    pub echoes: usize,
    /// Concurrent callers for the throughput runs.
    #[arg(short = 'c', long, default_value_t = 50)]
    pub concurrency: usize,
    /// Seconds of throughput measurement for each of the mesh and raw request/reply (in three
    /// alternating rounds).
    #[arg(long, default_value_t = 6.0)]
    pub seconds: f64,
    /// Print the results as one JSON document.
    #[arg(long)]
    pub json: bool,
}

struct Agent(Child);

impl Agent {
    async fn start(url: &str, name: &str, demo: &str) -> Result<Agent> {
        let exe = crate::local::oam_exe().map_err(Error::failed)?;
        let mut child = Command::new(exe)
            .args([
                "agent",
                "serve",
                name,
                "--demo",
                demo,
                "--concurrency",
                "64",
                "--json",
                "--nats-url",
                url,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(Error::failed)?;
        // The ready line means registered and subscribed.
        let out = child
            .stdout
            .take()
            .ok_or_else(|| Error::failed(anyhow::anyhow!("no stdout")))?;
        // Read off the runtime's workers: a pipe read blocks.
        let read = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line).map(|_| line)
        });
        let line = tokio::time::timeout(Duration::from_secs(20), read)
            .await
            .map_err(|_| Error::failed(anyhow::anyhow!("agent {name} did not start within 20 s")))?
            .map_err(Error::failed)?
            .map_err(Error::failed)?;
        if line.is_empty() {
            return Err(Error::new(
                Kind::Failed,
                anyhow::anyhow!("agent {name} did not start"),
            ));
        }
        Ok(Agent(child))
    }

    fn signal(&self, sig: libc::c_int) {
        crate::local::signal(self.0.id(), sig);
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The trials of one measure: the times of those that did what was measured, and why each
/// other one did not. A failed trial is reported, never just left out of the percentiles.
#[derive(Default)]
struct Trials {
    ms: Vec<f64>,
    failed: Vec<String>,
}

impl Trials {
    fn ok(&mut self, t0: Instant) {
        self.ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }

    fn fail(&mut self, why: String) {
        self.failed.push(why);
    }

    /// `{n, failed, failures, p50_ms, p99_ms, max_ms}` over the trials that succeeded.
    fn summary(mut self) -> serde_json::Value {
        self.ms.sort_by(f64::total_cmp);
        let v = &self.ms;
        let at = |q: f64| {
            v.get(((v.len() as f64 * q).ceil() as usize).saturating_sub(1))
                .copied()
                .unwrap_or(0.0)
        };
        serde_json::json!({
            "n": v.len() + self.failed.len(),
            "failed": self.failed.len(),
            "failures": self.failed,
            "p50_ms": at(0.5),
            "p99_ms": at(0.99),
            "max_ms": v.last().copied().unwrap_or(0.0),
        })
    }
}

async fn kill_case(
    url: &str,
    caller: &Caller,
    kills: usize,
    replica: bool,
) -> Result<serde_json::Value> {
    let mut times = Trials::default();
    for i in 0..kills {
        let name = format!("bench.hold{}.{i}", if replica { "r" } else { "" });
        let holder = Agent::start(url, &name, "hang").await?;
        let call = caller.call(&name, "{}".into(), Duration::from_secs(30));
        tokio::pin!(call);
        // Let the only instance take the request.
        if tokio::time::timeout(Duration::from_millis(200), &mut call)
            .await
            .is_ok()
        {
            return Err(Error::new(
                Kind::Failed,
                anyhow::anyhow!("the hang agent answered"),
            ));
        }
        let _other = if replica {
            Some(Agent::start(url, &name, "hang").await?)
        } else {
            None
        };
        let t0 = Instant::now();
        holder.signal(libc::SIGKILL);
        match tokio::time::timeout(Duration::from_secs(35), call).await {
            Ok(Err(e)) if e.code == ErrorCode::AgentDied => times.ok(t0),
            Ok(Err(e)) => times.fail(format!(
                "kill {i}: {} instead of agent_died",
                e.code.as_str()
            )),
            Ok(Ok(_)) => times.fail(format!("kill {i}: answered instead of agent_died")),
            Err(_) => times.fail(format!("kill {i}: no answer within 35 s")),
        }
    }
    Ok(times.summary())
}

async fn freeze_case(
    url: &str,
    nats: &async_nats::Client,
    freezes: usize,
) -> Result<serde_json::Value> {
    let mut times = Trials::default();
    for i in 0..freezes {
        let name = format!("bench.frozen.{i}");
        let agent = Agent::start(url, &name, "echo").await?;
        let mut deaths = nats
            .subscribe(crate::transport::subjects::death(&name))
            .await
            .map_err(|e| Error::new(Kind::Unreachable, e))?;
        tokio::time::sleep(Duration::from_millis(1_500)).await; // the monitor has seen it beat
        let t0 = Instant::now();
        agent.signal(libc::SIGSTOP);
        if tokio::time::timeout(Duration::from_secs(20), deaths.next())
            .await
            .is_ok()
        {
            times.ok(t0);
        } else {
            times.fail(format!("freeze {i}: no death notice within 20 s"));
        }
    }
    Ok(times.summary())
}

/// Requests per second with `c` concurrent requesters for `secs`, each doing `one`.
async fn throughput<F, Fut>(c: usize, secs: Duration, one: F) -> f64
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let deadline = Instant::now() + secs;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..c {
        let one = one.clone();
        tasks.spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                if one().await {
                    n += 1;
                }
            }
            n
        });
    }
    let mut total = 0;
    while let Some(Ok(n)) = tasks.join_next().await {
        total += n;
    }
    total as f64 / secs.as_secs_f64()
}

/// Throughput is measured in this many alternating rounds of mesh and raw request/reply.
const ROUNDS: u32 = 3;

pub async fn run(cluster: &super::super::ClusterArgs, a: Args) -> Result<Findings> {
    // Mesh and raw alternate in rounds, so a noisy neighbour on a shared machine weighs on both.
    let round_secs = Duration::try_from_secs_f64(a.seconds / f64::from(ROUNDS))
        .ok()
        .filter(|d| !d.is_zero() && a.seconds <= 3_600.0)
        .ok_or_else(|| Error::usage("--seconds must be a number of seconds in (0, 3600]"))?;
    // It starts, calls, freezes and kills agents of its own: the mesh owner's tool, run as the
    // admin (in a mesh folder, from its system.json).
    let url = &cluster.url(&crate::cmd::Role::Admin)?;
    let nats = crate::cmd::reach(url, "oam-agent-bench", false).await?;
    let caller = std::sync::Arc::new(
        Caller::new(nats.clone())
            .await
            .map_err(|e| Error::new(Kind::Unreachable, e))?,
    );

    let kill = kill_case(url, &caller, a.kills, false).await?;
    let replica = kill_case(url, &caller, a.kills, true).await?;
    let freeze = freeze_case(url, &nats, a.freezes).await?;

    // Raw async-nats request/reply, same machine, same run: the ceiling to compare against.
    let mut raw = nats
        .subscribe("bench.raw.echo")
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))?;
    let responder_nats = nats.clone();
    let own = nats.new_inbox();
    let own = own
        .rsplit_once('.')
        .map_or(own.as_str(), |(p, _)| p)
        .to_string()
        + ".";
    let responder = tokio::spawn(async move {
        while let Some(m) = raw.next().await {
            // Its own requests: answered in its own inbox only.
            if let Some(reply) = m.reply.filter(|r| r.starts_with(&own)) {
                let _ = responder_nats.publish(reply, m.payload).await;
            }
        }
    });
    let mut raw_seq = Trials::default();
    for i in 0..a.echoes {
        let t0 = Instant::now();
        match nats.request("bench.raw.echo", "{}".into()).await {
            Ok(_) => raw_seq.ok(t0),
            Err(e) => raw_seq.fail(format!("raw echo {i}: {e}")),
        }
    }
    let raw_seq = raw_seq.summary();
    let _echo = Agent::start(url, "bench.echo", "echo").await?;
    let mut seq = Trials::default();
    for i in 0..a.echoes {
        let t0 = Instant::now();
        match caller
            .call("bench.echo", "{}".into(), Duration::from_secs(5))
            .await
        {
            Ok(_) => seq.ok(t0),
            Err(e) => seq.fail(format!("echo {i}: {}", e.code.as_str())),
        }
    }
    let echo_seq = seq.summary();
    let (mut mesh_rps, mut raw_rps) = (0.0, 0.0);
    for _ in 0..ROUNDS {
        let c = caller.clone();
        mesh_rps += throughput(a.concurrency, round_secs, move || {
            let c = c.clone();
            async move {
                c.call("bench.echo", "{}".into(), Duration::from_secs(5))
                    .await
                    .is_ok()
            }
        })
        .await
            / f64::from(ROUNDS);
        let n = nats.clone();
        raw_rps += throughput(a.concurrency, round_secs, move || {
            let n = n.clone();
            async move { n.request("bench.raw.echo", "{}".into()).await.is_ok() }
        })
        .await
            / f64::from(ROUNDS);
    }
    responder.abort();

    let doc = serde_json::json!({
        "sigkill_to_agent_died": kill,
        "replica_sigkill_to_agent_died": replica,
        "sigstop_to_death_notice": freeze,
        "echo_sequential": echo_seq,
        "raw_request_reply_sequential": raw_seq,
        "echo_concurrent_rps": mesh_rps,
        "raw_request_reply_rps": raw_rps,
        "concurrency": a.concurrency,
        "ratio_to_raw": if raw_rps > 0.0 { mesh_rps / raw_rps } else { 0.0 },
    });
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{doc:#}")?;
    } else {
        let mut t = Table::new();
        t.load_style(UTF8_FULL_CONDENSED);
        t.set_header(vec!["measure", "n", "failed", "p50", "p99", "max"]);
        for (label, key) in [
            ("SIGKILL -> agent_died", "sigkill_to_agent_died"),
            (
                "replica SIGKILL -> agent_died",
                "replica_sigkill_to_agent_died",
            ),
            ("SIGSTOP -> death notice", "sigstop_to_death_notice"),
            ("echo, sequential", "echo_sequential"),
            (
                "raw request/reply, sequential",
                "raw_request_reply_sequential",
            ),
        ] {
            let v = &doc[key];
            t.add_row(vec![
                label.to_string(),
                v["n"].to_string(),
                v["failed"].to_string(),
                format!("{:.2} ms", v["p50_ms"].as_f64().unwrap_or(0.0)),
                format!("{:.2} ms", v["p99_ms"].as_f64().unwrap_or(0.0)),
                format!("{:.2} ms", v["max_ms"].as_f64().unwrap_or(0.0)),
            ]);
        }
        crate::cmd::fit(&mut t, false);
        writeln!(out, "{t}")?;
        writeln!(
            out,
            "echo with {} concurrent callers: {:.0} req/s through the mesh, {:.0} req/s raw request/reply ({:.0}%)",
            a.concurrency,
            mesh_rps,
            raw_rps,
            100.0 * doc["ratio_to_raw"].as_f64().unwrap_or(0.0)
        )?;
    }
    let failures: Vec<String> = [
        "sigkill_to_agent_died",
        "replica_sigkill_to_agent_died",
        "sigstop_to_death_notice",
        "echo_sequential",
        "raw_request_reply_sequential",
    ]
    .iter()
    .flat_map(|k| doc[*k]["failures"].as_array().cloned().unwrap_or_default())
    .filter_map(|f| f.as_str().map(String::from))
    .collect();
    Ok(Findings::from_failures(failures))
}
