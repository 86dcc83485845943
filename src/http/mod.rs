//! HTTP as every oam process uses it: the client (providers, nodes, the simulator), the lanes
//! a node serves connections on (`lanes`) and the server-sent-events codec (`sse`).

pub mod lanes;
pub mod sse;

use std::time::Duration;

/// An HTTP client for providers and local endpoints. oam's TLS uses ring (as async-nats does),
/// installed here once for the process. It follows no redirect (a provider that answers a
/// POST with one is misconfigured, and its answer is judged as such) and retries nothing by
/// itself (retries are the pipeline's to decide, counted and bounded there).
pub fn http_client(timeout: Option<Duration>) -> reqwest::Result<reqwest::Client> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut b = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .redirect(reqwest::redirect::Policy::none())
        .retry(reqwest::retry::never());
    if let Some(t) = timeout {
        b = b.timeout(t);
    }
    b.build()
}

/// What `Poster::post_json` got back: status, headers and the whole body.
pub(crate) type Posted = (hyper::StatusCode, hyper::HeaderMap, bytes::Bytes);

/// The lean client for the one upstream call on every request's path: a JSON POST whose whole
/// answer is read. hyper's pooled HTTP/1 client (TLS by rustls with the platform's roots, as
/// `http_client`'s), without the layers `reqwest` adds around it (redirect and proxy handling,
/// a URL parsed again per request) that this call never uses: a tenth of the gateway's work
/// per request went there. Like `http_client`'s, it follows no redirect; the one request it
/// sends again by itself is one that never left (its pooled connection closed first).
///
/// Each lane (`lanes`) has a pool of its own: a request on a lane is sent on a connection whose
/// task runs on that lane's thread, not across cores. Off the lanes, one shared pool.
#[derive(Clone)]
pub(crate) struct Poster {
    clients: lanes::PerLane<LeanClient>,
    /// The largest answer read; a longer one is an error (its bytes dropped as they come).
    max_answer_bytes: usize,
}

type LeanClient = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    http_body_util::Full<bytes::Bytes>,
>;

/// The platform's TLS roots could not be read, so no HTTPS client can be made.
#[derive(Debug, thiserror::Error)]
#[error("cannot set up TLS with the platform's roots: {0}")]
pub struct NoTlsRoots(String);

impl Poster {
    /// A client for callers on `lanes` lanes (and off them).
    pub fn new(max_answer_bytes: usize, lanes: usize) -> Result<Poster, NoTlsRoots> {
        use rustls_platform_verifier::ConfigVerifierExt as _;
        let _ = rustls::crypto::ring::default_provider().install_default();
        let tls = rustls::ClientConfig::with_platform_verifier()
            .map_err(|e| NoTlsRoots(e.to_string()))?;
        let mut tcp = hyper_util::client::legacy::connect::HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(tcp);
        let clients = lanes::PerLane::new(lanes, || {
            Ok::<_, NoTlsRoots>(
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .pool_max_idle_per_host(64)
                    .build(connector.clone()),
            )
        })?;
        Ok(Poster {
            clients,
            max_answer_bytes,
        })
    }

    /// The largest answer it reads (streams read elsewhere are held to it too).
    pub fn max_answer_bytes(&self) -> usize {
        self.max_answer_bytes
    }

    /// POST `body` (JSON) to `uri` with `headers` (ready values: the key), and read the
    /// whole answer, up to `max_answer_bytes`. Unbounded in time: the caller bounds it.
    pub async fn post_json(
        &self,
        uri: &hyper::Uri,
        headers: &[(hyper::header::HeaderName, hyper::header::HeaderValue)],
        body: Vec<u8>,
    ) -> Result<Posted, Box<dyn std::error::Error + Send + Sync>> {
        use http_body_util::BodyExt as _;
        let mut req = hyper::Request::post(uri.clone()).header(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        for (name, value) in headers {
            req = req.header(name, value.clone());
        }
        let req = req.body(http_body_util::Full::new(bytes::Bytes::from(body)))?;
        let resp = self.clients.here().request(req).await?;
        let (parts, body) = resp.into_parts();
        let limit = self.max_answer_bytes;
        let bytes = http_body_util::Limited::new(body, limit)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    format!("the answer is larger than node.max_answer_bytes ({limit} bytes)")
                        .into()
                } else {
                    e
                }
            })?
            .to_bytes();
        Ok((parts.status, parts.headers, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that answers every request with the port its caller's connection came from.
    async fn port_echo() -> hyper::Uri {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri = format!("http://{}/", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((stream, peer)) = listener.accept().await {
                let answer = move |_req| async move {
                    let body = bytes::Bytes::from(peer.port().to_string());
                    Ok::<_, std::convert::Infallible>(hyper::Response::new(
                        http_body_util::Full::new(body),
                    ))
                };
                tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(
                    hyper_util::rt::TokioIo::new(stream),
                    hyper::service::service_fn(answer),
                ));
            }
        });
        uri.parse().unwrap()
    }

    /// Each lane opens its own connection: a lane's first request never takes the pool's idle
    /// one from off the lanes (or another lane's), so its connection's task is on its thread.
    #[tokio::test]
    async fn each_lane_sends_on_connections_of_its_own() {
        let uri = port_echo().await;
        let lanes = lanes::Lanes::start(2).unwrap();
        let poster = Poster::new(1 << 10, 2).unwrap();
        let post = |p: Poster, uri: hyper::Uri| async move {
            let (status, _, body) = p.post_json(&uri, &[], b"{}".to_vec()).await.unwrap();
            assert_eq!(status, hyper::StatusCode::OK);
            String::from_utf8(body.to_vec()).unwrap()
        };
        let mut ports = vec![post(poster.clone(), uri.clone()).await];
        for _ in 0..2 {
            let lane = lanes.pick().unwrap();
            let port = lane.spawn(post(poster.clone(), uri.clone()));
            ports.push(port.await.unwrap());
        }
        let distinct: std::collections::HashSet<&String> = ports.iter().collect();
        assert_eq!(distinct.len(), 3, "one connection each: {ports:?}");
    }
}
