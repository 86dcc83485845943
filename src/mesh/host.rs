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
}

impl std::str::FromStr for Demo {
    type Err = String;
    fn from_str(s: &str) -> Result<Demo, String> {
        match s {
            "echo" => Ok(Demo::Echo),
            "hang" => Ok(Demo::Hang),
            "fail" => Ok(Demo::Fail),
            "chat" => Ok(Demo::Chat),
            _ => match s.strip_prefix("sleep:").map(str::parse::<u64>) {
                Some(Ok(ms)) => Ok(Demo::Sleep(Duration::from_millis(ms))),
                _ => Err(format!(
                    "unknown demo {s:?}; use echo, sleep:MS (e.g. sleep:50), hang, fail or chat"
                )),
            },
        }
    }
}

/// One running instance.
pub struct Instance {
    pub id: String,
    entry: CatalogEntry,
    nats: async_nats::Client,
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
    /// this returns.
    pub async fn start(
        url: &str,
        entry: CatalogEntry,
    ) -> anyhow::Result<(Arc<Instance>, async_nats::Subscriber)> {
        let id = crate::natsd::random_hex(8)?;
        let nats =
            crate::transport::connect::connect(url, &subjects::host_connection(&id), false).await?;
        let sub = nats
            .queue_subscribe(
                subjects::agent(&entry.name),
                subjects::agent_queue(&entry.name),
            )
            .await?;
        let me = Arc::new(Instance {
            id,
            entry,
            nats,
            in_flight: AtomicU64::new(0),
            processed: AtomicU64::new(0),
        });
        store::register(&me.nats, &me.entry, &me.id).await?;
        Ok((me, sub))
    }

    async fn reply_ok(&self, reply: async_nats::Subject, request_id: &str, body: Bytes) {
        let h = headers(&[
            (protocol::H_STATUS, "ok"),
            (protocol::H_SOURCE, &self.entry.name),
            (protocol::H_REQUEST_ID, request_id),
            (protocol::H_INSTANCE_ID, &self.id),
        ]);
        let _ = self.nats.publish_with_headers(reply, h, body).await;
    }

    async fn reply_error(
        &self,
        reply: Option<async_nats::Subject>,
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
        let body: Bytes = serde_json::to_vec(&err).unwrap_or_default().into();
        let h = headers(&[
            (protocol::H_STATUS, "error"),
            (protocol::H_REQUEST_ID, request_id),
            (protocol::H_INSTANCE_ID, &self.id),
        ]);
        if let Some(reply) = reply {
            let _ = self
                .nats
                .publish_with_headers(reply, h.clone(), body.clone())
                .await;
        }
        let _ = self
            .nats
            .publish_with_headers(subjects::errors(&self.entry.name), h, body)
            .await;
    }

    async fn handle(self: Arc<Self>, msg: async_nats::Message, demo: Demo) {
        let header = |k: &str| {
            msg.headers
                .as_ref()
                .and_then(|h| h.get(k))
                .map(|v| v.as_str().to_string())
        };
        let request_id = header(protocol::H_REQUEST_ID).unwrap_or_default();
        if header(protocol::H_STREAM).as_deref() == Some("true") {
            // Demo agents only answer calls; say so on the stream subject the caller listens on.
            let err = MeshError {
                code: ErrorCode::InvocationMismatch,
                message: format!(
                    "Agent '{}' does not support streaming. Use call() instead",
                    self.entry.name
                ),
                agent: self.entry.name.clone(),
                request_id: request_id.clone(),
                details: serde_json::Value::Object(Default::default()),
            };
            let h = headers(&[
                (protocol::H_STATUS, "error"),
                (protocol::H_STREAM_END, "true"),
                (protocol::H_REQUEST_ID, &request_id),
            ]);
            let body: Bytes = serde_json::to_vec(&err).unwrap_or_default().into();
            let _ = self
                .nats
                .publish_with_headers(subjects::stream(&request_id), h, body)
                .await;
            return;
        }
        let Some(reply) = msg.reply.clone() else {
            return; // a plain publish: nobody waits for an answer
        };
        // The handler's own work. Demo handlers are trivial; a real one would run here.
        let work = async {
            match demo {
                Demo::Echo | Demo::Fail | Demo::Chat => {}
                Demo::Sleep(d) => tokio::time::sleep(d).await,
                Demo::Hang => std::future::pending::<()>().await,
            }
        };
        // A declared maximum handling time bounds the work: past it the caller hears `stuck`.
        let max = self.entry.max_handling_ms.map(Duration::from_millis);
        let bounded = async {
            match max {
                Some(limit) => tokio::time::timeout(limit, work).await.is_ok(),
                None => {
                    work.await;
                    true
                }
            }
        };
        let finished = match header(protocol::H_ACK_TO) {
            // "I have it": a request still running after ACK_AFTER is acknowledged with this
            // instance's id, so the caller races it against this instance's death. Answers
            // faster than that need no acknowledgement (and cost no extra message).
            Some(ack_to) => {
                tokio::pin!(bounded);
                match tokio::time::timeout(ACK_AFTER, &mut bounded).await {
                    Ok(done) => done,
                    Err(_) => {
                        let _ = self.nats.publish(ack_to, self.id.clone().into()).await;
                        bounded.await
                    }
                }
            }
            None => bounded.await,
        };
        if !finished {
            let limit = self.entry.max_handling_ms.unwrap_or_default();
            self.reply_error(
                Some(reply),
                &request_id,
                ErrorCode::Stuck,
                format!("the handler ran past its declared maximum handling time of {limit} ms"),
            )
            .await;
            return;
        }
        match demo {
            Demo::Echo | Demo::Sleep(_) | Demo::Hang => {}
            Demo::Chat => {
                let content = serde_json::json!({
                    "answer": format!("{} answers", self.entry.name),
                    "confidence": 0.9,
                })
                .to_string();
                let body = serde_json::json!({
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9},
                });
                let bytes = serde_json::to_vec(&body).unwrap_or_default();
                self.reply_ok(reply, &request_id, bytes.into()).await;
                return;
            }
            Demo::Fail => {
                self.reply_error(
                    Some(reply),
                    &request_id,
                    ErrorCode::HandlerError,
                    "demo agent fails on purpose".into(),
                )
                .await;
                return;
            }
        }
        let body = if msg.payload.is_empty() {
            Bytes::from_static(b"{}")
        } else {
            msg.payload.clone()
        };
        if serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_err() {
            self.reply_error(
                Some(reply),
                &request_id,
                ErrorCode::InvalidInput,
                "the request body is not JSON".into(),
            )
            .await;
            return;
        }
        self.reply_ok(reply, &request_id, body).await;
    }

    fn heartbeat(&self) -> AgentHeartbeat {
        AgentHeartbeat {
            agent: self.entry.name.clone(),
            instance_id: self.id.clone(),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            processed: self.processed.load(Ordering::Relaxed),
            at_ms: crate::node::now_ms(),
        }
    }
}

