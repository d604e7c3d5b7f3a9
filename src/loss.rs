//! Lost-lock notification: what a guard offers besides `check()` to be told, without asking,
//! that its lock is gone ([`LockGuard::wait_lost`](crate::LockGuard::wait_lost),
//! [`LockGuard::on_lost`](crate::LockGuard::on_lost), [`LossWatch`]).
//!
//! Each guard has one [`Loss`]: its status (held, lost, released) behind a mutex and a
//! condvar. Whatever learns of a loss marks it: the lease heartbeat (a renewal that matched
//! no row), a lease's local deadline (`strategy/validity.rs` keeps `until` here in step with
//! its own, so a waiter wakes at that instant without anyone asking the database), a
//! `check()` that found the lock gone, and, for the strategies that nothing tells
//! (`Row`, `ForUpdate`, `Advisory`), the `Locker`'s watcher (`watcher.rs`), which asks
//! `Hold::held` once per `Hold::probe_every`. Marking never runs user code: a watched
//! `Loss` sends itself to the watcher, which runs the callbacks on threads of its own,
//! outside every lock of the library, so a callback may call anything (even `check()`)
//! without deadlocking.
//!
//! A release first sets `releasing`, which makes every later mark a no-op (a renewal racing
//! the release's own delete must not report a loss), then ends in `Released`, or in `Lost`
//! if the release found the lock no longer ours.

use crate::instrument::Meter;
use crate::sync::Unpoison;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The status of a guard's lock as its [`LossWatch`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockStatus {
    /// Held, as far as the library knows.
    Held,
    /// Lost: the lease expired or was taken over, the row was taken over or removed by
    /// force, the session holding it ended. For good.
    Lost,
    /// Released by its guard (normally: a release that found the lock already gone is
    /// `Lost`).
    Released,
}

type Callback = Box<dyn FnOnce() + Send>;

/// How a lock's loss reaches the `Locker`'s watcher (`watcher.rs`), which runs the
/// callbacks: it must not block (a send on a channel), as it is called under the status's
/// mutex.
pub(crate) type Tell = Box<dyn Fn(Arc<Loss>) + Send>;

struct State {
    status: LockStatus,
    /// A release is under way: nothing marks the lock lost any more except the release.
    releasing: bool,
    /// A lease's local deadline: past it, the lock is lost (see `validity.rs`).
    until: Option<Instant>,
    callbacks: Vec<Callback>,
    /// The `Locker`'s watcher watches it: told of the loss (once) through this.
    tell: Option<Tell>,
    /// The labels of the losses counted (set by the guard once made).
    meter: Option<Meter>,
}

/// One guard's loss status, shared by the guard, its strategy (a lease's `Validity`), its
/// `Locker`'s watcher and every [`LossWatch`].
pub(crate) struct Loss {
    state: Mutex<State>,
    changed: Condvar,
    /// Itself, for `tell`.
    me: std::sync::Weak<Loss>,
}

impl std::fmt::Debug for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loss")
            .field("status", &self.state().status)
            .finish_non_exhaustive()
    }
}

