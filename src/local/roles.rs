//! Who may do what on a mesh's NATS: one user per role, and the subjects each may publish and
//! subscribe to, enforced by nats-server (the `permissions` of each user in the generated
//! config). A process gets the credentials of its role only, so a hostile agent cannot speak
//! for a node, the monitor or the warden: the server refuses it.
//!
//! | role            | may publish                                             | may read           |
//! |-----------------|---------------------------------------------------------|--------------------|
//! | `node-{id}`     | its own gossip, state, decisions, incidents, escalations; calls; answers | gossip, its chaos, requests |
//! | `monitor`       | death notices; the mesh's liveness records              | heartbeats         |
//! | `warden`        | chaos commands to nodes, chaos events; answers           | chaos requests     |
//! | `operator`      | chaos requests, escalation resolutions                   | everything a viewer reads |
//! | `agent-{name}`  | its own heartbeats, errors, graceful death; calls; answers | its own requests   |
//! | `caller`        | calls to agents, data-plane requests                     | deaths, the catalog |
//! | `sdk-agent-{name}`, `sdk-caller` | as an agent / a caller, for the Open Agent Mesh SDK | also `_INBOX.>`, `mesh.stream.>`, the catalog through a consumer |
//! | `viewer`        | JetStream reads by key and direct get (no consumer); which faults are active (`oam.v1.chaos.list`) | the control plane but requests, mesh events |
//! | admin (`oam`)   | everything, including stream and bucket delete          | everything         |
//!
//! No role has a reply permission (`allow_responses`: the sender of a message picks its reply
//! subject, so it would let anyone publish anywhere by messaging itself). Nobody may publish
//! into a role's private inbox (`subjects::private_inbox`: its JetStream answers and
//! deliveries, which only the server writes). Answers go to answer inboxes
//! (`_OAM.re.{answerer}.{asker}.…`, `transport::ask`): each answering role may publish under
//! its own answerer token only, each asker subscribe under its own inbox only, so an answer's
//! subject says who wrote it. SDK clients keep the shared `_INBOX.`, which SDK roles may read. JetStream: no role but the admin creates, deletes or purges a
//! stream, and only roles trusted with it create consumers (see `consume_stream`). The system
//! account has one limited user, `observer`,
//! that may read disconnect advisories and ask for connection lists (never kick).

use crate::transport::{store::escalations, subjects};

pub use crate::transport::roles::{ADMIN_USER, BadRole, KINDS, OBSERVER_USER, Role, valid_name};

/// Every mesh's roles beside its nodes and agents: its services and the people who use it.
pub(crate) const BESIDE_NODES: [Role; 5] = [
    Role::Monitor,
    Role::Warden,
    Role::Operator,
    Role::Caller,
    Role::Viewer,
];

