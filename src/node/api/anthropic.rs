//! The Anthropic Messages surface (`POST /v1/messages`), a sibling of `openai`: a Messages
//! request is decoded into the typed turns and core request every upstream is written from
//! (`decode_request`), and the decided answer written as a Messages answer, a stream of
//! Anthropic's events (relayed live as the stream arrives: `Live`), or an error in Anthropic's
//! envelope. What only Messages carries (thinking blocks, documents, server tools, `top_k`) is
//! sent as it came to a Messages target, or refused with a 400 naming the field where there is
//! none; never dropped.

use super::{BadRequest, Decoded, Members, bad, body_members, is_null, member, passed_on, read};
use crate::core::request::Request;
use crate::node::api::openai::OamObject;
use crate::node::config::NodeConfig;
use crate::node::exchange::{Completion, Delta, Passthrough, read_completion};
use crate::node::model::{Content, Part, Sampling, Speaker, Stop, ToolCall, ToolChoice, Turn};
use crate::node::request::Answer;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

/// What only Messages carries (thinking, documents, server tools, `top_k`): refused where no
/// target speaks Messages; else left out of the chat translation (which the pipeline reads)
/// and noted, the request then served as it came by a Messages target.
struct MessagesOnly {
    allowed: bool,
    needed: bool,
}

impl MessagesOnly {
    fn met(&mut self, at: &str, what: &str) -> Result<(), BadRequest> {
        if !self.allowed {
            return Err(no_equivalent(at, what));
        }
        self.needed = true;
        Ok(())
    }
}

/// Why a member or block needs an Anthropic target.
fn no_equivalent(at: &str, what: &str) -> BadRequest {
    bad(
        at,
        format!(
            "{at}: {what} has no equivalent on this node's targets (they speak chat completions); \
             leave it out"
        ),
    )
}

/// A Messages request as the core request the pipeline reads (oam's fields from its `oam`
/// object, then the headers), whether the caller asked for a stream (relayed live as
/// Anthropic's events, or, under a contract, checked whole and then sent as them), and what
/// goes upstream. What only Messages carries (thinking, documents, server tools, `top_k`) is
/// refused where no target speaks Messages; else the request is bound to such targets and sent
/// to them as it came (`Passthrough::native`), the pipeline reading what chat can say of it.
pub(crate) fn decode_request(
    cfg: &NodeConfig,
    body: &[u8],
    h: &HeaderMap,
    new_id: impl FnOnce() -> String,
) -> Result<(Request, bool, Passthrough), BadRequest> {
    let mut only = MessagesOnly {
        allowed: cfg.speaks_anthropic(),
        needed: false,
    };
    let decoded = decode(body_members(body)?, &mut only, false)?;
    let (mut request, stream, mut pass) = decoded.into_request(cfg, h, new_id)?;
    if only.needed {
        request.bound_to = Some(crate::core::request::Api::Anthropic);
        pass.native = serde_json::from_slice(body).ok();
    }
    Ok((request, stream, pass))
}

/// A Messages request's members as the node serves them; `counting` (count_tokens) asks for no
/// `max_tokens`. Each member is read from its own text as what it must be: no tree of the
/// request is built.
fn decode(
    members: Members<'_>,
    only: &mut MessagesOnly,
    counting: bool,
) -> Result<Decoded, BadRequest> {
    let mut model = None;
    let mut max_tokens = None;
    let mut stream = false;
    let mut system = None;
    let mut said = None;
    let mut oam = None;
    let mut tools = None;
    let mut sampling = Sampling::default();
    for (k, raw) in members {
        match k.as_ref() {
            "thinking" | "top_k" if is_null(raw) => {}
            "thinking" => only.met("thinking", "extended thinking")?,
            "top_k" => only.met("top_k", "top_k sampling")?,
            "model" => {
                model = Some(
                    read::<String>(raw).ok_or_else(|| bad("model", "model must be a string"))?,
                );
            }
            "max_tokens" => {
                let n = read::<u64>(raw)
                    .filter(|n| *n >= 1)
                    .and_then(|n| u32::try_from(n).ok());
                max_tokens = Some(n.ok_or_else(|| {
                    bad(
                        "max_tokens",
                        "max_tokens must be a whole number of at least 1",
                    )
                })?);
            }
            "stream" => {
                stream = read::<Option<bool>>(raw)
                    .ok_or_else(|| bad("stream", "stream must be true or false"))?
                    .unwrap_or(false);
            }
            "system" => system = Some(text_blocks(raw, "system")?),
            "messages" => said = Some(raw),
            "temperature" | "top_p" => {
                let v = read::<Option<f64>>(raw)
                    .ok_or_else(|| bad(k.as_ref(), format!("{k} must be a number")))?;
                if k == "temperature" {
                    sampling.temperature = v;
                } else {
                    sampling.top_p = v;
                }
            }
            "stop_sequences" => {
                let stop = read::<Option<Vec<String>>>(raw).ok_or_else(|| {
                    bad(
                        "stop_sequences",
                        "stop_sequences must be an array of strings",
                    )
                })?;
                sampling.stop = stop.map(Stop::Many);
            }
            "metadata" => {
                #[derive(serde::Deserialize)]
                struct Metadata<'a> {
                    #[serde(borrow, default)]
                    user_id: Option<&'a RawValue>,
                }
                let user = read::<Metadata>(raw).and_then(|m| m.user_id);
                match user.filter(|u| !is_null(u)).map(read::<String>) {
                    None => {}
                    Some(Some(user)) => sampling.user = Some(user),
                    Some(None) => {
                        return Err(bad("metadata.user_id", "metadata.user_id must be a string"));
                    }
                }
            }
            "tools" => tools = Some(chat_tools(raw, only)?),
            "tool_choice" => {
                let (choice, parallel) = tool_choice(raw)?;
                sampling.tool_choice = Some(choice);
                if !parallel {
                    sampling.parallel_tool_calls = Some(false);
                }
            }
            "oam" => oam = Some(member(passed_on(raw, "oam")?, "oam")?),
            k => {
                return Err(bad(
                    k,
                    format!("{k}: not a Messages request field this node reads"),
                ));
            }
        }
    }
    let model = model.ok_or_else(|| bad("model", "model: Field required"))?;
    let max_tokens = match max_tokens {
        None if counting => 1,
        None => return Err(bad("max_tokens", "max_tokens: Field required")),
        Some(n) => n,
    };
    let mut turns = Vec::new();
    if let Some(system) = system {
        turns.push(Turn::text(Speaker::System, system));
    }
    let said = said
        .and_then(read::<Vec<&RawValue>>)
        .ok_or_else(|| bad("messages", "messages must be an array of {role, content}"))?;
    if said.is_empty() {
        return Err(bad("messages", "messages must hold at least one message"));
    }
    for (i, turn) in said.into_iter().enumerate() {
        decode_turn(turn, i, &mut turns, only)?;
    }
    Ok(Decoded {
        model: Some(model),
        turns,
        sampling,
        max_tokens: Some(max_tokens),
        response_format: None,
        stream,
        include_usage: false,
        oam,
        tools,
        extra: Map::new(),
    })
}

