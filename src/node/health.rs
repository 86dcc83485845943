//! What this node sees of each target's health, and the service that checks idle targets.
//!
//! [`Health`] keeps a window of samples per target (from traffic and from probes), the targets
//! that are mesh agents whose death notice came, and what probes cost; the request path and
//! gossip share it. A verdict rests on the cluster's evidence: every observation a node shares
//! carries what it saw itself, and each node judges on its own and its live peers' together
//! (`core::health::judge`), so a node without traffic learns from the traffic others see.
//!
//! [`Prober`] checks idle targets as a cluster: each target has one prober among the live nodes
//! (rendezvous hashing, so nodes split the targets and never probe in phase), its probes jittered,
//! at most 16 out at once and none waited for by another. The default check (`probe = "auto"`)
//! is free, the provider's model list; a billed one (a completion of one token) only confirms the
//! recovery of a target that real calls found failing, at most once per interval, charged to the
//! day's probe budget in the ledger (`[probes] max_usd_per_day`).

use super::Node;
use super::bus::Bus;
use super::config::{NodeConfig, Probe};
use super::metrics::{Kind, Registry};
use super::pipeline::{Pipeline, lock};
use super::upstream::Connector;
use crate::clock::now_ms;
use crate::core::breaker::Breaker;
use crate::core::contract::Contract;
use crate::core::health::{Evidence, FirstHand, Outcome, Stats, Verdict, Window, judge};
use crate::core::quorum::Observation;
use crate::core::reason::ReasonCode;
use crate::core::request::{GenerationStatus, Message, round_usd};
use crate::core::wire::{Observations, ProbeSnapshot};
use crate::transport::subjects;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Probes out at once, at most.
pub(crate) const MAX_PROBES_OUT: usize = 16;
/// A billed probe's prompt.
const BILLED_PROMPT: &str = "Reply with ok.";
/// What a `chat` probe asks (held to the default contract, if any).
const CHAT_PROMPT: &str = "oam health probe: reply with {\"answer\": \"ok\", \"confidence\": 1}";

/// When a target last had a sample from traffic, when it was last probed (less its jitter)
/// and last given a billed probe (ms; 0: never), and until when it is not to be probed (its
/// Retry-After).
#[derive(Default)]
struct Clocks {
    traffic: AtomicU64,
    probe: AtomicU64,
    billed: AtomicU64,
    quiet_until: AtomicU64,
    /// Billed confirmations in a row that found it failing (each doubles the wait for the
    /// next: `confirm_every`).
    confirms_failed: std::sync::atomic::AtomicU32,
}

/// The longest wait between billed confirmations of a target that keeps failing: one a minute
/// at most, for as long as it fails (it was one an interval, 86,400 a day).
pub(crate) const CONFIRM_MAX_MS: u64 = 60_000;

/// Billed confirmations a failing target gets at the probe interval before they back off: a
/// short outage (about this many intervals) is seen to end as fast as before.
pub(crate) const CONFIRM_QUICK: u32 = 10;

/// How long between billed confirmations of a target whose last `failed` ones found it
/// failing: the probe interval for the first `CONFIRM_QUICK`, then doubled after each, to at
/// most `CONFIRM_MAX_MS`.
pub(crate) fn confirm_every(every: u64, failed: u32) -> u64 {
    let doublings = failed.saturating_sub(CONFIRM_QUICK - 1).min(16);
    every
        .saturating_mul(1u64 << doublings)
        .min(CONFIRM_MAX_MS.max(every))
}

pub(crate) struct Health {
    id: String,
    windows: Mutex<BTreeMap<String, Window>>,
    clocks: BTreeMap<String, Clocks>,
    /// Targets that are mesh agents whose death notice arrived; UNHEALTHY until a probe
    /// succeeds again.
    down: Mutex<BTreeSet<String>>,
    pipeline: Pipeline,
    bus: Arc<Bus>,
    /// What this node's probes were and cost.
    pub probes: Arc<ProbeBook>,
    /// Each target's last failed call, and how many have failed since one worked.
    failures: Mutex<BTreeMap<String, crate::core::wire::LastFailure>>,
}

/// How often idle targets are probed: every `every` ms, and every `quick` ms while one
/// answers again after failing, until its window has judged the recovery.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Schedule {
    pub every: u64,
    pub quick: u64,
}

impl Schedule {
    pub(crate) fn new(every_ms: u64) -> Schedule {
        Schedule {
            every: every_ms,
            quick: (every_ms / 4).max(50),
        }
    }

    /// Is a target due a probe at `now`? Only an idle one (no traffic sample within `every`:
    /// a target in use is not probed, its traffic is the probe), once per `every`, or once per
    /// `quick` while it is `recovering`.
    pub(crate) fn due(
        &self,
        now: u64,
        last_traffic: u64,
        last_probe: u64,
        recovering: bool,
    ) -> bool {
        let idle = now.saturating_sub(last_traffic) >= self.every;
        let since = now.saturating_sub(last_probe);
        idle && (since >= self.every || (recovering && since >= self.quick))
    }

    /// How much sooner than `every` the next probe of `target` by `node` after `now` comes: up
    /// to a tenth of the interval, so probes that started together drift apart.
    pub(crate) fn jitter(&self, target: &str, node: &str, now: u64) -> u64 {
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(format!("{node}\0{target}").as_bytes(), now);
        h % (self.every / 10 + 1)
    }
}

