//! `oam mesh up / status / down` as a user runs them: real processes, a real state folder.

use assert_cmd::Command;
use serde_json::{Value, json};
use std::time::Duration;

fn oam() -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin!("oam"));
    c.timeout(Duration::from_secs(60));
    c
}

use crate::support::ClusterDir as Dir;

fn json(out: &[u8]) -> Value {
    serde_json::from_slice(out).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(out)))
}

#[tokio::test]
async fn up_status_request_down() {
    // `oam mesh up` itself, as an operator runs it, from a shell holding a file open (a lock
    // file, say) that is not close-on-exec: `oam mesh up` inherits it, the mesh must not.
    let dir = crate::support::ClusterDir::new("mesh");
    std::fs::create_dir_all(&dir.0).unwrap();
    let held_path = dir.0.join("held.lock");
    let held = std::fs::File::create(&held_path).unwrap();
    {
        use std::os::fd::AsRawFd;
        // SAFETY: plain integer arguments on a descriptor this test owns.
        let cleared = unsafe { libc::fcntl(held.as_raw_fd(), libc::F_SETFD, 0) };
        assert_eq!(cleared, 0);
    }
    let out = oam()
        .args([
            "mesh",
            "up",
            "--port",
            "0",
            "--sim-port",
            "0",
            "--http-port",
            "0",
        ])
        .args(["--json", "--dir"])
        .arg(&dir.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let up = &json(&out.stdout);
    drop(held);
    let mesh = crate::support::LocalCluster::recorded_in(dir);
    let dir = &mesh.dir;
    for p in &mesh.record.processes {
        let fds = std::fs::read_dir(format!("/proc/{}/fd", p.pid)).unwrap();
        for fd in fds {
            let target = std::fs::read_link(fd.unwrap().path()).unwrap_or_default();
            assert_ne!(
                target, held_path,
                "{} inherited the caller's open file",
                p.name
            );
        }
    }
    let nodes = up["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3);

    // Credentials are private to the owner: every password in system.json, each role's own in
    // its file (0600, in a 0700 folder), and no role file holds the admin's or the system
    // account's password (which can kick any connection).
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir.0.join("system.json")), 0o600);
    assert_eq!(mode(&dir.0.join("creds")), 0o700);
    assert!(!dir.0.join("credentials.json").exists());
    let system = json(&std::fs::read(dir.0.join("system.json")).unwrap());
    let secrets = ["sys_password", "app_password"]
        .map(|k| system["credentials"][k].as_str().unwrap().to_string());
    let mut users = Vec::new();
    for file in std::fs::read_dir(dir.0.join("creds")).unwrap() {
        let path = file.unwrap().path();
        assert_eq!(mode(&path), 0o600, "{}", path.display());
        let given = std::fs::read_to_string(&path).unwrap();
        assert!(
            secrets.iter().all(|s| !given.contains(s.as_str())),
            "{given}"
        );
        users.push(json(given.as_bytes())["user"].as_str().unwrap().to_string());
    }
    users.sort();
    assert_eq!(
        users,
        [
            "caller", "monitor", "node-n1", "node-n2", "node-n3", "operator", "viewer", "warden"
        ]
    );

    // Twice: already up, and where.
    oam()
        .args(["mesh", "up", "--dir"])
        .arg(&dir.0)
        .assert()
        .success()
        .stdout(predicates::str::contains("already up"));
    // Every command names the mesh the same way: --dir, or OAM_DIR, with no URL given.
    oam()
        .env_remove("OAM_NATS_URL")
        .args(["agent", "list", "--json", "--dir"])
        .arg(&dir.0)
        .assert()
        .success();
    oam()
        .env_remove("OAM_NATS_URL")
        .env("OAM_DIR", &dir.0)
        .args(["chaos", "list", "--json"])
        .assert()
        .success();
    let again = oam()
        .args(["mesh", "up", "--json", "--dir"])
        .arg(&dir.0)
        .output()
        .unwrap();
    assert!(again.status.success());
    let doc = json(&again.stdout);
    assert_eq!(doc["already_up"], true, "{doc}");
    assert_eq!(doc["running"], doc["processes"]);

    // Half dead: a node and the nats-server killed. `mesh up` starts exactly those again (the
    // server on its port, the node with its role's credentials), and the mesh is whole.
    let record = |name: &str| {
        let rec = oam::local::MeshRecord::load(&dir.0).unwrap().unwrap();
        rec.processes.into_iter().find(|p| p.name == name).unwrap()
    };
    for name in ["n2", "nats-server"] {
        assert!(oam::local::signal(record(name).pid, libc::SIGKILL));
    }
    let dead = crate::support::eventually(Duration::from_secs(5), || async {
        (!oam::local::is_ours(&record("n2")) && !oam::local::is_ours(&record("nats-server")))
            .then_some(())
    });
    assert!(dead.await.is_some(), "both are gone");
    let repaired = oam()
        .args(["mesh", "up", "--json", "--dir"])
        .arg(&dir.0)
        .output()
        .unwrap();
    assert!(
        repaired.status.success(),
        "{}",
        String::from_utf8_lossy(&repaired.stderr)
    );
    assert_eq!(
        json(&repaired.stdout)["repaired"],
        serde_json::json!(["nats-server", "n2"])
    );
    let whole = crate::support::eventually(Duration::from_secs(20), || async {
        let out = oam()
            .args(["mesh", "status", "--json", "--dir"])
            .arg(&dir.0)
            .output()
            .ok()?;
        (json(&out.stdout)["healthy"] == true).then_some(())
    })
    .await;
    assert!(whole.is_some(), "the repaired mesh is healthy");

    let status = oam()
        .args(["mesh", "status", "--json", "--dir"])
        .arg(&dir.0)
        .output()
        .unwrap();
    assert!(status.status.success());
    assert_eq!(json(&status.stdout)["healthy"], true);
    // The table fits a 60-column terminal, names whole; --wide keeps each row on one line.
    let table = oam()
        .env("COLUMNS", "60")
        .args(["mesh", "status", "--dir"])
        .arg(&dir.0)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.lines().all(|l| l.chars().count() <= 60) && text.contains("nats-server"),
        "{text}"
    );
    let wide = oam()
        .env("COLUMNS", "60")
        .args(["mesh", "status", "--wide", "--dir"])
        .arg(&dir.0)
        .output()
        .unwrap();
    let wide = String::from_utf8_lossy(&wide.stdout);
    assert!(wide.lines().any(|l| l.chars().count() > 60), "{wide}");
    assert!(wide.lines().count() < text.lines().count(), "{wide}");

    // Any OpenAI-shaped client can use it.
    let c = crate::support::http(Duration::from_secs(20));
    let url = nodes[0]["http"].as_str().unwrap();
    let r = c
        .post(format!("{url}/v1/chat/completions"))
        .json(
            &serde_json::json!({"model": "auto", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // Bounded load through all three nodes, the result as JSON.
    let bench = oam()
        .args(["bench", "-n", "60", "-c", "12", "--json", "--dir"])
        .arg(&dir.0)
        .output()
        .unwrap();
    assert!(
        bench.status.success(),
        "{}",
        String::from_utf8_lossy(&bench.stderr)
    );
    let report = json(&bench.stdout);
    assert_eq!(report["sent"], 60);
    assert_eq!(report["success_rate"], 1.0, "{report}");
    assert_eq!(report["plan"]["urls"].as_array().unwrap().len(), 3);
    assert_eq!(report["providers"]["primary"], 60);
    assert!(
        report["latency_ms"]["p50"].as_f64().unwrap() >= 150.0,
        "the simulated latency is in it"
    );

    // The same on the NATS data plane, with a request mix.
    let bench = oam()
        .args(["bench", "-n", "30", "-c", "6", "--nats", "--json"])
        .args([
            "--mix",
            "risk=high,priority=critical,agent=vip",
            "--mix",
            "weight=2",
        ])
        .arg("--dir")
        .arg(&dir.0)
        .output()
        .unwrap();
    assert!(
        bench.status.success(),
        "{}",
        String::from_utf8_lossy(&bench.stderr)
    );
    let report = json(&bench.stdout);
    assert_eq!(report["sent"], 30);
    assert_eq!(report["success_rate"], 1.0, "{report}");
    assert_eq!(report["plan"]["mix"].as_array().unwrap().len(), 2);
    assert!(
        report["reason_codes"]["ACCEPTED"].as_u64() == Some(30),
        "{report}"
    );
    let bad = oam()
        .args(["bench", "-n", "1", "--mix", "risk=extreme", "--dir"])
        .arg(&dir.0)
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("risk (low|medium|high)"));

    openai_python_client_works_unchanged(url, up["sim"].as_str().unwrap());
    every_api_answers_model_auto(url);

    let down = oam()
        .args(["mesh", "down", "--json", "--dir"])
        .arg(&dir.0)
        .output()
        .unwrap();
    assert!(down.status.success());
    let stopped = json(&down.stdout)["stopped"].as_array().unwrap().clone();
    let names: Vec<&str> = stopped
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["chaos", "monitor", "n3", "n2", "n1", "sim", "nats-server"],
        "newest first"
    );
    assert!(
        stopped.iter().all(|s| s["how"] == "terminated"),
        "{stopped:?}"
    );
    for s in &stopped {
        let pid = s["pid"].as_u64().unwrap();
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists() || {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                stat.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            },
            "{pid} still running"
        );
    }
    oam()
        .args(["mesh", "status", "--dir"])
        .arg(&dir.0)
        .assert()
        .code(3);
}

