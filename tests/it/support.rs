//! Test support: spawn real `oam` processes and stop them when the test ends, pass or fail.

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// `oam node run --id ID` on a free port, its ready line as JSON, against `nats_url`; then
/// `extra`.
pub fn node_args<'a>(id: &'a str, nats_url: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "node",
        "run",
        "--id",
        id,
        "--listen",
        "127.0.0.1:0",
        "--json",
        "--nats-url",
        nats_url,
    ];
    args.extend_from_slice(extra);
    args
}

/// A running `oam` child process, killed on drop.
pub struct Proc {
    child: Child,
    /// The first line the process printed, parsed as JSON (its ready line).
    pub ready: Value,
}

impl Proc {
    /// Start `oam ARGS...` and wait (at most 20 s) for its JSON ready line on stdout.
    pub fn spawn(args: &[&str]) -> Proc {
        Proc::spawn_with_env(args, &[])
    }

    /// `spawn`, with these variables set in the process's environment.
    pub fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut cmd = Command::new(assert_cmd::cargo::cargo_bin!("oam"));
        cmd.args(args).envs(env.iter().copied());
        Proc::spawn_command(cmd, args)
    }

    /// Start `oam ARGS...` with at most `files` open files (the soft `ulimit -n`, lower still if
    /// the hard limit is), as a constrained host would run it.
    pub fn spawn_with_file_limit(files: u32, args: &[&str]) -> Proc {
        let mut cmd = Command::new("bash");
        cmd.arg("-c")
            .arg(format!(
                "ulimit -S -n {files} 2>/dev/null || ulimit -S -n \"$(ulimit -H -n)\"; exec \"$0\" \"$@\""
            ))
            .arg(assert_cmd::cargo::cargo_bin!("oam"))
            .args(args);
        Proc::spawn_command(cmd, args)
    }

    /// Start `oam ARGS...` with soft and hard open-file limits of `files`: it cannot raise
    /// its own.
    pub fn spawn_with_hard_file_limit(files: u32, args: &[&str]) -> Proc {
        let mut cmd = Command::new("bash");
        cmd.arg("-c")
            .arg(format!("ulimit -n {files} && exec \"$0\" \"$@\""))
            .arg(assert_cmd::cargo::cargo_bin!("oam"))
            .args(args);
        Proc::spawn_command(cmd, args)
    }

    fn spawn_command(mut cmd: Command, args: &[&str]) -> Proc {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn oam");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(first)) = lines.next() {
                let _ = tx.send(first);
            }
            // Keep draining so the child never blocks on a full pipe.
            for _ in lines {}
        });
        let Ok(line) = rx.recv_timeout(Duration::from_secs(20)) else {
            let _ = child.kill();
            panic!("oam {args:?} printed no ready line within 20 s");
        };
        let ready =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("ready line {line:?}: {e}"));
        Proc { child, ready }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Let this test process open up to `files` files (the soft limit raised towards the hard one):
