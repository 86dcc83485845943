//! The `oam` binary: parse arguments, run, map the result to an exit code. Everything else lives
//! in the library.

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = oam::cli::Cli::parse();
    match oam::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => oam::error::report(&e),
    }
}
