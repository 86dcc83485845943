//! `oam.toml`: a node's providers, timings, pipeline and budgets. Every section is optional; the
//! embedded default points at `oam sim` so nothing needs configuring. Errors name the file, the
//! line and the field.
//!
//! ```toml
//! [node]
//! cluster_size = 3            # n for the quorum
//! members = ["n1", "n2", "n3"] # optional: exactly who may speak (cluster_size is then its length)
//! probe_interval_ms = 1000
//! probe_timeout_ms = 2000
//! heartbeat_interval_ms = 1000
//! health_window_ms = 15000
//! queue_timeout_ms = 5000     # longest wait in a bulkhead queue
//! max_body_bytes = 1048576
//! max_answer_bytes = 8388608  # an upstream's answer (or stream) larger than this is cut off
//! max_connections = 9872      # open HTTP connections (default: (open files - 256) / 2)
//! header_timeout_ms = 10000   # a request's headers within this (and idle keep-alive this long)
//! write_timeout_ms = 30000    # a client takes each write within this, or is hung up on
//! budget_lease_ms = 30000     # a dead node's holds in the shared budget ledger lapse after this
//! lanes = 2                   # threads HTTP connections are served on, each connection on one
//!                             # (default: one per core; 0: on the node's shared runtime)
//!
//! [[provider]]                # a host, in preference order
//! id = "primary"
//! base_url = "http://127.0.0.1:8081/primary/v1"
//! model = "sim-large"              # its one model: the target is named "primary" ...
//! # models = ["a", { name = "b", cost_per_1k_tokens_usd = 0.002 }]  # ... or several: "primary/a"
//! api_key_env = "OPENAI_API_KEY"   # optional: the key is read from this variable
//! # api = "anthropic"               # what base_url speaks: "openai" (chat completions, the
//!                                  # default) or "anthropic" (Messages; x-api-key; prefill)
//! # embeddings = true              # its models serve POST /v1/embeddings (and nothing else)
//! # agent = "llm.local"            # instead of base_url: a mesh agent answering chat requests
//! cost_per_1k_tokens_usd = 0.01    # target attributes, for each of its models unless the
//! output_cost_per_1k_usd = 0.03    # model says otherwise: prices (prompt; completion;
//! cached_input_cost_per_1k_usd = 0.001  # prompt tokens read from its cache, written to it,
//! cache_write_cost_per_1k_usd = 0.0125  # and completion tokens spent reasoning: each
//! reasoning_cost_per_1k_usd = 0.03      # optional, else the prompt or completion price),
//! context_window = 128000          # prompt + completion tokens at most,
//! prefill = false                  # whether it continues a trailing assistant message,
//! fallback = false                 # and whether it is a fallback (scored routing)
//! probe = "auto"                   # when idle: "auto" (GET /models, free; one billed token
//!                                  # only to confirm a failed target's recovery), "chat" (a
//!                                  # short completion each time: billed), "models", or "off"
//!
//! [[route]]                   # a model name clients ask for, and who serves it, in order
//! model = "fast"
//! targets = ["primary", "secondary/m"]   # provider/model, or a one-model provider's id
//! contract = {}               # optional: answers held to the JSON contract (a stream on a
//!                             # contracted route is checked whole, then released: buffered)
//! first_token_ms = 5000       # optional: this route's stream deadlines
//!
//! [streaming]                 # deadlines of a stream relayed live
//! first_token_ms = 10000
//! idle_ms = 5000
//! total_ms = 300000
//! done_grace_ms = 1000        # after the finish chunk, how long [DONE] is waited for
//!
//! [pipeline]                  # overrides of the decision defaults (see docs/decide.md)
//! max_attempts = { low = 3, medium = 2, high = 2 }
//! same_target_retries = 1     # a 5xx or 429 is retried on its target first
//! default_contract = {}       # hold every answer to the JSON contract (none by default)
//! stream_bulkheads = { normal = { concurrency = 6000, queue = 500 } }  # streams' own slots
//!                             # (defaults of it and `bulkheads`: sized from cores and open files)
//!
//! [[client]]                  # who may call: with any, every request (HTTP or NATS) needs
//! id = "support-bot"          # `Authorization: Bearer <key>` of one, and its id is the agent
//! key_env = "OAM_KEY_SUPPORT_BOT"   # the key is read from this variable (16 characters or more)
//! rpm = 100                   # optional: requests and tokens per minute, held across the
//! tpm = 200000                # cluster (over either: 429 with Retry-After)
//! team = "support"            # optional: the team's budget covers its requests too
//!
//! [rate_limits.batch-job]     # the same limits for an agent that names itself (no key)
//! rpm = 20
//!
//! [budgets.agents.support-bot]  # seeds the cluster's shared ledger if it has no such budget;
//! limit_usd = 5.0                # after that `oam budget set/reset` manage it. A request is
//!                                # charged to every budget that covers it: its task's
//! [budgets.teams.support]        # (`budgets.tasks.NAME`, the request's x-oam-task), its
//! limit_usd = 50.0               # agent's (a key's id), its team's and the global one
//! on_exceeded = "audit"          # "refuse" (default), "escalate" (whatever the risk), or
//!                                # "audit": let through, recorded as BUDGET_WOULD_REFUSE
//! [budgets.global]
//! limit_usd = 200.0
//!
//! [escalations]               # where a human hears of an escalation
//! webhook_url = "https://hooks.example.com/oam"   # POSTed {"node", "escalation"} as JSON
//! webhook_attempts = 5        # retried with backoff (250 ms doubling, at most 5 s) until 2xx
//! webhook_timeout_ms = 2000
//! command = ["/usr/local/bin/page-oncall", "--team", "ai"]  # the same JSON on stdin; exit 0
//! command_attempts = 3        # retried with the same backoff; each killed after the timeout
//! command_timeout_ms = 5000
//!
//! [decision_log]              # every decision's record, for `oam explain` and `oam audit`
//! max_age_hours = 168
//! max_bytes = 268435456       # the stream's size at most (JetStream sets it aside)
//! content = "full"            # or "hash": messages kept as hashes (not replayable)
//! max_content_bytes = 16384  # a record with more content than this is kept as under "hash"
//! durable = false             # true: an answer waits until its record is in the stream
//!
//! [telemetry]                 # OpenTelemetry: a span per request and per attempt (OTLP/HTTP)
//! otlp_endpoint = "http://127.0.0.1:4318"  # else $OTEL_EXPORTER_OTLP_ENDPOINT; none: off
//! headers = { "x-api-key" = "..." }        # sent with every export
//! service_name = "oam"        # else $OTEL_SERVICE_NAME, else "oam"
//! protocol = "http/protobuf"  # or "http/json" (else $OTEL_EXPORTER_OTLP_PROTOCOL, else JSON)
//! resource_attributes = { "deployment.environment" = "prod" }  # beside $OTEL_RESOURCE_ATTRIBUTES
//! content = false             # true: messages and answers on the spans (gen_ai.*.messages)
//! timeout_ms = 5000           # one export's deadline
//!
//! [probes]                    # what health probes may cost
//! max_usd_per_day = 0.50      # billed probes, for the cluster per UTC day (none: no cap)
//! ```

use crate::core::budget::Budgets;
use crate::core::bulkhead::{BulkheadConfig, Kind};
use crate::core::pipeline::Config as PipelineConfig;
use serde::Deserialize;
use std::path::Path;

#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct NodeSettings {
    pub cluster_size: usize,
    /// The node ids that make up the cluster; without it, the first `cluster_size` ids heard.
    pub members: Vec<String>,
    pub probe_interval_ms: u64,
    pub probe_timeout_ms: u64,
    pub heartbeat_interval_ms: u64,
    pub health_window_ms: u64,
    pub queue_timeout_ms: u64,
    pub max_body_bytes: usize,
    /// The most an upstream's answer may hold (a whole answer, or a stream's events in all):
    /// past it the attempt fails and what was read is dropped, so no upstream grows a node.
    pub max_answer_bytes: usize,
    /// Open HTTP connections at most (keep it under the open-file limit); more wait, unaccepted,
    /// until one closes.
    pub max_connections: usize,
    /// A request's headers must arrive within this, counted from when the node is ready to read
    /// them; a kept-alive connection idle this long is closed.
    pub header_timeout_ms: u64,
    /// How long a write may wait for the client to take it before the connection is closed.
    pub write_timeout_ms: u64,
    /// How long this node's holds in the shared budget ledger count without renewal (renewed
    /// every third of it while the node lives): how soon a dead node's holds lapse.
    pub budget_lease_ms: u64,
    /// Single-threaded lanes (`http::lanes`) HTTP connections are served on, a connection on
    /// one lane for its life with that lane's own upstream pool; 0 serves them on the node's
    /// shared runtime. Unset: one per core.
    pub lanes: usize,
}

/// More lanes than this is a typo, not a machine.
const MAX_LANES: usize = 256;

impl Default for NodeSettings {
    fn default() -> Self {
        NodeSettings {
            cluster_size: 3,
            members: Vec::new(),
            probe_interval_ms: 1_000,
            probe_timeout_ms: 2_000,
            heartbeat_interval_ms: 1_000,
            health_window_ms: 15_000,
            queue_timeout_ms: 5_000,
            max_body_bytes: 1 << 20,
            max_answer_bytes: 8 << 20,
            max_connections: 512,
            header_timeout_ms: 10_000,
            write_timeout_ms: 30_000,
            budget_lease_ms: 30_000,
            lanes: 0,
        }
    }
}

