//! Who is who on the bus: oam's roles as NATS users (`node-{id}`, `agent-{name}`, `caller`,
//! ...), their names and what a user name stands for. What each role may publish and
//! subscribe to is `local::roles`, which writes it into the server's config.

use super::subjects;

/// A `--role` (and `--name`) that names no role: what to give instead.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct BadRole(pub String);

/// One role, with the name it is for where it has one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Everything: `oam mesh up` itself, bucket creation, stream deletion.
    Admin,
    Node(String),
    Agent(String),
    /// An agent served by the Open Agent Mesh SDK, which needs more than oam's agents: see
    /// `Permissions::sdk`.
    SdkAgent(String),
    Monitor,
    Warden,
    Operator,
    Caller,
    /// A caller using the Open Agent Mesh SDK.
    SdkCaller,
    Viewer,
}

/// The admin's user name (the application account's first user).
pub const ADMIN_USER: &str = "oam";
/// The system account's limited user (monitor and warden).
pub const OBSERVER_USER: &str = "observer";

/// The role names `oam creds issue --role` takes.
pub const KINDS: &[&str] = &[
    "agent",
    "caller",
    "sdk-agent",
    "sdk-caller",
    "viewer",
    "operator",
    "node",
    "monitor",
    "warden",
];

/// Subject and KV-key rules for every name given to a role: dot-separated tokens of letters,
/// digits, '-' and '_' (no wildcards, no spaces), at most 128 characters.
pub fn valid_name(name: &str) -> bool {
    name.len() <= 128 && name.split('.').all(subjects::valid_token)
}

impl Role {
    /// The role `kind` for `name` (agents and nodes need one; the others take none).
    pub fn parse(kind: &str, name: Option<&str>) -> Result<Role, BadRole> {
        let named = |make: fn(String) -> Role| match name {
            Some(n) if valid_name(n) => Ok(make(n.to_string())),
            Some(n) => Err(BadRole(format!(
                "--name {n:?}: use dot-separated words of letters, digits, '-' and '_'"
            ))),
            None => Err(BadRole(format!(
                "--role {kind} needs --name (the {kind}'s name)"
            ))),
        };
        let bare = |role: Role| match name {
            None => Ok(role),
            Some(_) => Err(BadRole(format!("--role {kind} takes no --name"))),
        };
        match kind {
            "agent" => named(Role::Agent),
            "sdk-agent" => named(Role::SdkAgent),
            "sdk-caller" => bare(Role::SdkCaller),
            "node" => named(Role::Node).and_then(|r| match &r {
                Role::Node(id) if !subjects::valid_token(id) => Err(BadRole(format!(
                    "--name {id:?}: a node id is one word of letters, digits, '-' and '_'"
                ))),
                _ => Ok(r),
            }),
            "caller" => bare(Role::Caller),
            "viewer" => bare(Role::Viewer),
            "operator" => bare(Role::Operator),
            "monitor" => bare(Role::Monitor),
            "warden" => bare(Role::Warden),
            other => Err(BadRole(format!(
                "unknown role {other:?}; one of: {}",
                KINDS.join(", ")
            ))),
        }
    }

    /// The NATS user name of this role.
    pub fn user(&self) -> String {
        match self {
            Role::Admin => ADMIN_USER.into(),
            Role::Node(id) => format!("node-{id}"),
            Role::Agent(name) => format!("agent-{name}"),
            Role::SdkAgent(name) => format!("sdk-agent-{name}"),
            Role::SdkCaller => "sdk-caller".into(),
            Role::Monitor => "monitor".into(),
            Role::Warden => "warden".into(),
            Role::Operator => "operator".into(),
            Role::Caller => "caller".into(),
            Role::Viewer => "viewer".into(),
        }
    }

    /// The role a user name stands for (`None`: not one of ours).
    pub fn of_user(user: &str) -> Option<Role> {
        let role = if let Some(id) = user.strip_prefix("node-") {
            Role::Node(id.to_string())
        } else if let Some(name) = user.strip_prefix("agent-") {
            Role::Agent(name.to_string())
        } else if let Some(name) = user.strip_prefix("sdk-agent-") {
            Role::SdkAgent(name.to_string())
        } else {
            match user {
                ADMIN_USER => Role::Admin,
                "monitor" => Role::Monitor,
                "warden" => Role::Warden,
                "operator" => Role::Operator,
                "caller" => Role::Caller,
                "sdk-caller" => Role::SdkCaller,
                "viewer" => Role::Viewer,
                _ => return None,
            }
        };
        let ok = match &role {
            Role::Node(id) => subjects::valid_token(id),
            Role::Agent(name) | Role::SdkAgent(name) => valid_name(name),
            _ => true,
        };
        ok.then_some(role)
    }

    /// The role's kind, as `--role` takes it.
    pub fn kind(&self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Node(_) => "node",
            Role::Agent(_) => "agent",
            Role::SdkAgent(_) => "sdk-agent",
            Role::SdkCaller => "sdk-caller",
            Role::Monitor => "monitor",
            Role::Warden => "warden",
            Role::Operator => "operator",
            Role::Caller => "caller",
            Role::Viewer => "viewer",
        }
    }
}
