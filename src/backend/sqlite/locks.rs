//! SQLite's `Row` and `Lease` statements.
// Its statements' texts are `pub` for `__bench_sql` (feature `bench-sql`) only.
#![cfg_attr(not(feature = "bench-sql"), allow(unreachable_pub))]

use super::{seconds, AcquiredRow};
use crate::backend::sealed::Locks;
use crate::backend::shared;
use crate::backend::shared::{exists, HolderId, One};
use crate::backend::stmt::{in_list, pad, stmt, BATCH_SIZES};
use crate::backend::{Acquired, Line};
use crate::key::floor_bucket;
use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text};
use diesel::sqlite::SqliteConnection;
use diesel::{OptionalExtension, QueryResult, RunQueryDsl};
use std::sync::OnceLock;

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
     WHERE NOT EXISTS (SELECT 1 FROM dlock_waiters WHERE lock_key = ? AND line = ",
    line_sql!(row),
    " AND id < ? \
                       AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') AND granted_at IS NULL) \
     ON CONFLICT (lock_key) DO NOTHING \
     RETURNING id, token, acquired_at"
);

/// `lease_acquire`. The line is looked into only if the key's row does not say that nobody
/// waits (`line_free`, migration 19: cleared by every join in its write, set by a release
/// that found no live place under the same write lock, and by this statement's insert of
/// a new row for a newcomer, whose look found nobody). A row with live readers or permits (`shared_until`, raised by each of
/// them under the same single write lock: `holders.rs`) is not taken; a key with shared
/// holders always has its row, so the INSERT never runs beside them.
pub const LEASE_ACQUIRE: &str = concat!(
    "INSERT INTO dlock_leases (lock_key, owner, holder_id, token, acquired_at, expires_at, line_free) \
     SELECT ?, ?, ?, ",
    sqlite_next_token!("(SELECT token FROM dlock_tokens WHERE lock_key = ?)"),
    ", \
             strftime('%Y-%m-%d %H:%M:%f', 'now'), \
             strftime('%Y-%m-%d %H:%M:%f', 'now', ?), ? \
     WHERE COALESCE((SELECT line_free FROM dlock_leases WHERE lock_key = ?), 0) \
        OR NOT EXISTS (SELECT 1 FROM dlock_waiters WHERE lock_key = ? AND line = ",
    line_sql!(lease),
    " AND id < ? \
                       AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') AND granted_at IS NULL) \
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

/// `row_release` when nobody waits: the DELETE by id and holder id, if no live place of the
/// key's line waits for a grant (else the hand-over runs).
pub const ROW_RELEASE_ALONE: &str = concat!(
    "DELETE FROM dlock_rows WHERE id = ? AND COALESCE(holder, '') = ? \
     AND NOT EXISTS (SELECT 1 FROM dlock_waiters w WHERE w.lock_key = dlock_rows.lock_key \
       AND w.line = ",
    line_sql!(row),
    " AND w.expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
       AND w.granted_at IS NULL AND w.holder IS NOT NULL)"
);

/// `lease_release` when nobody waits: the row says so (`line_free`, see `LEASE_ACQUIRE`),
/// with no look into the line; else the hand-over runs.
pub const LEASE_RELEASE_ALONE: &str =
    "UPDATE dlock_leases SET holder_id = NULL, expires_at = NULL \
     WHERE lock_key = ? AND holder_id = ? AND line_free";

impl Locks for SqliteConnection {
    shared::statements!(row_forget, row_held, row_give_back);

    fn row_release(&mut self, id: i64, holder: &str) -> QueryResult<bool> {
        // The plain DELETE when nobody waits (one statement); otherwise the hand-over, in one
        // short IMMEDIATE transaction (`busy.rs`). (Both in that transaction would cost every
        // release outside a line its BEGIN, COMMIT and the busy timeout's toggling: the
        // one-thread cycle ran 20-30 % slower, measured on a loaded machine; this DELETE, just
        // after the holder's own confirmation, seldom meets another writer.)
        let n = stmt(ROW_RELEASE_ALONE)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(holder)
            .execute(self)?;
        if n == 1 {
            return Ok(true);
        }
        self.row_release_granted(id, holder)
    }

