//! Scored routing: the DESIGN.md score and the deliberate tie-break.
//!
//! ```text
//! S(p) = 40*a + L + H - 0.4*c + K - F
//! ```
//!
//! a availability in [0,1]; c contract-failure %; L +20 if p95 <= the latency budget else -20;
//! H 25 HEALTHY, 5 DEGRADED, 0 UNKNOWN; K +10 zero-cost, +5 within the request's cost limit;
//! F 5 for a fallback, 20 when the task is high-risk. Exclusions happen before scoring (pipeline).
//!
//! Tie-break: scores within `TIE_MARGIN` of the best are a tie, and a tie goes to the provider
//! listed first in the provider table (the operator's order of preference; never map order).
//! With the defaults a healthy paid primary and a healthy zero-cost fallback score exactly the same
//! (90), so without a margin one failed probe (40/n points of availability while still HEALTHY)
//! would move all traffic to the fallback and the next good probe would move it back. The margin
//! equals the fallback penalty: a provider listed later wins only when it is clearly better.
//!
//! The default table is `primary, local, secondary`: when the primary is out, low-risk traffic
//! takes the zero-cost path (local ties secondary and is listed first), while high-risk traffic,
//! where the fallback penalty is 20, goes to the paid secondary.

use super::health::Verdict;
use super::quorum::ProviderView;
use super::reason::ReasonCode;
use serde::{Deserialize, Serialize};

/// Scores this close to the best are treated as equal.
pub(crate) const TIE_MARGIN: f64 = 5.0;

/// The parts of a score, so a decision can show why.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug)]
pub struct ScoreParts {
    pub availability: f64,
    pub latency: f64,
    pub health: f64,
    pub contract: f64,
    pub cost: f64,
    pub fallback: f64,
    pub total: f64,
}

pub(crate) struct ScoreInput<'a> {
    pub view: &'a ProviderView,
    pub latency_budget_ms: u64,
    pub zero_cost: bool,
    pub within_cost_limit: bool,
    pub fallback: bool,
    pub high_risk: bool,
}

pub(crate) fn score(i: &ScoreInput<'_>) -> ScoreParts {
    let availability = 40.0 * i.view.availability;
    let latency = if i.view.p95_ms <= i.latency_budget_ms {
        20.0
    } else {
        -20.0
    };
    let health = match i.view.verdict {
        Verdict::Healthy => 25.0,
        Verdict::Degraded => 5.0,
        Verdict::Unknown | Verdict::Unhealthy => 0.0,
    };
    let contract = 0.0 - 0.4 * i.view.contract_failure_pct; // never -0.0 in output
    let cost = if i.zero_cost {
        10.0
    } else if i.within_cost_limit {
        5.0
    } else {
        0.0
    };
    let fallback = match (i.fallback, i.high_risk) {
        (false, _) => 0.0,
        (true, false) => -5.0,
        (true, true) => -20.0,
    };
    ScoreParts {
        availability,
        latency,
        health,
        contract,
        cost,
        fallback,
        total: availability + latency + health + contract + cost + fallback,
    }
}

/// The codes a provider's view contributes to a decision that uses it.
pub(crate) fn health_codes(view: &ProviderView) -> Vec<ReasonCode> {
    let mut codes = Vec::new();
    match view.verdict {
        Verdict::Degraded => codes.push(ReasonCode::ProviderDegraded),
        Verdict::Unknown => codes.push(ReasonCode::ProviderHealthUnknown),
        Verdict::Unhealthy => codes.push(ReasonCode::ProviderUnhealthy),
        Verdict::Healthy => {}
    }
    if !view.quorum {
        codes.push(ReasonCode::NoQuorumLocalView);
    }
    codes
}

/// Pick among scored candidates `(table_index, score)`: everything within `TIE_MARGIN` of the
/// best score ties, and the tie goes to the lowest table index.
pub fn select(scored: impl Iterator<Item = (usize, f64)> + Clone) -> Option<usize> {
    let best = scored
        .clone()
        .map(|s| s.1)
        .fold(f64::NEG_INFINITY, f64::max);
    scored
        .filter(|s| s.1 >= best - TIE_MARGIN)
        .map(|s| s.0)
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(verdict: Verdict, availability: f64, cfp: f64, p95_ms: u64) -> ProviderView {
        ProviderView {
            verdict,
            votes: 3,
            voters: 3,
            cluster_size: 3,
            quorum: true,
            availability,
            contract_failure_pct: cfp,
            p95_ms,
        }
    }

    fn input(v: &ProviderView, zero_cost: bool, fallback: bool, high_risk: bool) -> ScoreInput<'_> {
        ScoreInput {
            view: v,
            latency_budget_ms: 1_500,
            zero_cost,
            within_cost_limit: true,
            fallback,
            high_risk,
        }
    }

    #[test]
    fn formula_matches_design() {
        let healthy = view(Verdict::Healthy, 1.0, 0.0, 200);
        assert_eq!(score(&input(&healthy, false, false, false)).total, 90.0);
        assert_eq!(score(&input(&healthy, true, true, false)).total, 90.0);
        assert_eq!(score(&input(&healthy, true, true, true)).total, 75.0);
        let degraded = view(Verdict::Degraded, 0.9, 10.0, 2_000);
        // 36 - 20 + 5 - 4 + 5 = 22
        let p = score(&input(&degraded, false, false, false));
        assert!((p.total - 22.0).abs() < 1e-9, "{p:?}");
        let unknown = view(Verdict::Unknown, 0.0, 0.0, 0);
        assert_eq!(score(&input(&unknown, false, false, false)).total, 25.0);
        let mut over = input(&healthy, false, false, false);
        over.within_cost_limit = false;
        assert_eq!(score(&over).total, 85.0);
    }

    #[test]
    fn healthy_primary_and_zero_cost_fallback_do_not_flip_on_one_bad_probe() {
        let fallback = score(&input(
            &view(Verdict::Healthy, 1.0, 0.0, 150),
            true,
            true,
            false,
        ))
        .total;
        // One failure in 15 samples would degrade the verdict (93% < 95%); one in 20+ stays
        // HEALTHY but costs 40/n points.
        for n in [20.0, 30.0, 60.0] {
            let primary = score(&input(
                &view(Verdict::Healthy, 1.0 - 1.0 / n, 0.0, 150),
                false,
                false,
                false,
            ))
            .total;
            assert!(primary < fallback);
            assert_eq!(select([(0, primary), (1, fallback)].into_iter()), Some(0));
        }
        // A really sick primary does lose.
        let sick = score(&input(
            &view(Verdict::Degraded, 0.9, 0.0, 150),
            false,
            false,
            false,
        ))
        .total;
        assert_eq!(select([(0, sick), (1, fallback)].into_iter()), Some(1));
    }

    #[test]
    fn ties_go_to_table_order_not_map_order() {
        assert_eq!(select([(3, 80.0), (1, 80.0)].into_iter()), Some(1));
        assert_eq!(select([(1, 90.0), (0, 86.0)].into_iter()), Some(0));
        assert_eq!(select([(1, 90.0), (0, 84.9)].into_iter()), Some(1));
        assert_eq!(select([].into_iter()), None);
    }

    #[test]
    fn health_codes_name_verdict_and_quorum() {
        let mut v = view(Verdict::Degraded, 0.9, 0.0, 10);
        assert_eq!(health_codes(&v), vec![ReasonCode::ProviderDegraded]);
        v.quorum = false;
        v.verdict = Verdict::Healthy;
        assert_eq!(health_codes(&v), vec![ReasonCode::NoQuorumLocalView]);
    }
}
