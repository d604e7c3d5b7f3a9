//! Semaphores (`Locker::permit`): never more than N holders, across threads and processes
//! (a count of holders kept in a table, checked by every holder), and the count reaches N;
//! a SIGKILLed holder's permit comes back within its ttl + 1 s; the number of permits is
//! fixed per key; strategies without semaphores are refused.

mod common;

use common::kids::{hear, say, Kid};
use common::occupancy::Occupancy;
use common::{unique_key, Harness};
use diesel_lock::{Error, Strategy};
use std::time::{Duration, Instant};

const N: u32 = 3;

fn lease(ms: u64) -> Strategy {
    Strategy::Lease {
        ttl: Duration::from_millis(ms),
    }
}

child_entry!(child_main);

/// Modes: `count:THREADS:ROUNDS` (take a permit, enter, check, leave; prints `MAX m`), and
/// `hold` (take a permit, say `HELD`, wait to be killed).
fn child_main<C: Occupancy>(h: Harness<C>, ttl: Duration, key: &str, mode: &str) {
    let locker = h.locker(Strategy::Lease { ttl });
    if mode == "hold" {
        let g = locker.permit(key, N).unwrap();
        say(&format!("HELD {}", g.token()));
        loop {
            std::thread::park();
        }
    }
    let (threads, rounds) = mode
        .strip_prefix("count:")
        .and_then(|c| c.split_once(':'))
        .map(|(t, r)| (t.parse::<usize>().unwrap(), r.parse::<usize>().unwrap()))
        .expect("mode");
    say("READY");
    assert_eq!(hear(), "GO");
    let max = count_holders(&h, &locker, key, threads, rounds);
    say(&format!("MAX {max}"));
}

/// `threads` × `rounds` permits of `key`, each holder checking the count of holders; the
/// largest count seen.
fn count_holders<C: Occupancy>(
    h: &Harness<C>,
    locker: &diesel_lock::Locker<C>,
    key: &str,
    threads: usize,
    rounds: usize,
) -> i64 {
    common::occupancy::count_permit_holders(&h.pool, locker, key, N, threads, rounds)
}

fn never_more_than_n_across_threads<C: Occupancy>(h: &Harness<C>) {
    let locker = h.locker(lease(10_000));
    let key = unique_key("sem-threads");
    h.pool.get().unwrap().occupancy_init(&key);
    let max = count_holders(h, &locker, &key, 8, 100);
    eprintln!("most holders at once: {max}");
    n_hold_together(h);
}

/// N permits are held at once and an N+1st is refused: shown directly (the stress runs
/// measure how many held at once, which depends on the scheduling, and check the bound).
fn n_hold_together<C: Occupancy>(h: &Harness<C>) {
    let (a, b) = (h.locker(lease(10_000)), h.locker(lease(10_000)));
    let key = unique_key("sem-together");
    let held: Vec<_> = (0..N)
        .map(|i| {
            let l = if i % 2 == 0 { &a } else { &b };
            l.try_permit(&key, N).unwrap().expect("a free permit")
        })
        .collect();
    assert!(
        b.try_permit(&key, N).unwrap().is_none(),
        "permit {} of {N}",
        N + 1
    );
    for g in held {
        g.release().unwrap();
    }
    assert!(
        a.try_permit(&key, N).unwrap().is_some(),
        "permits back after release"
    );
}

/// 8 processes × 200 acquisitions (2 threads × 100 each).
fn never_more_than_n_across_processes<C: Occupancy>(backend: &str, h: &Harness<C>) {
    h.locker(lease(10_000)); // migrated
    let key = unique_key("sem-procs");
    h.pool.get().unwrap().occupancy_init(&key);
    let mut kids: Vec<Kid> = (0..8)
        .map(|_| Kid::spawn(backend, &h.url, 10_000, &key, "count:2:100"))
        .collect();
    for k in &mut kids {
        k.expect("READY");
    }
    for k in &mut kids {
        k.tell("GO");
    }
    let max = kids
        .iter_mut()
        .map(|k| k.expect("MAX")[4..].parse::<i64>().unwrap())
        .max()
        .unwrap();
    eprintln!("most holders at once: {max}");
    n_hold_together(h);
}

/// A holder killed with SIGKILL: its permit is back within ttl + 1 s (and not long before
/// the ttl: the other two permits stay held by live holders meanwhile).
fn killed_holders_permit_returns<C: Occupancy>(backend: &str, h: &Harness<C>) {
    let ttl = Duration::from_millis(1500);
    let locker = h.locker(lease(1500));
    let key = unique_key("sem-kill");
    let (_a, _b) = (
        locker.permit(&key, N).unwrap(),
        locker.permit(&key, N).unwrap(),
    );
    let mut kid = Kid::spawn(backend, &h.url, 1500, &key, "hold");
    kid.expect("HELD");
    assert!(locker.try_permit(&key, N).unwrap().is_none(), "all taken");
    kid.kill9();
    let killed = Instant::now();
    let g = locker
        .try_permit_for(&key, N, ttl + Duration::from_secs(1))
        .unwrap()
        .expect("the killed holder's permit did not come back within ttl + 1 s");
    let after = killed.elapsed();
    assert!(after <= ttl + Duration::from_secs(1), "{after:?}");
    // Its row lived on for the rest of its ttl (renewed at most ttl/3 before the kill).
    assert!(after >= ttl / 2, "came back after only {after:?}");
    drop(g);
}

