//! PostgreSQL's `Row` and `Lease` statements.
// Its statements' texts are `pub` for `__bench_sql` (feature `bench-sql`) only.
#![cfg_attr(not(feature = "bench-sql"), allow(unreachable_pub))]

use super::{lock_timeout_ms, AcquiredRow};
use crate::backend::sealed::Locks;
use crate::backend::shared;
use crate::backend::shared::{exists, One};
use crate::backend::stmt::stmt;
use crate::backend::{Acquired, NO_PLACE};
use crate::key::floor_bucket;
use diesel::pg::PgConnection;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::{OptionalExtension, QueryResult, RunQueryDsl};

// The texts of the statements the benches' raw floors run too (`diesel_lock::__bench_sql`);
// the others are written where they run.

/// The CTEs of `ROW_ACQUIRE` and `ROW_ACQUIRE_IN_LINE` (which add the final SELECT).
macro_rules! row_acquire {
    () => {
        concat!("WITH ", pg_floor!("NOT EXISTS (SELECT 1 FROM dlock_rows WHERE lock_key = ?) \
             AND NOT EXISTS (SELECT 1 FROM dlock_waiters \
                             WHERE lock_key = ? AND id < ? AND expires_at > now())"), ", \
         t AS ( \
           INSERT INTO dlock_tokens AS t (lock_key, token) \
           SELECT ?, ", pg_first_token!("0"), " FROM f \
           ON CONFLICT (lock_key) DO UPDATE SET token = ", pg_next_token!("t.token"), " \
           RETURNING token), \
         i AS ( \
           INSERT INTO dlock_rows (lock_key, owner, holder, token, acquired_at, stale_at) \
           SELECT ?, ?, ?, t.token, clock_timestamp(), clock_timestamp() + ? * interval '1 microsecond' FROM t \
           ON CONFLICT (lock_key) DO NOTHING \
           RETURNING id, token, acquired_at) ")
    };
}

/// `row_acquire`.
///
/// The token counter's row lock serialises every transaction that can insert the key's
/// row, so tokens are handed out in the order the rows are inserted and a later holder
/// always has a larger token (an id from a sequence would not: nextval runs before the
/// unique check, so a slow inserter can win with an older id). A key without a counter row
/// (never used, or purged) starts above the token floor (`pg_floor!`). The counter never goes
/// below the server's epoch (`pg_epoch!`), so tokens keep increasing across a promotion. While the row is visibly
/// held, or a live place of the key's line is ahead of the caller's (`lines.rs`), the
/// counter is not touched at all. A waiter's acquisition removes its own place
/// (`ROW_ACQUIRE_IN_LINE`). The
/// times are clock_timestamp(): now() is when the statement began, before any wait for the
/// counter's row lock.
pub const ROW_ACQUIRE: &str = concat!(row_acquire!(), "SELECT id, token, acquired_at FROM i");

/// `row_acquire` for a waiter with a place (`ROW_ACQUIRE` binds `NO_PLACE` and has nothing
/// to remove): its place goes with the acquisition (`d`).
const ROW_ACQUIRE_IN_LINE: &str = concat!(
    row_acquire!(),
    ", d AS (DELETE FROM dlock_waiters WHERE id = ? AND EXISTS (SELECT 1 FROM i)) \
     SELECT id, token, acquired_at FROM i"
);

/// `row_release`, by id and holder id (`Locks::row_release`). The notification goes to the channel of the first live place in the
/// key's line (`lines.rs`), if that waiter's `Locker` listens: one process is woken, the
/// one whose turn it is. It is sent at commit, so it never arrives before the row is gone.
/// `woken` (0 or 1) is selected only so that `n` runs (a SELECT in WITH runs only as far as
/// it is read); the library reads `one`.
pub const ROW_RELEASE: &str =
    "WITH d AS (DELETE FROM dlock_rows WHERE id = ? AND COALESCE(holder, '') = ? \
                RETURNING lock_key), \
     n AS (SELECT pg_notify(f.channel, f.lock_key) FROM ( \
             SELECT w.channel, w.lock_key FROM dlock_waiters w JOIN d ON w.lock_key = d.lock_key \
             WHERE w.expires_at > now() ORDER BY w.id LIMIT 1) f \
           WHERE f.channel IS NOT NULL) \
     SELECT (SELECT count(*) FROM d) AS one, (SELECT count(*) FROM n) AS woken";

