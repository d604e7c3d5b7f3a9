//! `Cancel`: ends a wait for a lock from another thread.

use crate::sync::Unpoison;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Ends a wait for a lock from another thread: the wait of
/// [`Locker::try_lock_cancellable`](crate::Locker::try_lock_cancellable) returns `Ok(None)`
/// soon after [`cancel`](Self::cancel) is called (at once for a wait in the `Locker`'s own
/// queue or between polls; a session strategy's wait in the server's lock queue is ended
/// by ending its database session, from another pooled connection).
///
/// A cancelled wait never returns a guard: a lock granted at the moment of cancelling is
/// released again. Once cancelled, a `Cancel` stays cancelled; clones share its state, and
/// one `Cancel` may serve many waits at once (e.g. every wait of a program, on Ctrl-C).
///
/// Ending a server-side wait takes a connection from the waiting `Locker`'s pool: `cancel`
/// waits for one as the pool allows (its `connection_timeout`), one wait after another. If
/// none is free, that wait cannot be reached: it goes on until its deadline or until it is
/// granted the lock, which it then gives back and returns `Ok(None)`. Size the pool with one
/// connection to spare. Only a wait still under way is ended: a session whose wait has
/// ended, and which may hold another lock by now, is never touched.
///
/// ```
/// use diesel_lock::{Cancel, Locker};
/// use std::time::Duration;
///
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = dir.path().join("locks.db");
/// let locker = Locker::connect(url.to_str().unwrap())?.build()?;
/// locker.migrate()?;
/// let held = locker.lock("deploy")?;
///
/// let cancel = Cancel::new();
/// let waiter = {
///     let (locker, cancel) = (locker.clone(), cancel.clone());
///     std::thread::spawn(move || locker.try_lock_cancellable("deploy", None, &cancel))
/// };
/// std::thread::sleep(Duration::from_millis(50)); // (only to let it start waiting)
/// cancel.cancel(); // e.g. on Ctrl-C
/// assert!(waiter.join().unwrap()?.is_none()); // gave up, without the lock
/// drop(held);
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct Cancel {
    inner: Arc<State>,
}

#[derive(Default)]
struct State {
    cancelled: AtomicBool,
    /// What to run on cancelling: wake the waiters of a key, end a session's wait.
    hooks: Mutex<Hooks>,
}

#[derive(Default)]
struct Hooks {
    next: u64,
    registered: HashMap<u64, Hook>,
}

type Hook = Arc<dyn Fn() + Send + Sync>;

impl std::fmt::Debug for Cancel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cancel")
            .field("cancelled", &self.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl Cancel {
    /// A handle that has not been cancelled.
    ///
    /// ```
    /// let cancel = diesel_lock::Cancel::new();
    /// assert!(!cancel.is_cancelled());
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels every wait given this handle (or a clone of it), now and later.
    ///
    /// ```
    /// let cancel = diesel_lock::Cancel::new();
    /// cancel.cancel();
    /// assert!(cancel.clone().is_cancelled());
    /// ```
    pub fn cancel(&self) {
        self.inner.cancelled.store(true, Ordering::SeqCst);
        // Run outside the mutex: a hook takes other locks, and may take a while (it may
        // have to open a connection to end a session).
        let hooks: Vec<Hook> = self
            .inner
            .hooks
            .lock()
            .unpoisoned()
            .registered
            .values()
            .cloned()
            .collect();
        for hook in hooks {
            hook();
        }
    }

    /// True once [`cancel`](Self::cancel) was called on this handle or a clone.
    ///
    /// ```
    /// use diesel_lock::Cancel;
    ///
    /// let cancel = Cancel::new();
    /// let on_ctrl_c = cancel.clone(); // e.g. moved into a signal handler's thread
    /// assert!(!cancel.is_cancelled());
    /// on_ctrl_c.cancel();
    /// assert!(cancel.is_cancelled()); // clones share the state
    /// ```
    pub fn is_cancelled(&self) -> bool {
        self.inner.cancelled.load(Ordering::SeqCst)
    }

    /// Runs `hook` when cancelled while the returned registration lives; at once if the
    /// handle is cancelled already.
    pub(crate) fn on_cancel(&self, hook: Hook) -> Registration<'_> {
        let id = {
            let mut hooks = self.inner.hooks.lock().unpoisoned();
            hooks.next += 1;
            let id = hooks.next;
            hooks.registered.insert(id, hook.clone());
            id
        };
        // After registering: a `cancel` that set the flag before we looked has either seen
        // the hook or is seen here.
        if self.is_cancelled() {
            hook();
        }
        Registration { cancel: self, id }
    }
}

/// A hook's registration; dropping it removes the hook.
pub(crate) struct Registration<'a> {
    cancel: &'a Cancel,
    id: u64,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.cancel
            .inner
            .hooks
            .lock()
            .unpoisoned()
            .registered
            .remove(&self.id);
    }
}
