//! What the criterion benches and the `bench_report` example share: the backends (from the
//! same environment variables as the tests), each strategy's cycle beside its *raw floor*
//! (the same SQL statements issued directly through diesel on a connection of the same pool,
//! no library code), the Redis yardstick, the contention runner and the scale fixtures.
//!
//! The raw statements are the library's own texts (`diesel_lock::__bench_sql`, never a
//! copy); they go through the same cached-prepared-statement helper (`stmt`, included from
//! src/ by path), so the floor and the library differ only by the library's own code.
#![allow(dead_code, unreachable_pub)]

#[allow(dead_code, unreachable_pub)]
#[path = "../../src/backend/stmt.rs"]
mod stmt;

pub mod kinds;
pub mod raw;
pub mod scale;

use diesel::r2d2::{ConnectionManager, Pool};
use diesel_lock::{LockConnection, Locker, Strategy};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

pub(crate) use stmt::stmt as sql;

/// The lease ttl used throughout: long enough that no heartbeat runs during a cycle.
pub const TTL: Duration = Duration::from_secs(30);

/// The strategies measured, by name: all of them, or those named in `DLOCK_BENCH_ONLY`
/// (comma-separated, e.g. `advisory,for-update`) for a shorter run.
pub fn strategies(backend: Db) -> Vec<Strategy> {
    let mut v = vec![
        Strategy::Row { stale_after: None },
        Strategy::Lease { ttl: TTL },
    ];
    if backend != Db::Sqlite {
        v.push(Strategy::ForUpdate);
        v.push(Strategy::Advisory);
    }
    if backend == Db::Postgres {
        v.push(Strategy::AdvisoryXact);
    }
    match std::env::var("DLOCK_BENCH_ONLY") {
        Ok(only) if !only.is_empty() => v
            .into_iter()
            .filter(|s| only.split(',').any(|o| o.trim() == s.name()))
            .collect(),
        _ => v,
    }
}

/// A backend under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Db {
    Postgres,
    Mysql,
    Sqlite,
}

impl Db {
    pub fn name(self) -> &'static str {
        match self {
            Db::Postgres => "postgresql",
            Db::Mysql => "mariadb",
            Db::Sqlite => "sqlite",
        }
    }
}

/// The URLs of the servers, from the environment; `None` (with a printed line) when unset.
pub fn url(db: Db) -> Option<String> {
    let var = match db {
        Db::Postgres => "DLOCK_TEST_PG_URL",
        Db::Mysql => "DLOCK_TEST_MYSQL_URL",
        Db::Sqlite => return Some(String::new()),
    };
    match std::env::var(var) {
        Ok(u) if !u.is_empty() => Some(match db {
            // A TLS handshake in r2d2's refill thread racing process exit crashes libpq.
            Db::Postgres if !u.contains("sslmode") => {
                let sep = if u.contains('?') { '&' } else { '?' };
                format!("{u}{sep}sslmode=disable")
            }
            _ => u,
        }),
        _ => {
            println!("{var} is not set: {} skipped", db.name());
            None
        }
    }
}

/// Every backend with a URL (SQLite always).
pub fn backends() -> Vec<Db> {
    [Db::Postgres, Db::Mysql, Db::Sqlite]
        .into_iter()
        .filter(|&db| {
            (db != Db::Postgres || cfg!(feature = "postgres"))
                && (db != Db::Mysql || cfg!(feature = "mysql"))
                && url(db).is_some()
        })
        .collect()
}

/// A pool as the tests build it: no idle minimum (a refill racing exit crashes libpq).
pub fn pool<C: LockConnection>(url: &str, size: u32) -> Pool<ConnectionManager<C>> {
    Pool::builder()
        .max_size(size)
        .min_idle(Some(0))
        .connection_timeout(Duration::from_secs(30))
        .build(ConnectionManager::<C>::new(url))
        .expect("pool")
}

/// The SQLite database every SQLite measurement of one process uses (a temp file, WAL,
/// synchronous = NORMAL as `connect` sets it).
pub fn sqlite_path() -> &'static str {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| tempfile::tempdir().expect("tempdir"));
    Box::leak(
        dir.path()
            .join("bench.db")
            .to_str()
            .unwrap()
            .to_owned()
            .into_boxed_str(),
    )
}

#[cfg(feature = "sqlite")]
pub fn sqlite_pool(size: u32) -> Pool<ConnectionManager<diesel::SqliteConnection>> {
    Pool::builder()
        .max_size(size)
        .min_idle(Some(0))
        .connection_timeout(Duration::from_secs(30))
        .connection_customizer(Box::new(diesel_lock::SqliteTuning::default()))
        .build(ConnectionManager::new(sqlite_path()))
        .expect("pool")
}

