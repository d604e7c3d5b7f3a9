//! `Advisory` guards of one `Locker` share a few sessions (issue 25): many locks on a small
//! pool, each released on its own; a shared session ended from the server tells every guard
//! on it; a wait runs on a session of its own, so nothing waits behind it; a cancelled wait
//! ends only itself. PostgreSQL and MariaDB (the transaction-pooling PgBouncer of the test
//! services cannot keep session locks: `Advisory` does not apply there).
//!
//! "Another process" is another `Locker` with a pool of its own: other server sessions, which
//! is all the server sees of a process.

mod common;

use common::conformance::TestDb;
use common::{unique_key, Harness};
use diesel::sql_types::{BigInt, Text};
use diesel::{QueryableByName, RunQueryDsl};
use diesel_lock::{Cancel, Error, LockConnection, LockGuard, LockStatus, Locker, Strategy};
use std::collections::HashSet;
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// What the tests ask the server about advisory locks, from outside the holder.
trait Advisories: TestDb {
    /// The session holding `key`'s advisory lock, if any.
    fn holder(&mut self, key: &str) -> Option<i64>;
    /// Whether a session waits for `key`'s advisory lock.
    fn waiting(&mut self, key: &str) -> bool;
}

#[cfg(feature = "postgres")]
impl Advisories for diesel::PgConnection {
    fn holder(&mut self, key: &str) -> Option<i64> {
        let k = diesel_lock::key_hash(key);
        diesel::sql_query(
            "SELECT pid::int8 AS id FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid::int8 = $1 AND objid::int8 = $2 AND objsubid = 1",
        )
        .bind::<BigInt, _>(i64::from((k >> 32) as u32))
        .bind::<BigInt, _>(i64::from(k as u32))
        .get_result::<Id>(self)
        .ok()
        .map(|r| r.id)
    }
    fn waiting(&mut self, key: &str) -> bool {
        let k = diesel_lock::key_hash(key);
        diesel::sql_query(
            "SELECT count(*)::int8 AS id FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND classid::int8 = $1 AND objid::int8 = $2 AND objsubid = 1",
        )
        .bind::<BigInt, _>(i64::from((k >> 32) as u32))
        .bind::<BigInt, _>(i64::from(k as u32))
        .get_result::<Id>(self)
        .unwrap()
        .id
            > 0
    }
}

#[cfg(feature = "mysql")]
impl Advisories for diesel::MysqlConnection {
    // The tests' keys are plain (lowercase letters, digits, '-'): the lock name is the key.
    fn holder(&mut self, key: &str) -> Option<i64> {
        #[derive(QueryableByName)]
        struct Holder {
            #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
            id: Option<i64>,
        }
        diesel::sql_query("SELECT CAST(IS_USED_LOCK(?) AS SIGNED) AS id")
            .bind::<Text, _>(key)
            .get_result::<Holder>(self)
            .unwrap()
            .id
    }
    fn waiting(&mut self, key: &str) -> bool {
        // A session in GET_LOCK shows the state "User lock"; the statement's text carries
        // no key (a bound parameter), so any such session of this database counts.
        let _ = key;
        diesel::sql_query(
            "SELECT COUNT(*) AS id FROM information_schema.PROCESSLIST \
             WHERE STATE = 'User lock' AND DB = DATABASE()",
        )
        .get_result::<Id>(self)
        .unwrap()
        .id > 0
    }
}

fn advisory<C: LockConnection>(pool: &r2d2::Pool<diesel::r2d2::ConnectionManager<C>>) -> Locker<C> {
    let l = Locker::builder(pool.clone())
        .strategy(Strategy::Advisory)
        .build()
        .unwrap();
    l.migrate().unwrap();
    l
}

