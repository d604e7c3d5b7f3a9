//! Leader election (`Election`) across processes, on every backend: three candidate
//! processes; the leader is killed (SIGKILL), twice; each time exactly one new leader follows
//! within ttl + 1 s (at once for `Advisory`), and every leader writes its term to a table
//! while it leads: in the table's order the terms never go down and each term has one
//! process, so no two leaders ever wrote in turn. A leader stopped (SIGSTOP) past its ttl is
//! replaced, and told it was deposed as soon as it resumes; its writes, fenced by term, never
//! land after its successor's. Failover times are printed.

mod common;

use common::{unique_key, Harness};
use diesel::connection::SimpleConnection;
use diesel::sql_types::BigInt;
use diesel::Connection;
use diesel::{QueryableByName, RunQueryDsl};
use diesel_lock::{Election, Leadership, LockConnection, Strategy};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[derive(QueryableByName, Debug)]
struct TermRow {
    #[diesel(sql_type = BigInt)]
    term: i64,
    #[diesel(sql_type = BigInt)]
    pid: i64,
}

/// The terms table, per backend (its key column and the id that orders the writes), and the
/// fence in front of it: one row per election with the greatest term written.
trait Terms: LockConnection {
    fn create_terms(&mut self, name: &str);
    fn write_term(&mut self, name: &str, term: i64, pid: i64);
    fn read_terms(&mut self, name: &str) -> Vec<TermRow>;
}

macro_rules! terms {
    ($conn:ty, $create:expr, $ph:expr) => {
        impl Terms for $conn {
            fn create_terms(&mut self, name: &str) {
                let ph: fn(usize) -> String = $ph;
                self.batch_execute($create).expect("create the terms tables");
                diesel::sql_query(format!(
                    "INSERT INTO dlock_test_fence (name, term) VALUES ({}, 0)",
                    ph(1)
                ))
                .bind::<diesel::sql_types::Text, _>(name)
                .execute(self)
                .expect("create the fence");
            }
            fn write_term(&mut self, name: &str, term: i64, pid: i64) {
                // Fenced by the term, as a resource does with a fencing token: the fence row
                // is raised to the term only if no greater term came first, and the write
                // happens in the same transaction, under the fence row's lock. So writes land
                // in term order, and a deposed leader that has not yet noticed cannot write
                // after its successor. (An `INSERT … WHERE NOT EXISTS` alone is no fence on
                // PostgreSQL: two such inserts at once do not see each other.)
                let ph: fn(usize) -> String = $ph;
                // A deadlock victim's transaction was rolled back: it runs again, and the
                // fence decides anew.
                for attempt in 0.. {
                    let written = self.transaction(|c| {
                        let raised = diesel::sql_query(format!(
                            "UPDATE dlock_test_fence SET term = {} WHERE name = {} AND term <= {}",
                            ph(1),
                            ph(2),
                            ph(3)
                        ))
                        .bind::<BigInt, _>(term)
                        .bind::<diesel::sql_types::Text, _>(name)
                        .bind::<BigInt, _>(term)
                        .execute(c)?;
                        if raised == 1 {
                            diesel::sql_query(format!(
                                "INSERT INTO dlock_test_terms (name, term, pid) VALUES ({}, {}, {})",
                                ph(1),
                                ph(2),
                                ph(3)
                            ))
                            .bind::<diesel::sql_types::Text, _>(name)
                            .bind::<BigInt, _>(term)
                            .bind::<BigInt, _>(pid)
                            .execute(c)?;
                        }
                        diesel::QueryResult::Ok(())
                    });
                    match written {
                        Ok(()) => break,
                        Err(e)
                            if attempt < 50
                                && ["Deadlock", "deadlock", "auto-increment", "database is locked"]
                                    .iter()
                                    .any(|m| e.to_string().contains(m)) => {}
                        Err(e) => panic!("write the term: {e:?}"),
                    }
                }
            }
            fn read_terms(&mut self, name: &str) -> Vec<TermRow> {
                let ph: fn(usize) -> String = $ph;
                diesel::sql_query(format!(
                    "SELECT term, pid FROM dlock_test_terms WHERE name = {} ORDER BY id",
                    ph(1)
                ))
                .bind::<diesel::sql_types::Text, _>(name)
                .load(self)
                .expect("read the terms")
            }
        }
    };
}

