//! The HTTP client every oam process uses (providers, nodes, the simulator).

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
