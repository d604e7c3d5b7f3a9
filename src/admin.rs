//! Looking at locks from outside their holders, and clearing a stuck one: what `dlock list`,
//! `dlock status` and `dlock release --force` are built on.
//!
//! These functions see the [`Strategy::Row`](crate::Strategy::Row) and
//! [`Strategy::Lease`](crate::Strategy::Lease) tables. Locks of the session-scoped strategies
//! (`ForUpdate`, `Advisory`) live in the server's lock manager, not in a table, and are not
//! listed.
//!
//! ```
//! use diesel_lock::{admin, Locker};
//!
//! # fn main() -> diesel_lock::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let url = dir.path().join("locks.db");
//! let pool = diesel_lock::connect(url.to_str().unwrap())?;
//! let locker = Locker::builder(pool.clone()).owner("report-worker").build()?;
//! locker.migrate()?;
//! let guard = locker.lock("nightly-report")?;
//!
//! let held = admin::held_locks(&mut *pool.get()?)?;
//! assert_eq!(held.len(), 1);
//! assert_eq!(held[0].key, "nightly-report");
//! assert_eq!(held[0].owner, "report-worker");
//! assert_eq!(held[0].token, guard.token());
//! # Ok(()) }
//! ```

use crate::backend::LockConnection;
use crate::backend::Sql;
use crate::{key, Result};
use chrono::{DateTime, Utc};
use std::time::Duration;

/// One held lock, as the database saw it.
///
/// ```
/// use diesel_lock::{admin, Locker, Strategy};
///
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
/// let rows = Locker::builder(pool.clone()).strategy(Strategy::Row { stale_after: None });
/// let locker = rows.build()?;
/// locker.migrate()?;
/// let _guard = locker.lock("export")?;
/// for info in admin::held_locks(&mut *pool.get()?)? {
///     println!("{} held by {} ({}) for {:?}", info.key, info.owner, info.strategy, info.age());
///     assert_eq!(info.expires_at, None); // rows do not expire
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The lock's key.
    pub key: String,
    /// The strategy that holds it, as named by [`Strategy::name`](crate::Strategy::name):
    /// `"row"` or `"lease"`.
    pub strategy: &'static str,
    /// The owner name its holder gave.
    pub owner: String,
    /// Its fencing token.
    pub token: i64,
    /// When it was taken (database clock).
    pub acquired_at: DateTime<Utc>,
    /// When a lease runs out unless renewed (database clock); `None` for rows, which do not
    /// expire.
    pub expires_at: Option<DateTime<Utc>>,
    /// The database's time when this was read: ages and remaining times are measured from it,
    /// never from the local clock.
    pub observed_at: DateTime<Utc>,
}

impl LockInfo {
    /// How long the lock had been held when it was read (database clock; zero if the clock
    /// went backwards).
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool.clone()).build()?;
    /// # locker.migrate()?;
    /// let _guard = locker.lock("k")?;
    /// std::thread::sleep(std::time::Duration::from_millis(20));
    /// let info = &diesel_lock::admin::lock_info(&mut *pool.get()?, "k")?[0];
    /// assert!(info.age() >= std::time::Duration::from_millis(10)); // database clock, ms steps
    /// # Ok(()) }
    /// ```
    pub fn age(&self) -> Duration {
        (self.observed_at - self.acquired_at)
            .to_std()
            .unwrap_or_default()
    }

    /// How long a lease had left when it was read; `None` for rows.
    ///
    /// ```
    /// use diesel_lock::{admin, Locker, Strategy};
    /// use std::time::Duration;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// let ttl = Duration::from_secs(30);
    /// let locker = Locker::builder(pool.clone()).strategy(Strategy::Lease { ttl }).build()?;
    /// locker.migrate()?;
    /// let _guard = locker.lock("k")?;
    /// let left = admin::lock_info(&mut *pool.get()?, "k")?[0].remaining().unwrap();
    /// assert!(left <= ttl && left > ttl / 2); // renewed every ttl/3 while the guard lives
    /// # Ok(()) }
    /// ```
    pub fn remaining(&self) -> Option<Duration> {
        self.expires_at
            .map(|e| (e - self.observed_at).to_std().unwrap_or_default())
    }
}

