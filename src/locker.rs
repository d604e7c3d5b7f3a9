//! `Locker` and `LockerBuilder`: the waiting loop (deadlines, backoff, the in-process queue)
//! written once for every strategy.

use crate::backend::Sql;
use crate::backend::{Backend, LockConnection};
use crate::guard::LockGuard;
use crate::strategy::heartbeat::Heartbeat;
use crate::strategy::{self, Ctx, Strategy, Taken};
use crate::{key, random, Error, Result};
use diesel::r2d2::ConnectionManager;
use r2d2::Pool;
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Takes locks on string keys, keeping them in the database behind `pool`.
///
/// Cheap to clone (an `Arc`), `Send` and `Sync`: share one per strategy across threads.
///
/// # Fairness
/// Threads of one `Locker` waiting for the same key line up first-come first-served, and only
/// the first of them polls the database; a release by one of them wakes the next at once.
/// Waiters in other processes poll with exponential backoff and jitter (1 ms doubling up to
/// [`LockerBuilder::max_backoff`]), so across processes no order is promised.
///
/// # Differences from `std::sync::Mutex`
/// Locks are not reentrant: a second `try_lock` of a held key returns `Ok(None)`, even from the
/// same `Locker` and thread, and a second `lock` would wait forever. There is no poisoning:
/// a guard dropped during a panic releases its lock.
pub struct Locker<C: LockConnection> {
    inner: Arc<Inner<C>>,
}

pub(crate) struct Inner<C: LockConnection> {
    pool: Pool<ConnectionManager<C>>,
    strategy: Strategy,
    owner: String,
    backend: Backend,
    max_backoff: Duration,
    heartbeat: Heartbeat<C>,
    queues: Arc<Queues>,
    /// PostgreSQL with `listen_url`: the thread that hears other processes' releases.
    /// Dropped (and joined) with the last clone of the `Locker`.
    #[cfg(feature = "postgres")]
    listener: Option<crate::backend::pg_listen::Listener>,
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
            .field("owner", &self.inner.owner)
            .field("backend", &self.inner.backend)
            .finish_non_exhaustive()
    }
}

/// Configures a [`Locker`]. Made by [`Locker::builder`].
pub struct LockerBuilder<C: LockConnection> {
    pool: Pool<ConnectionManager<C>>,
    strategy: Strategy,
    owner: Option<String>,
    heartbeat: Option<Duration>,
    max_backoff: Duration,
    listen_url: Option<String>,
}

