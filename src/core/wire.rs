//! Control-plane wire types: the envelope every oam event travels in, and the rule that keeps
//! duplicates and out-of-order arrivals from being applied.
//!
//! A sender stamps each event with its incarnation (its start time, so a restarted node is not
//! mistaken for an old one) and a sequence number. A receiver applies an event only if its
//! (incarnation, sequence) is newer than the last one it applied from that sender, and refuses as
//! forged what no honest sender can send: a stamp or incarnation from beyond `MAX_SKEW_MS` in the
//! future, or a sequence that jumped further than a sender can publish in the time since its last
//! event (one a millisecond, plus `SEQ_SLACK`). One forged message can therefore not shut a real
//! sender out for good.

use super::breaker::Breaker;
use super::budget::Budgets;
use super::bulkhead::{BulkheadConfig, Bulkheads};
use super::health::{Stats, Verdict};
use super::loops::{Fingerprint, Loops};
use super::quorum::{Observation, ProviderView};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Every control-plane event.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Envelope<T> {
    /// Unique per event: `{sender}-{incarnation}-{seq}`.
    pub id: String,
    pub sender: String,
    pub at_ms: u64,
    pub incarnation: u64,
    pub seq: u64,
    pub body: T,
}

/// Stamps outgoing events for one sender.
#[derive(Clone, Debug)]
pub(crate) struct Stamper {
    sender: String,
    incarnation: u64,
    seq: u64,
}

impl Stamper {
    pub fn new(sender: impl Into<String>, incarnation: u64) -> Self {
        Stamper {
            sender: sender.into(),
            incarnation,
            seq: 0,
        }
    }

    pub fn stamp<T>(&mut self, at_ms: u64, body: T) -> Envelope<T> {
        self.seq += 1;
        Envelope {
            id: format!("{}-{}-{}", self.sender, self.incarnation, self.seq),
            sender: self.sender.clone(),
            at_ms,
            incarnation: self.incarnation,
            seq: self.seq,
            body,
        }
    }
}

/// How far ahead of this node's clock a peer's clock may run.
pub(crate) const MAX_SKEW_MS: u64 = 5_000;
/// Sequence numbers a sender may skip beyond one per millisecond since its last event (events
/// it dropped while cut off, say).
pub(crate) const SEQ_SLACK: u64 = 10_000;

/// What a receiver does with an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// Newer than anything applied from its sender: apply it.
    Fresh,
    /// A duplicate, or older than something applied: ignore it.
    Stale,
    /// Nothing an honest sender sends: ignore it and count it.
    Forged(&'static str),
}

/// Incarnations remembered per sender and stream: the live one, plus room for a restart and
/// for whatever a forger claims, which therefore cannot shut the real one out.
pub(crate) const INCARNATIONS_KEPT: usize = 4;

/// Remembers, per sender and stream, the newest seq applied in each recent incarnation, and when.
#[derive(Clone, Debug, Default)]
pub(crate) struct Sequencer {
    last: BTreeMap<(String, &'static str), Vec<Last>>,
}

#[derive(Clone, Copy, Debug)]
struct Last {
    incarnation: u64,
    seq: u64,
    at_ms: u64,
}

/// Whether `e`, arriving at `now_ms`, carries stamps an honest sender can send: neither its
/// incarnation (a start time) nor its time beyond `MAX_SKEW_MS` in the future.
pub(crate) fn plausible<T>(e: &Envelope<T>, now_ms: u64) -> Result<(), &'static str> {
    let horizon = now_ms.saturating_add(MAX_SKEW_MS);
    if e.incarnation > horizon {
        return Err("incarnation in the future");
    }
    if e.at_ms > horizon {
        return Err("stamped in the future");
    }
    Ok(())
}

