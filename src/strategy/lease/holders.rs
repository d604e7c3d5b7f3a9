//! Shared leases (readers and writers) and semaphore permits of a `Lease` `Locker`: one row
//! per holder with its own expiry on the database clock, renewed by a heartbeat of their own
//! (`dlock_shared_leases`; the SQL and the decision are in `backend/holders.rs`).
//!
//! Writers do not starve: a writer that will wait (not a single `try_write`) and finds the
//! key busy leaves an *intent* on the key's header row, which keeps every new reader out
//! while it lasts; each of the writer's attempts renews it for `intent` (4 × `max_backoff`,
//! at least 100 ms, so it outlasts the pauses between attempts), its acquisition clears it,
//! and so does a writer that gives up waiting (`RawLock::gave_up`; one that dies lets it
//! run out). So a writer waits at most for the readers
//! holding the key when it first tried to leave, plus one pause between attempts.

use super::heartbeat::Heartbeat;
use super::{LeaseHold, Rows};
use crate::backend::holders::{HolderAnswer, HolderAsk, HolderMode};
use crate::backend::{LockConnection, Sql, Wait};
use crate::strategy::{check_duration, contention_is_busy, micros, with_pooled};
use crate::strategy::{Conn, Pool, RawLock, Setup, Taken};
use crate::{Error, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the holder locks of one `Locker` share.
pub(crate) struct HolderCore<C: LockConnection> {
    pool: Pool<C>,
    owner: String,
    ttl_us: i64,
    /// A waiting writer's intent lasts this long unless its next attempt renews it.
    intent_us: i64,
    /// Names this `Locker`'s waiting writers (with their thread) in the key's intent.
    id: String,
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
        let intent = (setup.max_backoff * 4).clamp(Duration::from_millis(100), MAX_INTENT);
        Ok(HolderCore {
            heartbeat: Arc::new(Heartbeat::with_renewal(
                setup.pool.clone(),
                every,
                ttl,
                |c: &mut C, key, holder, ttl_us, bound| {
                    c.sql().holders_renew(key, holder, ttl_us, bound)
                },
            )),
            pool: setup.pool.clone(),
            owner: setup.owner.clone(),
            ttl_us: micros(ttl).unwrap_or(i64::MAX),
            intent_us: micros(intent).unwrap_or(i64::MAX),
            id: format!("{:016x}", crate::random::random_u64()),
        })
    }
}

/// The longest a writer's intent lasts without renewal.
const MAX_INTENT: Duration = Duration::from_secs(5);

/// A reader, a writer or a semaphore permit of one key.
pub(crate) struct HolderLock<C: LockConnection> {
    pub(crate) core: Arc<HolderCore<C>>,
    pub(crate) mode: HolderMode,
    /// 0 for readers and writers.
    pub(crate) permits: u32,
}

impl<C: LockConnection> HolderLock<C> {
    fn attempt(&self, conn: &mut C, key: &str, wait: Wait) -> Result<Option<Taken>> {
        let core = &*self.core;
        let holder = crate::random::holder_id();
        let who = format!("{}:{:?}", core.id, std::thread::current().id());
        let ask = HolderAsk {
            key,
            owner: &core.owner,
            holder: &holder,
            mode: self.mode,
            permits: i64::from(self.permits),
            ttl_us: core.ttl_us,
            intent: (self.mode == HolderMode::Write && wait != Wait::No)
                .then_some((who.as_str(), core.intent_us)),
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
        wait: Wait,
    ) -> Result<Option<Taken>> {
        let attempt = self.attempt(conn, key, wait);
        contention_is_busy(&mut **conn, key, attempt)
    }

    fn gave_up(&self, key: &str) {
        if self.mode != HolderMode::Write {
            return;
        }
        // The same name as the attempts gave it: this thread's, of this `Locker`.
        let who = format!("{}:{:?}", self.core.id, std::thread::current().id());
        // Only a connection free at once: the caller's deadline has passed already.
        let Some(conn) = self.core.pool.try_get() else {
            log::debug!(
                "lock {key:?}: no free connection to clear the writer's intent; it runs out"
            );
            return;
        };
        if let Err(e) = with_pooled(conn, |c| c.sql().holders_clear_intent(key, &who)) {
            log::debug!(
                "lock {key:?}: the writer's intent could not be cleared ({e}); it runs out"
            );
        }
    }

    fn exclusive(&self) -> bool {
        self.mode == HolderMode::Write
    }
}
