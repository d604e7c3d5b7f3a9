//! MySQL's session strategies: `ForUpdate` (a row locked by `SELECT … FOR UPDATE`) and
//! `Advisory` (`GET_LOCK`). Their tokens (`fence.rs`) are drawn by the locking statement
//! itself, once the lock is held.
// Its statements' texts are `pub` for `__bench_sql` (feature `bench-sql`) only.
#![cfg_attr(not(feature = "bench-sql"), allow(unreachable_pub))]

use super::{fence, lock_unavailable, with_lock_wait_timeout};
use crate::backend::fence::secure;
use crate::backend::interrupt::EndSession;
use crate::backend::sealed::SessionLocks;
use crate::backend::shared::{exists, One};
use crate::backend::stmt::stmt;
use crate::backend::{Acquired, Drawn, Flavor, ForUpdateLocked, Wait};
use chrono::{DateTime, Utc};
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Double, Nullable, Text};
use diesel::{OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};

// The texts of the statements the benches' raw floors run too (`diesel_lock::__bench_sql`);
// the others are written where they run.

/// `for_update_lock`, with `Wait::Forever` or inside a bounded
/// `innodb_lock_wait_timeout`: locks the row and then (the select list is evaluated for the
/// row once it is locked) draws the token; -1 if this session has not joined the server's
/// life yet. The time is read by SYSDATE, which (unlike UTC_TIMESTAMP, fixed when the
/// statement begins) tells when the wait ended.
pub const FOR_UPDATE_LOCK: &str = "SELECT \
     CAST(COALESCE(CAST(UUID_SHORT() & 72057594037927935 AS SIGNED) + IF(@@GLOBAL.server_id = @dlock_fence_server, @dlock_fence_off, NULL), -1) AS SIGNED) AS token, \
     CAST(@dlock_fence_high AS SIGNED) AS high, \
     CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED) AS acquired_us \
     FROM dlock_for_update WHERE lock_key = ? FOR UPDATE";

/// `for_update_lock` on MySQL proper, once the row is locked: a row only this transaction
/// sees, its proof that it is still open (MySQL has no `@@in_transaction`).
const FENCE_INSERT: &str = "INSERT INTO dlock_fences (lock_key) VALUES (?)";

/// `for_update_finish` on MySQL proper.
const FENCE_DELETE: &str = "DELETE FROM dlock_fences WHERE id = ?";

/// `advisory_lock` with `Wait::Forever`, or a wait of at least
/// `GET_LOCK_MAX_SECS`: the lock, then the token. The CASE runs GET_LOCK once (into
/// `@dlock_got`, read by the next branch) and draws only if the lock was granted: the token
/// is NULL if GET_LOCK failed, 0 after a timeout, -1 if this session has not joined the
/// server's life yet.
pub const ADVISORY_LOCK: &str = "SELECT \
     CAST(CASE WHEN (@dlock_got := GET_LOCK(?, 31536000)) = 1 \
          THEN COALESCE(CAST(UUID_SHORT() & 72057594037927935 AS SIGNED) + IF(@@GLOBAL.server_id = @dlock_fence_server, @dlock_fence_off, NULL), -1) \
          WHEN @dlock_got = 0 THEN 0 END AS SIGNED) AS token, \
     CAST(@dlock_fence_high AS SIGNED) AS high, \
     CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED) AS acquired_us";

/// The lock alone, with no token, that the benches measure tokens against.
pub const GET_LOCK: &str = "SELECT CAST(GET_LOCK(?, 31536000) AS SIGNED) AS answer";

/// `for_update_lock`'s lock alone, that the benches measure tokens against.
pub const FOR_UPDATE_LOCK_ONLY: &str =
    "SELECT CAST(1 AS SIGNED) AS one FROM dlock_for_update WHERE lock_key = ? FOR UPDATE";

/// `advisory_unlock`.
pub const ADVISORY_UNLOCK: &str = "SELECT CAST(RELEASE_LOCK(?) AS SIGNED) AS answer";

/// What the locking statements return.
#[derive(QueryableByName)]
struct SequenceRow {
    #[diesel(sql_type = Nullable<BigInt>)]
    token: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    high: Option<i64>,
    #[diesel(sql_type = BigInt)]
    acquired_us: i64,
}

