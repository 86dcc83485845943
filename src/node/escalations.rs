//! Escalations this node raises: each recorded as open in the escalation store, then sent to
//! the configured sinks (a webhook, a command), retried with backoff. [`Escalations`] is the
//! handle the request path queues them with (never waiting); [`Escalator`] the service.

use super::Node;
use crate::clock::now_ms;
use crate::core::escalation::Escalation;
use crate::transport::store::escalations::{self as store, Delivery, Sink};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Escalations waiting to be recorded at most; beyond, they are dropped and counted.
const WAITING: usize = 4_096;

pub(crate) struct Escalations {
    id: String,
    bus: Arc<super::bus::Bus>,
    tx: mpsc::Sender<Escalation>,
    /// Escalations not delivered to a sink after every attempt.
    pub undelivered: AtomicU64,
}

/// The service: records queued escalations in order, and delivers each to every sink.
pub(crate) struct Escalator {
    rx: mpsc::Receiver<Escalation>,
    node: Arc<Node>,
}

/// How long to wait after failed attempt `attempt` (from 1) before the next: 250 ms, doubled
/// each time, at most 5 s.
pub(crate) fn backoff(attempt: u32) -> Duration {
    let doubled = 250u64.saturating_mul(1u64 << attempt.saturating_sub(1).min(16));
    Duration::from_millis(doubled.min(5_000))
}

impl Escalations {
    pub(crate) fn new(
        id: &str,
        bus: Arc<super::bus::Bus>,
    ) -> (Escalations, mpsc::Receiver<Escalation>) {
        let (tx, rx) = mpsc::channel(WAITING);
        let handle = Escalations {
            id: id.to_string(),
            bus,
            tx,
            undelivered: AtomicU64::new(0),
        };
        (handle, rx)
    }

