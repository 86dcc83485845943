//! Chaos as data: the faults, their parameters, and the messages between `oam chaos`, the
//! chaos warden and the nodes. Pure types and parsing; the warden (`crate::chaos`) applies them
//! and `transport::chaos` asks it.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The longest a fault may last.
pub(crate) const MAX_FOR: Duration = Duration::from_secs(3_600);

/// How a contract-breaking answer is broken (`break-contract --mode`, and the simulator's
/// `contract` fault mode).
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ContractBreak {
    #[default]
    NotJson,
    MissingField,
    LowConfidence,
    Truncated,
}

impl ContractBreak {
    pub const ALL: [ContractBreak; 4] = [
        ContractBreak::NotJson,
        ContractBreak::MissingField,
        ContractBreak::LowConfidence,
        ContractBreak::Truncated,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ContractBreak::NotJson => "not-json",
            ContractBreak::MissingField => "missing-field",
            ContractBreak::LowConfidence => "low-confidence",
            ContractBreak::Truncated => "truncated",
        }
    }

    pub fn from_name(name: &str) -> Option<ContractBreak> {
        ContractBreak::ALL.into_iter().find(|m| m.as_str() == name)
    }
}

/// How a streamed answer breaks (`break-stream --kind`, and the simulator's `stream` fault
/// mode).
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(rename_all = "kebab-case")]
pub enum StreamBreak {
    /// Falls silent (the connection open) until the fault ends, then goes on.
    Stall,
    /// The connection drops.
    #[default]
    Cut,
    /// One event that is not JSON, then the rest.
    Malformed,
    /// Everything but the final `[DONE]`, and the connection held open until the fault ends.
    NoDone,
}

impl StreamBreak {
    pub const ALL: [StreamBreak; 4] = [
        StreamBreak::Stall,
        StreamBreak::Cut,
        StreamBreak::Malformed,
        StreamBreak::NoDone,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StreamBreak::Stall => "stall",
            StreamBreak::Cut => "cut",
            StreamBreak::Malformed => "malformed",
            StreamBreak::NoDone => "no-done",
        }
    }

    pub fn from_name(name: &str) -> Option<StreamBreak> {
        StreamBreak::ALL.into_iter().find(|m| m.as_str() == name)
    }
}

/// The faults, by their command names.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    KillProvider,
    BreakContract,
    SlowProvider,
    HangProvider,
    FlakyProvider,
    RateLimitProvider,
    BreakStream,
    KillNode,
    StopNode,
    IsolateNode,
    KillAgent,
    StopAgent,
    AgentLoop,
    TrafficSpike,
    DrainBudget,
}

/// What a fault is aimed at, which decides how its target is checked.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Aim {
    Provider,
    Node,
    Agent,
    /// An agent name on the nodes' data plane (budgets, loops); any name is valid.
    Caller,
    /// No target.
    Mesh,
}

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::KillProvider => "kill-provider",
            Fault::BreakContract => "break-contract",
            Fault::SlowProvider => "slow-provider",
            Fault::HangProvider => "hang-provider",
            Fault::FlakyProvider => "flaky-provider",
            Fault::RateLimitProvider => "rate-limit-provider",
            Fault::BreakStream => "break-stream",
            Fault::KillNode => "kill-node",
            Fault::StopNode => "stop-node",
            Fault::IsolateNode => "isolate-node",
            Fault::KillAgent => "kill-agent",
            Fault::StopAgent => "stop-agent",
            Fault::AgentLoop => "agent-loop",
            Fault::TrafficSpike => "traffic-spike",
            Fault::DrainBudget => "drain-budget",
        }
    }

    /// The target a fault takes when none is given (`None`: it needs one).
    pub fn default_target(self) -> Option<&'static str> {
        match self {
            Fault::TrafficSpike => Some("mesh"),
            Fault::AgentLoop => Some("loop-bot"),
            _ => None,
        }
    }

    pub fn aim(self) -> Aim {
        match self {
            Fault::KillProvider
            | Fault::BreakContract
            | Fault::SlowProvider
            | Fault::HangProvider
            | Fault::FlakyProvider
            | Fault::RateLimitProvider
            | Fault::BreakStream => Aim::Provider,
            Fault::KillNode | Fault::StopNode | Fault::IsolateNode => Aim::Node,
            Fault::KillAgent | Fault::StopAgent => Aim::Agent,
            Fault::DrainBudget | Fault::AgentLoop => Aim::Caller,
            Fault::TrafficSpike => Aim::Mesh,
        }
    }
}

