//! Test fixtures for the watch, built from the real wire types (a renamed field breaks these at
//! compile time instead of showing `?` on screen).

use crate::core::breaker::Breaker;
use crate::core::budget::Budget;
use crate::core::bulkhead::{Bulkheads, Occupancy};
use crate::core::health::Verdict;
use crate::core::loops::{Fingerprint, Incident};
use crate::core::pipeline::{Attempt, Decision, DecisionOutcome};
use crate::core::quorum::ProviderView;
use crate::core::reason::{Phase, ReasonCode};
use crate::core::wire::{NodeSnapshot, ProviderSnapshot};
use crate::mesh::protocol::{AgentHeartbeat, DeathNotice, DeathReason};

/// A provider as every node sees it: `votes` of 3, with or without quorum.
pub(crate) fn provider(
    id: &str,
    verdict: Verdict,
    votes: usize,
    quorum: bool,
    availability: f64,
    p95_ms: u64,
    breaker: Breaker,
) -> ProviderSnapshot {
    ProviderSnapshot {
        id: id.into(),
        fallback: id == "local",
        tools: id == "tools",
        consensus: ProviderView {
            verdict,
            votes,
            voters: 3,
            cluster_size: 3,
            quorum,
            availability,
            contract_failure_pct: 0.0,
            p95_ms,
        },
        local: None,
        breaker,
        last_failure: None,
    }
}

pub(crate) fn open() -> Breaker {
    Breaker::Open {
        until_ms: 0,
        forced: false,
    }
}

/// A node of a three-node cluster that hears `live`, with some load and one budget.
pub(crate) fn node_state(
    live: &[&str],
    providers: Vec<ProviderSnapshot>,
    shed_bg: u64,
) -> Box<NodeSnapshot> {
    let usage = |active, shed| Occupancy {
        active,
        queued: 0,
        shed,
    };
    let mut state = NodeSnapshot {
        cluster_size: 3,
        quorum: 2,
        live_nodes: live.iter().map(|n| (*n).to_string()).collect(),
        providers,
        bulkheads: Bulkheads {
            critical: usage(1, 0),
            normal: usage(6, 0),
            background: usage(8, shed_bg),
        },
        stream_bulkheads: Bulkheads {
            normal: usage(12, 0),
            ..Bulkheads::default()
        },
        ..NodeSnapshot::default()
    };
    state.budgets.agents.insert(
        "support-bot".into(),
        Budget {
            spent_usd: 1.25,
            ..Budget::new(5.0)
        },
    );
    Box::new(state)
}

/// A decision with one attempt of `latency_ms` (none without a provider).
#[expect(
    clippy::too_many_arguments,
    reason = "a fixture reads best with every field at the call"
)]
pub(crate) fn decision(
    outcome: DecisionOutcome,
    phase: Phase,
    provider: &str,
    fallback: bool,
    codes: &[ReasonCode],
    agent: &str,
    latency_ms: u64,
    at_ms: u64,
) -> Box<Decision> {
    let provider = (!provider.is_empty()).then(|| provider.into());
    Box::new(Decision {
        request_id: format!("r-{agent}-{at_ms}"),
        agent: agent.into(),
        task: String::new(),
        fingerprint: Fingerprint(0),
        route: None,
        outcome,
        phase,
        reason_codes: codes.to_vec(),
        fallback,
        confidence: None,
        cost_usd: 0.0,
        attempts: vec![Attempt {
            n: 1,
            provider: provider.clone(),
            fallback,
            probe: false,
            same_target: false,
            candidates: Vec::new(),
            codes: Vec::new(),
            status: None,
            latency_ms,
            cost_usd: 0.0,
            confidence: None,
            defects: Vec::new(),
            delivered: false,
            agent_usage: None,
        }],
        provider,
        escalation: None,
        incident: None,
        effects: Vec::new(),
        decided_at_ms: at_ms,
        shortfall: None,
    })
}

pub(crate) fn beat(agent: &str, instance_id: &str) -> AgentHeartbeat {
    AgentHeartbeat {
        conn: None,
        agent: agent.into(),
        instance_id: instance_id.into(),
        in_flight: 1,
        processed: 40,
        at_ms: 0,
    }
}

pub(crate) fn death(agent: &str, reason: DeathReason, instance_id: &str) -> DeathNotice {
    DeathNotice {
        agent: agent.into(),
        reason,
        detected_at: "t".into(),
        instance_id: instance_id.into(),
        detail: None,
        detected_at_ms: None,
    }
}

pub(crate) fn incident(agent: &str, task: &str) -> Incident {
    Incident {
        id: format!("inc-{agent}"),
        fingerprint: Fingerprint(0),
        agent: agent.into(),
        task: task.into(),
        opened_at_ms: 0,
        failures: 3,
    }
}
