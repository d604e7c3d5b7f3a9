//! `LockerBuilder`: a `Locker`'s settings, checked once in `build`.

use super::queue::Queues;
use super::{Inner, Locker, Shared};
use crate::backend::{
    static_backend, AnyConnection, Backend, Failures, LockConnection, Sql, Target,
    DEFAULT_POOL_SIZE,
};
use crate::strategy::{self, Setup, Strategy};
use crate::{random, Error, Result};
use diesel::r2d2::ConnectionManager;
use r2d2::Pool;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

/// Configures a [`Locker`]. Made by [`Locker::builder`].
///
/// ```
/// use diesel_lock::{Locker, Strategy};
/// use std::time::Duration;
///
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
/// let locker = Locker::builder(pool)
///     .strategy(Strategy::Lease { ttl: Duration::from_secs(10) })
///     .heartbeat(Duration::from_secs(2)) // renew every 2 s instead of every 3.3 s
///     .max_backoff(Duration::from_millis(20))
///     .owner("billing-worker")
///     .build()?;
/// locker.migrate()?;
/// assert_eq!(locker.lock("invoices")?.owner(), "billing-worker");
/// # Ok(()) }
/// ```
pub struct LockerBuilder<C: LockConnection> {
    pub(super) source: Source<C>,
    pub(super) pool_size: Option<u32>,
    pub(super) strategy: Strategy,
    pub(super) owner: Option<String>,
    pub(super) heartbeat: Option<Duration>,
    pub(super) max_backoff: Duration,
    pub(super) listen_url: Option<String>,
    pub(super) reentrant: bool,
}

/// Where the `Locker`'s pool comes from: the caller's, or one `build` makes from a URL.
pub(super) enum Source<C: LockConnection> {
    Pool(Pool<ConnectionManager<C>>),
    Url {
        target: Target,
        /// Builds the pool (`backend::pool`, for `AnyConnection`).
        make: MakePool<C>,
    },
}

/// What builds a pool of `size` connections to a URL, its failures kept in `Failures`.
pub(super) type MakePool<C> = fn(&Target, u32, Arc<Failures>) -> Result<Pool<ConnectionManager<C>>>;

impl LockerBuilder<AnyConnection> {
    /// Starts configuring a `Locker` over a pool it builds itself from `url`, which it keeps:
    /// the same as [`Locker::connect`], which see.
    ///
    /// ```
    /// use diesel_lock::LockerBuilder;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = dir.path().join("locks.db").display().to_string();
    /// let locker = LockerBuilder::from_url(&url)?.pool_size(4).build()?;
    /// assert_eq!(locker.pool().max_size(), 4);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As for [`Locker::connect`].
    pub fn from_url(url: &str) -> Result<Self> {
        let target = crate::backend::open(url)?;
        Ok(LockerBuilder::new(Source::Url {
            target,
            make: crate::backend::locker_pool,
        }))
    }
}

