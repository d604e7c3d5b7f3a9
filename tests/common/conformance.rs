//! The checks every backend × strategy must pass, written once.

use super::{unique_key, Harness};
use diesel::connection::SimpleConnection;
use diesel::sql_types::{BigInt, Text};
use diesel::{QueryableByName, RunQueryDsl};
use diesel_lock::{Error, LockConnection, Locker, Strategy};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

#[derive(QueryableByName)]
pub struct Counter {
    #[diesel(sql_type = BigInt)]
    pub value: i64,
    #[diesel(sql_type = BigInt)]
    pub last_token: i64,
}

/// The server sessions behind connections: who is who, and ending one from outside, as an
/// operator (or a failover) would.
pub trait Sessions {
    /// This connection's server session id (PostgreSQL backend pid, MySQL connection id).
    fn session_id(&mut self) -> i64;
    /// Ends session `id` from this connection and returns once the server has done so.
    fn kill_session(&mut self, id: i64);
    /// The server session that holds `key` under session strategy `s`, looked up from
    /// another connection (behind a transaction pooler a connection's own id says nothing
    /// before its transaction begins).
    fn holder_session(&mut self, key: &str, s: Strategy) -> i64 {
        let _ = (key, s);
        unreachable!("only looked up through PgBouncer")
    }
}

