//! A decision's record: everything needed to replay it through the core and get the same
//! decision, byte for byte. A node keeps one per request (`node::decisionlog` writes them to
//! the decision log); `oam explain` replays one.
//!
//! Many requests share one engine, so the state a call saw is not the state at `begin` plus
//! this request's own calls: others changed breakers, health, budgets and slots meanwhile. The
//! record therefore holds the state each call saw, cut down to what a call for this request
//! reads (its loop entry, its budgets, its route).

use super::loops::{self, Fingerprint};
use super::pipeline::{Config, Decision, Engine, Route, Session, State, Step};
use super::reason::ReasonCode;
use super::request::{Generation, Request, Target};
use super::timeline::StateAt;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One thing a driver tells the engine about a request after `begin`.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(tag = "call", rename_all = "snake_case", deny_unknown_fields)]
pub enum Call {
    /// Granted a slot: continue (`Engine::dequeue`).
    Dequeue,
    /// Gave up waiting for a slot (`Engine::abandon`).
    Abandon,
    /// The caller went away (`Engine::caller_gone`).
    CallerGone,
    /// The attempt waiting to start is not made (`Engine::withdraw`).
    Withdraw,
    /// The dispatched attempt's result (`Engine::complete`).
    Complete { generation: Generation },
    /// The shared budget ledger would not hold the attempt (`Engine::refuse_reservation`).
    RefuseReservation { code: ReasonCode },
    /// The caller is over its rate limit (`Engine::rate_limited`).
    RateLimited,
    /// The attempt started reaching the caller (`Engine::delivering`).
    Delivering,
    /// ... and then broke (`Engine::interrupted`).
    Interrupted,
    /// The attempt under way delivered part of the answer (`Engine::delivered`).
    Delivered,
    /// A code the driver observed (`Session::note`).
    Note { code: ReasonCode },
}

impl Engine {
    /// Apply `call` to request `s` at `now_ms`: the next step, when the call gives one.
    pub fn apply(&mut self, s: &mut Session, call: Call, now_ms: u64) -> Option<Step> {
        let done = |d: Decision| Step::Done(Box::new(d));
        match call {
            Call::Dequeue => Some(self.dequeue(s, now_ms)),
            Call::Abandon => self.abandon(s, now_ms).map(done),
            Call::CallerGone => self.caller_gone(s, now_ms).map(done),
            Call::Withdraw => self.withdraw(s, now_ms).map(done),
            Call::Complete { generation } => Some(self.complete(s, generation, now_ms)),
            Call::RefuseReservation { code } => self.refuse_reservation(s, code, now_ms),
            Call::RateLimited => Some(self.rate_limited(s, now_ms)),
            Call::Delivering => {
                self.delivering(s);
                None
            }
            Call::Interrupted => {
                self.interrupted(s);
                None
            }
            Call::Delivered => {
                self.delivered(s);
                None
            }
            Call::Note { code } => {
                s.note(code);
                None
            }
        }
    }

    /// The pruned loop entry and budgets of `request`, when asked for.
    fn snapshot_for_parts(
        &self,
        request: &Request,
        loops: bool,
        budgets: bool,
    ) -> (Option<super::loops::Loops>, Option<super::budget::Budgets>) {
        let st = &self.state;
        let fp = fingerprint(request);
        let l = loops.then(|| {
            st.loops
                .get(&fp)
                .map(|e| (fp, e.clone()))
                .into_iter()
                .collect()
        });
        let b = budgets.then(|| st.budgets.only_covering(request));
        (l, b)
    }

    /// The state a call for `request` reads (its route's targets only: `scope`), and the
    /// escalation serial (part of escalation ids): what a record keeps before each call.
    pub(crate) fn snapshot_for(&self, request: &Request) -> Snapshot {
        let st = &self.state;
        let scope = self.scope(request);
        let (loops, budgets) = self.snapshot_for_parts(request, true, true);
        let state = State {
            cluster: self.scoped_cluster(request, &scope),
            providers: scope.providers(&st.providers),
            breakers: scope.entries(&st.providers, &st.breakers),
            cooldowns: scope.entries(&st.providers, &st.cooldowns),
            bulkheads: st.bulkheads,
            stream_bulkheads: st.stream_bulkheads,
            loops: loops.unwrap_or_default(),
            budgets: budgets.unwrap_or_default(),
            routes: request
                .model
                .as_ref()
                .and_then(|m| st.routes.get_key_value(m))
                .map(|(m, r)| (m.clone(), r.clone()))
                .into_iter()
                .collect(),
            misconfigured: scope.entries(&st.providers, &st.misconfigured),
        };
        Snapshot {
            state,
            escalations: self.escalations_raised(),
            seen: 0,
        }
    }
}

/// The loop fingerprint of a request, as `begin` computes it.
pub fn fingerprint(r: &Request) -> Fingerprint {
    loops::fingerprint(
        &r.agent,
        &r.task,
        r.model.as_deref().unwrap_or(""),
        &r.messages,
    )
}

/// The engine as one call saw it.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    pub state: State,
    /// Escalations the node had raised (the next one's serial).
    pub escalations: u64,
    /// The version of the node's state timeline it is a cut of (0: none was kept).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub seen: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One call, when it happened, and the state it saw (what differs from what `begin` saw).
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Logged {
    pub at_ms: u64,
    pub call: Call,
    #[serde(default, skip_serializing_if = "Patch::is_empty")]
    pub before: Patch,
}

/// The parts of a snapshot that differ from another (those left out are the same): a call's
/// state is mostly what `begin` saw, and a record keeps only what changed.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Patch {
    #[serde(
        skip_serializing_if = "Option::is_none",
        with = "cluster_in_run::option"
    )]
    pub cluster: Option<std::sync::Arc<super::quorum::Cluster>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub providers: Option<Vec<super::request::Target>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breakers: Option<std::collections::BTreeMap<String, super::breaker::Breaker>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cooldowns: Option<std::collections::BTreeMap<String, u64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bulkheads: Option<super::bulkhead::Bulkheads>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_bulkheads: Option<super::bulkhead::Bulkheads>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loops: Option<super::loops::Loops>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budgets: Option<super::budget::Budgets>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routes: Option<std::collections::BTreeMap<String, super::pipeline::Route>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub misconfigured: Option<std::collections::BTreeMap<String, u64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub escalations: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seen: Option<u64>,
}

