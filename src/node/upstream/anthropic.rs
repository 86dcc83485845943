//! Anthropic's Messages API (`api = "anthropic"`) behind the chat-completions shape every
//! stage reads: the chat request a target is sent becomes a Messages request, its answer a chat
//! completion, and its event stream chat chunks as the events arrive (`Chunks`), so a route falls
//! back between the two APIs whichever one the client spoke. A request using what Messages has
//! no equivalent for is found before routing (`not_carried`) and bound to chat targets, never
//! sent altered; a Messages request that uses what only Messages has is sent as it came.

use super::super::config::ProviderConfig;
use super::super::exchange::{Attempt, Passthrough, Reply};
use super::http::{Endpoint, judge_failure};
use super::{Opened, Upstream, UpstreamCall, chat, failed};
use crate::core::request::{Generation, GenerationStatus, Usage};
use crate::node::exchange::{
    CallOut, ChatUsage, ChoiceOut, ChunkOut, DeltaOut, FunctionOut, Head, UsageOut, lenient,
    members_of, str_of,
};
use crate::node::model::{Content, Part, Sampling, Speaker, Stop, ToolChoice, Turn};
use futures_util::future::BoxFuture;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::time::{Duration, Instant};

pub(super) struct AnthropicMessages {
    at: Endpoint,
}

impl AnthropicMessages {
    pub(super) fn new(
        cfg: &ProviderConfig,
        http: crate::http::lanes::PerLane<reqwest::Client>,
        post: crate::http::Poster,
    ) -> Result<AnthropicMessages, super::SetupError> {
        let mut headers: Vec<_> = super::http::key(cfg)
            .and_then(|k| super::http::secret(HeaderName::from_static("x-api-key"), &k))
            .into_iter()
            .collect();
        headers.push((
            HeaderName::from_static("anthropic-version"),
            HeaderValue::from_static(VERSION),
        ));
        let at = Endpoint::new(cfg, "messages", headers, http, post)?;
        Ok(AnthropicMessages { at })
    }
}

/// The Messages request for chat `body`, continuing `prefill` when given: what routing let
/// through (`not_carried` found nothing).
fn translated(body: &chat::Body<'_>, prefill: Option<&str>) -> serde_json::Result<Vec<u8>> {
    let probe: Vec<Turn>;
    let turns = match &body.messages {
        chat::Messages::AsSent(t) | chat::Messages::Prefilled(t, _) => *t,
        chat::Messages::Core(m) => {
            probe = m
                .iter()
                .map(|m| Turn::text(Speaker::named(&m.role), m.content.clone()))
                .collect();
            &probe
        }
    };
    let none = Sampling::default();
    serde_json::to_vec(&request_of(
        body.model,
        turns,
        body.sampling.unwrap_or(&none),
        body.tools,
        body.max_tokens,
        body.stream,
        prefill,
    ))
}

/// A Messages request as it came (its members as the client wrote them), for `model` with
/// oam's token limit: oam's own object left out, and whole (a stream of it is sent once
/// checked).
fn native_body(request: &RawValue, model: &str, max_tokens: u32) -> serde_json::Result<Vec<u8>> {
    use serde::ser::{SerializeMap, Serializer};
    let members = members_of(request.get())?;
    let mut out = Vec::with_capacity(request.get().len() + 64);
    let mut ser = serde_json::Serializer::new(&mut out);
    let mut m = ser.serialize_map(None)?;
    for (k, v) in &members {
        if !matches!(k.as_ref(), "oam" | "stream" | "model" | "max_tokens") {
            m.serialize_entry(k.as_ref(), v)?;
        }
    }
    m.serialize_entry("model", model)?;
    m.serialize_entry("max_tokens", &max_tokens)?;
    m.end()?;
    Ok(out)
}

/// Now, in Unix seconds (a translated answer's `created`).
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A whole answer: a failure as `judge_failure` reads it, else the Messages answer read as the
/// chat completion it means.
fn judge(
    status: reqwest::StatusCode,
    headers: &HeaderMap,
    bytes: &bytes::Bytes,
    latency_ms: u64,
) -> Attempt {
    if let Some(failure) = judge_failure(status, headers, bytes, latency_ms) {
        return failure;
    }
    let message = std::str::from_utf8(bytes).ok();
    match message.and_then(|m| completion_of(m, unix_now(), latency_ms)) {
        Some(attempt) => attempt,
        None => {
            let why = "the body is not a JSON message";
            failed(GenerationStatus::Error, why.into(), latency_ms)
        }
    }
}

impl Upstream for AnthropicMessages {
    fn generate<'a>(&'a self, ask: UpstreamCall<'a>, timeout: Duration) -> BoxFuture<'a, Attempt> {
        Box::pin(async move {
            let started = Instant::now();
            let native = ask.pass.and_then(|p| p.native.as_ref());
            let json = match native {
                Some(n) => native_body(n, ask.model, ask.max_tokens),
                None => translated(&chat::Body::whole(&ask), None),
            };
            let json = match json {
                Ok(json) => json,
                Err(e) => {
                    let why = format!("cannot write the upstream request: {e}");
                    return failed(GenerationStatus::Error, why, 0);
                }
            };
            let (status, headers, bytes) = match self.at.call(json, timeout, started).await {
                Ok(parts) => parts,
                Err(a) => return a,
            };
            let latency_ms = started.elapsed().as_millis() as u64;
            let mut attempt = judge(status, &headers, &bytes, latency_ms);
            // Answered as it was asked: the Messages answer itself (thinking blocks and all).
            if native.is_some()
                && attempt.generation.status == GenerationStatus::Ok
                && let Ok(message) = serde_json::from_slice::<Value>(&bytes)
            {
                attempt.body = Some(Reply::Json(message));
            }
            attempt
        })
    }

