//! The pooled connection that a `ForUpdate` or `Advisory` guard keeps for its whole life,
//! and the rule for giving it back: only when it provably holds nothing. Otherwise it is
//! closed, and the server frees whatever the session held.

use super::{Conn, Interrupter, Pool, Setup, Strategy};
use crate::backend::{Backend, Flavor, LockConnection, Sql};
use crate::sync::Unpoison;
use crate::{Error, Result};
use diesel::connection::{Connection, TransactionManager};
use diesel::r2d2::ConnectionManager;
use diesel::QueryResult;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// A connection checked out of the locker's pool.
pub(crate) type Pooled<C> = r2d2::PooledConnection<ConnectionManager<C>>;

/// A pooled connection whose server session (or open transaction) holds a lock.
pub(crate) struct Session<C: LockConnection> {
    /// `check(&self)` needs the connection too, hence the mutex; it is never contended
    /// except by a user calling `check` from two threads at once.
    conn: Mutex<Pooled<C>>,
    /// Set once the connection failed or the server said the lock is gone: from then on the
    /// lock is never reported held again, and the connection is closed on release.
    lost: AtomicBool,
}

impl<C: LockConnection> Session<C> {
    pub(crate) fn new(conn: Pooled<C>) -> Self {
        Session {
            conn: Mutex::new(conn),
            lost: AtomicBool::new(false),
        }
    }

    /// Asks the server, on the session's own connection, whether the lock is still held.
    ///
    /// A failing connection counts as a lost lock: the library can no longer vouch for the
    /// lock, and the session is closed on release either way.
    pub(crate) fn held(
        &self,
        key: &str,
        ask: impl FnOnce(&mut C) -> QueryResult<bool>,
    ) -> Result<bool> {
        if self.lost.load(Ordering::Acquire) {
            return Ok(false);
        }
        let mut conn = self.conn.lock().unpoisoned();
        let held = ask(&mut conn).unwrap_or_else(|e| {
            log::warn!("lock {key:?}: the connection holding it failed ({e}); the lock is lost");
            false
        });
        if !held {
            self.lost.store(true, Ordering::Release);
        }
        Ok(held)
    }

    /// Releases with `end` (COMMIT, unlock) on the session's connection, which goes back to
    /// the pool only if that worked, the lock was never found lost and no panic is under
    /// way. `end` returns false when the server says the lock was not held.
    ///
    /// Returns false, as for a lost lock, when `end` fails: the connection that held the lock
    /// failed, so the lock cannot be shown to have been held up to now; closing the
    /// connection frees it on the server in any case.
    pub(crate) fn end(
        self,
        key: &str,
        end: impl FnOnce(&mut C) -> QueryResult<bool>,
    ) -> Result<bool> {
        let mut conn = self.conn.into_inner().unpoisoned();
        let was_lost = self.lost.into_inner();
        let ended = end(&mut conn);
        let clean = matches!(ended, Ok(true)) && !was_lost && !std::thread::panicking();
        if !clean {
            discard(&mut *conn);
        }
        drop(conn);
        match ended {
            Ok(released) => Ok(released && !was_lost),
            Err(e) => {
                log::warn!("lock {key:?}: releasing failed ({e}); its connection is closed");
                Ok(false)
            }
        }
    }
}

/// Refuses a strategy that needs locks ending with a transaction (`AdvisoryXact`) on a
/// backend without them: MySQL's `GET_LOCK` belongs to the session whatever transaction is
/// open, and SQLite has no such locks.
pub(crate) fn require_xact_locks(backend: Backend, strategy: Strategy) -> Result<()> {
    match backend {
        Backend::Postgres => Ok(()),
        Backend::Mysql | Backend::Sqlite => Err(Error::Unsupported {
            strategy: strategy.name(),
            backend: backend.name(),
        }),
    }
}

/// Refuses a session strategy on a backend without row or session locks (SQLite locks the
/// whole database, never a row, and has no session locks), and on a server whose session
/// locks hold on one node of a multi-primary cluster only (a Galera node: one query).
pub(crate) fn require_sessions<C: LockConnection>(
    setup: &Setup<C>,
    strategy: Strategy,
) -> Result<()> {
    match setup.backend {
        Backend::Postgres => Ok(()),
        Backend::Mysql => match setup.pool.get()?.sql().session_locks_local()? {
            None => Ok(()),
            Some(why) => Err(Error::InvalidConfig(format!(
                "the {} strategy cannot exclude here: {why}",
                strategy.name()
            ))),
        },
        Backend::Sqlite => Err(Error::Unsupported {
            strategy: strategy.name(),
            backend: setup.backend.name(),
        }),
    }
}

