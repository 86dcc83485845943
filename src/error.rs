//! Errors that reach the user, and the one place exit codes are decided.
//!
//! Exit codes: 0 ok, 1 a checked condition failed, 2 usage, config or input error, 3 NATS or the
//! mesh unreachable, 130 interrupted. A closed stdout (broken pipe) exits 0 quietly.

use std::io;
use std::process::ExitCode;

/// What kind of failure, which decides the exit code.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    /// A checked condition did not hold (bench expectation, unhealthy verdict).
    Check,
    /// Bad arguments, configuration or input.
    Usage,
    /// NATS or the mesh could not be reached.
    Unreachable,
    Interrupted,
}

/// An error with its exit kind and its whole cause chain.
#[derive(Debug)]
pub struct Error {
    pub kind: Kind,
    pub source: anyhow::Error,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: Kind, source: impl Into<anyhow::Error>) -> Self {
        Error {
            kind,
            source: source.into(),
        }
    }

    pub fn usage(msg: impl std::fmt::Display) -> Self {
        Error::new(Kind::Usage, anyhow::anyhow!("{msg}"))
    }
}

/// Anything not classified otherwise is treated as a failed check (exit 1).
impl From<anyhow::Error> for Error {
    fn from(source: anyhow::Error) -> Self {
        Error {
            kind: Kind::Check,
            source,
        }
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::new(Kind::Check, e)
    }
}

pub fn exit_code(kind: Kind) -> u8 {
    match kind {
        Kind::Check => 1,
        Kind::Usage => 2,
        Kind::Unreachable => 3,
        Kind::Interrupted => 130,
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        let io = c.downcast_ref::<io::Error>().map(io::Error::kind);
        let json = c
            .downcast_ref::<serde_json::Error>()
            .and_then(serde_json::Error::io_error_kind);
        io.or(json) == Some(io::ErrorKind::BrokenPipe)
    })
}

/// Print `oam: <cause: cause: ...>` on one line to stderr and return the exit code.
pub fn report(e: &Error) -> ExitCode {
    if is_broken_pipe(&e.source) {
        return ExitCode::SUCCESS;
    }
    let chain: Vec<String> = e.source.chain().map(ToString::to_string).collect();
    eprintln!("oam: {}", chain.join(": "));
    ExitCode::from(exit_code(e.kind))
}
