//! MySQL's hand-over of `Row` and `Lease` keys (issue 23): a release with nobody in the
//! key's line is one plain statement (`ROW_RELEASE_ALONE`, `LEASE_RELEASE_ALONE`);
//! otherwise `release_or_grant` reads the first place and grants it the key
//! (`grant_row`, `grant_lease`), and the releaser's own confirmed place goes
//! (`delete_place`). The acquisitions and confirmations are in `locks.rs`.
// Its statements' texts are `pub` for `__bench_sql` (feature `bench-sql`) only.
#![cfg_attr(not(feature = "bench-sql"), allow(unreachable_pub))]

use crate::backend::shared;
use crate::backend::shared::{exists, One};
use crate::backend::stmt::stmt;
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Text};
use diesel::{OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};

/// Whether the key's counter row is there (a consistent read).
pub(super) fn counter_there(conn: &mut MysqlConnection, key: &str) -> QueryResult<bool> {
    exists(
        stmt("SELECT CAST(1 AS SIGNED) AS one FROM dlock_tokens WHERE lock_key = ?")
            .bind::<Text, _>(key)
            .get_result::<One>(conn)
            .optional(),
    )
}

/// A row's id, as the reads of a held row answer it.
#[derive(QueryableByName)]
pub(super) struct Id {
    #[diesel(sql_type = BigInt)]
    pub(super) id: i64,
}

/// Deletes place `place`, again while the server reports contention. The DELETE locks the
/// place's record, then its entry in the key's index; a release with nobody in line
/// (`nobody_in_line!`) reads the key's index entries, then their records, with shared locks:
/// the two deadlock, and InnoDB rolls back the DELETE (found by the release's adversary:
/// 3–23 places left in 60–75 s of 12 threads on one key, until `purge`).
pub(super) fn delete_place(conn: &mut MysqlConnection, place: i64) -> QueryResult<usize> {
    crate::backoff::retry_contended(
        conn,
        std::time::Duration::from_millis(64),
        "removing a place of the line",
        |c| {
            stmt(shared::LEAVE_PLACE)
                .bind::<BigInt, _>(place)
                .execute(c)
        },
        super::statement_retryable,
    )
}

/// Whether nobody is in the key's line (`$key`, SQL): no live place, and no place of the
/// releaser's own (its holder id, bound), which a grant gave it the key from and its
/// confirmation left lapsed (`confirmed_place!`) for the release to remove. The releases'
/// first try (`ROW_RELEASE_ALONE`, `LEASE_RELEASE_ALONE`) is then the plain one; any such
/// place, a reader's or a permit's too, sends the release to `release_or_grant`. The
/// statement's subquery is a locking read (shared next-key locks on the key's places, taken
/// after the lock of the row or lease released, the order of a grant's and a
/// confirmation's), held until its autocommit: a place joining meanwhile waits for it.
macro_rules! nobody_in_line {
    ($key:literal, $line:ident) => {
        concat!(
            "NOT EXISTS (SELECT 1 FROM dlock_waiters w WHERE w.lock_key = ",
            $key,
            " AND w.line = ",
            line_sql!($line),
            " AND (w.expires_at > UTC_TIMESTAMP(6) OR w.holder = ?))"
        )
    };
}

/// `row_release` while nobody is in the key's line (`nobody_in_line!`): the DELETE by id and
/// holder id, one statement, with no read of the line before it; 0 rows (the line not
/// empty, or the row not ours) runs `release_or_grant`. A place that joins after it tries
/// the key once it has joined (`wait.rs`), as after `release_or_grant`'s read.
pub const ROW_RELEASE_ALONE: &str = concat!(
    "DELETE FROM dlock_rows WHERE id = ? AND COALESCE(holder, '') = ? AND ",
    nobody_in_line!("dlock_rows.lock_key", row)
);

/// `lease_release` while nobody is in the key's line: the row says so (`line_free`,
/// migration 19), and no read of the line is needed. Set only by `LEASE_RELEASE_PLAIN`,
/// cleared by every join once its place is written (`lines.rs`); a row inserted by an
/// acquisition starts without it (its first release takes `release_or_grant`).
pub const LEASE_RELEASE_ALONE: &str =
    "UPDATE dlock_leases SET holder_id = NULL, expires_at = NULL \
     WHERE lock_key = ? AND holder_id = ? AND line_free";

