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

/// How long a catalog edit keeps trying while other writers change the catalog first: the
/// catalog is one key (the Open Agent Mesh layout), so agents that start together take turns.
const CATALOG_WITHIN: Duration = Duration::from_secs(30);

/// Change the catalog array by compare-and-swap: `edit` changes the items and says whether it
/// changed anything (nothing changed, nothing is written). A write another writer beat is
/// tried again on the catalog it wrote, after a pause drawn at random from a window that
/// doubles up to 250 ms, until `CATALOG_WITHIN` has passed.
async fn edit_catalog(
    nats: &async_nats::Client,
    edit: impl Fn(&mut Vec<serde_json::Value>) -> bool,
) -> anyhow::Result<()> {
    use std::hash::BuildHasher;
    let store = bucket(nats, subjects::CATALOG_BUCKET, Duration::ZERO).await?;
    let deadline = std::time::Instant::now() + CATALOG_WITHIN;
    let jitter = std::hash::RandomState::new();
    let (mut window_ms, mut tries) = (4u64, 0u64);
    loop {
        tries += 1;
        let current = store.entry(subjects::CATALOG_KEY).await?;
        let mut items: Vec<serde_json::Value> = current
            .as_ref()
            .filter(|e| e.operation == kv::Operation::Put)
            .and_then(|e| serde_json::from_slice(&e.value).ok())
            .unwrap_or_default();
        if !edit(&mut items) {
            return Ok(());
        }
        let value: bytes::Bytes = serde_json::to_vec(&items)?.into();
        let written = match &current {
            Some(e) => store
                .update(subjects::CATALOG_KEY, value, e.revision)
                .await
                .map(drop)
                .map_err(anyhow::Error::from),
            None => store
                .create(subjects::CATALOG_KEY, value)
                .await
                .map(drop)
                .map_err(anyhow::Error::from),
        };
        let Err(e) = written else {
            return Ok(());
        };
        if std::time::Instant::now() >= deadline {
            anyhow::bail!(
                "the catalog kept changing under us: {tries} writes in {} s were each beaten by \
                 another writer (last: {e:#})",
                CATALOG_WITHIN.as_secs()
            );
        }
        let pause = jitter.hash_one(tries) % window_ms + 1;
        tokio::time::sleep(Duration::from_millis(pause)).await;
        window_ms = (window_ms * 2).min(250);
    }
}

/// List `entry` in the catalog (in place of any entry of its name); a catalog that already
/// lists it so is not written, so the replicas after the first cost one read.
async fn list_in_catalog(nats: &async_nats::Client, entry: &CatalogEntry) -> anyhow::Result<()> {
    let listed = serde_json::to_value(entry)?;
    edit_catalog(nats, |items| {
        let mut same = items.iter().filter(|v| v["name"] == entry.name.as_str());
        if same.next() == Some(&listed) && same.next().is_none() {
            return false;
        }
        items.retain(|v| v["name"] != entry.name.as_str());
        items.push(listed.clone());
        true
    })
    .await
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
    // The agent lives again: its next death is announced again.
    unclaim(nats, &agent_tombstone(&entry.name)).await;
    list_in_catalog(nats, entry).await
}

/// Renew the instance lease (called with every heartbeat); failures are retried next time.
pub async fn renew(nats: &async_nats::Client, entry: &CatalogEntry, instance_id: &str) {
    if let Err(e) = put_instance(nats, entry, instance_id).await {
        tracing::debug!("instance lease renewal failed: {e:#}");
    }
}

/// Every instance record.
pub async fn all_instances(nats: &async_nats::Client) -> anyhow::Result<Vec<InstanceRecord>> {
    records(nats, ">").await
}

