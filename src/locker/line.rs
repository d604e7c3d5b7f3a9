//! A waiter's place in a key's line in the database (`dlock_waiters`), for the strategies
//! whose waiters would otherwise poll in no order (`RawLock::lines`: `Row`, `Lease`).
//!
//! The first thread of a `Locker` waiting for a key (the others wait in the in-process
//! line, `queue.rs`) takes a numbered place once it has found the key held, and keeps it
//! alive while it waits. The acquiring statements take a free key only for the lowest live
//! place (a newcomer, with no place, waits behind every one: no barging), and remove the
//! winner's place. An exclusive waiter with places ahead of it does not try the key at all:
//! it renews its place and counts those ahead. A reader's or permit's waiter, whom no
//! release hands the key, tries at every look while it is within reach (`in_reach`: no
//! exclusive place, and fewer places than the key's permits, ahead of it); its acquisition
//! takes a permit only while more are free than places are ahead. A release on PostgreSQL notifies the first live place's
//! `Locker` only (its listener's channel is stored with the place); elsewhere the first
//! polls. A place whose waiter died lapses at its expiry; one whose wait ended otherwise
//! (deadline, cancel, error, panic) is given up when its `Place` is dropped.

use crate::backend::{Line, LockConnection, Sql};
use crate::strategy::{Pool, RawLock};
use std::time::{Duration, Instant};

/// How often the first in line looks at its own place for a grant when it hears no
/// notifications (MySQL, SQLite, PostgreSQL without a listener): a cheap read of one
/// place. Those behind it pace themselves by the line's movement (`Place::pause`).
const HEAD_POLL: Duration = Duration::from_millis(1);

/// The longest pause of the first in line between looks, behind a holder that keeps the key
/// (reached once the line has stood still for 32 times as long, 0.8 s): a grant to it is
/// seen at most this late. 10 ms cost a waiting MariaDB process 1.4–1.8 % of a core; 25 ms
/// (with `HEAD_TRY_SLOW`) 0.4–0.8 % (`wait_report --cpu`, 26 Nov).
const HEAD_POLL_SLOW: Duration = Duration::from_millis(25);

/// The longest pause before its next look for which a waiter that polls keeps its pooled
/// connection (`wait.rs`): the first in line while the line moves or stands still briefly,
/// and those behind it while the line moves quickly. A longer pause gives it back.
pub(super) const KEEP_WITHIN: Duration = HEAD_POLL_SLOW;

/// How often the first in line also tries the key itself: releases hand the key over, so a
/// try finds it free only when no release did (a holder that died, a grant that lapsed, a
/// forced release, a purge). Behind a holder that keeps the key, ever less often (a 16th of
/// the time the line has stood still), up to `HEAD_TRY_SLOW`.
const HEAD_TRY: Duration = Duration::from_millis(20);

/// The longest pause of the first in line between its own tries: a key freed without a
/// hand-over (see `HEAD_TRY`) is found at most this late, once the line has stood still for
/// 16 times as long.
const HEAD_TRY_SLOW: Duration = Duration::from_millis(200);

/// How long a place stays alive without a renewal: long enough for the pauses between a
/// waiter's looks (at most `max_backoff`) with room to spare, short enough that a dead
/// waiter's place holds up the line briefly.
pub(super) fn place_ttl(max_backoff: Duration) -> Duration {
    (max_backoff * 4).max(Duration::from_secs(2))
}

