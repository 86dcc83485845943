//! What this node sees of each target's health: a window of samples per target (from traffic
//! and from probes), the targets that are mesh agents whose death notice came, and the probe
//! schedule. [`Health`] is the handle the request path and gossip share; [`Prober`] is the
//! service that probes idle targets and shares this node's observations with the cluster.

use super::bus::Bus;
use super::config::{NodeConfig, Probe};
use super::pipeline::{Pipeline, lock};
use super::upstreams::Upstreams;
use crate::clock::now_ms;
use crate::core::contract::Contract;
use crate::core::health::{Outcome, Stats, Verdict, Window};
use crate::core::quorum::Observation;
use crate::core::request::{GenerationStatus, Message};
use crate::core::wire::Observations;
use crate::transport::subjects;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// When a target last had a sample from traffic and when it was last probed (ms; 0: never),
/// and until when it is not to be probed (its Retry-After).
#[derive(Default)]
struct Clocks {
    traffic: AtomicU64,
    probe: AtomicU64,
    quiet_until: AtomicU64,
}

pub struct Health {
    id: String,
    windows: Mutex<BTreeMap<String, Window>>,
    clocks: BTreeMap<String, Clocks>,
    /// Targets that are mesh agents whose death notice arrived; UNHEALTHY until a probe
    /// succeeds again.
    down: Mutex<BTreeSet<String>>,
    pipeline: Pipeline,
    bus: Arc<Bus>,
}

/// How often idle targets are probed: every `every` ms, and every `quick` ms while one
/// answers again after failing, until its window has judged the recovery.
#[derive(Clone, Copy, Debug)]
pub struct Schedule {
    pub every: u64,
    pub quick: u64,
}

impl Schedule {
    pub fn new(every_ms: u64) -> Schedule {
        Schedule {
            every: every_ms,
            quick: (every_ms / 4).max(50),
        }
    }

    /// Is a target due a probe at `now`? Only an idle one (no traffic sample within `every`:
    /// a target in use is not probed, its traffic is the probe), once per `every`, or once per
    /// `quick` while it is `recovering`.
    pub fn due(&self, now: u64, last_traffic: u64, last_probe: u64, recovering: bool) -> bool {
        let idle = now.saturating_sub(last_traffic) >= self.every;
        let since = now.saturating_sub(last_probe);
        idle && (since >= self.every || (recovering && since >= self.quick))
    }
}

/// How a probe's answer is judged, as a request's is: the model list says only that the
/// provider answers; a chat answer is held to `contract`; an answer that refuses the request
/// itself (invalid, too long, against a content policy) says nothing of the target's health
/// and is no sample (`None`), on a probe as on a request.
pub fn probe_outcome(
    probe: Probe,
    status: GenerationStatus,
    contract_failed: impl FnOnce() -> bool,
) -> Option<Outcome> {
    Some(match status {
        // `GenerationStatus::is_refusal`, which the request path holds to.
        GenerationStatus::Rejected
        | GenerationStatus::ContextLength
        | GenerationStatus::ContentPolicy => return None,
        GenerationStatus::Ok if probe == Probe::Models => Outcome::Success,
        GenerationStatus::Ok if contract_failed() => Outcome::ContractFailure,
        GenerationStatus::Ok => Outcome::Success,
        GenerationStatus::Timeout => Outcome::Timeout,
        GenerationStatus::Error
        | GenerationStatus::RateLimited
        | GenerationStatus::Unauthorized => Outcome::Error,
    })
}