/// Fault-specific settings; each fault reads the ones it uses.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// `break-contract`: how the answers are broken.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<ContractBreak>,
    /// `slow-provider`: added latency.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ms: Option<u64>,
    /// `flaky-provider`: the share of requests that fail.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_rate: Option<f64>,
    /// `rate-limit-provider`: the Retry-After sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// `traffic-spike`, `agent-loop`: how many requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests: Option<u32>,
    /// `traffic-spike`: how many at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    /// `break-stream`: how streams break, and after how many events.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamBreak>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_chunks: Option<u32>,
}

/// `oam.v1.chaos.inject`: what `oam chaos FAULT` sends the warden.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct Inject {
    pub fault: Fault,
    #[serde(default)]
    pub target: Option<String>,
    pub for_ms: u64,
    #[serde(default)]
    pub params: Params,
}

/// An active fault, as listed and announced.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct Active {
    pub id: String,
    pub fault: Fault,
    pub target: String,
    pub params: Params,
    pub injected_at_ms: u64,
    pub expires_at_ms: u64,
    /// What was done, in words (e.g. "SIGKILL pid 4711").
    pub detail: String,
}

impl Active {
    pub fn left_ms(&self, now_ms: u64) -> u64 {
        self.expires_at_ms.saturating_sub(now_ms)
    }
}

/// `oam.v1.chaos.restore`: end faults early.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Restore {
    /// A fault id, or a fault name (every active fault of that kind); `None` is all of them.
    #[serde(default)]
    pub what: Option<String>,
}

/// The warden's answer to any request.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(rename_all = "snake_case")]
pub(crate) enum WardenReply {
    /// Faults injected, listed or restored.
    Ok(Vec<Active>),
    /// Refused, with what to do instead.
    Error(String),
}

/// `oam.v1.chaos.event`: a fault began or ended.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct Event {
    /// `injected`, `restored` (early) or `expired`.
    pub kind: String,
    pub fault: Active,
    pub at_ms: u64,
}

/// `oam.v1.chaos.node.{id|all}`: what a node does to itself until `until_ms`.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(tag = "action", rename_all = "kebab-case")]
pub enum NodeCommand {
    /// Stop exchanging anything with NATS (a partition) until `until_ms`. `key` (random, from
    /// the warden) is what an early restore over HTTP must carry: the node cannot hear NATS
    /// then, and anyone on 127.0.0.1 can reach its HTTP port.
    Isolate {
        id: String,
        until_ms: u64,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        key: String,
    },
    /// Treat `agent`'s budget as spent until `until_ms`.
    DrainBudget {
        id: String,
        agent: String,
        until_ms: u64,
    },
    /// Meet every call of provider `target` (a model's host or a tool server) with `fault`
    /// until `until_ms`: a fault injected at the node, for targets no simulator stands in for.
    FailTarget {
        id: String,
        target: String,
        fault: TargetFault,
        until_ms: u64,
    },
    /// End the fault `id` now (over HTTP only with the isolation's `key`).
    Restore {
        id: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        key: String,
    },
}

/// What a node does to its own calls of a target under `NodeCommand::FailTarget`: what
/// `oam chaos kill-provider`, `slow-provider`, `hang-provider`, `rate-limit-provider` and
/// `flaky-provider` mean for a target the simulator does not serve.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug)]
#[serde(tag = "mode", rename_all = "kebab-case", deny_unknown_fields)]
pub enum TargetFault {
    /// The call fails at once, as an HTTP `status` would.
    Error { status: u16 },
    /// The call waits `extra_ms` first.
    Slow { extra_ms: u64 },
    /// The call is never answered (it times out).
    Hang,
    /// The call is refused with 429 and this Retry-After.
    RateLimit { retry_after_ms: u64 },
    /// This share of calls fail at once.
    Flaky { error_rate: f64 },
}

