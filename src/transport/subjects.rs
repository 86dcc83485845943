//! Every NATS subject oam uses, and only here. Control-plane events are
//! `oam.v1.<kind>.<sender>`; wildcards subscribe to a kind from every sender.

/// Prefix of every control-plane subject.
pub const PREFIX: &str = "oam.v1";

pub fn heartbeat(node: &str) -> String {
    format!("{PREFIX}.heartbeat.{node}")
}
pub const HEARTBEATS: &str = "oam.v1.heartbeat.*";

pub fn goodbye(node: &str) -> String {
    format!("{PREFIX}.goodbye.{node}")
}
pub const GOODBYES: &str = "oam.v1.goodbye.*";

pub fn observations(node: &str) -> String {
    format!("{PREFIX}.observations.{node}")
}
pub const ALL_OBSERVATIONS: &str = "oam.v1.observations.*";

pub fn decision(node: &str) -> String {
    format!("{PREFIX}.decision.{node}")
}
pub const DECISIONS: &str = "oam.v1.decision.*";

pub fn incident(node: &str) -> String {
    format!("{PREFIX}.incident.{node}")
}
pub fn escalation(node: &str) -> String {
    format!("{PREFIX}.escalation.{node}")
}

/// The data plane on NATS: one service across nodes (a queue group), request/reply.
pub const REQUEST: &str = "oam.v1.request";
pub const REQUEST_QUEUE: &str = "oam-nodes";

/// A node id is one subject token: letters, digits, '-' and '_'.
pub fn valid_token(s: &str) -> bool {
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
    }
}