/// `POST /v1/messages/count_tokens`: the prompt tokens a Messages request (without
/// `max_tokens`) will be billed for, as the engine estimates them to price its reservations:
/// the same translation, so what cannot be served cannot be counted either.
pub(crate) fn count_tokens(
    cfg: &crate::node::config::NodeConfig,
    body: &[u8],
    h: &HeaderMap,
) -> Result<u64, BadRequest> {
    let mut only = MessagesOnly {
        allowed: cfg.speaks_anthropic(),
        needed: false,
    };
    let decoded = decode(body_members(body)?, &mut only, true)?;
    let (request, _, _) = decoded.into_request(cfg, h, String::new)?;
    Ok(crate::core::pipeline::estimate_prompt_tokens(&request))
}

/// A string, or text blocks (`[{type: "text", text}]`), as one text.
fn text_blocks(raw: &RawValue, at: &str) -> Result<String, BadRequest> {
    if let Some(text) = read::<String>(raw) {
        return Ok(text);
    }
    #[derive(serde::Deserialize)]
    struct TextBlock {
        #[serde(rename = "type")]
        kind: String,
        text: String,
    }
    let blocks = read::<Vec<&RawValue>>(raw).ok_or_else(|| {
        bad(
            at,
            format!("{at} must be a string or an array of text blocks"),
        )
    })?;
    let mut text = Vec::with_capacity(blocks.len());
    for (j, b) in blocks.into_iter().enumerate() {
        match read::<TextBlock>(b) {
            Some(b) if b.kind == "text" => text.push(b.text),
            _ => {
                return Err(bad(
                    format!("{at}[{j}]"),
                    format!("{at}[{j}] must be a text block {{\"type\": \"text\", \"text\": ...}}"),
                ));
            }
        }
    }
    Ok(text.join("\n"))
}