/// Which live node probes `target`: the one whose hash with it is highest (rendezvous hashing:
/// every node computes the same one from the same members, and a node's going moves only its
/// own targets).
pub(crate) fn prober_of<'a>(target: &str, live: &[&'a str]) -> Option<&'a str> {
    live.iter()
        .copied()
        .max_by_key(|n| xxhash_rust::xxh3::xxh3_64(format!("{n}\0{target}").as_bytes()))
}

/// What check a target gets, as its provider's `probe` says and as it is doing.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Check {
    /// The model list: free.
    Models,
    /// A chat completion (or an embedding) held to the default contract: billed.
    Chat,
    /// A completion of one token, to confirm a failed target answers again: billed.
    Confirm,
}

impl Check {
    /// `oam_probe_calls_total`'s `kind`.
    pub(crate) fn kind(self) -> &'static str {
        match self {
            Check::Models => "models",
            Check::Chat | Check::Confirm => "chat",
        }
    }

    pub(crate) fn billed(self) -> bool {
        self != Check::Models
    }
}

/// The check `probe` asks for, for a target that real calls found `failing` (or not), served
/// over HTTP (`http`: it has a model list) or by a mesh agent. `auto` checks for free and
/// confirms a failed target's recovery with one billed token; an agent's liveness is the mesh's
/// (death notices), so an agent that is not failing is not checked at all.
pub(crate) fn check_for(probe: Probe, failing: bool, http: bool) -> Option<Check> {
    match probe {
        Probe::Off => None,
        Probe::Models => Some(Check::Models),
        Probe::Chat => Some(Check::Chat),
        Probe::Auto if failing => Some(Check::Confirm),
        Probe::Auto => http.then_some(Check::Models),
    }
}

/// How a probe's answer is judged, as a request's is: the model list says only that the
/// provider answers; a chat answer is held to `contract`; an answer that refuses the request
/// itself (invalid, too long, against a content policy) says nothing of the target's health
/// and is no sample (`None`), on a probe as on a request.
pub(crate) fn probe_outcome(
    check: Check,
    status: GenerationStatus,
    contract_failed: impl FnOnce() -> bool,
) -> Option<Outcome> {
    Some(match status {
        // `GenerationStatus::says_nothing_of_target`, which the request path holds to.
        GenerationStatus::Rejected
        | GenerationStatus::ContextLength
        | GenerationStatus::ContentPolicy
        | GenerationStatus::LocalResources => return None,
        GenerationStatus::Ok if check != Check::Chat => Outcome::Success,
        GenerationStatus::Ok if contract_failed() => Outcome::ContractFailure,
        GenerationStatus::Ok => Outcome::Success,
        GenerationStatus::Timeout => Outcome::Timeout,
        GenerationStatus::Error
        | GenerationStatus::RateLimited
        | GenerationStatus::Unauthorized => Outcome::Error,
    })
}

/// What this node's probes were and what the billed ones cost: `oam_probe_calls_total`,
/// `oam_probe_spend_usd_total`, `oam_probe_spend_usd_per_hour`, and the node's snapshot.
#[derive(Default)]
pub(crate) struct ProbeBook {
    calls: Mutex<BTreeMap<(String, &'static str), u64>>,
    /// The billed probes' costs of the last hour by the second they were spent in, oldest
    /// first: 3,600 entries at most, however many targets are probed.
    hour: Mutex<VecDeque<(u64, f64)>>,
    /// The same, per target (so what probing one target costs an hour is said).
    hour_by_target: Mutex<BTreeMap<String, VecDeque<(u64, f64)>>>,
    spent_usd: Mutex<f64>,
    /// Why billed probes are not being sent now (the probe budget), if they are not.
    stopped: Mutex<Option<ReasonCode>>,
}

const HOUR_MS: u64 = 3_600_000;

/// The sum of `hour`'s spend within the hour before `now`, what is older dropped.
fn last_hour(hour: &mut VecDeque<(u64, f64)>, now: u64) -> f64 {
    while hour
        .front()
        .is_some_and(|(at, _)| now.saturating_sub(*at) >= HOUR_MS)
    {
        hour.pop_front();
    }
    // (A float sum of nothing is -0, which a dashboard would show as such.)
    round_usd(hour.iter().fold(0.0, |sum, (_, usd)| sum + usd))
}

impl ProbeBook {
    fn called(&self, target: &str, check: Check) {
        *lock(&self.calls)
            .entry((target.to_string(), check.kind()))
            .or_default() += 1;
    }

    fn spent(&self, now: u64, target: &str, usd: f64) {
        if usd <= 0.0 {
            return;
        }
        let add = |hour: &mut VecDeque<(u64, f64)>| match hour.back_mut() {
            Some((at, sum)) if *at / 1_000 == now / 1_000 => *sum += usd,
            _ => hour.push_back((now, usd)),
        };
        add(&mut lock(&self.hour));
        add(lock(&self.hour_by_target)
            .entry(target.to_string())
            .or_default());
        let mut total = lock(&self.spent_usd);
        *total = round_usd(*total + usd);
    }

    fn stop(&self, why: Option<ReasonCode>) {
        let mut stopped = lock(&self.stopped);
        if *stopped != why {
            match why {
                Some(code) => tracing::warn!(%code, "billed health probes stopped"),
                None => tracing::info!("billed health probes resumed"),
            }
            *stopped = why;
        }
    }

    /// What billed probes cost over the last hour.
    pub(crate) fn usd_last_hour(&self, now: u64) -> f64 {
        last_hour(&mut lock(&self.hour), now)
    }

