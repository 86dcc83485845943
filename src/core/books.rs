//! The cluster's books, checked (`oam spend --verify`): the budget ledger's settlements against
//! the charges the decision log records.
//!
//! Every attempt that cost something is settled in the ledger by its holder (one run of a node)
//! under a number, counted from 1 in that run, and its request's record names that number
//! (`record::Charge`). Each budget record keeps, per holder, the last number it applied and
//! what the holder charged it (`ledger::Settled`), and the holders applied in order. So:
//! - a recorded charge numbered past what its budget applied was answered and **not charged**
//!   (unless it is younger than the settling delay: **pending**);
//! - a number the ledger applied that no record names was **charged without a record**;
//! - one number in two records is **doubled**;
//! - per holder whose run the window holds from its first settlement, the ledger's amount
//!   equals the sum of its applied charges; per budget, what is spent equals what its holders
//!   charged; per record, its charges add up to its cost.

use super::ledger::Ledger;
use super::record::Record;
use super::request::round_usd;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// Dollar amounts this close are equal (each amount is rounded to a nanodollar; sums of many
/// drift below this).
const SLACK_USD: f64 = 1e-6;

/// The charges the decision log holds, gathered record by record (only what the check needs:
/// a day of records fits in a few tens of megabytes).
#[derive(Default, Clone)]
pub(crate) struct Books {
    records: u64,
    charged_records: u64,
    /// Holder -> its settlement number -> the charge.
    by_holder: BTreeMap<String, BTreeMap<u64, Seen>>,
    doubled: BTreeMap<(String, u64), Vec<String>>,
    cost_differs: Vec<CostDiffers>,
    /// Request id -> records that charged it (kept while above one).
    requests: BTreeMap<String, u32>,
    /// What the records' attempts cost, by UTC day and model (`--invoice`).
    by_day_model: BTreeMap<(String, String), f64>,
    forged: Vec<Forged>,
}

/// A charge a record names under another node's run: a node writes only its own records, and
/// charges only as itself, so it is not believed.
#[derive(Serialize, Clone, PartialEq, Debug)]
pub struct Forged {
    pub request_id: String,
    pub node: String,
    pub holder: String,
}

#[derive(Clone)]
struct Seen {
    request_id: String,
    usd: f64,
    budgets: Vec<String>,
    decided_at_ms: u64,
}

/// A recorded charge the ledger has not applied.
#[derive(Serialize, Clone, PartialEq, Debug)]
pub(crate) struct Hole {
    pub request_id: String,
    pub holder: String,
    pub seq: u64,
    pub budget: String,
    pub usd: f64,
    pub decided_at_ms: u64,
}

/// Settlements a holder's ledger entries count that no record in the window names.
#[derive(Serialize, Clone, PartialEq, Debug)]
pub(crate) struct Unrecorded {
    pub holder: String,
    pub seqs: Vec<u64>,
}

/// One settlement number in more than one record.
#[derive(Serialize, Clone, PartialEq, Debug)]
pub(crate) struct Doubled {
    pub holder: String,
    pub seq: u64,
    pub request_ids: Vec<String>,
}

/// A record whose charges do not add up to its cost.
#[derive(Serialize, Clone, PartialEq, Debug)]
pub(crate) struct CostDiffers {
    pub request_id: String,
    pub cost_usd: f64,
    pub charged_usd: f64,
}

/// One budget record's books.
#[derive(Serialize, Clone, PartialEq, Debug)]
pub struct Budget {
    pub key: String,
    pub limit_usd: f64,
    pub spent_usd: f64,
    /// What its holders' settlements add up to (since its last reset).
    pub settled_usd: f64,
    /// What the window's records charged it.
    pub recorded_usd: f64,
    pub holders: usize,
}

