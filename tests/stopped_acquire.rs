//! A `Lease` reader or permit whose process is stopped (SIGSTOP) inside its acquiring
//! transaction, holding the key's lease and header rows locked, must not stall the key: the
//! server ends that transaction after the library's idle bound (a quarter of the ttl, at most
//! 2 s), so the key's holders keep their leases (their renewals wait out the stop and go
//! through), and a newcomer's bounded wait returns near its deadline. Once continued, the
//! stopped process sees an error or a busy key, never a second holder.
//!
//! The child stops itself through the `test-hooks` hook inside the transaction, after saying
//! so (SIGSTOP raised at the hook's own thread: see `stop_here`); the parent waits for the
//! stop (`waitpid` with `WUNTRACED`) and proves the rows locked (`FOR UPDATE NOWAIT` fails)
//! before it measures anything.
//!
//! SQLite has no server to end a stopped writer's transaction (see the guide, "Shared
//! locks"): not tested here.

#![cfg(all(unix, any(feature = "postgres", feature = "mysql")))]

mod common;

use common::kids::{say, Kid};
use common::{unique_key, Harness};
use diesel::sql_types::Text;
use diesel::{Connection, RunQueryDsl};
use diesel_lock::{LockConnection, LockGuard, Locker, Strategy};
use nix::sys::signal::{kill, raise, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The leases' ttl: the library bounds the stopped transaction by a quarter of it, at most
/// `STALL`.
const TTL: Duration = Duration::from_secs(8);
/// The idle bound the library sets for an acquisition with `TTL` (min(TTL/4, 2 s)).
const STALL: Duration = Duration::from_secs(2);
/// The ttl of the lease whose heartbeat is stopped inside a batch renewal (renewed every
/// third of it; the bound of the stopped transaction: a quarter, at least 1 s).
const RENEW_TTL: Duration = Duration::from_secs(4);
/// The newcomers' wait.
const WAIT: Duration = Duration::from_secs(3);
/// Room for a loaded test machine: scheduling, connecting, a round trip or two.
const SLACK: Duration = Duration::from_secs(2);
/// Permits of the semaphore case: the parent holds them all.
const N: u32 = 2;

fn lease() -> Strategy {
    Strategy::Lease { ttl: TTL }
}

/// The SQL the parent needs to see the rows locked.
trait Server: LockConnection + Connection + Send + 'static {
    /// Tries to lock the key's lease row without waiting (in a transaction rolled back at
    /// once): false if another transaction holds it.
    fn lease_row_free(&mut self, key: &str) -> bool;
}

/// True if `r` failed because the row is locked (any other failure is the test's).
fn free_or_locked(r: diesel::QueryResult<usize>) -> bool {
    match r {
        Ok(_) => true,
        Err(e) => {
            let m = e.to_string().to_lowercase();
            assert!(m.contains("lock"), "not a lock failure: {e}");
            false
        }
    }
}

#[cfg(feature = "postgres")]
impl Server for diesel::PgConnection {
    fn lease_row_free(&mut self, key: &str) -> bool {
        free_or_locked(self.transaction(|c| {
            diesel::sql_query("SELECT 1 FROM dlock_leases WHERE lock_key = $1 FOR UPDATE NOWAIT")
                .bind::<Text, _>(key)
                .execute(c)
        }))
    }
}

#[cfg(feature = "mysql")]
impl Server for diesel::MysqlConnection {
    fn lease_row_free(&mut self, key: &str) -> bool {
        free_or_locked(self.transaction(|c| {
            diesel::sql_query("SELECT 1 FROM dlock_leases WHERE lock_key = ? FOR UPDATE NOWAIT")
                .bind::<Text, _>(key)
                .execute(c)
        }))
    }
}

child_entry!(child_main);

