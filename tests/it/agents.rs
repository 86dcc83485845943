//! The agent mesh with real processes: demo agents served by `oam agent serve`, calls by name,
//! the catalog, graceful exits, and interop with the Open Agent Mesh Python SDK.

use crate::support::{AckLoser, NatsServer, Proc, beat_of, next_json, python};
use assert_cmd::Command;
use futures_util::StreamExt as _;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

fn oam(nats: &str) -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin!("oam"));
    c.timeout(Duration::from_secs(30)).env("OAM_NATS_URL", nats);
    c
}

pub(crate) fn serve(nats: &str, name: &str, demo: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "agent",
        "serve",
        name,
        "--demo",
        demo,
        "--json",
        "--nats-url",
        nats,
    ];
    args.extend_from_slice(extra);
    Proc::spawn(&args)
}

fn call(nats: &str, name: &str, payload: &str, timeout: &str) -> (bool, String, String) {
    let out = oam(nats)
        .args(["agent", "call", name, payload, "--timeout", timeout])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    )
}

#[tokio::test]
async fn serve_call_list_fail_hang_and_leave() {
    let server = NatsServer::start().await;
    let url = server.url();
    let mut echo = serve(&url, "demo.echo", "echo", &["--replicas", "2"]);
    assert_eq!(echo.ready["instances"].as_array().unwrap().len(), 2);
    let _fail = serve(&url, "demo.fail", "fail", &[]);
    let _hang = serve(&url, "demo.hang", "hang", &[]);

    // Registration is eager: listed as soon as `serve` said it is ready.
    let list = oam(&url)
        .args(["agent", "list", "--json"])
        .output()
        .unwrap();
    let listed = serde_json::from_slice::<Vec<Value>>(&list.stdout).unwrap();
    let names: Vec<String> = listed
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_string())
        .collect();
    for n in ["demo.echo", "demo.fail", "demo.hang"] {
        assert!(names.contains(&n.to_string()), "{names:?}");
    }
    // And what is behind each entry: both echo replicas alive, beating just now.
    let echo_entry = listed.iter().find(|e| e["name"] == "demo.echo").unwrap();
    assert_eq!(echo_entry["instances_alive"], 2, "{echo_entry}");
    assert!(echo_entry["last_heartbeat_ms_ago"].as_u64().unwrap() < 3_000);
    // The table says the same, fitted to an 80-column terminal.
    let table = oam(&url)
        .env("COLUMNS", "80")
        .args(["agent", "list"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.lines().all(|l| l.chars().count() <= 80), "{text}");
    let echo_row = text.lines().find(|l| l.contains("demo.echo")).unwrap();
    assert!(
        echo_row.split('┆').nth(3).is_some_and(|c| c.trim() == "2"),
        "two alive: {text}"
    );

    let (ok, out, err) = call(&url, "demo.echo", r#"{"message": "hi"}"#, "5");
    assert!(ok, "{err}");
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap(),
        json!({"message": "hi"})
    );

    let (ok, _, err) = call(&url, "demo.fail", "{}", "5");
    assert!(!ok && err.contains("handler_error"), "{err}");
    let (ok, _, err) = call(&url, "nobody.here", "{}", "5");
    assert!(!ok && err.contains("not_found"), "{err}");
    let started = Instant::now();
    let (ok, _, err) = call(&url, "demo.hang", "{}", "0.3");
    assert!(!ok && err.contains("timeout"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let (ok, _, err) = call(&url, "demo.echo", "not json", "5");
    assert!(!ok && err.contains("not JSON"), "{err}");

    // A graceful exit: the host drains, deregisters, and as the last instance says so.
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    let mut deaths = nc.subscribe("mesh.death.>").await.unwrap();
    nc.flush().await.unwrap();
    std::process::Command::new("kill")
        .arg(echo.pid().to_string())
        .status()
        .unwrap();
    let notice = tokio::time::timeout(Duration::from_secs(10), deaths.next())
        .await
        .expect("a death notice")
        .unwrap();
    let notice: Value = serde_json::from_slice(&notice.payload).unwrap();
    assert_eq!(notice["agent"], "demo.echo");
    assert_eq!(notice["reason"], "graceful_shutdown");
    assert!(notice["detected_at"].as_str().unwrap().ends_with("+00:00"));
    echo.wait();
    let list = oam(&url)
        .args(["agent", "list", "--json"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&list.stdout).contains("demo.echo"),
        "the catalog forgot it"
    );
}

#[tokio::test]
async fn an_instance_handles_requests_concurrently() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _slow = serve(&url, "demo.slow", "sleep:100", &["--concurrency", "20"]);
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    let started = Instant::now();
    let calls = (0..20).map(|i| {
        let nc = nc.clone();
        async move {
            oam::mesh::client::call(
                &nc,
                "demo.slow",
                format!("{{\"i\": {i}}}").into(),
                Duration::from_secs(10),
            )
            .await
        }
    });
    let results = futures_util::future::join_all(calls).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    // One at a time this would take 20 x 100 ms; an order of magnitude less means concurrency.
    assert!(
        started.elapsed() < Duration::from_millis(1_000),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn interoperates_with_the_python_sdk() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _ours = serve(&url, "demo.echo", "echo", &[]);
    let _stream = serve(&url, "demo.stream", "stream:3:10", &[]);
    // An agent served by the Python SDK.
    let spawn_sdk_agent = || crate::support::spawn_sdk_echo(&url);
    let _monitor = monitor(&server);
    let (_nc, mut deaths, mut instance_deaths) = hearing_deaths(&url).await;
    let mut child = spawn_sdk_agent();
    let mut replica = spawn_sdk_agent();

    let list = oam(&url)
        .args(["agent", "list", "--json"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&list.stdout).contains("sdk.echo"));
    let (ok, out, err) = call(&url, "sdk.echo", r#"{"message": "hi"}"#, "10");
    assert!(ok, "{err}");
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap(),
        json!({"reply": "py:hi"})
    );

    // The SDK writes no instance records and names no connections; the monitor still sees its
    // processes die, by the subscriptions the server says they held. One replica is not the agent.
    let _ = replica.kill();
    let _ = replica.wait();
    let first = next_json(&mut instance_deaths, Duration::from_secs(10))
        .await
        .expect("an SDK instance's death");
    assert_eq!(first["reason"], "disconnect", "{first}");
    assert!(
        first["instance_id"].as_str().unwrap().starts_with("nats-"),
        "{first}"
    );
    assert!(
        next_json(&mut deaths, Duration::from_millis(500))
            .await
            .is_none(),
        "the other SDK replica still serves"
    );
    let (ok, _, err) = call(&url, "sdk.echo", r#"{"message": "again"}"#, "10");
    assert!(ok, "{err}");
    let _ = child.kill();
    let _ = child.wait();
    let notice = next_json(&mut deaths, Duration::from_secs(10))
        .await
        .expect("the SDK agent's death");
    assert_eq!(notice["agent"], "sdk.echo", "{notice}");
    assert_eq!(notice["reason"], "disconnect");
    let list = oam(&url)
        .args(["agent", "list", "--json"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&list.stdout).contains("sdk.echo"),
        "cleaned after the notice"
    );

    // The SDK calls an agent served by oam.
    let sdk_call = r#"
import asyncio, json, sys
from openagentmesh import AgentMesh

async def main():
    async with AgentMesh(sys.argv[1]) as mesh:
        print(json.dumps(await mesh.call("demo.echo", {"message": "from python"}, timeout=10.0)))
        print(json.dumps([c async for c in mesh.stream("demo.stream", {"n": 1}, timeout=10.0)]))

asyncio.run(main())
"#;
    let out = std::process::Command::new(python())
        .args(["-c", sdk_call, &url])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap());
    assert_eq!(lines.next(), Some(json!({"message": "from python"})));
    let chunks = lines.next().expect("the SDK's stream");
    assert_eq!(chunks.as_array().map(Vec::len), Some(3), "{chunks}");
    assert_eq!(chunks[2], json!({"index": 2, "of": 3, "input": {"n": 1}}));
}

/// A connection to `url` subscribed (at the server) to agent deaths and to instance deaths.
async fn hearing_deaths(
    url: &str,
) -> (
    async_nats::Client,
    async_nats::Subscriber,
    async_nats::Subscriber,
) {
    let nc = oam::transport::connect::connect(url, "test", false, &Default::default())
        .await
        .unwrap();
    let deaths = nc.subscribe("mesh.death.>").await.unwrap();
    let instance_deaths = nc.subscribe("mesh.instance-death.*").await.unwrap();
    nc.flush().await.unwrap();
    (nc, deaths, instance_deaths)
}

/// A monitor beside a fresh server, with both accounts.
pub(crate) fn monitor(server: &NatsServer) -> Proc {
    let sys =
        oam::local::natsd::sys_url(&oam::local::natsd::loopback(&[server.port]), &server.creds);
    Proc::spawn(&[
        "mesh",
        "monitor",
        "--json",
        "--nats-url",
        &server.url(),
        "--sys-url",
        &sys,
    ])
}

/// A tombstone claim whose acknowledgement is lost (the claim is written, the monitor never
/// hears so) is read back as the monitor's own: the death is announced, once, not taken as
/// announced by someone else.
#[tokio::test]
async fn a_claim_whose_acknowledgement_is_lost_is_still_announced_once() {
    let server = NatsServer::start().await;
    let url = server.url();
    let loser = AckLoser::start(server.port, "$KV.mesh-tombstones.");
    let through =
        oam::local::natsd::app_url(&oam::local::natsd::loopback(&[loser.port]), &server.creds);
    let sys =
        oam::local::natsd::sys_url(&oam::local::natsd::loopback(&[server.port]), &server.creds);
    let _monitor = Proc::spawn(&[
        "mesh",
        "monitor",
        "--json",
        "--nats-url",
        &through,
        "--sys-url",
        &sys,
    ]);
    let (_nc, mut deaths, mut instance_deaths) = hearing_deaths(&url).await;
    let mut victim = serve(&url, "demo.victim", "echo", &[]);
    let instance = victim.ready["instances"][0].clone();
    victim.kill();

    let notice = next_json(&mut deaths, Duration::from_secs(10))
        .await
        .expect("the death is announced though its claim's acknowledgement was lost");
    assert_eq!(notice["agent"], "demo.victim", "{notice}");
    assert_eq!(notice["instance_id"], instance, "{notice}");
    let told = next_json(&mut instance_deaths, Duration::from_secs(2))
        .await
        .expect("the instance's death");
    assert_eq!(told["instance_id"], instance, "{told}");
    for (what, sub) in [("agent", &mut deaths), ("instance", &mut instance_deaths)] {
        assert!(
            next_json(sub, Duration::from_millis(1_500)).await.is_none(),
            "the {what} death is announced once"
        );
    }
    // Both claims were written, and neither acknowledgement reached the monitor.
    let lost = loser.lost();
    let id = instance.as_str().unwrap();
    for key in [format!("{id}.demo.victim"), "dead.demo.victim".to_string()] {
        assert!(
            lost.contains(&format!("$KV.mesh-tombstones.{key}")),
            "{key}'s acknowledgement lost: {lost:?}"
        );
    }
}

/// A monitor that does not run for longer than the heartbeat bound (SIGSTOPped 3.6 s, as a
/// paused VM or a starved host) wakes to beats still unread in its socket: it reads them
/// before judging silence, so it announces no living agent dead, and it still announces a
/// real death after.
#[tokio::test]
async fn a_monitor_paused_past_the_bound_wakes_without_a_false_notice() {
    let server = NatsServer::start().await;
    let url = server.url();
    let paused = monitor(&server);
    let (nc, mut deaths, _instance_deaths) = hearing_deaths(&url).await;
    let mut agent = serve(&url, "demo.alive", "echo", &[]);
    beat_of(&nc, "demo.alive", |_| true).await;
    // Which the woken monitor meets first, its sweep or its connection's reading, is the
    // runtime's choice: twice.
    let mut woke = Instant::now();
    for pause in 1..=2 {
        assert!(oam::local::signal(paused.pid(), libc::SIGSTOP));
        tokio::time::sleep(Duration::from_millis(3_600)).await;
        assert!(oam::local::signal(paused.pid(), libc::SIGCONT));
        woke = Instant::now();
        let told = next_json(&mut deaths, Duration::from_millis(1_500)).await;
        assert!(
            told.is_none(),
            "a living agent announced dead by a monitor that woke from pause {pause}: {told:?}"
        );
    }
    agent.kill();
    let notice = next_json(&mut deaths, Duration::from_secs(10))
        .await
        .expect("the woken monitor announces a real death");
    assert_eq!(notice["agent"], "demo.alive", "{notice}");
    assert!(
        woke.elapsed() < Duration::from_secs(8),
        "{:?}",
        woke.elapsed()
    );
}

#[tokio::test]
async fn the_monitor_turns_kills_and_freezes_into_death_notices_once() {
    let server = NatsServer::start().await;
    let url = server.url();
    // Two monitors: each death must still be announced once.
    let _m1 = monitor(&server);
    let _m2 = monitor(&server);
    let (nc, mut deaths, mut instance_deaths) = hearing_deaths(&url).await;

    // Two replicas in two processes: the first SIGKILL is a replica's death, not the agent's.
    let mut a = serve(&url, "demo.pair", "echo", &[]);
    let mut b = serve(&url, "demo.pair", "echo", &[]);
    a.kill();
    let first = next_json(&mut instance_deaths, Duration::from_secs(10))
        .await
        .expect("instance death");
    assert_eq!(first["instance_id"], a.ready["instances"][0]);
    assert_eq!(first["reason"], "disconnect");
    assert!(
        next_json(&mut deaths, Duration::from_millis(500))
            .await
            .is_none(),
        "a replica still lives"
    );
    let (ok, _, err) = call(&url, "demo.pair", "{}", "5");
    assert!(ok, "the surviving replica serves: {err}");

    b.kill();
    let notice = next_json(&mut deaths, Duration::from_secs(10))
        .await
        .expect("the agent's death");
    assert_eq!(notice["agent"], "demo.pair");
    assert_eq!(notice["reason"], "disconnect");
    assert_eq!(notice["instance_id"], b.ready["instances"][0]);
    assert!(
        notice["detail"].as_str().is_some(),
        "the server's reason is kept: {notice}"
    );
    assert!(
        next_json(&mut deaths, Duration::from_millis(700))
            .await
            .is_none(),
        "announced once, not per monitor"
    );
    let list = oam(&url)
        .args(["agent", "list", "--json"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&list.stdout).contains("demo.pair"),
        "cleaned after the notice"
    );

    // A frozen process keeps its connection but stops heartbeating: dead in seconds.
    let frozen = serve(&url, "demo.frozen", "echo", &[]);
    beat_of(&nc, "demo.frozen", |_| true).await; // the monitors heard it beat
    std::process::Command::new("kill")
        .args(["-STOP", &frozen.pid().to_string()])
        .status()
        .unwrap();
    let started = Instant::now();
    let notice = next_json(&mut deaths, Duration::from_secs(10))
        .await
        .expect("a frozen agent is declared dead");
    std::process::Command::new("kill")
        .args(["-CONT", &frozen.pid().to_string()])
        .status()
        .unwrap();
    assert_eq!(notice["agent"], "demo.frozen");
    assert_eq!(notice["reason"], "missed_heartbeats");
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
    drop(frozen);

    // Garbage on the advisory and health subjects does not bring the monitors down.
    nc.publish("mesh.health.x", "not json".into())
        .await
        .unwrap();
    nc.flush().await.unwrap();
    let _c = serve(&url, "demo.after", "echo", &[]);
    let (ok, _, err) = call(&url, "demo.after", "{}", "5");
    assert!(ok, "{err}");
}

#[tokio::test]
async fn a_caller_fails_fast_when_the_replica_holding_its_request_dies() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _monitor = monitor(&server);
    let mut holder = serve(&url, "demo.hold", "sleep:20000", &[]);
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    let caller = std::sync::Arc::new(oam::mesh::client::Caller::new(nc.clone()).await.unwrap());
    let c = caller.clone();
    let pending = tokio::spawn(async move {
        c.call("demo.hold", "{}".into(), Duration::from_secs(30))
            .await
    });
    // The only replica has it now: it says so in its heartbeat.
    beat_of(&nc, "demo.hold", |b| b["in_flight"].as_u64() >= Some(1)).await;
    // Another replica comes up: the agent as a whole stays alive.
    let _other = serve(&url, "demo.hold", "sleep:20000", &[]);
    let killed = Instant::now();
    holder.kill();
    let result = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .expect("the call ended")
        .unwrap();
    let waited = killed.elapsed();
    let err = result.expect_err("the request died with its instance");
    assert_eq!(err.code, oam::mesh::protocol::ErrorCode::AgentDied, "{err}");
    assert_eq!(err.details["instance_id"], holder.ready["instances"][0]);
    // Milliseconds, not the 30 s timeout (an order-of-magnitude check, not a benchmark).
    assert!(waited < Duration::from_secs(2), "{waited:?}");
    assert_eq!(caller.waiting(), 0, "an ended call is forgotten");

    // A caller that stops waiting (its future dropped, as a client that gives up drops it)
    // leaves nothing behind in a caller that lives on (a node's).
    let _hung = serve(&url, "demo.hung", "hang", &[]);
    let gave_up = tokio::time::timeout(
        Duration::from_millis(500),
        caller.call("demo.hung", "{}".into(), Duration::from_secs(30)),
    )
    .await;
    assert!(gave_up.is_err(), "the hung agent answered");
    assert_eq!(caller.waiting(), 0, "a call given up is forgotten");
}

/// One agent floods the monitor with heartbeats of 5,000 made-up instances on its own subject
/// (0.04 s of work; once they go silent the monitor announced them all at ~65/s, and a real
/// death waited 45 s behind them). While the flood's instances are being announced, another
/// agent is SIGKILLed holding a call: its death is announced within 1 s and its caller fails
/// fast, and no more of the flood is announced than the instances one agent may have.
#[tokio::test]
async fn a_heartbeat_flood_from_one_agent_delays_no_other_death() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _monitor = monitor(&server);
    let mut victim = serve(&url, "demo.victim", "sleep:20000", &[]);
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    let mut deaths = nc.subscribe("mesh.death.>").await.unwrap();
    let mut instance_deaths = nc.subscribe("mesh.instance-death.*").await.unwrap();
    nc.flush().await.unwrap();
    let caller = std::sync::Arc::new(oam::mesh::client::Caller::new(nc.clone()).await.unwrap());
    let c = caller.clone();
    let pending = tokio::spawn(async move {
        c.call("demo.victim", "{}".into(), Duration::from_secs(30))
            .await
    });
    beat_of(&nc, "demo.victim", |b| b["in_flight"].as_u64() >= Some(1)).await;
    for i in 0..5_000 {
        let beat = json!({"agent": "demo.flood", "instance_id": format!("flood{i:05}"),
            "in_flight": 0, "processed": 0, "at_ms": 0});
        nc.publish("mesh.health.demo.flood", beat.to_string().into())
            .await
            .unwrap();
    }
    nc.flush().await.unwrap();
    // The flood's instances never beat again: the monitor is announcing them now.
    let first = next_json(&mut instance_deaths, Duration::from_secs(15))
        .await
        .expect("the flood's instances are announced dead");
    assert_eq!(first["agent"], "demo.flood", "{first}");
    let killed = Instant::now();
    victim.kill();
    let notice = loop {
        let n = next_json(&mut deaths, Duration::from_secs(60))
            .await
            .expect("the victim's death is announced");
        if n["agent"] == "demo.victim" {
            break n;
        }
    };
    let announced = killed.elapsed();
    assert_eq!(notice["reason"], "disconnect", "{notice}");
    let err = tokio::time::timeout(Duration::from_secs(30), pending)
        .await
        .expect("the call ended")
        .unwrap()
        .expect_err("the call died with its agent");
    let failed = killed.elapsed();
    assert_eq!(err.code, oam::mesh::protocol::ErrorCode::AgentDied, "{err}");
    // Orders of magnitude, not benchmarks: milliseconds, where the flood made it 45 s.
    assert!(
        announced < Duration::from_secs(1),
        "announced after {announced:?}"
    );
    assert!(failed < Duration::from_secs(1), "failed after {failed:?}");
    // Of the flood, only the instances one agent may have were announced (counted until the
    // notices stop for 2 s: a late one is missed, never one too many).
    let mut flooded = 1;
    while let Some(n) = next_json(&mut instance_deaths, Duration::from_secs(2)).await {
        flooded += usize::from(n["agent"] == "demo.flood");
    }
    let most = oam::mesh::monitor::MAX_INSTANCES_PER_AGENT;
    assert!(
        flooded <= most,
        "{flooded} of the flood's instances announced"
    );
}

