//! PostgreSQL's fencing-token statements (`backend/fence.rs` has the scheme; migration 6 the
//! tables).
//!
//! Why a sequence alone is not enough: `nextval` WAL-logs only every 32nd value, ahead, and
//! only the session that logs gets a transaction id, so only its commit waits for the WAL
//! flush. Another session may draw a value covered by that record and show it to its client
//! before the record is flushed; a crash then loses the record, and recovery hands the
//! value out again (sequence.c, `nextval_internal`). Hence the durable bound: a token is
//! handed out only at or below a bound committed, and flushed, before it was seen.
//!
//! The acquiring statements set `synchronous_commit = off` for their own transaction:
//! nothing they write has to survive a crash (a sequence record that the bound makes
//! unnecessary, ForUpdate's version bump), so no acquisition waits for a flush.

use super::super::fence::{Drawn, STEP};
use crate::backend::stmt::stmt;
use diesel::pg::PgConnection;
use diesel::sql_types::{BigInt, Nullable};
use diesel::{QueryResult, QueryableByName, RunQueryDsl};

/// `fence_draw`: a token for a session that holds its lock already.
const DRAW: &str =
    "SELECT nextval('dlock_fence_seq') + (SELECT off FROM dlock_fence_live) AS token, \
     (SELECT high FROM dlock_fence_live) AS high";

#[derive(QueryableByName)]
struct DrawnRow {
    #[diesel(sql_type = Nullable<BigInt>)]
    token: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    high: Option<i64>,
}

pub(super) fn draw(conn: &mut PgConnection) -> QueryResult<Drawn> {
    let r = stmt(DRAW).get_result::<DrawnRow>(conn)?;
    Ok(Drawn {
        token: r.token,
        high: r.high,
    })
}

// The statements that write the bound (`s`, first in each) commit with
// `synchronous_commit = on` when the session's own is `off` or `local`: they wait for this
// server's WAL flush and, where the server names synchronous standbys, for those too, so a
// promoted synchronous standby never misses a bound. Stricter settings (`remote_write`,
// `remote_apply`) are kept.

/// Raises the bound to `token + STEP` (at least), durably, and the live copy with it, in one
/// transaction: a reader that sees the new copy sees a committed, hence flushed, bound.
pub(super) fn raise(conn: &mut PgConnection, token: i64) -> QueryResult<()> {
    stmt(
        "WITH s AS (SELECT CASE WHEN current_setting('synchronous_commit') IN ('off', 'local') \
                    THEN set_config('synchronous_commit', 'on', true) END AS s), \
         h AS (UPDATE dlock_fence SET high = GREATEST(high, ?) + ? WHERE id = 1 RETURNING high) \
         UPDATE dlock_fence_live l SET high = GREATEST(l.high, h.high) FROM h, s WHERE l.id = 1",
    )
    .bind::<BigInt, _>(token)
    .bind::<BigInt, _>(STEP)
    .execute(conn)
    .map(drop)
}

/// Starts the server's current life if nobody has: the live row, with `off` such that every
/// value the sequence gives from now on, plus `off`, exceeds the bound every token of the
/// last life stayed under and the server's epoch (`pg_epoch!`), and a raised bound. The
/// bound's row lock serialises starters (and raisers); a second starter finds the row and
/// changes nothing but the bound.
///
/// A life ends with a crash and with a promotion: the live row is UNLOGGED, so crash
/// recovery empties it and a standby never has it. A promoted standby whose copy of the
/// bound lagged still starts above every token of the old timeline: its epoch is above them.
pub(super) fn start_life(conn: &mut PgConnection) -> QueryResult<()> {
    stmt(concat!(
        "WITH s AS (SELECT CASE WHEN current_setting('synchronous_commit') IN ('off', 'local') \
                    THEN set_config('synchronous_commit', 'on', true) END AS s), \
         h AS (UPDATE dlock_fence SET high = GREATEST(high, ",
        pg_epoch!(),
        ") + ? WHERE id = 1 RETURNING high - ? AS old, high), \
         v AS (SELECT nextval('dlock_fence_seq') AS v) \
         INSERT INTO dlock_fence_live (id, off, high) SELECT 1, h.old + 1 - v.v, h.high FROM h, v, s \
         ON CONFLICT (id) DO NOTHING",
    ))
    .bind::<BigInt, _>(STEP)
    .bind::<BigInt, _>(STEP)
    .execute(conn)
    .map(drop)
}