/// The server's flavor (see `backend::Flavor`), asked once per `ForUpdate` `Locker`: a MySQL
/// server is asked whether it is MariaDB; PostgreSQL is not asked.
pub(crate) fn flavor<C: LockConnection>(backend: Backend, pool: &Pool<C>) -> Result<Flavor> {
    match backend {
        Backend::Mysql => Ok(pool.get()?.session_sql()?.flavor()?),
        _ => Ok(Flavor::Standard),
    }
}

/// Ends `conn`'s session from another pooled connection: what interrupts a wait in the
/// server's lock queue (see `RawLock::interrupter`). The first step takes the connection
/// (waiting as the pool allows), the second ends the session.
pub(crate) fn interrupter<C: LockConnection>(pool: &Pool<C>, conn: &mut C) -> Result<Interrupter> {
    let id = conn.session_sql()?.session_id()?;
    let pool = pool.clone();
    Ok(Box::new(move || {
        let mut other = match pool.get() {
            Ok(c) => c,
            Err(e) => {
                log::warn!("a wait was cancelled, but no connection was free to end its session {id} ({e}); it waits on until its deadline or the lock");
                return None;
            }
        };
        Some(Box::new(move || {
            let ended = other
                .session_sql()
                .and_then(|s| s.end_session(id))
                .map_err(Error::from);
            match ended {
                Ok(_) => log::debug!("wait cancelled: session {id} ended"),
                Err(e) => {
                    log::warn!("a wait was cancelled but its session {id} could not be ended: {e}")
                }
            }
        }) as Box<dyn FnOnce() + Send>)
    }))
}

/// The session a cancellation may end, for strategies that wait inside a transaction
/// (`ForUpdate`, `AdvisoryXact`): known only while a transaction of the attempt is open.
///
/// Behind a transaction pooler, the server session of a statement outside a transaction is
/// any of the pooler's: asking its id before the transaction (as `interrupter` does) could
/// name a session that the pooler gives to another client, and a cancellation would end
/// that client's. So the id is asked inside each transaction ([`enter`](Self::enter)) and
/// forgotten before it ends ([`leave`](Self::leave)); the mutex makes ending the session
/// and leaving the transaction exclusive, so a session is never ended after its
/// transaction has ended.
#[derive(Debug, Default)]
pub(crate) struct TxnTarget {
    state: Mutex<TargetState>,
}

#[derive(Debug, Default)]
struct TargetState {
    session: Option<i64>,
    cancelled: bool,
}

impl TxnTarget {
    /// Inside a transaction just begun on `conn`, before it may wait: records its session,
    /// or returns false if the wait was cancelled already (the caller rolls back and gives
    /// up). With no target (the attempt cannot be cancelled), only true.
    pub(crate) fn enter<C: LockConnection>(
        target: Option<&TxnTarget>,
        conn: &mut C,
    ) -> QueryResult<bool> {
        let Some(target) = target else {
            return Ok(true);
        };
        let id = conn.session_sql()?.session_id()?;
        let mut state = target.state.lock().unpoisoned();
        if state.cancelled {
            return Ok(false);
        }
        state.session = Some(id);
        Ok(true)
    }

    /// Before the transaction ends (rollback), or once the lock is held: no cancellation
    /// ends this session any more; waits for one ending it now.
    pub(crate) fn leave(target: Option<&TxnTarget>) {
        if let Some(target) = target {
            target.state.lock().unpoisoned().session = None;
        }
    }
}

/// [`interrupter`] for strategies that wait inside a transaction: the session to end is
/// the one [`TxnTarget::enter`] recorded, if any; a later `enter` of the attempt refuses
/// to wait.
pub(crate) fn txn_interrupter<C: LockConnection>(
    pool: &Pool<C>,
    conn: &mut Conn<C>,
) -> Interrupter {
    let target = Arc::new(TxnTarget::default());
    conn.target = Some(target.clone());
    let pool = pool.clone();
    Box::new(move || {
        let mut other = match pool.get() {
            Ok(c) => c,
            Err(e) => {
                log::warn!("a wait was cancelled, but no connection was free to end its session ({e}); it waits on until its deadline or the lock");
                // Still keep the attempt from starting a wait it has not started yet.
                target.state.lock().unpoisoned().cancelled = true;
                return None;
            }
        };
        let target = target.clone();
        Some(Box::new(move || {
            // Held while the session is ended: its transaction cannot end meanwhile.
            let mut state = target.state.lock().unpoisoned();
            state.cancelled = true;
            let Some(id) = state.session else {
                return; // not waiting yet; `enter` now refuses to
            };
            match other.session_sql().and_then(|s| s.end_session(id)) {
                Ok(_) => log::debug!("wait cancelled: session {id} ended"),
                Err(e) => {
                    log::warn!("a wait was cancelled but its session {id} could not be ended: {e}")
                }
            }
        }) as Box<dyn FnOnce() + Send>)
    })
}