#[cfg(feature = "sqlite")]
terms!(
    diesel::SqliteConnection,
    "CREATE TABLE IF NOT EXISTS dlock_test_terms (id INTEGER PRIMARY KEY AUTOINCREMENT, \
     name TEXT NOT NULL, term BIGINT NOT NULL, pid BIGINT NOT NULL); \
     CREATE TABLE IF NOT EXISTS dlock_test_fence (name TEXT PRIMARY KEY, term BIGINT NOT NULL)",
    |_| "?".to_owned()
);
#[cfg(feature = "postgres")]
terms!(
    diesel::PgConnection,
    "CREATE TABLE IF NOT EXISTS dlock_test_terms (id BIGSERIAL PRIMARY KEY, \
     name VARCHAR(255) NOT NULL, term BIGINT NOT NULL, pid BIGINT NOT NULL); \
     CREATE TABLE IF NOT EXISTS dlock_test_fence (name VARCHAR(255) PRIMARY KEY, term BIGINT NOT NULL)",
    |n| format!("${n}")
);
#[cfg(feature = "mysql")]
terms!(
    diesel::MysqlConnection,
    "CREATE TABLE IF NOT EXISTS dlock_test_terms (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
     name VARCHAR(255) NOT NULL, term BIGINT NOT NULL, pid BIGINT NOT NULL); \
     CREATE TABLE IF NOT EXISTS dlock_test_fence (name VARCHAR(255) PRIMARY KEY, term BIGINT NOT NULL)",
    |_| "?".to_owned()
);

fn strategy(name: &str, ttl: Duration) -> Strategy {
    match name {
        "lease" => Strategy::Lease { ttl },
        "advisory" => Strategy::Advisory,
        "for-update" => Strategy::ForUpdate,
        other => panic!("unknown strategy {other}"),
    }
}

const TTL: Duration = Duration::from_millis(2000);

/// A candidate: campaigns; prints `LEADER <term>` when elected; while it leads, writes its
/// term to the table every 20 ms (only while `is_leader()`), on a thread of its own.
#[test]
#[ignore = "entry point of the candidate processes"]
fn candidate() {
    let Ok(spec) = std::env::var("DLOCK_CANDIDATE") else {
        return;
    };
    let p: Vec<&str> = spec.split('\t').collect();
    let (backend, url, strat, key) = (p[0], p[1], strategy(p[2], TTL), p[3]);
    fn run<C: Terms>(h: Harness<C>, s: Strategy, key: &str) {
        let e = Election::start(h.locker(s), key).unwrap();
        let events = e.subscribe();
        let pid = i64::from(std::process::id());
        let done = std::sync::atomic::AtomicBool::new(false);
        // The events are printed as they come, never behind a term write (which may wait for
        // a pooled connection, or for the fence row another writer holds).
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Some(term) = e.term() {
                        h.pool.get().unwrap().write_term(key, term, pid);
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            });
            for event in events {
                match event {
                    Leadership::Elected { term } => println!("\nLEADER {term}"),
                    Leadership::Deposed { term } => println!("\nDEPOSED {term}"),
                    _ => {}
                }
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
        });
    }
    match backend {
        #[cfg(feature = "sqlite")]
        "sqlite" => run(common::sqlite_at(url, 4), strat, key),
        #[cfg(feature = "postgres")]
        "pg" => run(
            common::server_at::<diesel::PgConnection>(url, 4),
            strat,
            key,
        ),
        #[cfg(feature = "mysql")]
        "mysql" => run(
            common::server_at::<diesel::MysqlConnection>(url, 4),
            strat,
            key,
        ),
        other => panic!("unknown backend {other}"),
    }
}

/// A candidate process, its lines sent to `tx` as (index, line, when read).
fn spawn(i: usize, spec: &str, tx: mpsc::Sender<(usize, String, Instant)>) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "candidate",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("DLOCK_CANDIDATE", spec)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    std::thread::spawn(move || {
        for line in out.lines() {
            let Ok(line) = line else { return };
            let _ = tx.send((i, line, Instant::now()));
        }
    });
    child
}

