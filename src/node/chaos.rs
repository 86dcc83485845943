//! Faults a node applies to itself (`oam chaos isolate-node`, `drain-budget`, and provider
//! faults on targets no simulator serves, into its own calls of them), each ended by its own
//! timer at its expiry or by a restore: [`Chaos`] is the handle (the HTTP restore and
//! the ledger use it), [`Commands`] the service that hears the warden on NATS.

use super::bus::Bus;
use super::pipeline::{Pipeline, lock};
use crate::clock::now_ms;
use crate::core::budget::Budget;
use crate::core::chaos::NodeCommand;
use crate::transport::published::subscribe;
use crate::transport::subjects;
use futures_util::StreamExt;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Budgets drained by chaos: per agent, its limit before the first drain (none when it had no
/// budget) and the drain faults holding it. Only the limit changes, so spending in flight is
/// still accounted.
#[derive(Default, Debug)]
pub(crate) struct Drains(BTreeMap<String, (Option<f64>, BTreeSet<String>)>);

impl Drains {
    /// Fault `id` drains `agent`, whose budget is `budget` now: the budget it has while
    /// drained (nothing left: the limit drops to what is spent or reserved).
    pub(crate) fn drain(&mut self, id: &str, agent: &str, budget: Option<Budget>) -> Budget {
        let held = self
            .0
            .entry(agent.to_string())
            .or_insert_with(|| (budget.map(|b| b.limit_usd), BTreeSet::new()));
        held.1.insert(id.to_string());
        let b = budget.unwrap_or(Budget::new(0.0));
        Budget {
            limit_usd: b.spent_usd + b.reserved_usd,
            ..b
        }
    }

    /// Fault `id` ends: the agents no fault drains any more, each with the limit to give back
    /// (none: it had no budget before).
    pub(crate) fn end(&mut self, id: &str) -> Vec<(String, Option<f64>)> {
        let ended: Vec<String> = self
            .0
            .iter_mut()
            .filter_map(|(agent, (_, ids))| {
                (ids.remove(id) && ids.is_empty()).then(|| agent.clone())
            })
            .collect();
        ended
            .into_iter()
            .filter_map(|a| self.0.remove(&a).map(|(limit, _)| (a, limit)))
            .collect()
    }

    pub(crate) fn contains(&self, agent: &str) -> bool {
        self.0.contains_key(agent)
    }
}

pub(crate) struct Chaos {
    id: String,
    drains: Mutex<Drains>,
    bus: Arc<Bus>,
    pipeline: Pipeline,
    /// Faults in the node's own calls of its targets.
    injected: Arc<super::upstream::Injected>,
    /// The node's tasks (a fault's timer is one) and its stop, which ends the timers.
    tasks: TaskTracker,
    stop: CancellationToken,
}

impl Chaos {
    pub(crate) fn new(
        id: &str,
        bus: Arc<Bus>,
        pipeline: Pipeline,
        injected: Arc<super::upstream::Injected>,
        tasks: TaskTracker,
        stop: CancellationToken,
    ) -> Chaos {
        Chaos {
            id: id.to_string(),
            drains: Mutex::default(),
            bus,
            pipeline,
            injected,
            tasks,
            stop,
        }
    }

    /// Is `agent`'s budget drained here (its limit is not the ledger's now)?
    pub(crate) fn drained(&self, agent: Option<&str>) -> bool {
        agent.is_some_and(|a| lock(&self.drains).contains(a))
    }

    /// Apply a chaos command; the fault ends by itself at its expiry.
    pub(crate) fn apply(self: &Arc<Self>, cmd: NodeCommand) {
        let (id, until_ms) = match cmd {
            NodeCommand::Restore { id, .. } => return self.end(&id),
            NodeCommand::Isolate { id, until_ms, key } => {
                self.bus.isolate(id.clone(), until_ms, key);
                tracing::warn!(node = %self.id, fault = %id, "isolated from NATS (chaos)");
                (id, until_ms)
            }
            NodeCommand::DrainBudget {
                id,
                agent,
                until_ms,
            } => {
                let mut drains = lock(&self.drains);
                self.pipeline.with(|e| {
                    let budgets = &mut e.state.budgets.agents;
                    let drained = drains.drain(&id, &agent, budgets.get(&agent).copied());
                    budgets.insert(agent.clone(), drained);
                });
                tracing::warn!(node = %self.id, fault = %id, agent, "budget drained (chaos)");
                (id, until_ms)
            }
            NodeCommand::FailTarget {
                id,
                target,
                fault,
                until_ms,
            } => {
                self.injected.set(&id, &target, fault, until_ms);
                tracing::warn!(node = %self.id, fault = %id, target, ?fault, "calls of a target fail (chaos)");
                (id, until_ms)
            }
        };
        let me = self.clone();
        self.tasks.spawn(async move {
            let wait = until_ms.saturating_sub(now_ms());
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(wait)) => me.end(&id),
                // A stopping node ends its timers; the faults end with the process.
                () = me.stop.cancelled() => {}
            }
        });
    }

    /// End fault `id`, whatever it is.
    fn end(&self, id: &str) {
        if self.bus.reconnect(id) {
            tracing::info!(node = %self.id, fault = id, "reconnected to NATS");
        }
        if self.injected.end(id) {
            tracing::info!(node = %self.id, fault = id, "calls of a target go through again");
        }
        let ended = lock(&self.drains).end(id);
        if ended.is_empty() {
            return;
        }
        self.pipeline.with(|e| {
            for (agent, limit) in ended {
                match limit {
                    Some(limit_usd) => {
                        if let Some(b) = e.state.budgets.agents.get_mut(&agent) {
                            // The drain is over: so is the exhaustion episode it caused.
                            b.limit_usd = limit_usd;
                            b.refused_at_ms = None;
                        }
                    }
                    None => {
                        e.state.budgets.agents.remove(&agent);
                    }
                }
            }
        });
    }
}