/// Connections of `pool` checked out now.
fn in_use<C: LockConnection>(pool: &r2d2::Pool<diesel::r2d2::ConnectionManager<C>>) -> u32 {
    let s = pool.state();
    s.connections - s.idle_connections
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < until, "{what}: not after 30 s");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// 60 guards on a pool of 8: at most 4 sessions hold them (checked by the server); releasing
/// one frees that key only; the others stay held against another `Locker`, and still check.
fn release_one_others_stay_held<C: TestDb + Advisories>(h: &Harness<C>) {
    let pool = common::pool::<C>(&h.url, 8);
    let l = advisory(&pool);
    let other = advisory(&h.pool);
    let keys: Vec<String> = (0..60).map(|i| unique_key(&format!("mux{i}"))).collect();
    let mut guards: Vec<Option<LockGuard<C>>> = keys
        .iter()
        .map(|k| Some(l.try_lock(k).unwrap().expect("free")))
        .collect();
    assert!(in_use(&pool) <= 4, "{} connections in use", in_use(&pool));
    let mut conn = h.pool.get().unwrap();
    let sessions: HashSet<i64> = keys
        .iter()
        .map(|k| conn.holder(k).expect("held on the server"))
        .collect();
    assert!(
        !sessions.is_empty() && sessions.len() <= 4,
        "{} sessions",
        sessions.len()
    );
    for i in [0usize, 31, 59] {
        guards[i].take().unwrap().release().unwrap();
        let g = other.try_lock(&keys[i]).unwrap().expect("released: free");
        g.release().unwrap();
        for (j, k) in keys.iter().enumerate() {
            if guards[j].is_some() {
                assert!(conn.holder(k).is_some(), "{k} lost with {}", keys[i]);
            }
        }
    }
    for (j, g) in guards.iter().enumerate() {
        if let Some(g) = g {
            g.check().unwrap();
            assert!(other.try_lock(&keys[j]).unwrap().is_none(), "{}", keys[j]);
        }
    }
    // A guard's own Locker does not take its key twice (the server would: reentrant).
    assert!(l.try_lock(&keys[1]).unwrap().is_none());
    drop(guards);
    for k in &keys {
        assert!(conn.holder(k).is_none(), "{k} still held");
    }
    assert_eq!(
        in_use(&pool),
        0,
        "the shared sessions went back to the pool"
    );
}

/// A shared session ended from the server (pg_terminate_backend, KILL): every guard on it
/// is told (watchers and `check`), its release says `LockLost`, every key can be taken by
/// another `Locker`, and this `Locker` goes on with a new session.
fn killed_session_tells_every_guard<C: TestDb + Advisories>(h: &Harness<C>) {
    // A pool of 2: one shared session holds all.
    let pool = common::pool::<C>(&h.url, 2);
    let l = advisory(&pool);
    let other = advisory(&h.pool);
    let keys: Vec<String> = (0..40).map(|i| unique_key(&format!("kill{i}"))).collect();
    let guards: Vec<LockGuard<C>> = keys.iter().map(|k| l.lock(k).unwrap()).collect();
    let mut conn = h.pool.get().unwrap();
    let ids: HashSet<i64> = keys.iter().map(|k| conn.holder(k).unwrap()).collect();
    assert_eq!(ids.len(), 1, "one shared session");
    let watches: Vec<_> = guards[..20].iter().map(|g| g.loss_watch()).collect();
    let (tx, rx) = mpsc::channel();
    for (i, g) in guards[20..30].iter().enumerate() {
        let tx = tx.clone();
        g.on_lost(move || tx.send(i).unwrap());
    }
    conn.kill_session(*ids.iter().next().unwrap());
    for (i, w) in watches.iter().enumerate() {
        assert_eq!(
            w.wait(Duration::from_secs(30)),
            LockStatus::Lost,
            "guard {i}"
        );
    }
    let told: HashSet<usize> = (0..10)
        .map(|_| rx.recv_timeout(Duration::from_secs(30)).expect("told"))
        .collect();
    assert_eq!(told.len(), 10);
    for g in &guards[30..] {
        assert!(matches!(g.check(), Err(Error::LockLost { .. })));
    }
    for (k, g) in keys.iter().zip(guards) {
        match g.release() {
            Err(Error::LockLost { key }) => assert_eq!(&key, k),
            other => panic!("expected LockLost, got {other:?}"),
        }
        other
            .try_lock(k)
            .unwrap()
            .expect("free once the session ended")
            .release()
            .unwrap();
    }
    let again = l
        .try_lock(&unique_key("after"))
        .unwrap()
        .expect("a new session");
    again.check().unwrap();
    again.release().unwrap();
}

