//! A request's way through the node, in stages every protocol shares: decode (the protocol's
//! own module) -> authenticate -> begin (admitted or queued by the engine) -> drive (the engine's
//! steps: wait for a slot, reserve budget, call targets) -> respond -> conclude (health
//! samples, metrics, the decision on the bus and in the log). HTTP (`http`) and NATS (`nats`)
//! are thin adapters over `execute`.

use super::Node;
use super::api::ClientApi;
use super::api::openai::{self, BadRequest, bad, header, json_bytes, param_of};
use super::exchange::Passthrough;
use crate::clock::now_ms;
use crate::core::pipeline::{Decision, Effect, Session, Step};
use crate::core::reason::ReasonCode;
use crate::core::record::{Call, Recorder};
use crate::core::request::{GenerationStatus, Request};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What a request asks for: an answer in a client API, relayed live as it arrives when `live`
/// and it streams (HTTP; else answered whole); or embeddings.
#[derive(Clone, Copy)]
pub(crate) enum Asks {
    Answer {
        api: &'static dyn ClientApi,
        live: bool,
    },
    Embeddings,
    /// One tool call (`api::mcp::call_body`), answered as its `tools/call` result.
    Tool,
}

/// Build the core request from the body and headers: the request, and whether it asked for
/// server-sent events (`"stream": true`). Bytes from outside: property-tested below.
pub(crate) fn to_request(
    node: &Node,
    body: &[u8],
    h: &HeaderMap,
    client: Option<&str>,
    asks: &Asks,
) -> Result<(Request, bool, Passthrough), BadRequest> {
    let new_id = || node.serving.next_request_id(&node.id);
    let mut r = match *asks {
        Asks::Answer { api, .. } => {
            let (request, stream, pass) = api.decode_request(&node.cfg, body, h, &new_id)?;
            match pass.native {
                // Bound to Messages targets, sent as it came.
                Some(_) => (request, stream, pass),
                None => bound(&node.cfg, (request, stream, pass)),
            }
        }
        Asks::Embeddings => super::api::embeddings::decode(&node.cfg, body, h, new_id)?,
        Asks::Tool => super::api::mcp::decode(body, h, &new_id)?,
    };
    if let Some(id) = client {
        // Who holds the key is who calls, whatever the request says.
        r.0.agent = id.to_string();
        r.0.team = node.cfg.team_of(id).map(String::from);
    }
    Ok(r)
}

/// A request Messages cannot carry goes only to chat targets (where there are others).
fn bound(
    cfg: &super::config::NodeConfig,
    (mut request, stream, pass): (Request, bool, Passthrough),
) -> (Request, bool, Passthrough) {
    if cfg.speaks_anthropic()
        && super::upstream::not_carried(
            &pass.turns,
            &pass.sampling,
            &pass.extra,
            request.response_format.as_ref(),
        )
        .is_some()
    {
        request.bound_to = Some(crate::core::request::Api::Openai);
    }
    (request, stream, pass)
}

/// The key a request presents (`Authorization: Bearer <key>`), if any.
pub(crate) fn presented_key(h: &HeaderMap) -> Option<&str> {
    header(h, "authorization")
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
}

/// With `[[client]]`s configured, the client whose key the request bears
/// (`Authorization: Bearer <key>`), or the 401 that refuses it; without, `Ok(None)`: anyone.
pub(crate) fn authenticate<'a>(
    node: &'a Node,
    h: &HeaderMap,
) -> Result<Option<&'a str>, Box<Answer>> {
    if node.cfg.client_keys.is_empty() {
        return Ok(None);
    }
    let why = match presented_key(h) {
        Some(key) => match node.cfg.client_with_key(key) {
            Some(id) => return Ok(Some(id)),
            // Anthropic's clients send the key in `x-api-key` (read as a bearer key).
            None if header(h, "x-api-key").is_some_and(|k| k.trim() == key) => {
                "the key in the x-api-key header is not one this gateway knows"
            }
            None => "the key in the Authorization header is not one this gateway knows",
        },
        None => {
            "this gateway needs an API key: send Authorization: Bearer <key> (or x-api-key: <key>)"
        }
    };
    node.metrics.unauthorized();
    let mut a = bad_request(
        node,
        h,
        BadRequest {
            param: None,
            message: why.into(),
            not_found: false,
        },
    );
    a.status = StatusCode::UNAUTHORIZED;
    a.body = json_bytes(&openai::error_body(
        why,
        "invalid_request_error",
        None,
        "invalid_api_key",
    ));
    a.phase = "unauthorized".into();
    Err(Box::new(a))
}

