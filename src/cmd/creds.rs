//! `oam creds issue | list | revoke`: the NATS users of a local mesh, one per role. Issuing
//! writes the role's credentials file (`creds/{user}.json`, 0600), adds the user to the
//! server's config and has the running server reload it (no restart); revoking removes both,
//! and the server closes that user's connections.

use crate::error::{Error, Kind, Result};
use crate::local::{self, cluster, natsd, roles::Role};
use std::io::Write;
use std::path::Path;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Credentials for a new agent, caller, viewer, ...: `oam creds issue --role agent --name X`.
    Issue(Which),
    /// Every user of the mesh, its role and its credentials file.
    List(ListArgs),
    /// Take a user's credentials back; its connections are closed.
    Revoke(Which),
}

#[derive(clap::Args, Debug)]
pub struct Which {
    /// agent, caller, viewer, operator, node, monitor or warden.
    #[arg(long)]
    pub role: String,
    /// The agent's name (agent) or the node's id (node).
    #[arg(long)]
    pub name: Option<String>,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub mesh: super::MeshArgs,
}

#[derive(clap::Args, Debug)]
pub struct ListArgs {
    /// One JSON array on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub mesh: super::MeshArgs,
}

pub async fn run(args: Args) -> Result<()> {
    match args.command {
        Command::Issue(w) => issue(w).await,
        Command::List(l) => list(l),
        Command::Revoke(w) => revoke(w).await,
    }
}

/// The mesh folder's credentials and NATS port, or what to do.
fn load(dir: &Path) -> Result<(natsd::Credentials, u16)> {
    let creds = cluster::kept_credentials(dir).ok_or_else(|| {
        Error::usage(format!(
            "no mesh credentials in {} (its system.json): start a mesh there with `oam mesh up \
             --dir {}`, or pass --dir for the folder of yours (as the user who started it)",
            dir.display(),
            dir.display()
        ))
    })?;
    let port = local::recorded_url(dir, "app_url")
        .and_then(|url| url.rsplit(':').next()?.parse().ok())
        .ok_or_else(|| {
            Error::usage(format!(
                "{} names no NATS URL; run `oam mesh up --dir {}` again",
                dir.join(local::SYSTEM).display(),
                dir.display()
            ))
        })?;
    Ok((creds, port))
}

async fn issue(w: Which) -> Result<()> {
    let role = Role::parse(&w.role, w.name.as_deref()).map_err(Error::usage)?;
    let dir = w.mesh.dir();
    let (mut creds, port) = load(&dir)?;
    let user = creds.add(&role).map_err(|e| Error::new(Kind::Failed, e))?;
    cluster::save_system(&dir, port, &creds).map_err(|e| Error::new(Kind::Failed, e))?;
    let file = local::write_role_file(&dir, port, &creds, &role)
        .map_err(|e| Error::new(Kind::Failed, e))?;
    let reloaded = reload(&dir, &creds, &user).await?;
    let mut out = std::io::stdout().lock();
    if w.json {
        let line = serde_json::json!({
            "user": user, "role": role.kind(), "file": file, "reloaded": reloaded,
        });
        writeln!(out, "{line}")?;
    } else {
        writeln!(
            out,
            "issued {user} ({} role): {}",
            role.kind(),
            file.display()
        )?;
        writeln!(
            out,
            "give that file to the process, e.g. `oam agent serve ... --creds {}`{}",
            file.display(),
            if reloaded {
                ""
            } else {
                " (the mesh is down: it takes effect at `oam mesh up`)"
            }
        )?;
    }
    Ok(())
}

async fn revoke(w: Which) -> Result<()> {
    let role = Role::parse(&w.role, w.name.as_deref()).map_err(Error::usage)?;
    let dir = w.mesh.dir();
    let (mut creds, port) = load(&dir)?;
    let user = role.user();
    if creds.users.remove(&user).is_none() {
        return Err(Error::usage(format!(
            "{user} has no credentials in {}; `oam creds list` shows who has",
            dir.display()
        )));
    }
    cluster::save_system(&dir, port, &creds).map_err(|e| Error::new(Kind::Failed, e))?;
    let _ = std::fs::remove_file(local::role_path(&dir, &user));
    let reloaded = reload(&dir, &creds, &user).await?;
    let mut out = std::io::stdout().lock();
    if w.json {
        writeln!(
            out,
            "{}",
            serde_json::json!({"revoked": user, "reloaded": reloaded})
        )?;
    } else {
        writeln!(out, "revoked {user}")?;
    }
    Ok(())
}

fn list(l: ListArgs) -> Result<()> {
    let dir = l.mesh.dir();
    let (creds, _) = load(&dir)?;
    let rows: Vec<serde_json::Value> = creds
        .users
        .keys()
        .filter_map(|user| {
            let role = Role::of_user(user)?;
            let file = local::role_path(&dir, user);
            Some(serde_json::json!({
                "user": user,
                "role": role.kind(),
                "file": file.exists().then_some(file),
            }))
        })
        .collect();
    let mut out = std::io::stdout().lock();
    if l.json {
        writeln!(out, "{}", serde_json::Value::Array(rows))?;
        return Ok(());
    }
    let table = super::table(
        &["user", "role", "credentials file"],
        rows.iter().map(|r| {
            vec![
                r["user"].as_str().unwrap_or("").to_string(),
                r["role"].as_str().unwrap_or("").to_string(),
                r["file"].as_str().unwrap_or("(missing)").to_string(),
            ]
        }),
        false,
    );
    writeln!(out, "{table}")?;
    Ok(())
}

/// Rewrite the running server's config from `creds` and have it reload (SIGHUP), waiting until
/// user `changed` is admitted or refused accordingly; false when no server of this mesh is
/// running (the next `oam mesh up` writes the config).
async fn reload(dir: &Path, creds: &natsd::Credentials, changed: &str) -> Result<bool> {
    let record = local::Record::load(dir).map_err(|e| Error::new(Kind::Failed, e))?;
    let Some(record) = record else {
        return Ok(false);
    };
    let Some(server) = record
        .processes
        .iter()
        .find(|p| p.name == "nats-server" && local::is_ours(p))
    else {
        return Ok(false);
    };
    let layout = |port, monitor_port| natsd::Layout {
        port,
        monitor_port,
        dir: dir.to_path_buf(),
    };
    let write = |l: &natsd::Layout| {
        local::write_private(&l.config_path(), &natsd::config(l, creds))
            .map_err(|e| Error::new(Kind::Failed, e))
    };
    // The server reloads only a config that names its ports as it was started ("any free
    // port"); once it has read it, the file names the ports taken again, so a restart from it
    // comes back at the same address.
    let http = crate::http::http_client(Some(Duration::from_secs(1)))
        .map_err(|e| Error::new(Kind::Failed, e))?;
    let varz = format!("http://127.0.0.1:{}/varz", record.nats_monitor_port);
    let before = loaded_at(&http, &varz).await;
    write(&layout(record.nats_asked_port, 0))?;
    let done = if local::signal(server.pid, libc::SIGHUP) {
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
    done.map(|()| true).map_err(|why| {
        Error::new(
            Kind::Unreachable,
            anyhow::anyhow!("{why}; see {}", dir.join("nats.log").display()),
        )
    })
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