#[tokio::test]
async fn stale_records_heal_and_a_restarted_monitor_still_announces_once() {
    let server = NatsServer::start().await;
    let url = server.url();
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    let mut deaths = nc.subscribe("mesh.death.>").await.unwrap();
    nc.flush().await.unwrap();

    // A record left behind while no monitor ran: an instance that registered and vanished.
    let ghost = oam::mesh::protocol::CatalogEntry {
        name: "demo.ghost".into(),
        description: "left behind".into(),
        version: "0.1.0".into(),
        tags: vec![],
        invocable: true,
        streaming: false,
        max_handling_ms: None,
    };
    oam::mesh::store::register(
        &oam::mesh::store::Mesh::new(nc.clone()),
        &ghost,
        "deadbeef00000001",
    )
    .await
    .unwrap();
    let mut first = monitor(&server);
    let notice = next_json(&mut deaths, Duration::from_secs(10))
        .await
        .expect("the ghost is declared dead");
    assert_eq!(notice["agent"], "demo.ghost");
    assert_eq!(notice["reason"], "missed_heartbeats");
    let list = oam(&url)
        .args(["agent", "list", "--json"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&list.stdout).contains("demo.ghost"));

    // The monitor restarts while an agent lives; the agent's later death is announced once.
    let mut agent = serve(&url, "demo.live", "echo", &[]);
    first.kill();
    let _second = monitor(&server);
    beat_of(&nc, "demo.live", |_| true).await; // the new monitor heard it beat
    agent.kill();
    let notice = next_json(&mut deaths, Duration::from_secs(10))
        .await
        .expect("announced by the new monitor");
    assert_eq!(notice["agent"], "demo.live");
    assert!(
        next_json(&mut deaths, Duration::from_millis(800))
            .await
            .is_none(),
        "once"
    );

    // Malformed advisories on the system account do not stop it.
    let sys = oam::transport::connect::connect(
        &oam::local::natsd::sys_url(&oam::local::natsd::loopback(&[server.port]), &server.creds),
        "test-sys",
        false,
        &Default::default(),
    )
    .await
    .unwrap();
    // A second system-account subscriber proves the server delivers the garbage to subscribers
    // of the advisory subject (the monitor is one), so this exercises the parse-failure path.
    let mut witness = sys.subscribe("$SYS.ACCOUNT.*.DISCONNECT").await.unwrap();
    sys.flush().await.unwrap();
    sys.publish("$SYS.ACCOUNT.APP.DISCONNECT", "garbage".into())
        .await
        .unwrap();
    sys.publish("$SYS.ACCOUNT.APP.DISCONNECT", r#"{"client": 7}"#.into())
        .await
        .unwrap();
    sys.flush().await.unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(5), witness.next())
        .await
        .expect("the server delivers it")
        .unwrap();
    assert_eq!(&seen.payload[..], b"garbage");
    let mut again = serve(&url, "demo.after", "echo", &[]);
    again.kill();
    let notice = next_json(&mut deaths, Duration::from_secs(10))
        .await
        .expect("still announcing");
    assert_eq!(notice["agent"], "demo.after");
}

