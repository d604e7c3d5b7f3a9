//! `lock_all`: several keys at once, all or nothing.

use super::deadline::Deadline;
use super::{Cancel, Locker};
use crate::backend::LockConnection;
use crate::guard::LockGuard;
use crate::{key, Result};
use std::time::{Duration, Instant};

/// The guards of several keys taken at once by [`Locker::lock_all`]. Dropping it releases
/// them all (in the reverse order of acquisition); [`release`](Self::release) does the same
/// and reports the first failure.
///
/// ```
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
/// # locker.migrate()?;
/// let both = locker.lock_all(&["account/7", "account/3"])?;
/// assert_eq!(both.keys().collect::<Vec<_>>(), ["account/3", "account/7"]); // sorted
/// assert!(locker.try_lock("account/7")?.is_none());
/// both.release()?;
/// assert!(locker.try_lock("account/7")?.is_some());
/// # Ok(()) }
/// ```
#[must_use = "if unused the locks are released immediately"]
#[derive(Debug)]
pub struct MultiGuard<C: LockConnection> {
    /// In the order taken (the keys' byte order).
    guards: Vec<LockGuard<C>>,
}

impl<C: LockConnection> MultiGuard<C> {
    /// The keys held, in byte order (the order they were taken in), without repeats.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let g = locker.lock_all(&["b", "a", "b"])?;
    /// assert_eq!(g.keys().collect::<Vec<_>>(), ["a", "b"]);
    /// # Ok(()) }
    /// ```
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.guards.iter().map(LockGuard::key)
    }

    /// The guard of each key, in byte order of the keys: each with its own fencing token.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let g = locker.lock_all(&["x", "y"])?;
    /// for guard in g.guards() {
    ///     println!("{} with token {}", guard.key(), guard.token());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn guards(&self) -> &[LockGuard<C>] {
        &self.guards
    }

    /// [`LockGuard::check`] of every key.
    ///
    /// # Errors
    /// The first key's error, as `LockGuard::check` reports it.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// locker.lock_all(&["x", "y"])?.check()?;
    /// # Ok(()) }
    /// ```
    pub fn check(&self) -> Result<()> {
        self.guards.iter().try_for_each(LockGuard::check)
    }

    /// Releases every lock (each is attempted) and reports the first failure.
    ///
    /// # Errors
    /// As [`LockGuard::release`], for the first key whose release failed.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// locker.lock_all(&["x", "y"])?.release()?;
    /// # Ok(()) }
    /// ```
    pub fn release(mut self) -> Result<()> {
        let mut first = Ok(());
        while let Some(guard) = self.guards.pop() {
            let r = guard.release();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl<C: LockConnection> Drop for MultiGuard<C> {
    fn drop(&mut self) {
        while let Some(guard) = self.guards.pop() {
            drop(guard);
        }
    }
}

impl<C: LockConnection> Locker<C> {
    /// Locks every key of `keys`, waiting as long as it takes: all of them or none.
    ///
    /// The keys are taken one by one in byte order (repeats count once), each as
    /// [`lock`](Self::lock) would take it, so callers naming the same keys in different
    /// orders cannot deadlock: whoever holds the smallest contested key goes on, the others
    /// wait for it holding only smaller keys. A session strategy's guard keeps a pooled
    /// connection per key: size the pool for the keys held at once plus the waiters.
    ///
    /// # Errors
    /// As for [`lock`](Self::lock); an invalid key is refused before anything is taken, and
    /// on any error the keys taken so far are released.
    ///
    /// # Examples
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let transfer = locker.lock_all(&["account/42", "account/7"])?;
    /// // ... move money between the two accounts ...
    /// transfer.release()?;
    /// # Ok(()) }
    /// ```
    pub fn lock_all(&self, keys: &[&str]) -> Result<MultiGuard<C>> {
        match self.all(keys, Deadline::Never, None)? {
            Some(guard) => Ok(guard),
            None => unreachable!("waiting without a deadline only ends with the locks"),
        }
    }

    /// One attempt per key, in byte order: `Ok(None)`, with every key taken so far released,
    /// as soon as one is held by someone else.
    ///
    /// # Errors
    /// As for [`lock_all`](Self::lock_all).
    ///
    /// # Examples
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let b = locker.lock("b")?;
    /// assert!(locker.try_lock_all(&["a", "b"])?.is_none());
    /// assert!(locker.try_lock("a")?.is_some()); // "a" was given back
    /// # drop(b);
    /// # Ok(()) }
    /// ```
    pub fn try_lock_all(&self, keys: &[&str]) -> Result<Option<MultiGuard<C>>> {
        self.all(keys, Deadline::Once, None)
    }

    /// Waits at most `timeout` for all of the keys: `Ok(None)`, with every key taken so far
    /// released, when the deadline passes.
    ///
    /// # Errors
    /// As for [`lock_all`](Self::lock_all).
    ///
    /// # Examples
    /// ```
    /// use std::time::Duration;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let b = locker.lock("b")?;
    /// assert!(locker.try_lock_all_for(&["a", "b"], Duration::from_millis(20))?.is_none());
    /// drop(b);
    /// assert!(locker.try_lock_all_for(&["a", "b"], Duration::from_secs(5))?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn try_lock_all_for(
        &self,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<Option<MultiGuard<C>>> {
        self.all(keys, Deadline::after(timeout), None)
    }

    /// Waits until `deadline` at the latest for all of the keys; see
    /// [`try_lock_all_for`](Self::try_lock_all_for).
    ///
    /// # Errors
    /// As for [`lock_all`](Self::lock_all).
    ///
    /// # Examples
    /// ```
    /// use std::time::{Duration, Instant};
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let soon = Instant::now() + Duration::from_secs(2);
    /// assert!(locker.try_lock_all_until(&["a", "b"], soon)?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn try_lock_all_until(
        &self,
        keys: &[&str],
        deadline: Instant,
    ) -> Result<Option<MultiGuard<C>>> {
        self.all(keys, Deadline::At(deadline), None)
    }

    /// Waits for all of the keys until `deadline` (`None`: as long as it takes) unless
    /// `cancel` is cancelled first, from another thread: `Ok(None)` then, with every key
    /// taken so far released. As [`try_lock_cancellable`](Self::try_lock_cancellable), for
    /// several keys.
    ///
    /// # Errors
    /// As for [`lock_all`](Self::lock_all).
    ///
    /// # Examples
    /// ```
    /// use diesel_lock::Cancel;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let held = locker.lock("b")?;
    /// let cancel = Cancel::new();
    /// let waiter = cancel.clone();
    /// std::thread::scope(|s| -> diesel_lock::Result<()> {
    ///     let wait = s.spawn(|| locker.try_lock_all_cancellable(&["a", "b"], None, &waiter));
    ///     cancel.cancel(); // from this thread: the wait ends without the locks
    ///     assert!(wait.join().unwrap()?.is_none());
    ///     Ok(())
    /// })?;
    /// assert!(locker.try_lock("a")?.is_some()); // "a" was given back
    /// # drop(held);
    /// # Ok(()) }
    /// ```
    pub fn try_lock_all_cancellable(
        &self,
        keys: &[&str],
        deadline: Option<Instant>,
        cancel: &Cancel,
    ) -> Result<Option<MultiGuard<C>>> {
        let deadline = deadline.map_or(Deadline::Never, Deadline::At);
        self.all(keys, deadline, Some(cancel))
    }

    fn all(
        &self,
        keys: &[&str],
        deadline: Deadline,
        cancel: Option<&Cancel>,
    ) -> Result<Option<MultiGuard<C>>> {
        for k in keys {
            key::validate(k)?;
        }
        let mut sorted = keys.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let mut guards = Vec::with_capacity(sorted.len());
        for k in sorted {
            match self.exclusive(k, deadline, cancel)? {
                Some(g) => guards.push(g),
                // Dropping `guards` gives back what was taken.
                None => return Ok(None),
            }
        }
        Ok(Some(MultiGuard { guards }))
    }
}