impl<C: LockConnection> std::fmt::Debug for LockerBuilder<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockerBuilder")
            .field("strategy", &self.strategy)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl<C: LockConnection> LockerBuilder<C> {
    /// The strategy used for every lock. Defaults to `Strategy::Lease { ttl: 30 s }`.
    pub fn strategy(mut self, strategy: Strategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// The owner name stored with each lock, for people reading the tables. Defaults to
    /// `host:pid:random`. Owner names need not be unique: releases are checked against a
    /// per-acquisition id, not against the owner.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// How often a held lease is renewed. Defaults to a third of the ttl. Must be shorter
    /// than the ttl. Ignored by strategies without leases.
    ///
    /// Renewals of different keys run side by side; each waits for a row lock held by
    /// another session at most a quarter of this (on MySQL whole seconds, at least 1; on
    /// SQLite the connection's `busy_timeout`) before it is retried, and renewals of healthy
    /// keys go before retries of stuck ones. So S keys stuck behind other sessions' row
    /// locks, on a pool of P connections, delay the `Locker`'s other renewals once, by about
    /// S/P such waits: the other leases survive while (S/P) × wait < ttl − interval. With the
    /// defaults that is S/P < 8 on PostgreSQL; on MySQL, whose wait is at least 1 s, S/P <
    /// (ttl − interval) / 1 s: with a ttl of 3 s, fewer than 2 stuck keys per connection
    /// (measured: 4 stuck keys on a pool of 2 lost 10 of 196 others; tested: 8 of 40 on a pool
    /// of 2 with a ttl of 9 s lose none). Not bounded: a wait for a
    /// *table* lock (`LOCK TABLE`, `VACUUM FULL`, an `ALTER TABLE` under way) or for a server
    /// that stopped answering; the guards then learn that their leases are lost once a ttl
    /// has passed without a renewal.
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = Some(every);
        self
    }

    /// The longest pause between two attempts while waiting. Defaults to 50 ms.
    ///
    /// With [`listen_url`](Self::listen_url) this is also how often a waiter looks
    /// regardless of notifications (a lost notification, a lease that expired).
    pub fn max_backoff(mut self, max: Duration) -> Self {
        self.max_backoff = max;
        self
    }

    /// PostgreSQL, `Row` and `Lease`: the URL of a connection the `Locker` opens for itself,
    /// outside the pool, to `LISTEN` for releases. Releases on PostgreSQL always send a
    /// notification (inside the releasing statement: no extra round trip); a `Locker` that
    /// listens wakes its waiters when one arrives, so a lock released by another process is
    /// taken within about a millisecond instead of at the waiter's next poll. Waiters still
    /// look every [`max_backoff`](Self::max_backoff), as notifications can be lost with a
    /// connection, and an expired lease notifies nobody.
    ///
    /// The listening connection is polled by a thread of the `Locker` (every 200 µs while it
    /// has waiters, every 100 ms otherwise; diesel offers no blocking wait), which ends when
    /// the last clone of the `Locker` is dropped. Should the connection fail, it is opened
    /// again and the waiters poll meanwhile.
    ///
    /// Defaults to none: waiters in other processes poll with backoff. Ignored on other
    /// backends and by the session strategies, which wait on the server.
    ///
    /// ```no_run
    /// use diesel::r2d2::{ConnectionManager, Pool};
    /// use diesel_lock::{Locker, Strategy};
    /// use std::time::Duration;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let url = "postgres://app@db/app";
    /// let pool = Pool::new(ConnectionManager::<diesel::PgConnection>::new(url))?;
    /// let locker = Locker::builder(pool)
    ///     .strategy(Strategy::Lease { ttl: Duration::from_secs(30) })
    ///     .listen_url(url)
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn listen_url(mut self, url: impl Into<String>) -> Self {
        self.listen_url = Some(url.into());
        self
    }

    /// Checks the configuration and builds the `Locker`.
    ///
    /// For [`AnyConnection`](crate::AnyConnection) pools this takes one connection from the
    /// pool to learn the backend. On MySQL it takes one to check that the pool's sessions
    /// commit each statement (`autocommit = 1`, as [`connect`](crate::connect) sets it):
    /// with autocommit off, every lock would stay uncommitted on its pooled connection.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a ttl or `stale_after` under 1 ms, a heartbeat not shorter
    /// than the ttl, an empty or oversized owner, a zero `max_backoff`, or a MySQL pool with
    /// autocommit off;
    /// [`Error::Unsupported`] for a strategy the backend cannot honour; [`Error::Pool`] if a
    /// connection was needed and none could be had.
    pub fn build(self) -> Result<Locker<C>> {
        let owner = self.owner.unwrap_or_else(random::default_owner);
        if owner.is_empty() || owner.len() > 255 || owner.contains('\0') {
            return Err(Error::InvalidConfig(
                "the owner must be 1 to 255 bytes without NUL".into(),
            ));
        }
        if self.max_backoff.is_zero() {
            return Err(Error::InvalidConfig("max_backoff must not be zero".into()));
        }
        let backend = match crate::backend::static_backend::<C>() {
            Some(b) => b,
            None => self.pool.get()?.sql().backend(),
        };
        self.strategy.validate(backend)?;
        if backend == Backend::Mysql && !self.pool.get()?.sql().autocommits()? {
            return Err(Error::InvalidConfig(
                "the pool's MySQL connections have autocommit off, so no lock would ever be \
                 committed: run `SET SESSION autocommit = 1` in the pool's connection \
                 customizer, or build the pool with diesel_lock::connect"
                    .into(),
            ));
        }
        let (interval, ttl) = match self.strategy {
            Strategy::Lease { ttl } => {
                let every = self
                    .heartbeat
                    .or(self.strategy.default_heartbeat())
                    .unwrap_or(ttl);
                if every.is_zero() || every >= ttl {
                    return Err(Error::InvalidConfig(
                        "the heartbeat must be longer than zero and shorter than the ttl".into(),
                    ));
                }
                (every, ttl)
            }
            _ => (Duration::from_secs(1), Duration::from_secs(1)),
        };
        let queues = Arc::new(Queues::default());
        #[cfg(feature = "postgres")]
        let listener = match (&self.listen_url, backend, self.strategy) {
            (Some(url), Backend::Postgres, Strategy::Row { .. } | Strategy::Lease { .. }) => {
                let (q, busy) = (queues.clone(), queues.clone());
                Some(
                    crate::backend::pg_listen::Listener::start(
                        url.clone(),
                        move |key| match key {
                            Some(key) => q.wake_remote(key),
                            None => q.wake_all(),
                        },
                        move || busy.has_waiters(),
                    )
                    .map_err(|e| {
                        Error::InvalidConfig(format!("cannot start the listener thread: {e}"))
                    })?,
                )
            }
            _ => None,
        };
        Ok(Locker {
            inner: Arc::new(Inner {
                heartbeat: Heartbeat::new(self.pool.clone(), interval, ttl),
                pool: self.pool,
                strategy: self.strategy,
                owner,
                backend,
                max_backoff: self.max_backoff,
                queues,
                #[cfg(feature = "postgres")]
                listener,
            }),
        })
    }
}

