//! What the engine decides, and tells its driver: the steps of a request (`Step`, `Dispatch`),
//! the attempts and routing evaluations it records, the effects the runtime carries out, and
//! the final `Decision` with its outcome. Plain data, serialised in decision records.

use super::breaker::Transition;
use super::contract::Defect;
use super::escalation::Escalation;
use super::health::{Outcome, Verdict};
use super::loops::{Fingerprint, Incident};
use super::reason::{Phase, ReasonCode};
use super::request::{GenerationStatus, TargetId};
use super::score::ScoreParts;
use serde::{Deserialize, Serialize};

/// How one candidate fared in routing.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct Evaluation {
    pub provider: TargetId,
    pub fallback: bool,
    pub verdict: Verdict,
    pub votes: usize,
    pub voters: usize,
    pub cluster_size: usize,
    pub quorum: bool,
    pub availability: f64,
    pub contract_failure_pct: f64,
    pub p95_ms: u64,
    pub est_cost_usd: f64,
    /// Why it could not be chosen, if it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub excluded: Option<ReasonCode>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub score: Option<ScoreParts>,
    /// What choosing it would add to the decision (health, quorum, cost notes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<ReasonCode>,
}

/// One try at one provider (or a routing round that found none).
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct Attempt {
    pub n: u32,
    pub provider: Option<TargetId>,
    pub fallback: bool,
    pub probe: bool,
    /// A retry on the target of the attempt before (not counted in `max_attempts`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub same_target: bool,
    pub candidates: Vec<Evaluation>,
    pub codes: Vec<ReasonCode>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<GenerationStatus>,
    pub latency_ms: u64,
    pub cost_usd: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confidence: Option<f64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub defects: Vec<Defect>,
    /// Part of the answer the caller has came from it (a live stream, and its continuation).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub delivered: bool,
    /// The model use its target, a mesh agent, reported (in `cost_usd`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_usage: Option<Box<super::request::AgentUsage>>,
}

/// Things the driver should do or publish because of this decision.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Effect {
    /// Feed the local health window.
    HealthSample {
        provider: TargetId,
        outcome: Outcome,
        latency_ms: u64,
    },
    Breaker {
        provider: TargetId,
        transition: Transition,
    },
    Cooldown {
        provider: TargetId,
        until_ms: u64,
    },
    /// The call failed and counts toward a loop: other nodes should count it too.
    LoopFailure {
        fingerprint: Fingerprint,
        agent: String,
        task: String,
        /// It was the episode's probe.
        probe: bool,
    },
    /// The call worked after failures: its count (and any episode) ends on every node.
    LoopCleared {
        fingerprint: Fingerprint,
    },
}

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "snake_case")]
pub enum DecisionOutcome {
    Accepted,
    Rejected,
    Escalated,
}

impl DecisionOutcome {
    /// Its wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionOutcome::Accepted => "accepted",
            DecisionOutcome::Rejected => "rejected",
            DecisionOutcome::Escalated => "escalated",
        }
    }
}

/// The pipeline's answer for one request: what happened, where, and why.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct Decision {
    pub request_id: String,
    pub agent: String,
    pub task: String,
    pub fingerprint: Fingerprint,
    /// The model route the request asked for, if it named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    pub outcome: DecisionOutcome,
    /// Where it ended: `accepted`, or the phase that vetoed.
    pub phase: Phase,
    /// Every code collected, first occurrence first.
    pub reason_codes: Vec<ReasonCode>,
    pub provider: Option<TargetId>,
    pub fallback: bool,
    pub confidence: Option<f64>,
    pub cost_usd: f64,
    pub attempts: Vec<Attempt>,
    pub escalation: Option<Escalation>,
    pub incident: Option<Incident>,
    pub effects: Vec<Effect>,
    pub decided_at_ms: u64,
    /// A budget refused it: the estimate beside what that budget had left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shortfall: Option<super::budget::Shortfall>,
}

impl Decision {
    /// The targets whose text the answer the caller has holds, in order: a live stream cut and
    /// continued names both. Empty when no attempt said it delivered (an answer sent whole).
    pub fn served_by(&self) -> Vec<&str> {
        let mut by: Vec<&str> = Vec::new();
        for a in self.attempts.iter().filter(|a| a.delivered) {
            if let Some(p) = a.provider.as_deref()
                && by.last() != Some(&p)
            {
                by.push(p);
            }
        }
        by
    }
}

/// What the driver should do next.
#[derive(Clone, PartialEq, Debug)]
pub enum Step {
    /// Call this provider, then `complete` with what happened.
    Dispatch(Dispatch),
    /// The class queue holds the request; call `dequeue` once a slot is free.
    Queued,
    Done(Box<Decision>),
}

#[derive(Clone, PartialEq, Debug)]
pub struct Dispatch {
    pub attempt: u32,
    pub provider: TargetId,
    pub model: TargetId,
    pub max_tokens: u32,
    pub timeout_ms: u64,
    /// Wait this long before calling (a same-target retry's backoff or Retry-After).
    pub delay_ms: u64,
    /// Continue the interrupted answer (send what was delivered as an assistant prefill).
    pub continuation: bool,
    /// What a budget must hold for the attempt (its estimated cost) before it is made; zero
    /// when no budget applies to the request or the target costs nothing. A driver sharing
    /// budgets with other nodes reserves it in the ledger first and, if the ledger refuses,
    /// reports so with `Engine::refuse_reservation` instead of calling.
    pub hold_usd: f64,
}
