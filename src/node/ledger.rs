//! The node's side of the shared budget ledger (`core::ledger`), kept in the JetStream KV bucket
//! `oam-budgets`: one key per budget (`global`, `agent.{name}`, `team.{name}`, `task.{name}`).
//! A request holds and is charged in every budget that covers it.
//!
//! Each node holds a *share* of each budget in the ledger (escrow): its hold there, taken in
//! one write and drawn on locally. Before an attempt a budget applies to, the driver asks
//! [`Ledgers::reserve`]: a share that covers it grants it at once, with no write. Otherwise one
//! task per node takes every request waiting at that moment and asks each key, in a single
//! compare-and-swap (retried on a conflict with another node), for what the shares lack plus a
//! new share: `SHARE_REQUESTS` times the reservation (doubled each time the last ran out
//! within `SHARE_IDLE_MS`, so a busy node asks about once a second), and at most
//! what is left over `SHARE_PARTS` times the cluster's size, so shares shrink as the budget runs
//! out; one under a `SHARE_FLOOR`th of its size is not taken, so near the end every reservation
//! is written, as without shares. Settlements are applied off the
//! request's path, gathered for `SETTLE_EVERY` (longer while writes conflict, to `SETTLE_MAX`)
//! into one write a key (each moves its cost from the share to `spent`); one that cannot be written waits for the next batch, never
//! dropped. A share unused for `SHARE_IDLE_MS`, or the node stopping, gives back what it does
//! not hold for attempts under way. So a busy cluster writes each key a few times a second per
//! node, not once per batch of requests.
//!
//! The bound kept: a reservation is granted only from a share the ledger holds, and a share
//! only if the limit covers it beside everything spent and every live hold; spend passes the
//! limit only by what settlements cost beyond their reservations (one attempt's overrun per
//! attempt under way). Every node watches the bucket and mirrors each budget into its engine
//! (others' shares count as spent), so routing already sees what the cluster spent or holds.
//!
//! When the ledger cannot be reached (no answer within `STORE_TIMEOUT`, or the node is cut
//! off) the request's risk decides: high risk is refused (BUDGET_STORE_UNREACHABLE, escalated);
//! lower risk may spend this node's local share (BUDGET_LOCAL_SHARE), settled in the ledger once
//! it answers again. A local share is what the node last saw left of the budget divided by the
//! cluster's size, sized when the node first draws on it: if every node is cut off at once (a
//! store electing its leader), together they spend at most what was left; a node cut off alone
//! passes the limit by at most its share while the others spend the rest.
//!
//! An exhausted budget is escalated once per episode for the cluster: the node whose engine
//! escalates first claims the episode in the budget's record (`Ledger::refused`), and raises
//! the escalation only if its claim was the first; an operator's `set` or `reset` ends it.

use super::Node;
use super::bus::Bus;
use super::chaos::Chaos;
use super::metrics::{Kind, Registry};
use super::pipeline::Pipeline;
use crate::clock::now_ms;
use crate::core::budget::{self, Owner, Shortfall};
use crate::core::escalation::Escalation;
use crate::core::ledger::{Ledger, Refused};
use crate::core::pipeline::{Engine, Session, Step};
use crate::core::reason::ReasonCode;
use crate::core::record::Charge;
use crate::core::request::{Risk, round_usd};
use crate::transport::store::ledger::{CAS_TRIES, STORE_TIMEOUT, key};
use async_nats::jetstream::kv;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// How soon settlements the ledger did not take are tried again.
const RETRY: Duration = Duration::from_millis(200);
/// Settlements wait this long to share one write (reservations never wait for them); each
/// write that met another node's doubles the wait, to at most `SETTLE_MAX`, and each that did
/// not takes a sixteenth off it: contention spaces the writes out, and they stay spaced while
/// it lasts (halving after each clean write brought them straight back).
const SETTLE_EVERY: Duration = Duration::from_millis(500);
const SETTLE_MAX: Duration = Duration::from_secs(1);
/// A new share is at most what is left over this many times the cluster's size...
const SHARE_PARTS: usize = 4;
/// ...and this many times the reservation that asked for it, doubled while it runs out fast,
/// to at most `SHARE_REQUESTS_MAX` times.
const SHARE_REQUESTS: f64 = 1024.0;
const SHARE_REQUESTS_MAX: f64 = 1_048_576.0;
/// A share no attempt drew on for this long goes back to the ledger.
const SHARE_IDLE_MS: u64 = 1_000;
/// Float slack for dollar amounts.
const EPSILON_USD: f64 = 1e-9;

/// What a node cut off from the ledger may spend of one budget, and has.
#[derive(Clone, Copy, Debug, PartialEq)]
struct LocalShare {
    /// What the node saw left of the budget when it first drew on this share, over the
    /// cluster's size.
    size: f64,
    used: f64,
}

/// Take `usd` from the local shares of every budget in `covering` (key, what the node sees left
/// of it) if each covers it; a budget's share is sized at its first draw, and kept until the
/// ledger has every settlement again.
fn take_local(
    shares: &mut BTreeMap<String, LocalShare>,
    covering: &[(String, f64)],
    cluster: usize,
    usd: f64,
) -> bool {
    let size = |left: f64| round_usd(left.max(0.0) / cluster.max(1) as f64);
    let fits = covering.iter().all(|(k, left)| {
        let s = shares.get(k).map_or(
            LocalShare {
                size: size(*left),
                used: 0.0,
            },
            |s| *s,
        );
        s.used + usd <= s.size + EPSILON_USD
    });
    if fits {
        for (k, left) in covering {
            let s = shares.entry(k.clone()).or_insert(LocalShare {
                size: size(*left),
                used: 0.0,
            });
            s.used = round_usd(s.used + usd);
        }
    }
    fits
}

/// This node's share of one budget.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Escrow {
    /// What the ledger holds for this node, as its newest record says.
    held: f64,
    /// Reserved for attempts under way.
    drawn: f64,
    /// Settled here, not yet written (the ledger still holds it as share).
    unwritten: f64,
    /// Being given back by the write under way.
    returning: f64,
    /// When an attempt last drew on it.
    used_ms: u64,
    /// How many reservations its last new share was sized for, and when it was asked.
    factor: f64,
    topped_ms: u64,
}

impl Escrow {
    /// What the share still covers (negative when attempts cost more than they reserved).
    fn free(&self) -> f64 {
        self.held - self.drawn - self.unwritten - self.returning
    }
}
/// A settlement made (this node's own accounting of it done) on its way to the ledger: it goes
/// when dropped. A request's settlements are held until its record is in the decision log
/// under `[decision_log] durable`, so that the ledger never holds a charge no record explains;
/// a node killed in between left a record without its charge, which it charges from the
/// record when it starts again (`reconcile`). The keeper applies them in their numbers' order
/// whatever order they come in (`InOrder`).
#[must_use = "a settlement goes to the ledger when dropped"]
pub(crate) struct Unsent {
    ops: Vec<LedgerOp>,
    tx: mpsc::UnboundedSender<LedgerOp>,
}

impl Drop for Unsent {
    fn drop(&mut self) {
        let settles = std::mem::take(&mut self.ops);
        if let Some(LedgerOp::Settle { seq, .. }) = settles.first() {
            let seq = *seq;
            let _ = self.tx.send(LedgerOp::Settlement { seq, settles });
        }
    }
}

/// Settlements put back in their numbers' order (a record's settlements may be held while
/// later ones are not): a budget record applies a holder's settlement only past the last it
/// applied, so one applied early would make the earlier one be skipped.
#[derive(Default)]
struct InOrder {
    /// The next number to pass on.
    next: u64,
    /// Those that came early, by number, with when the first of them came.
    early: BTreeMap<u64, Vec<LedgerOp>>,
    waiting_since: Option<tokio::time::Instant>,
}

/// How long settlements wait for an earlier number before it is given up (its request's
/// record never answered: the log's own deadlines are far shorter).
const IN_ORDER_WAIT: Duration = Duration::from_secs(60);

impl InOrder {
    /// Pass `op` on (a settlement as its `Settle`s), with the early ones it lets go, in order;
    /// hold a settlement that is early.
    fn admit(&mut self, op: LedgerOp, out: &mut Vec<LedgerOp>) {
        let LedgerOp::Settlement { seq, settles } = op else {
            out.push(op);
            return;
        };
        if self.next == 0 {
            self.next = 1;
        }
        if seq > self.next {
            self.waiting_since
                .get_or_insert_with(tokio::time::Instant::now);
            self.early.insert(seq, settles);
            return;
        }
        out.extend(settles);
        self.next = self.next.max(seq + 1);
        self.release(out);
    }