/// Mode `read` or `permit`: stops itself inside its first acquisition's transaction (once),
/// tries once, and says what it got: `RESULT taken`, `RESULT busy` or `RESULT error`.
fn child_main<C: LockConnection>(h: Harness<C>, ttl: Duration, key: &str, mode: &str) {
    let locker = Locker::builder(h.pool.clone())
        .strategy(Strategy::Lease { ttl })
        .build()
        .unwrap();
    let stopped = AtomicBool::new(false);
    diesel_lock::__test_hooks::set_in_holders_acquire(
        key,
        Arc::new(move || {
            if !stopped.swap(true, Ordering::SeqCst) {
                stop_here();
            }
        }),
    );
    if mode == "renew" {
        return renewing_child(&locker, key, ttl);
    }
    let got = match mode {
        "read" => locker.try_read(key),
        "permit" => locker.try_permit(key, N),
        other => panic!("{other}"),
    };
    match got {
        Ok(Some(g)) => {
            say(&format!("RESULT taken {}", g.token()));
            let _ = g.release();
        }
        Ok(None) => say("RESULT busy"),
        Err(e) => say(&format!("RESULT error {e}")),
    }
}

/// Mode `renew`: holds `key` as an exclusive lease and stops itself inside its heartbeat's
/// first batch renewal that includes it (once), with the rows locked; once continued, says
/// what its guard learnt within 3 ttl: `RESULT lost`, or `RESULT held`.
fn renewing_child<C: LockConnection>(locker: &Locker<C>, key: &str, ttl: Duration) {
    let stopped = AtomicBool::new(false);
    diesel_lock::__test_hooks::set_in_renew_batch(
        key,
        Arc::new(move || {
            if !stopped.swap(true, Ordering::SeqCst) {
                stop_here();
            }
        }),
    );
    let g = locker.lock(key).unwrap();
    match g.loss_watch().wait(3 * ttl) {
        diesel_lock::LockStatus::Lost => say("RESULT lost"),
        other => say(&format!("RESULT {other:?}")),
    }
}

/// In the child, inside a hook: says `STOPPING` and stops the process, the calling thread
/// before this returns, so that it sends nothing more (the rest of the transaction, its
/// COMMIT) until continued. `raise` directs SIGSTOP at the calling thread, which takes it on
/// its way back from the kernel. (`kill` of the own pid directs it at the process: the
/// kernel hands it to the main thread, and the calling thread runs on until that one is
/// scheduled and stops the group; on a loaded machine it had sent the COMMIT by then, and
/// the parent found the rows free.)
fn stop_here() {
    say("STOPPING");
    raise(Signal::SIGSTOP).unwrap();
}

/// Waits until the child has stopped.
fn wait_stopped(kid: &Kid) {
    match waitpid(Pid::from_raw(kid.pid()), Some(WaitPidFlag::WUNTRACED)).unwrap() {
        WaitStatus::Stopped(_, Signal::SIGSTOP) => {}
        other => panic!("the child did not stop: {other:?}"),
    }
}

/// What the newcomers found, and how long each took.
struct Newcomers {
    shared: (bool, Duration),
    exclusive: (bool, Duration),
}

/// A reader or permit newcomer and an exclusive one (`lockers`, built and migrated before
/// the stop: on SQLite a migration writes), side by side, each waiting `WAIT`; gives up on
/// them (continuing the child, so that nothing hangs) after `limit`.
fn newcomers<C: LockConnection>(
    lockers: [Locker<C>; 2],
    key: &str,
    mode: &str,
    kid: &Kid,
    limit: Duration,
) -> Newcomers {
    let (tx, rx) = mpsc::channel();
    for (exclusive, locker) in [false, true].into_iter().zip(lockers) {
        let (locker, key, mode, tx) = (locker, key.to_owned(), mode.to_owned(), tx.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            let got = if exclusive {
                locker.try_lock_for(&key, WAIT)
            } else if mode == "read" {
                locker.try_read_for(&key, WAIT)
            } else {
                locker.try_permit_for(&key, N, WAIT)
            };
            let took = start.elapsed();
            let _ = tx.send((exclusive, got.map(|g| g.is_some()), took));
        });
    }
    let mut out = Newcomers {
        shared: (false, Duration::ZERO),
        exclusive: (false, Duration::ZERO),
    };
    for _ in 0..2 {
        let Ok((exclusive, got, took)) = rx.recv_timeout(limit) else {
            let _ = kill(Pid::from_raw(kid.pid()), Signal::SIGCONT);
            panic!("a newcomer waiting {WAIT:?} had not returned after {limit:?}");
        };
        let got = got.unwrap_or_else(|e| panic!("newcomer (exclusive: {exclusive}): {e}"));
        if exclusive {
            out.exclusive = (got, took);
        } else {
            out.shared = (got, took);
        }
    }
    out
}

