//! PostgreSQL: every acquire and every release is one statement.

use super::sealed::Dialect;
use super::stmt::stmt;
use super::{migrate_with_retry, Acquired, Backend};
use crate::{Error, Result};
use chrono::{DateTime, Utc};
use diesel::pg::PgConnection;
use diesel::sql_types::{BigInt, Text, Timestamptz};
use diesel::{OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/postgres");

/// Serialises concurrent `migrate()` calls across processes (key_hash("diesel-lock/migrate")
/// is not needed here: any constant outside the range users pick by hand will do).
const MIGRATION_LOCK: i64 = 0x646c_6f63_6b5f_6d69; // "dlock_mi"

#[derive(QueryableByName)]
struct AcquiredRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = BigInt)]
    token: i64,
    #[diesel(sql_type = Timestamptz)]
    acquired_at: DateTime<Utc>,
}

impl From<AcquiredRow> for Acquired {
    fn from(r: AcquiredRow) -> Self {
        Acquired {
            id: r.id,
            token: r.token,
            acquired_at: r.acquired_at,
        }
    }
}

#[derive(QueryableByName)]
struct One {
    #[diesel(sql_type = BigInt)]
    #[allow(dead_code)]
    one: i64,
}

impl Dialect for PgConnection {
    fn backend(&self) -> Backend {
        Backend::Postgres
    }

    fn static_backend() -> Option<Backend> {
        Some(Backend::Postgres)
    }

    fn run_migrations(&mut self) -> Result<()> {
        stmt("SELECT pg_advisory_lock(?)")
            .bind::<BigInt, _>(MIGRATION_LOCK)
            .execute(self)?;
        let result = migrate_with_retry(self, |c| {
            c.run_pending_migrations(MIGRATIONS)
                .map(drop)
                .map_err(Error::Migration)
        });
        let unlocked = stmt("SELECT pg_advisory_unlock(?)")
            .bind::<BigInt, _>(MIGRATION_LOCK)
            .execute(self);
        result?;
        unlocked?;
        Ok(())
    }

    fn is_contention(&self, e: &diesel::result::Error) -> bool {
        use diesel::result::{DatabaseErrorKind, Error as E};
        match e {
            E::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => true,
            // 40P01 deadlock_detected and 55P03 lock_not_available have no diesel kind.
            E::DatabaseError(_, info) => {
                let m = info.message();
                m.starts_with("deadlock detected") || m.starts_with("could not obtain lock")
            }
            _ => false,
        }
    }

    fn row_acquire(
        &mut self,
        key: &str,
        owner: &str,
        _retry: bool,
    ) -> QueryResult<Option<Acquired>> {
        // The token counter's row lock serialises every transaction that can insert the
        // key's row, so tokens are handed out in the order the rows are inserted and a later
        // holder always has a larger token (an id from a sequence would not: nextval runs
        // before the unique check, so a slow inserter can win with an older id).
        // While the row is visibly held, the counter is not touched at all.
        stmt(
            "WITH t AS ( \
               INSERT INTO dlock_tokens AS t (lock_key, token) \
               SELECT ?, 1 WHERE NOT EXISTS (SELECT 1 FROM dlock_rows WHERE lock_key = ?) \
               ON CONFLICT (lock_key) DO UPDATE SET token = t.token + 1 \
               RETURNING token) \
             INSERT INTO dlock_rows (lock_key, owner, token, acquired_at) \
             SELECT ?, ?, t.token, now() FROM t \
             ON CONFLICT (lock_key) DO NOTHING \
             RETURNING id, token, acquired_at",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<Text, _>(owner)
        .get_result::<AcquiredRow>(self)
        .optional()
        .map(|r| r.map(Into::into))
    }

    fn row_delete_stale(&mut self, key: &str, stale_us: i64) -> QueryResult<bool> {
        // The subquery is a plain snapshot read; the DELETE then locks only that row, by id,
        // and re-checks it: a row deleted and re-inserted meanwhile has another id.
        stmt(
            "DELETE FROM dlock_rows WHERE id = (SELECT id FROM dlock_rows WHERE lock_key = ? \
             AND acquired_at <= now() - ? * interval '1 microsecond')",
        )
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(stale_us)
        .execute(self)
        .map(|n| n > 0)
    }

    fn row_release(&mut self, id: i64) -> QueryResult<bool> {
        stmt("DELETE FROM dlock_rows WHERE id = ?")
            .bind::<BigInt, _>(id)
            .execute(self)
            .map(|n| n == 1)
    }

    fn row_held(&mut self, id: i64) -> QueryResult<bool> {
        stmt("SELECT 1::int8 AS one FROM dlock_rows WHERE id = ?")
            .bind::<BigInt, _>(id)
            .get_result::<One>(self)
            .optional()
            .map(|r| r.is_some())
    }

    fn lease_acquire(
        &mut self,
        key: &str,
        owner: &str,
        holder: &str,
        ttl_us: i64,
        _retry: bool,
    ) -> QueryResult<Option<Acquired>> {
        // One statement: insert the key's lease row, or take it over if free or expired.
        // The row is never deleted, so its token only grows.
        stmt(
            "INSERT INTO dlock_leases AS l \
               (lock_key, owner, holder, token, acquired_at, expires_at) \
             VALUES (?, ?, ?, 1, now(), now() + ? * interval '1 microsecond') \
             ON CONFLICT (lock_key) DO UPDATE SET \
               owner = EXCLUDED.owner, holder = EXCLUDED.holder, token = l.token + 1, \
               acquired_at = EXCLUDED.acquired_at, expires_at = EXCLUDED.expires_at \
             WHERE l.holder IS NULL OR l.expires_at <= now() \
             RETURNING 0::int8 AS id, token, acquired_at",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(owner)
        .bind::<Text, _>(holder)
        .bind::<BigInt, _>(ttl_us)
        .get_result::<AcquiredRow>(self)
        .optional()
        .map(|r| r.map(Into::into))
    }

    fn lease_renew(&mut self, key: &str, holder: &str, ttl_us: i64) -> QueryResult<bool> {
        stmt(
            "UPDATE dlock_leases SET expires_at = now() + ? * interval '1 microsecond' \
             WHERE lock_key = ? AND holder = ? AND expires_at > now()",
        )
        .bind::<BigInt, _>(ttl_us)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .execute(self)
        .map(|n| n == 1)
    }

    fn lease_release(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        stmt(
            "UPDATE dlock_leases SET holder = NULL, expires_at = NULL \
             WHERE lock_key = ? AND holder = ?",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .execute(self)
        .map(|n| n == 1)
    }

    fn lease_held(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        stmt(
            "SELECT 1::int8 AS one FROM dlock_leases \
             WHERE lock_key = ? AND holder = ? AND expires_at > now()",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .get_result::<One>(self)
        .optional()
        .map(|r| r.is_some())
    }
}
