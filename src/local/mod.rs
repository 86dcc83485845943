//! A local cluster on this machine: its state folder (what `oam mesh up` started: PIDs, ports,
//! URLs), how to tell whether each process is still the one we started, how to start `oam`
//! processes and stop exactly those. `natsd` supervises nats-server, `cluster` starts and
//! probes a whole cluster with one call, `hosts` one host's part of a mesh across hosts, `mesh`
//! a private mesh inside this process (tests, examples),
//! `agents` starts demo agents for scenarios.
//!
//! `mesh.json` records everything but secrets; `system.json` (mode 0600) holds every NATS
//! password, for `oam mesh up` and `oam creds` only; `creds/{user}.json` (mode 0600, one per
//! role user) is what a process of that role is given. Logs live beside them. Nothing here
//! decides anything about requests.

pub mod agents;
pub mod cluster;
pub mod creds;
pub mod hosts;
pub mod mesh;
pub mod natsd;
pub mod roles;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub(crate) const RECORD: &str = "mesh.json";
/// Where a folder from before roles kept the application password every process shared.
pub(crate) const CREDENTIALS: &str = "credentials.json";
/// The admin and system-account URLs and every password (mode 0600): for `oam mesh up` and
/// `oam creds` only, never handed to agents or tools.
pub(crate) const SYSTEM: &str = "system.json";
/// The folder of role credentials (mode 0700), one `{user}.json` per role user.
pub(crate) const CREDS_DIR: &str = "creds";

/// What a process of one role is given: its user and URL (and, for the monitor and warden,
/// the system account's limited `observer`).
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub(crate) struct RoleFile {
    pub user: String,
    pub role: String,
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sys_url: Option<String>,
    /// The CA that signed the servers' certificates, when they speak TLS (a mesh across
    /// hosts): every connection checks the server against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<PathBuf>,
}

/// The credentials file of `user` in the state folder `dir`.
pub(crate) fn role_path(dir: &Path, user: &str) -> PathBuf {
    dir.join(CREDS_DIR).join(format!("{user}.json"))
}

/// Write the credentials file of `role` for the servers at `servers` (bare URLs; `ca`: the CA
/// of their TLS), 0600 in a 0700 folder; its path.
pub(crate) fn write_role_file(
    dir: &Path,
    servers: &[String],
    ca: Option<&Path>,
    creds: &natsd::Credentials,
    role: &roles::Role,
) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let user = role.user();
    let url = creds
        .url(servers, &user)
        .with_context(|| format!("no NATS user {user} in {}", dir.join(SYSTEM).display()))?;
    let folder = dir.join(CREDS_DIR);
    std::fs::create_dir_all(&folder)
        .and_then(|()| std::fs::set_permissions(&folder, std::fs::Permissions::from_mode(0o700)))
        .with_context(|| format!("cannot create {}", folder.display()))?;
    let sys_url = matches!(role, roles::Role::Monitor | roles::Role::Warden)
        .then(|| creds.observer_url(servers));
    let file = RoleFile {
        user: user.clone(),
        role: role.kind().into(),
        url,
        sys_url,
        ca: ca.map(Path::to_path_buf),
    };
    let path = role_path(dir, &user);
    write_private(
        &path,
        &format!("{}\n", serde_json::to_string_pretty(&file)?),
    )?;
    Ok(path)
}

/// Does `path` hold an oam credentials file (JSON), rather than a NATS one?
pub(crate) fn is_role_file(path: &Path) -> bool {
    std::fs::read(path).is_ok_and(|b| b.trim_ascii_start().starts_with(b"{"))
}

/// The credentials file at `path`, if it is one.
pub(crate) fn read_role_file(path: &Path) -> anyhow::Result<RoleFile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not an oam credentials file (`oam creds issue` writes them)",
            path.display()
        )
    })
}

/// One process oam started.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct Started {
    /// `nats-server`, `sim`, or the node id.
    pub name: String,
    pub pid: u32,
    /// What the operator connects to (no secrets).
    pub endpoint: String,
    pub log: PathBuf,
    /// A word the process's command line must contain, so a reused PID is never signalled.
    pub cmdline_marker: String,
    /// The `oam` arguments it was started with (empty for nats-server), so it can be started
    /// again (`oam chaos kill-node` restores a node this way).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
}

