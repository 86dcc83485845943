//! Pipeline tests: every rule composed, the known traps, and every reason code reached.

use super::*;
use crate::core::breaker::Breaker;
use crate::core::budget::Budget;
use crate::core::contract::ContractSpec;
use crate::core::contract::JsonType;
use crate::core::escalation::Escalation;
use crate::core::quorum::Observation;
use crate::core::reason::Action;
use crate::core::request::{Message, Policy, Priority, Usage};
use std::collections::{BTreeSet, VecDeque};

pub(crate) const T0: u64 = 1_000_000;

pub(crate) fn observation(
    node: &str,
    provider: &str,
    verdict: Verdict,
    availability: f64,
) -> Observation {
    Observation {
        node: node.into(),
        provider: provider.into(),
        at_ms: T0,
        verdict,
        availability,
        contract_failure_pct: 0.0,
        p95_ms: 180,
        samples: 15,
        evidence: crate::core::health::Evidence::Traffic,
        own: Default::default(),
    }
}

/// One node, three healthy providers.
pub(crate) fn engine() -> Engine {
    let mut state = State {
        cluster: Cluster::new("n1", 1).into(),
        ..State::default()
    };
    for p in ["primary", "secondary", "local"] {
        std::sync::Arc::make_mut(&mut state.cluster).observe(observation(
            "n1",
            p,
            Verdict::Healthy,
            1.0,
        ));
    }
    Engine::new(json_contract(), state)
}

/// The defaults, with answers held to the JSON contract (as the simulator's are) and no
/// same-target retries: the tests here script one attempt per target, except those of the
/// same-target retry itself (`retrying`).
fn json_contract() -> Config {
    Config {
        default_contract: Some(ContractSpec::default()),
        same_target_retries: 0,
        ..Config::default()
    }
}

/// `engine()` with the default same-target retries.
fn retrying() -> Engine {
    let mut e = engine();
    e.config.same_target_retries = Config::default().same_target_retries;
    e
}

fn set_verdict(e: &mut Engine, provider: &str, verdict: Verdict, availability: f64) {
    let mut o = observation("n1", provider, verdict, availability);
    o.at_ms = T0 + 1; // newer than the healthy one
    std::sync::Arc::make_mut(&mut e.state.cluster).observe(o);
}

