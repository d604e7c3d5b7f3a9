//! Key validation and the stable hash used where a backend limits lock names.

use crate::{Error, Result};
use sha2::{Digest, Sha256};

/// The longest key accepted, in bytes.
///
/// ```
/// use diesel_lock::{Error, MAX_KEY_LEN};
///
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
/// # locker.migrate()?;
/// assert!(locker.try_lock(&"k".repeat(MAX_KEY_LEN))?.is_some());
/// let too_long = "k".repeat(MAX_KEY_LEN + 1);
/// assert!(matches!(locker.try_lock(&too_long), Err(Error::InvalidKey { .. })));
/// # Ok(()) }
/// ```
pub const MAX_KEY_LEN: usize = 255;

/// Checks a key before any SQL runs: 1 to 255 bytes of UTF-8 without NUL.
pub(crate) fn validate(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidKey {
            reason: "the key is empty",
        });
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Error::InvalidKey {
            reason: "the key is longer than 255 bytes",
        });
    }
    if key.contains('\0') {
        return Err(Error::InvalidKey {
            reason: "the key contains a NUL byte",
        });
    }
    Ok(())
}

/// The stable 64-bit form of a key: the first 8 bytes of SHA-256 of its UTF-8 bytes, read
/// big-endian as a signed integer. It never changes between versions or platforms.
///
/// ```
/// assert_eq!(diesel_lock::key_hash("nightly-report"), diesel_lock::key_hash("nightly-report"));
/// assert_ne!(diesel_lock::key_hash("a"), diesel_lock::key_hash("A"));
/// ```
pub fn key_hash(key: &str) -> i64 {
    let digest = Sha256::digest(key.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// The row of `dlock_token_floor` (migration 15) that a key's first token is drawn above: 64
/// buckets chosen by `key_hash`, so that first acquisitions of different keys rarely lock the
/// same floor row (`backend/{pg,mysql,sqlite}/locks.rs`).
pub(crate) fn floor_bucket(key: &str) -> i64 {
    key_hash(key) & 63
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_keys() {
        for k in [
            "a",
            "nightly-report",
            "'; DROP TABLE x; --",
            "ключ-🔒",
            &"x".repeat(255),
        ] {
            validate(k).unwrap();
        }
    }

    #[test]
    fn refuses_bad_keys() {
        for k in ["", "a\0b", &"x".repeat(256), &"é".repeat(128)] {
            assert!(
                matches!(validate(k), Err(Error::InvalidKey { .. })),
                "{k:?}"
            );
        }
    }

    #[test]
    fn hash_vectors_are_fixed() {
        // sha256("") = e3b0c44298fc1c14...; sha256("abc") = ba7816bf8f01cfea...
        assert_eq!(key_hash(""), 0xe3b0c44298fc1c14_u64 as i64);
        assert_eq!(key_hash("abc"), 0xba7816bf8f01cfea_u64 as i64);
    }
}
