//! How soon a guard is told that its lock is gone (`LockGuard::loss_watch`), measured on
//! every backend the environment names (as the tests and `bench_report`: SQLite always,
//! `DLOCK_TEST_PG_URL`, `DLOCK_TEST_MYSQL_URL`):
//!
//! - `Lease` (ttl 3 s, so its heartbeat renews every 1 s): the lease is removed by
//!   `admin::force_release` (the loss happens in the database; the holder learns it at its
//!   next renewal), and, separately, taken over by another holder (its row rewritten, as after
//!   an expiry). Each loss lands at a random point of the heartbeat's interval.
//! - The session strategies (`Advisory`, `ForUpdate`, `AdvisoryXact` on PostgreSQL): the
//!   server ends the holder's session (`pg_terminate_backend`); the guard's watcher asks its
//!   session once a second.
//!
//! The time counted is from the statement that took the lock away (its end) to the watch
//! saying `Lost`. The report gives the median, the 90th percentile and the worst of each,
//! and the worst as a multiple of the interval it should keep to.
//!
//! ```sh
//! eval "$(bash scripts/services.sh)"
//! cargo run --release --all-features --example loss_latency -- --out docs/loss.md
//! ```
//! `DLOCK_LOSS_TRIALS` (default 30) sets the trials per case.

#[path = "../benches/support/mod.rs"]
mod support;

use diesel::r2d2::{ConnectionManager, Pool};
use diesel::RunQueryDsl;
use diesel_lock::{admin, LockConnection, LockStatus, Locker, Strategy};
use std::fmt::Write as _;
use std::time::{Duration, Instant};
use support::Db;

const TTL: Duration = Duration::from_secs(3);
/// The lease's heartbeat interval (ttl / 3, the default) and the session watcher's probe.
const INTERVAL: Duration = Duration::from_secs(1);

/// One case's latencies.
struct Case {
    backend: &'static str,
    what: String,
    bound: Duration,
    took: Vec<Duration>,
}

/// A pause that puts the next loss at a random point of the interval (the heartbeat's phase
/// is otherwise the same in every trial).
fn random_phase() -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    INTERVAL.mul_f64((h.finish() % 10_000) as f64 / 10_000.0)
}

/// Takes `key`'s lease over for another holder: the statement per backend.
type Steal<C> = fn(&mut C, &str) -> usize;

const STEAL: &str = "UPDATE dlock_leases SET holder_id = 'someone-else' WHERE lock_key = ?";

/// Removes or takes over `key`'s lease from another connection.
fn take_away<C: LockConnection>(
    pool: &Pool<ConnectionManager<C>>,
    key: &str,
    steal: Option<Steal<C>>,
) {
    let mut c = pool.get().expect("connection");
    match steal {
        Some(steal) => assert_eq!(steal(&mut c, key), 1),
        None => assert_eq!(admin::force_release(&mut *c, key).expect("force").len(), 1),
    }
}

macro_rules! steal {
    ($conn:ty) => {
        (|c: &mut $conn, key: &str| {
            support::sql(STEAL)
                .bind::<diesel::sql_types::Text, _>(key)
                .execute(c)
                .expect("steal")
        }) as Steal<$conn>
    };
}

fn lease_cases<C: LockConnection>(
    backend: &'static str,
    pool: Pool<ConnectionManager<C>>,
    trials: usize,
    steal: Steal<C>,
) -> Vec<Case> {
    let locker = Locker::builder(pool.clone())
        .strategy(Strategy::Lease { ttl: TTL })
        .build()
        .expect("build");
    locker.migrate().expect("migrate");
    let mut cases = Vec::new();
    for steal in [None, Some(steal)] {
        let mut took = Vec::new();
        for _ in 0..trials {
            let key = support::key("loss");
            let g = locker.lock(&key).expect("lock");
            let watch = g.loss_watch();
            std::thread::sleep(random_phase());
            take_away(&pool, &key, steal);
            let gone = Instant::now();
            assert_eq!(watch.wait(TTL), LockStatus::Lost, "{backend}");
            took.push(gone.elapsed());
        }
        cases.push(Case {
            backend,
            what: if steal.is_some() {
                "lease taken over (row rewritten)".into()
            } else {
                "lease force-released".into()
            },
            bound: INTERVAL,
            took,
        });
        eprintln!("{backend}: {}", line(cases.last().unwrap()));
    }
    cases
}

