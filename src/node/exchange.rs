//! What a front door hands an upstream and gets back, in the one form both sides read: the
//! client's request (`Passthrough`: its typed turns and what oam passes on unread), one attempt's outcome with the upstream's body
//! (`Attempt`, `Reply`), and chat-completion JSON as the answer's form: whole, as stream chunks
//! (`read_chunk`), and its usage. Client APIs (`openai`, `anthropic`, `responses`,
//! `embeddings`) and upstream APIs (`upstream`) both use this module and never each other.

use crate::core::request::{Generation, Usage};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use std::borrow::Cow;

/// What a client sent, for the upstream: its turns (`node::model`: text, image parts, tool calls
/// and results; a chat turn kept as it came) and every other field under chat's names (tools,
/// tool choice, sampling parameters, `user`, `metadata`, unknown future fields), as sent.
#[derive(Clone, Debug, Default)]
pub(crate) struct Passthrough {
    pub turns: Vec<crate::node::model::Turn>,
    pub sampling: crate::node::model::Sampling,
    pub extra: serde_json::Map<String, Value>,
    /// The client's `tools`, as sent.
    pub tools: Option<Box<serde_json::value::RawValue>>,
    /// The client asked for the usage chunk of a stream (`stream_options.include_usage`).
    pub include_usage: bool,
    /// A Messages request as it came, for a Messages target (it uses what only Messages
    /// carries; the request is bound to such targets): sent as it is, answered as it is.
    pub native: Option<Box<RawValue>>,
}

/// One attempt's outcome: the generation the pipeline judges, and the upstream's body as it
/// came with its HTTP status (an accepted answer, or a content-policy refusal, passes it on with
/// oam's object added).
pub(crate) struct Attempt {
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
pub(crate) enum Reply {
    /// A JSON object with a `choices` array and no `oam` member, as the upstream sent it.
    Completion(bytes::Bytes),
    /// Any other JSON: an error body, a completion of another shape.
    Json(Value),
}

impl Reply {
    /// The body's JSON text.
    pub(crate) fn text(&self) -> Cow<'_, str> {
        match self {
            Reply::Completion(b) => String::from_utf8_lossy(b),
            Reply::Json(v) => v.to_string().into(),
        }
    }

    /// The body as a JSON tree (parsed again for a completion: only the rare paths that
    /// rewrite it ask).
    pub(crate) fn value(&self) -> Option<Value> {
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
pub(crate) fn set_member(object: &[u8], name: &str, value: &[u8]) -> Vec<u8> {
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
pub(crate) fn with_member(object: &[u8], name: &str, value: &[u8]) -> Vec<u8> {
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

/// The token counts of an answer's `usage`: prompt and completion tokens, and of them those
/// read from the cache (`prompt_tokens_details.cached_tokens`), written to it
/// (`cache_creation_input_tokens`) and spent reasoning
/// (`completion_tokens_details.reasoning_tokens`).
pub(crate) fn usage_of(u: &Value) -> Usage {
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    Usage {
        prompt_tokens: n(&u["prompt_tokens"]),
        completion_tokens: n(&u["completion_tokens"]),
        cached_tokens: n(&u["prompt_tokens_details"]["cached_tokens"]),
        cache_write_tokens: n(&u["cache_creation_input_tokens"]),
        reasoning_tokens: n(&u["completion_tokens_details"]["reasoning_tokens"]),
    }
}

/// A JSON object's members in order, each kept as its own JSON text: nothing is built of a
/// member until it is read as what it must be. Fails on text that is no JSON object.
pub(crate) fn members_of(text: &str) -> serde_json::Result<Members<'_>> {
    struct Visit;
    impl<'de> serde::de::Visitor<'de> for Visit {
        type Value = Members<'de>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut m: A,
        ) -> Result<Members<'de>, A::Error> {
            let mut out = Vec::new();
            while let Some((Key(k), v)) = m.next_entry()? {
                out.push((k, v));
            }
            Ok(out)
        }
    }
    /// A member's name, borrowed unless it holds escapes.
    struct Key<'de>(std::borrow::Cow<'de, str>);
    impl<'de> Deserialize<'de> for Key<'de> {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Key<'de>, D::Error> {
            struct Name;
            impl<'de> serde::de::Visitor<'de> for Name {
                type Value = Key<'de>;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a member name")
                }
                fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Key<'de>, E> {
                    Ok(Key(s.into()))
                }
                fn visit_str<E>(self, s: &str) -> Result<Key<'de>, E> {
                    Ok(Key(s.to_string().into()))
                }
            }
            d.deserialize_str(Name)
        }
    }
    serde::Deserializer::deserialize_map(&mut serde_json::Deserializer::from_str(text), Visit)
}