    fn open_stream<'a>(
        &'a self,
        model: &'a str,
        pass: &'a Passthrough,
        prefill: Option<&'a str>,
        max_tokens: u32,
        first_event: Duration,
    ) -> BoxFuture<'a, Opened> {
        Box::pin(async move {
            let body = chat::Body::streamed(model, pass, prefill, max_tokens);
            let json = translated(&body, prefill).unwrap_or_default();
            let mut chunks = Chunks::new(unix_now());
            let translate: super::http::Translate = Box::new(move |e| chunks.event(e));
            self.at
                .open(
                    json,
                    first_event,
                    Some(translate),
                    pass.include_usage,
                    judge,
                )
                .await
        })
    }

    fn free_check(&self, timeout: Duration) -> Option<BoxFuture<'_, Generation>> {
        Some(Box::pin(self.at.list_models(timeout)))
    }
}

/// The `anthropic-version` oam speaks.
const VERSION: &str = "2023-06-01";

/// The first part of a request (its turns, sampling parameters, the other chat members in
/// `extra`, `response_format`) a Messages request cannot carry, named as the client wrote it;
/// `None` when all of it translates.
pub(crate) fn not_carried(
    turns: &[Turn],
    sampling: &Sampling,
    extra: &Map<String, Value>,
    response_format: Option<&Value>,
) -> Option<String> {
    if response_format.is_some_and(|f| !f.is_null() && f["type"] != "text") {
        return Some("response_format".into());
    }
    // Chat's range is 0 to 2, Messages' 0 to 1.
    if sampling.temperature.is_some_and(|t| t > 1.0) {
        return Some("temperature".into());
    }
    if matches!(sampling.tool_choice, Some(ToolChoice::Other(_))) {
        return Some("tool_choice".into());
    }
    if sampling.n.is_some_and(|n| n != 1) {
        return Some("n".into());
    }
    if sampling.logprobs == Some(true) {
        return Some("logprobs".into());
    }
    if let Some((k, _)) = extra.iter().find(|(_, v)| !v.is_null()) {
        return Some(k.clone());
    }
    let mut past_system = false;
    for (i, t) in turns.iter().enumerate() {
        if let Some(what) = &t.unread {
            return Some(format!("messages[{i}].{what}"));
        }
        let misplaced = t.role.instructs() && past_system;
        if misplaced || matches!(t.role, Speaker::Other(_)) {
            return Some(format!("messages[{i}].role"));
        }
        past_system |= !t.role.instructs();
        if let Content::Parts(parts) = &t.content {
            for (j, p) in parts.iter().enumerate() {
                let ok = match p {
                    Part::Text(_) => true,
                    Part::Image { .. } => t.role == Speaker::User,
                    Part::Other { .. } => false,
                };
                if !ok {
                    return Some(format!("messages[{i}].content[{j}]"));
                }
            }
        }
    }
    None
}

/// A Messages request, written from the typed conversation (`request_of`).
#[derive(Serialize)]
struct Request<'a> {
    model: &'a str,
    max_tokens: u32,
    messages: Vec<Said<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<String>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_sequences: Option<&'a [String]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata: Option<Metadata<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<Vec<Tool<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<Choice<'a>>,
}

/// One Messages turn (Messages alternates: a run of one role's turns is one).
#[derive(Serialize)]
struct Said<'a> {
    role: &'static str,
    content: Vec<Block<'a>>,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block<'a> {
    Text {
        text: &'a str,
    },
    Image {
        source: Source<'a>,
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: OrElse<'a>,
    },
    ToolResult {
        tool_use_id: Option<&'a str>,
        content: String,
    },
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Source<'a> {
    Base64 { media_type: &'a str, data: &'a str },
    Url { url: &'a str },
}

#[derive(Serialize)]
struct Metadata<'a> {
    user_id: &'a str,
}

/// A chat function tool as Messages writes it.
#[derive(Serialize)]
struct Tool<'a> {
    name: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    description: Option<&'a RawValue>,
    input_schema: OrElse<'a>,
}

/// JSON text as it came, or where there is none the object of these members.
struct OrElse<'a>(
    Option<&'a RawValue>,
    &'static [(&'static str, &'static str)],
);

impl Serialize for OrElse<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match self.0 {
            Some(raw) => raw.serialize(s),
            None => {
                let mut m = s.serialize_map(Some(self.1.len()))?;
                for (k, v) in self.1 {
                    m.serialize_entry(k, v)?;
                }
                m.end()
            }
        }
    }
}

#[derive(Serialize)]
struct Choice<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    disable_parallel_tool_use: bool,
}

/// A chat function tool as the client sent it (the node read the list before:
/// `node::tools`).
#[derive(serde::Deserialize)]
struct ChatTool<'a> {
    #[serde(borrow)]
    function: ChatFunction<'a>,
}

