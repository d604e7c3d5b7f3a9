//! The strategies, a folder each, behind one seam: [`RawLock`] (in the spirit of
//! `lock_api::RawMutex`) is what a strategy does with a key (one attempt, and what it needs
//! from the `Locker`: server-side waits and their interruption, release notifications,
//! purge, and the raw locks of its other modes: readers, writers, permits), and [`Hold`] is
//! what a guard keeps (release, check). [`build`] turns the public [`Strategy`] value into
//! its `RawLock` once, checking the strategy's own options; nothing else matches on the
//! strategy. Waiting, deadlines, cancellation and the in-process queue are written once in
//! `locker/`, the guard in `guard.rs`.
//!
//! A new strategy is a new folder here with its `RawLock` and `Hold`, one arm in `build` (and
//! in `Strategy::name` and `check_every`), and its statements in each backend folder:
//! ARCHITECTURE.md lists every place.

use crate::backend::{Backend, LockConnection, Sql, Wait};
pub(crate) use crate::hold::{Hold, Taken};
use crate::{Error, Result};
use diesel::r2d2::ConnectionManager;
use std::time::Duration;

// A strategy is a folder: its `RawLock` and `Hold`, and the raw locks of the modes it has.
// `session` and `session_permits` are what the session strategies share.
mod advisory;
mod advisory_xact;
mod for_update;
mod lease;
mod purge;
mod row;
pub(crate) mod session;
mod session_permits;

pub(crate) use session::Pooled;
use std::sync::Arc;

