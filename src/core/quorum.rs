//! Cluster membership and majority consensus on provider health.
//!
//! A provider verdict needs floor(n/2)+1 agreeing, fresh observations from nodes that are alive
//! now. A node whose heartbeat expired or whose connection dropped stops counting at once. The
//! routing inputs (availability, contract failures, p95) come from the agreeing majority too (their
//! median), never from a mean over every node: one node's bad probe must not move everyone's
//! traffic. Below quorum a node uses its own observation and says so.
//!
//! Who may speak is fixed, not taken from whoever speaks: the configured roster, or without one
//! the first n ids heard (this node included). An invented id is refused, so it can neither grow
//! the cluster (and its quorum), nor vote, nor take memory; n is the configured size, always.

use super::health::{Evidence, FirstHand, Verdict};
use super::wire::{Arrival, MAX_SKEW_MS};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

pub(crate) const DEFAULT_HEARTBEAT_TTL_MS: u64 = 3_000;
pub(crate) const DEFAULT_OBSERVATION_TTL_MS: u64 = 5_000;
/// Without a roster, a member silent this long gives up its seat to a new id (a node replaced
/// under another name); long enough that no outage of a real member lets others take it.
pub(crate) const SEAT_KEPT_MS: u64 = 60_000;

/// One node's view of one provider, as gossiped.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Observation {
    pub node: String,
    pub provider: String,
    pub at_ms: u64,
    pub verdict: Verdict,
    pub availability: f64,
    pub contract_failure_pct: f64,
    pub p95_ms: u64,
    #[serde(default)]
    pub samples: u32,
    /// What the verdict rests on (a node with no samples abstains; `none` with samples: an
    /// older node's, which does not say).
    #[serde(default)]
    pub evidence: Evidence,
    /// What the node saw itself, so others judge on the cluster's evidence (`health::judge`).
    #[serde(default)]
    pub own: FirstHand,
}

/// What the cluster knows about one member.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Member {
    pub last_heartbeat_ms: u64,
    /// False once the node's connection dropped (or it said goodbye); it counts again only after
    /// a new heartbeat.
    #[serde(default = "yes")]
    pub connected: bool,
}

fn yes() -> bool {
    true
}

/// Membership plus the latest observation per (node, provider).
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// This node's id; its own observations are its local view.
    pub self_id: String,
    /// Configured cluster size n. The quorum is floor(n/2)+1.
    #[serde(default = "one")]
    pub size: usize,
    /// The members that may speak, when configured (`node.members`); `size` is then its length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roster: Option<BTreeSet<String>>,
    #[serde(default = "heartbeat_ttl")]
    pub heartbeat_ttl_ms: u64,
    #[serde(default = "observation_ttl")]
    pub observation_ttl_ms: u64,
    #[serde(default)]
    pub members: BTreeMap<String, Member>,
    /// provider -> node -> latest observation.
    #[serde(default, with = "observation_list")]
    pub observations: BTreeMap<String, BTreeMap<String, Observation>>,
    /// What changed since the state timeline last took it (`take_changes`).
    #[serde(skip)]
    changes: Changes,
}

/// What of a cluster's view changed since it was last taken (`Cluster::take_changes`): for
/// the state timeline (`timeline`), which writes what changed, not the whole view. Not part of
/// the view: neither written nor compared.
#[derive(Clone, Default, Debug)]
pub struct Changes {
    /// Who the members are, or whether they are connected, changed. A heartbeat's time alone
    /// is not a change here: it comes every second from every node, and each record keeps
    /// the members as its calls saw them.
    pub members: bool,
    /// Providers whose observations changed.
    pub providers: BTreeSet<String>,
    /// Observations of every provider changed (a member gave up its seat).
    pub all: bool,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        !self.members && !self.all && self.providers.is_empty()
    }
}

impl PartialEq for Changes {
    fn eq(&self, _: &Changes) -> bool {
        true
    }
}

fn one() -> usize {
    1
}
fn heartbeat_ttl() -> u64 {
    DEFAULT_HEARTBEAT_TTL_MS
}
fn observation_ttl() -> u64 {
    DEFAULT_OBSERVATION_TTL_MS
}

