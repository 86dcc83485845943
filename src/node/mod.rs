//! `oam node run`: the runtime that feeds the pure core and executes its effects.
//!
//! A node heartbeats on NATS, probes every provider, publishes its observations, keeps the
//! cluster's consensus view, and serves requests over HTTP (OpenAI-compatible) and NATS. All
//! decisions are the core pipeline's; this module only moves data in and out of it.

pub mod config;
pub mod connector;
pub mod dataplane;
pub mod decisionlog;
mod detach;
pub mod ledger;
pub mod live;
pub mod loops;
pub mod metrics;
pub mod server;

use crate::clock::now_ms;
use crate::core::contract::Contract;
use crate::core::escalation::Escalation;
use crate::core::health::{Outcome, Window};
use crate::core::pipeline::{Config as PipelineConfig, Engine, State};
use crate::core::quorum::{Cluster, Observation};
use crate::core::record::Decided;
use crate::core::request::{GenerationStatus, Message, Provider};
use crate::core::wire::{
    Arrival, BusCounts, Envelope, Goodbye, Heartbeat, LoopEvent, MemberSnapshot, NodeSnapshot,
    Observations, ProviderSnapshot, Sequencer, Stamper,
};
use crate::transport::store::escalations::Sink;
use crate::transport::subjects;
use config::NodeConfig;
use connector::Connector;
use futures_util::StreamExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Counters of what the node refused to apply from the bus.
#[derive(Default)]
pub struct BusCounters {
    pub malformed: AtomicU64,
    pub duplicate_or_stale: AtomicU64,
    pub forged: AtomicU64,
    /// Events not published because the outbox was full (NATS down for long).
    pub dropped_events: AtomicU64,
}

/// How long a starting node waits to hear a majority before it serves anyway.
const JOIN_WAIT: Duration = Duration::from_millis(2_500);

/// Events wait here for the bus, so a slow or absent NATS never blocks a request.
const OUTBOX_CAPACITY: usize = 4_096;

/// Decisions go out in batches: every this many ms ...
pub const DECISION_BATCH_MS: u64 = 50;
/// ... or as soon as this many wait.
pub const DECISION_BATCH_MAX: usize = 256;
/// Decisions kept at most while the bus is slower than the node (the oldest go first, counted).
const DECISIONS_KEPT: usize = 8 * DECISION_BATCH_MAX;

pub struct Node {
    pub id: String,
    pub cfg: NodeConfig,
    engine: Mutex<Engine>,
    windows: Mutex<BTreeMap<String, Window>>,
    /// Escalations not delivered to the webhook after every attempt.
    undelivered: AtomicU64,
    /// One per provider (host).
    connectors: BTreeMap<String, Connector>,
    /// One per target (a model on a provider), by target id.
    targets: BTreeMap<String, TargetRt>,
    nats: async_nats::Client,
    outbox: tokio::sync::mpsc::Sender<(String, bytes::Bytes)>,
    outbox_rx: Mutex<Option<tokio::sync::mpsc::Receiver<(String, bytes::Bytes)>>>,
    /// Escalations waiting to be recorded as open in the escalation store.
    escalations: tokio::sync::mpsc::Sender<Escalation>,
    escalations_rx: Mutex<Option<tokio::sync::mpsc::Receiver<Escalation>>>,
    stamper: Mutex<Stamper>,
    sequencer: Mutex<Sequencer>,
    pub bus: BusCounters,
    /// Times every HTTP connection slot (`node.max_connections`) was taken.
    pub http_saturated: Arc<AtomicU64>,
    pub metrics: metrics::Metrics,
    requests: AtomicU64,
    /// Decisions waiting for the next batch.
    decisions: Mutex<Vec<Arc<Decided>>>,
    decisions_full: tokio::sync::Notify,
    /// Queued requests by ticket, woken one each when the engine grants them a slot.
    waiters: Mutex<std::collections::HashMap<u64, tokio::sync::oneshot::Sender<()>>>,
    /// Every task that serves a request or ends a fault: drained, with a deadline, on stop.
    pub(crate) tasks: tokio_util::task::TaskTracker,
    /// Cancelled when the node stops: the data planes stop taking work, timers end.
    pub(crate) stop: tokio_util::sync::CancellationToken,
    pub http_url: Mutex<Option<String>>,
    /// Providers that are mesh agents whose death notice arrived; UNHEALTHY until a probe
    /// succeeds again.
    down: Mutex<std::collections::BTreeSet<String>>,
    /// Loop episodes to claim (and claims to release), in order.
    loop_claims: tokio::sync::mpsc::UnboundedSender<loops::ClaimOp>,
    loop_claims_rx: Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<loops::ClaimOp>>>,
    /// Loop episodes this node opened that another node had raised already.
    pub loops_joined: AtomicU64,
    /// Decision records waiting for the decision log, and what became of them.
    #[allow(clippy::type_complexity)]
    records: Mutex<
        Vec<(
            crate::core::record::Record,
            Option<tokio::sync::oneshot::Sender<bool>>,
        )>,
    >,
    records_full: tokio::sync::Notify,
    pub log_counters: decisionlog::LogCounters,
    /// The node's side of the shared budget ledger.
    pub(crate) ledger: ledger::Ledgers,
    /// Chaos done to this node, undone at expiry or on request.
    chaos: Mutex<NodeChaos>,
    /// Woken when the node is cut off from NATS or reconnected.
    isolation_changed: tokio::sync::Notify,
    /// JetStream stores that refuse this node's writes now.
    pub(crate) store_faults: StoreFaults,
}