/// When to give up waiting.
#[derive(Debug, Clone, Copy)]
enum Deadline {
    Once,
    At(Instant),
    Never,
}

impl Deadline {
    fn remaining(self) -> Option<Duration> {
        match self {
            Deadline::Once => Some(Duration::ZERO),
            Deadline::At(t) => Some(t.saturating_duration_since(Instant::now())),
            Deadline::Never => None,
        }
    }
}

impl<C: LockConnection> Locker<C> {
    /// Starts configuring a `Locker` over `pool`.
    ///
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
        LockerBuilder {
            pool,
            strategy: Strategy::default(),
            owner: None,
            heartbeat: None,
            max_backoff: Duration::from_millis(50),
            listen_url: None,
        }
    }

    /// Creates or upgrades the library's tables (embedded diesel migrations). Idempotent, and
    /// safe to call from many processes at once.
    ///
    /// # Errors
    /// [`Error::Pool`] without a connection, [`Error::Migration`] if the DDL fails (for
    /// example, missing privileges).
    pub fn migrate(&self) -> Result<()> {
        self.inner.pool.get()?.sql().run_migrations()
    }

    /// Waits as long as it takes, then returns the guard.
    ///
    /// If this method returns `Ok`, the lock is held until the guard is dropped or released
    /// (or, for leases, until the heartbeat fails to renew it: see [`LockGuard::check`]).
    ///
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
    ///
    /// # Errors
    /// [`Error::InvalidKey`] before any SQL runs; [`Error::Pool`] when no connection can be
    /// had in the pool's `connection_timeout`; [`Error::MissingTable`] before `migrate`;
    /// [`Error::Database`] for other database failures. Contention is never an error.
    pub fn lock(&self, key: &str) -> Result<LockGuard<C>> {
        match self.acquire(key, Deadline::Never)? {
            Some(guard) => Ok(guard),
            None => unreachable!("waiting without a deadline only ends with the lock"),
        }
    }

    /// One attempt: `Ok(None)` when someone else holds the key. It never waits for the lock;
    /// it does wait for a pooled connection, as long as the pool's `connection_timeout`.
    ///
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
    ///
    /// # Errors
    /// As for [`lock`](Self::lock).
    pub fn try_lock(&self, key: &str) -> Result<Option<LockGuard<C>>> {
        self.acquire(key, Deadline::Once)
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
    /// As for [`lock`](Self::lock); [`Error::Pool`] also when the pool has no free connection
    /// before the deadline (every connection held elsewhere, e.g. by session strategies'
    /// guards: each keeps one).
    pub fn try_lock_for(&self, key: &str, timeout: Duration) -> Result<Option<LockGuard<C>>> {
        let deadline = Instant::now()
            .checked_add(timeout)
            .map_or(Deadline::Never, Deadline::At);
        self.acquire(key, deadline)
    }

    /// Deletes the rows of this `Locker`'s strategy that only take up space, and returns how
    /// many it deleted. It is safe beside live locks of every configuration: it deletes
    /// nothing that a holder could still count on.
    ///
    /// - `Lease`: lease rows free, or expired, for at least `idle` (an `idle` past 100 years
    ///   deletes nothing). A lease row carries its key's fencing token, so its token is
    ///   first saved in `dlock_tokens` (the counters `Row` and `Advisory` use, never
    ///   deleted), and a new lease row continues from there: tokens still only grow. The rows
    ///   are first marked taken by nobody and their tokens saved, in a committed statement of
    ///   their own, and only then deleted. An acquisition that meets the mark waits; one that
    ///   finds the row gone creates it only from a snapshot that sees it gone, so it reads
    ///   the saved token (tested with purges in a loop beside 8 acquiring threads: no token
    ///   ever went back). Should the second step never run, a marked key is free again after
    ///   a minute.
    /// - `Row` (with or without `stale_after`): rows past their *own* staleness limit, which
    ///   each row carries from the `Locker` that inserted it (its `stale_after`), and which
    ///   any waiter could take over anyway. A row inserted without `stale_after` is never
    ///   purged, whoever calls this. Their tokens already live in `dlock_tokens`. `idle` is
    ///   not used.
    /// - `ForUpdate`, `Advisory`: nothing (each keeps one small row per key: `ForUpdate`'s
    ///   row is what its holders lock, `Advisory`'s counter is its token).
    ///
    /// A deadlock with acquisitions running beside it is retried, not returned.
    ///
    /// Acquisitions stay O(log n) in the number of rows (measured: see BENCHMARKS.md), so
    /// purging is about disk space, not speed. It scans the table; run it now and then, not
    /// on every lock.
    ///
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
    ///
    /// # Errors
    /// [`Error::Pool`] without a connection, [`Error::Database`] if a statement fails.
    pub fn purge(&self, idle: Duration) -> Result<u64> {
        // Past the 100-year cap every row is younger than `idle`: nothing to delete (and the
        // databases' date arithmetic would overflow).
        let idle_us = strategy::micros(idle.min(strategy::MAX_DURATION)).unwrap_or(i64::MAX);
        let n = match self.inner.strategy {
            // Each step is one statement or transaction; a deadlock victim's was rolled back
            // and is run again.
            Strategy::Lease { .. } => {
                strategy::with_conn(&self.inner.pool, |c| c.sql().purge_mark_leases(idle_us))?;
                strategy::with_conn(&self.inner.pool, |c| c.sql().purge_delete_leases())?
            }
            Strategy::Row { .. } => {
                strategy::with_conn(&self.inner.pool, |c| c.sql().purge_stale_rows())?
            }
            _ => 0,
        };
        log::debug!("purge: {n} rows deleted");
        Ok(n as u64)
    }

    /// The strategy this `Locker` uses.
    pub fn strategy(&self) -> Strategy {
        self.inner.strategy
    }

    /// The owner name stored with each lock.
    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// The backend behind the pool.
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    pub(crate) fn ctx(&self) -> Ctx<'_, C> {
        Ctx {
            pool: &self.inner.pool,
            owner: &self.inner.owner,
            heartbeat: &self.inner.heartbeat,
        }
    }

    /// Tells local waiters for `key` that it was just released.
    pub(crate) fn released(&self, key: &str) {
        self.inner.queues.wake(key);
    }

    /// True if waiters hear other processes' releases (and so poll only as a fallback).
    fn listening(&self) -> bool {
        #[cfg(feature = "postgres")]
        if let Some(l) = &self.inner.listener {
            l.poke();
            return true;
        }
        false
    }

    fn acquire(&self, key: &str, deadline: Deadline) -> Result<Option<LockGuard<C>>> {
        key::validate(key)?;
        if let Deadline::Once = deadline {
            return Ok(self
                .attempt(key, false, deadline)?
                .map(|t| self.guard(key, t)));
        }
        let ticket = self.inner.queues.join(key);
        let queued = match ticket.wait_turn(deadline) {
            None => return Ok(None),
            Some(queued) => queued,
        };
        let max = self.inner.max_backoff;
        let cap = |d: Duration| deadline.remaining().map_or(d, |left| d.min(left));
        // While a guard of this Locker holds the key, its release wakes us: asking the
        // database before that could only fail. (Only after `max`, in case the holder's
        // lease was lost meanwhile.)
        if queued {
            ticket.pause(Duration::ZERO, cap(max));
        }
        // A thread that waited in line starts with the cheap "is it held?" read.
        let mut retry = queued;
        let mut backoff = Backoff::new(max);
        let mut listening = false;
        loop {
            if let Some(taken) = self.attempt(key, retry, deadline)? {
                // The guard marks the key held before the next local waiter looks.
                let guard = self.guard(key, taken);
                drop(ticket);
                return Ok(Some(guard));
            }
            if !retry {
                listening = self.listening();
            }
            retry = true;
            // A waiter that hears releases polls only as a fallback.
            let pause = if listening {
                Backoff::jitter(max)
            } else {
                backoff.next_pause()
            };
            if deadline.remaining().is_some_and(|left| left.is_zero()) {
                return Ok(None);
            }
            ticket.pause(cap(pause), cap(max));
        }
    }

    fn attempt(&self, key: &str, retry: bool, deadline: Deadline) -> Result<Option<Taken<C>>> {
        let conn = match deadline {
            // One attempt does not wait for the lock, but may wait for a connection as the
            // pool allows (a new one can take longer than a few ms to open: seen once, a
            // `try_lock` failing with `Error::Pool` on a loaded machine after 20 ms).
            Deadline::Once | Deadline::Never => self.inner.pool.get()?,
            // A short deadline still gets a fair chance at a momentarily busy pool.
            Deadline::At(_) => {
                let left = deadline.remaining().unwrap_or_default();
                self.inner
                    .pool
                    .get_timeout(left.max(Duration::from_millis(20)))?
            }
        };
        // Strategies that wait on the server may use what is left of the deadline.
        let left = deadline.remaining();
        strategy::try_acquire(&self.inner.strategy, &self.ctx(), conn, key, retry, left)
    }

    fn guard(&self, key: &str, taken: Taken<C>) -> LockGuard<C> {
        self.inner.queues.hold(key);
        log::debug!(
            "lock {key:?} acquired ({}, token {})",
            self.inner.strategy.name(),
            taken.token
        );
        LockGuard::new(self.clone(), key.to_owned(), taken)
    }
}

