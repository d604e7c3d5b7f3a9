//! One attempt of a strategy with a line of waiters (`line.rs`), for the waiting loop
//! (`wait.rs`): a place's renewal or look, taking a key granted to it, the head's try, and
//! a newcomer's joining with its try right after.

use super::cancel::Cancel;
use super::deadline::Deadline;
use super::line::{place_ttl, Place};
use super::Locker;
use crate::backend::{LockConnection, Sql, Wait};
use crate::strategy::{Conn, RawLock, Taken};
use crate::{Error, Result};

impl<C: LockConnection> Locker<C> {
    /// A grant its notification told (PostgreSQL, `Queues::take_grant`) to the waiter of
    /// `place`, taken as a look that saw it would take it (`Place::told`). Where the strategy
    /// needs no statement for it (`Lease`: `RawLock::take_grant`), the key is taken here, with
    /// no statement and no connection: `Some` (`None` inside if the wait was cancelled
    /// meanwhile: released at once, and its release hands the key on). Otherwise (`Row`) the
    /// place is marked granted, and the attempt's `attempt_in_line` confirms it with no look.
    pub(super) fn take_told<'a>(
        &'a self,
        raw: &'a dyn RawLock<C>,
        key: &str,
        place: &mut Option<Place<'a, C>>,
        cancel: Option<&Cancel>,
    ) -> Option<Option<Taken>> {
        if cancel.is_some_and(Cancel::is_cancelled) {
            return None;
        }
        let p = place.as_mut()?;
        let told = self.inner.shared.queues.take_grant(key, p.id, &p.holder)?;
        if !p.told(&told) {
            return None;
        }
        let taken = raw.take_grant(key, p.id, &p.holder, p.grant())?;
        log::trace!(
            "lock {key:?}: took the key granted to place {}, as told",
            p.id
        );
        if let Some(p) = place.take() {
            p.used();
        }
        if cancel.is_some_and(Cancel::is_cancelled) {
            super::wait::give_back_cancelled(key, taken);
            return Some(None);
        }
        Some(Some(taken))
    }

    /// One attempt of a strategy with a line (`line.rs`): a waiter with a place renews it
    /// when due and tries the key only if no live place is ahead of it; one without a place
    /// that finds the key held, and may wait, joins the line and tries once more at once (a
    /// release between its first try and its joining notified nobody).
    pub(super) fn attempt_in_line<'a>(
        &'a self,
        raw: &'a dyn RawLock<C>,
        conn: &mut Conn<C>,
        key: &'a str,
        retry: bool,
        deadline: Deadline,
        place: &mut Option<Place<'a, C>>,
    ) -> Result<Option<Taken>> {
        if let Some(p) = place.as_mut() {
            if p.take_told() {
                // Its notification told the grant (`Place::told`): taken below, no look.
            } else if !p.refresh(&mut **conn)? {
                if let Some(p) = place.take() {
                    p.leave(&mut **conn);
                }
            } else {
                self.inner.shared.queues.raise_floor(key, p.floor());
            }
        }
        // A reader or a permit may be let in past places ahead of its own (other readers;
        // as many as there are free permits): within reach (`Place::in_reach`) it tries at
        // every look, and its acquisition decides. Releases do not hand readers and permits
        // the key, so nothing else would let them in: pacing their tries as the first
        // exclusive waiter's (`HEAD_TRY`) left free permits idle.
        let joined = match place.as_mut() {
            Some(p) if p.granted() => {
                // A release handed this place the key: take it (confirmed by the strategy).
                conn.place = p.id;
                conn.holder = Some(p.holder.clone());
                conn.granted = Some(p.grant());
                let confirmed = raw.try_acquire(conn, key, true, Wait::No);
                conn.granted = None;
                return match confirmed {
                    Ok(Some(taken)) => {
                        if let Some(p) = place.take() {
                            p.used();
                        }
                        Ok(Some(taken))
                    }
                    Ok(None) => {
                        // The grant lapsed or was taken away (a forced release): join again.
                        log::debug!("lock {key:?}: the key granted to place {} was gone before it was confirmed", p.id);
                        if let Some(p) = place.take() {
                            p.leave(&mut **conn);
                        }
                        Ok(None)
                    }
                    Err(e) => {
                        // The confirmation may have committed: giving the place up gives the
                        // key back in any case.
                        p.may_hold = true;
                        Err(e)
                    }
                };
            }
            Some(p) if !p.in_reach() => return Ok(None),
            Some(p) => {
                if raw.exclusive() && !p.try_due() {
                    return Ok(None);
                }
                conn.place = p.id;
                conn.holder = Some(p.holder.clone());
                true
            }
            // A key this `Locker` found contended lately (`retry`), asked for by a wait:
            // a try before joining would most likely find it held, or granted to the first
            // in line (a releaser coming back for the key it just handed over). The waiter
            // joins at once, and tries once in line below: one statement less.
            None if retry
                && raw.exclusive()
                && !matches!(deadline, Deadline::Once)
                && !deadline.remaining().is_some_and(|left| left.is_zero()) =>
            {
                return self.join_and_try(raw, conn, key, place);
            }
            None => false,
        };
        let taken = raw.try_acquire(conn, key, retry || joined, Wait::No)?;
        if joined && taken.is_none() && !raw.exclusive() {
            if let Some(p) = place.as_mut() {
                p.busy();
            }
        }
        if taken.is_none() || joined {
            self.inner.shared.queues.mark_contended(key);
        }
        if taken.is_some() || joined || matches!(deadline, Deadline::Once) {
            if taken.is_some() {
                if let Some(p) = place.take() {
                    Self::took_with(raw, p);
                }
            }
            return Ok(taken);
        }
        if deadline.remaining().is_some_and(|left| left.is_zero()) {
            return Ok(None);
        }
        self.join_and_try(raw, conn, key, place)
    }

    /// Joins `key`'s line, then tries the key once with the new place (a release that came
    /// before the joining notified nobody).
    fn join_and_try<'a>(
        &'a self,
        raw: &'a dyn RawLock<C>,
        conn: &mut Conn<C>,
        key: &'a str,
        place: &mut Option<Place<'a, C>>,
    ) -> Result<Option<Taken>> {
        let joined = Place::join(
            &mut **conn,
            &self.inner.pool,
            raw,
            key,
            &self.inner.shared.owner,
            self.channel(),
            place_ttl(self.inner.max_backoff),
            !raw.exclusive(),
        );
        let mut p = match joined {
            Ok(p) => p,
            // The place could not be written for contention (SQLite: another connection kept
            // the write lock for the whole busy timeout; MySQL: a deadlock's victim nine
            // times): the key counts as found busy, as an acquisition that met contention
            // does, and the wait tries again (joining first) until its deadline.
            Err(Error::Database(e)) if conn.sql().is_contention(&e) => {
                log::debug!("lock {key:?}: joining the line met contention ({e}); trying again");
                self.inner.shared.queues.mark_contended(key);
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        p.start_at(self.inner.shared.queues.floor(key));
        conn.place = p.id;
        conn.holder = Some(p.holder.clone());
        let taken = raw.try_acquire(conn, key, true, Wait::No)?;
        if taken.is_some() {
            Self::took_with(raw, p);
        } else {
            self.inner.shared.queues.mark_contended(key);
            *place = Some(p);
        }
        Ok(taken)
    }

    /// An acquisition made with place `p`: removed by the acquisition itself, or given up
    /// now (`RawLock::removes_place`; dropping it leaves the line).
    fn took_with(raw: &dyn RawLock<C>, p: Place<'_, C>) {
        if raw.removes_place() {
            p.used();
        } else {
            drop(p);
        }
    }
}
