//! The other strategies at scale (issue 25, `--part others`): `Row` on every backend,
//! `ForUpdate` and `AdvisoryXact` where the backend has them, `Advisory` again (its statements
//! with and without loss watches, which the Advisory part does not count), and what each
//! backend refuses (the exact error, and how fast it comes).
//!
//! One `Locker` (`Locker::connect(url).pool_size(P)`) takes N keys one after another with
//! `lock` and holds them. Then two windows of [`WINDOW`] each: first the guards alone, then
//! with a `loss_watch()` on each guard (after [`SETTLE`] for the watcher's first round). Per
//! window: statements per second sent by this process (every statement of every connection,
//! counted by a diesel `Instrumentation` installed as the default of every connection the
//! process opens: `StartQuery` events, `BEGIN` and `COMMIT` included), on PostgreSQL the
//! database's commits per second (`pg_stat_database.xact_commit`), the CPU (utime + stime)
//! of this process and of the server's sessions of this database (PostgreSQL: the backend
//! processes `pg_stat_activity` lists for the database; MariaDB: the threads
//! `information_schema.PROCESSLIST.TID` lists for it, read in `/proc/<mariadbd>/task`), the
//! process's threads and the pool's connections (checked out, open). Resident memory while
//! all N are held. A `Row` key force-released among the N: time until its watch says
//! `Lost`. A child process holding N locks the same way, SIGKILLed: time until all N are
//! free.
//!
//! `ForUpdate` and `AdvisoryXact` keep a transaction, so a connection, per guard: they are
//! measured at N = [`SESSION_SIZES`] on a pool of N, and at N = 10³ on a pool of 8, where
//! the report records the first acquisition that fails, its error and how long it took.

use crate::lease::{cpu, server_commits, status};
use crate::Args;
use diesel::connection::{Instrumentation, InstrumentationEvent};
use diesel_lock::{admin, AnyConnection, LockGuard, LockStatus, Locker, Strategy};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Each measuring window.
const WINDOW: Duration = Duration::from_secs(5);
/// Before a window: for the loss watcher's first round to pass.
const SETTLE: Duration = Duration::from_secs(2);
/// The sizes at which `ForUpdate` and `AdvisoryXact` are measured, each on a pool of its
/// own size (a connection per guard); PostgreSQL's `max_connections` is 100 on the test
/// server, shared with other sessions, so no more.
const SESSION_SIZES: [usize; 2] = [10, 25];
/// The pool of the `Row` runs and of the over-the-pool attempts.
const POOL: u32 = 8;
/// The N of the over-the-pool attempts.
const BEYOND: usize = 1_000;

/// Statements sent by this process, on every connection it opened.
static STATEMENTS: AtomicU64 = AtomicU64::new(0);

struct Count;

impl Instrumentation for Count {
    fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
        if let InstrumentationEvent::StartQuery { .. } = event {
            STATEMENTS.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The statements this process has sent so far (see [`count_statements`]).
pub(crate) fn statements() -> u64 {
    STATEMENTS.load(Ordering::Relaxed)
}

/// Makes every connection opened from now on count its statements in [`STATEMENTS`].
pub(crate) fn count_statements() {
    diesel::connection::set_default_instrumentation(|| Some(Box::new(Count)))
        .expect("instrumentation");
}

fn strategy(name: &str) -> Strategy {
    match name {
        "row" => Strategy::Row { stale_after: None },
        "for-update" => Strategy::ForUpdate,
        "advisory-xact" => Strategy::AdvisoryXact,
        "advisory" => Strategy::Advisory,
        other => panic!("unknown strategy {other}"),
    }
}

fn locker(url: &str, s: Strategy, pool: u32) -> diesel_lock::Result<Locker<AnyConnection>> {
    let l = Locker::connect(url)?.pool_size(pool).strategy(s).build()?;
    l.migrate()?;
    Ok(l)
}

/// utime + stime (clock ticks) of a process or thread, from its `stat` file.
fn ticks(path: &str) -> Option<u64> {
    let s = std::fs::read_to_string(path).ok()?;
    let f: Vec<&str> = s[s.rfind(')')? + 2..].split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// The MariaDB server's process id (this machine's), for its threads' CPU.
fn mariadbd() -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        matches!(comm.trim(), "mariadbd" | "mysqld").then_some(pid)
    })
}

