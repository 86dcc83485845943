//! Serving an agent on the mesh: one NATS connection per instance (named
//! `oam-host-{instance_id}`), a queue subscription on `mesh.agent.{name}` (group `q.{name}`),
//! eager registration in the catalog, registry and instance buckets, heartbeats with in-flight and
//! processed counts, concurrent handling up to a limit with backpressure, and a graceful exit that
//! drains in-flight requests and, if it was the last instance, says so with a death notice.

use super::protocol::{
    self, AgentHeartbeat, CatalogEntry, DeathNotice, DeathReason, ErrorCode, MeshError,
};
use super::store;
use crate::transport::subjects;
use async_nats::HeaderMap;
use bytes::Bytes;
use futures_util::StreamExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A request still in hand after this long is acknowledged to its caller.
pub const ACK_AFTER: Duration = Duration::from_millis(2);

/// What a demo agent does with a request.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Demo {
    /// Reply with the request body.
    Echo,
    /// Wait, then echo.
    Sleep(Duration),
    /// Never reply.
    Hang,
    /// Reply with a `handler_error`.
    Fail,
    /// Answer a chat request with a chat completion (a model provider on the mesh).
    Chat,
    /// A streaming agent: `chunks` chunks, one every `every`, each echoing the request.
    Stream { chunks: u32, every: Duration },
}

impl Demo {
    /// Streaming agents answer `stream` requests only; the others answer calls only.
    pub fn streams(self) -> bool {
        matches!(self, Demo::Stream { .. })
    }

    /// The demo's answer to a call with (JSON) `payload`, as agent `agent`.
    fn answer(self, agent: &str, payload: Bytes) -> HandlerFuture {
        let agent = agent.to_string();
        Box::pin(async move {
            match self {
                Demo::Echo | Demo::Stream { .. } => Ok(payload),
                Demo::Sleep(d) => {
                    tokio::time::sleep(d).await;
                    Ok(payload)
                }
                Demo::Hang => std::future::pending().await,
                Demo::Fail => Err((
                    ErrorCode::HandlerError,
                    "demo agent fails on purpose".into(),
                )),
                Demo::Chat => {
                    let content = serde_json::json!({
                        "answer": format!("{agent} answers"),
                        "confidence": 0.9,
                    })
                    .to_string();
                    let body = serde_json::json!({
                        "object": "chat.completion",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9},
                    });
                    Ok(serde_json::to_vec(&body).unwrap_or_default().into())
                }
            }
        })
    }
}

/// What a handler returns: the reply body, or an error code and message for the caller.
pub(crate) type HandlerResult = Result<Bytes, (ErrorCode, String)>;
pub(crate) type HandlerFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = HandlerResult> + Send>>;

/// What an instance does with a request: a demo, or your own function of the (JSON) request
/// body.
#[derive(Clone)]
pub enum Handler {
    Demo(Demo),
    Call(Arc<dyn Fn(Bytes) -> HandlerFuture + Send + Sync>),
}

impl Handler {
    /// A handler from an async function of the request body.
    pub fn call<F, Fut>(f: F) -> Handler
    where
        F: Fn(Bytes) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = HandlerResult> + Send + 'static,
    {
        Handler::Call(Arc::new(move |body| Box::pin(f(body))))
    }

    pub fn streams(&self) -> bool {
        matches!(self, Handler::Demo(d) if d.streams())
    }
}

impl From<Demo> for Handler {
    fn from(d: Demo) -> Handler {
        Handler::Demo(d)
    }
}

/// A demo name that is none of them.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error(
    "unknown demo {0:?}; use echo, sleep:MS (e.g. sleep:50), hang, fail, chat or stream:N:MS \
     (N chunks, one every MS ms, e.g. stream:5:100)"
)]
pub struct UnknownDemo(String);

impl std::str::FromStr for Demo {
    type Err = UnknownDemo;
    fn from_str(s: &str) -> Result<Demo, UnknownDemo> {
        match s {
            "echo" => Ok(Demo::Echo),
            "hang" => Ok(Demo::Hang),
            "fail" => Ok(Demo::Fail),
            "chat" => Ok(Demo::Chat),
            _ => {
                let bad = || UnknownDemo(s.to_string());
                if let Some(ms) = s.strip_prefix("sleep:") {
                    let ms = ms.parse::<u64>().map_err(|_| bad())?;
                    return Ok(Demo::Sleep(Duration::from_millis(ms)));
                }
                let (n, ms) = s
                    .strip_prefix("stream:")
                    .and_then(|r| r.split_once(':'))
                    .ok_or_else(bad)?;
                Ok(Demo::Stream {
                    chunks: n.parse().map_err(|_| bad())?,
                    every: Duration::from_millis(ms.parse().map_err(|_| bad())?),
                })
            }
        }
    }
}

