//! `oam completions SHELL`: a completion script for the shell, on stdout.
//!
//!     oam completions bash > ~/.local/share/bash-completion/completions/oam
//!     oam completions zsh > "${fpath[1]}/_oam"
//!     oam completions fish > ~/.config/fish/completions/oam.fish

use crate::error::Result;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The shell: bash, zsh, fish, elvish or powershell.
    pub shell: clap_complete::Shell,
}

/// Write the script for `cli` (the whole command line, from `crate::cli`). It is made whole
/// first: the generator panics on a failed write, where a closed stdout (`| head`) must exit
/// 0 quietly like every command's.
pub fn run(a: Args, mut cli: clap::Command) -> Result<()> {
    use std::io::Write;
    let mut script = Vec::new();
    clap_complete::generate(a.shell, &mut cli, "oam", &mut script);
    std::io::stdout().lock().write_all(&script)?;
    Ok(())
}
