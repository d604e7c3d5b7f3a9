//! Metrics through the [`metrics`](https://docs.rs/metrics) facade, behind the `metrics`
//! feature (without it, every call here is an empty inline function). Labelled by strategy
//! and backend, never by key (keys are unbounded).
//!
//! | name | kind | what |
//! |---|---|---|
//! | `dlock_acquisitions_total` | counter | locks taken |
//! | `dlock_not_acquired_total` | counter | acquisition calls that ended without the lock (held elsewhere until the deadline, cancelled) |
//! | `dlock_contended_attempts_total` | counter | attempts that found the key held |
//! | `dlock_wait_seconds` | histogram | from the call to the lock taken, per acquisition |
//! | `dlock_held_seconds` | histogram | from the lock taken to its release (or loss found at release) |
//! | `dlock_locks_held` | gauge | guards alive now |
//! | `dlock_losses_total` | counter | locks lost while held (not released by their guard) |
//! | `dlock_release_failures_total` | counter | releases that failed with an error other than a loss |
//!
//! Readers, writers and permits count as acquisitions of their `Locker`'s strategy.
//! `lock_all` counts one acquisition per key it takes; when a later key is held, the keys
//! it took and gave back count too, and the call as one acquisition not made.

use std::time::Duration;

/// The labels of one `Locker`'s metrics, and the calls that record them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Meter {
    #[cfg(feature = "metrics")]
    strategy: &'static str,
    #[cfg(feature = "metrics")]
    backend: &'static str,
}

#[cfg(feature = "metrics")]
macro_rules! labelled {
    ($kind:ident, $name:expr, $m:expr) => {
        metrics::$kind!($name, "strategy" => $m.strategy, "backend" => $m.backend)
    };
}

#[cfg(feature = "metrics")]
impl Meter {
    pub(crate) fn new(strategy: &'static str, backend: &'static str) -> Self {
        describe();
        Meter { strategy, backend }
    }

    pub(crate) fn acquired(&self, waited: Duration) {
        labelled!(counter, "dlock_acquisitions_total", self).increment(1);
        labelled!(histogram, "dlock_wait_seconds", self).record(waited.as_secs_f64());
    }

    pub(crate) fn not_acquired(&self) {
        labelled!(counter, "dlock_not_acquired_total", self).increment(1);
    }

    pub(crate) fn contended(&self) {
        labelled!(counter, "dlock_contended_attempts_total", self).increment(1);
    }

    pub(crate) fn guard_created(&self) {
        labelled!(gauge, "dlock_locks_held", self).increment(1.0);
    }

    pub(crate) fn guard_ended(&self, held: Duration, failed: bool) {
        labelled!(gauge, "dlock_locks_held", self).decrement(1.0);
        labelled!(histogram, "dlock_held_seconds", self).record(held.as_secs_f64());
        if failed {
            labelled!(counter, "dlock_release_failures_total", self).increment(1);
        }
    }

    pub(crate) fn lost(&self) {
        labelled!(counter, "dlock_losses_total", self).increment(1);
    }
}

/// Describes the metrics to the recorder, once per process (the recorder must be installed
/// before the first `Locker` is built for it to see the descriptions).
#[cfg(feature = "metrics")]
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        describe_counter!("dlock_acquisitions_total", "locks taken");
        describe_counter!(
            "dlock_not_acquired_total",
            "acquisition calls that ended without the lock"
        );
        describe_counter!(
            "dlock_contended_attempts_total",
            "attempts that found the key held"
        );
        describe_histogram!(
            "dlock_wait_seconds",
            Unit::Seconds,
            "time from the acquisition call to the lock taken"
        );
        describe_histogram!(
            "dlock_held_seconds",
            Unit::Seconds,
            "time from the lock taken to its release"
        );
        describe_gauge!("dlock_locks_held", "locks held now (guards alive)");
        describe_counter!("dlock_losses_total", "locks lost while held");
        describe_counter!(
            "dlock_release_failures_total",
            "releases that failed (other than a lost lock)"
        );
    });
}

#[cfg(not(feature = "metrics"))]
#[allow(clippy::unused_self)]
impl Meter {
    pub(crate) fn new(_strategy: &'static str, _backend: &'static str) -> Self {
        Meter {}
    }
    #[inline]
    pub(crate) fn acquired(&self, _waited: Duration) {}
    #[inline]
    pub(crate) fn not_acquired(&self) {}
    #[inline]
    pub(crate) fn contended(&self) {}
    #[inline]
    pub(crate) fn guard_created(&self) {}
    #[inline]
    pub(crate) fn guard_ended(&self, _held: Duration, _failed: bool) {}
    #[inline]
    pub(crate) fn lost(&self) {}
}

/// Lease renewal statements sent by this process (batches count once): for the scale report
/// (`diesel_lock::__renewal_statements`). Always counted: one relaxed add per statement.
static RENEWAL_STATEMENTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub(crate) fn renewal_statement() {
    RENEWAL_STATEMENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// How many lease renewal statements this process has sent (a batch counts once), for
/// reports that measure the cost of holding many leases. Not a stable API.
#[doc(hidden)]
pub fn renewal_statements() -> u64 {
    RENEWAL_STATEMENTS.load(std::sync::atomic::Ordering::Relaxed)
}