impl Patch {
    pub fn is_empty(&self) -> bool {
        *self == Patch::default()
    }

    /// What of the engine's state, as a call for `request` reads it, differs from `base`:
    /// compared in place, only what differs is copied (this runs for every call of every
    /// request the log records).
    pub fn of(base: &Snapshot, e: &Engine, request: &Request, seen: u64) -> Patch {
        let (b, st) = (&base.state, &e.state);
        let fp = fingerprint(request);
        let loops_differ = b.loops.get(&fp) != st.loops.get(&fp);
        let budgets_differ = !b.budgets.covering(request).eq(st.budgets.covering(request));
        let route = request
            .model
            .as_ref()
            .and_then(|m| st.routes.get_key_value(m));
        let routes_differ = request
            .model
            .as_ref()
            .is_some_and(|m| b.routes.get(m) != st.routes.get(m));
        let pruned = e.snapshot_for_parts(request, loops_differ, budgets_differ);
        let escalations = e.escalations_raised();
        let scope = e.scope(request);
        let cluster = e.scoped_cluster(request, &scope);
        let ps = &st.providers;
        Patch {
            cluster: (!std::sync::Arc::ptr_eq(&b.cluster, &cluster) && b.cluster != cluster)
                .then_some(cluster),
            providers: scope
                .providers_differ(&b.providers, ps)
                .then(|| scope.providers(ps)),
            breakers: scope
                .entries_differ(ps, &b.breakers, &st.breakers)
                .then(|| scope.entries(ps, &st.breakers)),
            cooldowns: scope
                .entries_differ(ps, &b.cooldowns, &st.cooldowns)
                .then(|| scope.entries(ps, &st.cooldowns)),
            bulkheads: (b.bulkheads != st.bulkheads).then_some(st.bulkheads),
            stream_bulkheads: (b.stream_bulkheads != st.stream_bulkheads)
                .then_some(st.stream_bulkheads),
            loops: pruned.0,
            budgets: pruned.1,
            routes: routes_differ.then(|| {
                route
                    .map(|(m, r)| (m.clone(), r.clone()))
                    .into_iter()
                    .collect()
            }),
            misconfigured: scope
                .entries_differ(ps, &b.misconfigured, &st.misconfigured)
                .then(|| scope.entries(ps, &st.misconfigured)),
            escalations: (base.escalations != escalations).then_some(escalations),
            seen: (base.seen != seen).then_some(seen),
        }
    }

    /// `base` with this patch applied.
    pub fn apply(&self, base: &Snapshot) -> Snapshot {
        let b = &base.state;
        Snapshot {
            state: State {
                cluster: self.cluster.clone().unwrap_or_else(|| b.cluster.clone()),
                providers: self
                    .providers
                    .clone()
                    .unwrap_or_else(|| b.providers.clone()),
                breakers: self.breakers.clone().unwrap_or_else(|| b.breakers.clone()),
                cooldowns: self
                    .cooldowns
                    .clone()
                    .unwrap_or_else(|| b.cooldowns.clone()),
                bulkheads: self.bulkheads.unwrap_or(b.bulkheads),
                stream_bulkheads: self.stream_bulkheads.unwrap_or(b.stream_bulkheads),
                loops: self.loops.clone().unwrap_or_else(|| b.loops.clone()),
                budgets: self.budgets.clone().unwrap_or_else(|| b.budgets.clone()),
                routes: self.routes.clone().unwrap_or_else(|| b.routes.clone()),
                misconfigured: self
                    .misconfigured
                    .clone()
                    .unwrap_or_else(|| b.misconfigured.clone()),
            },
            escalations: self.escalations.unwrap_or(base.escalations),
            seen: self.seen.unwrap_or(base.seen),
        }
    }
}

/// Write (or read) many records in a row, as one decision log message holds them: within `f`,
/// a cluster view that is the very one written before it (the same `Arc`) is written as
/// `"same"`, and read back as the one before it; a request's tools that are the very set an
/// earlier record of the run declared are written as that set's number (`tools_in_run`).
/// Records seen alone (`oam audit --json`, a snapshot) always carry theirs in full. Each call
/// starts afresh: a message stands alone.
pub(crate) fn in_a_run<T>(f: impl FnOnce() -> T) -> T {
    struct EndOfRun;
    impl Drop for EndOfRun {
        fn drop(&mut self) {
            cluster_in_run::LAST.with(|l| *l.borrow_mut() = None);
            tools_in_run::WRITTEN.with(|w| *w.borrow_mut() = None);
        }
    }
    cluster_in_run::LAST.with(|l| *l.borrow_mut() = Some(None));
    tools_in_run::WRITTEN.with(|w| *w.borrow_mut() = Some(Vec::new()));
    let _end = EndOfRun;
    f()
}

/// Within a run, start another (the next message): nothing before counts as written.
pub(crate) fn run_afresh() {
    cluster_in_run::LAST.with(|l| {
        if let Some(last) = &mut *l.borrow_mut() {
            *last = None;
        }
    });
    tools_in_run::WRITTEN.with(|w| {
        if let Some(sets) = &mut *w.borrow_mut() {
            sets.clear();
        }
    });
}

/// Where a run stands: what a record written (or read) after it may refer back to.
pub(crate) struct RunMark {
    cluster: Option<Option<std::sync::Arc<super::quorum::Cluster>>>,
    tools: Option<usize>,
}

/// Where the run stands now (`rewind_run` goes back to it).
pub(crate) fn run_mark() -> RunMark {
    RunMark {
        cluster: cluster_in_run::LAST.with(|l| l.borrow().clone()),
        tools: tools_in_run::WRITTEN.with(|w| w.borrow().as_ref().map(Vec::len)),
    }
}

