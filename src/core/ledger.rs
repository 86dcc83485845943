//! The cluster's shared budget ledger: one record per budget (an agent's, or the global one),
//! kept in a store every node writes with compare-and-swap. A node *holds* the cost of the
//! attempts it has under way (reserved before dispatch, settled with the actual cost after);
//! a hold carries a lease, so the holds of a node that died stop counting once it ends.
//!
//! Spend across the cluster stays within the limit plus what one settlement can exceed its
//! reservation by: a reservation is granted only if the limit covers everything spent and
//! everything held by live leases.

use super::budget::{Budget, OnExceeded, Override, Owner};
use super::request::round_usd;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A share is not taken when what is left allows less than this part of what it was sized
/// for.
pub(crate) const SHARE_FLOOR: f64 = 128.0;

/// Float slack for comparing dollar amounts (as in `budget`).
const EPSILON_USD: f64 = 1e-9;

/// One budget as the cluster shares it.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct Ledger {
    /// Whose budget it is; none for the global one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    pub limit_usd: f64,
    #[serde(default)]
    pub spent_usd: f64,
    /// Holder (one run of a node, `{node}#{run}`) -> what it holds for attempts under way.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub holds: BTreeMap<String, Hold>,
    /// Holder -> the last of its settlements applied here: a settlement written again (its
    /// write was taken but the acknowledgement lost) is applied once.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settled: BTreeMap<String, Settled>,
    /// The exhaustion episode under way: the first refusal that was escalated, claimed by one
    /// node for the cluster. An operator's `set` or `reset` ends it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<Refused>,
    /// When this record began its current episode: made, or set or reset by an operator (the
    /// name of its exhaustion escalation, the same on every node). None: written before
    /// episodes were named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_ms: Option<u64>,
    /// What holders no longer listed in `settled` charged (their entries aged out): with the
    /// listed holders' `usd`, the sum of every settlement since the last reset, which `spent_usd`
    /// equals (`oam spend --verify` checks it).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub earlier_usd: f64,
    /// The team or the task whose budget it is (with `agent`: none of them for the global
    /// one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    #[serde(default, skip_serializing_if = "OnExceeded::is_refuse")]
    pub on_exceeded: OnExceeded,
    #[serde(default, rename = "override", skip_serializing_if = "Option::is_none")]
    pub overridden: Option<Override>,
    /// Reservations granted past the limit because the budget is in audit mode, since the
    /// last reset: what it would have refused.
    #[serde(default, skip_serializing_if = "is_zero_count")]
    pub would_refuse: u64,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// The refusal that opened an exhaustion episode, and its escalation.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Refused {
    pub at_ms: u64,
    /// The node that raised it.
    pub node: String,
    pub escalation: String,
    pub estimate_usd: f64,
    pub remaining_usd: f64,
}

/// The last settlement of one holder a record applied.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Settled {
    /// Its sequence number (a holder numbers its settlements from 1, in the order it sends
    /// them).
    pub seq: u64,
    pub at_ms: u64,
    /// What this holder's settlements charged this record since its last reset...
    #[serde(default)]
    pub usd: f64,
    /// ...which came after this one of its settlements (0: all of them).
    #[serde(default, skip_serializing_if = "is_zero_count")]
    pub after: u64,
}

fn is_zero_count(v: &u64) -> bool {
    *v == 0
}

/// How long a holder's last settlement is remembered: far longer than any settlement is tried
/// again (an hour would do for that), so that a week of settlements can be checked against
/// the decision log by holder.
pub(crate) const SETTLED_KEPT_MS: u64 = 7 * 24 * 3_600_000;
/// Holders remembered at most (a node restarted over and over must not grow every write):
/// beyond it the longest quiet ones are folded into `earlier_usd`.
pub(crate) const SETTLED_KEPT: usize = 64;

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Hold {
    pub usd: f64,
    /// The hold stops counting after this (its node renews it while it lives).
    pub until_ms: u64,
}

impl Ledger {
    pub fn new(limit_usd: f64) -> Self {
        Ledger {
            limit_usd,
            ..Ledger::default()
        }
    }

    /// A new record of `owner`'s budget.
    pub fn of(owner: &Owner, limit_usd: f64) -> Self {
        let mut l = Ledger::new(limit_usd);
        l.set_owner(owner);
        l
    }

    /// Whose budget it is.
    pub fn owner(&self) -> Owner {
        Owner::of_names(&self.agent, &self.team, &self.task)
    }

    pub fn set_owner(&mut self, owner: &Owner) {
        [self.agent, self.team, self.task] = owner.names();
    }

    /// The limit at `now_ms`: the override's while it stands.
    pub fn limit_at(&self, now_ms: u64) -> f64 {
        Override::limit_at(self.overridden, self.limit_usd, now_ms)
    }