/// The consensus view of one provider that routing uses.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
#[serde(default)]
pub struct ProviderView {
    pub verdict: Verdict,
    /// Observations agreeing with `verdict` (k in "k/n").
    pub votes: usize,
    /// Live nodes with a fresh observation.
    pub voters: usize,
    /// n in "k/n": the cluster size the quorum is computed from.
    pub cluster_size: usize,
    /// True when `votes` reached floor(n/2)+1; false means this is the node's local view.
    pub quorum: bool,
    pub availability: f64,
    pub contract_failure_pct: f64,
    pub p95_ms: u64,
}

impl Cluster {
    pub fn new(self_id: impl Into<String>, size: usize) -> Self {
        Cluster {
            self_id: self_id.into(),
            size,
            roster: None,
            heartbeat_ttl_ms: DEFAULT_HEARTBEAT_TTL_MS,
            observation_ttl_ms: DEFAULT_OBSERVATION_TTL_MS,
            members: BTreeMap::new(),
            observations: BTreeMap::new(),
            changes: Changes::default(),
        }
    }

    /// What changed since the last call (see `Changes`).
    pub fn changes(&self) -> &Changes {
        &self.changes
    }

    /// What changed since the last call, forgotten here.
    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    /// This cluster as the views of `providers` read it: every member, and the observations
    /// of those providers only (a provider's view reads nothing else).
    pub fn scoped<'a>(&self, providers: impl IntoIterator<Item = &'a str>) -> Cluster {
        Cluster {
            self_id: self.self_id.clone(),
            size: self.size,
            roster: self.roster.clone(),
            heartbeat_ttl_ms: self.heartbeat_ttl_ms,
            observation_ttl_ms: self.observation_ttl_ms,
            members: self.members.clone(),
            observations: providers
                .into_iter()
                .filter_map(|p| self.observations.get_key_value(p))
                .map(|(p, o)| (p.clone(), o.clone()))
                .collect(),
            changes: Changes::default(),
        }
    }

    /// A cluster of exactly `roster` (which includes `self_id`).
    pub fn with_roster(self_id: impl Into<String>, roster: BTreeSet<String>) -> Self {
        let mut c = Cluster::new(self_id, roster.len().max(1));
        c.roster = Some(roster);
        c
    }

    /// May `node` speak here at `now_ms`? With a roster, only its members; without one, the
    /// first `size` ids heard (this node included): a seat is given up only by a member silent
    /// for `SEAT_KEPT_MS` (a node replaced under a new id), never to whoever speaks most.
    /// Admitting a node makes it a member (not alive until it beats).
    pub fn admit(&mut self, node: &str, now_ms: u64) -> bool {
        if node == self.self_id || self.members.contains_key(node) {
            return true;
        }
        let room = match &self.roster {
            Some(roster) => roster.contains(node),
            None => {
                let others = self
                    .members
                    .keys()
                    .filter(|id| **id != self.self_id)
                    .count();
                others + 1 < self.size || self.free_a_seat(now_ms)
            }
        };
        if room {
            self.changes.members = true;
            self.members.insert(
                node.to_string(),
                Member {
                    last_heartbeat_ms: 0,
                    connected: false,
                },
            );
        }
        room
    }

    /// Give up the seat of the member silent longest, if it has been silent `SEAT_KEPT_MS`.
    fn free_a_seat(&mut self, now_ms: u64) -> bool {
        let gone = self
            .members
            .iter()
            .filter(|(id, m)| {
                **id != self.self_id && now_ms.saturating_sub(m.last_heartbeat_ms) > SEAT_KEPT_MS
            })
            .min_by_key(|(_, m)| m.last_heartbeat_ms)
            .map(|(id, _)| id.clone());
        let Some(id) = gone else {
            return false;
        };
        self.members.remove(&id);
        for per_node in self.observations.values_mut() {
            per_node.remove(&id);
        }
        self.changes.all = true;
        true
    }

    /// A heartbeat from `node` at `now_ms` (ignored if older than one already seen). False when
    /// `node` is not admitted (see `admit`).
    pub fn heartbeat(&mut self, node: &str, now_ms: u64) -> bool {
        if !self.admit(node, now_ms) {
            return false;
        }
        let joined = !self.members.contains_key(node);
        let m = self.members.entry(node.to_string()).or_insert(Member {
            last_heartbeat_ms: now_ms,
            connected: true,
        });
        if now_ms >= m.last_heartbeat_ms {
            m.last_heartbeat_ms = now_ms;
            if joined || !m.connected {
                self.changes.members = true;
            }
            m.connected = true;
        }
        true
    }

    /// An observation gossiped by a peer, arriving at `now_ms`: forged when its node is not
    /// admitted or it is stamped beyond the clock skew (a future stamp would count as fresh
    /// for good), stale when not newer than the one kept.
    pub fn gossiped(&mut self, obs: Observation, now_ms: u64) -> Arrival {
        if obs.at_ms > now_ms.saturating_add(MAX_SKEW_MS) {
            return Arrival::Forged("observation stamped in the future");
        }
        if !self.admit(&obs.node, now_ms) {
            return Arrival::Forged("observation from a node outside the cluster");
        }
        if self.observe(obs) {
            Arrival::Fresh
        } else {
            Arrival::Stale
        }
    }

    /// The node's connection dropped or it left: its observations stop counting now.
    pub fn disconnect(&mut self, node: &str) {
        if let Some(m) = self.members.get_mut(node) {
            m.connected = false;
            self.changes.members = true;
        }
    }

    /// Keep the newest observation per (node, provider); older or duplicate ones, and those of
    /// nodes not admitted, are ignored. Returns whether it was applied.
    pub fn observe(&mut self, obs: Observation) -> bool {
        // No clock here: a seat is not freed for an observation alone.
        if !self.admit(&obs.node, 0) {
            return false;
        }
        let per_node = self.observations.entry(obs.provider.clone()).or_default();
        match per_node.get(&obs.node) {
            Some(old) if old.at_ms >= obs.at_ms => false,
            _ => {
                if !self.changes.providers.contains(&obs.provider) {
                    self.changes.providers.insert(obs.provider.clone());
                }
                per_node.insert(obs.node.clone(), obs);
                true
            }
        }
    }

    /// Is `node` alive at `now_ms`? This node always is.
    pub fn is_alive(&self, node: &str, now_ms: u64) -> bool {
        if node == self.self_id {
            return true;
        }
        self.members
            .get(node)
            .is_some_and(|m| self.member_alive(m, now_ms))
    }

    fn member_alive(&self, m: &Member, now_ms: u64) -> bool {
        m.connected && now_ms.saturating_sub(m.last_heartbeat_ms) <= self.heartbeat_ttl_ms
    }

    /// Live nodes, this one included.
    pub fn live_nodes(&self, now_ms: u64) -> Vec<&str> {
        let mut nodes: Vec<&str> = self
            .members
            .keys()
            .map(String::as_str)
            .filter(|n| self.is_alive(n, now_ms))
            .collect();
        if !self.members.contains_key(&self.self_id) {
            nodes.push(&self.self_id);
            nodes.sort_unstable();
        }
        nodes
    }

    /// The n that the quorum is computed from: the configured size (nobody else is admitted).
    pub fn effective_size(&self, _now_ms: u64) -> usize {
        self.size.max(1)
    }

    pub fn quorum(&self, now_ms: u64) -> usize {
        self.effective_size(now_ms) / 2 + 1
    }

    /// Fresh observations of `provider` from every member, alive now or not: what a node saw
    /// of a provider stays evidence for as long as its observation is fresh, even after the
    /// node itself went (its probes' share is taken over meanwhile).
    pub fn fresh<'a>(
        &'a self,
        provider: &str,
        now_ms: u64,
    ) -> impl Iterator<Item = &'a Observation> + 'a {
        self.observations
            .get(provider)
            .into_iter()
            .flat_map(|m| m.values())
            .filter(move |o| now_ms.saturating_sub(o.at_ms) <= self.observation_ttl_ms)
    }

    /// Fresh observations of `provider` from live nodes, in node order. Observations and
    /// members are both ordered by node, so this is a merge, not a lookup per observation.
    pub fn counted<'a>(
        &'a self,
        provider: &str,
        now_ms: u64,
    ) -> impl Iterator<Item = &'a Observation> + 'a {
        let mut members = self.members.iter().peekable();
        self.observations
            .get(provider)
            .into_iter()
            .flat_map(|m| m.iter())
            .filter(move |(node, o)| {
                // A stamp slightly ahead of our clock (skew between nodes) is fresh, not ignored.
                if now_ms.saturating_sub(o.at_ms) > self.observation_ttl_ms {
                    return false;
                }
                while members.next_if(|(id, _)| *id < *node).is_some() {}
                let live_member = members
                    .peek()
                    .is_some_and(|(id, m)| *id == *node && self.member_alive(m, now_ms));
                live_member || **node == self.self_id
            })
            .map(|(_, o)| o)
    }

    /// The consensus (or, below quorum, local) view of `provider`.
    pub fn view(&self, provider: &str, now_ms: u64) -> ProviderView {
        let n = self.effective_size(now_ms);
        with_items(self.counted(provider, now_ms), &NO_OBSERVATION, |counted| {
            self.view_of(counted, n)
        })
    }

    /// The majority among the observations that vote (see `votes`), or below quorum this
    /// node's own observation.
    fn view_of(&self, counted: &[&Observation], n: usize) -> ProviderView {
        let q = n / 2 + 1;
        let real = real_calls_say(counted);
        let mut tally = [0usize; Verdict::ALL.len()];
        for o in counted.iter().filter(|o| votes(o, real)) {
            tally[o.verdict as usize] += 1;
        }
        let voters = counted.len();
        if let Some(verdict) = Verdict::ALL.into_iter().find(|&v| tally[v as usize] >= q) {
            return from_group(verdict, counted, voters, n, true);
        }
        match counted.iter().find(|o| o.node == self.self_id) {
            Some(own) => {
                let mut v = from_group(own.verdict, &[own], voters, n, false);
                v.votes = tally[own.verdict as usize];
                v
            }
            None => ProviderView {
                verdict: Verdict::Unknown,
                votes: 0,
                voters,
                cluster_size: n,
                quorum: false,
                availability: 0.0,
                contract_failure_pct: 0.0,
                p95_ms: 0,
            },
        }
    }
}

