//! MySQL's statements of the line of waiters (`dlock_waiters`). No notifications here:
//! waiters poll their own place (`line_renew`, an update by primary key and an indexed count).

use crate::backend::sealed::{LineAhead, LineStat, Lines, Spot};
use crate::backend::shared::Mine;
use crate::backend::stmt::stmt;
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Integer, Nullable, Text};
use diesel::{QueryResult, QueryableByName, RunQueryDsl};

use super::LookRow;

/// A look at place `id` of a key's line (`Lines::line_look`), a consistent (non-locking)
/// read of the key's places up to it: binds the place four times, then the key and the
/// place.
macro_rules! look {
    () => {
        "SELECT CAST(COALESCE(SUM(id = ? AND expires_at > UTC_TIMESTAMP(6)), 0) AS SIGNED) \
                  AS mine, \
                CAST(COALESCE(SUM(id < ? AND expires_at > UTC_TIMESTAMP(6) AND granted_at IS NULL), 0) AS SIGNED) \
                  AS ahead, \
                CAST(COALESCE(SUM(id < ? AND expires_at > UTC_TIMESTAMP(6) AND granted_at IS NULL AND shared = 0), 0) \
                  AS SIGNED) AS exclusive, \
                CAST(COALESCE(SUM(id = ? AND expires_at > UTC_TIMESTAMP(6) \
                                  AND granted_at IS NOT NULL), 0) AS SIGNED) AS granted, \
                CAST(NULL AS SIGNED) AS floor \
         FROM dlock_waiters WHERE lock_key = ? AND id <= ?"
    };
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

impl Lines for MysqlConnection {
    crate::backend::shared::statements!(line_leave);

    fn line_join(
        &mut self,
        key: &str,
        owner: &str,
        channel: Option<&str>,
        ttl_us: i64,
        holder: &str,
        shared: bool,
    ) -> QueryResult<i64> {
        // Lapsed places are left to `purge` (and ignored meanwhile): a DELETE by key here
        // would take next-key locks on the key's places and deadlock with other joiners.
        stmt(
            "INSERT INTO dlock_waiters (lock_key, owner, channel, since, expires_at, holder, shared) \
             VALUES (?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?, ?)",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(owner)
        .bind::<Nullable<Text>, _>(channel)
        .bind::<BigInt, _>(ttl_us)
        .bind::<Nullable<Text>, _>((!shared).then_some(holder))
        .bind::<Integer, _>(i32::from(shared))
        .execute(self)?;
        stmt("SELECT CAST(LAST_INSERT_ID() AS SIGNED) AS n")
            .get_result::<Count>(self)
            .map(|c| c.n)
    }

    fn line_ahead(&mut self, key: &str, place: i64) -> QueryResult<LineAhead> {
        // A consistent (non-locking) read: at READ COMMITTED (the holders' transaction) or
        // outside a transaction, the newest committed places.
        stmt(
            "SELECT CAST(COUNT(*) AS SIGNED) AS ahead, \
                    CAST(COALESCE(SUM(shared = 0), 0) AS SIGNED) AS exclusive \
             FROM dlock_waiters \
             WHERE lock_key = ? AND id < ? AND expires_at > UTC_TIMESTAMP(6) AND granted_at IS NULL",
        )
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(place)
        .get_result(self)
    }

    fn line_renew(
        &mut self,
        key: &str,
        id: i64,
        ttl_us: i64,
        floor: i64,
    ) -> QueryResult<Option<Spot>> {
        // A granted place is not renewed (its expiry is its grant's deadline): the look
        // below then reports it granted.
        stmt(
            "UPDATE dlock_waiters SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
             WHERE id = ? AND expires_at > UTC_TIMESTAMP(6) AND granted_at IS NULL",
        )
        .bind::<BigInt, _>(ttl_us)
        .bind::<BigInt, _>(id)
        .execute(self)?;
        self.line_look(key, id, floor)
    }

    fn line_look(&mut self, key: &str, id: i64, _floor: i64) -> QueryResult<Option<Spot>> {
        stmt(look!())
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(key)
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
        // One consistent read: the release that granted the place gave the lease in the
        // same transaction.
        stmt(concat!(
            "SELECT l.mine, l.ahead, l.exclusive, l.granted, l.floor, g.token, g.acquired_at \
             FROM (",
            look!(),
            ") l LEFT JOIN dlock_leases g \
               ON g.lock_key = ? AND g.holder_id = ? AND g.expires_at > UTC_TIMESTAMP(6)"
        ))
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .get_result::<LookRow>(self)
        .map(LookRow::spot)
    }

    fn line_stats(&mut self, key: Option<&str>) -> QueryResult<Vec<LineStat>> {
        stmt(
            "SELECT CAST(lock_key AS CHAR) AS lock_key, CAST(COUNT(*) AS SIGNED) AS waiting, \
                    CAST(TIMESTAMPDIFF(MICROSECOND, MIN(since), UTC_TIMESTAMP(6)) AS SIGNED) \
                      AS longest_us \
             FROM dlock_waiters WHERE expires_at > UTC_TIMESTAMP(6) AND granted_at IS NULL \
               AND (? IS NULL OR lock_key = ?) \
             GROUP BY lock_key",
        )
        .bind::<Nullable<Text>, _>(key)
        .bind::<Nullable<Text>, _>(key)
        .load(self)
    }

    fn purge_lapsed_places(&mut self) -> QueryResult<usize> {
        stmt("DELETE FROM dlock_waiters WHERE expires_at <= UTC_TIMESTAMP(6)").execute(self)
    }
}
