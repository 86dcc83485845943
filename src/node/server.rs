//! The node's HTTP listener, bounded: at most `node.max_connections` open at once, a request's
//! headers within `node.header_timeout_ms` (counted from when the node is ready to read them,
//! so a kept-alive connection idle that long is closed too), the body within `BODY_TIMEOUT`
//! (the chat handler's read), every write taken by the client within `node.write_timeout_ms`
//! (a reader that stalls, or reads a byte a second, holds a slot and an answer's buffers no
//! longer than that at a time; its stream's upstream call then ends), and on
//! stop every connection finishes the request in hand and closes.
//!
//! When every slot is taken, the connection that has waited longest for a request (one that
//! sends its headers a byte at a time, or sits idle between requests) is closed to make room:
//! slow or idle sockets cannot keep callers with a request to make out. Only when every
//! connection has a request in hand do new ones wait in the kernel's queue.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long a client has to send a request's body once its headers are in.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// One open connection, as the eviction sees it.
struct Conn {
    /// When it was opened.
    opened: Instant,
    /// Since when it waits for a request, in ns after `opened` (`BUSY`: a request is in hand).
    waiting_since: AtomicU64,
    /// Requests in hand (their responses not yet written out).
    in_hand: AtomicU64,
    close: CancellationToken,
}

/// `Conn::waiting_since` of a connection with a request in hand.
const BUSY: u64 = u64::MAX;

impl Conn {
    fn begin(&self) {
        self.in_hand.fetch_add(1, Ordering::Relaxed);
        self.waiting_since.store(BUSY, Ordering::Relaxed);
    }

    fn end(&self) {
        if self.in_hand.fetch_sub(1, Ordering::Relaxed) == 1 {
            let ns = u64::try_from(self.opened.elapsed().as_nanos()).unwrap_or(BUSY - 1);
            self.waiting_since.store(ns, Ordering::Relaxed);
        }
    }

