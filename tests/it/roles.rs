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
    // As oam's own processes do: replies in the role's private inbox.
    let inbox = oam::transport::subjects::private_inbox(&user).expect("a role of oam's");
    let nc = async_nats::ConnectOptions::with_user_and_password(user, password)
        .custom_inbox_prefix(inbox)
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
    let admin =
        oam::transport::connect::connect(&mesh.app_url(), "test-admin", false, &Default::default())
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

    // The Open Agent Mesh Python SDK serves under an SDK agent's role.
    issue(&mesh, "sdk-agent", "sdk.echo");
    let mut sdk = crate::support::spawn_sdk_echo(&mesh.role_url("sdk-agent-sdk.echo"));
    let call = in_folder(&mesh, &["agent", "call", "sdk.echo", r#"{"message":"hi"}"#]);
    let _ = sdk.kill();
    let _ = sdk.wait();
    assert_eq!(succeeded(&call), json!({"reply": "py:hi"}));

    // Revoked credentials close the connection and are refused from then on.
    let args = [
        "creds", "revoke", "--role", "agent", "--name", "evil", "--json",
    ];
    let revoked = in_folder(&mesh, &args);
    assert_eq!(succeeded(&revoked)["revoked"], "agent-evil");
    let said = String::from_utf8_lossy(&revoked.stderr);
    assert!(
        !said.contains("authorization violation"),
        "a success says no error: {said}"
    );
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

/// A client as `url`'s user the way the Open Agent Mesh SDK connects: NATS' default inbox.
async fn sdk_client(url: &str) -> async_nats::Client {
    let (bare, auth) = oam::transport::connect::split_credentials(url);
    let (user, password) = auth.expect("a URL with credentials");
    async_nats::ConnectOptions::with_user_and_password(user, password)
        .connect(bare.as_str())
        .await
        .unwrap()
}

/// Wait (at most 5 s) for a message on `sub`.
async fn next_msg(sub: &mut async_nats::Subscriber) -> async_nats::Message {
    tokio::time::timeout(Duration::from_secs(5), futures_util::StreamExt::next(sub))
        .await
        .expect("a message within 5 s")
        .expect("the subscription is open")
}

/// Publish `marker` on `nc`, then read `everything` (the admin's `>`) until it arrives: what was
/// delivered in between, in the server's order.
async fn delivered_until(
    nc: &async_nats::Client,
    marker: &str,
    everything: &mut async_nats::Subscriber,
) -> Vec<async_nats::Message> {
    nc.publish(marker.to_string(), "{}".into()).await.unwrap();
    nc.flush().await.unwrap();
    let mut seen = Vec::new();
    loop {
        let m = next_msg(everything).await;
        if m.subject.as_str() == marker {
            return seen;
        }
        seen.push(m);
    }
}

/// The attack that walked through every role: a user sends itself a message whose reply subject
/// is a control subject or a JetStream API call, then "answers" it. The server gives no role a
/// reply permission any more, so every such answer is refused and nothing arrives; and an oam
/// agent answers a caller's request only in a reply inbox, whatever subject the caller named.
#[tokio::test]
async fn no_role_answers_its_way_onto_a_control_subject() {
    let mesh = LocalCluster::up("bypass").await;
    issue(&mesh, "agent", "evil");
    let victim = issue(&mesh, "agent", "demo.victim");
    let admin =
        oam::transport::connect::connect(&mesh.app_url(), "test-admin", false, &Default::default())
            .await
            .unwrap();
    let mut everything = admin.subscribe(">").await.unwrap();
    admin.flush().await.unwrap();

    let (evil, errors) = client(&mesh.role_url("agent-evil")).await;
    let mut mine = evil.subscribe("mesh.agent.evil").await.unwrap();
    evil.flush().await.unwrap();
    let targets = [
        "oam.v1.chaos.node.n1",
        "oam.v1.chaos.inject",
        "mesh.death.demo.victim",
        "mesh.instance-death.abc",
        "oam.v1.decisionlog.n1",
        "$KV.oam-budgets.global",
        "$JS.API.STREAM.DELETE.KV_oam-budgets",
        "$JS.API.STREAM.PURGE.OAM_DECISIONS_n1",
        "$JS.API.STREAM.CREATE.CAPTURE",
    ];
    for target in targets {
        evil.publish_with_reply("mesh.agent.evil", target, "{}".into())
            .await
            .unwrap();
        let m = next_msg(&mut mine).await;
        assert_eq!(m.reply.as_deref(), Some(target));
        evil.publish(m.reply.unwrap(), r#"{"forged":true}"#.into())
            .await
            .unwrap();
    }
    let between = delivered_until(&evil, "mesh.health.evil", &mut everything).await;
    for target in targets {
        refused(&errors, "publish", target).await;
        assert!(
            !between.iter().any(|m| m.subject.as_str() == target),
            "{target} was delivered"
        );
    }
    let js = async_nats::jetstream::new(admin.clone());
    assert!(js.get_stream("KV_oam-budgets").await.is_ok());
    assert!(js.get_stream("CAPTURE").await.is_err());

    // A caller names a bucket as the reply subject of a call: the agent answers nobody there.
    let _served = Proc::spawn(&[
        "agent",
        "serve",
        "demo.victim",
        "--demo",
        "echo",
        "--json",
        "--creds",
        victim["file"].as_str().unwrap(),
    ]);
    let (caller, _) = client(&mesh.role_url("caller")).await;
    let answered = crate::support::eventually(Duration::from_secs(10), || {
        let caller = caller.clone();
        async move {
            let within = Duration::from_secs(2);
            oam::mesh::client::call(&caller, "demo.victim", r#"{"m":1}"#.into(), within)
                .await
                .ok()
        }
    })
    .await;
    assert!(answered.is_some(), "the agent serves ordinary calls");
    let bucket = "$KV.oam-budgets.agent.demo.victim";
    caller
        .publish_with_reply(
            "mesh.agent.demo.victim",
            bucket,
            r#"{"limit_usd":1e9}"#.into(),
        )
        .await
        .unwrap();
    // The answer to the next call comes after whatever the agent did with that one.
    let within = Duration::from_secs(5);
    let next = oam::mesh::client::call(&caller, "demo.victim", r#"{"m":2}"#.into(), within)
        .await
        .unwrap();
    assert_eq!(next.as_ref(), br#"{"m":2}"#);
    let between = delivered_until(&caller, "mesh.agent.marker", &mut everything).await;
    assert!(
        !between.iter().any(|m| m.subject.as_str() == bucket),
        "the agent answered into the budget bucket"
    );
}

/// What a hostile agent or viewer reads: nothing of anyone else's replies (oam's processes
/// answer in private inboxes), and the viewer never a data-plane request (they carry keys).
#[tokio::test]
async fn no_role_reads_another_s_replies_or_a_client_s_key() {
    let mesh = LocalCluster::up("snoop").await;
    issue(&mesh, "agent", "evil");
    let (evil, errors) = client(&mesh.role_url("agent-evil")).await;
    let sneaky = [
        "_INBOX.>",
        "_OAM.>",
        "_OAM.caller.>",
        "_OAM.re.>",
        "_OAM.re.*.caller.>",
        "oam.v1.request",
        "mesh.stream.>",
    ];
    for subject in sneaky {
        let _ = evil.subscribe(subject.to_string()).await.unwrap();
    }
    evil.flush().await.unwrap();
    for subject in sneaky {
        refused(&errors, "subscription", subject).await;
    }
    // The shared inbox is the SDK's: an SDK agent may read it, and oam's replies are not there.
    let issued = issue(&mesh, "sdk-agent", "sdk.evil");
    assert_eq!(issued["user"], "sdk-agent-sdk.evil", "{issued}");
    let sdk_evil = sdk_client(&mesh.role_url("sdk-agent-sdk.evil")).await;
    let mut shared = sdk_evil.subscribe("_INBOX.>").await.unwrap();
    sdk_evil.flush().await.unwrap();
    let (viewer, viewer_errors) = client(&mesh.role_url("viewer")).await;
    let mut decisions = viewer.subscribe("oam.v1.decision.*").await.unwrap();
    for subject in ["oam.v1.request", "oam.v1.>", "_INBOX.>", "_OAM.caller.>"] {
        let _ = viewer.subscribe(subject.to_string()).await.unwrap();
        viewer.flush().await.unwrap();
        refused(&viewer_errors, "subscription", subject).await;
    }

    // A round of ordinary use: a caller's NATS data-plane request with a key, an agent call and
    // the lists a viewer and a caller read.
    let (caller, _) = client(&mesh.role_url("caller")).await;
    let mut h = async_nats::HeaderMap::new();
    h.insert("Authorization", "Bearer sk-secret-of-the-caller");
    let body = json!({"messages": [{"role": "user", "content": "the card is 4111"}]});
    let asker = oam::transport::ask::Asker::new(caller.clone())
        .await
        .unwrap();
    let tag = oam::transport::subjects::ANSWERER_NODES;
    let body = serde_json::to_vec(&body).unwrap().into();
    let within = Duration::from_secs(10);
    let reply = asker
        .ask(tag, "oam.v1.request".into(), h, body, within)
        .await
        .unwrap();
    let answer: Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(answer["status"], 200, "{answer}");
    for args in [
        &["budget", "list", "--json"][..],
        &["escalation", "list", "--json"],
        &["agent", "list", "--json"],
    ] {
        succeeded(&in_folder(&mesh, args));
    }
    // The viewer sees the decision (that is its job), and no key in it.
    let decision = next_msg(&mut decisions).await;
    let text = String::from_utf8_lossy(&decision.payload);
    assert!(!text.contains("sk-secret"), "{text}");
    // The SDK agent read nothing of it all: the marker is the first thing on the shared inbox.
    let marker = "_INBOX.evil-marker";
    sdk_evil.publish(marker, "{}".into()).await.unwrap();
    sdk_evil.flush().await.unwrap();
    let first = next_msg(&mut shared).await;
    assert_eq!(
        first.subject.as_str(),
        marker,
        "the agent read {} ({:?})",
        first.subject,
        String::from_utf8_lossy(&first.payload)
    );
}

/// nats-server does not check where a push consumer delivers, so a role that may create one can
/// have a stream's messages copied onto any subject. Agents, callers and viewers may create none
/// on what agents write (the mesh's buckets); an SDK agent, whose client watches the catalog, can,
/// and the nodes drop what a consumer copies onto a control subject.
#[tokio::test]
async fn no_consumer_copies_an_agent_s_bytes_onto_a_control_subject() {
    let mesh = LocalCluster::up("copy").await;
    // Issued with the folder given relative to where the command runs: the server's reload
    // still finds every path.
    let parent = mesh.dir.0.parent().unwrap();
    let relative = mesh.dir.0.file_name().unwrap();
    let out = mesh
        .oam()
        .env_remove("OAM_NATS_URL")
        .current_dir(parent)
        .args([
            "creds", "issue", "--role", "agent", "--name", "evil", "--json", "--dir",
        ])
        .arg(relative)
        .output()
        .unwrap();
    assert_eq!(succeeded(&out)["reloaded"], true);
    issue(&mesh, "sdk-agent", "sdk.evil");
    let admin =
        oam::transport::connect::connect(&mesh.app_url(), "test-admin", false, &Default::default())
            .await
            .unwrap();
    let mut to_nodes = admin.subscribe("oam.v1.chaos.node.all").await.unwrap();
    admin.flush().await.unwrap();
    // What the agent writes where it may: a fault for every node, as the warden words them.
    let drain = json!({"action": "drain-budget", "id": "copied", "agent": "victim",
                       "until_ms": oam::clock::now_ms() + 60_000});
    let consumer = json!({"stream_name": "KV_mesh-catalog", "config": {
        "deliver_subject": "oam.v1.chaos.node.all", "deliver_policy": "last",
        "ack_policy": "none", "filter_subject": "$KV.mesh-catalog.catalog"}});
    let create = "$JS.API.CONSUMER.CREATE.KV_mesh-catalog";
    for user in ["agent-evil", "caller", "viewer"] {
        let (nc, errors) = client(&mesh.role_url(user)).await;
        if user == "agent-evil" {
            nc.publish("$KV.mesh-catalog.catalog", drain.to_string().into())
                .await
                .unwrap();
        }
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            nc.request(create, consumer.to_string().into()),
        )
        .await;
        refused(&errors, "publish", create).await;
    }
    // The SDK agent's consumer copies it: the server delivers it, every node drops it.
    let sdk = sdk_client(&mesh.role_url("sdk-agent-sdk.evil")).await;
    let made = sdk
        .request(create, consumer.to_string().into())
        .await
        .unwrap();
    let made: Value = serde_json::from_slice(&made.payload).unwrap();
    assert!(made["error"].is_null(), "{made}");
    let copied = next_msg(&mut to_nodes).await;
    assert_eq!(copied.payload.as_ref(), drain.to_string().as_bytes());
    assert!(
        oam::transport::subjects::from_jetstream(&copied),
        "{copied:?}"
    );
    // Had a node believed it, the victim's budget would be drained; its request is served.
    let body = json!({"messages": [{"role": "user", "content": "after the copy"}],
                      "oam": {"agent": "victim"}});
    for i in 0..3 {
        let r = crate::support::http(Duration::from_secs(10))
            .post(format!("{}/v1/chat/completions", mesh.node(i)))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "n{}: {v}", i + 1);
        let codes = v["oam"]["reason_codes"].to_string();
        assert!(!codes.contains("BUDGET"), "n{}: {v}", i + 1);
        assert_eq!(v["oam"]["fallback"], false, "n{}: {v}", i + 1);
    }
}

/// A bucket deleted (by the admin: no other role may) made `budget list`, `escalation list`
/// and `agent list` hang with no timeout, as their roles may not create it again. They now say
/// so within seconds and exit 3, and `oam mesh up` on the running mesh puts the buckets back.
#[tokio::test]
async fn a_missing_bucket_is_said_not_waited_for_and_mesh_up_puts_it_back() {
    let mesh = LocalCluster::up("missing-bucket").await;
    let admin =
        oam::transport::connect::connect(&mesh.app_url(), "test-admin", false, &Default::default())
            .await
            .unwrap();
    let js = async_nats::jetstream::new(admin);
    for stream in ["KV_oam-budgets", "KV_oam-escalations", "KV_mesh-catalog"] {
        js.delete_stream(stream).await.unwrap();
    }
    // At once: each waits a few seconds for the create its role may not make.
    let started = Instant::now();
    std::thread::scope(|s| {
        for args in [
            &["budget", "list"][..],
            &["escalation", "list"],
            &["agent", "list"],
        ] {
            let mesh = &mesh;
            s.spawn(move || {
                let out = in_folder(mesh, args);
                assert_eq!(out.status.code(), Some(3), "{args:?}");
                let err = String::from_utf8_lossy(&out.stderr);
                assert!(
                    err.contains("is missing and could not be created"),
                    "{args:?}: {err}"
                );
            });
        }
    });
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let up = mesh
        .oam()
        .env_remove("OAM_NATS_URL")
        .args(["mesh", "up", "--dir"])
        .arg(&mesh.dir.0)
        .output()
        .unwrap();
    assert!(
        up.status.success(),
        "{}",
        String::from_utf8_lossy(&up.stderr)
    );
    for args in [
        &["budget", "list", "--json"][..],
        &["escalation", "list", "--json"],
        &["agent", "list", "--json"],
    ] {
        succeeded(&in_folder(&mesh, args));
    }
}

/// The inboxes of role user `user`, as the server lists its connections' subscriptions to the
/// system account (what an attacker read off the monitoring port): every subject under
/// `prefix`, a wildcard's last token made concrete.
async fn inboxes_of(mesh: &LocalCluster, user: &str, prefix: &str) -> Vec<String> {
    let sys_url = oam::local::recorded_url(&mesh.dir.0, "sys_url").expect("a system URL");
    let sys = oam::transport::connect::connect(&sys_url, "test-sys", false, &Default::default())
        .await
        .unwrap();
    let query = json!({"subscriptions": true, "auth": true, "limit": 1024});
    let reply = sys
        .request("$SYS.REQ.SERVER.PING.CONNZ", query.to_string().into())
        .await
        .unwrap();
    let connz: Value = serde_json::from_slice(&reply.payload).unwrap();
    connz["data"]["connections"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["authorized_user"] == user)
        .flat_map(|c| {
            c["subscriptions_list"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|s| s.as_str().map(String::from))
        .filter(|s| s.starts_with(prefix))
        .map(|s| s.replace(".*", ".x").replace(".>", ".x"))
        .collect()
}

/// Publish a JetStream flow-control request (a status message, which no client library
/// writes) on each of `subjects` with reply `reply`, over a bare connection as `url`'s user:
/// the errors the server answered.
async fn flow_control(url: &str, subjects: &[String], reply: &str) -> Vec<String> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let (bare, auth) = oam::transport::connect::split_credentials(url);
    let (user, pass) = auth.expect("a URL with credentials");
    let addr = bare.trim_start_matches("nats://").to_string();
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (read, mut write) = stream.into_split();
    let mut lines = tokio::io::BufReader::new(read).lines();
    let info = lines.next_line().await.unwrap().unwrap();
    assert!(info.starts_with("INFO "), "{info}");
    let connect = json!({"user": user, "pass": pass, "headers": true, "verbose": false,
        "pedantic": false, "protocol": 1, "name": "test-flow-control"});
    let mut out = format!("CONNECT {connect}\r\n");
    let header = "NATS/1.0 100 FlowControl Request\r\n\r\n";
    for s in subjects {
        out += &format!(
            "HPUB {s} {reply} {} {}\r\n{header}\r\n",
            header.len(),
            header.len()
        );
    }
    out += "PING\r\n";
    write.write_all(out.as_bytes()).await.unwrap();
    let mut errors = Vec::new();
    loop {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("the server answers");
        if line.starts_with("-ERR") {
            errors.push(line);
        } else if line == "PONG" {
            return errors;
        }
    }
}

/// An agent publishes JetStream flow-control requests into every inbox a node reads, naming a
/// budget record as the reply: a node whose bucket watch was a push consumer answered each with
/// an empty body there, with its own rights (the budget emptied: nobody limited). Nobody but the
/// server may publish into a private inbox now (each is refused), and the node's watch is a
/// pull consumer, whose client answers nothing it is sent: the record stands.
#[tokio::test]
async fn a_flow_control_request_from_an_agent_empties_no_budget() {
    let mesh = LocalCluster::up("flow-control").await;
    issue(&mesh, "agent", "evil");
    succeeded(&in_folder(
        &mesh,
        &["budget", "set", "bob", "--limit", "5", "--json"],
    ));
    let admin =
        oam::transport::connect::connect(&mesh.app_url(), "test-admin", false, &Default::default())
            .await
            .unwrap();
    let record = "$KV.oam-budgets.agent.bob";
    let mut writes = admin.subscribe(record).await.unwrap();
    admin.flush().await.unwrap();
    let kv = async_nats::jetstream::new(admin.clone())
        .get_key_value("oam-budgets")
        .await
        .unwrap();
    let before = kv.entry("agent.bob").await.unwrap().expect("bob's budget");
    // The node reads its budget watch in one of these (a consumer's delivery or pull inbox).
    let inboxes = inboxes_of(&mesh, "node-n1", "_OAM.node.n1.").await;
    assert!(!inboxes.is_empty(), "the node reads inboxes");
    let errors = flow_control(&mesh.role_url("agent-evil"), &inboxes, record).await;
    for inbox in &inboxes {
        assert!(
            errors
                .iter()
                .any(|e| e.contains("Permissions Violation for Publish")
                    && e.contains(inbox.as_str())),
            "{inbox} was not refused: {errors:?}"
        );
    }
    // An answer to flow control is published at once: nothing in 2 s is nothing.
    let written = tokio::time::timeout(
        Duration::from_secs(2),
        futures_util::StreamExt::next(&mut writes),
    )
    .await;
    assert!(
        written.is_err(),
        "the budget record was written: {written:?}"
    );
    let after = kv.entry("agent.bob").await.unwrap().expect("bob's budget");
    assert_eq!(after.revision, before.revision);
    assert_eq!(after.value, before.value);
}

/// While a caller reads an agent's stream, a hostile agent writes into every inbox of the
/// caller's (found in the server's subscription list, as the attack found them) an end marker,
/// chunks of every sequence number and a forged `agent_died`, and another caller names those
/// inboxes as the reply of a data-plane request. A caller that believed them ended the stream
/// early, took the chunks or failed. Now the server refuses every write under the streaming
/// agent's answerer token or into the private inbox, and what evil may write under its own
/// token (or a node under the nodes') is not believed: the caller reads the stream whole, its
/// 20 chunks in order, then its own end.
#[tokio::test]
async fn nobody_ends_injects_into_or_fails_another_agent_s_stream() {
    use oam::mesh::protocol::{H_INSTANCE_ID, H_REQUEST_ID, H_STATUS, H_STREAM_END, H_STREAM_SEQ};
    let mesh = LocalCluster::up("forged-stream").await;
    issue(&mesh, "agent", "evil");
    let streamer = issue(&mesh, "agent", "demo.stream");
    let served = Proc::spawn(&[
        "agent",
        "serve",
        "demo.stream",
        "--demo",
        "stream:20:50",
        "--json",
        "--creds",
        streamer["file"].as_str().unwrap(),
    ]);
    let instance = served.ready["instances"][0].as_str().unwrap().to_string();
    let (reader, _) = client(&mesh.role_url("caller")).await;
    let caller = oam::mesh::client::Caller::new(reader).await.unwrap();
    let mut stream = caller
        .stream("demo.stream", r#"{"q": 1}"#.into(), Duration::from_secs(30))
        .await
        .unwrap();
    let first = stream
        .next()
        .await
        .expect("a chunk")
        .expect("the first chunk");
    assert_eq!(serde_json::from_slice::<Value>(&first).unwrap()["index"], 0);

    // Every subject the caller reads replies on: its private inbox (which only the server may
    // write) and its answer inboxes (`_OAM.re.{answerer}.caller.…`).
    let read = inboxes_of(&mesh, "caller", "_OAM.").await;
    assert!(
        read.iter()
            .any(|s| s.starts_with("_OAM.re.ag-demo~stream.caller."))
    );
    let aimed = |tag: &str| -> Vec<String> {
        read.iter()
            .map(|s| {
                let s = s.replace(".*", ".x").replace(".>", ".x");
                match s.strip_prefix("_OAM.re.").and_then(|r| r.split_once('.')) {
                    Some((_, rest)) => format!("_OAM.re.{tag}.{rest}"),
                    None => s,
                }
            })
            .collect()
    };
    // As the stream's own agent would write them (the server refuses them all: no publishing
    // into a private inbox, nor under another answerer's token), and under evil's own token
    // (delivered where the caller listens, and not believed).
    let (evil, evil_errors) = client(&mesh.role_url("agent-evil")).await;
    let (as_agent, as_evil) = (aimed("ag-demo~stream"), aimed("ag-evil"));
    let inboxes: Vec<&String> = as_agent.iter().chain(&as_evil).collect();
    let headers = |pairs: &[(&str, &str)]| {
        let mut h = async_nats::HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, *v);
        }
        h
    };
    for &inbox in &inboxes {
        for seq in 1..=20 {
            let seq = seq.to_string();
            let chunk = headers(&[
                (H_STREAM_SEQ, &seq),
                (H_STREAM_END, "false"),
                (H_REQUEST_ID, "guessed"),
                (H_INSTANCE_ID, &instance),
            ]);
            evil.publish_with_headers(inbox.clone(), chunk, r#"{"forged": true}"#.into())
                .await
                .unwrap();
        }
        let end = headers(&[
            (H_STREAM_SEQ, "4"),
            (H_STREAM_END, "true"),
            (H_INSTANCE_ID, &instance),
        ]);
        evil.publish_with_headers(inbox.clone(), end, "".into())
            .await
            .unwrap();
        let died = json!({"code": "agent_died", "message": "forged", "agent": "demo.stream",
            "request_id": "guessed", "details": {}});
        let error = headers(&[
            (H_STATUS, "error"),
            (H_STREAM_END, "true"),
            (H_INSTANCE_ID, &instance),
        ]);
        evil.publish_with_headers(inbox.clone(), error, died.to_string().into())
            .await
            .unwrap();
    }
    evil.flush().await.unwrap();
    for inbox in &as_agent {
        refused(&evil_errors, "publish", inbox).await;
    }
    // Another caller names them as the reply of a data-plane request: a node answers only under
    // the nodes' token, where the caller believes no chunk.
    let (other, _) = client(&mesh.role_url("caller")).await;
    let ask = json!({"model": "auto", "messages": [{"role": "user", "content": "hi"}]});
    for inbox in inboxes.iter().copied().chain(&aimed("nodes")) {
        other
            .publish_with_reply("oam.v1.request", inbox.clone(), ask.to_string().into())
            .await
            .unwrap();
    }
    other.flush().await.unwrap();

    let mut indexes = vec![0];
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("the stream is not failed by anyone but its agent");
        let v: Value = serde_json::from_slice(&chunk).unwrap();
        assert!(v.get("forged").is_none(), "a forged chunk was taken: {v}");
        indexes.push(v["index"].as_u64().unwrap());
    }
    assert_eq!(
        indexes,
        (0..20).collect::<Vec<u64>>(),
        "the whole stream, in order"
    );
}

/// A viewer (or operator) found the nodes' consumers on the budget bucket (here as the admin
/// lists them; the attack read them off the monitoring port) and deleted them: a budget change
/// went unseen for ~14 s. No role but the admin may delete a consumer now: refused by the
/// server, and the node's consumer stays.
#[tokio::test]
async fn no_role_deletes_the_nodes_consumers() {
    let mesh = LocalCluster::up("consumers").await;
    let admin =
        oam::transport::connect::connect(&mesh.app_url(), "test-admin", false, &Default::default())
            .await
            .unwrap();
    let js = async_nats::jetstream::new(admin.clone());
    let stream = js.get_stream("KV_oam-budgets").await.unwrap();
    let names = crate::support::eventually(Duration::from_secs(10), || {
        let js = js.clone();
        async move {
            use futures_util::TryStreamExt;
            let names: Vec<String> = js
                .get_stream("KV_oam-budgets")
                .await
                .ok()?
                .consumer_names()
                .try_collect()
                .await
                .ok()?;
            (names.len() >= 3).then_some(names)
        }
    })
    .await
    .expect("every node watches the budget bucket");
    for user in ["viewer", "operator"] {
        let (nc, errors) = client(&mesh.role_url(user)).await;
        for name in &names {
            let subject = format!("$JS.API.CONSUMER.DELETE.KV_oam-budgets.{name}");
            nc.publish(subject.clone(), "".into()).await.unwrap();
            nc.flush().await.unwrap();
            refused(&errors, "publish", &subject).await;
        }
    }
    for name in &names {
        assert!(
            stream.consumer_info(name).await.is_ok(),
            "{name} was deleted"
        );
    }
}

/// The viewer could create consumers without bound (500 durable ones in 0.4 s): each is the
/// server's to keep, and one slot used is one the nodes may need. It now reads the decision log
/// and the buckets by key and direct get: every consumer create it tries, ephemeral or durable,
/// is refused by the server, `oam audit` and `oam explain` still read the log as it, and no
/// consumer is left on the log.
///
/// And a node's credentials could fill the one shared log with junk (35 x 1.9 MB in 10 s),
/// pushing every other node's records out. Each node now writes a stream of its own, the log's
/// size shared out among them: a node overfilling its own pushes out only its own records.
#[tokio::test]
async fn the_log_is_read_without_consumers_and_written_per_node() {
    let mesh = LocalCluster::up("viewer-reads").await;
    let body = json!({"messages": [{"role": "user", "content": "to be read"}]});
    let r = crate::support::http(Duration::from_secs(10))
        .post(format!("{}/v1/chat/completions", mesh.node(0)))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.unwrap();
    let id = v["oam"]["request_id"].as_str().unwrap().to_string();

    let admin =
        oam::transport::connect::connect(&mesh.app_url(), "test-admin", false, &Default::default())
            .await
            .unwrap();
    let js = async_nats::jetstream::new(admin);
    let info = |name: &'static str| {
        let js = js.clone();
        async move { js.get_stream(name).await.unwrap().get_info().await.unwrap() }
    };
    let mut shared = 0;
    for name in ["OAM_DECISIONS_n1", "OAM_DECISIONS_n2", "OAM_DECISIONS_n3"] {
        shared += info(name).await.config.max_bytes;
    }
    let whole = i64::try_from(oam::transport::store::decisions::DEFAULT_MAX_BYTES).unwrap();
    assert_eq!(
        shared,
        whole / 3 * 3,
        "the log's size is shared by the nodes"
    );
    // A node given credentials later gets its stream and its share of the same log (the
    // viewer reading it too: `oam audit` below reads all four).
    succeeded(&in_folder(
        &mesh,
        &["creds", "issue", "--role", "node", "--name", "n4", "--json"],
    ));
    let mut shared = 0;
    for name in [
        "OAM_DECISIONS_n1",
        "OAM_DECISIONS_n2",
        "OAM_DECISIONS_n3",
        "OAM_DECISIONS_n4",
    ] {
        shared += info(name).await.config.max_bytes;
    }
    assert_eq!(shared, whole / 3 * 3 / 4 * 4, "shared by four nodes now");
    // n2's share made small (as a small `[decision_log] max_bytes` would), then its
    // credentials write four times that in junk on its own subject.
    let mut small = info("OAM_DECISIONS_n2").await.config;
    small.max_bytes = 2 << 20;
    js.update_stream(small).await.unwrap();
    let (n2, n2_errors) = client(&mesh.role_url("node-n2")).await;
    let as_n2 = async_nats::jetstream::new(n2.clone());
    let junk = bytes::Bytes::from(vec![b'x'; 256 << 10]);
    for _ in 0..32 {
        let ack = as_n2
            .publish(oam::transport::subjects::decision_log("n2"), junk.clone())
            .await
            .unwrap();
        ack.await.unwrap();
    }
    let n2_log = info("OAM_DECISIONS_n2").await.state;
    assert!(n2_log.bytes <= 2 << 20, "{} bytes", n2_log.bytes);
    assert!(n2_log.messages < 32, "{} messages", n2_log.messages);
    // Another node's subject is refused.
    let n1_subject = oam::transport::subjects::decision_log("n1");
    n2.publish(n1_subject.clone(), junk.clone()).await.unwrap();
    n2.flush().await.unwrap();
    refused(&n2_errors, "publish", &n1_subject).await;

    let (viewer, errors) = client(&mesh.role_url("viewer")).await;
    let config = json!({"config": {"ack_policy": "none", "durable_name": "mine"}});
    for stream in ["OAM_DECISIONS_n1", "KV_oam-budgets", "KV_oam-escalations"] {
        for create in [
            format!("$JS.API.CONSUMER.CREATE.{stream}"),
            format!("$JS.API.CONSUMER.CREATE.{stream}.mine"),
            format!("$JS.API.CONSUMER.CREATE.{stream}.mine.>"),
            format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.mine"),
        ] {
            viewer
                .publish(create.clone(), config.to_string().into())
                .await
                .unwrap();
            viewer.flush().await.unwrap();
            refused(&errors, "publish", &create).await;
        }
    }

    let as_viewer = |args: &[&str]| {
        let out = mesh
            .oam()
            .env("OAM_NATS_URL", mesh.role_url("viewer"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    };
    let listed = crate::support::eventually(Duration::from_secs(10), || async {
        let (code, out) = as_viewer(&["audit", "--json", "--since", "10m"]);
        (code == Some(0) && out.contains(&id)).then_some(out)
    })
    .await;
    assert!(listed.is_some(), "the viewer's audit lists {id}");
    let (code, out) = as_viewer(&["explain", &id, "--json"]);
    assert_eq!(code, Some(0), "{out}");
    let explained: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        explained["record"]["decision"]["request_id"],
        id.as_str(),
        "{explained}"
    );

    // n1's record is there, read as the viewer past n2's junk (`oam explain` above); and no
    // one left a consumer on any node's log.
    for name in ["OAM_DECISIONS_n1", "OAM_DECISIONS_n2", "OAM_DECISIONS_n4"] {
        assert_eq!(info(name).await.state.consumer_count, 0, "{name}");
    }
}

/// The nats-server's HTTP monitoring port listed every user, private inbox and consumer to
/// anyone on the machine, without a password: the map the attacks on other roles' inboxes
/// were aimed with. A mesh opens none unless asked (`--nats-monitor`); what oam needs of the
/// server it asks the system account, which a role's credentials cannot.
#[tokio::test]
async fn a_mesh_has_no_monitoring_port_unless_asked() {
    let mesh = LocalCluster::up("no-map").await;
    for s in &mesh.record.servers {
        assert_eq!(s.monitor_port, 0, "{}", s.name);
        let conf = std::fs::read_to_string(s.dir.join("nats.conf")).unwrap();
        assert!(
            !conf.lines().any(|l| l.trim_start().starts_with("http")),
            "{conf}"
        );
        // JetStream's store is sized to the disk (three quarters of what was free), so it
        // can never fill it, and the reload keeps that size.
        let stored = s.store_bytes.expect("sized to the disk");
        assert!(stored > 0 && stored <= 1 << 30, "{stored}");
        assert!(
            conf.contains(&format!("max_file_store: {stored}")),
            "{conf}"
        );
    }
    // The system account answers what the port told (here JetStream's state).
    let sys_url = oam::local::recorded_url(&mesh.dir.0, "sys_url").expect("a system URL");
    let sys = oam::transport::connect::connect(&sys_url, "test-sys", false, &Default::default())
        .await
        .unwrap();
    let jsz = oam::local::natsd::server_info(&sys, oam::local::natsd::LONE_NAME, "JSZ")
        .await
        .expect("the server answers the system account");
    assert!(jsz["data"]["config"]["store_dir"].is_string(), "{jsz}");
    // A role cannot ask it: the system account's subjects are not in the application account.
    let (viewer, _) = client(&mesh.role_url("viewer")).await;
    let asked = tokio::time::timeout(
        Duration::from_secs(3),
        viewer.request("$SYS.REQ.SERVER.PING.JSZ", "{}".into()),
    )
    .await;
    assert!(
        !matches!(asked, Ok(Ok(_))),
        "a viewer read the server's JetStream state"
    );
}

/// The catalog is one key any agent may write (the Open Agent Mesh layout): a hostile agent
/// empties it. Before, the catalog stayed
/// so (`oam agent list` showed nobody, a caller could not tell "not available" from "not
/// found"); now the live agent's next catalog check (every 10 beats) lists it again as it is.
#[tokio::test]
async fn an_agent_emptying_the_shared_catalog_is_undone_by_the_live_agents() {
    use oam::transport::subjects::{CATALOG_BUCKET, CATALOG_KEY};
    let mesh = LocalCluster::up("catalog").await;
    issue(&mesh, "agent", "evil");
    let victim = issue(&mesh, "agent", "demo.victim");
    let _served = Proc::spawn(&[
        "agent",
        "serve",
        "demo.victim",
        "--demo",
        "echo",
        "--json",
        "--creds",
        victim["file"].as_str().unwrap(),
    ]);
    let (evil, errors) = client(&mesh.role_url("agent-evil")).await;
    let js = async_nats::jetstream::new(evil);
    let subject = format!("$KV.{CATALOG_BUCKET}.{CATALOG_KEY}");
    let listed = || async {
        let out = mesh
            .oam()
            .args(["agent", "list", "--json"])
            .output()
            .unwrap();
        let all: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
        all.into_iter().find(|a| a["name"] == "demo.victim")
    };
    let start = listed().await.expect("the agent is listed at start");
    // (A changed entry is undone the same way: the instance compares its entry whole.)
    for forged in [json!([])] {
        let write = js
            .publish(subject.clone(), forged.to_string().into())
            .await
            .unwrap();
        write
            .await
            .expect("an agent may write the shared catalog key");
        let at = Instant::now();
        let back = crate::support::eventually(Duration::from_secs(15), || async {
            let a = listed().await?;
            (a["description"] == start["description"] && a["tags"] == start["tags"]).then_some(a)
        })
        .await;
        assert!(
            back.is_some(),
            "after {forged}, the live agent was not listed again as it is; errors: {:?}",
            errors.lock().unwrap()
        );
        assert!(
            at.elapsed() <= Duration::from_secs(12),
            "{:?}",
            at.elapsed()
        );
    }
}
