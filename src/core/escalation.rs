//! Escalation: when a failed (or refused) request needs a human, and how urgently.
//!
//! Rules, first match wins, applied to the final outcome of a request:
//! 1. a new agent-loop episode            -> ESCALATED_AGENT_LOOP, block automatic action
//! 2. high risk + budget refused it       -> ESCALATED_BUDGET_EXHAUSTED, block (once per
//!    exhaustion episode of that budget; whatever the risk when that budget escalates)
//! 3. non-idempotent timeout (no retry)   -> ESCALATED_UNSAFE_RETRY, review (block if high risk)
//! 4. high risk, any other failure        -> ESCALATED_HIGH_RISK_FAILURE, block
//! 5. critical-priority task failed       -> ESCALATED_CRITICAL_TASK_FAILURE, review
//! 6. medium risk ended on low confidence -> ESCALATED_LOW_CONFIDENCE, review
//!
//! Capacity sheds (admission) and calls refused inside an already-escalated loop episode are not
//! escalated again: the first is the caller's retry, the second already has its escalation.

use super::loops::Incident;
use super::reason::{Action, Phase, ReasonCode};
use super::request::{Priority, Request, Risk};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct Escalation {
    pub id: String,
    pub request_id: String,
    pub agent: String,
    pub task: String,
    pub phase: Phase,
    /// Everything the request collected, the escalation reason last.
    pub reason_codes: Vec<ReasonCode>,
    pub recommended_action: Action,
    pub created_at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub incident_id: Option<String>,
    /// The target at fault, for an escalation of a target's configuration (its credentials
    /// refused) rather than of one request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// What the upstream said (`HTTP 401 Unauthorized Incorrect API key ...`), where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// What the rules need to know about the finished request.
pub struct Concluded<'a> {
    pub request: &'a Request,
    pub phase: Phase,
    pub codes: &'a [ReasonCode],
    pub new_loop_incident: Option<&'a str>,
    /// The node raising it, and how many it raised before: with the time, the escalation's id
    /// (oam's own, never the caller's request id, which a caller may reuse).
    pub node: &'a str,
    pub serial: u64,
    /// The budget that refused it was escalated already in this exhaustion episode.
    pub budget_escalated: bool,
    /// The budget that refused it escalates every refusal's episode, whatever the risk
    /// (`on_exceeded = "escalate"`).
    pub budget_escalates: bool,
}

/// The escalation reason and action for a failed request, if it needs one.
pub(crate) fn rule(o: &Concluded<'_>) -> Option<(ReasonCode, Action)> {
    use Action::*;
    let risk = o.request.risk;
    let has = |c: ReasonCode| o.codes.contains(&c);
    if o.new_loop_incident.is_some() {
        return Some((
            ReasonCode::EscalatedAgentLoop,
            HumanReviewBlockAutomaticAction,
        ));
    }
    if matches!(o.phase, Phase::Admission | Phase::Loop) {
        return None;
    }
    if (risk == Risk::High || o.budget_escalates) && o.phase == Phase::Budget {
        if o.budget_escalated {
            return None;
        }
        return Some((
            ReasonCode::EscalatedBudgetExhausted,
            HumanReviewBlockAutomaticAction,
        ));
    }
    if has(ReasonCode::RetryNotSafe) {
        let action = if risk == Risk::High {
            HumanReviewBlockAutomaticAction
        } else {
            HumanReview
        };
        return Some((ReasonCode::EscalatedUnsafeRetry, action));
    }
    if risk == Risk::High {
        return Some((
            ReasonCode::EscalatedHighRiskFailure,
            HumanReviewBlockAutomaticAction,
        ));
    }
    if o.request.priority == Priority::Critical {
        return Some((ReasonCode::EscalatedCriticalTaskFailure, HumanReview));
    }
    if risk == Risk::Medium && o.phase == Phase::Quality {
        return Some((ReasonCode::EscalatedLowConfidence, HumanReview));
    }
    None
}

