//! Short write transactions that wait for SQLite's write lock at the scale of microseconds.
//!
//! SQLite has no queue for its single write lock: a writer that finds it taken calls the
//! busy handler, whose default (`busy_timeout`) sleeps 1, 2, 5, 10, 15, 20, 25 … 100 ms
//! between tries. The line's statements (a hand-over, a confirmation, a place taken or
//! given up) are writes of tens of microseconds, and they meet each other at every hand-over:
//! the releaser takes its next place while the head it woke confirms. Measured with 8
//! processes on one key for 4 s (`examples/wait_report.rs`, about 5,000 hand-overs; `perf
//! trace` of the sleeps): the busy handler slept 1,100–2,100 times, 2–5 s in all, and a
//! process whose tries kept colliding slept ever longer while the others went round without
//! it (fairness 0.31–0.66 with `Row`); with this, 40–170 times (the writes left to the
//! handler: releases and acquisitions outside the line, renewals of leases), 0.7–1.2 s, and
//! fairness 0.86–0.99. Here such a transaction runs with the busy handler off
//! (`PRAGMA busy_timeout = 0`: a taken lock fails the `BEGIN IMMEDIATE` at once, before any
//! statement ran) and is tried again after a pause that starts at a yield and doubles from
//! 16 µs up to `MAX_PAUSE` (after `FAST_FOR`, up to `SLOW_PAUSE`), for as long as the
//! connection's own `busy_timeout` (then the busy error, as before); the timeout is put back
//! before returning.

use diesel::connection::SimpleConnection;
use diesel::sqlite::SqliteConnection;
use diesel::{QueryResult, RunQueryDsl};
use std::time::{Duration, Instant};

/// The longest pause between tries for the first `FAST_FOR` of a wait: a hand-over's
/// writes wait for each other for well under that.
const MAX_PAUSE: Duration = Duration::from_micros(250);

/// How long the tries stay at most `MAX_PAUSE` apart.
const FAST_FOR: Duration = Duration::from_millis(20);

/// The longest pause after `FAST_FOR`: a writer held up by a long transaction (a purge, a
/// migration, a stopped process) tries about 200 times a second, not 4,000 (8 such waiters
/// used 1.63 CPU-seconds in 4 s at 250 µs, found by an adversary).
const SLOW_PAUSE: Duration = Duration::from_millis(5);

#[derive(diesel::QueryableByName)]
struct Timeout {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    timeout: i64,
}

