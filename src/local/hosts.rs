//! A mesh across hosts: the one file that lists them (`hosts.toml`), the secrets and TLS
//! certificates every host shares (made beside that file by `oam mesh init`), and what one host
//! runs of it (`oam mesh up --hosts FILE --host NAME`): its nats-server, a member of one cluster
//! with every other host's (routes and clients on the host's address, TLS on both), its nodes,
//! the liveness monitor and, without a node configuration, a simulator. Every host is given the
//! same folder, so every server holds the same roles. Nothing here decides about requests.

use super::cluster::{self, Plan, Spec, Up, UpError};
use super::natsd;
use super::roles::Role;
use super::{MeshRecord, Started};
use crate::transport::connect::{ENV_CA, ENV_URL};
use anyhow::{Context, anyhow, bail};
use serde::Deserialize;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Every password of the deployment (mode 0600), beside the hosts file.
pub(crate) const SECRETS: &str = "secrets.json";
/// The certificates' folder beside the hosts file, when oam makes them.
pub(crate) const TLS_DIR: &str = "tls";

/// The hosts file.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct HostsFile {
    #[serde(rename = "host", default)]
    pub hosts: Vec<Host>,
    #[serde(default)]
    pub ports: HostPorts,
    /// The nodes' configuration (`oam.toml`, relative to the hosts file); without one each
    /// host runs a simulator and its nodes route across it.
    #[serde(default)]
    pub config: Option<PathBuf>,
    /// The CA that signed every host's certificate (default `tls/ca.pem`).
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// Agents given a role (`agent-{name}`) with the rest.
    #[serde(default)]
    pub agents: Vec<String>,
    /// JetStream's fsync interval on every server (`always` or a duration; default 2m).
    #[serde(default)]
    pub sync_interval: Option<String>,
}

/// One host of the deployment.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct Host {
    /// Its name: lower-case letters, digits and `-`.
    pub name: String,
    /// The address every process of it listens on, and the others reach it at.
    pub address: IpAddr,
    /// How many nodes it runs (0-9).
    #[serde(default = "one")]
    pub nodes: u16,
    /// Whether it runs a liveness monitor (several announce each death once).
    #[serde(default = "yes")]
    pub monitor: bool,
    /// Its server's certificate and key (default `tls/{name}.pem`, `tls/{name}-key.pem`).
    #[serde(default)]
    pub cert: Option<PathBuf>,
    #[serde(default)]
    pub key: Option<PathBuf>,
}

fn one() -> u16 {
    1
}

fn yes() -> bool {
    true
}

/// The ports every host uses (the same on each).
#[derive(Deserialize, Debug, Clone, Copy)]
#[serde(deny_unknown_fields, default)]
pub struct HostPorts {
    pub nats: u16,
    pub cluster: u16,
    /// The first node's HTTP port; a host's others follow it.
    pub http: u16,
    pub sim: u16,
}

impl Default for HostPorts {
    fn default() -> Self {
        HostPorts {
            nats: 4222,
            cluster: 6222,
            http: 8091,
            sim: 8081,
        }
    }
}

/// A hosts file, read and checked, with the folder its paths are relative to.
#[derive(Debug, Clone)]
pub struct Deployment {
    pub file: PathBuf,
    pub folder: PathBuf,
    pub spec: HostsFile,
}

