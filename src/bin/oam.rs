//! The `oam` binary: parse arguments, set up logging and the runtime, run, map the result to an
//! exit code. Everything else lives in the library.

use std::io::IsTerminal;
use std::process::ExitCode;

/// mimalloc, not glibc's malloc: a node allocates on one worker thread and frees on another
/// (a request's record is built on the request's task and freed by the decision log's), where
/// glibc's arenas take a lock per free; measured with `scripts/bench-gateway`.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = match oam::cli::Cli::parse_args() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    // `oam watch` owns the terminal: log lines would land on its screen, so it logs nothing
    // unless asked (RUST_LOG=... oam watch 2>file). `OAM_LOG` says it for oam alone, before
    // `RUST_LOG`.
    let default = match cli.command {
        oam::cli::Command::Watch(_) => "off",
        _ => "info,async_nats=warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("OAM_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let color = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(color)
        .init();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = cli.worker_threads() {
        builder.worker_threads(n);
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("oam: cannot start the async runtime: {e}");
            return ExitCode::from(oam::error::exit_code(oam::error::Kind::Failed));
        }
    };
    oam::error::exit(runtime.block_on(oam::cli::run(cli)))
}