/// What the data plane answers, before it is turned into HTTP or a NATS reply.
pub(crate) struct Answer {
    /// The request asked for server-sent events (HTTP only; the NATS reply is always JSON).
    pub stream: bool,
    pub status: StatusCode,
    /// JSON, written out.
    pub body: bytes::Bytes,
    pub request_id: String,
    pub phase: String,
    pub reasons: String,
    /// The target that answered (`X-OAM-Target`).
    pub target: String,
    /// A stream relayed live: the response is already under way (HTTP only).
    pub live: Option<Response>,
    /// Why a stream asked for was not relayed live but checked whole, then released:
    /// `contract` (its answer is held to one) or `native` (a Messages request sent as it came).
    pub buffered: Option<&'static str>,
    /// The request was a Messages request sent to a Messages target as it came: a body that
    /// is a message is that target's own, written out as it is.
    pub native: bool,
}

impl Answer {
    /// A stream relayed live: its response is already under way.
    fn live(resp: Response) -> Answer {
        Answer {
            stream: true,
            status: StatusCode::OK,
            body: bytes::Bytes::new(),
            request_id: String::new(),
            phase: String::new(),
            reasons: String::new(),
            target: String::new(),
            live: Some(resp),
            buffered: None,
            native: false,
        }
    }
}

/// A request on its way through the engine. Whatever way its driver ends (finished, or the
/// task dropped), the guard gives back what the session still holds: its queue place or slot,
/// and budget reserved for an attempt under way.
pub(crate) struct Flight {
    pub node: Arc<Node>,
    pub session: Session,
    /// What the shared budget ledger holds for the attempt under way.
    pub hold: Option<super::ledger::Hold>,
    /// The request's record for the decision log, as it goes (none when the log is off).
    pub recorder: Option<Recorder>,
    /// Its OpenTelemetry spans, as they go (none when export is off).
    pub trace: Option<super::otlp::OpenSpans>,
    /// Its settlements held until its record is written (`ledger::Unsent`: they go to the
    /// ledger when dropped, with the flight at the latest).
    pub unsent: Vec<super::ledger::Unsent>,
}

impl Flight {
    pub(crate) fn new(node: Arc<Node>, session: Session, recorder: Option<Recorder>) -> Flight {
        Flight {
            node,
            session,
            hold: None,
            recorder,
            trace: None,
            unsent: Vec::new(),
        }
    }

    /// Tell the engine `call` about this request (recorded with the state it saw); if it ended
    /// the attempt under way, the attempt's ledger hold settles with what it cost.
    pub(crate) fn call(&mut self, call: Call) -> Option<Step> {
        let before = self.session.cost_usd();
        let ended = matches!(call, Call::Complete { .. } | Call::Withdraw);
        if let (Some(t), Call::Complete { generation }) = (self.trace.as_mut(), &call) {
            t.completed(generation, self.node.otlp.content());
        }

        let now = now_ms();
        let Flight {
            node,
            session,
            recorder,
            ..
        } = self;
        let out = node.pipeline.with(|e| {
            if let Some(r) = recorder.as_mut() {
                r.call(e, &call, now);
                node.log.timeline(e);
            }
            // A failed call is the target's last failure (one that refused the request itself
            // says nothing of the target).
            if let Call::Complete { generation: g } = &call
                && g.status != GenerationStatus::Ok
                && !g.status.says_nothing_of_target()
                && let Some(target) = e.dispatched_to(session)
            {
                node.health.failed(target, "request", g);
            }
            e.apply(session, call, now)
        });
        if let Some((charge, unsent)) = super::ledger::settle_after(
            &self.node.ledger,
            &mut self.hold,
            &self.session,
            before,
            ended,
        ) && let Some(r) = self.recorder.as_mut()
        {
            r.charged(charge);
            // Under a durable log the record goes first (dropped, a settlement is sent).
            if self.node.log.durable() {
                self.unsent.push(unsent);
            }
        }
        if let (Some(t), Some(Step::Dispatch(d))) = (self.trace.as_mut(), &out) {
            t.dispatched(d.delay_ms);
        }
        out
    }

