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
//! slow or idle sockets cannot keep callers with a request to make out. When every connection
//! has a request in hand, a new one is still accepted, on one of `OVERFLOW` spare slots, and
//! served by the `overflow` router: the node's state and metrics stay reachable, and every other
//! request is refused at once (the node's 503 with `Retry-After`) and the connection closed,
//! instead of waiting in the kernel's queue. Only past those spares do callers wait there.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long a client has to send a request's body once its headers are in.
pub(crate) const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Connections accepted past `max_connections`, each for one request (metrics, state, or a
/// refusal), with headers due within `OVERFLOW_HEADER_TIMEOUT`.
pub(crate) const OVERFLOW: usize = 64;
const OVERFLOW_HEADER_TIMEOUT: Duration = Duration::from_secs(1);

/// The listener's bounds.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub write_timeout: Duration,
}

/// How long a connection must have waited for a request before it may be closed to make room.
const EVICTABLE_AFTER: Duration = Duration::from_millis(250);

/// One open connection, as the eviction sees it.
struct Socket {
    /// When it was opened.
    opened: Instant,
    /// Since when it waits for a request, in ns after `opened` (`BUSY`: a request is in hand).
    waiting_since: AtomicU64,
    /// Requests in hand (their responses not yet written out).
    in_hand: AtomicU64,
    close: CancellationToken,
}

/// `Socket::waiting_since` of a connection with a request in hand.
const BUSY: u64 = u64::MAX;

impl Socket {
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
    open: Mutex<BTreeMap<u64, Arc<Socket>>>,
    next: AtomicU64,
}

