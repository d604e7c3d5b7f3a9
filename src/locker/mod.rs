//! `Locker`: takes locks on string keys. Its parts: `builder` (settings, checked once),
//! `wait` (waiting, written once for every strategy), `queue` (the in-process line of
//! waiters per key) and `cancel` (ending a wait from another thread).

mod builder;
mod cancel;
mod deadline;
mod in_line;
mod line;
mod metered;
mod modes;
mod multi;
mod queue;
mod reentrant;
pub(crate) mod shared;
mod wait;

use shared::Shared;

pub use builder::LockerBuilder;
use builder::Source;
pub use cancel::Cancel;
pub use multi::MultiGuard;

use crate::backend::{AnyConnection, Backend, Failures, LockConnection, Sql};
use crate::guard::LockGuard;
use crate::strategy::{RawLock, Strategy};
use crate::Result;
use deadline::Deadline;
use diesel::r2d2::ConnectionManager;
use r2d2::Pool;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Takes locks on string keys, keeping them in the database behind `pool`.
///
/// Cheap to clone (an `Arc`), `Send` and `Sync`: share one per strategy across threads.
///
/// # Acquiring: one rule for every kind of lock
/// Each kind of lock — [`lock`](Self::lock) (exclusive), [`read`](Self::read),
/// [`write`](Self::write), [`permit`](Self::permit) and [`lock_all`](Self::lock_all) —
/// comes in the same five forms, named as `lock_api` and `parking_lot` name them:
///
/// | form | waits | returns |
/// |---|---|---|
/// | `lock(key)` | as long as it takes | the guard |
/// | `try_lock(key)` | not at all: one attempt | `Some(guard)`, or `None` if held elsewhere |
/// | `try_lock_for(key, Duration)` | at most that long | `Some(guard)`, or `None` at the deadline |
/// | `try_lock_until(key, Instant)` | until then at the latest | as above |
/// | `try_lock_cancellable(key, Option<Instant>, &Cancel)` | until the deadline (`None`: no deadline) or a [`Cancel`] | as above, `None` also when cancelled |
///
/// Replace `lock` by `read`, `write`, `permit` (whose second argument is the number of
/// permits) or `lock_all` (whose first is a slice of keys): `try_read_for`,
/// `try_permit_until`, `try_lock_all_cancellable`, and so on. `None` always means "not
/// acquired in time"; an `Err` means the attempt itself failed (the database could not be
/// reached, a bad key, an unsupported mode).
///
/// # Fairness
/// Threads of one `Locker` waiting for the same key line up first-come first-served, and only
/// the first of them asks the database; a release by one of them wakes the next at once.
///
/// Across processes, `Row` and `Lease` waiters line up in the database: the first thread of
/// a `Locker` to find the key held takes a numbered place in the key's line (table
/// `dlock_waiters`), renewed while it waits, and the key goes only to the lowest live place.
/// Nobody takes a free key ahead of the line, not even `try_lock` (a newcomer): a key that is
/// free for a moment while others wait for it is not free to it. A release on PostgreSQL
/// wakes only the first waiter's `Locker` (see [`LockerBuilder::listen_url`]); elsewhere the
/// first in line polls, ever less often the longer the line stands still (up to
/// [`LockerBuilder::max_backoff`]). A waiter that gives up (deadline, cancellation, error,
/// panic) leaves the line; the place of one that died lapses after max(2 s, 4 ×
/// `max_backoff`). `ForUpdate` and `Advisory` waiters queue in the server's own lock queue
/// instead (see [`Strategy`](crate::Strategy)).
///
/// # Differences from `std::sync::Mutex`
/// Locks are not reentrant by default: a second `try_lock` of a held key returns `Ok(None)`,
/// even from the same `Locker` and thread, and a second `lock` would wait forever (see
/// [`LockerBuilder::reentrant`] to nest them instead). There is no poisoning:
/// a guard dropped during a panic releases its lock.
///
/// # Examples
/// ```
/// use diesel_lock::Locker;
///
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
/// let locker = Locker::builder(pool).build()?;
/// locker.migrate()?;
/// let guard = locker.lock("deploy")?;
/// let other = locker.clone(); // shares the pool and the line of waiters
/// let waiter = std::thread::spawn(move || other.lock("deploy").map(|g| g.token()));
/// assert!(locker.try_lock("deploy")?.is_none()); // held, and not reentrant
/// let token = guard.token();
/// drop(guard); // wakes the waiting thread at once
/// assert!(waiter.join().unwrap()? > token);
/// # Ok(()) }
/// ```
pub struct Locker<C: LockConnection> {
    inner: Arc<Inner<C>>,
}

