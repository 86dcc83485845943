//! The upstream APIs a provider may speak, as siblings behind one trait, one file each: an
//! OpenAI-compatible server (`openai`), Anthropic's Messages API (`anthropic`), an agent on the
//! mesh (`agent`), a Model Context Protocol server's tools (`mcp`). Each turns whatever happened (an answer, a 5xx, a 429, a reset, a timeout, a
//! death) into an `Attempt` for the pipeline, with the real elapsed time, and its stream into
//! chat chunks; adding an API is a sibling file and a line in `Connector::new`. Nothing here
//! uses a client API's module: both sides meet in `exchange`.

mod agent;
mod anthropic;
mod chat;
mod http;
mod injected;
mod mcp;
mod openai;
mod targets;

use agent::AgentCalls;
pub(crate) use anthropic::not_carried;
pub(crate) use injected::Injected;
pub(crate) use targets::Upstreams;

use super::config::{Probe, ProviderConfig};
use super::exchange::{Attempt, Passthrough, Reply, events_of, read_completion};
use crate::core::request::{Api, Generation, GenerationStatus, Message};
use crate::node::exchange::ToolDefinition;
use futures_util::future::BoxFuture;
use serde_json::Value;
use std::time::{Duration, Instant};

/// What one attempt for a whole answer asks of a target.
#[derive(Clone, Copy)]
pub(crate) struct UpstreamCall<'a> {
    /// The upstream's name of the target's model.
    pub model: &'a str,
    /// The client's request as it came; `None` for a probe, which sends just `messages`.
    pub pass: Option<&'a Passthrough>,
    pub messages: &'a [Message],
    /// oam's token limit.
    pub max_tokens: u32,
    pub response_format: Option<&'a Value>,
}

/// One upstream API. Futures are boxed: a provider's API is chosen by its configuration.
trait Upstream: Send + Sync {
    /// One whole answer, bounded by `timeout`.
    fn generate<'a>(&'a self, ask: UpstreamCall<'a>, timeout: Duration) -> BoxFuture<'a, Attempt>;

    /// Open a streamed answer to the client's request `pass` (usage asked for), continuing
    /// `prefill` (the answer so far) when given; the response must begin within
    /// `first_event`. One that cannot stream (an agent, a tool) answers whole, replayed as a
    /// stream's events.
    fn open_stream<'a>(
        &'a self,
        model: &'a str,
        pass: &'a Passthrough,
        _prefill: Option<&'a str>,
        max_tokens: u32,
        first_event: Duration,
    ) -> BoxFuture<'a, Opened> {
        Box::pin(async move {
            let started = Instant::now();
            let ask = UpstreamCall {
                model,
                pass: Some(pass),
                messages: &[],
                max_tokens,
                response_format: None,
            };
            let a = self.generate(ask, first_event).await;
            Opened::whole(a, pass.include_usage, started)
        })
    }

    /// Embeddings of the client's request `pass`. Only an API that serves them is asked
    /// (checked at load).
    fn embed<'a>(
        &'a self,
        _model: &'a str,
        _pass: &'a Passthrough,
        _timeout: Duration,
    ) -> BoxFuture<'a, Attempt> {
        Box::pin(std::future::ready(
            Generation::failed(GenerationStatus::Error, 0).into(),
        ))
    }

    /// A free check that it answers (its model list, `GET /models`; a tool server's tool
    /// list), bounded by `timeout`, which stands in for a billed one; `None` when it has none.
    fn free_check(&self, timeout: Duration) -> Option<BoxFuture<'_, Generation>> {
        let listing = self.tool_list(timeout)?;
        Some(Box::pin(async move {
            let started = Instant::now();
            let listed = listing.await;
            let ms = started.elapsed().as_millis() as u64;
            match listed {
                Ok(_) => Generation::ok("", ms),
                Err(why) => Generation {
                    error: Some(why.to_string()),
                    ..Generation::failed(GenerationStatus::Error, ms)
                },
            }
        }))
    }

    /// The mesh agent that serves it, if it is one.
    fn agent(&self) -> Option<&str> {
        None
    }

    /// The tools it serves, as it lists them (a tool server's), bounded by `timeout`.
    fn tool_list(
        &self,
        _timeout: Duration,
    ) -> Option<BoxFuture<'_, Result<Vec<ToolDefinition>, ToolListError>>> {
        None
    }
}