impl Deployment {
    /// Read and check the hosts file at `path`; the error names the file and what is wrong.
    pub fn load(path: &Path) -> anyhow::Result<Deployment> {
        let file = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("cannot read the hosts file {}", file.display()))?;
        let spec: HostsFile = toml::from_str(&text)
            .map_err(|e| anyhow!("{}: {}", file.display(), e.to_string().trim_end()))?;
        let folder = file.parent().map_or_else(PathBuf::new, Path::to_path_buf);
        let d = Deployment { file, folder, spec };
        d.check()
            .map_err(|why| anyhow!("{}: {why}", d.file.display()))?;
        Ok(d)
    }

    fn check(&self) -> Result<(), BadDeployment> {
        let hosts = &self.spec.hosts;
        if hosts.is_empty() {
            return Err(BadDeployment(
                "it lists no host; add [[host]] tables with name and address".into(),
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        let mut addresses = std::collections::BTreeSet::new();
        for h in hosts {
            let ok = !h.name.is_empty()
                && h.name.len() <= 32
                && h.name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
            if !ok {
                return Err(BadDeployment(format!(
                    "host name {:?}: use 1-32 lower-case letters, digits and -",
                    h.name
                )));
            }
            if !names.insert(h.name.as_str()) {
                return Err(BadDeployment(format!("host {:?} is listed twice", h.name)));
            }
            if h.address.is_ipv6() {
                return Err(BadDeployment(format!(
                    "host {}: {} is an IPv6 address; hosts are IPv4 addresses for now",
                    h.name, h.address
                )));
            }
            if h.address.is_unspecified() {
                return Err(BadDeployment(format!(
                    "host {}: address {} is every address, not one; give the one the other \
                     hosts reach it at",
                    h.name, h.address
                )));
            }
            if !addresses.insert(h.address) {
                return Err(BadDeployment(format!(
                    "address {} is given to two hosts; each host needs its own",
                    h.address
                )));
            }
            if h.nodes > 9 {
                return Err(BadDeployment(format!(
                    "host {}: nodes = {} (at most 9)",
                    h.name, h.nodes
                )));
            }
        }
        for agent in &self.spec.agents {
            if !super::roles::valid_name(agent) {
                return Err(BadDeployment(format!(
                    "agents: {agent:?} is no agent name; use dot-separated words of letters, \
                     digits, '-' and '_'"
                )));
            }
        }
        if let Some(sync) = &self.spec.sync_interval {
            natsd::parse_sync_interval(sync)
                .map_err(|why| BadDeployment(format!("sync_interval: {why}")))?;
        }
        let p = self.spec.ports;
        let mut used = vec![p.nats, p.cluster, p.sim];
        let most = hosts.iter().map(|h| h.nodes).max().unwrap_or(0);
        for i in 0..most {
            used.push(
                p.http.checked_add(i).ok_or_else(|| {
                    BadDeployment("ports.http leaves no room for the nodes".into())
                })?,
            );
        }
        let mut distinct = used.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() != used.len() || used.contains(&0) {
            return Err(BadDeployment(format!(
                "ports: nats {}, cluster {}, sim {} and http {} (+ one a node) must be distinct \
                 and not 0",
                p.nats, p.cluster, p.sim, p.http
            )));
        }
        Ok(())
    }

    /// The host named `name`; with `None`, the one whose address this machine has.
    pub fn host(&self, name: Option<&str>) -> anyhow::Result<&Host> {
        let listed = || {
            self.spec
                .hosts
                .iter()
                .map(|h| format!("{} ({})", h.name, h.address))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if let Some(name) = name {
            return self
                .spec
                .hosts
                .iter()
                .find(|h| h.name == name)
                .ok_or_else(|| {
                    anyhow!(
                        "--host {name} is not in {}; it lists {}",
                        self.file.display(),
                        listed()
                    )
                });
        }
        let here: Vec<&Host> = self
            .spec
            .hosts
            .iter()
            .filter(|h| std::net::UdpSocket::bind((h.address, 0)).is_ok())
            .collect();
        match here.as_slice() {
            [one] => Ok(one),
            [] => bail!(
                "no address of {} is on this machine (it lists {}); pass --host NAME",
                self.file.display(),
                listed()
            ),
            _ => bail!(
                "several hosts of {} are on this machine; pass --host NAME",
                self.file.display()
            ),
        }
    }

    /// The ids of `host`'s nodes: its name for one, `{name}-n1` ... for several.
    pub fn node_ids(host: &Host) -> Vec<String> {
        match host.nodes {
            1 => vec![host.name.clone()],
            n => (1..=n).map(|i| format!("{}-n{i}", host.name)).collect(),
        }
    }

    /// Every node of every host: the cluster's members.
    pub fn members(&self) -> Vec<String> {
        self.spec
            .hosts
            .iter()
            .flat_map(Deployment::node_ids)
            .collect()
    }

    /// Every host's server as clients reach it (TLS).
    pub fn client_urls(&self) -> Vec<String> {
        self.spec
            .hosts
            .iter()
            .map(|h| {
                format!(
                    "tls://{}",
                    SocketAddr::from((h.address, self.spec.ports.nats))
                )
            })
            .collect()
    }

    /// Every role of the deployment: each node, the monitor, the warden, the people's roles,
    /// and the agents the file names.
    pub fn roles(&self) -> Vec<Role> {
        let mut roles: Vec<Role> = self.members().into_iter().map(Role::Node).collect();
        roles.extend(super::roles::BESIDE_NODES);
        roles.extend(self.spec.agents.iter().cloned().map(Role::Agent));
        roles
    }

    fn path(&self, p: &Path) -> PathBuf {
        self.folder.join(p)
    }

    /// The nodes' configuration file, if the hosts file names one.
    pub fn config_path(&self) -> Option<PathBuf> {
        self.spec.config.as_deref().map(|p| self.path(p))
    }

    pub fn ca(&self) -> PathBuf {
        self.spec.ca.as_deref().map_or_else(
            || self.folder.join(TLS_DIR).join("ca.pem"),
            |p| self.path(p),
        )
    }

    /// `host`'s server certificate, key, and the CA.
    pub fn tls(&self, host: &Host) -> natsd::Tls {
        let tls = self.folder.join(TLS_DIR);
        natsd::Tls {
            cert: host
                .cert
                .as_deref()
                .map_or_else(|| tls.join(format!("{}.pem", host.name)), |p| self.path(p)),
            key: host.key.as_deref().map_or_else(
                || tls.join(format!("{}-key.pem", host.name)),
                |p| self.path(p),
            ),
            ca: self.ca(),
        }
    }

    pub(crate) fn secrets_path(&self) -> PathBuf {
        self.folder.join(SECRETS)
    }

    /// The deployment's passwords (`oam mesh init` writes them).
    pub fn secrets(&self) -> anyhow::Result<natsd::Credentials> {
        let path = self.secrets_path();
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "cannot read {}: run `oam mesh init --hosts {}` once, then copy its folder to \
                 every host (all but tls/ca-key.pem)",
                path.display(),
                self.file.display()
            )
        })?;
        serde_json::from_str(&text).with_context(|| format!("{} is damaged", path.display()))
    }
}

