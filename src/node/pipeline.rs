//! The node's one core engine (`core::pipeline::Engine`) behind one lock, and the queued
//! requests it wakes: a request granted a slot is woken by ticket, exactly once.

use crate::core::pipeline::Engine;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::oneshot;

/// A cheap handle to the engine; every clone is the same engine.
#[derive(Clone)]
pub(crate) struct Pipeline(Arc<Inner>);

struct Inner {
    engine: Mutex<Engine>,
    /// Queued requests by ticket, woken one each when the engine grants them a slot.
    waiters: Mutex<HashMap<u64, oneshot::Sender<()>>>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a panic elsewhere mid-update; the data is still the best we have.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Pipeline {
    pub(crate) fn new(engine: Engine) -> Pipeline {
        Pipeline(Arc::new(Inner {
            engine: Mutex::new(engine),
            waiters: Mutex::default(),
        }))
    }

    /// The engine, to read (nothing it grants while held is woken: change it with `with`).
    pub(crate) fn read(&self) -> MutexGuard<'_, Engine> {
        lock(&self.0.engine)
    }

    /// Run `f` on the engine, then wake exactly the queued requests it granted a slot (a slot
    /// freed by `f` goes to the oldest waiter of its class, and only that one is woken).
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Engine) -> R) -> R {
        let mut e = lock(&self.0.engine);
        let out = f(&mut e);
        let granted = e.take_granted();
        if !granted.is_empty() {
            let mut waiters = lock(&self.0.waiters);
            for ticket in granted {
                if let Some(tx) = waiters.remove(&ticket) {
                    // A waiter that is gone is not lost: its guard hands the slot on.
                    let _ = tx.send(());
                }
            }
        }
        out
    }

    /// Be woken when `ticket` is granted a slot. Called under the same engine lock that queued
    /// it (inside `with`), so no grant can come before the waiter is there.
    pub(crate) fn wait_for_slot(&self, ticket: u64) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        lock(&self.0.waiters).insert(ticket, tx);
        rx
    }

    /// Forget a waiter that left its queue.
    pub(crate) fn forget_waiter(&self, ticket: u64) {
        lock(&self.0.waiters).remove(&ticket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::pipeline::Step;
    use crate::core::pipeline::tests::{T0, engine, req};
    use crate::core::record::Call;

    /// One slot for normal requests, so the second one queues.
    fn one_slot() -> Pipeline {
        let mut e = engine();
        e.config.bulkheads.normal = crate::core::bulkhead::ClassLimits {
            concurrency: 1,
            queue: 4,
        };
        Pipeline::new(e)
    }

    #[test]
    fn a_freed_slot_wakes_exactly_the_request_it_goes_to() {
        let p = one_slot();
        let (mut first, _) = p.with(|e| e.begin(req("a"), T0)).expect("admitted");
        let mut queued = Vec::new();
        for id in ["b", "c"] {
            let (s, step) = p.with(|e| e.begin(req(id), T0)).expect("admitted");
            assert!(matches!(step, Step::Queued), "{id} waits for the slot");
            let rx = p.wait_for_slot(s.ticket().expect("a ticket"));
            queued.push((s, rx));
        }
        p.with(|e| e.drop_session(&mut first));
        let mut rxs = queued.into_iter().map(|(_, rx)| rx);
        let (mut b, mut c) = (rxs.next().expect("b"), rxs.next().expect("c"));
        assert_eq!(b.try_recv(), Ok(()), "the oldest waiter is woken");
        assert!(c.try_recv().is_err(), "the other one still waits");
    }

    #[test]
    fn a_waiter_that_left_is_not_woken_and_its_slot_goes_on() {
        let p = one_slot();
        let (mut first, _) = p.with(|e| e.begin(req("a"), T0)).expect("admitted");
        let (mut gone, _) = p.with(|e| e.begin(req("b"), T0)).expect("admitted");
        let ticket = gone.ticket().expect("queued");
        let rx = p.wait_for_slot(ticket);
        p.forget_waiter(ticket);
        drop(rx);
        let left = p.with(|e| e.apply(&mut gone, Call::Abandon, T0 + 1));
        assert!(matches!(left, Some(Step::Done(_))), "{left:?}");
        let (third, step) = p.with(|e| e.begin(req("c"), T0 + 2)).expect("admitted");
        assert!(matches!(step, Step::Queued));
        let mut rx = p.wait_for_slot(third.ticket().expect("queued"));
        p.with(|e| e.drop_session(&mut first));
        assert_eq!(rx.try_recv(), Ok(()), "the next waiter gets the slot");
    }
}