    /// What billed probes of each target cost over the last hour (targets with none left out).
    pub(crate) fn usd_last_hour_by_target(&self, now: u64) -> BTreeMap<String, f64> {
        let mut all = lock(&self.hour_by_target);
        all.iter_mut()
            .map(|(t, hour)| (t.clone(), last_hour(hour, now)))
            .filter(|(_, usd)| *usd > 0.0)
            .collect()
    }

    pub(crate) fn snapshot(&self, now: u64) -> ProbeSnapshot {
        let mut calls: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
        for ((target, kind), n) in lock(&self.calls).iter() {
            calls
                .entry(target.clone())
                .or_default()
                .insert((*kind).to_string(), *n);
        }
        ProbeSnapshot {
            calls,
            spend_usd_per_hour: self.usd_last_hour(now),
            spend_usd_per_hour_by_target: self.usd_last_hour_by_target(now),
            spent_usd: *lock(&self.spent_usd),
            stopped: *lock(&self.stopped),
        }
    }

    pub(crate) fn register(self: &Arc<Self>, registry: &Registry) {
        let book = self.clone();
        registry.register(
            "oam_probe_calls_total",
            "Health probes this node sent, by target and kind: models (the model list: free) or \
             chat (a completion: billed).",
            Kind::Counter,
            move |s| {
                for ((target, kind), n) in lock(&book.calls).iter() {
                    s.put(&[("target", target), ("kind", kind)], n);
                }
            },
        );
        let book = self.clone();
        registry.register(
            "oam_probe_spend_usd_total",
            "What this node's billed health probes cost, at the targets' prices.",
            Kind::Counter,
            move |s| s.put(&[], *lock(&book.spent_usd)),
        );
        let book = self.clone();
        registry.register(
            "oam_probe_spend_usd_per_hour",
            "What this node's billed health probes cost over the last hour.",
            Kind::Gauge,
            move |s| s.put(&[], book.usd_last_hour(now_ms())),
        );
        let book = self.clone();
        registry.register(
            "oam_probe_target_spend_usd_per_hour",
            "What this node's billed health probes of each target cost over the last hour.",
            Kind::Gauge,
            move |s| {
                for (target, usd) in book.usd_last_hour_by_target(now_ms()) {
                    s.put(&[("target", &target)], usd);
                }
            },
        );
    }
}

impl Health {
    pub(crate) fn new(id: &str, cfg: &NodeConfig, pipeline: Pipeline, bus: Arc<Bus>) -> Health {
        let ids = || cfg.targets.iter().map(|t| t.id.clone());
        Health {
            id: id.to_string(),
            windows: Mutex::new(
                ids()
                    .map(|t| (t, Window::new(cfg.node.health_window_ms)))
                    .collect(),
            ),
            clocks: ids().map(|t| (t, Clocks::default())).collect(),
            down: Mutex::default(),
            pipeline,
            bus,
            probes: Arc::default(),
            failures: Mutex::default(),
        }
    }

    /// A call to `target` by `by` (`probe`, `request`) failed with `g`: kept as its last
    /// failure, said in the node's snapshot and `oam mesh status`.
    pub(crate) fn failed(&self, target: &str, by: &str, g: &crate::core::request::Generation) {
        let mut all = lock(&self.failures);
        let failing = all.get(target).map_or(0, |f| f.failing) + 1;
        let error = g.error.as_ref().map(|e| e.chars().take(300).collect());
        all.insert(
            target.to_string(),
            crate::core::wire::LastFailure {
                at_ms: now_ms(),
                by: by.to_string(),
                status: g.status,
                error,
                failing,
            },
        );
    }

    /// `oam_target_failing_calls` and `oam_target_last_failure_age_seconds`: why a target is
    /// down, where a dashboard or an alert reads it.
    pub(crate) fn register(self: &Arc<Self>, registry: &Registry) {
        let me = self.clone();
        registry.register(
            "oam_target_failing_calls",
            "Calls of a target that failed since the last that worked, by the class of its last \
             failure (unauthorized, rate_limited, timeout, error, ...) and what met it (probe or \
             request); 0 once one works again.",
            Kind::Gauge,
            move |s| {
                for (target, f) in lock(&me.failures).iter() {
                    let labels = [
                        ("target", target.as_str()),
                        ("status", f.status.as_str()),
                        ("by", f.by.as_str()),
                    ];
                    s.put(&labels, f.failing);
                }
            },
        );
        let me = self.clone();
        registry.register(
            "oam_target_last_failure_age_seconds",
            "Seconds since a target's last failed call.",
            Kind::Gauge,
            move |s| {
                let now = now_ms();
                for (target, f) in lock(&me.failures).iter() {
                    let age = now.saturating_sub(f.at_ms) as f64 / 1e3;
                    s.put(&[("target", target)], age);
                }
            },
        );
    }

    /// Did `target`'s last failed call have its credentials refused, with none working since?
    pub(crate) fn refuses_credentials(&self, target: &str) -> bool {
        lock(&self.failures)
            .get(target)
            .is_some_and(|f| f.failing > 0 && f.status == GenerationStatus::Unauthorized)
    }

    /// `target`'s last failure (its `failing` count 0 once a call worked since).
    pub(crate) fn last_failure(&self, target: &str) -> Option<crate::core::wire::LastFailure> {
        lock(&self.failures).get(target).cloned()
    }

