//! PostgreSQL's statements of the line of waiters (`dlock_waiters`).

use crate::backend::sealed::{Joined, LineAhead, LineStat, Lines, Spot};
use crate::backend::shared::Mine;
use crate::backend::stmt::stmt;
use crate::backend::Line;
use diesel::pg::PgConnection;
use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text};
use diesel::{QueryResult, QueryableByName, RunQueryDsl};

use super::LookRow;

/// A look at place `id` of a key's line (`Lines::line_look`): binds the place four times,
/// then the key, the line, the floor and the place.
macro_rules! look {
    () => {
        "SELECT count(*) FILTER (WHERE id = ? AND expires_at > now()) AS mine, \
                count(*) FILTER (WHERE id < ? AND expires_at > now() AND granted_at IS NULL) AS ahead, \
                count(*) FILTER (WHERE id < ? AND expires_at > now() AND granted_at IS NULL AND shared = 0) \
                  AS exclusive, \
                count(*) FILTER (WHERE id = ? AND expires_at > now() \
                                 AND granted_at IS NOT NULL) AS granted, \
                min(id) FILTER (WHERE expires_at > now() AND granted_at IS NULL) AS floor \
         FROM dlock_waiters WHERE lock_key = ? AND line = ? AND id >= ? AND id <= ?"
    };
}

const LOOK: &str = look!();

/// `line_join`'s first step: the key's lease row, if it has one, no longer says that nobody waits
/// (`line_free`, which lets `Lease`'s acquisition and release skip their look into the
/// line: `locks.rs`), and counts one join more (`line_joins`), which tells a release about
/// to set `line_free` that a place may have come after its snapshot. An UPDATE: it waits
/// for any statement holding the row, and marks its newest version. Binds the key.
macro_rules! line_flag {
    () => {
        "UPDATE dlock_leases SET line_free = false, line_joins = line_joins + 1 WHERE lock_key = ?"
    };
}

/// What `line_join`'s statement returns.
#[derive(QueryableByName)]
struct JoinedRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// What `line_leave` answers: the notifications sent (read so that they are sent) and
/// whether the place had been granted.
#[derive(QueryableByName)]
struct Left {
    #[diesel(sql_type = BigInt)]
    #[allow(dead_code)]
    id: i64,
    #[diesel(sql_type = BigInt)]
    granted: i64,
}

