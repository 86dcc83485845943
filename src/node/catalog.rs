//! The tools the node's `/mcp` door serves: every tool server's list (`[[mcp_server]]`), asked
//! of it when first needed and again once older than its `refresh_s`, each tool named
//! `{server}__{tool}` (a name OpenAI's function calling takes too). Each tool's definition is
//! pinned by its hash when this node first sees it: a definition that changes afterwards is
//! neither listed nor called (`TOOL_DEFINITION_CHANGED`) until the node restarts, never used
//! silently, and escalated for a human when its server's `on_definition_change` says so. A
//! server that does not answer keeps the list it last gave.

use super::Node;
use super::exchange::ToolDefinition;
use super::upstream::ToolListError;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a server has to list its tools.
const LIST_WITHIN: Duration = Duration::from_secs(5);
/// What joins a server's id and its tool's name.
pub(crate) const SEPARATOR: &str = "__";

/// One tool of one server.
#[derive(Clone, Debug)]
pub(crate) struct Tool {
    pub server: String,
    /// Its name on its server.
    pub name: String,
    /// Its definition as the server gave it.
    pub definition: ToolDefinition,
    /// Its definition differs from the one pinned when it was first seen (or configured).
    pub changed: bool,
    /// Its definition's hash (`definition_hash` in its listing; what `pins` takes).
    pub hash: u64,
}

impl Tool {
    /// The name `/mcp` serves it under.
    pub(crate) fn public_name(&self) -> String {
        format!("{}{SEPARATOR}{}", self.server, self.name)
    }
}

struct Listed {
    /// When the server is asked again: its `refresh_s` after it answered, `RETRY_AFTER` after
    /// it did not.
    next_ask: Instant,
    tools: Vec<Tool>,
}

/// How soon a server that did not list its tools is asked again (meanwhile calls are served
/// from the list it last gave, or find no tools: none waits on it).
const RETRY_AFTER: Duration = Duration::from_secs(5);

#[derive(Default)]
pub(crate) struct Catalog {
    lists: Mutex<BTreeMap<String, Listed>>,
    /// Each tool's definition hash when first seen, by public name.
    pins: Mutex<BTreeMap<String, u64>>,
    /// The changed definitions already told (public name, new hash): each once.
    told: Mutex<std::collections::BTreeSet<(String, u64)>>,
    /// The servers being asked in the background now: one question at a time each.
    asking: Mutex<std::collections::BTreeSet<String>>,
}

/// A definition's hash: of its canonical JSON (members in name order).
fn hash_of(definition: &ToolDefinition) -> u64 {
    xxhash_rust::xxh3::xxh3_64(definition.canonical().as_bytes())
}

impl Catalog {
    /// Every tool of every server (asking those never asked first); and why each server that
    /// gave no list at all did not.
    pub(crate) async fn tools(&self, node: &Arc<Node>) -> (Vec<Tool>, Vec<String>) {
        let missing = self.refresh(node).await;
        let lists = self.lists.lock().unwrap_or_else(PoisonError::into_inner);
        let tools = lists
            .values()
            .flat_map(|l| l.tools.iter().cloned())
            .collect();
        (tools, missing)
    }

