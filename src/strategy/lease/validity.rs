//! A lease's local deadline: how long its guard may say "held" without hearing from the
//! database, so that a holder cut off from it (statements hanging, replies lost) stops
//! saying so before any other client can take the key.
//!
//! The database sets the expiry to *its* time of the acquiring or renewing statement plus
//! the ttl, and that statement cannot run before it was sent. So counting from the instant
//! just before the statement was sent needs no allowance for network or queueing delay: the
//! database's count can only start later. What is left to allow for:
//!
//! - **Clock rates**: the ttl is counted by two clocks, this process's monotonic clock and
//!   the database's. 1 % of the ttl covers a difference in rate of up to 1 %, twenty times
//!   the 500 ppm by which NTP may slew each clock on Linux.
//! - **Timestamp resolution**: 1 ms, SQLite's (its `'now'` has whole milliseconds: an expiry
//!   may be stored up to 1 ms early). PostgreSQL and MySQL keep microseconds.
//!
//! Hence the local validity `ttl − (ttl/100 + 1 ms)`. A clock *step* of the database server
//! (a jump of its wall clock) is not covered: it moves every expiry with it.
//!
//! Once lost, always lost: a renewal whose reply arrives after the deadline is not taken
//! as a renewal (the guard may already have said "lost", and whoever asked may have stopped
//! working on that basis), and the heartbeat stops renewing that lease.

use crate::loss::Loss;
use crate::sync::Unpoison;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long after sending a successful acquisition or renewal its lease counts as held
/// locally: `ttl − (ttl/100 + 1 ms)` (see the module docs), zero for a ttl under about 1 ms.
pub(crate) fn local_validity(ttl: Duration) -> Duration {
    ttl.saturating_sub(ttl / 100 + Duration::from_millis(1))
}

/// What a guard and the heartbeat share about one lease: its local deadline, and whether it
/// is lost for good.
#[derive(Debug)]
pub(crate) struct Validity {
    state: Mutex<State>,
    /// `local_validity(ttl)`.
    validity: Duration,
    /// The guard's loss status, kept in step under `state`'s mutex: its deadline is always
    /// this one, and it is marked lost when this is.
    loss: Arc<Loss>,
}

#[derive(Debug)]
struct State {
    until: Instant,
    lost: bool,
}

impl Validity {
    /// A lease whose acquiring statement was sent at `sent`.
    pub(crate) fn new(sent: Instant, ttl: Duration) -> Self {
        let validity = local_validity(ttl);
        let loss = Loss::new();
        loss.set_until(sent + validity);
        Validity {
            state: Mutex::new(State {
                until: sent + validity,
                lost: false,
            }),
            validity,
            loss,
        }
    }

    /// A lease a release granted to a waiter's place (`Heartbeat::register_granted`): it
    /// expires with the place, whose last join or renewal was sent at `renewed` and which
    /// lives `place_ttl` from then on the database clock, until the grant is confirmed (a
    /// renewal: `renewed`, counted with `ttl`).
    pub(crate) fn granted(renewed: Instant, place_ttl: Duration, ttl: Duration) -> Self {
        let v = Self::new(renewed, place_ttl);
        Validity {
            validity: local_validity(ttl),
            ..v
        }
    }

    /// The loss status of the guard, which this marks.
    pub(crate) fn loss(&self) -> Arc<Loss> {
        self.loss.clone()
    }

