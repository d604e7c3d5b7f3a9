//! One lock per key, whatever the mode: on every strategy that has readers or semaphores, a
//! key's exclusive lock (`lock`, and `write`, which is the same lock) excludes the key's
//! readers and permit holders and they exclude it, both ways, across threads and processes;
//! a waiting exclusive lock gets the key once the readers are gone; mixing a semaphore and a
//! reader-writer use of one key is an error that says so; and many threads and processes
//! mixing every kind on two keys never see an exclusive holder beside anyone (a count of
//! holders kept in a table, checked by every holder) while tokens keep increasing.

mod common;

use common::kids::{hear, say, Kid};
use common::occupancy::Occupancy;
use common::{unique_key, Harness};
use diesel_lock::{Error, Locker, Strategy};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

const PERMITS: u32 = 2;

fn lease() -> Strategy {
    Strategy::Lease {
        ttl: Duration::from_secs(10),
    }
}

fn strategy(name: &str) -> Strategy {
    match name {
        "for-update" => Strategy::ForUpdate,
        "advisory" => Strategy::Advisory,
        _ => lease(),
    }
}

child_entry!(child_main);

/// Modes: `hold:KIND:STRATEGY` takes `KIND` (`read`, `permit`, `lock`) of the key, says
/// `HELD token`, waits for `GO`, releases and says `DONE`; `mix:THREADS:ROUNDS:STRATEGY`
/// runs `mix` on the key and says `DONE`.
fn child_main<C: Occupancy>(h: Harness<C>, _ttl: Duration, key: &str, mode: &str) {
    let p: Vec<&str> = mode.split(':').collect();
    match p[0] {
        "hold" => {
            let locker = h.locker(strategy(p[2]));
            let g = match p[1] {
                "read" => locker.read(key),
                "permit" => locker.permit(key, PERMITS),
                _ => locker.lock(key),
            }
            .unwrap();
            say(&format!("HELD {}", g.token()));
            assert_eq!(hear(), "GO");
            g.release().unwrap();
            say("DONE");
        }
        "mix" => {
            let locker = h.locker(strategy(p[3]));
            say("READY");
            assert_eq!(hear(), "GO");
            mix(
                &h,
                &locker,
                key,
                p[1].parse().unwrap(),
                p[2].parse().unwrap(),
            );
            say("DONE");
        }
        other => panic!("{other}"),
    }
}

/// The kinds a round of `mix` takes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Lock,
    Write,
    Read,
    Permit,
}

/// The highest tokens this process has seen held of a key: of anyone, and of an exclusive
/// holder. An exclusive holder's token exceeds every token held before it; a shared
/// holder's exceeds every exclusive holder's before it.
#[derive(Default)]
struct Seen {
    any: i64,
    exclusive: i64,
}

