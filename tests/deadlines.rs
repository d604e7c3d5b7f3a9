//! Deadlines under a stream of hand-overs: `try_lock_for` returns by its deadline (plus the
//! time of a round trip or two), whether it got the lock or not. Found by the adversary:
//! PostgreSQL `ForUpdate` could wait twice its deadline (its statement's `lock_timeout`
//! bounds each row-lock wait, and a holder changing hands made it wait again) and then
//! return the lock. (MySQL's lock waits count whole seconds: not tested here.)

mod common;

use common::{unique_key, Harness};
use diesel_lock::{LockConnection, Strategy};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Six threads, a `Locker` each, take the key in turn with `try_lock_for(deadline)` for 4 s,
/// holding it 5-20 ms; returns the longest any call took.
fn longest_call<C: LockConnection>(
    h: &Harness<C>,
    strategy: Strategy,
    deadline: Duration,
) -> Duration {
    let key = unique_key("deadline-stream");
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..6)
        .map(|i| {
            let locker = h.locker(strategy);
            let (key, stop) = (key.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut longest = Duration::ZERO;
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let start = Instant::now();
                    let got = locker.try_lock_for(&key, deadline).unwrap();
                    longest = longest.max(start.elapsed());
                    if let Some(g) = got {
                        n += 1;
                        std::thread::sleep(Duration::from_millis(5 + (n * 7 + i) % 16));
                        g.release().unwrap();
                    }
                }
                longest
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(4));
    stop.store(true, Ordering::Relaxed);
    threads
        .into_iter()
        .map(|t| t.join().unwrap())
        .max()
        .unwrap()
}

fn within_deadline<C: LockConnection>(h: Option<Harness<C>>, strategy: Strategy) {
    let Some(h) = h else { return };
    let deadline = Duration::from_millis(400);
    let longest = longest_call(&h, strategy, deadline);
    eprintln!("{strategy:?}: longest try_lock_for({deadline:?}) took {longest:?}");
    // Twice the deadline is what the bug took; half of it is room for round trips on a
    // loaded machine.
    assert!(longest < deadline * 3 / 2, "{longest:?}");
}

#[cfg(feature = "postgres")]
#[test]
fn pg_for_update() {
    within_deadline(common::pg_sized(14), Strategy::ForUpdate);
}

#[cfg(feature = "postgres")]
#[test]
fn pgbouncer_for_update() {
    within_deadline(common::pgbouncer_sized(14), Strategy::ForUpdate);
}
