//! Semaphores of the session strategies (`Locker::permit` with `ForUpdate` and `Advisory`):
//! never more than N holders across threads and processes (a count of holders kept in a
//! table, checked by every holder), and the count reaches N; a SIGKILLed holder's permit
//! returns as soon as the server sees its session end; the number of permits is fixed per
//! key; tokens increase.

mod common;

use common::kids::{hear, say, Kid};
use common::occupancy::Occupancy;
use common::{unique_key, Harness};
use diesel_lock::{Error, Strategy};
use std::time::{Duration, Instant};

const N: u32 = 3;

fn strategy(name: &str) -> Strategy {
    match name {
        "for-update" => Strategy::ForUpdate,
        "advisory" => Strategy::Advisory,
        other => panic!("no session strategy {other}"),
    }
}

child_entry!(child_main);

/// Modes: `count:THREADS:ROUNDS:STRATEGY` (take a permit, enter, check, leave; prints
/// `MAX m`), and `hold:STRATEGY` (take a permit, say `HELD`, wait to be killed).
fn child_main<C: Occupancy>(h: Harness<C>, _ttl: Duration, key: &str, mode: &str) {
    let p: Vec<&str> = mode.split(':').collect();
    if p[0] == "hold" {
        let locker = h.locker(strategy(p[1]));
        let g = locker.permit(key, N).unwrap();
        say(&format!("HELD {}", g.token()));
        loop {
            std::thread::park();
        }
    }
    assert_eq!(p[0], "count");
    let (threads, rounds) = (p[1].parse().unwrap(), p[2].parse().unwrap());
    let locker = h.locker(strategy(p[3]));
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

/// N permits held at once and an N+1st refused, shown directly; every one back after
/// release.
fn n_hold_together<C: Occupancy>(h: &Harness<C>, s: Strategy) {
    let (a, b) = (h.locker(s), h.locker(s));
    let key = unique_key("ssem-together");
    let held: Vec<_> = (0..N)
        .map(|i| {
            let l = if i % 2 == 0 { &a } else { &b };
            l.try_permit(&key, N).unwrap().expect("a free permit")
        })
        .collect();
    assert!(held.windows(2).all(|w| w[1].token() > w[0].token()));
    assert!(b.try_permit(&key, N).unwrap().is_none(), "permit {}", N + 1);
    let started = Instant::now();
    assert!(b
        .try_permit_for(&key, N, Duration::from_millis(300))
        .unwrap()
        .is_none());
    assert!(started.elapsed() >= Duration::from_millis(300));
    for g in &held {
        g.check().unwrap();
    }
    let last = held.last().unwrap().token();
    drop(held);
    let again: Vec<_> = (0..N)
        .map(|_| a.try_permit(&key, N).unwrap().expect("permits back"))
        .collect();
    assert!(again.iter().all(|g| g.token() > last));
}

fn threads<C: Occupancy>(h: &Harness<C>, s: Strategy) {
    let locker = h.locker(s);
    let key = unique_key("ssem-threads");
    h.pool.get().unwrap().occupancy_init(&key);
    let max = count_holders(h, &locker, &key, 8, 100);
    eprintln!("most holders at once: {max}");
    assert_eq!(max, i64::from(N), "the count never reached {N}");
    n_hold_together(h, s);
}

/// 8 processes × 200 acquisitions (2 threads × 100 each).
fn processes<C: Occupancy>(backend: &str, h: &Harness<C>, s: Strategy) {
    h.locker(s); // migrated
    let key = unique_key("ssem-procs");
    h.pool.get().unwrap().occupancy_init(&key);
    let mode = format!("count:2:100:{}", s.name());
    let mut kids: Vec<Kid> = (0..8)
        .map(|_| Kid::spawn(backend, &h.url, 10_000, &key, &mode))
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
    // Never more than N (each child also checks the count at every acquisition), and N
    // together: as many waiters as permits are free go in at once.
    assert_eq!(max, i64::from(N), "{max} holders at once");
}

/// A holder killed with SIGKILL: the server ends its session, and its permit is free again
/// at once (bound: 1 s, for a loaded machine).
fn killed_holders_permit_returns<C: Occupancy>(backend: &str, h: &Harness<C>, s: Strategy) {
    let locker = h.locker(s);
    let key = unique_key("ssem-kill");
    let (_a, _b) = (
        locker.permit(&key, N).unwrap(),
        locker.permit(&key, N).unwrap(),
    );
    let mut kid = Kid::spawn(backend, &h.url, 10_000, &key, &format!("hold:{}", s.name()));
    let held: i64 = kid.expect("HELD")[5..].parse().unwrap();
    assert!(locker.try_permit(&key, N).unwrap().is_none(), "all taken");
    kid.kill9();
    let killed = Instant::now();
    let g = locker
        .try_permit_for(&key, N, Duration::from_secs(5))
        .unwrap()
        .expect("the killed holder's permit did not come back");
    let after = killed.elapsed();
    eprintln!("permit back {after:?} after the SIGKILL");
    assert!(after <= Duration::from_secs(1), "{after:?}");
    assert!(g.token() > held);
}

fn fixed_permits<C: Occupancy>(h: &Harness<C>, s: Strategy) {
    let locker = h.locker(s);
    let key = unique_key("ssem-fixed");
    let g = locker.permit(&key, 2).unwrap();
    match locker.try_permit(&key, 3) {
        Err(Error::Permits { stored, asked, .. }) => assert_eq!((stored, asked), (2, 3)),
        other => panic!("{other:?}"),
    }
    drop(g);
    // Another `Locker` (which has not seen the key) learns it from the database.
    assert!(matches!(
        h.locker(s).try_permit(&key, 5),
        Err(Error::Permits { stored: 2, .. })
    ));
    assert!(matches!(
        locker.try_permit(&key, 1001),
        Err(Error::InvalidConfig(_))
    ));
    assert!(matches!(
        locker.try_permit(&key, 0),
        Err(Error::InvalidConfig(_))
    ));
}

macro_rules! session_semaphore_tests {
    ($module:ident, $backend:literal, $harness:expr, $strategy:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn across_threads() {
                if let Some(h) = $harness {
                    threads(&h, $strategy);
                }
            }
            #[test]
            fn across_processes() {
                if let Some(h) = $harness {
                    processes($backend, &h, $strategy);
                }
            }
            #[test]
            fn sigkill() {
                if let Some(h) = $harness {
                    killed_holders_permit_returns($backend, &h, $strategy);
                }
            }
            #[test]
            fn fixed() {
                if let Some(h) = $harness {
                    fixed_permits(&h, $strategy);
                }
            }
        }
    };
}

