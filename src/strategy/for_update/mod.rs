//! `Strategy::ForUpdate`: the key's row locked by `SELECT … FOR UPDATE` in a transaction
//! that the guard keeps open; release = COMMIT.

pub(crate) mod rows;
pub(super) mod shared;

use super::session::{self, Session};
use super::session_permits::{slot_lock, SlotCore, SlotKind};
use super::{
    micros, Conn, Hold, Interrupter, Mode, ModeLock, Pool, RawLock, Setup, Strategy, Taken,
};
use crate::backend::{Flavor, LockConnection, Sql, Wait};
use crate::Result;
use diesel::connection::{Connection, TransactionManager};
use rows::row_lock;
use shared::{ForUpdateReadLock, ForUpdateWriteLock, MARK_FOR};
use std::sync::Arc;

type Tm<C> = <C as Connection>::TransactionManager;

pub(super) struct ForUpdateLock<C: LockConnection> {
    pool: Pool<C>,
    flavor: Flavor,
    /// Its readers (`FOR SHARE`), writers and semaphores; `None` in the writer's own copy.
    modes: Option<Modes<C>>,
}

/// The kinds of lock of a `ForUpdate` `Locker` beside `lock`: readers lock the key's row
/// `FOR SHARE` (MySQL: `LOCK IN SHARE MODE`), writers `FOR UPDATE`, marking the key while they
/// wait where the backend grants new sharers beside a waiting writer (PostgreSQL);
/// semaphores are slot rows (`session_permits.rs`).
struct Modes<C: LockConnection> {
    read: Arc<ForUpdateReadLock<C>>,
    write: Arc<ForUpdateWriteLock<C>>,
    slots: Arc<SlotCore>,
}

impl<C: LockConnection> ForUpdateLock<C> {
    pub(super) fn new(setup: Setup<C>, strategy: Strategy) -> Result<Self> {
        session::require_sessions(&setup, strategy)?;
        let flavor = session::flavor(setup.backend, &setup.pool)?;
        let marks = setup
            .pool
            .get()?
            .sql()
            .for_share()
            .is_some_and(|s| s.needs_writer_mark());
        let slots = SlotCore::new(SlotKind::ForUpdate(flavor));
        let modes = Modes {
            read: Arc::new(ForUpdateReadLock {
                pool: setup.pool.clone(),
                flavor,
                kinds: slots.clone(),
            }),
            write: Arc::new(ForUpdateWriteLock {
                inner: ForUpdateLock {
                    pool: setup.pool.clone(),
                    flavor,
                    modes: None,
                },
                mark: marks.then(crate::random::holder_id),
                mark_us: micros(MARK_FOR + setup.max_backoff).unwrap_or(i64::MAX),
            }),
            slots,
        };
        Ok(ForUpdateLock {
            pool: setup.pool,
            flavor,
            modes: Some(modes),
        })
    }
}

impl<C: LockConnection> RawLock<C> for ForUpdateLock<C> {
    fn mode(&self, mode: Mode) -> Result<Option<ModeLock<C>>> {
        let Some(modes) = &self.modes else {
            return Ok(None);
        };
        Ok(Some(match mode {
            Mode::Read => ModeLock::Other(modes.read.clone()),
            Mode::Write => ModeLock::Other(modes.write.clone()),
            Mode::Permits(n) => return slot_lock(&modes.slots, n, "for-update"),
        }))
    }

    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        retry: bool,
        wait: Wait,
    ) -> Result<Option<Taken>> {
        // `lock` is the writer: where a waiting writer must mark the key (PostgreSQL), one
        // that would wait marks it, as `write` does, and only the writer's way removes the
        // mark on success. A key free at once costs what it did: the waiting code's first
        // attempt never waits (`Wait::No`), and takes the plain row lock below.
        if let Some(write) = self.marking_writer().filter(|_| wait != Wait::No) {
            return write.try_acquire(conn, key, retry, wait);
        }
        self.lock_row(conn, key, wait)
    }

    fn interrupter(&self, conn: &mut Conn<C>) -> Result<Option<Interrupter>> {
        Ok(Some(session::txn_interrupter(&self.pool, conn)))
    }

    fn gave_up(&self, key: &str) {
        if let Some(write) = self.marking_writer() {
            write.gave_up(key);
        }
    }

    fn purge(&self, idle: std::time::Duration) -> Result<usize> {
        // The key rows no holder has locked, then the reader-writer kinds left without
        // anything of their key, each only once older than `idle` (the grace: a row just
        // made for an acquisition is not taken from under it). None carries a token.
        let grace_us = micros(idle.min(super::MAX_DURATION)).unwrap_or(i64::MAX);
        super::purge::released_keys(
            &self.pool,
            &[
                crate::backend::PurgeTable::KeyRows,
                crate::backend::PurgeTable::Kinds,
            ],
            grace_us,
        )
    }
}

impl<C: LockConnection> ForUpdateLock<C> {
    /// The writer lock, if this backend's waiting writers mark the key.
    fn marking_writer(&self) -> Option<&ForUpdateWriteLock<C>> {
        self.modes
            .as_ref()
            .map(|m| &*m.write)
            .filter(|w| w.mark.is_some())
    }

    /// One attempt on the key's row, `FOR UPDATE`.
    fn lock_row(&self, conn: &mut Conn<C>, key: &str, wait: Wait) -> Result<Option<Taken>> {
        let flavor = self.flavor;
        row_lock(
            conn,
            key,
            wait,
            |c, wait| c.session_sql()?.for_update_lock(key, wait, flavor),
            |session, proof| Box::new(ForUpdateHold { session, proof }),
        )
    }
}

/// The connection whose open transaction holds the row lock.
struct ForUpdateHold<C: LockConnection> {
    session: Session<C>,
    /// The backend's proof that the transaction holds the lock (see `for_update_lock`).
    proof: i64,
}

impl<C: LockConnection> Hold for ForUpdateHold<C> {
    fn release(self: Box<Self>, key: &str) -> Result<bool> {
        // COMMIT even while panicking: the transaction holds only our own lock and
        // bookkeeping. (r2d2 then closes the connection anyway, as it does with every
        // connection dropped during a panic.) A transaction that no longer holds the lock is
        // not committed: its connection is closed, which rolls it back.
        let proof = self.proof;
        self.session.end(key, |c| {
            if !c.session_sql()?.for_update_finish(proof)? {
                return Ok(false);
            }
            Tm::<C>::commit_transaction(c).map(|()| true)
        })
    }

    fn held(&self, key: &str) -> Result<bool> {
        self.session
            .held(key, |c| c.session_sql()?.for_update_held(key, self.proof))
    }
}