/// One holder's settlements in one budget record, beside its records'.
#[derive(Serialize, Clone, PartialEq, Debug)]
pub(crate) struct Holder {
    pub holder: String,
    pub budget: String,
    /// The last settlement number the record applied.
    pub applied: u64,
    pub ledger_usd: f64,
    /// What its records charged up to `applied` (since the record's last reset).
    pub recorded_usd: f64,
    /// Whether the window holds the holder's run from its first settlement (else the amounts
    /// are not compared).
    pub whole: bool,
}

/// What the check found.
#[derive(Serialize, Clone, PartialEq, Debug, Default)]
pub(crate) struct Report {
    pub records: u64,
    pub charged_records: u64,
    pub charges: u64,
    pub charged_usd: f64,
    pub budgets: Vec<Budget>,
    pub holders: Vec<Holder>,
    pub not_charged: Vec<Hole>,
    pub pending: Vec<Hole>,
    pub unrecorded: Vec<Unrecorded>,
    pub doubled: Vec<Doubled>,
    pub cost_differs: Vec<CostDiffers>,
    /// Request ids charged by more than one record: each record is its own answer (a client
    /// that sent one id twice), listed, not counted as a fault.
    pub repeated_ids: Vec<String>,
    /// What could not be checked, and why.
    pub unchecked: Vec<String>,
    /// Charges named under another node's run (not believed, not counted).
    pub forged: Vec<Forged>,
}

impl Books {
    /// Take one record's charges, and what its attempts cost by day and model.
    pub fn add(&mut self, r: &Record) {
        self.records += 1;
        self.price_attempts(r);
        if r.charges.is_empty() {
            return;
        }
        self.charged_records += 1;
        let d: &super::pipeline::Decision = &r.decision;
        let id = &d.request_id;
        let charged: f64 = r.charges.iter().map(|c| c.usd).sum();
        if (charged - d.cost_usd).abs() > SLACK_USD {
            self.cost_differs.push(CostDiffers {
                request_id: id.clone(),
                cost_usd: d.cost_usd,
                charged_usd: round_usd(charged),
            });
        }
        *self.requests.entry(id.clone()).or_default() += 1;
        for c in &r.charges {
            if c.holder.split_once('#').map(|(node, _)| node) != Some(r.node.as_str()) {
                self.forged.push(Forged {
                    request_id: id.clone(),
                    node: r.node.clone(),
                    holder: c.holder.clone(),
                });
                continue;
            }
            let seen = self.by_holder.entry(c.holder.clone()).or_default();
            if let Some(first) = seen.get(&c.seq) {
                self.doubled
                    .entry((c.holder.clone(), c.seq))
                    .or_insert_with(|| vec![first.request_id.clone()])
                    .push(id.clone());
                continue;
            }
            seen.insert(
                c.seq,
                Seen {
                    request_id: id.clone(),
                    usd: c.usd,
                    budgets: c.budgets.clone(),
                    decided_at_ms: d.decided_at_ms,
                },
            );
        }
    }

    /// Each attempt's cost under its model (the target's, as the record's state names it) and
    /// day; what a mesh agent reported spending, under the model it named.
    fn price_attempts(&mut self, r: &Record) {
        let d: &super::pipeline::Decision = &r.decision;
        let day = super::date::utc_date(d.decided_at_ms / 1_000);
        for a in d.attempts.iter().filter(|a| a.cost_usd > 0.0) {
            let Some(target) = a.provider.as_deref() else {
                continue;
            };
            let model = r
                .begin
                .state
                .providers
                .iter()
                .find(|t| &*t.id == target)
                .map_or(target, |t| &*t.model);
            let reported = a.agent_usage.as_ref().map_or(0.0, |u| u.charged_usd());
            let mut put = |model: &str, usd: f64| {
                if usd > 0.0 {
                    *self
                        .by_day_model
                        .entry((day.clone(), billed_model(model)))
                        .or_default() += usd;
                }
            };
            match a.agent_usage.as_ref().and_then(|u| u.model.as_deref()) {
                Some(theirs) if reported > 0.0 => {
                    put(theirs, reported);
                    put(model, a.cost_usd - reported);
                }
                _ => put(model, a.cost_usd),
            }
        }
    }

