//! Every NATS subject oam uses, and only here. Control-plane events are
//! `oam.v1.<kind>.<sender>`; wildcards subscribe to a kind from every sender. The agent mesh
//! uses the Open Agent Mesh names (`mesh.agent.{name}`, `q.{name}`, ...) so that other OAM
//! clients interoperate.

/// Prefix of every control-plane subject.
pub(crate) const PREFIX: &str = "oam.v1";

pub fn heartbeat(node: &str) -> String {
    format!("{PREFIX}.heartbeat.{node}")
}
pub(crate) const HEARTBEATS: &str = "oam.v1.heartbeat.*";

pub fn goodbye(node: &str) -> String {
    format!("{PREFIX}.goodbye.{node}")
}
pub(crate) const GOODBYES: &str = "oam.v1.goodbye.*";

pub fn observations(node: &str) -> String {
    format!("{PREFIX}.observations.{node}")
}
pub(crate) const ALL_OBSERVATIONS: &str = "oam.v1.observations.*";

/// A node's decisions, in batches: the envelope's body is a JSON array of decisions, sent every
/// `DECISION_BATCH_MS` or once `DECISION_BATCH_MAX` are waiting, whichever comes first (one
/// message per batch, not per request: the bus costs the gateway nearly nothing per decision).
pub fn decision(node: &str) -> String {
    format!("{PREFIX}.decision.{node}")
}
pub const DECISIONS: &str = "oam.v1.decision.*";

/// A node's decision records (`node::decisionlog`), in batches, kept by the node's own stream
/// (`decision_log_stream`).
pub fn decision_log(node: &str) -> String {
    format!("{PREFIX}.decisionlog.{node}")
}
pub(crate) const DECISION_LOG_ALL: &str = "oam.v1.decisionlog.*";
/// The stream that keeps `node`'s decision records, and only its: one node's writes push out
/// only its own records (JetStream bounds bytes per stream, not per subject).
pub(crate) fn decision_log_stream(node: &str) -> String {
    format!("{DECISION_LOG_STREAM}_{node}")
}
/// The stream names of the decision log begin so; the stream of that very name is the log
/// earlier oam kept for all nodes together, read still until it ages out.
pub(crate) const DECISION_LOG_STREAM: &str = "OAM_DECISIONS";
/// Where that shared stream takes writes since (none: no one publishes there).
pub const RETIRED_DECISION_LOG: &str = "oam.v1.retired.decisionlog";

/// Failures a node counted toward an agent loop, and calls that worked after some
/// (`core::wire::LoopEvent`).
pub(crate) fn loop_event(node: &str) -> String {
    format!("{PREFIX}.loop.{node}")
}
pub(crate) const LOOP_EVENTS: &str = "oam.v1.loop.*";
/// Who raised the incident of each open loop episode (one per episode for the cluster).
pub(crate) const LOOP_EPISODES_BUCKET: &str = "oam-loop-episodes";

/// A node's state snapshot (what `GET /v1/oam/state` returns), every heartbeat.
pub fn state(node: &str) -> String {
    format!("{PREFIX}.state.{node}")
}
pub(crate) const STATES: &str = "oam.v1.state.*";
pub const INCIDENTS: &str = "oam.v1.incident.*";
pub(crate) const ESCALATIONS: &str = "oam.v1.escalation.*";

pub fn incident(node: &str) -> String {
    format!("{PREFIX}.incident.{node}")
}
pub fn escalation(node: &str) -> String {
    format!("{PREFIX}.escalation.{node}")
}

/// Chaos: requests to the warden (request/reply), its events, and commands to nodes
/// (`oam.v1.chaos.node.{id}`, or `.all`).
pub(crate) const CHAOS_INJECT: &str = "oam.v1.chaos.inject";
pub(crate) const CHAOS_LIST: &str = "oam.v1.chaos.list";
pub(crate) const CHAOS_RESTORE: &str = "oam.v1.chaos.restore";
pub(crate) const CHAOS_EVENT: &str = "oam.v1.chaos.event";
pub fn chaos_node(to: &str) -> String {
    format!("{PREFIX}.chaos.node.{to}")
}

/// The data plane on NATS: one service across nodes (a queue group), request/reply.
pub(crate) const REQUEST: &str = "oam.v1.request";
pub(crate) const REQUEST_QUEUE: &str = "oam-nodes";

// The agent mesh (Open Agent Mesh protocol; names must match other OAM clients exactly).

