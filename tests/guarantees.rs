//! Regression tests for guarantee breaks an outside review found (issue 8): `purge` running
//! beside live locks must never break mutual exclusion or make a token go backwards.
//!
//! Every test uses its own keys on a database of its own (SQLite: a temp file): `purge` is
//! table-wide, and beside other tests it would delete rows they count on, as theirs would
//! delete its. The other Lockers and live locks a purge must spare are the test's own, all on
//! that one database (one harness, one pool).

mod common;

use common::{unique_key, Harness};
use diesel_lock::{Error, LockConnection, Strategy};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

/// Finding 1: a Locker whose `Row` has a short `stale_after` purged (and took over) rows of
/// other Lockers configured without one. A row is stale only past its *own* limit.
fn purge_spares_rows_of_other_configs<C: LockConnection>(h: &Harness<C>) {
    let maintenance = h.locker(Strategy::Row { stale_after: None });
    let short = h.locker(Strategy::Row {
        stale_after: Some(Duration::from_millis(1)),
    });
    let long = h.locker(Strategy::Row {
        stale_after: Some(Duration::from_secs(3600)),
    });
    let forever = unique_key("guarantee-row-forever");
    let hour = unique_key("guarantee-row-hour");
    let g_forever = maintenance.lock(&forever).unwrap();
    let g_hour = long.lock(&hour).unwrap();
    // Both rows are now older than `short`'s stale_after.
    std::thread::sleep(Duration::from_millis(20));
    for purger in [&short, &maintenance, &long] {
        purger.purge(Duration::ZERO).unwrap();
    }
    g_forever
        .check()
        .expect("a row without stale_after was purged by another Locker");
    g_hour
        .check()
        .expect("a row with stale_after 1 h was purged after 20 ms");
    // Nor may a waiter with a short stale_after take them over.
    assert!(short.try_lock(&forever).unwrap().is_none());
    assert!(short.try_lock(&hour).unwrap().is_none());
    g_forever.check().unwrap();
    g_hour.check().unwrap();

    // A row inserted with a short limit is stale past it, for every Locker.
    let brief = unique_key("guarantee-row-brief");
    let g_brief = short.lock(&brief).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let taken = maintenance
        .try_lock(&brief)
        .unwrap()
        .expect("a row past its own stale_after is taken over");
    assert!(taken.token() > g_brief.token());
    assert!(matches!(g_brief.check(), Err(Error::LockLost { .. })));
    drop(taken);
    let purged = short.lock(&brief).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(maintenance.purge(Duration::ZERO).unwrap() >= 1);
    assert!(matches!(purged.check(), Err(Error::LockLost { .. })));
}

/// Finding 2: lease tokens went backwards (and one was issued twice) on PostgreSQL when
/// `purge` ran beside acquisitions. 8 threads acquire and release on 6 keys while a ninth
/// purges idle leases in a loop; each key's tokens, in the order the key was held, must
/// strictly increase. The order of holding is the order of the (key, token) records made
/// under a per-key mutex taken after acquiring and released before releasing.
fn purge_beside_lease_acquisitions<C: LockConnection>(h: &Harness<C>, run_for: Duration) {
    let locker = h.locker(Strategy::Lease {
        ttl: Duration::from_secs(30),
    });
    let keys: Vec<String> = (0..6)
        .map(|i| unique_key(&format!("guarantee-lease-purge-{i}")))
        .collect();
    let seen: Arc<Mutex<HashMap<String, Vec<i64>>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(10));
    let mut threads = Vec::new();
    for t in 0..8 {
        let (locker, keys, seen, stop, start) = (
            locker.clone(),
            keys.clone(),
            seen.clone(),
            stop.clone(),
            start.clone(),
        );
        threads.push(std::thread::spawn(move || {
            start.wait();
            let mut i = t;
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = &keys[i % keys.len()];
                i += 1;
                if let Some(g) = locker
                    .try_lock_for(key, Duration::from_millis(200))
                    .unwrap()
                {
                    seen.lock()
                        .unwrap()
                        .entry(key.clone())
                        .or_default()
                        .push(g.token());
                    n += 1;
                    // A lost lease (purged while held would be a bug too) fails here.
                    g.release().unwrap();
                }
            }
            n
        }));
    }
    let purger = {
        let (locker, stop, start) = (locker.clone(), stop.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            let mut purged = 0u64;
            while !stop.load(Ordering::Relaxed) {
                purged += locker.purge(Duration::ZERO).unwrap();
            }
            purged
        })
    };
    start.wait();
    let began = Instant::now();
    while began.elapsed() < run_for {
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    let acquired: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let purged = purger.join().unwrap();
    let seen = seen.lock().unwrap();
    let mut bad = Vec::new();
    for (key, tokens) in seen.iter() {
        for w in tokens.windows(2) {
            if w[1] <= w[0] {
                bad.push(format!("{key}: {} -> {}", w[0], w[1]));
            }
        }
    }
    println!(
        "{acquired} acquisitions, {purged} rows purged, {} non-increasing tokens",
        bad.len()
    );
    assert!(acquired > 100, "too few acquisitions to mean anything");
    assert!(purged > 10, "the purge must have raced the acquisitions");
    assert!(
        bad.is_empty(),
        "tokens went backwards: {:?}",
        &bad[..bad.len().min(10)]
    );
}

/// Finding 9: `purge(Duration::MAX)` was an error (`interval out of range`) instead of
/// deleting nothing.
fn purge_with_huge_idle_deletes_nothing<C: LockConnection>(h: &Harness<C>) {
    for strategy in [
        Strategy::Lease {
            ttl: Duration::from_secs(30),
        },
        Strategy::Row {
            stale_after: Some(Duration::from_secs(3600)),
        },
    ] {
        let locker = h.locker(strategy);
        let key = unique_key("guarantee-purge-max");
        locker.lock(&key).unwrap().release().unwrap();
        let g = locker.lock(&key).unwrap();
        locker.purge(Duration::MAX).unwrap();
        g.check().unwrap();
    }
}

macro_rules! backend_tests {
    ($module:ident, $harness:expr, $run_for:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn purge_spares_rows_of_other_configs() {
                let Some(h) = $harness else { return };
                super::purge_spares_rows_of_other_configs(&h);
            }

            #[test]
            fn purge_beside_lease_acquisitions_keeps_tokens_increasing() {
                let Some(h) = $harness else { return };
                super::purge_beside_lease_acquisitions(&h, $run_for);
            }

            #[test]
            fn purge_with_huge_idle_deletes_nothing() {
                let Some(h) = $harness else { return };
                super::purge_with_huge_idle_deletes_nothing(&h);
            }
        }
    };
}

backend_tests!(sqlite, common::sqlite_sized(12), Duration::from_secs(5));
#[cfg(feature = "postgres")]
backend_tests!(pg, common::pg_own_db_sized(12), Duration::from_secs(15));
#[cfg(feature = "mysql")]
backend_tests!(
    mysql,
    common::mysql_own_db_sized(12),
    Duration::from_secs(10)
);
