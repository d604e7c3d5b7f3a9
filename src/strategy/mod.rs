//! The strategies. Each file implements one attempt to acquire, a release and a check for
//! its strategy on top of the backend's SQL; waiting, deadlines and the guard are written once
//! in `locker.rs` and `guard.rs`.

use crate::backend::Sql;
use crate::backend::{Backend, LockConnection, Wait};
use crate::{Error, Result};
use chrono::{DateTime, Utc};
use std::time::Duration;

mod advisory;
mod for_update;
pub(crate) mod heartbeat;
mod lease;
mod row;
pub(crate) mod session;

use session::{Pooled, Session};

/// How a lock is kept in the database. All strategies give the same
/// [`LockGuard`](crate::LockGuard) and the same guarantees of mutual exclusion and fencing tokens; they
/// differ in what happens when a holder crashes and in what they cost.
///
/// | strategy | PostgreSQL | MySQL / MariaDB | SQLite | a crashed holder's lock |
/// |---|---|---|---|---|
/// | `Row` | ✓ | ✓ | ✓ | stays until `stale_after` (or forever without it) |
/// | `Lease` | ✓ | ✓ | ✓ | free once `ttl` has passed without renewal |
/// | `ForUpdate` | ✓ | ✓ | refused | free as soon as the server sees the session end |
/// | `Advisory` | ✓ | ✓ | refused | free as soon as the server sees the session end |
///
/// The two session strategies (`ForUpdate`, `Advisory`) keep the lock in the holder's
/// database session: the guard owns one pooled connection for its whole life, so size the
/// pool for the locks held at once plus the waiters. Waiting happens on the server (the
/// server's lock queue hands the lock over the moment it is released) and a deadline is
/// enforced there too. What they guarantee when things go wrong:
///
/// | | `ForUpdate` | `Advisory` |
/// |---|---|---|
/// | holder process dies | the OS closes its socket; the server rolls back and frees the lock at once (measured: < 3 ms) | same |
/// | network partition | the server frees the lock only when it notices the dead session (TCP keepalives, `idle_in_transaction_session_timeout`, `wait_timeout`), which may take long; meanwhile the holder's [`check`](crate::LockGuard::check) fails | same, but no transaction: only keepalives / `wait_timeout` end it |
/// | database failover | the lock is gone with the session (row locks are not replicated); the holder's `check` fails | same (advisory locks are not replicated) |
/// | fencing token | drawn once the row is locked from a source a rollback does not undo (PostgreSQL sequence `dlock_fence_seq`, MySQL AUTO_INCREMENT of `dlock_fences`): never reissued, even after a holder dies | a counter committed as soon as the lock is held: never reissued |
/// | release | `COMMIT` | one `pg_advisory_unlock` / `RELEASE_LOCK` |
///
/// A guard's connection goes back to the pool only if its release worked; after a failed
/// release, a lost session or a panic it is closed, which makes the server free the lock.
///
/// ```no_run
/// use diesel_lock::{Locker, Strategy};
/// use std::time::Duration;
///
/// # fn main() -> diesel_lock::Result<()> {
/// let pool = diesel_lock::connect("postgres://app@db/app")?;
/// let locker = Locker::builder(pool).strategy(Strategy::Advisory).build()?;
/// locker.migrate()?;
/// if let Some(guard) = locker.try_lock_for("billing-run", Duration::from_secs(5))? {
///     // waited in the server's queue; the lock is ours until `guard` goes
///     guard.check()?; // still our session's?
///     guard.release()?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Strategy {
    /// INSERT a row on a unique key; release = DELETE by the row's id.
    ///
    /// `stale_after`: a row older than this (by the database clock) may be taken over by any
    /// `Row` waiter, or deleted by [`Locker::purge`](crate::Locker::purge): it is deleted in
    /// one conditional statement and then competed for by a normal insert, so two takers
    /// cannot both win. The limit is stored with the row (`stale_at`) by the `Locker` that
    /// inserted it: a waiter or purger configured with a shorter one, or none, goes by the
    /// holder's. Without it, a row left by a crashed holder stays until removed by hand
    /// (`dlock release --force`), and no other `Locker` can take it over or purge it.
    ///
    /// Rows inserted before version 0.1's fifth migration carry no limit: they never go
    /// stale. Upgrade every process sharing the tables together.
    Row {
        /// Age after which this `Locker`'s rows count as abandoned. `None`: never.
        stale_after: Option<Duration>,
    },
    /// Holder + expiry on the database clock. While a guard lives, a heartbeat renews the
    /// lease (default every ttl/3). Release is owner-checked: a unique holder id per
    /// acquisition, so two lockers sharing an owner name cannot release each other's locks.
    Lease {
        /// How long the lease lasts without renewal. At least 1 ms.
        ttl: Duration,
    },
    /// `SELECT … FOR UPDATE` on the key's row (in `dlock_for_update`, created on first use)
    /// inside a transaction the guard keeps open; release = COMMIT. `try_lock` uses
    /// `NOWAIT`; `try_lock_for` waits on the server under `lock_timeout` (PostgreSQL) or
    /// `innodb_lock_wait_timeout` (MySQL, whole seconds, the fraction by `NOWAIT` retries).
    /// The token is drawn once the row is locked, from a source the holder's rollback does
    /// not undo (the sequence `dlock_fence_seq` on PostgreSQL, the AUTO_INCREMENT of
    /// `dlock_fences` on MySQL), so a dead holder's token is never issued again; after a
    /// crash of the database *server*, one drawn just before it may be. PostgreSQL and MySQL
    /// only: `build` returns [`Error::Unsupported`] on SQLite.
    ForUpdate,
    /// PostgreSQL `pg_advisory_lock` family / MySQL `GET_LOCK`, held by the guard's session.
    /// PostgreSQL and MySQL only: `build` returns [`Error::Unsupported`] on SQLite.
    ///
    /// Keys are mapped by a stable hash: on PostgreSQL the lock key is
    /// [`key_hash`](crate::key_hash) (first 8 bytes of SHA-256, big-endian, as an `i64`;
    /// pg_locks shows its high half as `classid` and its low half as `objid`, `objsubid` 1);
    /// on MySQL a key of at most 64 lowercase ASCII letters, digits and `._:/-` is the lock
    /// name itself; any other key (or one starting with `dlock-sha256:`) becomes
    /// `dlock-sha256:` and the hash's 16 hex digits (MySQL folds lock names' case).
    /// Test vectors: `key_hash("nightly-report") = 0x6743ba10a2b2c487`,
    /// `"x"` × 65 → `0x9537c5fdf120482f` (negative) → MySQL name
    /// `dlock-sha256:9537c5fdf120482f`. MySQL lock names are server-wide, PostgreSQL's
    /// advisory keys per database.
    ///
    /// The token comes from the key's counter in `dlock_tokens`, bumped (and committed)
    /// only once the lock is held; that write is most of what this strategy costs.
    Advisory,
}