impl NodeCommand {
    /// Whether a node should act on this command at `now_ms`: a fault that would last beyond
    /// `MAX_FOR` (plus clock skew) is none the warden sent, and `oam chaos restore` could never
    /// end it.
    pub fn check(&self, now_ms: u64) -> Result<(), &'static str> {
        let until_ms = match self {
            NodeCommand::Isolate { until_ms, .. }
            | NodeCommand::DrainBudget { until_ms, .. }
            | NodeCommand::FailTarget { until_ms, .. } => *until_ms,
            NodeCommand::Restore { .. } => return Ok(()),
        };
        let latest = now_ms
            .saturating_add(MAX_FOR.as_millis() as u64)
            .saturating_add(super::wire::MAX_SKEW_MS);
        if until_ms > latest {
            return Err("a fault lasting beyond the warden's maximum (1 h)");
        }
        Ok(())
    }
}

pub use super::date::DurationError;

/// A fault's or a scenario's duration (`30s`, `500ms`, `2m`, `1h`, `1.5`: `date::parse_span`),
/// at most 24 h.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let d = super::date::parse_span(s)?;
    if d > Duration::from_secs(24 * 3_600) {
        return Err(DurationError::OutOfRange(s.to_string(), "24 h"));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_refuse_faults_no_warden_sent() {
        let now = 1_000_000;
        let isolate = |until_ms| NodeCommand::Isolate {
            id: "c1".into(),
            until_ms,
            key: String::new(),
        };
        assert!(isolate(u64::MAX).check(now).is_err(), "forever");
        assert!(
            isolate(now + MAX_FOR.as_millis() as u64 + 60_000)
                .check(now)
                .is_err()
        );
        assert_eq!(isolate(now + 30_000).check(now), Ok(()));
        let drain = NodeCommand::DrainBudget {
            id: "c2".into(),
            agent: "a".into(),
            until_ms: u64::MAX,
        };
        assert!(drain.check(now).is_err());
        let restore = NodeCommand::Restore {
            id: "c1".into(),
            key: String::new(),
        };
        assert_eq!(restore.check(now), Ok(()));
    }

    #[test]
    fn durations_parse_with_units_or_refuse_clearly() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1_500)));
        let soon = parse_duration("soon").unwrap_err();
        assert!(soon.to_string().contains("not a duration"), "{soon}");
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7_200)));
        assert_eq!(
            parse_duration("3d"),
            Err(DurationError::OutOfRange("3d".into(), "24 h"))
        );
        let long = parse_duration("25h").unwrap_err();
        assert!(long.to_string().contains("24 h"), "{long}");
        assert!(parse_duration("0s").is_err() && parse_duration("-1s").is_err());
    }

    #[test]
    fn wire_names_are_the_command_names() {
        for f in [
            Fault::KillProvider,
            Fault::RateLimitProvider,
            Fault::DrainBudget,
        ] {
            assert_eq!(serde_json::to_value(f).unwrap(), f.name());
        }
        let cmd: NodeCommand = serde_json::from_str(
            r#"{"action": "drain-budget", "id": "c1", "agent": "a", "until_ms": 5}"#,
        )
        .unwrap();
        assert!(matches!(cmd, NodeCommand::DrainBudget { .. }));
        assert!(serde_json::from_str::<Inject>(r#"{"fault": "melt-cpu", "for_ms": 1}"#).is_err());
    }

    proptest::proptest! {
        /// Any text as a duration is one of at most 24 h, or an error; never a panic.
        #[test]
        fn any_text_is_a_bounded_duration_or_an_error(text in "\\PC{0,24}") {
            if let Ok(d) = parse_duration(&text) {
                proptest::prop_assert!(d <= Duration::from_secs(24 * 3_600));
            }
        }
    }
}
