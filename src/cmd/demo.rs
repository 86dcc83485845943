//! `oam demo`: the whole story in one command. It brings up a private local mesh, plays the
//! headline scenarios one after another (each with live progress and a one-line verdict),
//! prints the summary with reason codes, and takes the mesh down again, on every exit path.

use crate::bench::runner::{self as bench_scenario, ScenarioReport};
use crate::bench::scenario::Scenario;
use crate::error::{Error, Findings, Kind, Result};
use crate::local::{self, cluster};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The scenarios it plays, in order (their files ship in `scenarios/`).
const HEADLINE: &[(&str, &str)] = &[
    ("baseline", include_str!("../../scenarios/baseline.toml")),
    (
        "provider-outage",
        include_str!("../../scenarios/provider-outage.toml"),
    ),
    ("every-api", include_str!("../../scenarios/every-api.toml")),
    (
        "tool-outage",
        include_str!("../../scenarios/tool-outage.toml"),
    ),
    (
        "broken-contract",
        include_str!("../../scenarios/broken-contract.toml"),
    ),
    (
        "node-death",
        include_str!("../../scenarios/node-death.toml"),
    ),
    (
        "agent-death",
        include_str!("../../scenarios/agent-death.toml"),
    ),
    (
        "agent-loop",
        include_str!("../../scenarios/agent-loop.toml"),
    ),
    (
        "traffic-spike",
        include_str!("../../scenarios/traffic-spike.toml"),
    ),
    (
        "budget-exhausted",
        include_str!("../../scenarios/budget-exhausted.toml"),
    ),
];

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Play the full-length scenarios instead of the short forms (about 2.5 minutes more).
    #[arg(long)]
    pub full: bool,
    /// Only these scenarios (repeatable), e.g. --only provider-outage.
    #[arg(long)]
    pub only: Vec<String>,
    /// Print every scenario's full result as one JSON document on stdout (the progress goes
    /// to stderr then).
    #[arg(long)]
    pub json: bool,
    /// Also write that JSON document to FILE.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// The demo's private cluster. `down` stops it and removes its folder; a guard dropped without
/// `down` (a panic) still sends every recorded process SIGTERM.
struct DemoMesh {
    dir: PathBuf,
    down: bool,
}

impl DemoMesh {
    async fn up() -> Result<DemoMesh> {
        let dir = std::env::temp_dir().join(format!(
            "oam-demo-{}",
            crate::ids::random_hex(4).map_err(Error::failed)?
        ));
        let exe = local::oam_exe().map_err(Error::failed)?;
        let mut cluster = DemoMesh { dir, down: false };
        let plan = cluster::Plan::any_ports(cluster.dir.clone(), 3, exe);
        match cluster::up(&plan).await {
            Ok(_) => Ok(cluster),
            Err(e) => {
                cluster.down = true;
                let _ = std::fs::remove_dir_all(&cluster.dir);
                Err(match e {
                    cluster::UpError::Plan(e) => Error::new(Kind::Usage, e),
                    cluster::UpError::Start(e) => Error::failed(e),
                })
            }
        }
    }

    async fn down(mut self) {
        let _ = cluster::down(&self.dir, Duration::from_secs(2)).await;
        let _ = std::fs::remove_dir_all(&self.dir);
        self.down = true;
    }
}

impl Drop for DemoMesh {
    fn drop(&mut self) {
        if self.down {
            return;
        }
        if let Ok(Some(rec)) = local::MeshRecord::load(&self.dir) {
            for p in rec.processes.iter().filter(|p| local::is_ours(p)) {
                local::signal(p.pid, libc::SIGTERM);
            }
        }
    }
}

/// Where the words go: stdout, or stderr when stdout holds the JSON.
fn say(a: &Args) -> Box<dyn Write> {
    if a.json {
        Box::new(std::io::stderr())
    } else {
        Box::new(std::io::stdout())
    }
}

/// The reason codes worth showing (the routine ones left out), most frequent first.
fn notable(o: &ScenarioReport) -> String {
    let mut codes: Vec<(&String, &usize)> = o
        .summary
        .reason_codes
        .iter()
        .filter(|(c, _)| !["ROUTING_SELECTED", "ACCEPTED"].contains(&c.as_str()))
        .collect();
    codes.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let mut shown: Vec<String> = codes
        .iter()
        .take(3)
        .map(|(c, n)| format!("{c} {n}"))
        .collect();
    shown.extend(o.summary.errors.iter().map(|(e, n)| format!("{e} {n}")));
    for (c, n) in o.cluster_reasons.iter().filter(|(c, _)| {
        [
            "AGENT_LOOP_DETECTED",
            "ESCALATED_AGENT_LOOP",
            "BULKHEAD_SHED",
        ]
        .contains(&c.as_str())
    }) {
        shown.push(format!("{c} {n} (cluster)"));
    }
    if shown.is_empty() {
        "-".into()
    } else {
        shown.join(", ")
    }
}