/// One provider (host): how its targets are reached and checked.
pub(crate) struct Connector {
    pub id: String,
    /// Its models serve embeddings (and are probed with one).
    pub embeddings: bool,
    /// How its targets are checked while idle.
    pub probe: Probe,
    upstream: Box<dyn Upstream>,
    /// Faults chaos injects into its calls.
    injected: std::sync::Arc<injected::Injected>,
}

impl Connector {
    /// The connector of provider `cfg` (checked at load: an agent, or a base URL that parses).
    pub(crate) fn new(
        cfg: &ProviderConfig,
        http: crate::http::lanes::PerLane<reqwest::Client>,
        post: crate::http::Poster,
        calls: &std::sync::Arc<AgentCalls>,
    ) -> Result<Self, SetupError> {
        let upstream: Box<dyn Upstream> = match (&cfg.agent, cfg.api) {
            (Some(name), _) => Box::new(agent::MeshAgent::new(name, calls.clone())),
            (None, Api::Openai) => Box::new(openai::OpenaiCompatible::new(cfg, http, post)?),
            (None, Api::Anthropic) => Box::new(anthropic::AnthropicMessages::new(cfg, http, post)?),
            (None, Api::Mcp) if cfg.mesh_tools => Box::new(agent::MeshTools::new(calls.clone())),
            (None, Api::Mcp) => Box::new(mcp::McpServer::new(cfg, http, &post)?),
        };
        Ok(Connector {
            id: cfg.id.clone(),
            embeddings: cfg.embeddings,
            probe: cfg.probe,
            upstream,
            injected: Default::default(),
        })
    }

    /// Its calls meet the faults of `injected` (chaos) first.
    pub(crate) fn with_faults(self, injected: std::sync::Arc<injected::Injected>) -> Connector {
        Connector { injected, ..self }
    }

    /// The mesh agent that serves this provider, if it is one.
    pub(crate) fn agent(&self) -> Option<&str> {
        self.upstream.agent()
    }

    /// It has a free check (a model list) that stands in for a billed one.
    pub(crate) fn lists_models(&self) -> bool {
        self.upstream.free_check(Duration::ZERO).is_some()
    }