    /// What the records cost by UTC day and model, against a provider's export (`billed`),
    /// for the days from `first_day` on: one row per day and model either side has.
    pub fn drift(&self, billed: &[Billed], first_day: &str) -> Vec<Drift> {
        let mut rows: BTreeMap<(String, String), (f64, f64)> = BTreeMap::new();
        for ((day, model), usd) in self
            .by_day_model
            .iter()
            .filter(|((day, _), _)| day.as_str() >= first_day)
        {
            rows.entry((day.clone(), model.clone())).or_default().0 += usd;
        }
        for b in billed.iter().filter(|b| b.day.as_str() >= first_day) {
            rows.entry((b.day.clone(), billed_model(&b.model)))
                .or_default()
                .1 += b.usd;
        }
        rows.into_iter()
            .map(|((day, model), (ours, theirs))| Drift {
                day,
                model,
                recorded_usd: round_usd(ours),
                billed_usd: round_usd(theirs),
                drift_usd: round_usd(theirs - ours),
            })
            .collect()
    }

    /// Check the charges gathered against `ledgers` (key -> budget record) as read at `now_ms`;
    /// the window began at `since_ms`; a charge younger than `settling_ms` may not be written
    /// yet.
    pub fn check(
        self,
        ledgers: &BTreeMap<String, Ledger>,
        since_ms: u64,
        now_ms: u64,
        settling_ms: u64,
    ) -> Report {
        let mut r = Report {
            records: self.records,
            charged_records: self.charged_records,
            cost_differs: self.cost_differs,
            forged: self.forged,
            repeated_ids: self
                .requests
                .into_iter()
                .filter(|(_, n)| *n > 1)
                .map(|(id, _)| id)
                .collect(),
            doubled: self
                .doubled
                .into_iter()
                .map(|((holder, seq), request_ids)| Doubled {
                    holder,
                    seq,
                    request_ids,
                })
                .collect(),
            ..Report::default()
        };
        // What the window's records charged each budget, in one pass over them.
        let mut recorded_by_budget: BTreeMap<&str, f64> = BTreeMap::new();
        for s in self.by_holder.values().flat_map(BTreeMap::values) {
            for b in &s.budgets {
                *recorded_by_budget.entry(b.as_str()).or_default() += s.usd;
            }
        }
        for (key, l) in ledgers {
            r.budgets.push(Budget {
                key: key.clone(),
                limit_usd: l.limit_usd,
                spent_usd: l.spent_usd,
                settled_usd: l.settled_usd(),
                recorded_usd: round_usd(
                    recorded_by_budget.get(key.as_str()).copied().unwrap_or(0.0),
                ),
                holders: l.settled.len(),
            });
        }
        // Holders the ledger counts settlements of but the window has no record from.
        let mut quiet: BTreeSet<&String> = BTreeSet::new();
        for l in ledgers.values() {
            for (h, s) in &l.settled {
                if s.at_ms >= since_ms && !self.by_holder.contains_key(h) {
                    quiet.insert(h);
                }
            }
        }
        for h in quiet {
            let last = applied_by(ledgers, h);
            r.unrecorded.push(Unrecorded {
                holder: h.clone(),
                seqs: (1..=last).collect(),
            });
        }
        for (holder, seen) in &self.by_holder {
            r.charges += seen.len() as u64;
            r.charged_usd += seen.values().map(|s| s.usd).sum::<f64>();
            let first = seen.keys().next().copied().unwrap_or(1);
            let whole = first == 1;
            if !whole {
                r.unchecked.push(format!(
                    "{holder}: its settlements before number {first} are not in the window \
                     (its run began before it); the later ones are checked by number only"
                ));
            }
            // Per budget: what it applied of this holder, and the charges past that (its
            // charges grouped by budget in one pass, in number order).
            let mut by_budget: BTreeMap<&String, Vec<(u64, &Seen)>> = BTreeMap::new();
            for (&seq, s) in seen {
                for b in &s.budgets {
                    by_budget.entry(b).or_default().push((seq, s));
                }
            }
            for (budget, charges) in by_budget {
                let Some(l) = ledgers.get(budget) else {
                    r.unchecked.push(format!(
                        "{holder}: charged budget {budget}, which the ledger no longer has \
                         (removed)"
                    ));
                    continue;
                };
                let entry = l.settled.get(holder);
                if entry.is_none() && l.earlier_usd > 0.0 {
                    r.unchecked.push(format!(
                        "{holder}: not among {budget}'s remembered holders (folded into what \
                         came earlier)"
                    ));
                    continue;
                }
                let (applied, ledger_usd, after) =
                    entry.map_or((0, 0.0, 0), |s| (s.seq, s.usd, s.after));
                let mut recorded = 0.0;
                for (seq, s) in charges {
                    if seq <= applied {
                        if seq > after {
                            recorded += s.usd;
                        }
                        continue;
                    }
                    let hole = Hole {
                        request_id: s.request_id.clone(),
                        holder: holder.clone(),
                        seq,
                        budget: budget.clone(),
                        usd: s.usd,
                        decided_at_ms: s.decided_at_ms,
                    };
                    if s.decided_at_ms.saturating_add(settling_ms) > now_ms {
                        r.pending.push(hole);
                    } else {
                        r.not_charged.push(hole);
                    }
                }
                r.holders.push(Holder {
                    holder: holder.clone(),
                    budget: budget.clone(),
                    applied,
                    ledger_usd,
                    recorded_usd: round_usd(recorded),
                    whole,
                });
            }
            // Numbers applied somewhere that no record names.
            let last = applied_by(ledgers, holder);
            let missing: Vec<u64> = (first..=last).filter(|s| !seen.contains_key(s)).collect();
            if !missing.is_empty() {
                r.unrecorded.push(Unrecorded {
                    holder: holder.clone(),
                    seqs: missing,
                });
            }
        }
        r.charged_usd = round_usd(r.charged_usd);
        r.unrecorded.sort_by(|a, b| a.holder.cmp(&b.holder));
        r
    }
}

