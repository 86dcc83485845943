//! The cluster's gossip as this node takes part in it: it heartbeats (and publishes what it
//! sees, for `oam watch`), and applies the heartbeats, observations, loop events and goodbyes
//! of every node, and the death notices of targets that are mesh agents.
//!
//! What is applied passes [`admissible`]: it came on its sender's own subject (only that node
//! may publish there once the server enforces roles), its stamps are plausible, and (for the
//! sequenced kinds) it is newer than what was applied from that sender. Everything else is
//! counted, never applied.

use super::Node;
use crate::clock::now_ms;
use crate::core::wire::{
    Arrival, Envelope, Goodbye, Heartbeat, LoopEvent, Observations, Sequencer,
};
use crate::transport::subjects;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The service; it owns what it has applied from each sender (its `Sequencer`).
pub struct Gossip {
    node: Arc<Node>,
    sequencer: Sequencer,
}

/// Whether an event that parsed may be applied as far as its envelope tells: sent on its
/// sender's own subject (`oam.v1.{kind}.{sender}`) with plausible stamps.
pub fn admissible<T>(subject: &str, env: &Envelope<T>, now_ms: u64) -> Result<(), &'static str> {
    if subject.rsplit('.').next() != Some(env.sender.as_str()) {
        return Err("sent on another node's subject");
    }
    crate::core::wire::plausible(env, now_ms)
}

impl Gossip {
    pub fn new(node: Arc<Node>) -> Gossip {
        Gossip {
            node,
            sequencer: Sequencer::default(),
        }
    }

    /// A peer's event, if it is one to apply (see the module's rules); then only a sender
    /// admitted to the cluster, and (when `ordered`) only what is newer than what was applied.
    fn decode<T: DeserializeOwned>(
        &mut self,
        stream: &'static str,
        m: &async_nats::Message,
        now_ms: u64,
        ordered: bool,
    ) -> Option<Envelope<T>> {
        let bus = &self.node.bus;
        let env: Envelope<T> = match serde_json::from_slice(&m.payload) {
            Ok(e) => e,
            Err(e) => {
                bus.counters.malformed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("ignored a malformed {stream} message: {e}");
                return None;
            }
        };
        if let Err(why) = admissible(&m.subject, &env, now_ms) {
            return bus.forged(stream, &env.sender, why);
        }
        // Only what passed every other check may take one of the cluster's seats.
        let id = &self.node.id;
        if env.sender != *id
            && !self
                .node
                .pipeline
                .with(|e| Arc::make_mut(&mut e.state.cluster).admit(&env.sender, now_ms))
        {
            return bus.forged(stream, &env.sender, "not a member of this cluster");
        }
        if !ordered {
            return Some(env);
        }
        match self.sequencer.accept(stream, &env, now_ms) {
            Arrival::Fresh => Some(env),
            Arrival::Stale => {
                bus.counters
                    .duplicate_or_stale
                    .fetch_add(1, Ordering::Relaxed);
                None
            }
            Arrival::Forged(why) => bus.forged(stream, &env.sender, why),
        }
    }

    /// Heartbeat and apply gossip until `stop`.
    pub async fn run(mut self, stop: CancellationToken) {
        let beat = heartbeat(self.node.clone(), stop.clone());
        let apply = async {
            if let Err(e) = self.apply(stop.clone()).await {
                tracing::error!("gossip stopped: {e:#}");
            }
        };
        tokio::join!(beat, apply);
    }

    async fn apply(&mut self, stop: CancellationToken) -> anyhow::Result<()> {
        let nats = self.node.bus.nats().clone();
        let mut deaths = nats.subscribe(subjects::DEATHS).await?;
        let mut hb = nats.subscribe(subjects::HEARTBEATS).await?;
        let mut obs = nats.subscribe(subjects::ALL_OBSERVATIONS).await?;
        let mut bye = nats.subscribe(subjects::GOODBYES).await?;
        let mut loop_events = nats.subscribe(subjects::LOOP_EVENTS).await?;
        loop {
            let m = tokio::select! {
                Some(m) = hb.next() => (m, Kind::Heartbeat),
                Some(m) = obs.next() => (m, Kind::Observations),
                Some(m) = deaths.next() => (m, Kind::Death),
                Some(m) = loop_events.next() => (m, Kind::Loop),
                Some(m) = bye.next() => (m, Kind::Goodbye),
                () = stop.cancelled() => return Ok(()),
                else => return Ok(()),
            };
            // Cut off, it hears nothing; a consumer's copy was not sent by a node.
            if !self.node.bus.isolated() && !subjects::from_jetstream(&m.0) {
                self.one(m.0, m.1);
            }
        }
    }

