//! Several OS processes on one key: mutual exclusion across processes, a holder killed with
//! SIGKILL, a holder paused (SIGSTOP) past its lease, and the session strategies' global
//! tokens increasing in lock order over 10^4 acquisitions by 4 processes. The children are this test binary run
//! again with `DLOCK_CHILD` set, entering through the ignored `child_entry` test.

mod common;

use common::conformance::TestDb;
use common::{unique_key, Harness};
use diesel_lock::{Error, Strategy};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

fn parse_strategy(s: &str) -> Strategy {
    let (name, ms) = s.split_once(':').unwrap_or((s, ""));
    let ms = ms.parse::<u64>().ok().map(Duration::from_millis);
    match name {
        "row" => Strategy::Row { stale_after: ms },
        "lease" => Strategy::Lease { ttl: ms.unwrap() },
        "advisory" => Strategy::Advisory,
        "advisory-xact" => Strategy::AdvisoryXact,
        "for-update" => Strategy::ForUpdate,
        other => panic!("unknown strategy {other}"),
    }
}

#[test]
#[ignore = "entry point for the child processes that the other tests spawn"]
fn child_entry() {
    let Ok(spec) = std::env::var("DLOCK_CHILD") else {
        return;
    };
    let p: Vec<&str> = spec.split('\t').collect();
    let (backend, url, strategy, key, mode) = (p[0], p[1], parse_strategy(p[2]), p[3], p[4]);
    match backend {
        "sqlite" => child_main(common::sqlite_at(url, 8), strategy, key, mode),
        #[cfg(feature = "postgres")]
        "pg" => child_main(
            common::server_at::<diesel::PgConnection>(url, 8),
            strategy,
            key,
            mode,
        ),
        #[cfg(feature = "mysql")]
        "mysql" => child_main(
            common::server_at::<diesel::MysqlConnection>(url, 8),
            strategy,
            key,
            mode,
        ),
        other => panic!("unknown backend {other}"),
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").unwrap();
    out.flush().unwrap();
}

fn child_main<C: TestDb>(h: Harness<C>, strategy: Strategy, key: &str, mode: &str) {
    let locker = h.locker(strategy);
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    match mode {
        "hold" => {
            let g = locker.lock(key).unwrap();
            say(&format!(
                "HELD {} {}",
                g.token(),
                g.acquired_at().timestamp_micros()
            ));
            loop {
                std::thread::park();
            }
        }
        "hold-check" => {
            let g = locker.lock(key).unwrap();
            say(&format!(
                "HELD {} {}",
                g.token(),
                g.acquired_at().timestamp_micros()
            ));
            stdin.read_line(&mut line).unwrap();
            let verdict = match g.check() {
                Ok(()) => "held".to_owned(),
                Err(Error::LockLost { .. }) => "lost".to_owned(),
                Err(e) => format!("error {e}"),
            };
            say(&format!("CHECK {verdict}"));
        }
        count => {
            let (threads, rounds) = count
                .strip_prefix("count:")
                .and_then(|c| c.split_once(':'))
                .map(|(t, r)| (t.parse::<usize>().unwrap(), r.parse::<usize>().unwrap()))
                .expect("mode");
            say("READY");
            stdin.read_line(&mut line).unwrap(); // "GO": every child starts together
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let (locker, pool, key) = (locker.clone(), h.pool.clone(), key.to_owned());
                    std::thread::spawn(move || {
                        for _ in 0..rounds {
                            let g = locker.lock(&key).unwrap();
                            let mut c = pool.get().unwrap();
                            let seen = c.counter_read(&key);
                            assert!(
                                g.token() > seen.last_token,
                                "token {} not above the last holder's {}",
                                g.token(),
                                seen.last_token
                            );
                            std::thread::sleep(Duration::from_micros(200));
                            c.counter_write(&key, seen.value + 1, g.token());
                            drop(c);
                            g.release().unwrap();
                        }
                    })
                })
                .collect();
            for handle in handles {
                handle.join().unwrap();
            }
            say("DONE");
        }
    }
}

struct Kid {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Kid {
    fn spawn(backend: &str, url: &str, strategy: &str, key: &str, mode: &str) -> Kid {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_entry",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                "DLOCK_CHILD",
                [backend, url, strategy, key, mode].join("\t"),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        Kid {
            stdin: child.stdin.take().unwrap(),
            stdout: BufReader::new(child.stdout.take().unwrap()),
            child,
        }
    }

