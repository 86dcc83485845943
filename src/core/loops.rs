//! Agent-loop detection: the same call (agent, task, model, messages) failing again and again.
//!
//! N failures of one fingerprint inside the window open an *episode*: a force-tripped breaker
//! keyed by the fingerprint, one incident and one escalation. While it is open, identical calls
//! are refused before any provider is touched. When the cool-down ends one identical call is let
//! through as a probe: success ends the episode, failure re-trips it (same episode, no new
//! escalation). An episode nobody probes expires on its own.

use super::breaker::{Breaker, BreakerConfig, Permit};
use super::request::Message;
use serde::{Deserialize, Deserializer, Serialize, Serializer, de};
use std::collections::BTreeMap;
use std::fmt;
use xxhash_rust::xxh3::xxh3_64_with_seed;

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(deny_unknown_fields, default)]
pub struct LoopConfig {
    /// Failures of one fingerprint that make a loop.
    pub threshold: u32,
    pub window_ms: u64,
    /// How long identical calls are refused after a trip.
    pub cooldown_ms: u64,
}

impl Default for LoopConfig {
    fn default() -> Self {
        LoopConfig {
            threshold: 3,
            window_ms: 60_000,
            cooldown_ms: 120_000,
        }
    }
}

impl LoopConfig {
    fn breaker(&self) -> BreakerConfig {
        BreakerConfig {
            failure_threshold: u32::MAX,
            open_ms: self.cooldown_ms,
            half_open_probes: 1,
            half_open_successes: 1,
        }
    }
}

/// A stable 64-bit fingerprint of a call; on the wire, 16 lower-case hex digits.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Fingerprint(pub u64);

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl Serialize for Fingerprint {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Fingerprint {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        if text.len() != 16 {
            return Err(de::Error::custom(format!(
                "fingerprint {text:?} must be 16 hex digits"
            )));
        }
        u64::from_str_radix(&text, 16)
            .map(Fingerprint)
            .map_err(|_| de::Error::custom(format!("fingerprint {text:?} must be 16 hex digits")))
    }
}

/// The fingerprint of a call. Each field is hashed in one shot, seeded with the hash so far
/// and the field's length, so ("ab", "c") and ("a", "bc") differ and order matters.
pub fn fingerprint(agent: &str, task: &str, model: &str, messages: &[Message]) -> Fingerprint {
    let field =
        |h: u64, s: &str| xxh3_64_with_seed(s.as_bytes(), h ^ (s.len() as u64).rotate_left(32));
    let mut h = field(field(field(0, agent), task), model);
    for m in messages {
        h = field(field(h, &m.role), &m.content);
    }
    Fingerprint(h)
}

/// An open loop, as reported once per episode.
#[derive(Serialize, Deserialize, Clone, PartialEq, Eq, Debug)]
pub struct Incident {
    pub id: String,
    pub fingerprint: Fingerprint,
    pub agent: String,
    pub task: String,
    pub opened_at_ms: u64,
    pub failures: u32,
}

#[derive(Serialize, Deserialize, Clone, PartialEq, Eq, Debug)]
#[serde(deny_unknown_fields)]
pub struct Episode {
    pub incident: Incident,
    pub breaker: Breaker,
    /// Dropped after this if nobody probed it.
    pub expires_at_ms: u64,
}

#[derive(Serialize, Deserialize, Clone, PartialEq, Eq, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct LoopEntry {
    #[serde(default)]
    pub agent: String,
    #[serde(default)]
    pub task: String,
    /// Failure times inside the window.
    #[serde(default)]
    pub failures: Vec<u64>,
    #[serde(default)]
    pub episode: Option<Episode>,
}

#[derive(Clone, PartialEq, Eq, Debug)]
pub enum LoopCheck {
    Clear,
    /// Let through once; report the result with `probe = true`.
    Probe,
    Blocked(Box<Incident>),
}

/// Loop state for every fingerprint, keyed by fingerprint.
pub(crate) type Loops = BTreeMap<Fingerprint, LoopEntry>;