#[derive(serde::Deserialize)]
struct ChatFunction<'a> {
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    description: Option<&'a RawValue>,
    #[serde(borrow, default)]
    parameters: Option<&'a RawValue>,
}

/// An image URL as an image source: a `data:` URL as base64, any other as a URL.
fn source(url: &str) -> Source<'_> {
    if let Some(rest) = url.strip_prefix("data:")
        && let Some((media_type, data)) = rest.split_once(";base64,")
    {
        return Source::Base64 { media_type, data };
    }
    Source::Url { url }
}

/// The content blocks of one turn: a tool turn is its result.
fn blocks(t: &Turn) -> Vec<Block<'_>> {
    if t.role == Speaker::Tool {
        return vec![Block::ToolResult {
            tool_use_id: t.answers.as_deref(),
            content: t.plain_text(),
        }];
    }
    let mut out = Vec::new();
    match &t.content {
        Content::Parts(parts) => {
            for p in parts {
                match p {
                    Part::Image { url, .. } => out.push(Block::Image {
                        source: source(url),
                    }),
                    Part::Text(text) if !text.is_empty() => out.push(Block::Text { text }),
                    _ => {}
                }
            }
        }
        Content::Text(text) if !text.is_empty() => out.push(Block::Text { text }),
        _ => {}
    }
    out.extend(t.calls.iter().map(|c| Block::ToolUse {
        id: &c.id,
        name: &c.name,
        // Arguments that are no JSON text (`not_carried` let none through): none.
        input: OrElse(serde_json::from_str(&c.arguments).ok(), &[]),
    }));
    out
}

/// The Messages request a conversation (as `not_carried` passed it) means, for `model`:
/// system turns become `system`; tool results a user turn; consecutive turns of one role one
/// turn (Messages alternates); `prefill`, the answer so far, a trailing assistant turn (without
/// trailing white space, which Messages refuses there).
fn request_of<'a>(
    model: &'a str,
    turns: &'a [Turn],
    sampling: &'a Sampling,
    tools: Option<&'a RawValue>,
    max_tokens: u32,
    stream: bool,
    prefill: Option<&'a str>,
) -> Request<'a> {
    let mut system = Vec::new();
    let mut said: Vec<Said> = Vec::new();
    let mut push = |role, blocks: Vec<Block<'a>>| match said.last_mut() {
        Some(s) if s.role == role => s.content.extend(blocks),
        _ if blocks.is_empty() => {}
        _ => said.push(Said {
            role,
            content: blocks,
        }),
    };
    for t in turns {
        match t.role {
            Speaker::System | Speaker::Developer => system.push(t.plain_text()),
            Speaker::Assistant => push("assistant", blocks(t)),
            _ => push("user", blocks(t)),
        }
    }
    if let Some(text) = prefill.map(str::trim_end).filter(|p| !p.is_empty()) {
        push("assistant", vec![Block::Text { text }]);
    }
    let tools = tools
        .and_then(|t| serde_json::from_str::<Vec<ChatTool>>(t.get()).ok())
        .map(|list| {
            list.into_iter()
                .map(|t| Tool {
                    name: t.function.name,
                    description: t.function.description,
                    input_schema: OrElse(t.function.parameters, &[("type", "object")]),
                })
                .collect()
        });
    let choice = |kind, name| Choice {
        kind,
        name,
        disable_parallel_tool_use: false,
    };
    let mut tool_choice = match &sampling.tool_choice {
        Some(ToolChoice::Mode(mode)) => match mode.as_str() {
            "required" => Some(choice("any", None)),
            "none" => Some(choice("none", None)),
            "auto" => Some(choice("auto", None)),
            _ => None,
        },
        Some(ToolChoice::Function(name)) => Some(choice("tool", Some(name.as_str()))),
        // Bound to chat targets (`not_carried`).
        Some(ToolChoice::Other(_)) | None => None,
    };
    if sampling.parallel_tool_calls == Some(false) {
        let c = tool_choice.get_or_insert(choice("auto", None));
        c.disable_parallel_tool_use = true;
    }
    Request {
        model,
        max_tokens,
        messages: said,
        system: (!system.is_empty()).then(|| system.join("\n")),
        stream,
        temperature: sampling.temperature,
        top_p: sampling.top_p,
        stop_sequences: sampling.stop.as_ref().map(Stop::sequences),
        metadata: sampling.user.as_deref().map(|user_id| Metadata { user_id }),
        tools,
        tool_choice,
    }
}

/// Chat's `finish_reason` for a Messages `stop_reason`.
fn finish_of(stop_reason: Option<&str>) -> &'static str {
    match stop_reason {
        Some("max_tokens") => "length",
        Some("tool_use") => "tool_calls",
        Some("refusal") => "content_filter",
        _ => "stop",
    }
}

/// A Messages usage as it came (its counts so far: a stream's `message_delta` adds to what
/// `message_start` said).
#[derive(Deserialize, Default, Clone, Copy, Debug)]
#[serde(default)]
struct MessagesUsage {
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

impl MessagesUsage {
    /// JSON text read as a usage; nothing where it is of another shape.
    fn of(raw: Option<&RawValue>) -> MessagesUsage {
        lenient(raw)
    }