/// The CTEs of `LEASE_ACQUIRE` and `LEASE_ACQUIRE_IN_LINE` (which add the final SELECT).
macro_rules! lease_acquire {
    () => {
        concat!("WITH l AS ( \
       SELECT NOT EXISTS (SELECT 1 FROM dlock_waiters \
                          WHERE lock_key = ? AND id < ? AND expires_at > now()) AS turn), \
     u AS ( \
       UPDATE dlock_leases SET owner = ?, holder_id = ?, \
         token = ", pg_next_token!("token"), ", \
         acquired_at = clock_timestamp(), expires_at = clock_timestamp() + ? * interval '1 microsecond' \
       WHERE lock_key = ? AND (holder_id IS NULL OR expires_at <= now()) \
         AND (shared_until IS NULL OR shared_until <= now()) AND (SELECT turn FROM l) \
       RETURNING token, acquired_at), ",
     pg_floor!("NOT EXISTS (SELECT 1 FROM dlock_leases WHERE lock_key = ?) AND (SELECT turn FROM l)"), ", \
     i AS ( \
       INSERT INTO dlock_leases (lock_key, owner, holder_id, token, acquired_at, expires_at) \
       SELECT ?, ?, ?, ", pg_first_token!("COALESCE((SELECT token FROM dlock_tokens WHERE lock_key = ?), 0)"), ", \
              clock_timestamp(), clock_timestamp() + ? * interval '1 microsecond' FROM f \
       ON CONFLICT (lock_key) DO NOTHING  \
       RETURNING token, acquired_at) ")
    };
}

/// `lease_acquire`.
///
/// One statement. If its snapshot shows the key's row, `u` takes it over when free or
/// expired: an UPDATE re-checks the row's newest version after any wait, so the token it
/// bumps is the latest. If the snapshot shows no row, `i` inserts it with a first token
/// above the token floor (`pg_floor!`, whose lock makes the value the newest) and above a
/// counter a `Row` lock or an older version's purge left in dlock_tokens. A row deleted by
/// `purge` after the snapshot makes `u` find nothing and `i` not run: the attempt fails and
/// is retried with a fresh snapshot. Neither runs while a live
/// place of the key's line is ahead of the caller's (`lines.rs`); a waiter's acquisition
/// removes its own place (`LEASE_ACQUIRE_IN_LINE`). The new times are clock_timestamp(), not now() (the
/// statement's start): `u` may wait for another transaction's update of the row, `t` for
/// the counter's row lock. An expiry a little later than the caller's own count (from
/// before it sent the statement) is on the safe side. `u` also waits out the key's readers
/// and permits: `shared_until` is on the row it updates, so it is re-read after any wait,
/// as every shared acquisition raises it while holding the row's lock (`holders.rs`); a
/// key with shared holders always has its row, so `i` never runs beside them.
pub const LEASE_ACQUIRE: &str = concat!(
    lease_acquire!(),
    "SELECT 0::int8 AS id, token, acquired_at FROM u \
     UNION ALL SELECT 0::int8 AS id, token, acquired_at FROM i"
);

/// `lease_acquire` for a waiter with a place: its place goes with the acquisition (`d`).
const LEASE_ACQUIRE_IN_LINE: &str = concat!(
    lease_acquire!(),
    ", d AS (DELETE FROM dlock_waiters WHERE id = ? \
           AND EXISTS (SELECT 1 FROM u UNION ALL SELECT 1 FROM i)) \
     SELECT 0::int8 AS id, token, acquired_at FROM u \
     UNION ALL SELECT 0::int8 AS id, token, acquired_at FROM i"
);

/// `lease_release`, with the notification `ROW_RELEASE` sends.
pub const LEASE_RELEASE: &str =
    "WITH u AS (UPDATE dlock_leases SET holder_id = NULL, expires_at = NULL \
                WHERE lock_key = ? AND holder_id = ? RETURNING lock_key), \
     n AS (SELECT pg_notify(f.channel, f.lock_key) FROM ( \
             SELECT w.channel, w.lock_key FROM dlock_waiters w JOIN u ON w.lock_key = u.lock_key \
             WHERE w.expires_at > now() ORDER BY w.id LIMIT 1) f \
           WHERE f.channel IS NOT NULL) \
     SELECT (SELECT count(*) FROM u) AS one, (SELECT count(*) FROM n) AS woken";