/// How a lock is kept in the database. All strategies give the same
/// [`LockGuard`](crate::LockGuard) and the same guarantees of mutual exclusion and fencing
/// tokens; they differ in what happens when a holder crashes and in what they cost.
///
/// | strategy | PostgreSQL | MySQL / MariaDB | SQLite | a crashed holder's lock | release |
/// |---|---|---|---|---|---|
/// | `Row` | ✓ | ✓ | ✓ | stays until `stale_after` (or forever without it) | `DELETE` |
/// | `Lease` | ✓ | ✓ | ✓ | free once `ttl` has passed without renewal | `UPDATE` |
/// | `ForUpdate` | ✓ | ✓ | refused | free as soon as the server sees the session end | `COMMIT` |
/// | `Advisory` | ✓ | ✓ | refused | free as soon as the server sees the session end | one unlock |
/// | `AdvisoryXact` | ✓ | refused | refused | free as soon as the server sees the session end | `COMMIT` |
///
/// The session strategies (`ForUpdate`, `Advisory`, `AdvisoryXact`) keep the lock in a
/// database session, waiting happens in the server's lock queue, and a deadline is enforced
/// there too. A `ForUpdate` or `AdvisoryXact` guard owns one pooled connection, with its
/// open transaction, for its whole life: a lock per transaction, by nature (size the pool
/// for the locks held at once plus the waiters). `Advisory` guards of one `Locker` share a
/// few sessions instead (see [`Advisory`](Self::Advisory)): 10⁴ locks fit on a pool of 8. `ForUpdate` and `AdvisoryXact` keep it
/// in a transaction the guard holds open, which works behind a transaction-pooling
/// PgBouncer; `Advisory` does not (docs/guide.md, "Behind a connection pooler"). A Galera node
/// refuses `ForUpdate` and `Advisory` (their locks are local to one node).
///
/// One lock per key: on every strategy with readers or semaphores, the key's exclusive lock
/// ([`Locker::lock`](crate::Locker::lock), and [`Locker::write`](crate::Locker::write),
/// which is the same lock) excludes the key's readers and permit holders, and they exclude
/// it: `Lease` on every backend, `ForUpdate` on PostgreSQL and MySQL, `Advisory` on
/// PostgreSQL. `Advisory` on MySQL refuses readers and permits (`GET_LOCK` has no shared
/// mode); `Row` and `AdvisoryXact` have neither.
///
/// Tokens of `Row` and `Lease` count per key (a `Lease` key's readers and permits draw
/// from the same counter as its exclusive lease); those of the session strategies come from one
/// global source, so a key's tokens strictly increase but skip values other keys took. Every
/// strategy's tokens keep increasing across a crash of the server and across a failover,
/// even to a standby that lagged (they carry the server's epoch); mutual exclusion is as
/// durable as the server's commits. A guard's connection goes back to the pool only if its
/// release worked; otherwise it is closed, which makes the server free a session lock.
///
/// The details: what each does on a holder's crash, a network partition and a failover,
/// measured, and how tokens are drawn, are in `docs/server-strategies.md` and
/// `docs/replication.md` (in the repository), and `docs/guide.md`.
///
/// # Examples
/// On SQLite, `Row` and `Lease`:
/// ```
/// use diesel_lock::{Error, Locker, Strategy};
/// use std::time::Duration;
///
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
/// let ttl = Duration::from_secs(10);
/// let lease = Locker::builder(pool.clone()).strategy(Strategy::Lease { ttl }).build()?;
/// lease.migrate()?;
/// let row = Locker::builder(pool.clone()).strategy(Strategy::Row { stale_after: None }).build()?;
/// // Locks of different strategies do not exclude each other: give a key one strategy.
/// let (_a, _b) = (lease.lock("k")?, row.lock("k")?);
/// let for_update = Locker::builder(pool).strategy(Strategy::ForUpdate).build();
/// assert!(matches!(for_update, Err(Error::Unsupported { .. })));
/// # Ok(()) }
/// ```
///
/// On PostgreSQL (or MySQL), a session strategy:
/// ```no_run
/// use diesel_lock::{Locker, Strategy};
/// use std::time::Duration;
///
/// # fn main() -> diesel_lock::Result<()> {
/// let locker = Locker::connect("postgres://app@db/app")?
///     .strategy(Strategy::Advisory)
///     .build()?;
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
    ///
    /// Readers and permits are leases of their own (one row per holder), and the key's lease
    /// row carries the latest expiry among them: the exclusive lease (which is also the
    /// writer) is taken only once that has passed, still in one statement, and a reader or
    /// permit only while no exclusive lease is live and no exclusive waiter is in the key's
    /// line. Migration 12 made it so; older builds' lease statements fail on tables it
    /// migrated (`MissingTable`), so upgrade every process sharing the tables together.
    /// A reader's or permit's acquisition is a short transaction holding the key's rows
    /// locked: the server ends it, and its session, once it has sat idle for a quarter of the
    /// ttl (at most 2 s; PostgreSQL and MariaDB, not MySQL proper, which has no such
    /// timeout), so that a client stopped inside it cannot stall the key's holders; each
    /// wait for those rows lasts at most 1 s (then busy, and the wait goes on to its
    /// deadline). See the guide, "Shared locks".
    ///
    /// The guard also keeps a deadline of its own, so that it says "lost" before any other
    /// client can take the key even when the database cannot be reached (a partition, where
    /// statements hang): the ttl less 1 % and 1 ms, counted from the instant just before the
    /// last successful acquisition or renewal was *sent*. The database's count can only
    /// start later, so network delay needs no allowance; the 1 % covers the two clocks
    /// running at different rates (twenty times the 500 ppm by which NTP may slew each), the
    /// 1 ms SQLite's millisecond timestamps. A step of the database server's wall clock is
    /// not covered. Past that deadline [`check`](crate::LockGuard::check) returns
    /// `LockLost` without waiting for the database, and a renewal that succeeds later does
    /// not change that: once lost, always lost.
    Lease {
        /// How long the lease lasts without renewal. At least 1 ms.
        ttl: Duration,
    },
    /// `SELECT … FOR UPDATE` on the key's row (in `dlock_for_update`, created on first use)
    /// inside a transaction the guard keeps open; release = COMMIT. `try_lock` uses
    /// `NOWAIT`; `try_lock_for` waits on the server under `lock_timeout` (PostgreSQL) or
    /// `innodb_lock_wait_timeout` (MySQL, whole seconds, the fraction by `NOWAIT` retries).
    /// The token is drawn by the locking statement once the row is locked, from the global
    /// source described above, which the holder's rollback does not undo: a dead holder's
    /// token is never issued again, nor is one handed out before a crash of the database
    /// server. The holder's transaction commits asynchronously on PostgreSQL (nothing in it
    /// needs to survive a crash). PostgreSQL and MySQL only: `build` returns
    /// [`Error::Unsupported`] on SQLite.
    ///
    /// Readers ([`Locker::read`](crate::Locker::read)) lock the row `FOR SHARE` (MySQL:
    /// `LOCK IN SHARE MODE`) in the same way, each with a token from the same source; writers
    /// ([`Locker::write`](crate::Locker::write)) are this strategy's `FOR UPDATE`, and on
    /// PostgreSQL mark the key while they wait so that new readers let them in. Semaphores
    /// ([`Locker::permit`](crate::Locker::permit)) keep one row per permit, of which a holder
    /// locks the first free one (`FOR UPDATE SKIP LOCKED`), beside the key's row `FOR SHARE`
    /// as a reader locks it; at most 1,000 permits.
    ForUpdate,
    /// PostgreSQL `pg_advisory_lock` family / MySQL `GET_LOCK`, held by a session of the
    /// `Locker`'s. PostgreSQL and MySQL only: `build` returns [`Error::Unsupported`] on SQLite.
    ///
    /// **Shared sessions.** The exclusive locks (`lock`, `write`) of one `Locker` are held on
    /// a few of its pool's connections, many locks per session, each released on its own
    /// (`pg_advisory_unlock` / `RELEASE_LOCK`): at most half the pool, and at most 4; a
    /// session is opened when those open are busy or hold many locks, and goes back to the
    /// pool once it holds none. A try (`try_lock`, and the first attempt of every wait) runs
    /// on a shared session; a wait in the server's queue runs on a session of its own, so
    /// that nothing waits behind it, and the lock it wins stays on that session, which joins
    /// the shared ones while fewer are open (else it stays the guard's own, as a
    /// cancellable wait's always does). A process's death still frees every lock at once
    /// (the server ends its sessions); a shared session that ends (killed, a network cut, a
    /// restart) ends every lock on it, and every guard on it reports the loss ([`check`],
    /// the loss watch), each key free for others. [`check`] costs one query per session
    /// (the session is alive, and the same one); a loss watch's probes of many guards on one
    /// session share one query each round. Readers and permits keep a session each.
    ///
    /// [`check`]: crate::LockGuard::check
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
    /// The token is drawn in the same statement as the lock, once it is granted, from the
    /// global source described above: no write and no flush of its own.
    ///
    /// Readers, writers and semaphores: PostgreSQL only. Readers hold
    /// `pg_advisory_lock_shared` of the key; a permit holds one advisory lock per permit (on
    /// the hash of the key and the permit's number, tried in turn; at most 1,000 permits)
    /// beside the key's shared one. MySQL's `GET_LOCK` has no shared mode, so neither could
    /// keep the key's exclusive lock out: readers are [`Error::Unsupported`], permits
    /// [`Error::Incompatible`].
    ///
    /// Behind a transaction-pooling PgBouncer use `AdvisoryXact` (or `ForUpdate`, `Row`,
    /// `Lease`) instead: the pooler hands the session that holds an `Advisory` lock to other
    /// clients, and cannot be detected from the connection.
    Advisory,
    /// PostgreSQL `pg_advisory_xact_lock`, held by a transaction that the guard keeps open;
    /// release = COMMIT. The same keys as [`Advisory`](Self::Advisory) (the two strategies
    /// exclude each other on a key), the same waits (`pg_try_advisory_xact_lock` for
    /// `try_lock`, `lock_timeout` for `try_lock_for`) and the same fencing tokens, drawn by
    /// the locking statement once the lock is granted; a token that may not go out yet (a
    /// new life of the server, a bound to raise) is rolled back, made ready outside the
    /// transaction and drawn again, as `ForUpdate` does. The holder's transaction commits
    /// asynchronously (nothing in it needs to survive a crash).
    ///
    /// The strategy for a transaction-pooling PgBouncer (`pool_mode = transaction`): the
    /// transaction keeps its server session for as long as the guard lives, and the lock
    /// ends with the transaction, never left behind on a pooled server session. Like
    /// `ForUpdate` it keeps a transaction open while held (PostgreSQL's
    /// `idle_in_transaction_session_timeout`, if set, ends it, and [`check`](crate::LockGuard::check)
    /// then reports the lock lost; a long open transaction holds back vacuum's horizon).
    ///
    /// PostgreSQL only: `build` returns [`Error::Unsupported`] on MySQL, whose `GET_LOCK`
    /// belongs to the session whatever transaction is open (it has no lock that ends with a
    /// transaction), and on SQLite.
    ///
    /// ```no_run
    /// use diesel_lock::{Locker, Strategy};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// // Through PgBouncer in transaction mode: dlock_pooler turns diesel's statement cache off.
    /// let pool = diesel_lock::connect("postgres://app@pgbouncer:6432/app?dlock_pooler=transaction")?;
    /// let locker = Locker::builder(pool).strategy(Strategy::AdvisoryXact).build()?;
    /// locker.migrate()?;
    /// let guard = locker.lock("billing-run")?; // a transaction of its own, kept open
    /// guard.release()?; // COMMIT
    /// # Ok(()) }
    /// ```
    AdvisoryXact,
}

