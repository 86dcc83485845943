//! Connecting to NATS the way every oam process does: named connection, fast reconnects,
//! retry when the server is not up yet, and events logged instead of swallowed.

use std::time::Duration;

/// The environment variable holding the NATS URL (credentials may be in it:
/// `nats://user:password@127.0.0.1:4222`), or a comma-separated list of a cluster's servers.
pub(crate) const ENV_URL: &str = "OAM_NATS_URL";

/// Told when the server refuses a connection's credentials (say, the mesh was started again
/// with new ones): retrying cannot help. Whoever made the connection decides what to do: a
/// command stops and exits as unreachable; a library user's process goes on. The first
/// reason is kept and logged once.
#[derive(Clone, Default)]
pub struct Refusal(std::sync::Arc<RefusedInner>);

#[derive(Default)]
struct RefusedInner {
    reason: std::sync::OnceLock<String>,
    told: tokio::sync::Notify,
}

impl Refusal {
    /// Why a connection's credentials were refused, if they were.
    pub fn reason(&self) -> Option<&str> {
        self.0.reason.get().map(String::as_str)
    }

    fn refuse(&self, reason: String) {
        if self.0.reason.set(reason.clone()).is_ok() {
            tracing::error!("{reason}");
            self.0.told.notify_waiters();
        }
    }

    /// Resolves once a connection's credentials are refused.
    pub async fn wait(&self) {
        let told = self.0.told.notified();
        tokio::pin!(told);
        told.as_mut().enable();
        if self.reason().is_some() {
            return;
        }
        told.await;
    }
}

/// Connect for a command, or say what to do: the one place that message is written. With
/// `wait_for_server`, a server that is not up yet is retried in the background.
pub async fn reach(
    url: &str,
    name: &str,
    wait_for_server: bool,
    refused: &Refusal,
) -> Result<async_nats::Client, ReachError> {
    reach_from(url, None, name, wait_for_server, refused).await
}

/// Why a command could not connect, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ReachError {
    /// The URL does not read.
    #[error("{list}{from}")]
    BadUrl { list: BadServerList, from: String },
    /// No server answered.
    #[error(
        "cannot reach {at}{from} ({why}). Start a local mesh with `oam mesh up`, or pass \
         --nats-url (and --creds for a mesh behind JWT auth)"
    )]
    Unreachable {
        at: String,
        from: String,
        why: String,
    },
}

/// `reach`, saying where the URL came from (`--nats-url`, `$OAM_NATS_URL`, a mesh folder) when
/// it cannot be reached.
pub(crate) async fn reach_from(
    url: &str,
    from: Option<&str>,
    name: &str,
    wait_for_server: bool,
    refused: &Refusal,
) -> Result<async_nats::Client, ReachError> {
    let from = from.map(|f| format!(", from {f}")).unwrap_or_default();
    let tried = match servers(url) {
        Ok((addrs, _)) => addrs.len(),
        Err(list) => return Err(ReachError::BadUrl { list, from }),
    };
    connect(url, name, wait_for_server, refused)
        .await
        .map_err(|e| ReachError::Unreachable {
            at: match tried {
                1 => format!("NATS at {}", redact(url)),
                n => format!("any of the {n} NATS servers tried ({})", redact(url)),
            },
            from,
            why: e.to_string(),
        })
}

/// A user name and its password.
pub(crate) type UserPassword = (String, String);

/// A server list that does not read: which entry, and why.
#[derive(Debug, thiserror::Error)]
#[error("{at} {why}")]
pub struct BadServerList {
    /// `the NATS URL "…"`, or `server 2 of 3 ("…")`.
    pub at: String,
    pub why: String,
}