#[cfg(feature = "postgres")]
session_semaphore_tests!(
    pg_for_update,
    "pg",
    common::pg_sized(16),
    Strategy::ForUpdate
);
#[cfg(feature = "postgres")]
session_semaphore_tests!(pg_advisory, "pg", common::pg_sized(16), Strategy::Advisory);
#[cfg(feature = "postgres")]
session_semaphore_tests!(
    pgbouncer_for_update,
    "pgbouncer",
    common::pgbouncer_sized(16),
    Strategy::ForUpdate
);
#[cfg(feature = "mysql")]
session_semaphore_tests!(
    mysql_for_update,
    "mysql",
    common::mysql_sized(16),
    Strategy::ForUpdate
);

/// MySQL's `GET_LOCK` has no shared mode, so an `Advisory` permit could not keep the key's
/// exclusive lock out: it is refused, naming the key and what to use instead, and nothing is
/// left held (the key's exclusive lock is free at once).
#[cfg(feature = "mysql")]
#[test]
fn mysql_advisory_refuses_semaphores() {
    let Some(h) = common::mysql() else { return };
    let locker = h.locker(Strategy::Advisory);
    let key = unique_key("ssem-mysql-advisory");
    for attempt in [
        locker.try_permit(&key, 3).map(|g| g.is_some()),
        locker.permit(&key, 3).map(|_| true),
    ] {
        match attempt {
            Err(e @ Error::Incompatible { .. }) => {
                let m = e.to_string();
                assert!(
                    m.contains(&key) && m.contains("semaphore") && m.contains("for-update"),
                    "{m}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(locker.try_lock(&key).unwrap().is_some());
}