impl Role {
    /// What the role may do; `None` for the admin, who may do everything. `logs`: the nodes
    /// whose decision logs readers may read (every node that has, or had, credentials).
    pub fn permissions(&self, logs: &[String]) -> Option<Permissions> {
        if *self == Role::Admin {
            return None;
        }
        let mut p = Permissions::base(&self.user());
        match self {
            Role::Admin => return None,
            Role::Viewer => p.viewer(logs),
            Role::Operator => {
                p.viewer(logs);
                p.publish([subjects::CHAOS_INJECT, subjects::CHAOS_RESTORE]);
                p.kv_write(escalations::BUCKET, ">");
                p.kv_write(subjects::BUDGETS_BUCKET, ">");
            }
            Role::Caller => p.caller(),
            Role::SdkCaller => {
                p.caller();
                p.sdk_caller();
            }
            Role::Agent(name) | Role::SdkAgent(name) => {
                p.caller();
                p.publish([
                    subjects::health(name),
                    subjects::death(name),
                    subjects::errors(name),
                    subjects::agent_events(name),
                    // The Open Agent Mesh SDK streams and calls back on these.
                    subjects::ALL_STREAMS.into(),
                    subjects::ALL_RESULTS.into(),
                ]);
                // Answers go to whoever called it, in answer inboxes under its own token; to SDK
                // clients in the shared inbox.
                p.publish([subjects::answers_from(&subjects::answerer_agent(name))]);
                p.publish([subjects::SHARED_INBOXES]);
                p.subscribe([subjects::agent(name)]);
                p.kv_write(subjects::CATALOG_BUCKET, subjects::CATALOG_KEY);
                p.kv_write(subjects::REGISTRY_BUCKET, name);
                // Its own instances' records and tombstones (`{instance_id}.{name}`).
                p.kv_write(subjects::INSTANCES_BUCKET, &format!("*.{name}"));
                p.kv_write(subjects::TOMBSTONES_BUCKET, &format!("*.{name}"));
                if matches!(self, Role::SdkAgent(_)) {
                    p.sdk_caller();
                    // The SDK's shared context and artifacts.
                    p.kv_write(SDK_CONTEXT_BUCKET, ">");
                    p.publish([format!("$O.{SDK_ARTIFACTS_BUCKET}.>")]);
                    p.consume_stream(&format!("OBJ_{SDK_ARTIFACTS_BUCKET}"));
                }
            }
            Role::Node(id) => {
                // A provider may be an agent on the mesh: a node calls it as a caller does.
                p.caller();
                p.publish([
                    subjects::heartbeat(id),
                    subjects::goodbye(id),
                    subjects::observations(id),
                    subjects::decision(id),
                    subjects::state(id),
                    subjects::incident(id),
                    subjects::escalation(id),
                    subjects::loop_event(id),
                    subjects::decision_log(id),
                ]);
                // It answers the NATS data plane under the nodes' token, and clients that keep
                // the default inbox.
                p.publish([subjects::answers_from(subjects::ANSWERER_NODES)]);
                p.publish([subjects::SHARED_INBOXES]);
                p.get_stream(&subjects::decision_log_stream(id));
                p.subscribe([
                    subjects::HEARTBEATS,
                    subjects::GOODBYES,
                    subjects::ALL_OBSERVATIONS,
                    subjects::DEATHS,
                    subjects::REQUEST,
                    subjects::LOOP_EVENTS,
                ]);
                p.subscribe([subjects::chaos_node(id), subjects::chaos_node("all")]);
                for b in [
                    escalations::BUCKET,
                    subjects::BUDGETS_BUCKET,
                    subjects::LOOP_EPISODES_BUCKET,
                ] {
                    p.kv_write(b, ">");
                    p.kv_watch(b);
                }
                // Rate-limit windows are read and written by key, never watched.
                p.kv_write(subjects::RATES_BUCKET, ">");
            }
            Role::Monitor => {
                p.publish([subjects::DEATHS, subjects::INSTANCE_DEATHS]);
                p.subscribe([
                    subjects::HEALTH,
                    subjects::DEATHS,
                    subjects::INSTANCE_DEATHS,
                ]);
                for b in MESH_BUCKETS {
                    p.kv_write(b, ">");
                    p.kv_watch(b);
                }
            }
            Role::Warden => {
                p.publish([subjects::chaos_node("*"), subjects::CHAOS_EVENT.to_string()]);
                // It answers the operator's (and the admin's) chaos requests, and the viewer's
                // one question (which faults are active: it may publish no other).
                p.publish([subjects::answers_from(subjects::ANSWERER_WARDEN)]);
                p.subscribe([
                    subjects::CHAOS_INJECT,
                    subjects::CHAOS_LIST,
                    subjects::CHAOS_RESTORE,
                ]);
                for b in MESH_BUCKETS {
                    p.kv_read(b);
                }
            }
        }
        Some(p)
    }
}

/// The Open Agent Mesh SDK's context bucket and artifact store (created by `oam mesh up`, so
/// agents need not create streams).
pub(crate) const SDK_CONTEXT_BUCKET: &str = "mesh-context";
pub(crate) const SDK_ARTIFACTS_BUCKET: &str = "mesh-artifacts";

