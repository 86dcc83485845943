//! What `oam watch` knows: a pure model fed by bus events (`apply`) and the clock (`now_ms` is an
//! argument), plus the operator's view settings. Rendering reads it and nothing else.

use crate::core::chaos::{Active, Fault};
use crate::core::health::Verdict as Health;
use crate::core::loops::Incident;
use crate::core::pipeline::{Decision, DecisionOutcome};
use crate::core::reason::Phase;
use crate::core::wire::NodeSnapshot;
use crate::mesh::protocol::{AgentHeartbeat, DeathNotice};
use crate::transport::store::escalations::{EscalationRecord, Status};
use std::collections::{BTreeMap, VecDeque};

/// Decisions kept for the stream.
pub(crate) const STREAM_CAPACITY: usize = 2_000;
/// Seconds of throughput and p95 history.
pub(crate) const HISTORY_SECS: usize = 60;
/// A node whose state snapshot is older than this is shown as down.
pub(crate) const NODE_SILENT_MS: u64 = 3_500;
/// Open escalations kept (the oldest go first beyond this).
pub(crate) const OPEN_ESCALATIONS_KEPT: usize = 1_000;
/// An agent instance whose heartbeat is older than this is shown as stale.
pub(crate) const AGENT_STALE_MS: u64 = 3_000;
/// The banner follows what requests experienced this recently (rerouted, failed).
pub(crate) const BANNER_WINDOW_MS: u64 = 2_000;
/// Traffic shares are computed over decisions this recent.
pub(crate) const SHARE_WINDOW_MS: u64 = 10_000;

/// What one recent decision means for the banner and the shares (kept whatever the stream's
/// pause and filter).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Recent {
    /// When the view received it (its own clock: nodes' clocks may differ).
    pub seen_ms: u64,
    /// Served by another provider than first chosen, or by a fallback.
    pub rerouted: bool,
    /// Not answered (refused, shed, escalated).
    pub failed: bool,
    pub provider: String,
}

/// The chaos menu: (label, fault or `None` to restore everything, target, seconds).
pub(crate) const CHAOS_MENU: &[(&str, Option<Fault>, Option<&str>, u64)] = &[
    (
        "kill provider primary (30 s)",
        Some(Fault::KillProvider),
        Some("primary"),
        30,
    ),
    (
        "break primary's contract (30 s)",
        Some(Fault::BreakContract),
        Some("primary"),
        30,
    ),
    (
        "slow provider primary (30 s)",
        Some(Fault::SlowProvider),
        Some("primary"),
        30,
    ),
    ("kill node n2 (20 s)", Some(Fault::KillNode), Some("n2"), 20),
    (
        "isolate node n3 (20 s)",
        Some(Fault::IsolateNode),
        Some("n3"),
        20,
    ),
    ("traffic spike (10 s)", Some(Fault::TrafficSpike), None, 10),
    ("agent loop (10 s)", Some(Fault::AgentLoop), None, 10),
    ("restore everything", None, None, 0),
];

/// A key, as the model sees it (the driver translates the terminal's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Key {
    Char(char),
    /// Ctrl and a letter.
    Ctrl(char),
    Enter,
    Esc,
    Backspace,
    Tab,
    Up,
    Down,
    PageUp,
    PageDown,
    Home,
    End,
    Other,
}

/// What a key asks of the driver, beyond changing the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum KeyEffect {
    None,
    Quit,
    /// Apply chaos menu entry `n`.
    Chaos(usize),
    /// Mark an open escalation (by id) acknowledged or resolved.
    Mark(crate::transport::store::escalations::Mark, String),
}

/// Something that arrived from the bus (or the connection itself).
#[derive(Clone, Debug)]
pub(crate) enum Update {
    /// A node's `/v1/oam/state` snapshot, published every second on `oam.v1.state.{node}`.
    NodeState {
        node: String,
        state: Box<NodeSnapshot>,
    },
    /// A decision from `oam.v1.decision.{node}`.
    Decision {
        node: String,
        decision: Box<Decision>,
    },
    /// An escalation record from the escalation store, open or resolved.
    Escalation(Box<EscalationRecord>),
    /// A record deleted from the store (by its key).
    EscalationGone(String),
    /// The store is about to be read again from the start: forget what it said.
    EscalationsReread,
    /// An agent-loop incident from `oam.v1.incident.{node}`.
    Incident { node: String, incident: Incident },
    /// A death notice from `mesh.death.{name}`.
    Death(DeathNotice),
    /// An agent instance's heartbeat from `mesh.health.{name}`.
    AgentBeat(AgentHeartbeat),
    /// The catalog (names and whether they stream), read every few seconds.
    Catalog(Vec<String>),
    /// The chaos warden's active faults (on start and on every chaos event).
    Chaos(Vec<Active>),
    /// Connected to NATS, or not.
    Connection(bool),
    /// A message on this subject that did not parse (another version, or a hostile sender).
    Unreadable(String),
}

/// One decision as a line of the stream.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Line {
    pub at_ms: u64,
    pub request_id: String,
    pub node: String,
    pub agent: String,
    pub kind: LineKind,
    pub provider: String,
    pub phase: String,
    pub codes: Vec<String>,
    pub latency_ms: u64,
}