/// The last settlement number of `holder` any budget record applied.
fn applied_by(ledgers: &BTreeMap<String, Ledger>, holder: &str) -> u64 {
    ledgers
        .values()
        .filter_map(|l| l.settled.get(holder).map(|s| s.seq))
        .max()
        .unwrap_or(0)
}

impl Report {
    /// Each fault in words, request ids named (empty: the books hold).
    pub fn faults(&self) -> Vec<String> {
        let mut out = Vec::new();
        for b in &self.budgets {
            if (b.spent_usd - b.settled_usd).abs() > SLACK_USD {
                out.push(format!(
                    "budget {}: spent says ${:.9}, its settlements add up to ${:.9}",
                    b.key, b.spent_usd, b.settled_usd
                ));
            }
        }
        for h in self.holders.iter().filter(|h| h.whole) {
            if (h.ledger_usd - h.recorded_usd).abs() > SLACK_USD {
                out.push(format!(
                    "budget {}: {} charged ${:.9} by the ledger, ${:.9} by its records",
                    h.budget, h.holder, h.ledger_usd, h.recorded_usd
                ));
            }
        }
        for h in &self.not_charged {
            out.push(format!(
                "request {}: answered, not charged to {} (${:.9}, settlement {} of {})",
                h.request_id, h.budget, h.usd, h.seq, h.holder
            ));
        }
        for u in &self.unrecorded {
            out.push(format!(
                "{}: settlements {} charged with no record",
                u.holder,
                ranges(&u.seqs)
            ));
        }
        for d in &self.doubled {
            out.push(format!(
                "{}: settlement {} in {} records ({})",
                d.holder,
                d.seq,
                d.request_ids.len(),
                d.request_ids.join(", ")
            ));
        }
        for f in &self.forged {
            out.push(format!(
                "request {}: node {}'s record names a charge of {}, another node's run; not \
                 believed",
                f.request_id, f.node, f.holder
            ));
        }
        for c in &self.cost_differs {
            out.push(format!(
                "request {}: cost ${:.9}, charged ${:.9}",
                c.request_id, c.cost_usd, c.charged_usd
            ));
        }
        out
    }
}

