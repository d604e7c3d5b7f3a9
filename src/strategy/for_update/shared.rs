//! The readers and writers of a `ForUpdate` `Locker` (`Locker::read`, `Locker::write`):
//! readers lock the key's row `FOR SHARE` (PostgreSQL) or `LOCK IN SHARE MODE` (MySQL) in a
//! transaction the guard keeps open, as `for_update.rs` does `FOR UPDATE`; writers are the
//! strategy's own exclusive lock. So readers share the key with each other and with no
//! writer, nor with `lock()`.
//!
//! Writers do not starve. On MySQL InnoDB queues a new share request behind a waiting
//! exclusive one. On PostgreSQL, which grants it at once, a writer (`lock` or `write`) that
//! would wait marks the key
//! first (`backend/for_share.rs`, committed at once, live for [`MARK_FOR`] plus a pause on
//! the database clock) and waits on the server at most [`SLICE`] at a time, renewing the
//! mark before each wait; readers that find a live mark wait as for a held key. The mark is
//! removed once the writer has the row (readers then queue on the row itself; with no
//! connection free at that moment, at its release) or gives up, and expires by itself if its
//! process dies. A writer waits behind the readers that held
//! the key when it came, plus at most about one slice behind readers that got in when
//! another writer's mark ended.

use super::rows::{row_lock, share, ForShareHold};
use super::ForUpdateLock;
use crate::backend::{Flavor, LockConnection, Sql, Wait};
use crate::strategy::session;
use crate::strategy::session_permits::{check_kind, SlotCore};
use crate::strategy::{Conn, Hold, Interrupter, Pool, Pooled, RawLock, Taken};
use crate::Result;
use std::sync::Arc;
use std::time::Duration;

/// The longest server-side wait of a marking writer: its mark is renewed after each.
pub(crate) const SLICE: Duration = Duration::from_secs(1);
/// How long a writer's mark lives past a renewal, beyond the pause between attempts.
pub(crate) const MARK_FOR: Duration = Duration::from_secs(2);

/// A reader.
pub(super) struct ForUpdateReadLock<C: LockConnection> {
    pub(super) pool: Pool<C>,
    pub(super) flavor: Flavor,
    /// The keys known to be reader-writer keys, not semaphores (shared with the permits).
    pub(super) kinds: Arc<SlotCore>,
}

impl<C: LockConnection> RawLock<C> for ForUpdateReadLock<C> {
    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        _retry: bool,
        wait: Wait,
    ) -> Result<Option<Taken>> {
        let flavor = self.flavor;
        // A semaphore's key is not a reader-writer lock (`Error::Permits`).
        check_kind(&self.kinds, &mut **conn, key, 0)?;
        row_lock(
            conn,
            key,
            wait,
            |c, wait| share(c)?.for_share_lock(key, wait, flavor),
            |session, proof| Box::new(ForShareHold { session, proof }),
        )
    }

    fn interrupter(&self, conn: &mut Conn<C>) -> Result<Option<Interrupter>> {
        Ok(Some(session::txn_interrupter(&self.pool, conn)))
    }

    fn exclusive(&self) -> bool {
        false
    }
}

/// A writer: the strategy's exclusive lock, which marks the key while it waits where the
/// backend needs that (PostgreSQL).
pub(super) struct ForUpdateWriteLock<C: LockConnection> {
    pub(super) inner: ForUpdateLock<C>,
    /// This `Locker`'s writer id, if the backend needs marks (see `writer`).
    pub(super) mark: Option<String>,
    /// How long a mark lives: [`MARK_FOR`] plus the longest pause between attempts.
    pub(super) mark_us: i64,
}

impl<C: LockConnection> ForUpdateWriteLock<C> {
    /// Removes this writer's mark on another pooled connection, if one is free at once;
    /// else the mark expires by itself.
    /// The name this thread's waits mark keys with, if the backend needs marks: the
    /// `Locker`'s id and the thread's (a thread that gives up removes only its own mark).
    fn writer(&self) -> Option<String> {
        let id = self.mark.as_deref()?;
        Some(format!("{id}:{:?}", std::thread::current().id()))
    }

    /// False if no connection was free at once.
    fn unmark(&self, key: &str, writer: &str) -> bool {
        let Some(c) = self.inner.pool.try_get() else {
            return false;
        };
        unmark_on(c, key, writer);
        true
    }
}

/// Removes `writer`'s mark on `conn`; a failure leaves it to expire.
fn unmark_on<C: LockConnection>(mut conn: Pooled<C>, key: &str, writer: &str) {
    if let Err(e) = share(&mut *conn).and_then(|s| s.unmark_writer(key, writer)) {
        log::debug!("lock {key:?}: the writer's mark could not be removed ({e}); it expires");
    }
}

/// A writer's hold whose mark could not be removed when it got in (no connection was free):
/// its release removes it, once the guard's own connection is back in the pool, so that the
/// mark does not keep readers out after the writer is gone.
struct Unmarking<C: LockConnection> {
    hold: Box<dyn Hold>,
    pool: Pool<C>,
    writer: String,
}

impl<C: LockConnection> Hold for Unmarking<C> {
    fn release(self: Box<Self>, key: &str) -> Result<bool> {
        let released = self.hold.release(key);
        match self.pool.get() {
            Ok(c) => unmark_on(c, key, &self.writer),
            Err(e) => log::debug!(
                "lock {key:?}: no connection to remove the writer's mark ({e}); it expires"
            ),
        }
        released
    }

    fn held(&self, key: &str) -> Result<bool> {
        self.hold.held(key)
    }

    fn loss(&self) -> Option<std::sync::Arc<crate::loss::Loss>> {
        self.hold.loss()
    }

    fn probe_every(&self) -> Option<Duration> {
        self.hold.probe_every()
    }
}

impl<C: LockConnection> RawLock<C> for ForUpdateWriteLock<C> {
    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        retry: bool,
        wait: Wait,
    ) -> Result<Option<Taken>> {
        let Some(writer) = self.writer().filter(|_| wait != Wait::No) else {
            return self.inner.try_acquire(conn, key, retry, wait);
        };
        let writer = writer.as_str();
        match share(&mut **conn)?.mark_writer(key, writer, self.mark_us) {
            Ok(()) => {}
            // Rolled back by the server: a serialization failure where sessions default to
            // REPEATABLE READ or SERIALIZABLE and another writer's mark (or unmark) of the
            // key's header row came first, or a deadlock. Nothing was marked; the key
            // counts as busy for this attempt, and a wait tries again.
            Err(e) if conn.sql().is_rolled_back(&e) => {
                log::debug!("lock {key:?}: marking the writer was rolled back ({e}); busy for now");
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        }
        let slice = match wait {
            Wait::For(d) => Wait::For(d.min(SLICE)),
            _ => Wait::For(SLICE),
        };
        let taken = self.inner.try_acquire(conn, key, retry, slice)?;
        Ok(taken.map(|mut t| {
            if !self.unmark(key, writer) {
                t.hold = Box::new(Unmarking {
                    hold: t.hold,
                    pool: self.inner.pool.clone(),
                    writer: writer.to_owned(),
                });
            }
            t
        }))
    }

    fn interrupter(&self, conn: &mut Conn<C>) -> Result<Option<Interrupter>> {
        self.inner.interrupter(conn)
    }

    fn gave_up(&self, key: &str) {
        if let Some(writer) = self.writer() {
            if !self.unmark(key, &writer) {
                log::debug!(
                    "lock {key:?}: no free connection to remove the writer's mark; it expires"
                );
            }
        }
    }
}
