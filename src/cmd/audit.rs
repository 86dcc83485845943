//! `oam audit`: list and filter the decision log (who asked, what was decided, why), and
//! `--verify` that every record replays to the decision it recorded.

use crate::core::pipeline::DecisionOutcome;
use crate::core::record::Record;
use crate::error::{Error, Findings, Kind, Result};
use crate::transport::store::decisions::{self, Stored};
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Only this agent's requests.
    #[arg(long)]
    pub agent: Option<String>,
    /// Only requests whose reason codes include this one (`oam reasons` lists them).
    #[arg(long)]
    pub code: Option<String>,
    /// Only requests with this outcome.
    #[arg(long, value_enum)]
    pub outcome: Option<OutcomeArg>,
    /// How far back to look: e.g. 30m, 2h, 7d.
    #[arg(long, default_value = "1h", value_parser = parse_age)]
    pub since: u64,
    /// Leave out the newest: requests decided within this of now (e.g. 5m).
    #[arg(long, value_parser = parse_age)]
    pub until: Option<u64>,
    /// The newest N records at most.
    #[arg(long, default_value_t = 50)]
    pub limit: usize,
    /// Replay every record listed through the core; exit 1 naming any whose replay differs
    /// from what it recorded.
    #[arg(long)]
    pub verify: bool,
    /// One JSON array of records (each with its replay verdict under --verify).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutcomeArg {
    Accepted,
    Rejected,
    Escalated,
}

/// An age, `30m`, `2h`, `7d`, `90s` (the one duration parser, `date::parse_span`), as
/// milliseconds. A bare number is refused: it meant minutes here once, and seconds everywhere
/// else.
pub(crate) fn parse_age(s: &str) -> std::result::Result<u64, super::BadValue> {
    if !s.trim().is_empty() && s.trim().chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(super::BadValue(format!(
            "{s:?}: give a unit, e.g. {}m, {}h or {}d",
            s.trim(),
            s.trim(),
            s.trim()
        )));
    }
    let d = crate::core::date::parse_span(s).map_err(|e| e.to_string())?;
    Ok(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Read the log from `since_ms` ago (as a viewer), keeping what `keep` wants: those records,
/// and how many were read in all.
pub async fn read(
    cluster: &super::ClusterArgs,
    since_ms: u64,
    node: Option<&str>,
    keep: impl Fn(&Record) -> bool,
    last: usize,
) -> Result<(Vec<Stored>, usize)> {
    let nats = cluster.connect(&super::Role::Viewer, "oam-audit").await?;
    let from = crate::clock::now_ms().saturating_sub(since_ms);
    decisions::read(&nats, from, node, keep, last)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))
}

