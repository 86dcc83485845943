//! `oam rehearse CANDIDATE.toml`: decide a window of the decision log again under a candidate
//! configuration (its pipeline, targets, routes and budget limits) and say what would have
//! changed, before it goes live (`core::rehearsal`).

use crate::core::rehearsal::{Candidate, Report};
use crate::error::{Error, Findings, Kind, Result};
use crate::node::config::NodeConfig;
use crate::transport::store::decisions;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The candidate configuration (an `oam.toml`): its [pipeline], providers, routes and
    /// [budgets] limits are what the records are decided again under.
    pub candidate: PathBuf,
    /// The window: records written within this of now (30m, 2h, 7d).
    #[arg(long, default_value = "24h", value_parser = super::audit::parse_age)]
    pub since: u64,
    /// Only this node's records.
    #[arg(long)]
    pub node: Option<String>,
    /// The changed requests listed at most (the counts cover them all); --json lists all.
    #[arg(long, default_value_t = 20)]
    pub show: usize,
    /// One JSON document: the whole report, every change listed.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

pub async fn run(a: Args) -> Result<Findings> {
    let cfg = NodeConfig::load(Some(&a.candidate), "").map_err(Error::usage)?;
    let candidate = Candidate {
        config: cfg.pipeline.clone(),
        targets: cfg
            .targets
            .iter()
            .map(crate::node::config::Target::core)
            .collect(),
        routes: cfg.core_routes(),
        budgets: cfg.budgets.clone(),
    };
    let nats = a
        .cluster
        .connect(&super::Role::Viewer, "oam-rehearse")
        .await?;
    let from = crate::clock::now_ms().saturating_sub(a.since);
    let bar = super::bench::progress_bar(0, "rehearsing");
    bar.set_length(0);
    let mut report = Report::default();
    decisions::each_with_states(&nats, from, a.node.as_deref(), |record, states| {
        report.add(record, &candidate, |v| states.at(v));
        bar.inc_length(1);
        bar.inc(1);
    })
    .await
    .map_err(|e| Error::new(Kind::Unreachable, e))?;
    bar.finish_and_clear();
    let mut out = std::io::stdout().lock();
    if a.json {
        serde_json::to_writer_pretty(&mut out, &report).map_err(Error::failed)?;
        writeln!(out)?;
        return Ok(Findings::Ok);
    }
    write_report(&mut out, &report, &a)?;
    Ok(Findings::Ok)
}

/// The report for a person: what changed, counted, then the first changes.
fn write_report(out: &mut impl Write, r: &Report, a: &Args) -> Result<()> {
    let not: usize = r.not_replayed.values().map(Vec::len).sum();
    writeln!(
        out,
        "{} records in the window; {} decided again under {}; {} change ({} refusals appear, {} vanish)",
        r.records,
        r.replayed,
        a.candidate.display(),
        r.changed.len(),
        r.refusals_appear,
        r.refusals_vanish
    )?;
    let targets: std::collections::BTreeSet<&String> = r
        .spend_before_usd
        .keys()
        .chain(r.spend_after_usd.keys())
        .collect();
    if !targets.is_empty() {
        let rows = targets.into_iter().map(|t| {
            let usd = |m: &std::collections::BTreeMap<String, f64>| {
                crate::core::request::dollars(m.get(t).copied().unwrap_or(0.0), 6)
            };
            vec![t.clone(), usd(&r.spend_before_usd), usd(&r.spend_after_usd)]
        });
        writeln!(
            out,
            "{}",
            super::table(
                &["target", "spend as recorded", "under the candidate"],
                rows,
                false
            )
        )?;
    }
    if !r.changed.is_empty() {
        let rows = r.changed.iter().take(a.show).map(|c| {
            let said = |v: &crate::core::rehearsal::Verdict| {
                format!(
                    "{} {}",
                    v.outcome.as_str(),
                    v.target.as_deref().unwrap_or("-")
                )
            };
            vec![
                c.request_id.clone(),
                c.agent.clone(),
                said(&c.before),
                format!(
                    "{}{}",
                    said(&c.after),
                    if c.answer_assumed {
                        " (answer assumed)"
                    } else {
                        ""
                    }
                ),
                c.after
                    .reason_codes
                    .last()
                    .map_or(String::new(), |code| code.as_str().to_string()),
            ]
        });
        writeln!(
            out,
            "{}",
            super::table(
                &["request", "agent", "recorded", "candidate", "last reason"],
                rows,
                false
            )
        )?;
        if r.changed.len() > a.show {
            writeln!(
                out,
                "... and {} more (--show N, or --json for all)",
                r.changed.len() - a.show
            )?;
        }
    }
    if r.on_own_cut > 0 {
        writeln!(
            out,
            "{} of them on their own route's state only: the log no longer holds the state \
             timeline they saw (it rolled over), so targets they did not see have no observations",
            r.on_own_cut
        )?;
    }
    if not > 0 {
        writeln!(out, "{not} records not decided again:")?;
        for (why, ids) in &r.not_replayed {
            writeln!(out, "  {}: {why}", ids.len())?;
        }
    }
    writeln!(
        out,
        "(a target the candidate calls in place of the recorded one is assumed to answer as it \
         did: \"answer assumed\")"
    )?;
    Ok(())
}