/// On the mesh `oam mesh up` starts, with no configuration, the official SDKs get `auto`
/// served in each API a node speaks: chat, Anthropic's Messages, OpenAI's Responses and
/// embeddings.
fn every_api_answers_model_auto(node_url: &str) {
    let script = r#"
import json, sys, openai, anthropic
o = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="not-needed", max_retries=0)
a = anthropic.Anthropic(base_url=sys.argv[1], api_key="not-needed", max_retries=0)
chat = o.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}])
msg = a.messages.create(model="auto", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
resp = o.responses.create(model="auto", input="hi")
emb = o.embeddings.create(model="auto", input=["hi", "there"])
print(json.dumps({"chat": chat.choices[0].message.content, "messages": msg.content[0].text,
                  "responses": resp.output_text, "embeddings": [len(d.embedding) for d in emb.data],
                  "embedding_model": emb.model}))
"#;
    let v = crate::support::python_json(script, &[node_url]);
    for api in ["chat", "messages", "responses"] {
        assert!(
            v[api].as_str().is_some_and(|t| t.contains("answer")),
            "{api}: {v}"
        );
    }
    assert_eq!(v["embeddings"], serde_json::json!([8, 8]), "{v}");
    assert_eq!(v["embedding_model"], "sim-embed", "{v}");
}

