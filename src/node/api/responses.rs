//! The OpenAI Responses surface (`POST /v1/responses`), a sibling of `openai` and `anthropic`:
//! a Responses request (input items, instructions, function tools and their outputs,
//! `text.format`) is decoded into the typed turns and core request every upstream is written
//! from (`decode_request`), and the decided answer written as a response object, or the typed
//! event stream (`response.created` ... `response.completed`; relayed live as the stream
//! arrives: `Live`). This gateway keeps no responses: what needs stored state (`previous_response_id`,
//! `store: true`, `background`) or a hosted tool is a 400 naming the field. Errors keep
//! OpenAI's envelope, as the Responses API's own do.

use super::{
    BadRequest, Decoded, Members, bad, body_members, is_null, member, members_of, passed_on, read,
};
use crate::core::request::Request;
use crate::node::config::NodeConfig;
use crate::node::exchange::{Completion, Passthrough, read_completion};
use crate::node::model::{Content, Part, Sampling, Speaker, ToolCall, ToolChoice, Turn};
use crate::node::request::Answer;
use axum::http::HeaderMap;
use axum::http::StatusCode;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

/// The members a Responses request may have; any other is refused by name.
const KNOWN: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "store",
    "previous_response_id",
    "metadata",
    "user",
    "reasoning",
    "oam",
];

/// A Responses request as the core request the pipeline reads, whether the caller asked for a
/// stream (relayed live as the typed events, or, under a contract, checked whole and then sent
/// as them), and what goes upstream.
pub(crate) fn decode_request(
    cfg: &NodeConfig,
    body: &[u8],
    h: &HeaderMap,
    new_id: impl FnOnce() -> String,
) -> Result<(Request, bool, Passthrough), BadRequest> {
    decode(body_members(body)?)?.into_request(cfg, h, new_id)
}

/// A Responses request's members as the node serves them, each read from its own text as what
/// it must be: no tree of the request is built.
fn decode(members: Members<'_>) -> Result<Decoded, BadRequest> {
    if let Some((k, _)) = members.iter().find(|(k, _)| !KNOWN.contains(&k.as_ref())) {
        return Err(bad(
            k.as_ref(),
            format!("{k}: not a Responses request field this gateway serves"),
        ));
    }
    // The last of a name counts, as in a JSON object read whole; `null` is left out.
    let get = |name: &str| {
        members
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| *v)
            .filter(|v| !is_null(v))
    };
    if get("previous_response_id").is_some() {
        return Err(bad(
            "previous_response_id",
            "previous_response_id: this gateway keeps no responses; send the whole conversation \
             in input",
        ));
    }
    if get("store").is_some_and(|s| s.get() == "true") {
        return Err(bad(
            "store",
            "store: this gateway keeps no responses; send store: false or leave it out",
        ));
    }
    let stream = match get("stream") {
        None => false,
        Some(s) => read::<bool>(s).ok_or_else(|| bad("stream", "stream must be true or false"))?,
    };
    let mut turns = Vec::new();
    if let Some(i) = get("instructions") {
        let text = read::<String>(i)
            .ok_or_else(|| bad("instructions", "instructions must be a string"))?;
        turns.push(Turn::text(Speaker::System, text));
    }
    let input = get("input");
    if let Some(text) = input.and_then(read::<String>) {
        turns.push(Turn::text(Speaker::User, text));
    } else {
        let items = input.and_then(read::<Vec<&RawValue>>).unwrap_or_default();
        if items.is_empty() {
            return Err(bad(
                "input",
                "input must be a string or a non-empty array of input items",
            ));
        }
        for (i, item) in items.into_iter().enumerate() {
            decode_item(item, i, &mut turns)?;
        }
    }
    let model = match get("model") {
        Some(m) => Some(read::<String>(m).ok_or_else(|| bad("model", "model must be a string"))?),
        None => None,
    };
    let max_tokens = match get("max_output_tokens") {
        Some(n) => Some(
            read::<u64>(n)
                .filter(|n| *n >= 1)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    bad(
                        "max_output_tokens",
                        "max_output_tokens must be a whole number of at least 1",
                    )
                })?,
        ),
        None => None,
    };
    let oam = match get("oam") {
        Some(o) => Some(member(passed_on(o, "oam")?, "oam")?),
        None => None,
    };
    let number = |k: &str| match get(k) {
        Some(v) => read::<f64>(v)
            .map(Some)
            .ok_or_else(|| bad(k, format!("{k} must be a number"))),
        None => Ok(None),
    };
    let mut sampling = Sampling {
        temperature: number("temperature")?,
        top_p: number("top_p")?,
        ..Sampling::default()
    };
    if let Some(p) = get("parallel_tool_calls") {
        let p = read::<bool>(p).ok_or_else(|| {
            bad(
                "parallel_tool_calls",
                "parallel_tool_calls must be true or false",
            )
        })?;
        sampling.parallel_tool_calls = Some(p);
    }
    if let Some(u) = get("user") {
        sampling.user =
            Some(read::<String>(u).ok_or_else(|| bad("user", "user must be a string"))?);
    }
    // What chat carries under its own names, passed on.
    let mut chat = Map::new();
    if let Some(m) = get("metadata") {
        chat.insert("metadata".into(), passed_on(m, "metadata")?);
    }
    if let Some(r) = get("reasoning") {
        let r = members_of(r.get()).unwrap_or_default();
        if let Some((k, _)) = r.iter().find(|(k, _)| k != "effort") {
            return Err(bad(
                format!("reasoning.{k}"),
                format!("reasoning.{k}: chat-completions targets take only reasoning.effort"),
            ));
        }
        if let Some((_, effort)) = r.iter().rev().find(|(_, e)| !is_null(e)) {
            chat.insert(
                "reasoning_effort".into(),
                passed_on(effort, "reasoning.effort")?,
            );
        }
    }
    let tools = match get("tools") {
        Some(tools) => Some(chat_tools(tools)?),
        None => None,
    };
    if let Some(c) = get("tool_choice") {
        sampling.tool_choice = Some(tool_choice(c)?);
    }
    let response_format = match get("text") {
        Some(text) => response_format(text)?,
        None => None,
    };
    Ok(Decoded {
        model,
        turns,
        sampling,
        max_tokens,
        response_format,
        stream,
        include_usage: false,
        oam,
        tools,
        extra: chat,
    })
}

