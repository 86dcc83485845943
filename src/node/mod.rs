//! `oam node run`: the runtime that feeds the pure core and executes its effects.
//!
//! A node heartbeats on NATS, probes idle targets, shares its observations, keeps the
//! cluster's consensus view, and serves requests over HTTP (OpenAI-compatible) and NATS. All
//! decisions are the core pipeline's; this module only builds the node from its services,
//! runs them, drains what is in hand and says goodbye.
//!
//! Each background concern is a service that owns its state, gives the node a cheap handle,
//! and runs as `run(self, stop)`: the publisher (`bus`), gossip, the prober (`health`), the
//! ledger's keeper, the decision-log writer, loop claims, escalations, chaos commands.

pub(crate) mod api;
#[doc(hidden)]
pub use api::translated;
pub(crate) mod bus;
pub(crate) mod catalog;
pub(crate) mod chaos;
pub mod config;
mod copies;
pub(crate) mod decisionlog;
mod detach;
mod doors;
pub(crate) mod escalations;
pub(crate) mod exchange;
pub(crate) mod gossip;
pub(crate) mod health;
pub(crate) mod http;
pub(crate) mod ledger;
pub(crate) mod limits;
pub(crate) mod live;
pub(crate) mod loops;
pub(crate) mod metrics;
pub(crate) mod model;
pub(crate) mod nats;
pub(crate) mod otlp;
pub(crate) mod pipeline;
pub(crate) mod prices;
pub(crate) mod rates;
mod reconcile;
pub(crate) mod request;
pub(crate) mod server;
pub(crate) mod status;
mod tools;
pub(crate) mod upstream;