/// The instance records under the keys that match `pattern`, read 32 at a time. Records whose
/// body claims another instance or agent than their key are left out, with a warning.
async fn records(nats: &async_nats::Client, pattern: &str) -> anyhow::Result<Vec<InstanceRecord>> {
    use futures_util::StreamExt;
    let store = bucket(nats, subjects::INSTANCES_BUCKET, INSTANCE_LEASE).await?;
    let keys = crate::transport::store::keys_matching(&store, pattern).await?;
    let store = &store;
    let read = futures_util::stream::iter(keys)
        .map(|key| async move { (store.get(&key).await, key) })
        .buffer_unordered(32);
    Ok(read
        .filter_map(|(got, key)| async move {
            let rec = serde_json::from_slice::<InstanceRecord>(&got.ok()??).ok()?;
            let believed = believed(&key, rec);
            if believed.is_none() {
                tracing::warn!(
                    key,
                    "an instance record names another instance or agent than its key; ignored"
                );
            }
            believed
        })
        .collect()
        .await)
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

/// Instance records that serve `agent` (its keys, `*.{agent}`; oam writes none under an id
/// alone), asked of the server by key, so the cost grows with the agent's instances, not the
/// mesh's.
pub async fn instances_of(
    nats: &async_nats::Client,
    agent: &str,
) -> anyhow::Result<Vec<InstanceRecord>> {
    // A name from the bus (a heartbeat's subject) is an agent's name, never a pattern.
    if !protocol::valid_agent_name(agent) {
        anyhow::bail!("{agent:?} is not an agent name");
    }
    Ok(records(nats, &format!("*.{agent}"))
        .await?
        .into_iter()
        .filter(|r| r.agents.iter().any(|a| a == agent))
        .collect())
}

/// One instance's records (one per agent it serves, `{id}.{agent}`, merged).
pub async fn instance(nats: &async_nats::Client, instance_id: &str) -> Option<InstanceRecord> {
    // The id comes from a connection's name, which its client chose: a key token, never a
    // pattern.
    if crate::transport::store::token(instance_id) != instance_id {
        return None;
    }
    let mut found = records(nats, &format!("{instance_id}.>"))
        .await
        .ok()?
        .into_iter();
    let mut rec = found.next()?;
    for more in found {
        rec.agents.extend(more.agents);
    }
    Some(rec)
}

/// Claim the right to announce the death of instance `instance_id` of `agent`: true for exactly
/// one caller cluster-wide (tombstones expire after two minutes).
pub async fn claim_tombstone(
    nats: &async_nats::Client,
    instance_id: &str,
    agent: Option<&str>,
) -> bool {
    claim(nats, &record_key(instance_id, agent)).await
}

/// The tombstone of agent `agent` itself (`dead.{agent}`, a key only that agent's user and the
/// monitor may write; instance ids are never `dead`): claimed by whoever announces the agent's
/// death (its last instance leaving, or a monitor), so the death is announced once however many
/// of its instances go together. Its next registration removes it.
pub fn agent_tombstone(agent: &str) -> String {
    format!("dead.{agent}")
}

/// Claim the right to announce that agent `agent` is gone (no instance serves it).
pub async fn claim_agent_death(nats: &async_nats::Client, agent: &str) -> bool {
    claim(nats, &agent_tombstone(agent)).await
}

/// Create tombstone `key`: true for exactly one caller cluster-wide.
async fn claim(nats: &async_nats::Client, key: &str) -> bool {
    match bucket(
        nats,
        subjects::TOMBSTONES_BUCKET,
        crate::transport::store::TOMBSTONE_AGE,
    )
    .await
    {
        Ok(store) => store.create(key, bytes::Bytes::new()).await.is_ok(),
        // Without the bucket we cannot deduplicate; announcing twice beats not announcing.
        Err(_) => true,
    }
}

/// An instance declared dead that is back (after a network blip): its next death must be
/// announced again.
pub async fn clear_tombstone(nats: &async_nats::Client, instance_id: &str, agent: &str) {
    unclaim(nats, &record_key(instance_id, Some(agent))).await;
}

/// Remove tombstone `key`, so what it stood for is announced again when it dies.
async fn unclaim(nats: &async_nats::Client, key: &str) {
    if let Ok(store) = bucket(
        nats,
        subjects::TOMBSTONES_BUCKET,
        crate::transport::store::TOMBSTONE_AGE,
    )
    .await
    {
        let _ = store.purge(key).await;
    }
}

/// Remove `instance_id`'s records: the keys it was recorded under (an agent's user may purge
/// only its own).
pub async fn forget_instance(nats: &async_nats::Client, instance_id: &str, agents: &[String]) {
    if let Ok(store) = bucket(nats, subjects::INSTANCES_BUCKET, INSTANCE_LEASE).await {
        if agents.is_empty() {
            let _ = store.purge(record_key(instance_id, None)).await;
        }
        for agent in agents {
            let _ = store.purge(record_key(instance_id, Some(agent))).await;
        }
    }
}

/// Remove `agents` from the catalog (in one write) and the registry.
pub async fn forget_agents(nats: &async_nats::Client, agents: &[String]) {
    if agents.is_empty() {
        return;
    }
    let gone = |v: &serde_json::Value| agents.iter().any(|a| v["name"] == a.as_str());
    let edited = edit_catalog(nats, |items| {
        let before = items.len();
        items.retain(|v| !gone(v));
        items.len() != before
    })
    .await;
    if let Err(e) = edited {
        tracing::warn!("{} agents left in the catalog: {e:#}", agents.len());
    }
    if let Ok(registry) = bucket(nats, subjects::REGISTRY_BUCKET, Duration::ZERO).await {
        for agent in agents {
            let _ = registry.delete(agent).await;
        }
    }
}

/// Instances of `agent` leaving together (a process's replicas): each claims its tombstone (so
/// no monitor announces its exit again) and removes its record, all at once. Then, if no other
/// instance serves the agent, it is gone; true if the agent's death is this caller's to
/// announce (then it announces, and `forget_agents` after). Records go before others are
/// counted, so of instances leaving together in different processes the last to go finds none
/// left, and the agent's tombstone makes one of them say so. A count that fails is not "none".
pub async fn leave(nats: &async_nats::Client, agent: &str, instance_ids: &[String]) -> bool {
    let agents = [agent.to_string()];
    futures_util::future::join_all(instance_ids.iter().map(|id| async {
        claim_tombstone(nats, id, Some(agent)).await;
        forget_instance(nats, id, &agents).await;
    }))
    .await;
    match instances_of(nats, agent).await {
        Ok(others) if others.iter().all(|r| instance_ids.contains(&r.instance_id)) => {
            claim_agent_death(nats, agent).await
        }
        Ok(_) => false,
        Err(e) => {
            tracing::warn!(agent, "cannot tell whether other instances serve it: {e:#}");
            false
        }
    }
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
