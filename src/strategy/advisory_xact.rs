//! `Strategy::AdvisoryXact`: PostgreSQL `pg_advisory_xact_lock`, held by a transaction that
//! the guard keeps open; release = COMMIT. What works through a transaction pooler, where a
//! session-level lock would stay with a server session the pooler gives to others.

use super::session::{self, discard, Session, TxnTarget};
use super::{Conn, Hold, Interrupter, Pool, RawLock, Setup, Strategy, Taken};
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
            Tm::<C>::begin_transaction(&mut **conn)?;
            let target = conn.target.clone();
            match TxnTarget::enter(target.as_deref(), &mut **conn) {
                Ok(true) => {}
                Ok(false) => {
                    rollback(conn);
                    return Ok(None); // cancelled before it could wait
                }
                Err(e) => {
                    rollback(conn);
                    return Err(e.into());
                }
            }
            let locked = conn.session_sql()?.advisory_xact_lock(key, wait);
            TxnTarget::leave(target.as_deref());
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
                Err(e) => {
                    // A timeout (or any error) aborted the transaction; the rollback frees a
                    // lock granted as it fired.
                    rollback(conn);
                    return if conn.session_sql()?.is_lock_unavailable(&e) {
                        Ok(None)
                    } else {
                        Err(e.into())
                    };
                }
            }
        }
        Err(crate::Error::Database(
            diesel::result::Error::QueryBuilderError(
                "no fencing token could be drawn: is the dlock_fence row missing? run migrate()"
                    .into(),
            ),
        ))
    }

    fn interrupter(&self, conn: &mut Conn<C>) -> Result<Option<Interrupter>> {
        Ok(Some(session::txn_interrupter(&self.pool, conn)))
    }
}

/// Rolls back; a connection that cannot is closed instead of going back to the pool.
fn rollback<C: LockConnection>(conn: &mut Conn<C>) {
    if let Err(e) = Tm::<C>::rollback_transaction(&mut **conn) {
        log::debug!("rollback failed ({e}); closing the connection");
        discard(&mut **conn);
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