/// What `init` wrote.
#[derive(serde::Serialize, Debug)]
pub struct Initialized {
    pub secrets: PathBuf,
    /// Files it made (secrets first, then certificates); files that were there are kept.
    pub written: Vec<PathBuf>,
    pub roles: usize,
    /// Users the file no longer lists, whose passwords went (once every host has run `oam mesh
    /// up --hosts` with these secrets, their servers refuse them).
    pub revoked: Vec<String>,
}

/// Make what every host shares, beside the hosts file: the passwords (every role's; kept if
/// there, new roles added, roles the file no longer lists dropped) and, when there is no CA
/// yet, a CA and each host's certificate (its address and name, for clients and for routes).
/// Run once, and again after changing the hosts' agents; copy the folder to every host.
pub fn init(d: &Deployment) -> anyhow::Result<Initialized> {
    let mut written = Vec::new();
    let path = d.secrets_path();
    let mut creds = if path.exists() {
        d.secrets()?
    } else {
        written.push(path.clone());
        natsd::Credentials::generate()?
    };
    let roles = d.roles();
    let listed: std::collections::BTreeSet<String> = roles.iter().map(Role::user).collect();
    let revoked: Vec<String> = creds
        .users
        .keys()
        .filter(|u| !listed.contains(*u))
        .cloned()
        .collect();
    creds.users.retain(|u, _| listed.contains(u));
    for role in &roles {
        creds.add(role)?;
    }
    // Certificates are checked before anything is written.
    let ca = d.ca();
    for h in &d.spec.hosts {
        let t = d.tls(h);
        for f in [&t.cert, &t.key] {
            match (ca.exists(), f.exists()) {
                (true, false) => bail!(
                    "{} is missing: give host {} a certificate for {} signed by {}, or remove \
                     {} to have oam make a new CA and every host's certificate",
                    f.display(),
                    h.name,
                    h.address,
                    ca.display(),
                    ca.display()
                ),
                (false, true) => bail!(
                    "{} is there but no CA ({}): give the CA that signed it, or remove the \
                     hosts' certificates to have oam make a CA and new ones",
                    f.display(),
                    ca.display()
                ),
                _ => {}
            }
        }
    }
    super::write_private(
        &path,
        &format!("{}\n", serde_json::to_string_pretty(&creds)?),
    )?;
    if !ca.exists() {
        written.extend(make_certificates(d)?);
    }
    Ok(Initialized {
        secrets: path,
        written,
        roles: roles.len(),
        revoked,
    })
}

