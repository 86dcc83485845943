//! `oam spend --verify`: the ledger's settlements checked against the decision log's charges,
//! on a real mesh, then with one settlement taken out of the ledger by hand.

use crate::support::{ClusterDir, Proc, eventually};
use serde_json::{Value, json};
use std::time::Duration;

fn config(sim: &str) -> String {
    format!(
        r#"
[[provider]]
id = "p1"
base_url = "{sim}/primary/v1"
model = "m1"
cost_per_1k_tokens_usd = 0.01

[budgets.global]
limit_usd = 100.0

[budgets.agents.spendy]
limit_usd = 10.0
"#
    )
}

/// Run `oam spend` (with `args`) on the mesh in `dir`: its exit code and its JSON report.
fn spend(dir: &std::path::Path, args: &[&str]) -> (i32, Value, String) {
    let out = assert_cmd::Command::new(assert_cmd::cargo::cargo_bin!("oam"))
        .args(["spend", "--json", "--since", "1h", "--dir"])
        .arg(dir)
        .args(args)
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    let report = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (
        out.status.code().unwrap_or(-1),
        report,
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// Requests from two agents under a global and an agent budget: once every charge is in,
/// `--verify` passes and the books add up to what the answers cost; with the last settlement
/// of the agent's budget taken out by hand (its number, what it charged, and the spend), it
/// exits 1 naming that request.
#[tokio::test]
async fn the_books_hold_until_a_settlement_is_taken_out_by_hand() {
    let sim = Proc::spawn(&["sim", "--listen", "127.0.0.1:0", "--json"]);
    let sim_url = sim.ready["url"].as_str().unwrap().to_string();
    let dir = ClusterDir::new("spend");
    std::fs::create_dir_all(&dir.0).unwrap();
    let file = dir.0.join("oam.toml");
    std::fs::write(&file, config(&sim_url)).unwrap();
    let up = crate::support::mesh_up_on(&dir.0, &file);
    let node = up["nodes"][0]["http"].as_str().unwrap().to_string();
    let c = crate::support::http(Duration::from_secs(10));
    let (mut cost, mut last) = (0.0, None);
    for (i, agent) in ["quiet", "spendy", "quiet", "spendy", "spendy"]
        .into_iter()
        .enumerate()
    {
        let r = c
            .post(format!("{node}/v1/chat/completions"))
            .json(&json!({"model": "auto", "max_tokens": 32,
                "messages": [{"role": "user", "content": format!("question {i}")}],
                "oam": {"agent": agent}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let body: Value = r.json().await.unwrap();
        let usd = body["oam"]["cost_usd"].as_f64().unwrap();
        assert!(usd > 0.0, "{body}");
        cost += usd;
        if agent == "spendy" {
            last = Some((body["oam"]["request_id"].as_str().unwrap().to_string(), usd));
        }
    }
    let (last_id, last_usd) = last.unwrap();

    // Every charge recorded and settled (settlements go out within a second or so).
    let report = eventually(Duration::from_secs(20), || async {
        let (code, r, _) = spend(&dir.0, &["--verify"]);
        (code == 0 && r["charges"] == 5 && r["pending"] == json!([])).then_some(r)
    })
    .await;
    let Some(report) = report else {
        let (code, r, err) = spend(&dir.0, &["--verify"]);
        panic!("exit {code}: {r:#} {err}");
    };
    assert_eq!(report["faults"], json!([]), "{report:#}");
    assert!(
        (report["charged_usd"].as_f64().unwrap() - cost).abs() < 1e-6,
        "{report:#}"
    );
    let budget = |r: &Value, key: &str| {
        r["budgets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["key"] == key)
            .cloned()
            .unwrap_or_else(|| panic!("no {key}: {r:#}"))
    };
    let global = budget(&report, "global");
    assert!(
        (global["spent_usd"].as_f64().unwrap() - cost).abs() < 1e-6,
        "{report:#}"
    );
    assert_eq!(global["spent_usd"], global["recorded_usd"], "{report:#}");
    let holders = report["holders"].as_array().unwrap();
    assert!(
        holders
            .iter()
            .all(|h| h["whole"] == true && h["ledger_usd"] == h["recorded_usd"]),
        "{report:#}"
    );

    // A provider's export beside the records: today's m1 (as the export dates it), and a model
    // oam never called.
    let today = oam::core::date::utc_date(oam::clock::now_ms() / 1_000);
    let export = dir.0.join("usage.csv");
    std::fs::write(
        &export,
        format!("Date,Model,Cost USD\n{today},m1-2026-01-01,0.5\n{today},other,0.25\n"),
    )
    .unwrap();
    let (code, r, err) = spend(&dir.0, &["--invoice", export.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let rows = r["invoice"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{r:#}");
    assert_eq!(rows[0]["model"], "m1");
    assert!(
        (rows[0]["recorded_usd"].as_f64().unwrap() - cost).abs() < 1e-6,
        "every answer's cost under its target's model: {r:#}"
    );
    assert_eq!(rows[0]["billed_usd"], 0.5);
    assert_eq!(
        (&rows[1]["model"], &rows[1]["recorded_usd"]),
        (&json!("other"), &json!(0.0))
    );
    std::fs::write(&export, "Date,Model\n").unwrap();
    let (code, _, err) = spend(&dir.0, &["--invoice", export.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("line 1: no cost column"), "{err}");

    // Take the agent's last settlement out of its record, as a lost write would have.
    let app_url = {
        let text = std::fs::read_to_string(dir.0.join("system.json")).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        v["app_url"].as_str().unwrap().to_string()
    };
    let nc = oam::transport::connect::connect(&app_url, "test-spend", false, &Default::default())
        .await
        .unwrap();
    let kv = async_nats::jetstream::new(nc)
        .get_key_value("oam-budgets")
        .await
        .unwrap();
    let entry = kv.entry("agent.spendy").await.unwrap().unwrap();
    let mut l: oam::core::ledger::Ledger = serde_json::from_slice(&entry.value).unwrap();
    let (holder, s) = l
        .settled
        .iter_mut()
        .next()
        .expect("one node run settled here");
    let holder = holder.clone();
    s.seq -= 1;
    s.usd = oam::core::request::round_usd(s.usd - last_usd);
    l.spent_usd = oam::core::request::round_usd(l.spent_usd - last_usd);
    kv.update(
        "agent.spendy",
        serde_json::to_vec(&l).unwrap().into(),
        entry.revision,
    )
    .await
    .unwrap();

    let (code, r, _) = spend(&dir.0, &["--verify"]);
    assert_eq!(code, 0, "younger than --settling: pending, {r:#}");
    assert_eq!(r["pending"][0]["request_id"], last_id.as_str(), "{r:#}");
    let (code, r, err) = spend(&dir.0, &["--verify", "--settling", "1ms"]);
    assert_eq!(code, 1, "{r:#} {err}");
    assert_eq!(r["not_charged"].as_array().unwrap().len(), 1, "{r:#}");
    assert_eq!(r["not_charged"][0]["request_id"], last_id.as_str(), "{r:#}");
    assert_eq!(r["not_charged"][0]["budget"], "agent.spendy", "{r:#}");
    assert_eq!(r["not_charged"][0]["holder"], holder.as_str(), "{r:#}");
    assert!(err.contains(&last_id), "the fault names the request: {err}");
    // Without --verify the same report, exit 0.
    let (code, r, _) = spend(&dir.0, &["--settling", "1ms"]);
    assert_eq!(code, 0);
    assert_eq!(r["faults"].as_array().unwrap().len(), 1, "{r:#}");
}

/// A node SIGKILLed right after answering (its settlements wait half a second to be written
/// together, its records are in the log before each answer under `durable`): the ledger lacks
/// what it answered last, and `oam spend --verify` names those requests. Started again
/// (`oam mesh up` repairs the mesh), the node charges them from their records, each once.
#[tokio::test]
async fn a_killed_nodes_unsettled_answers_are_charged_when_it_starts_again() {
    let (_sim, dir, node, ids, lost) = killed_with_unsettled_answers("spend-kill").await;

    // The node again: what its last run answered is charged from the records.
    let out = assert_cmd::Command::new(assert_cmd::cargo::cargo_bin!("oam"))
        .args(["mesh", "up", "--json", "--dir"])
        .arg(&dir.0)
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let held = eventually(Duration::from_secs(20), || async {
        let (code, r, _) = spend(&dir.0, &["--verify", "--settling", "1ms"]);
        (code == 0).then_some(r)
    })
    .await;
    let Some(r) = held else {
        let (code, r, err) = spend(&dir.0, &["--verify", "--settling", "1ms"]);
        panic!("exit {code}: {r:#} {err}");
    };
    assert_eq!(r["charges"], ids.len(), "{r:#}");
    // A new client: the one above keeps a connection to the killed run.
    let metrics = crate::support::http(Duration::from_secs(10))
        .get(format!("{node}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let applied: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("oam_budget_settled_from_records_total "))
        .expect("the counter")
        .parse()
        .unwrap();
    // Each lost settlement was one per budget (agent and global).
    assert_eq!(applied as usize, 2 * lost.len(), "{metrics}");
}

/// A node killed and never started again: `oam spend --settle` charges what its run answered
/// and did not settle, from the records, each once (a second run charges nothing), and the
/// books hold after.
#[tokio::test]
async fn a_node_that_never_comes_back_is_settled_by_spend_settle() {
    let (_sim, dir, _node, ids, lost) = killed_with_unsettled_answers("spend-gone").await;
    // Once its holds lapse (the lease, 3 s) the dead run is taken for gone.
    let settle = ["--settle", "--gone-after", "1ms", "--settling", "1ms"];
    let settled = eventually(Duration::from_secs(15), || async {
        let (code, r, _) = spend(&dir.0, &settle);
        (code == 0 && r["settled"]["waiting"] == json!([])).then_some(r)
    })
    .await;
    let r = settled.expect("the dead run's holds lapsed and its answers were settled");
    let applied: std::collections::BTreeSet<&str> = r["settled"]["applied"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["request_id"].as_str().unwrap())
        .collect();
    assert_eq!(applied, lost.iter().map(String::as_str).collect(), "{r:#}");
    assert_eq!(
        r["settled"]["applied"].as_array().unwrap().len(),
        2 * lost.len(),
        "one settlement per budget (agent and global): {r:#}"
    );
    assert_eq!(r["settled"]["there_already"], 0, "{r:#}");
    assert_eq!(
        r["not_charged"],
        json!([]),
        "the report is of the books after: {r:#}"
    );

    let (code, r, err) = spend(&dir.0, &["--verify", "--settling", "1ms"]);
    assert_eq!(code, 0, "the books hold: {r:#} {err}");
    assert_eq!(r["charges"], ids.len(), "{r:#}");
    // Again: nothing is charged twice.
    let (code, r, _) = spend(&dir.0, &settle);
    assert_eq!(code, 0);
    assert_eq!(r["settled"]["applied"], json!([]), "{r:#}");
    let (code, r, _) = spend(&dir.0, &["--verify", "--settling", "1ms"]);
    assert_eq!(code, 0, "{r:#}");
}

/// A one-node mesh with a durable log, four answers charged to agent `spendy`, and the node
/// SIGKILLed before its last settlements were written: the simulator, the mesh's folder, the
/// node's URL, the answers' request ids, and those `--verify` finds answered and not charged
/// (the last among them; every answer has its record).
async fn killed_with_unsettled_answers(
    tag: &str,
) -> (
    Proc,
    ClusterDir,
    String,
    Vec<String>,
    std::collections::BTreeSet<String>,
) {
    let sim = Proc::spawn(&["sim", "--listen", "127.0.0.1:0", "--json"]);
    let sim_url = sim.ready["url"].as_str().unwrap().to_string();
    let dir = ClusterDir::new(tag);
    std::fs::create_dir_all(&dir.0).unwrap();
    let file = dir.0.join("oam.toml");
    // Holds of a killed run lapse within the lease (3 s here).
    let durable = format!(
        "[node]\nbudget_lease_ms = 3000\n{}\n[decision_log]\ndurable = true\n",
        config(&sim_url)
    );
    std::fs::write(&file, durable).unwrap();
    let up = crate::support::mesh_up_on(&dir.0, &file);
    let node = up["nodes"][0]["http"].as_str().unwrap().to_string();
    let pid = up["nodes"][0]["pid"].as_u64().unwrap() as u32;
    let c = crate::support::http(Duration::from_secs(10));
    let mut ids = Vec::new();
    for i in 0..4 {
        let r = c
            .post(format!("{node}/v1/chat/completions"))
            .json(&json!({"model": "auto", "max_tokens": 32,
                "messages": [{"role": "user", "content": format!("question {i}")}],
                "oam": {"agent": "spendy"}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let body: Value = r.json().await.unwrap();
        ids.push(body["oam"]["request_id"].as_str().unwrap().to_string());
    }
    assert!(oam::local::signal(pid, libc::SIGKILL));

    let (code, r, _) = spend(&dir.0, &["--verify", "--settling", "1ms"]);
    assert_eq!(
        code, 1,
        "the last answers' settlements died with the node: {r:#}"
    );
    let lost: std::collections::BTreeSet<String> = r["not_charged"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["request_id"].as_str().unwrap().to_string())
        .collect();
    assert!(
        lost.contains(ids.last().unwrap()) && lost.iter().all(|id| ids.contains(id)),
        "{lost:?} of {ids:?}"
    );
    assert_eq!(
        r["unrecorded"],
        json!([]),
        "every answer has its record: {r:#}"
    );
    (sim, dir, node, ids, lost)
}
