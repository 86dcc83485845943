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
use crate::transport::published::subscribe;
use crate::transport::subjects;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The service; it owns what it has applied from each sender (its `Sequencer`).
pub(crate) struct Gossip {
    node: Arc<Node>,
    sequencer: Sequencer,
}

/// Whether an event that parsed may be applied as far as its envelope tells: sent on its
/// sender's own subject (`oam.v1.{kind}.{sender}`) with plausible stamps.
pub(crate) fn admissible<T>(
    subject: &str,
    env: &Envelope<T>,
    now_ms: u64,
) -> Result<(), &'static str> {
    if subject.rsplit('.').next() != Some(env.sender.as_str()) {
        return Err("sent on another node's subject");
    }
    crate::core::wire::plausible(env, now_ms)
}

impl Gossip {
    pub(crate) fn new(node: Arc<Node>) -> Gossip {
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
    pub(crate) async fn run(mut self, stop: CancellationToken) {
        let beat = heartbeat(self.node.clone(), stop.clone());
        let apply = async {
            if let Err(e) = self.apply(stop.clone()).await {
                tracing::error!("gossip stopped: {e:#}");
            }
        };
        tokio::join!(beat, apply);
    }

    async fn apply(&mut self, stop: CancellationToken) -> Result<(), super::NodeError> {
        let nats = self.node.bus.nats().clone();
        let mut deaths = subscribe(&nats, subjects::DEATHS).await?;
        let mut hb = subscribe(&nats, subjects::HEARTBEATS).await?;
        let mut obs = subscribe(&nats, subjects::ALL_OBSERVATIONS).await?;
        let mut bye = subscribe(&nats, subjects::GOODBYES).await?;
        let mut loop_events = subscribe(&nats, subjects::LOOP_EVENTS).await?;
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
            // Cut off, it hears nothing.
            if !self.node.bus.isolated() {
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
pub(crate) async fn join(node: &Node) {
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

    /// An event as it arrives on `subject`.
    fn arrives(subject: String, payload: Vec<u8>) -> async_nats::Message {
        async_nats::Message {
            subject: subject.into(),
            reply: None,
            length: payload.len(),
            payload: payload.into(),
            headers: None,
            status: None,
            description: None,
        }
    }

    fn stamped<T: serde::Serialize>(s: &mut Stamper, body: T) -> Vec<u8> {
        serde_json::to_vec(&s.stamp(now_ms(), body)).expect("JSON")
    }

    fn heartbeat_of(node: &str) -> Heartbeat {
        Heartbeat {
            node: node.into(),
            http: None,
        }
    }

    fn counted(node: &Node) -> (u64, u64, u64) {
        let c = &node.bus.counters;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        (
            get(&c.malformed),
            get(&c.forged),
            get(&c.duplicate_or_stale),
        )
    }

    fn live(node: &Node) -> Vec<String> {
        let e = node.pipeline.read();
        let mut l: Vec<String> = e
            .state
            .cluster
            .live_nodes(now_ms())
            .into_iter()
            .map(String::from)
            .collect();
        l.sort();
        l
    }

    #[tokio::test]
    async fn heartbeats_count_only_from_their_own_node_and_bad_ones_are_counted() {
        let (node, _) = super::super::offline::node_with("[node]\ncluster_size = 3\n").await;
        let mut g = Gossip::new(node.clone());
        let mut n2 = Stamper::new("n2", now_ms() - 1_000);
        let mut n3 = Stamper::new("n3", now_ms() - 1_000);

        g.one(
            arrives(
                subjects::heartbeat("n2"),
                stamped(&mut n2, heartbeat_of("n2")),
            ),
            Kind::Heartbeat,
        );
        assert_eq!(live(&node), ["n1", "n2"], "n2 is heard");
        // n3 on n2's subject, and n3 speaking for n2 on its own: neither makes n3 live.
        g.one(
            arrives(
                subjects::heartbeat("n2"),
                stamped(&mut n3, heartbeat_of("n3")),
            ),
            Kind::Heartbeat,
        );
        g.one(
            arrives(
                subjects::heartbeat("n3"),
                stamped(&mut n3, heartbeat_of("n2")),
            ),
            Kind::Heartbeat,
        );
        g.one(
            arrives(subjects::heartbeat("n3"), b"{not json".to_vec()),
            Kind::Heartbeat,
        );
        g.one(
            arrives(subjects::DEATHS.replace(">", "x"), b"[]".to_vec()),
            Kind::Death,
        );
        assert_eq!(live(&node), ["n1", "n2"]);
        assert_eq!(counted(&node), (2, 2, 0), "(malformed, forged, stale)");
    }

    #[tokio::test]
    async fn a_goodbye_is_applied_once_and_a_fourth_node_gets_no_seat() {
        let (node, _) = super::super::offline::node_with("[node]\ncluster_size = 3\n").await;
        let mut g = Gossip::new(node.clone());
        for peer in ["n2", "n3"] {
            let mut s = Stamper::new(peer, now_ms() - 1_000);
            g.one(
                arrives(
                    subjects::heartbeat(peer),
                    stamped(&mut s, heartbeat_of(peer)),
                ),
                Kind::Heartbeat,
            );
        }
        let mut n4 = Stamper::new("n4", now_ms() - 1_000);
        g.one(
            arrives(
                subjects::heartbeat("n4"),
                stamped(&mut n4, heartbeat_of("n4")),
            ),
            Kind::Heartbeat,
        );
        assert_eq!(live(&node), ["n1", "n2", "n3"], "three seats");
        assert_eq!(counted(&node).1, 1, "the fourth is counted as forged");

        let mut n2 = Stamper::new("n2", now_ms() - 1_000);
        let bye = stamped(&mut n2, Goodbye { node: "n2".into() });
        g.one(arrives(subjects::goodbye("n2"), bye.clone()), Kind::Goodbye);
        assert_eq!(live(&node), ["n1", "n3"]);
        g.one(arrives(subjects::goodbye("n2"), bye), Kind::Goodbye);
        assert_eq!(counted(&node).2, 1, "a replayed goodbye is stale");
    }

    #[tokio::test]
    async fn observations_of_targets_this_node_does_not_route_to_are_refused() {
        let (node, _) = super::super::offline::node_with("[node]\ncluster_size = 3\n").await;
        let mut g = Gossip::new(node.clone());
        let target = node.cfg.targets[0].id.clone();
        let seen = |node: &str, provider: &str| crate::core::quorum::Observation {
            node: node.into(),
            provider: provider.into(),
            at_ms: now_ms(),
            verdict: crate::core::health::Verdict::Unhealthy,
            availability: 0.0,
            contract_failure_pct: 0.0,
            p95_ms: 0,
            samples: 10,
            evidence: crate::core::health::Evidence::Traffic,
            own: Default::default(),
        };
        let mut n2 = Stamper::new("n2", now_ms() - 1_000);
        g.one(
            arrives(
                subjects::heartbeat("n2"),
                stamped(&mut n2, heartbeat_of("n2")),
            ),
            Kind::Heartbeat,
        );
        let body = Observations {
            node: "n2".into(),
            observations: vec![
                seen("n2", &target),
                seen("n2", "nowhere"),
                seen("n3", &target),
            ],
        };
        g.one(
            arrives(subjects::observations("n2"), stamped(&mut n2, body)),
            Kind::Observations,
        );
        assert_eq!(
            counted(&node).1,
            2,
            "one for an unknown target, one speaking for n3"
        );
        let e = node.pipeline.read();
        let view = e.state.cluster.view(&target, now_ms());
        assert!(
            view.voters >= 1,
            "n2's own observation of a known target counts: {view:?}"
        );
    }
}
