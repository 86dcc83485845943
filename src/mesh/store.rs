//! The mesh's JetStream KV state: the catalog (one `catalog` key holding a JSON array, updated
//! by compare-and-swap as the Python SDK does), the registry (a contract per agent name), and
//! instance records (which instance serves which agents; leases that expire unless renewed).

use super::protocol::{self, CatalogEntry};
use crate::transport::store::bucket;
use crate::transport::subjects;
use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use crate::transport::store::INSTANCE_LEASE;

#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct InstanceRecord {
    pub instance_id: String,
    pub agents: Vec<String>,
    pub connection: String,
    pub renewed_at_ms: u64,
    /// The serving process and its machine, so local tools (chaos) can find it.
    #[serde(default)]
    pub pid: Option<u32>,
    #[serde(default)]
    pub host: Option<String>,
}

/// This machine's host name (empty if unknown).
pub fn hostname() -> &'static str {
    static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default()
    })
}

/// RFC 3339 UTC timestamp, seconds precision, without a date library.
pub fn rfc3339_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    crate::core::date::rfc3339(secs)
}

/// The catalog's entries (empty if the bucket or key does not exist yet). Entries that do not
/// parse are skipped, not fatal.
pub async fn catalog(nats: &async_nats::Client) -> anyhow::Result<Vec<CatalogEntry>> {
    Ok(catalog_checked(nats).await?.0)
}

/// The catalog, and its items that are not entries (shown as they are, shortened), so a reader
/// can say so. A catalog that is not a JSON array at all is an error, not an empty catalog.
pub async fn catalog_checked(
    nats: &async_nats::Client,
) -> anyhow::Result<(Vec<CatalogEntry>, Vec<String>)> {
    let store = bucket(nats, subjects::CATALOG_BUCKET, Duration::ZERO).await?;
    let Some(raw) = store.get(subjects::CATALOG_KEY).await? else {
        return Ok((Vec::new(), Vec::new()));
    };
    let items: Vec<serde_json::Value> = serde_json::from_slice(&raw).map_err(|e| {
        anyhow::anyhow!(
            "the agent catalog (KV {} key {}) is not a JSON array of entries: {e}",
            subjects::CATALOG_BUCKET,
            subjects::CATALOG_KEY
        )
    })?;
    let mut entries = Vec::with_capacity(items.len());
    let mut unreadable = Vec::new();
    for v in items {
        match serde_json::from_value::<CatalogEntry>(v.clone()) {
            Ok(e) => entries.push(e),
            Err(_) => unreadable.push(v.to_string().chars().take(80).collect()),
        }
    }
    Ok((entries, unreadable))
}