/// How a decision is coloured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LineKind {
    Accepted,
    Fallback,
    Shed,
    Escalated,
    Refused,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct NodeView {
    pub state: NodeSnapshot,
    pub seen_ms: u64,
}

#[derive(Clone, Debug)]
pub(crate) struct Instance {
    pub agent: String,
    pub in_flight: u64,
    pub seen_ms: u64,
}

/// One second of decisions: how many, and their latencies until the second is over, when they
/// are reduced to their p95 (so a frame does not sort them again).
#[derive(Clone, Debug, Default)]
pub(crate) struct Second {
    pub count: u64,
    latencies: Vec<u64>,
    p95: Option<u64>,
}

impl Second {
    fn p95(&self) -> u64 {
        self.p95.unwrap_or_else(|| p95_of(&self.latencies))
    }
}

fn p95_of(latencies: &[u64]) -> u64 {
    let mut l = latencies.to_vec();
    l.sort_unstable();
    crate::core::health::nearest_rank(&l, 95)
}

/// Which panel has the keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub(crate) enum Focus {
    #[default]
    Stream,
    Nodes,
    Providers,
    Attention,
    Agents,
}

impl Focus {
    pub(crate) fn next(self) -> Focus {
        match self {
            Focus::Stream => Focus::Nodes,
            Focus::Nodes => Focus::Providers,
            Focus::Providers => Focus::Attention,
            Focus::Attention => Focus::Agents,
            Focus::Agents => Focus::Stream,
        }
    }
}

/// The whole picture.
#[derive(Clone, Debug, Default)]
pub(crate) struct App {
    pub nodes: BTreeMap<String, NodeView>,
    pub stream: VecDeque<Line>,
    /// Per second (ms of the second's start -> (decisions, latencies)).
    pub seconds: BTreeMap<u64, Second>,
    /// Open escalations by store key.
    pub escalations: BTreeMap<String, EscalationRecord>,
    pub incidents: VecDeque<(u64, String, Incident)>,
    pub deaths: VecDeque<(u64, DeathNotice)>,
    pub instances: BTreeMap<String, Instance>,
    /// Decisions of the last `SHARE_WINDOW_MS`, oldest first.
    pub recent: VecDeque<Recent>,
    pub catalog: Vec<String>,
    pub chaos: Vec<Active>,
    pub connected: bool,
    /// When the connection to NATS was lost: the picture is that moment's, kept (greyed) until
    /// the bus is back, not aged into "every node down".
    pub lost_at_ms: Option<u64>,
    /// Events the bounded channel had to drop (the watcher fell behind).
    pub dropped: u64,
    /// Messages that did not parse, and the subject of the last one.
    pub unreadable: u64,
    pub unreadable_subject: String,
    pub applied: u64,
    // The operator's view.
    pub focus: Focus,
    /// How far the stream is scrolled back from the newest line.
    pub scroll: usize,
    /// The first row shown in the nodes, providers, attention and agents panels.
    pub offsets: BTreeMap<Focus, usize>,
    pub paused: bool,
    pub filter: String,
    pub editing_filter: bool,
    pub help: bool,
    pub chaos_menu: Option<usize>,
    /// The last thing the operator did, and how it went.
    pub status: String,
}

fn push_bounded<T>(q: &mut VecDeque<T>, item: T, cap: usize) {
    if q.len() == cap {
        q.pop_front();
    }
    q.push_back(item);
}

fn line_of(node: &str, d: &Decision) -> Line {
    let accepted = d.outcome == DecisionOutcome::Accepted;
    let kind = if d.outcome == DecisionOutcome::Escalated {
        LineKind::Escalated
    } else if d.phase == Phase::Admission {
        LineKind::Shed
    } else if accepted && d.fallback {
        LineKind::Fallback
    } else if accepted {
        LineKind::Accepted
    } else {
        LineKind::Refused
    };
    Line {
        at_ms: d.decided_at_ms,
        request_id: d.request_id.clone(),
        node: node.to_string(),
        agent: d.agent.clone(),
        kind,
        provider: d.provider.as_deref().unwrap_or("").to_string(),
        phase: d.phase.to_string(),
        codes: d
            .reason_codes
            .iter()
            .map(|c| c.as_str().to_string())
            .collect(),
        latency_ms: d.attempts.iter().map(|a| a.latency_ms).sum(),
    }
}

