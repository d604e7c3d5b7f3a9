//! `ForUpdate`'s purge beside acquisitions (issue 25): a purge in a tight loop with no grace
//! (`purge(Duration::ZERO)`: every key row nobody has locked goes, however new) beside
//! threads that take and release keys of their own with every kind of acquisition
//! (`try_lock`, `try_lock_for`, `lock`, `try_read`, `try_read_for`, `read`, `try_write`,
//! `write`, `try_permit`), and contended keys shared by all the threads (writers and
//! readers). A key of a thread's own is free whenever the thread asks for it: it must never
//! be reported busy, and no acquisition may fail (a kind row or key row deleted under it, a
//! deadlock of two inserts of a just-deleted row); on the shared keys, never a writer beside
//! anyone else. PostgreSQL and MariaDB on databases of their own; PgBouncer on the shared
//! test database. SQLite has no `ForUpdate`, so nothing to test there.

mod common;

use common::{unique_key, Harness};
use diesel_lock::{LockConnection, LockGuard, Strategy};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

/// Threads taking keys; each has its own keys and shares the contended ones.
const THREADS: usize = 4;
/// Each thread's own keys (reused round after round, so that their rows exist, are purged
/// and are made again).
const OWN: usize = 3;
/// How long a wait on a free key may take before it counts as a failure.
const PATIENCE: Duration = Duration::from_secs(20);

/// What went wrong, by kind of acquisition: `busy <op>` for a free key reported busy,
/// `error <op>: <error>` for a failure.
type Failures = Arc<Mutex<BTreeMap<String, usize>>>;

fn note(failures: &Failures, what: String) {
    *failures.lock().unwrap().entry(what).or_default() += 1;
}

/// One acquisition of a free key by `op`; `None` (after noting it) if it failed.
fn take<C: LockConnection>(
    locker: &diesel_lock::Locker<C>,
    key: &str,
    op: &str,
    failures: &Failures,
) -> Option<LockGuard<C>> {
    let got = match op {
        "try_lock" => locker.try_lock(key),
        "try_lock_for" => locker.try_lock_for(key, PATIENCE),
        "lock" => locker.lock(key).map(Some),
        "try_read" => locker.try_read(key),
        "try_read_for" => locker.try_read_for(key, PATIENCE),
        "read" => locker.read(key).map(Some),
        "try_write" => locker.try_write(key),
        "write" => locker.write(key).map(Some),
        "try_permit" => locker.try_permit(&format!("{key}-sem"), 2),
        _ => unreachable!("{op}"),
    };
    match got {
        Ok(Some(g)) => Some(g),
        Ok(None) => {
            note(failures, format!("busy {op}"));
            None
        }
        Err(e) => {
            note(failures, format!("error {op}: {e}"));
            None
        }
    }
}

const OPS: [&str; 9] = [
    "try_lock",
    "try_lock_for",
    "lock",
    "try_read",
    "try_read_for",
    "read",
    "try_write",
    "write",
    "try_permit",
];

