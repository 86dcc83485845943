//! Control-plane wire types: the envelope every oam event travels in, and the rule that keeps
//! duplicates and out-of-order arrivals from being applied.
//!
//! A sender stamps each event with its incarnation (its start time, so a restarted node is not
//! mistaken for an old one) and a sequence number. A receiver applies an event only if its
//! (incarnation, sequence) is newer than the last one it applied from that sender.

use super::breaker::Breaker;
use super::budget::Budgets;
use super::bulkhead::{BulkheadConfig, Bulkheads};
use super::health::{Stats, Verdict};
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
pub struct Stamper {
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

    pub fn sender(&self) -> &str {
        &self.sender
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

/// Remembers the newest (incarnation, seq) applied per sender and stream.
#[derive(Clone, Debug, Default)]
pub struct Sequencer {
    last: BTreeMap<(String, &'static str), (u64, u64)>,
}

impl Sequencer {
    /// Should this event be applied? `stream` separates kinds (heartbeats and observations from
    /// one sender have their own orders only if stamped separately; passing the kind keeps a
    /// shared stamper correct too).
    pub fn accept<T>(&mut self, stream: &'static str, e: &Envelope<T>) -> bool {
        let key = (e.sender.clone(), stream);
        let next = (e.incarnation, e.seq);
        match self.last.get(&key) {
            Some(&last) if last >= next => false,
            _ => {
                self.last.insert(key, next);
                true
            }
        }
    }
}

/// "I am alive", every heartbeat interval.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    pub node: String,
    /// The data-plane URL, for operators.
    #[serde(default)]
    pub http: Option<String>,
}

/// "I am leaving": the node's observations stop counting now, not at heartbeat expiry.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Goodbye {
    pub node: String,
}

/// One node's observations of every provider, published after each probe round.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Observations {
    pub node: String,
    pub observations: Vec<Observation>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_and_reordering_are_refused() {
        let mut a = Stamper::new("n1", 100);
        let mut seq = Sequencer::default();
        let e1 = a.stamp(1, ());
        let e2 = a.stamp(2, ());
        assert!(seq.accept("hb", &e2));
        assert!(!seq.accept("hb", &e1), "older than one already applied");
        assert!(!seq.accept("hb", &e2), "duplicate");
        assert!(seq.accept("obs", &e1), "streams are separate");
        assert_ne!(e1.id, e2.id);
    }

    #[test]
    fn a_restarted_sender_is_new_not_old() {
        let mut seq = Sequencer::default();
        let mut old = Stamper::new("n1", 100);
        for _ in 0..50 {
            assert!(seq.accept("hb", &old.stamp(0, ())));
        }
        let mut restarted = Stamper::new("n1", 200);
        assert!(
            seq.accept("hb", &restarted.stamp(0, ())),
            "seq 1 of a newer incarnation"
        );
        assert!(
            !seq.accept("hb", &old.stamp(0, ())),
            "the old incarnation is over"
        );
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
    pub bulkheads: Bulkheads,
    pub bulkhead_limits: BulkheadConfig,
    pub budgets: Budgets,
    pub bus: BusCounts,
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
    pub consensus: ProviderView,
    /// This node's own window (`None` when it keeps none).
    pub local: Option<Stats>,
    pub breaker: Breaker,
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
