//! Waiting written once (issue 9): `try_lock_until`, cancelling a wait from another thread
//! (in the `Locker`'s queue, between polls, and in the server's lock queue, which only
//! ending the waiter's session can interrupt), a guard that outlives its `Locker`, and the
//! `Row` clean-up that stalled on a pool of one.

mod common;

use common::conformance::{is_session, Sessions};
use common::{unique_key, Harness};
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::BigInt;
use diesel::{QueryableByName, RunQueryDsl};
use diesel_lock::{Cancel, Error, LockConnection, Locker, Strategy};
use std::time::{Duration, Instant};

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Whether one of the sessions `ids` waits in the server's lock queue now.
trait ServerWaits: LockConnection + Sessions {
    fn waiting(&mut self, ids: &[i64]) -> bool;
}

impl ServerWaits for diesel::SqliteConnection {
    fn waiting(&mut self, _ids: &[i64]) -> bool {
        unreachable!("sqlite has no server-side waits")
    }
}

#[cfg(feature = "postgres")]
impl ServerWaits for diesel::PgConnection {
    fn waiting(&mut self, ids: &[i64]) -> bool {
        ids.iter().any(|&id| {
            diesel::sql_query("SELECT count(*) AS n FROM pg_locks WHERE NOT granted AND pid = $1")
                .bind::<BigInt, _>(id)
                .get_result::<Count>(self)
                .unwrap()
                .n
                > 0
        })
    }
}

#[cfg(feature = "mysql")]
impl ServerWaits for diesel::MysqlConnection {
    fn waiting(&mut self, ids: &[i64]) -> bool {
        ids.iter().any(|&id| {
            diesel::sql_query(
                "SELECT count(*) AS n FROM information_schema.PROCESSLIST \
                 WHERE ID = ? AND TIME_MS > 50 \
                   AND (INFO LIKE '%GET_LOCK%' OR INFO LIKE '%FOR UPDATE%')",
            )
            .bind::<BigInt, _>(id)
            .get_result::<Count>(self)
            .unwrap()
            .n > 0
        })
    }
}

