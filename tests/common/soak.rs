//! The soak: P processes × N acquisitions of one key, each holder incrementing a racy counter
//! (read, then write the value + 1, in a file, outside any database transaction), so that two
//! holders at once lose an increment. Afterwards the counter must equal P × N, every token
//! must be unique, and the tokens taken in counter order must strictly increase.
//!
//! Written once for `tests/soak.rs` (a short run in the suite) and `examples/soak.rs` (the long
//! runs whose figures BENCHMARKS.md gives). Both re-run their own binary as the children; the
//! children connect with `diesel_lock::connect`, as a user of the crate would.
#![allow(dead_code)]

use diesel_lock::{Locker, Strategy};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One soak: a database, a strategy, how many processes and acquisitions each.
#[derive(Debug, Clone)]
pub struct Soak {
    /// What `diesel_lock::connect` takes.
    pub url: String,
    /// `row`, `lease`, `for-update` or `advisory`.
    pub strategy: String,
    pub processes: usize,
    pub acquisitions: usize,
}

/// What a soak measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub acquisitions: usize,
    pub elapsed: Duration,
    /// Acquisitions per second over the whole run (all processes started together).
    pub rate: f64,
    /// The longest run of consecutive acquisitions by one process (every process makes the
    /// same number, so fairness shows here: 1 is perfect alternation).
    pub longest_streak: usize,
}

pub fn strategy(name: &str) -> Strategy {
    match name {
        "row" => Strategy::Row { stale_after: None },
        "lease" => Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        "for-update" => Strategy::ForUpdate,
        "advisory" => Strategy::Advisory,
        // No lock at all (the check's own test): any strategy will do for the Locker.
        "none" => Strategy::Row { stale_after: None },
        other => panic!("unknown strategy {other}"),
    }
}

/// The child's side: `DLOCK_SOAK` holds `url \t strategy \t key \t dir \t n`. Prints `ready`
/// once connected, waits for a line on stdin, then acquires `n` times; writes one line per
/// acquisition (`counter_before token`) to `dir/pid`. Returns false if this process is not
/// a soak child.
pub fn child() -> bool {
    let Ok(spec) = std::env::var("DLOCK_SOAK") else {
        return false;
    };
    let p: Vec<&str> = spec.split('\t').collect();
    let (url, strategy_name, key, dir, n) = (p[0], p[1], p[2], Path::new(p[3]), p[4]);
    let n: usize = n.parse().unwrap();
    let locker = Locker::connect(url)
        .expect("connect")
        .strategy(strategy(strategy_name))
        .build()
        .expect("build");
    locker.migrate().expect("migrate");
    println!("ready");
    std::io::stdout().flush().unwrap();
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).unwrap();
    let counter = dir.join("counter");
    let mut log = String::new();
    let unlocked = strategy_name == "none";
    for i in 0..n {
        let guard = (!unlocked).then(|| locker.lock(key).expect("lock"));
        // The racy part: read, then write. Two holders at once lose an increment (and one
        // may read the file while the other rewrites it: empty, read as 0, which the check
        // reports as two holders seeing the same value).
        let seen: u64 = std::fs::read_to_string(&counter)
            .unwrap()
            .trim()
            .parse()
            .unwrap_or(0);
        if unlocked {
            std::thread::sleep(Duration::from_millis(1)); // widens the race it exists to show
        }
        std::fs::write(&counter, (seen + 1).to_string()).unwrap();
        let token = guard.as_ref().map_or(i as i64, |g| g.token());
        log.push_str(&format!("{seen} {token} {}\n", std::process::id()));
        if let Some(g) = guard {
            g.release().expect("release");
        }
    }
    std::fs::write(dir.join(std::process::id().to_string()), log).unwrap();
    true
}

/// The parent's side: starts `processes` children (`child_command` makes the command that
/// re-runs this binary as one; the spec is added here), lets them go together, waits, and
/// checks: `Err` says what broke (an increment lost, a token reused or out of order). A child
/// that fails or hangs panics here.
pub fn run(soak: &Soak, child_command: impl Fn() -> Command) -> Result<Outcome, String> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("counter"), "0").unwrap();
    let key = format!(
        "soak-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let spec = [
        soak.url.as_str(),
        &soak.strategy,
        &key,
        dir.path().to_str().unwrap(),
        &soak.acquisitions.to_string(),
    ]
    .join("\t");
    let mut children: Vec<_> = (0..soak.processes)
        .map(|_| {
            child_command()
                .env("DLOCK_SOAK", &spec)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn a soak child")
        })
        .collect();
    // Each child's stdout read on a thread of its own, so that a child that never gets
    // ready fails the soak instead of hanging it.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    for c in &mut children {
        let out = BufReader::new(c.stdout.take().unwrap());
        let tx = ready_tx.clone();
        std::thread::spawn(move || {
            // The test harness may print its own lines around ours.
            for line in out.lines().map_while(Result::ok) {
                if line.trim() == "ready" {
                    let _ = tx.send(());
                }
            }
        });
    }
    for _ in 0..soak.processes {
        if ready_rx.recv_timeout(Duration::from_secs(60)).is_err() {
            for c in &mut children {
                let _ = c.kill();
            }
            panic!("{soak:?}: a soak child was not ready after 60 s");
        }
    }
    let started = Instant::now();
    for c in &mut children {
        writeln!(c.stdin.as_mut().unwrap()).unwrap();
    }
    for mut c in children {
        let status = c.wait().unwrap();
        assert!(status.success(), "a soak child failed: {status}");
    }
    let elapsed = started.elapsed();
    check(dir.path(), soak, elapsed)
}

fn check(dir: &Path, soak: &Soak, elapsed: Duration) -> Result<Outcome, String> {
    let total = soak.processes * soak.acquisitions;
    let counter: usize = std::fs::read_to_string(dir.join("counter"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut records: Vec<(u64, i64, u32)> = Vec::with_capacity(total);
    for entry in std::fs::read_dir(dir).unwrap() {
        let path: PathBuf = entry.unwrap().path();
        if path.file_name().unwrap() == "counter" {
            continue;
        }
        for line in std::fs::read_to_string(&path).unwrap().lines() {
            let mut f = line.split(' ');
            let seen = f.next().unwrap().parse().unwrap();
            let token = f.next().unwrap().parse().unwrap();
            let pid = f.next().unwrap().parse().unwrap();
            records.push((seen, token, pid));
        }
    }
    if counter != total {
        return Err(format!(
            "{soak:?}: the racy counter ended at {counter}: {} increments were lost to \
             holders at once",
            total.saturating_sub(counter)
        ));
    }
    if records.len() != total {
        return Err(format!("{soak:?}: {} acquisitions recorded", records.len()));
    }
    records.sort_unstable();
    for w in records.windows(2) {
        if w[0].0 + 1 != w[1].0 {
            return Err(format!(
                "{soak:?}: two holders saw the counter at {}",
                w[0].0
            ));
        }
        if w[0].1 >= w[1].1 {
            return Err(format!(
                "{soak:?}: tokens went back: {} then {} (counter {} and {})",
                w[0].1, w[1].1, w[0].0, w[1].0
            ));
        }
    }
    let mut longest_streak = 0;
    let mut streak = 0;
    for (i, r) in records.iter().enumerate() {
        streak = if i > 0 && records[i - 1].2 == r.2 {
            streak + 1
        } else {
            1
        };
        longest_streak = longest_streak.max(streak);
    }
    Ok(Outcome {
        acquisitions: total,
        elapsed,
        rate: total as f64 / elapsed.as_secs_f64(),
        longest_streak,
    })
}