impl Started {
    /// Record where a process told `--listen 127.0.0.1:PORT` (perhaps port 0) listens: its
    /// endpoint, and its arguments with the real port, so a restart comes back at the same
    /// address.
    pub fn settle_address(&mut self, url: &str) {
        self.endpoint = url.to_string();
        self.set_listen(url.trim_start_matches("http://"));
    }

    /// Change the `--listen` argument.
    pub fn set_listen(&mut self, addr: &str) {
        if let Some(at) = self.args.iter().position(|a| a == "--listen")
            && let Some(value) = self.args.get_mut(at + 1)
        {
            *value = addr.to_string();
        }
    }
}

/// The first line `child` printed to `out` (its ready line), parsed as JSON. An error says why
/// not: it exited first (with the last line of its `log`), printed something else, or said
/// nothing within `within`.
pub(crate) async fn ready_line(
    child: &mut std::process::Child,
    out: &Path,
    log: &Path,
    what: &str,
    within: Duration,
) -> anyhow::Result<serde_json::Value> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(text) = std::fs::read_to_string(out)
            && let Some((line, _)) = text.split_once('\n')
        {
            return serde_json::from_str(line)
                .with_context(|| format!("{what} printed {line:?}, not its ready line"));
        }
        if let Ok(Some(status)) = child.try_wait() {
            let tail = std::fs::read_to_string(log).unwrap_or_default();
            let last = tail.lines().last().unwrap_or("").to_string();
            anyhow::bail!(
                "{what} exited ({status}) before it was ready: {last} (see {})",
                log.display()
            );
        }
        if Instant::now() >= deadline {
            anyhow::bail!(
                "{what} was not ready within {} s; see {}",
                within.as_secs(),
                log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct MeshRecord {
    pub started_at_ms: u64,
    /// The NATS servers, in start order: one, or the members of a cluster.
    pub servers: Vec<NatsServer>,
    pub sim_url: String,
    /// In start order; stopped newest first.
    pub processes: Vec<Started>,
    /// Every server of the cluster as clients reach it (bare URLs), when some run on other
    /// hosts (`oam mesh up --hosts`); empty: `servers` are all of them, on 127.0.0.1.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nats_urls: Vec<String>,
    /// The CA of the servers' TLS, when they speak it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<PathBuf>,
    /// The hosts file of a mesh across hosts, whose folder holds every role's password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hosts: Option<PathBuf>,
}

/// One nats-server of a mesh: its process name in the record, folder and ports.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct NatsServer {
    /// `nats-server` when it runs alone; `nats-1` ... in a cluster (also its server name).
    pub name: String,
    /// Holds its `nats.conf`, `nats.log` and `jetstream/`.
    pub dir: PathBuf,
    pub port: u16,
    /// Its HTTP monitoring port on 127.0.0.1; 0: it has none (the default).
    pub monitor_port: u16,
    /// Its route port (0: it runs alone).
    #[serde(default)]
    pub cluster_port: u16,
    /// The client port it was started with in its config (0: any free one). A config reload
    /// must name the ports as the running server was started, or the server refuses it.
    #[serde(default)]
    pub asked_port: u16,
    /// The address it listens on for clients and routes (`None`: 127.0.0.1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// The route addresses of the cluster's other members when they run on other hosts
    /// (empty: they are the record's other servers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<natsd::Tls>,
    /// JetStream's fsync interval, when not the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_interval: Option<String>,
    /// JetStream's file storage in all (`store_bytes`: sized to the disk when the mesh came
    /// up, and kept, so a reload names what the server was started with); `None`: 1 GB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_bytes: Option<u64>,
}

impl NatsServer {
    /// Its name in its config (what the system account's questions filter by), beside the
    /// servers `all`.
    pub fn config_name(&self, all: &[NatsServer]) -> String {
        self.layout(all, false)
            .name
            .unwrap_or_else(|| natsd::LONE_NAME.to_string())
    }

    /// Where its clients reach it (`nats://127.0.0.1:4222`, `tls://10.0.0.2:4222`).
    pub(crate) fn client_url(&self) -> String {
        let scheme = if self.tls.is_some() { "tls" } else { "nats" };
        let address = self.address.as_deref().unwrap_or("127.0.0.1");
        format!("{scheme}://{address}:{}", self.port)
    }

    /// A connection to this server alone as the system account's admin (TLS checked against
    /// its CA where it speaks TLS): what oam asks a server (`natsd::server_info`) instead of
    /// its monitoring port. Not retried: the caller says what it was for.
    pub async fn system_connection(
        &self,
        creds: &natsd::Credentials,
    ) -> anyhow::Result<async_nats::Client> {
        let mut opts = async_nats::ConnectOptions::with_user_and_password(
            creds.sys_user.clone(),
            creds.sys_password.clone(),
        )
        .name("oam-sys")
        .connection_timeout(Duration::from_secs(2));
        if let Some(tls) = &self.tls {
            opts = opts.add_root_certificates(tls.ca.clone()).require_tls(true);
        }
        opts.connect(self.client_url().as_str())
            .await
            .with_context(|| format!("cannot reach {} as the system account", self.name))
    }

    /// Its config as it runs now, or as it was started (`as_started`, for a reload), among
    /// `all` the servers of its mesh.
    pub fn layout(&self, all: &[NatsServer], as_started: bool) -> natsd::Layout {
        let alone = all.len() <= 1 && self.peers.is_empty();
        let routes = if self.peers.is_empty() {
            all.iter()
                .filter(|s| s.name != self.name)
                .map(|s| format!("127.0.0.1:{}", s.cluster_port))
                .collect()
        } else {
            self.peers.clone()
        };
        let cluster = (!alone).then_some(natsd::ClusterPart {
            port: self.cluster_port,
            routes,
        });
        natsd::Layout {
            port: if as_started {
                self.asked_port
            } else {
                self.port
            },
            // Open only where it was asked for (then the port it took is recorded).
            monitor_port: (self.monitor_port != 0).then_some(if as_started {
                0
            } else {
                self.monitor_port
            }),
            dir: self.dir.clone(),
            name: (!alone).then(|| self.name.clone()),
            cluster,
            address: self.address.clone(),
            tls: self.tls.clone(),
            sync_interval: self.sync_interval.clone(),
            max_file_store: self.store_bytes,
        }
    }

    /// The address clients reach it at.
    pub fn ip(&self) -> std::net::IpAddr {
        self.address
            .as_deref()
            .and_then(|a| a.parse().ok())
            .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST))
    }
}