/// Serve `demo` as one instance until `stop` resolves, handling up to `concurrency` requests at
/// once (further requests wait in the subscription: backpressure, not rejection).
pub async fn serve(
    instance: Arc<Instance>,
    mut sub: async_nats::Subscriber,
    demo: Demo,
    concurrency: usize,
    heartbeat_every: Duration,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let permits = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
    let beats = {
        let me = instance.clone();
        tokio::spawn(async move {
            let mut beat = tokio::time::interval(heartbeat_every);
            let stats = me.nats.statistics();
            let mut connects_seen = stats.connects.load(Ordering::Relaxed);
            loop {
                beat.tick().await;
                if me.nats.connection_state() != async_nats::connection::State::Connected {
                    continue;
                }
                let connects = stats.connects.load(Ordering::Relaxed);
                if connects != connects_seen {
                    // Back after a network blip: the server (and its KV state) may be new, or a
                    // monitor may have declared us dead meanwhile. Register again.
                    store::clear_tombstone(&me.nats, &me.id).await;
                    match store::register(&me.nats, &me.entry, &me.id).await {
                        Ok(()) => {
                            connects_seen = connects;
                            tracing::info!(agent = %me.entry.name, instance = %me.id, "re-registered after reconnecting");
                        }
                        Err(e) => {
                            tracing::warn!("re-registration failed, retrying: {e:#}");
                            continue;
                        }
                    }
                }
                if let Ok(b) = serde_json::to_vec(&me.heartbeat()) {
                    let _ = me
                        .nats
                        .publish(subjects::health(&me.entry.name), b.into())
                        .await;
                }
                store::renew(&me.nats, &me.entry, &me.id).await;
            }
        })
    };
    let mut tasks = tokio::task::JoinSet::new();
    tokio::pin!(stop);
    loop {
        let msg = tokio::select! {
            _ = &mut stop => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            msg = sub.next() => match msg { Some(m) => m, None => break },
        };
        // Backpressure: at the limit, wait for a slot before taking the next request.
        let permit = tokio::select! {
            _ = &mut stop => break,
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let me = instance.clone();
        me.in_flight.fetch_add(1, Ordering::Relaxed);
        tasks.spawn(async move {
            me.clone().handle(msg, demo).await;
            me.in_flight.fetch_sub(1, Ordering::Relaxed);
            me.processed.fetch_add(1, Ordering::Relaxed);
            drop(permit);
        });
    }
    beats.abort();
    // Graceful exit: take no new requests, finish those in hand (bounded), then leave.
    let _ = sub.unsubscribe().await;
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    tasks.abort_all();
    let last = store::deregister(&instance.nats, &instance.entry, &instance.id).await;
    if last {
        let notice = DeathNotice {
            agent: instance.entry.name.clone(),
            reason: DeathReason::GracefulShutdown,
            detected_at: store::rfc3339_now(),
            instance_id: instance.id.clone(),
            detail: None,
        };
        if let Ok(b) = serde_json::to_vec(&notice) {
            let _ = instance
                .nats
                .publish(subjects::death(&instance.entry.name), b.into())
                .await;
        }
    }
    let _ = instance.nats.flush().await;
    Ok(())
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
        assert!(err.contains("echo, sleep:MS"), "{err}");
    }
}