impl SequenceRow {
    /// GET_LOCK's answer, as MariaDB's statement encodes it in the token (see
    /// `ADVISORY_LOCK`): 1 granted, 0 timed out, NULL failed.
    fn answer(&self) -> Option<i64> {
        self.token.map(|t| i64::from(t != 0))
    }

    fn drawn(&self) -> Drawn {
        Drawn {
            token: self.token.filter(|t| *t > 0),
            high: self.high,
        }
    }

    fn acquired_at(&self) -> QueryResult<DateTime<Utc>> {
        DateTime::from_timestamp_micros(self.acquired_us)
            .ok_or_else(|| error("the server's clock is out of range"))
    }
}

#[derive(QueryableByName)]
struct FenceId {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

#[derive(QueryableByName)]
struct Answer {
    #[diesel(sql_type = Nullable<BigInt>)]
    answer: Option<i64>,
}

/// The longest `GET_LOCK` name MySQL accepts (5.7 and later), in characters.
const MAX_LOCK_NAME_CHARS: usize = 64;

/// What marks a name as a hash; keys that start with it are hashed too, so a key used
/// verbatim can never equal another key's hashed name.
const HASHED_PREFIX: &str = "dlock-sha256:";

/// The `GET_LOCK` name of a key: the key itself when it has at most 64 characters, all of
/// them lowercase ASCII letters, digits or `.` `_` `:` `/` `-`, else `dlock-sha256:` and the 16
/// lowercase hex digits of [`key_hash`](crate::key_hash) (the first 8 bytes of SHA-256).
/// MySQL (unlike MariaDB) lowercases lock names and converts them to utf8mb3, which would make
/// `Report` and `report` one lock and refuse 4-byte characters; those keys are hashed, so keys
/// stay exact on both. Lock names are server-wide: the same key in two databases on one
/// server is one lock.
pub(crate) fn lock_name(key: &str) -> std::borrow::Cow<'_, str> {
    let plain = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || "._:/-".contains(c);
    if key.len() <= MAX_LOCK_NAME_CHARS && key.chars().all(plain) && !key.starts_with(HASHED_PREFIX)
    {
        key.into()
    } else {
        format!("{HASHED_PREFIX}{:016x}", crate::key_hash(key) as u64).into()
    }
}

/// A database error diesel has no kind for, with our own message.
fn error(message: &str) -> diesel::result::Error {
    diesel::result::Error::DatabaseError(
        diesel::result::DatabaseErrorKind::Unknown,
        Box::new(message.to_owned()),
    )
}

/// The longest `GET_LOCK` wait asked for (a year); the locker waits again after it.
const GET_LOCK_MAX_SECS: u64 = 31_536_000;

/// ForUpdate's proof on MariaDB, which inserts no fence row: the transaction is still open
/// (it holds the row lock until it ends).
const IN_TRANSACTION: i64 = 0;

/// `for_update_lock` with `Wait::No`, or the fraction of a second a bounded wait leaves.
const FOR_UPDATE_NOWAIT: &str = "SELECT \
     CAST(COALESCE(CAST(UUID_SHORT() & 72057594037927935 AS SIGNED) + IF(@@GLOBAL.server_id = @dlock_fence_server, @dlock_fence_off, NULL), -1) \
     AS SIGNED) AS token, \
     CAST(@dlock_fence_high AS SIGNED) AS high, \
     CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED) AS acquired_us \
     FROM dlock_for_update WHERE lock_key = ? FOR UPDATE NOWAIT";