    /// This, with what `later` says instead.
    fn then(self, later: MessagesUsage) -> MessagesUsage {
        MessagesUsage {
            input_tokens: later.input_tokens.or(self.input_tokens),
            output_tokens: later.output_tokens.or(self.output_tokens),
            cache_read_input_tokens: later
                .cache_read_input_tokens
                .or(self.cache_read_input_tokens),
            cache_creation_input_tokens: later
                .cache_creation_input_tokens
                .or(self.cache_creation_input_tokens),
        }
    }

    /// As chat counts it: the prompt counts the tokens read from and written to the cache
    /// (Messages counts them apart from `input_tokens`).
    fn counted(self) -> Usage {
        let read = self.cache_read_input_tokens.unwrap_or(0);
        let written = self.cache_creation_input_tokens.unwrap_or(0);
        Usage {
            prompt_tokens: self.input_tokens.unwrap_or(0) + read + written,
            completion_tokens: self.output_tokens.unwrap_or(0),
            cached_tokens: read,
            cache_write_tokens: written,
            reasoning_tokens: 0,
        }
    }
}

/// A Messages answer's members oam reads, each as its text.
#[derive(Deserialize, Default)]
#[serde(default)]
struct MessageIn<'a> {
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    content: Option<&'a RawValue>,
    #[serde(borrow)]
    stop_reason: Option<&'a RawValue>,
    #[serde(borrow)]
    usage: Option<&'a RawValue>,
}

/// A content block's members oam reads (of an answer, or of a stream's `content_block_start`).
#[derive(Deserialize, Default)]
#[serde(default)]
struct BlockIn<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<&'a RawValue>,
    #[serde(borrow)]
    text: Option<&'a RawValue>,
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    name: Option<&'a RawValue>,
    #[serde(borrow)]
    input: Option<&'a RawValue>,
}

/// A chat completion as oam writes one from another API's answer.
#[derive(Serialize)]
struct Completion<'a> {
    id: Option<&'a RawValue>,
    object: &'static str,
    created: u64,
    model: Option<&'a RawValue>,
    choices: [CompletionChoice<'a>; 1],
    usage: ChatUsage,
}

#[derive(Serialize)]
struct CompletionChoice<'a> {
    index: u32,
    message: AnswerMessage<'a>,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct AnswerMessage<'a> {
    role: &'static str,
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    tool_calls: &'a [crate::node::model::ToolCall],
}

/// A Messages answer (its text) as the chat completion it means (`created` in Unix seconds):
/// text blocks joined as the content, `tool_use` blocks as tool calls; thinking blocks (a chat
/// client cannot ask for them) are left out. The completion is what the pipeline judges, and
/// its bytes what a chat client is sent; `None` for text that is no JSON object.
fn completion_of(message: &str, created: u64, latency_ms: u64) -> Option<Attempt> {
    let m: MessageIn = serde_json::from_str(message).ok()?;
    let mut text = String::new();
    let mut calls = Vec::new();
    let blocks: Vec<&RawValue> = lenient(m.content);
    for b in blocks {
        let b: BlockIn = lenient(Some(b));
        match str_of(b.kind).as_deref() {
            Some("text") => text.push_str(&str_of(b.text).unwrap_or_default()),
            Some("tool_use") => calls.push(crate::node::model::ToolCall {
                id: str_of(b.id).map(String::from).unwrap_or_default(),
                name: str_of(b.name).map(String::from).unwrap_or_default(),
                arguments: b.input.map_or("null", RawValue::get).to_string(),
            }),
            _ => {}
        }
    }
    let finish = finish_of(str_of(m.stop_reason).as_deref());
    let usage = MessagesUsage::of(m.usage).counted();
    let content = (!text.is_empty() || calls.is_empty()).then_some(text.as_str());
    let completion = Completion {
        id: m.id,
        object: "chat.completion",
        created,
        model: m.model,
        choices: [CompletionChoice {
            index: 0,
            message: AnswerMessage {
                role: "assistant",
                content,
                tool_calls: &calls,
            },
            finish_reason: finish,
        }],
        usage: usage.into(),
    };
    let bytes = serde_json::to_vec(&completion).ok()?;
    let generation = Generation {
        // Cut by the upstream's content filter: its refusal, passed on as it came.
        status: if finish == "content_filter" {
            GenerationStatus::ContentPolicy
        } else {
            GenerationStatus::Ok
        },
        content: text,
        finish_reason: Some(finish.to_string()),
        latency_ms,
        usage: Some(usage),
        retry_after_ms: None,
        error: None,
        tool_calls: calls
            .into_iter()
            .map(|c| crate::core::contract::ToolCall {
                name: c.name,
                arguments: c.arguments,
            })
            .collect(),
        pace_ms: None,
        agent_usage: None,
    };
    Some(Attempt {
        generation,
        body: Some(Reply::Completion(bytes.into())),
        http_status: 200,
    })
}

/// A Messages event's members oam reads, each as its text.
#[derive(Deserialize, Default)]
#[serde(default)]
struct EventIn<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<&'a RawValue>,
    #[serde(borrow)]
    index: Option<&'a RawValue>,
    #[serde(borrow)]
    message: Option<&'a RawValue>,
    #[serde(borrow)]
    content_block: Option<&'a RawValue>,
    #[serde(borrow)]
    delta: Option<&'a RawValue>,
    #[serde(borrow)]
    usage: Option<&'a RawValue>,
    #[serde(borrow)]
    error: Option<&'a RawValue>,
}

