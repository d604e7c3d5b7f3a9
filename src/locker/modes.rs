//! The kinds of lock beside the strategy's exclusive one: readers and writers
//! (`read`, `write`), and semaphore permits (`permit`). Each is a raw lock that the strategy
//! built for the mode (`RawLock::mode`; a writer is the exclusive lock itself), waited for
//! by the same code as `lock`. One lock per key: a key's exclusive lock excludes its
//! readers and permits, and they exclude it.

use super::deadline::Deadline;
use super::{Cancel, Locker};
use crate::backend::LockConnection;
use crate::guard::LockGuard;
use crate::strategy::{Mode, ModeLock, RawLock};
use crate::{Error, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

impl<C: LockConnection> Locker<C> {
    /// Takes `key` as one of many readers, waiting as long as it takes: readers share the
    /// key; the key's exclusive lock ([`lock`](Self::lock), and [`write`](Self::write),
    /// which is the same lock) excludes them and waits for them.
    ///
    /// - `Lease`, every backend: each reader is a lease of its own, with the `Locker`'s ttl,
    ///   renewed by a heartbeat, in `dlock_shared_leases`, so a crashed reader's share
    ///   returns after its ttl; the key's exclusive lease waits until the latest of them
    ///   has been released or has expired.
    /// - `Advisory`, PostgreSQL: `pg_advisory_lock_shared`, held by the guard's session
    ///   (freed when it ends); `write` is the strategy's own `pg_advisory_lock`, the same
    ///   lock as [`lock`](Self::lock).
    /// - `ForUpdate`, PostgreSQL and MySQL: the key's row locked `FOR SHARE` (MySQL: `LOCK IN
    ///   SHARE MODE`) in a transaction the guard keeps open (freed when it ends); `write` is
    ///   the strategy's own `FOR UPDATE`, the same lock as [`lock`](Self::lock).
    ///
    /// Writers do not starve (see [`write`](Self::write)). Each guard has a fencing token of
    /// its own; a key's tokens (readers' and writers' alike) strictly increase (`Advisory`,
    /// `ForUpdate`: drawn from their global source, so with gaps).
    ///
    /// # Errors
    /// [`Error::Unsupported`](crate::Error::Unsupported) for strategies without a shared
    /// mode: `Row`, `AdvisoryXact`, and `Advisory` on MySQL, whose `GET_LOCK` has no shared
    /// mode;
    /// [`Error::Permits`](crate::Error::Permits) if the key is a semaphore; otherwise as for
    /// [`lock`](Self::lock).
    ///
    /// # Examples
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let a = locker.read("catalog")?;
    /// let b = locker.read("catalog")?; // readers share
    /// assert!(locker.try_write("catalog")?.is_none());
    /// assert!(b.token() > a.token());
    /// drop((a, b));
    /// assert!(locker.try_write("catalog")?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn read(&self, key: &str) -> Result<LockGuard<C>> {
        let raw = self.mode_raw(Mode::Read)?;
        match self.acquire(&*raw, key, Deadline::Never, None)? {
            Some(guard) => Ok(guard),
            None => unreachable!("waiting without a deadline only ends with the lock"),
        }
    }

    /// One attempt to take `key` as a reader: `Ok(None)` while a writer holds it, or waits
    /// for it.
    ///
    /// # Errors
    /// As for [`read`](Self::read).
    ///
    /// # Examples
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let w = locker.write("catalog")?;
    /// assert!(locker.try_read("catalog")?.is_none());
    /// drop(w);
    /// assert!(locker.try_read("catalog")?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn try_read(&self, key: &str) -> Result<Option<LockGuard<C>>> {
        let raw = self.mode_raw(Mode::Read)?;
        self.acquire(&*raw, key, Deadline::Once, None)
    }

    /// Waits at most `timeout` to take `key` as a reader.
    ///
    /// # Errors
    /// As for [`read`](Self::read).
    ///
    /// # Examples
    /// ```
    /// use std::time::{Duration, Instant};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// assert!(locker.try_read_for("catalog", Duration::from_secs(1))?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn try_read_for(&self, key: &str, timeout: Duration) -> Result<Option<LockGuard<C>>> {
        let raw = self.mode_raw(Mode::Read)?;
        self.acquire(&*raw, key, Deadline::after(timeout), None)
    }

    /// Waits until `deadline` at the latest to take `key` as a reader; `Ok(None)` when it passes.
    ///
    /// # Errors
    /// As for [`read`](Self::read).
    ///
    /// # Examples
    /// ```
    /// use std::time::{Duration, Instant};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let soon = Instant::now() + Duration::from_secs(1);
    /// assert!(locker.try_read_until("catalog", soon)?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn try_read_until(&self, key: &str, deadline: Instant) -> Result<Option<LockGuard<C>>> {
        let raw = self.mode_raw(Mode::Read)?;
        self.acquire(&*raw, key, Deadline::At(deadline), None)
    }

    /// Takes `key` as its one writer, waiting as long as it takes: no reader, no permit
    /// holder and no other writer holds it meanwhile. On every strategy the writer is the
    /// key's exclusive lock, the same lock as [`lock`](Self::lock).
    ///
    /// Writers do not starve under a stream of readers. `Advisory` (PostgreSQL): the server
    /// queues a new reader behind a writer waiting in its lock queue. `Lease`: an exclusive
    /// lock that waits (`lock`, `write`, `try_lock_for`…, not one `try_lock`) and finds the
    /// key held takes a place in the key's line in the database, and while a live place is
    /// there no new reader or permit gets in; so it waits at most until the holders of the
    /// moment it took its place have left. A waiter that gives up (its deadline, a
    /// cancellation) leaves the line; one that dies lets its place lapse. `ForUpdate`: MySQL queues a new
    /// reader behind a waiting writer; PostgreSQL does not, so there a waiting writer marks
    /// the key (renewed every second it waits, cleared when it gets in or gives up, gone
    /// 2 s after its process dies) and readers wait while the mark lives.
    ///
    /// # Errors
    /// As for [`read`](Self::read).
    ///
    /// # Examples
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let w = locker.write("catalog")?;
    /// assert!(locker.try_read("catalog")?.is_none());
    /// assert!(locker.try_write("catalog")?.is_none());
    /// # drop(w);
    /// # Ok(()) }
    /// ```
    pub fn write(&self, key: &str) -> Result<LockGuard<C>> {
        let raw = self.mode_raw(Mode::Write)?;
        match self.acquire(&*raw, key, Deadline::Never, None)? {
            Some(guard) => Ok(guard),
            None => unreachable!("waiting without a deadline only ends with the lock"),
        }
    }

    /// One attempt to take `key` as its writer. It takes no place in line: readers are not
    /// held back by a writer that does not wait.
    ///
    /// # Errors
    /// As for [`read`](Self::read).
    ///
    /// # Examples
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let r = locker.read("catalog")?;
    /// assert!(locker.try_write("catalog")?.is_none());
    /// assert!(locker.try_read("catalog")?.is_some()); // it left no place in line
    /// # drop(r);
    /// # Ok(()) }
    /// ```
    pub fn try_write(&self, key: &str) -> Result<Option<LockGuard<C>>> {
        let raw = self.mode_raw(Mode::Write)?;
        self.acquire(&*raw, key, Deadline::Once, None)
    }

    /// Waits at most `timeout` to take `key` as its writer.
    ///
    /// # Errors
    /// As for [`read`](Self::read).
    ///
    /// # Examples
    /// ```
    /// use std::time::{Duration, Instant};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// assert!(locker.try_write_for("catalog", Duration::from_secs(1))?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn try_write_for(&self, key: &str, timeout: Duration) -> Result<Option<LockGuard<C>>> {
        let raw = self.mode_raw(Mode::Write)?;
        self.acquire(&*raw, key, Deadline::after(timeout), None)
    }

    /// Waits until `deadline` at the latest to take `key` as its writer; `Ok(None)` when it passes.
    ///
    /// # Errors
    /// As for [`write`](Self::write).
    ///
    /// # Examples
    /// ```
    /// use std::time::{Duration, Instant};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let reader = locker.read("catalog")?;
    /// let soon = Instant::now() + Duration::from_millis(20);
    /// assert!(locker.try_write_until("catalog", soon)?.is_none()); // a reader holds it
    /// drop(reader);
    /// assert!(locker.try_write_until("catalog", soon + Duration::from_secs(1))?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn try_write_until(&self, key: &str, deadline: Instant) -> Result<Option<LockGuard<C>>> {
        let raw = self.mode_raw(Mode::Write)?;
        self.acquire(&*raw, key, Deadline::At(deadline), None)
    }

    /// Takes one of `permits` permits of the semaphore `key`, waiting as long as it takes:
    /// at most `permits` guards hold the key at once.
    ///
    /// The number is stored with the key by its first acquisition; asking with another one
    /// is an error ([`Error::Permits`](crate::Error::Permits)), never a silent change, and so
    /// is a semaphore's key taken as a reader, or a reader-writer key as a semaphore. The
    /// key's exclusive lock ([`lock`](Self::lock)) excludes every permit holder and waits
    /// for them. `Lease` (every backend): each permit is a lease of its own, renewed by a
    /// heartbeat, so a crashed holder's permit returns after the `Locker`'s ttl. `ForUpdate`
    /// (PostgreSQL, MySQL) and `Advisory` (PostgreSQL; at most 1,000 permits): each permit is
    /// a slot held by the guard's session (a row locked `FOR UPDATE SKIP LOCKED`, or an
    /// advisory lock) beside the key's own lock in shared mode, so a crashed holder's permit
    /// returns when the server sees its session end; with every slot taken a waiter pauses
    /// and tries again. Each guard carries a fencing token; a key's tokens strictly increase.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) for 0 permits (or more than
    /// 1,000 with a session strategy);
    /// [`Error::Unsupported`](crate::Error::Unsupported) for strategies without semaphores
    /// (`Row`, `AdvisoryXact`);
    /// [`Error::Incompatible`](crate::Error::Incompatible) for `Advisory` on MySQL, whose
    /// `GET_LOCK` has no shared mode to keep the key's exclusive lock out;
    /// `Error::Permits` as above; otherwise as for [`lock`](Self::lock).
    ///
    /// # Examples
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// use diesel_lock::Error;
    ///
    /// let a = locker.permit("crawler", 2)?;
    /// let b = locker.permit("crawler", 2)?;
    /// assert!(locker.try_permit("crawler", 2)?.is_none()); // both taken
    /// assert!(matches!(locker.try_permit("crawler", 3), Err(Error::Permits { .. })));
    /// drop(a);
    /// assert!(locker.try_permit("crawler", 2)?.is_some());
    /// # drop(b);
    /// # Ok(()) }
    /// ```
    pub fn permit(&self, key: &str, permits: u32) -> Result<LockGuard<C>> {
        let raw = self.mode_raw(Mode::Permits(permits))?;
        match self.acquire(&*raw, key, Deadline::Never, None)? {
            Some(guard) => Ok(guard),
            None => unreachable!("waiting without a deadline only ends with the lock"),
        }
    }

    /// One attempt at a permit of the semaphore `key`: `Ok(None)` while all `permits` are
    /// held.
    ///
    /// # Errors
    /// As for [`permit`](Self::permit).
    ///
    /// # Examples
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let only = locker.try_permit("single", 1)?.expect("free");
    /// assert!(locker.try_permit("single", 1)?.is_none());
    /// # drop(only);
    /// # Ok(()) }
    /// ```
    pub fn try_permit(&self, key: &str, permits: u32) -> Result<Option<LockGuard<C>>> {
        let raw = self.mode_raw(Mode::Permits(permits))?;
        self.acquire(&*raw, key, Deadline::Once, None)
    }

    /// Waits at most `timeout` for a permit of the semaphore `key`.
    ///
    /// # Errors
    /// As for [`permit`](Self::permit).
    ///
    /// # Examples
    /// ```
    /// use std::time::{Duration, Instant};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let held = locker.permit("single", 1)?;
    /// assert!(locker.try_permit_for("single", 1, Duration::from_millis(20))?.is_none());
    /// # drop(held);
    /// # Ok(()) }
    /// ```
    pub fn try_permit_for(
        &self,
        key: &str,
        permits: u32,
        timeout: Duration,
    ) -> Result<Option<LockGuard<C>>> {
        let raw = self.mode_raw(Mode::Permits(permits))?;
        self.acquire(&*raw, key, Deadline::after(timeout), None)
    }

    /// Waits until `deadline` at the latest to take a permit of the semaphore `key`; `Ok(None)` when it passes.
    ///
    /// # Errors
    /// As for [`permit`](Self::permit).
    ///
    /// # Examples
    /// ```
    /// use std::time::{Duration, Instant};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let held = locker.permit("single", 1)?;
    /// let soon = Instant::now() + Duration::from_millis(20);
    /// assert!(locker.try_permit_until("single", 1, soon)?.is_none());
    /// # drop(held);
    /// # Ok(()) }
    /// ```
    pub fn try_permit_until(
        &self,
        key: &str,
        permits: u32,
        deadline: Instant,
    ) -> Result<Option<LockGuard<C>>> {
        let raw = self.mode_raw(Mode::Permits(permits))?;
        self.acquire(&*raw, key, Deadline::At(deadline), None)
    }

    /// Waits to take `key` as a reader until `deadline` (`None`: as long as it takes) unless
    /// `cancel` is cancelled first: `Ok(None)` then. As
    /// [`try_lock_cancellable`](Self::try_lock_cancellable), for readers.
    ///
    /// # Errors
    /// As for [`read`](Self::read).
    ///
    /// # Examples
    /// ```
    /// use diesel_lock::Cancel;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let cancel = Cancel::new();
    /// assert!(locker.try_read_cancellable("catalog", None, &cancel)?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn try_read_cancellable(
        &self,
        key: &str,
        deadline: Option<Instant>,
        cancel: &Cancel,
    ) -> Result<Option<LockGuard<C>>> {
        let raw = self.mode_raw(Mode::Read)?;
        let deadline = deadline.map_or(Deadline::Never, Deadline::At);
        self.acquire(&*raw, key, deadline, Some(cancel))
    }

    /// Waits for a permit of the semaphore `key` until `deadline` (`None`: as long as it
    /// takes) unless `cancel` is cancelled first: `Ok(None)` then.
    ///
    /// # Errors
    /// As for [`permit`](Self::permit).
    ///
    /// # Examples
    /// ```
    /// use diesel_lock::Cancel;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let cancel = Cancel::new();
    /// assert!(locker.try_permit_cancellable("pool", 2, None, &cancel)?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn try_permit_cancellable(
        &self,
        key: &str,
        permits: u32,
        deadline: Option<Instant>,
        cancel: &Cancel,
    ) -> Result<Option<LockGuard<C>>> {
        let raw = self.mode_raw(Mode::Permits(permits))?;
        let deadline = deadline.map_or(Deadline::Never, Deadline::At);
        self.acquire(&*raw, key, deadline, Some(cancel))
    }

    /// Waits to take `key` as its writer until `deadline` (`None`: as long as it takes)
    /// unless `cancel` is cancelled first: `Ok(None)` then.
    ///
    /// # Errors
    /// As for [`read`](Self::read).
    ///
    /// # Examples
    /// ```
    /// use diesel_lock::Cancel;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let cancel = Cancel::new();
    /// assert!(locker.try_write_cancellable("catalog", None, &cancel)?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn try_write_cancellable(
        &self,
        key: &str,
        deadline: Option<Instant>,
        cancel: &Cancel,
    ) -> Result<Option<LockGuard<C>>> {
        let raw = self.mode_raw(Mode::Write)?;
        let deadline = deadline.map_or(Deadline::Never, Deadline::At);
        self.acquire(&*raw, key, deadline, Some(cancel))
    }
}