/// Exponential backoff with jitter: 1 ms doubling up to `max`, each pause drawn from the
/// upper half of the current bound so waiters spread out without long tails.
struct Backoff {
    bound: Duration,
    max: Duration,
}

impl Backoff {
    fn new(max: Duration) -> Self {
        Backoff {
            bound: Duration::from_millis(1).min(max),
            max,
        }
    }

    fn next_pause(&mut self) -> Duration {
        let bound = self.bound;
        self.bound = (self.bound * 2).min(self.max);
        Self::jitter(bound)
    }

    /// A pause drawn from the upper half of `bound`.
    fn jitter(bound: Duration) -> Duration {
        let half = bound / 2;
        let nanos = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX).max(1);
        half + Duration::from_nanos(random::random_u64() % nanos)
    }
}

/// The in-process line of waiters per key.
#[derive(Default)]
struct Queues {
    map: Mutex<HashMap<String, KeyQueue>>,
    next_id: std::sync::atomic::AtomicU64,
}

struct KeyQueue {
    waiters: VecDeque<u64>,
    wake: Arc<Condvar>,
    /// Counts releases heard (local, or notified by the database), so a release that comes
    /// while the first waiter is busy with an attempt (not yet sleeping) is not missed.
    released: u64,
    /// A guard of this `Locker` holds the key: only its release is worth waking up for.
    held: bool,
}

