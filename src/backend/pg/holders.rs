//! PostgreSQL's statements of shared leases and semaphore permits (see `backend/holders.rs`).
//! Times are `statement_timestamp()`: inside the acquisition's transaction, the time of each
//! statement, not of the transaction's start (which may have waited for the header's lock).

use super::{lock_timeout_ms, AcquiredRow};
use crate::backend::holders::HolderSteps;
use crate::backend::holders::{self, Header, HolderAnswer, HolderAsk, HolderLocks, HolderRow};
use crate::backend::shared::{exists, One};
use crate::backend::stmt::stmt;
use crate::backend::Acquired;
use chrono::{DateTime, Utc};
use diesel::pg::PgConnection;
use diesel::sql_types::{BigInt, Text, Timestamptz};
use diesel::{Connection, OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};

holders::holder_row!(Timestamptz, DateTime<Utc>, |t| t);

#[derive(QueryableByName)]
struct HeaderRow {
    #[diesel(sql_type = BigInt)]
    permits: i64,
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    live_intent: Option<String>,
}

#[derive(QueryableByName)]
struct Counts {
    #[diesel(sql_type = BigInt)]
    total: i64,
    #[diesel(sql_type = BigInt)]
    writers: i64,
}

impl HolderSteps for PgConnection {
    crate::backend::shared::statements!(create_header, clear_intent);

    fn lock_header(&mut self, key: &str) -> QueryResult<Option<Header>> {
        stmt(
            "SELECT permits, \
                    CASE WHEN intent_until > statement_timestamp() THEN intent END AS live_intent \
             FROM dlock_shared_keys WHERE lock_key = ? FOR UPDATE",
        )
        .bind::<Text, _>(key)
        .get_result::<HeaderRow>(self)
        .optional()
        .map(|r| {
            r.map(|r| Header {
                permits: r.permits,
                live_intent: r.live_intent,
            })
        })
    }

    fn expire(&mut self, key: &str) -> QueryResult<()> {
        stmt(
            "DELETE FROM dlock_shared_leases \
             WHERE lock_key = ? AND expires_at <= statement_timestamp()",
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

    fn set_intent(&mut self, key: &str, who: &str, us: i64) -> QueryResult<()> {
        stmt(
            "UPDATE dlock_shared_keys SET intent = ?, \
                    intent_until = statement_timestamp() + ? * interval '1 microsecond' \
             WHERE lock_key = ?",
        )
        .bind::<Text, _>(who)
        .bind::<BigInt, _>(us)
        .bind::<Text, _>(key)
        .execute(self)
        .map(drop)
    }

    fn insert(&mut self, ask: &HolderAsk<'_>) -> QueryResult<Acquired> {
        // The key's counter never goes below the server's epoch (`pg_epoch!`).
        stmt(concat!(
            "WITH t AS (UPDATE dlock_shared_keys SET token = GREATEST(token + 1, ",
            pg_epoch!(),
            " + 1) WHERE lock_key = ? RETURNING token) \
             INSERT INTO dlock_shared_leases \
                    (lock_key, holder, owner, mode, token, acquired_at, expires_at) \
             SELECT ?, ?, ?, ?, t.token, statement_timestamp(), \
                    statement_timestamp() + ? * interval '1 microsecond' FROM t \
             RETURNING 0::int8 AS id, token, acquired_at",
        ))
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
        stmt(
            "DELETE FROM dlock_shared_leases \
             WHERE expires_at <= statement_timestamp() - ? * interval '1 microsecond'",
        )
        .bind::<BigInt, _>(idle_us)
        .execute(self)
    }
    fn holders_clear_intent(&mut self, key: &str, who: &str) -> QueryResult<()> {
        self.clear_intent(key, who)
    }
    fn holders_acquire(&mut self, ask: &HolderAsk<'_>) -> QueryResult<HolderAnswer> {
        holders::acquire_with(self, ask, |c, ask| {
            c.transaction(|c| holders::decide(c, ask))
        })
    }

    fn holders_renew(
        &mut self,
        key: &str,
        holder: &str,
        ttl_us: i64,
        bound: std::time::Duration,
    ) -> QueryResult<bool> {
        stmt(
            "UPDATE dlock_shared_leases \
             SET expires_at = statement_timestamp() + ? * interval '1 microsecond' \
             WHERE lock_key = ? AND holder = ? \
               AND set_config('lock_timeout', ?, true) IS NOT NULL \
               AND expires_at > statement_timestamp()",
        )
        .bind::<BigInt, _>(ttl_us)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .bind::<Text, _>(lock_timeout_ms(bound))
        .execute(self)
        .map(|n| n == 1)
    }

    fn holders_release(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        // Notifies listening lockers, as a lease's release does.
        stmt(
            "WITH d AS (DELETE FROM dlock_shared_leases WHERE lock_key = ? AND holder = ? \
                        RETURNING lock_key) \
             SELECT count(pg_notify('dlock_release', lock_key)) AS one FROM d",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .get_result::<One>(self)
        .map(|r| r.one == 1)
    }

    fn holders_held(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        exists(
            stmt(
                "SELECT 1::int8 AS one FROM dlock_shared_leases \
                 WHERE lock_key = ? AND holder = ? AND expires_at > statement_timestamp()",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<One>(self)
            .optional(),
        )
    }

    fn admin_holders(&mut self, key: Option<&str>) -> QueryResult<Vec<HolderRow>> {
        let rows = stmt(
            "SELECT l.lock_key, l.holder, l.owner, l.mode, k.permits, l.token, \
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