/// `tool_choice` as chat's.
fn tool_choice(c: &RawValue) -> Result<ToolChoice, BadRequest> {
    if let Some(s) =
        read::<String>(c).filter(|s| matches!(s.as_str(), "auto" | "required" | "none"))
    {
        return Ok(ToolChoice::Mode(s));
    }
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct ChoiceIn {
        #[serde(rename = "type")]
        kind: Option<String>,
        name: Option<String>,
    }
    match read::<ChoiceIn>(c).unwrap_or_default() {
        ChoiceIn {
            kind: Some(k),
            name: Some(name),
        } if k == "function" => Ok(ToolChoice::Function(name)),
        ChoiceIn { kind: Some(k), .. } if k == "function" => Err(bad(
            "tool_choice.name",
            "tool_choice.name must name a function",
        )),
        _ => Err(bad(
            "tool_choice",
            "tool_choice must be \"auto\", \"required\", \"none\" or {\"type\": \"function\", \"name\": ...}",
        )),
    }
}

/// `text.format` as chat's `response_format` (none for plain text).
fn response_format(text: &RawValue) -> Result<Option<Value>, BadRequest> {
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct TextIn<'a> {
        #[serde(borrow)]
        format: Option<&'a RawValue>,
    }
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct FormatIn<'a> {
        #[serde(rename = "type")]
        kind: Option<String>,
        #[serde(borrow)]
        name: Option<&'a RawValue>,
        #[serde(borrow)]
        schema: Option<&'a RawValue>,
        #[serde(borrow)]
        strict: Option<&'a RawValue>,
    }
    let Some(format) = read::<TextIn>(text).and_then(|t| t.format) else {
        return Ok(None);
    };
    let f = read::<FormatIn>(format).unwrap_or_default();
    Ok(match f.kind.as_deref() {
        Some("text") | None => None,
        Some("json_object") => Some(json!({"type": "json_object"})),
        Some("json_schema") => {
            let mut schema = json!({"name": f.name, "schema": f.schema});
            if let Some(strict) = f.strict {
                schema["strict"] = passed_on(strict, "text.format.strict")?;
            }
            Some(json!({"type": "json_schema", "json_schema": schema}))
        }
        Some(other) => {
            return Err(bad(
                "text.format.type",
                format!("text.format.type: {other:?} is not text, json_object or json_schema"),
            ));
        }
    })
}

/// An input item's members oam reads, each as its text.
#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct ItemIn<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<&'a RawValue>,
    #[serde(borrow)]
    role: Option<&'a RawValue>,
    #[serde(borrow)]
    content: Option<&'a RawValue>,
    #[serde(borrow)]
    call_id: Option<&'a RawValue>,
    #[serde(borrow)]
    name: Option<&'a RawValue>,
    #[serde(borrow)]
    arguments: Option<&'a RawValue>,
    #[serde(borrow)]
    output: Option<&'a RawValue>,
}

/// JSON text given, and not `null`.
fn given(v: Option<&RawValue>) -> Option<&RawValue> {
    v.filter(|v| !is_null(v))
}

/// JSON text that is a string: the string.
fn string(v: Option<&RawValue>) -> Option<String> {
    crate::node::exchange::str_of(v).map(std::borrow::Cow::into_owned)
}

