//! MySQL's `Row` and `Lease` statements.
// Its statements' texts are `pub` for `__bench_sql` (feature `bench-sql`) only.
#![cfg_attr(not(feature = "bench-sql"), allow(unreachable_pub))]

use super::handover::{
    confirmed_place, counter_there, delete_place, grant_lease, grant_row, release_or_grant,
    FirstPlace, Id, LEASE_FIRST_PLACE, LEASE_RELEASE_ALONE, LEASE_RELEASE_PLAIN, ROW_FIRST_PLACE,
    ROW_RELEASE_ALONE,
};
use super::{with_lock_wait_timeout, with_transaction_bounds};
use crate::backend::holders::stall_bound;
use crate::backend::sealed::Locks;
use crate::backend::shared;
use crate::backend::shared::{exists, KeyHolder, One};
use crate::backend::stmt::{in_list, pad, stmt, BATCH_SIZES};
use crate::backend::Acquired;
use crate::key::floor_bucket;
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::Connection;
use diesel::{OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};
use std::sync::OnceLock;

// The texts of the statements the benches' raw floors run too (`diesel_lock::__bench_sql`);
// the others are written where they run. The releases are in `shared.rs` (the same on
// SQLite).

/// `row_acquire`, first: the key's counter goes up (never below the clock floor,
/// `mysql_floor!`; a key without a counter row starts above the token floor,
/// `mysql_floor_read!`), and the new value is left in this session's `LAST_INSERT_ID()`.
///
/// No trigger draws the token (creating one needs SUPER on a server with a binary log).
/// Instead the counter is bumped before the INSERT, and the INSERT (`ROW_INSERT`) inserts
/// only while the counter is still this bump, holding the counter's row lock until it
/// commits: another acquirer's bump waits for it, so every later holder's bump, and token,
/// comes after this row's. Of acquirers racing for a free key, the last to bump wins.
pub const ROW_BUMP: &str = concat!(
    "INSERT INTO dlock_tokens (lock_key, token) \
     SELECT ?, LAST_INSERT_ID(GREATEST(f.floor_token + 1, ",
    mysql_floor!(),
    ")) ",
    mysql_floor_read!(),
    " ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(GREATEST(dlock_tokens.token + 1, ",
    mysql_floor!(),
    "))"
);

/// `row_acquire`, the insert, with the token `ROW_BUMP` drew, if nobody bumped the key's
/// counter since (a locking read: see `ROW_BUMP`). Where the Row trigger of older versions
/// is still there (migration 11 drops it only where the user may), the server refuses this
/// statement, and `ROW_INSERT_STAMPED` runs instead.
pub const ROW_INSERT: &str =
    "INSERT IGNORE INTO dlock_rows (lock_key, owner, holder, token, acquired_at, stale_at) \
     SELECT ?, ?, ?, t.token, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
     FROM dlock_tokens t WHERE t.lock_key = ? AND t.token = LAST_INSERT_ID() FOR UPDATE";

/// `row_acquire`'s insert on a database that still has the Row trigger of older versions:
/// the trigger bumps the key's counter (holding its row lock until the statement commits) and
/// stamps the row with it, so tokens follow the order of the inserts, as they did then.
const ROW_INSERT_STAMPED: &str =
    "INSERT IGNORE INTO dlock_rows (lock_key, owner, holder, token, acquired_at, stale_at) \
     VALUES (?, ?, ?, 0, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)";

/// Whether the server refused `ROW_INSERT` for the old Row trigger, which writes
/// `dlock_tokens` while the statement reads it (error 1442). diesel keeps no error number,
/// and the message is in the server's language (`lc_messages`); the table's name is in it in
/// every language, and no other error of this statement names it but a missing table.
fn refused_for_the_old_trigger(e: &diesel::result::Error) -> bool {
    matches!(e, diesel::result::Error::DatabaseError(_, info)
        if info.message().contains("dlock_tokens"))
        && !crate::error::is_missing_table(e)
}

/// `row_acquire`, after an insert: the row's id, token and time.
/// The row just inserted, and how many live places of the key's line are ahead of the
/// caller's (its place, or none for a newcomer): more than none means the INSERT took the
/// key ahead of the line (a place joined between the caller's look and its INSERT, or a
/// newcomer, which does not look first), and the row is deleted again.
pub const ROW_READ_BACK: &str = concat!(
    "SELECT r.id, r.token, r.acquired_at, \
       (SELECT COUNT(*) FROM dlock_waiters w WHERE w.lock_key = r.lock_key AND w.line = ",
    line_sql!(row),
    " AND w.id < ? \
          AND w.expires_at > UTC_TIMESTAMP(6) AND w.granted_at IS NULL) AS ahead \
     FROM dlock_rows r WHERE r.id = LAST_INSERT_ID()"
);

