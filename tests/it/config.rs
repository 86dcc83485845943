//! `oam config check` and the starter configurations in examples/starters: each validates, and
//! serves a request with its upstreams pointed at a local stand-in (`oam sim`); a broken file
//! is named by file and line; a budget over a model of the price table trips with no prices
//! in the file.

use crate::support::{NatsServer, Proc, node_args};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn oam() -> assert_cmd::Command {
    assert_cmd::Command::cargo_bin("oam").expect("oam binary")
}

fn starters() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/starters");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("examples/starters")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    files
}

/// The variables the starters read their keys from.
const KEYS: [(&str, &str); 3] = [
    ("OPENAI_API_KEY", "sk-test-openai-0000"),
    ("ANTHROPIC_API_KEY", "sk-ant-test-0000"),
    ("OAM_KEY_SUPPORT_BOT", "support-bot-key-0123456789"),
];

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("oam-config-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test]
async fn every_starter_passes_config_check_and_serves_a_request_on_a_stand_in() {
    let files = starters();
    assert!(files.len() >= 4, "{files:?}");
    let nats = NatsServer::start().await;
    let sim = Proc::spawn(&["sim", "--listen", "127.0.0.1:0", "--json"]);
    let sim_url = sim.ready["url"].as_str().unwrap().to_string();
    let dir = scratch("starters");
    let c = crate::support::http(Duration::from_secs(10));
    let mut served = Vec::new();
    for file in files {
        let name = file.file_stem().unwrap().to_string_lossy().to_string();
        let out = oam()
            .args(["config", "check", "--json"])
            .arg(&file)
            .envs(KEYS)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let checked: Value = serde_json::from_slice(&out.stdout).unwrap();
        let targets = checked["targets"].as_array().unwrap();
        // Every paid model is priced (by the table: the starters give no prices), and so
        // nothing is left for a budget to warn about.
        for t in targets {
            // A model served locally costs what its file says (nothing), not a list price.
            let local = t["model"].as_str().unwrap().starts_with("llama");
            let table = t["priced_by"] == "table";
            assert_eq!(table, !local, "{name}: {t}");
        }
        assert_eq!(checked["warnings"], json!([]), "{name}");

        // The same file, its upstreams on the stand-in, serves its first route.
        let text = std::fs::read_to_string(&file).unwrap();
        let stand_in = format!("{sim_url}/primary/v1");
        let text: String = text
            .lines()
            .map(|l| {
                if l.trim_start().starts_with("base_url") {
                    format!("base_url = \"{stand_in}\"")
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n");
        let route = text
            .lines()
            .skip_while(|l| l.trim() != "[[route]]")
            .find_map(|l| l.trim().strip_prefix("model = \""))
            .map(|m| m.trim_end_matches('"').to_string())
            .expect("a route");
        let local = dir.join(format!("{name}.toml"));
        std::fs::write(&local, text).unwrap();
        served.push((name, route, local));
    }
    // One node per starter, started together.
    let nodes: Vec<Proc> = std::thread::scope(|s| {
        let starting: Vec<_> = served
            .iter()
            .map(|(name, _, local)| {
                let nats_url = nats.url();
                s.spawn(move || {
                    let id = format!("s-{name}");
                    let extra = ["--config", local.to_str().unwrap()];
                    Proc::spawn_with_env(&node_args(&id, &nats_url, &extra), &KEYS)
                })
            })
            .collect();
        starting.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((name, route, _), node) in served.iter().zip(&nodes) {
        let url = node.ready["http"].as_str().unwrap().to_string();
        let r = c
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth(KEYS[2].1)
            .json(&json!({"model": route, "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        let status = r.status();
        let body: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{name} on route {route}: {body}");
        assert!(
            body["choices"][0]["message"]["content"].is_string(),
            "{name}: {body}"
        );
    }
}

#[test]
fn a_broken_configuration_is_named_by_file_and_line() {
    let dir = scratch("broken");
    // A TOML error: the line TOML stopped on.
    let syntax = dir.join("syntax.toml");
    std::fs::write(&syntax, "[[provider]]\nid = \"a\"\nmodel = \n").unwrap();
    let out = oam()
        .args(["config", "check"])
        .arg(&syntax)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{}:3:", syntax.display())), "{err}");
    // A value the configuration cannot hold: the line of the table it is in.
    let invalid = dir.join("invalid.toml");
    std::fs::write(
        &invalid,
        "[[provider]]\nid = \"a\"\nbase_url = \"http://127.0.0.1:1/v1\"\nmodel = \"m\"\n\n\
         [[provider]]\nid = \"b\"\nbase_url = \"ftp://x\"\nmodel = \"m\"\n",
    )
    .unwrap();
    let out = oam()
        .args(["config", "check"])
        .arg(&invalid)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}:6:", invalid.display())) && err.contains("base_url"),
        "{err}"
    );
    // Nothing to check: said, with where a configuration may come from.
    let out = oam()
        .args(["config", "check"])
        .current_dir(&dir)
        .env_remove("OAM_CONFIG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("OAM_CONFIG"));
    // $OAM_CONFIG is read when no file is named.
    let out = oam()
        .args(["config", "check"])
        .current_dir(&dir)
        .env("OAM_CONFIG", &invalid)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// A budget over `gpt-4o-mini` with no price in the file: the price table prices its calls,
/// and the budget trips (with no price, every call cost $0 and none was ever refused).
#[tokio::test]
async fn a_budget_over_a_listed_model_trips_with_no_prices_in_the_file() {
    let nats = NatsServer::start().await;
    let sim = Proc::spawn(&["sim", "--listen", "127.0.0.1:0", "--json"]);
    let sim_url = sim.ready["url"].as_str().unwrap().to_string();
    let dir = scratch("table-budget");
    let cfg = dir.join("oam.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[provider]]\nid = \"openai\"\nbase_url = \"{sim_url}/primary/v1\"\n\
             model = \"gpt-4o-mini\"\n\n[budgets.agents.thrifty]\nlimit_usd = 0.0002\n"
        ),
    )
    .unwrap();
    let node = Proc::spawn(&node_args(
        "tb1",
        &nats.url(),
        &["--config", cfg.to_str().unwrap()],
    ));
    let url = node.ready["http"].as_str().unwrap().to_string();
    let c = crate::support::http(Duration::from_secs(10));
    let mut served = 0;
    let mut refused = None;
    for _ in 0..40 {
        let r = c
            .post(format!("{url}/v1/chat/completions"))
            .header("x-oam-agent", "thrifty")
            .json(&json!({"model": "openai", "max_tokens": 64,
                "messages": [{"role": "user", "content": "What is the capital of Norway?"}]}))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let body: Value = r.json().await.unwrap();
        match status {
            200 => served += 1,
            402 => {
                refused = Some(body);
                break;
            }
            other => panic!("{other}: {body}"),
        }
    }
    let refused = refused.expect("the budget trips");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("BUDGET_EXHAUSTED"),
        "{refused}"
    );
    assert!(
        served >= 1,
        "calls were served and charged before it tripped"
    );
}
