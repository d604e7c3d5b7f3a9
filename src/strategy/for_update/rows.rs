//! The pieces of `ForUpdate` that its modes and the session semaphores share: one attempt on
//! a key's row in a transaction the guard keeps (`row_lock`), and a reader's or permit's
//! `FOR SHARE` hold. A leaf of the folder: it uses nothing of its siblings, so that
//! `session_permits.rs` can use it while `mod.rs` and `shared.rs` use `session_permits.rs`.

use crate::backend::fence::no_token;
use crate::backend::for_share::ForShareLocks;
use crate::backend::{ForUpdateLocked, LockConnection, Sql, Wait};
use crate::strategy::session::{self, rollback, Session};
use crate::strategy::{Conn, Hold, Taken};
use crate::Result;
use diesel::connection::{Connection, TransactionManager};
use diesel::QueryResult;
use std::time::{Duration, Instant};

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

/// How many times an attempt makes the key's row again, looks again at a row found locked,
/// or runs its lock statement again after a deadlock, before it reports the key busy: each
/// time a purge must have deleted the row (or been deleting it) since the last look. A
/// purge takes only rows older than its grace, so with any grace beyond a round trip the
/// first retry wins.
const ROW_TRIES: usize = 16;

/// How long one attempt waits, in all, for purge batches to let go of the purge gate
/// (`SessionLocks::for_update_present`): one budget across its retries, so that a long
/// purge, whose batches take the gate again one round trip after each other, costs a busy
/// try at most this long (not this long per retry: on MariaDB, where a waiter looks at the
/// gate now and then, tries of held keys took up to 6 s during a purge of 10⁵ rows, found
/// by the purge-gate fix's adversary).
const GATE_PATIENCE: Duration = Duration::from_secs(2);

/// How many times a token that may not go out yet is made safe (a new life of the
/// server, or a bound to raise) before giving up.
const FENCE_TRIES: usize = 4;