impl<C: LockConnection> Locker<C> {
    /// The raw lock of `mode`: the strategy's (`RawLock::mode`), or `Error::Unsupported`.
    fn mode_raw(&self, mode: Mode) -> Result<Arc<dyn RawLock<C>>> {
        if let Mode::Permits(0) = mode {
            return Err(Error::InvalidConfig(
                "a semaphore needs at least one permit".into(),
            ));
        }
        match self.inner.raw.mode(mode)? {
            Some(ModeLock::Own) => Ok(self.inner.raw.clone()),
            Some(ModeLock::Other(raw)) => Ok(raw),
            None => Err(Error::Unsupported {
                strategy: unsupported_name(self.inner.strategy.name(), mode),
                backend: self.inner.backend.name(),
            }),
        }
    }
}

/// The name `Error::Unsupported` gives a mode the strategy lacks.
fn unsupported_name(strategy: &'static str, mode: Mode) -> &'static str {
    match (strategy, mode) {
        ("row", Mode::Permits(_)) => "row (semaphore)",
        ("advisory", Mode::Permits(_)) => "advisory (semaphore)",
        ("for-update", Mode::Permits(_)) => "for-update (semaphore)",
        ("advisory-xact", Mode::Permits(_)) => "advisory-xact (semaphore)",
        (_, Mode::Permits(_)) => "semaphore",
        ("row", _) => "row (shared mode)",
        ("advisory", _) => "advisory (shared mode)",
        ("for-update", _) => "for-update (shared mode)",
        ("advisory-xact", _) => "advisory-xact (shared mode)",
        _ => "shared mode",
    }
}
