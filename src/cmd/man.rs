//! `oam man`: the manual page (roff) on stdout, or one page per command into a folder.
//!
//!     oam man | man -l -
//!     oam man --out-dir /usr/local/share/man/man1

use crate::error::{Error, Result};
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Write `oam.1` and a page for every subcommand (`oam-mesh-up.1`, ...) into this folder
    /// instead of printing the top-level page.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
}

/// Render the pages of `cli` (the whole command line, from `crate::cli`).
pub fn run(a: Args, cli: clap::Command) -> Result<()> {
    match a.out_dir {
        Some(dir) => {
            std::fs::create_dir_all(&dir)
                .map_err(|e| Error::usage(format!("cannot create {}: {e}", dir.display())))?;
            clap_mangen::generate_to(cli, &dir)
                .map_err(|e| Error::usage(format!("cannot write into {}: {e}", dir.display())))?;
            let mut out = std::io::stdout().lock();
            writeln!(out, "manual pages written to {}", dir.display())?;
        }
        None => {
            let mut page = Vec::new();
            clap_mangen::Man::new(cli).render(&mut page)?;
            std::io::stdout().lock().write_all(&page)?;
        }
    }
    Ok(())
}
