//! PostgreSQL's statements of shared leases and semaphore permits (see `backend/holders.rs`).
//! Times are `statement_timestamp()`: inside the acquisition's transaction, the time of each
//! statement, not of the transaction's start (which may have waited for the header's lock).

use super::{bound_transaction, lock_timeout_ms, AcquiredRow};
use crate::backend::holders::HolderSteps;
use crate::backend::holders::{
    self, Header, HolderAnswer, HolderAsk, HolderLocks, HolderRow, Release,
};
use crate::backend::shared::{exists, HolderId, One};
use crate::backend::stmt::stmt;
use crate::backend::Acquired;
use chrono::{DateTime, Utc};
use diesel::pg::PgConnection;
use diesel::sql_types::{Array, BigInt, Text, Timestamptz};
use diesel::{Connection, OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};

holders::holder_row!(Timestamptz, DateTime<Utc>, |t| t);

#[derive(QueryableByName)]
struct Released {
    #[diesel(sql_type = BigInt)]
    one: i64,
    #[diesel(sql_type = BigInt)]
    #[allow(dead_code)] // selected only so that `u` is read
    lowered: i64,
    #[diesel(sql_type = BigInt)]
    present: i64,
}

#[derive(QueryableByName)]
struct LeaseRow {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    exclusive: bool,
}

#[derive(QueryableByName)]
struct Counts {
    #[diesel(sql_type = BigInt)]
    total: i64,
    #[diesel(sql_type = BigInt)]
    writers: i64,
}

impl HolderSteps for PgConnection {
    crate::backend::shared::statements!(create_header);

    fn create_lease(&mut self, key: &str) -> QueryResult<()> {
        // The row's counter starts at the token floor (read locked, so the newest: see
        // `pg_floor!`), or at a counter a `Row` lock or an older version's purge left.
        stmt(concat!(
            "WITH ",
            pg_floor!("NOT EXISTS (SELECT 1 FROM dlock_leases WHERE lock_key = ?)"),
            " INSERT INTO dlock_leases (lock_key, token, acquired_at) \
             SELECT ?, GREATEST(f.floor_token, \
                               COALESCE((SELECT token FROM dlock_tokens WHERE lock_key = ?), 0)), \
                    statement_timestamp() FROM f \
             ON CONFLICT (lock_key) DO NOTHING"
        ))
        .bind::<BigInt, _>(crate::key::floor_bucket(key))
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .execute(self)
        .map(drop)
    }

    fn lock_lease(&mut self, key: &str) -> QueryResult<Option<bool>> {
        // A locking read returns the row's newest version, whatever the statement's snapshot.
        stmt(
            "SELECT COALESCE(holder_id IS NOT NULL AND expires_at > statement_timestamp(), false) \
                    AS exclusive \
             FROM dlock_leases WHERE lock_key = ? FOR UPDATE",
        )
        .bind::<Text, _>(key)
        .get_result::<LeaseRow>(self)
        .optional()
        .map(|r| r.map(|r| r.exclusive))
    }

    fn lock_header(&mut self, key: &str) -> QueryResult<Option<Header>> {
        stmt("SELECT permit_count AS one FROM dlock_shared_keys WHERE lock_key = ? FOR UPDATE")
            .bind::<Text, _>(key)
            .get_result::<One>(self)
            .optional()
            .map(|r| r.map(|r| Header { permits: r.one }))
    }

    fn expire(&mut self, key: &str) -> QueryResult<()> {
        // Only the expired rows nobody else holds (a purge's, a stopped client's): waiting
        // for one kept the key's lease row locked, and its live holders' renewals out.
        stmt(
            "WITH s AS MATERIALIZED (SELECT lock_key, holder_id FROM dlock_shared_leases \
                 WHERE lock_key = ? AND expires_at <= statement_timestamp() \
                 FOR UPDATE SKIP LOCKED) \
             DELETE FROM dlock_shared_leases t USING s \
             WHERE t.lock_key = s.lock_key AND t.holder_id = s.holder_id",
        )
        .bind::<Text, _>(key)
        .execute(self)
        .map(drop)
    }

    fn count(&mut self, key: &str) -> QueryResult<(i64, i64)> {
        stmt(
            "SELECT count(*) AS total, count(*) FILTER (WHERE mode = 'write') AS writers \
             FROM dlock_shared_leases WHERE lock_key = ?",
        )
        .bind::<Text, _>(key)
        .get_result::<Counts>(self)
        .map(|c| (c.total, c.writers))
    }

