//! Semaphore permits and readers wait in the key's line (`dlock_waiters`) as exclusive
//! waiters do, with the configuration a user gets from `Locker::connect(url)?`: permit
//! waiters in other processes are served in the order they came, a newcomer (a releaser
//! asking again) does not take a permit ahead of them, a SIGKILLed waiter's place holds the
//! line up at most its ttl + 1 s, a writer between readers keeps its turn, and no place is
//! left behind. `Lease` on every backend, `ForUpdate` on PostgreSQL (and through PgBouncer)
//! and MariaDB, `Advisory` on PostgreSQL.

mod common;

use diesel::r2d2::{ConnectionManager, Pool};
use diesel::RunQueryDsl;
use diesel_lock::{connect, AnyConnection, LockGuard, Locker, Strategy};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PERMITS: u32 = 2;

fn strategy(name: &str) -> Strategy {
    match name {
        "lease" => Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        "for_update" => Strategy::ForUpdate,
        "advisory" => Strategy::Advisory,
        other => panic!("unknown strategy {other}"),
    }
}

/// The URLs of the backends under test (a SQLite file in `dir`).
fn url(backend: &str, dir: &tempfile::TempDir) -> Option<String> {
    match backend {
        "sqlite" => Some(dir.path().join("kinds.db").to_str().unwrap().to_owned()),
        "pg" => common::url("DLOCK_TEST_PG_URL", "pg"),
        "pgbouncer" => common::url("DLOCK_TEST_PGBOUNCER_URL", "pgbouncer"),
        _ => common::url("DLOCK_TEST_MYSQL_URL", "mysql"),
    }
}

fn locker(url: &str, s: &str) -> Locker<AnyConnection> {
    Locker::connect(url)
        .unwrap()
        .strategy(strategy(s))
        .build()
        .unwrap()
}

fn take(l: &Locker<AnyConnection>, kind: &str, key: &str) -> LockGuard<AnyConnection> {
    match kind {
        "permit" => l.permit(key, PERMITS).unwrap(),
        "read" => l.read(key).unwrap(),
        "write" => l.write(key).unwrap(),
        other => panic!("unknown kind {other}"),
    }
}

