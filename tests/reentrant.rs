//! `LockerBuilder::reentrant`: a thread that holds a key and locks it again through the same
//! `Locker` gets a nested guard with no database round trip (it works with every pooled
//! connection taken); the key is released when the outermost guard goes; another thread
//! and another process wait until then. Off by default.

mod common;

use common::kids::{say, Kid};
use common::occupancy::Occupancy;
use common::{unique_key, Harness};
use diesel_lock::{Locker, Strategy};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

child_entry!(child_main);

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// Mode: the strategy's name. Says `WAITING`, locks the key (waiting up to 30 s), says
/// `GOT <ms>`.
fn child_main<C: Occupancy>(h: Harness<C>, _ttl: Duration, key: &str, mode: &str) {
    let locker = h.locker(strategy_named(mode));
    say("WAITING");
    let g = locker
        .try_lock_for(key, Duration::from_secs(30))
        .unwrap()
        .expect("the parent never released");
    say(&format!("GOT {}", now_ms()));
    drop(g);
}

fn strategy_named(name: &str) -> Strategy {
    match name {
        "lease" => Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        "row" => Strategy::Row { stale_after: None },
        "advisory" => Strategy::Advisory,
        "for-update" => Strategy::ForUpdate,
        other => panic!("{other}"),
    }
}

fn nested<C: Occupancy>(backend: &str, h: &Harness<C>, strategy: &str) {
    let strategy = strategy_named(strategy);
    let locker: Locker<C> = h.builder(strategy).reentrant(true).build().unwrap();
    locker.migrate().unwrap();
    let key = unique_key("reentrant");
    let outer = locker.lock(&key).unwrap();
    {
        // Every pooled connection taken: a nested lock needs none.
        let size = h.pool.max_size() as usize;
        let taken: Vec<_> = (0..size
            - usize::from(strategy == Strategy::Advisory || strategy == Strategy::ForUpdate))
            .map(|_| h.pool.get().unwrap())
            .collect();
        let inner = locker.try_lock(&key).unwrap().expect("nested");
        let innermost = locker.lock(&key).unwrap();
        assert_eq!(inner.token(), outer.token());
        assert_eq!(innermost.token(), outer.token());
        drop(taken);
        innermost.release().unwrap();
        inner.check().unwrap();
        drop(inner);
    }
    outer.check().unwrap();
    // Another thread of the same Locker does not nest.
    let (l, k) = (locker.clone(), key.clone());
    assert!(
        std::thread::spawn(move || l.try_lock(&k).unwrap().is_none())
            .join()
            .unwrap()
    );
    // Another process waits until the outermost guard goes.
    let mut kid = Kid::spawn(backend, &h.url, 10_000, &key, strategy.name());
    kid.expect("WAITING");
    std::thread::sleep(Duration::from_millis(300));
    let inner = locker.lock(&key).unwrap();
    drop(inner); // a nested guard's release frees nothing
    std::thread::sleep(Duration::from_millis(300));
    let released = now_ms();
    outer.release().unwrap();
    let got: u128 = kid.expect("GOT")[4..].parse().unwrap();
    assert!(
        got >= released,
        "the child got the key {} ms before the outer release",
        released - got
    );
    // Not reentrant by default.
    let plain = h.locker(strategy);
    let key = unique_key("plain");
    let _g = plain.lock(&key).unwrap();
    assert!(plain.try_lock(&key).unwrap().is_none());
}

macro_rules! reentrant_tests {
    ($module:ident, $backend:literal, $harness:expr, [$($strategy:literal),*]) => {
        #[test]
        fn $module() {
            $(
                if let Some(h) = $harness {
                    nested($backend, &h, $strategy);
                }
            )*
        }
    };
}

reentrant_tests!(sqlite, "sqlite", common::sqlite_sized(4), ["lease", "row"]);
#[cfg(feature = "postgres")]
reentrant_tests!(
    pg,
    "pg",
    common::pg_sized(4),
    ["lease", "row", "advisory", "for-update"]
);
#[cfg(feature = "mysql")]
reentrant_tests!(
    mysql,
    "mysql",
    common::mysql_sized(4),
    ["lease", "row", "advisory", "for-update"]
);
