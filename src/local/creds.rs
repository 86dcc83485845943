//! A mesh folder's NATS users, one per role: issuing one (a password in `system.json`, its
//! credentials file in `creds/`), revoking one, and having the running nats-server reload its
//! config and checking it took the change. `oam creds` and scenarios (for the agents they
//! start) use it.

use super::{cluster, natsd, roles::Role};
use anyhow::{Context, anyhow};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The mesh folder's credentials and its NATS servers as clients reach them (bare URLs; `None`:
/// the folder holds no mesh's).
pub fn load(dir: &Path) -> Option<(natsd::Credentials, Vec<String>)> {
    let creds = cluster::kept_credentials(dir)?;
    let url = super::recorded_url(dir, "app_url")?;
    let servers = url
        .split(',')
        .map(|u| crate::transport::connect::split_credentials(u).0)
        .collect();
    Some((creds, servers))
}

/// The CA of the folder's servers' TLS, if they speak it (its record says).
fn ca_of(dir: &Path) -> Option<PathBuf> {
    super::MeshRecord::load(dir).ok()??.ca
}

/// What issuing did: the user, its credentials file, and whether a running server took it
/// (false: the mesh is down; `oam mesh up` will).
pub struct Issued {
    pub user: String,
    pub file: PathBuf,
    pub url: String,
    pub reloaded: bool,
}

/// Refuse to change one host's roles of a mesh across hosts: every server must hold the same.
fn not_across_hosts(dir: &Path) -> anyhow::Result<()> {
    if let Ok(Some(super::MeshRecord {
        hosts: Some(file), ..
    })) = super::MeshRecord::load(dir)
    {
        anyhow::bail!(
            "the mesh in {} runs across the hosts of {f}, and every host's server must hold the \
             same roles: add the agent to `agents` in {f}, run `oam mesh init --hosts {f}`, \
             copy its secrets.json to every host, and run `oam mesh up --hosts {f}` on each (a \
             running host's server reloads its roles)",
            dir.display(),
            f = file.display()
        );
    }
    Ok(())
}

/// Issue credentials for `role` in the mesh folder `dir` (the same ones again if it has some).
pub async fn issue(dir: &Path, role: &Role) -> anyhow::Result<Issued> {
    let (mut creds, servers) = load(dir).with_context(|| no_cluster(dir))?;
    if !creds.users.contains_key(&role.user()) {
        not_across_hosts(dir)?;
    }
    let user = creds.add(role)?;
    cluster::save_system(dir, &servers, &creds)?;
    let ca = ca_of(dir);
    let file = super::write_role_file(dir, &servers, ca.as_deref(), &creds, role)?;
    let reloaded = reload(dir, &creds, &user).await?;
    if reloaded && matches!(role, Role::Node(_)) {
        node_log(dir, &servers, &creds)
            .await
            .context("cannot make the new node's decision log stream")?;
    }
    let url = creds.url(&servers, &user).unwrap_or_default();
    Ok(Issued {
        user,
        file,
        url,
        reloaded,
    })
}

/// Give every node its stream of the decision log, sharing what the log keeps now among them
/// (only the admin may make a stream): a node issued after `oam mesh up` writes its records too.
async fn node_log(
    dir: &Path,
    servers: &[String],
    creds: &natsd::Credentials,
) -> anyhow::Result<()> {
    let url = natsd::app_url(servers, creds);
    let (bare, auth) = crate::transport::connect::split_credentials(&url);
    let (name, password) = auth.unwrap_or_default();
    let mut opts = async_nats::ConnectOptions::with_user_and_password(name, password)
        .connection_timeout(Duration::from_secs(2));
    if let Some(ca) = ca_of(dir) {
        opts = opts.add_root_certificates(ca).require_tls(true);
    }
    let nats = opts.connect(bare.as_str()).await?;
    let js = crate::transport::store::context(&nats);
    let replicas = crate::transport::store::replicas(&nats);
    crate::transport::store::decisions::reshare(&js, &creds.nodes(), replicas).await?;
    Ok(())
}