/// An event's `delta` members oam reads.
#[derive(Deserialize, Default)]
#[serde(default)]
struct EventDeltaIn<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<&'a RawValue>,
    #[serde(borrow)]
    text: Option<&'a RawValue>,
    #[serde(borrow)]
    partial_json: Option<&'a RawValue>,
    #[serde(borrow)]
    stop_reason: Option<&'a RawValue>,
}

/// A Messages event stream read as chat chunks, event by event: what the events so far said
/// (the message's id and model, its usage, which blocks are tool calls).
struct Chunks {
    /// When the answer began, in Unix seconds (as JSON).
    created: Option<Box<RawValue>>,
    id: Option<Box<RawValue>>,
    model: Option<Box<RawValue>>,
    usage: MessagesUsage,
    /// Per block index: the tool call's position among the answer's calls, if it is one.
    calls: Vec<Option<usize>>,
    ncalls: usize,
}

impl Chunks {
    fn new(created: u64) -> Self {
        Chunks {
            created: serde_json::value::to_raw_value(&created).ok(),
            id: None,
            model: None,
            usage: MessagesUsage::default(),
            calls: Vec::new(),
            ncalls: 0,
        }
    }

    fn write(&self, choices: &[ChoiceOut], usage: Option<ChatUsage>) -> String {
        let head = Head {
            id: self.id.as_deref(),
            created: self.created.as_deref(),
            model: self.model.as_deref(),
        };
        let mut chunk = ChunkOut::of(head, choices);
        chunk.usage = usage.map(UsageOut::Counted);
        chunk.text()
    }

    fn chunk(&self, delta: DeltaOut, finish: Option<&str>) -> String {
        let choice = ChoiceOut {
            index: 0,
            delta,
            finish_reason: finish,
        };
        self.write(&[choice], None)
    }

