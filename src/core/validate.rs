//! Whether the pipeline can judge a request at all: the checks `Engine::begin` runs first,
//! each failure naming the request field at fault.

use super::contract::Contract;
use super::request::Request;

/// A request the pipeline cannot judge: the field at fault (as named in [`Request`]) and why.
#[derive(Clone, PartialEq, Debug)]
pub struct InvalidRequest {
    pub field: &'static str,
    pub message: String,
}

impl std::fmt::Display for InvalidRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

pub(super) fn invalid(field: &'static str, message: impl Into<String>) -> InvalidRequest {
    InvalidRequest {
        field,
        message: message.into(),
    }
}

/// Reject requests the pipeline cannot judge, naming the field. Returns the request's own
/// contract, if it brings one.
pub fn validate(r: &Request) -> Result<Option<Contract>, InvalidRequest> {
    if r.id.trim().is_empty() {
        return Err(invalid("id", "request.id must not be empty"));
    }
    if r.agent.trim().is_empty() {
        return Err(invalid("agent", "request.agent must not be empty"));
    }
    // What a caller names itself and its request by reaches operators' terminals and logs
    // (`oam audit`, `oam explain`, `oam watch`): no escape sequence or line break rides along.
    let named = [
        ("id", r.id.as_str()),
        ("agent", r.agent.as_str()),
        ("task", r.task.as_str()),
        ("model", r.model.as_deref().unwrap_or_default()),
    ];
    if let Some((field, _)) = named.iter().find(|(_, v)| v.chars().any(char::is_control)) {
        return Err(invalid(
            field,
            format!("request.{field} must not hold control characters (escapes, line breaks)"),
        ));
    }
    if r.messages.is_empty() {
        return Err(invalid(
            "messages",
            "request.messages must hold at least one message",
        ));
    }
    if let Some(c) = r.max_cost_usd
        && !(c.is_finite() && c >= 0.0)
    {
        return Err(invalid(
            "max_cost_usd",
            format!("request.max_cost_usd must be a non-negative number, got {c}"),
        ));
    }
    if let Some(c) = r.policy.min_confidence
        && !(0.0..=1.0).contains(&c)
    {
        return Err(invalid(
            "policy.min_confidence",
            format!("request.policy.min_confidence must be in [0, 1], got {c}"),
        ));
    }
    r.tools
        .checked()
        .map_err(|e| invalid("tools", e.to_string()))?;
    if r.policy.max_attempts == Some(0) {
        return Err(invalid(
            "policy.max_attempts",
            "request.policy.max_attempts must be at least 1",
        ));
    }
    // Plain text asks for no contract.
    let response_format = r
        .response_format
        .as_ref()
        .filter(|rf| rf.get("type").and_then(serde_json::Value::as_str) != Some("text"));
    if r.contract.is_none() && response_format.is_none() {
        return Ok(None);
    }
    Contract::for_request(r.contract.as_ref(), response_format)
        .map(Some)
        .map_err(|e| invalid(e.field(), format!("request.{e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_with_control_characters_are_refused_naming_the_field() {
        let ok = crate::core::pipeline::tests::req("r1");
        assert!(validate(&ok).is_ok());
        let with = |f: fn(&mut Request)| {
            let mut r = ok.clone();
            f(&mut r);
            validate(&r).expect_err("refused").field
        };
        assert_eq!(with(|r| r.id = "r1\u{1b}[2J".into()), "id");
        assert_eq!(with(|r| r.agent = "bob\nforged line".into()), "agent");
        assert_eq!(with(|r| r.task = "t\r".into()), "task");
        assert_eq!(with(|r| r.model = Some("m\u{7}".into())), "model");
        // Any other text is a name: unicode, spaces, punctuation.
        let mut fine = ok.clone();
        fine.agent = "équipe support / bot 2".into();
        assert!(validate(&fine).is_ok());
    }
}
