//! The acquisition metrics (`instrument.rs`) around every acquisition call: the waiting code
//! (`wait.rs`) counts the contended attempts itself; this counts the outcome and the time
//! waited.

use super::deadline::Deadline;
use super::{Cancel, Locker};
use crate::backend::LockConnection;
use crate::strategy::RawLock;
use crate::{LockGuard, Result};
use std::time::Instant;

impl<C: LockConnection> Locker<C> {
    /// `acquire_unmetered`, measured.
    pub(super) fn acquire(
        &self,
        raw: &dyn RawLock<C>,
        key: &str,
        deadline: Deadline,
        cancel: Option<&Cancel>,
    ) -> Result<Option<LockGuard<C>>> {
        let started = Instant::now();
        let acquired = self.acquire_unmetered(raw, key, deadline, cancel);
        // A single attempt leaves nothing behind; a wait that ended without the lock may.
        if !matches!(deadline, Deadline::Once) && !matches!(acquired, Ok(Some(_))) {
            raw.gave_up(key);
        }
        let meter = &self.inner.shared.meter;
        match &acquired {
            Ok(Some(_)) => meter.acquired(started.elapsed()),
            Ok(None) => meter.not_acquired(),
            Err(_) => {}
        }
        acquired
    }
}
