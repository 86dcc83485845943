//! Reason codes: the one enum that names every veto, detour and verdict the pipeline can reach.
//!
//! Each code has a stable SCREAMING_SNAKE string (what clients match on, so never rename one),
//! the pipeline phase it belongs to and a one-line meaning (`oam reasons`). The table below is the
//! single source: the enum, `ALL`, the strings and the meanings are all generated from it.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Where in the pipeline something happened. A decision's phase is where it ended.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Admission,
    Loop,
    Budget,
    Routing,
    Breaker,
    Generation,
    Semantic,
    Quality,
    Cost,
    Retry,
    Escalation,
    Accepted,
}

impl Phase {
    pub const ALL: [Phase; 12] = [
        Phase::Admission,
        Phase::Loop,
        Phase::Budget,
        Phase::Routing,
        Phase::Breaker,
        Phase::Generation,
        Phase::Semantic,
        Phase::Quality,
        Phase::Cost,
        Phase::Retry,
        Phase::Escalation,
        Phase::Accepted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Admission => "admission",
            Phase::Loop => "loop",
            Phase::Budget => "budget",
            Phase::Routing => "routing",
            Phase::Breaker => "breaker",
            Phase::Generation => "generation",
            Phase::Semantic => "semantic",
            Phase::Quality => "quality",
            Phase::Cost => "cost",
            Phase::Retry => "retry",
            Phase::Escalation => "escalation",
            Phase::Accepted => "accepted",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a human should do with an escalation.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Action {
    /// Look at it; automation may continue meanwhile.
    HumanReview,
    /// Look at it, and nothing automatic may act on this request's result until someone has.
    HumanReviewBlockAutomaticAction,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::HumanReview => "HUMAN_REVIEW",
            Action::HumanReviewBlockAutomaticAction => "HUMAN_REVIEW_BLOCK_AUTOMATIC_ACTION",
        }
    }
}

macro_rules! reason_codes {
    ($($variant:ident = $name:literal, $phase:ident, $meaning:literal;)*) => {
        /// A machine-readable reason. Serialises as its stable string.
        #[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
        pub enum ReasonCode {
            $(#[doc = $meaning] #[serde(rename = $name)] $variant,)*
        }

        impl ReasonCode {
            /// Every code, in pipeline order.
            pub const ALL: &'static [ReasonCode] = &[$(ReasonCode::$variant,)*];

            pub fn as_str(self) -> &'static str {
                match self { $(ReasonCode::$variant => $name,)* }
            }

            pub fn phase(self) -> Phase {
                match self { $(ReasonCode::$variant => Phase::$phase,)* }
            }

            pub fn meaning(self) -> &'static str {
                match self { $(ReasonCode::$variant => $meaning,)* }
            }
        }
    };
}