/// A new CA and, signed by it, each host's certificate (its address and name as subject
/// alternative names; for servers and, on routes, as clients).
fn make_certificates(d: &Deployment) -> anyhow::Result<Vec<PathBuf>> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    let ca_path = d.ca();
    let folder = ca_path.parent().unwrap_or(&d.folder).to_path_buf();
    std::fs::create_dir_all(&folder)
        .with_context(|| format!("cannot create {}", folder.display()))?;
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "oam mesh CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let ca_key_path = folder.join("ca-key.pem");
    super::write_private(&ca_key_path, &ca_key.serialize_pem())?;
    std::fs::write(&ca_path, ca_cert.pem())
        .with_context(|| format!("cannot write {}", ca_path.display()))?;
    let issuer = Issuer::new(ca, ca_key);
    let mut written = vec![ca_path, ca_key_path];
    for h in &d.spec.hosts {
        let t = d.tls(h);
        let mut p = CertificateParams::new(vec![h.address.to_string(), h.name.clone()])?;
        p.distinguished_name
            .push(DnType::CommonName, format!("oam host {}", h.name));
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &issuer)?;
        super::write_private(&t.key, &key.serialize_pem())?;
        std::fs::write(&t.cert, cert.pem())
            .with_context(|| format!("cannot write {}", t.cert.display()))?;
        written.extend([t.cert, t.key]);
    }
    Ok(written)
}

/// What one host runs of the deployment.
pub struct HostPlan {
    pub deployment: Deployment,
    /// `None`: the host whose address this machine has.
    pub host: Option<String>,
    pub dir: PathBuf,
    pub exe: PathBuf,
    pub nats_server: Option<PathBuf>,
    /// How long to wait for the other hosts' servers (a JetStream majority).
    pub wait: Duration,
    /// The decision log's age and size from the nodes' `config` (checked by the caller).
    pub log_retention: Option<(Duration, u64)>,
    /// Open the server's HTTP monitoring port (see `cluster::Plan::nats_monitor`).
    pub nats_monitor: bool,
}

