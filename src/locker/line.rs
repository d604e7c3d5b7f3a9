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
    /// The live places ahead of this one at the last look.
    pub(super) ahead: i64,
    /// Set once the place went with an acquisition (the acquiring statement removed it).
    used: bool,
}

impl<'a, C: LockConnection> Place<'a, C> {
    /// Takes a place at the end of `key`'s line on `conn`.
    pub(super) fn join(
        conn: &mut C,
        pool: &'a Pool<C>,
        key: &'a str,
        owner: &str,
        channel: Option<&str>,
        ttl: Duration,
    ) -> crate::Result<Place<'a, C>> {
        let ttl_us = crate::strategy::micros(ttl).unwrap_or(i64::MAX);
        let renewed = Instant::now();
        let id = conn.sql().line_join(key, owner, channel, ttl_us)?;
        log::trace!("lock {key:?}: waiting in line, place {id}");
        Ok(Place {
            pool,
            key,
            id,
            ttl,
            ttl_us,
            renewed,
            // Not known yet: the attempt that follows the join tells.
            ahead: 0,
            used: false,
        })
    }

    /// Whether the place should be renewed before the next attempt: a third of its ttl
    /// has passed, or others were ahead at the last look (only a look tells when they go).
    pub(super) fn due(&self) -> bool {
        self.ahead > 0 || self.renewed.elapsed() >= self.ttl / 3
    }

    /// Renews the place and counts those ahead; false if the place is gone (it lapsed while
    /// this waiter was held up for longer than its ttl, and a purge or a newer waiter
    /// removed it): the caller then joins again, at the end.
    pub(super) fn renew(&mut self, conn: &mut C) -> crate::Result<bool> {
        let sent = Instant::now();
        match conn.sql().line_renew(self.key, self.id, self.ttl_us)? {
            Some(ahead) => {
                self.renewed = sent;
                self.ahead = ahead;
                Ok(true)
            }
            None => {
                log::debug!(
                    "lock {:?}: place {} in line lapsed; joining again",
                    self.key,
                    self.id
                );
                self.used = true; // nothing left to give up
                Ok(false)
            }
        }
    }

    /// The acquisition that went with this place removed it.
    pub(super) fn used(mut self) {
        self.used = true;
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