/// Is this recorded process one of the mesh's nats-servers?
pub(crate) fn is_nats_server(name: &str) -> bool {
    name == "nats-server" || name.starts_with("nats-")
}

impl MeshRecord {
    /// Every server's client port.
    pub fn nats_ports(&self) -> Vec<u16> {
        self.servers.iter().map(|s| s.port).collect()
    }

    /// Every server of the cluster as clients reach it (bare URLs).
    pub fn client_urls(&self) -> Vec<String> {
        if self.nats_urls.is_empty() {
            natsd::loopback(&self.nats_ports())
        } else {
            self.nats_urls.clone()
        }
    }

    pub fn path(dir: &Path) -> PathBuf {
        dir.join(RECORD)
    }

    pub fn load(dir: &Path) -> anyhow::Result<Option<MeshRecord>> {
        let path = MeshRecord::path(dir);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .with_context(|| format!("{} is not a mesh record; remove it", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
    }

    /// Write the record whole or not at all (a temporary file renamed over it), so a reader
    /// never sees half of it.
    pub fn save(&self, dir: &Path) -> anyhow::Result<()> {
        let path = MeshRecord::path(dir);
        let tmp = dir.join(format!("{RECORD}.tmp"));
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .with_context(|| format!("cannot write {}", path.display()))
    }

    pub fn nodes(&self) -> impl Iterator<Item = &Started> {
        self.processes.iter().filter(|p| {
            !is_nats_server(&p.name) && !["sim", "monitor", "chaos"].contains(&p.name.as_str())
        })
    }
}

/// A URL recorded in the state folder's `system.json` (`app_url`: the admin, `sys_url`: the
/// system account's admin), if any.
pub fn recorded_url(dir: &Path, key: &str) -> Option<String> {
    [SYSTEM].iter().find_map(|file| {
        let text = std::fs::read_to_string(dir.join(file)).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        v[key].as_str().map(String::from)
    })
}

/// No mesh to talk to, and what to do about it.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct NoMesh(pub String);

/// The NATS URL of the mesh a command talks to, and where it came from. Flags before the
/// environment before the default: `--nats-url`, `--dir`, `$OAM_NATS_URL`, `$OAM_DIR`, then
/// `./.oam`; a folder means the URL in its credentials file for `role` (`creds/{user}.json`).
/// No silent default port: without any of them the error says what to do.
pub(crate) fn find_cluster(
    url_flag: Option<String>,
    dir_flag: Option<&Path>,
    role: &roles::Role,
) -> Result<(String, String), NoMesh> {
    use crate::transport::connect::ENV_URL;
    let in_dir = |dir: &Path, how: &str| {
        // A mesh across hosts speaks TLS: its CA comes with its folder.
        if let Ok(Some(MeshRecord { ca: Some(ca), .. })) = MeshRecord::load(dir) {
            crate::transport::connect::use_ca_file(&ca);
        }
        let user = role.user();
        let path = role_path(dir, &user);
        if *role == roles::Role::Admin
            && let Some(url) = recorded_url(dir, "app_url")
        {
            return Ok((url, format!("the mesh in {} ({how})", dir.display())));
        }
        if let Ok(file) = read_role_file(&path) {
            if let Some(ca) = &file.ca {
                crate::transport::connect::use_ca_file(ca);
            }
            return Ok((
                file.url,
                format!("the mesh in {} ({how}) as {user}", dir.display()),
            ));
        }
        if *role == roles::Role::Admin && MeshRecord::path(dir).exists() {
            return Err(NoMesh(format!(
                "this command runs as the mesh's admin, whose URL is in {} ({how}), readable only \
                 by the user who started the mesh; run it as that user, or pass --nats-url",
                dir.join(SYSTEM).display()
            )));
        }
        if MeshRecord::path(dir).exists() {
            let issue = match role {
                roles::Role::Agent(name) => format!("--role agent --name {name}"),
                roles::Role::Node(id) => format!("--role node --name {id}"),
                other => format!("--role {}", other.kind()),
            };
            return Err(NoMesh(format!(
                "no credentials for {user} in {} ({how}): issue them with `oam creds issue \
                 {issue} --dir {}` (as the user who started the mesh), or pass --creds FILE",
                path.display(),
                dir.display()
            )));
        }
        Err(NoMesh(format!(
            "no mesh found: nothing recorded in {} ({how}). Start one with `oam mesh up --dir \
             {}`, or pass --dir for the folder of a mesh started elsewhere, or --nats-url URL",
            dir.display(),
            dir.display()
        )))
    };
    if let Some(url) = url_flag {
        return Ok((url, "--nats-url".into()));
    }
    if let Some(dir) = dir_flag {
        return in_dir(dir, "--dir");
    }
    if let Ok(url) = std::env::var(ENV_URL)
        && !url.is_empty()
    {
        return Ok((url, format!("${ENV_URL}")));
    }
    match std::env::var_os(ENV_DIR).filter(|d| !d.is_empty()) {
        Some(dir) => in_dir(Path::new(&dir), "$OAM_DIR"),
        None => in_dir(Path::new(".oam"), "the default folder"),
    }
}

/// The environment variable naming a mesh's state folder.
pub(crate) const ENV_DIR: &str = "OAM_DIR";

/// The state folder a command means: the flag, then `$OAM_DIR`, then `./.oam`.
pub(crate) fn cluster_dir(flag: Option<&Path>) -> PathBuf {
    let dir = flag
        .map(Path::to_path_buf)
        .or_else(|| {
            std::env::var_os(ENV_DIR)
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from(".oam"));
    // Absolute: the folder's paths go into nats-server's config, which the server (started
    // elsewhere) reads again on a reload.
    std::path::absolute(&dir).unwrap_or(dir)
}

/// The bytes free to an unprivileged writer on the filesystem that holds `path` (or its
/// nearest existing parent: a mesh folder may not exist yet); `None` when it cannot be told.
pub(crate) fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let at = path.ancestors().find(|p| p.exists())?;
    let c = std::ffi::CString::new(at.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a valid NUL-terminated path; `st` is written by statvfs on success only.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0;
    ok.then(|| st.f_bavail.saturating_mul(st.f_frsize))
}

/// JetStream's file storage for each of `servers` servers that share a disk with `free` bytes
/// free: three quarters of it between them, 1 GiB each at most. JetStream stops at its store's
/// size, so it never fills the disk: what it keeps is always left room to be purged or
/// shrunk by an admin (on a full disk even a purge fails).
pub fn store_bytes(free: u64, servers: usize) -> u64 {
    (free / 4 * 3 / servers.max(1) as u64).min(1 << 30)
}

/// A decision log too large for the JetStream store its servers keep.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error(
    "[decision_log] max_bytes is {} MiB, but JetStream's store here is {} MiB (three quarters \
     of the {} MiB free on {}, 1 GiB at most, shared by {servers} server(s)): the log must \
     leave as much again for the buckets. Lower max_bytes in the nodes' config (to at most {} \
     MiB here), or free space",
    wanted >> 20, store_bytes(*free, *servers) >> 20, free >> 20, dir.display(),
    (store_bytes(*free, *servers) / 2) >> 20
)]
pub(crate) struct LogTooLarge {
    pub wanted: u64,
    pub free: u64,
    pub servers: usize,
    pub dir: PathBuf,
}

/// Does a decision log of `max_bytes` fit the store of each of `servers` servers on `dir`'s
/// disk (`free` bytes free; see `store_bytes`)? It must leave as much again for what else
/// JetStream keeps (buckets, the SDK's store) and for its own work.
pub(crate) fn log_fits(
    max_bytes: u64,
    free: u64,
    servers: usize,
    dir: &Path,
) -> Result<(), LogTooLarge> {
    if max_bytes.saturating_mul(2) > store_bytes(free, servers) {
        return Err(LogTooLarge {
            wanted: max_bytes,
            free,
            servers,
            dir: dir.to_path_buf(),
        });
    }
    Ok(())
}

/// The `oam` binary to start processes from: this one, as it is on disk now.
pub(crate) fn oam_exe() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot tell where the oam binary is")?;
    // Rebuilt or upgraded while running: the kernel names our old image "... (deleted)"; start
    // the file that is there now.
    Ok(
        match exe.to_str().and_then(|p| p.strip_suffix(" (deleted)")) {
            Some(p) => PathBuf::from(p),
            None => exe,
        },
    )
}

