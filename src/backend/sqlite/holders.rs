//! SQLite's statements of shared leases and semaphore permits (see `backend/holders.rs`).
//! The acquisition's transaction is IMMEDIATE: it takes the single write lock first, so
//! nothing it reads can change before it commits.

use super::{seconds, AcquiredRow};
use crate::backend::holders::HolderSteps;
use crate::backend::holders::{self, Header, HolderAnswer, HolderAsk, HolderLocks, HolderRow};
use crate::backend::shared::{exists, One};
use crate::backend::stmt::stmt;
use crate::backend::Acquired;
use chrono::NaiveDateTime;
use diesel::sql_types::{BigInt, Nullable, Text, Timestamp};
use diesel::sqlite::SqliteConnection;
use diesel::{OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};

holders::holder_row!(Timestamp, NaiveDateTime, |t| t.and_utc());

#[derive(QueryableByName)]
struct HeaderRow {
    #[diesel(sql_type = BigInt)]
    permits: i64,
    #[diesel(sql_type = Nullable<Text>)]
    live_intent: Option<String>,
}

#[derive(QueryableByName)]
struct Counts {
    #[diesel(sql_type = BigInt)]
    total: i64,
    #[diesel(sql_type = BigInt)]
    writers: i64,
}

impl HolderSteps for SqliteConnection {
    crate::backend::shared::statements!(create_header, clear_intent);

    fn lock_header(&mut self, key: &str) -> QueryResult<Option<Header>> {
        stmt(
            "SELECT permits, \
                    CASE WHEN intent_until > strftime('%Y-%m-%d %H:%M:%f', 'now') \
                         THEN intent END AS live_intent \
             FROM dlock_shared_keys WHERE lock_key = ?",
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
             WHERE lock_key = ? AND expires_at <= strftime('%Y-%m-%d %H:%M:%f', 'now')",
        )
        .bind::<Text, _>(key)
        .execute(self)
        .map(drop)
    }

    fn count(&mut self, key: &str) -> QueryResult<(i64, i64)> {
        stmt(
            "SELECT count(*) AS total, COALESCE(sum(mode = 'write'), 0) AS writers \
             FROM dlock_shared_leases WHERE lock_key = ?",
        )
        .bind::<Text, _>(key)
        .get_result::<Counts>(self)
        .map(|c| (c.total, c.writers))
    }

    fn set_intent(&mut self, key: &str, who: &str, us: i64) -> QueryResult<()> {
        stmt(
            "UPDATE dlock_shared_keys SET intent = ?, \
                    intent_until = strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
             WHERE lock_key = ?",
        )
        .bind::<Text, _>(who)
        .bind::<Text, _>(seconds('+', us))
        .bind::<Text, _>(key)
        .execute(self)
        .map(drop)
    }

    fn insert(&mut self, ask: &HolderAsk<'_>) -> QueryResult<Acquired> {
        stmt("UPDATE dlock_shared_keys SET token = token + 1 WHERE lock_key = ?")
            .bind::<Text, _>(ask.key)
            .execute(self)?;
        stmt(
            "INSERT INTO dlock_shared_leases \
                    (lock_key, holder, owner, mode, token, acquired_at, expires_at) \
             SELECT ?, ?, ?, ?, token, strftime('%Y-%m-%d %H:%M:%f', 'now'), \
                    strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
             FROM dlock_shared_keys WHERE lock_key = ? \
             RETURNING 0 AS id, token, acquired_at",
        )
        .bind::<Text, _>(ask.key)
        .bind::<Text, _>(ask.holder)
        .bind::<Text, _>(ask.owner)
        .bind::<Text, _>(ask.mode.as_str())
        .bind::<Text, _>(seconds('+', ask.ttl_us))
        .bind::<Text, _>(ask.key)
        .get_result::<AcquiredRow>(self)
        .map(Into::into)
    }
}

impl HolderLocks for SqliteConnection {
    crate::backend::shared::statements!(holders_release);

    fn holders_purge(&mut self, idle_us: i64) -> QueryResult<usize> {
        stmt(
            "DELETE FROM dlock_shared_leases \
             WHERE expires_at <= strftime('%Y-%m-%d %H:%M:%f', 'now', ?)",
        )
        .bind::<Text, _>(seconds('-', idle_us))
        .execute(self)
    }
    fn holders_clear_intent(&mut self, key: &str, who: &str) -> QueryResult<()> {
        self.clear_intent(key, who)
    }
    fn holders_acquire(&mut self, ask: &HolderAsk<'_>) -> QueryResult<HolderAnswer> {
        holders::acquire_with(self, ask, |c, ask| {
            c.immediate_transaction(|c| holders::decide(c, ask))
        })
    }

    fn holders_renew(
        &mut self,
        key: &str,
        holder: &str,
        ttl_us: i64,
        _bound: std::time::Duration,
    ) -> QueryResult<bool> {
        stmt(
            "UPDATE dlock_shared_leases \
             SET expires_at = strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
             WHERE lock_key = ? AND holder = ? \
               AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')",
        )
        .bind::<Text, _>(seconds('+', ttl_us))
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .execute(self)
        .map(|n| n == 1)
    }

    fn holders_held(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        exists(
            stmt(
                "SELECT 1 AS one FROM dlock_shared_leases \
                 WHERE lock_key = ? AND holder = ? \
                   AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')",
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
                    l.acquired_at, l.expires_at, \
                    strftime('%Y-%m-%d %H:%M:%f', 'now') AS observed_at \
             FROM dlock_shared_leases l JOIN dlock_shared_keys k ON k.lock_key = l.lock_key \
             WHERE l.expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
               AND (? IS NULL OR l.lock_key = ?) \
             ORDER BY l.lock_key, l.token",
        )
        .bind::<Nullable<Text>, _>(key)
        .bind::<Nullable<Text>, _>(key)
        .load(self);
        holder_rows(rows)
    }
}
