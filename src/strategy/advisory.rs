//! `Strategy::Advisory`: PostgreSQL `pg_advisory_lock` / MySQL `GET_LOCK`, held by the
//! session of a connection that the guard keeps; release = one unlock.

use super::session::{discard, Pooled, Session};
use super::{Hold, Taken};
use crate::backend::Sql;
use crate::backend::{LockConnection, Wait};
use crate::Result;

pub(super) fn try_acquire<C: LockConnection>(
    mut conn: Pooled<C>,
    key: &str,
    wait: Wait,
) -> Result<Option<Taken<C>>> {
    // Server-side these locks are reentrant per session. The library is not: a held lock's
    // connection is out of the pool, owned by its guard, so any other attempt runs on
    // another session and finds the lock busy; and each guard unlocks exactly once.
    match conn.session_sql()?.advisory_lock(key, wait) {
        Ok(Some(a)) => Ok(Some(Taken {
            hold: Hold::Advisory {
                session: Session::new(conn),
            },
            token: a.token,
            acquired_at: a.acquired_at,
        })),
        Ok(None) => Ok(None),
        Err(e) => {
            // The lock may have been granted before the error (e.g. the token update
            // failed): closing the session is the one sure way to let go of it.
            discard(&mut *conn);
            Err(e.into())
        }
    }
}

pub(super) fn release<C: LockConnection>(session: Session<C>, key: &str) -> Result<()> {
    session.end(key, |c| c.session_sql()?.advisory_unlock(key))
}

pub(super) fn held<C: LockConnection>(session: &Session<C>, key: &str) -> Result<bool> {
    session.held(key, |c| c.session_sql()?.advisory_held(key))
}