/// One Messages turn as the turns it means: a user turn's tool results become tool turns
/// (first, as chat wants them right after the call), its other blocks one user turn; an
/// assistant turn's `tool_use` blocks become its tool calls.
fn decode_turn(
    raw: &RawValue,
    i: usize,
    out: &mut Vec<Turn>,
    only: &mut MessagesOnly,
) -> Result<(), BadRequest> {
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct TurnIn<'a> {
        role: Option<String>,
        #[serde(borrow)]
        content: Option<&'a RawValue>,
    }
    let at = format!("messages[{i}]");
    let turn = read::<TurnIn>(raw).unwrap_or_default();
    let role = match turn.role.as_deref() {
        Some("user") => Speaker::User,
        Some("assistant") => Speaker::Assistant,
        _ => {
            return Err(bad(
                format!("{at}.role"),
                format!("{at}.role must be \"user\" or \"assistant\""),
            ));
        }
    };
    let content = turn.content;
    if let Some(text) = content.and_then(read::<String>) {
        out.push(Turn::text(role, text));
        return Ok(());
    }
    let Some(blocks) = content.and_then(read::<Vec<&RawValue>>) else {
        return Err(bad(
            format!("{at}.content"),
            format!("{at}.content must be a string or an array of content blocks"),
        ));
    };
    /// A content block's members oam reads (each as its text).
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct BlockIn<'a> {
        #[serde(rename = "type")]
        kind: Option<String>,
        #[serde(borrow)]
        text: Option<&'a RawValue>,
        #[serde(borrow)]
        source: Option<&'a RawValue>,
        #[serde(borrow)]
        tool_use_id: Option<&'a RawValue>,
        #[serde(borrow)]
        content: Option<&'a RawValue>,
        #[serde(borrow)]
        is_error: Option<&'a RawValue>,
        #[serde(borrow)]
        id: Option<&'a RawValue>,
        #[serde(borrow)]
        name: Option<&'a RawValue>,
        #[serde(borrow)]
        input: Option<&'a RawValue>,
    }
    let user = role == Speaker::User;
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    for (j, raw) in blocks.into_iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        let b = read::<BlockIn>(raw).unwrap_or_default();
        let kind = b.kind.as_deref().unwrap_or_default();
        let string = |v: Option<&RawValue>| v.and_then(read::<String>);
        match (user, kind) {
            (_, "text") => {
                let text = string(b.text).ok_or_else(|| {
                    bad(format!("{at}.text"), format!("{at}.text must be a string"))
                })?;
                parts.push(Part::Text(text));
            }
            (true, "image") => parts.push(image_part(b.source, &at)?),
            (true, "tool_result") => {
                let id = string(b.tool_use_id).ok_or_else(|| {
                    bad(
                        format!("{at}.tool_use_id"),
                        format!("{at}.tool_use_id must be a string"),
                    )
                })?;
                let content = match b.content.filter(|c| !is_null(c)) {
                    None => String::new(),
                    Some(c) => text_blocks(c, &format!("{at}.content"))?,
                };
                let content = if b.is_error.is_some_and(|e| e.get() == "true") {
                    format!("error: {content}")
                } else {
                    content
                };
                let mut result = Turn::text(Speaker::Tool, content);
                result.answers = Some(id);
                out.push(result);
            }
            (false, "tool_use") => {
                let (Some(id), Some(name)) = (string(b.id), string(b.name)) else {
                    return Err(bad(
                        at.clone(),
                        format!("{at}: a tool_use block needs an id and a name"),
                    ));
                };
                // The input as the client wrote it (a JSON object: the arguments' text).
                let arguments = b.input.filter(|i| !is_null(i)).map_or("{}", |i| i.get());
                calls.push(ToolCall {
                    id,
                    name,
                    arguments: arguments.to_string(),
                });
            }
            (_, "thinking" | "redacted_thinking") => only.met(&at, "a thinking block")?,
            (
                _,
                "document"
                | "search_result"
                | "server_tool_use"
                | "web_search_tool_result"
                | "container_upload",
            ) => only.met(&at, &format!("a {kind} block"))?,
            _ => {
                return Err(bad(
                    format!("{at}.type"),
                    format!(
                        "{at}.type: {kind:?} is not a block a {} turn may hold",
                        role.as_str()
                    ),
                ));
            }
        }
    }
    if !user {
        let text: Vec<&str> = parts
            .iter()
            .filter_map(|p| match p {
                Part::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        let mut said = Turn::text(Speaker::Assistant, text.join(""));
        said.calls = calls;
        out.push(said);
    } else if !parts.is_empty() {
        let mut said = Turn::text(Speaker::User, "");
        said.content = Content::Parts(parts);
        out.push(said);
    }
    Ok(())
}

/// An image block's source as an image part.
fn image_part(source: Option<&RawValue>, at: &str) -> Result<Part, BadRequest> {
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct Source {
        #[serde(rename = "type")]
        kind: Option<String>,
        media_type: Option<String>,
        data: Option<String>,
        url: Option<String>,
    }
    let s = source.and_then(read::<Source>).unwrap_or_default();
    let url = match s.kind.as_deref() {
        Some("base64") => match (s.media_type, s.data) {
            (Some(t), Some(d)) => format!("data:{t};base64,{d}"),
            _ => {
                return Err(bad(
                    format!("{at}.source"),
                    format!("{at}.source: a base64 image needs media_type and data"),
                ));
            }
        },
        Some("url") => s.url.ok_or_else(|| {
            bad(
                format!("{at}.source.url"),
                format!("{at}.source.url must be a string"),
            )
        })?,
        _ => {
            return Err(bad(
                format!("{at}.source.type"),
                format!("{at}.source.type must be \"base64\" or \"url\""),
            ));
        }
    };
    Ok(Part::Image { url, detail: None })
}

/// Messages tools (`[{name, description, input_schema}]`) as a chat tool list (the schemas as
/// the client wrote them).
fn chat_tools(raw: &RawValue, only: &mut MessagesOnly) -> Result<Box<RawValue>, BadRequest> {
    #[derive(serde::Deserialize)]
    struct ToolIn<'a> {
        #[serde(rename = "type", default)]
        kind: Option<String>,
        #[serde(borrow, default)]
        name: Option<&'a RawValue>,
        #[serde(borrow, default)]
        description: Option<&'a RawValue>,
        #[serde(borrow, default)]
        input_schema: Option<&'a RawValue>,
    }
    #[derive(serde::Serialize)]
    struct Function<'a> {
        name: &'a RawValue,
        parameters: &'a RawValue,
        #[serde(skip_serializing_if = "Option::is_none")]
        description: Option<&'a RawValue>,
    }
    #[derive(serde::Serialize)]
    struct ChatTool<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        function: Function<'a>,
    }
    let list = read::<Vec<&RawValue>>(raw).ok_or_else(|| {
        bad(
            "tools",
            "tools must be an array of {name, description, input_schema}",
        )
    })?;
    let object: &RawValue =
        serde_json::from_str(r#"{"type":"object"}"#).map_err(|e| bad("tools", e.to_string()))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        let at = format!("tools[{i}]");
        let t = read::<ToolIn>(t).ok_or_else(|| {
            bad(
                at.clone(),
                format!("{at} must be {{name, description, input_schema}}"),
            )
        })?;
        if let Some(kind) = t.kind.filter(|k| k != "custom") {
            only.met(&at, &format!("the server tool {kind:?}"))?;
            continue;
        }
        let Some(name) = t.name.filter(|n| read::<String>(n).is_some()) else {
            return Err(bad(
                format!("{at}.name"),
                format!("{at}.name must be a string"),
            ));
        };
        out.push(ChatTool {
            kind: "function",
            function: Function {
                name,
                parameters: t.input_schema.unwrap_or(object),
                description: t.description,
            },
        });
    }
    serde_json::value::to_raw_value(&out).map_err(|e| bad("tools", e.to_string()))
}

/// `tool_choice` as chat's, and whether parallel tool calls stay allowed.
fn tool_choice(raw: &RawValue) -> Result<(ToolChoice, bool), BadRequest> {
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct ChoiceIn {
        #[serde(rename = "type")]
        kind: Option<String>,
        name: Option<String>,
        disable_parallel_tool_use: Option<bool>,
    }
    let c = read::<ChoiceIn>(raw).unwrap_or_default();
    let parallel = c.disable_parallel_tool_use != Some(true);
    let choice = match c.kind.as_deref() {
        Some("auto") => ToolChoice::Mode("auto".into()),
        Some("any") => ToolChoice::Mode("required".into()),
        Some("none") => ToolChoice::Mode("none".into()),
        Some("tool") => match c.name {
            Some(name) => ToolChoice::Function(name),
            None => return Err(bad("tool_choice.name", "tool_choice.name must name a tool")),
        },
        _ => {
            return Err(bad(
                "tool_choice.type",
                "tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\"",
            ));
        }
    };
    Ok((choice, parallel))
}

