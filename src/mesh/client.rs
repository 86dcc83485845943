//! Calling agents on the mesh: request/reply on `mesh.agent.{name}` with a request id, and every
//! failure turned into a `MeshError` with its code (no responders -> `not_found`, or
//! `not_available` when the catalog lists the agent; no answer in time -> `timeout`).

use super::protocol::{self, ErrorCode, MeshError};
use super::store;
use crate::transport::ask::{AskError, Asker, Inbox};
use crate::transport::published::subscribe;
use crate::transport::subjects;
use async_nats::HeaderMap;
use bytes::Bytes;
use std::time::Duration;

fn error(code: ErrorCode, agent: &str, request_id: &str, message: String) -> MeshError {
    MeshError {
        code,
        message,
        agent: agent.to_string(),
        request_id: request_id.to_string(),
        details: serde_json::Value::Object(Default::default()),
    }
}

/// Call `agent` with `payload`; the reply body on success. (For fail-fast calls that watch the
/// serving instance's death, and for many calls, use `Caller`.)
pub async fn call(
    nats: &async_nats::Client,
    agent: &str,
    payload: Bytes,
    timeout: Duration,
) -> Result<Bytes, MeshError> {
    let request_id = request_id();
    let asker = Asker::new(nats.clone()).await.map_err(|e| {
        error(
            ErrorCode::Unknown,
            agent,
            &request_id,
            format!("cannot listen for the answer: {e}"),
        )
    })?;
    call_with(&asker, nats, agent, payload, timeout, &request_id, None)
        .await
        .map(|(payload, _)| payload)
}

/// A request id (32 hex digits) nobody can predict from the ones they have seen: it names the
/// caller's acknowledgement subject, so an agent that served one call must not guess the next.
pub fn request_id() -> String {
    crate::ids::unguessable()
}

/// Nobody answered: `not_available` when the catalog lists the agent, else `not_found`.
async fn unanswered(nats: &async_nats::Client, agent: &str, request_id: &str) -> MeshError {
    let listed = store::catalog(&store::Mesh::new(nats.clone()))
        .await
        .unwrap_or_default()
        .iter()
        .any(|c| c.name == agent);
    let (code, message) = if listed {
        (
            ErrorCode::NotAvailable,
            format!("{agent} is in the catalog but no instance answers"),
        )
    } else {
        (
            ErrorCode::NotFound,
            format!("no agent named {agent} on the mesh"),
        )
    };
    error(code, agent, request_id, message)
}

fn invalid_name(agent: &str, request_id: &str) -> Option<MeshError> {
    (!protocol::valid_agent_name(agent)).then(|| {
        error(
            ErrorCode::InvalidInput,
            agent,
            request_id,
            "agent names are dot-separated segments of letters, digits, '-' and '_'".into(),
        )
    })
}

async fn call_with(
    asker: &Asker,
    nats: &async_nats::Client,
    agent: &str,
    payload: Bytes,
    timeout: Duration,
    request_id: &str,
    ack_to: Option<&str>,
) -> Result<(Bytes, Option<protocol::Usage>), MeshError> {
    let request_id = request_id.to_string();
    if let Some(e) = invalid_name(agent, &request_id) {
        return Err(e);
    }
    let mut h = HeaderMap::new();
    h.insert(protocol::H_REQUEST_ID, request_id.as_str());
    if let Some(ack_to) = ack_to {
        h.insert(protocol::H_ACK_TO, ack_to);
    }
    let tag = subjects::answerer_agent(agent);
    let asked = asker.ask(&tag, subjects::agent(agent), h, payload, timeout);
    let reply = match asked.await {
        Err(AskError::TimedOut) => {
            return Err(error(
                ErrorCode::Timeout,
                agent,
                &request_id,
                format!("no answer within {} ms", timeout.as_millis()),
            ));
        }
        Err(AskError::NoResponders) => {
            return Err(unanswered(nats, agent, &request_id).await);
        }
        Err(e) => {
            return Err(error(
                ErrorCode::Unknown,
                agent,
                &request_id,
                format!("the request failed: {e}"),
            ));
        }
        Ok(m) => m,
    };
    let status = reply
        .headers
        .as_ref()
        .and_then(|h| h.get(protocol::H_STATUS))
        .map(|v| v.as_str().to_string());
    if status.as_deref() == Some("error") {
        return Err(serde_json::from_slice(&reply.payload).unwrap_or_else(|_| {
            error(
                ErrorCode::Unknown,
                agent,
                &request_id,
                String::from_utf8_lossy(&reply.payload).into_owned(),
            )
        }));
    }
    let usage = reply
        .headers
        .as_ref()
        .and_then(|h| h.get(protocol::H_USAGE))
        .and_then(|v| protocol::Usage::parse(v.as_str()));
    Ok((
        if reply.payload.is_empty() {
            Bytes::from_static(b"{}")
        } else {
            reply.payload
        },
        usage,
    ))
}