/// Locks the key's row with `locking` (a statement as `FOR_UPDATE_LOCK`: `FOR UPDATE`, or a
/// reader's share lock) or, for `Wait::No` and what is left of a bounded wait below a second,
/// `nowait` (the same with `NOWAIT`), and makes the proof that the transaction holds it.
pub(super) fn row_lock(
    conn: &mut MysqlConnection,
    key: &str,
    wait: Wait,
    flavor: Flavor,
    locking: &'static str,
    nowait: &'static str,
) -> QueryResult<ForUpdateLocked> {
    // innodb_lock_wait_timeout counts whole seconds (and MariaDB's `WAIT n` rounds a
    // fraction down to 0), so a bounded wait waits the whole seconds it has server-side
    // and leaves the rest to the locker's NOWAIT retries, never overshooting.
    // At most 100,000,000 s, the largest the server takes; a longer wait ends there as
    // busy and the locker waits again until its deadline.
    let seconds = match wait {
        Wait::For(d) => d.as_secs().min(100_000_000),
        _ => 0,
    };
    let locked = match wait {
        Wait::Forever => stmt(locking)
            .bind::<Text, _>(key)
            .get_result::<SequenceRow>(conn)
            .optional(),
        Wait::For(_) if seconds > 0 => {
            // The session's own setting is saved and put back, as the connection goes
            // back to the pool and on to other users.
            with_lock_wait_timeout(conn, seconds, |c| {
                Ok(stmt(locking)
                    .bind::<Text, _>(key)
                    .get_result::<SequenceRow>(c)
                    .optional())
            })?
        }
        _ => stmt(nowait)
            .bind::<Text, _>(key)
            .get_result::<SequenceRow>(conn)
            .optional(),
    }?;
    let Some(r) = locked else {
        return Ok(ForUpdateLocked::Missing);
    };
    let token = match r.drawn().checked() {
        Ok(token) => token,
        Err(drawn) => return Ok(ForUpdateLocked::Unfenced(drawn)),
    };
    let proof = match flavor {
        Flavor::Standard => IN_TRANSACTION,
        Flavor::Mysql => {
            // The row stays uncommitted, visible only to this transaction, until
            // for_update_finish deletes it.
            stmt(FENCE_INSERT).bind::<Text, _>(key).execute(conn)?;
            stmt("SELECT CAST(LAST_INSERT_ID() AS SIGNED) AS id")
                .get_result::<FenceId>(conn)?
                .id
        }
    };
    Ok(ForUpdateLocked::Locked(Acquired {
        id: proof,
        token,
        acquired_at: r.acquired_at()?,
    }))
}