impl KeyQueue {
    fn new() -> KeyQueue {
        KeyQueue {
            waiters: VecDeque::new(),
            wake: Arc::new(Condvar::new()),
            released: 0,
            held: false,
        }
    }
}

impl Queues {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, KeyQueue>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn join(&self, key: &str) -> Ticket<'_> {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut map = self.lock();
        let q = map.entry(key.to_owned()).or_insert_with(KeyQueue::new);
        q.waiters.push_back(id);
        Ticket {
            queues: self,
            key: key.to_owned(),
            id,
            wake: q.wake.clone(),
            seen: Cell::new(q.released),
        }
    }

    /// A guard of this `Locker` took `key`.
    fn hold(&self, key: &str) {
        self.lock()
            .entry(key.to_owned())
            .or_insert_with(KeyQueue::new)
            .held = true;
    }

    /// A guard of this `Locker` released `key`.
    fn wake(&self, key: &str) {
        let mut map = self.lock();
        if let Some(q) = map.get_mut(key) {
            q.held = false;
            q.released += 1;
            if q.waiters.is_empty() {
                map.remove(key);
            } else {
                q.wake.notify_all();
            }
        }
    }

    /// The database says `key` was released, perhaps by another process (or, echoing a
    /// local release, by us: that changes nothing while a local guard holds it).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    fn wake_remote(&self, key: &str) {
        if let Some(q) = self.lock().get_mut(key) {
            q.released += 1;
            q.wake.notify_all();
        }
    }

    /// Releases may have gone unheard: every waiter looks again.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    fn wake_all(&self) {
        for q in self.lock().values_mut() {
            q.released += 1;
            q.wake.notify_all();
        }
    }

    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    fn has_waiters(&self) -> bool {
        self.lock().values().any(|q| !q.waiters.is_empty())
    }
}

