//! Behind a transaction-pooling PgBouncer (`DLOCK_TEST_PGBOUNCER_URL`, started by
//! scripts/services.sh): what the pooler breaks and how the library avoids it. The conformance
//! suite, the process tests and the session faults run through it too (tests/conformance.rs,
//! processes.rs, session_faults.rs); here is what is particular to the pooler: `connect` with
//! `dlock_pooler=transaction` (diesel's statement cache off: with it on, 393 of 400 cycles failed
//! through it, named statements "already exist" or "do not exist", and once a run hung),
//! migrations (no session lock left behind on a pooled server session), cancelled waits
//! (ending only the waiter's own server session), and `listen_url` (refused through it).
#![cfg(feature = "postgres")]

mod common;

use common::unique_key;
use diesel::sql_types::BigInt;
use diesel::{PgConnection, QueryableByName, RunQueryDsl};
use diesel_lock::{Cancel, Error, Locker, Strategy};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// `connect` takes the URL as services.sh prints it: every strategy that works through a
/// transaction pooler locks, excludes and releases through an `AnyConnection` pool.
#[test]
fn connect_takes_the_pooler_url() {
    let Some(url) = common::pgbouncer_url() else {
        return;
    };
    let pool = diesel_lock::connect(&url).unwrap();
    for s in [
        Strategy::Row { stale_after: None },
        Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        Strategy::ForUpdate,
        Strategy::AdvisoryXact,
    ] {
        let l = Locker::builder(pool.clone()).strategy(s).build().unwrap();
        l.migrate().unwrap();
        let key = unique_key("connect");
        // Many cycles, so that the pool's connections meet many server sessions.
        for _ in 0..50 {
            let g = l.lock(&key).unwrap();
            assert!(l.try_lock(&key).unwrap().is_none(), "{}", s.name());
            g.check().unwrap();
            g.release().unwrap();
        }
    }
}

