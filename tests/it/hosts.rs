//! A mesh across three hosts: each host a network namespace of its own on a private bridge
//! this test makes (and removes), started as a user would, one `oam mesh up --hosts FILE` per
//! host from one shared folder that `oam mesh init` made (passwords, a CA, each host's
//! certificate), and an agent on a fourth host that runs no server. Then a partition of the
//! ledger leader's host from the other two.

use crate::support::{KilledOnDrop, eventually};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// Hosts on a bridge of their own: `10.231.K.1` ... (the bridge, in this namespace, is
/// `10.231.K.254`); everything removed on drop, each host's mesh first. The first three run
/// the mesh, the fourth only an agent.
struct Hosts {
    tag: String,
    subnet: String,
    names: [&'static str; 4],
    /// The shared folder: hosts.toml, secrets.json, tls/.
    folder: PathBuf,
}

impl Hosts {
    fn ns(&self, host: &str) -> String {
        format!("oam-{}-{host}", self.tag)
    }

    /// The bridge's end of `host`'s link: down is a partition of that host from every other.
    fn link(&self, host: &str) -> String {
        format!("oamv{}{host}", self.tag)
    }

    fn bridge(&self) -> String {
        format!("oamb{}", self.tag)
    }

    fn address(&self, host: &str) -> String {
        let i = self.names.iter().position(|n| *n == host).unwrap() + 1;
        format!("{}.{i}", self.subnet)
    }

    fn dir(&self, host: &str) -> PathBuf {
        self.folder.join(format!("state-{host}"))
    }

