//! `oam agent call` and `oam agent stream`: one request to an agent by name.

use crate::error::{Error, Findings, Kind, Result};
use crate::mesh::{client, protocol};
use std::io::{IsTerminal, Read, Write};
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The agent's name (`oam agent list` shows them).
    pub name: String,
    /// The JSON payload, or `-` to read it from standard input (default: {}).
    pub payload: Option<String>,
    /// Seconds to wait for the answer (for a stream: for all of it).
    #[arg(long, default_value_t = 30.0)]
    pub timeout: f64,
}

impl Args {
    /// The payload (validated as JSON) and the timeout, or a usage error.
    fn checked(&self) -> Result<(bytes::Bytes, Duration)> {
        let payload = match self.payload.as_deref() {
            None => "{}".to_string(),
            Some("-") => {
                if std::io::stdin().is_terminal() {
                    return Err(Error::usage(
                        "`-` reads the payload from standard input; pipe JSON into it",
                    ));
                }
                let mut s = String::new();
                std::io::stdin()
                    .read_to_string(&mut s)
                    .map_err(|e| Error::usage(format!("cannot read standard input: {e}")))?;
                s
            }
            Some(p) => p.to_string(),
        };
        if let Err(e) = serde_json::from_str::<serde_json::Value>(&payload) {
            return Err(Error::usage(format!("the payload is not JSON: {e}")));
        }
        let timeout = Duration::try_from_secs_f64(self.timeout)
            .ok()
            .filter(|t| !t.is_zero() && *t <= MAX_TIMEOUT)
            .ok_or_else(|| {
                Error::usage(format!(
                    "--timeout {:?}: use a number of seconds above 0 and at most {}",
                    self.timeout,
                    MAX_TIMEOUT.as_secs()
                ))
            })?;
        Ok((payload.into_bytes().into(), timeout))
    }
}

/// The longest a caller may wait for an agent: a day.
const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);

/// The agent answered with an error (`agent_died`, `timeout`, `not_found`, ...).
fn failed(e: &protocol::MeshError) -> Findings {
    Findings::Failed(vec![format!("{}: {}", e.code.as_str(), e.message)])
}

/// Call agent `c.name`; its error reply is a failed check (exit 1) naming the code.
pub async fn call(cluster: &super::super::ClusterArgs, c: Args) -> Result<Findings> {
    let (payload, timeout) = c.checked()?;
    let nc = cluster
        .connect(&crate::cmd::Role::Caller, "oam-agent-call")
        .await?;
    let caller = client::Caller::new(nc)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))?;
    let body = match caller.call(&c.name, payload, timeout).await {
        Ok(body) => body,
        Err(e) => return Ok(failed(&e)),
    };
    let mut out = std::io::stdout().lock();
    out.write_all(&body)?;
    writeln!(out)?;
    Ok(Findings::Ok)
}

/// Stream from agent `c.name`, a chunk a line; an error (before or mid-stream) is a failed
/// check naming the code.
pub async fn stream(cluster: &super::super::ClusterArgs, c: Args) -> Result<Findings> {
    let (payload, timeout) = c.checked()?;
    let nc = cluster
        .connect(&crate::cmd::Role::Caller, "oam-agent-stream")
        .await?;
    let caller = client::Caller::new(nc)
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))?;
    let mut chunks = match caller.stream(&c.name, payload, timeout).await {
        Ok(chunks) => chunks,
        Err(e) => return Ok(failed(&e)),
    };
    while let Some(chunk) = chunks.next().await {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(e) => return Ok(failed(&e)),
        };
        let mut out = std::io::stdout().lock();
        out.write_all(&chunk)?;
        writeln!(out)?;
        out.flush()?;
    }
    Ok(Findings::Ok)
}