/// One running instance.
pub struct Instance {
    pub id: String,
    entry: CatalogEntry,
    nats: async_nats::Client,
    /// The mesh's buckets, opened once for the instance's life.
    mesh: store::Mesh,
    in_flight: AtomicU64,
    processed: AtomicU64,
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, *v);
    }
    h
}

impl Instance {
    /// Connect, subscribe and register. Registration is eager: the agent is in the catalog when
    /// this returns. A refusal of the connection's credentials is told to `refused`.
    pub async fn start(
        url: &str,
        entry: CatalogEntry,
        refused: &crate::transport::connect::Refusal,
    ) -> Result<(Arc<Instance>, async_nats::Subscriber), super::RunError> {
        let id = crate::ids::random_hex(8)?;
        let name = subjects::host_connection(&id);
        let nats = crate::transport::connect::connect(url, &name, false, refused).await?;
        let sub = nats
            .queue_subscribe(
                subjects::agent(&entry.name),
                subjects::agent_queue(&entry.name),
            )
            .await?;
        let me = Arc::new(Instance {
            id,
            entry,
            mesh: store::Mesh::new(nats.clone()),
            nats,
            in_flight: AtomicU64::new(0),
            processed: AtomicU64::new(0),
        });
        store::register(&me.mesh, &me.entry, &me.id).await?;
        Ok((me, sub))
    }

    async fn reply_ok(&self, reply: async_nats::Subject, request_id: &str, body: Bytes) {
        let h = headers(&[
            (protocol::H_STATUS, "ok"),
            (protocol::H_SOURCE, &self.entry.name),
            (protocol::H_REQUEST_ID, request_id),
        ]);
        let _ = self.nats.publish_with_headers(reply, h, body).await;
    }

    /// An error for the caller, as the reply to a call or on the request's stream subject (with
    /// the end marker) for a stream; every error also goes to `mesh.errors.{name}`.
    async fn fail(
        &self,
        reply: Option<async_nats::Subject>,
        stream: Option<&str>,
        request_id: &str,
        code: ErrorCode,
        message: String,
    ) {
        let err = MeshError {
            code,
            message,
            agent: self.entry.name.clone(),
            request_id: request_id.to_string(),
            details: serde_json::json!({"instance_id": self.id}),
        };
        let mut h = headers(&[
            (protocol::H_STATUS, "error"),
            (protocol::H_REQUEST_ID, request_id),
            (protocol::H_INSTANCE_ID, &self.id),
        ]);
        let to = match stream {
            Some(subject) => {
                h.insert(protocol::H_STREAM_END, "true");
                Some(subject.into())
            }
            None => reply,
        };
        let body: Bytes = serde_json::to_vec(&err).unwrap_or_default().into();
        if let Some(to) = to {
            let _ = self
                .nats
                .publish_with_headers(to, h.clone(), body.clone())
                .await;
        }
        let _ = self
            .nats
            .publish_with_headers(subjects::errors(&self.entry.name), h, body)
            .await;
    }

