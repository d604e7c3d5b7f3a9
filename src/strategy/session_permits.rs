//! Semaphores of the session strategies (`Locker::permit` on a `ForUpdate` or `Advisory`
//! `Locker`): N *slots* per key, of which a holder takes one that is free, held by its
//! session as the strategy holds a key, so a dead holder's permit returns as soon as the
//! server sees its session end. `ForUpdate`: slot rows (`dlock_permit_slots`), the first
//! free one locked `FOR UPDATE SKIP LOCKED` in the guard's transaction. `Advisory`: one
//! advisory lock per slot (PostgreSQL `pg_try_advisory_lock` on the hash of the key and the
//! slot's number), tried in turn. Neither waits on the server: with every slot taken, the
//! waiter takes a place in the key's line (`locker/line.rs`) and tries again while more
//! slots are free than live places are ahead of it (a newcomer: all of them): first come,
//! first served, and as many waiters in at once as slots are free. The number of permits is kept with the key as a
//! `Lease` semaphore's (`dlock_shared_keys`); each permit's token comes from the strategy's
//! global source.
//!
//! One lock per key: a permit also holds the key's own lock in shared mode (`ForUpdate`:
//! the key's row `FOR SHARE`, as a reader; `Advisory`: `pg_advisory_lock_shared` of the
//! key), taken first and without waiting, so the key's exclusive lock and its permits
//! exclude each other. MySQL's `GET_LOCK` has no shared mode: an `Advisory` permit there
//! could not keep the key's exclusive lock out, so it is refused (`Error::Incompatible`).

use super::for_update::rows::{row_lock, share, ForShareHold};
use super::session::{discard, Session};
use super::{Conn, Hold, ModeLock, RawLock, Taken};
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

impl SlotKind {
    /// The line of its semaphores' waiters: a `ForUpdate` semaphore and an `Advisory` one of
    /// the same name are different locks.
    fn line(self) -> crate::backend::Line {
        match self {
            SlotKind::ForUpdate(_) => crate::backend::Line::ForUpdatePermits,
            SlotKind::Advisory => crate::backend::Line::AdvisoryPermits,
        }
    }
}

impl SlotCore {
    pub(super) fn new(kind: SlotKind) -> Arc<SlotCore> {
        Arc::new(SlotCore {
            kind,
            known: Mutex::default(),
        })
    }
}

