//! `Strategy::Lease`: holder + expiry on the database clock, renewed by the heartbeat.

use super::{micros, Ctx, Hold, Taken};
use crate::backend::LockConnection;
use crate::backend::Sql;
use crate::{Error, Result};
use std::time::Duration;

pub(super) fn try_acquire<C: LockConnection>(
    ctx: &Ctx<'_, C>,
    conn: &mut C,
    key: &str,
    ttl: Duration,
    retry: bool,
) -> Result<Option<Taken<C>>> {
    let ttl_us = micros(ttl).unwrap_or(i64::MAX);
    let holder = crate::random::holder_id();
    let sent = std::time::Instant::now();
    let Some(a) = conn
        .sql()
        .lease_acquire(key, ctx.owner, &holder, ttl_us, retry)?
    else {
        return Ok(None);
    };
    let beat = ctx.heartbeat.register(key, &holder, sent);
    Ok(Some(Taken {
        hold: Hold::Lease { holder, beat },
        token: a.token,
        acquired_at: a.acquired_at,
    }))
}

pub(super) fn release<C: LockConnection>(
    ctx: &Ctx<'_, C>,
    key: &str,
    holder: &str,
    beat: super::heartbeat::Beat,
) -> Result<()> {
    // Stop renewing first. A renewal already under way cannot revive the lease after the
    // release below: renewals match on our holder id, which the release clears.
    let was_lost = beat.is_lost();
    drop(beat);
    if super::with_conn(ctx.pool, |c| c.sql().lease_release(key, holder))? && !was_lost {
        Ok(())
    } else {
        Err(Error::LockLost {
            key: key.to_owned(),
        })
    }
}

pub(super) fn held<C: LockConnection>(ctx: &Ctx<'_, C>, key: &str, holder: &str) -> Result<bool> {
    super::with_conn(ctx.pool, |c| c.sql().lease_held(key, holder))
}