/// The next `LEADER` line: which candidate, its term, when.
fn next_leader(
    rx: &mpsc::Receiver<(usize, String, Instant)>,
    within: Duration,
) -> (usize, i64, Instant) {
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok((i, line, at)) = rx.recv_timeout(left) else {
            panic!("no new leader within {within:?}; lines meanwhile: {seen:?}");
        };
        seen.push((i, line.clone()));
        if let Some(at_word) = line.find("LEADER ") {
            let term = line[at_word + "LEADER ".len()..].trim().parse().unwrap();
            return (i, term, at);
        }
    }
}

fn three_candidates<C: Terms>(h: &Harness<C>, backend: &str, strat: &str) {
    h.locker(strategy(strat, TTL)); // migrated
    let key = unique_key("leader");
    h.pool.get().unwrap().create_terms(&key);
    let spec = [backend, &h.url, strat, &key].join("\t");
    let (tx, rx) = mpsc::channel();
    let mut kids: Vec<Child> = (0..3).map(|i| spawn(i, &spec, tx.clone())).collect();
    let (mut leader, mut term, _) = next_leader(&rx, Duration::from_secs(20));
    let mut terms = vec![term];
    let mut failovers = Vec::new();
    for _ in 0..2 {
        // Let the leader write for a while, then kill it.
        std::thread::sleep(Duration::from_millis(300));
        let killed = Instant::now(); // before the signal: see `chaos`
        kids[leader].kill().unwrap(); // SIGKILL
        kids[leader].wait().unwrap();
        let (next, next_term, at) = next_leader(&rx, TTL + Duration::from_secs(5));
        let took = at.saturating_duration_since(killed);
        assert_ne!(next, leader, "a killed candidate cannot lead");
        assert!(next_term > term, "term {next_term} after {term}");
        assert!(
            took <= TTL + Duration::from_secs(1),
            "{backend} {strat}: a new leader only {took:?} after the kill"
        );
        failovers.push(took);
        (leader, term) = (next, next_term);
        terms.push(term);
    }
    std::thread::sleep(Duration::from_millis(300));
    for kid in &mut kids {
        let _ = kid.kill();
        let _ = kid.wait();
    }
    // No other LEADER line came (one leader at a time: the others were waiting).
    while let Ok((_, line, _)) = rx.try_recv() {
        assert!(!line.contains("LEADER "), "an extra leader: {line}");
    }
    check_table(h, &key, &terms);
    eprintln!("FAILOVER {backend} {strat} (ttl {TTL:?}): {failovers:?}; terms {terms:?}");
}

/// In the table's order the terms never go down, each term was written by one process, and
/// the terms written are those elected, in order.
fn check_table<C: Terms>(h: &Harness<C>, key: &str, terms: &[i64]) {
    let rows = h.pool.get().unwrap().read_terms(key);
    assert!(!rows.is_empty());
    let mut seen: Vec<(i64, i64)> = Vec::new();
    for r in &rows {
        match seen.last() {
            Some(&(t, pid)) if t == r.term => assert_eq!(pid, r.pid, "term {t} by two processes"),
            Some(&(t, _)) => assert!(r.term > t, "term {} written after term {t}", r.term),
            None => {}
        }
        if seen.last().map(|&(t, _)| t) != Some(r.term) {
            seen.push((r.term, r.pid));
        }
    }
    let written: Vec<i64> = seen.iter().map(|&(t, _)| t).collect();
    assert_eq!(
        written, terms,
        "the terms written are those elected, in order"
    );
}

/// The next line of candidate `who` holding `word`.
fn next_from(
    rx: &mpsc::Receiver<(usize, String, Instant)>,
    who: usize,
    word: &str,
    within: Duration,
) -> (String, Instant) {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let (i, line, at) = rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no {word:?} from {who}"));
        assert!(
            !(i != who && line.contains("LEADER ")),
            "an extra leader: {line}"
        );
        if i == who && line.contains(word) {
            return (line, at);
        }
    }
}

