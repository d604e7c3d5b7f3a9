//! The heartbeat's threads (`Worker`): each takes the next due renewal or batch of
//! renewals, or a guard's call, from the shared state (`heartbeat.rs`), runs it, and waits
//! for the next; see the parent module for the rules they follow.

use super::{Confirm, Renew, RenewMany};
use super::{Due, Shared, State, Work, MAX_BATCH};
use crate::backend::LockConnection;
use crate::strategy::lease::validity::Validity;
use crate::sync::Unpoison;
use diesel::r2d2::ConnectionManager;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

/// What one heartbeat thread needs.
pub(super) struct Worker<C: LockConnection> {
    pub(super) renew: Renew<C>,
    /// Renews healthy leases in batches, if the rows have such a statement.
    pub(super) renew_many: Option<RenewMany<C>>,
    /// Confirms grants (`register_granted`), if the rows are ever granted.
    pub(super) confirm: Option<Confirm<C>>,
    pub(super) shared: Arc<Shared>,
    pub(super) pool: r2d2::Pool<ConnectionManager<C>>,
    pub(super) interval: Duration,
    pub(super) ttl: Duration,
    /// At most this many threads renew at once (the pool's size).
    pub(super) max_threads: usize,
}

impl<C: LockConnection> Clone for Worker<C> {
    // By hand: a derive would ask `C: Clone`, which a connection is not.
    fn clone(&self) -> Self {
        Worker {
            renew: self.renew,
            renew_many: self.renew_many,
            confirm: self.confirm,
            shared: self.shared.clone(),
            pool: self.pool.clone(),
            interval: self.interval,
            ttl: self.ttl,
            max_threads: self.max_threads,
        }
    }
}

impl<C: LockConnection> Worker<C> {
    /// Starts a thread for which `starting` was counted.
    pub(super) fn spawn(self) {
        let shared = self.shared.clone();
        let spawned = std::thread::Builder::new()
            .name("dlock-heartbeat".into())
            .spawn(move || self.run());
        let mut st = shared.lock();
        st.starting -= 1;
        match spawned {
            Ok(handle) => {
                if st.shutdown {
                    // Drop has already joined the others; this one ends at once.
                    drop(st);
                    let _ = handle.join();
                } else {
                    st.threads.insert(handle.thread().id(), handle);
                }
            }
            // Without a heartbeat the lease still works until its ttl; check() will say so.
            Err(e) => log::warn!("could not start a lease heartbeat thread: {e}"),
        }
    }

    /// The next call or due renewal, or `None` once the heartbeat is dropped or this thread
    /// has been idle for two intervals while another is idle too.
    fn next(&self) -> Option<Work> {
        let me = std::thread::current().id();
        let mut idle_since = Instant::now();
        let mut st = self.shared.lock();
        loop {
            if st.shutdown {
                return None;
            }
            if let Some(call) = st.calls.0.pop_front() {
                return Some(self.take(st, Work::Call(call)));
            }
            let now = Instant::now();
            let mut idle_until = idle_since + 2 * self.interval;
            if now >= idle_until {
                if st.idle() > 1 && st.threads.contains_key(&me) {
                    // Our own handle is dropped, which detaches this (ending) thread. Another
                    // idle thread looks at the entries now: one entered while this one slept
                    // may have counted on it (`sleeping`).
                    st.threads.remove(&me);
                    drop(st);
                    self.shared.wake.notify_one();
                    return None;
                }
                // The last idle thread stays, and waits another two intervals at most: a
                // wait until an idle end already past was 1 ms, a wake-up a millisecond for
                // as long as the `Locker` lived with no lease held (an adversary counted 16k
                // context switches in 20 s).
                idle_since = now;
                idle_until = now + 2 * self.interval;
            }
            // Due renewals of healthy leases first, in batches if the rows have a batch
            // statement (with them every other healthy lease, due within the interval: so
            // leases taken at different times are renewed together from their first
            // round on, one round per interval), then
            // failing ones one by one; else wait for the earliest.
            if let Some(batch) = self.renew_many.and_then(|_| self.batch(&mut st, now)) {
                return Some(self.take(st, Work::Batch(batch)));
            }
            let due = st.first_due(false, now).or_else(|| st.first_due(true, now));
            if let Some(job) = due.and_then(|id| st.start(id, now + self.interval)) {
                let (id, key, holder, lease) = job;
                return Some(self.take(st, Work::Renew(id, key, holder, lease)));
            }
            let until = st.earliest().map_or(idle_until, |due| due.min(idle_until));
            let wait = until
                .saturating_duration_since(now)
                .max(Duration::from_millis(1));
            st.sleeping.insert(me, now + wait);
            st = self.shared.wake.wait_timeout(st, wait).unpoisoned().0;
            st.sleeping.remove(&me);
        }
    }

