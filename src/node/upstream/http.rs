//! What the HTTP upstreams (`openai`, `anthropic`) share: an endpoint parsed once with its key,
//! the whole-answer call under a deadline, the stream of server-sent events with its byte cap,
//! and how a non-2xx answer (a 429, a refusal, a failure) or no answer at all is judged. What
//! a success means is each API's own.

use super::super::config::ProviderConfig;
use super::super::exchange::{Attempt, Reply};
use super::{Broken, Opened, SetupError, Stream, failed};
use crate::core::request::{Generation, GenerationStatus};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use serde_json::Value;
use std::time::{Duration, Instant};

/// A provider's endpoint, parsed once (a URL parse per request is measurable at thousands a
/// second), with what every request to it carries.
pub(super) struct Endpoint {
    /// The call every request makes (`{base_url}/chat/completions`, `/messages`).
    url: reqwest::Url,
    /// `url` for the lean client.
    uri: hyper::Uri,
    /// `{base_url}/models`.
    models_url: reqwest::Url,
    /// The key from `api_key_env` (marked sensitive) and the API's own headers, made once.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    http: crate::http::lanes::PerLane<reqwest::Client>,
    /// Answers are read no larger than `node.max_answer_bytes`.
    pub post: crate::http::Poster,
}

/// The provider's key from its `api_key_env`, if set.
pub(super) fn key(cfg: &ProviderConfig) -> Option<String> {
    cfg.api_key_env
        .as_ref()
        .and_then(|var| std::env::var(var).ok())
}

/// A header of `value`, marked sensitive (never printed); `None` if it cannot be a header.
pub(super) fn secret(name: HeaderName, value: &str) -> Option<(HeaderName, HeaderValue)> {
    let mut v = HeaderValue::from_str(value).ok()?;
    v.set_sensitive(true);
    Some((name, v))
}

impl Endpoint {
    /// `cfg`'s endpoint for the call at `path` (checked at load: a base URL that parses).
    pub(super) fn new(
        cfg: &ProviderConfig,
        path: &str,
        headers: Vec<(HeaderName, HeaderValue)>,
        http: crate::http::lanes::PerLane<reqwest::Client>,
        post: crate::http::Poster,
    ) -> Result<Endpoint, SetupError> {
        let call = url(cfg, path)?;
        Ok(Endpoint {
            uri: call
                .as_str()
                .parse()
                .map_err(|_| SetupError::bad_url(cfg))?,
            url: call,
            models_url: url(cfg, "models")?,
            headers,
            http,
            post,
        })
    }

    /// A request to `url` with the provider's key.
    pub(super) fn request(
        &self,
        method: reqwest::Method,
        url: &reqwest::Url,
    ) -> reqwest::RequestBuilder {
        let mut req = self.http.here().request(method, url.clone());
        for (name, value) in &self.headers {
            req = req.header(name, value.clone());
        }
        req
    }

    /// POST `json` and read the whole answer within `timeout`: its status, headers and body,
    /// or the failed attempt (no answer in time, or none at all).
    pub(super) async fn call(
        &self,
        json: Vec<u8>,
        timeout: Duration,
        started: Instant,
    ) -> Result<crate::http::Posted, Attempt> {
        let call = self.post.post_json(&self.uri, &self.headers, json);
        let result = tokio::time::timeout(timeout, call).await;
        let latency_ms = ms_since(started);
        match result {
            Err(_) => Err(failed(
                GenerationStatus::Timeout,
                format!("no answer within {} ms", timeout.as_millis()),
                latency_ms,
            )),
            Ok(Err(e)) => Err(failed(unanswered(&*e), error_chain(&*e), latency_ms)),
            Ok(Ok(parts)) => Ok(parts),
        }
    }

