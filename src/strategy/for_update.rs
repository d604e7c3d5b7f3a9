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
    pub(super) pool: Pool<C>,
    pub(super) flavor: Flavor,
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
        let flavor = self.flavor;
        row_lock(
            conn,
            key,
            |c| c.session_sql()?.for_update_lock(key, wait, flavor),
            |session, proof| Box::new(ForUpdateHold { session, proof }),
        )
    }

    fn interrupter(&self, conn: &mut Conn<C>) -> Result<Option<Interrupter>> {
        Ok(Some(session::txn_interrupter(&self.pool, conn)))
    }
}

/// One attempt on the key's row with `lock` (`FOR UPDATE`, or `FOR SHARE` for a reader),
/// in a transaction that the guard made by `hold` keeps open. A first attempt that finds no
/// row creates it (committed on its own, so that other creators do not wait for our
/// transaction) and tries again; one whose token may not go out yet (a new life of the
/// server, or a bound to raise: once in 2^20) rolls back, has that done outside the
/// transaction, and tries again.
pub(super) fn row_lock<C: LockConnection>(
    conn: &mut Conn<C>,
    key: &str,
    lock: impl Fn(&mut C) -> diesel::QueryResult<ForUpdateLocked>,
    hold: impl FnOnce(Session<C>, i64) -> Box<dyn Hold>,
) -> Result<Option<Taken>> {
    let mut created = false;
    for _ in 0..4 {
        let Some(locked) = session::lock_in_txn(conn, &lock)? else {
            return Ok(None); // cancelled before it could wait
        };
        match locked {
            Ok(ForUpdateLocked::Locked(a)) => {
                return Ok(Some(Taken {
                    hold: hold(Session::new(conn.take()), a.id),
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
            Ok(ForUpdateLocked::Blocked) => {
                rollback(conn);
                return Ok(None);
            }
            Err(e) => return session::lock_failed(conn, e),
        }
    }
    Err(crate::Error::Database(no_token()))
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
