//! Per-caller rate limits (requests and tokens per minute) held once across the cluster. Each
//! minute is a window with one shared count of what has been granted in it (`Granted`); a node
//! leases a batch of the window at a time (`Lease`) and admits from it without asking again, so
//! N nodes hold one limit (never more than the limit is granted in a window) at about one round
//! trip per batch. Tokens are taken by estimate before a request and set right once its usage
//! is known. Pure: `now` is an argument.

use serde::{Deserialize, Serialize};

/// A window's length.
pub const WINDOW_MS: u64 = 60_000;

/// What one caller may use per window; `None`: no limit on that count.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    #[serde(default)]
    pub rpm: Option<u64>,
    #[serde(default)]
    pub tpm: Option<u64>,
}

/// The window `now_ms` falls in.
pub fn window(now_ms: u64) -> u64 {
    now_ms / WINDOW_MS
}

/// How long from `now_ms` until the next window opens.
pub fn retry_after_ms(now_ms: u64) -> u64 {
    WINDOW_MS - now_ms % WINDOW_MS
}

/// How much of a `limit` one node leases at a time, with `nodes` sharing it: small enough that
/// what leases leave unused when the window closes is a small part of it, large enough that a
/// node asks the shared count only every few requests.
pub fn batch(limit: u64, nodes: usize) -> u64 {
    (limit / (4 * nodes.max(1) as u64)).max(1)
}

/// What the cluster has granted of one caller's window (the shared record).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct Granted {
    pub requests: u64,
    pub tokens: u64,
}

impl Granted {
    /// Grant up to `requests` and `tokens` more under `limit` (a count without a limit is
    /// granted whole): what was granted, never beyond the limit.
    pub fn lease(&mut self, limit: &Limit, requests: u64, tokens: u64) -> (u64, u64) {
        let under = |cap: Option<u64>, had: u64, want: u64| match cap {
            Some(cap) => want.min(cap.saturating_sub(had)),
            None => want,
        };
        let r = under(limit.rpm, self.requests, requests);
        let t = under(limit.tpm, self.tokens, tokens);
        self.requests += r;
        self.tokens += t;
        (r, t)
    }
}

/// One node's lease of one caller's window: what it may still admit without asking. Tokens go
/// below zero when requests used more than their estimate (the next lease pays for it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) struct Lease {
    pub window: u64,
    pub requests: u64,
    pub tokens: i64,
    /// Of this window, what was granted on the node's own share while the count was unreachable.
    pub local_requests: u64,
    pub local_tokens: u64,
}

impl Lease {
    /// The lease as of `window` (a lease of an earlier window holds nothing).
    fn at(&mut self, window: u64) {
        if self.window != window {
            *self = Lease {
                window,
                ..Lease::default()
            };
        }
    }

    /// Admit one request of `tokens` (estimated) in `window` if the lease holds it.
    pub fn take(&mut self, limit: &Limit, window: u64, tokens: u64) -> bool {
        self.at(window);
        let requests_ok = limit.rpm.is_none() || self.requests >= 1;
        let tokens_ok = limit.tpm.is_none() || self.tokens >= tokens as i64;
        if !(requests_ok && tokens_ok) {
            return false;
        }
        if limit.rpm.is_some() {
            self.requests -= 1;
        }
        if limit.tpm.is_some() {
            self.tokens -= tokens as i64;
        }
        true
    }

    /// What to ask the shared count for so that a request of `tokens` can be admitted: a batch
    /// of each limited count, at least what is missing.
    pub fn wants(&self, limit: &Limit, nodes: usize, tokens: u64) -> (u64, u64) {
        let requests = limit.rpm.map_or(0, |l| batch(l, nodes));
        let short = (tokens as i64 - self.tokens).max(0) as u64;
        let tokens = limit.tpm.map_or(0, |l| batch(l, nodes).max(short));
        (requests, tokens)
    }

    /// Add what the shared count granted in `window`.
    pub fn add(&mut self, window: u64, requests: u64, tokens: u64) {
        self.at(window);
        self.requests += requests;
        self.tokens += tokens as i64;
    }