/// What the observations resting on real calls (traffic or billed probes) say together.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum RealCalls {
    /// None rests on real calls.
    Nothing,
    /// All that do say this.
    Agree(Verdict),
    /// They disagree.
    Split,
}

fn real_calls_say(counted: &[&Observation]) -> RealCalls {
    counted
        .iter()
        .filter(|o| o.samples > 0 && o.evidence.paid())
        .fold(RealCalls::Nothing, |say, o| match say {
            RealCalls::Nothing => RealCalls::Agree(o.verdict),
            RealCalls::Agree(v) if v == o.verdict => say,
            _ => RealCalls::Split,
        })
}

/// Does `o` vote, beside observations whose real calls say `real`? Not a node's that has no
/// samples (it abstains). One resting on free probes alone confirms but never decides: it
/// votes when no node has real calls to go by, or beside real calls that all say what it
/// says; a model list that answers does not outvote a model that fails, and a node that has
/// not yet heard of the traffic its peers serve still adds its vote to theirs. (An
/// observation that does not say what it rests on, from an older node or a hand-written
/// state, votes as before.)
fn votes(o: &Observation, real: RealCalls) -> bool {
    o.samples > 0
        && (o.evidence != Evidence::Free
            || match real {
                RealCalls::Nothing => true,
                RealCalls::Agree(v) => v == o.verdict,
                RealCalls::Split => false,
            })
}

