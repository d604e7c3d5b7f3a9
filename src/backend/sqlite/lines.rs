//! SQLite's statements of the line of waiters (`dlock_waiters`). No notifications here:
//! waiters poll their own place (`line_renew`).

use crate::backend::sealed::{Joined, LineAhead, LineStat, Lines, Spot};
use crate::backend::shared::Mine;
use crate::backend::stmt::stmt;
use crate::backend::Line;
use diesel::sql_types::{BigInt, Integer, Nullable, Text};
use diesel::sqlite::SqliteConnection;
use diesel::{QueryResult, QueryableByName, RunQueryDsl};

use super::busy::short_write;
use super::{seconds, LookRow};

/// A look at place `id` of a key's line (`Lines::line_look`), a read (in WAL mode it never
/// waits for the writer): binds the place four times, then the key, the line and the place.
macro_rules! look {
    () => {
        "SELECT COALESCE(SUM(id = ? AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')), 0) \
                  AS mine, \
                COALESCE(SUM(id < ? AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') AND granted_at IS NULL), 0) \
                  AS ahead, \
                COALESCE(SUM(id < ? AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') AND granted_at IS NULL \
                             AND shared = 0), 0) AS exclusive, \
                COALESCE(SUM(id = ? AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
                             AND granted_at IS NOT NULL), 0) AS granted, \
                CAST(NULL AS INTEGER) AS floor \
         FROM dlock_waiters WHERE lock_key = ? AND line = ? AND id <= ?"
    };
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

impl Lines for SqliteConnection {
    fn line_join(
        &mut self,
        key: &str,
        line: Line,
        owner: &str,
        channel: Option<&str>,
        ttl_us: i64,
        holder: &str,
        shared: bool,
        flag: bool,
    ) -> QueryResult<Joined> {
        // One write (a second, to delete the key's lapsed places, would queue for the write
        // lock once more: lapsed places are ignored, and `purge` removes them), waiting for
        // the write lock at µs scale (`busy.rs`). A `Lease` key's row no longer says that
        // nobody waits (`line_free`), in the same transaction.
        short_write(self, |c| {
            let id = stmt(
                "INSERT INTO dlock_waiters \
                   (lock_key, line, owner, channel, since, expires_at, holder, shared) \
                 VALUES (?, ?, ?, ?, strftime('%Y-%m-%d %H:%M:%f', 'now'), \
                         strftime('%Y-%m-%d %H:%M:%f', 'now', ?), ?, ?) \
                 RETURNING id AS n",
            )
            .bind::<Text, _>(key)
            .bind::<Integer, _>(line.id())
            .bind::<Text, _>(owner)
            .bind::<Nullable<Text>, _>(channel)
            .bind::<Text, _>(seconds('+', ttl_us))
            .bind::<Nullable<Text>, _>((!shared).then_some(holder))
            .bind::<Integer, _>(i32::from(shared))
            .get_result::<Count>(c)?
            .n;
            if flag {
                stmt("UPDATE dlock_leases SET line_free = 0 WHERE lock_key = ? AND line_free")
                    .bind::<Text, _>(key)
                    .execute(c)?;
            }
            Ok(Joined { id })
        })
    }

    fn line_ahead(&mut self, key: &str, line: Line, place: i64) -> QueryResult<LineAhead> {
        stmt(
            "SELECT COUNT(*) AS ahead, COALESCE(SUM(shared = 0), 0) AS exclusive \
             FROM dlock_waiters WHERE lock_key = ? AND line = ? AND id < ? \
               AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') AND granted_at IS NULL",
        )
        .bind::<Text, _>(key)
        .bind::<Integer, _>(line.id())
        .bind::<BigInt, _>(place)
        .get_result(self)
    }

    fn line_renew(
        &mut self,
        key: &str,
        line: Line,
        id: i64,
        ttl_us: i64,
        floor: i64,
    ) -> QueryResult<Option<Spot>> {
        // A granted place is not renewed (its expiry is its grant's deadline): the look
        // below then reports it granted.
        short_write(self, |c| {
            stmt(
                "UPDATE dlock_waiters SET expires_at = strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
                 WHERE id = ? AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
                   AND granted_at IS NULL",
            )
            .bind::<Text, _>(seconds('+', ttl_us))
            .bind::<BigInt, _>(id)
            .execute(c)
        })?;
        self.line_look(key, line, id, floor)
    }

    fn line_look(
        &mut self,
        key: &str,
        line: Line,
        id: i64,
        _floor: i64,
    ) -> QueryResult<Option<Spot>> {
        stmt(look!())
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(key)
            .bind::<Integer, _>(line.id())
            .bind::<BigInt, _>(id)
            .get_result::<Mine>(self)
            .map(Mine::spot)
    }

    fn line_look_lease(
        &mut self,
        key: &str,
        id: i64,
        _floor: i64,
        holder: &str,
    ) -> QueryResult<Option<Spot>> {
        // One read (one snapshot): the release that granted the place gave the lease in
        // the same transaction.
        stmt(concat!(
            "SELECT l.mine, l.ahead, l.exclusive, l.granted, l.floor, g.token, g.acquired_at \
             FROM (",
            look!(),
            ") l LEFT JOIN dlock_leases g \
               ON g.lock_key = ? AND g.holder_id = ? \
              AND g.expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')"
        ))
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(key)
        .bind::<Integer, _>(Line::Lease.id())
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .get_result::<LookRow>(self)
        .map(LookRow::spot)
    }

    fn line_leave(&mut self, _key: &str, _line: Line, id: i64) -> QueryResult<bool> {
        short_write(self, |c| {
            stmt("DELETE FROM dlock_waiters WHERE id = ? RETURNING (granted_at IS NOT NULL) AS n")
                .bind::<BigInt, _>(id)
                .get_results::<Count>(c)
                .map(|r| r.iter().any(|c| c.n == 1))
        })
    }

    fn line_stats(&mut self, key: Option<&str>) -> QueryResult<Vec<LineStat>> {
        stmt(
            "SELECT lock_key, line, COUNT(*) AS waiting, \
                    CAST((julianday('now') - julianday(MIN(since))) * 86400000000 AS INTEGER) \
                      AS longest_us \
             FROM dlock_waiters WHERE expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
               AND granted_at IS NULL AND (? IS NULL OR lock_key = ?) \
             GROUP BY lock_key, line",
        )
        .bind::<Nullable<Text>, _>(key)
        .bind::<Nullable<Text>, _>(key)
        .load(self)
    }

    fn purge_lapsed_places(&mut self) -> QueryResult<usize> {
        stmt(
            "DELETE FROM dlock_waiters \
             WHERE expires_at <= strftime('%Y-%m-%d %H:%M:%f', 'now')",
        )
        .execute(self)
    }
}