    fn release(&mut self, out: &mut Vec<LedgerOp>) {
        while let Some(settles) = self.early.remove(&self.next) {
            out.extend(settles);
            self.next += 1;
        }
        self.waiting_since = (!self.early.is_empty()).then(tokio::time::Instant::now);
    }

    /// Give up on a number that has kept later ones waiting for `IN_ORDER_WAIT`.
    fn overdue(&mut self, out: &mut Vec<LedgerOp>) {
        if self
            .waiting_since
            .is_none_or(|t| t.elapsed() < IN_ORDER_WAIT)
        {
            return;
        }
        if let Some(&first) = self.early.keys().next() {
            tracing::warn!(
                missing = self.next,
                next = first,
                "a settlement never came; the later ones are applied without it"
            );
            self.next = first;
            self.release(out);
        }
    }
}

/// Requests applied in one batch at most.
const BATCH_MAX: usize = 512;

/// What the ledger said to a reservation.
#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) enum Ruling {
    Held,
    /// Held, though a budget in audit mode could not cover it (`BUDGET_WOULD_REFUSE`).
    Audited,
    Refused(ReasonCode),
    Unreachable,
}

/// A granted hold an attempt carries until it settles.
#[derive(Clone, Debug)]
pub(crate) struct Hold {
    /// The keys of the budgets that hold it (every budget that covers the request).
    keys: Vec<String>,
    usd: f64,
    /// Spent on the node's local share, not held in the ledger.
    local: bool,
}

enum LedgerOp {
    Reserve {
        keys: Vec<String>,
        usd: f64,
        reply: oneshot::Sender<Ruling>,
    },
    Settle {
        key: String,
        reserved_usd: f64,
        actual_usd: f64,
        /// This node run's count of settlements (from 1), so a record applies each once.
        seq: u64,
    },
    /// One settlement's `Settle`s (one per budget it charges), as `Unsent` sends them: put in
    /// their number's order by the keeper (`InOrder`) before they are planned.
    Settlement { seq: u64, settles: Vec<LedgerOp> },
    /// Claim the exhaustion episode of `key` and raise its escalation, unless another node's
    /// claim is there already.
    Claim {
        key: String,
        refused: Refused,
        escalation: Box<Escalation>,
    },
}

