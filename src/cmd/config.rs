//! `oam config check [FILE]`: read a nodes' configuration as `oam node run` would, without
//! starting anything, and say what it holds (targets, routes, which prices come from the price
//! table) or where it is wrong (`file:line: ...`, exit 2).

use crate::error::{Error, Result};
use crate::node::config::{self, NodeConfig};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Validate a configuration without starting anything: exit 0 and a summary when a node
    /// would start on it, exit 2 naming the file, line and field when it would not.
    Check(CheckArgs),
}

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The file (default: $OAM_CONFIG, else ./oam.toml).
    pub file: Option<PathBuf>,
    /// Print one JSON document instead of the summary.
    #[arg(long)]
    pub json: bool,
}

/// What `check` found, for `--json`.
#[derive(Serialize)]
struct Checked {
    file: String,
    targets: Vec<TargetRow>,
    routes: Vec<String>,
    clients: usize,
    /// The price table's date, when a target is priced from it.
    #[serde(skip_serializing_if = "Option::is_none")]
    price_table: Option<String>,
    warnings: Vec<String>,
}

#[derive(Serialize)]
struct TargetRow {
    id: String,
    model: String,
    /// `config`, `table` (the price table) or `none`.
    priced_by: &'static str,
    input_usd_per_1m: f64,
    output_usd_per_1m: f64,
    fallback: bool,
}

pub fn run(args: Args) -> Result<()> {
    match args.command {
        Command::Check(a) => check(a),
    }
}

fn check(a: CheckArgs) -> Result<()> {
    let Some((path, _)) = config::discover(a.file) else {
        return Err(Error::usage(
            "no configuration to check: name a file, set OAM_CONFIG, or run where oam.toml is \
             (examples/ has starter configurations)",
        ));
    };
    let cfg = NodeConfig::load(Some(&path), "").map_err(Error::usage)?;
    let targets: Vec<TargetRow> = cfg
        .targets
        .iter()
        .map(|t| {
            let c = t.core();
            TargetRow {
                id: t.id.clone(),
                model: t.model.clone(),
                priced_by: if t.table_priced {
                    "table"
                } else if c.is_zero_cost() {
                    "none"
                } else {
                    "config"
                },
                input_usd_per_1m: round(t.cost_per_1k_tokens_usd * 1_000.0),
                output_usd_per_1m: round(
                    t.output_cost_per_1k_usd.unwrap_or(t.cost_per_1k_tokens_usd) * 1_000.0,
                ),
                fallback: t.fallback,
            }
        })
        .collect();
    let table = crate::node::prices::table();
    let checked = Checked {
        file: path.display().to_string(),
        price_table: targets
            .iter()
            .any(|t| t.priced_by == "table")
            .then(|| table.as_of.clone()),
        routes: cfg.routes.iter().map(|r| r.model.clone()).collect(),
        clients: cfg.clients.len(),
        warnings: cfg.warnings(),
        targets,
    };
    let mut out = std::io::stdout().lock();
    if a.json {
        serde_json::to_writer_pretty(&mut out, &checked).map_err(Error::failed)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(
        out,
        "{}: ok: {} targets, {} routes, {} clients",
        checked.file,
        checked.targets.len(),
        checked.routes.len(),
        checked.clients
    )?;
    let rows = checked.targets.iter().map(|t| {
        let price = match t.priced_by {
            "none" => "$0 (no price)".to_string(),
            by => format!(
                "${} in, ${} out per 1M ({by})",
                t.input_usd_per_1m, t.output_usd_per_1m
            ),
        };
        let fallback = if t.fallback { "fallback" } else { "" };
        vec![t.id.clone(), t.model.clone(), price, fallback.to_string()]
    });
    writeln!(
        out,
        "{}",
        super::table(&["target", "model", "price", ""], rows, false)
    )?;
    if let Some(as_of) = &checked.price_table {
        writeln!(
            out,
            "prices marked (table) are list prices of {as_of} from data/prices.toml ({}); \
             give a target its own cost_per_* keys where yours differ",
            table.sources.join(", ")
        )?;
    }
    for w in &checked.warnings {
        writeln!(out, "warning: {w}")?;
    }
    Ok(())
}

/// Dollars per million tokens, without float noise.
fn round(usd: f64) -> f64 {
    (usd * 1e6).round() / 1e6
}
