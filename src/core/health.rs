//! Provider health: a rolling window of outcomes and the verdict thresholds from DESIGN.md.
//!
//! Probes and live traffic both feed the window. Timeouts are recorded with the time they really
//! took, so p95 reflects a hanging provider instead of hiding it. Pure: `now` is an argument.

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Default rolling window.
pub(crate) const DEFAULT_WINDOW_MS: u64 = 15_000;
/// Memory bound for one window: at 1 probe/s plus heavy traffic this is still minutes of samples.
pub(crate) const MAX_SAMPLES: usize = 4_096;
/// Failures in a row that make an outage, and successes in a row that end it (see `Window`).
pub(crate) const RECOVERY_STREAK: usize = 3;

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

/// What a sample, and a verdict, rests on; weakest first. A free probe (a model list) says
/// only that the provider answers; a billed probe and real traffic say that the model does.
#[derive(
    Serialize, Deserialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default,
)]
#[serde(rename_all = "snake_case")]
pub enum Evidence {
    /// Nothing: the node abstains.
    #[default]
    None,
    Free,
    Billed,
    Traffic,
}

impl Evidence {
    /// Evidence of real calls to the model (what free probes never outvote).
    pub fn paid(self) -> bool {
        self >= Evidence::Billed
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Evidence::None => "none",
            Evidence::Free => "free",
            Evidence::Billed => "billed",
            Evidence::Traffic => "traffic",
        }
    }
}

/// Numbers computed from the evidence about one target.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug, Default)]
pub struct Stats {
    pub samples: u32,
    /// Share of calls that got an answer (success or contract failure), in [0, 1].
    pub availability: f64,
    /// Share of answers that broke the contract, in percent [0, 100].
    pub contract_failure_pct: f64,
    /// Nearest-rank 95th percentile latency of all calls, timeouts included.
    pub p95_ms: u64,
    /// What the numbers rest on.
    #[serde(default)]
    pub evidence: Evidence,
    /// When an outage these numbers no longer count ended (three answers in a row, seen by
    /// some node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovered_at_ms: Option<u64>,
}

/// Failures (or broken contracts) fewer than this never move a verdict: one among a few is
/// noise, not a degraded target.
pub(crate) const MIN_FAILURES: u32 = 2;
/// Latency says DEGRADED only over at least this many samples (one slow call has no p95).
pub(crate) const MIN_LATENCY_SAMPLES: u32 = 5;
/// A p95 above this is DEGRADED.
pub(crate) const SLOW_MS: u64 = 1_500;

impl Stats {
    /// Calls that got no answer.
    pub fn failures(&self) -> u32 {
        (f64::from(self.samples) * (1.0 - self.availability)).round() as u32
    }

    /// Answers that broke the contract.
    pub(crate) fn contract_failures(&self) -> u32 {
        let answered = f64::from(self.samples) * self.availability;
        (answered * self.contract_failure_pct / 100.0).round() as u32
    }

    /// The DESIGN.md verdict for these numbers, once they rest on enough evidence: a rule on
    /// failures needs `MIN_FAILURES` of them, one on latency `MIN_LATENCY_SAMPLES` samples.
    pub fn verdict(&self) -> Verdict {
        let failing = self.failures() >= MIN_FAILURES;
        let breaking = self.contract_failures() >= MIN_FAILURES;
        let slow = self.samples >= MIN_LATENCY_SAMPLES && self.p95_ms > SLOW_MS;
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

/// Counts of one kind of evidence about one target in one node's window: what a node shares
/// of what it saw itself, so nodes judge on the whole cluster's evidence.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Tally {
    pub samples: u32,
    /// Calls that got no answer.
    pub failed: u32,
    /// Answers that broke the contract.
    pub broken: u32,
    pub p95_ms: u64,
    /// Samples slower than `SLOW_MS`: whether the p95 of several nodes' samples together is
    /// over it is exact from these, where a mean of their p95s is not.
    pub slow: u32,
    /// The newest sample (0: none).
    pub last_ms: u64,
    /// The newest failed or broken one (0: none).
    pub last_failure_ms: u64,
}

impl Tally {
    /// Bounded as a window is: a peer's numbers cannot outweigh more than a full window.
    fn clamped(self) -> Tally {
        let samples = self.samples.min(MAX_SAMPLES as u32);
        let failed = self.failed.min(samples);
        Tally {
            samples,
            failed,
            broken: self.broken.min(samples - failed),
            slow: self.slow.min(samples),
            ..self
        }
    }

