//! The per-request pipeline, composed from the other core modules:
//!
//! admission -> loop check -> scored routing (exclusions, budget) -> circuit breaker ->
//! generation (done by the driver) -> semantic contract -> quality gate -> cost gate ->
//! retry or escalation.
//!
//! It is a small state machine over an `Engine` (configuration plus mutable state) and a
//! `Session` (one request): `begin` returns a `Step`; on `Step::Dispatch` the driver performs the
//! generation and hands the result to `complete`, which returns the next step, until
//! `Step::Done(decision)`. Nothing here reads a clock or does I/O, so the same inputs give the same
//! decision, byte for byte: `replay` drives a whole request from recorded generation results.

use super::breaker::{Breaker, BreakerConfig, Permit, Transition};
use super::budget::Budgets;
use super::bulkhead::{Admission, BulkheadConfig, Bulkheads, Kind, Left, Queues};
use super::contract::{Contract, ContractSpec, Defect};
use super::escalation::{self, Escalation};
use super::health::{Outcome, Verdict};
use super::loops::{self, Fingerprint, LoopCheck, LoopConfig, Loops};
use super::quorum::{Cluster, ProviderView};
use super::reason::{Action, Phase, ReasonCode};
use super::request::{Generation, GenerationStatus, Request, Risk, Target, TargetId, round_usd};
use super::score::{self, ScoreInput};
use super::timeline::{StateVersion, Timeline};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub use super::decision::{Attempt, Decision, DecisionOutcome, Dispatch, Effect, Evaluation, Step};
pub use super::replay::{DecideInput, replay};
use super::validate::invalid;
pub use super::validate::{InvalidRequest, validate};

/// Confidence an answer needs, by risk level (the quality gate).
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug)]
#[serde(deny_unknown_fields, default)]
pub struct ByRisk<T> {
    pub low: T,
    pub medium: T,
    pub high: T,
}

impl<T: Copy> ByRisk<T> {
    pub fn get(&self, risk: Risk) -> T {
        match risk {
            Risk::Low => self.low,
            Risk::Medium => self.medium,
            Risk::High => self.high,
        }
    }
}

impl Default for ByRisk<f64> {
    fn default() -> Self {
        ByRisk {
            low: 0.5,
            medium: 0.7,
            high: 0.85,
        }
    }
}

impl Default for ByRisk<u32> {
    fn default() -> Self {
        ByRisk {
            low: 3,
            medium: 2,
            high: 2,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub breaker: BreakerConfig,
    /// Admission of short completions.
    pub bulkheads: BulkheadConfig,
    /// Admission of streams, on their own slots: a stream holds one for its whole answer.
    pub stream_bulkheads: BulkheadConfig,
    pub loops: LoopConfig,
    /// Minimum confidence for the quality gate.
    pub quality: ByRisk<f64>,
    /// Total attempts (first try plus retries).
    pub max_attempts: ByRisk<u32>,
    pub default_latency_budget_ms: u64,
    pub default_max_tokens: u32,
    pub attempt_timeout_ms: u64,
    /// Cool-down after a 429 that carried no Retry-After.
    pub default_retry_after_ms: u64,
    /// Retries of a transient failure (5xx, refused or reset connection, 429) on the same
    /// target before the next target is tried; they do not count in `max_attempts`, and each
    /// must start within the request's latency budget.
    pub same_target_retries: u32,
    /// The first backoff before a same-target retry (doubling, with jitter in [50%, 100%]).
    pub retry_backoff_ms: u64,
    /// A 429's Retry-After longer than this goes to the next target instead of waiting.
    pub max_retry_after_ms: u64,
    /// The contract every answer is held to unless its route or the request brings one. None
    /// (the default): an answer is judged by transport, status and completeness only. `{}` is
    /// the JSON contract (`answer` and `confidence`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_contract: Option<ContractSpec>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            breaker: BreakerConfig::default(),
            bulkheads: BulkheadConfig::default(),
            stream_bulkheads: BulkheadConfig::default(),
            loops: LoopConfig::default(),
            quality: ByRisk::default(),
            max_attempts: ByRisk::default(),
            default_latency_budget_ms: 1_500,
            default_max_tokens: 256,
            attempt_timeout_ms: 10_000,
            default_retry_after_ms: 1_000,
            same_target_retries: 1,
            retry_backoff_ms: 100,
            max_retry_after_ms: 2_000,
            default_contract: None,
        }
    }
}

/// Everything the pipeline reads and writes besides the request.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields, default)]
pub struct State {
    /// Shared, not copied, by the records that saw it (`record`): it changes a few times a
    /// second, requests come thousands of times; a change copies it (`Arc::make_mut`). In a
    /// run of records (`record::in_a_run`) one that is the record before's is written once.
    #[serde(with = "super::record::cluster_in_run")]
    pub cluster: std::sync::Arc<Cluster>,
    /// In preference order: ties go to the provider listed first.
    pub providers: Vec<Target>,
    /// Per-provider breakers; a missing one is closed.
    pub breakers: BTreeMap<String, Breaker>,
    /// Target -> time its Retry-After ends.
    pub cooldowns: BTreeMap<String, u64>,
    pub bulkheads: Bulkheads,
    #[serde(default, skip_serializing_if = "Bulkheads::is_idle")]
    pub stream_bulkheads: Bulkheads,
    pub loops: Loops,
    pub budgets: Budgets,
    /// Model routes: what a client asks for -> the targets that may serve it, in preference
    /// order. A request for any other model (or `auto`) is routed by score across every target.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub routes: BTreeMap<String, Route>,
    /// Target -> until when its refused credentials need no new escalation.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub misconfigured: BTreeMap<String, u64>,
}

/// How long one escalation covers a target that refuses oam's credentials.
pub(crate) const MISCONFIGURED_ESCALATION_MS: u64 = 600_000;

/// A model name clients ask for, and who serves it.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Target ids, first preferred: the first one that passes every exclusion and is not
    /// degraded serves; the rest are its fallback chain.
    pub targets: Vec<TargetId>,
    /// The contract answers on this route are held to (a request's own wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contract: Option<ContractSpec>,
}

impl Default for State {
    fn default() -> Self {
        State {
            cluster: Cluster::new("local", 1).into(),
            providers: default_providers(),
            breakers: BTreeMap::new(),
            cooldowns: BTreeMap::new(),
            bulkheads: Bulkheads::default(),
            stream_bulkheads: Bulkheads::default(),
            loops: Loops::new(),
            budgets: Budgets::default(),
            routes: BTreeMap::new(),
            misconfigured: BTreeMap::new(),
        }
    }
}

/// The bulkheads a request is admitted to: its kind's, in its class.
fn lane(r: &Request) -> (Kind, crate::core::request::Priority) {
    (Kind::of(r.stream), r.priority)
}

/// The bulkheads of `kind` and their limits.
fn pool<'a>(
    state: &'a mut State,
    config: &'a Config,
    kind: Kind,
) -> (&'a mut Bulkheads, &'a BulkheadConfig) {
    match kind {
        Kind::Short => (&mut state.bulkheads, &config.bulkheads),
        Kind::Stream => (&mut state.stream_bulkheads, &config.stream_bulkheads),
    }
}

