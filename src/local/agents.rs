//! Demo agents started for a while (a scenario's `[[agents]]`): `oam agent serve` processes in
//! the state folder, stopped again by the same handle.

use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::{Duration, Instant};

/// One agent to serve: `oam agent serve NAME --demo DEMO --replicas N`.
#[derive(Deserialize, Serialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub struct AgentSpec {
    pub name: String,
    /// An `oam agent serve --demo` value, e.g. `sleep:300`.
    pub demo: String,
    #[serde(default = "one")]
    pub replicas: usize,
}

fn one() -> usize {
    1
}

/// How long a stopped agent may take to drain and leave before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Agent processes we started. `stop` ends them (SIGTERM, waited for, SIGKILL after a grace);
/// dropping the handle without `stop` still sends SIGTERM, without waiting.
pub struct Agents(Vec<std::process::Child>);

impl Agents {
    /// Start each agent (running `exe`) and wait until it says it is ready. In a mesh folder
    /// each agent runs as its own role (credentials issued for it); elsewhere it is given
    /// `app_url`. On failure the ones already started are stopped when the error drops the
    /// handle.
    pub async fn start(
        exe: &Path,
        dir: &Path,
        app_url: &str,
        specs: &[AgentSpec],
    ) -> anyhow::Result<Agents> {
        let mut agents = Agents(Vec::new());
        for a in specs {
            let args: Vec<String> = [
                "agent",
                "serve",
                &a.name,
                "--demo",
                &a.demo,
                "--replicas",
                &a.replicas.to_string(),
                "--json",
            ]
            .map(String::from)
            .to_vec();
            let url = if super::creds::load(dir).is_some() {
                let role = super::roles::Role::Agent(a.name.clone());
                super::creds::issue(dir, &role).await?.url
            } else {
                app_url.to_string()
            };
            let env = [(crate::transport::connect::ENV_URL, url)];
            let name = format!("agent-{}", a.name);
            let (mut child, out, log) = super::spawn_oam(exe, dir, &name, &args, &env)?;
            let ready =
                super::ready_line(&mut child, &out, &log, &name, Duration::from_secs(20)).await;
            agents.0.push(child);
            ready?;
        }
        Ok(agents)
    }

    /// SIGTERM every agent, then wait for each (SIGKILL after the grace period).
    pub async fn stop(mut self) {
        let children = std::mem::take(&mut self.0);
        for c in &children {
            super::signal(c.id(), libc::SIGTERM);
        }
        let deadline = Instant::now() + STOP_GRACE;
        for mut c in children {
            while matches!(c.try_wait(), Ok(None)) {
                if Instant::now() >= deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

impl Drop for Agents {
    fn drop(&mut self) {
        for c in &self.0 {
            super::signal(c.id(), libc::SIGTERM);
        }
    }
}