/// The parent's holders: a writer (mode `read`: the stopped reader would be a second holder
/// beside it) or all `N` permits (mode `permit`).
fn holders<C: LockConnection>(locker: &Locker<C>, key: &str, mode: &str) -> Vec<LockGuard<C>> {
    if mode == "read" {
        vec![locker.lock(key).unwrap()]
    } else {
        (0..N)
            .map(|_| locker.try_permit(key, N).unwrap().unwrap())
            .collect()
    }
}

fn stopped_inside_acquire<C: Server>(backend: &str, h: &Harness<C>, mode: &str) {
    let key = unique_key(&format!("stopped-{mode}"));
    let locker = h.locker(lease());
    let held = holders(&locker, &key, mode);
    let later = [h.locker(lease()), h.locker(lease())];
    let mut kid = Kid::spawn(backend, &h.url, TTL.as_millis() as u64, &key, mode);
    kid.expect("STOPPING");
    wait_stopped(&kid);
    let stopped_at = Instant::now();
    let mut conn = h.pool.get().unwrap();
    assert!(
        !conn.lease_row_free(&key),
        "{backend}: the stopped child does not hold the lease row: the test proves nothing"
    );

    // A newcomer's attempt waits for a row lock at most 1 s (ROW_WAIT), an exclusive
    // newcomer's statement until the server ends the stopped transaction (STALL): a wait
    // returns by its deadline plus the longer of them.
    let bound = WAIT + STALL + SLACK;
    let seen = newcomers(later, &key, mode, &kid, bound + SLACK);
    for (what, (got, took)) in [("shared", seen.shared), ("exclusive", seen.exclusive)] {
        eprintln!("{backend} {mode}: the {what} newcomer waiting {WAIT:?} returned after {took:?}");
        assert!(
            !got,
            "{backend}: the {what} newcomer got the key beside its holders"
        );
        assert!(
            took <= bound,
            "{backend}: the {what} newcomer waiting {WAIT:?} returned after {took:?} (> {bound:?})"
        );
    }
    // The server has ended the stopped transaction: its locks are gone.
    let by = STALL + SLACK;
    if stopped_at.elapsed() < by {
        std::thread::sleep(by - stopped_at.elapsed());
    }
    assert!(
        conn.lease_row_free(&key),
        "{backend}: the lease row is still locked {:?} after the stop",
        stopped_at.elapsed()
    );
    drop(conn);

    // The holders renewed through the stop: past a whole ttl since it began, none is lost
    // (a lease whose renewals had stayed blocked would have run out by now).
    let past = TTL + Duration::from_secs(1);
    if stopped_at.elapsed() < past {
        std::thread::sleep(past - stopped_at.elapsed());
    }
    for g in &held {
        g.check()
            .unwrap_or_else(|e| panic!("{backend}: a holder lost its lease through the stop: {e}"));
    }

    kill(Pid::from_raw(kid.pid()), Signal::SIGCONT).unwrap();
    let result = kid.expect("RESULT");
    assert!(
        result.starts_with("RESULT error") || result == "RESULT busy",
        "{backend}: the continued child got {result:?} while the key was held"
    );
    for g in held {
        g.release().unwrap();
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pg_reader_stopped_inside_acquire() {
    if let Some(h) = common::pg() {
        stopped_inside_acquire("pg", &h, "read");
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pg_permit_stopped_inside_acquire() {
    if let Some(h) = common::pg() {
        stopped_inside_acquire("pg", &h, "permit");
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pgbouncer_permit_stopped_inside_acquire() {
    if let Some(h) = common::pgbouncer() {
        stopped_inside_acquire("pgbouncer", &h, "permit");
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pgbouncer_reader_stopped_inside_acquire() {
    if let Some(h) = common::pgbouncer() {
        stopped_inside_acquire("pgbouncer", &h, "read");
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_reader_stopped_inside_acquire() {
    if let Some(h) = common::mysql() {
        stopped_inside_acquire("mysql", &h, "read");
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_permit_stopped_inside_acquire() {
    if let Some(h) = common::mysql() {
        stopped_inside_acquire("mysql", &h, "permit");
    }
}

/// A heartbeat stopped (SIGSTOP) inside a batch renewal, with the rows of the leases it
/// renews locked (MariaDB locks them by one statement and renews them by the next), must
/// not keep those keys from everyone for as long as it is stopped: the server ends that
/// transaction after the idle bound, a newcomer's bounded wait returns near its deadline,
/// the key is free once the stopped holder's lease has run out, and the holder, continued,
/// is told it lost the key and never renews it back over the newcomer. (PostgreSQL and
/// SQLite renew a batch in one statement.)
#[cfg(feature = "mysql")]
#[test]
fn mysql_heartbeat_stopped_inside_a_batch_renewal() {
    let Some(h) = common::mysql() else { return };
    let key = unique_key("stopped-renew");
    // Built (and the schema migrated: the child does not migrate) before the child starts.
    let newcomer = h.locker(lease());
    let mut kid = Kid::spawn("mysql", &h.url, RENEW_TTL.as_millis() as u64, &key, "renew");
    kid.expect("STOPPING");
    wait_stopped(&kid);
    let stopped_at = Instant::now();
    let mut conn = h.pool.get().unwrap();
    assert!(
        !conn.lease_row_free(&key),
        "the stopped heartbeat does not hold the lease row: the test proves nothing"
    );
    let bound = holders_stall(RENEW_TTL);
    // A newcomer waiting WAIT: its attempts wait for the row lock at most until the server
    // ends the stopped transaction; it may get the key once the lease ran out (a ttl from
    // the acquisition, under a ttl from the stop).
    let start = Instant::now();
    let got = newcomer.try_lock_for(&key, WAIT).unwrap();
    let took = start.elapsed();
    eprintln!(
        "a newcomer waiting {WAIT:?} returned after {took:?} (got it: {})",
        got.is_some()
    );
    let limit = WAIT + bound + SLACK;
    if took > limit {
        let _ = kill(Pid::from_raw(kid.pid()), Signal::SIGCONT);
        panic!("a newcomer waiting {WAIT:?} returned after {took:?} (> {limit:?})");
    }
    let by = bound + SLACK;
    if stopped_at.elapsed() < by {
        std::thread::sleep(by - stopped_at.elapsed());
    }
    assert!(
        conn.lease_row_free(&key),
        "the lease row is still locked {:?} after the stop",
        stopped_at.elapsed()
    );
    drop(conn);
    // Past a ttl since the stop the stopped holder's lease has run out: the key can be taken.
    let g = match got {
        Some(g) => g,
        None => {
            let past = RENEW_TTL + Duration::from_secs(1);
            if stopped_at.elapsed() < past {
                std::thread::sleep(past - stopped_at.elapsed());
            }
            newcomer
                .try_lock(&key)
                .unwrap()
                .expect("the key is stuck a ttl after its holder's heartbeat stopped")
        }
    };
    kill(Pid::from_raw(kid.pid()), Signal::SIGCONT).unwrap();
    let result = kid.expect("RESULT");
    assert_eq!(
        result, "RESULT lost",
        "the continued holder was not told its loss"
    );
    // The continued heartbeat did not renew the key back over the newcomer.
    g.check()
        .unwrap_or_else(|e| panic!("the newcomer lost the key to the continued holder: {e}"));
    g.release().unwrap();
}

/// The idle bound the library sets for a batch renewal of leases of `ttl`.
fn holders_stall(ttl: Duration) -> Duration {
    (ttl / 4).clamp(Duration::from_secs(1), STALL)
}