/// The simulator's providers, in preference order: a paid primary, a zero-cost local fallback
/// and a paid secondary (see `score` for why the fallback is listed second).
pub(crate) fn default_providers() -> Vec<Target> {
    let p = |id: &str, model: &str, cost: f64, fallback: bool| Target {
        id: id.into(),
        model: model.into(),
        cost_per_1k_tokens_usd: cost,
        output_cost_per_1k_usd: None,
        cached_input_cost_per_1k_usd: None,
        cache_write_cost_per_1k_usd: None,
        reasoning_cost_per_1k_usd: None,
        fallback,
        context_window: None,
        prefill: false,
        api: Default::default(),
        embeddings: false,
        cost_per_call_usd: 0.0,
    };
    vec![
        p("primary", "sim-large", 0.010, false),
        p("local", "sim-small", 0.0, true),
        p("secondary", "sim-medium", 0.004, false),
    ]
}

/// The prompt tokens `r` will be billed for, estimated high rather than low: an attempt's
/// budget reservation is priced on it, and the shared ledger's bound (spend at most the limit
/// plus what is reserved at one moment) holds only while answers cost no more than reserved.
/// Four characters a token for the messages (role and text) and the declared tools' schemas,
/// plus the chat format's own tokens: 4 per message and 3 to start the reply (OpenAI's published
/// accounting for its chat models).
pub(crate) fn estimate_prompt_tokens(r: &Request) -> u64 {
    let text: usize = r
        .messages
        .iter()
        .map(|m| m.role.len() + m.content.len())
        .sum();
    let tools = r.tools.json_len();
    ((text + tools) as u64).div_ceil(4) + 4 * r.messages.len() as u64 + 3
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    provider: usize,
    probe: bool,
    reserved_usd: f64,
    /// Prompt and completion tokens estimated.
    est_tokens: (u64, u64),
}

/// One request on its way through the pipeline.
#[derive(Clone, Debug)]
pub struct Session {
    request: Request,
    /// The model route the request asked for, if its `model` names one.
    route: Option<String>,
    /// What answers are held to: the request's own contract, else its route's, else the
    /// engine's default; none: transport, status and completeness only.
    contract: Option<Contract>,
    /// The contract is the request's own (`response_format`, `oam.contract`): an answer that
    /// breaks it says nothing about the target, which any caller could otherwise trip with a
    /// schema no answer can fit.
    own_contract: bool,
    fingerprint: Fingerprint,
    est_prompt_tokens: u64,
    codes: Vec<ReasonCode>,
    attempts: Vec<Attempt>,
    effects: Vec<Effect>,
    loop_probe: bool,
    /// The request's place in its class queue while it waits for a slot.
    ticket: Option<u64>,
    holds_slot: bool,
    /// The caller went away: no further attempt is made for it.
    caller_gone: bool,
    pending: Option<Pending>,
    cost_usd: f64,
    /// When the request began (same-target retries must start within its latency budget).
    began_ms: u64,
    /// The largest context window that refused the request as too long: no target whose
    /// window is as small is tried (a refusing target of unknown size is only never retried).
    context_over: Option<u64>,
    /// A target that refused oam's credentials during this request.
    misconfigured: Option<TargetId>,
    /// Part of the answer has reached the caller (a live stream): no attempt starts afresh.
    delivering: bool,
    /// ... and then the stream broke: only a target that takes a prefill may go on, once.
    interrupted: bool,
    continued: bool,
    /// The last budget refusal: its estimate beside what that budget had left.
    shortfall: Option<super::budget::Shortfall>,
}

impl Session {
    pub fn request(&self) -> &Request {
        &self.request
    }

    /// The prompt tokens its attempts are priced on without an upstream's count.
    pub fn est_prompt_tokens(&self) -> u64 {
        self.est_prompt_tokens
    }

    /// The queue ticket while the request waits for a slot (`Step::Queued`); the driver wakes
    /// it when `Engine::take_granted` names it.
    pub fn ticket(&self) -> Option<u64> {
        self.ticket
    }

    /// Does it still hold a queue place, a slot, or an attempt's reservation (which
    /// `Engine::drop_session` gives back)?
    pub fn holds_anything(&self) -> bool {
        self.ticket.is_some() || self.holds_slot || self.pending.is_some()
    }

    /// Is the answer held to a contract (and so checked whole before any of it is released)?
    pub fn contracted(&self) -> bool {
        self.contract.is_some()
    }

    /// Is an attempt dispatched and not yet reported?
    pub fn dispatched(&self) -> bool {
        self.pending.is_some()
    }

    /// What its attempts have cost so far.
    pub fn cost_usd(&self) -> f64 {
        self.cost_usd
    }

    /// Add a code the driver observed (e.g. a skipped stream event).
    pub fn note(&mut self, code: ReasonCode) {
        push(&mut self.codes, code);
    }

    /// Give the request back (e.g. to re-send it, or to reuse its buffers).
    pub fn into_request(self) -> Request {
        self.request
    }
}

/// The provider's breaker, created closed on first use (without allocating a key each call:
/// this runs for every routed request).
fn breaker_mut<'a>(breakers: &'a mut BTreeMap<String, Breaker>, id: &str) -> &'a mut Breaker {
    if !breakers.contains_key(id) {
        breakers.insert(id.to_string(), Breaker::default());
    }
    #[expect(clippy::expect_used, reason = "inserted just above")]
    breakers.get_mut(id).expect("inserted above")
}

fn push(codes: &mut Vec<ReasonCode>, code: ReasonCode) {
    if !codes.contains(&code) {
        codes.push(code);
    }
}

pub struct Engine {
    pub config: Config,
    pub state: State,
    /// Who waits for a slot, in order (not part of the replayable state: a recorded input is
    /// one request).
    queues: Queues,
    /// Escalations raised so far (part of each one's id).
    escalations: u64,
    /// Where targets are, worked out from `state` (see `scope`).
    pub(crate) lookup: super::scope::Lookup,
    /// The state timeline it writes, when a decision log keeps one (`keep_timeline`).
    timeline: Option<Box<Timeline>>,
}

impl Engine {
    /// The target of `session`'s attempt dispatched and not yet reported.
    pub fn dispatched_to(&self, session: &Session) -> Option<&str> {
        let p = session.pending.as_ref()?;
        self.state.providers.get(p.provider).map(|t| &*t.id)
    }

    pub fn new(config: Config, state: State) -> Self {
        Engine {
            config,
            state,
            queues: Queues::default(),
            escalations: 0,
            lookup: Default::default(),
            timeline: None,
        }
    }

    /// Write a state timeline from now on (see `timeline`).
    pub fn keep_timeline(&mut self) {
        self.timeline = Some(Box::new(Timeline::new()));
    }

    /// The version of the state timeline the state is at now, written first when it changed
    /// (0 without a timeline).
    pub fn seen(&mut self, now_ms: u64) -> u64 {
        match self.timeline.as_mut() {
            Some(t) => t.note(&mut self.state, now_ms),
            None => 0,
        }
    }

    /// The timeline entries written since the last call, to be logged in order.
    pub fn take_timeline(&mut self) -> Vec<StateVersion> {
        self.timeline.as_mut().map(|t| t.take()).unwrap_or_default()
    }

    /// Entries taken were not logged (see `Timeline::lost`).
    pub fn timeline_lost(&mut self) {
        if let Some(t) = self.timeline.as_mut() {
            t.lost();
        }
    }

    /// Target `at` (in `state.providers`) may have changed its breaker, cool-down or refused
    /// credentials.
    fn touch(&mut self, at: usize) {
        if let (Some(t), Some(p)) = (self.timeline.as_mut(), self.state.providers.get(at)) {
            t.touch(&p.id);
        }
    }

    /// Escalations raised so far (the next one's serial, part of its id).
    pub fn escalations_raised(&self) -> u64 {
        self.escalations
    }

    /// Continue an earlier engine's escalation serials (a replay).
    pub fn set_escalations_raised(&mut self, n: u64) {
        self.escalations = n;
    }

