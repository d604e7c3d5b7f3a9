//! `LockInfo`: one held lock as the database saw it. Its own module, used by `admin` and by
//! the backends' admin statements alike (so that neither depends on the other for it).

use chrono::{DateTime, Utc};
use std::time::Duration;

/// A strategy without its settings: what [`LockInfo::strategy`] says, and what
/// [`Strategy::kind`](crate::Strategy::kind) gives. Displays as
/// [`Strategy::name`](crate::Strategy::name) does (`"row"`, `"lease"`, `"for-update"`, …).
///
/// ```
/// use diesel_lock::{Strategy, StrategyKind};
///
/// assert_eq!(Strategy::ForUpdate.kind(), StrategyKind::ForUpdate);
/// assert_eq!(StrategyKind::ForUpdate.to_string(), "for-update");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StrategyKind {
    /// [`Strategy::Row`](crate::Strategy::Row).
    Row,
    /// [`Strategy::Lease`](crate::Strategy::Lease).
    Lease,
    /// [`Strategy::ForUpdate`](crate::Strategy::ForUpdate).
    ForUpdate,
    /// [`Strategy::Advisory`](crate::Strategy::Advisory).
    Advisory,
    /// [`Strategy::AdvisoryXact`](crate::Strategy::AdvisoryXact).
    AdvisoryXact,
}

impl StrategyKind {
    /// The name `dlock --strategy` takes: `"row"`, `"lease"`, `"for-update"`, `"advisory"`,
    /// `"advisory-xact"`.
    ///
    /// ```
    /// assert_eq!(diesel_lock::StrategyKind::AdvisoryXact.as_str(), "advisory-xact");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            StrategyKind::Row => "row",
            StrategyKind::Lease => "lease",
            StrategyKind::ForUpdate => "for-update",
            StrategyKind::Advisory => "advisory",
            StrategyKind::AdvisoryXact => "advisory-xact",
        }
    }
}

impl std::fmt::Display for StrategyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a lock is held: what [`LockInfo::mode`] says. Displays in lowercase (`"exclusive"`,
/// `"read"`, `"permit"`), as `dlock list` shows it.
///
/// ```
/// use diesel_lock::LockMode;
///
/// assert_eq!(LockMode::Exclusive.to_string(), "exclusive");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockMode {
    /// The key's exclusive lock ([`Locker::lock`](crate::Locker::lock), and
    /// [`Locker::write`](crate::Locker::write), the same lock).
    Exclusive,
    /// One of the key's readers ([`Locker::read`](crate::Locker::read)).
    Read,
    /// One of the permits of a semaphore ([`Locker::permit`](crate::Locker::permit)).
    Permit,
}

impl LockMode {
    /// The lowercase name: `"exclusive"`, `"read"` or `"permit"`.
    ///
    /// ```
    /// assert_eq!(diesel_lock::LockMode::Permit.as_str(), "permit");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            LockMode::Exclusive => "exclusive",
            LockMode::Read => "read",
            LockMode::Permit => "permit",
        }
    }
}

impl std::fmt::Display for LockMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

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
    /// The strategy that holds it: [`StrategyKind::Row`] or [`StrategyKind::Lease`], the
    /// strategies whose locks are rows (the session strategies' locks live in the server's
    /// lock tables, not in ours).
    pub strategy: StrategyKind,
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
    /// How it is held: [`LockMode::Exclusive`] (`lock`, `write`), or a shared lease's `Read`
    /// or `Permit` (see [`Locker::read`](crate::Locker::read) and
    /// [`Locker::permit`](crate::Locker::permit)); a key's readers and permit holders are
    /// listed one each.
    pub mode: LockMode,
    /// A semaphore's number of permits (for `"permit"`), else `None`.
    pub permits: Option<u32>,
    /// `Row` and `Lease` locks (exclusive, readers and permits): how many wait for the key
    /// in its line (live places in `dlock_waiters`: its exclusive waiters, readers and
    /// permits; not a place a release has granted the key to, which holds it); 0 for the
    /// other strategies.
    pub waiting: u32,
    /// How long the longest of them has waited (database clock), if any wait.
    pub longest_wait: Option<Duration>,
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