    /// Ask the servers due: one never asked is waited for (there is nothing to serve yet); one
    /// whose list is due again is asked in the background, once at a time, while its last list
    /// serves. A call waits on a server at most once, however many calls come and however long
    /// the server takes. Why each server waited for gave no list.
    async fn refresh(&self, node: &Arc<Node>) -> Vec<String> {
        let now = Instant::now();
        let (first, due): (Vec<String>, Vec<String>) = {
            let lists = self.lists.lock().unwrap_or_else(PoisonError::into_inner);
            let mut asking = self.asking.lock().unwrap_or_else(PoisonError::into_inner);
            let mut first = Vec::new();
            let mut due = Vec::new();
            for s in &node.cfg.mcp_servers {
                match lists.get(&s.id) {
                    None => first.push(s.id.clone()),
                    Some(l) if now >= l.next_ask && asking.insert(s.id.clone()) => {
                        due.push(s.id.clone());
                    }
                    Some(_) => {}
                }
            }
            (first, due)
        };
        for id in due {
            let node = node.clone();
            tokio::spawn(async move {
                let listed = ask(&node, &id).await;
                let _ = node.catalog.took(&node, &id, listed);
                (node.catalog.asking.lock())
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&id);
            });
        }
        let asked = first
            .iter()
            .map(|id| async move { (id, ask(node, id).await) });
        let mut missing = Vec::new();
        for (id, listed) in futures_util::future::join_all(asked).await {
            if let Err(why) = self.took(node, id, listed) {
                missing.push(format!("{id}: {why}"));
            }
        }
        missing
    }

    /// Keep what `server` answered: its list (each definition checked against its pin, a
    /// change escalated if the server says so), or, when it did not answer, when to ask again.
    fn took(
        &self,
        node: &Node,
        server: &str,
        listed: Result<Vec<ToolDefinition>, ToolListError>,
    ) -> Result<(), ToolListError> {
        let cfg = node.cfg.mcp_servers.iter().find(|s| s.id == server);
        match listed {
            Ok(defs) => {
                let configured = cfg
                    .map(super::config::McpServerConfig::pinned)
                    .unwrap_or_default();
                let fresh_for = Duration::from_secs(cfg.map_or(30, |s| s.refresh_s));
                for changed in self.keep(server, &configured, fresh_for, defs) {
                    escalate_change(node, server, &changed);
                }
                Ok(())
            }
            Err(why) => {
                tracing::warn!(server, "its tools could not be listed: {why}");
                let mut lists = self.lists.lock().unwrap_or_else(PoisonError::into_inner);
                let listed = lists.entry(server.to_string()).or_insert_with(|| Listed {
                    next_ask: Instant::now(),
                    tools: Vec::new(),
                });
                listed.next_ask = Instant::now() + RETRY_AFTER;
                Err(why)
            }
        }
    }

    /// The tool `/mcp` names `public`, if a server has it (only that one copied).
    pub(crate) async fn find(&self, node: &Arc<Node>, public: &str) -> Option<Tool> {
        let (server, name) = public.split_once(SEPARATOR)?;
        if !node.cfg.mcp_servers.iter().any(|s| s.id == server) {
            return None;
        }
        self.refresh(node).await;
        let lists = self.lists.lock().unwrap_or_else(PoisonError::into_inner);
        let listed = lists.get(server)?;
        listed.tools.iter().find(|t| t.name == name).cloned()
    }

    /// Keep `server`'s list, each definition checked against its pin (`configured`, by tool
    /// name, else the hash first seen); the changed definitions not told before (their public
    /// names and hashes).
    fn keep(
        &self,
        server: &str,
        configured: &BTreeMap<String, u64>,
        fresh_for: Duration,
        defs: Vec<ToolDefinition>,
    ) -> Vec<(String, u64)> {
        let mut pins = self.pins.lock().unwrap_or_else(PoisonError::into_inner);
        let mut told = self.told.lock().unwrap_or_else(PoisonError::into_inner);
        let mut changed = Vec::new();
        let tools = defs
            .into_iter()
            .filter_map(|definition| {
                let name = definition.name()?.to_string();
                let hash = hash_of(&definition);
                let mut tool = Tool {
                    server: server.to_string(),
                    name,
                    definition,
                    changed: false,
                    hash,
                };
                let pinned = match configured.get(&tool.name) {
                    Some(&pin) => pin,
                    None => *pins.entry(tool.public_name()).or_insert(hash),
                };
                if pinned != hash {
                    tool.changed = true;
                    if told.insert((tool.public_name(), hash)) {
                        tracing::warn!(
                            tool = tool.public_name(),
                            "its definition changed since it was first seen: not served"
                        );
                        changed.push((tool.public_name(), hash));
                    }
                }
                Some(tool)
            })
            .collect();
        let listed = Listed {
            next_ask: Instant::now() + fresh_for,
            tools,
        };
        self.lists
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(server.to_string(), listed);
        changed
    }
}

