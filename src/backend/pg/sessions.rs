//! PostgreSQL's session strategies: `ForUpdate` (a row locked by `SELECT … FOR UPDATE`) and
//! `Advisory` (`pg_advisory_lock`). Their tokens: `fence.rs`.
// Its statements' texts are `pub` for `__bench_sql` (feature `bench-sql`) only.
#![cfg_attr(not(feature = "bench-sql"), allow(unreachable_pub))]

use super::{fence, lock_timeout_ms, lock_unavailable};
use crate::backend::fence::secure;
use crate::backend::interrupt::EndSession;
use crate::backend::sealed::SessionLocks;
use crate::backend::shared::{exists, One};
use crate::backend::stmt::stmt;
use crate::backend::{Acquired, Drawn, Flavor, ForUpdateLocked, Wait, XactLocked};
use chrono::{DateTime, Utc};
use diesel::pg::PgConnection;
use diesel::sql_types::{BigInt, Bool, Nullable, Text, Timestamptz};
use diesel::{OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};

// The texts of the statements the benches' raw floors run too (`diesel_lock::__bench_sql`);
// the others are written where they run.

/// Whether `e` is the statement_timeout that `for_update_lock` set for its own bounded wait
/// (SQLSTATE 57014, which diesel keeps no kind for: the English message is matched, as in
/// `lock_unavailable`).
fn statement_timed_out(e: &diesel::result::Error) -> bool {
    matches!(e, diesel::result::Error::DatabaseError(_, info)
        if info.message().starts_with("canceling statement due to statement timeout"))
}

/// How long `for_update_create` waits for a transaction that holds the key's row it would
/// make (a purge's batch deleting it commits well within this).
const CREATE_PATIENCE: std::time::Duration = std::time::Duration::from_millis(100);

/// `for_update_lock` with `Wait::Forever`.
pub const FOR_UPDATE_LOCK: &str =
    "UPDATE dlock_for_update SET version = version + 1 WHERE lock_key = \
     (SELECT lock_key FROM dlock_for_update WHERE lock_key = ? \
      AND set_config('synchronous_commit', 'off', true) IS NOT NULL FOR UPDATE) \
     RETURNING true AS got, version AS id, \
     nextval('dlock_fence_seq') + (SELECT off FROM dlock_fence_live) AS token, \
     (SELECT high FROM dlock_fence_live) AS high, clock_timestamp() AS acquired_at";

/// `advisory_lock` with `Wait::Forever`.
pub const ADVISORY_LOCK: &str = ADVISORY.lock;

/// `advisory_xact_lock` with `Wait::Forever`.
pub const ADVISORY_XACT_LOCK: &str = ADVISORY_XACT.lock;

/// The acquiring statements of one kind of advisory lock, one per [`Wait`], alike but for
/// the lock function: each takes the lock and then draws the token in one statement (the
/// CTE holds a volatile function, so PostgreSQL runs it once and before the outer SELECT
/// reads it), with `synchronous_commit` off for its transaction (nothing it writes must
/// survive a crash: the token is safe by its bound). `set_config(.., true)` lasts until the
/// end of the statement's transaction.
pub(super) struct AdvisoryTexts {
    /// `Wait::No`: the `pg_try_…` function; the token only if it got the lock.
    try_lock: &'static str,
    /// `Wait::For`: binds the `lock_timeout` first.
    lock_within: &'static str,
    /// `Wait::Forever`.
    lock: &'static str,
}

macro_rules! advisory_texts {
    ($try_lock:literal, $lock:literal) => {
        AdvisoryTexts {
            try_lock: concat!(
                "WITH l AS (SELECT set_config('synchronous_commit', 'off', true) AS s, ",
                $try_lock,
                "(?) AS got) \
                 SELECT l.got, 0::int8 AS id, \
                 CASE WHEN l.got THEN nextval('dlock_fence_seq') + (SELECT off FROM dlock_fence_live) END \
                 AS token, (SELECT high FROM dlock_fence_live) AS high, \
                 clock_timestamp() AS acquired_at FROM l"
            ),
            lock_within: concat!(
                "WITH l AS (SELECT set_config('synchronous_commit', 'off', true) AS s, \
                 CASE WHEN set_config('lock_timeout', ?, true) IS NOT NULL \
                 THEN ",
                $lock,
                "(?) END AS got) \
                 SELECT true AS got, 0::int8 AS id, \
                 nextval('dlock_fence_seq') + (SELECT off FROM dlock_fence_live) AS token, \
                 (SELECT high FROM dlock_fence_live) AS high, clock_timestamp() AS acquired_at FROM l"
            ),
            lock: concat!(
                "WITH l AS (SELECT set_config('synchronous_commit', 'off', true) AS s, ",
                $lock,
                "(?) AS got) \
                 SELECT true AS got, 0::int8 AS id, \
                 nextval('dlock_fence_seq') + (SELECT off FROM dlock_fence_live) AS token, \
                 (SELECT high FROM dlock_fence_live) AS high, clock_timestamp() AS acquired_at FROM l"
            ),
        }
    };
}