impl<C: LockConnection> LockerBuilder<C> {
    pub(super) fn new(source: Source<C>) -> Self {
        LockerBuilder {
            source,
            pool_size: None,
            strategy: Strategy::default(),
            owner: None,
            heartbeat: None,
            max_backoff: Duration::from_millis(50),
            listen_url: None,
            reentrant: false,
        }
    }
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
    ///
    /// ```
    /// use diesel_lock::{admin, Locker, Strategy, StrategyKind};
    /// use std::time::Duration;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// let row = Strategy::Row { stale_after: Some(Duration::from_secs(600)) };
    /// let locker = Locker::builder(pool.clone()).strategy(row).build()?;
    /// locker.migrate()?;
    /// let _guard = locker.lock("import")?;
    /// assert_eq!(admin::lock_info(&mut *pool.get()?, "import")?[0].strategy, StrategyKind::Row);
    /// # Ok(()) }
    /// ```
    pub fn strategy(mut self, strategy: Strategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// The owner name stored with each lock, for people reading the tables. Defaults to
    /// `host:pid:random`. Owner names need not be unique: releases are checked against a
    /// per-acquisition id, not against the owner.
    ///
    /// ```
    /// use diesel_lock::{admin, Locker};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// let locker = Locker::builder(pool.clone()).owner("nightly@host-3").build()?;
    /// locker.migrate()?;
    /// let _guard = locker.lock("report")?;
    /// let held = admin::held_locks(&mut *pool.get()?)?; // what `dlock list` shows
    /// assert_eq!(held[0].owner, "nightly@host-3");
    /// # Ok(()) }
    /// ```
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// `Lease`: how often a held lease is renewed. Defaults to a third of the ttl. Must be
    /// shorter than the ttl. Ignored by the other strategies.
    ///
    /// Renewals of different keys run side by side; each waits for a row lock held by
    /// another session at most a quarter of this (on MySQL whole seconds, at least 1; on
    /// SQLite the connection's `busy_timeout`) before it is retried, and renewals of healthy
    /// keys go before retries of stuck ones. So S keys stuck behind other sessions' row
    /// locks, on a pool of P connections, delay the `Locker`'s other renewals once, by about
    /// S/P such waits: the other leases survive while (S/P) × wait < ttl − interval. With the
    /// defaults that is S/P < 8 on PostgreSQL; on MySQL, whose wait is at least 1 s, S/P <
    /// (ttl − interval) / 1 s: with a ttl of 3 s, fewer than 2 stuck keys per connection
    /// (tests/heartbeat.rs). Not bounded: a wait for a
    /// *table* lock (`LOCK TABLE`, `VACUUM FULL`, an `ALTER TABLE` under way) or for a server
    /// that stopped answering; the guards then learn that their leases are lost once a ttl
    /// has passed without a renewal.
    ///
    /// ```
    /// use diesel_lock::{Error, Locker, Strategy};
    /// use std::time::Duration;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// let lease = Strategy::Lease { ttl: Duration::from_secs(6) };
    /// let builder = || Locker::builder(pool.clone()).strategy(lease);
    /// builder().heartbeat(Duration::from_secs(1)).build()?; // 5 s to spare for a renewal
    /// let too_slow = builder().heartbeat(Duration::from_secs(6)).build(); // not under the ttl
    /// assert!(matches!(too_slow, Err(Error::InvalidConfig(_))));
    /// # Ok(()) }
    /// ```
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = Some(every);
        self
    }

    /// The longest pause between two attempts while waiting. Defaults to 50 ms.
    ///
    /// `Row` and `Lease` waiters in line (see [`Locker`]'s `# Fairness`) that hear
    /// notifications (PostgreSQL) look this often regardless (a lost notification, a lease
    /// that expired); those that hear none pause at most this long. A waiter's place in line
    /// lapses after max(2 s, 4 × this) without a renewal.
    ///
    /// ```
    /// use diesel_lock::{Error, Locker};
    /// use std::time::Duration;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// // Waiters in other processes look at least every 5 ms: quicker handovers, more queries.
    /// Locker::builder(pool.clone()).max_backoff(Duration::from_millis(5)).build()?;
    /// let never = Locker::builder(pool).max_backoff(Duration::ZERO).build();
    /// assert!(matches!(never, Err(Error::InvalidConfig(_))));
    /// # Ok(()) }
    /// ```
    pub fn max_backoff(mut self, max: Duration) -> Self {
        self.max_backoff = max;
        self
    }