/// One line of a provider's usage export: what a model cost on a day.
#[derive(Clone, PartialEq, Debug)]
pub(crate) struct Billed {
    /// UTC, `2026-12-05`.
    pub day: String,
    pub model: String,
    pub usd: f64,
}

/// What oam recorded beside what the provider billed, for one UTC day and model.
#[derive(Serialize, Clone, PartialEq, Debug)]
pub(crate) struct Drift {
    pub day: String,
    pub model: String,
    pub recorded_usd: f64,
    pub billed_usd: f64,
    /// Billed minus recorded.
    pub drift_usd: f64,
}

/// A usage export that cannot be read: its line (from 1) and what is wrong there.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("line {line}: {why}")]
pub(crate) struct ExportError {
    pub line: usize,
    pub why: String,
}

/// The header names an export's columns are known by (case and spaces aside), in the order
/// they are looked for: the day (a date, an RFC 3339 time or Unix seconds, read as UTC), the
/// model (`line_item` as OpenAI's cost export writes it, `gpt-4o-mini-2024-07-18, input`:
/// the part before the comma) and the cost in US dollars. Other columns are ignored.
pub(crate) const DAY_COLUMNS: &[&str] = &["date", "day", "usage_date", "start_time", "timestamp"];
pub(crate) const MODEL_COLUMNS: &[&str] = &["model", "model_name", "line_item"];
pub(crate) const COST_COLUMNS: &[&str] = &["cost_usd", "cost", "amount_value", "amount", "usd"];

/// Read a provider's usage export (CSV with a header row): one `Billed` per data line.
pub(crate) fn read_export(text: &str) -> Result<Vec<Billed>, ExportError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let Some((_, header)) = lines.next() else {
        return Err(ExportError {
            line: 1,
            why: "empty: a header row and one line per day and model are expected".into(),
        });
    };
    let names: Vec<String> = csv_fields(header)
        .ok_or_else(|| ExportError {
            line: 1,
            why: UNCLOSED.into(),
        })?
        .iter()
        .map(|n| n.trim().to_ascii_lowercase().replace(' ', "_"))
        .collect();
    let column = |known: &[&str], what: &str| {
        known
            .iter()
            .find_map(|k| names.iter().position(|n| n == k))
            .ok_or_else(|| ExportError {
                line: 1,
                why: format!(
                    "no {what} column (one of {}; the header has {})",
                    known.join(", "),
                    names.join(", ")
                ),
            })
    };
    let (day_at, model_at, cost_at) = (
        column(DAY_COLUMNS, "day")?,
        column(MODEL_COLUMNS, "model")?,
        column(COST_COLUMNS, "cost")?,
    );
    let mut out = Vec::new();
    for (i, line) in lines {
        let at = |why: String| ExportError { line: i + 1, why };
        let fields = csv_fields(line).ok_or_else(|| at(UNCLOSED.into()))?;
        let field = |n: usize| fields.get(n).map_or("", |f| f.trim());
        let day = export_day(field(day_at))
            .ok_or_else(|| at(format!("{:?} is not a day", field(day_at))))?;
        let model = field(model_at).split(',').next().unwrap_or("").trim();
        if model.is_empty() {
            return Err(at("no model".into()));
        }
        let cost = field(cost_at).trim_start_matches('$');
        let usd: f64 = match cost.parse() {
            Ok(v) if f64::is_finite(v) => v,
            _ => return Err(at(format!("{cost:?} is not an amount in dollars"))),
        };
        out.push(Billed {
            day,
            model: model.to_string(),
            usd,
        });
    }
    Ok(out)
}