/// Why a node could not start, or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// NATS refused or failed it (a subscription, a flush), as it said.
    #[error("{0}")]
    Bus(String),
    #[error(transparent)]
    Setup(#[from] upstream::SetupError),
    #[error(transparent)]
    Store(#[from] crate::transport::store::StoreError),
    /// The HTTP listener failed.
    #[error("the HTTP listener: {0}")]
    Listener(#[from] std::io::Error),
    /// The threads HTTP is served on could not start.
    #[error("cannot start the HTTP lanes (node.lanes in oam.toml): {0}")]
    Lanes(std::io::Error),
    /// The telemetry settings cannot be exported as configured.
    #[error("{0}")]
    Telemetry(String),
    /// The node's request slots were closed: it is stopping.
    #[error("the node is stopping")]
    Stopping(#[from] tokio::sync::AcquireError),
}

said_as!(NodeError::Bus: async_nats::SubscribeError, async_nats::client::FlushError);
said_as!(NodeError::Telemetry: otlp::ExportError);

use crate::clock::now_ms;
use crate::core::escalation::Escalation;
use crate::core::pipeline::{Engine, State};
use crate::core::quorum::Cluster;
use crate::core::wire::Goodbye;
use crate::transport::subjects;
use config::NodeConfig;
use pipeline::Pipeline;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a stopping node waits for the requests in hand to finish (inside `oam mesh down`'s
/// default grace of 5 s, with the goodbye after it).
const DRAIN_DEADLINE: Duration = Duration::from_secs(4);

pub struct Node {
    pub(crate) id: String,
    pub(crate) cfg: NodeConfig,
    /// The core engine every request and service decides with.
    pub(crate) pipeline: Pipeline,
    pub(crate) bus: Arc<bus::Bus>,
    pub(crate) upstreams: Arc<upstream::Upstreams>,
    pub(crate) health: Arc<health::Health>,
    /// The node's side of the shared budget ledger.
    pub(crate) ledger: ledger::Ledgers,
    /// The node's leases of the cluster's rate-limit windows.
    pub(crate) rates: rates::Rates,
    pub(crate) log: decisionlog::DecisionLog,
    pub(crate) loops: loops::LoopEpisodes,
    pub(crate) escalations: escalations::Escalations,
    pub(crate) chaos: Arc<chaos::Chaos>,
    /// The tools the `/mcp` door serves.
    pub(crate) catalog: catalog::Catalog,
    pub(crate) metrics: Arc<metrics::Metrics>,
    /// OpenTelemetry export of requests' spans (a no-op when off).
    pub(crate) otlp: otlp::Telemetry,
    /// JetStream stores that refuse this node's writes now.
    pub(crate) store_faults: status::StoreFaults,
    /// How many current copies the streams it writes keep.
    pub(crate) copies: Arc<copies::Copies>,
    pub serving: Serving,
}

/// What serving requests shares: the tasks that serve them, the stop that ends taking work,
/// where HTTP listens, and counters.
#[derive(Default)]
pub struct Serving {
    /// Every task that serves a request or ends a fault: drained, with a deadline, on stop.
    pub tasks: TaskTracker,
    /// Cancelled when the node stops: the data planes stop taking work, timers end.
    pub stop: CancellationToken,
    pub http_url: OnceLock<String>,
    /// Times every HTTP connection slot (`node.max_connections`) was taken.
    pub saturated: Arc<AtomicU64>,
    /// Requests refused with `CONNECTION_LIMIT` on a spare connection.
    pub refused_at_connection_limit: Arc<AtomicU64>,
    requests: AtomicU64,
}

impl Serving {
    /// A request id for a request that brought none: `{node}-{run}-{n}`, unique across the
    /// node's restarts (the run) and the cluster's nodes.
    pub(crate) fn next_request_id(&self, node: &str) -> String {
        let n = self.requests.fetch_add(1, Ordering::Relaxed) + 1;
        format!("{node}-{}-{n}", crate::ids::run_token())
    }
}

/// The services' halves the node does not keep: each is run once, by `run`.
pub struct Services {
    publisher: bus::Publisher,
    escalations: tokio::sync::mpsc::Receiver<Escalation>,
    ledger: ledger::Queue,
    claims: tokio::sync::mpsc::UnboundedReceiver<loops::ClaimOp>,
    otlp: Option<otlp::Exporter>,
}

impl Node {
    /// Build the node and the services it runs (`run` runs them).
    pub fn new(
        id: String,
        cfg: NodeConfig,
        nats: async_nats::Client,
    ) -> Result<(Arc<Node>, Services), NodeError> {
        let upstreams = Arc::new(upstream::Upstreams::new(&cfg, &nats)?);
        let state = State {
            cluster: Arc::new(if cfg.node.members.is_empty() {
                Cluster::new(id.clone(), cfg.node.cluster_size)
            } else {
                Cluster::with_roster(id.clone(), cfg.node.members.iter().cloned().collect())
            }),
            providers: cfg.targets.iter().map(config::Target::core).collect(),
            budgets: cfg.budgets.clone(),
            routes: cfg.core_routes(),
            ..State::default()
        };
        let mut engine = Engine::new(cfg.pipeline.clone(), state);
        if cfg.decision_log.enabled {
            engine.keep_timeline();
        }
        let pipeline = Pipeline::new(engine);
        let (bus, publisher) = bus::Bus::new(&id, nats);
        let serving = Serving::default();
        let chaos = Arc::new(chaos::Chaos::new(
            &id,
            bus.clone(),
            pipeline.clone(),
            upstreams.injected.clone(),
            serving.tasks.clone(),
            serving.stop.clone(),
        ));
        let (ledger, ledger_queue) =
            ledger::Ledgers::new(&id, pipeline.clone(), bus.clone(), chaos.clone());
        let (escalations, escalations_rx) = escalations::Escalations::new(&id, bus.clone());
        let (loops, claims) = loops::LoopEpisodes::new(&id, bus.clone());
        let log = decisionlog::DecisionLog::new(&id, cfg.decision_log.clone());
        let metrics = Arc::new(metrics::Metrics::default());
        let registry = &metrics.registry;
        status::register(registry, &id, &pipeline, &serving);
        bus.register(registry);
        ledger.counters.register(registry);
        let rates = rates::Rates::default();
        rates.counters.register(registry);
        log.counters.register(registry);
        let copies = Arc::new(copies::Copies::default());
        copies.register(registry);
        let export = cfg.telemetry.export(|k| std::env::var(k).ok())?;
        let (otlp, exporter) = otlp::Telemetry::new(&id, &cfg.telemetry, export, &cfg.targets);
        otlp.register(registry);
        let health = Arc::new(health::Health::new(
            &id,
            &cfg,
            pipeline.clone(),
            bus.clone(),
        ));
        health.probes.register(registry);
        health.register(registry);
        let node = Node {
            otlp,
            health,
            log,
            metrics,
            store_faults: status::StoreFaults::default(),
            copies,
            id,
            cfg,
            pipeline,
            bus,
            upstreams,
            ledger,
            rates,
            loops,
            escalations,
            chaos,
            catalog: catalog::Catalog::default(),
            serving,
        };
        let services = Services {
            publisher,
            escalations: escalations_rx,
            ledger: ledger_queue,
            claims,
            otlp: exporter,
        };
        Ok((Arc::new(node), services))
    }
}

/// Run a node until `stop` resolves: its services, HTTP on `listener`, the NATS data plane.
///
/// Stopping leaves the NATS queue group first (new work goes to the other nodes) and stops
/// accepting HTTP connections, then finishes every request in hand (HTTP and NATS, at most
/// `DRAIN_DEADLINE`), then writes what waits for the bus and says goodbye to the cluster.
pub async fn run(
    node: Arc<Node>,
    services: Services,
    listener: tokio::net::TcpListener,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), NodeError> {
    let addr = listener.local_addr()?;
    // Ended when `run` returns, after the connections on them are done.
    let lanes = crate::http::lanes::Lanes::start(node.cfg.node.lanes).map_err(NodeError::Lanes)?;
    let lanes = Arc::new(lanes);
    let _ = node.serving.http_url.set(format!("http://{addr}"));
    if node.cfg.clients.is_empty() && !node.cfg.budgets.agents.is_empty() {
        // The rule, said where an operator looks: no keys, no owners.
        tracing::warn!(
            node = %node.id,
            "agent budgets without [[client]] keys: any caller on 127.0.0.1 may name an agent and \
             spend or hold its budget; give each agent a [[client]] key to bind its budget to it"
        );
    }
    node.pipeline
        .with(|e| Arc::make_mut(&mut e.state.cluster).heartbeat(&node.id, now_ms()));
    // The services live until the goodbye is said: requests still in hand use them.
    let last = CancellationToken::new();
    let mut running = tokio::task::JoinSet::new();
    let n = &node;
    running.spawn(services.publisher.run(last.clone()));
    running.spawn(escalations::Escalator::new(services.escalations, n.clone()).run(last.clone()));
    running.spawn(ledger::Keeper::new(services.ledger, n.clone()).run(n.serving.stop.clone()));
    running.spawn(loops::Claimer::new(services.claims, n.clone()).run(last.clone()));
    running.spawn(health::Prober::new(n.clone()).run(last.clone()));
    running.spawn(gossip::Gossip::new(n.clone()).run(last.clone()));
    running.spawn(chaos::Commands(n.chaos.clone()).run(last.clone()));
    running.spawn(copies::watch(n.clone(), last.clone()));
    let writer = tokio::spawn(decisionlog::Writer(n.clone()).run(last.clone()));
    if let Some(exporter) = services.otlp {
        running.spawn(exporter.run(last.clone()));
    }
    tokio::pin!(stop);
    tokio::select! {
        () = gossip::join(&node) => {}
        () = &mut stop => node.serving.stop.cancel(),
    }
    let nats_plane = {
        let n = node.clone();
        tokio::spawn(async move {
            if let Err(e) = nats::serve(n).await {
                tracing::error!("NATS data plane stopped: {e:#}");
            }
        })
    };
    let limits = server::Limits {
        max_connections: node.cfg.node.max_connections,
        header_timeout: Duration::from_millis(node.cfg.node.header_timeout_ms),
        write_timeout: Duration::from_millis(node.cfg.node.write_timeout_ms),
    };
    let server = tokio::spawn(server::serve(
        listener,
        http::router(node.clone()),
        http::overflow_router(node.clone()),
        limits,
        node.serving.saturated.clone(),
        lanes.clone(),
        node.serving.stop.clone(),
    ));
    if !node.serving.stop.is_cancelled() {
        stop.await;
    }
    tracing::info!(node = %node.id, "stopping: leaving the queue group, finishing requests in hand");
    node.serving.stop.cancel();
    let tasks = &node.serving.tasks;
    let drained = tokio::time::timeout(DRAIN_DEADLINE, async {
        // The NATS data plane first: once it has left the queue group, no new task can come.
        let _ = nats_plane.await;
        tasks.close();
        let _ = server.await;
        tasks.wait().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            node = %node.id,
            left = tasks.len(),
            "requests still in hand after {} s; stopping anyway",
            DRAIN_DEADLINE.as_secs()
        );
    }
    tracing::info!(node = %node.id, "leaving the cluster");
    // What the requests in hand decided goes out before the goodbye.
    last.cancel();
    node.bus.send_decisions();
    let _ = tokio::time::timeout(Duration::from_millis(500), writer).await;
    // Say goodbye if the bus is there; never wait on a bus that is gone.
    node.bus.publish(
        subjects::goodbye(&node.id),
        Goodbye {
            node: node.id.clone(),
        },
    );
    node.bus.drain_within(Duration::from_millis(500)).await;
    running.abort_all();
    Ok(())
}

/// A node whose NATS client never connects (its services are not run): the stages and
/// handlers, tested without servers.
#[cfg(test)]
mod ids_tests {
    #[test]
    fn a_minted_request_id_names_the_node_and_this_run() {
        let serving = super::Serving::default();
        let id = serving.next_request_id("n1");
        let parts: Vec<&str> = id.split('-').collect();
        assert_eq!(parts.len(), 3, "{id}");
        assert_eq!((parts[0], parts[2]), ("n1", "1"));
        assert_eq!(parts[1], crate::ids::run_token());
        assert!(parts[1].len() == 6 && parts[1].bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(serving.next_request_id("n1"), id, "the count goes on");
    }
}

#[cfg(test)]
pub(crate) mod offline {
    use super::*;

    /// On `toml` (empty: the default configuration, targets on a port nothing listens on).
    pub(crate) async fn node_with(toml: &str) -> (Arc<Node>, Services) {
        let cfg = NodeConfig::parse("test.toml", toml, "http://127.0.0.1:1").expect("a config");
        Node::new("n1".into(), cfg, bus::offline::client().await).expect("a node")
    }

    pub(crate) async fn node() -> Arc<Node> {
        node_with("").await.0
    }

    /// A decision as the engine writes one: `outcome` in `phase` with `codes`, no attempts.
    pub(crate) fn decision(
        outcome: &str,
        phase: &str,
        codes: &[&str],
    ) -> crate::core::pipeline::Decision {
        serde_json::from_value(serde_json::json!({
            "request_id": "r", "agent": "a", "task": "", "fingerprint": "0000000000000000",
            "outcome": outcome, "phase": phase, "reason_codes": codes,
            "provider": null, "fallback": false, "confidence": null, "cost_usd": 0.0,
            "attempts": [], "escalation": null, "incident": null, "effects": [], "decided_at_ms": 0
        }))
        .expect("a decision")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Poll `url` until it answers 200, for at most `limit`.
    async fn answers(url: &str, limit: Duration) -> bool {
        let client = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < deadline {
            if let Ok(r) = client.get(url).send().await
                && r.status().is_success()
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_a_bus_a_node_serves_on_its_own_view_and_stops_when_told() {
        let (node, services) = offline::node_with("").await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let addr = listener.local_addr().expect("an address");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(run(node.clone(), services, listener, async {
            let _ = stopped.await;
        }));
        let url = format!("http://{addr}/healthz");
        assert!(
            answers(&url, gossip::JOIN_WAIT + Duration::from_secs(5)).await,
            "no HTTP after the join wait"
        );
        assert_eq!(node.serving.http_url.get(), Some(&format!("http://{addr}")));
        assert!(!node.serving.stop.is_cancelled());

        let _ = stop.send(());
        let ended = tokio::time::timeout(DRAIN_DEADLINE + Duration::from_secs(3), running).await;
        assert!(
            matches!(ended, Ok(Ok(Ok(())))),
            "run did not return in time: {ended:?}"
        );
        assert!(
            node.serving.stop.is_cancelled(),
            "the data planes were told"
        );
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "the listener is closed once run returns"
        );
    }
}
