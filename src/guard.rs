//! `LockGuard`: what a held lock looks like to its user; releases in `release` or `Drop`.

use crate::backend::LockConnection;
use crate::hold::{HoldCell, Taken};
use crate::locker::shared::Shared;
use crate::loss::{LockStatus, Loss, LossWatch};
use crate::sync::Unpoison;
use crate::{Error, Result};
use chrono::{DateTime, Utc};
use std::marker::PhantomData;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// A held lock. Dropping it releases the lock; [`release`](Self::release) does the same and
/// reports failure, which `Drop` can only log (at `warn`).
///
/// A guard is `Send`: it may be released by another thread than the one that took it.
///
/// ```
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
/// # locker.migrate()?;
/// {
///     let guard = locker.lock("nightly-report")?;
///     assert!(locker.try_lock("nightly-report")?.is_none());
///     println!("{} holds it with token {}", guard.owner(), guard.token());
/// } // dropped: released
/// let guard = locker.try_lock("nightly-report")?.expect("free again");
/// std::thread::spawn(move || guard.release()).join().unwrap()?; // from another thread
/// # Ok(()) }
/// ```
#[must_use = "if unused the lock is released immediately"]
pub struct LockGuard<C: LockConnection> {
    /// The `Locker`'s owner name and line of waiters (not the `Locker` itself).
    shared: Arc<Shared>,
    key: String,
    token: i64,
    acquired_at: DateTime<Utc>,
    /// What the strategy keeps to release and check the lock; `None` once released. Shared
    /// with the `Locker`'s loss watcher once watched.
    hold: Arc<HoldCell>,
    /// Whether the lock is held, lost or released, for those waiting to be told.
    loss: Arc<Loss>,
    /// When the guard was made, for the time held (metrics).
    made: Instant,
    /// Whether the hold keeps a pooled connection (the session strategies'), counted in
    /// `Shared::guards_with_connections` until released.
    keeps_connection: bool,
    _connection: PhantomData<fn() -> C>,
}

impl<C: LockConnection> std::fmt::Debug for LockGuard<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("owner", &self.owner())
            .field("acquired_at", &self.acquired_at)
            .finish_non_exhaustive()
    }
}

impl<C: LockConnection> LockGuard<C> {
    pub(crate) fn new(shared: Arc<Shared>, key: String, taken: Taken) -> Self {
        let loss = taken.hold.loss().unwrap_or_else(Loss::new);
        shared.meter.guard_created();
        loss.set_meter(shared.meter);
        LockGuard {
            shared,
            key,
            token: taken.token,
            acquired_at: taken.acquired_at,
            hold: Arc::new(RwLock::new(Some(taken.hold))),
            loss,
            made: Instant::now(),
            keeps_connection: false,
            _connection: PhantomData,
        }
    }

    /// The same guard with its hold replaced (the hold of a reentrant `Locker`'s nest).
    /// Counts this guard among those of its `Locker` that keep a pooled connection.
    pub(crate) fn keeping_connection(mut self) -> Self {
        self.shared
            .guards_with_connections
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.keeps_connection = true;
        self
    }

