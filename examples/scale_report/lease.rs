//! `Lease` locks at scale: one `Locker` (a pool of 8) holding N leases, a loss watch on
//! each guard. Per N: time to acquire all N one after another; then, over two renewal
//! intervals, the process's threads, resident memory, CPU (utime + stime, all of it spent
//! renewing and watching: nothing else runs), renewal statements per second (counted by the
//! library: a batch counts once), every statement the process sent per second (the others
//! part's count: `BEGIN`, `COMMIT` and r2d2's checkout ping included), the pool's
//! connections checked out and open, and, on PostgreSQL, the database's commits per second
//! (`pg_stat_database.xact_commit`); how soon a key taken over by force is told; and, for
//! a child process holding N watched leases that is SIGKILLed, the time until all N are free.
//! With `--kind read`, N readers (one per key) instead of N exclusive leases.

use crate::Args;
use diesel_lock::{admin, AnyConnection, LockStatus, Locker, Strategy};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Takes `key` as `kind` says: an exclusive lease (`lock`) or a reader (`read`).
fn take(l: &Locker<AnyConnection>, kind: &str, key: &str) -> diesel_lock::LockGuard<AnyConnection> {
    match kind {
        "read" => l.read(key).unwrap(),
        "lock" => l.lock(key).unwrap(),
        other => panic!("unknown kind {other}"),
    }
}

fn locker(url: &str, ttl: Duration) -> Locker<AnyConnection> {
    let l = Locker::connect(url)
        .unwrap()
        .pool_size(8)
        .strategy(Strategy::Lease { ttl })
        .build()
        .unwrap();
    l.migrate().unwrap();
    l
}

/// A line of /proc/self/status, its first number (kB for memory).
pub(crate) fn status(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// utime + stime of this process, in seconds (clock ticks of 1/100 s).
pub(crate) fn cpu() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let after = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of stat; 12 and 13 after the name and state.
    (f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()) as f64 / 100.0
}

/// The database's commits so far (PostgreSQL), for commits per second.
pub(crate) fn server_commits(a: &Args) -> Option<i64> {
    #[cfg(feature = "postgres")]
    if a.backend == "pg" {
        use diesel::{Connection, QueryableByName, RunQueryDsl};
        #[derive(QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let mut c = diesel::PgConnection::establish(&a.url).ok()?;
        return diesel::sql_query(
            "SELECT xact_commit AS n FROM pg_stat_database WHERE datname = current_database()",
        )
        .get_result::<N>(&mut c)
        .ok()
        .map(|r| r.n);
    }
    let _ = a;
    None
}

struct Row {
    n: usize,
    acquire: Duration,
    threads: u64,
    rss_mb: f64,
    cpu_pct: f64,
    statements_s: f64,
    commits_s: Option<f64>,
    told: Duration,
    freed: Duration,
    /// Every statement the process sent, per second (the others part's count).
    all_s: f64,
    /// The pool's connections checked out and open, after the window.
    connections: (u32, u32),
}

fn measure(a: &Args, n: usize) -> Row {
    let interval = a.ttl / 3;
    let l = locker(&a.url, a.ttl);
    let prefix = format!("scale-{}-{n}", std::process::id());
    let start = Instant::now();
    let guards: Vec<_> = (0..n)
        .map(|i| take(&l, &a.kind, &format!("{prefix}-{i}")))
        .collect();
    let acquire = start.elapsed();
    let watches: Vec<_> = guards.iter().map(|g| g.loss_watch()).collect();
    // One interval for the renewals of keys taken at different times to come together.
    std::thread::sleep(interval);
    let all0 = crate::others::statements();
    let (s0, c0, k0, t0) = (
        diesel_lock::__renewal_statements(),
        cpu(),
        server_commits(a),
        Instant::now(),
    );
    std::thread::sleep(interval * 2);
    let took = t0.elapsed().as_secs_f64();
    let statements_s = (diesel_lock::__renewal_statements() - s0) as f64 / took;
    let all_s = (crate::others::statements() - all0) as f64 / took;
    let cpu_pct = (cpu() - c0) / took * 100.0;
    let commits_s = k0
        .zip(server_commits(a))
        .map(|(k0, k1)| (k1 - k0) as f64 / took);
    let threads = status("Threads:");
    let rss_mb = status("VmRSS:") as f64 / 1024.0;
    let pool = l.pool().state();
    // A key taken over by force: told at the next renewal.
    let victim = n / 2;
    let mut conn = l.pool().get().unwrap();
    admin::force_release(&mut *conn, &format!("{prefix}-{victim}")).unwrap();
    let forced = Instant::now();
    assert_eq!(watches[victim].wait(a.ttl * 2), LockStatus::Lost);
    let told = forced.elapsed();
    drop(conn);
    assert_eq!(
        watches
            .iter()
            .filter(|w| w.status() == LockStatus::Lost)
            .count(),
        1
    );
    drop(guards);
    let freed = killed_holder(a, n);
    Row {
        n,
        acquire,
        threads,
        rss_mb,
        cpu_pct,
        statements_s,
        commits_s,
        told,
        freed,
        all_s,
        connections: (pool.connections - pool.idle_connections, pool.connections),
    }
}

