//! MySQL's statements of shared leases and semaphore permits (see `backend/holders.rs`).
//!
//! The acquisition's transaction runs at READ COMMITTED: its locking reads then lock only
//! the rows they match, not the gaps beside them, so acquisitions of neighbouring keys do
//! not deadlock over the gap between their holder rows. Counting is a locking read too
//! (`FOR UPDATE`), which sees the newest committed rows, not the transaction's snapshot.

use super::{with_lock_wait_timeout, AcquiredRow};
use crate::backend::holders::HolderSteps;
use crate::backend::holders::{self, Header, HolderAnswer, HolderAsk, HolderLocks, HolderRow};
use crate::backend::shared::{exists, One};
use crate::backend::stmt::stmt;
use crate::backend::Acquired;
use chrono::NaiveDateTime;
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Datetime, Nullable, Text};
use diesel::{Connection, OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};

holders::holder_row!(Datetime, NaiveDateTime, |t| t.and_utc());

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

impl HolderSteps for MysqlConnection {
    crate::backend::shared::statements!(clear_intent);

    fn create_header(&mut self, key: &str, permits: i64) -> QueryResult<()> {
        stmt("INSERT IGNORE INTO dlock_shared_keys (lock_key, permits, token) VALUES (?, ?, 0)")
            .bind::<Text, _>(key)
            .bind::<BigInt, _>(permits)
            .execute(self)
            .map(drop)
    }

    fn lock_header(&mut self, key: &str) -> QueryResult<Option<Header>> {
        stmt(
            "SELECT permits, \
                    IF(intent_until > UTC_TIMESTAMP(6), intent, NULL) AS live_intent \
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
             WHERE lock_key = ? AND expires_at <= UTC_TIMESTAMP(6)",
        )
        .bind::<Text, _>(key)
        .execute(self)
        .map(drop)
    }

    fn count(&mut self, key: &str) -> QueryResult<(i64, i64)> {
        stmt(
            "SELECT CAST(COUNT(*) AS SIGNED) AS total, \
                    CAST(COALESCE(SUM(mode = 'write'), 0) AS SIGNED) AS writers \
             FROM dlock_shared_leases WHERE lock_key = ? FOR UPDATE",
        )
        .bind::<Text, _>(key)
        .get_result::<Counts>(self)
        .map(|c| (c.total, c.writers))
    }

    fn set_intent(&mut self, key: &str, who: &str, us: i64) -> QueryResult<()> {
        stmt(
            "UPDATE dlock_shared_keys SET intent = ?, \
                    intent_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
             WHERE lock_key = ?",
        )
        .bind::<Text, _>(who)
        .bind::<BigInt, _>(us)
        .bind::<Text, _>(key)
        .execute(self)
        .map(drop)
    }

    fn insert(&mut self, ask: &HolderAsk<'_>) -> QueryResult<Acquired> {
        // The header row is ours until the commit: the token read back is the one drawn.
        stmt(concat!(
            "UPDATE dlock_shared_keys SET token = GREATEST(token + 1, ",
            mysql_floor!(),
            ") WHERE lock_key = ?"
        ))
        .bind::<Text, _>(ask.key)
        .execute(self)?;
        stmt(
            "INSERT INTO dlock_shared_leases \
                    (lock_key, holder, owner, mode, token, acquired_at, expires_at) \
             SELECT ?, ?, ?, ?, token, UTC_TIMESTAMP(6), \
                    UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
             FROM dlock_shared_keys WHERE lock_key = ?",
        )
        .bind::<Text, _>(ask.key)
        .bind::<Text, _>(ask.holder)
        .bind::<Text, _>(ask.owner)
        .bind::<Text, _>(ask.mode.as_str())
        .bind::<BigInt, _>(ask.ttl_us)
        .bind::<Text, _>(ask.key)
        .execute(self)?;
        stmt(
            "SELECT CAST(0 AS SIGNED) AS id, token, acquired_at FROM dlock_shared_leases \
             WHERE lock_key = ? AND holder = ?",
        )
        .bind::<Text, _>(ask.key)
        .bind::<Text, _>(ask.holder)
        .get_result::<AcquiredRow>(self)
        .map(Into::into)
    }
}

impl HolderLocks for MysqlConnection {
    crate::backend::shared::statements!(holders_release);

    fn holders_purge(&mut self, idle_us: i64) -> QueryResult<usize> {
        stmt(
            "DELETE FROM dlock_shared_leases \
             WHERE expires_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
        )
        .bind::<BigInt, _>(idle_us)
        .execute(self)
    }
    fn holders_clear_intent(&mut self, key: &str, who: &str) -> QueryResult<()> {
        self.clear_intent(key, who)
    }
    fn holders_acquire(&mut self, ask: &HolderAsk<'_>) -> QueryResult<HolderAnswer> {
        holders::acquire_with(self, ask, |c, ask| {
            // For the next transaction only.
            stmt("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(c)?;
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
        let seconds = bound.as_secs() + u64::from(bound.subsec_nanos() > 0);
        with_lock_wait_timeout(self, seconds, |c| {
            // diesel sets CLIENT_FOUND_ROWS, so the count is of matched rows.
            stmt(
                "UPDATE dlock_shared_leases \
                 SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
                 WHERE lock_key = ? AND holder = ? AND expires_at > UTC_TIMESTAMP(6)",
            )
            .bind::<BigInt, _>(ttl_us)
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .execute(c)
            .map(|n| n == 1)
        })
    }

    fn holders_held(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        exists(
            stmt(
                "SELECT CAST(1 AS SIGNED) AS one FROM dlock_shared_leases \
                 WHERE lock_key = ? AND holder = ? AND expires_at > UTC_TIMESTAMP(6)",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<One>(self)
            .optional(),
        )
    }

    fn admin_holders(&mut self, key: Option<&str>) -> QueryResult<Vec<HolderRow>> {
        let rows = stmt(
            "SELECT CAST(l.lock_key AS CHAR) AS lock_key, l.holder, l.owner, l.mode, \
                    k.permits, l.token, l.acquired_at, l.expires_at, \
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