impl App {
    pub(crate) fn apply(&mut self, ev: Update, now_ms: u64) {
        self.applied += 1;
        match ev {
            Update::NodeState { node, state } => {
                self.nodes.insert(
                    node,
                    NodeView {
                        state: *state,
                        seen_ms: now_ms,
                    },
                );
            }
            Update::Decision { node, decision } => {
                let line = line_of(&node, &decision);
                let oldest = now_ms.saturating_sub(SHARE_WINDOW_MS);
                while self.recent.front().is_some_and(|r| r.seen_ms < oldest) {
                    self.recent.pop_front();
                }
                self.recent.push_back(Recent {
                    seen_ms: now_ms,
                    rerouted: decision.fallback || decision.attempts.len() > 1,
                    failed: decision.outcome != DecisionOutcome::Accepted,
                    provider: line.provider.clone(),
                });
                let second = now_ms / 1_000 * 1_000;
                if !self.seconds.contains_key(&second) {
                    // A new second: the earlier ones are complete.
                    for s in self.seconds.values_mut().filter(|s| s.p95.is_none()) {
                        s.p95 = Some(p95_of(&s.latencies));
                        s.latencies = Vec::new();
                    }
                    let oldest = second.saturating_sub(HISTORY_SECS as u64 * 1_000);
                    self.seconds.retain(|&s, _| s > oldest);
                }
                let slot = self.seconds.entry(second).or_default();
                slot.count += 1;
                if slot.p95.is_none() {
                    slot.latencies.push(line.latency_ms);
                }
                if !self.paused {
                    push_bounded(&mut self.stream, line, STREAM_CAPACITY);
                }
            }
            Update::Escalation(record) => {
                let key = crate::transport::store::escalations::key(&record.escalation.id);
                if record.status == Status::Resolved {
                    self.escalations.remove(&key);
                } else {
                    self.escalations.insert(key, *record);
                    if self.escalations.len() > OPEN_ESCALATIONS_KEPT
                        && let Some(oldest) = self.oldest_escalation()
                    {
                        self.escalations.remove(&oldest);
                    }
                }
            }
            Update::EscalationGone(key) => {
                self.escalations.remove(&key);
            }
            Update::EscalationsReread => self.escalations.clear(),
            Update::Incident { node, incident } => {
                push_bounded(&mut self.incidents, (now_ms, node, incident), 50);
            }
            Update::Death(notice) => {
                self.instances.remove(&notice.instance_id);
                push_bounded(&mut self.deaths, (now_ms, notice), 50);
            }
            Update::AgentBeat(b) => {
                // Instances that stopped beating a minute ago without a death notice are gone.
                self.instances
                    .retain(|_, i| now_ms.saturating_sub(i.seen_ms) < 60_000);
                self.instances.insert(
                    b.instance_id,
                    Instance {
                        agent: b.agent,
                        in_flight: b.in_flight,
                        seen_ms: now_ms,
                    },
                );
            }
            Update::Catalog(names) => self.catalog = names,
            Update::Chaos(active) => self.chaos = active,
            Update::Connection(up) => {
                if up {
                    self.lost_at_ms = None;
                } else if self.connected {
                    self.lost_at_ms = Some(now_ms);
                }
                self.connected = up;
            }
            Update::Unreadable(subject) => {
                self.unreadable += 1;
                self.unreadable_subject = subject;
            }
        }
    }

    /// What `key` does. `panel_len` is how many rows the focused panel has now (what the
    /// arrow keys scroll through).
    pub(crate) fn on_key(&mut self, key: Key, panel_len: usize) -> KeyEffect {
        if key == Key::Ctrl('c') {
            return KeyEffect::Quit;
        }
        if self.editing_filter {
            match key {
                Key::Enter => self.editing_filter = false,
                Key::Esc => {
                    self.editing_filter = false;
                    self.filter.clear();
                }
                Key::Backspace => {
                    self.filter.pop();
                }
                Key::Char(c) => self.filter.push(c),
                _ => {}
            }
            self.scroll = 0;
            return KeyEffect::None;
        }
        if let Some(sel) = self.chaos_menu {
            match key {
                Key::Esc | Key::Char('c') => self.chaos_menu = None,
                Key::Up => self.chaos_menu = Some(sel.saturating_sub(1)),
                Key::Down => self.chaos_menu = Some((sel + 1).min(CHAOS_MENU.len() - 1)),
                Key::Enter => {
                    self.chaos_menu = None;
                    self.status = format!("chaos: {}…", CHAOS_MENU[sel].0);
                    return KeyEffect::Chaos(sel);
                }
                _ => {}
            }
            return KeyEffect::None;
        }
        match key {
            Key::Char('q') => return KeyEffect::Quit,
            Key::Esc => self.help = false,
            Key::Char('?') => self.help = !self.help,
            Key::Char('p') => self.paused = !self.paused,
            Key::Char('/') => {
                self.editing_filter = true;
                self.filter.clear();
            }
            Key::Char('c') => self.chaos_menu = Some(0),
            Key::Char(k @ ('a' | 'r')) => {
                use crate::transport::store::escalations::Mark;
                let (how, doing) = match k {
                    'a' => (Mark::Acknowledged, "acknowledging"),
                    _ => (Mark::Resolved, "resolving"),
                };
                let Some(id) = self
                    .open_escalations()
                    .first()
                    .map(|r| r.escalation.id.clone())
                else {
                    self.status = "no open escalation".into();
                    return KeyEffect::None;
                };
                self.status = format!("{doing} {id}…");
                return KeyEffect::Mark(how, id);
            }
            Key::Tab => self.focus = self.focus.next(),
            Key::Up | Key::Down | Key::PageUp | Key::PageDown => {
                let rows = match key {
                    Key::Up => -1,
                    Key::Down => 1,
                    Key::PageUp => -10,
                    _ => 10,
                };
                // The stream counts back from the newest line: up is further back.
                let rows = if self.focus == Focus::Stream {
                    -rows
                } else {
                    rows
                };
                self.scroll_by(rows, panel_len);
            }
            Key::Home | Key::End => self.scroll_home(),
            _ => {}
        }
        KeyEffect::None
    }