    fn insert(&mut self, ask: &HolderAsk<'_>) -> QueryResult<Acquired> {
        // The key's one counter, on its lease row (locked by this transaction), never goes
        // below the server's epoch (`pg_epoch!`).
        stmt(concat!(
            "WITH t AS (UPDATE dlock_leases SET token = GREATEST(token + 1, ",
            pg_epoch!(),
            " + 1), \
                shared_until = GREATEST(shared_until, \
                                        statement_timestamp() + ? * interval '1 microsecond') \
              WHERE lock_key = ? RETURNING token) \
             INSERT INTO dlock_shared_leases \
                    (lock_key, holder_id, owner, mode, token, acquired_at, expires_at) \
             SELECT ?, ?, ?, ?, t.token, statement_timestamp(), \
                    statement_timestamp() + ? * interval '1 microsecond' FROM t \
             RETURNING 0::int8 AS id, token, acquired_at",
        ))
        .bind::<BigInt, _>(ask.ttl_us)
        .bind::<Text, _>(ask.key)
        .bind::<Text, _>(ask.key)
        .bind::<Text, _>(ask.holder)
        .bind::<Text, _>(ask.owner)
        .bind::<Text, _>(ask.mode.as_str())
        .bind::<BigInt, _>(ask.ttl_us)
        .get_result::<AcquiredRow>(self)
        .map(Into::into)
    }
}

impl HolderLocks for PgConnection {
    fn holders_purge(&mut self, idle_us: i64) -> QueryResult<usize> {
        // The expired rows that nobody else holds are locked (a locking read checks the
        // expiry again on a row's newest version), then deleted: a row another transaction
        // holds (a stopped holder's, an acquisition's) is left for the next purge. A plain
        // DELETE waited for such a row with the dead holders' rows it had deleted before
        // kept locked; an acquisition of their key waited for those in its `expire` step
        // with the key's lease row locked, and the key's live readers, whose renewals lock
        // that row first, lost their leases (`tests/purge.rs`).
        stmt(
            "WITH s AS MATERIALIZED (SELECT lock_key, holder_id FROM dlock_shared_leases \
                 WHERE expires_at <= statement_timestamp() - ? * interval '1 microsecond' \
                 FOR UPDATE SKIP LOCKED) \
             DELETE FROM dlock_shared_leases t USING s \
             WHERE t.lock_key = s.lock_key AND t.holder_id = s.holder_id",
        )
        .bind::<BigInt, _>(idle_us)
        .execute(self)
    }