/// The leader is stopped (SIGSTOP) past its lease's ttl: another candidate is elected; the
/// old leader, resumed (SIGCONT), is told it was deposed at once (its lease's local deadline
/// has passed), and the table (fenced by term) never shows its term after its successor's.
fn stopped_leader<C: Terms>(h: &Harness<C>, backend: &str) {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    h.locker(Strategy::Lease { ttl: TTL });
    let key = unique_key("paused-leader");
    h.pool.get().unwrap().create_terms(&key);
    let spec = [backend, &h.url, "lease", &key].join("\t");
    let (tx, rx) = mpsc::channel();
    let mut kids: Vec<Child> = (0..3).map(|i| spawn(i, &spec, tx.clone())).collect();
    let (leader, term, _) = next_leader(&rx, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(300));
    let pid = Pid::from_raw(kids[leader].id() as i32);
    kill(pid, Signal::SIGSTOP).unwrap();
    let stopped = Instant::now();
    let (next, next_term, at) = next_leader(&rx, TTL + Duration::from_secs(5));
    let took = at.saturating_duration_since(stopped);
    assert_ne!(next, leader);
    assert!(next_term > term);
    assert!(took <= TTL + Duration::from_secs(1), "{backend}: {took:?}");
    std::thread::sleep(Duration::from_millis(300));
    let resumed = Instant::now();
    kill(pid, Signal::SIGCONT).unwrap();
    let (line, told) = next_from(&rx, leader, "DEPOSED", Duration::from_secs(5));
    assert!(line.ends_with(&format!("DEPOSED {term}")), "{line}");
    let told = told.saturating_duration_since(resumed);
    assert!(told < TTL / 3, "{backend}: deposed {told:?} after SIGCONT");
    std::thread::sleep(Duration::from_millis(300));
    for kid in &mut kids {
        let _ = kid.kill();
        let _ = kid.wait();
    }
    check_table(h, &key, &[term, next_term]);
    eprintln!("FAILOVER {backend} lease, leader stopped (ttl {TTL:?}): new leader {took:?} after SIGSTOP; old leader told {told:?} after SIGCONT");
}

#[cfg(feature = "sqlite")]
#[test]
fn sqlite_stopped_leader() {
    stopped_leader(&common::sqlite().unwrap(), "sqlite");
}

