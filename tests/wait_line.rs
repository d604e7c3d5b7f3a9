//! The line of waiters (`dlock_waiters`) of `Row` and `Lease`, with the configuration a user
//! gets from `Locker::connect(url)?`: processes are served in the order they came,
//! a killed waiter's place lapses, a waiter that times out, is cancelled or panics leaves
//! no place behind, and `admin` counts who waits. On every backend.

mod common;

use diesel::r2d2::{ConnectionManager, Pool};
use diesel_lock::{admin, connect, AnyConnection, Locker, Strategy};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn row() -> Strategy {
    Strategy::Row { stale_after: None }
}

fn lease() -> Strategy {
    Strategy::Lease {
        ttl: Duration::from_secs(10),
    }
}

fn strategy(name: &str) -> Strategy {
    match name {
        "row" => row(),
        _ => lease(),
    }
}

/// The URLs of the backends under test (a SQLite file in `dir`).
fn url(backend: &str, dir: &tempfile::TempDir) -> Option<String> {
    match backend {
        "sqlite" => Some(dir.path().join("line.db").to_str().unwrap().to_owned()),
        "pg" => common::url("DLOCK_TEST_PG_URL", "pg"),
        _ => common::url("DLOCK_TEST_MYSQL_URL", "mysql"),
    }
}

fn locker(url: &str, s: Strategy) -> Locker<AnyConnection> {
    Locker::connect(url).unwrap().strategy(s).build().unwrap()
}

/// What every test of this file starts from: a temp dir (the SQLite file, and the test's
/// own files), the backend's URL, and a migrated `Locker` of strategy `s`. `None` where the
/// backend is not configured (the test then returns at once).
fn start(backend: &str, s: &str) -> Option<(tempfile::TempDir, String, Locker<AnyConnection>)> {
    let dir = tempfile::tempdir().unwrap();
    let url = url(backend, &dir)?;
    let first = locker(&url, strategy(s));
    first.migrate().unwrap();
    Some((dir, url, first))
}

/// How many wait for `key` in its line, as `admin` reads it (0 when nobody holds it).
fn waiting(conn: &mut Pool<ConnectionManager<AnyConnection>>, key: &str) -> u32 {
    let mut c = conn.get().unwrap();
    admin::lock_info(&mut *c, key)
        .unwrap()
        .iter()
        .map(|i| i.waiting)
        .max()
        .unwrap_or(0)
}

