//! `Strategy::Advisory`: PostgreSQL `pg_advisory_lock` / MySQL `GET_LOCK`, held by the
//! session of a connection that the guard keeps; release = one unlock.

use super::session::{self, discard, Session};
use super::{Conn, Hold, Interrupter, Pool, RawLock, Setup, Strategy, Taken};
use crate::backend::{LockConnection, Sql, Wait};
use crate::Result;

pub(super) struct AdvisoryLock<C: LockConnection> {
    pool: Pool<C>,
}

impl<C: LockConnection> AdvisoryLock<C> {
    pub(super) fn new(setup: Setup<C>, strategy: Strategy) -> Result<Self> {
        session::require_sessions(setup.backend, strategy)?;
        Ok(AdvisoryLock { pool: setup.pool })
    }
}

impl<C: LockConnection> RawLock<C> for AdvisoryLock<C> {
    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        _retry: bool,
        wait: Wait,
    ) -> Result<Option<Taken>> {
        // Server-side these locks are reentrant per session. The library is not: a held
        // lock's connection is out of the pool, owned by its guard, so any other attempt runs
        // on another session and finds the lock busy; and each guard unlocks exactly once.
        match conn.session_sql()?.advisory_lock(key, wait) {
            Ok(Some(a)) => Ok(Some(Taken {
                hold: Box::new(AdvisoryHold {
                    session: Session::new(conn.take()),
                }),
                token: a.token,
                acquired_at: a.acquired_at,
            })),
            Ok(None) => Ok(None),
            Err(e) => {
                // The lock may have been granted before the error (e.g. the token could not
                // be made safe): closing the session is the one sure way to let go of it.
                discard(&mut **conn);
                Err(e.into())
            }
        }
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