    /// PostgreSQL, `Row` and `Lease`: the URL of a connection the `Locker` opens for itself,
    /// outside the pool, to `LISTEN` for its turn. Waiters line up in the database; a release
    /// notifies the `Locker` of the first waiter in line only (inside the releasing
    /// statement: no extra round trip), and that `Locker` wakes its waiter, so a lock
    /// released by another process is taken within about a millisecond instead of at the
    /// waiter's next poll. Waiters still look every [`max_backoff`](Self::max_backoff), as
    /// notifications can be lost with a connection, and an expired lease notifies nobody.
    ///
    /// A thread of the `Locker` waits on the listening connection (blocked in `poll(2)`: it
    /// uses no CPU between notifications); it starts with the `Locker`'s first wait for a
    /// held key and ends when the last clone of the `Locker` is dropped. Should the
    /// connection fail, it is opened again and the waiters poll meanwhile.
    ///
    /// Defaults to the URL the `Locker` was built from ([`Locker::connect`]) unless that
    /// goes through a transaction pooler; a `Locker` over a pool of your own
    /// ([`Locker::builder`], [`connect`](crate::connect)) has none unless given one here:
    /// waiters in line then poll. Ignored on other backends and by the session strategies,
    /// which wait on the server.
    ///
    /// Behind a transaction-pooling PgBouncer (a pool from a `dlock_pooler=transaction`
    /// URL), give the server's own address here: `LISTEN` holds a server session, which
    /// such a pooler hands to other clients, so `build` refuses a `listen_url` carrying
    /// `dlock_pooler=transaction`. Without a direct URL, leave it unset (waiters poll).
    ///
    /// # Examples
    /// ```no_run
    /// use diesel_lock::{Locker, Strategy};
    /// use std::time::Duration;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// let url = "postgres://app@db/app";
    /// let pool = diesel_lock::connect(url)?; // a pool of the application's, shared
    /// let locker = Locker::builder(pool.clone())
    ///     .strategy(Strategy::Lease { ttl: Duration::from_secs(30) })
    ///     .listen_url(url)
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn listen_url(mut self, url: impl Into<String>) -> Self {
        self.listen_url = Some(url.into());
        self
    }

    /// The most connections the pool that the `Locker` builds from a URL
    /// ([`Locker::connect`]) may hold. Defaults to the URL's `dlock_pool_size=N`, or else
    /// to 10.
    ///
    /// Each guard of a session strategy (`ForUpdate`, `Advisory`, `AdvisoryXact`) keeps one
    /// connection for its whole life, and a waiting thread uses one per attempt: a process
    /// that holds N such guards at once needs a pool of more than N. A pool you build
    /// yourself ([`Locker::builder`]) has the size you gave it: `build` refuses this option
    /// there.
    ///
    /// ```
    /// use diesel_lock::{Locker, Strategy};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = dir.path().join("locks.db").display().to_string();
    /// let locker = Locker::connect(&url)?.pool_size(32).build()?;
    /// assert_eq!(locker.pool().max_size(), 32);
    /// # Ok(()) }
    /// ```
    pub fn pool_size(mut self, connections: u32) -> Self {
        self.pool_size = Some(connections);
        self
    }

