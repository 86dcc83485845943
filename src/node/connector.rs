//! The provider connector: a real HTTP client of OpenAI-compatible servers (`oam sim`, Ollama,
//! vLLM, OpenAI) and of Anthropic's Messages API (translated both ways by
//! `anthropic::upstream`, so everything above it reads chat completions). It turns whatever
//! happened (an answer, a 5xx, a 429, a reset, a timeout) into a `Generation` for the pure
//! pipeline, with the real elapsed time.

use super::anthropic::upstream as messages;
use super::config::ProviderConfig;
use crate::core::request::{Api, Generation, GenerationStatus, Message};
use reqwest::header::{HeaderMap, RETRY_AFTER};
use serde_json::Value;
use std::time::{Duration, Instant};

/// What a client sent that oam does not interpret, for the upstream as it was: the messages
/// in their own shape (tool calls, tool results, image parts, names) and every other field
/// (tools, tool choice, sampling parameters, `user`, `metadata`, unknown future fields).
#[derive(Clone, Debug, Default)]
pub struct Passthrough {
    pub messages: Vec<Value>,
    pub extra: serde_json::Map<String, Value>,
    /// The client's `tools`, as sent.
    pub tools: Option<Box<serde_json::value::RawValue>>,
    /// The client asked for the usage chunk of a stream (`stream_options.include_usage`).
    pub include_usage: bool,
    /// A Messages request as it came, for a Messages target (it uses what only Messages
    /// carries; the request is bound to such targets): sent as it is, answered as it is.
    pub native: Option<Value>,
}

/// The upstream request: the client's own fields (which never include the ones below: oam
/// reads those), then what oam sets.
#[derive(serde::Serialize)]
struct Body<'a> {
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    extra: Option<&'a serde_json::Map<String, Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a serde_json::value::RawValue>,
    model: &'a str,
    messages: Messages<'a>,
    max_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format: Option<&'a Value>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<Value>,
}

enum Messages<'a> {
    AsSent(&'a [Value]),
    Core(&'a [Message]),
    /// As sent, and the answer so far as an assistant message to continue (a prefill).
    Prefilled(&'a [Value], Value),
}

impl serde::Serialize for Messages<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Messages::AsSent(m) => s.collect_seq(m.iter()),
            Messages::Core(m) => s.collect_seq(m.iter()),
            Messages::Prefilled(m, last) => s.collect_seq(m.iter().chain(std::iter::once(last))),
        }
    }
}

pub struct Connector {
    pub id: String,
    /// Its models serve embeddings (and are probed with one).
    pub embeddings: bool,
    /// How its targets are checked while idle.
    pub probe: super::config::Probe,
    pub upstream: Upstream,
    /// Answers are read no larger than `node.max_answer_bytes`.
    post: crate::http::Poster,
}

/// Where a provider is reached.
pub enum Upstream {
    /// An OpenAI-compatible HTTP endpoint.
    Http(Box<HttpEndpoint>),
    /// An Open Agent Mesh agent answering chat requests, called over NATS.
    Agent {
        name: String,
        calls: std::sync::Arc<AgentCalls>,
    },
}

/// The node's calls to mesh agents, made with the fail-fast caller: an attempt ends with
/// `agent_died` as soon as the instance holding it dies, not at its timeout. One caller (one
/// subscription each for acknowledgements and deaths) for every agent provider, made on the
/// first call.
pub struct AgentCalls {
    nats: async_nats::Client,
    caller: tokio::sync::OnceCell<crate::mesh::client::Caller>,
}

impl AgentCalls {
    pub fn new(nats: async_nats::Client) -> AgentCalls {
        AgentCalls {
            nats,
            caller: tokio::sync::OnceCell::new(),
        }
    }

    async fn caller(&self) -> anyhow::Result<&crate::mesh::client::Caller> {
        self.caller
            .get_or_try_init(|| crate::mesh::client::Caller::new(self.nats.clone()))
            .await
    }
}

/// An HTTP provider's endpoints, parsed once (a URL parse per request is measurable at
/// thousands a second), and its key.
pub struct HttpEndpoint {
    api: Api,
    /// `{base_url}/chat/completions` (or `/messages`).
    url: reqwest::Url,
    /// `url` for the lean client (the call every request makes).
    uri: hyper::Uri,
    /// `{base_url}/models`.
    models_url: reqwest::Url,
    /// `{base_url}/embeddings`.
    embeddings_url: reqwest::Url,
    /// What every request carries, made once: the key from `api_key_env` (as
    /// `Authorization: Bearer`, or `x-api-key`, marked sensitive) and `anthropic-version`.
    headers: Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>,
    http: reqwest::Client,
}