    fn row_release_granted(&mut self, id: i64, holder: &str) -> QueryResult<bool> {
        let granted = write_txn(self, |c| {
            let key = stmt(
                "SELECT lock_key AS n FROM dlock_rows WHERE id = ? AND COALESCE(holder, '') = ?",
            )
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(holder)
            .get_result::<KeyOf>(c)
            .optional()?;
            let Some(key) = key else {
                return Ok((false, None));
            };
            let Some(w) = first_place(c, &key.n, Line::Row)? else {
                return stmt(shared::ROW_RELEASE)
                    .bind::<BigInt, _>(id)
                    .bind::<Text, _>(holder)
                    .execute(c)
                    .map(|n| (n == 1, None));
            };
            // The key's next token: its own counter (the row's token, which the insert
            // trigger keeps in dlock_tokens too).
            let granted = stmt(
                "UPDATE dlock_rows SET owner = ?, holder = ?, token = token + 1, \
                   acquired_at = strftime('%Y-%m-%d %H:%M:%f', 'now'), stale_at = ? \
                 WHERE id = ? AND COALESCE(holder, '') = ? RETURNING token AS n",
            )
            .bind::<Text, _>(&w.owner)
            .bind::<Text, _>(&w.holder)
            .bind::<Text, _>(&w.expires_at)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(holder)
            .get_result::<Count>(c)
            .optional()?;
            let Some(token) = granted else {
                return Ok((false, None));
            };
            stmt(
                "INSERT INTO dlock_tokens (lock_key, token) VALUES (?, ?) \
                 ON CONFLICT (lock_key) DO UPDATE SET token = excluded.token",
            )
            .bind::<Text, _>(&w.lock_key)
            .bind::<BigInt, _>(token.n)
            .execute(c)?;
            grant(c, w.id)?;
            Ok((true, Some(w)))
        })?;
        Ok(rung(granted))
    }

    fn lease_release(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        // As `row_release`.
        let n = stmt(LEASE_RELEASE_ALONE)
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .execute(self)?;
        if n == 1 {
            return Ok(true);
        }
        lease_hand_over(self, key, holder)
    }

    fn lease_release_granted(&mut self, key: &str, holder: &str, _place: i64) -> QueryResult<bool> {
        // A lease a release granted: others were in line a moment ago, and most likely still
        // are. The hand-over's transaction at once, without the plain UPDATE first, which
        // would take the write lock only to find a place waiting. (Its place goes by the
        // trigger of migration 18.)
        lease_hand_over(self, key, holder)
    }

    fn row_confirm(
        &mut self,
        key: &str,
        place: i64,
        holder: &str,
        stale_us: Option<i64>,
    ) -> QueryResult<Option<Acquired>> {
        confirm(self, place, |c| {
            stmt(
                "UPDATE dlock_rows SET stale_at = strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
                 WHERE lock_key = ? AND holder = ? \
                   AND stale_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
                 RETURNING id, token, acquired_at",
            )
            .bind::<Nullable<Text>, _>(stale_us.map(|us| seconds('+', us)))
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<AcquiredRow>(c)
            .optional()
        })
    }