/// A server list (`nats://a:4222,nats://b:4222`; one server is a list of one) as the
/// addresses to connect to and the credentials any entry carries, or which entry is wrong.
pub fn servers(
    url: &str,
) -> Result<(Vec<async_nats::ServerAddr>, Option<UserPassword>), BadServerList> {
    let mut addrs = Vec::new();
    let mut auth: Option<UserPassword> = None;
    let entries: Vec<&str> = url.split(',').map(str::trim).collect();
    for (i, entry) in entries.iter().enumerate() {
        let at = match entries.len() {
            1 => format!("the NATS URL {:?}", redact(entry)),
            n => format!("server {} of {n} ({:?})", i + 1, redact(entry)),
        };
        if entry.is_empty() {
            return Err(BadServerList {
                at,
                why: "is empty; give URLs separated by commas, as \
                      nats://127.0.0.1:4222,nats://127.0.0.1:4223"
                    .into(),
            });
        }
        let (bare, creds) = split_one(entry);
        if let Some(c) = creds {
            match &auth {
                Some(first) if *first != c => {
                    return Err(BadServerList {
                        at,
                        why: "names another user or password than the server before it; one \
                              connection has one user, so give it once (or the same in every \
                              entry)"
                            .into(),
                    });
                }
                _ => auth = Some(c),
            }
        }
        let addr = bare
            .parse::<async_nats::ServerAddr>()
            .map_err(|e| BadServerList {
                at: at.clone(),
                why: format!("is not a NATS server address: {e}"),
            })?;
        addrs.push(addr);
    }
    Ok((addrs, auth))
}

/// The NATS credentials file (user JWT and NKey seed) every connection of this process uses,
/// read once from `--creds` / `$OAM_NATS_CREDS`.
static CREDENTIALS_FILE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Why a NATS credentials file cannot be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CredsFileError {
    #[error("--creds {}: cannot read it ({source})", path.display())]
    Unread {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(
        "--creds {}: not a NATS credentials file (it holds a user JWT and an NKey seed, as \
         `nsc generate creds` writes them)",
        path.display()
    )]
    NotCredentials { path: std::path::PathBuf },
    #[error("--creds {}: {why}", path.display())]
    Damaged {
        path: std::path::PathBuf,
        why: String,
    },
}

/// Use the NATS credentials file at `path` for every connection from now on; the error says
/// what is wrong with the file.
pub(crate) fn use_credentials_file(path: &std::path::Path) -> Result<(), CredsFileError> {
    let path_buf = || path.to_path_buf();
    let text = std::fs::read_to_string(path).map_err(|source| CredsFileError::Unread {
        path: path_buf(),
        source,
    })?;
    if !text.contains("BEGIN NATS USER JWT") || !text.contains("NKEY SEED") {
        return Err(CredsFileError::NotCredentials { path: path_buf() });
    }
    // Parsed now, so a damaged file is refused here rather than at every connection.
    async_nats::ConnectOptions::with_credentials(&text).map_err(|e| CredsFileError::Damaged {
        path: path_buf(),
        why: e.to_string(),
    })?;
    let _ = CREDENTIALS_FILE.set(text);
    Ok(())
}

/// The environment variable naming the CA (a PEM file) that signed the servers' TLS
/// certificates: every connection then speaks TLS and checks the server against it.
pub(crate) const ENV_CA: &str = "OAM_NATS_CA";

/// The CA every connection of this process checks servers against, once one is known (a mesh
/// folder's credentials file names it).
static CA_FILE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// Check every server this process connects to from now on against the CA at `path` (the
/// first one given is kept).
pub(crate) fn use_ca_file(path: &std::path::Path) {
    let _ = CA_FILE.set(path.to_path_buf());
}

/// The CA servers are checked against: `$OAM_NATS_CA`, else the one a mesh folder named
/// (`use_ca_file`).
fn ca_file() -> Option<std::path::PathBuf> {
    std::env::var_os(ENV_CA)
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| CA_FILE.get().cloned())
}

/// Flush what `nats` has buffered, waiting at most `limit`, and not at all when the bus is gone:
/// a process that is stopping (or handling an event) never waits on a server that is not there.
pub(crate) async fn flush_within(nats: &async_nats::Client, limit: Duration) {
    if nats.connection_state() == async_nats::connection::State::Connected {
        let _ = tokio::time::timeout(limit, nats.flush()).await;
    }
}

/// Resolves once `nats` has lost its server and is connected again, since the call (its state
/// looked at every `every`): for what a reconnect leaves stale, such as a consumer on a server
/// that restarted and lost it.
pub async fn reconnected(nats: &async_nats::Client, every: Duration) {
    use async_nats::connection::State;
    let mut lost = false;
    loop {
        tokio::time::sleep(every).await;
        match nats.connection_state() {
            State::Connected if lost => return,
            State::Connected => {}
            _ => lost = true,
        }
    }
}