    /// What live holds (other than `except`'s) hold at `now_ms`.
    pub fn held_usd(&self, now_ms: u64, except: Option<&str>) -> f64 {
        let sum: f64 = self
            .holds
            .iter()
            .filter(|(node, h)| h.until_ms > now_ms && Some(node.as_str()) != except)
            .map(|(_, h)| h.usd)
            .sum();
        round_usd(sum)
    }

    pub fn remaining_usd(&self, now_ms: u64) -> f64 {
        round_usd((self.limit_at(now_ms) - self.spent_usd - self.held_usd(now_ms, None)).max(0.0))
    }

    /// Hold `usd` for `node` if the limit covers it beside everything spent and held (in audit
    /// mode: whether or not, counting in `would_refuse` what it would have refused); renews
    /// the node's lease either way it is granted. Expired holds are dropped first.
    pub fn reserve(&mut self, node: &str, usd: f64, now_ms: u64, lease_ms: u64) -> bool {
        self.expire(now_ms);
        if usd > self.remaining_usd(now_ms) + EPSILON_USD {
            if self.on_exceeded != OnExceeded::Audit {
                return false;
            }
            self.would_refuse += 1;
        }
        let hold = self.holds.entry(node.to_string()).or_insert(Hold {
            usd: 0.0,
            until_ms: 0,
        });
        hold.usd = round_usd(hold.usd + usd);
        hold.until_ms = now_ms + lease_ms;
        true
    }

    /// How much more a node may take as its share beside what its reservations need: what is
    /// left over `parts`, at most `cap`; nothing when that is under `cap / SHARE_FLOOR` (near
    /// the limit every reservation is written, and no node sits on what another could spend).
    /// Never refused.
    pub fn share_extra(&self, now_ms: u64, parts: u32, cap: f64) -> f64 {
        let share = (self.remaining_usd(now_ms) / f64::from(parts.max(1))).min(cap.max(0.0));
        if share < cap / SHARE_FLOOR {
            0.0
        } else {
            round_usd(share)
        }
    }

    /// Release `reserved_usd` of `node`'s hold and charge `actual_usd` (which may have been
    /// spent without a hold: a node that could not reach the ledger spends its local share and
    /// settles later).
    pub fn settle(&mut self, node: &str, reserved_usd: f64, actual_usd: f64, now_ms: u64) {
        self.expire(now_ms);
        if let Some(h) = self.holds.get_mut(node) {
            h.usd = round_usd((h.usd - reserved_usd).max(0.0));
            if h.usd <= EPSILON_USD {
                self.holds.remove(node);
            }
        }
        self.spent_usd = round_usd(self.spent_usd + actual_usd);
    }

    /// `settle`, unless this record has applied settlement `seq` of `node` (or a later one)
    /// already; whether it was applied now.
    pub fn settle_once(
        &mut self,
        node: &str,
        seq: u64,
        reserved_usd: f64,
        actual_usd: f64,
        now_ms: u64,
    ) -> bool {
        if self.settled.get(node).is_some_and(|s| s.seq >= seq) {
            return false;
        }
        self.settle(node, reserved_usd, actual_usd, now_ms);
        let (usd, after) = self
            .settled
            .get(node)
            .map_or((0.0, 0), |s| (s.usd, s.after));
        self.settled.insert(
            node.to_string(),
            Settled {
                seq,
                at_ms: now_ms,
                usd: round_usd(usd + actual_usd),
                after,
            },
        );
        true
    }

    /// An operator's reset: nothing spent since. Each holder's count of settlements stays
    /// (so none is applied again), what it charged starts from zero.
    pub fn reset_spent(&mut self) {
        self.spent_usd = 0.0;
        self.would_refuse = 0;
        self.earlier_usd = 0.0;
        for s in self.settled.values_mut() {
            s.usd = 0.0;
            s.after = s.seq;
        }
    }

    /// What the remembered settlements add up to: `spent_usd` when the record is whole.
    pub fn settled_usd(&self) -> f64 {
        round_usd(self.earlier_usd + self.settled.values().map(|s| s.usd).sum::<f64>())
    }

    /// Extend `node`'s lease (it is alive and still holds what it held). False if it holds
    /// nothing here.
    pub fn renew(&mut self, node: &str, now_ms: u64, lease_ms: u64) -> bool {
        self.expire(now_ms);
        match self.holds.get_mut(node) {
            Some(h) => {
                h.until_ms = now_ms + lease_ms;
                true
            }
            None => false,
        }
    }

