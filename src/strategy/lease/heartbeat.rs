//! The lease heartbeat of one `Locker`: threads, started with its first lease, that renew each
//! held lease every `interval`; a renewal that finds the lease expired or taken marks the
//! guard lost.
//!
//! Renewals run side by side: a thread that takes a due renewal while no other thread is
//! idle starts one more (up to the pool's size), so a renewal stuck behind another session's
//! row lock holds up only its own key. Each renewal also waits for a row lock at most a
//! quarter interval (`Locks::lease_renew`; on MySQL whole seconds, at least 1), then is
//! retried, and due renewals of keys whose last renewal worked go before those of failing
//! keys. So S stuck keys on a pool of P connections delay the healthy renewals once, by about
//! S/P such waits, and not again. Healthy leases are renewed in batches of up to
//! `MAX_BATCH` in one statement (`Locks::lease_renew_many`, `HolderLocks::holders_renew_many`
//! for readers and permits), which skips rows another session has locked; a lease a batch
//! did not renew is renewed alone next, as a failing key, which tells a lost lease (marked
//! lost) from a stuck one. The leases wait for their renewals in two ordered sets
//! keyed by (due time, id), the healthy and the failing: a registration, and a round that
//! finds the due renewals, cost O(log N) plus the due ones, never a scan of all N (which
//! made acquiring N leases on one `Locker` cost O(N²)). A thread idle for two intervals
//! ends while another is idle too. Dropping the `Locker` ends and joins the idle threads; one
//! still inside a renewal is not waited for: it ends once that statement returns.
//!
//! The same threads run the statements of a guard's `check()` (`Heartbeat::call`), which
//! waits for them only until the lease's deadline.
//!
//! A lease also counts as lost, without asking the database, once its local deadline has
//! passed (`validity.rs`: the ttl less a margin for clock rates, counted from the send time of
//! the last acquisition or renewal that succeeded), so while the database cannot be reached
//! the guard still learns in time that it may no longer be the holder. A renewal that hangs
//! (a partition) delays nothing but itself: the deadline is kept by the local clock, and a
//! success reported after it does not count.

mod worker;

use super::validity::Validity;
use crate::backend::LockConnection;
use crate::backend::Sql;
use crate::sync::Unpoison;
use diesel::r2d2::ConnectionManager;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};
use worker::Worker;

#[derive(Debug, Default)]
struct State {
    entries: HashMap<u64, Entry>,
    /// The entries no thread is renewing whose last renewal worked, by (due, id); the failing
    /// ones in `failing`. The renewing ones are in neither: finding the due renewals and the
    /// earliest due time costs no scan of all leases (a registration and a renewal round
    /// cost O(log N) plus the due ones, not O(N)).
    healthy: BTreeSet<(Instant, u64)>,
    failing: BTreeSet<(Instant, u64)>,
    next_id: u64,
    shutdown: bool,
    /// Every heartbeat thread started and not yet ended, by id.
    threads: HashMap<ThreadId, JoinHandle<()>>,
    /// The threads inside a renewal.
    busy: std::collections::HashSet<ThreadId>,
    /// Threads spawned whose handle is not yet in `threads`.
    starting: usize,
    /// Statements of guards (`Heartbeat::call`), run before due renewals.
    calls: Calls,
    /// The threads waiting for work, each with the instant it wakes at by itself. A new
    /// lease due no earlier than one of them wakes nobody (`Heartbeat::enter`): waking a
    /// thread for every acquisition cost a futex wake and a context switch each, a tenth of
    /// the lock + release cycle's time on SQLite (`perf`, 1 thread).
    sleeping: HashMap<ThreadId, Instant>,
}

/// A statement a guard runs on a heartbeat thread, so that it can stop waiting for it.
type Call = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Calls(std::collections::VecDeque<Call>);

impl std::fmt::Debug for Calls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} calls", self.0.len())
    }
}

/// What a heartbeat thread does next.
enum Work {
    Renew(u64, String, String, Arc<Validity>),
    /// Leases renewed in one statement.
    Batch(Vec<Due>),
    Call(Call),
}

/// A lease to renew: its entry's id, key, holder id and validity.
type Due = (u64, String, String, Arc<Validity>);

/// At most this many leases in one renewal statement.
pub(crate) const MAX_BATCH: usize = 500;

impl State {
    fn idle(&self) -> usize {
        (self.threads.len() + self.starting).saturating_sub(self.busy.len())
    }

    /// The ordered set an entry not being renewed waits in.
    fn set(&mut self, failing: bool) -> &mut BTreeSet<(Instant, u64)> {
        if failing {
            &mut self.failing
        } else {
            &mut self.healthy
        }
    }

