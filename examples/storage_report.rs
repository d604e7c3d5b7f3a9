//! Storage that follows the keys held (migration 15, the token floor): N distinct keys each
//! locked and released once, then purged, per backend and strategy (`Row`, `Lease`). Prints
//! a Markdown table: rows left in every per-key `dlock_*` table, the tables' size (with
//! indexes), and the p50 of one acquire (of a new key) with 10³ keys' rows, with N, and after
//! the purge.
//!
//! It empties the lock tables of every URL it is given: give it scratch databases.
//!
//! ```text
//! cargo run --release --all-features --example storage_report -- 100000 \
//!     sqlite:///tmp/s.db postgres://…/scratch mysql://…/scratch
//! ```

use diesel::sql_types::BigInt;
use diesel::{QueryableByName, RunQueryDsl};
use diesel_lock::{AnyConnection, Backend, Locker, Strategy};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The tables that hold rows per key; `dlock_permit_slots` and `dlock_for_update` exist
/// on the server backends only.
const TABLES: [&str; 8] = [
    "dlock_rows",
    "dlock_tokens",
    "dlock_leases",
    "dlock_shared_keys",
    "dlock_shared_leases",
    "dlock_waiters",
    "dlock_permit_slots",
    "dlock_for_update",
];

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

fn one(l: &Locker<AnyConnection>, sql: &str) -> Option<i64> {
    diesel::sql_query(sql)
        .get_result::<N>(&mut *l.pool().get().unwrap())
        .ok()
        .map(|r| r.n)
}

fn tables(l: &Locker<AnyConnection>) -> Vec<&'static str> {
    TABLES
        .into_iter()
        .filter(|t| {
            l.backend() != Backend::Sqlite || !t.starts_with("dlock_p") && *t != "dlock_for_update"
        })
        .collect()
}

/// Rows of every per-key table, and their sum.
fn rows(l: &Locker<AnyConnection>) -> (i64, String) {
    let mut total = 0;
    let mut each = Vec::new();
    for t in tables(l) {
        let n = one(l, &format!("SELECT COUNT(*) AS n FROM {t}")).unwrap_or(0);
        total += n;
        if n > 0 {
            each.push(format!("{t} {n}"));
        }
    }
    (total, each.join(", "))
}

/// Bytes of the per-key tables with their indexes (SQLite: the whole file, less free pages).
fn size(l: &Locker<AnyConnection>) -> i64 {
    match l.backend() {
        Backend::Postgres => tables(l)
            .iter()
            .map(|t| {
                one(
                    l,
                    &format!("SELECT pg_total_relation_size('{t}')::int8 AS n"),
                )
                .unwrap_or(0)
            })
            .sum(),
        Backend::Mysql => {
            for t in tables(l) {
                let _ = diesel::sql_query(format!("ANALYZE TABLE {t}"))
                    .execute(&mut *l.pool().get().unwrap());
            }
            one(
                l,
                "SELECT CAST(COALESCE(SUM(data_length + index_length), 0) AS SIGNED) AS n \
                 FROM information_schema.TABLES WHERE table_schema = DATABASE() \
                 AND table_name IN ('dlock_rows', 'dlock_tokens', 'dlock_leases', \
                 'dlock_shared_keys', 'dlock_shared_leases', 'dlock_waiters', \
                 'dlock_permit_slots', 'dlock_for_update')",
            )
            .unwrap_or(0)
        }
        _ => {
            let _ = diesel::sql_query("PRAGMA wal_checkpoint(TRUNCATE)")
                .execute(&mut *l.pool().get().unwrap());
            let pages = one(l, "SELECT page_count AS n FROM pragma_page_count()").unwrap_or(0);
            let free =
                one(l, "SELECT freelist_count AS n FROM pragma_freelist_count()").unwrap_or(0);
            let page = one(l, "SELECT page_size AS n FROM pragma_page_size()").unwrap_or(0);
            (pages - free) * page
        }
    }
}

/// Locks and releases `n` new keys `{prefix}-{i}` on `threads` threads.
fn fill(l: &Locker<AnyConnection>, prefix: &str, n: u64, threads: u64) {
    let next = Arc::new(AtomicU64::new(0));
    std::thread::scope(|s| {
        for _ in 0..threads {
            let next = next.clone();
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                l.lock(&format!("{prefix}-{i}")).unwrap().release().unwrap();
            });
        }
    });
}

/// The p50 of `lock` on 1,000 new keys (each released after).
fn p50(l: &Locker<AnyConnection>, prefix: &str) -> Duration {
    let mut times: Vec<Duration> = (0..1000)
        .map(|i| {
            let start = Instant::now();
            let g = l.lock(&format!("{prefix}-{i}")).unwrap();
            let took = start.elapsed();
            g.release().unwrap();
            took
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn mb(bytes: i64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u64 = args.next().expect("N").parse().expect("N");
    let threads = 4;
    println!("| backend | strategy | keys | rows with 10³ keys | p50 at 10³ | rows / size with N | p50 at N | purge took, deleted | rows / size after | p50 after purge |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for url in args {
        for (name, strategy) in [
            ("Row", Strategy::Row { stale_after: None }),
            (
                "Lease",
                Strategy::Lease {
                    ttl: Duration::from_secs(30),
                },
            ),
        ] {
            let l = Locker::connect(&url)
                .unwrap()
                .pool_size(threads as u32 + 2)
                .strategy(strategy)
                .build()
                .unwrap();
            l.migrate().unwrap();
            for t in tables(&l) {
                diesel::sql_query(format!("DELETE FROM {t}"))
                    .execute(&mut *l.pool().get().unwrap())
                    .unwrap();
            }
            fill(&l, "small", 1000, threads);
            let (small_rows, _) = rows(&l);
            let before = p50(&l, "probe-a");
            let start = Instant::now();
            fill(&l, "big", n, threads);
            let filled = start.elapsed();
            let (big_rows, _) = rows(&l);
            let big_size = size(&l);
            let at_n = p50(&l, "probe-b");
            let start = Instant::now();
            let deleted = l.purge(Duration::ZERO).unwrap();
            let purged = start.elapsed();
            let held = l.lock("still-held").unwrap();
            let (left, which) = rows(&l);
            let left_size = size(&l);
            let after = p50(&l, "probe-c");
            drop(held);
            eprintln!(
                "{} {name}: {n} keys in {filled:.1?}; left: {which}",
                l.backend().name()
            );
            println!(
                "| {} | {name} | {n} | {small_rows} | {:.0} µs | {big_rows} / {} | {:.0} µs | {:.1?}, {deleted} | {left} (1 key held) / {} | {:.0} µs |",
                l.backend().name(),
                before.as_secs_f64() * 1e6,
                mb(big_size),
                at_n.as_secs_f64() * 1e6,
                purged,
                mb(left_size),
                after.as_secs_f64() * 1e6,
            );
        }
    }
}