    /// Start a request: admission, then (unless queued or refused) loop check and routing.
    pub fn begin(
        &mut self,
        request: Request,
        now_ms: u64,
    ) -> Result<(Session, Step), InvalidRequest> {
        let own = validate(&request)?;
        let own_contract = own.is_some();
        let route = request
            .model
            .as_deref()
            .filter(|m| self.state.routes.contains_key(*m))
            .map(String::from);
        // `response_format: {"type": "text"}` with no contract of its own asks for none.
        let plain = request.contract.is_none()
            && request
                .response_format
                .as_ref()
                .is_some_and(|rf| rf["type"] == "text");
        let contract = match own {
            Some(c) => Some(c),
            // An embedding is no answer text: there is nothing to hold to a contract; a tool's
            // result is held only to the schema the tool declares (the request's own).
            None if plain || request.embeddings || request.is_tool_call() => None,
            None => {
                let (field, spec) = match &route {
                    Some(r) => ("model", self.state.routes[r].contract.as_ref()),
                    None => ("config.default_contract", None),
                };
                let spec = spec.or(self.config.default_contract.as_ref());
                spec.map(|spec| Contract::for_request(Some(spec), None))
                    .transpose()
                    .map_err(|e| invalid(field, format!("the configured {e}")))?
            }
        };
        let fingerprint = loops::fingerprint(
            &request.agent,
            &request.task,
            request.model.as_deref().unwrap_or(""),
            &request.messages,
        );
        let mut s = Session {
            est_prompt_tokens: estimate_prompt_tokens(&request),
            request,
            route,
            contract,
            own_contract,
            fingerprint,
            codes: Vec::new(),
            attempts: Vec::new(),
            effects: Vec::new(),
            loop_probe: false,
            ticket: None,
            holds_slot: false,
            caller_gone: false,
            pending: None,
            cost_usd: 0.0,
            began_ms: now_ms,
            context_over: None,
            misconfigured: None,
            delivering: false,
            interrupted: false,
            continued: false,
            shortfall: None,
        };
        let (kind, class) = lane(&s.request);
        let (b, cfg) = pool(&mut self.state, &self.config, kind);
        let step = match b.try_admit(class, cfg) {
            Admission::Admitted => {
                s.holds_slot = true;
                self.proceed(&mut s, now_ms)
            }
            Admission::Queued => {
                s.ticket = Some(self.queues.enqueue(kind, class));
                push(&mut s.codes, ReasonCode::AdmissionQueued);
                Step::Queued
            }
            Admission::Rejected(code) => {
                push(&mut s.codes, code);
                self.finish_failure(&mut s, Phase::Admission, now_ms)
            }
        };
        Ok((s, step))
    }

    /// Queue tickets granted a slot since the last call, in order: the driver wakes exactly
    /// these requests, and each continues with `dequeue`.
    pub fn take_granted(&mut self) -> Vec<u64> {
        self.queues.take_granted()
    }

    /// A queued request continues with the slot it was granted. A driver that runs one request
    /// at a time (`replay`) may call it without a grant: the request then takes a slot at once.
    pub fn dequeue(&mut self, s: &mut Session, now_ms: u64) -> Step {
        if let Some(ticket) = s.ticket.take() {
            let (kind, class) = lane(&s.request);
            if !self.queues.claim(ticket) {
                self.queues.remove(kind, class, ticket);
                pool(&mut self.state, &self.config, kind)
                    .0
                    .start_queued(class);
            }
            s.holds_slot = true;
        }
        self.proceed(s, now_ms)
    }

    /// A queued request leaves its queue (a slot it was granted meanwhile goes to the next).
    fn leave_queue(&mut self, s: &mut Session) -> bool {
        let Some(ticket) = s.ticket.take() else {
            return false;
        };
        let (kind, class) = lane(&s.request);
        let (b, _) = pool(&mut self.state, &self.config, kind);
        if self.queues.leave(kind, class, ticket, b) == Left::Granted {
            self.release_slot(&s.request);
        }
        true
    }

    fn release_slot(&mut self, request: &Request) {
        let (kind, class) = lane(request);
        let (b, cfg) = pool(&mut self.state, &self.config, kind);
        b.release(class);
        self.queues.promote(kind, b, cfg);
    }

    /// A queued request gave up waiting for a slot (its deadline passed): it leaves the queue
    /// and is refused with QUEUE_TIMEOUT. Does nothing to a request that is not queued.
    pub fn abandon(&mut self, s: &mut Session, now_ms: u64) -> Option<Decision> {
        self.leave_queue_with(s, ReasonCode::QueueTimeout, now_ms)
    }

    /// The caller went away. A queued request leaves the queue at once, refused with
    /// CLIENT_DISCONNECTED, and no provider is called for it. A request with an attempt under
    /// way lets that attempt finish (its outcome is still a health sample, and it is paid for),
    /// but no further attempt is made: `None` here, and the decision comes from `complete`.
    pub fn caller_gone(&mut self, s: &mut Session, now_ms: u64) -> Option<Decision> {
        s.caller_gone = true;
        self.leave_queue_with(s, ReasonCode::ClientDisconnected, now_ms)
    }

    fn leave_queue_with(
        &mut self,
        s: &mut Session,
        code: ReasonCode,
        now_ms: u64,
    ) -> Option<Decision> {
        if !self.leave_queue(s) {
            return None;
        }
        push(&mut s.codes, code);
        match self.finish_failure(s, Phase::Admission, now_ms) {
            Step::Done(d) => Some(*d),
            _ => None,
        }
    }

    /// The attempt under way has started reaching the caller (a live stream): whatever its
    /// verdict, no attempt may start afresh after it (a broken stream is `interrupted`).
    pub fn delivering(&mut self, s: &mut Session) {
        s.delivering = true;
    }

    /// The attempt under way delivered part of the answer the caller has (a live stream's part,
    /// given before its `complete`): the answer names it among those that served it.
    pub fn delivered(&mut self, s: &mut Session) {
        if let Some(a) = s.attempts.last_mut() {
            a.delivered = true;
        }
    }

    /// The attempt under way was streaming to the caller and broke after part of the answer was
    /// delivered: its failure (given next to `complete`) may only be continued on a target that
    /// takes a prefill, once, and never retried from scratch.
    pub fn interrupted(&mut self, s: &mut Session) {
        s.delivering = true;
        s.interrupted = true;
        push(&mut s.codes, ReasonCode::StreamInterrupted);
    }

    /// The caller went away while a dispatched attempt waited to start (a retry's backoff): the
    /// attempt is not made (its reservation and any probe permit go back) and the request ends,
    /// refused with CLIENT_DISCONNECTED. `None` if no attempt was waiting.
    pub fn withdraw(&mut self, s: &mut Session, now_ms: u64) -> Option<Decision> {
        self.release_pending(s)?;
        s.attempts.pop();
        s.caller_gone = true;
        push(&mut s.codes, ReasonCode::ClientDisconnected);
        match self.finish_failure(s, Phase::Admission, now_ms) {
            Step::Done(d) => Some(*d),
            _ => None,
        }
    }

    /// Give back everything a session holds that it will never finish (its driver is gone):
    /// its queue place or slot, and the budget reserved for an attempt under way. No decision.
    pub fn drop_session(&mut self, s: &mut Session) {
        self.leave_queue(s);
        self.release_pending(s);
        if s.holds_slot {
            s.holds_slot = false;
            self.release_slot(&s.request);
        }
    }