    /// The same tally without its failures (an outage that ended after them).
    fn forgiven(self) -> Tally {
        Tally {
            samples: self.samples - self.failed - self.broken,
            failed: 0,
            broken: 0,
            last_failure_ms: 0,
            ..self
        }
    }
}

/// What one node saw itself of one target, by kind: shared with every observation.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(default, deny_unknown_fields)]
pub struct FirstHand {
    pub traffic: Tally,
    pub billed: Tally,
    pub free: Tally,
    /// When its paid evidence last ended an outage (see `Window`), if none failed since.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recovered_at_ms: Option<u64>,
}

/// The verdict's numbers from the first-hand evidence of every node that has some (this one's
/// and its live peers'): real calls (traffic and billed probes) when any node made one, the
/// free probes only when none did, so a model list that answers never outvotes a model that
/// fails. An outage that some node saw end (its window's recovery) ends for everyone: the
/// failures others saw before it are forgiven. A peer's p95 is weighed by its sample count.
pub fn judge(sources: &[FirstHand]) -> Stats {
    let paid_failure = |f: &FirstHand| f.traffic.last_failure_ms.max(f.billed.last_failure_ms);
    let recovered_at = sources
        .iter()
        .filter_map(|f| f.recovered_at_ms.filter(|&r| paid_failure(f) < r))
        .max();
    let cut = |t: Tally| match recovered_at {
        Some(r) if t.last_failure_ms < r => t.clamped().forgiven(),
        _ => t.clamped(),
    };
    let sum = |pick: &dyn Fn(&FirstHand) -> Tally, forgive: bool| {
        merged(sources.iter().map(|f| {
            if forgive {
                cut(pick(f))
            } else {
                pick(f).clamped()
            }
        }))
    };
    let traffic = sum(&|f| f.traffic, true);
    let billed = sum(&|f| f.billed, true);
    let (t, evidence) = if traffic.samples > 0 || billed.samples > 0 {
        let e = if traffic.samples > 0 {
            Evidence::Traffic
        } else {
            Evidence::Billed
        };
        (merged([traffic, billed]), e)
    } else {
        let free = sum(&|f| f.free, false);
        if free.samples == 0 {
            return Stats::default();
        }
        (free, Evidence::Free)
    };
    let answered = t.samples - t.failed;
    Stats {
        samples: t.samples,
        availability: f64::from(answered) / f64::from(t.samples),
        contract_failure_pct: if answered == 0 {
            0.0
        } else {
            100.0 * f64::from(t.broken) / f64::from(answered)
        },
        p95_ms: t.p95_ms,
        evidence,
        recovered_at_ms: recovered_at,
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
struct Sample {
    at_ms: u64,
    outcome: Outcome,
    latency_ms: u64,
    source: Evidence,
}

/// A rolling window of one kind of evidence (paid or free) for one provider.
#[derive(Clone, Debug, Default)]
struct Samples {
    samples: VecDeque<Sample>,
    /// When the window last forgot an outage.
    recovered_at_ms: Option<u64>,
}

/// A rolling window of outcomes for one provider, as one node sees it: real calls (traffic and
/// billed probes) and free probes apart, since only the first say that the model answers.
///
/// Fast recovery, with hysteresis, in each: when a provider that failed `RECOVERY_STREAK`
/// times in a row (an outage: no answer at all, not a flaky one) answers `RECOVERY_STREAK`
/// times in a row, the window forgets the outage (every sample before the streak) and judges
/// it on what it does now, instead of waiting for the outage to age out of the window. At most
/// once per window length: a provider that fails again soon after is judged on its whole
/// window, so one that flaps cannot flip back and forth faster than that. A free answer never
/// ends an outage of real calls.
#[derive(Clone, Debug)]
pub(crate) struct Window {
    window_ms: u64,
    paid: Samples,
    free: Samples,
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
            paid: Samples::default(),
            free: Samples::default(),
        }
    }

    /// Record an outcome that finished at `now_ms` after `latency_ms`, from `source` (what it
    /// was: traffic, a billed or a free probe).
    pub fn record(&mut self, now_ms: u64, source: Evidence, outcome: Outcome, latency_ms: u64) {
        let window_ms = self.window_ms;
        let class = match source {
            Evidence::Free | Evidence::None => &mut self.free,
            Evidence::Billed | Evidence::Traffic => &mut self.paid,
        };
        class.prune(now_ms, window_ms);
        if class.samples.len() == MAX_SAMPLES {
            class.samples.pop_front();
        }
        class.samples.push_back(Sample {
            at_ms: now_ms,
            outcome,
            latency_ms,
            source,
        });
        if outcome == Outcome::Success {
            class.recover(now_ms, window_ms);
        }
    }

    /// Answering again after an outage, and not yet judged recovered (in either kind): a
    /// prober checks such a provider again sooner (at most `RECOVERY_STREAK - 1` extra probes
    /// per recovery).
    pub fn recovering(&self) -> bool {
        [&self.paid, &self.free].into_iter().any(|c| {
            c.answers_after_outage()
                .is_some_and(|n| n < RECOVERY_STREAK)
        })
    }

    /// What this node saw itself at `now`, by kind.
    pub fn first_hand(&self, now_ms: u64) -> FirstHand {
        let w = self.window_ms;
        let recovered_at_ms = self.paid.recovered_at_ms.filter(|&r| {
            now_ms.saturating_sub(r) < w
                && self.paid.samples.iter().all(|s| {
                    s.at_ms < r
                        || !matches!(
                            s.outcome,
                            Outcome::Error | Outcome::Timeout | Outcome::ContractFailure
                        )
                })
        });
        FirstHand {
            traffic: self.paid.tally(now_ms, w, Evidence::Traffic),
            billed: self.paid.tally(now_ms, w, Evidence::Billed),
            free: self.free.tally(now_ms, w, Evidence::Free),
            recovered_at_ms,
        }
    }

    /// The numbers of this window alone (`judge` of this node's evidence).
    #[cfg(test)]
    pub fn stats(&self, now_ms: u64) -> Stats {
        judge(&[self.first_hand(now_ms)])
    }
}

impl Samples {
    /// Forget an outage the last `RECOVERY_STREAK` successes ended (see `Window`).
    fn recover(&mut self, now_ms: u64, window_ms: u64) {
        let n = self.samples.len();
        let hysteresis = self
            .recovered_at_ms
            .is_some_and(|t| now_ms.saturating_sub(t) < window_ms);
        if !hysteresis && self.answers_after_outage() == Some(RECOVERY_STREAK) {
            self.samples.drain(..n - RECOVERY_STREAK);
            self.recovered_at_ms = Some(now_ms);
        }
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

    fn prune(&mut self, now_ms: u64, window_ms: u64) {
        while self
            .samples
            .front()
            .is_some_and(|s| now_ms.saturating_sub(s.at_ms) >= window_ms)
        {
            self.samples.pop_front();
        }
    }

    /// The samples of `source` no older than the window (`now - at < window`), counted.
    fn tally(&self, now_ms: u64, window_ms: u64, source: Evidence) -> Tally {
        let live = || {
            self.samples.iter().filter(move |s| {
                s.source == source && s.at_ms <= now_ms && now_ms - s.at_ms < window_ms
            })
        };
        let mut t = Tally::default();
        let mut latencies = Vec::new();
        for s in live() {
            t.samples += 1;
            match s.outcome {
                Outcome::Success => {}
                Outcome::ContractFailure => t.broken += 1,
                Outcome::Error | Outcome::Timeout => t.failed += 1,
            }
            if s.outcome != Outcome::Success {
                t.last_failure_ms = s.at_ms;
            }
            t.last_ms = s.at_ms;
            if s.latency_ms > SLOW_MS {
                t.slow += 1;
            }
            latencies.push(s.latency_ms);
        }
        latencies.sort_unstable();
        t.p95_ms = nearest_rank(&latencies, 95);
        t
    }
}

/// Several tallies as one: their counts summed, their p95 as `union_p95` says.
fn merged(tallies: impl IntoIterator<Item = Tally>) -> Tally {
    let mut total = Tally::default();
    let mut weighted_p95 = 0.0;
    let mut slowest = 0;
    for t in tallies {
        total.samples += t.samples;
        total.failed += t.failed;
        total.broken += t.broken;
        total.slow += t.slow.min(t.samples);
        weighted_p95 += t.p95_ms as f64 * f64::from(t.samples);
        slowest = slowest.max(t.p95_ms);
    }
    if total.samples > 0 {
        let mean = (weighted_p95 / f64::from(total.samples)).round() as u64;
        total.p95_ms = union_p95(total.samples, total.slow, mean, slowest);
    }
    total
}

/// The p95 of `samples` samples of several windows together, `slow` of them over `SLOW_MS`:
/// over `SLOW_MS` exactly when the union's nearest-rank p95 is (then at least the slowest
/// window's p95), else the windows' p95s weighed by their samples, at most `SLOW_MS`.
fn union_p95(samples: u32, slow: u32, weighted: u64, slowest: u64) -> u64 {
    let rank = (95 * samples).div_ceil(100).max(1);
    if samples - slow.min(samples) < rank {
        slowest.max(weighted).max(SLOW_MS + 1)
    } else {
        weighted.min(SLOW_MS)
    }
}

/// Nearest-rank percentile of sorted values (0 for none).
pub(crate) fn nearest_rank(sorted: &[u64], pct: u32) -> u64 {
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
            w.record(1_000 + i as u64, Evidence::Traffic, o, l);
        }
        w
    }