    /// A health sample from real traffic.
    pub(crate) fn record_traffic(&self, target: &str, outcome: Outcome, latency_ms: u64) {
        if let Some(c) = self.clocks.get(target) {
            c.traffic.store(now_ms(), Ordering::Relaxed);
        }
        self.record(target, Evidence::Traffic, outcome, latency_ms);
    }

    /// A sample into the target's window.
    fn record(&self, target: &str, source: Evidence, outcome: Outcome, latency_ms: u64) {
        if outcome == Outcome::Success
            && let Some(f) = lock(&self.failures).get_mut(target)
        {
            f.failing = 0;
        }
        if let Some(w) = lock(&self.windows).get_mut(target) {
            w.record(now_ms(), source, outcome, latency_ms);
        }
    }

    /// What this node's peers saw themselves of `target`, in their fresh observations.
    fn peers(&self, target: &str, now: u64) -> Vec<FirstHand> {
        let e = self.pipeline.read();
        e.state
            .cluster
            .fresh(target, now)
            .filter(|o| o.node != self.id)
            .map(|o| o.own)
            .collect()
    }

    /// The target judged at `now` on this node's evidence and its peers', and this node's own.
    fn judged(&self, target: &str, now: u64) -> Option<(Stats, FirstHand)> {
        let mut sources = self.peers(target, now);
        let own = lock(&self.windows).get(target)?.first_hand(now);
        sources.push(own);
        Some((judge(&sources), own))
    }

    /// The target as this node judges it at `now` (on the cluster's evidence).
    pub(crate) fn stats(&self, target: &str, now: u64) -> Option<Stats> {
        self.judged(target, now).map(|(s, _)| s)
    }

    /// What the prober needs of `target` at `now`, judged once a round: its stats, and when
    /// traffic last reached it at any node.
    fn seen(&self, target: &str, now: u64) -> Option<(Stats, u64)> {
        let mut sources = self.peers(target, now);
        let peers_traffic = sources.iter().map(|f| f.traffic.last_ms).max().unwrap_or(0);
        let own = lock(&self.windows).get(target)?.first_hand(now);
        sources.push(own);
        Some((judge(&sources), peers_traffic))
    }

    /// This node's observations of every target at `now`.
    fn observations(&self, now: u64) -> Vec<Observation> {
        let down = lock(&self.down).clone();
        self.clocks
            .keys()
            .filter_map(|target| {
                let (s, own) = self.judged(target, now)?;
                // Its death notice outranks the window: down now, not 15 s from now.
                let dead = down.contains(target);
                Some(Observation {
                    node: self.id.clone(),
                    provider: target.clone(),
                    at_ms: now,
                    verdict: if dead {
                        Verdict::Unhealthy
                    } else {
                        s.verdict()
                    },
                    availability: if dead { 0.0 } else { s.availability },
                    contract_failure_pct: s.contract_failure_pct,
                    p95_ms: s.p95_ms,
                    samples: if dead { s.samples.max(1) } else { s.samples },
                    evidence: if dead { Evidence::Traffic } else { s.evidence },
                    own,
                })
            })
            .collect()
    }

    /// Apply this node's observations to its own view and publish them to the cluster. A
    /// target judged healthy again on real calls after an outage some node saw end has its
    /// breaker half-opened (one request tries it) instead of waiting out its open time.
    pub(crate) fn share(&self) {
        let now = now_ms();
        let observations = self.observations(now);
        self.pipeline.with(|e| {
            for o in &observations {
                let recovered = o.verdict == Verdict::Healthy
                    && o.evidence.paid()
                    && judge(&[o.own]).recovered_at_ms.is_some();
                if recovered && e.answering_again(&o.provider).is_some() {
                    tracing::info!(node = %self.id, target = %o.provider, "answering again: breaker half-open");
                }
            }
            let cluster = Arc::make_mut(&mut e.state.cluster);
            for o in &observations {
                cluster.observe(o.clone());
            }
        });
        self.bus.publish(
            subjects::observations(&self.id),
            Observations {
                node: self.id.clone(),
                observations,
            },
        );
    }

    /// Targets whose mesh agent died: down now, and the cluster told at once.
    pub(crate) fn died(&self, targets: Vec<String>) {
        if targets.is_empty() {
            return;
        }
        tracing::warn!(?targets, "provider agent died; marked down");
        lock(&self.down).extend(targets);
        self.share();
    }

    /// Is `target` failing on real calls, as far as this node can tell at `now` (judged `stats`):
    /// unhealthy or degraded on them, its breaker open, or its agent dead?
    fn failing(&self, target: &str, stats: Option<&Stats>, now: u64) -> bool {
        if lock(&self.down).contains(target) {
            return true;
        }
        let open = self
            .pipeline
            .read()
            .state
            .breakers
            .get(target)
            .is_some_and(|b| {
                let mut b = *b;
                b.tick(now);
                matches!(b, Breaker::Open { .. })
            });
        open || stats.is_some_and(|s| s.evidence.paid() && s.verdict() != Verdict::Healthy)
    }