impl Sequencer {
    /// What to do with event `e` arriving at `now_ms` (this node's clock). `stream` separates
    /// kinds (heartbeats and observations from one sender have their own orders only if stamped
    /// separately; passing the kind keeps a shared stamper correct too). Order is kept within an
    /// incarnation; a new incarnation (a restart) is always accepted and never silences another.
    pub fn accept<T>(&mut self, stream: &'static str, e: &Envelope<T>, now_ms: u64) -> Arrival {
        if let Err(why) = plausible(e, now_ms) {
            return Arrival::Forged(why);
        }
        let kept = self.last.entry((e.sender.clone(), stream)).or_default();
        match kept.iter_mut().find(|l| l.incarnation == e.incarnation) {
            Some(last) => {
                if last.seq >= e.seq {
                    return Arrival::Stale;
                }
                let may_skip = now_ms.saturating_sub(last.at_ms).saturating_add(SEQ_SLACK);
                if e.seq - last.seq > may_skip {
                    return Arrival::Forged("sequence jumped ahead");
                }
                last.seq = e.seq;
                last.at_ms = now_ms;
            }
            None => {
                if kept.len() == INCARNATIONS_KEPT
                    && let Some(oldest) = (0..kept.len()).min_by_key(|&i| kept[i].at_ms)
                {
                    kept.swap_remove(oldest);
                }
                kept.push(Last {
                    incarnation: e.incarnation,
                    seq: e.seq,
                    at_ms: now_ms,
                });
            }
        }
        Arrival::Fresh
    }
}

/// "I am alive", every heartbeat interval.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct Heartbeat {
    pub node: String,
    /// The data-plane URL, for operators.
    #[serde(default)]
    pub http: Option<String>,
}

/// "I am leaving": the node's observations stop counting now, not at heartbeat expiry.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct Goodbye {
    pub node: String,
}

/// One node's observations of every provider, published after each probe round.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct Observations {
    pub node: String,
    pub observations: Vec<Observation>,
}

