//! What a caller asks for (the request, its risk, priority and policy), the providers that can
//! answer, and what a generation attempt returned. Plain data; no behaviour beyond defaults.

use super::contract::ContractSpec;
use serde::{Deserialize, Serialize};

/// How bad a wrong answer would be.
#[derive(
    Serialize, Deserialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum Risk {
    #[default]
    Low,
    Medium,
    High,
}

/// The API an upstream speaks. A request is translated to whichever its target speaks, unless
/// it uses a feature the other API has no equivalent for: then it is bound to its own.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// OpenAI's chat completions (and every OpenAI-compatible server).
    #[default]
    Openai,
    /// Anthropic's Messages API.
    Anthropic,
    /// A Model Context Protocol server's tools: a request bound to it is one tool call.
    Mcp,
}

impl Api {
    pub fn is_openai(&self) -> bool {
        *self == Api::Openai
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Api::Openai => "openai",
            Api::Anthropic => "anthropic",
            Api::Mcp => "mcp",
        }
    }
}

/// The bulkhead class; `critical` also marks a critical task for escalation.
#[derive(
    Serialize, Deserialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    Critical,
    #[default]
    Normal,
    Background,
}

impl Risk {
    pub const ALL: [Risk; 3] = [Risk::Low, Risk::Medium, Risk::High];

    pub fn as_str(self) -> &'static str {
        match self {
            Risk::Low => "low",
            Risk::Medium => "medium",
            Risk::High => "high",
        }
    }

    pub fn from_name(name: &str) -> Option<Risk> {
        Risk::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::Critical, Priority::Normal, Priority::Background];

    pub fn from_name(name: &str) -> Option<Priority> {
        Priority::ALL.into_iter().find(|p| p.as_str() == name)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::Normal => "normal",
            Priority::Background => "background",
        }
    }
}

#[derive(Serialize, Deserialize, Clone, PartialEq, Eq, Hash, Debug)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// Per-request overrides of the defaults.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields, default)]
pub struct Policy {
    /// May a fallback provider serve this request?
    pub allow_fallback: bool,
    /// Total attempts, overriding the risk level's default.
    pub max_attempts: Option<u32>,
    /// Quality threshold, overriding the risk level's default.
    pub min_confidence: Option<f64>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            allow_fallback: true,
            max_attempts: None,
            min_confidence: None,
        }
    }
}

/// The agent name of a caller that did not say who it is (`oam.agent`, `X-OAM-Agent`). Such
/// callers are not one agent: loop detection, which counts one caller's identical failing calls,
/// never lumps them together.
pub(crate) const ANONYMOUS: &str = "anonymous";

#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Request {
    pub id: String,
    pub agent: String,
    #[serde(default)]
    pub task: String,
    /// The team of the client whose key it bears (`[[client]] team`): its budget covers it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// The model the caller asked for (part of the loop fingerprint; routing picks the provider).
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub risk: Risk,
    #[serde(default)]
    pub priority: Priority,
    /// Safe to run twice? A non-idempotent request that timed out is never retried.
    #[serde(default = "yes")]
    pub idempotent: bool,
    /// p95 a provider must meet to earn the latency bonus (default from config).
    #[serde(default)]
    pub latency_budget_ms: Option<u64>,
    /// Hard cost limit for this request.
    #[serde(default)]
    pub max_cost_usd: Option<f64>,
    /// Completion tokens to ask for (default from config); also the cost estimate's basis.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Answers asked for at once (OpenAI's `n`): each is billed, so a reservation prices all.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub n: u32,
    #[serde(default)]
    pub policy: Policy,
    /// oam's own contract form.
    #[serde(default)]
    pub contract: Option<ContractSpec>,
    /// OpenAI's `response_format`; a `json_schema` here becomes the contract.
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    /// The tools the request declared. Tool calls in the answer are checked against them.
    /// Shared: a request is copied on its way (session, record, attempts), and requests that
    /// declare the same tools share one set (a node reads each distinct list once). In a run
    /// of records (`record::in_a_run`) a set written before is written as its number.
    #[serde(
        default,
        skip_serializing_if = "no_tools",
        with = "super::record::tools_in_run"
    )]
    pub tools: std::sync::Arc<Tools>,
    /// Only targets of this API may serve it: it uses a feature (a parameter, a part) that a
    /// translation to the other would drop. Bound to `mcp`, it is a tool call: its `model`
    /// names the tool server, its one message the call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_to: Option<Api>,
    /// A tool call's: the revision of the caller's tool allowlist it was allowed under (none:
    /// the caller is held to no list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_allowlist: Option<String>,
    /// It asks for embeddings of its input (the messages hold the input's text): served only
    /// by embedding targets, and no answer text to hold to a contract.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub embeddings: bool,
    /// The caller asked for a stream: it is admitted to the streams' bulkheads.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
}