    /// The state, its deadline applied. One mutex for both fields, so that no caller can
    /// see the lease held after another has seen it lost.
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        let mut st = self.state.lock().unpoisoned();
        if !st.lost && Instant::now() >= st.until {
            st.lost = true;
            self.loss.mark_lost();
        }
        st
    }

    /// The instant until which the lease counts as held, or `None` once it is lost.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        let st = self.state();
        (!st.lost).then_some(st.until)
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.state().lost
    }

    /// The database says the lease is not ours (any more).
    pub(crate) fn lose(&self) {
        self.state().lost = true;
        self.loss.mark_lost();
    }

    /// A renewal sent at `sent` succeeded: the deadline moves to `sent` plus the validity,
    /// unless the lease is lost already (its deadline passed while the renewal was under
    /// way), which it stays. False if it was.
    pub(crate) fn renewed(&self, sent: Instant) -> bool {
        let mut st = self.state();
        if !st.lost {
            st.until = st.until.max(sent + self.validity);
            self.loss.set_until(st.until);
        }
        !st.lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(30);

    /// `d` before now (the monotonic clock starts at boot: the machine has run longer).
    fn ago(d: Duration) -> Instant {
        Instant::now()
            .checked_sub(d)
            .expect("up for longer than a ttl")
    }

    #[test]
    fn the_margin_is_a_hundredth_of_the_ttl_and_a_millisecond() {
        assert_eq!(local_validity(TTL), Duration::from_millis(29_699));
        assert_eq!(
            local_validity(Duration::from_millis(600)),
            Duration::from_millis(593)
        );
        assert_eq!(local_validity(Duration::from_millis(1)), Duration::ZERO);
        assert!(local_validity(Duration::from_micros(500)).is_zero());
    }

    #[test]
    fn the_deadline_counts_from_the_send_time() {
        let sent = Instant::now();
        let v = Validity::new(sent, TTL);
        assert_eq!(v.deadline(), Some(sent + local_validity(TTL)));
        // A renewal sent later moves it; one reported out of order never moves it back.
        let later = sent + Duration::from_secs(10);
        assert!(v.renewed(later));
        assert_eq!(v.deadline(), Some(later + local_validity(TTL)));
        assert!(v.renewed(sent));
        assert_eq!(v.deadline(), Some(later + local_validity(TTL)));
    }

    /// A granted lease counts as held until its place's expiry, and a confirmation (a
    /// renewal) gives it the lease's own ttl.
    #[test]
    fn a_granted_lease_runs_to_its_place_expiry_until_confirmed() {
        let renewed = Instant::now();
        let place_ttl = Duration::from_secs(2);
        let v = Validity::granted(renewed, place_ttl, TTL);
        assert_eq!(v.deadline(), Some(renewed + local_validity(place_ttl)));
        let sent = renewed + Duration::from_millis(100);
        assert!(v.renewed(sent));
        assert_eq!(v.deadline(), Some(sent + local_validity(TTL)));
        // A place renewed a whole place ttl ago: its grant may have lapsed already.
        let v = Validity::granted(ago(place_ttl), place_ttl, TTL);
        assert!(v.is_lost());
    }

    #[test]
    fn a_lease_past_its_deadline_is_lost() {
        // Sent a whole ttl ago: the database's expiry may have passed already.
        let v = Validity::new(ago(TTL), TTL);
        assert!(v.is_lost());
        assert_eq!(v.deadline(), None);
        // Sent 90 % of a ttl ago: still held, for a few seconds more.
        let v = Validity::new(ago(TTL * 9 / 10), TTL);
        assert!(!v.is_lost());
    }

    /// A renewal in flight while the deadline passes, whose success is reported afterwards:
    /// the guard may already have said "lost" to a caller, so it never says "held" again.
    #[test]
    fn a_late_renewal_does_not_revive_a_lost_lease() {
        let v = Validity::new(ago(TTL), TTL);
        assert!(v.is_lost());
        // Sent just now: on its own it would count as valid for most of a ttl.
        assert!(!v.renewed(Instant::now()));
        assert!(v.is_lost());
        assert_eq!(v.deadline(), None);
    }

    #[test]
    fn lost_by_the_database_is_lost_for_good() {
        let v = Validity::new(Instant::now(), TTL);
        v.lose();
        assert!(v.is_lost());
        assert!(!v.renewed(Instant::now()));
        assert!(v.is_lost());
    }
}
