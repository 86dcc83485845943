//! JetStream KV buckets: open one, creating it on first use.

use async_nats::jetstream::{self, kv};
use std::time::Duration;

/// How long an agent instance's record lives without renewal.
pub const INSTANCE_LEASE: Duration = Duration::from_secs(15);
/// How long an announced death is remembered (so it is announced once).
pub const TOMBSTONE_AGE: Duration = Duration::from_secs(120);

/// The agent mesh's buckets and how long an entry lives in each (zero: for good).
pub const MESH_BUCKETS: [(&str, Duration); 4] = [
    (crate::transport::subjects::CATALOG_BUCKET, Duration::ZERO),
    (crate::transport::subjects::REGISTRY_BUCKET, Duration::ZERO),
    (crate::transport::subjects::INSTANCES_BUCKET, INSTANCE_LEASE),
    (crate::transport::subjects::TOMBSTONES_BUCKET, TOMBSTONE_AGE),
];

/// Open the KV bucket `name`, creating it (history 1, `max_age`) if it does not exist.
pub async fn bucket(
    nats: &async_nats::Client,
    name: &str,
    max_age: Duration,
) -> anyhow::Result<kv::Store> {
    let js = jetstream::new(nats.clone());
    if let Ok(store) = js.get_key_value(name).await {
        return Ok(store);
    }
    let created = js
        .create_key_value(kv::Config {
            bucket: name.to_string(),
            history: 1,
            max_age,
            ..Default::default()
        })
        .await;
    match created {
        Ok(store) => Ok(store),
        // Another process created it meanwhile.
        Err(e) => js
            .get_key_value(name)
            .await
            .map_err(|_| anyhow::anyhow!("cannot open or create the KV bucket {name}: {e}")),
    }
}
