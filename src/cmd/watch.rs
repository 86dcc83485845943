//! `oam watch`: the terminal and the bus around the pure model in `crate::tui`. Bus events reach
//! the model over a bounded channel (what does not fit is counted and shown); keys come from a
//! reader thread; a frame is drawn at a fixed rate. The terminal is restored on every exit path,
//! panics included.

use crate::core::chaos::{Inject, Params, Restore};
use crate::core::pipeline::Decision;
use crate::core::wire::Envelope;
use crate::error::{Error, Result};
use crate::transport::chaos;
use crate::transport::store::escalations;
use crate::transport::subjects;
use crate::tui::render;
use crate::tui::state::{App, Update};
use crate::tui::state::{CHAOS_MENU, Key, KeyEffect};
use async_nats::jetstream::kv;
use futures_util::StreamExt;
use ratatui::crossterm::event::{self as term, KeyCode, KeyEventKind, KeyModifiers};
use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Bus events waiting for the model; more are dropped and counted.
pub(crate) const CHANNEL: usize = 10_000;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub cluster: crate::cmd::ClusterArgs,
    /// Frames per second.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=60))]
    pub fps: u32,
}

/// Puts the terminal back however `run` ends.
struct TerminalGuard;

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

/// An event's sender and body, or `None` for what does not parse as one (never applied).
fn body<T: serde::de::DeserializeOwned>(payload: &[u8]) -> Option<(String, T)> {
    let env: Envelope<T> = serde_json::from_slice(payload).ok()?;
    Some((env.sender, env.body))
}

/// A message the watch could not read: counted and shown, never silently dropped.
fn unreadable(m: &async_nats::Message) -> Update {
    Update::Unreadable(m.subject.to_string())
}

/// Everything from the bus, as model events, into `tx` (never waiting on a full channel).
async fn feed(
    nats: async_nats::Client,
    tx: tokio::sync::mpsc::Sender<Update>,
    dropped: Arc<AtomicU64>,
) {
    let send = |ev: Update| {
        if tx.try_send(ev).is_err() {
            dropped.fetch_add(1, Ordering::Relaxed);
        }
    };
    let subs = async {
        Ok::<_, async_nats::SubscribeError>((
            nats.subscribe(subjects::STATES).await?,
            nats.subscribe(subjects::DECISIONS).await?,
            nats.subscribe(subjects::INCIDENTS).await?,
            nats.subscribe(subjects::DEATHS).await?,
            nats.subscribe(subjects::HEALTH).await?,
            nats.subscribe(subjects::CHAOS_EVENT).await?,
        ))
    };
    let Ok((mut states, mut decisions, mut incidents, mut deaths, mut beats, mut chaos_events)) =
        subs.await
    else {
        send(Update::Connection(false));
        return;
    };
    let refresh_chaos = {
        let nats = nats.clone();
        let tx = tx.clone();
        move || {
            let nats = nats.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                if let Ok(active) = chaos::ask(&nats, subjects::CHAOS_LIST, b"{}".to_vec()).await {
                    let _ = tx.try_send(Update::Chaos(active));
                }
            });
        }
    };
    refresh_chaos();
    // Ends with the feed (when the mesh moved, the watch feeds from its new address).
    let _escalations = AbortOnDrop(tokio::spawn(feed_escalations(nats.clone(), tx.clone())));
    let mut slow = tokio::time::interval(Duration::from_secs(2));
    let mut connected = None;
    let catalog_of = crate::mesh::store::Mesh::new(nats.clone());
    loop {
        tokio::select! {
            Some(m) = states.next() => match body(&m.payload) {
                Some((node, state)) => send(Update::NodeState { node, state: Box::new(state) }),
                None => send(unreadable(&m)),
            },
            // A batch of a node's decisions.
            Some(m) = decisions.next() => match body::<Vec<Decision>>(&m.payload) {
                Some((node, batch)) => {
                    for decision in batch {
                        send(Update::Decision { node: node.clone(), decision: Box::new(decision) });
                    }
                }
                None => send(unreadable(&m)),
            },
            Some(m) = incidents.next() => match body(&m.payload) {
                Some((node, incident)) => send(Update::Incident { node, incident }),
                None => send(unreadable(&m)),
            },
            Some(m) = deaths.next() => match serde_json::from_slice(&m.payload) {
                Ok(v) => send(Update::Death(v)),
                Err(_) => send(unreadable(&m)),
            },
            Some(m) = beats.next() => match serde_json::from_slice(&m.payload) {
                Ok(v) => send(Update::AgentBeat(v)),
                Err(_) => send(unreadable(&m)),
            },
            Some(_) = chaos_events.next() => refresh_chaos(),
            _ = slow.tick() => {
                let up = nats.connection_state() == async_nats::connection::State::Connected;
                if connected != Some(up) {
                    connected = Some(up);
                    send(Update::Connection(up));
                    if up {
                        refresh_chaos();
                    }
                }
                if up && let Ok(catalog) = crate::mesh::store::catalog(&catalog_of).await {
                    send(Update::Catalog(catalog.into_iter().map(|c| c.name).collect()));
                }
            }
            else => return,
        }
    }
}