/// One attempt on the key's row with `lock` (`FOR UPDATE`, or `FOR SHARE` for a reader),
/// waiting as `wait` says, in a transaction that the guard made by `hold` keeps open.
///
/// A purge (`Locker::purge`) may delete a key row nobody holds at any moment, so the row
/// may be missing, or be deleted while this waits for it, or be locked by the purge
/// deleting it. So: a row found missing is made (committed on its own, so that other
/// creators do not wait for our transaction; an insert that deadlocks with another on a
/// just-deleted row is run again) and locked again; a row found locked (`NOWAIT`, or a
/// bounded wait that ran out) is busy only if it is still there once no purge's batch is
/// under way (`SessionLocks::for_update_present`), else it is looked at again; a lock
/// statement the server rolled back as a deadlock's victim (`Dialect::is_rolled_back`) is
/// run again. At most [`ROW_TRIES`] times in all, and never past the deadline of `wait`. A
/// token that may not go out yet (a new life of the server, or a bound to raise: once in
/// 2^20) is rolled back, made safe outside the transaction, and drawn again.
pub(crate) fn row_lock<C: LockConnection>(
    conn: &mut Conn<C>,
    key: &str,
    wait: Wait,
    lock: impl Fn(&mut C, Wait) -> diesel::QueryResult<ForUpdateLocked>,
    hold: impl FnOnce(Session<C>, i64) -> Box<dyn Hold>,
) -> Result<Option<Taken>> {
    let deadline = match wait {
        Wait::For(d) => Instant::now().checked_add(d),
        _ => None,
    };
    // What is left of a bounded wait; a retry past the deadline only looks (`NOWAIT`).
    let left = || match (wait, deadline) {
        (Wait::For(_), Some(at)) => match at.checked_duration_since(Instant::now()) {
            Some(d) if !d.is_zero() => Wait::For(d),
            _ => Wait::No,
        },
        _ => wait,
    };
    let (mut tries, mut fences) = (0, 0);
    let gate_until = Instant::now() + GATE_PATIENCE;
    loop {
        let Some(locked) = session::lock_in_txn(conn, |c| lock(c, left()))? else {
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
                tries += 1;
                if tries > ROW_TRIES {
                    log::debug!("lock {key:?}: its row was deleted under {ROW_TRIES} attempts; busy for now");
                    return Ok(None);
                }
                create(conn, key)?;
            }
            Ok(ForUpdateLocked::Unfenced(drawn)) => {
                rollback(conn);
                if fences == FENCE_TRIES {
                    return Err(crate::Error::Database(no_token()));
                }
                match conn.session_sql()?.fence_prepare(drawn) {
                    // Another session raised the bound or joined the life at once, and the
                    // server rolled this one back (a serialization failure with sessions at
                    // REPEATABLE READ on PostgreSQL, a deadlock): drawn again, as the
                    // attempt's tries allow.
                    Err(e) if tries < ROW_TRIES && conn.sql().is_rolled_back(&e) => {
                        tries += 1;
                        log::debug!(
                            "lock {key:?}: making its token safe was rolled back ({e}); again"
                        );
                    }
                    prepared => {
                        prepared?;
                        fences += 1;
                    }
                }
            }
            Ok(ForUpdateLocked::Blocked) => {
                rollback(conn);
                return Ok(None);
            }
            Err(e) => {
                rollback(conn);
                if conn.sql().is_rolled_back(&e) {
                    // A deadlock's victim: the server rolled the statement back whole (on
                    // MariaDB, an insert making the row over a record a purge has just
                    // deleted holds a shared lock on it and asks for an exclusive one
                    // behind the lock statement's); run again, as the wait allows.
                    tries += 1;
                    if tries > ROW_TRIES {
                        log::debug!("lock {key:?}: the lock statement was a deadlock's victim {ROW_TRIES} times ({e}); busy for now");
                        return Ok(None);
                    }
                    log::debug!(
                        "lock {key:?}: the lock statement was a deadlock's victim ({e}); again"
                    );
                    continue;
                }
                if !conn.session_sql()?.is_lock_unavailable(&e) {
                    return Err(e.into());
                }
                // Locked: by a holder, or by a purge deleting the row?
                tries += 1;
                let patience = gate_until.saturating_duration_since(Instant::now());
                if tries > ROW_TRIES || conn.session_sql()?.for_update_present(key, patience)? {
                    return Ok(None);
                }
            }
        }
    }
}

/// Makes the key's row, committed at once. Two inserts of a row a purge has just deleted
/// can deadlock on MariaDB (each holds a shared lock on the deleted record and wants to
/// insert): the victim's insert is run again. The insert's duplicate check waits for a
/// transaction holding the row (a holder that made and locked it since the lock statement
/// found none): only for a moment (`for_update_create`), then the row is there to lock as
/// the attempt's wait allows; unbounded, that wait outlasted deadlines and cancellations
/// (the session is ended only while the lock statement runs).
fn create<C: LockConnection>(conn: &mut Conn<C>, key: &str) -> Result<()> {
    #[cfg(feature = "test-hooks")]
    crate::hooks::before_create(key);
    let mut tries = 0;
    loop {
        match conn.session_sql()?.for_update_create(key) {
            Ok(()) => return Ok(()),
            // The row is there, in a transaction that holds it (made and locked after the
            // lock statement looked): locked again, as the attempt's wait allows.
            Err(e) if conn.session_sql()?.is_lock_unavailable(&e) => {
                log::debug!("lock {key:?}: its row is there, held ({e}); locking it");
                return Ok(());
            }
            // Contention, or rolled back: a deadlock's victim, or (sessions at REPEATABLE
            // READ on PostgreSQL) ON CONFLICT meeting a row committed after the statement's
            // snapshot, a serialization failure that reached first readers' callers.
            Err(e)
                if tries < ROW_TRIES
                    && (conn.sql().is_contention(&e) || conn.sql().is_rolled_back(&e)) =>
            {
                tries += 1;
                log::debug!("lock {key:?}: making its row met contention ({e}); again");
            }
            Err(e) => return Err(e.into()),
        }
    }
}
