//! Where each target is served: one connector per provider (an HTTP provider or a mesh
//! agent), and per target the provider and the model it asks for. Built once from the
//! configuration; read by the request path and the prober.

use super::super::config::NodeConfig;
use super::{AgentCalls, Connector};
use std::collections::BTreeMap;

pub(crate) struct Upstreams {
    /// One per provider (host), by provider id.
    connectors: BTreeMap<String, Connector>,
    /// Per target id: (its provider, the model it asks for).
    targets: BTreeMap<String, (String, String)>,
    /// Faults chaos injects into the calls of a provider (shared with every connector).
    pub(crate) injected: std::sync::Arc<super::injected::Injected>,
}

impl Upstreams {
    pub(crate) fn new(
        cfg: &NodeConfig,
        nats: &async_nats::Client,
    ) -> Result<Upstreams, super::SetupError> {
        // Each lane its own pools: a request's upstream connections are served on its thread.
        let http = crate::http::lanes::PerLane::new(cfg.node.lanes, || {
            crate::http::http_client(None).map_err(|e| super::SetupError::Http(e.to_string()))
        })?;
        let post = crate::http::Poster::new(cfg.node.max_answer_bytes, cfg.node.lanes)
            .map_err(|e| super::SetupError::Http(e.to_string()))?;
        let calls = std::sync::Arc::new(AgentCalls::new(nats.clone()));
        let injected = std::sync::Arc::new(super::injected::Injected::default());
        let connectors = cfg
            .providers
            .iter()
            .map(|p| {
                let c = Connector::new(p, http.clone(), post.clone(), &calls)?
                    .with_faults(injected.clone());
                Ok((p.id.clone(), c))
            })
            .collect::<Result<_, super::SetupError>>()?;
        let targets = cfg
            .targets
            .iter()
            .map(|t| (t.id.clone(), (t.provider.clone(), t.model.clone())))
            .collect();
        Ok(Upstreams {
            connectors,
            targets,
            injected,
        })
    }

    /// The connector and model that serve a target.
    pub(crate) fn target(&self, id: &str) -> Option<(&Connector, &str)> {
        let (provider, model) = self.targets.get(id)?;
        Some((self.connectors.get(provider)?, model))
    }

    /// Every target, with its connector and model.
    pub(crate) fn all(&self) -> impl Iterator<Item = (&str, &Connector, &str)> {
        self.targets
            .keys()
            .filter_map(|id| self.target(id).map(|(c, m)| (id.as_str(), c, m)))
    }

    /// The targets served by mesh agent `agent`.
    pub(crate) fn of_agent(&self, agent: &str) -> Vec<String> {
        self.all()
            .filter(|(_, c, _)| c.agent() == Some(agent))
            .map(|(id, _, _)| id.to_string())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_target_is_served_by_its_provider_and_agents_are_found_by_name() {
        let cfg = NodeConfig::parse(
            "oam.toml",
            r#"
[[provider]]
id = "http"
base_url = "http://127.0.0.1:1/v1"
models = ["a", "b"]
probe = "off"

[[provider]]
id = "llm"
agent = "llm.local"
model = "m"
probe = "off"
"#,
            "",
        )
        .expect("a valid configuration");
        let up = Upstreams::new(&cfg, &crate::node::bus::offline::client().await).expect("built");
        let (c, model) = up.target("http/b").expect("a target of the HTTP provider");
        assert_eq!((c.id.as_str(), model, c.agent()), ("http", "b", None));
        let (c, model) = up.target("llm").expect("the agent's one target");
        assert_eq!((model, c.agent()), ("m", Some("llm.local")));
        assert!(up.target("nope").is_none());
        assert_eq!(up.of_agent("llm.local"), vec!["llm".to_string()]);
        assert!(up.of_agent("other").is_empty());
        assert_eq!(up.all().count(), 3);
    }
}