/// What a line whose quoted field is not closed is told.
const UNCLOSED: &str = "a quoted field is not closed (line breaks inside fields are not read)";

/// One CSV line's fields (quoted fields may hold commas and doubled quotes; not line breaks);
/// None when a quoted field is not closed.
fn csv_fields(line: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut field = String::new();
    let mut quoted = false;
    let mut chars = line.trim_end_matches('\r').chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            ('"', true) => quoted = false,
            ('"', false) if field.trim().is_empty() => {
                field.clear();
                quoted = true;
            }
            (',', false) => out.push(std::mem::take(&mut field)),
            (c, _) => field.push(c),
        }
    }
    if quoted {
        return None;
    }
    out.push(field);
    Some(out)
}

/// The UTC day of an export's day field: `2026-12-05`, an RFC 3339 time, or Unix seconds.
fn export_day(s: &str) -> Option<String> {
    let date = s.get(..10).unwrap_or("");
    let b = date.as_bytes();
    if b.len() == 10
        && b[4] == b'-'
        && b[7] == b'-'
        && date
            .bytes()
            .enumerate()
            .all(|(i, c)| i == 4 || i == 7 || c.is_ascii_digit())
    {
        return Some(date.to_string());
    }
    let secs: f64 = s.parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| super::date::utc_date(secs as u64))
}

/// A model's name as exports and records are joined on: lower case, without a date suffix.
fn billed_model(model: &str) -> String {
    let lower = model.trim().to_ascii_lowercase();
    super::request::undated_model(&lower).map_or_else(|| lower.clone(), str::to_string)
}

