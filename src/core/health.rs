//! Provider health: a rolling window of outcomes and the verdict thresholds from DESIGN.md.
//!
//! Probes and live traffic both feed the window. Timeouts are recorded with the time they really
//! took, so p95 reflects a hanging provider instead of hiding it. Pure: `now` is an argument.

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Default rolling window.
pub const DEFAULT_WINDOW_MS: u64 = 15_000;
/// Memory bound for one window: at 1 probe/s plus heavy traffic this is still minutes of samples.
pub const MAX_SAMPLES: usize = 4_096;
/// Failures in a row that make an outage, and successes in a row that end it (see `Window`).
pub const RECOVERY_STREAK: usize = 3;

/// How one call to a provider went.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Answered and the answer met the contract.
    Success,
    /// Answered (HTTP 200) but the content broke the contract.
    ContractFailure,
    /// 5xx, connection error, 429 or an unusable response.
    Error,
    /// No answer within the timeout.
    Timeout,
}

/// The health verdict for one provider.
#[derive(
    Serialize, Deserialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default,
)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Verdict {
    Healthy,
    Degraded,
    Unhealthy,
    #[default]
    Unknown,
}

impl Verdict {
    pub const ALL: [Verdict; 4] = [
        Verdict::Healthy,
        Verdict::Degraded,
        Verdict::Unhealthy,
        Verdict::Unknown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Healthy => "HEALTHY",
            Verdict::Degraded => "DEGRADED",
            Verdict::Unhealthy => "UNHEALTHY",
            Verdict::Unknown => "UNKNOWN",
        }
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Numbers computed from one window.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug, Default)]
pub struct Stats {
    pub samples: u32,
    /// Share of calls that got an answer (success or contract failure), in [0, 1].
    pub availability: f64,
    /// Share of answers that broke the contract, in percent [0, 100].
    pub contract_failure_pct: f64,
    /// Nearest-rank 95th percentile latency of all calls, timeouts included.
    pub p95_ms: u64,
}

/// Failures (or broken contracts) fewer than this never move a verdict: one among a few is
/// noise, not a degraded target.
pub const MIN_FAILURES: u32 = 2;
/// Latency says DEGRADED only over at least this many samples (one slow call has no p95).
pub const MIN_LATENCY_SAMPLES: u32 = 5;

impl Stats {
    /// Calls that got no answer.
    pub fn failures(&self) -> u32 {
        (f64::from(self.samples) * (1.0 - self.availability)).round() as u32
    }

    /// Answers that broke the contract.
    pub fn contract_failures(&self) -> u32 {
        let answered = f64::from(self.samples) * self.availability;
        (answered * self.contract_failure_pct / 100.0).round() as u32
    }

