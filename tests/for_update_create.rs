//! `ForUpdate` makes a missing key row with an insert of its own, apart from the statement
//! that locks the row. That insert's duplicate check waits for a transaction holding the
//! row it would make: a holder that made and locked the row after the acquisition's lock
//! statement found none (a new key, or a row a purge had just deleted). Unbounded, that wait
//! lasted as long as the holder held, beyond `try_lock`'s "no wait", a deadline, or a
//! cancellation (the session is ended only while the lock statement runs). Found in CI:
//! `api_forms pg_for_update::lock_all_is_cancellable` hung for 180 s, its probing
//! `try_lock` of key a stuck in that insert behind the waiter's hold of a, while the waiter
//! waited for b, beside another test's purges of the same database; 15 hangs in 150 runs
//! of that test beside purges (the investigation), 0 in 660 with the insert's wait bounded.
//!
//! Each test stops the acquisition at that instant (`__test_hooks::set_before_create`),
//! lets a holder make and lock the row, then lets the acquisition go on, and asks for its
//! answer (busy) within 0.8 s while the holder keeps the key.
//!
//! On MariaDB that insert, made over a record a purge has just deleted, also deadlocks with
//! another acquisition's waiting lock statement of the key:
//! `mysql_lock_statement_deadlock_victim_runs_again` builds it. On PostgreSQL with sessions
//! at REPEATABLE READ, a waiting writer's mark of the key fails with a serialization
//! failure after another's update of the key's header row:
//! `pg_writer_mark_rolled_back_is_busy`; so did the insert of a key's kind by its first
//! readers or permit holders: `pg_first_readers_and_permits_at_repeatable_read`.

mod common;

use common::{unique_key, Harness};
use diesel_lock::__test_hooks as hooks;
use diesel_lock::{Cancel, LockConnection, Strategy};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How the acquisition under test asks for the key.
#[derive(Clone, Copy, Debug)]
enum Ask {
    Try,
    For,
    Cancelled,
}

