//! `Strategy::Lease`: holder + expiry on the database clock, renewed by the heartbeat, which
//! this strategy owns (its interval is a `Lease` option).

use super::heartbeat::{Beat, Heartbeat};
use super::{check_duration, contention_is_busy, micros, with_conn, Hold, Pool, RawLock, Setup};
use super::{Conn, Taken};
use crate::backend::{LockConnection, Sql, Wait};
use crate::backoff::Backoff;
use crate::{Error, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) struct LeaseLock<C: LockConnection> {
    pool: Pool<C>,
    owner: String,
    ttl_us: i64,
    /// Shared with the guards, so that a guard that outlives its `Locker` is still renewed.
    heartbeat: Arc<Heartbeat<C>>,
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
            heartbeat: Arc::new(Heartbeat::new(setup.pool.clone(), every, ttl)),
            pool: setup.pool,
            owner: setup.owner,
            ttl_us: micros(ttl).unwrap_or(i64::MAX),
        })
    }

    fn attempt(&self, conn: &mut C, key: &str, retry: bool) -> Result<Option<Taken>> {
        let holder = crate::random::holder_id();
        let mut backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(16));
        let mut tries = 0;
        let (sent, a) = loop {
            let sent = Instant::now();
            let acquired = conn
                .sql()
                .lease_acquire(key, &self.owner, &holder, self.ttl_us, retry);
            // A free key can look held for a moment while a purge runs: an attempt whose
            // snapshot still showed the row its second step has just deleted finds nothing
            // to take over, and either step may make an acquisition a deadlock victim
            // (MariaDB). A first attempt that finds the key held by nobody, or that met
            // contention, tries again (a fresh snapshot sees the row gone) a few times
            // instead of reporting it held. (Waiting callers try again anyway.) Marked rows
            // are expired, so they never look held (before, a mark held the key for as long
            // as the purge's second step took: 4-8 of 1,200 try_locks on free keys said
            // held on a loaded machine).
            tries += 1;
            let last = retry || tries == 5;
            match acquired {
                Ok(Some(a)) => break (sent, a),
                Err(e) if !last && conn.sql().is_contention(&e) => {
                    log::debug!("lock {key:?}: contention ({e}); trying again");
                }
                Err(e) => return Err(e.into()),
                Ok(None) if last || !conn.sql().admin_leases(Some(key))?.is_empty() => {
                    return Ok(None)
                }
                Ok(None) => {}
            }
            log::debug!("lock {key:?}: held by nobody (a purge under way?); trying again");
            std::thread::sleep(backoff.next_pause());
        };
        let beat = self.heartbeat.register(key, &holder, sent);
        Ok(Some(Taken {
            hold: Box::new(LeaseHold {
                pool: self.pool.clone(),
                holder,
                beat: Some(beat),
                _heartbeat: self.heartbeat.clone(),
            }),
            token: a.token,
            acquired_at: a.acquired_at,
        }))
    }
}

impl<C: LockConnection> RawLock<C> for LeaseLock<C> {
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

    fn notifies_releases(&self) -> bool {
        true
    }

    fn purge(&self, idle: Duration) -> Result<usize> {
        // Past the 100-year cap every row is younger than `idle`: nothing to delete (and the
        // databases' date arithmetic would overflow).
        let idle_us = micros(idle.min(super::MAX_DURATION)).unwrap_or(i64::MAX);
        // Each step is one statement or transaction; a deadlock victim's was rolled back and
        // is run again.
        with_conn(&self.pool, |c| c.sql().purge_mark_leases(idle_us))?;
        with_conn(&self.pool, |c| c.sql().purge_delete_leases())
    }
}

/// A held lease: its holder id and its registration with the heartbeat.
struct LeaseHold<C: LockConnection> {
    pool: Pool<C>,
    holder: String,
    /// `None` once released.
    beat: Option<Beat>,
    _heartbeat: Arc<Heartbeat<C>>,
}

impl<C: LockConnection> Hold for LeaseHold<C> {
    fn release(mut self: Box<Self>, key: &str) -> Result<bool> {
        // Stop renewing first. A renewal already under way cannot revive the lease after the
        // release below: renewals match on our holder id, which the release clears.
        let was_lost = self.beat.take().is_none_or(|beat| beat.is_lost());
        let released = with_conn(&self.pool, |c| c.sql().lease_release(key, &self.holder))?;
        Ok(released && !was_lost)
    }

    fn held(&self, key: &str) -> Result<bool> {
        if self.beat.as_ref().is_none_or(Beat::is_lost) {
            return Ok(false);
        }
        with_conn(&self.pool, |c| c.sql().lease_held(key, &self.holder))
    }
}