#[cfg(feature = "postgres")]
#[test]
fn pg_stopped_leader() {
    if let Some(h) = common::pg() {
        stopped_leader(&h, "pg");
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_stopped_leader() {
    if let Some(h) = common::mysql() {
        stopped_leader(&h, "mysql");
    }
}

#[cfg(feature = "sqlite")]
#[test]
fn sqlite_lease() {
    three_candidates(&common::sqlite().unwrap(), "sqlite", "lease");
}

#[cfg(feature = "postgres")]
#[test]
fn pg_lease() {
    if let Some(h) = common::pg() {
        three_candidates(&h, "pg", "lease");
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pg_advisory() {
    if let Some(h) = common::pg() {
        three_candidates(&h, "pg", "advisory");
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_lease() {
    if let Some(h) = common::mysql() {
        three_candidates(&h, "mysql", "lease");
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_advisory() {
    if let Some(h) = common::mysql() {
        three_candidates(&h, "mysql", "advisory");
    }
}

/// Under attack: 5 candidates; for 12 s the current leader is, in turn, SIGKILLed (and a new
/// candidate started in its place) or SIGSTOPped for 0.1–3 s (past the ttl half the time)
/// and resumed, while another thread runs `purge` and `admin::force_release` of the election
/// key every 150 ms. In the table (fenced by term) the terms never go down and each term was
/// written by one process; after every kill some candidate leads within ttl + 1 s (with
/// forced releases every 150 ms, often much sooner).
fn chaos<C: Terms>(h: &Harness<C>, backend: &str, strat: &str) {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let lease = h.locker(Strategy::Lease { ttl: TTL });
    h.locker(strategy(strat, TTL)); // migrated
    let key = unique_key("chaos-leader");
    h.pool.get().unwrap().create_terms(&key);
    let spec = [backend, &h.url, strat, &key].join("\t");
    let (tx, rx) = mpsc::channel();
    let mut kids: Vec<Child> = (0..5).map(|i| spawn(i, &spec, tx.clone())).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let maintenance = {
        let (stop, pool, key) = (stop.clone(), h.pool.clone(), key.clone());
        std::thread::spawn(move || {
            let mut forced = 0usize;
            while !stop.load(Ordering::Relaxed) {
                lease.purge(Duration::ZERO).unwrap();
                forced += diesel_lock::admin::force_release(&mut *pool.get().unwrap(), &key)
                    .unwrap()
                    .len();
                std::thread::sleep(Duration::from_millis(150));
            }
            forced
        })
    };
    let (mut leader, _, _) = next_leader(&rx, Duration::from_secs(20));
    let (mut kills, mut pauses, mut worst) = (0, 0, Duration::ZERO);
    let started = Instant::now();
    let mut round = 0u64;
    while started.elapsed() < Duration::from_secs(12) {
        round += 1;
        std::thread::sleep(Duration::from_millis(200));
        // Whoever leads now (the last LEADER line so far).
        while let Ok((i, line, _)) = rx.try_recv() {
            if line.contains("LEADER ") {
                leader = i;
            }
        }
        if round % 2 == 0 {
            // The instant before the signal: on `Advisory` the server frees the lock as the
            // process dies, and the next leader's line can be read before this thread, on a
            // loaded machine, runs again after `kill` (a line of the kill's own successor
            // then looked older than the kill, and was skipped below).
            let killed = Instant::now();
            kids[leader].kill().unwrap();
            kids[leader].wait().unwrap();
            kills += 1;
            kids[leader] = spawn(leader, &spec, tx.clone());
            // The first LEADER line read after the kill (a forced release may elect
            // someone else meanwhile: any leader counts).
            let (next, took) = loop {
                let (next, _, at) = next_leader(&rx, TTL + Duration::from_secs(5));
                if at >= killed {
                    break (next, at - killed);
                }
            };
            assert!(
                took <= TTL + Duration::from_secs(1),
                "{backend} {strat}: no leader {took:?} after a kill"
            );
            worst = worst.max(took);
            leader = next;
        } else {
            let pid = Pid::from_raw(kids[leader].id() as i32);
            let pause = Duration::from_millis(100 + (round * 733) % 2900);
            kill(pid, Signal::SIGSTOP).unwrap();
            std::thread::sleep(pause);
            kill(pid, Signal::SIGCONT).unwrap();
            pauses += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let forced = maintenance.join().unwrap();
    for kid in &mut kids {
        let _ = kid.kill();
        let _ = kid.wait();
    }
    let rows = h.pool.get().unwrap().read_terms(&key);
    let mut last: Option<(i64, i64)> = None;
    let mut terms = 0;
    for r in &rows {
        if let Some((t, pid)) = last {
            assert!(r.term >= t, "term {} written after term {t}", r.term);
            if r.term == t {
                assert_eq!(r.pid, pid, "term {t} written by two processes");
            }
        }
        if last.map(|(t, _)| t) != Some(r.term) {
            terms += 1;
        }
        last = Some((r.term, r.pid));
    }
    eprintln!(
        "CHAOS {backend} {strat}: {kills} kills, {pauses} pauses, {forced} forced releases, {terms} terms in {} writes; worst failover after a kill {worst:?}",
        rows.len()
    );
}

#[cfg(feature = "sqlite")]
#[test]
fn sqlite_chaos() {
    chaos(&common::sqlite().unwrap(), "sqlite", "lease");
}

#[cfg(feature = "postgres")]
#[test]
fn pg_chaos_lease() {
    if let Some(h) = common::pg_own_db() {
        chaos(&h, "pg", "lease");
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pg_chaos_advisory() {
    if let Some(h) = common::pg_own_db() {
        chaos(&h, "pg", "advisory");
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_chaos_lease() {
    if let Some(h) = common::mysql_own_db() {
        chaos(&h, "mysql", "lease");
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_chaos_advisory() {
    if let Some(h) = common::mysql_own_db() {
        chaos(&h, "mysql", "advisory");
    }
}