/// Every lock held right now (rows, and leases that have not expired), ordered by key and
/// then strategy.
///
/// # Errors
/// [`Error::MissingTable`](crate::Error::MissingTable) before the tables were created (nothing
/// can be held then); [`Error::Database`](crate::Error::Database) for other failures.
///
/// # Examples
/// ```
/// use diesel_lock::admin;
///
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
/// # let locker = diesel_lock::Locker::builder(pool.clone()).build()?;
/// # locker.migrate()?;
/// let (_b, _a) = (locker.lock("b")?, locker.lock("a")?);
/// let held = admin::held_locks(&mut *pool.get()?)?;
/// let keys: Vec<&str> = held.iter().map(|info| info.key.as_str()).collect();
/// assert_eq!(keys, ["a", "b"]); // ordered by key
/// # Ok(()) }
/// ```
pub fn held_locks<C: LockConnection>(conn: &mut C) -> Result<Vec<LockInfo>> {
    let mut all: Vec<LockInfo> = conn
        .sql()
        .admin_rows(None)?
        .into_iter()
        .chain(conn.sql().admin_leases(None)?)
        .map(|h| h.info)
        .collect();
    all.sort_by(|a, b| (&a.key, a.strategy).cmp(&(&b.key, b.strategy)));
    Ok(all)
}

/// The holders of `key` right now: empty if it is free, and at most one per strategy.
///
/// A plain read on every backend: it locks nothing, so calling it inside a long transaction
/// never holds up a holder's renewals or release.
///
/// # Errors
/// [`Error::InvalidKey`](crate::Error::InvalidKey) before any SQL runs; otherwise as for
/// [`held_locks`].
///
/// # Examples
/// ```
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
/// # let locker = diesel_lock::Locker::builder(pool.clone()).build()?;
/// # locker.migrate()?;
/// let mut conn = pool.get()?;
/// assert!(diesel_lock::admin::lock_info(&mut *conn, "k")?.is_empty());
/// let _guard = locker.lock("k")?;
/// assert_eq!(diesel_lock::admin::lock_info(&mut *conn, "k")?.len(), 1);
/// # Ok(()) }
/// ```
pub fn lock_info<C: LockConnection>(conn: &mut C, key: &str) -> Result<Vec<LockInfo>> {
    key::validate(key)?;
    let mut held: Vec<LockInfo> = conn
        .sql()
        .admin_rows(Some(key))?
        .into_iter()
        .chain(conn.sql().admin_leases(Some(key))?)
        .map(|h| h.info)
        .collect();
    held.sort_by_key(|i| i.strategy);
    Ok(held)
}

/// Removes whatever holds `key` (its row, and its lease if unexpired) and returns what was
/// removed: empty if nothing held it.
///
/// This is the administrator's way out for a lock whose holder is known to be dead, such as a
/// `Row` lock without `stale_after` left by a crashed process. The holder, if it is in fact
/// alive, is not told: its next [`LockGuard::check`](crate::LockGuard::check) says the lock
/// is lost, and a lease's heartbeat notices at its next renewal. What is removed is exactly
/// what is returned: the holders are read and removed in one transaction.
///
/// # Errors
/// [`Error::InvalidKey`](crate::Error::InvalidKey) before any SQL runs; otherwise as for
/// [`held_locks`].
///
/// # Examples
/// ```
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
/// # let locker = diesel_lock::Locker::builder(pool.clone()).build()?;
/// # locker.migrate()?;
/// let guard = locker.lock("stuck")?;
/// let removed = diesel_lock::admin::force_release(&mut *pool.get()?, "stuck")?;
/// assert_eq!(removed[0].token, guard.token());
/// assert!(guard.check().is_err()); // its holder has lost it
/// # Ok(()) }
/// ```
pub fn force_release<C: LockConnection>(conn: &mut C, key: &str) -> Result<Vec<LockInfo>> {
    key::validate(key)?;
    let mut removed = conn.sql().admin_force_release(key)?;
    removed.sort_by_key(|i| i.strategy);
    for info in &removed {
        log::warn!(
            "lock {key:?}: forcibly released the {} lock of {:?} (token {})",
            info.strategy,
            info.owner,
            info.token
        );
    }
    Ok(removed)
}
