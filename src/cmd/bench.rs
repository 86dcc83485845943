//! `oam bench`: bounded load against the nodes' HTTP data plane, with a summary table and a
//! full JSON result.

use crate::bench::load::{self as bench, LoadPlan, Report};
use crate::bench::runner as bench_scenario;
use crate::core::request::{Priority, Risk};
use crate::error::{Error, Findings, Kind, Result};
use crate::local::MeshRecord;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use tokio_util::sync::CancellationToken;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A node's base URL (repeatable; requests go round-robin). Default: the nodes of the local
    /// mesh in --dir.
    #[arg(long = "url")]
    pub urls: Vec<String>,
    /// Number of requests.
    #[arg(short = 'n', long, default_value_t = 1_000)]
    pub requests: usize,
    /// Concurrent requests.
    #[arg(short = 'c', long, default_value_t = 50)]
    pub concurrency: usize,
    /// Target requests per second across all workers (default: as fast as possible).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Stop starting requests after this many seconds, even if -n is not reached.
    #[arg(long)]
    pub duration: Option<f64>,
    /// The agent every request names (its budget, rate limits and loop counts apply).
    #[arg(long, default_value = "bench")]
    pub agent: String,
    /// The task every request names (part of what a loop is counted by).
    #[arg(long, default_value = "bench")]
    pub task: String,
    /// The model every request asks for: `auto` (scored routing over every target) or a
    /// route's name (`json` on the demo mesh holds answers to the JSON contract).
    #[arg(long, default_value = "auto")]
    pub model: String,
    /// The risk every request declares (high-risk work never spends a local budget share).
    #[arg(long, default_value = "low", value_parser = risks())]
    pub risk: Risk,
    /// The priority every request declares (its bulkhead class).
    #[arg(long, default_value = "normal", value_parser = priorities())]
    pub priority: Priority,
    /// A request kind in the mix, repeatable, chosen per request by weight, e.g.
    /// `--mix risk=high,priority=critical,agent=support-bot,weight=1 --mix weight=9`
    /// (keys: risk, priority, agent, task, model, api, weight; unset keys take the flags
    /// above).
    #[arg(long = "mix")]
    pub mix: Vec<String>,
    /// Send the requests on the NATS data plane (`oam.v1.request`) instead of HTTP.
    #[arg(long, conflicts_with = "urls")]
    pub nats: bool,
    /// Ask for streamed answers (`"stream": true`, plain text so no contract holds them back):
    /// a stream counts as answered only if it ends with `[DONE]`; an in-band error or a cut
    /// stream is a failure.
    #[arg(long, conflicts_with = "nats")]
    pub stream: bool,
    /// Seeds the mix's choices and the questions asked, so a run can be repeated.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Per-request timeout in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub timeout_ms: u64,
    /// Print the full result as one JSON document on stdout (and nothing else there).
    #[arg(long)]
    pub json: bool,
    /// Also write the full result as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// The share of requests that may fail (no 200) before the run exits 1, e.g. 0.05.
    /// (Scenarios judge failures by their own expectations.)
    #[arg(
        long,
        value_name = "RATE",
        default_value_t = 0.0,
        conflicts_with = "scenario"
    )]
    pub allow_failures: f64,
    /// Run a scenario (`scenarios/*.toml`): its load, chaos timeline and expectations, against
    /// the local mesh in --dir. Exits 1 naming each expectation that failed.
    #[arg(long)]
    pub scenario: Option<PathBuf>,
    /// The scenario's short form (every time scaled down; what CI runs).
    #[arg(long, requires = "scenario")]
    pub short: bool,
    /// The mesh: its folder (the nodes' URLs when no --url is given, and where a scenario
    /// runs), or its NATS URL for --nats.
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

/// `--risk`: low, medium or high.
fn risks() -> impl clap::builder::TypedValueParser<Value = Risk> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(Risk::ALL.map(Risk::as_str))
        .map(|name: String| Risk::from_name(&name).unwrap_or_default())
}

/// `--priority`: critical, normal or background.
fn priorities() -> impl clap::builder::TypedValueParser<Value = Priority> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(Priority::ALL.map(Priority::as_str))
        .map(|name: String| Priority::from_name(&name).unwrap_or_default())
}

/// One `--mix` value: `key=value` pairs separated by commas.
fn parse_mix(spec: &str, a: &Args) -> Result<crate::bench::scenario::Mix> {
    let mut m = crate::bench::scenario::Mix {
        weight: 1,
        risk: a.risk,
        priority: a.priority,
        agent: a.agent.clone(),
        task: a.task.clone(),
        max_tokens: None,
        api: Default::default(),
        model: a.model.clone(),
    };
    for pair in spec.split(',').filter(|p| !p.trim().is_empty()) {
        let (k, v) = pair.split_once('=').ok_or_else(|| {
            Error::usage(format!(
                "--mix {spec:?}: use key=value pairs, e.g. risk=high,weight=2"
            ))
        })?;
        let (k, v) = (k.trim(), v.trim().to_string());
        let invalid = || {
            Error::usage(format!(
                "--mix {spec:?}: {k}={v} is not valid; keys are risk (low|medium|high), \
                 priority (critical|normal|background), agent, task, model, weight, \
                 api (chat|messages|responses|embeddings)"
            ))
        };
        match k {
            "risk" => m.risk = Risk::from_name(&v).ok_or_else(invalid)?,
            "priority" => m.priority = Priority::from_name(&v).ok_or_else(invalid)?,
            "agent" => m.agent = v,
            "task" => m.task = v,
            "model" => m.model = v,
            "api" => {
                m.api = crate::bench::scenario::Surface::from_name(&v).ok_or_else(invalid)?;
            }
            "weight" => {
                m.weight = v.parse().map_err(|_| {
                    Error::usage(format!("--mix {spec:?}: weight must be a whole number"))
                })?;
            }
            _ => return Err(invalid()),
        }
    }
    Ok(m)
}