/// `oam.v1.loop.{node}`: a failure one node counted toward an agent loop, or a call that worked
/// after failures. Every node applies the others', so a loop spread over the cluster trips at
/// the same count as one on a single node.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(tag = "event", rename_all = "snake_case", deny_unknown_fields)]
pub(crate) enum LoopEvent {
    Failure {
        fingerprint: Fingerprint,
        agent: String,
        task: String,
        at_ms: u64,
        probe: bool,
        /// The call that failed (named in the escalation if this failure completes a count
        /// that no node's own failure did).
        #[serde(default)]
        request_id: String,
    },
    Cleared {
        fingerprint: Fingerprint,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_000_000;

    #[test]
    fn duplicates_and_reordering_are_refused() {
        let mut a = Stamper::new("n1", 100);
        let mut seq = Sequencer::default();
        let e1 = a.stamp(1, ());
        let e2 = a.stamp(2, ());
        assert_eq!(seq.accept("hb", &e2, NOW), Arrival::Fresh);
        assert_eq!(
            seq.accept("hb", &e1, NOW),
            Arrival::Stale,
            "older than one already applied"
        );
        assert_eq!(seq.accept("hb", &e2, NOW), Arrival::Stale, "duplicate");
        assert_eq!(
            seq.accept("obs", &e1, NOW),
            Arrival::Fresh,
            "streams are separate"
        );
        assert_ne!(e1.id, e2.id);
    }

    #[test]
    fn a_restarted_sender_is_heard_at_once() {
        let mut seq = Sequencer::default();
        let mut old = Stamper::new("n1", 100);
        for _ in 0..50 {
            assert_eq!(seq.accept("hb", &old.stamp(0, ()), NOW), Arrival::Fresh);
        }
        let mut restarted = Stamper::new("n1", 200);
        assert_eq!(
            seq.accept("hb", &restarted.stamp(0, ()), NOW),
            Arrival::Fresh,
            "seq 1 of a newer incarnation"
        );
        assert_eq!(
            seq.accept("hb", &restarted.stamp(0, ()), NOW),
            Arrival::Fresh
        );
    }

    /// A different number each call (the stamper's next seq): fresh forged incarnations.
    fn rand_ish(s: &Stamper) -> u64 {
        s.seq % 1_000
    }

    fn forged(incarnation: u64, seq: u64, at_ms: u64) -> Envelope<()> {
        Envelope {
            id: "x".into(),
            sender: "n2".into(),
            at_ms,
            incarnation,
            seq,
            body: (),
        }
    }

    #[test]
    fn one_forged_message_cannot_shut_a_real_sender_out() {
        let mut seq = Sequencer::default();
        let mut real = Stamper::new("n2", NOW - 60_000);
        assert_eq!(seq.accept("hb", &real.stamp(NOW, ()), NOW), Arrival::Fresh);
        // The attack that split the cluster: the highest possible stamp.
        for e in [
            forged(u64::MAX, u64::MAX, NOW),
            forged(NOW + 1_000 + MAX_SKEW_MS + 1, 1, NOW),
            forged(NOW - 60_000, 2, u64::MAX),
            forged(NOW - 60_000, u64::MAX, NOW),
            forged(NOW - 60_000, 2 + SEQ_SLACK + 1_000, NOW + 999),
        ] {
            assert!(
                matches!(seq.accept("hb", &e, NOW + 1_000), Arrival::Forged(_)),
                "{e:?}"
            );
        }
        // The real sender goes on being heard, even beside a plausible forged incarnation
        // (one that claims a restart just now): order is kept per incarnation.
        assert_eq!(
            seq.accept("hb", &forged(NOW + 1_000, 1, NOW + 1_000), NOW + 1_000),
            Arrival::Fresh
        );
        for _ in 0..2 * INCARNATIONS_KEPT {
            let e = forged(NOW + 1_000 + rand_ish(&real), 1, NOW + 1_000);
            let _ = seq.accept("hb", &e, NOW + 1_000);
            assert_eq!(
                seq.accept("hb", &real.stamp(NOW + 1_000, ()), NOW + 1_000),
                Arrival::Fresh,
                "the real incarnation is still heard"
            );
        }
        // A sender that was cut off for a minute and dropped what it could not send is fine.
        for _ in 0..30_000 {
            real.stamp(0, ());
        }
        assert_eq!(
            seq.accept("hb", &real.stamp(NOW + 61_000, ()), NOW + 61_000),
            Arrival::Fresh
        );
        // A restart a little ahead of our clock (skew) is a restart.
        let mut restarted = Stamper::new("n2", NOW + 61_000 + MAX_SKEW_MS);
        assert_eq!(
            seq.accept("hb", &restarted.stamp(NOW + 61_000, ()), NOW + 61_000),
            Arrival::Fresh
        );
    }

    proptest::proptest! {
        /// Whatever arrives (any stamps, any senders, in any order), the sequencer neither
        /// panics nor keeps more than `INCARNATIONS_KEPT` incarnations per sender and stream,
        /// and never takes a stamp from beyond the skew.
        #[test]
        fn any_arrivals_stay_bounded_and_never_panic(
            events in proptest::collection::vec(
                (0u8..4, proptest::num::u64::ANY, proptest::num::u64::ANY, proptest::num::u64::ANY),
                1..200,
            ),
            start in 0u64..u64::MAX / 2,
        ) {
            let mut seq = Sequencer::default();
            for (i, (sender, incarnation, n, at_ms)) in events.into_iter().enumerate() {
                let now = start + i as u64 * 10;
                let e = Envelope {
                    id: String::new(),
                    sender: format!("n{sender}"),
                    at_ms,
                    incarnation,
                    seq: n,
                    body: (),
                };
                let arrival = seq.accept("hb", &e, now);
                if incarnation > now + MAX_SKEW_MS || at_ms > now + MAX_SKEW_MS {
                    proptest::prop_assert!(matches!(arrival, Arrival::Forged(_)));
                }
            }
            for kept in seq.last.values() {
                proptest::prop_assert!(kept.len() <= INCARNATIONS_KEPT);
            }
        }
    }
}

/// What one node sees, now: `GET /v1/oam/state`, and `oam.v1.state.{node}` every heartbeat.
/// `oam watch`, `oam mesh status`, `oam mesh up`'s readiness wait and the scenario runner read
/// it. Fields a reader does not know are ignored and missing ones take their defaults, so a
/// reader and a node of neighbouring versions still understand each other.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
#[serde(default)]
pub struct NodeSnapshot {
    pub node: String,
    pub now_ms: u64,
    /// n: the configured cluster size (or more, when more nodes are alive).
    pub cluster_size: usize,
    /// Nodes needed for a majority: floor(n/2)+1.
    pub quorum: usize,
    /// Nodes whose heartbeat this node heard within the TTL (itself included).
    pub live_nodes: Vec<String>,
    pub nodes: Vec<MemberSnapshot>,
    pub providers: Vec<ProviderSnapshot>,
    /// Short requests' bulkheads and their limits.
    pub bulkheads: Bulkheads,
    pub bulkhead_limits: BulkheadConfig,
    /// Streams' bulkheads and their limits (a stream holds its slot for its whole answer).
    pub stream_bulkheads: Bulkheads,
    pub stream_bulkhead_limits: BulkheadConfig,
    pub budgets: Budgets,
    /// Calls failing again and again (counted across the cluster), and open loop episodes.
    pub loops: Loops,
    pub bus: BusCounts,
    /// Escalations this node could not deliver to its webhook (after every attempt).
    pub escalations_undelivered: u64,
    /// Decision records the decision log did not take (buffer full, no stream, no ack).
    pub decisions_unlogged: u64,
    /// JetStream stores that do not take this node's writes now (`ledger`, `decision log`),
    /// with the last error: budgets then fail closed for high-risk work, records are lost.
    /// Cleared by the next write that succeeds.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub store_faults: BTreeMap<String, String>,
    /// Streams it writes that keep fewer current copies than they are configured to: stream
    /// -> [current, configured] (over several NATS servers; `oam mesh status` says which).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub short_copies: BTreeMap<String, [u64; 2]>,
    /// The health probes this node sent and what the billed ones cost.
    pub probes: ProbeSnapshot,
    /// Each route's targets, first preferred (so a reader can tell a route none of whose
    /// targets answers).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub routes: BTreeMap<String, Vec<String>>,
}

/// A node's health probes: calls by target and kind (`models`: free, `chat`: billed), what the
/// billed ones cost, and why billed ones are not being sent, if they are not.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
#[serde(default)]
pub struct ProbeSnapshot {
    pub calls: BTreeMap<String, BTreeMap<String, u64>>,
    pub spend_usd_per_hour: f64,
    /// The same, by target (those that cost anything in the last hour).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub spend_usd_per_hour_by_target: BTreeMap<String, f64>,
    pub spent_usd: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<crate::core::reason::ReasonCode>,
}

impl ProbeSnapshot {
    /// Calls of `kind` to every target.
    pub fn total(&self, kind: &str) -> u64 {
        self.calls.values().filter_map(|k| k.get(kind)).sum()
    }
}

impl NodeSnapshot {
    /// Does this node hear a majority of the cluster?
    pub fn has_quorum(&self) -> bool {
        self.live_nodes.len() >= self.quorum
    }

