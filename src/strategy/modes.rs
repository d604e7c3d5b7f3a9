//! The kinds of lock beside a strategy's own exclusive one (`Locker::read`, `write`,
//! `permit`): which raw lock serves each mode, per strategy, built once with the `Locker`.
//! With `build`, the only `match` on the strategy outside `Strategy::name` and its
//! durations.

use super::{
    advisory, advisory_shared, for_update, for_update_shared, holders, micros, session,
    session_permits, RawLock, Setup, Strategy,
};
use crate::backend::{Backend, LockConnection, Sql};
use crate::{Error, Result};
use std::sync::Arc;

/// The kinds of lock beside the strategy's own exclusive one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// One of many readers of a reader-writer lock.
    Read,
    /// The writer of a reader-writer lock.
    Write,
    /// One of at most this many holders of a semaphore.
    Permits(u32),
}

/// A reader's raw lock and a writer's.
type ReadWrite<C> = (Arc<dyn RawLock<C>>, Arc<dyn RawLock<C>>);

/// What a `Locker` offers beyond its strategy's exclusive lock: a raw lock per [`Mode`].
pub(crate) struct Modes<C: LockConnection> {
    backend: Backend,
    strategy: &'static str,
    /// `Lease`: readers, writers and permits as shared leases.
    holders: Option<Arc<holders::HolderCore<C>>>,
    /// `Advisory` on PostgreSQL: readers (`pg_advisory_lock_shared`) and writers (the
    /// strategy's own advisory lock); `ForUpdate`: readers (`FOR SHARE`) and writers (its
    /// own `FOR UPDATE`, marking the key while waiting where needed).
    read_write: Option<ReadWrite<C>>,
    /// `ForUpdate` and `Advisory`: permits as slots held by sessions.
    slots: Option<Arc<session_permits::SlotCore>>,
}

impl<C: LockConnection> Modes<C> {
    /// The raw lock of `mode`, or `Error::Unsupported` where the strategy or backend cannot
    /// honour it.
    pub(crate) fn raw(&self, mode: Mode) -> Result<Arc<dyn RawLock<C>>> {
        let unsupported = |strategy| Error::Unsupported {
            strategy,
            backend: self.backend.name(),
        };
        if let Mode::Permits(0) = mode {
            return Err(Error::InvalidConfig(
                "a semaphore needs at least one permit".into(),
            ));
        }
        if let (Mode::Permits(n), Some(core)) = (mode, &self.slots) {
            if n > session_permits::MAX_SESSION_PERMITS {
                return Err(Error::InvalidConfig(format!(
                    "a semaphore of the {} strategy has at most {} permits",
                    self.strategy,
                    session_permits::MAX_SESSION_PERMITS
                )));
            }
            return Ok(Arc::new(session_permits::SlotLock {
                core: core.clone(),
                permits: n,
                _conn: std::marker::PhantomData,
            }));
        }
        if let Some((read, write)) = &self.read_write {
            return match mode {
                Mode::Read => Ok(read.clone()),
                Mode::Write => Ok(write.clone()),
                Mode::Permits(_) => Err(unsupported(semaphore_name(self.strategy))),
            };
        }
        if let (Mode::Read | Mode::Write, Some(_)) = (mode, &self.slots) {
            return Err(unsupported(shared_name(self.strategy)));
        }
        let Some(core) = &self.holders else {
            return Err(unsupported(match mode {
                Mode::Permits(_) => semaphore_name(self.strategy),
                Mode::Read | Mode::Write => shared_name(self.strategy),
            }));
        };
        let (mode, permits) = match mode {
            Mode::Read => (crate::backend::holders::HolderMode::Read, 0),
            Mode::Write => (crate::backend::holders::HolderMode::Write, 0),
            Mode::Permits(n) => (crate::backend::holders::HolderMode::Permit, n),
        };
        Ok(Arc::new(holders::HolderLock {
            core: core.clone(),
            mode,
            permits,
        }))
    }
}

/// The names `Error::Unsupported` gives the modes a strategy lacks.
fn shared_name(strategy: &'static str) -> &'static str {
    match strategy {
        "row" => "row (shared mode)",
        "advisory" => "advisory (shared mode)",
        "for-update" => "for-update (shared mode)",
        "advisory-xact" => "advisory-xact (shared mode)",
        _ => "shared mode",
    }
}

fn semaphore_name(strategy: &'static str) -> &'static str {
    match strategy {
        "row" => "row (semaphore)",
        "advisory" => "advisory (semaphore)",
        "for-update" => "for-update (semaphore)",
        "advisory-xact" => "advisory-xact (semaphore)",
        _ => "semaphore",
    }
}

/// The modes of `strategy` (see [`Modes`]): `Lease` keeps readers, writers and permits as
/// shared leases on every backend; `Advisory` on PostgreSQL has readers and writers
/// (`pg_advisory_lock_shared` beside `pg_advisory_lock`), `ForUpdate` on PostgreSQL and
/// MySQL too (`FOR SHARE` beside `FOR UPDATE`); the others have none yet.
pub(crate) fn build_modes<C: LockConnection>(
    strategy: Strategy,
    setup: &Setup<C>,
) -> Result<Modes<C>> {
    let mut modes = Modes {
        backend: setup.backend,
        strategy: strategy.name(),
        holders: None,
        read_write: None,
        slots: None,
    };
    match strategy {
        Strategy::Lease { ttl } => {
            modes.holders = Some(Arc::new(holders::HolderCore::new(setup, ttl)?));
        }
        Strategy::Advisory => {
            session::require_sessions(setup.backend, strategy)?;
            if setup.pool.get()?.sql().shared_sessions().is_some() {
                let write = advisory::AdvisoryLock::new(
                    Setup {
                        pool: setup.pool.clone(),
                        owner: setup.owner.clone(),
                        backend: setup.backend,
                        heartbeat: setup.heartbeat,
                        max_backoff: setup.max_backoff,
                    },
                    strategy,
                )?;
                let read = advisory_shared::AdvisorySharedLock {
                    pool: setup.pool.clone(),
                };
                modes.read_write = Some((Arc::new(read), Arc::new(write)));
            }
            modes.slots = Some(Arc::new(session_permits::SlotCore {
                kind: session_permits::SlotKind::Advisory,
                known: Default::default(),
            }));
        }
        Strategy::ForUpdate => {
            session::require_sessions(setup.backend, strategy)?;
            let flavor = session::flavor(setup.backend, &setup.pool)?;
            let marks = setup
                .pool
                .get()?
                .sql()
                .for_share()
                .is_some_and(|s| s.needs_writer_mark());
            let read = for_update_shared::ForUpdateReadLock {
                pool: setup.pool.clone(),
                flavor,
            };
            let write = for_update_shared::ForUpdateWriteLock {
                inner: for_update::ForUpdateLock {
                    pool: setup.pool.clone(),
                    flavor,
                },
                mark: marks.then(crate::random::holder_id),
                mark_us: micros(for_update_shared::MARK_FOR + setup.max_backoff)
                    .unwrap_or(i64::MAX),
            };
            modes.read_write = Some((Arc::new(read), Arc::new(write)));
            modes.slots = Some(Arc::new(session_permits::SlotCore {
                kind: session_permits::SlotKind::ForUpdate(flavor),
                known: Default::default(),
            }));
        }
        Strategy::Row { .. } | Strategy::AdvisoryXact => {}
    }
    Ok(modes)
}
