//! `oam mesh init --hosts FILE`: make what every host of a mesh across hosts shares, beside the
//! file that lists them (`crate::local::hosts::init`): the passwords and, unless a CA is
//! there, a CA and each host's certificate.

use crate::error::{Error, Result};
use crate::local::hosts;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The file that lists the hosts (`[[host]]` tables with `name` and `address`; see
    /// docs/cluster.md).
    #[arg(long, value_name = "FILE")]
    pub hosts: PathBuf,
    /// Print what was written as one JSON document.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(a: Args) -> Result<()> {
    let d = hosts::Deployment::load(&a.hosts).map_err(|e| Error::usage(format!("{e:#}")))?;
    let done = hosts::init(&d).map_err(Error::failed)?;
    let mut out = std::io::stdout().lock();
    if a.json {
        let doc = serde_json::to_string(&done).map_err(Error::failed)?;
        writeln!(out, "{doc}")?;
        return Ok(());
    }
    writeln!(
        out,
        "oam mesh init: {} host{}, {} roles; passwords in {} (keep it private)",
        d.spec.hosts.len(),
        if d.spec.hosts.len() == 1 { "" } else { "s" },
        done.roles,
        done.secrets.display()
    )?;
    for f in &done.written {
        writeln!(out, "  wrote {}", f.display())?;
    }
    for user in &done.revoked {
        writeln!(out, "  revoked {user} (no longer in the file)")?;
    }
    writeln!(
        out,
        "\nNext: copy {} to every host (all but tls/ca-key.pem, which only makes certificates), \
         then on each run\n  oam mesh up --hosts {}",
        d.folder.display(),
        d.file.display()
    )?;
    Ok(())
}