/// `lease_release`'s plain release in `release_or_grant` (nobody to hand the key to): the
/// lease is cleared, and the row says that nobody waits if no live place of the key is in
/// the line. The subquery is a locking read (shared next-key locks on the key's places,
/// after the lease's row lock, as `nobody_in_line!`): a place being written meanwhile is
/// waited for and seen, a later one waits for this statement, and its join then clears
/// `line_free` again.
pub(super) const LEASE_RELEASE_PLAIN: &str = concat!(
    "UPDATE dlock_leases SET holder_id = NULL, expires_at = NULL, \
       line_free = NOT EXISTS (SELECT 1 FROM dlock_waiters w WHERE w.lock_key = ? \
                               AND w.line = ",
    line_sql!(lease),
    " AND w.expires_at > UTC_TIMESTAMP(6)) \
     WHERE lock_key = ? AND holder_id = ?"
);

/// A release of `Row` or `Lease`: a consistent read of the first live place of the key
/// waiting for a grant (`first`, after the place id given; it also names the releaser's own
/// confirmed place, if it took the key by a grant: see `confirmed!`); nobody, the plain
/// release (`plain`: a place joining after the read tries the key itself once it has
/// joined); else the hand-over to that place (`grant`), autocommit statements each, so that
/// no transaction is left open across round trips for a releaser stopped inside to stall
/// the key with. A place gone meanwhile passes the grant to the next (at most 8 times, then
/// the plain release). Last, once the key is released or handed on, the releaser's own
/// confirmed place goes (best effort: a lapsed place is ignored by everyone, and `purge`
/// removes it otherwise).
pub(super) fn release_or_grant(
    conn: &mut MysqlConnection,
    mut first: impl FnMut(&mut MysqlConnection, i64) -> QueryResult<Vec<FirstPlace>>,
    mut grant: impl FnMut(&mut MysqlConnection, &FirstPlace) -> Result<bool, Passed>,
    plain: impl FnOnce(&mut MysqlConnection) -> QueryResult<bool>,
) -> QueryResult<bool> {
    let mut after = 0_i64;
    let mut confirmed = None;
    let mut granted = None;
    for _ in 0..8 {
        let places = first(conn, after)?;
        confirmed = confirmed.or(places.iter().find(|p| p.mine != 0).map(|p| p.id));
        let Some(w) = places.iter().find(|p| p.mine == 0) else {
            break;
        };
        match grant(conn, w) {
            Ok(g) => {
                granted = Some(g);
                break;
            }
            Err(Passed::Gone) => after = w.id,
            Err(Passed::Shared) => break,
            Err(Passed::Failed(e)) => return Err(e),
        }
    }
    let released = match granted {
        Some(granted) => granted,
        None => plain(conn)?,
    };
    if let Some(place) = confirmed {
        if let Err(e) = delete_place(conn, place) {
            log::debug!("removing the confirmed place {place} failed ({e}); purge removes it");
        }
    }
    Ok(released)
}

/// A place of a key's line, as a release reads it: the first one waiting, to grant it the
/// key (`mine` 0), or the releaser's own confirmed place, to remove (`mine` 1).
#[derive(QueryableByName)]
pub(super) struct FirstPlace {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    lock_key: String,
    #[diesel(sql_type = BigInt)]
    mine: i64,
}

/// A confirmation's assignment to the place it confirms (in the multi-table UPDATE that sets
/// the holder's own expiry): the place lapses, so that it is ignored at once by everyone (the
/// line's counts, the releases' first-place reads, `dlock list`, purge's checks, which all
/// look at live places only), and is removed later, off the path of the next hand-over:
/// by the holder's release (`confirmed!`, in `LEASE_FIRST_PLACE`/`ROW_FIRST_PLACE`), or by
/// `purge` (a holder that never releases). A fixed instant in the past, not the server's
/// clock, so that a clock stepped back cannot make it live again. Its `granted_at` stays.
macro_rules! confirmed_place {
    () => {
        "w.expires_at = '1970-01-01 00:00:00'"
    };
}
pub(super) use confirmed_place;

