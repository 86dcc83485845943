//! The mesh's JetStream KV state: the catalog (one `catalog` key holding a JSON array, updated
//! by compare-and-swap as the Python SDK does), the registry (a contract per agent name), and
//! instance records (which instance serves which agents; leases that expire unless renewed).

use super::protocol::{self, CatalogEntry};
use crate::transport::store::{StoreError, StoreResult, bucket};
use crate::transport::subjects;
use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use crate::transport::store::INSTANCE_LEASE;

/// The mesh's buckets, each opened at its first use and kept: every call after is one write
/// on the bucket's subjects or a direct get, never a stream info or a create (a stream whose
/// leader died answers neither until it has a new one, seconds later, and only the admin may
/// create a bucket). Opened again after the connection was lost and made again: the server
/// may be a new one that lost them (then one is made, where the role may).
pub struct Mesh {
    nats: async_nats::Client,
    catalog: Kept,
    registry: Kept,
    instances: Kept,
    tombstones: Kept,
    /// Tombstones this process announced without (its bucket did not answer), not yet
    /// written: claimed again, they are this process's already.
    unsettled: std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
}

/// A bucket as opened, and on which connection (the client's count of connects then).
type Kept = std::sync::Mutex<Option<(u64, kv::Store)>>;

/// How long opening a kept bucket again after a reconnect may hold a call up.
const REOPEN_WITHIN: Duration = Duration::from_millis(250);

impl Mesh {
    pub fn new(nats: async_nats::Client) -> Mesh {
        Mesh {
            nats,
            catalog: Kept::default(),
            registry: Kept::default(),
            instances: Kept::default(),
            tombstones: Kept::default(),
            unsettled: Default::default(),
        }
    }

    pub fn nats(&self) -> &async_nats::Client {
        &self.nats
    }

    /// Bucket `name` as kept in `kept`, opened (`bucket`) if it is not. After a reconnect it
    /// is opened again, and meanwhile (a stream electing a leader answers no open for seconds)
    /// the handle kept goes on: a bucket keeps its name, and its subjects, wherever it is led.
    async fn open(&self, kept: &Kept, name: &str, max_age: Duration) -> StoreResult<kv::Store> {
        let connects = self
            .nats
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed);
        let lock = || {
            kept.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        let held = lock().clone();
        let store = match held {
            Some((at, store)) if at == connects => return Ok(store),
            Some((_, store)) => {
                match tokio::time::timeout(REOPEN_WITHIN, bucket(&self.nats, name, max_age)).await {
                    Ok(Ok(fresh)) => fresh,
                    _ => return Ok(store),
                }
            }
            None => bucket(&self.nats, name, max_age).await?,
        };
        *lock() = Some((connects, store.clone()));
        Ok(store)
    }

    /// Open every bucket now, so that none is first opened when a death must be told fast.
    pub async fn open_all(&self) {
        let _ = tokio::join!(
            self.catalog(),
            self.registry(),
            self.instances(),
            self.tombstones()
        );
    }

    /// Ask the server something it answers on this connection, within `limit`: once answered,
    /// every message it sent this connection before is read and handed to its subscription
    /// (one connection delivers in order). False if no answer came in time.
    pub(crate) async fn round_trip(&self, limit: Duration) -> bool {
        let asked = async {
            let store = self.tombstones().await.ok()?;
            store.get("round-trip").await.ok()
        };
        matches!(tokio::time::timeout(limit, asked).await, Ok(Some(_)))
    }

    async fn catalog(&self) -> StoreResult<kv::Store> {
        self.open(&self.catalog, subjects::CATALOG_BUCKET, Duration::ZERO)
            .await
    }

    async fn registry(&self) -> StoreResult<kv::Store> {
        self.open(&self.registry, subjects::REGISTRY_BUCKET, Duration::ZERO)
            .await
    }

    async fn instances(&self) -> StoreResult<kv::Store> {
        self.open(&self.instances, subjects::INSTANCES_BUCKET, INSTANCE_LEASE)
            .await
    }

    async fn tombstones(&self) -> StoreResult<kv::Store> {
        let age = crate::transport::store::TOMBSTONE_AGE;
        self.open(&self.tombstones, subjects::TOMBSTONES_BUCKET, age)
            .await
    }
}

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
pub(crate) fn rfc3339_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    crate::core::date::rfc3339(secs)
}