    /// Raise an escalation: published live, and queued to be recorded as open and delivered
    /// (never waits; dropped and counted when the queue is full).
    pub(crate) fn raise(&self, e: &Escalation) {
        self.bus
            .publish(crate::transport::subjects::escalation(&self.id), e);
        if self.tx.try_send(e.clone()).is_err() {
            let dropped = &self.bus.counters.dropped_events;
            dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Escalator {
    pub(crate) fn new(rx: mpsc::Receiver<Escalation>, node: Arc<Node>) -> Escalator {
        Escalator { rx, node }
    }

    /// Record queued escalations in the escalation store, in order, until the node's last
    /// handle is gone; deliveries under way end with `stop`.
    pub(crate) async fn run(mut self, stop: CancellationToken) {
        let node = &self.node;
        let mut kept = None;
        while let Some(e) = self.rx.recv().await {
            if node.bus.isolated() {
                continue; // a partition loses what it would have said
            }
            if kept.is_none() {
                match store::store(node.bus.nats()).await {
                    Ok(s) => kept = Some(s),
                    Err(err) => tracing::warn!("escalation {} not recorded: {err:#}", e.id),
                }
            }
            if let Some(s) = &kept {
                match store::open(s, &node.id, &e).await {
                    Ok(true) => {}
                    Ok(false) => {
                        // The same episode's escalation, raised by another node first: its
                        // record and its sinks are that node's.
                        tracing::info!(escalation = %e.id, "already recorded by another node");
                        continue;
                    }
                    Err(err) => {
                        tracing::warn!("escalation {} not recorded: {err:#}", e.id);
                        kept = None; // the bucket may be gone (a new server): open it afresh
                    }
                }
            }
            let sinks = &node.cfg.escalations;
            let webhook = sinks.webhook_url.clone().map(Sink::Webhook);
            let command = sinks.command.clone().map(Sink::Command);
            for sink in webhook.into_iter().chain(command) {
                let (node2, kept, e, stop) = (node.clone(), kept.clone(), e.clone(), stop.clone());
                node.serving.tasks.spawn(async move {
                    deliver(&node2, sink, &e, kept.as_ref(), stop).await;
                });
            }
        }
    }
}

/// Send escalation `e` to `sink` (retried with backoff until it takes it, at most the sink's
/// attempts), then record how it went on its record and in the metrics.
async fn deliver(
    node: &Node,
    sink: Sink,
    e: &Escalation,
    kept: Option<&async_nats::jetstream::kv::Store>,
    stop: CancellationToken,
) {
    let sinks = &node.cfg.escalations;
    let (attempts, timeout) = match sink {
        Sink::Webhook(_) => (sinks.webhook_attempts, sinks.webhook_timeout_ms),
        Sink::Command(_) => (sinks.command_attempts, sinks.command_timeout_ms),
    };
    let timeout = Duration::from_millis(timeout);
    let body = serde_json::json!({"node": node.id, "escalation": e});
    let mut delivery = Delivery {
        sink: sink.name(),
        attempts: 0,
        delivered_at_ms: None,
        error: None,
    };
    let Ok(http) = crate::http::http_client(Some(timeout)) else {
        return;
    };
    while delivery.attempts < attempts.max(1) {
        delivery.attempts += 1;
        let taken = match &sink {
            Sink::Webhook(url) => match http.post(url).json(&body).send().await {
                Ok(r) if r.status().is_success() => Ok(()),
                Ok(r) => Err(SinkError::Status(r.status().as_u16())),
                Err(err) => Err(SinkError::Unsent(err.to_string())),
            },
            Sink::Command(argv) => run_sink_command(argv, &body, timeout).await,
        };
        match taken {
            Ok(()) => {
                delivery.delivered_at_ms = Some(now_ms());
                delivery.error = None;
                break;
            }
            Err(why) => delivery.error = Some(why.to_string()),
        }
        if delivery.attempts < attempts {
            tokio::select! {
                () = tokio::time::sleep(backoff(delivery.attempts)) => {}
                () = stop.cancelled() => break,
            }
        }
    }
    let outcome = if delivery.delivered_at_ms.is_some() {
        "delivered"
    } else {
        tracing::warn!(
            "escalation {} not delivered to {} after {} attempts: {}",
            e.id,
            delivery.sink,
            delivery.attempts,
            delivery.error.as_deref().unwrap_or("")
        );
        node.escalations.undelivered.fetch_add(1, Ordering::Relaxed);
        "failed"
    };
    node.metrics.escalation_delivery(outcome);
    if let Some(s) = kept
        && let Err(err) = store::delivered(s, &e.id, &sink, delivery).await
    {
        tracing::warn!("the delivery of escalation {} not recorded: {err:#}", e.id);
    }
}

/// Why a sink did not take an escalation.
#[derive(Debug, PartialEq, thiserror::Error)]
enum SinkError {
    #[error("HTTP {0}")]
    Status(u16),
    #[error("{0}")]
    Unsent(String),
    #[error("the command is empty")]
    Empty,
    #[error("cannot run {program}: {why}")]
    NotRun { program: String, why: String },
    #[error("{program} did not finish within {after:?}; killed")]
    TimedOut { program: String, after: Duration },
    #[error("{program} exited with {status}{}", if stderr.is_empty() { String::new() } else { format!(": {stderr}") })]
    Exited {
        program: String,
        status: String,
        /// The first 200 characters it wrote to standard error.
        stderr: String,
    },
}

/// Run an escalation command sink once: `body` as JSON on its standard input; taken when it
/// exits 0 within `timeout` (it is killed otherwise). Its output is discarded.
async fn run_sink_command(
    argv: &[String],
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<(), SinkError> {
    use tokio::io::AsyncWriteExt;
    let Some((program, args)) = argv.split_first() else {
        return Err(SinkError::Empty);
    };
    let not_run = |e: std::io::Error| SinkError::NotRun {
        program: program.clone(),
        why: e.to_string(),
    };
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(not_run)?;
    let input = body.to_string();
    let run = async {
        if let Some(mut stdin) = child.stdin.take() {
            // A command that does not read its input still gets to decide by its exit.
            let _ = stdin.write_all(input.as_bytes()).await;
        }
        child.wait_with_output().await
    };
    match tokio::time::timeout(timeout, run).await {
        Err(_) => Err(SinkError::TimedOut {
            program: program.clone(),
            after: timeout,
        }),
        Ok(Err(e)) => Err(not_run(e)),
        Ok(Ok(out)) if out.status.success() => Ok(()),
        Ok(Ok(out)) => Err(SinkError::Exited {
            program: program.clone(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr)
                .trim()
                .chars()
                .take(200)
                .collect(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_doubling_up_to_five_seconds() {
        let waits: Vec<u128> = [1, 2, 3, 4, 5, 6, 40, u32::MAX]
            .map(|n| backoff(n).as_millis())
            .to_vec();
        assert_eq!(
            waits,
            vec![250, 500, 1_000, 2_000, 4_000, 5_000, 5_000, 5_000]
        );
    }

    #[tokio::test]
    async fn a_command_sink_takes_it_by_exit_status_and_says_why_not() {
        let body = serde_json::json!({"escalation": {"id": "e1"}});
        let t = Duration::from_secs(5);
        let sh = |script: &str| vec!["sh".to_string(), "-c".to_string(), script.to_string()];
        assert_eq!(run_sink_command(&sh("grep -q e1"), &body, t).await, Ok(()));
        let no = run_sink_command(&sh("echo full >&2; exit 3"), &body, t).await;
        let said = no.as_ref().map_err(ToString::to_string);
        assert!(
            said.is_err_and(|e| e.contains("exit status: 3") && e.contains("full")),
            "{no:?}"
        );
        let slow = run_sink_command(&sh("sleep 5"), &body, Duration::from_millis(50)).await;
        assert!(matches!(slow, Err(SinkError::TimedOut { .. })));
        assert!(slow.is_err_and(|e| e.to_string().contains("killed")));
        let empty = run_sink_command(&[], &body, t).await;
        assert_eq!(empty, Err(SinkError::Empty));
    }
}
