//! `Strategy::Lease`: holder + expiry on the database clock, renewed by the heartbeat, which
//! this strategy owns (its interval is a `Lease` option).

mod heartbeat;
mod holders;
mod validity;

use super::{check_duration, contention_is_busy, micros, with_conn, with_pooled};
use super::{Conn, Grant, Taken};
use super::{Hold, Mode, ModeLock, Pool, RawLock, Setup};
use crate::backend::holders::HolderMode;
use crate::backend::{LockConnection, PurgeTable, Sql, Wait};
use crate::backoff::Backoff;
use crate::{Error, Result};
use diesel::QueryResult;
use heartbeat::{Beat, Heartbeat};
use holders::{HolderCore, HolderLock};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A first attempt's try that met contention within this long came back without waiting
/// (a deadlock victim) and is tried again; a slower one waited already and counts as busy.
const QUICK_CONTENTION: Duration = Duration::from_millis(100);

pub(super) struct LeaseLock<C: LockConnection> {
    pool: Pool<C>,
    owner: String,
    ttl_us: i64,
    /// Shared with the guards, so that a guard that outlives its `Locker` is still renewed.
    heartbeat: Arc<Heartbeat<C>>,
    /// Its readers and semaphore permits: shared leases, one row per holder.
    holders: Arc<HolderCore<C>>,
}

impl<C: LockConnection> LeaseLock<C> {
    pub(super) fn new(setup: Setup<C>, ttl: Duration) -> Result<Self> {
        check_duration(ttl, "the lease ttl")?;
        let every = setup.heartbeat.unwrap_or(ttl / 3);
        if every.is_zero() || every >= ttl {
            return Err(Error::InvalidConfig(
                "the heartbeat must be longer than zero and shorter than the ttl".into(),
            ));
        }
        Ok(LeaseLock {
            holders: Arc::new(HolderCore::new(&setup, ttl)?),
            heartbeat: Arc::new(Heartbeat::new(setup.pool.clone(), every, ttl)),
            pool: setup.pool,
            owner: setup.owner,
            ttl_us: micros(ttl).unwrap_or(i64::MAX),
        })
    }

    fn attempt(&self, conn: &mut Conn<C>, key: &str, retry: bool) -> Result<Option<Taken>> {
        let (place, holder, granted) = (conn.place, conn.holder.clone(), conn.granted);
        let holder = holder.unwrap_or_else(crate::random::holder_id);
        if let Some(grant) = granted {
            // A release gave this waiter's place the key, with the place's expiry as the
            // lease's, the deadline to confirm by. The look that saw the grant read what it
            // gave (`Spot::lease`: no statement more on the waiter's path); the
            // confirmation (the lease's own ttl, the place removed) is the heartbeat's first
            // renewal, off the waiter's path, and a holder that releases before it is due
            // never sends it (its release removes the place). `None`: the grant lapsed, or
            // was taken away (a forced release).
            return Ok(self.granted(key, place, &holder, grant));
        }
        let mut backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(16));
        let mut tries = 0;
        let (sent, a) = loop {
            let sent = Instant::now();
            let acquired =
                conn.sql()
                    .lease_acquire(key, &self.owner, &holder, self.ttl_us, retry, place);
            // A free key can look held for a moment while a purge runs: an attempt whose
            // snapshot still showed the row its second step has just deleted finds nothing
            // to take over, and either step may make an acquisition a deadlock victim
            // (MariaDB). A first attempt that finds the key held by nobody, or that met
            // contention, tries again (a fresh snapshot sees the row gone) a few times
            // instead of reporting it held. (Waiting callers try again anyway.) Marked rows
            // are expired, so they never look held. Contention is tried again only when the
            // try came back at once (a deadlock victim): one that waited already (SQLite's
            // busy handler, up to its busy_timeout, while another process holds the
            // database's write lock) is reported busy, so that the caller's wait keeps its
            // deadline.
            tries += 1;
            let last = retry || tries == 5;
            match acquired {
                Ok(Some(a)) => break (sent, a),
                Err(e)
                    if !last
                        && sent.elapsed() < QUICK_CONTENTION
                        && conn.sql().is_contention(&e) =>
                {
                    log::debug!("lock {key:?}: contention ({e}); trying again");
                    std::thread::sleep(backoff.next_pause());
                    continue;
                }
                Err(e) => return Err(e.into()),
                // Held (exclusively, or by readers or permits), or free with others waiting
                // their turn in the key's line.
                Ok(None)
                    if last
                        || !conn.sql().admin_leases(Some(key))?.is_empty()
                        || !conn.sql().admin_holders(Some(key))?.is_empty()
                        || conn
                            .sql()
                            .line_stats(Some(key))?
                            .iter()
                            .any(|l| l.line == i64::from(crate::backend::Line::Lease.id())) =>
                {
                    return Ok(None)
                }
                Ok(None) => {}
            }
            log::debug!("lock {key:?}: held by nobody (a purge under way?); trying again");
            std::thread::sleep(backoff.next_pause());
        };
        Ok(Some(self.taken(key, holder, sent, a)))
    }

    /// The hold of the lease a release granted to `place` (taken with `holder`), as the
    /// grant gave it (`Grant::lease`; `None` if unknown): kept by the heartbeat, whose first
    /// renewal confirms it.
    fn granted(&self, key: &str, place: i64, holder: &str, grant: Grant) -> Option<Taken> {
        grant.lease.map(|a| {
            let beat =
                self.heartbeat
                    .register_granted(key, holder, place, grant.renewed, grant.ttl);
            self.hold(holder.to_owned(), beat, a, Some(place))
        })
    }

    /// The hold of a lease acquired (or confirmed) with a statement sent at `sent`.
    fn taken(
        &self,
        key: &str,
        holder: String,
        sent: Instant,
        a: crate::backend::Acquired,
    ) -> Taken {
        let beat = self.heartbeat.register(key, &holder, sent);
        self.hold(holder, beat, a, None)
    }

    /// The hold of a lease kept by `beat`; `granted`: the place a release granted it to.
    fn hold(
        &self,
        holder: String,
        beat: Beat,
        a: crate::backend::Acquired,
        granted: Option<i64>,
    ) -> Taken {
        Taken {
            hold: Box::new(LeaseHold {
                rows: Rows::Lease,
                granted,
                pool: self.pool.clone(),
                holder,
                beat: Some(beat),
                heartbeat: self.heartbeat.clone(),
            }),
            token: a.token,
            acquired_at: a.acquired_at,
        }
    }
}