/// Every agent's serving subject.
pub(crate) const ALL_AGENTS: &str = "mesh.agent.>";
/// Where agent `name` publishes events (Open Agent Mesh SDK).
pub(crate) fn agent_events(name: &str) -> String {
    format!("{AGENT_PREFIX}{name}.events")
}
/// Every request's stream chunks and results (Open Agent Mesh SDK callbacks).
pub(crate) const ALL_STREAMS: &str = "mesh.stream.>";
pub(crate) const ALL_RESULTS: &str = "mesh.results.>";
/// Every agent's error replies.
pub(crate) const ALL_ERRORS: &str = "mesh.errors.>";
/// The reply inboxes of clients that keep the NATS default (the Open Agent Mesh SDK's): shared
/// by every such client, so oam's own processes never use them (`private_inbox`).
pub(crate) const SHARED_INBOXES: &str = "_INBOX.>";
/// The reply-inbox prefix of a client that names none (async-nats' default).
pub(crate) const DEFAULT_INBOX: &str = "_INBOX";
/// The root of oam's private inboxes.
const OAM_INBOX: &str = "_OAM";

/// Where the replies of an oam process connected as `user` arrive: `_OAM.{kind}` for a role
/// without a name (`caller`, `viewer`, ...; the admin is `admin`), `_OAM.{kind}.{name}` for
/// nodes and agents, an agent's dots written `~` so that no agent's inbox lies inside another's
/// (`demo` and `demo.echo`). Only that user may subscribe below it, so nobody else reads its
/// replies, JetStream answers or watches. `None` for a user that is no role of oam's (a server
/// configured by someone else): it keeps the client's default.
pub fn private_inbox(user: &str) -> Option<String> {
    let named = |kind: &str, name: &str| {
        let ok = !name.is_empty() && name.len() <= 128 && name.split('.').all(valid_token);
        ok.then(|| format!("{OAM_INBOX}.{kind}.{}", name.replace('.', "~")))
    };
    match user.split_once('-') {
        Some(("node", id)) if valid_token(id) => named("node", id),
        Some(("agent", name)) => named("agent", name),
        _ => match user {
            "oam" => Some(format!("{OAM_INBOX}.admin")),
            "monitor" | "warden" | "operator" | "caller" | "viewer" | "observer" => {
                Some(format!("{OAM_INBOX}.{user}"))
            }
            _ => None,
        },
    }
}

/// The root of answer inboxes: `_OAM.re.{answerer}.{asker}.…`, where `{answerer}` names who
/// may publish there (the server enforces it: each answering role may publish under its own
/// token only) and `{asker}` is the asker's private inbox without `_OAM.` (`caller`,
/// `node.n1`, ...: only that user may subscribe). No role kind is `re`, so an answer inbox is
/// never a private inbox, where nobody but the server may publish.
const ANSWERS: &str = "_OAM.re";

/// The answerer token of agent `name` (its dots written `~`, one token): what `agent-{name}`
/// and `sdk-agent-{name}` may answer under.
pub(crate) fn answerer_agent(name: &str) -> String {
    format!("ag-{}", name.replace('.', "~"))
}
/// The answerer token of every node (the nodes are one trust domain: each writes the shared
/// budgets already).
pub const ANSWERER_NODES: &str = "nodes";
/// The answerer token of the chaos warden.
pub(crate) const ANSWERER_WARDEN: &str = "warden";

/// What answerer `tag` may publish: `_OAM.re.{tag}.>`.
pub(crate) fn answers_from(tag: &str) -> String {
    format!("{ANSWERS}.{tag}.>")
}

/// Where the owner of private inbox `private` (`_OAM.caller`) hears `tag`:
/// `_OAM.re.{tag}.caller`; `None` for an inbox that is not oam's (`_INBOX`).
pub(crate) fn answer_inbox(tag: &str, private: &str) -> Option<String> {
    let asker = private.strip_prefix("_OAM.")?;
    Some(format!("{ANSWERS}.{tag}.{asker}"))
}

/// Every answer inbox of the owner of private inbox `private`, from any answerer: what it may
/// subscribe to.
pub(crate) fn answer_inboxes(private: &str) -> Option<String> {
    let asker = private.strip_prefix("_OAM.")?;
    Some(format!("{ANSWERS}.*.{asker}.>"))
}

/// The answerer token of answer-inbox subject `subject`, and the rest after it.
pub(crate) fn answered_by(subject: &str) -> Option<(&str, &str)> {
    subject
        .strip_prefix(ANSWERS)?
        .strip_prefix('.')?
        .split_once('.')
}

/// Whether answerer `tag` answers a request whose reply subject is `reply`: only in an answer
/// inbox under its own token, or in the shared `_INBOX.` of clients that keep the NATS
/// default (the Open Agent Mesh SDK's), whatever subject the asker named, so that a responder
/// running with wide rights (the admin's) cannot be made to write a control subject or a
/// bucket, and none is asked to write where the server would refuse it.
pub(crate) fn may_answer_on(tag: &str, reply: &str) -> bool {
    answered_by(reply).is_some_and(|(t, _)| t == tag) || reply.starts_with("_INBOX.")
}

