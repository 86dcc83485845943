//! Rehearsal: a window of the decision log decided again under a candidate configuration
//! (`oam rehearse`), each record on the whole per-target state its calls saw (the node's state
//! timeline), with the candidate's pipeline, targets, routes and budget limits, and the
//! answers the record holds. What comes out is what would have changed: requests whose
//! outcome, target, reason codes or cost differ, refusals that appear or vanish, spend by
//! target before and after, and the records that could not be decided again, with why.
//!
//! Assumed, and said in the report: a target the candidate calls in place of the recorded one
//! answers as the recorded one did (its answer is the only one the log has); a request that
//! would need more answers than the record holds is not decided again. Pure: the same records
//! and candidate give the same report, byte for byte.

use super::budget::{Budgets, Owner};
use super::decision::{Decision, DecisionOutcome};
use super::pipeline::{Config, Route};
use super::reason::ReasonCode;
use super::record::{Record, ReplayError};
use super::request::{Target, round_usd};
use super::timeline::StateAt;
use serde::Serialize;
use std::collections::BTreeMap;

/// What a rehearsal decides under: another configuration's pipeline, targets, routes and
/// budget limits.
#[derive(Clone, Debug)]
pub(crate) struct Candidate {
    pub config: Config,
    pub targets: Vec<Target>,
    pub routes: BTreeMap<String, Route>,
    pub budgets: Budgets,
}

/// What one decision came to, as a rehearsal compares it.
#[derive(Serialize, Clone, PartialEq, Debug)]
pub struct Verdict {
    pub outcome: DecisionOutcome,
    /// The target that served it, if one did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    pub reason_codes: Vec<ReasonCode>,
    pub cost_usd: f64,
}

impl Verdict {
    pub fn of(d: &Decision) -> Verdict {
        Verdict {
            outcome: d.outcome,
            target: d.provider.as_deref().map(String::from),
            reason_codes: d.reason_codes.clone(),
            cost_usd: round_usd(d.cost_usd),
        }
    }

    fn served(&self) -> bool {
        self.outcome == DecisionOutcome::Accepted
    }
}

/// A request the candidate decides otherwise.
#[derive(Serialize, Clone, PartialEq, Debug)]
pub struct Change {
    pub request_id: String,
    pub node: String,
    pub agent: String,
    pub at_ms: u64,
    pub before: Verdict,
    pub after: Verdict,
    /// The candidate serves it from a target the record did not call for it: that target's
    /// answer is assumed to be the recorded one.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub answer_assumed: bool,
}

/// What a rehearsal found, over every record it was given.
#[derive(Serialize, Clone, PartialEq, Debug, Default)]
pub(crate) struct Report {
    /// Records read in the window.
    pub records: u64,
    /// Of them, decided again.
    pub replayed: u64,
    /// Decided otherwise, in the order the records were written.
    pub changed: Vec<Change>,
    /// Served as recorded, refused under the candidate.
    pub refusals_appear: u64,
    /// Refused as recorded, served under the candidate.
    pub refusals_vanish: u64,
    /// Spend by target, as recorded and under the candidate (of the records decided again).
    pub spend_before_usd: BTreeMap<String, f64>,
    pub spend_after_usd: BTreeMap<String, f64>,
    /// Of those decided again, how many on their own cut of the state (their route's targets)
    /// because the log no longer held the state timeline they saw (it rolled over).
    pub on_own_cut: u64,
    /// Records not decided again: why -> their request ids.
    pub not_replayed: BTreeMap<String, Vec<String>>,
    /// What the candidate spent so far, by the budget it counts against: all of it, and what
    /// it spent beyond the record. A budget the candidate names is charged as the window goes.
    #[serde(skip)]
    spent: BTreeMap<Owner, (f64, f64)>,
}

impl Report {
    /// Decide `record` again under `candidate`, the state version it names found by `at`, and
    /// count what changed.
    pub fn add<'s>(
        &mut self,
        record: &Record,
        candidate: &Candidate,
        at: impl Fn(u64) -> Option<&'s StateAt>,
    ) {
        self.records += 1;
        // The candidate's budget limits, charged with what it has spent in the window so far:
        // beyond the record where the record had the budget, all of it where it did not.
        let spent = &self.spent;
        let budgets = |b: &mut Budgets| {
            b.limited_as(&candidate.budgets, |owner, had| {
                let (all, beyond) = spent.get(owner).copied().unwrap_or_default();
                if had { beyond } else { all }
            });
        };
        let replayed = record.replay_with(
            &candidate.config,
            &candidate.targets,
            &candidate.routes,
            Some(&budgets),
            at,
        );
        // The state they saw gone from the log (it rolled over): decided on what the record
        // itself saw, and counted as such.
        let replayed = match replayed {
            Err(ReplayError::NotInTimeline(_) | ReplayError::NoTimeline) => {
                let on_cut = record.replay_on_cut(
                    &candidate.config,
                    &candidate.targets,
                    &candidate.routes,
                    Some(&budgets),
                );
                self.on_own_cut += u64::from(on_cut.is_ok());
                on_cut
            }
            other => other,
        };
        let after = match replayed {
            Ok(d) => d,
            Err(e) => {
                self.not_replayed
                    .entry(why_not(&e))
                    .or_default()
                    .push(record.request.id.clone());
                return;
            }
        };
        self.replayed += 1;
        let before = Verdict::of(&record.decision);
        let after = Verdict::of(&after);
        for owner in Owner::all_of(&record.request) {
            let (all, beyond) = self.spent.entry(owner).or_default();
            *all = round_usd(*all + after.cost_usd);
            *beyond = round_usd(*beyond + after.cost_usd - before.cost_usd);
        }
        let add = |spend: &mut BTreeMap<String, f64>, v: &Verdict| {
            if let Some(t) = &v.target {
                let e = spend.entry(t.clone()).or_default();
                *e = round_usd(*e + v.cost_usd);
            }
        };
        add(&mut self.spend_before_usd, &before);
        add(&mut self.spend_after_usd, &after);
        if before == after {
            return;
        }
        match (before.served(), after.served()) {
            (true, false) => self.refusals_appear += 1,
            (false, true) => self.refusals_vanish += 1,
            _ => {}
        }
        let called: Vec<&str> = record
            .decision
            .attempts
            .iter()
            .filter_map(|a| a.provider.as_deref())
            .collect();
        let answer_assumed = after
            .target
            .as_deref()
            .is_some_and(|t| !called.contains(&t));
        self.changed.push(Change {
            request_id: record.request.id.clone(),
            node: record.node.clone(),
            agent: record.request.agent.clone(),
            at_ms: record.began_ms,
            before,
            after,
            answer_assumed,
        });
    }
}

/// Why a record was not decided again, in words a report groups by.
fn why_not(e: &ReplayError) -> String {
    match e {
        ReplayError::Hashed => "its content was kept as a hash".into(),
        ReplayError::NoTimeline => "its node kept no state timeline".into(),
        ReplayError::NotInTimeline(_) => {
            "the state it saw is not in the log read (a gap, or older than the log)".into()
        }
        ReplayError::Dispatched { .. } => {
            "the candidate would call a target whose answer the record does not hold".into()
        }
        ReplayError::Queued => "it would still wait in a queue".into(),
        ReplayError::Invalid { field, .. } => format!("the candidate refuses its request.{field}"),
        ReplayError::Differs { .. } | ReplayError::Unwritable(_) => e.to_string(),
    }
}
