//! `ForUpdate` makes a missing key row with an insert of its own, apart from the statement
//! that locks the row. That insert's duplicate check waits for a transaction holding the
//! row it would make: a holder that made and locked the row after the acquisition's lock
//! statement found none (a new key, or a row a purge had just deleted). Unbounded, that wait
//! lasted as long as the holder held, beyond `try_lock`'s "no wait", a deadline, or a
//! cancellation (the session is ended only while the lock statement runs). Found in CI:
//! `api_forms pg_for_update::lock_all_is_cancellable` hung for 180 s, its probing
//! `try_lock` of key a stuck in that insert behind the waiter's hold of a, while the waiter
//! waited for b, beside another test's purges of the same database; 15 hangs in 150 runs
//! of that test beside purges (the investigation), 0 in 660 with the insert's wait bounded.
//!
//! Each test stops the acquisition at that instant (`__test_hooks::set_before_create`),
//! lets a holder make and lock the row, then lets the acquisition go on, and asks for its
//! answer within 5 s while the holder keeps the key.

mod common;

use common::{unique_key, Harness};
use diesel_lock::__test_hooks as hooks;
use diesel_lock::{Cancel, LockConnection, Strategy};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How the acquisition under test asks for the key.
#[derive(Clone, Copy, Debug)]
enum Ask {
    Try,
    For,
    Cancelled,
}

/// Runs `ask` for a fresh key, stopped before it makes the key's row while `holder` makes
/// and locks it: once let go, the acquisition answers within 5 s, without the key.
fn aimed<C: LockConnection>(h: &Harness<C>, ask: Ask) {
    let (locker, holder) = (h.locker(Strategy::ForUpdate), h.locker(Strategy::ForUpdate));
    let key = unique_key("for-update-create");
    // The first thread to reach the instant (the acquisition under test) stops there until
    // the holder holds; the holder's own pass finds the hook spent.
    let armed = Arc::new(AtomicBool::new(true));
    let (at_tx, at_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (at_tx, go_rx) = (Mutex::new(at_tx), Mutex::new(go_rx));
    hooks::set_before_create(
        &key,
        Arc::new(move || {
            if armed.swap(false, Ordering::SeqCst) {
                at_tx.lock().unwrap().send(()).unwrap();
                go_rx.lock().unwrap().recv().unwrap();
            }
        }),
    );
    let cancel = Cancel::new();
    let (done_tx, done_rx) = mpsc::channel();
    let asker = {
        let (locker, key, cancel) = (locker.clone(), key.clone(), cancel.clone());
        std::thread::spawn(move || {
            let got = match ask {
                Ask::Try => locker.try_lock(&key),
                Ask::For => locker.try_lock_for(&key, Duration::from_millis(300)),
                Ask::Cancelled => locker.try_lock_cancellable(&key, None, &cancel),
            };
            let _ = done_tx.send((Instant::now(), got.map(|g| g.is_some())));
        })
    };
    at_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the acquisition never reached the row's insert");
    let held = holder.lock(&key).unwrap();
    go_tx.send(()).unwrap();
    let let_go = Instant::now();
    if matches!(ask, Ask::Cancelled) {
        cancel.cancel();
    }
    let answer = done_rx.recv_timeout(Duration::from_secs(5));
    hooks::clear(&key);
    // Kept until here, so that an acquisition waiting for the holder fails the check below
    // rather than returning once the key is released.
    drop(held);
    asker.join().unwrap();
    let (at, got) = answer.unwrap_or_else(|_| {
        panic!("{ask:?}: no answer within 5 s of the holder making and locking the row")
    });
    assert!(!got.unwrap(), "{ask:?}: got the key while it was held");
    eprintln!("{ask:?}: answered {:?} after it was let go", at - let_go);
}

fn all<C: LockConnection>(h: &Harness<C>) {
    for ask in [Ask::Try, Ask::For, Ask::Cancelled] {
        aimed(h, ask);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pg() {
    if let Some(h) = common::pg() {
        all(&h);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pgbouncer() {
    if let Some(h) = common::pgbouncer() {
        all(&h);
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql() {
    if let Some(h) = common::mysql() {
        all(&h);
    }
}