impl Default for Strategy {
    /// `Lease { ttl: 30 s }`.
    ///
    /// ```
    /// use diesel_lock::Strategy;
    /// use std::time::Duration;
    ///
    /// assert_eq!(Strategy::default(), Strategy::Lease { ttl: Duration::from_secs(30) });
    /// ```
    fn default() -> Self {
        Strategy::Lease {
            ttl: Duration::from_secs(30),
        }
    }
}

impl Strategy {
    /// The strategy's name, as used in messages and by the CLI.
    ///
    /// ```
    /// use diesel_lock::Strategy;
    ///
    /// assert_eq!(Strategy::ForUpdate.name(), "for-update");
    /// assert_eq!(Strategy::default().name(), "lease"); // as in `dlock run --strategy lease`
    /// ```
    pub fn name(&self) -> &'static str {
        self.kind().as_str()
    }

    /// The strategy without its settings.
    ///
    /// ```
    /// use diesel_lock::{Strategy, StrategyKind};
    ///
    /// assert_eq!(Strategy::default().kind(), StrategyKind::Lease);
    /// ```
    pub fn kind(&self) -> crate::StrategyKind {
        use crate::StrategyKind;
        match self {
            Strategy::Row { .. } => StrategyKind::Row,
            Strategy::Lease { .. } => StrategyKind::Lease,
            Strategy::ForUpdate => StrategyKind::ForUpdate,
            Strategy::Advisory => StrategyKind::Advisory,
            Strategy::AdvisoryXact => StrategyKind::AdvisoryXact,
        }
    }
}