/// Advisory's session-level lock.
const ADVISORY: AdvisoryTexts = advisory_texts!("pg_try_advisory_lock", "pg_advisory_lock");
/// AdvisoryXact's lock, which ends with its transaction.
const ADVISORY_XACT: AdvisoryTexts =
    advisory_texts!("pg_try_advisory_xact_lock", "pg_advisory_xact_lock");
/// The readers of an Advisory `Locker` (`shared_sessions.rs`).
pub(super) const ADVISORY_SHARED: AdvisoryTexts =
    advisory_texts!("pg_try_advisory_lock_shared", "pg_advisory_lock_shared");

/// Before a wait in the server's lock queue: the session checks every second whether its
/// client is still there (`client_connection_check_interval`, PostgreSQL 14 and later; a
/// session setting, left in place: it only ends sessions whose client has gone). Without
/// it a waiter whose process died stays in the queue until the lock is granted to it, and
/// the readers of a shared lock queue behind that dead writer for as long as the current
/// readers hold it.
/// It must be set before the waiting statement starts (the check is armed then).
fn check_client_while_waiting(conn: &mut PgConnection) -> QueryResult<()> {
    stmt(
        "SELECT set_config('client_connection_check_interval', '1000', false) AS s \
         WHERE current_setting('server_version_num')::int >= 140000",
    )
    .execute(conn)
    .map(drop)
}

/// Runs `texts`' statement for `wait` on advisory key `k`.
fn advisory_take(
    conn: &mut PgConnection,
    k: i64,
    wait: Wait,
    texts: &AdvisoryTexts,
) -> QueryResult<LockedRow> {
    if wait != Wait::No {
        check_client_while_waiting(conn)?;
    }
    match wait {
        Wait::No => stmt(texts.try_lock)
            .bind::<BigInt, _>(k)
            .get_result::<LockedRow>(conn),
        Wait::For(d) => stmt(texts.lock_within)
            .bind::<Text, _>(lock_timeout_ms(d))
            .bind::<BigInt, _>(k)
            .get_result::<LockedRow>(conn),
        Wait::Forever => stmt(texts.lock)
            .bind::<BigInt, _>(k)
            .get_result::<LockedRow>(conn),
    }
}