/// The request's headers as the chat stages read them: Anthropic clients send their key in
/// `x-api-key`, which authenticates like `Authorization: Bearer`.
pub(crate) fn chat_headers(h: &HeaderMap) -> HeaderMap {
    let mut h = h.clone();
    if !h.contains_key("authorization")
        && let Some(key) = h.get("x-api-key").and_then(|k| k.to_str().ok())
        && let Ok(v) = HeaderValue::from_str(&format!("Bearer {key}"))
    {
        h.insert("authorization", v);
    }
    h
}

/// A chat completion (what the pipeline accepted) as a Messages answer, the `oam` object kept.
pub(crate) fn message_of<'a>(chat: &'a Completion<'a>) -> MessageOut<'a> {
    let mut content = Vec::with_capacity(1 + chat.calls.len());
    if let Some(text) = chat.text.as_deref().filter(|t| !t.is_empty()) {
        content.push(BlockOut::Text { text });
    }
    for call in &chat.calls {
        content.push(BlockOut::ToolUse {
            id: call.id,
            name: call.name.as_deref(),
            // Arguments that are no JSON: none.
            input: ObjectOr(
                call.arguments
                    .as_deref()
                    .and_then(|a| serde_json::from_str::<&RawValue>(a).ok()),
            ),
        });
    }
    MessageOut {
        id: message_id(chat.head.id().as_deref()),
        kind: "message",
        role: "assistant",
        model: chat.head.model,
        content,
        stop_reason: stop_reason_of(chat.finish.as_deref()),
        stop_sequence: (),
        usage: MessagesUsage::from(chat.usage.unwrap_or_default()),
        oam: chat.oam,
    }
}

/// A Messages answer as oam writes one.
#[derive(serde::Serialize)]
pub(crate) struct MessageOut<'a> {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: Option<&'a RawValue>,
    content: Vec<BlockOut<'a>>,
    stop_reason: &'static str,
    stop_sequence: (),
    usage: MessagesUsage,
    oam: Option<&'a RawValue>,
}

#[derive(serde::Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum BlockOut<'a> {
    Text {
        text: &'a str,
    },
    ToolUse {
        id: Option<&'a RawValue>,
        name: Option<&'a str>,
        input: ObjectOr<'a>,
    },
}

/// JSON text as it came, or `{}` where there is none.
struct ObjectOr<'a>(Option<&'a RawValue>);

impl serde::Serialize for ObjectOr<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match self.0 {
            Some(raw) => raw.serialize(s),
            None => s.serialize_map(Some(0))?.end(),
        }
    }
}

/// Usage as Messages reports it: `input_tokens` without those read from or written to the
/// cache, which are counted apart (when there are any).
#[derive(serde::Serialize)]
pub(crate) struct MessagesUsage {
    input_tokens: u64,
    output_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_read_input_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_creation_input_tokens: Option<u64>,
}

impl From<crate::core::request::Usage> for MessagesUsage {
    fn from(u: crate::core::request::Usage) -> MessagesUsage {
        let read = u.cached_tokens.min(u.prompt_tokens);
        let written = u.cache_write_tokens.min(u.prompt_tokens - read);
        MessagesUsage {
            input_tokens: u.prompt_tokens - read - written,
            output_tokens: u.completion_tokens,
            cache_read_input_tokens: (read > 0).then_some(read),
            cache_creation_input_tokens: (written > 0).then_some(written),
        }
    }
}

/// A Messages id for a chat completion's (kept as it is when a Messages upstream made it).
fn message_id(chat_id: Option<&str>) -> String {
    let id = chat_id.unwrap_or_default();
    if id.starts_with("msg_") {
        return id.to_string();
    }
    format!("msg_{}", id.strip_prefix("chatcmpl-").unwrap_or(id))
}

/// Anthropic's `stop_reason` for a chat `finish_reason`.
fn stop_reason_of(finish: Option<&str>) -> &'static str {
    match finish {
        Some("length") => "max_tokens",
        Some("tool_calls" | "function_call") => "tool_use",
        Some("content_filter") => "refusal",
        _ => "end_turn",
    }
}

/// An event of Anthropic's stream, as a live relay writes it.
#[derive(serde::Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum StreamEvent<'a> {
    MessageStart {
        message: EmptyMessage<'a>,
    },
    Ping,
    ContentBlockStart {
        index: usize,
        content_block: BlockOut<'a>,
    },
    ContentBlockDelta {
        index: usize,
        delta: BlockDelta<'a>,
    },
    ContentBlockStop {
        index: usize,
    },
    MessageDelta {
        delta: StopDelta,
        usage: MessagesUsage,
        #[serde(skip_serializing_if = "Option::is_none")]
        oam: Option<OamObject<'a>>,
    },
    MessageStop,
    Error {
        error: ApiError<'a>,
        oam: OamObject<'a>,
    },
}

impl StreamEvent<'_> {
    fn name(&self) -> &'static str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::Ping => "ping",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop => "message_stop",
            StreamEvent::Error { .. } => "error",
        }
    }

    /// Written as one server-sent event onto `out`.
    fn write(&self, out: &mut String) {
        let data = serde_json::to_string(self).unwrap_or_default();
        out.push_str(&format!("event: {}\ndata: {data}\n\n", self.name()));
    }
}

/// The message a stream starts, empty.
#[derive(serde::Serialize)]
struct EmptyMessage<'a> {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: Option<&'a RawValue>,
    content: [(); 0],
    stop_reason: Option<&'static str>,
    stop_sequence: Option<&'static str>,
    usage: MessagesUsage,
}

#[derive(serde::Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum BlockDelta<'a> {
    TextDelta { text: &'a str },
    InputJsonDelta { partial_json: &'a str },
}

#[derive(serde::Serialize)]
struct StopDelta {
    stop_reason: &'static str,
    stop_sequence: Option<&'static str>,
}

#[derive(serde::Serialize)]
struct ApiError<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    message: &'a str,
}