impl HttpEndpoint {
    /// A request to `url` with the provider's key.
    fn request(&self, method: reqwest::Method, url: &reqwest::Url) -> reqwest::RequestBuilder {
        let mut req = self.http.request(method, url.clone());
        for (name, value) in &self.headers {
            req = req.header(name, value.clone());
        }
        req
    }

    /// The body of a request for `body`, in the API this endpoint speaks.
    fn body(&self, body: &Body<'_>, prefill: Option<&str>) -> serde_json::Result<Vec<u8>> {
        match self.api {
            Api::Openai => serde_json::to_vec(body),
            Api::Anthropic => {
                // Routing kept what Messages cannot carry away; the messages as chat sent them.
                let messages = match &body.messages {
                    Messages::AsSent(m) | Messages::Prefilled(m, _) => m.to_vec(),
                    Messages::Core(m) => m
                        .iter()
                        .map(serde_json::to_value)
                        .collect::<Result<_, _>>()?,
                };
                let empty = serde_json::Map::new();
                serde_json::to_vec(&messages::request_of(
                    body.model,
                    &messages,
                    body.extra.unwrap_or(&empty),
                    body.tools,
                    body.max_tokens,
                    body.stream,
                    prefill,
                ))
            }
        }
    }
}

/// Now, in Unix seconds (a translated answer's `created`).
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Connector {
    /// The connector of provider `cfg` (checked at load: an agent, or a base URL that parses).
    pub fn new(
        cfg: &ProviderConfig,
        http: reqwest::Client,
        post: crate::http::Poster,
        calls: &std::sync::Arc<AgentCalls>,
    ) -> anyhow::Result<Self> {
        let upstream = match &cfg.agent {
            Some(name) => Upstream::Agent {
                name: name.clone(),
                calls: calls.clone(),
            },
            None => {
                let at = |path| {
                    endpoint(&cfg.base_url, path).ok_or_else(|| {
                        anyhow::anyhow!(
                            "provider {}: base_url {:?} is no URL",
                            cfg.id,
                            cfg.base_url
                        )
                    })
                };
                use reqwest::header::{AUTHORIZATION, HeaderName, HeaderValue};
                let url = at(match cfg.api {
                    Api::Openai => "chat/completions",
                    Api::Anthropic => "messages",
                })?;
                let key = cfg
                    .api_key_env
                    .as_ref()
                    .and_then(|var| std::env::var(var).ok());
                let mut headers = Vec::new();
                if let Some(k) = key {
                    let (name, value) = match cfg.api {
                        Api::Openai => (AUTHORIZATION, format!("Bearer {k}")),
                        Api::Anthropic => (HeaderName::from_static("x-api-key"), k),
                    };
                    if let Ok(mut v) = HeaderValue::from_str(&value) {
                        v.set_sensitive(true);
                        headers.push((name, v));
                    }
                }
                if cfg.api == Api::Anthropic {
                    headers.push((
                        HeaderName::from_static("anthropic-version"),
                        HeaderValue::from_static(messages::VERSION),
                    ));
                }
                Upstream::Http(Box::new(HttpEndpoint {
                    api: cfg.api,
                    uri: url.as_str().parse()?,
                    url,
                    models_url: at("models")?,
                    embeddings_url: at("embeddings")?,
                    headers,
                    http,
                }))
            }
        };
        Ok(Connector {
            id: cfg.id.clone(),
            embeddings: cfg.embeddings,
            probe: cfg.probe,
            upstream,
            post,
        })
    }

    /// The mesh agent that serves this provider, if it is one.
    pub fn agent(&self) -> Option<&str> {
        match &self.upstream {
            Upstream::Agent { name, .. } => Some(name),
            Upstream::Http(_) => None,
        }
    }

    /// One chat completion from `model`, bounded by `timeout`: the client's request as it came
    /// (`pass`), with the target's model and oam's token limit, or just `messages` (probes); the
    /// upstream's chat completion is kept as it came (the answer passes it on).
    pub async fn generate(
        &self,
        model: &str,
        messages: &[Message],
        pass: Option<&Passthrough>,
        max_tokens: u32,
        response_format: Option<&Value>,
        timeout: Duration,
    ) -> Attempt {
        // Serialised from borrows: the client's request is not copied for each attempt.
        let body = Body {
            extra: pass.map(|p| &p.extra),
            tools: pass.and_then(|p| p.tools.as_deref()),
            model,
            messages: match pass {
                Some(p) => Messages::AsSent(&p.messages),
                None => Messages::Core(messages),
            },
            max_tokens,
            response_format,
            stream: false,
            stream_options: None,
        };
        let started = Instant::now();
        let http = match &self.upstream {
            Upstream::Http(http) => http,
            Upstream::Agent { name, calls } => {
                // Boxed: the mesh caller's future is five times the HTTP call's, and every
                // request's future would otherwise carry (and move) it.
                return Box::pin(self.generate_on_mesh(calls, name, &body, timeout, started)).await;
            }
        };
        let native = pass
            .and_then(|p| p.native.as_ref())
            .filter(|_| http.api == Api::Anthropic);
        let json = match native {
            Some(n) => Ok(native_body(n, model, max_tokens)),
            None => http.body(&body, None),
        };
        let json = match json {
            Ok(j) => j,
            Err(e) => {
                let error = format!("cannot write the upstream request: {e}");
                return Generation {
                    error: Some(error),
                    ..Generation::failed(GenerationStatus::Error, 0)
                }
                .into();
            }
        };
        let call = self.post.post_json(&http.uri, &http.headers, json);
        let result = tokio::time::timeout(timeout, call).await;
        let latency_ms = started.elapsed().as_millis() as u64;
        let failed = |status, error: String| Generation {
            error: Some(error),
            ..Generation::failed(status, latency_ms)
        };
        let (status, headers, bytes) = match result {
            Err(_) => {
                return failed(
                    GenerationStatus::Timeout,
                    format!("no answer within {} ms", timeout.as_millis()),
                )
                .into();
            }
            Ok(Err(e)) => return failed(unanswered(&*e), error_chain(&*e)).into(),
            Ok(Ok(parts)) => parts,
        };
        let mut attempt = judge(http.api, status, &headers, &bytes, latency_ms);
        // Answered as it was asked: the Messages answer itself (thinking blocks and all).
        if native.is_some()
            && attempt.generation.status == GenerationStatus::Ok
            && let Ok(message) = serde_json::from_slice::<Value>(&bytes)
        {
            attempt.body = Some(Reply::Json(message));
        }
        attempt
    }
}