    /// Drop the holds whose lease ended, and settlements too old to be tried again.
    pub fn expire(&mut self, now_ms: u64) {
        self.holds.retain(|_, h| h.until_ms > now_ms);
        let mut gone = 0.0;
        self.settled.retain(|_, s| {
            let kept = s.at_ms.saturating_add(SETTLED_KEPT_MS) > now_ms;
            if !kept {
                gone += s.usd;
            }
            kept
        });
        while self.settled.len() > SETTLED_KEPT {
            let Some(oldest) = self
                .settled
                .iter()
                .min_by_key(|(_, s)| s.at_ms)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            gone += self.settled.remove(&oldest).map_or(0.0, |s| s.usd);
        }
        if gone > 0.0 {
            self.earlier_usd = round_usd(self.earlier_usd + gone);
        }
    }

    /// The budget as `node`'s engine sees it: everyone else's live holds count as spent (its
    /// own reservations it keeps itself, as `reserved`).
    pub fn view_for(&self, node: &str, now_ms: u64, reserved_usd: f64) -> Budget {
        Budget {
            limit_usd: self.limit_usd,
            spent_usd: round_usd(self.spent_usd + self.held_usd(now_ms, Some(node))),
            reserved_usd,
            refused_at_ms: self.refused.as_ref().map(|r| r.at_ms),
            since_ms: self.since_ms,
            on_exceeded: self.on_exceeded,
            overridden: self.overridden,
            would_refuse: self.would_refuse,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::budget::Kind;
    use proptest::prelude::*;

    #[test]
    fn a_reservation_needs_the_limit_to_cover_spend_and_every_live_hold() {
        let mut l = Ledger::new(1.0);
        assert!(l.reserve("n1", 0.6, 0, 1_000));
        assert!(!l.reserve("n2", 0.5, 10, 1_000), "0.6 held, 0.4 left");
        assert!(l.reserve("n2", 0.4, 10, 1_000));
        assert_eq!(l.remaining_usd(10), 0.0);
        l.settle("n1", 0.6, 0.1, 20);
        assert_eq!(l.spent_usd, 0.1);
        assert!(
            !l.holds.contains_key("n1"),
            "a hold settled to zero is gone"
        );
        assert!((l.remaining_usd(20) - 0.5).abs() < 1e-9);
    }

    #[test]
    fn an_audit_budget_grants_past_its_limit_and_counts_it() {
        let mut l = Ledger::new(1.0);
        l.on_exceeded = OnExceeded::Audit;
        assert!(l.reserve("n1", 0.8, 0, 1_000));
        assert_eq!(l.would_refuse, 0);
        assert!(l.reserve("n2", 0.5, 0, 1_000), "past the limit, granted");
        assert_eq!(l.would_refuse, 1);
        l.reset_spent();
        assert_eq!(l.would_refuse, 0, "a reset starts the count again");
        l.on_exceeded = OnExceeded::Escalate;
        assert!(
            !l.reserve("n3", 0.5, 0, 1_000),
            "escalate refuses as refuse does"
        );
    }

    #[test]
    fn an_override_lifts_the_limit_until_it_expires() {
        let mut l = Ledger::of(&Owner::new(Kind::Team, "support"), 1.0);
        assert_eq!(l.owner().to_string(), "team:support");
        l.overridden = Some(Override {
            limit_usd: 3.0,
            until_ms: 100,
        });
        assert!(l.reserve("n1", 2.0, 0, 1_000), "within the override");
        assert!(
            !l.reserve("n1", 0.5, 100, 1_000),
            "expired: 2.0 held of 1.0"
        );
        assert_eq!(l.view_for("n2", 50, 0.0).limit_at(50), 3.0);
    }

    #[test]
    fn a_settlement_written_again_is_charged_once() {
        let mut l = Ledger::new(1.0);
        assert!(l.reserve("n1#a", 0.5, 0, 10_000));
        assert!(l.reserve("n1#a", 0.2, 0, 10_000));
        assert!(l.settle_once("n1#a", 1, 0.5, 0.4, 10));
        assert!(
            !l.settle_once("n1#a", 1, 0.5, 0.4, 20),
            "the same one again"
        );
        assert_eq!(l.spent_usd, 0.4);
        assert!((l.holds["n1#a"].usd - 0.2).abs() < 1e-9);
        assert!(
            l.settle_once("n2#b", 1, 0.0, 0.1, 30),
            "another holder counts on its own"
        );
        assert!(l.settle_once("n1#a", 2, 0.2, 0.2, 40));
        assert!((l.spent_usd - 0.7).abs() < 1e-9);
        assert!(!l.holds.contains_key("n1#a"));
        assert_eq!(l.settled["n1#a"].usd, 0.6, "what n1#a charged, each once");
        assert_eq!(l.settled_usd(), l.spent_usd);
        // Long after, the memory of it goes with the next change; what it charged stays.
        l.expire(40 + SETTLED_KEPT_MS);
        assert!(l.settled.is_empty());
        assert_eq!(l.earlier_usd, 0.7);
        assert_eq!(l.settled_usd(), l.spent_usd);
    }

    #[test]
    fn holders_beyond_the_kept_number_fold_into_what_came_earlier() {
        let mut l = Ledger::new(100.0);
        for n in 0..SETTLED_KEPT as u64 + 3 {
            assert!(l.settle_once(&format!("n#{n}"), 1, 0.0, 0.01, n));
        }
        l.expire(1_000);
        assert_eq!(l.settled.len(), SETTLED_KEPT);
        assert!(!l.settled.contains_key("n#2") && l.settled.contains_key("n#3"));
        assert_eq!(l.earlier_usd, 0.03, "the three quietest");
        assert_eq!(l.settled_usd(), l.spent_usd);
        l.reset_spent();
        assert_eq!((l.spent_usd, l.settled_usd()), (0.0, 0.0));
        assert!(
            !l.settle_once("n#3", 1, 0.0, 0.01, 2_000),
            "a reset keeps each holder's count"
        );
        assert!(l.settle_once("n#3", 2, 0.0, 0.02, 2_000));
        assert_eq!(
            (l.settled["n#3"].after, l.settled["n#3"].usd),
            (1, 0.02),
            "what it charged after settlement 1"
        );
    }

    #[test]
    fn a_dead_nodes_hold_stops_counting_when_its_lease_ends() {
        let mut l = Ledger::new(1.0);
        assert!(l.reserve("dead", 1.0, 0, 1_000));
        assert!(!l.reserve("n2", 0.1, 999, 1_000));
        assert!(l.reserve("n2", 0.1, 1_000, 1_000), "lease ended at 1000");
        assert!(!l.holds.contains_key("dead"));
    }

    #[test]
    fn renewing_keeps_a_live_nodes_hold() {
        let mut l = Ledger::new(1.0);
        assert!(l.reserve("n1", 1.0, 0, 1_000));
        assert!(l.renew("n1", 900, 1_000));
        assert!(!l.reserve("n2", 0.1, 1_500, 1_000));
        assert!(!l.renew("n2", 1_500, 1_000), "n2 holds nothing");
    }

    #[test]
    fn a_share_is_a_part_of_what_is_left_and_at_most_its_cap() {
        let mut l = Ledger::new(1.0);
        assert!((l.share_extra(0, 4, 10.0) - 0.25).abs() < 1e-9);
        assert!((l.share_extra(0, 4, 0.1) - 0.1).abs() < 1e-9, "capped");
        assert!(l.reserve("n1", 0.9, 0, 1_000));
        assert!(
            (l.share_extra(0, 4, 1.0) - 0.025).abs() < 1e-9,
            "of what is left"
        );
        assert_eq!(
            l.share_extra(0, 4, 10.0),
            0.0,
            "under a 128th of its size: none"
        );
        assert!(l.reserve("n2", 0.1, 0, 1_000));
        assert_eq!(l.share_extra(0, 4, 10.0), 0.0, "nothing left, nothing more");
    }

    #[test]
    fn spend_without_a_hold_is_charged() {
        let mut l = Ledger::new(1.0);
        l.settle("n1", 0.0, 0.3, 0);
        assert_eq!(l.spent_usd, 0.3);
        assert!(l.holds.is_empty());
    }

    #[test]
    fn a_node_sees_the_others_holds_as_spent() {
        let mut l = Ledger::new(1.0);
        assert!(l.reserve("n1", 0.2, 0, 1_000));
        assert!(l.reserve("n2", 0.3, 0, 1_000));
        l.settle("n2", 0.0, 0.1, 0);
        let v = l.view_for("n1", 10, 0.2);
        assert_eq!(v.limit_usd, 1.0);
        assert!((v.spent_usd - 0.4).abs() < 1e-9, "0.1 spent + n2's 0.3");
        assert!((v.remaining_usd(0) - 0.4).abs() < 1e-9);
    }

    proptest! {
        /// However reservations and settlements interleave across nodes, what is spent never
        /// passes the limit when no settlement exceeds its reservation.
        #[test]
        fn spend_never_passes_the_limit(ops in proptest::collection::vec((0usize..3, 1u32..50, 0u32..=100), 1..200)) {
            let mut l = Ledger::new(1.0);
            let mut open: Vec<(usize, f64)> = Vec::new();
            for (t, (node, cents, pct)) in ops.into_iter().enumerate() {
                let name = format!("n{node}");
                let usd = f64::from(cents) / 100.0;
                if l.reserve(&name, usd, t as u64, 1_000_000) {
                    open.push((node, usd));
                }
                if pct % 2 == 0 && !open.is_empty() {
                    let (n, r) = open.remove(0);
                    l.settle(&format!("n{n}"), r, r * f64::from(pct) / 100.0, t as u64);
                }
                prop_assert!(l.spent_usd + l.held_usd(t as u64, None) <= 1.0 + 1e-6);
            }
        }
    }
}
