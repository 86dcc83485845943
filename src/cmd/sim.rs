//! `oam sim`: serve simulated providers over HTTP until SIGINT/SIGTERM.

use crate::error::{Error, Result};
use crate::sim::model::{self, SimProvider};
use crate::sim::server::{Sim, router};
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Address to listen on; port 0 picks a free one (printed when ready).
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,
    /// Seed for answers and latency jitter: the same seed gives the same answers.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// A provider as NAME=LATENCY_MS+JITTER_MS (repeatable). Default: primary=150+50,
    /// secondary=150+50, local=40+20.
    #[arg(long = "provider", value_name = "NAME=MS+MS")]
    pub providers: Vec<String>,
    /// Print the ready line as one JSON object ({"url", "providers"}) on stdout.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: Args) -> Result<()> {
    let providers: Vec<SimProvider> = if args.providers.is_empty() {
        model::default_providers()
    } else {
        args.providers
            .iter()
            .map(|s| model::parse_provider(s).map_err(Error::usage))
            .collect::<Result<_>>()?
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| {
            Error::usage(format!(
                "cannot listen on {}: {e}. Pick another address with --listen, \
             or --listen 127.0.0.1:0 for any free port",
                args.listen
            ))
        })?;
    let addr = listener.local_addr().map_err(Error::failed)?;
    let url = format!("http://{addr}");
    let names: Vec<&str> = providers.iter().map(|p| p.id.as_str()).collect();
    {
        let mut out = std::io::stdout().lock();
        if args.json {
            let doc = serde_json::json!({"url": url, "providers": names, "seed": args.seed});
            writeln!(out, "{doc}")?;
        } else {
            writeln!(out, "oam sim listening on {url} (seed {})", args.seed)?;
            for p in &providers {
                writeln!(
                    out,
                    "  {:10} {url}/{}/v1  model {}  latency {} ms + 0-{} ms",
                    p.id,
                    p.id,
                    p.model,
                    p.latency_ms,
                    p.jitter_ms.saturating_sub(1)
                )?;
            }
            writeln!(out, "  faults     {url}/sim/faults")?;
        }
        out.flush()?;
    }
    let sim = Arc::new(Sim::new(args.seed, providers));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(listener, router(sim)).with_graceful_shutdown(async {
        let _ = stop_rx.await;
    });
    let server = tokio::spawn(server.into_future());
    crate::cmd::terminated().await;
    tracing::info!("stopping");
    let _ = stop_tx.send(());
    // In-flight requests (a hanging provider among them) get a short grace period, no more.
    let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
    Ok(())
}