fn verdict_line(o: &ScenarioReport) -> String {
    let s = &o.summary;
    let mut line = format!(
        "{} {}: {} requests, {:.1}% ok, p95 {:.0} ms; {}/{} expectations hold",
        if o.passed { "✓" } else { "✗" },
        o.scenario,
        s.sent,
        s.success_rate * 100.0,
        s.latency_ms.p95,
        o.verdicts.iter().filter(|v| v.ok).count(),
        o.verdicts.len()
    );
    for r in &o.recoveries {
        line.push_str(&format!(
            "; {}: requests stop failing {} ms after injection ({} failed), rerouted after {} ms",
            r.fault, r.recovery_ms, r.failed, r.reroute_ms
        ));
    }
    line
}

pub async fn run(a: Args) -> Result<Findings> {
    if let Some(unknown) = a
        .only
        .iter()
        .find(|o| !HEADLINE.iter().any(|(n, _)| n == o))
    {
        let names: Vec<&str> = HEADLINE.iter().map(|(n, _)| *n).collect();
        return Err(Error::usage(format!(
            "--only {unknown}: the demo plays {}",
            names.join(", ")
        )));
    }
    let chosen: Vec<(&str, &str)> = HEADLINE
        .iter()
        .copied()
        .filter(|(name, _)| a.only.is_empty() || a.only.iter().any(|o| o == name))
        .collect();
    let started = Instant::now();
    let mut out = say(&a);
    writeln!(
        out,
        "oam demo: a local mesh (nats-server, the provider simulator, three nodes, the liveness monitor, the chaos warden)"
    )?;
    let cluster = DemoMesh::up().await?;
    let played = play_all(&a, &chosen, &cluster, started).await;
    cluster.down().await;
    let outcomes = played?;
    let failed: Vec<&str> = outcomes
        .iter()
        .filter(|o| !o.passed)
        .map(|o| o.scenario.as_str())
        .collect();
    writeln!(
        out,
        "mesh down; nothing left running. {} of {} scenarios hold, in {:.0} s.",
        outcomes.len() - failed.len(),
        outcomes.len(),
        started.elapsed().as_secs_f64()
    )?;
    Ok(Findings::from_failures(
        outcomes.iter().flat_map(bench_scenario::failures).collect(),
    ))
}

/// Play the chosen scenarios on `mesh`, print the table, write `--json`.
async fn play_all(
    a: &Args,
    chosen: &[(&str, &str)],
    cluster: &DemoMesh,
    started: Instant,
) -> Result<Vec<ScenarioReport>> {
    let mut out = say(a);
    writeln!(
        out,
        "mesh up in {:.1} s; playing {} scenarios\n",
        started.elapsed().as_secs_f64(),
        chosen.len()
    )?;
    // Ctrl-C or SIGTERM stops the scenario under way (its faults ended, its agents stopped);
    // the mesh is taken down by the caller.
    let stop = super::bench::stop_on_signal();
    let play = async {
        let mut outcomes = Vec::new();
        for (name, text) in chosen {
            let s = Scenario::parse(text).map_err(|e| {
                Error::new(
                    Kind::Failed,
                    anyhow::anyhow!("built-in scenario {name}: {e}"),
                )
            })?;
            let s = if a.full { s } else { s.shortened() };
            writeln!(say(a), "▶ {}: {}", s.name, s.description)?;
            let bar = super::bench::progress_bar(1, &s.name);
            let tick = bar.clone();
            let o = bench_scenario::run(
                &cluster.dir,
                &s,
                !a.full,
                42,
                &stop,
                super::refused(),
                move |done, total| {
                    tick.set_length(total);
                    tick.set_position(done);
                },
            )
            .await;
            bar.finish_and_clear();
            let o = o?;
            if o.interrupted {
                return Err(Error::new(
                    Kind::Interrupted,
                    anyhow::anyhow!(
                        "interrupted during {}; the demo's mesh is taken down",
                        o.scenario
                    ),
                ));
            }
            writeln!(say(a), "{}", verdict_line(&o))?;
            for v in o.verdicts.iter().filter(|v| !v.ok) {
                writeln!(
                    say(a),
                    "    FAILED {} (measured {})",
                    v.expectation,
                    v.measured
                )?;
            }
            outcomes.push(o);
        }
        Ok::<_, Error>(outcomes)
    };
    let outcomes = play.await?;
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "scenario",
        "requests",
        "ok",
        "p95",
        "reason codes",
        "verdict",
    ]);
    for o in &outcomes {
        t.add_row(vec![
            o.scenario.clone(),
            o.summary.sent.to_string(),
            format!("{:.1}%", o.summary.success_rate * 100.0),
            format!("{:.0} ms", o.summary.latency_ms.p95),
            notable(o),
            if o.passed { "holds" } else { "FAILED" }.to_string(),
        ]);
    }
    super::fit(&mut t, false);
    writeln!(out, "\n{t}")?;
    if a.json || a.output.is_some() {
        let text = serde_json::to_string_pretty(&outcomes).map_err(Error::failed)? + "\n";
        if let Some(path) = &a.output {
            std::fs::write(path, &text)
                .map_err(|e| Error::usage(format!("cannot write {}: {e}", path.display())))?;
        }
        if a.json {
            std::io::stdout().lock().write_all(text.as_bytes())?;
        }
    }
    Ok(outcomes)
}
