//! Exponential backoff with jitter, written once for every loop that waits and tries again:
//! the `Locker`'s waiters, the contention retries of releases and renewals, optimistic
//! transactions and the release listener's reconnects.

use crate::random;
use std::time::Duration;

/// Pauses that start at `first` and double up to `max`, each drawn from the upper half of
/// the current bound, so that callers that collided spread out without long tails.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    bound: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        Backoff {
            bound: first.min(max),
            max,
        }
    }

    /// The next pause; the bound then doubles (up to `max`).
    pub(crate) fn next_pause(&mut self) -> Duration {
        let bound = self.bound;
        self.bound = (self.bound * 2).min(self.max);
        jitter(bound)
    }
}

/// Runs `f` on `conn`, and again after a pause of backoff (1 ms doubling up to `max`) while
/// it fails with an error `contended` says is contention (a deadlock victim's statement was
/// rolled back, so running it again is safe): at most 9 runs; the last one's result is
/// returned. `what` names the statement in the debug log.
pub(crate) fn retry_contended<C: ?Sized, T, E: std::fmt::Display>(
    conn: &mut C,
    max: Duration,
    what: &str,
    mut f: impl FnMut(&mut C) -> Result<T, E>,
    contended: impl Fn(&mut C, &E) -> bool,
) -> Result<T, E> {
    let mut backoff = Backoff::new(Duration::from_millis(1), max);
    for _ in 0..8 {
        match f(conn) {
            Err(e) if contended(conn, &e) => {
                log::debug!("contention on {what} ({e}); retrying");
                std::thread::sleep(backoff.next_pause());
            }
            other => return other,
        }
    }
    f(conn)
}

/// A pause drawn from the upper half of `bound`: at least `bound / 2`, at most `bound`.
pub(crate) fn jitter(bound: Duration) -> Duration {
    let half = bound / 2;
    let nanos = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX).max(1);
    half + Duration::from_nanos(random::random_u64() % nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contention_is_retried_nine_runs_at_most_and_other_errors_at_once() {
        let contended = |_: &mut u32, e: &&str| *e == "busy";
        let max = Duration::from_millis(1);
        let mut runs = 0;
        let r = retry_contended(
            &mut runs,
            max,
            "t",
            |n| {
                *n += 1;
                if *n < 3 {
                    Err("busy")
                } else {
                    Ok(*n)
                }
            },
            contended,
        );
        assert_eq!(r, Ok(3));
        let mut runs = 0;
        let r: Result<(), _> = retry_contended(
            &mut runs,
            max,
            "t",
            |n| {
                *n += 1;
                Err("busy")
            },
            contended,
        );
        assert_eq!((r, runs), (Err("busy"), 9));
        let mut runs = 0;
        let r: Result<(), _> = retry_contended(
            &mut runs,
            max,
            "t",
            |n| {
                *n += 1;
                Err("broken")
            },
            contended,
        );
        assert_eq!((r, runs), (Err("broken"), 1));
    }

    #[test]
    fn pauses_grow_to_their_bound() {
        let mut b = Backoff::new(Duration::from_millis(1), Duration::from_millis(50));
        let pauses: Vec<_> = (0..12).map(|_| b.next_pause()).collect();
        assert!(pauses[0] <= Duration::from_millis(1));
        assert!(pauses.iter().all(|p| *p <= Duration::from_millis(50)));
        assert!(pauses[11] >= Duration::from_millis(25));
    }

    #[test]
    fn jitter_stays_in_the_upper_half() {
        for _ in 0..1000 {
            let p = jitter(Duration::from_millis(10));
            assert!(
                p >= Duration::from_millis(5) && p <= Duration::from_millis(10),
                "{p:?}"
            );
        }
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
    }
}