    /// The chat chunks (or `[DONE]`) one event's data means; data that is no JSON passes as it
    /// came, for the stream's reader to find broken.
    fn event(&mut self, data: &str) -> Vec<String> {
        let Ok(e) = serde_json::from_str::<EventIn>(data) else {
            return vec![data.to_string()];
        };
        let index = lenient::<u64>(e.index) as usize;
        match str_of(e.kind).as_deref().unwrap_or_default() {
            "message_start" => {
                let m: MessageIn = lenient(e.message);
                self.id = m.id.map(RawValue::to_owned);
                self.model = m.model.map(RawValue::to_owned);
                self.usage = MessagesUsage::of(m.usage);
                let delta = DeltaOut {
                    role: Some("assistant"),
                    content: Some(Some("")),
                    tool_calls: None,
                };
                vec![self.chunk(delta, None)]
            }
            "content_block_start" => {
                let b: BlockIn = lenient(e.content_block);
                // An index beyond any real answer's is not a block to keep state for.
                if index > 4_096 {
                    return Vec::new();
                }
                if self.calls.len() <= index {
                    self.calls.resize(index + 1, None);
                }
                match str_of(b.kind).as_deref() {
                    Some("tool_use") => {
                        let n = self.ncalls;
                        self.ncalls += 1;
                        self.calls[index] = Some(n);
                        let name = str_of(b.name);
                        let call = CallOut {
                            index: n as u64,
                            id: Some(b.id),
                            kind: Some("function"),
                            function: FunctionOut {
                                name: Some(name.as_deref()),
                                arguments: Some(""),
                            },
                        };
                        let delta = DeltaOut {
                            tool_calls: Some(vec![call]),
                            ..DeltaOut::default()
                        };
                        vec![self.chunk(delta, None)]
                    }
                    Some("text") => match str_of(b.text).filter(|t| !t.is_empty()) {
                        Some(t) => {
                            let delta = DeltaOut {
                                content: Some(Some(&t)),
                                ..DeltaOut::default()
                            };
                            vec![self.chunk(delta, None)]
                        }
                        None => Vec::new(),
                    },
                    _ => Vec::new(),
                }
            }
            "content_block_delta" => {
                let d: EventDeltaIn = lenient(e.delta);
                match str_of(d.kind).as_deref() {
                    Some("text_delta") => {
                        let text = str_of(d.text);
                        let delta = DeltaOut {
                            content: Some(text.as_deref()),
                            ..DeltaOut::default()
                        };
                        vec![self.chunk(delta, None)]
                    }
                    Some("input_json_delta") => match self.calls.get(index).copied().flatten() {
                        Some(n) => {
                            let partial = str_of(d.partial_json);
                            let call = CallOut {
                                index: n as u64,
                                id: None,
                                kind: None,
                                function: FunctionOut {
                                    name: None,
                                    arguments: partial.as_deref(),
                                },
                            };
                            let delta = DeltaOut {
                                tool_calls: Some(vec![call]),
                                ..DeltaOut::default()
                            };
                            vec![self.chunk(delta, None)]
                        }
                        None => Vec::new(),
                    },
                    _ => Vec::new(),
                }
            }
            "message_delta" => {
                self.usage = self.usage.then(MessagesUsage::of(e.usage));
                let d: EventDeltaIn = lenient(e.delta);
                let finish = finish_of(str_of(d.stop_reason).as_deref());
                let usage = Some(ChatUsage::from(self.usage.counted()));
                vec![
                    self.chunk(DeltaOut::default(), Some(finish)),
                    self.write(&[], usage),
                ]
            }
            "message_stop" => vec!["[DONE]".into()],
            "error" => {
                #[derive(Serialize)]
                struct ErrorOut<'a> {
                    error: Option<&'a RawValue>,
                }
                let error = serde_json::to_string(&ErrorOut { error: e.error });
                vec![error.unwrap_or_default()]
            }
            // ping, content_block_stop, and events a later version adds.
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Chat request members as a node holds them: its sampling parameters, and the rest.
    fn extra(v: Value) -> (Sampling, Map<String, Value>) {
        let mut rest = v.as_object().cloned().unwrap_or_default();
        let sampling = serde_json::from_value(v).expect("sampling parameters");
        for k in [
            "temperature",
            "top_p",
            "stop",
            "user",
            "tool_choice",
            "parallel_tool_calls",
            "n",
            "logprobs",
        ] {
            rest.remove(k);
        }
        (sampling, rest)
    }

    /// Chat messages as the turns a node reads from them.
    fn turns(messages: &[Value]) -> Vec<Turn> {
        messages
            .iter()
            .map(|m| {
                let raw = serde_json::value::to_raw_value(m).unwrap();
                Turn::from_chat(&raw).expect("a turn")
            })
            .collect()
    }

    #[test]
    fn a_chat_request_becomes_the_messages_request_it_means() {
        let messages = vec![
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                "type": "function", "function": {"name": "look", "arguments": "{\"q\":\"x\"}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "a cat"}),
            json!({"role": "user", "content": "and?"}),
        ];
        let extra = extra(json!({"temperature": 0.5, "stop": "END", "user": "u1",
            "tool_choice": "required", "parallel_tool_calls": false}));
        let tools = serde_json::value::to_raw_value(&json!([{"type": "function", "function":
            {"name": "look", "description": "d", "parameters": {"type": "object"}}}]))
        .unwrap();
        let messages = turns(&messages);
        let (sampling, rest) = &extra;
        assert_eq!(not_carried(&messages, sampling, rest, None), None);
        let r = request_of(
            "claude",
            &messages,
            sampling,
            Some(&tools),
            64,
            true,
            Some("so far  "),
        );
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            json!({
                "model": "claude", "max_tokens": 64, "stream": true, "system": "be brief",
                "temperature": 0.5, "stop_sequences": ["END"], "metadata": {"user_id": "u1"},
                "tools": [{"name": "look", "description": "d", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "look", "input": {"q": "x"}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "a cat"},
                        {"type": "text", "text": "and?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "so far"}]},
                ],
            })
        );
    }

    /// A Messages request within what oam reads (the shapes a decode writes back alike: turns
    /// alternate, tool results first in a user turn, an assistant's one text before its calls).
    fn understood_request() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let word = "[a-zA-Z0-9 ,.!?\"\\\\]{1,12}";
        let image = prop_oneof![
            ("[a-z]{1,5}", "[A-Za-z0-9+/]{4,8}").prop_map(|(t, d)| json!({"type": "image",
                "source": {"type": "base64", "media_type": format!("image/{t}"), "data": d}})),
            "[a-z]{1,8}".prop_map(|h| json!({"type": "image",
                "source": {"type": "url", "url": format!("https://{h}.example/i.png")}})),
        ];
        let user = (
            proptest::collection::vec(("[a-z0-9_]{1,8}", word), 0..3),
            proptest::collection::vec(
                prop_oneof![word.prop_map(|t| json!({"type": "text", "text": t})), image],
                1..4,
            ),
        )
            .prop_map(|(results, parts)| {
                let mut blocks: Vec<Value> = results
                    .into_iter()
                    .map(|(id, text)| {
                        json!({"type": "tool_result", "tool_use_id": id, "content": text})
                    })
                    .collect();
                blocks.extend(parts);
                json!({"role": "user", "content": blocks})
            });
        let input = proptest::collection::btree_map("[a-z]{1,6}", word, 0..3);
        let assistant = (
            proptest::option::of(word),
            proptest::collection::vec(("[a-z0-9_]{1,8}", "[a-z_]{1,8}", input), 0..3),
        )
            .prop_filter("says something", |(t, calls)| {
                t.is_some() || !calls.is_empty()
            })
            .prop_map(|(text, calls)| {
                let mut blocks: Vec<Value> = text
                    .into_iter()
                    .map(|t| json!({"type": "text", "text": t}))
                    .collect();
                blocks.extend(calls.into_iter().map(|(id, name, input)| {
                    json!({"type": "tool_use", "id": id, "name": name, "input": input})
                }));
                json!({"role": "assistant", "content": blocks})
            });
        let turns = proptest::collection::vec((user, assistant), 1..4).prop_map(|pairs| {
            pairs
                .into_iter()
                .flat_map(|(u, a)| [u, a])
                .collect::<Vec<Value>>()
        });
        let tool = ("[a-z_]{1,8}", proptest::option::of(word)).prop_map(|(name, d)| {
            let mut t = json!({"name": name, "input_schema": {"type": "object",
                "properties": {"q": {"type": "string"}}}});
            if let Some(d) = d {
                t["description"] = json!(d);
            }
            t
        });
        let choice = prop_oneof![
            Just(json!({"type": "auto"})),
            Just(json!({"type": "any", "disable_parallel_tool_use": true})),
            Just(json!({"type": "none"})),
            "[a-z_]{1,8}".prop_map(|n| json!({"type": "tool", "name": n})),
        ];
        (
            turns,
            proptest::option::of(word),
            proptest::collection::vec(tool, 0..3),
            proptest::option::of(choice),
            proptest::option::of(proptest::collection::vec(word, 1..3)),
            proptest::option::of(0u8..=10),
            proptest::option::of("[a-z0-9]{1,8}"),
            1u32..5000,
        )
            .prop_map(
                |(messages, system, tools, choice, stop, temperature, user, max_tokens)| {
                    let mut r = json!({"model": "auto", "max_tokens": max_tokens,
                        "messages": messages});
                    if let Some(s) = system {
                        r["system"] = json!(s);
                    }
                    if !tools.is_empty() {
                        r["tools"] = json!(tools);
                    }
                    if let Some(c) = choice {
                        r["tool_choice"] = c;
                    }
                    if let Some(s) = stop {
                        r["stop_sequences"] = json!(s);
                    }
                    if let Some(t) = temperature {
                        r["temperature"] = json!(f64::from(t) / 10.0);
                    }
                    if let Some(u) = user {
                        r["metadata"] = json!({"user_id": u});
                    }
                    r
                },
            )
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Messages -> typed turns -> Messages keeps every field oam reads: what a Messages
        /// client sends a Messages target arrives as it meant it.
        #[test]
        fn a_messages_request_survives_the_typed_turns(sent in understood_request()) {
            let cfg = crate::node::config::NodeConfig::load(None, "http://127.0.0.1:1")
                .expect("a config");
            let h = axum::http::HeaderMap::new();
            let body = sent.to_string();
            let (request, _, pass) = crate::node::api::anthropic::decode_request(
                &cfg, body.as_bytes(), &h, || "r".into(),
            )
            .expect("decodes");
            proptest::prop_assert_eq!(
                not_carried(&pass.turns, &pass.sampling, &pass.extra, None),
                None
            );
            let max_tokens = request.max_tokens.expect("a limit");
            let again = request_of(
                "auto", &pass.turns, &pass.sampling, pass.tools.as_deref(), max_tokens, false, None,
            );
            let again = serde_json::to_value(&again).expect("writes");
            proptest::prop_assert_eq!(again, sent);
        }
    }

    #[test]
    fn a_request_served_as_it_came_keeps_its_members_as_written() {
        let sent = r#"{"model": "auto", "max_tokens": 9, "stream": true, "top_k": 5,
            "thinking": {"type": "enabled", "budget_tokens": 32}, "oam": {"agent": "a"},
            "messages": [{"role": "user", "content": "hi"}]}"#;
        let raw: Box<RawValue> = serde_json::from_str(sent).unwrap();
        let body = native_body(&raw, "claude-x", 64).expect("a body");
        let text = String::from_utf8(body).unwrap();
        assert!(
            text.contains(r#""thinking":{"type": "enabled", "budget_tokens": 32}"#),
            "as the client wrote it: {text}"
        );
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v,
            json!({"model": "claude-x", "max_tokens": 64, "top_k": 5,
                "thinking": {"type": "enabled", "budget_tokens": 32},
                "messages": [{"role": "user", "content": "hi"}]}),
            "oam's object and stream left out, the target's model and oam's limit in"
        );
    }

