//! Waiting across processes (`Row` and `Lease` waiters in the key's line): writes
//! docs/waiting.md, which `bench_report` carries into BENCHMARKS.md.
//!
//! Every `Locker` is built as a user gets it: `Locker::connect(url)?.build()`.
//! - Hand-overs: 8 threads with a `Locker` each, and 8 OS processes (this program run
//!   again), lock and release one key for a few seconds; hand-overs per second and fairness
//!   (fewest acquisitions of one over the most), beside PostgreSQL `Advisory` in the same run.
//! - Wake-ups per release (PostgreSQL): a connection of this program's own `LISTEN`s on
//!   every channel named in the line meanwhile and counts the notifications, per release.
//! - CPU: a process whose thread waits 5 s for a held key, `/proc/self/stat` utime + stime.
//!
//! ```text
//! eval "$(bash scripts/services.sh)"
//! cargo run --release --all-features --example wait_report -- --out docs/waiting.md
//! ```
//!
//! `--backend mysql` (or `postgresql`, `mariadb`, `sqlite`) measures that backend only;
//! `--threads URL STRATEGY`, `--processes URL STRATEGY` and `--cpu URL STRATEGY` measure one
//! figure.

use diesel_lock::{Locker, Strategy};
use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WINDOW: Duration = Duration::from_secs(4);

fn strategy(name: &str) -> Strategy {
    match name {
        "row" => Strategy::Row { stale_after: None },
        "lease" => Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        "advisory" => Strategy::Advisory,
        other => panic!("unknown strategy {other}"),
    }
}

fn locker(url: &str, s: &str) -> Locker<diesel_lock::AnyConnection> {
    let l = Locker::connect(url)
        .unwrap()
        .strategy(strategy(s))
        .build()
        .unwrap();
    l.migrate().unwrap();
    l
}

/// Locks and releases `key` until `stop`; the count. All start at `go`.
fn cycle(l: &Locker<diesel_lock::AnyConnection>, key: &str, stop: &AtomicBool) -> u64 {
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        l.lock(key).unwrap().release().unwrap();
        n += 1;
    }
    n
}

/// Hand-overs per second and fairness from per-waiter counts.
fn summary(counts: &[u64], took: Duration) -> (f64, f64) {
    let total: u64 = counts.iter().sum();
    let (min, max) = (*counts.iter().min().unwrap(), *counts.iter().max().unwrap());
    (
        total as f64 / took.as_secs_f64(),
        min as f64 / max.max(1) as f64,
    )
}

/// 8 threads, a `Locker` each (built and warmed up before the window).
fn threads(url: &str, s: &str) -> (f64, f64) {
    let key = format!("wait-threads-{}-{:?}", std::process::id(), Instant::now());
    let lockers: Vec<_> = (0..8).map(|_| locker(url, s)).collect();
    for l in &lockers {
        drop(l.lock(&key).unwrap());
    }
    let stop = Arc::new(AtomicBool::new(false));
    let go = Arc::new(std::sync::Barrier::new(9));
    let handles: Vec<_> = lockers
        .into_iter()
        .map(|l| {
            let (key, stop, go) = (key.clone(), stop.clone(), go.clone());
            std::thread::spawn(move || {
                go.wait();
                cycle(&l, &key, &stop)
            })
        })
        .collect();
    go.wait();
    let start = Instant::now();
    std::thread::sleep(WINDOW);
    stop.store(true, Ordering::Relaxed);
    let counts: Vec<u64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    summary(&counts, start.elapsed())
}

