//! Agent loops across the cluster: every failure a node counts toward a loop (and every call
//! that worked after failures) goes to the other nodes on `oam.v1.loop.{node}`, which count it
//! too, so a loop spread over three nodes trips at the same count as one on a single node.
//!
//! The node whose own failure opens an episode raises its incident and escalation, after
//! claiming the episode in the KV bucket `oam-loop-episodes`: when two nodes open one at the
//! same moment, the second finds the claim and stays quiet, so the cluster raises one incident
//! and one escalation per episode. When events cross (a node counts its own failure before an
//! earlier one from another node arrives), no node's own failure reaches the threshold and the
//! episode opens on every node from another's event: each of those nodes raises it after
//! `RAISE_GRACE` unless it was claimed or ended by then, so a loop is never stopped unheard. A
//! call that works ends the episode and its claim.

use super::Node;
use super::bus::Bus;
use super::pipeline::Pipeline;
use crate::clock::now_ms;
use crate::core::escalation::Escalation;
use crate::core::loops::{Fingerprint, Incident};
use crate::core::pipeline::{Decision, Effect};
use crate::core::wire::LoopEvent;
use crate::transport::store::loops::{self as claims, CLAIM_TIMEOUT, Claim};
use crate::transport::subjects;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// How long a node that opened an episode from another node's event waits before raising it
/// itself: the node whose own failure opened it claims it well within this.
pub(crate) const RAISE_GRACE: Duration = Duration::from_secs(1);

pub(crate) struct LoopEpisodes {
    id: String,
    bus: Arc<Bus>,
    claims: mpsc::UnboundedSender<ClaimOp>,
    /// Loop episodes this node opened that another node had raised already.
    pub joined: AtomicU64,
}

/// The service that claims episodes and releases their claims, in order.
pub(crate) struct Claimer {
    rx: mpsc::UnboundedReceiver<ClaimOp>,
    node: Arc<Node>,
}

impl LoopEpisodes {
    pub(crate) fn new(id: &str, bus: Arc<Bus>) -> (LoopEpisodes, mpsc::UnboundedReceiver<ClaimOp>) {
        let (claims, rx) = mpsc::unbounded_channel();
        let loops = LoopEpisodes {
            id: id.to_string(),
            bus,
            claims,
            joined: AtomicU64::new(0),
        };
        (loops, rx)
    }

    /// Tell the other nodes what this decision counted toward a loop.
    pub(crate) fn share(&self, d: &Decision) {
        for effect in &d.effects {
            match effect {
                Effect::LoopFailure {
                    fingerprint,
                    agent,
                    task,
                    probe,
                } => self.bus.publish(
                    subjects::loop_event(&self.id),
                    LoopEvent::Failure {
                        fingerprint: *fingerprint,
                        agent: agent.clone(),
                        task: task.clone(),
                        at_ms: now_ms(),
                        probe: *probe,
                        request_id: d.request_id.clone(),
                    },
                ),
                Effect::LoopCleared { fingerprint } => {
                    self.bus.publish(
                        subjects::loop_event(&self.id),
                        LoopEvent::Cleared {
                            fingerprint: *fingerprint,
                        },
                    );
                    let _ = self.claims.send(ClaimOp::Release(*fingerprint));
                }
                _ => {}
            }
        }
    }

    /// Count another node's loop event here.
    pub(crate) fn apply(&self, pipeline: &Pipeline, sender: &str, event: LoopEvent) {
        if sender == self.id {
            return; // counted when it happened
        }
        match event {
            LoopEvent::Failure {
                fingerprint,
                agent,
                task,
                at_ms,
                probe,
                request_id,
            } => {
                // Stamped by the sender's clock: never later than ours (a forged future stamp
                // would keep an episode open).
                let at = at_ms.min(now_ms());
                let opened =
                    pipeline.with(|e| e.remote_loop_failure(fingerprint, &agent, &task, at, probe));
                if let Some(incident) = opened {
                    self.raise_unless_heard(pipeline.clone(), incident, request_id);
                }
            }
            LoopEvent::Cleared { fingerprint } => {
                pipeline.with(|e| e.remote_loop_cleared(fingerprint));
            }
        }
    }