    /// Grant from the node's own share of `limit` (`1/nodes` of it per window) while the
    /// shared count cannot be reached: up to what `wants` asks, what was granted.
    pub fn local_share(
        &mut self,
        limit: &Limit,
        nodes: usize,
        window: u64,
        wants: (u64, u64),
    ) -> (u64, u64) {
        self.at(window);
        let share = |cap: u64| cap.div_ceil(nodes.max(1) as u64);
        let r = limit.rpm.map_or(0, |l| {
            wants.0.min(share(l).saturating_sub(self.local_requests))
        });
        let t = limit.tpm.map_or(0, |l| {
            wants.1.min(share(l).saturating_sub(self.local_tokens))
        });
        self.local_requests += r;
        self.local_tokens += t;
        self.add(window, r, t);
        (r, t)
    }

    /// A request of `window` used `actual` tokens where `estimated` were taken.
    pub fn settle(&mut self, window: u64, estimated: u64, actual: u64) {
        if self.window == window {
            self.tokens += estimated as i64 - actual as i64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RPM: Limit = Limit {
        rpm: Some(100),
        tpm: None,
    };

    #[test]
    fn three_nodes_leasing_in_batches_never_grant_more_than_the_limit() {
        let mut shared = Granted::default();
        let mut leases = [Lease::default(); 3];
        let mut admitted = 0;
        // 1,000 requests spread over the nodes in one window.
        for i in 0..1_000 {
            let l = &mut leases[i % 3];
            if !l.take(&RPM, 7, 0) {
                let (r, t) = l.wants(&RPM, 3, 0);
                let (r, t) = shared.lease(&RPM, r, t);
                l.add(7, r, t);
                if !l.take(&RPM, 7, 0) {
                    continue;
                }
            }
            admitted += 1;
        }
        assert_eq!(shared.requests, 100, "the window is granted whole, no more");
        assert_eq!(admitted, 100, "and every grant admitted one request");
        // The next window opens afresh.
        assert!(!leases[0].take(&RPM, 7, 0));
        assert_eq!(leases[0].wants(&RPM, 3, 0), (8, 0));
        leases[0].add(8, 8, 0);
        assert!(leases[0].take(&RPM, 8, 0));
    }

    #[test]
    fn tokens_are_taken_by_estimate_and_set_right_by_usage() {
        let limit = Limit {
            rpm: None,
            tpm: Some(1_000),
        };
        let mut shared = Granted::default();
        let mut l = Lease::default();
        assert!(!l.take(&limit, 1, 300));
        let (r, t) = l.wants(&limit, 1, 300);
        assert_eq!(
            (r, t),
            (0, 300),
            "the batch is 250: what is missing is asked for"
        );
        let (r, t) = shared.lease(&limit, r, t);
        l.add(1, r, t);
        assert!(l.take(&limit, 1, 300));
        // It used 500, not 300: the lease owes 200, and the next request asks for it.
        l.settle(1, 300, 500);
        assert_eq!(l.tokens, -200);
        assert_eq!(l.wants(&limit, 1, 100), (0, 300));
        // The window's count never passes the limit, whatever is asked.
        assert_eq!(shared.lease(&limit, 0, 5_000), (0, 700));
        assert_eq!(shared.lease(&limit, 0, 1), (0, 0));
        assert_eq!(retry_after_ms(61_500), 58_500);
        assert_eq!(window(61_500), 1);
    }

    #[test]
    fn an_unreachable_count_leaves_each_node_its_share_of_the_window() {
        let mut l = Lease::default();
        let mut admitted = 0;
        for _ in 0..100 {
            if !l.take(&RPM, 3, 0) {
                let wants = l.wants(&RPM, 3, 0);
                l.local_share(&RPM, 3, 3, wants);
                if !l.take(&RPM, 3, 0) {
                    continue;
                }
            }
            admitted += 1;
        }
        assert_eq!(admitted, 34, "a third of 100, rounded up");
    }
}