impl Loss {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new_cyclic(|me| Loss {
            state: Mutex::new(State {
                status: LockStatus::Held,
                releasing: false,
                until: None,
                callbacks: Vec::new(),
                tell: None,
                meter: None,
            }),
            changed: Condvar::new(),
            me: me.clone(),
        })
    }

    /// The state with the deadline applied. A leaf lock: nothing is called while it is held.
    fn state(&self) -> MutexGuard<'_, State> {
        let mut st = self.state.lock().unpoisoned();
        if st.status == LockStatus::Held
            && !st.releasing
            && st.until.is_some_and(|u| Instant::now() >= u)
        {
            self.lose(&mut st);
        }
        st
    }

    /// Held → lost: waiters woken, the loss counted, the watcher told.
    fn lose(&self, st: &mut State) {
        st.status = LockStatus::Lost;
        if let Some(meter) = st.meter {
            meter.lost();
        }
        self.changed.notify_all();
        self.tell(st);
    }

    fn tell(&self, st: &State) {
        if let (Some(tell), Some(me)) = (&st.tell, self.me.upgrade()) {
            tell(me);
        }
    }

    /// The labels under which a loss is counted; a loss before (between the acquisition and
    /// the guard) is counted now.
    pub(crate) fn set_meter(&self, meter: Meter) {
        let mut st = self.state();
        st.meter = Some(meter);
        if st.status == LockStatus::Lost {
            meter.lost();
        }
    }

    /// The lock is lost (unless a release is under way or it ended already).
    pub(crate) fn mark_lost(&self) {
        let mut st = self.state();
        if st.status == LockStatus::Held && !st.releasing {
            self.lose(&mut st);
        }
    }

    /// Moves a lease's local deadline (called by `Validity` under its own mutex, so that the
    /// two never disagree).
    pub(crate) fn set_until(&self, until: Instant) {
        let mut st = self.state();
        st.until = Some(until);
    }

    /// A release begins: from now on only its outcome changes the status.
    pub(crate) fn begin_release(&self) {
        self.state().releasing = true;
    }

    /// The release ended: `Lost` if it found the lock no longer ours, else `Released`.
    pub(crate) fn end_release(&self, lost: bool) {
        let mut st = self.state();
        if st.status == LockStatus::Held {
            if lost {
                self.lose(&mut st);
            } else {
                st.status = LockStatus::Released;
            }
        }
        if st.status == LockStatus::Released {
            st.callbacks.clear();
        }
        self.changed.notify_all();
    }

    pub(crate) fn status(&self) -> LockStatus {
        self.state().status
    }

    /// Waits until the status is no longer `Held`, or `deadline` passes (`None`: no
    /// deadline). Returns the status then.
    pub(crate) fn wait_until(&self, deadline: Option<Instant>) -> LockStatus {
        let mut st = self.state();
        loop {
            if st.status != LockStatus::Held {
                return st.status;
            }
            let now = Instant::now();
            // Wake at the lease's deadline too (unless a release is under way).
            let until = st.until.filter(|_| !st.releasing);
            let wake = match (deadline, until) {
                (Some(d), Some(u)) => Some(d.min(u)),
                (d, u) => d.or(u),
            };
            if deadline.is_some_and(|d| now >= d) {
                return st.status;
            }
            st = match wake {
                Some(w) => {
                    let left = w.saturating_duration_since(now);
                    let (g, _) = self.changed.wait_timeout(st, left).unpoisoned();
                    drop(g);
                    self.state()
                }
                None => {
                    let g = self.changed.wait(st).unpoisoned();
                    drop(g);
                    self.state()
                }
            };
        }
    }

    /// Adds a callback for the watcher; runs it at once if the lock is lost already,
    /// drops it if it was released.
    fn on_lost(&self, f: Callback) {
        let mut st = self.state();
        match st.status {
            LockStatus::Held => st.callbacks.push(f),
            LockStatus::Lost => {
                drop(st);
                f();
            }
            LockStatus::Released => {}
        }
    }

    /// The callbacks not run yet, taken out to be run (by the watcher, once lost).
    pub(crate) fn take_callbacks(&self) -> Vec<Callback> {
        std::mem::take(&mut self.state().callbacks)
    }

    /// The first time (true): from now on a loss is told through `tell`, at once if the
    /// lock is lost already.
    pub(crate) fn start_watching(&self, tell: impl FnOnce() -> Tell) -> bool {
        let mut st = self.state();
        if st.tell.is_some() {
            return false;
        }
        st.tell = Some(tell());
        if st.status == LockStatus::Lost {
            self.tell(&st);
        }
        true
    }

    /// Whether the watcher watches it (`start_watching` was called).
    pub(crate) fn watched(&self) -> bool {
        self.state().tell.is_some()
    }

    /// When to look at it next for a lease's local deadline: `None` if it has none, or it is
    /// no longer held, or a release is under way.
    pub(crate) fn until(&self) -> Option<Instant> {
        let st = self.state();
        (st.status == LockStatus::Held && !st.releasing)
            .then_some(st.until)
            .flatten()
    }
}

/// A handle on a guard's lock status, to wait for its loss from anywhere (it is `Clone`,
/// `Send` and `Sync`, and may outlive the guard). Made by
/// [`LockGuard::loss_watch`](crate::LockGuard::loss_watch).
///
/// ```
/// use diesel_lock::LockStatus;
/// use std::time::Duration;
///
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
/// # locker.migrate()?;
/// let guard = locker.lock("reports")?;
/// let watch = guard.loss_watch();
/// let waiter = std::thread::spawn(move || watch.wait(Duration::from_secs(60)));
/// guard.release()?;
/// assert_eq!(waiter.join().unwrap(), LockStatus::Released); // not a loss
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LossWatch {
    loss: Arc<Loss>,
}

impl std::fmt::Debug for LossWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LossWatch")
            .field("status", &self.status())
            .finish()
    }
}

