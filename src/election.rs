//! Leader election: "one of N replicas runs the scheduler", on a lock.
//!
//! An [`Election`] campaigns on one key from a thread of its own: it waits for the lock
//! (`try_lock_cancellable`, so a resignation ends the wait at once), holds it while leader,
//! learns of its loss through the guard's loss notification (`loss.rs`), and campaigns again.
//! The guard's fencing token is the leadership **term**: every new leader's term is greater
//! than every earlier one's, so whatever the leader acts on can refuse a deposed leader's
//! late writes by term.

use crate::backend::LockConnection;
use crate::sync::Unpoison;
use crate::{Cancel, Error, LockGuard, LockStatus, Locker, LossWatch, Result, Strategy};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A change of leadership seen by one [`Election`], sent to its
/// [`subscribe`](Election::subscribe)rs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Leadership {
    /// This replica became the leader, for this term (the lock's fencing token).
    Elected {
        /// The term: greater than every earlier leader's.
        term: i64,
    },
    /// This replica is no longer the leader of this term: its lock was lost, or it
    /// resigned.
    Deposed {
        /// The term that ended.
        term: i64,
    },
}

/// One term of leadership, as [`Election::run_while_leader`] hands it to the leader's work:
/// its number, and whether it still lasts.
///
/// ```
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
/// # let locker = diesel_lock::Locker::builder(pool).strategy(diesel_lock::Strategy::Lease { ttl: std::time::Duration::from_secs(10) }).build()?;
/// # locker.migrate()?;
/// let election = diesel_lock::Election::start(locker, "scheduler")?;
/// let value = election.run_while_leader(std::time::Duration::from_secs(5), |term| {
///     assert!(term.is_current());
///     term.value()
/// });
/// assert_eq!(value, election.term());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Term {
    value: i64,
    watch: LossWatch,
}

impl Term {
    /// The term's number: the lock's fencing token, greater than every earlier leader's.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool).strategy(diesel_lock::Strategy::Lease { ttl: std::time::Duration::from_secs(10) }).build()?;
    /// # locker.migrate()?;
    /// let election = diesel_lock::Election::start(locker, "scheduler")?;
    /// let value = election.run_while_leader(std::time::Duration::from_secs(5), |t| t.value());
    /// assert!(value.unwrap() > 0);
    /// # Ok(()) }
    /// ```
    pub fn value(&self) -> i64 {
        self.value
    }

    /// Whether this replica still leads in this term: false once its lock is lost or it
    /// resigned. Told as [`LockGuard::loss_watch`](crate::LockGuard::loss_watch) is told.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool).strategy(diesel_lock::Strategy::Lease { ttl: std::time::Duration::from_secs(10) }).build()?;
    /// # locker.migrate()?;
    /// let election = diesel_lock::Election::start(locker, "scheduler")?;
    /// assert_eq!(election.run_while_leader(std::time::Duration::from_secs(5), |t| t.is_current()), Some(true));
    /// # Ok(()) }
    /// ```
    pub fn is_current(&self) -> bool {
        self.watch.status() == LockStatus::Held
    }

    /// Waits at most `timeout` for the term to end: true if it has ended by then.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool).strategy(diesel_lock::Strategy::Lease { ttl: std::time::Duration::from_secs(10) }).build()?;
    /// # locker.migrate()?;
    /// let election = diesel_lock::Election::start(locker, "scheduler")?;
    /// let ended = election.run_while_leader(std::time::Duration::from_secs(5), |t| {
    ///     t.wait_ended(std::time::Duration::from_millis(10))
    /// });
    /// assert_eq!(ended, Some(false)); // still leading
    /// # Ok(()) }
    /// ```
    pub fn wait_ended(&self, timeout: Duration) -> bool {
        self.watch.wait(timeout) != LockStatus::Held
    }
}

struct State {
    /// The term while leader, and the watch on its lock.
    leading: Option<(i64, LossWatch)>,
    /// Resigned (or dropped): campaign no more.
    resigned: bool,
    subscribers: Vec<Sender<Leadership>>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    cancel: Cancel,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unpoisoned()
    }

    fn tell(st: &mut State, event: Leadership) {
        st.subscribers.retain(|s| s.send(event).is_ok());
    }
}