/// One input item as the turns it means: a message (its content parts read), a function call
/// (an assistant's tool call; the calls of one turn on one assistant turn, as chat wants them)
/// or a function call's output (a tool turn).
fn decode_item(raw: &RawValue, i: usize, out: &mut Vec<Turn>) -> Result<(), BadRequest> {
    let at = format!("input[{i}]");
    let item = read::<ItemIn>(raw).unwrap_or_default();
    match string(item.kind).as_deref() {
        None | Some("message") => {
            let role = match string(item.role).as_deref() {
                Some("developer" | "system") => Speaker::System,
                Some("user") => Speaker::User,
                Some("assistant") => Speaker::Assistant,
                _ => {
                    return Err(bad(
                        format!("{at}.role"),
                        format!("{at}.role must be user, assistant, system or developer"),
                    ));
                }
            };
            let content = if let Some(text) = string(item.content) {
                Content::Text(text)
            } else if let Some(parts) = item.content.and_then(read::<Vec<&RawValue>>) {
                let mut read = Vec::with_capacity(parts.len());
                for (j, p) in parts.into_iter().enumerate() {
                    read.push(decode_part(p, &format!("{at}.content[{j}]"))?);
                }
                if role == Speaker::Assistant {
                    // An assistant's turn is text in chat.
                    let text: Vec<&str> = read
                        .iter()
                        .filter_map(|p| match p {
                            Part::Text(t) => Some(t.as_str()),
                            _ => None,
                        })
                        .collect();
                    Content::Text(text.join(""))
                } else {
                    Content::Parts(read)
                }
            } else {
                return Err(bad(
                    format!("{at}.content"),
                    format!("{at}.content must be a string or an array of content parts"),
                ));
            };
            let mut turn = Turn::text(role, "");
            turn.content = content;
            out.push(turn);
        }
        Some("function_call") => {
            let (Some(id), Some(name)) = (string(item.call_id), string(item.name)) else {
                return Err(bad(
                    at.clone(),
                    format!("{at}: a function_call needs call_id and name"),
                ));
            };
            let call = ToolCall {
                id,
                name,
                arguments: string(item.arguments).unwrap_or_else(|| "{}".into()),
            };
            match out.last_mut() {
                Some(last) if last.role == Speaker::Assistant && !last.calls.is_empty() => {
                    last.calls.push(call);
                }
                _ => {
                    let mut turn = Turn::text(Speaker::Assistant, "");
                    turn.content = Content::Absent;
                    turn.calls.push(call);
                    out.push(turn);
                }
            }
        }
        Some("function_call_output") => {
            let Some(id) = string(item.call_id) else {
                return Err(bad(
                    format!("{at}.call_id"),
                    format!("{at}.call_id must be a string"),
                ));
            };
            // A string as it is; any other output as its JSON text.
            let output = string(item.output)
                .or_else(|| item.output.map(|o| o.get().to_string()))
                .unwrap_or_else(|| "null".into());
            let mut turn = Turn::text(Speaker::Tool, output);
            turn.answers = Some(id);
            out.push(turn);
        }
        Some(other) => {
            return Err(bad(
                format!("{at}.type"),
                format!(
                    "{at}.type: {other:?} items need stored state or a hosted tool this gateway \
                     does not keep; send messages, function_call and function_call_output items"
                ),
            ));
        }
    }
    Ok(())
}

/// A content part: text (input or output), or an image by URL.
fn decode_part(p: &RawValue, at: &str) -> Result<Part, BadRequest> {
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct PartIn<'a> {
        #[serde(rename = "type", borrow)]
        kind: Option<&'a RawValue>,
        #[serde(borrow)]
        text: Option<&'a RawValue>,
        #[serde(borrow)]
        image_url: Option<&'a RawValue>,
        #[serde(borrow)]
        detail: Option<&'a RawValue>,
    }
    let p = read::<PartIn>(p).unwrap_or_default();
    match string(p.kind).as_deref() {
        Some("input_text" | "output_text" | "text") => match string(p.text) {
            Some(t) => Ok(Part::Text(t)),
            None => Err(bad(
                format!("{at}.text"),
                format!("{at}.text must be a string"),
            )),
        },
        Some("input_image") => match string(p.image_url) {
            Some(url) => Ok(Part::Image {
                url,
                detail: string(p.detail),
            }),
            None => Err(bad(
                format!("{at}.image_url"),
                format!("{at}.image_url must be a URL (file_id images need stored files)"),
            )),
        },
        other => Err(bad(
            format!("{at}.type"),
            format!("{at}.type: {other:?} is not input_text, output_text or input_image"),
        )),
    }
}

/// Function tools (`[{type: "function", name, parameters}]`) as a chat tool list (schemas as
/// the client wrote them); a hosted tool is refused.
fn chat_tools(raw: &RawValue) -> Result<Box<RawValue>, BadRequest> {
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct ToolIn<'a> {
        #[serde(rename = "type", borrow)]
        kind: Option<&'a RawValue>,
        #[serde(borrow)]
        name: Option<&'a RawValue>,
        #[serde(borrow)]
        description: Option<&'a RawValue>,
        #[serde(borrow)]
        parameters: Option<&'a RawValue>,
        #[serde(borrow)]
        strict: Option<&'a RawValue>,
    }
    #[derive(serde::Serialize)]
    struct Function<'a> {
        name: &'a RawValue,
        #[serde(skip_serializing_if = "Option::is_none")]
        description: Option<&'a RawValue>,
        #[serde(skip_serializing_if = "Option::is_none")]
        parameters: Option<&'a RawValue>,
        #[serde(skip_serializing_if = "Option::is_none")]
        strict: Option<&'a RawValue>,
    }
    #[derive(serde::Serialize)]
    struct ChatTool<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        function: Function<'a>,
    }
    let list = read::<Vec<&RawValue>>(raw)
        .ok_or_else(|| bad("tools", "tools must be an array of function tools"))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        let at = format!("tools[{i}]");
        let t = read::<ToolIn>(t).unwrap_or_default();
        let kind = string(t.kind);
        if kind.as_deref() != Some("function") {
            return Err(bad(
                format!("{at}.type"),
                format!(
                    "{at}.type: {:?} is a hosted tool this gateway does not run; declare function tools",
                    kind.as_deref()
                ),
            ));
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
                description: given(t.description),
                parameters: given(t.parameters),
                strict: given(t.strict),
            },
        });
    }
    serde_json::value::to_raw_value(&out).map_err(|e| bad("tools", e.to_string()))
}

