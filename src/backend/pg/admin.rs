//! PostgreSQL's admin reads, force release, purge and optimistic versions.

use crate::backend::sealed::Admin;
use crate::backend::shared;
use crate::backend::shared::{Key, One};
use crate::backend::stmt::stmt;
use crate::backend::{force_release_in, Held};
use crate::backend::{PurgeTable, PURGE_BATCH};
use crate::lock_info::LockInfo;
use chrono::{DateTime, Utc};
use diesel::pg::PgConnection;
use diesel::sql_types::{BigInt, Nullable, Text, Timestamptz};
use diesel::Connection;
use diesel::OptionalExtension;
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
        // Bounded as the holders' transactions are: a stopped admin must not stall the key.
        self.transaction(|c| {
            super::bound_transaction(c, crate::backend::holders::STALL_CAP, None)?;
            force_release_in(c, key)
        })
    }

    fn purge_stale_rows(&mut self) -> QueryResult<usize> {
        stmt("DELETE FROM dlock_rows WHERE stale_at <= now()").execute(self)
    }

    fn purge_highest(&mut self) -> QueryResult<i64> {
        stmt(
            "SELECT GREATEST((SELECT COALESCE(max(token), 0) FROM dlock_tokens), \
                             (SELECT COALESCE(max(token), 0) FROM dlock_leases)) AS one",
        )
        .get_result::<One>(self)
        .map(|r| r.one)
    }

    fn floor_raise(&mut self, to: i64) -> QueryResult<()> {
        // Waits for the FOR SHARE of first acquisitions (`pg_floor!`), which wait for it.
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
            PurgeTable::KeyRows => shared::boundary!("dlock_for_update"),
            PurgeTable::Kinds => shared::boundary!("dlock_shared_keys"),
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
        // Each batch deletes only rows it could lock at once (SKIP LOCKED): a purge never
        // waits for an acquisition, so none can end up waiting for a purge in a cycle (an
        // acquisition holds its floor bucket's lock while it waits for its counter, and a
        // raise of the floor waits for that lock). The locking subquery re-checks each row on
        // its newest version (a lease taken meanwhile, a counter bumped above `highest`).
        let range = |text| {
            stmt(text)
                .bind::<Text, _>(after)
                .bind::<Nullable<Text>, _>(upto)
                .bind::<Nullable<Text>, _>(upto)
        };
        match table {
            PurgeTable::Counters => range(
                "DELETE FROM dlock_tokens WHERE lock_key IN ( \
                   SELECT lock_key FROM dlock_tokens t \
                   WHERE lock_key > ? AND (?::text IS NULL OR lock_key <= ?) AND token <= ? \
                     AND NOT EXISTS (SELECT 1 FROM dlock_rows r WHERE r.lock_key = t.lock_key) \
                   FOR UPDATE SKIP LOCKED)",
            )
            .bind::<BigInt, _>(highest)
            .execute(self),
            // The key's kind goes with its lease row: locked after it, as every reader's and
            // permit's acquisition locks them (`holders.rs`), and only where no session
            // strategy's permit slots or row use it too.
            PurgeTable::Leases => range(concat!(
                "WITH d AS (DELETE FROM dlock_leases WHERE lock_key IN ( \
                   SELECT lock_key FROM dlock_leases l \
                   WHERE lock_key > ? AND (?::text IS NULL OR lock_key <= ?) AND token <= ? \
                     AND ((holder_id IS NULL AND acquired_at <= now() - ? * interval '1 microsecond') \
                          OR expires_at <= now() - ? * interval '1 microsecond') \
                     AND (shared_until IS NULL OR shared_until <= now() - ? * interval '1 microsecond') \
                     AND NOT EXISTS (SELECT 1 FROM dlock_waiters w \
                                     WHERE w.lock_key = l.lock_key AND w.line = ",
                line_sql!(lease),
                " AND w.expires_at > now()) \
                     AND NOT EXISTS (SELECT 1 FROM dlock_shared_leases s \
                                     WHERE s.lock_key = l.lock_key AND s.expires_at > now()) \
                   FOR UPDATE SKIP LOCKED) RETURNING lock_key), \
                 h AS (DELETE FROM dlock_shared_keys k USING d \
                       WHERE k.lock_key = d.lock_key AND k.intent IS NULL \
                         AND NOT EXISTS (SELECT 1 FROM dlock_permit_slots p \
                                         WHERE p.lock_key = k.lock_key) \
                         AND NOT EXISTS (SELECT 1 FROM dlock_for_update u \
                                         WHERE u.lock_key = k.lock_key) \
                       RETURNING 1) \
                 SELECT (SELECT count(*) FROM d) + (SELECT count(*) FROM h) AS one",
            ))
            .bind::<BigInt, _>(highest)
            .bind::<BigInt, _>(idle_us)
            .bind::<BigInt, _>(idle_us)
            .bind::<BigInt, _>(idle_us)
            .get_result::<One>(self)
            .map(|r| r.one as usize),
            // A holder's transaction keeps its key row locked (FOR UPDATE, or FOR SHARE for
            // readers and permits): skipped. An acquisition waiting for a row deleted here
            // finds it missing once this commits, and makes it again.
            // Only rows older than the grace (`idle_us`): a row is never deleted between its
            // creation and the acquisition that made it, unless the grace is shorter than
            // that. The batch holds the purge gate (`PURGE_GATE`) from before it locks a row
            // until it commits: an acquisition that finds its row locked tells a purge from
            // a holder by it (`SessionLocks::for_update_present`).
            PurgeTable::KeyRows => self.transaction(|c| {
                // Bounded on the server: a purger stopped inside keeps its batch's rows
                // and the gate at most this long.
                super::bound_transaction(c, crate::backend::holders::STALL_CAP, None)?;
                stmt("SELECT pg_advisory_xact_lock(?, ?)")
                    .bind::<diesel::sql_types::Integer, _>(super::PURGE_GATE.0)
                    .bind::<diesel::sql_types::Integer, _>(super::PURGE_GATE.1)
                    .execute(c)?;
                range(
                    "DELETE FROM dlock_for_update WHERE lock_key IN ( \
                       SELECT lock_key FROM dlock_for_update \
                       WHERE lock_key > ? AND (?::text IS NULL OR lock_key <= ?) \
                         AND created_at <= now() - ? * interval '1 microsecond' \
                       FOR UPDATE SKIP LOCKED)",
                )
                .bind::<BigInt, _>(idle_us)
                .execute(c)
            }),
            PurgeTable::Kinds => range(
                "DELETE FROM dlock_shared_keys WHERE lock_key IN ( \
                   SELECT lock_key FROM dlock_shared_keys k \
                   WHERE lock_key > ? AND (?::text IS NULL OR lock_key <= ?) \
                     AND permit_count = 0 \
                     AND created_at <= now() - ? * interval '1 microsecond' \
                     AND (intent IS NULL OR intent_until IS NULL OR intent_until <= clock_timestamp()) \
                     AND NOT EXISTS (SELECT 1 FROM dlock_leases l WHERE l.lock_key = k.lock_key) \
                     AND NOT EXISTS (SELECT 1 FROM dlock_permit_slots p WHERE p.lock_key = k.lock_key) \
                     AND NOT EXISTS (SELECT 1 FROM dlock_for_update u WHERE u.lock_key = k.lock_key) \
                   FOR UPDATE SKIP LOCKED)",
            )
            .bind::<BigInt, _>(idle_us)
            .execute(self),
        }
    }
}
