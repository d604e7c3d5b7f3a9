//! MySQL's statements of shared leases and semaphore permits (see `backend/holders.rs`).
//!
//! The acquisition's transaction runs at READ COMMITTED: its locking reads then lock only
//! the rows they match, not the gaps beside them, so acquisitions of neighbouring keys do
//! not deadlock over the gap between their holder rows. Counting is a locking read too
//! (`FOR UPDATE`), which sees the newest committed rows, not the transaction's snapshot.

use super::{
    contention, with_lock_wait_setting, with_lock_wait_timeout, with_transaction_bounds,
    AcquiredRow,
};
use crate::backend::holders::HolderSteps;
use crate::backend::holders::{
    self, Header, HolderAnswer, HolderAsk, HolderLocks, HolderRow, Release,
};
use crate::backend::shared::{exists, HolderId, KeyHolder, One};
use crate::backend::stmt::{batch_size, in_list, in_pairs, pad, stmt, BATCH_SIZES};
use crate::backend::Acquired;
use chrono::NaiveDateTime;
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Datetime, Nullable, Text};
use diesel::{Connection, OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};
use std::collections::HashSet;
use std::sync::OnceLock;

holders::holder_row!(Datetime, NaiveDateTime, |t| t.and_utc());

/// A lease row's key (a batch renewal's locked rows).
#[derive(QueryableByName)]
struct LockKey {
    #[diesel(sql_type = Text)]
    lock_key: String,
}

/// `pairs` (keys and holder ids, flattened) padded to a batch size of pairs by repeating
/// the last pair.
fn pad_pairs(pairs: Vec<String>) -> Vec<String> {
    let n = pairs.len() / 2;
    let mut out = pairs;
    let last = [out[out.len() - 2].clone(), out[out.len() - 1].clone()];
    for _ in n..batch_size(n) {
        out.extend(last.iter().cloned());
    }
    out
}

/// How many expired holder rows a purge reads at a time, and deletes in one statement at
/// most (on MariaDB; one at a time on MySQL, see `holders_purge`).
const PURGE_CHUNK: usize = 500;

/// The holder rows expired `idle_us` ago, deleted in autocommit statements of at most
/// `most` rows each, in key order; rows that another transaction holds are left and not
/// counted. The rows are read a page at a time (a plain read, which locks nothing), from
/// after the last row of the page before.
fn purge_expired(c: &mut MysqlConnection, idle_us: i64, most: usize) -> QueryResult<usize> {
    let mut deleted = 0;
    let mut after: Option<KeyHolder> = None;
    loop {
        let page = match &after {
            None => stmt(
                "SELECT lock_key, holder_id FROM dlock_shared_leases \
                 WHERE expires_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
                 ORDER BY lock_key, holder_id LIMIT ?",
            )
            .bind::<BigInt, _>(idle_us)
            .bind::<BigInt, _>(PURGE_CHUNK as i64)
            .load::<KeyHolder>(c)?,
            Some(last) => stmt(
                "SELECT lock_key, holder_id FROM dlock_shared_leases \
                 WHERE (lock_key > ? OR (lock_key = ? AND holder_id > ?)) \
                   AND expires_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
                 ORDER BY lock_key, holder_id LIMIT ?",
            )
            .bind::<Text, _>(&last.lock_key)
            .bind::<Text, _>(&last.lock_key)
            .bind::<Text, _>(&last.holder_id)
            .bind::<BigInt, _>(idle_us)
            .bind::<BigInt, _>(PURGE_CHUNK as i64)
            .load::<KeyHolder>(c)?,
        };
        for rows in page.chunks(most) {
            deleted += delete_expired(c, rows, idle_us)?;
        }
        if page.len() < PURGE_CHUNK {
            return Ok(deleted);
        }
        after = page.into_iter().last();
    }
}

