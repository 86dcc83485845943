//! JetStream KV buckets: open one, creating it on first use.

use async_nats::jetstream::{self, kv};
use std::time::Duration;

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