/// Makes `key` a semaphore of `permits` (with its slot rows on `ForUpdate`), or with 0 a
/// reader-writer key, unless it is a key already, once per `Locker` (`core`): a key stored
/// as the other kind, or with another number of permits, is `Error::Permits`. What the
/// session strategies' permits and readers run first.
pub(super) fn check_kind<C: LockConnection>(
    core: &SlotCore,
    conn: &mut C,
    key: &str,
    permits: u32,
) -> Result<()> {
    let known = (key.to_owned(), permits);
    let mut set = core.known.lock().unpoisoned();
    if set.contains(&known) {
        return Ok(());
    }
    let slots = permits > 0 && matches!(core.kind, SlotKind::ForUpdate(_));
    let stored = share(conn)?.permits_setup(key, i64::from(permits), slots)?;
    if stored != i64::from(permits) {
        return Err(Error::Permits {
            key: key.to_owned(),
            stored: u32::try_from(stored).unwrap_or(u32::MAX),
            asked: permits,
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
        check_kind(&self.core, conn, key, self.permits)
    }

    fn for_update(&self, conn: &mut Conn<C>, key: &str, flavor: Flavor) -> Result<Option<Taken>> {
        // The key's row in share mode first, as a reader takes it (never waiting; busy while
        // the key is held exclusively, or a waiting writer has marked it), then a free slot
        // in the same transaction. A missing key row is created, as for a reader; every slot
        // taken is busy.
        row_lock(
            conn,
            key,
            Wait::No,
            |c, _| {
                let share = share(c)?;
                match share.for_share_lock(key, Wait::No, flavor)? {
                    ForUpdateLocked::Locked(_) => match share.permit_slot_lock(key, flavor)? {
                        ForUpdateLocked::Missing => Ok(ForUpdateLocked::Blocked),
                        slot => Ok(slot),
                    },
                    other => Ok(other),
                }
            },
            |session, proof| Box::new(ForShareHold { session, proof }),
        )
    }

    /// How many of the key's slots no holder has, counting at most `upto`.
    fn free_slots(&self, conn: &mut Conn<C>, key: &str, upto: i64) -> Result<i64> {
        match self.core.kind {
            SlotKind::ForUpdate(_) => Ok(share(&mut **conn)?.permit_slots_free(key, upto)?),
            SlotKind::Advisory => {
                let Some(shared) = conn.sql().shared_sessions() else {
                    return Err(no_shared_mode(key));
                };
                let slots: Vec<String> = (0..self.permits).map(|i| slot_key(key, i)).collect();
                let held = shared.advisory_held_anywhere(&slots)?;
                Ok((i64::from(self.permits) - held).clamp(0, upto))
            }
        }
    }

    fn advisory(&self, conn: &mut Conn<C>, key: &str) -> Result<Option<Taken>> {
        let Some(shared) = conn.sql().shared_sessions() else {
            return Err(no_shared_mode(key));
        };
        // The key's own lock in shared mode first, without waiting: busy while the key is
        // held exclusively (or an exclusive lock waits for it: PostgreSQL queues a new shared
        // request behind a waiting exclusive one).
        match shared.advisory_lock_shared(key, Wait::No) {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(None),
            Err(e) => {
                discard(&mut **conn);
                return Err(e.into());
            }
        }
        for i in 0..self.permits {
            let slot = slot_key(key, i);
            match conn.session_sql()?.advisory_lock(&slot, Wait::No) {
                Ok(Some(a)) => {
                    // The waiter's place goes at once, on this session (its locks are
                    // session locks, outside any transaction). Should that fail, the place
                    // lapses at its expiry.
                    let place = conn.place;
                    if place != crate::backend::NO_PLACE {
                        if let Err(e) = conn.sql().line_leave(key, self.core.kind.line(), place) {
                            log::debug!("lock {key:?}: giving up place {place} in line failed ({e}); it lapses");
                        }
                    }
                    return Ok(Some(Taken {
                        hold: Box::new(AdvisorySlotHold {
                            session: Session::new(conn.take()),
                            slot,
                        }),
                        token: a.token,
                        acquired_at: a.acquired_at,
                    }));
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
        // Every slot taken: the key's shared lock goes back before the connection does.
        let unlocked = conn
            .sql()
            .shared_sessions()
            .map(|s| s.advisory_unlock_shared(key));
        if !matches!(unlocked, Some(Ok(true))) {
            discard(&mut **conn);
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
        if matches!(self.core.kind, SlotKind::Advisory) && conn.sql().shared_sessions().is_none() {
            return Err(no_shared_mode(key));
        }
        self.setup(&mut **conn, key)?;
        // First come, first served: a place (or a newcomer, `NO_PLACE`, behind every live
        // place) tries the slots only while more are free than live places are ahead of it,
        // so that it never takes a slot that one who asked earlier is waiting for; as many
        // waiters as slots are free go in at once. (Checks just before the try: a place
        // joined after them is not seen, so a newcomer's attempt racing a waiter's joining
        // may still win; the waiter then tries again at once behind it.)
        let place = conn.place;
        let ahead = conn
            .sql()
            .line_ahead(key, self.core.kind.line(), place)?
            .ahead;
        if ahead >= i64::from(self.permits) {
            return Ok(None);
        }
        if ahead > 0 && self.free_slots(conn, key, ahead + 1)? <= ahead {
            return Ok(None);
        }
        match self.core.kind {
            SlotKind::ForUpdate(flavor) => self.for_update(conn, key, flavor),
            SlotKind::Advisory => self.advisory(conn, key),
        }
    }

    fn exclusive(&self) -> bool {
        false
    }

    /// Permit waiters poll the slots (no wait in the server's queue): they line up in the
    /// key's line, first come, first served.
    fn line(&self) -> Option<crate::backend::Line> {
        Some(self.core.kind.line())
    }

    /// `Advisory`: the attempt gives the place up on its own session once it has a slot.
    /// `ForUpdate`: the slot is held inside the guard's transaction, so the place is given
    /// up from another pooled connection (with every connection of the pool held, it
    /// lapses at its expiry instead).
    fn removes_place(&self) -> bool {
        matches!(self.core.kind, SlotKind::Advisory)
    }

    fn room(&self) -> u32 {
        self.permits
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
        self.session.end(key, |c| {
            let mine = c.session_sql()?.advisory_unlock(&slot)?;
            let shared = shared_unlock(c, key)?;
            Ok(mine && shared)
        })
    }

    fn held(&self, key: &str) -> Result<bool> {
        self.session
            .held(key, |c| c.session_sql()?.advisory_held(&self.slot))
    }
}

/// The refusal of an `Advisory` permit where the backend has no shared advisory lock
/// (MySQL), which it would need to keep the key's exclusive lock out.
fn no_shared_mode(key: &str) -> Error {
    Error::Incompatible {
        key: key.to_owned(),
        reason: "a semaphore permit of the advisory strategy on MySQL could not keep the \
                 key's exclusive lock out (GET_LOCK has no shared mode), so it is refused: \
                 use the for-update or lease strategy for semaphores on MySQL"
            .into(),
    }
}

/// Releases the key's shared advisory lock that a permit holds beside its slot.
fn shared_unlock<C: LockConnection>(c: &mut C, key: &str) -> diesel::QueryResult<bool> {
    match c.sql().shared_sessions() {
        Some(s) => s.advisory_unlock_shared(key),
        None => Ok(true),
    }
}