    /// A call that always gives the next step (`Dequeue`, `Complete`).
    pub(crate) fn next(&mut self, call: Call) -> Step {
        // `apply` gives a step for these; were it not to, the request would wait in vain:
        // end it closed instead.
        match self.call(call) {
            Some(step) => step,
            None => self
                .call(Call::Complete {
                    generation: crate::core::request::Generation::failed(
                        GenerationStatus::Error,
                        0,
                    ),
                })
                .unwrap_or(Step::Queued),
        }
    }

    /// The request's record as far as it goes (finished with its decision by `conclude`).
    pub(crate) fn recorder(&mut self) -> Option<Recorder> {
        self.recorder.take()
    }
}

/// Whoever asked for a request: its going away ends the driver's waits.
pub(crate) trait Requester {
    /// Resolves once the asker is gone.
    fn gone(&self) -> impl Future<Output = ()> + Send;
}

/// A caller of the data plane, cancelled when it goes away (`http`, `nats`).
impl Requester for CancellationToken {
    fn gone(&self) -> impl Future<Output = ()> + Send {
        self.cancelled()
    }
}

/// The reader of a relayed stream (`live`).
impl<T: Send> Requester for tokio::sync::mpsc::Sender<T> {
    fn gone(&self) -> impl Future<Output = ()> + Send {
        self.closed()
    }
}

/// What the driver's waits for one request know: the slot it may be queued for, until when it
/// waits for one, and the time spent waiting (in the queue, in backoffs, on upstreams: not
/// oam's own).
pub(crate) struct Waits {
    pub granted: Option<tokio::sync::oneshot::Receiver<()>>,
    pub queue_deadline: tokio::time::Instant,
    pub waited: Duration,
}

/// Where the driver leaves a request: decided, or with an attempt to make now.
pub(crate) enum Next {
    Decided(Box<Decision>),
    Call(crate::core::pipeline::Dispatch),
}

impl Flight {
    /// The one driver of the engine's steps, for whole answers and relayed streams alike:
    /// from `step`, wait for a queue slot (until `waits.queue_deadline`), a backoff, the
    /// ledger's hold, until the engine decides or asks for an attempt to be made now. The
    /// asker's leaving ends every wait: a queued request leaves the queue at once, an attempt
    /// waiting on its backoff is not made.
    pub(crate) async fn advance(
        &mut self,
        mut step: Step,
        waits: &mut Waits,
        asker: &impl Requester,
    ) -> Next {
        loop {
            step = match step {
                Step::Done(d) => return Next::Decided(d),
                Step::Queued => {
                    let ticket = self.session.ticket();
                    let Some(rx) = waits.granted.take() else {
                        // Only `begin` queues, and it registered the waiter; fail closed.
                        step = self.next(Call::Abandon);
                        continue;
                    };
                    let queued = std::time::Instant::now();
                    let gave_up = tokio::select! {
                        // A slot was handed to this request.
                        _ = rx => None,
                        () = tokio::time::sleep_until(waits.queue_deadline) => Some(false),
                        () = asker.gone() => Some(true),
                    };
                    waits.waited += queued.elapsed();
                    let Some(asker_left) = gave_up else {
                        step = self.next(Call::Dequeue);
                        continue;
                    };
                    // Leaving the queue: its waker goes too (a grant that raced with this is
                    // handed on by the engine).
                    if let Some(t) = ticket {
                        self.node.pipeline.forget_waiter(t);
                    }
                    match self.call(if asker_left {
                        Call::CallerGone
                    } else {
                        Call::Abandon
                    }) {
                        Some(next) => next,
                        // Not queued any more (cannot happen after `begin` queued it): go on
                        // as the engine says.
                        None => self.next(Call::Dequeue),
                    }
                }
                Step::Dispatch(d) => {
                    if d.delay_ms > 0 {
                        let backoff = std::time::Instant::now();
                        let slept = tokio::select! {
                            () = tokio::time::sleep(Duration::from_millis(d.delay_ms)) => true,
                            () = asker.gone() => false,
                        };
                        waits.waited += backoff.elapsed();
                        // The asker left during the wait: the attempt is not made (with nothing
                        // waiting to start there is nothing to withdraw, and the call goes
                        // ahead).
                        if !slept && let Some(Step::Done(d)) = self.call(Call::Withdraw) {
                            return Next::Decided(d);
                        }
                    }
                    // A shared budget holds the attempt's cost first (or the ledger says what
                    // next).
                    let node = self.node.clone();
                    if d.hold_usd > 0.0
                        && let Some(next) = node.ledger.reserve(self, d.hold_usd).await
                    {
                        next
                    } else {
                        return Next::Call(d);
                    }
                }
            };
        }
    }

