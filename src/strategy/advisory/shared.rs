//! The readers of an `Advisory` `Locker` on PostgreSQL: `pg_advisory_lock_shared`, held by
//! the session of a connection that the guard keeps (as `advisory.rs`; its writers are the
//! strategy's own advisory locks, which conflict with these on the same key).

use crate::backend::{LockConnection, Sql, Wait};
use crate::strategy::session::{self, discard, Session};
use crate::strategy::session_permits::{check_kind, SlotCore};
use crate::strategy::{Conn, Hold, Interrupter, Pool, RawLock, Taken};
use crate::{Error, Result};
use std::sync::Arc;

pub(super) struct AdvisorySharedLock<C: LockConnection> {
    pub(super) pool: Pool<C>,
    /// The keys known to be reader-writer keys, not semaphores (shared with the permits).
    pub(super) kinds: Arc<SlotCore>,
}

/// The shared session locks of `conn` (never missing: `build_modes` offers this lock on
/// PostgreSQL only).
fn shared<C: LockConnection>(
    conn: &mut C,
) -> Result<&mut dyn crate::backend::holders::SharedSessionLocks> {
    conn.sql()
        .shared_sessions()
        .ok_or_else(|| Error::Unsupported {
            strategy: "advisory (shared mode)",
            backend: "this backend",
        })
}

impl<C: LockConnection> RawLock<C> for AdvisorySharedLock<C> {
    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        _retry: bool,
        wait: Wait,
    ) -> Result<Option<Taken>> {
        // A semaphore's key is not a reader-writer lock (`Error::Permits`).
        check_kind(&self.kinds, &mut **conn, key, 0)?;
        match shared(&mut **conn)?.advisory_lock_shared(key, wait) {
            Ok(Some(a)) => Ok(Some(Taken {
                hold: Box::new(AdvisorySharedHold {
                    session: Session::new(conn.take()),
                }),
                token: a.token,
                acquired_at: a.acquired_at,
            })),
            Ok(None) => Ok(None),
            Err(e) => {
                // The lock may have been granted before the error: closing the session is
                // the one sure way to let go of it.
                discard(&mut **conn);
                Err(e.into())
            }
        }
    }

    fn interrupter(&self, conn: &mut Conn<C>) -> Result<Option<Interrupter>> {
        session::interrupter(&self.pool, conn).map(Some)
    }

    fn exclusive(&self) -> bool {
        false
    }
}

/// The connection whose session holds the shared lock.
struct AdvisorySharedHold<C: LockConnection> {
    session: Session<C>,
}

impl<C: LockConnection> Hold for AdvisorySharedHold<C> {
    fn release(self: Box<Self>, key: &str) -> Result<bool> {
        self.session.end(key, |c| {
            shared(c)
                .map_err(|e| diesel::result::Error::QueryBuilderError(e.to_string().into()))?
                .advisory_unlock_shared(key)
        })
    }

    fn held(&self, key: &str) -> Result<bool> {
        self.session.held(key, |c| {
            shared(c)
                .map_err(|e| diesel::result::Error::QueryBuilderError(e.to_string().into()))?
                .advisory_held_shared(key)
        })
    }
}
