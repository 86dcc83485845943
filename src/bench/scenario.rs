//! Scenarios (`scenarios/*.toml`): a load, a timeline of chaos events, and expectations that
//! `oam bench --scenario` checks against what it measured. Parsing, scaling (`--short`) and
//! evaluation are pure: samples and timings in, verdicts out.
//!
//! ```toml
//! name = "provider-outage"
//! description = "primary fails; traffic moves to the zero-cost local path"
//! [load]
//! rate = 20            # requests per second
//! duration = "12s"
//! [[chaos]]
//! at = "3s"
//! fault = "kill-provider"
//! target = "primary"
//! for = "6s"
//! [[expect]]
//! metric = "success_rate"
//! min = 0.99
//! [[expect]]
//! metric = "provider_share"
//! provider = "local"
//! during = "chaos"
//! min = 0.95
//! [[budget]]            # a budget in the cluster's shared ledger for the run
//! agent = "support-bot"
//! limit_usd = 0.5
//! [[expect]]
//! metric = "budget_spent_usd"
//! agent = "support-bot"
//! max = 0.55
//! ```

use super::load::Measurement;
use crate::core::chaos::{Fault, Params, parse_duration};
use crate::core::reason::{Phase, ReasonCode};
use crate::core::request::{Priority, Risk};
use crate::mesh::protocol::ErrorCode;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Deserialize, Serialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub load: Load,
    /// Agents the bench serves for the scenario (stopped at its end).
    #[serde(default)]
    pub agents: Vec<crate::local::agents::AgentSpec>,
    #[serde(default)]
    pub chaos: Vec<ChaosEvent>,
    /// Budgets set in the cluster's shared ledger for the run (spend from zero), removed after.
    #[serde(default, rename = "budget")]
    pub budgets: Vec<BudgetSpec>,
    #[serde(default)]
    pub expect: Vec<Expect>,
    /// How the short form (CI) differs: every time multiplied by `scale`.
    #[serde(default)]
    pub short: Short,
}

#[derive(Deserialize, Serialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct Load {
    /// Requests per second.
    pub rate: f64,
    pub duration: String,
    /// The load starts this long after the scenario (and its chaos clock) starts, e.g. to
    /// measure requests sent into an outage the cluster already knows about.
    #[serde(default)]
    pub after: Option<String>,
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Where requests go: `http` (the nodes' data plane) or `agent` (mesh calls to `agent`).
    #[serde(default = "default_kind")]
    pub kind: String,
    /// Only these nodes (names, e.g. ["n1"]); default all.
    #[serde(default)]
    pub nodes: Vec<String>,
    /// The request kinds, chosen per request by weight (default: one low-risk normal kind).
    #[serde(default)]
    pub mix: Vec<Mix>,
    /// For `kind = "agent"`: the agent called and the per-call timeout.
    #[serde(default)]
    pub agent: Option<String>,
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Ask for streamed answers (HTTP; see `oam bench --stream`).
    #[serde(default)]
    pub stream: bool,
}

fn default_concurrency() -> usize {
    50
}
fn default_kind() -> String {
    "http".into()
}
fn default_timeout_ms() -> u64 {
    30_000
}

#[derive(Deserialize, Serialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct Mix {
    #[serde(default = "one")]
    pub weight: u32,
    #[serde(default)]
    pub risk: Risk,
    #[serde(default)]
    pub priority: Priority,
    #[serde(default = "bench")]
    pub agent: String,
    #[serde(default = "bench")]
    pub task: String,
    /// The request's `max_tokens` (else the pipeline's default, 256): what an attempt reserves
    /// of a budget is priced on it.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// The API it is sent in (HTTP).
    #[serde(default)]
    pub api: Surface,
    /// The model asked for: `auto` (scored routing over every target) or a route's name, e.g.
    /// `json` on the demo mesh (answers held to the JSON contract).
    #[serde(default = "auto")]
    pub model: String,
}