    /// Is `target` due a probe of `check` at `now` from this node? Only this node's own share
    /// of the targets (`prober_of` the live nodes, or any target no fresh evidence speaks
    /// of), an idle one (no traffic here or at a peer
    /// within the interval), outside its Retry-After; a billed confirmation once per interval.
    /// Marked probed when due. `seen`: what `seen` says of it now.
    fn due(
        &self,
        schedule: Schedule,
        target: &str,
        check: Check,
        live: &[&str],
        seen: Option<&(Stats, u64)>,
        now: u64,
    ) -> bool {
        let Some(c) = self.clocks.get(target) else {
            return false;
        };
        if now < c.quiet_until.load(Ordering::Relaxed) {
            return false;
        }
        // Another node's share, unless nobody's evidence of it is fresh here (a prober that
        // just went, a node cut off): then this node does not wait for it.
        if prober_of(target, live) != Some(self.id.as_str())
            && seen.is_some_and(|(s, _)| s.samples > 0)
        {
            return false;
        }
        let peers_traffic = seen.map_or(0, |&(_, at)| at);
        let traffic = c.traffic.load(Ordering::Relaxed).max(peers_traffic);
        let recovering = lock(&self.windows)
            .get(target)
            .is_some_and(Window::recovering);
        // A billed confirmation once per interval while a target fails; once one answers,
        // the rest of its recovery streak at the quick pace (`RECOVERY_STREAK - 1` more at
        // most per recovery), so a recovery is judged in a fraction of a second, not three
        // intervals.
        let due = if check == Check::Confirm {
            // An upstream that refuses oam's credentials is not asked again and again, billed:
            // its configuration must change first (its free checks, and traffic, go on).
            let refused = self.refuses_credentials(target);
            let failed = c.confirms_failed.load(Ordering::Relaxed);
            let backed_off = Schedule {
                every: confirm_every(schedule.every, failed),
                ..schedule
            };
            !refused && backed_off.due(now, traffic, c.billed.load(Ordering::Relaxed), recovering)
        } else {
            schedule.due(now, traffic, c.probe.load(Ordering::Relaxed), recovering)
        };
        if due {
            let jittered = now.saturating_sub(schedule.jitter(target, &self.id, now));
            c.probe.store(jittered, Ordering::Relaxed);
            if check.billed() {
                c.billed.store(jittered, Ordering::Relaxed);
            }
        }
        due
    }

    /// `target` asked not to be called before `until` (a 429's Retry-After, to a probe or to
    /// traffic): no probe until then.
    pub(crate) fn quiet(&self, target: &str, until: u64) {
        if let Some(c) = self.clocks.get(target) {
            c.quiet_until.fetch_max(until, Ordering::Relaxed);
        }
    }

    /// A probe's outcome for `target`: recorded, and a target judged healthy again by its
    /// probes has its breaker half-opened (one request tries it) instead of waiting out its
    /// open time.
    fn probed(&self, target: &str, check: Check, outcome: Outcome, latency_ms: u64) {
        if outcome == Outcome::Success {
            lock(&self.down).remove(target);
        }
        if check == Check::Confirm
            && let Some(c) = self.clocks.get(target)
        {
            if outcome == Outcome::Success {
                c.confirms_failed.store(0, Ordering::Relaxed);
            } else {
                c.confirms_failed.fetch_add(1, Ordering::Relaxed);
            }
        }
        let source = if check.billed() {
            Evidence::Billed
        } else {
            Evidence::Free
        };
        self.record(target, source, outcome, latency_ms);
        let now = now_ms();
        let healthy = outcome == Outcome::Success
            && self
                .stats(target, now)
                .is_some_and(|s| s.verdict() == Verdict::Healthy);
        if healthy && self.pipeline.with(|e| e.answering_again(target)).is_some() {
            tracing::info!(node = %self.id, target, "answering again: breaker half-open");
        }
    }
}

/// The service that probes this node's share of the idle targets.
pub(crate) struct Prober {
    node: Arc<Node>,
    schedule: Schedule,
    timeout: Duration,
    /// What traffic that names no route is held to (checked at load), no more.
    contract: Option<Contract>,
    /// Targets whose probe is still out.
    out: Mutex<BTreeSet<String>>,
    /// A probe answered since observations were last shared.
    fresh: AtomicBool,
    /// The probe budget's record, once opened.
    store: tokio::sync::OnceCell<async_nats::jetstream::kv::Store>,
}

impl Prober {
    pub(crate) fn new(node: Arc<Node>) -> Prober {
        let cfg = &node.cfg;
        let contract = cfg
            .pipeline
            .default_contract
            .as_ref()
            .and_then(|spec| Contract::for_request(Some(spec), None).ok());
        Prober {
            schedule: Schedule::new(cfg.node.probe_interval_ms),
            timeout: Duration::from_millis(cfg.node.probe_timeout_ms),
            contract,
            out: Mutex::default(),
            fresh: AtomicBool::default(),
            store: tokio::sync::OnceCell::new(),
            node,
        }
    }