/// A caller that fails fast: every call races against the death of the instance that
/// acknowledged it (or, for agents that do not acknowledge, of the agent itself). One shared
/// subscription each for acknowledgements and deaths per client, not one per call.
pub struct Caller {
    nats: async_nats::Client,
    asker: Asker,
    /// Where instances acknowledge, each under its agent's answerer token.
    acks: Inbox,
    pending: Arc<Mutex<HashMap<String, AwaitedCall>>>,
    _watch: tokio::task::JoinHandle<()>,
}

struct AwaitedCall {
    agent: String,
    /// When the call was made (wall clock, ms), to tell deaths before it from deaths after.
    started_ms: u64,
    instance: Option<String>,
    fate: Option<tokio::sync::oneshot::Sender<Fate>>,
}

/// A pending call's place, given up when this is dropped.
struct Forget<'a> {
    pending: &'a Mutex<HashMap<String, AwaitedCall>>,
    request_id: &'a str,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        pending_map(self.pending).remove(self.request_id);
    }
}

/// What ends a pending request early.
enum Fate {
    /// The instance holding it (or the agent) died.
    Died(MeshError),
    /// The server said nobody subscribes (a stream request's no-responders status).
    NoResponders,
}

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

fn pending_map(
    m: &Mutex<HashMap<String, AwaitedCall>>,
) -> std::sync::MutexGuard<'_, HashMap<String, AwaitedCall>> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Caller {
    pub async fn new(nats: async_nats::Client) -> Result<Caller, super::RunError> {
        use futures_util::StreamExt;
        // Under each agent's answerer token: only the agent called may acknowledge its call.
        let ack_inbox = Inbox::new(&nats);
        let mut acks = subscribe(&nats, ack_inbox.every()).await?;
        let asker = Asker::new(nats.clone()).await?;
        let mut instance_deaths = subscribe(&nats, subjects::INSTANCE_DEATHS).await?;
        let mut deaths = subscribe(&nats, subjects::DEATHS).await?;
        nats.flush().await?;
        let pending: Arc<Mutex<HashMap<String, AwaitedCall>>> = Arc::default();
        let (p, a) = (pending.clone(), ack_inbox.clone());
        let watch = tokio::spawn(async move {
            let fail = |p: &Mutex<HashMap<String, AwaitedCall>>,
                        pred: &dyn Fn(&AwaitedCall) -> bool,
                        notice: &protocol::DeathNotice| {
                for (rid, call) in pending_map(p).iter_mut().filter(|(_, c)| pred(c)) {
                    if let Some(tx) = call.fate.take() {
                        let _ = tx.send(Fate::Died(MeshError {
                            code: ErrorCode::AgentDied,
                            message: format!(
                                "instance {} of {} died holding the request ({:?})",
                                notice.instance_id, call.agent, notice.reason
                            ),
                            agent: call.agent.clone(),
                            request_id: rid.clone(),
                            details: serde_json::json!({"instance_id": notice.instance_id, "reason": notice.reason, "detail": notice.detail}),
                        }));
                    }
                }
            };
            loop {
                tokio::select! {
                    Some(m) = acks.next() => {
                        let rid = m.subject.rsplit_once('.').map_or("", |(_, rid)| rid);
                        let mut pending = pending_map(&p);
                        let Some(call) = pending.get_mut(rid) else { continue };
                        let tag = subjects::answerer_agent(&call.agent);
                        if a.token_of(&m.subject, &tag).is_none() {
                            continue; // another agent's doing: the server let it write there
                        }
                        if m.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
                            if let Some(tx) = call.fate.take() {
                                let _ = tx.send(Fate::NoResponders);
                            }
                        } else if call.instance.is_none() {
                            // The first acknowledgement names the instance; a second one (a
                            // serving agent naming another instance) changes nothing.
                            call.instance = Some(String::from_utf8_lossy(&m.payload).into_owned());
                        }
                    }
                    Some(m) = instance_deaths.next() => {
                        if let Ok(n) = serde_json::from_slice::<protocol::DeathNotice>(&m.payload) {
                            // The monitor names the instance's agent: an instance id an agent claimed
                            // for itself fails only calls to that agent.
                            let held = |c: &AwaitedCall| c.instance.as_deref() == Some(n.instance_id.as_str())
                                && (n.agent.is_empty() || n.agent == c.agent);
                            fail(&p, &held, &n);
                        }
                    }
                    Some(m) = deaths.next() => {
                        if let Ok(n) = serde_json::from_slice::<protocol::DeathNotice>(&m.payload) {
                            // The agent's death fails the calls made before it; one made after
                            // it either finds nobody (not_found at once) or a new instance. A
                            // call made in the millisecond the death was detected came after the
                            // death itself, so it is left to find out for itself.
                            let before = |c: &AwaitedCall| n.detected_at_ms.is_none_or(|t| c.started_ms < t);
                            fail(&p, &|c: &AwaitedCall| c.agent == n.agent && before(c), &n);
                        }
                    }
                    else => return,
                }
            }
        });
        Ok(Caller {
            nats,
            asker,
            acks: ack_inbox,
            pending,
            _watch: watch,
        })
    }

    fn expect(&self, agent: &str) -> (String, tokio::sync::oneshot::Receiver<Fate>) {
        let request_id = request_id();
        let (tx, fate) = tokio::sync::oneshot::channel();
        pending_map(&self.pending).insert(
            request_id.clone(),
            AwaitedCall {
                agent: agent.to_string(),
                started_ms: crate::clock::now_ms(),
                instance: None,
                fate: Some(tx),
            },
        );
        (request_id, fate)
    }

    /// How many calls and streams wait on this caller now.
    pub fn waiting(&self) -> usize {
        pending_map(&self.pending).len()
    }

    /// Call `agent`; fails with `agent_died` as soon as the instance holding the request dies.
    pub async fn call(
        &self,
        agent: &str,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, MeshError> {
        self.call_reporting(agent, payload, timeout)
            .await
            .map(|(payload, _)| payload)
    }

    /// `call`, with the model use the agent reported for its answer (`X-Mesh-Usage`), if any.
    pub async fn call_reporting(
        &self,
        agent: &str,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<(Bytes, Option<protocol::Usage>), MeshError> {
        let (request_id, fate) = self.expect(agent);
        // Forgotten however the call ends, dropped by a caller that gave up included: a caller
        // shared for a process's life (a node's) must not keep the calls it stopped waiting for.
        let _forget = Forget {
            pending: &self.pending,
            request_id: &request_id,
        };
        let ack_to = self.acks.at(&subjects::answerer_agent(agent), &request_id);
        tokio::select! {
            r = call_with(&self.asker, &self.nats, agent, payload, timeout, &request_id, Some(&ack_to)) => r,
            Ok(Fate::Died(e)) = fate => Err(e),
        }
    }

    /// Start a streaming request: chunks arrive in sequence until the end marker, from an oam
    /// agent in an answer inbox of this call's own under the agent's answerer token (named in
    /// `X-Mesh-Stream-To`: nobody else can read them, and no other role write them), on
    /// `mesh.stream.{request_id}` from other Open Agent Mesh clients; the first chunk decides
    /// which, and the other is then ignored. Fails fast like `call`: no responders at once,
    /// `agent_died` as soon as the instance serving the stream dies, `timeout` when the whole
    /// stream takes longer than `timeout`.
    pub async fn stream(
        &self,
        agent: &str,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<ChunkStream, MeshError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let (request_id, fate) = self.expect(agent);
        let mut stream = ChunkStream {
            nats: self.nats.clone(),
            pending: self.pending.clone(),
            sub: None,
            shared: None,
            fate,
            agent: agent.to_string(),
            request_id: request_id.clone(),
            deadline,
            next_seq: 0,
            done: false,
        };
        if let Some(e) = invalid_name(agent, &request_id) {
            return Err(e);
        }
        let broken = |e: &dyn std::fmt::Display| {
            error(
                ErrorCode::Unknown,
                agent,
                &request_id,
                format!("cannot start the stream: {e}"),
            )
        };
        // Chunks from the agent called only: under its answerer token, on a subject of this
        // stream's own.
        let tag = subjects::answerer_agent(agent);
        let private = Inbox::new(&self.nats).at(&tag, "chunks");
        let sub = self
            .nats
            .subscribe(private.clone())
            .await
            .map_err(|e| broken(&e))?;
        stream.sub = Some(sub);
        // Where an SDK agent streams, for a client that may read it (asking without the right
        // only earns a permissions violation from the server).
        if subjects::may_read_shared(&self.nats.new_inbox()) {
            stream.shared = self
                .nats
                .subscribe(subjects::stream(&request_id))
                .await
                .ok();
        }
        let ack_to = self.acks.at(&tag, &request_id);
        let mut h = HeaderMap::new();
        h.insert(protocol::H_REQUEST_ID, request_id.as_str());
        h.insert(protocol::H_STREAM, "true");
        h.insert(protocol::H_ACK_TO, ack_to.as_str());
        h.insert(protocol::H_STREAM_TO, private.as_str());
        // The reply subject is only there so the server reports "no responders" on it; chunks
        // come on the stream subject (as other Open Agent Mesh clients expect).
        self.nats
            .publish_with_reply_and_headers(subjects::agent(agent), ack_to.clone(), h, payload)
            .await
            .map_err(|e| broken(&e))?;
        Ok(stream)
    }
}

/// The chunks of one streaming request, in order. Dropping it abandons the stream.
pub struct ChunkStream {
    nats: async_nats::Client,
    pending: Arc<Mutex<HashMap<String, AwaitedCall>>>,
    /// The answer inbox the chunks of an oam agent come to.
    sub: Option<async_nats::Subscriber>,
    /// `mesh.stream.{request_id}`, where other clients' agents stream; dropped once a chunk has
    /// come privately.
    shared: Option<async_nats::Subscriber>,
    fate: tokio::sync::oneshot::Receiver<Fate>,
    agent: String,
    request_id: String,
    deadline: tokio::time::Instant,
    next_seq: u64,
    done: bool,
}

impl ChunkStream {
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The next chunk; `None` after the end marker or after an error has been returned.
    pub async fn next(&mut self) -> Option<Result<Bytes, MeshError>> {
        use futures_util::StreamExt;
        if self.done {
            return None;
        }
        if self.sub.is_none() && self.shared.is_none() {
            return None;
        }
        async fn next_of(s: &mut Option<async_nats::Subscriber>) -> Option<async_nats::Message> {
            let Some(s) = s.as_mut() else {
                return std::future::pending().await;
            };
            loop {
                match s.next().await {
                    Some(m) if subjects::from_jetstream(&m) => {} // copied by a consumer
                    other => return other,
                }
            }
        }
        // In the answer inbox, only what the serving instance sent is believed: it carries
        // the request id (which only this caller, the server and the instance the request went
        // to know) and, once the stream is acknowledged, that instance's id. Anything else
        // (another agent or a node writing into this inbox) is skipped, not the stream's end.
        let event = loop {
            let (private, shared) = (&mut self.sub, &mut self.shared);
            let event = tokio::select! {
                m = next_of(private) => Ok((m, true)),
                Some(m) = next_of(shared) => Ok((Some(m), false)),
                fate = &mut self.fate => Err(Some(fate)),
                _ = tokio::time::sleep_until(self.deadline) => Err(None),
            };
            if let Ok((Some(m), true)) = &event
                && !self.sent_by_serving_instance(m)
            {
                tracing::warn!(
                    agent = self.agent,
                    request_id = self.request_id,
                    "a message in a stream's inbox that its agent did not send; skipped"
                );
                continue;
            }
            break event;
        };
        // The first chunk decides where the rest comes from: privately from an oam agent (the
        // shared subject is then nobody's to write into), or on the shared subject from another
        // client's agent.
        let acked = || {
            pending_map(&self.pending)
                .get(&self.request_id)
                .is_some_and(|c| c.instance.is_some())
        };
        let event = match event {
            Ok((_, false)) if acked() => {
                // An oam agent acknowledged the stream (other clients' agents do not), so it
                // streams privately: whatever comes on the shared subject is forged.
                self.shared = None;
                return Box::pin(self.next()).await;
            }
            Ok((m, private)) => {
                if private {
                    self.shared = None;
                } else {
                    self.sub = None;
                }
                Ok(m)
            }
            Err(e) => Err(e),
        };
        let outcome = match event {
            Ok(Some(m)) => {
                let header = |k: &str| {
                    m.headers
                        .as_ref()
                        .and_then(|h| h.get(k))
                        .map(|v| v.as_str().to_string())
                };
                let seq = header(protocol::H_STREAM_SEQ).and_then(|s| s.parse::<u64>().ok());
                if header(protocol::H_STATUS).as_deref() == Some("error") {
                    Some(Err(serde_json::from_slice(&m.payload).unwrap_or_else(
                        |_| {
                            let text = String::from_utf8_lossy(&m.payload).into_owned();
                            self.error(ErrorCode::Unknown, text)
                        },
                    )))
                } else if header(protocol::H_STREAM_END).as_deref() == Some("true") {
                    // An end marker that skips chunks ends a cut stream, never a clean one.
                    match seq {
                        Some(seq) if seq != self.next_seq => {
                            let message = format!("ended at chunk {seq}, {} came", self.next_seq);
                            Some(Err(self.error(ErrorCode::ChunkSequenceError, message)))
                        }
                        _ => None,
                    }
                } else if seq != Some(self.next_seq) {
                    let message = format!("expected chunk {}, got {seq:?}", self.next_seq);
                    Some(Err(self.error(ErrorCode::ChunkSequenceError, message)))
                } else {
                    self.next_seq += 1;
                    return Some(Ok(m.payload));
                }
            }
            Ok(None) => Some(Err(
                self.error(ErrorCode::Unknown, "the connection closed".into())
            )),
            Err(Some(Ok(Fate::Died(e)))) => Some(Err(e)),
            Err(Some(Ok(Fate::NoResponders))) => {
                Some(Err(
                    unanswered(&self.nats, &self.agent, &self.request_id).await
                ))
            }
            Err(Some(Err(_))) => Some(Err(
                self.error(ErrorCode::Unknown, "the caller closed".into())
            )),
            Err(None) => Some(Err(
                self.error(ErrorCode::Timeout, "the stream did not end in time".into())
            )),
        };
        self.done = true;
        outcome
    }

    fn error(&self, code: ErrorCode, message: String) -> MeshError {
        error(code, &self.agent, &self.request_id, message)
    }

    /// `m` names this stream's request and (once acknowledged) the instance serving it.
    fn sent_by_serving_instance(&self, m: &async_nats::Message) -> bool {
        let header = |k: &str| {
            m.headers
                .as_ref()
                .and_then(|h| h.get(k))
                .map(async_nats::HeaderValue::as_str)
        };
        if header(protocol::H_REQUEST_ID) != Some(self.request_id.as_str()) {
            return false;
        }
        let acked = pending_map(&self.pending)
            .get(&self.request_id)
            .and_then(|c| c.instance.clone());
        acked.is_none_or(|id| header(protocol::H_INSTANCE_ID) == Some(id.as_str()))
    }
}

impl Drop for ChunkStream {
    fn drop(&mut self) {
        pending_map(&self.pending).remove(&self.request_id);
    }
}

impl Drop for Caller {
    fn drop(&mut self) {
        self._watch.abort();
    }
}
