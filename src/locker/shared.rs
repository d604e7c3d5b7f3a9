//! `Shared`: the part of a `Locker` that its guards keep. Its own module, so that the guard
//! (which keeps it) and the `Locker` (which makes guards) do not import each other.

use super::queue::Queues;
use super::reentrant::Nests;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

/// The part of a `Locker` its guards keep: its owner name, and its line of waiters, which a
/// release wakes. (Not the pool, the heartbeat or the listener: a guard that outlives its
/// `Locker` keeps only what its own strategy's hold needs.)
pub(crate) struct Shared {
    pub(crate) owner: String,
    pub(crate) queues: Queues,
    /// The metrics' labels (strategy, backend); nothing without the `metrics` feature.
    pub(crate) meter: crate::instrument::Meter,
    /// `LockerBuilder::reentrant`: the keys held, by thread.
    pub(crate) nests: Option<Arc<Nests>>,
    /// How many of this `Locker`'s guards keep a pooled connection (the session
    /// strategies'), for the error of a pool they have emptied.
    pub(crate) guards_with_connections: AtomicUsize,
    /// The loss watcher of all the guards (`watcher.rs`): one thread, started with the
    /// first watch, ended with this.
    pub(crate) watcher: crate::watcher::Watcher,
}