    /// The attempt under way ended with `g`; the asker left meanwhile if `asker_left` (its
    /// answer is still judged and paid for, but nothing more is tried for nobody).
    pub(crate) fn completed(
        &mut self,
        g: crate::core::request::Generation,
        asker_left: bool,
    ) -> Step {
        if asker_left {
            self.call(Call::CallerGone);
        }
        self.next(Call::Complete { generation: g })
    }

    /// The asker left before the attempt made for it answered: the attempt is withdrawn and
    /// the request ends.
    pub(crate) fn withdraw(&mut self) -> Step {
        // Nothing waiting (cannot be, after a dispatch): `next` ends it closed.
        match self.call(Call::Withdraw) {
            Some(step) => step,
            None => self.next(Call::Abandon),
        }
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        if let Some(ticket) = self.session.ticket() {
            self.node.pipeline.forget_waiter(ticket);
        }
        // A decided request holds nothing: no lock taken for it.
        if self.session.holds_anything() {
            self.node
                .pipeline
                .with(|e| e.drop_session(&mut self.session));
        }
        if let Some(h) = self.hold.take() {
            let _ = self.node.ledger.settle(h, 0.0);
        }
    }
}

/// A request admitted to the pipeline.
pub(crate) struct Begun {
    flight: Flight,
    /// The engine's first step.
    step: Step,
    /// The slot it waits for, when queued.
    granted: Option<tokio::sync::oneshot::Receiver<()>>,
    /// It asked for server-sent events.
    stream: bool,
    /// What goes to the upstream unchanged.
    pass: Passthrough,
}

/// Authenticate, parse and begin a request, or the answer that refuses it. A function of its
/// own so that none of its temporaries is kept in the request's future (moved whole into its
/// box) across an await.
pub(crate) fn begin(
    node: &Arc<Node>,
    body: &[u8],
    headers: &HeaderMap,
    asks: &Asks,
) -> Result<Begun, Box<Answer>> {
    let client = authenticate(node, headers)?;
    let (request, stream, pass) = to_request(node, body, headers, client, asks)
        .map_err(|e| Box::new(bad_request(node, headers, e)))?;
    let logging = node.log.enabled();
    let traceparent = header(headers, "traceparent");
    let trace = node.otlp.begin(&request, stream, traceparent);
    let begun = node.pipeline.with(|e| {
        let now = now_ms();
        let recorder = logging.then(|| {
            let r = Recorder::begin(e, &request, now);
            node.log.timeline(e);
            r
        });
        e.begin(request, now).map(|(session, step)| {
            let granted = session.ticket().map(|t| node.pipeline.wait_for_slot(t));
            (Flight::new(node.clone(), session, recorder), step, granted)
        })
    });
    match begun {
        Ok((mut flight, step, granted)) => {
            flight.trace = trace;
            if let (Some(t), Step::Dispatch(d)) = (flight.trace.as_mut(), &step) {
                t.dispatched(d.delay_ms);
            }
            Ok(Begun {
                flight,
                step,
                granted,
                stream,
                pass,
            })
        }
        Err(e) => {
            let param = param_of(e.field);
            Err(Box::new(bad_request(node, headers, bad(param, e.message))))
        }
    }
}