    /// The moment the picture shows: now, or when NATS was lost (nothing heard since is news,
    /// so nothing ages meanwhile).
    pub(crate) fn picture_ms(&self, now_ms: u64) -> u64 {
        match self.lost_at_ms {
            Some(at) if !self.connected => at,
            _ => now_ms,
        }
    }

    /// Nodes whose snapshot is fresh.
    pub(crate) fn live_nodes(&self, now_ms: u64) -> Vec<&str> {
        self.nodes
            .iter()
            .filter(|(_, v)| now_ms.saturating_sub(v.seen_ms) <= NODE_SILENT_MS)
            .map(|(k, _)| k.as_str())
            .collect()
    }

    /// Scroll the focused panel by `rows` (positive: further down a panel, further back in the
    /// stream), keeping at least one of its `len` rows in view.
    pub(crate) fn scroll_by(&mut self, rows: isize, len: usize) {
        let last = len.saturating_sub(1);
        let moved = |at: usize| at.min(last).saturating_add_signed(rows).min(last);
        if self.focus == Focus::Stream {
            self.scroll = moved(self.scroll);
        } else {
            let at = self.offsets.entry(self.focus).or_default();
            *at = moved(*at);
        }
    }

    /// Back to the top of the focused panel (the newest line of the stream).
    pub(crate) fn scroll_home(&mut self) {
        if self.focus == Focus::Stream {
            self.scroll = 0;
        } else {
            self.offsets.remove(&self.focus);
        }
    }

    /// The first row shown in `panel`, within its `len` rows.
    pub(crate) fn offset(&self, panel: Focus, len: usize) -> usize {
        self.offsets
            .get(&panel)
            .copied()
            .unwrap_or(0)
            .min(len.saturating_sub(1))
    }

    /// Open escalations, newest first.
    pub(crate) fn open_escalations(&self) -> Vec<&EscalationRecord> {
        let mut open: Vec<&EscalationRecord> = self.escalations.values().collect();
        open.sort_by(|a, b| {
            (b.escalation.created_at_ms, &b.escalation.id)
                .cmp(&(a.escalation.created_at_ms, &a.escalation.id))
        });
        open
    }

    fn oldest_escalation(&self) -> Option<String> {
        self.escalations
            .iter()
            .min_by_key(|(_, r)| (r.escalation.created_at_ms, &r.escalation.id))
            .map(|(key, _)| key.clone())
    }

    /// The freshest snapshot among live nodes (for cluster-wide figures).
    pub(crate) fn reference(&self, now_ms: u64) -> Option<&NodeSnapshot> {
        let live = self.live_nodes(now_ms);
        self.nodes
            .iter()
            .filter(|(k, _)| live.contains(&k.as_str()))
            .max_by_key(|(_, v)| v.seen_ms)
            .map(|(_, v)| &v.state)
    }

    /// One verdict for the mesh, and what drives it.
    pub(crate) fn banner(&self, now_ms: u64) -> (MeshStatus, String) {
        if !self.connected {
            let why = match self.lost_at_ms {
                Some(at) => format!(
                    "NATS unreachable for {} s: the picture is as it was then (stale, greyed); \
                     reconnecting. Is the mesh up? `oam mesh status`, `oam mesh up`",
                    now_ms.saturating_sub(at) / 1_000
                ),
                None => "NATS unreachable: reconnecting. Is the mesh up? `oam mesh status`".into(),
            };
            return (MeshStatus::NoQuorum, why);
        }
        let Some(state) = self.reference(now_ms) else {
            return (
                MeshStatus::NoQuorum,
                "no node heard from: is the mesh up (`oam mesh status`)?".into(),
            );
        };
        let expected = state.cluster_size;
        let live = self.live_nodes(now_ms).len();
        if !state.has_quorum() {
            return (
                MeshStatus::NoQuorum,
                format!("no quorum: {live} of {expected} nodes; each node decides on its own view"),
            );
        }
        let ids = |v| {
            state
                .providers_with(v)
                .map(|p| p.id.clone())
                .collect::<Vec<_>>()
        };
        let (unhealthy, degraded) = (ids(Health::Unhealthy), ids(Health::Degraded));
        // What requests experienced just now outranks the health windows, which lag by design.
        let since = now_ms.saturating_sub(BANNER_WINDOW_MS);
        let just_now = || self.recent.iter().filter(|r| r.seen_ms >= since);
        let rerouted = just_now().filter(|r| r.rerouted).count();
        let failed = just_now().filter(|r| r.failed).count();
        // REROUTING is what requests experienced; the health verdicts (which lag by design) are
        // shown beside the banner (`health_line`) and can only make it DEGRADED.
        let w = BANNER_WINDOW_MS / 1_000;
        if rerouted > 0 {
            let mut why = vec![format!("{rerouted} rerouted in {w} s")];
            if failed > 0 {
                why.push(format!("{failed} failed in {w} s"));
            }
            return (
                MeshStatus::Rerouting,
                format!("rerouting: {}", why.join("; ")),
            );
        }
        let dead = self.nodes.len().saturating_sub(live);
        let sick = !unhealthy.is_empty() || !degraded.is_empty();
        // Stores a live node cannot write to (budgets fail closed, records are lost).
        let live_ids = self.live_nodes(now_ms);
        let stores: std::collections::BTreeSet<&str> = self
            .nodes
            .iter()
            .filter(|(k, _)| live_ids.contains(&k.as_str()))
            .flat_map(|(_, v)| v.state.store_faults.keys().map(String::as_str))
            .collect();
        // Streams a live node writes that run short of copies (the fewest any node saw).
        let mut short: std::collections::BTreeMap<&str, [u64; 2]> =
            std::collections::BTreeMap::new();
        for (_, v) in self
            .nodes
            .iter()
            .filter(|(k, _)| live_ids.contains(&k.as_str()))
        {
            for (stream, &c) in &v.state.short_copies {
                let seen = short.entry(stream.as_str()).or_insert(c);
                seen[0] = seen[0].min(c[0]);
            }
        }
        if failed > 0
            || sick
            || dead > 0
            || !self.chaos.is_empty()
            || !stores.is_empty()
            || !short.is_empty()
        {
            let mut why = Vec::new();
            if failed > 0 {
                why.push(format!("{failed} failed in {w} s"));
            }
            if !stores.is_empty() {
                let list: Vec<&str> = stores.into_iter().collect();
                why.push(format!("the {} takes no writes", list.join(" and the ")));
            }
            for (stream, [current, replicas]) in &short {
                why.push(format!(
                    "{stream} keeps {current} of {replicas} copies (oam mesh status)"
                ));
            }
            if dead > 0 {
                why.push(format!("{dead} node(s) down"));
            }
            if !unhealthy.is_empty() {
                why.push(format!("{} unhealthy", unhealthy.join(", ")));
            }
            if !degraded.is_empty() {
                why.push(format!("{} degraded", degraded.join(", ")));
            }
            if !self.chaos.is_empty() {
                why.push(format!("{} chaos fault(s) active", self.chaos.len()));
            }
            return (
                MeshStatus::Degraded,
                format!("degraded, absorbing failure: {}", why.join("; ")),
            );
        }
        (
            MeshStatus::Nominal,
            format!("all nominal: {live} nodes, quorum held, every provider healthy"),
        )
    }