/// A child holding `n` watched leases is SIGKILLed: the time until none of them is held.
fn killed_holder(a: &Args, n: usize) -> Duration {
    let prefix = format!("scale-kill-{}-{n}", std::process::id());
    let spec = [
        a.url.as_str(),
        &a.ttl.as_secs().to_string(),
        &prefix,
        &n.to_string(),
        &a.kind,
    ]
    .join("\t");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("DLOCK_SCALE_CHILD", spec)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "HELD");
    let l = locker(&a.url, a.ttl);
    let mut conn = l.pool().get().unwrap();
    let held = |conn: &mut AnyConnection| {
        admin::held_locks(conn)
            .unwrap()
            .iter()
            .filter(|i| i.key.starts_with(&prefix))
            .count()
    };
    assert_eq!(held(&mut conn), n);
    child.kill().unwrap();
    let killed = Instant::now();
    child.wait().unwrap();
    while held(&mut conn) > 0 {
        std::thread::sleep(Duration::from_millis(100));
    }
    killed.elapsed()
}

/// The child of `killed_holder`: takes the leases, watches each, says HELD, waits.
pub(crate) fn child(spec: &str) {
    let p: Vec<&str> = spec.split('\t').collect();
    let ttl = Duration::from_secs(p[1].parse().unwrap());
    let n: usize = p[3].parse().unwrap();
    let l = locker(p[0], ttl);
    let guards: Vec<_> = (0..n)
        .map(|i| take(&l, p[4], &format!("{}-{i}", p[2])))
        .collect();
    let _watches: Vec<_> = guards.iter().map(|g| g.loss_watch()).collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "HELD").unwrap();
    out.flush().unwrap();
    drop(out);
    std::thread::sleep(Duration::from_secs(3600));
}

pub(crate) fn report(a: &Args) -> String {
    let rows: Vec<Row> = a.n.iter().map(|&n| measure(a, n)).collect();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n### Lease{}, {} (ttl {:?}, renewed every {:?}; a pool of 8; a loss watch on each guard)\n",
        if a.kind == "read" { " readers" } else { "" },
        a.backend,
        a.ttl,
        a.ttl / 3
    );
    let _ = writeln!(
        s,
        "| N | acquire all | connections checked out / open | threads | RSS MB | CPU % of a core | renewal statements/s | all statements/s | server commits/s | forced takeover told after | all free after SIGKILL |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let _ = writeln!(
            s,
            "| {} | {:.2} s | {} / {} | {} | {:.1} | {:.2} | {:.2} | {:.2} | {} | {:.2} s | {:.2} s |",
            r.n,
            r.acquire.as_secs_f64(),
            r.connections.0,
            r.connections.1,
            r.threads,
            r.rss_mb,
            r.cpu_pct,
            r.statements_s,
            r.all_s,
            r.commits_s.map_or("–".into(), |c| format!("{c:.1}")),
            r.told.as_secs_f64(),
            r.freed.as_secs_f64()
        );
    }
    if let (Some(small), Some(big)) = (
        rows.iter().find(|r| r.n == 1000),
        rows.iter().find(|r| r.n == 10_000),
    ) {
        let ratio = |a: f64, b: f64| {
            if a > 0.0 {
                format!("{:.2}", b / a)
            } else {
                "–".into()
            }
        };
        let _ = writeln!(
            s,
            "\nN = 10⁴ over N = 10³: renewal statements/s ×{}, all statements/s ×{}, connections open ×{}, threads ×{}, CPU ×{}, RSS ×{}.",
            ratio(small.statements_s, big.statements_s),
            ratio(small.all_s, big.all_s),
            ratio(small.connections.1 as f64, big.connections.1 as f64),
            ratio(small.threads as f64, big.threads as f64),
            ratio(small.cpu_pct, big.cpu_pct),
            ratio(small.rss_mb, big.rss_mb),
        );
    }
    s
}
