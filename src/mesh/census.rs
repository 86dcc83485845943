//! Agents of other Open Agent Mesh clients (the Python SDK) that die together with their
//! nats-server, as on a host that fails: no server is left to send their disconnect advisory.
//! The monitor counts, every few seconds, the connections on each server that serve agents
//! without instance records. A server gone from a complete count (every server the cluster
//! still lists answered) makes its connections suspects; once the verdict bound has passed, a
//! suspect whose agent is served by fewer such connections than before did not reconnect
//! elsewhere, and died. Pure: the counts and the time are given.

use std::collections::BTreeSet;

/// A connection that serves agents, on one server.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct Conn {
    /// The server's id.
    pub server: String,
    /// Its connection id there.
    pub cid: u64,
    pub agents: Vec<String>,
}

impl Conn {
    /// The instance id the monitor gives such a connection (as for a disconnect advisory).
    pub fn instance_id(&self) -> String {
        let server: String = self.server.chars().take(8).collect();
        format!("nats-{server}-{}", self.cid)
    }
}

/// One complete count: every server that answered, and their agent-serving connections.
#[derive(Clone, Default, Debug)]
pub(crate) struct Count {
    pub servers: BTreeSet<String>,
    pub conns: Vec<Conn>,
}

impl Count {
    /// How many connections serve `agent`.
    fn serving(&self, agent: &str) -> usize {
        self.conns
            .iter()
            .filter(|c| c.agents.iter().any(|a| a == agent))
            .count()
    }
}

/// A connection last counted on a server that is gone.
#[derive(Debug)]
struct Suspect {
    conn: Conn,
    due_ms: u64,
    /// Connections that served its (first) agent before its server went.
    before: usize,
}

/// A suspect found dead: its instance id, its agents, and which of those other connections
/// still serve.
#[derive(PartialEq, Eq, Debug)]
pub(crate) struct Died {
    pub instance_id: String,
    pub agents: Vec<String>,
    pub served_elsewhere: Vec<String>,
}

#[derive(Default, Debug)]
pub(crate) struct Census {
    last: Option<Count>,
    suspects: Vec<Suspect>,
}

impl Census {
    /// Take a complete count made at `now_ms`: the suspects it finds dead, `bound_ms` after
    /// their server was seen gone.
    pub fn update(&mut self, count: Count, now_ms: u64, bound_ms: u64) -> Vec<Died> {
        if let Some(last) = &self.last {
            for gone in last.servers.difference(&count.servers) {
                for conn in last.conns.iter().filter(|c| &c.server == gone) {
                    if self.suspects.iter().any(|s| s.conn == *conn) {
                        continue;
                    }
                    let before = conn.agents.first().map_or(0, |a| last.serving(a));
                    self.suspects.push(Suspect {
                        conn: conn.clone(),
                        due_ms: now_ms + bound_ms,
                        before,
                    });
                }
            }
        }
        // A server that answers again has its connections: not suspects.
        self.suspects
            .retain(|s| !count.servers.contains(&s.conn.server));
        let (due, waiting): (Vec<Suspect>, Vec<Suspect>) = std::mem::take(&mut self.suspects)
            .into_iter()
            .partition(|s| s.due_ms <= now_ms);
        self.suspects = waiting;
        let mut died = Vec::new();
        let mut agents: Vec<&str> = due
            .iter()
            .filter_map(|s| s.conn.agents.first().map(String::as_str))
            .collect();
        agents.sort_unstable();
        agents.dedup();
        for agent in agents {
            let group: Vec<&Suspect> = due
                .iter()
                .filter(|s| s.conn.agents.first().map(String::as_str) == Some(agent))
                .collect();
            let before = group.iter().map(|s| s.before).max().unwrap_or(0);
            // Those that reconnected elsewhere are counted again; the others are missing.
            let missing = before.saturating_sub(count.serving(agent)).min(group.len());
            for s in group.into_iter().take(missing) {
                died.push(Died {
                    instance_id: s.conn.instance_id(),
                    agents: s.conn.agents.clone(),
                    served_elsewhere: s
                        .conn
                        .agents
                        .iter()
                        .filter(|a| count.serving(a) > 0)
                        .cloned()
                        .collect(),
                });
            }
        }
        self.last = Some(count);
        died
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(server: &str, cid: u64, agent: &str) -> Conn {
        Conn {
            server: server.into(),
            cid,
            agents: vec![agent.into()],
        }
    }

    fn count(servers: &[&str], conns: Vec<Conn>) -> Count {
        Count {
            servers: servers.iter().map(ToString::to_string).collect(),
            conns,
        }
    }

    #[test]
    fn a_connection_that_went_with_its_server_and_came_back_nowhere_died() {
        let mut c = Census::default();
        let on_a = conn("SERVERAAAA", 7, "sdk.echo");
        let on_b = conn("SERVERBBBB", 9, "sdk.echo");
        assert!(
            c.update(
                count(
                    &["SERVERAAAA", "SERVERBBBB"],
                    vec![on_a.clone(), on_b.clone()]
                ),
                0,
                3_000
            )
            .is_empty()
        );
        // A is gone; within the bound nothing is said.
        assert!(
            c.update(count(&["SERVERBBBB"], vec![on_b.clone()]), 1_000, 3_000)
                .is_empty()
        );
        let died = c.update(count(&["SERVERBBBB"], vec![on_b.clone()]), 4_000, 3_000);
        assert_eq!(
            died,
            [Died {
                instance_id: "nats-SERVERAA-7".into(),
                agents: vec!["sdk.echo".into()],
                served_elsewhere: vec!["sdk.echo".into()],
            }]
        );
        assert!(
            c.update(count(&["SERVERBBBB"], vec![on_b]), 5_000, 3_000)
                .is_empty(),
            "once"
        );
    }

    #[test]
    fn a_connection_that_reconnected_elsewhere_lives() {
        let mut c = Census::default();
        let on_a = conn("SERVERAAAA", 7, "sdk.echo");
        c.update(count(&["SERVERAAAA", "SERVERBBBB"], vec![on_a]), 0, 3_000);
        c.update(count(&["SERVERBBBB"], vec![]), 1_000, 3_000);
        let moved = conn("SERVERBBBB", 12, "sdk.echo");
        assert!(
            c.update(count(&["SERVERBBBB"], vec![moved]), 4_000, 3_000)
                .is_empty()
        );
    }

    #[test]
    fn the_last_connection_of_an_agent_is_its_death_and_a_server_back_clears_suspects() {
        let mut c = Census::default();
        let only = conn("SERVERAAAA", 1, "solo");
        c.update(
            count(&["SERVERAAAA", "SERVERBBBB"], vec![only.clone()]),
            0,
            3_000,
        );
        c.update(count(&["SERVERBBBB"], vec![]), 1_000, 3_000);
        let died = c.update(count(&["SERVERBBBB"], vec![]), 4_000, 3_000);
        assert_eq!(died.len(), 1);
        assert!(
            died[0].served_elsewhere.is_empty(),
            "no one serves solo now"
        );

        // A server that only missed a count comes back with its connections: no death.
        let mut c = Census::default();
        c.update(
            count(&["SERVERAAAA", "SERVERBBBB"], vec![only.clone()]),
            0,
            3_000,
        );
        c.update(count(&["SERVERBBBB"], vec![]), 1_000, 3_000);
        c.update(
            count(&["SERVERAAAA", "SERVERBBBB"], vec![only]),
            2_000,
            3_000,
        );
        assert!(
            c.update(count(&["SERVERAAAA", "SERVERBBBB"], vec![]), 9_000, 3_000)
                .is_empty()
        );
    }
}