/// A chat stream relayed live as Anthropic's events: what has been written so far (the
/// message started, the block open now), so each chunk becomes the events it means as it
/// arrives, across a continuation on another target too.
#[derive(Default)]
pub(crate) struct Live {
    started: bool,
    /// The open block: text (`None`) or the tool call at this chat index (`Some`), and its
    /// block index.
    open: Option<(Option<u64>, usize)>,
    blocks: usize,
    stop_reason: Option<&'static str>,
    usage: crate::core::request::Usage,
}

impl Live {
    /// The events one chat chunk (`delta`) means.
    pub(crate) fn chunk(&mut self, delta: &Delta) -> String {
        let mut out = String::new();
        if !self.started {
            self.started = true;
            let message = EmptyMessage {
                id: message_id(delta.head.id().as_deref()),
                kind: "message",
                role: "assistant",
                model: delta.head.model,
                content: [],
                stop_reason: None,
                stop_sequence: None,
                usage: MessagesUsage::from(crate::core::request::Usage::default()),
            };
            StreamEvent::MessageStart { message }.write(&mut out);
            StreamEvent::Ping.write(&mut out);
        }
        if let Some(text) = delta.text.as_deref().filter(|t| !t.is_empty()) {
            let index = self.open_block(&mut out, None, || BlockOut::Text { text: "" });
            let delta = BlockDelta::TextDelta { text };
            StreamEvent::ContentBlockDelta { index, delta }.write(&mut out);
        }
        for t in &delta.tool_calls {
            let index = self.open_block(&mut out, Some(t.index), || BlockOut::ToolUse {
                id: t.id,
                name: t.name.as_deref(),
                input: ObjectOr(None),
            });
            if let Some(args) = t.arguments.as_deref().filter(|a| !a.is_empty()) {
                let delta = BlockDelta::InputJsonDelta { partial_json: args };
                StreamEvent::ContentBlockDelta { index, delta }.write(&mut out);
            }
        }
        if let Some(f) = &delta.finish {
            self.stop_reason = Some(stop_reason_of(Some(f)));
        }
        if let Some(u) = delta.usage {
            self.usage = u;
        }
        out
    }

    /// The index of the block `kind` names, opened now (closing the one before) unless open.
    fn open_block<'b>(
        &mut self,
        out: &mut String,
        kind: Option<u64>,
        start: impl FnOnce() -> BlockOut<'b>,
    ) -> usize {
        if let Some((open, index)) = self.open
            && open == kind
        {
            return index;
        }
        self.close_block(out);
        let index = self.blocks;
        self.blocks += 1;
        self.open = Some((kind, index));
        let content_block = start();
        StreamEvent::ContentBlockStart {
            index,
            content_block,
        }
        .write(out);
        index
    }

    fn close_block(&mut self, out: &mut String) {
        if let Some((_, index)) = self.open.take() {
            StreamEvent::ContentBlockStop { index }.write(out);
        }
    }

    /// The events that end the stream once `d` is decided: the open block closed,
    /// `message_delta` (stop reason, output tokens, the `oam` object) and `message_stop` for an
    /// accepted answer; else Anthropic's in-band `error` event, and no `message_stop`.
    pub(crate) fn end(&mut self, d: &crate::core::pipeline::Decision) -> String {
        let mut out = String::new();
        let oam = OamObject::of(d);
        if d.outcome == crate::core::pipeline::DecisionOutcome::Accepted {
            out = self.finish(Some(oam));
        } else {
            let reasons: Vec<&str> = d.reason_codes.iter().map(|c| c.as_str()).collect();
            let message = format!(
                "oam ended the stream in phase {}: {}",
                d.phase,
                reasons.join(", ")
            );
            let error = ApiError {
                kind: "api_error",
                message: &message,
            };
            StreamEvent::Error { error, oam }.write(&mut out);
        }
        out
    }

    /// The events that end a complete stream: the open block closed, `message_delta` (stop
    /// reason, usage, the `oam` object if given) and `message_stop`.
    fn finish(&mut self, oam: Option<OamObject<'_>>) -> String {
        let mut out = String::new();
        self.close_block(&mut out);
        let delta = StopDelta {
            stop_reason: self.stop_reason.unwrap_or("end_turn"),
            stop_sequence: None,
        };
        let usage = MessagesUsage::from(self.usage);
        StreamEvent::MessageDelta { delta, usage, oam }.write(&mut out);
        StreamEvent::MessageStop.write(&mut out);
        out
    }
}

/// A whole Messages answer as Anthropic's event stream: `message_start`, each block's start,
/// delta and stop, `message_delta` (stop reason, output tokens), `message_stop`.
pub(crate) fn events_of(message: &Value) -> String {
    let mut out = String::new();
    let mut event = |name: &str, data: Value| {
        out.push_str(&format!("event: {name}\ndata: {data}\n\n"));
    };
    let mut start = message.clone();
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    start["usage"]["output_tokens"] = json!(0);
    if let Some(o) = start.as_object_mut() {
        o.remove("oam");
    }
    event(
        "message_start",
        json!({"type": "message_start", "message": start}),
    );
    event("ping", json!({"type": "ping"}));
    for (i, block) in message["content"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        // Each block starts empty and comes in one delta (two for thinking: its text, then its
        // signature); a block of another kind (a server tool's result) starts whole.
        let (empty, deltas) = match block["type"].as_str() {
            Some("tool_use") => {
                let mut empty = block.clone();
                empty["input"] = json!({});
                let d =
                    json!({"type": "input_json_delta", "partial_json": block["input"].to_string()});
                (empty, vec![d])
            }
            Some("text") => (
                json!({"type": "text", "text": ""}),
                vec![json!({"type": "text_delta", "text": block["text"]})],
            ),
            Some("thinking") => (
                json!({"type": "thinking", "thinking": "", "signature": ""}),
                vec![
                    json!({"type": "thinking_delta", "thinking": block["thinking"]}),
                    json!({"type": "signature_delta", "signature": block["signature"]}),
                ],
            ),
            _ => (block.clone(), Vec::new()),
        };
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": i, "content_block": empty}),
        );
        for delta in deltas {
            event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i, "delta": delta}),
            );
        }
        event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": i}),
        );
    }
    event(
        "message_delta",
        json!({"type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": null},
            "usage": message["usage"],
            "oam": message["oam"]}),
    );
    event("message_stop", json!({"type": "message_stop"}));
    out
}

