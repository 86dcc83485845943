//! The chat-completions wire, which OpenAI-compatible servers and chat agents on the mesh
//! speak and the Messages upstream translates from: the request body oam sends (the client's
//! own fields as they came, then what oam sets) and the completion it reads back (borrowed from
//! its bytes in the usual shape, as a tree otherwise).

use super::super::exchange::{Attempt, Passthrough, Reply, usage_of};
use super::UpstreamCall;
use crate::core::request::{Generation, GenerationStatus, Message};
use crate::node::model::{Sampling, Speaker, Turn};
use serde_json::Value;

/// The upstream request: the client's own fields (which never include the ones below: oam
/// reads those), then what oam sets.
#[derive(serde::Serialize)]
pub(super) struct Body<'a> {
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub extra: Option<&'a serde_json::Map<String, Value>>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<&'a Sampling>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<&'a serde_json::value::RawValue>,
    pub model: &'a str,
    pub messages: Messages<'a>,
    pub max_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_format: Option<&'a Value>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
}

/// What oam asks of a stream: its usage, always (the pipeline prices the answer by it).
#[derive(serde::Serialize)]
pub(super) struct StreamOptions {
    pub include_usage: bool,
}

pub(super) enum Messages<'a> {
    AsSent(&'a [Turn]),
    Core(&'a [Message]),
    /// As sent, and the answer so far as an assistant message to continue (a prefill).
    Prefilled(&'a [Turn], Turn),
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

impl<'a> Body<'a> {
    /// A whole answer's request: the client's as it came (`ask.pass`), with the target's model
    /// and oam's token limit, or just the messages (a probe). Serialised from borrows: the
    /// client's request is not copied for each attempt.
    pub(super) fn whole(ask: &UpstreamCall<'a>) -> Body<'a> {
        Body {
            extra: ask.pass.map(|p| &p.extra),
            sampling: ask.pass.map(|p| &p.sampling),
            tools: ask.pass.and_then(|p| p.tools.as_deref()),
            model: ask.model,
            messages: match ask.pass {
                Some(p) => Messages::AsSent(&p.turns),
                None => Messages::Core(ask.messages),
            },
            max_tokens: ask.max_tokens,
            response_format: ask.response_format,
            stream: false,
            stream_options: None,
        }
    }

    /// A stream's request: the client's as it came, continuing `prefill` (the answer so far)
    /// as a trailing assistant message when given.
    pub(super) fn streamed(
        model: &'a str,
        pass: &'a Passthrough,
        prefill: Option<&str>,
        max_tokens: u32,
    ) -> Body<'a> {
        Body {
            extra: Some(&pass.extra),
            sampling: Some(&pass.sampling),
            tools: pass.tools.as_deref(),
            model,
            messages: match prefill {
                Some(text) => {
                    Messages::Prefilled(&pass.turns, Turn::text(Speaker::Assistant, text))
                }
                None => Messages::AsSent(&pass.turns),
            },
            max_tokens,
            response_format: None,
            stream: true,
            stream_options: None,
        }
    }
}

/// The parts of a chat completion oam reads, borrowed from its bytes (everything else is
/// skipped unread). Where a part has another shape, this fails and the completion is read as
/// a tree instead, with the same leniency as before.
mod wire {
    use serde::{Deserialize, Deserializer};
    use std::borrow::Cow;

    #[derive(Deserialize)]
    pub(crate) struct Completion<'a> {
        #[serde(borrow)]
        pub choices: Vec<Choice<'a>>,
        /// Present (even as `null`) or not.
        #[serde(default, deserialize_with = "present")]
        pub usage: Option<Option<Usage>>,
        #[serde(default, deserialize_with = "present")]
        pub oam: Option<serde::de::IgnoredAny>,
    }

    #[derive(Deserialize)]
    pub(crate) struct Choice<'a> {
        #[serde(default, borrow)]
        pub finish_reason: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub message: Option<Message<'a>>,
    }

    #[derive(Deserialize)]
    pub(crate) struct Message<'a> {
        #[serde(default, borrow)]
        pub content: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub tool_calls: Option<Vec<ToolCall<'a>>>,
    }

    #[derive(Deserialize)]
    pub(crate) struct ToolCall<'a> {
        #[serde(default, borrow)]
        pub function: Option<Function<'a>>,
    }

    #[derive(Deserialize)]
    pub(crate) struct Function<'a> {
        #[serde(default, borrow)]
        pub name: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        pub arguments: Option<Cow<'a, str>>,
    }

    #[derive(Deserialize, Default)]
    pub(crate) struct Usage {
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
    pub(crate) struct PromptDetails {
        #[serde(default)]
        pub cached_tokens: Option<u64>,
    }

    #[derive(Deserialize, Default)]
    pub(crate) struct CompletionDetails {
        #[serde(default)]
        pub reasoning_tokens: Option<u64>,
    }

    impl Usage {
        pub(crate) fn counted(self) -> crate::core::request::Usage {
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
        agent_usage: None,
    };
    Some(Attempt {
        generation,
        body: Some(Reply::Completion(bytes.clone())),
        http_status: 200,
    })
}

/// Read a chat completion body into a `Generation`, keeping the body.
pub(super) fn completion(bytes: &bytes::Bytes, latency_ms: u64) -> Attempt {
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
    let usage = v.get("usage").map(usage_of);
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
        agent_usage: None,
    };
    Attempt {
        generation,
        body: Some(Reply::Json(v)),
        http_status: 200,
    }
}

/// The tool calls of an answer's message (`[{function: {name, arguments}}]`).
fn tool_calls(calls: &Value) -> Vec<crate::core::contract::ToolCall> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
