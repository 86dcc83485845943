//! `oam sim`: simulated upstream providers behind a real OpenAI-compatible HTTP API (chat
//! completions and Responses) and Anthropic's Messages API, with fault modes switchable at
//! runtime. `model` is the pure part (what a provider answers); `server` is the HTTP surface;
//! `messages` and `responses` its shapes of those two APIs.

pub(crate) mod messages;
pub(crate) mod model;
pub(crate) mod responses;
pub(crate) mod server;
pub(crate) mod tools;

/// The text of a string, or of content parts or blocks (their `text`, joined by spaces).
fn text_of(content: &serde_json::Value) -> String {
    use serde_json::Value;
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// A request the simulator refuses, in the words the API it speaks would use.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct NotServed(pub String);

impl From<String> for NotServed {
    fn from(why: String) -> NotServed {
        NotServed(why)
    }
}

/// A `--provider` or fault setting the simulator cannot take: what is wrong with it.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct BadSetting(pub String);

impl From<String> for BadSetting {
    fn from(why: String) -> BadSetting {
        BadSetting(why)
    }
}

impl From<&str> for NotServed {
    fn from(why: &str) -> NotServed {
        NotServed(why.into())
    }
}

impl From<&str> for BadSetting {
    fn from(why: &str) -> BadSetting {
        BadSetting(why.into())
    }
}