impl Lines for PgConnection {
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
        // The key's lease row, if `flag` asks for it, is marked first (`fu`, before the
        // place is written: `line_flag!`). If `fu` marked none (the snapshot shows no row,
        // or a purge deleted it since), the row is inserted marked (`fi`: free, its token
        // at the token floor `f`, as `create_lease` makes it), or, if another's insert of
        // it came first (a newcomer taking the key), marked once that insert is committed
        // (ON CONFLICT waits for it). A join that marked nothing let that newcomer's
        // release, whose snapshot predated the place, say that nobody waits, and the next
        // newcomer took the key past the place (an adversary beside purges: 3 of 885
        // newcomer takes). The key's lapsed places go in the same statement (a dead
        // waiter's place would otherwise stay until a purge; it is ignored meanwhile, as every
        // statement here asks for live places only), skipping any another statement has
        // locked: the join then waits for no place's lock while it holds the lease row's.
        // Its commit waits for the WAL's flush like any other. A join that did not
        // (`synchronous_commit` off for its own transaction) gave 15–35 % more `Lease`
        // hand-overs across 8 processes (27 Nov), but a crash then handed out again place
        // ids whose sequence advance was not flushed yet, while waiters that held them
        // went on renewing by id: two waiters on one place, served out of order (an
        // adversary, 1 of 6 bursts of joins crashed). Places are found by id alone. Ids
        // of the server's clock (µs × 1,024 plus the sequence's low bits, above the line's
        // highest) fixed that while the clock moves on, but a clock that read the same
        // microsecond after a restart (frozen, or put back by the outage's length) handed
        // a lost join's id out again (the third adversary, 3 of 12 crashed runs): an
        // unflushed join needs a place number that a crash cannot give out twice, and
        // places matched by the waiter's holder id too; until then, the flush.
        stmt(concat!(
            "WITH fu AS (",
            line_flag!(),
            " AND ? RETURNING 1), ",
            pg_floor!("? AND NOT EXISTS (SELECT 1 FROM fu)"),
            ", fi AS (INSERT INTO dlock_leases (lock_key, token, acquired_at, line_joins) \
               SELECT ?, GREATEST(f.floor_token, \
                                  COALESCE((SELECT token FROM dlock_tokens WHERE lock_key = ?), 0)), \
                      statement_timestamp(), 1 FROM f \
               ON CONFLICT (lock_key) DO UPDATE \
                 SET line_free = false, line_joins = dlock_leases.line_joins + 1 \
               RETURNING 1), \
             marked AS (SELECT 1 FROM fu UNION ALL SELECT 1 FROM fi), \
             gone AS (DELETE FROM dlock_waiters WHERE id IN ( \
               SELECT id FROM dlock_waiters WHERE lock_key = ? AND expires_at <= now() \
               FOR UPDATE SKIP LOCKED)), \
             i AS (INSERT INTO dlock_waiters (lock_key, line, owner, channel, since, expires_at, holder, shared) \
               SELECT ?, ?, ?, ?, clock_timestamp(), clock_timestamp() + ? * interval '1 microsecond', ?, ? \
               FROM (SELECT count(*) AS n FROM marked) x \
               RETURNING id) \
             SELECT i.id FROM i"
        ))
        .bind::<Text, _>(key)
        .bind::<Bool, _>(flag)
        .bind::<BigInt, _>(crate::key::floor_bucket(key))
        .bind::<Bool, _>(flag)
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<Integer, _>(line.id())
        .bind::<Text, _>(owner)
        .bind::<Nullable<Text>, _>(channel)
        .bind::<BigInt, _>(ttl_us)
        .bind::<Nullable<Text>, _>((!shared).then_some(holder))
        .bind::<Integer, _>(i32::from(shared))
        .get_result::<JoinedRow>(self)
        .map(|r| Joined { id: r.id })
    }

    fn line_ahead(&mut self, key: &str, line: Line, place: i64) -> QueryResult<LineAhead> {
        stmt(
            "SELECT count(*) AS ahead, count(*) FILTER (WHERE shared = 0) AS exclusive \
             FROM dlock_waiters \
             WHERE lock_key = ? AND line = ? AND id < ? AND expires_at > statement_timestamp() \
               AND granted_at IS NULL",
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
        stmt(
            "WITH u AS (UPDATE dlock_waiters \
                        SET expires_at = clock_timestamp() + ? * interval '1 microsecond' \
                        WHERE id = ? AND expires_at > now() AND granted_at IS NULL RETURNING id) \
             , w AS (SELECT id, shared FROM dlock_waiters \
                     WHERE lock_key = ? AND line = ? AND id >= ? AND id <= ? AND expires_at > now() \
                       AND granted_at IS NULL) \
             SELECT (SELECT count(*) FROM u) AS mine, \
                    (SELECT count(*) FROM w WHERE id < ?) AS ahead, \
                    (SELECT count(*) FROM w WHERE id < ? AND shared = 0) AS exclusive, \
                    (SELECT count(*) FROM dlock_waiters \
                     WHERE id = ? AND expires_at > now() AND granted_at IS NOT NULL) AS granted, \
                    (SELECT min(id) FROM w) AS floor",
        )
        .bind::<BigInt, _>(ttl_us)
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(key)
        .bind::<Integer, _>(line.id())
        .bind::<BigInt, _>(floor)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .get_result::<Mine>(self)
        .map(Mine::spot)
    }

    fn line_look(
        &mut self,
        key: &str,
        line: Line,
        id: i64,
        floor: i64,
    ) -> QueryResult<Option<Spot>> {
        stmt(LOOK)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(key)
            .bind::<Integer, _>(line.id())
            .bind::<BigInt, _>(floor)
            .bind::<BigInt, _>(id)
            .get_result::<Mine>(self)
            .map(Mine::spot)
    }

    fn line_look_lease(
        &mut self,
        key: &str,
        id: i64,
        floor: i64,
        holder: &str,
    ) -> QueryResult<Option<Spot>> {
        stmt(concat!(
            "SELECT l.mine, l.ahead, l.exclusive, l.granted, l.floor, g.token, g.acquired_at \
             FROM (",
            look!(),
            ") l LEFT JOIN dlock_leases g \
               ON g.lock_key = ? AND g.holder_id = ? AND g.expires_at > now()"
        ))
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(key)
        .bind::<Integer, _>(Line::Lease.id())
        .bind::<BigInt, _>(floor)
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .get_result::<LookRow>(self)
        .map(LookRow::spot)
    }

    fn line_leave(&mut self, key: &str, line: Line, id: i64) -> QueryResult<bool> {
        // The DELETE's effect is not visible to the rest of the statement: the first live
        // place other than this one is the next in line. The DELETE waits for a release
        // granting this place at that moment, and returns the granted version.
        stmt(
            "WITH d AS (DELETE FROM dlock_waiters WHERE id = ? RETURNING granted_at), \
             n AS (SELECT pg_notify(f.channel, f.lock_key) FROM ( \
               SELECT channel, lock_key FROM dlock_waiters \
               WHERE lock_key = ? AND line = ? AND id <> ? AND expires_at > now() AND granted_at IS NULL \
               ORDER BY id LIMIT 1) f \
             WHERE f.channel IS NOT NULL AND EXISTS (SELECT 1 FROM d)) \
             SELECT (SELECT count(*) FROM n) AS id, \
                    (SELECT count(*) FROM d WHERE granted_at IS NOT NULL) AS granted",
        )
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(key)
        .bind::<Integer, _>(line.id())
        .bind::<BigInt, _>(id)
        .get_result::<Left>(self)
        .map(|r| r.granted > 0)
    }

    fn line_stats(&mut self, key: Option<&str>) -> QueryResult<Vec<LineStat>> {
        stmt(
            "SELECT lock_key, line::int8 AS line, count(*) AS waiting, \
                    (extract(epoch FROM now() - min(since)) * 1000000)::int8 AS longest_us \
             FROM dlock_waiters WHERE expires_at > now() AND granted_at IS NULL \
               AND (?::text IS NULL OR lock_key = ?) \
             GROUP BY lock_key, line",
        )
        .bind::<Nullable<Text>, _>(key)
        .bind::<Nullable<Text>, _>(key)
        .load(self)
    }

    fn purge_lapsed_places(&mut self) -> QueryResult<usize> {
        stmt("DELETE FROM dlock_waiters WHERE expires_at <= now()").execute(self)
    }
}