/// One acquire + release of a key, whatever the connection type: what the contention runner
/// and the cycle measurements call.
pub trait Cycle: Send + Sync {
    fn cycle(&self, key: &str);
    /// Takes the lock; the closure releases it.
    fn acquire(&self, key: &str) -> Box<dyn FnOnce()>;
    /// Takes the key as a reader (`Lease` only); the closure releases it.
    fn acquire_read(&self, key: &str) -> Box<dyn FnOnce()>;
    /// Takes one of `n` permits (`Lease` only); the closure releases it.
    fn acquire_permit(&self, key: &str, n: u32) -> Box<dyn FnOnce()>;
    fn purge(&self, idle: Duration) -> u64;
}

impl<C: LockConnection> Cycle for Locker<C> {
    fn cycle(&self, key: &str) {
        self.lock(key).expect("lock").release().expect("release");
    }
    fn acquire(&self, key: &str) -> Box<dyn FnOnce()> {
        let g = self.lock(key).expect("lock");
        Box::new(move || g.release().expect("release"))
    }
    fn acquire_read(&self, key: &str) -> Box<dyn FnOnce()> {
        let g = self.read(key).expect("read");
        Box::new(move || g.release().expect("release"))
    }
    fn acquire_permit(&self, key: &str, n: u32) -> Box<dyn FnOnce()> {
        let g = self.permit(key, n).expect("permit");
        Box::new(move || g.release().expect("release"))
    }
    fn purge(&self, idle: Duration) -> u64 {
        Locker::purge(self, idle).expect("purge")
    }
}

/// A `Locker` of `strategy` on `db` over its own pool of `size` connections, as a separate
/// process would have. On PostgreSQL, Row and Lease lockers listen for releases.
pub fn locker(db: Db, strategy: Strategy, size: u32) -> Arc<dyn Cycle> {
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql")),
        allow(unused_variables)
    )]
    let url = url(db).expect("url");
    match db {
        #[cfg(feature = "postgres")]
        Db::Postgres => {
            let l = Locker::builder(pool::<diesel::PgConnection>(&url, size))
                .strategy(strategy)
                .listen_url(&url)
                .build()
                .expect("build");
            l.migrate().expect("migrate");
            Arc::new(l)
        }
        #[cfg(feature = "mysql")]
        Db::Mysql => {
            let l = Locker::builder(pool::<diesel::MysqlConnection>(&url, size))
                .strategy(strategy)
                .build()
                .expect("build");
            l.migrate().expect("migrate");
            Arc::new(l)
        }
        #[cfg(feature = "sqlite")]
        Db::Sqlite => {
            let l = Locker::builder(sqlite_pool(size))
                .strategy(strategy)
                .build()
                .expect("build");
            l.migrate().expect("migrate");
            Arc::new(l)
        }
        #[allow(unreachable_patterns)]
        _ => unreachable!("backend not compiled in"),
    }
}

/// A key no other run of this program uses.
pub fn key(what: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "bench-{what}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// How threads compete in a contention run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// All threads share one `Locker`: its in-process queue hands the lock over locally.
    OneLocker,
    /// Each thread has its own `Locker` and pool, as separate processes would.
    LockerPerThread,
}

impl Sharing {
    pub fn name(self) -> &'static str {
        match self {
            Sharing::OneLocker => "one locker",
            Sharing::LockerPerThread => "locker per thread",
        }
    }
}

/// The lockers for `threads` competing threads.
pub fn lockers(
    db: Db,
    strategy: Strategy,
    threads: usize,
    sharing: Sharing,
) -> Vec<Arc<dyn Cycle>> {
    match sharing {
        // Session strategies keep a connection per holder and per waiter.
        Sharing::OneLocker => {
            let one = locker(db, strategy, threads as u32 + 2);
            vec![one; threads]
        }
        Sharing::LockerPerThread => (0..threads).map(|_| locker(db, strategy, 2)).collect(),
    }
}

/// What a contention run measured.
#[derive(Debug, Clone)]
pub struct Contention {
    pub elapsed: Duration,
    /// Acquisitions per thread.
    pub per_thread: Vec<u64>,
}

impl Contention {
    pub fn total(&self) -> u64 {
        self.per_thread.iter().sum()
    }
    pub fn per_second(&self) -> f64 {
        self.total() as f64 / self.elapsed.as_secs_f64()
    }
    /// The fewest acquisitions of a thread over the most (1.0: perfectly even).
    pub fn fairness(&self) -> f64 {
        let min = *self.per_thread.iter().min().unwrap_or(&0);
        let max = *self.per_thread.iter().max().unwrap_or(&1);
        min as f64 / max.max(1) as f64
    }
}

/// Thread `i` locks `keys[i % keys.len()]` with `lockers[i]` until `stop` says so: either a
/// total number of acquisitions (criterion's `iters`) or a duration.
pub enum Stop {
    After(u64),
    For(Duration),
}

