//! Readers and semaphore permits of a `Lease` `Locker`: one row per holder with its own
//! expiry on the database clock, renewed by a heartbeat of their own
//! (`dlock_shared_leases`; the SQL and the decision are in `backend/holders.rs`). The
//! writer is the `Locker`'s exclusive lease (`LeaseLock`), which excludes them and which
//! they exclude.
//!
//! Everyone waits in the key's line (`locker/line.rs`), in one order: a waiting exclusive
//! lock, reader or permit has a place there. No reader or permit gets in past an exclusive
//! waiter's place (so a writer waits at most for the readers holding the key when it took
//! its place), and a permit only while the free permits outnumber the places ahead of it
//! (a releaser asking again goes behind those who waited: first come, first served).

use super::heartbeat::Heartbeat;
use super::{LeaseHold, Rows};
use crate::backend::holders::{HolderAnswer, HolderAsk, HolderMode};
use crate::backend::{LockConnection, Sql, Wait};
use crate::strategy::{check_duration, contention_is_busy, micros};
use crate::strategy::{Conn, Pool, RawLock, Setup, Taken};
use crate::{Error, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the holder locks of one `Locker` share.
pub(crate) struct HolderCore<C: LockConnection> {
    pool: Pool<C>,
    owner: String,
    ttl_us: i64,
    heartbeat: Arc<Heartbeat<C>>,
}

impl<C: LockConnection> HolderCore<C> {
    pub(crate) fn new(setup: &Setup<C>, ttl: Duration) -> Result<Self> {
        check_duration(ttl, "the lease ttl")?;
        let every = setup.heartbeat.unwrap_or(ttl / 3);
        if every.is_zero() || every >= ttl {
            return Err(Error::InvalidConfig(
                "the heartbeat must be longer than zero and shorter than the ttl".into(),
            ));
        }
        Ok(HolderCore {
            heartbeat: Arc::new(Heartbeat::with_renewal(
                setup.pool.clone(),
                every,
                ttl,
                |c: &mut C, key, holder, ttl_us, bound| {
                    c.sql().holders_renew(key, holder, ttl_us, bound)
                },
                Some(|c: &mut C, holders: &[(String, String)], ttl_us| {
                    c.sql().holders_renew_many(holders, ttl_us)
                }),
            )),
            pool: setup.pool.clone(),
            owner: setup.owner.clone(),
            ttl_us: micros(ttl).unwrap_or(i64::MAX),
        })
    }
}

/// A reader or a semaphore permit of one key.
pub(crate) struct HolderLock<C: LockConnection> {
    pub(crate) core: Arc<HolderCore<C>>,
    pub(crate) mode: HolderMode,
    /// 0 for readers.
    pub(crate) permits: u32,
}

impl<C: LockConnection> HolderLock<C> {
    fn attempt(&self, conn: &mut C, key: &str, place: i64) -> Result<Option<Taken>> {
        let core = &*self.core;
        let holder = crate::random::holder_id();
        let ask = HolderAsk {
            key,
            owner: &core.owner,
            holder: &holder,
            mode: self.mode,
            permits: i64::from(self.permits),
            ttl_us: core.ttl_us,
            place,
        };
        let sent = Instant::now();
        match conn.sql().holders_acquire(&ask)? {
            HolderAnswer::Busy => Ok(None),
            HolderAnswer::Mismatch { stored } => Err(Error::Permits {
                key: key.to_owned(),
                stored: u32::try_from(stored).unwrap_or(u32::MAX),
                asked: self.permits,
            }),
            HolderAnswer::Taken(a) => {
                let beat = core.heartbeat.register(key, &holder, sent);
                Ok(Some(Taken {
                    hold: Box::new(LeaseHold {
                        rows: Rows::Holder,
                        granted: None,
                        pool: core.pool.clone(),
                        holder,
                        beat: Some(beat),
                        heartbeat: core.heartbeat.clone(),
                    }),
                    token: a.token,
                    acquired_at: a.acquired_at,
                }))
            }
        }
    }
}

impl<C: LockConnection> RawLock<C> for HolderLock<C> {
    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        _retry: bool,
        _wait: Wait,
    ) -> Result<Option<Taken>> {
        let place = conn.place;
        let attempt = self.attempt(conn, key, place);
        contention_is_busy(&mut **conn, key, attempt)
    }

    fn exclusive(&self) -> bool {
        false
    }

    /// Readers and permits wait in the key's line with the exclusive waiters, in one order.
    fn line(&self) -> Option<crate::backend::Line> {
        Some(crate::backend::Line::Lease)
    }

    fn flags_line(&self) -> bool {
        true
    }

    /// A semaphore's permits; readers are not counted.
    fn room(&self) -> u32 {
        match self.mode {
            HolderMode::Permit => self.permits,
            HolderMode::Read => u32::MAX,
        }
    }
}
