//! Budgets, per agent and global: cost is reserved before dispatch and settled with the actual
//! cost afterwards, so concurrent requests cannot together overspend. No budget means no limit.

use super::reason::ReasonCode;
use super::request::round_usd;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Float slack for comparing dollar amounts.
const EPSILON_USD: f64 = 1e-9;

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    pub limit_usd: f64,
    #[serde(default)]
    pub spent_usd: f64,
    #[serde(default)]
    pub reserved_usd: f64,
    /// When this budget, unable to cover an attempt, was escalated: the exhaustion episode a
    /// human has heard of. Further refusals are not escalated again until someone sets or
    /// resets the budget (which ends the episode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused_at_ms: Option<u64>,
    /// When the cluster's record of this budget began its current episode (made, or set or
    /// reset by an operator): with the budget's name, the one id every node gives the
    /// escalation of its exhaustion (`escalation::budget_episode`). None: a budget no ledger
    /// record stands behind (this node's alone, or one recorded before episodes were named).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_ms: Option<u64>,
}

/// Why a budget refused: what the attempt was estimated to cost beside what the budget had
/// left, so "remaining $0.0020" and a refusal read together.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Shortfall {
    /// The agent whose budget refused; none: the global budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    pub estimate_usd: f64,
    pub remaining_usd: f64,
    pub limit_usd: f64,
}

impl Shortfall {
    /// "an attempt estimated at $0.0031 is more than the $0.0020 left of agent a's $0.0020
    /// budget".
    pub fn describe(&self) -> String {
        let whose = match &self.agent {
            Some(a) => format!("agent {a}'s"),
            None => "the global".into(),
        };
        format!(
            "an attempt estimated at ${:.4} is more than the ${:.4} left of {whose} ${:.4} budget",
            self.estimate_usd, self.remaining_usd, self.limit_usd
        )
    }
}

impl Budget {
    pub fn new(limit_usd: f64) -> Self {
        Budget {
            limit_usd,
            spent_usd: 0.0,
            reserved_usd: 0.0,
            refused_at_ms: None,
            since_ms: None,
        }
    }

    pub fn remaining_usd(&self) -> f64 {
        round_usd((self.limit_usd - self.spent_usd - self.reserved_usd).max(0.0))
    }

    pub fn covers(&self, cost_usd: f64) -> bool {
        cost_usd <= self.remaining_usd() + EPSILON_USD
    }

    fn settle(&mut self, reserved_usd: f64, actual_usd: f64) {
        self.reserved_usd = round_usd((self.reserved_usd - reserved_usd).max(0.0));
        self.spent_usd = round_usd(self.spent_usd + actual_usd);
    }
}

#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Budgets {
    pub global: Option<Budget>,
    pub agents: BTreeMap<String, Budget>,
}

impl Budgets {
    /// The limits of `other` in place of these where it names a budget, each budget then
    /// charged `more(agent)` (None: the global one) with whether it was here already (a
    /// rehearsal adds what its candidate spent beyond the record to a budget the record had,
    /// and all its candidate spent to one it did not); the rest as they are.
    pub fn limited_as(&mut self, other: &Budgets, more: impl Fn(Option<&str>, bool) -> f64) {
        let charge =
            |b: &mut Budget, usd: f64| b.spent_usd = round_usd((b.spent_usd + usd).max(0.0));
        for (agent, b) in &other.agents {
            let had = self.agents.contains_key(agent);
            let mine = self
                .agents
                .entry(agent.clone())
                .or_insert_with(|| Budget::new(b.limit_usd));
            mine.limit_usd = b.limit_usd;
            charge(mine, more(Some(agent), had));
        }
        if let Some(g) = &other.global {
            let had = self.global.is_some();
            let mine = self.global.get_or_insert_with(|| Budget::new(g.limit_usd));
            mine.limit_usd = g.limit_usd;
            charge(mine, more(None, had));
        }
    }