/// `--output FILE` writes `v` to FILE; `--json` prints it on stdout instead of the table
/// (returns true then).
fn emit_json<T: serde::Serialize>(a: &Args, v: &T) -> Result<bool> {
    if !a.json && a.output.is_none() {
        return Ok(false);
    }
    let text = serde_json::to_string_pretty(v).map_err(Error::failed)? + "\n";
    if let Some(path) = &a.output {
        std::fs::write(path, &text)
            .map_err(|e| Error::usage(format!("cannot write {}: {e}", path.display())))?;
    }
    if a.json {
        std::io::stdout().lock().write_all(text.as_bytes())?;
    }
    Ok(a.json)
}

pub async fn run(a: Args) -> Result<Findings> {
    if let Some(path) = &a.scenario {
        return scenario(&a, path).await;
    }
    if !(0.0..=1.0).contains(&a.allow_failures) {
        return Err(Error::usage(
            "--allow-failures is a share between 0 and 1, e.g. 0.05",
        ));
    }
    if a.requests == 0 || a.concurrency == 0 {
        return Err(Error::usage("-n and -c must be at least 1"));
    }
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if a.rate.is_some_and(|r| !positive(r)) || a.duration.is_some_and(|d| !positive(d)) {
        return Err(Error::usage("--rate and --duration must be positive"));
    }
    // Every run stops by itself within a day: the schedule must fit.
    const DAY_S: f64 = 86_400.0;
    if let Some(rate) = a.rate
        && a.duration.is_none()
        && (a.requests as f64 / rate) > DAY_S
    {
        return Err(Error::usage(format!(
            "--rate {rate}: {} requests would take more than a day; raise --rate or lower -n",
            a.requests
        )));
    }
    if a.duration.is_some_and(|d| d > DAY_S) {
        return Err(Error::usage("--duration must be at most 86400 seconds"));
    }
    let mix = a
        .mix
        .iter()
        .map(|spec| parse_mix(spec, &a))
        .collect::<Result<Vec<_>>>()?;
    // Over NATS the requests go to `oam.v1.request` (any node of the queue group): no URLs.
    let urls = if a.nats {
        Vec::new()
    } else if a.urls.is_empty() {
        let dir = a.cluster.dir();
        let rec = MeshRecord::load(&dir)
            .map_err(|e| Error::new(Kind::Usage, e))?
            .ok_or_else(|| {
                Error::new(
                    Kind::Unreachable,
                    anyhow::anyhow!(
                        "no --url given and no mesh recorded in {}; start one with `oam mesh up` \
                         or pass --url http://HOST:PORT",
                        dir.display()
                    ),
                )
            })?;
        rec.nodes().map(|n| n.endpoint.clone()).collect()
    } else {
        a.urls.clone()
    };
    let plan = LoadPlan {
        urls,
        requests: a.requests,
        concurrency: a.concurrency,
        rate_per_s: a.rate,
        max_duration_ms: a.duration.map(|d| (d * 1_000.0) as u64),
        agent: a.agent.clone(),
        model: a.model.clone(),
        task: a.task.clone(),
        risk: a.risk,
        priority: a.priority,
        seed: a.seed,
        timeout_ms: a.timeout_ms,
        mix,
        stream: a.stream,
    };
    let http = crate::http::http_client(None).map_err(Error::failed)?;
    let bar = progress_bar(plan.requests as u64, "");
    let tick = bar.clone();
    let target = if a.nats {
        let nats = a.cluster.connect(&super::Role::Caller, "oam-bench").await?;
        let asker = crate::transport::ask::Asker::new(nats)
            .await
            .map_err(|e| Error::new(Kind::Unreachable, e))?;
        bench::Through::Nats(std::sync::Arc::new(asker))
    } else {
        bench::Through::Http(http)
    };
    let stop = stop_on_signal();
    let report = bench::run(plan, target, &stop, move || tick.inc(1)).await;
    bar.finish_and_clear();
    if !emit_json(&a, &report)? {
        writeln!(std::io::stdout().lock(), "{}", table(&report))?;
    }
    if report.interrupted {
        return Err(interrupted(report.sent, report.plan.requests));
    }
    if report.sent == 0 {
        return Ok(Findings::Failed(vec!["no request was sent".into()]));
    }
    let share = report.failed as f64 / report.sent as f64;
    if share > a.allow_failures {
        let why: Vec<String> = report
            .failures
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        return Ok(Findings::Failed(vec![format!(
            "{} of {} requests failed ({:.1}%: {}); --allow-failures {:.2} would accept that share",
            report.failed,
            report.sent,
            share * 100.0,
            why.join(", "),
            share
        )]));
    }
    Ok(Findings::Ok)
}

