//! Optimistic concurrency on a key's version: no lock is held while the work runs, and the
//! work commits only if nobody else committed for the key in the meantime.
//!
//! Every key has a version (a row in `dlock_versions`, created at 0 on first use).
//! [`transaction`] reads it, runs your closure in a database transaction, and ends with
//! `UPDATE … SET version = version + 1 WHERE key = ? AND version = <seen>`: if that matched
//! one row the transaction commits; if someone else committed first it matched none, so
//! everything is rolled back and tried again after a short, growing, jittered pause.
//!
//! It suits short read-modify-write work where conflicts are rare; under heavy contention a
//! lock ([`Locker`](crate::Locker)) wastes less. Every writer of the protected data must go
//! through `transaction` with the same key: the version is what makes writes conflict.
//!
//! ```
//! use diesel_lock::{optimistic, Error};
//!
//! # fn main() -> diesel_lock::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
//! # diesel_lock::Locker::builder(pool.clone()).build()?.migrate()?;
//! let (mut conn, mut other) = (pool.get()?, pool.get()?);
//! let mut runs = 0;
//! optimistic::transaction(&mut *conn, "stock/42", 5, |_conn, _version| {
//!     runs += 1;
//!     if runs == 1 {
//!         // Another writer commits for the key meanwhile: this attempt must run again.
//!         optimistic::transaction(&mut *other, "stock/42", 1, |_, _| Ok::<_, Error>(()))?;
//!     }
//!     Ok::<_, Error>(())
//! })?;
//! assert_eq!(runs, 2);
//! # Ok(()) }
//! ```

use crate::backend::LockConnection;
use crate::backend::Sql;
use crate::backoff::Backoff;
use crate::{key, Error, Result};
use std::time::Duration;

/// The longest pause between two attempts.
const MAX_PAUSE: Duration = Duration::from_millis(50);

/// Runs `f` in a transaction with the key's current version; commits only if the version is
/// unchanged at the end (`UPDATE … SET version = version + 1 WHERE version = <seen>`),
/// otherwise rolls back and retries, up to `attempts` times in all.
///
/// `f` receives the connection (inside the transaction) and the version it runs against;
/// it may run several times, so it should have no effects outside the database. An error
/// from `f` rolls back and is returned at once, without retrying, unless it is contention
/// (a deadlock, a lock-wait timeout, a serialization failure, SQLite's "database is
/// locked"): that rolled `f`'s statements back too, and counts as a conflict. It must: on
/// SQLite, a transaction that has read cannot start writing while another writer commits,
/// and `f`'s own write is where that shows.
///
/// # Errors
/// [`Error::Conflict`] when the version changed under every attempt;
/// [`Error::InvalidKey`] before any SQL runs; [`Error::InvalidConfig`] for zero `attempts`;
/// [`Error::MissingTable`] before [`Locker::migrate`](crate::Locker::migrate); whatever `f`
/// returned, converted into [`Error`]. Deadlocks and busy databases met on the way count as
/// conflicts and are retried.
///
/// # Examples
/// ```
/// use diesel::prelude::*;
/// use diesel::sql_types::Text;
///
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = dir.path().join("app.db");
/// let pool = diesel_lock::connect(url.to_str().unwrap())?;
/// diesel_lock::Locker::builder(pool.clone()).build()?.migrate()?; // creates dlock_versions
/// let mut conn = pool.get()?;
/// diesel::sql_query("CREATE TABLE notes (name TEXT PRIMARY KEY, body TEXT NOT NULL)")
///     .execute(&mut *conn)?;
/// diesel::sql_query("INSERT INTO notes VALUES ('todo', '')").execute(&mut *conn)?;
///
/// let version = diesel_lock::optimistic::transaction(&mut *conn, "notes/todo", 10, |c, version| {
///     // Read, merge and write back; had another writer committed for "notes/todo" since
///     // `version` was read, this attempt would roll back and run again.
///     diesel::sql_query("UPDATE notes SET body = body || ? WHERE name = 'todo'")
///         .bind::<Text, _>("milk;")
///         .execute(c)?;
///     Ok::<_, diesel::result::Error>(version)
/// })?;
/// assert_eq!(version, 0); // the first transaction on a key sees version 0
/// # Ok(()) }
/// ```
pub fn transaction<C, T, E, F>(conn: &mut C, key: &str, attempts: u32, mut f: F) -> Result<T>
where
    C: LockConnection,
    F: FnMut(&mut C, i64) -> std::result::Result<T, E>,
    Error: From<E>,
{
    key::validate(key)?;
    if attempts == 0 {
        return Err(Error::InvalidConfig("attempts must be at least 1".into()));
    }
    // Jittered, so that the writers that collided do not collide again in step.
    let mut backoff = Backoff::new(Duration::from_millis(1), MAX_PAUSE);
    for attempt in 1..=attempts {
        match once(conn, key, &mut f) {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => log::debug!("optimistic {key:?}: version changed (attempt {attempt})"),
            Err(Error::Database(e)) if conn.sql().is_contention(&e) => {
                log::debug!("optimistic {key:?}: contention ({e}) (attempt {attempt})");
            }
            Err(e) => return Err(e),
        }
        if attempt < attempts {
            std::thread::sleep(backoff.next_pause());
        }
    }
    Err(Error::Conflict {
        key: key.to_owned(),
        attempts,
    })
}

/// Why a transaction was rolled back.
enum Abort {
    /// The key has no version row yet.
    Missing,
    /// Someone else committed for the key first.
    Conflict,
    Failed(Error),
}

impl From<diesel::result::Error> for Abort {
    fn from(e: diesel::result::Error) -> Self {
        Abort::Failed(e.into())
    }
}

/// One attempt: `Ok(None)` on a conflict.
fn once<C, T, E, F>(conn: &mut C, key: &str, f: &mut F) -> Result<Option<T>>
where
    C: LockConnection,
    F: FnMut(&mut C, i64) -> std::result::Result<T, E>,
    Error: From<E>,
{
    for _ in 0..2 {
        let outcome = conn.transaction::<T, Abort, _>(|c| {
            let seen = c.sql().version_read(key)?.ok_or(Abort::Missing)?;
            let value = f(c, seen).map_err(|e| Abort::Failed(e.into()))?;
            if c.sql().version_bump(key, seen)? {
                Ok(value)
            } else {
                Err(Abort::Conflict)
            }
        });
        match outcome {
            Ok(value) => return Ok(Some(value)),
            Err(Abort::Conflict) => return Ok(None),
            Err(Abort::Failed(e)) => return Err(e),
            // Created outside the transaction and committed at once: an uncommitted row
            // would make every other first user of the key wait for this transaction.
            Err(Abort::Missing) => conn.sql().version_create(key)?,
        }
    }
    // The row vanished right after its creation (deleted by hand): try again later.
    Ok(None)
}