/// The service that hears chaos commands for this node and for every node.
pub(crate) struct Commands(pub Arc<Chaos>);

impl Commands {
    pub(crate) async fn run(self, stop: CancellationToken) {
        if let Err(e) = self.listen(stop).await {
            tracing::error!("chaos commands stopped: {e:#}");
        }
    }

    async fn listen(self, stop: CancellationToken) -> Result<(), super::NodeError> {
        let chaos = self.0;
        let bus = &chaos.bus;
        let mut mine = subscribe(bus.nats(), subjects::chaos_node(&chaos.id)).await?;
        let mut all = subscribe(bus.nats(), subjects::chaos_node("all")).await?;
        loop {
            let m = tokio::select! {
                Some(m) = mine.next() => m,
                Some(m) = all.next() => m,
                () = stop.cancelled() => return Ok(()),
                else => return Ok(()),
            };
            if bus.isolated() {
                continue; // cut off: it cannot hear this
            }
            match serde_json::from_slice::<NodeCommand>(&m.payload) {
                Ok(cmd) => match cmd.check(now_ms()) {
                    Ok(()) => chaos.apply(cmd),
                    Err(why) => {
                        bus.forged::<()>("chaos", "?", why);
                    }
                },
                Err(_) => {
                    bus.counters.malformed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(limit: f64, spent: f64, reserved: f64) -> Budget {
        Budget {
            spent_usd: spent,
            reserved_usd: reserved,
            ..Budget::new(limit)
        }
    }

    #[test]
    fn a_drained_budget_has_nothing_left_but_keeps_what_is_in_flight() {
        let mut d = Drains::default();
        let b = d.drain("f1", "a", Some(budget(10.0, 2.0, 0.5)));
        assert_eq!((b.limit_usd, b.spent_usd, b.reserved_usd), (2.5, 2.0, 0.5));
        let none = d.drain("f1", "b", None);
        assert_eq!(
            none.limit_usd, 0.0,
            "an agent without a budget gets an empty one"
        );
        assert!(d.contains("a") && d.contains("b"));
    }

    #[test]
    fn the_limit_comes_back_when_the_last_drain_holding_it_ends() {
        let mut d = Drains::default();
        d.drain("f1", "a", Some(budget(10.0, 2.0, 0.0)));
        // A second drain sees the drained budget, but the limit to give back is the first's.
        d.drain("f2", "a", Some(budget(2.0, 2.0, 0.0)));
        d.drain("f2", "b", None);
        assert_eq!(d.end("f1"), vec![], "f2 still drains a");
        assert!(d.contains("a"));
        assert_eq!(
            d.end("f2"),
            vec![("a".to_string(), Some(10.0)), ("b".to_string(), None)]
        );
        assert!(!d.contains("a"));
        assert_eq!(d.end("f2"), vec![], "ended once");
    }
}
