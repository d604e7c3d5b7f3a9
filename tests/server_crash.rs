//! Fencing tokens across crashes of the database server: a private server (never a shared
//! one) is killed with SIGKILL, every process of it at once, while several connections take
//! and release locks as fast as they can; it is restarted, and every token drawn after the
//! restart must exceed every token any client saw before the crash. Three crashes per
//! backend × session strategy.
//!
//! On PostgreSQL the server runs with `commit_delay = 100 ms` (`commit_siblings = 0`): every
//! WAL flush waits that long first, so WAL that is inserted but not yet flushed, which a
//! crash loses, is there for most of the run instead of for microseconds. And the server is
//! killed at the worst moment for a sequence: just after a `nextval` wrote its WAL record
//! (the sequence's `log_cnt` is 32 again), which covers values that clients are about to see
//! long before that record is flushed. (With the tokens of `nextval` alone, or the
//! `ForUpdate` tokens of version 0.1, such values come out again after the restart.)
#![cfg(any(feature = "postgres", feature = "mysql"))]

mod common;

use diesel_lock::{LockConnection, Locker, Strategy};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Clients taking locks at once, each with a `Locker` and pool of its own.
const CLIENTS: usize = 4;
/// Keys the clients take in turn (two shared by all, one of each client's own).
const SHARED_KEYS: usize = 2;

fn locker<C: LockConnection>(url: &str, s: Strategy) -> Locker<C> {
    let l = Locker::builder(common::pool::<C>(url, 2))
        .strategy(s)
        .build()
        .unwrap();
    l.migrate().unwrap();
    l
}

/// What the clients saw before a crash: (key, token).
#[derive(Default)]
struct Seen {
    tokens: Mutex<Vec<(String, i64)>>,
    count: AtomicUsize,
    /// A client saw the moment to crash the server (see `Probe`).
    now: AtomicBool,
    /// The server has been killed: the clients stop (a wait rides out a lost connection
    /// until its deadline, so they would otherwise go on waiting for the restart).
    killed: AtomicBool,
}

/// Asked by a client after each acquisition, once enough tokens were seen: is this the
/// moment to crash the server?
type Probe = Arc<dyn Fn() -> bool + Send + Sync>;

/// Tokens seen before the first crash moment is looked for.
const PER_ROUND: usize = 400;

/// Clients that lock and release until their server goes away, recording every token they
/// were handed. Holds last a moment (some are held when the server dies).
fn stream<C: LockConnection>(
    url: &str,
    s: Strategy,
    seen: &Arc<Seen>,
    probe: &Option<Probe>,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..CLIENTS)
        .map(|i| {
            let (url, seen, probe) = (url.to_owned(), seen.clone(), probe.clone());
            std::thread::spawn(move || {
                let l = locker::<C>(&url, s);
                let keys: Vec<String> = (0..SHARED_KEYS)
                    .map(|k| format!("crash-shared-{k}"))
                    .chain([format!("crash-own-{i}")])
                    .collect();
                for n in 0.. {
                    if seen.killed.load(Ordering::Acquire) {
                        return;
                    }
                    let key = &keys[n % keys.len()];
                    let Ok(g) = l.try_lock_for(key, Duration::from_secs(5)) else {
                        return; // the server is gone
                    };
                    let Some(g) = g else { continue };
                    seen.tokens.lock().unwrap().push((key.clone(), g.token()));
                    let count = seen.count.fetch_add(1, Ordering::Relaxed);
                    if count >= PER_ROUND && probe.as_ref().is_some_and(|p| p()) {
                        seen.now.store(true, Ordering::Release);
                    }
                    std::thread::sleep(Duration::from_micros(300)); // a hold, not a wait
                    if g.release().is_err() {
                        return;
                    }
                }
            })
        })
        .collect()
}