/// A reservation in a batch and, once applied, its answer.
struct Ask {
    keys: Vec<String>,
    usd: f64,
    reply: oneshot::Sender<Ruling>,
    answer: Ruling,
    /// A budget in audit mode granted it past its limit.
    audited: bool,
    /// The shares it drew on (given back if it is not granted).
    drew: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum LedgerChange {
    Reserve(f64),
    /// Reserved, actual, and the settlement's number (none for a give-back, never retried).
    Settle(f64, f64, Option<u64>),
    Renew,
    /// A new share beside the reservations before it: what is left over `parts`, at most `cap`.
    Extra {
        parts: u32,
        cap: f64,
    },
}

/// Counters for `/metrics` and the state snapshot.
#[derive(Default)]
pub(crate) struct LedgerCounters {
    pub held: AtomicU64,
    pub refused: AtomicU64,
    pub unreachable: AtomicU64,
    pub local_share: AtomicU64,
    /// Exhaustion escalations not raised here: another node had claimed the episode.
    pub episodes_joined: AtomicU64,
    /// Settlements waiting for the ledger to answer.
    pub unsettled: AtomicU64,
    /// Compare-and-swap writes taken, and those another node's write beat.
    pub written: AtomicU64,
    pub conflicts: AtomicU64,
    /// Reservations held from this node's escrow at once, with no write.
    pub from_escrow: AtomicU64,
    /// Settlements of this node's earlier runs applied from their records (`reconcile`).
    pub from_records: AtomicU64,
    /// Reservations a budget in audit mode granted past its limit (`BUDGET_WOULD_REFUSE`).
    pub would_refuse: AtomicU64,
}

impl LedgerCounters {
    /// Register the counters, read when scraped.
    pub(crate) fn register(self: &Arc<Self>, registry: &Registry) {
        let c = self.clone();
        registry.register(
            "oam_budget_reservations_total",
            "Attempts a shared budget was asked to hold, by what the ledger answered \
             (local_share: unreachable, spent on this node's share).",
            Kind::Counter,
            move |s| {
                for (answer, n) in [
                    ("held", &c.held),
                    ("refused", &c.refused),
                    ("unreachable", &c.unreachable),
                    ("local_share", &c.local_share),
                ] {
                    s.put(&[("answer", answer)], n.load(Ordering::Relaxed));
                }
            },
        );
        let c = self.clone();
        registry.register(
            "oam_budget_ledger_writes_total",
            "Compare-and-swap writes to the budget ledger, by result (conflict: another node \
             wrote first, read again).",
            Kind::Counter,
            move |s| {
                for (result, n) in [("written", &c.written), ("conflict", &c.conflicts)] {
                    s.put(&[("result", result)], n.load(Ordering::Relaxed));
                }
            },
        );
        let c = self.clone();
        registry.register(
            "oam_budget_would_refuse_total",
            "Reservations a budget in audit mode granted past its limit (each such decision \
             says BUDGET_WOULD_REFUSE).",
            Kind::Counter,
            move |s| s.put(&[], c.would_refuse.load(Ordering::Relaxed)),
        );
        let c = self.clone();
        registry.register(
            "oam_budget_escrow_draws_total",
            "Reservations this node's escrow held at once, with no ledger write (of those \
             answered held).",
            Kind::Counter,
            move |s| s.put(&[], c.from_escrow.load(Ordering::Relaxed)),
        );
        let c = self.clone();
        registry.register(
            "oam_budget_settled_from_records_total",
            "Settlements an earlier run of this node answered and did not write, charged from \
             their decision records when it started again.",
            Kind::Counter,
            move |s| s.put(&[], c.from_records.load(Ordering::Relaxed)),
        );
        let c = self.clone();
        registry.register(
            "oam_budget_unsettled",
            "Settlements waiting for the ledger to answer.",
            Kind::Gauge,
            move |s| s.put(&[], c.unsettled.load(Ordering::Relaxed)),
        );
    }
}

pub(crate) struct Ledgers {
    id: String,
    pipeline: Pipeline,
    bus: Arc<Bus>,
    chaos: Arc<Chaos>,
    tx: mpsc::UnboundedSender<LedgerOp>,
    /// This node's local share of each key while the ledger is unreachable.
    share: std::sync::Mutex<BTreeMap<String, LocalShare>>,
    /// The newest record (and its revision) of each key this node has seen.
    latest: std::sync::Mutex<BTreeMap<String, (Ledger, u64)>>,
    /// This node's share of each key.
    escrow: std::sync::Mutex<BTreeMap<String, Escrow>>,
    /// The ledger took none of the last batch's writes (full, or out of reach): escrow is not
    /// drawn on without a write until it takes one again, so high-risk work fails closed.
    failing: std::sync::atomic::AtomicBool,
    /// This run of the node (random): its holds are `{node}#{run}`, so a node killed and started
    /// again does not renew, or add to, what its last run held; that lapses with its lease.
    run: String,
    /// Settlements sent so far in this run (each is numbered: the next is this plus one). Held
    /// while one is numbered and sent, so they reach the keeper in the order of their numbers
    /// (a record applies only numbers above the last it applied).
    settlements: std::sync::Mutex<u64>,
    pub counters: Arc<LedgerCounters>,
}

/// Reservations and settlements on their way to the [`Keeper`].
pub(crate) struct Queue(mpsc::UnboundedReceiver<LedgerOp>);

/// The service that applies the queue to the ledger in batches, renews this node's holds, and
/// mirrors every budget into the engine.
pub(crate) struct Keeper {
    node: Arc<Node>,
    rx: mpsc::UnboundedReceiver<LedgerOp>,
    /// The bucket, once open.
    store: Option<kv::Store>,
}

impl Ledgers {
    pub(crate) fn new(
        id: &str,
        pipeline: Pipeline,
        bus: Arc<Bus>,
        chaos: Arc<Chaos>,
    ) -> (Ledgers, Queue) {
        let (tx, rx) = mpsc::unbounded_channel();
        let ledgers = Ledgers {
            id: id.to_string(),
            pipeline,
            bus,
            chaos,
            tx,
            share: std::sync::Mutex::default(),
            latest: std::sync::Mutex::default(),
            escrow: std::sync::Mutex::default(),
            failing: std::sync::atomic::AtomicBool::new(false),
            run: crate::ids::unguessable()[..8].to_string(),
            settlements: std::sync::Mutex::new(0),
            counters: Arc::default(),
        };
        (ledgers, Queue(rx))
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Mirror a ledger into the engine's budgets as `node` sees it (its own reservations it keeps).
fn mirror_into(e: &mut Engine, node: &str, owner: &Owner, l: &Ledger, now: u64) {
    let slot = e.state.budgets.entry(owner, l.limit_usd);
    let marked = slot.refused_at_ms;
    *slot = l.view_for(node, now, slot.reserved_usd);
    // This engine escalated an exhaustion a moment ago and its claim is on the way: until the
    // ledger says, the episode stands here (else every refusal meanwhile is escalated again).
    if slot.refused_at_ms.is_none()
        && let Some(at) = marked.filter(|at| now.saturating_sub(*at) < CLAIM_GRACE_MS)
    {
        slot.refused_at_ms = Some(at);
    }
}

/// The kind of budget key `k` names (`team.x`: a team's).
fn kind_of(k: &str) -> budget::Kind {
    let kind = k.split_once('.').map_or(k, |(kind, _)| kind);
    budget::Kind::ALL
        .into_iter()
        .find(|x| x.as_str() == kind)
        .unwrap_or(budget::Kind::Global)
}

/// How long an engine's own mark of an exhaustion episode stands without the ledger's.
const CLAIM_GRACE_MS: u64 = 10_000;

impl Ledgers {
    /// Who this node's holds in the ledger are: this run of it (`{id}#{run}`).
    pub(crate) fn holder(&self) -> String {
        format!("{}#{}", self.id, self.run)
    }

    /// Reserve the attempt's cost in the shared ledger before it is made. `None`: go ahead (the
    /// flight carries the hold until it settles); `Some(step)`: the engine's next step after a
    /// refusal.
    pub(crate) async fn reserve(
        &self,
        flight: &mut super::request::Flight,
        usd: f64,
    ) -> Option<Step> {
        let risk = flight.session.request().risk;
        // Every budget that covers the request: its key, and what this node saw left of it
        // (for the local share).
        let now = now_ms();
        let covering: Vec<(String, f64)> = self.pipeline.with(|e| {
            let request = flight.session.request();
            e.state
                .budgets
                .covering(request)
                .map(|(k, n, b)| (key(&Owner::new(k, n)), b.remaining_usd(now)))
                .collect()
        });
        let keys: Vec<String> = covering.iter().map(|(k, _)| k.clone()).collect();
        let answer = if self.bus.isolated() {
            Ruling::Unreachable
        } else if self.draw(&keys, usd, now) {
            self.counters.from_escrow.fetch_add(1, Ordering::Relaxed);
            Ruling::Held
        } else {
            let (reply, rx) = oneshot::channel();
            let op = LedgerOp::Reserve {
                keys: keys.clone(),
                usd,
                reply,
            };
            match self.tx.send(op) {
                Ok(()) => rx.await.unwrap_or(Ruling::Unreachable),
                Err(_) => Ruling::Unreachable,
            }
        };
        let c = &self.counters;
        let code = match answer {
            Ruling::Held | Ruling::Audited => {
                c.held.fetch_add(1, Ordering::Relaxed);
                if answer == Ruling::Audited {
                    c.would_refuse.fetch_add(1, Ordering::Relaxed);
                    flight.call(crate::core::record::Call::Note {
                        code: ReasonCode::BudgetWouldRefuse,
                    });
                }
                flight.hold = Some(Hold {
                    keys,
                    usd,
                    local: false,
                });
                return None;
            }
            Ruling::Refused(code) => {
                c.refused.fetch_add(1, Ordering::Relaxed);
                code
            }
            Ruling::Unreachable => {
                c.unreachable.fetch_add(1, Ordering::Relaxed);
                if risk != Risk::High && self.take_local_share(&covering, usd) {
                    c.local_share.fetch_add(1, Ordering::Relaxed);
                    flight.call(crate::core::record::Call::Note {
                        code: ReasonCode::BudgetLocalShare,
                    });
                    flight.hold = Some(Hold {
                        keys,
                        usd,
                        local: true,
                    });
                    return None;
                }
                ReasonCode::BudgetStoreUnreachable
            }
        };
        flight.call(crate::core::record::Call::RefuseReservation { code })
    }

    /// Draw `usd` on this node's share of every key in `keys`, if each covers it (no write).
    fn draw(&self, keys: &[String], usd: f64, now: u64) -> bool {
        if self.failing.load(Ordering::Relaxed) {
            return false;
        }
        let mut escrow = lock(&self.escrow);
        let covered = keys
            .iter()
            .all(|k| escrow.get(k).is_some_and(|e| e.free() + EPSILON_USD >= usd));
        if covered {
            for k in keys {
                if let Some(e) = escrow.get_mut(k) {
                    e.drawn = round_usd(e.drawn + usd);
                    e.used_ms = now;
                }
            }
        }
        covered
    }

    /// Give back what attempts drew on the shares of `keys` and did not spend: `usd` each,
    /// with `actual_usd` of it spent (moved to `unwritten` until the ledger takes it).
    fn undraw(&self, keys: &[String], usd: f64, actual_usd: f64) {
        let mut escrow = lock(&self.escrow);
        for k in keys {
            if let Some(e) = escrow.get_mut(k) {
                e.drawn = round_usd((e.drawn - usd).max(0.0));
                e.unwritten = round_usd(e.unwritten + actual_usd);
            }
        }
    }

    /// How many parts a new escrow may take of what is left: `SHARE_PARTS` per node.
    fn share_parts(&self) -> u32 {
        let nodes = self
            .pipeline
            .with(|e| e.state.cluster.effective_size(now_ms()).max(1));
        u32::try_from(SHARE_PARTS * nodes).unwrap_or(u32::MAX)
    }

    /// Draw each ask still `Held` that `key_of` names a key for on this node's escrow of that
    /// key, in order, and plan in `plan` a reservation of what the escrow lacks for it, and a
    /// new escrow after the key's last (at most `SHARE_REQUESTS` times its largest ask).
    fn draw_escrow(
        &self,
        plan: &mut Plan,
        asks: &mut [Ask],
        key_of: impl Fn(&Ask) -> Option<String>,
        parts: u32,
        now: u64,
    ) {
        let trusted = !self.failing.load(Ordering::Relaxed);
        draw(
            &mut lock(&self.escrow),
            plan,
            asks,
            key_of,
            parts,
            now,
            trusted,
        );
    }

    /// After key `k`'s `changes` were written (`written`) or not: the settlements written are no
    /// longer this node's to count, and give-backs are over either way (the record says what
    /// the node holds).
    fn written(&self, k: &str, changes: &[(Option<usize>, LedgerChange)], written: bool) {
        let mut escrow = lock(&self.escrow);
        let Some(e) = escrow.get_mut(k) else {
            return;
        };
        for (_, c) in changes {
            match *c {
                LedgerChange::Settle(r, _, Some(_)) if written => {
                    e.unwritten = round_usd((e.unwritten - r).max(0.0));
                }
                LedgerChange::Settle(r, _, None) => {
                    e.returning = round_usd((e.returning - r).max(0.0));
                }
                _ => {}
            }
        }
    }

    /// What each escrow no attempt drew on for `idle_ms` holds beyond what it is spoken for:
    /// marked as being given back (key, usd).
    fn idle_escrow(&self, now: u64, idle_ms: u64) -> Vec<(String, f64)> {
        let mut escrow = lock(&self.escrow);
        let mut back = Vec::new();
        for (k, e) in escrow.iter_mut() {
            let free = round_usd(e.free());
            if free > EPSILON_USD && now.saturating_sub(e.used_ms) >= idle_ms {
                e.returning = round_usd(e.returning + free);
                e.factor = 0.0;
                back.push((k.clone(), free));
            }
        }
        back
    }

    /// Take `usd` from this node's local share of each budget in `covering` (key, what the
    /// node saw left of it), if every one covers it.
    fn take_local_share(&self, covering: &[(String, f64)], usd: f64) -> bool {
        let cluster = self
            .pipeline
            .with(|e| e.state.cluster.effective_size(now_ms()).max(1));
        take_local(&mut lock(&self.share), covering, cluster, usd)
    }

    /// Settle a hold with what the attempt really cost (off the request's path). A hold drawn
    /// on a share moves its cost from the share to `spent` (the ledger's hold shrinks by what
    /// was spent); one spent on the local share is charged beside the holds.
    /// The charge it makes, numbered for this holder (none when nothing was spent), and the
    /// settlement, which goes to the ledger when it is dropped (`Unsent`).
    pub(crate) fn settle(&self, hold: Hold, actual_usd: f64) -> Option<(Charge, Unsent)> {
        let keys = hold.keys;
        let reserved_usd = if hold.local { 0.0 } else { actual_usd };
        if !hold.local {
            self.undraw(&keys, hold.usd, actual_usd);
        } else {
            // The share keeps what was spent, not what was estimated.
            let mut share = lock(&self.share);
            for k in &keys {
                if let Some(s) = share.get_mut(k) {
                    s.used = round_usd((s.used - hold.usd + actual_usd).max(0.0));
                }
            }
        }
        if actual_usd <= 0.0 {
            return None; // nothing spent: the share is whole again, nothing to write
        }
        let mut sent = lock(&self.settlements);
        *sent += 1;
        let seq = *sent;
        let ops = keys
            .iter()
            .map(|k| LedgerOp::Settle {
                key: k.clone(),
                reserved_usd,
                actual_usd,
                seq,
            })
            .collect();
        let charge = Charge {
            holder: self.holder(),
            seq,
            usd: actual_usd,
            budgets: keys,
        };
        let unsent = Unsent {
            ops,
            tx: self.tx.clone(),
        };
        Some((charge, unsent))
    }

    /// Raise `e`, the escalation of the budget `sf` names, once for the cluster: claimed in
    /// the budget's record first (see the module). A budget chaos drained here is not the
    /// ledger's, so neither is its episode. Whether the keeper took it (else the caller
    /// raises `e` at once).
    pub(crate) fn raise_exhausted(&self, sf: &Shortfall, e: &Escalation) -> bool {
        if self.chaos.drained(sf.agent.as_deref()) {
            return false;
        }
        let refused = Refused {
            at_ms: e.created_at_ms,
            node: self.id.clone(),
            escalation: e.id.clone(),
            estimate_usd: sf.estimate_usd,
            remaining_usd: sf.remaining_usd,
        };
        let op = LedgerOp::Claim {
            key: key(&sf.owner()),
            refused,
            escalation: Box::new(e.clone()),
        };
        self.tx.send(op).is_ok()
    }

    /// Whose budget key `k` is, as the engine knows it.
    fn owner_of(&self, k: &str) -> Option<Owner> {
        self.pipeline
            .with(|e| e.state.budgets.iter().map(|(o, _)| o).find(|o| key(o) == k))
    }

    /// Mirror revision `revision` of key `k` into the engine unless a newer one is there already
    /// (this node's own write and the watch race), or chaos drained the budget here.
    pub(crate) fn mirror(&self, k: &str, revision: u64, l: &Ledger) {
        {
            let mut latest = lock(&self.latest);
            if latest.get(k).is_some_and(|(_, r)| revision <= *r) {
                return;
            }
            latest.insert(k.to_string(), (l.clone(), revision));
            // The share is what the newest record holds for this node (a lapsed lease holds
            // nothing), whoever wrote it.
            let now = now_ms();
            let held = l
                .holds
                .get(&self.holder())
                .filter(|h| h.until_ms > now)
                .map_or(0.0, |h| h.usd);
            let mut escrow = lock(&self.escrow);
            if held > 0.0 || escrow.contains_key(k) {
                escrow.entry(k.to_string()).or_default().held = held;
            }
        }
        if !self.chaos.drained(l.agent.as_deref()) {
            let now = now_ms();
            let owner = l.owner();
            self.pipeline
                .with(|e| mirror_into(e, &self.holder(), &owner, l, now));
        }
    }
}

impl Keeper {
    pub(crate) fn new(queue: Queue, node: Arc<Node>) -> Keeper {
        Keeper {
            node,
            rx: queue.0,
            store: None,
        }
    }

    /// The bucket, opened (or created) on first use; `None` while it cannot be.
    async fn ledger_store(&mut self) -> Option<kv::Store> {
        let store = &mut self.store;
        if store.is_none() {
            let open = crate::transport::store::ledger::open(self.node.bus.nats());
            match tokio::time::timeout(STORE_TIMEOUT * 2, open).await {
                Ok(Ok(s)) => *store = Some(s),
                Ok(Err(e)) => tracing::warn!(node = %self.node.id, "budget ledger: {e:#}"),
                Err(_) => {
                    tracing::warn!(node = %self.node.id, "budget ledger: no answer opening {}", crate::transport::subjects::BUDGETS_BUCKET);
                }
            }
        }
        store.clone()
    }

    /// Put the configured budgets in the ledger unless they are there already (the ledger is
    /// the truth once they are: limits changed by `oam budget set` and what was spent survive a
    /// restart), and mirror what the ledger holds.
    async fn seed_ledger(&self, store: &kv::Store) {
        let configured: Vec<(Owner, budget::Budget)> =
            self.node.cfg.budgets.iter().map(|(o, b)| (o, *b)).collect();
        for (owner, b) in configured {
            let k = key(&owner);
            let record = Ledger {
                since_ms: Some(now_ms()),
                on_exceeded: b.on_exceeded,
                overridden: b.overridden,
                ..Ledger::of(&owner, b.limit_usd)
            };
            let Ok(bytes) = serde_json::to_vec(&record) else {
                continue;
            };
            let _ = tokio::time::timeout(STORE_TIMEOUT, store.create(&k, bytes.into())).await;
        }
    }

    /// Apply ledger changes in batches until the node's last handle is gone; renew this
    /// node's holds; give back idle escrow (all of it once `stop` is cancelled); mirror the
    /// ledger until `stop`.
    pub(crate) async fn run(mut self, stop: CancellationToken) {
        tokio::spawn(super::reconcile::earlier_runs(
            self.node.clone(),
            stop.clone(),
        ));
        if let Some(store) = self.ledger_store().await {
            self.seed_ledger(&store).await;
            tokio::spawn(watch(self.node.clone(), store, stop.clone()));
        }
        let lease_ms = self.node.cfg.node.budget_lease_ms;
        // Renewals start at a random point of their period: nodes started together would
        // otherwise all write every key at the same moments.
        let period = Duration::from_millis((lease_ms / 3).max(1));
        let offset = {
            use std::hash::BuildHasher;
            let r = std::hash::RandomState::new().hash_one(now_ms());
            period.mul_f64((r % 1_000) as f64 / 1_000.0)
        };
        let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + offset, period);
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut idle = tokio::time::interval(Duration::from_millis(SHARE_IDLE_MS / 2));
        idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Settlements not written yet, oldest first, and when they are to be.
        let mut waiting: Vec<LedgerOp> = Vec::new();
        let mut due: Option<tokio::time::Instant> = None;
        let mut settle_every = SETTLE_EVERY;
        let mut held: BTreeMap<String, f64> = BTreeMap::new();
        let mut stopping = false;
        let counters = self.node.ledger.counters.clone();
        let mut in_order = InOrder::default();
        loop {
            let mut batch = Vec::new();
            let (mut renewing, mut idle_check) = (false, false);
            let wake = due.unwrap_or_else(tokio::time::Instant::now);
            tokio::select! {
                op = self.rx.recv() => match op {
                    Some(op) => in_order.admit(op, &mut batch),
                    None => return,
                },
                _ = renew.tick() => renewing = true,
                _ = idle.tick() => idle_check = true,
                () = tokio::time::sleep_until(wake), if due.is_some() => {}
                () = stop.cancelled(), if !stopping => {
                    stopping = true;
                    idle_check = true;
                }
            }
            while batch.len() < BATCH_MAX {
                match self.rx.try_recv() {
                    Ok(op) => in_order.admit(op, &mut batch),
                    Err(_) => break,
                }
            }
            in_order.overdue(&mut batch);
            let (settles, others): (Vec<LedgerOp>, Vec<LedgerOp>) = batch
                .into_iter()
                .partition(|op| matches!(op, LedgerOp::Settle { .. }));
            waiting.extend(settles);
            if !waiting.is_empty() && due.is_none() {
                due = Some(tokio::time::Instant::now() + settle_every);
            }
            let give_back = if idle_check {
                let idle_ms = if stopping { 0 } else { SHARE_IDLE_MS };
                self.node.ledger.idle_escrow(now_ms(), idle_ms)
            } else {
                Vec::new()
            };
            let renew_keys: Vec<String> = if renewing {
                held.iter()
                    .filter(|(_, v)| **v > 0.0)
                    .map(|(k, _)| k.clone())
                    .collect()
            } else {
                Vec::new()
            };
            // Settlements go with any write, or when due; alone they wait to share one.
            let writing = !others.is_empty() || !give_back.is_empty() || !renew_keys.is_empty();
            let settle = !waiting.is_empty()
                && (writing || stopping || due.is_some_and(|d| d <= tokio::time::Instant::now()));
            if !writing && !settle {
                continue;
            }
            let mut batch = if settle {
                due = None;
                std::mem::take(&mut waiting)
            } else {
                Vec::new()
            };
            batch.extend(others);
            let conflicts = counters.conflicts.load(Ordering::Relaxed);
            let mut failed = self
                .apply_batch(batch, &renew_keys, &give_back, &mut held)
                .await;
            settle_every = if counters.conflicts.load(Ordering::Relaxed) > conflicts {
                (settle_every * 2).min(SETTLE_MAX)
            } else {
                (settle_every - settle_every / 16).max(SETTLE_EVERY)
            };
            if !failed.is_empty() {
                failed.append(&mut waiting);
                waiting = failed;
                due = Some(tokio::time::Instant::now() + RETRY);
            }
            self.node
                .ledger
                .counters
                .unsettled
                .store(waiting.len() as u64, Ordering::Relaxed);
            // The ledger has everything, and took this batch's writes: local shares start
            // afresh. (A batch of renewals the ledger did not take, with no settlement waiting
            // yet, says nothing of attempts still spending a share: clearing it then let a
            // node size and draw a second share while the first was in flight.)
            if waiting.is_empty() && !self.node.ledger.failing.load(Ordering::Relaxed) {
                lock(&self.node.ledger.share).clear();
            }
        }
    }

    /// Apply one batch (and give back `give_back`: key, usd); returns the settlements that
    /// could not be written.
    async fn apply_batch(
        &mut self,
        batch: Vec<LedgerOp>,
        renew_keys: &[String],
        give_back: &[(String, f64)],
        held: &mut BTreeMap<String, f64>,
    ) -> Vec<LedgerOp> {
        let store = if self.node.bus.isolated() {
            None
        } else {
            self.ledger_store().await
        };
        let (claims, batch): (Vec<LedgerOp>, Vec<LedgerOp>) = batch
            .into_iter()
            .partition(|op| matches!(op, LedgerOp::Claim { .. }));
        for op in claims {
            if let LedgerOp::Claim {
                key,
                refused,
                escalation,
            } = op
            {
                self.claim_and_raise(store.as_ref(), &key, refused, &escalation)
                    .await;
            }
        }
        let ledgers = &self.node.ledger;
        let (mut reserves, mut phase1, settles) = plan(batch, renew_keys, give_back);
        let Some(store) = store else {
            ledgers.failing.store(true, Ordering::Relaxed);
            for (k, changes) in &phase1 {
                ledgers.written(k, changes, false);
            }
            for r in reserves {
                let _ = r.reply.send(Ruling::Unreachable);
            }
            return settles;
        };
        // Phase 1: every settlement, and reservations in the narrowest kind of budget (drawn
        // on this node's escrow, what it lacks asked of the ledger); then each wider kind in
        // turn for the reservations the narrower granted. A reservation not granted gives back
        // what it drew.
        let (parts, now) = (ledgers.share_parts(), now_ms());
        let mut failed: Vec<String> = Vec::new();
        for (i, kind) in budget::Kind::ALL.into_iter().enumerate() {
            let mut phase = if i == 0 {
                std::mem::take(&mut phase1)
            } else {
                Plan::new()
            };
            let key_of = |a: &Ask| a.keys.iter().find(|k| kind_of(k) == kind).cloned();
            ledgers.draw_escrow(&mut phase, &mut reserves, key_of, parts, now);
            if !phase.is_empty() {
                self.apply_keys(
                    &store,
                    phase,
                    &mut reserves,
                    &mut failed,
                    held,
                    kind.refusal(),
                )
                .await;
            }
        }
        ledgers.failing.store(!failed.is_empty(), Ordering::Relaxed);
        for r in reserves {
            if r.answer != Ruling::Held {
                ledgers.undraw(&r.drew, r.usd, 0.0);
            }
            let answer = if r.answer == Ruling::Held && r.audited {
                Ruling::Audited
            } else {
                r.answer
            };
            // A request that went away meanwhile (its caller gave up) never uses what was held
            // for it: give it back, or the node would renew that hold for as long as it lives.
            if r.reply.send(answer).is_err() && r.answer == Ruling::Held {
                let _ = ledgers.settle(
                    Hold {
                        keys: r.keys,
                        usd: r.usd,
                        local: false,
                    },
                    0.0,
                );
            }
        }
        // Settlements on keys whose write failed wait for the next batch.
        settles
            .into_iter()
            .filter(|op| matches!(op, LedgerOp::Settle { key, .. } if failed.contains(key)))
            .collect()
    }

    /// Claim the exhaustion episode of key `k` for `refused` and raise its escalation unless
    /// another node's claim was there first. Without a ledger to claim in (unreachable, no
    /// record) it is raised: a human hearing twice beats hearing nothing.
    async fn claim_and_raise(
        &self,
        store: Option<&kv::Store>,
        k: &str,
        refused: Refused,
        e: &Escalation,
    ) {
        let claimed = match store {
            Some(store) => self.claim(store, k, refused).await,
            None => None,
        };
        if claimed == Some(false) {
            let c = &self.node.ledger.counters;
            c.episodes_joined.fetch_add(1, Ordering::Relaxed);
            tracing::info!(node = %self.node.id, key = k, escalation = %e.id, "budget exhaustion already escalated by another node");
            return;
        }
        self.node.escalations.raise(e);
    }

    /// Write `refused` into `k`'s record unless an episode is there already: whether it was
    /// written, or `None` when the record could not be read or written.
    async fn claim(&self, store: &kv::Store, k: &str, refused: Refused) -> Option<bool> {
        for _ in 0..CAS_TRIES {
            let entry = tokio::time::timeout(STORE_TIMEOUT, store.entry(k))
                .await
                .ok()?
                .ok()??;
            if entry.operation != kv::Operation::Put {
                return None;
            }
            let mut ledger: Ledger = serde_json::from_slice(&entry.value).ok()?;
            if ledger.refused.is_some() {
                return Some(false);
            }
            ledger.refused = Some(refused.clone());
            let bytes: bytes::Bytes = serde_json::to_vec(&ledger).ok()?.into();
            let update = store.update(k, bytes, entry.revision);
            match tokio::time::timeout(STORE_TIMEOUT, update).await.ok()? {
                Ok(revision) => {
                    self.node.ledger.mirror(k, revision, &ledger);
                    return Some(true);
                }
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(_) => return None,
            }
        }
        None
    }

    /// Apply each key's changes in one compare-and-swap. Reservations answer in `reserves`
    /// (refused with `refusal`, or unreachable if the key could not be written); keys that
    /// could not be written are added to `failed`.
    async fn apply_keys(
        &self,
        store: &kv::Store,
        by_key: BTreeMap<String, Vec<(Option<usize>, LedgerChange)>>,
        reserves: &mut [Ask],
        failed: &mut Vec<String>,
        held: &mut BTreeMap<String, f64>,
        refusal: ReasonCode,
    ) {
        for (k, changes) in by_key {
            match self.cas(store, &k, &changes).await {
                Some((ledger, granted, revision)) => {
                    for ((i, _), grant) in changes.iter().zip(granted) {
                        if let Some(i) = i {
                            match grant {
                                Grant::No => reserves[*i].answer = Ruling::Refused(refusal),
                                Grant::PastLimit => reserves[*i].audited = true,
                                Grant::Yes => {}
                            }
                        }
                    }
                    let mine = ledger
                        .holds
                        .get(&self.node.ledger.holder())
                        .map_or(0.0, |h| h.usd);
                    held.insert(k.clone(), mine);
                    self.node.ledger.mirror(&k, revision, &ledger);
                    self.node.ledger.written(&k, &changes, true);
                }
                None => {
                    self.node.ledger.written(&k, &changes, false);
                    for (i, _) in &changes {
                        if let Some(i) = i {
                            reserves[*i].answer = Ruling::Unreachable;
                        }
                    }
                    failed.push(k);
                }
            }
        }
    }

    /// One key's read-modify-write, retried on conflicts: the ledger written, and for each
    /// change whether it was granted. `None` if the ledger did not answer or kept conflicting.
    async fn cas(
        &self,
        store: &kv::Store,
        k: &str,
        changes: &[(Option<usize>, LedgerChange)],
    ) -> Option<(Ledger, Vec<Grant>, u64)> {
        // Every write reads the record first, as fresh as the store has it. The watch's copy
        // saved that round trip, but on a busy machine it is a few milliseconds behind the
        // others' writes: at 5 nodes 6% of all writes conflicted on it. Writes are few (one
        // per escrow and per settlement, not per request): a round trip more each is cheap.
        let holder = self.node.ledger.holder();
        for _ in 0..CAS_TRIES {
            let entry = tokio::time::timeout(STORE_TIMEOUT, store.entry(k))
                .await
                .ok()?
                .ok()?;
            let (mut ledger, revision) = match entry {
                Some(e) if e.operation == kv::Operation::Put => {
                    match serde_json::from_slice::<Ledger>(&e.value) {
                        Ok(l) => (l, Some(e.revision)),
                        Err(err) => {
                            tracing::error!(node = %self.node.id, key = k, "budget ledger record unreadable: {err}");
                            return None;
                        }
                    }
                }
                other => {
                    // No record (yet, or removed): the engine's budget starts one.
                    let owner = self.node.ledger.owner_of(k)?;
                    let b = self
                        .node
                        .pipeline
                        .with(|e| e.state.budgets.get(owner.kind, &owner.name).copied())?;
                    (
                        Ledger {
                            since_ms: Some(now_ms()),
                            on_exceeded: b.on_exceeded,
                            overridden: b.overridden,
                            ..Ledger::of(&owner, b.limit_usd)
                        },
                        other.map(|e| e.revision),
                    )
                }
            };
            let now = now_ms();
            let lease = self.node.cfg.node.budget_lease_ms;
            let granted = apply_changes(&mut ledger, &holder, changes, now, lease);
            let bytes: bytes::Bytes = serde_json::to_vec(&ledger).ok()?.into();
            let no_answer = || format!("no answer within {} ms", STORE_TIMEOUT.as_millis());
            let written = match revision {
                Some(r) => {
                    match tokio::time::timeout(STORE_TIMEOUT, store.update(k, bytes, r)).await {
                        Err(_) => Err((false, no_answer())),
                        Ok(w) => w.map_err(|e| {
                            (
                                e.kind() == kv::UpdateErrorKind::WrongLastRevision,
                                e.to_string(),
                            )
                        }),
                    }
                }
                None => match tokio::time::timeout(STORE_TIMEOUT, store.create(k, bytes)).await {
                    Err(_) => Err((false, no_answer())),
                    Ok(w) => w.map_err(|e| {
                        (
                            e.kind() == kv::CreateErrorKind::AlreadyExists,
                            e.to_string(),
                        )
                    }),
                },
            };
            match written {
                Ok(revision) => {
                    self.node.store_faults.ok("ledger");
                    let c = &self.node.ledger.counters;
                    c.written.fetch_add(1, Ordering::Relaxed);
                    return Some((ledger, granted, revision));
                }
                // Another node wrote first: read again.
                Err((true, _)) => {
                    let c = &self.node.ledger.counters;
                    c.conflicts.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Err((false, why)) => {
                    self.node.store_faults.failed("ledger", why);
                    return None;
                }
            }
        }
        tracing::warn!(node = %self.node.id, key = k, "budget ledger: {CAS_TRIES} conflicting writes in a row");
        None
    }
}

/// How often the ledger watch looks whether NATS reconnected (see `watch`).
const RECONNECT_POLL: Duration = Duration::from_millis(250);

/// Mirror every budget (its last record first, then every change, this node's and the
/// others') into the engine (`transport::store::watch`: no push consumer, whose flow control a
/// forged status message could turn into writes).
async fn watch(node: Arc<Node>, store: kv::Store, stop: CancellationToken) {
    use futures_util::StreamExt;
    loop {
        let opened =
            tokio::time::timeout(STORE_TIMEOUT * 2, crate::transport::store::watch(&store)).await;
        let Ok(Ok(changes)) = opened else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let mut changes = std::pin::pin!(changes);
        // A server that restarted lost the consumer behind the watch; the client may take long
        // to find out (measured: 4-9 s, up to 30 s), and meanwhile the budgets it mirrors go
        // stale. After a reconnect the watch is opened again at once.
        let reconnected = crate::transport::connect::reconnected(node.bus.nats(), RECONNECT_POLL);
        let mut reconnected = std::pin::pin!(reconnected);
        loop {
            let next = tokio::select! {
                n = changes.next() => n,
                () = &mut reconnected => {
                    tracing::info!(node = %node.id, "budget ledger: NATS reconnected; watching again");
                    break;
                }
                () = stop.cancelled() => return,
            };
            let Some(entry) = next else {
                break;
            };
            if entry
                .key
                .starts_with(crate::transport::store::ledger::PROBES_PREFIX)
            {
                continue; // what probes cost: no agent's budget (`node::health`)
            }
            match entry.operation {
                kv::Operation::Put => {
                    let Ok(l) = serde_json::from_slice::<Ledger>(&entry.value) else {
                        tracing::warn!(node = %node.id, key = %entry.key, "budget ledger record unreadable; ignored");
                        continue;
                    };
                    node.ledger.mirror(&entry.key, entry.revision, &l);
                }
                kv::Operation::Delete | kv::Operation::Purge => {
                    if let Some(owner) = node.ledger.owner_of(&entry.key) {
                        node.pipeline.with(|e| e.state.budgets.remove(&owner));
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Each key's changes in one batch, in order; a reservation's change points at its `Ask`.
type Plan = BTreeMap<String, Vec<(Option<usize>, LedgerChange)>>;

/// Plan a batch's first phase: every settlement, in arrival order, and the give-backs
/// (key, usd) and renewals of `renew_keys`, by key; the reservations (all answered `Held` until
/// the ledger says otherwise, drawn on escrow by `Ledgers::draw_escrow`) and the settlements,
/// kept to retry those whose key fails.
fn plan(
    batch: Vec<LedgerOp>,
    renew_keys: &[String],
    give_back: &[(String, f64)],
) -> (Vec<Ask>, Plan, Vec<LedgerOp>) {
    let mut reserves: Vec<Ask> = Vec::new();
    let mut phase1 = Plan::new();
    let mut settles: Vec<LedgerOp> = Vec::new();
    for op in batch {
        match op {
            LedgerOp::Reserve { keys, usd, reply } => reserves.push(Ask {
                keys,
                usd,
                reply,
                answer: Ruling::Held,
                audited: false,
                drew: Vec::new(),
            }),
            LedgerOp::Settle {
                ref key,
                reserved_usd,
                actual_usd,
                seq,
            } => {
                phase1.entry(key.clone()).or_default().push((
                    None,
                    LedgerChange::Settle(reserved_usd, actual_usd, Some(seq)),
                ));
                settles.push(op);
            }
            LedgerOp::Claim { .. } | LedgerOp::Settlement { .. } => {}
        }
    }
    for (k, usd) in give_back {
        phase1
            .entry(k.clone())
            .or_default()
            .push((None, LedgerChange::Settle(*usd, 0.0, None)));
    }
    for k in renew_keys {
        phase1
            .entry(k.clone())
            .or_default()
            .push((None, LedgerChange::Renew));
    }
    (reserves, phase1, settles)
}

/// `Ledgers::draw_escrow` on `escrow`; unless `trusted`, every ask is written (the ledger took
/// none of the last writes: what it holds is not drawn on without one).
fn draw(
    escrow: &mut BTreeMap<String, Escrow>,
    plan: &mut Plan,
    asks: &mut [Ask],
    key_of: impl Fn(&Ask) -> Option<String>,
    parts: u32,
    now: u64,
    trusted: bool,
) {
    // Per key: the largest ask, and what was asked of the ledger.
    let mut caps: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for (i, a) in asks.iter_mut().enumerate() {
        let Some(k) = key_of(a).filter(|_| a.answer == Ruling::Held) else {
            continue;
        };
        let e = escrow.entry(k.clone()).or_default();
        // What the escrow covers, counting what this pass asks the ledger for already.
        let asked = caps.get(&k).map_or(0.0, |(_, asked)| *asked);
        let covered = if trusted { e.free() + asked } else { 0.0 };
        let need = round_usd(a.usd - covered.min(a.usd));
        e.drawn = round_usd(e.drawn + a.usd);
        e.used_ms = now;
        a.drew.push(k.clone());
        if need > EPSILON_USD {
            plan.entry(k.clone())
                .or_default()
                .push((Some(i), LedgerChange::Reserve(need)));
            let (largest, asked) = caps.entry(k).or_insert((0.0, 0.0));
            *largest = largest.max(a.usd);
            *asked += need;
        }
    }
    for (k, (largest, _)) in caps {
        let e = escrow.entry(k.clone()).or_default();
        // Doubled while a share lasts less than a second; kept once one lasts longer (an idle
        // escrow given back starts again from `SHARE_REQUESTS`).
        let soon = now.saturating_sub(e.topped_ms) < SHARE_IDLE_MS;
        e.factor = match e.factor {
            f if f <= 0.0 => SHARE_REQUESTS,
            f if soon => (f * 2.0).min(SHARE_REQUESTS_MAX),
            f => f,
        };
        e.topped_ms = now;
        let cap = largest * e.factor;
        plan.entry(k)
            .or_default()
            .push((None, LedgerChange::Extra { parts, cap }));
    }
}

/// Whether a record granted one change.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Grant {
    Yes,
    No,
    /// Past the limit, by a budget in audit mode.
    PastLimit,
}

/// Apply one key's changes to its record, in order, as `holder` at `now`: whether each was
/// granted (a settlement always is).
fn apply_changes(
    ledger: &mut Ledger,
    holder: &str,
    changes: &[(Option<usize>, LedgerChange)],
    now: u64,
    lease_ms: u64,
) -> Vec<Grant> {
    let yes = |ok: bool| if ok { Grant::Yes } else { Grant::No };
    changes
        .iter()
        .map(|(_, c)| match *c {
            LedgerChange::Reserve(usd) => {
                let before = ledger.would_refuse;
                match ledger.reserve(holder, usd, now, lease_ms) {
                    true if ledger.would_refuse > before => Grant::PastLimit,
                    ok => yes(ok),
                }
            }
            LedgerChange::Settle(r, a, Some(seq)) => {
                ledger.settle_once(holder, seq, r, a, now);
                Grant::Yes
            }
            LedgerChange::Settle(r, a, None) => {
                ledger.settle(holder, r, a, now);
                Grant::Yes
            }
            LedgerChange::Renew => yes(ledger.renew(holder, now, lease_ms)),
            LedgerChange::Extra { parts, cap } => {
                let usd = ledger.share_extra(now, parts, cap);
                yes(usd <= 0.0 || ledger.reserve(holder, usd, now, lease_ms))
            }
        })
        .collect()
}

/// The hold an attempt carries goes back when it settles; the engine gives back its own
/// reservation at the same time. `ended`: the call ended the attempt the hold was for (its
/// result, or its withdrawal), even if another attempt is now waiting to start (that one
/// reserves its own).
pub(crate) fn settle_after(
    ledgers: &Ledgers,
    hold: &mut Option<Hold>,
    session: &Session,
    cost_before: f64,
    ended: bool,
) -> Option<(Charge, Unsent)> {
    if session.dispatched() && !ended {
        return None;
    }
    let h = hold.take()?;
    ledgers.settle(h, round_usd((session.cost_usd() - cost_before).max(0.0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reserve(agent_key: Option<&str>, global: bool, usd: f64) -> LedgerOp {
        let (reply, _) = oneshot::channel();
        let keys = agent_key
            .map(String::from)
            .into_iter()
            .chain(global.then(|| "global".to_string()))
            .collect();
        LedgerOp::Reserve { keys, usd, reply }
    }

    /// An ask's key of `kind`.
    fn of_kind(kind: budget::Kind) -> impl Fn(&Ask) -> Option<String> {
        move |a| a.keys.iter().find(|k| kind_of(k) == kind).cloned()
    }

    #[test]
    fn nodes_cut_off_together_spend_at_most_what_was_left() {
        // Three nodes lose the ledger together with $0.003 left of an agent's $10 budget (the
        // whole global one left): each may spend a third of what it saw left, not a third of
        // the limit, so together they stay within it.
        let covering = [("agent.a".to_string(), 0.003), ("global".to_string(), 90.0)];
        let mut spent = 0.0_f64;
        for _node in 0..3 {
            let mut shares = BTreeMap::new();
            while take_local(&mut shares, &covering, 3, 0.0002) {
                spent += 0.0002;
            }
            assert_eq!(shares["agent.a"].size, 0.001);
            assert_eq!(shares["global"].size, 30.0);
        }
        assert!(spent <= 0.003 + 1e-9, "{spent}");
        assert!(
            (spent - 0.0030).abs() < 0.0007,
            "each spent its share: {spent}"
        );
        // A share is sized once: seeing more left later does not grow it, and a draw that
        // one budget cannot cover takes from none.
        let mut shares = BTreeMap::new();
        assert!(take_local(&mut shares, &covering, 3, 0.0009));
        let more = [("agent.a".to_string(), 5.0), ("global".to_string(), 90.0)];
        assert!(!take_local(&mut shares, &more, 3, 0.0002));
        assert_eq!(shares["global"].used, 0.0009, "{shares:?}");
        assert!(take_local(&mut shares, &more, 3, 0.0001));
        // Nothing left, nothing to spend.
        let mut shares = BTreeMap::new();
        assert!(!take_local(
            &mut shares,
            &[("agent.a".into(), 0.0)],
            1,
            1e-6
        ));
    }

    #[test]
    fn settlements_held_back_are_applied_in_their_numbers_order() {
        let settle = |key: &str, seq| LedgerOp::Settle {
            key: key.into(),
            reserved_usd: 0.0,
            actual_usd: 0.01,
            seq,
        };
        let order = |out: &[LedgerOp]| -> Vec<(String, u64)> {
            out.iter()
                .filter_map(|op| match op {
                    LedgerOp::Settle { key, seq, .. } => Some((key.clone(), *seq)),
                    _ => None,
                })
                .collect()
        };
        // A settlement of both budgets, as `Unsent` sends it.
        let both = |seq| LedgerOp::Settlement {
            seq,
            settles: vec![settle("agent.a", seq), settle("global", seq)],
        };
        let mut in_order = InOrder::default();
        let mut out = Vec::new();
        // 1, then 3 (2's record is not written yet), then 2.
        for op in [both(1), both(3), reserve(None, true, 0.5)] {
            in_order.admit(op, &mut out);
        }
        assert_eq!(
            order(&out),
            vec![("agent.a".into(), 1), ("global".into(), 1)],
            "3 waits for 2"
        );
        assert_eq!(out.len(), 3, "anything else passes at once");
        out.clear();
        in_order.admit(both(2), &mut out);
        assert_eq!(
            order(&out),
            vec![
                ("agent.a".into(), 2),
                ("global".into(), 2),
                ("agent.a".into(), 3),
                ("global".into(), 3)
            ],
            "each budget's in order"
        );
        // A number that never comes holds the later ones only so long.
        out.clear();
        in_order.admit(
            LedgerOp::Settlement {
                seq: 5,
                settles: vec![settle("global", 5)],
            },
            &mut out,
        );
        in_order.overdue(&mut out);
        assert!(out.is_empty());
        in_order.waiting_since = Some(tokio::time::Instant::now() - IN_ORDER_WAIT);
        in_order.overdue(&mut out);
        assert_eq!(order(&out), vec![("global".into(), 5)]);
        assert_eq!(in_order.next, 6);
    }

    #[test]
    fn a_batch_is_planned_by_key_in_arrival_order() {
        let settle = |seq| LedgerOp::Settle {
            key: "agent.a".into(),
            reserved_usd: 0.1,
            actual_usd: 0.05,
            seq,
        };
        let batch = vec![
            reserve(Some("agent.a"), true, 0.5),
            settle(3),
            settle(4),
            reserve(None, true, 0.25),
        ];
        let back = [("agent.b".to_string(), 0.3)];
        let (reserves, plan, settles) = plan(batch, &["global".to_string()], &back);
        assert_eq!(reserves.len(), 2);
        assert!(reserves.iter().all(|r| r.answer == Ruling::Held));
        assert_eq!(
            plan["agent.a"],
            vec![
                (None, LedgerChange::Settle(0.1, 0.05, Some(3))),
                (None, LedgerChange::Settle(0.1, 0.05, Some(4)))
            ],
            "one key's settlements in the order they came (reservations are drawn apart)"
        );
        assert_eq!(
            plan["agent.b"],
            vec![(None, LedgerChange::Settle(0.3, 0.0, None))]
        );
        assert_eq!(plan["global"], vec![(None, LedgerChange::Renew)]);
        assert_eq!(settles.len(), 2, "kept to retry if their key fails");
    }

    #[test]
    fn reservations_draw_on_escrow_and_ask_the_ledger_only_for_what_it_lacks() {
        let mut escrow = BTreeMap::new();
        escrow.insert(
            "agent.a".to_string(),
            Escrow {
                held: 1.0,
                drawn: 0.2,
                unwritten: 0.1,
                ..Escrow::default()
            },
        );
        let batch = vec![
            reserve(Some("agent.a"), true, 0.5),
            reserve(Some("agent.a"), true, 0.5),
            reserve(Some("agent.b"), false, 0.01),
            reserve(None, true, 0.25),
        ];
        let (mut asks, _, _) = plan(batch, &[], &[]);
        let mut phase1 = Plan::new();
        draw(
            &mut escrow,
            &mut phase1,
            &mut asks,
            of_kind(budget::Kind::Agent),
            8,
            7,
            true,
        );
        assert_eq!(
            phase1["agent.a"],
            vec![
                (Some(1), LedgerChange::Reserve(0.3)),
                (
                    None,
                    LedgerChange::Extra {
                        parts: 8,
                        cap: 512.0
                    }
                )
            ],
            "0.7 free: the first is covered, the second lacks 0.3; then a new escrow"
        );
        assert_eq!(
            phase1["agent.b"],
            vec![
                (Some(2), LedgerChange::Reserve(0.01)),
                (
                    None,
                    LedgerChange::Extra {
                        parts: 8,
                        cap: 10.24
                    }
                )
            ]
        );
        assert_eq!(
            escrow["agent.a"].drawn, 1.2,
            "both drawn until the ledger says"
        );
        assert_eq!(escrow["agent.a"].used_ms, 7);
        // The ledger refused the second: the global phase asks only for the others.
        asks[1].answer = Ruling::Refused(ReasonCode::BudgetExhausted);
        let mut phase2 = Plan::new();
        let global = of_kind(budget::Kind::Global);
        draw(&mut escrow, &mut phase2, &mut asks, global, 8, 7, true);
        assert_eq!(
            phase2["global"],
            vec![
                (Some(0), LedgerChange::Reserve(0.5)),
                (Some(3), LedgerChange::Reserve(0.25)),
                (
                    None,
                    LedgerChange::Extra {
                        parts: 8,
                        cap: 512.0
                    }
                )
            ],
            "not for a refused one, nor for one without a global budget"
        );
        let drew: Vec<_> = asks.iter().map(|a| a.drew.len()).collect();
        assert_eq!(
            drew,
            [2, 1, 1, 1],
            "what each gives back if it is not granted"
        );
        // Run out again within a second: the next share is sized for twice as many.
        let (mut asks, _, _) = plan(vec![reserve(Some("agent.b"), false, 0.01)], &[], &[]);
        let mut again = Plan::new();
        escrow.get_mut("agent.b").unwrap().drawn = 0.0;
        draw(
            &mut escrow,
            &mut again,
            &mut asks,
            of_kind(budget::Kind::Agent),
            8,
            500,
            true,
        );
        assert_eq!(
            again["agent.b"][1],
            (
                None,
                LedgerChange::Extra {
                    parts: 8,
                    cap: 20.48
                }
            )
        );
        // One that lasted longer keeps its size.
        let (mut asks, _, _) = plan(vec![reserve(Some("agent.b"), false, 0.01)], &[], &[]);
        let mut later = Plan::new();
        escrow.get_mut("agent.b").unwrap().drawn = 0.0;
        draw(
            &mut escrow,
            &mut later,
            &mut asks,
            of_kind(budget::Kind::Agent),
            8,
            5_000,
            true,
        );
        assert_eq!(later["agent.b"][1], again["agent.b"][1]);
        // A ledger that took none of the last writes: even a covered ask is written.
        let (mut asks, _, _) = plan(vec![reserve(Some("agent.c"), false, 0.1)], &[], &[]);
        escrow.insert(
            "agent.c".into(),
            Escrow {
                held: 5.0,
                ..Escrow::default()
            },
        );
        let mut untrusted = Plan::new();
        draw(
            &mut escrow,
            &mut untrusted,
            &mut asks,
            of_kind(budget::Kind::Agent),
            8,
            7,
            false,
        );
        assert_eq!(
            untrusted["agent.c"][0],
            (Some(0), LedgerChange::Reserve(0.1))
        );
    }

    #[test]
    fn one_record_grants_changes_in_order_up_to_its_limit() {
        let mut l = Ledger::new(1.0);
        let (now, lease) = (1_000, 5_000);
        let changes = [
            (Some(0), LedgerChange::Reserve(0.6)),
            (Some(1), LedgerChange::Reserve(0.6)),
            (None, LedgerChange::Settle(0.6, 0.2, Some(1))),
            (Some(2), LedgerChange::Reserve(0.6)),
            (None, LedgerChange::Renew),
        ];
        let granted = apply_changes(&mut l, "n1#r", &changes, now, lease);
        assert_eq!(
            granted,
            [Grant::Yes, Grant::No, Grant::Yes, Grant::Yes, Grant::Yes]
        );
        assert!((l.remaining_usd(now) - 0.2).abs() < 1e-9, "{l:?}");
    }

    /// A record of `limit` with `holds` (holder, usd), as another node would have written it.
    fn record(limit: f64, holds: &[(&str, f64)]) -> bytes::Bytes {
        let mut l = Ledger {
            agent: Some("a".into()),
            ..Ledger::new(limit)
        };
        for (h, usd) in holds {
            assert!(l.reserve(h, *usd, now_ms(), 60_000));
        }
        serde_json::to_vec(&l).expect("JSON").into()
    }

    #[tokio::test]
    async fn a_write_that_lost_a_race_decides_again_on_the_winners_record() {
        let mesh = crate::local::mesh::LocalMesh::start()
            .await
            .expect("a nats-server (OAM_NATS_SERVER, or scripts/install-test-tools)");
        let nats = mesh.connect("ledger-test").await.expect("connected");
        let toml = "[budgets.agents.a]\nlimit_usd = 1.0\n";
        let cfg = super::super::config::NodeConfig::parse("t.toml", toml, "http://127.0.0.1:1")
            .expect("a config");
        let (node, services) = Node::new("n1".into(), cfg, nats).expect("a node");
        let mut keeper = Keeper::new(services.ledger, node.clone());
        let store = keeper.ledger_store().await.expect("the ledger's bucket");
        let k = key(&Owner::agent("a"));

        // Another node wrote since the record was made: it holds 0.8 of the 1.0.
        let seen = store.create(&k, record(1.0, &[])).await.expect("created");
        let won = store
            .update(&k, record(1.0, &[("n2#1", 0.8)]), seen)
            .await
            .expect("updated");

        let reserve = |usd| vec![(Some(0), LedgerChange::Reserve(usd))];
        let (l, granted, revision) = keeper
            .cas(&store, &k, &reserve(0.5))
            .await
            .expect("written");
        assert_eq!(
            granted,
            [Grant::No],
            "0.5 more would pass the limit with the other node's 0.8"
        );
        assert!(revision > won, "written after the winner, not over it");
        let holds: Vec<&str> = l.holds.keys().map(String::as_str).collect();
        assert_eq!(holds, ["n2#1"], "the winner's hold is kept");

        let (l, granted, _) = keeper
            .cas(&store, &k, &reserve(0.15))
            .await
            .expect("written");
        assert_eq!(granted, [Grant::Yes]);
        let stored: Ledger =
            serde_json::from_slice(&store.get(&k).await.expect("read").expect("a record"))
                .expect("a ledger");
        assert_eq!(stored, l, "what cas returns is what the bucket holds");
        assert_eq!(stored.holds[&node.ledger.holder()].usd, 0.15);
        assert_eq!(stored.holds["n2#1"].usd, 0.8);

        // The settlement's write is taken but its acknowledgement lost: the keeper writes the
        // same settlement again, on the record that already holds it. It is charged once.
        let settle = vec![(None, LedgerChange::Settle(0.15, 0.1, Some(7)))];
        let (once, _, _) = keeper.cas(&store, &k, &settle).await.expect("written");
        let (again, _, _) = keeper.cas(&store, &k, &settle).await.expect("written");
        assert!((once.spent_usd - 0.1).abs() < 1e-9, "{once:?}");
        assert_eq!(again.spent_usd, once.spent_usd, "charged once: {again:?}");
        assert_eq!(again.settled[&node.ledger.holder()].seq, 7);
    }
}