/// The official OpenAI Python client, pointed at a node, with oam's fields in `extra_body`; a
/// tool-calling request reaches the upstream (the simulator at `sim_url`) as it was sent.
fn openai_python_client_works_unchanged(node_url: &str, sim_url: &str) {
    let python =
        std::env::var("OAM_TEST_PYTHON").unwrap_or_else(|_| ".tools/venv/bin/python".into());
    let script = r#"
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="not-needed", max_retries=0)
raw = c.chat.completions.with_raw_response.create(
    model="auto",
    messages=[{"role": "user", "content": "What is oam?"}],
    extra_body={"oam": {"agent": "py-agent", "task": "faq", "risk": "low"}},
)
r = raw.parse()
out = {
    "content": r.choices[0].message.content,
    "oam": (r.model_extra or {}).get("oam"),
    "phase": raw.headers.get("x-oam-phase"),
}
# Streaming: the checked answer arrives as server-sent events the client reassembles.
chunks = list(c.chat.completions.create(
    model="auto", messages=[{"role": "user", "content": "Stream it"}], stream=True,
))
out["streamed"] = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
out["stream_finish"] = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
out["stream_oam"] = (chunks[-1].model_extra or {}).get("oam", {}).get("outcome")
try:
    c.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    out["unknown_model"] = "accepted?!"
except openai.NotFoundError as e:
    out["unknown_model"] = e.status_code
# A tool-calling agent's turn: everything oam does not interpret reaches the upstream as sent.
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}}]
messages = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [
        {"type": "text", "text": "Weather in Paris?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"c\": 21}"},
]
r = c.chat.completions.create(
    model="auto", messages=messages, tools=tools, tool_choice="auto", temperature=0.2, top_p=0.9,
    stop=["END"], seed=7, n=1, user="u-42", metadata={"trace": "t-1"}, logprobs=False,
    extra_body={"oam": {"agent": "py-tools", "request_id": "pass-through-1"},
                "future_field": {"kept": True}},
)
served = (r.model_extra or {}).get("oam", {}).get("target")
import urllib.request
with urllib.request.urlopen(sys.argv[2] + "/sim/requests/" + served) as resp:
    # Health probes reach it too: ours is the one from user u-42.
    out["upstream"] = [r for r in json.load(resp) if r.get("user") == "u-42"][-1]
out["sent_messages"] = messages
out["sent_tools"] = tools
# The round trip: tools in, tool_calls out (the upstream's answer as it came), the tool's
# result back, a final answer; and the same call streamed, as tool-call deltas.
turn = [{"role": "user", "content": "Weather in Paris?"}]
r1 = c.chat.completions.create(model="auto", messages=turn, tools=tools)
call = r1.choices[0].message.tool_calls[0]
out["tool_finish"] = r1.choices[0].finish_reason
out["tool_call"] = {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
out["fingerprint"] = r1.system_fingerprint
out["tool_oam"] = (r1.model_extra or {}).get("oam", {}).get("outcome")
turn.append(r1.choices[0].message.model_dump(exclude_none=True))
turn.append({"role": "tool", "tool_call_id": call.id, "content": "{\"celsius\": 21}"})
r2 = c.chat.completions.create(model="auto", messages=turn, tools=tools)
out["final_finish"] = r2.choices[0].finish_reason
out["final_content"] = r2.choices[0].message.content
streamed = list(c.chat.completions.create(
    model="auto", messages=turn[:1], tools=tools, stream=True))
# Streamed live, as OpenAI streams a tool call: its name first, its arguments in pieces.
deltas = [tc for ch in streamed if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
out["streamed_tool"] = [tc.function.name for tc in deltas if tc.function.name]
out["streamed_args"] = json.loads("".join(tc.function.arguments or "" for tc in deltas))
print(json.dumps(out))
"#;
    let out = std::process::Command::new(&python)
        .args(["-c", script, node_url, sim_url])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python} ({e}); run scripts/install-test-tools"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out.stdout);
    assert!(v["content"].as_str().unwrap().contains("answer"), "{v}");
    assert_eq!(v["phase"], "accepted");
    assert!(v["streamed"].as_str().unwrap().contains("answer"), "{v}");
    assert_eq!(v["stream_finish"], "stop", "{v}");
    assert_eq!(v["stream_oam"], "accepted", "{v}");
    assert_eq!(v["oam"]["outcome"], "accepted");
    assert_eq!(v["unknown_model"], 404, "not found, as the vendors answer");
    // Passed through unchanged: every message shape, the tools, every parameter, unknown
    // fields; oam's own object stays with oam; the model is the upstream's.
    let up = &v["upstream"];
    assert_eq!(up["messages"], v["sent_messages"], "{up}");
    assert_eq!(up["tools"], v["sent_tools"]);
    for (field, value) in [
        ("tool_choice", json!("auto")),
        ("temperature", json!(0.2)),
        ("top_p", json!(0.9)),
        ("stop", json!(["END"])),
        ("seed", json!(7)),
        ("n", json!(1)),
        ("user", json!("u-42")),
        ("metadata", json!({"trace": "t-1"})),
        ("logprobs", json!(false)),
        ("future_field", json!({"kept": true})),
    ] {
        assert_eq!(up[field], value, "{field}: {up}");
    }
    assert!(up.get("oam").is_none(), "{up}");
    assert!(up["model"].as_str().is_some_and(|m| m != "auto"), "{up}");
    // A tool-calling agent works through oam: the tool call comes back as the upstream sent it
    // (its fingerprint too), the tool's result gets the final answer, streaming carries deltas.
    assert_eq!(v["tool_finish"], "tool_calls", "{v}");
    assert_eq!(
        v["tool_call"],
        json!({"name": "get_weather", "arguments": {"city": "Weather in Paris?"}})
    );
    assert!(
        v["fingerprint"]
            .as_str()
            .is_some_and(|f| f.starts_with("oam-sim-")),
        "{v}"
    );
    assert_eq!(v["tool_oam"], "accepted");
    assert_eq!(v["final_finish"], "stop", "{v}");
    assert!(v["final_content"].as_str().is_some_and(|c| !c.is_empty()));
    assert_eq!(v["streamed_tool"], json!(["get_weather"]), "{v}");
    assert!(v["streamed_args"]["city"].is_string(), "{v}");
}

