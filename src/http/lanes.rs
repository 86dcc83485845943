//! Lanes: single-threaded runtimes that HTTP connections are served on, one connection on one
//! lane for its whole life, each lane with its own pool of upstream connections.
//!
//! On the shared work-stealing runtime a request hops threads: the socket's readiness wakes
//! one worker, the pooled upstream connection's task runs on another, its answer wakes the
//! first again. Each hop is a wake-up across cores (a futex, an interrupt, a cold cache), and on
//! the zero-latency bench those hops were a quarter of a node's CPU per request. On a lane the
//! request, its upstream call and the connection's own task share one thread, as in nginx's
//! workers. A lane never steals work: one busy connection slows only the others on its lane.
//! The node's services and its NATS door stay on the shared runtime.

use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

thread_local! {
    /// The lane this thread runs, if it is one.
    static LANE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The lane the calling thread runs (`None` off the lanes).
pub fn current() -> Option<usize> {
    LANE.with(std::cell::Cell::get)
}

/// One `T` off the lanes and one for each lane (a connection pool, say): `here` is the calling
/// thread's.
pub struct PerLane<T>(std::sync::Arc<[T]>);

impl<T> Clone for PerLane<T> {
    fn clone(&self) -> Self {
        PerLane(self.0.clone())
    }
}

impl<T> PerLane<T> {
    /// `make`'s for off the lanes, then for each of `lanes`.
    pub fn new<E>(lanes: usize, make: impl FnMut() -> Result<T, E>) -> Result<PerLane<T>, E> {
        let made: Vec<T> = std::iter::repeat_with(make)
            .take(lanes + 1)
            .collect::<Result<_, E>>()?;
        Ok(PerLane(made.into()))
    }

    /// The calling thread's: its lane's, else the one off the lanes (also for a lane beyond
    /// those it was made for).
    pub fn here(&self) -> &T {
        let on = current().map_or(0, |i| i + 1);
        // Never empty: `new` makes at least the one off the lanes.
        self.0.get(on).unwrap_or(&self.0[0])
    }
}

/// A set of lanes, each a thread with its own runtime, until the set is dropped.
pub struct Lanes {
    handles: Vec<Handle>,
    next: AtomicUsize,
    /// Dropping the set ends every lane's runtime (and what still runs on it).
    stop: CancellationToken,
}

impl Lanes {
    /// No lanes: work stays on the caller's runtime.
    pub fn none() -> Lanes {
        Lanes {
            handles: Vec::new(),
            next: AtomicUsize::new(0),
            stop: CancellationToken::new(),
        }
    }

    /// `n` lanes, threads `oam-lane-0` and on.
    pub fn start(n: usize) -> std::io::Result<Lanes> {
        let mut lanes = Lanes::none();
        for i in 0..n {
            let (tx, rx) = std::sync::mpsc::channel();
            let stop = lanes.stop.clone();
            std::thread::Builder::new()
                .name(format!("oam-lane-{i}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return;
                        }
                    };
                    LANE.with(|l| l.set(Some(i)));
                    let _ = tx.send(Ok(rt.handle().clone()));
                    rt.block_on(stop.cancelled());
                })?;
            // A lane that could not start has said why; the ones before it end with `lanes`.
            let handle = rx
                .recv()
                .map_err(|_| std::io::Error::other("a lane's thread ended as it started"))??;
            lanes.handles.push(handle);
        }
        Ok(lanes)
    }

    /// The next lane, in turn; `None` without lanes.
    pub fn pick(&self) -> Option<&Handle> {
        if self.handles.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        self.handles.get(i)
    }
}

impl Drop for Lanes {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn work_runs_on_each_lane_in_turn_and_ends_with_the_set() {
        assert_eq!(current(), None, "a test's runtime is no lane");
        let lanes = Lanes::start(2).unwrap();
        let mut seen = Vec::new();
        for _ in 0..4 {
            let h = lanes.pick().unwrap();
            let on = h
                .spawn(async {
                    let name = std::thread::current().name().map(String::from);
                    (current(), name)
                })
                .await
                .unwrap();
            seen.push(on);
        }
        let lane = |i: usize| (Some(i), Some(format!("oam-lane-{i}")));
        assert_eq!(seen, vec![lane(0), lane(1), lane(0), lane(1)]);
        // Work still under way when the set goes is dropped with its lane.
        let (held, gone) = tokio::sync::oneshot::channel::<()>();
        lanes.pick().unwrap().spawn(async move {
            let _held = held;
            std::future::pending::<()>().await;
        });
        drop(lanes);
        let ended = tokio::time::timeout(Duration::from_secs(5), gone).await;
        assert!(
            matches!(ended, Ok(Err(_))),
            "the pending task was dropped: {ended:?}"
        );
    }

    #[tokio::test]
    async fn each_lane_has_its_own_and_the_rest_share_one() {
        let mut n = 0;
        let per = PerLane::new(2, || {
            n += 1;
            Ok::<_, ()>(n)
        })
        .unwrap();
        assert_eq!(*per.here(), 1, "off the lanes");
        let lanes = Lanes::start(3).unwrap();
        let mut seen = Vec::new();
        for _ in 0..3 {
            let per = per.clone();
            seen.push(
                lanes
                    .pick()
                    .unwrap()
                    .spawn(async move { *per.here() })
                    .await
                    .unwrap(),
            );
        }
        // The third lane was not made for: it shares the one off the lanes.
        assert_eq!(seen, vec![2, 3, 1]);
    }

    #[test]
    fn no_lanes_pick_nothing() {
        let lanes = Lanes::none();
        assert!(lanes.pick().is_none());
    }
}
