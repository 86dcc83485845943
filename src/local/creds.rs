//! A mesh folder's NATS users, one per role: issuing one (a password in `system.json`, its
//! credentials file in `creds/`), revoking one, and having the running nats-server reload its
//! config and checking it took the change. `oam creds` and scenarios (for the agents they
//! start) use it.

use super::{cluster, natsd, roles::Role};
use anyhow::{Context, anyhow};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The mesh folder's credentials and NATS port (`None`: the folder holds no mesh's).
pub fn load(dir: &Path) -> Option<(natsd::Credentials, u16)> {
    let creds = cluster::kept_credentials(dir)?;
    let port =
        super::recorded_url(dir, "app_url").and_then(|url| url.rsplit(':').next()?.parse().ok())?;
    Some((creds, port))
}

/// What issuing did: the user, its credentials file, and whether a running server took it
/// (false: the mesh is down; `oam mesh up` will).
pub struct Issued {
    pub user: String,
    pub file: PathBuf,
    pub url: String,
    pub reloaded: bool,
}

/// Issue credentials for `role` in the mesh folder `dir` (the same ones again if it has some).
pub async fn issue(dir: &Path, role: &Role) -> anyhow::Result<Issued> {
    let (mut creds, port) = load(dir).with_context(|| no_cluster(dir))?;
    let user = creds.add(role)?;
    cluster::save_system(dir, port, &creds)?;
    let file = super::write_role_file(dir, port, &creds, role)?;
    let reloaded = reload(dir, &creds, &user).await?;
    let url = creds.url(port, &user).unwrap_or_default();
    Ok(Issued {
        user,
        file,
        url,
        reloaded,
    })
}

/// Take `role`'s credentials back (its connections are closed); whether a running server took
/// it. An error when it had none.
pub async fn revoke(dir: &Path, role: &Role) -> anyhow::Result<bool> {
    let (mut creds, port) = load(dir).with_context(|| no_cluster(dir))?;
    let user = role.user();
    if creds.users.remove(&user).is_none() {
        anyhow::bail!(
            "{user} has no credentials in {}; `oam creds list` shows who has",
            dir.display()
        );
    }
    cluster::save_system(dir, port, &creds)?;
    let _ = std::fs::remove_file(super::role_path(dir, &user));
    reload(dir, &creds, &user).await
}

/// What to do when `dir` holds no mesh's credentials.
pub fn no_cluster(dir: &Path) -> String {
    format!(
        "no mesh credentials in {} (its system.json): start a mesh there with `oam mesh up --dir \
         {}`, or pass --dir for the folder of yours (as the user who started it)",
        dir.display(),
        dir.display()
    )
}

/// Rewrite the running server's config from `creds` and have it reload (SIGHUP), waiting until
/// user `changed` is admitted or refused accordingly; false when no server of this mesh is
/// running (the next `oam mesh up` writes the config).
async fn reload(dir: &Path, creds: &natsd::Credentials, changed: &str) -> anyhow::Result<bool> {
    let record = super::Record::load(dir)?;
    let Some(record) = record else {
        return Ok(false);
    };
    let Some(server) = record
        .processes
        .iter()
        .find(|p| p.name == "nats-server" && super::is_ours(p))
    else {
        return Ok(false);
    };
    let layout = |port, monitor_port| natsd::Layout {
        port,
        monitor_port,
        dir: dir.to_path_buf(),
        max_file_store: None,
    };
    let write =
        |l: &natsd::Layout| super::write_private(&l.config_path(), &natsd::config(l, creds));
    // The server reloads only a config that names its ports as it was started ("any free
    // port"); once it has read it, the file names the ports taken again, so a restart from it
    // comes back at the same address.
    let http = crate::http::http_client(Some(Duration::from_secs(1)))?;
    let varz = format!("http://127.0.0.1:{}/varz", record.nats_monitor_port);
    let before = loaded_at(&http, &varz).await;
    write(&layout(record.nats_asked_port, 0))?;
    let done = if super::signal(server.pid, libc::SIGHUP) {
        reloaded(&http, &varz, before).await
    } else {
        Err(format!(
            "cannot signal nats-server (pid {}) to reload",
            server.pid
        ))
    };
    write(&layout(record.nats_port, record.nats_monitor_port))?;
    let port = record.nats_port;
    let target = creds
        .url(port, changed)
        .unwrap_or_else(|| format!("nats://{changed}:revoked@127.0.0.1:{port}"));
    let done = match done {
        Ok(()) => took(&target, creds.users.contains_key(changed)).await,
        Err(e) => Err(e),
    };
    done.map(|()| true)
        .map_err(|why| anyhow!("{why}; see {}", dir.join("nats.log").display()))
}

/// When the server last loaded its config (its monitoring endpoint's `config_load_time`).
async fn loaded_at(http: &reqwest::Client, varz: &str) -> Option<String> {
    let v: serde_json::Value = http.get(varz).send().await.ok()?.json().await.ok()?;
    v["config_load_time"].as_str().map(String::from)
}

/// Wait (at most 5 s) until the server has loaded its config again since `before`.
async fn reloaded(
    http: &reqwest::Client,
    varz: &str,
    before: Option<String>,
) -> std::result::Result<(), String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let now = loaded_at(http, varz).await;
        if now.is_some() && now != before {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err("nats-server did not reload its config within 5 s".into());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Check that the server admits the credentials in `url` (`admit`) or refuses them as
/// unauthorized (a revoked user): a few tries within 5 s, for a busy server.
async fn took(url: &str, admit: bool) -> std::result::Result<(), String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let (bare, auth) = crate::transport::connect::split_credentials(url);
    let (name, password) = auth.unwrap_or_default();
    loop {
        // A plain connection: a refusal must not stop this command.
        let tried =
            async_nats::ConnectOptions::with_user_and_password(name.clone(), password.clone())
                .connection_timeout(Duration::from_secs(2))
                .connect(bare.as_str())
                .await;
        let as_wanted = match &tried {
            Ok(_) => admit,
            Err(e) => !admit && e.to_string().to_ascii_lowercase().contains("authoriz"),
        };
        if as_wanted {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            let what = if admit { "admit" } else { "refuse" };
            return Err(format!(
                "nats-server reloaded but does not {what} {name} (last try: {})",
                tried.map_or_else(|e| e.to_string(), |_| "admitted".into())
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
