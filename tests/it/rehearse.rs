//! `oam rehearse`: real traffic through a mesh, then its decision log decided again under a
//! candidate configuration, as a user would before putting the candidate live.

use crate::support::{ClusterDir, Proc, eventually};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::time::Duration;

fn oam() -> assert_cmd::Command {
    assert_cmd::Command::cargo_bin("oam").expect("oam binary")
}

fn config(sim: &str, route_change: &str, spendy_limit: f64) -> String {
    format!(
        r#"
[[provider]]
id = "p1"
base_url = "{sim}/primary/v1"
model = "m1"
cost_per_1k_tokens_usd = 0.01

[[provider]]
id = "p2"
base_url = "{sim}/secondary/v1"
model = "m2"
cost_per_1k_tokens_usd = 0.002

[[route]]
model = "keep"
targets = ["p1"]

[[route]]
model = "change"
targets = [{route_change}]

[budgets.agents.spendy]
limit_usd = {spendy_limit}
"#
    )
}

/// Traffic on two routes from two agents; then, under a candidate that takes p2 out of route
/// `change` and lowers agent spendy's budget to nothing, the report names exactly the requests
/// on `change` or from spendy, and says why; the same run again is byte-identical; the
/// configuration the mesh runs on changes nothing.
#[tokio::test]
async fn a_candidate_config_is_rehearsed_on_the_log_and_names_what_changes() {
    let sim = Proc::spawn(&["sim", "--listen", "127.0.0.1:0", "--json"]);
    let sim_url = sim.ready["url"].as_str().unwrap().to_string();
    let dir = ClusterDir::new("rehearse");
    std::fs::create_dir_all(&dir.0).unwrap();
    let live = dir.0.join("live.toml");
    std::fs::write(&live, config(&sim_url, r#""p2", "p1""#, 10.0)).unwrap();
    let candidate = dir.0.join("candidate.toml");
    std::fs::write(&candidate, config(&sim_url, r#""p1""#, 0.0)).unwrap();
    let up = crate::support::mesh_up_on(&dir.0, &live);
    let node = up["nodes"][0]["http"].as_str().unwrap().to_string();
    let c = crate::support::http(Duration::from_secs(10));
    let mut changing = BTreeSet::new();
    let mut all = BTreeSet::new();
    for (i, (route, agent)) in [
        ("keep", "quiet"),
        ("change", "quiet"),
        ("keep", "spendy"),
        ("change", "spendy"),
        ("keep", "quiet"),
    ]
    .into_iter()
    .enumerate()
    {
        let r = c
            .post(format!("{node}/v1/chat/completions"))
            .json(&json!({"model": route, "max_tokens": 32,
                "messages": [{"role": "user", "content": format!("question {i}")}],
                "oam": {"agent": agent}}))
            .send()
            .await
            .unwrap();
        let status = r.status();
        let body: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{body}");
        let id = body["oam"]["request_id"].as_str().unwrap().to_string();
        if route == "change" || agent == "spendy" {
            changing.insert(id.clone());
        }
        all.insert(id);
    }
    let rehearse = |file: &std::path::Path| {
        let out = oam()
            .args(["rehearse", "--json", "--since", "1h", "--dir"])
            .arg(&dir.0)
            .arg(file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    // The configuration the mesh runs on: every record decided again as it was.
    let same = eventually(Duration::from_secs(15), || async {
        let r: Value = serde_json::from_slice(&rehearse(&live)).ok()?;
        (r["records"].as_u64()? >= all.len() as u64).then_some(r)
    })
    .await
    .expect("the records are in the log");
    assert_eq!(same["replayed"], same["records"], "{same}");
    assert_eq!(same["changed"], json!([]), "{same}");

    let first = rehearse(&candidate);
    assert_eq!(
        first,
        rehearse(&candidate),
        "the same run gives the same bytes"
    );
    let report: Value = serde_json::from_slice(&first).unwrap();
    let changed: BTreeSet<String> = report["changed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["request_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(changed, changing, "{report}");
    for c in report["changed"].as_array().unwrap() {
        if c["agent"] == "spendy" {
            assert_eq!(c["after"]["outcome"], "rejected", "{c}");
            assert!(
                c["after"]["reason_codes"]
                    .as_array()
                    .unwrap()
                    .contains(&json!("BUDGET_EXHAUSTED")),
                "{c}"
            );
        } else {
            assert_eq!(c["before"]["target"], "p2", "{c}");
            assert_eq!(c["after"]["target"], "p1", "{c}");
            assert_eq!(c["answer_assumed"], true, "{c}");
        }
    }
    assert_eq!(report["refusals_appear"], 2, "{report}");
    assert!(
        report["spend_before_usd"]["p2"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    assert!(report["spend_after_usd"].get("p2").is_none(), "{report}");
    // And for a person.
    let out = oam()
        .args(["rehearse", "--since", "1h", "--dir"])
        .arg(&dir.0)
        .arg(&candidate)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("3 change (2 refusals appear"), "{text}");
}