    fn insert(&mut self, id: u64, entry: Entry) {
        let (due, failing) = (entry.due, entry.failing);
        self.entries.insert(id, entry);
        self.set(failing).insert((due, id));
    }

    /// No more renewals of `id`.
    fn remove(&mut self, id: u64) {
        if let Some(e) = self.entries.remove(&id) {
            if !e.renewing {
                self.set(e.failing).remove(&(e.due, id));
            }
        }
    }

    /// A thread takes `id`'s renewal, next due one interval from `now`: out of the sets
    /// until `finish`.
    fn start(&mut self, id: u64, next_due: Instant) -> Option<Due> {
        let e = self.entries.get_mut(&id)?;
        let (due, failing) = (e.due, e.failing);
        if !e.renewing {
            e.renewing = true;
            e.due = next_due;
        }
        let job = (id, e.key.clone(), e.holder.clone(), e.lease.clone());
        self.set(failing).remove(&(due, id));
        Some(job)
    }

    /// `id`'s renewal is over: back in the set its `failing` and `due` (set meanwhile) say.
    fn finish(&mut self, id: u64) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        if !e.renewing {
            return;
        }
        e.renewing = false;
        let (due, failing) = (e.due, e.failing);
        self.set(failing).insert((due, id));
    }

    /// The first entry of `failing`'s set, if it is due by `by`.
    fn first_due(&self, failing: bool, by: Instant) -> Option<u64> {
        let set = if failing {
            &self.failing
        } else {
            &self.healthy
        };
        set.first().filter(|(due, _)| *due <= by).map(|&(_, id)| id)
    }

    /// The earliest due time of an entry not being renewed.
    fn earliest(&self) -> Option<Instant> {
        let h = self.healthy.first().map(|&(due, _)| due);
        let f = self.failing.first().map(|&(due, _)| due);
        h.into_iter().chain(f).min()
    }
}

#[derive(Debug)]
struct Entry {
    key: String,
    holder: String,
    due: Instant,
    /// A thread is renewing it now: no other may start.
    renewing: bool,
    /// Its last renewal failed (perhaps stuck behind another session's row lock): due
    /// renewals of other keys go first, so that stuck keys, however many, cannot take every
    /// thread and connection while the healthy leases run out.
    failing: bool,
    lease: Arc<Validity>,
    /// The place of the key's line a release granted this lease to, while the grant is
    /// unconfirmed (`Heartbeat::register_granted`): its renewal is the confirmation.
    confirm: Option<i64>,
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
        self.state.lock().unpoisoned()
    }
}

/// The statement that renews one lease: `Locks::lease_renew` for `Lease`, another table's
/// for shared leases and permits (`strategy/holders.rs`).
pub(crate) type Renew<C> = fn(&mut C, &str, &str, i64, Duration) -> diesel::QueryResult<bool>;

/// The statement that confirms a grant (`Locks::lease_confirm`: key, place, holder id,
/// ttl): whether the lease was still the holder's.
pub(crate) type Confirm<C> = fn(&mut C, &str, i64, &str, i64) -> diesel::QueryResult<bool>;

/// The statement that renews many leases at once, skipping those whose rows another session
/// has locked (`Locks::lease_renew_many`): the holder ids renewed.
pub(crate) type RenewMany<C> =
    fn(&mut C, &[(String, String)], i64) -> diesel::QueryResult<Vec<String>>;

fn renew_leases<C: LockConnection>(
    c: &mut C,
    leases: &[(String, String)],
    ttl_us: i64,
) -> diesel::QueryResult<Vec<String>> {
    c.sql().lease_renew_many(leases, ttl_us)
}

fn confirm_lease<C: LockConnection>(
    c: &mut C,
    key: &str,
    place: i64,
    holder: &str,
    ttl_us: i64,
) -> diesel::QueryResult<bool> {
    c.sql()
        .lease_confirm(key, place, holder, ttl_us)
        .map(|a| a.is_some())
}

/// How soon after a grant its confirmation runs, at most (and at most an eighth of the time
/// the grant leaves): a holder that releases sooner never sends it (its release removes the
/// place), and one that holds longer has most of the grant's time left to confirm in.
const CONFIRM_AFTER: Duration = Duration::from_millis(100);

fn renew_lease<C: LockConnection>(
    c: &mut C,
    key: &str,
    holder: &str,
    ttl_us: i64,
    bound: Duration,
) -> diesel::QueryResult<bool> {
    c.sql().lease_renew(key, holder, ttl_us, bound)
}