/// Deletes those of `rows` still expired `idle_us` ago (the expiry is checked again: a row
/// that no longer is, whatever changed it since the read, stays), in one statement; if it meets a row another transaction holds (the lock wait is 0 on
/// MariaDB, 1 s on MySQL), in two halves, down to single rows, of which a held one is left.
fn delete_expired(c: &mut MysqlConnection, rows: &[KeyHolder], idle_us: i64) -> QueryResult<usize> {
    static DELETE: [OnceLock<String>; BATCH_SIZES.len()] =
        [const { OnceLock::new() }; BATCH_SIZES.len()];
    let done = match rows {
        [] => return Ok(0),
        [row] => stmt(
            "DELETE FROM dlock_shared_leases WHERE lock_key = ? AND holder_id = ? \
               AND expires_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
        )
        .bind::<Text, _>(&row.lock_key)
        .bind::<Text, _>(&row.holder_id)
        .bind::<BigInt, _>(idle_us)
        .execute(c),
        _ => {
            let pairs = pad_pairs(
                rows.iter()
                    .flat_map(|r| [r.lock_key.clone(), r.holder_id.clone()])
                    .collect(),
            );
            let delete = in_pairs(
                &DELETE,
                "DELETE FROM dlock_shared_leases WHERE (lock_key, holder_id) IN ({}) \
                   AND expires_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
                pairs.len() / 2,
            );
            stmt(delete)
                .bind_many::<Text, _>(pairs)
                .bind::<BigInt, _>(idle_us)
                .execute(c)
        }
    };
    match done {
        Err(e) if contention(&e) => match rows.len() {
            1 => Ok(0),
            n => {
                let (first, second) = rows.split_at(n / 2);
                Ok(delete_expired(c, first, idle_us)? + delete_expired(c, second, idle_us)?)
            }
        },
        done => done,
    }
}