/// The catalog's entries (empty if the bucket or key does not exist yet). Entries that do not
/// parse are skipped, not fatal.
pub async fn catalog(mesh: &Mesh) -> StoreResult<Vec<CatalogEntry>> {
    Ok(catalog_checked(mesh).await?.0)
}

/// The catalog, and its items that are not entries (shown as they are, shortened), so a reader
/// can say so. A catalog that is not a JSON array at all is an error, not an empty catalog.
pub(crate) async fn catalog_checked(mesh: &Mesh) -> StoreResult<(Vec<CatalogEntry>, Vec<String>)> {
    let store = mesh.catalog().await?;
    let Some(raw) = store.get(subjects::CATALOG_KEY).await? else {
        return Ok((Vec::new(), Vec::new()));
    };
    let items: Vec<serde_json::Value> = serde_json::from_slice(&raw).map_err(|e| {
        StoreError::Unreadable(format!(
            "the agent catalog (KV {} key {}) is not a JSON array of entries: {e}",
            subjects::CATALOG_BUCKET,
            subjects::CATALOG_KEY
        ))
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
    mesh: &Mesh,
    afresh: bool,
    edit: impl Fn(&mut Vec<serde_json::Value>) -> bool,
) -> StoreResult<()> {
    use std::hash::BuildHasher;
    let store = mesh.catalog().await?;
    let deadline = std::time::Instant::now() + CATALOG_WITHIN;
    let jitter = std::hash::RandomState::new();
    let (mut window_ms, mut tries) = (4u64, 0u64);
    loop {
        tries += 1;
        let current = store.entry(subjects::CATALOG_KEY).await?;
        let put = current
            .as_ref()
            .filter(|e| e.operation == kv::Operation::Put);
        let mut items: Vec<serde_json::Value> = match put.map(|e| serde_json::from_slice(&e.value))
        {
            Some(Ok(items)) => items,
            // Not an array: begun afresh only when asked (registering), else left as it is.
            Some(Err(_)) if !afresh => return Ok(()),
            _ => Vec::new(),
        };
        if !edit(&mut items) {
            return Ok(());
        }
        let value: bytes::Bytes = serde_json::to_vec(&items)?.into();
        let written = match &current {
            Some(e) => store
                .update(subjects::CATALOG_KEY, value, e.revision)
                .await
                .map(drop)
                .map_err(StoreError::from),
            None => store
                .create(subjects::CATALOG_KEY, value)
                .await
                .map(drop)
                .map_err(StoreError::from),
        };
        let Err(e) = written else {
            return Ok(());
        };
        if std::time::Instant::now() >= deadline {
            return Err(StoreError::Contended(format!(
                "the catalog kept changing under us: {tries} writes in {} s were each beaten by \
                 another writer (last: {e})",
                CATALOG_WITHIN.as_secs()
            )));
        }
        let pause = jitter.hash_one(tries) % window_ms + 1;
        tokio::time::sleep(Duration::from_millis(pause)).await;
        window_ms = (window_ms * 2).min(250);
    }
}

/// List `entry` in the catalog again, as a live agent does now and then (`host`'s
/// `RELIST_BEATS`): the catalog is one key any agent may write (the Open Agent Mesh layout), so
/// an entry another agent removed or changed comes back. A catalog that is not a JSON array is
/// left as it is, for `oam agent list` to report (rewriting it would drop every other agent's
/// entry from it without a word).
pub(crate) async fn relist(mesh: &Mesh, entry: &CatalogEntry) -> StoreResult<()> {
    listed(mesh, entry, false).await
}

/// List `entry` in the catalog (in place of any entry of its name); a catalog that already
/// lists it so is not written, so the replicas after the first cost one read.
async fn list_in_catalog(mesh: &Mesh, entry: &CatalogEntry) -> StoreResult<()> {
    listed(mesh, entry, true).await
}

/// `list_in_catalog`; a catalog that is not a JSON array is begun afresh only when `afresh`.
async fn listed(mesh: &Mesh, entry: &CatalogEntry, afresh: bool) -> StoreResult<()> {
    let listed = serde_json::to_value(entry)?;
    edit_catalog(mesh, afresh, |items| {
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

async fn put_instance(mesh: &Mesh, entry: &CatalogEntry, instance_id: &str) -> StoreResult<()> {
    let store = mesh.instances().await?;
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
pub(crate) fn record_key(instance_id: &str, agent: Option<&str>) -> String {
    match agent {
        Some(a) if !a.is_empty() => format!("{instance_id}.{a}"),
        _ => instance_id.to_string(),
    }
}

/// Register an instance of `entry`: instance record, registry contract, catalog entry.
pub async fn register(mesh: &Mesh, entry: &CatalogEntry, instance_id: &str) -> StoreResult<()> {
    put_instance(mesh, entry, instance_id).await?;
    let registry = mesh.registry().await?;
    let contract = protocol::registry_entry(entry, &rfc3339_now());
    registry
        .put(entry.name.as_str(), serde_json::to_vec(&contract)?.into())
        .await?;
    // The agent lives again: its next death is announced again.
    unclaim(mesh, &agent_tombstone(&entry.name)).await;
    list_in_catalog(mesh, entry).await
}

/// Renew the instance lease (called with every heartbeat); failures are retried next time.
pub(crate) async fn renew(mesh: &Mesh, entry: &CatalogEntry, instance_id: &str) {
    if let Err(e) = put_instance(mesh, entry, instance_id).await {
        tracing::debug!("instance lease renewal failed: {e:#}");
    }
}

/// Every instance record.
pub async fn all_instances(mesh: &Mesh) -> StoreResult<Vec<InstanceRecord>> {
    records(mesh, ">").await
}

/// The instance records under the keys that match `pattern`, read 32 at a time. Records whose
/// body claims another instance or agent than their key are left out, with a warning.
async fn records(mesh: &Mesh, pattern: &str) -> StoreResult<Vec<InstanceRecord>> {
    use futures_util::StreamExt;
    let store = mesh.instances().await?;
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
pub(crate) async fn instances_of(mesh: &Mesh, agent: &str) -> StoreResult<Vec<InstanceRecord>> {
    // A name from the bus (a heartbeat's subject) is an agent's name, never a pattern.
    if !protocol::valid_agent_name(agent) {
        return Err(StoreError::Unreadable(format!(
            "{agent:?} is not an agent name"
        )));
    }
    Ok(records(mesh, &format!("*.{agent}"))
        .await?
        .into_iter()
        .filter(|r| r.agents.iter().any(|a| a == agent))
        .collect())
}

/// One instance's records (one per agent it serves, `{id}.{agent}`, merged).
pub async fn instance(mesh: &Mesh, instance_id: &str) -> Option<InstanceRecord> {
    // The id comes from a connection's name, which its client chose: a key token, never a
    // pattern.
    if crate::transport::store::token(instance_id) != instance_id {
        return None;
    }
    let mut found = records(mesh, &format!("{instance_id}.>"))
        .await
        .ok()?
        .into_iter();
    let mut rec = found.next()?;
    for more in found {
        rec.agents.extend(more.agents);
    }
    Some(rec)
}

/// Who is to announce a death, as a claim on its tombstone came out.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Claim {
    /// This claimer: the tombstone names it.
    Mine,
    /// Another claimer, or this one in an earlier claim.
    Theirs,
    /// This claimer, without a tombstone: the bucket did not answer within `CLAIM_WITHIN` (its
    /// leader died, say). The tombstone is written once it answers again.
    Unanswered,
}

impl Claim {
    /// Whether this claimer announces.
    pub fn mine(self) -> bool {
        self != Claim::Theirs
    }
}

/// Claim the right to announce the death of instance `instance_id` of `agent`, as `owner`
/// (whoever claims: a monitor's run, a leaving instance): `Mine` for exactly one claimer
/// cluster-wide while the tombstone bucket answers (tombstones expire after two minutes).
pub(crate) async fn claim_tombstone(
    mesh: &Mesh,
    instance_id: &str,
    agent: Option<&str>,
    owner: &str,
) -> Claim {
    claim(mesh, &record_key(instance_id, agent), owner, true).await
}

/// The tombstone of agent `agent` itself (`dead.{agent}`, a key only that agent's user and the
/// monitor may write; instance ids are never `dead`): claimed by whoever announces the agent's
/// death (its last instance leaving, or a monitor), so the death is announced once however many
/// of its instances go together. Its next registration removes it.
pub(crate) fn agent_tombstone(agent: &str) -> String {
    format!("dead.{agent}")
}

/// Claim the right to announce that agent `agent` is gone (no instance serves it), as `owner`;
/// without asking the bucket unless `ask` (it did not answer a moment ago).
pub(crate) async fn claim_agent_death(mesh: &Mesh, agent: &str, owner: &str, ask: bool) -> Claim {
    claim(mesh, &agent_tombstone(agent), owner, ask).await
}

/// How long a claim may take before the death is announced without one: a tombstone bucket
/// whose leader died takes writes only once a new one is elected (4 to 9 s, nats-server's
/// election timeouts), and a death must be announced within its heartbeat bound. A live
/// bucket answers in a millisecond or two.
pub(crate) const CLAIM_WITHIN: Duration = Duration::from_millis(300);

/// What a try to create a tombstone came to.
#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) enum Try {
    Created,
    /// It was there already.
    Exists,
    /// No answer (a leader elected, an acknowledgement lost): it may or may not have been
    /// written.
    Unanswered,
}

/// Who announces, from a claim's tries (in order) and, when they do not tell, the tombstone as
/// read after them (`None`: not read; `Some(None)`: not there): true for this claimer.
/// - Created: it is ours.
/// - There before the first try: someone announced it (this claimer too, in an earlier claim).
/// - There after an unanswered try: written by that try (its acknowledgement lost) if it holds
///   this claimer's name, else by another.
/// - Never answered and not read as another's: announced without a claim (a death told twice
///   beats one not told), and the tombstone is written later (`settle_later`).
pub(crate) fn claimed(tries: &[Try], read: Option<Option<&[u8]>>, owner: &str) -> bool {
    match tries {
        [Try::Exists, ..] => false,
        _ if tries.contains(&Try::Created) => true,
        _ => match read {
            Some(Some(holder)) => holder == owner.as_bytes(),
            Some(None) | None => true,
        },
    }
}

/// Create tombstone `key` naming `owner`, within `CLAIM_WITHIN` (without trying unless `ask`):
/// who is to announce (`claimed`).
async fn claim(mesh: &Mesh, key: &str, owner: &str, ask: bool) -> Claim {
    let unsettled = |add: bool| {
        let mut keys = mesh
            .unsettled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if add {
            keys.insert(key.to_string())
        } else {
            keys.contains(key)
        }
    };
    if unsettled(false) {
        return Claim::Theirs; // announced by this process already, its tombstone not written yet
    }
    let deadline = tokio::time::Instant::now() + CLAIM_WITHIN;
    let opened = if ask {
        tokio::time::timeout_at(deadline, mesh.tombstones())
            .await
            .ok()
    } else {
        None
    };
    let Some(Ok(store)) = opened else {
        // Without the bucket we cannot deduplicate; announcing twice beats not announcing.
        tracing::warn!(
            key,
            "the tombstone bucket does not answer; announced without a claim"
        );
        unsettled(true);
        if let Ok(Ok(store)) = tokio::time::timeout(REOPEN_WITHIN, mesh.tombstones()).await {
            settle_later(mesh, store, key.to_string(), owner.to_string());
        }
        return Claim::Unanswered;
    };
    let mut tries = Vec::new();
    while tokio::time::Instant::now() < deadline {
        let left = deadline - tokio::time::Instant::now();
        let attempt = store.create(key, bytes::Bytes::copy_from_slice(owner.as_bytes()));
        let outcome = match tokio::time::timeout(left.min(CLAIM_WITHIN / 2), attempt).await {
            Ok(Ok(_)) => Try::Created,
            Ok(Err(e)) if e.kind() == kv::CreateErrorKind::AlreadyExists => Try::Exists,
            Ok(Err(_)) | Err(_) => Try::Unanswered,
        };
        tries.push(outcome);
        if outcome != Try::Unanswered {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let read = if tries.first() != Some(&Try::Exists) && !tries.contains(&Try::Created) {
        // Direct gets are answered by any replica, a leader or not.
        let within = deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .max(Duration::from_millis(100));
        match tokio::time::timeout(within, store.get(key)).await {
            Ok(Ok(v)) => Some(v),
            _ => None,
        }
    } else {
        None
    };
    if !claimed(&tries, read.as_ref().map(|v| v.as_deref()), owner) {
        return Claim::Theirs;
    }
    if tries.contains(&Try::Created) || read.as_ref().is_some_and(Option::is_some) {
        return Claim::Mine;
    }
    tracing::warn!(
        key,
        "the tombstone bucket does not answer; announced without a claim"
    );
    unsettled(true);
    settle_later(mesh, store, key.to_string(), owner.to_string());
    Claim::Unanswered
}

/// Write tombstone `key` naming `owner` once the bucket takes writes again (tried for a
/// tombstone's age at most), so that later claimers find it.
fn settle_later(mesh: &Mesh, store: kv::Store, key: String, owner: String) {
    let unsettled = mesh.unsettled.clone();
    tokio::spawn(async move {
        let until = tokio::time::Instant::now() + crate::transport::store::TOMBSTONE_AGE;
        while tokio::time::Instant::now() < until {
            match store.create(&key, owner.clone().into()).await {
                Ok(_) => break,
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => break,
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
        unsettled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&key);
    });
}

/// An instance declared dead that is back (after a network blip): its next death must be
/// announced again.
pub(crate) async fn clear_tombstone(mesh: &Mesh, instance_id: &str, agent: &str) {
    unclaim(mesh, &record_key(instance_id, Some(agent))).await;
}

/// Remove tombstone `key`, so what it stood for is announced again when it dies.
async fn unclaim(mesh: &Mesh, key: &str) {
    if let Ok(store) = mesh.tombstones().await {
        let _ = store.purge(key).await;
    }
}

/// Remove `instance_id`'s records: the keys it was recorded under (an agent's user may purge
/// only its own).
pub(crate) async fn forget_instance(mesh: &Mesh, instance_id: &str, agents: &[String]) {
    if let Ok(store) = mesh.instances().await {
        if agents.is_empty() {
            let _ = store.purge(record_key(instance_id, None)).await;
        }
        for agent in agents {
            let _ = store.purge(record_key(instance_id, Some(agent))).await;
        }
    }
}

/// Remove `agents` from the catalog (in one write) and the registry.
pub(crate) async fn forget_agents(mesh: &Mesh, agents: &[String]) {
    if agents.is_empty() {
        return;
    }
    let gone = |v: &serde_json::Value| agents.iter().any(|a| v["name"] == a.as_str());
    let edited = edit_catalog(mesh, false, |items| {
        let before = items.len();
        items.retain(|v| !gone(v));
        items.len() != before
    })
    .await;
    if let Err(e) = edited {
        tracing::warn!("{} agents left in the catalog: {e:#}", agents.len());
    }
    if let Ok(registry) = mesh.registry().await {
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
pub async fn leave(mesh: &Mesh, agent: &str, instance_ids: &[String]) -> bool {
    let agents = [agent.to_string()];
    futures_util::future::join_all(instance_ids.iter().map(|id| async {
        claim_tombstone(mesh, id, Some(agent), id).await;
        forget_instance(mesh, id, &agents).await;
    }))
    .await;
    match instances_of(mesh, agent).await {
        Ok(others) if others.iter().all(|r| instance_ids.contains(&r.instance_id)) => {
            claim_agent_death(mesh, agent, &instance_ids.join(","), true)
                .await
                .mine()
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
    use super::{InstanceRecord, Try, believed, claimed};

    #[test]
    fn a_claim_is_settled_by_its_tries_and_then_by_reading() {
        use Try::{Created, Exists, Unanswered};
        let me = "monitor-a";
        assert!(claimed(&[Created], None, me));
        // There before anything was tried: announced before (by anyone, this claimer too).
        assert!(!claimed(&[Exists], Some(Some(b"monitor-a")), me));
        // The first try's acknowledgement was lost, and the second finds the tombstone: the
        // first wrote it if it names this claimer, else another claimer was first.
        assert!(claimed(&[Unanswered, Exists], Some(Some(b"monitor-a")), me));
        assert!(!claimed(
            &[Unanswered, Exists],
            Some(Some(b"monitor-b")),
            me
        ));
        assert!(claimed(&[Unanswered, Created], None, me));
        // Never answered: another's tombstone read from a replica is theirs; none, or none
        // read, is announced without a claim (told twice beats never told).
        assert!(!claimed(
            &[Unanswered, Unanswered],
            Some(Some(b"monitor-b")),
            me
        ));
        assert!(claimed(&[Unanswered, Unanswered], Some(None), me));
        assert!(claimed(&[Unanswered], None, me));
        assert!(claimed(&[], None, me));
    }

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
