//! Do semaphore permits and readers wait their turn across processes? Writes a table (to
//! stdout, or `--out FILE`), per backend × strategy × kind:
//!
//! - permits: 5 processes × 6 rounds of `permit(key, 2)`, each holding 100 ms, releasing
//!   and asking again at once;
//! - readers: 4 processes × 6 rounds of `read(key)` and one process × 6 rounds of
//!   `write(key)` on the same key, each holding 100 ms.
//!
//! Each process records, per acquisition, when it asked, when it got the key and when it
//! released (the system clock, shared by the processes). "Retook" counts acquisitions made
//! within 10 ms of the same process's own release while another process had been waiting
//! since before that release (it took the key ahead of someone who asked first); "longest"
//! is the longest wait of any acquisition, beside what first come, first served would give
//! (permits: each process waits for the (N − permits) / permits holds ahead of it; readers:
//! a reader waits at most for the writer's hold and a writer for one round of readers,
//! about 2 holds).
//!
//! ```text
//! eval "$(bash scripts/services.sh)"
//! cargo run --release --all-features --example fair_kinds -- [--out FILE]
//! ```

use diesel_lock::{AnyConnection, Locker, Strategy};
use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const HOLD: Duration = Duration::from_millis(100);
const ROUNDS: usize = 6;
const PERMIT_PROCS: usize = 5;
const PERMITS: u32 = 2;
const READERS: usize = 4;