/// Connect as `name`. With `wait_for_server`, a server that is not up yet is retried in the
/// background and this returns at once; otherwise an unreachable server is an error. A
/// refusal of the credentials is told to `refused`.
pub async fn connect(
    url: &str,
    name: &str,
    wait_for_server: bool,
    refused: &Refusal,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    let refused = refused.clone();
    let conn_name = name.to_string();
    let shown = redact(url);
    // async-nats ignores credentials embedded in the URL, so take them out and pass them on.
    let (addrs, auth) = servers(url).map_err(|why| {
        async_nats::ConnectError::with_source(async_nats::ConnectErrorKind::ServerParse, why)
    })?;
    // Where this connection's replies arrive: a server that refuses it that subscription can
    // answer none of its requests.
    let mut inbox = super::subjects::DEFAULT_INBOX.to_string();
    let base = match (auth, CREDENTIALS_FILE.get()) {
        (Some((user, pass)), _) => {
            // A role of oam's reads its replies in an inbox only it may subscribe to.
            let private = super::subjects::private_inbox(&user);
            let o = async_nats::ConnectOptions::with_user_and_password(user, pass);
            match private {
                Some(prefix) => {
                    inbox.clone_from(&prefix);
                    o.custom_inbox_prefix(prefix)
                }
                None => o,
            }
        }
        (None, Some(creds)) => async_nats::ConnectOptions::with_credentials(creds)?,
        (None, None) => async_nats::ConnectOptions::new(),
    };
    let mut opts = base
        .name(name)
        .connection_timeout(Duration::from_secs(2))
        .ping_interval(ping_interval(name))
        .max_reconnects(None)
        // Callers bound their own requests; the client's 10 s default would cut them short.
        .request_timeout(None)
        .reconnect_delay_callback(reconnect_delay)
        .reconnect_to_server_callback({
            let outage = std::sync::Arc::new(std::sync::Mutex::new(Outage::default()));
            move |pool, last| {
                let pick = std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), 0u8);
                let next = outage
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .next_server(&pool, &last, pick);
                std::future::ready(next)
            }
        })
        .event_callback(move |event| {
            let (conn_name, shown) = (conn_name.clone(), shown.clone());
            let (refused, inbox) = (refused.clone(), inbox.clone());
            async move {
                match event {
                    async_nats::Event::Connected => {
                        tracing::debug!(conn = %conn_name, "NATS connected");
                    }
                    async_nats::Event::Disconnected => {
                        tracing::warn!(conn = %conn_name, "NATS disconnected; reconnecting");
                    }
                    async_nats::Event::Closed => tracing::debug!(conn = %conn_name, "NATS closed"),
                    async_nats::Event::ClientError(e) if says_refused(&e.to_string()) => {
                        refused.refuse(credentials_refused(&conn_name, &shown));
                    }
                    async_nats::Event::ServerError(e) if says_refused(&e.to_string()) => {
                        refused.refuse(credentials_refused(&conn_name, &shown));
                    }
                    async_nats::Event::ServerError(e) if inbox_refused(&e.to_string(), &inbox) => {
                        refused.refuse(format!(
                            "NATS at {shown} does not let {conn_name} receive replies on its inbox \
                             {inbox}.* (was the mesh started by another version of oam?); start \
                             the mesh again with `oam mesh up`"
                        ));
                    }
                    async_nats::Event::ClientError(e) => {
                        tracing::debug!(conn = %conn_name, "NATS client error: {e}");
                    }
                    other => tracing::warn!(conn = %conn_name, "NATS event: {other}"),
                }
            }
        });
    if let Some(ca) = ca_file() {
        opts = opts.add_root_certificates(ca).require_tls(true);
    }
    if wait_for_server {
        opts = opts.retry_on_initial_connect();
    }
    opts.connect(addrs).await
}