    fn one(&mut self, m: async_nats::Message, kind: Kind) {
        let now = now_ms();
        let node = self.node.clone();
        match kind {
            // Heartbeats and observations are not sequenced: a heartbeat only says "alive now"
            // and observations are ordered by their own stamps, so no forged sequence number
            // can shut a real node out of either.
            Kind::Heartbeat => {
                if let Some(env) = self.decode::<Heartbeat>("heartbeat", &m, now, false) {
                    if env.body.node != env.sender {
                        node.bus
                            .forged::<()>("heartbeat", &env.sender, "speaks for another node");
                        return;
                    }
                    // Liveness is judged on our clock, not the sender's.
                    node.pipeline.with(|e| {
                        Arc::make_mut(&mut e.state.cluster).heartbeat(&env.sender, now);
                    });
                }
            }
            Kind::Observations => {
                let Some(env) = self.decode::<Observations>("observations", &m, now, false) else {
                    return;
                };
                if env.sender == node.id {
                    return; // applied locally already
                }
                let forged: Vec<&'static str> = node.pipeline.with(|e| {
                    let mut forged = Vec::new();
                    for o in env.body.observations {
                        let why = if o.node != env.sender {
                            Some("an observation for another node")
                        } else if !e.state.providers.iter().any(|p| *p.id == *o.provider) {
                            Some("an observation of a provider this node does not route to")
                        } else {
                            match Arc::make_mut(&mut e.state.cluster).gossiped(o, now) {
                                Arrival::Forged(why) => Some(why),
                                Arrival::Fresh | Arrival::Stale => None,
                            }
                        };
                        forged.extend(why);
                    }
                    forged
                });
                for why in forged {
                    node.bus.forged::<()>("observations", &env.sender, why);
                }
            }
            Kind::Death => {
                match serde_json::from_slice::<crate::mesh::protocol::DeathNotice>(&m.payload) {
                    Ok(n) => node.health.died(node.upstreams.of_agent(&n.agent)),
                    Err(_) => {
                        node.bus.counters.malformed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Kind::Loop => {
                if let Some(env) = self.decode::<LoopEvent>("loop", &m, now, true) {
                    node.loops.apply(&node.pipeline, &env.sender, env.body);
                }
            }
            Kind::Goodbye => {
                if let Some(env) = self.decode::<Goodbye>("goodbye", &m, now, true)
                    && env.body.node == env.sender
                {
                    node.pipeline
                        .with(|e| Arc::make_mut(&mut e.state.cluster).disconnect(&env.sender));
                }
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Heartbeat,
    Observations,
    Death,
    Loop,
    Goodbye,
}

/// Heartbeat, and publish what this node sees, every heartbeat interval until `stop`.
async fn heartbeat(node: Arc<Node>, stop: CancellationToken) {
    let every = Duration::from_millis(node.cfg.node.heartbeat_interval_ms);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        let http = node.serving.http_url.get().cloned();
        node.bus.publish(
            subjects::heartbeat(&node.id),
            Heartbeat {
                node: node.id.clone(),
                http,
            },
        );
        // What this node sees, for `oam watch` and anyone else listening.
        node.bus
            .publish(subjects::state(&node.id), super::status::snapshot(&node));
    }
}

/// How long a starting node waits to hear a majority before it serves anyway.
pub(crate) const JOIN_WAIT: Duration = Duration::from_millis(2_500);

/// Wait (at most `JOIN_WAIT`) until this node hears a majority of the cluster (heartbeats,
/// and observations of every target), so a node that has just started or restarted does
/// not decide its first requests on a view of one. Without a majority in time it serves
/// anyway, on its local view, and says so.
pub async fn join(node: &Node) {
    let deadline = tokio::time::Instant::now() + JOIN_WAIT;
    loop {
        let now = now_ms();
        let (live, needed, heard) = {
            let e = node.pipeline.read();
            let c = &e.state.cluster;
            let needed = c.quorum(now);
            let heard = e
                .state
                .providers
                .iter()
                .all(|p| c.view(&p.id, now).voters >= needed);
            (c.live_nodes(now).len(), needed, heard)
        };
        if live >= needed && heard {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(
                node = %node.id,
                live,
                needed,
                "no majority heard within {} ms; serving on this node's own view",
                JOIN_WAIT.as_millis()
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::wire::Stamper;

    const NOW: u64 = 1_700_000_000_000;

    fn from(sender: &str) -> Envelope<u32> {
        Stamper::new(sender.to_string(), NOW - 10_000).stamp(NOW, 7)
    }

    #[test]
    fn an_event_is_believed_only_on_its_sender_s_own_subject() {
        let env = from("n2");
        let on = |node: &str| subjects::heartbeat(node);
        assert_eq!(admissible(&on("n2"), &env, NOW), Ok(()));
        assert_eq!(
            admissible(&on("n3"), &env, NOW),
            Err("sent on another node's subject")
        );
        assert!(admissible(&format!("{}.x", on("n2")), &env, NOW).is_err());
    }

    #[test]
    fn stamps_from_the_future_are_refused() {
        let mut env = from("n2");
        env.incarnation = NOW + 24 * 3_600_000;
        assert!(admissible(&subjects::heartbeat("n2"), &env, NOW).is_err());
    }
}