    fn uncount_connection(&mut self) {
        if std::mem::take(&mut self.keeps_connection) {
            self.shared
                .guards_with_connections
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    pub(crate) fn map_taken(self, f: impl FnOnce(Taken) -> Taken) -> Self {
        // The guard keeps the loss status of the strategy's own hold (a lease's heartbeat
        // marks it); a nested guard made later has its own, which its watcher probes.
        {
            let mut cell = self.hold.write().unpoisoned();
            if let Some(hold) = cell.take() {
                let taken = f(Taken {
                    hold,
                    token: self.token,
                    acquired_at: self.acquired_at,
                });
                *cell = Some(taken.hold);
            }
        }
        self
    }

    fn lost(&self) -> Error {
        Error::LockLost {
            key: self.key.clone(),
        }
    }

    /// The key this guard holds.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let guard = locker.lock("jobs/42")?;
    /// assert_eq!(guard.key(), "jobs/42");
    /// # Ok(()) }
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fencing token: strictly greater than every token issued earlier for this key by
    /// this strategy. Pass it to whatever the lock protects, and have that refuse writes
    /// carrying a token lower than one it has seen. `ForUpdate` and `Advisory` tokens are
    /// global (one source for every key), so consecutive tokens of a key may leave gaps.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let mut storage_seen = 0; // kept by the protected resource
    /// for _ in 0..3 {
    ///     let guard = locker.lock("ledger")?;
    ///     assert!(guard.token() > storage_seen); // a lapsed holder's write would be refused
    ///     storage_seen = guard.token();
    /// }
    /// # Ok(()) }
    /// ```
    pub fn token(&self) -> i64 {
        self.token
    }

    /// The owner name stored with the lock.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// let locker = diesel_lock::Locker::builder(pool).owner("worker-3").build()?;
    /// locker.migrate()?;
    /// assert_eq!(locker.lock("k")?.owner(), "worker-3");
    /// # Ok(()) }
    /// ```
    pub fn owner(&self) -> &str {
        &self.shared.owner
    }

    /// The database's time at which the lock was taken: for a guard that waited in the
    /// server's lock queue (`ForUpdate`, `Advisory`), when the wait ended, not when it began.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool.clone()).build()?;
    /// # locker.migrate()?;
    /// let guard = locker.lock("k")?;
    /// let info = &diesel_lock::admin::lock_info(&mut *pool.get()?, "k")?[0];
    /// assert_eq!(guard.acquired_at(), info.acquired_at); // as the database recorded it
    /// # Ok(()) }
    /// ```
    pub fn acquired_at(&self) -> DateTime<Utc> {
        self.acquired_at
    }

    /// Asks the database whether the lock is still held by this guard.
    ///
    /// Session strategies ask on the session holding the lock: `ForUpdate` whether the
    /// holding transaction still sees its row; an `Advisory` guard on a session it shares
    /// with the `Locker`'s other guards whether that session is alive and still the same
    /// one (its locks go only with it, or with their own releases); one on a session of its
    /// own, pg_locks for this backend or `IS_USED_LOCK(name) = CONNECTION_ID()`.
    ///
    /// A `Lease` guard waits for the database's answer at most until the lease's local
    /// deadline (see [`Strategy::Lease`](crate::Strategy::Lease)), and reports `LockLost`
    /// from then on, for good, whatever the database says later.
    ///
    /// # Errors
    /// [`Error::LockLost`](crate::Error::LockLost) if it is not: the lease expired (the
    /// heartbeat could not renew it in time), the row was taken over as stale, or the
    /// session holding it ended; a session strategy whose connection fails counts as lost
    /// too, for good. Other errors if the database could not be asked.
    ///
    /// # Examples
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let guard = locker.lock("invoices")?;
    /// guard.check()?; // before an irreversible step
    /// # Ok(()) }
    /// ```
    pub fn check(&self) -> Result<()> {
        let held = match &*self.hold.read().unpoisoned() {
            Some(hold) => hold.held(&self.key)?,
            None => false,
        };
        if held {
            Ok(())
        } else {
            self.loss.mark_lost();
            Err(self.lost())
        }
    }

    /// A handle that tells when this lock is lost, without asking: to wait for it
    /// ([`LossWatch::wait`]) or be called ([`LossWatch::on_lost`]) from any thread. It
    /// never reports a loss after a normal release ([`LockStatus::Released`]).
    ///
    /// How soon a loss is told, counted from the moment the library can know it:
    /// - `Lease`: at once when the heartbeat's renewal finds the lease expired or taken (it
    ///   renews every interval, ttl/3 by default, so within one interval of a takeover or a
    ///   forced release), and at the lease's local deadline when it could not be renewed in
    ///   time (see [`check`](Self::check)); no database work of its own.
    /// - `Row`, `ForUpdate`, `Advisory`: the `Locker`'s watcher, which the guard joins with
    ///   the first call of this method (or of [`wait_lost`](Self::wait_lost),
    ///   [`on_lost`](Self::on_lost)), asks the database once a second what
    ///   [`check`](Self::check) asks (for a session strategy, one query on the guard's own
    ///   connection, which fails at once when the server ended the session).
    ///
    /// One watcher thread serves all the watched guards of a `Locker` and runs the
    /// callbacks, on a few helper threads: a callback that blocks holds up only itself, one
    /// that panics is logged. A guard leaves it when released; the thread ends with the
    /// `Locker` and its last guard.
    ///
    /// ```
    /// use diesel_lock::{admin, LockStatus};
    /// use std::time::Duration;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// let locker = diesel_lock::Locker::builder(pool.clone())
    ///     .strategy(diesel_lock::Strategy::Lease { ttl: Duration::from_secs(3) })
    ///     .build()?;
    /// # locker.migrate()?;
    /// let guard = locker.lock("exports")?;
    /// let watch = guard.loss_watch();
    /// admin::force_release(&mut *pool.get()?, "exports")?; // an administrator steps in
    /// // Told at the next renewal: within ttl/3 (1 s here), or two if that renewal met
    /// // contention and was retried.
    /// assert_eq!(watch.wait(Duration::from_secs(30)), LockStatus::Lost);
    /// # Ok(()) }
    /// ```
    pub fn loss_watch(&self) -> LossWatch {
        self.shared.watcher.watch(&self.loss, &self.hold, &self.key);
        LossWatch::new(self.loss.clone())
    }

    /// Waits at most `timeout` for the lock to be lost: true if it was (see
    /// [`loss_watch`](Self::loss_watch) for how soon a loss is told).
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let guard = locker.lock("k")?;
    /// assert!(!guard.wait_lost(std::time::Duration::from_millis(10)));
    /// # Ok(()) }
    /// ```
    pub fn wait_lost(&self, timeout: Duration) -> bool {
        self.shared.watcher.watch(&self.loss, &self.hold, &self.key);
        self.loss.wait_until(Instant::now().checked_add(timeout)) == LockStatus::Lost
    }

    /// Runs `f` once, on a thread of the library, when the lock is lost (see
    /// [`loss_watch`](Self::loss_watch)); never after a normal release. `f` should be quick:
    /// send on a channel, set a flag, signal a process. When `f` runs, the guard's
    /// [`LossWatch::status`] reads [`LockStatus::Lost`]; each
    /// guard's loss is found and told on its own (see [`LossWatch::on_lost`]).
    ///
    /// ```
    /// use diesel_lock::admin;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool.clone()).build()?;
    /// # locker.migrate()?;
    /// let guard = locker.lock("k")?;
    /// let (tx, rx) = std::sync::mpsc::channel();
    /// guard.on_lost(move || tx.send("lost").unwrap());
    /// admin::force_release(&mut *pool.get()?, "k")?;
    /// assert_eq!(rx.recv().unwrap(), "lost");
    /// # Ok(()) }
    /// ```
    pub fn on_lost(&self, f: impl FnOnce() + Send + 'static) {
        self.loss_watch().on_lost(f);
    }

    /// Releases the lock now and reports whether that worked.
    ///
    /// # Errors
    /// [`Error::LockLost`](crate::Error::LockLost) if the lock had already been lost (it was
    /// not ours to release); [`Error::Pool`](crate::Error::Pool) or
    /// [`Error::Database`](crate::Error::Database) if the release could not be done. A lease
    /// that could not be released expires after its ttl; a row needs `stale_after` or a
    /// manual `dlock release --force`. A session strategy's connection is closed instead of
    /// pooled whenever its release fails (reported as `LockLost`: the connection that held
    /// the lock failed), which frees the lock on the server.
    ///
    /// # Examples
    /// ```
    /// use diesel_lock::{admin, Error};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool.clone()).build()?;
    /// # locker.migrate()?;
    /// locker.lock("a")?.release()?;
    /// let guard = locker.lock("b")?;
    /// admin::force_release(&mut *pool.get()?, "b")?; // an administrator steps in
    /// match guard.release() {
    ///     Err(Error::LockLost { key }) => assert_eq!(key, "b"), // it was no longer ours
    ///     other => panic!("{other:?}"),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn release(mut self) -> Result<()> {
        self.release_inner()
    }

    /// Releases the lock no sooner than `min` after it was acquired: ShedLock's
    /// `lockAtLeastFor`, for a scheduled job that may finish in less time than the clocks of
    /// the machines that run it may differ, so that another machine cannot run the same
    /// round again. Returns at once (releasing) if `min` has already passed; otherwise
    /// blocks the calling thread, holding the lock, until it has, then releases.
    ///
    /// The lock stays under watch meanwhile: if it is lost during the wait, the call returns
    /// at once with [`Error::LockLost`] (see [`loss_watch`](Self::loss_watch)).
    /// `dlock run --min-hold` does the same for a command.
    ///
    /// # Errors
    /// As for [`release`](Self::release).
    ///
    /// # Examples
    /// ```
    /// use std::time::{Duration, Instant};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let start = Instant::now();
    /// let guard = locker.lock("nightly-report")?;
    /// // ... the job, done in a moment ...
    /// guard.hold_at_least(Duration::from_millis(50))?;
    /// assert!(start.elapsed() >= Duration::from_millis(50));
    /// assert!(locker.try_lock("nightly-report")?.is_some()); // released now
    /// # Ok(()) }
    /// ```
    pub fn hold_at_least(self, min: Duration) -> Result<()> {
        let remaining = min.saturating_sub(self.made.elapsed());
        if !remaining.is_zero() {
            // Ends early on a loss; the release below then reports it.
            self.wait_lost(remaining);
        }
        self.release()
    }

    fn release_inner(&mut self) -> Result<()> {
        // From here on only the release's outcome tells the loss watchers anything: a
        // renewal racing the release's own delete must not report a loss.
        self.loss.begin_release();
        let taken = self.hold.write().unpoisoned().take();
        let Some(hold) = taken else {
            self.uncount_connection();
            return Ok(());
        };
        let result = match hold.release(&self.key) {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.lost()),
            Err(e) => Err(e),
        };
        self.uncount_connection();
        self.loss
            .end_release(matches!(result, Err(Error::LockLost { .. })));
        self.shared.watcher.unwatch(&self.loss);
        let failed = matches!(result, Err(ref e) if !matches!(e, Error::LockLost { .. }));
        self.shared.meter.guard_ended(self.made.elapsed(), failed);
        self.shared.queues.wake(&self.key);
        match &result {
            Ok(()) => log::debug!("lock {:?} released (token {})", self.key, self.token),
            Err(e) => log::debug!("lock {:?}: release failed: {e}", self.key),
        }
        result
    }
}

impl<C: LockConnection> Drop for LockGuard<C> {
    fn drop(&mut self) {
        if let Err(e) = self.release_inner() {
            log::warn!("lock {:?}: release on drop failed: {e}", self.key);
        }
    }
}