/// A Messages request as it came, for `model` with oam's token limit: oam's own object left
/// out, and whole (a stream of it is sent once checked).
fn native_body(request: &Value, model: &str, max_tokens: u32) -> Vec<u8> {
    let mut r = request.clone();
    if let Some(m) = r.as_object_mut() {
        m.remove("oam");
        m.remove("stream");
        m.insert("model".into(), Value::String(model.into()));
        m.insert("max_tokens".into(), max_tokens.into());
    }
    serde_json::to_vec(&r).unwrap_or_default()
}

/// `{base_url}/{path}`, parsed (`None` if it does not parse).
fn endpoint(base_url: &str, path: &str) -> Option<reqwest::Url> {
    reqwest::Url::parse(&format!("{}/{path}", base_url.trim_end_matches('/'))).ok()
}

/// A whole upstream answer (status, headers, body) in `api` as an attempt.
fn judge(
    api: Api,
    status: reqwest::StatusCode,
    headers: &HeaderMap,
    bytes: &bytes::Bytes,
    latency_ms: u64,
) -> Attempt {
    let failed = |status, error: String| Generation {
        error: Some(error),
        ..Generation::failed(status, latency_ms)
    };
    {
        if status.as_u16() == 429 {
            return Generation {
                retry_after_ms: retry_after_ms(headers),
                ..failed(GenerationStatus::RateLimited, "HTTP 429".into())
            }
            .into();
        }
        if !status.is_success() {
            let body = serde_json::from_slice::<Value>(bytes).ok();
            let error = body.as_ref().map(|v| &v["error"]);
            let detail = error
                .and_then(|e| e["message"].as_str())
                .unwrap_or_default();
            let kind = refusal(status.as_u16(), error);
            return Attempt {
                generation: failed(kind, format!("HTTP {status} {detail}")),
                body: body.map(Reply::Json),
                http_status: status.as_u16(),
            };
        }
        if api == Api::Anthropic {
            let Ok(message) = serde_json::from_slice::<Value>(bytes) else {
                return failed(
                    GenerationStatus::Error,
                    "the body is not a JSON message".into(),
                )
                .into();
            };
            let chat = messages::completion_of(&message, unix_now());
            return completion(
                &serde_json::to_vec(&chat).unwrap_or_default().into(),
                latency_ms,
            );
        }
        completion(bytes, latency_ms)
    }
}

/// A streamed answer under way: the upstream's events as they arrive.
pub struct Stream {
    source: Source,
    parser: crate::http::sse::Parser,
    ready: std::collections::VecDeque<String>,
    /// Bytes the stream may still bring (`node.max_answer_bytes` in all).
    left: usize,
    /// A Messages stream, read as chat chunks.
    translate: Option<messages::Chunks>,
}

enum Source {
    Http(reqwest::Response),
    /// A provider that cannot stream (a mesh agent): its whole answer, as events.
    Replay,
    Ended,
}

/// Why a stream broke off.
#[derive(Debug, Clone, PartialEq)]
pub enum Broken {
    /// Nothing arrived within the deadline.
    Silent,
    /// The connection failed (cut, reset) or the stream was unreadable.
    Failed(String),
}