    /// Can `agent` spend `cost_usd` now? Names the budget that refuses.
    pub fn check(&self, agent: &str, cost_usd: f64) -> Result<(), ReasonCode> {
        if cost_usd <= 0.0 {
            return Ok(());
        }
        if self.agents.get(agent).is_some_and(|b| !b.covers(cost_usd)) {
            return Err(ReasonCode::BudgetExhausted);
        }
        if self.global.is_some_and(|b| !b.covers(cost_usd)) {
            return Err(ReasonCode::GlobalBudgetExhausted);
        }
        Ok(())
    }

    /// The budget a shortfall names: its agent's, or the global one.
    pub fn of_shortfall_mut(&mut self, sf: &Shortfall) -> Option<&mut Budget> {
        match &sf.agent {
            Some(a) => self.agents.get_mut(a),
            None => self.global.as_mut(),
        }
    }

    /// What `code`'s budget had left for an attempt estimated at `estimate_usd`.
    pub fn shortfall(&self, agent: &str, code: ReasonCode, estimate_usd: f64) -> Option<Shortfall> {
        let b = match code {
            ReasonCode::BudgetExhausted => self.agents.get(agent),
            ReasonCode::GlobalBudgetExhausted => self.global.as_ref(),
            _ => None,
        }?;
        Some(Shortfall {
            agent: (code == ReasonCode::BudgetExhausted).then(|| agent.to_string()),
            estimate_usd: round_usd(estimate_usd),
            remaining_usd: b.remaining_usd(),
            limit_usd: b.limit_usd,
        })
    }

    /// Does any budget (the agent's, or the global one) limit `agent`?
    pub fn applies(&self, agent: &str) -> bool {
        self.global.is_some() || self.agents.contains_key(agent)
    }

    pub fn reserve(&mut self, agent: &str, cost_usd: f64) {
        if let Some(b) = self.agents.get_mut(agent) {
            b.reserved_usd = round_usd(b.reserved_usd + cost_usd);
        }
        if let Some(b) = self.global.as_mut() {
            b.reserved_usd = round_usd(b.reserved_usd + cost_usd);
        }
    }

    /// Release a reservation and charge what was really spent.
    pub fn settle(&mut self, agent: &str, reserved_usd: f64, actual_usd: f64) {
        if let Some(b) = self.agents.get_mut(agent) {
            b.settle(reserved_usd, actual_usd);
        }
        if let Some(b) = self.global.as_mut() {
            b.settle(reserved_usd, actual_usd);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_count_before_settlement() {
        let mut b = Budgets::default();
        b.agents.insert("a".into(), Budget::new(1.0));
        assert_eq!(b.check("a", 0.6), Ok(()));
        b.reserve("a", 0.6);
        assert_eq!(
            b.check("a", 0.6),
            Err(ReasonCode::BudgetExhausted),
            "reserved counts"
        );
        b.settle("a", 0.6, 0.2);
        assert_eq!(b.check("a", 0.6), Ok(()), "actual was cheaper");
        let a = b.agents["a"];
        assert!((a.spent_usd - 0.2).abs() < 1e-12 && a.reserved_usd == 0.0);
    }

    #[test]
    fn unknown_agents_and_zero_cost_are_unlimited() {
        let mut b = Budgets::default();
        assert_eq!(b.check("nobody", 1e9), Ok(()));
        b.agents.insert("a".into(), Budget::new(0.0));
        assert_eq!(b.check("a", 0.0), Ok(()), "zero cost always fits");
        assert_eq!(b.check("a", 0.001), Err(ReasonCode::BudgetExhausted));
    }

    #[test]
    fn global_budget_applies_to_everyone() {
        let mut b = Budgets {
            global: Some(Budget::new(0.5)),
            ..Budgets::default()
        };
        b.reserve("x", 0.4);
        assert_eq!(b.check("y", 0.2), Err(ReasonCode::GlobalBudgetExhausted));
        b.settle("x", 0.4, 0.4);
        assert_eq!(b.global.unwrap().remaining_usd(), 0.1);
    }
}
