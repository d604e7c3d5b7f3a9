//! PostgreSQL's admin reads, force release, purge and optimistic versions.

use crate::backend::sealed::Admin;
use crate::backend::shared;
use crate::backend::stmt::stmt;
use crate::backend::{force_release_in, Held};
use crate::lock_info::LockInfo;
use chrono::{DateTime, Utc};
use diesel::pg::PgConnection;
use diesel::sql_types::{BigInt, Text, Timestamptz};
use diesel::Connection;
use diesel::{QueryResult, RunQueryDsl};

shared::held_row!(Timestamptz, DateTime<Utc>, |t| t);

impl Admin for PgConnection {
    shared::statements!(version_read, version_bump, version_create);

    fn admin_rows(&mut self, key: Option<&str>) -> QueryResult<Vec<Held>> {
        let rows = match key {
            None => stmt(
                "SELECT id, COALESCE(holder, '') AS holder, lock_key, owner, token, acquired_at, \
                        NULL::timestamptz AS expires_at, now() AS observed_at \
                 FROM dlock_rows ORDER BY lock_key",
            )
            .load(self),
            Some(key) => stmt(
                "SELECT id, COALESCE(holder, '') AS holder, lock_key, owner, token, acquired_at, \
                        NULL::timestamptz AS expires_at, now() AS observed_at \
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
                "SELECT 0::int8 AS id, holder_id AS holder, lock_key, COALESCE(owner, '') AS owner, token, \
                        acquired_at, expires_at, now() AS observed_at \
                 FROM dlock_leases \
                 WHERE holder_id IS NOT NULL AND holder_id <> '' AND expires_at > now() AND acquired_at IS NOT NULL \
                 ORDER BY lock_key",
            )
            .load(self),
            Some(key) => stmt(
                "SELECT 0::int8 AS id, holder_id AS holder, lock_key, COALESCE(owner, '') AS owner, token, \
                        acquired_at, expires_at, now() AS observed_at \
                 FROM dlock_leases \
                 WHERE lock_key = ? AND holder_id IS NOT NULL AND holder_id <> '' AND expires_at > now() \
                   AND acquired_at IS NOT NULL",
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
        stmt("DELETE FROM dlock_rows WHERE stale_at <= now()").execute(self)
    }

    fn purge_mark_leases(&mut self, idle_us: i64) -> QueryResult<usize> {
        // A free row keeps the time of its last acquisition; an expired one its expiry. A
        // row whose readers or permits were live since is not idle (`shared_until`).
        stmt(
            "WITH m AS ( \
               UPDATE dlock_leases SET holder_id = '', expires_at = now() \
               WHERE ((holder_id IS NULL AND acquired_at <= now() - ? * interval '1 microsecond') \
                      OR expires_at <= now() - ? * interval '1 microsecond') \
                 AND (shared_until IS NULL OR shared_until <= now() - ? * interval '1 microsecond') \
               RETURNING lock_key, token) \
             INSERT INTO dlock_tokens AS t (lock_key, token) SELECT lock_key, token FROM m \
             ON CONFLICT (lock_key) DO UPDATE SET token = GREATEST(t.token, EXCLUDED.token)",
        )
        .bind::<BigInt, _>(idle_us)
        .bind::<BigInt, _>(idle_us)
        .bind::<BigInt, _>(idle_us)
        .execute(self)
    }

    fn purge_delete_leases(&mut self) -> QueryResult<usize> {
        stmt(
            "DELETE FROM dlock_leases l USING dlock_tokens t \
             WHERE l.holder_id = '' AND t.lock_key = l.lock_key AND l.token <= t.token",
        )
        .execute(self)
    }
}