/// How often an idle connection named `name` pings its server; two pings unanswered and the
/// next one makes it stale: closed, and made again, to another server if this one does not
/// answer. The connections liveness rests on (the monitor's, and each serving agent
/// instance's) ping every `LIVENESS_PING`, so a frozen server costs them about 1.5 s, inside
/// the 3 s heartbeat verdict, not the 4-6 s the others' 2 s pings take (which no stall of a busy
/// machine reaches).
fn ping_interval(name: &str) -> Duration {
    let liveness =
        name.starts_with("oam-monitor") || name.starts_with(&super::subjects::host_connection(""));
    if liveness {
        LIVENESS_PING
    } else {
        Duration::from_secs(2)
    }
}

/// See `ping_interval`.
pub(crate) const LIVENESS_PING: Duration = Duration::from_millis(500);

/// Does this server error refuse the connection the subscription to its own reply inbox
/// (`prefix`)? Then no request it makes can be answered.
fn inbox_refused(error: &str, prefix: &str) -> bool {
    let e = error.to_ascii_lowercase();
    let Some(at) = e.find("permissions violation for subscription to") else {
        return false;
    };
    let subject = error[at..].split('"').nth(1).unwrap_or("");
    subject == prefix || subject.starts_with(&format!("{prefix}."))
}

/// Does this client or server error say the credentials were refused?
fn says_refused(error: &str) -> bool {
    let e = error.to_ascii_lowercase();
    e.contains("authorization violation") || e.contains("authentication")
}

/// What to say when the server no longer takes a connection's credentials.
fn credentials_refused(conn: &str, url: &str) -> String {
    format!(
        "NATS at {url} refused the credentials of {conn} (was the mesh started again with \
         `--new-credentials`?); start this command again with the mesh folder's current \
         credentials (`--dir`, or a file from `oam creds issue` with --creds), or pass --nats-url"
    )
}

/// How long to wait before connection attempt `attempt` (counted from 1, and again from 1 after
/// every successful connection): the first at once, then 100 ms more each time, at most 1 s.
/// (async-nats applies this to the very first connect too; a delay there would be paid by every
/// short-lived command.)
fn reconnect_delay(attempt: usize) -> Duration {
    let waited = u64::try_from(attempt.saturating_sub(1)).unwrap_or(u64::MAX);
    Duration::from_millis(waited.saturating_mul(100).min(1_000))
}

/// The servers a lost connection tried since it was lost, to choose the next (`next_server`).
#[derive(Default)]
struct Outage {
    /// The connection that was lost (its server's id and its client id there).
    lost: Option<(String, u64)>,
    /// How often each server (by URL) was tried since.
    tried: std::collections::HashMap<String, u32>,
}

impl Outage {
    /// Which server to try next: one tried least since the connection was lost, and among
    /// those, one other than the server lost when there is one (picked among them by `pick`,
    /// so that a crowd of clients spreads): every other server once, then the lost one, and
    /// round again. A server that froze still accepts TCP connections, so trying it again costs
    /// the whole connect timeout; async-nats's own choice (shuffled, then by failures counted
    /// since each server last took a connection, so the server just lost, which took one,
    /// counts none while servers down in an earlier outage still count theirs) tries it first
    /// more often than not, and a liveness connection that does cannot beat inside the
    /// heartbeat bound. `None` (async-nats chooses) before the first connection.
    fn next_server(
        &mut self,
        pool: &[async_nats::Server],
        last: &async_nats::ServerInfo,
        pick: u64,
    ) -> Option<async_nats::ReconnectToServer> {
        if last.port == 0 {
            return None;
        }
        let lost = Some((last.server_id.clone(), last.client_id));
        if self.lost != lost {
            self.lost = lost;
            self.tried.clear();
        }
        let unspecified = matches!(last.host.as_str(), "" | "0.0.0.0" | "::" | "[::]");
        let is_lost = |s: &async_nats::Server| {
            s.addr.port() == last.port && (unspecified || s.addr.host() == last.host)
        };
        let rank = |s: &async_nats::Server| {
            let tried = self.tried.get(s.addr.as_url_str()).copied().unwrap_or(0);
            (tried, is_lost(s))
        };
        let best = pool.iter().map(rank).min()?;
        let tied: Vec<&async_nats::Server> = pool.iter().filter(|s| rank(s) == best).collect();
        let chosen = tied[(pick % tied.len() as u64) as usize];
        *self
            .tried
            .entry(chosen.addr.as_url_str().to_string())
            .or_default() += 1;
        Some(async_nats::ReconnectToServer {
            addr: chosen.addr.clone(),
            delay: None,
        })
    }
}

