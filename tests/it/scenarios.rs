//! Every shipped scenario, in its short form, on a fresh local mesh: `oam bench --scenario`
//! must exit 0, i.e. every expectation of the failure model holds.

use crate::support::LocalCluster;

async fn run(name: &str) {
    let mesh = LocalCluster::up(&format!("scenario-{name}")).await;
    let file = format!("{}/scenarios/{name}.toml", env!("CARGO_MANIFEST_DIR"));
    let json = mesh.dir.0.join("result.json");
    let out = mesh
        .oam()
        .args(["bench", "--scenario", &file, "--short", "--output"])
        .arg(&json)
        .arg("--dir")
        .arg(&mesh.dir.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scenario {name} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let result: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(result["passed"], true);
    assert_eq!(result["short"], true);
    assert!(result["summary"]["sent"].as_u64().unwrap() > 0);
    let verdicts = result["verdicts"].as_array().unwrap();
    assert!(!verdicts.is_empty() && verdicts.iter().all(|v| v["ok"] == true));
    // Every decision of the run is in the decision log and replays to itself, byte for byte.
    let out = mesh
        .oam()
        .args([
            "audit", "--verify", "--json", "--since", "10m", "--limit", "1000000",
        ])
        .arg("--dir")
        .arg(&mesh.dir.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scenario {name}: records that do not replay:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    // (Agent calls go to agents on the mesh, not through the nodes' pipeline.)
    let through_nodes = !std::fs::read_to_string(&file)
        .unwrap()
        .contains("kind = \"agent\"");
    assert_eq!(
        rows.is_empty(),
        !through_nodes,
        "scenario {name}: {} records in the decision log",
        rows.len()
    );
}

macro_rules! scenarios {
    ($($test:ident => $file:literal),* $(,)?) => {
        $(#[tokio::test]
        async fn $test() {
            run($file).await;
        })*
    };
}

scenarios! {
    baseline => "baseline",
    provider_outage => "provider-outage",
    outage_fallback => "outage-fallback",
    broken_contract => "broken-contract",
    latency_spike => "latency-spike",
    node_death => "node-death",
    node_partition => "node-partition",
    agent_loop => "agent-loop",
    traffic_spike => "traffic-spike",
    budget_exhausted => "budget-exhausted",
    shared_budget => "shared-budget",
    agent_death => "agent-death",
    every_api => "every-api",
    rate_limit => "rate-limit",
    stream_cut => "stream-cut",
    stream_stall => "stream-stall",
    tool_outage => "tool-outage",
}

#[test]
fn broken_scenario_files_and_a_missing_mesh_are_refused_clearly() {
    let dir = std::env::temp_dir().join(format!("oam-test-bad-scenario-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    let oam = || {
        let mut c = assert_cmd::Command::new(assert_cmd::cargo::cargo_bin!("oam"));
        c.timeout(std::time::Duration::from_secs(30));
        c
    };
    let cases = [
        (
            "name = \"x\"\n[load]\nrate = 5\nduration = \"2s\"\nconcurency = 3\n",
            "concurency",
        ),
        (
            "name = \"x\"\n[load]\nrate = 5\nduration = \"2s\"\n[[chaos]]\nat = \"1s\"\nfault = \"melt\"\nfor = \"1s\"\n",
            "melt",
        ),
        (
            "name = \"x\"\n[load]\nrate = 5\nduration = \"2s\"\n[[expect]]\nmetric = \"success_rate\"\n",
            "needs min or max",
        ),
        (
            "name = \"x\"\n[load]\nrate = 5\nduration = \"2s\"\n[[expect]]\nmetric = \"reason_count\"\ncode = \"NOT_A_CODE\"\nmin = 1\n",
            "not a reason code",
        ),
        (
            "name = \"x\"\n[load]\nrate = 5\nduration = \"2s\"\n[[expect]]\nmetric = \"phase_count\"\nphase = \"nowhere\"\nmin = 1\n",
            "nowhere",
        ),
        ("name = \"x\"\n[load\n", "bad.toml"),
    ];
    for (text, says) in cases {
        std::fs::write(&bad, text).unwrap();
        let out = oam()
            .args(["bench", "--scenario"])
            .arg(&bad)
            .arg("--dir")
            .arg(&dir)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(says), "{says:?} not in {err}");
    }
    // A good scenario with no mesh to run it on: exit 3 and what to do.
    let file = format!("{}/scenarios/baseline.toml", env!("CARGO_MANIFEST_DIR"));
    let out = oam()
        .args(["bench", "--scenario", &file, "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("oam mesh up"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_demo_plays_a_scenario_and_leaves_nothing_running() {
    let out = assert_cmd::Command::new(assert_cmd::cargo::cargo_bin!("oam"))
        .timeout(std::time::Duration::from_secs(120))
        .args(["demo", "--only", "provider-outage"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("✓ provider-outage"), "{stdout}");
    assert!(
        stdout.contains("FALLBACK_USED"),
        "the summary shows reason codes: {stdout}"
    );
    assert!(stdout.contains("1 of 1 scenarios hold"), "{stdout}");
    // Its mesh is gone: no process of ours still names a demo folder.
    let leftover = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains("oam-demo-") && !c.contains("demo --only"))
        .count();
    assert_eq!(leftover, 0, "the demo's mesh is down");
}