/// The JetStream stores that do not take this node's writes now (a full store, JetStream gone
/// on the server, no answer), each with its last error; a store's next write that succeeds
/// clears it. Shown in the snapshot, so `oam mesh status` and `oam watch` say so.
#[derive(Default)]
pub(crate) struct StoreFaults(Mutex<BTreeMap<&'static str, String>>);

impl StoreFaults {
    pub(crate) fn failed(&self, store: &'static str, why: impl std::fmt::Display) {
        let why = why.to_string();
        if lock(&self.0).insert(store, why.clone()).is_none() {
            tracing::error!(store, "the {store} takes no writes: {why}");
        }
    }

    pub(crate) fn ok(&self, store: &'static str) {
        if lock(&self.0).remove(store).is_some() {
            tracing::info!(store, "the {store} takes writes again");
        }
    }

    fn snapshot(&self) -> BTreeMap<String, String> {
        lock(&self.0)
            .iter()
            .map(|(k, v)| ((*k).to_string(), v.clone()))
            .collect()
    }
}

/// Faults a node applies to itself (`oam chaos isolate-node`, `drain-budget`).
#[derive(Default)]
struct NodeChaos {
    /// (fault id, until, the key an early restore over HTTP carries) while the node is cut off
    /// from NATS.
    isolated: Option<(String, u64, String)>,
    /// agent -> (its limit before the first drain, or none when it had no budget; the drain
    /// faults holding it). Only the limit changes, so spending in flight is still accounted.
    drained: BTreeMap<String, (Option<f64>, std::collections::BTreeSet<String>)>,
}

/// Run an escalation command sink once: `body` as JSON on its standard input; taken when it
/// exits 0 within `timeout` (it is killed otherwise). Its output is discarded.
async fn run_sink_command(
    argv: &[String],
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<(), String> {
    use tokio::io::AsyncWriteExt;
    let Some((program, args)) = argv.split_first() else {
        return Err("the command is empty".into());
    };
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    let input = body.to_string();
    let run = async {
        if let Some(mut stdin) = child.stdin.take() {
            // A command that does not read its input still gets to decide by its exit.
            let _ = stdin.write_all(input.as_bytes()).await;
        }
        child.wait_with_output().await
    };
    match tokio::time::timeout(timeout, run).await {
        Err(_) => Err(format!(
            "{program} did not finish within {timeout:?}; killed"
        )),
        Ok(Err(e)) => Err(format!("{program}: {e}")),
        Ok(Ok(out)) if out.status.success() => Ok(()),
        Ok(Ok(out)) => {
            let err = String::from_utf8_lossy(&out.stderr);
            let err = err.trim();
            Err(format!(
                "{program} exited with {}{}",
                out.status,
                if err.is_empty() {
                    String::new()
                } else {
                    format!(": {}", err.chars().take(200).collect::<String>())
                }
            ))
        }
    }
}

/// A target's place at run time: the provider that serves it, the model it asks for, and when
/// real traffic last gave it a health sample (ms; 0: never): a target in use is not probed (its
/// traffic is the probe).
pub(crate) struct TargetRt {
    pub provider: String,
    pub model: String,
    last_traffic: AtomicU64,
    /// When it was last probed (ms; 0: never).
    last_probe: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a panic elsewhere mid-update; the data is still the best we have.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Node {
    pub fn new(id: String, cfg: NodeConfig, nats: async_nats::Client) -> anyhow::Result<Arc<Node>> {
        let http = crate::http::http_client(None)?;
        let post = crate::http::Poster::new(cfg.node.max_answer_bytes)?;
        let connectors = cfg
            .providers
            .iter()
            .map(|p| {
                (
                    p.id.clone(),
                    Connector::new(p, http.clone(), post.clone(), Some(nats.clone())),
                )
            })
            .collect();
        let providers: Vec<Provider> = cfg.targets.iter().map(config::Target::core).collect();
        let targets = cfg
            .targets
            .iter()
            .map(|t| {
                let rt = TargetRt {
                    provider: t.provider.clone(),
                    model: t.model.clone(),
                    last_traffic: AtomicU64::new(0),
                    last_probe: AtomicU64::new(0),
                };
                (t.id.clone(), rt)
            })
            .collect();
        let state = State {
            cluster: Arc::new(if cfg.node.members.is_empty() {
                Cluster::new(id.clone(), cfg.node.cluster_size)
            } else {
                Cluster::with_roster(id.clone(), cfg.node.members.iter().cloned().collect())
            }),
            providers,
            budgets: cfg.budgets.clone(),
            routes: cfg.core_routes(),
            ..State::default()
        };
        let windows = cfg
            .targets
            .iter()
            .map(|p| (p.id.clone(), Window::new(cfg.node.health_window_ms)))
            .collect();
        let pipeline: PipelineConfig = cfg.pipeline.clone();
        let (outbox, outbox_rx) = tokio::sync::mpsc::channel(OUTBOX_CAPACITY);
        let (escalations, escalations_rx) = tokio::sync::mpsc::channel(OUTBOX_CAPACITY);
        let (loop_claims, loop_claims_rx) = tokio::sync::mpsc::unbounded_channel();
        Ok(Arc::new(Node {
            outbox,
            outbox_rx: Mutex::new(Some(outbox_rx)),
            escalations,
            escalations_rx: Mutex::new(Some(escalations_rx)),
            stamper: Mutex::new(Stamper::new(id.clone(), now_ms())),
            id,
            engine: Mutex::new(Engine::new(pipeline, state)),
            windows: Mutex::new(windows),
            undelivered: AtomicU64::new(0),
            connectors,
            targets,
            nats,
            sequencer: Mutex::new(Sequencer::default()),
            bus: BusCounters::default(),
            http_saturated: Arc::default(),
            metrics: metrics::Metrics::default(),
            requests: AtomicU64::new(0),
            decisions: Mutex::new(Vec::new()),
            decisions_full: tokio::sync::Notify::new(),
            waiters: Mutex::new(std::collections::HashMap::new()),
            tasks: tokio_util::task::TaskTracker::new(),
            stop: tokio_util::sync::CancellationToken::new(),
            http_url: Mutex::new(None),
            down: Mutex::new(std::collections::BTreeSet::new()),
            chaos: Mutex::new(NodeChaos::default()),
            ledger: ledger::Ledgers::default(),
            records: Mutex::new(Vec::new()),
            records_full: tokio::sync::Notify::new(),
            log_counters: decisionlog::LogCounters::default(),
            loop_claims,
            loop_claims_rx: Mutex::new(Some(loop_claims_rx)),
            loops_joined: AtomicU64::new(0),
            isolation_changed: tokio::sync::Notify::new(),
            store_faults: StoreFaults::default(),
            cfg,
        }))
    }

    fn engine(&self) -> MutexGuard<'_, Engine> {
        lock(&self.engine)
    }

    /// Run `f` on the engine, then wake exactly the queued requests it granted a slot (a slot
    /// freed by `f` goes to the oldest waiter of its class, and only that one is woken).
    pub(crate) fn with_engine<R>(&self, f: impl FnOnce(&mut Engine) -> R) -> R {
        let mut e = self.engine();
        let out = f(&mut e);
        let granted = e.take_granted();
        if !granted.is_empty() {
            let mut waiters = lock(&self.waiters);
            for ticket in granted {
                if let Some(tx) = waiters.remove(&ticket) {
                    // A waiter that is gone is not lost: its guard hands the slot on.
                    let _ = tx.send(());
                }
            }
        }
        out
    }

    /// Be woken when `ticket` is granted a slot. Called under the same engine lock that queued
    /// it, so no grant can come before the waiter is there.
    pub(crate) fn wait_for_slot(&self, ticket: u64) -> tokio::sync::oneshot::Receiver<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        lock(&self.waiters).insert(ticket, tx);
        rx
    }

    /// Forget a waiter that left its queue.
    pub(crate) fn forget_waiter(&self, ticket: u64) {
        lock(&self.waiters).remove(&ticket);
    }

    /// Cut off from NATS by `oam chaos isolate-node`: nothing goes out, nothing coming in is
    /// applied, and the NATS data plane is unsubscribed.
    /// Whether `key` is the key of isolation `id`, under way (constant time in the key).
    pub(crate) fn isolation_key_is(&self, id: &str, key: &str) -> bool {
        lock(&self.chaos)
            .isolated
            .as_ref()
            .is_some_and(|(i, _, k)| i == id && !k.is_empty() && config::Secret::of(k).matches(key))
    }

    pub fn isolated(&self) -> bool {
        lock(&self.chaos)
            .isolated
            .as_ref()
            .is_some_and(|(_, until, _)| now_ms() < *until)
    }

    /// Apply a chaos command to this node; the fault ends by itself at its expiry.
    pub fn chaos(self: &Arc<Self>, cmd: crate::core::chaos::NodeCommand) {
        use crate::core::chaos::NodeCommand;
        let (id, until_ms) = match cmd {
            NodeCommand::Restore { id, .. } => return self.end_chaos(&id),
            NodeCommand::Isolate { id, until_ms, key } => {
                lock(&self.chaos).isolated = Some((id.clone(), until_ms, key));
                self.isolation_changed.notify_waiters();
                tracing::warn!(node = %self.id, fault = %id, "isolated from NATS (chaos)");
                (id, until_ms)
            }
            NodeCommand::DrainBudget {
                id,
                agent,
                until_ms,
            } => {
                let mut c = lock(&self.chaos);
                let mut e = self.engine();
                let budget = e.state.budgets.agents.get(&agent).copied();
                let held = c
                    .drained
                    .entry(agent.clone())
                    .or_insert_with(|| (budget.map(|b| b.limit_usd), Default::default()));
                held.1.insert(id.clone());
                // Nothing left: the limit drops to what is already spent or reserved.
                let b = budget.unwrap_or(crate::core::budget::Budget::new(0.0));
                e.state.budgets.agents.insert(
                    agent.clone(),
                    crate::core::budget::Budget {
                        limit_usd: b.spent_usd + b.reserved_usd,
                        ..b
                    },
                );
                tracing::warn!(node = %self.id, fault = %id, agent, "budget drained (chaos)");
                (id, until_ms)
            }
        };
        let me = self.clone();
        self.tasks.spawn(async move {
            let wait = until_ms.saturating_sub(now_ms());
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(wait)) => me.end_chaos(&id),
                // A stopping node ends its timers; the faults end with the process.
                () = me.stop.cancelled() => {}
            }
        });
    }

    fn end_chaos(&self, id: &str) {
        let mut c = lock(&self.chaos);
        if c.isolated.as_ref().is_some_and(|(i, _, _)| i == id) {
            c.isolated = None;
            self.isolation_changed.notify_waiters();
            tracing::info!(node = %self.id, fault = id, "reconnected to NATS");
        }
        let ended: Vec<String> = c
            .drained
            .iter_mut()
            .filter_map(|(agent, (_, ids))| {
                (ids.remove(id) && ids.is_empty()).then(|| agent.clone())
            })
            .collect();
        for agent in ended {
            let Some((limit, _)) = c.drained.remove(&agent) else {
                continue;
            };
            let mut e = self.engine();
            match limit {
                Some(limit_usd) => {
                    if let Some(b) = e.state.budgets.agents.get_mut(&agent) {
                        b.limit_usd = limit_usd;
                    }
                }
                None => {
                    e.state.budgets.agents.remove(&agent);
                }
            }
        }
    }

    /// Wait (at most `JOIN_WAIT`) until this node hears a majority of the cluster (heartbeats,
    /// and observations of every provider), so a node
    /// that has just started or restarted does not decide its first requests on a view of one.
    /// Without a majority in time it serves anyway, on its local view, and says so.
    async fn join(&self) {
        let deadline = tokio::time::Instant::now() + JOIN_WAIT;
        loop {
            let now = now_ms();
            let (live, needed, heard) = {
                let e = self.engine();
                let c = &e.state.cluster;
                let needed = c.quorum(now);
                // A majority's heartbeats are not enough: routing needs a majority's
                // observations of every provider, or the first requests see a view of one.
                let heard = e
                    .state
                    .providers
                    .iter()
                    .all(|p| c.view(&p.id, now).voters >= needed);
                (c.live_nodes(now).len(), needed, heard)
            };
            if live >= needed && heard {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(
                    node = %self.id,
                    live,
                    needed,
                    "no majority heard within {} ms; serving on this node's own view",
                    JOIN_WAIT.as_millis()
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Chaos commands for this node and for every node.
    async fn chaos_loop(self: Arc<Self>) -> anyhow::Result<()> {
        let mut mine = self.nats.subscribe(subjects::chaos_node(&self.id)).await?;
        let mut all = self.nats.subscribe(subjects::chaos_node("all")).await?;
        loop {
            let m = tokio::select! {
                Some(m) = mine.next() => m,
                Some(m) = all.next() => m,
                else => return Ok(()),
            };
            if subjects::from_jetstream(&m) {
                continue; // copied here by a JetStream consumer, not sent by the warden
            }
            if self.isolated() {
                continue; // cut off: it cannot hear this
            }
            match serde_json::from_slice::<crate::core::chaos::NodeCommand>(&m.payload) {
                Ok(cmd) => match cmd.check(now_ms()) {
                    Ok(()) => self.chaos(cmd),
                    Err(why) => {
                        self.forged::<()>("chaos", "?", why);
                    }
                },
                Err(_) => {
                    self.bus.malformed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    fn next_request_id(&self) -> String {
        let n = self.requests.fetch_add(1, Ordering::Relaxed) + 1;
        format!("{}-{}", self.id, n)
    }

    /// Queue an event, in an envelope, for the bus. Never waits: when the outbox is full the
    /// event is dropped and counted.
    fn publish<T: Serialize>(&self, subject: String, body: T) {
        let env = lock(&self.stamper).stamp(now_ms(), body);
        match serde_json::to_vec(&env) {
            Ok(bytes) => {
                if self.outbox.try_send((subject, bytes.into())).is_err() {
                    self.bus.dropped_events.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) => tracing::warn!("cannot encode an event: {e}"),
        }
    }

    /// Keep a decision for the next batch (never waits).
    pub(crate) fn log_decision(&self, d: Arc<Decided>) {
        let mut waiting = lock(&self.decisions);
        if waiting.len() >= DECISIONS_KEPT {
            waiting.remove(0);
            self.bus.dropped_events.fetch_add(1, Ordering::Relaxed);
        }
        waiting.push(d);
        if waiting.len() >= DECISION_BATCH_MAX {
            self.decisions_full.notify_one();
        }
    }

    /// Publish waiting decisions as one message, every `DECISION_BATCH_MS` or when a batch is
    /// full; what waits when the node stops goes out then.
    async fn decision_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_millis(DECISION_BATCH_MS));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let stopping = tokio::select! {
                _ = tick.tick() => false,
                () = self.decisions_full.notified() => false,
                () = self.stop.cancelled() => true,
            };
            loop {
                let batch: Vec<Arc<Decided>> = {
                    let mut waiting = lock(&self.decisions);
                    let n = waiting.len().min(DECISION_BATCH_MAX);
                    waiting.drain(..n).collect()
                };
                if batch.is_empty() {
                    break;
                }
                self.publish(subjects::decision(&self.id), &batch);
            }
            if stopping {
                return;
            }
        }
    }

    /// Move queued events to NATS, in order.
    async fn publisher_loop(self: Arc<Self>) {
        let Some(mut rx) = lock(&self.outbox_rx).take() else {
            return;
        };
        while let Some((subject, payload)) = rx.recv().await {
            if self.isolated() {
                continue; // a partition loses what it would have said
            }
            if let Err(e) = self.nats.publish(subject, payload).await {
                tracing::debug!("publish failed: {e}");
            }
        }
    }

    /// Queue an escalation to be recorded as open (never waits; dropped and counted when full).
    fn record_escalation(&self, e: &Escalation) {
        if self.escalations.try_send(e.clone()).is_err() {
            self.bus.dropped_events.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Record queued escalations in the escalation store, in order.
    async fn escalation_loop(self: Arc<Self>) {
        let Some(mut rx) = lock(&self.escalations_rx).take() else {
            return;
        };
        let mut store = None;
        while let Some(e) = rx.recv().await {
            if self.isolated() {
                continue; // a partition loses what it would have said
            }
            if store.is_none() {
                match crate::transport::store::escalations::store(&self.nats).await {
                    Ok(s) => store = Some(s),
                    Err(err) => tracing::warn!("escalation {} not recorded: {err:#}", e.id),
                }
            }
            if let Some(s) = &store
                && let Err(err) = crate::transport::store::escalations::open(s, &self.id, &e).await
            {
                tracing::warn!("escalation {} not recorded: {err:#}", e.id);
                store = None; // the bucket may be gone (a new server): open it afresh next time
            }
            let sinks = &self.cfg.escalations;
            let webhook = sinks.webhook_url.clone().map(Sink::Webhook);
            let command = sinks.command.clone().map(Sink::Command);
            for sink in webhook.into_iter().chain(command) {
                let (node, store, e) = (self.clone(), store.clone(), e.clone());
                self.tasks
                    .spawn(async move { node.deliver(sink, &e, store.as_ref()).await });
            }
        }
    }

    /// Send escalation `e` to `sink` (retried with backoff until it takes it, at most the
    /// sink's attempts), then record how it went on its record and in the metrics.
    async fn deliver(
        &self,
        sink: Sink,
        e: &Escalation,
        store: Option<&async_nats::jetstream::kv::Store>,
    ) {
        use crate::transport::store::escalations::{Delivery, delivered};
        let sinks = &self.cfg.escalations;
        let (attempts, timeout) = match sink {
            Sink::Webhook(_) => (sinks.webhook_attempts, sinks.webhook_timeout_ms),
            Sink::Command(_) => (sinks.command_attempts, sinks.command_timeout_ms),
        };
        let timeout = Duration::from_millis(timeout);
        let body = serde_json::json!({"node": self.id, "escalation": e});
        let mut delivery = Delivery {
            sink: sink.name(),
            attempts: 0,
            delivered_at_ms: None,
            error: None,
        };
        let Ok(http) = crate::http::http_client(Some(timeout)) else {
            return;
        };
        let mut backoff = Duration::from_millis(250);
        while delivery.attempts < attempts.max(1) {
            delivery.attempts += 1;
            let taken = match &sink {
                Sink::Webhook(url) => match http.post(url).json(&body).send().await {
                    Ok(r) if r.status().is_success() => Ok(()),
                    Ok(r) => Err(format!("HTTP {}", r.status())),
                    Err(err) => Err(err.to_string()),
                },
                Sink::Command(argv) => run_sink_command(argv, &body, timeout).await,
            };
            match taken {
                Ok(()) => {
                    delivery.delivered_at_ms = Some(now_ms());
                    delivery.error = None;
                    break;
                }
                Err(why) => delivery.error = Some(why),
            }
            if delivery.attempts < attempts {
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = self.stop.cancelled() => break,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
        let outcome = if delivery.delivered_at_ms.is_some() {
            "delivered"
        } else {
            tracing::warn!(
                "escalation {} not delivered to {} after {} attempts: {}",
                e.id,
                delivery.sink,
                delivery.attempts,
                delivery.error.as_deref().unwrap_or("")
            );
            self.undelivered.fetch_add(1, Ordering::Relaxed);
            "failed"
        };
        self.metrics.escalation_delivery(outcome);
        if let Some(s) = store
            && let Err(err) = delivered(s, &e.id, &sink, delivery).await
        {
            tracing::warn!("the delivery of escalation {} not recorded: {err:#}", e.id);
        }
    }

    /// Record a call's outcome in the local health window.
    /// A health sample from real traffic (see `record`).
    pub fn record_traffic(&self, target: &str, outcome: Outcome, latency_ms: u64) {
        if let Some(t) = self.targets.get(target) {
            t.last_traffic.store(now_ms(), Ordering::Relaxed);
        }
        self.record(target, outcome, latency_ms);
    }

    /// Is `t` idle: no traffic sample within the last probe interval?
    fn idle(&self, t: &TargetRt, now: u64) -> bool {
        let at = t.last_traffic.load(Ordering::Relaxed);
        now.saturating_sub(at) >= self.cfg.node.probe_interval_ms
    }

    /// The connector and model that serve a target.
    pub(crate) fn target(&self, id: &str) -> Option<(&Connector, &str)> {
        let t = self.targets.get(id)?;
        Some((self.connectors.get(&t.provider)?, &t.model))
    }

    pub fn record(&self, provider: &str, outcome: Outcome, latency_ms: u64) {
        if let Some(w) = lock(&self.windows).get_mut(provider) {
            w.record(now_ms(), outcome, latency_ms);
        }
    }

    /// This node's observations of every provider, now.
    fn observations(&self) -> Vec<Observation> {
        let now = now_ms();
        let down = lock(&self.down).clone();
        lock(&self.windows)
            .iter()
            .map(|(provider, w)| {
                let mut s = w.stats(now);
                if down.contains(provider) {
                    // Its death notice outranks the window: down now, not 15 s from now.
                    s.availability = 0.0;
                    s.samples = s.samples.max(1);
                }
                Observation {
                    node: self.id.clone(),
                    provider: provider.clone(),
                    at_ms: now,
                    verdict: s.verdict(),
                    availability: s.availability,
                    contract_failure_pct: s.contract_failure_pct,
                    p95_ms: s.p95_ms,
                    samples: s.samples,
                }
            })
            .collect()
    }

    async fn heartbeat_loop(self: Arc<Self>) {
        let mut tick =
            tokio::time::interval(Duration::from_millis(self.cfg.node.heartbeat_interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let http = lock(&self.http_url).clone();
            self.publish(
                subjects::heartbeat(&self.id),
                Heartbeat {
                    node: self.id.clone(),
                    http,
                },
            );
            // What this node sees, for `oam watch` and anyone else listening.
            self.publish(subjects::state(&self.id), self.snapshot());
        }
    }

    /// Each interval, probe every idle provider (one no traffic gave a sample to within the
    /// interval) as its configuration says, then publish and apply this node's observations.
    /// A provider answering again after failing (`Window::recovering`) is probed four times as
    /// often until its window has judged the recovery: traffic returns within about a second
    /// of an outage's end, for at most `RECOVERY_STREAK - 1` extra probes.
    async fn probe_loop(self: Arc<Self>) {
        let every = self.cfg.node.probe_interval_ms;
        let quick = (every / 4).max(50);
        let mut tick = tokio::time::interval(Duration::from_millis(quick));
        let mut shared_at = 0u64;
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let probe = [Message {
            role: "user".into(),
            content: "oam health probe: reply with {\"answer\": \"ok\", \"confidence\": 1}".into(),
        }];
        let timeout = Duration::from_millis(self.cfg.node.probe_timeout_ms);
        // Judged by what traffic that names no route is held to (checked at load), no more.
        let contract = self
            .cfg
            .pipeline
            .default_contract
            .as_ref()
            .and_then(|spec| Contract::for_request(Some(spec), None).ok());
        loop {
            tick.tick().await;
            let now = now_ms();
            // Idle targets, each checked on its own; but one model list answers for every idle
            // model of its provider, so it is asked for once.
            let mut checks: Vec<(Vec<&String>, &TargetRt, &Connector)> = Vec::new();
            for (id, t) in &self.targets {
                let Some(c) = self.connectors.get(&t.provider) else {
                    continue;
                };
                if c.probe == config::Probe::Off || !self.idle(t, now) {
                    continue;
                }
                let since = now.saturating_sub(t.last_probe.load(Ordering::Relaxed));
                let recovering = || lock(&self.windows).get(id).is_some_and(Window::recovering);
                if since < every && !(since >= quick && recovering()) {
                    continue;
                }
                t.last_probe.store(now, Ordering::Relaxed);
                let same_list = checks.iter_mut().find(|(_, other, _)| {
                    c.probe == config::Probe::Models && other.provider == t.provider
                });
                match same_list {
                    Some(check) => check.0.push(id),
                    None => checks.push((vec![id], t, c)),
                }
            }
            let calls = checks.into_iter().map(|(ids, t, c)| async {
                let g = match c.probe {
                    config::Probe::Models => c.list_models(timeout).await,
                    _ => {
                        let a = c.generate(&t.model, &probe, None, 32, None, timeout).await;
                        a.generation
                    }
                };
                let outcome = match g.status {
                    // The model list says nothing of answers: only that the provider answers.
                    GenerationStatus::Ok if c.probe == config::Probe::Models => Outcome::Success,
                    GenerationStatus::Ok => match &contract {
                        Some(k) if k.check(&g.content, g.finish_reason.as_deref()).is_err() => {
                            Outcome::ContractFailure
                        }
                        _ => Outcome::Success,
                    },
                    GenerationStatus::Timeout => Outcome::Timeout,
                    // A probe refused as invalid is this node's misconfiguration: unusable.
                    GenerationStatus::Error
                    | GenerationStatus::RateLimited
                    | GenerationStatus::Rejected
                    | GenerationStatus::ContextLength
                    | GenerationStatus::ContentPolicy
                    | GenerationStatus::Unauthorized => Outcome::Error,
                };
                (ids, outcome, g.latency_ms)
            });
            let probed = calls.len() > 0;
            for (ids, outcome, latency) in futures_util::future::join_all(calls).await {
                for target in ids {
                    if outcome == Outcome::Success {
                        lock(&self.down).remove(target);
                    }
                    self.record(target, outcome, latency);
                    self.metrics.provider_outcome(target, "probe", outcome);
                    // Judged healthy again by its probes: its breaker need not wait out its
                    // open time (one request probes it, as half-open allows).
                    let now = now_ms();
                    let healthy = outcome == Outcome::Success
                        && lock(&self.windows).get(target).is_some_and(|w| {
                            w.stats(now).verdict() == crate::core::health::Verdict::Healthy
                        });
                    if healthy && self.with_engine(|e| e.answering_again(target)).is_some() {
                        tracing::info!(node = %self.id, target = %target, "answering again: breaker half-open");
                    }
                }
            }
            let now = now_ms();
            if probed || now.saturating_sub(shared_at) >= every {
                shared_at = now;
                self.share_observations();
            }
        }
    }

    /// A peer's gossip event, if it is one to apply: it parses, it came on its sender's own
    /// subject (`oam.v1.{kind}.{sender}`, which only that node may publish on once the server
    /// enforces roles), its stamps are plausible, its sender is admitted to the cluster, and
    /// (when `ordered`) it is newer than what was applied from that sender (see `Sequencer`).
    /// Everything else is counted: malformed, duplicate or stale, forged.
    fn decode<T: DeserializeOwned>(
        &self,
        stream: &'static str,
        m: &async_nats::Message,
        now_ms: u64,
        ordered: bool,
    ) -> Option<Envelope<T>> {
        let env: Envelope<T> = match serde_json::from_slice(&m.payload) {
            Ok(e) => e,
            Err(e) => {
                self.bus.malformed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("ignored a malformed {stream} message: {e}");
                return None;
            }
        };
        if m.subject.rsplit('.').next() != Some(env.sender.as_str()) {
            return self.forged(stream, &env.sender, "sent on another node's subject");
        }
        if let Err(why) = crate::core::wire::plausible(&env, now_ms) {
            return self.forged(stream, &env.sender, why);
        }
        // Only what passed every other check may take one of the cluster's seats.
        if env.sender != self.id
            && !Arc::make_mut(&mut self.engine().state.cluster).admit(&env.sender, now_ms)
        {
            return self.forged(stream, &env.sender, "not a member of this cluster");
        }
        if !ordered {
            return Some(env);
        }
        match lock(&self.sequencer).accept(stream, &env, now_ms) {
            Arrival::Fresh => Some(env),
            Arrival::Stale => {
                self.bus.duplicate_or_stale.fetch_add(1, Ordering::Relaxed);
                None
            }
            Arrival::Forged(why) => self.forged(stream, &env.sender, why),
        }
    }

    /// Count a forged gossip event, and say so (the first few times).
    fn forged<T>(&self, stream: &str, sender: &str, why: &str) -> Option<T> {
        let n = self.bus.forged.fetch_add(1, Ordering::Relaxed);
        if n < FORGED_LOGGED {
            tracing::warn!(node = %self.id, stream, sender, "refused a forged event: {why}");
        }
        None
    }

    /// Apply this node's observations to its own view and publish them to the cluster.
    fn share_observations(&self) {
        let observations = self.observations();
        {
            let mut e = self.engine();
            for o in &observations {
                Arc::make_mut(&mut e.state.cluster).observe(o.clone());
            }
        }
        self.publish(
            subjects::observations(&self.id),
            Observations {
                node: self.id.clone(),
                observations,
            },
        );
    }

    /// A provider that is a mesh agent died: mark it down and tell the cluster now.
    fn provider_died(&self, agent: &str) {
        let providers: Vec<String> = self
            .targets
            .iter()
            .filter(|(_, t)| {
                let c = self.connectors.get(&t.provider);
                c.is_some_and(|c| c.agent.as_deref() == Some(agent))
            })
            .map(|(id, _)| id.clone())
            .collect();
        if providers.is_empty() {
            return;
        }
        lock(&self.down).extend(providers.iter().cloned());
        tracing::warn!(agent, ?providers, "provider agent died; marked down");
        self.share_observations();
    }

    /// Apply heartbeats, goodbyes and observations from every node, and death notices of
    /// providers that are mesh agents.
    async fn gossip_loop(self: Arc<Self>) -> anyhow::Result<()> {
        let mut deaths = self.nats.subscribe(subjects::DEATHS).await?;
        let mut hb = self.nats.subscribe(subjects::HEARTBEATS).await?;
        let mut obs = self.nats.subscribe(subjects::ALL_OBSERVATIONS).await?;
        let mut bye = self.nats.subscribe(subjects::GOODBYES).await?;
        let mut loop_events = self.nats.subscribe(subjects::LOOP_EVENTS).await?;
        loop {
            if self.isolated() {
                // Cut off: whatever the subscriptions still hold is not heard.
                tokio::select! {
                    Some(_) = hb.next() => {}
                    Some(_) = obs.next() => {}
                    Some(_) = deaths.next() => {}
                    Some(_) = bye.next() => {}
                    Some(_) = loop_events.next() => {}
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
                continue;
            }
            tokio::select! {
                Some(m) = hb.next() => {
                    if subjects::from_jetstream(&m) {
                        continue;
                    }
                    let now = now_ms();
                    // Heartbeats and observations are not sequenced: a heartbeat only says "alive
                    // now" and observations are ordered by their own stamps, so no forged
                    // sequence number can shut a real node out of either.
                    if let Some(env) = self.decode::<Heartbeat>("heartbeat", &m, now, false) {
                        if env.body.node != env.sender {
                            self.forged::<()>("heartbeat", &env.sender, "speaks for another node");
                            continue;
                        }
                        // Liveness is judged on our clock, not the sender's.
                        Arc::make_mut(&mut self.engine().state.cluster).heartbeat(&env.sender, now);
                    }
                }
                Some(m) = obs.next() => {
                    if subjects::from_jetstream(&m) {
                        continue;
                    }
                    let now = now_ms();
                    if let Some(env) = self.decode::<Observations>("observations", &m, now, false) {
                        if env.sender == self.id {
                            continue; // applied locally already
                        }
                        let mut e = self.engine();
                        for o in env.body.observations {
                            let why = if o.node != env.sender {
                                Some("an observation for another node")
                            } else if !e.state.providers.iter().any(|p| *p.id == *o.provider) {
                                Some("an observation of a provider this node does not route to")
                            } else {
                                match Arc::make_mut(&mut e.state.cluster).gossiped(o, now) {
                                    Arrival::Forged(why) => Some(why),
                                    Arrival::Fresh | Arrival::Stale => None,
                                }
                            };
                            if let Some(why) = why {
                                self.forged::<()>("observations", &env.sender, why);
                            }
                        }
                    }
                }
                Some(m) = deaths.next() => {
                    if subjects::from_jetstream(&m) {
                        continue;
                    }
                    match serde_json::from_slice::<crate::mesh::protocol::DeathNotice>(&m.payload) {
                        Ok(n) => self.provider_died(&n.agent),
                        Err(_) => {
                            self.bus.malformed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                Some(m) = loop_events.next() => {
                    if subjects::from_jetstream(&m) {
                        continue;
                    }
                    if let Some(env) = self.decode::<LoopEvent>("loop", &m, now_ms(), true) {
                        self.apply_loop_event(&env.sender, env.body);
                    }
                }
                Some(m) = bye.next() => {
                    if subjects::from_jetstream(&m) {
                        continue;
                    }
                    if let Some(env) = self.decode::<Goodbye>("goodbye", &m, now_ms(), true)
                        && env.body.node == env.sender
                    {
                        Arc::make_mut(&mut self.engine().state.cluster).disconnect(&env.sender);
                    }
                }
                else => return Ok(()),
            }
        }
    }

    /// The Prometheus exposition (`GET /metrics`).
    pub fn prometheus(&self) -> String {
        let bus = [
            ("malformed", self.bus.malformed.load(Ordering::Relaxed)),
            (
                "duplicate_or_stale",
                self.bus.duplicate_or_stale.load(Ordering::Relaxed),
            ),
            ("forged", self.bus.forged.load(Ordering::Relaxed)),
            (
                "dropped_outgoing",
                self.bus.dropped_events.load(Ordering::Relaxed),
            ),
        ];
        let engine = self.engine();
        let mut text = self.metrics.render(&self.id, &engine, now_ms(), &bus);
        text.push_str(&format!(
            "# HELP oam_http_connection_limit_reached_total Times every HTTP connection slot \
             (node.max_connections) was taken; new connections waited.\n\
             # TYPE oam_http_connection_limit_reached_total counter\n\
             oam_http_connection_limit_reached_total {}\n",
            self.http_saturated.load(Ordering::Relaxed)
        ));
        text.push_str(&self.ledger.counters.render());
        text.push_str(&format!(
            "# HELP oam_decision_log_records_total Decision records, by what became of them (lost: \
             the buffer was full, or the stream did not take them).\n\
             # TYPE oam_decision_log_records_total counter\n\
             oam_decision_log_records_total{{result=\"written\"}} {}\n\
             oam_decision_log_records_total{{result=\"lost\"}} {}\n",
            self.log_counters.written.load(Ordering::Relaxed),
            self.log_counters.lost.load(Ordering::Relaxed)
        ));
        text
    }

    /// What this node sees, now (`GET /v1/oam/state`, and `oam.v1.state.{node}`).
    pub fn snapshot(&self) -> NodeSnapshot {
        let now = now_ms();
        let e = self.engine();
        let c = &e.state.cluster;
        let nodes = c
            .members
            .iter()
            .map(|(id, m)| MemberSnapshot {
                id: id.clone(),
                alive: c.is_alive(id, now),
                heartbeat_age_ms: now.saturating_sub(m.last_heartbeat_ms),
                connected: m.connected,
            })
            .collect();
        let windows = lock(&self.windows);
        let providers = e
            .state
            .providers
            .iter()
            .map(|p| ProviderSnapshot {
                id: p.id.to_string(),
                fallback: p.fallback,
                consensus: c.view(&p.id, now),
                local: windows.get(&*p.id).map(|w| w.stats(now)),
                breaker: breaker_now(e.state.breakers.get(&*p.id).copied(), now),
            })
            .collect();
        let count = |a: &AtomicU64| a.load(Ordering::Relaxed);
        NodeSnapshot {
            node: self.id.clone(),
            now_ms: now,
            cluster_size: c.effective_size(now),
            quorum: c.quorum(now),
            live_nodes: c.live_nodes(now).into_iter().map(String::from).collect(),
            nodes,
            providers,
            bulkheads: e.state.bulkheads,
            bulkhead_limits: e.config.bulkheads,
            budgets: e.state.budgets.clone(),
            loops: e.state.loops.clone(),
            bus: BusCounts {
                malformed: count(&self.bus.malformed),
                duplicate_or_stale: count(&self.bus.duplicate_or_stale),
                forged: count(&self.bus.forged),
                dropped_events: count(&self.bus.dropped_events),
            },
            escalations_undelivered: count(&self.undelivered),
            decisions_unlogged: count(&self.log_counters.lost),
            store_faults: self.store_faults.snapshot(),
        }
    }
}

/// A breaker as a request arriving at `now_ms` would find it: an open one past its time is
/// half-open, even if no request has touched it since.
fn breaker_now(
    b: Option<crate::core::breaker::Breaker>,
    now_ms: u64,
) -> crate::core::breaker::Breaker {
    let mut b = b.unwrap_or_default();
    b.tick(now_ms);
    b
}

/// Forged gossip events logged (at warn) before only the counter says more.
const FORGED_LOGGED: u64 = 8;

/// How long a stopping node waits for the requests in hand to finish (inside `oam mesh down`'s
/// default grace of 5 s, with the goodbye after it).
const DRAIN_DEADLINE: Duration = Duration::from_secs(4);

/// Run a node until `stop` resolves: background loops, HTTP on `listener`, the NATS data plane.
///
/// Stopping leaves the NATS queue group first (new work goes to the other nodes) and stops
/// accepting HTTP connections, then finishes every request in hand (HTTP and NATS, at most
/// `DRAIN_DEADLINE`), then says goodbye to the cluster.
pub async fn run(
    node: Arc<Node>,
    listener: tokio::net::TcpListener,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let addr = listener.local_addr()?;
    *lock(&node.http_url) = Some(format!("http://{addr}"));
    if node.cfg.clients.is_empty() && !node.cfg.budgets.agents.is_empty() {
        // The rule, said where an operator looks: no keys, no owners.
        tracing::warn!(
            node = %node.id,
            "agent budgets without [[client]] keys: any caller on 127.0.0.1 may name an agent and \
             spend or hold its budget; give each agent a [[client]] key to bind its budget to it"
        );
    }
    Arc::make_mut(&mut node.engine().state.cluster).heartbeat(&node.id, now_ms());
    let mut loops = tokio::task::JoinSet::new();
    loops.spawn(node.clone().publisher_loop());
    loops.spawn(node.clone().decision_loop());
    loops.spawn(node.clone().escalation_loop());
    loops.spawn(node.clone().heartbeat_loop());
    loops.spawn(node.clone().probe_loop());
    loops.spawn(node.clone().ledger_loop());
    loops.spawn(node.clone().loop_claim_loop());
    loops.spawn(node.clone().decision_log_loop());
    {
        let n = node.clone();
        loops.spawn(async move {
            if let Err(e) = n.gossip_loop().await {
                tracing::error!("gossip stopped: {e:#}");
            }
        });
        let n = node.clone();
        loops.spawn(async move {
            if let Err(e) = n.chaos_loop().await {
                tracing::error!("chaos commands stopped: {e:#}");
            }
        });
    }
    tokio::pin!(stop);
    tokio::select! {
        () = node.join() => {}
        () = &mut stop => node.stop.cancel(),
    }
    let nats_plane = {
        let n = node.clone();
        tokio::spawn(async move {
            if let Err(e) = dataplane::serve_nats(n).await {
                tracing::error!("NATS data plane stopped: {e:#}");
            }
        })
    };
    let server = tokio::spawn(server::serve(
        listener,
        dataplane::router(node.clone()),
        node.cfg.node.max_connections,
        Duration::from_millis(node.cfg.node.header_timeout_ms),
        Duration::from_millis(node.cfg.node.write_timeout_ms),
        node.http_saturated.clone(),
        node.stop.clone(),
    ));
    if !node.stop.is_cancelled() {
        stop.await;
    }
    tracing::info!(node = %node.id, "stopping: leaving the queue group, finishing requests in hand");
    node.stop.cancel();
    let drained = tokio::time::timeout(DRAIN_DEADLINE, async {
        // The NATS data plane first: once it has left the queue group, no new task can come.
        let _ = nats_plane.await;
        node.tasks.close();
        let _ = server.await;
        node.tasks.wait().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            node = %node.id,
            left = node.tasks.len(),
            "requests still in hand after {} s; stopping anyway",
            DRAIN_DEADLINE.as_secs()
        );
    }
    tracing::info!(node = %node.id, "leaving the cluster");
    // Say goodbye if the bus is there; never wait on a bus that is gone.
    node.publish(
        subjects::goodbye(&node.id),
        Goodbye {
            node: node.id.clone(),
        },
    );
    let goodbye = async {
        // Let the publisher drain the outbox (decisions and goodbye), then flush.
        while node.outbox.capacity() < OUTBOX_CAPACITY {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        crate::transport::connect::flush_within(&node.nats, Duration::from_millis(500)).await;
    };
    if node.nats.connection_state() == async_nats::connection::State::Connected {
        let _ = tokio::time::timeout(Duration::from_millis(500), goodbye).await;
    }
    loops.abort_all();
    Ok(())
}