impl Sessions for diesel::SqliteConnection {
    fn session_id(&mut self) -> i64 {
        unreachable!("sqlite has no server sessions")
    }
    fn kill_session(&mut self, _id: i64) {
        unreachable!("sqlite has no server sessions")
    }
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

#[cfg(feature = "postgres")]
impl Sessions for diesel::PgConnection {
    fn session_id(&mut self) -> i64 {
        diesel::sql_query("SELECT pg_backend_pid()::int8 AS id")
            .get_result::<Id>(self)
            .unwrap()
            .id
    }
    fn kill_session(&mut self, id: i64) {
        #[derive(QueryableByName)]
        struct Done {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            done: bool,
        }
        // With a timeout, pg_terminate_backend waits until the backend has exited.
        let done = diesel::sql_query("SELECT pg_terminate_backend($1::int4, 5000) AS done")
            .bind::<BigInt, _>(id)
            .get_result::<Done>(self)
            .unwrap();
        assert!(done.done, "backend {id} did not exit");
    }
    fn holder_session(&mut self, key: &str, s: Strategy) -> i64 {
        let q = match s {
            // The holder's transaction updated the row: its xmax is the holder's xid.
            Strategy::ForUpdate => diesel::sql_query(
                "SELECT l.pid::int8 AS id FROM dlock_for_update f JOIN pg_locks l \
                 ON l.locktype = 'transactionid' AND l.granted AND l.mode = 'ExclusiveLock' \
                 AND l.transactionid::text = f.xmax::text WHERE f.lock_key = $1",
            )
            .bind::<Text, _>(key)
            .get_result::<Id>(self),
            _ => {
                let k = diesel_lock::key_hash(key);
                diesel::sql_query(
                    "SELECT pid::int8 AS id FROM pg_locks WHERE locktype = 'advisory' \
                     AND granted AND classid::int8 = $1 AND objid::int8 = $2 AND objsubid = 1",
                )
                .bind::<BigInt, _>(i64::from((k >> 32) as u32))
                .bind::<BigInt, _>(i64::from(k as u32))
                .get_result::<Id>(self)
            }
        };
        q.unwrap_or_else(|e| panic!("no session holds {key:?}: {e}"))
            .id
    }
}

#[cfg(feature = "mysql")]
impl Sessions for diesel::MysqlConnection {
    fn session_id(&mut self) -> i64 {
        diesel::sql_query("SELECT CAST(CONNECTION_ID() AS SIGNED) AS id")
            .get_result::<Id>(self)
            .unwrap()
            .id
    }
    fn kill_session(&mut self, id: i64) {
        // KILL takes no placeholder; the id is an integer from the server.
        diesel::sql_query(format!("KILL CONNECTION {id}"))
            .execute(self)
            .unwrap();
        // KILL only marks the session: it ends (and rolls back, freeing its locks) when its
        // thread next looks. Wait for it to be gone, as PostgreSQL's kill waits for the exit.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let left = diesel::sql_query(
                "SELECT COUNT(*) AS id FROM information_schema.PROCESSLIST WHERE ID = ?",
            )
            .bind::<BigInt, _>(id)
            .get_result::<Id>(self)
            .unwrap()
            .id;
            if left == 0 {
                return;
            }
            assert!(
                std::time::Instant::now() < until,
                "session {id} still there 10 s after KILL"
            );
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
}

/// Test-only SQL per backend: a deliberately non-atomic counter, and a way to take a lock
/// away from its holder behind the library's back.
pub trait TestDb: LockConnection + Sessions {
    fn create_counter(&mut self);
    fn counter_init(&mut self, name: &str);
    fn counter_read(&mut self, name: &str) -> Counter;
    fn counter_write(&mut self, name: &str, value: i64, token: i64);
    /// Makes the current holder of `key` lose it, as a stale takeover or an expired lease
    /// followed by another holder would.
    fn steal(&mut self, key: &str);
    /// Deletes the holder row (a reader's or permit's) of `key` with token `token`, as a
    /// forced release of that holder alone would.
    fn delete_holder(&mut self, key: &str, token: i64);
    /// Makes the holder row of `key` with token `token` expired (its expiry set to its
    /// acquisition time), as a holder that missed its renewals would be.
    fn expire_holder(&mut self, key: &str, token: i64);
}

/// Implements `TestDb` for a concrete connection; `$ph` gives the n-th placeholder.
macro_rules! test_db {
    ($conn:ty, $ph:expr) => {
        impl TestDb for $conn {
            fn create_counter(&mut self) {
                self.batch_execute(
                    "CREATE TABLE IF NOT EXISTS dlock_test_counter (
                        name VARCHAR(255) PRIMARY KEY,
                        value BIGINT NOT NULL,
                        last_token BIGINT NOT NULL)",
                )
                .expect("create counter table");
            }

            fn counter_init(&mut self, name: &str) {
                let ph: fn(usize) -> String = $ph;
                diesel::sql_query(format!(
                    "INSERT INTO dlock_test_counter (name, value, last_token) VALUES ({}, 0, 0)",
                    ph(1)
                ))
                .bind::<Text, _>(name)
                .execute(self)
                .expect("init counter");
            }

            fn counter_read(&mut self, name: &str) -> Counter {
                let ph: fn(usize) -> String = $ph;
                diesel::sql_query(format!(
                    "SELECT value, last_token FROM dlock_test_counter WHERE name = {}",
                    ph(1)
                ))
                .bind::<Text, _>(name)
                .get_result(self)
                .expect("read counter")
            }

            fn counter_write(&mut self, name: &str, value: i64, token: i64) {
                let ph: fn(usize) -> String = $ph;
                diesel::sql_query(format!(
                    "UPDATE dlock_test_counter SET value = {}, last_token = {} WHERE name = {}",
                    ph(1),
                    ph(2),
                    ph(3)
                ))
                .bind::<BigInt, _>(value)
                .bind::<BigInt, _>(token)
                .bind::<Text, _>(name)
                .execute(self)
                .expect("write counter");
            }

            fn steal(&mut self, key: &str) {
                let ph: fn(usize) -> String = $ph;
                diesel::sql_query(format!("DELETE FROM dlock_rows WHERE lock_key = {}", ph(1)))
                    .bind::<Text, _>(key)
                    .execute(self)
                    .expect("steal row");
                diesel::sql_query(format!(
                    "UPDATE dlock_leases SET holder_id = 'thief' WHERE lock_key = {}",
                    ph(1)
                ))
                .bind::<Text, _>(key)
                .execute(self)
                .expect("steal lease");
            }

            fn delete_holder(&mut self, key: &str, token: i64) {
                let ph: fn(usize) -> String = $ph;
                let n = diesel::sql_query(format!(
                    "DELETE FROM dlock_shared_leases WHERE lock_key = {} AND token = {}",
                    ph(1),
                    ph(2)
                ))
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(token)
                .execute(self)
                .expect("delete holder");
                assert_eq!(n, 1, "one holder row of {key:?} with token {token}");
            }

            fn expire_holder(&mut self, key: &str, token: i64) {
                let ph: fn(usize) -> String = $ph;
                let n = diesel::sql_query(format!(
                    "UPDATE dlock_shared_leases SET expires_at = acquired_at \
                     WHERE lock_key = {} AND token = {}",
                    ph(1),
                    ph(2)
                ))
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(token)
                .execute(self)
                .expect("expire holder");
                assert_eq!(n, 1, "one holder row of {key:?} with token {token}");
            }
        }
    };
}

test_db!(diesel::SqliteConnection, |_| "?".to_owned());
#[cfg(feature = "postgres")]
test_db!(diesel::PgConnection, |n| format!("${n}"));
#[cfg(feature = "mysql")]
test_db!(diesel::MysqlConnection, |_| "?".to_owned());

fn other_locker<C: LockConnection>(h: &Harness<C>, s: Strategy) -> Locker<C> {
    h.builder(s).owner("other").build().unwrap()
}