/// Run one request through the pipeline, calling providers as it directs. `caller` is
/// cancelled when whoever asked went away: a queued request then leaves the queue at once, and
/// one with an attempt under way lets it finish but makes no further attempt.
pub(crate) async fn execute(
    node: &Arc<Node>,
    body: &[u8],
    headers: &HeaderMap,
    caller: CancellationToken,
    asks: Asks,
) -> Answer {
    let started = std::time::Instant::now();
    let Begun {
        mut flight,
        mut step,
        granted,
        stream,
        pass,
    } = match begin(node, body, headers, &asks) {
        Ok(begun) => begun,
        Err(refused) => return *refused,
    };
    // A streaming request held to no contract is relayed as it arrives; one under a contract is
    // checked whole first, then released.
    let native = pass.native.is_some();
    let live = match asks {
        Asks::Answer { api, live: true } if !native => {
            Some(api).filter(|_| stream && !flight.session.contracted())
        }
        // Checked whole, then sent as the API's events.
        _ => None,
    };
    let buffered = match () {
        _ if !stream || live.is_some() => None,
        _ if native => Some("native"),
        _ => Some("contract"),
    };
    let embeddings = matches!(asks, Asks::Embeddings);
    let limits = node
        .cfg
        .deadlines(flight.session.request().model.as_deref());
    let mut last = None;
    // A caller with a rate limit is admitted by the cluster's count before anything else.
    let rated = match &step {
        Step::Done(_) => None,
        _ => Box::pin(rate_limit(node, &mut flight, &mut step)).await,
    };
    let mut used_tokens = 0;
    // A request that states a latency budget waits for a slot no longer than that.
    let queue_ms = flight
        .session
        .request()
        .latency_budget_ms
        .map_or(node.cfg.node.queue_timeout_ms, |b| {
            b.min(node.cfg.node.queue_timeout_ms)
        });
    let mut waits = Waits {
        granted,
        queue_deadline: tokio::time::Instant::now() + Duration::from_millis(queue_ms),
        waited: Duration::ZERO,
    };
    let decision = loop {
        let d = match flight.advance(step, &mut waits, &caller).await {
            Next::Decided(d) => break *d,
            Next::Call(d) => d,
        };
        if let Some(wire) = live {
            // Boxed, like every rarely taken large future here: the request's future is moved
            // whole into its box, so it stays the size of the common path.
            let calling = std::time::Instant::now();
            let opened = tokio::select! {
                o = Box::pin(super::live::open(node, &d, &pass, None, limits)) => Some(o),
                () = caller.cancelled() => None,
            };
            waits.waited += calling.elapsed();
            match opened {
                // The caller left before the first event: the upstream call is dropped (no
                // more is generated, and paid for, for nobody) and the request ends.
                None => step = flight.withdraw(),
                Some(super::live::Open::Started(first)) => {
                    if let Some(t) = flight.trace.as_mut() {
                        t.first_chunk();
                    }
                    let own = started.elapsed().saturating_sub(waits.waited);
                    node.metrics.overhead("stream", own.as_secs_f64());
                    let target = d.provider.to_string();
                    let resp =
                        super::live::respond(flight, first, pass, limits, target, started, wire);
                    return Answer::live(resp);
                }
                Some(super::live::Open::Failed(a)) => {
                    let g = a.generation.clone();
                    last = Some(a);
                    step = flight.completed(g, caller.is_cancelled());
                }
            }
            continue;
        }
        let calling = std::time::Instant::now();
        let attempt = match node.upstreams.target(&d.provider) {
            Some((c, model)) if embeddings => {
                c.embed(model, &pass, Duration::from_millis(d.timeout_ms))
                    .await
            }
            Some((c, model)) => {
                c.generate(
                    model,
                    &flight.session.request().messages,
                    Some(&pass),
                    d.max_tokens,
                    flight.session.request().response_format.as_ref(),
                    Duration::from_millis(d.timeout_ms),
                )
                .await
            }
            None => crate::core::request::Generation {
                error: Some(format!("no connector for {}", d.provider)),
                ..crate::core::request::Generation::failed(GenerationStatus::Error, 0)
            }
            .into(),
        };
        waits.waited += calling.elapsed();
        let g = attempt.generation.clone();
        used_tokens += g.usage.map_or(0, |u| u.prompt_tokens + u.completion_tokens);
        last = Some(attempt);
        step = flight.completed(g, caller.is_cancelled());
    };
    if let Some((agent, admitted)) = rated {
        node.rates.settle(&agent, admitted, used_tokens).await;
    }
    let record = flight.recorder();
    let trace = flight.trace.take();
    let unsent = std::mem::take(&mut flight.unsent);
    drop(flight);
    let mut answer = respond(node, &decision, last, matches!(asks, Asks::Tool));
    // A stream checked whole says so in its `oam` object too, whichever API writes it out.
    if let Some(why) = buffered
        && let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(&answer.body)
    {
        v["oam"]["buffered"] = why.into();
        answer.body = openai::json_bytes(&v);
    }
    let logged = conclude(node, decision, record, trace, started);
    // Under `[decision_log] durable`, not before its record is in the stream; nor are its
    // settlements sent to the ledger.
    node.log.logged(logged).await;
    drop(unsent);
    let own = started.elapsed().saturating_sub(waits.waited);
    node.metrics.overhead("whole", own.as_secs_f64());
    Answer {
        stream,
        buffered,
        native,
        ..answer
    }
}

