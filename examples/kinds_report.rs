//! The "Kinds of lock" section of `bench_report` alone (8 threads on one key, a `Locker`
//! and pool each, every acquisition held 1 ms), for a quicker before/after of one change:
//! acquisitions per second and overlap (the mean number of holders at once).
//!
//! ```text
//! eval "$(bash scripts/services.sh)"
//! cargo run --release --all-features --example kinds_report -- [--window-ms 3000] [--only read|permit|exclusive] [--solo]
//! ```

#[path = "../benches/support/mod.rs"]
mod support;

use std::time::Duration;
use support::kinds::{kinds, Kind};

fn main() {
    let mut window = Duration::from_millis(3000);
    let mut only: Option<String> = None;
    let mut solo = false;
    let mut waits = false;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--window-ms" => {
                window = Duration::from_millis(
                    it.next()
                        .and_then(|v| v.parse().ok())
                        .expect("--window-ms N"),
                )
            }
            "--only" => only = it.next(),
            "--solo" => solo = true,
            "--waits" => waits = true,
            other => {
                panic!("unknown argument {other:?} (--window-ms N, --only KIND, --solo, --waits)")
            }
        }
    }
    let wanted = |k: Kind| {
        matches!(
            (only.as_deref(), k),
            (None, _)
                | (Some("exclusive"), Kind::Exclusive)
                | (Some("read"), Kind::Read)
                | (Some("permit"), Kind::Permits(_))
        )
    };
    println!("| backend | strategy | kind | acquisitions/s | overlap |\n|---|---|---|---:|---:|");
    for db in support::backends() {
        for (strategy, offered) in support::kinds::strategies(db) {
            for kind in offered.into_iter().filter(|&k| wanted(k)) {
                let (rate, overlap) = if solo {
                    alone(db, strategy, kind, window)
                } else if waits {
                    with_waits(db, strategy, kind, window)
                } else {
                    kinds(db, strategy, kind, window)
                };
                println!(
                    "| {} | {} | {} | {rate:.0} | {overlap:.2} |",
                    db.name(),
                    strategy.name(),
                    kind.name()
                );
            }
        }
    }
}

/// One thread alone on the key, holding nothing in between (`--solo`): what one
/// acquisition and release cost without contention.
fn alone(
    db: support::Db,
    strategy: diesel_lock::Strategy,
    kind: Kind,
    window: Duration,
) -> (f64, f64) {
    let l = support::locker(db, strategy, 2);
    let key = support::key("kinds-solo");
    let t0 = std::time::Instant::now();
    let mut n = 0u64;
    while t0.elapsed() < window {
        let release = match kind {
            Kind::Exclusive => l.acquire(&key),
            Kind::Read => l.acquire_read(&key),
            Kind::Permits(p) => l.acquire_permit(&key, p),
        };
        release();
        n += 1;
    }
    (n as f64 / t0.elapsed().as_secs_f64(), 0.0)
}

/// As `kinds`, printing the distribution of the waits (ask to acquisition) to stderr.
fn with_waits(
    db: support::Db,
    strategy: diesel_lock::Strategy,
    kind: Kind,
    window: Duration,
) -> (f64, f64) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Barrier};
    use std::time::Instant;
    let lockers: Vec<_> = (0..8).map(|_| support::locker(db, strategy, 2)).collect();
    let key = support::key("kinds-waits");
    let (start, done) = (Arc::new(Barrier::new(9)), Arc::new(AtomicBool::new(false)));
    let handles: Vec<_> = lockers
        .into_iter()
        .map(|l| {
            let (key, start, done) = (key.clone(), start.clone(), done.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut waits = Vec::new();
                let mut held = Duration::ZERO;
                while !done.load(Ordering::Relaxed) {
                    let asked = Instant::now();
                    let release = match kind {
                        Kind::Exclusive => l.acquire(&key),
                        Kind::Read => l.acquire_read(&key),
                        Kind::Permits(p) => l.acquire_permit(&key, p),
                    };
                    let t = Instant::now();
                    waits.push(t - asked);
                    std::thread::sleep(Duration::from_millis(1));
                    held += t.elapsed();
                    release();
                }
                (waits, held)
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    std::thread::sleep(window); // the measurement window, not synchronisation
    done.store(true, Ordering::Relaxed);
    let mut waits = Vec::new();
    let mut held = Duration::ZERO;
    for h in handles {
        let (w, d) = h.join().unwrap();
        waits.extend(w);
        held += d;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    waits.sort();
    let at = |q: f64| waits[((waits.len() - 1) as f64 * q) as usize];
    eprintln!(
        "{} {} {}: waits p50 {:?} p90 {:?} max {:?}",
        db.name(),
        strategy.name(),
        kind.name(),
        at(0.5),
        at(0.9),
        at(1.0)
    );
    (waits.len() as f64 / elapsed, held.as_secs_f64() / elapsed)
}