impl Default for Strategy {
    /// `Lease { ttl: 30 s }`.
    fn default() -> Self {
        Strategy::Lease {
            ttl: Duration::from_secs(30),
        }
    }
}

impl Strategy {
    /// The strategy's name, as used in messages and by the CLI.
    pub fn name(&self) -> &'static str {
        match self {
            Strategy::Row { .. } => "row",
            Strategy::Lease { .. } => "lease",
            Strategy::ForUpdate => "for-update",
            Strategy::Advisory => "advisory",
        }
    }

    /// Checks the strategy's own settings and that `backend` can honour it.
    pub(crate) fn validate(&self, backend: Backend) -> Result<()> {
        match *self {
            // Past a few thousand years the databases' date arithmetic overflows (NULL on
            // MySQL and SQLite, an error on PostgreSQL); a century is plenty.
            Strategy::Row { stale_after } => {
                if stale_after.is_some_and(|d| d < Duration::from_millis(1) || d > MAX_DURATION) {
                    return Err(Error::InvalidConfig(
                        "stale_after must be between 1 ms and 100 years (or None)".into(),
                    ));
                }
                Ok(())
            }
            Strategy::Lease { ttl } => {
                if ttl < Duration::from_millis(1) || ttl > MAX_DURATION {
                    return Err(Error::InvalidConfig(
                        "the lease ttl must be between 1 ms and 100 years".into(),
                    ));
                }
                Ok(())
            }
            // SQLite locks the whole database, never a row, and has no session locks.
            Strategy::ForUpdate | Strategy::Advisory => match backend {
                Backend::Postgres | Backend::Mysql => Ok(()),
                Backend::Sqlite => Err(Error::Unsupported {
                    strategy: self.name(),
                    backend: backend.name(),
                }),
            },
        }
    }

    /// The heartbeat interval used when the builder was not given one.
    pub(crate) fn default_heartbeat(&self) -> Option<Duration> {
        match self {
            Strategy::Lease { ttl } => Some(*ttl / 3),
            _ => None,
        }
    }
}

/// The longest ttl or `stale_after` accepted: 100 years.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A duration in whole microseconds, as the SQL takes it.
pub(crate) fn micros(d: Duration) -> Option<i64> {
    i64::try_from(d.as_micros()).ok()
}