pub async fn run(a: Args) -> Result<Findings> {
    if let Some(code) = &a.code
        && !crate::core::reason::ReasonCode::ALL
            .iter()
            .any(|c| c.as_str() == code)
    {
        return Err(Error::usage(format!(
            "--code {code}: not a reason code (`oam reasons` lists them)"
        )));
    }
    let now = crate::clock::now_ms();
    let newest = a.until.map_or(u64::MAX, |u| now.saturating_sub(u));
    let outcome = a.outcome.map(|o| match o {
        OutcomeArg::Accepted => DecisionOutcome::Accepted,
        OutcomeArg::Rejected => DecisionOutcome::Rejected,
        OutcomeArg::Escalated => DecisionOutcome::Escalated,
    });
    let wanted = |r: &Record| {
        let d = &r.decision;
        a.agent.as_ref().is_none_or(|x| *x == d.agent)
            && a.code
                .as_ref()
                .is_none_or(|c| d.reason_codes.iter().any(|r| r.as_str() == c))
            && outcome.is_none_or(|o| o == d.outcome)
            && d.decided_at_ms <= newest
    };
    // Only the newest `limit` matches are held: memory stays bounded on a full log.
    let (entries, total) = read(&a.cluster, a.since, None, wanted, a.limit).await?;
    let picked: Vec<&Stored> = entries.iter().collect();
    let verdicts: Vec<Option<Replay>> = picked
        .iter()
        .map(|e| a.verify.then(|| Replay::of(&e.record, &e.config)))
        .collect();
    let differ: Vec<&str> = picked
        .iter()
        .zip(&verdicts)
        .filter(|(_, v)| matches!(v, Some(Replay::Differs(_))))
        .map(|(e, _)| e.record.decision.request_id.as_str())
        .collect();
    let mut out = std::io::stdout().lock();
    if a.json {
        let rows: Vec<serde_json::Value> = picked
            .iter()
            .zip(&verdicts)
            .map(|(e, v)| {
                let mut row = serde_json::json!({"node": e.record.node, "record": e.record});
                if let Some(v) = v {
                    row["replay"] = match v {
                        Replay::Identical => serde_json::json!({"identical": true}),
                        Replay::Differs(why) => {
                            serde_json::json!({"identical": false, "difference": why})
                        }
                        Replay::Hashed => serde_json::json!({"replayable": false,
                            "why": "its messages were kept as hashes only"}),
                    };
                }
                row
            })
            .collect();
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&rows).map_err(Error::failed)?
        )?;
    } else if picked.is_empty() {
        writeln!(
            out,
            "no decisions recorded that match in the last {}",
            age(a.since)
        )?;
    } else {
        let full = super::width().is_none_or(|w| w >= 120);
        let mut header = vec!["request", "age", "node", "agent", "outcome", "phase"];
        if full {
            header.push("provider");
        }
        let reasons_at = header.len();
        header.push("reasons");
        if a.verify {
            header.push("replay");
        }
        let rows: Vec<Vec<String>> = picked
            .iter()
            .zip(&verdicts)
            .map(|(e, v)| {
                let d = &e.record.decision;
                let mut row = vec![
                    d.request_id.clone(),
                    age(now.saturating_sub(d.decided_at_ms)),
                    e.record.node.clone(),
                    d.agent.clone(),
                    d.outcome.as_str().to_string(),
                    d.phase.to_string(),
                ];
                if full {
                    row.push(d.provider.as_deref().unwrap_or("-").to_string());
                }
                let codes: Vec<&str> = d.reason_codes.iter().map(|c| c.as_str()).collect();
                row.push(codes.join(", "));
                if let Some(v) = v {
                    row.push(
                        match v {
                            Replay::Identical => "identical",
                            Replay::Differs(_) => "DIFFERS",
                            Replay::Hashed => "hashed, not replayable",
                        }
                        .into(),
                    );
                }
                row
            })
            .collect();
        let longest = rows
            .iter()
            .flat_map(|r| r[reasons_at].split(", "))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let mut t = super::table(&header, rows, false);
        // A reason code is one word: the column is never narrower than the longest, so codes
        // wrap between each other, never inside one.
        if let Some(c) = t.column_mut(reasons_at) {
            c.set_constraint(comfy_table::ColumnConstraint::LowerBoundary(
                // (with the cell's padding, a space each side)
                comfy_table::Width::Fixed(u16::try_from(longest + 2).unwrap_or(u16::MAX)),
            ));
        }
        writeln!(out, "{t}")?;
        // Read back from the newest, the log is read only until `--limit` records match: then
        // how many more the window holds is not known.
        let said = if picked.len() >= a.limit {
            format!(
                "the newest {} matching records of the last {} (--limit {}; older ones may \
                 match too)",
                picked.len(),
                age(a.since),
                a.limit
            )
        } else {
            format!(
                "{} of {} recorded in the last {}",
                picked.len(),
                total,
                age(a.since)
            )
        };
        writeln!(
            out,
            "{said}; `oam explain REQUEST_ID` tells one step by step"
        )?;
    }
    Ok(Findings::from_failures(
        differ
            .iter()
            .map(|id| format!("{id}: the replay differs from the recorded decision (`oam explain {id}` shows how)"))
            .collect(),
    ))
}

/// What replaying a record says: it gives the recorded decision, another one, or it cannot be
/// replayed (its messages were kept as hashes only): not a difference, and no failure.
enum Replay {
    Identical,
    Differs(String),
    Hashed,
}

impl Replay {
    fn of(r: &Record, config: &crate::core::pipeline::Config) -> Replay {
        if r.content_hashed {
            return Replay::Hashed;
        }
        match r.verify(config) {
            Ok(()) => Replay::Identical,
            Err(why) => Replay::Differs(why.to_string()),
        }
    }
}

/// A short age: 12s, 5m, 3h, 2d.
pub(crate) fn age(ms: u64) -> String {
    crate::transport::store::decisions::human(ms)
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_age_needs_its_unit() {
        assert_eq!(super::parse_age("90s").unwrap(), 90_000);
        assert_eq!(super::parse_age("2h").unwrap(), 7_200_000);
        assert_eq!(super::parse_age("7d").unwrap(), 7 * 86_400_000);
        let bare = super::parse_age("30").unwrap_err().0;
        assert!(bare.contains("give a unit, e.g. 30m"), "{bare}");
        assert!(super::parse_age("soon").is_err());
    }
}