/// A session-level advisory lock (`texts`: exclusive or shared) with its token, or `None`
/// if busy. `undo` unlocks the key's lock of that mode if `pg_locks` shows this session
/// holding it (binds: the key, then its `classid` and `objid`).
pub(super) fn advisory_session_lock(
    conn: &mut PgConnection,
    key: &str,
    wait: Wait,
    texts: &AdvisoryTexts,
    undo: &'static str,
) -> QueryResult<Option<Acquired>> {
    let k = crate::key_hash(key);
    match advisory_take(conn, k, wait, texts) {
        Ok(row) if !row.got => Ok(None),
        Ok(row) => {
            // The lock is this session's: whatever it takes to make the token safe runs
            // in statements of its own (an error leaves the lock held; the caller then
            // closes the session).
            let token = secure(conn, row.drawn())?;
            Ok(Some(Acquired {
                id: 0,
                token,
                acquired_at: row.acquired_at,
            }))
        }
        Err(e) if conn.is_lock_unavailable(&e) => {
            // A lock granted just as lock_timeout fired stays granted to the session even
            // though the statement fails (LockErrorCleanup keeps it). So look, and undo
            // such a grant, unlocking only if pg_locks shows it held (an unlock of a lock
            // not held would log a WARNING).
            let (classid, objid) = advisory_lock_ids(key);
            let raced = stmt(undo)
                .bind::<BigInt, _>(k)
                .bind::<BigInt, _>(classid)
                .bind::<BigInt, _>(objid)
                .get_result::<Released>(conn)
                .optional()?;
            if raced.is_some_and(|r| r.released) {
                log::debug!("lock {key:?}: a grant raced the wait's timeout; undone");
            }
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// `advisory_unlock`.
pub const ADVISORY_UNLOCK: &str = "SELECT pg_advisory_unlock(?) AS released";

/// What the acquiring statements return: whether the lock is ours (Advisory), ForUpdate's
/// proof, and the token with the bound it must not exceed (see `fence.rs`).
#[derive(QueryableByName)]
pub(super) struct LockedRow {
    #[diesel(sql_type = Bool)]
    pub(super) got: bool,
    #[diesel(sql_type = BigInt)]
    pub(super) id: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    token: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    high: Option<i64>,
    #[diesel(sql_type = Timestamptz)]
    pub(super) acquired_at: DateTime<Utc>,
}

impl LockedRow {
    pub(super) fn drawn(&self) -> Drawn {
        Drawn {
            token: self.token,
            high: self.high,
        }
    }
}

#[derive(QueryableByName)]
pub(super) struct Released {
    #[diesel(sql_type = Bool)]
    pub(super) released: bool,
}

/// pg_locks shows an advisory lock taken with one bigint key as classid = high 32 bits,
/// objid = low 32 bits (both oids, so unsigned) and objsubid = 1.
pub(super) fn advisory_lock_ids(key: &str) -> (i64, i64) {
    let k = crate::key_hash(key);
    (i64::from((k >> 32) as u32), i64::from(k as u32))
}

impl SessionLocks for PgConnection {
    fn is_lock_unavailable(&self, e: &diesel::result::Error) -> bool {
        lock_unavailable(e)
    }
    fn for_update_create(&mut self, key: &str) -> QueryResult<()> {
        // The unique check of ON CONFLICT waits for a transaction that has made or updated
        // the key's row and not ended: a holder that made the row and locked it after our
        // lock statement's snapshot. Waiting there would wait for the holder's release,
        // beyond any deadline and out of a cancellation's reach (the session is ended only
        // while the lock statement runs): the wait is bounded, and `lock_unavailable` then
        // tells the caller the row is there, to be locked as the attempt allows.
        stmt(
            "INSERT INTO dlock_for_update (lock_key, version) \
             SELECT ?, 0 WHERE set_config('lock_timeout', ?, true) IS NOT NULL \
             ON CONFLICT (lock_key) DO NOTHING",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(lock_timeout_ms(CREATE_PATIENCE))
        .execute(self)
        .map(drop)
    }
    fn for_update_present(
        &mut self,
        key: &str,
        patience: std::time::Duration,
    ) -> QueryResult<bool> {
        // Waits (at most `patience`, 1 ms at least: a lock_timeout of 0 would wait for
        // ever) for a purge's batch under way: it holds the gate until it commits, and the
        // lock is released only once its deletes are visible; still held after that, the
        // row counts as present (busy). Two statements: the read below must take its
        // snapshot after the wait.
        let ms = patience.as_millis().clamp(1, 60_000).to_string();
        let waited = stmt(
            "SELECT CASE WHEN set_config('lock_timeout', ?, true) IS NOT NULL \
             THEN pg_advisory_xact_lock_shared(?, ?)::text END AS s",
        )
        .bind::<Text, _>(ms)
        .bind::<diesel::sql_types::Integer, _>(super::PURGE_GATE.0)
        .bind::<diesel::sql_types::Integer, _>(super::PURGE_GATE.1)
        .execute(self);
        match waited {
            Ok(_) => {}
            // A purge's batch still holds the gate after 2 s (its purger stopped: the
            // server ends its transaction after its idle bound): busy for this attempt, not
            // one more 2 s wait per retry.
            Err(e) if lock_unavailable(&e) => return Ok(true),
            Err(e) => return Err(e),
        }
        exists(
            stmt("SELECT 1::int8 AS one FROM dlock_for_update WHERE lock_key = ?")
                .bind::<Text, _>(key)
                .get_result::<One>(self)
                .optional(),
        )
    }
    fn for_update_lock(
        &mut self,
        key: &str,
        wait: Wait,
        _flavor: Flavor,
    ) -> QueryResult<ForUpdateLocked> {
        // One statement locks the row (the subquery's FOR UPDATE) and bumps its version,
        // which proves to for_update_held that this transaction still holds the row. The
        // token comes from the sequence, drawn in RETURNING (after the lock is ours): nextval
        // is not rolled back, so a dead holder's token is never reissued; the bound
        // (fence.rs) covers a crash of the server, which this open transaction could not:
        // its WAL is flushed at COMMIT at the earliest, long after the token is seen.
        // An INSERT ... ON CONFLICT here would wait for the holder whatever NOWAIT says:
        // the holder has updated the row, and the unique check waits for its transaction.
        // So the row is created apart (for_update_create) and only when it is missing.
        // set_config(.., true) is SET LOCAL: it ends with this transaction. It is evaluated
        // in the scan below the row lock, so it is in force before the wait.
        let q = match wait {
            Wait::No => stmt(
                "UPDATE dlock_for_update SET version = version + 1 WHERE lock_key = \
                 (SELECT lock_key FROM dlock_for_update WHERE lock_key = ? \
                  AND set_config('synchronous_commit', 'off', true) IS NOT NULL FOR UPDATE NOWAIT) \
                 RETURNING true AS got, version AS id, \
                 nextval('dlock_fence_seq') + (SELECT off FROM dlock_fence_live) AS token, \
                 (SELECT high FROM dlock_fence_live) AS high, clock_timestamp() AS acquired_at",
            )
            .bind::<Text, _>(key)
            .get_result::<LockedRow>(self),
            Wait::For(d) => {
                // lock_timeout bounds each wait for a row lock, and the statement can wait
                // more than once: a holder changing hands makes it wait again for the row's
                // new version, so a bounded wait could last a multiple of its bound.
                // statement_timeout, armed when a statement starts, bounds
                // them all: set for this transaction first, and put back in the locking
                // statement itself once the lock is ours (the guard's transaction runs on).
                #[derive(QueryableByName)]
                struct Before {
                    #[diesel(sql_type = Text)]
                    before: String,
                }
                let ms = lock_timeout_ms(d);
                // With the client check of `check_client_while_waiting`, in the same round trip.
                let before = stmt(
                    "SELECT current_setting('statement_timeout') AS before, \
                     set_config('statement_timeout', ?, true) AS now, \
                     CASE WHEN current_setting('server_version_num')::int >= 140000 \
                     THEN set_config('client_connection_check_interval', '1000', false) END AS c",
                )
                .bind::<Text, _>(&ms)
                .get_result::<Before>(self)?
                .before;
                let locked = stmt(
                    "UPDATE dlock_for_update SET version = version + 1 WHERE lock_key = \
                     (SELECT lock_key FROM dlock_for_update WHERE lock_key = ? \
                      AND set_config('synchronous_commit', 'off', true) IS NOT NULL \
                      AND set_config('lock_timeout', ?, true) IS NOT NULL FOR UPDATE) \
                     RETURNING true AS got, version AS id, \
                     nextval('dlock_fence_seq') + (SELECT off FROM dlock_fence_live) AS token, \
                     (SELECT high FROM dlock_fence_live) AS high, clock_timestamp() AS acquired_at, \
                     set_config('statement_timeout', ?, true) AS put_back",
                )
                .bind::<Text, _>(key)
                .bind::<Text, _>(&ms)
                .bind::<Text, _>(&before)
                .get_result::<LockedRow>(self);
                match locked {
                    // Ours, as the deadline has passed: the transaction is rolled back.
                    Err(e) if statement_timed_out(&e) => return Ok(ForUpdateLocked::Blocked),
                    locked => locked,
                }
            }
            Wait::Forever => {
                check_client_while_waiting(self)?;
                stmt(FOR_UPDATE_LOCK)
                    .bind::<Text, _>(key)
                    .get_result::<LockedRow>(self)
            }
        };
        Ok(locked(q.optional()?))
    }
    fn for_update_held(&mut self, key: &str, version: i64) -> QueryResult<bool> {
        // Inside the holder's transaction this sees its own uncommitted version; a
        // transaction that ended (or a session that died) cannot answer yes.
        exists(
            stmt("SELECT 1::int8 AS one FROM dlock_for_update WHERE lock_key = ? AND version = ?")
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(version)
                .get_result::<One>(self)
                .optional(),
        )
    }
    fn advisory_lock(&mut self, key: &str, wait: Wait) -> QueryResult<Option<Acquired>> {
        advisory_session_lock(
            self,
            key,
            wait,
            &ADVISORY,
            "SELECT pg_advisory_unlock(?) AS released FROM pg_locks \
             WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted \
               AND classid::int8 = ? AND objid::int8 = ? AND objsubid = 1",
        )
    }
    fn advisory_unlock(&mut self, key: &str) -> QueryResult<bool> {
        stmt(ADVISORY_UNLOCK)
            .bind::<BigInt, _>(crate::key_hash(key))
            .get_result::<Released>(self)
            .map(|r| r.released)
    }
    fn advisory_held(&mut self, key: &str) -> QueryResult<bool> {
        let (classid, objid) = advisory_lock_ids(key);
        exists(
            stmt(
                "SELECT 1::int8 AS one FROM pg_locks \
                 WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted \
                   AND classid::int8 = ? AND objid::int8 = ? AND objsubid = 1",
            )
            .bind::<BigInt, _>(classid)
            .bind::<BigInt, _>(objid)
            .get_result::<One>(self)
            .optional(),
        )
    }
    fn advisory_xact_lock(&mut self, key: &str, wait: Wait) -> QueryResult<XactLocked> {
        // As advisory_lock, with the lock that ends with the transaction. synchronous_commit
        // off makes the holder's COMMIT wait for no flush. A timeout aborts the transaction,
        // and the caller's rollback frees a lock granted as the timeout fired.
        let row = advisory_take(self, crate::key_hash(key), wait, &ADVISORY_XACT)?;
        if !row.got {
            return Ok(XactLocked::Busy);
        }
        Ok(match row.drawn().checked() {
            Ok(token) => XactLocked::Locked(Acquired {
                id: 0,
                token,
                acquired_at: row.acquired_at,
            }),
            Err(drawn) => XactLocked::Unfenced(drawn),
        })
    }
    fn fence_prepare(&mut self, drawn: Option<i64>) -> QueryResult<()> {
        match drawn {
            Some(token) => fence::raise(self, token),
            None => fence::start_life(self),
        }
    }
    fn fence_draw(&mut self) -> QueryResult<Drawn> {
        fence::draw(self)
    }
}

#[derive(QueryableByName)]
struct SessionId {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

#[derive(QueryableByName)]
struct Yes {
    #[diesel(sql_type = Bool)]
    yes: bool,
}

impl EndSession for PgConnection {
    fn session_id(&mut self) -> QueryResult<i64> {
        stmt("SELECT pg_backend_pid()::bigint AS id")
            .get_result::<SessionId>(self)
            .map(|r| r.id)
    }

    fn kill_session(&mut self, id: i64) -> QueryResult<bool> {
        stmt("SELECT pg_terminate_backend(CAST(? AS integer)) AS yes")
            .bind::<BigInt, _>(id)
            .get_result::<Yes>(self)
            .map(|r| r.yes)
    }

    fn session_exists(&mut self, id: i64) -> QueryResult<bool> {
        stmt("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = CAST(? AS integer)) AS yes")
            .bind::<BigInt, _>(id)
            .get_result::<Yes>(self)
            .map(|r| r.yes)
    }
}

/// What a row-locking statement's row (if any) means: no row, the row is missing; else the
/// lock is held, with a token that may or may not go out yet.
pub(super) fn locked(row: Option<LockedRow>) -> ForUpdateLocked {
    match row {
        None => ForUpdateLocked::Missing,
        Some(r) => match r.drawn().checked() {
            Ok(token) => ForUpdateLocked::Locked(Acquired {
                id: r.id,
                token,
                acquired_at: r.acquired_at,
            }),
            Err(drawn) => ForUpdateLocked::Unfenced(drawn),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advisory_ids_split_the_hash_as_pg_locks_shows_it() {
        // key_hash("x" * 65) = 0x9537c5fdf120482f, a negative i64: both halves unsigned.
        assert_eq!(advisory_lock_ids(&"x".repeat(65)), (0x9537c5fd, 0xf120482f));
    }
}
