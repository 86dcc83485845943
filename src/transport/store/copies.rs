//! How a stream keeps its copies across a cluster of servers, from its cluster information:
//! which are current, whether it has a leader, and what that means for its writes. Read by
//! `oam mesh status` (every stream, as the admin) and by each node for the streams it writes
//! (`/metrics`).

use std::time::Duration;

/// One stream of a mesh of several servers, as `oam mesh status` reports it: whether it has a
/// leader (takes writes) and which servers' copies are current.
#[derive(serde::Serialize, Clone, PartialEq, Debug)]
pub struct StreamStatus {
    pub name: String,
    /// The server leading it; none: it takes no writes.
    pub leader: Option<String>,
    /// Copies it keeps, and how many are current (the leader's and followers caught up).
    pub replicas: usize,
    pub current: usize,
    /// The servers whose copy is not, and why.
    pub behind: Vec<String>,
    pub healthy: bool,
    pub detail: String,
}

/// A follower's copy is not current when the group holds it offline, it has not been heard
/// from for this long (followers answer the leader's heartbeat every second), not at all since
/// the leader was elected, or it says it is not caught up.
pub(crate) const SILENT_BEHIND: Duration = Duration::from_secs(3);

/// What a stream's cluster information says of its copies.
pub fn stream_copies(
    name: &str,
    replicas: usize,
    cluster: Option<async_nats::jetstream::stream::ClusterInfo>,
) -> StreamStatus {
    let cluster = cluster.unwrap_or_default();
    let mut behind = Vec::new();
    for r in &cluster.replicas {
        let lag = r.lag.filter(|l| *l > 0);
        if r.offline {
            behind.push(format!("{} (offline)", r.name));
        } else if r.active >= SILENT_BEHIND {
            let lag = lag.map_or_else(String::new, |l| format!("{l} entries behind, "));
            behind.push(format!("{} ({lag}silent {} s)", r.name, r.active.as_secs()));
        } else if !r.current && r.active.is_zero() {
            // Not heard from since this leader was elected.
            behind.push(format!("{} (not heard from)", r.name));
        } else if !r.current {
            // Heard from, but not caught up: it counts toward no majority's write (a full disk
            // keeps a copy that answers heartbeats and writes nothing).
            let lag = lag.map_or_else(String::new, |l| format!(", {l} entries behind"));
            behind.push(format!("{} (not current{lag})", r.name));
        }
    }
    let leader = cluster.leader.clone();
    let current = usize::from(leader.is_some()) + cluster.replicas.len() - behind.len();
    let majority = replicas / 2 + 1;
    let detail = match (&leader, behind.is_empty()) {
        (None, _) => "no leader: it takes no writes".to_string(),
        (Some(l), true) => format!("led by {l}, {current} of {replicas} copies current"),
        (Some(l), false) if current > majority => format!(
            "led by {l}, {current} of {replicas} copies current; not: {}",
            behind.join(", ")
        ),
        (Some(l), false) if current == majority => format!(
            "led by {l}, {current} of {replicas} copies current, so the loss of one more server \
             stops its writes; not: {}",
            behind.join(", ")
        ),
        (Some(l), false) => format!(
            "led by {l}, but only {current} of {replicas} copies current: it takes no writes \
             until {majority} are; not: {}",
            behind.join(", ")
        ),
    };
    StreamStatus {
        name: name.to_string(),
        healthy: leader.is_some() && behind.is_empty(),
        leader,
        replicas,
        current,
        behind,
        detail,
    }
}