    /// Open a stream of `json` (`stream: true`): the response headers must come within
    /// `first_event`. Events are passed through `translate` when given (an API whose events
    /// are not chat chunks). An answer that is no stream is judged whole by `judge` (an error,
    /// or a whole answer from an upstream that ignored `stream`, replayed as events).
    pub(super) async fn open(
        &self,
        json: Vec<u8>,
        first_event: Duration,
        translate: Option<Translate>,
        include_usage: bool,
        judge: impl FnOnce(reqwest::StatusCode, &HeaderMap, &bytes::Bytes, u64) -> Attempt,
    ) -> Opened {
        let started = Instant::now();
        let req = self
            .request(reqwest::Method::POST, &self.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(json);
        let resp = match tokio::time::timeout(first_event, req.send()).await {
            Err(_) => {
                let why = format!("no response within {} ms", first_event.as_millis());
                let a = failed(GenerationStatus::Timeout, why, ms_since(started));
                return Opened::Failed(a);
            }
            Ok(Err(e)) => {
                let a = failed(unanswered(&e), error_chain(&e), ms_since(started));
                return Opened::Failed(a);
            }
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        let is_sse = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if status.is_success() && is_sse {
            let events = Events {
                resp,
                parser: crate::http::sse::Parser::default(),
                left: self.post.max_answer_bytes(),
                translate,
            };
            return Opened::Streaming(Stream::of(events), started);
        }
        let headers = resp.headers().clone();
        let left = first_event.saturating_sub(started.elapsed());
        let read = read_capped(resp, self.post.max_answer_bytes());
        let Ok(Ok(bytes)) = tokio::time::timeout(left, read).await else {
            let ms = ms_since(started);
            return Opened::Failed(Generation::failed(GenerationStatus::Error, ms).into());
        };
        Opened::whole(
            judge(status, &headers, &bytes, ms_since(started)),
            include_usage,
            started,
        )
    }

    /// `GET /models`, bounded by `timeout`: a free check that the provider answers.
    pub(super) async fn list_models(&self, timeout: Duration) -> Generation {
        let started = Instant::now();
        let req = self.request(reqwest::Method::GET, &self.models_url);
        let result = tokio::time::timeout(timeout, req.send()).await;
        let failed = |status, error: String| Generation {
            error: Some(error),
            ..Generation::failed(status, ms_since(started))
        };
        match result {
            Err(_) => failed(
                GenerationStatus::Timeout,
                format!("no answer within {} ms", timeout.as_millis()),
            ),
            // The chain says why (a DNS failure, a refused connection, TLS).
            Ok(Err(e)) => failed(GenerationStatus::Error, error_chain(&e)),
            Ok(Ok(r)) if r.status().is_success() => Generation::ok("", ms_since(started)),
            Ok(Ok(r)) => {
                let (status, headers) = (r.status(), r.headers().clone());
                // Read as an answer is: no more than `node.max_answer_bytes`.
                let cap = self.post.max_answer_bytes();
                let body = tokio::time::timeout(timeout, read_capped(r, cap)).await;
                let body = body.ok().and_then(Result::ok).unwrap_or_default();
                judge_failure(status, &headers, &body, ms_since(started)).map_or_else(
                    || failed(GenerationStatus::Error, format!("HTTP {status}")),
                    |a| a.generation,
                )
            }
        }
    }
}

/// An API's events as chat chunks (or `[DONE]`), event by event.
pub(super) type Translate = Box<dyn FnMut(&str) -> Vec<String> + Send>;

/// A stream's events as they arrive over HTTP, at most `node.max_answer_bytes` in all.
pub(super) struct Events {
    resp: reqwest::Response,
    parser: crate::http::sse::Parser,
    /// Bytes the stream may still bring.
    left: usize,
    translate: Option<Translate>,
}

impl Events {
    /// Read until `deadline` for the next events, put into `ready`: `Ok(true)` when some may
    /// have come, `Ok(false)` when the body ended.
    pub(super) async fn read(
        &mut self,
        deadline: tokio::time::Instant,
        ready: &mut std::collections::VecDeque<String>,
    ) -> Result<bool, Broken> {
        let chunk = tokio::time::timeout_at(deadline, self.resp.chunk()).await;
        let bytes = match chunk {
            Err(_) => return Err(Broken::Silent),
            Ok(Err(e)) => return Err(Broken::Failed(error_chain(&e))),
            Ok(Ok(None)) => return Ok(false),
            Ok(Ok(Some(bytes))) if bytes.len() > self.left => {
                let why = "the stream is larger than node.max_answer_bytes";
                return Err(Broken::Failed(why.into()));
            }
            Ok(Ok(Some(bytes))) => bytes,
        };
        self.left -= bytes.len();
        let Ok(events) = self.parser.feed(&bytes) else {
            return Err(Broken::Failed("an event line over 1 MiB".into()));
        };
        match &mut self.translate {
            Some(t) => {
                for e in events {
                    ready.extend(t(&e));
                }
            }
            None => ready.extend(events),
        }
        Ok(true)
    }
}

fn ms_since(t: Instant) -> u64 {
    t.elapsed().as_millis() as u64
}

/// `{base_url}/{path}` of `cfg`, parsed.
pub(super) fn url(cfg: &ProviderConfig, path: &str) -> Result<reqwest::Url, SetupError> {
    endpoint(&cfg.base_url, path).ok_or_else(|| SetupError::bad_url(cfg))
}

/// A whole answer that is not a success, judged: a 429 (with its Retry-After), or a refusal
/// or failure with the body's error and the status passed on; `None` for a success, which is
/// the API's own to read.
pub(super) fn judge_failure(
    status: reqwest::StatusCode,
    headers: &HeaderMap,
    bytes: &bytes::Bytes,
    latency_ms: u64,
) -> Option<Attempt> {
    let why = |status, error: String| Generation {
        error: Some(error),
        ..Generation::failed(status, latency_ms)
    };
    if status.as_u16() == 429 {
        return Some(
            Generation {
                retry_after_ms: retry_after_ms(headers),
                ..why(GenerationStatus::RateLimited, "HTTP 429".into())
            }
            .into(),
        );
    }
    if status.is_success() {
        return None;
    }
    let body = serde_json::from_slice::<Value>(bytes).ok();
    let error = body.as_ref().map(|v| &v["error"]);
    let detail = error
        .and_then(|e| e["message"].as_str())
        .unwrap_or_default();
    let kind = refusal(status.as_u16(), error);
    Some(Attempt {
        generation: why(kind, format!("HTTP {status} {detail}")),
        body: body.map(Reply::Json),
        http_status: status.as_u16(),
    })
}

/// `{base_url}/{path}`, parsed (`None` if it does not parse).
fn endpoint(base_url: &str, path: &str) -> Option<reqwest::Url> {
    reqwest::Url::parse(&format!("{}/{path}", base_url.trim_end_matches('/'))).ok()
}

/// What an upstream's non-2xx answer (other than 429) says of the request: its credentials
/// refused (401, 403), too long for the model's context window, refused on content policy, or
/// otherwise invalid (400, 413, 422: the request's fault, not the upstream's); anything else is
/// the upstream failing. `error` is the body's OpenAI error object, if it has one.
fn refusal(status: u16, error: Option<&Value>) -> GenerationStatus {
    let field = |k: &str| {
        error
            .and_then(|e| e[k].as_str())
            .unwrap_or_default()
            .to_ascii_lowercase()
    };
    let (code, kind, message) = (field("code"), field("type"), field("message"));
    match status {
        401 | 403 => GenerationStatus::Unauthorized,
        400 | 413 | 422 => {
            if code == "context_length_exceeded"
                || message.contains("context length")
                || message.contains("prompt is too long")
                || message.contains("context window")
            {
                GenerationStatus::ContextLength
            } else if ["content_policy_violation", "content_filter"]
                .iter()
                .any(|c| code == *c || kind == *c)
            {
                GenerationStatus::ContentPolicy
            } else {
                GenerationStatus::Rejected
            }
        }
        _ => GenerationStatus::Error,
    }
}

/// `retry-after-ms` (OpenAI's header) or `Retry-After` in seconds.
fn retry_after_ms(h: &HeaderMap) -> Option<u64> {
    let get = |name: &str| h.get(name)?.to_str().ok()?.trim().parse::<f64>().ok();
    get("retry-after-ms")
        .map(|ms| ms as u64)
        .or_else(|| get(RETRY_AFTER.as_str()).map(|s| (s * 1_000.0) as u64))
}

/// How a call that got no answer failed: for want of the node's own descriptors, ports or
/// buffers (the target was never reached, and it is not the target's failure), or else the
/// target's error.
fn unanswered(e: &(dyn std::error::Error + 'static)) -> GenerationStatus {
    let mut cur = Some(e);
    while let Some(err) = cur {
        let errno = err
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error);
        if errno.is_some_and(|n| {
            matches!(
                n,
                libc::EMFILE | libc::ENFILE | libc::EADDRNOTAVAIL | libc::ENOBUFS | libc::ENOMEM
            )
        }) {
            return GenerationStatus::LocalResources;
        }
        cur = err.source();
    }
    GenerationStatus::Error
}

pub(super) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        parts.push(s.to_string());
        cur = s.source();
    }
    parts.join(": ")
}