#[test]
fn a_port_in_use_says_what_to_do() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let dir = Dir::new("mesh-port");
    oam()
        .args(["mesh", "up", "--port", &port, "--dir"])
        .arg(&dir.0)
        .assert()
        .code(2)
        .stderr(predicates::str::contains("in use").and(predicates::str::contains("--port 0")));
    assert!(
        !dir.0.join("mesh.json").exists(),
        "nothing was started or recorded"
    );
}

use predicates::prelude::PredicateBooleanExt as _;

/// A folder keeps its NATS credentials across `mesh down` and `mesh up` (running agents and
/// watches reconnect by themselves); `--new-credentials` replaces them.
#[tokio::test]
async fn credentials_survive_down_and_up_unless_renewed() {
    let dir = crate::support::ClusterDir::new("creds");
    // Every password is in system.json (each role gets its own file in creds/).
    let creds = || -> Value {
        json(&std::fs::read(dir.0.join("system.json")).unwrap())["credentials"].clone()
    };
    let up = |extra: &[&str]| {
        oam()
            .args([
                "mesh",
                "up",
                "--nodes",
                "1",
                "--port",
                "0",
                "--sim-port",
                "0",
            ])
            .args(["--http-port", "0", "--json", "--dir"])
            .arg(&dir.0)
            .args(extra)
            .assert()
            .success();
    };
    let down = || {
        oam()
            .args(["mesh", "down", "--dir"])
            .arg(&dir.0)
            .assert()
            .success();
    };
    up(&[]);
    let first = creds();
    assert!(
        first["app_password"]
            .as_str()
            .is_some_and(|p| p.len() >= 32)
    );
    let port = || {
        oam::local::MeshRecord::load(&dir.0)
            .unwrap()
            .unwrap()
            .servers[0]
            .port
    };
    let before = port();
    down();
    up(&[]);
    assert_eq!(creds(), first, "the same passwords after down and up");
    assert_eq!(
        port(),
        before,
        "--port 0 takes the folder's last NATS port again while it is free"
    );
    let given = json(&std::fs::read(dir.0.join("creds/viewer.json")).unwrap());
    let viewer = first["users"]["viewer"].as_str().unwrap();
    assert!(given["url"].as_str().unwrap().contains(viewer), "{given}");
    down();
    up(&["--new-credentials"]);
    let renewed = creds();
    assert_ne!(renewed["app_password"], first["app_password"]);
    assert_ne!(renewed["sys_password"], first["sys_password"]);
    down();
}

/// Every long-running process of a mesh (nodes, simulator, monitor, chaos warden, an agent, a
/// listener) stops within 2 s of SIGTERM or SIGINT after NATS has died under it, a fault active
/// (the warden ends it on the way out).
#[tokio::test]
async fn every_long_running_process_stops_within_two_seconds_without_nats() {
    use crate::support::{LocalCluster, Proc, eventually, process_state};
    let mesh = LocalCluster::up("stop-bound").await;
    let url = mesh.app_url();
    let agent = Proc::spawn(&[
        "agent",
        "serve",
        "demo.stop",
        "--demo",
        "echo",
        "--json",
        "--nats-url",
        &url,
    ]);
    let mut listener = std::process::Command::new(assert_cmd::cargo::cargo_bin!("oam"))
        .args(["listen", "stop.>", "--nats-url", &url])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The listener is subscribed once a message published now reaches its output.
    let nc = oam::transport::connect::connect(&url, "test", false, &Default::default())
        .await
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = listener.stdout.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let heard = eventually(Duration::from_secs(10), || async {
        nc.publish("stop.ping", "x".into()).await.ok()?;
        nc.flush().await.ok()?;
        rx.recv_timeout(Duration::from_millis(200)).ok()
    })
    .await;
    assert!(heard.is_some(), "the listener hears the bus");
    let fault = mesh
        .oam()
        .args(["chaos", "kill-provider", "primary", "--for", "60s"])
        .output()
        .unwrap();
    assert!(
        fault.status.success(),
        "{}",
        String::from_utf8_lossy(&fault.stderr)
    );

    let server = mesh.pid("nats-server");
    assert!(oam::local::signal(server, libc::SIGKILL));
    let dead = eventually(Duration::from_secs(5), || async {
        matches!(process_state(server), None | Some('Z')).then_some(())
    });
    assert!(dead.await.is_some(), "nats-server is gone");
    let mut pids: Vec<(String, u32)> = ["sim", "n1", "n2", "n3", "monitor", "chaos"]
        .iter()
        .map(|n| ((*n).to_string(), mesh.pid(n)))
        .collect();
    pids.push(("agent serve".into(), agent.pid()));
    pids.push(("listen".into(), listener.id()));
    for (i, (name, pid)) in pids.iter().enumerate() {
        let sig = if i % 2 == 0 {
            libc::SIGTERM
        } else {
            libc::SIGINT
        };
        let sent = std::time::Instant::now();
        assert!(oam::local::signal(*pid, sig), "{name} was running");
        let gone = eventually(Duration::from_secs(2), || async {
            // Exited: gone, or a zombie waiting for this test (its parent) to reap it.
            matches!(process_state(*pid), None | Some('Z')).then_some(())
        })
        .await;
        assert!(
            gone.is_some(),
            "{name} (pid {pid}) still running 2 s after signal {sig}"
        );
        eprintln!("{name}: stopped {:?} after signal {sig}", sent.elapsed());
    }
    let _ = listener.wait();
}

