//! The liveness monitor: turns connection drops (`$SYS.ACCOUNT.*.DISCONNECT` advisories) and
//! missed heartbeats into death notices, then cleans the catalog, registry and instance records.
//!
//! Order matters: the notice goes out first (callers waiting on the agent fail at once), the
//! clean-up after. One replica's death is not the agent's: `mesh.death.{name}` fires only when
//! the last instance serving the name is gone, but every instance death is announced on
//! `mesh.instance-death.{instance_id}` for callers whose request that instance held. Two monitors,
//! or a restarted one, announce each death once: the first to create the instance's tombstone in
//! the `mesh-tombstones` bucket announces it.
//!
//! Agents served by other Open Agent Mesh clients (the Python SDK) write no instance records and
//! use unnamed connections. For those, the monitor asks the server which subscriptions the closed
//! connection held (`CONNZ` on closed connections): queue subscriptions on `mesh.agent.{name}` in
//! group `q.{name}` make it an instance of `name`, identified as `nats-{server}-{cid}`. Whether
//! another instance still serves the name is asked the same way, of the open connections on
//! every server. Those that die together with their server send no advisory: the `census`
//! finds them.

use super::protocol::{AgentHeartbeat, DeathNotice, DeathReason};
use super::store;
use crate::transport::connect::flush_within;
use crate::transport::subjects;
use futures_util::StreamExt;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How often heartbeats are expected, and how many may be missed before an instance is dead.
pub(crate) const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
pub(crate) const MISSED_BEATS: u32 = 3;
/// How often silent instances are looked for: what a death by missed heartbeats may be told
/// late by, beyond `MISSED_BEATS` intervals.
const SWEEP_EVERY: Duration = Duration::from_millis(100);
/// Beats read at most before a sweep judges silence (those the server sent before it asked).
const MAX_DRAINED: usize = 100_000;
/// How long a sweep waits for its round trip to the server before judging silence anyway: a
/// woken connection reads its socket in milliseconds, and the loop must not stall for long on a
/// bucket electing a leader (deaths are due within the heartbeat bound).
const ROUND_TRIP_WITHIN: Duration = Duration::from_millis(250);
/// A death notice is flushed at once, but never waits long on a bus that is struggling.
const FLUSH_WITHIN: Duration = Duration::from_secs(1);
/// Live instances one agent may have (its replicas). Heartbeats that would make more are
/// refused and counted: one agent cannot fill the monitor with instances whose deaths it must
/// then announce, ahead of everyone else's.
pub const MAX_INSTANCES_PER_AGENT: usize = 64;
/// New instances one agent may start per second, once its first `MAX_INSTANCES_PER_AGENT`
/// are used up.
pub(crate) const NEW_INSTANCES_PER_S: f64 = 16.0;

#[derive(Deserialize, Debug)]
struct Advisory {
    #[serde(default)]
    client: AdvisoryClient,
    #[serde(default)]
    server: AdvisoryServer,
    #[serde(default)]
    reason: String,
}

#[derive(Deserialize, Debug, Default)]
struct AdvisoryClient {
    #[serde(default)]
    name: String,
    /// The connection id, unique per server run.
    #[serde(default)]
    id: u64,
    #[serde(default)]
    acc: String,
    /// The NATS user the connection authenticated as (empty on a server without users).
    #[serde(default)]
    user: String,
}

/// Whether a connection of NATS user `user` may speak for agent `agent`: its own agent's user,
/// the admin, or any user on a server whose users are not oam's roles (nothing to tell by).
fn may_speak_for(user: &str, agent: &str) -> bool {
    use crate::transport::roles::Role;
    match Role::of_user(user) {
        None | Some(Role::Admin) => true,
        Some(Role::Agent(name) | Role::SdkAgent(name)) => name == agent,
        Some(_) => false,
    }
}

#[derive(Deserialize, Debug, Default)]
struct AdvisoryServer {
    #[serde(default)]
    id: String,
}

/// The part of a `CONNZ` reply the monitor reads.
#[derive(Deserialize, Debug, Default)]
struct Connz {
    /// The server that answered.
    #[serde(default)]
    server: AdvisoryServer,
    #[serde(default)]
    data: ConnzData,
}

#[derive(Deserialize, Debug, Default)]
struct ConnzData {
    #[serde(default)]
    connections: Vec<ConnInfo>,
}

#[derive(Deserialize, Debug, Default)]
struct ConnInfo {
    #[serde(default)]
    cid: u64,
    #[serde(default)]
    name: String,
    /// The client's end of the connection (its local port, as the server sees it).
    #[serde(default)]
    port: u16,
    #[serde(default)]
    subscriptions_list_detail: Vec<SubDetail>,
}

#[derive(Deserialize, Debug, Default)]
struct SubDetail {
    #[serde(default)]
    subject: String,
    #[serde(default)]
    qgroup: String,
}

/// The agents a connection served: queue subscriptions `mesh.agent.{name}` in group `q.{name}`.
fn agents_served(subs: &[SubDetail]) -> Vec<String> {
    let mut agents: Vec<String> = subs
        .iter()
        .filter_map(|s| {
            let name = subjects::agent_of(&s.subject)?;
            (s.qgroup == subjects::agent_queue(name)).then(|| name.to_string())
        })
        .collect();
    agents.sort();
    agents.dedup();
    agents
}

/// The instance id a connection name belongs to (`oam-host-{id}`), if any.
fn instance_of(connection: &str) -> Option<&str> {
    connection
        .strip_prefix("oam-host-")
        .filter(|id| !id.is_empty())
}

