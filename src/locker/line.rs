//! A waiter's place in a key's line in the database (`dlock_waiters`), for the strategies
//! whose waiters would otherwise poll in no order (`RawLock::lines`: `Row`, `Lease`).
//!
//! The first thread of a `Locker` waiting for a key (the others wait in the in-process
//! line, `queue.rs`) takes a numbered place once it has found the key held, and keeps it
//! alive while it waits. The acquiring statements take a free key only for the lowest live
//! place (a newcomer, with no place, waits behind every one: no barging), and remove the
//! winner's place. A waiter with places ahead of it does not try the key at all: it renews
//! its place and counts those ahead. A release on PostgreSQL notifies the first live place's
//! `Locker` only (its listener's channel is stored with the place); elsewhere the first
//! polls. A place whose waiter died lapses at its expiry; one whose wait ended otherwise
//! (deadline, cancel, error, panic) is given up when its `Place` is dropped.

use crate::backend::{LockConnection, Sql};
use crate::strategy::Pool;
use std::time::{Duration, Instant};

/// How long a place stays alive without a renewal: long enough for the pauses between a
/// waiter's looks (at most `max_backoff`) with room to spare, short enough that a dead
/// waiter's place holds up the line briefly.
pub(super) fn place_ttl(max_backoff: Duration) -> Duration {
    (max_backoff * 4).max(Duration::from_secs(2))
}

/// A place held by a waiting thread.
pub(super) struct Place<'a, C: LockConnection> {
    pool: &'a Pool<C>,
    key: &'a str,
    pub(super) id: i64,
    ttl: Duration,
    ttl_us: i64,
    /// When the last join or renewal was sent (the database's expiry follows it).
    renewed: Instant,
    /// When the place was taken, and how many were ahead at the first look.
    joined: Instant,
    ahead_at_first_look: Option<i64>,
    /// The live places ahead of this one at the last look; `None` before the first.
    ahead: Option<i64>,
    /// Since when `ahead` has been what it is.
    since: Instant,
    /// Set once the place went with an acquisition (the acquiring statement removed it).
    used: bool,
}

impl<'a, C: LockConnection> Place<'a, C> {
    /// Takes a place at the end of `key`'s line on `conn`; `shared` for a reader's or a
    /// permit's (`Lines::line_join`).
    pub(super) fn join(
        conn: &mut C,
        pool: &'a Pool<C>,
        key: &'a str,
        owner: &str,
        channel: Option<&str>,
        ttl: Duration,
        shared: bool,
    ) -> crate::Result<Place<'a, C>> {
        let ttl_us = crate::strategy::micros(ttl).unwrap_or(i64::MAX);
        let renewed = Instant::now();
        let id = conn.sql().line_join(key, owner, channel, ttl_us, shared)?;
        log::trace!("lock {key:?}: waiting in line, place {id}");
        Ok(Place {
            pool,
            key,
            id,
            ttl,
            ttl_us,
            renewed,
            joined: renewed,
            ahead_at_first_look: None,
            ahead: None,
            since: renewed,
            used: false,
        })
    }

    /// Whether the waiter may try the key: nobody was ahead at the last look.
    pub(super) fn first(&self) -> bool {
        self.ahead == Some(0)
    }

    /// Before an attempt: renews the place once a third of its ttl has passed (a write),
    /// otherwise, unless it was first at the last look, counts those ahead (a read: only a
    /// look tells when they go). False if the place lapsed (this waiter was held up for longer
    /// than its ttl, and others were let past it) or is gone (a purge removed it): the caller
    /// then joins again, at the end.
    pub(super) fn refresh(&mut self, conn: &mut C) -> crate::Result<bool> {
        let sent = Instant::now();
        let ahead = if sent.duration_since(self.renewed) >= self.ttl / 3 {
            let ahead = conn.sql().line_renew(self.key, self.id, self.ttl_us)?;
            if ahead.is_some() {
                self.renewed = sent;
            }
            ahead
        } else if self.first() {
            return Ok(true);
        } else {
            conn.sql().line_look(self.key, self.id)?
        };
        let Some(ahead) = ahead else {
            log::debug!(
                "lock {:?}: place {} in line lapsed; joining again",
                self.key,
                self.id
            );
            // Given up by the caller (`leave`), which joins again.
            return Ok(false);
        };
        self.ahead_at_first_look.get_or_insert(ahead);
        if self.ahead != Some(ahead) {
            self.since = sent;
        }
        self.ahead = Some(ahead);
        Ok(true)
    }

    /// How long to pause before the next look, for a waiter that hears no notifications.
    /// The first in line, and the next (whose turn comes as soon as the first has had the
    /// key), look ever less often the longer the line has stood still (an eighth of that
    /// time, from 250 µs up to `max`): quick to follow a quick holder, quiet behind a slow
    /// one. One further back, once the line has moved, expects its turn after that many
    /// hand-overs less one at the pace the line has moved since it joined, and looks at half
    /// that time (before that, as the first does).
    pub(super) fn pause(&self, max: Duration) -> Duration {
        let floor = Duration::from_micros(250);
        let still = self.since.elapsed() / 8;
        let pause = match self.ahead {
            Some(ahead) if ahead > 1 => {
                let moved = self.ahead_at_first_look.unwrap_or(ahead) - ahead;
                match u32::try_from(moved) {
                    Ok(moved) if moved > 0 => {
                        let per_handover = self.joined.elapsed() / moved;
                        per_handover.saturating_mul(u32::try_from(ahead - 1).unwrap_or(u32::MAX))
                            / 2
                    }
                    _ => still,
                }
            }
            _ => still,
        };
        pause.clamp(floor, max.max(floor))
    }

    /// The acquisition that went with this place removed it.
    pub(super) fn used(mut self) {
        self.used = true;
    }

    /// Gives the place up on `conn`, the connection at hand (`Drop` would take another one
    /// from the pool, which on a pool of one would wait for this one).
    pub(super) fn leave(mut self, conn: &mut C) {
        self.used = true;
        if let Err(e) = conn.sql().line_leave(self.key, self.id) {
            log::debug!(
                "lock {:?}: giving up place {} in line failed ({e}); it lapses within {:?}",
                self.key,
                self.id,
                self.ttl
            );
        }
    }
}

impl<C: LockConnection> Drop for Place<'_, C> {
    fn drop(&mut self) {
        if self.used {
            return;
        }
        // Best effort, with a short wait for a connection: a place not given up lapses at its
        // expiry, and holds up the line only until then.
        let patience = self.pool.connection_timeout().min(Duration::from_secs(1));
        let left = match self.pool.get_timeout(patience) {
            Ok(mut c) => c
                .sql()
                .line_leave(self.key, self.id)
                .map_err(crate::Error::from),
            Err(e) => Err(e.into()),
        };
        match left {
            Ok(()) => log::trace!("lock {:?}: left the line (place {})", self.key, self.id),
            Err(e) => log::debug!(
                "lock {:?}: giving up place {} in line failed ({e}); it lapses within {:?}",
                self.key,
                self.id,
                self.ttl
            ),
        }
    }
}