/// May a call with this fingerprint go ahead? Takes the probe slot when it answers `Probe`.
pub fn check(loops: &mut Loops, fp: Fingerprint, now_ms: u64, cfg: &LoopConfig) -> LoopCheck {
    let Some(ep) = loops.get_mut(&fp).and_then(|e| e.episode.as_mut()) else {
        return LoopCheck::Clear;
    };
    match ep.breaker.acquire(now_ms, &cfg.breaker()) {
        Permit::Probe => LoopCheck::Probe,
        Permit::Allowed => LoopCheck::Clear,
        Permit::Open | Permit::ProbeQuotaFull => LoopCheck::Blocked(Box::new(ep.incident.clone())),
    }
}

/// Every this many fingerprints counted, `on_failure` forgets what is out of the window
/// (`prune`) before it counts a new one: the map holds about the fingerprints that failed within
/// the window, not every one that ever failed (at O(entries) once per this many new ones).
const PRUNE_EVERY: usize = 1_024;

/// Record a failed call. Returns the incident when this failure opens a new episode.
pub(crate) fn on_failure(
    loops: &mut Loops,
    fp: Fingerprint,
    agent: &str,
    task: &str,
    now_ms: u64,
    probe: bool,
    cfg: &LoopConfig,
) -> Option<Incident> {
    if loops.len() % PRUNE_EVERY == PRUNE_EVERY - 1 && !loops.contains_key(&fp) {
        prune(loops, now_ms, cfg);
    }
    let entry = loops.entry(fp).or_insert_with(|| LoopEntry {
        agent: agent.to_string(),
        task: task.to_string(),
        ..LoopEntry::default()
    });
    entry
        .failures
        .retain(|&t| now_ms.saturating_sub(t) < cfg.window_ms);
    entry.failures.push(now_ms);
    let expires_at_ms = now_ms + cfg.cooldown_ms + cfg.window_ms;
    if let Some(ep) = entry.episode.as_mut() {
        // Already a known loop: a failed probe re-trips it, nothing new to report.
        if probe {
            ep.breaker.on_failure(now_ms, true, &cfg.breaker());
            ep.expires_at_ms = expires_at_ms;
        }
        return None;
    }
    if (entry.failures.len() as u32) < cfg.threshold {
        return None;
    }
    let incident = Incident {
        id: format!("inc-{fp}-{now_ms}"),
        fingerprint: fp,
        agent: entry.agent.clone(),
        task: entry.task.clone(),
        opened_at_ms: now_ms,
        failures: entry.failures.len() as u32,
    };
    let mut breaker = Breaker::default();
    breaker.trip(now_ms, cfg.cooldown_ms);
    entry.episode = Some(Episode {
        incident: incident.clone(),
        breaker,
        expires_at_ms,
    });
    Some(incident)
}

/// A call with this fingerprint succeeded: any episode is over and the count starts again.
/// The call worked: its count and any episode end. Whether there was anything to end.
pub(crate) fn on_success(loops: &mut Loops, fp: Fingerprint) -> bool {
    loops.remove(&fp).is_some()
}