    /// Probe what is due every `quick` ms until `stop`, and share this node's observations (at
    /// least every `every` ms, and once probes have answered). Each probe runs on its own: no
    /// round waits for its slowest probe, and a target whose probe is still out is not probed
    /// again meanwhile.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let me = Arc::new(self);
        let mut tick = tokio::time::interval(Duration::from_millis(me.schedule.quick));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut shared_at = 0u64;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = stop.cancelled() => return,
            }
            me.round(now_ms(), &stop);
            let now = now_ms();
            let fresh = me.fresh.swap(false, Ordering::Relaxed);
            if fresh || now.saturating_sub(shared_at) >= me.schedule.every {
                shared_at = now;
                me.node.health.share();
            }
        }
    }

    /// Start a probe of every target due one that has none out.
    fn round(self: &Arc<Self>, now: u64, stop: &CancellationToken) {
        let health = &self.node.health;
        let live: Vec<String> = {
            let e = self.node.pipeline.read();
            e.state
                .cluster
                .live_nodes(now)
                .into_iter()
                .map(String::from)
                .collect()
        };
        let live: Vec<&str> = live.iter().map(String::as_str).collect();
        // One model list answers for every idle model of its provider: asked for once.
        let mut checks: Vec<(Vec<String>, &Connector, Check)> = Vec::new();
        for (id, c, _) in self.node.upstreams.all() {
            if lock(&self.out).contains(id) {
                continue;
            }
            let http = c.lists_models();
            // Judged once for both questions: a round visits every target every `quick` ms.
            let seen = health.seen(id, now);
            let stats = seen.as_ref().map(|(s, _)| s);
            let Some(check) = check_for(c.probe, health.failing(id, stats, now), http) else {
                continue;
            };
            if !health.due(self.schedule, id, check, &live, seen.as_ref(), now) {
                continue;
            }
            let same_list = checks
                .iter_mut()
                .find(|(_, other, k)| check == Check::Models && *k == check && other.id == c.id);
            match same_list {
                Some(list) => list.0.push(id.to_string()),
                None => checks.push((vec![id.to_string()], c, check)),
            }
        }
        for (ids, _, check) in checks {
            {
                let mut out = lock(&self.out);
                if out.len() >= MAX_PROBES_OUT {
                    return;
                }
                out.extend(ids.iter().cloned());
            }
            let me = self.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                tokio::select! {
                    () = me.probe(&ids, check) => {}
                    () = stop.cancelled() => {}
                }
                let mut out = lock(&me.out);
                for id in &ids {
                    out.remove(id);
                }
            });
        }
    }

    /// Check the target `ids[0]` (a model list answers for every id), and record what it says.
    async fn probe(&self, ids: &[String], check: Check) {
        let node = &self.node;
        let Some((c, model)) = ids.first().and_then(|id| node.upstreams.target(id)) else {
            return;
        };
        let mut check = check;
        let mut charged = 0.0;
        if check.billed() {
            match self.charge(&ids[0], check).await {
                Ok(usd) => {
                    node.health.probes.stop(None);
                    charged = usd;
                }
                Err(why) => {
                    node.health.probes.stop(Some(why));
                    // The free check stands in, where there is one.
                    if !c.lists_models() {
                        return;
                    }
                    check = Check::Models;
                }
            }
        }
        node.health.probes.called(&ids[0], check);
        let chat = |text: &str| {
            [Message {
                role: "user".into(),
                content: text.into(),
            }]
        };
        let g = match check {
            Check::Models => c.list_models(self.timeout).await,
            _ if c.embeddings => {
                let pass = super::exchange::Passthrough {
                    extra: [("input".to_string(), "oam health probe".into())]
                        .into_iter()
                        .collect(),
                    ..Default::default()
                };
                c.embed(model, &pass, self.timeout).await.generation
            }
            Check::Chat => {
                let probe = chat(CHAT_PROMPT);
                let a = c.generate(model, &probe, None, 32, None, self.timeout);
                a.await.generation
            }
            Check::Confirm => {
                let probe = chat(BILLED_PROMPT);
                let a = c.generate(model, &probe, None, 1, None, self.timeout);
                a.await.generation
            }
        };
        if check.billed() {
            // The target's price of what it used, else what was charged.
            let usd = g
                .usage
                .as_ref()
                .and_then(|u| self.price(&ids[0], |p| p.cost_of_usage(u)))
                .unwrap_or(charged);
            node.health.probes.spent(now_ms(), &ids[0], usd);
            if (usd - charged).abs() > 1e-9 {
                let _ = self.settle(usd - charged).await;
            }
        }
        // A chaos fault on one target of the provider (not the provider): the model list that
        // answers for every target says nothing of it, so that target's check meets the fault.
        let mut kept = ids.to_vec();
        if check == Check::Models {
            for id in ids {
                let Some(fg) = c.target_check(id, self.timeout).await else {
                    continue;
                };
                kept.retain(|k| k != id);
                node.health.failed(id, "probe", &fg);
                if let Some(o) = probe_outcome(check, fg.status, || false) {
                    node.health.probed(id, check, o, fg.latency_ms);
                    node.metrics.provider_outcome(id, "probe", o);
                }
            }
        }
        let ids: &[String] = &kept;
        if g.status != GenerationStatus::Ok {
            for id in ids {
                node.health.failed(id, "probe", &g);
            }
        }
        if g.status == GenerationStatus::Unauthorized {
            // A configuration fault, told once a window: the probes mark the target down, so
            // no request may ever reach it to raise it.
            for id in ids {
                let detail = g.error.as_ref().map(|e| e.chars().take(300).collect());
                let raised = node
                    .pipeline
                    .with(|e| e.refused_to_probe(id, detail, now_ms()));
                if let Some(e) = raised {
                    tracing::warn!(target = %id, escalation = %e.id, error = ?e.detail, "the upstream refuses oam's credentials; escalated");
                    node.escalations.raise(&e);
                }
            }
        }
        if g.status == GenerationStatus::RateLimited {
            // Not asked again before it said to.
            let wait = g.retry_after_ms.unwrap_or(self.schedule.every);
            for id in ids {
                node.health.quiet(id, now_ms() + wait);
            }
        }
        // An embedding has no answer text to hold to the contract.
        let outcome = probe_outcome(check, g.status, || {
            !c.embeddings
                && self
                    .contract
                    .as_ref()
                    .is_some_and(|k| k.check(&g.content, g.finish_reason.as_deref()).is_err())
        });
        let Some(outcome) = outcome else { return };
        for target in ids {
            // A model list that answers says nothing of credentials the target refused to a
            // completion (a key without rights to the model answers 403 to the call and 200 to
            // the list): such a target is not healed by a free check, only by a call that works.
            if check == Check::Models
                && outcome == Outcome::Success
                && node.health.refuses_credentials(target)
            {
                continue;
            }
            node.health.probed(target, check, outcome, g.latency_ms);
            node.metrics.provider_outcome(target, "probe", outcome);
        }
        self.fresh.store(true, Ordering::Relaxed);
    }

    /// `price` of `target` at its configured prices (None: no such target).
    fn price(
        &self,
        target: &str,
        price: impl FnOnce(&crate::core::request::Target) -> f64,
    ) -> Option<f64> {
        self.node.pipeline.with(|e| {
            let p = e.state.providers.iter().find(|p| *p.id == *target)?;
            Some(price(p))
        })
    }

    /// What a billed check of `target` is estimated to cost, charged to the day's probe budget
    /// before it is sent: its amount, or why it may not be sent (the day's budget is spent, or
    /// with a cap set the ledger cannot say).
    async fn charge(&self, target: &str, check: Check) -> Result<f64, ReasonCode> {
        let (prompt, completion) = match check {
            Check::Confirm => (estimate_tokens(BILLED_PROMPT), 1),
            _ => (estimate_tokens(CHAT_PROMPT), 32),
        };
        let usd = self
            .price(target, |p| p.cost_of(prompt, completion))
            .unwrap_or(0.0);
        if usd <= 0.0 {
            return Ok(0.0);
        }
        let cap = self.node.cfg.probes.max_usd_per_day;
        match self.change(usd, cap).await {
            Some(true) => Ok(usd),
            Some(false) => Err(ReasonCode::ProbeBudgetExhausted),
            // Unmetered, a probe need not wait for the ledger; capped, it must.
            None if cap.is_none() => Ok(usd),
            None => Err(ReasonCode::BudgetStoreUnreachable),
        }
    }

    /// Correct the day's probe spend by `usd` (what a check really cost less its estimate).
    async fn settle(&self, usd: f64) -> Option<bool> {
        self.change(usd, None).await
    }

    /// Add `usd` to today's probe budget record unless that passes `cap`: whether it was
    /// added; `None` when the ledger did not answer.
    async fn change(&self, usd: f64, cap: Option<f64>) -> Option<bool> {
        let store = self
            .store
            .get_or_try_init(|| async {
                let open = crate::transport::store::ledger::open(self.node.bus.nats());
                match tokio::time::timeout(crate::transport::store::ledger::STORE_TIMEOUT, open)
                    .await
                {
                    Ok(Ok(s)) => Ok(s),
                    _ => Err(()),
                }
            })
            .await
            .ok()?;
        let day = crate::transport::store::ledger::probes_day(now_ms());
        let f = crate::transport::store::ledger::charge_probes(store, &day, usd, cap);
        tokio::time::timeout(crate::transport::store::ledger::STORE_TIMEOUT * 2, f)
            .await
            .ok()?
            .ok()
    }
}

