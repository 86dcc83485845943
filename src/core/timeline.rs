//! A node's state timeline: the per-target state its engine decides on (the cluster's view,
//! the targets and routes, breakers, cool-downs, refused credentials), written once per change
//! as numbered versions beside the decision records. A record keeps only its route's cut of
//! that state and names the version each of its calls saw (`record::Snapshot::seen`), so it can
//! be replayed under another config whose routes read targets the request never used
//! (`Record::replay_under`).
//!
//! The work is in proportion to what changed, never to the configuration: the engine notes the
//! targets it touches, the cluster what it hears, and only those are compared and written. Every
//! `WHOLE_EVERY` entries (or `WHOLE_EVERY_MS`) one holds the whole state again, so a reader of a
//! window needs nothing older than the last whole entry before it, and a lost entry costs only
//! the versions until the next whole one.

use super::breaker::Breaker;
use super::pipeline::{Route, State};
use super::quorum::{Cluster, Member, Observation};
use super::request::{Target, TargetId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// One entry in this many holds the whole state.
pub(crate) const WHOLE_EVERY: u64 = 1_000;
/// ... and one at least this often.
pub(crate) const WHOLE_EVERY_MS: u64 = 600_000;
/// A whole state of more targets than this is written in parts of this many (each a message
/// well under NATS' 1 MB payload: about 150 KB for 250 targets seen by three nodes).
pub(crate) const WHOLE_PART_TARGETS: usize = 250;

/// One version of the state: what changed since the version before, or (`whole`) all of it.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
#[serde(deny_unknown_fields, default)]
pub struct StateVersion {
    /// 1, 2, ... in one run of a node (its engine's life).
    pub version: u64,
    pub at_ms: u64,
    /// The whole state: what it leaves out is empty, not unchanged.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub whole: bool,
    /// A whole state written in parts: how many (on the first, which is `whole`).
    #[serde(skip_serializing_if = "is_zero")]
    pub parts: u32,
    /// ... and which one this is (1, 2, ...: of the same version, after the first). Its
    /// targets are added to those of the parts before.
    #[serde(skip_serializing_if = "is_zero")]
    pub part: u32,
    /// The cluster's whole view.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<Cluster>,
    /// The cluster's members, when who they are or whether they are connected changed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub members: Option<BTreeMap<String, Member>>,
    /// Provider -> its observations (node -> latest) now, for those that changed.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub observations: BTreeMap<String, BTreeMap<String, Observation>>,
    /// Node -> when it made every one of its observations again, unchanged but for that time
    /// (each node re-observes every target once a second: written this way, that costs a
    /// line per node, not one per target). Applied after `observations`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub refreshed: BTreeMap<String, u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub providers: Option<Vec<Target>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routes: Option<BTreeMap<String, Route>>,
    /// Target -> its breaker now (none: closed), for those that changed.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub breakers: BTreeMap<String, Option<Breaker>>,
    /// Target -> when its cool-down ends (none: it has none), for those that changed.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub cooldowns: BTreeMap<String, Option<u64>>,
    /// Target -> until when its refused credentials need no new escalation, for those that
    /// changed.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub misconfigured: BTreeMap<String, Option<u64>>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The per-target state at one version, as a reader rebuilds it from entries. Its cluster's
/// members are as of their last change of who or whether connected (heartbeat times are not
/// written once per change: each record keeps the members its calls saw).
#[derive(Clone, PartialEq, Debug)]
pub struct StateAt {
    pub version: u64,
    /// Parts of a whole state still to come: it is complete at 0.
    pub awaiting: u32,
    pub cluster: Arc<Cluster>,
    pub providers: Vec<Target>,
    pub routes: BTreeMap<String, Route>,
    pub breakers: BTreeMap<String, Breaker>,
    pub cooldowns: BTreeMap<String, u64>,
    pub misconfigured: BTreeMap<String, u64>,
}

/// Why an entry cannot follow the state it is applied to.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Gap {
    #[error("state version {0} follows no whole state in the log")]
    NoWhole(u64),
    #[error("state version {got} follows version {have}: the versions between are not in the log")]
    Missing { have: u64, got: u64 },
    #[error("state version {0} was written in parts, and not every part is in the log")]
    Incomplete(u64),
}

impl StateAt {
    /// The state of a `whole` entry.
    pub fn of(whole: &StateVersion) -> Result<StateAt, Gap> {
        let (true, Some(cluster)) = (whole.whole, &whole.cluster) else {
            return Err(Gap::NoWhole(whole.version));
        };
        let mut s = StateAt {
            version: whole.version,
            awaiting: whole.parts.saturating_sub(1),
            cluster: Arc::new(cluster.clone()),
            providers: Vec::new(),
            routes: BTreeMap::new(),
            breakers: BTreeMap::new(),
            cooldowns: BTreeMap::new(),
            misconfigured: BTreeMap::new(),
        };
        s.put(whole);
        Ok(s)
    }

    /// The state after `e`: `e` itself when it is whole, the next part of a whole state
    /// written in parts, else this state changed by `e`, which must be the very next version.
    pub fn then(&mut self, e: &StateVersion) -> Result<(), Gap> {
        if e.whole {
            *self = StateAt::of(e)?;
            return Ok(());
        }
        if e.part > 0 {
            if e.version != self.version || self.awaiting == 0 {
                return Err(Gap::Incomplete(e.version));
            }
            self.put(e);
            self.awaiting -= 1;
            return Ok(());
        }
        if self.awaiting > 0 {
            return Err(Gap::Incomplete(self.version));
        }
        if e.version != self.version + 1 {
            return Err(Gap::Missing {
                have: self.version,
                got: e.version,
            });
        }
        self.put(e);
        self.version = e.version;
        Ok(())
    }

    fn put(&mut self, e: &StateVersion) {
        if e.members.is_some() || !e.observations.is_empty() || !e.refreshed.is_empty() {
            let c = Arc::make_mut(&mut self.cluster);
            if let Some(m) = &e.members {
                c.members = m.clone();
            }
            for (p, o) in &e.observations {
                if o.is_empty() {
                    c.observations.remove(p);
                } else {
                    c.observations.insert(p.clone(), o.clone());
                }
            }
            for per_node in c.observations.values_mut() {
                for (node, at_ms) in &e.refreshed {
                    if let Some(o) = per_node.get_mut(node) {
                        o.at_ms = *at_ms;
                    }
                }
            }
        }
        if let Some(p) = &e.providers {
            if e.part > 0 {
                self.providers.extend(p.iter().cloned());
            } else {
                self.providers = p.clone();
            }
        }
        if let Some(r) = &e.routes {
            self.routes = r.clone();
        }
        set_each(&mut self.breakers, &e.breakers);
        set_each(&mut self.cooldowns, &e.cooldowns);
        set_each(&mut self.misconfigured, &e.misconfigured);
    }
}

fn set_each<V: Clone>(map: &mut BTreeMap<String, V>, changed: &BTreeMap<String, Option<V>>) {
    for (k, v) in changed {
        match v {
            Some(v) => map.insert(k.clone(), v.clone()),
            None => map.remove(k),
        };
    }
}

/// The states of the latest versions of one run, as a reader following its entries in order
/// has them: what records written meanwhile name (a record names versions no older than its
/// request, so the latest `KEEP` go far enough back for any but a request that outlived them).
#[derive(Default, Debug)]
pub(crate) struct Versions {
    now: Option<StateAt>,
    kept: BTreeMap<u64, StateAt>,
}

impl Versions {
    /// How many complete versions are kept.
    pub const KEEP: usize = 64;

    /// Follow entry `e` (a gap drops what cannot be followed until the next whole entry).
    pub fn follow(&mut self, e: &StateVersion) {
        let next = match self.now.take() {
            Some(mut s) => s.then(e).map(|()| s),
            None => StateAt::of(e),
        };
        self.now = next.ok();
        if let Some(s) = self.now.as_ref().filter(|s| s.awaiting == 0) {
            self.kept.insert(s.version, s.clone());
            while self.kept.len() > Self::KEEP {
                self.kept.pop_first();
            }
        }
    }

    /// The state at `version`, if it is among those kept.
    pub fn at(&self, version: u64) -> Option<&StateAt> {
        self.kept.get(&version)
    }
}

/// What an engine keeps to write its timeline (`Engine::seen`): the version it is at, the
/// targets it touched since, and what it last wrote of those it compares.
#[derive(Default, Debug)]
pub(crate) struct Timeline {
    version: u64,
    since_whole: u64,
    whole_at_ms: u64,
    /// The next entry is whole: the first one, and the one after an entry was lost.
    whole_next: bool,
    /// Targets whose breaker, cool-down or refused credentials may have changed since.
    touched: BTreeSet<TargetId>,
    breakers: BTreeMap<String, Breaker>,
    cooldowns: BTreeMap<String, u64>,
    misconfigured: BTreeMap<String, u64>,
    /// The cluster's observations as last written (to tell a change from a refresh).
    observations: BTreeMap<String, BTreeMap<String, Observation>>,
    /// Entries not yet taken to be written.
    written: Vec<StateVersion>,
}

impl Timeline {
    pub fn new() -> Timeline {
        Timeline {
            whole_next: true,
            ..Timeline::default()
        }
    }

    /// `target`'s breaker, cool-down or refused credentials may have changed.
    pub fn touch(&mut self, target: &TargetId) {
        if !self.touched.contains(target) {
            self.touched.insert(target.clone());
        }
    }

    /// Bring the timeline up to `state` at `now_ms`: a new version when anything changed
    /// since the last (kept to be taken by `take`). The version `state` is at.
    pub fn note(&mut self, state: &mut State, now_ms: u64) -> u64 {
        let due = self.since_whole + 1 >= WHOLE_EVERY
            || now_ms.saturating_sub(self.whole_at_ms) >= WHOLE_EVERY_MS;
        if self.whole_next || state.cluster.changes().all || (due && self.changed(state)) {
            self.whole(state, now_ms);
            return self.version;
        }
        if !self.changed(state) {
            return self.version;
        }
        let mut e = StateVersion {
            version: self.version + 1,
            at_ms: now_ms,
            ..StateVersion::default()
        };
        if !state.cluster.changes().is_empty() {
            let c = Arc::make_mut(&mut state.cluster);
            let changes = c.take_changes();
            if changes.members {
                e.members = Some(c.members.clone());
            }
            self.observed(c, changes.providers, &mut e);
        }
        for id in std::mem::take(&mut self.touched) {
            write_if_changed(&mut e.breakers, &mut self.breakers, &state.breakers, &id);
            write_if_changed(&mut e.cooldowns, &mut self.cooldowns, &state.cooldowns, &id);
            write_if_changed(
                &mut e.misconfigured,
                &mut self.misconfigured,
                &state.misconfigured,
                &id,
            );
        }
        let nothing = e.members.is_none()
            && e.observations.is_empty()
            && e.refreshed.is_empty()
            && e.breakers.is_empty()
            && e.cooldowns.is_empty()
            && e.misconfigured.is_empty();
        if !nothing {
            self.version = e.version;
            self.since_whole += 1;
            self.written.push(e);
        }
        self.version
    }

    /// Write what changed of the observations of `providers` into `e`: a node that made all of
    /// its observations again at one time, unchanged but for that time, as one `refreshed`
    /// line; every other provider's observations whole.
    fn observed(&mut self, c: &Cluster, providers: BTreeSet<String>, e: &mut StateVersion) {
        let same_but_time = |was: Option<&Observation>, now: &Observation| {
            was.is_some_and(|w| {
                Observation {
                    at_ms: now.at_ms,
                    ..w.clone()
                } == *now
            })
        };
        // Node -> the one time all its refreshes share (None: they do not).
        let mut refreshes: BTreeMap<&str, Option<u64>> = BTreeMap::new();
        let mut whole: BTreeSet<&str> = BTreeSet::new();
        for p in &providers {
            let now = c.observations.get(p);
            let was = self.observations.get(p);
            let gone =
                was.is_some_and(|w| w.keys().any(|n| now.is_none_or(|m| !m.contains_key(n))));
            if gone || now.is_none_or(BTreeMap::is_empty) {
                whole.insert(p);
                continue;
            }
            for (n, o) in now.into_iter().flatten() {
                if same_but_time(was.and_then(|w| w.get(n)), o) {
                    let r = refreshes.entry(n).or_insert(Some(o.at_ms));
                    if *r != Some(o.at_ms) {
                        *r = None;
                    }
                } else {
                    whole.insert(p);
                }
            }
        }
        // A line for a node stands only when every observation the node has is at its time
        // (those that changed otherwise are written whole, at that time too): else its
        // refreshed providers are written whole.
        for (node, at) in refreshes {
            let covered = at.filter(|&at| {
                let mut mine = c.observations.values().filter_map(|m| m.get(node));
                mine.all(|o| o.at_ms == at)
            });
            match covered {
                Some(at) => {
                    e.refreshed.insert(node.to_string(), at);
                }
                None => whole.extend(
                    providers
                        .iter()
                        .filter(|p| c.observations.get(*p).is_some_and(|m| m.contains_key(node)))
                        .map(String::as_str),
                ),
            }
        }
        for p in &providers {
            let now = c.observations.get(p).cloned().unwrap_or_default();
            if whole.contains(p.as_str()) {
                e.observations.insert(p.clone(), now.clone());
            }
            if now.is_empty() {
                self.observations.remove(p);
            } else {
                self.observations.insert(p.clone(), now);
            }
        }
    }

    /// Might anything have changed since the last entry?
    fn changed(&self, state: &State) -> bool {
        !self.touched.is_empty() || !state.cluster.changes().is_empty()
    }

    fn whole(&mut self, state: &mut State, now_ms: u64) {
        if !state.cluster.changes().is_empty() {
            Arc::make_mut(&mut state.cluster).take_changes();
        }
        self.touched.clear();
        self.observations = state.cluster.observations.clone();
        self.breakers = state.breakers.clone();
        self.cooldowns = state.cooldowns.clone();
        self.misconfigured = state.misconfigured.clone();
        self.version += 1;
        self.write_whole(state, now_ms);
        self.since_whole = 0;
        self.whole_at_ms = now_ms;
        self.whole_next = false;
    }

    /// The whole state, in parts of `WHOLE_PART_TARGETS` targets when it has more (one part
    /// otherwise): the first holds the cluster's members, the routes and what is not any
    /// target's; each holds its targets, their observations, breakers, cool-downs and refused
    /// credentials.
    fn write_whole(&mut self, state: &State, now_ms: u64) {
        let all = &state.cluster;
        let chunks: Vec<&[Target]> = state.providers.chunks(WHOLE_PART_TARGETS).collect();
        let first_chunk = chunks.first().copied().unwrap_or_default();
        let first: BTreeSet<&str> = first_chunk.iter().map(|t| &*t.id).collect();
        let anyones: BTreeSet<&str> = state.providers.iter().map(|t| &*t.id).collect();
        // The first part's: its targets' and those of no target.
        let in_first = |id: &str| first.contains(id) || !anyones.contains(id);
        let of = |ids: &dyn Fn(&str) -> bool, e: &mut StateVersion| {
            e.breakers = picked(&state.breakers, ids);
            e.cooldowns = picked(&state.cooldowns, ids);
            e.misconfigured = picked(&state.misconfigured, ids);
        };
        let mut cluster = all.scoped(std::iter::empty());
        cluster.observations = all
            .observations
            .iter()
            .filter(|(k, _)| in_first(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut head = StateVersion {
            version: self.version,
            at_ms: now_ms,
            whole: true,
            parts: if chunks.len() > 1 {
                chunks.len() as u32
            } else {
                0
            },
            cluster: Some(cluster),
            providers: Some(first_chunk.to_vec()),
            routes: Some(state.routes.clone()),
            ..StateVersion::default()
        };
        of(&in_first, &mut head);
        self.written.push(head);
        for (i, chunk) in chunks.iter().enumerate().skip(1) {
            let ids: BTreeSet<&str> = chunk.iter().map(|t| &*t.id).collect();
            let mine = |id: &str| ids.contains(id);
            let mut part = StateVersion {
                version: self.version,
                at_ms: now_ms,
                part: i as u32,
                providers: Some(chunk.to_vec()),
                observations: all
                    .observations
                    .iter()
                    .filter(|(k, _)| mine(k))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                ..StateVersion::default()
            };
            of(&mine, &mut part);
            self.written.push(part);
        }
    }

    /// The entries written since the last call, to be logged in order.
    pub fn take(&mut self) -> Vec<StateVersion> {
        std::mem::take(&mut self.written)
    }

    /// An entry taken was not logged: the next one is whole, so readers lose only the versions
    /// between.
    pub fn lost(&mut self) {
        self.whole_next = true;
    }
}

/// The entries of `map` whose keys `ids` picks, as a change to an empty map.
fn picked<V: Copy>(
    map: &BTreeMap<String, V>,
    ids: &dyn Fn(&str) -> bool,
) -> BTreeMap<String, Option<V>> {
    map.iter()
        .filter(|(k, _)| ids(k))
        .map(|(k, v)| (k.clone(), Some(*v)))
        .collect()
}

/// When `id`'s value in `now` differs from the one last written (`last`), write it (`into`)
/// and remember it.
fn write_if_changed<V: Copy + PartialEq>(
    into: &mut BTreeMap<String, Option<V>>,
    last: &mut BTreeMap<String, V>,
    now: &BTreeMap<String, V>,
    id: &str,
) {
    let v = now.get(id).copied();
    if last.get(id).copied() == v {
        return;
    }
    match v {
        Some(v) => last.insert(id.to_string(), v),
        None => last.remove(id),
    };
    into.insert(id.to_string(), v);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::health::Verdict;
    use crate::core::pipeline::tests::{T0, asking, observation, routed};
    use crate::core::pipeline::{Engine, Step};
    use crate::core::request::{Generation, GenerationStatus};

    /// Drive a request for `model` to its decision, each attempt answered as `answers` says in
    /// turn (`Ok` when they run out).
    fn drive(e: &mut Engine, model: &str, id: &str, now: u64, answers: &[GenerationStatus]) {
        let (mut s, mut step) = e.begin(asking(model, id), now).expect("valid");
        let mut answers = answers.iter();
        while let Step::Dispatch(_) = step {
            let g = match answers.next() {
                Some(&status) => Generation::failed(status, 5),
                None => Generation::ok(r#"{"ok":true}"#, 5),
            };
            step = e.complete(&mut s, g, now);
        }
        assert!(matches!(step, Step::Done(_)), "{id} ended {step:?}");
    }

    /// The state a reader rebuilds is the engine's, field by field.
    fn same(seen: &StateAt, e: &Engine) {
        let st = &e.state;
        assert_eq!(*seen.cluster, *st.cluster);
        assert_eq!(seen.providers, st.providers);
        assert_eq!(seen.routes, st.routes);
        assert_eq!(seen.breakers, st.breakers);
        assert_eq!(seen.cooldowns, st.cooldowns);
        assert_eq!(seen.misconfigured, st.misconfigured);
    }

    #[test]
    fn a_reader_keeps_the_latest_versions_and_follows_a_gap_to_the_next_whole() {
        let mut e = routed();
        e.keep_timeline();
        let mut versions = Versions::default();
        let mut seen = Vec::new();
        for i in 0..(Versions::KEEP as u64 + 6) {
            let mut o = observation("n1", "o/big", Verdict::Degraded, 0.9);
            o.at_ms = T0 + i;
            Arc::make_mut(&mut e.state.cluster).observe(o);
            seen.push(e.seen(T0 + i));
            for entry in e.take_timeline() {
                versions.follow(&entry);
            }
            let v = *seen.last().unwrap();
            same(versions.at(v).expect("the latest is kept"), &e);
        }
        assert!(versions.at(seen[0]).is_none(), "the oldest went");
        assert!(versions.at(seen[seen.len() - Versions::KEEP]).is_some());
        // A lost entry: nothing is made up for it, and the next whole one is followed.
        let mut o = observation("n1", "o/big", Verdict::Healthy, 1.0);
        o.at_ms = T0 + 1_000;
        Arc::make_mut(&mut e.state.cluster).observe(o);
        let lost = e.seen(T0 + 1_000);
        drop(e.take_timeline());
        e.timeline_lost();
        let mut o = observation("n1", "o/big", Verdict::Degraded, 0.5);
        o.at_ms = T0 + 2_000;
        Arc::make_mut(&mut e.state.cluster).observe(o);
        let next = e.seen(T0 + 2_000);
        for entry in e.take_timeline() {
            versions.follow(&entry);
        }
        assert!(versions.at(lost).is_none());
        same(versions.at(next).expect("the whole one after the gap"), &e);
    }

    #[test]
    fn a_reader_rebuilds_the_engines_state_at_every_version_from_what_changed() {
        let mut e = routed();
        e.keep_timeline();
        let mut reader: Option<StateAt> = None;
        let mut wholes = 0;
        let mut follow = |e: &mut Engine, now: u64| {
            let v = e.seen(now);
            for entry in e.take_timeline() {
                wholes += usize::from(entry.whole);
                match reader.as_mut() {
                    None => reader = Some(StateAt::of(&entry).expect("the first is whole")),
                    Some(r) => r.then(&entry).expect("in order"),
                }
            }
            let r = reader.as_ref().expect("an entry");
            assert_eq!(r.version, v);
            same(r, e);
            v
        };
        let first = follow(&mut e, T0);
        // Nothing changed: no new version.
        assert_eq!(follow(&mut e, T0 + 1), first);
        let mut now = T0;
        let failures = [
            GenerationStatus::Error,
            GenerationStatus::RateLimited,
            GenerationStatus::Unauthorized,
            GenerationStatus::Timeout,
        ];
        for (i, &failed) in failures.iter().cycle().take(24).enumerate() {
            now += 1_000;
            // Requests change breakers, cool-downs and refused credentials; the cluster
            // hears newer observations of one target.
            drive(&mut e, "big", &format!("r{i}"), now, &[failed]);
            let mut o = observation("n1", "o/big", Verdict::Degraded, 0.9);
            o.at_ms = now;
            Arc::make_mut(&mut e.state.cluster).observe(o);
            drive(&mut e, "small", &format!("s{i}"), now, &[]);
            follow(&mut e, now);
        }
        assert!(!e.state.cooldowns.is_empty() && !e.state.misconfigured.is_empty());
        assert!(e.state.breakers.values().any(|b| *b != Breaker::default()));
        assert_eq!(wholes, 1, "one whole state, then only changes");
        let version = reader.as_ref().expect("read").version;
        assert!(version > first + 10, "{version} versions");

        // An entry lost: the reader sees the gap, and the next entry is whole again.
        let heard = |e: &mut Engine, at_ms: u64| {
            let mut o = observation("n1", "h/small", Verdict::Healthy, 1.0);
            o.at_ms = at_ms;
            Arc::make_mut(&mut e.state.cluster).observe(o);
        };
        heard(&mut e, now + 1);
        assert_eq!(e.seen(now + 1), version + 1);
        let lost = e.take_timeline();
        assert_eq!(lost.len(), 1);
        e.timeline_lost();
        heard(&mut e, now + 2);
        e.seen(now + 2);
        let next = e.take_timeline();
        assert!(next.len() == 1 && next[0].whole && next[0].version == version + 2);
        let mut r = reader.expect("read");
        let mut delta = next[0].clone();
        delta.whole = false;
        assert_eq!(
            r.then(&delta),
            Err(Gap::Missing {
                have: version,
                got: version + 2
            })
        );
        r.then(&next[0]).expect("a whole state follows anything");
        same(&r, &e);
    }

    #[test]
    fn a_whole_state_is_written_again_every_so_many_changes() {
        let mut e = routed();
        e.keep_timeline();
        let mut wholes = Vec::new();
        for i in 0..WHOLE_EVERY + 5 {
            let mut o = observation("n1", "h/big", Verdict::Healthy, 1.0);
            o.at_ms = T0 + 1 + i;
            Arc::make_mut(&mut e.state.cluster).observe(o);
            e.seen(T0 + 1 + i);
            wholes.extend(
                e.take_timeline()
                    .into_iter()
                    .filter(|x| x.whole)
                    .map(|x| x.version),
            );
        }
        assert_eq!(wholes, [1, WHOLE_EVERY + 1]);
        // ... and after `WHOLE_EVERY_MS`, at the next change.
        let later = T0 + WHOLE_EVERY_MS * 2;
        let mut o = observation("n1", "h/big", Verdict::Healthy, 1.0);
        o.at_ms = later;
        Arc::make_mut(&mut e.state.cluster).observe(o);
        e.seen(later);
        assert!(e.take_timeline()[0].whole);
    }

    #[test]
    fn a_whole_state_of_many_targets_is_written_in_parts_a_reader_joins() {
        let mut e = routed();
        for i in 0..600 {
            let mut t = e.state.providers[0].clone();
            t.id = format!("x{i}").into();
            e.state.providers.push(t);
            let o = observation("n1", &format!("x{i}"), Verdict::Healthy, 1.0);
            Arc::make_mut(&mut e.state.cluster).observe(o);
        }
        let open = Breaker::Open {
            until_ms: T0 + 9_000,
            forced: false,
        };
        e.state.breakers.insert("x599".into(), open);
        e.state.cooldowns.insert("h/big".into(), T0 + 5_000);
        e.keep_timeline();
        let v = e.seen(T0);
        let parts = e.take_timeline();
        // 603 targets: three parts, each a message well under NATS' 1 MB.
        assert_eq!(parts.len(), 3);
        assert!(parts[0].whole && parts[0].parts == 3);
        assert_eq!((parts[1].part, parts[2].part), (1, 2));
        for p in &parts {
            assert_eq!(p.version, v);
            let bytes = serde_json::to_vec(p).expect("JSON").len();
            assert!(bytes < 256 << 10, "{bytes} bytes");
        }
        let mut reader = StateAt::of(&parts[0]).expect("whole");
        assert_eq!(reader.awaiting, 2);
        // A change before every part is in is a gap, not a state.
        let mut early = reader.clone();
        let next = StateVersion {
            version: v + 1,
            ..StateVersion::default()
        };
        assert_eq!(early.then(&next), Err(Gap::Incomplete(v)));
        for p in &parts[1..] {
            reader.then(p).expect("the next part");
        }
        assert_eq!(reader.awaiting, 0);
        same(&reader, &e);
        // Read back through JSON, as the log keeps them.
        let back: Vec<StateVersion> =
            serde_json::from_str(&serde_json::to_string(&parts).unwrap()).unwrap();
        assert_eq!(back, parts);
    }

    #[test]
    fn a_heartbeat_s_time_writes_no_version_and_a_member_s_coming_and_going_does() {
        let mut e = routed();
        e.keep_timeline();
        let beat =
            |e: &mut Engine, at: u64| Arc::make_mut(&mut e.state.cluster).heartbeat("n1", at);
        beat(&mut e, T0);
        let joined = e.seen(T0);
        assert!(
            e.take_timeline().iter().all(|v| v.whole),
            "the first is whole"
        );
        beat(&mut e, T0 + 1_000);
        assert_eq!(e.seen(T0 + 1_000), joined, "a heartbeat's time alone");
        assert!(e.take_timeline().is_empty());
        Arc::make_mut(&mut e.state.cluster).disconnect("n1");
        let gone = e.seen(T0 + 1_500);
        let written = e.take_timeline();
        assert_eq!(gone, joined + 1);
        let members = written[0].members.as_ref().expect("the members");
        assert!(!members["n1"].connected);
        beat(&mut e, T0 + 2_000);
        assert_eq!(e.seen(T0 + 2_000), gone + 1, "connected again");
    }

    #[test]
    fn a_node_observing_every_target_again_costs_one_line() {
        let mut e = routed();
        e.keep_timeline();
        let mut reader = StateAt::of(&{
            e.seen(T0);
            e.take_timeline().remove(0)
        })
        .expect("whole");
        let targets = ["h/big", "h/small", "o/big"];
        let mut round = |e: &mut Engine, at: u64, degraded: &[&str], only: &[&str]| {
            for t in targets
                .iter()
                .filter(|t| only.is_empty() || only.contains(t))
            {
                let verdict = match degraded.contains(t) {
                    true => Verdict::Degraded,
                    false => Verdict::Healthy,
                };
                let mut o = observation("n1", t, verdict, 1.0);
                o.at_ms = at;
                Arc::make_mut(&mut e.state.cluster).observe(o);
            }
            e.seen(at);
            let written = e.take_timeline();
            for v in &written {
                reader.then(v).expect("in order");
            }
            same(&reader, e);
            written
        };
        // Every target again, unchanged: one line.
        let w = round(&mut e, T0 + 1_000, &[], &[]);
        assert_eq!(
            w[0].refreshed,
            BTreeMap::from([("n1".to_string(), T0 + 1_000)])
        );
        assert!(w[0].observations.is_empty());
        // One changed: it is written whole; the others are still one line.
        let w = round(&mut e, T0 + 2_000, &["o/big"], &[]);
        assert_eq!(w[0].refreshed.len(), 1);
        assert_eq!(w[0].observations.keys().collect::<Vec<_>>(), ["o/big"]);
        // Only some again: no line can say it; those are written whole.
        let w = round(&mut e, T0 + 3_000, &["o/big"], &["h/big"]);
        assert!(w[0].refreshed.is_empty());
        assert_eq!(w[0].observations.keys().collect::<Vec<_>>(), ["h/big"]);
    }

    #[test]
    fn an_engine_without_a_timeline_writes_none() {
        let mut e = routed();
        drive(&mut e, "big", "r1", T0, &[GenerationStatus::Error]);
        assert_eq!(e.seen(T0), 0);
        assert!(e.take_timeline().is_empty());
    }
}