/// A place held by a waiting thread.
pub(super) struct Place<'a, C: LockConnection> {
    pool: &'a Pool<C>,
    /// Gives back a key granted as the wait ended (`RawLock::give_back`).
    raw: &'a dyn RawLock<C>,
    key: &'a str,
    /// Whose line (`RawLock::line`).
    line: Line,
    pub(super) id: i64,
    /// The holder id a grant gives the key to.
    pub(super) holder: String,
    /// A release granted the key to this place (at the last look).
    granted: bool,
    /// When the first in line last tried the key itself.
    tried: Option<Instant>,
    /// A confirmation failed in a way that may have committed: giving the place up gives
    /// the key back whatever the removal says.
    pub(super) may_hold: bool,
    ttl: Duration,
    ttl_us: i64,
    /// When the last join or renewal was sent (the database's expiry follows it).
    renewed: Instant,
    /// When the place was taken, and how many were ahead at the first look.
    joined: Instant,
    ahead_at_first_look: Option<i64>,
    /// The live places ahead of this one at the last look; `None` before the first.
    ahead: Option<i64>,
    /// The exclusive waiters' places among them.
    exclusive_ahead: i64,
    /// A reader's or permit's tries found the key busy this many times in a row since the
    /// line ahead last moved: its looks (each a try) slow down, up to `HEAD_TRY`.
    busy: u32,
    /// A reader's or permit's place: how many of its kind the key may have at once
    /// (`RawLock::room`); `None` for an exclusive waiter's.
    room: Option<u32>,
    /// Since when `ahead` has been what it is.
    since: Instant,
    /// Set once the place went with an acquisition (the acquiring statement removed it).
    used: bool,
    /// No place below this one lives again (`Spot::floor`): the looks count from here.
    floor: i64,
    /// What the grant gave, if the last look read it (`Spot::lease`) or its notification
    /// told it (`told`).
    lease: Option<crate::backend::Acquired>,
    /// The grant was told by its notification, and the next attempt takes it with no look.
    told: bool,
}