/// The view from the observations in `counted` that say `verdict`; their numbers are medians.
fn from_group(
    verdict: Verdict,
    counted: &[&Observation],
    voters: usize,
    n: usize,
    quorum: bool,
) -> ProviderView {
    let group = counted.iter().filter(|o| o.verdict == verdict).copied();
    with_items(group, &NO_OBSERVATION, |group| ProviderView {
        verdict,
        votes: group.len(),
        voters,
        cluster_size: n,
        quorum,
        availability: lower_median(group, |o| o.availability),
        contract_failure_pct: lower_median(group, |o| o.contract_failure_pct),
        p95_ms: lower_median(group, |o| o.p95_ms as f64) as u64,
    })
}

/// Lower median of `key` over `group`: deterministic and always one of the observed values
/// (0 for none). Sorts the group in place by that key.
fn lower_median(group: &mut [&Observation], key: impl Fn(&Observation) -> f64) -> f64 {
    group.sort_unstable_by(|a, b| key(a).total_cmp(&key(b)));
    group
        .get((group.len().max(1) - 1) / 2)
        .map_or(0.0, |o| key(o))
}

/// Run `f` on the items of `iter`. Groups are cluster-sized, so up to 16 items stay on the stack
/// (`fill` pads the unused slots); more spill to the heap. Keeps the per-request path free of
/// allocations.
fn with_items<T: Copy, R>(
    iter: impl Iterator<Item = T>,
    fill: T,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    let mut buf = [fill; 16];
    let mut spill = Vec::new();
    let mut len = 0;
    for v in iter {
        if len < buf.len() {
            buf[len] = v;
        } else {
            if spill.is_empty() {
                spill.extend_from_slice(&buf);
            }
            spill.push(v);
        }
        len += 1;
    }
    if spill.is_empty() {
        f(&mut buf[..len])
    } else {
        f(&mut spill)
    }
}