    /// A streaming demo: acknowledge at once (streams are long), then `chunks` chunks echoing the
    /// request, one every `every`, then the end marker. A declared maximum handling time bounds
    /// the wait for each chunk.
    async fn stream(
        &self,
        msg: &async_nats::Message,
        request_id: &str,
        ack_to: Option<&str>,
        subject: &str,
        chunks: u32,
        every: Duration,
    ) {
        if let Some(ack_to) = ack_to {
            let _ = self
                .nats
                .publish(ack_to.to_string(), self.id.clone().into())
                .await;
        }
        let input: serde_json::Value = if msg.payload.is_empty() {
            serde_json::json!({})
        } else {
            match serde_json::from_slice(&msg.payload) {
                Ok(v) => v,
                Err(_) => {
                    let why = "the request body is not JSON".to_string();
                    return self
                        .fail(
                            None,
                            Some(subject),
                            request_id,
                            ErrorCode::InvalidInput,
                            why,
                        )
                        .await;
                }
            }
        };
        let chunk_headers = |seq: u32, end: bool| {
            let seq = seq.to_string();
            headers(&[
                (protocol::H_STREAM_SEQ, &seq),
                (protocol::H_STREAM_END, if end { "true" } else { "false" }),
                (protocol::H_REQUEST_ID, request_id),
                (protocol::H_INSTANCE_ID, &self.id),
            ])
        };
        for seq in 0..chunks {
            if let Some(limit) = self
                .entry
                .max_handling_ms
                .filter(|l| every.as_millis() > u128::from(*l))
            {
                tokio::time::sleep(Duration::from_millis(limit)).await;
                let why =
                    format!("no chunk within the declared maximum handling time of {limit} ms");
                return self
                    .fail(None, Some(subject), request_id, ErrorCode::Stuck, why)
                    .await;
            }
            tokio::time::sleep(every).await;
            let body = serde_json::json!({"index": seq, "of": chunks, "input": input});
            let body: Bytes = serde_json::to_vec(&body).unwrap_or_default().into();
            let _ = self
                .nats
                .publish_with_headers(subject.to_string(), chunk_headers(seq, false), body)
                .await;
        }
        let _ = self
            .nats
            .publish_with_headers(
                subject.to_string(),
                chunk_headers(chunks, true),
                Bytes::new(),
            )
            .await;
    }

    async fn handle(self: Arc<Self>, msg: async_nats::Message, handler: Handler) {
        fn value<'a>(msg: &'a async_nats::Message, key: &str) -> Option<&'a str> {
            msg.headers
                .as_ref()?
                .get(key)
                .map(async_nats::HeaderValue::as_str)
        }
        let header = |k: &'static str| value(&msg, k);
        // Answers, acknowledgements and chunks go to this agent's answer inboxes only (or the
        // SDK's shared one): a caller cannot make an instance running with wide rights write a
        // control subject, a bucket or another role's inbox.
        let tag = subjects::answerer_agent(&self.entry.name);
        let inbox = |s: &str| subjects::may_answer_on(&tag, s);
        let ack_to = header(protocol::H_ACK_TO).filter(|s| inbox(s));
        let reply = msg.reply.clone().filter(|s| inbox(s));
        let request_id = header(protocol::H_REQUEST_ID).unwrap_or_default();
        let wants_stream = header(protocol::H_STREAM) == Some("true");
        // An oam caller names an answer inbox of its own; other clients read the shared subject.
        let stream_to = header(protocol::H_STREAM_TO)
            .filter(|s| inbox(s))
            .map_or_else(|| subjects::stream(request_id), str::to_string);
        if wants_stream != handler.streams() {
            let message = if wants_stream {
                format!(
                    "Agent '{}' does not support streaming. Use call() instead",
                    self.entry.name
                )
            } else {
                format!(
                    "Agent '{}' is streaming-only. Use stream() instead",
                    self.entry.name
                )
            };
            self.fail(
                reply.filter(|_| !wants_stream),
                wants_stream.then_some(stream_to.as_str()),
                request_id,
                ErrorCode::InvocationMismatch,
                message,
            )
            .await;
            return;
        }
        if let Handler::Demo(Demo::Stream { chunks, every }) = handler {
            self.stream(&msg, request_id, ack_to, &stream_to, chunks, every)
                .await;
            return;
        }
        let Some(reply) = reply else {
            return; // a plain publish (or no inbox): nobody waits for an answer
        };
        let payload = if msg.payload.is_empty() {
            Bytes::from_static(b"{}")
        } else {
            msg.payload.clone()
        };
        if serde_json::from_slice::<serde::de::IgnoredAny>(&payload).is_err() {
            let why = "the request body is not JSON".to_string();
            return self
                .fail(Some(reply), None, request_id, ErrorCode::InvalidInput, why)
                .await;
        }
        let work = match &handler {
            Handler::Demo(demo) => demo.answer(&self.entry.name, payload),
            Handler::Call(f) => f(payload),
        };
        // A declared maximum handling time bounds the work: past it the caller hears `stuck`.
        let max = self.entry.max_handling_ms.map(Duration::from_millis);
        let bounded = async {
            match max {
                Some(limit) => tokio::time::timeout(limit, work).await.ok(),
                None => Some(work.await),
            }
        };
        let outcome = match ack_to {
            // "I have it": a request still running after ACK_AFTER is acknowledged with this
            // instance's id, so the caller races it against this instance's death. Answers
            // faster than that need no acknowledgement (and cost no extra message).
            Some(ack_to) => {
                tokio::pin!(bounded);
                match tokio::time::timeout(ACK_AFTER, &mut bounded).await {
                    Ok(done) => done,
                    Err(_) => {
                        let _ = self
                            .nats
                            .publish(ack_to.to_string(), self.id.clone().into())
                            .await;
                        bounded.await
                    }
                }
            }
            None => bounded.await,
        };
        match outcome {
            Some(Ok(body)) => self.reply_ok(reply, request_id, body).await,
            Some(Err((code, message))) => {
                self.fail(Some(reply), None, request_id, code, message)
                    .await;
            }
            None => {
                let limit = self.entry.max_handling_ms.unwrap_or_default();
                let why = format!(
                    "the handler ran past its declared maximum handling time of {limit} ms"
                );
                self.fail(Some(reply), None, request_id, ErrorCode::Stuck, why)
                    .await;
            }
        }
    }

    fn heartbeat(&self) -> AgentHeartbeat {
        AgentHeartbeat {
            agent: self.entry.name.clone(),
            instance_id: self.id.clone(),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            processed: self.processed.load(Ordering::Relaxed),
            at_ms: crate::clock::now_ms(),
            conn: self
                .nats
                .try_server_info()
                .map(|i| crate::mesh::protocol::conn_name(&i.server_id, i.client_id)),
        }
    }
}