impl<'a, C: LockConnection> Place<'a, C> {
    /// Takes a place at the end of `key`'s line on `conn`; `shared` for a reader's or a
    /// permit's (`Lines::line_join`: a shared place is never granted the key by a release).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn join(
        conn: &mut C,
        pool: &'a Pool<C>,
        raw: &'a dyn RawLock<C>,
        key: &'a str,
        owner: &str,
        channel: Option<&str>,
        ttl: Duration,
        shared: bool,
    ) -> crate::Result<Place<'a, C>> {
        let ttl_us = crate::strategy::micros(ttl).unwrap_or(i64::MAX);
        let renewed = Instant::now();
        let room = shared.then(|| raw.room());
        let holder = crate::random::holder_id();
        // Only a lock that lines up takes a place (`RawLock::lines`); `Lease`'s line
        // otherwise, as places of builds from before the line's column are.
        let line = raw.line().unwrap_or(Line::Lease);
        let crate::backend::Joined { id } = conn.sql().line_join(
            key,
            line,
            owner,
            channel,
            ttl_us,
            &holder,
            shared,
            raw.flags_line(),
        )?;
        log::trace!("lock {key:?}: waiting in line, place {id}");
        Ok(Place {
            pool,
            raw,
            key,
            line,
            id,
            holder,
            granted: false,
            tried: None,
            may_hold: false,
            ttl,
            ttl_us,
            renewed,
            joined: renewed,
            ahead_at_first_look: None,
            ahead: None,
            exclusive_ahead: 0,
            busy: 0,
            room,
            since: renewed,
            used: false,
            floor: 0,
            lease: None,
            told: false,
        })
    }

    /// Whether the waiter may be let in now, as far as the line tells (at the last look):
    /// first in line for an exclusive waiter; for a reader or a permit, no exclusive
    /// waiter ahead and fewer places ahead than the key may have holders of its kind (its
    /// acquisition then decides, counting what is free). Such a waiter tries at every look,
    /// and looks as often as the first in line.
    pub(super) fn in_reach(&self) -> bool {
        match (self.room, self.ahead) {
            (_, None) => false,
            (None, Some(ahead)) => ahead == 0,
            (Some(room), Some(ahead)) => self.exclusive_ahead == 0 && ahead < i64::from(room),
        }
    }

    /// Takes the grant its notification told (PostgreSQL, `Queues::take_grant`) as a look
    /// that saw it: granted, with the token and time it gave. Not while the place is past
    /// half its ttl (a notification heard that late is left to a look, which sees whether
    /// the grant lapsed). Whether it was taken.
    pub(super) fn told(&mut self, told: &crate::backend::Told) -> bool {
        if self.renewed.elapsed() >= self.ttl / 2 {
            return false;
        }
        let Some(acquired_at) = chrono::DateTime::from_timestamp_micros(told.acquired_us) else {
            return false;
        };
        self.granted = true;
        self.told = true;
        self.lease = Some(crate::backend::Acquired {
            id: 0,
            token: told.token,
            acquired_at,
        });
        true
    }

    /// Whether a grant was told since the last look (`told`), which then needs none; clears it.
    pub(super) fn take_told(&mut self) -> bool {
        std::mem::take(&mut self.told)
    }

    /// Whether a release granted this place the key (at the last look).
    pub(super) fn granted(&self) -> bool {
        self.granted
    }

    /// A grant of the key to this place: its deadline to confirm by is the place's
    /// expiry, no earlier than the last join or renewal sent plus the ttl (a granted place
    /// is not renewed).
    pub(super) fn grant(&self) -> crate::strategy::Grant {
        crate::strategy::Grant {
            renewed: self.renewed,
            ttl: self.ttl,
            lease: self.lease,
        }
    }

    /// Whether the first in line should try the key itself now (see `HEAD_TRY`): at once
    /// when it becomes first, then now and then; it notes the try.
    pub(super) fn try_due(&mut self) -> bool {
        let every = (self.since.elapsed() / 16).clamp(HEAD_TRY, HEAD_TRY_SLOW);
        let due = self.tried.is_none_or(|t| t.elapsed() >= every);
        if due {
            self.tried = Some(Instant::now());
        }
        due
    }

    /// Before an attempt: renews the place once a third of its ttl has passed (a write),
    /// otherwise looks at it (a read: whether a release granted it the key, and how many are
    /// ahead). False if the place lapsed (this waiter was held up for longer than its ttl,
    /// and others were let past it) or is gone (a purge removed it): the caller then joins
    /// again, at the end.
    pub(super) fn refresh(&mut self, conn: &mut C) -> crate::Result<bool> {
        let sent = Instant::now();
        let spot = if !self.granted && sent.duration_since(self.renewed) >= self.ttl / 3 {
            let spot =
                conn.sql()
                    .line_renew(self.key, self.line, self.id, self.ttl_us, self.floor)?;
            if spot.is_some_and(|s| !s.granted) {
                self.renewed = sent;
            }
            match spot {
                // Not renewed: lapsed, gone, or granted by a release that committed while
                // the renewal waited for the place (PostgreSQL's renewal then reads the rest
                // of its answer from before that commit): a look of its own tells. A grant
                // the renewal saw is looked at too: on `Lease` the look reads what it gave.
                None => {
                    self.raw
                        .look(conn, self.key, self.line, self.id, self.floor, &self.holder)?
                }
                Some(s) if s.granted && s.lease.is_none() => {
                    self.raw
                        .look(conn, self.key, self.line, self.id, self.floor, &self.holder)?
                }
                spot => spot,
            }
        } else {
            self.raw
                .look(conn, self.key, self.line, self.id, self.floor, &self.holder)?
        };
        self.granted = spot.is_some_and(|s| s.granted);
        self.lease = spot.and_then(|s| s.lease);
        if let Some(floor) = spot.and_then(|s| s.floor) {
            self.floor = self.floor.max(floor);
        }
        let ahead = spot.map(|s| s.ahead);
        let Some(ahead) = ahead else {
            log::debug!(
                "lock {:?}: place {} in line lapsed; joining again",
                self.key,
                self.id
            );
            // Given up by the caller (`leave`), which joins again.
            return Ok(false);
        };
        self.exclusive_ahead = spot.map_or(0, |s| s.exclusive);
        self.ahead_at_first_look.get_or_insert(ahead);
        if self.ahead != Some(ahead) {
            self.since = sent;
            self.busy = 0;
            if ahead == 0 {
                self.tried = None; // just became first: try the key at once
            }
        }
        self.ahead = Some(ahead);
        Ok(true)
    }

    /// How long to pause before the next look, for a waiter that hears no notifications.
    /// The first in line (or a reader or permit within reach, `in_reach`, or soon to be:
    /// behind fewer than twice its room, none of them exclusive, whose turn comes as soon
    /// as a few of those ahead are let in, several at once, which the line's pace so far
    /// does not foretell), and the next (whose turn comes as soon as the first has had the
    /// key), look ever less often the longer the line has stood still (an eighth of that
    /// time, from 250 µs up to `max`): quick to follow a quick holder, quiet behind a slow
    /// one. One further back, once the line has moved, expects its turn after that many
    /// hand-overs less one at the pace the line has moved since it joined, and looks at half
    /// that time (before that, as the first does).
    pub(super) fn pause(&self, max: Duration) -> Duration {
        let near = match (self.room, self.ahead) {
            (Some(room), Some(ahead)) => {
                self.exclusive_ahead == 0 && ahead < i64::from(room).saturating_mul(2)
            }
            _ => false,
        };
        if self.in_reach() || near {
            // Every `HEAD_POLL` while the line moves; behind a holder that keeps the key,
            // ever less often (a 32nd of the time the line has stood still), up to
            // `HEAD_POLL_SLOW`: a quick hand-over is seen within a millisecond, and a long
            // wait costs little CPU.
            let pause = (self.since.elapsed() / 32).clamp(HEAD_POLL, HEAD_POLL_SLOW);
            // A reader's or permit's look within reach is a try (a transaction that locks
            // the key's rows on `Lease`): after busy ones in a row, it waits twice as long
            // each time, up to `HEAD_TRY` or the look's own pause if that is longer (the
            // line moving ahead starts it over).
            let pause = match self.room {
                Some(_) if self.in_reach() && self.busy > 0 => (HEAD_POLL
                    * 2u32.saturating_pow(self.busy.min(8)))
                .clamp(pause, HEAD_TRY.max(pause)),
                _ => pause,
            };
            return pause.min(max.max(Duration::from_micros(250)));
        }
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

    /// No place below `floor` lives again (one an earlier place of this `Locker` saw): the
    /// looks count from there.
    pub(super) fn start_at(&mut self, floor: i64) {
        self.floor = self.floor.max(floor);
    }

    /// The floor the last look saw (see `Spot::floor`).
    pub(super) fn floor(&self) -> i64 {
        self.floor
    }

    /// A reader's or permit's try within reach found the key busy.
    pub(super) fn busy(&mut self) {
        self.busy = self.busy.saturating_add(1);
    }

    /// The acquisition that went with this place removed it.
    pub(super) fn used(mut self) {
        self.used = true;
    }

    /// Gives the place up on `conn`, the connection at hand (`Drop` would take another one
    /// from the pool, which on a pool of one would wait for this one).
    pub(super) fn leave(mut self, conn: &mut C) {
        self.used = true;
        if let Err(e) = self.give_up(conn) {
            log::debug!(
                "lock {:?}: giving up place {} in line failed ({e}); it lapses within {:?}",
                self.key,
                self.id,
                self.ttl
            );
        }
    }

    /// Removes the place, then gives back the key if a release had granted it to the place
    /// before the removal (the removal commits first: a release that had not granted it
    /// yet can no longer, and a grant already made is seen by the give-back, which hands
    /// the key on). The race of a waiter that gives up (deadline, cancel, error, panic) as
    /// it is granted the key ends so: the grant passes to the next place.
    fn give_up(&self, conn: &mut C) -> crate::Result<()> {
        #[cfg(feature = "test-hooks")]
        crate::hooks::before_leave(self.key);
        let granted = conn.sql().line_leave(self.key, self.line, self.id)?;
        if granted || self.may_hold {
            self.raw.give_back(conn, self.key, &self.holder)?;
        }
        Ok(())
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
            Ok(mut c) => self.give_up(&mut c),
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