/// The agent mesh's buckets.
const MESH_BUCKETS: [&str; 4] = [
    subjects::CATALOG_BUCKET,
    subjects::REGISTRY_BUCKET,
    subjects::INSTANCES_BUCKET,
    subjects::TOMBSTONES_BUCKET,
];

/// Allow-lists for one user.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Permissions {
    pub publish: Vec<String>,
    pub subscribe: Vec<String>,
}

impl Permissions {
    /// What every role needs: its own private inbox (replies, JetStream answers and watches;
    /// `subjects::private_inbox`), JetStream's flow control and acknowledgements.
    fn base(user: &str) -> Permissions {
        let mut p = Permissions::default();
        p.publish(["$JS.API.INFO", "$JS.FC.>", "$JS.ACK.>"]);
        if let Some(inbox) = subjects::private_inbox(user) {
            p.subscribe([format!("{inbox}.>")]);
            p.subscribe(subjects::answer_inboxes(&inbox));
        }
        p
    }

    fn publish<S: Into<String>>(&mut self, subjects: impl IntoIterator<Item = S>) {
        for s in subjects {
            let s = s.into();
            if !self.publish.contains(&s) {
                self.publish.push(s);
            }
        }
    }

    fn subscribe<S: Into<String>>(&mut self, subjects: impl IntoIterator<Item = S>) {
        for s in subjects {
            let s = s.into();
            if !self.subscribe.contains(&s) {
                self.subscribe.push(s);
            }
        }
    }

    /// Read single messages of the stream `stream` (its info with subject counts, which lists
    /// a bucket's keys, and direct gets): no consumer.
    fn get_stream(&mut self, stream: &str) {
        self.publish([
            format!("$JS.API.STREAM.INFO.{stream}"),
            format!("$JS.API.STREAM.MSG.GET.{stream}"),
            format!("$JS.API.DIRECT.GET.{stream}"),
            format!("$JS.API.DIRECT.GET.{stream}.>"),
        ]);
    }

    /// Read the stream `stream` through consumers too (watches, history). Only for streams whose
    /// every writer is trusted, and only for roles that are: nats-server does not check a push
    /// consumer's deliver subject against its creator's rights, so a consumer can copy the
    /// stream's messages onto any subject of the account (control-plane loops drop such
    /// deliveries, `subjects::from_jetstream`; a bucket stores them). No role but the admin
    /// deletes a consumer: consumer names are not scoped by permissions, so a viewer could end
    /// the nodes' watches (the ephemeral consumers oam makes expire by themselves, and the
    /// client's delete of an old one on a reset is allowed to fail).
    fn consume_stream(&mut self, stream: &str) {
        self.get_stream(stream);
        self.publish([
            format!("$JS.API.CONSUMER.CREATE.{stream}"),
            format!("$JS.API.CONSUMER.CREATE.{stream}.>"),
            format!("$JS.API.CONSUMER.INFO.{stream}.>"),
            format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.>"),
        ]);
    }

    fn kv_read(&mut self, bucket: &str) {
        self.get_stream(&subjects::kv_stream(bucket));
    }

    fn kv_watch(&mut self, bucket: &str) {
        self.consume_stream(&subjects::kv_stream(bucket));
    }

    /// Read bucket `bucket` and write the keys `keys` (a key or a wildcard) of it.
    fn kv_write(&mut self, bucket: &str, keys: &str) {
        self.kv_read(bucket);
        self.publish([format!("$KV.{bucket}.{keys}")]);
    }