impl SessionLocks for MysqlConnection {
    fn is_lock_unavailable(&self, e: &diesel::result::Error) -> bool {
        lock_unavailable(e)
    }
    fn for_update_create(&mut self, key: &str) -> QueryResult<()> {
        // The duplicate check waits for a transaction that holds the key's row (made and
        // locked by a holder after our lock statement found none): not at all on MariaDB
        // (1 s on MySQL proper, the least it takes), so that the attempt locks the row
        // instead, as its wait allows. (A wait of 1 s made every try, deadline and
        // cancellation that met such a row answer 1 s late.)
        super::with_least_lock_wait(self, |c| {
            stmt("INSERT IGNORE INTO dlock_for_update (lock_key, version) VALUES (?, 0)")
                .bind::<Text, _>(key)
                .execute(c)
                .map(drop)
        })
    }
    fn for_update_present(
        &mut self,
        key: &str,
        patience: std::time::Duration,
    ) -> QueryResult<bool> {
        // A purge's batch under way holds the gate until it has committed: wait for it (at
        // most `patience`) and try again. Free: the read below, a statement of its own (a read
        // view of its own), tells whether the row is still there. The wait looks at the
        // gate (`IS_FREE_LOCK`, every 1 ms growing to 50 ms) and never takes it: a named
        // lock is the session's, so an acquirer stopped (SIGSTOP, a partition) right after
        // its `GET_LOCK` was granted kept the gate for as long as it was stopped, and every
        // purge and every busy try of a `ForUpdate` key with it (found by the purge's
        // adversary: `dlock purge` failed after a minute, busy tries took 2 s).
        let start = std::time::Instant::now();
        let mut pause = std::time::Duration::from_millis(1);
        let mut waited = false;
        loop {
            let free = stmt(concat!(
                "SELECT CAST(COALESCE(IS_FREE_LOCK(",
                super::purge_gate!(),
                "), 0) AS SIGNED) AS one"
            ))
            .get_result::<One>(self)?
            .one;
            if free == 1 {
                break;
            }
            if start.elapsed() >= patience {
                // Still held after 2 s (a purger stopped between taking the gate and its
                // transaction, whose idle bound then ends nothing): busy for this attempt,
                // not one more 2 s wait per retry.
                return Ok(true);
            }
            waited = true;
            std::thread::sleep(pause.min(patience.saturating_sub(start.elapsed())));
            pause = (pause * 2).min(std::time::Duration::from_millis(50));
        }
        if waited {
            // The gate was held and is free now: the purge's batch has committed; try again.
            return Ok(false);
        }
        exists(
            stmt("SELECT CAST(1 AS SIGNED) AS one FROM dlock_for_update WHERE lock_key = ?")
                .bind::<Text, _>(key)
                .get_result::<One>(self)
                .optional(),
        )
    }
    fn for_update_lock(
        &mut self,
        key: &str,
        wait: Wait,
        flavor: Flavor,
    ) -> QueryResult<ForUpdateLocked> {
        row_lock(self, key, wait, flavor, FOR_UPDATE_LOCK, FOR_UPDATE_NOWAIT)
    }
    fn for_update_held(&mut self, _key: &str, proof: i64) -> QueryResult<bool> {
        if proof == IN_TRANSACTION {
            return in_transaction(self);
        }
        // Only the holder's own open transaction can see its uncommitted fence row.
        exists(
            stmt("SELECT CAST(1 AS SIGNED) AS one FROM dlock_fences WHERE id = ?")
                .bind::<BigInt, _>(proof)
                .get_result::<One>(self)
                .optional(),
        )
    }
    fn for_update_finish(&mut self, proof: i64) -> QueryResult<bool> {
        if proof == IN_TRANSACTION {
            return in_transaction(self);
        }
        stmt(FENCE_DELETE)
            .bind::<BigInt, _>(proof)
            .execute(self)
            .map(|n| n == 1)
    }
    fn advisory_lock(&mut self, key: &str, wait: Wait) -> QueryResult<Option<Acquired>> {
        let name = lock_name(key);
        // MySQL reads a negative timeout as "forever", MariaDB refuses it (NULL and warning
        // 1411); a year is accepted by both and ends as an ordinary timeout. (MariaDB
        // answers a much longer one, 10^12 s, with 0 at once.)
        let r = match wait {
            Wait::No => stmt(
                "SELECT \
                 CAST(CASE WHEN (@dlock_got := GET_LOCK(?, 0)) = 1 \
                      THEN COALESCE(CAST(UUID_SHORT() & 72057594037927935 AS SIGNED) + IF(@@GLOBAL.server_id = @dlock_fence_server, @dlock_fence_off, NULL), -1) \
                      WHEN @dlock_got = 0 THEN 0 END AS SIGNED) AS token, \
                 CAST(@dlock_fence_high AS SIGNED) AS high, \
                 CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED) AS acquired_us",
            )
            .bind::<Text, _>(&*name)
            .get_result::<SequenceRow>(self)?,
            // MariaDB honours fractions of a second; MySQL may round the timeout to whole
            // seconds, up as well as down, so it is given only the whole seconds.
            Wait::For(d) if d.as_secs() < GET_LOCK_MAX_SECS => stmt(
                "SELECT \
                 CAST(CASE WHEN (@dlock_got := \
                          GET_LOCK(?, IF(VERSION() LIKE '%MariaDB%', ?, FLOOR(?)))) = 1 \
                      THEN COALESCE(CAST(UUID_SHORT() & 72057594037927935 AS SIGNED) + IF(@@GLOBAL.server_id = @dlock_fence_server, @dlock_fence_off, NULL), -1) \
                      WHEN @dlock_got = 0 THEN 0 END AS SIGNED) AS token, \
                 CAST(@dlock_fence_high AS SIGNED) AS high, \
                 CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED) AS acquired_us",
            )
            .bind::<Text, _>(&*name)
            .bind::<Double, _>(d.as_secs_f64())
            .bind::<Double, _>(d.as_secs_f64())
            .get_result::<SequenceRow>(self)?,
            _ => stmt(ADVISORY_LOCK)
                .bind::<Text, _>(&*name)
                .get_result::<SequenceRow>(self)?,
        };
        match r.answer() {
            Some(1) => {}
            Some(_) => {
                // 0 is a timeout. GET_LOCK decides atomically, but a lock that this session
                // holds must not stay behind whatever it said, so make sure.
                if self.advisory_held(key)? {
                    log::warn!("lock {key:?}: GET_LOCK timed out yet the lock is ours; releasing");
                    self.advisory_unlock(key)?;
                }
                return Ok(None);
            }
            None => return Err(error("GET_LOCK failed (returned NULL)")),
        }
        // The lock is this session's: whatever it takes to make the token safe runs in
        // statements of its own (an error leaves the lock held; the caller then closes the
        // session).
        let token = secure(self, r.drawn())?;
        Ok(Some(Acquired {
            id: 0,
            token,
            acquired_at: r.acquired_at()?,
        }))
    }
    fn advisory_unlock(&mut self, key: &str) -> QueryResult<bool> {
        // 1: released; 0: held by another session; NULL: not held by anyone.
        stmt(ADVISORY_UNLOCK)
            .bind::<Text, _>(&*lock_name(key))
            .get_result::<Answer>(self)
            .map(|r| r.answer == Some(1))
    }
    fn advisory_held(&mut self, key: &str) -> QueryResult<bool> {
        stmt("SELECT CAST(IS_USED_LOCK(?) = CONNECTION_ID() AS SIGNED) AS answer")
            .bind::<Text, _>(&*lock_name(key))
            .get_result::<Answer>(self)
            .map(|r| r.answer == Some(1))
    }
    fn flavor(&mut self) -> QueryResult<Flavor> {
        fence::flavor(self)
    }
    fn fence_prepare(&mut self, drawn: Option<i64>) -> QueryResult<()> {
        match drawn {
            Some(token) => fence::raise(self, token),
            None => fence::join(self),
        }
    }
    fn fence_draw(&mut self) -> QueryResult<Drawn> {
        fence::draw(self)
    }
}