/// The model list (OpenAI's entries) as Anthropic's clients read it: one page.
pub(crate) fn models_of(entries: &[Value]) -> Value {
    let data: Vec<Value> = entries
        .iter()
        .map(|e| {
            json!({"type": "model", "id": e["id"], "display_name": e["id"],
                "created_at": "1970-01-01T00:00:00Z", "oam": e["oam"]})
        })
        .collect();
    json!({
        "data": data,
        "has_more": false,
        "first_id": data.first().map(|d| d["id"].clone()),
        "last_id": data.last().map(|d| d["id"].clone()),
    })
}

/// Anthropic's error type for an HTTP status.
pub(crate) fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// The answer to a Messages request: the body (a message, or an error in Anthropic's envelope:
/// `{"type": "error", "error": {type, message}}` with the `oam` object) and whether it is the
/// event stream the caller asked for.
pub(crate) fn answer_of(a: &Answer, stream: bool) -> (String, bool) {
    let text = String::from_utf8_lossy(&a.body);
    if a.status == StatusCode::OK {
        #[derive(serde::Deserialize)]
        struct Kind<'a> {
            #[serde(rename = "type", borrow, default)]
            kind: Option<&'a RawValue>,
        }
        // Only a request sent as it came can have the target's own message for an answer:
        // any other body is a chat completion, read once below.
        let kind = a
            .native
            .then(|| serde_json::from_str::<Kind>(&text).ok())
            .flatten()
            .and_then(|k| k.kind);
        // A Messages target's own answer (a request served as it came) is kept as it is.
        if kind.map(RawValue::get) == Some(r#""message""#) {
            return if stream {
                (
                    events_of(&serde_json::from_str(&text).unwrap_or_default()),
                    true,
                )
            } else {
                (text.into_owned(), false)
            };
        }
        let chat = read_completion(&text).unwrap_or_default();
        let message = message_of(&chat);
        return if stream {
            // Checked whole, then sent as the events of its stream.
            let tree = serde_json::to_value(&message).unwrap_or_default();
            (events_of(&tree), true)
        } else {
            (serde_json::to_string(&message).unwrap_or_default(), false)
        };
    }
    let v: Value = serde_json::from_str(&text).unwrap_or_default();
    let e = &v["error"];
    let mut message = e["message"]
        .as_str()
        .unwrap_or("oam refused the request")
        .to_string();
    if let Some(param) = e["param"].as_str()
        && !message.contains(param)
    {
        message = format!("{param}: {message}");
    }
    let mut body =
        json!({"type": "error", "error": {"type": error_type(a.status), "message": message}});
    if !v["oam"].is_null() {
        body["oam"] = v["oam"].clone();
    }
    (body.to_string(), false)
}

/// Anthropic's Messages.
pub(crate) struct Messages;

impl super::ClientApi for Messages {
    fn headers(&self, h: HeaderMap) -> HeaderMap {
        chat_headers(&h)
    }

    fn decode_request(
        &self,
        cfg: &NodeConfig,
        body: &[u8],
        h: &HeaderMap,
        new_id: &dyn Fn() -> String,
    ) -> Result<(Request, bool, Passthrough), BadRequest> {
        decode_request(cfg, body, h, new_id)
    }

    fn answer_of(&self, a: &Answer, stream: bool) -> (bytes::Bytes, bool) {
        let (text, events) = answer_of(a, stream);
        (text.into(), events)
    }

    fn relay(&self, _pass: &Passthrough) -> Box<dyn super::Relayed> {
        Box::new(Live::default())
    }
}

impl super::Relayed for Live {
    fn chunk(&mut self, _data: &str, delta: &Delta) -> String {
        Live::chunk(self, delta)
    }

