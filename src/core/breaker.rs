//! Circuit breaker: closed -> open after consecutive failures -> half-open with a probe quota ->
//! closed after enough probe successes. Also used, force-tripped, for agent-loop episodes.
//!
//! Only probe results move a half-open breaker; a result from a request dispatched before the
//! breaker opened is ignored, so a late success can never close it without a probe.

use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Consecutive failures that open a closed breaker.
    pub failure_threshold: u32,
    /// How long it stays open before half-opening.
    pub open_ms: u64,
    /// Concurrent probes allowed while half-open.
    pub half_open_probes: u32,
    /// Probe successes needed to close.
    pub half_open_successes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: 5,
            open_ms: 10_000,
            half_open_probes: 1,
            half_open_successes: 1,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(tag = "state", rename_all = "snake_case", deny_unknown_fields)]
pub enum Breaker {
    Closed {
        #[serde(default)]
        failures: u32,
    },
    Open {
        until_ms: u64,
        /// Tripped on purpose (a loop, an operator), not by counting failures.
        #[serde(default)]
        forced: bool,
    },
    HalfOpen {
        #[serde(default)]
        probes_in_flight: u32,
        #[serde(default)]
        successes: u32,
    },
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker::Closed { failures: 0 }
    }
}

/// What the breaker allows for a new request.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Permit {
    /// Closed: go ahead.
    Allowed,
    /// Half-open: go ahead as a probe; report the result with `probe = true`.
    Probe,
    /// Open.
    Open,
    /// Half-open, and every probe slot is taken.
    ProbeQuotaFull,
}

/// A state change worth telling someone about.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "snake_case")]
pub enum Transition {
    Opened,
    HalfOpened,
    Closed,
}

impl Breaker {
    pub fn is_closed(&self) -> bool {
        matches!(self, Breaker::Closed { .. })
    }

    pub fn is_open(&self) -> bool {
        matches!(self, Breaker::Open { .. })
    }

