//! The OpenAI embeddings surface (`POST /v1/embeddings`): the request decoded into the core's
//! request (its input's text as one user message, which prices its reservation and feeds loop
//! detection; `embeddings` set, so only embedding targets serve it and no contract applies),
//! the rest of it passed to the upstream as it came. The upstream's list comes back with the
//! `oam` object; refusals are in OpenAI's envelope.

use super::{BadRequest, Decoded, bad, member, object_of};
use crate::core::request::Request;
use crate::node::config::NodeConfig;
use crate::node::exchange::Passthrough;
use crate::node::model::{Speaker, Turn};
use axum::http::HeaderMap;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::Value;

/// The most inputs one request may embed (OpenAI's own limit).
pub(crate) const MAX_INPUTS: usize = 2048;

/// `input` as OpenAI takes it: a string, strings, a token array or token arrays.
#[derive(Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<InputItem>),
    Other(IgnoredAny),
}

/// One item of an `input` array (only which shape it has is read of a number or a token
/// array).
#[derive(Deserialize)]
#[serde(untagged)]
#[expect(
    dead_code,
    reason = "the numbers are read for their shape, not their values"
)]
enum InputItem {
    Text(String),
    /// A token id: the array is one token array.
    Token(u64),
    /// A number that is no token id.
    Number(f64),
    Tokens(Vec<u64>),
    /// An array that is not all token ids.
    NotTokens(Vec<IgnoredAny>),
    Other(IgnoredAny),
}

/// The text of `input` (none when it is missing or null), checked as OpenAI checks it: nothing
/// empty, at most `MAX_INPUTS`. A token array reads as that many words (for the estimate of its
/// prompt tokens).
fn input_text(input: Option<Input>) -> Result<String, BadRequest> {
    let no_tokens = "a token array must hold at least one token id (a whole number)";
    let tokens = |n: usize| "tok ".repeat(n);
    let items = match input {
        None => return Err(bad("input", "input: Field required")),
        Some(Input::Text(s)) if s.is_empty() => {
            return Err(bad("input", "input must not be an empty string"));
        }
        Some(Input::Text(s)) => return Ok(s),
        Some(Input::Other(_)) => {
            return Err(bad(
                "input",
                "input must be a string, an array of strings, or token arrays",
            ));
        }
        Some(Input::Items(items)) => items,
    };
    if items.is_empty() {
        return Err(bad("input", "input must hold at least one item"));
    }
    if items.len() > MAX_INPUTS {
        let why = format!(
            "input: at most {MAX_INPUTS} items per request; this one has {}",
            items.len()
        );
        return Err(bad("input", why));
    }
    if matches!(items[0], InputItem::Token(_) | InputItem::Number(_)) {
        if !items.iter().all(|i| matches!(i, InputItem::Token(_))) {
            return Err(bad("input", format!("input: {no_tokens}")));
        }
        return Ok(tokens(items.len()));
    }
    let mut text = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        match item {
            InputItem::Text(s) if !s.is_empty() => text.push(s),
            InputItem::Tokens(t) if !t.is_empty() => text.push(tokens(t.len())),
            InputItem::Tokens(_) | InputItem::NotTokens(_) => {
                return Err(bad(
                    format!("input[{i}]"),
                    format!("input[{i}]: {no_tokens}"),
                ));
            }
            _ => {
                return Err(bad(
                    format!("input[{i}]"),
                    format!("input[{i}] must be a non-empty string or a token array"),
                ));
            }
        }
    }
    Ok(text.join("\n"))
}