/// Opening a stream: it answered 200 and streams, or the attempt failed before any event.
pub enum Opened {
    Streaming(Stream, Instant),
    Failed(Attempt),
}

impl Stream {
    /// The next event's data, waiting at most `wait`; `None` when the body ended.
    pub async fn next(&mut self, wait: Duration) -> Result<Option<String>, Broken> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(e) = self.ready.pop_front() {
                return Ok(Some(e));
            }
            let Source::Http(resp) = &mut self.source else {
                return Ok(None);
            };
            let chunk = tokio::time::timeout_at(deadline, resp.chunk()).await;
            match chunk {
                Err(_) => return Err(Broken::Silent),
                Ok(Err(e)) => {
                    self.source = Source::Ended;
                    return Err(Broken::Failed(error_chain(&e)));
                }
                Ok(Ok(None)) => {
                    self.source = Source::Ended;
                    return Ok(None);
                }
                Ok(Ok(Some(bytes))) if bytes.len() > self.left => {
                    self.source = Source::Ended;
                    return Err(Broken::Failed(
                        "the stream is larger than node.max_answer_bytes".into(),
                    ));
                }
                Ok(Ok(Some(bytes))) => {
                    self.left -= bytes.len();
                    match self.parser.feed(&bytes) {
                        Ok(events) => match &mut self.translate {
                            Some(t) => {
                                for e in events {
                                    self.ready.extend(t.event(&e));
                                }
                            }
                            None => self.ready.extend(events),
                        },
                        Err(_) => {
                            self.source = Source::Ended;
                            return Err(Broken::Failed("an event line over 1 MiB".into()));
                        }
                    }
                }
            }
        }
    }
}

