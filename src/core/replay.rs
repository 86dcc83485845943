//! Replay: one request driven through the engine from recorded generation results, with no
//! clock and no I/O, so the same input gives the same decision, byte for byte (`oam decide`,
//! `oam explain`).

use super::decision::Decision;
use super::pipeline::{Config, Engine, State, Step};
use super::request::{Generation, Request};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A replayable input: `now`, the request, the state snapshot, and the generation results each
/// provider returned (consumed in order per provider).
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct DecideInput {
    pub now_ms: u64,
    #[serde(default)]
    pub config: Config,
    pub request: Request,
    #[serde(default)]
    pub state: State,
    #[serde(default)]
    pub generations: BTreeMap<String, Vec<Generation>>,
}

/// Why an input does not decide.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecideError {
    /// A field of the input is missing or wrong (the message names it).
    #[error("{0}")]
    Input(String),
    /// The engine refuses the request itself.
    #[error("{0}")]
    Refused(String),
    #[error(
        "generations.{provider}: attempt {attempt} was dispatched to {provider} but the input \
         holds no (further) result for it"
    )]
    NoResult { provider: String, attempt: u32 },
}

/// Drive one request through the pipeline with recorded generation results. Time advances by
/// each generation's latency. Errors name the input field that is missing or wrong.
pub fn replay(input: DecideInput) -> Result<Decision, DecideError> {
    if input.state.providers.is_empty() {
        return Err(DecideError::Input(
            "state.providers must list at least one provider".into(),
        ));
    }
    let mut ids = std::collections::BTreeSet::new();
    for (i, p) in input.state.providers.iter().enumerate() {
        if p.id.is_empty() || !ids.insert(&*p.id) {
            return Err(DecideError::Input(format!(
                "state.providers[{i}].id must be a non-empty, unique name"
            )));
        }
        if !(p.cost_per_1k_tokens_usd.is_finite() && p.cost_per_1k_tokens_usd >= 0.0) {
            return Err(DecideError::Input(format!(
                "state.providers[{i}].cost_per_1k_tokens_usd must be >= 0"
            )));
        }
    }
    for name in input.generations.keys() {
        if !ids.contains(name.as_str()) {
            return Err(DecideError::Input(format!(
                "generations.{name}: no such provider in state.providers"
            )));
        }
    }
    let mut generations = input.generations;
    let mut engine = Engine::new(input.config, input.state);
    let mut now = input.now_ms;
    let (mut session, mut step) = engine
        .begin(input.request, now)
        .map_err(|e| DecideError::Refused(e.message))?;
    loop {
        step = match step {
            Step::Done(d) => return Ok(*d),
            Step::Queued => engine.dequeue(&mut session, now),
            Step::Dispatch(d) => {
                let queue = generations.entry(d.provider.to_string()).or_default();
                if queue.is_empty() {
                    return Err(DecideError::NoResult {
                        provider: d.provider.to_string(),
                        attempt: d.attempt,
                    });
                }
                let g = queue.remove(0);
                now += g.latency_ms;
                engine.complete(&mut session, g, now)
            }
        };
    }
}