/// `threads` threads × `rounds` rounds on two keys of `key`: `KEY/rw` taken as `lock`,
/// `write` or `read`, and `KEY/sem` as `lock` or one of `PERMITS` permits. Each holder
/// enters the key's count of holders (exclusive holders as writers) and checks it.
fn mix<C: Occupancy>(h: &Harness<C>, locker: &Locker<C>, key: &str, threads: usize, rounds: usize) {
    let seen = Arc::new(Mutex::new(HashMap::<String, Seen>::new()));
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (locker, pool, key) = (locker.clone(), h.pool.clone(), key.to_owned());
            let (seen, start) = (seen.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                for round in 0..rounds {
                    let (k, kind) = match (round + t) % 5 {
                        0 => (format!("{key}/rw"), Kind::Lock),
                        1 => (format!("{key}/rw"), Kind::Write),
                        2 => (format!("{key}/rw"), Kind::Read),
                        3 => (format!("{key}/sem"), Kind::Lock),
                        _ => (format!("{key}/sem"), Kind::Permit),
                    };
                    let g = match kind {
                        Kind::Lock => locker.lock(&k),
                        Kind::Write => locker.write(&k),
                        Kind::Read => locker.read(&k),
                        Kind::Permit => locker.permit(&k, PERMITS),
                    }
                    .unwrap();
                    let exclusive = matches!(kind, Kind::Lock | Kind::Write);
                    let mut c = pool.get().unwrap();
                    let now = c.enter(&k, exclusive);
                    if exclusive {
                        assert_eq!(
                            (now.holders, now.writers),
                            (1, 1),
                            "{kind:?} of {k} beside others"
                        );
                    } else {
                        assert_eq!(now.writers, 0, "{kind:?} of {k} beside an exclusive holder");
                    }
                    if kind == Kind::Permit {
                        assert!(now.holders <= i64::from(PERMITS), "{} permits", now.holders);
                    }
                    {
                        let mut seen = seen.lock().unwrap();
                        let s = seen.entry(k.clone()).or_default();
                        if exclusive {
                            assert!(
                                g.token() > s.any,
                                "{kind:?} token {} after {}",
                                g.token(),
                                s.any
                            );
                            s.exclusive = g.token();
                        } else {
                            assert!(
                                g.token() > s.exclusive,
                                "{kind:?} token {} after the exclusive {}",
                                g.token(),
                                s.exclusive
                            );
                        }
                        s.any = s.any.max(g.token());
                    }
                    std::thread::sleep(Duration::from_micros(if exclusive { 300 } else { 1500 }));
                    c.leave(&k, exclusive);
                    drop(c);
                    g.release().unwrap();
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
}

/// Readers and the exclusive lock (and `write`, the same lock), both ways, on two
/// `Locker`s of the same process.
fn readers_and_exclusive<C: Occupancy>(h: &Harness<C>, s: Strategy) {
    let (a, b) = (h.locker(s), h.locker(s));
    let key = unique_key("one-rw");
    let r1 = a
        .try_read(&key)
        .unwrap()
        .expect("a free key: a reader gets in");
    let r2 = b
        .try_read(&key)
        .unwrap()
        .expect("a second reader beside the first");
    assert!(b.try_lock(&key).unwrap().is_none(), "lock beside readers");
    assert!(a.try_write(&key).unwrap().is_none(), "write beside readers");
    let top = r1.token().max(r2.token());
    // A waiting exclusive lock gets the key once the readers are gone, and not before.
    let released = Arc::new(AtomicBool::new(false));
    let waiter = {
        let (b, key, released) = (b.clone(), key.clone(), released.clone());
        std::thread::spawn(move || {
            let g = b
                .try_lock_for(&key, Duration::from_secs(20))
                .unwrap()
                .expect("the exclusive lock once the readers left");
            assert!(
                released.load(Ordering::SeqCst),
                "lock while readers held the key"
            );
            g
        })
    };
    // However long the waiter has tried by now, the readers still hold the key.
    std::thread::sleep(Duration::from_millis(300));
    released.store(true, Ordering::SeqCst);
    r1.release().unwrap();
    r2.release().unwrap();
    let x = waiter.join().unwrap();
    assert!(
        x.token() > top,
        "exclusive token {} after readers' {top}",
        x.token()
    );
    // Held exclusively: no reader, no writer.
    assert!(a.try_read(&key).unwrap().is_none(), "a reader beside lock");
    assert!(a.try_write(&key).unwrap().is_none(), "a writer beside lock");
    assert!(a.try_lock(&key).unwrap().is_none(), "two exclusive holders");
    let after = x.token();
    x.release().unwrap();
    // `write` is the exclusive lock: it excludes `lock`, and readers.
    let w = a
        .try_write(&key)
        .unwrap()
        .expect("a free key: the writer gets in");
    assert!(w.token() > after);
    assert!(b.try_lock(&key).unwrap().is_none(), "lock beside write");
    assert!(b.try_read(&key).unwrap().is_none(), "a reader beside write");
    let wt = w.token();
    w.release().unwrap();
    let r = b.try_read(&key).unwrap().expect("a reader once free");
    assert!(
        r.token() > wt,
        "a reader's token {} after the writer's {wt}",
        r.token()
    );
    drop(r);
    if matches!(s, Strategy::Lease { .. }) {
        forced_readers_free_the_key(h, &a);
    }
}

/// `admin::force_release` of a `Lease` key's readers (the administrator's way out) frees the
/// key for its exclusive lock at once, not only once their leases would have run out.
fn forced_readers_free_the_key<C: Occupancy>(h: &Harness<C>, l: &Locker<C>) {
    let key = unique_key("one-forced");
    let (r1, r2) = (l.read(&key).unwrap(), l.read(&key).unwrap());
    assert!(l.try_lock(&key).unwrap().is_none());
    let removed = diesel_lock::admin::force_release(&mut *h.pool.get().unwrap(), &key).unwrap();
    assert_eq!(removed.len(), 2, "{removed:?}");
    assert!(
        l.try_lock(&key).unwrap().is_some(),
        "the exclusive lock right after the readers were forced out"
    );
    assert!(matches!(r1.release(), Err(Error::LockLost { .. })));
    assert!(matches!(r2.release(), Err(Error::LockLost { .. })));
}

/// Permits and the exclusive lock, both ways; a semaphore key is not a reader-writer key.
fn permits_and_exclusive<C: Occupancy>(h: &Harness<C>, s: Strategy) {
    let (a, b) = (h.locker(s), h.locker(s));
    let key = unique_key("one-sem");
    let p1 = a.try_permit(&key, PERMITS).unwrap().expect("a permit");
    assert!(b.try_lock(&key).unwrap().is_none(), "lock beside a permit");
    assert!(
        b.try_write(&key).unwrap().is_none(),
        "write beside a permit"
    );
    let released = Arc::new(AtomicBool::new(false));
    let waiter = {
        let (b, key, released) = (b.clone(), key.clone(), released.clone());
        std::thread::spawn(move || {
            let g = b
                .try_lock_for(&key, Duration::from_secs(20))
                .unwrap()
                .expect("the exclusive lock once the permit went back");
            assert!(released.load(Ordering::SeqCst), "lock beside a permit");
            g
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    released.store(true, Ordering::SeqCst);
    let pt = p1.token();
    p1.release().unwrap();
    let x = waiter.join().unwrap();
    assert!(x.token() > pt);
    assert!(
        a.try_permit(&key, PERMITS).unwrap().is_none(),
        "a permit beside the exclusive lock"
    );
    let xt = x.token();
    x.release().unwrap();
    let p = a
        .try_permit(&key, PERMITS)
        .unwrap()
        .expect("a permit once free");
    assert!(p.token() > xt);
    drop(p);
    mixing_is_an_error(&a, &key);
}

/// A key is a semaphore or a reader-writer lock, never both; the error says which it is and
/// what to do.
fn mixing_is_an_error<C: Occupancy>(l: &Locker<C>, sem: &str) {
    match l.try_read(sem) {
        Err(e @ Error::Permits { .. }) => {
            let m = e.to_string();
            assert!(
                m.contains(sem) && m.contains("semaphore") && m.contains("another key"),
                "{m}"
            );
        }
        other => panic!("a reader of a semaphore key: {other:?}"),
    }
    let rw = unique_key("one-rw-then-sem");
    drop(l.try_read(&rw).unwrap().expect("a reader"));
    match l.try_permit(&rw, 3) {
        Err(e @ Error::Permits { .. }) => {
            let m = e.to_string();
            assert!(
                m.contains(&rw) && m.contains("reader-writer") && m.contains("another key"),
                "{m}"
            );
        }
        other => panic!("a permit of a reader-writer key: {other:?}"),
    }
}

/// Holders in other processes: three readers, then the exclusive lock of this process
/// refused and then waiting for them; an exclusive holder elsewhere keeps readers and
/// permits of this process out; permits elsewhere keep the exclusive lock out.
fn across_processes<C: Occupancy>(backend: &str, h: &Harness<C>, s: Strategy) {
    let l = h.locker(s);
    let name = s.name();
    let key = unique_key("one-procs");
    let mut readers: Vec<Kid> = (0..3)
        .map(|_| Kid::spawn(backend, &h.url, 10_000, &key, &format!("hold:read:{name}")))
        .collect();
    let top = readers
        .iter_mut()
        .map(|k| k.expect("HELD")[5..].parse::<i64>().unwrap())
        .max()
        .unwrap();
    assert!(
        l.try_lock(&key).unwrap().is_none(),
        "lock beside 3 readers of other processes"
    );
    assert!(
        l.try_lock_for(&key, Duration::from_millis(300))
            .unwrap()
            .is_none(),
        "lock beside 3 readers of other processes, after a wait"
    );
    for k in &mut readers {
        k.tell("GO");
    }
    for k in &mut readers {
        k.expect("DONE");
    }
    let x = l
        .try_lock_for(&key, Duration::from_secs(20))
        .unwrap()
        .expect("lock once the readers left");
    assert!(x.token() > top);
    drop(x);
    // An exclusive holder in another process.
    let mut holder = Kid::spawn(backend, &h.url, 10_000, &key, &format!("hold:lock:{name}"));
    holder.expect("HELD");
    assert!(
        l.try_read(&key).unwrap().is_none(),
        "a reader beside lock elsewhere"
    );
    holder.tell("GO");
    holder.expect("DONE");
    // Permits elsewhere.
    let sem = unique_key("one-procs-sem");
    let mut permits: Vec<Kid> = (0..2)
        .map(|_| {
            Kid::spawn(
                backend,
                &h.url,
                10_000,
                &sem,
                &format!("hold:permit:{name}"),
            )
        })
        .collect();
    for k in &mut permits {
        k.expect("HELD");
    }
    assert!(
        l.try_lock(&sem).unwrap().is_none(),
        "lock beside permits elsewhere"
    );
    for k in &mut permits {
        k.tell("GO");
        k.expect("DONE");
    }
    assert!(
        l.try_lock(&sem).unwrap().is_some(),
        "lock once the permits went back"
    );
}

/// `mix` in this process's threads, then in 3 processes × 3 threads at once.
fn chaos<C: Occupancy>(backend: &str, h: &Harness<C>, s: Strategy, rounds: usize) {
    let l = h.locker(s);
    let key = unique_key("one-mix");
    for k in ["rw", "sem"] {
        h.pool.get().unwrap().occupancy_init(&format!("{key}/{k}"));
    }
    mix(h, &l, &key, 6, rounds);
    let mut kids: Vec<Kid> = (0..3)
        .map(|_| {
            let mode = format!("mix:3:{rounds}:{}", s.name());
            Kid::spawn(backend, &h.url, 10_000, &key, &mode)
        })
        .collect();
    for k in &mut kids {
        k.expect("READY");
    }
    for k in &mut kids {
        k.tell("GO");
    }
    for k in &mut kids {
        k.expect("DONE");
    }
}

macro_rules! one_lock_tests {
    ($module:ident, $backend:literal, $harness:expr, $strategy:expr, $rounds:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn readers() {
                if let Some(h) = $harness {
                    readers_and_exclusive(&h, $strategy);
                }
            }
            #[test]
            fn permits() {
                if let Some(h) = $harness {
                    permits_and_exclusive(&h, $strategy);
                }
            }
            #[test]
            fn processes() {
                if let Some(h) = $harness {
                    across_processes($backend, &h, $strategy);
                }
            }
            #[test]
            fn mixed() {
                if let Some(h) = $harness {
                    chaos($backend, &h, $strategy, $rounds);
                }
            }
        }
    };
}

one_lock_tests!(
    sqlite_lease,
    "sqlite",
    common::sqlite_sized(16),
    lease(),
    40
);
#[cfg(feature = "postgres")]
one_lock_tests!(pg_lease, "pg", common::pg_sized(16), lease(), 60);
#[cfg(feature = "postgres")]
one_lock_tests!(
    pgbouncer_lease,
    "pgbouncer",
    common::pgbouncer_sized(16),
    lease(),
    40
);
#[cfg(feature = "postgres")]
one_lock_tests!(
    pg_for_update,
    "pg",
    common::pg_sized(16),
    Strategy::ForUpdate,
    60
);
#[cfg(feature = "postgres")]
one_lock_tests!(
    pgbouncer_for_update,
    "pgbouncer",
    common::pgbouncer_sized(16),
    Strategy::ForUpdate,
    40
);
#[cfg(feature = "postgres")]
one_lock_tests!(
    pg_advisory,
    "pg",
    common::pg_sized(16),
    Strategy::Advisory,
    60
);
#[cfg(feature = "mysql")]
one_lock_tests!(mysql_lease, "mysql", common::mysql_sized(16), lease(), 60);
#[cfg(feature = "mysql")]
one_lock_tests!(
    mysql_for_update,
    "mysql",
    common::mysql_sized(16),
    Strategy::ForUpdate,
    60
);

/// MySQL's `Advisory` can make neither readers nor permits exclude its exclusive lock
/// (`GET_LOCK` has no shared mode): both are refused, with errors that say so, and the key's
/// exclusive lock is left free.
#[cfg(feature = "mysql")]
#[test]
fn mysql_advisory_refuses_kinds_it_cannot_exclude() {
    let Some(h) = common::mysql() else { return };
    let l = h.locker(Strategy::Advisory);
    let key = unique_key("one-mysql-advisory");
    assert!(matches!(l.try_read(&key), Err(Error::Unsupported { .. })));
    match l.try_permit(&key, PERMITS) {
        Err(e @ Error::Incompatible { .. }) => {
            let m = e.to_string();
            assert!(
                m.contains(&key) && m.contains("exclusive") && m.contains("lease"),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(l.try_lock(&key).unwrap().is_some());
}
