//! The session strategies' readers, writers and semaphore permits under attack: 4 processes
//! × 3 threads take readers, writers and permits of one key each (every holder checks a
//! count of holders kept in a table), while this process pauses random children with
//! SIGSTOP for up to 300 ms (a paused waiting writer's mark on PostgreSQL then runs out), and
//! runs `purge` and `admin::force_release` on the same keys and `admin` reads in a loop
//! beside them. Never two writers, a writer beside a reader, or more permits than N; every
//! thread's tokens increase; every child finishes (no hang, no error).

mod common;

use common::kids::{hear, say, Kid};
use common::occupancy::Occupancy;
use common::{unique_key, Harness};
use diesel_lock::{admin, Strategy};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const N: u32 = 2;

fn strategy(name: &str) -> Strategy {
    match name {
        "for-update" => Strategy::ForUpdate,
        "advisory" => Strategy::Advisory,
        other => panic!("{other}"),
    }
}

child_entry!(child_main);

/// Mode `STRATEGY:RW:ROUNDS`: 3 threads × ROUNDS; each round a permit of `key`/sem, and, if
/// RW is 1, a reader or (every third round) a writer of `key`/rw. Prints `DONE`.
fn child_main<C: Occupancy>(h: Harness<C>, _ttl: Duration, key: &str, mode: &str) {
    let p: Vec<&str> = mode.split(':').collect();
    let locker = h.locker(strategy(p[0]));
    let (rw, rounds): (bool, usize) = (p[1] == "1", p[2].parse().unwrap());
    say("READY");
    assert_eq!(hear(), "GO");
    let handles: Vec<_> = (0..3)
        .map(|t| {
            let (locker, pool, key) = (locker.clone(), h.pool.clone(), key.to_owned());
            std::thread::spawn(move || {
                let (sem, rwk) = (format!("{key}/sem"), format!("{key}/rw"));
                let (mut last_sem, mut last_rw) = (0, 0);
                for round in 0..rounds {
                    let g = locker.permit(&sem, N).unwrap();
                    assert!(g.token() > last_sem, "a permit's token went back");
                    last_sem = g.token();
                    let mut c = pool.get().unwrap();
                    let seen = c.enter(&sem, false);
                    assert!(
                        seen.holders <= i64::from(N),
                        "{} permits of {N}",
                        seen.holders
                    );
                    std::thread::sleep(Duration::from_micros(300));
                    c.leave(&sem, false);
                    drop(c);
                    g.release().unwrap();
                    if !rw {
                        continue;
                    }
                    let writer = (round + t) % 3 == 0;
                    let g = if writer {
                        locker.write(&rwk).unwrap()
                    } else {
                        locker.read(&rwk).unwrap()
                    };
                    assert!(
                        g.token() > last_rw,
                        "a reader's or writer's token went back"
                    );
                    last_rw = g.token();
                    let mut c = pool.get().unwrap();
                    let seen = c.enter(&rwk, writer);
                    if writer {
                        assert_eq!(
                            (seen.holders, seen.writers),
                            (1, 1),
                            "a writer beside others"
                        );
                    } else {
                        assert_eq!(seen.writers, 0, "a reader beside a writer");
                    }
                    std::thread::sleep(Duration::from_micros(500));
                    c.leave(&rwk, writer);
                    drop(c);
                    g.check().unwrap();
                    g.release().unwrap();
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
    say("DONE");
}

fn attack<C: Occupancy>(backend: &str, h: &Harness<C>, s: Strategy, rw: bool) {
    h.locker(s); // migrated
    let lease = h.locker(Strategy::Lease {
        ttl: Duration::from_secs(10),
    });
    let key = unique_key("chaos");
    let (sem, rwk) = (format!("{key}/sem"), format!("{key}/rw"));
    h.pool.get().unwrap().occupancy_init(&sem);
    h.pool.get().unwrap().occupancy_init(&rwk);
    let mode = format!("{}:{}:60", s.name(), u8::from(rw));
    let mut kids: Vec<Kid> = (0..4)
        .map(|_| Kid::spawn(backend, &h.url, 10_000, &key, &mode))
        .collect();
    for k in &mut kids {
        k.expect("READY");
    }
    let stop = Arc::new(AtomicBool::new(false));
    // Maintenance beside the locks.
    let maintenance = {
        let (stop, pool, lease, sem, rwk) = (
            stop.clone(),
            h.pool.clone(),
            lease.clone(),
            sem.clone(),
            rwk.clone(),
        );
        std::thread::spawn(move || {
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) {
                lease.purge(Duration::ZERO).unwrap();
                let mut c = pool.get().unwrap();
                admin::force_release(&mut *c, &sem).unwrap();
                admin::force_release(&mut *c, &rwk).unwrap();
                admin::held_locks(&mut *c).unwrap();
                rounds += 1;
            }
            rounds
        })
    };
    for k in &mut kids {
        k.tell("GO");
    }
    let pids: Vec<i32> = kids.iter().map(Kid::pid).collect();
    let pauser = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut paused = 0u32;
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let pid = Pid::from_raw(pids[i % pids.len()]);
                i = (i * 7 + 3) % 1009;
                if kill(pid, Signal::SIGSTOP).is_ok() {
                    paused += 1;
                    std::thread::sleep(Duration::from_millis((i * 37 % 300) as u64));
                    let _ = kill(pid, Signal::SIGCONT);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            paused
        })
    };
    let started = Instant::now();
    for k in &mut kids {
        k.expect("DONE");
    }
    stop.store(true, Ordering::Relaxed);
    let paused = pauser.join().unwrap();
    let purges = maintenance.join().unwrap();
    eprintln!(
        "{backend} {}: 4 processes × 3 threads × 60 rounds in {:?}, {paused} pauses, {purges} maintenance rounds",
        s.name(),
        started.elapsed()
    );
}

#[cfg(feature = "postgres")]
#[test]
fn pg_for_update() {
    if let Some(h) = common::pg_own_db_sized(12) {
        attack("pg", &h, Strategy::ForUpdate, true);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pg_advisory() {
    if let Some(h) = common::pg_own_db_sized(12) {
        attack("pg", &h, Strategy::Advisory, true);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pgbouncer_for_update() {
    if let Some(h) = common::pgbouncer_own_db_sized(12) {
        attack("pgbouncer", &h, Strategy::ForUpdate, true);
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_for_update() {
    if let Some(h) = common::mysql_own_db_sized(12) {
        attack("mysql", &h, Strategy::ForUpdate, true);
    }
}

// MySQL's `Advisory` has neither readers nor semaphores (`GET_LOCK` has no shared mode;
// tests/session_semaphore.rs checks the refusal).
