//! Admission: per-class bulkheads (critical, normal, background) and a global cap that sheds
//! non-critical traffic before critical capacity is touched, one set for short completions and
//! one for streams (a stream holds its slot for its whole generation: it is not a short request).
//!
//! Critical capacity is a reservation: non-critical classes together may hold at most
//! `global_limit - critical.concurrency` slots, and background is shed earlier still, at
//! `background_shed_at`. With the core's defaults (critical 16, normal 24, background 8, global
//! 40) a normal plus background spike saturates at 24 active and is shed from there, while all 16
//! critical slots stay free. A node sizes its defaults from its machine instead (`sized`).

use super::reason::ReasonCode;
use super::request::Priority;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, VecDeque};

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

/// What a request holds its slot for: each kind has its own bulkheads and queues.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A whole answer at once: its slot is held for one upstream call.
    Short,
    /// A stream: its slot is held for as long as the answer is relayed.
    Stream,
}

impl Kind {
    pub fn of(stream: bool) -> Kind {
        if stream { Kind::Stream } else { Kind::Short }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Short => "short",
            Kind::Stream => "stream",
        }
    }
}

/// What a node's default admission limits are sized from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Machine {
    pub cores: u32,
    /// HTTP connections the node may hold (from its descriptor limit): every active or queued
    /// request holds one.
    pub connections: u32,
}

/// Per core: (critical, normal, background) as (concurrency, queue), the global limit and the
/// background shed point. Short requests spend ~100 µs of a node's CPU each and wait on their
/// upstream the rest of the time; a relayed stream ~14 µs per token and ~100 KB while it lasts,
/// so a core carries thousands of streams at a human reading pace.
type PerCore = ([(u32, u32); 3], u32, u32);
const SHORT_PER_CORE: PerCore = ([(64, 128), (128, 256), (32, 0)], 192, 64);
const STREAM_PER_CORE: PerCore = ([(1_024, 128), (3_072, 256), (512, 0)], 4_096, 1_536);

/// Connections one core's worth of both kinds' slots and queue places hold.
fn held_per_core() -> u64 {
    [SHORT_PER_CORE, STREAM_PER_CORE]
        .iter()
        .map(|(classes, global, _)| {
            u64::from(*global) + classes.iter().map(|c| u64::from(c.1)).sum::<u64>()
        })
        .sum()
}

impl BulkheadConfig {
    /// The default limits of `kind` on `m`: the per-core figures times its cores, then scaled
    /// down (both kinds alike) until every slot and queue place of both kinds fits in its
    /// connections. Every class keeps at least one slot, and normal traffic room beside the
    /// critical reservation.
    pub fn sized(kind: Kind, m: Machine) -> BulkheadConfig {
        let (classes, global, shed) = match kind {
            Kind::Short => SHORT_PER_CORE,
            Kind::Stream => STREAM_PER_CORE,
        };
        let cores = u64::from(m.cores.max(1));
        let wanted = held_per_core() * cores;
        let have = u64::from(m.connections.max(1)).min(wanted);
        let scale = |per_core: u32, floor: u32| -> u32 {
            let n = u64::from(per_core) * cores * have / wanted;
            u32::try_from(n)
                .unwrap_or(u32::MAX)
                .max(floor.min(per_core))
        };
        let class = |(c, q): (u32, u32)| ClassLimits {
            concurrency: scale(c, 1),
            queue: scale(q, 1),
        };
        let [critical, normal, background] = classes.map(class);
        BulkheadConfig {
            critical,
            normal,
            background,
            global_limit: scale(global, 1).max(critical.concurrency + 1),
            background_shed_at: scale(shed, 1),
        }
    }

    pub fn limits(&self, class: Priority) -> ClassLimits {
        match class {
            Priority::Critical => self.critical,
            Priority::Normal => self.normal,
            Priority::Background => self.background,
        }
    }

    /// Slots non-critical classes may hold together.
    pub(crate) fn non_critical_cap(&self) -> u32 {
        self.global_limit.saturating_sub(self.critical.concurrency)
    }
}