impl LossWatch {
    pub(crate) fn new(loss: Arc<Loss>) -> Self {
        LossWatch { loss }
    }

    /// The status now, without waiting or asking the database.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let guard = locker.lock("k")?;
    /// let watch = guard.loss_watch();
    /// assert_eq!(watch.status(), diesel_lock::LockStatus::Held);
    /// drop(guard);
    /// assert_eq!(watch.status(), diesel_lock::LockStatus::Released);
    /// # Ok(()) }
    /// ```
    pub fn status(&self) -> LockStatus {
        self.loss.status()
    }

    /// Waits at most `timeout` for the lock to be lost or released: `Held` if neither
    /// happened by then.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let guard = locker.lock("k")?;
    /// let status = guard.loss_watch().wait(std::time::Duration::from_millis(10));
    /// assert_eq!(status, diesel_lock::LockStatus::Held);
    /// # Ok(()) }
    /// ```
    pub fn wait(&self, timeout: Duration) -> LockStatus {
        self.loss.wait_until(Instant::now().checked_add(timeout))
    }

    /// Waits until `deadline` (`None`: as long as it takes) for the lock to be lost or
    /// released.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let guard = locker.lock("k")?;
    /// let watch = guard.loss_watch();
    /// drop(guard);
    /// assert_eq!(watch.wait_until(None), diesel_lock::LockStatus::Released);
    /// # Ok(()) }
    /// ```
    pub fn wait_until(&self, deadline: Option<Instant>) -> LockStatus {
        self.loss.wait_until(deadline)
    }

    /// Runs `f` once, on a thread of the library, when the lock is lost (at once if it is
    /// lost already); never if it is released. `f` should be quick: send on a channel, set a
    /// flag, signal a process. When `f` runs, [`status`](Self::status) reads
    /// [`LockStatus::Lost`]. Locks lost at the same moment (forced releases of many keys, say)
    /// are each found and told on their own, in no set order: one's callback may run while
    /// another still reads `Held`.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let locker = diesel_lock::Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
    /// # locker.migrate()?;
    /// let guard = locker.lock("k")?;
    /// let (tx, rx) = std::sync::mpsc::channel::<()>();
    /// guard.loss_watch().on_lost(move || { let _ = tx.send(()); });
    /// guard.release()?;
    /// assert!(rx.recv().is_err()); // released, not lost: the callback was dropped unrun
    /// # Ok(()) }
    /// ```
    pub fn on_lost(&self, f: impl FnOnce() + Send + 'static) {
        self.loss.on_lost(Box::new(f));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_marks_the_loss_and_wakes_the_waiter() {
        let loss = Loss::new();
        let until = Instant::now() + Duration::from_millis(50);
        loss.set_until(until);
        assert_eq!(loss.status(), LockStatus::Held);
        // No deadline of its own: only the lease's wakes it.
        assert_eq!(loss.wait_until(None), LockStatus::Lost);
        assert!(Instant::now() >= until);
    }

    #[test]
    fn a_release_under_way_is_never_reported_as_a_loss() {
        let loss = Loss::new();
        loss.set_until(Instant::now() + Duration::from_millis(30));
        loss.begin_release();
        std::thread::sleep(Duration::from_millis(40)); // the deadline passes mid-release
        loss.mark_lost(); // a renewal racing the release's delete
        assert_eq!(loss.status(), LockStatus::Held);
        loss.end_release(false);
        assert_eq!(loss.wait_until(None), LockStatus::Released);
        loss.mark_lost();
        assert_eq!(
            loss.status(),
            LockStatus::Released,
            "released stays released"
        );
    }

    #[test]
    fn a_release_that_found_the_lock_gone_is_a_loss() {
        let loss = Loss::new();
        loss.begin_release();
        loss.end_release(true);
        assert_eq!(loss.status(), LockStatus::Lost);
    }

    #[test]
    fn callbacks_run_once_lost_and_never_once_released() {
        let (tx, rx) = std::sync::mpsc::channel();
        let lost = Loss::new();
        lost.mark_lost();
        let t = tx.clone();
        lost.on_lost(Box::new(move || t.send("late").unwrap())); // at once
        assert_eq!(rx.try_recv(), Ok("late"));
        let released = Loss::new();
        released.on_lost(Box::new(move || tx.send("never").unwrap()));
        released.begin_release();
        released.end_release(false);
        assert!(rx.try_recv().is_err());
        assert!(released.state().callbacks.is_empty(), "dropped unrun");
    }
}