/// An embeddings request as the core's request (`model`, the `oam` object and the `X-OAM-*`
/// headers mean what they mean in chat) and what goes to the upstream.
pub(crate) fn decode(
    cfg: &NodeConfig,
    body: &[u8],
    h: &HeaderMap,
    new_id: impl FnOnce() -> String,
) -> Result<(Request, bool, Passthrough), BadRequest> {
    let mut m = object_of(body)?;
    let model = match m.remove("model") {
        Some(Value::String(s)) => s,
        Some(_) => return Err(bad("model", "model must be a string")),
        None => return Err(bad("model", "model: Field required")),
    };
    let input = m.get("input").filter(|i| !i.is_null());
    let input = input.map(|i| Input::deserialize(i).unwrap_or(Input::Other(IgnoredAny)));
    let text = input_text(input)?;
    if let Some(f) = m.get("encoding_format")
        && !matches!(f.as_str(), Some("float" | "base64"))
    {
        return Err(bad(
            "encoding_format",
            "encoding_format must be \"float\" or \"base64\"",
        ));
    }
    if let Some(d) = m.get("dimensions")
        && d.as_u64().is_none_or(|d| d < 1)
    {
        return Err(bad(
            "dimensions",
            "dimensions must be a whole number of at least 1",
        ));
    }
    let decoded = Decoded {
        model: Some(model),
        turns: vec![Turn::text(Speaker::User, text)],
        sampling: Default::default(),
        max_tokens: None,
        response_format: None,
        stream: false,
        include_usage: false,
        oam: m.remove("oam").map(|o| member(o, "oam")).transpose()?,
        tools: None,
        extra: serde_json::Map::new(),
    };
    let (mut request, _, _) = decoded.into_request(cfg, h, new_id)?;
    request.embeddings = true;
    // Nothing is generated: the reservation prices the input alone.
    request.max_tokens = Some(0);
    request.bound_to = None;
    let pass = Passthrough {
        turns: Vec::new(),
        sampling: Default::default(),
        extra: m,
        tools: None,
        include_usage: false,
        native: None,
    };
    Ok((request, false, pass))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg() -> NodeConfig {
        NodeConfig::parse("test", "", "http://127.0.0.1:1").unwrap()
    }

    fn decoded(body: Value) -> Result<(Request, Passthrough), BadRequest> {
        decode(
            &cfg(),
            body.to_string().as_bytes(),
            &HeaderMap::new(),
            || "r1".into(),
        )
        .map(|(r, _, p)| (r, p))
    }

    #[test]
    fn an_embeddings_request_is_priced_on_its_input_and_passed_on_as_it_came() {
        let (r, p) = decoded(json!({"model": "auto", "input": ["one", "two"],
            "dimensions": 8, "user": "u", "oam": {"agent": "retriever"}}))
        .unwrap();
        assert!(r.embeddings && r.contract.is_none());
        assert_eq!((r.agent.as_str(), r.max_tokens), ("retriever", Some(0)));
        assert_eq!(r.messages[0].content, "one\ntwo");
        assert_eq!(
            Value::Object(p.extra),
            json!({"input": ["one", "two"], "dimensions": 8, "user": "u"})
        );
        let (r, _) = decoded(json!({"model": "auto", "input": [[1, 2, 3]]})).unwrap();
        assert_eq!(r.messages[0].content.split_whitespace().count(), 3);
    }

    #[test]
    fn bad_input_is_refused_naming_its_field() {
        let cases = [
            (json!({"input": "x"}), "model"),
            (json!({"model": "auto"}), "input"),
            (json!({"model": "auto", "input": ""}), "input"),
            (json!({"model": "auto", "input": []}), "input"),
            (json!({"model": "auto", "input": ["a", 5]}), "input[1]"),
            (json!({"model": "auto", "input": ["a", []]}), "input[1]"),
            (json!({"model": "auto", "input": [1, -2]}), "input"),
            (json!({"model": "auto", "input": [[1.5]]}), "input[0]"),
            (json!({"model": "auto", "input": {"text": "x"}}), "input"),
            (json!({"model": "auto", "input": null}), "input"),
            (
                json!({"model": "auto", "input": "x", "dimensions": 0}),
                "dimensions",
            ),
            (
                json!({"model": "auto", "input": "x", "encoding_format": "hex"}),
                "encoding_format",
            ),
            (json!({"model": "gpt-9", "input": "x"}), "model"),
            (
                json!({"model": "auto", "input": vec!["a"; MAX_INPUTS + 1]}),
                "input",
            ),
        ];
        for (body, param) in cases {
            let e = decoded(body.clone())
                .err()
                .unwrap_or_else(|| panic!("{body}"));
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }
}