impl Request {
    /// It is one call of a tool (on the server its `model` names), not a model's answer.
    pub fn is_tool_call(&self) -> bool {
        self.bound_to == Some(Api::Mcp)
    }
}

fn yes() -> bool {
    true
}

fn no_model() -> TargetId {
    "".into()
}

/// A provider's id or model name: shared, so the many decisions and events that name a provider
/// copy a pointer, not the string.
pub(crate) type TargetId = std::sync::Arc<str>;

/// A target: one model on one upstream (a provider), the unit that is routed to, and whose
/// health, breaker and cool-down are kept. With one model per provider the target is named by
/// the provider's id. (On the wire, in records and snapshots, targets are still listed under
/// `providers` and named `provider`: those names stay, so old records read and replay.)
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Target {
    pub id: TargetId,
    /// The upstream's name for the model (what the request's `model` becomes).
    #[serde(default = "no_model")]
    pub model: TargetId,
    /// Price per 1,000 prompt tokens, and completion tokens too unless `output_cost_per_1k_usd`
    /// says otherwise. 0 (with no output price) makes it a zero-cost target.
    #[serde(default)]
    pub cost_per_1k_tokens_usd: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_cost_per_1k_usd: Option<f64>,
    /// Per 1,000 prompt tokens read from the upstream's cache (else the prompt price).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input_cost_per_1k_usd: Option<f64>,
    /// Per 1,000 prompt tokens written to its cache (else the prompt price).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_cost_per_1k_usd: Option<f64>,
    /// Per 1,000 completion tokens spent reasoning (else the completion price).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_cost_per_1k_usd: Option<f64>,
    #[serde(default)]
    pub fallback: bool,
    /// Prompt plus completion tokens the model takes at most (unknown: no limit assumed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window: Option<u64>,
    /// Does it continue an assistant message given as the last one (a prefill)?
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub prefill: bool,
    /// The API its upstream speaks.
    #[serde(default, skip_serializing_if = "Api::is_openai")]
    pub api: Api,
    /// It serves embeddings (and only embeddings requests).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub embeddings: bool,
    /// Price of each call, whatever its tokens (a tool server's price per call).
    #[serde(default, skip_serializing_if = "is_free")]
    pub cost_per_call_usd: f64,
}

fn is_free(usd: &f64) -> bool {
    *usd == 0.0
}

impl Target {
    pub fn is_zero_cost(&self) -> bool {
        self.cost_per_1k_tokens_usd <= 0.0
            && self.output_cost_per_1k_usd.unwrap_or(0.0) <= 0.0
            && self.cost_per_call_usd <= 0.0
    }

    /// It is a tool server: only tool calls go to it, and tool calls go nowhere else.
    pub fn serves_tools(&self) -> bool {
        self.api == Api::Mcp
    }

    /// Cost of `prompt` and `completion` tokens, rounded to a nano-dollar so sums print cleanly
    /// and compare exactly.
    pub fn cost_of(&self, prompt: u64, completion: u64) -> f64 {
        self.cost_of_usage(&Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            ..Usage::default()
        })
    }

    /// Cost of what an upstream reported: prompt tokens at the prompt price but those read
    /// from or written to its cache at theirs, completion tokens at the completion price but
    /// those spent reasoning at theirs (cached, written and reasoning tokens are counted within
    /// the prompt and completion totals, as upstreams report them).
    pub fn cost_of_usage(&self, u: &Usage) -> f64 {
        let input = self.cost_per_1k_tokens_usd;
        let output = self.output_cost_per_1k_usd.unwrap_or(input);
        let cached = u.cached_tokens.min(u.prompt_tokens);
        let written = u.cache_write_tokens.min(u.prompt_tokens - cached);
        let reasoning = u.reasoning_tokens.min(u.completion_tokens);
        let plain_in = (u.prompt_tokens - cached - written) as f64;
        let plain_out = (u.completion_tokens - reasoning) as f64;
        // Each term is 0.0 when its tokens are, so a usage without them costs exactly what
        // the prompt and completion prices alone say (old records replay to the same cost).
        let total = input * plain_in
            + self.cached_input_cost_per_1k_usd.unwrap_or(input) * cached as f64
            + self.cache_write_cost_per_1k_usd.unwrap_or(input) * written as f64
            + output * plain_out
            + self.reasoning_cost_per_1k_usd.unwrap_or(output) * reasoning as f64;
        round_usd(total / 1_000.0 + self.cost_per_call_usd)
    }
}

