//! Contention: 1, 2, 8 and 32 threads on one key, and 8 threads on 8 distinct keys, for every
//! strategy × backend, in handoffs (acquisitions) per second. Threads share one `Locker`
//! (its in-process queue hands the lock over locally); with 8 threads the run is repeated
//! with a `Locker` and pool per thread, as separate processes would have them. Fairness
//! (per-thread min/max acquisitions) is printed beside each, as criterion cannot show it.
//!
//! ```text
//! eval "$(bash scripts/services.sh)"
//! cargo bench --all-features --bench contention
//! ```

mod support;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::time::Duration;
use support::{Sharing, Stop};

fn contention(c: &mut Criterion) {
    let runs: &[(usize, usize, Sharing)] = &[
        (1, 1, Sharing::OneLocker),
        (2, 1, Sharing::OneLocker),
        (8, 1, Sharing::OneLocker),
        (32, 1, Sharing::OneLocker),
        (8, 8, Sharing::OneLocker),
        (8, 1, Sharing::LockerPerThread),
    ];
    for db in support::backends() {
        let mut g = c.benchmark_group(format!("contention/{}", db.name()));
        g.throughput(Throughput::Elements(1))
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(2));
        for s in support::strategies(db) {
            for &(threads, keys, sharing) in runs {
                let lockers = support::lockers(db, s, threads, sharing);
                let keys: Vec<String> = (0..keys).map(|_| support::key("contention")).collect();
                let id = format!(
                    "{}/{threads}t-{}k-{}",
                    s.name(),
                    keys.len(),
                    match sharing {
                        Sharing::OneLocker => "shared",
                        Sharing::LockerPerThread => "per-thread",
                    }
                );
                let mut seen = Vec::new();
                g.bench_function(&id, |b| {
                    b.iter_custom(|iters| {
                        let r = support::contend(&lockers, &keys, Stop::After(iters));
                        let e = r.elapsed;
                        seen.push(r);
                        e
                    })
                });
                if let Some(r) = seen.iter().max_by_key(|r| r.total()) {
                    println!(
                        "{}/{id}: fairness (min/max acquisitions per thread) {:.2} over {} acquisitions",
                        db.name(),
                        r.fairness(),
                        r.total()
                    );
                }
            }
        }
        g.finish();
    }
}

criterion_group!(benches, contention);
criterion_main!(benches);