/// `lease_release`'s first step (a consistent read): the first live place of the key's line
/// waiting for a grant, after place `?` (0 at first), with `mine` 0; none: the plain
/// release (`shared::LEASE_RELEASE`). Only an exclusive waiter's place is granted: a
/// reader's or a permit's (`shared`, no holder id) first in line means the plain release
/// (its waiter takes the key). And, with `mine` 1, the releaser's own place, if a grant gave
/// it the key and its confirmation left it lapsed (`confirmed!`: the key and holder id bound
/// again), which the release removes once done.
pub const LEASE_FIRST_PLACE: &str = concat!(
    "SELECT id, lock_key, mine FROM ( \
       SELECT id, CAST(lock_key AS CHAR) AS lock_key, holder, CAST(0 AS SIGNED) AS mine \
       FROM dlock_waiters \
       WHERE lock_key = ? AND line = ",
    line_sql!(lease),
    " AND id > ? AND expires_at > UTC_TIMESTAMP(6) AND granted_at IS NULL \
       ORDER BY id LIMIT 1) x \
     WHERE holder IS NOT NULL \
     UNION ALL ",
    confirmed!("?"),
);

/// `row_release`'s first step, as `LEASE_FIRST_PLACE`, for the key of row `?` (bound again
/// for the releaser's own confirmed place, with the holder id).
pub const ROW_FIRST_PLACE: &str = concat!(
    "(SELECT w.id, CAST(w.lock_key AS CHAR) AS lock_key, CAST(0 AS SIGNED) AS mine \
      FROM dlock_waiters w JOIN dlock_rows r ON r.lock_key = w.lock_key WHERE r.id = ? \
        AND w.line = ",
    line_sql!(row),
    " AND w.id > ? AND w.expires_at > UTC_TIMESTAMP(6) AND w.granted_at IS NULL \
        AND w.holder IS NOT NULL ORDER BY w.id LIMIT 1) \
     UNION ALL ",
    confirmed!("(SELECT lock_key FROM dlock_rows WHERE id = ?)"),
);

/// The releaser's own place, if a release granted it the key: lapsed by its confirmation
/// (`confirmed_place!`), or still live if a `Lease` holder releases before its heartbeat
/// confirmed the grant. By the key (`$key`, SQL) and the holder id (bound), which a grant
/// gave the lock from the place (a holder id is 128 random bits, drawn for this one
/// acquisition). A consistent read.
macro_rules! confirmed {
    ($key:literal) => {
        concat!(
            "SELECT id, CAST(lock_key AS CHAR) AS lock_key, CAST(1 AS SIGNED) AS mine \
             FROM dlock_waiters \
             WHERE lock_key = ",
            $key,
            " AND holder = ? AND granted_at IS NOT NULL"
        )
    };
}
use confirmed;

/// Why a hand-over passed the key on to no one: the place it meant to grant was gone (its
/// waiter left, its place lapsed, or another release granted it first), or a statement
/// failed.
pub(super) enum Passed {
    Gone,
    /// The releaser's lease had expired and readers or permits hold the key: the plain
    /// release only, no waiter is let in beside them.
    Shared,
    Failed(diesel::result::Error),
}

impl From<diesel::result::Error> for Passed {
    fn from(e: diesel::result::Error) -> Self {
        Passed::Failed(e)
    }
}

/// `lease_release`'s hand-over, one statement (autocommit, so nothing stays locked between
/// round trips): the lease, while still `holder`'s, takes the place's holder id and owner,
/// the key's next token, the time, and the place's expiry as its deadline to confirm, and
/// the place, while live and ungranted, is marked granted. The lease's row is locked first
/// (STRAIGHT_JOIN; both are read by primary key), then the place, as the confirmation
/// (`lease_confirm`) and purge lock them; the place's own statements (renewal, leave) lock
/// the place alone. A waiter leaving meanwhile waits for this statement and then gives the
/// key back. No assignment reads a column another assigns (MySQL gives no order across the
/// tables of a multi-table UPDATE). Binds: key, holder id, place.
const LEASE_GRANT: &str = concat!(
    "UPDATE dlock_leases l STRAIGHT_JOIN dlock_waiters w \
     SET l.owner = w.owner, l.holder_id = w.holder, \
         l.token = GREATEST(l.token + 1, ",
    mysql_floor!(),
    "), l.acquired_at = UTC_TIMESTAMP(6), l.expires_at = w.expires_at, \
         w.granted_at = UTC_TIMESTAMP(6) \
     WHERE l.lock_key = ? AND l.holder_id = ? \
       AND (l.shared_until IS NULL OR l.shared_until <= UTC_TIMESTAMP(6)) \
       AND w.id = ? AND w.lock_key = l.lock_key AND w.granted_at IS NULL \
       AND w.expires_at > UTC_TIMESTAMP(6) AND w.holder IS NOT NULL"
);