/// Live counts for one class.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Occupancy {
    pub active: u32,
    pub queued: u32,
    pub shed: u64,
}

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Bulkheads {
    pub critical: Occupancy,
    pub normal: Occupancy,
    pub background: Occupancy,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Admission {
    Admitted,
    /// Wait for `promote`; the class queue holds the request.
    Queued,
    Rejected(ReasonCode),
}

impl Bulkheads {
    /// Nothing active, queued or ever shed.
    pub fn is_idle(&self) -> bool {
        *self == Bulkheads::default()
    }

    pub fn usage(&self, class: Priority) -> &Occupancy {
        match class {
            Priority::Critical => &self.critical,
            Priority::Normal => &self.normal,
            Priority::Background => &self.background,
        }
    }

    fn usage_mut(&mut self, class: Priority) -> &mut Occupancy {
        match class {
            Priority::Critical => &mut self.critical,
            Priority::Normal => &mut self.normal,
            Priority::Background => &mut self.background,
        }
    }

    pub(crate) fn non_critical_active(&self) -> u32 {
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
    pub(crate) fn can_start_queued(&self, class: Priority, cfg: &BulkheadConfig) -> bool {
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

/// The order of the class queues: first in, first out per class, and one hand-over per freed
/// slot. A freed slot goes to the head of the highest-priority queue that may take it, at the
/// moment it is freed, so a request arriving later cannot overtake one that waits, and nobody
/// is woken only to find the slot gone.
///
/// A queued request holds a ticket. `promote` moves free slots to queue heads (counts included)
/// and records their tickets as granted; the driver wakes exactly those waiters
/// (`take_granted`), and each claims its slot with `claim`.
#[derive(Clone, Debug, Default)]
pub(crate) struct Queues {
    next_ticket: u64,
    /// By kind, then class.
    waiting: [VecDeque<u64>; 6],
    /// Granted a slot, not yet claimed by the waiter.
    granted: BTreeSet<u64>,
    /// Granted since the driver last looked.
    to_wake: Vec<u64>,
}

/// Where a ticket was when its request left the queue.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Left {
    /// Still waiting: the queue count is decremented.
    Waiting,
    /// A slot had already been handed to it: the caller must release that slot.
    Granted,
    /// Not in any queue (already left or claimed).
    Unknown,
}

fn index(kind: Kind, class: Priority) -> usize {
    let k = match kind {
        Kind::Short => 0,
        Kind::Stream => 3,
    };
    k + match class {
        Priority::Critical => 0,
        Priority::Normal => 1,
        Priority::Background => 2,
    }
}

impl Queues {
    /// A request joins its class queue (`try_admit` answered `Queued`): its ticket.
    pub fn enqueue(&mut self, kind: Kind, class: Priority) -> u64 {
        self.next_ticket += 1;
        self.waiting[index(kind, class)].push_back(self.next_ticket);
        self.next_ticket
    }

    /// Hand every free slot of `kind` (its bulkheads `b`, limits `cfg`) to the head of a
    /// queue, critical first.
    pub fn promote(&mut self, kind: Kind, b: &mut Bulkheads, cfg: &BulkheadConfig) {
        for class in Priority::ALL {
            while b.can_start_queued(class, cfg) {
                let Some(ticket) = self.waiting[index(kind, class)].pop_front() else {
                    break;
                };
                b.start_queued(class);
                self.granted.insert(ticket);
                self.to_wake.push(ticket);
            }
        }
    }

    /// Tickets granted a slot since the last call, in grant order: wake exactly these.
    pub fn take_granted(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.to_wake)
    }

    /// The waiter takes the slot it was granted; false if it was not granted one.
    pub fn claim(&mut self, ticket: u64) -> bool {
        self.granted.remove(&ticket)
    }

    /// A request leaves the queue without claiming a slot (deadline, caller gone).
    pub fn leave(&mut self, kind: Kind, class: Priority, ticket: u64, b: &mut Bulkheads) -> Left {
        if self.granted.remove(&ticket) {
            return Left::Granted;
        }
        if self.remove(kind, class, ticket) {
            b.abandon(class);
            Left::Waiting
        } else {
            Left::Unknown
        }
    }

    /// Take a waiting ticket out of its queue without touching the counts (the caller moves
    /// it to a slot itself); false if it was not waiting.
    pub fn remove(&mut self, kind: Kind, class: Priority, ticket: u64) -> bool {
        let q = &mut self.waiting[index(kind, class)];
        match q.iter().position(|&t| t == ticket) {
            Some(i) => q.remove(i).is_some(),
            None => false,
        }
    }

    /// How many wait in `class`'s queue of `kind`.
    #[cfg(test)]
    pub fn waiting(&self, kind: Kind, class: Priority) -> usize {
        self.waiting[index(kind, class)].len()
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

    /// Every connection an admission config can hold: its slots and its queue places.
    fn held(c: &BulkheadConfig) -> u64 {
        u64::from(c.global_limit)
            + [c.critical, c.normal, c.background]
                .iter()
                .map(|l| u64::from(l.queue))
                .sum::<u64>()
    }

    #[test]
    fn defaults_grow_with_cores_and_fit_the_connections() {
        let roomy = Machine {
            cores: 2,
            connections: 1_000_000,
        };
        let short = BulkheadConfig::sized(Kind::Short, roomy);
        let streams = BulkheadConfig::sized(Kind::Stream, roomy);
        assert_eq!((short.normal.concurrency, short.normal.queue), (256, 512));
        assert_eq!(short.non_critical_cap(), 256);
        assert_eq!(streams.normal.concurrency, 6_144);
        assert_eq!(streams.global_limit, 8_192);
        // Twice the cores, twice the slots.
        let four = BulkheadConfig::sized(Kind::Short, Machine { cores: 4, ..roomy });
        assert_eq!(four.global_limit, 2 * short.global_limit);
        // A descriptor limit of 20,000 leaves ~9,872 connections: both kinds shrink alike.
        let tight = Machine {
            cores: 2,
            connections: 9_872,
        };
        let (s, t) = (
            BulkheadConfig::sized(Kind::Short, tight),
            BulkheadConfig::sized(Kind::Stream, tight),
        );
        assert!(held(&s) + held(&t) <= 9_872, "{s:?} {t:?}");
        assert!(s.normal.concurrency < 256 && s.normal.concurrency > 200);
    }

    proptest::proptest! {
        /// However small the machine, every class keeps a slot and normal traffic has room
        /// beside the critical reservation; from 64 connections up, both kinds fit in them.
        #[test]
        fn sized_limits_are_usable(cores in 1u32..256, connections in 1u32..2_000_000) {
            let m = Machine { cores, connections };
            let (s, t) = (BulkheadConfig::sized(Kind::Short, m), BulkheadConfig::sized(Kind::Stream, m));
            for c in [s, t] {
                proptest::prop_assert!(c.critical.concurrency >= 1 && c.normal.concurrency >= 1);
                proptest::prop_assert!(c.background.concurrency >= 1 && c.background_shed_at >= 1);
                proptest::prop_assert!(c.non_critical_cap() >= 1);
                proptest::prop_assert_eq!(c.background.queue, 0);
            }
            if connections >= 64 {
                proptest::prop_assert!(held(&s) + held(&t) <= u64::from(connections) + 16);
            }
        }
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
            Occupancy {
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
        assert_eq!(b.critical, Occupancy::default());
    }

    fn queued(q: &mut Queues, b: &mut Bulkheads, cfg: &BulkheadConfig, n: u32) -> Vec<u64> {
        (0..n)
            .map(|_| {
                assert_eq!(b.try_admit(Priority::Normal, cfg), Admission::Queued);
                q.enqueue(Kind::Short, Priority::Normal)
            })
            .collect()
    }

    #[test]
    fn freed_slots_go_to_the_queue_in_arrival_order_one_each() {
        let cfg = BulkheadConfig {
            normal: ClassLimits {
                concurrency: 2,
                queue: 8,
            },
            ..BulkheadConfig::default()
        };
        let mut b = Bulkheads::default();
        let mut q = Queues::default();
        fill(&mut b, Priority::Normal, 2, &cfg);
        let tickets = queued(&mut q, &mut b, &cfg, 5);
        q.promote(Kind::Short, &mut b, &cfg);
        assert!(q.take_granted().is_empty(), "no slot is free yet");
        let mut woken = Vec::new();
        for _ in 0..5 {
            b.release(Priority::Normal);
            q.promote(Kind::Short, &mut b, &cfg);
            let granted = q.take_granted();
            assert_eq!(granted.len(), 1, "one wake-up per freed slot");
            assert!(q.claim(granted[0]));
            woken.extend(granted);
            assert_eq!(
                b.normal.active, 2,
                "the slot moved, it was not lost or doubled"
            );
        }
        assert_eq!(woken, tickets, "first in, first out");
        assert_eq!(b.normal.queued, 0);
        // A newcomer takes a free slot only when nobody waits.
        b.release(Priority::Normal);
        q.promote(Kind::Short, &mut b, &cfg);
        assert_eq!(b.try_admit(Priority::Normal, &cfg), Admission::Admitted);
    }

    #[test]
    fn leaving_the_queue_gives_back_what_was_held() {
        let cfg = BulkheadConfig {
            normal: ClassLimits {
                concurrency: 1,
                queue: 8,
            },
            ..BulkheadConfig::default()
        };
        let mut b = Bulkheads::default();
        let mut q = Queues::default();
        fill(&mut b, Priority::Normal, 1, &cfg);
        let t = queued(&mut q, &mut b, &cfg, 3);
        // The middle one gives up while waiting: only the queue count changes.
        assert_eq!(
            q.leave(Kind::Short, Priority::Normal, t[1], &mut b),
            Left::Waiting
        );
        assert_eq!((b.normal.active, b.normal.queued), (1, 2));
        assert_eq!(
            q.leave(Kind::Short, Priority::Normal, t[1], &mut b),
            Left::Unknown
        );
        // The head is granted the freed slot but gives up before claiming it: the caller must
        // release the slot, and the next in line gets it.
        b.release(Priority::Normal);
        q.promote(Kind::Short, &mut b, &cfg);
        assert_eq!(q.take_granted(), vec![t[0]]);
        assert_eq!(
            q.leave(Kind::Short, Priority::Normal, t[0], &mut b),
            Left::Granted
        );
        b.release(Priority::Normal);
        q.promote(Kind::Short, &mut b, &cfg);
        assert_eq!(q.take_granted(), vec![t[2]]);
        assert!(q.claim(t[2]));
        assert_eq!((b.normal.active, b.normal.queued), (1, 0));
        assert_eq!(q.waiting(Kind::Short, Priority::Normal), 0);
    }

    proptest::proptest! {
        /// Whatever arrives, finishes or gives up, in any order: active never exceeds a limit,
        /// the queue count is the queue's length, and every waiter is eventually served.
        #[test]
        fn queues_and_counts_never_disagree(ops in proptest::collection::vec(0u8..4, 1..200)) {
            let cfg = BulkheadConfig {
                normal: ClassLimits { concurrency: 3, queue: 5 },
                ..BulkheadConfig::default()
            };
            let mut b = Bulkheads::default();
            let mut q = Queues::default();
            let mut active = 0u32;
            let mut waiting: Vec<u64> = Vec::new();
            for op in ops {
                match op {
                    0 => match b.try_admit(Priority::Normal, &cfg) {
                        Admission::Admitted => active += 1,
                        Admission::Queued => waiting.push(q.enqueue(Kind::Short, Priority::Normal)),
                        Admission::Rejected(_) => {}
                    },
                    1 if active > 0 => {
                        active -= 1;
                        b.release(Priority::Normal);
                        q.promote(Kind::Short, &mut b, &cfg);
                    }
                    2 if !waiting.is_empty() => {
                        let t = waiting.remove(waiting.len() / 2);
                        if q.leave(Kind::Short, Priority::Normal, t, &mut b) == Left::Granted {
                            b.release(Priority::Normal);
                            q.promote(Kind::Short, &mut b, &cfg);
                        }
                    }
                    _ => {}
                }
                for t in q.take_granted() {
                    proptest::prop_assert!(q.claim(t));
                    waiting.retain(|&w| w != t);
                    active += 1;
                }
                proptest::prop_assert_eq!(b.normal.active, active);
                proptest::prop_assert!(active <= cfg.normal.concurrency);
                proptest::prop_assert_eq!(b.normal.queued as usize, q.waiting(Kind::Short, Priority::Normal));
                proptest::prop_assert_eq!(waiting.len(), q.waiting(Kind::Short, Priority::Normal));
                // Nobody waits while a slot is free.
                proptest::prop_assert!(waiting.is_empty() || active == cfg.normal.concurrency);
            }
        }
    }
}
