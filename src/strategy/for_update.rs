//! `Strategy::ForUpdate`: the key's row locked by `SELECT … FOR UPDATE` in a transaction
//! that the guard keeps open; release = COMMIT.

use super::session::{self, rollback, Session};
use super::{Conn, Hold, Interrupter, Pool, RawLock, Setup, Strategy, Taken};
use crate::backend::fence::no_token;
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
            let Some(locked) =
                session::lock_in_txn(conn, |s| s.for_update_lock(key, wait, self.flavor))?
            else {
                return Ok(None); // cancelled before it could wait
            };
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
                Err(e) => return session::lock_failed(conn, e),
            }
        }
        Err(crate::Error::Database(no_token()))
    }

    fn interrupter(&self, conn: &mut Conn<C>) -> Result<Option<Interrupter>> {
        Ok(Some(session::txn_interrupter(&self.pool, conn)))
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