fn strategy(name: &str) -> Strategy {
    match name {
        "lease" => Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        "for_update" => Strategy::ForUpdate,
        "advisory" => Strategy::Advisory,
        other => panic!("unknown strategy {other}"),
    }
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// One acquisition: process, asked, got, released (µs since the epoch), writer?
#[derive(Clone, Copy)]
struct Take {
    proc: usize,
    asked: i64,
    got: i64,
    released: i64,
}

/// `--child URL STRATEGY KIND KEY GO`: ROUNDS acquisitions, one line each.
fn child(url: &str, s: &str, kind: &str, key: &str, go: &str) {
    let l = Locker::connect(url)
        .unwrap()
        .strategy(strategy(s))
        .build()
        .unwrap();
    l.migrate().unwrap();
    let take = |l: &Locker<AnyConnection>| match kind {
        "permit" => l.permit(key, PERMITS).unwrap(),
        "read" => l.read(key).unwrap(),
        "write" => l.write(key).unwrap(),
        other => panic!("unknown kind {other}"),
    };
    // Warm up: a connection, the kind of the key.
    drop(take(&l));
    println!("READY");
    while !std::path::Path::new(go).exists() {
        std::thread::sleep(Duration::from_micros(200));
    }
    for _ in 0..ROUNDS {
        let asked = now_us();
        let g = take(&l);
        let got = now_us();
        std::thread::sleep(HOLD);
        g.release().unwrap();
        let released = now_us();
        println!("{asked} {got} {released}");
    }
}

/// Runs the processes (`kinds[i]` for process i) on a fresh key; every acquisition.
fn run(url: &str, s: &str, kinds: &[&str]) -> Vec<Take> {
    let dir = std::env::temp_dir().join(format!("fair-kinds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let go = dir.join("go");
    let _ = std::fs::remove_file(&go);
    let key = format!("fair-kinds-{}-{}", std::process::id(), now_us());
    let mut kids: Vec<_> = kinds
        .iter()
        .map(|k| {
            let mut c = Command::new(std::env::current_exe().unwrap())
                .args(["--child", url, s, k, &key, go.to_str().unwrap()])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let out = c.stdout.take().unwrap();
            let mut r = std::io::BufReader::new(out);
            let mut line = String::new();
            std::io::BufRead::read_line(&mut r, &mut line).unwrap();
            assert_eq!(line.trim(), "READY");
            (c, r)
        })
        .collect();
    std::fs::write(&go, b"").unwrap();
    let mut takes = Vec::new();
    for (proc, (c, r)) in kids.iter_mut().enumerate() {
        for _ in 0..ROUNDS {
            let mut line = String::new();
            std::io::BufRead::read_line(r, &mut line).unwrap();
            let v: Vec<i64> = line
                .split_whitespace()
                .map(|x| x.parse().unwrap())
                .collect();
            takes.push(Take {
                proc,
                asked: v[0],
                got: v[1],
                released: v[2],
            });
        }
        assert!(c.wait().unwrap().success());
    }
    let _ = std::fs::remove_dir_all(&dir);
    takes
}

/// (retook ahead of an earlier waiter within 10 ms, longest wait) over `takes`, counting
/// only waiters whose kind conflicts (`conflicts(a, b)`).
fn figures(takes: &[Take], conflicts: impl Fn(usize, usize) -> bool) -> (usize, Duration) {
    let mut retook = 0;
    for t in takes {
        // This process's previous release, just before it asked again.
        let Some(prev) = takes
            .iter()
            .filter(|p| p.proc == t.proc && p.released <= t.asked)
            .max_by_key(|p| p.released)
        else {
            continue;
        };
        if t.got - prev.released > 10_000 {
            continue;
        }
        // Someone else asked before that release and got the key only after this one.
        let overtaken = takes.iter().any(|o| {
            o.proc != t.proc
                && conflicts(t.proc, o.proc)
                && o.asked < prev.released
                && o.got > t.got
        });
        if overtaken {
            retook += 1;
        }
    }
    let longest = takes.iter().map(|t| t.got - t.asked).max().unwrap_or(0);
    (retook, Duration::from_micros(longest.max(0) as u64))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        child(&args[2], &args[3], &args[4], &args[5], &args[6]);
        return;
    }
    let out = args
        .iter()
        .position(|a| a == "--out")
        .map(|i| args[i + 1].clone());
    let mut backends: Vec<(&str, String)> = Vec::new();
    let sqlite = std::env::temp_dir().join(format!("fair-kinds-{}.db", std::process::id()));
    backends.push(("SQLite", sqlite.to_string_lossy().into_owned()));
    if let Ok(u) = std::env::var("DLOCK_TEST_PG_URL") {
        backends.push(("PostgreSQL", u));
    }
    if let Ok(u) = std::env::var("DLOCK_TEST_MYSQL_URL") {
        backends.push(("MariaDB", u));
    }
    let mut table = String::new();
    writeln!(
        table,
        "## Readers and permits waiting across processes\n\n\
         Produced by `cargo run --release --all-features --example fair_kinds -- --out \
         docs/fair_kinds.md`; the configuration a user gets from `Locker::connect(url)`. \
         Permits: {PERMIT_PROCS} processes × {ROUNDS} rounds of `permit(key, {PERMITS})`; readers: \
         {READERS} processes × {ROUNDS} rounds of `read(key)` beside one of `write(key)`; each \
         holds {} ms, releases and asks again at once. \"Retook\" counts acquisitions made \
         within 10 ms of the same process's release while a process that conflicts with it \
         had asked before that release and got the key later.\n",
        HOLD.as_millis()
    )
    .unwrap();
    writeln!(
        table,
        "| backend × strategy | kind | acquisitions | retook ahead of an earlier waiter (≤ 10 ms) | longest wait | first come, first served |"
    )
    .unwrap();
    writeln!(table, "|---|---|---:|---:|---:|---:|").unwrap();
    for (name, url) in &backends {
        let strategies: &[&str] = match *name {
            "SQLite" => &["lease"],
            "PostgreSQL" => &["lease", "for_update", "advisory"],
            _ => &["lease", "for_update"],
        };
        for s in strategies {
            // Permits.
            let kinds = vec!["permit"; PERMIT_PROCS];
            let takes = run(url, s, &kinds);
            let (retook, longest) = figures(&takes, |_, _| true);
            let fcfs = HOLD * (PERMIT_PROCS as u32 - PERMITS) / PERMITS;
            let line = format!(
                "| {name} {s} | permit(2), {PERMIT_PROCS} processes | {} | {retook} | {:.2} s | {:.2} s |",
                takes.len(),
                longest.as_secs_f64(),
                fcfs.as_secs_f64()
            );
            eprintln!("{line}");
            writeln!(table, "{line}").unwrap();
            // Readers beside a writer (Advisory on MariaDB has none; SQLite has Lease only).
            let mut kinds = vec!["read"; READERS];
            kinds.push("write");
            let takes = run(url, s, &kinds);
            // Readers do not conflict with readers: only the writer's overtaking counts.
            let writer = READERS;
            let (retook, longest) = figures(&takes, |a, b| a == writer || b == writer);
            let line = format!(
                "| {name} {s} | {READERS} readers + 1 writer | {} | {retook} | {:.2} s | {:.2} s |",
                takes.len(),
                longest.as_secs_f64(),
                (HOLD * 2).as_secs_f64()
            );
            eprintln!("{line}");
            writeln!(table, "{line}").unwrap();
        }
    }
    let _ = std::fs::remove_file(&sqlite);
    match out {
        Some(f) => std::fs::write(f, table).unwrap(),
        None => print!("{table}"),
    }
}