/// Forget what was written since `mark`: a record that failed halfway and was cut from the
/// message must leave nothing for the next ones to refer to.
pub(crate) fn rewind_run(mark: RunMark) {
    cluster_in_run::LAST.with(|l| *l.borrow_mut() = mark.cluster);
    tools_in_run::WRITTEN.with(|w| {
        if let (Some(sets), Some(n)) = (&mut *w.borrow_mut(), mark.tools) {
            sets.truncate(n);
        }
    });
}

/// How `Request::tools` is written and read (see `in_a_run`): in a run, the sets written in
/// full are numbered from 0 as they come (the first `SETS` of them), and a set written before
/// is written as its number. An agent sends the same 128 tools request after request: the
/// message holds them once, not once a record.
pub mod tools_in_run {
    use super::super::request::Tools;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::cell::RefCell;
    use std::sync::Arc;

    /// The sets a run numbers at most.
    const SETS: usize = 64;

    thread_local! {
        /// Outside a run: `None`. In one: the sets written (or read) in full so far.
        pub(super) static WRITTEN: RefCell<Option<Vec<Arc<Tools>>>> = const { RefCell::new(None) };
    }

    /// Number `t` as the next set written in full, if the run numbers it.
    fn number(t: &Arc<Tools>) {
        WRITTEN.with(|w| {
            if let Some(sets) = &mut *w.borrow_mut()
                && sets.len() < SETS
            {
                sets.push(t.clone());
            }
        });
    }

    pub fn serialize<S: Serializer>(t: &Arc<Tools>, s: S) -> Result<S::Ok, S::Error> {
        let seen = WRITTEN.with(|w| {
            w.borrow()
                .as_ref()
                .and_then(|sets| sets.iter().position(|p| Arc::ptr_eq(p, t)))
        });
        if let Some(i) = seen {
            return s.serialize_u64(i as u64);
        }
        number(t);
        t.as_ref().serialize(s)
    }

    /// A set in full, or its number (read from the text: the schemas in a set are kept as
    /// their text, which a reader that buffers, as `untagged` does, cannot give).
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<Tools>, D::Error> {
        let raw = Box::<serde_json::value::RawValue>::deserialize(d)?;
        if let Ok(i) = raw.get().parse::<u64>() {
            return WRITTEN
                .with(|w| {
                    let sets = w.borrow();
                    sets.as_ref()?.get(usize::try_from(i).ok()?).cloned()
                })
                .ok_or_else(|| {
                    serde::de::Error::custom(format!(
                        "tools written as set {i}, which this run of records does not hold"
                    ))
                });
        }
        let t =
            Arc::new(serde_json::from_str::<Tools>(raw.get()).map_err(serde::de::Error::custom)?);
        number(&t);
        Ok(t)
    }
}

/// How `State::cluster` and `Patch::cluster` are written and read (see `in_a_run`).
pub mod cluster_in_run {
    use super::super::quorum::Cluster;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::cell::RefCell;
    use std::sync::Arc;

    thread_local! {
        /// Outside a run: `None`. In one: the cluster view last written or read, if any.
        pub(super) static LAST: RefCell<Option<Option<Arc<Cluster>>>> = const { RefCell::new(None) };
    }

    const SAME: &str = "same";

