//! SQLite's admin reads, force release, purge and optimistic versions.

use super::seconds;
use crate::backend::sealed::Admin;
use crate::backend::shared;
use crate::backend::shared::{Key, One};
use crate::backend::stmt::stmt;
use crate::backend::{force_release_in, Held, PurgeTable, PURGE_BATCH};
use crate::lock_info::LockInfo;
use chrono::NaiveDateTime;
use diesel::sql_types::{BigInt, Nullable, Text, Timestamp};
use diesel::sqlite::SqliteConnection;
use diesel::OptionalExtension;
use diesel::{QueryResult, RunQueryDsl};

shared::held_row!(Timestamp, NaiveDateTime, |t| t.and_utc());

/// The lease rows a purge's batch deletes: binds the range (after, upto twice), the highest
/// token and the idle time three times.
macro_rules! purgeable_leases {
    () => {
        concat!(
            "WHERE lock_key > ? AND (? IS NULL OR lock_key <= ?) AND token <= ? \
                   AND ((holder_id IS NULL \
                         AND acquired_at <= strftime('%Y-%m-%d %H:%M:%f', 'now', ?)) \
                        OR expires_at <= strftime('%Y-%m-%d %H:%M:%f', 'now', ?)) \
                   AND (shared_until IS NULL \
                        OR shared_until <= strftime('%Y-%m-%d %H:%M:%f', 'now', ?)) \
                   AND NOT EXISTS (SELECT 1 FROM dlock_waiters w \
                                   WHERE w.lock_key = dlock_leases.lock_key AND w.line = ",
            line_sql!(lease),
            " AND w.expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')) \
                   AND NOT EXISTS (SELECT 1 FROM dlock_shared_leases s \
                                   WHERE s.lock_key = dlock_leases.lock_key \
                                     AND s.expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now'))"
        )
    };
}

impl Admin for SqliteConnection {
    shared::statements!(version_read, version_bump, version_create);

    fn admin_rows(&mut self, key: Option<&str>) -> QueryResult<Vec<Held>> {
        let rows = match key {
            None => stmt(
                "SELECT id, COALESCE(holder, '') AS holder, lock_key, owner, token, acquired_at, \
                        NULL AS expires_at, \
                        strftime('%Y-%m-%d %H:%M:%f', 'now') AS observed_at \
                 FROM dlock_rows ORDER BY lock_key",
            )
            .load(self),
            Some(key) => stmt(
                "SELECT id, COALESCE(holder, '') AS holder, lock_key, owner, token, acquired_at, \
                        NULL AS expires_at, \
                        strftime('%Y-%m-%d %H:%M:%f', 'now') AS observed_at \
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
                "SELECT 0 AS id, holder_id AS holder, lock_key, COALESCE(owner, '') AS owner, token, \
                        acquired_at, expires_at, \
                        strftime('%Y-%m-%d %H:%M:%f', 'now') AS observed_at \
                 FROM dlock_leases \
                 WHERE holder_id IS NOT NULL AND holder_id <> '' AND acquired_at IS NOT NULL \
                   AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
                 ORDER BY lock_key",
            )
            .load(self),
            Some(key) => stmt(
                "SELECT 0 AS id, holder_id AS holder, lock_key, COALESCE(owner, '') AS owner, token, \
                        acquired_at, expires_at, \
                        strftime('%Y-%m-%d %H:%M:%f', 'now') AS observed_at \
                 FROM dlock_leases \
                 WHERE lock_key = ? AND holder_id IS NOT NULL AND holder_id <> '' AND acquired_at IS NOT NULL \
                   AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')",
            )
            .bind::<Text, _>(key)
            .load(self),
        };
        held(rows, crate::lock_info::StrategyKind::Lease)
    }

    fn admin_force_release(&mut self, key: &str) -> QueryResult<Vec<LockInfo>> {
        // IMMEDIATE: take the write lock before reading, so that the read and the removals
        // see the same state (a deferred transaction could not upgrade after a concurrent
        // write and would fail with SQLITE_BUSY instead).
        self.immediate_transaction(|c| force_release_in(c, key))
    }

    fn purge_stale_rows(&mut self) -> QueryResult<usize> {
        stmt("DELETE FROM dlock_rows WHERE stale_at <= strftime('%Y-%m-%d %H:%M:%f', 'now')")
            .execute(self)
    }

    fn purge_highest(&mut self) -> QueryResult<i64> {
        stmt(
            "SELECT max((SELECT COALESCE(max(token), 0) FROM dlock_tokens), \
                        (SELECT COALESCE(max(token), 0) FROM dlock_leases)) AS one",
        )
        .get_result::<One>(self)
        .map(|r| r.one)
    }

    fn floor_raise(&mut self, to: i64) -> QueryResult<()> {
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
            // No ForUpdate on SQLite; a reader's kind goes with its lease row.
            PurgeTable::KeyRows | PurgeTable::Kinds => return Ok(None),
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
        // One batch holds the single write lock briefly: acquisitions wait for it at most
        // one batch long (busy_timeout covers far more).
        let range = |text| {
            stmt(text)
                .bind::<Text, _>(after)
                .bind::<Nullable<Text>, _>(upto)
                .bind::<Nullable<Text>, _>(upto)
        };
        match table {
            PurgeTable::KeyRows | PurgeTable::Kinds => Ok(0),
            PurgeTable::Counters => range(
                "DELETE FROM dlock_tokens \
                 WHERE lock_key > ? AND (? IS NULL OR lock_key <= ?) AND token <= ? \
                   AND NOT EXISTS (SELECT 1 FROM dlock_rows r \
                                   WHERE r.lock_key = dlock_tokens.lock_key)",
            )
            .bind::<BigInt, _>(highest)
            .execute(self),
            // The key's kind goes with its lease row (SQLite has no permit slots or
            // ForUpdate rows), in one transaction under the single write lock.
            PurgeTable::Leases => self.immediate_transaction(|c| {
                let leases = |text| {
                    stmt(text)
                        .bind::<Text, _>(after)
                        .bind::<Nullable<Text>, _>(upto)
                        .bind::<Nullable<Text>, _>(upto)
                        .bind::<BigInt, _>(highest)
                        .bind::<Text, _>(seconds('-', idle_us))
                        .bind::<Text, _>(seconds('-', idle_us))
                        .bind::<Text, _>(seconds('-', idle_us))
                };
                let kinds = leases(concat!(
                    "DELETE FROM dlock_shared_keys WHERE intent IS NULL AND lock_key IN \
                     (SELECT lock_key FROM dlock_leases ",
                    purgeable_leases!(),
                    ")"
                ))
                .execute(c)?;
                let rows =
                    leases(concat!("DELETE FROM dlock_leases ", purgeable_leases!())).execute(c)?;
                Ok(kinds + rows)
            }),
            // SQLite has neither ForUpdate rows nor permit slots.
        }
    }
}