pub(crate) struct Inner<C: LockConnection> {
    pool: Pool<ConnectionManager<C>>,
    /// The pool's last connection failure with the driver's reason, when the `Locker` built
    /// the pool from a URL ([`Locker::connect`]).
    failures: Option<Arc<Failures>>,
    strategy: Strategy,
    /// What the strategy does with a key (built once from `strategy`), and the raw locks of
    /// its other modes (`RawLock::mode`).
    raw: Arc<dyn RawLock<C>>,
    /// What guards share with the `Locker`.
    shared: Arc<Shared>,
    backend: Backend,
    max_backoff: Duration,
    /// Set once an acquisition (or `migrate`) found the tables at this build's newest
    /// migration: the schema never goes back, so it is asked once per `Locker`.
    schema_current: AtomicBool,
    /// Set once a schema check has waited for a migration committed elsewhere to show: the
    /// next checks of a database that is not migrated answer at once.
    schema_waited: AtomicBool,
    /// The pooled connections this `Locker`'s polling waiters keep between their looks
    /// (`wait.rs`, `Kept`): at most half the pool.
    kept: std::sync::atomic::AtomicUsize,
    /// PostgreSQL with `listen_url`: the thread that hears other processes' releases.
    /// Dropped (and joined) with the last clone of the `Locker`.
    #[cfg(feature = "postgres")]
    listener: Option<crate::backend::pg::listen::Listener>,
    /// SQLite on Linux, Row and Lease: the socket a release that grants this `Locker`'s
    /// place the key rings (`backend/sqlite/doorbell.rs`).
    #[cfg(all(feature = "sqlite", target_os = "linux"))]
    doorbell: Option<crate::backend::sqlite::doorbell::Doorbell>,
}

impl<C: LockConnection> Clone for Locker<C> {
    fn clone(&self) -> Self {
        Locker {
            inner: self.inner.clone(),
        }
    }
}

impl<C: LockConnection> std::fmt::Debug for Locker<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locker")
            .field("strategy", &self.inner.strategy)
            .field("owner", &self.inner.shared.owner)
            .field("backend", &self.inner.backend)
            .finish_non_exhaustive()
    }
}

impl Locker<AnyConnection> {
    /// Starts configuring a `Locker` over a pool of its own, built from `url`:
    /// `postgres://…` or `postgresql://…`, `mysql://…` (or `mariadb://…`), `sqlite://PATH` or
    /// a plain file path (SQLite). One connection is opened at once, so that a wrong URL or
    /// a server that is down fails here with the driver's reason; the pool itself is built
    /// by [`build`](LockerBuilder::build), of [`pool_size`](LockerBuilder::pool_size)
    /// connections (default: the URL's `dlock_pool_size=N`, else 10).
    ///
    /// The `Locker` keeps the URL: on PostgreSQL its waiters hear releases on a connection
    /// of their own to it (see [`LockerBuilder::listen_url`]), and its errors say why the
    /// pool could not connect ([`Error::Connection`](crate::Error::Connection): connection
    /// refused, authentication failed, unknown database, TLS required) where a pool built by
    /// hand can only say that it timed out. The URL accepts the same parameters as
    /// [`connect`](crate::connect) (`dlock_pooler=transaction` for PgBouncer), and its
    /// password appears in no message. [`Locker::pool`] gives the pool, for the
    /// application's own queries. On PostgreSQL reached directly (not through a transaction
    /// pooler) the pool's sessions run at READ COMMITTED whatever the role's or the
    /// database's default isolation: the line of waiters keeps its order only there (see
    /// the guide, "Waiting").
    ///
    /// # Errors
    /// [`Error::InvalidUrl`](crate::Error::InvalidUrl) for an empty or malformed URL, an
    /// unknown scheme, a backend this build lacks (naming the Cargo feature to turn on) or
    /// an in-memory SQLite database; [`Error::Connection`](crate::Error::Connection) if the
    /// first connection fails.
    ///
    /// # Examples
    /// ```
    /// use diesel_lock::{Locker, Strategy};
    /// use std::time::Duration;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = dir.path().join("locks.db").display().to_string();
    /// // `url`: "postgres://app:secret@db/app", "mysql://…", or a file path as here.
    /// let locker = Locker::connect(&url)?
    ///     .strategy(Strategy::Lease { ttl: Duration::from_secs(30) })
    ///     .build()?;
    /// locker.migrate()?;
    /// let _guard = locker.lock("nightly-report")?;
    /// # Ok(()) }
    /// ```
    pub fn connect(url: &str) -> Result<LockerBuilder<AnyConnection>> {
        LockerBuilder::from_url(url)
    }
}