    #[test]
    fn a_down_provider_that_answers_three_times_in_a_row_is_judged_on_that() {
        let mut w = Window::default();
        for t in 0..10 {
            w.record(1_000 + t * 100, Evidence::Traffic, Outcome::Error, 10);
        }
        assert_eq!(w.stats(2_000).verdict(), Verdict::Unhealthy);
        w.record(2_000, Evidence::Traffic, Outcome::Success, 10);
        w.record(2_100, Evidence::Traffic, Outcome::Success, 10);
        assert!(w.recovering());
        assert_eq!(
            w.stats(2_100).verdict(),
            Verdict::Unhealthy,
            "two are not enough"
        );
        w.record(2_200, Evidence::Traffic, Outcome::Success, 10);
        let s = w.stats(2_200);
        assert_eq!((s.verdict(), s.samples), (Verdict::Healthy, 3), "{s:?}");
        assert!(!w.recovering());

        // Failing again inside the window: judged on the whole window until it ages out, even
        // after another streak.
        for t in 0..6 {
            w.record(2_300 + t * 100, Evidence::Traffic, Outcome::Error, 10);
        }
        for t in 0..3 {
            w.record(3_000 + t * 100, Evidence::Traffic, Outcome::Success, 10);
        }
        assert_eq!(
            w.stats(3_200).verdict(),
            Verdict::Degraded,
            "no second cut: 6 of 12"
        );
        assert_eq!(w.stats(3_200).samples, 12);
        // A window later, it may recover fast again.
        for t in 0..20 {
            w.record(17_300 + t * 100, Evidence::Traffic, Outcome::Error, 10);
        }
        for t in 0..3 {
            w.record(19_500 + t * 100, Evidence::Traffic, Outcome::Success, 10);
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
            w.record(1_000 + t as u64 * 100, Evidence::Traffic, o, 10);
        }
        let s = w.stats(2_200);
        assert_eq!((s.verdict(), s.samples), (Verdict::Degraded, 12));
        assert!(!w.recovering(), "no outage, so no quicker probes");
        // Answers that break the contract are answers: no outage either.
        let mut w = Window::default();
        for t in 0..5 {
            w.record(
                1_000 + t * 100,
                Evidence::Traffic,
                Outcome::ContractFailure,
                10,
            );
        }
        for t in 5..8 {
            w.record(1_000 + t * 100, Evidence::Traffic, Outcome::Success, 10);
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
        w.record(1_000, Evidence::Traffic, Outcome::Error, 10);
        w.record(10_000, Evidence::Traffic, Outcome::Success, 10);
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
            w.record(i, Evidence::Traffic, Outcome::Success, 1);
        }
        assert_eq!(w.paid.samples.len(), MAX_SAMPLES);
    }

