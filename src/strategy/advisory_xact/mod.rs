//! `Strategy::AdvisoryXact`: PostgreSQL `pg_advisory_xact_lock`, held by a transaction that
//! the guard keeps open; release = COMMIT. What works through a transaction pooler, where a
//! session-level lock would stay with a server session the pooler gives to others.

use super::session::{self, rollback, Session};
use super::{Conn, Hold, Interrupter, Pool, RawLock, Setup, Strategy, Taken};
use crate::backend::fence::no_token;
use crate::backend::{LockConnection, Sql, Wait, XactLocked};
use crate::Result;
use diesel::connection::{Connection, TransactionManager};

type Tm<C> = <C as Connection>::TransactionManager;

pub(super) struct AdvisoryXactLock<C: LockConnection> {
    pool: Pool<C>,
}

impl<C: LockConnection> AdvisoryXactLock<C> {
    pub(super) fn new(setup: Setup<C>, strategy: Strategy) -> Result<Self> {
        session::require_xact_locks(setup.backend, strategy)?;
        Ok(AdvisoryXactLock { pool: setup.pool })
    }
}

impl<C: LockConnection> RawLock<C> for AdvisoryXactLock<C> {
    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        _retry: bool,
        wait: Wait,
    ) -> Result<Option<Taken>> {
        // A token that may not go out yet (a new life of the server, or a bound to raise:
        // once in 2^20) is rolled back with the lock; the bound is raised outside the
        // transaction (so that it is committed before the token is seen) and we try again.
        for _ in 0..3 {
            let Some(locked) =
                session::lock_in_txn(conn, |c| c.session_sql()?.advisory_xact_lock(key, wait))?
            else {
                return Ok(None); // cancelled before it could wait
            };
            match locked {
                Ok(XactLocked::Locked(a)) => {
                    return Ok(Some(Taken {
                        hold: Box::new(AdvisoryXactHold {
                            session: Session::new(conn.take()),
                        }),
                        token: a.token,
                        acquired_at: a.acquired_at,
                    }))
                }
                Ok(XactLocked::Busy) => {
                    rollback(conn);
                    return Ok(None);
                }
                Ok(XactLocked::Unfenced(drawn)) => {
                    rollback(conn);
                    conn.session_sql()?.fence_prepare(drawn)?;
                }
                Err(e) => return session::lock_failed(conn, e),
            }
        }
        Err(crate::Error::Database(no_token()))
    }

    fn interrupter(&self, conn: &mut Conn<C>) -> Result<Option<Interrupter>> {
        Ok(Some(session::txn_interrupter(&self.pool, conn)))
    }
}

/// The connection whose open transaction holds the lock.
struct AdvisoryXactHold<C: LockConnection> {
    session: Session<C>,
}

impl<C: LockConnection> Hold for AdvisoryXactHold<C> {
    fn release(self: Box<Self>, key: &str) -> Result<bool> {
        // COMMIT ends the transaction and its lock. A transaction that ended already (its
        // session died, or the server ended it) cannot commit: the error makes the release
        // report the lock lost, and its connection is closed.
        self.session
            .end(key, |c| Tm::<C>::commit_transaction(c).map(|()| true))
    }

    fn held(&self, key: &str) -> Result<bool> {
        // Inside the holder's transaction, on its server session: the lock shows in
        // pg_locks as a session-level advisory lock would.
        self.session
            .held(key, |c| c.session_sql()?.advisory_held(key))
    }
}
