//! Roles enforced by nats-server on a default local mesh: what an agent, a caller and a viewer
//! try beyond their role is refused by the server (a permissions violation, nothing delivered),
//! while their own work goes on; credentials are issued and revoked on a running server.

use crate::support::{LocalCluster, Proc};
use serde_json::{Value, json};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A client as `url`'s user that records every error the server sends it.
async fn client(url: &str) -> (async_nats::Client, Arc<Mutex<Vec<String>>>) {
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = errors.clone();
    let (bare, auth) = oam::transport::connect::split_credentials(url);
    let (user, password) = auth.expect("a URL with credentials");
    let nc = async_nats::ConnectOptions::with_user_and_password(user, password)
        .event_callback(move |event| {
            let seen = seen.clone();
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    seen.lock().unwrap().push(e.to_string());
                }
            }
        })
        .connect(bare.as_str())
        .await
        .unwrap();
    (nc, errors)
}

/// Wait (at most 5 s) until the server has said that `what` on `subject` was refused.
async fn refused(errors: &Mutex<Vec<String>>, what: &str, subject: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let found = errors.lock().unwrap().iter().any(|e| {
            let e = e.to_ascii_lowercase();
            e.contains("permissions violation")
                && e.contains(what)
                && e.contains(&subject.to_ascii_lowercase())
        });
        if found {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the server did not refuse {what} {subject}; it said {:?}",
            errors.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `oam ARGS --dir FOLDER` as a user of the mesh folder: its roles' credentials, no URL.
fn in_folder(mesh: &LocalCluster, args: &[&str]) -> std::process::Output {
    mesh.oam()
        .env_remove("OAM_NATS_URL")
        .args(args)
        .arg("--dir")
        .arg(&mesh.dir.0)
        .output()
        .unwrap()
}

/// What a command that succeeded printed, as JSON.
fn succeeded(out: &std::process::Output) -> Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn issue(mesh: &LocalCluster, role: &str, name: &str) -> Value {
    let args = ["creds", "issue", "--role", role, "--name", name, "--json"];
    succeeded(&in_folder(mesh, &args))
}

#[tokio::test]
async fn every_role_may_do_its_own_work_and_nothing_else() {
    let mesh = LocalCluster::up("roles").await;
    let issued = issue(&mesh, "agent", "evil");
    assert_eq!(issued["user"], "agent-evil", "{issued}");
    assert_eq!(issued["reloaded"], true, "{issued}");
    let creds_file = issued["file"].as_str().unwrap().to_string();

    // The admin sees every message, in the order the server delivers them.
    let admin = oam::transport::connect::connect(&mesh.app_url(), "test-admin", false)
        .await
        .unwrap();
    let mut everything = admin.subscribe(">").await.unwrap();
    admin.flush().await.unwrap();

    // An agent, with the credentials it was given, attacks.
    let evil_url = mesh.role_url("agent-evil");
    let (evil, errors) = client(&evil_url).await;
    let forbidden = [
        "oam.v1.chaos.node.n1",  // a node fault past the warden
        "oam.v1.chaos.node.all", // every node at once
        "oam.v1.chaos.inject",   // a chaos request only operators make
        "mesh.death.demo.echo",  // a forged death notice
        "mesh.instance-death.abc",
        "mesh.health.demo.echo",  // a forged heartbeat of another agent
        "oam.v1.heartbeat.n2",    // gossip in a node's name
        "oam.v1.observations.n2", // verdicts in a node's name
        "$KV.oam-escalations.esc-n1-1-1", // resolving an escalation
        "$JS.API.STREAM.DELETE.KV_oam-escalations", // deleting every escalation
        "$JS.API.STREAM.PURGE.KV_mesh-catalog",
        // Another agent's instance record, and its tombstone (which would keep the monitor
        // from announcing that instance's death).
        "$KV.mesh-instances.abc123.demo.echo",
        "$KV.mesh-tombstones.abc123.demo.echo",
    ];
    for subject in forbidden {
        evil.publish(subject, r#"{"forged":true}"#.into())
            .await
            .unwrap();
    }
    // Its own heartbeat subject is its to use: the marker that everything before it was handled.
    evil.publish("mesh.health.evil", "{}".into()).await.unwrap();
    evil.flush().await.unwrap();
    for subject in forbidden {
        refused(&errors, "publish", subject).await;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let m = tokio::time::timeout(left, futures_util::StreamExt::next(&mut everything))
            .await
            .expect("the agent's own heartbeat arrives")
            .unwrap();
        assert!(
            !forbidden.contains(&m.subject.as_str()),
            "{} was delivered",
            m.subject
        );
        if m.subject.as_str() == "mesh.health.evil" {
            break;
        }
    }
    // Nor may it listen in on another agent's requests (and answer them first).
    let _hijack = evil.subscribe("mesh.agent.demo.echo").await.unwrap();
    evil.flush().await.unwrap();
    refused(&errors, "subscription", "mesh.agent.demo.echo").await;
    // Nothing changed: the escalations bucket is there, every node keeps its peers.
    let js = async_nats::jetstream::new(admin.clone());
    assert!(js.get_stream("KV_oam-escalations").await.is_ok());
    for i in 0..3 {
        let state: Value = crate::support::http(Duration::from_secs(5))
            .get(format!("{}/v1/oam/state", mesh.node(i)))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            state["live_nodes"].as_array().map(Vec::len),
            Some(3),
            "{state}"
        );
    }

    // The monitor's system-account user reads advisories and connection lists; it cannot kick.
    let monitor_file: Value =
        serde_json::from_slice(&std::fs::read(mesh.dir.0.join("creds/monitor.json")).unwrap())
            .unwrap();
    let (observer, observer_errors) = client(monitor_file["sys_url"].as_str().unwrap()).await;
    let kick = "$SYS.REQ.SERVER.oam-local.KICK";
    observer.publish(kick, "{}".into()).await.unwrap();
    observer.flush().await.unwrap();
    refused(&observer_errors, "publish", kick).await;

    // A viewer publishes nothing.
    let (viewer, viewer_errors) = client(&mesh.role_url("viewer")).await;
    for subject in ["oam.v1.decision.n1", "mesh.agent.evil", "oam.v1.request"] {
        viewer.publish(subject, "{}".into()).await.unwrap();
        viewer.flush().await.unwrap();
        refused(&viewer_errors, "publish", subject).await;
    }

    // The agent serves under its own credentials, and a caller (the folder's default for
    // `oam agent call`) reaches it.
    let _served = Proc::spawn(&[
        "agent",
        "serve",
        "evil",
        "--demo",
        "echo",
        "--json",
        "--creds",
        &creds_file,
    ]);
    let call = in_folder(&mesh, &["agent", "call", "evil", r#"{"message":"hi"}"#]);
    assert_eq!(succeeded(&call), json!({"message": "hi"}));
    // An agent without credentials is told how to get them.
    let out = in_folder(&mesh, &["agent", "serve", "nobody", "--demo", "echo"]);
    assert_eq!(out.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("oam creds issue --role agent --name nobody"),
        "{stderr}"
    );

    // The Open Agent Mesh Python SDK serves under an agent role.
    issue(&mesh, "agent", "sdk.echo");
    let mut sdk = crate::support::spawn_sdk_echo(&mesh.role_url("agent-sdk.echo"));
    let call = in_folder(&mesh, &["agent", "call", "sdk.echo", r#"{"message":"hi"}"#]);
    let _ = sdk.kill();
    let _ = sdk.wait();
    assert_eq!(succeeded(&call), json!({"reply": "py:hi"}));

    // Revoked credentials close the connection and are refused from then on.
    let args = [
        "creds", "revoke", "--role", "agent", "--name", "evil", "--json",
    ];
    assert_eq!(succeeded(&in_folder(&mesh, &args))["revoked"], "agent-evil");
    assert!(!std::path::Path::new(&creds_file).exists());
    let (bare, auth) = oam::transport::connect::split_credentials(&evil_url);
    let (user, password) = auth.unwrap();
    let again = async_nats::ConnectOptions::with_user_and_password(user, password)
        .connection_timeout(Duration::from_secs(2))
        .connect(bare.as_str())
        .await;
    assert!(again.is_err(), "revoked credentials are refused");
    // And the connection it held is closed by the server.
    let closed = crate::support::eventually(Duration::from_secs(5), || {
        let state = evil.connection_state();
        async move { (state != async_nats::connection::State::Connected).then_some(()) }
    })
    .await;
    assert!(
        closed.is_some(),
        "the revoked agent's connection stays open"
    );
}
