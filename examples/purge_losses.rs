//! Readers beside a purge loop, and the purge's speed (PostgreSQL, MySQL/MariaDB).
//!
//! `losses SECONDS URL`: four keys, each with two live readers (ttl 2 s, renewed every
//! 500 ms) and new readers that come and go; a thread leaves dead readers on those keys
//! (rows aged two hours back) and another holds an expired reader row of a key after them
//! in an open transaction, 1.9 s at a time (a client stopped inside its transaction); a
//! purge runs in a loop. Prints how many times a live reader lost its lease.
//!
//! `speed N URL`: N expired reader rows (10 per key), then one purge, timed.
//!
//! It deletes every reader and permit row of the database it is given, and purges it with
//! no grace: give it a scratch database.
//!
//! ```text
//! cargo run --release --all-features --example purge_losses -- losses 60 mysql://…/scratch
//! cargo run --release --all-features --example purge_losses -- speed 20000 mysql://…/scratch
//! ```

use diesel::RunQueryDsl;
use diesel_lock::{AnyConnection, Backend, Locker, Strategy};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn locker(url: &str, ttl: Duration, heartbeat: Duration) -> Locker<AnyConnection> {
    let l = Locker::connect(url)
        .unwrap()
        .pool_size(32)
        .strategy(Strategy::Lease { ttl })
        .heartbeat(heartbeat)
        .build()
        .unwrap();
    l.migrate().unwrap();
    l
}

fn run(l: &Locker<AnyConnection>, sql: &str) {
    diesel::sql_query(sql)
        .execute(&mut *l.pool().get().unwrap())
        .unwrap();
}

/// Two hours back, as SQL.
fn two_hours_ago(l: &Locker<AnyConnection>) -> &'static str {
    match l.backend() {
        Backend::Postgres => "now() - interval '2 hours'",
        _ => "UTC_TIMESTAMP(6) - INTERVAL 2 HOUR",
    }
}

/// Ages the holder row of `key` with `token` (a dead reader's). Keys are the program's own.
/// An UPDATE that a purge made a deadlock victim leaves that reader live.
fn age(l: &Locker<AnyConnection>, key: &str, token: i64) {
    let t = two_hours_ago(l);
    let _ = diesel::sql_query(format!(
        "UPDATE dlock_shared_leases SET acquired_at = {t}, expires_at = {t} \
         WHERE lock_key = '{key}' AND token = {token}"
    ))
    .execute(&mut *l.pool().get().unwrap());
}