    /// The attempt dispatched and never made: its reservation and any probe permit go back.
    fn release_pending(&mut self, s: &mut Session) -> Option<()> {
        let p = s.pending.take()?;
        self.state.budgets.settle(&s.request, p.reserved_usd, 0.0);
        if p.probe {
            let id = self.state.providers[p.provider].id.clone();
            breaker_mut(&mut self.state.breakers, &id).release_probe();
            self.touch(p.provider);
        }
        Some(())
    }

    fn proceed(&mut self, s: &mut Session, now_ms: u64) -> Step {
        if s.request.agent == crate::core::request::ANONYMOUS {
            return self.route(s, now_ms, None);
        }
        match loops::check(
            &mut self.state.loops,
            s.fingerprint,
            now_ms,
            &self.config.loops,
        ) {
            LoopCheck::Blocked(incident) => {
                push(&mut s.codes, ReasonCode::RunawayRetryStopped);
                let mut step = self.finish_failure(s, Phase::Loop, now_ms);
                if let Step::Done(d) = &mut step {
                    d.incident = Some(*incident);
                }
                step
            }
            LoopCheck::Probe => {
                s.loop_probe = true;
                push(&mut s.codes, ReasonCode::LoopProbe);
                self.route(s, now_ms, None)
            }
            LoopCheck::Clear => self.route(s, now_ms, None),
        }
    }

    /// The targets this session may use, as indices into `state.providers`: its route's in
    /// route order, or every one.
    fn eligible(&self, s: &Session) -> Vec<usize> {
        if s.request.is_tool_call() {
            // A tool is called on the server that has it.
            let server = s.request.model.as_deref().unwrap_or("");
            return self.position(server).into_iter().collect();
        }
        match s.route.as_ref().and_then(|r| self.state.routes.get(r)) {
            Some(route) => route
                .targets
                .iter()
                .filter_map(|t| self.position(t))
                .collect(),
            None => (0..self.state.providers.len()).collect(),
        }
    }

    /// Evaluate every target in `order` for this session at `now_ms`; `again` when the one
    /// target in `order` is to be retried (so its earlier attempt does not exclude it).
    fn evaluate(&self, s: &Session, order: &[usize], now_ms: u64, again: bool) -> Vec<Evaluation> {
        let r = &s.request;
        let max_tokens = r.max_tokens.unwrap_or(self.config.default_max_tokens) as u64;
        // Every one of `n` answers is billed for its completion.
        let completion = max_tokens * u64::from(r.n.max(1));
        let latency_budget_ms = r
            .latency_budget_ms
            .unwrap_or(self.config.default_latency_budget_ms);
        let tried =
            |id: &str| !again && s.attempts.iter().any(|a| a.provider.as_deref() == Some(id));
        let needs = s.est_prompt_tokens + max_tokens;
        let too_small = |p: &Target| {
            p.context_window
                .is_some_and(|w| w < needs || s.context_over.is_some_and(|over| w <= over))
        };
        order
            .iter()
            .map(|&i| {
                let p = &self.state.providers[i];
                let view: ProviderView = self.state.cluster.view(&p.id, now_ms);
                let est_cost_usd = p.cost_of(s.est_prompt_tokens, completion);
                let within_cost_limit = r.max_cost_usd.is_none_or(|m| est_cost_usd <= m);
                let breaker = self.state.breakers.get(&*p.id).copied().unwrap_or_default();
                let excluded = if tried(&p.id) {
                    Some(ReasonCode::ProviderAlreadyTried)
                } else if p.embeddings != r.embeddings || p.serves_tools() != r.is_tool_call() {
                    Some(ReasonCode::ModelKindMismatch)
                } else if r.bound_to.is_some_and(|api| api != p.api) {
                    Some(ReasonCode::ApiNotCarried)
                } else if too_small(p) {
                    Some(ReasonCode::ContextWindowTooSmall)
                } else if s.interrupted && !p.prefill {
                    Some(ReasonCode::PrefillNotSupported)
                } else if p.fallback && !r.policy.allow_fallback {
                    Some(ReasonCode::FallbackNotAllowed)
                } else {
                    match breaker.peek(now_ms, &self.config.breaker) {
                        Permit::Open => Some(ReasonCode::CircuitOpen),
                        Permit::ProbeQuotaFull => Some(ReasonCode::CircuitNotAvailable),
                        Permit::Allowed | Permit::Probe => None,
                    }
                }
                .or_else(|| {
                    let cooling = self
                        .state
                        .cooldowns
                        .get(&*p.id)
                        .is_some_and(|&t| now_ms < t);
                    cooling.then_some(ReasonCode::ProviderCoolingDown)
                })
                .or_else(|| {
                    (view.verdict == Verdict::Unhealthy).then_some(ReasonCode::ProviderUnhealthy)
                });
                // Budget exclusions are still scored: a high-risk request whose best provider is
                // unaffordable must refuse rather than fall back to a cheaper guess.
                let budget = self.state.budgets.check(r, est_cost_usd, now_ms).err();
                let score = excluded.is_none().then(|| {
                    score::score(&ScoreInput {
                        view: &view,
                        latency_budget_ms,
                        zero_cost: p.is_zero_cost(),
                        within_cost_limit,
                        fallback: p.fallback,
                        high_risk: r.risk == Risk::High,
                    })
                });
                let mut notes = score::health_codes(&view);
                if !within_cost_limit {
                    notes.push(ReasonCode::CostOverRequestLimit);
                }
                Evaluation {
                    provider: p.id.clone(),
                    fallback: p.fallback,
                    verdict: view.verdict,
                    votes: view.votes,
                    voters: view.voters,
                    cluster_size: view.cluster_size,
                    quorum: view.quorum,
                    availability: view.availability,
                    contract_failure_pct: view.contract_failure_pct,
                    p95_ms: view.p95_ms,
                    est_cost_usd,
                    excluded: excluded.or(budget),
                    score,
                    notes,
                }
            })
            .collect()
    }

    /// Choose a provider and dispatch, or fail. `retry_of` is the phase of the failure that
    /// caused this round, which stays the decision's phase if nothing is left to try.
    fn route(&mut self, s: &mut Session, now_ms: u64, retry_of: Option<Phase>) -> Step {
        let n = s.attempts.len() as u32 + 1;
        let order = self.eligible(s);
        let candidates = self.evaluate(s, &order, now_ms, false);
        let scored = |affordable_only: bool| {
            candidates
                .iter()
                .enumerate()
                .filter(move |(_, e)| !affordable_only || e.excluded.is_none())
                .filter_map(|(i, e)| e.score.map(|sc| (i, sc.total)))
        };
        // On a route, its order decides: the first usable target that is not degraded, else
        // the first usable one. Otherwise the best score.
        let pick = |affordable_only: bool| {
            if s.route.is_none() {
                return score::select(scored(affordable_only));
            }
            let mut usable = scored(affordable_only).map(|(i, _)| i);
            let first = usable.clone().next();
            usable
                .find(|&i| candidates[i].verdict != Verdict::Degraded)
                .or(first)
        };
        let best_overall = pick(false);
        let refused_for_budget = best_overall.is_some_and(|i| candidates[i].excluded.is_some())
            && s.request.risk == Risk::High;
        let chosen = if refused_for_budget { None } else { pick(true) };
        let mut attempt = Attempt {
            n,
            provider: None,
            fallback: false,
            probe: false,
            same_target: false,
            candidates,
            codes: Vec::new(),
            status: None,
            latency_ms: 0,
            cost_usd: 0.0,
            confidence: None,
            defects: Vec::new(),
            delivered: false,
            agent_usage: None,
        };
        let Some(i) = chosen else {
            let exclusions: Vec<ReasonCode> = attempt
                .candidates
                .iter()
                .filter_map(|e| e.excluded)
                .collect();
            let phase = if refused_for_budget {
                Phase::Budget
            } else {
                match exclusions.first().map(|c| c.phase()) {
                    Some(p) if exclusions.iter().all(|c| c.phase() == p) => p,
                    _ => Phase::Routing,
                }
            };
            if phase == Phase::Budget {
                // The best target's shortfall when that is what refused (high risk), else the
                // cheapest target a budget refused.
                let refused = best_overall.filter(|_| refused_for_budget).or_else(|| {
                    (0..attempt.candidates.len())
                        .filter(|&i| {
                            attempt.candidates[i]
                                .excluded
                                .is_some_and(|c| c.phase() == Phase::Budget)
                        })
                        .min_by(|&a, &b| {
                            let cost = |i: usize| attempt.candidates[i].est_cost_usd;
                            cost(a).total_cmp(&cost(b))
                        })
                });
                if let Some(e) = refused.map(|i| &attempt.candidates[i])
                    && let Some(code) = e.excluded
                {
                    s.shortfall =
                        self.state
                            .budgets
                            .shortfall(&s.request, code, e.est_cost_usd, now_ms);
                }
            }
            for c in exclusions {
                if !refused_for_budget || c.phase() == Phase::Budget {
                    push(&mut attempt.codes, c);
                }
            }
            if !refused_for_budget {
                push(&mut attempt.codes, ReasonCode::NoProviderAvailable);
            }
            for &c in &attempt.codes {
                push(&mut s.codes, c);
            }
            s.attempts.push(attempt);
            return self.finish_failure(s, retry_of.unwrap_or(phase), now_ms);
        };
        self.dispatch(s, attempt, i, order[i], now_ms, 0)
    }