/// An object's members as `members_of` reads them.
pub(crate) type Members<'a> = Vec<(std::borrow::Cow<'a, str>, &'a RawValue)>;

/// A usage as a chat completion writes it (what `usage_of` and `usage_in` read back): the
/// details only where they count something.
#[derive(Serialize, Debug, Clone, Copy)]
pub(crate) struct ChatUsage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_tokens_details: Option<CachedTokens>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_creation_input_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    completion_tokens_details: Option<ReasoningTokens>,
}

#[derive(Serialize, Debug, Clone, Copy)]
struct CachedTokens {
    cached_tokens: u64,
}

#[derive(Serialize, Debug, Clone, Copy)]
struct ReasoningTokens {
    reasoning_tokens: u64,
}

impl From<Usage> for ChatUsage {
    fn from(u: Usage) -> ChatUsage {
        let some = |n: u64| (n > 0).then_some(n);
        ChatUsage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: some(u.cached_tokens).map(|n| CachedTokens { cached_tokens: n }),
            cache_creation_input_tokens: some(u.cache_write_tokens),
            completion_tokens_details: some(u.reasoning_tokens).map(|n| ReasoningTokens {
                reasoning_tokens: n,
            }),
        }
    }
}

/// The `id`, `created` and `model` a chat chunk names, as the upstream wrote them (`null`
/// where it left one out): oam's own last chunk repeats them, and other APIs' events name the
/// answer by them.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct Head<'a> {
    pub id: Option<&'a RawValue>,
    pub created: Option<&'a RawValue>,
    pub model: Option<&'a RawValue>,
}

/// A `Head` kept past its chunk.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct OwnedHead {
    pub id: Option<Box<RawValue>>,
    pub created: Option<Box<RawValue>>,
    pub model: Option<Box<RawValue>>,
}

impl Head<'_> {
    pub(crate) fn to_owned(self) -> OwnedHead {
        OwnedHead {
            id: self.id.map(RawValue::to_owned),
            created: self.created.map(RawValue::to_owned),
            model: self.model.map(RawValue::to_owned),
        }
    }

    /// The id, when it is a string.
    pub(crate) fn id(&self) -> Option<Cow<'_, str>> {
        str_of(self.id)
    }

    /// It names a model (a string).
    pub(crate) fn names_model(&self) -> bool {
        str_of(self.model).is_some()
    }
}

/// One tool call's piece in a chunk (`{index, id, function: {name, arguments}}`).
#[derive(Debug, Default)]
pub(crate) struct CallDelta<'a> {
    /// Its position among the answer's calls.
    pub index: u64,
    pub id: Option<&'a RawValue>,
    pub name: Option<Cow<'a, str>>,
    pub arguments: Option<Cow<'a, str>>,
}

impl<'a> CallDelta<'a> {
    /// A tool call (or its piece) read from its text, leniently; at `position` in a whole
    /// answer, else where its `index` says.
    fn read(raw: &'a RawValue, position: Option<u64>) -> CallDelta<'a> {
        let c: CallIn = lenient(Some(raw));
        let f: FunctionIn = lenient(c.function);
        CallDelta {
            index: position.unwrap_or_else(|| u64_of(c.index).unwrap_or(0)),
            id: c.id,
            name: str_of(f.name),
            arguments: str_of(f.arguments),
        }
    }
}

/// What one chunk of an upstream's stream says, borrowed from its text.
#[derive(Debug, Default)]
pub(crate) struct Delta<'a> {
    pub head: Head<'a>,
    pub text: Option<Cow<'a, str>>,
    pub tool_calls: Vec<CallDelta<'a>>,
    pub finish: Option<Cow<'a, str>>,
    pub usage: Option<Usage>,
    /// The `usage` object as it came.
    pub usage_sent: Option<&'a RawValue>,
    /// A chunk with no choices: only usage (sent when the caller asked for it).
    pub usage_only: bool,
}

