//! The price table: list prices of common models (`data/prices.toml`, with its date and
//! sources), for targets whose configuration names no price of its own, so that a budget over
//! `gpt-4o-mini` counts what its calls cost without anyone typing a price.

use serde::Deserialize;
use std::sync::OnceLock;

/// The table as kept in the repository.
const TABLE: &str = include_str!("../../data/prices.toml");

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct Table {
    /// When the prices were read (`2026-06`).
    pub as_of: String,
    pub sources: Vec<String>,
    #[serde(rename = "model")]
    models: Vec<Listed>,
}

/// One model's prices, in US dollars per 1,000,000 tokens (as vendors publish them).
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct Listed {
    pub names: Vec<String>,
    pub input: f64,
    pub output: f64,
    #[serde(default)]
    pub cached_input: Option<f64>,
    #[serde(default)]
    pub cache_write: Option<f64>,
    #[serde(default)]
    pub reasoning: Option<f64>,
}

/// The table (parsed once; a table that does not parse is a build's defect, caught by its test).
pub(crate) fn table() -> &'static Table {
    static PARSED: OnceLock<Table> = OnceLock::new();
    PARSED.get_or_init(|| {
        toml::from_str(TABLE).unwrap_or_else(|e| {
            tracing::error!("data/prices.toml does not parse: {e}");
            Table {
                as_of: String::new(),
                sources: Vec::new(),
                models: Vec::new(),
            }
        })
    })
}

impl Table {
    /// `model`'s prices: by its name, or its name less a trailing date (`-2024-08-06`,
    /// `-20241022`) or `-latest`.
    pub(crate) fn lookup(&self, model: &str) -> Option<&Listed> {
        let find = |name: &str| {
            self.models
                .iter()
                .find(|m| m.names.iter().any(|n| n == name))
        };
        find(model).or_else(|| find(crate::core::request::undated_model(model)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_parses_and_every_price_is_sane_and_every_name_listed_once() {
        let t: Table = toml::from_str(TABLE).expect("data/prices.toml parses");
        assert!(t.as_of.len() >= 7 && !t.sources.is_empty());
        let mut names = std::collections::BTreeSet::new();
        for m in &t.models {
            for n in &m.names {
                assert!(names.insert(n.clone()), "{n} is listed twice");
            }
            let prices = [
                Some(m.input),
                Some(m.output),
                m.cached_input,
                m.cache_write,
                m.reasoning,
            ];
            for p in prices.into_iter().flatten() {
                assert!(p.is_finite() && (0.0..1_000.0).contains(&p), "{m:?}");
            }
            assert!(m.input > 0.0, "{m:?}: a listed model has a price");
        }
        assert!(t.models.len() >= 20, "the common models are listed");
    }

    #[test]
    fn models_are_found_by_name_with_or_without_their_date() {
        let t = table();
        let mini = t.lookup("gpt-4o-mini").expect("gpt-4o-mini is listed");
        assert_eq!((mini.input, mini.output), (0.15, 0.60));
        assert_eq!(t.lookup("gpt-4o-mini-2024-07-18"), Some(mini));
        let haiku = t
            .lookup("claude-3-5-haiku-20241022")
            .expect("dated Anthropic name");
        assert_eq!(haiku.output, 4.0);
        assert_eq!(t.lookup("claude-3-5-haiku-latest"), Some(haiku));
        assert!(t.lookup("gpt-4o-mini-x").is_none());
        assert!(
            t.lookup("llama3.1:8b").is_none(),
            "a local model's own name is not guessed"
        );
        assert!(t.lookup("my-model-12-34").is_none());
        assert_eq!(
            crate::core::request::undated_model("a-2024-08-06"),
            Some("a")
        );
        assert_eq!(crate::core::request::undated_model("2024-08-06"), None);
    }
}