/// A place in a key's line; dropping it leaves the line and wakes the next in it.
struct Ticket<'a> {
    queues: &'a Queues,
    key: String,
    id: u64,
    wake: Arc<Condvar>,
    seen: Cell<u64>,
}

impl Ticket<'_> {
    /// Waits to be first in line. `None` if the deadline passed first; otherwise whether
    /// anyone was ahead of us.
    fn wait_turn(&self, deadline: Deadline) -> Option<bool> {
        let mut map = self.queues.lock();
        let mut queued = false;
        loop {
            let q = map.get(&self.key);
            if q.and_then(|q| q.waiters.front().copied()) == Some(self.id) {
                // Releases before our turn were for those ahead of us.
                self.seen.set(q.map_or(0, |q| q.released));
                return Some(queued);
            }
            queued = true;
            map = match deadline.remaining() {
                None => self.wake.wait(map).unwrap_or_else(|p| p.into_inner()),
                Some(left) if left.is_zero() => return None,
                Some(left) => {
                    self.wake
                        .wait_timeout(map, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    /// Sleeps up to `pause`, or less if the key is released. While a guard of this
    /// `Locker` holds the key, sleeps up to `held` instead, and only its release ends that.
    fn pause(&self, pause: Duration, held: Duration) {
        let start = Instant::now();
        let mut map = self.queues.lock();
        loop {
            let Some(q) = map.get(&self.key) else { return };
            if !q.held && q.released != self.seen.get() {
                break;
            }
            let left = (if q.held { held } else { pause }).saturating_sub(start.elapsed());
            if left.is_zero() {
                break;
            }
            map = self
                .wake
                .wait_timeout(map, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if let Some(q) = map.get(&self.key) {
            self.seen.set(q.released);
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut map = self.queues.lock();
        if let Some(q) = map.get_mut(&self.key) {
            q.waiters.retain(|&w| w != self.id);
            if q.waiters.is_empty() {
                if !q.held {
                    map.remove(&self.key);
                }
            } else {
                q.wake.notify_all();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_bound() {
        let mut b = Backoff::new(Duration::from_millis(50));
        let pauses: Vec<_> = (0..12).map(|_| b.next_pause()).collect();
        assert!(pauses[0] <= Duration::from_millis(1));
        assert!(pauses.iter().all(|p| *p <= Duration::from_millis(50)));
        assert!(pauses[11] >= Duration::from_millis(25));
    }
}