/// The heartbeat of one `Locker`.
pub(crate) struct Heartbeat<C: LockConnection> {
    /// What every thread it starts is given (its statements, pool, timings and the shared
    /// state): each new thread's `Worker` is a clone of it.
    worker: Worker<C>,
}

impl<C: LockConnection> std::fmt::Debug for Heartbeat<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heartbeat")
            .field("interval", &self.worker.interval)
            .finish_non_exhaustive()
    }
}

/// A lease's registration with the heartbeat; dropping it stops the renewals.
#[derive(Debug)]
pub(crate) struct Beat {
    id: u64,
    lease: Arc<Validity>,
    shared: Arc<Shared>,
}

impl Beat {
    /// True, for good, once the database said the lease is not ours or its local deadline
    /// passed.
    pub(crate) fn is_lost(&self) -> bool {
        self.lease.is_lost()
    }

    /// Until when the lease counts as held without hearing from the database; `None` once
    /// lost.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.lease.deadline()
    }

    /// The guard's loss status, which the lease marks (see `Validity`).
    pub(crate) fn loss(&self) -> Arc<crate::loss::Loss> {
        self.lease.loss()
    }

    /// The database says the lease is not ours: lost for good, and no more renewals.
    pub(crate) fn lose(&self) {
        self.lease.lose();
        self.shared.lock().remove(self.id);
    }
}

impl Drop for Beat {
    fn drop(&mut self) {
        self.shared.lock().remove(self.id);
    }
}

impl<C: LockConnection> Heartbeat<C> {
    pub(crate) fn new(
        pool: r2d2::Pool<ConnectionManager<C>>,
        interval: Duration,
        ttl: Duration,
    ) -> Self {
        let mut h = Self::with_renewal(
            pool,
            interval,
            ttl,
            renew_lease::<C>,
            Some(renew_leases::<C>),
        );
        h.worker.confirm = Some(confirm_lease::<C>);
        h
    }

    /// A heartbeat whose renewals run `renew`, and `renew_many` for batches of healthy
    /// leases if given.
    pub(crate) fn with_renewal(
        pool: r2d2::Pool<ConnectionManager<C>>,
        interval: Duration,
        ttl: Duration,
        renew: Renew<C>,
        renew_many: Option<RenewMany<C>>,
    ) -> Self {
        Heartbeat {
            worker: Worker {
                renew,
                renew_many,
                confirm: None,
                shared: Arc::default(),
                max_threads: pool.max_size().max(1) as usize,
                pool,
                interval,
                ttl,
            },
        }
    }

    /// Starts renewing `holder`'s lease on `key` one interval from now. `sent` is when the
    /// acquiring statement was sent: the lease cannot have started before it.
    pub(crate) fn register(&self, key: &str, holder: &str, sent: Instant) -> Beat {
        let lease = Arc::new(Validity::new(sent, self.worker.ttl));
        self.enter(
            key,
            holder,
            lease,
            Instant::now() + self.worker.interval,
            None,
        )
    }

    /// Starts keeping a lease that a release granted to `place` of the key's line, which
    /// was last joined or renewed with a statement sent at `renewed` and lives `place_ttl`
    /// from then: the grant's deadline to confirm by is the place's expiry, and the guard
    /// counts the lease held until then (less the margin of `validity.rs`). The lease's
    /// first renewal is the confirmation (`Locks::lease_confirm`: the lease's own ttl, and
    /// the place removed), due `CONFIRM_AFTER` from now (sooner if the grant leaves less
    /// than eight times that), renewed alone, not in a batch. A holder that releases first
    /// never sends it: its release removes the place. Without a confirming statement (a
    /// heartbeat made for readers and permits, whose places are never granted), `register`.
    pub(crate) fn register_granted(
        &self,
        key: &str,
        holder: &str,
        place: i64,
        renewed: Instant,
        place_ttl: Duration,
    ) -> Beat {
        if self.worker.confirm.is_none() {
            return self.register(key, holder, renewed);
        }
        let lease = Arc::new(Validity::granted(renewed, place_ttl, self.worker.ttl));
        let now = Instant::now();
        let left = lease
            .deadline()
            .map_or(Duration::ZERO, |d| d.saturating_duration_since(now));
        let due = now + CONFIRM_AFTER.min(left / 8);
        self.enter(key, holder, lease, due, Some(place))
    }