impl Strategy {
    /// How often a holder that must notice a lost lock in time should call
    /// [`LockGuard::check`](crate::LockGuard::check) if it polls (rather than being told by
    /// [`LockGuard::loss_watch`](crate::LockGuard::loss_watch), as `dlock run` is): a third of a lease's
    /// ttl (renewals run at that pace too), a third of a row's `stale_after` but at most 5 s,
    /// 1 s for the session strategies (a cheap query on the holding session), else 5 s.
    ///
    /// ```
    /// use diesel_lock::Strategy;
    /// use std::time::Duration;
    ///
    /// let lease = Strategy::Lease { ttl: Duration::from_secs(30) };
    /// assert_eq!(lease.check_every(), Duration::from_secs(10));
    /// assert_eq!(Strategy::Advisory.check_every(), Duration::from_secs(1));
    /// ```
    pub fn check_every(&self) -> Duration {
        match *self {
            Strategy::Lease { ttl } => ttl / 3,
            Strategy::Row {
                stale_after: Some(s),
            } => (s / 3).min(Duration::from_secs(5)),
            Strategy::Row { stale_after: None } => Duration::from_secs(5),
            Strategy::ForUpdate | Strategy::Advisory | Strategy::AdvisoryXact => {
                Duration::from_secs(1)
            }
        }
    }

