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

/// SQLite: another process's write transaction holds the database's one write lock (a
/// process stopped inside one, say): a `try_lock_for` of 1 s returns busy after at most one
/// busy_timeout (5 s, the statement's own wait), not one per internal retry (it took 25 s:
/// five tries of 5 s each). Here the other "process" is a raw connection of this test.
#[test]
fn sqlite_a_held_write_lock_costs_one_busy_timeout_at_most() {
    use diesel::connection::SimpleConnection;
    use diesel::Connection;
    let h = common::sqlite().unwrap();
    for strategy in [
        Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        Strategy::Row { stale_after: None },
    ] {
        let locker = h.locker(strategy);
        let key = unique_key("sqlite-write-locked");
        let mut other = diesel::SqliteConnection::establish(&h.url).unwrap();
        other.batch_execute("BEGIN IMMEDIATE").unwrap();
        let start = Instant::now();
        let got = locker.try_lock_for(&key, Duration::from_secs(1));
        let took = start.elapsed();
        other.batch_execute("ROLLBACK").unwrap();
        assert!(
            matches!(got, Ok(None)),
            "{strategy:?}: {:?}",
            got.map(|g| g.map(|g| g.token()))
        );
        // 1 s of deadline + one 5 s busy wait + slack for a loaded machine; five busy
        // waits would be 25 s.
        assert!(
            took < Duration::from_secs(12),
            "{strategy:?}: took {took:?}"
        );
        // Free again: taken at once.
        assert!(locker.try_lock(&key).unwrap().is_some());
    }
}