/// A wait on one key runs on a session of its own: while it waits, the same `Locker` takes
/// and releases other keys (tries and uncontended `lock`s) without waiting behind it, and
/// its guards check; the wait then gets its key when the other `Locker` lets go.
fn nothing_waits_behind_a_wait<C: TestDb + Advisories>(h: &Harness<C>) {
    let pool = common::pool::<C>(&h.url, 4);
    let l = advisory(&pool);
    let other = advisory(&h.pool);
    let key = unique_key("waited");
    let held = other.lock(&key).unwrap();
    let kept: Vec<_> = (0..5)
        .map(|i| l.lock(&unique_key(&format!("kept{i}"))).unwrap())
        .collect();
    let (tx, rx) = mpsc::channel();
    let waiter = {
        let (l, key) = (l.clone(), key.clone());
        std::thread::spawn(move || {
            let g = l.lock(&key).unwrap();
            tx.send(()).unwrap();
            g
        })
    };
    let mut conn = h.pool.get().unwrap();
    wait_until("the waiter in the server's queue", || conn.waiting(&key));
    for i in 0..200 {
        let k = unique_key(&format!("busy{i}"));
        let g = if i % 2 == 0 {
            l.try_lock(&k).unwrap().expect("free")
        } else {
            l.lock(&k).unwrap()
        };
        g.check().unwrap();
        g.release().unwrap();
    }
    for g in &kept {
        g.check().unwrap();
    }
    assert!(rx.try_recv().is_err(), "the waiter got a held key");
    drop(held);
    rx.recv_timeout(Duration::from_secs(30))
        .expect("the waiter got it");
    let g = waiter.join().unwrap();
    g.check().unwrap();
    assert!(other.try_lock(&key).unwrap().is_none());
    // Its session joined the shared ones (room: a pool of 4 has 2): later tries may use it.
    for i in 0..20 {
        l.try_lock(&unique_key(&format!("after{i}")))
            .unwrap()
            .expect("free")
            .release()
            .unwrap();
    }
    g.release().unwrap();
    assert!(other.try_lock(&key).unwrap().is_some());
}

/// A cancelled wait ends only itself: the guards on the shared sessions stay held, and the
/// `Locker` goes on.
fn a_cancelled_wait_ends_only_itself<C: TestDb + Advisories>(h: &Harness<C>) {
    let pool = common::pool::<C>(&h.url, 4);
    let l = advisory(&pool);
    let other = advisory(&h.pool);
    let key = unique_key("cancelled");
    let _held = other.lock(&key).unwrap();
    let keys: Vec<String> = (0..10).map(|i| unique_key(&format!("stay{i}"))).collect();
    let guards: Vec<_> = keys.iter().map(|k| l.lock(k).unwrap()).collect();
    for round in 0..3 {
        let cancel = Cancel::new();
        let waiter = {
            let (l, key, cancel) = (l.clone(), key.clone(), cancel.clone());
            std::thread::spawn(move || l.try_lock_cancellable(&key, None, &cancel))
        };
        let mut conn = h.pool.get().unwrap();
        wait_until("the waiter in the server's queue", || conn.waiting(&key));
        cancel.cancel();
        assert!(matches!(waiter.join().unwrap(), Ok(None)), "round {round}");
        for (k, g) in keys.iter().zip(&guards) {
            g.check().unwrap();
            assert!(other.try_lock(k).unwrap().is_none(), "{k}");
        }
    }
    drop(guards);
    for k in &keys {
        assert!(other.try_lock(k).unwrap().is_some());
    }
}

/// 10⁴ locks held at once by one `Locker` on a pool of 8, at most 4 of its connections used;
/// another `Locker` finds each held, and free once released. (Not timed: see
/// examples/scale_report.)
fn ten_thousand_on_a_pool_of_eight<C: TestDb + Advisories>(h: &Harness<C>) {
    const N: usize = 10_000;
    let pool = common::pool::<C>(&h.url, 8);
    let l = advisory(&pool);
    let other = advisory(&h.pool);
    let base = unique_key("many");
    let keys: Vec<String> = (0..N).map(|i| format!("{base}-{i}")).collect();
    let guards: Vec<_> = keys.iter().map(|k| l.lock(k).unwrap()).collect();
    assert!(in_use(&pool) <= 4, "{} connections", in_use(&pool));
    for k in keys.iter().step_by(97) {
        assert!(other.try_lock(k).unwrap().is_none(), "{k}");
    }
    for g in guards.iter().step_by(101) {
        g.check().unwrap();
    }
    drop(guards);
    for k in keys.iter().step_by(97) {
        other
            .try_lock(k)
            .unwrap()
            .expect("released")
            .release()
            .unwrap();
    }
    assert_eq!(in_use(&pool), 0);
}

