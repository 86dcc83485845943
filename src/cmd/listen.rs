//! `oam listen SUBJECT`: print what arrives on a NATS subject (e.g. `mesh.death.>`).

use crate::error::{Error, Kind, Result};
use futures_util::StreamExt;
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The subject, wildcards allowed (`mesh.death.>`, `oam.v1.decision.*`).
    pub subject: String,
    /// Stop after this many messages.
    #[arg(long)]
    pub count: Option<u64>,
    /// One JSON object per message: {subject, headers, payload}.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArgs,
}

pub async fn run(a: Args) -> Result<()> {
    let nc = a
        .cluster
        .connect(&super::Role::Viewer, "oam-listen")
        .await?;
    let mut sub = nc
        .subscribe(a.subject.clone())
        .await
        .map_err(|e| Error::usage(format!("cannot subscribe to {:?}: {e}", a.subject)))?;
    nc.flush()
        .await
        .map_err(|e| Error::new(Kind::Unreachable, e))?;
    if a.json {
        // Tell scripts the subscription is live before anything is published.
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "listening on {}", a.subject);
    }
    let mut seen = 0u64;
    // One signal listener for the whole run: a signal that lands while a line is written is
    // not lost.
    let terminated = crate::cmd::terminated();
    tokio::pin!(terminated);
    loop {
        let msg = tokio::select! {
            () = &mut terminated => return Ok(()),
            m = sub.next() => match m { Some(m) => m, None => return Ok(()) },
        };
        let mut out = std::io::stdout().lock();
        let text = String::from_utf8_lossy(&msg.payload);
        if a.json {
            let payload: serde_json::Value = serde_json::from_slice(&msg.payload)
                .unwrap_or_else(|_| serde_json::Value::String(text.into_owned()));
            let headers: serde_json::Map<String, serde_json::Value> = msg
                .headers
                .iter()
                .flat_map(|h| h.iter())
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        serde_json::json!(v.first().map(async_nats::HeaderValue::as_str)),
                    )
                })
                .collect();
            writeln!(
                out,
                "{}",
                serde_json::json!({"subject": msg.subject.as_str(), "headers": headers, "payload": payload})
            )?;
        } else {
            writeln!(out, "{}: {text}", msg.subject)?;
        }
        out.flush()?;
        seen += 1;
        if a.count.is_some_and(|n| seen >= n) {
            return Ok(());
        }
    }
}
