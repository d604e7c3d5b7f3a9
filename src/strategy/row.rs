//! `Strategy::Row`: the lock is a row on a unique key; release deletes it by id.

use super::{micros, Ctx, Hold, Taken};
use crate::backend::LockConnection;
use crate::backend::Sql;
use crate::{Error, Result};
use std::time::Duration;

pub(super) fn try_acquire<C: LockConnection>(
    ctx: &Ctx<'_, C>,
    conn: &mut C,
    key: &str,
    stale_after: Option<Duration>,
    retry: bool,
) -> Result<Option<Taken<C>>> {
    let holder = crate::random::holder_id();
    // The row carries its own staleness limit (`stale_at`), fixed by this Locker's setting.
    let stale_us = stale_after.map(|d| micros(d).unwrap_or(i64::MAX));
    if let Some(a) = insert(ctx, conn, key, &holder, stale_us, retry)? {
        return Ok(Some(taken(a)));
    }
    // The holder's row goes stale only past the limit its *holder* set (never, without
    // one), whatever this Locker's own `stale_after` says. One conditional DELETE removes
    // it only if it is still the stale one: a row that replaced it in the meantime has its
    // own, later `stale_at` and survives. After it, every taker competes with an ordinary
    // insert, so only one of them wins.
    if conn.sql().row_delete_stale(key)? {
        log::warn!(
            "lock {key:?}: took over a row past its holder's stale_after (its holder is presumed dead)"
        );
        return Ok(insert(ctx, conn, key, &holder, stale_us, false)?.map(taken));
    }
    Ok(None)
}

/// The backend's insert. An error other than contention may come after the INSERT committed
/// (a lost reply, a connection dropped before the row was read back): the row, if any, is
/// then deleted by its holder id on another connection, so that no lock is left that nobody
/// holds. Contention errors roll their statement back and leave nothing.
fn insert<C: LockConnection>(
    ctx: &Ctx<'_, C>,
    conn: &mut C,
    key: &str,
    holder: &str,
    stale_us: Option<i64>,
    retry: bool,
) -> Result<Option<crate::backend::Acquired>> {
    match conn
        .sql()
        .row_acquire(key, ctx.owner, holder, stale_us, retry)
    {
        Err(e) if !conn.sql().is_contention(&e) => {
            match super::with_conn(ctx.pool, |c| c.sql().row_forget(key, holder)) {
                Ok(true) => log::warn!("lock {key:?}: acquiring failed ({e}) after the row was inserted; the row was removed"),
                Ok(false) => {}
                Err(cleanup) => log::warn!(
                    "lock {key:?}: acquiring failed ({e}), and removing a row it may have left failed too ({cleanup}); if the key stays held, remove holder {holder} with `dlock release --force`"
                ),
            }
            Err(e.into())
        }
        other => Ok(other?),
    }
}

fn taken<C: LockConnection>(a: crate::backend::Acquired) -> Taken<C> {
    Taken {
        hold: Hold::Row { id: a.id },
        token: a.token,
        acquired_at: a.acquired_at,
    }
}

pub(super) fn release<C: LockConnection>(ctx: &Ctx<'_, C>, key: &str, id: i64) -> Result<()> {
    if super::with_conn(ctx.pool, |c| c.sql().row_release(id))? {
        Ok(())
    } else {
        Err(Error::LockLost {
            key: key.to_owned(),
        })
    }
}

pub(super) fn held<C: LockConnection>(ctx: &Ctx<'_, C>, id: i64) -> Result<bool> {
    super::with_conn(ctx.pool, |c| c.sql().row_held(id))
}