/// One replica's candidacy for the leadership of `key`: it campaigns in the background from
/// [`start`](Self::start) on, is the leader while it holds the key's lock, campaigns again
/// after losing it, and resigns (releasing the lock) on [`resign`](Self::resign) or drop.
///
/// The [`term`](Self::term) is the lock's fencing token: strictly greater for every new
/// leader. Give it to what the leader writes, and have that refuse a term lower than one it
/// has seen: a leader that was paused past its lease (and so deposed without knowing) is then
/// refused rather than obeyed.
///
/// Strategies: `Lease` (every backend; a dead or cut-off leader is replaced once its ttl has
/// passed, and a leader cut off from the database knows it is deposed by then too), or, on
/// PostgreSQL and MySQL, `Advisory` or `ForUpdate` (a dead leader is replaced the moment the
/// server ends its session, at no cost while leading but one waiting session per candidate;
/// a leader cut off by a network partition stays leader until the server's TCP keepalives
/// give up, see [`Strategy`]). `Row` is refused: a row lock does not lapse while its holder
/// lives, nor end with it.
///
/// ```
/// use diesel_lock::{Election, Locker, Strategy};
/// use std::time::Duration;
///
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
/// let locker = Locker::builder(pool)
///     .strategy(Strategy::Lease { ttl: Duration::from_secs(10) })
///     .build()?;
/// locker.migrate()?;
/// let a = Election::start(locker.clone(), "scheduler")?;
/// let term = a.wait_leader(Duration::from_secs(5)).expect("the only candidate");
/// let b = Election::start(locker, "scheduler")?;
/// assert!(a.is_leader() && !b.is_leader());
/// a.resign(); // or drop it
/// let next = b.wait_leader(Duration::from_secs(5)).expect("b takes over");
/// assert!(next > term);
/// # Ok(()) }
/// ```
pub struct Election<C: LockConnection> {
    shared: Arc<Shared>,
    key: String,
    thread: Option<JoinHandle<()>>,
    _locker: std::marker::PhantomData<fn() -> C>,
}

impl<C: LockConnection> std::fmt::Debug for Election<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Election")
            .field("key", &self.key)
            .field("term", &self.term())
            .finish_non_exhaustive()
    }
}