impl Health {
    pub fn new(id: &str, cfg: &NodeConfig, pipeline: Pipeline, bus: Arc<Bus>) -> Health {
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
        }
    }

    /// A health sample from real traffic.
    pub fn record_traffic(&self, target: &str, outcome: Outcome, latency_ms: u64) {
        if let Some(c) = self.clocks.get(target) {
            c.traffic.store(now_ms(), Ordering::Relaxed);
        }
        self.record(target, outcome, latency_ms);
    }

    /// A sample (traffic or probe) into the target's window.
    pub fn record(&self, target: &str, outcome: Outcome, latency_ms: u64) {
        if let Some(w) = lock(&self.windows).get_mut(target) {
            w.record(now_ms(), outcome, latency_ms);
        }
    }

    /// The target's window as it stands at `now`.
    pub fn stats(&self, target: &str, now: u64) -> Option<Stats> {
        lock(&self.windows).get(target).map(|w| w.stats(now))
    }

    /// This node's observations of every target at `now`.
    fn observations(&self, now: u64) -> Vec<Observation> {
        let down = lock(&self.down).clone();
        lock(&self.windows)
            .iter()
            .map(|(target, w)| {
                let mut s = w.stats(now);
                if down.contains(target) {
                    // Its death notice outranks the window: down now, not 15 s from now.
                    s.availability = 0.0;
                    s.samples = s.samples.max(1);
                }
                Observation {
                    node: self.id.clone(),
                    provider: target.clone(),
                    at_ms: now,
                    verdict: s.verdict(),
                    availability: s.availability,
                    contract_failure_pct: s.contract_failure_pct,
                    p95_ms: s.p95_ms,
                    samples: s.samples,
                }
            })
            .collect()
    }

    /// Apply this node's observations to its own view and publish them to the cluster.
    pub fn share(&self) {
        let observations = self.observations(now_ms());
        self.pipeline.with(|e| {
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
    pub fn died(&self, targets: Vec<String>) {
        if targets.is_empty() {
            return;
        }
        tracing::warn!(?targets, "provider agent died; marked down");
        lock(&self.down).extend(targets);
        self.share();
    }

    /// Which targets are due a probe at `now` (each marked probed).
    fn due(&self, schedule: Schedule, now: u64) -> BTreeSet<String> {
        let windows = lock(&self.windows);
        self.clocks
            .iter()
            .filter(|(id, c)| {
                let recovering = windows.get(*id).is_some_and(Window::recovering);
                let (traffic, probe) = (
                    c.traffic.load(Ordering::Relaxed),
                    c.probe.load(Ordering::Relaxed),
                );
                now >= c.quiet_until.load(Ordering::Relaxed)
                    && schedule.due(now, traffic, probe, recovering)
            })
            .map(|(id, c)| {
                c.probe.store(now, Ordering::Relaxed);
                id.clone()
            })
            .collect()
    }

    /// `target` asked not to be called before `until` (a 429's Retry-After): no probe until then.
    fn quiet(&self, target: &str, until: u64) {
        if let Some(c) = self.clocks.get(target) {
            c.quiet_until.fetch_max(until, Ordering::Relaxed);
        }
    }

    /// A probe's outcome for `target`: recorded, and a target judged healthy again by its
    /// probes has its breaker half-opened (one request tries it) instead of waiting out its
    /// open time.
    fn probed(&self, target: &str, outcome: Outcome, latency_ms: u64) {
        if outcome == Outcome::Success {
            lock(&self.down).remove(target);
        }
        self.record(target, outcome, latency_ms);
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

/// The service that probes idle targets as their providers' configuration says.
pub struct Prober {
    pub health: Arc<Health>,
    pub upstreams: Arc<Upstreams>,
    pub metrics: Arc<super::metrics::Metrics>,
    pub schedule: Schedule,
    pub timeout: Duration,
    /// What traffic that names no route is held to (checked at load), no more.
    pub contract: Option<Contract>,
    /// Targets whose probe is still out.
    out: Mutex<BTreeSet<String>>,
    /// A probe answered since observations were last shared.
    fresh: std::sync::atomic::AtomicBool,
}

impl Prober {
    pub fn new(
        cfg: &NodeConfig,
        health: Arc<Health>,
        upstreams: Arc<Upstreams>,
        metrics: Arc<super::metrics::Metrics>,
    ) -> Prober {
        let contract = cfg
            .pipeline
            .default_contract
            .as_ref()
            .and_then(|spec| Contract::for_request(Some(spec), None).ok());
        Prober {
            health,
            upstreams,
            metrics,
            schedule: Schedule::new(cfg.node.probe_interval_ms),
            timeout: Duration::from_millis(cfg.node.probe_timeout_ms),
            contract,
            out: Mutex::default(),
            fresh: Default::default(),
        }
    }

    /// Probe what is due every `quick` ms until `stop`, and share this node's observations (at
    /// least every `every` ms, and once probes have answered). Each probe runs on its own: no
    /// round waits for its slowest probe, and a target whose probe is still out is not probed
    /// again meanwhile.
    pub async fn run(self, stop: CancellationToken) {
        let me = Arc::new(self);
        let mut tick = tokio::time::interval(Duration::from_millis(me.schedule.quick));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut shared_at = 0u64;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = stop.cancelled() => return,
            }
            me.round(now_ms());
            let now = now_ms();
            let fresh = me.fresh.swap(false, Ordering::Relaxed);
            if fresh || now.saturating_sub(shared_at) >= me.schedule.every {
                shared_at = now;
                me.health.share();
            }
        }
    }

    /// Start a probe of every due target that has none out.
    fn round(self: &Arc<Self>, now: u64) {
        let due = self.health.due(self.schedule, now);
        // One model list answers for every idle model of its provider: asked for once.
        let mut checks: Vec<(Vec<String>, &super::connector::Connector)> = Vec::new();
        {
            let out = lock(&self.out);
            for (id, c, _) in self.upstreams.all() {
                if c.probe == Probe::Off || !due.contains(id) || out.contains(id) {
                    continue;
                }
                let same_list = checks
                    .iter_mut()
                    .find(|(_, other)| c.probe == Probe::Models && other.id == c.id);
                match same_list {
                    Some(check) => check.0.push(id.to_string()),
                    None => checks.push((vec![id.to_string()], c)),
                }
            }
        }
        for (ids, _) in checks {
            lock(&self.out).extend(ids.iter().cloned());
            let me = self.clone();
            tokio::spawn(async move {
                me.probe(&ids).await;
                let mut out = lock(&me.out);
                for id in &ids {
                    out.remove(id);
                }
            });
        }
    }

    /// Probe the target `ids[0]` (a model list answers for every id), and record what it says.
    async fn probe(&self, ids: &[String]) {
        let Some((c, model)) = ids.first().and_then(|id| self.upstreams.target(id)) else {
            return;
        };
        let probe = [Message {
            role: "user".into(),
            content: "oam health probe: reply with {\"answer\": \"ok\", \"confidence\": 1}".into(),
        }];
        let g = match c.probe {
            Probe::Models => c.list_models(self.timeout).await,
            _ if c.embeddings => {
                let pass = super::connector::Passthrough {
                    extra: [("input".to_string(), "oam health probe".into())]
                        .into_iter()
                        .collect(),
                    ..Default::default()
                };
                c.embed(model, &pass, self.timeout).await.generation
            }
            _ => {
                let a = c
                    .generate(model, &probe, None, 32, None, self.timeout)
                    .await;
                a.generation
            }
        };
        if g.status == GenerationStatus::RateLimited {
            // Not asked again before it said to.
            let wait = g.retry_after_ms.unwrap_or(self.schedule.every);
            for id in ids {
                self.health.quiet(id, now_ms() + wait);
            }
        }
        // An embedding has no answer text to hold to the contract.
        let outcome = probe_outcome(c.probe, g.status, || {
            !c.embeddings
                && self
                    .contract
                    .as_ref()
                    .is_some_and(|k| k.check(&g.content, g.finish_reason.as_deref()).is_err())
        });
        let Some(outcome) = outcome else { return };
        for target in ids {
            self.health.probed(target, outcome, g.latency_ms);
            self.metrics.provider_outcome(target, "probe", outcome);
        }
        self.fresh.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            probe_outcome(Probe::Models, G::Ok, never),
            Some(Outcome::Success)
        );
        assert_eq!(
            probe_outcome(Probe::Chat, G::Ok, || true),
            Some(Outcome::ContractFailure)
        );
        assert_eq!(
            probe_outcome(Probe::Chat, G::Ok, || false),
            Some(Outcome::Success)
        );
        assert_eq!(
            probe_outcome(Probe::Chat, G::Timeout, || false),
            Some(Outcome::Timeout)
        );
        for failed in [G::Unauthorized, G::RateLimited, G::Error] {
            assert_eq!(
                probe_outcome(Probe::Chat, failed, || false),
                Some(Outcome::Error)
            );
        }
        // The request's fault, on a probe as on a request: no sample either way.
        for refused in [G::Rejected, G::ContextLength, G::ContentPolicy] {
            assert!(refused.is_refusal());
            assert_eq!(probe_outcome(Probe::Chat, refused, || false), None);
        }
    }
}