/// A chat completion (what the pipeline accepted) as a response object, the `oam` object kept.
pub(crate) fn response_of<'a>(chat: &'a Completion<'a>) -> ResponseOut<'a> {
    let id = chat.head.id().unwrap_or_default();
    let id = id.strip_prefix("chatcmpl-").unwrap_or(&id).to_string();
    let mut output = Vec::with_capacity(1 + chat.calls.len());
    if let Some(text) = chat.text.as_deref().filter(|t| !t.is_empty()) {
        output.push(ItemOut::Message {
            id: format!("msg_{id}"),
            status: "completed",
            role: "assistant",
            content: vec![output_text(text)],
        });
    }
    for (i, call) in chat.calls.iter().enumerate() {
        output.push(ItemOut::FunctionCall {
            id: format!("fc_{id}_{i}"),
            call_id: call.id,
            name: call.name.as_deref(),
            arguments: call.arguments.as_deref(),
            status: "completed",
        });
    }
    let incomplete = match chat.finish.as_deref() {
        Some("length") => Some("max_output_tokens"),
        Some("content_filter") => Some("content_filter"),
        _ => None,
    };
    let u = chat.usage.unwrap_or_default();
    ResponseOut {
        id: format!("resp_{id}"),
        object: "response",
        created_at: chat.head.created,
        status: if incomplete.is_some() {
            "incomplete"
        } else {
            "completed"
        },
        incomplete_details: incomplete.map(|reason| Incomplete { reason }),
        error: None,
        model: chat.head.model,
        output,
        parallel_tool_calls: true,
        tool_choice: "auto",
        tools: [],
        store: false,
        usage: Some(UsageOut::of(u)),
        oam: chat.oam,
    }
}

/// A response object as oam writes one.
#[derive(serde::Serialize)]
pub(crate) struct ResponseOut<'a> {
    id: String,
    object: &'static str,
    created_at: Option<&'a RawValue>,
    status: &'static str,
    incomplete_details: Option<Incomplete>,
    error: Option<FailedOut>,
    model: Option<&'a RawValue>,
    output: Vec<ItemOut<'a>>,
    parallel_tool_calls: bool,
    tool_choice: &'static str,
    tools: [(); 0],
    store: bool,
    /// None (null) while the response is in progress, or when it failed.
    usage: Option<UsageOut>,
    #[serde(skip_serializing_if = "Option::is_none")]
    oam: Option<&'a RawValue>,
}

/// Why a response failed.
#[derive(serde::Serialize)]
struct FailedOut {
    code: String,
    message: String,
}

#[derive(serde::Serialize)]
struct Incomplete {
    reason: &'static str,
}

#[derive(serde::Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ItemOut<'a> {
    Message {
        id: String,
        status: &'static str,
        role: &'static str,
        content: Vec<TextOut<'a>>,
    },
    FunctionCall {
        id: String,
        call_id: Option<&'a RawValue>,
        name: Option<&'a str>,
        arguments: Option<&'a str>,
        status: &'static str,
    },
}

#[derive(serde::Serialize)]
struct TextOut<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
    annotations: [(); 0],
}

#[derive(serde::Serialize)]
struct UsageOut {
    input_tokens: u64,
    input_tokens_details: CachedOut,
    output_tokens: u64,
    output_tokens_details: ReasoningOut,
    total_tokens: u64,
}

impl UsageOut {
    fn of(u: crate::core::request::Usage) -> UsageOut {
        UsageOut {
            input_tokens: u.prompt_tokens,
            input_tokens_details: CachedOut {
                cached_tokens: u.cached_tokens,
            },
            output_tokens: u.completion_tokens,
            output_tokens_details: ReasoningOut {
                reasoning_tokens: u.reasoning_tokens,
            },
            total_tokens: u.prompt_tokens + u.completion_tokens,
        }
    }
}

#[derive(serde::Serialize)]
struct CachedOut {
    cached_tokens: u64,
}

#[derive(serde::Serialize)]
struct ReasoningOut {
    reasoning_tokens: u64,
}

/// A chat stream relayed live as the Responses API's typed events: the response started, the
/// output item open now (a message, or the tool call at a chat index) with what it has said,
/// and the items done, so each chunk becomes its events as it arrives.
#[derive(Default)]
pub(crate) struct Live {
    seq: u64,
    /// The response's id, time and model, once the first chunk named them.
    head: Option<LiveHead>,
    /// The output items done, in order.
    done: Vec<LiveItem>,
    /// The open item: the tool call at this chat index (`Some`) or the message (`None`).
    open: Option<(Option<u64>, LiveItem)>,
    finish: Option<String>,
    usage: Option<crate::core::request::Usage>,
}

struct LiveHead {
    id: String,
    created: Option<Box<RawValue>>,
    model: Option<Box<RawValue>>,
}

/// An output item as the stream builds it.
enum LiveItem {
    Message {
        id: String,
        text: String,
    },
    Call {
        id: String,
        call_id: Option<Box<RawValue>>,
        name: Option<String>,
        arguments: String,
    },
}

impl LiveItem {
    fn id(&self) -> &str {
        match self {
            LiveItem::Message { id, .. } | LiveItem::Call { id, .. } => id,
        }
    }

    /// As written: as it was added (`whole` false: no text, no arguments yet), or as it is.
    fn out(&self, whole: bool) -> ItemOut<'_> {
        let status = if whole { "completed" } else { "in_progress" };
        match self {
            LiveItem::Message { id, text } => ItemOut::Message {
                id: id.clone(),
                status,
                role: "assistant",
                content: if whole {
                    vec![output_text(text)]
                } else {
                    Vec::new()
                },
            },
            LiveItem::Call {
                id,
                call_id,
                name,
                arguments,
            } => ItemOut::FunctionCall {
                id: id.clone(),
                call_id: call_id.as_deref(),
                name: name.as_deref(),
                arguments: Some(if whole { arguments } else { "" }),
                status,
            },
        }
    }
}

