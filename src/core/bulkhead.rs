//! Admission: per-class bulkheads (critical, normal, background) and a global cap that sheds
//! non-critical traffic before critical capacity is touched.
//!
//! Critical capacity is a reservation: non-critical classes together may hold at most
//! `global_limit - critical.concurrency` slots, and background is shed earlier still, at
//! `background_shed_at`. With the defaults (critical 16, normal 24, background 8, global 40) a
//! normal plus background spike saturates at 24 active and is shed from there, while all 16
//! critical slots stay free.

use super::reason::ReasonCode;
use super::request::Priority;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(deny_unknown_fields)]
pub struct ClassLimits {
    pub concurrency: u32,
    pub queue: u32,
}

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(deny_unknown_fields, default)]
pub struct BulkheadConfig {
    pub critical: ClassLimits,
    pub normal: ClassLimits,
    pub background: ClassLimits,
    /// Total active requests across classes.
    pub global_limit: u32,
    /// Background is shed once non-critical active reaches this.
    pub background_shed_at: u32,
}

impl Default for BulkheadConfig {
    fn default() -> Self {
        BulkheadConfig {
            critical: ClassLimits {
                concurrency: 16,
                queue: 32,
            },
            normal: ClassLimits {
                concurrency: 24,
                queue: 48,
            },
            background: ClassLimits {
                concurrency: 8,
                queue: 0,
            },
            global_limit: 40,
            background_shed_at: 16,
        }
    }
}

impl BulkheadConfig {
    pub fn limits(&self, class: Priority) -> ClassLimits {
        match class {
            Priority::Critical => self.critical,
            Priority::Normal => self.normal,
            Priority::Background => self.background,
        }
    }

    /// Slots non-critical classes may hold together.
    pub fn non_critical_cap(&self) -> u32 {
        self.global_limit.saturating_sub(self.critical.concurrency)
    }
}

