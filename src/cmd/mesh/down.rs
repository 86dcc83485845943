//! `oam mesh down`: stop exactly what `oam mesh up` started.

use crate::error::{Error, Kind, Result};
use crate::local::{Stopped, cluster};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The state folder of the mesh to stop (as given to `oam mesh up --dir`).
    #[arg(long, env = "OAM_DIR", default_value = ".oam")]
    pub dir: PathBuf,
    /// How long each process gets to exit after SIGTERM before SIGKILL.
    #[arg(long, default_value_t = 5_000)]
    pub grace_ms: u64,
    /// Say how each process stopped as one JSON document.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(a: Args) -> Result<()> {
    let grace = Duration::from_millis(a.grace_ms);
    let report = cluster::down(&a.dir, grace)
        .await
        .map_err(|e| Error::new(Kind::Usage, e))?;
    let mut out = std::io::stdout().lock();
    let Some(report) = report else {
        if a.json {
            writeln!(out, "{}", serde_json::json!({"stopped": []}))?;
        } else {
            writeln!(
                out,
                "no mesh recorded in {}; nothing to stop",
                a.dir.display()
            )?;
        }
        return Ok(());
    };
    if a.json {
        let stopped: Vec<serde_json::Value> = report
            .iter()
            .map(|(p, how)| serde_json::json!({"name": p.name, "pid": p.pid, "how": how}))
            .collect();
        writeln!(out, "{}", serde_json::json!({ "stopped": stopped }))?;
    } else {
        for (p, how) in &report {
            let how = match how {
                Stopped::Terminated => "stopped",
                Stopped::Killed => "killed after the grace period",
                Stopped::NotRunning => "was not running",
            };
            writeln!(out, "  {:12} {:>7}  {how}", p.name, p.pid)?;
        }
        writeln!(out, "oam mesh down: logs kept in {}", a.dir.display())?;
    }
    Ok(())
}