/// `oam mesh up --config FILE` runs the nodes on the user's configuration (here an upstream
/// with its own model names, standing in for a real provider), starting no simulator; a broken
/// configuration is refused before anything starts, naming the line.
#[tokio::test]
async fn a_mesh_runs_on_the_users_configuration() {
    let upstream = crate::support::Proc::spawn(&[
        "sim",
        "--listen",
        "127.0.0.1:0",
        "--json",
        "--provider",
        "gpt=0+0",
        "--provider",
        "llama=0+0",
    ]);
    let upstream_url = upstream.ready["url"].as_str().unwrap().to_string();
    let dir = Dir::new("mesh-config");
    std::fs::create_dir_all(&dir.0).unwrap();
    let config = dir.0.join("oam.toml");
    std::fs::write(
        &config,
        format!(
            "[[provider]]\nid = \"gpt\"\nbase_url = \"{upstream_url}/gpt/v1\"\nmodel = \"gpt-4o-mini\"\n\
             probe = \"models\"\n\n[[provider]]\nid = \"llama\"\nbase_url = \"{upstream_url}/llama/v1\"\n\
             model = \"llama3.2\"\nprobe = \"models\"\nfallback = true\n\n\
             [rate_limits.limited]\nrpm = 2\n\n[decision_log]\nmax_bytes = 8388608\n\
             max_age_hours = 48\n"
        ),
    )
    .unwrap();
    let broken = dir.0.join("broken.toml");
    std::fs::write(&broken, "[[provider]]\nid = \"gpt\"\nmodle = \"x\"\n").unwrap();
    let up = |config: &std::path::Path| {
        let args = [
            "mesh",
            "up",
            "--nodes",
            "1",
            "--port",
            "0",
            "--http-port",
            "0",
            "--json",
        ];
        oam()
            .args(args)
            .arg("--config")
            .arg(config)
            .arg("--dir")
            .arg(&dir.0)
            .output()
            .unwrap()
    };
    let out = up(&broken);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("broken.toml") && stderr.contains("line 3") && stderr.contains("modle"),
        "{stderr}"
    );
    assert!(!dir.0.join("mesh.json").exists(), "nothing started");

    let out = up(&config);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let up = json(&out.stdout);
    assert_eq!(up["sim"], Value::Null, "{up}");
    let names: Vec<&str> = up["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert!(!names.contains(&"sim"), "{names:?}");
    let node = up["nodes"][0]["http"].as_str().unwrap().to_string();
    let c = crate::support::http(Duration::from_secs(10));
    let answered = crate::support::eventually(Duration::from_secs(10), || async {
        let r = c
            .post(format!("{node}/v1/chat/completions"))
            .json(&json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .ok()?;
        (r.status().as_u16() == 200).then_some(())?;
        r.json::<Value>().await.ok()
    })
    .await
    .expect("the node answers on the user's providers");
    assert_eq!(answered["oam"]["target"], "gpt", "{answered}");
    assert_eq!(answered["model"], "gpt-4o-mini");
    let seen: Vec<Value> = c
        .get(format!("{upstream_url}/sim/requests/gpt"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        seen.iter().any(|r| r["model"] == "gpt-4o-mini"
            && r["messages"] == json!([{"role": "user", "content": "hi"}])),
        "{seen:?}"
    );
    // A rate limit holds on this mesh's roles: the node leases from the shared window (the
    // bucket made at start, writable by nodes), not from its own share.
    let mut statuses = Vec::new();
    for i in 0..3 {
        let r = c
            .post(format!("{node}/v1/chat/completions"))
            .json(&json!({"model": "gpt-4o-mini", "oam": {"agent": "limited"},
                "messages": [{"role": "user", "content": format!("limited {i}")}]}))
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429]);
    let metrics = c
        .get(format!("{node}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !metrics.contains("oam_rate_limit_leases_total{from=\"store\"} 0")
            && metrics.contains("oam_rate_limit_leases_total{from=\"local_share\"} 0"),
        "{metrics}"
    );
    // The decision log keeps what the configuration says (nodes may not change the stream;
    // `mesh up` does, as the admin), also when the stream is there already.
    let app_url = json(&std::fs::read(dir.0.join("system.json")).unwrap())["app_url"]
        .as_str()
        .unwrap()
        .to_string();
    let retention = || async {
        let nc = oam::transport::connect::connect(&app_url, "test", false, &Default::default())
            .await
            .unwrap();
        let mut s = async_nats::jetstream::new(nc)
            .get_stream("OAM_DECISIONS_n1")
            .await
            .unwrap();
        let c = s.info().await.unwrap().config.clone();
        (c.max_bytes, c.max_age.as_secs() / 3600)
    };
    assert_eq!(retention().await, (8 << 20, 48));
    // A mesh of earlier oam kept one log for all nodes (`OAM_DECISIONS`). Made so here, with
    // a record in it, the next `mesh up` retires it (it takes no writes, its subjects would
    // overlap the nodes' own streams) and readers still find what it holds.
    let audit = || {
        let out = oam()
            .env_remove("OAM_NATS_URL")
            .args(["audit", "--json", "--since", "1h", "--dir"])
            .arg(&dir.0)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        json(&out.stdout)
    };
    let id = &answered["oam"]["request_id"];
    let logged = crate::support::eventually(Duration::from_secs(10), || async {
        let rows = audit();
        let row = rows
            .as_array()?
            .iter()
            .find(|r| r["record"]["decision"]["request_id"] == *id);
        Some(row?["record"].clone())
    })
    .await;
    let mut old = logged.unwrap_or_else(|| panic!("{id} is not in the log"));
    old["decision"]["request_id"] = json!("kept-by-the-shared-log");
    let admin = oam::transport::connect::connect(&app_url, "test", false, &Default::default())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(admin);
    js.delete_stream("OAM_DECISIONS_n1").await.unwrap();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "OAM_DECISIONS".into(),
        subjects: vec!["oam.v1.decisionlog.*".into()],
        allow_direct: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let batch = json!({"node": "n1", "config": {}, "records": [old]});
    js.publish(
        oam::transport::subjects::decision_log("n1"),
        serde_json::to_vec(&batch).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("8388608", "16777216")).unwrap();
    let again = oam()
        .args(["mesh", "up", "--nodes", "1", "--config"])
        .arg(&config)
        .arg("--dir")
        .arg(&dir.0)
        .output()
        .unwrap();
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(retention().await, (16 << 20, 48));
    let shared = js
        .get_stream("OAM_DECISIONS")
        .await
        .unwrap()
        .get_info()
        .await
        .unwrap();
    assert_eq!(
        shared.config.subjects,
        [oam::transport::subjects::RETIRED_DECISION_LOG]
    );
    let ids: Vec<Value> = audit()
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["record"]["decision"]["request_id"].clone())
        .collect();
    assert!(ids.contains(&json!("kept-by-the-shared-log")), "{ids:?}");
    // Without a simulator, provider faults are injected by the nodes into their own calls:
    // failover is rehearsed on the real configuration. What only an upstream can do (a broken
    // contract) and a target no node routes to are refused, saying why.
    let chaos = |args: &[&str]| {
        oam()
            .env_remove("OAM_NATS_URL")
            .arg("chaos")
            .args(args)
            .arg("--dir")
            .arg(&dir.0)
            .output()
            .unwrap()
    };
    let refused = chaos(&["break-contract", "gpt", "--for", "5s"]);
    assert_eq!(refused.status.code(), Some(2));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("only an upstream"), "{said}");
    let refused = chaos(&["kill-provider", "gtp", "--for", "5s"]);
    assert_eq!(refused.status.code(), Some(2));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("no provider \"gtp\"") && said.contains("gpt"),
        "{said}"
    );
    let killed = chaos(&["kill-provider", "gpt", "--for", "30s", "--json"]);
    assert!(
        killed.status.success(),
        "{}",
        String::from_utf8_lossy(&killed.stderr)
    );
    let fault = json(&killed.stdout);
    let id = fault["id"].as_str().unwrap().to_string();
    let ask = || async {
        let r = c
            .post(format!("{node}/v1/chat/completions"))
            .json(&json!({"model": "auto", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        r.json::<Value>().await.unwrap()
    };
    let before = seen_by("gpt", &c, &upstream_url).await;
    let fell_back = crate::support::eventually(Duration::from_secs(10), || async {
        let v = ask().await;
        (v["oam"]["target"] == "llama").then_some(v)
    })
    .await
    .expect("requests go to the fallback while gpt is failed");
    assert_eq!(fell_back["oam"]["outcome"], "accepted", "{fell_back}");
    // The node says why gpt is down: the injected fault, by its id.
    let state: Value = c
        .get(format!("{node}/v1/oam/state"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let gpt = state["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == "gpt")
        .unwrap();
    let why = gpt["last_failure"]["error"].as_str().unwrap_or_default();
    assert!(why.contains(&format!("chaos fault {id}")), "{gpt}");
    assert_eq!(
        seen_by("gpt", &c, &upstream_url).await,
        before,
        "the failed target was never really called"
    );
    let restored = chaos(&["restore", &id]);
    assert!(
        restored.status.success(),
        "{}",
        String::from_utf8_lossy(&restored.stderr)
    );
}

/// How many chat requests the upstream's provider `name` has received.
async fn seen_by(name: &str, c: &reqwest::Client, upstream_url: &str) -> usize {
    let seen: Vec<Value> = c
        .get(format!("{upstream_url}/sim/requests/{name}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    seen.len()
}

/// An upstream that refuses oam's key: every target UNHEALTHY, every call 503, and nothing said
/// why (no error, no `/v1/oam/state`, no `mesh status`, exit 0). The 401 is now said where a
/// user looks: `mesh status` names the target and what the upstream said (exit 1), the node's
/// state keeps it, and the refused caller's body names it.
#[tokio::test]
async fn an_upstream_refusing_the_key_is_said_where_users_look() {
    let upstream = crate::support::answering_upstream(
        401,
        r#"{"error":{"message":"Incorrect API key provided: sk-ab***cd.","type":"invalid_request_error","code":"invalid_api_key"}}"#,
    )
    .await;
    let dir = Dir::new("mesh-401");
    std::fs::create_dir_all(&dir.0).unwrap();
    let config = dir.0.join("oam.toml");
    std::fs::write(
        &config,
        format!(
            "[[provider]]\nid = \"gpt\"\nbase_url = \"{upstream}\"\nmodel = \"gpt-4o-mini\"\n\
             probe = \"models\"\n"
        ),
    )
    .unwrap();
    let up = crate::support::mesh_up_on(&dir.0, &config);
    let node = up["nodes"][0]["http"].as_str().unwrap().to_string();
    let status = || {
        let out = oam()
            .args(["mesh", "status", "--json", "--dir"])
            .arg(&dir.0)
            .output()
            .unwrap();
        (out.status.code(), json(&out.stdout))
    };
    let told = crate::support::eventually(Duration::from_secs(20), || async {
        let (code, doc) = status();
        let n1 = doc["processes"]
            .as_array()?
            .iter()
            .find(|p| p["name"] == "n1")?
            .clone();
        let detail = n1["detail"].as_str()?.to_string();
        (code == Some(1) && detail.contains("gpt: probe: HTTP 401")).then_some(detail)
    })
    .await;
    let detail = told.expect("mesh status names the target and its 401");
    assert!(detail.contains("Incorrect API key"), "{detail}");
    assert!(detail.contains("no target answers"), "{detail}");
    // The node's own state keeps it.
    let c = crate::support::http(Duration::from_secs(10));
    let state: Value = c
        .get(format!("{node}/v1/oam/state"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let gpt = &state["providers"][0];
    assert_eq!(gpt["last_failure"]["status"], "unauthorized", "{gpt}");
    assert!(
        gpt["last_failure"]["failing"].as_u64().unwrap() >= 1,
        "{gpt}"
    );
    // The caller is refused with the why.
    let r = c
        .post(format!("{node}/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 503);
    let body: Value = r.json().await.unwrap();
    let said = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        said.contains("NO_PROVIDER_AVAILABLE") && said.contains("gpt: probe: HTTP 401"),
        "{body}"
    );
    // A configuration fault for a human, raised by the probes (no request reached the target)
    // and once: the probes that failed since raised nothing more.
    let escalations = || {
        let out = oam()
            .args(["escalation", "list", "--json", "--dir"])
            .arg(&dir.0)
            .output()
            .unwrap();
        serde_json::from_slice::<Vec<Value>>(&out.stdout).unwrap_or_default()
    };
    let open = crate::support::eventually(Duration::from_secs(10), || async {
        let all = escalations();
        (!all.is_empty()).then_some(all)
    })
    .await
    .expect("the refused key is escalated");
    let e = &open[0]["escalation"];
    assert_eq!(e["target"], "gpt", "{e}");
    assert_eq!(
        e["reason_codes"].as_array().unwrap().last().unwrap(),
        "ESCALATED_UPSTREAM_MISCONFIGURED",
        "{e}"
    );
    assert!(
        e["detail"].as_str().unwrap().contains("Incorrect API key"),
        "{e}"
    );
    let probed = |state: &Value| state["providers"][0]["last_failure"]["failing"].as_u64();
    let before = probed(&state).unwrap();
    crate::support::eventually(Duration::from_secs(20), || async {
        let state: Value = c
            .get(format!("{node}/v1/oam/state"))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        (probed(&state)? >= before + 2).then_some(())
    })
    .await
    .expect("the probes go on failing");
    assert_eq!(escalations().len(), 1, "{:?}", escalations());
}

/// An upstream whose model list answers but whose completions refuse oam's key (403: a key
/// without rights to the model). Before, the free model-list probe "healed" the target a
/// second after each refused call, and the next request met the 403 again. Now a target whose
/// credentials were refused stays down until a call works, and `/metrics` says why.
#[tokio::test]
async fn a_model_list_that_answers_does_not_heal_refused_credentials() {
    let app = axum::Router::new()
        .route(
            "/v1/models",
            axum::routing::get(|| async {
                axum::Json(json!({"object": "list", "data": [{"id": "gpt-4o", "object": "model"}]}))
            }),
        )
        .fallback(|| async {
            (
                axum::http::StatusCode::FORBIDDEN,
                [("content-type", "application/json")],
                r#"{"error":{"message":"You do not have access to the model gpt-4o.","type":"invalid_request_error","code":"model_not_found"}}"#,
            )
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let nats = crate::support::NatsServer::start().await;
    let dir = Dir::new("mesh-403");
    std::fs::create_dir_all(&dir.0).unwrap();
    let config = dir.0.join("oam.toml");
    std::fs::write(
        &config,
        format!(
            "[[provider]]\nid = \"gpt\"\nbase_url = \"{upstream}\"\nmodel = \"gpt-4o\"\n\
             probe = \"models\"\n"
        ),
    )
    .unwrap();
    let node = crate::support::InProcessNode::start("n403", &config, &nats.url());
    let c = crate::support::http(Duration::from_secs(10));
    let r = c
        .post(format!("{}/v1/chat/completions", node.url))
        .json(&json!({"model": "gpt", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_ne!(r.status(), 200);
    let failing = || async {
        let state: Value = c
            .get(format!("{}/v1/oam/state", node.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let f = state["providers"][0]["last_failure"].clone();
        (f["failing"].as_u64().unwrap_or(0), f["status"].clone())
    };
    let (n, status) = failing().await;
    assert!(n >= 1 && status == "unauthorized", "{n} {status}");
    // Two model lists that answer 200 after the refused call: still refused (before, the
    // first of them counted the target as working again).
    let probes = |m: &str| {
        m.lines()
            .find(|l| l.starts_with("oam_probe_calls_total{target=\"gpt\",kind=\"models\"}"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let before = probes(&crate::support::metrics(&node.url).await);
    let models_probed = crate::support::eventually(Duration::from_secs(10), || async {
        let m = crate::support::metrics(&node.url).await;
        (probes(&m) >= before + 2.0).then_some(m)
    })
    .await
    .expect("the model list was probed twice more");
    let (n, status) = failing().await;
    assert!(
        n >= 1 && status == "unauthorized",
        "healed by the model list: {n} {status}"
    );
    assert!(
        models_probed.lines().any(|l| l.starts_with(
            "oam_target_failing_calls{target=\"gpt\",status=\"unauthorized\",by=\"request\"} "
        ) && !l.ends_with(" 0")),
        "{models_probed}"
    );
    assert!(models_probed.contains("oam_target_last_failure_age_seconds{target=\"gpt\"}"));
}

/// One route's every target refuses oam's key while another route serves: before, `mesh
/// status` said nothing of the route and exited 0 (a node was unhealthy only when every target
/// was); now it names the route whose clients get nothing, and exits 1.
#[tokio::test]
async fn mesh_status_names_a_route_none_of_whose_targets_answers() {
    let refusing = crate::support::answering_upstream(
        401,
        r#"{"error":{"message":"Incorrect API key provided.","type":"invalid_request_error","code":"invalid_api_key"}}"#,
    )
    .await;
    let sim = crate::support::Proc::spawn(&["sim", "--listen", "127.0.0.1:0", "--json"]);
    let sim_url = sim.ready["url"].as_str().unwrap().to_string();
    let dir = Dir::new("mesh-route-down");
    std::fs::create_dir_all(&dir.0).unwrap();
    let config = dir.0.join("oam.toml");
    std::fs::write(
        &config,
        format!(
            "[[provider]]\nid = \"good\"\nbase_url = \"{sim_url}/primary/v1\"\nmodel = \"m\"\n\
             probe = \"models\"\n\n[[provider]]\nid = \"bad\"\nbase_url = \"{refusing}\"\n\
             model = \"m\"\nprobe = \"models\"\n\n[[route]]\nmodel = \"works\"\n\
             targets = [\"good\"]\n\n[[route]]\nmodel = \"broken\"\ntargets = [\"bad\"]\n"
        ),
    )
    .unwrap();
    crate::support::mesh_up_on(&dir.0, &config);
    let told = crate::support::eventually(Duration::from_secs(20), || async {
        let out = oam()
            .args(["mesh", "status", "--json", "--dir"])
            .arg(&dir.0)
            .output()
            .unwrap();
        let doc = json(&out.stdout);
        let n1 = doc["processes"]
            .as_array()?
            .iter()
            .find(|p| p["name"] == "n1")?
            .clone();
        let detail = n1["detail"].as_str()?.to_string();
        (out.status.code() == Some(1) && detail.contains("route broken")).then_some(detail)
    })
    .await;
    let detail = told.expect("mesh status names the route and exits 1");
    assert!(
        detail.contains("no target answers route broken (bad)"),
        "{detail}"
    );
    assert!(!detail.contains("route works"), "{detail}");
    assert!(detail.contains("HTTP 401"), "{detail}");
}

/// One model of a provider failed by chaos on a `--config` mesh: before, `oam chaos
/// kill-provider openai/gpt-4o-mini` was refused ("no provider ... their targets are
/// openai/gpt-4o-mini, ..."), and only the whole provider could be failed. Now the target alone
/// fails, its route falls back to the provider's other model, and restore ends it.
#[tokio::test]
async fn one_model_of_a_provider_is_failed_by_chaos_and_its_route_falls_back() {
    let upstream = crate::support::Proc::spawn(&["sim", "--listen", "127.0.0.1:0", "--json"]);
    let upstream_url = upstream.ready["url"].as_str().unwrap().to_string();
    let dir = Dir::new("mesh-target-chaos");
    std::fs::create_dir_all(&dir.0).unwrap();
    let config = dir.0.join("oam.toml");
    std::fs::write(
        &config,
        format!(
            "[[provider]]\nid = \"openai\"\nbase_url = \"{upstream_url}/primary/v1\"\n\
             models = [\"mini\", \"big\"]\nprobe = \"models\"\n\n[[route]]\nmodel = \"fast\"\n\
             targets = [\"openai/mini\", \"openai/big\"]\n"
        ),
    )
    .unwrap();
    let up = crate::support::mesh_up_on(&dir.0, &config);
    let node = up["nodes"][0]["http"].as_str().unwrap().to_string();
    let c = crate::support::http(Duration::from_secs(10));
    let ask = || async {
        let r = c
            .post(format!("{node}/v1/chat/completions"))
            .json(&json!({"model": "fast", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        r.json::<Value>().await.unwrap()
    };
    assert_eq!(ask().await["oam"]["target"], "openai/mini");
    let chaos = |args: &[&str]| {
        oam()
            .env_remove("OAM_NATS_URL")
            .arg("chaos")
            .args(args)
            .arg("--dir")
            .arg(&dir.0)
            .output()
            .unwrap()
    };
    let killed = chaos(&["kill-provider", "openai/mini", "--for", "30s", "--json"]);
    assert!(
        killed.status.success(),
        "{}",
        String::from_utf8_lossy(&killed.stderr)
    );
    let id = json(&killed.stdout)["id"].as_str().unwrap().to_string();
    let fell_back = crate::support::eventually(Duration::from_secs(10), || async {
        let v = ask().await;
        (v["oam"]["target"] == "openai/big").then_some(v)
    })
    .await
    .expect("the route falls back to the provider's other model");
    assert_eq!(fell_back["oam"]["outcome"], "accepted", "{fell_back}");
    // The other model's own calls and checks are untouched: it is not failing.
    let state: Value = c
        .get(format!("{node}/v1/oam/state"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let of = |id: &str| {
        state["providers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["id"] == id)
            .cloned()
            .unwrap()
    };
    let mini = of("openai/mini");
    assert!(
        mini["last_failure"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains(&format!("chaos fault {id}")),
        "{mini}"
    );
    assert!(of("openai/big")["last_failure"].is_null(), "{state}");
    assert!(chaos(&["restore", &id]).status.success());
    let back = crate::support::eventually(Duration::from_secs(20), || async {
        (ask().await["oam"]["target"] == "openai/mini").then_some(())
    })
    .await;
    assert!(
        back.is_some(),
        "served by the first target again after the restore"
    );
}