    /// What the child says from `word` on, in the next line holding it. libtest's own chatter
    /// is skipped, and may stand on the same line before it ("test child_entry ... READY").
    fn expect(&mut self, word: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "child exited before saying {word:?}");
            if let Some(at) = line.find(word) {
                return line[at..].trim_end().to_owned();
            }
        }
    }

    fn tell(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// "HELD token micros" → (token, acquired_at in µs).
fn held(line: &str) -> (i64, i64) {
    let mut it = line.split(' ').skip(1).map(|v| v.parse::<i64>().unwrap());
    (it.next().unwrap(), it.next().unwrap())
}

fn mutual_exclusion_across_processes<C: TestDb>(backend: &str, h: &Harness<C>, strategy: &str) {
    let key = unique_key("procs");
    {
        let mut c = h.pool.get().unwrap();
        c.create_counter();
        c.counter_init(&key);
    }
    let (children, threads, rounds) = (3, 4, 25);
    let mode = format!("count:{threads}:{rounds}");
    let mut kids: Vec<_> = (0..children)
        .map(|_| Kid::spawn(backend, &h.url, strategy, &key, &mode))
        .collect();
    for kid in &mut kids {
        kid.expect("READY");
    }
    for kid in &mut kids {
        kid.tell("GO");
    }
    for kid in &mut kids {
        kid.expect("DONE");
        assert!(kid.child.wait().unwrap().success(), "a child failed");
    }
    let total = h.pool.get().unwrap().counter_read(&key).value;
    assert_eq!(total, (children * threads * rounds) as i64, "lost updates");
}

/// 4 processes take one key 2,500 times each (Advisory, ForUpdate: their tokens come from
/// one source for all keys, drawn by the locking statement): inside each hold, the holder
/// checks its token against the last holder's, recorded beside a racy counter, so tokens
/// strictly increase in the order the lock was held, and the counter comes out exact.
fn tokens_increase_across_processes<C: TestDb>(backend: &str, h: &Harness<C>, strategy: &str) {
    let key = unique_key("procs-tokens");
    {
        let mut c = h.pool.get().unwrap();
        c.create_counter();
        c.counter_init(&key);
    }
    let (children, rounds) = (4, 2500);
    let mode = format!("count:1:{rounds}");
    let mut kids: Vec<_> = (0..children)
        .map(|_| Kid::spawn(backend, &h.url, strategy, &key, &mode))
        .collect();
    for kid in &mut kids {
        kid.expect("READY");
    }
    let started = Instant::now();
    for kid in &mut kids {
        kid.tell("GO");
    }
    for kid in &mut kids {
        kid.expect("DONE");
        assert!(kid.child.wait().unwrap().success(), "a child failed");
    }
    let seen = h.pool.get().unwrap().counter_read(&key);
    assert_eq!(seen.value, (children * rounds) as i64, "lost updates");
    eprintln!(
        "{backend} {strategy}: {} acquisitions by {children} processes in {:?}, last token {}",
        seen.value,
        started.elapsed(),
        seen.last_token
    );
}

fn sigkill_lease_frees_after_ttl_not_before<C: TestDb>(backend: &str, h: &Harness<C>) {
    let ttl = Duration::from_millis(2000);
    let key = unique_key("kill-lease");
    let mut kid = Kid::spawn(backend, &h.url, "lease:2000", &key, "hold");
    let (child_token, _) = held(&kid.expect("HELD"));
    kid.child.kill().unwrap(); // SIGKILL: no release, no more heartbeats
    let killed = Instant::now();
    kid.child.wait().unwrap();
    let locker = h.locker(Strategy::Lease { ttl });
    assert!(
        locker.try_lock(&key).unwrap().is_none(),
        "lease freed before its ttl"
    );
    let g = locker
        .try_lock_for(&key, Duration::from_secs(10))
        .unwrap()
        .expect("lease never expired");
    let waited = killed.elapsed();
    // The child renewed at most one heartbeat interval (ttl/3) before it died.
    assert!(
        waited >= ttl - ttl / 3 - Duration::from_millis(100),
        "freed after {waited:?}"
    );
    assert!(
        waited <= ttl + Duration::from_secs(1),
        "freed only after {waited:?}"
    );
    assert!(g.token() > child_token);
}

fn sigkill_row_with_stale_after_is_taken_over<C: TestDb>(backend: &str, h: &Harness<C>) {
    let stale = Duration::from_millis(2000);
    let key = unique_key("kill-row");
    let mut kid = Kid::spawn(backend, &h.url, "row:2000", &key, "hold");
    let (child_token, child_at) = held(&kid.expect("HELD"));
    kid.child.kill().unwrap();
    kid.child.wait().unwrap();
    let locker = h.locker(Strategy::Row {
        stale_after: Some(stale),
    });
    let g = locker
        .try_lock_for(&key, Duration::from_secs(10))
        .unwrap()
        .expect("stale row never taken over");
    let age = g.acquired_at().timestamp_micros() - child_at;
    assert!(
        age >= stale.as_micros() as i64,
        "taken over after only {age} µs"
    );
    assert!(g.token() > child_token);
}

fn sigkill_row_without_stale_after_stays_held<C: TestDb>(backend: &str, h: &Harness<C>) {
    let key = unique_key("kill-row-kept");
    let mut kid = Kid::spawn(backend, &h.url, "row", &key, "hold");
    kid.expect("HELD");
    kid.child.kill().unwrap();
    kid.child.wait().unwrap();
    let locker = h.locker(Strategy::Row { stale_after: None });
    assert!(locker
        .try_lock_for(&key, Duration::from_millis(1500))
        .unwrap()
        .is_none());
    h.pool.get().unwrap().steal(&key); // what `dlock release --force` is for
    assert!(locker.try_lock(&key).unwrap().is_some());
}

fn paused_holder_loses_its_lease<C: TestDb>(backend: &str, h: &Harness<C>) {
    let key = unique_key("paused");
    let mut kid = Kid::spawn(backend, &h.url, "lease:1000", &key, "hold-check");
    let (child_token, _) = held(&kid.expect("HELD"));
    kid.signal("-STOP");
    let locker = h.locker(Strategy::Lease {
        ttl: Duration::from_secs(5),
    });
    let g = locker
        .try_lock_for(&key, Duration::from_secs(10))
        .unwrap()
        .expect("paused holder's lease never expired");
    assert!(g.token() > child_token);
    kid.signal("-CONT");
    kid.tell("CHECK");
    assert_eq!(kid.expect("CHECK"), "CHECK lost");
    g.check().unwrap();
}

macro_rules! process_tests {
    ($module:ident, $backend:literal, $harness:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn mutual_exclusion_row() {
                if let Some(h) = $harness {
                    mutual_exclusion_across_processes($backend, &h, "row");
                }
            }
            #[test]
            fn mutual_exclusion_lease() {
                if let Some(h) = $harness {
                    mutual_exclusion_across_processes($backend, &h, "lease:10000");
                }
            }
            #[test]
            fn sigkill_lease() {
                if let Some(h) = $harness {
                    sigkill_lease_frees_after_ttl_not_before($backend, &h);
                }
            }
            #[test]
            fn sigkill_row_stale() {
                if let Some(h) = $harness {
                    sigkill_row_with_stale_after_is_taken_over($backend, &h);
                }
            }
            #[test]
            fn sigkill_row_kept() {
                if let Some(h) = $harness {
                    sigkill_row_without_stale_after_stays_held($backend, &h);
                }
            }
            #[test]
            fn paused_holder() {
                if let Some(h) = $harness {
                    paused_holder_loses_its_lease($backend, &h);
                }
            }
        }
    };
}

