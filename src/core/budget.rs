//! Budgets by scope: a request is charged to every budget that covers it (its task's, its
//! agent's, its team's and the global one; a client key's id is the agent of every request it
//! makes, so a key's budget is its agent's). Cost is reserved before dispatch and settled with
//! the actual cost afterwards, so concurrent requests cannot together overspend. No budget
//! means no limit. A budget says what happens when it cannot cover an attempt
//! (`OnExceeded`): refuse it, refuse and escalate it whatever its risk, or pass it and record
//! `BUDGET_WOULD_REFUSE` (audit). An override replaces the limit until it expires.

use super::reason::ReasonCode;
use super::request::{Request, round_usd};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Float slack for comparing dollar amounts.
const EPSILON_USD: f64 = 1e-9;

/// What a budget covers, narrowest first: the order budgets are checked in, so a refusal names
/// the narrowest budget that refused.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Every request naming the task (`x-oam-task`).
    Task,
    /// Every request of the agent (a keyed client's id).
    Agent,
    /// Every request of the team's clients (`[[client]] team`).
    Team,
    /// Every request.
    Global,
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::Task, Kind::Agent, Kind::Team, Kind::Global];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Task => "task",
            Kind::Agent => "agent",
            Kind::Team => "team",
            Kind::Global => "global",
        }
    }

    /// The reason code a budget of this kind refuses with.
    pub fn refusal(self) -> ReasonCode {
        match self {
            Kind::Global => ReasonCode::GlobalBudgetExhausted,
            _ => ReasonCode::BudgetExhausted,
        }
    }
}

/// One budget's name: its kind and whose it is (empty for the global one). Written
/// `global`, `agent:NAME`, `team:NAME`, `task:NAME`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Owner {
    pub kind: Kind,
    pub name: String,
}

impl Owner {
    pub fn global() -> Owner {
        Owner {
            kind: Kind::Global,
            name: String::new(),
        }
    }

    pub fn agent(name: &str) -> Owner {
        Owner::new(Kind::Agent, name)
    }

    pub fn new(kind: Kind, name: &str) -> Owner {
        Owner {
            kind,
            name: if kind == Kind::Global {
                String::new()
            } else {
                name.to_string()
            },
        }
    }

    /// `global`, `agent:NAME` (or `key:NAME`: a key's budget is its agent's), `team:NAME`,
    /// `task:NAME`; a bare name is an agent's.
    pub fn parse(s: &str) -> Result<Owner, ScopeError> {
        if s == "global" {
            return Ok(Owner::global());
        }
        let (kind, name) = match s.split_once(':') {
            Some(("agent" | "key", n)) => (Kind::Agent, n),
            Some(("team", n)) => (Kind::Team, n),
            Some(("task", n)) => (Kind::Task, n),
            Some((scope, _)) => {
                return Err(ScopeError::Unknown {
                    given: s.to_string(),
                    scope: scope.to_string(),
                });
            }
            None => (Kind::Agent, s),
        };
        if name.is_empty() {
            return Err(ScopeError::NamesNobody(s.to_string()));
        }
        Ok(Owner::new(kind, name))
    }
}

/// A budget scope `Owner::parse` cannot read.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum ScopeError {
    #[error(
        "{given:?}: unknown scope {scope:?}; a budget is global, agent:NAME (key:NAME is the \
         same), team:NAME or task:NAME"
    )]
    Unknown { given: String, scope: String },
    #[error("{0:?}: the scope names nobody")]
    NamesNobody(String),
}

impl Owner {
    /// Every budget that would cover `r` were it set, narrowest first.
    pub fn all_of(r: &Request) -> impl Iterator<Item = Owner> + '_ {
        scopes(r)
            .into_iter()
            .filter_map(|(k, n)| n.map(|n| Owner::new(k, n)))
    }
}

impl Owner {
    /// The owner a record's three names say (it keeps the one of its kind; none: global).
    pub fn of_names(agent: &Option<String>, team: &Option<String>, task: &Option<String>) -> Owner {
        match (agent, team, task) {
            (Some(a), _, _) => Owner::new(Kind::Agent, a),
            (_, Some(t), _) => Owner::new(Kind::Team, t),
            (_, _, Some(t)) => Owner::new(Kind::Task, t),
            _ => Owner::global(),
        }
    }