/// 8 OS processes (this program with `--child`), started together by a file that appears.
fn processes(url: &str, s: &str) -> (f64, f64) {
    let dir = std::env::temp_dir().join(format!("wait-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let go = dir.join("go");
    let _ = std::fs::remove_file(&go);
    let key = format!("wait-procs-{}-{:?}", std::process::id(), Instant::now());
    let kids: Vec<_> = (0..8)
        .map(|_| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--child", url, s, &key, go.to_str().unwrap()])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Each child says READY once its Locker is built and warmed up.
    let mut kids: Vec<_> = kids
        .into_iter()
        .map(|mut k| {
            let out = k.stdout.take().unwrap();
            let mut r = std::io::BufReader::new(out);
            let mut line = String::new();
            std::io::BufRead::read_line(&mut r, &mut line).unwrap();
            assert_eq!(line.trim(), "READY");
            (k, r)
        })
        .collect();
    std::fs::write(&go, b"").unwrap();
    let counts: Vec<u64> = kids
        .iter_mut()
        .map(|(k, r)| {
            let mut line = String::new();
            std::io::BufRead::read_line(r, &mut line).unwrap();
            assert!(k.wait().unwrap().success());
            line.trim().parse().unwrap()
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    log::info!("{s} across processes, acquisitions of each: {counts:?}");
    summary(&counts, WINDOW)
}

/// `DLOCK_QUERY_PROFILE=DIR`: every child counts the statements its connections run (by
/// their text's start) and writes the counts to a file of its own in DIR once done: what a
/// hand-over costs, statement by statement (divide by the hand-overs of the run).
static QUERIES: std::sync::Mutex<Option<std::collections::BTreeMap<String, u64>>> =
    std::sync::Mutex::new(None);

fn count_queries() -> Option<Box<dyn diesel::connection::Instrumentation>> {
    Some(Box::new(
        |event: diesel::connection::InstrumentationEvent<'_>| {
            if let diesel::connection::InstrumentationEvent::StartQuery { query, .. } = event {
                let text = query.to_string();
                let text = text.split("-- binds").next().unwrap_or("");
                let text: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
                let text: String = text.chars().take(90).collect();
                let mut q = QUERIES.lock().unwrap();
                *q.get_or_insert_with(Default::default)
                    .entry(text)
                    .or_default() += 1;
            }
        },
    ))
}

fn child(url: &str, s: &str, key: &str, go: &str) {
    let profile = std::env::var("DLOCK_QUERY_PROFILE").ok();
    if profile.is_some() {
        diesel::connection::set_default_instrumentation(count_queries).unwrap();
    }
    let l = locker(url, s);
    drop(l.lock(key).unwrap());
    println!("READY");
    while !std::path::Path::new(go).exists() {
        std::thread::sleep(Duration::from_micros(200));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    std::thread::spawn(move || {
        std::thread::sleep(WINDOW);
        s2.store(true, Ordering::Relaxed);
    });
    let n = cycle(&l, key, &stop);
    if let Some(dir) = profile {
        let q = QUERIES.lock().unwrap().take().unwrap_or_default();
        let mut out = format!("acquisitions {n}\n");
        for (text, count) in q {
            out.push_str(&format!("{count}\t{text}\n"));
        }
        std::fs::write(format!("{dir}/{}.txt", std::process::id()), out).unwrap();
    }
    println!("{n}");
}

/// PostgreSQL: notifications per release while 8 `Locker`s contend (threads).
#[cfg(feature = "postgres")]
fn wakeups(url: &str, s: &str) -> f64 {
    use diesel::connection::SimpleConnection;
    use diesel::{Connection, RunQueryDsl};
    #[derive(diesel::QueryableByName)]
    struct Ch {
        #[diesel(sql_type = diesel::sql_types::Text)]
        channel: String,
    }
    let key = format!("wait-wakeups-{}-{:?}", std::process::id(), Instant::now());
    let lockers: Vec<_> = (0..8).map(|_| locker(url, s)).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = lockers
        .into_iter()
        .map(|l| {
            let (key, stop) = (key.clone(), stop.clone());
            std::thread::spawn(move || cycle(&l, &key, &stop))
        })
        .collect();
    // The counting connection: LISTEN on each channel as it shows up in the key's line.
    let mut c = diesel::PgConnection::establish(url).unwrap();
    let mut heard = std::collections::HashSet::new();
    let mut notes = 0u64;
    let start = Instant::now();
    let mut listening_since = None;
    while start.elapsed() < WINDOW {
        let channels: Vec<Ch> = diesel::sql_query(
            "SELECT DISTINCT channel FROM dlock_waiters WHERE lock_key = $1 AND channel IS NOT NULL",
        )
        .bind::<diesel::sql_types::Text, _>(&key)
        .load(&mut c)
        .unwrap();
        for ch in channels {
            if heard.insert(ch.channel.clone()) {
                // Channel names are the library's own (`dlock_v_` and hex digits); grants
                // go to the channel's grants channel (`_g` after it).
                c.batch_execute(&format!("LISTEN {0}; LISTEN {0}_g", ch.channel))
                    .unwrap();
            }
        }
        if heard.len() == 8 && listening_since.is_none() {
            listening_since = Some(Instant::now());
            notes = 0;
        }
        notes += c.notifications_iter().filter(|n| n.is_ok()).count() as u64;
        std::thread::sleep(Duration::from_millis(2));
    }
    stop.store(true, Ordering::Relaxed);
    let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    // Releases while all 8 channels were heard: the share of the window.
    let heard_for = listening_since.map_or(Duration::ZERO, |t| t.elapsed());
    let releases = total as f64 * heard_for.as_secs_f64() / start.elapsed().as_secs_f64();
    notes as f64 / releases.max(1.0)
}

/// The uncontended lock + release cycle of one thread with one `Locker`, per second: what a
/// hand-over across processes is measured against.
fn one_thread(url: &str, s: &str) -> f64 {
    let l = locker(url, s);
    let key = format!("wait-one-{}-{:?}", std::process::id(), Instant::now());
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let n = std::thread::scope(|sc| {
        let h = sc.spawn(|| cycle(&l, &key, &stop));
        std::thread::sleep(WINDOW / 2);
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap()
    });
    n as f64 / start.elapsed().as_secs_f64()
}

fn cpu_seconds() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
}

/// Percent of one core this process used while one of its threads waited 5 s for a key held
/// by another process (a child holding it).
fn waiting_cpu(url: &str, s: &str) -> f64 {
    let key = format!("wait-cpu-{}-{:?}", std::process::id(), Instant::now());
    let mut holder = Command::new(std::env::current_exe().unwrap())
        .args(["--hold", url, s, &key])
        .stdout(Stdio::piped())
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let mut r = std::io::BufReader::new(holder.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut r, &mut line).unwrap();
    assert_eq!(line.trim(), "HELD");
    let l = locker(url, s);
    let (k, l2) = (key.clone(), l.clone());
    let waiter = std::thread::spawn(move || drop(l2.lock(&k).unwrap()));
    std::thread::sleep(Duration::from_millis(300));
    let (c0, t0) = (cpu_seconds(), Instant::now());
    std::thread::sleep(Duration::from_secs(5));
    let used = (cpu_seconds() - c0) / t0.elapsed().as_secs_f64();
    drop(holder.stdin.take()); // the holder releases and exits
    waiter.join().unwrap();
    holder.wait().unwrap();
    100.0 * used
}

fn hold(url: &str, s: &str, key: &str) {
    let l = locker(url, s);
    let g = l.lock(key).unwrap();
    println!("HELD");
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    g.release().unwrap();
}

fn main() {
    // RUST_LOG=diesel_lock=debug shows the line at work (nothing without it).
    env_logger::init();
    let a: Vec<String> = std::env::args().collect();
    match a.get(1).map(String::as_str) {
        Some("--child") => return child(&a[2], &a[3], &a[4], &a[5]),
        Some("--hold") => return hold(&a[2], &a[3], &a[4]),
        _ => {}
    }
    if a.get(1).map(String::as_str) == Some("--threads") {
        let (t, f) = threads(&a[2], &a[3]);
        println!("{} {}: {t:.0}/s fairness {f:.2}", a[2], a[3]);
        return;
    }
    // The CPU of a waiting process alone, 5 s behind a holder.
    if a.get(1).map(String::as_str) == Some("--cpu") {
        println!("{} {}: cpu {:.2}%", a[2], a[3], waiting_cpu(&a[2], &a[3]));
        return;
    }
    // One figure across processes, beside the one-thread cycle of the same run.
    if a.get(1).map(String::as_str) == Some("--processes") {
        let (p, f) = processes(&a[2], &a[3]);
        let one = one_thread(&a[2], &a[3]);
        println!(
            "{} {}: processes {p:.0}/s fairness {f:.2}, one thread {one:.0}/s, ratio {:.2}",
            a[2],
            a[3],
            p / one
        );
        return;
    }
    let out = a
        .iter()
        .position(|x| x == "--out")
        .map(|i| a[i + 1].clone());
    let sqlite_dir = tempfile::tempdir().unwrap();
    let sqlite = sqlite_dir
        .path()
        .join("wait.db")
        .to_str()
        .unwrap()
        .to_owned();
    let mut backends = vec![("sqlite", sqlite)];
    if let Ok(u) = std::env::var("DLOCK_TEST_PG_URL") {
        backends.insert(0, ("postgresql", u));
    }
    if let Ok(u) = std::env::var("DLOCK_TEST_MYSQL_URL") {
        backends.insert(1, ("mariadb", u));
    }
    // `--backend NAME` (postgresql, mariadb or its alias mysql, sqlite): that one only.
    if let Some(i) = a.iter().position(|x| x == "--backend") {
        let only = match a[i + 1].as_str() {
            "mysql" => "mariadb",
            other => other,
        };
        backends.retain(|(name, _)| *name == only);
        assert!(!backends.is_empty(), "no such backend here: {only}");
    }
    let mut m = String::new();
    writeln!(
        m,
        "## Waiting across processes\n\nProduced by `cargo run --release --all-features --example wait_report -- --out docs/waiting.md` on {} (UTC), {} cores; the configuration a user gets from `Locker::connect(url)?.build()` (on PostgreSQL that includes the listener). 8 waiters on one key, each lock released at once, for {} s per figure. Fairness is the fewest acquisitions of one waiter over the most.\n",
        chrono::Utc::now().format("%Y-%m-%d %H:%M"),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        WINDOW.as_secs()
    )
    .unwrap();
    writeln!(m, "| backend | strategy | a `Locker` each (threads): handoffs/s (fairness) | 8 processes: handoffs/s (fairness) | × Advisory (processes) | one thread alone: cycles/s | processes ÷ one thread | CPU of a process waiting 5 s (% of a core) |\n|---|---|---:|---:|---:|---:|---:|---:|").unwrap();
    let mut wakes = Vec::new();
    for (name, url) in &backends {
        let advisory = (*name == "postgresql").then(|| processes(url, "advisory"));
        for s in ["row", "lease"] {
            let (t, tf) = threads(url, s);
            let (p, pf) = processes(url, s);
            let one = one_thread(url, s);
            let cpu = waiting_cpu(url, s);
            let ratio = advisory.map_or("–".to_owned(), |(a, _)| format!("{:.2}", p / a));
            writeln!(
                m,
                "| {name} | {s} | {t:.0} ({tf:.2}) | {p:.0} ({pf:.2}) | {ratio} | {one:.0} | {:.2} | {cpu:.2} |",
                p / one
            )
            .unwrap();
            eprintln!(
                "{name} {s}: threads {t:.0} ({tf:.2}), processes {p:.0} ({pf:.2}) = {:.2} x one thread ({one:.0}), advisory ratio {ratio}, cpu {cpu:.2}%",
                p / one
            );
            #[cfg(feature = "postgres")]
            if *name == "postgresql" {
                wakes.push((s, wakeups(url, s)));
            }
        }
        if let Some((a, af)) = advisory {
            writeln!(
                m,
                "| {name} | advisory (reference) | – | {a:.0} ({af:.2}) | 1.00 | – | – | – |"
            )
            .unwrap();
        }
    }
    if !wakes.is_empty() {
        writeln!(m, "\nNotifications per release on PostgreSQL, 8 listening `Locker`s in line (counted by a connection of the report's own that listens on every channel named in the line):\n").unwrap();
        for (s, w) in wakes {
            writeln!(m, "- {s}: {w:.2}").unwrap();
        }
    }
    print!("{m}");
    if let Some(out) = out {
        std::fs::write(out, m).unwrap();
    }
}