/// Whether the lease row an upsert met is free: no live exclusive lease and no live reader
/// or permit (`shared_until`, raised by each of them with the row locked: `holders.rs`).
macro_rules! lease_free {
    () => {
        "(expires_at IS NULL OR expires_at <= UTC_TIMESTAMP(6)) \
         AND (shared_until IS NULL OR shared_until <= UTC_TIMESTAMP(6))"
    };
}

/// `lease_acquire`, the upsert.
///
/// MySQL applies ON DUPLICATE KEY UPDATE assignments left to right, each seeing the ones
/// before it, unless MariaDB's sql_mode SIMULTANEOUS_ASSIGNMENT is set, when each sees the
/// old row. Every condition reads only `expires_at`, which is assigned last, and
/// `shared_until`, which is not assigned, so both orders decide alike. (A free lease has
/// expires_at NULL: release clears it together with the holder.) The upsert locks the row
/// and reads its newest committed version, so a reader committed after the statement began
/// is seen; a key with shared holders always has its row, so the INSERT never runs beside
/// them.
/// The token never goes below the server's clock floor (`mysql_floor!`); a new row (a key
/// never used, or purged) starts above the token floor (`mysql_floor_read!`) and above a
/// counter a `Row` lock or an older version's purge left in dlock_tokens.
pub const LEASE_UPSERT: &str = concat!(
    "INSERT INTO dlock_leases (lock_key, owner, holder_id, token, acquired_at, expires_at) \
     SELECT ?, ?, ?, GREATEST(GREATEST(f.floor_token, \
                                       COALESCE((SELECT t.token FROM dlock_tokens t \
                                                 WHERE t.lock_key = ?), 0)) + 1, ",
    mysql_floor!(),
    "), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND ",
    mysql_floor_read!(),
    " ON DUPLICATE KEY UPDATE \
       token = IF(",
    lease_free!(),
    ", GREATEST(token + 1, ",
    mysql_floor!(),
    "), token), \
       owner = IF(",
    lease_free!(),
    ", VALUES(owner), owner), \
       holder_id = IF(",
    lease_free!(),
    ", VALUES(holder_id), holder_id), \
       acquired_at = IF(",
    lease_free!(),
    ", VALUES(acquired_at), acquired_at), \
       expires_at = IF(",
    lease_free!(),
    ", VALUES(expires_at), expires_at)"
);

/// `lease_acquire`, after the upsert: the token and time, if the lease is ours.
/// The lease just taken, and the live places ahead of the caller's, as `ROW_READ_BACK`.
/// The line is read only if the row does not say that nobody waits (`line_free`).
pub const LEASE_READ_BACK: &str = concat!(
    "SELECT CAST(0 AS SIGNED) AS id, l.token, l.acquired_at, \
       CASE WHEN l.line_free THEN CAST(0 AS SIGNED) ELSE \
       (SELECT COUNT(*) FROM dlock_waiters w WHERE w.lock_key = l.lock_key AND w.line = ",
    line_sql!(lease),
    " AND w.id < ? \
          AND w.expires_at > UTC_TIMESTAMP(6) AND w.granted_at IS NULL) END AS ahead \
     FROM dlock_leases l WHERE l.lock_key = ? AND l.holder_id = ?"
);

/// What the read-backs answer.
#[derive(QueryableByName)]
struct ReadBack {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = BigInt)]
    token: i64,
    #[diesel(sql_type = diesel::sql_types::Datetime)]
    acquired_at: chrono::NaiveDateTime,
    #[diesel(sql_type = BigInt)]
    ahead: i64,
}

impl ReadBack {
    fn acquired(self) -> Acquired {
        Acquired {
            id: self.id,
            token: self.token,
            acquired_at: self.acquired_at.and_utc(),
        }
    }
}

/// After an acquisition: a waiter's own place goes (best effort: a place left behind lapses
/// at its expiry, and holds up the line only until then).
fn leave_place(conn: &mut MysqlConnection, place: i64) {
    if place == crate::backend::NO_PLACE {
        return;
    }
    if let Err(e) = delete_place(conn, place) {
        log::debug!("leaving the line after acquiring failed ({e}); the place lapses");
    }
}