impl<C: LockConnection> RawLock<C> for LeaseLock<C> {
    fn mode(&self, mode: Mode) -> Result<Option<ModeLock<C>>> {
        // The writer is the exclusive lease itself: one lock per key, which excludes the
        // key's readers and permits and which they exclude (`backend/holders.rs`).
        let (mode, permits) = match mode {
            Mode::Read => (HolderMode::Read, 0),
            Mode::Write => return Ok(Some(ModeLock::Own)),
            Mode::Permits(n) => (HolderMode::Permit, n),
        };
        Ok(Some(ModeLock::Other(Arc::new(HolderLock {
            core: self.holders.clone(),
            mode,
            permits,
        }))))
    }

    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        retry: bool,
        _wait: Wait,
    ) -> Result<Option<Taken>> {
        let attempt = self.attempt(conn, key, retry);
        contention_is_busy(&mut **conn, key, attempt)
    }

    fn line(&self) -> Option<crate::backend::Line> {
        Some(crate::backend::Line::Lease)
    }

    fn take_grant(&self, key: &str, place: i64, holder: &str, grant: Grant) -> Option<Taken> {
        self.granted(key, place, holder, grant)
    }

    fn flags_line(&self) -> bool {
        true
    }

    fn look(
        &self,
        conn: &mut C,
        key: &str,
        _line: crate::backend::Line,
        id: i64,
        floor: i64,
        holder: &str,
    ) -> diesel::QueryResult<Option<crate::backend::Spot>> {
        conn.sql().line_look_lease(key, id, floor, holder)
    }

    fn give_back(&self, conn: &mut C, key: &str, holder: &str) -> Result<()> {
        if conn.sql().lease_release(key, holder)? {
            log::debug!("lock {key:?}: gave back the key granted as its wait ended");
        }
        Ok(())
    }

    fn purge(&self, idle: Duration) -> Result<usize> {
        // Past the 100-year cap every row is younger than `idle`: nothing to delete (and the
        // databases' date arithmetic would overflow).
        let idle_us = micros(idle.min(super::MAX_DURATION)).unwrap_or(i64::MAX);
        // Each step is one statement or transaction; a deadlock victim's was rolled back and
        // is run again. The shared leases and permits of the same `Locker`
        // (`strategy/holders.rs`) first, so that a key whose holders all expired long ago
        // loses its lease row in the same purge.
        let holders = with_conn(&self.pool, |c| c.sql().holders_purge(idle_us))?;
        // Places of dead waiters (ignored by everyone once lapsed; not counted as locks).
        with_conn(&self.pool, |c| c.sql().purge_lapsed_places())?;
        // The lease rows, the counters and the kinds of keys nobody holds (the token floor is
        // raised first).
        let keys = super::purge::released_keys(
            &self.pool,
            &[PurgeTable::Leases, PurgeTable::Counters],
            idle_us,
        )?;
        Ok(keys + holders)
    }
}

/// Which rows a lease hold keeps: the key's own lease (`dlock_leases`; the exclusive lock
/// and the writer), or one holder of the key's readers or permits (`dlock_shared_leases`).
#[derive(Debug, Clone, Copy)]
enum Rows {
    Lease,
    Holder,
}