    /// The free model list answers while the model fails for the node that serves traffic:
    /// every node judging on the cluster's evidence finds it unhealthy, and a node with no
    /// evidence at all has no verdict to give (it abstains).
    #[test]
    fn free_probes_never_outvote_real_failures() {
        let mut idle = Window::default();
        for t in 0..10 {
            idle.record(1_000 + t * 1_000, Evidence::Free, Outcome::Success, 20);
        }
        let alone = idle.stats(11_000);
        assert_eq!(
            (alone.verdict(), alone.evidence),
            (Verdict::Healthy, Evidence::Free)
        );
        let mut serving = Window::default();
        for t in 0..6 {
            serving.record(5_000 + t * 500, Evidence::Traffic, Outcome::Error, 30);
        }
        let peer = serving.first_hand(11_000);
        assert_eq!((peer.traffic.samples, peer.traffic.failed), (6, 6));
        let s = judge(&[idle.first_hand(11_000), peer]);
        assert_eq!(
            (s.verdict(), s.evidence, s.samples),
            (Verdict::Unhealthy, Evidence::Traffic, 6)
        );
        // Billed probes are real calls: they count beside traffic.
        let mut billing = Window::default();
        for t in 0..4 {
            billing.record(6_000 + t * 1_000, Evidence::Billed, Outcome::Success, 40);
        }
        let s = judge(&[peer, billing.first_hand(11_000)]);
        assert_eq!(
            (s.samples, s.failures(), s.evidence),
            (10, 6, Evidence::Traffic)
        );
        let none = judge(&[Window::default().first_hand(11_000)]);
        assert_eq!(
            (none.verdict(), none.evidence),
            (Verdict::Unknown, Evidence::None)
        );
        assert_eq!(judge(&[]).verdict(), Verdict::Unknown);
    }