/// An error event in a stream, with what it says (its JSON).
#[derive(Debug, thiserror::Error)]
#[error("the stream says: {0}")]
pub(crate) struct ErrorEvent(pub String);

/// A JSON string, borrowed from its text unless it holds escapes.
#[derive(Deserialize)]
struct Str<'a>(#[serde(borrow)] Cow<'a, str>);

/// JSON text that is a string: the string.
pub(crate) fn str_of(raw: Option<&RawValue>) -> Option<Cow<'_, str>> {
    raw.and_then(|r| serde_json::from_str::<Str>(r.get()).ok())
        .map(|s| s.0)
}

/// JSON text that is a whole number: the number.
fn u64_of(raw: Option<&RawValue>) -> Option<u64> {
    raw.and_then(|r| serde_json::from_str(r.get()).ok())
}

/// An object's members, each as its text (`null` for one not there or of another shape).
macro_rules! members {
    ($name:ident { $($field:ident),* }) => {
        #[derive(Deserialize, Default)]
        #[serde(default)]
        struct $name<'a> {
            $(#[serde(borrow)] $field: Option<&'a RawValue>,)*
        }
    };
}

members!(ChunkIn {
    id,
    created,
    model,
    choices,
    usage,
    error
});
members!(ChoiceIn {
    delta,
    finish_reason
});
members!(DeltaIn {
    content,
    tool_calls
});
members!(CallIn {
    index,
    id,
    function
});
members!(FunctionIn { name, arguments });
members!(UsageIn {
    prompt_tokens,
    completion_tokens,
    prompt_tokens_details,
    cache_creation_input_tokens,
    completion_tokens_details
});
members!(PromptDetailsIn { cached_tokens });
members!(CompletionDetailsIn { reasoning_tokens });

/// JSON text read as `T`; where it has another shape, `T`'s default.
pub(crate) fn lenient<'a, T: Deserialize<'a> + Default>(raw: Option<&'a RawValue>) -> T {
    raw.and_then(|r| serde_json::from_str(r.get()).ok())
        .unwrap_or_default()
}

/// The token counts of a chat `usage` object: prompt and completion tokens, and of them those
/// read from the cache (`prompt_tokens_details.cached_tokens`), written to it
/// (`cache_creation_input_tokens`) and spent reasoning
/// (`completion_tokens_details.reasoning_tokens`). `None` when it is no object.
pub(crate) fn usage_in(raw: &RawValue) -> Option<Usage> {
    let u: UsageIn = serde_json::from_str(raw.get()).ok()?;
    let prompt: PromptDetailsIn = lenient(u.prompt_tokens_details);
    let completion: CompletionDetailsIn = lenient(u.completion_tokens_details);
    Some(Usage {
        prompt_tokens: u64_of(u.prompt_tokens).unwrap_or(0),
        completion_tokens: u64_of(u.completion_tokens).unwrap_or(0),
        cached_tokens: u64_of(prompt.cached_tokens).unwrap_or(0),
        cache_write_tokens: u64_of(u.cache_creation_input_tokens).unwrap_or(0),
        reasoning_tokens: u64_of(completion.reasoning_tokens).unwrap_or(0),
    })
}

/// A chat completion as every writer of an answer reads it, borrowed from its text: its head,
/// what its first choice says, and the members passed on as they came (`usage`, `oam`).
#[derive(Debug, Default)]
pub(crate) struct Completion<'a> {
    pub head: Head<'a>,
    /// The message's content (`None` where it is null).
    pub text: Option<Cow<'a, str>>,
    /// Its tool calls, each at its position.
    pub calls: Vec<CallDelta<'a>>,
    pub finish: Option<Cow<'a, str>>,
    pub usage: Option<Usage>,
    pub usage_sent: Option<&'a RawValue>,
    pub oam: Option<&'a RawValue>,
}

members!(CompletionIn {
    id,
    created,
    model,
    choices,
    usage,
    oam
});
members!(AnswerChoiceIn {
    message,
    finish_reason
});
members!(AnswerMessageIn {
    content,
    tool_calls
});