    fn lease_confirm(
        &mut self,
        key: &str,
        place: i64,
        holder: &str,
        ttl_us: i64,
    ) -> QueryResult<Option<Acquired>> {
        confirm(self, place, |c| {
            stmt(
                "UPDATE dlock_leases SET expires_at = strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
                 WHERE lock_key = ? AND holder_id = ? \
                   AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
                 RETURNING 0 AS id, token, acquired_at",
            )
            .bind::<Text, _>(seconds('+', ttl_us))
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<AcquiredRow>(c)
            .optional()
        })
    }

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
                concat!(
                    "SELECT 1 AS one WHERE EXISTS (SELECT 1 FROM dlock_rows WHERE lock_key = ?) \
                     OR EXISTS (SELECT 1 FROM dlock_waiters WHERE lock_key = ? AND line = ",
                    line_sql!(row),
                    " AND id < ? \
                       AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') AND granted_at IS NULL)"
                ),
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
        // Every attempt that finds the key held asks this: a read first (in WAL mode it never
        // waits for the writer), so that a held key costs no take of the write lock. The
        // DELETE was otherwise one for each try of a waiter and two for each re-entry of a
        // releaser into the line, meeting the hand-overs of the others (and a process
        // stopped in it held every writer up). The DELETE checks again.
        if !exists(
            stmt(
                "SELECT 1 AS one FROM dlock_rows WHERE lock_key = ? \
                 AND stale_at <= strftime('%Y-%m-%d %H:%M:%f', 'now')",
            )
            .bind::<Text, _>(key)
            .get_result::<One>(self)
            .optional(),
        )? {
            return Ok(false);
        }
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
                concat!(
                "SELECT 1 AS one WHERE EXISTS (SELECT 1 FROM dlock_leases WHERE lock_key = ? \
                     AND (holder_id IS NOT NULL \
                          AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
                          OR shared_until > strftime('%Y-%m-%d %H:%M:%f', 'now'))) \
                   OR EXISTS (SELECT 1 FROM dlock_waiters WHERE lock_key = ? AND line = ",
                line_sql!(lease),
                " AND id < ? \
                              AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') AND granted_at IS NULL)"
                ),
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
                .bind::<Bool, _>(place == crate::backend::NO_PLACE)
                .bind::<Text, _>(key)
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

    fn lease_renew_many(
        &mut self,
        leases: &[(String, String)],
        ttl_us: i64,
    ) -> QueryResult<Vec<String>> {
        static TEXTS: [OnceLock<String>; BATCH_SIZES.len()] =
            [const { OnceLock::new() }; BATCH_SIZES.len()];
        // Holder ids are 128 random bits: the pair of lists matches exactly our leases.
        let leases = pad(leases.to_vec());
        let (keys, holders): (Vec<String>, Vec<String>) = leases.into_iter().unzip();
        let sql = in_list(
            &TEXTS,
            "UPDATE dlock_leases SET expires_at = strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
             WHERE lock_key IN ({}) AND holder_id IN ({}) \
               AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
             RETURNING holder_id",
            keys.len(),
        );
        stmt(sql)
            .bind::<Text, _>(seconds('+', ttl_us))
            .bind_many::<Text, _>(keys)
            .bind_many::<Text, _>(holders)
            .load::<HolderId>(self)
            .map(|rows| rows.into_iter().map(|r| r.holder_id).collect())
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

/// Runs an acquiring statement; a waiter's (one with a place) runs in one short IMMEDIATE
/// transaction with the removal of its place (`busy.rs`), so that the two take the
/// database's write lock once.
fn in_line(
    conn: &mut SqliteConnection,
    place: i64,
    acquire: impl Fn(&mut SqliteConnection) -> QueryResult<Option<Acquired>>,
) -> QueryResult<Option<Acquired>> {
    if place == crate::backend::NO_PLACE {
        return acquire(conn);
    }
    write_txn(conn, |c| {
        let acquired = acquire(c)?;
        if acquired.is_some() {
            stmt(shared::LEAVE_PLACE)
                .bind::<BigInt, _>(place)
                .execute(c)?;
        }
        Ok(acquired)
    })
}

/// `lease_release`'s hand-over, in one short IMMEDIATE transaction: the lease goes to the
/// first live place waiting (its doorbell rung once committed), or, with nobody waiting,
/// is cleared.
fn lease_hand_over(c: &mut SqliteConnection, key: &str, holder: &str) -> QueryResult<bool> {
    let granted = write_txn(c, |c| {
        let Some(w) = first_place(c, key, Line::Lease)? else {
            let n = stmt(shared::LEASE_RELEASE)
                .bind::<Text, _>(key)
                .bind::<Text, _>(holder)
                .execute(c)?;
            // Under the write lock every join waits: with no live place left, the row says
            // that nobody waits, for the next acquisitions and releases to skip the line.
            stmt(concat!(
                "UPDATE dlock_leases SET line_free = 1 WHERE lock_key = ? AND NOT line_free \
                     AND NOT EXISTS (SELECT 1 FROM dlock_waiters WHERE lock_key = ? AND line = ",
                line_sql!(lease),
                " AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now'))"
            ))
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .execute(c)?;
            return Ok((n == 1, None));
        };
        let n = stmt(
            "UPDATE dlock_leases SET owner = ?, holder_id = ?, token = token + 1, \
                   acquired_at = strftime('%Y-%m-%d %H:%M:%f', 'now'), expires_at = ? \
                 WHERE lock_key = ? AND holder_id = ? \
                   AND (shared_until IS NULL \
                        OR shared_until <= strftime('%Y-%m-%d %H:%M:%f', 'now'))",
        )
        .bind::<Text, _>(&w.owner)
        .bind::<Text, _>(&w.holder)
        .bind::<Text, _>(&w.expires_at)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .execute(c)?;
        if n == 1 {
            grant(c, w.id)?;
            return Ok((true, Some(w)));
        }
        // Not ours any more; or ours, expired, with readers or permits come in since: no
        // writer is let in beside them, the plain release only (found by the hand-over's
        // adversary).
        stmt(shared::LEASE_RELEASE)
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .execute(c)
            .map(|n| (n == 1, None))
    })?;
    Ok(rung(granted))
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(diesel::QueryableByName)]
struct KeyOf {
    #[diesel(sql_type = Text)]
    n: String,
}

/// The first live place of a key's line not granted yet.
#[derive(diesel::QueryableByName)]
struct FirstPlace {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    lock_key: String,
    #[diesel(sql_type = Text)]
    owner: String,
    #[diesel(sql_type = Text)]
    holder: String,
    #[diesel(sql_type = Text)]
    expires_at: String,
    #[diesel(sql_type = Nullable<Text>)]
    channel: Option<String>,
}

/// Inside a release's IMMEDIATE transaction: the first live place of `key`'s `line` not
/// granted yet, if any.
fn first_place(
    conn: &mut SqliteConnection,
    key: &str,
    line: Line,
) -> QueryResult<Option<FirstPlace>> {
    stmt(FIRST_PLACE)
        .bind::<Text, _>(key)
        .bind::<Integer, _>(line.id())
        .get_result::<FirstPlace>(conn)
        .optional()
}

/// The first live place of a key's line that no release has granted the key yet.
/// Only an exclusive waiter's place is granted: a reader's or a permit's (`shared`, no holder
/// id) first in line means no grant (the key is freed and its waiter takes it).
const FIRST_PLACE: &str = "SELECT id, lock_key, owner, holder, expires_at, channel FROM ( \
       SELECT id, lock_key, owner, holder, expires_at, channel FROM dlock_waiters \
       WHERE lock_key = ? AND line = ? AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
         AND granted_at IS NULL ORDER BY id LIMIT 1) \
     WHERE holder IS NOT NULL";