/// Runs `f` in an IMMEDIATE transaction, waiting for the write lock at µs scale (see the
/// module's comment); inside a transaction of the caller's (`admin::force_release`), in a
/// savepoint of it, as before.
pub(super) fn short_write<T>(
    conn: &mut SqliteConnection,
    mut f: impl FnMut(&mut SqliteConnection) -> QueryResult<T>,
) -> QueryResult<T> {
    use diesel::connection::{AnsiTransactionManager, TransactionManager};
    let depth = AnsiTransactionManager::transaction_manager_status_mut(conn).transaction_depth()?;
    if depth.is_some() {
        return diesel::Connection::transaction(conn, f);
    }
    // Read each time (not cached: SQLite evaluates this pragma when preparing it): the pool's
    // connections may have been given any timeout.
    let timeout = diesel::sql_query("PRAGMA busy_timeout")
        .get_result::<Timeout>(conn)?
        .timeout;
    if timeout <= 0 {
        return conn.immediate_transaction(f);
    }
    conn.batch_execute("PRAGMA busy_timeout = 0")?;
    let limit = Duration::from_millis(u64::try_from(timeout).unwrap_or(0));
    let start = Instant::now();
    let tried = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut pause = Duration::ZERO;
        loop {
            match conn.immediate_transaction(&mut f) {
                Err(e) if busy(&e) && start.elapsed() < limit => {
                    if pause.is_zero() {
                        std::thread::yield_now();
                        pause = Duration::from_micros(16);
                    } else {
                        std::thread::sleep(crate::backoff::jitter(pause));
                        let cap = if start.elapsed() < FAST_FOR {
                            MAX_PAUSE
                        } else {
                            SLOW_PAUSE
                        };
                        pause = (pause * 2).min(cap);
                    }
                }
                r => return r,
            }
        }
    }));
    // PRAGMA takes no bound parameters: the value is the integer SQLite itself gave above.
    let restored = conn.batch_execute(&format!("PRAGMA busy_timeout = {timeout}"));
    if let Err(e) = restored {
        // Not an error of `f`, which may have committed (a release, a grant): the
        // connection's writes fail at once when busy from now on, which every caller counts
        // as contention and tries again.
        log::warn!("SQLite: could not put busy_timeout back to {timeout} ms ({e})");
    }
    match tried {
        Ok(r) => r,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// SQLITE_BUSY or SQLITE_LOCKED: another connection holds the write lock.
fn busy(e: &diesel::result::Error) -> bool {
    matches!(e, diesel::result::Error::DatabaseError(_, info)
        if info.message().contains("database is locked")
            || info.message().contains("database table is locked"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use diesel::Connection;
    use std::sync::mpsc;

    fn open(path: &str, timeout_ms: u32) -> SqliteConnection {
        let mut c = SqliteConnection::establish(path).unwrap();
        c.batch_execute("PRAGMA journal_mode = WAL").unwrap();
        // PRAGMA takes no parameters; a test's own integer.
        c.batch_execute(&format!("PRAGMA busy_timeout = {timeout_ms}"))
            .unwrap();
        c
    }

    fn timeout(c: &mut SqliteConnection) -> i64 {
        diesel::sql_query("PRAGMA busy_timeout")
            .get_result::<Timeout>(c)
            .unwrap()
            .timeout
    }

    /// A write lock held by another connection for a while is waited for (a busy timeout
    /// of 0 would fail at once), and the connection's own timeout is back afterwards.
    #[test]
    fn waits_for_the_write_lock_and_puts_the_timeout_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("busy.db").to_str().unwrap().to_owned();
        let mut c = open(&path, 1234);
        c.batch_execute("CREATE TABLE t (n INTEGER)").unwrap();
        let (held, release) = (mpsc::channel(), mpsc::channel::<()>());
        let other = {
            let path = path.clone();
            std::thread::spawn(move || {
                let mut o = open(&path, 1234);
                o.batch_execute("BEGIN IMMEDIATE").unwrap();
                held.0.send(()).unwrap();
                release.1.recv().unwrap();
                o.batch_execute("INSERT INTO t VALUES (1); COMMIT").unwrap();
            })
        };
        held.1.recv().unwrap();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            release.0.send(()).unwrap();
        });
        let start = Instant::now();
        let mut tries = 0;
        let n = short_write(&mut c, |c| {
            tries += 1;
            c.batch_execute("INSERT INTO t VALUES (2)")?;
            diesel::sql_query("SELECT COUNT(*) AS timeout FROM t").get_result::<Timeout>(c)
        })
        .unwrap()
        .timeout;
        assert!(
            start.elapsed() >= Duration::from_millis(25),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(n, 2, "ran after the other's commit");
        assert_eq!(tries, 1, "the transaction's body ran once");
        assert_eq!(timeout(&mut c), 1234);
        other.join().unwrap();
        releaser.join().unwrap();
    }

    /// A write lock that stays taken: the busy error after the connection's own timeout,
    /// not sooner, and that timeout back.
    #[test]
    fn gives_up_after_the_connections_busy_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("busy.db").to_str().unwrap().to_owned();
        let mut c = open(&path, 80);
        c.batch_execute("CREATE TABLE t (n INTEGER)").unwrap();
        let mut o = open(&path, 80);
        o.batch_execute("BEGIN IMMEDIATE").unwrap();
        let start = Instant::now();
        let e = short_write(&mut c, |c| c.batch_execute("INSERT INTO t VALUES (1)")).unwrap_err();
        assert!(busy(&e), "{e}");
        assert!(
            start.elapsed() >= Duration::from_millis(80),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(timeout(&mut c), 80);
        o.batch_execute("ROLLBACK").unwrap();
        // Inside a transaction of the caller's: a savepoint, the timeout untouched.
        c.transaction(|c| {
            short_write(c, |c| c.batch_execute("INSERT INTO t VALUES (1)"))?;
            assert_eq!(timeout(c), 80);
            diesel::QueryResult::Ok(())
        })
        .unwrap();
    }
}