    /// A model list that answers does not end an outage of the model: only real answers do.
    #[test]
    fn a_free_answer_ends_no_outage_of_real_calls() {
        let mut w = Window::default();
        for t in 0..5 {
            w.record(1_000 + t * 100, Evidence::Traffic, Outcome::Error, 10);
        }
        for t in 0..5 {
            w.record(2_000 + t * 100, Evidence::Free, Outcome::Success, 10);
        }
        let s = w.stats(3_000);
        assert_eq!(
            (s.verdict(), s.evidence),
            (Verdict::Unhealthy, Evidence::Traffic)
        );
        assert_eq!(w.first_hand(3_000).recovered_at_ms, None);
        for t in 0..3 {
            w.record(3_000 + t * 100, Evidence::Billed, Outcome::Success, 10);
        }
        let s = w.stats(3_200);
        assert_eq!(
            (s.verdict(), s.samples, s.evidence),
            (Verdict::Healthy, 3, Evidence::Billed)
        );
        assert_eq!(w.first_hand(3_200).recovered_at_ms, Some(3_200));
    }

    /// The node that probes a failed target sees it answer three times in a row after its
    /// outage: the failures every other node saw before that are forgiven, so the cluster comes
    /// back together instead of when their samples age out. Failures after it are not.
    #[test]
    fn an_outage_one_node_saw_end_ends_for_the_cluster() {
        let mut serving = Window::default();
        for t in 0..8 {
            serving.record(1_000 + t * 200, Evidence::Traffic, Outcome::Error, 30);
        }
        let mut prober = Window::default();
        for t in 0..3 {
            prober.record(2_000 + t * 1_000, Evidence::Billed, Outcome::Error, 30);
        }
        for t in 0..3 {
            prober.record(5_000 + t * 1_000, Evidence::Billed, Outcome::Success, 30);
        }
        let s = judge(&[serving.first_hand(7_500), prober.first_hand(7_500)]);
        assert_eq!(s.recovered_at_ms, Some(7_000));
        assert_eq!(
            (s.verdict(), s.samples, s.failures()),
            (Verdict::Healthy, 3, 0),
            "{s:?}"
        );
        // A failure after the recovery stands.
        serving.record(7_600, Evidence::Traffic, Outcome::Error, 30);
        let s = judge(&[serving.first_hand(7_700), prober.first_hand(7_700)]);
        assert_eq!(s.failures(), 9, "{s:?}");
        assert_eq!(s.verdict(), Verdict::Unhealthy);
    }

