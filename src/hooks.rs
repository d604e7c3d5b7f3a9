//! Test hooks (feature `test-hooks`, not part of the API): let a test stop a waiting thread
//! at a chosen instant, to aim at a race rather than hope for it. Exposed as
//! `diesel_lock::__test_hooks`.

use crate::sync::Unpoison;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// What a hook runs: called on the thread that reached the instant.
pub type Hook = Arc<dyn Fn() + Send + Sync>;

fn hooks() -> &'static Mutex<HashMap<String, Hook>> {
    static HOOKS: OnceLock<Mutex<HashMap<String, Hook>>> = OnceLock::new();
    HOOKS.get_or_init(Default::default)
}

/// Runs `hook` whenever a waiter for `key` is about to give up its place in the key's
/// line (its wait ended without the lock: deadline, cancel, error, panic), before the
/// removal: the instant where a release may be granting it the key.
pub fn set_before_leave(key: &str, hook: Hook) {
    hooks().lock().unpoisoned().insert(key.to_owned(), hook);
}

/// Removes the hook of `key`.
pub fn clear(key: &str) {
    hooks().lock().unpoisoned().remove(key);
}

pub(crate) fn before_leave(key: &str) {
    let hook = hooks().lock().unpoisoned().get(key).cloned();
    if let Some(hook) = hook {
        hook();
    }
}
