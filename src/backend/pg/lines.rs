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

/// `Lines::line_flag`: the key's lease row, if it has one, no longer says that nobody waits
/// (`line_free`, which lets `Lease`'s acquisition and release skip their look into the
/// line: `locks.rs`), and counts one join more (`line_joins`), which tells a release about
/// to set `line_free` that a place may have come after its snapshot. An UPDATE: it waits
/// for any statement holding the row, and marks its newest version. Binds the key.
macro_rules! line_flag {
    () => {
        "UPDATE dlock_leases SET line_free = false, line_joins = line_joins + 1 WHERE lock_key = ?"
    };
}

/// Is `c` outside any transaction of diesel's, so that a statement runs as its own?
fn own_transaction(c: &mut PgConnection) -> bool {
    use diesel::connection::{AnsiTransactionManager, TransactionManager};
    matches!(
        AnsiTransactionManager::transaction_manager_status_mut(c).transaction_depth(),
        Ok(None)
    )
}

/// What `line_join`'s statement returns.
#[derive(QueryableByName)]
struct JoinedRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = BigInt)]
    flagged: i64,
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
        // The key's lease row, if it has one and `flag` asks for it, is marked first (`f`,
        // before the place is written: `line_flag!`); the key's lapsed places go in the same statement (a dead
        // waiter's place would otherwise stay until a purge; it is ignored meanwhile, as every
        // statement here asks for live places only), skipping any another statement has
        // locked: the join then waits for no place's lock while it holds the lease row's.
        // Its commit does not wait for the WAL's flush (`synchronous_commit` off for this
        // transaction): a place says who waits in what order, and gives nobody the key. A
        // crash can lose a join that was not flushed yet, with its flag (the same
        // transaction), and the waiter then joins again as for a lapsed place; a grant to
        // the place is a later commit, whose flush carries the join's record with it. With
        // eight processes on one key, a join beside every hand-over, the flushes of the
        // joins were the hand-overs' to wait behind (issue 23). Only when the statement is
        // its own transaction: inside another (none of the library's joins is) it would make
        // that transaction's commit unflushed too.
        //
        // The place's id is therefore not the sequence's alone: a sequence's advance is
        // flushed only with a commit that waits for it, and after a crash the sequence gave
        // out again ids that waiters of lost joins still held, and renewed by id (an
        // adversary: two waiters on one place). The id is the server's clock in
        // microseconds, times 1,024, plus the sequence's next value modulo 1,024 (two joins
        // in one microsecond differ): after a crash or a failover the clock has moved on,
        // so a new place's id is above every id handed out before. Should the server's
        // clock step back, the key's line goes on above its highest place (its index's
        // last entry, `dlock_waiters_line_key`): a newcomer never comes before those who
        // wait (an adversary's finding, with the clock put back 2 s). Such a join, whose id
        // is not the clock's, waits for the flush: a crash that lost it would have handed
        // the same id out again to the next join while the clock was still behind (the
        // next adversary: a clock 60 s back, then a crash). Places of builds before this
        // one have the sequence's small ids, and come first.
        stmt(concat!(
            "WITH f AS (",
            line_flag!(),
            " AND ? RETURNING 1), \
             gone AS (DELETE FROM dlock_waiters WHERE id IN ( \
               SELECT id FROM dlock_waiters WHERE lock_key = ? AND expires_at <= now() \
               FOR UPDATE SKIP LOCKED)), \
             n AS MATERIALIZED (SELECT floor(extract(epoch FROM clock_timestamp()) * 1000000)::int8 \
                                         AS clock, \
                                       (SELECT COALESCE(max(id), 0) FROM dlock_waiters \
                                        WHERE lock_key = ? AND line = ?) / 1024 + 1 AS above), \
             i AS (INSERT INTO dlock_waiters \
                     (id, lock_key, line, owner, channel, since, expires_at, holder, shared) \
               SELECT greatest(n.clock, n.above) * 1024 + nextval('dlock_waiters_id_seq') % 1024, \
                      ?, ?, ?, ?, clock_timestamp(), clock_timestamp() + ? * interval '1 microsecond', ?, ? \
               FROM n, (SELECT count(*) AS c FROM f) x \
               RETURNING id) \
             SELECT i.id, (SELECT count(*) FROM f) AS flagged FROM i \
             WHERE (CASE WHEN ? AND (SELECT clock >= above FROM n) \
                         THEN set_config('synchronous_commit', 'off', true) \
                    ELSE '' END) IS NOT NULL"
        ))
        .bind::<Text, _>(key)
        .bind::<Bool, _>(flag)
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<Integer, _>(line.id())
        .bind::<Text, _>(key)
        .bind::<Integer, _>(line.id())
        .bind::<Text, _>(owner)
        .bind::<Nullable<Text>, _>(channel)
        .bind::<BigInt, _>(ttl_us)
        .bind::<Nullable<Text>, _>((!shared).then_some(holder))
        .bind::<Integer, _>(i32::from(shared))
        .bind::<Bool, _>(own_transaction(self))
        .get_result::<JoinedRow>(self)
        .map(|r| Joined {
            id: r.id,
            flagged: r.flagged > 0,
        })
    }

    fn line_flag(&mut self, key: &str) -> QueryResult<()> {
        stmt(line_flag!())
            .bind::<Text, _>(key)
            .execute(self)
            .map(drop)
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