/// Gives back a key taken ahead of the line, retrying while the server reports contention (a
/// deadlock victim, a Galera certification failure). A give-back that still fails is not
/// contention for the caller: the row would be left held by nobody (a `Row` without
/// `stale_after` for good), so the error goes up as one that may have left a row, and the
/// strategy removes the row by its holder id or remembers it (`RowLock`'s orphans).
fn give_back(
    conn: &mut MysqlConnection,
    key: &str,
    f: impl FnMut(&mut MysqlConnection) -> QueryResult<()>,
) -> QueryResult<()> {
    use crate::backend::sealed::Dialect;
    crate::backoff::retry_contended(
        conn,
        std::time::Duration::from_millis(64),
        &format!("giving back {key:?}, taken ahead of the line"),
        f,
        super::statement_retryable,
    )
    .map_err(|e| {
        if conn.is_contention(&e) {
            diesel::result::Error::QueryBuilderError(
                format!("could not give back a key taken ahead of the line: {e}").into(),
            )
        } else {
            e
        }
    })
}

/// How many times `row_acquire` bumps a counter again that a purge deleted between its bump
/// and its insert (each time a purge must have won that race).
const PURGE_RETRIES: usize = 100;

impl Locks for MysqlConnection {
    shared::statements!(row_held, row_give_back);

    fn row_release(&mut self, id: i64, holder: &str) -> QueryResult<bool> {
        let alone = stmt(ROW_RELEASE_ALONE)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(holder)
            .bind::<Text, _>(holder)
            .execute(self)?;
        if alone == 1 {
            return Ok(true);
        }
        self.row_release_granted(id, holder)
    }

    fn row_release_granted(&mut self, id: i64, holder: &str) -> QueryResult<bool> {
        // The hand-over is one statement, which locks the key's counter, then its row, then
        // the place (`ROW_GRANT`; the acquisitions lock the counter, then insert the row; a
        // place's own statements lock the place only, and the confirmation the row, then the
        // place).
        release_or_grant(
            self,
            |c, after| {
                stmt(ROW_FIRST_PLACE)
                    .bind::<BigInt, _>(id)
                    .bind::<BigInt, _>(after)
                    .bind::<BigInt, _>(id)
                    .bind::<Text, _>(holder)
                    .load::<FirstPlace>(c)
            },
            |c, w| grant_row(c, id, holder, w),
            |c| {
                stmt(shared::ROW_RELEASE)
                    .bind::<BigInt, _>(id)
                    .bind::<Text, _>(holder)
                    .execute(c)
                    .map(|n| n == 1)
            },
        )
    }

    fn lease_release(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        let alone = stmt(LEASE_RELEASE_ALONE)
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .execute(self)?;
        if alone == 1 {
            return Ok(true);
        }
        self.lease_release_granted(key, holder, crate::backend::NO_PLACE)
    }

    fn lease_release_granted(&mut self, key: &str, holder: &str, _place: i64) -> QueryResult<bool> {
        // The hand-over is one statement, which locks the lease's row, then the place
        // (`LEASE_GRANT`), as the confirmation does.
        release_or_grant(
            self,
            |c, after| {
                stmt(LEASE_FIRST_PLACE)
                    .bind::<Text, _>(key)
                    .bind::<BigInt, _>(after)
                    .bind::<Text, _>(key)
                    .bind::<Text, _>(holder)
                    .load::<FirstPlace>(c)
            },
            |c, w| grant_lease(c, key, holder, w),
            |c| {
                stmt(LEASE_RELEASE_PLAIN)
                    .bind::<Text, _>(key)
                    .bind::<Text, _>(key)
                    .bind::<Text, _>(holder)
                    .execute(c)
                    .map(|n| n == 1)
            },
        )
    }