/// Add or remove `entry` in the catalog array by compare-and-swap (10 tries).
async fn update_catalog(
    nats: &async_nats::Client,
    entry: &CatalogEntry,
    add: bool,
) -> anyhow::Result<()> {
    let store = bucket(nats, subjects::CATALOG_BUCKET, Duration::ZERO).await?;
    for _ in 0..10 {
        let current = store.entry(subjects::CATALOG_KEY).await?;
        let mut items: Vec<serde_json::Value> = current
            .as_ref()
            .filter(|e| e.operation == kv::Operation::Put)
            .and_then(|e| serde_json::from_slice(&e.value).ok())
            .unwrap_or_default();
        items.retain(|v| v["name"] != entry.name.as_str());
        if add {
            items.push(serde_json::to_value(entry)?);
        }
        let value: bytes::Bytes = serde_json::to_vec(&items)?.into();
        let written = match &current {
            Some(e) => store
                .update(subjects::CATALOG_KEY, value, e.revision)
                .await
                .is_ok(),
            None => store.create(subjects::CATALOG_KEY, value).await.is_ok(),
        };
        if written {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!("the catalog kept changing under us; could not update it in 10 tries")
}

async fn put_instance(
    nats: &async_nats::Client,
    entry: &CatalogEntry,
    instance_id: &str,
) -> anyhow::Result<()> {
    let store = bucket(nats, subjects::INSTANCES_BUCKET, INSTANCE_LEASE).await?;
    let rec = InstanceRecord {
        instance_id: instance_id.to_string(),
        agents: vec![entry.name.clone()],
        connection: subjects::host_connection(instance_id),
        renewed_at_ms: crate::clock::now_ms(),
        pid: Some(std::process::id()),
        host: Some(hostname().to_string()),
    };
    store
        .put(
            record_key(instance_id, Some(&entry.name)),
            serde_json::to_vec(&rec)?.into(),
        )
        .await?;
    Ok(())
}

/// The key of an instance's record or tombstone: `{instance_id}.{agent}`, so that an agent's
/// NATS user may write its own instances' keys only (`*.{agent}`); just the id when the agent
/// is not known (only the monitor writes those).
pub fn record_key(instance_id: &str, agent: Option<&str>) -> String {
    match agent {
        Some(a) if !a.is_empty() => format!("{instance_id}.{a}"),
        _ => instance_id.to_string(),
    }
}

/// Register an instance of `entry`: instance record, registry contract, catalog entry.
pub async fn register(
    nats: &async_nats::Client,
    entry: &CatalogEntry,
    instance_id: &str,
) -> anyhow::Result<()> {
    put_instance(nats, entry, instance_id).await?;
    let registry = bucket(nats, subjects::REGISTRY_BUCKET, Duration::ZERO).await?;
    let contract = protocol::registry_entry(entry, &rfc3339_now());
    registry
        .put(entry.name.as_str(), serde_json::to_vec(&contract)?.into())
        .await?;
    update_catalog(nats, entry, true).await
}

/// Renew the instance lease (called with every heartbeat); failures are retried next time.
pub async fn renew(nats: &async_nats::Client, entry: &CatalogEntry, instance_id: &str) {
    if let Err(e) = put_instance(nats, entry, instance_id).await {
        tracing::debug!("instance lease renewal failed: {e:#}");
    }
}

/// Every instance record.
pub async fn all_instances(nats: &async_nats::Client) -> anyhow::Result<Vec<InstanceRecord>> {
    let store = bucket(nats, subjects::INSTANCES_BUCKET, INSTANCE_LEASE).await?;
    let mut out = Vec::new();
    for key in crate::transport::store::keys(&store).await? {
        if let Ok(Some(raw)) = store.get(&key).await
            && let Ok(rec) = serde_json::from_slice::<InstanceRecord>(&raw)
        {
            match believed(&key, rec) {
                Some(rec) => out.push(rec),
                None => tracing::warn!(
                    key,
                    "an instance record names another instance or agent than its key; ignored"
                ),
            }
        }
    }
    Ok(out)
}

/// An instance record as its key says, or `None` if its body claims anything else. The key
/// (`{instance_id}.{agent}`) is what the server lets only that agent's user write; the body is
/// whatever the writer put there, so an agent cannot claim another's instance or name.
fn believed(key: &str, rec: InstanceRecord) -> Option<InstanceRecord> {
    let (id, agent) = key.split_once('.').unwrap_or((key, ""));
    let agents_match = if agent.is_empty() {
        true // written under its id alone: only the monitor and the admin may
    } else {
        rec.agents.len() == 1 && rec.agents[0] == agent
    };
    (rec.instance_id == id && agents_match).then_some(rec)
}

/// Instance records that serve `agent`.
pub async fn instances_of(
    nats: &async_nats::Client,
    agent: &str,
) -> anyhow::Result<Vec<InstanceRecord>> {
    Ok(all_instances(nats)
        .await?
        .into_iter()
        .filter(|r| r.agents.iter().any(|a| a == agent))
        .collect())
}

/// One instance record.
pub async fn instance(nats: &async_nats::Client, instance_id: &str) -> Option<InstanceRecord> {
    all_instances(nats)
        .await
        .ok()?
        .into_iter()
        .find(|r| r.instance_id == instance_id)
}

/// Claim the right to announce the death of instance `instance_id` of `agent`: true for exactly
/// one caller cluster-wide (tombstones expire after two minutes).
pub async fn claim_tombstone(
    nats: &async_nats::Client,
    instance_id: &str,
    agent: Option<&str>,
) -> bool {
    match bucket(
        nats,
        subjects::TOMBSTONES_BUCKET,
        crate::transport::store::TOMBSTONE_AGE,
    )
    .await
    {
        Ok(store) => store
            .create(record_key(instance_id, agent), bytes::Bytes::new())
            .await
            .is_ok(),
        // Without the bucket we cannot deduplicate; announcing twice beats not announcing.
        Err(_) => true,
    }
}

/// An instance declared dead that is back (after a network blip): its next death must be
/// announced again.
pub async fn clear_tombstone(nats: &async_nats::Client, instance_id: &str, agent: &str) {
    if let Ok(store) = bucket(
        nats,
        subjects::TOMBSTONES_BUCKET,
        crate::transport::store::TOMBSTONE_AGE,
    )
    .await
    {
        let _ = store.purge(record_key(instance_id, Some(agent))).await;
    }
}

/// Remove a dead instance's record, and each of its agents that no other instance serves from
/// the catalog and the registry.
/// Remove `instance_id`'s record, then the catalog entry and contract of each agent in `dead`
/// (the agents no other instance serves).
pub async fn forget_instance(
    nats: &async_nats::Client,
    instance_id: &str,
    agents: &[String],
    dead: &[String],
) {
    if let Ok(store) = bucket(nats, subjects::INSTANCES_BUCKET, INSTANCE_LEASE).await {
        // The keys it was recorded under (an agent's user may purge only its own).
        if agents.is_empty() {
            let _ = store.purge(record_key(instance_id, None)).await;
        }
        for agent in agents {
            let _ = store.purge(record_key(instance_id, Some(agent))).await;
        }
    }
    for agent in dead {
        forget_agent(nats, agent).await;
    }
}

/// Remove `agent` from the catalog and the registry.
pub async fn forget_agent(nats: &async_nats::Client, agent: &str) {
    let entry = CatalogEntry {
        name: agent.to_string(),
        description: String::new(),
        version: String::new(),
        tags: Vec::new(),
        invocable: true,
        streaming: false,
        max_handling_ms: None,
    };
    let _ = update_catalog(nats, &entry, false).await;
    if let Ok(registry) = bucket(nats, subjects::REGISTRY_BUCKET, Duration::ZERO).await {
        let _ = registry.delete(agent).await;
    }
}

/// A graceful exit: claim the tombstone (so monitors do not announce this exit again), remove the
/// record, and the agent too if this was its last instance. Returns whether it was the last.
pub async fn deregister(
    nats: &async_nats::Client,
    entry: &CatalogEntry,
    instance_id: &str,
) -> bool {
    claim_tombstone(nats, instance_id, Some(&entry.name)).await;
    let others = instances_of(nats, &entry.name).await.unwrap_or_default();
    let last = !others.iter().any(|r| r.instance_id != instance_id);
    let dead = if last {
        vec![entry.name.clone()]
    } else {
        Vec::new()
    };
    forget_instance(nats, instance_id, std::slice::from_ref(&entry.name), &dead).await;
    last
}

#[cfg(test)]
mod tests {
    use super::{InstanceRecord, believed};

    fn record(id: &str, agents: &[&str]) -> InstanceRecord {
        InstanceRecord {
            instance_id: id.into(),
            agents: agents.iter().map(ToString::to_string).collect(),
            connection: String::new(),
            renewed_at_ms: 0,
            pid: None,
            host: None,
        }
    }

    #[test]
    fn an_instance_record_is_believed_only_as_its_key_says() {
        assert!(believed("ab12.demo.echo", record("ab12", &["demo.echo"])).is_some());
        assert!(believed("ab12", record("ab12", &["x", "y"])).is_some());
        // Under the attacker's own key, naming the victim's agent or instance.
        assert!(believed("ab12.evil", record("ab12", &["demo.victim"])).is_none());
        assert!(believed("ab12.evil", record("cd34", &["evil"])).is_none());
        assert!(believed("ab12.evil", record("ab12", &["evil", "demo.victim"])).is_none());
    }
}