    pub fn serialize<S: Serializer>(c: &Arc<Cluster>, s: S) -> Result<S::Ok, S::Error> {
        let same = LAST.with(|l| match &mut *l.borrow_mut() {
            Some(last) if last.as_ref().is_some_and(|p| Arc::ptr_eq(p, c)) => true,
            Some(last) => {
                *last = Some(c.clone());
                false
            }
            None => false,
        });
        if same {
            s.serialize_str(SAME)
        } else {
            c.as_ref().serialize(s)
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Wire {
        Full(Cluster),
        Mark(String),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<Cluster>, D::Error> {
        let c = match Wire::deserialize(d)? {
            Wire::Full(c) => Arc::new(c),
            Wire::Mark(m) if m == SAME => {
                LAST.with(|l| l.borrow().clone().flatten()).ok_or_else(|| {
                    serde::de::Error::custom(
                        "a cluster view written as \"same\" with none before it",
                    )
                })?
            }
            Wire::Mark(m) => {
                return Err(serde::de::Error::custom(format!(
                    "{m:?} is no cluster view"
                )));
            }
        };
        LAST.with(|l| {
            if let Some(last) = &mut *l.borrow_mut() {
                *last = Some(c.clone());
            }
        });
        Ok(c)
    }

    /// The same, for an optional view (`Patch::cluster`).
    pub mod option {
        use super::*;

        pub fn serialize<S: Serializer>(c: &Option<Arc<Cluster>>, s: S) -> Result<S::Ok, S::Error> {
            match c {
                Some(c) => super::serialize(c, s),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<Arc<Cluster>>, D::Error> {
            super::deserialize(d).map(Some)
        }
    }
}

/// A decision shared by its readers (the live decision stream, the decision log), with its
/// JSON written once, by whichever reader writes it first.
#[derive(Clone, Debug)]
pub struct Decided {
    decision: Decision,
    json: std::sync::OnceLock<Box<serde_json::value::RawValue>>,
}

impl Decided {
    pub fn new(decision: Decision) -> Self {
        Decided {
            decision,
            json: std::sync::OnceLock::new(),
        }
    }

    /// The decision to change (its JSON is written afresh when next asked for).
    #[cfg(test)]
    pub(crate) fn decision_mut(&mut self) -> &mut Decision {
        self.json = std::sync::OnceLock::new();
        &mut self.decision
    }

    /// Its JSON, as `Decision`'s own `Serialize` writes it.
    pub fn json(&self) -> Result<&serde_json::value::RawValue, serde_json::Error> {
        if let Some(j) = self.json.get() {
            return Ok(j);
        }
        let written = serde_json::value::to_raw_value(&self.decision)?;
        Ok(self.json.get_or_init(|| written))
    }
}

impl std::ops::Deref for Decided {
    type Target = Decision;
    fn deref(&self) -> &Decision {
        &self.decision
    }
}

impl PartialEq for Decided {
    fn eq(&self, other: &Self) -> bool {
        self.decision == other.decision
    }
}

impl Serialize for Decided {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.json().map_err(serde::ser::Error::custom)?.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Decided {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Decision::deserialize(d).map(Decided::new)
    }
}

/// Everything needed to replay one request's decision.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub node: String,
    pub request: Request,
    pub began_ms: u64,
    /// The state `begin` saw.
    pub begin: Snapshot,
    pub calls: Vec<Logged>,
    /// Shared with the decision's other readers (the live decision stream): never copied,
    /// and written out once.
    pub decision: std::sync::Arc<Decided>,
    /// The messages' and answers' content was left out (`[decision_log] content = "hash"`, or
    /// more of it than `max_content_bytes`): each is its hash, and the record cannot be replayed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub content_hashed: bool,
    /// What its attempts were charged in the cluster's budget ledger, one settlement each
    /// (none when no ledger budget covers it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub charges: Vec<Charge>,
}

/// One settlement of an attempt's cost in the cluster's budget ledger (`core::ledger`): the
/// holder that wrote it (a run of the node), its number there, what it charged and to which
/// budget records. `oam spend --verify` matches it with the ledger's count of each holder's
/// settlements.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Charge {
    pub holder: String,
    pub seq: u64,
    pub usd: f64,
    /// The budget records' keys (`global`, `agent.{name}`).
    pub budgets: Vec<String>,
}

impl Record {
    /// The bytes of content it carries: the request's messages and every answer's.
    pub fn content_bytes(&self) -> usize {
        let asked: usize = self.request.messages.iter().map(|m| m.content.len()).sum();
        let answered: usize = self
            .calls
            .iter()
            .map(|l| match &l.call {
                Call::Complete { generation } => generation.content.len(),
                _ => 0,
            })
            .sum();
        asked + answered
    }

    /// Keep every message's and answer's content as `hash` of it only: the record stays
    /// listed and explained as far as it goes, but cannot be replayed.
    pub fn hash_content(&mut self, hash: impl Fn(&str) -> String) {
        for m in &mut self.request.messages {
            m.content = hash(&m.content);
        }
        for l in &mut self.calls {
            if let Call::Complete { generation } = &mut l.call {
                generation.content = hash(&generation.content);
            }
        }
        self.content_hashed = true;
    }

    /// Drive the request through a fresh engine with `config`, each call on the state it saw.
    pub fn replay(&self, config: &Config) -> Result<Decision, ReplayError> {
        self.drive(config, Ok)
    }

    /// Replay under `config` with `targets` and `routes` (another config's), each call on the
    /// whole per-target state it saw, as the node's state timeline has it (`at` a version),
    /// not only the cut of its own route this record keeps: what would have been decided had
    /// these been in force. Slots, loops, budgets and the cluster's members are the record's.
    pub fn replay_under<'s>(
        &self,
        config: &Config,
        targets: &[Target],
        routes: &BTreeMap<String, Route>,
        at: impl Fn(u64) -> Option<&'s StateAt>,
    ) -> Result<Decision, ReplayError> {
        self.replay_with(config, targets, routes, None, at)
    }

    /// `replay_under`, with the budgets each call saw changed by `budgets` (a rehearsal's
    /// limits and what its candidate would have spent by then).
    pub fn replay_with<'s>(
        &self,
        config: &Config,
        targets: &[Target],
        routes: &BTreeMap<String, Route>,
        budgets: Option<&dyn Fn(&mut super::budget::Budgets)>,
        at: impl Fn(u64) -> Option<&'s StateAt>,
    ) -> Result<Decision, ReplayError> {
        self.drive(config, |mut snap| {
            let seen = match snap.seen {
                0 => return Err(ReplayError::NoTimeline),
                v => at(v).ok_or(ReplayError::NotInTimeline(v))?,
            };
            let st = &mut snap.state;
            // Every target's observations from the timeline; the members (and their
            // heartbeats) as this call saw them, which the record keeps.
            let mut cluster = seen.cluster.clone();
            if cluster.members != st.cluster.members {
                std::sync::Arc::make_mut(&mut cluster).members = st.cluster.members.clone();
            }
            st.cluster = cluster;
            st.providers = targets.to_vec();
            st.routes = routes.clone();
            st.breakers = seen.breakers.clone();
            st.cooldowns = seen.cooldowns.clone();
            st.misconfigured = seen.misconfigured.clone();
            if let Some(b) = budgets {
                b(&mut st.budgets);
            }
            Ok(snap)
        })
    }

    /// `replay_with` on the record's own cut of the state (its route's targets) where the
    /// timeline the record names is not to be had (the log lost its older entries): the
    /// candidate's targets, routes and budget limits, and what the record itself saw of the
    /// cluster; a target it did not see has no observations.
    pub fn replay_on_cut(
        &self,
        config: &Config,
        targets: &[Target],
        routes: &BTreeMap<String, Route>,
        budgets: Option<&dyn Fn(&mut super::budget::Budgets)>,
    ) -> Result<Decision, ReplayError> {
        self.drive(config, |mut snap| {
            let st = &mut snap.state;
            st.providers = targets.to_vec();
            st.routes = routes.clone();
            if let Some(b) = budgets {
                b(&mut st.budgets);
            }
            Ok(snap)
        })
    }

    /// Drive the request through a fresh engine with `config`, each call on the state it saw
    /// as `state` makes it from the record's own.
    fn drive(
        &self,
        config: &Config,
        mut state: impl FnMut(Snapshot) -> Result<Snapshot, ReplayError>,
    ) -> Result<Decision, ReplayError> {
        if self.content_hashed {
            return Err(ReplayError::Hashed);
        }
        let begin = state(self.begin.clone())?;
        let mut e = Engine::new(config.clone(), begin.state);
        e.set_escalations_raised(begin.escalations);
        let (mut s, mut step) = e
            .begin(self.request.clone(), self.began_ms)
            .map_err(|err| ReplayError::Invalid {
                field: err.field,
                message: err.message,
            })?;
        for l in &self.calls {
            // Decided: what the record holds after is for a decision made otherwise (another
            // config ended it sooner), never applied to a finished request.
            if matches!(step, Step::Done(_)) {
                break;
            }
            let before = state(l.before.apply(&self.begin))?;
            e.state = before.state;
            e.set_escalations_raised(before.escalations);
            if let Some(next) = e.apply(&mut s, l.call.clone(), l.at_ms) {
                step = next;
            }
        }
        match step {
            Step::Done(d) => Ok(*d),
            Step::Queued => Err(ReplayError::Queued),
            Step::Dispatch(d) => Err(ReplayError::Dispatched {
                attempt: d.attempt,
                provider: d.provider.to_string(),
            }),
        }
    }

    /// Does replaying it give the recorded decision, byte for byte? `Ok(())`, or what differs.
    pub fn verify(&self, config: &Config) -> Result<(), ReplayError> {
        let replayed = self.replay(config)?;
        let json = |d: &Decision| {
            serde_json::to_string(d).map_err(|e| ReplayError::Unwritable(e.to_string()))
        };
        let (recorded, replayed) = (json(&self.decision)?, json(&replayed)?);
        if recorded == replayed {
            Ok(())
        } else {
            Err(ReplayError::Differs { recorded, replayed })
        }
    }
}

/// Why a record does not replay to its decision.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReplayError {
    #[error(
        "the messages were left out of this record (content = \"hash\", or more than \
         [decision_log] max_content_bytes), so it cannot be replayed"
    )]
    Hashed,
    /// The engine refuses the recorded request (under this config).
    #[error("request.{field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error("the record ends with the request still queued")]
    Queued,
    #[error("the record ends with attempt {attempt} dispatched to {provider} and no result")]
    Dispatched { attempt: u32, provider: String },
    /// The replay decided otherwise: both decisions as JSON.
    #[error("recorded {recorded}\nreplayed {replayed}")]
    Differs { recorded: String, replayed: String },
    #[error("a decision cannot be written as JSON: {0}")]
    Unwritable(String),
    #[error("the record names no state version: its node kept no state timeline")]
    NoTimeline,
    #[error("state version {0} is not in the timeline read")]
    NotInTimeline(u64),
}

