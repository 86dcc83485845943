//! Work that outlives whoever waits for it, without a task of its own until it needs one.
//!
//! A chat request's pipeline must not stop half-way when its caller hangs up (hyper then drops
//! the handler): a budget held, a bulkhead slot or a health sample would be left behind.
//! Spawning every pipeline on its own task guarantees that, but costs a task and a wake-up
//! across threads per request. `Detachable` runs the pipeline in the handler's own task and
//! spawns it only when the handler is dropped before the pipeline ended: the pipeline is boxed,
//! so it moves to the new task from where it was pinned.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// `run`, awaited in place; dropped before its end, it is cancelled through `hung_up` and
/// finishes on a task of `tasks` (what it returns is then dropped).
pub(crate) struct Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send,
{
    run: Option<Pin<Box<F>>>,
    hung_up: CancellationToken,
    tasks: TaskTracker,
}

impl<F> Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send,
{
    pub(crate) fn new(run: F, hung_up: CancellationToken, tasks: TaskTracker) -> Self {
        Detachable {
            run: Some(Box::pin(run)),
            hung_up,
            tasks,
        }
    }
}

impl<F> Future for Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // Polled again after its end (a caller's bug): never ready again, never a panic.
        let Some(run) = self.run.as_mut() else {
            return Poll::Pending;
        };
        let out = std::task::ready!(run.as_mut().poll(cx));
        self.run = None;
        Poll::Ready(out)
    }
}

impl<F> Drop for Detachable<F>
where
    F: Future + Send + 'static,
    F::Output: Send,
{
    fn drop(&mut self) {
        let Some(run) = self.run.take() else {
            return;
        };
        self.hung_up.cancel();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                self.tasks.spawn_on(async move { drop(run.await) }, &rt);
            }
            // No runtime left (the process is ending): nothing can run it any more.
            Err(_) => tracing::debug!("a request's pipeline was dropped with its runtime"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn awaited_to_its_end_it_runs_in_place_and_cancels_nothing() {
        let hung_up = CancellationToken::new();
        let tasks = TaskTracker::new();
        let out = Detachable::new(async { 7 }, hung_up.clone(), tasks.clone()).await;
        assert_eq!(out, 7);
        assert!(!hung_up.is_cancelled());
        assert!(tasks.is_empty(), "no task was spawned");
    }

    #[tokio::test]
    async fn dropped_half_way_it_is_told_and_finishes_on_a_task() {
        let hung_up = CancellationToken::new();
        let tasks = TaskTracker::new();
        let (step_tx, step_rx) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let told = hung_up.clone();
        let run = async move {
            let _ = step_rx.await; // half-way: waits here when dropped
            let _ = done_tx.send(told.is_cancelled());
        };
        let mut waiting = Box::pin(Detachable::new(run, hung_up.clone(), tasks.clone()));
        let first = std::future::poll_fn(|cx| Poll::Ready(waiting.as_mut().poll(cx))).await;
        assert!(first.is_pending());
        drop(waiting);
        assert!(hung_up.is_cancelled());
        assert_eq!(tasks.len(), 1, "the rest moved to a task");
        step_tx.send(()).unwrap();
        let saw_cancel = tokio::time::timeout(Duration::from_secs(5), done_rx)
            .await
            .expect("the detached rest ran to its end")
            .unwrap();
        assert!(saw_cancel, "it ran on after the hang-up, told of it");
        tasks.close();
        tokio::time::timeout(Duration::from_secs(5), tasks.wait())
            .await
            .unwrap();
    }
}