/// The session strategies, on the servers that have them.
macro_rules! session_process_tests {
    ($module:ident, $backend:literal, $harness:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn tokens_across_processes_advisory() {
                if let Some(h) = $harness {
                    tokens_increase_across_processes($backend, &h, "advisory");
                }
            }
            #[test]
            fn tokens_across_processes_for_update() {
                if let Some(h) = $harness {
                    tokens_increase_across_processes($backend, &h, "for-update");
                }
            }
        }
    };
}

/// The strategies whose lock lives in a transaction (ForUpdate, AdvisoryXact): what works
/// through a transaction pooler. The children get the harness's URL, PgBouncer's with its
/// `dlock_pooler` parameter, which their pools heed as the parent's do.
macro_rules! xact_process_tests {
    ($module:ident, $backend:literal, $harness:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn mutual_exclusion_advisory_xact() {
                if let Some(h) = $harness {
                    mutual_exclusion_across_processes($backend, &h, "advisory-xact");
                }
            }
            #[test]
            fn mutual_exclusion_for_update() {
                if let Some(h) = $harness {
                    mutual_exclusion_across_processes($backend, &h, "for-update");
                }
            }
            #[test]
            fn tokens_across_processes_advisory_xact() {
                if let Some(h) = $harness {
                    tokens_increase_across_processes($backend, &h, "advisory-xact");
                }
            }
        }
    };
}

process_tests!(sqlite, "sqlite", common::sqlite());
#[cfg(feature = "postgres")]
xact_process_tests!(pg_xact, "pg", common::pg());
#[cfg(feature = "postgres")]
xact_process_tests!(pgbouncer_xact, "pg", common::pgbouncer());
#[cfg(feature = "postgres")]
process_tests!(pgbouncer, "pg", common::pgbouncer());
#[cfg(feature = "postgres")]
session_process_tests!(pg_sessions, "pg", common::pg());
#[cfg(feature = "mysql")]
session_process_tests!(mysql_sessions, "mysql", common::mysql());
#[cfg(feature = "postgres")]
process_tests!(pg, "pg", common::pg());
#[cfg(feature = "mysql")]
process_tests!(mysql, "mysql", common::mysql());