/// `model` without a trailing `-YYYY-MM-DD`, `-YYYYMMDD` or `-latest`, if it has one.
pub(crate) fn undated_model(model: &str) -> Option<&str> {
    if let Some(base) = model.strip_suffix("-latest") {
        return Some(base);
    }
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (base, last) = model.rsplit_once('-')?;
    if last.len() == 8 && digits(last) {
        return Some(base);
    }
    // -YYYY-MM-DD: three dash-separated parts of 4, 2 and 2 digits.
    let mut parts = model.rsplitn(4, '-');
    let (d, m, y, base) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let sized = [(y, 4), (m, 2), (d, 2)];
    sized
        .iter()
        .all(|&(p, n)| p.len() == n && digits(p))
        .then_some(base)
}

/// Round a dollar amount to a nano-dollar.
pub fn round_usd(usd: f64) -> f64 {
    // `+ 0.0` makes a negative zero (an empty sum of floats is one) plain zero, so JSON never
    // says `-0.0`.
    (usd * 1e9).round() / 1e9 + 0.0
}

/// A dollar amount as people read it, to `places` decimals: `$0.0020`. What rounds to zero is
/// `$0.0000`, never `$-0.0000`.
pub(crate) fn dollars(usd: f64, places: usize) -> String {
    let shown = format!("{usd:.places$}");
    match shown.strip_prefix('-') {
        Some(rest) if rest.bytes().all(|b| b == b'0' || b == b'.') => format!("${rest}"),
        Some(rest) => format!("-${rest}"),
        None => format!("${shown}"),
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "snake_case")]
pub enum GenerationStatus {
    /// HTTP 200 with a completion (the contract is checked separately).
    Ok,
    /// 5xx, connection refused or reset, or an unreadable body.
    Error,
    Timeout,
    /// 429.
    RateLimited,
    /// The provider refused the request itself (HTTP 400, 413, 422: invalid, or too large for
    /// it): the caller's doing, not the provider's failure.
    Rejected,
    /// Refused as longer than the model's context window.
    ContextLength,
    /// Refused on content policy (an error, or an answer its content filter cut).
    ContentPolicy,
    /// HTTP 401 or 403: the upstream does not accept oam's credentials.
    Unauthorized,
    /// The node could not make the call for want of its own resources (descriptors, ports,
    /// buffers): the target was never reached.
    LocalResources,
}

impl GenerationStatus {
    /// Its name as JSON spells it (`rate_limited`).
    pub fn as_str(self) -> &'static str {
        match self {
            GenerationStatus::Ok => "ok",
            GenerationStatus::Error => "error",
            GenerationStatus::Timeout => "timeout",
            GenerationStatus::RateLimited => "rate_limited",
            GenerationStatus::Rejected => "rejected",
            GenerationStatus::ContextLength => "context_length",
            GenerationStatus::ContentPolicy => "content_policy",
            GenerationStatus::Unauthorized => "unauthorized",
            GenerationStatus::LocalResources => "local_resources",
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Of the prompt tokens, read from the upstream's cache.
    #[serde(skip_serializing_if = "is_zero")]
    pub cached_tokens: u64,
    /// Of the prompt tokens, written to the upstream's cache.
    #[serde(skip_serializing_if = "is_zero")]
    pub cache_write_tokens: u64,
    /// Of the completion tokens, spent reasoning.
    #[serde(skip_serializing_if = "is_zero")]
    pub reasoning_tokens: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl std::ops::Add for Usage {
    type Output = Usage;

    /// The usage of two parts of one answer (a stream and its continuation) together.
    fn add(self, o: Usage) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens + o.prompt_tokens,
            completion_tokens: self.completion_tokens + o.completion_tokens,
            cached_tokens: self.cached_tokens + o.cached_tokens,
            cache_write_tokens: self.cache_write_tokens + o.cache_write_tokens,
            reasoning_tokens: self.reasoning_tokens + o.reasoning_tokens,
        }
    }
}

