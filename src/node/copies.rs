//! How many current copies the streams this node writes keep (the budget ledger, its own
//! decision log, the escalation store), asked every 10 s: `/metrics` shows a stream running
//! short (a server down, or whose JetStream stopped after a full disk) before the loss of one
//! more server stops its writes. One server's streams keep one copy: nothing to say.

use super::Node;
use super::metrics::{Kind, Registry};
use crate::transport::store::copies::stream_copies;
use crate::transport::subjects;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const EVERY: Duration = Duration::from_secs(10);
const ASK_WITHIN: Duration = Duration::from_secs(2);

/// Stream -> (copies it keeps, copies current: 0 when it did not answer).
#[derive(Default)]
pub(crate) struct Copies(Mutex<BTreeMap<String, (u64, u64)>>);

impl Copies {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (u64, u64)>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The streams short of copies: stream -> [current, configured].
    pub(crate) fn short(&self) -> BTreeMap<String, [u64; 2]> {
        self.lock()
            .iter()
            .filter(|(_, (replicas, current))| current < replicas)
            .map(|(s, &(replicas, current))| (s.clone(), [current, replicas]))
            .collect()
    }

    pub(crate) fn register(self: &Arc<Self>, registry: &Registry) {
        for (name, help, which) in [
            (
                "oam_stream_replicas",
                "Copies each stream this node writes is configured to keep (over several NATS \
                 servers).",
                0,
            ),
            (
                "oam_stream_replicas_current",
                "Of them, copies current now (the leader's and followers caught up); 0: the \
                 stream has no leader and takes no writes. Below a majority plus one, the loss \
                 of one more server stops its writes: `oam mesh status` says which server, and \
                 `oam mesh up` starts a stopped one again.",
                1,
            ),
        ] {
            let c = self.clone();
            registry.register(name, help, Kind::Gauge, move |s| {
                for (stream, &(replicas, current)) in c.lock().iter() {
                    s.put(
                        &[("stream", stream)],
                        if which == 0 { replicas } else { current },
                    );
                }
            });
        }
    }
}

/// Ask every `EVERY` until `stop`.
pub(crate) async fn watch(node: Arc<Node>, stop: CancellationToken) {
    let streams = [
        subjects::kv_stream(subjects::BUDGETS_BUCKET),
        subjects::decision_log_stream(&node.id),
        subjects::kv_stream(crate::transport::store::escalations::BUCKET),
    ];
    let js = crate::transport::store::context(node.bus.nats());
    let mut every = tokio::time::interval(EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            () = stop.cancelled() => return,
        }
        for name in &streams {
            let asked = tokio::time::timeout(ASK_WITHIN, js.get_stream(name)).await;
            let seen = match asked {
                Ok(Ok(s)) => {
                    let info = s.cached_info();
                    let replicas = info.config.num_replicas;
                    (replicas > 1).then(|| {
                        let c = stream_copies(name, replicas, info.cluster.clone());
                        (replicas as u64, c.current as u64)
                    })
                }
                // Not made yet (nothing written), or no answer: a stream known to keep copies
                // has none current now.
                _ => node
                    .copies
                    .lock()
                    .get(name.as_str())
                    .map(|&(replicas, _)| (replicas, 0)),
            };
            if let Some(seen) = seen {
                node.copies.lock().insert(name.clone(), seen);
            }
        }
    }
}
