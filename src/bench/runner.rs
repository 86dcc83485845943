//! Play a scenario against a local cluster (its load, its chaos timeline through the warden,
//! its agents), then check its expectations: what `oam bench --scenario` and `oam demo` run.

use super::load::{self as bench, LoadPlan, Through};
use super::scenario::{self, Measured, Recovery, Run, Scenario};
use crate::core::budget::Owner;
use crate::core::chaos::{Inject, Restore};
use crate::core::health::Verdict as Health;
use crate::error::{Error, Kind, Result};
use crate::local::{self, MeshRecord};
use crate::transport::chaos::{self, WardenError};
use crate::transport::subjects;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Everything a scenario run measured, as written by `--json`.
#[derive(Serialize, Debug)]
pub(crate) struct ScenarioReport {
    pub version: &'static str,
    pub scenario: String,
    pub description: String,
    pub short: bool,
    pub seed: u64,
    pub summary: bench::Report,
    /// (fault, injected at ms, expires at ms), since the load started.
    pub chaos: Vec<(String, u64, u64)>,
    pub recoveries: Vec<Recovery>,
    pub cluster_reasons: BTreeMap<String, f64>,
    /// Per `[[budget]]` agent: what the shared ledger charged it (USD), every hold settled.
    pub budgets_spent: BTreeMap<String, f64>,
    pub verdicts: Vec<Measured>,
    pub passed: bool,
    /// Stopped early (Ctrl-C, SIGTERM): the load and the timeline stopped, faults were ended,
    /// agents stopped; the expectations were judged on what finished, and `passed` is false.
    pub interrupted: bool,
}

/// Read and check a scenario file (`short`: its `--short` form).
pub(crate) fn load(path: &Path, short: bool) -> Result<Scenario> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::usage(format!("cannot read scenario {}: {e}", path.display())))?;
    let s = Scenario::parse(&text)
        .map_err(|e| Error::usage(format!("scenario {}: {e}", path.display())))?;
    Ok(if short { s.shortened() } else { s })
}

/// The reason-code counters of every node (`oam_reason_codes_total`), summed.
async fn cluster_reasons(http: &reqwest::Client, urls: &[String]) -> BTreeMap<String, f64> {
    let mut counts = BTreeMap::new();
    for url in urls {
        let get = http
            .get(format!("{url}/metrics"))
            .timeout(Duration::from_secs(5));
        let Ok(r) = get.send().await else {
            continue;
        };
        let text = r.text().await.unwrap_or_default();
        for line in text
            .lines()
            .filter(|l| l.starts_with("oam_reason_codes_total{"))
        {
            let code = line.split('"').nth(1).unwrap_or("").to_string();
            let n: f64 = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            *counts.entry(code).or_insert(0.0) += n;
        }
    }
    counts
}

