//! The node's HTTP listener, bounded: at most `node.max_connections` open at once (beyond that
//! it accepts no more until one closes: new clients wait in the kernel's queue instead of taking
//! the node's last file descriptors), a request's headers within `node.header_timeout_ms`
//! (counted from when the node is ready to read them, so a kept-alive connection idle that long
//! is closed too), the body within `BODY_TIMEOUT` (the chat handler's read), and on stop every
//! connection finishes the request in hand and closes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long a client has to send a request's body once its headers are in.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Serve `app` on `listener` until `stop` is cancelled, then let every open connection finish
/// the request in hand. `saturated` counts the times every connection slot was taken.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    max_connections: usize,
    header_timeout: Duration,
    saturated: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        // A slot first, then a connection: what cannot be served yet waits in the backlog.
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                saturated.fetch_add(1, Ordering::Relaxed);
                tokio::select! {
                    p = permits.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break,
                    },
                    () = stop.cancelled() => break,
                }
            }
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: wait a little rather than spin.
                    tracing::warn!("cannot accept an HTTP connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = stop.cancelled() => break,
        };
        // A streamed answer is many small writes: without this, each waits for the caller's
        // (delayed) ACK of the one before, ~40 ms per event.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let stop = stop.clone();
        connections.spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                () = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(permit);
        });
    }
    connections.close();
    connections.wait().await;
}