#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct ProviderConfig {
    pub id: String,
    /// The OpenAI-compatible base URL (what `/chat/completions` is appended to).
    #[serde(default)]
    pub base_url: String,
    /// The API it speaks at `base_url`: `"openai"` (chat completions, the default) or
    /// `"anthropic"` (Messages: `/messages` is appended, the key goes in `x-api-key`, and it
    /// continues an assistant prefill natively).
    #[serde(default)]
    pub api: crate::core::request::Api,
    /// Its models serve embeddings (`POST {base_url}/embeddings`), and only embeddings requests
    /// go to them.
    #[serde(default)]
    pub embeddings: bool,
    /// Or: the provider is an agent on the mesh, called by this name with the chat request as
    /// its payload and answering with a chat completion. Its death notice marks it down at once.
    #[serde(default)]
    pub agent: Option<String>,
    /// Its one model (the target is then named by the provider's id) ...
    #[serde(default)]
    pub model: String,
    /// ... or several, each a target named `{id}/{model}`: names, or tables with the target
    /// attributes below for that model alone.
    #[serde(default)]
    pub models: Vec<ModelEntry>,
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Target attributes, for every model of the provider unless a model says otherwise:
    /// price per 1,000 prompt tokens (and completion tokens, unless `output_cost_per_1k_usd`).
    /// A target whose configuration names no price at all is priced from the price table
    /// (`data/prices.toml`) when its model is listed there.
    #[serde(default)]
    pub cost_per_1k_tokens_usd: Option<f64>,
    #[serde(default)]
    pub output_cost_per_1k_usd: Option<f64>,
    /// Prices per 1,000 prompt tokens read from the provider's cache, written to it, and
    /// completion tokens spent reasoning (else the prompt price, and the completion price).
    #[serde(default)]
    pub cached_input_cost_per_1k_usd: Option<f64>,
    #[serde(default)]
    pub cache_write_cost_per_1k_usd: Option<f64>,
    #[serde(default)]
    pub reasoning_cost_per_1k_usd: Option<f64>,
    /// Price of each call, whatever its tokens.
    #[serde(default)]
    pub cost_per_call_usd: f64,
    /// Prompt plus completion tokens at most.
    #[serde(default)]
    pub context_window: Option<u64>,
    /// Does it continue a trailing assistant message (a prefill)?
    #[serde(default)]
    pub prefill: bool,
    #[serde(default)]
    pub fallback: bool,
    /// How the node checks the provider while no traffic does (traffic outcomes are the
    /// health samples otherwise).
    #[serde(default)]
    pub probe: Probe,
    /// A tool server whose tools are the mesh's agents (`[[mcp_server]] mesh = true`).
    #[serde(skip)]
    pub mesh_tools: bool,
}

/// One model of a provider: its name, or its name with its own target attributes.
#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(untagged)]
pub(crate) enum ModelEntry {
    Name(String),
    Full(ModelConfig),
}

#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct ModelConfig {
    pub name: String,
    #[serde(default)]
    pub cost_per_1k_tokens_usd: Option<f64>,
    #[serde(default)]
    pub output_cost_per_1k_usd: Option<f64>,
    #[serde(default)]
    pub cached_input_cost_per_1k_usd: Option<f64>,
    #[serde(default)]
    pub cache_write_cost_per_1k_usd: Option<f64>,
    #[serde(default)]
    pub reasoning_cost_per_1k_usd: Option<f64>,
    #[serde(default)]
    pub context_window: Option<u64>,
    #[serde(default)]
    pub prefill: Option<bool>,
    #[serde(default)]
    pub fallback: Option<bool>,
}

/// The route of the simulator's default configuration whose answers are held to the JSON
/// contract (`model: "json"`).
pub(crate) const JSON_ROUTE: &str = "json";

/// `[[route]]`: a model name clients ask for, served by targets in preference order.
#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct RouteConfig {
    pub model: String,
    /// `provider/model`, or a one-model provider's id.
    pub targets: Vec<String>,
    /// Answers on this route are held to this contract (`{}`: the JSON contract).
    #[serde(default)]
    pub contract: Option<crate::core::contract::ContractSpec>,
    /// Stream deadlines on this route (else `[streaming]`'s).
    #[serde(default)]
    pub first_token_ms: Option<u64>,
    #[serde(default)]
    pub idle_ms: Option<u64>,
    #[serde(default)]
    pub total_ms: Option<u64>,
}

/// `[streaming]`: deadlines of a streamed answer relayed live (each a failure of the target).
#[derive(Deserialize, Clone, Copy, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct Streaming {
    /// From the call to the upstream's first event.
    pub first_token_ms: u64,
    /// Between two events.
    pub idle_ms: u64,
    /// From the call to the last event.
    pub total_ms: u64,
    /// After the finish chunk, how long `[DONE]` is waited for before the stream is closed
    /// (complete) by oam.
    pub done_grace_ms: u64,
}

impl Default for Streaming {
    fn default() -> Self {
        Streaming {
            first_token_ms: 10_000,
            idle_ms: 5_000,
            total_ms: 300_000,
            done_grace_ms: 1_000,
        }
    }
}

/// One model on one provider, resolved from the configuration: what is routed to.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Target {
    /// `{provider}/{model}`, or the provider's id when it has one model.
    pub id: String,
    pub provider: String,
    pub model: String,
    pub cost_per_1k_tokens_usd: f64,
    pub output_cost_per_1k_usd: Option<f64>,
    pub cached_input_cost_per_1k_usd: Option<f64>,
    pub cache_write_cost_per_1k_usd: Option<f64>,
    pub reasoning_cost_per_1k_usd: Option<f64>,
    pub context_window: Option<u64>,
    pub prefill: bool,
    pub fallback: bool,
    pub api: crate::core::request::Api,
    pub embeddings: bool,
    pub cost_per_call_usd: f64,
    /// Priced from the price table (its configuration named no price).
    pub table_priced: bool,
}

impl Target {
    /// This target at the price table's prices `l` (per 1,000,000 tokens there, per 1,000
    /// here).
    fn priced_as(self, l: &super::prices::Listed) -> Target {
        let k = |usd: f64| usd / 1_000.0;
        Target {
            cost_per_1k_tokens_usd: k(l.input),
            output_cost_per_1k_usd: Some(k(l.output)),
            cached_input_cost_per_1k_usd: l.cached_input.map(k),
            cache_write_cost_per_1k_usd: l.cache_write.map(k),
            reasoning_cost_per_1k_usd: l.reasoning.map(k),
            table_priced: true,
            ..self
        }
    }

    pub(crate) fn core(&self) -> crate::core::request::Target {
        crate::core::request::Target {
            id: self.id.as_str().into(),
            model: self.model.as_str().into(),
            cost_per_1k_tokens_usd: self.cost_per_1k_tokens_usd,
            output_cost_per_1k_usd: self.output_cost_per_1k_usd,
            cached_input_cost_per_1k_usd: self.cached_input_cost_per_1k_usd,
            cache_write_cost_per_1k_usd: self.cache_write_cost_per_1k_usd,
            reasoning_cost_per_1k_usd: self.reasoning_cost_per_1k_usd,
            fallback: self.fallback,
            context_window: self.context_window,
            prefill: self.prefill,
            api: self.api,
            embeddings: self.embeddings,
            cost_per_call_usd: self.cost_per_call_usd,
        }
    }
}

/// An active health check of an idle provider.
#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Probe {
    /// Free while it answers: its model list (an agent: nothing, the mesh says when it dies);
    /// a completion of one token (billed) only to confirm that a target real calls found
    /// failing answers again, at most once per interval for the cluster.
    #[default]
    Auto,
    /// A short chat completion every interval, judged as traffic is (billed by a paid
    /// provider).
    Chat,
    /// `GET {base_url}/models` only: reachable and answering, at no token cost.
    Models,
    /// None: health comes from traffic alone.
    Off,
}

/// `[probes]`: what health probes may cost.
#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct Probes {
    /// What billed probes may cost the cluster per UTC day, in the ledger (none: no cap,
    /// still counted there). Past it a target gets its free check, and the node says
    /// PROBE_BUDGET_EXHAUSTED.
    #[serde(default)]
    pub max_usd_per_day: Option<f64>,
}

