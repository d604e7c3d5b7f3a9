//! Looking at locks from outside their holders, and clearing a stuck one: what `dlock list`,
//! `dlock status` and `dlock release --force` are built on.
//!
//! These functions see the [`Strategy::Row`](crate::Strategy::Row) and
//! [`Strategy::Lease`](crate::Strategy::Lease) tables, the latter's shared leases and
//! permits included (one [`LockInfo`] per holder, with its `mode`). Locks of the session-scoped strategies
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

pub use crate::lock_info::LockInfo;

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
    all.extend(holders(conn, None)?.into_iter().map(|h| h.info));
    add_lines(conn, None, &mut all)?;
    all.sort_by(|a, b| {
        (&a.key, a.strategy.as_str(), a.token).cmp(&(&b.key, b.strategy.as_str(), b.token))
    });
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
        .chain(
            conn.sql()
                .admin_holders(Some(key))?
                .into_iter()
                .map(|h| h.info),
        )
        .collect();
    add_lines(conn, Some(key), &mut held)?;
    held.sort_by_key(|i| (i.strategy.as_str(), i.token));
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
    // Shared leases and permits: each holder's row deleted by its holder id.
    for held in holders(conn, Some(key))? {
        if conn.sql().holders_release(key, &held.holder)? {
            removed.push(held.info);
        }
    }
    removed.sort_by_key(|i| i.strategy.as_str());
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

/// The live holders of shared leases and permits; none on tables older than the migration
/// that made them (the other locks are still listed there).
/// Fills in how many wait for each `Row` or `Lease` lock (the exclusive lock, and each
/// reader or permit holding a key whose readers, writers or permits wait), and for how long.
fn add_lines<C: LockConnection>(
    conn: &mut C,
    key: Option<&str>,
    infos: &mut [LockInfo],
) -> Result<()> {
    if infos.is_empty() {
        return Ok(());
    }
    // Tables older than their migration (a database not yet migrated) have no lines.
    let lines = match conn.sql().line_stats(key) {
        Err(e) if crate::error::is_missing_table(&e) => return Ok(()),
        lines => lines?,
    };
    for line in lines {
        // Each lock's own line: a `Row` lock's waiters are not a `Lease` lock's of the
        // same name (`backend::Line`).
        let Some(kind) = crate::backend::Line::from_id(line.line).map(|l| l.kind()) else {
            continue;
        };
        for info in infos
            .iter_mut()
            .filter(|i| i.key == line.lock_key && i.strategy == kind)
        {
            info.waiting = u32::try_from(line.waiting).unwrap_or(u32::MAX);
            info.longest_wait = Some(std::time::Duration::from_micros(
                u64::try_from(line.longest_us).unwrap_or(0),
            ));
        }
    }
    Ok(())
}

fn holders<C: LockConnection>(
    conn: &mut C,
    key: Option<&str>,
) -> Result<Vec<crate::backend::holders::HolderRow>> {
    match conn.sql().admin_holders(key) {
        Ok(v) => Ok(v),
        Err(e) => match crate::Error::from(e) {
            crate::Error::MissingTable(_) => Ok(Vec::new()),
            e => Err(e),
        },
    }
}
