//! The HTTP client every oam process uses (providers, nodes, the simulator).

use std::time::Duration;

/// An HTTP client for providers and local endpoints. oam's TLS uses ring (as async-nats does),
/// installed here once for the process.
pub fn http_client(timeout: Option<Duration>) -> reqwest::Result<reqwest::Client> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut b = reqwest::Client::builder().pool_max_idle_per_host(64);
    if let Some(t) = timeout {
        b = b.timeout(t);
    }
    b.build()
}
