//! PostgreSQL lockers that LISTEN for releases (`LockerBuilder::listen_url`): the whole
//! conformance suite again, and that a waiter in another `Locker` is woken by the release
//! rather than by its next poll.
#![cfg(feature = "postgres")]

mod common;

use common::unique_key;
use diesel_lock::Strategy;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const ROW: Strategy = Strategy::Row { stale_after: None };
const ROW_STALE: Strategy = Strategy::Row {
    stale_after: Some(Duration::from_secs(60)),
};
const LEASE: Strategy = Strategy::Lease {
    ttl: Duration::from_secs(10),
};

conformance_suite!(pg_row_listening, common::pg_listening(), ROW);
conformance_suite!(pg_row_stale_listening, common::pg_listening(), ROW_STALE);
conformance_suite!(pg_lease_listening, common::pg_listening(), LEASE);

/// How long a waiter in another `Locker`, listening, takes to hold the lock after it is
/// released.
fn handoff(strategy: Strategy) -> Option<Duration> {
    let h = common::pg()?;
    let holder = h.locker(strategy);
    let waiter = h
        .builder(strategy)
        .max_backoff(Duration::from_secs(5))
        .listen_url(h.url.clone())
        .build()
        .unwrap();
    let key = unique_key("wake");
    let g = holder.lock(&key).unwrap();
    let (tx, rx) = mpsc::channel();
    let k = key.clone();
    let t = std::thread::spawn(move || {
        let g = waiter.try_lock_for(&k, Duration::from_secs(30)).unwrap();
        tx.send(Instant::now()).unwrap();
        g.expect("the lock within 30 s").release().unwrap();
    });
    // The hold itself: by its end the waiter's first attempt has failed and its pause has
    // begun (were it slower, it would find the key free and the figure below only smaller).
    std::thread::sleep(Duration::from_millis(300));
    let released = Instant::now();
    g.release().unwrap();
    let taken = rx.recv().unwrap();
    t.join().unwrap();
    Some(taken - released)
}

#[test]
fn a_waiter_in_another_locker_is_woken_by_the_release() {
    for s in [ROW, LEASE] {
        let Some(d) = handoff(s) else { return };
        // A listening waiter's poll is its fallback, 2.5 to 5 s after its failed attempt:
        // only the notification can have woken it this soon.
        assert!(d < Duration::from_millis(500), "{}: {d:?}", s.name());
    }
}
