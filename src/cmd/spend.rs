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
    /// With --settle: a run is taken for gone once it has also written nothing to the ledger
    /// for this long (a node cut off from the bus gives up a settlement after 60 s; one it
    /// still holds, applied after a later one settled here, would be skipped).
    #[arg(long, default_value = "90s", value_parser = super::audit::parse_age)]
    pub gone_after: u64,
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
            let now = crate::clock::now_ms();
            let gone = Gone::of(&before.not_charged, &ledgers, &alive, now, a.gone_after);
            let settled = settle_gone(&store, gone, now).await?;
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

/// What `--settle` charged, and what it left.
#[derive(serde::Serialize, Default)]
struct Settled {
    /// Settlements applied now, each once.
    applied: Vec<Hole>,
    /// Recorded charges of runs of nodes heard alive: left to them.
    left: Vec<Hole>,
    /// Recorded charges of runs that wrote to the ledger within `--gone-after`: not yet.
    waiting: Vec<Hole>,
    /// Settlements that were in the ledger by the time they were applied.
    there_already: usize,
}

/// The uncharged answers `--settle` may charge (`gone`: their run's node was not heard, and
/// the run wrote nothing to the ledger for `quiet_ms`), and those it leaves.
#[derive(Debug, PartialEq)]
struct Gone {
    gone: Vec<Hole>,
    left: Vec<Hole>,
    waiting: Vec<Hole>,
}

impl Gone {
    fn of(
        holes: &[Hole],
        ledgers: &std::collections::BTreeMap<String, crate::core::ledger::Ledger>,
        alive: &std::collections::BTreeSet<String>,
        now_ms: u64,
        quiet_ms: u64,
    ) -> Gone {
        // The last a run was seen writing: a settlement, or now while it has a hold in force
        // (its node renews it while it lives; a dead run's lapses within its lease).
        let last = |holder: &str| {
            ledgers
                .values()
                .flat_map(|l| {
                    let settled = l.settled.get(holder).map(|s| s.at_ms);
                    let holding = l.holds.get(holder).filter(|h| h.until_ms > now_ms);
                    settled.into_iter().chain(holding.map(|_| now_ms))
                })
                .max()
                .unwrap_or(0)
        };
        let mut out = Gone {
            gone: Vec::new(),
            left: Vec::new(),
            waiting: Vec::new(),
        };
        for h in holes {
            let node = h.holder.split('#').next().unwrap_or("");
            if alive.contains(node) {
                out.left.push(h.clone());
            } else if now_ms.saturating_sub(last(&h.holder)) < quiet_ms {
                out.waiting.push(h.clone());
            } else {
                out.gone.push(h.clone());
            }
        }
        out
    }
}

/// Apply the holes of gone runs, budget by budget, at `now_ms`.
async fn settle_gone(
    store: &async_nats::jetstream::kv::Store,
    holes: Gone,
    now_ms: u64,
) -> Result<Settled> {
    let mut by_key: std::collections::BTreeMap<String, Vec<Hole>> = Default::default();
    for h in holes.gone {
        by_key.entry(h.budget.clone()).or_default().push(h);
    }
    let mut out = Settled {
        left: holes.left,
        waiting: holes.waiting,
        ..Settled::default()
    };
    for (k, mut holes) in by_key {
        holes.sort_by(|a, b| (&a.holder, a.seq).cmp(&(&b.holder, b.seq)));
        let (applied, _) = crate::transport::store::ledger::settle_holes(store, &k, &holes, now_ms)
            .await
            .map_err(|e| {
                Error::new(
                    Kind::Unreachable,
                    anyhow::Error::from(e).context(format!("settling {k}")),
                )
            })?;
        out.there_already += holes.len() - applied.len();
        out.applied
            .extend(applied.into_iter().map(|i| holes[i].clone()));
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
            s.applied.len(),
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
    if !s.waiting.is_empty() {
        let runs: std::collections::BTreeSet<&str> =
            s.waiting.iter().map(|h| h.holder.as_str()).collect();
        writeln!(
            out,
            "not yet: {} uncharged answers of {}, which wrote to the ledger within --gone-after; \
             run --settle again once they have been quiet that long",
            s.waiting.len(),
            runs.into_iter().collect::<Vec<_>>().join(", ")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_runs_of_unheard_nodes_quiet_long_enough_are_settled() {
        let hole = |holder: &str| Hole {
            request_id: format!("r-{holder}"),
            holder: holder.to_string(),
            seq: 1,
            budget: "global".into(),
            usd: 0.1,
            decided_at_ms: 0,
        };
        let mut ledger = crate::core::ledger::Ledger::new(10.0);
        assert!(ledger.settle_once("n2#quiet", 1, 0.0, 0.1, 1_000));
        assert!(ledger.settle_once("n3#recent", 1, 0.0, 0.1, 95_000));
        assert!(ledger.reserve("n4#holding", 0.1, 70_000, 40_000));
        assert!(ledger.reserve("n6#lapsed", 0.1, 10_000, 30_000));
        let ledgers = std::collections::BTreeMap::from([("global".to_string(), ledger)]);
        let alive = std::collections::BTreeSet::from(["n1".to_string()]);
        let holes = [
            "n1#old",
            "n2#quiet",
            "n3#recent",
            "n4#holding",
            "n5#unknown",
            "n6#lapsed",
        ]
        .map(hole);
        let g = Gone::of(&holes, &ledgers, &alive, 100_000, 90_000);
        let holders = |v: &[Hole]| v.iter().map(|h| h.holder.clone()).collect::<Vec<_>>();
        assert_eq!(holders(&g.left), ["n1#old"], "a node heard settles its own");
        assert_eq!(
            holders(&g.waiting),
            ["n3#recent", "n4#holding"],
            "wrote within 90 s, or holds still"
        );
        assert_eq!(holders(&g.gone), ["n2#quiet", "n5#unknown", "n6#lapsed"]);
    }
}