    /// What the control plane tells: gossip, decisions, state, incidents, escalations, chaos
    /// events, and the agent mesh's liveness. Never the data plane's requests
    /// (`oam.v1.request`: they carry clients' keys) nor anyone's replies.
    fn viewer(&mut self, logs: &[String]) {
        self.subscribe([
            subjects::HEARTBEATS,
            subjects::GOODBYES,
            subjects::ALL_OBSERVATIONS,
            subjects::DECISIONS,
            subjects::STATES,
            subjects::INCIDENTS,
            subjects::ESCALATIONS,
            subjects::LOOP_EVENTS,
            subjects::CHAOS_EVENT,
            subjects::DEATHS,
            subjects::INSTANCE_DEATHS,
            subjects::HEALTH,
            subjects::ALL_ERRORS,
        ]);
        // Every store is read by key or by direct get, never through a consumer: a viewer
        // creates none (a consumer could copy a stream's bytes onto any subject, and each one
        // is the server's to keep), so it can leave none behind and use up no consumer slot.
        for b in MESH_BUCKETS {
            self.kv_read(b);
        }
        for b in [escalations::BUCKET, subjects::BUDGETS_BUCKET] {
            self.kv_read(b);
        }
        // The decision log: every node's stream (listed by name), and the shared one of
        // earlier oam.
        self.publish(["$JS.API.STREAM.NAMES"]);
        self.get_stream(subjects::DECISION_LOG_STREAM);
        for node in logs {
            self.get_stream(&subjects::decision_log_stream(node));
        }
        // Which faults are active (asking changes nothing; injecting is the operator's).
        self.publish([subjects::CHAOS_LIST]);
    }

    /// What the Open Agent Mesh SDK needs beyond oam's own callers: it keeps NATS' default
    /// inbox and streams on `mesh.stream.{id}`, both shared by every SDK client (so each can read
    /// the others' replies and streams), and it watches the catalog through a consumer (so it
    /// can have the catalog's bytes, which agents write, copied onto any subject).
    fn sdk_caller(&mut self) {
        self.subscribe([
            subjects::SHARED_INBOXES,
            subjects::ALL_STREAMS,
            subjects::ALL_RESULTS,
        ]);
        self.kv_watch(subjects::CATALOG_BUCKET);
    }

    /// Call agents and the data plane; read the catalog, contracts and instances by key.
    fn caller(&mut self) {
        self.publish([subjects::ALL_AGENTS, subjects::REQUEST]);
        self.subscribe([
            subjects::DEATHS,
            subjects::INSTANCE_DEATHS,
            subjects::HEALTH,
        ]);
        for b in [
            subjects::CATALOG_BUCKET,
            subjects::REGISTRY_BUCKET,
            subjects::INSTANCES_BUCKET,
        ] {
            self.kv_read(b);
        }
    }
}

/// The SYS account's `observer`: disconnect advisories, connection and route lists, nothing
/// else.
pub(crate) fn observer_permissions() -> Permissions {
    let mut p = Permissions::base(OBSERVER_USER);
    p.publish.clear();
    p.publish([
        subjects::sys_connz(""),
        subjects::sys_connz("*"),
        subjects::SYS_ROUTEZ.to_string(),
    ]);
    p.subscribe([subjects::SYS_DISCONNECTS]);
    p
}