/// Which of a node's HTTP APIs a request is sent in.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Surface {
    /// `POST /v1/chat/completions`.
    #[default]
    Chat,
    /// `POST /v1/messages` (Anthropic's Messages API).
    Messages,
    /// `POST /v1/responses` (OpenAI's Responses API).
    Responses,
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /mcp`: one `tools/call` of the tool `model` names (e.g. `tools__lookup`).
    Mcp,
}

impl Surface {
    pub(crate) fn path(self) -> &'static str {
        match self {
            Surface::Chat => "/v1/chat/completions",
            Surface::Messages => "/v1/messages",
            Surface::Responses => "/v1/responses",
            Surface::Embeddings => "/v1/embeddings",
            Surface::Mcp => "/mcp",
        }
    }

    pub(crate) fn from_name(name: &str) -> Option<Surface> {
        serde_json::from_value(serde_json::Value::String(name.to_ascii_lowercase())).ok()
    }
}

fn one() -> u32 {
    1
}
fn bench() -> String {
    "bench".into()
}

fn auto() -> String {
    "auto".into()
}

impl Default for Mix {
    fn default() -> Mix {
        Mix {
            weight: 1,
            risk: Risk::Low,
            priority: Priority::Normal,
            agent: bench(),
            task: bench(),
            max_tokens: None,
            api: Surface::Chat,
            model: auto(),
        }
    }
}

#[derive(Deserialize, Serialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChaosEvent {
    pub at: String,
    pub fault: Fault,
    #[serde(default)]
    pub target: Option<String>,
    #[serde(rename = "for")]
    pub for_: String,
    #[serde(default, flatten)]
    pub params: Params,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct Short {
    #[serde(default)]
    pub scale: Option<f64>,
}

/// Which requests an expectation looks at, by start time.
#[derive(Deserialize, Serialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum StartWindow {
    #[default]
    All,
    /// Requests that finished before the first fault.
    Before,
    /// From the first injection to the last expiry.
    Chaos,
    /// After the last expiry.
    After,
}

#[derive(Deserialize, Serialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct Expect {
    pub metric: Metric,
    #[serde(default)]
    pub during: StartWindow,
    /// The target measured (`provider_share`, `recovery_to_primary_ms`); `target` works too,
    /// the core's name for it.
    #[serde(default, alias = "target")]
    pub provider: Option<String>,
    /// A reason code (`reason_count`, `cluster_reason_count`) or a mesh error code
    /// (`error_count`), checked against the valid ones when the file is read.
    #[serde(default)]
    pub code: Option<String>,
    #[serde(default)]
    pub phase: Option<Phase>,
    #[serde(default)]
    pub priority: Option<Priority>,
    /// The agent whose `[[budget]]` is measured (`budget_spent_usd`).
    #[serde(default)]
    pub agent: Option<String>,
    #[serde(default)]
    pub min: Option<f64>,
    #[serde(default)]
    pub max: Option<f64>,
}

/// `[[budget]]`: an agent's budget in the shared ledger while the scenario runs.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct BudgetSpec {
    pub agent: String,
    pub limit_usd: f64,
}

/// What can be expected.
#[derive(Deserialize, Serialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Metric {
    /// Share of requests answered 200 (agent calls: answered without error).
    SuccessRate,
    /// Failed requests (count).
    Failed,
    /// Share of answered requests served by `provider` (also spelled `target_share`).
    #[serde(alias = "target_share")]
    ProviderShare,
    /// Requests whose reasons include `code` (count).
    ReasonCount,
    /// Requests that ended in `phase` (count), optionally only of `priority`.
    PhaseCount,
    /// Latency percentiles over the window, in ms.
    P50Ms,
    P95Ms,
    P99Ms,
    /// Across every node's `/metrics`: how much `code` grew during the run (includes requests
    /// the bench did not send, e.g. chaos load).
    ClusterReasonCount,
    /// Agent calls that failed with error `code` (e.g. agent_died).
    ErrorCount,
    /// For calls that failed with `agent_died`: the time from the fault's injection to the
    /// caller's error, worst case (ms).
    DeathDetectMs,
    /// Per fault: the time from injection until requests stop failing, worst case (ms).
    RecoveryMs,
    /// Per fault: the time from its end until a request is served by `provider` again, worst
    /// case (ms); the rest of the run when none is.
    RecoveryToPrimaryMs,
    /// What the cluster's shared ledger charged `agent`'s `[[budget]]` over the run, once every
    /// hold has settled (USD).
    BudgetSpentUsd,
}

/// A scenario file that cannot be run: what is wrong with it (the field named).
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct BadScenario(pub String);

impl From<String> for BadScenario {
    fn from(why: String) -> BadScenario {
        BadScenario(why)
    }
}

impl Scenario {
    pub(crate) fn parse(text: &str) -> Result<Scenario, BadScenario> {
        let s: Scenario = toml::from_str(text).map_err(|e| BadScenario(e.to_string()))?;
        s.check()?;
        Ok(s)
    }

    fn check(&self) -> Result<(), BadScenario> {
        parse_duration(&self.load.duration).map_err(|e| format!("load.duration: {e}"))?;
        if let Some(after) = &self.load.after {
            offset(after).map_err(|e| format!("load.after: {e}"))?;
        }
        if !(self.load.rate.is_finite() && self.load.rate > 0.0) {
            return Err(BadScenario(
                "load.rate must be a positive number of requests per second".into(),
            ));
        }
        if !["http", "agent"].contains(&self.load.kind.as_str()) {
            return Err(BadScenario(format!(
                "load.kind {:?}: use http or agent",
                self.load.kind
            )));
        }
        if self.load.kind == "agent" && self.load.agent.is_none() {
            return Err(BadScenario(
                "load.kind = \"agent\" needs load.agent (the agent to call)".into(),
            ));
        }
        if self.load.stream && self.load.mix.iter().any(|m| m.api != Surface::Chat) {
            return Err(BadScenario(
                "load.stream: streamed answers are read as chat chunks; the mix's api must be chat"
                    .into(),
            ));
        }
        for m in &self.load.mix {
            if !["low", "medium", "high"].contains(&m.risk.as_str()) {
                return Err(BadScenario(format!(
                    "load.mix risk {:?}: use low, medium or high",
                    m.risk
                )));
            }
            if !["critical", "normal", "background"].contains(&m.priority.as_str()) {
                return Err(BadScenario(format!(
                    "load.mix priority {:?}: use critical, normal or background",
                    m.priority
                )));
            }
        }
        let requests = self.load.rate * self.duration().as_secs_f64();
        if requests > MAX_REQUESTS {
            return Err(BadScenario(format!(
                "load: rate x duration is {requests:.0} requests; at most {MAX_REQUESTS:.0}"
            )));
        }
        for (i, c) in self.chaos.iter().enumerate() {
            offset(&c.at).map_err(|e| format!("chaos[{i}].at: {e}"))?;
            let d = parse_duration(&c.for_).map_err(|e| format!("chaos[{i}].for: {e}"))?;
            if d > crate::core::chaos::MAX_FOR {
                return Err(BadScenario(format!(
                    "chaos[{i}].for: at most {} s",
                    crate::core::chaos::MAX_FOR.as_secs()
                )));
            }
            if c.fault.default_target().is_none() && c.target.is_none() {
                return Err(BadScenario(format!(
                    "chaos[{i}] ({}) needs a target",
                    c.fault.name()
                )));
            }
        }
        for (i, b) in self.budgets.iter().enumerate() {
            if b.agent.trim().is_empty() {
                return Err(BadScenario(format!("budget[{i}].agent must name an agent")));
            }
            if !(b.limit_usd.is_finite() && b.limit_usd >= 0.0) {
                return Err(BadScenario(format!(
                    "budget[{i}].limit_usd must be an amount, zero or more"
                )));
            }
            if self.budgets[..i].iter().any(|o| o.agent == b.agent) {
                return Err(BadScenario(format!(
                    "budget[{i}]: {} has a budget already",
                    b.agent
                )));
            }
        }
        for (i, e) in self.expect.iter().enumerate() {
            let needs = |field: &str, v: &Option<String>| {
                v.is_none()
                    .then(|| format!("expect[{i}] ({:?}) needs {field}", e.metric))
            };
            let missing = match e.metric {
                Metric::ProviderShare | Metric::RecoveryToPrimaryMs => {
                    needs("provider", &e.provider)
                }
                Metric::ReasonCount | Metric::ClusterReasonCount | Metric::ErrorCount => {
                    needs("code", &e.code)
                }
                Metric::PhaseCount => e
                    .phase
                    .is_none()
                    .then(|| format!("expect[{i}] ({:?}) needs phase", e.metric)),
                Metric::BudgetSpentUsd => needs("agent", &e.agent).or_else(|| {
                    let a = e.agent.as_deref().unwrap_or("");
                    (!self.budgets.iter().any(|b| b.agent == a)).then(|| {
                        format!("expect[{i}].agent {a:?} has no [[budget]] in this scenario")
                    })
                }),
                _ => None,
            };
            if let Some(code) = &e.code {
                let known = match e.metric {
                    Metric::ErrorCount => ErrorCode::ALL.iter().any(|c| c.as_str() == code),
                    _ => ReasonCode::ALL.iter().any(|c| c.as_str() == code),
                };
                if !known {
                    return Err(BadScenario(format!(
                        "expect[{i}].code {code:?} is not a {} (`oam reasons` lists them)",
                        if e.metric == Metric::ErrorCount {
                            "mesh error code"
                        } else {
                            "reason code"
                        }
                    )));
                }
            }
            if let Some(m) = missing {
                return Err(BadScenario(m));
            }
            if e.min.is_none() && e.max.is_none() {
                return Err(BadScenario(format!(
                    "expect[{i}] ({:?}) needs min or max",
                    e.metric
                )));
            }
        }
        Ok(())
    }

    /// The short form: every time multiplied by `short.scale` (default 0.5).
    pub(crate) fn shortened(&self) -> Scenario {
        let k = self.short.scale.unwrap_or(0.5);
        let scale = |d: &str| {
            let ms = parse_duration(d).map_or(0.0, |d| d.as_secs_f64() * 1e3);
            format!("{}ms", (ms * k).round().max(1.0))
        };
        let mut s = self.clone();
        s.load.duration = scale(&s.load.duration);
        s.load.after = s.load.after.as_deref().map(scale);
        for c in &mut s.chaos {
            c.at = scale(&c.at);
            c.for_ = scale(&c.for_);
        }
        s
    }

    pub(crate) fn duration(&self) -> Duration {
        parse_duration(&self.load.duration).unwrap_or_default()
    }

    /// How long after the scenario's start the load begins.
    pub(crate) fn load_after(&self) -> Duration {
        self.load
            .after
            .as_deref()
            .and_then(|a| offset(a).ok())
            .unwrap_or_default()
    }
}

/// The most requests one scenario may send.
const MAX_REQUESTS: f64 = 1_000_000.0;

/// An offset from the scenario's start: a duration, or zero.
fn offset(s: &str) -> Result<Duration, crate::core::chaos::DurationError> {
    match s.trim() {
        "0" | "0s" | "0ms" => Ok(Duration::ZERO),
        _ => parse_duration(s),
    }
}

/// A chaos event's offset and length in ms.
pub(crate) fn event_times(c: &ChaosEvent) -> (u64, u64) {
    let ms = |d: &str| offset(d).map_or(0, |d| d.as_millis() as u64);
    (ms(&c.at), ms(&c.for_))
}

/// What one expectation measured.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub(crate) struct Measured {
    /// e.g. "provider_share(local) during chaos >= 0.95".
    pub expectation: String,
    pub measured: f64,
    pub ok: bool,
}

/// Per fault: time from injection until requests stop failing, and how many failed meanwhile.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub(crate) struct Recovery {
    pub fault: String,
    pub injected_at_ms: u64,
    pub recovery_ms: u64,
    pub failed: usize,
    /// From injection until requests stop paying a retry (they go straight to where they are
    /// served): the reroute time; and how many paid one meanwhile.
    pub reroute_ms: u64,
    pub retried: usize,
}

/// Everything the evaluation needs besides the samples.
pub(crate) struct Run<'a> {
    pub samples: &'a [Measurement],
    /// (injected at, expires at) per chaos event, ms since the load started.
    pub faults: Vec<(String, u64, u64)>,
    /// Growth of each reason code across the nodes' `/metrics` during the run.
    pub cluster_reasons: BTreeMap<String, f64>,
    /// Per `[[budget]]` agent: what the shared ledger charged it over the run (USD).
    pub budgets_spent: BTreeMap<String, f64>,
}

fn failed(s: &Measurement) -> bool {
    s.status != 200
}

impl Run<'_> {
    fn window(&self, w: StartWindow) -> Vec<&Measurement> {
        let first = self.faults.iter().map(|f| f.1).min();
        let last = self.faults.iter().map(|f| f.2).max();
        self.samples
            .iter()
            .filter(|s| {
                let t = s.started_us / 1_000;
                match (w, first, last) {
                    (StartWindow::All, _, _) => true,
                    // Finished before: a request under way at the injection saw either state.
                    (StartWindow::Before, Some(a), _) => (s.started_us + s.latency_us) / 1_000 < a,
                    (StartWindow::Chaos, Some(a), Some(b)) => t >= a && t < b,
                    (StartWindow::After, _, Some(b)) => t >= b,
                    (_, _, _) => w == StartWindow::Before || w == StartWindow::After,
                }
            })
            .collect()
    }

    pub(crate) fn recoveries(&self) -> Vec<Recovery> {
        self.faults
            .iter()
            .map(|(fault, at, until)| {
                let fails: Vec<&Measurement> = self
                    .samples
                    .iter()
                    .filter(|s| {
                        let t = s.started_us / 1_000;
                        failed(s) && t >= *at && t < *until
                    })
                    .collect();
                let last_end = fails
                    .iter()
                    .map(|s| (s.started_us + s.latency_us) / 1_000)
                    .max();
                let retried: Vec<u64> = self
                    .samples
                    .iter()
                    .filter(|s| {
                        let t = s.started_us / 1_000;
                        t >= *at && t < *until && s.reasons.iter().any(|r| r == "RETRY_SCHEDULED")
                    })
                    .map(|s| s.started_us / 1_000)
                    .collect();
                Recovery {
                    fault: fault.clone(),
                    injected_at_ms: *at,
                    recovery_ms: last_end.map_or(0, |e| e.saturating_sub(*at)),
                    failed: fails.len(),
                    reroute_ms: retried.iter().max().map_or(0, |t| t.saturating_sub(*at)),
                    retried: retried.len(),
                }
            })
            .collect()
    }

    fn measure(&self, e: &Expect) -> f64 {
        let w = self.window(e.during);
        let count = |f: &dyn Fn(&Measurement) -> bool| w.iter().filter(|s| f(s)).count() as f64;
        let pct = |q: f64| {
            let mut l: Vec<u64> = w.iter().map(|s| s.latency_us).collect();
            l.sort_unstable();
            if l.is_empty() {
                return 0.0;
            }
            let i = ((q * l.len() as f64).ceil() as usize).clamp(1, l.len()) - 1;
            l[i] as f64 / 1e3
        };
        let code = e.code.as_deref().unwrap_or("");
        match e.metric {
            Metric::SuccessRate => {
                if w.is_empty() {
                    0.0
                } else {
                    count(&|s| !failed(s)) / w.len() as f64
                }
            }
            Metric::Failed => count(&failed),
            Metric::ProviderShare => {
                let answered = count(&|s| !s.provider.is_empty());
                let p = e.provider.as_deref().unwrap_or("");
                if answered == 0.0 {
                    0.0
                } else {
                    count(&|s| s.provider == p) / answered
                }
            }
            Metric::ReasonCount => count(&|s| s.reasons.iter().any(|r| r == code)),
            Metric::PhaseCount => count(&|s| {
                e.phase.is_some_and(|p| s.phase == p.as_str())
                    && e.priority.is_none_or(|p| p == s.priority)
            }),
            Metric::P50Ms => pct(0.50),
            Metric::P95Ms => pct(0.95),
            Metric::P99Ms => pct(0.99),
            Metric::ClusterReasonCount => self.cluster_reasons.get(code).copied().unwrap_or(0.0),
            Metric::BudgetSpentUsd => e
                .agent
                .as_ref()
                .and_then(|a| self.budgets_spent.get(a))
                .copied()
                .unwrap_or(f64::NAN),
            Metric::ErrorCount => count(&|s| s.error.as_deref() == Some(code)),
            Metric::DeathDetectMs => {
                let injected: Vec<u64> = self.faults.iter().map(|f| f.1).collect();
                w.iter()
                    .filter(|s| s.error.as_deref() == Some("agent_died"))
                    .filter_map(|s| {
                        let end = (s.started_us + s.latency_us) as f64 / 1e3;
                        injected
                            .iter()
                            .map(|&t| t as f64)
                            .filter(|&t| t <= end)
                            .map(|t| end - t)
                            .reduce(f64::min)
                    })
                    .fold(0.0, f64::max)
            }
            Metric::RecoveryMs => self
                .recoveries()
                .iter()
                .map(|r| r.recovery_ms as f64)
                .fold(0.0, f64::max),
            Metric::RecoveryToPrimaryMs => {
                let p = e.provider.as_deref().unwrap_or("");
                let end = self
                    .samples
                    .iter()
                    .map(|s| (s.started_us + s.latency_us) / 1_000)
                    .max()
                    .unwrap_or(0);
                self.faults
                    .iter()
                    .map(|&(_, _, until)| {
                        let back = self
                            .samples
                            .iter()
                            .filter(|s| s.provider == p && s.started_us / 1_000 >= until)
                            .map(|s| s.started_us / 1_000)
                            .min()
                            .unwrap_or(end);
                        back.saturating_sub(until) as f64
                    })
                    .fold(0.0, f64::max)
            }
        }
    }

    pub(crate) fn evaluate(&self, expect: &[Expect]) -> Vec<Measured> {
        expect
            .iter()
            .map(|e| {
                let measured = self.measure(e);
                let ok = e.min.is_none_or(|m| measured >= m - 1e-12)
                    && e.max.is_none_or(|m| measured <= m + 1e-12);
                Measured {
                    expectation: describe(e),
                    measured,
                    ok,
                }
            })
            .collect()
    }
}

fn describe(e: &Expect) -> String {
    let metric = serde_json::to_value(e.metric)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default();
    let what = [
        e.provider.clone(),
        e.agent.clone(),
        e.code.clone(),
        e.phase.map(|p| p.as_str().to_string()),
        e.priority.map(|p| p.as_str().to_string()),
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>()
    .join(", ");
    let mut s = if what.is_empty() {
        metric
    } else {
        format!("{metric}({what})")
    };
    if e.during != StartWindow::All {
        let w = serde_json::to_value(e.during).unwrap_or_default();
        s.push_str(&format!(" during {}", w.as_str().unwrap_or("")));
    }
    match (e.min, e.max) {
        (Some(a), Some(b)) if a == b => s.push_str(&format!(" == {a}")),
        (Some(a), Some(b)) => s.push_str(&format!(" in [{a}, {b}]")),
        (Some(a), None) => s.push_str(&format!(" >= {a}")),
        (None, Some(b)) => s.push_str(&format!(" <= {b}")),
        (None, None) => {}
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(
        start_ms: u64,
        ms: u64,
        status: u16,
        provider: &str,
        reasons: &[&str],
    ) -> Measurement {
        Measurement {
            started_us: start_ms * 1_000,
            latency_us: ms * 1_000,
            first_byte_us: None,
            status,
            phase: if status == 200 {
                "accepted"
            } else {
                "generation"
            }
            .into(),
            provider: provider.into(),
            reasons: reasons
                .iter()
                .map(std::string::ToString::to_string)
                .collect(),
            priority: Priority::Normal,
            error: None,
        }
    }

    const OUTAGE: &str = r#"
name = "outage"
[load]
rate = 10
duration = "10s"
[[chaos]]
at = "2s"
fault = "kill-provider"
target = "primary"
for = "4s"
[[expect]]
metric = "success_rate"
min = 0.99
[[expect]]
metric = "provider_share"
provider = "local"
during = "chaos"
min = 0.9
[[expect]]
metric = "reason_count"
code = "FALLBACK_USED"
min = 1
"#;

    #[test]
    fn scenarios_parse_shorten_and_refuse_mistakes_by_name() {
        let s = Scenario::parse(OUTAGE).unwrap();
        assert_eq!(s.chaos[0].fault, Fault::KillProvider);
        let short = s.shortened();
        assert_eq!(short.duration(), Duration::from_secs(5));
        assert_eq!(event_times(&short.chaos[0]), (1_000, 2_000));
        let renamed = OUTAGE
            .replace("metric = \"provider_share\"", "metric = \"target_share\"")
            .replace("provider = \"local\"\n", "target = \"local\"\n");
        let (old, new) = (
            Scenario::parse(OUTAGE).expect("the old names"),
            Scenario::parse(&renamed).expect("the target names"),
        );
        assert_ne!(renamed, OUTAGE);
        assert_eq!(
            format!("{:?}", old.expect),
            format!("{:?}", new.expect),
            "target and target_share read as provider and provider_share"
        );
        let bad = OUTAGE.replace("kill-provider", "melt-provider");
        assert!(
            Scenario::parse(&bad)
                .unwrap_err()
                .0
                .contains("melt-provider")
        );
        let bad = OUTAGE.replace("provider = \"local\"\n", "");
        assert!(
            Scenario::parse(&bad)
                .unwrap_err()
                .0
                .contains("needs provider")
        );
        let bad = OUTAGE.replace("duration = \"10s\"", "duration = \"ten\"");
        assert!(
            Scenario::parse(&bad)
                .unwrap_err()
                .0
                .contains("load.duration")
        );
        let bad = OUTAGE.replace("rate = 10", "rate = 10\nrat = 1");
        assert!(Scenario::parse(&bad).unwrap_err().0.contains("rat"));
        let bad = OUTAGE.replace("target = \"primary\"\n", "");
        assert!(
            Scenario::parse(&bad)
                .unwrap_err()
                .0
                .contains("needs a target")
        );
        let bad = OUTAGE.replace("rate = 10", "rate = 1e6");
        assert!(Scenario::parse(&bad).unwrap_err().0.contains("at most"));
        let bad = OUTAGE.replace("for = \"4s\"", "for = \"90m\"");
        assert!(
            Scenario::parse(&bad)
                .unwrap_err()
                .0
                .contains("at most 3600 s")
        );
        let at_zero = OUTAGE.replace("at = \"2s\"", "at = \"0s\"");
        assert_eq!(
            event_times(&Scenario::parse(&at_zero).unwrap().chaos[0]).0,
            0
        );
    }

    #[test]
    fn budgets_and_their_expectations_are_checked() {
        let with = |extra: &str| format!("{OUTAGE}\n{extra}");
        let ok = with(
            "[[budget]]\nagent = \"a\"\nlimit_usd = 0.5\n\
             [[expect]]\nmetric = \"budget_spent_usd\"\nagent = \"a\"\nmax = 0.6\n",
        );
        let s = Scenario::parse(&ok).unwrap();
        assert_eq!(s.budgets[0].limit_usd, 0.5);
        for (extra, says) in [
            (
                "[[expect]]\nmetric = \"budget_spent_usd\"\nmax = 1\n",
                "needs agent",
            ),
            (
                "[[expect]]\nmetric = \"budget_spent_usd\"\nagent = \"b\"\nmax = 1\n",
                "has no [[budget]]",
            ),
            (
                "[[budget]]\nagent = \"a\"\nlimit_usd = -1\n",
                "budget[0].limit_usd",
            ),
            (
                "[[budget]]\nagent = \"a\"\nlimit_usd = 1\n[[budget]]\nagent = \"a\"\nlimit_usd = 2\n",
                "budget[1]",
            ),
        ] {
            let e = Scenario::parse(&with(extra)).unwrap_err();
            assert!(e.0.contains(says), "{e:?} should say {says:?}");
        }
        // A budget expectation with nothing measured fails rather than passes.
        let run = Run {
            samples: &[],
            faults: Vec::new(),
            cluster_reasons: BTreeMap::new(),
            budgets_spent: BTreeMap::new(),
        };
        assert!(!run.evaluate(&s.expect).last().unwrap().ok);
    }

    #[test]
    fn the_shipped_scenarios_parse() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            let s = Scenario::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(!s.expect.is_empty(), "{} expects nothing", path.display());
            n += 1;
        }
        assert!(n >= 11, "one scenario per row of the failure model");
    }

    #[test]
    fn expectations_are_measured_in_their_window() {
        let s = Scenario::parse(OUTAGE).unwrap();
        let mut samples = vec![sample(0, 150, 200, "primary", &[])];
        samples.push(sample(2_000, 30, 502, "", &["PROVIDER_ERROR"]));
        samples.push(sample(
            2_100,
            40,
            200,
            "local",
            &["RETRY_SCHEDULED", "FALLBACK_USED"],
        ));
        samples.push(sample(3_000, 40, 200, "local", &["FALLBACK_USED"]));
        samples.push(sample(7_000, 150, 200, "primary", &[]));
        let run = Run {
            samples: &samples,
            faults: vec![("kill-provider".into(), 2_000, 6_000)],
            cluster_reasons: BTreeMap::new(),
            budgets_spent: BTreeMap::new(),
        };
        let v = run.evaluate(&s.expect);
        assert_eq!(v[0].measured, 0.8);
        assert!(!v[0].ok, "one failure in five is below 0.99");
        assert_eq!(v[0].expectation, "success_rate >= 0.99");
        assert_eq!(v[1].measured, 1.0, "answered requests during the outage");
        assert!(v[1].ok && v[2].ok);
        assert_eq!(
            v[1].expectation,
            "provider_share(local) during chaos >= 0.9"
        );
        let r = run.recoveries();
        assert_eq!((r[0].recovery_ms, r[0].failed), (30, 1));
        assert_eq!((r[0].reroute_ms, r[0].retried), (100, 1));
    }

    #[test]
    fn recovery_to_primary_is_the_first_primary_answer_after_each_fault() {
        let expect = |provider: &str| Expect {
            metric: Metric::RecoveryToPrimaryMs,
            during: StartWindow::All,
            provider: Some(provider.into()),
            agent: None,
            code: None,
            phase: None,
            priority: None,
            min: None,
            max: Some(3_000.0),
        };
        let samples = vec![
            sample(0, 150, 200, "primary", &[]),
            sample(3_000, 40, 200, "local", &[]),
            sample(6_500, 40, 200, "local", &[]),
            sample(7_200, 150, 200, "primary", &[]),
            sample(9_000, 150, 200, "primary", &[]),
        ];
        let run = Run {
            samples: &samples,
            faults: vec![("kill-provider".into(), 2_000, 6_000)],
            cluster_reasons: BTreeMap::new(),
            budgets_spent: BTreeMap::new(),
        };
        let v = run.evaluate(&[expect("primary"), expect("secondary")]);
        assert_eq!(v[0].measured, 1_200.0);
        assert!(v[0].ok);
        // Never back: the rest of the run (to the last answer's end, 9.15 s).
        assert_eq!(v[1].measured, 3_150.0);
        assert!(!v[1].ok);
        assert!(
            Scenario::parse(&format!(
                "{}\n[[expect]]\nmetric = \"recovery_to_primary_ms\"\nmax = 3000\n",
                template(10.0, "5s", "1s")
            ))
            .unwrap_err()
            .0
            .contains("needs provider")
        );
    }

    #[test]
    fn before_means_finished_before_the_first_fault() {
        // Started 1 ms before the injection and refused by it: neither before nor chaos.
        let samples = vec![
            sample(1_000, 150, 200, "primary", &[]),
            sample(1_999, 5, 402, "", &["BUDGET_EXHAUSTED"]),
            sample(2_000, 5, 402, "", &["BUDGET_EXHAUSTED"]),
        ];
        let run = Run {
            samples: &samples,
            faults: vec![("drain-budget".into(), 2_000, 6_000)],
            cluster_reasons: BTreeMap::new(),
            budgets_spent: BTreeMap::new(),
        };
        let before: Vec<u64> = run
            .window(StartWindow::Before)
            .iter()
            .map(|s| s.started_us / 1_000)
            .collect();
        assert_eq!(before, [1_000]);
        let chaos: Vec<u64> = run
            .window(StartWindow::Chaos)
            .iter()
            .map(|s| s.started_us / 1_000)
            .collect();
        assert_eq!(chaos, [2_000]);
    }

    proptest::proptest! {
        /// Any text as a scenario file is a scenario or an error, never a panic.
        #[test]
        fn any_text_is_a_scenario_or_an_error(text in "\\PC{0,400}") {
            let _ = Scenario::parse(&text);
        }

        /// The real sections with random values: checked, never a panic.
        #[test]
        fn any_values_in_a_scenario_are_checked(
            rate in proptest::num::f64::ANY,
            duration in "[0-9a-z.]{0,8}",
            at in "[0-9a-z.-]{0,8}",
        ) {
            let _ = Scenario::parse(&template(rate, &duration, &at));
        }
    }

    /// A scenario with these load and chaos values (the rest as in the shipped ones).
    fn template(rate: f64, duration: &str, at: &str) -> String {
        format!(
            "name = \"p\"\ndescription = \"d\"\n[load]\nrate = {rate:?}\nduration = {duration:?}\n\n\
             [[chaos]]\nat = {at:?}\nfault = \"kill-provider\"\ntarget = \"primary\"\nfor = \"1s\"\n\n\
             [[expect]]\nmetric = \"success_rate\"\nmin = 0.9\n"
        )
    }

    #[test]
    fn the_fuzzing_template_is_a_scenario_with_sane_values() {
        let s = Scenario::parse(&template(25.0, "12s", "3s"));
        assert!(s.is_ok(), "{s:?}");
    }
}
