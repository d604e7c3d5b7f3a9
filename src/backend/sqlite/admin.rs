//! SQLite's admin reads, force release, purge and optimistic versions.

use super::seconds;
use crate::backend::sealed::Admin;
use crate::backend::shared;
use crate::backend::stmt::stmt;
use crate::backend::{force_release_in, Held};
use crate::lock_info::LockInfo;
use chrono::NaiveDateTime;
use diesel::sql_types::{Text, Timestamp};
use diesel::sqlite::SqliteConnection;
use diesel::{QueryResult, RunQueryDsl};

shared::held_row!(Timestamp, NaiveDateTime, |t| t.and_utc());

#[derive(diesel::QueryableByName)]
struct Now {
    #[diesel(sql_type = Text)]
    now: String,
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

    fn purge_mark_leases(&mut self, idle_us: i64) -> QueryResult<usize> {
        // The rows marked here carry one instant (`mark`): only their tokens are saved. A
        // marked row whose key a reader took since has a token above the saved one and a live
        // `shared_until`; the delete spares it either way.
        self.immediate_transaction(|c| {
            let mark = stmt("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now') AS now")
                .get_result::<Now>(c)?
                .now;
            let marked = stmt(
                "UPDATE dlock_leases SET holder_id = '', expires_at = ? \
                 WHERE ((holder_id IS NULL \
                         AND acquired_at <= strftime('%Y-%m-%d %H:%M:%f', 'now', ?)) \
                        OR expires_at <= strftime('%Y-%m-%d %H:%M:%f', 'now', ?)) \
                   AND (shared_until IS NULL \
                        OR shared_until <= strftime('%Y-%m-%d %H:%M:%f', 'now', ?))",
            )
            .bind::<Text, _>(&mark)
            .bind::<Text, _>(seconds('-', idle_us))
            .bind::<Text, _>(seconds('-', idle_us))
            .bind::<Text, _>(seconds('-', idle_us))
            .execute(c)?;
            if marked > 0 {
                // `WHERE true` tells SQLite's parser that ON CONFLICT is the upsert clause.
                stmt(
                    "INSERT INTO dlock_tokens (lock_key, token) \
                     SELECT lock_key, token FROM dlock_leases \
                     WHERE holder_id = '' AND expires_at = ? AND true \
                     ON CONFLICT (lock_key) DO UPDATE SET token = max(token, excluded.token)",
                )
                .bind::<Text, _>(&mark)
                .execute(c)?;
            }
            Ok(marked)
        })
    }

    fn purge_delete_leases(&mut self) -> QueryResult<usize> {
        stmt(
            "DELETE FROM dlock_leases WHERE holder_id = '' \
             AND token <= (SELECT t.token FROM dlock_tokens t \
                           WHERE t.lock_key = dlock_leases.lock_key) \
             AND (shared_until IS NULL \
                  OR shared_until <= strftime('%Y-%m-%d %H:%M:%f', 'now'))",
        )
        .execute(self)
    }
}
