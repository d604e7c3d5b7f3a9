//! PostgreSQL's `Row` and `Lease` statements.
// Its statements' texts are `pub` for `__bench_sql` (feature `bench-sql`) only.
#![cfg_attr(not(feature = "bench-sql"), allow(unreachable_pub))]

use super::{lock_timeout_ms, AcquiredRow};
use crate::backend::sealed::Locks;
use crate::backend::shared;
use crate::backend::shared::{exists, HolderId, One};
use crate::backend::stmt::stmt;
use crate::backend::{Acquired, NO_PLACE};
use crate::key::floor_bucket;
use diesel::pg::PgConnection;
use diesel::sql_types::{Array, BigInt, Nullable, Text};
use diesel::{OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};

// The texts of the statements the benches' raw floors run too (`diesel_lock::__bench_sql`);
// the others are written where they run.

/// The first live place of a key's line not granted yet, locked (`FOR UPDATE`: a waiter
/// leaving at that moment either deleted it first, and the next place is taken, or waits
/// for the grant to commit, and gives the key back), if it is an exclusive waiter's (a
/// reader's or a permit's place has no holder id: it is never granted, and no place behind
/// it is). `$key`: an expression for the key; `$line`: the strategy's line (`line_sql!`).
macro_rules! first_place {
    ($key:literal, $line:ident) => {
        concat!(
            "SELECT x.id, x.owner, x.holder, x.expires_at FROM ( \
             SELECT w.id, w.owner, w.holder, w.expires_at FROM dlock_waiters w \
             WHERE w.lock_key = ",
            $key,
            " AND w.line = ",
            line_sql!($line),
            " AND w.expires_at > now() AND w.granted_at IS NULL \
             ORDER BY w.id LIMIT 1 FOR UPDATE) x \
           WHERE x.holder IS NOT NULL"
        )
    };
}

/// What a grant's notification carries (`$g`: the granting step's name, SQL, whose rows
/// have `wid`, `holder`, `token`, `acquired_at` and `lock_key`): the place's id, the holder
/// id it was given the key under, the token, the acquisition time in microseconds since the
/// epoch, and the key, separated by single spaces (the key last: it may hold spaces), so that
/// the waiter takes the key with no look of its own (`listen::grant_in` reads it). Sent by
/// `grant_notify!`.
macro_rules! grant_note {
    ($g:literal) => {
        concat!(
            "concat_ws(' ', ",
            $g,
            ".wid, COALESCE(",
            $g,
            ".holder, '-'), ",
            $g,
            ".token, \
             (extract(epoch FROM ",
            $g,
            ".acquired_at) * 1000000)::int8, ",
            $g,
            ".lock_key)"
        )
    };
}

/// The grant's notification (`m`: the granted place's `channel`, `lock_key` and `note`,
/// `grant_note!`): the note, on the grants channel of a listener that hears grants there
/// (its channel begins `listen::TOLD`; the grants channel adds `listen::GRANTS`), which only
/// these statements write to; the key, on the channel itself, for an older build's.
macro_rules! grant_notify {
    () => {
        "pg_notify(CASE WHEN left(channel, 8) = 'dlock_v_' THEN channel || '_g' ELSE channel END, \
                   CASE WHEN left(channel, 8) = 'dlock_v_' THEN note ELSE lock_key END)"
    };
}