/// Forget what is out of the window and episodes that expired unprobed; O(entries).
fn prune(loops: &mut Loops, now_ms: u64, cfg: &LoopConfig) {
    loops.retain(|_, e| {
        e.failures
            .retain(|&t| now_ms.saturating_sub(t) < cfg.window_ms);
        if e.episode
            .as_ref()
            .is_some_and(|ep| now_ms >= ep.expires_at_ms)
        {
            e.episode = None;
        }
        e.episode.is_some() || !e.failures.is_empty()
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: Fingerprint = Fingerprint(0xf);
    const QUIET: Fingerprint = Fingerprint(0x9);
    const OTHER: Fingerprint = Fingerprint(0x0);

    const CFG: LoopConfig = LoopConfig {
        threshold: 3,
        window_ms: 1_000,
        cooldown_ms: 5_000,
    };

    fn msg(s: &str) -> Vec<Message> {
        vec![Message {
            role: "user".into(),
            content: s.into(),
        }]
    }

    #[test]
    fn fingerprint_is_stable_and_field_separated() {
        let a = fingerprint("agent", "task", "m", &msg("hello"));
        assert_eq!(a, fingerprint("agent", "task", "m", &msg("hello")));
        assert_eq!(a.to_string().len(), 16);
        assert_ne!(a, fingerprint("agen", "ttask", "m", &msg("hello")));
        assert_ne!(a, fingerprint("agent", "task", "m", &msg("hello!")));
        assert_ne!(a, fingerprint("agent", "task", "other", &msg("hello")));
        // Pinned: the fingerprint is part of the wire (incidents, replay); it must not drift.
        assert_eq!(fingerprint("", "", "", &[]).to_string(), "4e92fbee4afd555f");
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<Fingerprint>(&json).unwrap(), a);
        assert!(serde_json::from_str::<Fingerprint>("\"xyz\"").is_err());
    }

    #[test]
    fn third_failure_in_window_opens_one_episode() {
        let mut l = Loops::new();
        assert_eq!(on_failure(&mut l, F, "a", "t", 0, false, &CFG), None);
        assert_eq!(on_failure(&mut l, F, "a", "t", 100, false, &CFG), None);
        let inc = on_failure(&mut l, F, "a", "t", 200, false, &CFG).expect("loop");
        assert_eq!((inc.failures, inc.agent.as_str()), (3, "a"));
        assert_eq!(
            check(&mut l, F, 300, &CFG),
            LoopCheck::Blocked(Box::new(inc.clone()))
        );
        // More failures during the episode report nothing new.
        assert_eq!(on_failure(&mut l, F, "a", "t", 400, false, &CFG), None);
        assert_eq!(check(&mut l, OTHER, 300, &CFG), LoopCheck::Clear);
    }

    #[test]
    fn failures_outside_the_window_do_not_add_up() {
        let mut l = Loops::new();
        on_failure(&mut l, F, "a", "t", 0, false, &CFG);
        on_failure(&mut l, F, "a", "t", 600, false, &CFG);
        assert_eq!(on_failure(&mut l, F, "a", "t", 1_200, false, &CFG), None);
        assert_eq!(l[&F].failures, vec![600, 1_200]);
    }

    #[test]
    fn probe_after_cooldown_then_success_or_retrip() {
        let mut l = Loops::new();
        for t in [0, 1, 2] {
            on_failure(&mut l, F, "a", "t", t, false, &CFG);
        }
        assert!(matches!(
            check(&mut l, F, 5_001, &CFG),
            LoopCheck::Blocked(_)
        ));
        assert_eq!(check(&mut l, F, 5_002, &CFG), LoopCheck::Probe);
        assert!(
            matches!(check(&mut l, F, 5_002, &CFG), LoopCheck::Blocked(_)),
            "one probe at a time"
        );
        assert_eq!(
            on_failure(&mut l, F, "a", "t", 5_003, true, &CFG),
            None,
            "same episode"
        );
        assert!(matches!(
            check(&mut l, F, 10_002, &CFG),
            LoopCheck::Blocked(_)
        ));
        assert_eq!(check(&mut l, F, 10_003, &CFG), LoopCheck::Probe);
        on_success(&mut l, F);
        assert_eq!(check(&mut l, F, 10_004, &CFG), LoopCheck::Clear);
    }

    #[test]
    fn fingerprints_that_failed_long_ago_are_forgotten_as_new_ones_come() {
        let mut l = Loops::new();
        for i in 0..10_000u64 {
            on_failure(&mut l, Fingerprint(i), "a", "t", i * 10, false, &CFG);
            assert!(l.len() <= PRUNE_EVERY, "{} entries after {i}", l.len());
        }
        // Those within the window are all kept.
        let within = (CFG.window_ms / 10) as usize;
        assert!(l.len() >= within.min(PRUNE_EVERY - 1), "{}", l.len());
    }

    #[test]
    fn prune_forgets_old_failures_and_expired_episodes() {
        let mut l = Loops::new();
        on_failure(&mut l, QUIET, "a", "t", 0, false, &CFG);
        for t in [0, 1, 2] {
            on_failure(&mut l, F, "a", "t", t, false, &CFG);
        }
        prune(&mut l, 2_000, &CFG);
        assert!(!l.contains_key(&QUIET));
        assert!(l.contains_key(&F), "episode still running");
        prune(&mut l, 2 + CFG.cooldown_ms + CFG.window_ms, &CFG);
        assert!(l.is_empty());
    }
}