/// The tokens an answer's text (and its tool calls' names and arguments) was billed for, when
/// the upstream did not say: four characters a token, rounded up, as prompts are estimated.
pub(crate) fn estimate_answer_tokens(text: &str, tool_calls: &[super::contract::ToolCall]) -> u64 {
    let calls: usize = tool_calls
        .iter()
        .map(|c| c.name.len() + c.arguments.len())
        .sum();
    ((text.len() + calls) as u64).div_ceil(4)
}

/// What one generation attempt returned, as the driver observed it.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Generation {
    pub status: GenerationStatus,
    #[serde(default)]
    pub content: String,
    #[serde(default)]
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub latency_ms: u64,
    /// Token counts; when absent the reservation's estimate is charged.
    #[serde(default)]
    pub usage: Option<Usage>,
    /// From a 429's Retry-After.
    #[serde(default)]
    pub retry_after_ms: Option<u64>,
    /// What went wrong, for humans.
    #[serde(default)]
    pub error: Option<String>,
    /// The tool calls the answer made.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<super::contract::ToolCall>,
    /// A streamed answer's pace: the longer of the time to its first event and its longest
    /// gap between events. Its health is judged by this, not by its whole duration (a long
    /// healthy stream is not a slow target).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pace_ms: Option<u64>,
    /// What a mesh agent said its answer cost it in model use (the Open Agent Mesh
    /// `X-Mesh-Usage` reply header): charged on top of the target's own price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_usage: Option<Box<AgentUsage>>,
}

/// Model use an agent reported for one answer (`X-Mesh-Usage`: every field optional), and
/// what it is charged.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct AgentUsage {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// What it is charged (US dollars): the agent's own estimate when it gave one, else its
    /// tokens at its model's listed price; none when neither is known (nothing is charged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usd: Option<f64>,
}

impl AgentUsage {
    /// What is charged for it (0 when unpriced).
    pub fn charged_usd(&self) -> f64 {
        self.usd
            .filter(|u| u.is_finite() && *u > 0.0)
            .unwrap_or(0.0)
    }
}

impl GenerationStatus {
    /// The upstream refused the request itself (invalid, too long for the model, against its
    /// content policy): the caller's doing, saying nothing of the target's health.
    pub fn is_refusal(self) -> bool {
        matches!(
            self,
            GenerationStatus::Rejected
                | GenerationStatus::ContextLength
                | GenerationStatus::ContentPolicy
        )
    }

    /// The outcome says nothing of the target's health: the request's own doing (a refusal)
    /// or the node's (its resources ran out before the target was reached).
    pub fn says_nothing_of_target(self) -> bool {
        self.is_refusal() || self == GenerationStatus::LocalResources
    }
}

impl Generation {
    pub fn ok(content: impl Into<String>, latency_ms: u64) -> Self {
        Generation {
            status: GenerationStatus::Ok,
            content: content.into(),
            finish_reason: Some("stop".into()),
            latency_ms,
            usage: None,
            retry_after_ms: None,
            error: None,
            tool_calls: Vec::new(),
            pace_ms: None,
            agent_usage: None,
        }
    }

    pub fn failed(status: GenerationStatus, latency_ms: u64) -> Self {
        Generation {
            status,
            content: String::new(),
            finish_reason: None,
            latency_ms,
            usage: None,
            retry_after_ms: None,
            error: None,
            tool_calls: Vec::new(),
            pace_ms: None,
            agent_usage: None,
        }
    }
}

fn one() -> u32 {
    1
}

#[expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if takes &T"
)]
fn is_one(n: &u32) -> bool {
    *n == 1
}

/// Whether a request declares no tools (serialized without the field).
fn no_tools(tools: &std::sync::Arc<Tools>) -> bool {
    tools.is_empty()
}

/// A tool's parameter schema as JSON text, as the client wrote it (`null` when it gives none).
pub type Schema = Box<serde_json::value::RawValue>;

/// The tools a request declared: name -> parameter schema, kept as the text it came in (oam
/// reads a schema only to check an answer's call against it), with what each request carrying
/// them would otherwise work out again: their size in JSON (the token estimate) and whether
/// every schema compiles (checked once per set, on first use).
#[derive(Default, Debug)]
pub struct Tools {
    by_name: std::collections::BTreeMap<String, Schema>,
    json_len: usize,
    checked: std::sync::OnceLock<Result<(), BadToolSchema>>,
}

