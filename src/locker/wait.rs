//! Waiting for a lock, written once for every strategy: deadlines, backoff, the in-process
//! queue, listening for releases and cancellation. What one attempt does is the strategy's
//! (`RawLock::try_acquire`).

use super::cancel::Cancel;
use super::deadline::Deadline;
use super::line::{Place, KEEP_WITHIN};
use super::Locker;
use crate::backend::{Backend, LockConnection, Sql, Wait};
use crate::backoff::{self, Backoff};
use crate::guard::LockGuard;
use crate::strategy::session::discard;
use crate::strategy::{Conn, Pooled, RawLock, Strategy, Taken};
use crate::sync::Unpoison;
use crate::{key, Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The connection a waiter that polls keeps between its looks (`Locker::acquire_unmetered`),
/// counted in its `Locker`'s `kept`, which `put` holds to `most` (half the pool).
pub(super) struct Kept<'a, C: LockConnection> {
    conn: Option<Pooled<C>>,
    count: &'a AtomicUsize,
    most: u32,
}

impl<C: LockConnection> Kept<'_, C> {
    /// The kept connection, if there is one (no longer counted).
    fn take(&mut self) -> Option<Pooled<C>> {
        let conn = self.conn.take();
        if conn.is_some() {
            self.count.fetch_sub(1, Ordering::Relaxed);
        }
        conn
    }

    /// Keeps `conn`, unless half the pool is kept already (then it goes back to the pool).
    fn put(&mut self, conn: Pooled<C>) {
        let most = usize::try_from(self.most).unwrap_or(usize::MAX);
        if self.count.fetch_add(1, Ordering::Relaxed) < most {
            self.conn = Some(conn);
        } else {
            self.count.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl<C: LockConnection> Drop for Kept<'_, C> {
    fn drop(&mut self) {
        drop(self.take());
    }
}

impl<C: LockConnection> Locker<C> {
    pub(super) fn acquire_unmetered(
        &self,
        raw: &dyn RawLock<C>,
        key: &str,
        deadline: Deadline,
        cancel: Option<&Cancel>,
    ) -> Result<Option<LockGuard<C>>> {
        key::validate(key)?;
        let queues = &self.inner.shared.queues;
        if let Deadline::Once = deadline {
            return Ok(self
                .attempt(
                    raw,
                    key,
                    queues.contended(key),
                    deadline,
                    false,
                    None,
                    &mut None,
                    None,
                )?
                .map(|t| self.guard(raw, key, t)));
        }
        // A cancellation wakes this key's local waiters; each then sees the flag.
        let _woken = cancel.map(|c| {
            let shared = self.inner.shared.clone();
            let key = key.to_owned();
            c.on_cancel(Arc::new(move || shared.queues.interrupt(&key)))
        });
        let ticket = self.inner.shared.queues.join(key);
        let queued = match ticket.wait_turn(deadline, cancel) {
            None if cancel.is_some_and(Cancel::is_cancelled) => return Ok(None),
            // The deadline passed behind this Locker's own waiters: "held elsewhere" only if
            // the database answers (the thread ahead may be failing for want of it).
            None => return self.missed_in_line(key),
            Some(queued) => queued,
        };
        let max = self.inner.max_backoff;
        let cap = |d: Duration| deadline.remaining().map_or(d, |left| d.min(left));
        // While a guard of this Locker holds the key, its release wakes us: asking the
        // database before that could only fail. (Only after `max`, in case the holder's
        // lease was lost meanwhile.)
        if queued {
            ticket.pause(Duration::ZERO, cap(max), cancel);
        }
        // First in line now, whether or not anyone was ahead: a waiter that hears other
        // processes' releases polls only as a fallback. (Asked once the key was found held:
        // the first wait starts the listener.)
        let mut listening = None;
        // A thread that waited in line, or that asks for a key found contended lately,
        // starts with the cheap "is it held?" read (and, with a line, joins it first). So
        // does a wait on SQLite for a key this Locker did not release lately (a
        // newcomer's): its first try would be a write queued for SQLite's write lock in the
        // default busy handler, which sleeps 1, 2, 5, 10 … ms between tries, and against a
        // process that takes and releases the key in a loop (alone in the line, so keeping
        // it) such a try waited 18–107 ms (8 processes, each on the key for 4 s), the
        // looper took hundreds of turns meanwhile, and fairness across the run fell to
        // 0.70–0.89 in 4 of 17 runs. Joining goes through `sqlite/busy.rs`'s µs-paced
        // tries; once in line, the looper's next release hands the key over. A loop that
        // takes the key again at once (`Queues::released_lately`) pays nothing for it.
        let mut retry = queued
            || queues.contended(key)
            || (self.inner.backend == Backend::Sqlite
                && raw.lines()
                && raw.exclusive()
                && !queues.released_lately(key));
        let mut backoff = Backoff::new(Duration::from_millis(1), max);
        // A connection lost during the wait (a server restarting, a network cut) is ridden
        // out until the deadline: the next attempt takes a new connection. Only a pool that
        // could not connect before this `Locker` ever reached the database is an error at
        // once, so that a wrong URL or a database that is down says so instead of waiting;
        // a `Locker` that has worked before waits out an outage, even one that began before
        // this call.
        let mut reached = self.inner.schema_current.load(Ordering::Relaxed);
        let mut outage: Option<Instant> = None;
        // The error of the last attempt, while the attempts fail for want of the database:
        // a wait that ends so is an error (`Error::Unreachable`), not "held elsewhere".
        let mut unreachable: Option<Error>;
        // Whether the wait, its deadline passed, made its one more attempt after a last one
        // that lost its connection.
        let mut last_chance_taken = false;
        // This thread's place in the key's line in the database (strategies with a line),
        // taken once the key was found held; given up when dropped without the lock.
        let mut place: Option<Place<'_, C>> = None;
        // The first attempt only tries (a free key is taken in one statement); the wait in
        // the server's lock queue, and what it needs set up first (a statement timeout, a
        // check of the client, the session id for a cancellation), is for a key found held.
        let mut tried = false;
        // A waiter in a line it polls (no notifications heard) keeps its connection
        // between its looks, which come every millisecond or so for the first in line
        // while the line moves, and a few times per turn for those behind: no checkout, and
        // no test of the connection by the pool, per look. Declared after `place`, so
        // dropped before it (giving the place up takes one).
        let mut kept = Kept {
            conn: None,
            count: &self.inner.kept,
            most: self.inner.pool.max_size() / 2,
        };
        loop {
            if cancel.is_some_and(Cancel::is_cancelled) {
                return Ok(None);
            }
            let server_wait = std::mem::replace(&mut tried, true);
            let keep = (listening == Some(false)).then_some(&mut kept);
            let reused = keep.as_ref().is_some_and(|k| k.conn.is_some());
            match self.attempt(
                raw,
                key,
                retry,
                deadline,
                server_wait,
                cancel,
                &mut place,
                keep,
            ) {
                Ok(Some(taken)) => {
                    if let Some(since) = outage {
                        log::warn!(
                            "lock {key:?}: the database answers again after {:?}",
                            since.elapsed()
                        );
                    }
                    // The guard marks the key held before the next local waiter looks.
                    let guard = self.guard(raw, key, taken);
                    drop(ticket);
                    return Ok(Some(guard));
                }
                Ok(None) => {
                    unreachable = None;
                    if let Some(since) = outage.take() {
                        log::warn!(
                            "lock {key:?}: the database answers again after {:?}; still waiting",
                            since.elapsed()
                        );
                    }
                    reached = true;
                    if !server_wait && !raw.lines() {
                        retry = true;
                        continue; // now the wait in the server's queue, at once
                    }
                }
                // The connection kept since the last look died meanwhile (a session ended by
                // the server or an administrator): r2d2 tests a connection only as it hands
                // it out, and this one was not handed out again. Tried again at once on one
                // from the pool (which this attempt did not keep), before counting an outage:
                // the database itself may well answer (found by an adversary: a session
                // killed just before a wait's deadline made it end `Unreachable`).
                Err(e) if reused && crate::error::is_connection_lost(&e) => {
                    log::debug!("lock {key:?}: the connection kept between looks was lost ({e}); trying again on another");
                    continue;
                }
                Err(e) if self.lost_the_database(&e, reached) => {
                    reached = true;
                    // One line per outage, not one per attempt.
                    if outage.is_none() {
                        let cause = std::error::Error::source(&e)
                            .map_or(String::new(), |s| format!(": {s}"));
                        log::warn!("lock {key:?}: lost the database while waiting ({e}{cause}); trying again until the deadline");
                        outage = Some(Instant::now());
                    } else {
                        log::debug!("lock {key:?}: the database is still unreachable ({e})");
                    }
                    unreachable = Some(e);
                }
                Err(e) => return Err(e),
            }
            retry = true;
            // A waiter in line that hears no notifications paces its looks by the line's
            // (`Place::pause`).
            let listening = *listening.get_or_insert_with(|| self.listening());
            let pause = match &place {
                _ if outage.is_some() => backoff.next_pause(),
                _ if listening => backoff::jitter(max),
                Some(p) => p.pause(max),
                None => backoff.next_pause(),
            };
            if deadline.remaining().is_some_and(|left| left.is_zero()) {
                return match unreachable {
                    // The last attempt lost its connection (a session ended by the server or
                    // an administrator, not necessarily a database gone): one more, at once,
                    // on another connection (the pool opens one if it must, for up to a
                    // second), says which; only a database that does not answer it makes
                    // the wait `Unreachable`. (Found by an adversary: a session killed just
                    // before the deadline.)
                    Some(e) if !last_chance_taken && crate::error::is_connection_lost(&e) => {
                        last_chance_taken = true;
                        log::debug!("lock {key:?}: the last attempt lost its connection ({e}); one more on another");
                        continue;
                    }
                    Some(e) => Err(Error::Unreachable {
                        key: key.to_owned(),
                        source: Box::new(e),
                    }),
                    None => Ok(None),
                };
            }
            ticket.pause(cap(pause), cap(max), cancel);
        }
    }

    /// One attempt; with `server_wait`, one that waits in the server's lock queue as long
    /// as the deadline allows (strategies that have one). A cancelled one returns `Ok(None)`,
    /// and never a lock: one granted at the moment of cancelling is released again.
    #[allow(clippy::too_many_arguments)]
    fn attempt<'a>(
        &'a self,
        raw: &'a dyn RawLock<C>,
        key: &'a str,
        retry: bool,
        deadline: Deadline,
        server_wait: bool,
        cancel: Option<&Cancel>,
        place: &mut Option<Place<'a, C>>,
        kept: Option<&mut Kept<'_, C>>,
    ) -> Result<Option<Taken>> {
        // `kept`: where a waiter that polls keeps its connection between looks (see
        // `acquire_unmetered`): one kept there is used instead of a new checkout, and this
        // one is kept there after the attempt if it only looked (or tried) and waits in
        // line.
        #[cfg(all(test, feature = "postgres"))]
        tests::ATTEMPTS.with(|n| n.set(n.get() + 1));
        // Strategies that wait on the server use what is left of the deadline; a
        // cancellation then ends the server's wait by ending the session, but only while
        // this attempt is under way (`live`): once it has returned, the connection may go
        // back to the pool and on to another lock, whose session no late cancellation may
        // end (that would free a lock its guard still holds, for a second guard to take).
        let wait = if server_wait {
            deadline.server_wait()
        } else {
            Wait::No
        };
        // A try that the strategy runs on a session of its own choosing (`Advisory`'s
        // shared sessions), once this `Locker` knows the schema is current.
        if wait == Wait::No
            && !raw.lines()
            && self.inner.schema_current.load(Ordering::Relaxed)
            && !cancel.is_some_and(Cancel::is_cancelled)
        {
            match raw.try_without_connection(key) {
                // No shared session could be opened (the pool is full): a wait with time
                // left goes on below, waiting for a connection of its own until its deadline.
                Some(Err(Error::Pool(e))) if !matches!(deadline, Deadline::Once) => {
                    log::debug!(
                        "lock {key:?}: no shared session to try on ({e}); waiting for a connection"
                    );
                }
                Some(attempt) => {
                    if matches!(attempt, Ok(None)) {
                        self.inner.shared.meter.contended();
                    }
                    return match attempt {
                        Err(Error::Pool(e)) => Err(self.pool_error(e)),
                        Ok(Some(taken)) if cancel.is_some_and(Cancel::is_cancelled) => {
                            // Cancelled meanwhile: never a lock.
                            give_back_cancelled(key, taken);
                            Ok(None)
                        }
                        attempt => attempt,
                    };
                }
                None => {}
            }
        }
        if raw.lines() {
            if let Some(taken) = self.take_told(raw, key, place, cancel) {
                return Ok(taken);
            }
        }
        let mut kept = kept;
        let mut conn = match kept.as_mut().and_then(|k| k.take()) {
            Some(c) => c,
            None => match self.connection(deadline, cancel)? {
                Some(c) => c,
                None => return Ok(None), // cancelled while waiting for a connection
            },
        };
        self.check_schema(&mut conn)?;
        let mut conn = Conn::new(conn);
        let live = Arc::new(Mutex::new(true));
        let registration = match cancel {
            Some(c) if wait != Wait::No => {
                match raw.interrupter(&mut conn)? {
                    Some(interrupt) => {
                        conn.cancellable = true;
                        let live = live.clone();
                        Some(c.on_cancel(Arc::new(move || {
                            // Taking a connection may block: not while holding `live`.
                            if let Some(end) = interrupt() {
                                let live = live.lock().unpoisoned();
                                if *live {
                                    end();
                                }
                            }
                        })))
                    }
                    None => None,
                }
            }
            _ => None,
        };
        let attempt = if cancel.is_some_and(Cancel::is_cancelled) {
            Ok(None)
        } else if raw.lines() {
            self.attempt_in_line(raw, &mut conn, key, retry, deadline, place)
        } else {
            raw.try_acquire(&mut conn, key, retry, wait)
        };
        // From here on no cancellation ends this session (waits for one ending it now).
        *live.lock().unpoisoned() = false;
        let interruptible = registration.is_some();
        drop(registration);
        let cancelled = cancel.is_some_and(Cancel::is_cancelled);
        if cancelled && interruptible {
            // Its session may have been ended: closed, not pooled.
            if let Some(c) = conn.get_mut() {
                discard(&mut **c);
            }
        }
        match kept {
            // Kept only for a pause of at most `KEEP_WITHIN` before the next look, while
            // the pool has another connection idle or room to open one, and by at most half
            // the pool's connections at once (`Kept::put`): a thread of this process that
            // needs one (a holder's release, a heartbeat, a short wait) gets it at once, or
            // at a keeper's next look at the latest (when its connection goes back).
            Some(k)
                if !cancelled
                    && !interruptible
                    && matches!(attempt, Ok(None))
                    && place
                        .as_ref()
                        .is_some_and(|p| p.pause(self.inner.max_backoff) <= KEEP_WITHIN)
                    && self.spare_connection() =>
            {
                if let Some(c) = conn.into_pooled() {
                    k.put(c);
                }
            }
            _ => drop(conn),
        }
        if !cancelled && matches!(attempt, Ok(None)) {
            self.inner.shared.meter.contended();
        }
        match attempt {
            Ok(Some(taken)) if cancelled => {
                // Granted as it was cancelled; its session may have been ended already.
                give_back_cancelled(key, taken);
                Ok(None)
            }
            Err(e) if cancelled => {
                log::debug!("lock {key:?}: wait cancelled ({e})");
                Ok(None)
            }
            attempt => attempt,
        }
    }

    /// Whether a failed attempt of a wait lost the database, and the wait should go on: a
    /// connection that died, or a pool that could not open one (though it had room for one:
    /// a pool whose connections are all taken is exhausted, not cut off, and says so). A pool
    /// that could not connect before any attempt reached the database is a wrong URL or a
    /// database that was down from the start: an error at once.
    fn lost_the_database(&self, e: &Error, reached: bool) -> bool {
        match e {
            Error::Pool(_) => {
                let pool = &self.inner.pool;
                reached && pool.state().connections < pool.max_size()
            }
            Error::Connection { .. } => reached,
            e => crate::error::is_connection_lost(e),
        }
    }

    /// Refuses to touch tables older than this build, once per `Locker`: a database
    /// migrated by an older version, or still being migrated by another process (on MySQL
    /// each DDL statement commits at once, so the tables of the first migrations are
    /// visible before the last one is applied), is `Error::MissingTable`, which says to
    /// migrate, instead of whatever the first missing piece would make a statement do.
    fn check_schema(&self, conn: &mut Pooled<C>) -> Result<()> {
        /// How long a migration committed elsewhere is given to show.
        const SCHEMA_PATIENCE: Duration = Duration::from_secs(1);
        let current = &self.inner.schema_current;
        if current.load(Ordering::Relaxed) {
            return Ok(());
        }
        // A migration just committed on another node of a cluster (Galera applies other
        // nodes' commits a moment later) or by another process is given up to a second to
        // show, once per `Locker`: a database that is not migrated pays that second once,
        // and later calls get the error at once.
        let mut found = conn.sql().schema_current()?;
        if !found && !self.inner.schema_waited.swap(true, Ordering::Relaxed) {
            let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(200));
            let patience = Instant::now() + SCHEMA_PATIENCE;
            while !found && Instant::now() < patience {
                std::thread::sleep(backoff.next_pause());
                found = conn.sql().schema_current()?;
            }
        }
        if !found {
            return Err(Error::MissingTable(diesel::result::Error::DatabaseError(
                diesel::result::DatabaseErrorKind::Unknown,
                Box::new("a migration of this version of diesel-lock is not applied".to_owned()),
            )));
        }
        current.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// The answer of a wait whose deadline passed while other threads of this `Locker` were
    /// ahead of it for `key`: `Ok(None)` if the database can be reached (a pooled connection
    /// checks out, or the pool is merely busy), `Error::Unreachable` if it cannot.
    fn missed_in_line(&self, key: &str) -> Result<Option<LockGuard<C>>> {
        match self.connection(Deadline::Once, None) {
            Err(e) if self.lost_the_database(&e, true) => Err(Error::Unreachable {
                key: key.to_owned(),
                source: Box::new(e),
            }),
            _ => Ok(None),
        }
    }

    /// A pooled connection for one attempt; `None` if the wait was cancelled meanwhile.
    fn connection(&self, deadline: Deadline, cancel: Option<&Cancel>) -> Result<Option<Pooled<C>>> {
        let pool = &self.inner.pool;
        let patience = match deadline {
            // One attempt does not wait for the lock: it waits for a connection being
            // opened (which can take more than a few ms on a loaded machine, and is needed
            // too when the idle ones turn out dead) up to a second, and for one to come back
            // to a pool whose connections are all taken a moment. (`get_timeout` hands out
            // an idle connection at once.)
            Deadline::Once => {
                let state = pool.state();
                if state.connections < pool.max_size() || state.idle_connections > 0 {
                    pool.connection_timeout().min(Duration::from_secs(1))
                } else {
                    Duration::from_millis(20)
                }
            }
            Deadline::Never => pool.connection_timeout(),
            Deadline::At(_) => {
                let state = pool.state();
                if state.idle_connections > 0 || state.connections < pool.max_size() {
                    // The pool opens a connection for us (none is idle, or the idle ones
                    // turn out dead when tested: a server restarted, sessions killed): on a
                    // loaded machine that is not waiting for the lock, and a short deadline
                    // still gets a second for it (opening one can take longer than a short
                    // deadline; an idle one that is alive comes at once); but no more than
                    // the deadline beyond that, so that a server that does not answer holds
                    // the call up by at most that second, not the pool's whole timeout.
                    deadline
                        .remaining()
                        .unwrap_or_default()
                        .max(Duration::from_secs(1))
                        .min(pool.connection_timeout())
                } else {
                    // Every connection taken: waited for until the deadline, though a short
                    // deadline still gets a fair chance at a momentarily busy pool.
                    deadline
                        .remaining()
                        .unwrap_or_default()
                        .max(Duration::from_millis(20))
                }
            }
        };
        let Some(cancel) = cancel else {
            return match pool.get_timeout(patience) {
                Ok(conn) => Ok(Some(conn)),
                Err(e) => Err(self.pool_error(e)),
            };
        };
        // Cancellable: in short slices (r2d2 has no other way to give up a wait).
        let start = Instant::now();
        loop {
            if cancel.is_cancelled() {
                return Ok(None);
            }
            let left = patience.saturating_sub(start.elapsed());
            match pool.get_timeout(left.min(Duration::from_millis(20))) {
                Ok(conn) => return Ok(Some(conn)),
                Err(e) if left <= Duration::from_millis(20) => return Err(self.pool_error(e)),
                Err(_) => {}
            }
        }
    }

    /// Whether a thread that asks the pool for a connection now gets one without waiting
    /// (an idle one, or room to open one).
    fn spare_connection(&self) -> bool {
        let pool = &self.inner.pool;
        let state = pool.state();
        state.idle_connections > 0 || state.connections < pool.max_size()
    }

    /// True if waiters hear other processes' releases (and so poll only as a fallback);
    /// starts the listener at the first wait.
    fn listening(&self) -> bool {
        #[cfg(feature = "postgres")]
        if let Some(l) = &self.inner.listener {
            return match l.start() {
                Ok(()) => true,
                Err(e) => {
                    log::warn!("release listener: cannot start its thread ({e}); waiters poll");
                    false
                }
            };
        }
        #[cfg(all(feature = "sqlite", target_os = "linux"))]
        if let Some(d) = &self.inner.doorbell {
            return match d.start() {
                Ok(()) => true,
                Err(e) => {
                    log::warn!("doorbell: cannot start its thread ({e}); waiters poll");
                    false
                }
            };
        }
        false
    }

    /// The channel this `Locker`'s listener hears, which its waiters' places name.
    pub(super) fn channel(&self) -> Option<&str> {
        #[cfg(feature = "postgres")]
        if let Some(l) = &self.inner.listener {
            return Some(l.channel());
        }
        #[cfg(all(feature = "sqlite", target_os = "linux"))]
        if let Some(d) = &self.inner.doorbell {
            return Some(d.name());
        }
        None
    }

    fn guard(&self, raw: &dyn RawLock<C>, key: &str, taken: Taken) -> LockGuard<C> {
        // A reader or a permit leaves room for others: local waiters keep trying.
        if raw.exclusive() {
            self.inner.shared.queues.hold(key);
        }
        log::debug!(
            "lock {key:?} acquired ({}, token {})",
            self.inner.strategy.name(),
            taken.token
        );
        let keeps = taken.hold.keeps_connection();
        let guard = LockGuard::new(self.inner.shared.clone(), key.to_owned(), taken);
        // A session strategy's hold keeps its pooled connection until released (unless it
        // shares its session with other guards: `Advisory`'s tries).
        match self.inner.strategy {
            Strategy::ForUpdate | Strategy::Advisory | Strategy::AdvisoryXact if keeps => {
                guard.keeping_connection()
            }
            _ => guard,
        }
    }
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use super::*;
    use std::cell::Cell;

    thread_local! {
        /// The attempts this thread made.
        pub(super) static ATTEMPTS: Cell<usize> = const { Cell::new(0) };
    }

    fn url() -> Option<String> {
        crate::test_env::server_url("DLOCK_TEST_PG_URL", "pg")
    }

    /// A waiter that first queued behind another local waiter also listens once it is first
    /// in line: it waited for a lock held by another process with one poll, not with the
    /// ever longer backoff of a waiter that hears nothing.
    #[test]
    fn a_waiter_that_queued_first_listens_too() {
        let Some(url) = url() else { return };
        let pool = r2d2::Pool::builder()
            .max_size(4)
            .min_idle(Some(0))
            .build(diesel::r2d2::ConnectionManager::<diesel::PgConnection>::new(&url))
            .unwrap();
        let s = Strategy::Lease {
            ttl: Duration::from_secs(30),
        };
        let other = Locker::builder(pool.clone()).strategy(s).build().unwrap();
        other.migrate().unwrap();
        let listening = Locker::builder(pool)
            .strategy(s)
            .listen_url(url.clone())
            .max_backoff(Duration::from_secs(2))
            .build()
            .unwrap();
        let key = format!("queued-listens-{}-{:?}", std::process::id(), Instant::now());
        let held = other.lock(&key).unwrap();
        let first = {
            let (l, k) = (listening.clone(), key.clone());
            std::thread::spawn(move || {
                l.try_lock_for(&k, Duration::from_millis(300))
                    .unwrap()
                    .is_none()
            })
        };
        while !listening.inner.shared.queues.has_waiters() {
            std::thread::yield_now();
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let second = {
            let (l, k) = (listening.clone(), key.clone());
            std::thread::spawn(move || {
                tx.send(()).unwrap();
                let guard = l.lock(&k).unwrap();
                drop(guard);
                ATTEMPTS.with(Cell::get)
            })
        };
        rx.recv().unwrap();
        assert!(
            first.join().unwrap(),
            "the first waiter gave up at its deadline"
        );
        // The second is first in line now, waiting for another process's lock.
        std::thread::sleep(Duration::from_millis(1500));
        held.release().unwrap();
        let attempts = second.join().unwrap();
        assert!(
            attempts <= 3,
            "{attempts} attempts: it polled instead of listening"
        );
    }
}

/// Releases a lock taken (or granted) as its wait was cancelled: a cancelled wait never
/// returns a lock, and the release hands the key on as any release does.
pub(super) fn give_back_cancelled(key: &str, taken: Taken) {
    if let Err(e) = taken.hold.release(key) {
        log::debug!("lock {key:?}: releasing a lock taken as its wait was cancelled failed ({e})");
    }
}