    /// The DESIGN.md verdict for these numbers, once they rest on enough evidence: a rule on
    /// failures needs `MIN_FAILURES` of them, one on latency `MIN_LATENCY_SAMPLES` samples.
    pub fn verdict(&self) -> Verdict {
        let failing = self.failures() >= MIN_FAILURES;
        let breaking = self.contract_failures() >= MIN_FAILURES;
        let slow = self.samples >= MIN_LATENCY_SAMPLES && self.p95_ms > 1_500;
        if self.samples == 0 {
            Verdict::Unknown
        } else if (failing && self.availability < 0.50)
            || (breaking && self.contract_failure_pct > 20.0)
        {
            Verdict::Unhealthy
        } else if (failing && self.availability < 0.95)
            || (breaking && self.contract_failure_pct > 2.0)
            || slow
        {
            Verdict::Degraded
        } else {
            Verdict::Healthy
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
struct Sample {
    at_ms: u64,
    outcome: Outcome,
    latency_ms: u64,
}

/// A rolling window of outcomes for one provider, as one node sees it.
///
/// Fast recovery, with hysteresis: when a provider that failed `RECOVERY_STREAK` times in a row
/// (an outage: no answer at all, not a flaky one) answers `RECOVERY_STREAK` times in a row, the
/// window forgets the outage (every sample before the streak) and judges it on what it does
/// now, instead of waiting for the outage to age out of the window. At most once per window
/// length: a provider that fails again soon after is judged on its whole window, so one that
/// flaps cannot flip back and forth faster than that.
#[derive(Clone, Debug)]
pub struct Window {
    window_ms: u64,
    samples: VecDeque<Sample>,
    /// When the window last forgot an outage.
    recovered_at_ms: Option<u64>,
}

impl Default for Window {
    fn default() -> Self {
        Window::new(DEFAULT_WINDOW_MS)
    }
}

impl Window {
    pub fn new(window_ms: u64) -> Self {
        Window {
            window_ms,
            samples: VecDeque::new(),
            recovered_at_ms: None,
        }
    }

    /// Record an outcome that finished at `now_ms` after `latency_ms`.
    pub fn record(&mut self, now_ms: u64, outcome: Outcome, latency_ms: u64) {
        self.prune(now_ms);
        if self.samples.len() == MAX_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(Sample {
            at_ms: now_ms,
            outcome,
            latency_ms,
        });
        if outcome == Outcome::Success {
            self.recover(now_ms);
        }
    }

    /// Forget an outage the last `RECOVERY_STREAK` successes ended (see the type's docs).
    fn recover(&mut self, now_ms: u64) {
        let n = self.samples.len();
        let hysteresis = self
            .recovered_at_ms
            .is_some_and(|t| now_ms.saturating_sub(t) < self.window_ms);
        if !hysteresis && self.answers_after_outage() == Some(RECOVERY_STREAK) {
            self.samples.drain(..n - RECOVERY_STREAK);
            self.recovered_at_ms = Some(now_ms);
        }
    }

    /// Answering again after an outage, and not yet judged recovered: a prober checks such a
    /// provider again sooner (at most `RECOVERY_STREAK - 1` extra probes per recovery).
    pub fn recovering(&self) -> bool {
        self.answers_after_outage()
            .is_some_and(|n| n < RECOVERY_STREAK)
    }

    /// The successes in a row that end the window (`RECOVERY_STREAK` at most), when
    /// `RECOVERY_STREAK` failures in a row (errors or timeouts: no answer at all) come just
    /// before them. Longer streaks are no recovery in progress: `None`, found without counting
    /// them (a healthy window holds thousands of successes, and this runs on every sample).
    fn answers_after_outage(&self) -> Option<usize> {
        let answered = self
            .samples
            .iter()
            .rev()
            .take(RECOVERY_STREAK + 1)
            .take_while(|s| s.outcome == Outcome::Success)
            .count();
        if answered == 0 || answered > RECOVERY_STREAK {
            return None;
        }
        let outage = self
            .samples
            .iter()
            .rev()
            .skip(answered)
            .take(RECOVERY_STREAK)
            .filter(|s| matches!(s.outcome, Outcome::Error | Outcome::Timeout))
            .count();
        (outage == RECOVERY_STREAK).then_some(answered)
    }

    fn prune(&mut self, now_ms: u64) {
        while self
            .samples
            .front()
            .is_some_and(|s| now_ms.saturating_sub(s.at_ms) >= self.window_ms)
        {
            self.samples.pop_front();
        }
    }

    /// Stats over the samples no older than the window: `now - at < window`.
    pub fn stats(&self, now_ms: u64) -> Stats {
        let live = || {
            self.samples
                .iter()
                .filter(move |s| s.at_ms <= now_ms && now_ms - s.at_ms < self.window_ms)
        };
        let total = live().count();
        if total == 0 {
            return Stats::default();
        }
        let count = |o: Outcome| live().filter(|s| s.outcome == o).count();
        let successes = count(Outcome::Success);
        let contract_failures = count(Outcome::ContractFailure);
        let answered = successes + contract_failures;
        let mut latencies: Vec<u64> = live().map(|s| s.latency_ms).collect();
        latencies.sort_unstable();
        Stats {
            samples: total as u32,
            availability: answered as f64 / total as f64,
            contract_failure_pct: if answered == 0 {
                0.0
            } else {
                100.0 * contract_failures as f64 / answered as f64
            },
            p95_ms: nearest_rank(&latencies, 95),
        }
    }
}

/// Nearest-rank percentile of sorted values (0 for none).
pub fn nearest_rank(sorted: &[u64], pct: u32) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (pct as usize * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window_with(outcomes: &[(Outcome, u64)]) -> Window {
        let mut w = Window::default();
        for (i, &(o, l)) in outcomes.iter().enumerate() {
            w.record(1_000 + i as u64, o, l);
        }
        w
    }

    #[test]
    fn a_down_provider_that_answers_three_times_in_a_row_is_judged_on_that() {
        let mut w = Window::default();
        for t in 0..10 {
            w.record(1_000 + t * 100, Outcome::Error, 10);
        }
        assert_eq!(w.stats(2_000).verdict(), Verdict::Unhealthy);
        w.record(2_000, Outcome::Success, 10);
        w.record(2_100, Outcome::Success, 10);
        assert!(w.recovering());
        assert_eq!(
            w.stats(2_100).verdict(),
            Verdict::Unhealthy,
            "two are not enough"
        );
        w.record(2_200, Outcome::Success, 10);
        let s = w.stats(2_200);
        assert_eq!((s.verdict(), s.samples), (Verdict::Healthy, 3), "{s:?}");
        assert!(!w.recovering());

        // Failing again inside the window: judged on the whole window until it ages out, even
        // after another streak.
        for t in 0..6 {
            w.record(2_300 + t * 100, Outcome::Error, 10);
        }
        for t in 0..3 {
            w.record(3_000 + t * 100, Outcome::Success, 10);
        }
        assert_eq!(
            w.stats(3_200).verdict(),
            Verdict::Degraded,
            "no second cut: 6 of 12"
        );
        assert_eq!(w.stats(3_200).samples, 12);
        // A window later, it may recover fast again.
        for t in 0..20 {
            w.record(17_300 + t * 100, Outcome::Error, 10);
        }
        for t in 0..3 {
            w.record(19_500 + t * 100, Outcome::Success, 10);
        }
        assert_eq!(w.stats(19_700).verdict(), Verdict::Healthy);
    }

    #[test]
    fn a_flaky_provider_is_not_forgiven_by_a_streak() {
        // Errors one or two at a time are flakiness, not an outage: successes in a row change
        // nothing.
        let mut w = Window::default();
        for (t, o) in [
            Outcome::Error,
            Outcome::Success,
            Outcome::Error,
            Outcome::Error,
        ]
        .into_iter()
        .chain([Outcome::Success; 8])
        .enumerate()
        {
            w.record(1_000 + t as u64 * 100, o, 10);
        }
        let s = w.stats(2_200);
        assert_eq!((s.verdict(), s.samples), (Verdict::Degraded, 12));
        assert!(!w.recovering(), "no outage, so no quicker probes");
        // Answers that break the contract are answers: no outage either.
        let mut w = Window::default();
        for t in 0..5 {
            w.record(1_000 + t * 100, Outcome::ContractFailure, 10);
        }
        for t in 5..8 {
            w.record(1_000 + t * 100, Outcome::Success, 10);
        }
        assert_eq!(w.stats(1_800).samples, 8);
    }

    #[test]
    fn empty_window_is_unknown() {
        let w = Window::default();
        assert_eq!(w.stats(10_000).verdict(), Verdict::Unknown);
    }

    #[test]
    fn all_success_fast_is_healthy() {
        let w = window_with(&[(Outcome::Success, 150); 20]);
        let s = w.stats(2_000);
        assert_eq!(s.availability, 1.0);
        assert_eq!(s.p95_ms, 150);
        assert_eq!(s.verdict(), Verdict::Healthy);
    }

    #[test]
    fn thresholds_follow_design() {
        // 19/20 answered = 95% exactly: still healthy (the rule is "< 95%").
        let mut v = vec![(Outcome::Success, 100); 19];
        v.push((Outcome::Error, 100));
        assert_eq!(window_with(&v).stats(2_000).verdict(), Verdict::Healthy);
        // 18/20 = 90% -> degraded.
        v[0] = (Outcome::Error, 100);
        assert_eq!(window_with(&v).stats(2_000).verdict(), Verdict::Degraded);
        // 9/20 = 45% -> unhealthy (interleaved: three successes in a row would be a recovery).
        let mut v: Vec<(Outcome, u64)> = (0..9)
            .flat_map(|_| [(Outcome::Timeout, 100), (Outcome::Success, 100)])
            .collect();
        v.extend([(Outcome::Timeout, 100); 2]);
        assert_eq!(window_with(&v).stats(2_000).verdict(), Verdict::Unhealthy);
        // contract failures: 2 of 40 answers = 5% -> degraded; 9 of 40 = 22.5% -> unhealthy.
        let mut v = vec![(Outcome::Success, 100); 38];
        v.extend([(Outcome::ContractFailure, 100); 2]);
        assert_eq!(window_with(&v).stats(2_000).verdict(), Verdict::Degraded);
        // (the failures last: successes after them would be a recovery)
        for item in v.iter_mut().skip(31) {
            *item = (Outcome::ContractFailure, 100);
        }
        let s = window_with(&v).stats(2_000);
        assert_eq!(s.contract_failure_pct, 22.5);
        assert_eq!(s.verdict(), Verdict::Unhealthy);
    }

    /// One failure among a few is noise: it moves no verdict (at df30167, one failed sample
    /// among eight made a target DEGRADED and routes skipped it). Two do.
    #[test]
    fn a_verdict_needs_enough_evidence() {
        let mut v = vec![(Outcome::Success, 100); 7];
        v.insert(3, (Outcome::Error, 100));
        let s = window_with(&v).stats(2_000);
        assert_eq!((s.samples, s.failures()), (8, 1));
        assert_eq!(s.verdict(), Verdict::Healthy, "{s:?}");
        v.insert(5, (Outcome::Timeout, 100));
        assert_eq!(window_with(&v).stats(2_000).verdict(), Verdict::Degraded);
        // One failed call alone, or one broken contract among three answers: no verdict moves.
        assert_eq!(
            window_with(&[(Outcome::Error, 100)]).stats(2_000).verdict(),
            Verdict::Healthy
        );
        let one_broken = [
            (Outcome::Success, 100),
            (Outcome::ContractFailure, 100),
            (Outcome::Success, 100),
        ];
        let s = window_with(&one_broken).stats(2_000);
        assert_eq!((s.contract_failures(), s.verdict()), (1, Verdict::Healthy));
        // Two failed calls of two: an outage.
        assert_eq!(
            window_with(&[(Outcome::Error, 100); 2])
                .stats(2_000)
                .verdict(),
            Verdict::Unhealthy
        );
        // One slow call has no p95 to speak of; five do.
        assert_eq!(
            window_with(&[(Outcome::Success, 1_600); 4])
                .stats(2_000)
                .verdict(),
            Verdict::Healthy
        );
        assert_eq!(
            window_with(&[(Outcome::Success, 1_600); 5])
                .stats(2_000)
                .verdict(),
            Verdict::Degraded
        );
    }

    #[test]
    fn timeouts_count_with_their_real_latency() {
        let mut v = vec![(Outcome::Success, 150); 19];
        v.push((Outcome::Timeout, 30_000));
        v.push((Outcome::Timeout, 30_000));
        let s = window_with(&v).stats(2_000);
        assert_eq!(
            s.p95_ms, 30_000,
            "two of 21 timeouts put p95 at the timeout"
        );
        assert_eq!(s.verdict(), Verdict::Degraded);
    }

    #[test]
    fn slow_p95_alone_degrades() {
        let w = window_with(&[(Outcome::Success, 1_600); 10]);
        assert_eq!(w.stats(2_000).verdict(), Verdict::Degraded);
    }

    #[test]
    fn samples_leave_the_window() {
        let mut w = Window::new(15_000);
        w.record(1_000, Outcome::Error, 10);
        w.record(10_000, Outcome::Success, 10);
        assert_eq!(w.stats(10_000).samples, 2);
        assert_eq!(
            w.stats(16_000).samples,
            1,
            "the sample at 1000 expired at 16000"
        );
        assert_eq!(w.stats(16_000).verdict(), Verdict::Healthy);
        assert_eq!(w.stats(25_000).verdict(), Verdict::Unknown);
    }

    #[test]
    fn memory_is_bounded() {
        let mut w = Window::new(u64::MAX / 2);
        for i in 0..(MAX_SAMPLES as u64 + 100) {
            w.record(i, Outcome::Success, 1);
        }
        assert_eq!(w.samples.len(), MAX_SAMPLES);
    }

    #[test]
    fn nearest_rank_matches_definition() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(nearest_rank(&v, 95), 95);
        assert_eq!(nearest_rank(&v, 50), 50);
        assert_eq!(nearest_rank(&[7], 95), 7);
        assert_eq!(nearest_rank(&[1, 2], 95), 2);
    }
}