/// `1-3, 7`: numbers in order, runs joined.
pub(crate) fn ranges(seqs: &[u64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < seqs.len() {
        let mut j = i;
        while j + 1 < seqs.len() && seqs[j + 1] == seqs[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            seqs[i].to_string()
        } else {
            format!("{}-{}", seqs[i], seqs[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::record::Charge;

    /// A charged record as a node writes one: request `id` charged by settlements `charges`
    /// (holder, seq, usd), each to `budgets`, decided at `at`.
    fn record(id: &str, at: u64, charges: &[(&str, u64, f64)], budgets: &[&str]) -> Record {
        let mut r = crate::core::record::tests::answered(id);
        let mut d = crate::core::pipeline::Decision::clone(&r.decision);
        d.cost_usd = charges.iter().map(|c| c.2).sum();
        d.decided_at_ms = at;
        r.decision = std::sync::Arc::new(crate::core::record::Decided::new(d));
        if let Some((holder, _, _)) = charges.first() {
            r.node = holder.split('#').next().unwrap_or_default().to_string();
        }
        r.charges = charges
            .iter()
            .map(|&(holder, seq, usd)| Charge {
                holder: holder.into(),
                seq,
                usd,
                budgets: budgets.iter().map(|&b| b.into()).collect(),
            })
            .collect();
        r
    }

    /// A ledger that applied, of each holder, the settlements given (in order).
    fn ledger(settled: &[(&str, u64, f64)]) -> Ledger {
        let mut l = Ledger::new(10.0);
        for &(h, seq, usd) in settled {
            assert!(l.settle_once(h, seq, 0.0, usd, 1_000));
        }
        l
    }

    fn books(records: &[Record]) -> Books {
        let mut b = Books::default();
        for r in records {
            b.add(r);
        }
        b
    }

    const NOW: u64 = 1_000_000;

    #[test]
    fn books_that_match_hold() {
        let rs = [
            record("r1", 10, &[("n1#a", 1, 0.25)], &["global", "agent.x"]),
            record(
                "r2",
                20,
                &[("n1#a", 2, 0.5), ("n1#a", 3, 0.125)],
                &["global"],
            ),
            record("r3", 30, &[("n2#b", 1, 1.0)], &["global"]),
            record("r4", 40, &[], &[]),
        ];
        let ledgers = BTreeMap::from([
            (
                "global".to_string(),
                ledger(&[
                    ("n1#a", 1, 0.25),
                    ("n2#b", 1, 1.0),
                    ("n1#a", 2, 0.5),
                    ("n1#a", 3, 0.125),
                ]),
            ),
            ("agent.x".to_string(), ledger(&[("n1#a", 1, 0.25)])),
        ]);
        let r = books(&rs).check(&ledgers, 0, NOW, 30_000);
        assert_eq!(r.faults(), Vec::<String>::new());
        assert_eq!((r.records, r.charged_records, r.charges), (4, 3, 4));
        assert_eq!(r.charged_usd, 1.875);
        assert_eq!(r.budgets[1].key, "global");
        assert_eq!(r.budgets[1].recorded_usd, 1.875);
        assert!(r.unchecked.is_empty());
    }

    #[test]
    fn a_settlement_the_ledger_lacks_names_its_request() {
        let rs = [
            record("r1", 10, &[("n1#a", 1, 0.25)], &["global"]),
            record("r2", 20, &[("n1#a", 2, 0.5)], &["global"]),
            record("fresh", NOW - 100, &[("n1#a", 3, 0.5)], &["global"]),
        ];
        let ledgers = BTreeMap::from([("global".to_string(), ledger(&[("n1#a", 1, 0.25)]))]);
        let r = books(&rs).check(&ledgers, 0, NOW, 30_000);
        assert_eq!(r.not_charged.len(), 1);
        assert_eq!(r.not_charged[0].request_id, "r2");
        assert_eq!(r.pending[0].request_id, "fresh", "younger than settling");
        assert_eq!(
            r.faults(),
            vec![
                "request r2: answered, not charged to global ($0.500000000, settlement 2 of n1#a)"
            ]
        );
    }

    #[test]
    fn a_settlement_without_a_record_and_a_lowered_total_are_faults() {
        let rs = [
            record("r1", 10, &[("n1#a", 1, 0.25)], &["global"]),
            record("r3", 30, &[("n1#a", 3, 0.5)], &["global"]),
        ];
        let mut l = ledger(&[("n1#a", 1, 0.25), ("n1#a", 2, 0.1), ("n1#a", 3, 0.5)]);
        let ledgers = BTreeMap::from([("global".to_string(), l.clone())]);
        let faults = books(&rs).check(&ledgers, 0, NOW, 30_000).faults();
        assert_eq!(
            faults,
            vec![
                "budget global: n1#a charged $0.850000000 by the ledger, $0.750000000 by its records",
                "n1#a: settlements 2 charged with no record",
            ]
        );
        l.spent_usd = 0.5;
        let ledgers = BTreeMap::from([("global".to_string(), l)]);
        let faults = books(&rs).check(&ledgers, 0, NOW, 30_000).faults();
        assert!(
            faults[0].starts_with("budget global: spent says $0.500000000"),
            "{faults:?}"
        );
    }

    #[test]
    fn a_number_in_two_records_is_doubled_and_a_short_charge_differs() {
        let mut short = record("r2", 20, &[("n1#a", 1, 0.25)], &["global"]);
        let mut d = crate::core::pipeline::Decision::clone(&short.decision);
        d.cost_usd = 0.5;
        short.decision = std::sync::Arc::new(crate::core::record::Decided::new(d));
        let rs = [record("r1", 10, &[("n1#a", 1, 0.25)], &["global"]), short];
        let ledgers = BTreeMap::from([("global".to_string(), ledger(&[("n1#a", 1, 0.25)]))]);
        let r = books(&rs).check(&ledgers, 0, NOW, 30_000);
        assert_eq!(r.doubled[0].request_ids, vec!["r1", "r2"]);
        assert_eq!(r.cost_differs[0].request_id, "r2");
        assert_eq!(r.faults().len(), 2);
    }

    #[test]
    fn a_charge_named_under_another_nodes_run_is_not_believed() {
        let mut r = record("r1", 10, &[("n1#a", 1, 0.25)], &["global"]);
        r.node = "n2".into();
        let ledgers = BTreeMap::from([("global".to_string(), ledger(&[]))]);
        let report = books(&[r]).check(&ledgers, 0, NOW, 30_000);
        assert_eq!(report.charges, 0, "not counted");
        assert_eq!(
            report.faults(),
            vec![
                "request r1: node n2's record names a charge of n1#a, another node's run; not believed"
            ]
        );
    }

    #[test]
    fn a_reset_counts_only_what_came_after_it() {
        let rs = [
            record("r1", 10, &[("n1#a", 1, 0.25)], &["global"]),
            record("r2", 20, &[("n1#a", 2, 0.5)], &["global"]),
        ];
        let mut l = ledger(&[("n1#a", 1, 0.25)]);
        l.reset_spent();
        assert!(l.settle_once("n1#a", 2, 0.0, 0.5, 2_000));
        let ledgers = BTreeMap::from([("global".to_string(), l)]);
        let r = books(&rs).check(&ledgers, 0, NOW, 30_000);
        assert_eq!(r.faults(), Vec::<String>::new());
        assert_eq!(r.holders[0].recorded_usd, 0.5);
    }

    #[test]
    fn an_export_is_read_by_its_header_and_joined_by_day_and_model() {
        let csv = "Start Time,Line Item,Project,Amount Value\n\
                   2026-12-04T00:00:00Z,\"gpt-4o-mini-2024-07-18, input\",p,0.50\n\
                   2026-12-04T00:00:00Z,\"gpt-4o-mini-2024-07-18, output\",p,$0.25\n\
                   1796428800,claude-x,p,1\n";
        let billed = read_export(csv).expect("reads");
        assert_eq!(billed[0].model, "gpt-4o-mini-2024-07-18");
        assert_eq!(billed[2].day, "2026-12-05", "Unix seconds, UTC");
        let mut books = Books::default();
        books
            .by_day_model
            .insert(("2026-12-04".into(), "gpt-4o-mini".into()), 0.70);
        books
            .by_day_model
            .insert(("2026-12-03".into(), "gpt-4o-mini".into()), 9.0);
        let rows = books.drift(&billed, "2026-12-04");
        assert_eq!(
            rows,
            vec![
                Drift {
                    day: "2026-12-04".into(),
                    model: "gpt-4o-mini".into(),
                    recorded_usd: 0.7,
                    billed_usd: 0.75,
                    drift_usd: 0.05,
                },
                Drift {
                    day: "2026-12-05".into(),
                    model: "claude-x".into(),
                    recorded_usd: 0.0,
                    billed_usd: 1.0,
                    drift_usd: 1.0,
                },
            ],
            "the day before the window left out"
        );
        assert_eq!(
            read_export("day,model\n").unwrap_err().why,
            "no cost column (one of cost_usd, cost, amount_value, amount, usd; the header has \
             day, model)"
        );
        assert_eq!(
            read_export("day,model,cost\n2026-12-01,m,1\nyesterday,m,2\n")
                .unwrap_err()
                .to_string(),
            "line 3: \"yesterday\" is not a day"
        );
    }

    #[test]
    fn a_run_begun_before_the_window_is_checked_by_number_only() {
        let rs = [record("r5", 10, &[("n1#a", 5, 0.25)], &["global"])];
        let ledgers = BTreeMap::from([(
            "global".to_string(),
            ledger(&[("n1#a", 4, 1.0), ("n1#a", 5, 0.25), ("n9#z", 1, 0.1)]),
        )]);
        let r = books(&rs).check(&ledgers, 500, NOW, 30_000);
        assert_eq!(r.unchecked.len(), 1, "{:?}", r.unchecked);
        assert_eq!(
            r.faults(),
            vec!["n9#z: settlements 1 charged with no record"],
            "a holder settling in the window with no record at all"
        );
        assert_eq!(ranges(&[1, 2, 3, 5, 7, 8]), "1-3, 5, 7-8");
    }
}