#[derive(Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    #[serde(default)]
    pub(crate) node: NodeSettings,
    #[serde(default, rename = "provider")]
    pub(crate) providers: Vec<ProviderConfig>,
    #[serde(default)]
    pub(crate) pipeline: PipelineConfig,
    #[serde(default)]
    pub(crate) budgets: Budgets,
    #[serde(default)]
    pub(crate) escalations: EscalationSinks,
    #[serde(default)]
    pub(crate) decision_log: super::decisionlog::LogSettings,
    /// OpenTelemetry export of every request's spans (off unless an endpoint is given).
    #[serde(default)]
    pub(crate) telemetry: super::otlp::Settings,
    #[serde(default)]
    pub(crate) probes: Probes,
    #[serde(default, rename = "route")]
    pub(crate) routes: Vec<RouteConfig>,
    #[serde(default)]
    pub(crate) streaming: Streaming,
    #[serde(default, rename = "client")]
    pub(crate) clients: Vec<ClientConfig>,
    /// Requests and tokens per minute per agent (a client's own are on its `[[client]]`).
    #[serde(default)]
    pub(crate) rate_limits: std::collections::BTreeMap<String, crate::core::rates::Limit>,
    /// Model Context Protocol servers whose tools the node's `/mcp` door serves, each call
    /// judged as a model call is (they join `providers`, speaking `mcp`, at `parse`).
    #[serde(default, rename = "mcp_server")]
    pub(crate) mcp_servers: Vec<McpServerConfig>,
    /// Every provider's models, resolved (filled in by `parse`).
    #[serde(skip)]
    pub(crate) targets: Vec<Target>,
    /// Every client's key, read from its variable (filled in by `parse`).
    #[serde(skip)]
    pub(crate) client_keys: Vec<(String, Secret)>,
}

/// The simulator's tool server's id in the default configuration.
pub(crate) const SIM_TOOLS: &str = "tools";

/// `[[mcp_server]]`: a Model Context Protocol server (streamable HTTP) whose tools the node
/// serves at `/mcp` as `{id}__{tool}`. It is a target of its own: its health and breaker are
/// the cluster's, its price per call is charged to budgets.
#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct McpServerConfig {
    pub id: String,
    /// Its endpoint, e.g. `http://127.0.0.1:8000/mcp` ...
    #[serde(default)]
    pub url: String,
    /// ... or, instead: its tools are the mesh's agents tagged `mcp` in the catalog, each called
    /// with the tool's arguments as its payload by the fail-fast caller.
    #[serde(default)]
    pub mesh: bool,
    /// The variable holding its key, sent as `Authorization: Bearer <key>`.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// What each call costs (0: free).
    #[serde(default)]
    pub cost_per_call_usd: f64,
    #[serde(default)]
    pub probe: Probe,
    /// How long its tool list is served before it is asked again (and each definition checked
    /// against its pin), in seconds.
    #[serde(default = "thirty")]
    pub refresh_s: u64,
    /// What a changed tool definition does besides being refused: nothing more (`refuse`), or
    /// an escalation for a human (`escalate`), once per new definition per node.
    #[serde(default)]
    pub on_definition_change: OnDefinitionChange,
    /// Tool definitions pinned here, by tool name: the 16 hex digits of the hash `/mcp` lists as
    /// the tool's `_meta.oam.definition_hash`. Unpinned tools are pinned when first seen.
    #[serde(default)]
    pub pins: std::collections::BTreeMap<String, String>,
}

impl McpServerConfig {
    /// The configured pins as hashes (checked at load: 16 hex digits each).
    pub(crate) fn pinned(&self) -> std::collections::BTreeMap<String, u64> {
        self.pins
            .iter()
            .filter_map(|(tool, hex)| Some((tool.clone(), u64::from_str_radix(hex, 16).ok()?)))
            .collect()
    }
}

/// `[[mcp_server]] on_definition_change`.
#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub(crate) enum OnDefinitionChange {
    #[default]
    Refuse,
    Escalate,
}

fn thirty() -> u64 {
    30
}

impl McpServerConfig {
    /// The provider it is to the pipeline: one target named by its id, speaking `mcp`.
    fn provider(&self) -> ProviderConfig {
        ProviderConfig {
            id: self.id.clone(),
            base_url: self.url.clone(),
            api: crate::core::request::Api::Mcp,
            model: self.id.clone(),
            api_key_env: self.api_key_env.clone(),
            cost_per_call_usd: self.cost_per_call_usd,
            probe: self.probe,
            mesh_tools: self.mesh,
            ..ProviderConfig::blank()
        }
    }
}

/// `[[client]]`: a caller of the gateway with a key of its own. With none configured the
/// gateway serves anyone (who names itself, if at all, with `oam.agent`); with any, a request
/// without one of their keys is refused (401), and an authenticated request's agent is its
/// client's id, whatever the request says: budgets and loop counts are then per caller, and no
/// caller can spend another's budget or hide in another's loop count.
#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClientConfig {
    pub id: String,
    /// The environment variable holding its key (never the key itself in the file).
    pub key_env: String,
    /// Requests and tokens per minute, across the cluster.
    #[serde(default)]
    pub rpm: Option<u64>,
    #[serde(default)]
    pub tpm: Option<u64>,
    /// The tools at `/mcp` it may list and call, as `{server}__{tool}` names where `*` stands
    /// for any run of characters and `?` for one (`tickets__*`). None: every tool; empty: none.
    #[serde(default)]
    pub tools: Option<Vec<String>>,
    /// The team it belongs to: the team's budget (`[budgets.teams.NAME]`, `oam budget set
    /// team:NAME`) covers every request it makes, beside its own.
    #[serde(default)]
    pub team: Option<String>,
}

/// The tools a client may use (`[[client]] tools`), and the revision of that list, which each
/// tool call's record carries.
pub(crate) struct Allowlist<'a> {
    pub patterns: &'a [String],
    pub revision: String,
}

impl Allowlist<'_> {
    pub(crate) fn allows(&self, tool: &str) -> bool {
        self.patterns.iter().any(|p| glob_matches(p, tool))
    }
}