    /// A peer's tally is bounded as a window is: no claim of four billion failures outweighs
    /// more than one full window, and counts that do not add up are cut to what can be.
    #[test]
    fn a_peers_tally_is_bounded() {
        let lie = FirstHand {
            traffic: Tally {
                samples: u32::MAX,
                failed: u32::MAX,
                broken: u32::MAX,
                p95_ms: 10,
                slow: u32::MAX,
                last_ms: 1,
                last_failure_ms: 1,
            },
            ..FirstHand::default()
        };
        let mut w = Window::default();
        for t in 0..100 {
            w.record(1_000 + t, Evidence::Traffic, Outcome::Success, 10);
        }
        let s = judge(&[lie, w.first_hand(2_000)]);
        assert_eq!(s.samples, MAX_SAMPLES as u32 + 100);
        assert_eq!(s.failures(), MAX_SAMPLES as u32);
        assert_eq!(s.contract_failure_pct, 0.0);
    }

    /// A peer's p95 counts by how many samples it rests on: one timed-out call somewhere does
    /// not make a thousand fast ones slow.
    #[test]
    fn p95_across_nodes_is_weighed_by_samples() {
        let mut fast = Window::default();
        for t in 0..99 {
            fast.record(1_000 + t, Evidence::Traffic, Outcome::Success, 100);
        }
        let mut slow = Window::default();
        slow.record(1_500, Evidence::Traffic, Outcome::Success, 10_100);
        let s = judge(&[fast.first_hand(2_000), slow.first_hand(2_000)]);
        assert_eq!(s.p95_ms, 200);
        assert_eq!(s.verdict(), Verdict::Healthy);
    }

    /// Slowness that shows on one node first is the cluster's once its slow samples are over
    /// 5% of everyone's, though a mean of the nodes' p95s would still look fast.
    #[test]
    fn slow_samples_count_across_nodes_exactly() {
        let fast = || {
            let mut w = Window::default();
            for t in 0..20 {
                w.record(1_000 + t, Evidence::Traffic, Outcome::Success, 60);
            }
            w
        };
        let (b, c) = (fast(), fast());
        let mut a = Window::default();
        a.record(1_100, Evidence::Traffic, Outcome::Success, 60);
        a.record(1_200, Evidence::Traffic, Outcome::Success, 3_000);
        // 1 slow of 42: fast.
        let s = judge(&[
            a.first_hand(2_000),
            b.first_hand(2_000),
            c.first_hand(2_000),
        ]);
        assert!(s.p95_ms <= SLOW_MS, "{s:?}");
        assert_eq!(s.verdict(), Verdict::Healthy);
        a.record(1_300, Evidence::Traffic, Outcome::Success, 3_000);
        a.record(1_400, Evidence::Traffic, Outcome::Success, 3_000);
        // 3 slow of 44 (7%): slow, though the p95s' mean is (3000*4 + 60*40) / 44, about 327.
        let s = judge(&[
            a.first_hand(2_000),
            b.first_hand(2_000),
            c.first_hand(2_000),
        ]);
        assert!(s.p95_ms > SLOW_MS, "{s:?}");
        assert_eq!(s.verdict(), Verdict::Degraded);
        // Beside many more fast samples (3 of 64: under 5%), fast again.
        let s = judge(&[
            a.first_hand(2_000),
            b.first_hand(2_000),
            c.first_hand(2_000),
            fast().first_hand(2_000),
        ]);
        assert!(s.p95_ms <= SLOW_MS, "{s:?}");
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