/// How often the heartbeat task looks whether its connection was made again (then it beats at
/// once).
const RECONNECT_LOOK: Duration = Duration::from_millis(50);

/// After a death notice about itself, an instance registers again on this many beats.
const REREGISTER_BEATS: u32 = 3;

/// Every this many beats (10 s at the default 1 s) a live instance reads the catalog and lists
/// its agent again if another agent removed or changed its entry: one read of the catalog per
/// instance per 10 s (500 agents of one instance: 50 reads a second), and an emptied catalog
/// whole again within 10 s.
const RELIST_BEATS: u64 = 10;

/// Serve `handler` as one instance until `stop` resolves, handling up to `concurrency` requests at
/// once (further requests wait in the subscription: backpressure, not rejection); then leave
/// gracefully.
pub async fn serve(
    instance: Arc<Instance>,
    sub: async_nats::Subscriber,
    handler: Handler,
    concurrency: usize,
    heartbeat_every: Duration,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), super::RunError> {
    let me = instance.clone();
    if run(me, sub, handler, concurrency, heartbeat_every, stop).await {
        leave(&[instance]).await;
    }
    Ok(())
}

/// `serve` without the leaving: serve until `stop`, then take no new requests and finish those
/// in hand (at most `DRAIN_WITHIN`). Returns whether the bus is still there to leave on
/// (`leave`); without it nothing in hand could be answered, so it returns at once.
pub async fn run(
    instance: Arc<Instance>,
    mut sub: async_nats::Subscriber,
    handler: Handler,
    concurrency: usize,
    heartbeat_every: Duration,
    stop: impl std::future::Future<Output = ()>,
) -> bool {
    let permits = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
    // The heartbeat: the liveness signal, on a task of its own.
    let beating = {
        let me = instance.clone();
        AbortOnDrop(tokio::spawn(async move {
            // Looked at every `RECONNECT_LOOK`: a beat is due each interval, and at once on a
            // new connection (moved off a server that froze, say), so the monitor hears the
            // new connection before the old one's close can read as this instance's death.
            let mut look = tokio::time::interval(RECONNECT_LOOK.min(heartbeat_every));
            look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let bound = heartbeat_every.max(Duration::from_millis(500));
            let stats = me.nats.statistics();
            let (mut connects, mut last) = (u64::MAX, None::<tokio::time::Instant>);
            loop {
                look.tick().await;
                if me.nats.connection_state() != async_nats::connection::State::Connected {
                    continue;
                }
                let now_connects = stats.connects.load(Ordering::Relaxed);
                let due = last.is_none_or(|t| t.elapsed() >= heartbeat_every);
                if !due && now_connects == connects {
                    continue;
                }
                (connects, last) = (now_connects, Some(tokio::time::Instant::now()));
                if let Ok(b) = serde_json::to_vec(&me.heartbeat()) {
                    let sent = me.nats.publish(subjects::health(&me.entry.name), b.into());
                    if tokio::time::timeout(bound, sent).await.is_err() {
                        tracing::warn!(agent = %me.entry.name, "heartbeat not sent within {bound:?}");
                    }
                }
            }
        }))
    };
    // Its records: registered again after a reconnect or a death notice about it, its lease
    // renewed, its catalog entry checked.
    let beats = {
        let me = instance.clone();
        AbortOnDrop(tokio::spawn(async move {
            let mut beat = tokio::time::interval(heartbeat_every);
            let stats = me.nats.statistics();
            let mut connects_seen = stats.connects.load(Ordering::Relaxed);
            // A monitor that declares this instance dead (it was frozen past the heartbeat
            // verdict, say) says so here; alive after all, it registers again at once, so the
            // catalog has it back and a later death is announced again.
            let mut declared_dead =
                crate::transport::published::subscribe(&me.nats, subjects::instance_death(&me.id))
                    .await
                    .ok();
            // Beats left on which to register again after being declared dead: the monitor's
            // clean-up (it removes a dead agent from the catalog) follows its notice, and may
            // land after the first re-registration; registering on the next beats too undoes it.
            let mut revived = 0u32;
            // Beats since start, from an offset of this instance's own, so that the replicas
            // and agents that started together check the catalog at different beats.
            let mut beats = xxhash_rust::xxh3::xxh3_64(me.id.as_bytes()) % RELIST_BEATS;
            loop {
                tokio::select! {
                    _ = beat.tick() => {}
                    Some(_) = async {
                        match declared_dead.as_mut() {
                            Some(s) => s.next().await,
                            None => std::future::pending().await,
                        }
                    } => {
                        revived = REREGISTER_BEATS;
                        tracing::warn!(agent = %me.entry.name, instance = %me.id, "declared dead while alive (frozen?); registering again");
                    }
                }
                if me.nats.connection_state() != async_nats::connection::State::Connected {
                    continue;
                }
                // The records after the heartbeat (which beats on its own task: nothing the KV
                // store does may hold it up, and a store electing a leader after a server's
                // loss takes seconds). Every step is bounded, so a call the server never
                // answers (seen after a reconnect) is tried again on the next beat.
                let bound = heartbeat_every.max(Duration::from_millis(500));
                let connects = stats.connects.load(Ordering::Relaxed);
                if connects != connects_seen || revived > 0 {
                    // Back after a network blip or a freeze: the server (and its KV state) may
                    // be new, or a monitor declared us dead meanwhile. Register again.
                    let again = async {
                        store::clear_tombstone(&me.mesh, &me.id, &me.entry.name).await;
                        store::register(&me.mesh, &me.entry, &me.id).await
                    };
                    match tokio::time::timeout(bound * 4, again).await {
                        Ok(Ok(())) => {
                            connects_seen = connects;
                            revived = revived.saturating_sub(1);
                            tracing::info!(agent = %me.entry.name, instance = %me.id, "registered again");
                        }
                        Ok(Err(e)) => {
                            tracing::warn!("re-registration failed, retrying: {e:#}");
                            continue;
                        }
                        Err(_) => {
                            tracing::warn!(
                                "re-registration took longer than {:?}, retrying",
                                bound * 4
                            );
                            continue;
                        }
                    }
                }
                let renewed = store::renew(&me.mesh, &me.entry, &me.id);
                if tokio::time::timeout(bound, renewed).await.is_err() {
                    tracing::warn!(agent = %me.entry.name, "instance lease not renewed within {bound:?}");
                }
                beats = beats.wrapping_add(1);
                if beats.is_multiple_of(RELIST_BEATS) {
                    // One read while the catalog lists this agent as it should; a write only
                    // when another agent removed or changed its entry.
                    let listed = store::relist(&me.mesh, &me.entry);
                    match tokio::time::timeout(bound, listed).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            tracing::debug!(agent = %me.entry.name, "catalog entry not checked: {e:#}");
                        }
                        Err(_) => {
                            tracing::debug!(agent = %me.entry.name, "catalog entry not checked within {bound:?}");
                        }
                    }
                }
            }
        }))
    };
    let mut tasks = tokio::task::JoinSet::new();
    tokio::pin!(stop);
    loop {
        let msg = tokio::select! {
            _ = &mut stop => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            msg = sub.next() => match msg { Some(m) => m, None => break },
        };
        if subjects::from_jetstream(&msg) {
            continue; // copied here by a JetStream consumer: nobody asked
        }
        // Backpressure: at the limit, wait for a slot before taking the next request.
        let permit = tokio::select! {
            _ = &mut stop => break,
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let me = instance.clone();
        me.in_flight.fetch_add(1, Ordering::Relaxed);
        let handler = handler.clone();
        let mut work = Box::pin(async move {
            me.clone().handle(msg, handler).await;
            me.in_flight.fetch_sub(1, Ordering::Relaxed);
            me.processed.fetch_add(1, Ordering::Relaxed);
            drop(permit);
        });
        // An answer ready at once (an echo, a cached result) is sent from here; only work that
        // has to wait becomes a task of its own.
        let first = std::future::poll_fn(|cx| std::task::Poll::Ready(work.as_mut().poll(cx)));
        if first.await.is_pending() {
            tasks.spawn(work);
        }
    }
    drop((beating, beats));
    // Graceful exit: take no new requests, finish those in hand (bounded).
    let connected = instance.nats.connection_state() == async_nats::connection::State::Connected;
    let _ = sub.unsubscribe().await;
    if connected {
        let _ = tokio::time::timeout(DRAIN_WITHIN, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
    }
    tasks.abort_all();
    connected
}

/// How long a stopping instance waits for the requests in hand to finish.
pub(crate) const DRAIN_WITHIN: Duration = Duration::from_secs(5);

/// Leave gracefully, all of `instances` at once (a process's replicas): their records go, and
/// for each agent none of whose instances is left elsewhere, one `graceful_shutdown` death notice
/// (`store::leave` decides who says it), then its catalog entry and contract go. Bounded by
/// `LEAVE_WITHIN`: a bus that went away mid-goodbye must not hold the process (the monitor
/// announces the death from the disconnect instead).
pub async fn leave(instances: &[Arc<Instance>]) {
    let mut agents: std::collections::BTreeMap<&str, Vec<&Arc<Instance>>> = Default::default();
    for i in instances {
        if i.nats.connection_state() == async_nats::connection::State::Connected {
            agents.entry(i.entry.name.as_str()).or_default().push(i);
        }
    }
    let goodbyes = agents.into_iter().map(|(agent, group)| async move {
        let ids: Vec<String> = group.iter().map(|i| i.id.clone()).collect();
        let me = group[0];
        if store::leave(&me.mesh, agent, &ids).await {
            let notice = DeathNotice {
                agent: agent.to_string(),
                reason: DeathReason::GracefulShutdown,
                detected_at: store::rfc3339_now(),
                instance_id: me.id.clone(),
                detail: None,
                detected_at_ms: Some(crate::clock::now_ms()),
            };
            if let Ok(b) = serde_json::to_vec(&notice) {
                let _ = me.nats.publish(subjects::death(agent), b.into()).await;
            }
            let _ = me.nats.flush().await;
            store::forget_agents(&me.mesh, &[agent.to_string()]).await;
        }
    });
    let all = futures_util::future::join_all(goodbyes);
    if tokio::time::timeout(LEAVE_WITHIN, all).await.is_err() {
        tracing::warn!(
            instances = instances.len(),
            "could not say goodbye within {} s",
            LEAVE_WITHIN.as_secs()
        );
    }
}

/// How long leaving instances may take to deregister and announce their exit.
pub(crate) const LEAVE_WITHIN: Duration = Duration::from_secs(2);

/// A task that ends when its handle is dropped (so aborting `serve` also stops its heartbeats and
/// lets the instance's connection close, like a crash).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demos_parse_or_list_the_valid_ones() {
        assert_eq!("echo".parse::<Demo>(), Ok(Demo::Echo));
        assert_eq!(
            "sleep:50".parse::<Demo>(),
            Ok(Demo::Sleep(Duration::from_millis(50)))
        );
        let err = "sleep:soon".parse::<Demo>().unwrap_err();
        assert_eq!(err, UnknownDemo("sleep:soon".into()));
        assert!(err.to_string().contains("echo, sleep:MS"), "{err}");
    }
}