    /// The owner as a record's three names (agent, team, task): `of_names` backwards.
    pub fn names(&self) -> [Option<String>; 3] {
        let named = |k: Kind| (self.kind == k).then(|| self.name.clone());
        [named(Kind::Agent), named(Kind::Team), named(Kind::Task)]
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            Kind::Global => f.write_str("global"),
            k => write!(f, "{}:{}", k.as_str(), self.name),
        }
    }
}

/// What a budget does with an attempt it cannot cover.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnExceeded {
    /// Refuse it (a high-risk request's refusal is escalated, once per exhaustion episode).
    #[default]
    Refuse,
    /// Refuse it and escalate, whatever the request's risk (once per episode).
    Escalate,
    /// Let it through and record `BUDGET_WOULD_REFUSE`: a limit tried on live traffic.
    Audit,
}

impl OnExceeded {
    pub fn is_refuse(&self) -> bool {
        *self == OnExceeded::Refuse
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OnExceeded::Refuse => "refuse",
            OnExceeded::Escalate => "escalate",
            OnExceeded::Audit => "audit",
        }
    }
}

/// A limit that stands in for a budget's own until it expires.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Override {
    pub limit_usd: f64,
    pub until_ms: u64,
}

impl Override {
    /// The limit at `now_ms` of a budget whose own is `own`: `overridden`'s while it stands.
    pub fn limit_at(overridden: Option<Override>, own: f64, now_ms: u64) -> f64 {
        match overridden {
            Some(o) if now_ms < o.until_ms => o.limit_usd,
            _ => own,
        }
    }
}

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
    #[serde(default, skip_serializing_if = "OnExceeded::is_refuse")]
    pub on_exceeded: OnExceeded,
    #[serde(default, rename = "override", skip_serializing_if = "Option::is_none")]
    pub overridden: Option<Override>,
    /// In audit mode: how many attempts the cluster's ledger granted past the limit since the
    /// last reset (mirrored from it, to show).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub would_refuse: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// Why a budget refused: what the attempt was estimated to cost beside what the budget had
/// left, so "remaining $0.0020" and a refusal read together.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Shortfall {
    /// The agent whose budget refused (none: another scope's, or the global budget).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The team whose budget refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// The task whose budget refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    pub estimate_usd: f64,
    pub remaining_usd: f64,
    pub limit_usd: f64,
}

impl Shortfall {
    /// The budget that refused.
    pub fn owner(&self) -> Owner {
        Owner::of_names(&self.agent, &self.team, &self.task)
    }

    /// "an attempt estimated at $0.0031 is more than the $0.0020 left of agent a's $0.0020
    /// budget".
    pub fn describe(&self) -> String {
        let o = self.owner();
        let whose = match o.kind {
            Kind::Global => "the global".into(),
            k => format!("{} {}'s", k.as_str(), o.name),
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
            on_exceeded: OnExceeded::Refuse,
            overridden: None,
            would_refuse: 0,
        }
    }

    /// The limit at `now_ms`: the override's while it stands, else the budget's own.
    pub fn limit_at(&self, now_ms: u64) -> f64 {
        Override::limit_at(self.overridden, self.limit_usd, now_ms)
    }

    pub fn remaining_usd(&self, now_ms: u64) -> f64 {
        round_usd((self.limit_at(now_ms) - self.spent_usd - self.reserved_usd).max(0.0))
    }

    pub fn covers(&self, cost_usd: f64, now_ms: u64) -> bool {
        cost_usd <= self.remaining_usd(now_ms) + EPSILON_USD
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
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub teams: BTreeMap<String, Budget>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tasks: BTreeMap<String, Budget>,
}

/// The budgets a request may be charged to, narrowest first: (kind, name) where it names one.
fn scopes(r: &Request) -> [(Kind, Option<&str>); 4] {
    [
        (Kind::Task, Some(r.task.as_str()).filter(|t| !t.is_empty())),
        (Kind::Agent, Some(r.agent.as_str())),
        (Kind::Team, r.team.as_deref()),
        (Kind::Global, Some("")),
    ]
}

impl Budgets {
    fn map(&self, kind: Kind) -> Option<&BTreeMap<String, Budget>> {
        match kind {
            Kind::Task => Some(&self.tasks),
            Kind::Agent => Some(&self.agents),
            Kind::Team => Some(&self.teams),
            Kind::Global => None,
        }
    }

    fn map_mut(&mut self, kind: Kind) -> Option<&mut BTreeMap<String, Budget>> {
        match kind {
            Kind::Task => Some(&mut self.tasks),
            Kind::Agent => Some(&mut self.agents),
            Kind::Team => Some(&mut self.teams),
            Kind::Global => None,
        }
    }