pub fn try_lock_on_held_key_is_none<C: TestDb>(h: &Harness<C>, s: Strategy) {
    let l = h.locker(s);
    let key = unique_key("held");
    let g = l.try_lock(&key).unwrap().expect("free key");
    assert!(l.try_lock(&key).unwrap().is_none(), "not reentrant");
    assert!(other_locker(h, s).try_lock(&key).unwrap().is_none());
    drop(g);
}

pub fn drop_and_release_both_free_the_key<C: TestDb>(h: &Harness<C>, s: Strategy) {
    let l = h.locker(s);
    let other = other_locker(h, s);
    let key = unique_key("free");
    let g = l.lock(&key).unwrap();
    drop(g);
    let g = other.try_lock(&key).unwrap().expect("free after drop");
    g.release().unwrap();
    let g = l.try_lock(&key).unwrap().expect("free after release");
    g.check().unwrap();
    g.release().unwrap();
}

/// Strategies whose lock lives in a server session that the guard's connection keeps.
pub fn is_session(s: Strategy) -> bool {
    matches!(
        s,
        Strategy::ForUpdate | Strategy::Advisory | Strategy::AdvisoryXact
    )
}

/// A session strategy's lock is lost when its session ends: the holder is given a pool of
/// one connection, whose session id is learnt first, and that session is terminated from
/// another connection. The pool must then hand out a fresh connection that works.
///
/// Through a transaction pooler (a `dlock_pooler` URL) the holder's session is looked up by
/// its lock instead, and the fresh connection's session cannot be told apart (the pooler's
/// server sessions are shared), only shown to work.
pub fn session_lost<C: TestDb>(h: &Harness<C>, s: Strategy, key: &str) {
    let pooled = super::strip_pooler(&h.url).is_some();
    let pool = super::pool::<C>(&h.url, 1);
    let before = pool.get().unwrap().session_id();
    let l = Locker::builder(pool.clone()).strategy(s).build().unwrap();
    let g = l.lock(key).unwrap();
    g.check().unwrap();
    let id = if pooled {
        h.pool.get().unwrap().holder_session(key, s)
    } else {
        before
    };
    h.pool.get().unwrap().kill_session(id);
    assert!(matches!(g.check(), Err(Error::LockLost { .. })));
    match g.release() {
        Err(Error::LockLost { key: k }) => assert_eq!(k, key),
        other => panic!("expected LockLost, got {other:?}"),
    }
    let fresh = pool.get().unwrap().session_id();
    if !pooled {
        assert_ne!(fresh, id, "the dead connection went back to the pool");
    }
    let g = l
        .try_lock(key)
        .unwrap()
        .expect("free once its session ended");
    g.release().unwrap();
}

pub fn release_reports_a_lost_lock<C: TestDb>(h: &Harness<C>, s: Strategy) {
    if is_session(s) {
        return session_lost(h, s, &unique_key("lost"));
    }
    let l = h.locker(s);
    let key = unique_key("lost");
    let g = l.lock(&key).unwrap();
    g.check().unwrap();
    h.pool.get().unwrap().steal(&key);
    assert!(matches!(g.check(), Err(Error::LockLost { .. })));
    match g.release() {
        Err(Error::LockLost { key: k }) => assert_eq!(k, key),
        other => panic!("expected LockLost, got {other:?}"),
    }
}

pub fn try_lock_for_returns_at_its_deadline<C: TestDb>(h: &Harness<C>, s: Strategy) {
    let l = h.locker(s);
    let key = unique_key("deadline");
    let _g = l.lock(&key).unwrap();
    let other = other_locker(h, s);
    for timeout in [
        Duration::ZERO,
        Duration::from_millis(50),
        Duration::from_millis(300),
    ] {
        let start = Instant::now();
        assert!(other.try_lock_for(&key, timeout).unwrap().is_none());
        let took = start.elapsed();
        assert!(took >= timeout, "returned early: {took:?} < {timeout:?}");
        // Past the deadline a waiter in a key's line still leaves it: one commit, which a
        // server busy with other tests' fsyncs took up to 250 ms to make (MariaDB, seen 4
        // of 60 runs beside the suite: 466–544 ms for 300 ms); a waiter that kept waiting
        // would take far longer.
        assert!(
            took <= timeout + Duration::from_millis(400),
            "returned late: {took:?} for {timeout:?}"
        );
    }
}

pub fn waiter_gets_the_lock_when_it_is_released<C: TestDb>(h: &Harness<C>, s: Strategy) {
    for same_locker in [true, false] {
        let l = h.locker(s);
        let waiter_locker = if same_locker {
            l.clone()
        } else {
            other_locker(h, s)
        };
        let key = unique_key("handoff");
        let g = l.lock(&key).unwrap();
        let released = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let waiter = {
            let (key, released) = (key.clone(), released.clone());
            std::thread::spawn(move || {
                tx.send(()).unwrap();
                let g = waiter_locker.lock(&key).unwrap();
                assert!(released.load(Ordering::SeqCst), "acquired while still held");
                g.release().unwrap();
            })
        };
        rx.recv().unwrap();
        released.store(true, Ordering::SeqCst);
        g.release().unwrap();
        waiter.join().unwrap();
    }
}