    /// What a chaos fault on a call of `model` may name: this provider, or the target
    /// (`{provider}/{model}`; a one-model provider's target is the provider itself).
    fn fault_names<'a>(&'a self, model: &str) -> [std::borrow::Cow<'a, str>; 2] {
        [
            std::borrow::Cow::Borrowed(self.id.as_str()),
            std::borrow::Cow::Owned(format!("{}/{model}", self.id)),
        ]
    }

    /// A chaos fault on target `target` alone (one model of this provider), met by the free
    /// check that answers for it: the model list says nothing of one target's fault.
    pub(crate) async fn target_check(&self, target: &str, timeout: Duration) -> Option<Generation> {
        if target == self.id {
            return None;
        }
        self.injected.meet_check(&[target], timeout).await
    }

    /// One whole answer from `model`, bounded by `timeout`: the client's request as it came
    /// (`pass`), with the target's model and oam's token limit, or just `messages` (probes).
    pub(crate) async fn generate(
        &self,
        model: &str,
        messages: &[Message],
        pass: Option<&Passthrough>,
        max_tokens: u32,
        response_format: Option<&Value>,
        timeout: Duration,
    ) -> Attempt {
        if let Some(failed) = self.injected.meet(&self.fault_names(model), timeout).await {
            return failed;
        }
        let ask = UpstreamCall {
            model,
            pass,
            messages,
            max_tokens,
            response_format,
        };
        self.upstream.generate(ask, timeout).await
    }

    /// Open a streamed answer (see `Upstream::open_stream`).
    pub(crate) async fn open_stream(
        &self,
        model: &str,
        pass: &Passthrough,
        prefill: Option<&str>,
        max_tokens: u32,
        first_event: Duration,
    ) -> Opened {
        if let Some(failed) = self
            .injected
            .meet(&self.fault_names(model), first_event)
            .await
        {
            return Opened::Failed(failed);
        }
        self.upstream
            .open_stream(model, pass, prefill, max_tokens, first_event)
            .await
    }

    /// Embeddings from `model`, bounded by `timeout`: the client's request as it came
    /// (`pass.extra`) with the target's model.
    pub(crate) async fn embed(
        &self,
        model: &str,
        pass: &Passthrough,
        timeout: Duration,
    ) -> Attempt {
        if let Some(failed) = self.injected.meet(&self.fault_names(model), timeout).await {
            return failed;
        }
        self.upstream.embed(model, pass, timeout).await
    }

    /// The tools it serves (a tool server's; an error for any other provider), bounded by
    /// `timeout`.
    pub(crate) async fn tools(
        &self,
        timeout: Duration,
    ) -> Result<Vec<ToolDefinition>, ToolListError> {
        if let Some(failed) = self.injected.meet(&[&self.id], timeout).await {
            return Err(ToolListError::Failed(
                failed.generation.error.unwrap_or_default(),
            ));
        }
        match self.upstream.tool_list(timeout) {
            Some(list) => list.await,
            None => Err(ToolListError::ServesNone(self.id.clone())),
        }
    }

    /// Its free check (`GET /models`, a tool list), bounded by `timeout`: that the provider
    /// answers (a failure where it has none: checked at load, none is asked).
    pub(crate) async fn list_models(&self, timeout: Duration) -> Generation {
        if let Some(failed) = self.injected.meet_check(&[&self.id], timeout).await {
            return failed;
        }
        match self.upstream.free_check(timeout) {
            Some(check) => check.await,
            None => Generation::failed(GenerationStatus::Error, 0),
        }
    }
}

/// What an attempt asks of a tool server: a probe (no client request: its tool list answers,
/// for free), or one call of a tool, read from the request's one message.
enum ToolAsk {
    Probe,
    Call(ToolCallIn),
}

/// One call of a tool, as `api::mcp::call_body` wrote it into the request's message.
#[derive(serde::Deserialize)]
struct ToolCallIn {
    name: String,
    /// Passed on to the tool as given.
    #[serde(default)]
    arguments: Value,
}

impl ToolAsk {
    /// The ask of `ask`, or the refused attempt (after `ms`) when its message holds no call.
    fn of(ask: &UpstreamCall<'_>, ms: u64) -> Result<ToolAsk, Box<Attempt>> {
        if ask.pass.is_none() {
            return Ok(ToolAsk::Probe);
        }
        let call = ask
            .messages
            .first()
            .and_then(|m| serde_json::from_str::<ToolCallIn>(&m.content).ok());
        match call {
            Some(call) => Ok(ToolAsk::Call(call)),
            None => Err(Box::new(failed(
                GenerationStatus::Rejected,
                "the request holds no tool call".into(),
                ms,
            ))),
        }
    }
}

/// Why the connectors could not be made from the configuration.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A provider's base_url (with the path oam appends to it) is no URL.
    #[error("provider {id}: base_url {url:?} is no URL")]
    BadUrl { id: String, url: String },
    /// The HTTP clients could not be made (the platform's TLS roots unreadable, ...).
    #[error("cannot make the HTTP client: {0}")]
    Http(String),
}