/// Live counts for one class.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Usage {
    pub active: u32,
    pub queued: u32,
    pub shed: u64,
}

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Bulkheads {
    pub critical: Usage,
    pub normal: Usage,
    pub background: Usage,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Admission {
    Admitted,
    /// Wait for `promote`; the class queue holds the request.
    Queued,
    Rejected(ReasonCode),
}

impl Bulkheads {
    pub fn usage(&self, class: Priority) -> &Usage {
        match class {
            Priority::Critical => &self.critical,
            Priority::Normal => &self.normal,
            Priority::Background => &self.background,
        }
    }

    fn usage_mut(&mut self, class: Priority) -> &mut Usage {
        match class {
            Priority::Critical => &mut self.critical,
            Priority::Normal => &mut self.normal,
            Priority::Background => &mut self.background,
        }
    }

    pub fn non_critical_active(&self) -> u32 {
        self.normal.active + self.background.active
    }

    /// Would `class` get an active slot now, under both its own and the global limits?
    fn has_room(&self, class: Priority, cfg: &BulkheadConfig) -> bool {
        let own = self.usage(class).active < cfg.limits(class).concurrency;
        own && match class {
            Priority::Critical => true,
            Priority::Normal => self.non_critical_active() < cfg.non_critical_cap(),
            Priority::Background => {
                self.non_critical_active() < cfg.non_critical_cap().min(cfg.background_shed_at)
            }
        }
    }

    pub fn try_admit(&mut self, class: Priority, cfg: &BulkheadConfig) -> Admission {
        let limits = cfg.limits(class);
        let admission = if self.has_room(class, cfg) {
            self.usage_mut(class).active += 1;
            Admission::Admitted
        } else if self.usage(class).active < limits.concurrency {
            // The class has its own room: global pressure is what stops it.
            Admission::Rejected(ReasonCode::LoadShedNonCritical)
        } else if limits.queue == 0 {
            Admission::Rejected(ReasonCode::BulkheadShed)
        } else if self.usage(class).queued < limits.queue {
            self.usage_mut(class).queued += 1;
            Admission::Queued
        } else {
            Admission::Rejected(ReasonCode::QueueFull)
        };
        if let Admission::Rejected(_) = admission {
            self.usage_mut(class).shed += 1;
        }
        admission
    }

    /// Could a queued request of `class` take an active slot now?
    pub fn can_start_queued(&self, class: Priority, cfg: &BulkheadConfig) -> bool {
        self.usage(class).queued > 0 && self.has_room(class, cfg)
    }

    /// A queued request takes an active slot (its driver saw one free up).
    pub fn start_queued(&mut self, class: Priority) {
        let u = self.usage_mut(class);
        u.queued = u.queued.saturating_sub(1);
        u.active += 1;
    }

    /// A queued request gave up (its caller went away or timed out).
    pub fn abandon(&mut self, class: Priority) {
        let u = self.usage_mut(class);
        u.queued = u.queued.saturating_sub(1);
    }

    /// An active request finished.
    pub fn release(&mut self, class: Priority) {
        let u = self.usage_mut(class);
        u.active = u.active.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(b: &mut Bulkheads, class: Priority, n: u32, cfg: &BulkheadConfig) -> Vec<Admission> {
        (0..n).map(|_| b.try_admit(class, cfg)).collect()
    }

    #[test]
    fn a_non_critical_spike_never_touches_critical_capacity_with_defaults() {
        let cfg = BulkheadConfig::default();
        let mut b = Bulkheads::default();
        // A spike far beyond every limit: 200 background and 200 normal requests.
        let bg = fill(&mut b, Priority::Background, 200, &cfg);
        let normal = fill(&mut b, Priority::Normal, 200, &cfg);
        assert_eq!(b.non_critical_active(), cfg.non_critical_cap());
        assert!(bg.contains(&Admission::Rejected(ReasonCode::BulkheadShed)));
        assert!(normal.contains(&Admission::Rejected(ReasonCode::LoadShedNonCritical)));
        // Every critical slot is still there.
        let crit = fill(&mut b, Priority::Critical, 16, &cfg);
        assert!(crit.iter().all(|a| *a == Admission::Admitted), "{crit:?}");
        assert_eq!(b.critical.shed, 0);
        // Then critical queues, and only then is it refused.
        assert_eq!(b.try_admit(Priority::Critical, &cfg), Admission::Queued);
    }

    #[test]
    fn background_is_shed_before_normal() {
        let cfg = BulkheadConfig::default();
        let mut b = Bulkheads::default();
        fill(&mut b, Priority::Normal, cfg.background_shed_at, &cfg);
        assert_eq!(
            b.try_admit(Priority::Background, &cfg),
            Admission::Rejected(ReasonCode::LoadShedNonCritical)
        );
        assert_eq!(b.try_admit(Priority::Normal, &cfg), Admission::Admitted);
    }

    #[test]
    fn class_queue_then_queue_full() {
        let cfg = BulkheadConfig {
            normal: ClassLimits {
                concurrency: 2,
                queue: 1,
            },
            ..BulkheadConfig::default()
        };
        let mut b = Bulkheads::default();
        let got = fill(&mut b, Priority::Normal, 4, &cfg);
        assert_eq!(
            got,
            vec![
                Admission::Admitted,
                Admission::Admitted,
                Admission::Queued,
                Admission::Rejected(ReasonCode::QueueFull)
            ]
        );
        assert!(!b.can_start_queued(Priority::Normal, &cfg), "no room yet");
        b.release(Priority::Normal);
        assert!(b.can_start_queued(Priority::Normal, &cfg));
        b.start_queued(Priority::Normal);
        assert_eq!(
            b.normal,
            Usage {
                active: 2,
                queued: 0,
                shed: 1
            }
        );
    }

    #[test]
    fn counts_never_underflow() {
        let mut b = Bulkheads::default();
        b.release(Priority::Critical);
        b.abandon(Priority::Critical);
        assert_eq!(b.critical, Usage::default());
    }
}