impl Connector {
    /// Open a streamed chat completion from `model` (`stream: true`, usage asked for), the
    /// client's request as it came, continuing `prefill` (the answer so far) when given. The
    /// response headers must come within `first_event`. A provider that cannot stream (a mesh
    /// agent) answers whole, replayed as events.
    pub async fn open_stream(
        &self,
        model: &str,
        pass: &Passthrough,
        prefill: Option<&str>,
        max_tokens: u32,
        first_event: Duration,
    ) -> Opened {
        let started = Instant::now();
        let Upstream::Http(http) = &self.upstream else {
            let a = self
                .generate(model, &[], Some(pass), max_tokens, None, first_event)
                .await;
            return match (&a.generation.status, a.body.as_ref().and_then(Reply::value)) {
                (GenerationStatus::Ok, Some(body)) => {
                    Opened::Streaming(Stream::replay(&body, pass.include_usage), started)
                }
                _ => Opened::Failed(a),
            };
        };
        let messages = match prefill {
            Some(text) => Messages::Prefilled(
                &pass.messages,
                serde_json::json!({"role": "assistant", "content": text}),
            ),
            None => Messages::AsSent(&pass.messages),
        };
        let body = Body {
            extra: Some(&pass.extra),
            tools: pass.tools.as_deref(),
            model,
            messages,
            max_tokens,
            response_format: None,
            stream: true,
            stream_options: (http.api == Api::Openai)
                .then(|| serde_json::json!({"include_usage": true})),
        };
        let req = http
            .request(reqwest::Method::POST, &http.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(http.body(&body, prefill).unwrap_or_default());
        let resp = match tokio::time::timeout(first_event, req.send()).await {
            Err(_) => {
                let g = Generation {
                    error: Some(format!("no response within {} ms", first_event.as_millis())),
                    ..Generation::failed(
                        GenerationStatus::Timeout,
                        started.elapsed().as_millis() as u64,
                    )
                };
                return Opened::Failed(g.into());
            }
            Ok(Err(e)) => {
                let g = Generation {
                    error: Some(error_chain(&e)),
                    ..Generation::failed(unanswered(&e), started.elapsed().as_millis() as u64)
                };
                return Opened::Failed(g.into());
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
            return Opened::Streaming(
                Stream {
                    source: Source::Http(resp),
                    parser: crate::http::sse::Parser::default(),
                    ready: std::collections::VecDeque::new(),
                    left: self.post.max_answer_bytes(),
                    translate: (http.api == Api::Anthropic)
                        .then(|| messages::Chunks::new(unix_now())),
                },
                started,
            );
        }
        // Not a stream: an error answer (judged as a whole one is), or a whole answer from an
        // upstream that ignored `stream` (replayed as events).
        let headers = resp.headers().clone();
        let left = first_event.saturating_sub(started.elapsed());
        let read = read_capped(resp, self.post.max_answer_bytes());
        let Ok(Ok(bytes)) = tokio::time::timeout(left, read).await else {
            let ms = started.elapsed().as_millis() as u64;
            return Opened::Failed(Generation::failed(GenerationStatus::Error, ms).into());
        };
        let a = judge(
            http.api,
            status,
            &headers,
            &bytes,
            started.elapsed().as_millis() as u64,
        );
        match (&a.generation.status, a.body.as_ref().and_then(Reply::value)) {
            (GenerationStatus::Ok, Some(body)) => {
                Opened::Streaming(Stream::replay(&body, pass.include_usage), started)
            }
            _ => Opened::Failed(a),
        }
    }
}

impl Stream {
    /// A whole chat completion as the events a stream of it would carry.
    fn replay(answer: &Value, include_usage: bool) -> Stream {
        let ready = super::openai::events_of(answer, include_usage).into();
        Stream {
            source: Source::Replay,
            parser: crate::http::sse::Parser::default(),
            ready,
            left: 0,
            translate: None,
        }
    }
}

/// A whole response body, if it holds at most `cap` bytes (read no further than that).
async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Result<bytes::Bytes, String> {
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| error_chain(&e))? {
        if body.len() + chunk.len() > cap {
            return Err(format!(
                "the answer is larger than node.max_answer_bytes ({cap} bytes)"
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.into())
}

impl Connector {
    /// Embeddings from `model`, bounded by `timeout`: the client's request as it came
    /// (`pass.extra`: `input`, `dimensions`, `encoding_format`, `user`) with the target's model.
    /// An answer of 200 whose list does not hold one embedding per input is a failure of the
    /// target, not an answer.
    pub async fn embed(&self, model: &str, pass: &Passthrough, timeout: Duration) -> Attempt {
        let started = Instant::now();
        let Upstream::Http(http) = &self.upstream else {
            // Checked at load: an agent serves no embeddings.
            return Generation::failed(GenerationStatus::Error, 0).into();
        };
        let mut body = pass.extra.clone();
        body.insert("model".into(), Value::String(model.into()));
        let call = async {
            let resp = http
                .request(reqwest::Method::POST, &http.embeddings_url)
                .json(&body)
                .send()
                .await
                .map_err(|e| error_chain(&e))?;
            let (status, headers) = (resp.status(), resp.headers().clone());
            let bytes = read_capped(resp, self.post.max_answer_bytes()).await?;
            Ok::<_, String>((status, headers, bytes))
        };
        let result = tokio::time::timeout(timeout, call).await;
        let latency_ms = started.elapsed().as_millis() as u64;
        let failed = |status, error: String| -> Attempt {
            Generation {
                error: Some(error),
                ..Generation::failed(status, latency_ms)
            }
            .into()
        };
        let (status, headers, bytes) = match result {
            Err(_) => {
                let why = format!("no answer within {} ms", timeout.as_millis());
                return failed(GenerationStatus::Timeout, why);
            }
            Ok(Err(e)) => return failed(GenerationStatus::Error, e),
            Ok(Ok(parts)) => parts,
        };
        let attempt = judge(Api::Openai, status, &headers, &bytes, latency_ms);
        if attempt.generation.status != GenerationStatus::Ok {
            return attempt;
        }
        let inputs = match &pass.extra["input"] {
            Value::Array(items) if items.iter().all(Value::is_number) => 1,
            Value::Array(items) => items.len(),
            _ => 1,
        };
        let answered = attempt
            .body
            .as_ref()
            .and_then(Reply::value)
            .and_then(|v| v["data"].as_array().map(Vec::len));
        if answered != Some(inputs) {
            let why = format!(
                "the answer holds {} embeddings for {inputs} inputs",
                answered.map_or("no list of".to_string(), |n| n.to_string())
            );
            return failed(GenerationStatus::Error, why);
        }
        attempt
    }

    /// `GET /models`, bounded by `timeout`: a free check that the provider answers.
    pub async fn list_models(&self, timeout: Duration) -> Generation {
        let started = Instant::now();
        let Upstream::Http(http) = &self.upstream else {
            // Checked at load: an agent has no model list to probe.
            return Generation::failed(GenerationStatus::Error, 0);
        };
        let req = http.request(reqwest::Method::GET, &http.models_url);
        let result = tokio::time::timeout(timeout, req.send()).await;
        let latency_ms = started.elapsed().as_millis() as u64;
        let status = match result {
            Err(_) => GenerationStatus::Timeout,
            Ok(Err(_)) => GenerationStatus::Error,
            Ok(Ok(r)) if r.status().is_success() => GenerationStatus::Ok,
            Ok(Ok(_)) => GenerationStatus::Error,
        };
        Generation::failed(status, latency_ms)
    }

    /// A provider that is a mesh agent: the chat request is its payload, a chat completion its
    /// answer.
    async fn generate_on_mesh(
        &self,
        calls: &AgentCalls,
        agent: &str,
        body: &Body<'_>,
        timeout: Duration,
        started: Instant,
    ) -> Attempt {
        use crate::mesh::protocol::ErrorCode;
        let payload = serde_json::to_vec(body).unwrap_or_default();
        let result = match calls.caller().await {
            Ok(caller) => caller.call(agent, payload.into(), timeout).await,
            Err(e) => {
                let why = format!("cannot watch the mesh for deaths: {e:#}");
                return Generation {
                    error: Some(why),
                    ..Generation::failed(GenerationStatus::Error, 0)
                }
                .into();
            }
        };
        let latency_ms = started.elapsed().as_millis() as u64;
        match result {
            Ok(bytes) => completion(&bytes, latency_ms),
            Err(e) => {
                let status = if e.code == ErrorCode::Timeout {
                    GenerationStatus::Timeout
                } else {
                    GenerationStatus::Error
                };
                Generation {
                    error: Some(e.to_string()),
                    ..Generation::failed(status, latency_ms)
                }
                .into()
            }
        }
    }
}

/// One attempt's outcome: the generation the pipeline judges, and the upstream's body as it
/// came with its HTTP status (an accepted answer, or a content-policy refusal, passes it on with
/// oam's object added).
pub struct Attempt {
    pub generation: Generation,
    pub body: Option<Reply>,
    /// 0 when nothing was answered.
    pub http_status: u16,
}

impl From<Generation> for Attempt {
    fn from(generation: Generation) -> Self {
        Attempt {
            generation,
            body: None,
            http_status: 0,
        }
    }
}

/// An upstream's answer body. A chat completion of the usual shape is kept as its bytes and
/// passed on as it came, with oam's object written in (parsing it into a tree and writing the
/// tree out again cost more than the rest of the hop); anything else is kept parsed.
#[derive(Debug)]
pub enum Reply {
    /// A JSON object with a `choices` array and no `oam` member, as the upstream sent it.
    Completion(bytes::Bytes),
    /// Any other JSON: an error body, a completion of another shape.
    Json(Value),
}

impl Reply {
    /// The body as a JSON tree (parsed again for a completion: only the rare paths that
    /// rewrite it ask).
    pub fn value(&self) -> Option<Value> {
        match self {
            Reply::Completion(b) => serde_json::from_slice(b).ok(),
            Reply::Json(v) => Some(v.clone()),
        }
    }
}

/// `with_member` for an object that may already hold a member `name` (an answer oam did not
/// read member by member): one whose bytes spell the name, or hold any `\u` escape that could
/// spell it, is read as a tree and the member set there. The result never carries two members
/// of one name, which parsers would tell apart differently.
pub fn set_member(object: &[u8], name: &str, value: &[u8]) -> Vec<u8> {
    use memchr::memmem::find;
    let quoted = format!("\"{name}\"");
    if (find(object, quoted.as_bytes()).is_some() || find(object, b"\\u").is_some())
        && let Ok(Value::Object(mut members)) = serde_json::from_slice::<Value>(object)
        && let Ok(value) = serde_json::from_slice::<Value>(value)
    {
        members.insert(name.to_string(), value);
        if let Ok(out) = serde_json::to_vec(&members) {
            return out;
        }
    }
    with_member(object, name, value)
}

/// The JSON object `object` (with no member named `name`) with `"name": <value>` written in
/// as its last member; anything but an object becomes `{"name": <value>}`.
pub fn with_member(object: &[u8], name: &str, value: &[u8]) -> Vec<u8> {
    let trimmed = object.trim_ascii();
    let mut out = Vec::with_capacity(object.len() + name.len() + value.len() + 8);
    match trimmed
        .strip_prefix(b"{")
        .and_then(|o| o.strip_suffix(b"}"))
    {
        Some(members) if !members.trim_ascii().is_empty() => {
            out.push(b'{');
            out.extend_from_slice(members);
            out.push(b',');
        }
        _ => out.push(b'{'),
    }
    out.push(b'"');
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\":");
    out.extend_from_slice(value);
    out.push(b'}');
    out
}

/// The parts of a chat completion oam reads, borrowed from its bytes (everything else is
/// skipped unread). Where a part has another shape, this fails and the completion is read as
/// a tree instead, with the same leniency as before.
mod wire {
    use serde::{Deserialize, Deserializer};
    use std::borrow::Cow;

    #[derive(Deserialize)]
    pub struct Completion<'a> {
        #[serde(borrow)]
        pub choices: Vec<Choice<'a>>,
        /// Present (even as `null`) or not.
        #[serde(default, deserialize_with = "present")]
        pub usage: Option<Option<Usage>>,
        #[serde(default, deserialize_with = "present")]
        pub oam: Option<serde::de::IgnoredAny>,
    }

    #[derive(Deserialize)]
    pub struct Choice<'a> {
        #[serde(default, borrow)]
        pub finish_reason: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub message: Option<Message<'a>>,
    }

    #[derive(Deserialize)]
    pub struct Message<'a> {
        #[serde(default, borrow)]
        pub content: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub tool_calls: Option<Vec<ToolCall<'a>>>,
    }

