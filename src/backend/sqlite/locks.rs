//! SQLite's `Row` and `Lease` statements.
// Its statements' texts are `pub` for `__bench_sql` (feature `bench-sql`) only.
#![cfg_attr(not(feature = "bench-sql"), allow(unreachable_pub))]

use super::{seconds, AcquiredRow};
use crate::backend::sealed::Locks;
use crate::backend::shared;
use crate::backend::shared::{exists, One};
use crate::backend::stmt::stmt;
use crate::backend::Acquired;
use crate::key::floor_bucket;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::sqlite::SqliteConnection;
use diesel::{OptionalExtension, QueryResult, RunQueryDsl};

// The texts of the statements the benches' raw floors run too (`diesel_lock::__bench_sql`);
// the others are written where they run. The releases are in `shared.rs` (the same on
// MySQL).

/// The next token of a key without a row of its own strategy, as SQL: one more than its
/// counter (`$last`, an SQL expression, NULL without a counter row) and than the token floor
/// of its bucket (bound), above which a key never used or purged starts. The one place where SQLite's `Row` and `Lease` tokens are computed.
/// Every write statement takes SQLite's single write lock before it reads, so a purge's
/// raise of the floor and its deletes come wholly before or wholly after it.
macro_rules! sqlite_next_token {
    ($last:literal) => {
        concat!(
            "max(COALESCE(",
            $last,
            ", 0), COALESCE((SELECT floor_token FROM dlock_token_floor WHERE bucket = ?), 0)) + 1"
        )
    };
}