    /// How long a holder may go without a successful [`check`](crate::LockGuard::check)
    /// before it must presume its lock lost even though it could not ask (the database out of
    /// reach): a lease's ttl, after which the lease has run out unrenewed. `None` for the
    /// other strategies, whose locks do not lapse by time alone while their holder lives (a
    /// row is taken over only past its `stale_after`, which the holder cannot outlive
    /// unnoticed while checks succeed; a session's lock ends with the session, which its
    /// next check sees).
    ///
    /// ```
    /// use diesel_lock::Strategy;
    /// use std::time::Duration;
    ///
    /// let ttl = Duration::from_secs(30);
    /// assert_eq!(Strategy::Lease { ttl }.expires_after(), Some(ttl));
    /// assert_eq!(Strategy::ForUpdate.expires_after(), None);
    /// ```
    pub fn expires_after(&self) -> Option<Duration> {
        match *self {
            Strategy::Lease { ttl } => Some(ttl),
            _ => None,
        }
    }
}

/// The pool every part of a `Locker` shares.
pub(crate) type Pool<C> = r2d2::Pool<ConnectionManager<C>>;

/// What `build` gives a strategy: the `Locker`'s settings that strategies use.
pub(crate) struct Setup<C: LockConnection> {
    pub(crate) pool: Pool<C>,
    pub(crate) owner: String,
    pub(crate) backend: Backend,
    /// `LockerBuilder::heartbeat`, if it was set (only `Lease` has a heartbeat).
    pub(crate) heartbeat: Option<Duration>,
    /// `LockerBuilder::max_backoff`: the longest pause between a waiter's attempts.
    pub(crate) max_backoff: Duration,
}

/// Turns the public `Strategy` into its raw lock (which builds the raw locks of its other
/// modes, `RawLock::mode`), checking its options and that the backend can honour it. The
/// only `match` on the strategy outside `Strategy::name` and its durations.
pub(crate) fn build<C: LockConnection>(
    strategy: Strategy,
    setup: Setup<C>,
) -> Result<Arc<dyn RawLock<C>>> {
    Ok(match strategy {
        Strategy::Row { stale_after } => Arc::new(row::RowLock::new(setup, stale_after)?),
        Strategy::Lease { ttl } => Arc::new(lease::LeaseLock::new(setup, ttl)?),
        Strategy::ForUpdate => Arc::new(for_update::ForUpdateLock::new(setup, strategy)?),
        Strategy::Advisory => Arc::new(advisory::AdvisoryLock::new(setup, strategy)?),
        Strategy::AdvisoryXact => Arc::new(advisory_xact::AdvisoryXactLock::new(setup, strategy)?),
    })
}

