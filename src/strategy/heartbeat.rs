//! The lease heartbeat: one thread per `Locker`, started with its first lease and joined when
//! the last clone of the `Locker` (and so every guard) is gone. It renews each held lease
//! every `interval`; a renewal that finds the lease expired or taken marks the guard lost.
//!
//! A lease also counts as lost, without asking the database, once a whole ttl has passed
//! since the start of the last acquisition or renewal that succeeded: the database's expiry
//! is at most that late, so while the database cannot be reached the guard still learns in
//! time that it may no longer be the holder.

use crate::backend::LockConnection;
use diesel::r2d2::ConnectionManager;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
struct State {
    entries: HashMap<u64, Entry>,
    next_id: u64,
    shutdown: bool,
}

#[derive(Debug)]
struct Entry {
    key: String,
    holder: String,
    due: Instant,
    lease: Arc<Lease>,
}

/// What a guard and the heartbeat share about one lease.
#[derive(Debug)]
struct Lease {
    lost: AtomicBool,
    /// No later than the database's expiry: the start of the last successful acquisition or
    /// renewal, plus the ttl.
    valid_until: Mutex<Instant>,
}

impl Lease {
    fn valid_until(&self) -> Instant {
        *self.valid_until.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire) || Instant::now() >= self.valid_until()
    }
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent even if a thread panicked while holding the lock: every
        // critical section is a handful of map operations.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The heartbeat of one `Locker`.
pub(crate) struct Heartbeat<C: LockConnection> {
    shared: Arc<Shared>,
    pool: r2d2::Pool<ConnectionManager<C>>,
    interval: Duration,
    ttl: Duration,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<C: LockConnection> std::fmt::Debug for Heartbeat<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heartbeat")
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// A lease's registration with the heartbeat; dropping it stops the renewals.
#[derive(Debug)]
pub(crate) struct Beat {
    id: u64,
    lease: Arc<Lease>,
    shared: Arc<Shared>,
}

impl Beat {
    /// True once a renewal found the lease gone, or a whole ttl passed without a renewal.
    pub(crate) fn is_lost(&self) -> bool {
        self.lease.is_lost()
    }
}

impl Drop for Beat {
    fn drop(&mut self) {
        self.shared.lock().entries.remove(&self.id);
    }
}

impl<C: LockConnection> Heartbeat<C> {
    pub(crate) fn new(
        pool: r2d2::Pool<ConnectionManager<C>>,
        interval: Duration,
        ttl: Duration,
    ) -> Self {
        Heartbeat {
            shared: Arc::default(),
            pool,
            interval,
            ttl,
            thread: Mutex::new(None),
        }
    }

    /// Starts renewing `holder`'s lease on `key` one interval from now. `sent` is when the
    /// acquiring statement was sent: the lease cannot have started before it.
    pub(crate) fn register(&self, key: &str, holder: &str, sent: Instant) -> Beat {
        let lease = Arc::new(Lease {
            lost: AtomicBool::new(false),
            valid_until: Mutex::new(sent + self.ttl),
        });
        let id = {
            let mut st = self.shared.lock();
            st.next_id += 1;
            let id = st.next_id;
            st.entries.insert(
                id,
                Entry {
                    key: key.to_owned(),
                    holder: holder.to_owned(),
                    due: Instant::now() + self.interval,
                    lease: lease.clone(),
                },
            );
            id
        };
        self.shared.wake.notify_one();
        self.ensure_thread();
        Beat {
            id,
            lease,
            shared: self.shared.clone(),
        }
    }

    fn ensure_thread(&self) {
        let mut thread = self.thread.lock().unwrap_or_else(|p| p.into_inner());
        if thread.is_some() {
            return;
        }
        let shared = self.shared.clone();
        let pool = self.pool.clone();
        let (interval, ttl) = (self.interval, self.ttl);
        let spawned = std::thread::Builder::new()
            .name("dlock-heartbeat".into())
            .spawn(move || run(&shared, &pool, interval, ttl));
        match spawned {
            Ok(handle) => *thread = Some(handle),
            // Without a heartbeat the lease still works until its ttl; check() will say so.
            Err(e) => log::warn!("could not start the lease heartbeat thread: {e}"),
        }
    }
}

impl<C: LockConnection> Drop for Heartbeat<C> {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.wake.notify_all();
        let thread = self.thread.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(handle) = thread.take() {
            let _ = handle.join();
        }
    }
}

fn run<C: LockConnection>(
    shared: &Shared,
    pool: &r2d2::Pool<ConnectionManager<C>>,
    interval: Duration,
    ttl: Duration,
) {
    let ttl_us = crate::strategy::micros(ttl).unwrap_or(i64::MAX);
    loop {
        let (id, key, holder, lease) = {
            let mut st = shared.lock();
            loop {
                if st.shutdown {
                    return;
                }
                let now = Instant::now();
                let next = st.entries.iter_mut().min_by_key(|(_, e)| e.due);
                match next {
                    None => st = shared.wake.wait(st).unwrap_or_else(|p| p.into_inner()),
                    Some((&id, e)) if e.due <= now => {
                        e.due = now + interval;
                        break (id, e.key.clone(), e.holder.clone(), e.lease.clone());
                    }
                    Some((_, e)) => {
                        let wait = e.due - now;
                        st = shared
                            .wake
                            .wait_timeout(st, wait)
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                    }
                }
            }
        };
        let started = Instant::now();
        // Waiting for a connection longer than the lease has left would be pointless.
        let left = lease.valid_until().saturating_duration_since(started);
        let renewed = pool
            .get_timeout(interval.min(left).max(Duration::from_millis(1)))
            .map_err(crate::Error::from)
            .and_then(|mut c| c.lease_renew(&key, &holder, ttl_us).map_err(Into::into));
        match renewed {
            Ok(true) => {
                *lease.valid_until.lock().unwrap_or_else(|p| p.into_inner()) = started + ttl;
                log::trace!("lock {key:?}: lease renewed");
            }
            Ok(false) => {
                lease.lost.store(true, Ordering::Release);
                shared.lock().entries.remove(&id);
                log::warn!("lock {key:?}: the lease expired or was taken before it could be renewed; the lock is lost");
            }
            Err(e) if lease.is_lost() => {
                lease.lost.store(true, Ordering::Release);
                shared.lock().entries.remove(&id);
                log::warn!(
                    "lock {key:?}: no renewal for a whole ttl (last error: {e}); the lock is lost"
                );
            }
            Err(e) => {
                // Try again soon; the lease still has time left.
                log::warn!("lock {key:?}: lease renewal failed: {e}; retrying");
                if let Some(entry) = shared.lock().entries.get_mut(&id) {
                    entry.due = Instant::now() + (interval / 4).max(Duration::from_millis(1));
                }
            }
        }
    }
}
