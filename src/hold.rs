//! What a guard keeps of its lock: the strategy's `Hold` (release it, ask whether it is still
//! held) in a `HoldCell` the guard shares with its `Locker`'s loss watcher (`watcher.rs`).
//! A leaf below the strategies and the guard: it knows `Loss`, and neither of them.

use crate::loss::Loss;
use crate::Result;
use chrono::{DateTime, Utc};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// What a guard keeps of its lock: enough to release it and to ask whether it is still held.
pub(crate) trait Hold: Send + Sync {
    /// Releases; false if the lock was no longer ours.
    fn release(self: Box<Self>, key: &str) -> Result<bool>;
    /// Asks the database whether the lock is still ours.
    fn held(&self, key: &str) -> Result<bool>;
    /// As [`held`](Self::held), but an answer from a query that began after `since` will
    /// do: locks that share a session (`Advisory`'s) answer many guards' probes with one
    /// query per session. A loss watcher that probes many guards in a round passes the
    /// round's start.
    fn probe(&self, key: &str, since: Instant) -> Result<bool> {
        let _ = since;
        self.held(key)
    }
    /// Whether this hold keeps a pooled connection of its own (counted for the error of a
    /// pool its guards have emptied): a session strategy's, unless it shares its session.
    fn keeps_connection(&self) -> bool {
        true
    }
    /// The loss status that this hold marks by itself (a lease's: the heartbeat and the
    /// local deadline), if any; the guard makes one otherwise.
    fn loss(&self) -> Option<Arc<Loss>> {
        None
    }
    /// How often the guard's loss watcher asks [`held`](Self::held), for a strategy that
    /// nothing else tells of a loss; `None` if it needs no asking.
    fn probe_every(&self) -> Option<Duration> {
        Some(PROBE_EVERY)
    }
}

/// How often a loss watcher asks the database about a lock nothing else watches (`Row`,
/// `ForUpdate`, `Advisory`): the pace [`Strategy::check_every`](crate::Strategy::check_every) gives the session
/// strategies. One query each time (on the session holding the lock for a session strategy;
/// guards sharing a session share their probes: [`Hold::probe`]).
pub(crate) const PROBE_EVERY: Duration = Duration::from_secs(1);

/// A successful acquisition.
pub(crate) struct Taken {
    pub(crate) hold: Box<dyn Hold>,
    pub(crate) token: i64,
    pub(crate) acquired_at: DateTime<Utc>,
}

/// What a guard keeps of its strategy's hold, shared with the `Locker`'s watcher: `None` once
/// released. A probe reads it; a release takes it (waiting for a probe under way).
pub(crate) type HoldCell = RwLock<Option<Box<dyn Hold>>>;