    /// Retry target `i` after `delay_ms` (a transient failure), unless by then it is excluded:
    /// then route as usual.
    fn retry_same(
        &mut self,
        s: &mut Session,
        i: usize,
        now_ms: u64,
        delay_ms: u64,
        phase: Phase,
    ) -> Step {
        let at = now_ms + delay_ms;
        let candidates = self.evaluate(s, &[i], at, true);
        if candidates[0].excluded.is_some() {
            return self.route(s, now_ms, Some(phase));
        }
        let attempt = Attempt {
            n: s.attempts.len() as u32 + 1,
            provider: None,
            fallback: false,
            probe: false,
            same_target: true,
            candidates,
            codes: vec![ReasonCode::RetrySameTarget],
            status: None,
            latency_ms: 0,
            cost_usd: 0.0,
            confidence: None,
            defects: Vec::new(),
            delivered: false,
            agent_usage: None,
        };
        push(&mut s.codes, ReasonCode::RetrySameTarget);
        self.dispatch(s, attempt, 0, i, at, delay_ms)
    }

    /// Dispatch `attempt` to target `i` (`candidates[eval_at]` in it) at `now_ms`, after
    /// `delay_ms`.
    fn dispatch(
        &mut self,
        s: &mut Session,
        mut attempt: Attempt,
        eval_at: usize,
        i: usize,
        now_ms: u64,
        delay_ms: u64,
    ) -> Step {
        let n = attempt.n;
        let provider = &self.state.providers[i];
        let permit = breaker_mut(&mut self.state.breakers, &provider.id)
            .acquire(now_ms, &self.config.breaker);
        let probe = permit == Permit::Probe;
        let eval = &attempt.candidates[eval_at];
        let mut codes = std::mem::take(&mut attempt.codes);
        if !attempt.same_target {
            codes.push(ReasonCode::RoutingSelected);
        }
        if s.interrupted {
            s.continued = true;
            codes.push(ReasonCode::StreamContinuedWithPrefill);
        }
        // A fallback: a provider configured as one, or any target of a route after its first.
        let fallback = provider.fallback || (s.route.is_some() && eval_at > 0);
        if fallback {
            codes.push(ReasonCode::FallbackUsed);
        }
        codes.extend(eval.notes.iter().copied());
        if probe {
            codes.push(ReasonCode::CircuitHalfOpenProbe);
        }
        let reserved_usd = eval.est_cost_usd;
        let max_tokens = s
            .request
            .max_tokens
            .unwrap_or(self.config.default_max_tokens);
        self.state.budgets.reserve(&s.request, reserved_usd);
        let hold_usd = if self.state.budgets.applies(&s.request) {
            reserved_usd
        } else {
            0.0
        };
        s.pending = Some(Pending {
            provider: i,
            probe,
            reserved_usd,
            est_tokens: (
                s.est_prompt_tokens,
                u64::from(max_tokens) * u64::from(s.request.n.max(1)),
            ),
        });
        for &c in &codes {
            push(&mut s.codes, c);
        }
        self.touch(i);
        let provider = &self.state.providers[i];
        attempt.codes = codes;
        attempt.provider = Some(provider.id.clone());
        attempt.fallback = fallback;
        attempt.probe = probe;
        s.attempts.push(attempt);
        Step::Dispatch(Dispatch {
            attempt: n,
            provider: provider.id.clone(),
            model: provider.model.clone(),
            max_tokens,
            timeout_ms: self.config.attempt_timeout_ms,
            delay_ms,
            continuation: s.interrupted,
            hold_usd,
        })
    }

    /// Health probes say `target` answers again (its window judged the outage over): an open
    /// breaker (not one tripped on purpose) half-opens now, instead of when its `open_ms` ends,
    /// so the next request probes it. The transition, if one happened.
    pub fn answering_again(&mut self, target: &str) -> Option<Transition> {
        if let Some(t) = self.timeline.as_mut() {
            t.touch(&TargetId::from(target));
        }
        let b = self.state.breakers.get_mut(target)?;
        let Breaker::Open { forced: false, .. } = *b else {
            return None;
        };
        *b = Breaker::HalfOpen {
            probes_in_flight: 0,
            successes: 0,
        };
        Some(Transition::HalfOpened)
    }

    /// Another node counted a failure of call `fp` at `at_ms` (its `Effect::LoopFailure`): count
    /// it here too, so a loop spread over the cluster trips at the same count as one on a
    /// single node. An episode it opens blocks identical calls here, and is returned: its
    /// incident and escalation are the node's whose own failure opened it, unless no node's own
    /// count reached the threshold (their events crossed), when the driver raises it (see
    /// `node::loops`).
    pub fn remote_loop_failure(
        &mut self,
        fp: Fingerprint,
        agent: &str,
        task: &str,
        at_ms: u64,
        probe: bool,
    ) -> Option<loops::Incident> {
        loops::on_failure(
            &mut self.state.loops,
            fp,
            agent,
            task,
            at_ms,
            probe,
            &self.config.loops,
        )
    }

    /// Another node's call `fp` worked: its count and any episode end here too.
    pub fn remote_loop_cleared(&mut self, fp: Fingerprint) {
        loops::on_success(&mut self.state.loops, fp);
    }

    /// The caller is over its rate limit (the driver asks the cluster's count right after
    /// `begin`, before any attempt is made): what it holds (a queue place, a slot, the attempt
    /// waiting to start) goes back, the attempt that was never made and what routing said of it
    /// are forgotten, and it is refused with RATE_LIMIT_EXCEEDED.
    pub fn rate_limited(&mut self, s: &mut Session, now_ms: u64) -> Step {
        self.leave_queue(s);
        if self.release_pending(s).is_some() && s.attempts.len() == 1 {
            s.attempts.clear();
            s.codes.retain(|c| c.phase() == Phase::Admission);
        }
        push(&mut s.codes, ReasonCode::RateLimitExceeded);
        self.finish_failure(s, Phase::Admission, now_ms)
    }