/// A token cancelled by Ctrl-C or SIGTERM: the load stops and the report of what finished is
/// still written.
pub(crate) fn stop_on_signal() -> CancellationToken {
    let stop = CancellationToken::new();
    let on_signal = stop.clone();
    tokio::spawn(async move {
        crate::cmd::terminated().await;
        on_signal.cancel();
    });
    stop
}

fn interrupted(sent: usize, planned: usize) -> Error {
    Error::new(
        Kind::Interrupted,
        anyhow::anyhow!(
            "interrupted after {sent} of {planned} requests; the report above covers those"
        ),
    )
}

/// A request rate as a bar shows it: whole requests per second (`35 req/s`), one decimal
/// below ten.
fn rate(per_sec: f64) -> String {
    if per_sec < 10.0 {
        format!("{per_sec:.1} req/s")
    } else {
        format!("{per_sec:.0} req/s")
    }
}

/// A progress bar on a terminal's stderr (hidden otherwise).
pub(crate) fn progress_bar(len: u64, prefix: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    if std::io::stderr().is_terminal() {
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{prefix} {spinner} {bar:40} {pos}/{len} requests  {rate}  eta {eta}",
            )
            .map_or_else(
                |_| indicatif::ProgressStyle::default_bar(),
                |style| {
                    style.with_key(
                        "rate",
                        |s: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                            let _ = w.write_str(&rate(s.per_sec()));
                        },
                    )
                },
            ),
        );
        bar.set_prefix(prefix.to_string());
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar
}

async fn scenario(a: &Args, path: &std::path::Path) -> Result<Findings> {
    let s = bench_scenario::load(path, a.short)?;
    let bar = progress_bar(1, &s.name);
    let tick = bar.clone();
    let stop = stop_on_signal();
    let outcome = bench_scenario::run(
        &a.cluster.dir(),
        &s,
        a.short,
        a.seed,
        &stop,
        super::refused(),
        move |done, total| {
            tick.set_length(total);
            tick.set_position(done);
        },
    )
    .await?;
    bar.finish_and_clear();
    if !emit_json(a, &outcome)? {
        let mut out = std::io::stdout().lock();
        writeln!(
            out,
            "scenario {}{}: {}",
            outcome.scenario,
            if a.short { " (short)" } else { "" },
            outcome.description
        )?;
        writeln!(out, "{}", table(&outcome.summary))?;
        writeln!(out, "{}", bench_scenario::table(&outcome))?;
    }
    if outcome.interrupted {
        return Err(interrupted(
            outcome.summary.sent,
            outcome.summary.plan.requests,
        ));
    }
    Ok(Findings::from_failures(bench_scenario::failures(&outcome)))
}

fn table(r: &Report) -> String {
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_header(vec!["measure", "value"]);
    let pct = |n: usize| format!("{n} ({:.1}%)", 100.0 * n as f64 / r.sent.max(1) as f64);
    t.add_row(vec![
        "requests".into(),
        format!("{} in {:.2} s", r.sent, r.elapsed_s),
    ]);
    t.add_row(vec!["succeeded".into(), pct(r.succeeded)]);
    t.add_row(vec![
        "throughput".into(),
        format!("{:.1} req/s", r.throughput_per_s),
    ]);
    let l = &r.latency_ms;
    t.add_row(vec![
        "latency p50 / p95 / p99 / max".into(),
        format!(
            "{:.1} / {:.1} / {:.1} / {:.1} ms",
            l.p50, l.p95, l.p99, l.max
        ),
    ]);
    if let Some(f) = &r.ttft_ms {
        t.add_row(vec![
            "first token p50 / p95 / p99 / max".into(),
            format!(
                "{:.1} / {:.1} / {:.1} / {:.1} ms",
                f.p50, f.p95, f.p99, f.max
            ),
        ]);
    }
    for (k, v) in &r.phases {
        t.add_row(vec![format!("phase {k}"), pct(*v)]);
    }
    for (k, v) in &r.providers {
        t.add_row(vec![format!("served by {k}"), pct(*v)]);
    }
    for (k, v) in &r.reason_codes {
        t.add_row(vec![format!("  {k}"), v.to_string()]);
    }
    if r.failed > 0 {
        t.add_row(vec!["failed".into(), pct(r.failed)]);
        for (k, v) in &r.failures {
            t.add_row(vec![format!("  {k}"), v.to_string()]);
        }
    }
    super::fit(&mut t, false);
    t.to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_rate_reads_in_whole_requests_per_second() {
        assert_eq!(super::rate(34.984_4), "35 req/s");
        assert_eq!(super::rate(2.25), "2.2 req/s");
    }
}
