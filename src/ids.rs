//! Random identifiers (passwords, instance and fault ids) from the operating system.

use std::io::Read;

/// The operating system gave no random bytes.
#[derive(Debug, thiserror::Error)]
#[error("cannot read /dev/urandom for a password: {0}")]
pub struct NoRandomness(#[from] std::io::Error);

/// `bytes` random bytes from the OS, as hex.
pub fn random_hex(bytes: usize) -> Result<String, NoRandomness> {
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// An id (32 hex digits) nobody can work out from the ids they have seen: a keyed hash
/// (SipHash; the key drawn from the OS once per process by the standard library) of a counter,
/// so it costs no system call. For request ids that name reply subjects: an agent that served
/// one request of a caller must not be able to predict the next.
pub(crate) fn unguessable() -> String {
    use std::hash::BuildHasher;
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static KEY: OnceLock<std::hash::RandomState> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let key = KEY.get_or_init(std::hash::RandomState::new);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!(
        "{:016x}{:016x}",
        key.hash_one((n, 0u8)),
        key.hash_one((n, 1u8))
    )
}

/// This process's run: 6 hex digits drawn at its start. Ids a process mints carry it, so the
/// ids minted after a restart never repeat those of the run before.
pub(crate) fn run_token() -> &'static str {
    static RUN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    RUN.get_or_init(|| unguessable()[..6].to_string())
}

#[cfg(test)]
mod tests {
    #[test]
    fn unguessable_ids_share_no_prefix_and_do_not_repeat() {
        let ids: Vec<String> = (0..1000).map(|_| super::unguessable()).collect();
        assert!(ids.iter().all(|id| id.len() == 32));
        let distinct: std::collections::BTreeSet<&String> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len());
        // Consecutive ids do not share a counter-like prefix (as `prefix + counter` would).
        let same_prefix = ids.windows(2).filter(|w| w[0][..8] == w[1][..8]).count();
        assert!(
            same_prefix < 3,
            "{same_prefix} consecutive ids share 8 hex digits"
        );
    }
}