impl Locks for PgConnection {
    shared::statements!(row_forget, row_held);

    fn row_acquire(
        &mut self,
        key: &str,
        owner: &str,
        holder: &str,
        stale_us: Option<i64>,
        _retry: bool,
        place: i64,
    ) -> QueryResult<Option<Acquired>> {
        let q = |text| {
            stmt(text)
                .bind::<BigInt, _>(floor_bucket(key))
                .bind::<Text, _>(key)
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(place)
                .bind::<Text, _>(key)
                .bind::<Text, _>(key)
                .bind::<Text, _>(owner)
                .bind::<Text, _>(holder)
                .bind::<Nullable<BigInt>, _>(stale_us)
        };
        if place == NO_PLACE {
            q(ROW_ACQUIRE).get_result::<AcquiredRow>(self)
        } else {
            q(ROW_ACQUIRE_IN_LINE)
                .bind::<BigInt, _>(place)
                .get_result::<AcquiredRow>(self)
        }
        .optional()
        .map(|r| r.map(Into::into))
    }

    fn row_delete_stale(&mut self, key: &str) -> QueryResult<bool> {
        // The subquery is a plain snapshot read; the DELETE then locks only that row, by id,
        // and re-checks it: a row deleted and re-inserted meanwhile has another id.
        stmt(
            "DELETE FROM dlock_rows WHERE id = (SELECT id FROM dlock_rows WHERE lock_key = ? \
             AND stale_at <= now())",
        )
        .bind::<Text, _>(key)
        .execute(self)
        .map(|n| n > 0)
    }

    fn row_release(&mut self, id: i64, holder: &str) -> QueryResult<bool> {
        stmt(ROW_RELEASE)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(holder)
            .get_result::<One>(self)
            .map(|r| r.one == 1)
    }

    fn lease_acquire(
        &mut self,
        key: &str,
        owner: &str,
        holder: &str,
        ttl_us: i64,
        _retry: bool,
        place: i64,
    ) -> QueryResult<Option<Acquired>> {
        let q = |text| {
            stmt(text)
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(place)
                .bind::<Text, _>(owner)
                .bind::<Text, _>(holder)
                .bind::<BigInt, _>(ttl_us)
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(floor_bucket(key))
                .bind::<Text, _>(key)
                .bind::<Text, _>(key)
                .bind::<Text, _>(owner)
                .bind::<Text, _>(holder)
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(ttl_us)
        };
        if place == NO_PLACE {
            q(LEASE_ACQUIRE).get_result::<AcquiredRow>(self)
        } else {
            q(LEASE_ACQUIRE_IN_LINE)
                .bind::<BigInt, _>(place)
                .get_result::<AcquiredRow>(self)
        }
        .optional()
        .map(|r| r.map(Into::into))
    }

    fn lease_renew(
        &mut self,
        key: &str,
        holder: &str,
        ttl_us: i64,
        bound: std::time::Duration,
    ) -> QueryResult<bool> {
        // set_config(.., true) lasts until the end of this statement's own transaction, and
        // runs (on the row's filter) before the UPDATE waits for another session's row lock.
        stmt(
            "UPDATE dlock_leases SET expires_at = now() + ? * interval '1 microsecond' \
             WHERE lock_key = ? AND holder_id = ? \
               AND set_config('lock_timeout', ?, true) IS NOT NULL AND expires_at > now()",
        )
        .bind::<BigInt, _>(ttl_us)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .bind::<Text, _>(lock_timeout_ms(bound))
        .execute(self)
        .map(|n| n == 1)
    }

    fn lease_release(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        stmt(LEASE_RELEASE)
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<One>(self)
            .map(|r| r.one == 1)
    }

    fn lease_held(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        exists(
            stmt(
                "SELECT 1::int8 AS one FROM dlock_leases \
                 WHERE lock_key = ? AND holder_id = ? AND expires_at > now()",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<One>(self)
            .optional(),
        )
    }
}
