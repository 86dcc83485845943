//! The floor under the node's HTTP hop: oam's transport with none of oam's work. A POST is
//! read whole, sent on to the upstream over a pooled keep-alive connection, and its answer read
//! whole and sent back, on the stack the node serves on: hyper's HTTP/1 server and client on the
//! node's own lanes (`oam::http::lanes`: one single-threaded tokio runtime per core, each
//! accepted connection handed to the next one, each lane with its own upstream pool). No JSON is
//! read, nothing is decided or logged.
//! `scripts/bench-gateway`'s target `floor` runs it beside nginx and the node:
//!
//! ```text
//! cargo build --release --example floor_proxy
//! target/release/examples/floor_proxy 127.0.0.1:8080 http://127.0.0.1:9000 [lanes]
//! ```

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, body::Incoming};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use oam::http::lanes::{Lanes, PerLane};

type Upstream = Client<HttpConnector, Full<Bytes>>;
type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let usage =
        "usage: floor_proxy LISTEN UPSTREAM_URL [LANES (at least 1; default: one per core)]";
    let listen: std::net::SocketAddr = args.next().ok_or(usage)?.parse()?;
    // Request paths are appended to it.
    let upstream: std::sync::Arc<str> = args.next().ok_or(usage)?.trim_end_matches('/').into();
    let n = match args.next() {
        Some(n) => n.parse()?,
        None => std::thread::available_parallelism().map_or(1, usize::from),
    };
    if n == 0 {
        return Err(usage.into());
    }
    // The node's lanes and per-lane pools (`oam::http`), with a plain-HTTP client as the
    // node's `Poster` builds it (no delay, 64 idle connections a host).
    let lanes = Lanes::start(n)?;
    let clients = PerLane::new(n, || {
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        Ok::<Upstream, Error>(
            Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(64)
                .build(tcp),
        )
    })?;
    let listener = std::net::TcpListener::bind(listen)?;
    println!("{}", listener.local_addr()?);
    for conn in listener.incoming() {
        let conn = conn?;
        conn.set_nodelay(true)?;
        conn.set_nonblocking(true)?;
        let (clients, upstream) = (clients.clone(), upstream.clone());
        let lane = lanes.pick().ok_or(usage)?;
        lane.spawn(async move {
            // Registered with the lane's own I/O driver, as the node does.
            let Ok(conn) = tokio::net::TcpStream::from_std(conn) else {
                return;
            };
            let serve = hyper::service::service_fn(move |req| {
                forward(clients.here().clone(), upstream.clone(), req)
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(conn), serve)
                .await;
        });
    }
    Ok(())
}

async fn forward(
    client: Upstream,
    upstream: std::sync::Arc<str>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Error> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    let mut out = Request::post(format!("{upstream}{}", parts.uri.path()));
    if let Some(t) = parts.headers.get(hyper::header::CONTENT_TYPE) {
        out = out.header(hyper::header::CONTENT_TYPE, t);
    }
    let answer = client.request(out.body(Full::new(body))?).await?;
    let (parts, body) = answer.into_parts();
    let body = body.collect().await?.to_bytes();
    let mut back = Response::builder().status(parts.status);
    if let Some(t) = parts.headers.get(hyper::header::CONTENT_TYPE) {
        back = back.header(hyper::header::CONTENT_TYPE, t);
    }
    Ok(back.body(Full::new(body))?)
}