    #[derive(Deserialize)]
    pub struct ToolCall<'a> {
        #[serde(default, borrow)]
        pub function: Option<Function<'a>>,
    }

    #[derive(Deserialize)]
    pub struct Function<'a> {
        #[serde(default, borrow)]
        pub name: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub arguments: Option<Cow<'a, str>>,
    }

    #[derive(Deserialize, Default)]
    pub struct Usage {
        #[serde(default)]
        pub prompt_tokens: Option<u64>,
        #[serde(default)]
        pub completion_tokens: Option<u64>,
        #[serde(default)]
        pub prompt_tokens_details: Option<PromptDetails>,
        #[serde(default)]
        pub completion_tokens_details: Option<CompletionDetails>,
        /// Prompt tokens written to the cache (Anthropic's name, passed on by some gateways).
        #[serde(default)]
        pub cache_creation_input_tokens: Option<u64>,
    }

    #[derive(Deserialize, Default)]
    pub struct PromptDetails {
        #[serde(default)]
        pub cached_tokens: Option<u64>,
    }

    #[derive(Deserialize, Default)]
    pub struct CompletionDetails {
        #[serde(default)]
        pub reasoning_tokens: Option<u64>,
    }

    impl Usage {
        pub fn counted(self) -> crate::core::request::Usage {
            crate::core::request::Usage {
                prompt_tokens: self.prompt_tokens.unwrap_or(0),
                completion_tokens: self.completion_tokens.unwrap_or(0),
                cached_tokens: self
                    .prompt_tokens_details
                    .and_then(|d| d.cached_tokens)
                    .unwrap_or(0),
                cache_write_tokens: self.cache_creation_input_tokens.unwrap_or(0),
                reasoning_tokens: self
                    .completion_tokens_details
                    .and_then(|d| d.reasoning_tokens)
                    .unwrap_or(0),
            }
        }
    }

    fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
    ) -> Result<Option<T>, D::Error> {
        T::deserialize(d).map(Some)
    }
}