/// Builds a request's record as its driver goes (see `Record`).
#[derive(Clone, Debug)]
pub struct Recorder {
    node: String,
    request: Request,
    began_ms: u64,
    begin: Snapshot,
    calls: Vec<Logged>,
    charges: Vec<Charge>,
}

impl Recorder {
    /// Before `begin`: the request and the state it is about to see (and its version in the
    /// engine's timeline, written first when it changed).
    pub fn begin(e: &mut Engine, request: &Request, now_ms: u64) -> Recorder {
        let seen = e.seen(now_ms);
        let mut begin = e.snapshot_for(request);
        begin.seen = seen;
        Recorder {
            node: e.state.cluster.self_id.clone(),
            request: request.clone(),
            began_ms: now_ms,
            begin,
            calls: Vec::new(),
            charges: Vec::new(),
        }
    }

    /// An attempt's cost was settled in the budget ledger as `charge`.
    pub fn charged(&mut self, charge: Charge) {
        self.charges.push(charge);
    }

    /// Before applying `call` to the engine.
    pub fn call(&mut self, e: &mut Engine, call: &Call, now_ms: u64) {
        let seen = e.seen(now_ms);
        self.calls.push(Logged {
            at_ms: now_ms,
            call: call.clone(),
            before: Patch::of(&self.begin, e, &self.request, seen),
        });
    }