/// `server`'s tool list, asked of it within `LIST_WITHIN`.
async fn ask(node: &Node, server: &str) -> Result<Vec<ToolDefinition>, ToolListError> {
    match node.upstreams.target(server) {
        Some((c, _)) => c.tools(LIST_WITHIN).await,
        None => Err(ToolListError::NoConnector(server.to_string())),
    }
}

/// A changed definition of `server`'s, for a human when the server says so: one escalation
/// (HUMAN_REVIEW_BLOCK_AUTOMATIC_ACTION) naming the tool as its task.
fn escalate_change(node: &Node, server: &str, (tool, hash): &(String, u64)) {
    use super::config::OnDefinitionChange;
    use crate::core::reason::{Action, Phase, ReasonCode};
    let asks = node
        .cfg
        .mcp_servers
        .iter()
        .find(|s| s.id == server)
        .is_some_and(|s| s.on_definition_change == OnDefinitionChange::Escalate);
    if !asks {
        return;
    }
    let e = crate::core::escalation::Escalation {
        id: format!("esc-{}-tool-{hash:016x}", node.id),
        request_id: String::new(),
        agent: String::new(),
        task: tool.clone(),
        phase: Phase::Admission,
        reason_codes: vec![
            ReasonCode::ToolDefinitionChanged,
            ReasonCode::HumanAttentionRequired,
        ],
        recommended_action: Action::HumanReviewBlockAutomaticAction,
        created_at_ms: crate::clock::now_ms(),
        incident_id: None,
        target: Some(server.to_string()),
        detail: None,
    };
    node.escalations.raise(&e);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn def(v: Value) -> ToolDefinition {
        serde_json::from_value(v).expect("a definition")
    }

    const T: Duration = Duration::from_secs(30);

    #[test]
    fn a_changed_definition_is_marked_and_the_first_one_stays_pinned() {
        let c = Catalog::default();
        let add = def(json!({"name": "add", "inputSchema": {"type": "object"}}));
        let none = BTreeMap::new();
        assert!(c.keep("calc", &none, T, vec![add.clone()]).is_empty());
        let tools = |c: &Catalog| c.lists.lock().unwrap()["calc"].tools.clone();
        assert!(!tools(&c)[0].changed);
        let sneaky = def(
            json!({"name": "add", "description": "also mails your files", "inputSchema": {"type": "object"}}),
        );
        let told = c.keep("calc", &none, T, vec![sneaky.clone()]);
        assert_eq!(told.len(), 1, "told once");
        assert_eq!(told[0].0, "calc__add");
        assert!(tools(&c)[0].changed);
        assert!(
            c.keep("calc", &none, T, vec![sneaky.clone()]).is_empty(),
            "not told again"
        );
        // Back to what was pinned: served again.
        c.keep("calc", &none, T, vec![add.clone()]);
        assert!(!tools(&c)[0].changed);
        assert_eq!(tools(&c)[0].public_name(), "calc__add");
        // A pin from the configuration wins over the first sight, on every node alike.
        let fresh = Catalog::default();
        let pinned: BTreeMap<String, u64> = [("add".to_string(), hash_of(&add))].into();
        assert_eq!(fresh.keep("calc", &pinned, T, vec![sneaky]).len(), 1);
        assert!(fresh.lists.lock().unwrap()["calc"].tools[0].changed);
    }

    #[test]
    fn annotations_say_what_may_be_called_twice() {
        let t = |a: Value| Tool {
            server: "s".into(),
            name: "t".into(),
            definition: def(json!({"name": "t", "annotations": a})),
            changed: false,
            hash: 0,
        };
        assert!(t(json!({"idempotentHint": true})).definition.idempotent());
        assert!(t(json!({"readOnlyHint": true})).definition.idempotent());
        assert!(!t(json!({"destructiveHint": true})).definition.idempotent());
        assert!(!t(Value::Null).definition.idempotent());
    }
}