    fn holders_acquire(&mut self, ask: &HolderAsk<'_>) -> QueryResult<HolderAnswer> {
        let idle = holders::stall_bound(ask.ttl_us);
        holders::acquire_with(self, ask, |c, ask| {
            c.transaction(|c| {
                bound_transaction(c, idle, Some(holders::ROW_WAIT))?;
                holders::decide(c, ask)
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
        // One statement: `l` raises the lease row's `shared_until` (locking that row first,
        // as every statement writing the key's holders does) if the holder row is there and
        // live, then the holder row is extended to the same instant.
        stmt(
            "WITH l AS (UPDATE dlock_leases \
                 SET shared_until = GREATEST(shared_until, \
                                             statement_timestamp() + ? * interval '1 microsecond') \
                 WHERE lock_key = ? AND set_config('lock_timeout', ?, true) IS NOT NULL \
                   AND EXISTS (SELECT 1 FROM dlock_shared_leases \
                               WHERE lock_key = ? AND holder_id = ? \
                                 AND expires_at > statement_timestamp()) \
                 RETURNING 1) \
             UPDATE dlock_shared_leases \
             SET expires_at = statement_timestamp() + ? * interval '1 microsecond' \
             WHERE lock_key = ? AND holder_id = ? AND expires_at > statement_timestamp() \
               AND EXISTS (SELECT 1 FROM l)",
        )
        .bind::<BigInt, _>(ttl_us)
        .bind::<Text, _>(key)
        .bind::<Text, _>(lock_timeout_ms(bound))
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .bind::<BigInt, _>(ttl_us)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .execute(self)
        .map(|n| n == 1)
    }

    fn holders_renew_many(
        &mut self,
        holders: &[(String, String)],
        ttl_us: i64,
    ) -> QueryResult<Vec<String>> {
        // One statement. The keys' lease rows are locked first (`l`), then the live holder
        // rows of those keys (`s`), each skipping rows another session holds, so that a
        // stuck key holds up nothing; then exactly the rows locked are extended (`h`) and
        // their keys' `shared_until` raised to the same instant (`u`, run to completion
        // although nothing reads it). The holder rows are found by (key, holder id) pairs
        // (`unnest` of the two arrays): an index condition `holder_id = ANY(…)` would be
        // one index search per key and holder id, 500 × 500 for a full batch.
        let (keys, ids): (Vec<&str>, Vec<&str>) = holders
            .iter()
            .map(|(k, h)| (k.as_str(), h.as_str()))
            .unzip();
        stmt(
            "WITH l AS MATERIALIZED (SELECT lock_key FROM dlock_leases \
                                     WHERE lock_key = ANY(?) FOR UPDATE SKIP LOCKED), \
             s AS MATERIALIZED (SELECT t.lock_key, t.holder_id \
                                FROM unnest(?::text[], ?::text[]) AS p(k, h) \
                                JOIN dlock_shared_leases t \
                                  ON t.lock_key = p.k AND t.holder_id = p.h \
                                WHERE t.lock_key IN (SELECT lock_key FROM l) \
                                  AND t.expires_at > statement_timestamp() \
                                FOR UPDATE OF t SKIP LOCKED), \
             h AS (UPDATE dlock_shared_leases t \
                   SET expires_at = statement_timestamp() + ? * interval '1 microsecond' \
                   FROM s WHERE t.lock_key = s.lock_key AND t.holder_id = s.holder_id \
                   RETURNING t.lock_key, t.holder_id), \
             u AS (UPDATE dlock_leases \
                   SET shared_until = GREATEST(shared_until, \
                                               statement_timestamp() + ? * interval '1 microsecond') \
                   WHERE lock_key IN (SELECT lock_key FROM h) RETURNING 1) \
             SELECT holder_id FROM h",
        )
        .bind::<Array<Text>, _>(&keys)
        .bind::<Array<Text>, _>(&keys)
        .bind::<Array<Text>, _>(ids)
        .bind::<BigInt, _>(ttl_us)
        .bind::<BigInt, _>(ttl_us)
        .load::<HolderId>(self)
        .map(|rows| rows.into_iter().map(|r| r.holder_id).collect())
    }

    fn holders_release(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        // The lease row first, locked by a statement of its own: the next statement's
        // snapshot then shows every holder committed before this one got the lock, and no
        // holder can be added or renewed until the commit. The holder's row is deleted
        // unless another session holds it (`s`); `present`, of the statement's snapshot,
        // tells such a row from one that is gone. Notifies listening lockers.
        holders::release_with(
            self,
            key,
            |c| {
                c.transaction(|c| {
                    bound_transaction(c, holders::STALL_CAP, None)?;
                    stmt("SELECT 1::int8 AS one FROM dlock_leases WHERE lock_key = ? FOR UPDATE")
                        .bind::<Text, _>(key)
                        .get_result::<One>(c)
                        .optional()?;
                    let r = stmt(
                        "WITH s AS MATERIALIZED (SELECT lock_key, holder_id FROM dlock_shared_leases \
                             WHERE lock_key = ? AND holder_id = ? FOR UPDATE SKIP LOCKED), \
                         d AS (DELETE FROM dlock_shared_leases t USING s \
                               WHERE t.lock_key = s.lock_key AND t.holder_id = s.holder_id \
                               RETURNING t.lock_key), \
                         u AS (UPDATE dlock_leases SET shared_until = \
                                 (SELECT max(expires_at) FROM dlock_shared_leases \
                                  WHERE lock_key = s.lock_key AND holder_id <> s.holder_id \
                                    AND expires_at > statement_timestamp()) \
                               FROM s WHERE dlock_leases.lock_key = s.lock_key \
                                 AND EXISTS (SELECT 1 FROM d) RETURNING 1) \
                         SELECT (SELECT count(pg_notify('dlock_release', lock_key)) FROM d) AS one, \
                                (SELECT count(*) FROM u) AS lowered, \
                                (SELECT count(*) FROM dlock_shared_leases \
                                 WHERE lock_key = ? AND holder_id = ?) AS present",
                    )
                    .bind::<Text, _>(key)
                    .bind::<Text, _>(holder)
                    .bind::<Text, _>(key)
                    .bind::<Text, _>(holder)
                    .get_result::<Released>(c)?;
                    Ok(match (r.one, r.present) {
                        (1, _) => Release::Done(true),
                        (_, 0) => Release::Done(false),
                        _ => Release::Held,
                    })
                })
            },
            |c| {
                c.transaction(|c| {
                    bound_transaction(c, holders::STALL_CAP, None)?;
                    stmt(
                        "SELECT 1::int8 AS one FROM dlock_shared_leases \
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
                "SELECT 1::int8 AS one FROM dlock_shared_leases \
                 WHERE lock_key = ? AND holder_id = ? AND expires_at > statement_timestamp()",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<One>(self)
            .optional(),
        )
    }

    fn admin_holders(&mut self, key: Option<&str>) -> QueryResult<Vec<HolderRow>> {
        let rows = stmt(
            "SELECT l.lock_key, l.holder_id AS holder, l.owner, l.mode, k.permit_count AS permits, l.token, \
                    l.acquired_at, l.expires_at, now() AS observed_at \
             FROM dlock_shared_leases l JOIN dlock_shared_keys k USING (lock_key) \
             WHERE l.expires_at > now() AND (? IS NULL OR l.lock_key = ?) \
             ORDER BY l.lock_key, l.token",
        )
        .bind::<diesel::sql_types::Nullable<Text>, _>(key)
        .bind::<diesel::sql_types::Nullable<Text>, _>(key)
        .load(self);
        holder_rows(rows)
    }
}