/// Take `role`'s credentials back (its connections are closed); whether a running server took
/// it. An error when it had none.
pub async fn revoke(dir: &Path, role: &Role) -> anyhow::Result<bool> {
    not_across_hosts(dir)?;
    let (mut creds, servers) = load(dir).with_context(|| no_cluster(dir))?;
    let user = role.user();
    if creds.users.remove(&user).is_none() {
        anyhow::bail!(
            "{user} has no credentials in {}; `oam creds list` shows who has",
            dir.display()
        );
    }
    if let Role::Node(id) = role {
        creds.retired_nodes.insert(id.clone());
    }
    cluster::save_system(dir, &servers, &creds)?;
    let _ = std::fs::remove_file(super::role_path(dir, &user));
    reload(dir, &creds, &user).await
}

/// What to do when `dir` holds no mesh's credentials.
pub(crate) fn no_cluster(dir: &Path) -> String {
    format!(
        "no mesh credentials in {} (its system.json): start a mesh there with `oam mesh up --dir \
         {}`, or pass --dir for the folder of yours (as the user who started it)",
        dir.display(),
        dir.display()
    )
}

/// Rewrite every running server's config from `creds` and have each reload (SIGHUP), waiting
/// until user `changed` is admitted or refused accordingly on every one; false when no server
/// of this mesh is running (the next `oam mesh up` writes the configs). Roles are the same on
/// every server of a cluster: a server left out would admit a revoked user.
async fn reload(dir: &Path, creds: &natsd::Credentials, changed: &str) -> anyhow::Result<bool> {
    reload_checking(dir, creds, Some(changed)).await
}

/// This folder's servers take the roles of `creds` (written to `system.json`, the roles'
/// files and each server's config, then reloaded): a running host of a mesh across hosts
/// given a changed `secrets.json`. Whether a running server took them.
pub(crate) async fn take_roles(dir: &Path, creds: &natsd::Credentials) -> anyhow::Result<bool> {
    let (kept, servers) = load(dir).with_context(|| no_cluster(dir))?;
    // Reloaded first: the folder records the new roles only once the server took them, so a
    // failed reload is tried again by the next `oam mesh up`.
    let took = reload_checking(dir, creds, None).await?;
    cluster::save_system(dir, &servers, creds)?;
    cluster::write_role_files(dir, &servers, ca_of(dir).as_deref(), creds)?;
    for gone in kept.users.keys().filter(|u| !creds.users.contains_key(*u)) {
        let _ = std::fs::remove_file(super::role_path(dir, gone));
    }
    Ok(took)
}

async fn reload_checking(
    dir: &Path,
    creds: &natsd::Credentials,
    changed: Option<&str>,
) -> anyhow::Result<bool> {
    let record = super::MeshRecord::load(dir)?;
    let Some(record) = record else {
        return Ok(false);
    };
    let mut reloaded_any = false;
    for server in &record.servers {
        let Some(process) = record
            .processes
            .iter()
            .find(|p| p.name == server.name && super::is_ours(p))
        else {
            continue;
        };
        reload_one(server, &record.servers, process.pid, creds)
            .await
            .map_err(|why| {
                anyhow!(
                    "{}: {why}; see {}",
                    server.name,
                    server.dir.join("nats.log").display()
                )
            })?;
        let Some(changed) = changed else {
            reloaded_any = true;
            continue;
        };
        let own = [format!(
            "{}://{}:{}",
            if server.tls.is_some() { "tls" } else { "nats" },
            server.ip(),
            server.port
        )];
        let target = creds
            .url(&own, changed)
            .unwrap_or_else(|| natsd::server_list(changed, "revoked", &own));
        took(
            &target,
            creds.users.contains_key(changed),
            record.ca.as_deref(),
        )
        .await
        .map_err(|why| anyhow!("{}: {why}", server.name))?;
        reloaded_any = true;
    }
    Ok(reloaded_any)
}