/// Whether `m` was delivered by a JetStream push consumer rather than published: such a
/// delivery always carries a `$JS.ACK.` reply subject, which no client may set on a message it
/// publishes. nats-server does not check a push consumer's deliver subject against the rights
/// of whoever created it, so any role that may create a consumer could otherwise have a stream's
/// messages copied onto a subject it may not publish to: every control-plane loop drops them.
pub fn from_jetstream(m: &async_nats::Message) -> bool {
    m.reply.as_ref().is_some_and(|r| r.starts_with("$JS.ACK."))
}

/// Whether a client whose inboxes are named like `inbox` may read the SDK's shared subjects
/// (`_INBOX.>`, `mesh.stream.>`): SDK roles and users of other servers keep the default inbox
/// and may; of oam's own roles (private inboxes) only the admin may.
pub(crate) fn may_read_shared(inbox: &str) -> bool {
    !inbox.starts_with("_OAM.") || inbox.starts_with("_OAM.admin.")
}

/// The prefix of every agent's serving subject.
pub(crate) const AGENT_PREFIX: &str = "mesh.agent.";
/// Where agent `name` serves (request/reply).
pub fn agent(name: &str) -> String {
    format!("{AGENT_PREFIX}{name}")
}
/// The agent name a serving subject is for (`mesh.agent.{name}`).
pub(crate) fn agent_of(subject: &str) -> Option<&str> {
    subject.strip_prefix(AGENT_PREFIX)
}
/// The queue group every instance of agent `name` joins.
pub(crate) fn agent_queue(name: &str) -> String {
    format!("q.{name}")
}
/// Stream chunks for one request.
pub fn stream(request_id: &str) -> String {
    format!("mesh.stream.{request_id}")
}
/// Death notices for agent `name`.
pub fn death(name: &str) -> String {
    format!("mesh.death.{name}")
}
pub(crate) const DEATHS: &str = "mesh.death.>";
/// The death of one serving instance (a caller whose request it held fails at once, even
/// while other replicas of the agent live).
pub(crate) fn instance_death(instance_id: &str) -> String {
    format!("mesh.instance-death.{instance_id}")
}
pub(crate) const INSTANCE_DEATHS: &str = "mesh.instance-death.*";
/// Heartbeats from instances serving agent `name`.
pub fn health(name: &str) -> String {
    format!("mesh.health.{name}")
}
pub(crate) const HEALTH: &str = "mesh.health.>";
/// The agent a heartbeat subject is for (`mesh.health.{name}`).
pub(crate) fn health_of(subject: &str) -> Option<&str> {
    subject.strip_prefix("mesh.health.")
}
/// Every error reply of agent `name` is also published here.
pub fn errors(name: &str) -> String {
    format!("mesh.errors.{name}")
}
/// The JetStream stream that holds KV bucket `bucket`.
pub(crate) fn kv_stream(bucket: &str) -> String {
    format!("KV_{bucket}")
}

/// The cluster's shared budget ledger (`node::ledger`): `global` and `agent.{name}`.
pub(crate) const BUDGETS_BUCKET: &str = "oam-budgets";
/// The JetStream KV bucket of rate-limit windows (`node::rates`): what each caller was granted
/// per minute, kept two windows.
pub(crate) const RATES_BUCKET: &str = "oam-rates";
pub const CATALOG_BUCKET: &str = "mesh-catalog";
/// The one key of the catalog bucket: a JSON array of entries.
pub const CATALOG_KEY: &str = "catalog";
pub(crate) const REGISTRY_BUCKET: &str = "mesh-registry";
pub const INSTANCES_BUCKET: &str = "mesh-instances";
/// One key per announced instance death, so each is announced once.
pub(crate) const TOMBSTONES_BUCKET: &str = "mesh-tombstones";
/// The NATS connection name of a process that serves agents.
pub(crate) fn host_connection(instance_id: &str) -> String {
    format!("oam-host-{instance_id}")
}

// The system account (nats-server's own subjects).

/// Connection disconnects of every account: the monitor's first signal of a death.
pub(crate) const SYS_DISCONNECTS: &str = "$SYS.ACCOUNT.*.DISCONNECT";
/// Ask server `server` for its connections (CONNZ); an empty name asks every server.
pub(crate) fn sys_connz(server: &str) -> String {
    if server.is_empty() {
        "$SYS.REQ.SERVER.PING.CONNZ".to_string()
    } else {
        format!("$SYS.REQ.SERVER.{server}.CONNZ")
    }
}

