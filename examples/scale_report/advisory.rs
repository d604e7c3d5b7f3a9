//! The `Advisory` part of the scale report (issue 25): one process holding N = 10, 10³, 10⁴
//! advisory locks on a pool of 8, on PostgreSQL and MariaDB: connections used, threads,
//! resident memory, time to acquire all N one after another and that rate over the floors
//! measured in the same run, and the time until all 10⁴ are free after a SIGKILL of a child
//! process holding them.
//!
//! `main.rs` calls [`child_if_asked`] first (the SIGKILLed holder is this program run again)
//! and then [`report`], which returns a Markdown section.

use diesel::r2d2::ConnectionManager;
use diesel::sql_types::{Array, BigInt, Text};
use diesel::{QueryableByName, RunQueryDsl};
use diesel_lock::{LockConnection, Locker, Strategy};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

type Pool<C> = r2d2::Pool<ConnectionManager<C>>;

/// The sizes measured.
const SIZES: [usize; 3] = [10, 1_000, 10_000];
/// The pool every measured `Locker` gets.
const POOL: u32 = 8;

fn pool<C: LockConnection>(url: &str, size: u32) -> Pool<C> {
    r2d2::Pool::builder()
        .max_size(size)
        .min_idle(Some(0))
        .build(ConnectionManager::<C>::new(url))
        .expect("pool")
}

/// `VmRSS` (kB) and `Threads` of this process.
fn rss_threads() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("Threads:"))
}

fn in_use<C: LockConnection>(pool: &Pool<C>) -> u32 {
    let s = pool.state();
    s.connections - s.idle_connections
}