    /// Up to `MAX_BATCH` healthy leases to renew together, if one of them is due: the due
    /// ones first, then those due within an interval (every healthy lease not being
    /// renewed). A window any shorter keeps leases taken at different times in groups
    /// that each need a statement of their own per interval (a window of a quarter
    /// interval: up to four, merging only by chance).
    fn batch(&self, st: &mut State, now: Instant) -> Option<Vec<Due>> {
        st.first_due(false, now)?;
        let soon = now + self.interval;
        let ready: Vec<u64> = st
            .healthy
            .iter()
            .take_while(|&&(due, _)| due <= soon)
            .take(MAX_BATCH)
            .map(|&(_, id)| id)
            .collect();
        let next_due = now + self.interval;
        Some(
            ready
                .into_iter()
                .filter_map(|id| st.start(id, next_due))
                .collect(),
        )
    }

    /// This thread takes `work`: busy now, and one more thread is started if none is left
    /// idle, for the other keys, should this work stall.
    fn take(&self, mut st: MutexGuard<'_, State>, work: Work) -> Work {
        st.busy.insert(std::thread::current().id());
        let more = st.idle() == 0 && st.threads.len() + st.starting < self.max_threads;
        // `Heartbeat::enter` woke nobody for an entry that a waiting thread, maybe this one,
        // would see in time; this one is busy now. If no thread still waiting wakes by the
        // earliest entry left, one is woken to wait for it (a confirmation due in 100 ms
        // must not wait for this work, which may hang on a locked row, nor for another
        // thread's wake-up an interval away: found by the heartbeat's adversary).
        let uncovered = st
            .earliest()
            .is_some_and(|due| !st.sleeping.values().any(|&wakes| wakes <= due));
        if more {
            st.starting += 1;
            drop(st);
            self.clone().spawn();
        } else if uncovered {
            drop(st);
            self.shared.wake.notify_one();
        }
        work
    }

    fn run(self) {
        let me = std::thread::current().id();
        while let Some(work) = self.next() {
            let renewed = match work {
                Work::Renew(id, key, holder, lease) => {
                    self.renew(id, &key, &holder, &lease);
                    vec![id]
                }
                Work::Batch(batch) => {
                    // Clears `renewing` itself.
                    self.renew_batch(batch);
                    Vec::new()
                }
                Work::Call(call) => {
                    call();
                    Vec::new()
                }
            };
            let mut st = self.shared.lock();
            st.busy.remove(&me);
            for id in renewed {
                st.finish(id);
            }
            if st.shutdown {
                // Drop did not wait for this thread: it detaches by dropping the handle.
                st.threads.remove(&me);
                return;
            }
        }
    }

    /// Renews `batch` in one statement. A lease it did not renew (lost, or its row locked
    /// by another session) is renewed on its own at once, which tells the two apart and
    /// holds up nothing but that lease.
    fn renew_batch(&self, batch: Vec<Due>) {
        let Some(renew_many) = self.renew_many else {
            return;
        };
        let ttl_us = crate::strategy::micros(self.ttl).unwrap_or(i64::MAX);
        let sent = Instant::now();
        let mut left = self.interval;
        let mut live = Vec::with_capacity(batch.len());
        for (id, key, holder, lease) in batch {
            match lease.deadline() {
                Some(d) => {
                    left = left.min(d.saturating_duration_since(sent));
                    live.push((id, key, holder, lease));
                }
                None => {
                    self.shared.lock().remove(id);
                    log::warn!(
                        "lock {key:?}: not renewed before its local deadline; the lock is lost"
                    );
                }
            }
        }
        let pairs: Vec<(String, String)> = live
            .iter()
            .map(|(_, k, h, _)| (k.clone(), h.clone()))
            .collect();
        let renewed = if pairs.is_empty() {
            Ok(Vec::new())
        } else {
            crate::instrument::renewal_statement();
            self.pool
                .get_timeout(left.max(Duration::from_millis(1)))
                .map_err(crate::Error::from)
                .and_then(|mut c| renew_many(&mut *c, &pairs, ttl_us).map_err(Into::into))
        };
        let renewed: std::collections::HashSet<String> = match renewed {
            Ok(r) => r.into_iter().collect(),
            Err(e) => {
                log::debug!(
                    "{} leases: batch renewal failed ({e}); renewing each alone",
                    live.len()
                );
                Default::default()
            }
        };
        let mut st = self.shared.lock();
        let now = Instant::now();
        for (id, key, holder, lease) in live {
            if renewed.contains(&holder) {
                if lease.renewed(sent) {
                    log::trace!("lock {key:?}: lease renewed");
                    st.finish(id);
                } else {
                    st.remove(id);
                    log::warn!("lock {key:?}: the lease was renewed only after its local deadline; the lock counts as lost");
                }
            } else if let Some(entry) = st.entries.get_mut(&id) {
                // On its own, next (after the healthy renewals due).
                entry.failing = true;
                entry.due = now;
                st.finish(id);
            }
        }
        drop(st);
        self.shared.wake.notify_all();
    }