#[derive(diesel::QueryableByName)]
struct Id {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// CPU ticks so far of each of the server's sessions of this database (not the one asking):
/// PostgreSQL backend processes, MariaDB threads. `None` for SQLite (in the process).
fn server_ticks(a: &Args) -> Option<HashMap<i64, u64>> {
    use diesel::{Connection, RunQueryDsl};
    let (ids, base): (Vec<Id>, String) = match a.backend.as_str() {
        #[cfg(feature = "postgres")]
        "pg" => {
            let mut c = diesel::PgConnection::establish(&a.url).ok()?;
            let ids = diesel::sql_query(
                "SELECT pid::int8 AS n FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .load(&mut c)
            .ok()?;
            (ids, "/proc".into())
        }
        #[cfg(feature = "mysql")]
        "mysql" => {
            let mut c = diesel::MysqlConnection::establish(&a.url).ok()?;
            let ids = diesel::sql_query(
                "SELECT CAST(TID AS SIGNED) AS n FROM information_schema.PROCESSLIST \
                 WHERE DB = DATABASE() AND ID <> CONNECTION_ID()",
            )
            .load(&mut c)
            .ok()?;
            (ids, format!("/proc/{}/task", mariadbd()?))
        }
        _ => return None,
    };
    Some(
        ids.into_iter()
            .filter_map(|i| Some((i.n, ticks(&format!("{base}/{}/stat", i.n))?)))
            .collect(),
    )
}

/// This process's threads by name, `name ×count`.
fn thread_names() -> String {
    let mut names: std::collections::BTreeMap<String, usize> = Default::default();
    for e in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        *names.entry(comm.trim().to_string()).or_default() += 1;
    }
    names
        .iter()
        .map(|(n, c)| format!("{n} ×{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What one window measured.
#[derive(Default, Clone, Copy)]
struct Window {
    statements_s: f64,
    commits_s: Option<f64>,
    cpu_pct: f64,
    server_cpu_pct: Option<f64>,
    threads: u64,
    /// The pool's connections checked out and open at the window's end.
    in_use: u32,
    open: u32,
}

fn window(a: &Args) -> Window {
    let (srv0, k0) = (server_ticks(a), server_commits(a));
    let (s0, c0, t0) = (STATEMENTS.load(Ordering::Relaxed), cpu(), Instant::now());
    std::thread::sleep(WINDOW);
    let took = t0.elapsed().as_secs_f64();
    let (s1, c1) = (STATEMENTS.load(Ordering::Relaxed), cpu());
    let threads = status("Threads:");
    let (k1, srv1) = (server_commits(a), server_ticks(a));
    let server_cpu_pct = srv0.zip(srv1).map(|(t0, t1)| {
        let spent: u64 = t1
            .iter()
            .filter_map(|(id, t)| Some(t.saturating_sub(*t0.get(id)?)))
            .sum();
        spent as f64 / 100.0 / took * 100.0
    });
    Window {
        in_use: 0,
        open: 0,
        statements_s: (s1 - s0) as f64 / took,
        commits_s: k0.zip(k1).map(|(k0, k1)| (k1 - k0) as f64 / took),
        cpu_pct: (c1 - c0) / took * 100.0,
        server_cpu_pct,
        threads,
    }
}

/// One strategy at one N.
struct Held {
    strategy: &'static str,
    n: usize,
    pool: u32,
    acquire: Duration,
    rss_mb: f64,
    bare: Window,
    watched: Window,
    told: Option<Duration>,
    /// The threads by name while watched.
    thread_names: String,
    freed: String,
}

/// Measures one strategy at one N in a process of its own (this program again), so that
/// neither the threads of earlier pools (r2d2's workers end up to 30 s after their pool) nor
/// the memory of earlier runs count; then SIGKILLs another child holding the same.
fn measure(a: &Args, name: &'static str, n: usize, pool: u32) -> Held {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(std::env::args().skip(1))
        .env("DLOCK_SCALE_OTHERS_MEASURE", format!("{name}\t{n}\t{pool}"))
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), "the measuring child failed");
    let text = String::from_utf8(out.stdout).unwrap();
    let line = text.lines().last().unwrap();
    let (nums, names) = line.split_once('|').unwrap();
    let f: Vec<Option<f64>> = nums.split_whitespace().map(|v| v.parse().ok()).collect();
    let w = |i: usize| Window {
        statements_s: f[i].unwrap(),
        commits_s: f[i + 1],
        cpu_pct: f[i + 2].unwrap(),
        server_cpu_pct: f[i + 3],
        threads: f[i + 4].unwrap() as u64,
        in_use: f[i + 5].unwrap() as u32,
        open: f[i + 6].unwrap() as u32,
    };
    Held {
        strategy: name,
        n,
        pool,
        acquire: Duration::from_secs_f64(f[0].unwrap()),
        rss_mb: f[1].unwrap(),
        bare: w(2),
        watched: w(9),
        told: f[16].map(Duration::from_secs_f64),
        thread_names: names.trim().to_string(),
        // The Advisory part above measures its SIGKILL (pg_locks / IS_USED_LOCK, all 10⁴).
        freed: if name == "advisory" {
            "(the Advisory section)".into()
        } else {
            killed_holder(a, name, n, pool)
        },
    }
}

/// The measuring child of [`measure`]: prints its figures on one line.
pub(crate) fn measure_child(a: &Args, spec: &str) {
    let p: Vec<&str> = spec.split('\t').collect();
    let name = match p[0] {
        "row" => "row",
        "for-update" => "for-update",
        "advisory-xact" => "advisory-xact",
        "advisory" => "advisory",
        other => panic!("unknown strategy {other}"),
    };
    let h = hold(a, name, p[1].parse().unwrap(), p[2].parse().unwrap());
    let o = |v: Option<f64>| v.map_or("-".into(), |v| v.to_string());
    let w = |w: &Window| {
        format!(
            "{} {} {} {} {} {} {}",
            w.statements_s,
            o(w.commits_s),
            w.cpu_pct,
            o(w.server_cpu_pct),
            w.threads,
            w.in_use,
            w.open
        )
    };
    println!(
        "{} {} {} {} {} | {}",
        h.acquire.as_secs_f64(),
        h.rss_mb,
        w(&h.bare),
        w(&h.watched),
        o(h.told.map(|t| t.as_secs_f64())),
        h.thread_names
    );
}

/// Takes N keys with one `Locker` and measures them held, without and with loss watches.
fn hold(a: &Args, name: &'static str, n: usize, pool: u32) -> Held {
    let l = locker(&a.url, strategy(name), pool).unwrap();
    let prefix = format!("scale-{name}-{}-{n}", std::process::id());
    let start = Instant::now();
    let guards: Vec<LockGuard<AnyConnection>> = (0..n)
        .map(|i| l.lock(&format!("{prefix}-{i}")).unwrap())
        .collect();
    let acquire = start.elapsed();
    let rss_mb = status("VmRSS:") as f64 / 1024.0;
    let with_pool = |mut w: Window| {
        let state = l.pool().state();
        w.in_use = state.connections - state.idle_connections;
        w.open = state.connections;
        w
    };
    std::thread::sleep(SETTLE);
    let bare = with_pool(window(a));
    let watches: Vec<_> = guards.iter().map(|g| g.loss_watch()).collect();
    std::thread::sleep(SETTLE);
    let watched = with_pool(window(a));
    let thread_names = thread_names();
    // A Row key deleted behind the holder's back: told at the watcher's next probe of it.
    let told = (name == "row").then(|| {
        let victim = n / 2;
        let mut conn = Locker::connect(&a.url)
            .unwrap()
            .pool_size(1)
            .build()
            .unwrap()
            .pool()
            .get()
            .unwrap();
        admin::force_release(&mut *conn, &format!("{prefix}-{victim}")).unwrap();
        let forced = Instant::now();
        assert_eq!(
            watches[victim].wait(Duration::from_secs(600)),
            LockStatus::Lost
        );
        forced.elapsed()
    });
    let lost = watches
        .iter()
        .filter(|w| w.status() == LockStatus::Lost)
        .count();
    assert_eq!(lost, usize::from(told.is_some()), "losses nobody caused");
    drop(watches);
    drop(guards);
    drop(l);
    Held {
        strategy: name,
        n,
        pool,
        acquire,
        rss_mb,
        bare,
        watched,
        told,
        thread_names,
        freed: String::new(),
    }
}

/// A child holding `n` locks of `name` on a pool of `pool` is SIGKILLed: how soon they are
/// all free (taken and released again by this process), or, for `Row` (no `stale_after`),
/// how many are still held 5 s later (then removed with `admin::force_release`).
fn killed_holder(a: &Args, name: &str, n: usize, pool: u32) -> String {
    let prefix = format!("scale-kill-{name}-{}-{n}", std::process::id());
    let spec = [
        a.url.as_str(),
        name,
        &prefix,
        &n.to_string(),
        &pool.to_string(),
    ]
    .join("\t");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("DLOCK_SCALE_OTHERS_CHILD", spec)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "HELD");
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    let l = locker(&a.url, strategy(name), 2).unwrap();
    child.kill().unwrap();
    let killed = Instant::now();
    child.wait().unwrap();
    if name == "row" {
        std::thread::sleep(Duration::from_secs(5));
        let mut conn = l.pool().get().unwrap();
        let held = admin::held_locks(&mut *conn)
            .unwrap()
            .iter()
            .filter(|i| i.key.starts_with(&prefix))
            .count();
        let after = killed.elapsed();
        for k in &keys {
            admin::force_release(&mut *conn, k).unwrap();
        }
        return format!(
            "never: {held} of {n} held {:.1} s after",
            after.as_secs_f64()
        );
    }
    let mut left = keys;
    while !left.is_empty() {
        assert!(
            killed.elapsed() < Duration::from_secs(120),
            "not free after 120 s"
        );
        left.retain(|k| match l.try_lock(k).unwrap() {
            Some(g) => {
                g.release().unwrap();
                false
            }
            None => true,
        });
        if !left.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    format!("{:.3} s", killed.elapsed().as_secs_f64())
}

/// The child of [`killed_holder`]: takes the locks, says HELD, waits to be killed.
pub(crate) fn child(spec: &str) {
    let p: Vec<&str> = spec.split('\t').collect();
    let n: usize = p[3].parse().unwrap();
    let l = locker(p[0], strategy(p[1]), p[4].parse().unwrap()).unwrap();
    let _guards: Vec<_> = (0..n)
        .map(|i| l.lock(&format!("{}-{i}", p[2])).unwrap())
        .collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "HELD").unwrap();
    out.flush().unwrap();
    drop(out);
    std::thread::sleep(Duration::from_secs(3600));
}

/// N = [`BEYOND`] keys on a pool of [`POOL`] with a strategy that keeps a connection per
/// guard: `try_lock` one after another until one fails. What the user gets.
fn beyond_the_pool(a: &Args, name: &str) -> String {
    let l = locker(&a.url, strategy(name), POOL).unwrap();
    let prefix = format!("scale-beyond-{name}-{}", std::process::id());
    let mut guards = Vec::new();
    for i in 0..BEYOND {
        let t = Instant::now();
        match l.try_lock(&format!("{prefix}-{i}")) {
            Ok(Some(g)) => guards.push(g),
            Ok(None) => return format!("the {}th `try_lock` found its key busy", i + 1),
            Err(e) => {
                return format!(
                    "{} acquired; the {}th `try_lock` failed after {:.2} s: `{e}`",
                    guards.len(),
                    i + 1,
                    t.elapsed().as_secs_f64()
                )
            }
        }
    }
    format!("all {BEYOND} acquired")
}

/// What `build` says for a strategy the backend does not have, and how fast.
fn refused(a: &Args, name: &str) -> Option<String> {
    let start = Instant::now();
    let built = Locker::connect(&a.url)
        .unwrap()
        .pool_size(POOL)
        .strategy(strategy(name))
        .build();
    let took = start.elapsed();
    match built {
        Ok(_) => None,
        Err(e) => Some(format!(
            "`{name}` refused by `build` after {:.1} ms (the URL's first connection included): `{e}`",
            took.as_secs_f64() * 1000.0
        )),
    }
}

/// The server's connection limit (`max_connections`), for the over-the-pool notes.
fn max_connections(a: &Args) -> Option<i64> {
    use diesel::{Connection, RunQueryDsl};
    match a.backend.as_str() {
        #[cfg(feature = "postgres")]
        "pg" => {
            let mut c = diesel::PgConnection::establish(&a.url).ok()?;
            diesel::sql_query(
                "SELECT setting::int8 AS n FROM pg_settings WHERE name = 'max_connections'",
            )
            .get_result::<Id>(&mut c)
            .ok()
            .map(|i| i.n)
        }
        #[cfg(feature = "mysql")]
        "mysql" => {
            let mut c = diesel::MysqlConnection::establish(&a.url).ok()?;
            diesel::sql_query("SELECT CAST(@@max_connections AS SIGNED) AS n")
                .get_result::<Id>(&mut c)
                .ok()
                .map(|i| i.n)
        }
        _ => None,
    }
}

fn pct(w: Option<f64>) -> String {
    w.map_or("–".into(), |v| format!("{v:.1}"))
}

/// The load averages (1, 5, 15 min).
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) fn report(a: &Args) -> String {
    let load0 = loadavg();
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for &n in &a.n {
        rows.push(measure(a, "row", n, POOL));
    }
    // Advisory measured the same way, for its statements with and without watches.
    match refused(a, "advisory") {
        Some(why) => notes.push(why),
        None => {
            for &n in &a.n {
                rows.push(measure(a, "advisory", n, POOL));
            }
        }
    }
    for name in ["for-update", "advisory-xact"] {
        if let Some(why) = refused(a, name) {
            notes.push(why);
            continue;
        }
        for n in SESSION_SIZES {
            rows.push(measure(a, name, n, n as u32));
        }
        notes.push(format!(
            "`{name}`, N = {BEYOND} on a pool of {POOL}: {}",
            beyond_the_pool(a, name)
        ));
    }
    if let Some(m) = max_connections(a) {
        notes.push(format!(
            "The server's `max_connections`: {m} (shared by every client of the server): a pool of {BEYOND} for {BEYOND} `ForUpdate` or `AdvisoryXact` guards cannot be had; not tried here, the server is shared."
        ));
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n### Row, Advisory, ForUpdate, AdvisoryXact: {} (ended {}; load average {load0} at the start, {} at the end)\n",
        a.backend,
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC"),
        loadavg()
    );
    let _ = writeln!(
        s,
        "Each pair is *without watch / with a loss watch on each guard*; connections: the pool's at each window's end.\n\n\
         | strategy | N | pool | acquire all | connections open | connections checked out | threads | RSS MB | statements/s | server commits/s | holder CPU % | server CPU % | Row key deleted: told after | all free after SIGKILL |\n\
         |---|---:|---:|---:|---|---|---|---:|---|---|---|---|---:|---|"
    );
    for r in &rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.2} s | {} / {} | {} / {} | {} / {} | {:.1} | {:.1} / {:.1} | {} / {} | {:.2} / {:.2} | {} / {} | {} | {} |",
            r.strategy,
            r.n,
            r.pool,
            r.acquire.as_secs_f64(),
            r.bare.open,
            r.watched.open,
            r.bare.in_use,
            r.watched.in_use,
            r.bare.threads,
            r.watched.threads,
            r.rss_mb,
            r.bare.statements_s,
            r.watched.statements_s,
            pct(r.bare.commits_s),
            pct(r.watched.commits_s),
            r.bare.cpu_pct,
            r.watched.cpu_pct,
            pct(r.bare.server_cpu_pct),
            pct(r.watched.server_cpu_pct),
            r.told.map_or("–".into(), |t| format!("{:.2} s", t.as_secs_f64())),
            r.freed
        );
    }
    s.push('\n');
    // The threads by name at each strategy's largest N.
    for r in &rows {
        if rows.iter().any(|o| o.strategy == r.strategy && o.n > r.n) {
            continue;
        }
        let _ = writeln!(
            s,
            "- threads of `{}`, N = {}, while watched: {}",
            r.strategy, r.n, r.thread_names
        );
    }
    for n in &notes {
        let _ = writeln!(s, "- {n}");
    }
    // Growth from 10³ to 10⁴ (Row), or between the two session sizes.
    let ratio = |x: f64, y: f64| {
        if x > 0.0 {
            format!("×{:.2}", y / x)
        } else if y > 0.0 {
            "0 → >0".into()
        } else {
            "0 → 0".into()
        }
    };
    for name in ["row", "advisory", "for-update", "advisory-xact"] {
        let of: Vec<&Held> = rows.iter().filter(|r| r.strategy == name).collect();
        let pair = if matches!(name, "row" | "advisory") {
            of.iter()
                .find(|r| r.n == 1_000)
                .zip(of.iter().find(|r| r.n == 10_000))
        } else {
            of.first().zip(of.last())
        };
        if let Some((x, y)) = pair {
            let _ = writeln!(
                s,
                "- `{name}`, N = {} over N = {}: statements/s {} / {} (without / with watch), connections open {} / {}, threads {} / {}, holder CPU {} / {}.",
                y.n,
                x.n,
                ratio(x.bare.statements_s, y.bare.statements_s),
                ratio(x.watched.statements_s, y.watched.statements_s),
                ratio(x.bare.open as f64, y.bare.open as f64),
                ratio(x.watched.open as f64, y.watched.open as f64),
                ratio(x.bare.threads as f64, y.bare.threads as f64),
                ratio(x.watched.threads as f64, y.watched.threads as f64),
                ratio(x.bare.cpu_pct, y.bare.cpu_pct),
                ratio(x.watched.cpu_pct, y.watched.cpu_pct),
            );
        }
    }
    s
}