/// Read a chat completion from its text, leniently (a part of another shape reads as
/// missing); `None` for text that is no JSON object.
pub(crate) fn read_completion(text: &str) -> Option<Completion<'_>> {
    let c: CompletionIn = serde_json::from_str(text).ok()?;
    let choices: Vec<&RawValue> = lenient(c.choices);
    let choice: AnswerChoiceIn = lenient(choices.first().copied());
    let message: AnswerMessageIn = lenient(choice.message);
    let calls: Vec<&RawValue> = lenient(message.tool_calls);
    let usage = c.usage.and_then(usage_in);
    Some(Completion {
        head: Head {
            id: c.id,
            created: c.created,
            model: c.model,
        },
        text: str_of(message.content),
        calls: calls
            .into_iter()
            .enumerate()
            .map(|(i, call)| CallDelta::read(call, Some(i as u64)))
            .collect(),
        finish: str_of(choice.finish_reason),
        usage,
        usage_sent: c.usage.filter(|_| usage.is_some()),
        oam: c.oam,
    })
}

/// A chat chunk as oam writes one.
#[derive(Serialize)]
pub(crate) struct ChunkOut<'a> {
    pub id: Option<&'a RawValue>,
    pub object: &'static str,
    pub created: Option<&'a RawValue>,
    pub model: Option<&'a RawValue>,
    pub choices: &'a [ChoiceOut<'a>],
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageOut<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oam: Option<&'a RawValue>,
}

impl<'a> ChunkOut<'a> {
    /// A chunk under `head` with these choices, and nothing else.
    pub(crate) fn of(head: Head<'a>, choices: &'a [ChoiceOut<'a>]) -> ChunkOut<'a> {
        ChunkOut {
            id: head.id,
            object: "chat.completion.chunk",
            created: head.created,
            model: head.model,
            choices,
            usage: None,
            oam: None,
        }
    }

    pub(crate) fn text(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// A usage in a chunk: counted by oam, or as the upstream sent it.
#[derive(Serialize)]
#[serde(untagged)]
pub(crate) enum UsageOut<'a> {
    Counted(ChatUsage),
    Sent(&'a RawValue),
}

#[derive(Serialize)]
pub(crate) struct ChoiceOut<'a> {
    pub index: u32,
    pub delta: DeltaOut<'a>,
    pub finish_reason: Option<&'a str>,
}

/// What a chunk adds: members left out are not in it.
#[derive(Serialize, Default)]
pub(crate) struct DeltaOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<CallOut<'a>>>,
}

#[derive(Serialize)]
pub(crate) struct CallOut<'a> {
    pub index: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<Option<&'a RawValue>>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionOut<'a>,
}

#[derive(Serialize)]
pub(crate) struct FunctionOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<Option<&'a str>>,
    pub arguments: Option<&'a str>,
}

impl<'a> CallOut<'a> {
    /// A whole call (its id, type and name with its arguments so far).
    pub(crate) fn whole(c: &'a CallDelta<'a>) -> CallOut<'a> {
        CallOut {
            index: c.index,
            id: Some(c.id),
            kind: Some("function"),
            function: FunctionOut {
                name: Some(c.name.as_deref()),
                arguments: c.arguments.as_deref(),
            },
        }
    }
}

impl Completion<'_> {
    /// The chunk that carries everything the message says: its content, its tool calls as
    /// deltas that carry their position.
    pub(crate) fn content_choice(&self) -> ChoiceOut<'_> {
        ChoiceOut {
            index: 0,
            delta: DeltaOut {
                role: Some("assistant"),
                content: Some(self.text.as_deref()),
                tool_calls: (!self.calls.is_empty())
                    .then(|| self.calls.iter().map(CallOut::whole).collect()),
            },
            finish_reason: None,
        }
    }

    /// The chunk that carries its finish reason.
    pub(crate) fn finish_choice(&self) -> ChoiceOut<'_> {
        ChoiceOut {
            index: 0,
            delta: DeltaOut::default(),
            finish_reason: self.finish.as_deref(),
        }
    }
}

/// A whole chat completion as the events (`data:` payloads) a stream of it would carry: its
/// content, its finish reason, a usage chunk when the caller asked for one
/// (`stream_options.include_usage`), then `[DONE]`.
pub(crate) fn events_of(answer: &Completion, include_usage: bool) -> Vec<String> {
    let content = [answer.content_choice()];
    let finish = [answer.finish_choice()];
    let mut events = vec![
        ChunkOut::of(answer.head, &content).text(),
        ChunkOut::of(answer.head, &finish).text(),
    ];
    if include_usage {
        let mut u = ChunkOut::of(answer.head, &[]);
        u.usage = answer.usage_sent.map(UsageOut::Sent);
        events.push(u.text());
    }
    events.push("[DONE]".into());
    events
}