pub fn contend(lockers: &[Arc<dyn Cycle>], keys: &[String], stop: Stop) -> Contention {
    let threads = lockers.len();
    let start = Arc::new(Barrier::new(threads + 1));
    let done = Arc::new(AtomicBool::new(false));
    let taken = Arc::new(AtomicU64::new(0));
    let limit = match stop {
        Stop::After(n) => n,
        Stop::For(_) => u64::MAX,
    };
    let handles: Vec<_> = lockers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let (l, key) = (l.clone(), keys[i % keys.len()].clone());
            let (start, done, taken) = (start.clone(), done.clone(), taken.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut mine = 0u64;
                while !done.load(Ordering::Relaxed) && taken.fetch_add(1, Ordering::Relaxed) < limit
                {
                    l.cycle(&key);
                    mine += 1;
                }
                mine
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    if let Stop::For(d) = stop {
        std::thread::sleep(d); // the measurement window, not synchronisation
        done.store(true, Ordering::Relaxed);
    }
    let per_thread: Vec<u64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    Contention {
        elapsed: t0.elapsed(),
        per_thread,
    }
}

/// Redis `SET key token NX PX ttl` + Lua compare-and-delete: the yardstick, not a backend.
pub struct Redis {
    conn: std::sync::Mutex<redis::Connection>,
    script: redis::Script,
}

impl Redis {
    /// `None` (with a printed line) without `DLOCK_TEST_REDIS_URL` or a reachable server.
    pub fn connect() -> Option<Redis> {
        let Ok(url) = std::env::var("DLOCK_TEST_REDIS_URL") else {
            println!("DLOCK_TEST_REDIS_URL is not set: the Redis reference is skipped");
            return None;
        };
        let conn = redis::Client::open(url)
            .and_then(|c| c.get_connection())
            .map_err(|e| println!("redis: {e}: the Redis reference is skipped"))
            .ok()?;
        Some(Redis {
            conn: std::sync::Mutex::new(conn),
            script: redis::Script::new(
                "if redis.call('get', KEYS[1]) == ARGV[1] then \
                   return redis.call('del', KEYS[1]) else return 0 end",
            ),
        })
    }

    /// One uncontended acquire + release.
    pub fn cycle(&self, key: &str, token: &str) {
        let mut c = self.conn.lock().unwrap();
        let set: Option<String> = redis::cmd("SET")
            .arg(key)
            .arg(token)
            .arg("NX")
            .arg("PX")
            .arg(TTL.as_millis() as u64)
            .query(&mut *c)
            .expect("SET");
        assert!(set.is_some(), "redis key {key} was held");
        let deleted: i64 = self
            .script
            .key(key)
            .arg(token)
            .invoke(&mut *c)
            .expect("compare-and-delete");
        assert_eq!(deleted, 1);
    }
}

/// The Redis yardstick under contention: `threads` threads, each on a connection of its
/// own (as separate processes), take `key` with `SET NX PX`, sleep 1 ms and retry while it
/// is held, and release with the Lua compare-and-delete, for `window`. `None` without
/// `DLOCK_TEST_REDIS_URL`.
pub fn redis_contend(threads: usize, key: &str, window: Duration) -> Option<Contention> {
    let url = std::env::var("DLOCK_TEST_REDIS_URL").ok()?;
    let start = Arc::new(Barrier::new(threads + 1));
    let done = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let (start, done, key) = (start.clone(), done.clone(), key.to_owned());
            let mut c = redis::Client::open(url.as_str())
                .and_then(|c| c.get_connection())
                .expect("redis connection");
            std::thread::spawn(move || {
                let script = redis::Script::new(
                    "if redis.call('get', KEYS[1]) == ARGV[1] then \
                       return redis.call('del', KEYS[1]) else return 0 end",
                );
                let token = format!("t{i}");
                start.wait();
                let mut mine = 0u64;
                while !done.load(Ordering::Relaxed) {
                    let set: Option<String> = redis::cmd("SET")
                        .arg(&key)
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(TTL.as_millis() as u64)
                        .query(&mut c)
                        .expect("SET");
                    if set.is_none() {
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    }
                    let deleted: i64 = script.key(&key).arg(&token).invoke(&mut c).expect("del");
                    assert_eq!(deleted, 1);
                    mine += 1;
                }
                mine
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    std::thread::sleep(window); // the measurement window, not synchronisation
    done.store(true, Ordering::Relaxed);
    let per_thread: Vec<u64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    Some(Contention {
        elapsed: t0.elapsed(),
        per_thread,
    })
}

/// Cycles per second of `f`, run for `round`.
pub fn rate(round: Duration, f: &mut dyn FnMut()) -> f64 {
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < round {
        f();
        n += 1;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the contestants round-robin (`rounds` times after one warm-up round each) and
/// returns each one's median rate, so that the drift of a shared machine cancels.
pub fn interleaved(
    round: Duration,
    rounds: usize,
    contestants: &mut [&mut dyn FnMut()],
) -> Vec<f64> {
    for c in contestants.iter_mut() {
        rate(round / 2, *c);
    }
    let mut rates = vec![Vec::new(); contestants.len()];
    for _ in 0..rounds {
        for (c, r) in contestants.iter_mut().zip(&mut rates) {
            r.push(rate(round, *c));
        }
    }
    rates.iter().map(|r| median(r)).collect()
}