/// The first try after the shared session was ended from the server (before anything of
/// this `Locker` noticed) takes its key on another session: no error where nothing was held
/// (found by the adversary of the shared sessions).
fn a_try_after_a_kill_finds_another_session<C: TestDb + Advisories>(h: &Harness<C>) {
    let pool = common::pool::<C>(&h.url, 2);
    let l = advisory(&pool);
    let keys: Vec<String> = (0..5).map(|i| unique_key(&format!("tk{i}"))).collect();
    let guards: Vec<LockGuard<C>> = keys.iter().map(|k| l.lock(k).unwrap()).collect();
    let mut conn = h.pool.get().unwrap();
    let id = conn.holder(&keys[0]).unwrap();
    conn.kill_session(id);
    wait_until("the killed session's locks gone", || {
        conn.holder(&keys[0]).is_none()
    });
    for round in 0..3 {
        let g = l
            .try_lock(&unique_key(&format!("after{round}")))
            .unwrap_or_else(|e| panic!("round {round}: {e}"))
            .expect("free key");
        g.check().unwrap();
        g.release().unwrap();
    }
    for g in guards {
        assert!(matches!(g.release(), Err(Error::LockLost { .. })));
    }
}

/// A wait whose `Locker`'s pool is full (every connection in another wait) waits for a
/// connection until its deadline, as before the shared sessions: no pool error after the
/// second a new shared session may take to open (found by the adversary).
fn a_wait_on_a_full_pool_waits_for_a_connection<C: TestDb + Advisories>(h: &Harness<C>) {
    let pool = common::pool::<C>(&h.url, 2);
    let l = advisory(&pool);
    let other = advisory(&h.pool);
    let busy: Vec<String> = (0..2).map(|i| unique_key(&format!("busy{i}"))).collect();
    let mut held: Vec<_> = busy.iter().map(|k| other.lock(k).unwrap()).collect();
    let waiters: Vec<_> = busy
        .iter()
        .map(|k| {
            let (l, k) = (l.clone(), k.clone());
            std::thread::spawn(move || {
                l.try_lock_for(&k, Duration::from_secs(60))
                    .map(|g| g.is_some())
            })
        })
        .collect();
    let mut conn = h.pool.get().unwrap();
    wait_until("both waiters in the server's queue", || {
        busy.iter().all(|k| conn.waiting(k)) && in_use(&pool) == 2
    });
    let free = unique_key("free");
    let asked = Instant::now();
    let wait = {
        let (l, free) = (l.clone(), free.clone());
        std::thread::spawn(move || {
            l.try_lock_for(&free, Duration::from_secs(60))
                .map(|g| g.map(|g| g.release()))
        })
    };
    // Past the second a try may wait to open a shared session, the wait is still waiting.
    while asked.elapsed() < Duration::from_millis(2500) {
        assert!(
            !wait.is_finished(),
            "the wait ended at {:?}: {:?}",
            asked.elapsed(),
            wait.join()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(held.remove(0)); // a waiter gets its key, releases it: a connection comes back
    match wait.join().unwrap() {
        Ok(Some(Ok(()))) => {}
        other => panic!("expected the free key, got {other:?}"),
    }
    drop(held);
    for w in waiters {
        assert!(w.join().unwrap().unwrap());
    }
}

macro_rules! suite {
    ($module:ident, $harness:expr) => {
        mod $module {
            use super::*;
            #[test]
            fn release_one_others_stay_held() {
                if let Some(h) = $harness {
                    super::release_one_others_stay_held(&h);
                }
            }
            #[test]
            fn killed_session_tells_every_guard() {
                if let Some(h) = $harness {
                    super::killed_session_tells_every_guard(&h);
                }
            }
            #[test]
            fn nothing_waits_behind_a_wait() {
                if let Some(h) = $harness {
                    super::nothing_waits_behind_a_wait(&h);
                }
            }
            #[test]
            fn a_cancelled_wait_ends_only_itself() {
                if let Some(h) = $harness {
                    super::a_cancelled_wait_ends_only_itself(&h);
                }
            }
            #[test]
            fn a_try_after_a_kill_finds_another_session() {
                if let Some(h) = $harness {
                    super::a_try_after_a_kill_finds_another_session(&h);
                }
            }
            #[test]
            fn a_wait_on_a_full_pool_waits_for_a_connection() {
                if let Some(h) = $harness {
                    super::a_wait_on_a_full_pool_waits_for_a_connection(&h);
                }
            }
            #[test]
            fn ten_thousand_on_a_pool_of_eight() {
                if let Some(h) = $harness {
                    super::ten_thousand_on_a_pool_of_eight(&h);
                }
            }
        }
    };
}

#[cfg(feature = "postgres")]
suite!(pg, common::pg());
#[cfg(feature = "mysql")]
suite!(mysql, common::mysql());