/// Start this host's part of the deployment (or repair it, or say it runs), recorded in
/// `plan.dir` like a local mesh: `oam mesh status` and `down` work on it as on any.
pub async fn up(plan: &HostPlan) -> Result<Up, UpError> {
    let plan_err = UpError::Plan;
    let d = &plan.deployment;
    let host = d.host(plan.host.as_deref()).map_err(plan_err)?.clone();
    let creds = d.secrets().map_err(plan_err)?;
    let tls = d.tls(&host);
    for f in [&tls.cert, &tls.key, &tls.ca] {
        if !f.exists() {
            return Err(plan_err(anyhow!(
                "{} is missing: run `oam mesh init --hosts {}` once and copy its folder to every \
                 host (all but tls/ca-key.pem)",
                f.display(),
                d.file.display()
            )));
        }
    }
    crate::transport::connect::use_ca_file(&tls.ca);
    std::fs::create_dir_all(&plan.dir)
        .map_err(|e| plan_err(anyhow!("cannot create {}: {e}", plan.dir.display())))?;
    let dir = plan
        .dir
        .canonicalize()
        .map_err(|e| plan_err(anyhow!("cannot open {}: {e}", plan.dir.display())))?;
    let config = match &d.spec.config {
        Some(p) => Some(
            d.path(p)
                .canonicalize()
                .map_err(|e| plan_err(anyhow!("config {}: {e}", p.display())))?,
        ),
        None => None,
    };
    let local = Plan {
        config: config.clone(),
        log_retention: plan.log_retention,
        nats_server: plan.nats_server.clone(),
        ..Plan::any_ports(dir.clone(), host.nodes, plan.exe.clone())
    };
    if let Some(rec) = MeshRecord::load(&dir).map_err(plan_err)? {
        let total = rec.processes.len();
        let alive = rec.processes.iter().filter(|p| super::is_ours(p)).count();
        if alive > 0 && rec.hosts.as_deref() != Some(d.file.as_path()) {
            return Err(plan_err(anyhow!(
                "{} holds another mesh that runs ({alive} of {total} processes): stop it with \
                 `oam mesh down --dir {}`, or pass --dir for this host's part of {}",
                dir.display(),
                dir.display(),
                d.file.display()
            )));
        }
        if alive == total {
            // Roles added to the hosts' secrets since: this host's server takes them.
            if cluster::kept_credentials(&dir).is_some_and(|kept| kept != creds) {
                super::creds::take_roles(&dir, &creds)
                    .await
                    .map_err(UpError::Start)?;
                eprintln!(
                    "oam mesh up: {}'s server took the roles of {}",
                    host.name,
                    d.secrets_path().display()
                );
            }
            // Its server's JetStream went off (a full disk): started again once it has room.
            let clustered = d.spec.hosts.len() >= 2;
            if let Some(up) = cluster::jetstream_repaired(&local, &dir, rec, clustered).await? {
                return Ok(up);
            }
            return Ok(Up::AlreadyRunning { dir, alive, total });
        }
        if alive > 0 {
            let restarted = cluster::repair(&local, &dir, rec)
                .await
                .map_err(UpError::Start)?;
            return Ok(Up::Repaired {
                dir,
                restarted,
                total,
            });
        }
    }
    let ports = d.spec.ports;
    let mut wanted = vec![(ports.nats, "nats-server"), (ports.cluster, "its routes")];
    if config.is_none() {
        wanted.push((ports.sim, "the simulator"));
    }
    for i in 0..host.nodes {
        wanted.push((ports.http + i, "a node"));
    }
    for (port, what) in wanted {
        if std::net::TcpListener::bind((host.address, port)).is_err() {
            return Err(plan_err(anyhow!(
                "port {port} for {what} is in use on {} (or that address is not this \
                 machine's); stop what holds it, or change [ports] in {} on every host",
                host.address,
                d.file.display()
            )));
        }
    }
    let (bin, version) = natsd::find(plan.nats_server.as_deref()).map_err(plan_err)?;
    let mut started = Vec::new();
    let done = start_host(plan, &local, &dir, &bin, &host, &creds, &mut started).await;
    cluster::settle(done, dir, version, &started).await
}