    /// An episode opened here by another node's event: raise it after `RAISE_GRACE` if it is
    /// still open (the claim then keeps quiet every node but one, and the node whose own
    /// failure opened it, if one did, has claimed it by then).
    fn raise_unless_heard(&self, pipeline: Pipeline, incident: Incident, request_id: String) {
        let claims = self.claims.clone();
        tokio::spawn(async move {
            tokio::time::sleep(RAISE_GRACE).await;
            let open = pipeline
                .read()
                .state
                .loops
                .get(&incident.fingerprint)
                .is_some_and(|l| {
                    l.episode
                        .as_ref()
                        .is_some_and(|ep| ep.incident.id == incident.id)
                });
            if open {
                let escalation = crate::core::escalation::of_loop(&incident, &request_id, now_ms());
                let _ = claims.send(ClaimOp::Raise(Box::new((incident, Some(escalation)))));
            }
        });
    }

    /// Raise a new loop episode's incident and escalation unless another node claimed the
    /// episode first.
    pub(crate) fn raise(&self, incident: Incident, escalation: Option<Escalation>) {
        if self
            .claims
            .send(ClaimOp::Raise(Box::new((incident, escalation))))
            .is_err()
        {
            let dropped = &self.bus.counters.dropped_events;
            dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Claimer {
    pub(crate) fn new(rx: mpsc::UnboundedReceiver<ClaimOp>, node: Arc<Node>) -> Claimer {
        Claimer { rx, node }
    }

    /// Claim episodes and release their claims, in order, until the node's last handle is
    /// gone (a claim is one round trip, bounded by `CLAIM_TIMEOUT`).
    pub(crate) async fn run(mut self, _stop: CancellationToken) {
        let node = &self.node;
        let mut store: Option<async_nats::jetstream::kv::Store> = None;
        while let Some(op) = self.rx.recv().await {
            if store.is_none() {
                store = tokio::time::timeout(CLAIM_TIMEOUT, claims::open(node.bus.nats()))
                    .await
                    .ok()
                    .and_then(Result::ok);
            }
            match op {
                ClaimOp::Raise(raise) => {
                    if node.bus.isolated() {
                        continue; // a partition loses what it would have said
                    }
                    let (incident, escalation) = *raise;
                    let won = match &store {
                        Some(s) => {
                            let cfg = node.pipeline.read().config.loops;
                            let now = now_ms();
                            let claim = Claim {
                                incident: incident.id.clone(),
                                node: node.id.clone(),
                                until_ms: now + cfg.cooldown_ms + cfg.window_ms,
                            };
                            claims::claim(s, &incident.fingerprint.to_string(), &claim, now).await
                        }
                        None => None,
                    };
                    match won {
                        Some(false) => {
                            node.loops.joined.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(node = %node.id, incident = %incident.id, "loop episode already raised by another node");
                            continue;
                        }
                        Some(true) => {}
                        None => {
                            tracing::warn!(node = %node.id, incident = %incident.id, "cannot claim the loop episode; raising it anyway");
                            store = None;
                        }
                    }
                    node.bus.publish(subjects::incident(&node.id), &incident);
                    if let Some(e) = escalation {
                        node.escalations.raise(&e);
                    }
                }
                ClaimOp::Release(fp) => {
                    if let Some(s) = &store {
                        claims::release(s, &fp.to_string()).await;
                    }
                }
            }
        }
    }
}

/// Work for the claim task.
pub(crate) enum ClaimOp {
    Raise(Box<(Incident, Option<Escalation>)>),
    Release(Fingerprint),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::pipeline::tests::{T0, engine};

    #[tokio::test]
    async fn what_a_decision_counted_toward_a_loop_goes_to_the_cluster() {
        let (bus, mut publisher) = super::super::bus::offline::bus("n1").await;
        let (loops, mut claims) = LoopEpisodes::new("n1", bus);
        let fp = Fingerprint(7);
        let rec = crate::core::pipeline::tests::recorded(&mut engine(), "r", 1);
        let mut d: Decision = (**rec.decision).clone();
        d.effects = vec![
            Effect::LoopFailure {
                fingerprint: fp,
                agent: "a".into(),
                task: "t".into(),
                probe: false,
            },
            Effect::LoopCleared { fingerprint: fp },
        ];
        loops.share(&d);
        let sent = super::super::bus::offline::sent(&mut publisher);
        assert_eq!(sent.len(), 2);
        assert!(sent.iter().all(|(s, _)| *s == subjects::loop_event("n1")));
        let body = |i: usize| &sent[i].1["body"];
        assert_eq!(
            (body(0)["event"].as_str(), body(0)["agent"].as_str()),
            (Some("failure"), Some("a"))
        );
        assert_eq!(body(1)["event"], "cleared", "{}", body(1));
        assert!(
            matches!(claims.try_recv(), Ok(ClaimOp::Release(f)) if f == fp),
            "a cleared episode frees its claim"
        );
    }

    #[tokio::test]
    async fn another_node_s_loop_events_count_here_and_its_own_do_not_count_twice() {
        let (bus, _publisher) = super::super::bus::offline::bus("n1").await;
        let (loops, _claims) = LoopEpisodes::new("n1", bus);
        let pipeline = Pipeline::new(engine());
        let failure = |at_ms| LoopEvent::Failure {
            fingerprint: Fingerprint(9),
            agent: "a".into(),
            task: "t".into(),
            at_ms,
            probe: false,
            request_id: "r9".into(),
        };
        loops.apply(&pipeline, "n1", failure(T0));
        assert!(
            pipeline.read().state.loops.is_empty(),
            "counted when it happened"
        );
        loops.apply(&pipeline, "n2", failure(T0));
        let e = pipeline.read();
        let entry = e.state.loops.get(&Fingerprint(9)).expect("counted");
        assert_eq!((entry.agent.as_str(), entry.failures.len()), ("a", 1));
    }

    #[tokio::test(start_paused = true)]
    async fn an_episode_opened_by_crossed_events_is_raised_unless_it_ended() {
        let (bus, _publisher) = super::super::bus::offline::bus("n1").await;
        let (loops, mut claims) = LoopEpisodes::new("n1", bus);
        let pipeline = Pipeline::new(engine());
        let failure = |fp: u64, at_ms: u64| LoopEvent::Failure {
            fingerprint: Fingerprint(fp),
            agent: "a".into(),
            task: "t".into(),
            at_ms,
            probe: false,
            request_id: format!("r{at_ms}"),
        };
        // Three failures, none counted here first: the third opens the episode here.
        for k in 0..3 {
            loops.apply(&pipeline, "n2", failure(5, T0 + k));
        }
        assert!(claims.try_recv().is_err(), "not before the grace");
        tokio::time::sleep(RAISE_GRACE * 2).await;
        let Ok(ClaimOp::Raise(raised)) = claims.try_recv() else {
            panic!("the episode is raised");
        };
        let (incident, escalation) = *raised;
        let escalation = escalation.expect("with its escalation");
        assert_eq!(incident.fingerprint, Fingerprint(5));
        assert_eq!(
            escalation.incident_id.as_deref(),
            Some(incident.id.as_str())
        );
        assert_eq!(escalation.request_id, format!("r{}", T0 + 2));
        assert_eq!(
            escalation.reason_codes.last(),
            Some(&crate::core::reason::ReasonCode::EscalatedAgentLoop)
        );
        // One that a working call ended within the grace is not raised.
        for k in 0..3 {
            loops.apply(&pipeline, "n2", failure(6, T0 + k));
        }
        let cleared = LoopEvent::Cleared {
            fingerprint: Fingerprint(6),
        };
        loops.apply(&pipeline, "n3", cleared);
        tokio::time::sleep(RAISE_GRACE * 2).await;
        assert!(
            claims.try_recv().is_err(),
            "an ended episode stays unraised"
        );
    }
}
