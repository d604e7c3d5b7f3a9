//! Test hooks (feature `test-hooks`, not part of the API): let a test stop a waiting thread
//! at a chosen instant, to aim at a race rather than hope for it. Exposed as
//! `diesel_lock::__test_hooks`.

use crate::sync::Unpoison;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// What a hook runs: called on the thread that reached the instant.
pub type Hook = Arc<dyn Fn() + Send + Sync>;

/// The instants a hook can be set at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum At {
    BeforeLeave,
    InHoldersAcquire,
    InRenewBatch,
    BeforeConfirm,
    BeforeCreate,
}

fn hooks() -> &'static Mutex<HashMap<(At, String), Hook>> {
    static HOOKS: OnceLock<Mutex<HashMap<(At, String), Hook>>> = OnceLock::new();
    HOOKS.get_or_init(Default::default)
}

fn run(at: At, key: &str) {
    let hook = hooks()
        .lock()
        .unpoisoned()
        .get(&(at, key.to_owned()))
        .cloned();
    if let Some(hook) = hook {
        hook();
    }
}

/// Runs `hook` whenever a waiter for `key` is about to give up its place in the key's
/// line (its wait ended without the lock: deadline, cancel, error, panic), before the
/// removal: the instant where a release may be granting it the key.
pub fn set_before_leave(key: &str, hook: Hook) {
    hooks()
        .lock()
        .unpoisoned()
        .insert((At::BeforeLeave, key.to_owned()), hook);
}

/// Runs `hook` inside the acquiring transaction of a `Lease` reader or permit of `key`, once
/// it holds the key's lease and header rows locked, before it decides: the instant where a
/// stopped client would hold up every renewal and acquisition of the key.
pub fn set_in_holders_acquire(key: &str, hook: Hook) {
    hooks()
        .lock()
        .unpoisoned()
        .insert((At::InHoldersAcquire, key.to_owned()), hook);
}

/// Runs `hook` inside a batch renewal's transaction of exclusive leases that includes `key`
/// (MySQL/MariaDB, where the batch locks the rows by one statement and renews them by
/// another), once the rows are locked, before they are renewed: the instant where a stopped
/// heartbeat would hold up to 500 keys' rows locked.
pub fn set_in_renew_batch(key: &str, hook: Hook) {
    hooks()
        .lock()
        .unpoisoned()
        .insert((At::InRenewBatch, key.to_owned()), hook);
}

/// Runs `hook` on the heartbeat thread about to confirm a `Lease` grant of `key` (the lease
/// a release granted to a waiter's place, which the waiter took with a read), before the
/// confirming statement is sent: the instant where a stopped or starved heartbeat would
/// leave the lease to expire with the place. And on the waiting thread about to confirm a
/// `Row` grant of `key`, before each run of the confirming statement.
pub fn set_before_confirm(key: &str, hook: Hook) {
    hooks()
        .lock()
        .unpoisoned()
        .insert((At::BeforeConfirm, key.to_owned()), hook);
}

/// Runs `hook` on a `ForUpdate` acquisition of `key` that found no row for the key, before
/// it makes the row: the instant where a holder can make and lock the row first, and the
/// acquisition's insert meets the holder's open transaction.
pub fn set_before_create(key: &str, hook: Hook) {
    hooks()
        .lock()
        .unpoisoned()
        .insert((At::BeforeCreate, key.to_owned()), hook);
}

/// Removes the hooks of `key`.
pub fn clear(key: &str) {
    hooks().lock().unpoisoned().retain(|(_, k), _| k != key);
}

pub(crate) fn before_leave(key: &str) {
    run(At::BeforeLeave, key);
}

pub(crate) fn before_confirm(key: &str) {
    run(At::BeforeConfirm, key);
}

pub(crate) fn in_holders_acquire(key: &str) {
    run(At::InHoldersAcquire, key);
}

#[cfg_attr(not(feature = "mysql"), allow(dead_code))]
pub(crate) fn in_renew_batch(key: &str) {
    run(At::InRenewBatch, key);
}

pub(crate) fn before_create(key: &str) {
    run(At::BeforeCreate, key);
}
