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