/// The `permissions` block of a user in nats-server's config.
pub(crate) fn config_block(p: &Permissions) -> String {
    let list = |v: &[String]| {
        v.iter()
            .map(|s| serde_json::to_string(s).unwrap_or_default())
            .collect::<Vec<_>>()
            .join(", ")
    };
    // No `allow_responses`: it would let a user publish once to any reply subject of a message
    // it received, and a sender chooses that subject, so anyone could send themselves a
    // message "answered" on a control subject. Answers go to inboxes listed in `publish`.
    format!(
        "permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }} }}",
        list(&p.publish),
        list(&p.subscribe)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nodes whose decision logs the tests' mesh keeps.
    fn logs() -> Vec<String> {
        vec!["n1".into(), "n2".into()]
    }

    fn may_publish(role: &Role, subject: &str) -> bool {
        let Some(p) = role.permissions(&logs()) else {
            return true;
        };
        p.publish.iter().any(|pat| matches(pat, subject))
    }

    /// NATS subject matching: `*` one token, `>` the rest.
    fn matches(pattern: &str, subject: &str) -> bool {
        let (mut p, mut s) = (pattern.split('.'), subject.split('.'));
        loop {
            match (p.next(), s.next()) {
                (Some(">"), Some(_)) => return true,
                (Some("*"), Some(_)) => {}
                (Some(a), Some(b)) if a == b => {}
                (None, None) => return true,
                _ => return false,
            }
        }
    }

    #[test]
    fn users_and_roles_round_trip() {
        for role in [
            Role::Admin,
            Role::Node("n1".into()),
            Role::Agent("demo.echo".into()),
            Role::Monitor,
            Role::Warden,
            Role::Operator,
            Role::Caller,
            Role::SdkAgent("py.echo".into()),
            Role::SdkCaller,
            Role::Viewer,
        ] {
            assert_eq!(Role::of_user(&role.user()), Some(role));
        }
        assert_eq!(Role::of_user("stranger"), None);
        assert_eq!(Role::of_user("agent-a.*"), None);
        assert_eq!(Role::of_user("node-a.b"), None);
    }

    #[test]
    fn names_are_checked() {
        assert!(Role::parse("agent", Some("demo.echo")).is_ok());
        assert!(Role::parse("agent", Some("a.>")).is_err());
        assert!(Role::parse("agent", Some("a b")).is_err());
        assert!(Role::parse("agent", None).is_err());
        assert!(Role::parse("node", Some("n.1")).is_err());
        assert!(Role::parse("viewer", Some("x")).is_err());
        assert!(
            Role::parse("root", None)
                .unwrap_err()
                .0
                .contains("one of: agent")
        );
    }

    #[test]
    fn only_the_right_role_speaks_for_a_subject() {
        let agent = Role::Agent("demo.echo".into());
        let caller = Role::Caller;
        let viewer = Role::Viewer;
        let n1 = Role::Node("n1".into());
        let node_fault = subjects::chaos_node("n1");
        for r in [&agent, &caller, &viewer, &n1] {
            assert!(!may_publish(r, &node_fault), "{r:?}");
            assert!(!may_publish(r, subjects::CHAOS_INJECT), "{r:?}");
            assert!(!may_publish(r, &subjects::death("other")), "{r:?}");
            assert!(!may_publish(r, &subjects::instance_death("abc")), "{r:?}");
            assert!(!may_publish(r, "$JS.API.STREAM.DELETE.KV_mesh-catalog"));
            assert!(!may_publish(r, "$KV.oam-escalations.esc-n1-1-1") || r == &n1);
            assert!(!may_publish(r, &subjects::heartbeat("n2")), "{r:?}");
        }
        assert!(may_publish(&n1, &subjects::heartbeat("n1")));
        // A node calls a provider that is an agent on the mesh.
        assert!(may_publish(&n1, &subjects::agent("llm.chat")));
        assert!(may_publish(&agent, &subjects::health("demo.echo")));
        assert!(!may_publish(&agent, &subjects::health("other")));
        assert!(may_publish(&agent, &subjects::death("demo.echo")));
        // Its own instances' records and tombstones, nobody else's.
        assert!(may_publish(&agent, "$KV.mesh-tombstones.abc.demo.echo"));
        assert!(!may_publish(&agent, "$KV.mesh-tombstones.abc.demo.other"));
        assert!(!may_publish(&agent, "$KV.mesh-tombstones.abc"));
        assert!(!may_publish(&agent, "$KV.mesh-instances.abc.demo.echo.x"));
        assert!(may_publish(&Role::Monitor, &subjects::death("other")));
        assert!(may_publish(&Role::Warden, &node_fault));
        assert!(may_publish(&Role::Operator, subjects::CHAOS_INJECT));
        assert!(!may_publish(&Role::Operator, &node_fault));
        assert!(may_publish(
            &Role::Admin,
            "$JS.API.STREAM.DELETE.KV_mesh-catalog"
        ));
        // No untrusted role creates a consumer on what agents write (it could have the server
        // copy an agent's bytes onto any subject); an SDK role must, for the SDK's catalog watch.
        let create = "$JS.API.CONSUMER.CREATE.KV_mesh-catalog";
        for r in [&agent, &caller, &viewer, &Role::Operator, &Role::Warden] {
            assert!(!may_publish(r, create), "{r:?}");
            assert!(
                may_publish(r, "$JS.API.DIRECT.GET.KV_mesh-catalog"),
                "{r:?}"
            );
        }
        assert!(may_publish(&Role::SdkAgent("py.x".into()), create));
        assert!(may_publish(&Role::SdkCaller, create));
        // A node watches its buckets through consumers; nobody reads the log through one.
        assert!(may_publish(&n1, "$JS.API.CONSUMER.CREATE.KV_oam-budgets"));
        assert!(!may_publish(
            &n1,
            "$JS.API.CONSUMER.CREATE.OAM_DECISIONS_n1"
        ));
        // A node writes its own decision log and no other's, and changes no stream.
        assert!(may_publish(&n1, &subjects::decision_log("n1")));
        assert!(!may_publish(&n1, &subjects::decision_log("n2")));
        assert!(!may_publish(&n1, "$JS.API.DIRECT.GET.OAM_DECISIONS_n2"));
        for verb in ["CREATE", "UPDATE", "DELETE", "PURGE"] {
            assert!(!may_publish(
                &n1,
                &format!("$JS.API.STREAM.{verb}.OAM_DECISIONS_n1")
            ));
        }
        // Answers: only under the answerer's own token, never into a private inbox, never a
        // reply permission.
        for r in [&agent, &n1, &caller, &viewer, &Role::Warden, &Role::Monitor] {
            for inbox in ["_OAM.caller.abc.1", "_OAM.node.n2.abc", "_OAM.admin.abc"] {
                assert!(!may_publish(r, inbox), "{r:?} {inbox}");
            }
        }
        assert!(may_publish(&agent, "_OAM.re.ag-demo~echo.caller.c.1"));
        assert!(!may_publish(&agent, "_OAM.re.ag-demo~other.caller.c.1"));
        assert!(!may_publish(&agent, "_OAM.re.nodes.caller.c.1"));
        assert!(may_publish(&n1, "_OAM.re.nodes.caller.c.1"));
        assert!(!may_publish(&n1, "_OAM.re.warden.operator.c.1"));
        assert!(may_publish(&Role::Warden, "_OAM.re.warden.operator.c.1"));
        assert!(!may_publish(&caller, "_OAM.re.nodes.caller.c.1"));
        let p = caller.permissions(&logs()).unwrap();
        assert!(p.subscribe.contains(&"_OAM.re.*.caller.>".to_string()));
        // A viewer publishes nothing but JetStream reads and the question which faults are
        // active; injecting and restoring are the operator's.
        let v = viewer.permissions(&logs()).unwrap();
        assert!(
            v.publish
                .iter()
                .all(|s| s.starts_with("$JS.") || s == subjects::CHAOS_LIST),
            "{:?}",
            v.publish
        );
        assert!(may_publish(&viewer, subjects::CHAOS_LIST));
        assert!(!may_publish(&viewer, subjects::CHAOS_INJECT));
        assert!(!may_publish(&viewer, subjects::CHAOS_RESTORE));
        // ... and creates no consumer, ephemeral or durable, on any stream.
        // It reads every node's decision log, and the shared one of earlier oam.
        let streams = ["OAM_DECISIONS_n1", "OAM_DECISIONS_n2", "OAM_DECISIONS"];
        for stream in streams
            .into_iter()
            .chain(["KV_oam-budgets", "KV_oam-escalations"])
        {
            for create in [
                format!("$JS.API.CONSUMER.CREATE.{stream}"),
                format!("$JS.API.CONSUMER.CREATE.{stream}.name"),
                format!("$JS.API.CONSUMER.CREATE.{stream}.name.filter"),
                format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.name"),
            ] {
                assert!(!may_publish(&viewer, &create), "{create}");
            }
            assert!(may_publish(
                &viewer,
                &format!("$JS.API.DIRECT.GET.{stream}")
            ));
        }
    }

    #[test]
    fn the_config_block_quotes_every_subject() {
        let block = config_block(&Role::Viewer.permissions(&logs()).unwrap());
        assert!(block.contains("\"$JS.API.INFO\""), "{block}");
        assert!(!block.contains("allow_responses"), "{block}");
    }
}
