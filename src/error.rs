//! Errors that reach the user, the outcome of a command that checks something, and the one
//! place exit codes are decided.
//!
//! Exit codes: 0 ok; 1 a checked condition failed (a bench expectation or scenario, an
//! unhealthy mesh, an agent call answered with an error); 2 usage, config or input error; 3
//! NATS or the mesh unreachable; 4 oam could not do what was asked for another reason (a
//! process did not start, a file could not be written, an internal failure); 130 interrupted.
//! A closed stdout (broken pipe) exits 0 quietly.

use std::io;
use std::process::ExitCode;

/// What kind of failure, which decides the exit code. A checked condition that did not hold
/// is not an error: it is a [`Findings`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    /// Bad arguments, configuration or input.
    Usage,
    /// NATS or the mesh could not be reached.
    Unreachable,
    /// The work could not be done (a process did not start, a file could not be written).
    Failed,
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

    /// The work could not be done (exit 4).
    pub fn failed(source: impl Into<anyhow::Error>) -> Self {
        Error::new(Kind::Failed, source)
    }
}

/// Writing the output failed (a broken pipe exits 0 all the same).
impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::new(Kind::Failed, e)
    }
}

/// What a command found: everything held, or the checks that failed (exit 1), each in words.
#[derive(Debug, PartialEq, Eq)]
#[must_use]
pub enum Findings {
    Ok,
    Failed(Vec<String>),
}

impl Findings {
    /// `Ok` when nothing failed.
    pub fn from_failures(failed: Vec<String>) -> Findings {
        if failed.is_empty() {
            Findings::Ok
        } else {
            Findings::Failed(failed)
        }
    }
}

pub fn exit_code(kind: Kind) -> u8 {
    match kind {
        Kind::Usage => 2,
        Kind::Unreachable => 3,
        Kind::Failed => 4,
        Kind::Interrupted => 130,
    }
}

/// The exit code of a command's result, after printing what failed to stderr.
pub fn exit(result: Result<Findings>) -> ExitCode {
    match result {
        Ok(Findings::Ok) => ExitCode::SUCCESS,
        Ok(Findings::Failed(failed)) => {
            for f in &failed {
                eprintln!("oam: {f}");
            }
            ExitCode::from(1)
        }
        Err(e) => report(&e),
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
