//! What `Locker::purge` of `Row` and `Lease` deletes of keys nobody uses any more, written
//! once over each backend's statements (`Admin::purge_*`, `floor_raise`).
//!
//! Tokens keep increasing per key without a row per key for ever: a key without a counter
//! row (its `dlock_tokens` row for `Row`, its lease row for `Lease` and its readers and
//! permits) takes its first token above the token floor of its bucket (`dlock_token_floor`,
//! migration 15). So a purge first reads the highest token there is, raises the floor to it
//! and commits that, and only then deletes, in batches of `PURGE_BATCH` keys each one short
//! transaction, the rows of released keys whose token is at most that highest one (a counter
//! bumped since is spared, and goes with a later purge). Each backend's first acquisition of
//! a key reads its floor so that a raise committed after the acquisition's snapshot is still
//! seen (`backend/{pg,mysql}/locks.rs`).

use super::Pool;
use crate::backend::{LockConnection, PurgeTable, Sql};
use crate::{Error, Result};
use std::time::Duration;

/// Raises the floor, then deletes the released keys' rows of `tables`, in this order; the
/// number deleted. `idle_us`: how long a lease must have been free or expired. Runs on one
/// pooled connection, between the backend's `purge_begin` and `purge_end` (MySQL: one
/// purge at a time, see `mysql/admin.rs`).
pub(super) fn released_keys<C: LockConnection>(
    pool: &Pool<C>,
    tables: &[PurgeTable],
    idle_us: i64,
) -> Result<usize> {
    let mut conn = pool.get()?;
    let c = &mut *conn;
    run(c, |c| c.sql().purge_begin())?;
    let purged = steps(c, tables, idle_us);
    let ended = run(c, |c| c.sql().purge_end());
    let deleted = purged?;
    ended?;
    Ok(deleted)
}

fn steps<C: LockConnection>(c: &mut C, tables: &[PurgeTable], idle_us: i64) -> Result<usize> {
    let highest = run(c, |c| c.sql().purge_highest())?;
    // Committed (autocommit) before the first delete below.
    run(c, |c| c.sql().floor_raise(highest))?;
    let mut deleted = 0;
    for &table in tables {
        // Keys are 1 to 255 bytes: the empty string is below every one.
        let mut after = String::new();
        loop {
            let upto = run(c, |c| c.sql().purge_boundary(table, &after))?;
            deleted += run(c, |c| {
                c.sql()
                    .purge_batch(table, &after, upto.as_deref(), highest, idle_us)
            })?;
            match upto {
                Some(key) => after = key,
                None => break,
            }
        }
    }
    Ok(deleted)
}

/// One statement, run again if the database reports contention (a deadlock victim's
/// statement was rolled back).
fn run<C: LockConnection, T>(
    c: &mut C,
    f: impl FnMut(&mut C) -> diesel::QueryResult<T>,
) -> Result<T> {
    crate::backoff::retry_contended(c, Duration::from_millis(128), "a purge", f, |c, e| {
        c.sql().is_contention(e)
    })
    .map_err(Error::from)
}