/// A chat completion of the usual shape, read from its bytes without building a tree.
fn completion_fast(bytes: &bytes::Bytes, latency_ms: u64) -> Option<Attempt> {
    use std::borrow::Cow;
    let trimmed = bytes.trim_ascii();
    if !(trimmed.starts_with(b"{") && trimmed.ends_with(b"}")) {
        return None;
    }
    let c: wire::Completion = serde_json::from_slice(bytes).ok()?;
    if c.oam.is_some() {
        return None;
    }
    let choice = c.choices.into_iter().next();
    let (finish_reason, message) = match choice {
        Some(ch) => (ch.finish_reason, ch.message),
        None => (None, None),
    };
    let (content, calls) = match message {
        Some(m) => (m.content, m.tool_calls),
        None => (None, None),
    };
    let tool_calls = calls
        .into_iter()
        .flatten()
        .map(|c| {
            let (name, arguments) = match c.function {
                Some(f) => (f.name, f.arguments),
                None => (None, None),
            };
            crate::core::contract::ToolCall {
                name: name.map(Cow::into_owned).unwrap_or_default(),
                arguments: arguments.map(Cow::into_owned).unwrap_or_default(),
            }
        })
        .collect();
    let generation = Generation {
        status: if finish_reason.as_deref() == Some("content_filter") {
            GenerationStatus::ContentPolicy
        } else {
            GenerationStatus::Ok
        },
        content: content.map(Cow::into_owned).unwrap_or_default(),
        finish_reason: finish_reason.map(Cow::into_owned),
        latency_ms,
        usage: c.usage.map(|u| u.unwrap_or_default().counted()),
        retry_after_ms: None,
        error: None,
        tool_calls,
        pace_ms: None,
    };
    Some(Attempt {
        generation,
        body: Some(Reply::Completion(bytes.clone())),
        http_status: 200,
    })
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

/// Read a chat completion body into a `Generation`, keeping the body.
fn completion(bytes: &bytes::Bytes, latency_ms: u64) -> Attempt {
    completion_fast(bytes, latency_ms).unwrap_or_else(|| completion_tree(bytes, latency_ms))
}

/// `completion` for any shape: read as a JSON tree, leniently (a part of another type reads
/// as missing).
fn completion_tree(bytes: &[u8], latency_ms: u64) -> Attempt {
    let Ok(v) = serde_json::from_slice::<Value>(bytes) else {
        return Generation {
            error: Some("the response body is not a JSON chat completion".into()),
            ..Generation::failed(GenerationStatus::Error, latency_ms)
        }
        .into();
    };
    let choice = &v["choices"][0];
    let usage = v.get("usage").map(super::openai::usage_of);
    let finish_reason = choice["finish_reason"].as_str();
    let generation = Generation {
        // Cut by the upstream's content filter: its refusal, passed on as it came.
        status: if finish_reason == Some("content_filter") {
            GenerationStatus::ContentPolicy
        } else {
            GenerationStatus::Ok
        },
        content: choice["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        finish_reason: finish_reason.map(String::from),
        latency_ms,
        usage,
        retry_after_ms: None,
        error: None,
        tool_calls: tool_calls(&choice["message"]["tool_calls"]),
        pace_ms: None,
    };
    Attempt {
        generation,
        body: Some(Reply::Json(v)),
        http_status: 200,
    }
}

/// The tool calls of an answer's message (`[{function: {name, arguments}}]`).
pub fn tool_calls(calls: &Value) -> Vec<crate::core::contract::ToolCall> {
    calls
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| crate::core::contract::ToolCall {
            name: c["function"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            arguments: c["function"]["arguments"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        })
        .collect()
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

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        parts.push(s.to_string());
        cur = s.source();
    }
    parts.join(": ")
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
    fn a_completion_read_from_its_bytes_reads_as_its_tree_does() {
        let bodies = [
            r#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hi \u00e9\n"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#,
            r#"{"choices":[{"message":{"content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}},{"function":null}]},"finish_reason":"tool_calls"}]}"#,
            r#"{"choices":[{"message":{"content":"x"},"finish_reason":"content_filter"}],"usage":null}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":null}}"#,
            r#" { "choices" : [ { "message" : null , "finish_reason" : null } ] , "logprobs" : {"a": [1, 2]} } "#,
            // Shapes the fast reading leaves to the tree:
            r#"{"choices":[{"message":{"content":[{"type":"text","text":"parts"}]}}]}"#,
            r#"{"choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":1.5}}"#,
            r#"{"choices":[{"message":{"content":"x"}}],"usage":7}"#,
            r#"{"choices":[{"message":{"content":"x"}}],"oam":null}"#,
            r#"{"choices":"none","usage":{"prompt_tokens":2}}"#,
            r#"{"object":"list"}"#,
            r#"[[{"message":{"content":"x"}}]]"#,
            r#"{"choices":[{"message":{"content":"a"}}],"choices":[{"message":{"content":"b"}}]}"#,
        ];
        let mut fast = 0;
        for body in bodies {
            let bytes = bytes::Bytes::from(body);
            let tree = completion_tree(&bytes, 7);
            let read = completion(&bytes, 7);
            assert_eq!(read.generation, tree.generation, "{body}");
            match read.body {
                Some(Reply::Completion(b)) => {
                    fast += 1;
                    assert_eq!(b, bytes);
                    let v: Value = serde_json::from_slice(&b).unwrap();
                    assert!(v["choices"].is_array() && v.get("oam").is_none(), "{body}");
                }
                Some(Reply::Json(v)) => assert_eq!(Some(v), tree.body.and_then(|b| b.value())),
                None => assert!(tree.body.is_none(), "{body}"),
            }
        }
        assert_eq!(fast, 5, "the usual shapes are read without a tree");
    }

    #[test]
    fn a_member_set_where_it_may_exist_is_never_there_twice() {
        for (object, want) in [
            (
                r#"{"status":"up","a":1}"#,
                serde_json::json!({"a": 1, "status": 200}),
            ),
            (
                r#"{"st\u0061tus":"up"}"#,
                serde_json::json!({"status": 200}),
            ),
            (
                r#"{"a":"\"status\""}"#,
                serde_json::json!({"a": "\"status\"", "status": 200}),
            ),
        ] {
            let out = set_member(object.as_bytes(), "status", b"200");
            let text = String::from_utf8(out).unwrap();
            assert_eq!(text.matches("status\":").count(), 1, "{text}");
            assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), want);
        }
        // Nothing that could spell it: written in as it came.
        let plain = br#"{"a":1, "b":"x"}"#;
        assert_eq!(
            set_member(plain, "status", b"200"),
            with_member(plain, "status", b"200")
        );
    }

    #[test]
    fn a_member_is_written_into_an_object_as_it_came() {
        let cases = [
            (
                r#"{"a":1,"b":[{"c":"}"}]}"#,
                r#"{"a":1,"b":[{"c":"}"}],"oam":{"x":true}}"#,
            ),
            (
                " {\n \"a\" : 1 \n}\n",
                "{\n \"a\" : 1 \n,\"oam\":{\"x\":true}}",
            ),
            ("{}", r#"{"oam":{"x":true}}"#),
            ("", r#"{"oam":{"x":true}}"#),
        ];
        for (object, want) in cases {
            let out = with_member(object.as_bytes(), "oam", br#"{"x":true}"#);
            assert_eq!(String::from_utf8(out.clone()).unwrap(), want);
            let v: Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(v["oam"]["x"], true);
        }
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
