//! What a front door hands an upstream and gets back, in the one form both sides read: the
//! client's request (`Passthrough`: its typed turns and what oam passes on unread), one attempt's outcome with the upstream's body
//! (`Attempt`, `Reply`), and chat-completion JSON as the answer's form: whole, as stream chunks
//! (`read_chunk`), and its usage. Client APIs (`openai`, `anthropic`, `responses`,
//! `embeddings`) and upstream APIs (`upstream`) both use this module and never each other.

use crate::core::request::{Generation, Usage};
use serde_json::{Value, json};

/// What a client sent, for the upstream: its turns (`node::model`: text, image parts, tool calls
/// and results; a chat turn kept as it came) and every other field under chat's names (tools,
/// tool choice, sampling parameters, `user`, `metadata`, unknown future fields), as sent.
#[derive(Clone, Debug, Default)]
pub struct Passthrough {
    pub turns: Vec<crate::node::model::Turn>,
    pub extra: serde_json::Map<String, Value>,
    /// The client's `tools`, as sent.
    pub tools: Option<Box<serde_json::value::RawValue>>,
    /// The client asked for the usage chunk of a stream (`stream_options.include_usage`).
    pub include_usage: bool,
    /// A Messages request as it came, for a Messages target (it uses what only Messages
    /// carries; the request is bound to such targets): sent as it is, answered as it is.
    pub native: Option<Value>,
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

/// A whole chat completion as the two chunks a stream of it carries: everything the message
/// says (its content, its tool calls as deltas that carry their position), then its finish
/// reason.
pub(crate) fn chunks_of(answer: &Value) -> [Value; 2] {
    let head = |choices: Value| {
        json!({
            "id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
            "model": answer["model"], "choices": choices,
        })
    };
    let choice = &answer["choices"][0];
    let mut delta = json!({"role": "assistant", "content": choice["message"]["content"]});
    if let Some(calls) = choice["message"]["tool_calls"].as_array() {
        let indexed: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut c = c.clone();
                c["index"] = json!(i);
                c
            })
            .collect();
        delta["tool_calls"] = Value::Array(indexed);
    }
    [
        head(json!([{"index": 0, "delta": delta, "finish_reason": null}])),
        head(json!([{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}])),
    ]
}

/// A whole chat completion as the events (`data:` payloads) a stream of it would carry: its
/// two chunks, a usage chunk when the caller asked for one (`stream_options.include_usage`),
/// then `[DONE]`.
pub(crate) fn events_of(answer: &Value, include_usage: bool) -> Vec<String> {
    let [content, finish] = chunks_of(answer);
    let mut events = vec![content.to_string(), finish.to_string()];
    if include_usage {
        let mut u = finish;
        u["choices"] = json!([]);
        u["usage"] = answer["usage"].clone();
        events.push(u.to_string());
    }
    events.push("[DONE]".into());
    events
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

/// `u` as a chat completion's `usage` (what `usage_of` reads back).
pub(crate) fn usage_json(u: &Usage) -> Value {
    let mut v = json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    });
    if u.cached_tokens > 0 {
        v["prompt_tokens_details"] = json!({"cached_tokens": u.cached_tokens});
    }
    if u.cache_write_tokens > 0 {
        v["cache_creation_input_tokens"] = json!(u.cache_write_tokens);
    }
    if u.reasoning_tokens > 0 {
        v["completion_tokens_details"] = json!({"reasoning_tokens": u.reasoning_tokens});
    }
    v
}

/// What one chunk of an upstream's stream says.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Delta<'a> {
    pub text: Option<&'a str>,
    /// The tool-call deltas (`[{index, function: {name, arguments}}]`), or null.
    pub tool_calls: Option<&'a Value>,
    pub finish: Option<&'a str>,
    pub usage: Option<Usage>,
    /// A chunk with no choices: only usage (sent when the caller asked for it).
    pub usage_only: bool,
}

/// An error event in a stream, with what it says.
#[derive(Debug, thiserror::Error)]
#[error("the stream says: {0}")]
pub(crate) struct ErrorEvent(pub Value);

/// Read one chunk of a stream; an error event is `Err`.
pub(crate) fn read_chunk(chunk: &Value) -> Result<Delta<'_>, ErrorEvent> {
    if let Some(err) = chunk.get("error") {
        return Err(ErrorEvent(err.clone()));
    }
    let choice = &chunk["choices"][0];
    Ok(Delta {
        text: choice["delta"]["content"].as_str(),
        tool_calls: choice["delta"].get("tool_calls").filter(|t| t.is_array()),
        finish: choice["finish_reason"].as_str(),
        usage: chunk.get("usage").filter(|u| u.is_object()).map(usage_of),
        usage_only: chunk["choices"].as_array().is_some_and(Vec::is_empty),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

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
        let events = events_of(&completion(), true);
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
        let read: Vec<Delta> = chunks
            .iter()
            .map(|c| read_chunk(c).expect("a chunk"))
            .collect();
        assert_eq!(read[0].text, Some("hi"));
        let calls = read[0]
            .tool_calls
            .and_then(Value::as_array)
            .expect("tool calls");
        let at: Vec<(u64, &str)> = calls
            .iter()
            .map(|c| {
                (
                    c["index"].as_u64().unwrap_or(99),
                    c["function"]["name"].as_str().unwrap_or(""),
                )
            })
            .collect();
        assert_eq!(at, [(0, "a"), (1, "b")], "each call carries its position");
        assert_eq!((read[1].finish, read[1].text), (Some("tool_calls"), None));
        assert!(read[2].usage_only);
        assert_eq!(read[2].usage.map(|u| u.prompt_tokens), Some(4));
        for c in &chunks {
            assert_eq!(
                (&c["id"], &c["object"], &c["model"]),
                (&json!("c1"), &json!("chat.completion.chunk"), &json!("m"))
            );
        }
        assert_eq!(
            events_of(&completion(), false).len(),
            3,
            "no usage chunk unasked"
        );
    }

    #[test]
    fn an_error_event_breaks_the_stream() {
        let why = read_chunk(&json!({"error": {"message": "overloaded"}})).expect_err("an error");
        assert_eq!(why.0["message"], "overloaded");
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
