//! The lease heartbeat: it keeps a lease alive well past its ttl, and it leaves no thread
//! behind once its `Locker` is gone.

mod common;

use common::{unique_key, Harness};
use diesel_lock::{LockConnection, Locker, Strategy};
use std::time::Duration;

fn heartbeat_keeps_the_lease<C: LockConnection>(h: &Harness<C>) {
    let _one_at_a_time = THREADS.lock().unwrap_or_else(|p| p.into_inner());
    let ttl = Duration::from_millis(600);
    let l = h.locker(Strategy::Lease { ttl });
    let other = Locker::builder(h.pool.clone())
        .strategy(Strategy::Lease { ttl })
        .build()
        .unwrap();
    let key = unique_key("beat");
    let g = l.lock(&key).unwrap();
    // More than three ttls: without renewals the lease would have expired three times over.
    assert!(other
        .try_lock_for(&key, ttl * 3 + Duration::from_millis(200))
        .unwrap()
        .is_none());
    g.check().unwrap();
    g.release().unwrap();
    assert!(other.try_lock(&key).unwrap().is_some());
}

#[test]
fn sqlite_heartbeat_keeps_the_lease() {
    heartbeat_keeps_the_lease(&common::sqlite().unwrap());
}

#[cfg(feature = "postgres")]
#[test]
fn pg_heartbeat_keeps_the_lease() {
    if let Some(h) = common::pg() {
        heartbeat_keeps_the_lease(&h);
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_heartbeat_keeps_the_lease() {
    if let Some(h) = common::mysql() {
        heartbeat_keeps_the_lease(&h);
    }
}

/// Threads of this process with the given name.
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// Under `cargo test` the tests of this file share one process: they take turns, so that the
/// thread count below sees no heartbeat but its own.
static THREADS: std::sync::Mutex<()> = std::sync::Mutex::new(());
#[test]
fn dropping_the_locker_stops_its_heartbeat_thread() {
    let _one_at_a_time = THREADS.lock().unwrap_or_else(|p| p.into_inner());
    let h = common::sqlite().unwrap();
    let before = threads_named("dlock-heartbeat");
    let l = h.locker(Strategy::Lease {
        ttl: Duration::from_secs(5),
    });
    let g = l.lock(&unique_key("threads")).unwrap();
    // A new thread names itself once it runs, a moment after it is spawned: look until then.
    let named = std::time::Instant::now() + Duration::from_secs(5);
    while threads_named("dlock-heartbeat") == before && std::time::Instant::now() < named {
        std::thread::yield_now();
    }
    assert_eq!(threads_named("dlock-heartbeat"), before + 1);
    let l2 = l.clone();
    drop(l);
    drop(g);
    // A clone still lives: its heartbeat may still be needed.
    assert_eq!(threads_named("dlock-heartbeat"), before + 1);
    drop(l2);
    // Joined in the Locker's drop: gone by the time drop returns, no waiting needed.
    assert_eq!(threads_named("dlock-heartbeat"), before);
}

/// Context switches of this process's heartbeat threads so far.
fn heartbeat_switches() -> u64 {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| {
            let p = t.ok()?.path();
            let comm = std::fs::read_to_string(p.join("comm")).ok()?;
            (comm.trim_end() == "dlock-heartbeat").then(|| {
                std::fs::read_to_string(p.join("status"))
                    .unwrap_or_default()
                    .lines()
                    .filter(|l| l.contains("ctxt_switches"))
                    .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
                    .sum::<u64>()
            })
        })
        .sum()
}

/// A heartbeat thread with no lease left to renew waits two intervals at a time. Once its
/// first idle stretch had passed it woke every millisecond for as long as the `Locker`
/// lived (an adversary counted 16k context switches in 20 s).
#[test]
fn an_idle_heartbeat_thread_sleeps() {
    let _one_at_a_time = THREADS.lock().unwrap_or_else(|p| p.into_inner());
    let h = common::sqlite().unwrap();
    // A renewal every 200 ms: idle stretches of 400 ms.
    let l = h.locker(Strategy::Lease {
        ttl: Duration::from_millis(600),
    });
    l.lock(&unique_key("idle")).unwrap().release().unwrap();
    // Not a synchronisation: past the first idle stretch, where the spinning began.
    std::thread::sleep(Duration::from_secs(1));
    let before = heartbeat_switches();
    std::thread::sleep(Duration::from_secs(2));
    let woke = heartbeat_switches() - before;
    assert!(
        woke < 100,
        "the idle heartbeat switched {woke} times in 2 s"
    );
    drop(l);
}

/// With the database out of reach (here: every pooled connection taken), renewals fail; once
/// a whole ttl has passed since the last one that worked, the guard knows it may no longer
/// hold the lock, without asking the database.
#[test]
fn a_lease_that_cannot_be_renewed_is_lost_after_its_ttl() {
    use diesel::r2d2::{ConnectionManager, Pool};
    use diesel_lock::Error;
    use std::time::Instant;

    let _one_at_a_time = THREADS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // No connection opened by `build` (within the 100 ms below: a loaded machine's SQLite
    // open can take longer); each is opened by a `get` that may try again.
    let pool = Pool::builder()
        .max_size(2)
        .min_idle(Some(0))
        .connection_timeout(Duration::from_millis(100))
        .connection_customizer(Box::new(diesel_lock::SqliteTuning::default()))
        .build(ConnectionManager::<diesel::SqliteConnection>::new(
            dir.path().join("l.db").to_str().unwrap(),
        ))
        .unwrap();
    let get = || {
        let t0 = Instant::now();
        loop {
            match pool.get() {
                Ok(c) => break c,
                Err(e) => assert!(t0.elapsed() < Duration::from_secs(10), "{e}"),
            }
        }
    };
    // Both opened before anything needs one within 100 ms, and kept idle in the pool.
    drop((get(), get()));
    let ttl = Duration::from_millis(600);
    let l = Locker::builder(pool.clone())
        .strategy(Strategy::Lease { ttl })
        .build()
        .unwrap();
    l.migrate().unwrap();
    let g = l.lock("cut-off").unwrap();
    let start = Instant::now();
    let taken = (get(), get());
    let lost_at = loop {
        match g.check() {
            Err(Error::LockLost { .. }) => break start.elapsed(),
            Err(Error::Pool(_)) => assert!(start.elapsed() < ttl * 3, "never counted as lost"),
            other => panic!("with every connection taken: {other:?}"),
        }
    };
    assert!(
        lost_at <= ttl + Duration::from_millis(300),
        "lost only after {lost_at:?}"
    );
    drop(taken);
    assert!(matches!(g.release(), Err(Error::LockLost { .. })));
}

/// `check()` answers by the lease's local deadline even when the database does not (here:
/// no pooled connection for far longer than the ttl; in a partition, a statement that hangs:
/// tests/partition.rs), and once it has said "lost" it never says "held" again, even when
/// the database can be reached once more. Before: `check()` waited for the pool's own timeout
/// (60 s here) and then reported a pool error, not the loss.
#[test]
fn check_reports_the_loss_by_the_deadline_when_the_database_does_not_answer() {
    use diesel::r2d2::{ConnectionManager, Pool};
    use diesel_lock::Error;
    use std::time::Instant;

    let _one_at_a_time = THREADS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let pool_timeout = Duration::from_secs(60);
    let pool = Pool::builder()
        .max_size(2)
        .connection_timeout(pool_timeout)
        .connection_customizer(Box::new(diesel_lock::SqliteTuning::default()))
        .build(ConnectionManager::<diesel::SqliteConnection>::new(
            dir.path().join("l.db").to_str().unwrap(),
        ))
        .unwrap();
    let ttl = Duration::from_millis(800);
    let l = Locker::builder(pool.clone())
        .strategy(Strategy::Lease { ttl })
        .build()
        .unwrap();
    l.migrate().unwrap();
    let g = l.lock("unanswered").unwrap();
    let start = Instant::now();
    let taken = (pool.get().unwrap(), pool.get().unwrap());
    // One call: it may not wait for the pool past the deadline.
    let verdict = g.check();
    let took = start.elapsed();
    assert!(
        matches!(verdict, Err(Error::LockLost { .. })),
        "after {took:?}: {verdict:?}"
    );
    assert!(took < pool_timeout / 4, "answered only after {took:?}");
    drop(taken);
    // The database answers again, and the lease is in fact expired there; however long the
    // heartbeat keeps running, the guard stays lost.
    for _ in 0..5 {
        std::thread::sleep(ttl / 4);
        assert!(matches!(g.check(), Err(Error::LockLost { .. })));
    }
    assert!(matches!(g.release(), Err(Error::LockLost { .. })));
}