/// Runs `ask` for a fresh key, stopped before it makes the key's row while `holder` makes
/// and locks it: once let go, the acquisition answers within 5 s, without the key.
fn aimed<C: LockConnection>(h: &Harness<C>, ask: Ask) {
    let (locker, holder) = (h.locker(Strategy::ForUpdate), h.locker(Strategy::ForUpdate));
    let key = unique_key("for-update-create");
    // The first thread to reach the instant (the acquisition under test) stops there until
    // the holder holds; the holder's own pass finds the hook spent.
    let armed = Arc::new(AtomicBool::new(true));
    let (at_tx, at_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (at_tx, go_rx) = (Mutex::new(at_tx), Mutex::new(go_rx));
    hooks::set_before_create(
        &key,
        Arc::new(move || {
            if armed.swap(false, Ordering::SeqCst) {
                at_tx.lock().unwrap().send(()).unwrap();
                go_rx.lock().unwrap().recv().unwrap();
            }
        }),
    );
    let cancel = Cancel::new();
    let (done_tx, done_rx) = mpsc::channel();
    let asker = {
        let (locker, key, cancel) = (locker.clone(), key.clone(), cancel.clone());
        std::thread::spawn(move || {
            let got = match ask {
                Ask::Try => locker.try_lock(&key),
                Ask::For => locker.try_lock_for(&key, Duration::from_millis(300)),
                Ask::Cancelled => locker.try_lock_cancellable(&key, None, &cancel),
            };
            let _ = done_tx.send((Instant::now(), got.map(|g| g.is_some())));
        })
    };
    at_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the acquisition never reached the row's insert");
    let held = holder.lock(&key).unwrap();
    go_tx.send(()).unwrap();
    let let_go = Instant::now();
    if matches!(ask, Ask::Cancelled) {
        cancel.cancel();
    }
    let answer = done_rx.recv_timeout(Duration::from_secs(5));
    hooks::clear(&key);
    // Kept until here, so that an acquisition waiting for the holder fails the check below
    // rather than returning once the key is released.
    drop(held);
    asker.join().unwrap();
    let (at, got) = answer.unwrap_or_else(|_| {
        panic!("{ask:?}: no answer within 5 s of the holder making and locking the row")
    });
    assert!(!got.unwrap(), "{ask:?}: got the key while it was held");
    eprintln!("{ask:?}: answered {:?} after it was let go", at - let_go);
    // PostgreSQL's insert waits 100 ms for the holder, then busy (`For`: its deadline, 300 ms
    // after the call); MariaDB's does not wait (it waited 1 s, the least a lock wait there
    // lasts, before).
    assert!(
        at - let_go < Duration::from_millis(800),
        "{ask:?}: answered {:?} after it was let go",
        at - let_go
    );
}

fn all<C: LockConnection>(h: &Harness<C>) {
    for ask in [Ask::Try, Ask::For, Ask::Cancelled] {
        aimed(h, ask);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pg() {
    if let Some(h) = common::pg() {
        all(&h);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pgbouncer() {
    if let Some(h) = common::pgbouncer() {
        all(&h);
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql() {
    if let Some(h) = common::mysql() {
        all(&h);
    }
}

/// How many deadlocks the server has ended since it started (`Innodb_deadlocks`).
#[cfg(feature = "mysql")]
fn mysql_deadlocks(c: &mut diesel::MysqlConnection) -> i64 {
    use diesel::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    diesel::sql_query(
        "SELECT CAST(VARIABLE_VALUE AS SIGNED) AS n FROM information_schema.GLOBAL_STATUS \
         WHERE VARIABLE_NAME = 'INNODB_DEADLOCKS'",
    )
    .get_result::<N>(c)
    .unwrap()
    .n
}

/// Waits (at most 20 s) until `n` sessions of the test's database wait for a row lock.
#[cfg(feature = "mysql")]
fn until_waiting(watch: &mut diesel::MysqlConnection, n: i64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while common::mysql_waiting(watch) < n {
        assert!(Instant::now() < deadline, "{what} never waited");
        // What INNODB_TRX shows is refreshed only once nobody read it for 100 ms (see
        // `common::mysql_someone_waits`): a quicker poll would see the same answer for ever.
        std::thread::sleep(Duration::from_millis(150));
    }
}

/// A waiting acquisition whose lock statement MariaDB rolls back as a deadlock's victim runs
/// it again and gets the key, instead of failing with "Deadlock found when trying to get
/// lock". Beside purges of new keys (an adversary: about 1 acquisition in 5,000): a purge's
/// batch has deleted the key's row and not yet committed; the insert that makes the row
/// again (`for_update_create`'s, of an acquisition that found no row) waits for a shared
/// lock on the deleted record, and another acquisition's `SELECT … FOR UPDATE` waits behind
/// it; the batch commits, the insert gets its shared lock and asks for an exclusive one (it
/// makes the row over the deleted record), behind the lock statement's: the server rolls
/// back the lock statement. Built here on purpose with the same statements: the batch is a
/// transaction that deleted the row; the insert runs in a transaction that has written
/// rows, so that the server rolls back the other side, the acquisition (as it did beside
/// real purges); a consistent snapshot keeps the deleted record from being cleaned away.
/// What went wrong with the acquisition's answer, if anything.
#[cfg(feature = "mysql")]
fn lock_statement_deadlock_victim_runs_again(
    h: &Harness<diesel::MysqlConnection>,
    how: &str,
    ask: fn(&diesel_lock::Locker<diesel::MysqlConnection>, &str) -> diesel_lock::Result<bool>,
) -> Option<String> {
    use diesel::sql_types::Text;
    use diesel::{Connection, MysqlConnection, RunQueryDsl};
    let locker = h.locker(Strategy::ForUpdate);
    let key = unique_key("for-update-deadlock");
    drop(locker.lock(&key).unwrap()); // the key's row is there, free
    let connect = || MysqlConnection::establish(&h.url).unwrap();
    let (mut pin, mut purge, mut insert, mut watch) = (connect(), connect(), connect(), connect());
    diesel::sql_query("START TRANSACTION WITH CONSISTENT SNAPSHOT")
        .execute(&mut pin)
        .unwrap();
    diesel::sql_query("BEGIN").execute(&mut purge).unwrap();
    let deleted = diesel::sql_query("DELETE FROM dlock_for_update WHERE lock_key = ?")
        .bind::<Text, _>(&key)
        .execute(&mut purge)
        .unwrap();
    assert_eq!(deleted, 1);
    diesel::sql_query("BEGIN").execute(&mut insert).unwrap();
    for i in 0..50 {
        diesel::sql_query("INSERT INTO dlock_versions (lock_key, version) VALUES (?, 0)")
            .bind::<Text, _>(format!("{key}-weight-{i}"))
            .execute(&mut insert)
            .unwrap();
    }
    let inserting = {
        let key = key.clone();
        std::thread::spawn(move || {
            let made = diesel::sql_query(
                "INSERT IGNORE INTO dlock_for_update (lock_key, version) VALUES (?, 0)",
            )
            .bind::<Text, _>(&key)
            .execute(&mut insert);
            (insert, made)
        })
    };
    until_waiting(&mut watch, 1, "the insert");
    let (done_tx, done_rx) = mpsc::channel();
    let asker = {
        let (locker, key) = (locker.clone(), key.clone());
        std::thread::spawn(move || {
            let _ = done_tx.send(ask(&locker, &key));
        })
    };
    until_waiting(&mut watch, 2, "the acquisition's lock statement");
    let before = mysql_deadlocks(&mut watch);
    diesel::sql_query("COMMIT").execute(&mut purge).unwrap();
    let (mut insert, made) = inserting.join().unwrap();
    assert_eq!(
        made.expect("the insert, whose transaction has written rows, survives the deadlock"),
        1
    );
    assert!(
        mysql_deadlocks(&mut watch) > before,
        "no deadlock was built: nothing tested"
    );
    diesel::sql_query("COMMIT").execute(&mut insert).unwrap();
    let got = done_rx.recv_timeout(Duration::from_secs(20));
    diesel::sql_query("ROLLBACK").execute(&mut pin).unwrap();
    asker.join().unwrap();
    match got {
        Err(_) => Some(format!("{how}: no answer within 20 s")),
        Ok(Ok(true)) => None,
        Ok(Ok(false)) => Some(format!("{how}: the key is free, yet not taken")),
        Ok(Err(e)) => {
            let source = std::error::Error::source(&e).map_or(String::new(), |s| format!(": {s}"));
            Some(format!("{how}: {e}{source}"))
        }
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_lock_statement_deadlock_victim_runs_again() {
    let Some(h) = common::mysql_own_db() else {
        return;
    };
    let failed: Vec<String> = [
        lock_statement_deadlock_victim_runs_again(&h, "lock", |l, k| l.lock(k).map(|_| true)),
        lock_statement_deadlock_victim_runs_again(&h, "try_lock_for", |l, k| {
            l.try_lock_for(k, Duration::from_secs(30))
                .map(|g| g.is_some())
        }),
    ]
    .into_iter()
    .flatten()
    .collect();
    assert!(failed.is_empty(), "{failed:#?}");
}

/// PostgreSQL sessions that default to REPEATABLE READ: a waiting writer first marks the
/// key (an upsert of the key's header row in `dlock_shared_keys`), and that upsert fails
/// with a serialization failure when another transaction updated the row while it waited
/// (another writer's mark or unmark). The attempt counts as busy and the wait goes on; the
/// error reached `try_lock_for` and `lock` before (an adversary's reproduction, 3 of 3).
#[cfg(feature = "postgres")]
#[test]
fn pg_writer_mark_rolled_back_is_busy() {
    use diesel::connection::SimpleConnection;
    use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let Some((own, h)) = pg_own_db_at_repeatable_read(6) else {
        return;
    };
    let holder = h.locker(Strategy::ForUpdate);
    let waiter = h.locker(Strategy::ForUpdate);
    let k = unique_key("mark-rr");
    let held = holder.lock(&k).unwrap();
    // A bounded wait makes the key's header row with the waiter's mark.
    assert!(waiter
        .try_lock_for(&k, Duration::from_millis(300))
        .unwrap()
        .is_none());
    let mut other = PgConnection::establish(&own.url).unwrap();
    other.batch_execute("BEGIN").unwrap();
    let n = diesel::sql_query(
        "UPDATE dlock_shared_keys SET intent_until = intent_until WHERE lock_key = $1",
    )
    .bind::<diesel::sql_types::Text, _>(&k)
    .execute(&mut other)
    .unwrap();
    assert_eq!(n, 1, "the key's header row");
    let (tx, rx) = mpsc::channel();
    let waiting = {
        let (waiter, k) = (waiter.clone(), k.clone());
        std::thread::spawn(move || {
            let r = waiter
                .try_lock_for(&k, Duration::from_secs(3))
                .map(|g| g.is_some());
            tx.send(()).unwrap();
            r
        })
    };
    // Until the waiter's mark waits for the open update's row lock.
    let mut watch = PgConnection::establish(&own.url).unwrap();
    let start = Instant::now();
    while diesel::sql_query(
        "SELECT count(*) AS n FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .get_result::<N>(&mut watch)
    .unwrap()
    .n == 0
    {
        assert!(
            rx.try_recv().is_err(),
            "the wait ended before it met the update"
        );
        assert!(start.elapsed() < Duration::from_secs(20), "never waited");
        std::thread::sleep(Duration::from_millis(2));
    }
    other.batch_execute("COMMIT").unwrap();
    match waiting.join().unwrap() {
        Ok(taken) => assert!(!taken, "taken while held"),
        Err(e) => panic!("the wait failed: {e}"),
    }
    drop(held);
    assert!(waiter
        .try_lock_for(&k, Duration::from_secs(3))
        .unwrap()
        .is_some());
}

/// With sessions at REPEATABLE READ, the first readers (and permit holders) of a key, each
/// with a `Locker` of its own, insert its kind (`dlock_shared_keys`) at once: an insert whose
/// ON CONFLICT met a row committed after its snapshot failed with a serialization failure,
/// which reached the caller (an adversary: 246 of 400 first `try_read_for`, 127 of 200
/// `try_permit_for`). Now run again: no caller sees an error.
#[cfg(feature = "postgres")]
#[test]
fn pg_first_readers_and_permits_at_repeatable_read() {
    use std::sync::Barrier;
    const THREADS: usize = 4;
    let Some((_own, h)) = pg_own_db_at_repeatable_read(4) else {
        return;
    };
    let mut errors = Vec::new();
    for round in 0..30 {
        let key = unique_key("kind-rr");
        let permit = round % 2 == 1;
        // Fresh Lockers: each asks for the key's kind once, at its first acquisition.
        let lockers: Vec<_> = (0..THREADS)
            .map(|_| h.locker(Strategy::ForUpdate))
            .collect();
        let barrier = Arc::new(Barrier::new(THREADS));
        let answers: Vec<_> = lockers
            .into_iter()
            .map(|l| {
                let (key, barrier) = (key.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let d = Duration::from_millis(300);
                    if permit {
                        l.try_permit_for(&key, 2, d).map(drop)
                    } else {
                        l.try_read_for(&key, d).map(drop)
                    }
                    .map_err(|e| format!("{e:?}"))
                })
            })
            .collect();
        for a in answers {
            if let Err(e) = a.join().unwrap() {
                errors.push(format!("round {round} (permit: {permit}): {e}"));
            }
        }
    }
    assert!(
        errors.is_empty(),
        "{} of {} first acquisitions failed: {:?}",
        errors.len(),
        30 * THREADS,
        &errors[..errors.len().min(3)]
    );
}

/// A database of the test's own (dropped with the first harness) whose sessions start at
/// REPEATABLE READ, and a harness of `size` connections on it, made after the change.
#[cfg(feature = "postgres")]
fn pg_own_db_at_repeatable_read(
    size: u32,
) -> Option<(Harness<diesel::PgConnection>, Harness<diesel::PgConnection>)> {
    use diesel::connection::SimpleConnection;
    use diesel::{Connection, PgConnection};
    let own = common::pg_own_db_sized(1)?;
    let name = common::database_name(&own.url);
    PgConnection::establish(&own.url)
        .unwrap()
        .batch_execute(&format!(
            "ALTER DATABASE {name} SET default_transaction_isolation = 'repeatable read'"
        ))
        .unwrap();
    let h = common::server_at::<PgConnection>(&own.url, size);
    Some((own, h))
}