/// Of `agents`, those instance `id` still beats for on a connection other than `closed`
/// (`protocol::conn_name`), heard within the heartbeat bound: it moved to another server (its
/// own froze, say), and the connection that closed is its old one, not its death.
fn moved(
    seen: &BTreeMap<(String, String), Seen>,
    id: &str,
    agents: &[String],
    closed: &str,
) -> Vec<String> {
    let limit = HEARTBEAT_EVERY * MISSED_BEATS;
    agents
        .iter()
        .filter(|a| {
            seen.get(&(id.to_string(), (*a).clone())).is_some_and(|s| {
                s.last.elapsed() <= limit && s.conn.as_deref().is_some_and(|c| c != closed)
            })
        })
        .cloned()
        .collect()
}

/// How long an announced death is remembered, to tell it once when two kinds of evidence
/// (missed heartbeats, the connection's close) come together.
const RECENTLY: Duration = Duration::from_secs(10);

/// Whether a death of instance `id` naming `agents` repeats one announced a moment ago
/// (`announced`, kept for `RECENTLY`): the same instance, not heard beating since, and no agent
/// it did not name then (none: the records would name the same).
fn repeats(
    announced: &BTreeMap<String, (Instant, Vec<String>)>,
    seen: &BTreeMap<(String, String), Seen>,
    id: &str,
    agents: &[String],
) -> bool {
    let Some((_, told)) = announced.get(id) else {
        return false;
    };
    let beating_again = seen
        .range((id.to_string(), String::new())..)
        .next()
        .is_some_and(|((i, _), _)| i == id);
    !beating_again && agents.iter().all(|a| told.contains(a))
}

struct Seen {
    last: Instant,
    /// The connection its newest heartbeat came on (`protocol::conn_name`), if it said, and
    /// when that heartbeat was sent (its `at_ms`): a server that thaws delivers the beats it
    /// held after those the instance sent since on another connection.
    conn: Option<String>,
    at_ms: u64,
}

/// One agent's instances as the monitor admits them: how many are live, and the tokens left
/// for new ones (refilled at `NEW_INSTANCES_PER_S`, at most `MAX_INSTANCES_PER_AGENT`).
struct InstanceQuota {
    live: usize,
    tokens: f64,
    at: Instant,
}

impl InstanceQuota {
    fn new(now: Instant) -> InstanceQuota {
        InstanceQuota {
            live: 0,
            tokens: MAX_INSTANCES_PER_AGENT as f64,
            at: now,
        }
    }

    /// May one more instance start now?
    fn admit(&mut self, now: Instant) -> bool {
        let refill = now.duration_since(self.at).as_secs_f64() * NEW_INSTANCES_PER_S;
        self.tokens = (self.tokens + refill).min(MAX_INSTANCES_PER_AGENT as f64);
        self.at = now;
        if self.live >= MAX_INSTANCES_PER_AGENT || self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        self.live += 1;
        true
    }
}

pub(crate) struct Monitor {
    /// The mesh's buckets, opened once and kept for the monitor's life.
    mesh: std::sync::Arc<store::Mesh>,
    /// Instance id -> when this monitor announced its death, and the agents it named
    /// (`repeats`).
    announced: BTreeMap<String, (Instant, Vec<String>)>,
    /// Who this monitor is in the tombstones it claims (one per run).
    owner: std::sync::Arc<str>,
    /// (instance id, agent) -> its latest heartbeat. Keyed by both: an agent may beat with any
    /// instance id it likes, and that must not stand for another agent's instance.
    seen: BTreeMap<(String, String), Seen>,
    /// Per agent, its instances as admitted.
    admitted: BTreeMap<String, InstanceQuota>,
    /// Heartbeats of new instances refused: their agent had `MAX_INSTANCES_PER_AGENT` live, or
    /// started more than `NEW_INSTANCES_PER_S`.
    pub refused_instances: u64,
    /// Heartbeats whose body names another agent than the subject they came on.
    pub forged: u64,
    pub malformed: u64,
    /// Closed connections not looked up because the queue was full.
    pub skipped_lookups: u64,
    /// Deaths being announced at once (each its own task, so a burst of deaths is announced
    /// together rather than one after another).
    announcing: std::sync::Arc<tokio::sync::Semaphore>,
    /// Deaths by missed heartbeats being announced at once: their own turns, so however many
    /// go silent together, a dropped connection's death never waits behind them.
    sweeping: std::sync::Arc<tokio::sync::Semaphore>,
}

/// Deaths announced at once; more wait for a turn.
const ANNOUNCING: usize = 64;
/// Deaths by missed heartbeats announced at once.
const SWEEPING: usize = 16;

/// A death the evidence tells of.
struct Death {
    instance_id: String,
    /// The agents the evidence names (a heartbeat's subject, a closed connection's agents);
    /// none: the instance's records say, as far as `user` may speak for them.
    agents: Vec<String>,
    /// The NATS user of the connection that closed, if that is the evidence.
    user: Option<String>,
    reason: DeathReason,
    detail: String,
    /// Agents other clients (without instance records) were found still serving.
    served_elsewhere: Vec<String>,
    /// Agents another instance still heartbeats for, as this monitor heard: what says whether
    /// the agent lives when the instance records cannot be read (their bucket electing a
    /// leader).
    beating_elsewhere: Vec<String>,
    /// An oam host's instance (it keeps records): its agent's death is claimed by the agent's
    /// tombstone, which the agent's next registration removes. A client without records (the
    /// Python SDK) removes nothing when it comes back, so its agents' deaths are not claimed.
    recorded: bool,
}

impl Monitor {
    pub fn new(app: async_nats::Client) -> Monitor {
        let owner = format!(
            "monitor-{}",
            crate::ids::random_hex(6).unwrap_or_else(|_| crate::clock::now_ms().to_string())
        );
        Monitor {
            announced: BTreeMap::new(),
            mesh: std::sync::Arc::new(store::Mesh::new(app)),
            owner: owner.into(),
            seen: BTreeMap::new(),
            admitted: BTreeMap::new(),
            refused_instances: 0,
            forged: 0,
            malformed: 0,
            skipped_lookups: 0,
            announcing: std::sync::Arc::new(tokio::sync::Semaphore::new(ANNOUNCING)),
            sweeping: std::sync::Arc::new(tokio::sync::Semaphore::new(SWEEPING)),
        }
    }