    /// The shared ledger would not hold the dispatched attempt's cost (`code`: the budget that
    /// refused, or BUDGET_STORE_UNREACHABLE when the ledger could not be asked and the request
    /// may not spend on a local share). The attempt is not made. A high-risk request is refused
    /// (and escalated), as a budget refusal in routing would; any other goes on to the next
    /// target (one that costs nothing needs no budget). `None` if no attempt was waiting.
    pub fn refuse_reservation(
        &mut self,
        s: &mut Session,
        code: ReasonCode,
        now_ms: u64,
    ) -> Option<Step> {
        let estimate_usd = s.pending.as_ref().map_or(0.0, |p| p.reserved_usd);
        self.release_pending(s)?;
        if let Some(sf) = self
            .state
            .budgets
            .shortfall(&s.request, code, estimate_usd, now_ms)
        {
            s.shortfall = Some(sf);
        }
        if let Some(a) = s.attempts.last_mut() {
            a.codes.push(code);
        }
        push(&mut s.codes, code);
        Some(if s.request.risk == Risk::High {
            self.finish_failure(s, Phase::Budget, now_ms)
        } else {
            self.route(s, now_ms, Some(Phase::Budget))
        })
    }

    /// The driver's report on the dispatched attempt: the attempt is judged, then the engine
    /// decides what comes next.
    pub fn complete(&mut self, s: &mut Session, g: Generation, now_ms: u64) -> Step {
        let Some(p) = s.pending.take() else {
            // Nothing was dispatched: the driver called out of turn. Fail closed, visibly.
            push(&mut s.codes, ReasonCode::GenerationError);
            return self.finish_failure(s, Phase::Generation, now_ms);
        };
        let judged = self.judge(s, p, &g, now_ms);
        self.touch(p.provider);
        self.after(s, p, &g, judged, now_ms)
    }

    /// Judge attempt `p` by what came back (`g`): charge its cost, move its target's breaker,
    /// record its health sample, reason codes and result on the session. What it failed (the
    /// phase), if anything, and the breaker's transition.
    fn judge(
        &mut self,
        s: &mut Session,
        p: Pending,
        g: &Generation,
        now_ms: u64,
    ) -> (Option<Phase>, Option<Transition>) {
        let State {
            providers,
            breakers,
            cooldowns,
            budgets,
            ..
        } = &mut self.state;
        let provider = &providers[p.provider];
        // Without the upstream's count, an answer is charged the estimate, and so is an attempt
        // that timed out (the upstream may have generated, and billed, all of it); a stream cut
        // after part of its answer, the prompt and that part; a failure the upstream reported,
        // nothing.
        let cost_usd = match g.usage {
            Some(u) => provider.cost_of_usage(&u),
            None if matches!(g.status, GenerationStatus::Ok | GenerationStatus::Timeout) => {
                provider.cost_of(p.est_tokens.0, p.est_tokens.1)
            }
            None if !g.content.is_empty() || !g.tool_calls.is_empty() => provider.cost_of(
                p.est_tokens.0,
                super::request::estimate_answer_tokens(&g.content, &g.tool_calls),
            ),
            None => 0.0,
        };
        // What a mesh agent reported spending on its own model calls comes on top.
        let cost_usd = match &g.agent_usage {
            Some(u) => round_usd(cost_usd + u.charged_usd()),
            None => cost_usd,
        };
        budgets.settle(&s.request, p.reserved_usd, cost_usd);
        s.cost_usd = round_usd(s.cost_usd + cost_usd);

        let mut codes = Vec::new();
        let mut defects = Vec::new();
        // The attempt failed only what the request itself asked for (see the contract check).
        let mut request_made = false;
        let mut confidence = None;
        let cfg = self.config.breaker;
        let breaker = breaker_mut(breakers, &provider.id);
        let (outcome, phase, transition) = match g.status {
            GenerationStatus::Error => {
                codes.push(ReasonCode::GenerationError);
                (
                    Outcome::Error,
                    Some(Phase::Generation),
                    breaker.on_failure(now_ms, p.probe, &cfg),
                )
            }
            GenerationStatus::Timeout => {
                codes.push(ReasonCode::GenerationTimeout);
                (
                    Outcome::Timeout,
                    Some(Phase::Generation),
                    breaker.on_failure(now_ms, p.probe, &cfg),
                )
            }
            status @ (GenerationStatus::Rejected
            | GenerationStatus::ContextLength
            | GenerationStatus::ContentPolicy) => {
                // The request's own doing: no breaker failure and (below) no health sample.
                codes.push(match status {
                    GenerationStatus::Rejected => ReasonCode::ProviderRejectedRequest,
                    GenerationStatus::ContextLength => ReasonCode::ContextLengthExceeded,
                    _ => ReasonCode::ContentPolicyRefusal,
                });
                if status == GenerationStatus::ContextLength {
                    // Too long for this model: only a larger window may take it.
                    s.context_over = s.context_over.max(provider.context_window);
                }
                if p.probe {
                    breaker.release_probe();
                }
                (Outcome::Error, Some(Phase::Generation), None)
            }
            GenerationStatus::LocalResources => {
                // The node's shortage, not the target's failure: no breaker failure and (below)
                // no health sample.
                codes.push(ReasonCode::LocalResourceExhausted);
                if p.probe {
                    breaker.release_probe();
                }
                (Outcome::Error, Some(Phase::Generation), None)
            }
            GenerationStatus::Unauthorized => {
                codes.push(ReasonCode::UpstreamAuthFailed);
                s.misconfigured = Some(provider.id.clone());
                (
                    Outcome::Error,
                    Some(Phase::Generation),
                    breaker.on_failure(now_ms, p.probe, &cfg),
                )
            }
            GenerationStatus::RateLimited => {
                codes.push(ReasonCode::RateLimited);
                if p.probe {
                    breaker.release_probe();
                }
                let until_ms = now_ms
                    + g.retry_after_ms
                        .unwrap_or(self.config.default_retry_after_ms);
                cooldowns.insert(provider.id.to_string(), until_ms);
                s.effects.push(Effect::Cooldown {
                    provider: provider.id.clone(),
                    until_ms,
                });
                (Outcome::Error, Some(Phase::Generation), None)
            }
            GenerationStatus::Ok => {
                // A tool-call turn is held to the tools the request declared (its arguments JSON
                // that fits the tool's schema), not to a text contract.
                let (tool_turn, checked) = check_answer(s, g);
                match checked {
                    Err(d) => {
                        codes.push(ReasonCode::SemanticValidationFailed);
                        for x in &d {
                            push(&mut codes, x.code);
                        }
                        defects = d;
                        // Held to what the request brought (its own contract, its own tools'
                        // schemas): the answer fails the request, never the target's breaker
                        // or health.
                        let t = if tool_turn || s.own_contract {
                            request_made = true;
                            if p.probe {
                                breaker.release_probe();
                            }
                            None
                        } else {
                            breaker.on_failure(now_ms, p.probe, &cfg)
                        };
                        (Outcome::ContractFailure, Some(Phase::Semantic), t)
                    }
                    Ok(c) => {
                        // The provider did its job: quality and cost verdicts are about this request,
                        // not the provider, so they must not count against its breaker.
                        confidence = c;
                        let t = breaker.on_success(p.probe, &cfg);
                        let failed = gates(s, c, &self.config);
                        codes.extend(failed.map(|(code, _)| code));
                        (Outcome::Success, failed.map(|(_, phase)| phase), t)
                    }
                }
            }
        };
        match transition {
            Some(Transition::Opened) => codes.push(ReasonCode::CircuitOpened),
            Some(Transition::Closed) => codes.push(ReasonCode::CircuitClosed),
            _ => {}
        }
        if let Some(t) = transition {
            s.effects.push(Effect::Breaker {
                provider: provider.id.clone(),
                transition: t,
            });
        }
        if !g.status.says_nothing_of_target() && !request_made {
            s.effects.push(Effect::HealthSample {
                provider: provider.id.clone(),
                outcome,
                // A stream's health is its pace, not how long its answer is.
                latency_ms: g.pace_ms.unwrap_or(g.latency_ms),
            });
        }
        for &c in &codes {
            push(&mut s.codes, c);
        }
        if let Some(a) = s.attempts.last_mut() {
            a.codes.extend(codes);
            a.status = Some(g.status);
            a.latency_ms = g.latency_ms;
            a.cost_usd = cost_usd;
            a.agent_usage = g.agent_usage.clone();
            a.confidence = confidence;
            a.defects = defects;
        }
        (phase, transition)
    }