    /// The state's name as it travels: `closed`, `open` or `half_open`.
    pub fn name(&self) -> &'static str {
        match self {
            Breaker::Closed { .. } => "closed",
            Breaker::Open { .. } => "open",
            Breaker::HalfOpen { .. } => "half_open",
        }
    }

    /// Move an expired open breaker to half-open. Returns the transition if one happened.
    pub fn tick(&mut self, now_ms: u64) -> Option<Transition> {
        if let Breaker::Open { until_ms, .. } = *self
            && now_ms >= until_ms
        {
            *self = Breaker::HalfOpen {
                probes_in_flight: 0,
                successes: 0,
            };
            return Some(Transition::HalfOpened);
        }
        None
    }

    /// What a request arriving at `now_ms` would get, without taking anything.
    pub fn peek(&self, now_ms: u64, cfg: &BreakerConfig) -> Permit {
        let mut b = *self;
        b.tick(now_ms);
        match b {
            Breaker::Closed { .. } => Permit::Allowed,
            Breaker::Open { .. } => Permit::Open,
            Breaker::HalfOpen {
                probes_in_flight, ..
            } if probes_in_flight < cfg.half_open_probes => Permit::Probe,
            Breaker::HalfOpen { .. } => Permit::ProbeQuotaFull,
        }
    }

    /// Take a permit: a probe slot is held until its result is reported or released.
    pub fn acquire(&mut self, now_ms: u64, cfg: &BreakerConfig) -> Permit {
        self.tick(now_ms);
        let permit = self.peek(now_ms, cfg);
        if let (
            Permit::Probe,
            Breaker::HalfOpen {
                probes_in_flight, ..
            },
        ) = (permit, self)
        {
            *probes_in_flight += 1;
        }
        permit
    }

    /// The provider worked.
    pub fn on_success(&mut self, probe: bool, cfg: &BreakerConfig) -> Option<Transition> {
        match self {
            Breaker::Closed { failures } => {
                *failures = 0;
                None
            }
            Breaker::HalfOpen {
                probes_in_flight,
                successes,
            } if probe => {
                *probes_in_flight = probes_in_flight.saturating_sub(1);
                *successes += 1;
                if *successes >= cfg.half_open_successes {
                    *self = Breaker::Closed { failures: 0 };
                    Some(Transition::Closed)
                } else {
                    None
                }
            }
            _ => None,
        }
    }

    /// The provider failed (error, timeout or broken contract).
    pub fn on_failure(
        &mut self,
        now_ms: u64,
        probe: bool,
        cfg: &BreakerConfig,
    ) -> Option<Transition> {
        match self {
            Breaker::Closed { failures } => {
                *failures += 1;
                if *failures >= cfg.failure_threshold {
                    *self = Breaker::Open {
                        until_ms: now_ms + cfg.open_ms,
                        forced: false,
                    };
                    Some(Transition::Opened)
                } else {
                    None
                }
            }
            Breaker::HalfOpen { .. } if probe => {
                *self = Breaker::Open {
                    until_ms: now_ms + cfg.open_ms,
                    forced: false,
                };
                Some(Transition::Opened)
            }
            _ => None,
        }
    }

    /// A probe ended without telling us anything about the provider (e.g. 429): free its slot.
    pub fn release_probe(&mut self) {
        if let Breaker::HalfOpen {
            probes_in_flight, ..
        } = self
        {
            *probes_in_flight = probes_in_flight.saturating_sub(1);
        }
    }

    /// Open now for `duration_ms`, whatever the state (a loop, an operator).
    pub fn trip(&mut self, now_ms: u64, duration_ms: u64) -> Option<Transition> {
        let was_open = matches!(self, Breaker::Open { .. });
        *self = Breaker::Open {
            until_ms: now_ms + duration_ms,
            forced: true,
        };
        (!was_open).then_some(Transition::Opened)
    }

    /// Close at once (operator reset).
    pub fn reset(&mut self) -> Option<Transition> {
        let was_closed = self.is_closed();
        *self = Breaker::Closed { failures: 0 };
        (!was_closed).then_some(Transition::Closed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CFG: BreakerConfig = BreakerConfig {
        failure_threshold: 3,
        open_ms: 1_000,
        half_open_probes: 1,
        half_open_successes: 2,
    };

    #[test]
    fn opens_after_consecutive_failures_only() {
        let mut b = Breaker::default();
        b.on_failure(0, false, &CFG);
        b.on_failure(0, false, &CFG);
        b.on_success(false, &CFG);
        assert_eq!(
            b,
            Breaker::Closed { failures: 0 },
            "a success resets the count"
        );
        b.on_failure(0, false, &CFG);
        b.on_failure(0, false, &CFG);
        assert_eq!(b.on_failure(10, false, &CFG), Some(Transition::Opened));
        assert_eq!(b.peek(10, &CFG), Permit::Open);
        assert_eq!(b.peek(1_009, &CFG), Permit::Open);
        assert_eq!(b.peek(1_010, &CFG), Permit::Probe);
    }

    #[test]
    fn half_open_probe_quota_and_close() {
        let mut b = Breaker::Open {
            until_ms: 100,
            forced: false,
        };
        assert_eq!(b.acquire(100, &CFG), Permit::Probe);
        assert_eq!(b.acquire(100, &CFG), Permit::ProbeQuotaFull);
        assert_eq!(b.on_success(true, &CFG), None, "needs two successes");
        assert_eq!(b.acquire(101, &CFG), Permit::Probe);
        assert_eq!(b.on_success(true, &CFG), Some(Transition::Closed));
        assert_eq!(b.acquire(102, &CFG), Permit::Allowed);
    }

    #[test]
    fn probe_failure_reopens_and_late_results_are_ignored() {
        let mut b = Breaker::Open {
            until_ms: 0,
            forced: false,
        };
        assert_eq!(b.acquire(0, &CFG), Permit::Probe);
        assert_eq!(
            b.on_success(false, &CFG),
            None,
            "a non-probe success is ignored"
        );
        assert_eq!(b.on_failure(5, true, &CFG), Some(Transition::Opened));
        assert_eq!(
            b,
            Breaker::Open {
                until_ms: 1_005,
                forced: false
            }
        );
        assert_eq!(b.on_success(false, &CFG), None);
        assert!(!b.is_closed());
    }

    #[test]
    fn trip_and_reset() {
        let mut b = Breaker::default();
        assert_eq!(b.trip(0, 500), Some(Transition::Opened));
        assert_eq!(b.trip(0, 500), None, "already open");
        assert_eq!(b.peek(499, &CFG), Permit::Open);
        assert_eq!(b.reset(), Some(Transition::Closed));
        assert_eq!(b.peek(0, &CFG), Permit::Allowed);
    }

    #[test]
    fn released_probe_frees_the_slot() {
        let mut b = Breaker::Open {
            until_ms: 0,
            forced: false,
        };
        assert_eq!(b.acquire(0, &CFG), Permit::Probe);
        b.release_probe();
        assert_eq!(b.acquire(0, &CFG), Permit::Probe);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Acquire,
        Success(bool),
        Failure(bool),
        Release,
        Advance(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            Just(Op::Acquire),
            any::<bool>().prop_map(Op::Success),
            any::<bool>().prop_map(Op::Failure),
            Just(Op::Release),
            (0u64..2_000).prop_map(Op::Advance),
        ]
    }

    proptest! {
        /// A breaker never closes without a half-open probe success, never exceeds its probe
        /// quota, and never opens without a failure (or a trip).
        #[test]
        fn never_closes_without_a_probe(ops in prop::collection::vec(op(), 1..200)) {
            let mut b = Breaker::default();
            let mut now = 0;
            for op in ops {
                let before = b;
                let t = match op {
                    Op::Acquire => { b.acquire(now, &CFG); None }
                    Op::Success(probe) => b.on_success(probe, &CFG),
                    Op::Failure(probe) => b.on_failure(now, probe, &CFG),
                    Op::Release => { b.release_probe(); None }
                    Op::Advance(d) => { now += d; None }
                };
                let was_half_open = matches!(before, Breaker::HalfOpen { .. });
                let is_open = matches!(b, Breaker::Open { .. });
                let was_open = matches!(before, Breaker::Open { .. });
                if !before.is_closed() && b.is_closed() {
                    prop_assert!(was_half_open, "closed from {:?}", before);
                    let probe_success = matches!(op, Op::Success(true));
                    prop_assert!(probe_success, "closed by {:?}", op);
                    prop_assert_eq!(t, Some(Transition::Closed));
                }
                if let Breaker::HalfOpen { probes_in_flight, .. } = b {
                    prop_assert!(probes_in_flight <= CFG.half_open_probes);
                }
                if is_open && !was_open {
                    let failure = matches!(op, Op::Failure(_));
                    prop_assert!(failure, "opened by {:?}", op);
                }
            }
        }
    }
}