reason_codes! {
    AdmissionQueued = "ADMISSION_QUEUED", Admission,
        "The request's class was at its concurrency limit; the request waited in the class queue.";
    QueueTimeout = "QUEUE_TIMEOUT", Admission,
        "The request waited in its class queue past the queue deadline without getting a slot; retry later.";
    ClientDisconnected = "CLIENT_DISCONNECTED", Admission,
        "The caller went away before the answer: a queued request left the queue without calling a provider, or no further attempt was made after the one under way.";
    RateLimitExceeded = "RATE_LIMIT_EXCEEDED", Admission,
        "The caller used its requests or tokens per minute across the cluster; refused before any target was called, retry after the window (Retry-After).";
    QueueFull = "QUEUE_FULL", Admission,
        "The request's class was at its concurrency limit and its queue was full; rejected, retry later.";
    BulkheadShed = "BULKHEAD_SHED", Admission,
        "The request's class was at its concurrency limit and does not queue; shed, retry later.";
    LoadShedNonCritical = "LOAD_SHED_NON_CRITICAL", Admission,
        "Global load reached the non-critical cap; non-critical traffic is shed so critical capacity stays free.";
    ConnectionLimit = "CONNECTION_LIMIT", Admission,
        "Every HTTP connection the node may hold (node.max_connections, sized from its open-file limit) had a request in hand; refused at once with Retry-After, retry later or on another node.";
    ToolDefinitionChanged = "TOOL_DEFINITION_CHANGED", Admission,
        "The tool's definition differs from the one pinned when this node first saw it; the tool is neither listed nor called, never used silently.";
    AgentLoopDetected = "AGENT_LOOP_DETECTED", Loop,
        "The same call (agent, task, model, messages) failed repeatedly within the loop window; the loop breaker tripped and an incident opened.";
    RunawayRetryStopped = "RUNAWAY_RETRY_STOPPED", Loop,
        "This exact call is in an open loop episode; refused without calling any provider until the episode expires or succeeds.";
    LoopProbe = "LOOP_PROBE", Loop,
        "The loop episode's cool-down ended; this identical call was let through once to see whether it works again.";
    BudgetExhausted = "BUDGET_EXHAUSTED", Budget,
        "The remaining budget of the request's agent, team or task cannot cover this request on the provider.";
    BudgetWouldRefuse = "BUDGET_WOULD_REFUSE", Budget,
        "A budget in audit mode (on_exceeded = \"audit\") could not cover this attempt: it went ahead, and would have been refused with the budget enforced.";
    GlobalBudgetExhausted = "GLOBAL_BUDGET_EXHAUSTED", Budget,
        "The cluster-wide budget cannot cover this request on the provider.";
    BudgetStoreUnreachable = "BUDGET_STORE_UNREACHABLE", Budget,
        "The shared budget ledger could not be reached and the request may not spend on this node's local share (high risk, or the share is spent); refused.";
    BudgetLocalShare = "BUDGET_LOCAL_SHARE", Budget,
        "The shared budget ledger could not be reached; this lower-risk request spent from the node's local share (limit / cluster size), settled in the ledger once it is back.";
    ProbeBudgetExhausted = "PROBE_BUDGET_EXHAUSTED", Budget,
        "A billed health probe was not sent: today's probe budget ([probes] max_usd_per_day, UTC days) is spent; the target gets its free check (its model list) until the next day or a higher cap.";
    RoutingSelected = "ROUTING_SELECTED", Routing,
        "A provider was chosen by score among the candidates that passed every exclusion.";
    FallbackUsed = "FALLBACK_USED", Routing,
        "The chosen provider is a fallback.";
    ProviderUnhealthy = "PROVIDER_UNHEALTHY", Routing,
        "The provider's verdict is UNHEALTHY (availability < 50% or contract failures > 20%); excluded.";
    ProviderDegraded = "PROVIDER_DEGRADED", Routing,
        "The provider's verdict is DEGRADED (availability < 95%, contract failures > 2% or p95 > 1500 ms); scored lower.";
    ProviderHealthUnknown = "PROVIDER_HEALTH_UNKNOWN", Routing,
        "No recent samples for the provider; its health is UNKNOWN and scored neutrally.";
    NoQuorumLocalView = "NO_QUORUM_LOCAL_VIEW", Routing,
        "Fewer than floor(n/2)+1 live nodes agree on the provider's health; this node routed on its own view.";
    FallbackNotAllowed = "FALLBACK_NOT_ALLOWED", Routing,
        "The request's policy forbids fallbacks; the fallback provider was excluded.";
    ProviderAlreadyTried = "PROVIDER_ALREADY_TRIED", Routing,
        "The provider already failed an earlier attempt of this request; excluded from the retry.";
    ProviderCoolingDown = "PROVIDER_COOLING_DOWN", Routing,
        "The provider rate-limited us and its Retry-After has not passed; excluded until then.";
    ContextWindowTooSmall = "CONTEXT_WINDOW_TOO_SMALL", Routing,
        "The target's context window is too small for the request (by estimate, or because a target with a window as large refused it as too long); excluded.";
    PrefillNotSupported = "PREFILL_NOT_SUPPORTED", Routing,
        "The target cannot continue a partial answer (it takes no assistant prefill); excluded from continuing an interrupted stream.";
    ApiNotCarried = "API_NOT_CARRIED", Routing,
        "The request uses a feature the target's API has no equivalent for (a translation would drop it); excluded, so it is served only where its own API is spoken.";
    ModelKindMismatch = "MODEL_KIND_MISMATCH", Routing,
        "The target serves embeddings or tools and the request asks for an answer, or the reverse; excluded.";
    NoProviderAvailable = "NO_PROVIDER_AVAILABLE", Routing,
        "Every provider was excluded; nothing could serve the request.";
    CircuitOpen = "CIRCUIT_OPEN", Breaker,
        "The provider's circuit breaker is open after consecutive failures; excluded until it half-opens.";
    CircuitNotAvailable = "CIRCUIT_NOT_AVAILABLE", Breaker,
        "The provider's breaker is half-open and its probe quota is in use; excluded for now.";
    CircuitHalfOpenProbe = "CIRCUIT_HALF_OPEN_PROBE", Breaker,
        "The provider's breaker is half-open; this request is one of its probes.";
    CircuitOpened = "CIRCUIT_OPENED", Breaker,
        "This request's failure opened the provider's circuit breaker.";
    CircuitClosed = "CIRCUIT_CLOSED", Breaker,
        "This request's success as a half-open probe closed the provider's circuit breaker.";
    GenerationError = "GENERATION_ERROR", Generation,
        "The provider failed: a 5xx, a connection error or an unusable response.";
    ProviderRejectedRequest = "PROVIDER_REJECTED_REQUEST", Generation,
        "The provider refused the request itself (HTTP 400, 413 or 422: invalid, or too large for it); the caller's doing, so it counts against neither the provider's health nor its breaker.";
    GenerationTimeout = "GENERATION_TIMEOUT", Generation,
        "The provider did not answer within the attempt's timeout.";
    LocalResourceExhausted = "LOCAL_RESOURCE_EXHAUSTED", Generation,
        "The node ran out of its own resources (open files, ports) before the provider was reached; not counted against the provider's health or breaker; retry after Retry-After or on another node.";
    RateLimited = "RATE_LIMITED", Generation,
        "The provider answered 429; its Retry-After is honoured before it is used again.";
    StreamInterrupted = "STREAM_INTERRUPTED", Generation,
        "The upstream's stream stalled past its idle deadline, ran past its total deadline or was cut, after part of the answer had reached the caller.";
    StreamChunkSkipped = "STREAM_CHUNK_SKIPPED", Generation,
        "An unreadable event in the upstream's stream was skipped (counted) after the answer had started reaching the caller.";
    ContextLengthExceeded = "CONTEXT_LENGTH_EXCEEDED", Generation,
        "The target refused the request as longer than its context window; only targets with a larger window are tried next, this one never again.";
    ContentPolicyRefusal = "CONTENT_POLICY_REFUSAL", Generation,
        "The upstream refused on content policy (an error, or an answer cut by its content filter); returned to the caller as it came, with no retry and no fallback.";
    UpstreamAuthFailed = "UPSTREAM_AUTH_FAILED", Generation,
        "The upstream refused oam's credentials (HTTP 401 or 403): the target is misconfigured; the next target is tried and an operator is told.";
    SemanticValidationFailed = "SEMANTIC_VALIDATION_FAILED", Semantic,
        "The provider answered, but the content broke the response contract (see the CONTRACT_* codes).";
    ContractEmpty = "CONTRACT_EMPTY", Semantic,
        "The response content was empty.";
    ContractNotJson = "CONTRACT_NOT_JSON", Semantic,
        "The response content was not JSON.";
    ContractNotObject = "CONTRACT_NOT_OBJECT", Semantic,
        "The response content was JSON but not an object.";
    ContractMissingField = "CONTRACT_MISSING_FIELD", Semantic,
        "A field the contract requires was missing.";
    ContractFieldType = "CONTRACT_FIELD_TYPE", Semantic,
        "A field had a different JSON type than the contract says.";
    ContractConfidenceType = "CONTRACT_CONFIDENCE_TYPE", Semantic,
        "The confidence field was not a number.";
    ContractConfidenceRange = "CONTRACT_CONFIDENCE_RANGE", Semantic,
        "The confidence was outside [0, 1].";
    ContractConfidenceTooLow = "CONTRACT_CONFIDENCE_TOO_LOW", Semantic,
        "The confidence was below the contract's floor: the provider itself says the answer is unusable.";
    ContractTooLong = "CONTRACT_TOO_LONG", Semantic,
        "The response content was longer than the contract allows.";
    ContractTruncated = "CONTRACT_TRUNCATED", Semantic,
        "The response was cut off (finish_reason \"length\" or JSON that ends early).";
    ContractSchemaViolation = "CONTRACT_SCHEMA_VIOLATION", Semantic,
        "The answer does not fit the JSON Schema of the request's json_schema response format.";
    ToolArgumentsInvalid = "TOOL_ARGUMENTS_INVALID", Semantic,
        "A tool call's arguments are not JSON or do not fit the parameter schema of the tool the request declared (or it names no declared tool); at /mcp, the arguments do not fit the tool's input schema, and its server is not called.";
    QualityBelowThreshold = "QUALITY_BELOW_THRESHOLD", Quality,
        "A valid answer whose confidence is below what this request's risk level requires.";
    CostOverRequestLimit = "COST_OVER_REQUEST_LIMIT", Cost,
        "The provider's estimated cost is above the request's max_cost_usd; excluded.";
    CostLimitExceeded = "COST_LIMIT_EXCEEDED", Cost,
        "The attempt's actual cost exceeded the request's max_cost_usd; the answer is withheld and not retried.";
    StreamContinuedWithPrefill = "STREAM_CONTINUED_WITH_PREFILL", Retry,
        "An interrupted stream was continued on a target that accepts an assistant prefill, given the text already delivered (once; never restarted from scratch).";
    StreamEndedWithError = "STREAM_ENDED_WITH_ERROR", Retry,
        "An interrupted stream could not be continued; it ended with an in-band error event naming the reason, never with [DONE].";
    RetrySameTarget = "RETRY_SAME_TARGET", Retry,
        "A transient failure (a 5xx, a refused or reset connection, or a 429 whose Retry-After is within the cap) was retried on the same target, after a backoff with jitter or the Retry-After.";
    RetryWaitOverBudget = "RETRY_WAIT_OVER_BUDGET", Retry,
        "A same-target retry was not made: its wait (the backoff, or a Retry-After within the cap, which the default budget always holds) would end past the request's latency budget.";
    RetryScheduled = "RETRY_SCHEDULED", Retry,
        "An attempt failed and another was scheduled: on a different target, or on the same one (RETRY_SAME_TARGET).";
    RetriesExhausted = "RETRIES_EXHAUSTED", Retry,
        "The request used every attempt its risk level and policy allow.";
    RetryNotSafe = "RETRY_NOT_SAFE", Retry,
        "A non-idempotent request timed out; its effect is unknown, so it is not retried.";
    HumanAttentionRequired = "HUMAN_ATTENTION_REQUIRED", Escalation,
        "An escalation was raised; see its recommended action.";
    EscalatedHighRiskFailure = "ESCALATED_HIGH_RISK_FAILURE", Escalation,
        "A high-risk request failed; oam refuses to guess and hands it to a human.";
    EscalatedCriticalTaskFailure = "ESCALATED_CRITICAL_TASK_FAILURE", Escalation,
        "A critical-priority task failed; a human should know.";
    EscalatedLowConfidence = "ESCALATED_LOW_CONFIDENCE", Escalation,
        "A medium-risk request ended with answers below its confidence threshold.";
    EscalatedUnsafeRetry = "ESCALATED_UNSAFE_RETRY", Escalation,
        "A non-idempotent request timed out and could not be retried safely.";
    EscalatedAgentLoop = "ESCALATED_AGENT_LOOP", Escalation,
        "An agent loop was detected; one escalation for the whole episode.";
    EscalatedUpstreamMisconfigured = "ESCALATED_UPSTREAM_MISCONFIGURED", Escalation,
        "A target refused oam's credentials; an operator must fix its key or permissions (one escalation per target per 10 minutes, whether or not another target served the request).";
    EscalatedBudgetExhausted = "ESCALATED_BUDGET_EXHAUSTED", Escalation,
        "A high-risk request met an exhausted budget; oam refuses to fall back to a cheaper guess.";
    Accepted = "ACCEPTED", Accepted,
        "The answer passed the contract, quality and cost gates and was returned.";
}