/// Why a response body was not read whole.
#[derive(Debug, thiserror::Error)]
pub(super) enum Unread {
    /// The connection failed (its error chain).
    #[error("{0}")]
    Transport(String),
    #[error("the answer is larger than node.max_answer_bytes ({0} bytes)")]
    TooLarge(usize),
}

/// A whole response body, if it holds at most `cap` bytes (read no further than that).
pub(super) async fn read_capped(
    mut resp: reqwest::Response,
    cap: usize,
) -> Result<bytes::Bytes, Unread> {
    let mut body = Vec::new();
    let transport = |e: reqwest::Error| Unread::Transport(error_chain(&e));
    while let Some(chunk) = resp.chunk().await.map_err(transport)? {
        if body.len() + chunk.len() > cap {
            return Err(Unread::TooLarge(cap));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_out_of_descriptors_or_ports_is_the_nodes_shortage() {
        #[derive(Debug)]
        struct Wrapped(std::io::Error);
        impl std::fmt::Display for Wrapped {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("client error (Connect)")
            }
        }
        impl std::error::Error for Wrapped {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        for errno in [libc::EMFILE, libc::ENFILE, libc::EADDRNOTAVAIL] {
            let e = Wrapped(std::io::Error::from_raw_os_error(errno));
            assert_eq!(unanswered(&e), GenerationStatus::LocalResources, "{errno}");
        }
        let refused = Wrapped(std::io::Error::from_raw_os_error(libc::ECONNREFUSED));
        assert_eq!(unanswered(&refused), GenerationStatus::Error);
    }

    #[test]
    fn refusals_are_told_apart_by_status_and_error_code() {
        use GenerationStatus::*;
        let e = |code: &str, message: &str| serde_json::json!({"code": code, "message": message});
        let cases = [
            (401, None, Unauthorized),
            (403, Some(e("", "")), Unauthorized),
            (400, Some(e("context_length_exceeded", "")), ContextLength),
            (
                400,
                Some(e("", "This model's maximum context length is 8192 tokens")),
                ContextLength,
            ),
            (400, Some(e("content_policy_violation", "")), ContentPolicy),
            (400, Some(e("content_filter", "")), ContentPolicy),
            (400, Some(e("invalid_value", "bad temperature")), Rejected),
            (422, None, Rejected),
            (500, Some(e("context_length_exceeded", "")), Error),
            (502, None, Error),
        ];
        for (status, error, want) in cases {
            assert_eq!(refusal(status, error.as_ref()), want, "{status} {error:?}");
        }
    }

    #[test]
    fn retry_after_prefers_milliseconds() {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, "2".parse().unwrap());
        assert_eq!(retry_after_ms(&h), Some(2_000));
        h.insert("retry-after-ms", "1500".parse().unwrap());
        assert_eq!(retry_after_ms(&h), Some(1_500));
        assert_eq!(retry_after_ms(&HeaderMap::new()), None);
    }
}