/// Padding for `with_items` over observation references.
static NO_OBSERVATION: Observation = Observation {
    node: String::new(),
    provider: String::new(),
    at_ms: 0,
    verdict: Verdict::Unknown,
    availability: 0.0,
    contract_failure_pct: 0.0,
    p95_ms: 0,
    samples: 0,
    evidence: Evidence::None,
    own: FirstHand {
        traffic: EMPTY,
        billed: EMPTY,
        free: EMPTY,
        recovered_at_ms: None,
    },
};

const EMPTY: super::health::Tally = super::health::Tally {
    samples: 0,
    failed: 0,
    broken: 0,
    p95_ms: 0,
    slow: 0,
    last_ms: 0,
    last_failure_ms: 0,
};

/// Observations travel as a flat list; in memory they are indexed by provider and node.
mod observation_list {
    use super::Observation;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::collections::BTreeMap;

    type Index = BTreeMap<String, BTreeMap<String, Observation>>;

    pub fn serialize<S: Serializer>(index: &Index, s: S) -> Result<S::Ok, S::Error> {
        let list: Vec<&Observation> = index.values().flat_map(|m| m.values()).collect();
        list.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Index, D::Error> {
        let mut index = Index::new();
        for o in Vec::<Observation>::deserialize(d)? {
            let slot = index.entry(o.provider.clone()).or_default();
            if slot.get(&o.node).is_none_or(|old| old.at_ms < o.at_ms) {
                slot.insert(o.node.clone(), o);
            }
        }
        Ok(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn obs(node: &str, verdict: Verdict, availability: f64, at_ms: u64) -> Observation {
        Observation {
            node: node.into(),
            provider: "p".into(),
            at_ms,
            verdict,
            availability,
            contract_failure_pct: 0.0,
            p95_ms: 150,
            samples: 15,
            evidence: Evidence::Traffic,
            own: FirstHand::default(),
        }
    }

    fn three_nodes(now: u64) -> Cluster {
        let mut c = Cluster::new("n1", 3);
        for n in ["n1", "n2", "n3"] {
            c.heartbeat(n, now);
        }
        c
    }

    /// Two nodes whose free probes say healthy do not outvote the one whose traffic fails,
    /// and a node with no evidence does not vote at all.
    #[test]
    fn free_probes_and_no_evidence_do_not_vote() {
        let mut c = three_nodes(1_000);
        let with = |node: &str, verdict, evidence| Observation {
            evidence,
            samples: if evidence == Evidence::None { 0 } else { 15 },
            ..obs(node, verdict, 1.0, 1_000)
        };
        c.observe(with("n1", Verdict::Healthy, Evidence::Free));
        c.observe(with("n2", Verdict::Healthy, Evidence::Free));
        c.observe(with("n3", Verdict::Unhealthy, Evidence::Traffic));
        let v = c.view("p", 1_000);
        assert!(!v.quorum, "{v:?}");
        assert_eq!(v.voters, 3);
        c.observe(Observation {
            at_ms: 1_001,
            ..with("n2", Verdict::Unhealthy, Evidence::Traffic)
        });
        let v = c.view("p", 1_001);
        assert_eq!(
            (v.verdict, v.votes, v.quorum),
            (Verdict::Unhealthy, 2, true)
        );
        // A free probe that says what every real call says adds its vote to theirs (a node
        // that has not yet heard of its peer's traffic); beside real calls that disagree, it
        // decides nothing.
        let mut c = three_nodes(1_000);
        c.observe(with("n1", Verdict::Healthy, Evidence::Traffic));
        c.observe(with("n2", Verdict::Healthy, Evidence::Free));
        let v = c.view("p", 1_000);
        assert_eq!((v.verdict, v.votes, v.quorum), (Verdict::Healthy, 2, true));
        c.observe(with("n3", Verdict::Unhealthy, Evidence::Billed));
        let v = c.view("p", 1_000);
        assert!(!v.quorum, "{v:?}");
        // Without evidence: abstains; two healthy free probes are a majority then.
        let mut c = three_nodes(1_000);
        c.observe(with("n1", Verdict::Unknown, Evidence::None));
        c.observe(with("n2", Verdict::Healthy, Evidence::Free));
        c.observe(with("n3", Verdict::Healthy, Evidence::Free));
        let v = c.view("p", 1_000);
        assert_eq!((v.verdict, v.votes, v.quorum), (Verdict::Healthy, 2, true));
        c.observe(Observation {
            at_ms: 1_001,
            ..with("n3", Verdict::Unknown, Evidence::None)
        });
        let v = c.view("p", 1_001);
        assert!(!v.quorum && v.verdict == Verdict::Unknown, "{v:?}");
    }

    #[test]
    fn majority_decides_and_uses_majority_numbers() {
        let mut c = three_nodes(1_000);
        c.observe(obs("n1", Verdict::Healthy, 1.0, 1_000));
        c.observe(obs("n2", Verdict::Healthy, 0.97, 1_000));
        c.observe(obs("n3", Verdict::Unhealthy, 0.0, 1_000));
        let v = c.view("p", 1_000);
        assert_eq!(v.verdict, Verdict::Healthy);
        assert!(v.quorum);
        assert_eq!((v.votes, v.voters, v.cluster_size), (2, 3, 3));
        // Median of the majority (lower median of [0.97, 1.0]); the outlier's 0.0 never enters.
        assert_eq!(v.availability, 0.97);
    }

    #[test]
    fn a_dead_node_stops_counting_the_moment_it_expires() {
        let mut c = three_nodes(1_000);
        c.observe(obs("n2", Verdict::Unhealthy, 0.0, 1_000));
        c.observe(obs("n3", Verdict::Unhealthy, 0.0, 1_000));
        c.observe(obs("n1", Verdict::Healthy, 1.0, 1_000));
        assert_eq!(c.view("p", 1_000).verdict, Verdict::Unhealthy);
        // n1 keeps heartbeating; n2 and n3 go silent.
        c.heartbeat("n1", 4_001);
        let at_ttl = c.view("p", 1_000 + DEFAULT_HEARTBEAT_TTL_MS);
        assert_eq!(
            at_ttl.verdict,
            Verdict::Unhealthy,
            "still alive exactly at the ttl"
        );
        let after = c.view("p", 1_001 + DEFAULT_HEARTBEAT_TTL_MS);
        assert!(!after.quorum);
        assert_eq!(
            after.verdict,
            Verdict::Healthy,
            "falls back to the local view"
        );
        assert_eq!(after.voters, 1);
    }

    #[test]
    fn a_dropped_connection_counts_at_once() {
        let mut c = three_nodes(1_000);
        c.observe(obs("n2", Verdict::Unhealthy, 0.0, 1_000));
        c.observe(obs("n3", Verdict::Unhealthy, 0.0, 1_000));
        c.disconnect("n3");
        let v = c.view("p", 1_000);
        assert!(!v.quorum);
        assert_eq!(
            v.verdict,
            Verdict::Unknown,
            "no own observation: unknown, not n2's claim"
        );
        c.heartbeat("n3", 1_100);
        assert!(c.view("p", 1_100).quorum, "a new heartbeat brings it back");
    }

    #[test]
    fn stale_and_out_of_order_observations_are_ignored() {
        let mut c = three_nodes(10_000);
        assert!(c.observe(obs("n2", Verdict::Healthy, 1.0, 9_000)));
        assert!(
            !c.observe(obs("n2", Verdict::Unhealthy, 0.0, 8_000)),
            "older"
        );
        assert!(
            !c.observe(obs("n2", Verdict::Unhealthy, 0.0, 9_000)),
            "duplicate"
        );
        assert_eq!(
            c.counted("p", 10_000).next().unwrap().verdict,
            Verdict::Healthy
        );
        assert_eq!(
            c.counted("p", 9_000 + DEFAULT_OBSERVATION_TTL_MS + 1)
                .count(),
            0
        );
    }

    #[test]
    fn split_vote_without_majority_is_local_view() {
        let mut c = Cluster::new("n1", 4);
        for n in ["n1", "n2", "n3", "n4"] {
            c.heartbeat(n, 0);
        }
        c.observe(obs("n1", Verdict::Degraded, 0.9, 0));
        c.observe(obs("n2", Verdict::Degraded, 0.9, 0));
        c.observe(obs("n3", Verdict::Healthy, 1.0, 0));
        c.observe(obs("n4", Verdict::Healthy, 1.0, 0));
        let v = c.view("p", 0);
        assert!(!v.quorum, "2 of 4 is not floor(4/2)+1 = 3");
        assert_eq!(v.verdict, Verdict::Degraded);
        assert_eq!(v.votes, 2);
    }

    #[test]
    fn invented_ids_are_not_admitted_and_cannot_grow_the_cluster_or_vote() {
        let mut c = Cluster::new("n1", 3);
        for n in ["n1", "n2", "n3"] {
            assert!(c.heartbeat(n, 0));
        }
        // The attack: six more ids, and their votes for UNHEALTHY.
        for i in 4..10 {
            let id = format!("n{i}");
            assert!(!c.heartbeat(&id, 0), "{id} admitted");
            assert!(!c.observe(obs(&id, Verdict::Unhealthy, 0.0, 0)));
            assert!(matches!(
                c.gossiped(obs(&id, Verdict::Unhealthy, 0.0, 0), 0),
                Arrival::Forged(_)
            ));
        }
        c.observe(obs("n1", Verdict::Healthy, 1.0, 0));
        c.observe(obs("n2", Verdict::Healthy, 1.0, 0));
        assert_eq!((c.effective_size(0), c.quorum(0)), (3, 2));
        assert_eq!(c.members.len(), 3, "no memory for invented ids");
        let v = c.view("p", 0);
        assert!(v.quorum && v.verdict == Verdict::Healthy, "{v:?}");
    }

    #[test]
    fn a_seat_is_given_up_only_by_a_member_long_silent() {
        let mut c = Cluster::new("n1", 3);
        assert!(c.heartbeat("n2", 0) && c.heartbeat("n3", 0));
        assert!(
            !c.heartbeat("n4", SEAT_KEPT_MS),
            "n2 and n3 were heard just now"
        );
        assert!(c.heartbeat("n2", SEAT_KEPT_MS));
        // n3 silent past the limit: a replacement under a new id takes its seat, not n2's.
        assert!(c.heartbeat("n4", SEAT_KEPT_MS + 1));
        assert_eq!(
            c.members.keys().map(String::as_str).collect::<Vec<_>>(),
            ["n2", "n4"]
        );
        assert_eq!(c.effective_size(SEAT_KEPT_MS + 1), 3);
    }

    #[test]
    fn a_roster_admits_exactly_its_members_whoever_speaks_first() {
        let roster: BTreeSet<String> = ["n1", "n2", "n3"].map(String::from).into();
        let mut c = Cluster::with_roster("n1", roster);
        assert!(!c.heartbeat("evil", 0), "not on the roster");
        assert!(c.heartbeat("n3", 0) && c.heartbeat("n2", 0));
        assert_eq!(c.live_nodes(0), ["n1", "n2", "n3"]);
        assert_eq!(c.effective_size(0), 3);
    }

    #[test]
    fn a_future_stamp_is_forged_not_fresh_forever() {
        let mut c = three_nodes(0);
        let now = 10_000;
        assert!(matches!(
            c.gossiped(obs("n2", Verdict::Unhealthy, 0.0, u64::MAX), now),
            Arrival::Forged(_)
        ));
        assert!(matches!(
            c.gossiped(
                obs("n2", Verdict::Unhealthy, 0.0, now + MAX_SKEW_MS + 1),
                now
            ),
            Arrival::Forged(_)
        ));
        // Slightly ahead (skew between honest clocks) is fine, and later ones replace it.
        assert_eq!(
            c.gossiped(obs("n2", Verdict::Healthy, 1.0, now + 100), now),
            Arrival::Fresh
        );
        assert_eq!(
            c.gossiped(obs("n2", Verdict::Healthy, 1.0, now + 100), now),
            Arrival::Stale
        );
    }

    #[test]
    fn serde_round_trip_keeps_newest() {
        let mut c = three_nodes(0);
        c.observe(obs("n2", Verdict::Healthy, 1.0, 5));
        let json = serde_json::to_string(&c).unwrap();
        let back: Cluster = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn large_clusters_spill_past_the_stack_buffer() {
        let mut c = Cluster::new("n00", 20);
        for i in 0..20 {
            let id = format!("n{i:02}");
            c.heartbeat(&id, 0);
            let verdict = if i < 11 {
                Verdict::Healthy
            } else {
                Verdict::Degraded
            };
            c.observe(obs(&id, verdict, 0.5 + i as f64 / 100.0, 0));
        }
        let v = c.view("p", 0);
        assert!(v.quorum);
        assert_eq!((v.verdict, v.votes, v.voters), (Verdict::Healthy, 11, 20));
        assert_eq!(v.availability, 0.55, "lower median of 0.50..=0.60");
    }

    fn arb_verdict() -> impl Strategy<Value = Verdict> {
        prop::sample::select(Verdict::ALL.to_vec())
    }

    proptest! {
        /// Any gossip (invented ids, extreme stamps and numbers) leaves the cluster its size:
        /// no more members than n, n unchanged, and a view that never panics.
        #[test]
        fn any_gossip_keeps_the_cluster_its_size(
            size in 1usize..6,
            gossip in prop::collection::vec(
                (0u8..20, any::<u64>(), arb_verdict(), -1e300f64..1e300, any::<u64>(), any::<bool>()),
                1..100,
            ),
            now in 0u64..u64::MAX / 2,
        ) {
            let mut c = Cluster::new("n0", size);
            for (node, at_ms, verdict, availability, p95_ms, beat) in gossip {
                let id = format!("n{node}");
                if beat {
                    c.heartbeat(&id, now);
                }
                let o = Observation {
                    node: id,
                    provider: "p".into(),
                    at_ms,
                    verdict,
                    availability,
                    contract_failure_pct: availability,
                    p95_ms,
                    samples: 1,
                    evidence: Evidence::Traffic,
                    own: FirstHand::default(),
                };
                let _ = c.gossiped(o, now);
                prop_assert!(c.members.keys().filter(|k| **k != c.self_id).count() < size.max(1));
            }
            let v = c.view("p", now);
            prop_assert_eq!(c.effective_size(now), size);
            prop_assert!(v.votes <= size && v.voters <= size);
        }

        /// Quorum never counts a dead node: whatever a dead node says cannot change the view,
        /// and the votes never exceed the live, fresh voters.
        #[test]
        fn dead_nodes_never_count(
            nodes in prop::collection::vec((0u64..10_000, any::<bool>(), arb_verdict(), 0u64..10_000), 1..7),
            size in 1usize..7,
            now in 5_000u64..12_000,
            flip in arb_verdict(),
        ) {
            let mut c = Cluster::new("n0", size);
            for (i, (hb, connected, verdict, at)) in nodes.iter().enumerate() {
                let id = format!("n{i}");
                c.heartbeat(&id, *hb);
                if !connected { c.disconnect(&id); }
                c.observe(obs(&id, *verdict, 0.5, *at));
            }
            let view = c.view("p", now);
            let live_fresh = c.counted("p", now).count();
            // The merge in `counted` agrees with a plain lookup per observation.
            let by_lookup = c.observations["p"]
                .values()
                .filter(|o| {
                    c.is_alive(&o.node, now)
                        && now.saturating_sub(o.at_ms) <= c.observation_ttl_ms
                })
                .count();
            prop_assert_eq!(live_fresh, by_lookup);
            prop_assert!(view.votes <= live_fresh);
            prop_assert_eq!(view.voters, live_fresh);
            if view.quorum {
                prop_assert!(view.votes >= c.quorum(now));
                prop_assert!(view.votes * 2 > view.cluster_size);
            }
            // Rewrite every dead node's observation: the view must not move.
            let mut c2 = c.clone();
            for i in 0..nodes.len() {
                let id = format!("n{i}");
                if !c.is_alive(&id, now) {
                    c2.observe(obs(&id, flip, 0.1, now));
                }
            }
            prop_assert_eq!(c2.view("p", now), view);
        }
    }
}