fn losses(seconds: u64, url: &str) {
    let short = locker(url, Duration::from_secs(2), Duration::from_millis(500));
    let other = locker(url, Duration::from_secs(30), Duration::from_secs(10));
    run(&other, "DELETE FROM dlock_shared_leases");
    let keys: Vec<String> = (0..4).map(|i| format!("purge-losses-a{i}")).collect();
    let last = "purge-losses-z".to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    let lost = Arc::new(AtomicUsize::new(0));
    let purges = Arc::new(AtomicUsize::new(0));
    let end = Instant::now() + Duration::from_secs(seconds);
    std::thread::scope(|s| {
        // Live readers: each counts its losses and takes the key again.
        for key in keys.iter().flat_map(|k| [k, k]) {
            let (short, lost, stop) = (&short, &lost, &stop);
            s.spawn(move || {
                let mut g = short.read(key).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    if g.wait_lost(Duration::from_millis(200)) {
                        lost.fetch_add(1, Ordering::Relaxed);
                        g = short.read(key).unwrap();
                    }
                }
            });
        }
        // New readers that come and go.
        for i in 0..3 {
            let (other, keys, stop) = (&other, &keys, &stop);
            s.spawn(move || {
                let mut n = i;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let key = &keys[n % keys.len()];
                    // A wait may find the pool empty (every connection waiting for a row):
                    // the next one tries again.
                    if let Ok(Some(g)) = other.try_read_for(key, Duration::from_millis(500)) {
                        let _ = g.release();
                    }
                }
            });
        }
        // Dead readers (their guards kept, so that no release deletes their rows).
        {
            let (other, keys, stop) = (&other, &keys, &stop);
            s.spawn(move || {
                let mut dead = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let key = &keys[n % keys.len()];
                    let g = other.read(key).unwrap();
                    age(other, key, g.token());
                    dead.push(g);
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
        }
        // An expired row of a later key, held 1.9 s at a time.
        {
            let (other, last, stop) = (&other, &last, &stop);
            s.spawn(move || {
                let now = match other.backend() {
                    Backend::Postgres => "now()",
                    _ => "UTC_TIMESTAMP(6)",
                };
                let mut dead = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let g = other.read(last).unwrap();
                    age(other, last, g.token());
                    dead.push(g);
                    let mut c = other.pool().get().unwrap();
                    if other.backend() == Backend::Mysql {
                        // READ COMMITTED, as a holder's transaction: no gap locks.
                        diesel::sql_query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                            .execute(&mut *c)
                            .unwrap();
                    }
                    diesel::sql_query("BEGIN").execute(&mut *c).unwrap();
                    diesel::sql_query(format!(
                        "SELECT 1 FROM dlock_shared_leases WHERE lock_key = '{last}' \
                         AND expires_at <= {now} FOR UPDATE"
                    ))
                    .execute(&mut *c)
                    .unwrap();
                    std::thread::sleep(Duration::from_millis(1900));
                    diesel::sql_query("ROLLBACK").execute(&mut *c).unwrap();
                }
            });
        }
        {
            let (other, purges, stop) = (&other, &purges, &stop);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    other.purge(Duration::ZERO).unwrap();
                    purges.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        while Instant::now() < end {
            std::thread::sleep(Duration::from_millis(100));
        }
        stop.store(true, Ordering::Relaxed);
    });
    println!(
        "{:?}, {seconds} s: 8 live readers lost their leases {} times, {} purges",
        short.backend(),
        lost.load(Ordering::Relaxed),
        purges.load(Ordering::Relaxed)
    );
}

fn speed(n: u64, url: &str) {
    let l = locker(url, Duration::from_secs(30), Duration::from_secs(10));
    run(&l, "DELETE FROM dlock_shared_leases");
    let t = two_hours_ago(&l);
    let numbers = match l.backend() {
        Backend::Postgres => format!("generate_series(0, {n} - 1) AS s(n)"),
        _ => "(SELECT a.d + 10 * b.d + 100 * c.d + 1000 * d.d + 10000 * e.d + 100000 * f.d AS n \
              FROM (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                    UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                    UNION ALL SELECT 8 UNION ALL SELECT 9) a \
              CROSS JOIN (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                    UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                    UNION ALL SELECT 8 UNION ALL SELECT 9) b \
              CROSS JOIN (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                    UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                    UNION ALL SELECT 8 UNION ALL SELECT 9) c \
              CROSS JOIN (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                    UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                    UNION ALL SELECT 8 UNION ALL SELECT 9) d \
              CROSS JOIN (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                    UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                    UNION ALL SELECT 8 UNION ALL SELECT 9) e \
              CROSS JOIN (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                    UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                    UNION ALL SELECT 8 UNION ALL SELECT 9) f) s"
            .to_owned(),
    };
    let concat = match l.backend() {
        Backend::Postgres => "'purge-speed-' || (s.n / 10), 'h' || s.n",
        _ => "CONCAT('purge-speed-', s.n DIV 10), CONCAT('h', s.n)",
    };
    run(
        &l,
        &format!(
            "INSERT INTO dlock_shared_leases \
                    (lock_key, holder_id, owner, mode, token, acquired_at, expires_at) \
             SELECT {concat}, 'purge-speed', 'read', s.n + 1, {t}, {t} FROM {numbers} \
             WHERE s.n < {n}"
        ),
    );
    let start = Instant::now();
    let purged = l.purge(Duration::from_secs(3600)).unwrap();
    println!(
        "{:?}: purge of {n} expired reader rows: {purged} rows in {:.3} s",
        l.backend(),
        start.elapsed().as_secs_f64()
    );
}

fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "purge_losses (losses SECONDS | speed N) URL";
    let (what, number, url) = (
        args.next().expect(usage),
        args.next().expect(usage).parse().expect(usage),
        args.next().expect(usage),
    );
    match what.as_str() {
        "losses" => losses(number, &url),
        "speed" => speed(number, &url),
        _ => panic!("{usage}"),
    }
}