    pub fn finish(self, decision: std::sync::Arc<Decided>) -> Record {
        Record {
            node: self.node,
            request: self.request,
            began_ms: self.began_ms,
            begin: self.begin,
            calls: self.calls,
            decision,
            content_hashed: false,
            charges: self.charges,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::core::breaker::Breaker;
    use crate::core::pipeline::tests::{T0, engine, req as request};
    use crate::core::request::GenerationStatus;

    /// A request `id` recorded as a node records it (answered after one retry).
    pub(crate) fn answered(id: &str) -> Record {
        recorded(&mut engine(), request(id))
    }

    /// Drive `r` as a node does, recording it; between its calls another "request" changes
    /// the engine (a breaker opens), as concurrent traffic does.
    fn recorded(e: &mut Engine, r: Request) -> Record {
        let mut rec = Recorder::begin(e, &r, T0);
        let (mut s, mut step) = e.begin(r, T0).expect("valid");
        let mut now = T0;
        let mut answers = vec![
            Generation::failed(GenerationStatus::Error, 30),
            Generation::ok(r#"{"answer":"42","confidence":0.9}"#, 80),
        ]
        .into_iter();
        loop {
            step = match step {
                Step::Done(d) => return rec.finish(std::sync::Arc::new(Decided::new(*d))),
                Step::Queued => unreachable!("one request, free slots"),
                Step::Dispatch(_) => {
                    let g = answers.next().expect("scripted");
                    now += g.latency_ms;
                    // Someone else's failures open the secondary's breaker meanwhile.
                    e.state.breakers.insert(
                        "secondary".into(),
                        Breaker::Open {
                            until_ms: now + 10_000,
                            forced: false,
                        },
                    );
                    let call = Call::Complete { generation: g };
                    rec.call(e, &call, now);
                    e.apply(&mut s, call, now).expect("a step")
                }
            };
        }
    }

    #[test]
    fn a_recorded_request_replays_to_its_decision_byte_for_byte() {
        let mut e = engine();
        let r = recorded(&mut e, request("r1"));
        assert_eq!(r.decision.attempts.len(), 2, "{:?}", r.decision);
        assert_eq!(r.calls.len(), 2);
        // The retry saw the secondary's breaker open (another request's doing).
        assert!(
            r.calls[0]
                .before
                .breakers
                .as_ref()
                .is_some_and(|b| b.contains_key("secondary"))
        );
        // What did not change is not kept again.
        assert!(r.calls[0].before.cluster.is_none() && r.calls[0].before.providers.is_none());
        assert_eq!(r.verify(&e.config), Ok(()));
        // Through JSON, as the log keeps it.
        let back: Record = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back.verify(&e.config), Ok(()));
        // Under another configuration it is another decision, and that is said.
        let mut other = e.config.clone();
        other.max_attempts.low = 1;
        assert!(r.verify(&other).is_err());
    }

    #[test]
    fn a_record_on_a_route_keeps_its_route_s_targets_alone_and_replays() {
        use crate::core::health::Verdict;
        use crate::core::pipeline::tests::{asking, observation, routed};
        let mut e = routed();
        // A hundred more targets on no route, some of them failing.
        for i in 0..100 {
            let mut t = e.state.providers[0].clone();
            t.id = format!("x{i}").into();
            e.state.providers.push(t);
            let seen = observation("n1", &format!("x{i}"), Verdict::Unhealthy, 0.0);
            std::sync::Arc::make_mut(&mut e.state.cluster).observe(seen);
        }
        let open = Breaker::Open {
            until_ms: T0 + 10_000,
            forced: false,
        };
        e.state.breakers.insert("x7".into(), open);
        e.state.cooldowns.insert("x8".into(), T0 + 5_000);
        e.state.misconfigured.insert("x9".into(), T0 + 5_000);

        let r = asking("big", "r1");
        let mut rec = Recorder::begin(&mut e, &r, T0);
        let (mut s, step) = e.begin(r, T0).expect("valid");
        assert!(matches!(step, Step::Dispatch(ref d) if &*d.provider == "h/big"));
        // Meanwhile other requests close x7's breaker (off the route) and open o/big's.
        e.state.breakers.remove("x7");
        e.state.breakers.insert("o/big".into(), open);
        let call = Call::Complete {
            generation: Generation::failed(GenerationStatus::Error, 30),
        };
        rec.call(&mut e, &call, T0 + 30);
        let Some(Step::Done(d)) = e.apply(&mut s, call, T0 + 30) else {
            panic!("o/big is open: nothing is left to try");
        };
        let r = rec.finish(std::sync::Arc::new(Decided::new(*d)));

        let begin = &r.begin.state;
        let ids: Vec<&str> = begin.providers.iter().map(|p| &*p.id).collect();
        assert_eq!(ids, ["h/big", "o/big"]);
        let seen: Vec<&str> = begin.cluster.observations.keys().map(|k| &**k).collect();
        assert_eq!(seen, ["h/big", "o/big"]);
        assert!(begin.breakers.is_empty() && begin.cooldowns.is_empty());
        assert!(begin.misconfigured.is_empty());
        let before = &r.calls[0].before;
        let breakers: Vec<&str> = before
            .breakers
            .iter()
            .flatten()
            .map(|(k, _)| &**k)
            .collect();
        // The dispatch to h/big wrote its breaker; x7's change is not the route's.
        assert_eq!(breakers, ["h/big", "o/big"]);
        assert!(before.cluster.is_none() && before.providers.is_none());
        assert_eq!(r.verify(&e.config), Ok(()));
        let back: Record = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back.verify(&e.config), Ok(()));

        // A request on no route reads, and keeps, every target.
        let every = e.snapshot_for(&asking("auto", "r2"));
        assert_eq!(every.state.providers.len(), 103);
        assert!(std::sync::Arc::ptr_eq(
            &every.state.cluster,
            &e.state.cluster
        ));
        assert!(every.state.breakers.contains_key("o/big") && every.state.cooldowns.len() == 1);
        // The route's cut of the view is made once, and again after the view changes.
        let cut = |e: &Engine| e.snapshot_for(&asking("big", "r3")).state.cluster;
        assert!(std::sync::Arc::ptr_eq(&cut(&e), &cut(&e)));
        let before_change = cut(&e);
        let mut newer = observation("n1", "o/big", Verdict::Unhealthy, 0.0);
        newer.at_ms += 1;
        std::sync::Arc::make_mut(&mut e.state.cluster).observe(newer);
        let after = cut(&e);
        assert!(!std::sync::Arc::ptr_eq(&before_change, &after));
        assert_ne!(
            before_change.observations["o/big"],
            after.observations["o/big"]
        );
    }

    #[test]
    fn in_a_run_each_shared_tool_set_is_written_once_and_read_back_shared() {
        use crate::core::request::Tools;
        let set = |name: &str| {
            let schema = serde_json::json!({"type": "object", "description": "unique-schema-text"});
            std::sync::Arc::new(Tools::from([(name.to_string(), schema)]))
        };
        let (t1, t2) = (set("first"), set("second"));
        let mut e = engine();
        let mut with = |id: &str, t: &std::sync::Arc<Tools>| {
            let mut r = request(id);
            r.tools = t.clone();
            recorded(&mut e, r)
        };
        // Interleaved, as two agents' requests come: each set is written in full once.
        let all = vec![
            with("a", &t1),
            with("b", &t2),
            with("c", &t1),
            with("d", &t2),
        ];
        let run = in_a_run(|| serde_json::to_string(&all)).unwrap();
        assert_eq!(run.matches("unique-schema-text").count(), 2, "{run}");
        let back: Vec<Record> = in_a_run(|| serde_json::from_str(&run)).unwrap();
        assert_eq!(back, all);
        assert!(std::sync::Arc::ptr_eq(
            &back[0].request.tools,
            &back[2].request.tools
        ));
        assert_eq!(back[3].request.tools.keys().next().unwrap(), "second");
        // Alone, a set number means nothing: refused, not read as no tools.
        assert!(serde_json::from_str::<Vec<Record>>(&run).is_err());
        // A record cut from the message leaves no number behind for the next to refer to.
        let rewound = in_a_run(|| {
            let mark = run_mark();
            let _ = serde_json::to_string(&all[0]).unwrap();
            rewind_run(mark);
            serde_json::to_string(&all[2]).unwrap()
        });
        assert_eq!(
            rewound.matches("unique-schema-text").count(),
            1,
            "{rewound}"
        );
    }

    #[test]
    fn in_a_run_a_shared_cluster_view_is_written_once_and_read_back() {
        let mut e = engine();
        let (a, b) = (
            recorded(&mut e, request("a")),
            recorded(&mut e, request("b")),
        );
        let both = vec![a.clone(), b.clone()];
        let run = in_a_run(|| serde_json::to_string(&both)).unwrap();
        assert_eq!(run.matches("\"self_id\"").count(), 1, "{run}");
        let back: Vec<Record> = in_a_run(|| serde_json::from_str(&run)).unwrap();
        assert_eq!(back, both);
        assert_eq!(back[1].verify(&e.config), Ok(()));
        // Outside a run, every record carries its own; a "same" read alone is refused.
        let alone = serde_json::to_string(&both).unwrap();
        assert_eq!(alone.matches("\"self_id\"").count(), 2);
        assert!(serde_json::from_str::<Vec<Record>>(&run).is_err());
        let second = serde_json::to_string(&b).unwrap();
        assert_eq!(serde_json::from_str::<Record>(&second).unwrap(), b);
        // A changed view is written in full again.
        std::sync::Arc::make_mut(&mut e.state.cluster).heartbeat("n2", T0 + 1);
        let c = recorded(&mut e, request("c"));
        let three = vec![a, b, c];
        let run = in_a_run(|| serde_json::to_string(&three)).unwrap();
        assert_eq!(run.matches("\"self_id\"").count(), 2);
        let back: Vec<Record> = in_a_run(|| serde_json::from_str(&run)).unwrap();
        assert_eq!(back, three);
    }

    #[test]
    fn a_shared_decision_is_written_as_the_decision_is_and_afresh_once_changed() {
        let mut e = engine();
        let r = recorded(&mut e, request("r9"));
        let plain = serde_json::to_string(&*r.decision.clone()).unwrap();
        let direct = serde_json::to_string::<Decision>(&r.decision).unwrap();
        assert_eq!(plain, direct);
        assert_eq!(
            serde_json::to_string(&*r.decision).unwrap(),
            direct,
            "again, from the cell"
        );
        let mut changed = (*r.decision).clone();
        changed.decision_mut().cost_usd += 1.0;
        let written = serde_json::to_string(&changed).unwrap();
        assert_ne!(written, direct);
        assert_eq!(
            written,
            serde_json::to_string::<Decision>(&changed).unwrap()
        );
        let back: Decided = serde_json::from_str(&written).unwrap();
        assert_eq!(back, changed);
    }

    #[test]
    fn a_tampered_record_does_not_replay() {
        let mut e = engine();
        let r = recorded(&mut e, request("r2"));
        let mut cost = r.clone();
        std::sync::Arc::make_mut(&mut cost.decision)
            .decision_mut()
            .cost_usd += 1.0;
        assert!(cost.verify(&e.config).is_err());
        let mut result = r.clone();
        result.calls[1].call = Call::Complete {
            generation: Generation::failed(GenerationStatus::Timeout, 80),
        };
        let why = result.verify(&e.config).unwrap_err();
        assert!(matches!(why, ReplayError::Differs { .. }), "{why}");
        assert!(why.to_string().starts_with("recorded "), "{why}");
        let mut cut = r.clone();
        cut.calls.pop();
        let why = cut.replay(&e.config).unwrap_err();
        assert!(matches!(why, ReplayError::Dispatched { .. }), "{why}");
        assert!(why.to_string().contains("dispatched"));
        let mut hashed = r.clone();
        hashed.content_hashed = true;
        let why = hashed.verify(&e.config).unwrap_err();
        assert_eq!(why, ReplayError::Hashed);
        assert!(why.to_string().contains("cannot be replayed"));
        // Content counted and hashed: the request's messages and every answer.
        let asked: usize = r.request.messages.iter().map(|m| m.content.len()).sum();
        assert!(r.content_bytes() > asked, "an answer's content counts too");
        let mut h = r;
        h.hash_content(|c| format!("h{}", c.len()));
        assert!(h.content_hashed);
        assert!(
            h.request
                .messages
                .iter()
                .all(|m| m.content.starts_with('h'))
        );
        assert!(h.calls.iter().all(|l| match &l.call {
            Call::Complete { generation } => generation.content.starts_with('h'),
            _ => true,
        }));
        assert!(h.replay(&e.config).is_err());
    }

    /// Record a request for `model` driven as a node does, each attempt answered as
    /// `answers` says in turn (`Ok` when they run out).
    fn driven(e: &mut Engine, model: &str, id: &str, answers: &[GenerationStatus]) -> Record {
        use crate::core::pipeline::tests::asking;
        let r = asking(model, id);
        let mut rec = Recorder::begin(e, &r, T0);
        let (mut s, mut step) = e.begin(r, T0).expect("valid");
        let mut answers = answers.iter();
        while let Step::Dispatch(_) = step {
            let generation = match answers.next() {
                Some(&status) => Generation::failed(status, 5),
                None => Generation::ok(r#"{"answer":"42","confidence":0.9}"#, 5),
            };
            let call = Call::Complete { generation };
            rec.call(e, &call, T0 + 5);
            step = e.apply(&mut s, call, T0 + 5).expect("a step");
        }
        let Step::Done(d) = step else {
            panic!("{id} ended {step:?}")
        };
        rec.finish(std::sync::Arc::new(Decided::new(*d)))
    }

    #[test]
    fn a_rehearsal_names_what_changes_and_falls_back_to_a_record_s_own_cut() {
        use crate::core::pipeline::tests::routed;
        use crate::core::rehearsal::{Candidate, Report};
        let mut e = routed();
        e.keep_timeline();
        let r1 = driven(&mut e, "small", "r1", &[]);
        let mut versions = crate::core::timeline::Versions::default();
        for entry in e.take_timeline() {
            versions.follow(&entry);
        }
        let same = Candidate {
            config: e.config.clone(),
            targets: e.state.providers.clone(),
            routes: e.state.routes.clone(),
            budgets: crate::core::budget::Budgets::default(),
        };
        let mut rep = Report::default();
        rep.add(&r1, &same, |v| versions.at(v));
        assert_eq!(
            (rep.records, rep.replayed, rep.changed.len(), rep.on_own_cut),
            (1, 1, 0, 0)
        );
        // Route `small` served by h/big alone: changed, on an answer assumed.
        let mut routes = same.routes.clone();
        routes.get_mut("small").expect("a route").targets = vec!["h/big".into()];
        let moved = Candidate {
            routes,
            ..same.clone()
        };
        let mut rep = Report::default();
        rep.add(&r1, &moved, |v| versions.at(v));
        assert_eq!(rep.changed.len(), 1, "{rep:?}");
        let c = &rep.changed[0];
        assert_eq!(c.after.target.as_deref(), Some("h/big"));
        assert!(c.answer_assumed);
        assert_eq!(rep.spend_after_usd.keys().collect::<Vec<_>>(), ["h/big"]);
        // The log no longer holds the state it saw: decided on its own cut, and counted.
        let mut rep = Report::default();
        rep.add(&r1, &same, |_| None);
        assert_eq!((rep.replayed, rep.on_own_cut, rep.changed.len()), (1, 1, 0));
    }

    #[test]
    fn a_budget_a_rehearsal_adds_is_charged_as_the_window_goes() {
        use crate::core::pipeline::tests::routed;
        use crate::core::rehearsal::{Candidate, Report};
        let mut e = routed();
        e.keep_timeline();
        let records: Vec<Record> = (0..3)
            .map(|i| driven(&mut e, "small", &format!("b{i}"), &[]))
            .collect();
        let mut versions = crate::core::timeline::Versions::default();
        for entry in e.take_timeline() {
            versions.follow(&entry);
        }
        let first = &records[0];
        assert!(first.decision.cost_usd > 0.0, "priced");
        let est = first.decision.attempts[0].candidates[0].est_cost_usd;
        // A budget the live mesh did not have, as large as one request's estimate: the first
        // fits, and what it cost is charged before the second, which no longer fits.
        let mut budgets = crate::core::budget::Budgets::default();
        budgets.agents.insert(
            first.request.agent.clone(),
            crate::core::budget::Budget::new(est),
        );
        let candidate = Candidate {
            config: e.config.clone(),
            targets: e.state.providers.clone(),
            routes: e.state.routes.clone(),
            budgets,
        };
        let mut rep = Report::default();
        for r in &records {
            rep.add(r, &candidate, |v| versions.at(v));
        }
        let refused: Vec<&str> = rep.changed.iter().map(|c| c.request_id.as_str()).collect();
        assert_eq!(refused, ["b1", "b2"], "{rep:?}");
        assert_eq!(rep.refusals_appear, 2);
        // Each record alone (a fresh report each) fits.
        for r in &records {
            let mut alone = Report::default();
            alone.add(r, &candidate, |v| versions.at(v));
            assert!(alone.changed.is_empty(), "{alone:?}");
        }
    }

    #[test]
    fn under_another_route_a_record_replays_on_the_state_of_targets_it_never_used() {
        use crate::core::pipeline::tests::routed;
        use crate::core::timeline::StateAt;
        let mut e = routed();
        e.keep_timeline();
        // h/big answers 429 (a cool-down), o/big serves; then a request on `small`, whose
        // record keeps only h/small's state.
        driven(&mut e, "big", "r0", &[GenerationStatus::RateLimited]);
        let r1 = driven(&mut e, "small", "r1", &[]);
        assert!(e.state.cooldowns.contains_key("h/big"));
        assert!(r1.begin.state.cooldowns.is_empty() && r1.begin.seen > 0);
        let mut versions = std::collections::BTreeMap::new();
        let mut at: Option<StateAt> = None;
        for entry in e.take_timeline() {
            match at.as_mut() {
                None => at = Some(StateAt::of(&entry).expect("whole")),
                Some(s) => s.then(&entry).expect("in order"),
            }
            let s = at.clone().expect("read");
            versions.insert(s.version, s);
        }
        let (targets, routes) = (&e.state.providers, &e.state.routes);
        let json = |d: &Decision| serde_json::to_string(d).unwrap();

        // Under its own config it is its own decision.
        let same = r1.replay_under(&e.config, targets, routes, |v| versions.get(&v));
        assert_eq!(json(&same.expect("replays")), json(&r1.decision));

        // A candidate that puts h/big first on `small`: h/big was cooling down then, so h/small
        // still serves, as a fallback.
        let mut candidate = routes.clone();
        let small = candidate.get_mut("small").expect("a route");
        small.targets.insert(0, "h/big".into());
        let d = r1
            .replay_under(&e.config, targets, &candidate, |v| versions.get(&v))
            .expect("replays");
        let served = d.attempts.last().and_then(|a| a.provider.as_deref());
        assert_eq!(served, Some("h/small"), "{}", json(&d));
        assert!(d.attempts.last().is_some_and(|a| a.fallback));
        // The record's own cut does not know h/big's cool-down: on it alone, h/big would serve.
        let cut = |v: u64| {
            let st = &r1.begin.state;
            Some(StateAt {
                version: v,
                awaiting: 0,
                cluster: st.cluster.clone(),
                providers: st.providers.clone(),
                routes: st.routes.clone(),
                breakers: st.breakers.clone(),
                cooldowns: st.cooldowns.clone(),
                misconfigured: st.misconfigured.clone(),
            })
        };
        let alone = cut(r1.begin.seen).expect("a cut");
        let wrong = r1
            .replay_under(&e.config, targets, &candidate, |_| Some(&alone))
            .expect("replays");
        let served = wrong.attempts.last().and_then(|a| a.provider.as_deref());
        assert_eq!(served, Some("h/big"));

        // A version the reader does not have, and a record from a node without a timeline.
        let missing = r1.replay_under(&e.config, targets, routes, |_| None);
        assert_eq!(missing, Err(ReplayError::NotInTimeline(r1.begin.seen)));
        let mut plain = routed();
        let untimed = driven(&mut plain, "small", "r2", &[]);
        let none = untimed.replay_under(&e.config, targets, routes, |v| versions.get(&v));
        assert_eq!(none, Err(ReplayError::NoTimeline));
    }
}
