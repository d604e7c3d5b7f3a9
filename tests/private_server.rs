//! The private-server harness (`common::private_server`) on its own: a server of the test's
//! own starts, serves locks, survives `kill9` + `restart` and a clean stop + restart, and
//! goes away with its directory. The crash tests of the token and reliability suites build
//! on it.
#![cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(unused))]

mod common;

use diesel_lock::{LockConnection, Locker, Strategy};
use std::time::Instant;

fn locker<C: LockConnection>(url: &str, s: Strategy) -> Locker<C> {
    let l = Locker::builder(common::pool::<C>(url, 4))
        .strategy(s)
        .build()
        .unwrap();
    l.migrate().unwrap();
    l
}

/// Takes `key` with each session strategy and returns the tokens.
fn tokens<C: LockConnection>(url: &str, key: &str) -> Vec<i64> {
    [Strategy::Advisory, Strategy::ForUpdate]
        .into_iter()
        .map(|s| locker::<C>(url, s).lock(key).unwrap().token())
        .collect()
}

/// Start, lock, crash while a guard holds the key, restart, lock again (the key is free: its
/// session died), stop cleanly, restart, lock again. `start` returns the server and its URL;
/// the server's `kill9`, `restart` and `stop_clean` come as closures over it.
fn crash_and_restart<C: LockConnection, S>(
    name: &str,
    start: impl FnOnce() -> S,
    url: impl Fn(&S) -> String,
    kill9: impl Fn(&mut S),
    restart: impl Fn(&mut S),
    stop_clean: impl Fn(&mut S),
) -> String {
    let t = Instant::now();
    let mut server = start();
    let started = t.elapsed();
    let url = url(&server);
    let key = common::unique_key("private");
    let before = tokens::<C>(&url, &key);

    let held_across = locker::<C>(&url, Strategy::Advisory);
    let guard = held_across.lock(&key).unwrap();
    kill9(&mut server);
    let t = Instant::now();
    restart(&mut server);
    let recovered = t.elapsed();
    let after_crash = tokens::<C>(&url, &key);
    // Its session died with the server: the release reports an error, which is logged.
    drop(guard);

    stop_clean(&mut server);
    let t = Instant::now();
    restart(&mut server);
    let restarted = t.elapsed();
    let after_stop = tokens::<C>(&url, &key);

    for (a, b) in [(&before, &after_crash), (&after_crash, &after_stop)] {
        for (x, y) in a.iter().zip(b) {
            assert!(y > x, "tokens {a:?} then {b:?}");
        }
    }
    format!(
        "{name}: start {:.1} s, restart after kill -9 {:.1} s, after a clean stop {:.1} s",
        started.as_secs_f64(),
        recovered.as_secs_f64(),
        restarted.as_secs_f64()
    )
}

#[cfg(feature = "postgres")]
#[test]
fn pg_starts_crashes_and_restarts() {
    use common::private_server::{available, PrivatePg};
    if !available("pg") {
        return;
    }
    let line = crash_and_restart::<diesel::PgConnection, _>(
        "private PostgreSQL",
        PrivatePg::start,
        PrivatePg::url,
        PrivatePg::kill9,
        PrivatePg::restart,
        PrivatePg::stop_clean,
    );
    eprintln!("{line}");
}

#[cfg(feature = "mysql")]
#[test]
fn maria_starts_crashes_and_restarts() {
    use common::private_server::{available, PrivateMaria};
    if !available("mysql") {
        return;
    }
    let line = crash_and_restart::<diesel::MysqlConnection, _>(
        "private MariaDB",
        PrivateMaria::start,
        PrivateMaria::url,
        PrivateMaria::kill9,
        PrivateMaria::restart,
        PrivateMaria::stop_clean,
    );
    eprintln!("{line}");
}

/// A killed server leaves no process behind, and a dropped one no directory either.
#[cfg(feature = "postgres")]
#[test]
fn pg_kill9_leaves_no_process_and_drop_no_directory() {
    use common::private_server::{available, PrivatePg};
    if !available("pg") {
        return;
    }
    let mut pg = PrivatePg::start();
    // Some backends to kill besides the postmaster's own helpers.
    let pool = common::pool::<diesel::PgConnection>(&pg.url(), 3);
    let _conns: Vec<_> = (0..3).map(|_| pool.get().unwrap()).collect();
    let (pm, dir) = (pg.postmaster_pid(), pg.dir());
    let children = common::private_server::children_of(pm);
    assert!(children.len() >= 3 + 3, "postmaster children: {children:?}");
    pg.kill9();
    for pid in std::iter::once(pm as i32).chain(children) {
        assert!(
            common::private_server::exited(pid),
            "pid {pid} survived kill9"
        );
    }
    pg.restart();
    drop(pg);
    assert!(!dir.exists(), "{} left behind", dir.display());
}
