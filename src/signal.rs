//! Waiting for what ends a long-running command: Ctrl-C, SIGTERM, or a condition of this
//! process that makes going on pointless (NATS refusing its credentials), said once with why.

use std::sync::OnceLock;
use tokio::sync::Notify;

static REASON: OnceLock<String> = OnceLock::new();
static STOPPED: Notify = Notify::const_new();

/// Ask every long-running command of this process to stop, because of `reason` (the first
/// reason given is kept).
pub fn stop_for(reason: String) {
    if REASON.set(reason).is_ok() {
        STOPPED.notify_waiters();
    }
}

/// Why this process was asked to stop, if it was (not by a signal).
pub fn stop_reason() -> Option<&'static str> {
    REASON.get().map(String::as_str)
}

async fn stopped() {
    let notified = STOPPED.notified();
    tokio::pin!(notified);
    notified.as_mut().enable();
    if REASON.get().is_some() {
        return;
    }
    notified.await;
}

/// Resolves on SIGINT or SIGTERM, or when `stop_for` is called.
pub async fn terminated() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                    () = stopped() => {}
                }
            }
            Err(_) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    () = stopped() => {}
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        tokio::select! {
            _ = ctrl_c => {}
            () = stopped() => {}
        }
    }
}
