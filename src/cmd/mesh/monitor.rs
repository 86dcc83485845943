//! `oam mesh monitor`: the liveness monitor (started by `oam mesh up`, or by hand).

use crate::error::{Error, Kind, Result};
use crate::local::{self, cluster::ENV_SYS_URL};
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// System-account NATS URL (reads `$SYS` advisories). Default: $OAM_NATS_SYS_URL, then the
    /// mesh in --dir.
    #[arg(long)]
    pub sys_url: Option<String>,
    /// The mesh (its application account).
    #[command(flatten)]
    pub cluster: crate::cmd::ClusterArgs,
    /// Print the ready line as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(a: Args) -> Result<()> {
    use crate::transport::connect;
    let dir = a.cluster.dir();
    let role = crate::cmd::Role::Monitor;
    let app_url = a.cluster.url(&role)?;
    // The system account's limited observer, from the monitor's credentials file.
    let from_dir = || {
        let path = a.cluster.creds.clone().filter(|p| local::is_role_file(p));
        let path = path.unwrap_or_else(|| local::role_path(&dir, &role.user()));
        local::read_role_file(&path).ok()?.sys_url
    };
    let sys_url = a
        .sys_url
        .or_else(|| std::env::var(ENV_SYS_URL).ok())
        .or_else(from_dir)
        .ok_or_else(|| {
            Error::usage(
                "the monitor needs the system account to read $SYS advisories: pass --sys-url \
                 (or set OAM_NATS_SYS_URL), or run it beside a mesh started by `oam mesh up`",
            )
        })?;
    let app = crate::cmd::reach(&app_url, "oam-monitor", false).await?;
    let sys = crate::cmd::reach(&sys_url, "oam-monitor-sys", false).await?;
    let json = a.json;
    let shown = connect::redact(&app_url);
    let ready = move || {
        let mut out = std::io::stdout().lock();
        let line = serde_json::json!({"monitor": shown, "pid": std::process::id()});
        let _ = if json {
            writeln!(out, "{line}")
        } else {
            writeln!(out, "oam mesh monitor watching {shown}")
        };
        let _ = out.flush();
    };
    crate::mesh::monitor::run(app, sys, ready, crate::cmd::terminated())
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))
}