/// The SQL of a backend that the report needs beside the library.
trait Probe: LockConnection {
    /// One raw cycle on `conn`: try the key's advisory lock, unlock it.
    fn raw_cycle(conn: &mut Self, key: &str);
    /// How many of `keys` are held by anyone.
    fn held(conn: &mut Self, keys: &[String]) -> i64;
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[cfg(feature = "postgres")]
impl Probe for diesel::PgConnection {
    fn raw_cycle(conn: &mut Self, key: &str) {
        let k = diesel_lock::key_hash(key);
        diesel::sql_query("SELECT pg_try_advisory_lock($1)::int::int8 AS n")
            .bind::<BigInt, _>(k)
            .get_result::<Count>(conn)
            .unwrap();
        diesel::sql_query("SELECT pg_advisory_unlock($1)::int::int8 AS n")
            .bind::<BigInt, _>(k)
            .get_result::<Count>(conn)
            .unwrap();
    }
    fn held(conn: &mut Self, keys: &[String]) -> i64 {
        let hashes: Vec<i64> = keys.iter().map(|k| diesel_lock::key_hash(k)).collect();
        // pg_locks shows a key's hash as classid (high half) and objid (low half).
        diesel::sql_query(
            "SELECT count(*)::int8 AS n FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND objsubid = 1 AND ((classid::int8 << 32) | objid::int8) = ANY($1)",
        )
        .bind::<Array<BigInt>, _>(hashes)
        .get_result::<Count>(conn)
        .unwrap()
        .n
    }
}

#[cfg(feature = "mysql")]
impl Probe for diesel::MysqlConnection {
    // The report's keys are plain (lowercase letters, digits, '-'): the lock name is the key.
    fn raw_cycle(conn: &mut Self, key: &str) {
        diesel::sql_query("SELECT CAST(GET_LOCK(?, 0) AS SIGNED) AS n")
            .bind::<Text, _>(key)
            .get_result::<Count>(conn)
            .unwrap();
        diesel::sql_query("SELECT CAST(RELEASE_LOCK(?) AS SIGNED) AS n")
            .bind::<Text, _>(key)
            .get_result::<Count>(conn)
            .unwrap();
    }
    fn held(conn: &mut Self, keys: &[String]) -> i64 {
        let json = format!(
            "[{}]",
            keys.iter()
                .map(|k| format!("\"{k}\""))
                .collect::<Vec<_>>()
                .join(",")
        );
        diesel::sql_query(
            "SELECT COUNT(*) AS n FROM JSON_TABLE(?, '$[*]' COLUMNS (k VARCHAR(255) PATH '$')) t \
             WHERE IS_USED_LOCK(t.k) IS NOT NULL",
        )
        .bind::<Text, _>(json)
        .get_result::<Count>(conn)
        .unwrap()
        .n
    }
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

fn prefix(what: &str) -> String {
    format!(
        "scale-{what}-{}-{}",
        std::process::id(),
        chrono::Utc::now().timestamp_micros()
    )
}

/// Raw cycles a second: a connection checked out of a pool of 8 (as each guard of today's
/// per-guard path did), try + unlock, back to the pool. The library's own statement also
/// draws the token; this floor does not.
fn raw_rate<C: Probe>(url: &str, window: Duration) -> f64 {
    let pool = pool::<C>(url, POOL);
    let key = prefix("raw");
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < window {
        let mut conn = pool.get().unwrap();
        C::raw_cycle(&mut conn, &key);
        n += 1;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// The library's uncontended cycles a second (`lock` + `release` of one key, N = 1, on a
/// pool of 8): the session goes back to the pool between cycles, as a guard's own did.
fn lib_cycle_rate<C: LockConnection>(url: &str, window: Duration) -> f64 {
    let l = Locker::builder(pool::<C>(url, POOL))
        .strategy(Strategy::Advisory)
        .build()
        .unwrap();
    l.migrate().unwrap();
    let key = prefix("cycle");
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < window {
        l.lock(&key).unwrap().release().unwrap();
        n += 1;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

struct Held {
    n: usize,
    connections: u32,
    threads: u64,
    rss_kb: u64,
    secs: f64,
}

/// N locks taken one after another by one `Locker` on a pool of 8, and held.
fn hold_n<C: LockConnection>(url: &str, n: usize) -> Held {
    let l = Locker::builder(pool::<C>(url, POOL))
        .strategy(Strategy::Advisory)
        .build()
        .unwrap();
    l.migrate().unwrap();
    let ks = keys(&prefix("hold"), n);
    // Not timed: the pool's first connection.
    l.lock(&prefix("warm")).unwrap().release().unwrap();
    let start = Instant::now();
    let guards: Vec<_> = ks.iter().map(|k| l.lock(k).unwrap()).collect();
    let secs = start.elapsed().as_secs_f64();
    let (rss_kb, threads) = rss_threads();
    let held = Held {
        n,
        connections: in_use(l.pool()),
        threads,
        rss_kb,
        secs,
    };
    drop(guards);
    held
}

/// Seconds from the SIGKILL of a child process holding `n` locks until all are free.
fn free_after_kill<C: Probe>(backend: &str, url: &str, n: usize) -> f64 {
    let p = prefix("kill");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--advisory-child", backend, url, &n.to_string(), &p])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "held", "the child said {line:?}");
    let ks = keys(&p, n);
    let mut conn = C::establish(url).unwrap();
    assert_eq!(
        C::held(&mut conn, &ks),
        n as i64,
        "all held before the kill"
    );
    let start = Instant::now();
    child.kill().unwrap();
    child.wait().unwrap();
    while C::held(&mut conn, &ks) > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not free after 60 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    start.elapsed().as_secs_f64()
}

/// The child: takes `n` locks through one `Locker` on a pool of 8, says "held", waits.
pub fn child_if_asked() {
    let a: Vec<String> = std::env::args().collect();
    if a.get(1).map(String::as_str) != Some("--advisory-child") {
        return;
    }
    let (backend, url, n, p) = (&a[2], &a[3], a[4].parse().unwrap(), &a[5]);
    fn hold<C: LockConnection>(url: &str, n: usize, p: &str) -> ! {
        let l = Locker::builder(pool::<C>(url, POOL))
            .strategy(Strategy::Advisory)
            .build()
            .unwrap();
        let _guards: Vec<_> = keys(p, n).iter().map(|k| l.lock(k).unwrap()).collect();
        println!("held");
        std::io::stdout().flush().unwrap();
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        std::process::exit(0)
    }
    match backend.as_str() {
        #[cfg(feature = "postgres")]
        "postgresql" => hold::<diesel::PgConnection>(url, n, p),
        #[cfg(feature = "mysql")]
        "mariadb" => hold::<diesel::MysqlConnection>(url, n, p),
        other => panic!("unknown backend {other}"),
    }
}

fn section<C: Probe>(m: &mut String, notes: &mut String, backend: &str, url: &str) {
    let window = Duration::from_secs(3);
    let raw = raw_rate::<C>(url, window);
    let cycle = lib_cycle_rate::<C>(url, window);
    for n in SIZES {
        let h = hold_n::<C>(url, n);
        let rate = h.n as f64 / h.secs;
        writeln!(
            m,
            "| {backend} | {} | {} | {} | {:.1} | {:.3} | {:.0} | {:.2} | {:.2} |",
            h.n,
            h.connections,
            h.threads,
            h.rss_kb as f64 / 1024.0,
            h.secs,
            rate,
            rate / raw,
            rate / cycle,
        )
        .unwrap();
    }
    let kill = free_after_kill::<C>(backend, url, 10_000);
    writeln!(
        notes,
        "\n{backend}: floors in this run: raw try + unlock on a pooled connection {raw:.0}/s; the library's lock + release on one `Locker` {cycle:.0}/s. All 10⁴ locks of a SIGKILLed holder free after **{kill:.3} s**.\n"
    )
    .unwrap();
}

/// The `Advisory` section of the scale report, for the backends given a URL.
pub fn report(pg_url: Option<&str>, mysql_url: Option<&str>) -> String {
    let (mut m, mut notes) = (String::new(), String::new());
    writeln!(
        m,
        "## Advisory\n\nProduced by `cargo run --release --all-features --example scale_report` on {} (UTC), {} cores. One process, one `Locker` (`Strategy::Advisory`) on a pool of {POOL}, N keys locked one after another with `lock` and held together. *connections*: the pool's connections checked out while all N are held; *threads*, *RSS*: the whole report process's. *× raw*: the acquisition rate over the raw floor (a pooled connection checked out, `pg_try_advisory_lock`/`GET_LOCK(k, 0)` and unlock, back to the pool: the per-guard path's statements without the token); *× cycle*: over the library's own lock + release cycle in the same run.\n",
        chrono::Utc::now().format("%Y-%m-%d %H:%M"),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    )
    .unwrap();
    writeln!(
        m,
        "| backend | N | connections | threads | RSS (MiB) | time to acquire all (s) | acquisitions/s | × raw | × cycle |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    .unwrap();
    #[cfg(feature = "postgres")]
    if let Some(url) = pg_url {
        section::<diesel::PgConnection>(&mut m, &mut notes, "postgresql", url);
    }
    #[cfg(feature = "mysql")]
    if let Some(url) = mysql_url {
        section::<diesel::MysqlConnection>(&mut m, &mut notes, "mariadb", url);
    }
    let _ = (pg_url, mysql_url);
    m + &notes
}