/// `nats://user:pass@host:port` -> (`nats://host:port`, Some((user, pass))); of a server
/// list, every entry's taken out and the first entry's returned.
pub fn split_credentials(url: &str) -> (String, Option<UserPassword>) {
    let mut auth = None;
    let bare: Vec<String> = url
        .split(',')
        .map(|entry| {
            let (bare, creds) = split_one(entry);
            auth = auth.take().or(creds);
            bare
        })
        .collect();
    (bare.join(","), auth)
}

/// `split_credentials` of one server's URL.
fn split_one(url: &str) -> (String, Option<UserPassword>) {
    if let (Some(scheme), Some(at)) = (url.find("://"), url.rfind('@'))
        && at > scheme
    {
        let userinfo = &url[scheme + 3..at];
        let (user, pass) = userinfo.split_once(':').unwrap_or((userinfo, ""));
        let bare = format!("{}{}", &url[..scheme + 3], &url[at + 1..]);
        return (bare, Some((user.to_string(), pass.to_string())));
    }
    (url.to_string(), None)
}

/// The URL (or every URL of a server list) without its password, for messages and logs.
pub fn redact(url: &str) -> String {
    url.split(',').map(redact_one).collect::<Vec<_>>().join(",")
}

fn redact_one(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn a_refusal_is_told_to_its_own_watcher_only_and_the_first_reason_kept() {
        let (mine, other) = (super::Refusal::default(), super::Refusal::default());
        let waiting = tokio::spawn({
            let mine = mine.clone();
            async move { mine.wait().await }
        });
        tokio::task::yield_now().await;
        mine.refuse("first".into());
        mine.refuse("second".into());
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("the waiter is woken")
            .unwrap();
        assert_eq!(mine.reason(), Some("first"));
        assert_eq!(
            other.reason(),
            None,
            "another connection's watcher hears nothing"
        );
        // Already refused: waiting returns at once.
        tokio::time::timeout(std::time::Duration::from_secs(5), mine.wait())
            .await
            .expect("at once");
    }

    #[test]
    fn only_a_refused_reply_inbox_stops_a_connection() {
        let seen = r#"nats: Permissions Violation for Subscription to "_OAM.viewer.0j4jc6tMZ0LWjv08ZMQiYu.*""#;
        assert!(super::inbox_refused(seen, "_OAM.viewer"));
        assert!(
            !super::inbox_refused(seen, "_OAM.view"),
            "another role's prefix"
        );
        let other = format!(
            r#"nats: Permissions Violation for Subscription to "{}""#,
            crate::transport::subjects::REQUEST
        );
        assert!(
            !super::inbox_refused(&other, "_OAM.viewer"),
            "a subject it was not meant to read"
        );
        let publish = r#"nats: Permissions Violation for Publish to "_OAM.viewer.x""#;
        assert!(!super::inbox_refused(publish, "_OAM.viewer"));
        let shared = format!(
            r#"Permissions Violation for Subscription to "{}.abc.*""#,
            crate::transport::subjects::DEFAULT_INBOX
        );
        assert!(super::inbox_refused(
            &shared,
            crate::transport::subjects::DEFAULT_INBOX
        ));
    }

    #[test]
    fn a_lost_connection_tries_every_other_server_before_the_lost_one() {
        // Failures counted from an earlier outage: the lost server, which took the connection
        // since, counts none; they do not decide.
        let pool = [(4222, 0), (4223, 3), (4224, 2)].map(|(port, failed)| async_nats::Server {
            addr: format!("nats://127.0.0.1:{port}").parse().unwrap(),
            failed_attempts: failed,
            did_connect: true,
            is_discovered: false,
            last_error: None,
        });
        let lost = |client_id| async_nats::ServerInfo {
            host: "127.0.0.1".into(),
            port: 4222,
            server_id: "NLOST".into(),
            client_id,
            ..Default::default()
        };
        let tries = |outage: &mut super::Outage, client_id, pick: u64, n: usize| -> Vec<u16> {
            (0..n as u64)
                .map(|k| {
                    let next = outage.next_server(&pool, &lost(client_id), pick + k);
                    next.unwrap().addr.port()
                })
                .collect()
        };
        let mut outage = super::Outage::default();
        let first = tries(&mut outage, 7, 0, 6);
        let mut round: Vec<u16> = first[..2].to_vec();
        round.sort_unstable();
        assert_eq!(round, [4223, 4224], "the others first: {first:?}");
        assert_eq!(first[2], 4222, "then the lost one: {first:?}");
        let mut again: Vec<u16> = first[3..5].to_vec();
        again.sort_unstable();
        assert_eq!((again, first[5]), (vec![4223, 4224], 4222), "{first:?}");
        // Clients spread over the others.
        let firsts: std::collections::BTreeSet<u16> = (0..8)
            .map(|pick| tries(&mut super::Outage::default(), 7, pick, 1)[0])
            .collect();
        assert_eq!(firsts, [4223, 4224].into());
        // A later loss (another connection) starts over.
        assert_ne!(tries(&mut outage, 8, 0, 1), [4222]);
        // Alone in the pool: the lost server.
        let alone = outage.next_server(&pool[..1], &lost(9), 0);
        assert_eq!(alone.map(|n| n.addr.port()), Some(4222));
        // Before any connection async-nats chooses.
        let never = async_nats::ServerInfo::default();
        assert!(outage.next_server(&pool, &never, 0).is_none());
    }

    #[test]
    fn the_first_attempt_does_not_wait() {
        let delays: Vec<u128> = [1, 2, 3, 11, 12, usize::MAX]
            .map(|a| super::reconnect_delay(a).as_millis())
            .to_vec();
        assert_eq!(delays, vec![0, 100, 200, 1_000, 1_000, 1_000]);
    }

    #[test]
    fn credentials_come_out_of_the_url() {
        assert_eq!(
            super::split_credentials("nats://oam:pw@127.0.0.1:4222"),
            (
                "nats://127.0.0.1:4222".to_string(),
                Some(("oam".to_string(), "pw".to_string()))
            )
        );
        assert_eq!(super::split_credentials("nats://127.0.0.1:1").1, None);
    }

    #[test]
    fn a_server_list_is_read_entry_by_entry_and_a_bad_entry_named() {
        let (addrs, auth) =
            super::servers("nats://oam:pw@127.0.0.1:4222, nats://127.0.0.1:4223,127.0.0.1:4224")
                .unwrap();
        let ports: Vec<u16> = addrs.iter().map(async_nats::ServerAddr::port).collect();
        assert_eq!(ports, [4222, 4223, 4224]);
        assert_eq!(auth, Some(("oam".into(), "pw".into())));
        let bad = super::servers("nats://127.0.0.1:4222,nats://127.0.0.1:99999").unwrap_err();
        assert_eq!(bad.at, "server 2 of 2 (\"nats://127.0.0.1:99999\")");
        let empty = super::servers("nats://127.0.0.1:4222,")
            .unwrap_err()
            .to_string();
        assert!(
            empty.starts_with("server 2 of 2") && empty.contains("empty"),
            "{empty}"
        );
        let two = super::servers("nats://a:x@127.0.0.1:1,nats://b:y@127.0.0.1:2")
            .unwrap_err()
            .to_string();
        assert!(
            two.contains("another user") && !two.contains(":y@"),
            "{two}"
        );
        assert_eq!(
            super::split_credentials("nats://oam:pw@127.0.0.1:1,nats://oam:pw@127.0.0.1:2"),
            (
                "nats://127.0.0.1:1,nats://127.0.0.1:2".to_string(),
                Some(("oam".to_string(), "pw".to_string()))
            )
        );
        assert_eq!(
            super::redact("nats://oam:pw@127.0.0.1:1,nats://oam:pw@127.0.0.1:2"),
            "nats://oam:***@127.0.0.1:1,nats://oam:***@127.0.0.1:2"
        );
    }

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(
            super::redact("nats://oam:s3cret@127.0.0.1:4222"),
            "nats://oam:***@127.0.0.1:4222"
        );
        assert_eq!(
            super::redact("nats://127.0.0.1:4222"),
            "nats://127.0.0.1:4222"
        );
    }
}