    /// `provider`'s share of the decisions of the last `SHARE_WINDOW_MS` that a provider served.
    pub(crate) fn share(&self, provider: &str, now_ms: u64) -> f64 {
        let since = now_ms.saturating_sub(SHARE_WINDOW_MS);
        let (mut served, mut by) = (0usize, 0usize);
        for r in self
            .recent
            .iter()
            .filter(|r| r.seen_ms >= since && !r.provider.is_empty())
        {
            served += 1;
            by += usize::from(r.provider == provider);
        }
        if served == 0 {
            return 0.0;
        }
        by as f64 / served as f64
    }

    /// Decisions per second over the history (oldest first), and p95 latency per second.
    pub(crate) fn history(&self, now_ms: u64) -> (Vec<u64>, Vec<u64>) {
        let now_s = now_ms / 1_000 * 1_000;
        let mut rate = Vec::with_capacity(HISTORY_SECS);
        let mut p95 = Vec::with_capacity(HISTORY_SECS);
        for i in (0..HISTORY_SECS as u64).rev() {
            let s = now_s.saturating_sub(i * 1_000);
            match self.seconds.get(&s) {
                Some(second) => {
                    rate.push(second.count);
                    p95.push(second.p95());
                }
                None => {
                    rate.push(0);
                    p95.push(0);
                }
            }
        }
        (rate, p95)
    }

