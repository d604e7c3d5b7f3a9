//! `Strategy::Advisory`: PostgreSQL `pg_advisory_lock` / MySQL `GET_LOCK`, held on a few
//! sessions that the `Locker`'s guards share (`mux.rs`), or, for a lock won by a wait once
//! those are all open, by the session of a connection that the guard keeps; release = one
//! unlock.

pub(crate) mod mux;
mod shared;

use super::session::{self, discard, Session};
use super::session_permits::{slot_lock, SlotCore, SlotKind};
use super::{Conn, Hold, Interrupter, Mode, ModeLock, Pool, RawLock, Setup, Strategy, Taken};
use crate::backend::{LockConnection, Sql, Wait};
use crate::Result;
use mux::Mux;
use shared::AdvisorySharedLock;
use std::sync::Arc;

pub(super) struct AdvisoryLock<C: LockConnection> {
    pool: Pool<C>,
    /// The shared sessions of the exclusive locks.
    mux: Arc<Mux<C>>,
    /// Readers, where the backend has shared advisory locks (PostgreSQL's
    /// `pg_advisory_lock_shared`); their writer is this strategy's own lock.
    read: Option<Arc<AdvisorySharedLock<C>>>,
    /// Semaphores: an advisory lock per permit (`session_permits.rs`).
    slots: Arc<SlotCore>,
}

impl<C: LockConnection> AdvisoryLock<C> {
    pub(super) fn new(setup: Setup<C>, strategy: Strategy) -> Result<Self> {
        session::require_sessions(&setup, strategy)?;
        let shared = setup.pool.get()?.sql().shared_sessions().is_some();
        let slots = SlotCore::new(SlotKind::Advisory);
        Ok(AdvisoryLock {
            read: shared.then(|| {
                Arc::new(AdvisorySharedLock {
                    pool: setup.pool.clone(),
                    kinds: slots.clone(),
                })
            }),
            mux: Arc::new(Mux::new(setup.pool.clone())),
            pool: setup.pool,
            slots,
        })
    }
}

impl<C: LockConnection> RawLock<C> for AdvisoryLock<C> {
    fn mode(&self, mode: Mode) -> Result<Option<ModeLock<C>>> {
        match mode {
            Mode::Read => Ok(self
                .read
                .clone()
                .map(|r| ModeLock::Other(r as Arc<dyn RawLock<C>>))),
            Mode::Write => Ok(self.read.is_some().then_some(ModeLock::Own)),
            Mode::Permits(n) => slot_lock(&self.slots, n, "advisory"),
        }
    }

    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        _retry: bool,
        wait: Wait,
    ) -> Result<Option<Taken>> {
        // A try runs on a shared session (the waiting code asks `try_without_connection`
        // first; this is the first attempt of a `Locker`, which checked the schema on
        // `conn`). A wait runs on `conn`'s session, of its own, so that nothing waits
        // behind it on a shared one.
        if wait == Wait::No {
            let mut offer = conn.get_mut().is_some().then(|| conn.take());
            return self.mux.try_lock(key, &mut offer);
        }
        // Server-side these locks are reentrant per session. The library is not: a session
        // holding locks is out of the pool, and a shared one refuses its own keys (`mux.rs`),
        // so any other attempt finds the lock busy; and each guard unlocks exactly once.
        match conn.session_sql()?.advisory_lock(key, wait) {
            Ok(Some(a)) => {
                // Won by a wait: the session joins the shared ones if there is room (not
                // one a cancellation may still end: that would end the others' locks).
                let hold = match conn.cancellable {
                    false => self.mux.adopt(conn.take(), key),
                    true => Err(conn.take()),
                }
                .unwrap_or_else(|conn| {
                    Box::new(AdvisoryHold {
                        session: Session::new(conn),
                    })
                });
                Ok(Some(Taken {
                    hold,
                    token: a.token,
                    acquired_at: a.acquired_at,
                }))
            }
            Ok(None) => Ok(None),
            Err(e) => {
                // The lock may have been granted before the error (e.g. the token could not
                // be made safe): closing the session is the one sure way to let go of it.
                discard(&mut **conn);
                Err(e.into())
            }
        }
    }

    fn connections_held(&self) -> usize {
        self.mux.open()
    }

    fn try_without_connection(&self, key: &str) -> Option<Result<Option<Taken>>> {
        Some(self.mux.try_lock(key, &mut None))
    }

    fn interrupter(&self, conn: &mut Conn<C>) -> Result<Option<Interrupter>> {
        session::interrupter(&self.pool, conn).map(Some)
    }
}

/// The connection whose session holds the advisory lock.
struct AdvisoryHold<C: LockConnection> {
    session: Session<C>,
}

impl<C: LockConnection> Hold for AdvisoryHold<C> {
    fn release(self: Box<Self>, key: &str) -> Result<bool> {
        self.session
            .end(key, |c| c.session_sql()?.advisory_unlock(key))
    }

    fn held(&self, key: &str) -> Result<bool> {
        self.session
            .held(key, |c| c.session_sql()?.advisory_held(key))
    }
}