impl ReasonCode {
    /// Parse a stable string back into a code.
    pub fn parse(s: &str) -> Option<ReasonCode> {
        ReasonCode::ALL.iter().copied().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for ReasonCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_unique_screaming_snake_and_match_serde() {
        let mut seen = std::collections::BTreeSet::new();
        for &code in ReasonCode::ALL {
            let s = code.as_str();
            assert!(seen.insert(s), "duplicate code string {s}");
            assert!(
                s.chars().all(|c| c.is_ascii_uppercase() || c == '_'),
                "{s} is not SCREAMING_SNAKE"
            );
            assert_eq!(serde_json::to_string(&code).unwrap(), format!("\"{s}\""));
            assert_eq!(ReasonCode::parse(s), Some(code));
            assert!(!code.meaning().is_empty());
        }
    }

    #[test]
    fn all_is_in_pipeline_order() {
        let phases: Vec<Phase> = ReasonCode::ALL.iter().map(|c| c.phase()).collect();
        let mut sorted = phases.clone();
        sorted.sort();
        assert_eq!(
            phases, sorted,
            "codes are grouped by phase in pipeline order"
        );
    }

    #[test]
    fn actions_serialise_to_their_documented_strings() {
        for a in [Action::HumanReview, Action::HumanReviewBlockAutomaticAction] {
            assert_eq!(
                serde_json::to_string(&a).unwrap(),
                format!("\"{}\"", a.as_str())
            );
        }
    }
}