/// What one strategy does with a key. One impl per strategy file.
pub(crate) trait RawLock<C: LockConnection>: Send + Sync + 'static {
    /// One attempt on `conn`. `retry` is true when an earlier attempt by this caller failed;
    /// `wait` is how long the attempt may wait on the server, which only strategies with an
    /// [`interrupter`](Self::interrupter) use. Contention is `Ok(None)`, never an
    /// error. Session strategies take `conn` out of its slot for the guard; otherwise the
    /// waiting code puts it back in the pool, once no cancellation can reach its session.
    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        retry: bool,
        wait: Wait,
    ) -> Result<Option<Taken>>;

    /// For a strategy whose attempts wait in the server's lock queue (as `wait` allows):
    /// something that, called from another thread, ends such a wait running on `conn` (by
    /// ending its session). Asked before each cancellable attempt that may wait; `None`
    /// (the default, no I/O) for strategies that never wait on the server.
    fn interrupter(&self, _conn: &mut Conn<C>) -> Result<Option<Interrupter>> {
        Ok(None)
    }

    /// `Locker::purge`: deletes what only takes up space; the number of rows deleted.
    fn purge(&self, _idle: Duration) -> Result<usize> {
        Ok(0)
    }

    /// The caller stopped waiting for `key` without the lock (its deadline passed, it was
    /// cancelled, an error): undo what the attempts left for others to see (a `ForUpdate`
    /// writer's mark). Not called after a single attempt (`try_lock`).
    fn gave_up(&self, _key: &str) {}

    /// False for a lock that others may hold beside its holder (a reader, a semaphore
    /// permit): the waiting code then does not tell the key's local waiters that only its
    /// release can help them.
    fn exclusive(&self) -> bool {
        true
    }

    /// The raw lock of `mode`, a kind of lock beside the strategy's own exclusive one (see
    /// [`Mode`]), built with the strategy; `Ok(None)` where the strategy, or the backend it
    /// runs on, has no such kind (the `Locker` then reports `Error::Unsupported`).
    fn mode(&self, _mode: Mode) -> Result<Option<ModeLock<C>>> {
        Ok(None)
    }

    /// One try (no wait) that needs no connection of the attempt's own: `Advisory` tries on
    /// a session it shares between its guards. `None` (the default): the strategy tries on
    /// the attempt's connection, through [`try_acquire`](Self::try_acquire).
    fn try_without_connection(&self, _key: &str) -> Option<Result<Option<Taken>>> {
        None
    }

    /// How many pooled connections the strategy keeps for its guards beside those the
    /// guards keep themselves (`Advisory`'s shared sessions), for the error of an exhausted
    /// pool.
    fn connections_held(&self) -> usize {
        0
    }

    /// The line its waiters take places in (`dlock_waiters`, `locker/line.rs`): `Row`'s,
    /// `Lease`'s, and the session strategies' semaphores', whose waiters would otherwise
    /// poll in no order. `None`: the strategy's waiters wait in the server's own lock queue,
    /// and need no line.
    fn line(&self) -> Option<crate::backend::Line> {
        None
    }

    /// Whether waiters line up in the database (`line`).
    fn lines(&self) -> bool {
        self.line().is_some()
    }

    /// For a lock that `lines`: a waiter's look at its place `id` in `line` (`Lines::line_look`),
    /// which a strategy whose grant the waiter reads (`Lease`) widens to read it too, in the
    /// same statement (`Lines::line_look_lease`, `Spot::lease`).
    fn look(
        &self,
        conn: &mut C,
        key: &str,
        line: crate::backend::Line,
        id: i64,
        floor: i64,
        _holder: &str,
    ) -> diesel::QueryResult<Option<crate::backend::Spot>> {
        conn.sql().line_look(key, line, id, floor)
    }

    /// For a lock that `lines`: takes a grant of the key to place `place` (taken with
    /// `holder`) that needs no statement (`Lease`: what the grant gave is in `grant.lease`,
    /// and the heartbeat confirms it), with no connection; `None` where the grant needs its
    /// confirmation first (`Row`: the attempt confirms it) or `grant.lease` is unknown.
    fn take_grant(&self, _key: &str, _place: i64, _holder: &str, _grant: Grant) -> Option<Taken> {
        None
    }

    /// Gives back the key a release may have granted to a place taken with `holder`, whose
    /// waiter gave up (its place is already removed): released as the strategy releases,
    /// which hands it on to the next place. Nothing where it holds nothing.
    fn give_back(&self, _conn: &mut C, _key: &str, _holder: &str) -> Result<()> {
        Ok(())
    }

    /// For a lock that `lines`: whether its key has a `Lease` row that its line marks as
    /// waited for (`Lines::line_join`'s `flag`): true for `Lease` and its readers and permits.
    fn flags_line(&self) -> bool {
        false
    }

    /// For a lock that `lines`: whether its acquisition removes the waiter's place itself
    /// (in the acquiring statement or transaction: `Row`, `Lease`, `Lease` readers and
    /// permits, `Advisory` permits). False for `ForUpdate` permits, whose acquisition is
    /// held in an open transaction: the waiting code gives the place up right after, from
    /// another pooled connection.
    fn removes_place(&self) -> bool {
        true
    }

    /// For a lock that is not `exclusive` and `lines`: how many holders of its kind the key
    /// may have at once (a semaphore's permits; `u32::MAX` for readers). A waiter of this
    /// kind tries as soon as fewer live places than that are ahead of it and none of them is
    /// an exclusive waiter's (the acquisition then decides, counting the free permits): a
    /// release of several permits lets as many waiters in at once, and readers all
    /// together. Not asked of exclusive locks, whose waiter tries only when first.
    fn room(&self) -> u32 {
        1
    }
}

