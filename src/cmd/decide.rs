//! `oam decide`: run the pure pipeline on a recorded input (now, request, state snapshot and the
//! generation results) and print the decision. Same input, same output, byte for byte: this is
//! the replay primitive. The input schema is documented in docs/decide.md.

use crate::core::pipeline::{self, DecideInput};
use crate::error::{Error, Result};
use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The input document (JSON); `-` or nothing reads standard input.
    pub file: Option<PathBuf>,
    /// Print the decision on one line instead of indented.
    #[arg(long)]
    pub compact: bool,
}

pub fn run(args: Args) -> Result<()> {
    let (name, text) = read_input(args.file.as_deref())?;
    let input = parse(&name, &text)?;
    let decision = pipeline::replay(input).map_err(|e| Error::usage(format!("{name}: {e}")))?;
    let mut out = std::io::stdout().lock();
    if args.compact {
        serde_json::to_writer(&mut out, &decision).map_err(Error::failed)?;
    } else {
        serde_json::to_writer_pretty(&mut out, &decision).map_err(Error::failed)?;
    }
    writeln!(out)?;
    Ok(())
}

fn read_input(file: Option<&std::path::Path>) -> Result<(String, String)> {
    match file {
        Some(p) if p.as_os_str() != "-" => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| Error::usage(format!("cannot read {}: {e}", p.display())))?;
            Ok((p.display().to_string(), text))
        }
        _ => {
            let stdin = std::io::stdin();
            if stdin.is_terminal() {
                return Err(Error::usage(
                    "no input: pass a FILE (see examples/decide/) or pipe JSON into `oam decide -`",
                ));
            }
            let mut text = String::new();
            stdin
                .lock()
                .read_to_string(&mut text)
                .map_err(|e| Error::usage(format!("cannot read standard input: {e}")))?;
            Ok(("<stdin>".into(), text))
        }
    }
}

/// Parse with the failing field's path in the message: `request.risk: unknown variant ...`.
pub fn parse(name: &str, text: &str) -> Result<DecideInput> {
    if text.trim().is_empty() {
        return Err(Error::usage(format!(
            "{name} is empty: expected a JSON object with now_ms, request, state and generations \
             (see docs/decide.md and examples/decide/)"
        )));
    }
    let de = &mut serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let at = if path == "." {
            String::new()
        } else {
            format!("{path}: ")
        };
        Error::usage(format!("{name}: {at}{inner}"))
    })
}