    fn end(&mut self, d: &crate::core::pipeline::Decision) -> String {
        Live::end(self, d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Messages answer a chat completion means.
    fn message(chat: Value) -> Value {
        let text = chat.to_string();
        let chat = read_completion(&text).expect("a completion");
        serde_json::to_value(message_of(&chat)).expect("JSON")
    }
    use crate::node::api::as_chat;

    /// A node's configuration; with a Messages target when `messages`.
    fn cfg(messages: bool) -> NodeConfig {
        let mut cfg = NodeConfig::load(None, "http://127.0.0.1:1").expect("a config");
        if messages {
            cfg.targets[0].api = crate::core::request::Api::Anthropic;
        }
        cfg
    }

    fn decoded(body: &Value, messages: bool) -> Result<(Request, bool, Passthrough), BadRequest> {
        decode_request(
            &cfg(messages),
            body.to_string().as_bytes(),
            &HeaderMap::new(),
            || "r".into(),
        )
    }

    /// What a chat target is sent of a Messages request (a node with chat targets only), and
    /// the core request.
    fn chat(body: Value) -> Result<(Value, bool, Request), BadRequest> {
        let (request, stream, pass) = decoded(&body, false)?;
        Ok((as_chat(&request, &pass), stream, request))
    }

    fn refused(body: Value) -> BadRequest {
        match chat(body) {
            Err(e) => e,
            Ok((c, _, _)) => panic!("translated: {c}"),
        }
    }

    #[test]
    fn a_messages_request_becomes_the_chat_request_it_means() {
        let (c, stream, request) = chat(json!({
            "model": "auto", "max_tokens": 64, "stream": true,
            "system": [{"type": "text", "text": "be brief"}],
            "stop_sequences": ["END"], "temperature": 0.2, "metadata": {"user_id": "u1"},
            "tools": [{"name": "get_weather", "description": "d",
                       "input_schema": {"type": "object", "required": ["city"]}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "oam": {"agent": "claude"},
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "Weather?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21C"}]},
                    {"type": "text", "text": "And tomorrow?"}]}
            ]
        }))
        .expect("translated");
        assert!(stream && request.stream, "asked for a stream");
        let m = &c["messages"];
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(
            m[1]["content"][1]["image_url"]["url"],
            "data:image/png;base64,iVBOR"
        );
        assert_eq!(m[2]["content"], "Checking.");
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            "{\"city\":\"Paris\"}"
        );
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "21C"})
        );
        assert_eq!(m[4]["content"][0]["text"], "And tomorrow?");
        assert_eq!(m.as_array().map(Vec::len), Some(5));
        assert_eq!(
            (&c["stop"], &c["user"], &c["max_tokens"]),
            (&json!(["END"]), &json!("u1"), &json!(64))
        );
        assert_eq!(
            c["tools"][0]["function"]["parameters"]["required"],
            json!(["city"])
        );
        assert_eq!(
            (&c["tool_choice"], &c["parallel_tool_calls"]),
            (&json!("required"), &json!(false))
        );
        assert_eq!(request.agent, "claude", "oam's fields are read");
    }

    #[test]
    fn what_a_chat_target_cannot_carry_is_refused_by_name() {
        let m = json!([{"role": "user", "content": "hi"}]);
        for (body, param) in [
            (json!({"model": "auto", "messages": m}), "max_tokens"),
            (json!({"max_tokens": 5, "messages": m}), "model"),
            (
                json!({"model": "auto", "max_tokens": 0, "messages": m}),
                "max_tokens",
            ),
            (
                json!({"model": "auto", "max_tokens": 5, "messages": m, "thinking": {"type": "enabled"}}),
                "thinking",
            ),
            (
                json!({"model": "auto", "max_tokens": 5, "messages": m, "top_k": 5}),
                "top_k",
            ),
            (
                json!({"model": "auto", "max_tokens": 5, "messages": m, "n": 2}),
                "n",
            ),
            (
                json!({"model": "auto", "max_tokens": 5, "messages": []}),
                "messages",
            ),
            (
                json!({"model": "auto", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"model": "auto", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"model": "auto", "max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]}]}),
                "messages[0].content[0]",
            ),
            (
                json!({"model": "auto", "max_tokens": 5, "messages": m, "tools": [{"type": "web_search_20250305", "name": "web"}]}),
                "tools[0]",
            ),
            (
                json!({"model": "auto", "max_tokens": 5, "messages": m, "tool_choice": {"type": "maybe"}}),
                "tool_choice.type",
            ),
        ] {
            let e = refused(body.clone());
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert!(e.message.contains(param), "{}", e.message);
        }
        assert_eq!(refused(json!([1])).param.as_deref(), Some("body"));
    }

    #[test]
    fn with_messages_targets_what_only_messages_carries_is_kept_as_it_came() {
        let body = json!({"model": "auto", "max_tokens": 64, "top_k": 5,
            "thinking": {"type": "enabled", "budget_tokens": 32},
            "tools": [{"type": "web_search_20250305", "name": "web"}],
            "messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "hello"}]},
                {"role": "user", "content": "again"}]});
        let (request, _, pass) = decoded(&body, true).unwrap();
        let native = pass.native.as_ref().map(|n| n.get());
        assert_eq!(native, Some(body.to_string().as_str()), "served as it came");
        assert_eq!(request.bound_to, Some(crate::core::request::Api::Anthropic));
        let chat = as_chat(&request, &pass);
        assert_eq!(
            chat["messages"][1],
            json!({"role": "assistant", "content": "hello"}),
            "the pipeline reads what chat can say of it"
        );
        assert!(chat.get("top_k").is_none() && chat.get("thinking").is_none());
        assert_eq!(chat["tools"], json!([]));
        let plain = json!({"model": "auto", "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}]});
        let (request, _, pass) = decoded(&plain, true).unwrap();
        assert!(
            pass.native.is_none() && request.bound_to.is_none(),
            "a request chat carries is translated as before"
        );
        assert!(
            decoded(&body, false).is_err(),
            "refused where no target speaks Messages"
        );
    }

    fn completion(finish: &str) -> Value {
        json!({
            "id": "chatcmpl-abc", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": finish, "message": {
                "role": "assistant", "content": "Looking.",
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 6}},
            "oam": {"request_id": "r1", "target": "primary/m"}
        })
    }

    #[test]
    fn a_chat_answer_reads_as_a_message_with_its_blocks_stop_reason_and_usage() {
        let m = message(completion("tool_calls"));
        assert_eq!(
            (&m["id"], &m["type"], &m["role"]),
            (&json!("msg_abc"), &json!("message"), &json!("assistant"))
        );
        assert_eq!(m["content"][0], json!({"type": "text", "text": "Looking."}));
        assert_eq!(
            m["content"][1],
            json!({"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}})
        );
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(
            m["usage"],
            json!({"input_tokens": 4, "output_tokens": 4, "cache_read_input_tokens": 6})
        );
        assert_eq!(m["oam"]["target"], "primary/m");
        for (finish, reason) in [
            ("stop", "end_turn"),
            ("length", "max_tokens"),
            ("content_filter", "refusal"),
        ] {
            assert_eq!(message(completion(finish))["stop_reason"], reason);
        }
    }

    #[test]
    fn a_stream_carries_every_block_in_anthropics_event_order() {
        let events = parse(&events_of(&message(completion("tool_calls"))));
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        for (name, data) in &events {
            assert_eq!(data["type"], *name, "each data names its event");
        }
        assert_eq!(events[0].1["message"]["content"], json!([]));
        assert_eq!(
            events[3].1["delta"],
            json!({"type": "text_delta", "text": "Looking."})
        );
        assert_eq!(events[5].1["content_block"]["input"], json!({}));
        let partial = events[6].1["delta"]["partial_json"]
            .as_str()
            .expect("partial JSON");
        assert_eq!(
            serde_json::from_str::<Value>(partial).expect("JSON"),
            json!({"city": "Paris"})
        );
        assert_eq!(events[8].1["delta"]["stop_reason"], "tool_use");
        assert_eq!(events[8].1["usage"]["output_tokens"], 4);
    }

    #[test]
    fn a_refusal_is_in_anthropics_envelope_with_its_status_and_the_oam_object() {
        let body = json!({"error": {"message": "oam refused the request in phase budget: BUDGET_EXHAUSTED",
            "type": "invalid_request_error", "param": null, "code": "BUDGET_EXHAUSTED"},
            "oam": {"phase": "budget"}});
        let a = Answer {
            stream: false,
            status: StatusCode::PAYMENT_REQUIRED,
            body: body.to_string().into(),
            request_id: "r".into(),
            phase: "budget".into(),
            reasons: "BUDGET_EXHAUSTED".into(),
            target: String::new(),
            live: None,
            buffered: None,
            native: false,
        };
        let (text, events) = answer_of(&a, true);
        assert!(!events, "a refusal is no stream");
        let v: Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "billing_error");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("BUDGET_EXHAUSTED")
        );
        assert_eq!(v["oam"]["phase"], "budget");
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (429, "rate_limit_error"),
            (502, "api_error"),
            (503, "overloaded_error"),
        ] {
            assert_eq!(
                error_type(StatusCode::from_u16(status).expect("a status")),
                kind
            );
        }
    }

    #[test]
    fn an_api_key_header_authenticates_as_a_bearer_token() {
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("sk-1"));
        assert_eq!(chat_headers(&h)["authorization"], "Bearer sk-1");
        h.insert("authorization", HeaderValue::from_static("Bearer sk-2"));
        assert_eq!(
            chat_headers(&h)["authorization"],
            "Bearer sk-2",
            "an explicit one wins"
        );
    }

    /// Events as (name, data).
    fn parse(text: &str) -> Vec<(String, Value)> {
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (name, data) = e.split_once('\n').expect("event and data lines");
                let name = name
                    .strip_prefix("event: ")
                    .expect("an event line")
                    .to_string();
                (
                    name,
                    serde_json::from_str(data.strip_prefix("data: ").expect("data")).expect("JSON"),
                )
            })
            .collect()
    }

    fn decided(outcome: &str) -> crate::core::pipeline::Decision {
        match outcome {
            "accepted" => crate::node::offline::decision("accepted", "accepted", &[]),
            other => {
                crate::node::offline::decision(other, "generation", &["STREAM_ENDED_WITH_ERROR"])
            }
        }
    }

    #[test]
    fn a_live_chat_stream_becomes_anthropics_events_block_by_block() {
        let mut live = Live::default();
        let mut text = String::new();
        let mut feed = |chunk: Value| {
            let data = chunk.to_string();
            let d = crate::node::exchange::read_chunk(&data)
                .expect("no error")
                .expect("a chunk");
            text.push_str(&live.chunk(&d));
        };
        let head = |choices: Value| json!({"id": "chatcmpl-9", "model": "m", "choices": choices});
        feed(head(
            json!([{"delta": {"role": "assistant", "content": "Hel"}}]),
        ));
        feed(head(json!([{"delta": {"content": "lo"}}])));
        feed(head(
            json!([{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "get_weather", "arguments": "{\"ci"}}]}}]),
        ));
        feed(head(
            json!([{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "ty\":1}"}}]}}]),
        ));
        feed(head(json!([{"delta": {}, "finish_reason": "tool_calls"}])));
        feed(
            json!({"id": "chatcmpl-9", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}),
        );
        let ended = live.end(&decided("accepted"));
        let events = parse(&(text + &ended));
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(events[0].1["message"]["id"], "msg_9");
        assert_eq!(
            events[6].1["content_block"],
            json!({"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}})
        );
        let args: String = events[7..9]
            .iter()
            .map(|(_, d)| d["delta"]["partial_json"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(args, "{\"city\":1}");
        assert_eq!(events[10].1["delta"]["stop_reason"], "tool_use");
        assert_eq!(events[10].1["usage"]["output_tokens"], 7);
        assert_eq!(events[10].1["oam"]["outcome"], "accepted");
    }

    #[test]
    fn a_live_stream_oam_does_not_accept_ends_with_an_error_event_not_message_stop() {
        let mut live = Live::default();
        let chunk = json!({"id": "c", "model": "m", "choices": [{"delta": {"content": "par"}}]});
        let data = chunk.to_string();
        let d = crate::node::exchange::read_chunk(&data)
            .expect("no error")
            .expect("a chunk");
        let mut text = live.chunk(&d);
        text.push_str(&live.end(&decided("rejected")));
        let events = parse(&text);
        let last = events.last().expect("events");
        assert_eq!(last.0, "error");
        assert_eq!(last.1["error"]["type"], "api_error");
        assert!(
            last.1["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("STREAM_ENDED_WITH_ERROR")
        );
        assert!(
            !events.iter().any(|(n, _)| n == "message_stop"),
            "a cut answer never ends cleanly"
        );
    }

    #[test]
    fn tokens_are_counted_as_the_engine_prices_them() {
        let cfg =
            crate::node::config::NodeConfig::load(None, "http://127.0.0.1:1").expect("a config");
        let count = |content: &str| {
            let body = json!({"model": "auto", "system": "be brief",
                "messages": [{"role": "user", "content": content}]});
            count_tokens(&cfg, body.to_string().as_bytes(), &HeaderMap::new())
        };
        let short = count("hi").expect("counted");
        let long = count(&"word ".repeat(400)).expect("counted");
        assert!(short > 0 && long >= short + 400, "{short} {long}");
        let e = count_tokens(
            &cfg,
            br#"{"model": "auto", "messages": [], "top_k": 1}"#,
            &HeaderMap::new(),
        )
        .expect_err("refused");
        assert_eq!(e.param.as_deref(), Some("top_k"));
    }
}