impl SetupError {
    fn bad_url(cfg: &ProviderConfig) -> SetupError {
        SetupError::BadUrl {
            id: cfg.id.clone(),
            url: cfg.base_url.clone(),
        }
    }
}

/// Why a tool list could not be had.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum ToolListError {
    #[error("provider {0} serves no tools")]
    ServesNone(String),
    #[error("no connector for {0}")]
    NoConnector(String),
    /// The attempt failed (no answer, an HTTP error, a fault injected): as it says.
    #[error("{0}")]
    Failed(String),
    #[error("its tools/list result has no tools list")]
    NoList,
    #[error("tools/list refused ({code}): {message}")]
    Refused { code: i64, message: String },
    #[error("tools/list has more than {0} pages")]
    TooManyPages(usize),
    #[error("the catalog did not answer within {0:?}")]
    CatalogSilent(Duration),
    #[error("the catalog could not be read: {0}")]
    CatalogUnread(String),
}

/// A probe's attempt from a tool list (or why there is none), after `ms`.
fn listed(tools: Result<Vec<ToolDefinition>, ToolListError>, ms: u64) -> Attempt {
    match tools {
        Ok(_) => Generation::ok("", ms).into(),
        Err(why) => failed(GenerationStatus::Error, why.to_string(), ms),
    }
}

/// A failed attempt that got no usable answer, and why.
fn failed(status: GenerationStatus, error: String, latency_ms: u64) -> Attempt {
    Generation {
        error: Some(error),
        ..Generation::failed(status, latency_ms)
    }
    .into()
}

/// A streamed answer under way: the upstream's events, as chat chunks, as they arrive.
pub(crate) struct Stream {
    ready: std::collections::VecDeque<String>,
    /// Where more events come from (none: a replayed whole answer, or the body ended).
    events: Option<http::Events>,
}

/// Why a stream broke off.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Broken {
    /// Nothing arrived within the deadline.
    Silent,
    /// The connection failed (cut, reset) or the stream was unreadable.
    Failed(String),
}

/// Opening a stream: it answered 200 and streams, or the attempt failed before any event.
pub(crate) enum Opened {
    Streaming(Stream, Instant),
    Failed(Attempt),
}

impl Opened {
    /// A whole answer where a stream was asked for: an accepted one replayed as the events a
    /// stream of it would carry, anything else the failed attempt it is.
    fn whole(a: Attempt, include_usage: bool, started: Instant) -> Opened {
        let text = a.body.as_ref().map(Reply::text);
        let events = text
            .as_deref()
            .and_then(read_completion)
            .filter(|_| a.generation.status == GenerationStatus::Ok)
            .map(|c| events_of(&c, include_usage));
        match events {
            Some(events) => Opened::Streaming(Stream::replay(events), started),
            None => Opened::Failed(a),
        }
    }
}

impl Stream {
    fn of(events: http::Events) -> Stream {
        Stream {
            ready: std::collections::VecDeque::new(),
            events: Some(events),
        }
    }

    /// A whole answer's events (`events_of`), as a stream.
    fn replay(events: Vec<String>) -> Stream {
        Stream {
            ready: events.into(),
            events: None,
        }
    }

    /// The next event's data, waiting at most `wait`; `None` when the body ended.
    pub(crate) async fn next(&mut self, wait: Duration) -> Result<Option<String>, Broken> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(e) = self.ready.pop_front() {
                return Ok(Some(e));
            }
            let Some(events) = &mut self.events else {
                return Ok(None);
            };
            match events.read(deadline, &mut self.ready).await {
                Ok(true) => {}
                Ok(false) => {
                    self.events = None;
                    return Ok(None);
                }
                // Silent: the stream stays, for a caller that waits longer.
                Err(Broken::Silent) => return Err(Broken::Silent),
                Err(broken) => {
                    self.events = None;
                    return Err(broken);
                }
            }
        }
    }
}