/// For the next transaction only: READ COMMITTED, so that locking reads lock only the rows
/// they match (no gap locks between neighbouring keys) and plain reads see the newest
/// committed rows.
pub(super) fn read_committed(c: &mut MysqlConnection) -> QueryResult<()> {
    stmt("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(c)
        .map(drop)
}

#[derive(QueryableByName)]
struct Counts {
    #[diesel(sql_type = BigInt)]
    total: i64,
    #[diesel(sql_type = BigInt)]
    writers: i64,
}

impl HolderSteps for MysqlConnection {
    fn create_lease(&mut self, key: &str) -> QueryResult<()> {
        // The row's counter starts at the token floor (a locking read: `mysql_floor_read!`),
        // or at a counter a `Row` lock or an older version's purge left (the subquery of an
        // INSERT … SELECT is a locking read too at REPEATABLE READ).
        stmt(concat!(
            "INSERT IGNORE INTO dlock_leases (lock_key, token, acquired_at) \
             SELECT ?, GREATEST(f.floor_token, \
                                COALESCE((SELECT t.token FROM dlock_tokens t WHERE t.lock_key = ?), 0)), \
                    UTC_TIMESTAMP(6) ",
            mysql_floor_read!()
        ))
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(crate::key::floor_bucket(key))
        .execute(self)
        .map(drop)
    }

    fn create_header(&mut self, key: &str, permits: i64) -> QueryResult<()> {
        stmt(
            "INSERT IGNORE INTO dlock_shared_keys (lock_key, permit_count, token) VALUES (?, ?, 0)",
        )
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(permits)
        .execute(self)
        .map(drop)
    }

    fn lock_lease(&mut self, key: &str) -> QueryResult<Option<bool>> {
        stmt(
            "SELECT CAST(COALESCE(holder_id IS NOT NULL AND expires_at > UTC_TIMESTAMP(6), 0) \
                         AS SIGNED) AS one \
             FROM dlock_leases WHERE lock_key = ? FOR UPDATE",
        )
        .bind::<Text, _>(key)
        .get_result::<One>(self)
        .optional()
        .map(|r| r.map(|r| r.one == 1))
    }

    fn lock_header(&mut self, key: &str) -> QueryResult<Option<Header>> {
        stmt(
            "SELECT CAST(permit_count AS SIGNED) AS one FROM dlock_shared_keys \
             WHERE lock_key = ? FOR UPDATE",
        )
        .bind::<Text, _>(key)
        .get_result::<One>(self)
        .optional()
        .map(|r| r.map(|r| Header { permits: r.one }))
    }

    fn expire(&mut self, key: &str) -> QueryResult<()> {
        // Only the expired rows nobody else holds (a purge's, a stopped client's), locked
        // first, then deleted one by one (few: a key's dead holders since its last
        // acquisition): a DELETE of them all waited for a held one with the key's lease row
        // locked, and its live holders' renewals out.
        let expired = stmt(
            "SELECT holder_id FROM dlock_shared_leases \
             WHERE lock_key = ? AND expires_at <= UTC_TIMESTAMP(6) FOR UPDATE SKIP LOCKED",
        )
        .bind::<Text, _>(key)
        .load::<HolderId>(self)?;
        for row in expired {
            stmt("DELETE FROM dlock_shared_leases WHERE lock_key = ? AND holder_id = ?")
                .bind::<Text, _>(key)
                .bind::<Text, _>(&row.holder_id)
                .execute(self)?;
        }
        Ok(())
    }

    fn count(&mut self, key: &str) -> QueryResult<(i64, i64)> {
        // A plain read at READ COMMITTED (`read_committed`): the newest committed rows.
        // Every writer of the key's holders but a purge (of expired rows only) holds the
        // key's lease row, locked here since `lock_lease`, so none is under way; a locking
        // read would wait for an expired row `expire` left, held by another session. Such a
        // row is counted (`HolderSteps::count`).
        stmt(
            "SELECT CAST(COUNT(*) AS SIGNED) AS total, \
                    CAST(COALESCE(SUM(mode = 'write'), 0) AS SIGNED) AS writers \
             FROM dlock_shared_leases WHERE lock_key = ?",
        )
        .bind::<Text, _>(key)
        .get_result::<Counts>(self)
        .map(|c| (c.total, c.writers))
    }

    fn insert(&mut self, ask: &HolderAsk<'_>) -> QueryResult<Acquired> {
        // The lease row is ours until the commit: the holder row takes the key's next token
        // from it, then the lease row takes that token and the holder's expiry (one instant,
        // written once, so that `shared_until` is never short of it).
        stmt(concat!(
            "INSERT INTO dlock_shared_leases \
                    (lock_key, holder_id, owner, mode, token, acquired_at, expires_at) \
             SELECT ?, ?, ?, ?, GREATEST(token + 1, ",
            mysql_floor!(),
            "), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
             FROM dlock_leases WHERE lock_key = ?"
        ))
        .bind::<Text, _>(ask.key)
        .bind::<Text, _>(ask.holder)
        .bind::<Text, _>(ask.owner)
        .bind::<Text, _>(ask.mode.as_str())
        .bind::<BigInt, _>(ask.ttl_us)
        .bind::<Text, _>(ask.key)
        .execute(self)?;
        stmt(
            "UPDATE dlock_leases l JOIN dlock_shared_leases s \
                    ON s.lock_key = l.lock_key AND s.holder_id = ? \
             SET l.token = s.token, \
                 l.shared_until = IF(l.shared_until IS NULL OR l.shared_until < s.expires_at, \
                                     s.expires_at, l.shared_until) \
             WHERE l.lock_key = ?",
        )
        .bind::<Text, _>(ask.holder)
        .bind::<Text, _>(ask.key)
        .execute(self)?;
        stmt(
            "SELECT CAST(0 AS SIGNED) AS id, token, acquired_at FROM dlock_shared_leases \
             WHERE lock_key = ? AND holder_id = ?",
        )
        .bind::<Text, _>(ask.key)
        .bind::<Text, _>(ask.holder)
        .get_result::<AcquiredRow>(self)
        .map(Into::into)
    }
}

impl HolderLocks for MysqlConnection {
    fn holders_purge(&mut self, idle_us: i64) -> QueryResult<usize> {
        // The expired rows are read without locking any, then deleted by primary key in
        // statements of their own that never wait for a row lock: a statement that meets a
        // row another transaction holds (a stopped holder's, an acquisition's) is refused at
        // once and tried again in halves, and a held row is left for the next purge. One
        // DELETE of them all waited for such a row with the dead holders' rows it had
        // matched before it locked; an acquisition of their key waited for those in its
        // `expire` step with the key's lease row locked, and the key's live readers, whose
        // renewals lock that row first, lost their leases (`tests/purge.rs`).
        //
        // MySQL proper takes no `innodb_lock_wait_timeout` below 1 s: there the purge waits
        // up to a second for a held row, one row per statement, so that no other row is
        // kept locked meanwhile. The server's version tells them apart (as `GET_LOCK`'s
        // timeout in `sessions.rs`), once per purge.
        let mariadb = stmt("SELECT CAST(VERSION() LIKE '%MariaDB%' AS SIGNED) AS one")
            .get_result::<One>(self)?
            .one
            == 1;
        let (wait, most) = if mariadb { (0, PURGE_CHUNK) } else { (1, 1) };
        with_lock_wait_setting(self, wait, |c| purge_expired(c, idle_us, most))
    }

    fn holders_acquire(&mut self, ask: &HolderAsk<'_>) -> QueryResult<HolderAnswer> {
        let idle = holders::stall_bound(ask.ttl_us);
        holders::acquire_with(self, ask, |c, ask| {
            with_transaction_bounds(c, idle, Some(holders::ROW_WAIT), |c| {
                read_committed(c)?;
                c.transaction(|c| holders::decide(c, ask))
            })
        })
    }

    fn holders_renew(
        &mut self,
        key: &str,
        holder: &str,
        ttl_us: i64,
        bound: std::time::Duration,
    ) -> QueryResult<bool> {
        let seconds = bound.as_secs() + u64::from(bound.subsec_nanos() > 0);
        with_lock_wait_timeout(self, seconds, |c| {
            read_committed(c)?;
            // The lease row first (as every writer of the key's holders), raised to the
            // holder's new expiry only if the holder row is live; then the holder row, to
            // the same instant (`@dlock_until`).
            c.transaction(|c| {
                stmt("SET @dlock_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND")
                    .bind::<BigInt, _>(ttl_us)
                    .execute(c)?;
                // diesel sets CLIENT_FOUND_ROWS, so the counts are of matched rows. Without
                // its lease row the holder no longer keeps the exclusive lock out: lost.
                let lease = stmt(
                    "UPDATE dlock_leases \
                     SET shared_until = IF(shared_until IS NULL OR shared_until < @dlock_until, \
                                           @dlock_until, shared_until) \
                     WHERE lock_key = ? AND EXISTS (SELECT 1 FROM dlock_shared_leases \
                         WHERE lock_key = ? AND holder_id = ? AND expires_at > UTC_TIMESTAMP(6))",
                )
                .bind::<Text, _>(key)
                .bind::<Text, _>(key)
                .bind::<Text, _>(holder)
                .execute(c)?;
                if lease == 0 {
                    return Ok(false);
                }
                stmt(
                    "UPDATE dlock_shared_leases SET expires_at = @dlock_until \
                     WHERE lock_key = ? AND holder_id = ? AND expires_at > UTC_TIMESTAMP(6)",
                )
                .bind::<Text, _>(key)
                .bind::<Text, _>(holder)
                .execute(c)
                .map(|n| n == 1)
            })
        })
    }

    fn holders_renew_many(
        &mut self,
        holders: &[(String, String)],
        ttl_us: i64,
    ) -> QueryResult<Vec<String>> {
        static LEASES: [OnceLock<String>; BATCH_SIZES.len()] =
            [const { OnceLock::new() }; BATCH_SIZES.len()];
        static LOCK: [OnceLock<String>; BATCH_SIZES.len()] =
            [const { OnceLock::new() }; BATCH_SIZES.len()];
        static RENEW: [OnceLock<String>; BATCH_SIZES.len()] =
            [const { OnceLock::new() }; BATCH_SIZES.len()];
        static RAISE: [OnceLock<String>; BATCH_SIZES.len()] =
            [const { OnceLock::new() }; BATCH_SIZES.len()];
        // As `holders_renew`, for many: the lease rows first (as every writer of the key's
        // holders), then the live holder rows of the keys locked, each by a locking read
        // that skips the rows another session holds (a stuck key must not hold up the
        // batch: an UPDATE would wait on it); then exactly the holder rows locked are
        // extended, and their keys' `shared_until` raised, to the same instant. Bounded on
        // the server as an acquisition's: the transaction holds up to 500 keys' rows locked
        // across its statements, and a heartbeat stopped among them must not keep those keys
        // from everyone.
        with_transaction_bounds(self, holders::stall_bound(ttl_us), None, |c| {
            read_committed(c)?;
            c.transaction(|c| {
                let mut keys: Vec<String> = holders.iter().map(|(k, _)| k.clone()).collect();
                keys.sort_unstable();
                keys.dedup();
                let keys = pad(keys);
                let lock = in_list(
                    &LEASES,
                    "SELECT lock_key FROM dlock_leases WHERE lock_key IN ({}) \
                 FOR UPDATE SKIP LOCKED",
                    keys.len(),
                );
                let locked: HashSet<String> = stmt(lock)
                    .bind_many::<Text, _>(keys)
                    .load::<LockKey>(c)?
                    .into_iter()
                    .map(|r| r.lock_key)
                    .collect();
                let pairs: Vec<String> = holders
                    .iter()
                    .filter(|(k, _)| locked.contains(k))
                    .flat_map(|(k, h)| [k.clone(), h.clone()])
                    .collect();
                if pairs.is_empty() {
                    return Ok(Vec::new());
                }
                let pairs = pad_pairs(pairs);
                let lock = in_pairs(
                    &LOCK,
                    "SELECT lock_key, holder_id FROM dlock_shared_leases \
                 WHERE (lock_key, holder_id) IN ({}) AND expires_at > UTC_TIMESTAMP(6) \
                 FOR UPDATE SKIP LOCKED",
                    pairs.len() / 2,
                );
                let rows = stmt(lock)
                    .bind_many::<Text, _>(pairs)
                    .load::<KeyHolder>(c)?;
                if rows.is_empty() {
                    return Ok(Vec::new());
                }
                stmt("SET @dlock_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND")
                    .bind::<BigInt, _>(ttl_us)
                    .execute(c)?;
                let pairs = pad_pairs(
                    rows.iter()
                        .flat_map(|r| [r.lock_key.clone(), r.holder_id.clone()])
                        .collect(),
                );
                let renew = in_pairs(
                    &RENEW,
                    "UPDATE dlock_shared_leases SET expires_at = @dlock_until \
                 WHERE (lock_key, holder_id) IN ({})",
                    pairs.len() / 2,
                );
                stmt(renew).bind_many::<Text, _>(pairs).execute(c)?;
                let mut keys: Vec<String> = rows.iter().map(|r| r.lock_key.clone()).collect();
                keys.sort_unstable();
                keys.dedup();
                let keys = pad(keys);
                let raise = in_list(
                    &RAISE,
                    "UPDATE dlock_leases \
                 SET shared_until = IF(shared_until IS NULL OR shared_until < @dlock_until, \
                                       @dlock_until, shared_until) \
                 WHERE lock_key IN ({})",
                    keys.len(),
                );
                stmt(raise).bind_many::<Text, _>(keys).execute(c)?;
                Ok(rows.into_iter().map(|r| r.holder_id).collect())
            })
        })
    }

    fn holders_release(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        // The lease row first: with it locked no holder of the key is added or renewed, and
        // at READ COMMITTED the subquery reads the newest committed holders. The holder's
        // row is deleted unless another session holds it (`SKIP LOCKED`); a plain read then
        // tells such a row from one that is gone.
        holders::release_with(
            self,
            key,
            |c| {
                release_transaction(c, |c| {
                    stmt(
                        "SELECT CAST(1 AS SIGNED) AS one FROM dlock_leases \
                             WHERE lock_key = ? FOR UPDATE",
                    )
                    .bind::<Text, _>(key)
                    .get_result::<One>(c)
                    .optional()?;
                    let mine = stmt(
                        "SELECT CAST(1 AS SIGNED) AS one FROM dlock_shared_leases \
                             WHERE lock_key = ? AND holder_id = ? FOR UPDATE SKIP LOCKED",
                    )
                    .bind::<Text, _>(key)
                    .bind::<Text, _>(holder)
                    .get_result::<One>(c)
                    .optional()?;
                    if mine.is_none() {
                        let present = exists(
                            stmt(
                                "SELECT CAST(1 AS SIGNED) AS one FROM dlock_shared_leases \
                                     WHERE lock_key = ? AND holder_id = ?",
                            )
                            .bind::<Text, _>(key)
                            .bind::<Text, _>(holder)
                            .get_result::<One>(c)
                            .optional(),
                        )?;
                        return Ok(if present {
                            Release::Held
                        } else {
                            Release::Done(false)
                        });
                    }
                    stmt("DELETE FROM dlock_shared_leases WHERE lock_key = ? AND holder_id = ?")
                        .bind::<Text, _>(key)
                        .bind::<Text, _>(holder)
                        .execute(c)?;
                    stmt(
                        "UPDATE dlock_leases SET shared_until = \
                               (SELECT MAX(expires_at) FROM dlock_shared_leases \
                                WHERE lock_key = ? AND expires_at > UTC_TIMESTAMP(6)) \
                             WHERE lock_key = ?",
                    )
                    .bind::<Text, _>(key)
                    .bind::<Text, _>(key)
                    .execute(c)?;
                    Ok(Release::Done(true))
                })
            },
            |c| {
                release_transaction(c, |c| {
                    stmt(
                        "SELECT CAST(1 AS SIGNED) AS one FROM dlock_shared_leases \
                             WHERE lock_key = ? AND holder_id = ? FOR UPDATE",
                    )
                    .bind::<Text, _>(key)
                    .bind::<Text, _>(holder)
                    .get_result::<One>(c)
                    .optional()
                    .map(drop)
                })
            },
        )
    }

    fn holders_held(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        exists(
            stmt(
                "SELECT CAST(1 AS SIGNED) AS one FROM dlock_shared_leases \
                 WHERE lock_key = ? AND holder_id = ? AND expires_at > UTC_TIMESTAMP(6)",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<One>(self)
            .optional(),
        )
    }

    fn admin_holders(&mut self, key: Option<&str>) -> QueryResult<Vec<HolderRow>> {
        let rows = stmt(
            "SELECT CAST(l.lock_key AS CHAR) AS lock_key, l.holder_id AS holder, l.owner, l.mode, \
                    k.permit_count AS permits, l.token, l.acquired_at, l.expires_at, \
                    UTC_TIMESTAMP(6) AS observed_at \
             FROM dlock_shared_leases l JOIN dlock_shared_keys k ON k.lock_key = l.lock_key \
             WHERE l.expires_at > UTC_TIMESTAMP(6) AND (? IS NULL OR l.lock_key = ?) \
             ORDER BY l.lock_key, l.token",
        )
        .bind::<Nullable<Text>, _>(key)
        .bind::<Nullable<Text>, _>(key)
        .load(self);
        holder_rows(rows)
    }
}

/// A transaction of a release (`HolderLocks::holders_release`): at READ COMMITTED, idle at
/// most `STALL_CAP`.
fn release_transaction<T>(
    c: &mut MysqlConnection,
    f: impl FnOnce(&mut MysqlConnection) -> QueryResult<T>,
) -> QueryResult<T> {
    with_transaction_bounds(c, holders::STALL_CAP, None, |c| {
        read_committed(c)?;
        c.transaction(f)
    })
}