/// Wait (at most `within`) until every node sees every node and agrees every provider is
/// HEALTHY with its breaker not open (a half-open one closes on the next request), so one
/// scenario's faults do not leak into the next.
async fn settle(http: &reqwest::Client, urls: &[String], within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let mut why = None;
        for url in urls {
            let Some(v) = crate::local::cluster::snapshot(http, url).await else {
                why = Some(format!("{url} does not answer"));
                break;
            };
            let live = v.live_nodes.len();
            if live < urls.len() {
                why = Some(format!("{url} sees {live} of {} nodes", urls.len()));
                break;
            }
            for p in &v.providers {
                let verdict = p.consensus.verdict;
                if verdict != Health::Healthy || p.breaker.is_open() {
                    why = Some(format!(
                        "{} is {verdict} (breaker {}) on {url}",
                        p.id,
                        p.breaker.name()
                    ));
                }
            }
        }
        let Some(why) = why else {
            return Ok(());
        };
        if Instant::now() > deadline {
            return Err(Error::new(
                Kind::Failed,
                anyhow::anyhow!(
                    "the mesh did not settle within {} s: {why}",
                    within.as_secs()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Set the scenario's `[[budget]]`s in the shared ledger, spent from zero, and wait (at most
/// 10 s) until every node mirrors them; the ledger, when there are any.
async fn set_budgets(
    nats: &async_nats::Client,
    http: &reqwest::Client,
    urls: &[String],
    s: &Scenario,
) -> Result<Option<async_nats::jetstream::kv::Store>> {
    if s.budgets.is_empty() {
        return Ok(None);
    }
    let unreachable = |e: String| {
        Error::new(
            Kind::Unreachable,
            anyhow::anyhow!("scenario {}: the budget ledger: {e}", s.name),
        )
    };
    let store = crate::transport::store::bucket(nats, subjects::BUDGETS_BUCKET, Duration::ZERO)
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    for b in &s.budgets {
        crate::transport::store::ledger::change(&store, &Owner::agent(&b.agent), true, |l| {
            l.limit_usd = b.limit_usd;
            l.spent_usd = 0.0;
            l.holds.clear();
        })
        .await
        .map_err(|e| unreachable(format!("{}: {e:?}", b.agent)))?;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    'nodes: for url in urls {
        loop {
            let mirrored = crate::local::cluster::snapshot(http, url)
                .await
                .is_some_and(|v| {
                    s.budgets.iter().all(|b| {
                        v.budgets
                            .agents
                            .get(&b.agent)
                            .is_some_and(|m| m.limit_usd == b.limit_usd && m.spent_usd == 0.0)
                    })
                });
            if mirrored {
                continue 'nodes;
            }
            if Instant::now() > deadline {
                return Err(unreachable(format!(
                    "{url} did not take the budgets within 10 s"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(Some(store))
}

/// What the ledger charged each `[[budget]]` once no hold is left (at most 10 s after the
/// load); every budget is removed whatever happens, so the scenario leaves none behind.
async fn settled_budgets(
    store: &async_nats::jetstream::kv::Store,
    s: &Scenario,
) -> Result<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    let mut failed = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    for b in &s.budgets {
        while failed.is_none() {
            match crate::transport::store::ledger::read(store, &Owner::agent(&b.agent)).await {
                Ok(Some(l))
                    if l.held_usd(crate::clock::now_ms(), None) > 0.0
                        && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(l) => {
                    out.insert(b.agent.clone(), l.map_or(f64::NAN, |l| l.spent_usd));
                    break;
                }
                Err(e) => failed = Some(Error::new(Kind::Unreachable, e)),
            }
        }
        let _ = store
            .delete(crate::transport::store::ledger::key(&Owner::agent(
                &b.agent,
            )))
            .await;
    }
    failed.map_or(Ok(out), Err)
}

/// Agents of this scenario that the warden started again after a `kill-agent` are not this
/// process's children; stop them too (by pid from their instance record, only if their command
/// line is that agent's `oam agent serve`), so a scenario leaves no agent behind.
async fn stop_restarted_agents(nats: &async_nats::Client, s: &Scenario) {
    let host = crate::mesh::store::hostname();
    let records = crate::mesh::store::all_instances(&crate::mesh::store::Mesh::new(nats.clone()))
        .await
        .unwrap_or_default();
    for a in &s.agents {
        for r in records
            .iter()
            .filter(|r| r.agents.contains(&a.name) && r.host.as_deref() == Some(host))
        {
            let Some(pid) = r.pid else { continue };
            if local::is_running(pid, &format!("agent serve {}", a.name)) {
                local::signal(pid, libc::SIGTERM);
            }
        }
    }
}

/// Run scenario `s` on the mesh in `dir` until it ends or `stop`; a refusal of its credentials
/// is told to `refused`; `progress` gets (done, total) as requests finish.
pub(crate) async fn run(
    dir: &Path,
    s: &Scenario,
    short: bool,
    seed: u64,
    stop: &CancellationToken,
    refused: &crate::transport::connect::Refusal,
    progress: impl Fn(u64, u64) + Send + Sync + 'static,
) -> Result<ScenarioReport> {
    let rec = MeshRecord::load(dir)
        .map_err(|e| Error::new(Kind::Usage, e))?
        .ok_or_else(|| {
            Error::new(
                Kind::Unreachable,
                anyhow::anyhow!(
                    "no mesh recorded in {}; start one with `oam mesh up` (a scenario needs its \
                     nodes and its chaos warden)",
                    dir.display()
                ),
            )
        })?;
    // A scenario is the mesh owner's: it starts agents, injects chaos and reads every record.
    let app_url = local::find_cluster(None, Some(dir), &local::roles::Role::Admin)
        .map(|(url, _)| url)
        .map_err(|why| Error::new(Kind::Unreachable, anyhow::anyhow!(why)))?;
    let nats =
        crate::transport::connect::reach(&app_url, "oam-bench-scenario", false, refused).await?;
    let all_nodes: Vec<(String, String)> = rec
        .nodes()
        .map(|n| (n.name.clone(), n.endpoint.clone()))
        .collect();
    let urls: Vec<String> = all_nodes
        .iter()
        .filter(|(name, _)| s.load.nodes.is_empty() || s.load.nodes.contains(name))
        .map(|(_, url)| url.clone())
        .collect();
    if urls.is_empty() {
        return Err(Error::usage(format!(
            "load.nodes {:?} names no node of this mesh ({})",
            s.load.nodes,
            all_nodes
                .iter()
                .map(|n| n.0.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let every: Vec<String> = all_nodes.iter().map(|n| n.1.clone()).collect();
    let http = crate::http::http_client(None).map_err(Error::failed)?;
    tokio::select! {
        r = settle(&http, &every, Duration::from_secs(60)) => r?,
        () = stop.cancelled() => {}
    }
    if stop.is_cancelled() {
        return Err(Error::new(
            Kind::Interrupted,
            anyhow::anyhow!("interrupted before scenario {} began", s.name),
        ));
    }
    let exe = local::oam_exe().map_err(Error::failed)?;
    let agents = local::agents::Agents::start(&exe, dir, &app_url, &s.agents)
        .await
        .map_err(Error::failed)?;
    let ledger = set_budgets(&nats, &http, &every, s).await?;
    let before = cluster_reasons(&http, &every).await;

    let duration = s.duration();
    let requests = (s.load.rate * duration.as_secs_f64()).ceil().max(1.0) as usize;
    let plan = LoadPlan {
        urls,
        requests,
        concurrency: s.load.concurrency.max(1),
        rate_per_s: Some(s.load.rate),
        max_duration_ms: Some(duration.as_millis() as u64 + 1_000),
        agent: "bench".into(),
        model: "auto".into(),
        task: "bench".into(),
        risk: crate::core::request::Risk::Low,
        priority: crate::core::request::Priority::Normal,
        seed,
        timeout_ms: s.load.timeout_ms,
        mix: s.load.mix.clone(),
        stream: s.load.stream,
    };
    let target = if s.load.kind == "agent" {
        let caller = crate::mesh::client::Caller::new(nats.clone())
            .await
            .map_err(|e| Error::new(Kind::Unreachable, e))?;
        Through::Agent {
            caller: std::sync::Arc::new(caller),
            agent: s.load.agent.clone().unwrap_or_default(),
        }
    } else {
        Through::Http(http.clone())
    };

    // The chaos timeline runs beside the load, on the load's clock.
    let started = Instant::now();
    let timeline = {
        let nats = nats.clone();
        let events = s.chaos.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut done: Vec<(String, String, u64, u64)> = Vec::new();
            let mut errors = Vec::new();
            for c in events {
                let (at, for_ms) = scenario::event_times(&c);
                let due = tokio::time::sleep_until((started + Duration::from_millis(at)).into());
                tokio::select! {
                    () = due => {}
                    () = stop.cancelled() => break,
                }
                let req = Inject {
                    fault: c.fault,
                    target: c.target.clone(),
                    for_ms,
                    params: c.params.clone(),
                };
                let body = serde_json::to_vec(&req).unwrap_or_default();
                let injected_at = started.elapsed().as_millis() as u64;
                match chaos::ask(&nats, subjects::CHAOS_INJECT, body).await {
                    Ok(faults) => {
                        for f in faults {
                            done.push((
                                f.id,
                                c.fault.name().to_string(),
                                injected_at,
                                injected_at + for_ms,
                            ));
                        }
                    }
                    Err(WardenError::NoWarden) => errors.push(
                        "no chaos warden answers; is the mesh up (`oam mesh status`)?".to_string(),
                    ),
                    Err(e) => errors.push(format!("{}: {e}", c.fault.name())),
                }
            }
            (done, errors)
        })
    };
    let total = requests as u64;
    let counter = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let c = counter.clone();
    // Sample times are on the scenario's clock, like the chaos timeline.
    let after = s.load_after();
    tokio::select! {
        () = tokio::time::sleep(after) => {}
        () = stop.cancelled() => {}
    }
    // The load's clock is the timeline's, shifted by `after` exactly (not by however long the
    // sleep took), so a sample and a fault compare on one clock.
    let (mut samples, elapsed, plan) =
        bench::run_samples(plan, target, started + after, stop, move || {
            let n = c.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            progress(n, total);
        })
        .await;
    for sample in &mut samples {
        sample.started_us += after.as_micros() as u64;
    }
    let (injected, errors) = timeline.await.map_err(|e| {
        Error::new(
            Kind::Failed,
            anyhow::anyhow!("the chaos timeline failed: {e}"),
        )
    })?;
    // Leave nothing behind: end this scenario's faults that outlived the load.
    for (id, ..) in &injected {
        let body = serde_json::to_vec(&Restore {
            what: Some(id.clone()),
        })
        .unwrap_or_default();
        let _ = chaos::ask(&nats, subjects::CHAOS_RESTORE, body).await;
    }
    // ... and no budget: read and removed before anything else can end the run.
    let budgets_spent = match &ledger {
        Some(store) => settled_budgets(store, s).await,
        None => Ok(BTreeMap::new()),
    };
    if let Some(why) = errors.first() {
        return Err(Error::new(
            Kind::Unreachable,
            anyhow::anyhow!("scenario {}: could not inject chaos: {why}", s.name),
        ));
    }
    let budgets_spent = budgets_spent?;
    agents.stop().await;
    stop_restarted_agents(&nats, s).await;
    let after = cluster_reasons(&http, &every).await;
    let cluster: BTreeMap<String, f64> = after
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                (v - before.get(k).copied().unwrap_or(0.0)).max(0.0),
            )
        })
        .filter(|(_, v)| *v > 0.0)
        .collect();
    let faults: Vec<(String, u64, u64)> = injected
        .iter()
        .map(|(_, f, a, b)| (f.clone(), *a, *b))
        .collect();
    let eval = Run {
        samples: &samples,
        faults: faults.clone(),
        cluster_reasons: cluster.clone(),
        budgets_spent: budgets_spent.clone(),
    };
    let verdicts = eval.evaluate(&s.expect);
    let recoveries = eval.recoveries();
    let interrupted = stop.is_cancelled();
    let passed = !interrupted && verdicts.iter().all(|v| v.ok);
    Ok(ScenarioReport {
        version: env!("CARGO_PKG_VERSION"),
        scenario: s.name.clone(),
        description: s.description.clone(),
        short,
        seed,
        summary: bench::summarize(plan, &samples, elapsed),
        chaos: faults,
        recoveries,
        cluster_reasons: cluster,
        budgets_spent,
        verdicts,
        passed,
        interrupted,
    })
}

/// The expectations as a table, with what was measured.
pub(crate) fn table(o: &ScenarioReport) -> String {
    use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_header(vec!["", "expectation", "measured"]);
    for v in &o.verdicts {
        t.add_row(vec![
            if v.ok { "ok" } else { "FAIL" }.to_string(),
            v.expectation.clone(),
            format!("{:.4}", v.measured)
                .trim_end_matches('0')
                .trim_end_matches('.')
                .to_string(),
        ]);
    }
    for r in &o.recoveries {
        t.add_row(vec![
            String::new(),
            format!("{}: from injection until requests stop failing", r.fault),
            format!(
                "{} ms, {} failed; rerouted after {} ms ({} retried)",
                r.recovery_ms, r.failed, r.reroute_ms, r.retried
            ),
        ]);
    }
    t.to_string()
}

/// The failed expectations, each in words with what was measured.
pub(crate) fn failures(o: &ScenarioReport) -> Vec<String> {
    o.verdicts
        .iter()
        .filter(|v| !v.ok)
        .map(|v| {
            format!(
                "scenario {}: expectation failed: {} (measured {})",
                o.scenario, v.expectation, v.measured
            )
        })
        .collect()
}
