//! Live streaming: an upstream's server-sent events relayed to the caller as they arrive, under
//! deadlines (first event, idle gap, total). Until the first event reaches the caller, a failure
//! is an ordinary failed attempt, retried or moved on invisibly. After it, the answer is continued
//! once on a target that takes an assistant prefill, given the text delivered so far, or the
//! stream ends with an in-band error event and never `[DONE]`: a truncated stream never ends
//! cleanly. A finish chunk whose `[DONE]` never comes is complete, and closed by oam.

use super::Node;
use super::config::Streaming;
use super::exchange::{Attempt, Delta, Passthrough, read_chunk};
use super::http::with_oam_headers;
use super::request::{Flight, Next, Waits, conclude};
use super::upstream::{Broken, Opened, Stream};
use crate::core::contract::ToolCall;
use crate::core::pipeline::{Decision, Dispatch};
use crate::core::reason::ReasonCode;
use crate::core::record::Call;
use crate::core::request::{Generation, GenerationStatus, Usage, estimate_answer_tokens};
use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A stream whose first event arrived and can be relayed.
pub(crate) struct Flowing {
    upstream: Stream,
    first: String,
    /// When the attempt began (its deadlines and latency count from here).
    began: Instant,
    /// When its first event came.
    first_at: Instant,
}

pub(crate) enum Open {
    Started(Flowing),
    Failed(Attempt),
}

fn ms_since(t: Instant) -> u64 {
    t.elapsed().as_millis() as u64
}

fn failed(status: GenerationStatus, began: Instant, why: impl Into<String>) -> Generation {
    Generation {
        error: Some(why.into()),
        ..Generation::failed(status, ms_since(began))
    }
}

/// Open `d` on its target (continuing `prefill` when given) and wait for its first readable
/// event: every failure until then is an ordinary failed attempt.
pub(crate) async fn open(
    node: &Node,
    d: &Dispatch,
    pass: &Passthrough,
    prefill: Option<&str>,
    limits: Streaming,
) -> Open {
    let Some((c, model)) = node.upstreams.target(&d.provider) else {
        let g = failed(GenerationStatus::Error, Instant::now(), "no connector");
        return Open::Failed(g.into());
    };
    let first = Duration::from_millis(limits.first_token_ms);
    let (mut upstream, began) = match c
        .open_stream(model, pass, prefill, d.max_tokens, first)
        .await
    {
        Opened::Streaming(u, t) => (u, t),
        Opened::Failed(a) => return Open::Failed(a),
    };
    let g = match upstream.next(first.saturating_sub(began.elapsed())).await {
        Ok(Some(e)) if e == "[DONE]" => failed(
            GenerationStatus::Error,
            began,
            "the stream ended before any answer",
        ),
        Ok(Some(e)) => match serde_json::from_str::<Value>(&e) {
            Ok(v) if v.get("error").is_none() => {
                return Open::Started(Flowing {
                    upstream,
                    first: e,
                    began,
                    first_at: Instant::now(),
                });
            }
            Ok(v) => failed(
                GenerationStatus::Error,
                began,
                format!("the stream says: {}", v["error"]),
            ),
            Err(_) => failed(
                GenerationStatus::Error,
                began,
                "the stream's first event is not JSON",
            ),
        },
        Ok(None) => failed(
            GenerationStatus::Error,
            began,
            "the stream ended before any event",
        ),
        Err(Broken::Silent) => failed(
            GenerationStatus::Timeout,
            began,
            format!("no event within {} ms", limits.first_token_ms),
        ),
        Err(Broken::Failed(why)) => failed(GenerationStatus::Error, began, why),
    };
    Open::Failed(g.into())
}

