//! `oam creds issue | list | revoke`: the NATS users of a local mesh, one per role. Issuing
//! writes the role's credentials file (`creds/{user}.json`, 0600), adds the user to the
//! server's config and has the running server reload it (no restart); revoking removes both,
//! and the server closes that user's connections.

use crate::error::{Error, Kind, Result};
use crate::local::{self, creds, natsd, roles::Role};
use std::io::Write;
use std::path::Path;

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
    /// agent, caller, sdk-agent, sdk-caller (for the Open Agent Mesh SDK), viewer, operator,
    /// node, monitor or warden.
    #[arg(long)]
    pub role: String,
    /// The agent's name (agent) or the node's id (node).
    #[arg(long)]
    pub name: Option<String>,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

#[derive(clap::Args, Debug)]
pub struct ListArgs {
    /// One JSON array on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

pub async fn run(args: Args) -> Result<()> {
    match args.command {
        Command::Issue(w) => issue(w).await,
        Command::List(l) => list(l),
        Command::Revoke(w) => revoke(w).await,
    }
}

/// The mesh folder's credentials, or what to do.
fn load(dir: &Path) -> Result<natsd::Credentials> {
    creds::load(dir)
        .map(|(c, _)| c)
        .ok_or_else(|| Error::usage(creds::no_cluster(dir)))
}

async fn issue(w: Which) -> Result<()> {
    let role = Role::parse(&w.role, w.name.as_deref()).map_err(Error::usage)?;
    let dir = w.cluster.dir();
    load(&dir)?;
    let issued = creds::issue(&dir, &role)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))?;
    let (user, file, reloaded) = (issued.user, issued.file, issued.reloaded);
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
    let dir = w.cluster.dir();
    let user = role.user();
    if !load(&dir)?.users.contains_key(&user) {
        return Err(Error::usage(format!(
            "{user} has no credentials in {}; `oam creds list` shows who has",
            dir.display()
        )));
    }
    let reloaded = creds::revoke(&dir, &role)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))?;
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
    let dir = l.cluster.dir();
    let creds = load(&dir)?;
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