/// The kinds of lock beside a strategy's own exclusive one (`Locker::read`, `write`,
/// `permit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// One of many readers of a reader-writer lock.
    Read,
    /// The writer of a reader-writer lock.
    Write,
    /// One of at most this many holders of a semaphore (at least one: the `Locker` checks).
    Permits(u32),
}

/// What [`RawLock::mode`] answers: the strategy's own exclusive lock (a writer that is the
/// same lock as `lock`), or a raw lock of the mode's own.
pub(crate) enum ModeLock<C: LockConnection> {
    Own,
    Other(Arc<dyn RawLock<C>>),
}

/// Ends another thread's server-side wait; see [`RawLock::interrupter`]. It runs in two
/// steps, so that the caller can check in between that the wait is still under way: `prepare`
/// (what may block, such as taking a pooled connection) returns the `end` step, which ends
/// the session.
pub(crate) type Interrupter = Box<dyn Fn() -> Option<Box<dyn FnOnce() + Send>> + Send + Sync>;

/// The pooled connection of one attempt. It goes back to the pool only when the waiting code
/// drops it, after it has made sure that no cancellation can reach its session any more (a
/// late one would otherwise end the session of whoever took the connection next, perhaps
/// holding another lock). A strategy whose guard keeps the connection
/// takes it out with [`take`](Self::take).
///
/// It also carries what a strategy that waits inside a transaction needs to let a
/// cancellation end the right session ([`session::TxnTarget`]).
/// A grant of the key to the caller's place: the database's expiry of the place, the
/// grant's deadline to confirm by, is no earlier than `renewed` (when the place's last join
/// or renewal was sent) plus `ttl`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grant {
    pub(crate) renewed: std::time::Instant,
    pub(crate) ttl: Duration,
    /// `Lease`: what the grant gave, as the look that saw it read it (`Spot::lease`); `None`
    /// if that look did not read it (then the attempt does).
    pub(crate) lease: Option<crate::backend::Acquired>,
}

pub(crate) struct Conn<C: LockConnection> {
    conn: Option<Pooled<C>>,
    target: Option<std::sync::Arc<session::TxnTarget>>,
    /// The caller's place in the key's line (`locker/line.rs`), or `NO_PLACE`: what the
    /// acquiring statements of strategies with a line (`RawLock::lines`) are given.
    pub(crate) place: i64,
    /// The holder id the caller's place was taken with (a grant names it), if it has one.
    pub(crate) holder: Option<String>,
    /// The caller's place was granted the key by a release: the attempt takes the grant
    /// (`Row`: confirms it, `Locks::row_confirm`; `Lease`: takes what the look that saw it
    /// read, `Grant::lease`, and its heartbeat confirms it, `lease_confirm`) instead of
    /// acquiring.
    pub(crate) granted: Option<Grant>,
    /// Whether a cancellation may end this attempt's session (the waiting code registered
    /// the strategy's interrupter): such a session must not be shared with other locks.
    pub(crate) cancellable: bool,
}