/// The CTEs of `ROW_ACQUIRE` and `ROW_ACQUIRE_IN_LINE` (which add the final SELECT).
macro_rules! row_acquire {
    () => {
        concat!("WITH ", pg_floor!("NOT EXISTS (SELECT 1 FROM dlock_rows WHERE lock_key = ?) \
             AND NOT EXISTS (SELECT 1 FROM dlock_waiters \
                             WHERE lock_key = ? AND line = ", line_sql!(row), " AND id < ? \
                               AND expires_at > now())"), ", \
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

/// `row_release`, by id and holder id (`Locks::row_release`), and the hand-over: if a live
/// place waits in the key's line, the row is not deleted but given to the first place
/// (`g`: its owner and holder id, the key's next token from its counter `t`, the time, and as
/// `stale_at` the place's own expiry, the deadline to confirm by), the place is marked
/// granted (`m`) and its `Locker` notified (`n`, sent at commit). Otherwise the row goes
/// (`d`). One statement, one commit per hand-over. Every step re-checks the row's id and
/// holder id.
pub const ROW_RELEASE: &str = concat!(
    "WITH r AS (SELECT lock_key FROM dlock_rows WHERE id = ? AND COALESCE(holder, '') = ?), \
     w AS MATERIALIZED (", first_place!("(SELECT lock_key FROM r)", row), "), \
     t AS (UPDATE dlock_tokens SET token = ", pg_next_token!("dlock_tokens.token"), " \
           FROM w WHERE dlock_tokens.lock_key = (SELECT lock_key FROM r) RETURNING dlock_tokens.token), \
     g AS (UPDATE dlock_rows SET owner = w.owner, holder = w.holder, token = t.token, \
             acquired_at = clock_timestamp(), stale_at = w.expires_at \
           FROM w, t WHERE dlock_rows.id = ? AND COALESCE(dlock_rows.holder, '') = ? \
           RETURNING dlock_rows.lock_key, w.id AS wid, dlock_rows.holder, dlock_rows.token, \
             dlock_rows.acquired_at), \
     d AS (DELETE FROM dlock_rows WHERE id = ? AND COALESCE(holder, '') = ? \
           AND NOT EXISTS (SELECT 1 FROM t) RETURNING lock_key), \
     m AS (UPDATE dlock_waiters SET granted_at = clock_timestamp() FROM g \
           WHERE dlock_waiters.id = g.wid RETURNING dlock_waiters.channel, dlock_waiters.lock_key, ", grant_note!("g"), " AS note), \
     n AS (SELECT ", grant_notify!(), " FROM m WHERE channel IS NOT NULL) \
     SELECT (SELECT count(*) FROM g) + (SELECT count(*) FROM d) AS one, \
            (SELECT count(*) FROM n) AS woken"
);

/// Whether no live place is in the key's line (the key of the row or lease released,
/// `$key`, SQL): the releases' first try (`ROW_RELEASE_ALONE`, `LEASE_RELEASE_ALONE`) is
/// then the plain one, with nothing to hand over and nobody to notify. Any live place, granted
/// or not, a reader's or a permit's too, sends the release to the hand-over statement. (No
/// `granted_at IS NULL` beside it: see `lease_acquire!`.)
macro_rules! nobody_in_line {
    ($key:literal, $line:ident) => {
        concat!(
            "NOT EXISTS (SELECT 1 FROM dlock_waiters w WHERE w.lock_key = ",
            $key,
            " AND w.line = ",
            line_sql!($line),
            " AND w.expires_at > now())"
        )
    };
}

/// `row_release` while nobody is in the key's line (`nobody_in_line!`): the DELETE by id and
/// holder id alone, one plain statement. The uncontended cycle pays one probe of the line's
/// index for it, not `ROW_RELEASE`'s hand-over CTEs: 0 rows (the line not empty, or the row
/// not ours) runs `ROW_RELEASE`. A place that joins after this statement's snapshot tries
/// the key once it has joined (`wait.rs`), as it does after `ROW_RELEASE`'s.
pub const ROW_RELEASE_ALONE: &str = concat!(
    "DELETE FROM dlock_rows r WHERE r.id = ? AND COALESCE(r.holder, '') = ? AND ",
    nobody_in_line!("r.lock_key", row)
);

/// `row_confirm`: the granted row, still the holder's and within its deadline, takes the
/// holder's own `stale_at`, and the place goes.
const ROW_CONFIRM: &str =
    "WITH u AS (UPDATE dlock_rows SET stale_at = clock_timestamp() + ? * interval '1 microsecond' \
                WHERE lock_key = ? AND holder = ? AND stale_at > now() \
                RETURNING id, token, acquired_at), \
     d AS (DELETE FROM dlock_waiters WHERE id = ? AND EXISTS (SELECT 1 FROM u)) \
     SELECT id, token, acquired_at FROM u";

/// Whether the key's lease row (`dlock_leases`) is free to take by the caller: no live
/// holder, no live readers or permits, and nobody waiting ahead (`l`'s turn) unless the
/// row says nobody waits. `lease_update!`'s UPDATE and `LEASE_TAKE`'s `raced` ask the same.
macro_rules! lease_takeable {
    () => {
        "(dlock_leases.holder_id IS NULL OR dlock_leases.expires_at <= now()) \
         AND (dlock_leases.shared_until IS NULL OR dlock_leases.shared_until <= now()) \
         AND (dlock_leases.line_free OR (SELECT turn FROM l))"
    };
}

/// The turn check and the take-over of the key's row, the first CTEs of `LEASE_TAKE`,
/// `LEASE_ACQUIRE` and `LEASE_ACQUIRE_IN_LINE` (which add the rest).
/// Its turn check (`l`), as `row_acquire!`'s, counts a granted place too (its holder's
/// release removes it, or its confirmation): with `granted_at IS NULL` beside the
/// condition the planner, estimating a row or none, chose a bitmap scan of the key's whole
/// index range, which reads every dead place since the last vacuum (2,820 entries, 0.76 ms,
/// after a 4 s hand-over run) and never marks them dead as a plain index scan does, for
/// every later scan to skip: a hand-over across processes ran 20 % slower.
macro_rules! lease_update {
    () => {
        concat!("WITH l AS ( \
       SELECT NOT EXISTS (SELECT 1 FROM dlock_waiters \
                          WHERE lock_key = ? AND line = ", line_sql!(lease), " AND id < ? \
                            AND expires_at > now()) AS turn), \
     u AS ( \
       UPDATE dlock_leases SET owner = ?, holder_id = ?, \
         token = ", pg_next_token!("token"), ", \
         acquired_at = clock_timestamp(), expires_at = clock_timestamp() + ? * interval '1 microsecond' \
       WHERE lock_key = ? AND ", lease_takeable!(), " \
       RETURNING token, acquired_at)")
    };
}

/// `lease_update!` and the insert of a key's first row (`f`, `i`).
macro_rules! lease_acquire {
    () => {
        concat!(
            lease_update!(),
            ", ",
            pg_floor!(
                "CASE WHEN EXISTS (SELECT 1 FROM dlock_leases WHERE lock_key = ?) THEN false \
                ELSE (SELECT turn FROM l) END"
            ),
            ", \
     i AS ( \
       INSERT INTO dlock_leases (lock_key, owner, holder_id, token, acquired_at, expires_at) \
       SELECT ?, ?, ?, ",
            pg_first_token!("COALESCE((SELECT token FROM dlock_tokens WHERE lock_key = ?), 0)"),
            ", \
              clock_timestamp(), clock_timestamp() + ? * interval '1 microsecond' FROM f \
       ON CONFLICT (lock_key) DO NOTHING  \
       RETURNING token, acquired_at) "
        )
    };
}

/// `lease_acquire` by a newcomer, first: `lease_update!` alone, the key's row taken over if
/// free (its token, time), or else whether the statement's snapshot shows the row
/// (`known`), and whether it showed it free to take (`raced`: the UPDATE, which re-reads
/// the row's newest version after any wait, found it taken meanwhile, or deleted by a
/// purge). A row it does not show, or `raced`, sends the acquisition to `LEASE_ACQUIRE`,
/// whose fresh snapshot inserts the row if a purge deleted it, and finds it held if
/// another took it: a free key deleted under a `try_lock` was reported held (the key's
/// `Locker` had found it held a moment before, and its acquisition left trying again to a
/// caller that makes one attempt; CI's `wait_line` beside another test's purges). Most
/// acquisitions find their key's row: an insert's part in the statement (`f`, `i`), which
/// runs nothing then, still cost the server about a third of the statement's time
/// (`EXPLAIN ANALYZE`, median of 35, row free and the line marked free: 0.055 ms for this
/// statement against 0.076 ms for `LEASE_ACQUIRE`, 27 Nov). `raced` is read only when
/// nothing was taken.
pub const LEASE_TAKE: &str = concat!(
    lease_update!(),
    " SELECT 0::int8 AS id, token, acquired_at, true AS known, false AS raced FROM u \
     UNION ALL SELECT 0::int8, NULL, NULL, EXISTS (SELECT 1 FROM dlock_leases WHERE lock_key = ?), \
       EXISTS (SELECT 1 FROM dlock_leases WHERE lock_key = ? AND ",
    lease_takeable!(),
    ") \
     WHERE NOT EXISTS (SELECT 1 FROM u)"
);

/// What `LEASE_TAKE` answers.
#[derive(QueryableByName)]
struct Taken {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
    token: Option<i64>,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Timestamptz>)]
    acquired_at: Option<chrono::DateTime<chrono::Utc>>,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    known: bool,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    raced: bool,
}

/// `lease_acquire` by a newcomer whose `LEASE_TAKE` found no row of the key (and by a
/// waiter with a place, as `LEASE_ACQUIRE_IN_LINE`).
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

/// Whether `LEASE_RELEASE` hands the lease to the first place `w`: there is one, and no
/// reader or permit holds the key (`shared_until`, on the lease's row as locked and re-read
/// by the UPDATE: a releaser whose lease expired while readers came in lets no writer in
/// beside them; found by the hand-over's adversary).
macro_rules! handing {
    () => {
        "(w.id IS NOT NULL AND (l.shared_until IS NULL OR l.shared_until <= now()))"
    };
}

/// `lease_release`, and the hand-over as `ROW_RELEASE`'s: with a live place waiting, the
/// lease goes to the first (`u`: its owner and holder id, the next token, the time, and the
/// place's expiry as the lease's, the deadline to confirm by), which is marked granted and
/// notified; otherwise it is cleared, and a reader's or a permit's place first in line is
/// notified (`s`: its waiter takes the key itself). The place is locked before the lease's
/// row. The releaser's own place goes too (`x`, by its id: `NO_PLACE` for a lease not
/// granted), if a grant gave it the lease and its heartbeat has not confirmed the grant yet
/// (the confirmation removes it): a holder that releases soon after a grant never sends
/// the confirmation. (By the id, not the key and holder id: such a scan of the key's index
/// entries read every place the key had since the last vacuum, 600 a statement in a 4 s
/// hand-over run.)
pub const LEASE_RELEASE: &str = concat!(
    "WITH w AS MATERIALIZED (", first_place!("?", lease), "), \
     u AS (UPDATE dlock_leases l SET owner = CASE WHEN ", handing!(), " THEN w.owner ELSE l.owner END, \
             holder_id = CASE WHEN ", handing!(), " THEN w.holder END, \
             token = CASE WHEN ", handing!(), " THEN ", pg_next_token!("l.token"), " ELSE l.token END, \
             acquired_at = CASE WHEN ", handing!(), " THEN clock_timestamp() ELSE l.acquired_at END, \
             expires_at = CASE WHEN ", handing!(), " THEN w.expires_at END, \
             line_free = (w.id IS NULL \
               AND NOT EXISTS (SELECT 1 FROM dlock_waiters v \
                               WHERE v.lock_key = l.lock_key AND v.line = ", line_sql!(lease), " \
                                 AND v.expires_at > now()) \
               AND l.line_joins = (SELECT j.line_joins FROM dlock_leases j WHERE j.lock_key = l.lock_key)) \
           FROM (SELECT 1) o LEFT JOIN w ON true \
           WHERE l.lock_key = ? AND l.holder_id = ? \
           RETURNING l.lock_key, CASE WHEN ", handing!(), " THEN w.id END AS wid, l.holder_id AS holder, \
             l.token, l.acquired_at), \
     m AS (UPDATE dlock_waiters SET granted_at = clock_timestamp() FROM u \
           WHERE dlock_waiters.id = u.wid RETURNING dlock_waiters.channel, dlock_waiters.lock_key, ", grant_note!("u"), " AS note), \
     n AS (SELECT ", grant_notify!(), " FROM m WHERE channel IS NOT NULL), \
     s AS (SELECT pg_notify(f.channel, f.lock_key) FROM ( \
             SELECT channel, lock_key FROM dlock_waiters WHERE lock_key = ? \
               AND line = ", line_sql!(lease), " AND expires_at > now() AND granted_at IS NULL \
               ORDER BY id LIMIT 1) f, u \
           WHERE f.channel IS NOT NULL AND u.wid IS NULL), \
     x AS (DELETE FROM dlock_waiters WHERE id = ? AND holder = ? AND granted_at IS NOT NULL) \
     SELECT (SELECT count(*) FROM u) AS one, \
            (SELECT count(*) FROM n) + (SELECT count(*) FROM s) AS woken"
);

/// `lease_release` while nobody is in the key's line, as `ROW_RELEASE_ALONE`: the lease is
/// cleared (as `LEASE_RELEASE` clears it when it hands over nothing); 0 rows runs
/// `LEASE_RELEASE`. Not for a lease a release granted (`lease_release_granted`): its own
/// place may still be there to remove.
pub const LEASE_RELEASE_ALONE: &str =
    "UPDATE dlock_leases SET holder_id = NULL, expires_at = NULL \
     WHERE lock_key = ? AND holder_id = ? AND line_free";

/// `lease_confirm`: the granted lease, still the holder's and unexpired, runs its own ttl
/// from now, and the place goes.
const LEASE_CONFIRM: &str =
    "WITH u AS (UPDATE dlock_leases SET expires_at = clock_timestamp() + ? * interval '1 microsecond' \
                WHERE lock_key = ? AND holder_id = ? AND expires_at > now() \
                RETURNING token, acquired_at), \
     d AS (DELETE FROM dlock_waiters WHERE id = ? AND EXISTS (SELECT 1 FROM u)) \
     SELECT 0::int8 AS id, token, acquired_at FROM u";

impl Locks for PgConnection {
    shared::statements!(row_forget, row_held, row_give_back);

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
        let alone = stmt(ROW_RELEASE_ALONE)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(holder)
            .execute(self)?;
        if alone == 1 {
            return Ok(true);
        }
        self.row_release_granted(id, holder)
    }

    fn row_release_granted(&mut self, id: i64, holder: &str) -> QueryResult<bool> {
        stmt(ROW_RELEASE)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(holder)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(holder)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(holder)
            .get_result::<One>(self)
            .map(|r| r.one == 1)
    }

    fn row_confirm(
        &mut self,
        key: &str,
        place: i64,
        holder: &str,
        stale_us: Option<i64>,
    ) -> QueryResult<Option<Acquired>> {
        stmt(ROW_CONFIRM)
            .bind::<Nullable<BigInt>, _>(stale_us)
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .bind::<BigInt, _>(place)
            .get_result::<AcquiredRow>(self)
            .optional()
            .map(|r| r.map(Into::into))
    }

    fn lease_confirm(
        &mut self,
        key: &str,
        place: i64,
        holder: &str,
        ttl_us: i64,
    ) -> QueryResult<Option<Acquired>> {
        stmt(LEASE_CONFIRM)
            .bind::<BigInt, _>(ttl_us)
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .bind::<BigInt, _>(place)
            .get_result::<AcquiredRow>(self)
            .optional()
            .map(|r| r.map(Into::into))
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
        // The binds of `lease_update!` (the turn check and the take-over), which every
        // acquiring statement starts with; then those of the insert (`lease_acquire!`).
        let update = |text| {
            stmt(text)
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(place)
                .bind::<Text, _>(owner)
                .bind::<Text, _>(holder)
                .bind::<BigInt, _>(ttl_us)
                .bind::<Text, _>(key)
        };
        let q = |text| {
            update(text)
                .bind::<BigInt, _>(floor_bucket(key))
                .bind::<Text, _>(key)
                .bind::<Text, _>(key)
                .bind::<Text, _>(owner)
                .bind::<Text, _>(holder)
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(ttl_us)
        };
        if place == NO_PLACE {
            let taken = update(LEASE_TAKE)
                .bind::<Text, _>(key)
                .bind::<Text, _>(key)
                .get_result::<Taken>(self)?;
            match (taken.token, taken.acquired_at) {
                (Some(token), Some(acquired_at)) => {
                    return Ok(Some(Acquired {
                        id: taken.id,
                        token,
                        acquired_at,
                    }))
                }
                _ if taken.known && !taken.raced => return Ok(None),
                _ => {}
            }
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

    fn lease_renew_many(
        &mut self,
        leases: &[(String, String)],
        ttl_us: i64,
    ) -> QueryResult<Vec<String>> {
        // The rows are locked first, skipping those another session holds (a stuck key
        // must not hold up the batch); only the rows locked are renewed.
        let (keys, holders): (Vec<&str>, Vec<&str>) =
            leases.iter().map(|(k, h)| (k.as_str(), h.as_str())).unzip();
        stmt(
            "UPDATE dlock_leases SET expires_at = now() + ? * interval '1 microsecond' \
             WHERE lock_key IN (SELECT lock_key FROM dlock_leases \
                                WHERE lock_key = ANY(?) AND holder_id = ANY(?) \
                                  AND expires_at > now() \
                                FOR UPDATE SKIP LOCKED) \
             RETURNING holder_id",
        )
        .bind::<BigInt, _>(ttl_us)
        .bind::<Array<Text>, _>(keys)
        .bind::<Array<Text>, _>(holders)
        .load::<HolderId>(self)
        .map(|rows| rows.into_iter().map(|r| r.holder_id).collect())
    }

    fn lease_release(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        let alone = stmt(LEASE_RELEASE_ALONE)
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .execute(self)?;
        if alone == 1 {
            return Ok(true);
        }
        self.lease_release_granted(key, holder, NO_PLACE)
    }

    fn lease_release_granted(&mut self, key: &str, holder: &str, place: i64) -> QueryResult<bool> {
        stmt(LEASE_RELEASE)
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .bind::<Text, _>(key)
            .bind::<BigInt, _>(place)
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

#[cfg(test)]
mod tests;