/// A task that ends when its handle is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How long NATS may be gone before the mesh folder is read again for another address.
const MOVED_AFTER: Duration = Duration::from_secs(4);

/// The feed, on `nats` as long as the mesh is where it was. Cut off for a while, the watch reads
/// the mesh folder (or flags) again: a mesh started again on another port is followed there,
/// and watches stay open across `oam mesh down` and `up`.
async fn follow(
    cluster: crate::cmd::ClusterArgs,
    mut nats: async_nats::Client,
    tx: tokio::sync::mpsc::Sender<Update>,
    dropped: Arc<AtomicU64>,
) {
    let mut url = cluster.url(&crate::cmd::Role::Viewer).ok();
    loop {
        let feeder = AbortOnDrop(tokio::spawn(feed(
            nats.clone(),
            tx.clone(),
            dropped.clone(),
        )));
        let mut lost_for = Duration::ZERO;
        let moved = loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if tx.is_closed() {
                return;
            }
            if nats.connection_state() == async_nats::connection::State::Connected {
                lost_for = Duration::ZERO;
                continue;
            }
            lost_for += Duration::from_secs(1);
            if lost_for < MOVED_AFTER {
                continue;
            }
            let now = cluster.url(&crate::cmd::Role::Viewer).ok();
            if now.is_some() && now != url {
                let connect = cluster.connect(&crate::cmd::Role::Viewer, "oam-watch");
                if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_secs(5), connect).await {
                    break (c, now);
                }
            }
        };
        drop(feeder);
        // The old client gives up its reconnecting with its last handle.
        (nats, url) = moved;
    }
}

/// The escalation store, every record and then every change, as model events, read by direct
/// get every `ESCALATIONS_EVERY` (no consumer: the viewer may create none); read again from the
/// start whenever reading fails (NATS gone and back). These are state, not a stream: this task
/// waits for room in the channel rather than drop a resolution.
async fn feed_escalations(nats: async_nats::Client, tx: tokio::sync::mpsc::Sender<Update>) {
    const ESCALATIONS_EVERY: Duration = Duration::from_secs(1);
    let mut at: Option<(kv::Store, u64)> = None;
    loop {
        if at.is_none()
            && let Ok(store) = escalations::store(&nats).await
        {
            if tx.send(Update::EscalationsReread).await.is_err() {
                return;
            }
            at = Some((store, 1));
        }
        if let Some((store, from)) = at.as_mut() {
            match crate::transport::store::changes_since(&nats, store, *from).await {
                Ok((changes, next)) => {
                    *from = next;
                    for c in changes {
                        let ev = match c.operation {
                            kv::Operation::Put => match serde_json::from_slice::<
                                escalations::EscalationRecord,
                            >(&c.value)
                            {
                                Ok(r) => Update::Escalation(Box::new(r)),
                                Err(_) => continue,
                            },
                            kv::Operation::Delete | kv::Operation::Purge => {
                                Update::EscalationGone(c.key)
                            }
                        };
                        if tx.send(ev).await.is_err() {
                            return;
                        }
                    }
                }
                Err(_) => at = None,
            }
        }
        if tx.is_closed() {
            return;
        }
        tokio::time::sleep(ESCALATIONS_EVERY).await;
    }
}

