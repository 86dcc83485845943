//! `oam chaos` against a real local mesh: every fault is applied to real processes and undone on
//! time by the warden, without the `oam chaos` process staying around.

use crate::support::{LocalCluster, eventually, http, process_state};
use futures_util::StreamExt as _;
use serde_json::{Value, json};
use std::time::Duration;

fn chaos(mesh: &LocalCluster, args: &[&str]) -> Value {
    let out = mesh
        .oam()
        .arg("chaos")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "oam chaos {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().next().unwrap_or("null")).unwrap()
}

async fn get(url: &str) -> Value {
    http(Duration::from_secs(5))
        .get(url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn live_nodes(node: &str) -> Vec<String> {
    oam::local::cluster::snapshot(&http(Duration::from_secs(5)), node)
        .await
        .expect("a node state snapshot")
        .live_nodes
}

/// One request; each has its own content, so repeated refusals are not an agent loop.
async fn chat(node: &str, oam: Value) -> (u16, String) {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let content = format!("hi {n}");
    let r = http(Duration::from_secs(20))
        .post(format!("{node}/v1/chat/completions"))
        .json(&json!({"model": "auto", "messages": [{"role": "user", "content": content}], "oam": oam}))
        .send()
        .await
        .unwrap();
    let reasons = r
        .headers()
        .get("x-oam-reasons")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    (r.status().as_u16(), reasons)
}

#[tokio::test]
async fn faults_are_applied_listed_and_undone_on_time() {
    let mesh = LocalCluster::up("chaos").await;
    let nc = oam::transport::connect::connect(&mesh.app_url(), "test", false, &Default::default())
        .await
        .unwrap();
    let mut events = nc.subscribe("oam.v1.chaos.event").await.unwrap();
    nc.flush().await.unwrap();
    let sim = mesh.record.sim_url.clone();

    // A provider outage: the simulator fails, the warden lists it, and it ends by itself.
    let f = chaos(&mesh, &["kill-provider", "primary", "--for", "2s"]);
    assert_eq!(
        (f["fault"].as_str(), f["target"].as_str()),
        (Some("kill-provider"), Some("primary"))
    );
    let faults = get(&format!("{sim}/sim/faults")).await;
    assert_eq!(faults["faults"][0]["provider"], "primary", "{faults}");
    let listed = chaos(&mesh, &["list"]);
    assert_eq!(listed[0]["id"], f["id"]);
    assert!(listed[0]["left_ms"].as_u64().unwrap() > 0);
    let ev: Value = serde_json::from_slice(&events.next().await.unwrap().payload).unwrap();
    assert_eq!(
        (ev["kind"].as_str(), &ev["fault"]["id"]),
        (Some("injected"), &f["id"])
    );

    // A hung node and a killed node; the killed one is started again at the end.
    let n2 = mesh.pid("n2");
    let n3 = mesh.pid("n3");
    chaos(&mesh, &["stop-node", "n2", "--for", "1500ms"]);
    let stopped = eventually(Duration::from_secs(2), || async {
        (process_state(n2) == Some('T')).then_some(())
    })
    .await;
    assert!(stopped.is_some(), "SIGSTOPped");
    chaos(&mesh, &["kill-node", "n3", "--for", "1s"]);
    let gone = eventually(Duration::from_secs(5), || async {
        (!matches!(process_state(n3), Some('R' | 'S' | 'D'))).then_some(())
    })
    .await;
    assert!(gone.is_some(), "n3 was killed");

    // Everything ends on time, restored by the warden.
    let expired = tokio::time::timeout(Duration::from_secs(10), async {
        let mut ended = Vec::new();
        while ended.len() < 3 {
            let m = events.next().await.unwrap();
            let ev: Value = serde_json::from_slice(&m.payload).unwrap();
            if ev["kind"] == "expired" {
                ended.push(ev["fault"]["fault"].as_str().unwrap().to_string());
            }
        }
        ended
    })
    .await
    .expect("three faults expire");
    assert!(expired.contains(&"kill-node".to_string()), "{expired:?}");
    assert_ne!(process_state(n2), Some('T'), "SIGCONT at the end");
    assert_eq!(get(&format!("{sim}/sim/faults")).await["faults"], json!([]));
    // The restarted n3's answers are cluster decisions from the first one: it hears a majority
    // (heartbeats, and observations of every provider) before it serves, instead of deciding on
    // a view of one. (Requests sent while it starts wait for it; the window that matters is its
    // first second. Whether the majority it hears agrees after three faults is another matter:
    // each decision's candidates say how many nodes voted.)
    let restarted = eventually(Duration::from_secs(15), || async {
        (mesh.pid("n3") != n3).then_some(())
    })
    .await;
    assert!(restarted.is_some(), "the warden started n3 again");
    let mut decisions = nc.subscribe("oam.v1.decision.n3").await.unwrap();
    nc.flush().await.unwrap();
    let client = http(Duration::from_secs(10));
    let mut answered = Vec::new();
    let until = std::time::Instant::now() + Duration::from_millis(1_500);
    while std::time::Instant::now() < until {
        let id = format!("early-{}", answered.len());
        let sent = client
            .post(format!("{}/v1/chat/completions", mesh.node(2)))
            .header("x-request-id", &id)
            .json(&json!({"model": "auto", "messages": [{"role": "user", "content": id}]}))
            .send()
            .await;
        if let Ok(r) = sent {
            assert_eq!(r.status(), 200, "{id}");
            answered.push(id);
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(!answered.is_empty(), "n3 answered while starting");
    let mut seen = Vec::new();
    while seen.len() < answered.len() {
        let m = tokio::time::timeout(Duration::from_secs(5), decisions.next())
            .await
            .expect("n3 published the decision of every early request")
            .unwrap();
        let env: Value = serde_json::from_slice(&m.payload).unwrap();
        for d in env["body"].as_array().expect("a batch of decisions") {
            let id = d["request_id"].as_str().unwrap().to_string();
            if !answered.contains(&id) {
                continue;
            }
            for c in d["attempts"][0]["candidates"].as_array().unwrap() {
                assert!(
                    c["voters"].as_u64().unwrap() >= 2,
                    "{id} was decided on fewer than a majority's observations: {c}"
                );
            }
            seen.push(id);
        }
    }
    let back = eventually(Duration::from_secs(15), || async {
        let pid = mesh.pid("n3");
        (pid != n3 && live_nodes(&mesh.node(0)).await.len() == 3).then_some(pid)
    })
    .await;
    assert!(back.is_some(), "n3 was started again and rejoined");
    assert_eq!(chaos(&mesh, &["list"]), json!([]));
}

#[tokio::test]
async fn a_partition_cuts_a_node_off_both_ways_until_restored_early() {
    let mesh = LocalCluster::up("chaos-cut").await;
    // A partition: the others lose n1, n1 loses them; an early restore brings it back.
    let f = chaos(&mesh, &["isolate-node", "n1", "--for", "60s"]);
    let cut = eventually(Duration::from_secs(10), || async {
        let n2_sees = live_nodes(&mesh.node(1)).await;
        let n1_sees = live_nodes(&mesh.node(0)).await;
        (!n2_sees.contains(&"n1".to_string()) && n1_sees == ["n1"]).then_some(())
    })
    .await;
    assert!(cut.is_some(), "n1 is cut off both ways");
    let (status, reasons) = chat(&mesh.node(0), json!({})).await;
    assert_eq!(status, 200, "an isolated node still serves on its own view");
    assert!(reasons.contains("NO_QUORUM_LOCAL_VIEW"), "{reasons}");
    let id = f["id"].as_str().unwrap();
    let restored = mesh.oam().args(["chaos", "restore", id]).output().unwrap();
    assert!(String::from_utf8_lossy(&restored.stdout).contains(id));
    let healed = eventually(Duration::from_secs(10), || async {
        (live_nodes(&mesh.node(1)).await.len() == 3 && live_nodes(&mesh.node(0)).await.len() == 3)
            .then_some(())
    })
    .await;
    assert!(healed.is_some(), "n1 rejoined after the early restore");
}

#[tokio::test]
async fn a_drained_budget_escalates_and_operators_work_the_escalations() {
    let mesh = LocalCluster::up("chaos-budget").await;
    // A drained budget: high-risk work for that agent is refused and escalated, then allowed.
    chaos(&mesh, &["drain-budget", "support-bot", "--for", "2s"]);
    let high = json!({"agent": "support-bot", "risk": "high", "task": "refund"});
    let drained = eventually(Duration::from_secs(5), || async {
        let (status, reasons) = chat(&mesh.node(0), high.clone()).await;
        (status == 402).then_some(reasons)
    })
    .await
    .expect("refused for budget");
    assert!(drained.contains("BUDGET_EXHAUSTED"), "{drained}");
    // The escalation waits, open, in the store until somebody resolves it.
    // As the mesh folder's roles: viewer to list, operator to resolve.
    let escalations = |args: &[&str]| {
        let out = mesh
            .oam()
            .env_remove("OAM_NATS_URL")
            .arg("escalation")
            .args(args)
            .arg("--dir")
            .arg(&mesh.dir.0)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let open = eventually(Duration::from_secs(5), || async {
        let (_, out, _) = escalations(&["list", "--agent", "support-bot", "--json"]);
        let v: Vec<Value> = serde_json::from_str(&out).ok()?;
        (!v.is_empty()).then_some(v)
    })
    .await
    .expect("the refusal's escalation is listed as open");
    let first = &open[0];
    assert_eq!(first["status"], "open", "{first}");
    // The table fits an 80-column terminal; --wide keeps whole lines.
    let out = mesh
        .oam()
        .env("COLUMNS", "80")
        .args(["escalation", "list"])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        table.lines().all(|l| l.chars().count() <= 80) && table.contains("review+block"),
        "{table}"
    );
    let out = mesh
        .oam()
        .env("COLUMNS", "80")
        .args(["escalation", "list", "--wide"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("HUMAN_REVIEW_BLOCK_AUTOMATIC_ACTION"));
    assert_eq!(
        first["escalation"]["recommended_action"],
        "HUMAN_REVIEW_BLOCK_AUTOMATIC_ACTION"
    );
    assert_eq!(
        first["escalation"]["reason_codes"]
            .as_array()
            .unwrap()
            .last()
            .unwrap(),
        "ESCALATED_BUDGET_EXHAUSTED"
    );
    let id = first["escalation"]["id"].as_str().unwrap().to_string();
    // Acknowledged first: still open, and it says who is on it.
    let (code, out, err) = escalations(&["ack", &id, "--json"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["acknowledged"],
        json!([id])
    );
    let (_, out, _) = escalations(&["list", "--json"]);
    let open: Vec<Value> = serde_json::from_str(&out).unwrap();
    let acked = open
        .iter()
        .find(|r| r["escalation"]["id"] == id.as_str())
        .unwrap();
    assert_eq!(
        (acked["status"].as_str(), acked["acknowledged_by"].as_str()),
        (Some("open"), Some("operator"))
    );
    let (_, out, _) = escalations(&["ack", &id, "--json"]);
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["already"],
        json!([id])
    );
    let (code, out, err) = escalations(&[
        "resolve",
        &id,
        "--by",
        "tester",
        "--note",
        "topped up",
        "--json",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["resolved"], json!([id]));
    let (_, out, _) = escalations(&["resolve", &id, "--json"]);
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["already"],
        json!([id])
    );
    let (_, out, _) = escalations(&["list", "--all", "--json"]);
    let all: Vec<Value> = serde_json::from_str(&out).unwrap();
    let record = all
        .iter()
        .find(|r| r["escalation"]["id"] == id.as_str())
        .unwrap();
    assert_eq!(
        (
            record["status"].as_str(),
            record["resolved_by"].as_str(),
            record["note"].as_str()
        ),
        (
            Some("resolved"),
            Some("operator (tester)"),
            Some("topped up")
        )
    );
    let (code, _, err) = escalations(&["resolve", "esc-never-raised"]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("no escalation esc-never-raised") && err.contains("oam escalation list --all"),
        "{err}"
    );
    let (code, _, err) = escalations(&["resolve"]);
    assert_eq!(code, Some(2), "resolve needs ids, --agent or --all: {err}");
    let last = std::sync::Mutex::new(String::new());
    let refilled = eventually(Duration::from_secs(8), || async {
        let (status, reasons) = chat(&mesh.node(0), high.clone()).await;
        *last.lock().unwrap() = format!("{status} {reasons}");
        (status == 200).then_some(())
    })
    .await;
    assert!(
        refilled.is_some(),
        "the budget is back after the fault; last answer: {}",
        last.lock().unwrap()
    );
    // Every open one of an agent at once. (A refusal's escalation is recorded just after its
    // answer, so one raised at the very end of the drain may land after a first sweep.)
    let last = std::sync::Mutex::new(String::new());
    let cleared = eventually(Duration::from_secs(10), || async {
        let (code, out, err) = escalations(&["resolve", "--agent", "support-bot", "--json"]);
        assert_eq!(code, Some(0), "{err}");
        let (_, left, _) = escalations(&["list", "--agent", "support-bot", "--json"]);
        *last.lock().unwrap() = format!("resolved {out}, left {left}");
        (serde_json::from_str::<Value>(&left).ok()? == json!([])).then_some(())
    })
    .await;
    assert!(cleared.is_some(), "{}", last.lock().unwrap());
}

#[tokio::test]
async fn a_killed_node_whose_port_was_taken_comes_back_on_a_free_one() {
    let mesh = LocalCluster::up("chaos-port").await;
    // A killed node whose address was taken meanwhile comes back on a free port, recorded.
    let (n2, n2_url) = (mesh.pid("n2"), mesh.endpoint("n2"));
    let port: u16 = n2_url.rsplit(':').next().unwrap().parse().unwrap();
    chaos(&mesh, &["kill-node", "n2", "--for", "1s"]);
    let squatter = eventually(Duration::from_secs(5), || async {
        std::net::TcpListener::bind(("127.0.0.1", port)).ok()
    })
    .await
    .expect("the killed node's port is free");
    let moved = eventually(Duration::from_secs(20), || async {
        let url = mesh.endpoint("n2");
        (mesh.pid("n2") != n2 && url != n2_url && live_nodes(&mesh.node(0)).await.len() == 3)
            .then_some(url)
    })
    .await;
    drop(squatter);
    let moved = moved.expect("n2 started again on another port and rejoined");
    let answers = eventually(Duration::from_secs(10), || async {
        (live_nodes(&moved).await.len() == 3).then_some(())
    })
    .await;
    assert!(
        answers.is_some(),
        "the recorded endpoint {moved} is the node, and it sees all"
    );
}

#[tokio::test]
async fn load_faults_agents_and_bad_input() {
    let mesh = LocalCluster::up("chaos-load").await;

    // Unknown faults and targets: exit 2 with the valid ones.
    let out = mesh.oam().args(["chaos", "melt-cpu"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("kill-provider, break-contract"));
    let out = mesh
        .oam()
        .args(["chaos", "kill-node", "n9", "--for", "1s"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("n1, n2, n3"));
    let out = mesh
        .oam()
        .args(["chaos", "kill-provider", "primary", "--for", "soon"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));

    // An agent process killed, and started again by the warden at the end.
    let url = mesh.app_url();
    let _agent = crate::support::Proc::spawn(&[
        "agent",
        "serve",
        "demo.work",
        "--demo",
        "echo",
        "--json",
        "--nats-url",
        &url,
    ]);
    chaos(&mesh, &["kill-agent", "demo.work", "--for", "1s"]);
    let call = |payload: &'static str| {
        let out = mesh
            .oam()
            .args(["agent", "call", "demo.work", payload, "--timeout", "2"])
            .output()
            .unwrap();
        out.status.success()
    };
    let down = eventually(Duration::from_secs(5), || async {
        (!call("{}")).then_some(())
    })
    .await;
    assert!(down.is_some(), "the agent is gone");
    let up = eventually(Duration::from_secs(15), || async {
        call("{}").then_some(())
    })
    .await;
    assert!(up.is_some(), "the agent is back");

    // A loop: one detection, one escalation, then identical calls refused fast.
    chaos(&mesh, &["agent-loop", "--for", "3s", "--requests", "6"]);
    // A spike of background work, sized by default from the nodes' limits: some of it shed.
    chaos(&mesh, &["traffic-spike", "--for", "3s"]);
    let settled = eventually(Duration::from_secs(15), || async {
        (chaos(&mesh, &["list"]) == json!([])).then_some(())
    })
    .await;
    assert!(settled.is_some(), "both load faults end by themselves");
    let mut counts = std::collections::BTreeMap::<String, f64>::new();
    for i in 0..3 {
        for (code, n) in crate::support::reason_counts(&mesh.node(i)).await {
            *counts.entry(code).or_default() += n;
        }
    }
    // Detected by the decision of a node whose own failure completed its count (two may, when
    // the spike delays the nodes' loop events), or raised by a node that counted another's
    // (when none did): either way one escalation for the cluster, and identical calls refused.
    let count = |code: &str| counts.get(code).copied().unwrap_or(0.0);
    assert!(count("RUNAWAY_RETRY_STOPPED") > 0.0, "{counts:?}");
    assert!(count("BULKHEAD_SHED") > 0.0, "{counts:?}");
    let loop_escalations = || {
        let out = mesh
            .oam()
            .env_remove("OAM_NATS_URL")
            .args([
                "escalation",
                "list",
                "--agent",
                "loop-bot",
                "--json",
                "--dir",
            ])
            .arg(&mesh.dir.0)
            .output()
            .unwrap();
        let all: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
        all.into_iter()
            .filter(|e| {
                e["escalation"]["reason_codes"]
                    .as_array()
                    .and_then(|c| c.last())
                    == Some(&json!("ESCALATED_AGENT_LOOP"))
            })
            .collect::<Vec<_>>()
    };
    let raised = eventually(Duration::from_secs(5), || async {
        let v = loop_escalations();
        (!v.is_empty()).then_some(v)
    })
    .await
    .expect("the loop is escalated");
    assert_eq!(raised.len(), 1, "{raised:?}");
}

/// A record in the escalation store is never overwritten: recording an escalation whose id is
/// already there (resolved, say) fails and leaves the record as it was.
#[tokio::test]
async fn an_escalation_record_is_never_overwritten() {
    use oam::transport::store::escalations;
    let server = crate::support::NatsServer::start().await;
    let nc = oam::transport::connect::connect(&server.url(), "test", false, &Default::default())
        .await
        .unwrap();
    let store = escalations::store(&nc).await.unwrap();
    let now = oam::clock::now_ms();
    let first: oam::core::escalation::Escalation = serde_json::from_value(json!({
        "id": "esc-n1-1-0", "request_id": "r-1", "agent": "bot", "task": "t",
        "phase": "budget", "reason_codes": ["ESCALATED_BUDGET_EXHAUSTED"],
        "recommended_action": "HUMAN_REVIEW", "created_at_ms": now
    }))
    .unwrap();
    assert!(escalations::open(&store, "n1", &first).await.unwrap());
    let resolved = escalations::resolve(&store, "esc-n1-1-0", "tester", Some("done"), now)
        .await
        .unwrap();
    assert!(matches!(resolved, escalations::Resolved::Now(_)));
    let mut again = first.clone();
    again.agent = "intruder".into();
    // Another node's record of the same id (one episode's escalation): there already, not
    // written again.
    assert!(!escalations::open(&store, "n2", &again).await.unwrap());
    let all = escalations::all(&store).await.unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].escalation.agent, "bot");
    assert_eq!(all[0].status, escalations::Status::Resolved);

    // Something that is not a record is reported, not hidden.
    store.put("junk", "not a record".into()).await.unwrap();
    let out = assert_cmd::Command::new(assert_cmd::cargo::cargo_bin!("oam"))
        .args(["escalation", "list", "--all", "--nats-url", &server.url()])
        .timeout(Duration::from_secs(20))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("1 entries of oam-escalations are not escalation records")
            && stderr.contains("junk"),
        "{stderr}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("esc-n1-1-0"));
}

/// Chaos the warden did not send, or would not: a forged instance record naming any process
/// does not get that process signalled (only `oam agent serve AGENT` of this very oam is), and a
/// node fault lasting forever published straight to a node is refused and counted.
#[tokio::test]
async fn forged_chaos_signals_nothing_and_cannot_last_forever() {
    let mesh = LocalCluster::up("chaos-forged").await;
    let nc =
        oam::transport::connect::connect(&mesh.app_url(), "attacker", false, &Default::default())
            .await
            .unwrap();
    // The victim: any process of this user.
    let mut victim = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let store = oam::transport::store::bucket(
        &nc,
        oam::transport::subjects::INSTANCES_BUCKET,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let record = json!({"instance_id": "forged1", "agents": ["victim.x"],
        "connection": "oam-host-forged1", "renewed_at_ms": oam::clock::now_ms(),
        "pid": victim.id(), "host": oam::mesh::store::hostname()});
    store
        .put("forged1", record.to_string().into())
        .await
        .unwrap();
    let out = mesh
        .oam()
        .args(["chaos", "kill-agent", "victim.x", "--for", "5s"])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    for sig in ["stop-agent", "kill-agent"] {
        let _ = mesh
            .oam()
            .args(["chaos", sig, "victim.x", "--for", "5s"])
            .output()
            .unwrap();
    }
    assert!(
        matches!(process_state(victim.id()), Some('S' | 'R')),
        "the victim was signalled: {:?}",
        process_state(victim.id())
    );
    let _ = victim.kill();
    let _ = victim.wait();

    // A partition "until the end of time", straight to n1.
    let forever = oam::core::chaos::NodeCommand::Isolate {
        id: "forever".into(),
        until_ms: u64::MAX,
        key: String::new(),
    };
    nc.publish(
        oam::transport::subjects::chaos_node("n1"),
        serde_json::to_vec(&forever).unwrap().into(),
    )
    .await
    .unwrap();
    nc.flush().await.unwrap();
    let c = http(Duration::from_secs(5));
    let counted = eventually(Duration::from_secs(10), || async {
        let s = oam::local::cluster::snapshot(&c, &mesh.node(0)).await?;
        (s.bus.forged >= 1).then_some(s)
    })
    .await
    .expect("the command was refused and counted");
    assert_eq!(counted.live_nodes.len(), 3, "{counted:?}");
    // For longer than a heartbeat lives (3 s), n2 goes on hearing n1: it was never cut off.
    let until = std::time::Instant::now() + Duration::from_secs(4);
    while std::time::Instant::now() < until {
        let s = oam::local::cluster::snapshot(&c, &mesh.node(1))
            .await
            .unwrap();
        assert!(s.live_nodes.iter().any(|n| n == "n1"), "n1 cut off: {s:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