    /// Instance `instance_id` of `agent` is not followed any more.
    fn forget(&mut self, instance_id: &str, agent: &str) {
        let key = (instance_id.to_string(), agent.to_string());
        if self.seen.remove(&key).is_some()
            && let Some(a) = self.admitted.get_mut(agent)
        {
            a.live = a.live.saturating_sub(1);
        }
    }

    /// Announce (once, cluster-wide) and clean up a death, in a task of its own once one of the
    /// `ANNOUNCING` turns is free: past that the loop waits (backpressure), so a flood of closed
    /// connections cannot pile up tasks. Deaths by missed heartbeats wait for one of their own
    /// `SWEEPING` turns in their task, never in the loop (they are as many as the admitted
    /// instances at most): the loop goes on reading advisories, whose deaths go first.
    async fn died(&mut self, mut death: Death) {
        let now = Instant::now();
        self.announced
            .retain(|_, (at, _)| now.duration_since(*at) < RECENTLY);
        if repeats(
            &self.announced,
            &self.seen,
            &death.instance_id,
            &death.agents,
        ) {
            tracing::info!(instance = %death.instance_id, reason = ?death.reason, "announced a moment ago; not again");
            return;
        }
        self.announced
            .insert(death.instance_id.clone(), (now, death.agents.clone()));
        for agent in &death.agents {
            self.forget(&death.instance_id, agent);
        }
        let limit = HEARTBEAT_EVERY * MISSED_BEATS;
        death.beating_elsewhere = death
            .agents
            .iter()
            .filter(|a| {
                self.seen.iter().any(|((id, agent), s)| {
                    agent == *a && *id != death.instance_id && s.last.elapsed() <= limit
                })
            })
            .cloned()
            .collect();
        let (mesh, owner) = (self.mesh.clone(), self.owner.clone());
        if death.reason == DeathReason::MissedHeartbeats {
            let turns = self.sweeping.clone();
            tokio::spawn(async move {
                let Ok(_turn) = turns.acquire_owned().await else {
                    return;
                };
                announce(&mesh, &owner, death).await;
            });
            return;
        }
        let Ok(turn) = self.announcing.clone().acquire_owned().await else {
            return;
        };
        tokio::spawn(async move {
            announce(&mesh, &owner, death).await;
            drop(turn);
        });
    }

    /// A connection without an instance record that served agents (a Python SDK process)
    /// closed: that instance died.
    async fn client_died(&mut self, c: ClosedClient) {
        let server: String = c.adv.server.id.chars().take(8).collect();
        self.died(Death {
            instance_id: format!("nats-{server}-{}", c.adv.client.id),
            agents: c.agents,
            user: None,
            reason: DeathReason::Disconnect,
            detail: c.adv.reason,
            served_elsewhere: c.served_elsewhere,
            beating_elsewhere: Vec::new(),
            recorded: false,
        })
        .await;
    }

    /// A heartbeat that came on `subject`: believed for the agent the subject names (which only
    /// that agent's user may publish), never for one its body names instead.
    fn heartbeat(&mut self, subject: &str, payload: &[u8]) {
        let on = subjects::health_of(subject).unwrap_or_default();
        match serde_json::from_slice::<AgentHeartbeat>(payload) {
            Ok(h) if h.agent == on => {
                let last = Instant::now();
                let key = (h.instance_id, h.agent);
                if let Some(s) = self.seen.get_mut(&key) {
                    s.last = last;
                    if h.at_ms >= s.at_ms {
                        (s.conn, s.at_ms) = (h.conn, h.at_ms);
                    }
                    return;
                }
                // An instance id is the agent's that beat with it first (an oam host serves one
                // agent an instance): another agent's beat with it is forged, and its silence
                // must not announce the first agent's instance dead.
                let owner = self
                    .seen
                    .range((key.0.clone(), String::new())..)
                    .next()
                    .filter(|((id, _), _)| *id == key.0)
                    .map(|((_, agent), _)| agent.clone());
                if let Some(owner) = owner {
                    self.forged += 1;
                    tracing::warn!(
                        subject,
                        instance_id = key.0,
                        owner,
                        "a heartbeat names another agent's instance; ignored"
                    );
                    return;
                }
                let admission = self
                    .admitted
                    .entry(key.1.clone())
                    .or_insert_with(|| InstanceQuota::new(last));
                if !admission.admit(last) {
                    self.refused_instances += 1;
                    if self.refused_instances.is_power_of_two() {
                        tracing::warn!(
                            agent = key.1,
                            refused = self.refused_instances,
                            "heartbeats of new instances refused: an agent may have {} live and \
                             start {} a second",
                            MAX_INSTANCES_PER_AGENT,
                            NEW_INSTANCES_PER_S
                        );
                    }
                    return;
                }
                self.seen.insert(
                    key,
                    Seen {
                        last,
                        conn: h.conn,
                        at_ms: h.at_ms,
                    },
                );
            }
            Ok(h) => {
                self.forged += 1;
                tracing::warn!(
                    subject,
                    agent = h.agent,
                    "a heartbeat names another agent than its subject; ignored"
                );
            }
            Err(_) => self.malformed += 1,
        }
    }

    /// The agents instance `id` stood for, as far as a closed connection of `user` may say.
    fn beating_for(&self, id: &str, user: &str) -> Vec<String> {
        self.seen
            .keys()
            .filter(|(i, agent)| i == id && may_speak_for(user, agent))
            .map(|(_, agent)| agent.clone())
            .collect()
    }