    #[test]
    fn what_messages_cannot_carry_is_named_as_the_client_wrote_it() {
        let user = vec![json!({"role": "user", "content": "hi"})];
        let user_turns = turns(&user);
        let none = Map::new();
        let cases = [
            (user.clone(), json!({"logprobs": true}), None, "logprobs"),
            (user.clone(), json!({"n": 2}), None, "n"),
            (
                user.clone(),
                json!({"temperature": 1.5}),
                None,
                "temperature",
            ),
            (user.clone(), json!({"seed": 7}), None, "seed"),
            (
                user.clone(),
                json!({}),
                Some(json!({"type": "json_object"})),
                "response_format",
            ),
            (
                vec![
                    json!({"role": "user", "content": "a"}),
                    json!({"role": "system", "content": "b"}),
                ],
                json!({}),
                None,
                "messages[1].role",
            ),
            (
                vec![json!({"role": "user", "name": "bob", "content": "a"})],
                json!({}),
                None,
                "messages[0].name",
            ),
            (
                vec![json!({"role": "user", "content": [{"type": "input_audio"}]})],
                json!({}),
                None,
                "messages[0].content[0]",
            ),
            (
                vec![
                    json!({"role": "assistant", "tool_calls": [{"type": "function",
                    "function": {"name": "f", "arguments": "{cut"}}]}),
                ],
                json!({}),
                None,
                "messages[0].tool_calls[0]",
            ),
        ];
        for (messages, e, format, want) in cases {
            let (sampling, rest) = extra(e.clone());
            let got = not_carried(&turns(&messages), &sampling, &rest, format.as_ref());
            assert_eq!(got.as_deref(), Some(want), "{e} {messages:?}");
        }
        let (sampling, rest) = extra(json!({"n": 1, "logprobs": false, "temperature": 1.0}));
        assert_eq!(
            not_carried(
                &user_turns,
                &sampling,
                &rest,
                Some(&json!({"type": "text"}))
            ),
            None
        );
        let none_sampled = Sampling::default();
        assert_eq!(not_carried(&user_turns, &none_sampled, &none, None), None);
    }