/// A declared tool whose parameters are no JSON Schema: its name, and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("tools: {name}: its parameters are no JSON Schema: {why}")]
pub struct BadToolSchema {
    pub name: String,
    pub why: String,
}

impl Tools {
    pub fn new(by_name: std::collections::BTreeMap<String, Schema>) -> Tools {
        let json_len = by_name.iter().map(|(n, s)| n.len() + s.get().len()).sum();
        Tools {
            by_name,
            json_len,
            checked: std::sync::OnceLock::new(),
        }
    }

    /// The names' and schemas' length in JSON.
    pub fn json_len(&self) -> usize {
        self.json_len
    }

    /// Whether every declared schema is a JSON Schema (checked once per set): the first that
    /// is not, and why.
    pub fn checked(&self) -> Result<(), &BadToolSchema> {
        let first_bad = || {
            for (name, schema) in &self.by_name {
                super::contract::check_tool_schema(schema).map_err(|e| BadToolSchema {
                    name: name.clone(),
                    why: e.to_string(),
                })?;
            }
            Ok(())
        };
        self.checked.get_or_init(first_bad).as_ref().map(|_| ())
    }
}

impl Clone for Tools {
    fn clone(&self) -> Tools {
        Tools::new(self.by_name.clone())
    }
}

impl std::ops::Deref for Tools {
    type Target = std::collections::BTreeMap<String, Schema>;
    fn deref(&self) -> &Self::Target {
        &self.by_name
    }
}

impl PartialEq for Tools {
    fn eq(&self, other: &Tools) -> bool {
        self.by_name.len() == other.by_name.len()
            && self
                .by_name
                .iter()
                .zip(&other.by_name)
                .all(|((a, x), (b, y))| a == b && x.get() == y.get())
    }
}

/// Tools from schemas held as JSON trees (written compactly).
impl FromIterator<(String, serde_json::Value)> for Tools {
    fn from_iter<I: IntoIterator<Item = (String, serde_json::Value)>>(tools: I) -> Tools {
        use serde_json::value::{RawValue, to_raw_value};
        let text =
            |v: serde_json::Value| to_raw_value(&v).unwrap_or_else(|_| RawValue::NULL.to_owned());
        Tools::new(tools.into_iter().map(|(n, v)| (n, text(v))).collect())
    }
}

impl From<std::collections::BTreeMap<String, serde_json::Value>> for Tools {
    fn from(by_name: std::collections::BTreeMap<String, serde_json::Value>) -> Tools {
        by_name.into_iter().collect()
    }
}

impl<const N: usize> From<[(String, serde_json::Value); N]> for Tools {
    fn from(tools: [(String, serde_json::Value); N]) -> Tools {
        tools.into_iter().collect()
    }
}

impl Serialize for Tools {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.by_name.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Tools {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Tools, D::Error> {
        std::collections::BTreeMap::deserialize(d).map(Tools::new)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_status_s_name_is_its_json_name() {
        use super::GenerationStatus as S;
        for s in [
            S::Ok,
            S::Error,
            S::Timeout,
            S::RateLimited,
            S::Rejected,
            S::ContextLength,
            S::ContentPolicy,
            S::Unauthorized,
            S::LocalResources,
        ] {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
    }

    use super::{dollars, round_usd};

    #[test]
    fn amounts_have_no_negative_zero() {
        let none: f64 = std::iter::empty::<f64>().sum();
        assert!(none.is_sign_negative(), "an empty sum of floats is -0.0");
        assert!(round_usd(none).is_sign_positive());
        assert_eq!(serde_json::json!(round_usd(none)).to_string(), "0.0");
        assert_eq!(round_usd(-0.000_000_000_1), 0.0);
        assert!(round_usd(-0.000_000_000_1).is_sign_positive());
        assert_eq!(round_usd(0.123_456_789_9), 0.123_456_79);
    }

    #[test]
    fn dollars_never_show_a_negative_zero() {
        assert_eq!(dollars(-0.0, 4), "$0.0000");
        assert_eq!(dollars(-0.000_01, 4), "$0.0000");
        assert_eq!(dollars(0.002, 4), "$0.0020");
        assert_eq!(dollars(-1.5, 2), "-$1.50");
        assert_eq!(dollars(0.123_456_7, 6), "$0.123457");
    }
}