/// Why a running server did not take a change of its users.
#[derive(Debug, thiserror::Error)]
enum ReloadError {
    #[error("cannot write its config: {0}")]
    Write(String),
    #[error("cannot ask it as the system account: {0}")]
    Unasked(String),
    #[error("cannot signal nats-server (pid {0}) to reload")]
    Unsignalled(u32),
    #[error("nats-server did not reload its config within 5 s")]
    NotReloaded,
    #[error("nats-server reloaded but does not {what} {user} (last try: {last})")]
    NotTaken {
        what: &'static str,
        user: String,
        last: String,
    },
}

/// Have `server` (process `pid`) reload its config written from `creds`.
async fn reload_one(
    server: &super::NatsServer,
    all: &[super::NatsServer],
    pid: u32,
    creds: &natsd::Credentials,
) -> std::result::Result<(), ReloadError> {
    let write = |l: &natsd::Layout| {
        super::write_private(&l.config_path(), &natsd::config(l, creds))
            .map_err(|e| ReloadError::Write(format!("{e:#}")))
    };
    // The server reloads only a config that names its ports as it was started ("any free
    // port"); once it has read it, the file names the ports taken again, so a restart from it
    // comes back at the same address.
    // When it last loaded it is asked of the server as the system account (it has no
    // monitoring port unless one was asked for).
    let sys = server
        .system_connection(creds)
        .await
        .map_err(|e| ReloadError::Unasked(format!("{e:#}")))?;
    let name = server.config_name(all);
    let before = loaded_at(&sys, &name).await;
    write(&server.layout(all, true))?;
    let done = if super::signal(pid, libc::SIGHUP) {
        reloaded(&sys, &name, before).await
    } else {
        Err(ReloadError::Unsignalled(pid))
    };
    write(&server.layout(all, false))?;
    done
}

/// When the server named `name` last loaded its config (`config_load_time` of its VARZ).
async fn loaded_at(sys: &async_nats::Client, name: &str) -> Option<String> {
    let v = natsd::server_info(sys, name, "VARZ").await?;
    v["data"]["config_load_time"].as_str().map(String::from)
}

/// Wait (at most 5 s) until the server named `name` has loaded its config again since
/// `before`.
async fn reloaded(
    sys: &async_nats::Client,
    name: &str,
    before: Option<String>,
) -> std::result::Result<(), ReloadError> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let now = loaded_at(sys, name).await;
        if now.is_some() && now != before {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(ReloadError::NotReloaded);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Check that the server admits the credentials in `url` (`admit`) or refuses them as
/// unauthorized (a revoked user): a few tries within 5 s, for a busy server.
async fn took(url: &str, admit: bool, ca: Option<&Path>) -> std::result::Result<(), ReloadError> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let (bare, auth) = crate::transport::connect::split_credentials(url);
    let (name, password) = auth.unwrap_or_default();
    loop {
        // A plain connection: a refusal must not stop this command.
        let mut opts =
            async_nats::ConnectOptions::with_user_and_password(name.clone(), password.clone())
                .connection_timeout(Duration::from_secs(2));
        if let Some(ca) = ca {
            opts = opts
                .add_root_certificates(ca.to_path_buf())
                .require_tls(true);
        }
        // A refusal is what a revoke waits for: async-nats' own error line about it is not
        // shown.
        let tried = tracing::instrument::WithSubscriber::with_subscriber(
            opts.connect(bare.as_str()),
            tracing::subscriber::NoSubscriber::default(),
        )
        .await;
        let as_wanted = match &tried {
            Ok(_) => admit,
            Err(e) => !admit && e.to_string().to_ascii_lowercase().contains("authoriz"),
        };
        if as_wanted {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(ReloadError::NotTaken {
                what: if admit { "admit" } else { "refuse" },
                user: name,
                last: tried.map_or_else(|e| e.to_string(), |_| "admitted".into()),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