    /// This monitor's own view was dark (its connection to its server took no round trip) and
    /// is back: every instance gets a fresh bound, as none of them could be heard meanwhile.
    fn see_again(&mut self) {
        let now = Instant::now();
        for s in self.seen.values_mut() {
            s.last = now;
        }
    }

    /// Instances whose heartbeats stopped (a frozen or partitioned process keeps its TCP
    /// connection for a while; its heartbeats stop at once).
    fn silent(&self) -> Vec<(String, String)> {
        let limit = HEARTBEAT_EVERY * MISSED_BEATS;
        self.seen
            .iter()
            .filter(|(_, s)| s.last.elapsed() > limit)
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Instance records present at start (left by a previous run, or by hosts whose monitor was
    /// down) get the same chance as everyone else: heartbeat within the limit or be declared dead.
    async fn adopt_records(&mut self) {
        let now = Instant::now();
        for rec in store::all_instances(&self.mesh).await.unwrap_or_default() {
            let agent = rec.agents.first().cloned().unwrap_or_default();
            let key = (rec.instance_id, agent);
            if self.seen.contains_key(&key) {
                continue;
            }
            // Records are admitted as heartbeats are: no more per agent than it may have.
            let admission = self
                .admitted
                .entry(key.1.clone())
                .or_insert_with(|| InstanceQuota::new(now));
            if admission.admit(now) {
                self.seen.insert(
                    key,
                    Seen {
                        last: now,
                        conn: None,
                        at_ms: 0,
                    },
                );
            }
        }
    }
}

/// Announce a death and clean up after it. The instance's notice first (callers holding a
/// request on it fail at once), then its records go, and only then is it counted whether other
/// instances still serve each of its agents: of instances dying together (each announced by a
/// task of its own) the last to go finds none left, and the agent's tombstone makes one of those
/// that find none say so. The catalog and registry are cleaned last.
async fn announce(mesh: &std::sync::Arc<store::Mesh>, owner: &str, d: Death) {
    let app = mesh.nats();
    let id = d.instance_id.as_str();
    let mut agents = d.agents;
    if agents.is_empty() {
        agents = store::instance(mesh, id)
            .await
            .map(|r| r.agents)
            .unwrap_or_default();
        if let Some(user) = &d.user {
            agents.retain(|a| may_speak_for(user, a));
        }
    }
    let Some(first) = agents.first().cloned() else {
        tracing::info!(
            instance_id = id,
            user = d.user,
            "a closed connection named for an instance its user does not serve; no death"
        );
        return;
    };
    // The tombstone is the agent's (`{id}.{agent}`, where only that agent and the monitor may
    // write).
    let claim = store::claim_tombstone(mesh, id, Some(&first), owner).await;
    if !claim.mine() {
        // Another monitor (or an earlier run) announced it; said, not skipped silently.
        tracing::info!(
            instance_id = id,
            reason = d.reason.as_str(),
            "death already announced (its tombstone exists); not announced again"
        );
        return;
    }
    let detected_at = store::rfc3339_now();
    let detected_at_ms = crate::clock::now_ms();
    let notice = |agent: &str| DeathNotice {
        agent: agent.to_string(),
        reason: d.reason,
        detected_at: detected_at.clone(),
        instance_id: id.to_string(),
        detail: (!d.detail.is_empty()).then(|| d.detail.clone()),
        detected_at_ms: Some(detected_at_ms),
    };
    // Not flushed on its own: the requests below go out after it, on the same connection.
    if let Ok(body) = serde_json::to_vec(&notice(&first)) {
        let _ = app.publish(subjects::instance_death(id), body.into()).await;
    }
    // A bucket that did not answer the claim (its leader died) is not waited for again: the
    // instance's records go once it answers, and the heartbeats this monitor hears say whether
    // other instances serve its agents (unknown is not dead: a false notice would fail every
    // caller of the agent).
    let answers = claim != store::Claim::Unanswered;
    if answers {
        // Its records go before others are counted.
        let forgotten = store::forget_instance(mesh, id, &agents);
        let _ = tokio::time::timeout(store::CLAIM_WITHIN, forgotten).await;
    } else {
        let (mesh, id, agents) = (mesh.clone(), id.to_string(), agents.clone());
        tokio::spawn(async move { store::forget_instance(&mesh, &id, &agents).await });
    }
    let mut dead = Vec::new();
    for agent in &agents {
        let others = async {
            if !answers {
                return None;
            }
            let read = store::instances_of(mesh, agent);
            match tokio::time::timeout(store::CLAIM_WITHIN, read).await {
                Ok(Ok(others)) => Some(others.iter().any(|r| r.instance_id != id)),
                Ok(Err(e)) => {
                    tracing::warn!(agent, "instance records unread ({e:#}); heartbeats tell");
                    None
                }
                Err(_) => {
                    tracing::warn!(agent, "instance records unread in time; heartbeats tell");
                    None
                }
            }
        };
        let alive = d.served_elsewhere.contains(agent)
            || others
                .await
                .unwrap_or_else(|| d.beating_elsewhere.contains(agent));
        tracing::info!(
            agent,
            instance_id = id,
            reason = ?d.reason,
            detail = d.detail,
            last = !alive,
            "death"
        );
        if alive
            || (d.recorded
                && !store::claim_agent_death(mesh, agent, owner, answers)
                    .await
                    .mine())
        {
            continue;
        }
        if let Ok(body) = serde_json::to_vec(&notice(agent)) {
            let _ = app.publish(subjects::death(agent), body.into()).await;
            flush_within(app, FLUSH_WITHIN).await;
        }
        dead.push(agent.clone());
    }
    store::forget_agents(mesh, &dead).await;
}

/// Ask server `server` (any, if empty) for connections: open ones, or the closed one `cid`.
async fn connz(sys: &async_nats::Client, server: &str, query: serde_json::Value) -> Option<Connz> {
    let subject = subjects::sys_connz(server);
    let body = serde_json::to_vec(&query).ok()?;
    let reply = tokio::time::timeout(Duration::from_secs(2), sys.request(subject, body.into()))
        .await
        .ok()?
        .ok()?;
    serde_json::from_slice(&reply.payload).ok()
}

/// How long every server of a cluster has to answer a question asked of all of them.
const GATHER_WITHIN: Duration = Duration::from_secs(2);

/// Ask every server `body` on `subject` and gather the replies until `expected` came or
/// `within` passed.
async fn gather(
    sys: &async_nats::Client,
    subject: &str,
    body: bytes::Bytes,
    expected: usize,
    within: Duration,
) -> Vec<async_nats::Message> {
    let inbox = sys.new_inbox();
    let Ok(mut replies) = sys.subscribe(inbox.clone()).await else {
        return Vec::new();
    };
    if sys
        .publish_with_reply(subject.to_string(), inbox, body)
        .await
        .is_err()
    {
        return Vec::new();
    }
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    while got.len() < expected {
        match tokio::time::timeout_at(deadline, replies.next()).await {
            Ok(Some(m)) => got.push(m),
            Ok(None) | Err(_) => break,
        }
    }
    got
}

/// A ROUTEZ reply: the server, and the servers its routes reach.
#[derive(Deserialize, Default)]
struct Routez {
    #[serde(default)]
    server: AdvisoryServer,
    #[serde(default)]
    data: RoutezData,
}

#[derive(Deserialize, Default)]
struct RoutezData {
    #[serde(default)]
    routes: Vec<ServerRoute>,
}

#[derive(Deserialize, Default)]
struct ServerRoute {
    #[serde(default)]
    remote_id: String,
}

/// Ask every server for connections and gather the answers: the answers, and whether every
/// server the cluster holds answered. One server's answer is not the cluster's: a connection
/// lives on one of them. The cluster is as many servers as it tells its clients; when fewer
/// answer (the count a client was told can be stale once a server is gone), the servers that
/// did answer say which others their routes still reach.
async fn connz_all(sys: &async_nats::Client, query: serde_json::Value) -> (Vec<Connz>, bool) {
    let told = crate::transport::store::cluster_size(sys);
    let Ok(body) = serde_json::to_vec(&query) else {
        return (Vec::new(), false);
    };
    let replies = gather(
        sys,
        &subjects::sys_connz(""),
        body.into(),
        told,
        GATHER_WITHIN,
    )
    .await;
    let answers: Vec<Connz> = replies
        .iter()
        .filter_map(|m| serde_json::from_slice(&m.payload).ok())
        .collect();
    if answers.len() >= told {
        return (answers, true);
    }
    let answered: std::collections::BTreeSet<&str> =
        answers.iter().map(|a| a.server.id.as_str()).collect();
    let routes = gather(
        sys,
        subjects::SYS_ROUTEZ,
        "{}".into(),
        answers.len(),
        GATHER_WITHIN,
    )
    .await;
    let mut held = std::collections::BTreeSet::new();
    for m in &routes {
        let Ok(r) = serde_json::from_slice::<Routez>(&m.payload) else {
            return (answers, false);
        };
        held.insert(r.server.id);
        held.extend(r.data.routes.into_iter().map(|r| r.remote_id));
    }
    let all = routes.len() >= answers.len()
        && !answers.is_empty()
        && held.iter().all(|id| answered.contains(id.as_str()));
    (answers, all)
}

/// The client port of the open connection named `name` (what `oam-host-{id}` connections
/// are called), on whichever server holds it: how the warden ties an instance to a process.
pub(crate) async fn connection_port(sys: &async_nats::Client, name: &str) -> Option<u16> {
    let query = serde_json::json!({"state": 0, "limit": 100_000});
    let (answers, _) = connz_all(sys, query).await;
    answers
        .into_iter()
        .flat_map(|c| c.data.connections)
        .find(|c| c.name == name)
        .map(|c| c.port)
}

/// The agents a closed connection served (none for callers, nodes and tools), from the server
/// that held it.
async fn agents_of_closed(sys: &async_nats::Client, adv: &Advisory) -> Vec<String> {
    let query = serde_json::json!({
        "cid": adv.client.id,
        "state": 1,
        "acc": adv.client.acc,
        "subscriptions_detail": true,
    });
    // A busy server may not answer in time, and the server saves a closed connection in a task
    // of its own that may run after it sent the advisory: not found yet is asked again, after
    // a pause that doubles (a death missed here is never announced, as such clients send no
    // heartbeats of their own to miss).
    let mut pause = Duration::from_millis(20);
    for attempt in 0..LOOKUP_TRIES {
        match connz(sys, &adv.server.id, query.clone()).await {
            Some(c) if c.data.connections.iter().any(|c| c.cid == adv.client.id) => {
                return c
                    .data
                    .connections
                    .iter()
                    .flat_map(|c| agents_served(&c.subscriptions_list_detail))
                    .collect();
            }
            Some(_) => {
                tracing::debug!(
                    cid = adv.client.id,
                    attempt,
                    "closed connection not saved yet"
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
            None => tracing::warn!(
                cid = adv.client.id,
                attempt,
                "the server did not say what a closed connection served; asking again"
            ),
        }
    }
    tracing::warn!(
        cid = adv.client.id,
        "the server never said what a closed connection served; no death told for it"
    );
    Vec::new()
}

/// How many times the server is asked what a closed connection served: pauses of 20 ms
/// doubling to 500 ms make about 3 s of waiting for a connection the server saves late.
const LOOKUP_TRIES: u32 = 10;

/// A closed connection without instance records that served agents, and which of those other
/// clients still serve.
struct ClosedClient {
    adv: Advisory,
    agents: Vec<String>,
    served_elsewhere: Vec<String>,
}

/// Whether a connection that is not an oam host (those have instance records) still serves
/// `agent` on any server of the cluster: an Open Agent Mesh client such as the Python SDK.
async fn other_clients_serve(sys: &async_nats::Client, account: &str, agent: &str) -> bool {
    let query = serde_json::json!({
        "acc": account,
        "filter_subject": subjects::agent(agent),
        "subscriptions_detail": true,
    });
    // A cluster that did not all answer is asked again; unknown at the end is not dead: a false
    // death notice would fail every caller of the agent.
    for attempt in 0..3 {
        let (answers, all) = connz_all(sys, query.clone()).await;
        let serves = answers.iter().flat_map(|c| &c.data.connections).any(|c| {
            instance_of(&c.name).is_none()
                && agents_served(&c.subscriptions_list_detail)
                    .iter()
                    .any(|a| a == agent)
        });
        if serves || all {
            return serves;
        }
        tracing::warn!(
            agent,
            attempt,
            "not every server said who serves an agent; asking again"
        );
    }
    true
}

/// Everything the monitor needs to know about a closed connection, asked of the server; `None`
/// when it served no agents (a caller, a node, a tool).
async fn look_up(sys: &async_nats::Client, adv: Advisory) -> Option<ClosedClient> {
    let agents = agents_of_closed(sys, &adv).await;
    if agents.is_empty() {
        return None;
    }
    let mut served_elsewhere = Vec::new();
    for agent in &agents {
        if other_clients_serve(sys, &adv.client.acc, agent).await {
            served_elsewhere.push(agent.clone());
        }
    }
    Some(ClosedClient {
        adv,
        agents,
        served_elsewhere,
    })
}

/// How often the connections that serve agents without instance records are counted on
/// every server (`census`): how soon those that die with their server are noticed.
const CENSUS_EVERY: Duration = Duration::from_secs(1);

/// A complete count of the connections that serve agents without instance records (the
/// Python SDK's), by server; `None` when not every server the cluster lists answered.
async fn census_count(sys: &async_nats::Client) -> Option<super::census::Count> {
    // Every open connection with its subscriptions (the server filters by subject only within
    // one named account), read here for the agents each serves.
    let query = serde_json::json!({"state": 0, "limit": 100_000, "subscriptions_detail": true});
    let (answers, all) = connz_all(sys, query).await;
    if !all {
        tracing::debug!(
            answered = answers.len(),
            "census: not every server answered"
        );
        return None;
    }
    let mut count = super::census::Count::default();
    for a in answers {
        for c in a.data.connections {
            let agents = agents_served(&c.subscriptions_list_detail);
            if instance_of(&c.name).is_none() && !agents.is_empty() {
                count.conns.push(super::census::Conn {
                    server: a.server.id.clone(),
                    cid: c.cid,
                    agents,
                });
            }
        }
        count.servers.insert(a.server.id);
    }
    Some(count)
}

/// Look-ups of closed connections running at once.
const LOOKUPS: usize = 16;
/// Closed connections waiting for a look-up; beyond this they are counted and skipped.
const LOOKUP_QUEUE: usize = 4_096;

/// Run until `stop`: `sys` reads `$SYS` advisories, `app` does everything else. `ready` is
/// called once both subscriptions are in place at the server.
pub async fn run(
    app: async_nats::Client,
    sys: async_nats::Client,
    ready: impl FnOnce(),
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), super::RunError> {
    let mut advisories = sys.subscribe(subjects::SYS_DISCONNECTS).await?;
    let mut beats = crate::transport::published::subscribe(&app, subjects::HEALTH).await?;
    sys.flush().await?;
    app.flush().await?;
    ready();
    let mut m = Monitor::new(app);
    m.mesh.open_all().await;
    m.adopt_records().await;
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    let census_sys = sys.clone();
    // Closed connections without instance records are looked up off the loop (a bounded queue,
    // LOOKUPS at once), so neither deaths nor heartbeats wait on the server's answers.
    let (lookup_tx, lookup_rx) = tokio::sync::mpsc::channel::<Advisory>(LOOKUP_QUEUE);
    let (found_tx, mut found) = tokio::sync::mpsc::channel::<ClosedClient>(LOOKUP_QUEUE);
    let queue = futures_util::stream::unfold(lookup_rx, |mut rx| async move {
        rx.recv().await.map(|adv| (adv, rx))
    });
    tokio::spawn(queue.for_each_concurrent(LOOKUPS, move |adv| {
        let (sys, found_tx) = (sys.clone(), found_tx.clone());
        async move {
            if let Some(c) = look_up(&sys, adv).await {
                let _ = found_tx.send(c).await;
            }
        }
    }));
    // The census is counted off the loop too; a count not taken yet is never waited for.
    let (count_tx, mut counts) = tokio::sync::mpsc::channel::<super::census::Count>(1);
    let counting = tokio::spawn(async move {
        let mut every = tokio::time::interval(CENSUS_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            if let Some(count) = census_count(&census_sys).await
                && count_tx.send(count).await.is_err()
            {
                return;
            }
        }
    });
    let _counting = AbortOnDrop(counting);
    let mut census = super::census::Census::default();
    let bound_ms = (HEARTBEAT_EVERY * MISSED_BEATS).as_millis() as u64;
    // Whether this monitor hears its server (`View`): silence it could not hear is not the
    // instances'.
    let mut view = View::new(m.mesh.nats());
    tokio::pin!(stop);
    loop {
        tokio::select! {
            biased;
            _ = &mut stop => return Ok(()),
            Some(count) = counts.recv() => {
                for d in census.update(count, crate::clock::now_ms(), bound_ms) {
                    m.died(Death {
                        instance_id: d.instance_id,
                        agents: d.agents,
                        user: None,
                        reason: DeathReason::Disconnect,
                        detail: "its nats-server is gone and it did not reconnect elsewhere".into(),
                        served_elsewhere: d.served_elsewhere,
                        beating_elsewhere: Vec::new(),
                        recorded: false,
                    })
                    .await;
                }
            }
            Some(msg) = beats.next() => m.heartbeat(&msg.subject, &msg.payload),
            Some(msg) = advisories.next() => {
                let Ok(adv) = serde_json::from_slice::<Advisory>(&msg.payload) else {
                    m.malformed += 1;
                    continue;
                };
                if let Some(id) = instance_of(&adv.client.name) {
                    // A connection's name is its own to choose: it stands only for the agents
                    // its user may speak for.
                    let instance_id = id.to_string();
                    let mut agents = m.beating_for(&instance_id, &adv.client.user);
                    let closed = super::protocol::conn_name(&adv.server.id, adv.client.id);
                    let named = !agents.is_empty();
                    let moved = moved(&m.seen, &instance_id, &agents, &closed);
                    for ((_, agent), s) in m.seen.iter().filter(|((i, _), _)| *i == instance_id) {
                        tracing::info!(instance = %instance_id, agent, %closed, beat_on = ?s.conn, ago = ?s.last.elapsed(), "a connection of a beating instance closed");
                    }
                    if !moved.is_empty() {
                        tracing::info!(instance = %instance_id, ?moved, "an old connection closed; the instance beats on another");
                        agents.retain(|a| !moved.contains(a));
                    }
                    // A close met while the monitor could not hear beats (it was reconnecting
                    // itself since the instance last beat): whether the instance beats on
                    // another connection is not known, so its heartbeats decide, from now.
                    let connected = m.mesh.nats().connection_state()
                        == async_nats::connection::State::Connected;
                    let unheard: Vec<String> = agents
                        .iter()
                        .filter(|a| {
                            m.seen
                                .get(&(instance_id.clone(), (*a).clone()))
                                .is_some_and(|s| view.blind_since(connected, s.last))
                        })
                        .cloned()
                        .collect();
                    if !unheard.is_empty() {
                        tracing::info!(instance = %instance_id, ?unheard, "a connection closed while the monitor could not hear beats; its heartbeats decide");
                        for a in &unheard {
                            if let Some(s) = m.seen.get_mut(&(instance_id.clone(), a.clone())) {
                                s.last = Instant::now();
                            }
                        }
                        agents.retain(|a| !unheard.contains(a));
                    }
                    if named && agents.is_empty() {
                        continue;
                    }
                    m.died(Death {
                        instance_id,
                        agents,
                        user: Some(adv.client.user),
                        reason: DeathReason::Disconnect,
                        detail: adv.reason,
                        served_elsewhere: Vec::new(),
                        beating_elsewhere: Vec::new(),
                        recorded: true,
                    })
                    .await;
                } else if lookup_tx.try_send(adv).is_err() {
                    m.skipped_lookups += 1;
                    tracing::warn!("{} closed connections not looked up: too many at once", m.skipped_lookups);
                }
            }
            Some(c) = found.recv() => m.client_died(c).await,
            _ = sweep.tick() => {
                match view.look(m.mesh.nats()) {
                    Look::Dark => continue,
                    Look::Back => {
                        tracing::info!("the monitor is connected again; every instance gets a fresh bound");
                        m.see_again();
                        continue;
                    }
                    Look::Clear => {}
                }
                if m.silent().is_empty() {
                    continue;
                }
                // Beats the server sent before now may not be read yet: a monitor that did not
                // run for a while (paused, starved of CPU) finds them in its socket. A round
                // trip to the server brings every one of them in before silence is judged (one
                // unanswered within its limit has given the connection that long to read).
                if !m.mesh.round_trip(ROUND_TRIP_WITHIN).await {
                    tracing::debug!("no round trip before judging silence");
                }
                for _ in 0..MAX_DRAINED {
                    match futures_util::FutureExt::now_or_never(beats.next()) {
                        Some(Some(msg)) => m.heartbeat(&msg.subject, &msg.payload),
                        _ => break,
                    }
                }
                for (instance_id, agent) in m.silent() {
                    m.died(Death {
                        instance_id,
                        agents: vec![agent],
                        user: None,
                        reason: DeathReason::MissedHeartbeats,
                        detail: "no heartbeat for 3 intervals".into(),
                        served_elsewhere: Vec::new(),
                        beating_elsewhere: Vec::new(),
                        recorded: true,
                    })
                    .await;
                }
            }
        }
    }
}

/// Whether the monitor could hear heartbeats since it last looked: its connection is up and
/// was not made again meanwhile. Its connection pings often (`connect::LIVENESS_PING`), so a
/// server that freezes under it is left within about 1.5 s, before any instance it heard has
/// been silent for the verdict's 3 s; while it is away (reconnecting, or every server gone)
/// and when it is back, silence is its own: every instance gets a fresh bound.
struct View {
    connects: u64,
    dark: bool,
    /// When the monitor was last found connected again.
    back_at: Option<Instant>,
}

enum Look {
    /// Connected all along.
    Clear,
    /// Not connected now.
    Dark,
    /// Connected again since the last look.
    Back,
}

impl View {
    fn new(nats: &async_nats::Client) -> View {
        View {
            connects: nats
                .statistics()
                .connects
                .load(std::sync::atomic::Ordering::Relaxed),
            dark: false,
            back_at: None,
        }
    }

    /// Could the monitor have missed beats sent after `since` (it is not `connected` now, or
    /// was connected again after it)?
    fn blind_since(&self, connected: bool, since: Instant) -> bool {
        !connected || self.dark || self.back_at.is_some_and(|t| t > since)
    }

    fn look(&mut self, nats: &async_nats::Client) -> Look {
        let connects = nats
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed);
        if nats.connection_state() != async_nats::connection::State::Connected {
            if !self.dark {
                tracing::warn!(
                    "the monitor lost its server: no instance is judged by its heartbeats until it is back"
                );
            }
            self.dark = true;
            return Look::Dark;
        }
        let back = self.dark || connects != self.connects;
        if back {
            self.back_at = Some(Instant::now());
        }
        self.connects = connects;
        self.dark = false;
        if back { Look::Back } else { Look::Clear }
    }
}

/// A task stopped when its handle goes.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instance_beating_on_another_connection_is_not_dead_when_an_old_one_closes() {
        let now = Instant::now();
        let key = |a: &str| ("i1".to_string(), a.to_string());
        let mut seen = BTreeMap::new();
        seen.insert(
            key("a"),
            Seen {
                last: now,
                conn: Some("S2/7".into()),
                at_ms: 2,
            },
        );
        seen.insert(
            key("b"),
            Seen {
                last: now,
                conn: None,
                at_ms: 2,
            },
        );
        let agents = vec!["a".to_string(), "b".to_string()];
        assert_eq!(
            moved(&seen, "i1", &agents, "S1/3"),
            ["a"],
            "b never said its connection"
        );
        assert!(
            moved(&seen, "i1", &agents, "S2/7").is_empty(),
            "its own connection closed"
        );
        assert!(
            moved(&seen, "i2", &agents, "S1/3").is_empty(),
            "another instance"
        );
        seen.get_mut(&key("a")).unwrap().last =
            now - HEARTBEAT_EVERY * MISSED_BEATS - Duration::from_millis(1);
        assert!(
            moved(&seen, "i1", &agents, "S1/3").is_empty(),
            "silent past the bound"
        );
    }

    #[test]
    fn a_close_met_while_the_monitor_could_not_hear_is_judged_by_heartbeats() {
        let t0 = Instant::now();
        let beat = t0 + Duration::from_millis(10);
        let mut v = View {
            connects: 1,
            dark: false,
            back_at: None,
        };
        assert!(!v.blind_since(true, beat), "connected all along");
        assert!(v.blind_since(false, beat), "not connected now");
        v.back_at = Some(t0);
        assert!(
            !v.blind_since(true, beat),
            "back before the beat: it would have heard more"
        );
        v.back_at = Some(beat + Duration::from_millis(1));
        assert!(
            v.blind_since(true, beat),
            "back after the beat: beats may have gone unheard"
        );
        v.dark = true;
        assert!(v.blind_since(true, t0 + Duration::from_secs(9)));
    }

    #[test]
    fn a_death_told_a_moment_ago_is_not_told_again_unless_it_lived_since() {
        let mut announced = BTreeMap::new();
        announced.insert("i1".to_string(), (Instant::now(), vec!["a".to_string()]));
        let mut seen = BTreeMap::new();
        let a = vec!["a".to_string()];
        assert!(repeats(&announced, &seen, "i1", &a), "the same death");
        assert!(
            repeats(&announced, &seen, "i1", &[]),
            "the records would say the same"
        );
        assert!(!repeats(&announced, &seen, "i2", &a), "another instance");
        assert!(
            !repeats(&announced, &seen, "i1", &["b".to_string()]),
            "an agent not named then"
        );
        seen.insert(
            ("i1".to_string(), "a".to_string()),
            Seen {
                last: Instant::now(),
                conn: None,
                at_ms: 1,
            },
        );
        assert!(
            !repeats(&announced, &seen, "i1", &a),
            "it beat again since: a new death"
        );
    }

    #[test]
    fn a_connection_speaks_only_for_its_own_agent() {
        assert!(may_speak_for("agent-demo.echo", "demo.echo"));
        assert!(!may_speak_for("agent-evil", "demo.echo"));
        assert!(!may_speak_for("caller", "demo.echo"));
        assert!(!may_speak_for("node-n1", "demo.echo"));
        // The admin, and users of a server configured by someone else, are not ours to judge.
        assert!(may_speak_for("oam", "demo.echo"));
        assert!(may_speak_for("", "demo.echo"));
        assert!(may_speak_for("UABC123", "demo.echo"));
    }

    #[test]
    fn an_agent_may_have_so_many_instances_and_start_so_many_a_second() {
        let t0 = Instant::now();
        let mut a = InstanceQuota::new(t0);
        let burst = (0..5_000).filter(|_| a.admit(t0)).count();
        assert_eq!(burst, MAX_INSTANCES_PER_AGENT);
        // Every one live: no more, however long it waits.
        assert!(!a.admit(t0 + Duration::from_secs(60)));
        // Half of them gone a second after the burst: new ones at the stated rate.
        let mut a = InstanceQuota::new(t0);
        (0..MAX_INSTANCES_PER_AGENT).for_each(|_| assert!(a.admit(t0)));
        a.live /= 2;
        let later = t0 + Duration::from_secs(1);
        let n = (0..100).filter(|_| a.admit(later)).count();
        assert_eq!(n, NEW_INSTANCES_PER_S as usize);
    }

    #[test]
    fn only_oam_hosts_map_to_instances() {
        assert_eq!(instance_of("oam-host-ab12"), Some("ab12"));
        assert_eq!(instance_of("oam-host-"), None);
        assert_eq!(instance_of("oam-node-n1"), None);
        assert_eq!(instance_of(""), None);
    }

    #[test]
    fn advisories_parse_with_missing_fields() {
        let a: Advisory = serde_json::from_str(
            r#"{"type":"io.nats.server.advisory.v1.client_disconnect","client":{"name":"oam-host-x","acc":"APP"},"reason":"Client Closed"}"#,
        )
        .unwrap();
        assert_eq!(
            (a.client.name.as_str(), a.reason.as_str()),
            ("oam-host-x", "Client Closed")
        );
        let empty: Advisory = serde_json::from_str("{}").unwrap();
        assert!(instance_of(&empty.client.name).is_none());
    }
}