/// Ask the cluster's count to admit the request of `flight` if its caller has a rate limit:
/// the caller and what was taken for it when admitted; when not, `step` becomes its refusal
/// (whatever it held given back). Nothing for a caller without a limit.
async fn rate_limit(
    node: &Arc<Node>,
    flight: &mut Flight,
    step: &mut Step,
) -> Option<(String, super::rates::Admitted)> {
    let r = flight.session.request();
    let limit = node.cfg.rate_limit(&r.agent)?;
    let agent = r.agent.clone();
    let max_tokens = r
        .max_tokens
        .unwrap_or_else(|| node.pipeline.with(|e| e.config.default_max_tokens));
    let tokens = crate::core::pipeline::estimate_prompt_tokens(r)
        + u64::from(max_tokens) * u64::from(r.n.max(1));
    match node.rates.admit(node, &agent, &limit, tokens).await {
        Ok(admitted) => Some((agent, admitted)),
        Err(_) => {
            // Leaving the queue, if it was in one: its waker goes too.
            if let Some(t) = flight.session.ticket() {
                node.pipeline.forget_waiter(t);
            }
            *step = flight.next(Call::RateLimited);
            None
        }
    }
}

/// What every decided request leaves behind: health samples from its traffic, metrics, and the
/// decision (with any incident and escalation) on the bus.
pub(crate) fn conclude(
    node: &Node,
    decision: Decision,
    record: Option<Recorder>,
    trace: Option<super::otlp::OpenSpans>,
    started: std::time::Instant,
) -> Option<super::decisionlog::Kept> {
    for effect in &decision.effects {
        match effect {
            Effect::HealthSample {
                provider,
                outcome,
                latency_ms,
            } => {
                node.health.record_traffic(provider, *outcome, *latency_ms);
                node.metrics.provider_outcome(provider, "traffic", *outcome);
            }
            // Its Retry-After holds for probes too.
            Effect::Cooldown { provider, until_ms } => node.health.quiet(provider, *until_ms),
            _ => {}
        }
    }
    node.metrics
        .decision(&decision, started.elapsed().as_secs_f64());
    node.otlp.finish(trace, &decision);
    let decision = std::sync::Arc::new(crate::core::record::Decided::new(decision));
    let logged = record.map(|r| node.log.keep(r.finish(decision.clone())));
    publish_decision(node, decision);
    logged
}

pub(crate) fn bad_request(node: &Node, headers: &HeaderMap, e: BadRequest) -> Answer {
    let request_id = header(headers, "x-request-id")
        .map_or_else(|| node.serving.next_request_id(&node.id), String::from);
    let (status, code) = if e.not_found {
        (StatusCode::NOT_FOUND, "model_not_found")
    } else {
        (StatusCode::BAD_REQUEST, "invalid_request")
    };
    Answer {
        stream: false,
        status,
        body: json_bytes(&openai::error_body(
            &e.message,
            "invalid_request_error",
            e.param.as_deref(),
            code,
        )),
        request_id,
        phase: "invalid".into(),
        reasons: String::new(),
        target: String::new(),
        live: None,
        buffered: None,
        native: false,
    }
}

