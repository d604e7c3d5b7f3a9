//! `Strategy::ForUpdate`: the key's row locked by `SELECT … FOR UPDATE` in a transaction
//! that the guard keeps open; release = COMMIT.

use super::session::{self, discard, Session, TxnTarget};
use super::{Conn, Hold, Interrupter, Pool, RawLock, Setup, Strategy, Taken};
use crate::backend::{Flavor, ForUpdateLocked, LockConnection, Sql, Wait};
use crate::Result;
use diesel::connection::{Connection, TransactionManager};

type Tm<C> = <C as Connection>::TransactionManager;

pub(super) struct ForUpdateLock<C: LockConnection> {
    pool: Pool<C>,
    flavor: Flavor,
}

impl<C: LockConnection> ForUpdateLock<C> {
    pub(super) fn new(setup: Setup<C>, strategy: Strategy) -> Result<Self> {
        session::require_sessions(setup.backend, strategy)?;
        let flavor = session::flavor(setup.backend, &setup.pool)?;
        Ok(ForUpdateLock {
            pool: setup.pool,
            flavor,
        })
    }
}

impl<C: LockConnection> RawLock<C> for ForUpdateLock<C> {
    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        _retry: bool,
        wait: Wait,
    ) -> Result<Option<Taken>> {
        // A first attempt that finds no row creates it (committed on its own, so that
        // other creators do not wait for our transaction) and tries again; one whose token
        // may not go out yet (a new life of the server, or a bound to raise: once in 2^20)
        // rolls back, has that done outside the transaction, and tries again.
        let mut created = false;
        for _ in 0..4 {
            Tm::<C>::begin_transaction(&mut **conn)?;
            // A cancellation may end this session only while this transaction is open (see
            // `TxnTarget`: behind a transaction pooler the session changes between them).
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
            let locked = conn.session_sql()?.for_update_lock(key, wait, self.flavor);
            TxnTarget::leave(target.as_deref());
            match locked {
                Ok(ForUpdateLocked::Locked(a)) => {
                    return Ok(Some(Taken {
                        hold: Box::new(ForUpdateHold {
                            session: Session::new(conn.take()),
                            proof: a.id,
                        }),
                        token: a.token,
                        acquired_at: a.acquired_at,
                    }))
                }
                Ok(ForUpdateLocked::Missing) => {
                    rollback(conn);
                    if created {
                        // The row vanished between its creation and our lock (deleted by
                        // hand): busy, for now.
                        return Ok(None);
                    }
                    conn.session_sql()?.for_update_create(key)?;
                    created = true;
                }
                Ok(ForUpdateLocked::Unfenced(drawn)) => {
                    rollback(conn);
                    conn.session_sql()?.fence_prepare(drawn)?;
                }
                Err(e) => {
                    // PostgreSQL has aborted the transaction; MySQL rolled back the
                    // statement. Either way nothing of ours may stay open on a pooled
                    // connection.
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