/// `row_release`'s hand-over, one statement (autocommit, as `LEASE_GRANT`): the key's
/// counter, the row, while still `holder`'s, and the place, while live and ungranted, locked
/// in that order (STRAIGHT_JOIN, each by its key: the order of the acquisitions, which lock
/// the counter, then insert the row). The row takes the place's holder id and owner, the
/// next token, the time, and the place's expiry as its deadline to confirm; the place is
/// marked granted. Binds: key, row id, holder id, place.
///
/// The next token is the row's own plus one (never below the clock floor), and the counter
/// goes up to at least that: MySQL gives no order across the tables of a multi-table
/// UPDATE, and each assignment here decides alike whichever table goes first. The row's
/// reads only its own old token; the counter's reads the row's token, old (`r0 + 1`) or
/// new (`r0 + 2`), and keeps the larger of that and its own: after the statement the
/// counter is at least the row's new token either way, so every later acquisition draws a
/// larger one, and the new token is above the row's old one, the latest any holder had (a
/// counter above it holds only bumps of newcomers whose insert failed, never handed out).
const ROW_GRANT: &str = concat!(
    "UPDATE dlock_tokens t STRAIGHT_JOIN dlock_rows r STRAIGHT_JOIN dlock_waiters w \
     SET t.token = GREATEST(t.token, r.token + 1, ",
    mysql_floor!(),
    "), r.owner = w.owner, r.holder = w.holder, \
         r.token = GREATEST(r.token + 1, ",
    mysql_floor!(),
    "), r.acquired_at = UTC_TIMESTAMP(6), r.stale_at = w.expires_at, \
         w.granted_at = UTC_TIMESTAMP(6) \
     WHERE t.lock_key = ? AND r.id = ? AND r.lock_key = t.lock_key \
       AND COALESCE(r.holder, '') = ? \
       AND w.id = ? AND w.lock_key = r.lock_key AND w.granted_at IS NULL \
       AND w.expires_at > UTC_TIMESTAMP(6) AND w.holder IS NOT NULL"
);

/// A lease's hand-over to place `w` (`LEASE_GRANT`): false if `holder` no longer held it;
/// `Passed::Gone` if the place was no longer waiting (the lease still `holder`'s: a
/// consistent read after the grant matched nothing tells which).
pub(super) fn grant_lease(
    c: &mut MysqlConnection,
    key: &str,
    holder: &str,
    w: &FirstPlace,
) -> Result<bool, Passed> {
    let n = stmt(LEASE_GRANT)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .bind::<BigInt, _>(w.id)
        .execute(c)?;
    if n > 0 {
        return Ok(true);
    }
    // Still ours: 1, with readers or permits live on the key (its lease expired, and they
    // came in: no hand-over past them), 2.
    let still_ours = stmt(
        "SELECT CAST(1 + COALESCE(shared_until > UTC_TIMESTAMP(6), 0) AS SIGNED) AS one \
         FROM dlock_leases WHERE lock_key = ? AND holder_id = ?",
    )
    .bind::<Text, _>(key)
    .bind::<Text, _>(holder)
    .get_result::<One>(c)
    .optional()?;
    match still_ours.map(|r| r.one) {
        Some(2) => Err(Passed::Shared),
        Some(_) => Err(Passed::Gone),
        None => Ok(false),
    }
}

/// A row's hand-over to place `w` (`ROW_GRANT`): false if `holder` no longer held it;
/// `Passed::Gone` if the place was no longer waiting (told apart by reads after the grant
/// matched nothing, as `grant_lease` does). A key without a counter (never expected while
/// its row exists) is released without a hand-over.
pub(super) fn grant_row(
    c: &mut MysqlConnection,
    id: i64,
    holder: &str,
    w: &FirstPlace,
) -> Result<bool, Passed> {
    let n = stmt(ROW_GRANT)
        .bind::<Text, _>(&w.lock_key)
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(holder)
        .bind::<BigInt, _>(w.id)
        .execute(c)?;
    if n > 0 {
        return Ok(true);
    }
    let still_ours = stmt(shared::ROW_HELD)
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(holder)
        .get_result::<Id>(c)
        .optional()?
        .is_some();
    if !still_ours {
        return Ok(false);
    }
    if !counter_there(c, &w.lock_key)? {
        return Ok(stmt(shared::ROW_RELEASE)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(holder)
            .execute(c)?
            == 1);
    }
    Err(Passed::Gone)
}
