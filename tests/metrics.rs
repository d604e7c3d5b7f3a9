//! Metrics (feature `metrics`) against a scripted sequence on every backend and strategy:
//! acquisitions, contended attempts, calls that ended without the lock, time waited and
//! held, locks held now, losses (a forced release, or the session ended by the server) and
//! a release failure (no pooled connection for a `Row` release), read from metrics-util's
//! `DebuggingRecorder`, labelled by strategy and backend. One test function, because the
//! recorder is global to the process and its snapshots reset what they read.

mod common;

use common::conformance::TestDb;
use common::{unique_key, Harness};
use diesel::r2d2::{ConnectionManager, Pool};
use diesel_lock::{admin, LockStatus, Locker, Strategy};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use std::collections::HashMap;
use std::time::Duration;

/// What one snapshot says for one strategy × backend: counters and gauges by name, and the
/// number of values recorded by each histogram.
fn read(snap: &Snapshotter, strategy: &str, backend: &str) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for (ck, _, _, value) in snap.snapshot().into_vec() {
        let key = ck.key();
        let label = |n: &str| {
            key.labels()
                .find(|l| l.key() == n)
                .map(|l| l.value().to_owned())
        };
        assert!(
            key.labels()
                .all(|l| l.key() == "strategy" || l.key() == "backend"),
            "{key:?}"
        );
        if label("strategy").as_deref() != Some(strategy)
            || label("backend").as_deref() != Some(backend)
        {
            continue;
        }
        let v = match value {
            DebugValue::Counter(c) => c as f64,
            DebugValue::Gauge(g) => g.into_inner(),
            DebugValue::Histogram(h) => h.len() as f64,
        };
        out.insert(key.name().to_owned(), v);
    }
    out
}

fn get(m: &HashMap<String, f64>, name: &str) -> f64 {
    m.get(name).copied().unwrap_or(0.0)
}

fn scripted<C: TestDb>(snap: &Snapshotter, h: &Harness<C>, backend: &str, sessions: bool) {
    let mut strategies = vec![
        Strategy::Row { stale_after: None },
        Strategy::Lease {
            ttl: Duration::from_secs(3),
        },
    ];
    if sessions {
        strategies.extend([Strategy::ForUpdate, Strategy::Advisory]);
    }
    for s in strategies {
        let name = s.name();
        let session = common::conformance::is_session(s);
        // The holder on a pool of its own, so that its session can be found and ended.
        let pool = if session {
            common::pool::<C>(&h.url, 1)
        } else {
            h.pool.clone()
        };
        let l = Locker::builder(pool.clone()).strategy(s).build().unwrap();
        l.migrate().unwrap();
        let other = h.locker(s);
        read(snap, name, backend); // from zero

        let key = unique_key("metered");
        let session_id = session.then(|| pool.get().unwrap().session_id());
        let g = l.lock(&key).unwrap();
        assert!(other.try_lock(&key).unwrap().is_none());
        assert!(other
            .try_lock_for(&key, Duration::from_millis(200))
            .unwrap()
            .is_none());
        let m = read(snap, name, backend);
        assert_eq!(
            get(&m, "dlock_acquisitions_total"),
            1.0,
            "{backend} {name}: {m:?}"
        );
        assert_eq!(
            get(&m, "dlock_not_acquired_total"),
            2.0,
            "{backend} {name}: {m:?}"
        );
        assert!(
            get(&m, "dlock_contended_attempts_total") >= 2.0,
            "{backend} {name}: {m:?}"
        );
        assert_eq!(
            get(&m, "dlock_wait_seconds"),
            1.0,
            "{backend} {name}: {m:?}"
        );
        assert_eq!(get(&m, "dlock_locks_held"), 1.0, "{backend} {name}: {m:?}");
        assert_eq!(
            get(&m, "dlock_losses_total"),
            0.0,
            "{backend} {name}: {m:?}"
        );

        // Lost: the session ended by the server, or the lock removed by force.
        match session_id {
            Some(id) => h.pool.get().unwrap().kill_session(id),
            None => {
                admin::force_release(&mut *h.pool.get().unwrap(), &key).unwrap();
            }
        }
        assert!(
            g.wait_lost(Duration::from_secs(5)),
            "{backend} {name}: not told"
        );
        assert!(g.release().is_err());
        let m = read(snap, name, backend);
        assert_eq!(
            get(&m, "dlock_losses_total"),
            1.0,
            "{backend} {name}: {m:?}"
        );
        assert_eq!(get(&m, "dlock_locks_held"), -1.0, "{backend} {name}: {m:?}");
        assert_eq!(
            get(&m, "dlock_held_seconds"),
            1.0,
            "{backend} {name}: {m:?}"
        );
        assert_eq!(
            get(&m, "dlock_release_failures_total"),
            0.0,
            "a loss is not a failure"
        );

        // A normal cycle: nothing lost, nothing held after.
        for _ in 0..3 {
            l.lock(&unique_key("metered")).unwrap().release().unwrap();
        }
        let m = read(snap, name, backend);
        assert_eq!(
            get(&m, "dlock_acquisitions_total"),
            3.0,
            "{backend} {name}: {m:?}"
        );
        assert_eq!(
            get(&m, "dlock_contended_attempts_total"),
            0.0,
            "{backend} {name}: {m:?}"
        );
        assert_eq!(get(&m, "dlock_locks_held"), 0.0, "{backend} {name}: {m:?}");
        assert_eq!(
            get(&m, "dlock_held_seconds"),
            3.0,
            "{backend} {name}: {m:?}"
        );
        assert_eq!(
            get(&m, "dlock_losses_total"),
            0.0,
            "{backend} {name}: {m:?}"
        );
    }
}