/// Keys from the terminal, on a thread of their own (crossterm reads block).
fn keys(stop: Arc<AtomicBool>) -> tokio::sync::mpsc::Receiver<term::KeyEvent> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            if term::poll(Duration::from_millis(100)).unwrap_or(false)
                && let Ok(term::Event::Key(k)) = term::read()
                && k.kind != KeyEventKind::Release
                && tx.blocking_send(k).is_err()
            {
                return;
            }
        }
    });
    rx
}

/// The terminal's key as the model's.
fn key_of(k: term::KeyEvent) -> Key {
    match k.code {
        KeyCode::Char(c) if k.modifiers.contains(KeyModifiers::CONTROL) => Key::Ctrl(c),
        KeyCode::Char(c) => Key::Char(c),
        KeyCode::Enter => Key::Enter,
        KeyCode::Esc => Key::Esc,
        KeyCode::Backspace => Key::Backspace,
        KeyCode::Tab => Key::Tab,
        KeyCode::Up => Key::Up,
        KeyCode::Down => Key::Down,
        KeyCode::PageUp => Key::PageUp,
        KeyCode::PageDown => Key::PageDown,
        KeyCode::Home => Key::Home,
        KeyCode::End => Key::End,
        _ => Key::Other,
    }
}

/// What the watch does with the operator's credentials.
enum Act {
    Chaos(usize),
    Mark(escalations::Mark, String),
}

/// Mark escalation `id` acknowledged or resolved by `by`; the outcome in words.
async fn mark_action(
    nats: &async_nats::Client,
    how: escalations::Mark,
    id: &str,
    by: &str,
) -> String {
    let done = match how {
        escalations::Mark::Acknowledged => "acknowledged",
        escalations::Mark::Resolved => "resolved",
    };
    let store = match escalations::store(nats).await {
        Ok(s) => s,
        Err(e) => return format!("{id} not {done}: the escalation store: {e:#}"),
    };
    match escalations::mark(&store, id, how, by, None, crate::clock::now_ms()).await {
        Ok(escalations::Resolved::Now(_)) => format!("{id} {done}"),
        Ok(escalations::Resolved::Already(r)) => {
            let state = if r.status == escalations::Status::Resolved {
                "resolved"
            } else {
                "acknowledged"
            };
            format!("{id} was {state} already")
        }
        Ok(escalations::Resolved::Unknown) => format!("{id} is no longer in the store"),
        Err(e) => format!("{id} not {done}: {e:#}"),
    }
}

/// Inject (or restore) menu entry `sel`; the outcome in words.
async fn chaos_action(nats: &async_nats::Client, sel: usize) -> String {
    let (label, fault, target, secs) = CHAOS_MENU[sel];
    let (subject, body) = if let Some(fault) = fault {
        let req = Inject {
            fault,
            target: target.map(String::from),
            for_ms: secs * 1_000,
            params: Params::default(),
        };
        (subjects::CHAOS_INJECT, serde_json::to_vec(&req))
    } else {
        (
            subjects::CHAOS_RESTORE,
            serde_json::to_vec(&Restore { what: None }),
        )
    };
    match chaos::ask(nats, subject, body.unwrap_or_default()).await {
        Ok(done) => format!("chaos: {label}: {} fault(s)", done.len()),
        Err(e) => format!("chaos: {label}: {e}"),
    }
}