    /// The stream as filtered by the operator (a code, an agent, a provider or a node).
    pub(crate) fn visible(&self) -> Vec<&Line> {
        let f = self.filter.trim().to_ascii_lowercase();
        self.stream
            .iter()
            .filter(|l| {
                f.is_empty()
                    || l.agent.to_ascii_lowercase().contains(&f)
                    || l.provider.to_ascii_lowercase().contains(&f)
                    || l.node.to_ascii_lowercase() == f
                    || l.codes.iter().any(|c| c.to_ascii_lowercase().contains(&f))
            })
            .collect()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MeshStatus {
    Nominal,
    Degraded,
    Rerouting,
    NoQuorum,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::breaker::Breaker;
    use crate::core::reason::ReasonCode;
    use crate::tui::fixtures;

    /// A node's snapshot: every node live (quorum) or only itself, with these verdicts.
    fn state(quorum: bool, verdicts: &[(&str, Health)]) -> Box<NodeSnapshot> {
        let live: &[&str] = if quorum { &["n1", "n2", "n3"] } else { &["n1"] };
        let providers = verdicts
            .iter()
            .map(|(id, v)| fixtures::provider(id, *v, 3, quorum, 1.0, 100, Breaker::default()))
            .collect();
        fixtures::node_state(live, providers, 0)
    }

    #[test]
    fn keys_edit_the_filter_drive_the_chaos_menu_and_quit() {
        let mut app = App::default();
        let type_in = |app: &mut App, keys: &[Key]| {
            keys.iter().map(|k| app.on_key(*k, 10)).collect::<Vec<_>>()
        };
        // '/' starts a filter; typed keys go into it (even 'q'), Enter keeps it.
        type_in(&mut app, &[Key::Char('/'), Key::Char('q'), Key::Char('x')]);
        assert_eq!((app.filter.as_str(), app.editing_filter), ("qx", true));
        type_in(&mut app, &[Key::Backspace, Key::Enter]);
        assert_eq!((app.filter.as_str(), app.editing_filter), ("q", false));
        // Esc while editing drops the filter.
        type_in(&mut app, &[Key::Char('/'), Key::Char('z'), Key::Esc]);
        assert_eq!(app.filter, "");
        // The chaos menu: down twice, up once, Enter picks entry 1 and closes.
        let effects = type_in(
            &mut app,
            &[Key::Char('c'), Key::Down, Key::Down, Key::Up, Key::Enter],
        );
        assert_eq!(effects.last(), Some(&KeyEffect::Chaos(1)));
        assert_eq!(app.chaos_menu, None);
        assert!(app.status.contains(CHAOS_MENU[1].0), "{}", app.status);
        // Down past the last entry stays on it; Esc closes without an effect.
        app.on_key(Key::Char('c'), 10);
        for _ in 0..50 {
            app.on_key(Key::Down, 10);
        }
        assert_eq!(app.chaos_menu, Some(CHAOS_MENU.len() - 1));
        assert_eq!(app.on_key(Key::Esc, 10), KeyEffect::None);
        assert_eq!(app.chaos_menu, None);
        // Help, pause, focus, scrolling (the stream: up is further back).
        type_in(&mut app, &[Key::Char('?'), Key::Char('p')]);
        assert!(app.help && app.paused);
        app.on_key(Key::Up, 100);
        assert_eq!(app.scroll, 1);
        app.on_key(Key::PageUp, 100);
        assert_eq!(app.scroll, 11);
        app.on_key(Key::Home, 100);
        assert_eq!(app.scroll, 0);
        app.on_key(Key::Tab, 100);
        assert_eq!(app.focus, Focus::Nodes);
        app.on_key(Key::Down, 5);
        assert_eq!(app.offset(Focus::Nodes, 5), 1);
        assert_eq!(app.on_key(Key::Char('q'), 10), KeyEffect::Quit);
        assert_eq!(app.on_key(Key::Ctrl('c'), 10), KeyEffect::Quit);
    }

    #[test]
    fn each_panel_scrolls_on_its_own_within_its_rows() {
        let mut app = App::default();
        app.scroll_by(5, 100);
        assert_eq!(app.scroll, 5, "the stream goes back in history");
        app.focus = Focus::Stream.next().next().next(); // attention
        assert_eq!(app.focus, Focus::Attention);
        app.scroll_by(3, 10);
        app.scroll_by(-1, 10);
        assert_eq!(app.offset(Focus::Attention, 10), 2);
        app.scroll_by(50, 10);
        assert_eq!(
            app.offset(Focus::Attention, 10),
            9,
            "the last row stays in view"
        );
        assert_eq!(
            app.offset(Focus::Attention, 4),
            3,
            "a panel that shrank shows its last row"
        );
        app.scroll_by(-1, 4);
        assert_eq!(
            app.offset(Focus::Attention, 4),
            2,
            "and the first step up moves"
        );
        app.scroll_by(7, 10);
        app.scroll_by(-50, 10);
        assert_eq!(app.offset(Focus::Attention, 10), 0);
        assert_eq!(app.scroll, 5, "the stream did not move");
        app.scroll_by(2, 10);
        app.scroll_home();
        assert_eq!(app.offset(Focus::Attention, 10), 0);
        app.focus = app.focus.next().next();
        assert_eq!(app.focus, Focus::Stream, "Tab goes round");
        app.scroll_home();
        assert_eq!(app.scroll, 0);
    }

    #[test]
    fn a_and_r_mark_the_newest_open_escalation() {
        use crate::transport::store::escalations::{Mark, example};
        let mut app = App::default();
        assert_eq!(app.on_key(Key::Char('a'), 0), KeyEffect::None);
        assert_eq!(app.status, "no open escalation");
        for (i, id) in ["esc-old", "esc-new"].iter().enumerate() {
            let r = example(id, "bot", 1_000 * i as u64, Status::Open);
            app.apply(Update::Escalation(Box::new(r)), 5_000);
        }
        assert_eq!(
            app.on_key(Key::Char('a'), 0),
            KeyEffect::Mark(Mark::Acknowledged, "esc-new".into())
        );
        assert_eq!(app.status, "acknowledging esc-new…");
        assert_eq!(
            app.on_key(Key::Char('r'), 0),
            KeyEffect::Mark(Mark::Resolved, "esc-new".into())
        );
        // Typed into the filter, they are letters.
        app.on_key(Key::Char('/'), 0);
        assert_eq!(app.on_key(Key::Char('a'), 0), KeyEffect::None);
        assert_eq!(app.filter, "a");
    }

    #[test]
    fn escalations_stay_open_until_resolved_and_stay_bounded() {
        use crate::transport::store::escalations::example;
        let mut app = App::default();
        for (i, id) in ["esc-a", "esc-b", "esc-c"].iter().enumerate() {
            let r = example(id, "bot", 1_000 * i as u64, Status::Open);
            app.apply(Update::Escalation(Box::new(r)), 5_000);
        }
        // The same record again (a replayed store) changes nothing.
        app.apply(
            Update::Escalation(Box::new(example("esc-b", "bot", 1_000, Status::Open))),
            6_000,
        );
        let ids = |app: &App| -> Vec<String> {
            app.open_escalations()
                .iter()
                .map(|r| r.escalation.id.clone())
                .collect()
        };
        assert_eq!(ids(&app), ["esc-c", "esc-b", "esc-a"], "newest first");
        app.apply(
            Update::Escalation(Box::new(example("esc-b", "bot", 1_000, Status::Resolved))),
            7_000,
        );
        assert_eq!(ids(&app), ["esc-c", "esc-a"]);
        // Resolving one the view never saw open is harmless.
        app.apply(
            Update::Escalation(Box::new(example("esc-z", "bot", 9, Status::Resolved))),
            7_000,
        );
        assert_eq!(app.escalations.len(), 2);
        app.apply(Update::EscalationGone("esc-c".into()), 7_000);
        assert_eq!(ids(&app), ["esc-a"], "a deleted record leaves");
        app.apply(Update::EscalationsReread, 7_000);
        assert!(app.escalations.is_empty(), "a re-read starts afresh");
        for i in 0..OPEN_ESCALATIONS_KEPT as u64 + 5 {
            let r = example(&format!("esc-n{i}"), "bot", 10_000 + i, Status::Open);
            app.apply(Update::Escalation(Box::new(r)), 8_000);
        }
        assert_eq!(app.escalations.len(), OPEN_ESCALATIONS_KEPT);
        assert!(
            !app.escalations.contains_key("esc-a"),
            "the oldest went first"
        );
        assert!(
            app.escalations
                .contains_key(&format!("esc-n{}", OPEN_ESCALATIONS_KEPT + 4))
        );
    }

    #[test]
    fn the_banner_says_what_drives_it() {
        let mut app = App::default();
        app.apply(Update::Connection(true), 0);
        assert_eq!(app.banner(0).0, MeshStatus::NoQuorum, "nothing heard yet");
        for n in ["n1", "n2", "n3"] {
            let s = state(true, &[("primary", Health::Healthy)]);
            app.apply(
                Update::NodeState {
                    node: n.into(),
                    state: s,
                },
                1_000,
            );
        }
        assert_eq!(app.banner(1_000).0, MeshStatus::Nominal);
        app.apply(
            Update::NodeState {
                node: "n1".into(),
                state: state(true, &[("primary", Health::Unhealthy)]),
            },
            2_000,
        );
        // Unhealthy by the health windows, but no request rerouted (yet): degraded.
        let (v, why) = app.banner(2_000);
        assert_eq!(v, MeshStatus::Degraded);
        assert!(why.contains("primary unhealthy"), "{why}");
        // n2 and n3 fall silent; the freshest (n1) still says quorum: degraded by silence.
        app.apply(
            Update::NodeState {
                node: "n1".into(),
                state: state(true, &[("primary", Health::Healthy)]),
            },
            6_000,
        );
        let (v, why) = app.banner(6_000);
        assert_eq!(v, MeshStatus::Degraded);
        assert!(why.contains("2 node(s) down"), "{why}");
        // A store that takes no writes, as a live node says: degraded, and said.
        let mut full = state(true, &[("primary", Health::Healthy)]);
        full.store_faults
            .insert("ledger".into(), "insufficient resources".into());
        app.apply(
            Update::NodeState {
                node: "n1".into(),
                state: full,
            },
            6_100,
        );
        let (v, why) = app.banner(6_100);
        assert_eq!(v, MeshStatus::Degraded);
        assert!(why.contains("the ledger takes no writes"), "{why}");
        // A stream short of copies (a server down, or its disk full): degraded, and said.
        let mut short = state(true, &[("primary", Health::Healthy)]);
        short.short_copies.insert("KV_oam-budgets".into(), [2, 3]);
        app.apply(
            Update::NodeState {
                node: "n1".into(),
                state: short,
            },
            6_200,
        );
        let (v, why) = app.banner(6_200);
        assert_eq!(v, MeshStatus::Degraded);
        assert!(
            why.contains("KV_oam-budgets keeps 2 of 3 copies (oam mesh status)"),
            "{why}"
        );
        // n1 itself hears only itself: no quorum, whatever the verdicts say.
        app.apply(
            Update::NodeState {
                node: "n1".into(),
                state: state(false, &[("primary", Health::Healthy)]),
            },
            7_000,
        );
        let (v, why) = app.banner(7_000);
        assert_eq!(v, MeshStatus::NoQuorum, "{why}");
        app.apply(Update::Connection(false), 7_000);
        assert!(app.banner(7_000).1.contains("NATS unreachable"));
    }

    #[test]
    fn the_banner_follows_what_requests_experience_within_two_seconds() {
        let mut app = App::default();
        app.apply(Update::Connection(true), 0);
        let healthy = |app: &mut App, at: u64| {
            for n in ["n1", "n2", "n3"] {
                let state = state(
                    true,
                    &[("primary", Health::Healthy), ("local", Health::Healthy)],
                );
                app.apply(
                    Update::NodeState {
                        node: n.into(),
                        state,
                    },
                    at,
                );
            }
        };
        let decide = |app: &mut App, at: u64, outcome, provider: &str, fallback: bool| {
            let d = fixtures::decision(
                outcome,
                if outcome == DecisionOutcome::Accepted {
                    Phase::Accepted
                } else {
                    Phase::Admission
                },
                provider,
                fallback,
                &[ReasonCode::Accepted],
                "a",
                100,
                at,
            );
            app.apply(
                Update::Decision {
                    node: "n1".into(),
                    decision: d,
                },
                at,
            );
        };
        healthy(&mut app, 10_000);
        assert_eq!(app.banner(10_000).0, MeshStatus::Nominal);
        // The health windows still say HEALTHY: the first rerouted request turns the banner.
        decide(&mut app, 10_100, DecisionOutcome::Accepted, "local", true);
        let (v, why) = app.banner(10_100);
        assert_eq!(v, MeshStatus::Rerouting, "{why}");
        assert!(why.contains("1 rerouted"), "{why}");
        healthy(&mut app, 11_000);
        assert_eq!(
            app.banner(12_000).0,
            MeshStatus::Rerouting,
            "within 2 s of the last"
        );
        healthy(&mut app, 12_000);
        assert_eq!(
            app.banner(12_200).0,
            MeshStatus::Nominal,
            "cleared 2 s after the last"
        );
        // A failing request, any phase, can never sit beside ALL NOMINAL.
        decide(&mut app, 12_300, DecisionOutcome::Rejected, "", false);
        let (v, why) = app.banner(12_300);
        assert_eq!(v, MeshStatus::Degraded, "{why}");
        assert!(why.contains("1 failed"), "{why}");
        healthy(&mut app, 14_000);
        assert_eq!(app.banner(14_400).0, MeshStatus::Nominal);
        // Shares count the last 10 s only.
        for at in [20_000, 20_100, 20_200] {
            decide(&mut app, at, DecisionOutcome::Accepted, "primary", false);
        }
        assert!((app.share("primary", 20_300) - 1.0).abs() < 1e-9);
        decide(&mut app, 31_000, DecisionOutcome::Accepted, "local", false);
        assert!((app.share("local", 31_000) - 1.0).abs() < 1e-9);
        assert_eq!(app.share("primary", 31_000), 0.0);
        // The health windows alone (no request rerouted) make it DEGRADED, never REROUTING.
        for n in ["n1", "n2", "n3"] {
            let state = state(
                true,
                &[("primary", Health::Unhealthy), ("local", Health::Healthy)],
            );
            app.apply(
                Update::NodeState {
                    node: n.into(),
                    state,
                },
                40_000,
            );
        }
        let (v, why) = app.banner(40_000);
        assert_eq!(v, MeshStatus::Degraded, "{why}");
        assert!(why.contains("primary unhealthy"), "{why}");
    }

    #[test]
    fn decisions_become_coloured_lines_rates_and_a_filtered_stream() {
        let mut app = App::default();
        let d = |outcome: DecisionOutcome, phase: Phase, fallback: bool, agent: &str| {
            let (provider, code) = if fallback {
                ("local", ReasonCode::FallbackUsed)
            } else {
                ("primary", ReasonCode::Accepted)
            };
            fixtures::decision(outcome, phase, provider, fallback, &[code], agent, 150, 10)
        };
        app.apply(
            Update::Decision {
                node: "n1".into(),
                decision: d(DecisionOutcome::Accepted, Phase::Accepted, false, "a"),
            },
            10_100,
        );
        app.apply(
            Update::Decision {
                node: "n1".into(),
                decision: d(DecisionOutcome::Accepted, Phase::Accepted, true, "b"),
            },
            10_200,
        );
        app.apply(
            Update::Decision {
                node: "n2".into(),
                decision: d(DecisionOutcome::Rejected, Phase::Admission, false, "c"),
            },
            10_300,
        );
        app.apply(
            Update::Decision {
                node: "n2".into(),
                decision: d(DecisionOutcome::Escalated, Phase::Budget, false, "d"),
            },
            11_000,
        );
        let kinds: Vec<LineKind> = app.stream.iter().map(|l| l.kind).collect();
        assert_eq!(
            kinds,
            [
                LineKind::Accepted,
                LineKind::Fallback,
                LineKind::Shed,
                LineKind::Escalated
            ]
        );
        assert_eq!(app.stream[0].latency_ms, 150);
        let (rate, p95) = app.history(11_500);
        assert_eq!(&rate[HISTORY_SECS - 2..], &[3, 1]);
        assert_eq!(p95[HISTORY_SECS - 1], 150);
        app.filter = "fallback".into();
        assert_eq!(app.visible().len(), 1);
        app.filter = "n2".into();
        assert_eq!(app.visible().len(), 2);
        app.paused = true;
        app.apply(
            Update::Decision {
                node: "n1".into(),
                decision: d(DecisionOutcome::Accepted, Phase::Accepted, false, "e"),
            },
            12_000,
        );
        assert_eq!(app.stream.len(), 4, "paused: the stream holds still");
        assert_eq!(
            app.history(12_000).0[HISTORY_SECS - 1],
            1,
            "but the rates go on"
        );
    }
}