/// Prompt tokens of a one-message chat, as the pipeline estimates them.
fn estimate_tokens(text: &str) -> u64 {
    ("user".len() + text.len()).div_ceil(4) as u64 + 4 + 3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hours_spend_is_kept_by_the_second() {
        let book = ProbeBook::default();
        for i in 0..1_000 {
            book.spent(5_000 + i % 1_000, "a", 0.001);
        }
        book.spent(6_000, "b", 0.5);
        assert_eq!(lock(&book.hour).len(), 2, "one entry per second spent in");
        assert_eq!(book.usd_last_hour(7_000), 1.5);
        let by_target = book.usd_last_hour_by_target(7_000);
        assert_eq!((by_target["a"], by_target["b"]), (1.0, 0.5));
        assert_eq!(
            book.usd_last_hour_by_target(5_000 + HOUR_MS)
                .keys()
                .collect::<Vec<_>>(),
            ["b"],
            "a target whose spend aged out is left out"
        );
        assert_eq!(
            book.usd_last_hour(5_000 + HOUR_MS),
            0.5,
            "the first second aged out"
        );
        assert_eq!(book.snapshot(7_000).spent_usd, 1.5);
    }

    /// A target that fails for 5 minutes, confirmed as the schedule says (1 s probe interval):
    /// it drew about one billed call a second (58 in a 60 s outage); now, after the first ten,
    /// the wait doubles after each failed confirmation to a minute, so its last 4 minutes draw
    /// at most 15.
    #[test]
    fn a_failing_target_is_confirmed_less_and_less_often() {
        let s = Schedule::new(1_000);
        let (mut failed, mut last, mut at) = (0u32, 0u64, Vec::new());
        let mut now = 10_000;
        while now <= 310_000 {
            let backed = Schedule {
                every: confirm_every(s.every, failed),
                ..s
            };
            if backed.due(now, 0, last, false) {
                at.push(now);
                last = now;
                failed += 1; // it fails every time
            }
            now += 100;
        }
        let late = at.iter().filter(|t| **t > 70_000).count();
        assert!(
            late <= 15,
            "{late} billed calls in the last 4 minutes: {at:?}"
        );
        assert!(late >= 4, "still confirmed about once a minute: {at:?}");
        assert_eq!(confirm_every(1_000, 0), 1_000);
        assert_eq!(
            confirm_every(1_000, CONFIRM_QUICK - 1),
            1_000,
            "a short outage as before"
        );
        assert_eq!(confirm_every(1_000, CONFIRM_QUICK + 2), 8_000);
        assert_eq!(confirm_every(1_000, 40), CONFIRM_MAX_MS);
        assert_eq!(
            confirm_every(120_000, 2),
            120_000,
            "never shorter than the interval"
        );
    }

    #[test]
    fn only_idle_targets_are_probed_once_per_interval() {
        let s = Schedule::new(1_000);
        assert_eq!(s.quick, 250);
        let now = 10_000;
        assert!(s.due(now, 0, 0, false), "never probed, never used");
        assert!(
            !s.due(now, now - 500, 0, false),
            "traffic within the interval is the probe"
        );
        assert!(s.due(now, now - 1_000, now - 1_000, false));
        assert!(
            !s.due(now, 0, now - 999, false),
            "probed within the interval"
        );
    }

    #[test]
    fn a_recovering_target_is_probed_four_times_as_often() {
        let s = Schedule::new(1_000);
        let now = 10_000;
        assert!(s.due(now, 0, now - 250, true));
        assert!(!s.due(now, 0, now - 249, true));
        assert!(!s.due(now, 0, now - 250, false));
        assert!(
            !s.due(now, now - 10, now - 900, true),
            "still only when idle"
        );
        assert_eq!(Schedule::new(100).quick, 50, "never faster than 50 ms");
    }

    #[test]
    fn probe_answers_are_judged_by_what_the_probe_can_tell() {
        use GenerationStatus as G;
        let never = || -> bool { panic!("a model list is not held to a contract") };
        assert_eq!(
            probe_outcome(Check::Models, G::Ok, never),
            Some(Outcome::Success)
        );
        assert_eq!(
            probe_outcome(Check::Chat, G::Ok, || true),
            Some(Outcome::ContractFailure)
        );
        assert_eq!(
            probe_outcome(Check::Chat, G::Ok, || false),
            Some(Outcome::Success)
        );
        assert_eq!(
            probe_outcome(Check::Chat, G::Timeout, || false),
            Some(Outcome::Timeout)
        );
        for failed in [G::Unauthorized, G::RateLimited, G::Error] {
            assert_eq!(
                probe_outcome(Check::Chat, failed, || false),
                Some(Outcome::Error)
            );
        }
        // A one-token confirmation is cut short on purpose: no contract to hold it to.
        assert_eq!(
            probe_outcome(Check::Confirm, G::Ok, || panic!("not held to the contract")),
            Some(Outcome::Success)
        );
        // The request's fault, on a probe as on a request: no sample either way.
        for refused in [G::Rejected, G::ContextLength, G::ContentPolicy] {
            assert!(refused.is_refusal());
            assert_eq!(probe_outcome(Check::Chat, refused, || false), None);
        }
    }

    /// Free unless it must be: `auto` checks the model list, and a billed token only for a
    /// target real calls found failing; an agent that is not failing is not checked at all.
    #[test]
    fn the_default_check_is_free_and_a_billed_one_only_confirms_a_recovery() {
        assert_eq!(Probe::default(), Probe::Auto);
        assert_eq!(check_for(Probe::Auto, false, true), Some(Check::Models));
        assert_eq!(check_for(Probe::Auto, true, true), Some(Check::Confirm));
        assert_eq!(check_for(Probe::Auto, false, false), None);
        assert_eq!(check_for(Probe::Auto, true, false), Some(Check::Confirm));
        assert_eq!(check_for(Probe::Chat, false, true), Some(Check::Chat));
        assert_eq!(check_for(Probe::Models, true, true), Some(Check::Models));
        assert_eq!(check_for(Probe::Off, true, true), None);
        assert_eq!(
            (
                Check::Models.kind(),
                Check::Chat.kind(),
                Check::Confirm.kind()
            ),
            ("models", "chat", "chat")
        );
        assert!(!Check::Models.billed() && Check::Confirm.billed());
    }

    /// Every node names the same prober for a target from the same members; the targets are
    /// split between them; a member's going moves only its own targets.
    #[test]
    fn one_live_node_probes_each_target_and_they_share_the_targets() {
        let targets: Vec<String> = (0..60).map(|i| format!("p{i}/model")).collect();
        let three = ["n1", "n2", "n3"];
        let mut shares = BTreeMap::new();
        for t in &targets {
            let who = prober_of(t, &three).expect("someone");
            assert_eq!(
                prober_of(t, &["n3", "n1", "n2"]),
                Some(who),
                "order does not matter"
            );
            *shares.entry(who).or_insert(0) += 1;
        }
        assert_eq!(shares.len(), 3, "{shares:?}");
        assert!(shares.values().all(|&n| n >= 10), "{shares:?}");
        for t in &targets {
            let before = prober_of(t, &three).unwrap();
            let after = prober_of(t, &["n1", "n3"]).unwrap();
            if before != "n2" {
                assert_eq!(before, after, "{t} moved though its prober stayed");
            }
        }
        assert_eq!(prober_of("x", &[]), None);
    }

    #[test]
    fn jitter_is_at_most_a_tenth_of_the_interval_and_varies() {
        let s = Schedule::new(1_000);
        let seen: BTreeSet<u64> = (0..50).map(|t| s.jitter("p", "n1", 1_000 * t)).collect();
        assert!(seen.iter().all(|&j| j <= 100), "{seen:?}");
        assert!(seen.len() > 10, "{seen:?}");
    }
}