/// A decided request's record, its message `content_bytes` long.
pub(crate) fn recorded(
    e: &mut Engine,
    id: &str,
    content_bytes: usize,
) -> crate::core::record::Record {
    recorded_answer(e, id, content_bytes, r#"{"answer":"42","confidence":0.9}"#)
}

/// `recorded`, the provider having answered `answer`.
pub(crate) fn recorded_answer(
    e: &mut Engine,
    id: &str,
    content_bytes: usize,
    answer: &str,
) -> crate::core::record::Record {
    let mut r = req(id);
    r.messages[0].content = "x".repeat(content_bytes);
    let rec = crate::core::record::Recorder::begin(e, &r, T0);
    let (mut s, _) = e.begin(r, T0).expect("valid");
    let mut rec = rec;
    let call = crate::core::record::Call::Complete {
        generation: Generation::ok(answer, 5),
    };
    rec.call(e, &call, T0 + 5);
    let Some(Step::Done(d)) = e.apply(&mut s, call, T0 + 5) else {
        panic!("decided")
    };
    rec.finish(std::sync::Arc::new(crate::core::record::Decided::new(*d)))
}

pub(crate) fn req(id: &str) -> Request {
    Request {
        id: id.into(),
        agent: "agent-a".into(),
        task: "summarise".into(),
        team: None,
        model: None,
        messages: vec![Message {
            role: "user".into(),
            content: format!("question {id}"),
        }],
        risk: Risk::Low,
        priority: Priority::Normal,
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

fn good() -> Generation {
    Generation::ok(r#"{"answer":"42","confidence":0.9}"#, 180)
}

fn with_confidence(c: f64) -> Generation {
    Generation::ok(format!(r#"{{"answer":"42","confidence":{c}}}"#), 180)
}

fn err() -> Generation {
    Generation::failed(GenerationStatus::Error, 20)
}

/// Drive a request; `script` answers each dispatch to a provider in order. Panics if the
/// pipeline dispatches to a provider the script has no answer for.
fn run_at(e: &mut Engine, r: Request, now: u64, script: &[(&str, Generation)]) -> Decision {
    let mut answers: BTreeMap<&str, VecDeque<Generation>> = BTreeMap::new();
    for (p, g) in script {
        answers.entry(p).or_default().push_back(g.clone());
    }
    let (mut s, mut step) = e.begin(r, now).expect("valid request");
    let mut t = now;
    for _ in 0..20 {
        step = match step {
            Step::Done(d) => return *d,
            Step::Queued => e.dequeue(&mut s, t),
            Step::Dispatch(d) => {
                let g = answers
                    .get_mut(&*d.provider)
                    .and_then(VecDeque::pop_front)
                    .unwrap_or_else(|| panic!("unscripted dispatch to {}", d.provider));
                t += g.latency_ms;
                e.complete(&mut s, g, t)
            }
        };
    }
    panic!("pipeline did not finish in 20 steps");
}

fn run(e: &mut Engine, r: Request, script: &[(&str, Generation)]) -> Decision {
    run_at(e, r, T0, script)
}

fn has(d: &Decision, c: ReasonCode) -> bool {
    d.reason_codes.contains(&c)
}

#[test]
fn a_tool_call_turn_is_not_held_to_a_text_contract_but_a_cut_answer_is() {
    let mut e = engine();
    let tool_turn = Generation {
        finish_reason: Some("tool_calls".into()),
        ..Generation::ok("", 120)
    };
    let d = run(&mut e, req("t1"), &[("primary", tool_turn)]);
    assert_eq!(d.outcome, DecisionOutcome::Accepted, "{:?}", d.reason_codes);
    assert_eq!(d.confidence, None);
    let cut = Generation {
        finish_reason: Some("length".into()),
        ..Generation::ok("", 120)
    };
    let d = run(
        &mut e,
        req("t2"),
        &[
            ("primary", cut.clone()),
            ("secondary", cut.clone()),
            ("local", cut),
        ],
    );
    assert!(
        has(&d, ReasonCode::ContractTruncated),
        "{:?}",
        d.reason_codes
    );
}

#[test]
fn healthy_cluster_routes_to_primary_and_accepts() {
    let mut e = engine();
    let d = run(&mut e, req("r1"), &[("primary", good())]);
    assert_eq!(d.outcome, DecisionOutcome::Accepted);
    assert_eq!(d.phase, Phase::Accepted);
    assert_eq!(d.provider.as_deref(), Some("primary"));
    assert!(!d.fallback);
    assert_eq!(
        d.reason_codes,
        vec![ReasonCode::RoutingSelected, ReasonCode::Accepted]
    );
    let c = &d.attempts[0].candidates;
    assert_eq!(c.len(), 3);
    assert_eq!(c[0].score.unwrap().total, 90.0);
    assert_eq!(
        c[2].score.unwrap().total,
        90.0,
        "zero-cost fallback ties the primary"
    );
    assert_eq!(d.confidence, Some(0.9));
    // No usage from the upstream: charged the estimate, (ceil(len("user" + "question r1") / 4)
    // + 4 for the message + 3 for the reply + 256) tokens at $0.01/1k.
    assert!((d.cost_usd - (4.0 + 4.0 + 3.0 + 256.0) * 0.01 / 1000.0).abs() < 1e-12);
}

#[test]
fn a_published_decision_reads_back_as_it_was() {
    // What nodes publish (empty lists left out) is what the watch and listeners read: a field
    // left out on the wire must read back, or every such decision is dropped by its readers.
    let mut e = engine();
    for d in [
        run(&mut e, req("r1"), &[("primary", good())]),
        run(&mut e, req("r2"), &[("primary", err()), ("local", good())]),
    ] {
        let wire = serde_json::to_string(&d).unwrap();
        assert!(!wire.contains("\"defects\""), "{wire}");
        let back: Decision = serde_json::from_str(&wire).unwrap();
        assert_eq!(back, d);
    }
}

#[test]
fn every_attempt_keeps_its_codes() {
    let mut e = engine();
    let d = run(
        &mut e,
        req("r1"),
        &[
            ("primary", err()),
            ("local", Generation::ok("not json at all", 100)),
            ("secondary", good()),
        ],
    );
    assert_eq!(d.outcome, DecisionOutcome::Accepted);
    assert_eq!(d.provider.as_deref(), Some("secondary"));
    assert!(!d.fallback);
    assert_eq!(d.attempts.len(), 3);
    assert!(d.attempts[0].codes.contains(&ReasonCode::GenerationError));
    assert!(d.attempts[1].codes.contains(&ReasonCode::ContractNotJson));
    assert!(d.attempts[1].codes.contains(&ReasonCode::FallbackUsed));
    for c in [
        ReasonCode::GenerationError,
        ReasonCode::RetryScheduled,
        ReasonCode::SemanticValidationFailed,
        ReasonCode::ContractNotJson,
        ReasonCode::FallbackUsed,
        ReasonCode::Accepted,
    ] {
        assert!(has(&d, c), "missing {c}");
    }
    assert_eq!(
        d.attempts[1].candidates[0].excluded,
        Some(ReasonCode::ProviderAlreadyTried)
    );
    assert_eq!(d.attempts[1].defects[0].code, ReasonCode::ContractNotJson);
    // Health samples for every attempt, in order.
    let samples: Vec<(&str, Outcome)> = d
        .effects
        .iter()
        .filter_map(|x| match x {
            Effect::HealthSample {
                provider, outcome, ..
            } => Some((&**provider, *outcome)),
            _ => None,
        })
        .collect();
    assert_eq!(
        samples,
        vec![
            ("primary", Outcome::Error),
            ("local", Outcome::ContractFailure),
            ("secondary", Outcome::Success)
        ]
    );
}

#[test]
fn medium_risk_quality_failures_on_the_fallback_do_not_open_its_breaker() {
    let mut e = engine();
    // The paid providers are down: only the zero-cost fallback is left.
    set_verdict(&mut e, "primary", Verdict::Unhealthy, 0.0);
    set_verdict(&mut e, "secondary", Verdict::Unhealthy, 0.0);
    // Far more medium-risk quality failures than the breaker threshold (5).
    for i in 0..12 {
        let mut r = req(&format!("m{i}"));
        r.risk = Risk::Medium;
        let d = run(&mut e, r, &[("local", with_confidence(0.6))]);
        assert_eq!(d.phase, Phase::Quality);
        assert_eq!(d.outcome, DecisionOutcome::Escalated);
        assert_eq!(
            d.escalation.as_ref().unwrap().recommended_action,
            Action::HumanReview
        );
    }
    assert!(e.state.breakers["local"].is_closed());
    // Low-risk traffic still gets its answer from the fallback.
    let d = run(&mut e, req("low"), &[("local", with_confidence(0.6))]);
    assert_eq!(d.outcome, DecisionOutcome::Accepted);
    assert_eq!(d.provider.as_deref(), Some("local"));
}

#[test]
fn provider_faults_do_open_the_breaker_and_traffic_moves() {
    let mut e = engine();
    e.config.max_attempts.low = 1;
    for i in 0..5 {
        let d = run(&mut e, req(&format!("r{i}")), &[("primary", err())]);
        assert_eq!(d.outcome, DecisionOutcome::Rejected);
        assert_eq!(d.phase, Phase::Generation);
        assert_eq!(has(&d, ReasonCode::CircuitOpened), i == 4);
    }
    let d = run(&mut e, req("after"), &[("local", good())]);
    assert_eq!(
        d.attempts[0].candidates[0].excluded,
        Some(ReasonCode::CircuitOpen)
    );
    assert_eq!(
        d.provider.as_deref(),
        Some("local"),
        "the zero-cost fallback ties secondary and is listed first"
    );
    // After open_ms the breaker half-opens and one request probes it.
    let later = T0 + e.config.breaker.open_ms + 1_000;
    let d = run_at(&mut e, req("probe"), later, &[("primary", good())]);
    assert!(has(&d, ReasonCode::CircuitHalfOpenProbe));
    assert!(has(&d, ReasonCode::CircuitClosed));
    assert!(e.state.breakers["primary"].is_closed());
}

#[test]
fn requests_a_provider_refuses_as_invalid_never_count_against_it() {
    // The attack: a dozen requests the provider refuses (too large, invalid) used to open its
    // breaker on every node and mark it unhealthy.
    let mut e = engine();
    for i in 0..12 {
        let d = run(
            &mut e,
            req(&format!("big{i}")),
            &[("primary", Generation::failed(GenerationStatus::Rejected, 3))],
        );
        assert_eq!(d.outcome, DecisionOutcome::Rejected);
        assert_eq!(d.phase, Phase::Generation);
        assert!(has(&d, ReasonCode::ProviderRejectedRequest), "{d:?}");
        assert_eq!(
            d.attempts.len(),
            1,
            "not retried elsewhere: it would only spend more"
        );
        assert!(
            !d.effects
                .iter()
                .any(|f| matches!(f, Effect::HealthSample { .. } | Effect::Breaker { .. })),
            "{:?}",
            d.effects
        );
    }
    assert!(
        e.state
            .breakers
            .get("primary")
            .is_none_or(Breaker::is_closed)
    );
    let d = run(&mut e, req("after"), &[("primary", good())]);
    assert_eq!(d.provider.as_deref(), Some("primary"));
}

#[test]
fn escalation_ids_are_oams_own_so_a_reused_request_id_gets_a_new_one() {
    let mut e = engine();
    let mut ids = Vec::new();
    for _ in 0..2 {
        let mut r = req("same");
        r.risk = Risk::High;
        let d = run(&mut e, r, &[("primary", err()), ("secondary", err())]);
        let esc = d.escalation.expect("a high-risk failure escalates");
        assert_eq!(esc.request_id, "same");
        ids.push(esc.id);
    }
    assert_ne!(ids[0], ids[1], "{ids:?}");
    assert!(ids.iter().all(|id| id.starts_with("esc-n1-")), "{ids:?}");
}

#[test]
fn callers_who_do_not_say_who_they_are_are_never_one_looping_agent() {
    // Independent clients repeating the same failing request, none naming an agent: each gets
    // its own answer, never RUNAWAY_RETRY_STOPPED for what the others did.
    let mut e = engine();
    e.config.max_attempts.low = 1;
    // Four: the fifth failure would open the primary's breaker, which is another story.
    for i in 0..4u64 {
        let mut r = req("same");
        r.agent = crate::core::request::ANONYMOUS.into();
        let d = run_at(&mut e, r, T0 + i * 100, &[("primary", err())]);
        assert_eq!(d.phase, Phase::Generation, "{:?}", d.reason_codes);
        assert!(!has(&d, ReasonCode::AgentLoopDetected));
        assert!(!has(&d, ReasonCode::RunawayRetryStopped));
    }
}

#[test]
fn a_loop_trips_once_escalates_once_and_refuses_fast() {
    let mut e = engine();
    e.config.max_attempts.low = 1;
    let mut r = req("loop");
    r.risk = Risk::High;
    r.policy.max_attempts = Some(1);
    let mut escalations = Vec::<Escalation>::new();
    let mut incidents = BTreeSet::new();
    let mut dispatched = 0;
    for i in 0..10u64 {
        let d = run_at(&mut e, r.clone(), T0 + i * 100, &[("primary", err())]);
        dispatched += d.attempts.iter().filter(|a| a.status.is_some()).count();
        escalations.extend(d.escalation.clone());
        if let Some(inc) = &d.incident {
            incidents.insert(inc.id.clone());
        }
        if i < 2 {
            assert_eq!(
                d.escalation.as_ref().unwrap().reason_codes.last(),
                Some(&ReasonCode::EscalatedHighRiskFailure)
            );
        } else if i == 2 {
            assert_eq!(d.phase, Phase::Loop);
            assert!(has(&d, ReasonCode::AgentLoopDetected));
            let esc = d.escalation.as_ref().unwrap();
            assert!(esc.reason_codes.contains(&ReasonCode::EscalatedAgentLoop));
            assert_eq!(
                esc.recommended_action,
                Action::HumanReviewBlockAutomaticAction
            );
        } else {
            assert_eq!(d.phase, Phase::Loop);
            assert_eq!(d.reason_codes, vec![ReasonCode::RunawayRetryStopped]);
            assert!(
                d.escalation.is_none(),
                "one escalation per episode, not per request"
            );
            assert!(d.attempts.is_empty(), "refused before routing");
        }
    }
    assert_eq!(dispatched, 3, "only the first three reached a provider");
    assert_eq!(incidents.len(), 1, "one incident for the episode");
    assert_eq!(
        escalations
            .iter()
            .filter(|x| x.reason_codes.contains(&ReasonCode::EscalatedAgentLoop))
            .count(),
        1
    );
    // After the cool-down one identical call probes; success ends the episode.
    let later = T0 + e.config.loops.cooldown_ms + 1_000;
    let d = run_at(&mut e, r.clone(), later, &[("primary", good())]);
    assert!(has(&d, ReasonCode::LoopProbe));
    assert_eq!(d.outcome, DecisionOutcome::Accepted);
    assert!(e.state.loops.is_empty());
}

#[test]
fn a_failed_loop_probe_retrips_without_a_second_escalation() {
    let mut e = engine();
    let mut r = req("loop");
    r.policy.max_attempts = Some(1);
    for i in 0..3 {
        run_at(&mut e, r.clone(), T0 + i, &[("primary", err())]);
    }
    let later = T0 + e.config.loops.cooldown_ms + 1_000;
    let d = run_at(&mut e, r.clone(), later, &[("primary", err())]);
    assert!(has(&d, ReasonCode::LoopProbe));
    assert!(d.escalation.is_none());
    assert!(!has(&d, ReasonCode::AgentLoopDetected));
    let d = run_at(&mut e, r, later + 1, &[]);
    assert_eq!(d.reason_codes, vec![ReasonCode::RunawayRetryStopped]);
}

#[test]
fn critical_capacity_survives_a_background_spike() {
    let mut e = engine();
    let mut shed = 0;
    let mut sessions = Vec::new();
    // 100 background and 100 normal requests arrive and stay in flight.
    for i in 0..200 {
        let mut r = req(&format!("bg{i}"));
        r.priority = if i % 2 == 0 {
            Priority::Background
        } else {
            Priority::Normal
        };
        let (s, step) = e.begin(r, T0).unwrap();
        match step {
            Step::Dispatch(_) => sessions.push(s),
            Step::Done(d) => {
                assert_eq!(d.phase, Phase::Admission);
                shed += 1;
            }
            Step::Queued => {}
        }
    }
    assert!(shed > 100, "most of the spike is shed ({shed})");
    // Every critical request still gets a slot and is served.
    for i in 0..16 {
        let mut r = req(&format!("crit{i}"));
        r.priority = Priority::Critical;
        let (_, step) = e.begin(r, T0).unwrap();
        assert!(
            matches!(step, Step::Dispatch(_)),
            "critical {i} got {step:?}"
        );
    }
    assert_eq!(e.state.bulkheads.critical.shed, 0);
}

#[test]
fn slots_and_reservations_are_released_after_every_decision() {
    let mut e = engine();
    e.state
        .budgets
        .agents
        .insert("agent-a".into(), Budget::new(1.0));
    run(&mut e, req("a"), &[("primary", good())]);
    run(
        &mut e,
        req("b"),
        &[("primary", err()), ("secondary", err()), ("local", err())],
    );
    let b = &e.state.bulkheads;
    assert_eq!((b.normal.active, b.normal.queued), (0, 0));
    let budget = e.state.budgets.agents["agent-a"];
    assert_eq!(budget.reserved_usd, 0.0);
    assert!(budget.spent_usd > 0.0, "the accepted request was charged");
}

#[test]
fn budget_exhausted_low_risk_falls_back_high_risk_refuses() {
    let mut e = engine();
    e.state
        .budgets
        .agents
        .insert("agent-a".into(), Budget::new(0.0));
    let d = run(&mut e, req("low"), &[("local", good())]);
    assert_eq!(d.outcome, DecisionOutcome::Accepted);
    assert!(d.fallback);
    assert_eq!(
        d.attempts[0].candidates[0].excluded,
        Some(ReasonCode::BudgetExhausted)
    );
    let mut r = req("high");
    r.risk = Risk::High;
    let d = run(&mut e, r, &[]);
    assert_eq!(d.outcome, DecisionOutcome::Escalated);
    assert_eq!(d.phase, Phase::Budget);
    assert!(has(&d, ReasonCode::BudgetExhausted));
    assert!(!has(&d, ReasonCode::NoProviderAvailable));
    let esc = d.escalation.unwrap();
    assert_eq!(
        esc.recommended_action,
        Action::HumanReviewBlockAutomaticAction
    );
    assert_eq!(
        esc.reason_codes.last(),
        Some(&ReasonCode::EscalatedBudgetExhausted)
    );
}

/// One exhaustion episode met by two nodes is one escalation: each names it after the budget
/// and the ledger record's episode, not after itself, so callers, records and the escalation
/// store all see one id. A budget no record stands behind keeps the node's own names.
#[test]
fn every_node_names_one_budget_episode_s_escalation_alike() {
    let high = |id: &str| {
        let mut r = req(id);
        r.risk = Risk::High;
        r
    };
    let on = |node: &str, since: Option<u64>| {
        let mut e = engine();
        std::sync::Arc::make_mut(&mut e.state.cluster).self_id = node.into();
        let b = Budget {
            since_ms: since,
            ..Budget::new(0.0)
        };
        e.state.budgets.agents.insert("agent-a".into(), b);
        e.state.budgets.global = Some(b);
        e
    };
    let since = Some(T0 - 60_000);
    let (mut n1, mut n2) = (on("n1", since), on("n2", since));
    let a = run(&mut n1, high("r1"), &[]).escalation.expect("escalated");
    let b = run(&mut n2, high("r2"), &[]).escalation.expect("escalated");
    assert_eq!(a.id, b.id);
    assert!(a.id.starts_with("esc-budget-agent-agent-a-"), "{}", a.id);
    // The next episode (an operator's set or reset) has a name of its own.
    let mut n3 = on("n3", Some(T0 - 1_000));
    let c = run(&mut n3, high("r3"), &[]).escalation.expect("escalated");
    assert_ne!(c.id, a.id);
    // Without a record: the node's own name, as before.
    let mut alone = on("n4", None);
    let d = run(&mut alone, high("r4"), &[])
        .escalation
        .expect("escalated");
    assert!(d.id.starts_with("esc-n4-"), "{}", d.id);
}

/// A budget refusal says what the attempt was estimated at beside what was left, and an
/// exhausted budget is escalated once per episode: the next refusals are only refused, until
/// the episode ends (an operator's set or reset clears the mark the ledger mirrors).
#[test]
fn an_exhausted_budget_says_its_shortfall_and_escalates_once_per_episode() {
    let mut e = engine();
    e.state
        .budgets
        .agents
        .insert("agent-a".into(), Budget::new(0.002));
    // Different questions of one length: the same estimate, and no loop.
    let mut asked = 0;
    let mut high = || {
        asked += 1;
        let mut r = req(&format!("high-{asked}"));
        r.risk = Risk::High;
        r
    };
    let first = run(&mut e, high(), &[]);
    assert_eq!(
        (first.outcome, first.phase),
        (DecisionOutcome::Escalated, Phase::Budget)
    );
    let sf = first.shortfall.clone().expect("a shortfall");
    assert_eq!(sf.agent.as_deref(), Some("agent-a"));
    assert_eq!((sf.remaining_usd, sf.limit_usd), (0.002, 0.002));
    let best = &first.attempts[0].candidates[0];
    assert_eq!(sf.estimate_usd, best.est_cost_usd);
    assert!(sf.estimate_usd > sf.remaining_usd, "{sf:?}");
    assert_eq!(
        e.state.budgets.agents["agent-a"].refused_at_ms,
        Some(first.decided_at_ms)
    );

    for _ in 0..3 {
        let again = run(&mut e, high(), &[]);
        assert_eq!(
            (again.outcome, again.phase),
            (DecisionOutcome::Rejected, Phase::Budget),
            "refused, not escalated again: {:?}",
            again.reason_codes
        );
        assert!(again.escalation.is_none());
        assert!(has(&again, ReasonCode::BudgetExhausted));
        assert!(!has(&again, ReasonCode::HumanAttentionRequired));
        assert_eq!(again.shortfall, Some(sf.clone()));
    }

    // The episode ends: the next refusal is escalated again.
    e.state
        .budgets
        .agents
        .get_mut("agent-a")
        .unwrap()
        .refused_at_ms = None;
    assert_eq!(run(&mut e, high(), &[]).outcome, DecisionOutcome::Escalated);

    // A refusal by the ledger tells the attempt's hold beside what the ledger left.
    let mut e = budgeted(1.0);
    let (mut s, step) = e.begin(high(), T0).expect("valid");
    let Step::Dispatch(dispatch) = step else {
        panic!("dispatched: {step:?}")
    };
    let Some(Step::Done(d)) = e.refuse_reservation(&mut s, ReasonCode::BudgetExhausted, T0) else {
        panic!("a refused high-risk request ends")
    };
    let sf = d.shortfall.expect("a shortfall");
    assert_eq!(
        (sf.estimate_usd, sf.remaining_usd),
        (dispatch.hold_usd, 1.0)
    );
}

/// A budget with `on_exceeded = "escalate"` escalates a refusal whatever its risk (once per
/// episode); the same refusal under "refuse" is only refused. The shortfall names the team.
#[test]
fn a_budget_that_escalates_escalates_low_risk_refusals_too() {
    use crate::core::budget::{Kind, OnExceeded, Owner};
    let mut e = engine();
    for p in &mut e.state.providers {
        p.cost_per_1k_tokens_usd = 1.0; // nothing free to fall back on
    }
    e.state.budgets.teams.insert(
        "support".into(),
        Budget {
            on_exceeded: OnExceeded::Escalate,
            ..Budget::new(0.0001)
        },
    );
    let of_team = |id: &str| {
        let mut r = req(id);
        r.team = Some("support".into());
        r
    };
    let d = run(&mut e, of_team("low-1"), &[]);
    assert_eq!(
        (d.outcome, d.phase),
        (DecisionOutcome::Escalated, Phase::Budget)
    );
    assert!(
        has(&d, ReasonCode::EscalatedBudgetExhausted),
        "{:?}",
        d.reason_codes
    );
    let sf = d.shortfall.expect("a shortfall");
    assert_eq!(sf.owner(), Owner::new(Kind::Team, "support"));
    let again = run(&mut e, of_team("low-2"), &[]);
    assert_eq!(again.outcome, DecisionOutcome::Rejected, "once per episode");
    // Under "refuse" a low-risk refusal is not escalated at all.
    let team = e.state.budgets.teams.get_mut("support").unwrap();
    team.on_exceeded = OnExceeded::Refuse;
    team.refused_at_ms = None;
    let refused = run(&mut e, of_team("low-3"), &[]);
    assert_eq!(
        (refused.outcome, refused.phase),
        (DecisionOutcome::Rejected, Phase::Budget)
    );
    assert!(refused.escalation.is_none());
    // Another agent of no team is not held to it.
    let free = run(&mut e, req("other"), &[("primary", good())]);
    assert_eq!(free.outcome, DecisionOutcome::Accepted);
}

#[test]
fn high_risk_is_served_when_only_a_worse_provider_is_unaffordable() {
    let mut e = engine();
    // Enough for the primary's estimate, not more: the cheaper secondary fits too.
    e.state
        .budgets
        .agents
        .insert("agent-a".into(), Budget::new(0.003));
    e.state.providers[2].cost_per_1k_tokens_usd = 1.0; // secondary now unaffordable
    let mut r = req("high");
    r.risk = Risk::High;
    let d = run(&mut e, r, &[("primary", good())]);
    assert_eq!(d.outcome, DecisionOutcome::Accepted);
    assert_eq!(d.provider.as_deref(), Some("primary"));
    assert_eq!(
        d.attempts[0].candidates[2].excluded,
        Some(ReasonCode::BudgetExhausted)
    );
}

#[test]
fn a_single_dissenting_node_does_not_move_traffic() {
    let mut e = engine();
    std::sync::Arc::make_mut(&mut e.state.cluster).size = 3;
    for n in ["n1", "n2", "n3"] {
        std::sync::Arc::make_mut(&mut e.state.cluster).heartbeat(n, T0);
        for p in ["primary", "secondary", "local"] {
            std::sync::Arc::make_mut(&mut e.state.cluster).observe(observation(
                n,
                p,
                Verdict::Healthy,
                1.0,
            ));
        }
    }
    // This node had a bad probe and sees the primary as unhealthy; the majority does not.
    set_verdict(&mut e, "primary", Verdict::Unhealthy, 0.0);
    let d = run(&mut e, req("r"), &[("primary", good())]);
    assert_eq!(d.provider.as_deref(), Some("primary"));
    let c = &d.attempts[0].candidates[0];
    assert!(c.quorum);
    assert_eq!((c.votes, c.voters, c.availability), (2, 3, 1.0));
    assert!(!has(&d, ReasonCode::NoQuorumLocalView));
}

#[test]
fn without_quorum_the_node_routes_on_its_own_view_and_says_so() {
    let mut e = engine();
    std::sync::Arc::make_mut(&mut e.state.cluster).size = 3; // two peers configured, none alive
    let d = run(&mut e, req("r"), &[("primary", good())]);
    assert_eq!(d.outcome, DecisionOutcome::Accepted);
    assert!(has(&d, ReasonCode::NoQuorumLocalView));
    assert!(!d.attempts[0].candidates[0].quorum);
}

#[test]
fn retry_after_is_honoured() {
    let mut e = engine();
    let mut limited = Generation::failed(GenerationStatus::RateLimited, 5);
    limited.retry_after_ms = Some(2_000);
    let d = run(&mut e, req("a"), &[("primary", limited), ("local", good())]);
    assert!(has(&d, ReasonCode::RateLimited));
    assert_eq!(d.provider.as_deref(), Some("local"));
    assert!(
        e.state.breakers["primary"].is_closed(),
        "a 429 is not a breaker failure"
    );
    let d = run_at(&mut e, req("b"), T0 + 1_000, &[("local", good())]);
    assert_eq!(
        d.attempts[0].candidates[0].excluded,
        Some(ReasonCode::ProviderCoolingDown)
    );
    let d = run_at(&mut e, req("c"), T0 + 2_006, &[("primary", good())]);
    assert_eq!(d.provider.as_deref(), Some("primary"));
}

#[test]
fn non_idempotent_timeouts_are_not_retried() {
    let mut e = engine();
    let mut r = req("pay");
    r.idempotent = false;
    let d = run(
        &mut e,
        r,
        &[(
            "primary",
            Generation::failed(GenerationStatus::Timeout, 10_000),
        )],
    );
    assert_eq!(d.attempts.len(), 1);
    assert!(has(&d, ReasonCode::RetryNotSafe));
    assert_eq!(d.outcome, DecisionOutcome::Escalated);
    assert!(has(&d, ReasonCode::EscalatedUnsafeRetry));
    assert_eq!(
        d.decided_at_ms,
        T0 + 10_000,
        "time advanced by the real elapsed time"
    );
}

#[test]
fn queued_requests_proceed_when_dequeued() {
    let mut e = engine();
    e.state.bulkheads.normal.active = e.config.bulkheads.normal.concurrency;
    let (mut s, step) = e.begin(req("q"), T0).unwrap();
    assert_eq!(step, Step::Queued);
    assert_eq!(e.state.bulkheads.normal.queued, 1);
    e.state.bulkheads.release(Priority::Normal);
    let step = e.dequeue(&mut s, T0 + 5);
    assert!(matches!(step, Step::Dispatch(_)));
    assert_eq!(e.state.bulkheads.normal.queued, 0);
}

#[test]
fn a_freed_slot_goes_to_the_oldest_waiter_and_wakes_only_it() {
    let mut e = engine();
    let limit = e.config.bulkheads.normal.concurrency;
    let running: Vec<Session> = (0..limit)
        .map(|i| {
            let (s, step) = e.begin(req(&format!("run{i}")), T0).unwrap();
            assert!(matches!(step, Step::Dispatch(_)));
            s
        })
        .collect();
    let mut waiting: Vec<Session> = (0..3)
        .map(|i| {
            let (s, step) = e.begin(req(&format!("wait{i}")), T0).unwrap();
            assert_eq!(step, Step::Queued);
            s
        })
        .collect();
    assert!(e.take_granted().is_empty());
    // The first running request finishes: exactly the oldest waiter is granted its slot.
    let mut first = running.into_iter().next().unwrap();
    assert!(matches!(
        e.complete(&mut first, good(), T0 + 180),
        Step::Done(_)
    ));
    assert_eq!(e.take_granted(), vec![waiting[0].ticket().unwrap()]);
    assert_eq!(
        (
            e.state.bulkheads.normal.active,
            e.state.bulkheads.normal.queued
        ),
        (limit, 2),
        "the slot moved to the waiter, it was not freed for anyone"
    );
    // A newcomer queues behind the others instead of taking the slot.
    let (_, step) = e.begin(req("late"), T0 + 181).unwrap();
    assert_eq!(step, Step::Queued);
    let step = e.dequeue(&mut waiting[0], T0 + 181);
    assert!(matches!(step, Step::Dispatch(_)));
    assert_eq!(e.state.bulkheads.normal.active, limit);
}

#[test]
fn a_caller_that_leaves_the_queue_costs_nothing_and_frees_its_place() {
    let mut e = engine();
    e.state.bulkheads.normal.active = e.config.bulkheads.normal.concurrency;
    let (mut s, step) = e.begin(req("gone"), T0).unwrap();
    assert_eq!(step, Step::Queued);
    let d = e
        .caller_gone(&mut s, T0 + 50)
        .expect("a queued request ends at once");
    assert_eq!(d.phase, Phase::Admission);
    assert!(
        has(&d, ReasonCode::ClientDisconnected),
        "{:?}",
        d.reason_codes
    );
    assert!(d.attempts.is_empty(), "no provider was called");
    assert_eq!(e.state.bulkheads.normal.queued, 0);
}

#[test]
fn a_caller_that_leaves_mid_attempt_gets_no_retry() {
    let mut e = engine();
    let (mut s, step) = e.begin(req("mid"), T0).unwrap();
    assert!(matches!(step, Step::Dispatch(_)));
    assert_eq!(
        e.caller_gone(&mut s, T0 + 5),
        None,
        "the attempt under way finishes"
    );
    let Step::Done(d) = e.complete(&mut s, err(), T0 + 20) else {
        panic!("a failed attempt of a caller that left is not retried");
    };
    assert_eq!(d.attempts.len(), 1);
    assert!(
        has(&d, ReasonCode::ClientDisconnected),
        "{:?}",
        d.reason_codes
    );
    assert!(
        d.effects
            .iter()
            .any(|x| matches!(x, Effect::HealthSample { .. }))
    );
    assert_eq!(e.state.bulkheads.normal.active, 0);
}

#[test]
fn a_dropped_session_gives_back_its_slot_reservation_and_place() {
    let mut e = engine();
    e.state
        .budgets
        .agents
        .insert("agent-a".into(), Budget::new(1.0));
    let limit = e.config.bulkheads.normal.concurrency;
    e.state.bulkheads.normal.active = limit - 1;
    let (mut holder, step) = e.begin(req("holder"), T0).unwrap();
    assert!(matches!(step, Step::Dispatch(_)));
    let (mut waiter, step) = e.begin(req("waiter"), T0).unwrap();
    assert_eq!(step, Step::Queued);
    e.drop_session(&mut holder);
    assert_eq!(e.take_granted(), vec![waiter.ticket().unwrap()]);
    assert_eq!(e.state.budgets.agents["agent-a"].reserved_usd, 0.0);
    // The waiter's driver is gone too, after its grant: the slot is free again.
    e.drop_session(&mut waiter);
    assert_eq!(
        (
            e.state.bulkheads.normal.active,
            e.state.bulkheads.normal.queued
        ),
        (limit - 1, 0)
    );
}

#[test]
fn invalid_requests_are_refused_with_the_field_named() {
    let mut e = engine();
    let mut r = req("x");
    r.messages.clear();
    let err = e.begin(r, T0).unwrap_err();
    assert_eq!(err.field, "messages");
    assert!(err.message.contains("request.messages"), "{err}");
    let mut r = req("x");
    r.policy.min_confidence = Some(3.0);
    let err = e.begin(r, T0).unwrap_err();
    assert_eq!(err.field, "policy.min_confidence");
    assert!(err.message.contains("policy.min_confidence"), "{err}");
    let mut r = req("x");
    r.response_format = Some(serde_json::json!({"type": "xml"}));
    let err = e.begin(r, T0).unwrap_err();
    assert_eq!(err.field, "response_format");
    assert!(
        err.message.contains("request.response_format.type"),
        "{err}"
    );
    let mut r = req("x");
    r.max_cost_usd = Some(-1.0);
    assert_eq!(e.begin(r, T0).unwrap_err().field, "max_cost_usd");
}

#[test]
fn replay_is_byte_for_byte_deterministic_and_names_missing_results() {
    let input = DecideInput {
        now_ms: T0,
        config: json_contract(),
        request: req("r"),
        state: engine().state,
        generations: [
            ("primary".to_string(), vec![err()]),
            ("local".into(), vec![good()]),
        ]
        .into(),
    };
    let a = serde_json::to_string(&replay(input.clone()).unwrap()).unwrap();
    let b = serde_json::to_string(&replay(input.clone()).unwrap()).unwrap();
    assert_eq!(a, b);
    let mut missing = input.clone();
    missing.generations.remove("local");
    let e = replay(missing).unwrap_err();
    assert!(
        matches!(e, crate::core::replay::DecideError::NoResult { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("generations.local"), "{e}");
    let mut unknown = input;
    unknown.generations.insert("nope".into(), vec![]);
    let e = replay(unknown).unwrap_err();
    assert!(e.to_string().contains("generations.nope"), "{e}");
}

/// Every reason code in the enum is reachable: each scenario below drives the real pipeline and
/// the union of what the decisions carry must be the whole enum.
#[test]
fn every_reason_code_is_reachable() {
    let mut seen = BTreeSet::new();
    let mut note = |d: &Decision| {
        seen.extend(d.reason_codes.iter().copied());
        for a in &d.attempts {
            seen.extend(a.codes.iter().copied());
            for c in &a.candidates {
                seen.extend(c.excluded);
                seen.extend(c.notes.iter().copied());
            }
        }
        if let Some(esc) = &d.escalation {
            seen.extend(esc.reason_codes.iter().copied());
        }
    };

    // Admission.
    let mut e = engine();
    e.state.bulkheads.normal.active = 24;
    note(&run(&mut e, req("queued"), &[("primary", good())]));
    let mut e = engine();
    e.state.bulkheads.normal.active = 24;
    e.state.bulkheads.normal.queued = 48;
    note(&run(&mut e, req("full"), &[]));
    let mut e = engine();
    e.state.bulkheads.normal.active = 24;
    let (mut s, step) = e.begin(req("waits"), T0).unwrap();
    assert_eq!(step, Step::Queued);
    let d = e
        .abandon(&mut s, T0 + 5_000)
        .expect("a queued request can be abandoned");
    assert_eq!(
        (d.phase, e.state.bulkheads.normal.queued),
        (Phase::Admission, 0)
    );
    note(&d);
    let mut e = engine();
    e.state.bulkheads.normal.active = 24;
    let (mut s, _) = e.begin(req("leaves"), T0).unwrap();
    note(&e.caller_gone(&mut s, T0 + 10).expect("queued"));
    let mut e = engine();
    e.state.bulkheads.background.active = 8;
    let mut r = req("bg");
    r.priority = Priority::Background;
    note(&run(&mut e, r.clone(), &[]));
    let mut e = engine();
    e.state.bulkheads.normal.active = 24;
    note(&run(&mut e, r, &[]));

    // Loops (AGENT_LOOP_DETECTED, RUNAWAY_RETRY_STOPPED, LOOP_PROBE, ESCALATED_AGENT_LOOP).
    let mut e = engine();
    let mut r = req("loop");
    r.policy.max_attempts = Some(1);
    for i in 0..4 {
        note(&run_at(&mut e, r.clone(), T0 + i, &[("primary", err())]));
    }
    let later = T0 + e.config.loops.cooldown_ms + 1_000;
    note(&run_at(&mut e, r, later, &[("primary", good())]));

    // Budgets.
    let mut e = engine();
    e.state
        .budgets
        .agents
        .insert("agent-a".into(), Budget::new(0.0));
    note(&run(&mut e, req("b"), &[("local", good())]));
    let mut r = req("hb");
    r.risk = Risk::High;
    note(&run(&mut e, r, &[]));
    let mut e = engine();
    e.state.budgets.global = Some(Budget::new(0.0));
    note(&run(&mut e, req("g"), &[("local", good())]));

    // Routing: health, quorum, policy, cool-down, nothing left.
    let mut e = engine();
    set_verdict(&mut e, "primary", Verdict::Unhealthy, 0.2);
    set_verdict(&mut e, "secondary", Verdict::Degraded, 0.9);
    e.state.breakers.insert(
        "local".into(),
        Breaker::HalfOpen {
            probes_in_flight: 1,
            successes: 0,
        },
    );
    note(&run(&mut e, req("degraded"), &[("secondary", good())]));
    let mut e = engine();
    e.state.cluster = Cluster::new("n1", 3).into();
    note(&run(&mut e, req("unknown"), &[("primary", good())]));
    let mut e = engine();
    e.state.breakers.insert(
        "primary".into(),
        Breaker::Open {
            until_ms: T0 + 60_000,
            forced: false,
        },
    );
    e.state.cooldowns.insert("secondary".into(), T0 + 60_000);
    let mut r = req("nofb");
    r.policy.allow_fallback = false;
    note(&run(&mut e, r, &[]));

    // Breaker: half-open probe that closes, and a failure that opens.
    let mut e = engine();
    e.state.breakers.insert(
        "primary".into(),
        Breaker::Open {
            until_ms: T0,
            forced: false,
        },
    );
    note(&run(&mut e, req("probe"), &[("primary", good())]));
    let mut e = engine();
    e.state
        .breakers
        .insert("primary".into(), Breaker::Closed { failures: 4 });
    note(&run(
        &mut e,
        req("opens"),
        &[("primary", err()), ("local", good())],
    ));

    // Generation failures, retries, and the unsafe retry.
    let mut e = engine();
    let mut limited = Generation::failed(GenerationStatus::RateLimited, 5);
    limited.retry_after_ms = Some(100);
    note(&run(
        &mut e,
        req("gen"),
        &[
            (
                "primary",
                Generation::failed(GenerationStatus::Timeout, 10_000),
            ),
            ("local", limited),
            ("secondary", err()),
        ],
    ));
    // Same-target retries, refusals of the request, refused credentials, context windows.
    note(&drive(&mut retrying(), req("again"), vec![err(), good()]).1);
    for status in [
        GenerationStatus::ContentPolicy,
        GenerationStatus::Unauthorized,
        GenerationStatus::LocalResources,
    ] {
        let g = Generation::failed(status, 5);
        note(&drive(&mut retrying(), req("refused"), vec![g, good()]).1);
    }
    let too_long = Generation::failed(GenerationStatus::ContextLength, 5);
    note(
        &drive(
            &mut windows(),
            asking("long", "ctx"),
            vec![too_long, good()],
        )
        .1,
    );
    // Streams: a skipped event (the driver's note), interrupted, continued where a prefill is
    // taken, interrupted again and ended with an error.
    let mut e = windows();
    e.state.providers[2].prefill = true;
    let (mut s, _) = e.begin(asking("long", "st"), T0).unwrap();
    s.note(ReasonCode::StreamChunkSkipped);
    e.interrupted(&mut s);
    let _ = e.complete(&mut s, err(), T0 + 10);
    e.interrupted(&mut s);
    if let Step::Done(d) = e.complete(&mut s, err(), T0 + 20) {
        note(&d);
    }
    // A json_schema answer that breaks its schema; tool arguments that break theirs.
    let mut r = req("schema");
    r.response_format = Some(
        serde_json::json!({"type": "json_schema", "json_schema": {"schema":
        {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}}}}),
    );
    r.policy.max_attempts = Some(1);
    note(&run(
        &mut engine(),
        r,
        &[("primary", Generation::ok(r#"{"n": 9}"#, 1))],
    ));
    let mut r = req("tool");
    r.tools = std::sync::Arc::new(
        [(
            "f".to_string(),
            serde_json::json!({"type": "object", "required": ["x"]}),
        )]
        .into(),
    );
    r.policy.max_attempts = Some(1);
    let call = Generation {
        finish_reason: Some("tool_calls".into()),
        tool_calls: vec![crate::core::contract::ToolCall {
            name: "f".into(),
            arguments: "{}".into(),
        }],
        ..Generation::ok("", 1)
    };
    note(&run(&mut engine(), r, &[("primary", call)]));
    let mut r = req("unsafe");
    r.idempotent = false;
    note(&run(
        &mut engine(),
        r,
        &[("primary", Generation::failed(GenerationStatus::Timeout, 9))],
    ));

    // Every contract defect.
    let mut bad = vec![
        Generation::ok("", 1),
        Generation::ok("plain text", 1),
        Generation::ok("[1]", 1),
        Generation::ok(r#"{"answer":"x"}"#, 1),
        Generation::ok(r#"{"answer":"x","confidence":"high"}"#, 1),
        Generation::ok(r#"{"answer":"x","confidence":7}"#, 1),
        Generation::ok(r#"{"answer":"x","confidence":0.01}"#, 1),
        Generation::ok(
            format!(r#"{{"answer":"{}","confidence":0.9}}"#, "x".repeat(20_000)),
            1,
        ),
        Generation::ok(r#"{"answer":"x","conf"#, 1),
    ];
    let mut cut = good();
    cut.finish_reason = Some("length".into());
    bad.push(cut);
    for (i, g) in bad.into_iter().enumerate() {
        let mut r = req(&format!("c{i}"));
        r.policy.max_attempts = Some(1);
        note(&run(&mut engine(), r, &[("primary", g)]));
    }
    let mut r = req("typed");
    r.contract = Some(ContractSpec {
        properties: [("answer".to_string(), JsonType::Number)].into(),
        ..ContractSpec::default()
    });
    r.policy.max_attempts = Some(1);
    note(&run(&mut engine(), r, &[("primary", good())]));

    // Quality (medium risk -> low-confidence escalation), cost gates.
    let mut r = req("quality");
    r.risk = Risk::Medium;
    note(&run(
        &mut engine(),
        r,
        &[
            ("primary", with_confidence(0.6)),
            ("local", with_confidence(0.6)),
        ],
    ));
    let mut e = engine();
    e.state.providers.truncate(1);
    let mut r = req("cost");
    r.max_cost_usd = Some(0.000_001);
    note(&run(&mut e, r, &[("primary", good())]));

    // A same-target retry the request's latency budget has no room for.
    let tight = Request {
        latency_budget_ms: Some(10),
        ..req("tight")
    };
    note(&drive(&mut retrying(), tight, vec![err(), good()]).1);

    // A request the provider refuses as invalid.
    note(&run(
        &mut engine(),
        req("invalid"),
        &[("primary", Generation::failed(GenerationStatus::Rejected, 2))],
    ));

    // Escalations by risk and by task criticality.
    let mut r = req("high");
    r.risk = Risk::High;
    note(&run(
        &mut engine(),
        r,
        &[("primary", err()), ("secondary", err())],
    ));
    let mut r = req("crit");
    r.priority = Priority::Critical;
    note(&run(
        &mut engine(),
        r,
        &[("primary", err()), ("local", err()), ("secondary", err())],
    ));

    // The shared ledger refuses, or cannot be asked: refused (high risk), or spent on the
    // node's local share (noted by the driver).
    let mut e = budgeted(1.0);
    let mut r = req("store");
    r.risk = Risk::High;
    let (mut s, _) = e.begin(r, T0).expect("valid");
    let step = e.refuse_reservation(&mut s, ReasonCode::BudgetStoreUnreachable, T0);
    if let Some(Step::Done(d)) = step {
        note(&d);
    }
    let (mut s, step) = e.begin(req("share"), T0).expect("valid");
    assert!(matches!(step, Step::Dispatch(_)));
    s.note(ReasonCode::BudgetLocalShare);
    if let Step::Done(d) = e.complete(&mut s, good(), T0 + 5) {
        note(&d);
    }
    // A budget in audit mode: the ledger granted what it would have refused (noted by the
    // driver).
    let (mut s, step) = e.begin(req("audited"), T0).expect("valid");
    assert!(matches!(step, Step::Dispatch(_)));
    s.note(ReasonCode::BudgetWouldRefuse);
    if let Step::Done(d) = e.complete(&mut s, good(), T0 + 5) {
        note(&d);
    }

    // A request bound to its API: the target of the other is excluded.
    e.state.providers[0].api = crate::core::request::Api::Anthropic;
    let mut bound = req("bound");
    bound.bound_to = Some(crate::core::request::Api::Openai);
    let (_, d) = drive(&mut e, bound, vec![good()]);
    note(&d);
    // Over a rate limit before the first attempt.
    let (mut s, _) = e.begin(req("limited"), T0).expect("valid");
    if let Step::Done(d) = e.rate_limited(&mut s, T0) {
        note(&d);
    }
    // Embeddings asked of chat targets only.
    let mut embed = req("embed");
    embed.embeddings = true;
    let (_, d) = drive(&mut e, embed, vec![]);
    note(&d);

    // The prober's, not a request's: said in the node's state when the probe budget stops
    // billed probes (`node::health`, tested there).
    seen.insert(ReasonCode::ProbeBudgetExhausted);
    // The listener's: a connection past node.max_connections is refused before any request
    // is read (`node::server`, tested in the suite's gateway tests).
    seen.insert(ReasonCode::ConnectionLimit);
    // The MCP door's: a tool whose definition changed is refused before any request is made
    // (`node::catalog` pins definitions; tested end to end in the suite's tools tests).
    seen.insert(ReasonCode::ToolDefinitionChanged);
    let all: BTreeSet<ReasonCode> = ReasonCode::ALL.iter().copied().collect();
    let missing: Vec<&str> = all.difference(&seen).map(|c| c.as_str()).collect();
    assert!(missing.is_empty(), "unreached reason codes: {missing:?}");
}

/// Two models on one host (`h/big`, `h/small`) and one elsewhere (`o/big`), all healthy; a route
/// `big` -> h/big then o/big, and a route `small` (held to the JSON contract) -> h/small.
pub(crate) fn routed() -> Engine {
    let target = |id: &str, model: &str, cost: f64| Target {
        id: id.into(),
        model: model.into(),
        cost_per_1k_tokens_usd: cost,
        output_cost_per_1k_usd: None,
        cached_input_cost_per_1k_usd: None,
        cache_write_cost_per_1k_usd: None,
        reasoning_cost_per_1k_usd: None,
        fallback: false,
        context_window: None,
        prefill: false,
        api: Default::default(),
        embeddings: false,
        cost_per_call_usd: 0.0,
    };
    let mut state = State {
        cluster: Cluster::new("n1", 1).into(),
        // o/big is cheaper: scored routing would prefer it; the route's order must win.
        providers: vec![
            target("h/big", "big", 0.01),
            target("h/small", "small", 0.001),
            target("o/big", "big-2", 0.0),
        ],
        ..State::default()
    };
    for p in ["h/big", "h/small", "o/big"] {
        std::sync::Arc::make_mut(&mut state.cluster).observe(observation(
            "n1",
            p,
            Verdict::Healthy,
            1.0,
        ));
    }
    let route = |targets: &[&str], contract| Route {
        targets: targets.iter().map(|&t| t.into()).collect(),
        contract,
    };
    state
        .routes
        .insert("big".into(), route(&["h/big", "o/big"], None));
    state.routes.insert(
        "small".into(),
        route(&["h/small"], Some(ContractSpec::default())),
    );
    let config = Config {
        same_target_retries: 0,
        ..Config::default()
    };
    Engine::new(config, state)
}

pub(crate) fn asking(model: &str, id: &str) -> Request {
    Request {
        model: Some(model.into()),
        ..req(id)
    }
}

#[test]
fn without_a_contract_a_prose_answer_is_a_good_answer() {
    let mut e = routed();
    let prose = Generation::ok("Paris is the capital of France.", 90);
    let d = run(&mut e, asking("big", "p1"), &[("h/big", prose.clone())]);
    assert_eq!(d.outcome, DecisionOutcome::Accepted, "{:?}", d.reason_codes);
    assert_eq!(d.confidence, None);
    // Cut off by its token limit is the caller's choice without a contract.
    let cut = Generation {
        finish_reason: Some("length".into()),
        ..prose.clone()
    };
    let d = run(&mut e, asking("big", "p2"), &[("h/big", cut.clone())]);
    assert_eq!(d.outcome, DecisionOutcome::Accepted);
    // The same prose on a route held to the JSON contract fails it ...
    let d = run(&mut e, asking("small", "p3"), &[("h/small", prose.clone())]);
    assert!(has(&d, ReasonCode::ContractNotJson), "{:?}", d.reason_codes);
    // ... and a request's own contract wins over its route's (plain text asks for none, even
    // on a route that has one).
    let plain = Request {
        response_format: Some(serde_json::json!({"type": "text"})),
        ..asking("small", "p3b")
    };
    assert_eq!(
        run(&mut e, plain, &[("h/small", prose.clone())]).outcome,
        DecisionOutcome::Accepted
    );
    let text = Request {
        response_format: Some(serde_json::json!({"type": "text"})),
        ..asking("big", "p4")
    };
    assert_eq!(
        run(&mut e, text, &[("h/big", cut)]).outcome,
        DecisionOutcome::Accepted
    );
    let own = Request {
        contract: Some(ContractSpec::default()),
        ..asking("big", "p5")
    };
    let d = run(&mut e, own, &[("h/big", prose.clone()), ("o/big", prose)]);
    assert!(has(&d, ReasonCode::ContractNotJson), "{:?}", d.reason_codes);
}

#[test]
fn a_route_serves_in_its_order_and_falls_back_along_its_chain() {
    let mut e = routed();
    let d = run(&mut e, asking("big", "r1"), &[("h/big", good())]);
    assert_eq!(
        d.provider.as_deref(),
        Some("h/big"),
        "route order beats cost"
    );
    assert!(!d.fallback && !has(&d, ReasonCode::FallbackUsed));
    assert_eq!(d.route.as_deref(), Some("big"));
    let ids: Vec<&str> = d.attempts[0]
        .candidates
        .iter()
        .map(|c| &*c.provider)
        .collect();
    assert_eq!(
        ids,
        ["h/big", "o/big"],
        "only the route's targets, in order"
    );
    // A failure moves along the chain, never off it.
    let d = run(
        &mut e,
        asking("big", "r2"),
        &[("h/big", err()), ("o/big", good())],
    );
    assert_eq!(d.provider.as_deref(), Some("o/big"));
    // A route's later target is its fallback, and says so.
    assert!(d.fallback && has(&d, ReasonCode::FallbackUsed), "{d:?}");
    assert!(!d.attempts[0].fallback && d.attempts[1].fallback);
    // A degraded first target yields to a healthy second one.
    set_verdict(&mut e, "h/big", Verdict::Degraded, 0.8);
    let d = run(&mut e, asking("big", "r3"), &[("o/big", good())]);
    assert_eq!(d.provider.as_deref(), Some("o/big"));
    // With no route named (or `auto`), scoring picks across every target, as before.
    let all = [("h/big", good()), ("h/small", good()), ("o/big", good())];
    let d = run(&mut e, asking("auto", "r4"), &all);
    assert_eq!(d.route, None);
    assert_eq!(d.attempts[0].candidates.len(), 3);
}

#[test]
fn a_failing_model_does_not_open_the_breaker_of_another_model_on_its_host() {
    let mut e = routed();
    for i in 0..12 {
        let r = asking("big", &format!("b{i}"));
        let _ = run_at(
            &mut e,
            r,
            T0 + i * 10,
            &[("h/big", err()), ("o/big", good())],
        );
    }
    let open = |e: &Engine, id: &str| {
        e.state
            .breakers
            .get(id)
            .is_some_and(|b| b.peek(T0 + 200, &e.config.breaker) == Permit::Open)
    };
    assert!(open(&e, "h/big"), "the failing model's breaker opened");
    assert!(!open(&e, "h/small"), "its sibling on the same host did not");
    let d = run_at(
        &mut e,
        asking("small", "s1"),
        T0 + 200,
        &[("h/small", good())],
    );
    assert_eq!(d.outcome, DecisionOutcome::Accepted);
}

#[test]
fn prompt_and_completion_tokens_are_priced_apart() {
    let p = Target {
        output_cost_per_1k_usd: Some(0.004),
        ..default_providers()[0].clone()
    };
    // 1,000 prompt tokens at $0.01/1k and 500 completion tokens at $0.004/1k.
    assert!((p.cost_of(1_000, 500) - 0.012).abs() < 1e-12);
    assert!(!p.is_zero_cost());
}

#[test]
fn cached_written_and_reasoning_tokens_are_priced_at_their_own_prices() {
    use crate::core::request::{Usage, round_usd};
    let usage = Usage {
        prompt_tokens: 1_000,
        completion_tokens: 500,
        cached_tokens: 600,
        cache_write_tokens: 100,
        reasoning_tokens: 200,
    };
    let plain = Target {
        output_cost_per_1k_usd: Some(0.004),
        ..default_providers()[0].clone()
    };
    // Without prices of their own they cost what prompt and completion tokens cost, exactly.
    assert_eq!(plain.cost_of_usage(&usage), plain.cost_of(1_000, 500));
    let priced = Target {
        cached_input_cost_per_1k_usd: Some(0.001),
        cache_write_cost_per_1k_usd: Some(0.0125),
        reasoning_cost_per_1k_usd: Some(0.02),
        ..plain.clone()
    };
    // 300 plain prompt at 0.01, 600 cached at 0.001, 100 written at 0.0125, 300 plain
    // completion at 0.004, 200 reasoning at 0.02: per 1k, 3 + 0.6 + 1.25 + 1.2 + 4 = 10.05.
    assert_eq!(priced.cost_of_usage(&usage), 0.01005);
    // Counts an upstream got wrong (more cached than prompt tokens) are clamped, never negative.
    let odd = Usage {
        cached_tokens: 5_000,
        reasoning_tokens: 9_000,
        ..usage
    };
    assert_eq!(
        priced.cost_of_usage(&odd),
        round_usd((1_000.0 * 0.001 + 500.0 * 0.02) / 1_000.0)
    );
}

#[test]
fn a_usage_without_the_new_counts_reads_and_writes_as_before() {
    use crate::core::request::Usage;
    let old: Usage = serde_json::from_str(r#"{"prompt_tokens": 3, "completion_tokens": 2}"#)
        .expect("an old record's usage");
    assert_eq!((old.cached_tokens, old.reasoning_tokens), (0, 0));
    assert_eq!(
        serde_json::to_string(&old).expect("JSON"),
        r#"{"prompt_tokens":3,"completion_tokens":2}"#,
        "byte for byte, so old records replay the same"
    );
}

/// Begin `r` and answer each dispatch from `script` in order (whatever the target), returning
/// every dispatch made and the decision.
fn drive(e: &mut Engine, r: Request, script: Vec<Generation>) -> (Vec<Dispatch>, Decision) {
    let (mut s, mut step) = e.begin(r, T0).expect("valid request");
    let mut t = T0;
    let mut sent = Vec::new();
    let mut script = VecDeque::from(script);
    loop {
        step = match step {
            Step::Done(d) => return (sent, *d),
            Step::Queued => e.dequeue(&mut s, t),
            Step::Dispatch(d) => {
                let g = script
                    .pop_front()
                    .expect("a scripted answer for every dispatch");
                t += d.delay_ms + g.latency_ms;
                sent.push(d);
                e.complete(&mut s, g, t)
            }
        };
    }
}

fn targets(sent: &[Dispatch]) -> Vec<&str> {
    sent.iter().map(|d| &*d.provider).collect()
}

#[test]
fn transient_failures_retry_the_same_target_first_then_the_next() {
    // A 5xx: the same target again after a backoff in [50, 100] ms, and it answers.
    let (sent, d) = drive(&mut retrying(), req("t1"), vec![err(), good()]);
    assert_eq!(targets(&sent), ["primary", "primary"]);
    assert!(
        (50..=100).contains(&sent[1].delay_ms),
        "{}",
        sent[1].delay_ms
    );
    assert_eq!(sent[0].delay_ms, 0);
    assert_eq!(d.outcome, DecisionOutcome::Accepted);
    assert!(has(&d, ReasonCode::RetrySameTarget));
    assert!(d.attempts[1].same_target && !d.attempts[0].same_target);
    // The same inputs wait the same time (the jitter is the request's, not a dice roll).
    let (again, _) = drive(&mut retrying(), req("t1"), vec![err(), good()]);
    assert_eq!(again[1].delay_ms, sent[1].delay_ms);
    // Twice: then the next target (with its own retry); retries do not use up the three
    // attempts a low-risk request has.
    let (sent, d) = drive(
        &mut retrying(),
        req("t2"),
        vec![err(), err(), err(), good()],
    );
    let t = targets(&sent);
    assert_eq!(t.len(), 4, "{t:?}");
    assert_eq!(&t[..2], ["primary", "primary"]);
    assert!(t[2] != "primary" && t[2] == t[3], "{t:?}");
    assert_eq!(d.attempts.iter().filter(|a| !a.same_target).count(), 2);
    assert_eq!(d.outcome, DecisionOutcome::Accepted);

    // A 429 within the cap: the same target once its Retry-After has passed.
    let limited = |ms| Generation {
        retry_after_ms: Some(ms),
        ..Generation::failed(GenerationStatus::RateLimited, 5)
    };
    let (sent, _) = drive(&mut retrying(), req("t3"), vec![limited(400), good()]);
    assert_eq!(targets(&sent), ["primary", "primary"]);
    assert_eq!(sent[1].delay_ms, 400);
    // Past the cap: the next target at once.
    let (sent, _) = drive(&mut retrying(), req("t4"), vec![limited(30_000), good()]);
    assert_ne!(sent[1].provider, sent[0].provider);
    assert_eq!(sent[1].delay_ms, 0);

    // A silent target is not waited on twice.
    let silent = Generation::failed(GenerationStatus::Timeout, 900);
    let (sent, _) = drive(&mut retrying(), req("t5"), vec![silent, good()]);
    assert_ne!(sent[1].provider, sent[0].provider);

    // No retry that would start past the request's latency budget.
    let tight = Request {
        latency_budget_ms: Some(60),
        ..req("t6")
    };
    let (sent, d) = drive(&mut retrying(), tight, vec![err(), good()]);
    assert_ne!(sent[1].provider, sent[0].provider);
    assert!(has(&d, ReasonCode::RetryWaitOverBudget), "and it says why");

    // The default budget (1.5 s) holds a Retry-After up to the cap (2 s): it is honoured.
    let cfg = Config::default();
    assert!(cfg.max_retry_after_ms > cfg.default_latency_budget_ms);
    let (sent, d) = drive(
        &mut retrying(),
        req("t7"),
        vec![limited(cfg.max_retry_after_ms), good()],
    );
    assert_eq!(targets(&sent), ["primary", "primary"]);
    assert_eq!(sent[1].delay_ms, cfg.max_retry_after_ms);
    assert!(!has(&d, ReasonCode::RetryWaitOverBudget));
    // A budget the request set, too short for it: the next target, and said.
    let hurried = Request {
        latency_budget_ms: Some(1_000),
        ..req("t8")
    };
    let (sent, d) = drive(&mut retrying(), hurried, vec![limited(1_500), good()]);
    assert_ne!(sent[1].provider, sent[0].provider);
    assert!(
        has(&d, ReasonCode::RetryWaitOverBudget),
        "{:?}",
        d.reason_codes
    );
}

#[test]
fn a_caller_gone_during_a_retry_backoff_costs_nothing_more() {
    let mut e = retrying();
    e.state
        .budgets
        .agents
        .insert("agent-a".into(), Budget::new(10.0));
    let (mut s, step) = e.begin(req("w1"), T0).unwrap();
    assert!(matches!(step, Step::Dispatch(_)));
    let step = e.complete(&mut s, err(), T0 + 20);
    let Step::Dispatch(d) = step else {
        panic!("a retry is dispatched: {step:?}")
    };
    assert!(d.delay_ms > 0);
    let d = e.withdraw(&mut s, T0 + 30).expect("an attempt was waiting");
    assert!(has(&d, ReasonCode::ClientDisconnected));
    assert_eq!(d.attempts.len(), 1, "the withdrawn attempt was never made");
    assert_eq!(e.state.bulkheads.normal.active, 0, "its slot is back");
    let budget = e.state.budgets.agents["agent-a"];
    assert_eq!(
        (budget.reserved_usd, budget.spent_usd),
        (0.0, 0.0),
        "and its reservation"
    );
}

/// Targets a (8k tokens), b (4k) and c (32k) on one route, in that order.
fn windows() -> Engine {
    let mut e = routed();
    let t = |id: &str, w| Target {
        id: id.into(),
        model: id.into(),
        cost_per_1k_tokens_usd: 0.0,
        output_cost_per_1k_usd: None,
        cached_input_cost_per_1k_usd: None,
        cache_write_cost_per_1k_usd: None,
        reasoning_cost_per_1k_usd: None,
        fallback: false,
        context_window: Some(w),
        prefill: false,
        api: Default::default(),
        embeddings: false,
        cost_per_call_usd: 0.0,
    };
    e.state.providers = vec![t("a", 8_000), t("b", 4_000), t("c", 32_000)];
    e.state.routes.insert(
        "long".into(),
        Route {
            targets: vec!["a".into(), "b".into(), "c".into()],
            contract: None,
        },
    );
    e
}

#[test]
fn too_long_for_a_context_window_goes_to_a_larger_one_never_the_same() {
    let refused = Generation::failed(GenerationStatus::ContextLength, 15);
    let (sent, d) = drive(&mut windows(), asking("long", "l1"), vec![refused, good()]);
    assert_eq!(targets(&sent), ["a", "c"], "b's window is smaller than a's");
    assert_eq!(d.outcome, DecisionOutcome::Accepted);
    assert!(has(&d, ReasonCode::ContextLengthExceeded));
    let b = &d.attempts[1].candidates[1];
    assert_eq!(b.excluded, Some(ReasonCode::ContextWindowTooSmall));
    // Not the target's failure: no breaker count, no health sample.
    assert!(
        !d.effects
            .iter()
            .any(|f| matches!(f, Effect::HealthSample { provider, .. } if &**provider == "a"))
    );
    // Known too long by estimate (~6k tokens): the small windows are skipped up front.
    let long = Request {
        messages: vec![Message {
            role: "user".into(),
            content: "x".repeat(24_000),
        }],
        ..asking("long", "l2")
    };
    let (sent, _) = drive(&mut windows(), long, vec![good()]);
    assert_eq!(targets(&sent), ["a"]);
    let longer = Request {
        messages: vec![Message {
            role: "user".into(),
            content: "x".repeat(40_000),
        }],
        ..asking("long", "l3")
    };
    let (sent, _) = drive(&mut windows(), longer, vec![good()]);
    assert_eq!(targets(&sent), ["c"]);
}

#[test]
fn a_content_policy_refusal_is_final() {
    let refused = Generation::failed(GenerationStatus::ContentPolicy, 15);
    let (sent, d) = drive(&mut retrying(), req("cp"), vec![refused]);
    assert_eq!(sent.len(), 1, "no retry, no fallback");
    assert_eq!(d.outcome, DecisionOutcome::Rejected);
    assert!(has(&d, ReasonCode::ContentPolicyRefusal));
    assert!(
        d.effects
            .iter()
            .all(|f| !matches!(f, Effect::HealthSample { .. }))
    );
}

#[test]
fn refused_credentials_move_on_and_tell_an_operator_once() {
    let mut e = retrying();
    let denied = Generation::failed(GenerationStatus::Unauthorized, 10);
    let (sent, d) = drive(&mut e, req("u1"), vec![denied.clone(), good()]);
    assert_ne!(
        sent[1].provider, sent[0].provider,
        "no retry of a refused key"
    );
    assert_eq!(
        d.outcome,
        DecisionOutcome::Accepted,
        "another target served it"
    );
    let esc = d.escalation.as_ref().expect("an operator is told");
    assert_eq!(
        esc.reason_codes.last(),
        Some(&ReasonCode::EscalatedUpstreamMisconfigured)
    );
    assert_eq!(esc.recommended_action, Action::HumanReview);
    // The next request that meets it raises nothing new.
    let (_, d) = drive(&mut e, req("u2"), vec![denied.clone(), good()]);
    assert!(has(&d, ReasonCode::UpstreamAuthFailed));
    assert!(d.escalation.is_none());
    // Another node meeting it in the same window names it alike (one escalation between
    // them), and so does a probe's refusal; the target is named.
    let mut other = retrying();
    std::sync::Arc::make_mut(&mut other.state.cluster).self_id = "n2".into();
    let (_, d2) = drive(&mut other, req("u3"), vec![denied, good()]);
    let esc2 = d2.escalation.expect("the other node tells too");
    assert_eq!(esc2.id, esc.id);
    assert_eq!(esc.target.as_deref(), Some(&*sent[0].provider));
    let mut third = retrying();
    let probed = third
        .refused_to_probe(&sent[0].provider, Some("HTTP 401".into()), T0)
        .expect("raised");
    assert_eq!(probed.id, esc.id);
    assert_eq!(probed.detail.as_deref(), Some("HTTP 401"));
    assert!(
        third
            .refused_to_probe(&sent[0].provider, None, T0 + 1_000)
            .is_none(),
        "once per window"
    );
}

#[test]
fn an_interrupted_stream_goes_on_once_and_only_where_a_prefill_is_taken() {
    let mut e = windows();
    e.config.same_target_retries = 1;
    // a and c take a prefill; b does not.
    e.state.providers[0].prefill = true;
    e.state.providers[2].prefill = true;
    let (mut s, step) = e.begin(asking("long", "s1"), T0).unwrap();
    assert!(matches!(step, Step::Dispatch(ref d) if &*d.provider == "a" && !d.continuation));
    e.interrupted(&mut s);
    let Step::Dispatch(d) = e.complete(&mut s, err(), T0 + 50) else {
        panic!("continued")
    };
    assert_eq!(
        &*d.provider, "c",
        "not a again (no restart), not b (no prefill)"
    );
    assert!(d.continuation && d.delay_ms == 0);
    let b = &s.attempts[1].candidates;
    assert_eq!(b[1].excluded, Some(ReasonCode::PrefillNotSupported));
    // The continuation breaks too: not continued again.
    e.interrupted(&mut s);
    let Step::Done(d) = e.complete(&mut s, err(), T0 + 90) else {
        panic!("ended")
    };
    assert_eq!(d.outcome, DecisionOutcome::Rejected);
    assert_eq!(d.attempts.len(), 2);
    for c in [
        ReasonCode::StreamInterrupted,
        ReasonCode::StreamContinuedWithPrefill,
        ReasonCode::StreamEndedWithError,
    ] {
        assert!(has(&d, c), "{:?}", d.reason_codes);
    }
}

#[test]
fn a_continued_stream_names_both_targets_and_charges_both_parts() {
    let mut e = windows();
    e.state.providers[0].cost_per_1k_tokens_usd = 0.01;
    e.state.providers[2].prefill = true;
    e.state.providers[2].cost_per_1k_tokens_usd = 0.002;
    let (mut s, _) = e.begin(asking("long", "c1"), T0).unwrap();
    let prompt = s.est_prompt_tokens();
    // The first part delivered 10 characters, then was cut before its usage came: charged the
    // prompt and 3 tokens (4 characters a token, rounded up) at a's price.
    e.delivered(&mut s);
    e.interrupted(&mut s);
    let cut = Generation {
        content: "0123456789".into(),
        ..err()
    };
    let Step::Dispatch(d) = e.complete(&mut s, cut, T0 + 50) else {
        panic!("continued")
    };
    assert_eq!(&*d.provider, "c");
    e.delivered(&mut s);
    let rest = Generation {
        usage: Some(Usage {
            prompt_tokens: 40,
            completion_tokens: 20,
            ..Usage::default()
        }),
        ..Generation::ok("and the rest", 60)
    };
    let Step::Done(d) = e.complete(&mut s, rest, T0 + 110) else {
        panic!("decided")
    };
    assert_eq!(d.outcome, DecisionOutcome::Accepted);
    assert_eq!(d.served_by(), ["a", "c"]);
    let first = round_usd((prompt + 3) as f64 * 0.01 / 1000.0);
    assert_eq!(d.attempts[0].cost_usd, first);
    assert_eq!(d.attempts[1].cost_usd, round_usd(60.0 * 0.002 / 1000.0));
    assert_eq!(
        d.cost_usd,
        round_usd(d.attempts[0].cost_usd + d.attempts[1].cost_usd)
    );
    // A failure that delivered nothing costs nothing, and is no part of the answer.
    let (mut s, _) = e.begin(asking("long", "c2"), T0).unwrap();
    e.interrupted(&mut s);
    let _ = e.complete(&mut s, err(), T0 + 50);
    assert_eq!(s.attempts[0].cost_usd, 0.0);
    assert!(!s.attempts[0].delivered);
}

#[test]
fn an_answer_that_already_reached_the_caller_is_never_followed_by_a_fresh_one() {
    // A live stream's tool call turns out invalid at its end: refused, not retried elsewhere
    // (the caller has the first answer's bytes; a second whole answer cannot follow them).
    let mut e = retrying();
    let mut r = req("live");
    r.tools = std::sync::Arc::new(
        [(
            "f".to_string(),
            serde_json::json!({"type": "object", "required": ["x"]}),
        )]
        .into(),
    );
    let (mut s, _) = e.begin(r, T0).unwrap();
    e.delivering(&mut s);
    let call = Generation {
        finish_reason: Some("tool_calls".into()),
        tool_calls: vec![crate::core::contract::ToolCall {
            name: "f".into(),
            arguments: "{}".into(),
        }],
        ..Generation::ok("", 40)
    };
    let Step::Done(d) = e.complete(&mut s, call, T0 + 40) else {
        panic!("decided, not retried")
    };
    assert_eq!(d.outcome, DecisionOutcome::Rejected);
    assert!(has(&d, ReasonCode::ToolArgumentsInvalid));
    assert_eq!(d.attempts.len(), 1);
    // A 5xx after the first bytes is no same-target restart either (only an interruption,
    // continued where a prefill is taken).
    let (mut s, _) = e.begin(req("live2"), T0).unwrap();
    e.delivering(&mut s);
    assert!(matches!(e.complete(&mut s, err(), T0 + 10), Step::Done(_)));
}

#[test]
fn a_decided_session_holds_nothing_a_live_one_does() {
    let mut e = engine();
    let (mut s, step) = e.begin(req("h1"), T0).unwrap();
    assert!(matches!(step, Step::Dispatch(_)) && s.holds_anything());
    assert!(matches!(e.complete(&mut s, good(), T0 + 5), Step::Done(_)));
    assert!(
        !s.holds_anything(),
        "nothing left for drop_session to give back"
    );
    e.state.bulkheads.normal.active = 24;
    let (s, step) = e.begin(req("h2"), T0).unwrap();
    assert_eq!(step, Step::Queued);
    assert!(s.holds_anything(), "a queue place");
}

/// `engine()` with a budget of `limit_usd` for `agent-a`.
fn budgeted(limit_usd: f64) -> Engine {
    let mut e = engine();
    e.state
        .budgets
        .agents
        .insert("agent-a".into(), Budget::new(limit_usd));
    e
}

#[test]
fn a_dispatch_under_a_budget_names_what_the_ledger_must_hold() {
    let mut e = budgeted(1.0);
    let (_, step) = e.begin(req("a"), T0).expect("valid");
    let Step::Dispatch(d) = step else {
        panic!("dispatched: {step:?}")
    };
    assert_eq!(&*d.provider, "primary");
    assert!(
        d.hold_usd > 0.0,
        "a paid target under a budget holds its estimate"
    );
    let reserved = e.state.budgets.agents["agent-a"].reserved_usd;
    assert!((d.hold_usd - reserved).abs() < 1e-9);

    // Without a budget nothing needs holding.
    let mut free = engine();
    let (_, step) = free.begin(req("b"), T0).expect("valid");
    let Step::Dispatch(d) = step else {
        panic!("dispatched: {step:?}")
    };
    assert_eq!(d.hold_usd, 0.0);
}

#[test]
fn a_refused_reservation_refuses_high_risk_and_moves_lower_risk_on() {
    // High risk: refused in the budget phase and escalated, its reservation given back.
    let mut e = budgeted(1.0);
    let mut r = req("high");
    r.risk = Risk::High;
    let (mut s, _) = e.begin(r, T0).expect("valid");
    let Some(Step::Done(d)) = e.refuse_reservation(&mut s, ReasonCode::BudgetExhausted, T0) else {
        panic!("a refused high-risk request ends")
    };
    assert_eq!(d.phase, Phase::Budget);
    assert!(d.reason_codes.contains(&ReasonCode::BudgetExhausted));
    assert!(
        d.reason_codes
            .contains(&ReasonCode::EscalatedBudgetExhausted)
    );
    assert!(d.escalation.is_some());
    assert_eq!(e.state.budgets.agents["agent-a"].reserved_usd, 0.0);

    // Low risk: the refused target counts as tried; the next (a zero-cost fallback needs no
    // hold) serves.
    let (mut s, _) = e.begin(req("low"), T0).expect("valid");
    let Some(Step::Dispatch(d)) =
        e.refuse_reservation(&mut s, ReasonCode::GlobalBudgetExhausted, T0)
    else {
        panic!("a lower-risk request goes on")
    };
    assert_ne!(&*d.provider, "primary");
    let Step::Done(done) = e.complete(&mut s, good(), T0 + 10) else {
        panic!("answered")
    };
    assert_eq!(done.outcome, DecisionOutcome::Accepted);
    assert!(
        done.reason_codes
            .contains(&ReasonCode::GlobalBudgetExhausted)
    );
    assert_eq!(e.state.budgets.agents["agent-a"].reserved_usd, 0.0);

    // Out of turn (nothing dispatched): nothing to refuse.
    let mut s2 = s.clone();
    assert!(
        e.refuse_reservation(&mut s2, ReasonCode::BudgetExhausted, T0)
            .is_none()
    );
}

#[test]
fn a_provider_answering_again_half_opens_its_breaker_unless_tripped_on_purpose() {
    let mut e = engine();
    assert_eq!(e.answering_again("primary"), None, "no breaker yet");
    e.state.breakers.insert(
        "primary".into(),
        Breaker::Open {
            until_ms: T0 + 10_000,
            forced: false,
        },
    );
    assert_eq!(e.answering_again("primary"), Some(Transition::HalfOpened));
    // The next request is its probe.
    let (_, step) = e.begin(req("probe"), T0).expect("valid");
    let Step::Dispatch(d) = step else {
        panic!("dispatched: {step:?}")
    };
    assert_eq!(&*d.provider, "primary");
    assert_eq!(e.answering_again("primary"), None, "half-open already");
    let forced = Breaker::Open {
        until_ms: T0 + 10_000,
        forced: true,
    };
    e.state.breakers.insert("secondary".into(), forced);
    assert_eq!(e.answering_again("secondary"), None);
    assert_eq!(e.state.breakers["secondary"], forced);
}

/// What a reservation is priced on counts what providers bill beyond the text: the chat
/// format's tokens per message and the declared tools' schemas.
#[test]
fn prompt_estimates_count_the_format_and_the_tools() {
    let mut r = req("est");
    r.messages = vec![Message {
        role: "user".into(),
        content: "hello".into(),
    }];
    // "user" + "hello": 9 characters, 3 tokens; 4 for the message, 3 for the reply.
    assert_eq!(estimate_prompt_tokens(&r), 10);
    // Twice: 18 characters, 5 tokens; 8 for the two messages, 3 for the reply.
    r.messages.push(r.messages[0].clone());
    assert_eq!(estimate_prompt_tokens(&r), 16);
    let schema = serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let schema_chars = "get_weather".len() + schema.to_string().len();
    let before = estimate_prompt_tokens(&r);
    r.tools = std::sync::Arc::new([("get_weather".to_string(), schema)].into());
    assert!(estimate_prompt_tokens(&r) >= before + (schema_chars as u64) / 4);
}

#[test]
fn a_request_s_own_schema_never_counts_against_a_target() {
    // The attack: ten requests whose own json_schema (or tool schema) no answer can fit opened
    // every breaker of a node, and then ordinary requests got CIRCUIT_OPEN.
    let mut e = engine();
    let impossible = serde_json::json!({"type": "json_schema", "json_schema": {"schema":
        {"type": "object", "required": ["never"], "properties": {"never": {"type": "integer"}}}}});
    for i in 0..12 {
        let mut r = req(&format!("schema{i}"));
        r.response_format = Some(impossible.clone());
        let mut t = req(&format!("tool{i}"));
        t.tools = std::sync::Arc::new(
            [(
                "f".to_string(),
                serde_json::json!({"type": "object", "required": ["x"]}),
            )]
            .into(),
        );
        let call = Generation {
            finish_reason: Some("tool_calls".into()),
            tool_calls: vec![crate::core::contract::ToolCall {
                name: "f".into(),
                arguments: "{}".into(),
            }],
            ..Generation::ok("", 1)
        };
        for (r, g) in [(r, Generation::ok(r#"{"n": 1}"#, 1)), (t, call)] {
            let script: Vec<(&str, Generation)> = ["primary", "secondary", "local"]
                .iter()
                .map(|p| (*p, g.clone()))
                .collect();
            let d = run(&mut e, r, &script);
            assert!(has(&d, ReasonCode::SemanticValidationFailed), "{d:?}");
            assert!(
                !d.effects
                    .iter()
                    .any(|f| matches!(f, Effect::HealthSample { .. } | Effect::Breaker { .. })),
                "{:?}",
                d.effects
            );
        }
    }
    assert!(e.state.breakers.values().all(Breaker::is_closed));
    // Ordinary requests are served as before.
    let d = run(&mut e, req("plain"), &[("primary", good())]);
    assert_eq!(d.outcome, DecisionOutcome::Accepted, "{d:?}");
    assert!(!has(&d, ReasonCode::CircuitOpen), "{d:?}");
    // The configured contract still judges the target.
    let mut e = engine();
    e.config.max_attempts.low = 1;
    for i in 0..5 {
        let d = run(
            &mut e,
            req(&format!("c{i}")),
            &[("primary", Generation::ok("prose", 1))],
        );
        assert_eq!(has(&d, ReasonCode::CircuitOpened), i == 4, "{d:?}");
    }
}

#[test]
fn a_reservation_prices_every_answer_asked_for_and_a_timeout_is_charged() {
    // The attack: `n = 128` against a $0.01 limit was priced as one answer, so eight requests
    // were admitted and spent 102 times the limit.
    let mut e = engine();
    e.state.providers[0].cost_per_1k_tokens_usd = 0.01;
    e.state.providers[1].cost_per_1k_tokens_usd = 0.01;
    e.state
        .budgets
        .agents
        .insert("agent-a".into(), Budget::new(0.01));
    let mut one = req("one");
    one.max_tokens = Some(100);
    let mut many = req("many");
    many.max_tokens = Some(100);
    many.n = 128;
    let (s1, _) = e.begin(one, T0).unwrap();
    let (s128, _) = e.begin(many.clone(), T0).unwrap();
    let est = |e: &Engine, s: &Session| e.evaluate(s, &[0], T0, false)[0].est_cost_usd;
    let (c1, c128) = (est(&e, &s1), est(&e, &s128));
    assert!(
        c128 > 100.0 * (c1 - e.state.providers[0].cost_of(s1.est_prompt_tokens, 0)),
        "{c1} {c128}"
    );
    // Over the limit on every paid target: refused before any call is made.
    let d = run(&mut e, many, &[("primary", good()), ("secondary", good())]);
    assert!(
        d.attempts
            .iter()
            .all(|a| a.provider.as_deref() != Some("primary")),
        "{d:?}"
    );
    assert_eq!(
        d.attempts[0].candidates[0].excluded,
        Some(ReasonCode::BudgetExhausted),
        "{d:?}"
    );

    // An attempt that timed out may have been billed in full: it is charged its estimate.
    let mut e = engine();
    e.state.providers[0].cost_per_1k_tokens_usd = 0.01;
    e.config.max_attempts.low = 1;
    let d = run(
        &mut e,
        req("slow"),
        &[("primary", Generation::failed(GenerationStatus::Timeout, 9))],
    );
    assert!(d.attempts[0].cost_usd > 0.0, "{d:?}");
    assert!((d.cost_usd - d.attempts[0].cost_usd).abs() < 1e-12, "{d:?}");
}

#[test]
fn a_request_bound_to_its_api_goes_only_to_targets_that_speak_it() {
    use crate::core::request::Api;
    let mut e = windows();
    e.config.same_target_retries = 0;
    // b speaks Messages; a and c chat completions.
    e.state.providers[1].api = Api::Anthropic;
    let mut r = asking("long", "bound");
    r.bound_to = Some(Api::Openai);
    let (mut s, step) = e.begin(r, T0).unwrap();
    assert!(matches!(step, Step::Dispatch(ref d) if &*d.provider == "a"));
    let Step::Dispatch(d) = e.complete(&mut s, err(), T0 + 50) else {
        panic!("moved on")
    };
    assert_eq!(&*d.provider, "c", "not b: it cannot carry the request");
    let b = &s.attempts[1].candidates;
    assert_eq!(b[1].excluded, Some(ReasonCode::ApiNotCarried));
    // Unbound, the same route goes through b.
    let (mut s, _) = e.begin(asking("long", "free"), T0 + 100).unwrap();
    let Step::Dispatch(d) = e.complete(&mut s, err(), T0 + 150) else {
        panic!("moved on")
    };
    assert_eq!(&*d.provider, "b");
}

#[test]
fn a_caller_over_its_rate_limit_gives_back_its_slot_and_queue_place() {
    let mut e = engine();
    e.config.bulkheads.normal = crate::core::bulkhead::ClassLimits {
        concurrency: 1,
        queue: 4,
    };
    let (mut first, step) = e.begin(req("first"), T0).unwrap();
    assert!(matches!(step, Step::Dispatch(_)));
    let (mut queued, step) = e.begin(req("queued"), T0).unwrap();
    assert_eq!(step, Step::Queued);
    let Step::Done(d) = e.rate_limited(&mut queued, T0 + 1) else {
        panic!("refused")
    };
    assert_eq!(d.phase, crate::core::reason::Phase::Admission);
    assert!(
        has(&d, ReasonCode::RateLimitExceeded),
        "{:?}",
        d.reason_codes
    );
    assert!(d.attempts.is_empty(), "no target was called");
    assert_eq!(
        e.state.bulkheads.normal.queued, 0,
        "its queue place went back"
    );
    let Step::Done(d) = e.rate_limited(&mut first, T0 + 2) else {
        panic!("refused")
    };
    assert_eq!(d.cost_usd, 0.0);
    assert!(
        d.attempts.is_empty(),
        "the dispatched attempt was never made"
    );
    assert_eq!(d.reason_codes, [ReasonCode::RateLimitExceeded]);
    assert_eq!(e.state.bulkheads.normal.active, 0, "its slot went back");
}

/// The node ran out of descriptors before the target was reached: the request is refused
/// (the caller retries after a moment), and neither the target's breaker nor its health hears
/// of it, however many such failures come; nor does loop detection, though the same call
/// comes again and again.
#[test]
fn a_local_shortage_is_never_scored_against_the_target() {
    let mut e = retrying();
    for i in 0..20 {
        let short = Generation::failed(GenerationStatus::LocalResources, 1);
        let mut again = req("fd");
        again.id = format!("fd-{i}");
        let (sent, d) = drive(&mut e, again, vec![short]);
        assert!(
            !has(&d, ReasonCode::AgentLoopDetected),
            "{i}: {:?}",
            d.reason_codes
        );
        assert_eq!(
            sent.len(),
            1,
            "no retry, here or elsewhere: the shortage is the node's"
        );
        assert_eq!(d.phase, Phase::Generation);
        assert!(
            has(&d, ReasonCode::LocalResourceExhausted),
            "{:?}",
            d.reason_codes
        );
        assert!(
            !d.effects
                .iter()
                .any(|f| matches!(f, Effect::HealthSample { .. } | Effect::Breaker { .. })),
            "{:?}",
            d.effects
        );
    }
    assert_eq!(
        e.state.breakers.get("primary").copied().unwrap_or_default(),
        crate::core::breaker::Breaker::default(),
        "the breaker never heard of it"
    );
}