fn output_text(text: &str) -> TextOut<'_> {
    TextOut {
        kind: "output_text",
        text,
        annotations: [],
    }
}

/// One event's members (those it has), beside its type and number.
#[derive(serde::Serialize, Default)]
struct EventOut<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    sequence_number: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<ResponseOut<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    item_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    output_index: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content_index: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    item: Option<ItemOut<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    part: Option<TextOut<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    arguments: Option<&'a str>,
}

/// Write event `e` named `name` onto `out`, numbered by `seq`.
fn write_event<'a>(out: &mut String, seq: &mut u64, name: &'a str, mut e: EventOut<'a>) {
    e.kind = name;
    e.sequence_number = *seq;
    *seq += 1;
    let data = serde_json::to_string(&e).unwrap_or_default();
    out.push_str(&format!("event: {name}\ndata: {data}\n\n"));
}

/// How a live response ends.
struct Ending<'a> {
    status: &'static str,
    incomplete: Option<&'static str>,
    error: Option<FailedOut>,
    oam: Option<&'a RawValue>,
}

impl Live {
    fn index(&self) -> usize {
        self.done.len()
    }

    /// The response as it stands: in progress (`ending` none), or ended.
    fn response<'a>(&'a self, ending: Option<Ending<'a>>) -> ResponseOut<'a> {
        let head = self.head.as_ref();
        let u = self.usage.unwrap_or_default();
        let e = ending.unwrap_or(Ending {
            status: "in_progress",
            incomplete: None,
            error: None,
            oam: None,
        });
        ResponseOut {
            id: head.map(|h| h.id.clone()).unwrap_or_default(),
            object: "response",
            created_at: head.and_then(|h| h.created.as_deref()),
            status: e.status,
            incomplete_details: e.incomplete.map(|reason| Incomplete { reason }),
            error: e.error,
            model: head.and_then(|h| h.model.as_deref()),
            output: self.done.iter().map(|i| i.out(true)).collect(),
            parallel_tool_calls: true,
            tool_choice: "auto",
            tools: [],
            store: false,
            usage: matches!(e.status, "completed" | "incomplete").then(|| UsageOut::of(u)),
            oam: e.oam,
        }
    }

    /// Write the response as it stands (`ending`: as it ended) as event `name`.
    fn response_event(&mut self, out: &mut String, name: &str, ending: Option<Ending<'_>>) {
        let mut seq = self.seq;
        let e = EventOut {
            response: Some(self.response(ending)),
            ..Default::default()
        };
        write_event(out, &mut seq, name, e);
        self.seq = seq;
    }

    /// The response is continued by `model` (a stream cut and continued): the response it
    /// completes names that model.
    pub(crate) fn written_by(&mut self, model: &RawValue) {
        if let Some(h) = &mut self.head {
            h.model = Some(model.to_owned());
        }
    }

    /// The events one chat chunk (`delta`) means.
    pub(crate) fn chunk(&mut self, delta: &crate::node::exchange::Delta) -> String {
        let mut out = String::new();
        if self.head.is_none() {
            let head = &delta.head;
            let id = head.id().unwrap_or_default();
            let id = id.strip_prefix("chatcmpl-").unwrap_or(&id);
            self.head = Some(LiveHead {
                id: format!("resp_{id}"),
                created: head.created.map(RawValue::to_owned),
                model: head.model.map(RawValue::to_owned),
            });
            self.response_event(&mut out, "response.created", None);
            self.response_event(&mut out, "response.in_progress", None);
        }
        let rid = self.head.as_ref().map(|h| h.id.clone()).unwrap_or_default();
        if let Some(text) = delta.text.as_deref().filter(|t| !t.is_empty()) {
            if !matches!(self.open, Some((None, _))) {
                self.close(&mut out);
                let i = self.index();
                let item = LiveItem::Message {
                    id: format!("msg_{rid}_{i}"),
                    text: String::new(),
                };
                let e = EventOut {
                    output_index: Some(i),
                    item: Some(item.out(false)),
                    ..Default::default()
                };
                write_event(&mut out, &mut self.seq, "response.output_item.added", e);
                let e = EventOut {
                    item_id: Some(item.id()),
                    output_index: Some(i),
                    content_index: Some(0),
                    part: Some(output_text("")),
                    ..Default::default()
                };
                write_event(&mut out, &mut self.seq, "response.content_part.added", e);
                self.open = Some((None, item));
            }
            let i = self.index();
            if let Some((_, item)) = &mut self.open {
                if let LiveItem::Message { text: t, .. } = item {
                    t.push_str(text);
                }
                let e = EventOut {
                    item_id: Some(item.id()),
                    output_index: Some(i),
                    content_index: Some(0),
                    delta: Some(text),
                    ..Default::default()
                };
                write_event(&mut out, &mut self.seq, "response.output_text.delta", e);
            }
        }
        for t in &delta.tool_calls {
            let call = t.index;
            if !matches!(&self.open, Some((Some(c), _)) if *c == call) {
                self.close(&mut out);
                let i = self.index();
                let item = LiveItem::Call {
                    id: format!("fc_{rid}_{i}"),
                    call_id: t.id.map(RawValue::to_owned),
                    name: t.name.as_deref().map(String::from),
                    arguments: String::new(),
                };
                let e = EventOut {
                    output_index: Some(i),
                    item: Some(item.out(false)),
                    ..Default::default()
                };
                write_event(&mut out, &mut self.seq, "response.output_item.added", e);
                self.open = Some((Some(call), item));
            }
            if let Some(args) = t.arguments.as_deref().filter(|a| !a.is_empty()) {
                let i = self.index();
                if let Some((_, item)) = &mut self.open {
                    if let LiveItem::Call { arguments, .. } = item {
                        arguments.push_str(args);
                    }
                    let e = EventOut {
                        item_id: Some(item.id()),
                        output_index: Some(i),
                        delta: Some(args),
                        ..Default::default()
                    };
                    let name = "response.function_call_arguments.delta";
                    write_event(&mut out, &mut self.seq, name, e);
                }
            }
        }
        if let Some(f) = &delta.finish {
            self.finish = Some(f.to_string());
        }
        if delta.usage.is_some() {
            self.usage = delta.usage;
        }
        out
    }