/// `n` in base 36 (lowercase): a millisecond timestamp in 8 characters.
fn base36(mut n: u64) -> String {
    let mut digits = Vec::new();
    loop {
        digits.push(b"0123456789abcdefghijklmnopqrstuvwxyz"[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    digits.iter().rev().map(|&d| char::from(d)).collect()
}

/// The escalation of a loop episode a node opened by counting another node's failure (no
/// node's own failure reached the threshold): `request_id` is the call whose failure there
/// completed the count.
pub(crate) fn of_loop(incident: &Incident, request_id: &str, now_ms: u64) -> Escalation {
    Escalation {
        id: format!("esc-{}", incident.id),
        request_id: request_id.to_string(),
        agent: incident.agent.clone(),
        task: incident.task.clone(),
        phase: Phase::Loop,
        reason_codes: vec![
            ReasonCode::AgentLoopDetected,
            ReasonCode::HumanAttentionRequired,
            ReasonCode::EscalatedAgentLoop,
        ],
        recommended_action: Action::HumanReviewBlockAutomaticAction,
        created_at_ms: now_ms,
        incident_id: Some(incident.id.clone()),
        target: None,
        detail: None,
    }
}

/// Build the escalation object for a request the rules picked.
pub fn build(o: &Concluded<'_>, reason: ReasonCode, action: Action, now_ms: u64) -> Escalation {
    let mut reason_codes = o.codes.to_vec();
    for c in [ReasonCode::HumanAttentionRequired, reason] {
        if !reason_codes.contains(&c) {
            reason_codes.push(c);
        }
    }
    Escalation {
        id: match o.new_loop_incident {
            Some(inc) => format!("esc-{inc}"),
            None => format!("esc-{}-{}-{}", o.node, base36(now_ms), o.serial),
        },
        request_id: o.request.id.clone(),
        agent: o.request.agent.clone(),
        task: o.request.task.clone(),
        phase: o.phase,
        reason_codes,
        recommended_action: action,
        created_at_ms: now_ms,
        incident_id: o.new_loop_incident.map(str::to_string),
        target: None,
        detail: None,
    }
}

/// The id of the exhaustion escalation of `owner`'s budget in its
/// episode since `since_ms`: every node names it so, so one episode met by many nodes is one
/// escalation for callers, records, `explain` and the escalation store alike.
pub(crate) fn budget_episode(owner: &super::budget::Owner, since_ms: u64) -> String {
    use super::budget::Kind;
    match owner.kind {
        Kind::Global => format!("esc-budget-global-{}", base36(since_ms)),
        k => format!(
            "esc-budget-{}-{}-{}",
            k.as_str(),
            owner.name,
            base36(since_ms)
        ),
    }
}

/// How long one escalation of a target's configuration stands for every node (the same as
/// `pipeline::MISCONFIGURED_ESCALATION_MS`, each node's own window).
const CONFIG_EPISODE_MS: u64 = 600_000;

/// The id of the escalation of `target`'s configuration (its credentials refused) at `now_ms`:
/// the same on every node within one 10-minute window, so the nodes that meet the fault in it
/// raise one escalation between them (the store keeps the first; the others leave it).
pub(crate) fn config_episode(target: &str, now_ms: u64) -> String {
    format!("esc-config-{target}-{}", base36(now_ms / CONFIG_EPISODE_MS))
}

/// The escalation of `target` refusing oam's credentials to a health probe at `now_ms`: no
/// request was refused, the target's configuration must change (its key or its permissions).
pub(crate) fn of_refused_credentials(
    target: &str,
    detail: Option<String>,
    now_ms: u64,
) -> Escalation {
    Escalation {
        id: config_episode(target, now_ms),
        request_id: String::new(),
        agent: String::new(),
        task: String::new(),
        phase: Phase::Generation,
        reason_codes: vec![
            ReasonCode::UpstreamAuthFailed,
            ReasonCode::HumanAttentionRequired,
            ReasonCode::EscalatedUpstreamMisconfigured,
        ],
        recommended_action: Action::HumanReview,
        created_at_ms: now_ms,
        incident_id: None,
        target: Some(target.to_string()),
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::request::{Message, Policy};

    fn req(risk: Risk, priority: Priority) -> Request {
        Request {
            id: "r1".into(),
            agent: "a".into(),
            task: "t".into(),
            team: None,
            model: None,
            messages: vec![Message {
                role: "user".into(),
                content: "hi".into(),
            }],
            risk,
            priority,
            idempotent: true,
            latency_budget_ms: None,
            max_cost_usd: None,
            max_tokens: None,
            n: 1,
            policy: Policy::default(),
            contract: None,
            response_format: None,
            tools: Default::default(),
            bound_to: None,
            tool_allowlist: None,
            embeddings: false,
            stream: false,
        }
    }

    fn decide(
        r: &Request,
        phase: Phase,
        codes: &[ReasonCode],
        inc: Option<&str>,
    ) -> Option<ReasonCode> {
        rule(&Concluded {
            request: r,
            phase,
            codes,
            new_loop_incident: inc,
            node: "n1",
            serial: 0,
            budget_escalated: false,
            budget_escalates: false,
        })
        .map(|x| x.0)
    }

    #[test]
    fn rules_by_risk_priority_phase_and_idempotency() {
        use ReasonCode::*;
        let low = req(Risk::Low, Priority::Normal);
        let med = req(Risk::Medium, Priority::Normal);
        let high = req(Risk::High, Priority::Normal);
        let crit = req(Risk::Low, Priority::Critical);
        assert_eq!(
            decide(&low, Phase::Generation, &[], None),
            None,
            "low risk goes back to the caller"
        );
        assert_eq!(
            decide(&low, Phase::Generation, &[], Some("inc")),
            Some(EscalatedAgentLoop)
        );
        assert_eq!(
            decide(&high, Phase::Admission, &[], None),
            None,
            "sheds are not escalated"
        );
        assert_eq!(
            decide(&high, Phase::Loop, &[], None),
            None,
            "episode already escalated"
        );
        assert_eq!(
            decide(&high, Phase::Budget, &[], None),
            Some(EscalatedBudgetExhausted)
        );
        assert_eq!(decide(&low, Phase::Budget, &[], None), None);
        assert_eq!(
            decide(&low, Phase::Generation, &[RetryNotSafe], None),
            Some(EscalatedUnsafeRetry)
        );
        assert_eq!(
            decide(&high, Phase::Semantic, &[], None),
            Some(EscalatedHighRiskFailure)
        );
        assert_eq!(
            decide(&crit, Phase::Generation, &[], None),
            Some(EscalatedCriticalTaskFailure)
        );
        assert_eq!(
            decide(&med, Phase::Quality, &[], None),
            Some(EscalatedLowConfidence)
        );
        assert_eq!(decide(&med, Phase::Semantic, &[], None), None);
    }

    #[test]
    fn high_risk_blocks_automatic_action() {
        let high = req(Risk::High, Priority::Normal);
        let o = Concluded {
            request: &high,
            phase: Phase::Generation,
            codes: &[ReasonCode::RetryNotSafe],
            new_loop_incident: None,
            node: "n1",
            serial: 4,
            budget_escalated: false,
            budget_escalates: false,
        };
        let (reason, action) = rule(&o).unwrap();
        assert_eq!(action, Action::HumanReviewBlockAutomaticAction);
        let e = build(&o, reason, action, 7_000);
        assert_eq!(
            e.id, "esc-n1-5eg-4",
            "oam's own id: node, time (base 36), serial"
        );
        assert_eq!(e.request_id, "r1", "the request id is a field");
        assert_eq!(
            e.reason_codes,
            vec![
                ReasonCode::RetryNotSafe,
                ReasonCode::HumanAttentionRequired,
                ReasonCode::EscalatedUnsafeRetry
            ]
        );
    }
}