pub(crate) fn publish_decision(node: &Node, d: std::sync::Arc<crate::core::record::Decided>) {
    node.loops.share(&d);
    if let Some(i) = &d.incident
        && d.reason_codes.contains(&ReasonCode::AgentLoopDetected)
    {
        // A new loop episode: raised once for the cluster (see `node::loops`).
        node.loops.raise(i.clone(), d.escalation.clone());
    } else if let Some(e) = &d.escalation {
        // An exhausted budget's is raised once for the cluster (see `node::ledger`).
        let exhausted = e.reason_codes.last() == Some(&ReasonCode::EscalatedBudgetExhausted);
        let claimed = match &d.shortfall {
            Some(sf) if exhausted => node.ledger.raise_exhausted(sf, e),
            _ => false,
        };
        if !claimed {
            node.escalations.raise(e);
        }
    }
    node.bus.decided(d);
}

/// For a request refused because no target could take it: why each target it weighed last
/// failed (`primary/gpt: probe: HTTP 401 ... (3 failing, 40 s ago)`), as this node saw it.
fn why_down(node: &Node, d: &Decision) -> Vec<String> {
    if d.outcome == crate::core::decision::DecisionOutcome::Accepted
        || !matches!(
            d.phase,
            crate::core::reason::Phase::Routing | crate::core::reason::Phase::Breaker
        )
    {
        return Vec::new();
    }
    let now = now_ms();
    let mut weighed: Vec<&str> = d
        .attempts
        .iter()
        .flat_map(|a| a.candidates.iter().map(|c| &*c.provider))
        .collect();
    weighed.sort_unstable();
    weighed.dedup();
    weighed
        .into_iter()
        .filter_map(|t| {
            let f = node.health.last_failure(t).filter(|f| f.failing > 0)?;
            Some(format!("{t}: {}", f.said(now)))
        })
        .collect()
}