impl Conns {
    fn add(&self) -> (u64, Arc<Socket>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let c = Arc::new(Socket {
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

    /// Close the connection that has waited longest for a request, once it has waited
    /// `EVICTABLE_AFTER` (one just opened is about to send its request): made room, or when
    /// there will be some to make, or none (every connection has a request in hand).
    fn make_room(&self, now: Instant) -> Room {
        let open = lock(&self.open);
        let longest = open
            .values()
            .filter(|c| !c.close.is_cancelled())
            .filter_map(|c| c.waiting().map(|since| (since, c)))
            .min_by_key(|(since, _)| *since);
        match longest {
            Some((since, c)) if now.duration_since(since) >= EVICTABLE_AFTER => {
                c.close.cancel();
                Room::Made
            }
            Some((since, _)) => Room::At(since + EVICTABLE_AFTER),
            None => Room::None,
        }
    }
}

/// What `Conns::make_room` did.
#[derive(Debug, PartialEq, Eq)]
enum Room {
    /// A waiting connection was closed: its slot is coming.
    Made,
    /// The longest waiting has not waited long enough yet: try again then.
    At(Instant),
    /// Every connection has a request in hand.
    None,
}

/// A response body that tells its connection when it is written out (or dropped).
struct Tracked {
    body: axum::body::Body,
    conn: Option<Arc<Socket>>,
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
/// the request in hand; past `max_connections` (none evictable), serve `overflow` one request
/// per connection. `saturated` counts the times every connection slot was taken. Each
/// connection is served on the next of `lanes` (without lanes, on the caller's runtime); the
/// overflow's on the caller's.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    overflow: axum::Router,
    limits: Limits,
    saturated: Arc<AtomicU64>,
    lanes: Arc<crate::http::lanes::Lanes>,
    stop: CancellationToken,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let spares = Arc::new(tokio::sync::Semaphore::new(OVERFLOW));
    let connections = tokio_util::task::TaskTracker::new();
    let conns = Arc::new(Conns::default());
    loop {
        // A slot first, then a connection: what cannot be served yet waits in the backlog.
        if permits.available_permits() == 0 {
            saturated.fetch_add(1, Ordering::Relaxed);
        }
        let slot = loop {
            if let Ok(p) = permits.clone().try_acquire_owned() {
                break Some(Slot::Main(p));
            }
            // Make room: the connection waiting longest for a request goes; with every one
            // busy, a spare slot answers at once.
            let (retry_at, spare) = match conns.make_room(Instant::now()) {
                Room::Made => (None, false),
                Room::At(t) => (Some(t), false),
                Room::None => (None, true),
            };
            if spare && let Ok(p) = spares.clone().try_acquire_owned() {
                break Some(Slot::Spare(p));
            }
            let retry = async {
                match retry_at {
                    Some(t) => tokio::time::sleep_until(t.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                p = permits.clone().acquire_owned() => break p.ok().map(Slot::Main),
                p = spares.clone().acquire_owned(), if spare => break p.ok().map(Slot::Spare),
                () = retry => {}
                () = stop.cancelled() => break None,
            }
        };
        let Some(slot) = slot else { break };
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
        let permit = match slot {
            Slot::Main(p) => p,
            Slot::Spare(p) => {
                connections.spawn(serve_spare(stream, overflow.clone(), limits, p));
                continue;
            }
        };
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
        let lane = lanes.pick();
        // A socket moves to its lane's own I/O driver: its readiness then wakes that thread.
        let accepted = match lane {
            Some(_) => match stream.into_std() {
                Ok(s) => Accepted::ToLane(s),
                Err(e) => {
                    tracing::warn!("cannot move an HTTP connection to its lane: {e}");
                    conns.remove(id);
                    continue;
                }
            },
            None => Accepted::Here(stream),
        };
        let served = async move {
            let stream = match accepted {
                Accepted::Here(s) => s,
                Accepted::ToLane(s) => match tokio::net::TcpStream::from_std(s) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!("cannot serve an HTTP connection on its lane: {e}");
                        conns.remove(id);
                        return;
                    }
                },
            };
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let io = WriteDeadline {
                inner: stream,
                limit: limits.write_timeout,
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
        };
        match lane {
            Some(lane) => connections.spawn_on(served, lane),
            None => connections.spawn(served),
        };
    }
    connections.close();
    connections.wait().await;
}

/// An accepted connection: on the accepting runtime's I/O driver, or out of it on its way to a
/// lane's (registered there by the lane itself).
enum Accepted {
    Here(tokio::net::TcpStream),
    ToLane(std::net::TcpStream),
}

/// What a new connection is served on.
enum Slot {
    Main(tokio::sync::OwnedSemaphorePermit),
    Spare(tokio::sync::OwnedSemaphorePermit),
}

/// One request on a spare slot, then the connection closes: short deadlines, no keep-alive.
async fn serve_spare(
    stream: tokio::net::TcpStream,
    overflow: axum::Router,
    limits: Limits,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout.min(OVERFLOW_HEADER_TIMEOUT))
        .keep_alive(false);
    let io = WriteDeadline {
        inner: stream,
        limit: limits.write_timeout.min(OVERFLOW_HEADER_TIMEOUT * 5),
        stalled: None,
    };
    let service = hyper_util::service::TowerToHyperService::new(overflow);
    let _ = builder
        .serve_connection(hyper_util::rt::TokioIo::new(io), service)
        .await;
    drop(permit);
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
        let now = Instant::now();
        let Room::At(at) = conns.make_room(now) else {
            panic!("just opened: its request is coming")
        };
        assert!(at > now && at <= Instant::now() + EVICTABLE_AFTER);
        let later = now + EVICTABLE_AFTER;
        assert_eq!(conns.make_room(later), Room::Made);
        assert!(newer.close.is_cancelled());
        assert!(!oldest.close.is_cancelled() && !busy.close.is_cancelled());
        // Every one left has a request in hand: nothing to close.
        assert_eq!(conns.make_room(later), Room::None);
        // A finished request leaves its connection waiting again, and so evictable.
        busy.end();
        assert_eq!(
            conns.make_room(Instant::now() + EVICTABLE_AFTER),
            Room::Made
        );
        assert!(busy.close.is_cancelled());
    }

    /// `app` (and `overflow`) served on 127.0.0.1 with `max_connections`, on two lanes, until
    /// the token is cancelled.
    async fn serving(
        app: axum::Router,
        overflow: axum::Router,
        max_connections: usize,
    ) -> (
        std::net::SocketAddr,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let limits = Limits {
            max_connections,
            header_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
        };
        let server = tokio::spawn(serve(
            listener,
            app,
            overflow,
            limits,
            Arc::default(),
            Arc::new(crate::http::lanes::Lanes::start(2).unwrap()),
            stop.clone(),
        ));
        (addr, stop, server)
    }

    /// Each connection is served on the next lane, all its requests there.
    #[tokio::test]
    async fn connections_are_served_each_on_a_lane_in_turn() {
        use http_body_util::BodyExt as _;
        let on = || async { format!("{:?}", crate::http::lanes::current()) };
        let app = axum::Router::new().route("/lane", axum::routing::get(on));
        let (addr, stop, server) = serving(app, axum::Router::new(), 8).await;
        let mut seen = Vec::new();
        for _ in 0..3 {
            // One connection, two requests on it.
            let io =
                hyper_util::rt::TokioIo::new(tokio::net::TcpStream::connect(addr).await.unwrap());
            let (mut send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
            tokio::spawn(conn);
            for _ in 0..2 {
                let req = hyper::Request::get("/lane")
                    .header(hyper::header::HOST, "x")
                    .body(http_body_util::Empty::<bytes::Bytes>::new())
                    .unwrap();
                let body = send.send_request(req).await.unwrap().into_body();
                let body = body.collect().await.unwrap().to_bytes();
                seen.push(String::from_utf8(body.to_vec()).unwrap());
            }
        }
        let lane = |i: usize| format!("{:?}", Some(i));
        let want = [lane(0), lane(0), lane(1), lane(1), lane(0), lane(0)];
        assert_eq!(seen, want);
        stop.cancel();
        server.await.unwrap();
    }

    /// Past every slot (each with a request in hand), a caller is answered by the overflow
    /// router at once, one request per connection, again and again.
    #[tokio::test]
    async fn past_every_slot_callers_get_the_overflow_answer_at_once() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let app = axum::Router::new().route(
            "/hold",
            axum::routing::post(|body: axum::body::Bytes| async move { body.len().to_string() }),
        );
        let overflow = axum::Router::new().fallback(|body: axum::body::Bytes| async move {
            (
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                format!("full {}", body.len()),
            )
        });
        // The slot's connection on a lane, the overflow's on the test's runtime.
        let (addr, stop, server) = serving(app, overflow, 1).await;
        // The one slot: a request whose body is held back.
        let mut held = tokio::net::TcpStream::connect(addr).await.unwrap();
        held.write_all(b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        for i in 0..5 {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            let body = format!("{{\"n\": {i}}}");
            let req = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            c.write_all(req.as_bytes()).await.unwrap();
            let mut answer = String::new();
            let read = tokio::time::timeout(Duration::from_secs(2), c.read_to_string(&mut answer));
            read.await.expect("answered at once").expect("read");
            assert!(answer.starts_with("HTTP/1.1 503"), "{i}: {answer}");
            assert!(
                answer.ends_with(&format!("full {}", body.len())),
                "{i}: {answer}"
            );
        }
        held.write_all(b"123456789").await.unwrap();
        let mut answer = [0u8; 256];
        let n = held.read(&mut answer).await.unwrap();
        assert!(String::from_utf8_lossy(&answer[..n]).ends_with("10"));
        stop.cancel();
        drop(held);
        server.await.unwrap();
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