/// Answer the caller with the stream `first` began: headers and first event now, the rest as it
/// comes, relayed by a task of the node's own, in the events of the caller's API.
#[allow(clippy::too_many_arguments)]
pub(crate) fn respond(
    flight: Flight,
    first: Flowing,
    pass: Passthrough,
    limits: Streaming,
    target: String,
    request_started: Instant,
    api: &'static dyn super::api::ClientApi,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    let mut flight = flight;
    let node = flight.node.clone();
    flight.call(Call::Delivering);
    let request_id = flight.session.request().id.clone();
    let encoder = api.relay(&pass);
    let relay = Relay {
        flight,
        pass,
        limits,
        tx,
        request_started,
        delivered: String::new(),
        earlier: None,
        part_sent: false,
        waits: Waits {
            granted: None,
            queue_deadline: tokio::time::Instant::now(),
            waited: Duration::ZERO,
        },
        encoder,
        started: false,
    };
    node.serving.tasks.spawn(relay.run(first));
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        let b = rx.recv().await?;
        Some((Ok::<_, std::convert::Infallible>(b), rx))
    });
    let resp = (
        StatusCode::OK,
        [
            (axum::http::header::CONTENT_TYPE, "text/event-stream"),
            (axum::http::header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response();
    with_oam_headers(
        resp,
        ["streaming".into(), String::new(), target, request_id],
    )
}

/// What one attempt's stream carried.
#[derive(Default)]
struct Accum {
    text: String,
    finish: Option<String>,
    usage: Option<Usage>,
    /// Tool calls by their index, their arguments gathered from the deltas.
    calls: Vec<ToolCall>,
    /// The longest wait for an event so far (the first one's included), in ms.
    pace_ms: u64,
}

impl Accum {
    /// Take in what one chunk says.
    fn absorb(&mut self, d: &Delta) {
        if let Some(text) = &d.text {
            self.text.push_str(text);
        }
        for t in &d.tool_calls {
            let i = t.index as usize;
            if i > 1_024 {
                continue; // no answer calls that many tools; not worth a huge allocation
            }
            if self.calls.len() <= i {
                self.calls.resize_with(i + 1, || ToolCall {
                    name: String::new(),
                    arguments: String::new(),
                });
            }
            if let Some(name) = &t.name {
                self.calls[i].name.push_str(name);
            }
            if let Some(args) = &t.arguments {
                self.calls[i].arguments.push_str(args);
            }
        }
        if let Some(f) = &d.finish {
            self.finish = Some(f.to_string());
        }
        if d.usage.is_some() {
            self.usage = d.usage;
        }
    }
}

/// How one attempt's stream ended.
enum End {
    /// Its finish chunk came (then `[DONE]`, the end of the body, or the grace time).
    Finished,
    /// It broke before its finish chunk.
    Broken(Generation),
    /// Nobody reads it any more.
    CallerGone,
}

struct Relay {
    flight: Flight,
    pass: Passthrough,
    limits: Streaming,
    tx: tokio::sync::mpsc::Sender<Bytes>,
    request_started: Instant,
    /// A chunk has come (from any part).
    started: bool,
    /// The answer's text the caller has, across a continuation.
    delivered: String,
    /// How each chunk is written to the caller, in its API (what its events have opened so
    /// far).
    encoder: Box<dyn super::api::Relayed>,
    /// What the parts before this one used (a stream cut and continued): the usage the caller
    /// is told is theirs and this part's together.
    earlier: Option<Usage>,
    /// The part under way has sent the caller something.
    part_sent: bool,
    /// The driver's waits (a stream under way is never queued again).
    waits: Waits,
}

impl Relay {
    fn node(&self) -> Arc<Node> {
        self.flight.node.clone()
    }

    async fn run(mut self, mut cur: Flowing) {
        loop {
            let mut acc = Accum::default();
            self.part_sent = false;
            let end = self.pump(&mut cur, &mut acc).await;
            let node = self.node();
            let latency_ms = ms_since(cur.began);
            if self.part_sent {
                self.flight.call(Call::Delivered);
            }
            let mut step = match end {
                End::Finished => {
                    let g = Generation {
                        status: GenerationStatus::Ok,
                        content: acc.text,
                        finish_reason: acc.finish,
                        latency_ms,
                        usage: acc.usage,
                        retry_after_ms: None,
                        error: None,
                        tool_calls: acc.calls,
                        pace_ms: Some(acc.pace_ms),
                        agent_usage: None,
                    };
                    self.flight.next(Call::Complete { generation: g })
                }
                End::CallerGone => {
                    // Its answer so far is paid for and was good: no retry, nobody to read one.
                    let g = Generation {
                        content: acc.text,
                        finish_reason: None,
                        usage: acc.usage,
                        ..Generation::ok("", latency_ms)
                    };
                    self.flight.call(Call::Note {
                        code: ReasonCode::ClientDisconnected,
                    });
                    self.flight.call(Call::CallerGone);
                    self.flight.next(Call::Complete { generation: g })
                }
                End::Broken(mut g) => {
                    // What it delivered is paid for: charged, and counted in the usage of the
                    // answer a continuation completes (the upstream's count, else oam's
                    // estimate, as the engine charges it).
                    if self.part_sent {
                        let part = acc.usage.unwrap_or_else(|| Usage {
                            prompt_tokens: self.flight.session.est_prompt_tokens(),
                            completion_tokens: estimate_answer_tokens(&acc.text, &acc.calls),
                            ..Usage::default()
                        });
                        self.earlier = Some(self.earlier.unwrap_or_default() + part);
                    }
                    g.content = acc.text;
                    g.tool_calls = acc.calls;
                    g.usage = acc.usage;
                    self.flight.call(Call::Interrupted);
                    self.flight.next(Call::Complete { generation: g })
                }
            };
            // Done, or continue on a prefill target (each open that fails is one more attempt),
            // driven as every request is: backoffs waited for, the reader's leaving honoured.
            let next = loop {
                let d = match self.flight.advance(step, &mut self.waits, &self.tx).await {
                    Next::Decided(d) => return self.close(*d).await,
                    Next::Call(d) => d,
                };
                let prefill = d.continuation.then_some(self.delivered.as_str());
                let opened = tokio::select! {
                    o = open(&node, &d, &self.pass, prefill, self.limits) => Some(o),
                    () = self.tx.closed() => None,
                };
                match opened {
                    Some(Open::Started(s)) => break s,
                    Some(Open::Failed(a)) => {
                        step = self.flight.completed(a.generation, self.tx.is_closed());
                    }
                    None => step = self.flight.withdraw(),
                }
            };
            cur = next;
        }
    }

    /// Relay one attempt's events until its stream ends, under the deadlines.
    async fn pump(&mut self, cur: &mut Flowing, acc: &mut Accum) -> End {
        let limits = self.limits;
        let total = cur.began + Duration::from_millis(limits.total_ms);
        let mut event = Some(std::mem::take(&mut cur.first));
        let mut last = cur.first_at;
        acc.pace_ms = cur.first_at.duration_since(cur.began).as_millis() as u64;
        let mut first_of_part = true;
        loop {
            let data = match event.take() {
                Some(e) => e,
                None => {
                    let finished = acc.finish.is_some();
                    let idle = if finished {
                        limits.done_grace_ms
                    } else {
                        limits.idle_ms
                    };
                    let wait = Duration::from_millis(idle)
                        .min(total.saturating_duration_since(Instant::now()));
                    let next = tokio::select! {
                        r = cur.upstream.next(wait) => r,
                        () = self.tx.closed() => return End::CallerGone,
                    };
                    match next {
                        Ok(Some(e)) => {
                            let now = Instant::now();
                            let gap = now.duration_since(last).as_millis() as u64;
                            acc.pace_ms = acc.pace_ms.max(gap);
                            last = now;
                            e
                        }
                        _ if finished => return End::Finished,
                        Ok(None) => {
                            let why = "the stream ended before its finish chunk (cut)";
                            return End::Broken(failed(GenerationStatus::Error, cur.began, why));
                        }
                        Err(Broken::Failed(why)) => {
                            return End::Broken(failed(GenerationStatus::Error, cur.began, why));
                        }
                        Err(Broken::Silent) => {
                            let why = if Instant::now() >= total {
                                format!("the stream ran past its {} ms total", limits.total_ms)
                            } else {
                                format!("the stream stalled: no event for {idle} ms")
                            };
                            return End::Broken(failed(GenerationStatus::Timeout, cur.began, why));
                        }
                    }
                }
            };
            if data == "[DONE]" {
                if acc.finish.is_some() {
                    return End::Finished;
                }
                let why = "[DONE] came without a finish reason";
                return End::Broken(failed(GenerationStatus::Error, cur.began, why));
            }
            let delta = match read_chunk(&data) {
                Ok(Some(delta)) => delta,
                Ok(None) => {
                    // Unreadable, after the caller has part of the answer: skipped, and said.
                    self.flight.session.note(ReasonCode::StreamChunkSkipped);
                    continue;
                }
                Err(why) => {
                    let why = why.to_string();
                    return End::Broken(failed(GenerationStatus::Error, cur.began, why));
                }
            };
            // A continuation: the answer's last chunk names the model that wrote its end.
            if let (true, true, Some(model)) = (self.started, first_of_part, delta.head.model)
                && delta.head.names_model()
            {
                self.encoder.continued_by(model);
            }
            self.started = true;
            first_of_part = false;
            acc.absorb(&delta);
            let mut delta = delta;
            if let (Some(earlier), Some(u)) = (self.earlier, delta.usage) {
                // The caller is told the usage of every part: oam's sum, not the one sent.
                delta.usage = Some(earlier + u);
                delta.usage_sent = None;
            }
            if let Some(text) = &delta.text {
                self.delivered.push_str(text);
            }
            let text = self.encoder.chunk(&data, &delta);
            if !text.is_empty() {
                if self.send(text).await.is_err() {
                    return End::CallerGone;
                }
                self.part_sent = true;
            }
        }
    }

    async fn send(&self, text: String) -> Result<(), ()> {
        self.tx.send(Bytes::from(text)).await.map_err(|_| ())
    }

    /// The request is decided: oam's last chunk and `[DONE]` for an accepted answer, else an
    /// in-band error event (and no `[DONE]`). Then what every decided request leaves behind.
    async fn close(mut self, d: Decision) {
        let text = self.encoder.end(&d);
        let node = self.node();
        let started = self.request_started;
        let record = self.flight.recorder();
        let trace = self.flight.trace.take();
        let logged = conclude(&node, d, record, trace, started);
        // Under `[decision_log] durable`, the stream ends only once its record is written, and
        // its settlements go to the ledger only then.
        node.log.logged(logged).await;
        self.flight.unsent.clear();
        let _ = self.send(text).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn absorb(acc: &mut Accum, chunk: Value) {
        let data = chunk.to_string();
        acc.absorb(&read_chunk(&data).expect("no error").expect("a chunk"));
    }

    #[test]
    fn an_answer_is_gathered_from_its_chunks_tool_calls_by_position() {
        let mut acc = Accum::default();
        let call = |i: u64, name: Option<&str>, args: &str| {
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": i, "function": {"name": name, "arguments": args}}
            ]}}]})
        };
        absorb(
            &mut acc,
            json!({"choices": [{"delta": {"role": "assistant", "content": "Hel"}}]}),
        );
        absorb(&mut acc, json!({"choices": [{"delta": {"content": "lo"}}]}));
        // Two calls whose argument deltas interleave, the second announced first.
        absorb(&mut acc, call(1, Some("b"), "{\"y\":"));
        absorb(&mut acc, call(0, Some("a"), "{\"x\""));
        absorb(&mut acc, call(0, None, ":1}"));
        absorb(&mut acc, call(1, None, "2}"));
        absorb(
            &mut acc,
            json!({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
        );
        assert_eq!(acc.text, "Hello");
        assert_eq!(acc.finish.as_deref(), Some("tool_calls"));
        let calls: Vec<(&str, &str)> = acc
            .calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(calls, [("a", "{\"x\":1}"), ("b", "{\"y\":2}")]);
        assert_eq!(acc.usage, None, "no chunk carried usage");
    }

    #[test]
    fn usage_comes_from_the_chunk_that_carries_it_and_absurd_indexes_are_ignored() {
        let mut acc = Accum::default();
        absorb(
            &mut acc,
            json!({"choices": [{"delta": {"tool_calls": [{"index": 5_000_000, "function": {"name": "x"}}]}}]}),
        );
        assert!(
            acc.calls.is_empty(),
            "no allocation for an index no answer has"
        );
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}});
        let data = usage.to_string();
        assert!(
            read_chunk(&data)
                .expect("no error")
                .expect("a chunk")
                .usage_only
        );
        absorb(&mut acc, usage);
        absorb(
            &mut acc,
            json!({"choices": [{"delta": {"content": "late"}}], "usage": null}),
        );
        assert_eq!(
            acc.usage,
            Some(Usage {
                prompt_tokens: 7,
                completion_tokens: 3,
                ..Usage::default()
            }),
            "a null usage later keeps what came"
        );
    }
}