impl<C: LockConnection> Conn<C> {
    pub(crate) fn new(conn: Pooled<C>) -> Self {
        Conn {
            conn: Some(conn),
            target: None,
            place: crate::backend::NO_PLACE,
            holder: None,
            granted: None,
            cancellable: false,
        }
    }

    /// Takes the connection for a guard.
    pub(crate) fn take(&mut self) -> Pooled<C> {
        self.conn.take().expect("the connection was taken already")
    }

    /// The pooled connection back, for another attempt (`None` if a guard took it, or if
    /// it carries a transaction's target: such a one goes back to the pool on drop).
    pub(crate) fn into_pooled(mut self) -> Option<Pooled<C>> {
        match self.target {
            None => self.conn.take(),
            Some(_) => None,
        }
    }

    /// The connection, unless a guard took it.
    pub(crate) fn get_mut(&mut self) -> Option<&mut Pooled<C>> {
        self.conn.as_mut()
    }
}

impl<C: LockConnection> std::ops::Deref for Conn<C> {
    type Target = C;
    fn deref(&self) -> &C {
        self.conn.as_ref().expect("the connection was taken")
    }
}

impl<C: LockConnection> std::ops::DerefMut for Conn<C> {
    fn deref_mut(&mut self) -> &mut C {
        self.conn.as_mut().expect("the connection was taken")
    }
}

/// Refuses a duration option outside 1 ms to 100 years. Past a few thousand years the
/// databases' date arithmetic overflows (NULL on MySQL and SQLite, an error on PostgreSQL);
/// a century is plenty.
pub(crate) fn check_duration(d: Duration, what: &str) -> Result<()> {
    if d < Duration::from_millis(1) || d > MAX_DURATION {
        return Err(Error::InvalidConfig(format!(
            "{what} must be between 1 ms and 100 years"
        )));
    }
    Ok(())
}

/// The longest ttl or `stale_after` accepted: 100 years.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A duration in whole microseconds, as the SQL takes it.
pub(crate) fn micros(d: Duration) -> Option<i64> {
    i64::try_from(d.as_micros()).ok()
}

/// Runs one short statement on a pooled connection, retrying a few times if the database
/// reports contention (a deadlock victim's statement was rolled back, so running it again is
/// safe). Releases and renewals must not fail merely because a waiter collided with them.
pub(crate) fn with_conn<C: LockConnection, T>(
    pool: &Pool<C>,
    f: impl FnMut(&mut C) -> diesel::QueryResult<T>,
) -> Result<T> {
    with_pooled(pool.get()?, f)
}

/// `with_conn` on a connection taken already.
pub(crate) fn with_pooled<C: LockConnection, T>(
    mut conn: Pooled<C>,
    f: impl FnMut(&mut C) -> diesel::QueryResult<T>,
) -> Result<T> {
    crate::backoff::retry_contended(
        &mut *conn,
        Duration::from_millis(128),
        "a release or renewal",
        f,
        |c, e| c.sql().is_contention(e),
    )
    .map_err(Error::from)
}

/// Maps a contention error of one attempt to "busy".
pub(crate) fn contention_is_busy<C: LockConnection>(
    conn: &mut C,
    key: &str,
    attempt: Result<Option<Taken>>,
) -> Result<Option<Taken>> {
    match attempt {
        Err(Error::Database(e)) if conn.sql().is_contention(&e) => {
            log::debug!("lock {key:?}: contention ({e}); retrying");
            Ok(None)
        }
        other => other,
    }
}
