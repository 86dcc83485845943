//! `oam spend [--verify]`: the cluster's books. What each budget record says was spent, beside
//! the charges the decision log's records carry, per budget and per node run; `--verify`
//! exits 1 on any request answered and not charged, any settlement charged without a record,
//! any charged twice (`core::books`).

use crate::core::books::{Books, Drift, Report, read_export};
use crate::core::request::dollars;
use crate::error::{Error, Findings, Kind, Result};
use crate::transport::store::decisions;
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Check the books: exit 1, naming request ids, on any request answered and not charged,
    /// any settlement without a record, any charged twice, any total that does not add up.
    #[arg(long)]
    pub verify: bool,
    /// The window of the decision log: records written within this of now (30m, 2h, 7d).
    /// Node runs that began before it are checked by settlement number only.
    #[arg(long, default_value = "24h", value_parser = super::audit::parse_age)]
    pub since: u64,
    /// A recorded charge younger than this that the ledger lacks may be on its way (nodes write
    /// settlements within a second while the ledger answers): pending, not a fault.
    #[arg(long, default_value = "30s", value_parser = super::audit::parse_age)]
    pub settling: u64,
    /// The faults and per-run rows listed at most (the counts cover them all); --json lists
    /// all.
    #[arg(long, default_value_t = 20)]
    pub show: usize,
    /// A provider's usage export (CSV with a header row: a day, a model and a cost column;
    /// docs/commands.md lists the names read): what the records cost per UTC day and model
    /// beside what was billed, from the window's first day on.
    #[arg(long, value_name = "FILE.csv")]
    pub invoice: Option<std::path::PathBuf>,
    /// One JSON document: the whole report.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

pub async fn run(a: Args) -> Result<Findings> {
    // A bad export is said before anything is read from the cluster.
    let billed = match &a.invoice {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::usage(format!("--invoice {}: {e}", path.display())))?;
            Some(
                read_export(&text)
                    .map_err(|e| Error::usage(format!("--invoice {}: {e}", path.display())))?,
            )
        }
        None => None,
    };
    let nats = a.cluster.connect(&super::Role::Viewer, "oam-spend").await?;
    let store = super::budget::open_on(&nats).await?;
    let now = crate::clock::now_ms();
    let from = now.saturating_sub(a.since);
    let bar = super::bench::progress_bar(0, "reading the decision log");
    let mut books = Books::default();
    decisions::each(&nats, from, None, |r| {
        books.add(r);
        bar.inc_length(1);
        bar.inc(1);
    })
    .await
    .map_err(|e| Error::new(Kind::Unreachable, e))?;
    bar.finish_and_clear();
    // The ledger is read after the records: a charge recorded is then either applied already
    // or younger than the settling delay.
    let (ledgers, _) = super::budget::read_all(&store).await?;
    let drift = billed.map(|b| books.drift(&b, &crate::core::date::utc_date(from / 1_000)));
    let report = books.check(&ledgers, from, crate::clock::now_ms(), a.settling);
    let faults = report.faults();
    let mut out = std::io::stdout().lock();
    if a.json {
        let mut v = serde_json::to_value(&report).map_err(Error::failed)?;
        v["faults"] = serde_json::json!(faults);
        if let Some(d) = &drift {
            v["invoice"] = serde_json::to_value(d).map_err(Error::failed)?;
        }
        serde_json::to_writer_pretty(&mut out, &v).map_err(Error::failed)?;
        writeln!(out)?;
    } else {
        write_report(&mut out, &report, &faults, &a)?;
        if let Some(d) = &drift {
            write_drift(&mut out, d)?;
        }
    }
    Ok(if a.verify {
        Findings::from_failures(faults)
    } else {
        Findings::Ok
    })
}

fn write_report(
    out: &mut impl Write,
    r: &Report,
    faults: &[String],
    a: &Args,
) -> std::io::Result<()> {
    let usd = |v: f64| dollars(v, 6);
    writeln!(
        out,
        "{} records in the window, {} of them charged: {} charges, {}",
        r.records,
        r.charged_records,
        r.charges,
        usd(r.charged_usd)
    )?;
    if !r.budgets.is_empty() {
        let rows = r.budgets.iter().map(|b| {
            vec![
                b.key.clone(),
                usd(b.limit_usd),
                usd(b.spent_usd),
                usd(b.settled_usd),
                usd(b.recorded_usd),
                b.holders.to_string(),
            ]
        });
        writeln!(
            out,
            "{}",
            super::table(
                &[
                    "budget",
                    "limit",
                    "spent",
                    "settlements add up to",
                    "charged in the window",
                    "node runs"
                ],
                rows,
                false
            )
        )?;
    }
    if !r.holders.is_empty() {
        let rows = r.holders.iter().take(a.show).map(|h| {
            vec![
                h.holder.clone(),
                h.budget.clone(),
                h.applied.to_string(),
                usd(h.ledger_usd),
                if h.whole {
                    usd(h.recorded_usd)
                } else {
                    "(began before the window)".into()
                },
            ]
        });
        writeln!(
            out,
            "{}",
            super::table(
                &[
                    "node run",
                    "budget",
                    "last settlement applied",
                    "ledger",
                    "its records"
                ],
                rows,
                false
            )
        )?;
        if r.holders.len() > a.show {
            writeln!(out, "... and {} more rows", r.holders.len() - a.show)?;
        }
    }
    if !r.pending.is_empty() {
        writeln!(
            out,
            "{} charges younger than --settling {}s are not in the ledger yet (not counted as \
             faults)",
            r.pending.len(),
            a.settling / 1_000
        )?;
    }
    for u in &r.unchecked {
        writeln!(out, "not checked: {u}")?;
    }
    if !r.repeated_ids.is_empty() {
        writeln!(
            out,
            "{} request ids were answered (and charged) more than once, each time by its own \
             record: {}",
            r.repeated_ids.len(),
            r.repeated_ids
                .iter()
                .take(a.show)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        )?;
    }
    if faults.is_empty() {
        writeln!(
            out,
            "the books hold: every recorded charge is in the ledger once, every settlement has \
             its record, and every total adds up"
        )?;
    } else {
        writeln!(out, "{} faults:", faults.len())?;
        for f in faults.iter().take(a.show) {
            writeln!(out, "  {f}")?;
        }
        if faults.len() > a.show {
            writeln!(
                out,
                "  ... and {} more (--show N, or --json)",
                faults.len() - a.show
            )?;
        }
    }
    Ok(())
}

/// The export beside the records, per day and model, with the totals.
fn write_drift(out: &mut impl Write, rows: &[Drift]) -> std::io::Result<()> {
    let usd = |v: f64| dollars(v, 6);
    let (ours, theirs): (f64, f64) = rows.iter().fold((0.0, 0.0), |(o, t), r| {
        (o + r.recorded_usd, t + r.billed_usd)
    });
    let table = rows.iter().map(|r| {
        vec![
            r.day.clone(),
            r.model.clone(),
            usd(r.recorded_usd),
            usd(r.billed_usd),
            usd(r.drift_usd),
        ]
    });
    writeln!(
        out,
        "{}",
        super::table(
            &[
                "day (UTC)",
                "model",
                "recorded",
                "billed",
                "billed - recorded"
            ],
            table,
            false
        )
    )?;
    writeln!(
        out,
        "the export against the records: {} billed, {} recorded, {} apart",
        usd(theirs),
        usd(ours),
        usd(theirs - ours)
    )
}