/// `row_acquire`. Reading the counter and inserting happen under SQLite's single write lock,
/// and the AFTER INSERT trigger stores the new token back into dlock_tokens.
pub const ROW_ACQUIRE: &str = concat!(
    "INSERT INTO dlock_rows (lock_key, owner, holder, token, acquired_at, stale_at) \
     SELECT ?, ?, ?, ",
    sqlite_next_token!("(SELECT token FROM dlock_tokens WHERE lock_key = ?)"),
    ", \
             strftime('%Y-%m-%d %H:%M:%f', 'now'), \
             strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
     WHERE NOT EXISTS (SELECT 1 FROM dlock_waiters WHERE lock_key = ? AND id < ? \
                       AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')) \
     ON CONFLICT (lock_key) DO NOTHING \
     RETURNING id, token, acquired_at"
);

/// `lease_acquire`. A row with live readers or permits (`shared_until`, raised by each of
/// them under the same single write lock: `holders.rs`) is not taken; a key with shared
/// holders always has its row, so the INSERT never runs beside them.
pub const LEASE_ACQUIRE: &str = concat!(
    "INSERT INTO dlock_leases (lock_key, owner, holder_id, token, acquired_at, expires_at) \
     SELECT ?, ?, ?, ",
    sqlite_next_token!("(SELECT token FROM dlock_tokens WHERE lock_key = ?)"),
    ", \
             strftime('%Y-%m-%d %H:%M:%f', 'now'), \
             strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
     WHERE NOT EXISTS (SELECT 1 FROM dlock_waiters WHERE lock_key = ? AND id < ? \
                       AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')) \
     ON CONFLICT (lock_key) DO UPDATE SET \
       owner = excluded.owner, holder_id = excluded.holder_id, \
       token = dlock_leases.token + 1, \
       acquired_at = excluded.acquired_at, expires_at = excluded.expires_at \
     WHERE (dlock_leases.holder_id IS NULL \
            OR dlock_leases.expires_at <= excluded.acquired_at) \
       AND (dlock_leases.shared_until IS NULL \
            OR dlock_leases.shared_until <= excluded.acquired_at) \
     RETURNING 0 AS id, token, acquired_at"
);

impl Locks for SqliteConnection {
    shared::statements!(row_forget, row_release, row_held, lease_release);

    fn row_acquire(
        &mut self,
        key: &str,
        owner: &str,
        holder: &str,
        stale_us: Option<i64>,
        retry: bool,
        place: i64,
    ) -> QueryResult<Option<Acquired>> {
        // Waiters look with a read first: in WAL mode reads never wait for the writer, while
        // every INSERT attempt queues for the single write lock.
        if retry
            && held_or_behind(
                self,
                "SELECT 1 AS one WHERE EXISTS (SELECT 1 FROM dlock_rows WHERE lock_key = ?) \
                   OR EXISTS (SELECT 1 FROM dlock_waiters WHERE lock_key = ? AND id < ? \
                              AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now'))",
                key,
                place,
            )?
        {
            return Ok(None);
        }
        in_line(self, place, |c| {
            stmt(ROW_ACQUIRE)
                .bind::<Text, _>(key)
                .bind::<Text, _>(owner)
                .bind::<Text, _>(holder)
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(floor_bucket(key))
                // A NULL modifier makes strftime NULL: a row that never goes stale.
                .bind::<Nullable<Text>, _>(stale_us.map(|us| seconds('+', us)))
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(place)
                .get_result::<AcquiredRow>(c)
                .optional()
                .map(|r| r.map(Into::into))
        })
    }

    fn row_delete_stale(&mut self, key: &str) -> QueryResult<bool> {
        stmt(
            "DELETE FROM dlock_rows WHERE lock_key = ? \
             AND stale_at <= strftime('%Y-%m-%d %H:%M:%f', 'now')",
        )
        .bind::<Text, _>(key)
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
        if retry
            && held_or_behind(
                self,
                "SELECT 1 AS one WHERE EXISTS (SELECT 1 FROM dlock_leases WHERE lock_key = ? \
                     AND (holder_id IS NOT NULL \
                          AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
                          OR shared_until > strftime('%Y-%m-%d %H:%M:%f', 'now'))) \
                   OR EXISTS (SELECT 1 FROM dlock_waiters WHERE lock_key = ? AND id < ? \
                              AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now'))",
                key,
                place,
            )?
        {
            return Ok(None);
        }
        in_line(self, place, |c| {
            stmt(LEASE_ACQUIRE)
                .bind::<Text, _>(key)
                .bind::<Text, _>(owner)
                .bind::<Text, _>(holder)
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(floor_bucket(key))
                .bind::<Text, _>(seconds('+', ttl_us))
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(place)
                .get_result::<AcquiredRow>(c)
                .optional()
                .map(|r| r.map(Into::into))
        })
    }

    fn lease_renew(
        &mut self,
        key: &str,
        holder: &str,
        ttl_us: i64,
        // A write waits for the whole database, as long as busy_timeout (5 s) lets it.
        _bound: std::time::Duration,
    ) -> QueryResult<bool> {
        stmt(
            "UPDATE dlock_leases SET expires_at = strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
             WHERE lock_key = ? AND holder_id = ? \
               AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')",
        )
        .bind::<Text, _>(seconds('+', ttl_us))
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .execute(self)
        .map(|n| n == 1)
    }

    fn lease_held(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        exists(
            stmt(
                "SELECT 1 AS one FROM dlock_leases WHERE lock_key = ? AND holder_id = ? \
                 AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<One>(self)
            .optional(),
        )
    }
}

/// Whether a key is visibly held, or others are ahead of `place` in its line (`query`
/// binds the key twice, then the place): a read, which in WAL mode never waits for the
/// writer.
fn held_or_behind(
    conn: &mut SqliteConnection,
    query: &'static str,
    key: &str,
    place: i64,
) -> QueryResult<bool> {
    exists(
        stmt(query)
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .bind::<BigInt, _>(place)
            .get_result::<One>(conn)
            .optional(),
    )
}

/// Runs an acquiring statement; a waiter's (one with a place) runs in one IMMEDIATE
/// transaction with the removal of its place, so that the two take the database's write
/// lock once (each wait for it can cost the busy handler's sleeps of 1 ms and more).
fn in_line(
    conn: &mut SqliteConnection,
    place: i64,
    acquire: impl Fn(&mut SqliteConnection) -> QueryResult<Option<Acquired>>,
) -> QueryResult<Option<Acquired>> {
    if place == crate::backend::NO_PLACE {
        return acquire(conn);
    }
    conn.immediate_transaction(|c| {
        let acquired = acquire(c)?;
        if acquired.is_some() {
            stmt(shared::LEAVE_PLACE)
                .bind::<BigInt, _>(place)
                .execute(c)?;
        }
        Ok(acquired)
    })
}
