//! What the machine gives a node: its cores and its open-file limit, raised to the hard limit at
//! start. A node's default connection limit and admission limits are sized from these (see
//! `core::bulkhead::BulkheadConfig::sized`), not fixed: every request holds about two descriptors
//! (the caller's connection and its upstream's), and a node that runs out of them refuses
//! callers and cannot reach providers.

use crate::core::bulkhead::Machine;

/// Descriptors kept aside from connections: NATS, the log, the listener, files, spares.
pub(crate) const RESERVED_FDS: u64 = 256;

/// The most connections a default sizes for, however many descriptors there are (each open
/// connection costs memory too).
const MAX_DEFAULT_CONNECTIONS: u64 = 65_536;

/// Raise the soft open-file limit to the hard one (at most 1,048,576: an unlimited hard limit
/// cannot be the soft one on Linux). Returns the soft limit now in force.
pub(crate) fn raise_open_files() -> u64 {
    let Some((soft, hard)) = open_files() else {
        return 1_024;
    };
    let want = hard.min(1 << 20);
    if want > soft {
        let lim = libc::rlimit {
            rlim_cur: want,
            rlim_max: hard,
        };
        // SAFETY: setrlimit reads the struct it is given; no memory is shared.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim) } == 0 {
            return want;
        }
        tracing::warn!(soft, hard, "cannot raise the open-file limit");
    }
    soft
}

/// The soft and hard open-file limits.
fn open_files() -> Option<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the struct it is given.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut lim) } == 0)
        .then_some((lim.rlim_cur, lim.rlim_max))
}

/// The connections a node may hold with `open_files` descriptors: two per connection, the
/// reserve kept aside, at least 16.
pub(crate) fn connections_for(open_files: u64) -> usize {
    let n = (open_files.saturating_sub(RESERVED_FDS) / 2).clamp(16, MAX_DEFAULT_CONNECTIONS);
    usize::try_from(n).unwrap_or(16)
}

/// The cores this process may run on.
pub(crate) fn cores() -> u32 {
    let n = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The soft open-file limit now in force.
pub(crate) fn soft_open_files() -> u64 {
    open_files().map_or(1_024, |(soft, _)| soft)
}

/// The machine the admission limits are sized for, holding `connections`.
pub(crate) fn sizing(cores: u32, connections: usize) -> Machine {
    Machine {
        cores,
        connections: u32::try_from(connections).unwrap_or(u32::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_leave_the_reserve_and_two_descriptors_each() {
        assert_eq!(connections_for(1_024), 384);
        assert_eq!(connections_for(20_000), 9_872);
        assert_eq!(connections_for(100), 16, "never below 16");
        assert_eq!(connections_for(u64::MAX), 65_536);
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let before = open_files().expect("getrlimit");
        let now = raise_open_files();
        assert_eq!(now, before.1.min(1 << 20));
        assert_eq!(open_files().expect("getrlimit").0, now);
    }
}