/// A waiter with no deadline behind a holder in another `Locker` ends soon after `cancel`,
/// without the lock, and leaves nothing behind: the holder still holds, and once it releases
/// the key is free at once, for a `Locker` on the waiter's own (small) pool too.
fn cancel_ends_a_wait<C: ServerWaits>(h: &Harness<C>, s: Strategy) {
    let key = unique_key("cancel");
    let holder = h.locker(s);
    let held = holder.lock(&key).unwrap();
    // Session strategies: a pool of two (one connection waits, the other ends its session).
    let pool: Pool<ConnectionManager<C>> = if is_session(s) {
        common::pool(&h.url, 2)
    } else {
        h.pool.clone()
    };
    let ids = if is_session(s) {
        let (mut a, mut b) = (pool.get().unwrap(), pool.get().unwrap());
        vec![a.session_id(), b.session_id()]
    } else {
        Vec::new()
    };
    let waiter = Locker::builder(pool.clone()).strategy(s).build().unwrap();
    let cancel = Cancel::new();
    let thread = {
        let (waiter, cancel, key) = (waiter.clone(), cancel.clone(), key.clone());
        std::thread::spawn(move || waiter.try_lock_cancellable(&key, None, &cancel))
    };
    if is_session(s) {
        // Cancel only once the server shows the wait: only ending the session ends it.
        let mut watcher = h.pool.get().unwrap();
        let started = Instant::now();
        while !watcher.waiting(&ids) {
            assert!(started.elapsed() < Duration::from_secs(20), "never waited");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let cancelled = Instant::now();
    cancel.cancel();
    assert!(
        thread.join().unwrap().unwrap().is_none(),
        "a cancelled wait got the lock"
    );
    eprintln!(
        "{}: the wait ended {:?} after cancel",
        s.name(),
        cancelled.elapsed()
    );
    held.check().expect("the holder kept its lock");
    held.release().unwrap();
    // The ended session may still be on its way out of the server (KILL CONNECTION only
    // marks it), holding what its wait was granted at the release: give it a moment.
    let again = waiter
        .try_lock_for(&key, Duration::from_secs(5))
        .unwrap()
        .expect("the key is free");
    again.release().unwrap();
    // A cancelled handle cancels at once.
    assert!(waiter
        .try_lock_cancellable(&key, None, &cancel)
        .unwrap()
        .is_none());
}

/// A waiter cancelled while in the `Locker`'s own line, behind another thread of it.
fn cancel_ends_a_wait_in_the_local_queue<C: LockConnection>(h: &Harness<C>, s: Strategy) {
    let key = unique_key("cancel-queued");
    let locker = h.locker(s);
    let held = locker.lock(&key).unwrap();
    let first = {
        let (l, k) = (locker.clone(), key.clone());
        std::thread::spawn(move || {
            l.try_lock_for(&k, Duration::from_secs(30))
                .map(|g| g.is_some())
        })
    };
    let cancel = Cancel::new();
    let second = {
        let (l, k, c) = (locker.clone(), key.clone(), cancel.clone());
        std::thread::spawn(move || l.try_lock_cancellable(&k, None, &c).map(|g| g.is_some()))
    };
    cancel.cancel();
    assert!(
        !second.join().unwrap().unwrap(),
        "cancelled, yet got the lock"
    );
    held.release().unwrap();
    assert!(
        first.join().unwrap().unwrap(),
        "the other waiter kept its place"
    );
}

fn try_lock_until_returns_at_its_deadline<C: LockConnection>(h: &Harness<C>, s: Strategy) {
    let key = unique_key("until");
    let locker = h.locker(s);
    let _held = locker.lock(&key).unwrap();
    let other = h.locker(s);
    let start = Instant::now();
    let deadline = start + Duration::from_millis(300);
    assert!(other.try_lock_until(&key, deadline).unwrap().is_none());
    assert!(Instant::now() >= deadline, "gave up before its deadline");
    assert!(
        other.try_lock_until(&key, start).unwrap().is_none(),
        "a past deadline is one try"
    );
}

/// The session ids of every connection `pool` can have (it opens all of them).
fn session_ids<C: ServerWaits>(pool: &Pool<ConnectionManager<C>>) -> Vec<i64> {
    let mut conns: Vec<_> = (0..pool.max_size()).map(|_| pool.get().unwrap()).collect();
    conns.iter_mut().map(|c| c.session_id()).collect()
}

/// A cancellation ends a waiting session only while its wait is under way. One `Cancel`
/// shared by several waits runs its hooks one after another; here three of them first wait
/// a second each for a connection (their pools have none free), so the fourth wait has long
/// been granted, released (it was cancelled) and its connection reused for another lock
/// before its hook runs. Before: that hook ended the session now holding "other" (a live
/// guard lost its lock and a second guard got the key: found by the adversary, 12 of 18
/// rounds). After: the late hook does nothing.
fn a_late_cancellation_spares_a_session_that_moved_on<C: ServerWaits>(h: &Harness<C>, s: Strategy) {
    let keys: Vec<String> = (0..4)
        .map(|i| unique_key(&format!("moved-on-{i}")))
        .collect();
    let other = unique_key("moved-on-other");
    let holder = h.locker(s);
    let held: Vec<_> = keys.iter().map(|k| holder.lock(k).unwrap()).collect();
    let cancel = Cancel::new();
    let mut ids = Vec::new();
    let mut slow = Vec::new();
    for key in &keys[..3] {
        let pool: Pool<ConnectionManager<C>> = Pool::builder()
            .max_size(1)
            .connection_timeout(Duration::from_secs(1))
            .build(ConnectionManager::new(&h.url))
            .unwrap();
        ids.extend(session_ids(&pool));
        let l = Locker::builder(pool).strategy(s).build().unwrap();
        let (c, k) = (cancel.clone(), key.clone());
        slow.push(std::thread::spawn(move || {
            l.try_lock_cancellable(&k, None, &c)
        }));
    }
    let pool: Pool<ConnectionManager<C>> = common::pool(&h.url, 3);
    ids.extend(session_ids(&pool));
    let lb = Locker::builder(pool).strategy(s).build().unwrap();
    let (granted_tx, granted_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let b = {
        let (c, k, other) = (cancel.clone(), keys[3].clone(), other.clone());
        std::thread::spawn(move || {
            assert!(lb.try_lock_cancellable(&k, None, &c).unwrap().is_none());
            let g2 = lb.try_lock(&other).unwrap().expect("other is free");
            granted_tx.send(()).unwrap();
            done_rx.recv().unwrap();
            g2.check().map(|()| g2)
        })
    };
    let mut watcher = h.pool.get().unwrap();
    let since = Instant::now();
    while ids.iter().filter(|&&id| watcher.waiting(&[id])).count() < 4 {
        assert!(
            since.elapsed() < Duration::from_secs(20),
            "the waits never began"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let canceller = {
        let c = cancel.clone();
        std::thread::spawn(move || c.cancel())
    };
    // The wait is cancelled before it is granted (its hook may still be to come): a grant
    // racing ahead of `cancel` would be an ordinary acquisition, not this scenario.
    while !cancel.is_cancelled() {
        assert!(since.elapsed() < Duration::from_secs(20), "never cancelled");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut held = held;
    held.pop().unwrap().release().unwrap(); // the fourth wait is granted, then gives it back
    granted_rx.recv().unwrap();
    canceller.join().unwrap(); // every hook has run, the late ones too
                               // The three slow waits could not be reached (no connection was free to end their
                               // sessions): granted now, they see the cancellation and give the locks back.
    drop(held);
    for w in slow {
        assert!(w.join().unwrap().unwrap().is_none());
    }
    done_tx.send(()).unwrap();
    let g2 = b
        .join()
        .unwrap()
        .expect("a late cancellation ended a session that moved on");
    assert!(
        h.locker(s).try_lock(&other).unwrap().is_none(),
        "two guards on one key"
    );
    g2.release().unwrap();
}

#[cfg(feature = "postgres")]
#[test]
fn pg_a_late_cancellation_spares_a_session_that_moved_on() {
    if let Some(h) = common::pg() {
        for s in [
            Strategy::Advisory,
            Strategy::ForUpdate,
            Strategy::AdvisoryXact,
        ] {
            a_late_cancellation_spares_a_session_that_moved_on(&h, s);
        }
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_a_late_cancellation_spares_a_session_that_moved_on() {
    if let Some(h) = common::mysql() {
        for s in [Strategy::Advisory, Strategy::ForUpdate] {
            a_late_cancellation_spares_a_session_that_moved_on(&h, s);
        }
    }
}

macro_rules! waiting_tests {
    ($module:ident, $harness:expr, $strategy:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn cancel_ends_a_wait() {
                let Some(h) = $harness else { return };
                super::cancel_ends_a_wait(&h, $strategy);
            }

            #[test]
            fn cancel_ends_a_wait_in_the_local_queue() {
                let Some(h) = $harness else { return };
                super::cancel_ends_a_wait_in_the_local_queue(&h, $strategy);
            }

            #[test]
            fn try_lock_until_returns_at_its_deadline() {
                let Some(h) = $harness else { return };
                super::try_lock_until_returns_at_its_deadline(&h, $strategy);
            }
        }
    };
}

const ROW: Strategy = Strategy::Row {
    stale_after: Some(Duration::from_secs(60)),
};
const LEASE: Strategy = Strategy::Lease {
    ttl: Duration::from_secs(10),
};

#[cfg(feature = "sqlite")]
waiting_tests!(sqlite_row, common::sqlite(), ROW);
#[cfg(feature = "sqlite")]
waiting_tests!(sqlite_lease, common::sqlite(), LEASE);
#[cfg(feature = "postgres")]
waiting_tests!(pg_row, common::pg(), ROW);
#[cfg(feature = "postgres")]
waiting_tests!(pg_lease, common::pg(), LEASE);
#[cfg(feature = "postgres")]
waiting_tests!(pg_for_update, common::pg(), Strategy::ForUpdate);
#[cfg(feature = "postgres")]
waiting_tests!(pg_advisory, common::pg(), Strategy::Advisory);
#[cfg(feature = "postgres")]
waiting_tests!(pg_advisory_xact, common::pg(), Strategy::AdvisoryXact);
#[cfg(feature = "mysql")]
waiting_tests!(mysql_row, common::mysql(), ROW);
#[cfg(feature = "mysql")]
waiting_tests!(mysql_lease, common::mysql(), LEASE);
#[cfg(feature = "mysql")]
waiting_tests!(mysql_for_update, common::mysql(), Strategy::ForUpdate);
#[cfg(feature = "mysql")]
waiting_tests!(mysql_advisory, common::mysql(), Strategy::Advisory);

/// The guard keeps what its lease needs, not the `Locker`: dropped first, the `Locker` no
/// longer ends the renewals of a guard that outlives it.
#[cfg(feature = "sqlite")]
#[test]
fn a_lease_outliving_its_locker_is_still_renewed() {
    let h = common::sqlite().unwrap();
    let key = unique_key("outlives");
    let locker = Locker::builder(h.pool.clone())
        .strategy(Strategy::Lease {
            ttl: Duration::from_millis(600),
        })
        .build()
        .unwrap();
    locker.migrate().unwrap();
    let guard = locker.lock(&key).unwrap();
    drop(locker);
    // Three ttls: without renewals the lease would have expired twice over.
    std::thread::sleep(Duration::from_millis(1800));
    guard.check().expect("renewed after its Locker was dropped");
    guard.release().unwrap();
}

/// A `Row` acquisition failing before anything was inserted (here: no tables yet) cleaned up
/// on a second pooled connection while holding the first: on a pool of one it waited the
/// pool's whole `connection_timeout` (30 s here) before reporting `MissingTable`.
#[cfg(feature = "sqlite")]
#[test]
fn a_failed_row_acquisition_does_not_wait_for_a_second_connection() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("empty.db");
    let pool = Pool::builder()
        .max_size(1)
        .connection_timeout(Duration::from_secs(30))
        .connection_customizer(Box::new(diesel_lock::SqliteTuning::default()))
        .build(ConnectionManager::<diesel::SqliteConnection>::new(
            url.to_str().unwrap(),
        ))
        .unwrap();
    let locker = Locker::builder(pool).strategy(ROW).build().unwrap();
    let start = Instant::now();
    let e = locker.try_lock("k").unwrap_err();
    assert!(matches!(e, Error::MissingTable(_)), "{e:?}");
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "took {:?}: waited for a second connection",
        start.elapsed()
    );
}

/// A wait cancelled while it waits for a pooled connection (every connection held by the
/// session strategies' guards) returns `Ok(None)` soon, not `Error::Pool` at the end of its
/// patience (found by the adversary: 8 s, then `Error::Pool`).
fn a_wait_for_a_connection_is_cancelled_too<C: LockConnection>(url: &str, s: Strategy) {
    let pool: Pool<ConnectionManager<C>> = Pool::builder()
        .max_size(1)
        .min_idle(Some(0))
        .connection_timeout(Duration::from_secs(20))
        .build(ConnectionManager::new(url))
        .unwrap();
    let locker = Locker::builder(pool).strategy(s).build().unwrap();
    let _held = locker.lock(&unique_key("only-connection")).unwrap();
    let cancel = Cancel::new();
    let waiter = {
        let (l, c) = (locker.clone(), cancel.clone());
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            l.try_lock_cancellable(&unique_key("other"), Some(deadline), &c)
        })
    };
    cancel.cancel();
    let started = Instant::now();
    let r = waiter.join().unwrap();
    assert!(matches!(r, Ok(None)), "{r:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waited {:?} for a connection after the cancel",
        started.elapsed()
    );
}

#[cfg(feature = "postgres")]
#[test]
fn pg_a_wait_for_a_connection_is_cancelled_too() {
    if let Some(h) = common::pg() {
        a_wait_for_a_connection_is_cancelled_too::<diesel::PgConnection>(
            &h.url,
            Strategy::Advisory,
        );
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_a_wait_for_a_connection_is_cancelled_too() {
    if let Some(h) = common::mysql() {
        a_wait_for_a_connection_is_cancelled_too::<diesel::MysqlConnection>(
            &h.url,
            Strategy::ForUpdate,
        );
    }
}

/// A SQLite pool without WAL and a busy timeout is refused: with it, a lock's commit could
/// fail after its statement returned the lock (found by the adversary: 11 overlaps and 9
/// tokens issued twice in 10 s, 16 threads, Row; 44 and 27 with Lease).
#[cfg(feature = "sqlite")]
#[test]
fn a_sqlite_pool_without_tuning_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("bare.db");
    let bare = Pool::builder()
        .max_size(1)
        .build(ConnectionManager::<diesel::SqliteConnection>::new(
            url.to_str().unwrap(),
        ))
        .unwrap();
    for s in [ROW, LEASE] {
        match Locker::builder(bare.clone()).strategy(s).build() {
            Err(Error::InvalidConfig(why)) => assert!(why.contains("SqliteTuning"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
    let tuned = Pool::builder()
        .max_size(1)
        .connection_customizer(Box::new(diesel_lock::SqliteTuning::default()))
        .build(ConnectionManager::<diesel::SqliteConnection>::new(
            url.to_str().unwrap(),
        ))
        .unwrap();
    Locker::builder(tuned).strategy(LEASE).build().unwrap();
}
