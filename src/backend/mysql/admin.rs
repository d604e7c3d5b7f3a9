//! MySQL's admin reads, force release, purge and optimistic versions.

use crate::backend::holders::STALL_CAP;
use crate::backend::sealed::Admin;
use crate::backend::shared;
use crate::backend::shared::{Key, One};
use crate::backend::stmt::stmt;
use crate::backend::{force_release_in, Held, PurgeTable, PURGE_BATCH};
use crate::lock_info::LockInfo;
use chrono::NaiveDateTime;
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Datetime, Nullable, Text};
use diesel::Connection;
use diesel::OptionalExtension;
use diesel::{QueryResult, RunQueryDsl};

shared::held_row!(Datetime, NaiveDateTime, |t| t.and_utc());

impl Admin for MysqlConnection {
    shared::statements!(version_read, version_bump);

    fn version_create(&mut self, key: &str) -> QueryResult<()> {
        stmt("INSERT IGNORE INTO dlock_versions (lock_key, version) VALUES (?, 0)")
            .bind::<Text, _>(key)
            .execute(self)
            .map(drop)
    }

    // Keys are VARBINARY (byte-exact comparison); CAST(... AS CHAR) reads them back as text
    // in the connection's character set (utf8mb4, set by diesel). No FOR UPDATE here: a
    // locking read by key takes the unique index before the primary key, the opposite order
    // of a holder's DELETE by id, and the two can deadlock. force_release removes by row id
    // and holder id anyway, so it reports only what it really removed.
    fn admin_rows(&mut self, key: Option<&str>) -> QueryResult<Vec<Held>> {
        let rows = match key {
            None => stmt(
                "SELECT id, COALESCE(holder, '') AS holder, CAST(lock_key AS CHAR) AS lock_key, \
                        owner, token, acquired_at, CAST(NULL AS DATETIME(6)) AS expires_at, \
                        UTC_TIMESTAMP(6) AS observed_at \
                 FROM dlock_rows ORDER BY lock_key",
            )
            .load(self),
            Some(key) => stmt(
                "SELECT id, COALESCE(holder, '') AS holder, CAST(lock_key AS CHAR) AS lock_key, \
                        owner, token, acquired_at, CAST(NULL AS DATETIME(6)) AS expires_at, \
                        UTC_TIMESTAMP(6) AS observed_at \
                 FROM dlock_rows WHERE lock_key = ?",
            )
            .bind::<Text, _>(key)
            .load(self),
        };
        held(rows, crate::lock_info::StrategyKind::Row)
    }

    fn admin_leases(&mut self, key: Option<&str>) -> QueryResult<Vec<Held>> {
        let rows = match key {
            None => stmt(
                "SELECT CAST(0 AS SIGNED) AS id, holder_id AS holder, CAST(lock_key AS CHAR) AS lock_key, \
                        COALESCE(owner, '') AS owner, token, acquired_at, expires_at, \
                        UTC_TIMESTAMP(6) AS observed_at \
                 FROM dlock_leases \
                 WHERE holder_id IS NOT NULL AND holder_id <> '' AND acquired_at IS NOT NULL \
                   AND expires_at > UTC_TIMESTAMP(6) \
                 ORDER BY lock_key",
            )
            .load(self),
            Some(key) => stmt(
                "SELECT CAST(0 AS SIGNED) AS id, holder_id AS holder, CAST(lock_key AS CHAR) AS lock_key, \
                        COALESCE(owner, '') AS owner, token, acquired_at, expires_at, \
                        UTC_TIMESTAMP(6) AS observed_at \
                 FROM dlock_leases \
                 WHERE lock_key = ? AND holder_id IS NOT NULL AND holder_id <> '' AND acquired_at IS NOT NULL \
                   AND expires_at > UTC_TIMESTAMP(6)",
            )
            .bind::<Text, _>(key)
            .load(self),
        };
        held(rows, crate::lock_info::StrategyKind::Lease)
    }

    fn admin_force_release(&mut self, key: &str) -> QueryResult<Vec<LockInfo>> {
        // Bounded as the holders' transactions are: a stopped admin must not stall the key.
        super::with_transaction_bounds(self, crate::backend::holders::STALL_CAP, None, |c| {
            c.transaction(|c| force_release_in(c, key))
        })
    }