fn permits_are_fixed_per_key<C: Occupancy>(h: &Harness<C>) {
    let locker = h.locker(lease(10_000));
    let key = unique_key("sem-fixed");
    let g = locker.permit(&key, 2).unwrap();
    match locker.try_permit(&key, 3) {
        Err(Error::Permits { stored, asked, .. }) => assert_eq!((stored, asked), (2, 3)),
        other => panic!("{other:?}"),
    }
    // Still after every permit is released: the number is the key's.
    drop(g);
    assert!(matches!(
        locker.try_permit(&key, 5),
        Err(Error::Permits { .. })
    ));
    // A semaphore is not a reader-writer lock, nor the reverse.
    assert!(matches!(
        locker.try_read(&key),
        Err(Error::Permits {
            stored: 2,
            asked: 0,
            ..
        })
    ));
    let rw = unique_key("sem-rw");
    drop(locker.read(&rw).unwrap());
    assert!(matches!(
        locker.try_permit(&rw, 2),
        Err(Error::Permits {
            stored: 0,
            asked: 2,
            ..
        })
    ));
    assert!(matches!(
        locker.try_permit(&key, 0),
        Err(Error::InvalidConfig(_))
    ));
}

fn tokens_increase_and_release_frees<C: Occupancy>(h: &Harness<C>) {
    let locker = h.locker(lease(10_000));
    let key = unique_key("sem-tokens");
    let gs: Vec<_> = (0..N).map(|_| locker.permit(&key, N).unwrap()).collect();
    assert!(gs.windows(2).all(|w| w[1].token() > w[0].token()));
    assert!(locker.try_permit(&key, N).unwrap().is_none());
    let last = gs.last().unwrap().token();
    gs.into_iter().next().unwrap().release().unwrap();
    let g = locker.try_permit(&key, N).unwrap().expect("one came back");
    assert!(g.token() > last);
    g.check().unwrap();
}

fn unsupported_strategies<C: Occupancy>(h: &Harness<C>, strategy: Strategy) {
    let locker = h.locker(strategy);
    match locker.try_permit(&unique_key("sem-unsupported"), 2) {
        Err(Error::Unsupported { strategy, .. }) => assert!(strategy.contains("semaphore")),
        other => panic!("{other:?}"),
    }
}

macro_rules! semaphore_tests {
    ($module:ident, $backend:literal, $harness:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn across_threads() {
                if let Some(h) = $harness {
                    never_more_than_n_across_threads(&h);
                }
            }
            #[test]
            fn across_processes() {
                if let Some(h) = $harness {
                    never_more_than_n_across_processes($backend, &h);
                }
            }
            #[test]
            fn sigkill() {
                if let Some(h) = $harness {
                    killed_holders_permit_returns($backend, &h);
                }
            }
            #[test]
            fn fixed_permits() {
                if let Some(h) = $harness {
                    permits_are_fixed_per_key(&h);
                }
            }
            #[test]
            fn tokens() {
                if let Some(h) = $harness {
                    tokens_increase_and_release_frees(&h);
                }
            }
            #[test]
            fn row_refused() {
                if let Some(h) = $harness {
                    unsupported_strategies(&h, Strategy::Row { stale_after: None });
                }
            }
        }
    };
}

semaphore_tests!(sqlite, "sqlite", common::sqlite_sized(12));
#[cfg(feature = "postgres")]
semaphore_tests!(pg, "pg", common::pg_sized(12));
#[cfg(feature = "mysql")]
semaphore_tests!(mysql, "mysql", common::mysql_sized(12));

/// `Row` has no semaphores on any backend (the session strategies' are in
/// `tests/session_semaphore.rs`).
#[cfg(feature = "postgres")]
#[test]
fn row_refuses_semaphores_pg() {
    if let Some(h) = common::pg() {
        unsupported_strategies(&h, Strategy::Row { stale_after: None });
    }
}

/// `admin` on tables older than the shared leases' migration still lists the other locks
/// (and force-releases them) instead of failing.
#[test]
fn admin_without_the_shared_tables_lists_the_rest() {
    use diesel::connection::SimpleConnection;
    let Some(h) = common::sqlite() else { return };
    let locker = h.locker(Strategy::Row { stale_after: None });
    let key = unique_key("old-schema");
    let _g = locker.lock(&key).unwrap();
    let mut c = h.pool.get().unwrap();
    c.batch_execute("DROP TABLE dlock_shared_leases; DROP TABLE dlock_shared_keys")
        .unwrap();
    let held = diesel_lock::admin::held_locks(&mut *c).unwrap();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].mode, diesel_lock::LockMode::Exclusive);
    assert_eq!(
        diesel_lock::admin::force_release(&mut *c, &key)
            .unwrap()
            .len(),
        1
    );
}

/// `AdvisoryXact` has no semaphores (yet): refused, with the strategy named.
#[cfg(feature = "postgres")]
#[test]
fn advisory_xact_refuses_semaphores() {
    if let Some(h) = common::pg() {
        match h
            .locker(Strategy::AdvisoryXact)
            .try_permit("sem-xact-refused", 2)
        {
            Err(Error::Unsupported { strategy, backend }) => {
                assert_eq!(strategy, "advisory-xact (semaphore)");
                assert_eq!(backend, "postgresql");
            }
            other => panic!("{other:?}"),
        }
    }
}