    pub fn get(&self, kind: Kind, name: &str) -> Option<&Budget> {
        match self.map(kind) {
            Some(m) => m.get(name),
            None => self.global.as_ref(),
        }
    }

    pub fn get_mut(&mut self, kind: Kind, name: &str) -> Option<&mut Budget> {
        match kind {
            Kind::Global => self.global.as_mut(),
            k => self.map_mut(k)?.get_mut(name),
        }
    }

    /// `owner`'s budget, made with `limit_usd` when there is none.
    pub fn entry(&mut self, owner: &Owner, limit_usd: f64) -> &mut Budget {
        let new = || Budget::new(limit_usd);
        let name = || owner.name.clone();
        match owner.kind {
            Kind::Task => self.tasks.entry(name()).or_insert_with(new),
            Kind::Agent => self.agents.entry(name()).or_insert_with(new),
            Kind::Team => self.teams.entry(name()).or_insert_with(new),
            Kind::Global => self.global.get_or_insert_with(new),
        }
    }

    pub fn remove(&mut self, owner: &Owner) -> Option<Budget> {
        match owner.kind {
            Kind::Global => self.global.take(),
            k => self.map_mut(k)?.remove(&owner.name),
        }
    }

    /// Every budget, narrowest kind first, by name.
    pub fn iter(&self) -> impl Iterator<Item = (Owner, &Budget)> + Send {
        fn named(
            kind: Kind,
            m: &BTreeMap<String, Budget>,
        ) -> impl Iterator<Item = (Owner, &Budget)> + Send {
            m.iter().map(move |(n, b)| (Owner::new(kind, n), b))
        }
        named(Kind::Task, &self.tasks)
            .chain(named(Kind::Agent, &self.agents))
            .chain(named(Kind::Team, &self.teams))
            .chain(self.global.iter().map(|b| (Owner::global(), b)))
    }

    pub fn is_empty(&self) -> bool {
        self.global.is_none()
            && self.agents.is_empty()
            && self.teams.is_empty()
            && self.tasks.is_empty()
    }

    /// The budgets that cover `r`, narrowest first: (kind, name, budget).
    pub fn covering<'a>(
        &'a self,
        r: &'a Request,
    ) -> impl Iterator<Item = (Kind, &'a str, &'a Budget)> {
        scopes(r)
            .into_iter()
            .filter_map(move |(k, n)| n.and_then(|n| self.get(k, n).map(|b| (k, n, b))))
    }

    /// Only the budgets that cover `r` (what its record keeps).
    pub fn only_covering(&self, r: &Request) -> Budgets {
        let mut only = Budgets::default();
        for (k, n, b) in self.covering(r) {
            *only.entry(&Owner::new(k, n), b.limit_usd) = *b;
        }
        only
    }

    /// Every budget that covers `r`, each changed by `f`.
    fn each_covering_mut(&mut self, r: &Request, mut f: impl FnMut(&mut Budget)) {
        for (k, n) in scopes(r) {
            if let Some(b) = n.and_then(|n| self.get_mut(k, n)) {
                f(b);
            }
        }
    }

    /// The limits (and modes, and overrides) of `other` in place of these where it names a
    /// budget, each budget then charged `more(owner, had)` with whether it was here already
    /// (a rehearsal adds what its candidate spent beyond the record to a budget the record
    /// had, and all its candidate spent to one it did not); the rest as they are.
    pub fn limited_as(&mut self, other: &Budgets, more: impl Fn(&Owner, bool) -> f64) {
        for (owner, b) in other.iter() {
            let had = self.get(owner.kind, &owner.name).is_some();
            let mine = self.entry(&owner, b.limit_usd);
            mine.limit_usd = b.limit_usd;
            mine.on_exceeded = b.on_exceeded;
            mine.overridden = b.overridden;
            mine.spent_usd = round_usd((mine.spent_usd + more(&owner, had)).max(0.0));
        }
    }

    /// Can `r` spend `cost_usd` at `now_ms`? Err: the reason code of the narrowest budget that
    /// refuses. A budget in audit mode refuses nothing (the ledger, which knows the cluster's
    /// spend, says when it would have: `BUDGET_WOULD_REFUSE`).
    pub fn check(&self, r: &Request, cost_usd: f64, now_ms: u64) -> Result<(), ReasonCode> {
        if cost_usd <= 0.0 {
            return Ok(());
        }
        match self
            .covering(r)
            .find(|(_, _, b)| b.on_exceeded != OnExceeded::Audit && !b.covers(cost_usd, now_ms))
        {
            Some((k, _, _)) => Err(k.refusal()),
            None => Ok(()),
        }
    }