/// Does `name` match `pattern`, where `*` is any run of characters and `?` any one?
pub(crate) fn glob_matches(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut i, mut j) = (0, 0);
    // Where the last `*` was, and the name position it stands up to so far.
    let mut star: Option<(usize, usize)> = None;
    while j < n.len() {
        if i < p.len() && (p[i] == '?' || p[i] == n[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some((i, j));
            i += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

/// A key: compared in constant time, never printed.
#[derive(Clone, PartialEq)]
pub(crate) struct Secret(String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    pub(crate) fn of(key: &str) -> Secret {
        Secret(key.to_string())
    }

    /// Is `presented` this key? Takes as long whatever it is (for a presented key of the
    /// same length): a wrong key's timing tells nothing of the right one.
    pub(crate) fn matches(&self, presented: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), presented.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

/// Keys shorter than this are refused: a key is a password that scripts send.
pub(crate) const MIN_KEY_CHARS: usize = 16;

impl NodeConfig {
    /// The client whose key is `presented`, if any (every key is compared).
    /// The tools client `id` may use; none when it is held to no list.
    pub(crate) fn tool_allowlist(&self, id: &str) -> Option<Allowlist<'_>> {
        let patterns = self.clients.iter().find(|c| c.id == id)?.tools.as_deref()?;
        let hash = xxhash_rust::xxh3::xxh3_64(patterns.join("\n").as_bytes());
        Some(Allowlist {
            patterns,
            revision: format!("{hash:016x}"),
        })
    }

    /// The team of client `id`, if it has one.
    pub(crate) fn team_of(&self, id: &str) -> Option<&str> {
        self.clients.iter().find(|c| c.id == id)?.team.as_deref()
    }

    pub(crate) fn client_with_key(&self, presented: &str) -> Option<&str> {
        let mut found = None;
        for (id, key) in &self.client_keys {
            if key.matches(presented) {
                found = Some(id.as_str());
            }
        }
        found
    }
}

/// Where escalations go besides the record (`[escalations]`): a webhook that gets each one as
/// JSON (`{"node", "escalation"}`), retried with backoff until it answers 2xx; and a command
/// (a pager's CLI, a script) that gets the same JSON on its standard input, retried until it
/// exits 0.
#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct EscalationSinks {
    pub webhook_url: Option<String>,
    /// Attempts per escalation at most (backoff 250 ms, doubling, at most 5 s apart).
    pub webhook_attempts: u32,
    pub webhook_timeout_ms: u64,
    /// The program and its arguments (run directly, no shell).
    pub command: Option<Vec<String>>,
    /// Attempts per escalation at most (the same backoff); each is killed after the timeout.
    pub command_attempts: u32,
    pub command_timeout_ms: u64,
}

impl Default for EscalationSinks {
    fn default() -> Self {
        EscalationSinks {
            webhook_url: None,
            webhook_attempts: 5,
            webhook_timeout_ms: 2_000,
            command: None,
            command_attempts: 3,
            command_timeout_ms: 5_000,
        }
    }
}

/// The simulator's providers at `sim_url`, in the core's default preference order.
pub(crate) fn default_providers(sim_url: &str) -> Vec<ProviderConfig> {
    let sim_url = sim_url.trim_end_matches('/');
    crate::core::pipeline::default_providers()
        .into_iter()
        .map(|p| ProviderConfig {
            base_url: format!("{sim_url}/{}/v1", p.id),
            agent: None,
            api: Default::default(),
            embeddings: false,
            id: p.id.to_string(),
            model: p.model.to_string(),
            models: Vec::new(),
            api_key_env: None,
            cost_per_1k_tokens_usd: Some(p.cost_per_1k_tokens_usd),
            output_cost_per_1k_usd: None,
            cached_input_cost_per_1k_usd: None,
            cache_write_cost_per_1k_usd: None,
            reasoning_cost_per_1k_usd: None,
            cost_per_call_usd: 0.0,
            context_window: None,
            // The simulator takes any message list: its zero-cost model stands in for a local
            // model that continues an interrupted stream (it answers afresh, as a sim does).
            prefill: p.fallback,
            fallback: p.fallback,
            probe: Probe::Auto,
            mesh_tools: false,
        })
        .chain(std::iter::once(ProviderConfig {
            // The simulator's embedding model, on its zero-cost local provider.
            id: "embed".into(),
            base_url: format!("{sim_url}/local/v1"),
            model: "sim-embed".into(),
            embeddings: true,
            probe: Probe::Models,
            ..ProviderConfig::blank()
        }))
        .collect()
}

impl ProviderConfig {
    /// A provider with every attribute at its default (filled in by the caller).
    fn blank() -> ProviderConfig {
        ProviderConfig {
            id: String::new(),
            base_url: String::new(),
            api: Default::default(),
            embeddings: false,
            agent: None,
            model: String::new(),
            models: Vec::new(),
            api_key_env: None,
            cost_per_1k_tokens_usd: None,
            output_cost_per_1k_usd: None,
            cached_input_cost_per_1k_usd: None,
            cache_write_cost_per_1k_usd: None,
            reasoning_cost_per_1k_usd: None,
            cost_per_call_usd: 0.0,
            context_window: None,
            prefill: false,
            fallback: false,
            probe: Probe::Auto,
            mesh_tools: false,
        }
    }
}

/// `kind`'s limits sized for `m`, with what the file `set` laid over them.
fn sized_unless_set(
    kind: Kind,
    m: crate::core::bulkhead::Machine,
    set: Option<&toml::Value>,
) -> Result<BulkheadConfig, ConfigError> {
    let sized = BulkheadConfig::sized(kind, m);
    let Some(set) = set else {
        return Ok(sized);
    };
    fn lay(base: &mut toml::Value, over: &toml::Value) {
        match (base, over) {
            (toml::Value::Table(b), toml::Value::Table(o)) => {
                for (k, v) in o {
                    match b.get_mut(k) {
                        Some(slot) => lay(slot, v),
                        None => {
                            b.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
            (b, o) => *b = o.clone(),
        }
    }
    let mut v = toml::Value::try_from(sized).map_err(|e| ConfigError::Syntax(e.to_string()))?;
    lay(&mut v, set);
    v.try_into().map_err(|e: toml::de::Error| {
        ConfigError::Invalid(format!(
            "pipeline.{}bulkheads: {e}",
            if kind == Kind::Stream { "stream_" } else { "" }
        ))
    })
}

/// Why a config cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    /// Not TOML of the config's shape.
    #[error("{0}")]
    Syntax(String),
    /// A value the config cannot hold: where, and why.
    #[error("{0}")]
    Invalid(String),
    /// The error, in the file (or text) named, at the line it is about where that is known.
    #[error("{file}{}: {error}", line.map(|l| format!(":{l}")).unwrap_or_default())]
    In {
        file: String,
        line: Option<usize>,
        error: Box<ConfigError>,
    },
}

impl ConfigError {
    /// The line of `text` (from 1) this error is about: where TOML stopped reading, or the
    /// table an invalid value is in (`provider[1] (...)`: the second `[[provider]]`).
    fn line_in(&self, text: &str) -> Option<usize> {
        let line_at = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
        match self {
            ConfigError::Syntax(_) => {
                let e = toml::from_str::<NodeConfig>(text).err()?;
                e.span().map(|s| line_at(s.start))
            }
            ConfigError::Invalid(why) => {
                let headers = |table: &str| {
                    let header = format!("[[{table}]]");
                    text.lines()
                        .enumerate()
                        .filter(move |(_, l)| l.trim_start().starts_with(&header))
                        .map(|(n, _)| n + 1)
                };
                for table in ["provider", "route", "client"] {
                    let Some(rest) = why.strip_prefix(&format!("{table}[")) else {
                        continue;
                    };
                    let i: usize = rest.split(']').next()?.parse().ok()?;
                    return headers(table).nth(i);
                }
                // `mcp_server (id)`: the line naming its id, after a `[[mcp_server]]`.
                let id = why.strip_prefix("mcp_server (")?.split(')').next()?;
                let start = headers("mcp_server").next()?;
                let named = [format!("id = \"{id}\""), format!("id=\"{id}\"")];
                text.lines()
                    .enumerate()
                    .skip(start)
                    .find(|(_, l)| named.iter().any(|n| l.trim() == n.as_str()))
                    .map(|(n, _)| n + 1)
            }
            ConfigError::Read { .. } | ConfigError::In { .. } => None,
        }
    }
}

/// The configuration file to use: `flag` when given, else `$OAM_CONFIG`, else `oam.toml` in
/// the current folder when there is one; with how it was found (for the user to be told).
pub(crate) fn discover(
    flag: Option<std::path::PathBuf>,
) -> Option<(std::path::PathBuf, &'static str)> {
    if let Some(p) = flag {
        return Some((p, "--config"));
    }
    if let Some(p) = std::env::var_os("OAM_CONFIG").filter(|v| !v.is_empty()) {
        return Some((p.into(), "$OAM_CONFIG"));
    }
    let here = std::path::PathBuf::from("oam.toml");
    here.is_file().then_some((here, "the current folder"))
}

impl NodeConfig {
    /// Parse `text` (from `name`), fill in the simulator's providers if none are listed, and
    /// check what serde cannot.
    pub(crate) fn parse(name: &str, text: &str, sim_url: &str) -> Result<NodeConfig, ConfigError> {
        NodeConfig::parse_text(text, sim_url).map_err(|e| ConfigError::In {
            file: name.to_string(),
            line: e.line_in(text),
            error: Box::new(e),
        })
    }

    fn parse_text(text: &str, sim_url: &str) -> Result<NodeConfig, ConfigError> {
        let mut cfg: NodeConfig =
            toml::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        cfg.size_for_machine(
            text,
            super::limits::cores(),
            super::limits::soft_open_files(),
        )?;
        if cfg.providers.is_empty() {
            cfg.providers = default_providers(sim_url);
            // The simulator's tool server, unless the file names tool servers of its own.
            if cfg.mcp_servers.is_empty() {
                cfg.mcp_servers.push(McpServerConfig {
                    id: SIM_TOOLS.into(),
                    url: format!("{}/mcp", sim_url.trim_end_matches('/')),
                    mesh: false,
                    api_key_env: None,
                    cost_per_call_usd: 0.0,
                    probe: Probe::Auto,
                    refresh_s: thirty(),
                    on_definition_change: OnDefinitionChange::Refuse,
                    pins: Default::default(),
                });
            }
            // The simulator's models answer in oam's JSON contract: the route `json` holds them
            // to it (and so checks a stream whole before releasing it); every other model
            // streams live. They answer within ~200 ms, so a stream silent for a second is broken.
            if !cfg.routes.iter().any(|r| r.model == JSON_ROUTE) {
                cfg.routes.push(RouteConfig {
                    model: JSON_ROUTE.into(),
                    targets: ["primary", "secondary", "local"].map(String::from).into(),
                    contract: Some(Default::default()),
                    first_token_ms: None,
                    idle_ms: None,
                    total_ms: None,
                });
            }
            if cfg.streaming == Streaming::default() {
                cfg.streaming = Streaming {
                    first_token_ms: 2_000,
                    idle_ms: 1_000,
                    ..Streaming::default()
                };
            }
        }
        let servers: Vec<ProviderConfig> = cfg
            .mcp_servers
            .iter()
            .map(McpServerConfig::provider)
            .collect();
        cfg.providers.extend(servers);
        for m in &cfg.mcp_servers {
            if let Some((tool, hex)) = m
                .pins
                .iter()
                .find(|(_, h)| h.len() != 16 || u64::from_str_radix(h, 16).is_err())
            {
                return Err(ConfigError::Invalid(format!(
                    "mcp_server ({}): pins: {tool} = {hex:?} is no definition hash (16 hex \
                     digits, as tools/list gives it in _meta.oam.definition_hash)",
                    m.id
                )));
            }
        }
        cfg.check()?;
        cfg.client_keys = cfg.read_client_keys()?;
        cfg.targets = cfg.resolve_targets();
        cfg.check_routes()?;
        cfg.check_rate_limits()?;
        cfg.telemetry
            .export(|k| std::env::var(k).ok())
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        Ok(cfg)
    }

    /// What `text` leaves unset of the connection limit and both kinds' bulkheads, sized for
    /// a machine of `cores` and `open_files` descriptors: a field the file sets is kept.
    fn size_for_machine(
        &mut self,
        text: &str,
        cores: u32,
        open_files: u64,
    ) -> Result<(), ConfigError> {
        let raw: toml::Table =
            toml::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        let node = raw.get("node").and_then(toml::Value::as_table);
        if !node.is_some_and(|n| n.contains_key("max_connections")) {
            self.node.max_connections = super::limits::connections_for(open_files);
        }
        if !node.is_some_and(|n| n.contains_key("lanes")) {
            self.node.lanes = cores as usize;
        }
        let m = super::limits::sizing(cores, self.node.max_connections);
        let pipeline = raw.get("pipeline").and_then(toml::Value::as_table);
        let set = |key: &str| pipeline.and_then(|p| p.get(key));
        self.pipeline.bulkheads = sized_unless_set(Kind::Short, m, set("bulkheads"))?;
        self.pipeline.stream_bulkheads =
            sized_unless_set(Kind::Stream, m, set("stream_bulkheads"))?;
        Ok(())
    }

    pub fn load(path: Option<&Path>, sim_url: &str) -> Result<NodeConfig, ConfigError> {
        match path {
            None => NodeConfig::parse("the default config", "", sim_url),
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.to_path_buf(),
                    source,
                })?;
                NodeConfig::parse(&p.display().to_string(), &text, sim_url)
            }
        }
    }

    /// Every `[[client]]`'s key, from its variable: each id and each key once, no key short.
    fn read_client_keys(&self) -> Result<Vec<(String, Secret)>, ConfigError> {
        let mut out: Vec<(String, Secret)> = Vec::new();
        for (i, c) in self.clients.iter().enumerate() {
            let at = format!("client[{i}] ({:?})", c.id);
            if c.id.trim().is_empty() || c.id.chars().any(char::is_whitespace) {
                return Err(ConfigError::Invalid(format!(
                    "{at}: id must be a name without spaces"
                )));
            }
            if out.iter().any(|(id, _)| *id == c.id) {
                return Err(ConfigError::Invalid(format!("{at}: id is listed twice")));
            }
            let odd = c.tools.iter().flatten().find(|t| {
                t.is_empty()
                    || !t
                        .chars()
                        .all(|ch| ch.is_ascii_alphanumeric() || "_-.*?".contains(ch))
            });
            if let Some(t) = odd {
                return Err(ConfigError::Invalid(format!(
                    "{at}: tools: {t:?} is no tool name pattern (letters, digits, '_', '-', '.', \
                     and the wildcards '*' and '?', e.g. \"tickets__*\")"
                )));
            }
            let key = std::env::var(&c.key_env).map_err(|_| {
                ConfigError::Invalid(format!(
                    "{at}: key_env names {}, which is not set in this environment",
                    c.key_env
                ))
            })?;
            if key.chars().count() < MIN_KEY_CHARS {
                return Err(ConfigError::Invalid(format!(
                    "{at}: the key in {} is shorter than {MIN_KEY_CHARS} characters",
                    c.key_env
                )));
            }
            let key = Secret(key);
            if let Some((other, _)) = out.iter().find(|(_, k)| *k == key) {
                return Err(ConfigError::Invalid(format!(
                    "{at}: has the same key as client {other:?}"
                )));
            }
            out.push((c.id.clone(), key));
        }
        Ok(out)
    }

    /// Every provider's models as targets, in the providers' order.
    fn resolve_targets(&self) -> Vec<Target> {
        let mut out = Vec::new();
        for p in &self.providers {
            let base = Target {
                id: p.id.clone(),
                provider: p.id.clone(),
                model: p.model.clone(),
                cost_per_1k_tokens_usd: p.cost_per_1k_tokens_usd.unwrap_or(0.0),
                output_cost_per_1k_usd: p.output_cost_per_1k_usd,
                cached_input_cost_per_1k_usd: p.cached_input_cost_per_1k_usd,
                cache_write_cost_per_1k_usd: p.cache_write_cost_per_1k_usd,
                reasoning_cost_per_1k_usd: p.reasoning_cost_per_1k_usd,
                context_window: p.context_window,
                // Messages continues a trailing assistant turn by design.
                prefill: p.prefill || p.api == crate::core::request::Api::Anthropic,
                fallback: p.fallback,
                api: p.api,
                embeddings: p.embeddings,
                cost_per_call_usd: p.cost_per_call_usd,
                table_priced: false,
            };
            let provider_priced = p.cost_per_call_usd > 0.0
                || [
                    p.cost_per_1k_tokens_usd,
                    p.output_cost_per_1k_usd,
                    p.cached_input_cost_per_1k_usd,
                    p.cache_write_cost_per_1k_usd,
                    p.reasoning_cost_per_1k_usd,
                ]
                .iter()
                .any(Option::is_some);
            // Only models called over HTTP have list prices: an agent or a tool server costs
            // what its configuration says.
            let listed = p.agent.is_none() && p.api != crate::core::request::Api::Mcp;
            let price = |t: Target, model_priced: bool| {
                if provider_priced || model_priced || !listed {
                    return t;
                }
                match super::prices::table().lookup(&t.model) {
                    Some(l) => t.priced_as(l),
                    None => t,
                }
            };
            if p.models.is_empty() {
                out.push(price(base, false));
                continue;
            }
            for m in &p.models {
                let model_priced = match m {
                    ModelEntry::Name(_) => false,
                    ModelEntry::Full(m) => [
                        m.cost_per_1k_tokens_usd,
                        m.output_cost_per_1k_usd,
                        m.cached_input_cost_per_1k_usd,
                        m.cache_write_cost_per_1k_usd,
                        m.reasoning_cost_per_1k_usd,
                    ]
                    .iter()
                    .any(Option::is_some),
                };
                let t = match m {
                    ModelEntry::Name(name) => Target {
                        model: name.clone(),
                        ..base.clone()
                    },
                    ModelEntry::Full(m) => Target {
                        model: m.name.clone(),
                        cost_per_1k_tokens_usd: m
                            .cost_per_1k_tokens_usd
                            .unwrap_or(base.cost_per_1k_tokens_usd),
                        output_cost_per_1k_usd: m
                            .output_cost_per_1k_usd
                            .or(base.output_cost_per_1k_usd),
                        cached_input_cost_per_1k_usd: m
                            .cached_input_cost_per_1k_usd
                            .or(base.cached_input_cost_per_1k_usd),
                        cache_write_cost_per_1k_usd: m
                            .cache_write_cost_per_1k_usd
                            .or(base.cache_write_cost_per_1k_usd),
                        reasoning_cost_per_1k_usd: m
                            .reasoning_cost_per_1k_usd
                            .or(base.reasoning_cost_per_1k_usd),
                        context_window: m.context_window.or(base.context_window),
                        prefill: m.prefill.unwrap_or(base.prefill),
                        fallback: m.fallback.unwrap_or(base.fallback),
                        ..base.clone()
                    },
                };
                let t = Target {
                    id: format!("{}/{}", p.id, t.model),
                    ..t
                };
                out.push(price(t, model_priced));
            }
        }
        out
    }

    /// The rate limit on `agent`: its client's, else `[rate_limits.{agent}]`'s; none when
    /// neither limits anything.
    pub(crate) fn rate_limit(&self, agent: &str) -> Option<crate::core::rates::Limit> {
        let limit = match self.clients.iter().find(|c| c.id == agent) {
            Some(c) => crate::core::rates::Limit {
                rpm: c.rpm,
                tpm: c.tpm,
            },
            None => self.rate_limits.get(agent).copied()?,
        };
        (limit.rpm.is_some() || limit.tpm.is_some()).then_some(limit)
    }

    /// What in this configuration is valid but likely not meant, for the node to say at start:
    /// budgets set while a target has no price (its calls cost $0 and never count against
    /// them). A fallback marked as such is free on purpose and not named.
    pub(crate) fn warnings(&self) -> Vec<String> {
        let budgeted = !self.budgets.is_empty();
        if !budgeted {
            return Vec::new();
        }
        self.targets
            .iter()
            .filter(|t| !t.fallback && t.core().is_zero_cost())
            .map(|t| {
                let price = if t.api == crate::core::request::Api::Mcp {
                    "cost_per_call_usd"
                } else {
                    "cost_per_1k_tokens_usd"
                };
                format!(
                    "budgets are set, but target {} has no price ({price}): its calls cost $0 \
                     and never count against a budget; give it its price, or `fallback = true` \
                     if it is free on purpose",
                    t.id
                )
            })
            .collect()
    }

    /// Does any target speak Anthropic's Messages API (so some requests must be kept from it)?
    pub(crate) fn speaks_anthropic(&self) -> bool {
        self.targets
            .iter()
            .any(|t| t.api == crate::core::request::Api::Anthropic)
    }

    /// The target a route names: `provider/model`, or a one-model provider's id.
    pub(crate) fn target(&self, name: &str) -> Option<&Target> {
        self.targets.iter().find(|t| {
            t.id == name || name.split_once('/') == Some((t.provider.as_str(), t.model.as_str()))
        })
    }

    /// The route serving `model`, if one does.
    pub(crate) fn route(&self, model: &str) -> Option<&RouteConfig> {
        self.routes.iter().find(|r| r.model == model)
    }

    /// The stream deadlines for a request for `model`: its route's, else `[streaming]`'s.
    pub(crate) fn deadlines(&self, model: Option<&str>) -> Streaming {
        let d = self.streaming;
        match model.and_then(|m| self.route(m)) {
            Some(r) => Streaming {
                first_token_ms: r.first_token_ms.unwrap_or(d.first_token_ms),
                idle_ms: r.idle_ms.unwrap_or(d.idle_ms),
                total_ms: r.total_ms.unwrap_or(d.total_ms),
                ..d
            },
            None => d,
        }
    }

    fn check_rate_limits(&self) -> Result<(), ConfigError> {
        let limits = self
            .clients
            .iter()
            .map(|c| (format!("client {:?}", c.id), c.rpm, c.tpm))
            .chain(
                self.rate_limits
                    .iter()
                    .map(|(a, l)| (format!("rate_limits.{a}"), l.rpm, l.tpm)),
            );
        for (at, rpm, tpm) in limits {
            if rpm == Some(0) || tpm == Some(0) {
                return Err(ConfigError::Invalid(format!(
                    "{at}: rpm and tpm must be at least 1 (leave one out for no limit)"
                )));
            }
        }
        Ok(())
    }

    fn check_routes(&self) -> Result<(), ConfigError> {
        let mut seen = std::collections::BTreeSet::new();
        for (i, r) in self.routes.iter().enumerate() {
            let at = format!("route[{i}] ({})", r.model);
            if r.model.trim().is_empty() || matches!(r.model.as_str(), "auto" | "oam") {
                return Err(ConfigError::Invalid(format!(
                    "{at}: model must be a name clients ask for (not empty, \"auto\" or \"oam\")"
                )));
            }
            if !seen.insert(&r.model) {
                return Err(ConfigError::Invalid(format!("{at}: model is routed twice")));
            }
            if r.targets.is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "{at}: targets must name at least one provider/model"
                )));
            }
            for t in &r.targets {
                if self.target(t).is_none() {
                    let known: Vec<String> = self
                        .targets
                        .iter()
                        .map(|t| format!("{}/{}", t.provider, t.model))
                        .collect();
                    return Err(ConfigError::Invalid(format!(
                        "{at}: target {t:?} is no provider's model; targets are {}",
                        known.join(", ")
                    )));
                }
            }
            let kinds: std::collections::BTreeSet<bool> = r
                .targets
                .iter()
                .filter_map(|t| self.target(t).map(|t| t.embeddings))
                .collect();
            if kinds.len() > 1 {
                return Err(ConfigError::Invalid(format!(
                    "{at}: mixes embedding targets with chat targets; a route serves one or the other"
                )));
            }
            if let Some(spec) = &r.contract {
                crate::core::contract::Contract::for_request(Some(spec), None)
                    .map_err(|e| ConfigError::Invalid(format!("{at}: {e}")))?;
            }
        }
        let s = &self.streaming;
        let deadlines = self
            .routes
            .iter()
            .flat_map(|r| [r.first_token_ms, r.idle_ms, r.total_ms]);
        if [s.first_token_ms, s.idle_ms, s.total_ms]
            .into_iter()
            .chain(deadlines.flatten())
            .any(|v| v == 0)
        {
            return Err(ConfigError::Invalid(
                "stream deadlines (first_token_ms, idle_ms, total_ms) must be more than 0".into(),
            ));
        }
        if let Some(spec) = &self.pipeline.default_contract {
            crate::core::contract::Contract::for_request(Some(spec), None)
                .map_err(|e| ConfigError::Invalid(format!("pipeline.default_contract: {e}")))?;
        }
        Ok(())
    }

    /// The model routes as the core keeps them (target ids resolved).
    pub(crate) fn core_routes(
        &self,
    ) -> std::collections::BTreeMap<String, crate::core::pipeline::Route> {
        self.routes
            .iter()
            .map(|r| {
                let targets = r
                    .targets
                    .iter()
                    .filter_map(|t| self.target(t))
                    .map(|t| t.id.as_str().into())
                    .collect();
                let route = crate::core::pipeline::Route {
                    targets,
                    contract: r.contract.clone(),
                };
                (r.model.clone(), route)
            })
            .collect()
    }

    fn check(&self) -> Result<(), ConfigError> {
        if self
            .probes
            .max_usd_per_day
            .is_some_and(|c| !(c.is_finite() && c >= 0.0))
        {
            return Err(ConfigError::Invalid(
                "probes.max_usd_per_day must be a number >= 0 (0: no billed probes)".into(),
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, p) in self.providers.iter().enumerate() {
            let at = match p.api {
                crate::core::request::Api::Mcp => format!("mcp_server ({})", p.id),
                _ => format!("provider[{i}] ({})", p.id),
            };
            if !crate::transport::subjects::valid_token(&p.id) {
                return Err(ConfigError::Invalid(format!(
                    "{at}: id must be letters, digits, '-' or '_'"
                )));
            }
            if !seen.insert(&p.id) {
                return Err(ConfigError::Invalid(format!("{at}: id is listed twice")));
            }
            if p.api == crate::core::request::Api::Mcp && p.id.contains(super::catalog::SEPARATOR) {
                return Err(ConfigError::Invalid(format!(
                    "{at}: id must not hold \"__\", which joins it to its tools' names"
                )));
            }
            match &p.agent {
                Some(_) if p.embeddings => {
                    return Err(ConfigError::Invalid(format!(
                        "{at}: an agent answers chat requests; embeddings = true needs a base_url"
                    )));
                }
                Some(agent) => {
                    if !p.api.is_openai() {
                        return Err(ConfigError::Invalid(format!(
                            "{at}: an agent answers chat requests; api = \"anthropic\" needs a \
                             base_url"
                        )));
                    }
                    if !crate::mesh::protocol::valid_agent_name(agent) || !p.base_url.is_empty() {
                        return Err(ConfigError::Invalid(format!(
                            "{at}: agent must be a valid agent name, and a provider has either \
                             an agent or a base_url, not both"
                        )));
                    }
                    if p.probe == Probe::Models {
                        return Err(ConfigError::Invalid(format!(
                            "{at}: probe = \"models\" needs a base_url (an agent has no model \
                             list); use \"chat\" or \"off\""
                        )));
                    }
                }
                None if p.mesh_tools => {
                    if !p.base_url.is_empty() {
                        return Err(ConfigError::Invalid(format!(
                            "{at}: its tools are either the mesh's agents (mesh = true) or a \
                             server's at url, not both"
                        )));
                    }
                }
                None => {
                    if !(p.base_url.starts_with("http://") || p.base_url.starts_with("https://")) {
                        return Err(ConfigError::Invalid(format!(
                            "{at}: base_url must start with http:// or https://"
                        )));
                    }
                    if let Err(e) = reqwest::Url::parse(&p.base_url) {
                        return Err(ConfigError::Invalid(format!(
                            "{at}: base_url {:?} is no URL: {e}",
                            p.base_url
                        )));
                    }
                }
            }
            if p.embeddings && !p.api.is_openai() {
                return Err(ConfigError::Invalid(format!(
                    "{at}: Anthropic's API serves no embeddings; embeddings = true needs api = \"openai\""
                )));
            }
            if p.model.is_empty() == p.models.is_empty() {
                let which = if p.model.is_empty() {
                    "it names none"
                } else {
                    "not both"
                };
                return Err(ConfigError::Invalid(format!(
                    "{at}: give its one model (model = \"...\") or its models (models = [...]), \
                     {which}"
                )));
            }
            let mut names = std::collections::BTreeSet::new();
            for m in &p.models {
                let (name, costs) = match m {
                    ModelEntry::Name(n) => (n, [None; 5]),
                    ModelEntry::Full(m) => (
                        &m.name,
                        [
                            m.cost_per_1k_tokens_usd,
                            m.output_cost_per_1k_usd,
                            m.cached_input_cost_per_1k_usd,
                            m.cache_write_cost_per_1k_usd,
                            m.reasoning_cost_per_1k_usd,
                        ],
                    ),
                };
                if name.trim().is_empty() || !names.insert(name) {
                    return Err(ConfigError::Invalid(format!(
                        "{at}: models: {name:?} is empty or listed twice"
                    )));
                }
                if costs
                    .into_iter()
                    .flatten()
                    .any(|c| !(c.is_finite() && c >= 0.0))
                {
                    return Err(ConfigError::Invalid(format!(
                        "{at}: models: {name}: costs must be >= 0"
                    )));
                }
            }
            let costs = [
                Some(p.cost_per_call_usd),
                p.cost_per_1k_tokens_usd,
                p.output_cost_per_1k_usd,
                p.cached_input_cost_per_1k_usd,
                p.cache_write_cost_per_1k_usd,
                p.reasoning_cost_per_1k_usd,
            ];
            if costs
                .into_iter()
                .flatten()
                .any(|c| !(c.is_finite() && c >= 0.0))
            {
                return Err(ConfigError::Invalid(format!(
                    "{at}: cost_per_1k_tokens_usd and output_cost_per_1k_usd must be >= 0"
                )));
            }
            if let Some(var) = &p.api_key_env
                && std::env::var_os(var).is_none()
            {
                return Err(ConfigError::Invalid(format!(
                    "{at}: api_key_env names {var}, which is not set in this environment"
                )));
            }
        }
        let n = &self.node;
        if n.cluster_size == 0 {
            return Err(ConfigError::Invalid(
                "node.cluster_size must be at least 1".into(),
            ));
        }
        if n.max_connections == 0 {
            return Err(ConfigError::Invalid(
                "node.max_connections must be at least 1".into(),
            ));
        }
        if n.lanes > MAX_LANES {
            return Err(ConfigError::Invalid(format!(
                "node.lanes is {}; at most {MAX_LANES} (unset: one per core; 0: none)",
                n.lanes
            )));
        }
        if let Some(bad) = n
            .members
            .iter()
            .find(|m| !crate::transport::subjects::valid_token(m))
        {
            return Err(ConfigError::Invalid(format!(
                "node.members: {bad:?} is not a node id (letters, digits, '-' or '_')"
            )));
        }
        for (name, v) in [
            ("node.probe_interval_ms", n.probe_interval_ms),
            ("node.probe_timeout_ms", n.probe_timeout_ms),
            ("node.heartbeat_interval_ms", n.heartbeat_interval_ms),
            ("node.health_window_ms", n.health_window_ms),
            ("node.header_timeout_ms", n.header_timeout_ms),
            ("node.write_timeout_ms", n.write_timeout_ms),
            ("node.budget_lease_ms", n.budget_lease_ms),
            ("node.max_answer_bytes", n.max_answer_bytes as u64),
        ] {
            if v == 0 {
                return Err(ConfigError::Invalid(format!("{name} must be more than 0")));
            }
        }
        if self
            .escalations
            .command
            .as_ref()
            .is_some_and(|c| c.first().is_none_or(|p| p.trim().is_empty()))
        {
            return Err(ConfigError::Invalid(
                "escalations.command must name a program (e.g. [\"/usr/local/bin/page\", \"--team\", \"ai\"])"
                    .into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_over_unpriced_targets_are_warned_of() {
        let base = "[[provider]]\nid = \"paid\"\nbase_url = \"http://127.0.0.1:1/v1\"\n\
                    model = \"m\"\n";
        let cfg = NodeConfig::parse("t", base, "http://127.0.0.1:9999").unwrap();
        assert!(cfg.warnings().is_empty(), "no budgets, nothing to warn of");
        let budgeted = format!("{base}\n[budgets.global]\nlimit_usd = 5.0\n");
        let cfg = NodeConfig::parse("t", &budgeted, "http://127.0.0.1:9999").unwrap();
        let w = cfg.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("target paid has no price"), "{w:?}");
        let priced = budgeted.replace(
            "model = \"m\"",
            "model = \"m\"\ncost_per_1k_tokens_usd = 0.01",
        );
        let cfg = NodeConfig::parse("t", &priced, "http://127.0.0.1:9999").unwrap();
        assert!(cfg.warnings().is_empty());
    }

    #[test]
    fn tool_patterns_match_whole_names_with_wildcards() {
        assert!(glob_matches("tickets__*", "tickets__open"));
        assert!(glob_matches("*__read_?", "files__read_a"));
        assert!(glob_matches("calc__add", "calc__add"));
        assert!(glob_matches("*", "anything"));
        assert!(glob_matches("a*b*c", "a__b__b__c"));
        assert!(!glob_matches("calc__add", "calc__add_all"));
        assert!(!glob_matches("tickets__*", "ticketsx__open"));
        assert!(!glob_matches("*__read_?", "files__read_ab"));
        assert!(!glob_matches("a*b*c", "a__b__b__d"));
    }

    #[test]
    fn mcp_servers_are_tool_targets_and_clients_may_be_held_to_tools() {
        let text = "[[mcp_server]]\nid = \"calc\"\nurl = \"http://127.0.0.1:1/mcp\"\n\
             cost_per_call_usd = 0.002\n\n\
             [[client]]\nid = \"a\"\nkey_env = \"PATH\"\ntools = [\"calc__add\"]\n";
        let cfg = NodeConfig::parse("t", text, "http://127.0.0.1:9999").unwrap();
        let calc = cfg.targets.iter().find(|t| t.id == "calc").unwrap();
        assert_eq!(calc.api, crate::core::request::Api::Mcp);
        assert_eq!(calc.core().cost_of(1_000, 1_000), 0.002);
        let list = cfg.tool_allowlist("a").unwrap();
        assert!(list.allows("calc__add") && !list.allows("calc__sub"));
        assert_eq!(list.revision.len(), 16);
        assert!(cfg.tool_allowlist("nobody").is_none());
        let twice = text.replace("id = \"calc\"", "id = \"my__calc\"");
        let e = NodeConfig::parse("t", &twice, "http://127.0.0.1:9999").unwrap_err();
        assert!(e.to_string().contains("must not hold"), "{e}");
        let pins = text.replace(
            "cost_per_call_usd",
            "pins = { add = \"xyz\" }\ncost_per_call_usd",
        );
        let e = NodeConfig::parse("t", &pins, "http://127.0.0.1:9999").unwrap_err();
        assert!(e.to_string().contains("no definition hash"), "{e}");
        let bad = text.replace("calc__add", "calc add");
        let e = NodeConfig::parse("t", &bad, "http://127.0.0.1:9999").unwrap_err();
        assert!(e.to_string().contains("no tool name pattern"), "{e}");
    }

    #[test]
    fn the_default_needs_no_file_and_points_at_the_sim() {
        let cfg = NodeConfig::load(None, "http://127.0.0.1:9999/").unwrap();
        let ids: Vec<&str> = cfg.providers.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids, ["primary", "local", "secondary", "embed", "tools"]);
        assert_eq!(cfg.providers[4].base_url, "http://127.0.0.1:9999/mcp");
        assert_eq!(
            cfg.providers[0].base_url,
            "http://127.0.0.1:9999/primary/v1"
        );
        assert!(cfg.providers[1].fallback);
        // The simulator's embedding model, served only to embeddings requests.
        assert!(cfg.providers[3].embeddings && !cfg.providers[2].embeddings);
        assert_eq!(cfg.node.cluster_size, 3);
    }

    /// Keys come from the environment (`PATH` stands in: set wherever tests run, and long).
    #[test]
    fn clients_keys_are_read_checked_and_matched() {
        let path = std::env::var("PATH").unwrap();
        let cfg = NodeConfig::parse(
            "oam.toml",
            "[[client]]\nid = \"bot\"\nkey_env = \"PATH\"\n",
            "http://sim",
        )
        .unwrap();
        assert_eq!(cfg.client_with_key(&path), Some("bot"));
        assert_eq!(cfg.client_with_key(&format!("{path}x")), None);
        assert_eq!(cfg.client_with_key(""), None);
        assert!(
            !format!("{cfg:?}").contains(&path),
            "a key is never printed"
        );
        for (text, words) in [
            (
                "[[client]]\nid = \"bot\"\nkey_env = \"OAM_TEST_SURELY_UNSET\"\n",
                vec!["oam.toml", "client[0]", "OAM_TEST_SURELY_UNSET", "not set"],
            ),
            (
                "[[client]]\nid = \"a\"\nkey_env = \"PATH\"\n[[client]]\nid = \"b\"\nkey_env = \"PATH\"\n",
                vec!["client[1]", "same key", "\"a\""],
            ),
            (
                "[[client]]\nid = \"a\"\nkey_env = \"PATH\"\n[[client]]\nid = \"a\"\nkey_env = \"HOME\"\n",
                vec!["client[1]", "twice"],
            ),
            (
                "[[client]]\nid = \"a b\"\nkey_env = \"PATH\"\n",
                vec!["client[0]", "without spaces"],
            ),
            ("[[client]]\nid = \"a\"\n", vec!["oam.toml", "key_env"]),
        ] {
            let e = NodeConfig::parse("oam.toml", text, "http://sim")
                .unwrap_err()
                .to_string();
            for w in words {
                assert!(e.contains(w), "{e:?} should mention {w:?}");
            }
        }
    }

    #[test]
    fn a_full_file_parses() {
        let text = r#"
[node]
cluster_size = 5

[[provider]]
id = "openai"
base_url = "https://api.openai.com/v1"
model = "gpt-4o-mini"
cost_per_1k_tokens_usd = 0.0006

[[provider]]
id = "ollama"
base_url = "http://127.0.0.1:11434/v1"
model = "llama3.2"
fallback = true

[pipeline]
max_attempts = { low = 2, medium = 2, high = 1 }

[budgets.agents.support-bot]
limit_usd = 5.0

[budgets.teams.support]
limit_usd = 50.0
on_exceeded = "audit"

[budgets.tasks.nightly]
limit_usd = 1.0
on_exceeded = "escalate"
"#;
        let cfg = NodeConfig::parse("oam.toml", text, "unused").unwrap();
        assert_eq!(cfg.node.cluster_size, 5);
        assert_eq!(
            cfg.node.probe_interval_ms, 1_000,
            "unset fields keep defaults"
        );
        assert_eq!(cfg.providers.len(), 2);
        assert_eq!(cfg.pipeline.max_attempts.high, 1);
        assert_eq!(cfg.budgets.agents["support-bot"].limit_usd, 5.0);
        use crate::core::budget::OnExceeded;
        let team = cfg.budgets.teams["support"];
        assert_eq!(
            (team.limit_usd, team.on_exceeded),
            (50.0, OnExceeded::Audit)
        );
        assert_eq!(
            cfg.budgets.tasks["nightly"].on_exceeded,
            OnExceeded::Escalate
        );
        let bad = text.replace("\"audit\"", "\"warn\"");
        let e = NodeConfig::parse("oam.toml", &bad, "unused")
            .unwrap_err()
            .to_string();
        assert!(e.contains("on_exceeded") || e.contains("warn"), "{e}");
    }

    #[test]
    fn unset_limits_are_sized_for_the_machine_and_set_ones_kept() {
        use crate::core::bulkhead::{BulkheadConfig, ClassLimits, Kind};
        let sized = |text: &str, cores, files| {
            let mut cfg: NodeConfig = toml::from_str(text).unwrap();
            cfg.size_for_machine(text, cores, files).unwrap();
            cfg
        };
        // Nothing set: 2 cores and 20,000 open files.
        let cfg = sized("", 2, 20_000);
        assert_eq!(cfg.node.max_connections, 9_872);
        assert_eq!(cfg.node.lanes, 2, "a lane per core");
        assert_eq!(sized("[node]\nlanes = 0\n", 2, 20_000).node.lanes, 0);
        let m = crate::node::limits::sizing(2, 9_872);
        assert_eq!(
            cfg.pipeline.bulkheads,
            BulkheadConfig::sized(Kind::Short, m)
        );
        assert_eq!(
            cfg.pipeline.stream_bulkheads,
            BulkheadConfig::sized(Kind::Stream, m)
        );
        assert!(
            cfg.pipeline.stream_bulkheads.global_limit > 10 * cfg.pipeline.bulkheads.global_limit
        );
        // A field set is kept; the rest of its table is still sized, for the connections set.
        let text = "[node]\nmax_connections = 100\n[pipeline.stream_bulkheads]\nnormal = { concurrency = 5, queue = 1 }\n";
        let cfg = sized(text, 2, 20_000);
        assert_eq!(cfg.node.max_connections, 100);
        let small = BulkheadConfig::sized(Kind::Stream, crate::node::limits::sizing(2, 100));
        assert_eq!(
            cfg.pipeline.stream_bulkheads.normal,
            ClassLimits {
                concurrency: 5,
                queue: 1
            }
        );
        assert_eq!(cfg.pipeline.stream_bulkheads.critical, small.critical);
        // What serde refuses is refused with the field named.
        let bad = "[pipeline.bulkheads]\nnormal = { concurrency = 5, queu = 1 }\n";
        let e = NodeConfig::parse("oam.toml", bad, "http://sim").unwrap_err();
        assert!(
            matches!(&e, ConfigError::In { error, .. } if matches!(**error, ConfigError::Syntax(_)))
        );
        assert!(e.to_string().contains("queu"), "{e}");
    }

    #[test]
    fn providers_serve_many_models_and_routes_name_them() {
        let text = r#"
[[provider]]
id = "openai"
base_url = "https://api.openai.com/v1"
cost_per_1k_tokens_usd = 0.00015
output_cost_per_1k_usd = 0.0006
context_window = 128000
models = ["gpt-4o-mini", { name = "gpt-4o", cost_per_1k_tokens_usd = 0.0025, output_cost_per_1k_usd = 0.01 }]

[[provider]]
id = "local"
base_url = "http://127.0.0.1:11434/v1"
model = "llama3.2"
prefill = true

[[route]]
model = "fast"
targets = ["openai/gpt-4o-mini", "local/llama3.2"]

[[route]]
model = "smart"
targets = ["openai/gpt-4o", "local"]
contract = {}
"#;
        let cfg = NodeConfig::parse("oam.toml", text, "unused").unwrap();
        let ids: Vec<&str> = cfg.targets.iter().map(|t| t.id.as_str()).collect();
        assert_eq!(ids, ["openai/gpt-4o-mini", "openai/gpt-4o", "local"]);
        let big = cfg.target("openai/gpt-4o").unwrap();
        assert_eq!(
            big.cost_per_1k_tokens_usd, 0.0025,
            "a model's own price wins"
        );
        assert_eq!(
            big.context_window,
            Some(128_000),
            "the provider's is the default"
        );
        assert!(cfg.target("local/llama3.2").unwrap().prefill);
        let routes = cfg.core_routes();
        assert_eq!(
            &*routes["fast"].targets[1], "local",
            "resolved to the target's id"
        );
        assert!(routes["smart"].contract.is_some());
        assert_eq!(
            cfg.pipeline.default_contract, None,
            "a user's providers: no contract"
        );
        let sim = NodeConfig::load(None, "http://sim").unwrap();
        assert_eq!(
            sim.pipeline.default_contract, None,
            "the simulator's: every model streams live"
        );
        assert!(
            sim.core_routes()[JSON_ROUTE].contract.is_some(),
            "but the json route holds answers to the JSON contract"
        );
    }

    #[test]
    fn errors_name_the_file_line_and_field() {
        let cases = [
            (
                "[node]\nclustr_size = 3\n",
                ["oam.toml", "line 2", "clustr_size"],
            ),
            (
                "[[provider]]\nid = \"a\"\nbase_url = \"http://x\"\nmodel = 7\n",
                ["oam.toml", "line 4", "model"],
            ),
            (
                "[[provider]]\nid = \"a b\"\nbase_url = \"http://x\"\nmodel = \"m\"\n",
                ["oam.toml", "provider[0]", "id must be"],
            ),
            (
                "[[provider]]\nid = \"a\"\nbase_url = \"ftp://x\"\nmodel = \"m\"\n",
                ["oam.toml", "provider[0]", "base_url"],
            ),
            (
                "[[provider]]\nid = \"a\"\nbase_url = \"http://x\"\nmodel = \"m\"\napi_key_env = \"OAM_TEST_SURELY_UNSET\"\n",
                ["oam.toml", "api_key_env", "OAM_TEST_SURELY_UNSET"],
            ),
            (
                "[node]\ncluster_size = 0\n",
                ["oam.toml", "node.cluster_size", "at least 1"],
            ),
            (
                "[node]\nlanes = 1000\n",
                ["oam.toml", "node.lanes is 1000", "at most 256"],
            ),
            (
                "[node]\nmembers = [\"n1\", \"n 2\"]\n",
                ["oam.toml", "node.members", "\"n 2\""],
            ),
            (
                "[escalations]\ncommand = []\n",
                ["oam.toml", "escalations.command", "name a program"],
            ),
            (
                "[[provider]]\nid = \"a\"\nbase_url = \"http://x\"\n",
                ["oam.toml", "provider[0]", "it names none"],
            ),
            (
                "[[provider]]\nid = \"a\"\nbase_url = \"http://x\"\nmodel = \"m\"\nmodels = [\"n\"]\n",
                ["oam.toml", "provider[0]", "not both"],
            ),
            (
                "[[provider]]\nid = \"a\"\nagent = \"llm.x\"\nbase_url = \"http://x\"\nmodel = \"m\"\n",
                ["oam.toml", "provider[0]", "not both"],
            ),
            (
                "[[provider]]\nid = \"a\"\nagent = \"llm.x\"\nmodel = \"m\"\nprobe = \"models\"\n",
                ["oam.toml", "provider[0]", "needs a base_url"],
            ),
            (
                "[[provider]]\nid = \"a\"\nbase_url = \"http://x\"\nmodel = \"m\"\nmodels = [\"n\"]\n",
                ["oam.toml", "provider[0]", "not both"],
            ),
            (
                "[[provider]]\nid = \"a\"\nbase_url = \"http://x\"\nmodels = [\"n\", \"n\"]\n",
                ["oam.toml", "provider[0]", "listed twice"],
            ),
            (
                "[[provider]]\nid = \"a\"\nbase_url = \"http://x\"\nmodels = [\"n\"]\n[[route]]\nmodel = \"m\"\ntargets = [\"a/x\"]\n",
                ["route[0] (m)", "\"a/x\"", "a/n"],
            ),
            (
                "[[provider]]\nid = \"a\"\nbase_url = \"http://x\"\nmodel = \"n\"\n[[route]]\nmodel = \"auto\"\ntargets = [\"a\"]\n",
                ["oam.toml", "route[0]", "not empty"],
            ),
            (
                "[[route]]\nmodel = \"m\"\ntargets = [\"primary\"]\ncontract = { min_confidence = 2.0 }\n",
                ["oam.toml", "route[0] (m)", "min_confidence"],
            ),
        ];
        for (text, needles) in cases {
            let err = NodeConfig::parse("oam.toml", text, "http://sim")
                .unwrap_err()
                .to_string();
            for n in needles {
                assert!(err.contains(n), "{err:?} lacks {n:?}");
            }
        }
    }

    proptest::proptest! {
        /// Any text as `oam.toml` is a config or an error naming the file, never a panic.
        #[test]
        fn any_text_is_a_config_or_an_error(text in "\\PC{0,400}") {
            if let Err(e) = NodeConfig::parse("oam.toml", &text, "http://sim") {
                proptest::prop_assert!(e.to_string().contains("oam.toml"), "{e}");
            }
        }

        /// TOML-shaped input with the real sections and keys, and random values.
        #[test]
        fn any_values_in_real_keys_are_checked(
            size in proptest::num::i64::ANY,
            members in "[a-z0-9 .*>]{0,12}",
            timeout in proptest::num::i64::ANY,
        ) {
            let _ = NodeConfig::parse("oam.toml", &template(size, &members, timeout), "http://sim");
        }
    }

    fn template(size: i64, member: &str, timeout: i64) -> String {
        format!(
            "[node]\ncluster_size = {size}\nmembers = [{member:?}]\nheader_timeout_ms = {timeout}\n"
        )
    }

    #[test]
    fn the_fuzzing_template_is_a_config_with_sane_values() {
        let cfg = NodeConfig::parse("oam.toml", &template(3, "n1", 1_000), "http://sim").unwrap();
        assert_eq!(cfg.node.members, ["n1"]);
        assert_eq!(cfg.node.header_timeout_ms, 1_000);
    }
}
