//! Semaphores of the session strategies (`Locker::permit` on a `ForUpdate` or `Advisory`
//! `Locker`): N *slots* per key, of which a holder takes one that is free, held by its
//! session as the strategy holds a key, so a dead holder's permit returns as soon as the
//! server sees its session end. `ForUpdate`: slot rows (`dlock_permit_slots`), the first
//! free one locked `FOR UPDATE SKIP LOCKED` in the guard's transaction. `Advisory`: one
//! advisory lock per slot (PostgreSQL `pg_try_advisory_lock`, MySQL `GET_LOCK`, on the
//! hash of the key and the slot's number), tried in turn. Neither waits on the server: with
//! every slot taken, the waiting code pauses and tries again. The number of permits is kept
//! with the key as a `Lease` semaphore's (`dlock_shared_keys`); each permit's token comes
//! from the strategy's global source.

use super::for_update::shared::{share, ForShareHold};
use super::session::{self, discard, rollback, Session};
use super::{Conn, Hold, ModeLock, RawLock, Taken};
use crate::backend::fence::no_token;
use crate::backend::{Flavor, ForUpdateLocked, LockConnection, Sql, Wait};
use crate::sync::Unpoison;
use crate::{Error, Result};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

/// The most permits a session strategy's semaphore may have: each is a row or a lock that
/// an attempt may try.
pub(crate) const MAX_SESSION_PERMITS: u32 = 1000;

/// How many (key, permits) pairs a `Locker` remembers as set up.
const MAX_KNOWN: usize = 4096;

/// Which strategy's slots.
#[derive(Debug, Clone, Copy)]
pub(super) enum SlotKind {
    ForUpdate(Flavor),
    Advisory,
}

/// What a `Locker`'s session semaphores share: the keys (with their permits) known to be
/// set up, so that only the first attempt on a key asks.
pub(super) struct SlotCore {
    pub(super) kind: SlotKind,
    pub(super) known: Mutex<HashSet<(String, u32)>>,
}

impl SlotCore {
    pub(super) fn new(kind: SlotKind) -> Arc<SlotCore> {
        Arc::new(SlotCore {
            kind,
            known: Mutex::default(),
        })
    }
}

/// The raw lock of a permit of a semaphore of `permits` on `core`, for `strategy`'s
/// `RawLock::mode`.
pub(super) fn slot_lock<C: LockConnection>(
    core: &Arc<SlotCore>,
    permits: u32,
    strategy: &str,
) -> Result<Option<ModeLock<C>>> {
    if permits > MAX_SESSION_PERMITS {
        return Err(Error::InvalidConfig(format!(
            "a semaphore of the {strategy} strategy has at most {MAX_SESSION_PERMITS} permits"
        )));
    }
    Ok(Some(ModeLock::Other(Arc::new(SlotLock {
        core: core.clone(),
        permits,
        _conn: std::marker::PhantomData,
    }))))
}

/// A permit of a semaphore of `permits`.
pub(super) struct SlotLock<C: LockConnection> {
    pub(super) core: Arc<SlotCore>,
    pub(super) permits: u32,
    pub(super) _conn: std::marker::PhantomData<fn() -> C>,
}

/// The advisory lock of slot `i` of `key`: never a key's own (keys have no NUL).
fn slot_key(key: &str, i: u32) -> String {
    format!("{key}\0permit {i}")
}

impl<C: LockConnection> SlotLock<C> {
    /// Makes the key a semaphore of `permits` (and its slot rows), once per `Locker`.
    fn setup(&self, conn: &mut C, key: &str) -> Result<()> {
        let known = (key.to_owned(), self.permits);
        let mut set = self.core.known.lock().unpoisoned();
        if set.contains(&known) {
            return Ok(());
        }
        let slots = matches!(self.core.kind, SlotKind::ForUpdate(_));
        let stored = share(conn)?.permits_setup(key, i64::from(self.permits), slots)?;
        if stored != i64::from(self.permits) {
            return Err(Error::Permits {
                key: key.to_owned(),
                stored: u32::try_from(stored).unwrap_or(u32::MAX),
                asked: self.permits,
            });
        }
        // A bound on what is remembered: a `Locker` naming ever new keys asks again rather
        // than growing without end.
        if set.len() >= MAX_KNOWN {
            set.clear();
        }
        set.insert(known);
        Ok(())
    }

    fn for_update(&self, conn: &mut Conn<C>, key: &str, flavor: Flavor) -> Result<Option<Taken>> {
        // A token that may not go out yet is made ready outside the transaction (as
        // `ForUpdate` does): three rounds are plenty.
        for _ in 0..3 {
            let Some(locked) =
                session::lock_in_txn(conn, |c| share(c)?.permit_slot_lock(key, flavor))?
            else {
                return Ok(None);
            };
            match locked {
                Ok(ForUpdateLocked::Locked(a)) => {
                    return Ok(Some(Taken {
                        hold: Box::new(ForShareHold {
                            session: Session::new(conn.take()),
                            proof: a.id,
                        }),
                        token: a.token,
                        acquired_at: a.acquired_at,
                    }))
                }
                Ok(ForUpdateLocked::Missing | ForUpdateLocked::Blocked) => {
                    rollback(conn);
                    return Ok(None); // every slot taken
                }
                Ok(ForUpdateLocked::Unfenced(drawn)) => {
                    rollback(conn);
                    conn.session_sql()?.fence_prepare(drawn)?;
                }
                Err(e) => return session::lock_failed(conn, e),
            }
        }
        Err(Error::Database(no_token()))
    }

    fn advisory(&self, conn: &mut Conn<C>, key: &str) -> Result<Option<Taken>> {
        for i in 0..self.permits {
            let slot = slot_key(key, i);
            match conn.session_sql()?.advisory_lock(&slot, Wait::No) {
                Ok(Some(a)) => {
                    return Ok(Some(Taken {
                        hold: Box::new(AdvisorySlotHold {
                            session: Session::new(conn.take()),
                            slot,
                        }),
                        token: a.token,
                        acquired_at: a.acquired_at,
                    }))
                }
                Ok(None) => {}
                Err(e) => {
                    // The lock may have been granted before the error: closing the session
                    // is the one sure way to let go of it.
                    discard(&mut **conn);
                    return Err(e.into());
                }
            }
        }
        Ok(None)
    }
}

impl<C: LockConnection> RawLock<C> for SlotLock<C> {
    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        _retry: bool,
        _wait: Wait,
    ) -> Result<Option<Taken>> {
        self.setup(&mut **conn, key)?;
        match self.core.kind {
            SlotKind::ForUpdate(flavor) => self.for_update(conn, key, flavor),
            SlotKind::Advisory => self.advisory(conn, key),
        }
    }

    fn exclusive(&self) -> bool {
        false
    }
}

/// The connection whose session holds one slot's advisory lock.
struct AdvisorySlotHold<C: LockConnection> {
    session: Session<C>,
    slot: String,
}

impl<C: LockConnection> Hold for AdvisorySlotHold<C> {
    fn release(self: Box<Self>, key: &str) -> Result<bool> {
        let slot = self.slot;
        self.session
            .end(key, |c| c.session_sql()?.advisory_unlock(&slot))
    }

    fn held(&self, key: &str) -> Result<bool> {
        self.session
            .held(key, |c| c.session_sql()?.advisory_held(&self.slot))
    }
}
