//! MySQL's admin reads, force release, purge and optimistic versions.

use crate::backend::sealed::Admin;
use crate::backend::shared;
use crate::backend::stmt::stmt;
use crate::backend::{force_release_in, Held};
use crate::lock_info::LockInfo;
use chrono::NaiveDateTime;
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Datetime, Text};
use diesel::Connection;
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
        self.transaction(|c| force_release_in(c, key))
    }

    fn purge_stale_rows(&mut self) -> QueryResult<usize> {
        // These statements scan whole tables. Under REPEATABLE READ InnoDB would keep every
        // scanned row locked until the end and block acquisitions meanwhile; READ COMMITTED
        // lets go of the rows that do not match. (Without GLOBAL or SESSION, SET TRANSACTION
        // applies to the next transaction only, so the pooled connection keeps its level.)
        stmt("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(self)?;
        stmt("DELETE FROM dlock_rows WHERE stale_at <= UTC_TIMESTAMP(6)").execute(self)
    }

    fn purge_mark_leases(&mut self, idle_us: i64) -> QueryResult<usize> {
        stmt("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(self)?;
        // The rows marked here carry one instant (`@dlock_mark`): only their tokens are saved.
        // A marked row whose key a reader took since has a token above the saved one and a
        // live `shared_until`; the delete spares it either way.
        self.transaction(|c| {
            stmt("SET @dlock_mark = UTC_TIMESTAMP(6)").execute(c)?;
            let marked = stmt(
                "UPDATE dlock_leases SET holder_id = '', expires_at = @dlock_mark \
                 WHERE ((holder_id IS NULL \
                         AND acquired_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) \
                        OR expires_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) \
                   AND (shared_until IS NULL \
                        OR shared_until <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND)",
            )
            .bind::<BigInt, _>(idle_us)
            .bind::<BigInt, _>(idle_us)
            .bind::<BigInt, _>(idle_us)
            .execute(c)?;
            if marked > 0 {
                stmt(
                    "INSERT INTO dlock_tokens (lock_key, token) \
                     SELECT lock_key, token FROM dlock_leases \
                     WHERE holder_id = '' AND expires_at = @dlock_mark \
                     ON DUPLICATE KEY UPDATE token = GREATEST(dlock_tokens.token, VALUES(token))",
                )
                .execute(c)?;
            }
            Ok(marked)
        })
    }

    fn purge_delete_leases(&mut self) -> QueryResult<usize> {
        stmt("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(self)?;
        stmt(
            "DELETE l FROM dlock_leases l JOIN dlock_tokens t ON t.lock_key = l.lock_key \
             WHERE l.holder_id = '' AND l.token <= t.token \
               AND (l.shared_until IS NULL OR l.shared_until <= UTC_TIMESTAMP(6))",
        )
        .execute(self)
    }
}