#[cfg(feature = "postgres")]
fn session_cases(url: &str, trials: usize) -> Vec<Case> {
    use diesel::sql_types::{BigInt, Bool, Integer};
    use diesel::{Connection, PgConnection, QueryableByName};
    #[derive(QueryableByName)]
    struct Pid {
        #[diesel(sql_type = Integer)]
        pid: i32,
    }
    #[derive(QueryableByName)]
    struct Done {
        #[diesel(sql_type = Bool)]
        done: bool,
    }
    let mut killer = PgConnection::establish(url).expect("connect");
    let mut cases = Vec::new();
    for s in [
        Strategy::Advisory,
        Strategy::ForUpdate,
        Strategy::AdvisoryXact,
    ] {
        let mut took = Vec::new();
        for _ in 0..trials {
            // A pool of one: the guard's session is the one whose id was read.
            let pool = support::pool::<PgConnection>(url, 1);
            let pid = support::sql("SELECT pg_backend_pid() AS pid")
                .get_result::<Pid>(&mut *pool.get().unwrap())
                .expect("pid")
                .pid;
            let l = Locker::builder(pool).strategy(s).build().expect("build");
            l.migrate().expect("migrate");
            let g = l.lock(&support::key("loss-session")).expect("lock");
            let watch = g.loss_watch();
            std::thread::sleep(random_phase());
            let done = support::sql("SELECT pg_terminate_backend(?::int4, 5000) AS done")
                .bind::<BigInt, _>(i64::from(pid))
                .get_result::<Done>(&mut killer)
                .expect("terminate");
            assert!(done.done);
            let gone = Instant::now();
            assert_eq!(watch.wait(TTL), LockStatus::Lost);
            took.push(gone.elapsed());
        }
        cases.push(Case {
            backend: "postgresql",
            what: format!("{} session ended by the server", s.name()),
            bound: INTERVAL,
            took,
        });
        eprintln!("postgresql: {}", line(cases.last().unwrap()));
    }
    cases
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

fn line(c: &Case) -> String {
    let mut v = c.took.clone();
    v.sort();
    let (p50, p90, max) = (v[v.len() / 2], v[v.len() * 9 / 10], v[v.len() - 1]);
    format!(
        "| {} | {} | {} | {} | {} | {} | {:.3}× |",
        c.backend,
        c.what,
        v.len(),
        ms(p50),
        ms(p90),
        ms(max),
        max.as_secs_f64() / c.bound.as_secs_f64()
    )
}

fn main() {
    let mut out = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = it.next(),
            other => panic!("unknown argument {other:?} (only --out FILE)"),
        }
    }
    let trials: usize = std::env::var("DLOCK_LOSS_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let mut cases = Vec::new();
    for db in support::backends() {
        let url = support::url(db).expect("url");
        match db {
            #[cfg(feature = "postgres")]
            Db::Postgres => {
                cases.extend(lease_cases(
                    "postgresql",
                    support::pool::<diesel::PgConnection>(&url, 4),
                    trials,
                    steal!(diesel::PgConnection),
                ));
                cases.extend(session_cases(&url, trials));
            }
            #[cfg(feature = "mysql")]
            Db::Mysql => cases.extend(lease_cases(
                "mariadb",
                support::pool::<diesel::MysqlConnection>(&url, 4),
                trials,
                steal!(diesel::MysqlConnection),
            )),
            #[cfg(feature = "sqlite")]
            Db::Sqlite => cases.extend(lease_cases(
                "sqlite",
                support::sqlite_pool(4),
                trials,
                steal!(diesel::SqliteConnection),
            )),
            #[allow(unreachable_patterns)]
            _ => {}
        }
    }
    let mut md = String::new();
    writeln!(
        md,
        "## How soon a loss is told (`examples/loss_latency.rs`)\n"
    )
    .unwrap();
    writeln!(
        md,
        "From the end of the statement that took the lock away to `loss_watch()` saying `Lost`; \
         each loss at a random point of the interval. `Lease` ttl 3 s (heartbeat every 1 s); \
         the session strategies' watcher asks every 1 s. Target (issue 14): within one \
         interval. Last column: the worst over the interval.\n"
    )
    .unwrap();
    writeln!(
        md,
        "| backend | loss | trials | median | p90 | worst | worst ÷ interval |"
    )
    .unwrap();
    writeln!(md, "|---|---|---|---|---|---|---|").unwrap();
    for c in &cases {
        writeln!(md, "{}", line(c)).unwrap();
    }
    match out {
        Some(path) => std::fs::write(path, &md).expect("write report"),
        None => print!("{md}"),
    }
}