    #[test]
    fn a_messages_answer_reads_as_a_chat_completion_with_its_cache_usage() {
        let m = json!({"id": "msg_1", "type": "message", "model": "claude",
            "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "hi"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 10, "output_tokens": 5,
                "cache_read_input_tokens": 100, "cache_creation_input_tokens": 20}});
        let a = completion_of(&m.to_string(), 7, 3).expect("a message");
        let Some(Reply::Completion(bytes)) = &a.body else {
            panic!("a chat completion's bytes")
        };
        let c: Value = serde_json::from_slice(bytes).expect("JSON");
        let g = &a.generation;
        assert_eq!(
            (
                g.status,
                g.content.as_str(),
                g.finish_reason.as_deref(),
                g.latency_ms
            ),
            (GenerationStatus::Ok, "hi", Some("tool_calls"), 3)
        );
        assert_eq!(
            (
                g.tool_calls[0].name.as_str(),
                g.tool_calls[0].arguments.as_str()
            ),
            ("f", "{\"a\":1}")
        );
        assert_eq!(g.usage, Some(crate::node::exchange::usage_of(&c["usage"])));
        assert_eq!(
            (c["id"].as_str(), c["created"].as_u64()),
            (Some("msg_1"), Some(7))
        );
        assert_eq!(c["choices"][0]["message"]["content"], "hi");
        assert_eq!(
            c["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"a\":1}"
        );
        assert_eq!(c["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(
            c["usage"],
            json!({"prompt_tokens": 130, "completion_tokens": 5, "total_tokens": 135,
                "prompt_tokens_details": {"cached_tokens": 100}, "cache_creation_input_tokens": 20})
        );
        let u = crate::node::exchange::usage_of(&c["usage"]);
        assert_eq!(
            (u.prompt_tokens, u.cached_tokens, u.cache_write_tokens),
            (130, 100, 20)
        );
        let refused = json!({"id": "msg_2", "content": [{"type": "tool_use", "id": "t",
            "name": "f", "input": {}}], "stop_reason": "refusal"});
        let a = completion_of(&refused.to_string(), 7, 0).expect("a message");
        assert_eq!(a.generation.status, GenerationStatus::ContentPolicy);
        let Some(Reply::Completion(bytes)) = &a.body else {
            panic!("a chat completion's bytes")
        };
        let c: Value = serde_json::from_slice(bytes).expect("JSON");
        assert_eq!(
            (
                &c["choices"][0]["message"]["content"],
                &c["choices"][0]["finish_reason"]
            ),
            (&Value::Null, &json!("content_filter")),
            "only tool calls: no content"
        );
        assert!(completion_of("{cut", 7, 0).is_none(), "no JSON: no message");
    }

    #[test]
    fn an_event_stream_reads_as_chat_chunks_that_gather_to_the_answer() {
        let events = [
            json!({"type": "message_start", "message": {"id": "msg_1", "model": "claude",
                "usage": {"input_tokens": 10, "output_tokens": 1}}}),
            json!({"type": "ping"}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hel"}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t1", "name": "f", "input": {}}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"a\":"}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "1}"}}),
            json!({"type": "content_block_stop", "index": 1}),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}}),
            json!({"type": "message_stop"}),
        ];
        let mut c = Chunks::new(7);
        let out: Vec<String> = events
            .iter()
            .flat_map(|e| c.event(&e.to_string()))
            .collect();
        assert_eq!(out.last().map(String::as_str), Some("[DONE]"));
        let mut text = String::new();
        let mut args = String::new();
        let mut finish = None;
        let mut usage = None;
        for ch in &out[..out.len() - 1] {
            let d = crate::node::exchange::read_chunk(ch)
                .unwrap()
                .expect("a chunk");
            assert_eq!(d.head.id().as_deref(), Some("msg_1"));
            text.push_str(d.text.as_deref().unwrap_or_default());
            for t in &d.tool_calls {
                assert_eq!(t.index, 0);
                args.push_str(t.arguments.as_deref().unwrap_or_default());
            }
            finish = finish.or(d.finish.map(String::from));
            usage = usage.or(d.usage);
        }
        assert_eq!((text.as_str(), args.as_str()), ("hello", "{\"a\":1}"));
        assert_eq!(finish.as_deref(), Some("tool_calls"));
        let u = usage.unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (10, 9));
        // An error event is an error chunk; data that is no JSON passes as it came.
        let e =
            c.event(&json!({"type": "error", "error": {"type": "overloaded_error"}}).to_string());
        assert!(crate::node::exchange::read_chunk(&e[0]).is_err());
        assert_eq!(c.event("{\"type\": "), vec!["{\"type\": ".to_string()]);
    }
}
