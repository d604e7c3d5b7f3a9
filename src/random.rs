//! Randomness without a dependency: std's `RandomState` is seeded from the OS once per thread
//! and then stepped, so hashing a counter and the time through a fresh one gives values that
//! differ across processes, threads and calls. Used for holder ids, default owners and jitter,
//! never for anything secret.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// A holder id, unique per acquisition: 32 hex digits.
pub(crate) fn holder_id() -> String {
    format!("{:016x}{:016x}", random_u64(), random_u64())
}

/// `host:pid:random`, the default owner name.
pub(crate) fn default_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned());
    format!(
        "{host}:{}:{:04x}",
        std::process::id(),
        random_u64() & 0xffff
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn holder_ids_differ() {
        let a = super::holder_id();
        let b = super::holder_id();
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
    }
}
