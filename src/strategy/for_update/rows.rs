//! The pieces of `ForUpdate` that its modes and the session semaphores share: one attempt on
//! a key's row in a transaction the guard keeps (`row_lock`), and a reader's or permit's
//! `FOR SHARE` hold. A leaf of the folder: it uses nothing of its siblings, so that
//! `session_permits.rs` can use it while `mod.rs` and `shared.rs` use `session_permits.rs`.

use crate::backend::fence::no_token;
use crate::backend::for_share::ForShareLocks;
use crate::backend::{ForUpdateLocked, LockConnection, Sql};
use crate::strategy::session::{self, rollback, Session};
use crate::strategy::{Conn, Hold, Taken};
use crate::Result;
use diesel::connection::{Connection, TransactionManager};
use diesel::QueryResult;

type Tm<C> = <C as Connection>::TransactionManager;

/// The share locks of `conn` (never missing: `build` offers `ForUpdate` and `Advisory` on
/// PostgreSQL and MySQL only, which both have them).
pub(crate) fn share<C: LockConnection>(conn: &mut C) -> QueryResult<&mut dyn ForShareLocks> {
    conn.sql().for_share().ok_or_else(|| {
        diesel::result::Error::QueryBuilderError("this backend has no share locks".into())
    })
}

/// A reader's open transaction (or a `ForUpdate` permit's: `session_permits.rs`).
pub(crate) struct ForShareHold<C: LockConnection> {
    pub(crate) session: Session<C>,
    /// The backend's proof that the transaction holds the lock (see `for_share_lock`).
    pub(crate) proof: i64,
}

impl<C: LockConnection> Hold for ForShareHold<C> {
    fn release(self: Box<Self>, key: &str) -> Result<bool> {
        let proof = self.proof;
        self.session.end(key, |c| {
            if !share(c)?.for_share_finish(proof)? {
                return Ok(false);
            }
            Tm::<C>::commit_transaction(c).map(|()| true)
        })
    }

    fn held(&self, key: &str) -> Result<bool> {
        self.session
            .held(key, |c| share(c)?.for_share_held(key, self.proof))
    }
}

/// One attempt on the key's row with `lock` (`FOR UPDATE`, or `FOR SHARE` for a reader),
/// in a transaction that the guard made by `hold` keeps open. A first attempt that finds no
/// row creates it (committed on its own, so that other creators do not wait for our
/// transaction) and tries again; one whose token may not go out yet (a new life of the
/// server, or a bound to raise: once in 2^20) rolls back, has that done outside the
/// transaction, and tries again.
pub(crate) fn row_lock<C: LockConnection>(
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
