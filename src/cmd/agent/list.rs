//! `oam agent list`: the agents in the mesh catalog, with how many instances are alive (their
//! lease renewed by a heartbeat within the last few seconds) and when one last beat.

use crate::error::{Error, Kind, Result};
use crate::mesh::protocol::CatalogEntry;
use crate::mesh::store::{self, InstanceRecord};
use serde::Serialize;
use std::io::Write;

/// An instance whose last heartbeat is older than this is not counted alive.
const ALIVE_WITHIN_MS: u64 = 3_000;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// One JSON array: the catalog entries with `instances_alive` and `last_heartbeat_ms_ago`.
    #[arg(long)]
    pub json: bool,
    /// Whole lines, however wide (by default the table wraps to the terminal).
    #[arg(long)]
    pub wide: bool,
}

/// One catalog entry and what serves it now.
#[derive(Serialize)]
struct Listed<'a> {
    #[serde(flatten)]
    entry: &'a CatalogEntry,
    /// Instances (of oam hosts) that beat within the last 3 s.
    instances_alive: usize,
    /// Since the last heartbeat of any instance of it (`null`: none recorded; agents of other
    /// clients keep no instance records).
    last_heartbeat_ms_ago: Option<u64>,
}

fn listed<'a>(entry: &'a CatalogEntry, records: &[InstanceRecord], now: u64) -> Listed<'a> {
    let ages: Vec<u64> = records
        .iter()
        .filter(|r| r.agents.contains(&entry.name))
        .map(|r| now.saturating_sub(r.renewed_at_ms))
        .collect();
    Listed {
        entry,
        instances_alive: ages.iter().filter(|&&a| a <= ALIVE_WITHIN_MS).count(),
        last_heartbeat_ms_ago: ages.iter().min().copied(),
    }
}

pub async fn run(cluster: &super::super::ClusterArgs, l: Args) -> Result<()> {
    let nc = cluster
        .connect(&crate::cmd::Role::Caller, "oam-agent-list")
        .await?;
    let mesh = store::Mesh::new(nc);
    let (entries, unreadable) = store::catalog_checked(&mesh)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))?;
    if !unreadable.is_empty() {
        eprintln!(
            "oam: {} catalog items are not agent entries and are not listed: {}",
            unreadable.len(),
            unreadable.join("; ")
        );
    }
    let records = store::all_instances(&mesh).await.unwrap_or_default();
    let now = crate::clock::now_ms();
    let rows: Vec<Listed> = entries.iter().map(|e| listed(e, &records, now)).collect();
    let mut out = std::io::stdout().lock();
    if l.json {
        serde_json::to_writer_pretty(&mut out, &rows).map_err(Error::failed)?;
        writeln!(out)?;
    } else if rows.is_empty() {
        writeln!(out, "no agents in the catalog")?;
    } else {
        let lines = rows.iter().map(|r| {
            let e = r.entry;
            let kind = match (e.invocable, e.streaming) {
                (true, false) => "call",
                (true, true) => "stream",
                (false, true) => "publisher",
                (false, false) => "watcher",
            };
            let beat = r.last_heartbeat_ms_ago.map_or_else(
                || "-".to_string(),
                |ms| format!("{:.1}s ago", ms as f64 / 1e3),
            );
            vec![
                e.name.clone(),
                e.version.clone(),
                kind.to_string(),
                r.instances_alive.to_string(),
                beat,
                e.description.clone(),
            ]
        });
        let header = [
            "name",
            "version",
            "kind",
            "alive",
            "last beat",
            "description",
        ];
        writeln!(out, "{}", crate::cmd::table(&header, lines, l.wide))?;
    }
    Ok(())
}