/// Mark every descriptor above stdio close-on-exec, so the processes we start inherit only
/// stdio: not, say, a lock file that the shell running `oam mesh up` held open (the whole mesh
/// would hold it for its lifetime). Rust opens its own descriptors close-on-exec already; this
/// catches what this process inherited.
pub(crate) fn close_inherited_fds() {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd > 2)
        .collect();
    for fd in fds {
        // SAFETY: fcntl on a descriptor number touches no memory of ours; on a number that
        // is not open (the directory's own, closed by now) it fails with EBADF, harmlessly.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}

/// Start `oam ARGS` detached (own process group), stdout to `NAME.out`, stderr to `NAME.log`
/// (appended, so a restarted process keeps its history).
pub(crate) fn spawn_oam(
    exe: &Path,
    dir: &Path,
    name: &str,
    args: &[String],
    env: &[(&str, String)],
) -> anyhow::Result<(std::process::Child, PathBuf, PathBuf)> {
    use std::os::unix::process::CommandExt;
    let out = dir.join(format!("{name}.out"));
    let log = dir.join(format!("{name}.log"));
    let stdout =
        std::fs::File::create(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .with_context(|| format!("cannot open {}", log.display()))?;
    close_inherited_fds();
    let mut cmd = std::process::Command::new(exe);
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .process_group(0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("cannot start {name}"))?;
    Ok((child, out, log))
}

/// Write a file only its owner can read.
pub(crate) fn write_private(path: &Path, contents: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    // A file that was there keeps its mode through `open`: make it private too.
    f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    f.write_all(contents.as_bytes())?;
    Ok(())
}

/// Is `p` running and still the process we started (not a reused PID)?
pub fn is_ours(p: &Started) -> bool {
    is_running(p.pid, &p.cmdline_marker)
}

/// Whether `pid` is alive and its command line contains `marker` (so a reused PID is not it).
pub(crate) fn is_running(pid: u32, marker: &str) -> bool {
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(raw) => {
            let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
            cmdline.contains(marker) && !is_zombie(pid)
        }
        Err(_) => false,
    }
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()
                .map(|rest| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

pub fn signal(pid: u32, sig: libc::c_int) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    unsafe { libc::kill(pid, sig) == 0 }
}

/// How a process was stopped.
#[derive(Serialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "snake_case")]
pub enum Stopped {
    /// It exited after SIGTERM.
    Terminated,
    /// It ignored SIGTERM for the grace period and was killed.
    Killed,
    /// It was not running (or its PID now belongs to something else, which is left alone).
    NotRunning,
}

/// SIGTERM, then SIGKILL after `grace` if it is still there.
pub async fn stop(p: &Started, grace: Duration) -> Stopped {
    if !is_ours(p) {
        return Stopped::NotRunning;
    }
    signal(p.pid, libc::SIGTERM);
    if gone_within(p, grace).await {
        return Stopped::Terminated;
    }
    signal(p.pid, libc::SIGKILL);
    gone_within(p, Duration::from_secs(2)).await;
    Stopped::Killed
}

async fn gone_within(p: &Started, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while is_ours(p) {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_log_must_leave_as_much_again_of_a_store_that_leaves_the_disk_room() {
        let dir = Path::new("/x");
        // JetStream takes three quarters of what is free, shared, 1 GiB each at most.
        assert_eq!(store_bytes(400, 1), 300);
        assert_eq!(store_bytes(400, 3), 100);
        assert_eq!(store_bytes(100 << 30, 3), 1 << 30);
        assert_eq!(log_fits(150, 400, 1, dir), Ok(()));
        let e = log_fits(151, 400, 1, dir).unwrap_err();
        assert_eq!((e.wanted, e.free, e.servers), (151, 400, 1));
        assert!(log_fits(150, 400, 3, dir).is_err());
        let said = log_fits(256 << 20, 300 << 20, 1, dir)
            .unwrap_err()
            .to_string();
        assert!(
            said.contains("256 MiB")
                && said.contains("store here is 225 MiB")
                && said.contains("300 MiB free")
                && said.contains("at most 112 MiB"),
            "{said}"
        );
        // A folder not made yet is measured on its nearest existing parent.
        let free = free_bytes(Path::new("/tmp/oam-no-such-folder/mesh")).expect("measured");
        assert!(free > 0);
    }

    #[test]
    fn a_reused_pid_is_not_ours() {
        let me = Started {
            name: "x".into(),
            pid: std::process::id(),
            endpoint: String::new(),
            log: PathBuf::new(),
            cmdline_marker: "surely-not-in-this-test-binary-cmdline".into(),
            args: Vec::new(),
        };
        assert!(!is_ours(&me));
        let stopped = futures_util::FutureExt::now_or_never(stop(&me, Duration::from_millis(10)));
        assert_eq!(stopped, Some(Stopped::NotRunning));
    }

    #[test]
    fn private_files_are_0600() {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("oam-private-{}", std::process::id()));
        write_private(&path, "secret").unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        std::fs::remove_file(&path).unwrap();
        assert_eq!(mode, 0o600);
    }
}