    /// Since when it waits for a request, if it does.
    fn waiting(&self) -> Option<Instant> {
        let ns = self.waiting_since.load(Ordering::Relaxed);
        (ns != BUSY).then(|| self.opened + Duration::from_nanos(ns))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The open connections, by a number of their own.
#[derive(Default)]
struct Conns {
    open: Mutex<BTreeMap<u64, Arc<Conn>>>,
    next: AtomicU64,
}

impl Conns {
    fn add(&self) -> (u64, Arc<Conn>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let c = Arc::new(Conn {
            opened: Instant::now(),
            waiting_since: AtomicU64::new(0),
            in_hand: AtomicU64::new(0),
            close: CancellationToken::new(),
        });
        lock(&self.open).insert(id, c.clone());
        (id, c)
    }

    fn remove(&self, id: u64) {
        lock(&self.open).remove(&id);
    }

    /// Close the connection that has waited longest for a request; false if every one has a
    /// request in hand.
    fn evict_longest_waiting(&self) -> bool {
        let open = lock(&self.open);
        let longest = open
            .values()
            .filter(|c| !c.close.is_cancelled())
            .filter_map(|c| c.waiting().map(|since| (since, c)))
            .min_by_key(|(since, _)| *since);
        match longest {
            Some((_, c)) => {
                c.close.cancel();
                true
            }
            None => false,
        }
    }
}

/// A response body that tells its connection when it is written out (or dropped).
struct Tracked {
    body: axum::body::Body,
    conn: Option<Arc<Conn>>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            c.end();
        }
    }
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// A socket whose writes fail once one has waited `limit` for the peer to take it.
struct WriteDeadline<S> {
    inner: S,
    limit: Duration,
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> WriteDeadline<S> {
    /// `poll` the write, timing how long it stays pending.
    fn timed<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        poll: impl FnOnce(
            std::pin::Pin<&mut S>,
            &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::future::Future as _;
        match poll(std::pin::Pin::new(&mut self.inner), cx) {
            std::task::Poll::Ready(r) => {
                self.stalled = None;
                std::task::Poll::Ready(r)
            }
            std::task::Poll::Pending => {
                let limit = self.limit;
                let stalled = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match stalled.as_mut().poll(cx) {
                    std::task::Poll::Ready(()) => std::task::Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the client took nothing for the write timeout",
                    ))),
                    std::task::Poll::Pending => std::task::Poll::Pending,
                }
            }
        }
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.timed(cx, |s, cx| s.poll_write(cx, buf))
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.timed(cx, tokio::io::AsyncWrite::poll_flush)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Serve `app` on `listener` until `stop` is cancelled, then let every open connection finish
/// the request in hand. `saturated` counts the times every connection slot was taken.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    max_connections: usize,
    header_timeout: Duration,
    write_timeout: Duration,
    saturated: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let connections = tokio_util::task::TaskTracker::new();
    let conns = Arc::new(Conns::default());
    loop {
        // A slot first, then a connection: what cannot be served yet waits in the backlog.
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                saturated.fetch_add(1, Ordering::Relaxed);
                // Make room: the connection waiting longest for a request goes.
                conns.evict_longest_waiting();
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
        let (id, conn) = conns.add();
        let service = {
            let inner = hyper_util::service::TowerToHyperService::new(app.clone());
            let conn = conn.clone();
            hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                conn.begin();
                let conn = conn.clone();
                let call = hyper::service::Service::call(&inner, req);
                async move {
                    let resp = call.await?;
                    Ok::<_, std::convert::Infallible>(resp.map(|body| Tracked {
                        body,
                        conn: Some(conn),
                    }))
                }
            })
        };
        let (stop, conns) = (stop.clone(), conns.clone());
        connections.spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout);
            let io = WriteDeadline {
                inner: stream,
                limit: write_timeout,
                stalled: None,
            };
            let conn_io = builder.serve_connection(hyper_util::rt::TokioIo::new(io), service);
            tokio::pin!(conn_io);
            tokio::select! {
                _ = conn_io.as_mut() => {}
                // Evicted while waiting for a request: nothing in hand to finish, so it is
                // closed at once (a socket half way through its headers would hold a graceful
                // shutdown up).
                () = conn.close.cancelled() => {}
                () = stop.cancelled() => {
                    conn_io.as_mut().graceful_shutdown();
                    let _ = conn_io.await;
                }
            }
            conns.remove(id);
            drop(permit);
        });
    }
    connections.close();
    connections.wait().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_waiting_longest_for_a_request_makes_room_never_one_in_use() {
        let conns = Conns::default();
        let (_, oldest) = conns.add();
        let (_, busy) = conns.add();
        let (_, newer) = conns.add();
        // The oldest has a request in hand: it is not the one to go.
        oldest.begin();
        busy.begin();
        assert!(conns.evict_longest_waiting());
        assert!(newer.close.is_cancelled());
        assert!(!oldest.close.is_cancelled() && !busy.close.is_cancelled());
        // Every one left has a request in hand: nothing to close.
        assert!(!conns.evict_longest_waiting());
        // A finished request leaves its connection waiting again, and so evictable.
        busy.end();
        assert!(conns.evict_longest_waiting());
        assert!(busy.close.is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_the_client_does_not_take_fails_after_the_limit() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (ours, mut theirs) = tokio::io::duplex(1024);
        let mut w = WriteDeadline {
            inner: ours,
            limit: Duration::from_secs(30),
            stalled: None,
        };
        // Taken: fine, however long it takes overall.
        w.write_all(&[0; 512]).await.unwrap();
        let mut buf = [0; 512];
        theirs.read_exact(&mut buf).await.unwrap();
        // Not taken: fails once it has waited 30 s (the clock is paused and advances).
        let started = tokio::time::Instant::now();
        let err = w.write_all(&[0; 4096]).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_secs(30));
    }
}
