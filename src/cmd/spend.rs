//! `oam spend [--verify] [--settle]`: the cluster's books. What each budget record says was
//! spent, beside the charges the decision log's records carry, per budget and per node run;
//! `--verify` exits 1 on any request answered and not charged, any settlement charged without a
//! record, any charged twice (`core::books`); `--settle` charges what the runs of nodes that are
//! gone answered and did not settle, from their records.

use crate::core::books::{Books, Drift, Hole, Report, read_export};
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
    /// Charge, from their records, what runs of nodes that are gone answered and did not settle
    /// (a node killed and never started again; one started again charges its earlier runs
    /// itself), each settlement once, then report the books as they are after. A node heard on
    /// the bus is left alone: its runs may still be settling. Needs the operator's credentials.
    #[arg(long)]
    pub settle: bool,
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
    let role = if a.settle {
        super::Role::Operator
    } else {
        super::Role::Viewer
    };
    let nats = a.cluster.connect(&role, "oam-spend").await?;
    let store = super::budget::open_on(&nats).await?;
    // Which nodes are alive: heard on the bus while the log is read (their heartbeats).
    let heard = if a.settle {
        Some(Heard::listen(&nats).await?)
    } else {
        None
    };
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
    let (mut ledgers, _) = super::budget::read_all(&store).await?;
    let drift = billed.map(|b| books.drift(&b, &crate::core::date::utc_date(from / 1_000)));
    let (report, settled) = match heard {
        Some(heard) => {
            let before = books
                .clone()
                .check(&ledgers, from, crate::clock::now_ms(), a.settling);
            let alive = heard.alive().await;
            let settled = settle_gone(&store, &before.not_charged, &alive).await?;
            if !settled.applied.is_empty() {
                (ledgers, _) = super::budget::read_all(&store).await?;
            }
            let after = books.check(&ledgers, from, crate::clock::now_ms(), a.settling);
            (after, Some(settled))
        }
        None => (
            books.check(&ledgers, from, crate::clock::now_ms(), a.settling),
            None,
        ),
    };
    let faults = report.faults();
    let mut out = std::io::stdout().lock();
    if a.json {
        let mut v = serde_json::to_value(&report).map_err(Error::failed)?;
        v["faults"] = serde_json::json!(faults);
        if let Some(d) = &drift {
            v["invoice"] = serde_json::to_value(d).map_err(Error::failed)?;
        }
        if let Some(s) = &settled {
            v["settled"] = serde_json::to_value(s).map_err(Error::failed)?;
        }
        serde_json::to_writer_pretty(&mut out, &v).map_err(Error::failed)?;
        writeln!(out)?;
    } else {
        if let Some(s) = &settled {
            write_settled(&mut out, s)?;
        }
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

/// The nodes heard on the bus: heartbeats from the moment `listen` subscribed.
struct Heard {
    sub: crate::transport::published::Published,
    since: std::time::Instant,
}

/// How long heartbeats are listened for before a node is taken for gone: several of its beats
/// (a node beats every second by default).
const HEARD_WITHIN: std::time::Duration = std::time::Duration::from_secs(3);

impl Heard {
    async fn listen(nats: &async_nats::Client) -> Result<Heard> {
        let sub =
            crate::transport::published::subscribe(nats, crate::transport::subjects::HEARTBEATS)
                .await
                .map_err(|e| Error::new(Kind::Unreachable, anyhow::anyhow!("{e}")))?;
        Ok(Heard {
            sub,
            since: std::time::Instant::now(),
        })
    }

    /// The nodes whose heartbeat came within `HEARD_WITHIN` of subscribing (waiting out what is
    /// left of it).
    async fn alive(mut self) -> std::collections::BTreeSet<String> {
        use futures_util::StreamExt as _;
        let mut alive = std::collections::BTreeSet::new();
        let until = tokio::time::Instant::from_std(self.since + HEARD_WITHIN);
        // The subject names its node (only a node may publish on its own).
        while let Ok(Some(m)) = tokio::time::timeout_at(until, self.sub.next()).await {
            if let Some(node) = m.subject.rsplit('.').next() {
                alive.insert(node.to_string());
            }
        }
        alive
    }
}

/// What `--settle` charged, and what it left to nodes that are alive.
#[derive(serde::Serialize, Default)]
struct Settled {
    /// Settlements applied now (each once: one the ledger had meanwhile is not counted).
    applied: Vec<Hole>,
    /// Recorded charges of runs of nodes heard alive: left to them.
    left: Vec<Hole>,
    /// Settlements that were in the ledger by the time they were applied.
    there_already: usize,
}

/// Apply the holes of runs whose node is not in `alive`, budget by budget.
async fn settle_gone(
    store: &async_nats::jetstream::kv::Store,
    holes: &[Hole],
    alive: &std::collections::BTreeSet<String>,
) -> Result<Settled> {
    let node_of = |h: &Hole| h.holder.split('#').next().unwrap_or("").to_string();
    let (gone, left): (Vec<&Hole>, Vec<&Hole>) =
        holes.iter().partition(|h| !alive.contains(&node_of(h)));
    let mut by_key: std::collections::BTreeMap<&str, Vec<Hole>> = Default::default();
    for h in gone {
        by_key.entry(&h.budget).or_default().push(h.clone());
    }
    let mut out = Settled {
        left: left.into_iter().cloned().collect(),
        ..Settled::default()
    };
    for (k, mut holes) in by_key {
        holes.sort_by(|a, b| (&a.holder, a.seq).cmp(&(&b.holder, b.seq)));
        let (n, _) =
            crate::transport::store::ledger::settle_holes(store, k, &holes, crate::clock::now_ms())
                .await
                .map_err(|e| Error::new(Kind::Unreachable, e.context(format!("settling {k}"))))?;
        out.there_already += holes.len() - n;
        out.applied.extend(holes);
    }
    Ok(out)
}

fn write_settled(out: &mut impl Write, s: &Settled) -> std::io::Result<()> {
    let usd: f64 = s.applied.iter().map(|h| h.usd).sum();
    let runs: std::collections::BTreeSet<&str> =
        s.applied.iter().map(|h| h.holder.as_str()).collect();
    if s.applied.is_empty() {
        writeln!(out, "settled: nothing a gone node's run left uncharged")?;
    } else {
        writeln!(
            out,
            "settled: {} charges ({}) that {} left uncharged ({})",
            s.applied.len() - s.there_already,
            dollars(usd, 6),
            runs.into_iter().collect::<Vec<_>>().join(", "),
            if s.there_already == 0 {
                "each once".to_string()
            } else {
                format!("{} were in the ledger already", s.there_already)
            }
        )?;
    }
    if !s.left.is_empty() {
        let nodes: std::collections::BTreeSet<&str> = s
            .left
            .iter()
            .map(|h| h.holder.split('#').next().unwrap_or(""))
            .collect();
        writeln!(
            out,
            "left: {} uncharged answers of runs of {}, which are alive and settle their own \
             (a node started again charges its earlier runs)",
            s.left.len(),
            nodes.into_iter().collect::<Vec<_>>().join(", ")
        )?;
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