/// What a guard needs to release and check its lock.
pub(crate) enum Hold<C: LockConnection> {
    Row {
        id: i64,
    },
    Lease {
        holder: String,
        beat: heartbeat::Beat,
    },
    /// The connection whose open transaction holds the row lock.
    ForUpdate {
        session: Session<C>,
        /// The backend's proof that the transaction holds the lock (see `for_update_lock`).
        proof: i64,
    },
    /// The connection whose session holds the advisory lock.
    Advisory {
        session: Session<C>,
    },
}

/// A successful acquisition.
pub(crate) struct Taken<C: LockConnection> {
    pub(crate) hold: Hold<C>,
    pub(crate) token: i64,
    pub(crate) acquired_at: DateTime<Utc>,
}

/// The parts of a `Locker` a strategy needs.
pub(crate) struct Ctx<'a, C: LockConnection> {
    pub(crate) pool: &'a r2d2::Pool<diesel::r2d2::ConnectionManager<C>>,
    pub(crate) owner: &'a str,
    pub(crate) heartbeat: &'a heartbeat::Heartbeat<C>,
}

/// One attempt on `conn`. `retry` is true when an earlier attempt by this caller failed;
/// `left` is how long the attempt may wait on the server (`None`: as long as it takes), which
/// only the strategies with server-side waits use. Contention is `Ok(None)`, never an error.
/// Session strategies keep `conn` in the guard; the others return it to the pool.
pub(crate) fn try_acquire<C: LockConnection>(
    strategy: &Strategy,
    ctx: &Ctx<'_, C>,
    mut conn: Pooled<C>,
    key: &str,
    retry: bool,
    left: Option<Duration>,
) -> Result<Option<Taken<C>>> {
    let wait = match left {
        None => Wait::Forever,
        Some(d) if d.is_zero() => Wait::No,
        Some(d) => Wait::For(d),
    };
    let taken = match *strategy {
        Strategy::Row { stale_after } => row::try_acquire(ctx, &mut *conn, key, stale_after, retry),
        Strategy::Lease { ttl } => lease::try_acquire(ctx, &mut *conn, key, ttl, retry),
        Strategy::ForUpdate | Strategy::Advisory if conn.sql().backend() == Backend::Sqlite => {
            Err(Error::Unsupported {
                strategy: strategy.name(),
                backend: conn.sql().backend().name(),
            })
        }
        Strategy::ForUpdate => return for_update::try_acquire(conn, key, wait),
        Strategy::Advisory => return advisory::try_acquire(conn, key, wait),
    };
    match taken {
        Err(Error::Database(e)) if conn.sql().is_contention(&e) => {
            log::debug!("lock {key:?}: contention ({e}); retrying");
            Ok(None)
        }
        other => other,
    }
}

/// Runs one short statement on a pooled connection, retrying a few times if the database
/// reports contention (a deadlock victim's statement was rolled back, so running it again is
/// safe). Releases and renewals must not fail merely because a waiter collided with them.
pub(crate) fn with_conn<C: LockConnection, T>(
    pool: &r2d2::Pool<diesel::r2d2::ConnectionManager<C>>,
    mut f: impl FnMut(&mut C) -> diesel::QueryResult<T>,
) -> Result<T> {
    let mut conn = pool.get()?;
    let mut pause = Duration::from_millis(1);
    for _ in 0..8 {
        match f(&mut conn) {
            Err(e) if conn.sql().is_contention(&e) => {
                log::debug!("contention on a release or renewal ({e}); retrying");
                std::thread::sleep(pause);
                pause *= 2;
            }
            other => return other.map_err(Error::from),
        }
    }
    f(&mut conn).map_err(Error::from)
}

/// Releases; `Err(LockLost)` if the lock was no longer ours.
pub(crate) fn release<C: LockConnection>(ctx: &Ctx<'_, C>, key: &str, hold: Hold<C>) -> Result<()> {
    match hold {
        Hold::Row { id } => row::release(ctx, key, id),
        Hold::Lease { holder, beat } => lease::release(ctx, key, &holder, beat),
        Hold::ForUpdate { session, proof } => for_update::release(session, key, proof),
        Hold::Advisory { session } => advisory::release(session, key),
    }
}

/// Asks the database whether the lock is still ours.
pub(crate) fn check<C: LockConnection>(ctx: &Ctx<'_, C>, key: &str, hold: &Hold<C>) -> Result<()> {
    let held = match hold {
        Hold::Row { id } => row::held(ctx, *id)?,
        Hold::Lease { holder, beat } => !beat.is_lost() && lease::held(ctx, key, holder)?,
        Hold::ForUpdate { session, proof } => for_update::held(session, key, *proof)?,
        Hold::Advisory { session } => advisory::held(session, key)?,
    };
    if held {
        Ok(())
    } else {
        Err(Error::LockLost {
            key: key.to_owned(),
        })
    }
}