pub(crate) fn respond(
    node: &Node,
    d: &Decision,
    last: Option<super::exchange::Attempt>,
    tool: bool,
) -> Answer {
    let target = d.provider.as_deref().unwrap_or("").to_string();
    let model = node
        .cfg
        .targets
        .iter()
        .find(|t| t.id == target)
        .map_or("", |t| t.model.as_str());
    let (status, body) = if tool {
        super::api::mcp::answer(d, last)
    } else {
        openai::answer(d, last, model, &why_down(node, d))
    };
    let reasons: Vec<&str> = d.reason_codes.iter().map(|c| c.as_str()).collect();
    Answer {
        stream: false,
        status,
        body,
        request_id: d.request_id.clone(),
        phase: d.phase.to_string(),
        reasons: reasons.join(","),
        target,
        live: None,
        buffered: None,
        native: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::offline::node;

    fn body(a: &Answer) -> serde_json::Value {
        serde_json::from_slice(&a.body).expect("JSON")
    }

    #[tokio::test]
    async fn a_body_the_node_cannot_read_is_refused_before_the_engine_with_an_id() {
        let n = node().await;
        let a = execute(
            &n,
            b"{\"messages\": 5}",
            &HeaderMap::new(),
            CancellationToken::new(),
            Asks::Answer {
                api: &crate::node::api::openai::Chat,
                live: false,
            },
        )
        .await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST);
        let v = body(&a);
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "messages", "{v}");
        let minted = format!("n1-{}-1", crate::ids::run_token());
        assert_eq!(
            (a.request_id.as_str(), a.phase.as_str()),
            (minted.as_str(), "invalid")
        );
        let e = n.pipeline.read();
        assert_eq!(e.state.bulkheads.normal.active, 0, "nothing was admitted");
    }

    /// A caller-chosen request id, agent or task with an escape sequence or a line break never
    /// reaches a record (and from there an operator's terminal): refused, the field named as
    /// the caller wrote it.
    #[tokio::test]
    async fn names_with_control_characters_are_refused_before_the_engine() {
        let n = node().await;
        for (oam, param) in [
            (r#"{"request_id": "r\u001b[2J"}"#, "oam.request_id"),
            (r#"{"agent": "bob\nforged: line"}"#, "oam.agent"),
            (r#"{"task": "t\u0007"}"#, "oam.task"),
        ] {
            let sent = format!(
                r#"{{"model": "auto", "messages": [{{"role": "user", "content": "q"}}], "oam": {oam}}}"#
            );
            let a = execute(
                &n,
                sent.as_bytes(),
                &HeaderMap::new(),
                CancellationToken::new(),
                Asks::Answer {
                    api: &crate::node::api::openai::Chat,
                    live: false,
                },
            )
            .await;
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "{oam}");
            let v = body(&a);
            assert_eq!(v["error"]["param"], param, "{v}");
        }
        let e = n.pipeline.read();
        assert_eq!(e.state.bulkheads.normal.active, 0, "nothing was admitted");
    }

    /// The one driver honours the asker's leaving in a backoff, whoever the asker is (a data
    /// plane caller, a stream's reader): the attempt is not made for nobody, and the request
    /// is decided at once, not after the wait.
    #[tokio::test]
    async fn a_backoff_ends_when_the_asker_leaves_and_no_attempt_is_made() {
        async fn leave_during_backoff(asker: &impl Requester) -> Decision {
            let n = node().await;
            let body = br#"{"model": "auto", "messages": [{"role": "user", "content": "q"}]}"#;
            let Ok(begun) = begin(
                &n,
                body,
                &HeaderMap::new(),
                &Asks::Answer {
                    api: &crate::node::api::openai::Chat,
                    live: false,
                },
            ) else {
                panic!("a good request is begun");
            };
            let Begun {
                mut flight,
                step,
                granted,
                ..
            } = begun;
            let Step::Dispatch(mut d) = step else {
                panic!("free slots: the first step is an attempt");
            };
            d.delay_ms = 60_000;
            let mut waits = Waits {
                granted,
                queue_deadline: tokio::time::Instant::now(),
                waited: Duration::ZERO,
            };
            let advanced = flight.advance(Step::Dispatch(d), &mut waits, asker);
            match tokio::time::timeout(Duration::from_secs(10), advanced).await {
                Ok(Next::Decided(d)) => *d,
                Ok(Next::Call(_)) => panic!("an attempt was made for nobody"),
                Err(_) => panic!("the driver waited out the backoff"),
            }
        }
        let gone = CancellationToken::new();
        gone.cancel();
        let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(1);
        drop(rx);
        for d in [
            leave_during_backoff(&gone).await,
            leave_during_backoff(&tx).await,
        ] {
            assert!(
                d.outcome != crate::core::pipeline::DecisionOutcome::Accepted,
                "{d:?}"
            );
            assert!(
                d.attempts.iter().all(|a| a.status.is_none()),
                "no attempt answered: {:?}",
                d.attempts
            );
        }
    }

    #[tokio::test]
    async fn with_every_target_unreachable_a_request_fails_closed_and_says_why() {
        let n = node().await;
        let req = br#"{"model": "auto", "messages": [{"role": "user", "content": "q"}],
            "oam": {"request_id": "r1", "latency_budget_ms": 400}}"#;
        let a = execute(
            &n,
            req,
            &HeaderMap::new(),
            CancellationToken::new(),
            Asks::Answer {
                api: &crate::node::api::openai::Chat,
                live: false,
            },
        )
        .await;
        let v = body(&a);
        assert!(a.status.is_server_error(), "{} {v}", a.status);
        assert_eq!(v["oam"]["request_id"], "r1");
        let codes = v["oam"]["reason_codes"].to_string();
        assert!(codes.contains("GENERATION_ERROR"), "{codes}");
        assert!(v["oam"]["attempts"].as_u64() >= Some(1), "{v}");
        assert_eq!(
            a.reasons,
            v["oam"]["reason_codes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c.as_str().unwrap())
                .collect::<Vec<_>>()
                .join(",")
        );
        let e = n.pipeline.read();
        assert_eq!(e.state.bulkheads.normal.active, 0, "its slot is given back");
        drop(e);
        assert!(
            n.metrics
                .registry
                .render()
                .contains("oam_requests_total{outcome=\""),
            "the decision is counted"
        );
    }
}