/// Many concurrent `migrate()` calls through the pooler leave no migration lock behind: the
/// lock is transaction-level. (A session-level lock taken and released by statements that
/// the pooler sends to different server sessions stays held by one of them and blocks every
/// later migration on the others, until the pooler closes that server session: after 10 s
/// idle with services.sh's `server_idle_timeout`. Seen: 41 s for these 30 calls, against
/// 0.3 s.)
#[test]
fn migrations_leave_no_lock_behind() {
    let Some(h) = common::pgbouncer() else {
        return;
    };
    let started = Instant::now();
    let threads: Vec<_> = (0..6)
        .map(|_| {
            let pool = h.pool.clone();
            std::thread::spawn(move || {
                let l = Locker::builder(pool).build().unwrap();
                for _ in 0..5 {
                    l.migrate().unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(8),
        "30 migrations took {took:?}: blocked by a lock left on a server session?"
    );
    // The migration lock's key, 0x646c_6f63_6b5f_6d69 ("dlock_mi"), as pg_locks shows it,
    // held by a session that is idle: a lock left behind. (Other tests migrating at this
    // moment hold or wait for it inside their migration's transaction: not idle.)
    let held = diesel::sql_query(
        "SELECT count(*) AS n FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND a.state = 'idle' \
         AND l.classid::int8 = 1684828003 AND l.objid::int8 = 1801416041 AND l.objsubid = 1",
    )
    .get_result::<Count>(&mut common::pg().unwrap().pool.get().unwrap())
    .unwrap();
    assert_eq!(held.n, 0, "a migration lock was left on a server session");
}

/// A `listen_url` through the pooler is refused: LISTEN holds a server session that the
/// pooler hands to others, so no notification would arrive.
#[test]
fn listen_url_through_the_pooler_is_refused() {
    let h = common::sqlite().unwrap();
    let r = Locker::builder(h.pool.clone())
        .listen_url("postgres://u@db:6432/app?dlock_pooler=transaction")
        .build();
    assert!(matches!(r, Err(Error::InvalidConfig(_))), "{r:?}");
    // And connect refuses what it does not know.
    for bad in [
        "postgres://u@db/app?dlock_pooler=session",
        "mysql://u@db/app?dlock_pooler=transaction",
    ] {
        assert!(
            matches!(diesel_lock::connect(bad), Err(Error::InvalidUrl(_))),
            "{bad}"
        );
    }
}

/// `Advisory` on a pool from a transaction pooler's URL is refused: its session locks would
/// stay on whichever server session the pooler gave out. The strategies that work there
/// are not (`connect_takes_the_pooler_url` runs them).
#[test]
fn advisory_through_the_pooler_is_refused() {
    let Some(url) = common::pgbouncer_url() else {
        return;
    };
    let r = Locker::connect(&url)
        .unwrap()
        .strategy(Strategy::Advisory)
        .build();
    match r {
        Err(Error::InvalidConfig(why)) => assert!(why.contains("Advisory"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// Whether the server shows a wait for `key` under `s` (the waiter's session is the
/// pooler's choice, so it is found by the lock it waits for).
fn waiting(conn: &mut PgConnection, key: &str, s: Strategy) -> bool {
    let q = match s {
        Strategy::ForUpdate => diesel::sql_query(
            "SELECT count(*) AS n FROM pg_locks l JOIN dlock_for_update f ON f.lock_key = $1 \
             WHERE NOT l.granted AND l.locktype = 'transactionid' \
             AND l.transactionid::text = f.xmax::text",
        )
        .bind::<diesel::sql_types::Text, _>(key)
        .get_result::<Count>(conn),
        _ => {
            let k = diesel_lock::key_hash(key);
            diesel::sql_query(
                "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                 AND classid::int8 = $1 AND objid::int8 = $2 AND objsubid = 1",
            )
            .bind::<BigInt, _>(i64::from((k >> 32) as u32))
            .bind::<BigInt, _>(i64::from(k as u32))
            .get_result::<Count>(conn)
        }
    };
    q.unwrap().n > 0
}

/// A wait cancelled through the pooler ends the waiter's own server session and no other:
/// while other clients of the pooler lock and release (Row, on the same server sessions)
/// and a holder keeps its transaction open, waiters are cancelled, once they wait in the
/// server's queue and also at once (before, or as, their transaction begins). Every
/// cancelled wait returns without the lock, the holder keeps its lock, and the other
/// clients never see a connection fail. (With the waiter's session id asked before its
/// transaction, as for session-level Advisory, cancelled waits went on here: the id named
/// a server session the pooler had given to someone else.)
#[test]
fn a_cancelled_wait_ends_only_its_own_session() {
    let Some(h) = common::pgbouncer() else {
        return;
    };
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(AtomicUsize::new(0));
    let traffic: Vec<_> = (0..3)
        .map(|_| {
            let (stop, failures) = (stop.clone(), failures.clone());
            let l = h.locker(Strategy::Row { stale_after: None });
            std::thread::spawn(move || {
                let key = unique_key("traffic");
                let mut cycles = 0;
                while !stop.load(Ordering::Relaxed) {
                    match l.lock(&key).and_then(|g| g.release()) {
                        Ok(()) => cycles += 1,
                        Err(e) => {
                            eprintln!("a bystander failed: {e}");
                            failures.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                cycles
            })
        })
        .collect();
    for s in [Strategy::ForUpdate, Strategy::AdvisoryXact] {
        let key = unique_key("cancel");
        let holder = h.locker(s);
        let held = holder.lock(&key).unwrap();
        let waiter = Locker::builder(common::pool::<PgConnection>(&h.url, 2))
            .strategy(s)
            .build()
            .unwrap();
        for round in 0..20 {
            let cancel = Cancel::new();
            let (tx, rx) = std::sync::mpsc::channel();
            {
                let (waiter, cancel, key) = (waiter.clone(), cancel.clone(), key.clone());
                std::thread::spawn(move || {
                    let _ = tx.send(waiter.try_lock_cancellable(&key, None, &cancel));
                });
            }
            if round % 2 == 0 {
                let mut watcher = h.pool.get().unwrap();
                let started = Instant::now();
                while !waiting(&mut watcher, &key, s) {
                    assert!(started.elapsed() < Duration::from_secs(20), "never waited");
                    std::thread::sleep(Duration::from_millis(2));
                }
            } else {
                std::thread::sleep(Duration::from_micros(300 * round));
            }
            cancel.cancel();
            // Ending some other server session instead would leave this wait going on.
            let got = rx
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|_| {
                    panic!("{} round {round}: the cancelled wait went on", s.name())
                });
            assert!(
                matches!(got, Ok(None)),
                "{} round {round}: {got:?}",
                s.name()
            );
            held.check().expect("the holder kept its lock");
        }
        held.release().unwrap();
        let again = waiter
            .try_lock_for(&key, Duration::from_secs(5))
            .unwrap()
            .expect("free after the holder's release");
        again.release().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let cycles: usize = traffic.into_iter().map(|t| t.join().unwrap()).sum();
    eprintln!("bystanders: {cycles} cycles meanwhile");
    assert!(cycles > 0);
    assert_eq!(
        failures.load(Ordering::Relaxed),
        0,
        "a cancellation ended a bystander's session"
    );
}