impl<C: LockConnection> Locker<C> {
    /// Starts configuring a `Locker` over `pool`.
    ///
    /// # Examples
    /// ```
    /// use diesel_lock::{Locker, Strategy};
    /// use std::time::Duration;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = dir.path().join("locks.db");
    /// let pool = diesel_lock::connect(url.to_str().unwrap())?;
    /// let locker = Locker::builder(pool)
    ///     .strategy(Strategy::Lease { ttl: Duration::from_secs(10) })
    ///     .owner("report-worker-1")
    ///     .build()?;
    /// locker.migrate()?;
    /// # Ok(()) }
    /// ```
    pub fn builder(pool: Pool<ConnectionManager<C>>) -> LockerBuilder<C> {
        LockerBuilder::new(Source::Pool(pool))
    }

    /// The pool the `Locker` takes its connections from: the one it was given, or the one
    /// it built from a URL. For the application's own queries (see the crate docs, "Your own
    /// queries"); a connection taken from it is one fewer for the locks.
    ///
    /// ```
    /// use diesel::connection::SimpleConnection;
    /// use diesel_lock::Locker;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = dir.path().join("locks.db").display().to_string();
    /// let locker = Locker::connect(&url)?.build()?;
    /// let mut conn = locker.pool().get()?;
    /// conn.batch_execute("CREATE TABLE IF NOT EXISTS jobs (id INTEGER PRIMARY KEY)")?;
    /// # Ok(()) }
    /// ```
    pub fn pool(&self) -> &Pool<ConnectionManager<C>> {
        &self.inner.pool
    }

    /// The error for a connection the pool could not give: the driver's reason if the pool
    /// knows it, else whether this `Locker`'s own guards hold the pool's connections.
    pub(crate) fn pool_error(&self, e: r2d2::Error) -> crate::Error {
        let pool = &self.inner.pool;
        let state = pool.state();
        let full = state.connections >= pool.max_size() && state.idle_connections == 0;
        if !full {
            if let Some(why) = self
                .inner
                .failures
                .as_ref()
                .and_then(|f| f.recent(pool.connection_timeout()))
            {
                return why;
            }
        }
        let held_by_guards = self
            .inner
            .shared
            .guards_with_connections
            .load(Ordering::Relaxed)
            + self.inner.raw.connections_held();
        if full && held_by_guards > 0 {
            return crate::Error::PoolExhausted {
                size: pool.max_size(),
                held_by_guards,
            };
        }
        crate::Error::Pool(e)
    }