/// Three rounds of: a stream of acquisitions, SIGKILL of the server once the clients have
/// seen `PER_ROUND` tokens and `probe` (if any) says now (or twice as many were seen),
/// restart, and tokens after the restart above all seen before.
fn tokens_survive_server_crashes<C: LockConnection, S>(
    name: &str,
    mut server: S,
    url: &str,
    kill9: impl Fn(&mut S),
    restart: impl Fn(&mut S),
    s: Strategy,
    probe: Option<Probe>,
) {
    let mut highest_ever = 0;
    for round in 0..3 {
        let seen = Arc::new(Seen::default());
        let clients = stream::<C>(url, s, &seen, &probe);
        let deadline = Instant::now() + Duration::from_secs(120);
        let enough = |n: usize| match &probe {
            Some(_) => n >= 2 * PER_ROUND,
            None => n >= PER_ROUND,
        };
        while !seen.now.load(Ordering::Acquire) && !enough(seen.count.load(Ordering::Relaxed)) {
            assert!(
                Instant::now() < deadline,
                "{name}: the clients made no progress"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        seen.killed.store(true, Ordering::Release);
        kill9(&mut server);
        for c in clients {
            c.join().unwrap();
        }
        let before = seen.tokens.lock().unwrap().clone();
        let max_before = before.iter().map(|b| b.1).max().unwrap();
        assert!(
            max_before > highest_ever,
            "{name}: tokens went back within a life"
        );
        restart(&mut server);

        // New connections, every key (the shared ones, a client's own, a new one).
        let l = locker::<C>(url, s);
        let keys = [
            "crash-shared-0",
            "crash-shared-1",
            "crash-own-0",
            "crash-new",
        ];
        let after: Vec<(&str, i64)> = keys
            .iter()
            .cycle()
            .take(40)
            .map(|k| {
                let g = l.lock(k).unwrap();
                let t = g.token();
                g.release().unwrap();
                (*k, t)
            })
            .collect();
        // Per key: what every version of the library promised.
        for (k, t) in &after {
            let key_before = before.iter().filter(|b| b.0 == *k).map(|b| b.1).max();
            assert!(
                key_before.is_none_or(|b| *t > b),
                "{name} round {round}: {k:?} got token {t} after the restart, {key_before:?} before it"
            );
        }
        // Across keys: these strategies' tokens are global.
        let min_after = after.iter().map(|a| a.1).min().unwrap();
        eprintln!(
            "{name} round {round}: {} tokens seen before the crash, highest {max_before}; \
             lowest after the restart {min_after}",
            before.len()
        );
        assert!(
            min_after > max_before,
            "{name} round {round}: token {min_after} after the restart, {max_before} before it"
        );
        highest_ever = after.iter().map(|a| a.1).max().unwrap();
    }
}

#[cfg(feature = "postgres")]
mod pg {
    use super::*;
    use common::private_server::{available, PrivatePg};

    fn run(s: Strategy) {
        if !available("pg") {
            return;
        }
        let pg = PrivatePg::start_configured(
            &[],
            &[("commit_delay", "100000"), ("commit_siblings", "0")],
        );
        let url = pg.url();
        // The sequence has just written WAL ahead for its next 32 values.
        let probe_url = url.clone();
        let probe: Probe = Arc::new(move || {
            #[derive(diesel::QueryableByName)]
            struct LogCnt {
                #[diesel(sql_type = diesel::sql_types::BigInt)]
                log_cnt: i64,
            }
            use diesel::{Connection, RunQueryDsl};
            diesel::PgConnection::establish(&probe_url)
                .ok()
                .and_then(|mut c| {
                    diesel::sql_query("SELECT log_cnt FROM dlock_fence_seq")
                        .get_result::<LogCnt>(&mut c)
                        .ok()
                })
                .is_some_and(|r| r.log_cnt >= 30)
        });
        tokens_survive_server_crashes::<diesel::PgConnection, _>(
            &format!("postgresql {}", s.name()),
            pg,
            &url,
            PrivatePg::kill9,
            PrivatePg::restart,
            s,
            Some(probe),
        );
    }

    #[test]
    fn advisory_tokens_survive_server_crashes() {
        run(Strategy::Advisory);
    }

    #[test]
    fn for_update_tokens_survive_server_crashes() {
        run(Strategy::ForUpdate);
    }

    #[test]
    fn advisory_xact_tokens_survive_server_crashes() {
        run(Strategy::AdvisoryXact);
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use common::private_server::{available, PrivateMaria};

    fn run(s: Strategy) {
        if !available("mysql") {
            return;
        }
        let m = PrivateMaria::start();
        let url = m.url();
        tokens_survive_server_crashes::<diesel::MysqlConnection, _>(
            &format!("mariadb {}", s.name()),
            m,
            &url,
            PrivateMaria::kill9,
            PrivateMaria::restart,
            s,
            None,
        );
    }

    #[test]
    fn advisory_tokens_survive_server_crashes() {
        run(Strategy::Advisory);
    }

    #[test]
    fn for_update_tokens_survive_server_crashes() {
        run(Strategy::ForUpdate);
    }
}