    fn make() -> Hosts {
        assert!(
            ip(&["netns", "list"]).status.success(),
            "this test makes network namespaces with `ip` (iproute2) and needs root"
        );
        let used = String::from_utf8_lossy(&ip(&["-4", "-o", "addr"]).stdout).to_string();
        let tag = oam::ids::random_hex(3).unwrap();
        let k = (1..250u16)
            .map(|k| (k + u16::from_str_radix(&tag[..2], 16).unwrap()) % 250 + 1)
            .find(|k| !used.contains(&format!("10.231.{k}.")))
            .expect("a free 10.231.K.0/24");
        let folder = std::env::temp_dir().join(format!("oam-test-hosts-{tag}"));
        std::fs::create_dir_all(&folder).unwrap();
        let hosts = Hosts {
            tag,
            subnet: format!("10.231.{k}"),
            names: ["a", "b", "c", "d"],
            folder,
        };
        let br = hosts.bridge();
        run_ip(&["link", "add", &br, "type", "bridge"]);
        run_ip(&[
            "addr",
            "add",
            &format!("{}.254/24", hosts.subnet),
            "dev",
            &br,
        ]);
        run_ip(&["link", "set", &br, "up"]);
        for h in hosts.names {
            let (ns, link) = (hosts.ns(h), hosts.link(h));
            run_ip(&["netns", "add", &ns]);
            run_ip(&[
                "link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ]);
            run_ip(&["link", "set", &link, "master", &br, "up"]);
            let addr = format!("{}/24", hosts.address(h));
            run_ip(&["-n", &ns, "addr", "add", &addr, "dev", "eth0"]);
            run_ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            run_ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        hosts
    }

    /// `oam ARGS` run on `host` (in its namespace).
    fn oam_on(&self, host: &str, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(host)])
            .arg(assert_cmd::cargo::cargo_bin!("oam"))
            .args(args)
            .env_remove("OAM_DIR")
            .env_remove("OAM_NATS_URL");
        c
    }

    /// `curl` run on `host`: a chat request to `url`; the request id of a 200 answer.
    fn ask_on(&self, host: &str, url: &str, question: &str) -> Option<String> {
        let body = json!({"model": "auto", "messages": [{"role": "user", "content": question}]});
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns(host),
                "curl",
                "-s",
                "-m",
                "10",
                "-D",
                "-",
            ])
            .args(["-H", "content-type: application/json", "-d"])
            .arg(body.to_string())
            .arg(format!("{url}/v1/chat/completions"))
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if !text.starts_with("HTTP/1.1 200") {
            return None;
        }
        text.lines()
            .find_map(|l| l.strip_prefix("x-request-id: "))
            .map(|id| id.trim().to_string())
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for h in self.names {
            let _ = Command::new(assert_cmd::cargo::cargo_bin!("oam"))
                .args(["mesh", "down", "--grace-ms", "500", "--dir"])
                .arg(self.dir(h))
                .output();
            let _ = ip(&["link", "del", &self.link(h)]);
            let _ = ip(&["netns", "del", &self.ns(h)]);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
        let _ = std::fs::remove_dir_all(&self.folder);
    }
}

fn ip(args: &[&str]) -> Output {
    Command::new("ip").args(args).output().unwrap()
}

fn run_ip(args: &[&str]) {
    let out = ip(args);
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A TLS connection as `user` to exactly the server at `url` (checked against `ca`).
async fn connect_tls(
    url: &str,
    user: &str,
    password: &str,
    ca: &Path,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    async_nats::ConnectOptions::with_user_and_password(user.into(), password.into())
        .add_root_certificates(ca.to_path_buf())
        .require_tls(true)
        .connection_timeout(Duration::from_secs(3))
        .ignore_discovered_servers()
        .connect(url)
        .await
}

fn secrets(folder: &Path) -> oam::local::natsd::Credentials {
    let text = std::fs::read_to_string(folder.join("secrets.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Set budget `agent`'s limit on `host` (`oam budget set`, as that host's admin).
fn budget_set(hosts: &Hosts, host: &str, agent: &str) -> Output {
    let dir = hosts.dir(host);
    hosts
        .oam_on(host, &["budget", "set", agent, "--limit", "3", "--dir"])
        .arg(&dir)
        .output()
        .unwrap()
}

/// The agents with a budget, as `host` reads them.
fn budgets_on(hosts: &Hosts, host: &str) -> Option<Vec<String>> {
    let dir = hosts.dir(host);
    let out = hosts
        .oam_on(host, &["budget", "list", "--json", "--dir"])
        .arg(&dir)
        .output()
        .ok()?;
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    Some(
        v.as_array()?
            .iter()
            .filter_map(|b| b["agent"].as_str().map(String::from))
            .collect(),
    )
}

#[tokio::test]
async fn three_hosts_run_one_mesh_over_tls_and_a_cut_off_leader_acknowledges_nothing() {
    let hosts = Hosts::make();
    let file = hosts.folder.join("hosts.toml");
    let mut text = String::from("agents = [\"demo.echo\", \"demo.slow\"]\n");
    let servers = &hosts.names[..3];
    for h in servers {
        text.push_str(&format!(
            "[[host]]\nname = \"{h}\"\naddress = \"{}\"\n",
            hosts.address(h)
        ));
    }
    std::fs::write(&file, text).unwrap();

    // Once, for every host: passwords, a CA, a certificate per host.
    let init = Command::new(assert_cmd::cargo::cargo_bin!("oam"))
        .args(["mesh", "init", "--json", "--hosts"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );
    let made: Value = serde_json::from_slice(&init.stdout).unwrap();
    assert_eq!(
        made["written"].as_array().unwrap().len(),
        1 + 2 + 3 * 2,
        "{made}"
    );
    let tls = hosts.folder.join("tls");
    let ca = tls.join("ca.pem");

    // Each host starts its part, as a person would on three machines at once.
    let starting: Vec<_> = servers
        .iter()
        .map(|h| {
            let dir = hosts.dir(h);
            hosts
                .oam_on(h, &["mesh", "up", "--json", "--wait-s", "60", "--hosts"])
                .arg(&file)
                .arg("--dir")
                .arg(&dir)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut nodes = Vec::new();
    for (h, child) in servers.iter().zip(starting) {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "mesh up on {h}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let up: Value = serde_json::from_slice(&out.stdout).unwrap();
        let node = &up["nodes"][0];
        assert_eq!(node["id"], *h);
        let http = node["http"].as_str().unwrap().to_string();
        assert!(
            http.contains(&hosts.address(h)),
            "{h}'s node on its address: {http}"
        );
        let servers: Vec<&str> = up["nats"].as_str().unwrap().split(',').collect();
        assert_eq!(servers.len(), 3, "every host's server: {up}");
        assert!(servers.iter().all(|s| s.starts_with("tls://")), "{up}");
        nodes.push(http);
    }

    // From outside the hosts: every node sees all three, and answers.
    let http = crate::support::http(Duration::from_secs(10));
    for url in &nodes {
        let seen = eventually(Duration::from_secs(20), || async {
            let s = oam::local::cluster::snapshot(&http, url).await?;
            (s.live_nodes.len() == 3).then_some(())
        })
        .await;
        assert!(seen.is_some(), "{url} sees every host's node");
    }
    let r = http
        .post(format!("{}/v1/chat/completions", nodes[0]))
        .json(&json!({"model": "auto", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // TLS or nothing; the same roles on every server.
    let creds = secrets(&hosts.folder);
    let server = |h: &str| format!("tls://{}:4222", hosts.address(h));
    // Each server says at once that it takes TLS only, and a client that will not speak it
    // gets no further.
    for h in servers {
        use std::io::BufRead;
        let tcp = std::net::TcpStream::connect((hosts.address(h).as_str(), 4222)).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut info = String::new();
        std::io::BufReader::new(tcp).read_line(&mut info).unwrap();
        let info: Value = serde_json::from_str(info.trim_start_matches("INFO ")).unwrap();
        assert_eq!(info["tls_required"], true, "{h}: {info}");
    }
    let plain = async_nats::ConnectOptions::with_user_and_password(
        creds.app_user.clone(),
        creds.app_password.clone(),
    )
    .connection_timeout(Duration::from_secs(3))
    .connect(format!("nats://{}:4222", hosts.address("a")))
    .await;
    assert!(plain.is_err(), "a plain connection is refused");
    let viewer = &creds.users["viewer"];
    for h in servers {
        let c = connect_tls(&server(h), "viewer", viewer, &ca).await;
        assert!(c.is_ok(), "{h} admits the viewer: {:?}", c.err());
        let bad = connect_tls(&server(h), "viewer", "not-it", &ca).await;
        assert!(bad.is_err(), "{h} refuses a wrong password");
    }
    let all: Vec<String> = servers.iter().map(|h| server(h)).collect();
    let admin = async_nats::ConnectOptions::with_user_and_password(
        creds.app_user.clone(),
        creds.app_password.clone(),
    )
    .add_root_certificates(ca.clone())
    .require_tls(true)
    .connect(
        all.iter()
            .map(|u| u.parse::<async_nats::ServerAddr>().unwrap())
            .collect::<Vec<_>>(),
    )
    .await
    .unwrap();
    let js = async_nats::jetstream::new(admin.clone());
    for stream in ["KV_oam-budgets", "OAM_DECISIONS_a", "KV_mesh-instances"] {
        let info = js
            .get_stream(stream)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .clone();
        let cluster = info.cluster.unwrap();
        assert_eq!(info.config.num_replicas, 3, "{stream}");
        assert!(cluster.leader.is_some(), "{stream} has a leader");
        assert_eq!(cluster.replicas.len(), 2, "{stream} on all three hosts");
    }

    // Agents on a fourth host, clients of the hosts' servers: one called from another host;
    // one killed while a call waits on it, which fails at once rather than at its timeout, and
    // its death announced once though every host runs a monitor.
    let serve = |name: &str, demo: &str| {
        let creds = hosts
            .dir("a")
            .join("creds")
            .join(format!("agent-{name}.json"));
        let mut agent = KilledOnDrop(
            hosts
                .oam_on(
                    "d",
                    &["agent", "serve", name, "--demo", demo, "--json", "--creds"],
                )
                .arg(&creds)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        // Its ready line, or end of output if it exits first.
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(agent.0.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
        let ready: Value = serde_json::from_str(&line).unwrap_or_default();
        assert_eq!(ready["agent"], name, "ready line: {line:?}");
        (agent, ready)
    };
    let (_echo, _) = serve("demo.echo", "echo");
    let called = hosts
        .oam_on("b", &["agent", "call", "demo.echo", r#"{"x": 1}"#, "--dir"])
        .arg(hosts.dir("b"))
        .output()
        .unwrap();
    assert!(
        called.status.success(),
        "{}",
        String::from_utf8_lossy(&called.stderr)
    );
    let echoed: Value = serde_json::from_slice(&called.stdout).unwrap();
    assert_eq!(echoed, json!({"x": 1}));

    let (mut slow, ready) = serve("demo.slow", "sleep:20000");
    let mut deaths = admin.subscribe("mesh.death.demo.slow").await.unwrap();
    admin.flush().await.unwrap();
    let caller = std::sync::Arc::new(oam::mesh::client::Caller::new(admin.clone()).await.unwrap());
    let pending = tokio::spawn({
        let caller = caller.clone();
        async move {
            caller
                .call("demo.slow", "{}".into(), Duration::from_secs(30))
                .await
        }
    });
    // Its heartbeats (one a second) say when it holds the call.
    crate::support::beat_of(&admin, "demo.slow", |b| b["in_flight"].as_u64() >= Some(1)).await;
    let killed = std::time::Instant::now();
    let killed_at = oam::clock::now_ms();
    slow.stop();
    let result = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .expect("the call ended")
        .unwrap();
    let failed_after = killed.elapsed();
    let err = result.expect_err("the call died with the agent");
    assert_eq!(err.code, oam::mesh::protocol::ErrorCode::AgentDied, "{err}");
    assert!(
        failed_after < Duration::from_secs(5),
        "{failed_after:?}, not its 30 s timeout"
    );
    let notice = crate::support::next_json(&mut deaths, Duration::from_secs(10))
        .await
        .expect("the agent's death is announced");
    assert_eq!(notice["instance_id"], ready["instances"][0], "{notice}");
    let again = crate::support::next_json(&mut deaths, Duration::from_secs(3)).await;
    assert_eq!(again, None, "three hosts' monitors announce the death once");
    eprintln!(
        "an agent on a fourth host killed mid-call: the call failed after {failed_after:?}, \
         the death announced {} ms after the SIGKILL",
        notice["detected_at_ms"]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(killed_at)
    );

    // Cut off the host that leads the ledger.
    let leader = js
        .get_stream("KV_oam-budgets")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .cluster
        .clone()
        .unwrap()
        .leader
        .unwrap();
    let cut = *servers
        .iter()
        .find(|h| leader == format!("nats-{h}"))
        .unwrap_or_else(|| panic!("the leader {leader} is one of the hosts"));
    let kept: Vec<&str> = servers.iter().copied().filter(|h| *h != cut).collect();
    let since = oam::clock::now_ms();
    run_ip(&["link", "set", &hosts.link(cut), "down"]);

    // The majority elects a leader of its own and takes writes; its nodes serve throughout.
    let took = eventually(Duration::from_secs(30), || async {
        budget_set(&hosts, kept[0], "written-on-the-majority")
            .status
            .success()
            .then_some(())
    })
    .await;
    assert!(took.is_some(), "the majority side takes writes");
    let mut answered = std::collections::BTreeSet::new();
    for (i, h) in kept.iter().enumerate() {
        let url = &nodes[hosts.names.iter().position(|n| n == h).unwrap()];
        for k in 0..3 {
            let id = hosts.ask_on(h, url, &format!("kept {i} {k}"));
            answered.insert(id.unwrap_or_else(|| panic!("{h}'s node answers")));
        }
    }
    // The cut-off side acknowledges no write; its node still answers its own callers (their
    // records wait for the partition to heal).
    let minority = budget_set(&hosts, cut, "written-on-the-cut-side");
    let said = String::from_utf8_lossy(&minority.stderr);
    assert_eq!(minority.status.code(), Some(3), "unreachable store: {said}");
    assert!(
        said.contains("not acknowledged") && said.contains("majority"),
        "a write on the minority side is never acknowledged, and says why: {said}"
    );
    let cut_node = &nodes[hosts.names.iter().position(|h| *h == cut).unwrap()];
    let before = answered.len();
    for i in 0..3 {
        if let Some(id) = hosts.ask_on(cut, cut_node, &format!("cut {i}")) {
            answered.insert(id);
        }
    }
    assert!(
        answered.len() > before,
        "the cut-off host's node answers its own callers"
    );

    // Healed: the cut-off host has the majority's write and not its own, and every answer
    // given on either side has its record.
    run_ip(&["link", "set", &hosts.link(cut), "up"]);
    let healed = eventually(Duration::from_secs(30), || async {
        let b = budgets_on(&hosts, cut)?;
        b.contains(&"written-on-the-majority".to_string())
            .then_some(b)
    })
    .await
    .expect("the majority's write is read on the cut-off host once healed");
    assert!(
        !healed.contains(&"written-on-the-cut-side".to_string()),
        "an unacknowledged write never appears: {healed:?}"
    );
    let logged = eventually(Duration::from_secs(30), || async {
        let (entries, _) =
            oam::transport::store::decisions::read(&admin, since, None, |_| true, usize::MAX)
                .await
                .ok()?;
        let ids: std::collections::BTreeSet<String> =
            entries.into_iter().map(|e| e.record.request.id).collect();
        answered.is_subset(&ids).then_some(())
    })
    .await;
    assert!(
        logged.is_some(),
        "every answer has its record: {answered:?}"
    );
    // The agent taken out of the file: once each host ran `mesh up` again, no server admits it.
    let agent_password = creds.users["agent-demo.echo"].clone();
    let agent_creds_a = hosts.dir("a").join("creds").join("agent-demo.echo.json");
    assert!(agent_creds_a.exists());
    for h in servers {
        let c = connect_tls(&server(h), "agent-demo.echo", &agent_password, &ca).await;
        assert!(c.is_ok(), "{h} admits the agent before: {:?}", c.err());
    }
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, text.replace("\"demo.echo\", ", "")).unwrap();
    let init = Command::new(assert_cmd::cargo::cargo_bin!("oam"))
        .args(["mesh", "init", "--json", "--hosts"])
        .arg(&file)
        .output()
        .unwrap();
    let made: Value = serde_json::from_slice(&init.stdout).unwrap();
    assert_eq!(made["revoked"], json!(["agent-demo.echo"]), "{made}");
    assert_eq!(
        made["written"],
        json!([]),
        "secrets and certificates kept: {made}"
    );
    for h in servers {
        let again = hosts
            .oam_on(h, &["mesh", "up", "--hosts"])
            .arg(&file)
            .arg("--dir")
            .arg(hosts.dir(h))
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&again.stderr);
        assert!(again.status.success(), "{said}");
        assert!(said.contains("took the roles"), "{h} reloads: {said}");
    }
    assert!(!agent_creds_a.exists(), "its credentials file is gone");
    for h in servers {
        let c = connect_tls(&server(h), "agent-demo.echo", &agent_password, &ca).await;
        assert!(c.is_err(), "{h} refuses the revoked agent");
        let v = connect_tls(&server(h), "viewer", viewer, &ca).await;
        assert!(v.is_ok(), "{h} still admits the viewer: {:?}", v.err());
    }
}

/// A hosts file that cannot work is refused before anything starts, naming the file and what
/// to do; `--hosts` does not go with flags the file decides.
#[test]
fn a_bad_hosts_file_or_flag_is_refused_with_what_to_do() {
    let oam = || Command::new(assert_cmd::cargo::cargo_bin!("oam"));
    let folder = std::env::temp_dir().join(format!("oam-test-bad-hosts-{}", std::process::id()));
    std::fs::create_dir_all(&folder).unwrap();
    let missing = folder.join("missing.toml");
    let out = oam()
        .args(["mesh", "up", "--hosts"])
        .arg(&missing)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("missing.toml") && said.contains("No such file"),
        "{said}"
    );

    let file = folder.join("hosts.toml");
    std::fs::write(
        &file,
        "[[host]]\nname = \"a\"\naddress = \"10.254.254.1\"\n",
    )
    .unwrap();
    let out = oam()
        .args(["mesh", "up", "--servers", "3", "--hosts"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
    // Not initialised, and named as a host this machine is not.
    let out = oam()
        .args(["mesh", "up", "--host", "a", "--hosts"])
        .arg(&file)
        .arg("--dir")
        .arg(folder.join("state"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(said.contains("oam mesh init --hosts"), "{said}");
    let _ = std::fs::remove_dir_all(&folder);
}
