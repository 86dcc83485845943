//! The request path on NATS: requests on `oam.v1.request` (queue group `oam-nodes`), the reply
//! the HTTP body with `status` added. At most `node.max_connections` requests are in hand at
//! once (as on HTTP); past that the node stops taking messages until one ends.

use super::Node;
use super::http::too_large;
use super::request::{Answer, execute};
use crate::transport::subjects;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

/// The same data plane on NATS: requests on `oam.v1.request` (queue group `oam-nodes`), the
/// reply is the HTTP body with `status` and the `X-OAM-*` values added to its `oam` object.
/// When the node stops it leaves the queue group, answers what the server had already sent it,
/// and returns.
pub(crate) async fn serve(node: Arc<Node>) -> Result<(), super::NodeError> {
    let in_hand = Arc::new(tokio::sync::Semaphore::new(node.cfg.node.max_connections));
    loop {
        // Isolated (chaos): not a member of the queue group until reconnected.
        while node.bus.isolated() {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
                () = node.serving.stop.cancelled() => return Ok(()),
            }
        }
        let mut sub = node
            .bus
            .nats()
            .queue_subscribe(subjects::REQUEST, subjects::REQUEST_QUEUE.into())
            .await?;
        loop {
            // Registered before the check, so an isolation between the two is not missed.
            let changed = node.bus.isolation_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if node.bus.isolated() {
                break;
            }
            // A place for the next request first: past the bound, messages wait with the server.
            let permit = tokio::select! {
                biased;
                () = node.serving.stop.cancelled() => None,
                _ = &mut changed => break,
                p = in_hand.clone().acquire_owned() => Some(p?),
            };
            let next = match permit {
                None => None,
                Some(permit) => tokio::select! {
                    biased;
                    () = node.serving.stop.cancelled() => None,
                    _ = changed => break,
                    m = sub.next() => match m {
                        Some(m) => Some((m, permit)),
                        None => return Ok(()),
                    },
                },
            };
            let Some((msg, permit)) = next else {
                return leave(&node, sub, &in_hand).await;
            };
            serve_one(&node, msg, permit);
        }
        let _ = sub.unsubscribe().await;
    }
}

/// The node stops: leave the queue group, and answer what the server had sent already.
async fn leave(
    node: &Arc<Node>,
    mut sub: async_nats::Subscriber,
    in_hand: &Arc<tokio::sync::Semaphore>,
) -> Result<(), super::NodeError> {
    // Without a bus there is nothing to leave and nothing more will arrive.
    if node.bus.nats().connection_state() != async_nats::connection::State::Connected {
        return Ok(());
    }
    let _ = sub.drain().await;
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(1), sub.next()).await {
        let permit = in_hand.clone().acquire_owned().await?;
        serve_one(node, m, permit);
    }
    Ok(())
}

/// Answer one request from the NATS data plane, on its own task.
fn serve_one(node: &Arc<Node>, msg: async_nats::Message, permit: OwnedSemaphorePermit) {
    if subjects::from_jetstream(&msg) {
        return; // copied here by a JetStream consumer: nobody asked
    }
    let node = node.clone();
    node.clone().serving.tasks.spawn(async move {
        let _in_hand = permit;
        // Answers go to the nodes' answer inboxes only, whatever subject the asker named.
        let reply = msg.reply.clone();
        let Some(reply) = reply.filter(|r| subjects::may_answer_on(subjects::ANSWERER_NODES, r))
        else {
            return; // no reply inbox: nobody to answer
        };
        let headers = msg.headers.as_ref().map(headers_of).unwrap_or_default();
        // The same body limit as HTTP. A NATS requester that gives up cannot be seen; its
        // request runs to the end.
        let a = if msg.payload.len() > node.cfg.node.max_body_bytes {
            too_large(&node, &headers)
        } else {
            execute(
                &node,
                &msg.payload,
                &headers,
                CancellationToken::new(),
                super::request::Asks::Answer {
                    api: &super::api::openai::Chat,
                    live: false,
                },
            )
            .await
        };
        let bytes = reply_of(&a);
        if let Err(e) = node.bus.nats().publish(reply, bytes.into()).await {
            tracing::debug!("cannot reply on NATS: {e}");
        }
    });
}

/// A NATS message's headers as the request stages read HTTP's: the first value of each, and
/// none that HTTP could not carry.
fn headers_of(h: &async_nats::HeaderMap) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, values) in h.iter() {
        let Ok(name) = HeaderName::from_bytes(name.to_string().as_bytes()) else {
            continue;
        };
        if let Some(v) = values.first()
            && let Ok(v) = HeaderValue::from_str(v.as_str())
        {
            headers.insert(name, v);
        }
    }
    headers
}

/// The reply: the HTTP answer's body with its status as a member (the upstream's own
/// `status`, if its answer had one, gives way).
fn reply_of(a: &Answer) -> Vec<u8> {
    let status = a.status.as_u16().to_string();
    super::exchange::set_member(&a.body, "status", status.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    #[test]
    fn headers_cross_from_nats_as_http_reads_them() {
        let mut h = async_nats::HeaderMap::new();
        h.insert("X-OAM-Agent", "planner");
        h.append("X-Request-Id", "first");
        h.append("X-Request-Id", "second");
        h.insert("bad(name)", "x");
        h.insert("X-Control", "a\u{1}b");
        let got = headers_of(&h);
        assert_eq!(got["x-oam-agent"], "planner", "names compare as HTTP's do");
        assert_eq!(got["x-request-id"], "first", "the first of several values");
        assert!(
            !got.contains_key("x-control"),
            "a value HTTP cannot carry is left out"
        );
        assert_eq!(got.len(), 2, "{got:?}");
    }

    #[test]
    fn the_reply_carries_the_http_status_in_place_of_the_upstreams() {
        let a = Answer {
            stream: false,
            status: StatusCode::BAD_GATEWAY,
            body: br#"{"status":"ok","oam":{"phase":"generation"}}"#.to_vec().into(),
            request_id: "r".into(),
            phase: "generation".into(),
            reasons: String::new(),
            target: String::new(),
            live: None,
            buffered: None,
            native: false,
        };
        let v: serde_json::Value = serde_json::from_slice(&reply_of(&a)).expect("JSON");
        assert_eq!(v["status"], 502);
        assert_eq!(v["oam"]["phase"], "generation");
    }
}