/// Read one chunk of a stream from its data: what it says (nothing, for JSON that is no
/// object), `Ok(None)` for data that is no JSON, an error event as `Err`.
pub(crate) fn read_chunk(data: &str) -> Result<Option<Delta<'_>>, ErrorEvent> {
    let chunk: ChunkIn = match serde_json::from_str(data) {
        Ok(chunk) => chunk,
        Err(_) if serde_json::from_str::<serde::de::IgnoredAny>(data).is_ok() => {
            return Ok(Some(Delta::default()));
        }
        Err(_) => return Ok(None),
    };
    if let Some(error) = chunk.error {
        return Err(ErrorEvent(error.get().to_string()));
    }
    let choices: Option<Vec<&RawValue>> = chunk
        .choices
        .and_then(|c| serde_json::from_str(c.get()).ok());
    let choice: ChoiceIn = lenient(choices.as_ref().and_then(|c| c.first().copied()));
    let delta: DeltaIn = lenient(choice.delta);
    let calls: Option<Vec<&RawValue>> = delta
        .tool_calls
        .and_then(|t| serde_json::from_str(t.get()).ok());
    let tool_calls = calls
        .unwrap_or_default()
        .into_iter()
        .map(|c| CallDelta::read(c, None))
        .collect();
    let usage = chunk.usage.and_then(usage_in);
    Ok(Some(Delta {
        head: Head {
            id: chunk.id,
            created: chunk.created,
            model: chunk.model,
        },
        text: str_of(delta.content),
        tool_calls,
        finish: str_of(choice.finish_reason),
        usage,
        usage_sent: chunk.usage.filter(|_| usage.is_some()),
        usage_only: choices.is_some_and(|c| c.is_empty()),
    }))
}

/// A tool's definition as its server gave it (MCP's `Tool`): oam reads its name, schemas and
/// annotations, and passes the rest on as it came.
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(transparent)]
pub(crate) struct ToolDefinition(serde_json::Value);

impl ToolDefinition {
    /// Its name, if it has one (a definition without is not served).
    pub(crate) fn name(&self) -> Option<&str> {
        self.0["name"].as_str()
    }

    pub(crate) fn description(&self) -> &str {
        self.0["description"].as_str().unwrap_or("")
    }

    /// The schema its arguments must fit.
    pub(crate) fn input_schema(&self) -> Option<&serde_json::Value> {
        self.0.get("inputSchema").filter(|s| s.is_object())
    }

    /// The schema its structured results must fit, if it declares one.
    pub(crate) fn output_schema(&self) -> Option<&serde_json::Value> {
        self.0.get("outputSchema").filter(|s| s.is_object())
    }

    /// Safe to call twice (its annotations say it is idempotent, or only reads).
    pub(crate) fn idempotent(&self) -> bool {
        let a = &self.0["annotations"];
        a["idempotentHint"] == true || a["readOnlyHint"] == true
    }

    /// Its canonical JSON (members in name order): what its hash is of.
    pub(crate) fn canonical(&self) -> String {
        self.0.to_string()
    }

    /// As listed under `name`, its hash in `_meta.oam.definition_hash` (what `[[mcp_server]]
    /// pins` takes to pin it).
    pub(crate) fn listed_as(&self, name: &str, hash: u64) -> ToolDefinition {
        let mut d = self.0.clone();
        d["name"] = name.into();
        if !d["_meta"].is_object() {
            d["_meta"] = serde_json::json!({});
        }
        d["_meta"]["oam"] = serde_json::json!({"definition_hash": format!("{hash:016x}")});
        ToolDefinition(d)
    }