    /// Close the open item: its done events, and it joins the response's output.
    fn close(&mut self, out: &mut String) {
        let Some((_, item)) = self.open.take() else {
            return;
        };
        let i = self.index();
        let seq = &mut self.seq;
        let at = || EventOut {
            item_id: Some(item.id()),
            output_index: Some(i),
            ..Default::default()
        };
        match &item {
            LiveItem::Call { arguments, .. } => {
                let e = EventOut {
                    arguments: Some(arguments),
                    ..at()
                };
                write_event(out, seq, "response.function_call_arguments.done", e);
            }
            LiveItem::Message { text, .. } => {
                let e = EventOut {
                    content_index: Some(0),
                    text: Some(text),
                    ..at()
                };
                write_event(out, seq, "response.output_text.done", e);
                let e = EventOut {
                    content_index: Some(0),
                    part: Some(output_text(text)),
                    ..at()
                };
                write_event(out, seq, "response.content_part.done", e);
            }
        }
        let e = EventOut {
            output_index: Some(i),
            item: Some(item.out(true)),
            ..Default::default()
        };
        write_event(out, seq, "response.output_item.done", e);
        self.done.push(item);
    }

    /// The events that end the stream once `d` is decided: the open item closed and
    /// `response.completed` (or `response.incomplete`) with the whole response and the `oam`
    /// object; else `response.failed`, whose `error` says why.
    pub(crate) fn end(&mut self, d: &crate::core::pipeline::Decision) -> String {
        let mut out = String::new();
        let oam = serde_json::value::to_raw_value(&super::openai::OamObject::of(d)).ok();
        let (name, ending) = if d.outcome == crate::core::pipeline::DecisionOutcome::Accepted {
            self.close(&mut out);
            let incomplete = match self.finish.as_deref() {
                Some("length") => Some("max_output_tokens"),
                Some("content_filter") => Some("content_filter"),
                _ => None,
            };
            let ending = Ending {
                status: if incomplete.is_some() {
                    "incomplete"
                } else {
                    "completed"
                },
                incomplete,
                error: None,
                oam: oam.as_deref(),
            };
            let name = if incomplete.is_some() {
                "response.incomplete"
            } else {
                "response.completed"
            };
            (name, ending)
        } else {
            let reasons: Vec<&str> = d.reason_codes.iter().map(|c| c.as_str()).collect();
            let code = d.reason_codes.last().map_or("", |c| c.as_str());
            let message = format!(
                "oam ended the stream in phase {}: {}",
                d.phase,
                reasons.join(", ")
            );
            let ending = Ending {
                status: "failed",
                incomplete: None,
                error: Some(FailedOut {
                    code: code.to_string(),
                    message,
                }),
                oam: oam.as_deref(),
            };
            ("response.failed", ending)
        };
        self.response_event(&mut out, name, Some(ending));
        out
    }
}

/// A whole response as the typed event stream: `response.created`, `response.in_progress`,
/// each output item added, its text or arguments in a delta and done, the item done, then
/// `response.completed` (or `response.incomplete`) with the whole response.
pub(crate) fn events_of(response: &Value) -> String {
    let mut out = String::new();
    let mut seq = 0u64;
    let mut event = |name: &str, mut data: Value| {
        data["type"] = json!(name);
        data["sequence_number"] = json!(seq);
        seq += 1;
        out.push_str(&format!("event: {name}\ndata: {data}\n\n"));
    };
    let mut start = response.clone();
    start["status"] = json!("in_progress");
    start["output"] = json!([]);
    start["usage"] = Value::Null;
    event("response.created", json!({"response": start}));
    event("response.in_progress", json!({"response": start}));
    for (i, item) in response["output"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let item_id = &item["id"];
        let mut added = item.clone();
        added["status"] = json!("in_progress");
        if item["type"] == "function_call" {
            added["arguments"] = json!("");
            event(
                "response.output_item.added",
                json!({"output_index": i, "item": added}),
            );
            let args = &item["arguments"];
            event(
                "response.function_call_arguments.delta",
                json!({"item_id": item_id, "output_index": i, "delta": args}),
            );
            event(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": i, "arguments": args}),
            );
        } else {
            added["content"] = json!([]);
            event(
                "response.output_item.added",
                json!({"output_index": i, "item": added}),
            );
            for (j, part) in item["content"].as_array().into_iter().flatten().enumerate() {
                let at = json!({"item_id": item_id, "output_index": i, "content_index": j});
                let mut empty = part.clone();
                empty["text"] = json!("");
                let with = |mut v: Value, k: &str, x: Value| {
                    v[k] = x;
                    v
                };
                event(
                    "response.content_part.added",
                    with(at.clone(), "part", empty),
                );
                event(
                    "response.output_text.delta",
                    with(at.clone(), "delta", part["text"].clone()),
                );
                event(
                    "response.output_text.done",
                    with(at.clone(), "text", part["text"].clone()),
                );
                event("response.content_part.done", with(at, "part", part.clone()));
            }
        }
        event(
            "response.output_item.done",
            json!({"output_index": i, "item": item}),
        );
    }
    let last = if response["status"] == "incomplete" {
        "response.incomplete"
    } else {
        "response.completed"
    };
    event(last, json!({"response": response}));
    out
}