    fn renew(&self, id: u64, key: &str, holder: &str, lease: &Validity) {
        let (shared, interval, ttl) = (&self.shared, self.interval, self.ttl);
        let ttl_us = crate::strategy::micros(ttl).unwrap_or(i64::MAX);
        let forget = || {
            shared.lock().remove(id);
        };
        // Before anything is sent: the database's count of the ttl starts later.
        let sent = Instant::now();
        let Some(deadline) = lease.deadline() else {
            forget();
            log::warn!("lock {key:?}: not renewed before its local deadline; the lock is lost");
            return;
        };
        // Waiting for a connection longer than the lease has left would be pointless. The
        // statement itself may hang (a partition): the deadline passes all the same, and a
        // success reported after it does not count.
        let left = deadline.saturating_duration_since(sent);
        // A granted lease's first renewal confirms the grant.
        let confirm = shared
            .lock()
            .entries
            .get(&id)
            .and_then(|e| e.confirm)
            .zip(self.confirm);
        let renewed =
            self.pool
                .get_timeout(interval.min(left).max(Duration::from_millis(1)))
                .map_err(crate::Error::from)
                .and_then(|mut c| {
                    crate::instrument::renewal_statement();
                    match confirm {
                        Some((place, confirm)) => crate::strategy::with_pooled(c, |c| {
                            #[cfg(feature = "test-hooks")]
                            crate::hooks::before_confirm(key);
                            confirm(c, key, place, holder, ttl_us)
                        }),
                        // At most a quarter interval behind another session's row lock.
                        None => (self.renew)(&mut *c, key, holder, ttl_us, interval / 4)
                            .map_err(Into::into),
                    }
                });
        match renewed {
            Ok(true) if lease.renewed(sent) => {
                if let Some(entry) = shared.lock().entries.get_mut(&id) {
                    entry.failing = false;
                    entry.confirm = None;
                }
                log::trace!("lock {key:?}: lease renewed");
            }
            Ok(true) => {
                forget();
                log::warn!("lock {key:?}: the lease was renewed only after its local deadline; the lock counts as lost");
            }
            Ok(false) => {
                // Unless its guard was released meanwhile: a release stops the renewals
                // (removes the entry) before it clears the lease, so an entry still here
                // means the lease was not ours before the release began.
                let mut st = shared.lock();
                if st.entries.contains_key(&id) {
                    lease.lose();
                    st.remove(id);
                    drop(st);
                    log::warn!("lock {key:?}: the lease expired or was taken before it could be renewed; the lock is lost");
                }
            }
            Err(e) if lease.is_lost() => {
                forget();
                log::warn!(
                    "lock {key:?}: not renewed before its local deadline (last error: {e}); the lock is lost"
                );
            }
            Err(e) => {
                // Try again soon; the lease still has time left.
                log::warn!("lock {key:?}: lease renewal failed: {e}; retrying");
                if let Some(entry) = shared.lock().entries.get_mut(&id) {
                    // Sooner if the lease has less than that left (a grant's short one).
                    let soon = (interval / 4).min(left / 4);
                    entry.due = Instant::now() + soon.max(Duration::from_millis(1));
                    entry.failing = true;
                }
            }
        }
    }
}