/// MariaDB's ForUpdate proof: this session's transaction is still open.
fn in_transaction(conn: &mut MysqlConnection) -> QueryResult<bool> {
    stmt("SELECT CAST(@@in_transaction AS SIGNED) AS one")
        .get_result::<One>(conn)
        .map(|r| r.one == 1)
}

#[derive(QueryableByName)]
struct SessionId {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

impl EndSession for MysqlConnection {
    fn session_id(&mut self) -> QueryResult<i64> {
        stmt("SELECT CAST(CONNECTION_ID() AS SIGNED) AS id")
            .get_result::<SessionId>(self)
            .map(|r| r.id)
    }

    fn session_exists(&mut self, id: i64) -> QueryResult<bool> {
        // A user sees its own sessions without the PROCESS privilege.
        stmt("SELECT CAST(COUNT(*) AS SIGNED) AS id FROM information_schema.PROCESSLIST WHERE ID = ?")
            .bind::<BigInt, _>(id)
            .get_result::<SessionId>(self)
            .map(|r| r.id > 0)
    }

    fn kill_session(&mut self, id: i64) -> QueryResult<bool> {
        match stmt("KILL CONNECTION ?")
            .bind::<BigInt, _>(id)
            .execute(self)
        {
            Ok(_) => Ok(true),
            // ER_NO_SUCH_THREAD: the session has ended already.
            Err(diesel::result::Error::DatabaseError(_, info))
                if info.message().starts_with("Unknown thread id") =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_names_are_verbatim_up_to_64_characters_then_hashed() {
        assert_eq!(lock_name("nightly-report"), "nightly-report");
        let x64 = "x".repeat(64);
        assert_eq!(lock_name(&x64), x64.as_str());
        // Upper case, spaces and non-ASCII are hashed: MySQL folds case and charset.
        assert_eq!(lock_name("Nightly-Report"), "dlock-sha256:3869aaf865c191f5");
        assert_eq!(lock_name("ключ-🔒"), "dlock-sha256:01ee05df8e3fd0cb");
        // Test vector: sha256("x" × 65) starts 9537c5fdf120482f.
        assert_eq!(lock_name(&"x".repeat(65)), "dlock-sha256:9537c5fdf120482f");
        // A key that looks like a hashed name is hashed too, so it cannot collide with one.
        let lookalike = "dlock-sha256:9537c5fdf120482f";
        assert_ne!(lock_name(lookalike), lookalike);
        assert!(lock_name(lookalike).starts_with(HASHED_PREFIX));
    }
}