pub async fn run(a: Args) -> Result<()> {
    if !std::io::stdout().is_terminal() {
        return Err(Error::usage(
            "oam watch draws on a terminal and stdout is not one; for streams a program can \
             read, use `oam listen 'oam.v1.decision.*' --json` (decisions) or \
             `oam listen 'oam.v1.state.*' --json` (each node's view)",
        ));
    }
    let nats = a
        .cluster
        .connect(&crate::cmd::Role::Viewer, "oam-watch")
        .await?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Update>(CHANNEL);
    let dropped = Arc::new(AtomicU64::new(0));
    let feeder = tokio::spawn(follow(a.cluster.clone(), nats, tx, dropped.clone()));
    let (chaos_tx, mut chaos_rx) = tokio::sync::mpsc::channel::<Act>(4);
    let (status_tx, mut status_rx) = tokio::sync::mpsc::channel::<String>(4);
    {
        // The watch reads as the viewer; injecting and marking escalations are the operator's,
        // on a connection of its own, opened at the first use (or why it cannot be, said on
        // screen).
        let cluster = a.cluster.clone();
        let by = format!(
            "{} (oam watch)",
            cluster
                .url(&crate::cmd::Role::Operator)
                .ok()
                .and_then(|u| crate::transport::connect::split_credentials(&u).1)
                .map_or_else(|| "operator".to_string(), |(user, _)| user)
        );
        tokio::spawn(async move {
            let mut operator: Option<async_nats::Client> = None;
            while let Some(act) = chaos_rx.recv().await {
                // (A mesh started again elsewhere needs a connection there.)
                if operator.as_ref().is_some_and(|c| {
                    c.connection_state() != async_nats::connection::State::Connected
                }) {
                    operator = None;
                }
                if operator.is_none() {
                    match cluster
                        .connect(&crate::cmd::Role::Operator, "oam-watch-chaos")
                        .await
                    {
                        Ok(c) => operator = Some(c),
                        Err(e) => {
                            let what = match act {
                                Act::Chaos(_) => "chaos",
                                Act::Mark(..) => "marking an escalation",
                            };
                            let why =
                                format!("{what} needs the operator's credentials: {:#}", e.source);
                            let _ = status_tx.send(why).await;
                            continue;
                        }
                    }
                }
                if let Some(op) = &operator {
                    let said = match act {
                        Act::Chaos(sel) => chaos_action(op, sel).await,
                        Act::Mark(how, id) => mark_action(op, how, &id, &by).await,
                    };
                    let _ = status_tx.send(said).await;
                }
            }
        });
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut key_rx = keys(stop.clone());

    let mut terminal = ratatui::init();
    let _guard = TerminalGuard;
    let mut app = App::default();
    let mut frame = tokio::time::interval(Duration::from_millis(1_000 / u64::from(a.fps)));
    frame.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let terminated = crate::cmd::terminated();
    tokio::pin!(terminated);
    let result = loop {
        tokio::select! {
            _ = frame.tick() => {
                let now = crate::clock::now_ms();
                while let Ok(ev) = rx.try_recv() {
                    app.apply(ev, now);
                }
                app.dropped = dropped.load(Ordering::Relaxed);
                if let Err(e) = terminal.draw(|f| render::render(f, &app, now)) {
                    break Err(Error::failed(e));
                }
            }
            Some(k) = key_rx.recv() => {
                let len = render::panel_len(&app, app.focus, crate::clock::now_ms());
                match app.on_key(key_of(k), len) {
                    KeyEffect::Quit => break Ok(()),
                    KeyEffect::Chaos(sel) => {
                        let _ = chaos_tx.try_send(Act::Chaos(sel));
                    }
                    KeyEffect::Mark(how, id) => {
                        let _ = chaos_tx.try_send(Act::Mark(how, id));
                    }
                    KeyEffect::None => {}
                }
            },
            Some(s) = status_rx.recv() => app.status = s,
            _ = &mut terminated => break Ok(()),
        }
    };
    stop.store(true, Ordering::Relaxed);
    feeder.abort();
    result
}