    /// Makes the `Locker` reentrant for its exclusive locks (`lock`, `try_lock*`,
    /// `lock_all`): a thread that holds a key through this `Locker` (or a clone) and locks it
    /// again gets a nested guard at once, with no database round trip and the same token;
    /// the lock is released when the last of the nested guards goes (the outermost, when
    /// they are dropped in order). Another thread, or another `Locker`, still waits.
    ///
    /// Off by default, as in `std::sync::Mutex`: a second lock of a held key is usually a
    /// bug (code that assumed it had the key to itself, now running inside a section that
    /// already holds it), and with reentrancy it silently succeeds instead of being seen;
    /// the nested section also cannot tell whether its own release will free the key. The
    /// nesting is by thread, so it does not follow a guard sent to another thread. Readers,
    /// writers and permits (`read`, `write`, `permit`) are never reentrant.
    ///
    /// ```
    /// use diesel_lock::Locker;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// let locker = Locker::builder(pool).reentrant(true).build()?;
    /// locker.migrate()?;
    /// let outer = locker.lock("config")?;
    /// let inner = locker.lock("config")?; // no wait, no round trip
    /// assert_eq!(inner.token(), outer.token());
    /// drop(inner);
    /// let other = locker.clone();
    /// let elsewhere = std::thread::spawn(move || other.try_lock("config").map(|g| g.is_some()));
    /// assert!(!elsewhere.join().unwrap()?); // still held by `outer`
    /// drop(outer);
    /// assert!(locker.try_lock("config")?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn reentrant(mut self, on: bool) -> Self {
        self.reentrant = on;
        self
    }

    /// Checks the configuration and builds the `Locker`.
    ///
    /// A builder from a URL ([`Locker::connect`]) builds its pool here. For
    /// [`AnyConnection`](crate::AnyConnection) pools this takes one connection from the
    /// pool to learn the backend. On MySQL it takes one to check that the pool's sessions
    /// commit each statement (`autocommit = 1`, as [`connect`](crate::connect) sets it):
    /// with autocommit off, every lock would stay uncommitted on its pooled connection. On
    /// SQLite it checks that the connections run in WAL mode with a busy timeout, as
    /// [`SqliteTuning`](crate::SqliteTuning) (which `connect` installs) sets them: without
    /// them a lock's commit can fail after its statement returned the lock.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a ttl or `stale_after` under 1 ms, a heartbeat not shorter
    /// than the ttl, an empty or oversized owner, a zero `max_backoff`, a `listen_url` through
    /// a transaction pooler (`dlock_pooler=transaction`), the `Advisory` strategy on a pool
    /// built from such a URL (its session locks would stay on whichever server session the
    /// pooler gave out), a `pool_size` of 0 or for a pool
    /// of your own, a MySQL pool with
    /// autocommit off, a PostgreSQL pool whose sessions run at SERIALIZABLE (the
    /// sessions a `Locker` opens itself from a URL run at READ COMMITTED, unless through a
    /// transaction pooler), or a SQLite pool without WAL or a busy timeout;
    /// [`Error::Unsupported`] for a strategy the backend cannot honour;
    /// [`Error::Connection`] or [`Error::Pool`] if a connection was needed and none could be
    /// had; [`Error::Thread`] if the listener's
    /// wake-up socket could not be made (its thread starts with the first wait).
    ///
    /// # Examples
    /// ```
    /// use diesel_lock::{Error, Locker, Strategy};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// let locker = Locker::builder(pool.clone()).build()?;
    /// assert_eq!(locker.strategy(), Strategy::default()); // Lease, 30 s
    /// // SQLite has no session locks:
    /// match Locker::builder(pool).strategy(Strategy::Advisory).build() {
    ///     Err(Error::Unsupported { strategy, backend }) => {
    ///         assert_eq!((strategy, backend), ("advisory", "sqlite"))
    ///     }
    ///     other => panic!("{other:?}"),
    /// }
    /// # Ok(()) }
    /// ```
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
        if self
            .listen_url
            .as_deref()
            .is_some_and(crate::backend::behind_pooler)
        {
            // LISTEN registers one server session, which a transaction pooler gives to other
            // clients after the statement: the notifications would never come.
            return Err(Error::InvalidConfig(
                "listen_url must reach PostgreSQL directly (or through session pooling), not through a transaction pooler".into(),
            ));
        }
        // A pool built here from a URL keeps its connection failures' reasons, and its URL
        // is the default one to listen on.
        let (pool, failures, own_url) = match self.source {
            Source::Pool(pool) => {
                if self.pool_size.is_some() {
                    return Err(Error::InvalidConfig(
                        "pool_size sizes the pool a Locker builds from a url (Locker::connect); give your own pool its size with r2d2's Pool::builder().max_size".into(),
                    ));
                }
                (pool, None, None)
            }
            Source::Url { target, make } => {
                if target.behind_pooler && matches!(self.strategy, Strategy::Advisory) {
                    // A session's advisory locks stay on the server session that ran the
                    // statement, which a transaction pooler hands to other clients: the lock
                    // would be neither this guard's nor released by it.
                    return Err(Error::InvalidConfig(
                        "the Advisory strategy holds session locks, which a transaction pooler (dlock_pooler=transaction) hands to other clients: use AdvisoryXact, ForUpdate, Row or Lease there".into(),
                    ));
                }
                let failures = Arc::new(Failures::new(target.clone()));
                let size = self
                    .pool_size
                    .or(target.pool_size)
                    .unwrap_or(DEFAULT_POOL_SIZE);
                let pool = make(&target, size, failures.clone())?;
                let url = (!target.behind_pooler).then_some(target.url);
                (pool, Some(failures), url)
            }
        };
        let pool_error = |e: r2d2::Error| match &failures {
            Some(f) => f
                .recent(pool.connection_timeout())
                .unwrap_or(Error::Pool(e)),
            None => Error::Pool(e),
        };
        // A pool of a fixed connection type says its backend; an `AnyConnection` pool (what
        // `connect` builds) is asked on one of its connections.
        let backend = match static_backend::<C>() {
            Some(b) => b,
            None => pool.get().map_err(pool_error)?.sql().backend(),
        };
        let setup = Setup {
            pool: pool.clone(),
            owner: owner.clone(),
            backend,
            heartbeat: self.heartbeat,
            max_backoff: self.max_backoff,
        };
        let raw = strategy::build(self.strategy, setup)?;
        if let Some(why) = pool
            .get()
            .map_err(pool_error)?
            .sql()
            .misconfigured(raw.lines())?
        {
            return Err(Error::InvalidConfig(why));
        }
        let shared = Arc::new(Shared {
            owner,
            queues: Queues::default(),
            meter: crate::instrument::Meter::new(self.strategy.name(), backend.name()),
            nests: self.reentrant.then(Arc::default),
            guards_with_connections: AtomicUsize::new(0),
            watcher: crate::watcher::Watcher::default(),
        });
        // Row and Lease waiters on PostgreSQL hear their turn come on a connection of the
        // `Locker`'s own: at `listen_url`, or by default at the URL it was built from.
        #[cfg(feature = "postgres")]
        let listener = match self.listen_url.or(own_url) {
            Some(url) if backend == Backend::Postgres && raw.lines() => Some(url),
            _ => None,
        };
        #[cfg(not(feature = "postgres"))]
        drop(own_url);
        #[cfg(feature = "postgres")]
        let listener = match listener {
            Some(url) => {
                let woken = shared.clone();
                Some(
                    crate::backend::pg::listen::Listener::new(url, move |heard| {
                        use crate::backend::pg::listen::Heard;
                        match heard {
                            Heard::Key(key) => woken.queues.wake_remote(key),
                            // What a release gave this Locker's waiter: taken with no look.
                            Heard::Grant(key, told) => woken.queues.wake_granted(key, told),
                            Heard::Missed => woken.queues.wake_all(),
                        }
                    })
                    .map_err(Error::Thread)?,
                )
            }
            None => None,
        };
        // Row and Lease waiters on SQLite (Linux) are rung by the release that grants them
        // the key.
        #[cfg(all(feature = "sqlite", target_os = "linux"))]
        let doorbell = if backend == Backend::Sqlite && raw.lines() {
            let woken = shared.clone();
            match crate::backend::sqlite::doorbell::Doorbell::new(move |key| {
                woken.queues.wake_remote(key)
            }) {
                Ok(d) => Some(d),
                Err(e) => {
                    log::warn!("doorbell: cannot bind its socket ({e}); waiters poll");
                    None
                }
            }
        } else {
            None
        };
        Ok(Locker {
            inner: Arc::new(Inner {
                pool,
                failures,
                strategy: self.strategy,
                raw,
                shared,
                backend,
                max_backoff: self.max_backoff,
                schema_current: AtomicBool::new(false),
                schema_waited: AtomicBool::new(false),
                kept: AtomicUsize::new(0),
                #[cfg(feature = "postgres")]
                listener,
                #[cfg(all(feature = "sqlite", target_os = "linux"))]
                doorbell,
            }),
        })
    }
}