#[tokio::test]
async fn hosts_reconnect_and_register_again_after_a_blip() {
    let server = NatsServer::start().await;
    let (port, creds, url) = (server.port, server.creds.clone(), server.url());
    let _agent = serve(&url, "demo.blip", "echo", &[]);
    let (ok, _, err) = call(&url, "demo.blip", "{}", "5");
    assert!(ok, "{err}");

    // The server goes away and a new one (with empty JetStream state) takes its place.
    drop(server);
    let _server = NatsServer::start_on(port, creds).await.unwrap();
    let back = crate::support::eventually(Duration::from_secs(15), || {
        let url = url.clone();
        async move {
            let list = oam(&url).args(["agent", "list", "--json"]).output().ok()?;
            let listed = String::from_utf8_lossy(&list.stdout).contains("demo.blip");
            let (ok, _, _) = call(&url, "demo.blip", "{}", "2");
            (listed && ok).then_some(())
        }
    })
    .await;
    assert!(
        back.is_some(),
        "the host did not come back into the catalog and serve"
    );
}

#[tokio::test]
async fn a_stuck_handler_is_reported_as_stuck_not_as_a_timeout() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _stuck = serve(&url, "demo.stuck", "hang", &["--max-handling-ms", "300"]);
    let started = Instant::now();
    let (ok, _, err) = call(&url, "demo.stuck", "{}", "20");
    assert!(!ok && err.starts_with("oam: stuck"), "{err}");
    assert!(err.contains("300 ms"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "not the caller's 20 s timeout"
    );
    // The declared limit is part of the agent's contract.
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    let kv = async_nats::jetstream::new(nc)
        .get_key_value("mesh-registry")
        .await
        .unwrap();
    let contract: Value =
        serde_json::from_slice(&kv.get("demo.stuck").await.unwrap().unwrap()).unwrap();
    assert_eq!(contract["x-agentmesh"]["max_handling_ms"], 300);
}