    /// A mesh agent's, as a tool taking any object.
    pub(crate) fn of_agent(name: &str, description: &str, idempotent: bool) -> ToolDefinition {
        ToolDefinition(serde_json::json!({
            "name": name,
            "description": description,
            "inputSchema": {"type": "object"},
            "annotations": {"idempotentHint": idempotent},
        }))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// A chat completion with text, two tool calls, usage and an `oam` object.
    pub(crate) fn completion() -> Value {
        json!({
            "id": "c1", "object": "chat.completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "hi",
                "tool_calls": [
                    {"id": "t0", "type": "function", "function": {"name": "a", "arguments": "{}"}},
                    {"id": "t1", "type": "function", "function": {"name": "b", "arguments": "[1]"}}
                ]
            }}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
            "oam": {"request_id": "r"}
        })
    }

    #[test]
    fn a_whole_answer_streams_as_chunks_that_read_back_to_it() {
        let text = completion().to_string();
        let answer = read_completion(&text).expect("a completion");
        let events = events_of(&answer, true);
        assert_eq!(
            events.len(),
            4,
            "content, finish, usage, [DONE]: {events:?}"
        );
        assert_eq!(events[3], "[DONE]");
        let chunks: Vec<Value> = events[..3]
            .iter()
            .map(|e| serde_json::from_str(e).expect("JSON"))
            .collect();
        let read: Vec<Delta> = events[..3]
            .iter()
            .map(|c| read_chunk(c).expect("no error").expect("a chunk"))
            .collect();
        assert_eq!(read[0].text.as_deref(), Some("hi"));
        let at: Vec<(u64, &str)> = read[0]
            .tool_calls
            .iter()
            .map(|c| (c.index, c.name.as_deref().unwrap_or("")))
            .collect();
        assert_eq!(at, [(0, "a"), (1, "b")], "each call carries its position");
        assert_eq!(
            (read[1].finish.as_deref(), read[1].text.as_deref()),
            (Some("tool_calls"), None)
        );
        assert!(read[2].usage_only);
        assert_eq!(read[2].usage.map(|u| u.prompt_tokens), Some(4));
        for c in &chunks {
            assert_eq!(
                (&c["id"], &c["object"], &c["model"]),
                (&json!("c1"), &json!("chat.completion.chunk"), &json!("m"))
            );
        }
        assert_eq!(events_of(&answer, false).len(), 3, "no usage chunk unasked");
    }

    #[test]
    fn a_chunk_of_odd_shape_reads_as_far_as_it_goes() {
        assert!(
            matches!(read_chunk("{cut"), Ok(None)),
            "no JSON: unreadable"
        );
        let empty = read_chunk("42").expect("no error").expect("JSON");
        assert!(empty.text.is_none() && empty.tool_calls.is_empty() && !empty.usage_only);
        let data = r#"{"id": 7, "choices": [{"delta": {"content": "a\"b\u00e9",
            "tool_calls": {"index": 0}}, "finish_reason": 3}], "usage": null}"#;
        let d = read_chunk(data).expect("no error").expect("a chunk");
        assert_eq!(d.text.as_deref(), Some("a\"b\u{e9}"), "escapes read");
        assert!(
            d.tool_calls.is_empty(),
            "tool calls that are no array are none"
        );
        assert_eq!((d.finish, d.usage, d.head.id()), (None, None, None));
        assert_eq!(d.head.id.map(RawValue::get), Some("7"), "the id as it came");
        let data = json!({"choices": [{"delta": {"tool_calls": [
            {"index": "x", "function": {"name": "f", "arguments": 5}}]}}],
            "usage": {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}})
        .to_string();
        let d = read_chunk(&data).expect("no error").expect("a chunk");
        let call = &d.tool_calls[0];
        assert_eq!(
            (call.index, call.name.as_deref(), call.arguments.as_deref()),
            (0, Some("f"), None)
        );
        let u = d.usage.expect("usage");
        assert_eq!(
            (u.prompt_tokens, u.cached_tokens, u.completion_tokens),
            (2, 1, 0)
        );
        assert_eq!(
            d.usage_sent.map(RawValue::get),
            Some(r#"{"prompt_tokens":2,"prompt_tokens_details":{"cached_tokens":1}}"#)
        );
    }

    #[test]
    fn an_error_event_breaks_the_stream() {
        let data = json!({"error": {"message": "overloaded"}}).to_string();
        let why = read_chunk(&data).expect_err("an error");
        assert_eq!(why.0, r#"{"message":"overloaded"}"#);
        assert!(why.to_string().contains("overloaded"), "{why}");
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
}