    /// Creates or upgrades the library's tables (embedded diesel migrations). Idempotent, and
    /// safe to call from many processes at once: they queue on a migration lock, and on
    /// PostgreSQL and SQLite all pending migrations commit in one transaction. Until the
    /// newest migration is applied, acquisitions return
    /// [`Error::MissingTable`](crate::Error::MissingTable) (a `Locker` checks this once, at
    /// its first acquisition, unless it migrated itself).
    ///
    /// # Errors
    /// [`Error::Pool`](crate::Error::Pool) without a connection,
    /// [`Error::Migration`](crate::Error::Migration) if the DDL fails (for example, missing
    /// privileges).
    ///
    /// # Examples
    /// ```
    /// use diesel_lock::{Error, Locker};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// let locker = Locker::builder(pool).build()?;
    /// assert!(matches!(locker.try_lock("k"), Err(Error::MissingTable(_))));
    /// locker.migrate()?;
    /// locker.migrate()?; // a second call finds nothing to do
    /// assert!(locker.try_lock("k")?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn migrate(&self) -> Result<()> {
        let mut conn = self.inner.pool.get().map_err(|e| self.pool_error(e))?;
        conn.sql().run_migrations()?;
        self.inner.schema_current.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Waits as long as it takes, then returns the guard.
    ///
    /// If this method returns `Ok`, the lock is held until the guard is dropped or released
    /// (or, for leases, until the heartbeat fails to renew it: see [`LockGuard::check`]).
    ///
    /// # Errors
    /// [`Error::InvalidKey`](crate::Error::InvalidKey) before any SQL runs;
    /// [`Error::Pool`](crate::Error::Pool) when no connection can be had in the pool's
    /// `connection_timeout` ([`Error::Connection`](crate::Error::Connection), naming the
    /// driver's reason, from a `Locker` built by [`Locker::connect`];
    /// [`Error::PoolExhausted`](crate::Error::PoolExhausted) when this `Locker`'s own guards
    /// hold the pool's connections); [`Error::MissingTable`](crate::Error::MissingTable)
    /// before `migrate`; [`Error::Database`](crate::Error::Database) for other database
    /// failures. Contention is never an error, and neither is a connection lost while waiting
    /// (a database restarting, a network cut): the wait tries again with a new connection
    /// until the deadline, logging one warning per outage. Only a `Locker` that has never
    /// reached the database (no acquisition or `migrate` yet) whose pool cannot connect on
    /// its first attempt returns at once: a wrong URL, or a database down from the start.
    ///
    /// # Examples
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let guard = locker.lock("nightly-report")?;
    /// // ... the work only one process may do ...
    /// guard.release()?;
    /// # Ok(()) }
    /// ```
    pub fn lock(&self, key: &str) -> Result<LockGuard<C>> {
        match self.exclusive(key, Deadline::Never, None)? {
            Some(guard) => Ok(guard),
            None => unreachable!("waiting without a deadline only ends with the lock"),
        }
    }