    fn row_confirm(
        &mut self,
        key: &str,
        place: i64,
        holder: &str,
        stale_us: Option<i64>,
    ) -> QueryResult<Option<Acquired>> {
        // One statement (one commit): the row's own `stale_at`, and the place lapsed (see
        // `confirmed_place!`); the row locked first, then the place, as the hand-over locks them.
        let n = stmt(concat!(
            "UPDATE dlock_rows r LEFT JOIN dlock_waiters w \
               ON w.id = ? AND w.lock_key = r.lock_key AND w.holder = r.holder \
             SET r.stale_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ",
            confirmed_place!(),
            " WHERE r.lock_key = ? AND r.holder = ? AND r.stale_at > UTC_TIMESTAMP(6)"
        ))
        .bind::<BigInt, _>(place)
        .bind::<Nullable<BigInt>, _>(stale_us)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .execute(self)?;
        // Rows matched (diesel sets CLIENT_FOUND_ROWS): the row's, and the place's if it
        // was still there.
        if n == 0 {
            return Ok(None);
        }
        let a = stmt(
            "SELECT id, token, acquired_at, CAST(0 AS SIGNED) AS ahead FROM dlock_rows \
             WHERE lock_key = ? AND holder = ?",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .get_result::<ReadBack>(self)
        .optional()?;
        Ok(a.map(ReadBack::acquired))
    }

    fn lease_confirm(
        &mut self,
        key: &str,
        place: i64,
        holder: &str,
        ttl_us: i64,
    ) -> QueryResult<Option<Acquired>> {
        // One statement (one commit): the lease's own expiry, and the place lapsed (see
        // `confirmed_place!`); the lease's row locked first, then the place, as the hand-over
        // locks them.
        let n = stmt(concat!(
            "UPDATE dlock_leases l LEFT JOIN dlock_waiters w \
               ON w.id = ? AND w.lock_key = l.lock_key AND w.holder = l.holder_id \
             SET l.expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ",
            confirmed_place!(),
            " WHERE l.lock_key = ? AND l.holder_id = ? AND l.expires_at > UTC_TIMESTAMP(6)"
        ))
        .bind::<BigInt, _>(place)
        .bind::<BigInt, _>(ttl_us)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .execute(self)?;
        // Rows matched: the lease's, and the place's if it was still there.
        if n == 0 {
            return Ok(None);
        }
        let a = stmt(
            "SELECT CAST(0 AS SIGNED) AS id, token, acquired_at, CAST(0 AS SIGNED) AS ahead \
             FROM dlock_leases WHERE lock_key = ? AND holder_id = ?",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .get_result::<ReadBack>(self)
        .optional()?;
        Ok(a.map(ReadBack::acquired))
    }

    fn row_acquire(
        &mut self,
        key: &str,
        owner: &str,
        holder: &str,
        stale_us: Option<i64>,
        retry: bool,
        place: i64,
    ) -> QueryResult<Option<Acquired>> {
        // A waiter first looks with a consistent (non-locking) read: every failed INSERT
        // takes a shared lock on the holder's index record, and a crowd of them is what
        // makes InnoDB deadlock when the holder deletes the row. It also does not INSERT
        // while a live place of the line is ahead of its own.
        if retry
            && exists(
                stmt(concat!(
                    "SELECT CAST(1 AS SIGNED) AS one FROM DUAL \
                     WHERE EXISTS (SELECT 1 FROM dlock_rows WHERE lock_key = ?) \
                        OR EXISTS (SELECT 1 FROM dlock_waiters WHERE lock_key = ? AND line = ",
                    line_sql!(row),
                    " AND id < ? \
                                   AND expires_at > UTC_TIMESTAMP(6) AND granted_at IS NULL)",
                ))
                .bind::<Text, _>(key)
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(place)
                .get_result::<One>(self)
                .optional(),
            )?
        {
            return Ok(None);
        }
        // A purge may delete the counter between the bump and the insert (the key is free,
        // and the purge raised the floor above the bump first): the insert then finds no
        // counter at this bump, and the bump is made again, from the floor.
        let mut bumps = 0;
        let (inserted, stamped) = loop {
            stmt(ROW_BUMP)
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(floor_bucket(key))
                .execute(self)?;
            let mut stamped = false;
            let inserted = match stmt(ROW_INSERT)
                .bind::<Text, _>(key)
                .bind::<Text, _>(owner)
                .bind::<Text, _>(holder)
                .bind::<Nullable<BigInt>, _>(stale_us)
                .bind::<Text, _>(key)
                .execute(self)
            {
                Err(e) if refused_for_the_old_trigger(&e) => {
                    stamped = true;
                    stmt(ROW_INSERT_STAMPED)
                        .bind::<Text, _>(key)
                        .bind::<Text, _>(owner)
                        .bind::<Text, _>(holder)
                        .bind::<Nullable<BigInt>, _>(stale_us)
                        .execute(self)?
                }
                other => other?,
            };
            bumps += 1;
            if inserted == 1 || bumps >= PURGE_RETRIES || counter_there(self, key)? {
                break (inserted, stamped);
            }
            log::debug!("lock {key:?}: its counter was purged between bump and insert; again");
        };
        if inserted != 1 {
            return Ok(None);
        }
        // Gone already means a stale takeover deleted it in between: not ours after all.
        let Some(row) = stmt(ROW_READ_BACK)
            .bind::<BigInt, _>(place)
            .get_result::<ReadBack>(self)
            .optional()?
        else {
            return Ok(None);
        };
        // The trigger-stamped insert ran where no trigger stamps (never a token of 0), or the
        // key was taken ahead of the line (the caller waits its turn): the row goes back.
        let bad_stamp = stamped && row.token == 0;
        if bad_stamp || row.ahead > 0 {
            give_back(self, key, |c| {
                stmt(shared::ROW_RELEASE)
                    .bind::<BigInt, _>(row.id)
                    .bind::<Text, _>(holder)
                    .execute(c)
                    .map(drop)
            })?;
            if bad_stamp {
                return Err(diesel::result::Error::QueryBuilderError(
                    "the Row insert was refused as if the old trigger were there, but no \
                     trigger stamped the token"
                        .into(),
                ));
            }
            return Ok(None);
        }
        leave_place(self, place);
        Ok(Some(row.acquired()))
    }

    fn row_forget(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        // Read, then delete by id, as row_delete_stale does, for the same lock order.
        let ours = stmt("SELECT id FROM dlock_rows WHERE lock_key = ? AND holder = ?")
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<Id>(self)
            .optional()?;
        let Some(Id { id }) = ours else {
            return Ok(false);
        };
        stmt("DELETE FROM dlock_rows WHERE id = ? AND holder = ?")
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(holder)
            .execute(self)
            .map(|n| n > 0)
    }

    fn row_delete_stale(&mut self, key: &str) -> QueryResult<bool> {
        // Find the stale row with a consistent (non-locking) read, then delete it by id.
        // A DELETE by key would lock the unique index before the primary key, the opposite
        // order of a holder's DELETE by id, and the two deadlock.
        let stale =
            stmt("SELECT id FROM dlock_rows WHERE lock_key = ? AND stale_at <= UTC_TIMESTAMP(6)")
                .bind::<Text, _>(key)
                .get_result::<Id>(self)
                .optional()?;
        let Some(Id { id }) = stale else {
            return Ok(false);
        };
        stmt("DELETE FROM dlock_rows WHERE id = ? AND stale_at <= UTC_TIMESTAMP(6)")
            .bind::<BigInt, _>(id)
            .execute(self)
            .map(|n| n > 0)
    }

    fn lease_acquire(
        &mut self,
        key: &str,
        owner: &str,
        holder: &str,
        ttl_us: i64,
        retry: bool,
        place: i64,
    ) -> QueryResult<Option<Acquired>> {
        if retry && lease_visibly_held(self, key, place)? {
            return Ok(None);
        }
        stmt(LEASE_UPSERT)
            .bind::<Text, _>(key)
            .bind::<Text, _>(owner)
            .bind::<Text, _>(holder)
            .bind::<Text, _>(key)
            .bind::<BigInt, _>(ttl_us)
            .bind::<BigInt, _>(floor_bucket(key))
            .execute(self)?;
        let Some(lease) = stmt(LEASE_READ_BACK)
            .bind::<BigInt, _>(place)
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<ReadBack>(self)
            .optional()?
        else {
            return Ok(None);
        };
        if lease.ahead > 0 {
            // Taken ahead of the line: given back at once, as for a row.
            give_back(self, key, |c| c.lease_release(key, holder).map(drop))?;
            return Ok(None);
        }
        leave_place(self, place);
        Ok(Some(lease.acquired()))
    }

    fn lease_renew(
        &mut self,
        key: &str,
        holder: &str,
        ttl_us: i64,
        bound: std::time::Duration,
    ) -> QueryResult<bool> {
        // innodb_lock_wait_timeout counts whole seconds, 1 to 100,000,000. The session's own
        // setting is put back, as the connection goes back to the pool.
        let seconds = bound.as_secs() + u64::from(bound.subsec_nanos() > 0);
        with_lock_wait_timeout(self, seconds, |c| {
            // diesel sets CLIENT_FOUND_ROWS, so the count is of matched rows.
            stmt(
                "UPDATE dlock_leases SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
                 WHERE lock_key = ? AND holder_id = ? AND expires_at > UTC_TIMESTAMP(6)",
            )
            .bind::<BigInt, _>(ttl_us)
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .execute(c)
            .map(|n| n == 1)
        })
    }

    fn lease_renew_many(
        &mut self,
        leases: &[(String, String)],
        ttl_us: i64,
    ) -> QueryResult<Vec<String>> {
        // No UPDATE … RETURNING on MariaDB: the rows are locked first by a read that skips
        // those another session holds (a stuck key must not hold up the batch: an UPDATE
        // would wait on it), then exactly those are renewed. READ COMMITTED: no gap locks.
        // Holder ids are 128 random bits: the pair of lists matches exactly our leases.
        // The transaction holds up to 500 rows' locks across its statements: bounded on the
        // server as an acquisition's (a heartbeat stopped between them must not keep those
        // keys from everyone; its renewal is then rolled back and told late, so lost).
        with_transaction_bounds(self, stall_bound(ttl_us), None, |c| {
            super::holders::read_committed(c)?;
            c.transaction(|c| renew_leases_locked(c, leases, ttl_us))
        })
    }

    fn lease_held(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        exists(
            stmt(
                "SELECT CAST(1 AS SIGNED) AS one FROM dlock_leases \
                 WHERE lock_key = ? AND holder_id = ? AND expires_at > UTC_TIMESTAMP(6)",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<One>(self)
            .optional(),
        )
    }
}

/// A plain consistent read: is the lease held and unexpired right now (exclusively, or by
/// readers or permits), or others ahead of `place` in the key's line?
fn lease_visibly_held(conn: &mut MysqlConnection, key: &str, place: i64) -> QueryResult<bool> {
    exists(
        stmt(concat!(
            "SELECT CAST(1 AS SIGNED) AS one FROM DUAL \
             WHERE EXISTS (SELECT 1 FROM dlock_leases WHERE lock_key = ? \
                           AND (holder_id IS NOT NULL AND expires_at > UTC_TIMESTAMP(6) \
                                OR shared_until > UTC_TIMESTAMP(6))) \
                OR EXISTS (SELECT 1 FROM dlock_waiters WHERE lock_key = ? AND line = ",
            line_sql!(lease),
            " AND id < ? \
                           AND expires_at > UTC_TIMESTAMP(6) AND granted_at IS NULL)",
        ))
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(place)
        .get_result::<One>(conn)
        .optional(),
    )
}

/// `lease_renew_many`'s transaction: the leases' rows locked (skipping those another session
/// holds), exactly those renewed; their holder ids.
fn renew_leases_locked(
    c: &mut MysqlConnection,
    leases: &[(String, String)],
    ttl_us: i64,
) -> QueryResult<Vec<String>> {
    static LOCK: [OnceLock<String>; BATCH_SIZES.len()] =
        [const { OnceLock::new() }; BATCH_SIZES.len()];
    static RENEW: [OnceLock<String>; BATCH_SIZES.len()] =
        [const { OnceLock::new() }; BATCH_SIZES.len()];
    let (keys, holders): (Vec<String>, Vec<String>) = pad(leases.to_vec()).into_iter().unzip();
    let lock = in_list(
        &LOCK,
        "SELECT lock_key, holder_id FROM dlock_leases \
             WHERE lock_key IN ({}) AND holder_id IN ({}) \
               AND expires_at > UTC_TIMESTAMP(6) \
             FOR UPDATE SKIP LOCKED",
        keys.len(),
    );
    let locked = stmt(lock)
        .bind_many::<Text, _>(keys)
        .bind_many::<Text, _>(holders)
        .load::<KeyHolder>(c)?;
    if locked.is_empty() {
        return Ok(Vec::new());
    }
    #[cfg(feature = "test-hooks")]
    for r in &locked {
        crate::hooks::in_renew_batch(&r.lock_key);
    }
    let keys = pad(locked.iter().map(|r| r.lock_key.clone()).collect());
    let renew = in_list(
        &RENEW,
        "UPDATE dlock_leases SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
             WHERE lock_key IN ({})",
        keys.len(),
    );
    stmt(renew)
        .bind::<BigInt, _>(ttl_us)
        .bind_many::<Text, _>(keys)
        .execute(c)?;
    Ok(locked.into_iter().map(|r| r.holder_id).collect())
}