impl<C: LockConnection> Election<C> {
    /// Starts campaigning for the leadership of `key` with `locker`'s strategy, on a thread
    /// of its own.
    ///
    /// With `Advisory` or `ForUpdate`, give the `Locker`'s pool at least two connections: a
    /// candidate waits in the server's lock queue on one of them, and resigning (or dropping
    /// the `Election`) ends that wait from another (see [`Cancel`]). With a single connection
    /// a resignation of a waiting candidate takes the pool's `connection_timeout`. A leader
    /// whose session the server ended learns it at the guard's next probe: `is_leader()` may
    /// say true for up to a second while a successor leads; act on the term, which fences the old leader's writes.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a `Row` locker; [`Error::InvalidKey`] for a key that no
    /// lock may have; [`Error::Thread`] if no thread could be started. Database errors
    /// while campaigning are logged and retried (once a second).
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// let rows = diesel_lock::Locker::builder(pool)
    ///     .strategy(diesel_lock::Strategy::Row { stale_after: None })
    ///     .build()?;
    /// assert!(diesel_lock::Election::start(rows, "scheduler").is_err());
    /// # Ok(()) }
    /// ```
    pub fn start(locker: Locker<C>, key: &str) -> Result<Self> {
        if matches!(locker.strategy(), Strategy::Row { .. }) {
            return Err(Error::InvalidConfig(
                "leader election needs a Lease, Advisory or ForUpdate locker: a Row lock does not end with its holder".into(),
            ));
        }
        crate::key::validate(key)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                leading: None,
                resigned: false,
                subscribers: Vec::new(),
            }),
            changed: Condvar::new(),
            cancel: Cancel::new(),
        });
        let (s, k) = (shared.clone(), key.to_owned());
        let thread = std::thread::Builder::new()
            .name("dlock-election".into())
            .spawn(move || campaign(&locker, &k, &s))
            .map_err(Error::Thread)?;
        Ok(Election {
            shared,
            key: key.to_owned(),
            thread: Some(thread),
            _locker: std::marker::PhantomData,
        })
    }

    /// The key campaigned for.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool).strategy(diesel_lock::Strategy::Lease { ttl: std::time::Duration::from_secs(10) }).build()?;
    /// # locker.migrate()?;
    /// let e = diesel_lock::Election::start(locker, "scheduler")?;
    /// assert_eq!(e.key(), "scheduler");
    /// # Ok(()) }
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The current term if this replica is the leader now, as far as it knows without
    /// asking the database (a lease past its local deadline counts as lost: see
    /// [`LockGuard::loss_watch`]).
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool).strategy(diesel_lock::Strategy::Lease { ttl: std::time::Duration::from_secs(10) }).build()?;
    /// # locker.migrate()?;
    /// let e = diesel_lock::Election::start(locker, "scheduler")?;
    /// let term = e.wait_leader(std::time::Duration::from_secs(5));
    /// assert_eq!(e.term(), term);
    /// # Ok(()) }
    /// ```
    pub fn term(&self) -> Option<i64> {
        match &self.shared.lock().leading {
            Some((term, watch)) if watch.status() == LockStatus::Held => Some(*term),
            _ => None,
        }
    }

    /// Whether this replica is the leader now (see [`term`](Self::term)).
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool).strategy(diesel_lock::Strategy::Lease { ttl: std::time::Duration::from_secs(10) }).build()?;
    /// # locker.migrate()?;
    /// let e = diesel_lock::Election::start(locker, "scheduler")?;
    /// e.wait_leader(std::time::Duration::from_secs(5));
    /// assert!(e.is_leader());
    /// # Ok(()) }
    /// ```
    pub fn is_leader(&self) -> bool {
        self.term().is_some()
    }

    /// Waits at most `timeout` for this replica to be the leader; its term if it is.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool).strategy(diesel_lock::Strategy::Lease { ttl: std::time::Duration::from_secs(10) }).build()?;
    /// # locker.migrate()?;
    /// let e = diesel_lock::Election::start(locker, "scheduler")?;
    /// assert!(e.wait_leader(std::time::Duration::from_secs(5)).is_some());
    /// # Ok(()) }
    /// ```
    pub fn wait_leader(&self, timeout: Duration) -> Option<i64> {
        self.wait_term(timeout).map(|t| t.value)
    }

    /// The current term with the watch on its lock, once this replica leads (at most
    /// `timeout`).
    fn wait_term(&self, timeout: Duration) -> Option<Term> {
        let deadline = Instant::now().checked_add(timeout);
        let mut st = self.shared.lock();
        loop {
            if let Some((term, watch)) = &st.leading {
                if watch.status() == LockStatus::Held {
                    return Some(Term {
                        value: *term,
                        watch: watch.clone(),
                    });
                }
            }
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() || st.resigned {
                return None;
            }
            st = self.shared.changed.wait_timeout(st, left).unpoisoned().0;
        }
    }

    /// Runs `work` while this replica leads: waits at most `timeout` to be elected (`None`
    /// if it is not by then), then calls `work` with the [`Term`] and returns what it
    /// returns. The work is the leader's, and the term says for how long: check
    /// [`Term::is_current`] between its steps and stop when it says false, and give
    /// [`Term::value`] to what the work writes, so that a deposed leader's late writes can be
    /// refused. A Curator `LeaderSelector`'s `takeLeadership`, in one call.
    ///
    /// The election goes on after `work` returns: call it again for the next round (or
    /// [`resign`](Self::resign) to hand the leadership over).
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool).strategy(diesel_lock::Strategy::Lease { ttl: std::time::Duration::from_secs(10) }).build()?;
    /// # locker.migrate()?;
    /// let election = diesel_lock::Election::start(locker, "scheduler")?;
    /// let rounds = election.run_while_leader(Duration::from_secs(5), |term| {
    ///     let mut rounds = 0;
    ///     while term.is_current() && rounds < 3 {
    ///         // ... schedule this round's jobs, stamped with term.value() ...
    ///         rounds += 1;
    ///     }
    ///     rounds
    /// });
    /// assert_eq!(rounds, Some(3));
    /// # Ok(()) }
    /// ```
    pub fn run_while_leader<T>(
        &self,
        timeout: Duration,
        work: impl FnOnce(&Term) -> T,
    ) -> Option<T> {
        let term = self.wait_term(timeout)?;
        Some(work(&term))
    }

    /// Waits at most `timeout` for this replica to stop being the leader (its lock lost);
    /// true if it is not the leader by then. Returns at once if it is not the leader now.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool).strategy(diesel_lock::Strategy::Lease { ttl: std::time::Duration::from_secs(10) }).build()?;
    /// # locker.migrate()?;
    /// let e = diesel_lock::Election::start(locker, "scheduler")?;
    /// e.wait_leader(std::time::Duration::from_secs(5));
    /// assert!(!e.wait_deposed(std::time::Duration::from_millis(10))); // still leading
    /// # Ok(()) }
    /// ```
    pub fn wait_deposed(&self, timeout: Duration) -> bool {
        let watch = match &self.shared.lock().leading {
            Some((_, watch)) => watch.clone(),
            None => return true,
        };
        watch.wait(timeout) != LockStatus::Held
    }

    /// A channel of this replica's changes of leadership from now on ([`Leadership`]): to
    /// be told, without polling, when it is elected and when it is deposed. An `Elected`
    /// event is sent at once if it leads now.
    ///
    /// ```
    /// use diesel_lock::Leadership;
    ///
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool).strategy(diesel_lock::Strategy::Lease { ttl: std::time::Duration::from_secs(10) }).build()?;
    /// # locker.migrate()?;
    /// let e = diesel_lock::Election::start(locker, "scheduler")?;
    /// let events = e.subscribe();
    /// let Leadership::Elected { term } = events.recv().unwrap() else { panic!() };
    /// e.resign();
    /// assert_eq!(events.recv().unwrap(), Leadership::Deposed { term });
    /// # Ok(()) }
    /// ```
    pub fn subscribe(&self) -> Receiver<Leadership> {
        let (tx, rx) = channel();
        let mut st = self.shared.lock();
        if let Some((term, watch)) = &st.leading {
            if watch.status() == LockStatus::Held {
                let _ = tx.send(Leadership::Elected { term: *term });
            }
        }
        st.subscribers.push(tx);
        rx
    }

    /// Stops campaigning, and releases the lock if leading (as dropping does); returns once
    /// done.
    ///
    /// ```
    /// # fn main() -> diesel_lock::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
    /// # let locker = diesel_lock::Locker::builder(pool).strategy(diesel_lock::Strategy::Lease { ttl: std::time::Duration::from_secs(10) }).build()?;
    /// # locker.migrate()?;
    /// let e = diesel_lock::Election::start(locker.clone(), "scheduler")?;
    /// e.wait_leader(std::time::Duration::from_secs(5));
    /// e.resign();
    /// assert!(locker.try_lock("scheduler")?.is_some()); // free again
    /// # Ok(()) }
    /// ```
    pub fn resign(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.lock().resigned = true;
        self.shared.changed.notify_all();
        self.shared.cancel.cancel();
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                log::warn!("the election thread of {:?} panicked", self.key);
            }
        }
    }
}