    /// The budget a shortfall names.
    pub fn of_shortfall_mut(&mut self, sf: &Shortfall) -> Option<&mut Budget> {
        let o = sf.owner();
        self.get_mut(o.kind, &o.name)
    }

    /// The budget a shortfall names, read.
    pub fn of_shortfall(&self, sf: &Shortfall) -> Option<&Budget> {
        let o = sf.owner();
        self.get(o.kind, &o.name)
    }

    /// What the budget refusing `r` with `code` had left for an attempt estimated at
    /// `estimate_usd`: the narrowest that refuses with `code` and cannot cover it, else (the
    /// ledger refused what this view thought covered) the narrowest that refuses with `code`.
    pub fn shortfall(
        &self,
        r: &Request,
        code: ReasonCode,
        estimate_usd: f64,
        now_ms: u64,
    ) -> Option<Shortfall> {
        let refusing = || {
            self.covering(r)
                .filter(|(k, _, b)| k.refusal() == code && b.on_exceeded != OnExceeded::Audit)
        };
        let (k, n, b) = refusing()
            .find(|(_, _, b)| !b.covers(estimate_usd, now_ms))
            .or_else(|| refusing().next())?;
        let [agent, team, task] = Owner::new(k, n).names();
        Some(Shortfall {
            agent,
            team,
            task,
            estimate_usd: round_usd(estimate_usd),
            remaining_usd: b.remaining_usd(now_ms),
            limit_usd: b.limit_at(now_ms),
        })
    }

    /// Does any budget limit `r`?
    pub fn applies(&self, r: &Request) -> bool {
        self.covering(r).next().is_some()
    }

    pub fn reserve(&mut self, r: &Request, cost_usd: f64) {
        self.each_covering_mut(r, |b| b.reserved_usd = round_usd(b.reserved_usd + cost_usd));
    }