impl Rows {
    /// `granted`: the place a release granted the lease to (see `LeaseHold::granted`).
    fn release<C: LockConnection>(
        self,
        c: &mut C,
        key: &str,
        holder: &str,
        granted: Option<i64>,
    ) -> QueryResult<bool> {
        match (self, granted) {
            (Rows::Lease, Some(place)) => c.sql().lease_release_granted(key, holder, place),
            (Rows::Lease, None) => c.sql().lease_release(key, holder),
            (Rows::Holder, _) => c.sql().holders_release(key, holder),
        }
    }

    fn held<C: LockConnection>(self, c: &mut C, key: &str, holder: &str) -> QueryResult<bool> {
        match self {
            Rows::Lease => c.sql().lease_held(key, holder),
            Rows::Holder => c.sql().holders_held(key, holder),
        }
    }
}

/// A held lease (the key's own, or a holder's: `rows`): its holder id and its registration
/// with the heartbeat that renews it.
struct LeaseHold<C: LockConnection> {
    rows: Rows,
    /// The place of the key's line a release granted this lease to, if it came so: its
    /// release removes the place, should the heartbeat not have confirmed the grant yet.
    granted: Option<i64>,
    pool: Pool<C>,
    holder: String,
    /// `None` once released.
    beat: Option<Beat>,
    /// Also runs the guard's check statements.
    heartbeat: Arc<Heartbeat<C>>,
}

impl<C: LockConnection> LeaseHold<C> {
    /// Runs a check statement (as `with_conn` does: contention is retried) on a heartbeat
    /// thread, and waits for its answer until `until`: `None` if there was none by then
    /// (see `Heartbeat::call`).
    fn within<T: Send + 'static>(
        &self,
        until: Instant,
        f: impl FnMut(&mut C) -> diesel::QueryResult<T> + Send + 'static,
    ) -> Option<Result<T>> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let pool = self.pool.clone();
        self.heartbeat.call(Box::new(move || {
            let conn = pool.get_timeout(pool_wait(&pool, until));
            let _ = tx.send(conn.map_err(Error::from).and_then(|c| with_pooled(c, f)));
        }));
        rx.recv_timeout(until.saturating_duration_since(Instant::now()))
            .ok()
    }
}

impl<C: LockConnection> Hold for LeaseHold<C> {
    fn release(mut self: Box<Self>, key: &str) -> Result<bool> {
        // Stop renewing first. A renewal already under way cannot revive the lease after the
        // release below: renewals match on our holder id, which the release clears.
        let Some(until) = self.beat.take().and_then(|beat| beat.deadline()) else {
            // Lost already: the answer would change nothing, so nobody waits for it (in a
            // partition it could hang for a quarter of an hour), but a lease the database
            // still keeps for us (renewed just before the deadline) is freed if it can be.
            let (k, holder, rows) = (key.to_owned(), self.holder.clone(), self.rows);
            let (pool, granted) = (self.pool.clone(), self.granted);
            self.heartbeat.call(Box::new(move || {
                if let Err(e) = with_conn(&pool, |c| rows.release(c, &k, &holder, granted)) {
                    log::debug!("lock {k:?}: the release of the lost lease failed: {e}");
                }
            }));
            return Ok(false);
        };
        // Inline, as a release is part of every lock cycle and a thread would cost as much
        // as the statement on SQLite; waiting for a connection is bounded by the deadline.
        match self.pool.get_timeout(pool_wait(&self.pool, until)) {
            Ok(c) => with_pooled(c, |c| self.rows.release(c, key, &self.holder, self.granted)),
            // None free before the deadline: the lease expires by itself.
            Err(_) if Instant::now() >= until => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    fn loss(&self) -> Option<Arc<crate::loss::Loss>> {
        self.beat.as_ref().map(Beat::loss)
    }

    fn probe_every(&self) -> Option<Duration> {
        None // the heartbeat and the local deadline mark the loss
    }

    fn held(&self, key: &str) -> Result<bool> {
        let Some(beat) = &self.beat else {
            return Ok(false);
        };
        let Some(until) = beat.deadline() else {
            return Ok(false);
        };
        let (k, holder) = (key.to_owned(), self.holder.clone());
        let rows = self.rows;
        let answer = self.within(until, move |c| rows.held(c, &k, &holder));
        // An answer that came after the deadline says nothing about now.
        if beat.is_lost() {
            return Ok(false);
        }
        match answer {
            Some(Ok(true)) => Ok(true),
            // No answer by the deadline: as good as past it.
            Some(Ok(false)) | None => {
                beat.lose();
                Ok(false)
            }
            Some(Err(e)) => Err(e),
        }
    }
}

/// How long to wait for a pooled connection with `until` as the deadline: the pool's own
/// timeout, or less.
fn pool_wait<C: LockConnection>(pool: &Pool<C>, until: Instant) -> Duration {
    let left = until.saturating_duration_since(Instant::now());
    pool.connection_timeout()
        .min(left)
        .max(Duration::from_millis(1))
}