/// `threads` threads, split over two `Locker`s (so both the in-process queue and the database
/// are exercised), each taking the lock `rounds` times and doing a read-sleep-write of a
/// counter in the database inside it. Any overlap loses an increment.
pub fn mutual_exclusion_across_threads<C: TestDb>(
    h: &Harness<C>,
    s: Strategy,
    threads: usize,
    rounds: usize,
) {
    let lockers = [h.locker(s), other_locker(h, s)];
    let key = unique_key("mutex");
    {
        let mut c = h.pool.get().unwrap();
        c.create_counter();
        c.counter_init(&key);
    }
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::with_capacity(threads * rounds)));
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let locker = lockers[t % 2].clone();
            let (key, inside, tokens, start) =
                (key.clone(), inside.clone(), tokens.clone(), start.clone());
            let pool = h.pool.clone();
            std::thread::spawn(move || {
                start.wait();
                for _ in 0..rounds {
                    let g = locker.lock(&key).unwrap();
                    assert_eq!(
                        inside.fetch_add(1, Ordering::SeqCst),
                        0,
                        "two holders at once"
                    );
                    {
                        let mut c = pool.get().unwrap();
                        let seen = c.counter_read(&key);
                        std::thread::sleep(Duration::from_micros(200)); // widen the race window
                        c.counter_write(&key, seen.value + 1, g.token());
                    }
                    tokens.lock().unwrap().push(g.token());
                    inside.fetch_sub(1, Ordering::SeqCst);
                    g.release().unwrap();
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
    let final_count = h.pool.get().unwrap().counter_read(&key).value;
    assert_eq!(final_count, (threads * rounds) as i64, "lost updates");
    let tokens = tokens.lock().unwrap();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens not strictly increasing in acquisition order"
    );
}

pub fn tokens_strictly_increase<C: TestDb>(h: &Harness<C>, s: Strategy) {
    let lockers = [h.locker(s), other_locker(h, s)];
    let key = unique_key("tokens");
    let mut last = i64::MIN;
    for i in 0..20 {
        let g = lockers[i % 2].lock(&key).unwrap();
        assert!(g.token() > last, "token {} after {last}", g.token());
        last = g.token();
    }
}

pub fn keys_are_exact_and_any_text_works<C: TestDb>(h: &Harness<C>, s: Strategy) {
    let l = h.locker(s);
    let base = unique_key("Key");
    let evil = format!("'; DROP TABLE dlock_rows; -- {base}");
    let unicode = format!("ключ-🔒-{base}");
    let long = format!("{base}{}", "x".repeat(255 - base.len()));
    let held: Vec<_> = [&base, &evil, &unicode, &long]
        .into_iter()
        .map(|k| {
            l.try_lock(k)
                .unwrap()
                .unwrap_or_else(|| panic!("{k:?} free"))
        })
        .collect();
    // Keys differing by case or trailing space are different keys.
    for k in [base.to_lowercase(), format!("{base} ")] {
        assert!(l.try_lock(&k).unwrap().is_some(), "{k:?} is its own key");
    }
    for (g, k) in held.iter().zip([&base, &evil, &unicode, &long]) {
        assert_eq!(g.key(), k.as_str());
        assert!(l.try_lock(k).unwrap().is_none());
    }
}

pub fn guard_reports_key_owner_and_db_time<C: TestDb>(h: &Harness<C>, s: Strategy) {
    let l = Locker::builder(h.pool.clone())
        .strategy(s)
        .owner("reporter")
        .build()
        .unwrap();
    l.migrate().unwrap();
    let key = unique_key("report");
    let g = l.lock(&key).unwrap();
    assert_eq!(g.key(), key);
    assert_eq!(g.owner(), "reporter");
    let skew = (chrono::Utc::now() - g.acquired_at()).num_seconds().abs();
    assert!(
        skew < 300,
        "acquired_at {} is far from now",
        g.acquired_at()
    );
    assert!(format!("{g:?}").contains(&key));
}

pub fn distinct_keys_do_not_block_each_other<C: TestDb>(h: &Harness<C>, s: Strategy) {
    let l = h.locker(s);
    let a = l.lock(&unique_key("a")).unwrap();
    let b = l
        .try_lock(&unique_key("b"))
        .unwrap()
        .expect("another key is free");
    drop((a, b));
}