/// a test that opens many sockets must not fail for a default soft limit of 1,024.
/// A node in this test's own process, on a runtime of its own (so the test's runtime cannot
/// starve it), with a real nats-server and a real HTTP listener; stopped by its stop future
/// when dropped, as `oam node run` is by SIGTERM (it drains, then says goodbye).
pub struct InProcessNode {
    pub url: String,
    /// The node itself, to read what it counts.
    pub node: std::sync::Arc<oam::node::Node>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl InProcessNode {
    /// Node `id` on the configuration file `config`, connected to `nats_url`.
    pub fn start(id: &str, config: &std::path::Path, nats_url: &str) -> InProcessNode {
        let cfg = oam::node::config::NodeConfig::load(Some(config), "").expect("a valid oam.toml");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready, url) = std::sync::mpsc::channel();
        let (id, nats_url) = (id.to_string(), nats_url.to_string());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("a runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let url = format!("http://{}", listener.local_addr().unwrap());
                let name = format!("oam-node-{id}");
                let refused = oam::transport::connect::Refusal::default();
                let nats = oam::transport::connect::connect(&nats_url, &name, true, &refused)
                    .await
                    .expect("a NATS client");
                let (node, services) = oam::node::Node::new(id, cfg, nats).expect("a node");
                ready.send((url, node.clone())).unwrap();
                let stop = async {
                    let _ = stopped.await;
                };
                oam::node::run(node, services, listener, stop)
                    .await
                    .unwrap();
            });
        });
        let (url, node) = url
            .recv_timeout(Duration::from_secs(30))
            .expect("the node starts");
        InProcessNode {
            url,
            node,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for InProcessNode {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn allow_open_files(files: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct we pass, nothing else.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < files {
            lim.rlim_cur = files.min(lim.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Poll `check` every 20 ms until it returns `Some`, for at most `limit` (a check that does
/// not return is cut off at the limit too: the test fails, it does not hang).
pub async fn eventually<T, F, Fut>(limit: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Ok(Some(v)) = tokio::time::timeout(left, check()).await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Wait for the process to exit (after a signal sent by the test).
    pub fn wait(&mut self) {
        let _ = self.child.wait();
    }

    /// How the process exited, if it did within `limit`.
    pub async fn exited_within(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let child = &mut self.child;
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL now (a crash, not a shutdown).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A real nats-server on a free 127.0.0.1 port with generated credentials, in its own folder;
/// stopped and removed on drop.
pub struct NatsServer {
    child: std::process::Child,
    dir: std::path::PathBuf,
    pub port: u16,
    pub creds: oam::local::natsd::Credentials,
}

impl NatsServer {
    /// A server on any free port (the server picks it: no race with other tests).
    pub async fn start() -> NatsServer {
        let creds = oam::local::natsd::Credentials::generate().unwrap();
        NatsServer::start_on(0, creds)
            .await
            .expect("nats-server starts")
    }

    /// Start on a given port with given credentials (to restart "the same" server).
    pub async fn start_on(
        port: u16,
        creds: oam::local::natsd::Credentials,
    ) -> anyhow::Result<NatsServer> {
        NatsServer::start_with(port, creds, None).await
    }

    /// A server whose JetStream file storage holds `max_file_store` bytes in all.
    pub async fn start_small(max_file_store: u64) -> NatsServer {
        let creds = oam::local::natsd::Credentials::generate().unwrap();
        NatsServer::start_with(0, creds, Some(max_file_store))
            .await
            .expect("nats-server starts")
    }

    async fn start_with(
        port: u16,
        creds: oam::local::natsd::Credentials,
        max_file_store: Option<u64>,
    ) -> anyhow::Result<NatsServer> {
        let (bin, _) = oam::local::natsd::find(None)?;
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "oam-test-nats-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let layout = oam::local::natsd::Layout {
            port,
            dir: dir.clone(),
            max_file_store,
            ..Default::default()
        };
        let server = oam::local::natsd::start(
            &bin,
            &layout,
            &creds,
            &dir.join("nats.log"),
            Duration::from_secs(10),
        )
        .await?;
        Ok(NatsServer {
            child: server.child,
            dir,
            port: server.port,
            creds,
        })
    }

    pub fn url(&self) -> String {
        oam::local::natsd::app_url(&oam::local::natsd::loopback(&[self.port]), &self.creds)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An HTTP client (oam builds reqwest without a default TLS provider; tests use ring, as oam does).
pub fn http(timeout: Duration) -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .timeout(timeout)
        // A node closes a connection idle for its header timeout (10 s); one reused at that
        // moment fails. Kept connections go sooner, as the official SDKs' do (httpx: 5 s).
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .expect("http client")
}

/// `http` with no connection kept: every request opens its own, and closes it after.
pub fn http_unpooled(timeout: Duration) -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .timeout(timeout)
        .pool_max_idle_per_host(0)
        .build()
        .expect("http client")
}

/// A node's `/metrics` exposition.
pub async fn metrics(node_url: &str) -> String {
    http(Duration::from_secs(5))
        .get(format!("{node_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// A node's reason-code counters from its `/metrics` (codes that never occurred are absent).
pub async fn reason_counts(node_url: &str) -> std::collections::BTreeMap<String, f64> {
    let text = metrics(node_url).await;
    let mut counts = std::collections::BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("oam_reason_codes_total{"))
    {
        let code = line.split('"').nth(1).unwrap_or("").to_string();
        let n: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        *counts.entry(code).or_default() += n;
    }
    counts
}

/// The project's test Python (a virtualenv with openai and prometheus-client).
pub fn python() -> String {
    std::env::var("OAM_TEST_PYTHON").unwrap_or_else(|_| ".tools/venv/bin/python".into())
}

/// Run `script` with the test virtualenv's Python and `args`: what it printed, as JSON (the
/// test fails with its stderr when it fails).
pub fn python_json(script: &str, args: &[&str]) -> Value {
    let out = Command::new(python())
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script prints JSON")
}

/// An echo agent served by the Open Agent Mesh Python SDK (`sdk.echo`, replies `py:` + the
/// message), connected to `url`; started once it says it is ready.
pub fn spawn_sdk_echo(url: &str) -> Child {
    const AGENT: &str = r#"
import asyncio, sys
from pydantic import BaseModel
from openagentmesh import AgentMesh, AgentSpec

class In(BaseModel):
    message: str
class Out(BaseModel):
    reply: str

mesh = AgentMesh(sys.argv[1])

@mesh.agent(AgentSpec(name="sdk.echo", description="Echoes from Python", tags=[], version="0.1.0"))
async def echo(req: In) -> Out:
    return Out(reply="py:" + req.message)

async def main():
    async with mesh:
        print('{"ready": true}', flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"#;
    let mut child = Command::new(python())
        .args(["-c", AGENT, url])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python with openagentmesh; run scripts/install-test-tools");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    if !line.contains("ready") {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the SDK agent did not start: {line:?} (its stderr is above)");
    }
    child
}

/// Parse a Prometheus exposition with Prometheus' own Python parser; returns every sample as
/// `[name, {labels}, value]`. Panics, with the parser's message, if the text is not valid.
pub fn prometheus_samples(text: &str) -> Vec<Value> {
    use std::io::Write as _;
    let script = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for fam in text_string_to_metric_families(sys.stdin.read()):
    for s in fam.samples:
        out.append([s.name, s.labels, s.value])
print(json.dumps(out))
"#;
    let mut child = Command::new(python())
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python; run scripts/install-test-tools");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "invalid exposition: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A mesh's state folder: whatever happened, `oam mesh down` and removal on drop.
pub struct ClusterDir(pub std::path::PathBuf);

impl ClusterDir {
    pub fn new(tag: &str) -> ClusterDir {
        ClusterDir(std::env::temp_dir().join(format!("oam-test-{tag}-{}", std::process::id())))
    }
}

impl Drop for ClusterDir {
    fn drop(&mut self) {
        let _ = Command::new(assert_cmd::cargo::cargo_bin!("oam"))
            .args(["mesh", "down", "--grace-ms", "500", "--dir"])
            .arg(&self.0)
            .output();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A local cluster on free ports, in its own folder, started by a function call (the same one
/// `oam mesh up` makes).
pub struct LocalCluster {
    pub dir: ClusterDir,
    /// What was started (as recorded in mesh.json when it came up).
    pub record: oam::local::MeshRecord,
}

impl LocalCluster {
    pub async fn up(tag: &str) -> LocalCluster {
        LocalCluster::up_on(tag, 1).await
    }

    /// Three nodes on a cluster of `servers` nats-servers.
    pub async fn up_on(tag: &str, servers: u16) -> LocalCluster {
        let dir = ClusterDir::new(tag);
        let exe = std::path::PathBuf::from(assert_cmd::cargo::cargo_bin!("oam"));
        let plan = oam::local::cluster::Plan {
            servers,
            ..oam::local::cluster::Plan::any_ports(dir.0.clone(), 3, exe)
        };
        match oam::local::cluster::up(&plan).await {
            Ok(oam::local::cluster::Up::Started { record, .. }) => LocalCluster { dir, record },
            Ok(other) => panic!("a fresh folder holds a running mesh: {other:?}"),
            Err(e) => panic!("the local cluster did not start: {e}"),
        }
    }

    /// A mesh `oam mesh up` started in `dir`.
    pub fn recorded_in(dir: ClusterDir) -> LocalCluster {
        let record = oam::local::MeshRecord::load(&dir.0)
            .unwrap()
            .expect("a mesh recorded");
        LocalCluster { dir, record }
    }

    /// The application account's admin URL, credentials included (may do everything).
    pub fn app_url(&self) -> String {
        let text = std::fs::read_to_string(self.dir.0.join("system.json")).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        v["app_url"].as_str().unwrap().to_string()
    }

    /// The URL in the credentials file of role user `user` (`creds/{user}.json`).
    pub fn role_url(&self, user: &str) -> String {
        let path = self.dir.0.join("creds").join(format!("{user}.json"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let v: Value = serde_json::from_str(&text).unwrap();
        v["url"].as_str().unwrap().to_string()
    }

    /// `oam` pointed at this mesh.
    pub fn oam(&self) -> assert_cmd::Command {
        let mut c = assert_cmd::Command::new(assert_cmd::cargo::cargo_bin!("oam"));
        c.timeout(Duration::from_secs(60))
            .env("OAM_NATS_URL", self.app_url());
        c
    }

    /// Node `i`'s HTTP base URL (0-based).
    pub fn node(&self, i: usize) -> String {
        self.record.nodes().nth(i).unwrap().endpoint.clone()
    }

    /// The record of the process named `name` in mesh.json (chaos may restart it: a new pid,
    /// perhaps a new endpoint).
    fn recorded(&self, name: &str) -> Value {
        let text = std::fs::read_to_string(self.dir.0.join("mesh.json")).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        v["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no process {name} in mesh.json"))
    }

    pub fn endpoint(&self, name: &str) -> String {
        self.recorded(name)["endpoint"]
            .as_str()
            .unwrap()
            .to_string()
    }

    pub fn pid(&self, name: &str) -> u32 {
        self.recorded(name)["pid"].as_u64().unwrap() as u32
    }
}

/// A process's state letter from /proc (R, S, T for stopped, Z), or None when it is gone.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.trim_start().chars().next()
}

/// A nats-server in operator mode (decentralized JWT auth, as `nsc` sets one up) with one
/// account and one user of it, whose credentials file is what `oam --creds` reads. The JWTs are
/// minted here, signed with the same NKeys an operator's tools use.
pub struct JwtServer {
    child: std::process::Child,
    dir: std::path::PathBuf,
    pub port: u16,
    /// The user's credentials file (user JWT and NKey seed).
    pub creds: std::path::PathBuf,
}

/// A JWT with `claims`, issued (and signed) by `issuer`.
fn jwt(issuer: &nkeys::KeyPair, mut claims: Value) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    claims["iss"] = issuer.public_key().into();
    claims["iat"] = (oam::clock::now_ms() / 1_000).into();
    claims["jti"] = format!("OAMTEST{}{n}", std::process::id()).into();
    let signed = format!(
        "{}.{}",
        b64.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#),
        b64.encode(claims.to_string())
    );
    let signature = issuer.sign(signed.as_bytes()).unwrap();
    format!("{signed}.{}", b64.encode(signature))
}

impl JwtServer {
    pub async fn start() -> JwtServer {
        use serde_json::json;
        let operator = nkeys::KeyPair::new_operator();
        let account = nkeys::KeyPair::new_account();
        let user = nkeys::KeyPair::new_user();
        let operator_jwt = jwt(
            &operator,
            json!({"sub": operator.public_key(), "name": "oam-test",
                   "nats": {"type": "operator", "version": 2}}),
        );
        let unlimited = json!({"subs": -1, "data": -1, "payload": -1, "imports": -1,
                               "exports": -1, "wildcards": true, "conn": -1, "leaf": -1});
        let account_jwt = jwt(
            &operator,
            json!({"sub": account.public_key(), "name": "APP",
                   "nats": {"limits": unlimited, "default_permissions": {"pub": {}, "sub": {}},
                            "type": "account", "version": 2}}),
        );
        let user_jwt = jwt(
            &account,
            json!({"sub": user.public_key(), "name": "remote-user",
                   "nats": {"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
                            "type": "user", "version": 2}}),
        );
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "oam-test-jwt-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let creds = dir.join("remote-user.creds");
        std::fs::write(
            &creds,
            format!(
                "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
                 ************************* IMPORTANT *************************\n\
                 NKEY Seed printed below can be used to sign and prove identity.\n\n\
                 -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
                user.seed().unwrap()
            ),
        )
        .unwrap();
        let conf = dir.join("nats.conf");
        std::fs::write(
            &conf,
            format!(
                "listen: 127.0.0.1:-1\nports_file_dir: {:?}\noperator: {operator_jwt}\n\
                 resolver: MEMORY\nresolver_preload: {{ {}: {account_jwt} }}\n",
                dir.display().to_string(),
                account.public_key()
            ),
        )
        .unwrap();
        let (bin, _) = oam::local::natsd::find(None).unwrap();
        let server = oam::local::natsd::start_from(
            &bin,
            &conf,
            &dir,
            &dir.join("nats.log"),
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| panic!("operator-mode nats-server: {e:#}"));
        JwtServer {
            child: server.child,
            dir,
            port: server.port,
            creds,
        }
    }

    /// The server's URL, with no credentials in it.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for JwtServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A real OTLP/HTTP trace receiver: a small server that decodes every export with
/// OpenTelemetry's own protobuf definitions (`opentelemetry-proto`; unknown fields and ids of
/// the wrong size are refused with 400, as a collector refuses them) and reports each span it
/// took (each export as one JSON line). Killed on drop.
pub struct OtlpReceiver {
    child: std::process::Child,
    pub url: String,
    spans: tokio::sync::mpsc::UnboundedReceiver<Value>,
}

const OTLP_RECEIVER: &str = r#"
import base64, json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from google.protobuf import json_format, unknown_fields
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

def ids_to_base64(o):
    # OTLP/JSON writes ids as hex; protobuf's JSON mapping reads bytes as base64.
    for rs in o.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                for k, n in (("traceId", 16), ("spanId", 8), ("parentSpanId", 8)):
                    if k in s:
                        b = bytes.fromhex(s[k])
                        if len(b) != n:
                            raise ValueError(f"{k} {s[k]!r} is not {n} bytes")
                        s[k] = base64.b64encode(b).decode()

def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None

class Receiver(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        try:
            if self.path != "/v1/traces":
                raise ValueError("not the traces path: " + self.path)
            kind = self.headers.get("content-type", "").split(";")[0]
            if kind == "application/json":
                raw = json.loads(body)
                ids_to_base64(raw)
                req = json_format.ParseDict(raw, ExportTraceServiceRequest())
            elif kind == "application/x-protobuf":
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                # Protobuf skips what it does not know: an unknown field is a defect here.
                def known(m):
                    if len(unknown_fields.UnknownFieldSet(m)):
                        raise ValueError(f"unknown fields in {type(m).__name__}")
                    for f, v in m.ListFields():
                        if f.message_type is None:
                            continue
                        for x in (v if f.is_repeated else [v]):
                            known(x)
                known(req)
            else:
                raise ValueError("neither JSON nor protobuf: " + kind)
        except Exception as e:
            print(json.dumps({"refused": str(e)}), flush=True)
            self.send_response(400)
            self.end_headers()
            return
        spans = []
        for rs in req.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({
                        "resource": resource, "scope": ss.scope.name,
                        "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(), "name": s.name, "kind": s.kind,
                        "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                        "status": s.status.code,
                        "attributes": {a.key: value(a.value) for a in s.attributes},
                        "header": self.headers.get("x-test-key"),
                        "content_type": kind,
                    })
        # One line per export: a request's span and its attempts' arrive together.
        print(json.dumps({"spans": spans}), flush=True)
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
print(json.dumps({"port": server.server_address[1]}), flush=True)
server.serve_forever()
"#;

impl OtlpReceiver {
    pub fn start() -> OtlpReceiver {
        use std::io::BufRead as _;
        let mut child = Command::new(python())
            .args(["-u", "-c", OTLP_RECEIVER])
            .stdout(Stdio::piped())
            .spawn()
            .expect("python; run scripts/install-test-tools");
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let first: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
        let url = format!("http://127.0.0.1:{}", first["port"]);
        let (tx, spans) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&line)
                    && tx.send(v).is_err()
                {
                    return;
                }
            }
        });
        OtlpReceiver { child, url, spans }
    }

    /// The spans received until `done` says the ones wanted are in (or `within` passes).
    pub async fn until(&mut self, within: Duration, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + within;
        while !done(&got) {
            match tokio::time::timeout_at(deadline, self.spans.recv()).await {
                Ok(Some(v)) => match v["spans"].as_array() {
                    Some(spans) => got.extend(spans.iter().cloned()),
                    None => got.push(v),
                },
                _ => break,
            }
        }
        got
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The next message on `sub` within `within`, as JSON (`None`: none came, or not JSON).
pub async fn next_json(
    sub: &mut async_nats::Subscriber,
    within: std::time::Duration,
) -> Option<serde_json::Value> {
    use futures_util::StreamExt;
    let m = tokio::time::timeout(within, sub.next()).await.ok()??;
    serde_json::from_slice(&m.payload).ok()
}

/// A child process stopped (SIGKILL, then reaped) when the test is done with it, or fails.
pub struct KilledOnDrop(pub std::process::Child);

impl KilledOnDrop {
    pub fn stop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Wait (at most 10 s) for a heartbeat of agent `name` that satisfies `pred`: what the monitors
/// and the test see the agent report, instead of a sleep.
pub async fn beat_of(nc: &async_nats::Client, name: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let mut beats = nc.subscribe(format!("mesh.health.{name}")).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let beat = next_json(&mut beats, left)
            .await
            .unwrap_or_else(|| panic!("no heartbeat of {name} as expected within 10 s"));
        if pred(&beat) {
            return beat;
        }
    }
}

/// The nodes' NATS data plane (`oam.v1.request`) asked as oam's own clients ask it: in an
/// answer inbox under the nodes' token, the only place a node answers a role of oam's.
#[derive(Clone)]
pub struct NatsPlane(std::sync::Arc<oam::transport::ask::Asker>);

impl NatsPlane {
    pub async fn new(nc: &async_nats::Client) -> NatsPlane {
        let asker = oam::transport::ask::Asker::new(nc.clone()).await.unwrap();
        NatsPlane(std::sync::Arc::new(asker))
    }

    pub async fn request(
        &self,
        body: bytes::Bytes,
    ) -> Result<async_nats::Message, oam::transport::ask::AskError> {
        self.request_with_headers(async_nats::HeaderMap::new(), body)
            .await
    }

    pub async fn request_with_headers(
        &self,
        h: async_nats::HeaderMap,
        body: bytes::Bytes,
    ) -> Result<async_nats::Message, oam::transport::ask::AskError> {
        let tag = oam::transport::subjects::ANSWERER_NODES;
        let within = Duration::from_secs(60);
        self.0
            .ask(tag, "oam.v1.request".into(), h, body, within)
            .await
    }
}

/// `oam mesh up` of one node on the configuration `config`, in `dir` (free ports): its JSON
/// report (the node's URL at `["nodes"][0]["http"]`).
pub fn mesh_up_on(dir: &std::path::Path, config: &std::path::Path) -> Value {
    let out = Command::new(assert_cmd::cargo::cargo_bin!("oam"))
        .args([
            "mesh",
            "up",
            "--nodes",
            "1",
            "--port",
            "0",
            "--http-port",
            "0",
            "--sim-port",
            "0",
            "--json",
        ])
        .arg("--config")
        .arg(config)
        .arg("--dir")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// An upstream on a free port that answers every request with `status` and the JSON `body`
/// (a refused key, say): its `/v1` base URL.
pub async fn answering_upstream(status: u16, body: &'static str) -> String {
    let status = axum::http::StatusCode::from_u16(status).unwrap();
    let app = axum::Router::new()
        .fallback(move || async move { (status, [("content-type", "application/json")], body) });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// A NATS proxy in front of the server on `server_port` that loses the acknowledgement of the
/// first publish to each subject under `prefix`: the server stores the message and answers,
/// the publisher never hears it (as when a leader changes between the write and its answer).
/// Everything else passes unchanged. Stopped on drop.
pub struct AckLoser {
    pub port: u16,
    state: std::sync::Arc<std::sync::Mutex<Losing>>,
    /// Dropped to stop the proxy (on a thread of its own: a test's runtime may be blocked
    /// while a process it spawns connects through it).
    _stop: tokio::sync::oneshot::Sender<()>,
}

#[derive(Default)]
struct Losing {
    prefix: String,
    /// Reply subject -> the subject whose acknowledgement it will carry.
    awaited: std::collections::HashMap<String, String>,
    /// Subjects whose first publish was seen.
    seen: std::collections::HashSet<String>,
    /// Subjects whose acknowledgement was lost, in order.
    lost: Vec<String>,
}

impl AckLoser {
    pub fn start(server_port: u16, prefix: &str) -> AckLoser {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = std::sync::Arc::new(std::sync::Mutex::new(Losing {
            prefix: prefix.to_string(),
            ..Losing::default()
        }));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shared = state.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let mut conns = tokio::task::JoinSet::new();
                let accepting = async {
                    while let Ok((client, _)) = listener.accept().await {
                        let Ok(server) =
                            tokio::net::TcpStream::connect(("127.0.0.1", server_port)).await
                        else {
                            continue;
                        };
                        let (client_read, client_write) = client.into_split();
                        let (server_read, server_write) = server.into_split();
                        let up = shared.clone();
                        conns.spawn(pump(client_read, server_write, move |line| {
                            up.lock().unwrap().publishing(line);
                            true
                        }));
                        let down = shared.clone();
                        conns.spawn(pump(server_read, client_write, move |line| {
                            down.lock().unwrap().delivering(line)
                        }));
                    }
                };
                tokio::select! {
                    () = accepting => {}
                    _ = stopped => {}
                }
            });
        });
        AckLoser {
            port,
            state,
            _stop: stop,
        }
    }

    /// The subjects whose acknowledgement was lost so far.
    pub fn lost(&self) -> Vec<String> {
        self.state.lock().unwrap().lost.clone()
    }
}

impl Losing {
    /// A client's protocol line: the first `PUB`/`HPUB` with a reply to a subject under the
    /// prefix marks its reply to be lost.
    fn publishing(&mut self, line: &str) {
        let fields: Vec<&str> = line.split_ascii_whitespace().collect();
        let reply = match fields.as_slice() {
            ["PUB", subject, reply, _] | ["HPUB", subject, reply, _, _] => Some((*subject, *reply)),
            _ => None,
        };
        if let Some((subject, reply)) = reply
            && subject.starts_with(&self.prefix)
            && self.seen.insert(subject.to_string())
        {
            self.awaited.insert(reply.to_string(), subject.to_string());
        }
    }

    /// A server's protocol line: false for the message carrying a marked reply.
    fn delivering(&mut self, line: &str) -> bool {
        let subject = match line.split_ascii_whitespace().collect::<Vec<_>>().as_slice() {
            ["MSG" | "HMSG", subject, ..] => subject.to_string(),
            _ => return true,
        };
        match self.awaited.remove(&subject) {
            Some(published) => {
                self.lost.push(published);
                false
            }
            None => true,
        }
    }
}

/// Copy NATS protocol frames from `from` to `to`, each whole (a line, and a message's payload
/// with it), leaving out those whose first line `keep` refuses.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut keep: impl FnMut(&str) -> bool + Send + 'static,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (mut pending, mut chunk) = (Vec::new(), vec![0u8; 64 * 1024]);
    loop {
        let n = match from.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        pending.extend_from_slice(&chunk[..n]);
        let mut out = Vec::with_capacity(pending.len());
        while let Some((line_end, len)) = frame(&pending) {
            if keep(&String::from_utf8_lossy(&pending[..line_end])) {
                out.extend_from_slice(&pending[..len]);
            }
            pending.drain(..len);
        }
        if to.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// The first whole protocol frame of `buf`, if all there: where its line ends and its length
/// (for `PUB`, `HPUB`, `MSG` and `HMSG`, the line's last field is the payload's size).
fn frame(buf: &[u8]) -> Option<(usize, usize)> {
    let line_end = buf.windows(2).position(|w| w == b"\r\n")?;
    let line = String::from_utf8_lossy(&buf[..line_end]);
    let mut fields = line.split_ascii_whitespace();
    let payload = match fields.next().map(str::to_ascii_uppercase).as_deref() {
        Some("PUB" | "HPUB" | "MSG" | "HMSG") => fields.next_back()?.parse::<usize>().ok()? + 2,
        _ => 0,
    };
    let len = line_end + 2 + payload;
    (buf.len() >= len).then_some((line_end, len))
}
