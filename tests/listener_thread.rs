//! The listening thread of a PostgreSQL `Locker` ends with the last clone of the `Locker`,
//! even while a guard of it lives: guards keep what their own lock needs, not the `Locker`.
//! (A file of its own: it counts this process's threads, which other tests would disturb.)
#![cfg(all(feature = "postgres", target_os = "linux"))]

mod common;

use diesel_lock::Strategy;
use std::time::Duration;

/// This process's threads named like the listener.
fn listeners() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim() == "dlock-listen")
        .count()
}

#[test]
fn the_listener_thread_ends_with_the_locker() {
    let Some(h) = common::pg_listening() else {
        return;
    };
    assert_eq!(listeners(), 0);
    let locker = h.locker(Strategy::Lease {
        ttl: Duration::from_secs(10),
    });
    let key = common::unique_key("listener-thread");
    // Started by the first wait, not by `build` nor by a call that found the key free.
    assert_eq!(listeners(), 0);
    let first = locker.lock(&key).unwrap();
    assert_eq!(listeners(), 0);
    assert!(locker
        .try_lock_for(&key, Duration::from_millis(50))
        .unwrap()
        .is_none());
    // Spawned by that wait; a thread takes its name itself once it first runs, which on a
    // loaded machine can come a moment after the wait returned (seen once, load 19: 0 here).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while listeners() == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(listeners(), 1);
    drop(first);
    let clone = locker.clone();
    let guard = locker.lock(&key).unwrap();
    drop(locker);
    assert_eq!(listeners(), 1, "a clone keeps the Locker");
    drop(clone);
    // Dropping the Locker joins the listener, unless the listener is still connecting (it
    // is then left to end once its connection attempt returns, which on a loaded machine
    // can take a moment: seen once in CI).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while listeners() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        listeners(),
        0,
        "a guard does not keep its Locker's listener"
    );
    guard.check().unwrap();
    guard.release().unwrap();
    // Lockers of other strategies, or without a URL, start none.
    let _advisory = h.locker(Strategy::Advisory);
    let _plain = common::pg()
        .unwrap()
        .locker(Strategy::Row { stale_after: None });
    assert_eq!(listeners(), 0);
}