/// Waits (at most 20 s) until `n` wait for `key`.
fn until_waiting(pool: &mut Pool<ConnectionManager<AnyConnection>>, key: &str, n: u32) {
    let start = Instant::now();
    loop {
        let w = waiting(pool, key);
        if w == n {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{w} waiting for {key}, not {n}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A child process: `lock(key)`, then append its name to `file` while holding, print
/// `GOT`, hold `hold_ms` and release.
fn spawn(url: &str, s: &str, key: &str, name: &str, file: &str, hold_ms: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_entry",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            "DLOCK_LINE_CHILD",
            [url, s, key, name, file, &hold_ms.to_string()].join("\t"),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

#[test]
#[ignore = "entry point for the child processes that the other tests spawn"]
fn child_entry() {
    let Ok(spec) = std::env::var("DLOCK_LINE_CHILD") else {
        return;
    };
    let p: Vec<&str> = spec.split('\t').collect();
    let (url, s, key, name, file) = (p[0], p[1], p[2], p[3], p[4]);
    let hold = Duration::from_millis(p[5].parse().unwrap());
    let l = locker(url, strategy(s));
    let g = l.lock(key).unwrap();
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(file)
        .unwrap();
    writeln!(f, "{name} {}", g.token()).unwrap();
    println!("GOT {name}");
    std::thread::sleep(hold);
    g.release().unwrap();
}

/// The line `GOT …` of a child, and when it came.
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

/// A holder holds; five processes start waiting one after the other (each once the one
/// before it is in line); released, the key goes to them in the order they came.
fn served_in_order(backend: &str, s: &str) {
    let Some((dir, url, holder)) = start(backend, s) else {
        return;
    };
    let key = common::unique_key(&format!("line-order-{s}"));
    let file = dir.path().join("order").to_str().unwrap().to_owned();
    let mut admin_pool = connect(&url).unwrap();
    let g = holder.lock(&key).unwrap();
    let first = g.token();
    let mut kids = Vec::new();
    for i in 0..5 {
        kids.push(spawn(&url, s, &key, &i.to_string(), &file, 20));
        until_waiting(&mut admin_pool, &key, i + 1);
        std::thread::sleep(Duration::from_millis(100));
    }
    g.release().unwrap();
    for k in &mut kids {
        assert!(k.wait().unwrap().success());
    }
    let order = std::fs::read_to_string(&file).unwrap();
    let (names, tokens): (Vec<&str>, Vec<i64>) = order
        .lines()
        .map(|l| {
            let (n, t) = l.split_once(' ').unwrap();
            (n, t.parse::<i64>().unwrap())
        })
        .unzip();
    assert_eq!(names, ["0", "1", "2", "3", "4"], "{backend} {s}");
    assert!(
        tokens[0] > first && tokens.windows(2).all(|w| w[0] < w[1]),
        "{tokens:?}"
    );
    assert_eq!(waiting(&mut admin_pool, &key), 0);
}

/// Three wait in line; the second is SIGKILLed; after the holder's release the first gets
/// the key and gives it back at once, and the third gets it within the dead place's ttl
/// (2 s with the default `max_backoff`) + 1 s.
fn a_killed_second_in_line_is_passed_over(backend: &str, s: &str) {
    let Some((dir, url, holder)) = start(backend, s) else {
        return;
    };
    let key = common::unique_key(&format!("line-killed-{s}"));
    let file = dir.path().join("order").to_str().unwrap().to_owned();
    let mut admin_pool = connect(&url).unwrap();
    let g = holder.lock(&key).unwrap();
    let mut kids = Vec::new();
    for i in 0..3 {
        kids.push(spawn(&url, s, &key, &i.to_string(), &file, 0));
        until_waiting(&mut admin_pool, &key, i + 1);
    }
    kids[1].kill().unwrap();
    kids[1].wait().unwrap();
    let released = Instant::now();
    g.release().unwrap();
    let third = got(&mut kids[2]);
    let took = third - released;
    eprintln!("{backend} {s}: third in line got the key {took:?} after the release");
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(kids[0].wait().unwrap().success());
    assert!(kids[2].wait().unwrap().success());
    let order = std::fs::read_to_string(&file).unwrap();
    let names: Vec<&str> = order.lines().map(|l| &l[..1]).collect();
    assert_eq!(names, ["0", "2"]);
}

/// Two wait in line; the first is SIGKILLed (and, in a second round, SIGSTOPped) just before
/// the holder's release, which grants it the key: the grant lapses with its place, and the
/// second gets the key within the place's ttl (2 s with the default `max_backoff`) + 1 s,
/// with a token above the one the dead head was granted. The release comes only once the
/// head is dead (`wait`) or wholly stopped (`stop_wholly`).
fn a_killed_head_loses_its_grant(backend: &str, s: &str) {
    let Some((dir, url, holder)) = start(backend, s) else {
        return;
    };
    let mut admin_pool = connect(&url).unwrap();
    for stop in [false, true] {
        let key = common::unique_key(&format!("line-dead-head-{s}-{stop}"));
        let file = dir
            .path()
            .join(format!("order-{stop}"))
            .to_str()
            .unwrap()
            .to_owned();
        let g = holder.lock(&key).unwrap();
        let first = g.token();
        let mut kids = Vec::new();
        for i in 0..2 {
            kids.push(spawn(&url, s, &key, &i.to_string(), &file, 0));
            until_waiting(&mut admin_pool, &key, i + 1);
        }
        if stop {
            stop_wholly(&kids[0]);
        } else {
            kids[0].kill().unwrap();
            kids[0].wait().unwrap();
        }
        let released = Instant::now();
        g.release().unwrap();
        let second = got(&mut kids[1]);
        let took = second - released;
        eprintln!("{backend} {s}: the dead head's grant passed on {took:?} after the release (stopped: {stop})");
        assert!(took < Duration::from_secs(3), "{took:?}");
        assert!(kids[1].wait().unwrap().success());
        if stop {
            kids[0].kill().unwrap();
            kids[0].wait().unwrap();
        }
        let order = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = order.lines().collect();
        assert_eq!(lines.len(), 1, "{order}");
        let token: i64 = lines[0].split(' ').nth(1).unwrap().parse().unwrap();
        assert!(
            token > first + 1,
            "token {token} after {first} and the dead head's grant"
        );
        assert_eq!(waiting(&mut admin_pool, &key), 0);
    }
}

/// Stops `child` (SIGSTOP) and returns once all its threads have stopped. `kill` returning
/// is not enough: the kernel wakes one thread to take a SIGSTOP, and the process's other
/// threads run on until that one gets the CPU and stops them all. On a loaded machine a
/// head "stopped" so still heard the grant the holder's release then rang (its doorbell's
/// thread) and took the key, 12-82 ms after the release, before it stopped: two lines in
/// the order file (`sqlite_row`: 5 runs of 44 with 8 busy loops on the test's one core).
/// `waitpid` with `WUNTRACED` reports a stop only once the whole thread group has stopped.
fn stop_wholly(child: &Child) {
    use nix::sys::signal::{kill, Signal};
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    use nix::unistd::Pid;
    let pid = Pid::from_raw(i32::try_from(child.id()).unwrap());
    kill(pid, Signal::SIGSTOP).unwrap();
    match waitpid(pid, Some(WaitPidFlag::WUNTRACED)).unwrap() {
        WaitStatus::Stopped(_, Signal::SIGSTOP) => {}
        other => panic!("the child did not stop: {other:?}"),
    }
}

/// A waiter that gives up at its deadline, or is cancelled, leaves no place behind; nor does
/// one whose thread panics while it waits (here: in the pool's checkout of its next
/// attempt).
fn impatient_and_panicking_waiters_leave_no_place(backend: &str, s: &str) {
    let Some((_dir, url, holder)) = start(backend, s) else {
        return;
    };
    let key = common::unique_key(&format!("line-impatient-{s}"));
    let mut admin_pool = connect(&url).unwrap();
    let g = holder.lock(&key).unwrap();

    let other = locker(&url, strategy(s));
    assert!(other
        .try_lock_for(&key, Duration::from_millis(300))
        .unwrap()
        .is_none());
    assert_eq!(
        waiting(&mut admin_pool, &key),
        0,
        "a timed-out waiter's place"
    );

    let cancel = diesel_lock::Cancel::new();
    let waiter = {
        let (l, k, c) = (other.clone(), key.clone(), cancel.clone());
        std::thread::spawn(move || l.try_lock_cancellable(&k, None, &c).unwrap().is_none())
    };
    until_waiting(&mut admin_pool, &key, 1);
    cancel.cancel();
    assert!(waiter.join().unwrap());
    assert_eq!(
        waiting(&mut admin_pool, &key),
        0,
        "a cancelled waiter's place"
    );

    // A pool whose next checkout panics once, armed once the waiter is in line. Of one
    // connection: a waiter that polls keeps its connection between looks only while the
    // pool has another to give, so this one takes it from the pool for every look.
    let armed = Arc::new(AtomicBool::new(false));
    let panicky = pool_builder(backend)
        .max_size(1)
        .event_handler(Box::new(PanicOnce(armed.clone())))
        .build(ConnectionManager::<AnyConnection>::new(&url))
        .unwrap();
    let panicky = Locker::builder(panicky)
        .strategy(strategy(s))
        .build()
        .unwrap();
    let waiter = {
        let k = key.clone();
        std::thread::spawn(move || panicky.lock(&k).map(drop))
    };
    until_waiting(&mut admin_pool, &key, 1);
    armed.store(true, Ordering::SeqCst);
    assert!(waiter.join().is_err(), "the waiter did not panic");
    assert_eq!(
        waiting(&mut admin_pool, &key),
        0,
        "a panicked waiter's place"
    );
    drop(g);
    assert!(other.try_lock(&key).unwrap().is_some());
}

/// A pool of the test's own (not from `connect`: no listener); SQLite connections tuned as
/// `connect` tunes them (WAL, a busy timeout), which `build` requires.
fn pool_builder(backend: &str) -> r2d2::Builder<ConnectionManager<AnyConnection>> {
    let b = Pool::builder().min_idle(Some(0));
    if backend == "sqlite" {
        b.connection_customizer(Box::new(Wal))
    } else {
        b
    }
}

#[derive(Debug)]
struct Wal;

impl diesel::r2d2::CustomizeConnection<AnyConnection, diesel::r2d2::Error> for Wal {
    fn on_acquire(&self, c: &mut AnyConnection) -> Result<(), diesel::r2d2::Error> {
        use diesel::connection::SimpleConnection;
        c.batch_execute("PRAGMA busy_timeout = 5000; PRAGMA journal_mode = WAL;")
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

#[derive(Debug)]
struct PanicOnce(Arc<AtomicBool>);

impl r2d2::HandleEvent for PanicOnce {
    fn handle_checkout(&self, _: r2d2::event::CheckoutEvent) {
        if self.0.swap(false, Ordering::SeqCst) {
            panic!("checkout panics, as asked");
        }
    }
}

/// `try_lock` (a newcomer) does not take a key that is free for a moment while others wait
/// in line for it: the first in line gets it.
fn newcomers_do_not_barge(backend: &str, s: &str) {
    let Some((_dir, url, holder)) = start(backend, s) else {
        return;
    };
    let key = common::unique_key(&format!("line-barge-{s}"));
    let mut admin_pool = connect(&url).unwrap();
    let g = holder.lock(&key).unwrap();
    // A waiter that polls slowly (no listener: a pool not built by `connect`), so that the
    // key stays free between the release and its next look.
    let slow = Locker::builder(
        pool_builder(backend)
            .max_size(2)
            .build(ConnectionManager::<AnyConnection>::new(&url))
            .unwrap(),
    )
    .strategy(strategy(s))
    .max_backoff(Duration::from_millis(500))
    .build()
    .unwrap();
    let (got_tx, got_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let waiter = {
        let k = key.clone();
        std::thread::spawn(move || {
            let g = slow.lock(&k).unwrap();
            got_tx.send(g.token()).unwrap();
            // Held until the newcomers are done.
            let _ = done_rx.recv();
        })
    };
    until_waiting(&mut admin_pool, &key, 1);
    let released = g.token();
    g.release().unwrap();
    let newcomer = locker(&url, strategy(s));
    let mut barged = 0;
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(100) {
        barged += usize::from(newcomer.try_lock(&key).unwrap().is_some());
    }
    assert_eq!(barged, 0, "a newcomer took the key ahead of the line");
    assert!(got_rx.recv().unwrap() > released);
    done_tx.send(()).unwrap();
    waiter.join().unwrap();
}

/// A newcomer's wait is not starved by another `Locker` that takes and releases the key in
/// a loop (alone in the line, so keeping it, as a process would): it is served within a
/// few of the looper's turns. On SQLite its first try used to queue for the write lock in
/// the busy handler, whose sleeps (1, 2, 5, 10 … ms) let the looper go round hundreds of
/// times (18–107 ms); now it joins the line first. Five newcomers, each a `Locker` that has
/// never released the key, one after the other.
fn a_newcomer_is_served_beside_a_looper(backend: &str, s: &str) {
    let Some((_dir, url, looper)) = start(backend, s) else {
        return;
    };
    let key = common::unique_key(&format!("line-looper-{s}"));
    let turns = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (going_tx, going_rx) = std::sync::mpsc::channel();
    let looping = {
        let (k, turns, stop) = (key.clone(), turns.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                looper.lock(&k).unwrap().release().unwrap();
                if turns.fetch_add(1, Ordering::Relaxed) == 100 {
                    going_tx.send(()).unwrap();
                }
            }
        })
    };
    going_rx.recv().unwrap();
    let mut waited = Vec::new();
    for _ in 0..5 {
        let newcomer = locker(&url, strategy(s));
        let before = turns.load(Ordering::Relaxed);
        let g = newcomer.lock(&key).unwrap();
        // The looper is held up while the newcomer holds the key: its count stands.
        waited.push(turns.load(Ordering::Relaxed) - before);
        g.release().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    looping.join().unwrap();
    assert!(
        waited.iter().all(|&w| w <= 100),
        "the looper's turns while each newcomer waited: {waited:?}"
    );
}

macro_rules! line_suite {
    ($($name:ident: $backend:literal, $strategy:literal;)+) => {$(
        mod $name {
            #[test]
            fn served_in_order() {
                super::served_in_order($backend, $strategy);
            }
            #[test]
            fn a_killed_second_in_line_is_passed_over() {
                super::a_killed_second_in_line_is_passed_over($backend, $strategy);
            }
            #[test]
            fn a_killed_head_loses_its_grant() {
                super::a_killed_head_loses_its_grant($backend, $strategy);
            }
            #[test]
            fn impatient_and_panicking_waiters_leave_no_place() {
                super::impatient_and_panicking_waiters_leave_no_place($backend, $strategy);
            }
            #[test]
            fn newcomers_do_not_barge() {
                super::newcomers_do_not_barge($backend, $strategy);
            }
            #[test]
            fn a_newcomer_is_served_beside_a_looper() {
                super::a_newcomer_is_served_beside_a_looper($backend, $strategy);
            }
        }
    )+};
}

line_suite! {
    sqlite_row: "sqlite", "row";
    sqlite_lease: "sqlite", "lease";
    pg_row: "pg", "row";
    pg_lease: "pg", "lease";
    mysql_row: "mysql", "row";
    mysql_lease: "mysql", "lease";
}