fn purge_beside_acquisitions<C: LockConnection>(h: &Harness<C>, rounds: usize) {
    let prefix = unique_key("fup");
    let locker = h.locker(Strategy::ForUpdate);
    let failures: Failures = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let (purges, purged) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let start = Arc::new(Barrier::new(THREADS + 2));
    // The shared keys' holders: +1 per reader, +1000 per writer.
    let shared: Arc<[AtomicI64; 2]> = Arc::new([AtomicI64::new(0), AtomicI64::new(0)]);
    let overlaps = Arc::new(AtomicU64::new(0));
    let purger = {
        let (l, stop, purges, purged, start) = (
            h.locker(Strategy::ForUpdate),
            stop.clone(),
            purges.clone(),
            purged.clone(),
            start.clone(),
        );
        let failures = failures.clone();
        std::thread::spawn(move || {
            start.wait();
            while !stop.load(Ordering::Relaxed) {
                match l.purge(Duration::ZERO) {
                    Ok(n) => {
                        purged.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(e) => note(&failures, format!("error purge: {e}")),
                }
                purges.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let free_ops = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (locker, failures, prefix, shared, overlaps, start, free_ops) = (
                locker.clone(),
                failures.clone(),
                prefix.clone(),
                shared.clone(),
                overlaps.clone(),
                start.clone(),
                free_ops.clone(),
            );
            std::thread::spawn(move || {
                // Each key's tokens, taken one after another by this thread: increasing.
                let mut last: BTreeMap<String, i64> = BTreeMap::new();
                start.wait();
                for i in 0..rounds {
                    // A free key of this thread's own, by every kind of acquisition in turn.
                    let op = OPS[(i + t) % OPS.len()];
                    let own = format!("{prefix}-own-{t}-{}", i % OWN);
                    if let Some(g) = take(&locker, &own, op, &failures) {
                        free_ops.fetch_add(1, Ordering::Relaxed);
                        let before = last.insert(g.key().to_owned(), g.token());
                        if before.is_some_and(|b| b >= g.token()) {
                            note(&failures, format!("token went back {op}"));
                        }
                        if let Err(e) = g.check() {
                            note(&failures, format!("error check {op}: {e}"));
                        }
                        if let Err(e) = g.release() {
                            note(&failures, format!("error release {op}: {e}"));
                        }
                    }
                    // Every third round, a contended key: a writer or a reader.
                    if i % 3 == 0 {
                        let s = (i / 3) % 2;
                        let key = format!("{prefix}-shared-{s}");
                        let write = (i / 3 + t) % 3 == 0;
                        let got = if write {
                            locker.try_lock_for(&key, PATIENCE)
                        } else {
                            locker.try_read_for(&key, PATIENCE)
                        };
                        match got {
                            Ok(Some(g)) => {
                                let add = if write { 1000 } else { 1 };
                                let before = shared[s].fetch_add(add, Ordering::SeqCst);
                                if (write && before != 0) || (!write && before >= 1000) {
                                    overlaps.fetch_add(1, Ordering::SeqCst);
                                }
                                std::thread::sleep(Duration::from_millis(1));
                                shared[s].fetch_sub(add, Ordering::SeqCst);
                                if let Err(e) = g.release() {
                                    note(&failures, format!("error release shared: {e}"));
                                }
                            }
                            Ok(None) => note(&failures, format!("timeout shared (write {write})")),
                            Err(e) => note(&failures, format!("error shared: {e}")),
                        }
                    }
                }
            })
        })
        .collect();
    start.wait();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    purger.join().unwrap();
    let failures = failures.lock().unwrap().clone();
    let failed: usize = failures.values().sum();
    eprintln!(
        "{} acquisitions of free keys ({} ok), {} purges ({} rows and kinds deleted); \
         {failed} failures: {failures:?}; {} overlaps on the shared keys",
        THREADS * rounds,
        free_ops.load(Ordering::Relaxed),
        purges.load(Ordering::Relaxed),
        purged.load(Ordering::Relaxed),
        overlaps.load(Ordering::SeqCst),
    );
    assert!(
        purged.load(Ordering::Relaxed) > 0,
        "the purge deleted nothing: no race was run"
    );
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
    assert!(failures.is_empty(), "{failures:?}");
}

/// Rounds per thread, from `DLOCK_FUP_ROUNDS` (default 150).
fn rounds() -> usize {
    std::env::var("DLOCK_FUP_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150)
}

#[cfg(feature = "postgres")]
#[test]
fn pg_purge_beside_acquisitions() {
    let Some(h) = common::pg_own_db_sized(THREADS as u32 * 3 + 4) else {
        return;
    };
    purge_beside_acquisitions(&h, rounds());
}

#[cfg(feature = "postgres")]
#[test]
fn pgbouncer_purge_beside_acquisitions() {
    let Some(h) = common::pgbouncer_sized(THREADS as u32 * 3 + 4) else {
        return;
    };
    purge_beside_acquisitions(&h, rounds());
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_purge_beside_acquisitions() {
    let Some(h) = common::mysql_own_db_sized(THREADS as u32 * 3 + 4) else {
        return;
    };
    purge_beside_acquisitions(&h, rounds());
}

/// A purge batch that keeps the gate (its purger stopped, or a session holding it by hand,
/// as here) costs a busy `try_lock` of a held key one bounded wait for the gate (2 s), not
/// one per retry: it took 32 s (16 × 2 s) before, found by the purge's adversary.
fn stuck_gate_costs_one_wait<C: LockConnection>(h: &Harness<C>, hold_gate: &str) {
    let locker = h.locker(Strategy::ForUpdate);
    let key = unique_key("stuck-gate");
    let held = locker.lock(&key).unwrap();
    let mut gate = C::establish(&h.url).unwrap();
    gate.batch_execute(hold_gate).unwrap();
    let other = h.locker(Strategy::ForUpdate);
    let start = std::time::Instant::now();
    assert!(
        other.try_lock(&key).unwrap().is_none(),
        "a held key was taken"
    );
    let took = start.elapsed();
    eprintln!("a busy try_lock beside a stuck purge gate took {took:?}");
    assert!(took < Duration::from_secs(6), "{took:?}");
    drop(gate);
    drop(held);
}

#[cfg(feature = "postgres")]
#[test]
fn pg_stuck_purge_gate_costs_one_wait() {
    if let Some(h) = common::pg() {
        // The gate's two int4 keys ("dloc", "purg"), held by an open transaction.
        stuck_gate_costs_one_wait(
            &h,
            "BEGIN; SELECT pg_advisory_xact_lock(1684828003, 1886745191);",
        );
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_stuck_purge_gate_costs_one_wait() {
    if let Some(h) = common::mysql() {
        stuck_gate_costs_one_wait(
            &h,
            "SELECT GET_LOCK(CONCAT('dlock_purge_gate:', MD5(DATABASE())), 0);",
        );
    }
}

/// An acquirer waiting for the purge gate never takes it (MariaDB): a `dlock run` of a held
/// `ForUpdate` key, started while a stand-in for a purge batch holds the gate and stopped
/// (SIGSTOP) during its wait, leaves the gate free once the batch lets go. It used to wait
/// in `GET_LOCK(gate, 2)`, which the server granted to the stopped session at the batch's
/// release: the gate stayed taken as long as the process was stopped, and `dlock purge`
/// failed after a minute (found by the purge's adversary).
#[cfg(feature = "mysql")]
#[test]
fn mysql_a_stopped_acquirer_keeps_no_purge_gate() {
    use diesel::connection::SimpleConnection;
    use diesel::{Connection, RunQueryDsl};
    use nix::sys::signal::{kill, Signal};
    let Some(h) = common::mysql() else {
        return;
    };
    #[derive(diesel::QueryableByName)]
    struct Free {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        free: i64,
    }
    let gate_free = |c: &mut diesel::MysqlConnection| {
        diesel::sql_query(
            "SELECT CAST(COALESCE(IS_FREE_LOCK(CONCAT('dlock_purge_gate:', MD5(DATABASE()))), 0) \
             AS SIGNED) AS free",
        )
        .get_result::<Free>(c)
        .unwrap()
        .free
    };
    let locker = h.locker(Strategy::ForUpdate);
    let key = unique_key("gate-stopped");
    let held = locker.lock(&key).unwrap();
    let mut batch = diesel::MysqlConnection::establish(&h.url).unwrap();
    batch
        .batch_execute("DO GET_LOCK(CONCAT('dlock_purge_gate:', MD5(DATABASE())), 0);")
        .unwrap();
    let mut acquirer = std::process::Command::new(env!("CARGO_BIN_EXE_dlock"))
        .args([
            "--url",
            &h.url,
            "run",
            "--strategy",
            "for-update",
            "--key",
            &key,
        ])
        .args(["--", "true"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = nix::unistd::Pid::from_raw(acquirer.id() as i32);
    // Inside its wait for the gate (which lasts up to 2 s): the process has connected and
    // found the key held by then.
    std::thread::sleep(Duration::from_millis(700));
    kill(pid, Signal::SIGSTOP).unwrap();
    batch
        .batch_execute("DO RELEASE_LOCK(CONCAT('dlock_purge_gate:', MD5(DATABASE())));")
        .unwrap();
    let mut probe = diesel::MysqlConnection::establish(&h.url).unwrap();
    let free = gate_free(&mut probe);
    kill(pid, Signal::SIGKILL).unwrap();
    let _ = acquirer.wait();
    assert_eq!(free, 1, "the stopped acquirer kept the purge gate");
    drop(held);
}
