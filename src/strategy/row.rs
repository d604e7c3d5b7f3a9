//! `Strategy::Row`: the lock is a row on a unique key; release deletes it by id.

use super::{micros, Ctx, Hold, Taken};
use crate::backend::LockConnection;
use crate::{Error, Result};
use std::time::Duration;

pub(super) fn try_acquire<C: LockConnection>(
    ctx: &Ctx<'_, C>,
    conn: &mut C,
    key: &str,
    stale_after: Option<Duration>,
    retry: bool,
) -> Result<Option<Taken<C>>> {
    if let Some(a) = conn.row_acquire(key, ctx.owner, retry)? {
        return Ok(Some(taken(a)));
    }
    let Some(stale) = stale_after else {
        return Ok(None);
    };
    // One conditional DELETE removes the row only if it is still the stale one: a fresh row
    // that replaced it in the meantime is younger than the cutoff and survives. After it,
    // every taker competes with an ordinary insert, so only one of them wins.
    let stale_us = micros(stale).unwrap_or(i64::MAX);
    if conn.row_delete_stale(key, stale_us)? {
        log::warn!(
            "lock {key:?}: took over a row older than {stale:?} (its holder is presumed dead)"
        );
        return Ok(conn.row_acquire(key, ctx.owner, false)?.map(taken));
    }
    Ok(None)
}

fn taken<C: LockConnection>(a: crate::backend::Acquired) -> Taken<C> {
    Taken {
        hold: Hold::Row { id: a.id },
        token: a.token,
        acquired_at: a.acquired_at,
    }
}

pub(super) fn release<C: LockConnection>(ctx: &Ctx<'_, C>, key: &str, id: i64) -> Result<()> {
    if super::with_conn(ctx.pool, |c| c.row_release(id))? {
        Ok(())
    } else {
        Err(Error::LockLost {
            key: key.to_owned(),
        })
    }
}

pub(super) fn held<C: LockConnection>(ctx: &Ctx<'_, C>, id: i64) -> Result<bool> {
    super::with_conn(ctx.pool, |c| c.row_held(id))
}