/// Ask every server (or those a filter in the body names) for its `kind` of monitoring
/// information (`JSZ`, `VARZ`, ...): what the HTTP monitoring port would tell, asked of the
/// system account instead.
pub(crate) fn sys_ping(kind: &str) -> String {
    format!("$SYS.REQ.SERVER.PING.{kind}")
}

/// Ask every server for its routes (ROUTEZ): which servers the cluster still holds.
pub(crate) const SYS_ROUTEZ: &str = "$SYS.REQ.SERVER.PING.ROUTEZ";

/// A node id is one subject token: letters, digits, '-' and '_'.
pub(crate) fn valid_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_stable() {
        assert_eq!(heartbeat("n1"), "oam.v1.heartbeat.n1");
        assert_eq!(observations("n1"), "oam.v1.observations.n1");
        assert!(valid_token("node-1_a"));
        assert!(!valid_token("a.b") && !valid_token("*") && !valid_token(""));
        assert_eq!(agent("demo.echo"), "mesh.agent.demo.echo");
        assert_eq!(agent_queue("demo.echo"), "q.demo.echo");
        assert_eq!(death("x"), "mesh.death.x");
        assert_eq!(agent_of("mesh.agent.demo.echo"), Some("demo.echo"));
        assert_eq!(agent_of("mesh.death.x"), None);
        assert_eq!(sys_connz(""), "$SYS.REQ.SERVER.PING.CONNZ");
        assert_eq!(sys_connz("S1"), "$SYS.REQ.SERVER.S1.CONNZ");
    }

    #[test]
    fn a_consumer_s_delivery_is_told_from_a_publish() {
        let msg = |reply: Option<&str>| async_nats::Message {
            subject: "oam.v1.chaos.node.all".into(),
            reply: reply.map(Into::into),
            payload: bytes::Bytes::new(),
            headers: None,
            status: None,
            description: None,
            length: 0,
        };
        assert!(from_jetstream(&msg(Some(
            "$JS.ACK.KV_mesh-catalog.N8jufqfl.1.1.1.1796166764736555641.0"
        ))));
        assert!(!from_jetstream(&msg(None)));
        assert!(!from_jetstream(&msg(Some("_OAM.warden.abc.1"))));
    }

    #[test]
    fn private_inboxes_never_nest() {
        assert_eq!(private_inbox("node-n1").as_deref(), Some("_OAM.node.n1"));
        assert_eq!(private_inbox("oam").as_deref(), Some("_OAM.admin"));
        assert_eq!(private_inbox("caller").as_deref(), Some("_OAM.caller"));
        let (demo, echo) = (
            private_inbox("agent-demo").unwrap(),
            private_inbox("agent-demo.echo").unwrap(),
        );
        assert_eq!(echo, "_OAM.agent.demo~echo");
        // A subscription to `{demo}.>` covers no inbox of demo.echo, nor the other way round.
        assert!(!format!("{echo}.x").starts_with(&format!("{demo}.")));
        assert!(!format!("{demo}.x").starts_with(&format!("{echo}.")));
        let tag = answerer_agent("demo.echo");
        assert_eq!(tag, "ag-demo~echo");
        assert_eq!(answers_from(&tag), "_OAM.re.ag-demo~echo.>");
        let at = answer_inbox(&tag, "_OAM.node.n1").unwrap();
        assert_eq!(at, "_OAM.re.ag-demo~echo.node.n1");
        assert_eq!(answer_inboxes("_OAM.caller").unwrap(), "_OAM.re.*.caller.>");
        assert_eq!(answer_inbox(&tag, "_INBOX"), None);
        let reply = format!("{at}.conn.token");
        assert_eq!(
            answered_by(&reply),
            Some((tag.as_str(), "node.n1.conn.token"))
        );
        assert!(may_answer_on(&tag, &reply) && may_answer_on(ANSWERER_NODES, "_INBOX.abc"));
        // Nobody answers into a private inbox, another answerer's, a control subject or a bucket.
        for reply in [
            "_OAM.caller.abc.1",
            "_OAM.re.ag-demo.caller.x.y",
            "_OAM.re.ag-demo~echo2.caller.x",
            "_OAM.reX.ag-demo~echo.caller.x",
            "$KV.oam-budgets.global",
            "oam.v1.chaos.node.n1",
            "_INBOX",
        ] {
            assert!(!may_answer_on(&tag, reply), "{reply}");
        }
        assert!(may_read_shared("_INBOX.abc") && may_read_shared("_OAM.admin.abc"));
        assert!(!may_read_shared("_OAM.caller.abc") && !may_read_shared("_OAM.agent.x.abc"));
        for stranger in ["bob", "node-a.b", "agent-", "agent-a.*", "node-"] {
            assert_eq!(private_inbox(stranger), None, "{stranger}");
        }
    }
}