impl<C: LockConnection> Drop for Election<C> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The election thread: wait for the lock, lead until it is lost or the candidate resigns,
/// and again.
fn campaign<C: LockConnection>(locker: &Locker<C>, key: &str, shared: &Arc<Shared>) {
    let resigned = || shared.lock().resigned;
    while !resigned() {
        let guard = match locker.try_lock_cancellable(key, None, &shared.cancel) {
            Ok(Some(g)) => g,
            Ok(None) => continue, // cancelled: resigned
            Err(e) => {
                log::warn!("election {key:?}: campaigning failed ({e}); trying again in 1 s");
                let st = shared.lock();
                if !st.resigned {
                    drop(
                        shared
                            .changed
                            .wait_timeout(st, Duration::from_secs(1))
                            .unpoisoned(),
                    );
                }
                continue;
            }
        };
        lead(guard, key, shared);
    }
}

/// Leads with `guard` until its lock is lost or the candidate resigns.
fn lead<C: LockConnection>(guard: LockGuard<C>, key: &str, shared: &Arc<Shared>) {
    let term = guard.token();
    let watch = guard.loss_watch();
    // A loss wakes the wait below (under the mutex, so the wake-up cannot fall between its
    // look at the status and its wait); so does a resignation.
    let s = shared.clone();
    guard.on_lost(move || {
        let _st = s.lock();
        s.changed.notify_all();
    });
    let w = watch.clone();
    {
        let mut st = shared.lock();
        st.leading = Some((term, w));
        Shared::tell(&mut st, Leadership::Elected { term });
    }
    shared.changed.notify_all();
    log::info!("election {key:?}: leader, term {term}");
    let lost = {
        let mut st = shared.lock();
        loop {
            if watch.status() != LockStatus::Held {
                break true;
            }
            if st.resigned {
                break false;
            }
            st = shared.changed.wait(st).unpoisoned();
        }
    };
    {
        let mut st = shared.lock();
        st.leading = None;
        Shared::tell(&mut st, Leadership::Deposed { term });
    }
    shared.changed.notify_all();
    if lost {
        log::warn!("election {key:?}: the lock was lost; term {term} is over, campaigning again");
        drop(guard);
    } else {
        log::info!("election {key:?}: resigned, term {term}");
        if let Err(e) = guard.release() {
            log::warn!("election {key:?}: releasing on resignation failed: {e}");
        }
    }
}
