//! `oam mesh status`: what is running and healthy, and on a mesh of several servers whether
//! every stream keeps its copies (exit 1 if anything is not).

use crate::error::{Error, Findings, Kind, Result};
use crate::local::{MeshRecord, cluster};
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The state folder of the mesh (as given to `oam mesh up --dir`).
    #[arg(long, env = "OAM_DIR", default_value = ".oam")]
    pub dir: PathBuf,
    /// Every process's state as one JSON document.
    #[arg(long)]
    pub json: bool,
    /// Whole lines, however wide (by default the table wraps to the terminal).
    #[arg(long)]
    pub wide: bool,
}

pub async fn run(a: Args) -> Result<Findings> {
    let Some(rec) = MeshRecord::load(&a.dir).map_err(|e| Error::new(Kind::Usage, e))? else {
        return Err(Error::new(
            Kind::Unreachable,
            anyhow::anyhow!(
                "no mesh recorded in {}; start one with `oam mesh up`",
                a.dir.display()
            ),
        ));
    };
    let rows = cluster::status(&rec).await.map_err(Error::failed)?;
    let streams = cluster::stream_status(&a.dir, &rec).await;
    let sick: Vec<&cluster::StreamStatus> =
        streams.iter().flatten().filter(|s| !s.healthy).collect();
    let all_healthy = rows.iter().all(|r| r.healthy) && sick.is_empty();
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(
            out,
            "{}",
            serde_json::json!({"healthy": all_healthy, "processes": rows, "streams": streams})
        )?;
    } else {
        let lines = rows.iter().map(|r| {
            vec![
                r.name.clone(),
                r.pid.to_string(),
                r.endpoint.clone(),
                r.detail.clone(),
            ]
        });
        let header = ["process", "pid", "endpoint", "status"];
        writeln!(out, "{}", crate::cmd::table(&header, lines, a.wide))?;
        match &streams {
            Some(all) if sick.is_empty() => writeln!(
                out,
                "\n{} streams, every copy current on every server",
                all.len()
            )?,
            Some(_) => {
                let lines = sick.iter().map(|s| vec![s.name.clone(), s.detail.clone()]);
                writeln!(out)?;
                writeln!(
                    out,
                    "{}",
                    crate::cmd::table(&["stream", "copies"], lines, a.wide)
                )?;
            }
            None => {}
        }
    }
    let mut failures: Vec<String> = rows
        .iter()
        .filter(|r| !r.healthy)
        .map(|r| format!("{} (pid {}): {}", r.name, r.pid, r.detail))
        .collect();
    failures.extend(
        sick.iter()
            .map(|s| format!("stream {}: {}", s.name, s.detail)),
    );
    Ok(Findings::from_failures(failures))
}
