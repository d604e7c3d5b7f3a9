//! `Deadline`: when a call gives up waiting, and how long one attempt may wait on the
//! server. A leaf: the waiting code, the in-process queue and the public calls all use it.

use crate::backend::Wait;
use std::time::{Duration, Instant};

/// When to give up waiting.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Deadline {
    /// One attempt, no waiting for the lock.
    Once,
    At(Instant),
    Never,
}

impl Deadline {
    pub(crate) fn remaining(self) -> Option<Duration> {
        match self {
            Deadline::Once => Some(Duration::ZERO),
            Deadline::At(t) => Some(t.saturating_duration_since(Instant::now())),
            Deadline::Never => None,
        }
    }

    pub(crate) fn after(timeout: Duration) -> Deadline {
        Instant::now()
            .checked_add(timeout)
            .map_or(Deadline::Never, Deadline::At)
    }

    /// How long an attempt may wait on the server.
    pub(crate) fn server_wait(self) -> Wait {
        match self.remaining() {
            None => Wait::Forever,
            Some(d) if d.is_zero() => Wait::No,
            Some(d) => Wait::For(d),
        }
    }
}