    fn purge_stale_rows(&mut self) -> QueryResult<usize> {
        // These statements scan whole tables. Under REPEATABLE READ InnoDB would keep every
        // scanned row locked until the end and block acquisitions meanwhile; READ COMMITTED
        // lets go of the rows that do not match. (Without GLOBAL or SESSION, SET TRANSACTION
        // applies to the next transaction only, so the pooled connection keeps its level.)
        stmt("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(self)?;
        stmt("DELETE FROM dlock_rows WHERE stale_at <= UTC_TIMESTAMP(6)").execute(self)
    }

    fn purge_begin(&mut self) -> QueryResult<()> {
        // One purge at a time: a raise of the floor waits for the acquisitions that read it
        // (shared locks), and one of those may wait for a counter or lease row that another
        // purge's batch has locked, while that batch waits for an acquisition queued behind
        // the raise: a deadlock whose victim could be the acquisition. Within one purge the
        // raise and the batches never overlap. Session-scoped: a purger that dies frees it.
        stmt(concat!(
            "SELECT CAST(GET_LOCK(",
            super::per_database!("dlock_purge:"),
            ", 3600) AS SIGNED) AS one"
        ))
        .get_result::<One>(self)
        .and_then(|r| {
            if r.one == 1 {
                Ok(())
            } else {
                Err(diesel::result::Error::QueryBuilderError(
                    "another purge ran for an hour; not purging".into(),
                ))
            }
        })
    }

    fn purge_end(&mut self) -> QueryResult<()> {
        stmt(concat!(
            "DO RELEASE_LOCK(",
            super::per_database!("dlock_purge:"),
            ")"
        ))
        .execute(self)
        .map(drop)
    }

    fn purge_highest(&mut self) -> QueryResult<i64> {
        stmt(
            "SELECT GREATEST((SELECT COALESCE(MAX(token), 0) FROM dlock_tokens), \
                             (SELECT COALESCE(MAX(token), 0) FROM dlock_leases)) AS one",
        )
        .get_result::<One>(self)
        .map(|r| r.one)
    }

    fn floor_raise(&mut self, to: i64) -> QueryResult<()> {
        // Waits for the shared locks of acquisitions reading the floor (`mysql_floor_read!`),
        // which wait for it; it touches no other table, so no cycle.
        stmt("UPDATE dlock_token_floor SET floor_token = ? WHERE floor_token < ?")
            .bind::<BigInt, _>(to)
            .bind::<BigInt, _>(to)
            .execute(self)
            .map(drop)
    }

    fn purge_boundary(&mut self, table: PurgeTable, after: &str) -> QueryResult<Option<String>> {
        let text = match table {
            PurgeTable::Counters => shared::boundary!("dlock_tokens"),
            PurgeTable::Leases => shared::boundary!("dlock_leases"),
            PurgeTable::KeyRows => shared::boundary!("dlock_for_update"),
            PurgeTable::Kinds => shared::boundary!("dlock_shared_keys"),
        };
        stmt(text)
            .bind::<Text, _>(after)
            .bind::<BigInt, _>(PURGE_BATCH - 1)
            .get_result::<Key>(self)
            .optional()
            .map(|k| k.map(|k| k.lock_key))
    }

    fn purge_batch(
        &mut self,
        table: PurgeTable,
        after: &str,
        upto: Option<&str>,
        highest: i64,
        idle_us: i64,
    ) -> QueryResult<usize> {
        // READ COMMITTED for this batch's transaction: the subqueries are consistent reads
        // (no shared locks on the rows and gaps of the tables they read, which acquisitions
        // insert into), and the DELETE locks only the rows it deletes, each re-checked on
        // its newest version (a lease taken meanwhile, a counter bumped above `highest`).
        stmt("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(self)?;
        let range = |text| {
            stmt(text)
                .bind::<Text, _>(after)
                .bind::<Nullable<Text>, _>(upto)
                .bind::<Nullable<Text>, _>(upto)
        };
        match table {
            PurgeTable::Counters => range(
                "DELETE FROM dlock_tokens \
                 WHERE lock_key > ? AND (? IS NULL OR lock_key <= ?) AND token <= ? \
                   AND NOT EXISTS (SELECT 1 FROM dlock_rows r \
                                   WHERE r.lock_key = dlock_tokens.lock_key)",
            )
            .bind::<BigInt, _>(highest)
            .execute(self),
            // A multi-table DELETE: the key's kind goes with its lease row, the lease row
            // locked first (a LEFT JOIN reads it first), as every reader's and permit's
            // acquisition locks them (`holders.rs`), and only where no session strategy's
            // permit slots or row use it too. (MariaDB's subqueries here take shared locks
            // even at READ COMMITTED: each one locks rows of the key only after its lease row,
            // which is the order of every statement that writes them.)
            PurgeTable::Leases => range(concat!(
                "DELETE l, k FROM dlock_leases l \
                 LEFT JOIN dlock_shared_keys k ON k.lock_key = l.lock_key AND k.intent IS NULL \
                   AND NOT EXISTS (SELECT 1 FROM dlock_permit_slots p WHERE p.lock_key = l.lock_key) \
                   AND NOT EXISTS (SELECT 1 FROM dlock_for_update u WHERE u.lock_key = l.lock_key) \
                 WHERE l.lock_key > ? AND (? IS NULL OR l.lock_key <= ?) AND l.token <= ? \
                   AND ((l.holder_id IS NULL \
                         AND l.acquired_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) \
                        OR l.expires_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) \
                   AND (l.shared_until IS NULL \
                        OR l.shared_until <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) \
                   AND NOT EXISTS (SELECT 1 FROM dlock_waiters w \
                                   WHERE w.lock_key = l.lock_key AND w.line = ",
                line_sql!(lease),
                " AND w.expires_at > UTC_TIMESTAMP(6)) \
                   AND NOT EXISTS (SELECT 1 FROM dlock_shared_leases s \
                                   WHERE s.lock_key = l.lock_key \
                                     AND s.expires_at > UTC_TIMESTAMP(6))",
            ))
            .bind::<BigInt, _>(highest)
            .bind::<BigInt, _>(idle_us)
            .bind::<BigInt, _>(idle_us)
            .bind::<BigInt, _>(idle_us)
            .execute(self),
            // A DELETE over the range would wait for every holder's transaction (each keeps
            // its key row locked): the rows nobody holds are locked first by a read that
            // skips the others, then exactly those are deleted, in short transactions
            // (`purge_key_rows`). Only rows older than the grace (`idle_us`), as on
            // PostgreSQL. Each transaction holds the purge gate (`purge_gate!`, a named lock of the database's own)
            // from before it locks a row until it has committed: an acquisition that finds
            // its row locked tells a purge from a holder by it
            // (`SessionLocks::for_update_present`).
            PurgeTable::KeyRows => purge_key_rows(self, after, upto, idle_us),
            // The same, for reader-writer kinds without a live mark or anything else of
            // their key. The existence checks are plain reads (a subquery of a locking
            // statement would take shared locks, and wait for holders).
            // Bounded on the server: a purger stopped inside keeps the kinds it locked
            // (up to 1,000) at most `STALL_CAP`.
            PurgeTable::Kinds => super::with_transaction_bounds(self, STALL_CAP, None, |c| {
                c.transaction(|c| {
                let keys = range(
                    "SELECT lock_key FROM dlock_shared_keys \
                     WHERE lock_key > ? AND (? IS NULL OR lock_key <= ?) AND permit_count = 0 \
                       AND created_at <= CURRENT_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
                       AND (intent IS NULL OR intent_until IS NULL \
                            OR intent_until <= UTC_TIMESTAMP(6)) \
                     FOR UPDATE SKIP LOCKED",
                )
                .bind::<BigInt, _>(idle_us)
                .load::<Key>(c)?;
                let mut idle = Vec::with_capacity(keys.len());
                for k in keys {
                    let used = stmt(
                        "SELECT CAST(EXISTS (SELECT 1 FROM dlock_leases WHERE lock_key = ?) \
                                OR EXISTS (SELECT 1 FROM dlock_permit_slots WHERE lock_key = ?) \
                                OR EXISTS (SELECT 1 FROM dlock_for_update WHERE lock_key = ?) \
                                AS SIGNED) AS one",
                    )
                    .bind::<Text, _>(&k.lock_key)
                    .bind::<Text, _>(&k.lock_key)
                    .bind::<Text, _>(&k.lock_key)
                    .get_result::<One>(c)?
                    .one;
                    if used == 0 {
                        idle.push(k);
                    }
                }
                delete_keys(c, "DELETE FROM dlock_shared_keys WHERE lock_key = ?", idle)
                })
            }),
        }
    }
}

/// Deletes the rows of `keys` (locked by the caller's transaction) with `sql`, one key per
/// statement, found by the primary key: a list (`IN (…)`) may be run as a scan of the
/// table, whose DELETE waits for the row lock of every holder on the way (InnoDB reads only
/// an UPDATE's rows semi-consistently). The number deleted.
fn delete_keys(c: &mut MysqlConnection, sql: &'static str, keys: Vec<Key>) -> QueryResult<usize> {
    let mut deleted = 0;
    for k in keys {
        deleted += stmt(sql).bind::<Text, _>(k.lock_key).execute(c)?;
    }
    Ok(deleted)
}

/// How many key rows one transaction of a `ForUpdate` purge deletes on MySQL, one statement
/// each: an acquisition that finds a row of them locked waits for that transaction.
const KEY_ROWS_CHUNK: i64 = 100;

/// `purge_batch` of `KeyRows` on MySQL: in transactions of at most [`KEY_ROWS_CHUNK`]
/// rows, each holding the purge gate (`purge_gate!`) from before it locks a row until it
/// has committed, the rows of the range older than the grace that nobody has locked.
fn purge_key_rows(
    c: &mut MysqlConnection,
    after: &str,
    upto: Option<&str>,
    idle_us: i64,
) -> QueryResult<usize> {
    let mut from = after.to_owned();
    let mut deleted = 0;
    loop {
        let gate = stmt(concat!(
            "SELECT CAST(COALESCE(GET_LOCK(",
            super::purge_gate!(),
            ", 60), 0) AS SIGNED) AS one"
        ))
        .get_result::<One>(c)?;
        if gate.one != 1 {
            return Err(diesel::result::Error::QueryBuilderError(
                "the ForUpdate purge gate stayed taken for a minute".into(),
            ));
        }
        // READ COMMITTED (no gap locks, which would hold up inserts of new keys), set
        // again: the GET_LOCK above was the next transaction.
        // Bounded on the server: a purger stopped inside keeps the chunk's rows at most
        // `STALL_CAP` (the gate, a named lock, goes with its session).
        let chunk = super::with_transaction_bounds(c, STALL_CAP, None, |c| {
            stmt("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                .execute(c)
                .and_then(|_| {
                    c.transaction(|c| {
                        let keys = stmt(
                            "SELECT lock_key FROM dlock_for_update \
                         WHERE lock_key > ? AND (? IS NULL OR lock_key <= ?) \
                           AND created_at <= CURRENT_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
                         ORDER BY lock_key LIMIT ? FOR UPDATE SKIP LOCKED",
                        )
                        .bind::<Text, _>(&from)
                        .bind::<Nullable<Text>, _>(upto)
                        .bind::<Nullable<Text>, _>(upto)
                        .bind::<BigInt, _>(idle_us)
                        .bind::<BigInt, _>(KEY_ROWS_CHUNK)
                        .load::<Key>(c)?;
                        let last = keys.last().map(|k| k.lock_key.clone());
                        let full = keys.len() as i64 == KEY_ROWS_CHUNK;
                        let n = delete_keys(
                            c,
                            "DELETE FROM dlock_for_update WHERE lock_key = ?",
                            keys,
                        )?;
                        Ok((n, last.filter(|_| full)))
                    })
                })
        });
        let released = stmt(concat!("DO RELEASE_LOCK(", super::purge_gate!(), ")")).execute(c);
        let (n, next) = chunk?;
        released?;
        deleted += n;
        match next {
            Some(k) => from = k,
            None => return Ok(deleted),
        }
    }
}