/// A node (`oam node run`, id n1) on `url` with `toml` as its oam.toml, in a folder of its own
/// that the caller removes: the process, its HTTP base URL and the folder.
fn node_with(url: &str, tag: &str, toml: &str) -> (Proc, String, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("oam-test-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("oam.toml");
    std::fs::write(&cfg, toml).unwrap();
    let node = Proc::spawn(&crate::support::node_args(
        "n1",
        url,
        &["--config", cfg.to_str().unwrap()],
    ));
    let http = node.ready["http"].as_str().unwrap().to_string();
    (node, http, dir)
}

#[tokio::test]
async fn a_provider_on_the_mesh_is_marked_down_by_its_death_notice() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _monitor = monitor(&server);
    let sim = Proc::spawn(&["sim", "--listen", "127.0.0.1:0", "--json"]);
    let sim_url = sim.ready["url"].as_str().unwrap().to_string();
    let mut llm = serve(&url, "llm.chat", "chat", &[]);
    let (_node, http, dir) = node_with(
        &url,
        "meshprov",
        &format!(
            "[node]\ncluster_size = 1\n\n[[provider]]\nid = \"meshllm\"\nagent = \"llm.chat\"\nmodel = \"m\"\n\
             cost_per_1k_tokens_usd = 0.001\nprobe = \"chat\"\n\n[[provider]]\nid = \"local\"\nbase_url = \"{sim_url}/local/v1\"\n\
             model = \"sim-small\"\nfallback = true\n"
        ),
    );
    let c = crate::support::http(Duration::from_secs(10));
    // (verdict, samples in the node's own window) of the mesh provider.
    let view = |c: reqwest::Client, http: String| async move {
        let s: oam::core::wire::NodeSnapshot = c
            .get(format!("{http}/v1/oam/state"))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        let p = s.provider("meshllm")?;
        let samples = p.local.map_or(0, |l| l.samples);
        Some((p.consensus.verdict.as_str().to_string(), samples))
    };
    let verdict =
        |c: reqwest::Client, http: String| async move { view(c, http).await.map(|v| v.0) };
    // HEALTHY on a few samples, so one request's outcome does not swing the verdict.
    let healthy = crate::support::eventually(Duration::from_secs(15), || {
        let (c, http) = (c.clone(), http.clone());
        async move {
            let (v, samples) = view(c, http).await?;
            (v == "HEALTHY" && samples >= 3).then_some(())
        }
    })
    .await;
    assert!(healthy.is_some(), "the mesh provider never became HEALTHY");
    let ask = || {
        c.post(format!("{http}/v1/chat/completions"))
            .json(&json!({"model": "auto", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
    };
    let r = ask().await.unwrap();
    assert_eq!(r.headers()["x-oam-target"], "meshllm");

    llm.kill();
    let killed = Instant::now();
    let down = crate::support::eventually(Duration::from_secs(10), || {
        let (c, http) = (c.clone(), http.clone());
        async move { (verdict(c, http).await? == "UNHEALTHY").then_some(()) }
    })
    .await;
    assert!(down.is_some(), "the dead provider was not marked down");
    // Failed probes alone would need several seconds to outweigh the healthy samples.
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "{:?}",
        killed.elapsed()
    );
    let r = ask().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-oam-target"], "local");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A node whose target is a mesh agent calls it with the fail-fast caller: the agent SIGKILLed
/// while it holds a request ends that attempt with `agent_died` at once, and the request is
/// answered by the route's fallback within the time the death notice takes, not at the
/// attempt's 10 s timeout.
#[tokio::test]
async fn a_node_falls_back_at_once_when_the_agent_holding_its_request_dies() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _monitor = monitor(&server);
    let sim = Proc::spawn(&["sim", "--listen", "127.0.0.1:0", "--json"]);
    let sim_url = sim.ready["url"].as_str().unwrap().to_string();
    let mut holder = serve(&url, "llm.hang", "hang", &[]);
    let (_node, http, dir) = node_with(
        &url,
        "meshdies",
        &format!(
            "[node]\ncluster_size = 1\n\n[[provider]]\nid = \"meshllm\"\nagent = \"llm.hang\"\n\
             model = \"m\"\nprobe = \"off\"\n\n[[provider]]\nid = \"local\"\n\
             base_url = \"{sim_url}/local/v1\"\nmodel = \"sim-small\"\n\n\
             [[route]]\nmodel = \"meshy\"\ntargets = [\"meshllm\", \"local\"]\n"
        ),
    );
    let c = crate::support::http(Duration::from_secs(30));
    let pending = tokio::spawn(
        c.post(format!("{http}/v1/chat/completions"))
            .json(&json!({"model": "meshy", "messages": [{"role": "user", "content": "hi"}]}))
            .send(),
    );
    // The agent holds the node's request now: it says so in its heartbeat.
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    beat_of(&nc, "llm.hang", |b| b["in_flight"].as_u64() >= Some(1)).await;
    let killed = Instant::now();
    holder.kill();
    let r = tokio::time::timeout(Duration::from_secs(15), pending)
        .await
        .expect("the request was answered")
        .unwrap()
        .unwrap();
    let waited = killed.elapsed();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-oam-target"], "local");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["oam"]["target"], "local", "{v}");
    let tried = v["oam"]["tried"].as_array().unwrap();
    assert_eq!(tried[0]["target"], "meshllm", "{v}");
    // Within the death notice's time plus the fallback's answer, not the 10 s timeout (an
    // order-of-magnitude check, not a benchmark).
    assert!(waited < Duration::from_secs(2), "{waited:?}: {v}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An agent that answers as an Open Agent Mesh agent does when it reports its model use: the
/// `X-Mesh-Usage` header on its reply (the SDK's usage attribution, written here with the SDK's
/// own NATS client, since the released SDK predates it). Prints `ready` once it listens.
const USAGE_AGENT: &str = r#"
import asyncio, json, sys
import nats

async def main():
    nc = await nats.connect(sys.argv[1])
    async def answer(msg):
        body = json.dumps({"id": "a1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "counted"}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
        usage = json.dumps({"input_tokens": 1000, "output_tokens": 200,
                            "model": "gpt-4o-mini", "estimated_cost_usd": 0.25})
        await nc.publish(msg.reply, body.encode(),
                         headers={"X-Mesh-Status": "ok", "X-Mesh-Usage": usage})
    await nc.subscribe("mesh.agent.llm.usage", queue="mesh.agent.llm.usage", cb=answer)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"#;

/// What a mesh agent says its answer cost it (`X-Mesh-Usage`) is charged on top of the
/// target's price, to the budget of the agent that asked, and `oam explain` says so.
#[tokio::test]
async fn the_model_use_a_mesh_agent_reports_is_charged_to_its_caller() {
    use std::io::BufRead as _;
    let server = NatsServer::start().await;
    let url = server.url();
    /// The agent, stopped however the test ends.
    struct Agent(std::process::Child);
    impl Drop for Agent {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut agent = Agent(
        std::process::Command::new(python())
            .args(["-c", USAGE_AGENT, &url])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python with nats-py; run scripts/install-test-tools"),
    );
    let mut line = String::new();
    std::io::BufReader::new(agent.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    let (_node, http, dir) = node_with(
        &url,
        "usage",
        "[node]\ncluster_size = 1\n\n[[provider]]\nid = \"meshllm\"\nagent = \"llm.usage\"\n\
         model = \"m\"\ncost_per_1k_tokens_usd = 0.001\nprobe = \"off\"\n\n\
         [budgets.agents.payer]\nlimit_usd = 10.0\n",
    );
    let c = crate::support::http(Duration::from_secs(10));
    let r = c
        .post(format!("{http}/v1/chat/completions"))
        .json(
            &json!({"model": "auto", "messages": [{"role": "user", "content": "hi"}],
            "oam": {"agent": "payer"}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let cost = body["oam"]["cost_usd"].as_f64().unwrap();
    // 6 tokens at $0.001 per 1k, and the $0.25 the agent reported.
    assert!((cost - 0.250_006).abs() < 1e-9, "{body}");
    let charged = crate::support::eventually(Duration::from_secs(10), || async {
        let l = crate::gateway::ledger_of(&url, "payer").await?;
        ((l.spent_usd - cost).abs() < 1e-9).then_some(())
    })
    .await;
    assert!(
        charged.is_some(),
        "the payer's budget is charged what was reported"
    );
    let id = body["oam"]["request_id"].as_str().unwrap();
    let told = crate::support::eventually(Duration::from_secs(10), || async {
        let out = Command::cargo_bin("oam")
            .unwrap()
            .args(["explain", id, "--nats-url", &url])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        out.status.success().then_some(text)
    })
    .await
    .expect("the record explained");
    assert!(
        told.contains(
            "X-Mesh-Usage): 1000 tokens in, 200 out of gpt-4o-mini; $0.250000 of the cost is its"
        ),
        "{told}"
    );
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn streams_arrive_in_order_and_fail_fast() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _monitor = monitor(&server);
    let _stream = serve(&url, "demo.stream", "stream:3:20", &[]);
    let _echo = serve(&url, "demo.echo", "echo", &[]);

    let out = oam(&url)
        .args(["agent", "stream", "demo.stream", r#"{"q": 1}"#])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let chunks: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(chunks.len(), 3, "{chunks:?}");
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["input"], json!({"q": 1}));
    }

    // The wrong way round is refused by the agent, not waited out.
    let (ok, _, err) = call(&url, "demo.stream", "{}", "5");
    assert!(!ok && err.contains("invocation_mismatch"), "{err}");
    let out = oam(&url)
        .args(["agent", "stream", "demo.echo", "--timeout", "20"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("invocation_mismatch"),
        "{err}"
    );

    // Nobody serves it: known at once, not after the timeout.
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    let caller = oam::mesh::client::Caller::new(nc).await.unwrap();
    let started = Instant::now();
    let mut s = caller
        .stream("nobody.streams", "{}".into(), Duration::from_secs(30))
        .await
        .unwrap();
    let err = s.next().await.unwrap().unwrap_err();
    assert_eq!(err.code, oam::mesh::protocol::ErrorCode::NotFound, "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(s.next().await.is_none(), "an error ends the stream");

    // The instance serving the stream dies mid-way: the caller hears it in milliseconds.
    let mut long = serve(&url, "demo.long", "stream:100:100", &[]);
    let mut s = caller
        .stream("demo.long", "{}".into(), Duration::from_secs(30))
        .await
        .unwrap();
    let first = s.next().await.unwrap().unwrap();
    assert_eq!(serde_json::from_slice::<Value>(&first).unwrap()["index"], 0);
    let killed = Instant::now();
    long.kill();
    let err = loop {
        match s.next().await.expect("an error, not a clean end") {
            Ok(_) => continue, // a chunk already on its way
            Err(e) => break e,
        }
    };
    assert_eq!(err.code, oam::mesh::protocol::ErrorCode::AgentDied, "{err}");
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "{:?}",
        killed.elapsed()
    );

    // A stream whose next chunk takes longer than the agent declared is stuck.
    let _slow = serve(
        &url,
        "demo.slowstream",
        "stream:3:5000",
        &["--max-handling-ms", "200"],
    );
    let started = Instant::now();
    let out = oam(&url)
        .args(["agent", "stream", "demo.slowstream", "--timeout", "20"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("stuck"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_local_mesh_in_one_call_with_full_liveness() {
    use oam::mesh::host::Handler;
    use oam::mesh::protocol::ErrorCode;
    let mesh = oam::local::mesh::LocalMesh::start().await.unwrap();
    let upper = mesh
        .serve(
            "text.upper",
            Handler::call(|body| async move {
                let text = String::from_utf8_lossy(&body).to_uppercase();
                Ok(text.into_bytes().into())
            }),
        )
        .await
        .unwrap();
    // The slow agent says when it holds a call, so the test knows without a sleep: once it
    // has held it well past the time after which its host acknowledges a call (a crash before
    // that leaves the caller to the agent's death notice, which the next check is not about).
    let (holding_tx, mut holding) = tokio::sync::mpsc::channel::<()>(4);
    let slow = mesh
        .serve(
            "text.slow",
            Handler::call(move |body| {
                let holding_tx = holding_tx.clone();
                async move {
                    tokio::time::sleep(oam::mesh::host::ACK_AFTER * 10).await;
                    let _ = holding_tx.send(()).await;
                    tokio::time::sleep(Duration::from_secs(20)).await;
                    Ok(body)
                }
            }),
        )
        .await
        .unwrap();
    let caller = std::sync::Arc::new(mesh.caller().await.unwrap());
    let reply = caller
        .call("text.upper", r#"{"a": "b"}"#.into(), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(&reply[..], br#"{"A": "B"}"#);

    // A crash (the handle dropped without `stop`) while holding a call: the in-process monitor
    // sees the connection close and the caller fails at once.
    let c = caller.clone();
    let pending = tokio::spawn(async move {
        c.call("text.slow", "{}".into(), Duration::from_secs(30))
            .await
    });
    tokio::time::timeout(Duration::from_secs(10), holding.recv())
        .await
        .expect("the slow agent took the call");
    let crashed = Instant::now();
    drop(slow);
    let err = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .expect("the call ended")
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::AgentDied, "{err}");
    assert!(
        crashed.elapsed() < Duration::from_secs(3),
        "{:?}",
        crashed.elapsed()
    );

    // A graceful stop says so; then nothing answers.
    let nc = mesh.connect("test").await.unwrap();
    let mut deaths = nc.subscribe("mesh.death.text.upper").await.unwrap();
    nc.flush().await.unwrap();
    upper.stop().await.unwrap();
    let notice = next_json(&mut deaths, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(notice["reason"], "graceful_shutdown");
    let err = caller
        .call("text.upper", "{}".into(), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::NotFound, "{err}");

    // Dropping the mesh stops its server.
    let url = mesh.url();
    drop(mesh);
    assert!(
        oam::transport::connect::connect(&url, "after", false, &Default::default())
            .await
            .is_err(),
        "the private server is gone"
    );
}

/// An agent whose NATS is gone still stops on SIGTERM at once (it used to take 40 s and more),
/// and one whose credentials the server no longer takes says so and exits 3 instead of
/// retrying forever.
#[tokio::test]
async fn agents_stop_without_nats_and_give_up_on_refused_credentials() {
    let server = NatsServer::start().await;
    let url = server.url();
    let mut agent = serve(&url, "demo.orphan", "echo", &[]);
    drop(server);
    let term = std::process::Command::new("kill")
        .args(["-TERM", &agent.pid().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let status = agent.exited_within(Duration::from_secs(10)).await;
    assert!(status.is_some(), "SIGTERM without NATS ended the agent");

    // The server comes back on its port with other credentials (`mesh up --new-credentials`).
    let server = NatsServer::start().await;
    let port = server.port;
    let mut agent = serve(&server.url(), "demo.refused", "echo", &[]);
    drop(server);
    let renewed = oam::local::natsd::Credentials::generate().unwrap();
    let _again = NatsServer::start_on(port, renewed).await.unwrap();
    let status = agent
        .exited_within(Duration::from_secs(20))
        .await
        .expect("the refused agent gave up by itself");
    assert_eq!(status.code(), Some(3), "unreachable: {status:?}");
}

/// A mesh elsewhere behind JWT auth (operator mode, as `nsc` sets it up): `--creds FILE`, or
/// `$OAM_NATS_CREDS`, connects with the user's JWT and NKey seed; without it the server refuses
/// (exit 3, naming the URL); a file that is not credentials, or credentials beside a password in
/// the URL, are usage errors (exit 2) that say what is wrong.
#[tokio::test]
async fn creds_files_reach_a_mesh_behind_jwt_auth() {
    let server = crate::support::JwtServer::start().await;
    let url = server.url();
    let creds = server.creds.to_str().unwrap().to_string();
    let publisher = async_nats::ConnectOptions::with_credentials_file(&server.creds)
        .await
        .unwrap()
        .connect(url.as_str())
        .await
        .unwrap();
    for by_env in [false, true] {
        let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin!("oam"));
        cmd.args([
            "listen",
            "remote.>",
            "--count",
            "1",
            "--json",
            "--nats-url",
            &url,
        ])
        .env_remove("OAM_NATS_CREDS")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
        if by_env {
            cmd.env("OAM_NATS_CREDS", &creds);
        } else {
            cmd.args(["--creds", &creds]);
        }
        let mut listener = cmd.spawn().unwrap();
        // Published until the listener (subscribed once connected) has its one message.
        let deadline = Instant::now() + Duration::from_secs(15);
        let done = loop {
            let _ = publisher
                .publish("remote.hello", "{\"from\": \"afar\"}".into())
                .await;
            let _ = publisher.flush().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            if let Ok(Some(status)) = listener.try_wait() {
                break Some(status);
            }
            if Instant::now() > deadline {
                let _ = listener.kill();
                break None;
            }
        };
        let out = listener.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            done.is_some_and(|s| s.success()),
            "by_env {by_env}: {stderr}"
        );
        let line: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(line["subject"], "remote.hello");
        assert_eq!(line["payload"]["from"], "afar");
    }

    let refused = Command::new(assert_cmd::cargo::cargo_bin!("oam"))
        .args(["listen", "remote.>", "--count", "1", "--nats-url", &url])
        .env_remove("OAM_NATS_CREDS")
        .timeout(Duration::from_secs(20))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains(&url), "{stderr}");

    let bogus = server.creds.with_file_name("bogus.creds");
    std::fs::write(&bogus, "not a credentials file").unwrap();
    let with_password = format!("nats://someone:secret@127.0.0.1:{}", server.port);
    for (nats_url, file, says) in [
        (
            url.as_str(),
            bogus.to_str().unwrap(),
            "not a NATS credentials file",
        ),
        (url.as_str(), "/nonexistent/user.creds", "cannot read it"),
        (with_password.as_str(), creds.as_str(), "give one of them"),
    ] {
        let out = Command::new(assert_cmd::cargo::cargo_bin!("oam"))
            .args([
                "listen",
                "remote.>",
                "--nats-url",
                nats_url,
                "--creds",
                file,
            ])
            .timeout(Duration::from_secs(20))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{file}: {stderr}");
        assert!(stderr.contains(says), "{file}: {stderr}");
    }
}

/// A corrupt catalog is said to be corrupt, never shown as an empty one; items in it that are
/// not entries are named.
#[tokio::test]
async fn a_corrupt_catalog_is_reported_not_shown_empty() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _echo = serve(&url, "demo.echo", "echo", &[]);
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    let store = oam::transport::store::bucket(
        &nc,
        oam::transport::subjects::CATALOG_BUCKET,
        Duration::ZERO,
    )
    .await
    .unwrap();
    let key = oam::transport::subjects::CATALOG_KEY;
    let current = store.get(key).await.unwrap().unwrap();
    let mut items: Vec<Value> = serde_json::from_slice(&current).unwrap();
    items.push(json!({"bogus": true}));
    store
        .put(key, serde_json::to_vec(&items).unwrap().into())
        .await
        .unwrap();
    let out = oam(&url).args(["agent", "list"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("1 catalog items are not agent entries") && stderr.contains("bogus"),
        "{stderr}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("demo.echo"));

    store.put(key, "{not json".into()).await.unwrap();
    let out = oam(&url).args(["agent", "list"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("is not a JSON array of entries"),
        "{stderr}"
    );
}

/// An instance frozen past the heartbeat verdict and then revived registers again at once (it
/// hears its own death notice), so it is back in the catalog and its later death is announced:
/// a caller holding a request on it fails with `agent_died` in milliseconds, not at its timeout.
#[tokio::test]
async fn a_revived_instance_registers_again_and_its_next_death_is_announced() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _monitor = monitor(&server);
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    let mut deaths = nc.subscribe("mesh.death.demo.revived").await.unwrap();
    nc.flush().await.unwrap();
    let mut agent = serve(&url, "demo.revived", "sleep:20000", &[]);
    beat_of(&nc, "demo.revived", |_| true).await;
    let signal = |sig: &str, pid: u32| {
        std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap();
    };
    signal("-STOP", agent.pid());
    let notice = next_json(&mut deaths, Duration::from_secs(10)).await;
    signal("-CONT", agent.pid());
    assert_eq!(
        notice.expect("declared dead while frozen")["reason"],
        "missed_heartbeats"
    );
    // Back in the catalog, alive (given room: each look runs `oam agent list`, slow on a
    // loaded machine).
    let listed = crate::support::eventually(Duration::from_secs(20), || async {
        let out = oam(&url).args(["agent", "list", "--json"]).output().ok()?;
        let v: Vec<Value> = serde_json::from_slice(&out.stdout).ok()?;
        v.iter()
            .any(|e| e["name"] == "demo.revived" && e["instances_alive"] == 1)
            .then_some(())
    })
    .await;
    assert!(listed.is_some(), "the revived instance is listed again");
    // Its next death, mid-call, is announced at once.
    let caller = std::sync::Arc::new(oam::mesh::client::Caller::new(nc.clone()).await.unwrap());
    let c = caller.clone();
    let pending = tokio::spawn(async move {
        c.call("demo.revived", "{}".into(), Duration::from_secs(30))
            .await
    });
    beat_of(&nc, "demo.revived", |b| b["in_flight"].as_u64() >= Some(1)).await;
    let killed = Instant::now();
    agent.kill();
    let result = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .expect("the call ended")
        .unwrap();
    let err = result.expect_err("the request died with its instance");
    assert_eq!(err.code, oam::mesh::protocol::ErrorCode::AgentDied, "{err}");
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "{:?}",
        killed.elapsed()
    );
    let notice = next_json(&mut deaths, Duration::from_secs(10))
        .await
        .expect("the second death is announced");
    assert_eq!(notice["reason"], "disconnect");
}

/// Ten instances frozen for 9 s (three times the heartbeat verdict) at once: every one is
/// declared dead, every one registers again when it wakes, and every one's next freeze is
/// announced again (a revived instance has no blind spot).
#[tokio::test]
async fn every_instance_frozen_for_nine_seconds_registers_again() {
    const N: usize = 10;
    let server = NatsServer::start().await;
    let url = server.url();
    let _monitor = monitor(&server);
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    let mut deaths = nc.subscribe("mesh.death.demo.frozen.>").await.unwrap();
    nc.flush().await.unwrap();
    let names: Vec<String> = (0..N).map(|i| format!("demo.frozen.a{i}")).collect();
    let mut agents: Vec<Proc> = names.iter().map(|n| serve(&url, n, "echo", &[])).collect();
    for n in &names {
        beat_of(&nc, n, |_| true).await;
    }
    let signal_all = |sig: &str, agents: &[Proc]| {
        for a in agents {
            std::process::Command::new("kill")
                .args([sig, &a.pid().to_string()])
                .status()
                .unwrap();
        }
    };
    let alive = |url: String| async move {
        let out = oam(&url).args(["agent", "list", "--json"]).output().ok()?;
        let v: Vec<Value> = serde_json::from_slice(&out.stdout).ok()?;
        let n = v
            .iter()
            .filter(|e| {
                e["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("demo.frozen."))
                    && e["instances_alive"] == 1
            })
            .count();
        Some(n)
    };
    signal_all("-STOP", &agents);
    let frozen_at = Instant::now();
    assert_eq!(
        frozen_announced(&mut deaths, N).await,
        N,
        "every frozen instance declared dead"
    );
    let listed = crate::support::eventually(Duration::from_secs(5), || alive(url.clone())).await;
    assert_eq!(listed, Some(0), "the dead are out of the catalog");
    tokio::time::sleep(Duration::from_secs(9).saturating_sub(frozen_at.elapsed())).await;
    signal_all("-CONT", &agents);
    let back = crate::support::eventually(Duration::from_secs(10), || async {
        (alive(url.clone()).await? == N).then_some(())
    })
    .await;
    assert!(
        back.is_some(),
        "all {N} registered again: {:?}",
        alive(url.clone()).await
    );

    // Frozen again: announced again, every one.
    signal_all("-STOP", &agents);
    assert_eq!(
        frozen_announced(&mut deaths, N).await,
        N,
        "every second freeze announced"
    );
    signal_all("-CONT", &agents);
    for a in &mut agents {
        a.kill();
    }
}

/// Death notices of `n` frozen instances, each once and for missed heartbeats (at most 15 s):
/// how many distinct instances were announced.
async fn frozen_announced(deaths: &mut async_nats::Subscriber, n: usize) -> usize {
    let mut seen = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while seen.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(notice) = next_json(deaths, left).await else {
            break;
        };
        assert_eq!(notice["reason"], "missed_heartbeats", "{notice}");
        let name = notice["agent"].as_str().unwrap().to_string();
        assert!(seen.insert(name.clone()), "{name} announced twice");
    }
    seen.len()
}

/// A stream between oam's caller and agent goes to the caller's private inbox: nothing appears
/// on the shared `mesh.stream.{id}`, and chunks and an end marker forged there (even knowing the
/// request id) change nothing; a second acknowledgement naming another instance is not believed.
#[tokio::test]
async fn forged_chunks_and_acknowledgements_change_no_stream() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _monitor = monitor(&server);
    let _stream = serve(&url, "demo.stream20", "stream:20:20", &[]);
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    let mut shared = nc.subscribe("mesh.stream.>").await.unwrap();
    nc.flush().await.unwrap();
    let caller = oam::mesh::client::Caller::new(nc.clone()).await.unwrap();
    let mut s = caller
        .stream("demo.stream20", "{}".into(), Duration::from_secs(30))
        .await
        .unwrap();
    let first = s.next().await.unwrap().unwrap();
    let first: Value = serde_json::from_slice(&first).unwrap();
    assert_eq!(first["index"], 0);
    // A forger that learned the request id injects a chunk and the end marker.
    let forged = format!("mesh.stream.{}", s.request_id());
    let mut h = async_nats::HeaderMap::new();
    h.insert("X-Mesh-Stream-Seq", "1");
    h.insert("X-Mesh-Stream-End", "false");
    nc.publish_with_headers(forged.clone(), h, r#"{"forged":true}"#.into())
        .await
        .unwrap();
    let mut end = async_nats::HeaderMap::new();
    end.insert("X-Mesh-Stream-Seq", "2");
    end.insert("X-Mesh-Stream-End", "true");
    nc.publish_with_headers(forged, end, "".into())
        .await
        .unwrap();
    nc.flush().await.unwrap();
    let mut got = vec![first];
    while let Some(chunk) = s.next().await {
        got.push(serde_json::from_slice(&chunk.unwrap()).unwrap());
    }
    assert_eq!(got.len(), 20, "{got:?}");
    assert!(
        got.iter().enumerate().all(|(i, c)| c["index"] == i),
        "{got:?}"
    );
    // The shared subject carried only the forgeries.
    let mut on_shared = 0;
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), shared.next()).await {
        on_shared += 1;
        assert!(m.headers.is_some());
    }
    assert_eq!(on_shared, 2, "the real stream went to the private inbox");

    // The serving agent acknowledges a call, then acknowledges it again naming another
    // instance; that instance dies: the call, held by the first, is not failed.
    let mut agent_sub = nc
        .queue_subscribe("mesh.agent.demo.liar", "q.demo.liar".to_string())
        .await
        .unwrap();
    nc.flush().await.unwrap();
    let call = tokio::spawn(async move {
        caller
            .call("demo.liar", "{}".into(), Duration::from_secs(10))
            .await
    });
    let req = tokio::time::timeout(Duration::from_secs(5), agent_sub.next())
        .await
        .unwrap()
        .unwrap();
    let header = |k: &str| {
        req.headers
            .as_ref()
            .unwrap()
            .get(k)
            .unwrap()
            .as_str()
            .to_string()
    };
    let ack_to = header("X-Mesh-Ack-To");
    nc.publish(ack_to.clone(), "liar-instance".into())
        .await
        .unwrap();
    nc.publish(ack_to, "victim-instance".into()).await.unwrap();
    let notice = json!({"agent": "demo.victim", "reason": "disconnect", "instance_id": "victim-instance", "detected_at": "2026-12-01T00:00:00+00:00"});
    nc.publish(
        "mesh.instance-death.victim-instance",
        serde_json::to_vec(&notice).unwrap().into(),
    )
    .await
    .unwrap();
    // So is a notice of "its" instance that names another agent (an instance id is whatever
    // an agent claims; the monitor names the agent the evidence was for).
    let notice = json!({"agent": "demo.other", "reason": "disconnect", "instance_id": "liar-instance", "detected_at": "2026-12-01T00:00:00+00:00"});
    nc.publish(
        "mesh.instance-death.liar-instance",
        serde_json::to_vec(&notice).unwrap().into(),
    )
    .await
    .unwrap();
    nc.flush().await.unwrap();
    // The answer comes after the notices, with time for the caller to act on them: had either
    // been believed, the call would have failed as agent_died by then.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut ok = async_nats::HeaderMap::new();
    ok.insert("X-Mesh-Status", "ok");
    nc.publish_with_headers(req.reply.unwrap(), ok, r#"{"answer":1}"#.into())
        .await
        .unwrap();
    let answer = call
        .await
        .unwrap()
        .expect("the call is answered, not failed");
    assert_eq!(answer.as_ref(), br#"{"answer":1}"#);
}

/// The monitor believes who sent a record, not the name inside it: a heartbeat on one agent's
/// subject naming another agent is ignored (it would declare that agent dead when the beats
/// stop), and an instance record under one agent's key naming another agent does not keep that
/// agent alive after its real death.
#[tokio::test]
async fn forged_heartbeats_and_instance_records_fool_no_monitor() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _monitor = monitor(&server);
    let (nc, mut deaths, mut instance_deaths) = hearing_deaths(&url).await;
    let mut victim = serve(&url, "demo.victim", "echo", &[]);
    let victim_id = victim.ready["instances"][0].as_str().unwrap().to_string();
    beat_of(&nc, "demo.victim", |_| true).await;

    // A forged beat for the victim's instance on the attacker's subject, then a marker beat of
    // the attacker's own that stops too: the marker's death comes, the victim's does not.
    let beat = |agent: &str, id: &str| {
        let b =
            json!({"agent": agent, "instance_id": id, "in_flight": 0, "processed": 0, "at_ms": 0});
        serde_json::to_vec(&b).unwrap()
    };
    nc.publish("mesh.health.evil", beat("demo.victim", "forged-1").into())
        .await
        .unwrap();
    nc.publish("mesh.health.evil", beat("evil", "marker-1").into())
        .await
        .unwrap();
    nc.flush().await.unwrap();
    let marker = next_json(&mut instance_deaths, Duration::from_secs(10))
        .await
        .expect("the marker's missed heartbeats");
    assert_eq!(marker["instance_id"], "marker-1", "{marker}");
    assert_eq!(marker["agent"], "evil", "{marker}");
    let notice = next_json(&mut deaths, Duration::from_secs(1)).await;
    assert_eq!(
        notice.as_ref().map(|n| n["agent"].clone()),
        Some(json!("evil")),
        "{notice:?}"
    );
    assert!(
        next_json(&mut instance_deaths, Duration::from_millis(500))
            .await
            .is_none(),
        "no other instance was declared dead"
    );
    let (ok, _, err) = call(&url, "demo.victim", "{}", "5");
    assert!(ok, "the victim still serves: {err}");

    // The attacker beats with the victim's live instance id on its own subject, then goes
    // silent: the id is the victim's, so nothing is announced for it (it was announced dead
    // under the attacker's name), and the next marker's death comes alone.
    nc.publish("mesh.health.evil", beat("evil", &victim_id).into())
        .await
        .unwrap();
    nc.publish("mesh.health.evil", beat("evil", "marker-2").into())
        .await
        .unwrap();
    nc.flush().await.unwrap();
    let marker = next_json(&mut instance_deaths, Duration::from_secs(10))
        .await
        .expect("the second marker's missed heartbeats");
    assert_eq!(marker["instance_id"], "marker-2", "{marker}");
    assert!(
        next_json(&mut instance_deaths, Duration::from_millis(500))
            .await
            .is_none(),
        "the victim's instance was not declared dead"
    );

    // A record under the attacker's key that names the victim, then the victim's real death.
    let js = async_nats::jetstream::new(nc.clone());
    let kv = js.get_key_value("mesh-instances").await.unwrap();
    let record = json!({"instance_id": "forged-2", "agents": ["demo.victim"], "connection": "oam-host-forged-2", "renewed_at_ms": oam::clock::now_ms()});
    kv.put("forged-2.evil", serde_json::to_vec(&record).unwrap().into())
        .await
        .unwrap();
    victim.kill();
    let notice = next_json(&mut deaths, Duration::from_secs(10))
        .await
        .expect("the victim's death is announced");
    assert_eq!(notice["agent"], "demo.victim", "{notice}");
    assert_eq!(notice["instance_id"], victim_id.as_str(), "{notice}");
}

/// Agents that start together all register, though the catalog is one key that each changes by
/// compare-and-swap (it used to give up after 10 tries: most of a burst failed), and the Open
/// Agent Mesh SDK still reads the catalog they wrote.
#[tokio::test]
async fn agents_registered_together_all_register_and_the_sdk_reads_them() {
    const AGENTS: usize = 240;
    let server = NatsServer::start().await;
    let url = server.url();
    let mut conns = Vec::new();
    for i in 0..8 {
        let name = format!("test-{i}");
        conns.push(
            oam::transport::connect::connect(&url, &name, false, &Default::default())
                .await
                .unwrap(),
        );
    }
    let registrations = (0..AGENTS).map(|i| {
        let nc = conns[i % conns.len()].clone();
        async move {
            let entry = oam::mesh::protocol::CatalogEntry {
                name: format!("burst.agent{i}"),
                description: format!("agent {i} of a burst"),
                version: "0.1.0".into(),
                tags: vec!["burst".into()],
                invocable: true,
                streaming: false,
                max_handling_ms: None,
            };
            let id = format!("{i:016x}");
            oam::mesh::store::register(&oam::mesh::store::Mesh::new(nc.clone()), &entry, &id).await
        }
    });
    let results = futures_util::future::join_all(registrations).await;
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| format!("{e:#}")))
        .collect();
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        &failed[..1]
    );

    let listed = crate::support::python_json(
        r#"
import asyncio, json, sys
from openagentmesh import AgentMesh

async def main():
    async with AgentMesh(sys.argv[1]) as mesh:
        print(json.dumps(sorted(e.name for e in await mesh.catalog())))

asyncio.run(main())
"#,
        &[&url],
    );
    let mut expected: Vec<String> = (0..AGENTS).map(|i| format!("burst.agent{i}")).collect();
    expected.sort();
    assert_eq!(listed, json!(expected), "the SDK lists every agent once");
}

/// Start `oam agent serve NAME --replicas N` processes all at once.
fn serve_together(url: &str, agents: &[(&str, &str)]) -> Vec<Proc> {
    std::thread::scope(|s| {
        let started: Vec<_> = agents
            .iter()
            .map(|(name, replicas)| {
                s.spawn(move || serve(url, name, "echo", &["--replicas", replicas]))
            })
            .collect();
        started.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

fn instances(p: &Proc) -> Vec<String> {
    p.ready["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_str().unwrap().to_string())
        .collect()
}

/// Instances killed together are each announced once, at once (each death used to wait for
/// the one before, which read every instance record); an agent's death is announced once when
/// its last instance goes, whichever of them the monitor handles last, and never while another
/// process still serves it. Replicas stopped together (in two processes at once) leave one
/// graceful notice and an empty catalog; each process exits within the 2 s the docs state.
#[tokio::test]
async fn deaths_and_exits_in_a_burst_are_announced_each_once() {
    let server = NatsServer::start().await;
    let url = server.url();
    let _monitor = monitor(&server);
    let (nc, mut deaths, mut instance_deaths) = hearing_deaths(&url).await;
    let mut procs = serve_together(
        &url,
        &[
            ("burst.a", "4"),
            ("burst.a", "4"),
            ("burst.a", "4"),
            ("burst.b", "4"),
            ("burst.b", "4"),
            ("burst.c", "4"),
        ],
    );
    // Every instance beats before the kill, so the monitor knows each by its heartbeat.
    for name in ["burst.a", "burst.b", "burst.c"] {
        beat_of(&nc, name, |_| true).await;
    }
    let survivors: Vec<Proc> = procs.drain(..2).collect();
    let killed: std::collections::BTreeSet<String> = procs.iter().flat_map(instances).collect();
    assert_eq!(killed.len(), 16);
    for p in &mut procs {
        let _ = oam::local::signal(p.pid(), libc::SIGKILL);
    }
    let last_kill = Instant::now();
    for p in &mut procs {
        p.wait();
    }

    let mut announced = std::collections::BTreeSet::new();
    let mut agents_dead = Vec::new();
    let deadline = last_kill + Duration::from_secs(10);
    while announced.len() < killed.len() || agents_dead.len() < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::select! {
            n = next_json(&mut instance_deaths, left) => {
                let n = n.expect("every killed instance is announced within 10 s");
                let id = n["instance_id"].as_str().unwrap().to_string();
                assert!(killed.contains(&id), "a false death: {n}");
                assert!(announced.insert(id), "announced twice: {n}");
            }
            n = next_json(&mut deaths, left) => {
                let n = n.expect("both agents' deaths are announced within 10 s");
                agents_dead.push(n["agent"].as_str().unwrap().to_string());
            }
        }
    }
    let took = last_kill.elapsed();
    agents_dead.sort();
    assert_eq!(
        agents_dead,
        ["burst.b", "burst.c"],
        "each once; burst.a lives"
    );
    // From the disconnects, not the heartbeat verdict (3 s of silence).
    assert!(
        took < Duration::from_millis(2_500),
        "the last notice came {took:?} after the kill"
    );
    assert!(
        next_json(&mut instance_deaths, Duration::from_millis(500))
            .await
            .is_none(),
        "no more deaths"
    );
    let (ok, _, err) = call(&url, "burst.a", r#"{"still": "served"}"#, "10");
    assert!(ok, "{err}");

    // The two processes left serving burst.a stop together.
    let mut survivors = survivors;
    for p in &survivors {
        assert!(oam::local::signal(p.pid(), libc::SIGTERM));
    }
    let stopped = Instant::now();
    for p in &mut survivors {
        let status = p.exited_within(Duration::from_secs(10)).await;
        assert!(status.is_some_and(|s| s.success()), "{status:?}");
    }
    let took = stopped.elapsed();
    assert!(took < Duration::from_secs(3), "exits took {took:?}");
    let notice = next_json(&mut deaths, Duration::from_secs(5))
        .await
        .expect("the agent's graceful notice");
    assert_eq!(notice["agent"], "burst.a", "{notice}");
    assert_eq!(notice["reason"], "graceful_shutdown", "{notice}");
    assert!(
        next_json(&mut deaths, Duration::from_millis(500))
            .await
            .is_none(),
        "said once, not by each process or by the monitor"
    );
    assert!(
        next_json(&mut instance_deaths, Duration::from_millis(200))
            .await
            .is_none(),
        "a graceful exit is not a crash"
    );
    let mesh = oam::mesh::store::Mesh::new(nc.clone());
    let catalog = oam::mesh::store::catalog(&mesh).await.unwrap();
    assert!(catalog.is_empty(), "{catalog:?}");
    let records = oam::mesh::store::all_instances(&mesh).await.unwrap();
    assert!(records.is_empty(), "{records:?}");
}