/// Marks place `id` granted (inside the release's transaction).
fn grant(conn: &mut SqliteConnection, id: i64) -> QueryResult<()> {
    stmt("UPDATE dlock_waiters SET granted_at = strftime('%Y-%m-%d %H:%M:%f', 'now') WHERE id = ?")
        .bind::<BigInt, _>(id)
        .execute(conn)
        .map(drop)
}

/// A confirmation: `update` (extending the granted lock, while still the holder's and
/// within its deadline) and the removal of the place, in one IMMEDIATE transaction.
fn confirm(
    conn: &mut SqliteConnection,
    place: i64,
    mut update: impl FnMut(&mut SqliteConnection) -> QueryResult<Option<AcquiredRow>>,
) -> QueryResult<Option<Acquired>> {
    write_txn(conn, |c| {
        let a = update(c)?;
        if a.is_some() {
            stmt(shared::LEAVE_PLACE)
                .bind::<BigInt, _>(place)
                .execute(c)?;
        }
        Ok(a.map(Into::into))
    })
}

/// A short IMMEDIATE transaction (the write lock first, waited for at µs scale:
/// `busy.rs`), or a savepoint inside the caller's own (`admin::force_release` releases
/// inside one).
fn write_txn<T>(
    conn: &mut SqliteConnection,
    f: impl FnMut(&mut SqliteConnection) -> QueryResult<T>,
) -> QueryResult<T> {
    super::busy::short_write(conn, f)
}

/// After a release's transaction: rings the doorbell of the place it granted the key, if any
/// (`doorbell.rs`); the release's answer.
fn rung((released, granted): (bool, Option<FirstPlace>)) -> bool {
    #[cfg(target_os = "linux")]
    if let Some(w) = granted {
        super::doorbell::ring(w.channel.as_deref(), &w.lock_key);
    }
    #[cfg(not(target_os = "linux"))]
    drop(granted);
    released
}
