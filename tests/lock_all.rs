//! `Locker::lock_all`: several keys, all or nothing, from 4 threads naming the same keys in
//! shuffled orders: no deadlock, and no key ever held twice (a count per key checked by each
//! holder); `try_lock_all` gives back what it took when one key is busy.

mod common;

use common::occupancy::Occupancy;
use common::{unique_key, Harness};
use diesel_lock::{Locker, Strategy};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// A small xorshift, so each thread shuffles its keys differently, with no dependency.
fn shuffle(keys: &mut [String], seed: &mut u64) {
    for i in (1..keys.len()).rev() {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        keys.swap(i, (*seed % (i as u64 + 1)) as usize);
    }
}

/// 4 threads × `rounds`, each round `lock_all` of 3 of 4 shared keys in a shuffled order;
/// the holder checks it is alone on each of them. Ends (no deadlock) within a minute.
fn no_deadlock_in_shuffled_orders<C: Occupancy>(h: &Harness<C>, strategy: Strategy, rounds: usize) {
    let locker = h.locker(strategy);
    let keys: Vec<String> = (0..4).map(|i| unique_key(&format!("all-{i}"))).collect();
    for k in &keys {
        h.pool.get().unwrap().occupancy_init(k);
    }
    let start = Arc::new(Barrier::new(4));
    let began = Instant::now();
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let (locker, pool, keys, start) =
                (locker.clone(), h.pool.clone(), keys.clone(), start.clone());
            std::thread::spawn(move || {
                let mut seed = 0x9e37_79b9_7f4a_7c15 ^ (t + 1);
                let mut keys = keys;
                start.wait();
                for round in 0..rounds {
                    shuffle(&mut keys, &mut seed);
                    let chosen: Vec<&str> = keys[..3].iter().map(String::as_str).collect();
                    let all = locker.lock_all(&chosen).unwrap();
                    assert_eq!(all.guards().len(), 3);
                    // Every tenth round, check exclusion through the table (the rest only
                    // exercise the ordering, cheaply).
                    if round % 10 == 0 {
                        let mut c = pool.get().unwrap();
                        for k in &chosen {
                            assert_eq!(c.enter(k, true).holders, 1, "{k} held twice");
                        }
                        for k in &chosen {
                            c.leave(k, true);
                        }
                    }
                    all.release().unwrap();
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
    println!(
        "{} rounds of lock_all by 4 threads in {:?}",
        4 * rounds,
        began.elapsed()
    );
}

fn try_lock_all_gives_back<C: Occupancy>(h: &Harness<C>, strategy: Strategy) {
    let locker = h.locker(strategy);
    let other = h.locker(strategy);
    let (a, b, c) = (unique_key("a"), unique_key("b"), unique_key("c"));
    let held = other.lock(&c).unwrap();
    assert!(locker.try_lock_all(&[&c, &a, &b]).unwrap().is_none());
    // a and b were taken and given back.
    assert!(other.try_lock(&a).unwrap().is_some());
    assert!(other.try_lock(&b).unwrap().is_some());
    let t0 = Instant::now();
    assert!(locker
        .try_lock_all_for(&[&a, &c], Duration::from_millis(100))
        .unwrap()
        .is_none());
    assert!(t0.elapsed() >= Duration::from_millis(100));
    assert!(other.try_lock(&a).unwrap().is_some());
    drop(held);
    let all = locker
        .try_lock_all(&[&c, &a, &b, &a])
        .unwrap()
        .expect("free");
    assert_eq!(all.keys().count(), 3);
    assert!(other.try_lock(&b).unwrap().is_none());
    drop(all);
    assert!(other.try_lock(&b).unwrap().is_some());
}

fn lease() -> Strategy {
    Strategy::Lease {
        ttl: Duration::from_secs(10),
    }
}

macro_rules! lock_all_tests {
    ($module:ident, $harness:expr, $strategy:expr, $rounds:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn shuffled_orders() {
                if let Some(h) = $harness {
                    no_deadlock_in_shuffled_orders(&h, $strategy, $rounds);
                }
            }
            #[test]
            fn all_or_nothing() {
                if let Some(h) = $harness {
                    try_lock_all_gives_back(&h, $strategy);
                }
            }
        }
    };
}

// 10⁴ rounds in all on SQLite (4 threads × 2,500), fewer on the servers (the same code
// path, at a server's cost per round).
lock_all_tests!(sqlite_lease, common::sqlite_sized(12), lease(), 2500);
lock_all_tests!(
    sqlite_row,
    common::sqlite_sized(12),
    Strategy::Row { stale_after: None },
    500
);
#[cfg(feature = "postgres")]
lock_all_tests!(pg_lease, common::pg_sized(12), lease(), 250);
#[cfg(feature = "postgres")]
lock_all_tests!(
    pg_row,
    common::pg_sized(12),
    Strategy::Row { stale_after: None },
    250
);
#[cfg(feature = "postgres")]
lock_all_tests!(pg_advisory, common::pg_sized(16), Strategy::Advisory, 250);
#[cfg(feature = "postgres")]
lock_all_tests!(
    pg_for_update,
    common::pg_sized(16),
    Strategy::ForUpdate,
    250
);
#[cfg(feature = "mysql")]
lock_all_tests!(mysql_lease, common::mysql_sized(12), lease(), 250);
#[cfg(feature = "mysql")]
lock_all_tests!(
    mysql_row,
    common::mysql_sized(12),
    Strategy::Row { stale_after: None },
    250
);
#[cfg(feature = "mysql")]
lock_all_tests!(
    mysql_advisory,
    common::mysql_sized(16),
    Strategy::Advisory,
    250
);
#[cfg(feature = "mysql")]
lock_all_tests!(
    mysql_for_update,
    common::mysql_sized(16),
    Strategy::ForUpdate,
    250
);

/// Locker is Send + Sync and MultiGuard is Send: a transfer may be released elsewhere.
#[test]
fn multi_guard_is_send() {
    fn send<T: Send>() {}
    send::<diesel_lock::MultiGuard<diesel::SqliteConnection>>();
    send::<Locker<diesel::SqliteConnection>>();
}