#[derive(diesel::QueryableByName)]
struct N {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// The places of `key` in `dlock_waiters`, live or lapsed.
fn places(pool: &Pool<ConnectionManager<AnyConnection>>, backend: &str, key: &str) -> i64 {
    let sql = match backend {
        "pg" | "pgbouncer" => "SELECT count(*) AS n FROM dlock_waiters WHERE lock_key = $1",
        "mysql" => {
            "SELECT CAST(COUNT(*) AS SIGNED) AS n FROM dlock_waiters \
                    WHERE lock_key = CAST(? AS BINARY)"
        }
        _ => "SELECT COUNT(*) AS n FROM dlock_waiters WHERE lock_key = ?",
    };
    let mut c = pool.get().unwrap();
    diesel::sql_query(sql)
        .bind::<diesel::sql_types::Text, _>(key)
        .get_result::<N>(&mut *c)
        .unwrap()
        .n
}

/// Waits (at most 20 s) until `key` has `n` places.
fn until_places(pool: &Pool<ConnectionManager<AnyConnection>>, backend: &str, key: &str, n: i64) {
    let start = Instant::now();
    loop {
        let p = places(pool, backend, key);
        if p == n {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{p} places for {key}, not {n}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A child process: takes `kind` of `key`, appends its name to `file`, prints `GOT`, holds
/// `hold_ms`, appends `name-end` and releases.
fn spawn(url: &str, s: &str, kind: &str, key: &str, name: &str, file: &str, hold_ms: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_entry",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            "DLOCK_KINDS_CHILD",
            [url, s, kind, key, name, file, &hold_ms.to_string()].join("\t"),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

fn append(file: &str, line: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(file)
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

#[test]
#[ignore = "entry point for the child processes that the other tests spawn"]
fn child_entry() {
    let Ok(spec) = std::env::var("DLOCK_KINDS_CHILD") else {
        return;
    };
    let p: Vec<&str> = spec.split('\t').collect();
    let (url, s, kind, key, name, file) = (p[0], p[1], p[2], p[3], p[4], p[5]);
    let hold = Duration::from_millis(p[6].parse().unwrap());
    let l = locker(url, s);
    let g = take(&l, kind, key);
    append(file, name);
    println!("GOT {name}");
    std::thread::sleep(hold);
    append(file, &format!("{name}-end"));
    g.release().unwrap();
}

/// When a child said `GOT`.
fn got(child: &mut Child) -> Instant {
    let out = child.stdout.as_mut().unwrap();
    let mut r = BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "child ended first");
        if line.contains("GOT ") {
            return Instant::now();
        }
    }
}

/// The names in `file` that are acquisitions (not `-end` lines).
fn acquisitions(file: &str) -> Vec<String> {
    std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .filter(|l| !l.ends_with("-end"))
        .map(str::to_owned)
        .collect()
}

/// Both permits held here; five processes start waiting for one, one after the other
/// (each once the one before it has its place); one permit is given back, and the other
/// stays held: each child in turn gets the one free permit, in the order they came.
fn permits_served_in_order(backend: &str, s: &str) {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = url(backend, &dir) else {
        return;
    };
    let holder = locker(&url, s);
    holder.migrate().unwrap();
    let key = common::unique_key(&format!("kinds-order-{s}"));
    let file = dir.path().join("order").to_str().unwrap().to_owned();
    let admin = connect(&url).unwrap();
    let a = holder.permit(&key, PERMITS).unwrap();
    let b = holder.permit(&key, PERMITS).unwrap();
    let mut kids = Vec::new();
    for i in 0..5 {
        kids.push(spawn(&url, s, "permit", &key, &i.to_string(), &file, 20));
        until_places(&admin, backend, &key, i + 1);
    }
    a.release().unwrap();
    for k in &mut kids {
        assert!(k.wait().unwrap().success());
    }
    assert_eq!(
        acquisitions(&file),
        ["0", "1", "2", "3", "4"],
        "{backend} {s}"
    );
    assert_eq!(places(&admin, backend, &key), 0, "a place left behind");
    b.release().unwrap();
}

/// A permit waiter polls slowly (a `Locker` without a listener, a long `max_backoff`);
/// while it waits, a permit is given back and a newcomer (as a releaser asking again would)
/// tries for 100 ms: it never gets the permit ahead of the waiter. A waiter that gives up at
/// its deadline leaves no place.
fn newcomers_do_not_take_a_waiters_permit(backend: &str, s: &str) {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = url(backend, &dir) else {
        return;
    };
    let holder = locker(&url, s);
    holder.migrate().unwrap();
    let key = common::unique_key(&format!("kinds-barge-{s}"));
    let admin = connect(&url).unwrap();
    let a = holder.permit(&key, PERMITS).unwrap();
    let b = holder.permit(&key, PERMITS).unwrap();

    let impatient = locker(&url, s);
    assert!(impatient
        .try_permit_for(&key, PERMITS, Duration::from_millis(300))
        .unwrap()
        .is_none());
    assert_eq!(
        places(&admin, backend, &key),
        0,
        "a timed-out waiter's place"
    );

    let slow = Locker::builder(admin.clone())
        .strategy(strategy(s))
        .max_backoff(Duration::from_millis(500))
        .build()
        .unwrap();
    let (got_tx, got_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let waiter = {
        let k = key.clone();
        std::thread::spawn(move || {
            let g = slow.permit(&k, PERMITS).unwrap();
            got_tx.send(()).unwrap();
            let _ = done_rx.recv();
            drop(g);
        })
    };
    until_places(&admin, backend, &key, 1);
    a.release().unwrap();
    let newcomer = locker(&url, s);
    let mut barged = 0;
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(100) {
        barged += usize::from(newcomer.try_permit(&key, PERMITS).unwrap().is_some());
    }
    assert_eq!(barged, 0, "a newcomer took the permit ahead of the line");
    got_rx.recv().unwrap();
    assert_eq!(places(&admin, backend, &key), 0, "the waiter's place");
    done_tx.send(()).unwrap();
    waiter.join().unwrap();
    b.release().unwrap();
}

/// Three wait in line for the one free permit; the second is SIGKILLed; after a permit is
/// given back the first gets it and gives it back at once, and the third gets it within the
/// dead place's ttl (2 s with the default `max_backoff`) + 1 s.
fn a_killed_permit_waiter_is_passed_over(backend: &str, s: &str) {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = url(backend, &dir) else {
        return;
    };
    let holder = locker(&url, s);
    holder.migrate().unwrap();
    let key = common::unique_key(&format!("kinds-killed-{s}"));
    let file = dir.path().join("order").to_str().unwrap().to_owned();
    let admin = connect(&url).unwrap();
    let a = holder.permit(&key, PERMITS).unwrap();
    let b = holder.permit(&key, PERMITS).unwrap();
    let mut kids = Vec::new();
    for i in 0..3 {
        kids.push(spawn(&url, s, "permit", &key, &i.to_string(), &file, 0));
        until_places(&admin, backend, &key, i + 1);
    }
    kids[1].kill().unwrap();
    kids[1].wait().unwrap();
    let released = Instant::now();
    a.release().unwrap();
    let third = got(&mut kids[2]);
    let took = third - released;
    eprintln!("{backend} {s}: third in line got a permit {took:?} after the release");
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(kids[0].wait().unwrap().success());
    assert!(kids[2].wait().unwrap().success());
    assert_eq!(acquisitions(&file), ["0", "2"]);
    b.release().unwrap();
}

/// A reader holds; a writer waits, then a reader behind it: the reader does not get in
/// beside the first (past the writer's place), and gets the key only once the writer has
/// had it and given it back.
fn a_writer_between_readers_keeps_its_turn(backend: &str, s: &str) {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = url(backend, &dir) else {
        return;
    };
    let holder = locker(&url, s);
    holder.migrate().unwrap();
    let key = common::unique_key(&format!("kinds-writer-{s}"));
    let file = dir.path().join("order").to_str().unwrap().to_owned();
    let admin = connect(&url).unwrap();
    let r = holder.read(&key).unwrap();
    let mut w = spawn(&url, s, "write", &key, "w", &file, 200);
    until_places(&admin, backend, &key, 1);
    let mut r2 = spawn(&url, s, "read", &key, "r", &file, 0);
    until_places(&admin, backend, &key, 2);
    r.release().unwrap();
    assert!(w.wait().unwrap().success());
    assert!(r2.wait().unwrap().success());
    let order = std::fs::read_to_string(&file).unwrap();
    let order: Vec<&str> = order.lines().collect();
    assert_eq!(order, ["w", "w-end", "r", "r-end"], "{backend} {s}");
    assert_eq!(places(&admin, backend, &key), 0, "a place left behind");
}

/// Runs `sql` (with `key` bound once) on the admin pool.
fn exec(pool: &Pool<ConnectionManager<AnyConnection>>, sql: &str, key: &str) {
    let mut c = pool.get().unwrap();
    diesel::sql_query(sql)
        .bind::<diesel::sql_types::Text, _>(key)
        .execute(&mut *c)
        .unwrap();
}

/// A reader's or permit's place at the head of `key`'s line that lives 60 s and never
/// tries: a waiter that is slow to look (a paused process, a loaded machine). In the line
/// of strategy `s`'s semaphores (`dlock_waiters.line`: 0 `Lease`, 2 `ForUpdate`, 3
/// `Advisory`).
fn phantom_place(pool: &Pool<ConnectionManager<AnyConnection>>, backend: &str, s: &str, key: &str) {
    let line: i32 = match s {
        "lease" => 0,
        "for_update" => 2,
        "advisory" => 3,
        other => panic!("no semaphore line for {other}"),
    };
    let sql = match backend {
        "pg" | "pgbouncer" => {
            "INSERT INTO dlock_waiters (lock_key, line, owner, since, expires_at, shared) \
             VALUES ($1, $2, 'phantom', now(), now() + interval '60 seconds', 1)"
        }
        "mysql" => {
            "INSERT INTO dlock_waiters (lock_key, line, owner, since, expires_at, shared) \
             VALUES (CAST(? AS BINARY), ?, 'phantom', UTC_TIMESTAMP(6), \
                     UTC_TIMESTAMP(6) + INTERVAL 60 SECOND, 1)"
        }
        _ => {
            "INSERT INTO dlock_waiters (lock_key, line, owner, since, expires_at, shared) \
             VALUES (?, ?, 'phantom', strftime('%Y-%m-%d %H:%M:%f', 'now'), \
                     strftime('%Y-%m-%d %H:%M:%f', 'now', '+60 seconds'), 1)"
        }
    };
    let mut c = pool.get().unwrap();
    diesel::sql_query(sql)
        .bind::<diesel::sql_types::Text, _>(key)
        .bind::<diesel::sql_types::Integer, _>(line)
        .execute(&mut *c)
        .unwrap();
}

fn remove_phantom(pool: &Pool<ConnectionManager<AnyConnection>>, backend: &str, key: &str) {
    let sql = match backend {
        "pg" | "pgbouncer" => "DELETE FROM dlock_waiters WHERE lock_key = $1 AND owner = 'phantom'",
        "mysql" => {
            "DELETE FROM dlock_waiters WHERE lock_key = CAST(? AS BINARY) AND owner = 'phantom'"
        }
        _ => "DELETE FROM dlock_waiters WHERE lock_key = ? AND owner = 'phantom'",
    };
    exec(pool, sql, key);
}

/// Waiter threads (a `Locker` each, as separate processes would have) for `n` permits of
/// `key`: each sends when it holds one, and holds it until `done` says.
fn permit_waiters(
    url: &str,
    s: &str,
    key: &str,
    n: u32,
    count: usize,
    got: &std::sync::mpsc::Sender<Instant>,
    done: &std::sync::Arc<std::sync::Barrier>,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..count)
        .map(|_| {
            let l = locker(url, s);
            let (key, got, done) = (key.to_owned(), got.clone(), done.clone());
            std::thread::spawn(move || {
                let g = l.permit(&key, n).unwrap();
                got.send(Instant::now()).unwrap();
                done.wait();
                g.release().unwrap();
            })
        })
        .collect()
}

/// N permits given back together let N waiters in together, not one after the other:
///
/// - with a place at the head of the line that does not try (a slow waiter), the N − 1
///   waiters behind it get the permits they have room for at once (before, only the first
///   place tried, so they waited for the slow one's place to lapse), while a newcomer still
///   does not take the permit left for the slow one; once it is gone, the last waiter gets
///   that permit: N hold together;
/// - N waiters in line, N holders release: all N hold together.
fn permits_admitted_together(backend: &str, s: &str) {
    use std::sync::mpsc::channel;
    use std::sync::{Arc, Barrier};
    const N: u32 = 3;
    /// Far below the phantom place's 60 s, far above a hand-over on a loaded machine.
    const BOUND: Duration = Duration::from_secs(10);
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = url(backend, &dir) else {
        return;
    };
    let holder = locker(&url, s);
    holder.migrate().unwrap();
    let admin = connect(&url).unwrap();

    // Behind a slow first place.
    let key = common::unique_key(&format!("kinds-together-slow-{s}"));
    let held: Vec<_> = (0..N).map(|_| holder.permit(&key, N).unwrap()).collect();
    phantom_place(&admin, backend, s, &key);
    let (got_tx, got) = channel();
    let done = Arc::new(Barrier::new(N as usize + 1));
    let mut waiters = permit_waiters(&url, s, &key, N, N as usize - 1, &got_tx, &done);
    until_places(&admin, backend, &key, i64::from(N));
    let released = Instant::now();
    for g in held {
        g.release().unwrap();
    }
    for i in 1..N {
        let at = got
            .recv_timeout(BOUND)
            .unwrap_or_else(|_| panic!("{backend} {s}: waiter {i} of {} not let in", N - 1));
        eprintln!("{backend} {s}: waiter {i} in after {:?}", at - released);
    }
    // One permit is left, for the slow place: a newcomer does not take it.
    assert!(
        locker(&url, s).try_permit(&key, N).unwrap().is_none(),
        "{backend} {s}: a newcomer took the permit of the place ahead of it"
    );
    remove_phantom(&admin, backend, &key);
    waiters.extend(permit_waiters(&url, s, &key, N, 1, &got_tx, &done));
    got.recv_timeout(BOUND)
        .unwrap_or_else(|_| panic!("{backend} {s}: the last permit not taken"));
    // N hold together now (each holds until all have been counted).
    done.wait();
    for w in waiters {
        w.join().unwrap();
    }
    assert_eq!(places(&admin, backend, &key), 0, "a place left behind");

    // N waiters in line, N holders release together.
    let key = common::unique_key(&format!("kinds-together-{s}"));
    let held: Vec<_> = (0..N).map(|_| holder.permit(&key, N).unwrap()).collect();
    let done = Arc::new(Barrier::new(N as usize + 1));
    let waiters = permit_waiters(&url, s, &key, N, N as usize, &got_tx, &done);
    until_places(&admin, backend, &key, i64::from(N));
    let released = Instant::now();
    for g in held {
        g.release().unwrap();
    }
    let mut last = released;
    for i in 0..N {
        last = got
            .recv_timeout(BOUND)
            .unwrap_or_else(|_| panic!("{backend} {s}: only {i} of {N} waiters let in"));
    }
    eprintln!("{backend} {s}: {N} waiters in within {:?}", last - released);
    done.wait();
    for w in waiters {
        w.join().unwrap();
    }
    assert_eq!(places(&admin, backend, &key), 0, "a place left behind");
}

macro_rules! permit_suite {
    ($($name:ident: $backend:literal, $strategy:literal;)+) => {$(
        mod $name {
            #[test]
            fn permits_served_in_order() {
                super::permits_served_in_order($backend, $strategy);
            }
            #[test]
            fn newcomers_do_not_take_a_waiters_permit() {
                super::newcomers_do_not_take_a_waiters_permit($backend, $strategy);
            }
            #[test]
            fn a_killed_permit_waiter_is_passed_over() {
                super::a_killed_permit_waiter_is_passed_over($backend, $strategy);
            }
            #[test]
            fn permits_admitted_together() {
                super::permits_admitted_together($backend, $strategy);
            }
        }
    )+};
}

permit_suite! {
    sqlite_lease: "sqlite", "lease";
    pg_lease: "pg", "lease";
    pg_for_update: "pg", "for_update";
    pg_advisory: "pg", "advisory";
    pgbouncer_for_update: "pgbouncer", "for_update";
    mysql_lease: "mysql", "lease";
    mysql_for_update: "mysql", "for_update";
}

macro_rules! reader_suite {
    ($($name:ident: $backend:literal;)+) => {$(
        mod $name {
            #[test]
            fn a_writer_between_readers_keeps_its_turn() {
                super::a_writer_between_readers_keeps_its_turn($backend, "lease");
            }
        }
    )+};
}

reader_suite! {
    sqlite_lease_readers: "sqlite";
    pg_lease_readers: "pg";
    mysql_lease_readers: "mysql";
}