async fn start_host(
    plan: &HostPlan,
    local: &Plan,
    dir: &Path,
    bin: &Path,
    host: &Host,
    creds: &natsd::Credentials,
    started: &mut Vec<Started>,
) -> anyhow::Result<MeshRecord> {
    let d = &plan.deployment;
    let ports = d.spec.ports;
    let tls = d.tls(host);
    let address = host.address.to_string();
    let peers = d
        .spec
        .hosts
        .iter()
        .filter(|h| h.name != host.name)
        .map(|h| SocketAddr::from((h.address, ports.cluster)).to_string())
        .collect();
    let server = super::NatsServer {
        name: format!("nats-{}", host.name),
        dir: dir.join("nats"),
        port: ports.nats,
        monitor_port: 0,
        cluster_port: ports.cluster,
        asked_port: ports.nats,
        address: Some(address.clone()),
        peers,
        tls: Some(tls.clone()),
        sync_interval: d.spec.sync_interval.clone(),
        // One server on this host's disk.
        store_bytes: super::free_bytes(dir).map(|f| super::store_bytes(f, 1)),
    };
    std::fs::create_dir_all(&server.dir)?;
    let layout = natsd::Layout {
        monitor_port: plan.nats_monitor.then_some(0),
        ..server.layout(std::slice::from_ref(&server), true)
    };
    let log = server.dir.join("nats.log");
    let running = natsd::start(bin, &layout, creds, &log, Duration::from_secs(15)).await?;
    started.push(Started {
        name: server.name.clone(),
        pid: running.child.id(),
        endpoint: format!(
            "tls://{}{}",
            SocketAddr::from((host.address, running.port)),
            cluster::monitor_shown(running.monitor_port)
        ),
        log,
        cmdline_marker: layout.config_path().display().to_string(),
        args: Vec::new(),
    });
    let server = super::NatsServer {
        monitor_port: running.monitor_port,
        ..server
    };
    let hosts = d.spec.hosts.len();
    if hosts > 1 {
        eprintln!(
            "oam mesh up: {} waits for the other hosts' servers (JetStream needs a majority of \
             {hosts}; at most {} s)",
            server.name,
            plan.wait.as_secs()
        );
        cluster::jetstream_sees(std::slice::from_ref(&server), creds, hosts, plan.wait)
            .await
            .map_err(|e| {
                anyhow!(
                    "{e:#}: start `oam mesh up --hosts {}` on the other hosts, and check that \
                     they reach {} on port {} (routes) and {} (clients)",
                    d.file.display(),
                    host.address,
                    ports.cluster,
                    ports.nats
                )
            })?;
    }
    if hosts == 2 {
        tracing::warn!(
            "2 hosts make no majority once one is gone: streams keep 2 copies and stop taking \
             writes when either server dies; list 3 hosts to survive the loss of one"
        );
    }
    let urls = d.client_urls();
    cluster::save_system(dir, &urls, creds)?;
    cluster::write_role_files(dir, &urls, Some(&tls.ca), creds)?;
    // Every host creates the buckets it needs; the first does, the others find them. Their
    // copies are as many as the server the admin reaches knows (`store::replicas`): wait until
    // it knows every host's, or a store made now would keep fewer for good.
    let admin = natsd::app_url(&urls, creds);
    let want = hosts.min(3);
    let deadline = std::time::Instant::now() + plan.wait;
    loop {
        let refused = crate::transport::connect::Refusal::default();
        let seen = crate::transport::connect::connect(&admin, "oam-mesh-up", false, &refused)
            .await
            .map_or(0, |nats| crate::transport::store::replicas(&nats));
        if seen >= want {
            break;
        }
        if std::time::Instant::now() >= deadline {
            bail!(
                "the servers of {} reach {seen} of {want} hosts' servers after {} s; check that \
                 every host reaches the others on port {}",
                d.file.display(),
                plan.wait.as_secs(),
                ports.cluster
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let mut tries = 0;
    while let Err(e) =
        cluster::create_buckets(&admin, local.log_retention, want, &creds.nodes()).await
    {
        tries += 1;
        if tries == 5 {
            return Err(e.context("cannot create the mesh's streams and buckets"));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let url_of = |role: &Role| creds.url(&urls, &role.user()).unwrap_or_default();
    let ca = (ENV_CA, tls.ca.display().to_string());
    let strings = |a: &[&str]| a.iter().map(|s| (*s).to_string()).collect::<Vec<_>>();
    let (sim_url, routing) = match &local.config {
        Some(path) => (
            String::new(),
            strings(&["--config", &path.display().to_string()]),
        ),
        None => {
            let listen = SocketAddr::from((host.address, ports.sim)).to_string();
            let url = cluster::start_sim(local, dir, &listen, started).await?;
            (url.clone(), vec!["--sim-url".to_string(), url])
        }
    };
    let members = d.members().join(",");
    for (i, id) in Deployment::node_ids(host).into_iter().enumerate() {
        let listen = SocketAddr::from((host.address, ports.http + i as u16)).to_string();
        let env = [(ENV_URL, url_of(&Role::Node(id.clone()))), ca.clone()];
        let spec = Spec {
            name: &id,
            args: cluster::node_args(&id, &routing, &listen, &members),
            env: &env,
            endpoint: "",
            marker: cluster::node_marker(&id, &routing),
        };
        let ready = cluster::start_oam(local, dir, started, spec).await?;
        if let (Some(url), Some(p)) = (ready["http"].as_str(), started.last_mut()) {
            p.settle_address(url);
        }
    }
    if host.monitor {
        let shown = dir.display().to_string();
        let env = [
            (ENV_URL, url_of(&Role::Monitor)),
            (cluster::ENV_SYS_URL, creds.observer_url(&urls)),
            ca.clone(),
        ];
        cluster::start_oam(local, dir, started, cluster::monitor_spec(&shown, &env)).await?;
    }
    Ok(MeshRecord {
        started_at_ms: crate::clock::now_ms(),
        servers: vec![server],
        sim_url,
        processes: std::mem::take(started),
        nats_urls: urls,
        ca: Some(tls.ca),
        hosts: Some(d.file.clone()),
    })
}

/// A deployment file that cannot be used: what is wrong with it.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct BadDeployment(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> anyhow::Result<Deployment> {
        let dir = std::env::temp_dir().join(format!(
            "oam-hosts-{}-{}",
            std::process::id(),
            crate::ids::random_hex(4)?
        ));
        std::fs::create_dir_all(&dir)?;
        let file = dir.join("hosts.toml");
        std::fs::write(&file, text)?;
        let d = Deployment::load(&file);
        let _ = std::fs::remove_dir_all(&dir);
        d
    }

    const THREE: &str = r#"
[[host]]
name = "a"
address = "10.9.0.1"
[[host]]
name = "b"
address = "10.9.0.2"
nodes = 2
monitor = false
[[host]]
name = "c"
address = "10.9.0.3"
"#;

    #[test]
    fn a_hosts_file_gives_members_servers_and_roles() {
        let d = load(THREE).unwrap();
        assert_eq!(d.members(), ["a", "b-n1", "b-n2", "c"]);
        assert_eq!(
            d.client_urls(),
            [
                "tls://10.9.0.1:4222",
                "tls://10.9.0.2:4222",
                "tls://10.9.0.3:4222"
            ]
        );
        let users: Vec<String> = d.roles().iter().map(Role::user).collect();
        assert!(users.contains(&"node-b-n2".to_string()), "{users:?}");
        assert!(users.contains(&"monitor".to_string()), "{users:?}");
        let b = d.host(Some("b")).unwrap();
        assert!(!b.monitor);
        assert!(d.tls(b).cert.ends_with("tls/b.pem"));
        let err = format!("{:#}", d.host(Some("z")).unwrap_err());
        assert!(
            err.contains("--host z") && err.contains("b (10.9.0.2)"),
            "{err}"
        );
    }

    #[test]
    fn a_bad_hosts_file_is_named_with_what_is_wrong() {
        for (text, says) in [
            ("", "lists no host"),
            (
                "[[host]]\nname = \"A\"\naddress = \"10.0.0.1\"\n",
                "lower-case",
            ),
            (
                "[[host]]\nname = \"a\"\naddress = \"10.0.0.1\"\n[[host]]\nname = \"a\"\naddress = \"10.0.0.2\"\n",
                "listed twice",
            ),
            (
                "[[host]]\nname = \"a\"\naddress = \"10.0.0.1\"\n[[host]]\nname = \"b\"\naddress = \"10.0.0.1\"\n",
                "two hosts",
            ),
            (
                "[[host]]\nname = \"a\"\naddress = \"0.0.0.0\"\n",
                "every address",
            ),
            ("[[host]]\nname = \"a\"\naddress = \"fd00::1\"\n", "IPv6"),
            (
                "[[host]]\nname = \"a\"\naddress = \"10.0.0.300\"\n",
                "address",
            ),
            ("[[host]]\nname = \"a\"\nadress = \"10.0.0.1\"\n", "adress"),
            (
                "[ports]\nnats = 6222\n[[host]]\nname = \"a\"\naddress = \"10.0.0.1\"\n",
                "distinct",
            ),
        ] {
            let err = format!("{:#}", load(text).unwrap_err());
            assert!(
                err.contains("hosts.toml") && err.contains(says),
                "{text:?}: {err}"
            );
        }
    }
}