type Tm<C> = <C as Connection>::TransactionManager;

/// The locking statement of a strategy whose lock lives in a transaction (`ForUpdate`,
/// `AdvisoryXact`): begins the transaction, lets a cancellation end its session while it
/// may wait (a [`TxnTarget`]: behind a transaction pooler the session changes between
/// transactions), runs `lock` and stops letting it. `None`: cancelled before it could wait
/// (rolled back). The transaction stays open whatever `lock` returned: on success it holds
/// the lock; on an error the caller hands it to [`lock_failed`].
pub(crate) fn lock_in_txn<C: LockConnection, T>(
    conn: &mut Conn<C>,
    lock: impl FnOnce(&mut C) -> QueryResult<T>,
) -> Result<Option<QueryResult<T>>> {
    Tm::<C>::begin_transaction(&mut **conn)?;
    let target = conn.target.clone();
    match TxnTarget::enter(target.as_deref(), &mut **conn) {
        Ok(true) => {}
        Ok(false) => {
            rollback(conn);
            return Ok(None);
        }
        Err(e) => {
            rollback(conn);
            return Err(e.into());
        }
    }
    let locked = lock(&mut **conn);
    TxnTarget::leave(target.as_deref());
    Ok(Some(locked))
}

/// After [`lock_in_txn`]'s statement failed: rolls back (PostgreSQL has aborted the
/// transaction, MySQL rolled back the statement; either way nothing of ours may stay open
/// on a pooled connection, and the rollback frees a lock granted as a timeout fired), and
/// reports a lock-wait timeout as busy.
pub(crate) fn lock_failed<C: LockConnection, T>(
    conn: &mut Conn<C>,
    e: diesel::result::Error,
) -> Result<Option<T>> {
    rollback(conn);
    if conn.session_sql()?.is_lock_unavailable(&e) {
        Ok(None)
    } else {
        Err(e.into())
    }
}

/// Rolls back; a connection that cannot is closed instead of going back to the pool.
pub(crate) fn rollback<C: LockConnection>(conn: &mut Conn<C>) {
    if let Err(e) = Tm::<C>::rollback_transaction(&mut **conn) {
        log::debug!("rollback failed ({e}); closing the connection");
        discard(&mut **conn);
    }
}

/// Makes r2d2 close `conn` when it is dropped instead of returning it to the pool.
///
/// r2d2 0.8 has no way to take a connection out of its pool: it closes a returned connection
/// only if the manager's `has_broken` says so, and diesel's says so when the thread is
/// panicking or the connection's transaction manager is in error. So the transaction manager
/// is put in error. (`transaction_manager_status_mut` is public but hidden in diesel's docs;
/// `tests/session_faults.rs` pins this behaviour.)
pub(crate) fn discard<C: LockConnection>(conn: &mut C) {
    <C as Connection>::TransactionManager::transaction_manager_status_mut(conn).set_in_error();
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use diesel::connection::SimpleConnection;
    use diesel::RunQueryDsl;

    /// Pins the r2d2 + diesel behaviour `discard` relies on: a connection so marked is closed
    /// when dropped, and the pool opens a new one. A TEMP table lives only as long as the
    /// connection that made it, so it tells the two apart.
    #[test]
    fn a_discarded_connection_is_closed_not_pooled() {
        let dir = tempfile::tempdir().unwrap();
        let url = dir.path().join("d.db");
        let pool = r2d2::Pool::builder()
            .max_size(1)
            .build(ConnectionManager::<diesel::SqliteConnection>::new(
                url.to_str().unwrap(),
            ))
            .unwrap();
        let temp_table_exists = |c: &mut diesel::SqliteConnection| {
            diesel::sql_query("SELECT 1 FROM mark").execute(c).is_ok()
        };

        let mut conn = pool.get().unwrap();
        conn.batch_execute("CREATE TEMP TABLE mark (x INTEGER)")
            .unwrap();
        drop(conn);
        let mut conn = pool.get().unwrap();
        assert!(
            temp_table_exists(&mut conn),
            "an ordinary connection is reused"
        );

        discard(&mut *conn);
        drop(conn);
        let mut conn = pool.get().unwrap();
        assert!(
            !temp_table_exists(&mut conn),
            "the discarded connection came back"
        );
    }
}
