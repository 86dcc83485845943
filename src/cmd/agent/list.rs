//! `oam agent list`: the agents in the mesh catalog.

use crate::error::{Error, Kind, Result};
use crate::mesh::store;
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long)]
    pub json: bool,
}

pub async fn run(url: &str, l: Args) -> Result<()> {
    let nc = crate::transport::connect::reach(url, "oam-agent-list", false).await?;
    let entries = store::catalog(&nc)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))?;
    let mut out = std::io::stdout().lock();
    if l.json {
        serde_json::to_writer_pretty(&mut out, &entries).map_err(Error::failed)?;
        writeln!(out)?;
    } else if entries.is_empty() {
        writeln!(out, "no agents in the catalog")?;
    } else {
        writeln!(
            out,
            "{:30} {:8} {:10} DESCRIPTION",
            "NAME", "VERSION", "KIND"
        )?;
        for e in &entries {
            let kind = match (e.invocable, e.streaming) {
                (true, false) => "call",
                (true, true) => "stream",
                (false, true) => "publisher",
                (false, false) => "watcher",
            };
            writeln!(
                out,
                "{:30} {:8} {:10} {}",
                e.name, e.version, kind, e.description
            )?;
        }
    }
    Ok(())
}