    /// Release a reservation and charge what was really spent.
    pub fn settle(&mut self, r: &Request, reserved_usd: f64, actual_usd: f64) {
        self.each_covering_mut(r, |b| b.settle(reserved_usd, actual_usd));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::pipeline::tests::req;

    fn of(agent: &str) -> Request {
        Request {
            agent: agent.into(),
            ..req("r1")
        }
    }

    #[test]
    fn reservations_count_before_settlement() {
        let mut b = Budgets::default();
        b.agents.insert("a".into(), Budget::new(1.0));
        let a = of("a");
        assert_eq!(b.check(&a, 0.6, 0), Ok(()));
        b.reserve(&a, 0.6);
        assert_eq!(
            b.check(&a, 0.6, 0),
            Err(ReasonCode::BudgetExhausted),
            "reserved counts"
        );
        b.settle(&a, 0.6, 0.2);
        assert_eq!(b.check(&a, 0.6, 0), Ok(()), "actual was cheaper");
        let x = b.agents["a"];
        assert!((x.spent_usd - 0.2).abs() < 1e-12 && x.reserved_usd == 0.0);
    }

    #[test]
    fn unknown_agents_and_zero_cost_are_unlimited() {
        let mut b = Budgets::default();
        assert_eq!(b.check(&of("nobody"), 1e9, 0), Ok(()));
        b.agents.insert("a".into(), Budget::new(0.0));
        assert_eq!(b.check(&of("a"), 0.0, 0), Ok(()), "zero cost always fits");
        assert_eq!(
            b.check(&of("a"), 0.001, 0),
            Err(ReasonCode::BudgetExhausted)
        );
    }

    #[test]
    fn global_budget_applies_to_everyone() {
        let mut b = Budgets {
            global: Some(Budget::new(0.5)),
            ..Budgets::default()
        };
        b.reserve(&of("x"), 0.4);
        assert_eq!(
            b.check(&of("y"), 0.2, 0),
            Err(ReasonCode::GlobalBudgetExhausted)
        );
        b.settle(&of("x"), 0.4, 0.4);
        assert_eq!(b.global.unwrap().remaining_usd(0), 0.1);
    }

    #[test]
    fn a_request_is_charged_to_every_budget_that_covers_it() {
        let mut b = Budgets::default();
        b.teams.insert("support".into(), Budget::new(1.0));
        b.tasks.insert("summarise".into(), Budget::new(1.0));
        b.agents.insert("a".into(), Budget::new(1.0));
        b.global = Some(Budget::new(1.0));
        let mut r = of("a");
        r.team = Some("support".into());
        let covering: Vec<String> = b
            .covering(&r)
            .map(|(k, n, _)| Owner::new(k, n).to_string())
            .collect();
        assert_eq!(
            covering,
            ["task:summarise", "agent:a", "team:support", "global"],
            "narrowest first"
        );
        b.reserve(&r, 0.3);
        b.settle(&r, 0.3, 0.25);
        for (o, x) in b.iter() {
            assert_eq!((x.spent_usd, x.reserved_usd), (0.25, 0.0), "{o}");
        }
        // Another of the team's agents shares the team's budget, not agent a's.
        let mut other = of("b");
        other.team = Some("support".into());
        other.task = String::new();
        b.reserve(&other, 0.7);
        assert_eq!(b.check(&other, 0.1, 0), Err(ReasonCode::BudgetExhausted));
        let sf = b
            .shortfall(&other, ReasonCode::BudgetExhausted, 0.1, 0)
            .unwrap();
        assert_eq!(sf.owner(), Owner::new(Kind::Team, "support"));
        assert!(
            sf.describe().contains("team support's $1.0000 budget"),
            "{}",
            sf.describe()
        );
        assert_eq!(
            b.check(&of("c"), 0.1, 0),
            Err(ReasonCode::GlobalBudgetExhausted)
        );
        // What a record keeps: only what covers the request.
        let only = b.only_covering(&other);
        assert_eq!(only.teams.len() + only.agents.len() + only.tasks.len(), 1);
        assert!(only.global.is_some());
    }

    #[test]
    fn an_audit_budget_passes_what_it_would_refuse_and_says_so() {
        let mut b = Budgets::default();
        let mut audit = Budget::new(0.1);
        audit.on_exceeded = OnExceeded::Audit;
        b.agents.insert("a".into(), audit);
        assert_eq!(b.check(&of("a"), 0.05, 0), Ok(()));
        assert_eq!(b.check(&of("a"), 0.5, 0), Ok(()), "passed");
        assert_eq!(
            b.shortfall(&of("a"), ReasonCode::BudgetExhausted, 0.5, 0),
            None,
            "an audit budget never refuses"
        );
        // A refusing budget beside it still refuses.
        b.global = Some(Budget::new(0.2));
        assert_eq!(
            b.check(&of("a"), 0.5, 0),
            Err(ReasonCode::GlobalBudgetExhausted)
        );
    }

    #[test]
    fn an_override_stands_until_it_expires() {
        let mut x = Budget::new(1.0);
        x.overridden = Some(Override {
            limit_usd: 5.0,
            until_ms: 1_000,
        });
        x.spent_usd = 2.0;
        assert!(x.covers(2.5, 999), "the override's limit");
        assert!(!x.covers(2.5, 1_000), "expired: the budget's own");
        assert_eq!(x.remaining_usd(1_000), 0.0);
    }

    #[test]
    fn owners_parse_and_print_alike() {
        for s in ["global", "agent:a", "team:support", "task:t-1"] {
            assert_eq!(Owner::parse(s).unwrap().to_string(), s);
        }
        assert_eq!(Owner::parse("bob").unwrap(), Owner::agent("bob"));
        assert_eq!(Owner::parse("key:bob").unwrap(), Owner::agent("bob"));
        let e = Owner::parse("org:x").unwrap_err().to_string();
        assert!(e.contains("team:NAME"), "{e}");
        assert!(Owner::parse("team:").is_err());
    }

    #[test]
    fn old_records_read_and_write_as_they_were() {
        let old = r#"{"global":{"limit_usd":1.0,"spent_usd":0.5,"reserved_usd":0.0},"agents":{}}"#;
        let b: Budgets = serde_json::from_str(old).unwrap();
        assert_eq!(serde_json::to_string(&b).unwrap(), old);
        let old_sf = r#"{"agent":"a","estimate_usd":0.1,"remaining_usd":0.0,"limit_usd":1.0}"#;
        let sf: Shortfall = serde_json::from_str(old_sf).unwrap();
        assert_eq!(sf.owner(), Owner::agent("a"));
        assert_eq!(serde_json::to_string(&sf).unwrap(), old_sf);
    }
}