/// A `Row` release that finds no pooled connection (the pool's only one taken) fails: a
/// release failure, not a loss.
fn release_failure<C: TestDb>(snap: &Snapshotter, pool: Pool<ConnectionManager<C>>, backend: &str) {
    let l = Locker::builder(pool.clone())
        .strategy(Strategy::Row { stale_after: None })
        .build()
        .unwrap();
    l.migrate().unwrap();
    read(snap, "row", backend);
    let key = unique_key("unreleased");
    let g = l.lock(&key).unwrap();
    let taken = pool.get().unwrap();
    assert!(g.release().is_err());
    drop(taken);
    let m = read(snap, "row", backend);
    assert_eq!(
        get(&m, "dlock_release_failures_total"),
        1.0,
        "{backend}: {m:?}"
    );
    assert_eq!(get(&m, "dlock_losses_total"), 0.0, "{backend}: {m:?}");
    assert_eq!(get(&m, "dlock_locks_held"), 0.0, "{backend}: {m:?}");
    admin::force_release(&mut *pool.get().unwrap(), &key).unwrap();
}

/// `lock_all` counts one acquisition per key it takes (and, when a later key is held, the
/// earlier keys it took and gave back, plus one acquisition not made); readers and permits
/// count as acquisitions of their `Locker`'s strategy.
fn kinds_and_lock_all<C: TestDb>(snap: &Snapshotter, h: &Harness<C>, backend: &str) {
    let l = h.locker(Strategy::Lease {
        ttl: Duration::from_secs(10),
    });
    read(snap, "lease", backend); // from zero
    let keys = [
        unique_key("all-a"),
        unique_key("all-b"),
        unique_key("all-c"),
    ];
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let all = l.lock_all(&refs).unwrap();
    let m = read(snap, "lease", backend);
    assert_eq!(get(&m, "dlock_acquisitions_total"), 3.0, "{backend}: {m:?}");
    assert_eq!(get(&m, "dlock_locks_held"), 3.0, "{backend}: {m:?}");
    drop(all);
    let m = read(snap, "lease", backend);
    assert_eq!(get(&m, "dlock_locks_held"), -3.0, "{backend}: {m:?}");
    assert_eq!(get(&m, "dlock_held_seconds"), 3.0, "{backend}: {m:?}");

    // The second key held elsewhere: the first is taken and given back.
    let other = h.locker(Strategy::Lease {
        ttl: Duration::from_secs(10),
    });
    let g = other.lock(&keys[1]).unwrap();
    read(snap, "lease", backend);
    assert!(l.try_lock_all(&refs).unwrap().is_none());
    let m = read(snap, "lease", backend);
    assert_eq!(get(&m, "dlock_acquisitions_total"), 1.0, "{backend}: {m:?}");
    assert_eq!(get(&m, "dlock_not_acquired_total"), 1.0, "{backend}: {m:?}");
    assert_eq!(get(&m, "dlock_locks_held"), 0.0, "{backend}: {m:?}");
    drop(g);

    let r = l.read(&unique_key("metered-read")).unwrap();
    let p = l.permit(&unique_key("metered-permit"), 2).unwrap();
    let m = read(snap, "lease", backend);
    assert_eq!(get(&m, "dlock_acquisitions_total"), 2.0, "{backend}: {m:?}");
    assert_eq!(get(&m, "dlock_locks_held"), 1.0, "{backend}: {m:?}");
    drop((r, p));
}

fn tiny<C: TestDb>(b: r2d2::Builder<ConnectionManager<C>>) -> r2d2::Builder<ConnectionManager<C>> {
    b.max_size(1)
        .min_idle(Some(0))
        .connection_timeout(Duration::from_millis(300))
}

#[test]
fn counters_follow_a_scripted_sequence() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    recorder.install().unwrap();

    #[cfg(feature = "sqlite")]
    {
        let h = common::sqlite().unwrap();
        scripted(&snap, &h, "sqlite", false);
        kinds_and_lock_all(&snap, &h, "sqlite");
        let pool = tiny(Pool::builder())
            .connection_customizer(Box::new(diesel_lock::SqliteTuning::default()))
            .build(ConnectionManager::<diesel::SqliteConnection>::new(&h.url))
            .unwrap();
        release_failure(&snap, pool, "sqlite");
    }
    #[cfg(feature = "postgres")]
    if let Some(h) = common::pg() {
        scripted(&snap, &h, "postgresql", true);
        kinds_and_lock_all(&snap, &h, "postgresql");
        let pool = tiny(Pool::builder())
            .build(ConnectionManager::new(&h.url))
            .unwrap();
        release_failure::<diesel::PgConnection>(&snap, pool, "postgresql");
    }
    #[cfg(feature = "mysql")]
    if let Some(h) = common::mysql() {
        scripted(&snap, &h, "mysql", true);
        kinds_and_lock_all(&snap, &h, "mysql");
        let pool = tiny(Pool::builder())
            .build(ConnectionManager::new(&h.url))
            .unwrap();
        release_failure::<diesel::MysqlConnection>(&snap, pool, "mysql");
    }
    let _ = LockStatus::Held;
}