/// The answer to a Responses request: a response object or its events when accepted; a refusal
/// as it is (OpenAI's envelope, the `oam` object in it).
pub(crate) fn answer_of(a: &Answer, stream: bool) -> (String, bool) {
    if a.status != StatusCode::OK {
        return (String::from_utf8_lossy(&a.body).into_owned(), false);
    }
    let text = String::from_utf8_lossy(&a.body);
    let chat = read_completion(&text).unwrap_or_default();
    let response = response_of(&chat);
    if stream {
        // Checked whole, then sent as the events of its stream.
        let tree = serde_json::to_value(&response).unwrap_or_default();
        (events_of(&tree), true)
    } else {
        (serde_json::to_string(&response).unwrap_or_default(), false)
    }
}

/// OpenAI's Responses.
pub(crate) struct Responses;

impl super::ClientApi for Responses {
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
    fn chunk(&mut self, _data: &str, delta: &crate::node::exchange::Delta) -> String {
        Live::chunk(self, delta)
    }

    fn continued_by(&mut self, model: &RawValue) {
        self.written_by(model);
    }

    fn end(&mut self, d: &crate::core::pipeline::Decision) -> String {
        Live::end(self, d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The response object a chat completion means.
    fn response(chat: Value) -> Value {
        let text = chat.to_string();
        let chat = read_completion(&text).expect("a completion");
        serde_json::to_value(response_of(&chat)).expect("JSON")
    }

    /// What a chat target is sent of a Responses request, whether it streams, and the core
    /// request.
    fn chat(body: Value) -> Result<(Value, bool, Request), BadRequest> {
        let cfg = NodeConfig::load(None, "http://127.0.0.1:1").expect("a config");
        let h = HeaderMap::new();
        let (request, stream, pass) =
            decode_request(&cfg, body.to_string().as_bytes(), &h, || "r".into())?;
        Ok((crate::node::api::as_chat(&request, &pass), stream, request))
    }

    #[test]
    fn a_responses_request_becomes_the_chat_request_it_means() {
        let (c, stream, request) = chat(json!({
            "model": "auto", "instructions": "be brief", "stream": true, "max_output_tokens": 50,
            "store": false, "reasoning": {"effort": "low"}, "oam": {"agent": "agents-sdk"},
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}},
            "input": [
                {"role": "developer", "content": "use metric"},
                {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "Weather?"},
                    {"type": "input_image", "image_url": "data:image/png;base64,iVBOR", "detail": "low"}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\":\"Rome\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "21C"},
                {"type": "function_call_output", "call_id": "call_2", "output": {"c": 25}}
            ]
        }))
        .expect("translated");
        assert!(stream && request.stream);
        let m = &c["messages"];
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(m[1], json!({"role": "system", "content": "use metric"}));
        assert_eq!(
            m[2]["content"][1]["image_url"],
            json!({"url": "data:image/png;base64,iVBOR", "detail": "low"})
        );
        let calls = m[3]["tool_calls"]
            .as_array()
            .expect("one turn's calls together");
        assert_eq!(calls.len(), 2);
        assert_eq!(
            m[4],
            json!({"role": "tool", "tool_call_id": "call_1", "content": "21C"})
        );
        assert_eq!(m[5]["content"], "{\"c\":25}");
        assert_eq!(
            (&c["max_tokens"], &c["reasoning_effort"]),
            (&json!(50), &json!("low"))
        );
        assert_eq!(c["tools"][0]["function"]["strict"], true);
        assert_eq!(c["tool_choice"]["function"]["name"], "get_weather");
        assert_eq!(c["response_format"]["json_schema"]["name"], "w");
        assert_eq!(request.agent, "agents-sdk", "oam's fields are read");
    }