    fn enter(
        &self,
        key: &str,
        holder: &str,
        lease: Arc<Validity>,
        due: Instant,
        confirm: Option<i64>,
    ) -> Beat {
        let id = {
            let mut st = self.worker.shared.lock();
            st.next_id += 1;
            let id = st.next_id;
            st.insert(
                id,
                Entry {
                    key: key.to_owned(),
                    holder: holder.to_owned(),
                    due,
                    renewing: false,
                    // Renewed alone: a grant's confirmation is a statement of its own.
                    failing: confirm.is_some(),
                    lease: lease.clone(),
                    confirm,
                },
            );
            // A thread waiting already wakes by `due` by itself, and looks at every entry
            // then; otherwise one is woken to wait for this one's due time instead.
            let seen_in_time = st.sleeping.values().any(|&wakes| wakes <= due);
            (id, seen_in_time)
        };
        let (id, seen_in_time) = id;
        if !seen_in_time {
            self.worker.shared.wake.notify_one();
        }
        self.ensure_thread();
        Beat {
            id,
            lease,
            shared: self.worker.shared.clone(),
        }
    }

    /// Runs `call` on a heartbeat thread (one more is started if none is idle, up to the
    /// pool's size). For the statements of a guard that may wait for them only until its
    /// lease's deadline: in a partition a statement hangs until TCP gives up (a quarter of an
    /// hour by default on Linux), and only the thread running it waits that long. A thread
    /// of its own per statement would cost more than the statement (135 µs to start one on
    /// a loaded 2-core machine).
    pub(crate) fn call(&self, call: Call) {
        let more = {
            let mut st = self.worker.shared.lock();
            st.calls.0.push_back(call);
            let more = st.idle() == 0 && st.threads.len() + st.starting < self.worker.max_threads;
            if more {
                st.starting += 1;
            }
            more
        };
        self.worker.shared.wake.notify_one();
        if more {
            self.worker().spawn();
        }
    }

    fn ensure_thread(&self) {
        let needed = {
            let mut st = self.worker.shared.lock();
            let needed = st.threads.is_empty() && st.starting == 0;
            if needed {
                st.starting += 1;
            }
            needed
        };
        if needed {
            self.worker().spawn();
        }
    }

    fn worker(&self) -> Worker<C> {
        self.worker.clone()
    }
}

impl<C: LockConnection> Drop for Heartbeat<C> {
    fn drop(&mut self) {
        let idle: Vec<JoinHandle<()>> = {
            let mut st = self.worker.shared.lock();
            st.shutdown = true;
            let busy = st.busy.clone();
            let ids: Vec<ThreadId> = st
                .threads
                .keys()
                .filter(|id| !busy.contains(id))
                .copied()
                .collect();
            ids.iter().filter_map(|id| st.threads.remove(id)).collect()
        };
        self.worker.shared.wake.notify_all();
        // An idle thread sees `shutdown` at once. One inside a renewal (perhaps waiting for
        // a row lock) is left to end by itself once its statement returns.
        for handle in idle {
            if handle.join().is_err() {
                log::warn!("a lease heartbeat thread panicked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(due: Instant) -> Entry {
        Entry {
            key: "k".into(),
            holder: "h".into(),
            due,
            renewing: false,
            failing: false,
            lease: Arc::new(Validity::new(Instant::now(), Duration::from_secs(30))),
            confirm: None,
        }
    }

    /// The ordered sets follow every change: due healthy entries before due failing ones,
    /// renewing entries in neither set, removed entries gone from both.
    #[test]
    fn ordered_sets_follow_the_entries() {
        let now = Instant::now();
        let mut st = State::default();
        for (id, secs) in [(1, 3), (2, 1), (3, 2)] {
            st.insert(id, entry(now + Duration::from_secs(secs)));
        }
        let later = now + Duration::from_secs(10);
        assert_eq!(st.first_due(false, now), None);
        assert_eq!(st.first_due(false, later), Some(2));
        assert_eq!(st.earliest(), Some(now + Duration::from_secs(1)));
        // 2 is renewed and fails: due at once, but after the healthy ones.
        let job = st.start(2, later).unwrap();
        assert_eq!(job.0, 2);
        assert_eq!((st.healthy.len(), st.failing.len()), (2, 0));
        let e = st.entries.get_mut(&2).unwrap();
        e.failing = true;
        e.due = now;
        st.finish(2);
        assert_eq!(st.first_due(false, later), Some(3));
        assert_eq!(st.first_due(true, now), Some(2));
        assert_eq!(st.earliest(), Some(now));
        // A removed entry leaves its set, renewing or not.
        st.remove(2);
        st.start(3, later).unwrap();
        st.remove(3);
        st.finish(3);
        assert_eq!(st.failing.len(), 0);
        assert_eq!(
            st.healthy.iter().map(|&(_, id)| id).collect::<Vec<_>>(),
            [1]
        );
        assert_eq!(st.entries.len(), 1);
    }
}