    /// What comes after attempt `p`, judged `(phase, transition)`: accepted, retried on the same
    /// target or another, or finished as a failure.
    fn after(
        &mut self,
        s: &mut Session,
        p: Pending,
        g: &Generation,
        (phase, transition): (Option<Phase>, Option<Transition>),
        now_ms: u64,
    ) -> Step {
        let Some(phase) = phase else {
            return self.finish(s, DecisionOutcome::Accepted, Phase::Accepted, now_ms, None);
        };
        let max_attempts = s
            .request
            .policy
            .max_attempts
            .unwrap_or(self.config.max_attempts.get(s.request.risk));
        let tries = s.attempts.iter().filter(|a| !a.same_target).count() as u32;
        let retry_block = if phase == Phase::Cost
            || matches!(
                g.status,
                GenerationStatus::Rejected | GenerationStatus::ContentPolicy
            ) {
            // A retry would only spend more: the request itself was refused.
            Some(None)
        } else if g.status == GenerationStatus::LocalResources {
            // Another target needs the same descriptors and ports: the caller retries later.
            Some(None)
        } else if s.caller_gone {
            Some(Some(ReasonCode::ClientDisconnected)) // nobody would read the answer
        } else if s.request.is_tool_call() && !s.request.idempotent {
            // A tool that failed may have done part of its work: it runs again only if it says
            // it may. Its failure is its answer, for the agent's model to read.
            Some(None)
        } else if g.status == GenerationStatus::Timeout && !s.request.idempotent {
            Some(Some(ReasonCode::RetryNotSafe))
        } else if s.continued || (s.delivering && !s.interrupted) {
            // Part of this answer is with the caller: a whole new one cannot follow it (and a
            // continuation that broke too is not continued again).
            Some(None)
        } else {
            match self.same_target_delay(s, g, transition, now_ms) {
                Ok(delay) => {
                    push(&mut s.codes, ReasonCode::RetryScheduled);
                    return self.retry_same(s, p.provider, now_ms, delay, phase);
                }
                Err(over_budget) => {
                    if over_budget {
                        push(&mut s.codes, ReasonCode::RetryWaitOverBudget);
                    }
                    (tries >= max_attempts).then_some(Some(ReasonCode::RetriesExhausted))
                }
            }
        };
        match retry_block {
            Some(code) => {
                if let Some(c) = code {
                    push(&mut s.codes, c);
                }
                self.finish_failure(s, phase, now_ms)
            }
            None => {
                push(&mut s.codes, ReasonCode::RetryScheduled);
                self.route(s, now_ms, Some(phase))
            }
        }
    }

    /// How long to wait before retrying a transient failure on the same target, if it is to be
    /// retried there: a 5xx or a connection refused or reset (nothing was answered, so resending
    /// is safe) after a backoff with jitter, or a 429 after its Retry-After when that is within
    /// the cap. Not after a timeout (a silent target is left for the next), not once its breaker
    /// opened, not past the retries allowed, and not past the request's latency budget: a
    /// backoff within the budget (the request's, else the default), a Retry-After within the
    /// cap unless the request set a budget it does not fit. `Err(true)`: only the budget
    /// forbade the wait.
    fn same_target_delay(
        &self,
        s: &Session,
        g: &Generation,
        transition: Option<Transition>,
        now_ms: u64,
    ) -> Result<u64, bool> {
        let cfg = &self.config;
        if s.interrupted {
            return Err(false); // never restarted from scratch
        }
        let last = s.attempts.last().ok_or(false)?;
        let retried = s
            .attempts
            .iter()
            .rev()
            .take_while(|a| a.same_target)
            .count() as u32;
        if retried >= cfg.same_target_retries || transition == Some(Transition::Opened) {
            return Err(false);
        }
        let delay = match g.status {
            GenerationStatus::Error => {
                // Deterministic jitter in [50%, 100%] of the doubled backoff, from the request
                // and the attempt (the same inputs give the same decision).
                let base = cfg.retry_backoff_ms.saturating_mul(1 << retried.min(10));
                let h = xxhash_rust::xxh3::xxh3_64(
                    format!("{}:{}", s.fingerprint.0, last.n).as_bytes(),
                );
                base / 2 + h % (base / 2 + 1)
            }
            GenerationStatus::RateLimited => {
                let wait = g.retry_after_ms.unwrap_or(cfg.default_retry_after_ms);
                if wait > cfg.max_retry_after_ms {
                    return Err(false);
                }
                wait
            }
            _ => return Err(false),
        };
        let ends_ms = (now_ms + delay).saturating_sub(s.began_ms);
        match s.request.latency_budget_ms {
            Some(budget) if ends_ms > budget => Err(true),
            // The default budget holds any Retry-After within the cap: the cap is the wait
            // oam promises to honour.
            None if ends_ms > cfg.default_latency_budget_ms
                && g.status != GenerationStatus::RateLimited =>
            {
                Err(true)
            }
            _ => Ok(delay),
        }
    }

    fn finish_failure(&mut self, s: &mut Session, phase: Phase, now_ms: u64) -> Step {
        if s.interrupted {
            push(&mut s.codes, ReasonCode::StreamEndedWithError);
        }
        let mut phase = phase;
        let mut incident = None;
        let anonymous = s.request.agent == crate::core::request::ANONYMOUS;
        // The node ran short of its own resources: the call itself is not known to fail.
        let node_short =
            s.attempts.last().and_then(|a| a.status) == Some(GenerationStatus::LocalResources);
        if !anonymous && !node_short && !matches!(phase, Phase::Admission | Phase::Loop) {
            incident = loops::on_failure(
                &mut self.state.loops,
                s.fingerprint,
                &s.request.agent,
                &s.request.task,
                now_ms,
                s.loop_probe,
                &self.config.loops,
            );
            s.effects.push(Effect::LoopFailure {
                fingerprint: s.fingerprint,
                agent: s.request.agent.clone(),
                task: s.request.task.clone(),
                probe: s.loop_probe,
            });
            if incident.is_some() {
                push(&mut s.codes, ReasonCode::AgentLoopDetected);
                phase = Phase::Loop;
            }
        }
        // The budget that refused (if one did, and it is in the phase that ended the request):
        // escalated once per exhaustion episode.
        let refusing = s.shortfall.as_ref().filter(|_| phase == Phase::Budget);
        let refusing_budget = refusing.and_then(|sf| self.state.budgets.of_shortfall(sf));
        let budget_escalated = refusing_budget.is_some_and(|b| b.refused_at_ms.is_some());
        let budget_escalates =
            refusing_budget.is_some_and(|b| b.on_exceeded == super::budget::OnExceeded::Escalate);
        let outcome = escalation::Concluded {
            request: &s.request,
            phase,
            codes: &s.codes,
            new_loop_incident: incident.as_ref().map(|i| i.id.as_str()),
            node: &self.state.cluster.self_id,
            serial: self.escalations,
            budget_escalated,
            budget_escalates,
        };
        let mut escalation = escalation::rule(&outcome)
            .map(|(reason, action)| escalation::build(&outcome, reason, action, now_ms));
        self.escalations += u64::from(escalation.is_some());
        if let Some(sf) = refusing
            && let Some(e) = escalation
                .as_mut()
                .filter(|e| e.reason_codes.last() == Some(&ReasonCode::EscalatedBudgetExhausted))
            && let Some(b) = self.state.budgets.of_shortfall_mut(sf)
        {
            b.refused_at_ms = Some(now_ms);
            // The episode's one name, the same on every node that meets it.
            if let Some(since) = b.since_ms {
                e.id = escalation::budget_episode(&sf.owner(), since);
            }
        }
        if let Some(e) = &escalation {
            push(&mut s.codes, ReasonCode::HumanAttentionRequired);
            push(
                &mut s.codes,
                *e.reason_codes
                    .last()
                    .unwrap_or(&ReasonCode::HumanAttentionRequired),
            );
        }
        let verdict = if escalation.is_some() {
            DecisionOutcome::Escalated
        } else {
            DecisionOutcome::Rejected
        };
        let step = self.finish(s, verdict, phase, now_ms, escalation);
        match step {
            Step::Done(mut d) => {
                d.incident = incident;
                Step::Done(d)
            }
            other => other,
        }
    }