    #[test]
    fn what_needs_stored_state_or_a_hosted_tool_is_refused_by_name() {
        let input = json!("hi");
        for (body, param) in [
            (
                json!({"model": "auto", "input": input, "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (
                json!({"model": "auto", "input": input, "store": true}),
                "store",
            ),
            (
                json!({"model": "auto", "input": input, "background": true}),
                "background",
            ),
            (
                json!({"model": "auto", "input": input, "tools": [{"type": "web_search"}]}),
                "tools[0].type",
            ),
            (
                json!({"model": "auto", "input": [{"type": "item_reference", "id": "x"}]}),
                "input[0].type",
            ),
            (
                json!({"model": "auto", "input": [{"type": "reasoning", "summary": []}]}),
                "input[0].type",
            ),
            (
                json!({"model": "auto", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
                "input[0].content[0].type",
            ),
            (json!({"model": "auto", "input": []}), "input"),
            (
                json!({"model": "auto", "input": input, "reasoning": {"summary": "auto"}}),
                "reasoning.summary",
            ),
            (
                json!({"model": "auto", "input": input, "text": {"format": {"type": "xml"}}}),
                "text.format.type",
            ),
        ] {
            let Err(e) = chat(body.clone()) else {
                panic!("translated {body}")
            };
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert!(e.message.contains(param), "{}", e.message);
        }
    }

    fn completion(finish: &str) -> Value {
        json!({
            "id": "chatcmpl-abc", "object": "chat.completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "finish_reason": finish, "message": {
                "role": "assistant", "content": "Looking.",
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4,
                      "completion_tokens_details": {"reasoning_tokens": 2}},
            "oam": {"request_id": "r1"}
        })
    }

    #[test]
    fn a_chat_answer_reads_as_a_response_with_its_items_and_usage() {
        let r = response(completion("tool_calls"));
        assert_eq!(
            (&r["id"], &r["object"], &r["status"]),
            (&json!("resp_abc"), &json!("response"), &json!("completed"))
        );
        assert_eq!(
            r["output"][0]["content"][0],
            json!({"type": "output_text", "text": "Looking.", "annotations": []})
        );
        assert_eq!(r["output"][1]["type"], "function_call");
        assert_eq!(
            (&r["output"][1]["call_id"], &r["output"][1]["arguments"]),
            (&json!("call_1"), &json!("{\"city\":\"Paris\"}"))
        );
        assert_eq!(r["usage"]["total_tokens"], 14);
        assert_eq!(r["usage"]["output_tokens_details"]["reasoning_tokens"], 2);
        assert_eq!(r["oam"]["request_id"], "r1");
        let cut = response(completion("length"));
        assert_eq!(
            (&cut["status"], &cut["incomplete_details"]["reason"]),
            (&json!("incomplete"), &json!("max_output_tokens"))
        );
    }

    #[test]
    fn a_stream_is_the_typed_event_sequence_numbered_in_order() {
        let events = events(&events_of(&response(completion("tool_calls"))));
        let types: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(
            types,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        for (i, e) in events.iter().enumerate() {
            assert_eq!(e["sequence_number"], i as u64);
        }
        assert_eq!(events[0]["response"]["output"], json!([]));
        assert_eq!(events[4]["delta"], "Looking.");
        assert_eq!(
            events[12]["response"]["output"].as_array().map(Vec::len),
            Some(2)
        );
    }

    fn decided(outcome: &str) -> crate::core::pipeline::Decision {
        match outcome {
            "accepted" => crate::node::offline::decision("accepted", "accepted", &[]),
            other => {
                crate::node::offline::decision(other, "generation", &["STREAM_ENDED_WITH_ERROR"])
            }
        }
    }

    /// The events of a stream, each data's `type` checked against its event name.
    fn events(text: &str) -> Vec<Value> {
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (name, data) = e.split_once('\n').expect("event and data lines");
                let v: Value =
                    serde_json::from_str(data.strip_prefix("data: ").expect("data")).expect("JSON");
                assert_eq!(
                    Some(v["type"].as_str().unwrap_or_default()),
                    name.strip_prefix("event: ")
                );
                v
            })
            .collect()
    }

    #[test]
    fn a_live_chat_stream_becomes_the_typed_events_item_by_item() {
        let mut live = Live::default();
        let mut text = String::new();
        for chunk in [
            json!({"id": "chatcmpl-7", "created": 1, "model": "m", "choices": [{"delta": {"content": "Hel"}}]}),
            json!({"id": "chatcmpl-7", "choices": [{"delta": {"content": "lo"}}]}),
            json!({"id": "chatcmpl-7", "choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{\"a\""}}]}}]}),
            json!({"id": "chatcmpl-7", "choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}, "finish_reason": "tool_calls"}]}),
            json!({"id": "chatcmpl-7", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}),
        ] {
            let data = chunk.to_string();
            let d = crate::node::exchange::read_chunk(&data)
                .expect("no error")
                .expect("a chunk");
            text.push_str(&live.chunk(&d));
        }
        text.push_str(&live.end(&decided("accepted")));
        let evs = events(&text);
        let types: Vec<&str> = evs.iter().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(
            types,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        for (i, e) in evs.iter().enumerate() {
            assert_eq!(e["sequence_number"], i as u64);
        }
        let done = &evs[14]["response"];
        assert_eq!(done["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(done["output"][1]["arguments"], "{\"a\":1}");
        assert_eq!(done["usage"]["total_tokens"], 8);
        assert_eq!(done["oam"]["outcome"], "accepted");
    }

    #[test]
    fn a_live_stream_oam_does_not_accept_ends_failed() {
        let mut live = Live::default();
        let chunk = json!({"id": "c", "choices": [{"delta": {"content": "par"}}]});
        let data = chunk.to_string();
        let d = crate::node::exchange::read_chunk(&data)
            .expect("no error")
            .expect("a chunk");
        let mut text = live.chunk(&d);
        text.push_str(&live.end(&decided("rejected")));
        let last = events(&text).pop().expect("events");
        assert_eq!(last["type"], "response.failed");
        assert_eq!(last["response"]["status"], "failed");
        assert_eq!(last["response"]["error"]["code"], "STREAM_ENDED_WITH_ERROR");
        assert!(
            !text.contains("response.completed"),
            "a cut answer never ends cleanly"
        );
    }
}