    /// One attempt: `Ok(None)` when someone else holds the key. It never waits for the lock,
    /// and for a pooled connection only briefly: up to a second for one being opened (at most
    /// the pool's `connection_timeout`), 20 ms for one to come back to a pool whose
    /// connections are all taken.
    ///
    /// # Errors
    /// As for [`lock`](Self::lock); the pool's errors come after that brief wait.
    ///
    /// # Examples
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let first = locker.try_lock("k")?.expect("free");
    /// assert!(locker.try_lock("k")?.is_none()); // not reentrant
    /// drop(first);
    /// assert!(locker.try_lock("k")?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn try_lock(&self, key: &str) -> Result<Option<LockGuard<C>>> {
        self.exclusive(key, Deadline::Once, None)
    }

    /// Waits at most `timeout`: `Ok(None)` when the deadline passes.
    ///
    /// With `ForUpdate` and `Advisory` the wait happens on the server, bounded by the time
    /// left, so a release hands the lock over at once and the deadline is kept within a
    /// round trip or so.
    /// Any length is accepted: a server that caps one wait (PostgreSQL's `lock_timeout` at
    /// about 24.8 days, `innodb_lock_wait_timeout` at 10⁸ s, `GET_LOCK` asked for at most a
    /// year) is asked again when that runs out, until the deadline.
    ///
    /// # Errors
    /// As for [`lock`](Self::lock); [`Error::Pool`](crate::Error::Pool) (or
    /// [`Error::PoolExhausted`](crate::Error::PoolExhausted)) also when the pool has no free
    /// connection before the deadline (every connection held elsewhere, e.g. by session
    /// strategies' guards: each keeps one); [`Error::Unreachable`](crate::Error::Unreachable)
    /// when the deadline passes while the last attempts could not reach the database (a
    /// server down or restarting, a network cut), with the last attempt's error as its
    /// source: `Ok(None)` always means that the key was found held.
    ///
    /// # Examples
    /// ```
    /// use std::time::Duration;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let held = locker.lock("k")?;
    /// assert!(locker.try_lock_for("k", Duration::from_millis(20))?.is_none()); // timed out
    /// std::thread::spawn(move || {
    ///     std::thread::sleep(Duration::from_millis(50));
    ///     drop(held); // released by another thread
    /// });
    /// assert!(locker.try_lock_for("k", Duration::from_secs(10))?.is_some()); // waited for it
    /// # Ok(()) }
    /// ```
    pub fn try_lock_for(&self, key: &str, timeout: Duration) -> Result<Option<LockGuard<C>>> {
        self.exclusive(key, Deadline::after(timeout), None)
    }

    /// Waits until `deadline` at the latest: `Ok(None)` when it passes. The same as
    /// [`try_lock_for`](Self::try_lock_for), for callers that keep one deadline across
    /// several steps.
    ///
    /// # Errors
    /// As for [`try_lock_for`](Self::try_lock_for).
    ///
    /// # Examples
    /// ```
    /// use std::time::{Duration, Instant};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let deadline = Instant::now() + Duration::from_secs(2);
    /// let a = locker.try_lock_until("a", deadline)?.expect("free");
    /// let b = locker.try_lock_until("b", deadline)?.expect("free"); // what is left of the 2 s
    /// # drop((a, b));
    /// # Ok(()) }
    /// ```
    pub fn try_lock_until(&self, key: &str, deadline: Instant) -> Result<Option<LockGuard<C>>> {
        self.exclusive(key, Deadline::At(deadline), None)
    }

    /// Waits until `deadline` (`None`: as long as it takes) unless `cancel` is cancelled
    /// first, from another thread: `Ok(None)` then, without the lock. The wait keeps its
    /// place in line throughout: in the `Locker`'s own queue and, for `ForUpdate` and
    /// `Advisory`, in the server's lock queue (one call waits on the server until the
    /// deadline; no call is repeated in slices). `Advisory` waiters get the lock in the order
    /// they came, on PostgreSQL and MariaDB; `ForUpdate` waiters on PostgreSQL only the first
    /// two of them (each holder updates the row it locked, and the waiters behind the next
    /// one then compete for the new row version anew). A cancelled server-side wait is ended by ending its database session from
    /// another pooled connection (`pg_terminate_backend`, `KILL CONNECTION`: the same
    /// database user may always do this), so cancelling needs a free connection in the pool
    /// for that moment. See [`Cancel`] for an example.
    ///
    /// # Errors
    /// As for [`try_lock_for`](Self::try_lock_for).
    ///
    /// # Examples
    /// ```
    /// use diesel_lock::Cancel;
    /// use std::time::{Duration, Instant};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let cancel = Cancel::new(); // never cancelled here: see `Cancel` for that
    /// let held = locker.lock("k")?;
    /// let soon = Instant::now() + Duration::from_millis(20);
    /// assert!(locker.try_lock_cancellable("k", Some(soon), &cancel)?.is_none()); // deadline
    /// drop(held);
    /// assert!(locker.try_lock_cancellable("k", None, &cancel)?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn try_lock_cancellable(
        &self,
        key: &str,
        deadline: Option<Instant>,
        cancel: &Cancel,
    ) -> Result<Option<LockGuard<C>>> {
        let deadline = deadline.map_or(Deadline::Never, Deadline::At);
        self.exclusive(key, deadline, Some(cancel))
    }

    /// The strategy's exclusive lock, through the nests of a reentrant `Locker`.
    fn exclusive(
        &self,
        key: &str,
        deadline: Deadline,
        cancel: Option<&Cancel>,
    ) -> Result<Option<LockGuard<C>>> {
        let shared = &self.inner.shared;
        let Some(nests) = &shared.nests else {
            return self.acquire(&*self.inner.raw, key, deadline, cancel);
        };
        crate::key::validate(key)?;
        if let Some(taken) = nests.nested(key) {
            return Ok(Some(LockGuard::new(shared.clone(), key.to_owned(), taken)));
        }
        let guard = self.acquire(&*self.inner.raw, key, deadline, cancel)?;
        Ok(guard.map(|g| g.map_taken(|taken| nests.first(key, taken))))
    }

    /// How many guards of this `Locker` its loss watcher watches now (tests and reports;
    /// not a stable API).
    #[doc(hidden)]
    pub fn __watched(&self) -> usize {
        self.inner.shared.watcher.watched()
    }

    /// Deletes the rows of this `Locker`'s strategy that only take up space, and returns how
    /// many it deleted. It is safe beside live locks of every configuration: it deletes
    /// nothing a holder could still count on, and tokens keep growing across it.
    ///
    /// - `Lease`: lease rows free, or expired, for at least `idle`, with no live reader,
    ///   permit or waiter (and the key's kind, its number of permits, with them), and the rows
    ///   of readers, writers and permits expired for at least `idle`. The purge never waits
    ///   for such a row that another transaction holds (a client stopped inside one): it
    ///   leaves it, uncounted, for the next purge.
    /// - `Row`: rows past their *own* `stale_after` (never a row inserted without one);
    ///   `idle` is not used.
    /// - `Row` and `Lease`: the token counters of keys nobody holds.
    /// - `ForUpdate` (PostgreSQL, MySQL): the key rows (`dlock_for_update`) that no holder's
    ///   transaction has locked, and the reader-writer kinds left without anything of their
    ///   key, each only if made at least `idle` ago (the grace); semaphores keep their kind
    ///   and slots. An acquisition whose row a purge deletes under it makes it again (up to
    ///   16 times per attempt, then busy for that attempt); a grace of a minute or more
    ///   keeps that churn away from keys in use. With `idle` zero and purges in a loop, a
    ///   `try_lock` of a key nobody held answered busy about 3 times in 10,000 on MariaDB
    ///   (an adversary's count, 28 Nov; `try_lock_for` tries again and did not). Tokens
    ///   come from the global source.
    /// - `Advisory`, `AdvisoryXact`: nothing.
    /// - every strategy with a line of waiters: places whose waiter died.
    ///
    /// So after a purge the lock tables hold rows for the keys held (and waited for) only,
    /// however many keys were ever used. Tokens keep increasing per key: the purge first
    /// raises a token floor above every counter it deletes (and commits that), and a key
    /// without a counter starts above the floor. It deletes in batches of 1,000 keys, each a
    /// short transaction, so an acquisition meeting it waits one batch at most; it scans the
    /// tables: run it now and then (`dlock purge` from cron), not on every lock. How it stays
    /// safe beside acquisitions is in ARCHITECTURE.md.
    ///
    /// # Errors
    /// [`Error::Pool`](crate::Error::Pool) without a connection,
    /// [`Error::Database`](crate::Error::Database) if a statement fails.
    ///
    /// # Examples
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// use std::time::Duration;
    ///
    /// locker.lock("k")?.release()?;
    /// let deleted = locker.purge(Duration::ZERO)?; // leases free for any time at all
    /// assert_eq!(deleted, 1);
    /// assert!(locker.lock("k")?.token() > 1); // the token carried on
    /// # Ok(()) }
    /// ```
    pub fn purge(&self, idle: Duration) -> Result<u64> {
        let n = self.inner.raw.purge(idle)?;
        log::debug!("purge: {n} rows deleted");
        Ok(n as u64)
    }

    /// The strategy this `Locker` uses.
    ///
    /// ```
    /// use diesel_lock::{Locker, Strategy};
    /// use std::time::Duration;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// let row = Strategy::Row { stale_after: Some(Duration::from_secs(60)) };
    /// let locker = Locker::builder(pool).strategy(row).build()?;
    /// assert_eq!(locker.strategy(), row);
    /// assert_eq!(locker.strategy().name(), "row");
    /// # Ok(()) }
    /// ```
    pub fn strategy(&self) -> Strategy {
        self.inner.strategy
    }

    /// The owner name stored with each lock.
    ///
    /// ```
    /// use diesel_lock::Locker;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// let named = Locker::builder(pool.clone()).owner("billing-7").build()?;
    /// assert_eq!(named.owner(), "billing-7");
    /// let unnamed = Locker::builder(pool).build()?; // host:pid:random
    /// assert!(unnamed.owner().contains(&format!(":{}:", std::process::id())));
    /// # Ok(()) }
    /// ```
    pub fn owner(&self) -> &str {
        &self.inner.shared.owner
    }

    /// The backend behind the pool.
    ///
    /// ```
    /// use diesel_lock::{Backend, Locker};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let path = dir.path().join("l.db");
    /// let locker = Locker::connect(path.to_str().unwrap())?.build()?; // a file path: SQLite
    /// assert_eq!(locker.backend(), Backend::Sqlite);
    /// # Ok(()) }
    /// ```
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }
}