    /// An operator's escalation when a target refused oam's credentials during this request,
    /// once per target per `MISCONFIGURED_ESCALATION_MS`, whether or not the request was served.
    fn misconfigured(&mut self, s: &mut Session, phase: Phase, now_ms: u64) -> Option<Escalation> {
        let target = s.misconfigured.take()?;
        if !self.misconfigured_anew(&target, now_ms) {
            return None;
        }
        for c in [
            ReasonCode::HumanAttentionRequired,
            ReasonCode::EscalatedUpstreamMisconfigured,
        ] {
            push(&mut s.codes, c);
        }
        let outcome = escalation::Concluded {
            request: &s.request,
            phase,
            codes: &s.codes,
            new_loop_incident: None,
            node: &self.state.cluster.self_id,
            serial: self.escalations,
            budget_escalated: false,
            budget_escalates: false,
        };
        self.escalations += 1;
        let mut e = escalation::build(
            &outcome,
            ReasonCode::EscalatedUpstreamMisconfigured,
            Action::HumanReview,
            now_ms,
        );
        e.id = escalation::config_episode(&target, now_ms);
        e.target = Some(target.to_string());
        Some(e)
    }

    /// Is `target`'s refusal of oam's credentials at `now_ms` news, not covered by an escalation
    /// of the last `MISCONFIGURED_ESCALATION_MS`? Noted, if so.
    fn misconfigured_anew(&mut self, target: &TargetId, now_ms: u64) -> bool {
        if self
            .state
            .misconfigured
            .get(&**target)
            .is_some_and(|&until| now_ms < until)
        {
            return false;
        }
        self.state
            .misconfigured
            .insert(target.to_string(), now_ms + MISCONFIGURED_ESCALATION_MS);
        if let Some(t) = self.timeline.as_mut() {
            t.touch(target);
        }
        true
    }

    /// A health probe found `target` refusing oam's credentials (`detail`: what it said) at
    /// `now_ms`: the configuration fault's escalation, as a request's refusal raises it and
    /// within the same once-per-target window, so that a target the probes mark down before
    /// any request reaches it is still told. None: one was raised within the window (or there
    /// is no such target).
    pub fn refused_to_probe(
        &mut self,
        target: &str,
        detail: Option<String>,
        now_ms: u64,
    ) -> Option<Escalation> {
        let id = self
            .state
            .providers
            .iter()
            .find(|p| *p.id == *target)?
            .id
            .clone();
        if !self.misconfigured_anew(&id, now_ms) {
            return None;
        }
        let e = escalation::of_refused_credentials(target, detail, now_ms);
        self.escalations += 1;
        Some(e)
    }

    fn finish(
        &mut self,
        s: &mut Session,
        outcome: DecisionOutcome,
        phase: Phase,
        now_ms: u64,
        escalation: Option<Escalation>,
    ) -> Step {
        if s.holds_slot {
            s.holds_slot = false;
            self.release_slot(&s.request);
        }
        let escalation = escalation.or_else(|| self.misconfigured(s, phase, now_ms));
        let accepted = outcome == DecisionOutcome::Accepted;
        if accepted {
            push(&mut s.codes, ReasonCode::Accepted);
            if loops::on_success(&mut self.state.loops, s.fingerprint) {
                s.effects.push(Effect::LoopCleared {
                    fingerprint: s.fingerprint,
                });
            }
        }
        let last = s
            .attempts
            .last()
            .filter(|a| accepted && a.provider.is_some());
        Step::Done(Box::new(Decision {
            request_id: s.request.id.clone(),
            agent: s.request.agent.clone(),
            task: s.request.task.clone(),
            fingerprint: s.fingerprint,
            route: s.route.clone(),
            outcome,
            phase,
            reason_codes: std::mem::take(&mut s.codes),
            provider: last.and_then(|a| a.provider.clone()),
            fallback: last.is_some_and(|a| a.fallback),
            confidence: last.and_then(|a| a.confidence),
            cost_usd: s.cost_usd,
            attempts: std::mem::take(&mut s.attempts),
            escalation,
            incident: None,
            effects: std::mem::take(&mut s.effects),
            decided_at_ms: now_ms,
            shortfall: s.shortfall.take(),
        }))
    }
}

/// Whether an answer holds: a tool-call turn to the tools the request declared (each call's
/// arguments JSON that fits its tool's schema), any other answer to the session's contract.
/// Whether it is a tool-call turn, and the contract's confidence or the defects found.
fn check_answer(s: &Session, g: &Generation) -> (bool, Result<Option<f64>, Vec<Defect>>) {
    let tool_turn = g.finish_reason.as_deref() == Some("tool_calls") || !g.tool_calls.is_empty();
    let checked = if tool_turn {
        let defects = if s.request.tools.is_empty() {
            Vec::new()
        } else {
            super::contract::check_tool_calls(&s.request.tools, &g.tool_calls)
        };
        if defects.is_empty() {
            Ok(None)
        } else {
            Err(defects)
        }
    } else {
        match &s.contract {
            Some(c) => c.check(&g.content, g.finish_reason.as_deref()),
            None => Ok(None),
        }
    };
    (tool_turn, checked)
}

/// The quality and cost gates on an answer that holds (its `confidence`, the session's cost):
/// the first one it fails, if any. About this request, never the target.
fn gates(s: &Session, confidence: Option<f64>, cfg: &Config) -> Option<(ReasonCode, Phase)> {
    let threshold = s
        .request
        .policy
        .min_confidence
        .unwrap_or(cfg.quality.get(s.request.risk));
    if confidence.is_some_and(|c| c < threshold) {
        Some((ReasonCode::QualityBelowThreshold, Phase::Quality))
    } else if s
        .request
        .max_cost_usd
        .is_some_and(|m| s.cost_usd > m + 1e-12)
    {
        Some((ReasonCode::CostLimitExceeded, Phase::Cost))
    } else {
        None
    }
}

#[cfg(test)]
#[path = "pipeline_tests.rs"]
pub(crate) mod tests;