    pub fn provider(&self, id: &str) -> Option<&ProviderSnapshot> {
        self.providers.iter().find(|p| p.id == id)
    }

    /// Providers whose consensus verdict is `v`.
    pub fn providers_with(&self, v: Verdict) -> impl Iterator<Item = &ProviderSnapshot> {
        self.providers
            .iter()
            .filter(move |p| p.consensus.verdict == v)
    }
}

/// One cluster member as a node sees it.
#[derive(Serialize, Deserialize, Clone, PartialEq, Eq, Debug, Default)]
#[serde(default)]
pub struct MemberSnapshot {
    pub id: String,
    pub alive: bool,
    pub heartbeat_age_ms: u64,
    pub connected: bool,
}

/// One provider as a node sees it: the cluster's verdict, its own window, its breaker.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
#[serde(default)]
pub struct ProviderSnapshot {
    pub id: String,
    pub fallback: bool,
    /// It is a tool server (`[[mcp_server]]`): tool calls go to it, not model calls.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub tools: bool,
    pub consensus: ProviderView,
    /// This node's own window (`None` when it keeps none).
    pub local: Option<Stats>,
    pub breaker: Breaker,
    /// Why it last failed, as this node saw it (a probe's or a request's call).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<LastFailure>,
}

/// A target's last failed call as a node saw it: what answered (or did not), when, and how many
/// of its calls have failed since the last that worked.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct LastFailure {
    pub at_ms: u64,
    /// `probe` or `request`.
    pub by: String,
    pub status: super::request::GenerationStatus,
    /// What the upstream said (`HTTP 401 Unauthorized Incorrect API key ...`), or why it could
    /// not be reached; at most 300 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Calls failed since the last that worked (0: it works again).
    pub failing: u64,
}

impl LastFailure {
    /// `probe: HTTP 401 Unauthorized Incorrect API key (3 failing, 40 s ago)`, at `now_ms`.
    pub fn said(&self, now_ms: u64) -> String {
        let what = self
            .error
            .clone()
            .unwrap_or_else(|| format!("{:?}", self.status).to_lowercase());
        let ago = now_ms.saturating_sub(self.at_ms) / 1_000;
        if self.failing == 0 {
            format!("{}: {what} ({ago} s ago; it works again)", self.by)
        } else {
            format!(
                "{}: {what} ({} failing, {ago} s ago)",
                self.by, self.failing
            )
        }
    }
}

/// Messages from the bus a node refused to apply, by why.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(default)]
pub struct BusCounts {
    pub malformed: u64,
    pub duplicate_or_stale: u64,
    pub forged: u64,
    /// Events not published because the outbox was full (NATS down for long).
    pub dropped_events: u64,
}
